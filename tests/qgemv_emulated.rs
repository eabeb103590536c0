//! The quantized GEMV kernel (`kernels/qgemv.cu`) run on the CPU: its header and
//! body, exactly as MLX would wrap them, are compiled as C++ with a small CUDA
//! emulation (one OS thread per CUDA thread, `__syncthreads` and warp shuffles as
//! barriers) and compared with dequantize + matmul in double precision. This
//! checks the kernel's indexing, reduction and dequantisation math on machines
//! without a GPU (CI); `scripts/check_qgemv.py` checks it on one, against MLX.
use std::path::Path;

mod common;

const MAIN: &str = r#"
int main() {
  using bf = T;  // bfloat16, or float16 with F16 = 1
  std::mt19937 rng(1234);
  constexpr int OUT_N = EPI == 2 ? N / 2 : N;
  std::vector<bf> x(M * K), sc(N * (K / G)), bi(N * (K / G)), res(M * N), nw(K), y(M * OUT_N);
  std::vector<int32_t> pos;
  std::vector<float> inv;
  std::vector<bf> yq, ykv;
#if ROPE
  rope_inputs(M, HD, pos, inv);
  yq.resize(M * NQ * HD);
  ykv.resize(M * (N - NQ * HD));
#endif
  std::vector<uint32_t> w;
  std::vector<int> q;
  // (row 0 of x holds a NaN with NAN_X: every output of row 0 must be NaN)
  draw_quantized(rng, N, K, BITS, NAN_X, x, sc, bi, res, nw, w, q);
#if MMA_X
  // x rounded to int8 per group by the rounding kernel (XQ_TPB threads per block), the
  // GEMV's input
  std::vector<uint32_t> xq(size_t(M) * K / 4 + 2 * 8 * size_t(K / G), 0xDEADBEEFu);
  {
    constexpr int bpr = (K / 8 + XQ_TPB - 1) / XQ_TPB;
    blockDim.x = XQ_TPB;
    g_shfl.assign(XQ_TPB, 0.f);
    for (int blk = 0; blk < M * bpr; ++blk) {
      run_block(blk, XQ_TPB, [&] { kernel_xq(x.data(), nw.data(), xq.data()); });
    }
  }
  const uint32_t* xarg = xq.data();
#else
  const bf* xarg = x.data();
#endif
#if ROPE_KV
  KvPool<bf> kv(M, N / HD - NQ, HD);
#endif
  const int tpb = 32 * WPB;
  blockDim.x = tpb;
  g_shfl.assign(tpb, 0.f);
  g_mma.assign(6 * tpb, 0u);
  // PG > 0: the streaming path's grid of PG blocks, each looping over row groups
  for (int blk = 0; blk < (PG > 0 ? PG : N / ROWS); ++blk) {
    run_block(blk, tpb, [&] {
#if ROPE_KV
      kernel(xarg, w.data(), sc.data(), bi.data(), nw.data(), pos.data(), inv.data(), kv.pool.data(),
             kv.shape, kv.dst.data(), res.data(), yq.data());
#elif ROPE
      kernel(xarg, w.data(), sc.data(), bi.data(), nw.data(), pos.data(), inv.data(), res.data(),
             yq.data(), ykv.data());
#else
      kernel(xarg, w.data(), sc.data(), bi.data(), res.data(), nw.data(), y.data());
#endif
    });
  }
#if ROPE_KV
  // the pool's rows back into kv's layout; a row written that was not asked for fails
  if (!kv.read_back(ykv)) return 1;
#endif
  const std::vector<double> xin = ref_input(x, nw, M, K, NORM, EPS_BITS);
  // (BIAS: the q/k/v entry points add qb, here the first N values of res, before RoPE)
  auto dot = [&](int m, int n) {
    return ref_qdot(xin, q, sc, bi, K, G, m, n) + (BIAS ? double(float(res[n])) : 0.0);
  };
  if (NAN_X) {
    for (int n = 0; n < OUT_N; ++n)
      if (!std::isnan(float(y[n]))) { std::printf("max_err: y[%d] = %g is not NaN\n", n, float(y[n])); return 1; }
    std::printf("max_err 0 (row 0 all NaN)\n");
    return 0;
  }
  return ref_check(dot, M, N, EPI, HD, NQ, pos, inv, res, y, yq, ykv, XQ ? 2e-2 : 1e-2);
}
"#;

/// The kernel file split as mlxcel splits it (header, bodies).
fn kernel_parts() -> mlxcel::kernels::qgemv::Source {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/qgemv.cu");
    let text = std::fs::read_to_string(&path).unwrap();
    mlxcel::kernels::qgemv::split_source(&text).unwrap()
}

/// Compile and run the emulated kernel with template constants `consts`; the RoPE
/// entry point (`@@body_rope`) when they include `HD` and `NQ`.
fn run(tag: &str, consts: &[(&str, usize)]) {
    let parts = kernel_parts();
    let rope = consts.iter().any(|(n, _)| *n == "HD");
    // KVW = 1: the RoPE entry point that writes k and v into a KV pool (`@@body_rope_kv`)
    let rope_kv = consts.contains(&("KVW", 1));
    let consts: Vec<(&str, usize)> = consts
        .iter()
        .copied()
        .filter(|(n, _)| *n != "KVW")
        .collect();
    let consts = consts.as_slice();
    // MMA = 1: x comes from the rounding kernel (`@@body_xq`), as uint32 words
    let mma = consts.contains(&("MMA", 1));
    // F16 = 1: float16 activations, scales and biases (T = __half), else bfloat16
    let (mut src, t) = common::program_head(
        &parts.header,
        consts,
        &[("XQ", 0), ("MMA", 0), ("PG", 0), ("NAN_X", 0), ("BIAS", 0)],
    );
    let xin = if mma { "uint32_t" } else { t };
    if rope_kv {
        // inputs x, w, scales, biases, nw, pos, inv_freq, pool (and its shape, as MLX passes
        // it when the body names `pool_shape`), dst, qb and output q
        src += &format!(
            "void kernel(const {xin}* x, const uint32_t* w, const {t}* scales,\n\
                const {t}* biases, const {t}* nw, const int32_t* pos,\n\
                const float* inv_freq, const {t}* pool, const int* pool_shape,\n\
                const int32_t* dst, const {t}* qb, {t}* q) {{\n"
        );
        src += &parts.body_rope_kv;
    } else if rope {
        // the signature MLX generates for inputs x, w, scales, biases, nw, pos, inv_freq, qb
        // and outputs q, kv
        src += &format!(
            "void kernel(const {xin}* x, const uint32_t* w, const {t}* scales,\n\
                const {t}* biases, const {t}* nw, const int32_t* pos,\n\
                const float* inv_freq, const {t}* qb, {t}* q, {t}* kv) {{\n"
        );
        src += &parts.body_rope;
    } else {
        // the signature MLX generates for inputs x, w, scales, biases, res, nw and output y
        src += &format!(
            "void kernel(const {xin}* x, const uint32_t* w, const {t}* scales,\n\
                const {t}* biases, const {t}* res, const {t}* nw,\n\
                {t}* y) {{\n"
        );
        src += &parts.body;
    }
    src += "\n}\n";
    if mma {
        // inputs x, nw and output xq
        src += &format!("void kernel_xq(const {t}* x, const {t}* nw, uint32_t* xq) {{\n");
        src += &parts.body_xq;
        src += "\n}\n";
    }
    src += &format!(
        "#define ROPE {}\n#define ROPE_KV {}\n#define MMA_X {}\n",
        rope as i32, rope_kv as i32, mma as i32
    );
    src += MAIN;
    common::run_checked(&format!("qgemv-{tag}"), &src, &consts, "max_err");
}

#[test]
fn qgemv_4bit_matches_dequantize_matmul() {
    // chunks per row a multiple of threads per block
    run(
        "4bit_g64",
        &[
            ("M", 1),
            ("N", 8),
            ("K", 2048),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 2),
            ("WPB", 2),
        ],
    );
    // chunks per row (9) not a multiple of the threads (32): the guarded tail
    run(
        "4bit_tail",
        &[
            ("M", 4),
            ("N", 8),
            ("K", 288),
            ("G", 32),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 1),
        ],
    );
    // odd N with one row per block, fewer chunks than threads, group 128
    run(
        "4bit_oddn",
        &[
            ("M", 2),
            ("N", 3),
            ("K", 128),
            ("G", 128),
            ("BITS", 4),
            ("ROWS", 1),
            ("WPB", 2),
        ],
    );
}

#[test]
fn qgemv_8bit_matches_dequantize_matmul() {
    run(
        "8bit_g64",
        &[
            ("M", 3),
            ("N", 8),
            ("K", 1024),
            ("G", 64),
            ("BITS", 8),
            ("ROWS", 4),
            ("WPB", 4),
        ],
    );
    // eight warps per block (long rows: launch_config keeps loads per thread ≤ 28)
    run(
        "8bit_wpb8",
        &[
            ("M", 2),
            ("N", 8),
            ("K", 4096 + 512),
            ("G", 64),
            ("BITS", 8),
            ("ROWS", 4),
            ("WPB", 8),
            ("EPI", 1),
        ],
    );
    run(
        "8bit_g32_tail",
        &[
            ("M", 1),
            ("N", 6),
            ("K", 3 * 512 + 32),
            ("G", 32),
            ("BITS", 8),
            ("ROWS", 2),
            ("WPB", 2),
        ],
    );
}

#[test]
fn qgemv_fused_epilogues_match() {
    // residual add: y = res + x·Wᵀ
    run(
        "4bit_residual",
        &[
            ("M", 2),
            ("N", 8),
            ("K", 512),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 2),
            ("EPI", 1),
        ],
    );
    // SwiGLU of the two halves of a merged gate/up weight: a block takes rows of both
    run(
        "4bit_swiglu",
        &[
            ("M", 1),
            ("N", 16),
            ("K", 512),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 2),
            ("EPI", 2),
        ],
    );
    run(
        "8bit_swiglu_m3",
        &[
            ("M", 3),
            ("N", 12),
            ("K", 256),
            ("G", 32),
            ("BITS", 8),
            ("ROWS", 2),
            ("WPB", 1),
            ("EPI", 2),
        ],
    );
}

#[test]
fn qgemv_fused_rms_norm_matches() {
    // RMSNorm of x (weight nw, eps 1e-5) before the product, with SwiGLU as for gate/up
    run(
        "4bit_norm_swiglu",
        &[
            ("M", 2),
            ("N", 16),
            ("K", 1024),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 2),
            ("EPI", 2),
            ("NORM", 1),
        ],
    );
    // and alone, as for q/k/v, with the guarded tail (9 chunks per row, 32 threads)
    run(
        "8bit_norm_tail",
        &[
            ("M", 1),
            ("N", 6),
            ("K", 144),
            ("G", 16),
            ("BITS", 8),
            ("ROWS", 2),
            ("WPB", 1),
            ("NORM", 1),
        ],
    );
}

#[test]
fn qgemv_fused_rope_matches() {
    // merged q/k/v with RoPE: 4 query heads, 2 key and 2 value heads of 16, with the norm;
    // row 1 at position 70000; and (KVW) the same writing k and v into a KV pool (the
    // decode step's cache write); BIAS: with Qwen2's q/k/v biases added before RoPE
    for (tag, m, kvw, bias) in [
        ("4bit_rope_norm", 2, 0, 0),
        ("4bit_rope_kv_m1", 1, 1, 0),
        ("4bit_rope_kv_m3", 3, 1, 0),
        ("4bit_rope_bias", 2, 0, 1),
        ("4bit_rope_kv_bias_m3", 3, 1, 1),
    ] {
        run(
            tag,
            &[
                ("M", m),
                ("N", 8 * 16),
                ("K", 512),
                ("G", 64),
                ("BITS", 4),
                ("ROWS", 4),
                ("WPB", 2),
                ("NORM", 1),
                ("HD", 16),
                ("NQ", 4),
                ("KVW", kvw),
                ("BIAS", bias),
            ],
        );
    }
    // one row per pair half (ROWS 2), 8-bit, the guarded tail, GQA 3:1 (3 q, 1 k, 1 v)
    run(
        "8bit_rope_tail",
        &[
            ("M", 1),
            ("N", 5 * 8),
            ("K", 144),
            ("G", 16),
            ("BITS", 8),
            ("ROWS", 2),
            ("WPB", 1),
            ("HD", 8),
            ("NQ", 3),
        ],
    );
}

#[test]
fn qgemv_int8_activations_match() {
    // 4-bit weights with x quantized to int8 per 32 values (XQ = 1): plain (M = 1's launch,
    // 8 rows and 4 warps), the guarded tail with batch 4, SwiGLU with the norm, and the
    // RoPE entry point
    run(
        "4bit_xq",
        &[
            ("M", 1),
            ("N", 16),
            ("K", 2048),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 8),
            ("WPB", 4),
            ("XQ", 1),
        ],
    );
    // the launches mlxcel picks at M = 1 for the 8B down projection (K = 14336: 8 rows,
    // 8 warps, 2 chunks of each row per thread) and the 70B one (K = 28672: 4 rows, 8
    // warps, 4 chunks)
    run(
        "4bit_xq_8b_down",
        &[
            ("M", 1),
            ("N", 8),
            ("K", 14336),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 8),
            ("WPB", 8),
            ("EPI", 1),
            ("XQ", 1),
        ],
    );
    run(
        "4bit_xq_70b_down",
        &[
            ("M", 1),
            ("N", 8),
            ("K", 28672),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 8),
            ("EPI", 1),
            ("XQ", 1),
        ],
    );
    // a NaN in x reaches the output (int8 rounding would otherwise turn it into 0)
    run(
        "4bit_xq_nan",
        &[
            ("M", 2),
            ("N", 8),
            ("K", 512),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 1),
            ("XQ", 1),
            ("NAN_X", 1),
        ],
    );
    run(
        "4bit_xq_tail_m4_res",
        &[
            ("M", 4),
            ("N", 8),
            ("K", 288),
            ("G", 32),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 1),
            ("EPI", 1),
            ("XQ", 1),
        ],
    );
    run(
        "4bit_xq_norm_swiglu",
        &[
            ("M", 2),
            ("N", 16),
            ("K", 1024),
            ("G", 128),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 2),
            ("EPI", 2),
            ("NORM", 1),
            ("XQ", 1),
        ],
    );
    // M = 1 launches (16 rows × 8 warps as for K > 4096, 8 × 4 as for K ≤ 4096; short
    // rows here to keep the emulation quick): 8 pairs of the SwiGLU halves, 4 of RoPE's rows
    run(
        "4bit_xq_norm_swiglu_m1",
        &[
            ("M", 1),
            ("N", 32),
            ("K", 1024),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 16),
            ("WPB", 8),
            ("EPI", 2),
            ("NORM", 1),
            ("XQ", 1),
        ],
    );
    run(
        "4bit_xq_rope_m1",
        &[
            ("M", 1),
            ("N", 8 * 16),
            ("K", 512),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 8),
            ("WPB", 4),
            ("NORM", 1),
            ("HD", 16),
            ("NQ", 4),
            ("XQ", 1),
        ],
    );
    run(
        "4bit_xq_rope",
        &[
            ("M", 3),
            ("N", 8 * 16),
            ("K", 512),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 2),
            ("NORM", 1),
            ("HD", 16),
            ("NQ", 4),
            ("XQ", 1),
        ],
    );
}

/// The tensor-core path (`MMA = 1`: 16-row tiles, `mma.sync.m16n8k32` emulated lane by
/// lane as the PTX ISA lays out its fragments) with 4-bit weights and x rounded to int8
/// by the rounding kernel (`@@body_xq`, run first).
fn mma(
    m: usize,
    n: usize,
    k: usize,
    g: usize,
    rows: usize,
    wpb: usize,
) -> Vec<(&'static str, usize)> {
    vec![
        ("M", m),
        ("N", n),
        ("K", k),
        ("G", g),
        ("BITS", 4),
        ("ROWS", rows),
        ("WPB", wpb),
        ("XQ", 1),
        ("MMA", 1),
    ]
}

#[test]
fn qgemv_mma_matches_dequantize_matmul() {
    // every batch size from 1 to 8 (the padding columns of B are zero), group 64
    for m in 1..=8 {
        run(&format!("mma_m{m}"), &mma(m, 32, 512, 64, 16, 2));
    }
    // two tiles per block; groups 32 and 128 (one and four words per lane and group)
    run("mma_g32_tiles2", &mma(3, 64, 256, 32, 32, 2));
    run("mma_g128", &mma(8, 32, 1024, 128, 16, 2));
    // steps of 128 values per row (5) not a multiple of the warps (2): the last warp's
    // tail is zero
    run("mma_tail", &mma(5, 16, 640, 64, 16, 2));
    // warps with more steps than loads in flight (3; 4 with group 128), each group size
    // (the lanes' word exchanges differ)
    run("mma_deep", &mma(2, 16, 1024, 64, 16, 1));
    run("mma_deep_g32", &mma(8, 16, 2048, 32, 16, 2));
    run("mma_deep_g128", &mma(4, 32, 2048, 128, 32, 1));
    // the launch of a 70B down projection (K = 28672: 56 groups per warp of 8)
    run("mma_70b_down", &mma(3, 16, 28672, 64, 16, 8));
    // scales and biases come in chunks of CS steps (kernels/qgemv.cu): the cases above
    // take CS = 4 (16 bytes at group 64, 8 at 128), 2 and 1; group 128 with 1 and 2 steps
    // per chunk (2 and 4 bytes: halves of a word)
    run("mma_g128_cs1", &mma(2, 16, 384, 128, 16, 1));
    run("mma_g128_cs2", &mma(3, 16, 768, 128, 16, 3));
}

#[test]
fn qgemv_mma_epilogues_match() {
    let with = |mut c: Vec<(&'static str, usize)>, extra: &[(&'static str, usize)]| {
        c.extend_from_slice(extra);
        c
    };
    run(
        "mma_residual",
        &with(mma(6, 32, 512, 64, 16, 2), &[("EPI", 1)]),
    );
    // SwiGLU over a block's 16 gate rows and 16 up rows, with the norm
    run(
        "mma_norm_swiglu",
        &with(mma(4, 64, 512, 64, 32, 2), &[("EPI", 2), ("NORM", 1)]),
    );
    // RoPE: 4 query, 2 key, 2 value heads of 16; row 1 at position 70000; and (KVW) the
    // same writing k and v into a KV pool, as batched decode steps of 5-8 rows do
    for (tag, kvw, bias) in [
        ("mma_rope_norm", 0, 0),
        ("mma_rope_kv_norm", 1, 0),
        ("mma_rope_kv_norm_bias", 1, 1),
    ] {
        run(
            tag,
            &with(
                mma(7, 8 * 16, 512, 64, 16, 2),
                &[
                    ("NORM", 1),
                    ("HD", 16),
                    ("NQ", 4),
                    ("KVW", kvw),
                    ("BIAS", bias),
                ],
            ),
        );
    }
    // SwiGLU with one tile per block (8 gate rows and 8 up rows), group 32, the norm
    run(
        "mma_swiglu_rows16_g32",
        &with(mma(5, 32, 512, 32, 16, 2), &[("EPI", 2), ("NORM", 1)]),
    );
    // RoPE with two tiles per block (16 pairs over two heads of 16), group 128, the norm
    run(
        "mma_rope_rows32_g128",
        &with(
            mma(3, 6 * 16, 1024, 128, 32, 2),
            &[("NORM", 1), ("HD", 16), ("NQ", 2)],
        ),
    );
    // the rounding kernel's norm at a row longer than its blocks (K = 4608: 2 blocks of 256
    // threads per row), with the residual
    run(
        "mma_norm_res_2blocks",
        &with(mma(3, 16, 4608, 64, 16, 4), &[("EPI", 1), ("NORM", 1)]),
    );
    // a NaN in row 0 of x makes all of row 0 NaN
    run(
        "mma_nan",
        &with(mma(2, 16, 256, 64, 16, 1), &[("NAN_X", 1)]),
    );
}

#[test]
fn qgemv_streaming_matches() {
    // M = 1 with int8 activations, a grid of PG blocks streaming row groups through shared
    // memory: 8 groups of 2 rows over 3 blocks (3, 3 and 2 groups each, 4 stages deep),
    // with the residual; the RoPE case below has 6-7 groups per block, so its ring wraps
    run(
        "4bit_stream",
        &[
            ("M", 1),
            ("N", 16),
            ("K", 2048),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 2),
            ("WPB", 2),
            ("EPI", 1),
            ("XQ", 1),
            ("PG", 3),
        ],
    );
    // mlxcel's streaming launches for the 8B down projection (K = 14336: 2 rows per group,
    // 14 warps, 2 stages) and the 70B one (K = 28672: 1 row, 2 chunks per thread, 2 stages)
    run(
        "4bit_stream_8b_down",
        &[
            ("M", 1),
            ("N", 6),
            ("K", 14336),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 2),
            ("WPB", 14),
            ("EPI", 1),
            ("XQ", 1),
            ("PG", 2),
        ],
    );
    run(
        "4bit_stream_70b_down",
        &[
            ("M", 1),
            ("N", 4),
            ("K", 28672),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 1),
            ("WPB", 14),
            ("EPI", 1),
            ("XQ", 1),
            ("PG", 3),
        ],
    );
    // more blocks than row groups (2 groups, 3 blocks): the third only commits empty groups
    run(
        "4bit_stream_idle_block",
        &[
            ("M", 1),
            ("N", 4),
            ("K", 512),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 2),
            ("WPB", 1),
            ("XQ", 1),
            ("PG", 3),
        ],
    );
    // the guarded tail (49 chunks per row, 32 threads: 2 chunks each, the second of 15
    // threads out of the row), group 32 (odd groups take the high half of a scale word),
    // one row per group, with the norm
    run(
        "4bit_stream_tail_norm",
        &[
            ("M", 1),
            ("N", 6),
            ("K", 3 * 512 + 32),
            ("G", 32),
            ("BITS", 4),
            ("ROWS", 1),
            ("WPB", 1),
            ("NORM", 1),
            ("XQ", 1),
            ("PG", 4),
        ],
    );
    // SwiGLU of the merged gate/up halves with the norm (group 128), and the RoPE entry
    // point (4 query, 2 key, 2 value heads of 16)
    run(
        "4bit_stream_swiglu",
        &[
            ("M", 1),
            ("N", 32),
            ("K", 1024),
            ("G", 128),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 1),
            ("EPI", 2),
            ("NORM", 1),
            ("XQ", 1),
            ("PG", 3),
        ],
    );
    run(
        "4bit_stream_rope",
        &[
            ("M", 1),
            ("N", 8 * 16),
            ("K", 512),
            ("G", 64),
            ("BITS", 4),
            ("ROWS", 4),
            ("WPB", 1),
            ("NORM", 1),
            ("HD", 16),
            ("NQ", 4),
            ("XQ", 1),
            ("PG", 5),
        ],
    );
}

#[test]
fn qgemv_float16_matches() {
    // float16 activations, scales and biases (T = __half: GGUF models on a GPU) on each
    // path: float math (4- and 8-bit), int8 activations with dp4a and the norm, the
    // tensor cores at groups 32, 64 and 128 (one scale per step read as half a word),
    // the streaming launch and the RoPE entry point
    let f16 = |mut c: Vec<(&'static str, usize)>| {
        c.push(("F16", 1));
        c
    };
    let plain = |m, n, k, g, bits, rows, wpb| {
        vec![
            ("M", m),
            ("N", n),
            ("K", k),
            ("G", g),
            ("BITS", bits),
            ("ROWS", rows),
            ("WPB", wpb),
        ]
    };
    run("f16_4bit", &f16(plain(2, 8, 576, 32, 4, 2, 2)));
    run("f16_8bit_res", &{
        let mut c = f16(plain(3, 8, 1024, 32, 8, 4, 2));
        c.push(("EPI", 1));
        c
    });
    run("f16_xq_norm_swiglu", &{
        let mut c = f16(plain(1, 16, 576, 32, 4, 4, 2));
        c.extend_from_slice(&[("XQ", 1), ("EPI", 2), ("NORM", 1)]);
        c
    });
    run("f16_mma_g32", &f16(mma(4, 32, 512, 32, 16, 2)));
    run("f16_mma_g64_norm", &{
        let mut c = f16(mma(8, 32, 1024, 64, 16, 2));
        c.push(("NORM", 1));
        c
    });
    run("f16_mma_g128_cs1", &f16(mma(2, 16, 384, 128, 16, 1)));
    run("f16_stream", &{
        let mut c = f16(plain(1, 16, 2048, 64, 4, 2, 2));
        c.extend_from_slice(&[("EPI", 1), ("XQ", 1), ("PG", 3)]);
        c
    });
    run("f16_rope_norm", &{
        let mut c = f16(plain(2, 8 * 16, 512, 32, 4, 4, 2));
        c.extend_from_slice(&[("NORM", 1), ("HD", 16), ("NQ", 4)]);
        c
    });
    run("f16_mma_nan", &{
        let mut c = f16(mma(2, 16, 256, 64, 16, 1));
        c.push(("NAN_X", 1));
        c
    });
}

/// The one-kernel SwiGLU MLP (`@@body_mlp`): blocks of the gate/up stage, then of the down
/// stage, one at a time in index order (as a GPU starts them), twice with the same scratch
/// (the counts must be back at zero after each call), against gate/up, SwiGLU (rounded to
/// T, as the kernel stores it) and down in double precision.
const MAIN_MLP: &str = r#"
int main() {
  using bf = T;
  std::mt19937 rng(99);
  std::vector<bf> x(M * K), sc1(2 * NI * (K / G)), bi1(2 * NI * (K / G)), r1(M * 2 * NI), nw(K);
  std::vector<bf> xd(M * NI), sc2(K * (NI / G)), bi2(K * (NI / G)), res(M * K), nwd(NI), y(M * K);
  std::vector<uint32_t> w1, w2;
  std::vector<int> q1, q2;
  draw_quantized(rng, 2 * NI, K, BITS, false, x, sc1, bi1, r1, nw, w1, q1);
  draw_quantized(rng, K, NI, BITS, false, xd, sc2, bi2, res, nwd, w2, q2);
  std::vector<bf> act(4 * NI, bf(NAN));
  std::vector<int32_t> count(16, 0);
  constexpr int B = 2 * NI / R1 + K / R2;
  const int tpb = 32 * WPB;
  blockDim.x = tpb;
  g_shfl.assign(tpb, 0.f);
  g_mma.assign(6 * tpb, 0u);
  // the reference: act rounded to T as the kernel stores it, then the down product
  const std::vector<double> xin = ref_input(x, nw, M, K, NORM, EPS_BITS);
  std::vector<bf> actr(M * NI);
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < NI; ++i) {
      const double g = ref_qdot(xin, q1, sc1, bi1, K, G, m, i), u = ref_qdot(xin, q1, sc1, bi1, K, G, m, i + NI);
      actr[m * NI + i] = bf(float(g / (1.0 + std::exp(-g)) * u));
    }
  const std::vector<double> ain = ref_input(actr, nwd, M, NI, false, EPS_BITS);
  int status = 0;
  for (int run = 0; run < 2; ++run) {
    std::fill(y.begin(), y.end(), bf(NAN));
    for (int blk = 0; blk < B; ++blk) {
      run_block(blk, tpb, [&] {
        kernel(x.data(), w1.data(), sc1.data(), bi1.data(), nw.data(), w2.data(), sc2.data(), bi2.data(),
               res.data(), act.data(), count.data(), x.data(), y.data());
      });
    }
    if (count[0] != 0 || count[1] != 0 || count[2] != 0) {
      std::printf("max_err: counts left at %d, %d, %d\n", count[0], count[1], count[2]);
      return 1;
    }
    RefErr e;
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < K; ++n) {
        double r = ref_qdot(ain, q2, sc2, bi2, NI, G, m, n);
        if (EPI2 == 1) r += double(float(res[m * K + n]));
        e.add(r, double(float(y[m * K + n])));
      }
    std::printf("run %d: max_err %.3e max_ref %.3e rel %.3e\n", run, e.max_err, e.max_ref, e.max_err / e.max_ref);
    if (!(e.max_err / e.max_ref < (XQ ? 2e-2 : 1e-2))) status = 1;
  }
  return status;
}
"#;

/// Compile and run the one-kernel MLP with template constants `consts`.
fn run_mlp(tag: &str, consts: &[(&str, usize)]) {
    let parts = kernel_parts();
    assert!(!parts.body_mlp.trim().is_empty(), "no @@body_mlp part");
    // the MLP's norm (post-attention) comes with it: NORM 1 unless a test says otherwise
    let mut consts = consts.to_vec();
    if !consts.iter().any(|(n, _)| *n == "NORM") {
        consts.push(("NORM", 1));
    }
    let consts = consts.as_slice();
    let (mut src, t) = common::program_head(&parts.header, consts, &[("XQ", 0), ("EPI2", 1)]);
    // the signature MLX generates for inputs x, w1, s1, b1, nw, w2, s2, b2, res, act,
    // count, prev and output y
    src += &format!(
        "void kernel(const {t}* x, const uint32_t* w1, const {t}* s1, const {t}* b1,\n\
            const {t}* nw, const uint32_t* w2, const {t}* s2, const {t}* b2,\n\
            const {t}* res, const {t}* act, const int32_t* count, const {t}* prev, {t}* y) {{\n"
    );
    src += &parts.body_mlp;
    src += "\n}\n";
    src += MAIN_MLP;
    common::run_checked(&format!("qgemv-mlp-{tag}"), &src, &consts, "run 1: max_err");
}

#[test]
fn qgemv_mlp_matches_its_two_products() {
    // batch 1 with int8 activations, the stages' own rows per block (gate/up 8, down 4)
    run_mlp(
        "4bit_xq_m1",
        &[
            ("M", 1),
            ("NI", 256),
            ("K", 512),
            ("G", 64),
            ("BITS", 4),
            ("R1", 8),
            ("R2", 4),
            ("WPB", 2),
            ("XQ", 1),
        ],
    );
    // batch 3, float math, 8-bit, no residual (a tensor-parallel rank other than 0)
    run_mlp(
        "8bit_m3_nores",
        &[
            ("M", 3),
            ("NI", 128),
            ("K", 256),
            ("G", 32),
            ("BITS", 8),
            ("R1", 4),
            ("R2", 2),
            ("WPB", 1),
            ("EPI2", 0),
        ],
    );
    // float16, 4-bit float math at batch 2
    run_mlp(
        "4bit_f16_m2",
        &[
            ("M", 2),
            ("NI", 128),
            ("K", 384),
            ("G", 32),
            ("BITS", 4),
            ("R1", 4),
            ("R2", 4),
            ("WPB", 2),
            ("F16", 1),
        ],
    );
}
