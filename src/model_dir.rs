//! Model folder resolution.
//!
//! This module owns [`ModelDir`]: turning the `-m/--model` argument into a folder with a
//! `config.json` and its safetensors weight files. The argument is either an existing folder or
//! a Hugging Face repo id (`org/name`) looked up offline in the local Hub cache
//! (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`), at `models--org--name/snapshots/<rev>/` with `<rev>` from
//! `refs/main` when present, else the only / most recently modified snapshot. Nothing is
//! downloaded.
//!
//! A GGUF model is accepted too: `-m PATH.gguf`, the first part of a split GGUF
//! (`*-00001-of-0000N.gguf`), or a folder without `config.json` holding one GGUF model.
//! Its [`ModelDir`] has `root` = `config` = the (first) `.gguf` file and `weights` = its
//! parts; [`ModelDir::read_config`] builds `config.json` from the GGUF metadata.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Errors from resolving a model folder. Each names the path involved.
#[derive(Debug, thiserror::Error)]
pub enum ModelDirError {
    #[error(
        "model {arg:?} not found: tried {}; pass an existing model folder, or download the model \
         into the Hugging Face cache first (e.g. `huggingface-cli download {arg}`)",
        tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    NotFound { arg: String, tried: Vec<PathBuf> },
    #[error("{} is not a folder or a .gguf file; -m/--model takes a model folder, a GGUF file or an org/name repo id", .0.display())]
    NotADirectory(PathBuf),
    #[error(
        "{} has no snapshots (no folder under {}); the download is incomplete: download the model again",
        repo.display(), repo.join("snapshots").display()
    )]
    NoSnapshot { repo: PathBuf },
    #[error("{} not found: a model folder needs its config.json", .0.display())]
    MissingConfig(PathBuf),
    #[error(
        "no weights in {}: expected model.safetensors, model.safetensors.index.json or *.safetensors \
         (use --load-format dummy to run without weights)",
        .0.display()
    )]
    NoWeights(PathBuf),
    #[error("{} lists weight file {file:?}, but {} does not exist; the download is incomplete", index.display(), missing.display())]
    IndexMissingFile {
        index: PathBuf,
        file: String,
        missing: PathBuf,
    },
    #[error("{} is not a valid safetensors index: {message}", .0.display(), message = .1)]
    BadIndex(PathBuf, String),
    #[error("{} holds {n} GGUF models ({names}); pass one of them with -m", dir.display())]
    SeveralGguf {
        dir: PathBuf,
        n: usize,
        names: String,
    },
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A resolved model folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDir {
    /// The folder itself.
    pub root: PathBuf,
    /// `root/config.json`.
    pub config: PathBuf,
    /// Weight files, sorted: `model.safetensors`, or the distinct files of the index's
    /// `weight_map`, or (no index) `model*.safetensors` / `*.safetensors`. Empty for
    /// [`ModelDir::resolve_config_only`].
    pub weights: Vec<PathBuf>,
    /// `root/model.safetensors.index.json`, when present.
    pub index: Option<PathBuf>,
}

const CONFIG_FILE: &str = "config.json";
const SINGLE_WEIGHTS: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

impl ModelDir {
    /// Resolves `-m/--model`: an existing folder, else an `org/name` repo id in the local
    /// Hugging Face cache. Requires `config.json` and weights.
    pub fn resolve(arg: &str) -> Result<ModelDir, ModelDirError> {
        Self::open(&find_root(arg, hub_cache_dir().as_deref())?)
    }

    /// Like [`resolve`](Self::resolve), but weights are not required (`--load-format dummy`):
    /// `weights` is empty and `index` is `None`.
    pub fn resolve_config_only(arg: &str) -> Result<ModelDir, ModelDirError> {
        Self::open_config_only(&find_root(arg, hub_cache_dir().as_deref())?)
    }

    /// Opens a model folder: checks `config.json` and lists the weight files.
    pub fn open(dir: &Path) -> Result<ModelDir, ModelDirError> {
        let mut md = Self::open_config_only(dir)?;
        if md.is_gguf() {
            return Ok(md);
        }
        let (weights, index) = list_weights(&md.root)?;
        md.weights = weights;
        md.index = index;
        Ok(md)
    }

    /// Opens a model folder requiring only `config.json` (a GGUF model: its parts).
    pub fn open_config_only(dir: &Path) -> Result<ModelDir, ModelDirError> {
        if let Some(first) = gguf_first_part(dir)? {
            let weights = crate::gguf::split_parts(&first)?;
            return Ok(ModelDir {
                root: first.clone(),
                config: first,
                weights,
                index: None,
            });
        }
        if !dir.is_dir() {
            return Err(if dir.exists() {
                ModelDirError::NotADirectory(dir.to_path_buf())
            } else {
                ModelDirError::NotFound {
                    arg: dir.display().to_string(),
                    tried: vec![dir.to_path_buf()],
                }
            });
        }
        let config = dir.join(CONFIG_FILE);
        if !config.is_file() {
            return Err(ModelDirError::MissingConfig(config));
        }
        Ok(ModelDir {
            root: dir.to_path_buf(),
            config,
            weights: Vec::new(),
            index: None,
        })
    }

    /// Whether this is a GGUF model (see the module docs).
    pub fn is_gguf(&self) -> bool {
        crate::gguf::is_gguf(&self.config) && self.config.is_file()
    }

    /// Reads and parses `config.json` (a GGUF model: made from its metadata).
    pub fn read_config(&self) -> Result<serde_json::Value, ModelDirError> {
        if self.is_gguf() {
            return Ok(crate::gguf::GgufModel::open(&self.config)?.config_json()?);
        }
        let text = std::fs::read_to_string(&self.config).map_err(|source| ModelDirError::Io {
            path: self.config.clone(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| ModelDirError::Io {
            path: self.config.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })
    }
}

/// The Hub cache folder from the environment (see the module docs for the order).
pub fn hub_cache_dir() -> Option<PathBuf> {
    hub_cache_from(
        std::env::var_os("HF_HUB_CACHE"),
        std::env::var_os("HF_HOME"),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    )
}

fn non_empty(v: Option<OsString>) -> Option<PathBuf> {
    v.filter(|s| !s.is_empty()).map(PathBuf::from)
}

fn hub_cache_from(
    hf_hub_cache: Option<OsString>,
    hf_home: Option<OsString>,
    xdg_cache_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    non_empty(hf_hub_cache)
        .or_else(|| non_empty(hf_home).map(|h| h.join("hub")))
        .or_else(|| non_empty(xdg_cache_home).map(|x| x.join("huggingface").join("hub")))
        .or_else(|| non_empty(home).map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// A repo id usable as a cache key: `name` or `org/name`, no empty parts, no `..`.
fn is_repo_id(arg: &str) -> bool {
    let parts: Vec<&str> = arg.split('/').collect();
    !arg.is_empty()
        && parts.len() <= 2
        && parts
            .iter()
            .all(|p| !p.is_empty() && *p != "." && *p != ".." && !p.contains('\\'))
}

/// The GGUF file to open for `path`: itself if it is a `.gguf` file, or the one GGUF model
/// (single file or first part of a split one) of a folder without `config.json`.
fn gguf_first_part(path: &Path) -> Result<Option<PathBuf>, ModelDirError> {
    if path.is_file() && crate::gguf::is_gguf(path) {
        return Ok(Some(path.to_path_buf()));
    }
    if !path.is_dir() || path.join(CONFIG_FILE).is_file() {
        return Ok(None);
    }
    let entries = std::fs::read_dir(path).map_err(|source| ModelDirError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut firsts: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && crate::gguf::is_gguf(p))
        .filter(|p| {
            // parts after the first of a split model are opened through the first
            let n = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            !n.contains("-of-") || n.contains("-00001-of-")
        })
        .collect();
    firsts.sort();
    match firsts.len() {
        0 => Ok(None),
        1 => Ok(firsts.pop()),
        n => Err(ModelDirError::SeveralGguf {
            dir: path.to_path_buf(),
            n,
            names: firsts
                .iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

fn find_root(arg: &str, cache: Option<&Path>) -> Result<PathBuf, ModelDirError> {
    let direct = PathBuf::from(arg);
    if direct.exists() {
        return if direct.is_dir() || crate::gguf::is_gguf(&direct) {
            Ok(direct)
        } else {
            Err(ModelDirError::NotADirectory(direct))
        };
    }
    let mut tried = vec![direct];
    if let (true, Some(cache)) = (is_repo_id(arg), cache) {
        let repo = cache.join(format!("models--{}", arg.replace('/', "--")));
        if repo.is_dir() {
            return snapshot_of(&repo);
        }
        tried.push(repo);
    }
    Err(ModelDirError::NotFound {
        arg: arg.to_string(),
        tried,
    })
}

/// The snapshot folder of a cached repo: `refs/main`'s revision if it exists, else the only or
/// newest snapshot.
fn snapshot_of(repo: &Path) -> Result<PathBuf, ModelDirError> {
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs").join("main")) {
        let rev = rev.trim();
        if !rev.is_empty() && !rev.contains('/') {
            let dir = snapshots.join(rev);
            if dir.is_dir() {
                return Ok(dir);
            }
            tracing::warn!(
                "{} names revision {rev}, but {} does not exist; using the newest snapshot",
                repo.join("refs/main").display(),
                dir.display()
            );
        }
    }
    let entries = match std::fs::read_dir(&snapshots) {
        Ok(e) => e,
        Err(_) => {
            return Err(ModelDirError::NoSnapshot {
                repo: repo.to_path_buf(),
            })
        }
    };
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        let mtime = entry
            .metadata()
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        let newer = match &best {
            None => true,
            Some((t, p)) => (mtime, &path) > (*t, p),
        };
        if newer {
            best = Some((mtime, path));
        }
    }
    best.map(|(_, p)| p)
        .ok_or_else(|| ModelDirError::NoSnapshot {
            repo: repo.to_path_buf(),
        })
}

fn list_weights(root: &Path) -> Result<(Vec<PathBuf>, Option<PathBuf>), ModelDirError> {
    let index = root.join(INDEX_FILE);
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|source| ModelDirError::Io {
            path: index.clone(),
            source,
        })?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelDirError::BadIndex(index.clone(), e.to_string()))?;
        let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
            return Err(ModelDirError::BadIndex(
                index,
                "missing `weight_map` object".into(),
            ));
        };
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(ModelDirError::BadIndex(
                    index,
                    format!("weight_map[{tensor:?}] is not a file name"),
                ));
            };
            files.insert(file.to_string());
        }
        if files.is_empty() {
            return Err(ModelDirError::BadIndex(
                index,
                "`weight_map` is empty".into(),
            ));
        }
        let mut weights = Vec::with_capacity(files.len());
        for file in files {
            let path = root.join(&file);
            if file.contains("..") || !path.is_file() {
                return Err(ModelDirError::IndexMissingFile {
                    index,
                    file,
                    missing: path,
                });
            }
            weights.push(path);
        }
        return Ok((weights, Some(index)));
    }
    let single = root.join(SINGLE_WEIGHTS);
    if single.is_file() {
        return Ok((vec![single], None));
    }
    let entries = std::fs::read_dir(root).map_err(|source| ModelDirError::Io {
        path: root.to_path_buf(),
        source,
    })?;
    let mut all: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    all.sort();
    let model: Vec<PathBuf> = all
        .iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model"))
        })
        .cloned()
        .collect();
    let weights = if model.is_empty() { all } else { model };
    if weights.is_empty() {
        return Err(ModelDirError::NoWeights(root.to_path_buf()));
    }
    Ok((weights, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    /// A fresh empty folder under the system temp dir, removed when the guard drops.
    fn temp_dir(tag: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("mlxcel-md-test-{tag}-"))
            .tempdir()
            .unwrap()
    }

    fn touch(p: &Path, content: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }

    #[test]
    fn single_file_folder() {
        let tmp_d = temp_dir("single");
        let d = tmp_d.path();
        touch(&d.join("config.json"), "{}");
        touch(&d.join("model.safetensors"), "");
        let md = ModelDir::resolve(d.to_str().unwrap()).unwrap();
        assert_eq!(md.root, d);
        assert_eq!(md.config, d.join("config.json"));
        assert_eq!(md.weights, vec![d.join("model.safetensors")]);
        assert_eq!(md.index, None);
        assert_eq!(md.read_config().unwrap(), serde_json::json!({}));
    }

    #[test]
    fn sharded_index() {
        let tmp_d = temp_dir("sharded");
        let d = tmp_d.path();
        touch(&d.join("config.json"), "{}");
        touch(&d.join("model-00002-of-00002.safetensors"), "");
        touch(&d.join("model-00001-of-00002.safetensors"), "");
        touch(&d.join("consolidated.safetensors"), "");
        touch(
            &d.join(INDEX_FILE),
            r#"{"metadata": {}, "weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}"#,
        );
        let md = ModelDir::open(d).unwrap();
        assert_eq!(
            md.weights,
            vec![
                d.join("model-00001-of-00002.safetensors"),
                d.join("model-00002-of-00002.safetensors")
            ]
        );
        assert_eq!(md.index, Some(d.join(INDEX_FILE)));

        std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap();
        let err = ModelDir::open(d).unwrap_err();
        assert!(matches!(err, ModelDirError::IndexMissingFile { .. }));
        let msg = err.to_string();
        assert!(
            msg.contains("model-00002-of-00002.safetensors") && msg.contains(INDEX_FILE),
            "{msg}"
        );

        touch(&d.join(INDEX_FILE), "{");
        assert!(matches!(
            ModelDir::open(d),
            Err(ModelDirError::BadIndex(..))
        ));
        touch(
            &d.join(INDEX_FILE),
            r#"{"weight_map": {"a": "../x.safetensors"}}"#,
        );
        assert!(matches!(
            ModelDir::open(d),
            Err(ModelDirError::IndexMissingFile { .. })
        ));
    }

    #[test]
    fn glob_fallback_and_missing() {
        let tmp_d = temp_dir("glob");
        let d = tmp_d.path();
        touch(&d.join("config.json"), "{}");
        let err = ModelDir::open(d).unwrap_err();
        assert!(matches!(err, ModelDirError::NoWeights(_)));
        assert!(err.to_string().contains(&d.display().to_string()));
        // config-only works without weights
        let md = ModelDir::resolve_config_only(d.to_str().unwrap()).unwrap();
        assert!(md.weights.is_empty() && md.index.is_none());

        touch(&d.join("weights.safetensors"), "");
        assert_eq!(
            ModelDir::open(d).unwrap().weights,
            vec![d.join("weights.safetensors")]
        );
        touch(&d.join("model-b.safetensors"), "");
        touch(&d.join("model-a.safetensors"), "");
        assert_eq!(
            ModelDir::open(d).unwrap().weights,
            vec![d.join("model-a.safetensors"), d.join("model-b.safetensors")]
        );

        let tmp_e = temp_dir("noconfig");
        let e = tmp_e.path();
        touch(&e.join("model.safetensors"), "");
        let err = ModelDir::open(e).unwrap_err();
        assert!(matches!(err, ModelDirError::MissingConfig(_)));
        assert!(err
            .to_string()
            .contains(&e.join("config.json").display().to_string()));
        assert!(matches!(
            ModelDir::resolve_config_only(e.to_str().unwrap()),
            Err(ModelDirError::MissingConfig(_))
        ));

        let f = e.join("model.safetensors");
        assert!(matches!(
            ModelDir::resolve(f.to_str().unwrap()),
            Err(ModelDirError::NotADirectory(_))
        ));
    }

    #[test]
    fn hub_cache_env_order() {
        let s = |x: &str| Some(OsString::from(x));
        assert_eq!(
            hub_cache_from(s("/c"), s("/h"), s("/x"), s("/home")),
            Some("/c".into())
        );
        assert_eq!(
            hub_cache_from(s(""), s("/h"), s("/x"), s("/home")),
            Some("/h/hub".into())
        );
        assert_eq!(
            hub_cache_from(None, None, s("/x"), s("/home")),
            Some("/x/huggingface/hub".into())
        );
        assert_eq!(
            hub_cache_from(None, None, None, s("/home")),
            Some("/home/.cache/huggingface/hub".into())
        );
        assert_eq!(hub_cache_from(None, None, None, None), None);
    }

    #[test]
    fn hf_cache_lookup() {
        let tmp_cache = temp_dir("hub");
        let cache = tmp_cache.path();
        let repo = cache.join("models--org--name");
        let old = repo.join("snapshots").join("aaa");
        let new = repo.join("snapshots").join("bbb");
        touch(&old.join("config.json"), "{}");
        touch(&old.join("model.safetensors"), "");
        touch(&new.join("config.json"), "{}");
        touch(&new.join("model.safetensors"), "");
        // no refs/main: only/newest snapshot (equal mtimes are broken by name)
        let root = find_root("org/name", Some(cache)).unwrap();
        assert!(root == new || root == old);
        // refs/main wins
        touch(&repo.join("refs").join("main"), "aaa\n");
        assert_eq!(find_root("org/name", Some(cache)).unwrap(), old);
        assert_eq!(
            ModelDir::open(&old).unwrap().weights,
            vec![old.join("model.safetensors")]
        );
        // refs/main naming a missing snapshot falls back
        touch(&repo.join("refs").join("main"), "zzz");
        assert!(find_root("org/name", Some(cache)).is_ok());

        // not cached: the error names what was tried, incl. the cache path
        let err = find_root("org/other", Some(cache)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("org/other"), "{msg}");
        assert!(
            msg.contains(&cache.join("models--org--other").display().to_string()),
            "{msg}"
        );

        // repo folder without snapshots
        std::fs::create_dir_all(cache.join("models--org--empty")).unwrap();
        assert!(matches!(
            find_root("org/empty", Some(cache)),
            Err(ModelDirError::NoSnapshot { .. })
        ));

        // not a repo id: only the path was tried
        match find_root("a/b/c", Some(cache)).unwrap_err() {
            ModelDirError::NotFound { tried, .. } => {
                assert_eq!(tried, vec![PathBuf::from("a/b/c")])
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn fixture_folders() {
        let base = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures"));
        for name in ["llama3", "llama_gqa2_tied", "mistral", "qwen2", "qwen3"] {
            let d = base.join(name);
            let md = ModelDir::resolve(d.to_str().unwrap()).unwrap();
            assert_eq!(md.weights, vec![d.join("model.safetensors")], "{name}");
            assert_eq!(md.index, None);
            assert!(md.read_config().unwrap().get("model_type").is_some());
        }
        let d = base.join("llama_q4");
        let md = ModelDir::open(&d).unwrap();
        assert_eq!(md.weights, vec![d.join("model.safetensors")]);
        assert_eq!(md.index, Some(d.join(INDEX_FILE)));
    }
}
