//! Compiles the C++ shim (`cpp/`) and the `cxx` bridge (`src/mlx/ffi.rs`)
//! against the MLX that `mlx-sys` found, and gives every binary an rpath to it
//! (so it runs without LD_LIBRARY_PATH; LD_LIBRARY_PATH can still point it at
//! another backend's libmlx of the same version).
use std::env;

fn main() {
    let include = env::var("DEP_MLX_INCLUDE").expect("mlx-sys sets DEP_MLX_INCLUDE");
    let libdir = env::var("DEP_MLX_LIBDIR").expect("mlx-sys sets DEP_MLX_LIBDIR");
    let backend = env::var("DEP_MLX_BACKEND").unwrap_or_else(|_| "unknown".into());
    let version = env::var("DEP_MLX_VERSION").unwrap_or_else(|_| "unknown".into());

    cxx_build::bridge("src/mlx/ffi.rs")
        .file("cpp/shim.cc")
        .include(&include)
        .std("c++20")
        .flag_if_supported("-O2")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .compile("mlxcel_shim");

    // after the shim (static) so the linker resolves its MLX symbols
    println!("cargo:rustc-link-search=native={libdir}");
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    println!("cargo:rustc-env=MLXCEL_BUILD_MLX_LIBDIR={libdir}");
    println!("cargo:rustc-env=MLXCEL_BUILD_MLX_BACKEND={backend}");
    println!("cargo:rustc-env=MLXCEL_BUILD_MLX_VERSION={version}");
    for f in ["cpp/shim.cc", "cpp/shim.h", "src/mlx/ffi.rs"] {
        println!("cargo:rerun-if-changed={f}");
    }
}
