//! Finds or fetches the pinned MLX C++ library; never builds it from source.
//!
//! Search order:
//! 1. `MLX_DIR`: a folder with `include/mlx/mlx.h` and `lib/libmlx.{so,dylib}`.
//! 2. An installed `mlx` Python package (`$MLXCEL_PYTHON` or `python3`), e.g. a
//!    venv with `mlx[cuda13]`, `mlx-cpu`, or `mlx` on macOS.
//! 3. The pinned wheel of the chosen backend, fetched with pip into a per-user
//!    cache and checked against `third_party/mlx-wheels.sha256`:
//!    `mlx-cpu` (Linux default), `mlx-metal` (macOS default), or, with
//!    `MLXCEL_MLX_BACKEND=cuda13|cuda12` (or the cargo feature of that name),
//!    `mlx-cuda-13`/`mlx-cuda-12` installed *with* its NVIDIA dependencies into
//!    a `pip install --target` prefix (the CUDA wheel does not work alone).
//!
//! A found MLX whose version differs from the pin is refused. Dependents get
//! `DEP_MLX_INCLUDE`, `DEP_MLX_LIBDIR`, `DEP_MLX_BACKEND` and `DEP_MLX_VERSION`.
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_VERSION: &str = "0.32.4";

struct Found {
    include: PathBuf,
    lib: PathBuf,
    backend: String,
    how: String,
}

fn main() {
    for var in [
        "MLX_DIR",
        "MLXCEL_MLX_BACKEND",
        "MLXCEL_MLX_CACHE",
        "MLXCEL_PYTHON",
        "MLXCEL_MLX_FETCH",
        "XDG_CACHE_HOME",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let pins = Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap())
        .join("../third_party/mlx-wheels.sha256");
    println!("cargo:rerun-if-changed={}", pins.display());
    println!("cargo:rerun-if-changed=build.rs");

    let found = match find(&pins) {
        Ok(f) => f,
        Err(msg) => fail(&msg),
    };
    match read_version(&found.include) {
        Ok(v) if v == MLX_VERSION => {}
        Ok(v) => fail(&format!(
            "found MLX {v} at {} ({}), but mlxcel pins MLX {MLX_VERSION}: install mlx {MLX_VERSION}, \
             point MLX_DIR at an MLX {MLX_VERSION} install, or set MLXCEL_MLX_FETCH=1 to fetch the pinned wheel",
            found.lib.display(),
            found.how
        )),
        Err(e) => fail(&e),
    }
    println!("cargo:rustc-link-search=native={}", found.lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:include={}", found.include.display());
    println!("cargo:libdir={}", found.lib.display());
    println!("cargo:backend={}", found.backend);
    println!("cargo:version={MLX_VERSION}");
}

fn fail(msg: &str) -> ! {
    eprintln!("error: mlx-sys: {msg}");
    println!("cargo::error=mlx-sys: {msg}");
    std::process::exit(1);
}

fn lib_name() -> &'static str {
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        "libmlx.dylib"
    } else {
        "libmlx.so"
    }
}

/// The backend asked for, if any: env var first, then cargo features.
fn requested_backend() -> Option<String> {
    if let Ok(b) = env::var("MLXCEL_MLX_BACKEND") {
        if !b.is_empty() {
            return Some(b);
        }
    }
    if env::var("CARGO_FEATURE_CUDA13").is_ok() {
        return Some("cuda13".into());
    }
    if env::var("CARGO_FEATURE_CUDA12").is_ok() {
        return Some("cuda12".into());
    }
    None
}

fn default_backend() -> String {
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        "metal".into()
    } else {
        "cpu".into()
    }
}

fn is_mlx_root(dir: &Path) -> bool {
    dir.join("include/mlx/mlx.h").is_file() && dir.join("lib").join(lib_name()).is_file()
}

fn find(pins: &Path) -> Result<Found, String> {
    let requested = requested_backend();
    if let Some(b) = &requested {
        if !["cpu", "metal", "cuda13", "cuda12"].contains(&b.as_str()) {
            return Err(format!(
                "MLXCEL_MLX_BACKEND={b} is not one of cpu, metal, cuda13, cuda12"
            ));
        }
    }
    // 1. MLX_DIR
    if let Ok(dir) = env::var("MLX_DIR") {
        let dir = PathBuf::from(dir);
        if !is_mlx_root(&dir) {
            return Err(format!(
                "MLX_DIR={} has no include/mlx/mlx.h and lib/{}: point it at an MLX {MLX_VERSION} install",
                dir.display(),
                lib_name()
            ));
        }
        return Ok(Found {
            include: dir.join("include"),
            lib: dir.join("lib"),
            backend: requested.unwrap_or_else(|| "unknown".into()),
            how: "MLX_DIR".into(),
        });
    }
    let python = env::var("MLXCEL_PYTHON").unwrap_or_else(|_| "python3".into());
    let fetch_only = env::var("MLXCEL_MLX_FETCH")
        .map(|v| v == "1")
        .unwrap_or(false);
    // 2. an installed Python package
    if !fetch_only {
        if let Some(found) = find_python_package(&python, requested.as_deref()) {
            return Ok(found);
        }
    }
    // 3. fetch the pinned wheel
    let backend = requested.unwrap_or_else(default_backend);
    fetch(&python, &backend, pins)
}

fn find_python_package(python: &str, requested: Option<&str>) -> Option<Found> {
    let out = Command::new(python)
        .args([
            "-c",
            "import importlib.util as u\ns=u.find_spec('mlx')\nprint('\\n'.join(s.submodule_search_locations or []) if s else '')",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let dir = PathBuf::from(line.trim());
        if !is_mlx_root(&dir) {
            continue;
        }
        let backend = detect_wheel_backend(dir.parent()?);
        if let Some(req) = requested {
            if backend != req {
                continue;
            }
        }
        return Some(Found {
            include: dir.join("include"),
            lib: dir.join("lib"),
            backend,
            how: format!("Python package at {}", dir.display()),
        });
    }
    None
}

/// Which MLX wheel a site-packages folder holds, from its dist-info folders.
fn detect_wheel_backend(site: &Path) -> String {
    let Ok(entries) = fs::read_dir(site) else {
        return "unknown".into();
    };
    let names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let has = |prefix: &str| {
        names
            .iter()
            .any(|n| n.starts_with(prefix) && n.ends_with(".dist-info"))
    };
    if has("mlx_cuda_13") {
        "cuda13".into()
    } else if has("mlx_cuda_12") {
        "cuda12".into()
    } else if has("mlx_cpu") {
        "cpu".into()
    } else if has("mlx_metal") || env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        "metal".into()
    } else {
        "unknown".into()
    }
}

fn cache_root() -> Result<PathBuf, String> {
    if let Ok(d) = env::var("MLXCEL_MLX_CACHE") {
        return Ok(PathBuf::from(d));
    }
    if let Ok(d) = env::var("XDG_CACHE_HOME") {
        if !d.is_empty() {
            return Ok(PathBuf::from(d).join("mlxcel"));
        }
    }
    match env::var("HOME") {
        Ok(h) => Ok(PathBuf::from(h).join(".cache/mlxcel")),
        Err(_) => {
            Err("no HOME, XDG_CACHE_HOME or MLXCEL_MLX_CACHE to cache the MLX wheel in".into())
        }
    }
}

fn run(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd.output().map_err(|e| {
        format!(
            "could not run {what} ({e}): install Python 3 with pip (the build fetches the pinned MLX wheel with it), \
             or set MLX_DIR to an MLX {MLX_VERSION} install"
        )
    })?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn fetch(python: &str, backend: &str, pins: &Path) -> Result<Found, String> {
    let package = match backend {
        "cpu" => "mlx-cpu",
        "metal" => "mlx-metal",
        "cuda13" => "mlx-cuda-13",
        "cuda12" => "mlx-cuda-12",
        other => return Err(format!("unknown MLX backend {other}")),
    };
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let dir = cache_root()?.join(format!("mlx-{MLX_VERSION}-{backend}-{os}-{arch}"));
    let root = dir.join("mlx");
    if dir.join(".complete").is_file() && is_mlx_root(&root) {
        return Ok(Found {
            include: root.join("include"),
            lib: root.join("lib"),
            backend: backend.into(),
            how: format!("cached wheel in {}", dir.display()),
        });
    }
    let tmp = dir.with_extension(format!("tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let wheels = tmp.join("wheel");
    let site = tmp.join("site");
    fs::create_dir_all(&wheels).map_err(|e| format!("cannot create {}: {e}", wheels.display()))?;
    let spec = format!("{package}=={MLX_VERSION}");
    run(
        Command::new(python)
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
            .arg(&spec),
        &format!("{python} -m pip download {spec}"),
    )?;
    let wheel = fs::read_dir(&wheels)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip download {spec} produced no wheel"))?;
    let file_name = wheel.file_name().unwrap().to_string_lossy().into_owned();
    let sum = run(
        Command::new(python).args([
            "-c",
            "import hashlib,sys\nh=hashlib.sha256()\nf=open(sys.argv[1],'rb')\nfor b in iter(lambda: f.read(1<<20), b''): h.update(b)\nprint(h.hexdigest())",
        ]).arg(&wheel),
        "sha256 of the MLX wheel",
    )?;
    let sum = sum.trim().to_string();
    let pinned =
        fs::read_to_string(pins).map_err(|e| format!("cannot read {}: {e}", pins.display()))?;
    let want = pinned
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?, it.next()?))
        })
        .find(|(_, name)| *name == file_name)
        .map(|(h, _)| h.to_string());
    match want {
        None => {
            return Err(format!(
                "no pinned sha256 for {file_name} in {}: add `<sha256>  {file_name}` after checking the wheel, or set MLX_DIR",
                pins.display()
            ))
        }
        Some(h) if h != sum => {
            return Err(format!("sha256 of {file_name} is {sum}, but {} pins {h}: refusing to use it", pins.display()))
        }
        Some(_) => {}
    }
    if backend.starts_with("cuda") {
        // The CUDA wheel needs the NVIDIA library wheels in a site-packages layout.
        run(
            Command::new(python)
                .args(["-m", "pip", "install", "-q", "--no-compile", "--target"])
                .arg(&site)
                .arg(&wheel),
            &format!(
                "{python} -m pip install --target {} {file_name}",
                site.display()
            ),
        )?;
    } else {
        run(
            Command::new(python)
                .args(["-m", "zipfile", "-e"])
                .arg(&wheel)
                .arg(&site),
            &format!("unpacking {file_name}"),
        )?;
    }
    if !is_mlx_root(&site.join("mlx")) {
        return Err(format!(
            "{file_name} has no mlx/include and mlx/lib/{}",
            lib_name()
        ));
    }
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&site, &dir)
        .map_err(|e| format!("cannot move {} to {}: {e}", site.display(), dir.display()))?;
    let _ = fs::remove_dir_all(&tmp);
    fs::write(dir.join(".complete"), format!("{file_name} {sum}\n")).map_err(|e| e.to_string())?;
    Ok(Found {
        include: root.join("include"),
        lib: root.join("lib"),
        backend: backend.into(),
        how: format!("fetched {file_name} into {}", dir.display()),
    })
}

fn read_version(include: &Path) -> Result<String, String> {
    let path = include.join("mlx/version.h");
    let text =
        fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let get = |key: &str| -> Option<String> {
        text.lines().find_map(|l| {
            l.trim()
                .strip_prefix(&format!("#define {key} "))
                .map(|v| v.trim().to_string())
        })
    };
    match (
        get("MLX_VERSION_MAJOR"),
        get("MLX_VERSION_MINOR"),
        get("MLX_VERSION_PATCH"),
    ) {
        (Some(a), Some(b), Some(c)) => Ok(format!("{a}.{b}.{c}")),
        _ => Err(format!(
            "{} does not define MLX_VERSION_MAJOR/MINOR/PATCH",
            path.display()
        )),
    }
}
