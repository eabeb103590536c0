//! CUDA on the CPU for the kernel tests (`*_emulated`): a prelude
//! that lets a kernel file compile as C++ (one OS thread per CUDA thread, block-wide
//! barriers for `__syncthreads` and warp shuffles, so a kernel's shuffle counts must be
//! uniform over its block) and a helper that compiles and runs a test program.
#![allow(dead_code)]

/// The header and body of a one-body kernel file `kernels/{file}` (its `// @@header` and
/// `// @@body` parts).
pub fn one_body(file: &str) -> (String, String) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("kernels")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let (_, rest) = text.split_once("// @@header\n").unwrap();
    let (header, body) = rest.split_once("// @@body\n").unwrap();
    (header.to_string(), body.to_string())
}

/// The start of a kernel test program: [`PRELUDE`], the kernel file's device code `header`,
/// `T` (float16 when `consts` has `F16 = 1`, else bfloat16; also returned), the template
/// constants `consts`, then those of `defaults` and of the GEMV-family kernels' own defaults
/// (`EPI` 3 for the RoPE entry point, which `HD` in `consts` marks, else 0; no norm, eps
/// 1e-5, no heads) that `consts` lacks.
pub fn program_head(
    header: &str,
    consts: &[(&str, usize)],
    defaults: &[(&str, usize)],
) -> (String, &'static str) {
    let rope = consts.iter().any(|(n, _)| *n == "HD");
    let common = [
        ("EPI", if rope { 3 } else { 0 }),
        ("NORM", 0),
        ("EPS_BITS", 1e-5f32.to_bits() as usize),
        ("HD", 0),
        ("NQ", 0),
    ];
    let t = if consts.contains(&("F16", 1)) {
        "__half"
    } else {
        "__nv_bfloat16"
    };
    let mut src = String::from(PRELUDE);
    src += header;
    src += &format!("using T = {t};\n");
    for (n, v) in consts {
        src += &format!("constexpr int {n} = {v};\n");
    }
    for (name, default) in defaults.iter().chain(&common) {
        if !consts.iter().any(|(n, _)| n == name) {
            src += &format!("constexpr int {name} = {default};\n");
        }
    }
    (src, t)
}
use std::process::Command;

pub const PRELUDE: &str = r#"
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__
#define __shared__ static
struct uint4 { uint32_t x, y, z, w; };
static uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
static float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
// byte i of the result is byte (s >> 4i) & 7 of the 8 bytes {b:a}
static unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
  const uint64_t v = (uint64_t(b) << 32) | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
// c + the dot product of the four signed bytes of a and b
static int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += int(int8_t(a >> (8 * i))) * int(int8_t(b >> (8 * i)));
  return c;
}
static float rsqrtf(float v) { return 1.f / std::sqrt(v); }
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() : bits(0) {}
  explicit __nv_bfloat16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
    bits = uint16_t(u >> 16);
  }
  operator float() const { uint32_t u = uint32_t(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
// float16 through the compiler's _Float16 (IEEE binary16, round to nearest even)
struct __half {
  uint16_t bits;
  __half() : bits(0) {}
  explicit __half(float f) { _Float16 h = static_cast<_Float16>(f); std::memcpy(&bits, &h, 2); }
  operator float() const { _Float16 h; std::memcpy(&h, &bits, 2); return static_cast<float>(h); }
};
static __half __ushort_as_half(unsigned short b) { __half h; h.bits = b; return h; }
static float __half2float(__half h) { return float(h); }
struct Dim { unsigned x = 0, y = 0, z = 0; };
static thread_local Dim threadIdx, blockIdx;
static Dim blockDim, gridDim;
static std::barrier<>* g_barrier = nullptr;
static std::vector<float> g_shfl;
static void __syncthreads() { g_barrier->arrive_and_wait(); }
static void __syncwarp() { g_barrier->arrive_and_wait(); }
// CUDA block (bx, by) (or `blk`, y = 0) of `tpb` threads: f() on each, with
// threadIdx/blockIdx set and the block's barrier (and shuffles) shared
template <class F> static void run_block_xy(int bx, int by, int tpb, F f) {
  std::barrier<> bar(tpb);
  g_barrier = &bar;
  std::vector<std::thread> ts;
  for (int t = 0; t < tpb; ++t)
    ts.emplace_back([&, t] {
      threadIdx.x = t;
      blockIdx.x = bx;
      blockIdx.y = by;
      f();
    });
  for (auto& t : ts) t.join();
}
template <class F> static void run_block(int blk, int tpb, F f) { run_block_xy(blk, 0, tpb, f); }
struct uint2 { uint32_t x, y; };
struct float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
static uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
static float2 make_float2(float a, float b) { return {a, b}; }
static float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
// v of thread `src` of the block (all threads take part, as in a warp shuffle)
template <class V> static V shfl_from(V v, unsigned src) {
  static_assert(sizeof(V) == 4);
  const unsigned t = threadIdx.x;
  std::memcpy(&g_shfl[t], &v, 4);
  g_barrier->arrive_and_wait();
  V r;
  std::memcpy(&r, &g_shfl[src], 4);
  g_barrier->arrive_and_wait();
  return r;
}
static float __shfl_xor_sync(unsigned, float v, int o) { return shfl_from(v, threadIdx.x ^ o); }
static int __shfl_xor_sync(unsigned, int v, int o) { return shfl_from(v, threadIdx.x ^ o); }
static unsigned __shfl_xor_sync(unsigned, unsigned v, int o) { return shfl_from(v, threadIdx.x ^ o); }
static float __shfl_sync(unsigned, float v, int lane) { return shfl_from(v, (threadIdx.x & ~31u) | lane); }
static unsigned __shfl_sync(unsigned, unsigned v, int lane) { return shfl_from(v, (threadIdx.x & ~31u) | lane); }
// mma.sync.m16n8k32 s8·s8 + s32 of one warp: every lane posts its fragments, then
// computes its four outputs from the warp's (layouts as in the PTX ISA)
static std::vector<uint32_t> g_mma;
static void mlxcel_emulated_mma(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                uint32_t b0, uint32_t b1) {
  const unsigned t = threadIdx.x;
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(&g_mma[6 * t], mine, sizeof mine);
  g_barrier->arrive_and_wait();
  const unsigned base = t & ~31u, lane = t & 31u, gid = lane >> 2, tg = lane & 3;
  auto byte = [&](unsigned owner, int reg, int k) { return int(int8_t(g_mma[6 * (base + owner) + reg] >> (8 * (k % 4)))); };
  auto A = [&](int row, int k) { return byte((row % 8) * 4 + (k % 16) / 4, (row >= 8) + 2 * (k >= 16), k); };
  auto B = [&](int k, int col) { return byte(col * 4 + (k % 16) / 4, 4 + (k >= 16), k); };
  int r[4];
  for (int i = 0; i < 4; ++i) {
    const int row = gid + (i >= 2 ? 8 : 0), col = 2 * tg + (i & 1);
    int d = 0;
    for (int k = 0; k < 32; ++k) d += A(row, k) * B(k, col);
    r[i] = c[i] + d;
  }
  g_barrier->arrive_and_wait();
  for (int i = 0; i < 4; ++i) c[i] = r[i];
}
// pairs of 16-bit floats (kernels/qgemm.cu): T from its bits, two floats packed (lo in the
// low half) and a·b + c per half, each rounded to T once from a double
template <class T> static T mlxcel_emu16(uint32_t bits) { T h; h.bits = uint16_t(bits); return h; }
template <class T> static uint32_t mlxcel_emulated_pack2(float lo, float hi) {
  return uint32_t(T(lo).bits) | (uint32_t(T(hi).bits) << 16);
}
template <class T> static uint32_t mlxcel_emulated_fma2(uint32_t a, uint32_t b, uint32_t c) {
  auto one = [](uint32_t x, uint32_t y, uint32_t z) {
    const double d = double(float(mlxcel_emu16<T>(x))) * double(float(mlxcel_emu16<T>(y))) +
                     double(float(mlxcel_emu16<T>(z)));
    return uint32_t(T(float(d)).bits);
  };
  return one(a, b, c) | (one(a >> 16, b >> 16, c >> 16) << 16);
}
// mma.sync.m16n8k16 with T inputs and f32 accumulators of one warp (layouts as in the PTX
// ISA): A[row][k] is half k % 2 of register (row >= 8) + 2 (k >= 8) of lane (row % 8)·4 + (k % 8)/2,
// B[k][col] half k % 2 of register 4 + (k >= 8) of lane col·4 + (k % 8)/2
template <class T> static void mlxcel_emulated_mma16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                     uint32_t a3, uint32_t b0, uint32_t b1) {
  const unsigned t = threadIdx.x;
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(&g_mma[6 * t], mine, sizeof mine);
  g_barrier->arrive_and_wait();
  const unsigned base = t & ~31u, lane = t & 31u, gid = lane >> 2, tg = lane & 3;
  auto hv = [&](unsigned owner, int reg, int k) {
    return double(float(mlxcel_emu16<T>(g_mma[6 * (base + owner) + reg] >> (16 * (k % 2)))));
  };
  auto A = [&](int row, int k) { return hv((row % 8) * 4 + (k % 8) / 2, (row >= 8) + 2 * (k >= 8), k); };
  auto B = [&](int k, int col) { return hv(col * 4 + (k % 8) / 2, 4 + (k >= 8), k); };
  float r[4];
  for (int i = 0; i < 4; ++i) {
    const int row = gid + (i >= 2 ? 8 : 0), col = 2 * tg + (i & 1);
    double d = 0;
    for (int k = 0; k < 16; ++k) d += A(row, k) * B(k, col);
    r[i] = c[i] + float(d);
  }
  g_barrier->arrive_and_wait();
  for (int i = 0; i < 4; ++i) c[i] = r[i];
}
// wgmma.mma_async.m64nNk16 (T inputs, f32 accumulators, A in registers, B K-major without
// swizzle, read through its matrix descriptor from `base`: start address, leading byte
// offset between the two core matrices along K, stride byte offset between groups of 8
// columns; PTX ISA) of one warpgroup: every lane posts its A fragments (each warp's 16 rows
// laid out as mma.m16n8k16's A), then computes its d[nn/2] (rows 16·warp + g, + 8; columns
// 8j + 2t, + 1) from the warpgroup's
template <class T> static void mlxcel_emulated_wgmma_now(float* d, int nn, uint32_t a0, uint32_t a1, uint32_t a2,
                                                         uint32_t a3, uint64_t desc, const void* base) {
  const unsigned t = threadIdx.x;
  const uint32_t mine[4] = {a0, a1, a2, a3};
  std::memcpy(&g_mma[6 * t], mine, sizeof mine);
  g_barrier->arrive_and_wait();
  const unsigned wg = t & ~127u, w = (t >> 5) & 3u, lane = t & 31u, gid = lane >> 2, tg = lane & 3;
  const uint32_t start = uint32_t(desc & 0x3FFFu) << 4, lbo = uint32_t((desc >> 16) & 0x3FFFu) << 4,
                 sbo = uint32_t((desc >> 32) & 0x3FFFu) << 4;
  const char* b = static_cast<const char*>(base);
  auto A = [&](int row, int k) {
    const unsigned owner = wg + (row / 16) * 32 + (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row % 16 >= 8) + 2 * (k >= 8);
    return double(float(mlxcel_emu16<T>(g_mma[6 * owner + reg] >> (16 * (k % 2)))));
  };
  auto B = [&](int k, int col) {
    uint16_t v;
    std::memcpy(&v, b + start + (col / 8) * sbo + (col % 8) * 16 + (k / 8) * lbo + (k % 8) * 2, 2);
    return double(float(mlxcel_emu16<T>(v)));
  };
  std::vector<float> r(nn / 2);
  for (int j = 0; j < nn / 8; ++j)
    for (int c = 0; c < 4; ++c) {
      const int row = 16 * int(w) + int(gid) + (c >= 2 ? 8 : 0), col = 8 * j + 2 * int(tg) + (c & 1);
      double s = 0;
      for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
      r[4 * j + c] = d[4 * j + c] + float(s);
    }
  g_barrier->arrive_and_wait();
  for (int i = 0; i < nn / 2; ++i) d[i] = r[i];
}
// wgmma is asynchronous: a thread's wgmmas are queued as issued (A's registers by value, B
// read later) and run when wgmma.wait_group retires their commit group, so B is read from
// shared memory as the tensor cores would read it: a stage refilled while its wgmmas are
// still in flight gives wrong results here too. Every thread issues, commits and waits alike
// (the block's barriers stay in step).
struct MlxcelWgOp {
  void (*run)(float*, int, uint32_t, uint32_t, uint32_t, uint32_t, uint64_t, const void*);
  float* d;
  int nn;
  uint32_t a[4];
  uint64_t desc;
  const void* base;
};
static thread_local std::vector<MlxcelWgOp> g_wg_ops;     // issued, not yet run
static thread_local std::vector<size_t> g_wg_groups;      // committed groups' ends in g_wg_ops
template <class T> static void mlxcel_emulated_wgmma(float* d, int nn, uint32_t a0, uint32_t a1, uint32_t a2,
                                                     uint32_t a3, uint64_t desc, const void* base) {
  g_wg_ops.push_back({&mlxcel_emulated_wgmma_now<T>, d, nn, {a0, a1, a2, a3}, desc, base});
}
static void mlxcel_emulated_wg_commit() { g_wg_groups.push_back(g_wg_ops.size()); }
// wgmma.wait_group p: the committed groups but the newest p run now, in order
static void mlxcel_emulated_wg_wait(int p) {
  if (int(g_wg_groups.size()) <= p) return;
  const size_t n = g_wg_groups[g_wg_groups.size() - 1 - p];
  for (size_t i = 0; i < n; ++i) {
    const MlxcelWgOp& o = g_wg_ops[i];
    o.run(o.d, o.nn, o.a[0], o.a[1], o.a[2], o.a[3], o.desc, o.base);
  }
  g_wg_ops.erase(g_wg_ops.begin(), g_wg_ops.begin() + n);
  g_wg_groups.erase(g_wg_groups.begin(), g_wg_groups.end() - p);
  for (size_t& e : g_wg_groups) e -= n;
}
// The kernels' reference, in double: the kernel's input rows (x, or RMSNorm(x) with
// weight nw when norm), and its outputs against dot(m, n) (input row m times weight row n)
// as each epilogue lays them out (y = dot, + res, or SwiGLU of the halves; or q/k/v with
// RoPE: q heads to yq, key then value heads to ykv)
template <class X> static std::vector<double> ref_input(const std::vector<X>& x, const std::vector<X>& nw,
                                                        int M, int K, bool norm, int eps_bits) {
  std::vector<double> xin(size_t(M) * K);
  float eps;
  std::memcpy(&eps, &eps_bits, 4);
  for (int m = 0; m < M; ++m) {
    double ss = 0;
    for (int k = 0; k < K; ++k) ss += double(float(x[m * K + k])) * double(float(x[m * K + k]));
    double f = norm ? 1.0 / std::sqrt(ss / K + double(eps)) : 1.0;
    for (int k = 0; k < K; ++k)
      xin[m * K + k] = double(float(x[m * K + k])) * f * (norm ? double(float(nw[k])) : 1.0);
  }
  return xin;
}
// largest |reference| and |reference - output| (a NaN output, or one never written, fails)
struct RefErr {
  double max_ref = 0, max_err = 0;
  void add(double r, double got) {
    max_ref = std::fmax(max_ref, std::fabs(r));
    const double e = std::fabs(r - got);
    max_err = std::isnan(e) ? INFINITY : std::fmax(max_err, e);
  }
};
template <class X, class Dot> static void ref_rope(RefErr& e, Dot dot, int M, int N, int HD, int NQ,
                                                   const int32_t* pos, const float* inv, const X* yq,
                                                   const X* ykv) {
  const int nkv = (N / HD - NQ) / 2;
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < NQ + 2 * nkv; ++h)
      for (int d = 0; d < HD / 2; ++d) {
        double a = dot(m, h * HD + d), c = dot(m, h * HD + d + HD / 2);
        if (h < NQ + nkv) {
          double th = double(pos[m]) * double(inv[d]);
          double ra = a * std::cos(th) - c * std::sin(th);
          c = a * std::sin(th) + c * std::cos(th);
          a = ra;
        }
        const X* out = h < NQ ? &yq[m * NQ * HD + h * HD] : &ykv[m * (N - NQ * HD) + (h - NQ) * HD];
        e.add(a, double(float(out[d])));
        e.add(c, double(float(out[d + HD / 2])));
      }
}
template <class X, class Dot> static void ref_epilogue(RefErr& e, Dot dot, int M, int N, int epi, const X* res,
                                                       const X* y) {
  const int out_n = epi == 2 ? N / 2 : N;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < out_n; ++n) {
      double r = dot(m, n);
      if (epi == 1) r += double(float(res[m * N + n]));
      if (epi == 2) r = r / (1.0 + std::exp(-r)) * dot(m, n + N / 2);
      e.add(r, double(float(y[m * out_n + n])));
    }
}
// The KV pool a q/k/v entry point writes into (`@@body_rope_kv`): R = 2·M + 5 rows per kv
// head, batch row m at row R - 1 - 2m, every row -777 first; `shape` as MLX passes it.
template <class X> struct KvPool {
  int M, nkv2, hd, R;
  std::vector<X> pool;
  int shape[10];
  std::vector<int32_t> dst;
  KvPool(int m, int nkv2_, int hd_) : M(m), nkv2(nkv2_), hd(hd_), R(2 * m + 5), dst(m) {
    pool.assign(size_t(nkv2) * R * hd, X(-777.f));
    const int s[10] = {1, nkv2, R, hd, -1, -1, -1, -1, -1, -1};
    for (int i = 0; i < 10; ++i) shape[i] = s[i];
    for (int i = 0; i < M; ++i) dst[i] = R - 1 - 2 * i;
  }
  // the rows asked for into kv's layout [M, nkv2, 1, hd]; false (and a line saying which) if
  // any other row was written
  bool read_back(std::vector<X>& ykv) const {
    for (int j = 0; j < nkv2; ++j)
      for (int r = 0; r < R; ++r) {
        const bool asked = (R - 1 - r) % 2 == 0 && (R - 1 - r) / 2 < M;
        for (int d = 0; d < hd; ++d) {
          const X v = pool[(size_t(j) * R + r) * hd + d];
          if (asked) {
            ykv[(size_t((R - 1 - r) / 2) * nkv2 + j) * hd + d] = v;
          } else if (float(v) != float(X(-777.f))) {
            std::printf("pool row %d of kv head %d written\n", r, j);
            return false;
          }
        }
      }
    return true;
  }
};
// every output against the reference: q/k/v with RoPE when hd > 0, else y with epilogue epi;
// prints the line the tests read and returns the program's exit status (0: the largest error
// below tol of the largest reference value)
template <class X, class Dot> static int ref_check(Dot dot, int M, int N, int epi, int hd, int nq,
                                                   const std::vector<int32_t>& pos, const std::vector<float>& inv,
                                                   const std::vector<X>& res, const std::vector<X>& y,
                                                   const std::vector<X>& yq, const std::vector<X>& ykv, double tol) {
  RefErr e;
  if (hd > 0) {
    ref_rope(e, dot, M, N, hd, nq, pos.data(), inv.data(), yq.data(), ykv.data());
  } else {
    ref_epilogue(e, dot, M, N, epi, res.data(), y.data());
  }
  std::printf("max_err %.3e max_ref %.3e rel %.3e\n", e.max_err, e.max_ref, e.max_err / e.max_ref);
  return e.max_err / e.max_ref < tol ? 0 : 1;
}
// RoPE inputs: a position per row (row 1 far out, where float angles lose digits) and MLX's
// inverse frequencies base^(-2d/HD), base 10000
static void rope_inputs(int M, int HD, std::vector<int32_t>& pos, std::vector<float>& inv) {
  pos.resize(M);
  for (int m = 0; m < M; ++m) pos[m] = m == 1 ? 70000 : 3 + 41 * m;
  inv.resize(HD / 2);
  for (int d = 0; d < HD / 2; ++d) inv[d] = float(std::pow(10000.0, -2.0 * d / HD));
}
// The quantized kernels' data (x, scales, biases, residual and norm weight at their sizes):
// drawn at random, and bits-bit weight values q [N, K], packed into w in MLX's layout; with
// nan_x a NaN in row 0 of x
template <class X> static void draw_quantized(std::mt19937& rng, int N, int K, int bits, bool nan_x,
                                              std::vector<X>& x, std::vector<X>& sc, std::vector<X>& bi,
                                              std::vector<X>& res, std::vector<X>& nw, std::vector<uint32_t>& w,
                                              std::vector<int>& q) {
  std::uniform_real_distribution<float> ux(-1.f, 1.f), us(0.001f, 0.02f), ub(-0.05f, 0.05f);
  const int vpw = 32 / bits;
  w.assign(size_t(N) * K / vpw, 0u);
  q.assign(size_t(N) * K, 0);
  for (auto& v : x) v = X(ux(rng));
  if (nan_x) x[5] = X(NAN);
  for (auto& v : sc) v = X(us(rng));
  for (auto& v : bi) v = X(ub(rng));
  for (auto& v : res) v = X(ux(rng));
  for (auto& v : nw) v = X(0.5f + ux(rng));
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      int v = int(rng() % (1u << bits));
      q[size_t(n) * K + k] = v;
      w[(size_t(n) * K + k) / vpw] |= uint32_t(v) << (bits * (k % vpw));
    }
}
// x·dequantize(w)ᵀ of the quantized kernels: weight values q [N, K], group scales and biases
template <class X> static double ref_qdot(const std::vector<double>& xin, const std::vector<int>& q,
                                          const std::vector<X>& sc, const std::vector<X>& bi, int K, int G,
                                          int m, int n) {
  double r = 0;
  for (int k = 0; k < K; ++k) {
    const int g = k / G;
    const double wv = q[size_t(n) * K + k] * double(float(sc[n * (K / G) + g])) + double(float(bi[n * (K / G) + g]));
    r += xin[size_t(m) * K + k] * wv;
  }
  return r;
}
// block-wide atomics and fences: the emulation runs one block at a time
static int atomicAdd(int* p, int v) { int o = *p; *p += v; return o; }
static int atomicExch(int* p, int v) { int o = *p; *p = v; return o; }
static void __threadfence() {}
static float __ldcg(const float* p) { return *p; }
static int min(int a, int b) { return a < b ? a : b; }
"#;

/// Compile `src` (C++20, the host's `c++` or `$CXX`) and run it; (exit status ok, stdout).
pub fn compile_and_run(tag: &str, src: &str) -> (bool, String) {
    let tmp = tempfile::Builder::new()
        .prefix(&format!("mlxcel-emu-{tag}-"))
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let cpp = dir.join("kernel.cpp");
    let exe = dir.join("kernel");
    std::fs::write(&cpp, src).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-o"])
        .arg(&exe)
        .arg(&cpp)
        .output()
        .unwrap_or_else(|e| panic!("running the C++ compiler `{cxx}`: {e}"));
    assert!(
        out.status.success(),
        "{tag}: compiling the emulated kernel failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let res = Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&res.stdout).to_string();
    (res.status.success(), text)
}

/// [`compile_and_run`] a kernel test program and check it: it must exit 0 and print
/// `expect` (its error line); prints that output under `tag`.
pub fn run_checked(tag: &str, src: &str, what: &dyn std::fmt::Debug, expect: &str) {
    let (ok, out) = compile_and_run(tag, src);
    eprintln!("{tag}: {}", out.trim());
    assert!(ok, "{tag} {what:?}: {out}");
    assert!(out.contains(expect), "{tag}: {out}");
}
