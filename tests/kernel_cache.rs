//! The compiled-kernel cache's compile path (`src/mlx/kernel_cache.rs`): mlxcel's kernel
//! files, in the source MLX generates around a custom kernel's body (the layout of its
//! `build_kernel`: MLX's utilities header, the header, the `__global__` signature from
//! the input and output names and dtypes, the template constants, the body), turned into
//! what the cache compiles and compiled by NVRTC with the cache's options for an H200
//! (sm_90a). MLX's CUDA backend then loads these binaries from the cache folder instead of
//! compiling (checked on a GPU by `scripts/gpu/kernel-cache.sh`).
//!
//! Needs NVRTC, which needs no GPU: `MLXCEL_NVRTC_LIBRARY=…/nvidia/cu13/lib/libnvrtc.so.13`
//! (the `nvidia-cuda-nvrtc` and `nvidia-cuda-runtime` wheels; `.ci/run` fetches them).
//! Without it the test says so and passes, except under CI (`CI` set), where it fails.
use std::path::Path;

use std::ffi::OsString;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use mlxcel::kernels::cache::{cuda_include_dirs, nvrtc_options};
use mlxcel::mlx::kernel_cache::{
    compile_in_worker, compile_source, nvrtc, nvrtc_compile, CompileJob, WorkerError,
    COMPILE_TIMEOUT,
};

/// A custom kernel's source as MLX generates it: `inputs` and `outputs` are (name, CUDA
/// type), `shape_of` the inputs whose `_shape` the body uses, `consts` the template
/// constants after `T` (one argument per part of MLX's template).
#[allow(clippy::too_many_arguments)]
fn mlx_source(
    name: &str,
    header: &str,
    body: &str,
    inputs: &[(&str, &str)],
    shape_of: &[&str],
    outputs: &[(&str, &str)],
    t: &str,
    consts: &[(&str, i64)],
) -> String {
    let mut s = String::from(
        "\n#include \"mlx/backend/cuda/device/utils.cuh\"\n\n#include <cooperative_groups.h>\n\n",
    );
    s += header;
    s += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n";
    s += &format!("__global__ void {name}(\n");
    for (n, ty) in inputs {
        s += &format!("    const {ty}* {n},\n");
        if shape_of.contains(n) {
            s += &format!("    const __grid_constant__ Shape {n}_shape,\n");
        }
        // (MLX adds an input's ndim where the body names it, as it does its shape)
        if body.contains(&format!("{n}_ndim")) {
            s += &format!("    const __grid_constant__ int {n}_ndim,\n");
        }
    }
    for (i, (n, ty)) in outputs.iter().enumerate() {
        s += &format!("    {ty}* {n}");
        s += if i + 1 < outputs.len() {
            ",\n"
        } else {
            ") {\n"
        };
    }
    s += &format!("  using T = {t};\n");
    for (n, v) in consts {
        s += &format!("  constexpr int {n} = {v};\n");
    }
    s += "\n";
    s += body;
    s += "\n}\n\n} // namespace mlx::core::cu\n";
    s
}

fn parts(file: &str, markers: &[&str]) -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(file)).unwrap();
    let mut rest = text.split_once("// @@header\n").unwrap().1.to_string();
    let mut out = Vec::new();
    for m in markers {
        let (a, b) = rest.split_once(m).unwrap();
        out.push(a.to_string());
        rest = b.to_string();
    }
    out.push(rest);
    out
}

/// With `MLXCEL_PTXAS=path/to/ptxas` (the `nvidia-cuda-nvcc` wheel has one): the kernel's
/// PTX through `ptxas -v` for sm_90a, its registers and spills printed; the GEMM's variants
/// must not spill (their accumulators and in-flight loads are sized to fit).
fn ptxas_report(
    nvrtc: &str,
    src: &str,
    name: &str,
    expr: &str,
    options: &[String],
    ptxas: &std::ffi::OsStr,
) {
    let (ptx, _) = nvrtc_compile(nvrtc, src, &format!("{name}.cu"), expr, options, false)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(format!("{name}.ptx"));
    std::fs::write(&file, ptx.strip_suffix(&[0]).unwrap_or(&ptx)).unwrap();
    let out = std::process::Command::new(ptxas)
        .args(["-arch=sm_90a", "-v", "-o"])
        .arg(dir.path().join("out.cubin"))
        .arg(&file)
        .output()
        .expect("running MLXCEL_PTXAS");
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{name}: ptxas failed:\n{log}");
    // MLXCEL_CUBIN_DIR=dir keeps each cubin there, for reading its instructions
    if let Some(keep) = std::env::var_os("MLXCEL_CUBIN_DIR") {
        std::fs::copy(
            dir.path().join("out.cubin"),
            std::path::Path::new(&keep).join(format!("{name}.cubin")),
        )
        .expect("MLXCEL_CUBIN_DIR: copying a cubin there");
    }
    let line = log
        .lines()
        .filter(|l| l.contains("registers") || l.contains("spill"))
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ");
    eprintln!("{name}: ptxas: {line}");
    if name.contains("qgemm") {
        assert!(
            log.contains(" 0 bytes spill stores") && log.contains(" 0 bytes spill loads"),
            "{name} spills: {line}"
        );
    }
}

/// `f` of every job, on `threads` threads taking the next job as they finish one; the
/// results in the jobs' order.
fn on_threads<T: Send>(
    jobs: &[CompileJob],
    threads: usize,
    f: impl Fn(&CompileJob) -> T + Sync,
) -> Vec<T> {
    let next = AtomicUsize::new(0);
    let done = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(j) = jobs.get(i) else { break };
                let out = f(j);
                done.lock().unwrap().push((i, out));
            });
        }
    });
    let mut done = done.into_inner().unwrap();
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, out)| out).collect()
}

#[test]
fn kernels_compile_for_the_cache_with_nvrtc() {
    let library = std::env::var("MLXCEL_NVRTC_LIBRARY").unwrap_or_default();
    let (version, path) = match nvrtc(&library) {
        Ok(v) => v,
        Err(e) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must run this test with NVRTC (MLXCEL_NVRTC_LIBRARY): {e}"
            );
            eprintln!("skipped: {e} (set MLXCEL_NVRTC_LIBRARY to run it)");
            return;
        }
    };
    eprintln!("NVRTC {version} at {path}");
    let include = cuda_include_dirs(Path::new(&path), mlxcel::mlx::library_path().as_deref());
    assert!(!include.is_empty(), "no CUDA headers beside {path}");
    let options = nvrtc_options(90, &include);

    let q = parts(
        "kernels/qgemv.cu",
        &[
            "// @@body\n",
            "// @@body_rope\n",
            "// @@body_xq\n",
            "// @@body_rope_kv\n",
            "// @@body_mlp\n",
        ],
    );
    let (header, body, body_rope, body_xq, body_rope_kv, body_mlp) =
        (&q[0], &q[1], &q[2], &q[3], &q[4], &q[5]);
    // the header as mlxcel passes it to MLX: an #include of a file holding it
    let dir = tempfile::tempdir().unwrap();
    let include_line = mlxcel::kernels::qgemv::include_header(dir.path(), "q", header).unwrap();
    let bf = "__nv_bfloat16";
    let f16 = "__half";
    let plain_in = |x: &'static str, t: &'static str| {
        vec![
            ("x", x),
            ("w", "uint32_t"),
            ("scales", t),
            ("biases", t),
            ("res", t),
            ("nw", t),
        ]
    };
    let eps = 1e-5f32.to_bits() as i64;
    let gemv = |m: i64, k: i64, g: i64, rows: i64, wpb: i64, xq: i64, mma: i64, pg: i64| {
        vec![
            ("M", m),
            ("N", 4096),
            ("K", k),
            ("G", g),
            ("BITS", 4),
            ("ROWS", rows),
            ("WPB", wpb),
            ("EPI", 2),
            ("NORM", 1),
            ("EPS_BITS", eps),
            ("XQ", xq),
            ("MMA", mma),
            ("PG", pg),
        ]
    };
    let mut sources: Vec<(String, String)> = Vec::new();
    let name = "custom_kernel_mlxcel_qgemv_test_dp4a";
    sources.push((
        name.into(),
        mlx_source(
            name,
            &include_line,
            body,
            &plain_in(bf, bf),
            &[],
            &[("y", bf)],
            bf,
            &gemv(1, 4096, 64, 8, 4, 1, 0, 0),
        ),
    ));
    let name = "custom_kernel_mlxcel_qgemv_test_mma_f16";
    sources.push((
        name.into(),
        mlx_source(
            name,
            header,
            body,
            &plain_in("uint32_t", f16),
            &[],
            &[("y", f16)],
            f16,
            &gemv(8, 4096, 32, 16, 4, 1, 1, 0),
        ),
    ));
    let name = "custom_kernel_mlxcel_qgemv_test_stream";
    sources.push((
        name.into(),
        mlx_source(
            name,
            header,
            body,
            &plain_in(bf, bf),
            &[],
            &[("y", bf)],
            bf,
            &{
                let mut c = gemv(1, 14336, 64, 2, 14, 1, 0, 132);
                c[8].1 = 1; // EPI: the residual
                c[9].1 = 0; // NORM
                c
            },
        ),
    ));
    let name = "custom_kernel_mlxcel_qgemv_test_rope";
    let mut rope = gemv(1, 4096, 64, 8, 4, 1, 0, 0);
    rope[1].1 = 6144;
    rope.retain(|(n, _)| *n != "EPI");
    rope.extend([("HD", 128), ("NQ", 32), ("BIAS", 0)]);
    let q_rope_in = vec![
        ("x", bf),
        ("w", "uint32_t"),
        ("scales", bf),
        ("biases", bf),
        ("nw", bf),
        ("pos", "int32_t"),
        ("inv_freq", "float"),
    ];
    let qb = [("qb", bf)];
    sources.push((
        name.into(),
        mlx_source(
            name,
            header,
            body_rope,
            &[q_rope_in.as_slice(), &qb].concat(),
            &[],
            &[("q", bf), ("kv", bf)],
            bf,
            &rope,
        ),
    ));
    // the same writing k and v into a KV pool (its shape passed, as the body names it),
    // with q/k/v biases (Qwen2)
    let name = "custom_kernel_mlxcel_qgemv_test_rope_kv";
    let kv_in = [("pool", bf), ("dst", "int32_t")];
    let mut rope_bias = rope.clone();
    rope_bias.retain(|(n, _)| *n != "BIAS");
    rope_bias.push(("BIAS", 1));
    sources.push((
        name.into(),
        mlx_source(
            name,
            header,
            body_rope_kv,
            &[q_rope_in.as_slice(), &kv_in, &qb].concat(),
            &["pool"],
            &[("q", bf)],
            bf,
            &rope_bias,
        ),
    ));
    let name = "custom_kernel_mlxcel_qgemv_test_xq";
    sources.push((
        name.into(),
        mlx_source(
            name,
            header,
            body_xq,
            &[("x", f16), ("nw", f16)],
            &[],
            &[("xq", "uint32_t")],
            f16,
            &[
                ("M", 8),
                ("K", 4096),
                ("G", 32),
                ("NORM", 1),
                ("EPS_BITS", eps),
            ],
        ),
    ));
    // the one-kernel MLP (MLXCEL_QGEMV_MLP) of a 70B TP=8 rank at batch 1 (gate/up 7168 ×
    // 8192 and down 8192 × 3584 on 16 rows a block, 8 warps: `qgemv::mlp_launch`), the
    // same with 8 rows a block in the down stage (MLXCEL_QGEMV_MLP_ROWS2=8), and an 8-bit
    // float16 one at batch 3 without the residual (a TP rank other than 0)
    // and (MLXCEL_QGEMV_MLP_BOUNDED) the first compiled for two blocks per SM
    let bounded_mlp = format!("{}{include_line}", mlxcel::kernels::qgemm::BOUNDED_PREFIX);
    for (name, t, consts) in [
        (
            "custom_kernel_mlxcel_qgemv_test_mlp",
            bf,
            [3584, 8192, 64, 4, 16, 16, 8, 1, 1, 1],
        ),
        (
            "custom_kernel_mlxcel_qgemv_test_mlp_rows8",
            bf,
            [3584, 8192, 64, 4, 16, 8, 8, 1, 1, 1],
        ),
        (
            "custom_kernel_mlxcel_qgemv_test_mlp_bounded",
            bf,
            [3584, 8192, 64, 4, 16, 16, 8, 1, 1, 1],
        ),
        (
            "custom_kernel_mlxcel_qgemv_test_mlp_8bit_f16",
            f16,
            [1024, 4096, 32, 8, 4, 4, 4, 3, 0, 0],
        ),
    ] {
        let [ni, k, g, bits, r1, r2, wpb, m, xq, epi2] = consts;
        let mlp_in = vec![
            ("x", t),
            ("w1", "uint32_t"),
            ("s1", t),
            ("b1", t),
            ("nw", t),
            ("w2", "uint32_t"),
            ("s2", t),
            ("b2", t),
            ("res", t),
            ("act", t),
            ("count", "int32_t"),
            ("prev", t),
        ];
        sources.push((
            name.into(),
            mlx_source(
                name,
                match name.ends_with("_bounded") {
                    true => &bounded_mlp,
                    false => &include_line,
                },
                body_mlp,
                &mlp_in,
                &[],
                &[("y", t)],
                t,
                &[
                    ("M", m),
                    ("NI", ni),
                    ("K", k),
                    ("G", g),
                    ("BITS", bits),
                    ("R1", r1),
                    ("R2", r2),
                    ("WPB", wpb),
                    ("NORM", 1),
                    ("EPS_BITS", eps),
                    ("XQ", xq),
                    ("EPI2", epi2),
                ],
            ),
        ));
    }
    // the quantized GEMM (kernels/qgemm.cu after the GEMV's header, as mlxcel passes them):
    // launches mlxcel picks for 8B shapes (src/kernels/qgemm.rs `launch_for`), both bodies
    let g = parts("kernels/qgemm.cu", &["// @@body\n", "// @@body_rope\n"]);
    let gemm_header = format!("{header}{}", g[0]);
    let gemm_include =
        mlxcel::kernels::qgemv::include_header(dir.path(), "g", &gemm_header).unwrap();
    let gemm = |mt: i64, n: i64, k: i64, g: i64, bits: i64, wn: i64, sk: i64, st: i64| {
        vec![
            ("MT", mt),
            ("N", n),
            ("K", k),
            ("G", g),
            ("BITS", bits),
            // 8 warps a block (`qgemm::BLOCK_WARPS`), 4 with two per row of tiles
            ("WR", 8 / wn),
            ("WN", wn),
            ("SK", sk),
            ("ST", st),
        ]
    };
    let gemm_in = |t: &'static str| {
        vec![
            ("x", t),
            ("w", "uint32_t"),
            ("scales", t),
            ("biases", t),
            ("res", t),
            ("nw", t),
            ("part", "float"),
            ("count", "int32_t"),
            ("prev", t),
        ]
    };
    // the GEMM's 128-register flavour (MLXCEL_QGEMM_BOUNDED, `qgemm::bounded`: two warps
    // per row of tiles up to 32 rows) must stay spill-free within the bound too
    let bounded_header = format!("{header}{}{}", mlxcel::kernels::qgemm::BOUNDED_PREFIX, g[0]);
    // the word loop unrolled (MLXCEL_QGEMM_CUNROLL, set in a kernel file sent through
    // MLXCEL_QGEMM_SOURCE): 4-bit up to 32 rows, where two blocks an SM leave 255 registers
    // a narrow launch (MLXCEL_QGEMM_WIDE=0: 4 warps over the weight rows)
    let narrow = |mut c: Vec<(&'static str, i64)>| {
        for e in c.iter_mut().filter(|e| e.0 == "WR") {
            e.1 = 4;
        }
        c
    };
    let unrolled_header = format!(
        "{header}#define MLXCEL_QGEMM_CUNROLL 4\n#define MLXCEL_QGEMM_PIPE 0\n{}",
        g[0]
    );
    // the warpgroup-MMA flavour (MLXCEL_QGEMM_WGMMA, `Launch::wgmma`): wgmma from sm_90a
    // (`switches`: the kernel file's tuning defines after the flavour's)
    let wgmma_with = |switches: &str| {
        format!(
            "{header}{}{switches}{}",
            mlxcel::kernels::qgemm::WGMMA_PREFIX,
            g[0]
        )
    };
    let wgmma_header = wgmma_with("");
    // with a step's last wgmmas carried into the next (MLXCEL_QGEMM_CARRY)
    let carry_header = wgmma_with("#define MLXCEL_QGEMM_CARRY 1\n");
    // the profiling switch with every part left out (MLXCEL_QGEMM_SKIP: wrong results by
    // design, but it must compile for the timings it is for)
    let skip_header = wgmma_with("#define MLXCEL_QGEMM_SKIP 63\n");
    for (name, t, head, mut c, epi, norm) in [
        // gate/up at 32 rows: SwiGLU with the norm, 2 splits, a ring of 3 stages
        (
            "custom_kernel_mlxcel_qgemm_test_swiglu",
            bf,
            &gemm_include,
            gemm(32, 28672, 4096, 64, 4, 1, 2, 3),
            2,
            1,
        ),
        // down at 128 rows, 8-bit float16: the residual, two warps per row of tiles, 7 splits
        (
            "custom_kernel_mlxcel_qgemm_test_res_f16",
            f16,
            &gemm_include,
            gemm(128, 4096, 14336, 64, 8, 2, 7, 2),
            1,
            0,
        ),
        // 4-bit at 128 rows with the norm (gate/up: SwiGLU)
        (
            "custom_kernel_mlxcel_qgemm_test_swiglu_128",
            bf,
            &gemm_include,
            gemm(128, 28672, 4096, 64, 4, 2, 1, 2),
            2,
            1,
        ),
        // at 64 rows: gate/up with the norm (the word loop as it is), 4- and 8-bit down (the
        // loop pipelined, MLXCEL_QGEMM_PIPE, the weights read from the stage word by word)
        (
            "custom_kernel_mlxcel_qgemm_test_res_64",
            bf,
            &gemm_include,
            gemm(64, 4096, 14336, 64, 4, 1, 8, 3),
            1,
            0,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_swiglu_64",
            bf,
            &gemm_include,
            gemm(64, 28672, 4096, 64, 4, 1, 1, 3),
            2,
            1,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_res_64_8bit",
            bf,
            &gemm_include,
            gemm(64, 4096, 14336, 64, 8, 1, 8, 2),
            1,
            0,
        ),
        // 70B TP8 rank down at 64 rows (K = 3584, 7 steps a split): scale blocks in 4-byte
        // pieces, 16 a thread; 4- and 8-bit, and the narrow launch at 8 bits
        (
            "custom_kernel_mlxcel_qgemm_test_res_64_pieces",
            bf,
            &gemm_include,
            gemm(64, 8192, 3584, 64, 4, 1, 4, 3),
            1,
            0,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_res_64_pieces_8bit",
            bf,
            &gemm_include,
            gemm(64, 8192, 3584, 64, 8, 1, 4, 2),
            1,
            0,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_res_64_narrow_8bit",
            bf,
            &gemm_include,
            narrow(gemm(64, 4096, 14336, 64, 8, 1, 8, 3)),
            1,
            0,
        ),
        // o at 16 rows, group 32: the plain product, 16 splits
        (
            "custom_kernel_mlxcel_qgemm_test_plain",
            bf,
            &gemm_include,
            gemm(16, 4096, 4096, 32, 4, 1, 16, 4),
            0,
            0,
        ),
        // the bounded flavour: gate/up with the norm at 32 rows, 8-bit down with the residual
        (
            "custom_kernel_mlxcel_qgemm_test_bounded_swiglu",
            bf,
            &bounded_header,
            gemm(32, 28672, 4096, 64, 4, 2, 2, 6),
            2,
            1,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_unroll4_swiglu",
            bf,
            &unrolled_header,
            narrow(gemm(32, 28672, 4096, 64, 4, 1, 2, 6)),
            2,
            1,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_unroll4_res",
            bf,
            &unrolled_header,
            narrow(gemm(32, 4096, 14336, 64, 4, 1, 14, 6)),
            1,
            0,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_bounded_res_8bit",
            bf,
            &bounded_header,
            gemm(32, 4096, 14336, 64, 8, 2, 14, 4),
            1,
            0,
        ),
        // the wgmma flavour (up to 64 rows, `qgemm::WGMMA_MAX_M`): gate/up with the norm at 32
        // and 64 rows (SwiGLU), 4- and 8-bit down at 64 rows (the residual, 8 splits), 40 rows
        // (two wgmmas a product)
        (
            "custom_kernel_mlxcel_qgemm_test_wgmma_swiglu_32",
            bf,
            &wgmma_header,
            gemm(32, 28672, 4096, 64, 4, 1, 1, 4),
            2,
            1,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_wgmma_swiglu_64",
            bf,
            &wgmma_header,
            gemm(64, 28672, 4096, 64, 4, 1, 1, 3),
            2,
            1,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_wgmma_res_64",
            bf,
            &wgmma_header,
            gemm(64, 4096, 14336, 64, 4, 1, 8, 3),
            1,
            0,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_wgmma_res_64_8bit",
            bf,
            &wgmma_header,
            gemm(64, 4096, 14336, 64, 8, 1, 8, 2),
            1,
            0,
        ),
        // 8-bit down at 64 rows with a ring of 3 (MLXCEL_QGEMM_RING_BYTES): x a step ahead
        (
            "custom_kernel_mlxcel_qgemm_test_wgmma_res_64_8bit_st3",
            bf,
            &wgmma_header,
            gemm(64, 4096, 14336, 64, 8, 1, 8, 3),
            1,
            0,
        ),
        // carried wgmmas: gate/up with the norm at 64 rows (4 stages: x a step ahead), 8-bit
        // down at 64 rows (3)
        (
            "custom_kernel_mlxcel_qgemm_test_carry_swiglu_64",
            bf,
            &carry_header,
            gemm(64, 28672, 4096, 64, 4, 1, 1, 4),
            2,
            1,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_carry_res_64_8bit",
            bf,
            &carry_header,
            gemm(64, 4096, 14336, 64, 8, 1, 8, 3),
            1,
            0,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_skip_swiglu_64",
            bf,
            &skip_header,
            gemm(64, 28672, 4096, 64, 4, 1, 1, 3),
            2,
            1,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_wgmma_res_40_f16",
            f16,
            &wgmma_header,
            gemm(40, 4096, 14336, 64, 4, 1, 8, 3),
            1,
            0,
        ),
    ] {
        c.extend([("EPI", epi), ("NORM", norm), ("EPS_BITS", eps)]);
        sources.push((
            name.into(),
            mlx_source(
                name,
                head,
                &g[1],
                &gemm_in(t),
                &["x"],
                &[("y", t), ("tok", t)],
                t,
                &c,
            ),
        ));
    }
    // the q/k/v projection with RoPE: 64 rows of group 128 with q/k/v biases (Qwen2), and 16
    // rows in the bounded flavour without
    let rope_in = [
        ("x", bf),
        ("w", "uint32_t"),
        ("scales", bf),
        ("biases", bf),
        ("nw", bf),
        ("pos", "int32_t"),
        ("inv_freq", "float"),
        ("qb", bf),
        ("part", "float"),
        ("count", "int32_t"),
        ("prev", bf),
    ];
    for (name, head, mut c, bias) in [
        (
            "custom_kernel_mlxcel_qgemm_test_rope",
            &gemm_header,
            gemm(64, 6144, 4096, 128, 4, 1, 4, 3),
            1,
        ),
        (
            "custom_kernel_mlxcel_qgemm_test_bounded_rope",
            &bounded_header,
            gemm(16, 6144, 4096, 64, 4, 2, 8, 6),
            0,
        ),
    ] {
        c.extend([
            ("NORM", 1),
            ("EPS_BITS", eps),
            ("HD", 128),
            ("NQ", 32),
            ("BIAS", bias),
        ]);
        sources.push((
            name.into(),
            mlx_source(
                name,
                head,
                &g[2],
                &rope_in,
                &["x"],
                &[("q", bf), ("kv", bf), ("tok", bf)],
                bf,
                &c,
            ),
        ));
    }
    // the dense bf16/f16 GEMV (kernels/gemv.cu): plain with the norm, SwiGLU, and q/k/v with RoPE;
    // the tensor-core path (MMA) at 16 rows with the norm and the residual
    let d = parts(
        "kernels/gemv.cu",
        &["// @@body\n", "// @@body_rope\n", "// @@body_rope_kv\n"],
    );
    let dense = |m: i64, epi: i64, norm: i64| {
        let mma = i64::from(m > 8);
        vec![
            ("M", m),
            ("N", 4096),
            ("K", 4096),
            ("ROWS", if mma == 1 { 32 } else { 4 }),
            ("WPB", if mma == 1 { 8 } else { 4 }),
            ("EPI", epi),
            ("NORM", norm),
            ("EPS_BITS", eps),
            ("MMA", mma),
        ]
    };
    for (name, t, m, epi, norm) in [
        ("custom_kernel_mlxcel_gemv_test_norm", bf, 1, 0, 1),
        ("custom_kernel_mlxcel_gemv_test_swiglu_f16", f16, 8, 2, 0),
        ("custom_kernel_mlxcel_gemv_test_mma", bf, 16, 1, 1),
        ("custom_kernel_mlxcel_gemv_test_mma_f16", f16, 12, 2, 0),
    ] {
        sources.push((
            name.into(),
            mlx_source(
                name,
                &d[0],
                &d[1],
                &[("x", t), ("w", t), ("res", t), ("nw", t)],
                &[],
                &[("y", t)],
                t,
                &dense(m, epi, norm),
            ),
        ));
    }
    let name = "custom_kernel_mlxcel_gemv_test_rope";
    let mut rope_d = dense(1, 0, 1);
    rope_d[1].1 = 6144;
    rope_d.retain(|(n, _)| *n != "EPI");
    rope_d.extend([("HD", 128), ("NQ", 32), ("BIAS", 0)]);
    let d_rope_in = [
        ("x", bf),
        ("w", bf),
        ("nw", bf),
        ("pos", "int32_t"),
        ("inv_freq", "float"),
    ];
    let mut rope_d_bias = rope_d.clone();
    rope_d_bias.retain(|(n, _)| *n != "BIAS");
    rope_d_bias.push(("BIAS", 1));
    sources.push((
        name.into(),
        mlx_source(
            name,
            &d[0],
            &d[2],
            &[d_rope_in.as_slice(), &qb].concat(),
            &[],
            &[("q", bf), ("kv", bf)],
            bf,
            &rope_d,
        ),
    ));
    // (with q/k/v biases, as Qwen2's decode steps run it)
    let name = "custom_kernel_mlxcel_gemv_test_rope_kv";
    sources.push((
        name.into(),
        mlx_source(
            name,
            &d[0],
            &d[3],
            &[d_rope_in.as_slice(), &kv_in, &qb].concat(),
            &["pool"],
            &[("q", bf)],
            bf,
            &rope_d_bias,
        ),
    ));
    let a = parts("kernels/attn.cu", &["// @@body\n"]);
    for (t, tag) in [(bf, "bf16"), (f16, "f16")] {
        let name = format!("custom_kernel_mlxcel_attn_test_{tag}");
        sources.push((
            name.clone(),
            mlx_source(
                &name,
                &a[0],
                &a[1],
                &[
                    ("q", t),
                    ("pool", t),
                    ("table", "int32_t"),
                    ("pos", "int32_t"),
                    ("part", "float"),
                    ("count", "int32_t"),
                ],
                &["pool", "table"],
                &[("out", t)],
                t,
                &[
                    ("D", 128),
                    ("HQ", 32),
                    ("HKV", 8),
                    ("NSPLIT", 32),
                    ("WARPS", 16),
                    ("BS", 32),
                    ("SCALE_BITS", 0.125f32.to_bits() as i64),
                ],
            ),
        ));
    }
    // Qwen3's q/k norm + RoPE + cache write (kernels/qk_rope.cu), a TP=8 rank's heads
    let qr = parts("kernels/qk_rope.cu", &["// @@body\n"]);
    for (t, tag) in [(bf, "bf16"), (f16, "f16")] {
        let name = format!("custom_kernel_mlxcel_qk_rope_test_{tag}");
        sources.push((
            name.clone(),
            mlx_source(
                &name,
                &qr[0],
                &qr[1],
                &[
                    ("y", t),
                    ("qw", t),
                    ("kw", t),
                    ("pos", "int32_t"),
                    ("inv_freq", "float"),
                    ("pool", t),
                    ("dst", "int32_t"),
                ],
                &["pool"],
                &[("q", t)],
                t,
                &[
                    ("NQ", 8),
                    ("NKV", 1),
                    ("HD", 128),
                    ("EPS_BITS", 1e-6f32.to_bits() as i64),
                ],
            ),
        ));
    }
    let mw = parts("kernels/mask_wait.cu", &["// @@body\n"]);
    let name = "custom_kernel_mlxcel_mask_wait_test".to_string();
    sources.push((
        name.clone(),
        mlx_source(
            &name,
            &mw[0],
            &mw[1],
            &[("src", "int64_t"), ("want", "uint32_t")],
            &[],
            &[("out", "uint32_t")],
            "uint32_t",
            &[("N", 32 * 1536)],
        ),
    ));
    // MLXCEL_KERNEL_TEST_ONLY=part: only the kernels whose names contain it (for a quick
    // look at one variant's registers)
    if let Ok(only) = std::env::var("MLXCEL_KERNEL_TEST_ONLY") {
        sources.retain(|(name, _)| name.contains(&only));
    }
    let jobs: Vec<CompileJob> = sources
        .iter()
        .map(|(name, src)| CompileJob {
            library: path.clone(),
            source: compile_source(src).expect("MLX's header line is replaced"),
            file: format!("{name}.cu"),
            name_expr: format!("mlx::core::cu::{name}"),
            options: options.clone(),
            cubin: true,
        })
        .collect();
    let t = Instant::now();
    let here: Vec<(Vec<u8>, String)> = jobs
        .iter()
        .map(|j| j.run().unwrap_or_else(|e| panic!("{}: {e}", j.file)))
        .collect();
    let serial = t.elapsed().as_secs_f64();
    // the same in compile processes (the cache's way), as many at once as there are
    // cores: the same binaries
    let worker = [
        OsString::from(env!("CARGO_BIN_EXE_mlxcel")),
        OsString::from(mlxcel::kernels::cache::WORKER_COMMAND),
    ];
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let t = Instant::now();
    let apart = on_threads(&jobs, cores, |j| {
        compile_in_worker(&worker, j, COMPILE_TIMEOUT)
            .unwrap_or_else(|e| panic!("{} in a compile process: {e}", j.file))
    });
    let parallel = t.elapsed().as_secs_f64();
    // (and on threads of this process, as the cache compiled before: NVRTC holds a lock
    // of its process for most of a compilation, so they overlap little)
    let t = Instant::now();
    on_threads(&jobs, cores, |j| {
        j.run().unwrap_or_else(|e| panic!("{}: {e}", j.file))
    });
    let threads = t.elapsed().as_secs_f64();
    eprintln!(
        "{} kernels: {serial:.1} s one after another in this process, {threads:.1} s on \
         {cores} threads of it, {parallel:.1} s in compile processes, {cores} at once",
        jobs.len()
    );
    for (i, out) in apart.iter().enumerate() {
        assert_eq!(out, &here[i], "{}", jobs[i].file);
    }
    for (((name, _), job), (bin, lowered)) in sources.iter().zip(&jobs).zip(here) {
        let (cache_src, expr) = (&job.source, &job.name_expr);
        assert!(bin.starts_with(b"\x7fELF"), "{name}: not a cubin");
        if let Some(ptxas) = std::env::var_os("MLXCEL_PTXAS") {
            ptxas_report(&path, cache_src, name, expr, &options, &ptxas);
        }
        assert!(
            lowered.starts_with("_Z") && lowered.contains(name),
            "{name}: lowered name {lowered}"
        );
        eprintln!("{name}: {} byte cubin, {lowered}", bin.len());
    }
    // a compile error comes back with NVRTC's log
    let bad = compile_source(&mlx_source(
        "custom_kernel_broken",
        "",
        "this is not CUDA;",
        &[("x", bf)],
        &[],
        &[("y", bf)],
        bf,
        &[],
    ))
    .unwrap();
    let e = nvrtc_compile(
        &path,
        &bad,
        "broken.cu",
        "mlx::core::cu::custom_kernel_broken",
        &options,
        true,
    )
    .unwrap_err();
    assert!(e.contains("broken.cu"), "{e}");
    // and from a compile process, as its error
    let job = CompileJob {
        library: path.clone(),
        source: bad,
        file: "broken.cu".into(),
        name_expr: "mlx::core::cu::custom_kernel_broken".into(),
        options: options.clone(),
        cubin: true,
    };
    match compile_in_worker(&worker, &job, COMPILE_TIMEOUT) {
        Err(WorkerError::Compile(e)) => assert!(e.contains("broken.cu"), "{e}"),
        other => panic!("{other:?}"),
    }
}
