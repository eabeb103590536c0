//! The Qwen3 q/k norm + RoPE + cache write kernel (`kernels/qk_rope.cu`) run on the CPU (see
//! `common`) and compared with a float64 reference of MLX's ops: per-head RMSNorm of the
//! query and key heads (rounded to the dtype, as `rms_norm`'s output), half-split RoPE, and
//! the key and value heads at their pool rows (no other row written), in bfloat16 and
//! float16, head_dim 64 and 128, batch rows 1 and 3 (row 1 at position 70000).
mod common;
use common::PRELUDE;

const MAIN: &str = r#"
int main() {
  using bf = T;
  constexpr int H = NQ + 2 * NKV;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  std::vector<bf> y(size_t(M) * H * HD), qw(HD), kw(HD), q(size_t(M) * NQ * HD, bf(-777.f));
  for (auto& v : y) v = bf(u(rng));
  for (auto& v : qw) v = bf(0.5f + 0.25f * u(rng));
  for (auto& v : kw) v = bf(0.5f + 0.25f * u(rng));
  std::vector<int32_t> pos;
  std::vector<float> inv;
  rope_inputs(M, HD, pos, inv);
  KvPool<bf> kv(M, 2 * NKV, HD);
  constexpr int tpb = HD / 2;
  blockDim.x = tpb;
  g_shfl.assign(tpb, 0.f);
  for (int blk = 0; blk < M * H; ++blk)
    run_block(blk, tpb, [&] {
      kernel(y.data(), qw.data(), kw.data(), pos.data(), inv.data(), kv.pool.data(), kv.shape,
             kv.dst.data(), q.data());
    });
  std::vector<bf> ykv(size_t(M) * 2 * NKV * HD, bf(-777.f));
  if (!kv.read_back(ykv)) return 1;
  float eps; int eb = EPS_BITS; std::memcpy(&eps, &eb, 4);
  double max_err = 0, max_ref = 0;
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < H; ++h) {
      const bf* src = &y[(size_t(m) * H + h) * HD];
      std::vector<double> r(HD);
      for (int d = 0; d < HD; ++d) r[d] = double(float(src[d]));
      if (h < NQ + NKV) {
        double ss = 0;
        for (int d = 0; d < HD; ++d) ss += r[d] * r[d];
        const double s = 1.0 / std::sqrt(ss / HD + double(eps));
        const bf* g = h < NQ ? qw.data() : kw.data();
        for (int d = 0; d < HD; ++d) r[d] = double(float(bf(float(r[d] * s * double(float(g[d]))))));
        for (int d = 0; d < HD / 2; ++d) {
          const double th = double(pos[m]) * double(inv[d]);
          const double a = r[d], c = r[d + HD / 2];
          r[d] = a * std::cos(th) - c * std::sin(th);
          r[d + HD / 2] = a * std::sin(th) + c * std::cos(th);
        }
      }
      const bf* got = h < NQ ? &q[(size_t(m) * NQ + h) * HD] : &ykv[(size_t(m) * 2 * NKV + (h - NQ)) * HD];
      for (int d = 0; d < HD; ++d) {
        const double g = double(float(got[d]));
        max_ref = std::fmax(max_ref, std::fabs(r[d]));
        max_err = std::isnan(g) || g == -777.0 ? 1e300 : std::fmax(max_err, std::fabs(r[d] - g));
      }
    }
  std::printf("max_err %.3e max_ref %.3e rel %.3e\n", max_err, max_ref, max_err / max_ref);
  return max_err / max_ref < 1e-2 ? 0 : 1;
}
"#;

/// Compile and run the emulated kernel with template constants `consts` (M, NQ, NKV, HD),
/// in float16 when `F16` = 1, else bfloat16.
fn run(tag: &str, consts: &[(&str, i64)]) {
    let t = if consts.contains(&("F16", 1)) {
        "__half"
    } else {
        "__nv_bfloat16"
    };
    let (header, body) = common::one_body("qk_rope.cu");
    let mut src = String::from(PRELUDE);
    src += &header;
    for (n, v) in consts {
        src += &format!("constexpr int {n} = {v};\n");
    }
    src += &format!("constexpr int EPS_BITS = {};\n", 1e-6f32.to_bits() as i32);
    // MLX's template type, and the signature it generates for inputs y, qw, kw, pos,
    // inv_freq, pool (with its shape), dst and output q
    src += &format!("using T = {t};\n");
    src += "void kernel(const T* y, const T* qw, const T* kw, const int32_t* pos,\n\
            const float* inv_freq, const T* pool, const int* pool_shape, const int32_t* dst,\n\
            T* q) {\n";
    src += &body;
    src += "\n}\n";
    src += MAIN;
    common::run_checked(&format!("qk_rope-{tag}"), &src, &consts, "max_err");
}

#[test]
fn qk_norm_rope_and_the_cache_write_match_the_ops() {
    for f16 in [0, 1] {
        // a Qwen3-32B rank at TP=8 (8 query heads, 1 kv head) at batch 3; GQA 4:2 at HD 64
        run(
            &format!("tp8-{f16}"),
            &[("M", 3), ("NQ", 8), ("NKV", 1), ("HD", 128), ("F16", f16)],
        );
        run(
            &format!("hd64-{f16}"),
            &[("M", 1), ("NQ", 4), ("NKV", 2), ("HD", 64), ("F16", f16)],
        );
    }
}
