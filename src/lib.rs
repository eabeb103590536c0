//! mlxcel: LLM inference over MLX, with tensor parallelism across the GPUs of one node.
pub mod cli;
pub mod default_model;
pub mod engine;
pub mod gguf;
pub mod kernels;
pub mod mlx;
pub mod model_dir;
pub mod models;
pub mod parallel;
pub mod runtime;
pub mod server;
pub mod tokenizer;

// Links the MLX library that mlx-sys found.
use mlx_sys as _;

/// mlxcel's cache folder (the demo model, kernel headers): `$MLXCEL_CACHE`, else
/// `$XDG_CACHE_HOME/mlxcel`, else `~/.cache/mlxcel`, else `mlxcel` in the temp folder.
pub fn cache_root() -> std::path::PathBuf {
    use std::path::PathBuf;
    std::env::var_os("MLXCEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("mlxcel")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/mlxcel")))
        .unwrap_or_else(|| std::env::temp_dir().join("mlxcel"))
}

/// This process's program, for the child processes that run it again (ranks, kernel
/// compiles): on Linux `/proc/self/exe`, this very binary even if its file was replaced
/// or deleted since the start; elsewhere its path.
pub fn this_executable() -> Option<std::path::PathBuf> {
    let this_exe = std::path::Path::new("/proc/self/exe");
    if cfg!(target_os = "linux") && this_exe.exists() {
        Some(this_exe.to_path_buf())
    } else {
        std::env::current_exe().ok()
    }
}
