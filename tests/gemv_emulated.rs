//! The dense GEMV kernel (`kernels/gemv.cu`) run on the CPU: its header and bodies,
//! wrapped as MLX wraps them, are compiled as C++ with the CUDA emulation of
//! `tests/common` and compared with a float64 product of the same bf16/f16 values, for
//! every epilogue, the norm and RoPE, batch rows 1, 3 and 8 and rows whose vectors do not
//! fill the block's threads; and the tensor-core path (`MMA = 1`, `mma.sync.m16n8k16`
//! emulated lane by lane) at 1-16 rows. `scripts/check_gemv.py` checks the kernel on a GPU, against MLX.
use std::path::Path;

use mlxcel::kernels::gemv;
use mlxcel::mlx::Dtype;

mod common;

const MAIN: &str = r#"
int main() {
  std::mt19937 rng(4321);
  std::uniform_real_distribution<float> ux(-1.f, 1.f), uw(-0.05f, 0.05f);
  constexpr int OUT_N = EPI == 2 ? N / 2 : N;
  std::vector<T> x(M * K), w(size_t(N) * K), res(M * N), nw(K), y(M * OUT_N, T(-777.f));
  std::vector<int32_t> pos;
  std::vector<float> inv;
  std::vector<T> yq, ykv;
#if ROPE
  rope_inputs(M, HD, pos, inv);
  yq.assign(M * NQ * HD, T(-777.f));
  ykv.assign(M * (N - NQ * HD), T(-777.f));
#endif
  for (auto& v : x) v = T(ux(rng));
  for (auto& v : w) v = T(uw(rng));
  for (auto& v : res) v = T(ux(rng));
  for (auto& v : nw) v = T(0.5f + ux(rng));
#if ROPE_KV
  KvPool<T> kv(M, N / HD - NQ, HD);
#endif
  const int tpb = 32 * WPB;
  blockDim.x = tpb;
  g_shfl.assign(tpb, 0.f);
  g_mma.assign(6 * tpb, 0u);
  for (int blk = 0; blk < N / ROWS; ++blk) {
    run_block(blk, tpb, [&] {
#if ROPE_KV
      kernel(x.data(), w.data(), nw.data(), pos.data(), inv.data(), kv.pool.data(), kv.shape,
             kv.dst.data(), res.data(), yq.data());
#elif ROPE
      kernel(x.data(), w.data(), nw.data(), pos.data(), inv.data(), res.data(), yq.data(), ykv.data());
#else
      kernel(x.data(), w.data(), res.data(), nw.data(), y.data());
#endif
    });
  }
#if ROPE_KV
  // the pool's rows back into kv's layout; a row written that was not asked for fails
  if (!kv.read_back(ykv)) return 1;
#endif
  const std::vector<double> xin = ref_input(x, nw, M, K, NORM, EPS_BITS);
  auto dot = [&](int m, int n) {
    double r = 0;
    for (int k = 0; k < K; ++k) r += xin[m * K + k] * double(float(w[size_t(n) * K + k]));
    // (BIAS: the q/k/v entry points add qb, here the first N values of res, before RoPE)
    return r + (BIAS ? double(float(res[n])) : 0.0);
  };
  // float32 sums of 16-bit values: the error is the output's rounding, at most half an
  // ulp of the largest output (bf16: 2^-8 of it, f16: 2^-11), with room for float sums;
  // a NaN, or an output never written (-777), fails
  constexpr double tol = std::is_same_v<T, __half> ? 1.5e-3 : 6e-3;
  return ref_check(dot, M, N, EPI, HD, NQ, pos, inv, res, y, yq, ykv, tol);
}
"#;

/// The kernel file's header, plain body, RoPE body and the RoPE body writing a KV pool.
fn kernel_parts() -> (String, String, String, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/gemv.cu");
    let text = std::fs::read_to_string(&path).unwrap();
    let src = gemv::split_source(&text).unwrap();
    (src.header, src.body, src.body_rope, src.body_rope_kv)
}

/// Compile and run the emulated kernel with template constants `consts` (`F16` = 1: float16,
/// else bfloat16); the RoPE entry point when they include `HD` and `NQ`.
fn run(tag: &str, consts: &[(&str, usize)]) {
    let (header, body, body_rope, body_rope_kv) = kernel_parts();
    let rope = consts.iter().any(|(n, _)| *n == "HD");
    let rope_kv = consts.contains(&("KVW", 1));
    let consts: Vec<(&str, usize)> = consts
        .iter()
        .copied()
        .filter(|(n, _)| *n != "KVW")
        .collect();
    let (mut src, t) = common::program_head(&header, &consts, &[("MMA", 0), ("BIAS", 0)]);
    if rope_kv {
        // inputs x, w, nw, pos, inv_freq, pool (and its shape, as MLX passes it when the
        // body names `pool_shape`), dst, qb and output q
        src += &format!(
            "void kernel(const {t}* x, const {t}* w, const {t}* nw, const int32_t* pos,\n\
                const float* inv_freq, const {t}* pool, const int* pool_shape,\n\
                const int32_t* dst, const {t}* qb, {t}* q) {{\n"
        );
        src += &body_rope_kv;
    } else if rope {
        // the signature MLX generates for inputs x, w, nw, pos, inv_freq, qb and outputs q, kv
        src += &format!(
            "void kernel(const {t}* x, const {t}* w, const {t}* nw, const int32_t* pos,\n\
                const float* inv_freq, const {t}* qb, {t}* q, {t}* kv) {{\n"
        );
        src += &body_rope;
    } else {
        // inputs x, w, res, nw and output y
        src += &format!(
            "void kernel(const {t}* x, const {t}* w, const {t}* res, const {t}* nw, {t}* y) {{\n"
        );
        src += &body;
    }
    src += "\n}\n";
    src += &format!(
        "#define ROPE {}\n#define ROPE_KV {}\n",
        rope as i32, rope_kv as i32
    );
    src += MAIN;
    common::run_checked(&format!("gemv-{tag}"), &src, &consts, "max_err");
}

/// `run` with the launch the Rust side picks for this shape (rows and warps per block).
fn run_launched(tag: &str, m: usize, n: usize, k: usize, extra: &[(&str, usize)]) {
    let l = gemv::launch_config(m, n, k);
    launched(tag, m, n, k, l, extra);
}

/// `run` with launch `l`.
fn launched(tag: &str, m: usize, n: usize, k: usize, l: gemv::Launch, extra: &[(&str, usize)]) {
    let mut consts = vec![
        ("M", m),
        ("N", n),
        ("K", k),
        ("ROWS", l.rows),
        ("WPB", l.wpb),
        ("MMA", l.mma as usize),
    ];
    consts.extend_from_slice(extra);
    run(tag, &consts);
}

#[test]
fn gemv_plain_matches_reference() {
    for (dt, f16) in [("bf16", 0), ("f16", 1)] {
        for m in [1, 3, 8] {
            // vectors per row (64) a multiple of the threads (32)
            run(
                &format!("{dt}_m{m}"),
                &[
                    ("M", m),
                    ("N", 8),
                    ("K", 512),
                    ("ROWS", 4),
                    ("WPB", 1),
                    ("F16", f16),
                ],
            );
        }
        // 9 vectors per row for 64 threads (the guarded tail), odd N, one row per block
        run(
            &format!("{dt}_tail_oddn"),
            &[
                ("M", 3),
                ("N", 3),
                ("K", 72),
                ("ROWS", 1),
                ("WPB", 2),
                ("F16", f16),
            ],
        );
        // more vectors per thread than it loads at once (loads in several rounds, the last
        // partial) and a tail: 8 rounds of 2 rows, 290 vectors for 32 threads
        run(
            &format!("{dt}_rounds"),
            &[
                ("M", 8),
                ("N", 6),
                ("K", 290 * 8),
                ("ROWS", 2),
                ("WPB", 1),
                ("F16", f16),
            ],
        );
    }
}

#[test]
fn gemv_fused_epilogues_match() {
    for (dt, f16) in [("bf16", 0), ("f16", 1)] {
        for m in [1, 3, 8] {
            run(
                &format!("{dt}_residual_m{m}"),
                &[
                    ("M", m),
                    ("N", 12),
                    ("K", 264),
                    ("ROWS", 4),
                    ("WPB", 1),
                    ("EPI", 1),
                    ("F16", f16),
                ],
            );
            run(
                &format!("{dt}_swiglu_m{m}"),
                &[
                    ("M", m),
                    ("N", 16),
                    ("K", 256),
                    ("ROWS", 4),
                    ("WPB", 2),
                    ("EPI", 2),
                    ("F16", f16),
                ],
            );
        }
    }
}

#[test]
fn gemv_fused_rms_norm_matches() {
    for (dt, f16) in [("bf16", 0), ("f16", 1)] {
        for m in [1, 3, 8] {
            // RMSNorm then SwiGLU (gate/up), with a tail (33 vectors for 32 threads)
            run(
                &format!("{dt}_norm_swiglu_m{m}"),
                &[
                    ("M", m),
                    ("N", 8),
                    ("K", 264),
                    ("ROWS", 2),
                    ("WPB", 1),
                    ("EPI", 2),
                    ("NORM", 1),
                    ("F16", f16),
                ],
            );
        }
        // and alone, as for an lm_head after the final norm
        run(
            &format!("{dt}_norm"),
            &[
                ("M", 3),
                ("N", 8),
                ("K", 1024),
                ("ROWS", 4),
                ("WPB", 2),
                ("NORM", 1),
                ("F16", f16),
            ],
        );
    }
}

#[test]
fn gemv_fused_rope_matches() {
    for (dt, f16) in [("bf16", 0), ("f16", 1)] {
        for m in [1, 3, 8] {
            // 4 query heads, 2 key and 2 value heads of 16, with the norm; row 1 at 70000
            run(
                &format!("{dt}_rope_norm_m{m}"),
                &[
                    ("M", m),
                    ("N", 8 * 16),
                    ("K", 512),
                    ("ROWS", 4),
                    ("WPB", 2),
                    ("NORM", 1),
                    ("HD", 16),
                    ("NQ", 4),
                    ("F16", f16),
                ],
            );
        }
        // Qwen2's q/k/v biases, added before RoPE, with the norm, plain and into the pool
        for kvw in [0, 1] {
            run(
                &format!("{dt}_rope_bias_kv{kvw}"),
                &[
                    ("M", 3),
                    ("N", 8 * 16),
                    ("K", 512),
                    ("ROWS", 4),
                    ("WPB", 2),
                    ("NORM", 1),
                    ("HD", 16),
                    ("NQ", 4),
                    ("BIAS", 1),
                    ("KVW", kvw),
                    ("F16", f16),
                ],
            );
        }
        // GQA 3:1 (3 q, 1 k, 1 v heads of 8), one pair per block, a tail, no norm
        run(
            &format!("{dt}_rope_tail"),
            &[
                ("M", 1),
                ("N", 5 * 8),
                ("K", 72),
                ("ROWS", 2),
                ("WPB", 1),
                ("HD", 8),
                ("NQ", 3),
                ("F16", f16),
            ],
        );
    }
}

#[test]
fn gemv_rope_into_the_kv_pool_matches() {
    // the q/k/v entry point that writes k and v into a layer's pool (the decode step's
    // cache write): q and the pool rows asked for as the plain RoPE entry point gives
    // them, no other row touched
    for (dt, f16) in [("bf16", 0), ("f16", 1)] {
        for m in [1, 3, 8] {
            run(
                &format!("{dt}_rope_kv_m{m}"),
                &[
                    ("M", m),
                    ("N", 8 * 16),
                    ("K", 512),
                    ("ROWS", 2),
                    ("WPB", 2),
                    ("NORM", 1),
                    ("HD", 16),
                    ("NQ", 4),
                    ("F16", f16),
                    ("KVW", 1),
                ],
            );
        }
    }
}

#[test]
fn gemv_with_the_launch_config() {
    // the rows and warps launch_config picks, on shapes of the 8B model's layers scaled
    // down in N (the launch depends on K and on which row counts divide N)
    run_launched("launch_qkv", 1, 48, 4096, &[("NORM", 1)]);
    run_launched("launch_down", 3, 8, 14336, &[("EPI", 1)]);
    run_launched("launch_gateup", 8, 20, 1024, &[("EPI", 2), ("NORM", 1)]);
}

#[test]
fn launch_code_refuses_what_the_kernel_does_not_take() {
    let (bf, f16) = ([Dtype::BF16, Dtype::BF16], [Dtype::F16, Dtype::F16]);
    assert!(gemv::shape_supported(1, 4096, 4096, bf));
    assert!(gemv::shape_supported(8, 6, 72, f16));
    // K not a multiple of 8 (the 16-byte vectors), batches above 8 off the tensor-core
    // path (N not whole tiles of 16) and above its 16, mixed or f32 dtypes
    assert!(!gemv::shape_supported(1, 4096, 4100, bf));
    assert!(!gemv::shape_supported(1, 16, 12, f16));
    assert!(!gemv::shape_supported(9, 4104, 4096, bf));
    assert!(!gemv::shape_supported(17, 4096, 4096, bf));
    assert!(!gemv::shape_supported(0, 4096, 4096, bf));
    assert!(!gemv::shape_supported(
        1,
        4096,
        4096,
        [Dtype::BF16, Dtype::F16]
    ));
    assert!(!gemv::shape_supported(
        1,
        4096,
        4096,
        [Dtype::F32, Dtype::F32]
    ));
    // every launch it takes divides N into whole blocks, and pairs rows where N is even
    for m in 1..=8 {
        for (n, k) in [
            (4096, 4096),
            (6144, 4096),
            (28672, 4096),
            (4096, 14336),
            (40, 72),
            (7, 8),
        ] {
            let l = gemv::launch_config(m, n, k);
            assert!(
                n.is_multiple_of(l.rows) && l.rows >= 1 && (1..=16).contains(&l.wpb),
                "{m} {n} {k}: {l:?}"
            );
            if n.is_multiple_of(2) {
                assert!(l.rows.is_multiple_of(2), "{m} {n} {k}: {l:?}");
            }
        }
    }
    // RoPE needs whole heads and as many key as value heads
    assert!(gemv::supports_rope(1, (32 + 16) * 128, 32, 128));
    assert!(!gemv::supports_rope(1, (32 + 15) * 128, 32, 128));
    assert!(!gemv::supports_rope(1, 48 * 128 + 64, 32, 128));
}

#[test]
fn gemv_tensor_cores_match() {
    // the MMA path: one or two tiles of 16 weight rows a warp, one or two tiles of 8 batch
    // rows (1-16 rows, the rows past M zero), K split over the warps with partial rounds
    // and a row end inside a chunk (K = 264: 33 vectors, the last chunk one vector)
    for (dt, f16) in [("bf16", 0), ("f16", 1)] {
        for (m, rows, wpb, k) in [
            (1, 16, 2, 264),
            (5, 32, 2, 512),
            (8, 16, 4, 1064),
            (12, 32, 1, 264),
            (16, 16, 2, 520),
        ] {
            run(
                &format!("{dt}_mma_m{m}_r{rows}"),
                &[
                    ("M", m),
                    ("N", 64),
                    ("K", k),
                    ("ROWS", rows),
                    ("WPB", wpb),
                    ("MMA", 1),
                    ("F16", f16),
                ],
            );
        }
    }
}

#[test]
fn gemv_tensor_cores_fused_match() {
    // the epilogues and the norm on the MMA path: the residual, SwiGLU of gate/up halves
    // (a block's first tile the gate rows), RMSNorm (x·w rounded to T for the fragments,
    // Σ x² from the lanes of each batch row), RoPE and the KV pool write
    for (dt, f16) in [("bf16", 0), ("f16", 1)] {
        let mma = [("MMA", 1), ("F16", f16)];
        for m in [4, 9] {
            let c = |extra: &[(&'static str, usize)]| {
                let mut v: Vec<(&'static str, usize)> = vec![("M", m)];
                v.extend_from_slice(extra);
                v.extend_from_slice(&mma);
                v
            };
            run(
                &format!("{dt}_mma_residual_m{m}"),
                &c(&[("N", 32), ("K", 264), ("ROWS", 16), ("WPB", 2), ("EPI", 1)]),
            );
            run(
                &format!("{dt}_mma_norm_swiglu_m{m}"),
                &c(&[
                    ("N", 64),
                    ("K", 520),
                    ("ROWS", 32),
                    ("WPB", 2),
                    ("EPI", 2),
                    ("NORM", 1),
                ]),
            );
            run(
                &format!("{dt}_mma_rope_norm_m{m}"),
                &c(&[
                    ("N", 8 * 16),
                    ("K", 512),
                    ("ROWS", 16),
                    ("WPB", 2),
                    ("NORM", 1),
                    ("HD", 16),
                    ("NQ", 4),
                ]),
            );
            run(
                &format!("{dt}_mma_rope_kv_bias_m{m}"),
                &c(&[
                    ("N", 8 * 16),
                    ("K", 512),
                    ("ROWS", 32),
                    ("WPB", 1),
                    ("NORM", 1),
                    ("HD", 16),
                    ("NQ", 4),
                    ("KVW", 1),
                    ("BIAS", 1),
                ]),
            );
        }
    }
}

#[test]
fn gemv_tensor_cores_with_their_launch() {
    // mma_launch's rows and warps on shapes of the 8B and 70B-rank layers scaled down in N
    // (two tiles a block from 8,192 rows, warps by K)
    for (m, n, k, extra) in [
        (8, 8192, 4096, vec![("NORM", 1)]),
        (6, 1280, 8192, vec![]),
        (4, 64, 14336, vec![("EPI", 1)]),
    ] {
        let l = gemv::mma_launch(n, k);
        assert!(
            l.mma && n.is_multiple_of(l.rows) && (1..=16).contains(&l.wpb),
            "{l:?}"
        );
        // (the emulation runs every block: keep N small, the launch as for the full shape)
        let n_run = 2 * l.rows;
        launched(&format!("mma_launch_{n}x{k}"), m, n_run, k, l, &extra);
    }
    // Qwen2's q/k/v with its biases into the pool at batches of 4-16: hidden 32 with 2
    // query heads and 1 kv head of 16, and the qwen2_bf16 fixture's hidden 24 (rows of 3
    // vectors: a partial chunk) with heads of 64
    for (n, k, hd) in [(64, 32, 16), (256, 24, 64)] {
        for m in [4, 5, 8, 12, 16] {
            let l = gemv::mma_launch(n, k);
            let extra = [("NORM", 1), ("HD", hd), ("NQ", 2), ("KVW", 1), ("BIAS", 1)];
            launched(
                &format!("mma_launch_qwen2_kv_bias_{n}x{k}_m{m}"),
                m,
                n,
                k,
                l,
                &extra,
            );
        }
    }
    assert_eq!(gemv::mma_launch(28672, 4096).rows, 32);
    assert_eq!(gemv::mma_launch(1280, 8192).rows, 16);
    assert_eq!(gemv::mma_launch(1280, 8192).wpb, 16);
    assert_eq!(gemv::mma_launch(28672, 4096).wpb, 8);
    assert_eq!(gemv::mma_launch(64, 72).wpb, 1);
}
