//! The quantized GEMM (`kernels/qgemm.cu`, after `kernels/qgemv.cu`'s header as mlxcel
//! passes them to MLX) run on the CPU: compiled as C++ with the CUDA emulation of
//! `tests/common` (one OS thread per CUDA thread; `mma.sync.m16n8k16` lane by lane as the
//! PTX ISA lays out its fragments; bf16x2/f16x2 FMAs and conversions), every block of the
//! grid run in turn, and compared with x · dequantize(w)ᵀ in double precision (and the
//! epilogues after it). It checks the kernel's indexing, dequantization, fragment layout,
//! split-K reduction and epilogues without a GPU; `scripts/check_qgemm.py` checks it on
//! one against MLX. The last test plants bugs in the kernel file and checks they are caught.
use std::path::Path;

mod common;

const MAIN: &str = r#"
int main() {
  using bf = T;  // bfloat16, or float16 with F16 = 1
  constexpr int M = MROWS;  // the batch rows (MT: rounded up to whole tiles)
  constexpr int TPB = 32 * WR * WN;
  constexpr int BN = 32 * WR;
  constexpr int CB = (N + BN - 1) / BN;
  constexpr int NV = 2 * (MT / 8 / WN);
  std::mt19937 rng(4321);
  constexpr int OUT_N = EPI == 2 ? N / 2 : N;
  const bf sentinel = bf(12345.f);
  std::vector<bf> x(M * K), sc(N * (K / G)), bi(N * (K / G)), res(M * N), nw(K);
  // outputs with room past their end, which must stay as they were
  std::vector<bf> y(M * OUT_N + 64, sentinel);
  std::vector<int32_t> pos;
  std::vector<float> inv;
  std::vector<bf> yq, ykv;
#if ROPE
  rope_inputs(M, HD, pos, inv);
  yq.assign(M * NQ * HD + 64, sentinel);
  ykv.assign(M * (N - NQ * HD) + 64, sentinel);
#endif
  std::vector<uint32_t> w;
  std::vector<int> q;
  // (row 0 of x holds a NaN with NAN_X: every output of row 0 must be NaN, row 1 none)
  draw_quantized(rng, N, K, BITS, NAN_X, x, sc, bi, res, nw, w, q);
  // split-K scratch: every column block's tile, then every block's Σ x² partials; all zeros,
  // as the counts, and left so by every run
  std::vector<float> part(size_t(CB) * (NV * TPB * 4 + SK * MT), 0.f);
  std::vector<int32_t> count(CB, 0);
  // x as a [M, 1, K] array: MLX passes its shape padded to 10 dimensions with whatever
  // was in that memory (here nonzero junk, which the kernel must not read), and its ndim
  const int x_shape[10] = {M, 1, K, 7, 3, -1, 5, 9, 2, 11};
  const int x_ndim = 3;
  blockDim.x = TPB;
  g_shfl.assign(TPB, 0.f);
  g_mma.assign(6 * TPB, 0u);
  // twice: the second run finds the counts the first left (all zero) and must write the same
  for (int run = 0; run < 2; ++run) {
    for (int blk = 0; blk < CB * SK; ++blk) {
      run_block(blk, TPB, [&] {
#if ROPE
        kernel(x.data(), x_shape, x_ndim, w.data(), sc.data(), bi.data(), nw.data(), pos.data(), inv.data(),
               res.data(), part.data(), count.data(), x.data(), yq.data(), ykv.data(), y.data());
#else
        kernel(x.data(), x_shape, x_ndim, w.data(), sc.data(), bi.data(), res.data(), nw.data(), part.data(),
               count.data(), x.data(), y.data(), yq_unused());
#endif
      });
    }
    for (int c = 0; c < CB; ++c)
      if (count[c] != 0) { std::printf("max_err: count[%d] = %d after the run\n", c, count[c]); return 1; }
    for (size_t i = 0; i < part.size(); ++i)
      if (part[i] != 0.f) { std::printf("max_err: part[%zu] = %g after the run\n", i, part[i]); return 1; }
  }
  auto untouched = [&](const std::vector<bf>& v, size_t n, const char* what) {
    for (size_t i = n; i < v.size(); ++i)
      if (v[i].bits != sentinel.bits) { std::printf("max_err: %s[%zu] written past the end\n", what, i); return false; }
    return true;
  };
  const std::vector<double> xin = ref_input(x, nw, M, K, NORM, EPS_BITS);
  // (BIAS: the RoPE entry point adds qb, here the first N values of res, before the rotation)
  auto dot = [&](int m, int n) { return ref_qdot(xin, q, sc, bi, K, G, m, n) + (BIAS ? double(float(res[n])) : 0.0); };
#if ROPE
  if (!untouched(yq, M * NQ * HD, "q") || !untouched(ykv, M * (N - NQ * HD), "kv")) return 1;
#else
  if (!untouched(y, M * OUT_N, "y")) return 1;
#endif
  if (NAN_X) {
    for (int n = 0; n < OUT_N; ++n) {
      if (!std::isnan(float(y[n]))) { std::printf("max_err: y[%d] = %g is not NaN\n", n, float(y[n])); return 1; }
      if (std::isnan(float(y[OUT_N + n]))) { std::printf("max_err: y[1, %d] is NaN\n", n); return 1; }
    }
    std::printf("max_err 0 (row 0 all NaN, row 1 none)\n");
    return 0;
  }
  return ref_check(dot, M, N, EPI, HD, NQ, pos, inv, res, y, yq, ykv, 1e-2);
}
"#;

/// The GEMV's header followed by the GEMM file's header, plain body and RoPE body (after
/// `edit`, which plants a bug for the last test).
fn kernel_parts(edit: &dyn Fn(String) -> String) -> (String, String, String) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let gemv = std::fs::read_to_string(dir.join("qgemv.cu")).unwrap();
    let gemv_header = gemv
        .split_once("// @@header\n")
        .unwrap()
        .1
        .split_once("// @@body\n")
        .unwrap()
        .0;
    let text = edit(std::fs::read_to_string(dir.join("qgemm.cu")).unwrap());
    let (_, rest) = text.split_once("// @@header\n").unwrap();
    let (header, rest) = rest.split_once("// @@body\n").unwrap();
    let (body, body_rope) = rest.split_once("// @@body_rope\n").unwrap();
    (
        format!("{gemv_header}{header}"),
        body.to_string(),
        body_rope.to_string(),
    )
}

/// The test program for template constants `consts` (the RoPE entry point when they
/// include `HD`): the kernel in the signature MLX generates, then [`MAIN`].
fn program(consts: &[(&str, usize)], edit: &dyn Fn(String) -> String) -> String {
    let (header, body, body_rope) = kernel_parts(edit);
    let rope = consts.iter().any(|(n, _)| *n == "HD");
    let mt = consts.iter().find(|(n, _)| *n == "MT").map_or(8, |c| c.1);
    let (mut src, t) = common::program_head(
        &header,
        consts,
        &[
            ("NAN_X", 0),
            ("MROWS", mt),
            ("ST", 2),
            ("WN", 1),
            ("SK", 1),
            ("BIAS", 0),
        ],
    );
    if rope {
        // inputs x (with its shape and ndim), w, scales, biases, nw, pos, inv_freq, qb, part, count,
        // prev; outputs q, kv, tok
        src += &format!(
            "void kernel(const {t}* x, const int* x_shape, int x_ndim, const uint32_t* w, const {t}* scales,\n\
                const {t}* biases, const {t}* nw, const int32_t* pos, const float* inv_freq, const {t}* qb,\n\
                const float* part, const int32_t* count, const {t}* prev, {t}* q, {t}* kv, {t}* tok) {{\n"
        );
        src += &body_rope;
    } else {
        // inputs x (with its shape and ndim), w, scales, biases, res, nw, part, count, prev; outputs y, tok
        src += &format!(
            "static {t}* yq_unused() {{ return nullptr; }}\n\
             void kernel(const {t}* x, const int* x_shape, int x_ndim, const uint32_t* w, const {t}* scales,\n\
                const {t}* biases, const {t}* res, const {t}* nw, const float* part,\n\
                const int32_t* count, const {t}* prev, {t}* y, {t}* tok) {{\n"
        );
        src += &body;
    }
    src += "\n}\n";
    src += &format!("#define ROPE {}\n", rope as i32);
    src += MAIN;
    src
}

/// Template constants of a test program.
type Consts = Vec<(&'static str, usize)>;

fn run(tag: &str, consts: &[(&str, usize)]) {
    let src = program(consts, &|s| s);
    common::run_checked(&format!("qgemm-{tag}"), &src, &consts, "max_err");
}

/// Template constants of a launch: batch rows `m` (MT: `m` rounded up to tiles of 8), a
/// `[n, k]` weight of `bits` in groups of `g`, `wr` warp rows (32 weight rows each), `wn`
/// warps splitting the n-tiles, `sk` splits of K.
#[allow(clippy::too_many_arguments)]
fn cfg(
    m: usize,
    n: usize,
    k: usize,
    g: usize,
    bits: usize,
    wr: usize,
    wn: usize,
    sk: usize,
) -> Consts {
    vec![
        ("MROWS", m),
        ("MT", m.div_ceil(8) * 8),
        ("N", n),
        ("K", k),
        ("G", g),
        ("BITS", bits),
        ("WR", wr),
        ("WN", wn),
        ("SK", sk),
    ]
}

fn with(mut c: Consts, extra: &[(&'static str, usize)]) -> Consts {
    c.extend_from_slice(extra);
    c
}

#[test]
fn qgemm_4bit_matches_dequantize_matmul() {
    // every group size; M = 9 (one row past a tile), 16, 33 (5 tiles), 128 (two warps per
    // row of tiles); N not a multiple of the block's 64 rows (a tail of 16 and of 7 rows)
    run("4bit_m9_g64", &cfg(9, 64 + 16, 256, 64, 4, 2, 1, 1));
    run("4bit_m16_g32_tail7", &cfg(16, 32 + 7, 384, 32, 4, 1, 1, 1));
    run("4bit_m33_g128", &cfg(33, 64, 512, 128, 4, 2, 1, 1));
    run("4bit_m128_wn2", &cfg(128, 64, 256, 64, 4, 2, 2, 1));
    // wide blocks (8 warps, 256 weight rows: `qgemm::BLOCK_WARPS`): the norm and 2 splits
    // over two column blocks, the second a tail of 48 rows
    run(
        "4bit_m40_wide_norm_split",
        &with(
            cfg(40, 256 + 48, 512, 64, 4, 8, 1, 2),
            &[("NORM", 1), ("ST", 3)],
        ),
    );
    // their scale blocks (SB steps' scales copied at once, two slots): groups of 32 over 3
    // blocks of 4 steps with the ring at its deepest for them (ST - 1 = SB: a slot refilled
    // the step after its last use); groups of 128 in 4-byte pieces, 2 splits of 10 steps
    // (a partial block of 16)
    run(
        "4bit_m17_wide_g32_blocks",
        &with(cfg(17, 256, 1536, 32, 4, 8, 1, 1), &[("ST", 5)]),
    );
    run(
        "4bit_m20_wide_g128_pieces",
        &with(cfg(20, 256 + 32, 2560, 128, 4, 8, 1, 2), &[("ST", 3)]),
    );
    // groups of 32, 2 splits of 9 steps: blocks of 4, 4 and 1 steps in 8-byte pieces
    run(
        "4bit_m12_wide_g32_split_blocks",
        &with(cfg(12, 256, 128 * 18, 32, 4, 8, 1, 2), &[("ST", 4)]),
    );
    // the bounded flavour's launches (MLXCEL_QGEMM_BOUNDED): two warps share 2 or 4 tiles
    run("4bit_m16_wn2", &cfg(16, 64, 256, 64, 4, 2, 2, 1));
    run(
        "4bit_m32_wn2_norm_split",
        &with(cfg(27, 64, 512, 64, 4, 2, 2, 2), &[("NORM", 1), ("ST", 3)]),
    );
    // rings of 3 stages over 5 steps, 6 over 7 (a second round of the ring), and more
    // stages than steps (5 over 3)
    run(
        "4bit_st3",
        &with(cfg(12, 32, 640, 64, 4, 1, 1, 1), &[("ST", 3)]),
    );
    run(
        "4bit_st6_norm",
        &with(cfg(24, 64, 896, 64, 4, 2, 1, 1), &[("ST", 6), ("NORM", 1)]),
    );
    run(
        "4bit_st5_short",
        &with(cfg(12, 32, 384, 32, 4, 1, 1, 1), &[("ST", 5)]),
    );
    run(
        "8bit_st4_split",
        &with(cfg(40, 64, 1024, 64, 8, 2, 1, 2), &[("ST", 4)]),
    );
}

/// A launch run with the kernel file's tuning switches set (defined before its header, as
/// a file sent through `MLXCEL_QGEMM_SOURCE` may).
fn run_switched(tag: &str, defines: &str, consts: &[(&str, usize)]) {
    let edit = |s: String| s.replacen("// @@header\n", &format!("// @@header\n{defines}"), 1);
    let src = program(consts, &edit);
    common::run_checked(&format!("qgemm-{tag}"), &src, &consts, "max_err");
}

#[test]
fn qgemm_tuning_switches_match() {
    // x paired by a pass over the stage instead of each warp's fragment loads (without the
    // norm), the word loop unrolled (4-bit, up to 32 rows; the pipeline off, which it would
    // replace), and not pipelined (the default dequantizes each word during the one before's
    // MMAs up to 64 rows), each with the plain and residual epilogues and at 8 bits
    for (tag, d) in [
        ("pair_pass", "#define MLXCEL_QGEMM_XPAIR 1\n"),
        (
            "unroll4",
            "#define MLXCEL_QGEMM_CUNROLL 4\n#define MLXCEL_QGEMM_PIPE 0\n",
        ),
        (
            "unroll2_pair_pass",
            "#define MLXCEL_QGEMM_CUNROLL 2\n#define MLXCEL_QGEMM_XPAIR 1\n#define MLXCEL_QGEMM_PIPE 0\n",
        ),
        ("pipe_off", "#define MLXCEL_QGEMM_PIPE 0\n"),
    ] {
        run_switched(
            &format!("{tag}_m24"),
            d,
            &cfg(24, 64 + 16, 384, 64, 4, 2, 1, 1),
        );
        run_switched(
            &format!("{tag}_res_split"),
            d,
            &with(cfg(32, 64, 512, 32, 4, 2, 2, 2), &[("EPI", 1), ("ST", 3)]),
        );
        run_switched(&format!("{tag}_8bit"), d, &cfg(17, 32, 256, 64, 8, 1, 1, 1));
    }
}

/// The kernel file's warpgroup-MMA flavour (`MLXCEL_QGEMM_WGMMA`: x read by the tensor cores
/// from the stage through matrix descriptors, the emulated `wgmma` decoding them).
const WGMMA: &str = "#define MLXCEL_QGEMM_WGMMA 1\n";
/// Its switch carrying a step's last wgmmas into the next step (`MLXCEL_QGEMM_CARRY`).
const CARRY: &str = "#define MLXCEL_QGEMM_CARRY 1\n";

#[test]
fn qgemm_wgmma_matches() {
    // one warpgroup (4 warps): 24 rows in two wgmmas (16 + 8 columns), a tail of 16 rows
    run_switched("wg_m24", WGMMA, &cfg(24, 128 + 16, 384, 64, 4, 4, 1, 1));
    // two warpgroups (the wide block): 64 rows with the norm, 2 splits over two column
    // blocks (the second a tail of 48 rows); 40 rows (32 + 8) in groups of 32 over scale blocks
    run_switched(
        "wg_m64_norm_split",
        WGMMA,
        &with(
            cfg(64, 256 + 48, 512, 64, 4, 8, 1, 2),
            &[("NORM", 1), ("ST", 3)],
        ),
    );
    run_switched(
        "wg_m40_g32_blocks",
        WGMMA,
        &with(cfg(40, 256, 1536, 32, 4, 8, 1, 1), &[("ST", 4)]),
    );
    // 128 rows in one wgmma; SwiGLU; the residual; 8 bits; float16
    run_switched("wg_m128_g128", WGMMA, &cfg(128, 128, 256, 128, 4, 4, 1, 1));
    run_switched(
        "wg_m17_swiglu_norm",
        WGMMA,
        &with(
            cfg(17, 256, 384, 64, 4, 4, 1, 1),
            &[("EPI", 2), ("NORM", 1)],
        ),
    );
    run_switched(
        "wg_m32_res_split",
        WGMMA,
        &with(cfg(32, 128, 512, 32, 4, 4, 1, 2), &[("EPI", 1), ("ST", 3)]),
    );
    run_switched("wg_m20_8bit", WGMMA, &cfg(20, 128, 512, 64, 8, 4, 1, 1));
    // 8-bit from 5 rows (`qgemm::MIN_M`): one tile, one wgmma of 8 columns
    run_switched("wg_m5_8bit", WGMMA, &cfg(5, 128, 256, 64, 8, 4, 1, 1));
    run_switched(
        "wg_m48_8bit_norm_split",
        WGMMA,
        &with(
            cfg(48, 256, 1024, 64, 8, 8, 1, 2),
            &[("NORM", 1), ("ST", 3)],
        ),
    );
    run_switched(
        "wg_m24_f16",
        WGMMA,
        &with(cfg(24, 128, 256, 64, 4, 4, 1, 1), &[("F16", 1)]),
    );
    // x's pass between the step's barriers instead of a step ahead (MLXCEL_QGEMM_XAHEAD 0)
    run_switched(
        "wg_m64_norm_split_in_step",
        &format!("{WGMMA}#define MLXCEL_QGEMM_XAHEAD 0\n"),
        &with(
            cfg(64, 256 + 48, 512, 64, 4, 8, 1, 2),
            &[("NORM", 1), ("ST", 3)],
        ),
    );
    // a step's last wgmmas carried into the next step (MLXCEL_QGEMM_CARRY): 4 stages (2 steps
    // of copies in flight, x a step ahead), 3 (one step, x in the step), 8 bits
    let carry = format!("{WGMMA}{CARRY}");
    run_switched(
        "wg_m64_norm_split_carry_st4",
        &carry,
        &with(
            cfg(64, 256 + 48, 1024, 64, 4, 8, 1, 2),
            &[("NORM", 1), ("ST", 4)],
        ),
    );
    run_switched(
        "wg_m40_g32_blocks_carry_st3",
        &carry,
        &with(cfg(40, 256, 1536, 32, 4, 8, 1, 1), &[("ST", 3)]),
    );
    run_switched(
        "wg_m24_8bit_res_carry_st3",
        &carry,
        &with(cfg(24, 128, 1024, 64, 8, 4, 1, 1), &[("EPI", 1), ("ST", 3)]),
    );
    // the q/k/v entry point with RoPE (2 query heads, 1 key and 1 value head of 64) and the bias
    run_switched(
        "wg_rope_m24_norm",
        WGMMA,
        &with(
            cfg(24, 256, 256, 64, 4, 4, 1, 1),
            &[("HD", 64), ("NQ", 2), ("NORM", 1), ("BIAS", 1)],
        ),
    );
}

#[test]
fn qgemm_8bit_matches_dequantize_matmul() {
    // M = 5 (the 8-bit default's smallest batch: one tile, three rows of padding)
    run("8bit_m5_g64", &cfg(5, 64, 256, 64, 8, 2, 1, 1));
    run("8bit_m9_g32", &cfg(9, 64, 256, 32, 8, 2, 1, 1));
    run("8bit_m16_g64_tail", &cfg(16, 32 + 5, 384, 64, 8, 1, 1, 1));
    run("8bit_m33_g128", &cfg(33, 64, 512, 128, 8, 2, 1, 1));
    run("8bit_m128", &cfg(128, 32, 256, 64, 8, 1, 2, 1));
    // a wide block (8 warps, 256 weight rows: `qgemm::BLOCK_WARPS`), a tail of 16 rows
    run(
        "8bit_m24_wide",
        &with(cfg(24, 256 + 16, 512, 32, 8, 8, 1, 1), &[("ST", 2)]),
    );
}

#[test]
fn qgemm_split_k_matches() {
    // K split over 2, 4 and 3 blocks per column block (the last adds the others' partials),
    // with the norm's Σ x² split the same way; two column blocks, one with a tail
    run("split2", &cfg(9, 64 + 16, 512, 64, 4, 1, 1, 2));
    run(
        "split4_norm",
        &with(cfg(20, 32, 512, 32, 4, 1, 1, 4), &[("NORM", 1)]),
    );
    run(
        "split3_8bit_res",
        &with(cfg(40, 48, 384, 128, 8, 1, 1, 3), &[("EPI", 1)]),
    );
    run(
        "split2_m128_norm_swiglu",
        &with(
            cfg(128, 64, 256, 64, 4, 1, 2, 2),
            &[("EPI", 2), ("NORM", 1)],
        ),
    );
}

#[test]
fn qgemm_epilogues_match() {
    // residual add; SwiGLU of the merged halves (N/2 = 40: a tail of 8 pairs); with the norm
    run(
        "res_m16",
        &with(cfg(16, 64, 256, 64, 4, 2, 1, 1), &[("EPI", 1)]),
    );
    run(
        "swiglu_m9_tail",
        &with(cfg(9, 80, 256, 32, 4, 2, 1, 1), &[("EPI", 2)]),
    );
    // a wide block's pairs (128 a block; N/2 = 160: a second block of 32)
    run(
        "swiglu_m20_wide",
        &with(cfg(20, 2 * 160, 256, 64, 4, 8, 1, 1), &[("EPI", 2)]),
    );
    run(
        "norm_swiglu_8bit",
        &with(cfg(33, 64, 384, 64, 8, 1, 1, 1), &[("EPI", 2), ("NORM", 1)]),
    );
    run(
        "norm_res_m128",
        &with(
            cfg(128, 32, 256, 128, 4, 1, 2, 1),
            &[("EPI", 1), ("NORM", 1)],
        ),
    );
    run(
        "norm_plain_m9",
        &with(cfg(9, 48, 256, 64, 4, 1, 1, 1), &[("NORM", 1)]),
    );
}

#[test]
fn qgemm_rope_matches() {
    // q/k/v with RoPE: 4 query, 2 key, 2 value heads of 16 (pairs straddle heads within a
    // tile), the norm; row 1 at position 70000
    run(
        "rope_m9",
        &with(
            cfg(9, 8 * 16, 256, 64, 4, 2, 1, 1),
            &[("NORM", 1), ("HD", 16), ("NQ", 4)],
        ),
    );
    // heads of 64 (GQA 3:1: 3 q, 1 k, 1 v), 8-bit, split-K, a tail of pairs (160 / 64)
    run(
        "rope_8bit_split_m17",
        &with(
            cfg(17, 5 * 64, 256, 32, 8, 2, 1, 2),
            &[("NORM", 1), ("HD", 64), ("NQ", 3)],
        ),
    );
    // Qwen2's q/k/v biases, added before the rotation: both cases again with BIAS
    run(
        "rope_bias_m9",
        &with(
            cfg(9, 8 * 16, 256, 64, 4, 2, 1, 1),
            &[("NORM", 1), ("HD", 16), ("NQ", 4), ("BIAS", 1)],
        ),
    );
    run(
        "rope_bias_8bit_split_m17",
        &with(
            cfg(17, 5 * 64, 256, 32, 8, 2, 1, 2),
            &[("NORM", 1), ("HD", 64), ("NQ", 3), ("BIAS", 1)],
        ),
    );
}

#[test]
fn qgemm_float16_matches() {
    let f16 = |c: Consts| with(c, &[("F16", 1)]);
    run("f16_4bit_m9", &f16(cfg(9, 64, 256, 64, 4, 2, 1, 1)));
    run("f16_8bit_m33_split", &f16(cfg(33, 32, 512, 32, 8, 1, 1, 2)));
    run(
        "f16_norm_swiglu_m16",
        &f16(with(
            cfg(16, 64, 256, 128, 4, 1, 1, 1),
            &[("EPI", 2), ("NORM", 1)],
        )),
    );
    run(
        "f16_rope_m12",
        &f16(with(
            cfg(12, 8 * 16, 256, 64, 4, 2, 1, 1),
            &[("NORM", 1), ("HD", 16), ("NQ", 4)],
        )),
    );
    run(
        "f16_res_m128",
        &f16(with(cfg(128, 32, 256, 64, 8, 1, 2, 1), &[("EPI", 1)])),
    );
}

#[test]
fn qgemm_nan_reaches_its_row_only() {
    run(
        "nan_4bit",
        &with(cfg(9, 32, 256, 64, 4, 1, 1, 1), &[("NAN_X", 1)]),
    );
    run(
        "nan_8bit_norm",
        &with(
            cfg(16, 32, 256, 64, 8, 1, 1, 2),
            &[("NAN_X", 1), ("NORM", 1)],
        ),
    );
}

/// The tests above fail when the kernel is wrong: bugs planted in the kernel file (the B
/// fragments' pairing, in the warps' loads and in the pair pass; one nibble of the 4-bit
/// unpacking, one split's partial left out of the sum, the sum left in the scratch for the
/// next call, the 8-bit byte order, the epilogue's rows of the
/// second tile, x's slots in a stage, the 8-bit weights' swizzle, the words the pipelined
/// loop reads from the stage above 32 rows, a step copied into the slot still being read,
/// the scale blocks' slot, and a scale block refilled while still read) each make a run fail.
#[test]
fn planted_bugs_are_caught() {
    let cases: [(&str, &str, &str, Consts); 12] = [
        (
            "pairs",
            "b1 = __byte_perm(v.x, v.z, 0x7632)",
            "b1 = __byte_perm(v.x, v.z, 0x3276)",
            cfg(9, 32, 256, 64, 4, 1, 1, 1),
        ),
        (
            "nibble",
            "0x000F000Fu) | mlxcel_k16",
            "0x000F0007u) | mlxcel_k16",
            cfg(9, 32, 256, 64, 4, 1, 1, 1),
        ),
        // split-K: one split's partial tile left out of the sum; the sum left in the scratch
        // (the next run adds to it)
        (
            "split",
            "        mlxcel_red_add4(tile + (i * NTW + j) * TPB + tid,",
            "        if (split != 0) mlxcel_red_add4(tile + (i * NTW + j) * TPB + tid,",
            cfg(9, 32, 512, 64, 4, 1, 1, 2),
        ),
        (
            "split-unzeroed",
            "  *p = make_float4(0.f, 0.f, 0.f, 0.f);",
            "",
            cfg(9, 32, 512, 64, 4, 1, 1, 2),
        ),
        (
            "bytes",
            "0x7540 + j)) - 8388608.f;\n      const float c",
            "0x7540 + (j ^ 1))) - 8388608.f;\n      const float c",
            cfg(9, 32, 256, 32, 8, 1, 1, 1),
        ),
        (
            "tile2",
            "const int n = cb * BN + wr_ * 32 + i * 16 + r;",
            "const int n = cb * BN + wr_ * 32 + i * 8 + r;",
            cfg(16, 64, 256, 64, 4, 2, 1, 1),
        ),
        (
            "x-slots",
            "st[W16 + m * 16 + ((4 * c + t) ^ (4 * (m & 1)))]",
            "st[W16 + m * 16 + (4 * c + t)]",
            cfg(9, 32, 256, 64, 4, 1, 1, 1),
        ),
        (
            "8bit-swizzle",
            "return st + r * BITS + (BITS == 8 ? (q ^ (r & 1)) : q);",
            "return st + r * BITS + q;",
            cfg(9, 32, 256, 64, 8, 1, 1, 1),
        ),
        (
            "stage-words",
            "lo = p[k];",
            "lo = p[k ^ 1];",
            cfg(33, 32, 256, 64, 4, 1, 1, 1),
        ),
        (
            "ring-slot",
            "copy(s + AH, (s + AH) % ST);",
            "copy(s + AH, (s + AH - 1) % ST);",
            with(cfg(9, 32, 640, 64, 4, 1, 1, 1), &[("ST", 3)]),
        ),
        (
            "scale-block-slot",
            "sbuf + ((s / SB) % 2) * 4 * BN",
            "sbuf + ((s / SB + 1) % 2) * 4 * BN",
            with(cfg(9, 256, 1024, 64, 4, 8, 1, 1), &[("ST", 3)]),
        ),
        (
            "scale-block-refill",
            "SB >= ST - 1;",
            "SB >= ST - 3;",
            with(cfg(9, 256, 2048, 32, 4, 8, 1, 1), &[("ST", 6)]),
        ),
    ];
    for (tag, from, to, consts) in cases {
        let src = program(&consts, &|s: String| {
            assert!(s.contains(from), "{tag}: `{from}` not in kernels/qgemm.cu");
            s.replacen(from, to, 1)
        });
        let (ok, out) = common::compile_and_run(&format!("qgemm-bug-{tag}"), &src);
        eprintln!("qgemm-bug-{tag}: {}", out.trim());
        assert!(!ok, "planted bug `{tag}` was not caught: {out}");
    }
    // the pair pass (MLXCEL_QGEMM_XPAIR 1) with two of its pairs swapped
    let (from, to) = (
        "make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),",
        "make_uint4(__byte_perm(v.x, v.z, 0x7632), __byte_perm(v.x, v.z, 0x5410),",
    );
    let src = program(&cfg(9, 32, 256, 64, 4, 1, 1, 1), &|s: String| {
        assert!(
            s.contains(from),
            "pair pass: `{from}` not in kernels/qgemm.cu"
        );
        s.replacen(
            "// @@header\n",
            "// @@header\n#define MLXCEL_QGEMM_XPAIR 1\n",
            1,
        )
        .replacen(from, to, 1)
    });
    let (ok, out) = common::compile_and_run("qgemm-bug-pair-pass", &src);
    eprintln!("qgemm-bug-pair-pass: {}", out.trim());
    assert!(!ok, "planted bug `pair-pass` was not caught: {out}");
    // the wgmma flavour (with the tuning switches each needs): B's core matrices along K read
    // 256 bytes apart instead of 128, and a word's second wgmma reading the first one's pairs of x
    for (tag, from, to, switches) in [
        (
            "wgmma-lbo",
            "xa + (4 * c + 2 * h2) * WG_LBO, WG_LBO, WG_SBO, ring",
            "xa + (4 * c + 2 * h2) * WG_LBO, 2 * WG_LBO, WG_SBO, ring",
            "",
        ),
        (
            "wgmma-pairs",
            "xa + (4 * c + 2 * h2) * WG_LBO, WG_LBO, WG_SBO, ring",
            "xa + (4 * c) * WG_LBO, WG_LBO, WG_SBO, ring",
            "",
        ),
        (
            "wgmma-x-ahead-slot",
            "XAHEAD && s + 1 < NS ? (s + 1) % ST : -1",
            "XAHEAD && s + 1 < NS ? (s + 2) % ST : -1",
            "",
        ),
        // carried wgmmas with the ring refilled as without them: the slot the tensor cores
        // still read (the emulated wgmma reads it when its group is waited for)
        (
            "wgmma-carry-refill",
            "constexpr int AH = CARRY ? ST - 2 : ST - 1;",
            "constexpr int AH = ST - 1;",
            CARRY,
        ),
    ] {
        let consts = with(cfg(24, 128, 640, 64, 4, 4, 1, 1), &[("ST", 3)]);
        let src = program(&consts, &|s: String| {
            assert!(s.contains(from), "{tag}: `{from}` not in kernels/qgemm.cu");
            s.replacen(
                "// @@header\n",
                &format!("// @@header\n{WGMMA}{switches}"),
                1,
            )
            .replacen(from, to, 1)
        });
        let (ok, out) = common::compile_and_run(&format!("qgemm-bug-{tag}"), &src);
        eprintln!("qgemm-bug-{tag}: {}", out.trim());
        assert!(!ok, "planted bug `{tag}` was not caught: {out}");
    }
}
