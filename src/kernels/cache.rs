//! Where mlxcel keeps compiled kernels between runs, and turning that on at start-up
//! (the mechanism: [`crate::mlx::kernel_cache`]).
//!
//! The folder is `<cache>/cuda-kernels/mlx-<version>/<arch>-nvrtc-<version>/` (or
//! `MLX_PTX_CACHE_DIR` when set), so an entry is only ever read by the MLX, GPU
//! architecture and compiler it was made for; the entry's name hashes the kernel's whole
//! source and launch constants. MLX's own JIT kernels are kept there too. Off with
//! `MLXCEL_KERNEL_CACHE=0`, and off the CUDA backend.
use std::path::{Path, PathBuf};

use super::{gpu, knobs};
use crate::mlx::{self, kernel_cache, Backend};

/// NVRTC options for a GPU of compute capability `cc` (×10), as MLX compiles: SASS for
/// the device (`sm_90a` from 9.0 on), device code by default, the CUDA headers.
pub fn nvrtc_options(cc: u32, include: &[PathBuf]) -> Vec<String> {
    let tag = if cc >= 90 { "a" } else { "" };
    let mut o = vec![
        "--device-as-default-execution-space".to_string(),
        format!("--gpu-architecture=sm_{cc}{tag}"),
    ];
    o.extend(
        include
            .iter()
            .map(|p| format!("--include-path={}", p.display())),
    );
    o
}

/// Include folders for NVRTC, as MLX finds them: the CUDA headers (`cuda_fp16.h`) of
/// NVRTC at `library` (the `include` beside its `lib` folder: the pip layout), else of
/// `$CUDA_HOME`, `$CUDA_PATH` or `/usr/local/cuda`; and the CCCL headers (`nv/target`,
/// which the CUDA headers include) from the MLX library's own `include/cccl` (`mlx`:
/// the loaded libmlx) or the CUDA headers' `cccl`. Empty when no CUDA headers are found.
pub fn cuda_include_dirs(library: &Path, mlx: Option<&Path>) -> Vec<PathBuf> {
    let mut cuda = Vec::new();
    if let Some(root) = library.parent().and_then(|lib| lib.parent()) {
        cuda.push(root.join("include"));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = std::env::var_os(var) {
            cuda.push(PathBuf::from(h).join("include"));
        }
    }
    cuda.push(PathBuf::from("/usr/local/cuda/include"));
    let Some(cuda) = cuda.into_iter().find(|d| d.join("cuda_fp16.h").is_file()) else {
        return Vec::new();
    };
    let cccl = mlx
        .and_then(|m| m.parent()?.parent().map(|root| root.join("include/cccl")))
        .into_iter()
        .chain([cuda.join("cccl")])
        .find(|d| d.join("nv/target").is_file());
    let mut out = vec![cuda];
    out.extend(cccl);
    out
}

/// Kernels one process compiles at once, at most.
pub const MAX_COMPILE_JOBS: usize = 16;

/// The hidden subcommand of every mlxcel binary that compiles one kernel
/// ([`kernel_cache::serve_worker`]).
pub const WORKER_COMMAND: &str = "_nvrtc";

/// Turn the compiled-kernel cache on for this process (CUDA, `MLXCEL_KERNEL_CACHE` not
/// 0, NVRTC loadable); `MLXCEL_NVRTC_LIBRARY` names the NVRTC library to use. Call it
/// before MLX compiles anything (the binaries' start-up). Returns the folder.
pub fn init() -> Option<PathBuf> {
    if mlx::backend() != Backend::Cuda || !knobs::get().kernel_cache {
        return None;
    }
    let library = std::env::var("MLXCEL_NVRTC_LIBRARY").unwrap_or_default();
    let (version, path) = match kernel_cache::nvrtc(&library) {
        Ok(v) => v,
        Err(e) => {
            tracing::info!("compiled-kernel cache off: {e}");
            return None;
        }
    };
    let Some(cc) = gpu::this_gpu().cc else {
        tracing::info!("compiled-kernel cache off: MLX does not report the GPU's architecture");
        return None;
    };
    let include = cuda_include_dirs(Path::new(&path), mlx::library_path().as_deref());
    if include.is_empty() {
        tracing::info!("compiled-kernel cache off: no CUDA headers found for {path}");
        return None;
    }
    let dir = match std::env::var_os("MLX_PTX_CACHE_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => {
            let d = crate::cache_root()
                .join("cuda-kernels")
                .join(format!("mlx-{}", mlx::version()))
                .join(format!(
                    "sm_{cc}-nvrtc-{}.{}",
                    version / 1000,
                    (version % 1000) / 10
                ));
            // MLX reads the variable once, when it first compiles: start-up is before that
            std::env::set_var("MLX_PTX_CACHE_DIR", &d);
            d
        }
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        tracing::info!("compiled-kernel cache off: {}: {e}", dir.display());
        return None;
    }
    // the cores this process may take: under tensor parallelism the node's ranks share
    // them (each compiles the same kernels), and at most MAX_COMPILE_JOBS (each NVRTC
    // process holds a few hundred MB while it runs)
    let ranks = std::env::var("MLX_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    let jobs = (cores / ranks).clamp(1, MAX_COMPILE_JOBS);
    // each kernel in a process of its own: NVRTC compiles one program at a time per process
    let worker = crate::this_executable()
        .filter(|_| knobs::get().nvrtc_processes)
        .map(|exe| vec![exe.into_os_string(), WORKER_COMMAND.into()]);
    let processes = worker.is_some();
    kernel_cache::enable(kernel_cache::Config {
        dir: dir.clone(),
        nvrtc: path.clone(),
        options: nvrtc_options(cc, &include),
        cubin: true,
        jobs,
        worker,
    });
    tracing::debug!(
        "compiled-kernel cache in {} (NVRTC {path}, {jobs} compile jobs{})",
        dir.display(),
        if processes { ", each in a process" } else { "" }
    );
    Some(dir)
}

/// A line for logs: what the cache did so far in this process.
pub fn summary() -> Option<String> {
    let c = kernel_cache::get()?;
    let s = c.stats();
    Some(format!(
        "kernel cache {}: {} found, {} compiled, {} rebuilt, {} left to MLX",
        c.dir().display(),
        s.hits,
        s.built,
        s.invalid,
        s.failed
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_follow_mlx() {
        let o = nvrtc_options(90, &[PathBuf::from("/x/include")]);
        assert_eq!(
            o,
            [
                "--device-as-default-execution-space",
                "--gpu-architecture=sm_90a",
                "--include-path=/x/include"
            ]
        );
        assert_eq!(nvrtc_options(80, &[])[1], "--gpu-architecture=sm_80");
    }
}
