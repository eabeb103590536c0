//! The decode attention kernel (`kernels/attn.cu`) run on the CPU (see `common`) and
//! compared with softmax(q·kᵀ·scale)·v in double precision: GQA, rows reading their
//! positions through shuffled block tables at other lengths (two rows sharing one
//! table), one and several splits (the last block merging them), run twice so that a
//! count left non-zero by the first run would show in the second; in bfloat16 and in
//! float16 (`F16` = 1).

mod common;
use common::PRELUDE;

const MAIN: &str = r#"
#include <algorithm>
int main() {
  using bf = T;
  constexpr int G = HQ / HKV;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  // three sequences of CAP positions each over a pool of their blocks in shuffled order
  const int seqs_n = 3, nb = CAP / BS, blocks_n = seqs_n * nb, cap = blocks_n * BS;
  std::vector<bf> q(B * HQ * D), pool(size_t(2) * HKV * cap * D), out(B * HQ * D);
  for (auto& v : q) v = bf(2.f * u(rng));
  for (auto& v : pool) v = bf(u(rng));
  std::vector<int32_t> perm(blocks_n);
  for (int i = 0; i < blocks_n; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  const int32_t seq_of[4] = {2, 0, 1, 2}, pos_of[4] = {POS0, POS1, POS2, POS3};
  std::vector<int32_t> table(size_t(B) * nb), pos(pos_of, pos_of + B);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < nb; ++j) table[b * nb + j] = perm[seq_of[b] * nb + j];
  const int table_shape[2] = {B, nb};
  auto row_of = [&](int b, int p) { return size_t(table[b * nb + p / BS]) * BS + p % BS; };
  std::vector<float> part(size_t(B) * HKV * NSPLIT * G * (D + 2), NAN);
  std::vector<int32_t> count(B * HKV * (NSPLIT + 1), 0);  // (sized as mlxcel sizes it)
  const int pool_shape[4] = {1, 2 * HKV, cap, D};
  constexpr int tpb = 32 * WARPS;
  blockDim.x = tpb;
  g_shfl.assign(tpb, 0.f);
  double worst = 0;
  for (int run = 0; run < 2; ++run) {
    std::fill(out.begin(), out.end(), bf(NAN));
    // mlxcel's launch: SPLITS blocks (x) per (row, kv head) (y)
    gridDim.x = SPLITS;
    gridDim.y = B * HKV;
    for (int by = 0; by < B * HKV; ++by)
      for (int bx = 0; bx < SPLITS; ++bx)
        run_block_xy(bx, by, tpb, [&] {
          kernel(q.data(), pool.data(), pool_shape, table.data(), table_shape, pos.data(),
                 part.data(), count.data(), out.data());
        });
    for (int c : count)
      if (c != 0) { std::printf("max_err: a count was left at %d\n", c); return 1; }
    float scale; int sb = SCALE_BITS; std::memcpy(&scale, &sb, 4);
    scale /= std::log2(std::exp(1.0));  // the kernel gets scale·log2(e)
    double max_ref = 0, max_err = 0;
    for (int b = 0; b < B; ++b)
      for (int hq = 0; hq < HQ; ++hq) {
        const int h = hq / G, len = pos[b] + 1;
        const bf* k = &pool[size_t(h) * cap * D];
        const bf* v = &pool[size_t(HKV + h) * cap * D];
        std::vector<double> sc(len);
        double mx = -1e300, sum = 0;
        for (int p = 0; p < len; ++p) {
          double d = 0;
          for (int i = 0; i < D; ++i) d += double(float(q[(b * HQ + hq) * D + i])) * double(float(k[row_of(b, p) * D + i]));
          sc[p] = d * scale;
          mx = std::max(mx, sc[p]);
        }
        for (int p = 0; p < len; ++p) sum += (sc[p] = std::exp(sc[p] - mx));
        for (int i = 0; i < D; ++i) {
          double r = 0;
          for (int p = 0; p < len; ++p) r += sc[p] / sum * double(float(v[row_of(b, p) * D + i]));
          const double got = double(float(out[(b * HQ + hq) * D + i]));
          max_ref = std::fmax(max_ref, std::fabs(r));
          max_err = std::isnan(got) ? 1e300 : std::fmax(max_err, std::fabs(r - got));
        }
      }
    std::printf("run %d: max_err %.3e max_ref %.3e rel %.3e\n", run, max_err, max_ref, max_err / max_ref);
    worst = std::fmax(worst, max_err / max_ref);
  }
  return worst < 1e-2 ? 0 : 1;
}
"#;

/// Compile and run the emulated kernel with template constants `consts` (B, HQ, HKV, D,
/// NSPLIT, WARPS, BS, CAP (positions per sequence, a multiple of BS), the rows'
/// positions POS0..POS3 and the softmax scale), in float16 when `F16` = 1, else bfloat16,
/// launched with SPLITS blocks per (row, kv head) (default NSPLIT).
fn run(tag: &str, consts: &[(&str, i64)], scale: f32) {
    let t = if consts.contains(&("F16", 1)) {
        "__half"
    } else {
        "__nv_bfloat16"
    };
    let (header, body) = common::one_body("attn.cu");
    let mut src = String::from(PRELUDE);
    src += &header;
    for (n, v) in consts {
        src += &format!("constexpr int {n} = {v};\n");
    }
    if !consts.iter().any(|(n, _)| *n == "SPLITS") {
        src += "constexpr int SPLITS = NSPLIT;\n";
    }
    let scale_log2e = scale * std::f32::consts::LOG2_E;
    src += &format!(
        "constexpr int SCALE_BITS = {};\n",
        scale_log2e.to_bits() as i32
    );
    // MLX's template type, and the signature it generates for inputs q, pool (with its
    // shape), table (with its shape), pos, part, count and output out
    src += &format!("using T = {t};\n");
    src += "void kernel(const T* q, const T* pool, const int* pool_shape,\n\
            const int32_t* table, const int* table_shape, const int32_t* pos, const float* part,\n\
            const int32_t* count, T* out) {\n";
    src += &body;
    src += "\n}\n";
    src += MAIN;
    common::run_checked(&format!("attn-{tag}"), &src, &consts, "run 1: max_err");
}

#[test]
fn decode_attention_matches_softmax_of_scores_times_values() {
    cases(0);
}

#[test]
fn decode_attention_in_float16_matches_too() {
    cases(1);
}

/// The shapes below, in float16 when `f16` is 1.
fn cases(f16: i64) {
    // one row, one split of two tiles (the second partial); GQA 4:1, head_dim 128
    run(
        &format!("one_split-{f16}"),
        &[
            ("F16", f16),
            ("B", 1),
            ("HQ", 8),
            ("HKV", 2),
            ("D", 128),
            ("NSPLIT", 4),
            ("WARPS", 8),
            ("BS", 32),
            ("CAP", 128),
            ("POS0", 40),
            ("POS1", 0),
            ("POS2", 0),
            ("POS3", 0),
        ],
        0.088,
    );
    // four rows over three slots at lengths 1, 70, 200, 33: 1 to 4 splits of one
    // 32-position tile each (the last block merges), an empty last round; head_dim 64,
    // 3 query heads per kv head
    run(
        &format!("splits-{f16}"),
        &[
            ("F16", f16),
            ("B", 4),
            ("HQ", 6),
            ("HKV", 2),
            ("D", 64),
            ("NSPLIT", 4),
            ("WARPS", 3),
            ("BS", 64),
            ("CAP", 256),
            ("POS0", 0),
            ("POS1", 69),
            ("POS2", 199),
            ("POS3", 32),
        ],
        0.125,
    );
    // mlxcel's launch for 8B heads per kv head (16 warps: 4 tiles of 4 query heads per
    // round, up to 32 splits): 301 positions are 3 splits of 128
    run(
        &format!("launch-{f16}"),
        &[
            ("F16", f16),
            ("B", 1),
            ("HQ", 8),
            ("HKV", 2),
            ("D", 128),
            ("NSPLIT", 32),
            ("WARPS", 16),
            ("BS", 32),
            ("CAP", 320),
            ("POS0", 300),
            ("POS1", 0),
            ("POS2", 0),
            ("POS3", 0),
        ],
        0.088,
    );
    // mlxcel's launch for a step whose longest row attends to 301 positions: 3 blocks per
    // (row, kv head) of the 32 the scratch is laid out for (rows of 1, 128, 129 and 301
    // positions: 1, 1, 2 and 3 splits of 128)
    run(
        &format!("launch-splits-{f16}"),
        &[
            ("F16", f16),
            ("B", 4),
            ("HQ", 8),
            ("HKV", 2),
            ("D", 128),
            ("NSPLIT", 32),
            ("SPLITS", 3),
            ("WARPS", 16),
            ("BS", 32),
            ("CAP", 320),
            ("POS0", 300),
            ("POS1", 127),
            ("POS2", 128),
            ("POS3", 0),
        ],
        0.088,
    );
    // fewer blocks launched than the longest row would be cut into: 2 splits of 160
    // positions, two rounds of 128 each (the second partly empty)
    run(
        &format!("launch-fewer-{f16}"),
        &[
            ("F16", f16),
            ("B", 2),
            ("HQ", 8),
            ("HKV", 2),
            ("D", 128),
            ("NSPLIT", 32),
            ("SPLITS", 2),
            ("WARPS", 16),
            ("BS", 32),
            ("CAP", 320),
            ("POS0", 300),
            ("POS1", 40),
            ("POS2", 0),
            ("POS3", 0),
        ],
        0.088,
    );
    // two tiles per round over 3 splits (lengths 150, 300: rounds of 64 with empty tiles)
    run(
        &format!("rounds-{f16}"),
        &[
            ("F16", f16),
            ("B", 2),
            ("HQ", 4),
            ("HKV", 2),
            ("D", 64),
            ("NSPLIT", 3),
            ("WARPS", 4),
            ("BS", 160),
            ("CAP", 320),
            ("POS0", 149),
            ("POS1", 299),
            ("POS2", 0),
            ("POS3", 0),
        ],
        0.125,
    );
}
