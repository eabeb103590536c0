//! CUDA on the CPU for the kernel tests (`qgemv_emulated`, `qgemm_emulated`, `attn_emulated`): a prelude
//! that lets a kernel file compile as C++ (one OS thread per CUDA thread, block-wide
//! barriers for `__syncthreads` and warp shuffles, so a kernel's shuffle counts must be
//! uniform over its block) and a helper that compiles and runs a test program.
#![allow(dead_code)]
use std::path::PathBuf;
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
static Dim blockDim;
static std::barrier<>* g_barrier = nullptr;
static std::vector<float> g_shfl;
static void __syncthreads() { g_barrier->arrive_and_wait(); }
static void __syncwarp() { g_barrier->arrive_and_wait(); }
// CUDA block `blk` of `tpb` threads: f() on each, with threadIdx/blockIdx set and the
// block's barrier (and shuffles) shared
template <class F> static void run_block(int blk, int tpb, F f) {
  std::barrier<> bar(tpb);
  g_barrier = &bar;
  std::vector<std::thread> ts;
  for (int t = 0; t < tpb; ++t)
    ts.emplace_back([&, t] {
      threadIdx.x = t;
      blockIdx.x = blk;
      f();
    });
  for (auto& t : ts) t.join();
}
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
// block-wide atomics and fences: the emulation runs one block at a time
static int atomicAdd(int* p, int v) { int o = *p; *p += v; return o; }
static int atomicExch(int* p, int v) { int o = *p; *p = v; return o; }
static void __threadfence() {}
static float __ldcg(const float* p) { return *p; }
static int min(int a, int b) { return a < b ? a : b; }
"#;

/// Compile `src` (C++20, the host's `c++` or `$CXX`) and run it; (exit status ok, stdout).
pub fn compile_and_run(tag: &str, src: &str) -> (bool, String) {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("mlxcel-emu-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
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
    let _ = std::fs::remove_dir_all(&dir);
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
