// mlxcel: quantized GEMV for decode, y[M, N] = x[M, K] · dequant(w)[N, K]ᵀ, M ≤ 8.
//
// MLX's affine layout (what `mx.quantize` / mlx-lm checkpoints hold):
//   w      uint32 [N, K·BITS/32]  value j of word i is bits [BITS·j, BITS·(j+1)) of it, k = i·32/BITS + j
//   scales T      [N, K/G]
//   biases T      [N, K/G]        w[n, k] = q · scale + bias
// x and y are T (bfloat16 or float16, the dtype of the scales and biases too). Compiled
// at run time by MLX (`fast::cuda_kernel`, nvrtc); template constants: M, N, K, G, BITS,
// ROWS, WPB, EPI, NORM, EPS_BITS, XQ, MMA, PG (and HD, NQ for the RoPE entry point).
//
// EPI picks what is written (each saves the decode step a separate MLX op):
//   0: y[M, N]   = x·Wᵀ
//   1: y[M, N]   = res + x·Wᵀ            (res T [M, N]: the residual stream)
//   2: y[M, N/2] = silu(g)·u, g = (x·Wᵀ)[:, :N/2], u = (x·Wᵀ)[:, N/2:]
//      (the merged gate/up projection; a block takes ROWS/2 rows of each half)
//   3: the merged q/k/v projection of a decode step with RoPE applied to q and k:
//      x·Wᵀ is NQ query heads, NKV key heads, NKV value heads of HD values each
//      (N = (NQ + 2·NKV)·HD); a block takes ROWS/2 pairs of rows (d, d + HD/2) of a
//      head, rotates q and k heads by pos[m]·inv_freq[d] (half-split RoPE, as MLX's
//      `fast::rope` with traditional = false), and writes q heads to y
//      ([M, NQ, 1, HD]) and key then value heads to y2 ([M, 2·NKV, 1, HD]: what the
//      KV cache stores for one position, so one update writes both).
// NORM = 1 applies RMSNorm to x first (x·w_norm·rsqrt(mean(x²) + eps), nw T [K] the
// norm weight, eps the float whose bits are EPS_BITS): the block's threads read all of
// each row of x anyway, so the sum of squares comes with the dot products.
// x is read as M rows of K whatever its shape, y is written row-major.
//
// This file is loaded in parts split at the marker lines: the header (device code,
// here all of the kernel as the template `mlxcel_qgemv`) and three kernel bodies, each
// the body of a `__global__` function MLX generates around it:
//   @@body       (const X* x, const uint32_t* w, const T* scales, const T* biases,
//                 const T* res, const T* nw, T* y)                        EPI 0, 1, 2
//   @@body_rope  (const X* x, const uint32_t* w, const T* scales, const T* biases,
//                 const T* nw, const int32_t* pos, const float* inv_freq, const T* qb,
//                 T* q, T* kv)
//   @@body_xq    (const T* x, const T* nw, uint32_t* xq)    x rounded for MMA = 1
//   @@body_rope_kv (const X* x, const uint32_t* w, const T* scales, const T* biases,
//                 const T* nw, const int32_t* pos, const float* inv_freq, const T* pool,
//                 <pool's shape>, const int32_t* dst, const T* qb, T* q)   @@body_rope with the key and
//                 value heads written into a layer's KV pool (T [1, 2·NKV, R, HD]) at row
//                 dst[m] of batch row m: the decode step's cache write, without an op of
//                 its own (the pool is mlxcel's, passed as a view that holds no reference;
//                 every reader of it takes q, so runs after this kernel)
// (X is T, or with MMA = 1 uint32_t: the rounding kernel's output, which carries the
// norm then; res is read only when EPI = 1, nw only when NORM = 1 and MMA = 0, qb only
// when BIAS = 1 (the q/k/v projection's bias, T [N]: Qwen2; added before the rotation);
// callers pass any array there). MLX declares the template constants as constexpr locals of that function,
// so the bodies pass them on as template arguments: a discarded `if constexpr` branch
// of a template is not compiled, which lets one kernel have two signatures.
// mlxcel embeds it and `MLXCEL_QGEMV_SOURCE=path` replaces it at run time;
// `scripts/check_qgemv.py` loads the same file from Python to check and time it.
//
// PG > 0 (M = 1 with XQ, long rows: mlxcel takes it for K > 8192, e.g. the down projections):
// a grid of PG blocks instead of one per row group, each block streaming row groups
// b, b + PG, … through a ring of shared-memory stages filled by cp.async (see the code).
//
// Work split: one block of WPB warps per ROWS output rows (grid N/ROWS blocks);
// thread t reads 16-byte chunks t, t+32·WPB, … of each of its rows (coalesced,
// and enough blocks and loads in flight to cover DRAM latency: one warp per row
// reached only 12% of the SMs' warp slots on the 8B down projection). The
// partial dot products are reduced with shuffles, then across warps in shared memory.
//
// Dequantisation without int→float conversions (slow on the SFU path): the
// q bits are moved to the top of a float's mantissa under exponent 0, which makes
// the float exactly 1 + q/2^BITS. So Σ_k (1 + q/2^BITS)·x = X + (Σ q·x)/2^BITS
// with X = Σ x, and per group
//   Σ w·x = scale·Σ q·x + bias·X = scale·2^BITS·(D − X) + bias·X.
// One shift+mask and one FMA per weight; X is shared by the ROWS rows of a warp.
//
// XQ = 1 (4-bit only; mlxcel's default, `MLXCEL_QGEMV_XQ=0` turns it off): the
// float path above is bound by instructions, not memory. Instead each thread turns
// its 32-value chunk of x into int8 once for all ROWS rows (xq = round(x/dq), dq =
// max|x|/127, via the 1.5·2^23 rounding trick and byte permutes), and a weight word
// costs two masks, a shift and two dp4a (four 8-bit products each):
//   Σ w·x ≈ scale·dq·Σ q·xq + bias·dq·Σ xq
// about 2.4× fewer instructions per weight (PTX count) for an added relative error
// of a few 1e-3 (x's rounding; as llama.cpp's q8_1 activations).
//
// MMA = 1 (4-bit with XQ, batch rows M = 1..8, ROWS a multiple of 16, G 32/64/128,
// K a multiple of 128): tensor cores instead of dp4a, so the instructions per weight no
// longer grow with M. x comes rounded to int8 per group (dq = max|x|/127 over the G
// values) by a kernel of its own, `mlxcel_round_x` (@@body_xq), once per call: rounding
// it in every block cost as many instructions as the MMAs and loads together at M = 8.
// A warp takes a slice of the row's groups for ROWS/16 tiles of 16 rows and issues one
// `mma.sync.m16n8k32` (s8·s8 → s32) per tile and 32 values of a group: the 16 rows of a
// tile are matrix A (their 4-bit values as int8, 0..15), the M rows of x padded to 8
// are matrix B. Which 32 values of a group one MMA takes does not matter to a dot
// product as long as A and B agree: lane (g, t) (g = lane/4, t = lane%4) holds WPT =
// G/32 words of the group for rows g and g + 8, and MMA s takes word s of each: its low
// nibbles (0x0F0F0F0F mask) are A's k positions 4t..4t+3, its high nibbles
// 16+4t..16+4t+3, and B's same positions are the even and odd values of x at those
// words (as the rounding kernel stores them). The s32 accumulator starts at the bits of
// 1.5·2^23, so read as a float it is 1.5·2^23 + D exactly (|D| ≤ G·15·127 < 2^22) and
// one subtraction converts it; then, per group, Σ w·x ≈ scale·dq·D + bias·dq·Σ xq for
// the fragment's two rows and two columns (rows 2t and 2t + 1 of x). Weights are read
// 64 contiguous bytes per row and load (see the code) and 3 steps of 128 values ahead
// of the math (4 with G = 128).
// @@header
// Steps of 128 values whose loads a lane of the tensor-core path keeps in flight (0: the
// default, 3, or 4 with G = 128); a source file may define another for experiments.
#ifndef MLXCEL_MMA_STEPS
#define MLXCEL_MMA_STEPS 0
#endif
template <int BITS, int J>
__device__ __forceinline__ float mlxcel_qval(uint32_t u) {
  constexpr int from = BITS * J;
  constexpr int to = 23 - BITS;
  uint32_t m = (from >= to) ? (u >> (from - to)) : (u << (to - from));
  return __uint_as_float((m & (((1u << BITS) - 1u) << to)) | 0x3F800000u);
}

// 16-bit floats (T: bfloat16 or float16; MLX names them __nv_bfloat16 and __half) from
// their bits, picked by overload on a null T pointer: a bfloat16 is the top half of an
// f32, a float16 goes through the hardware conversion.
__device__ __forceinline__ float mlxcel_f16bits(uint32_t h, const __nv_bfloat16*) {
  return __uint_as_float(h << 16);
}
__device__ __forceinline__ float mlxcel_f16bits(uint32_t h, const __half*) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
// the low and the high 16-bit value of a 32-bit word as floats
template <typename T>
__device__ __forceinline__ float mlxcel_lo(uint32_t u) {
  return mlxcel_f16bits(u & 0xFFFFu, static_cast<const T*>(nullptr));
}
template <typename T>
__device__ __forceinline__ float mlxcel_hi(uint32_t u) {
  return mlxcel_f16bits(u >> 16, static_cast<const T*>(nullptr));
}

// 8 values of T (one 16-byte load) to floats
template <typename T>
__device__ __forceinline__ void mlxcel_h8(const uint4 v, float* f) {
  f[0] = mlxcel_lo<T>(v.x);
  f[1] = mlxcel_hi<T>(v.x);
  f[2] = mlxcel_lo<T>(v.y);
  f[3] = mlxcel_hi<T>(v.y);
  f[4] = mlxcel_lo<T>(v.z);
  f[5] = mlxcel_hi<T>(v.z);
  f[6] = mlxcel_lo<T>(v.w);
  f[7] = mlxcel_hi<T>(v.w);
}

// max(a, b) that returns NaN when either is NaN (fmaxf drops it), so a NaN in x
// survives the int8 rounding of XQ as a NaN chunk scale.
__device__ __forceinline__ float mlxcel_max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else  // older GPUs, and the CPU emulation in tests/qgemv_emulated.rs
  return (a != a || b != b) ? a + b : (a > b ? a : b);
#endif
}

// y += the int8 product A·B of one m16n8k32 tensor-core MMA (fragments as PTX lays
// them out: a0 = A[g][4t..], a1 = A[g+8][4t..], a2 = A[g][16+4t..], a3 = A[g+8][16+4t..],
// b0 = B[4t..][g], b1 = B[16+4t..][g]; c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]).
__device__ __forceinline__ void mlxcel_mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                              uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
  asm(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else  // the CPU emulation in tests/qgemv_emulated.rs
  mlxcel_emulated_mma(c, a0, a1, a2, a3, b0, b1);
#endif
}

// WPT consecutive words (one 4-, 8- or 16-byte load, two for 8 words; p aligned to it)
template <int WPT>
__device__ __forceinline__ void mlxcel_load_words(const uint32_t* p, uint32_t (&o)[WPT]) {
  if constexpr (WPT == 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const uint4 u = *reinterpret_cast<const uint4*>(p + 4);
    o[0] = v.x;
    o[1] = v.y;
    o[2] = v.z;
    o[3] = v.w;
    o[4] = u.x;
    o[5] = u.y;
    o[6] = u.z;
    o[7] = u.w;
  } else if constexpr (WPT == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    o[0] = v.x;
    o[1] = v.y;
    o[2] = v.z;
    o[3] = v.w;
  } else if constexpr (WPT == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    o[0] = v.x;
    o[1] = v.y;
  } else {
    o[0] = p[0];
  }
}

// 8 floats to int8 (xq = round(x·inv)), packed as the even values (e) and odd values (o)
// of the 8, so they line up with the low and high nibbles of a weight word under a
// 0x0F0F0F0F mask: 1.5·2^23 + x·inv has round(x·inv) in its low byte
__device__ __forceinline__ void mlxcel_pack_i8(const float* xs, float inv, int& e, int& o) {
  int t[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    t[j] = __float_as_int(fmaf(xs[j], inv, 12582912.f));
  }
  e = int(__byte_perm(__byte_perm(t[0], t[2], 0x0040), __byte_perm(t[4], t[6], 0x0040), 0x5410));
  o = int(__byte_perm(__byte_perm(t[1], t[3], 0x0040), __byte_perm(t[5], t[7], 0x0040), 0x5410));
}

// D = Σ_j (1 + q_j/2^BITS)·x_j over the 32/BITS values of one word.
template <int BITS>
__device__ __forceinline__ float mlxcel_word_dot(uint32_t u, const float* xs) {
  float a = 0.f, b = 0.f;
  if constexpr (BITS == 4) {
    a = fmaf(mlxcel_qval<4, 0>(u), xs[0], a);
    b = fmaf(mlxcel_qval<4, 1>(u), xs[1], b);
    a = fmaf(mlxcel_qval<4, 2>(u), xs[2], a);
    b = fmaf(mlxcel_qval<4, 3>(u), xs[3], b);
    a = fmaf(mlxcel_qval<4, 4>(u), xs[4], a);
    b = fmaf(mlxcel_qval<4, 5>(u), xs[5], b);
    a = fmaf(mlxcel_qval<4, 6>(u), xs[6], a);
    b = fmaf(mlxcel_qval<4, 7>(u), xs[7], b);
  } else {
    a = fmaf(mlxcel_qval<8, 0>(u), xs[0], a);
    b = fmaf(mlxcel_qval<8, 1>(u), xs[1], b);
    a = fmaf(mlxcel_qval<8, 2>(u), xs[2], a);
    b = fmaf(mlxcel_qval<8, 3>(u), xs[3], b);
  }
  return a + b;
}

// 32 values of x (one 16-byte chunk of 4-bit weights) as int8 for the dp4a path (XQ):
// xq = round(x / dq), dq = max|x| / 127, packed as the even and odd values of each
// 8-value word (xe, xo) so they line up with the low and high nibbles of the weight word
// under a 0x0F0F0F0F mask: two dp4a per word and row. X = dq·Σ xq.
__device__ __forceinline__ void mlxcel_xq_chunk(const float* xs, int (&xe)[4], int (&xo)[4], float& dq,
                                                float& X) {
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    amax = mlxcel_max_nan(amax, fabsf(xs[j]));
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  dq = amax * (1.f / 127.f);
  int xsum = 0;
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    mlxcel_pack_i8(xs + 8 * v, inv, xe[v], xo[v]);
    xsum = __dp4a(xe[v], 0x01010101, __dp4a(xo[v], 0x01010101, xsum));
  }
  X = dq * static_cast<float>(xsum);
}

// Asynchronous 16- and 4-byte copies global → shared (cp.async, sm_80+; a plain copy
// elsewhere and in the CPU emulation), committed as a group; wait until at most N of
// this thread's groups are pending. The "memory" clobbers keep the compiler from moving
// shared-memory reads of a stage above the wait that makes them valid.
__device__ __forceinline__ void mlxcel_cp16(uint4* dst, const uint4* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
#else
  *dst = *src;
#endif
}
__device__ __forceinline__ void mlxcel_cp4(uint32_t* dst, const uint32_t* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
#else
  *dst = *src;
#endif
}
__device__ __forceinline__ void mlxcel_cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void mlxcel_cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// RoPE (half-split, angle pos[m]·inv_freq[d]) of the pair (a, c), rows d and d + HD/2 of head
// p / (HD/2) (d = p % (HD/2)) for batch row m, on query and key heads, written where the q/k/v
// entry points put it: q heads to q [M, NQ, 1, HD], key then value heads to kv [M, 2·NKV, 1, HD],
// or with kvdst to a layer's KV pool kv [2·NKV, kvrows, HD] at row kvdst[m]
template <typename T, int N, int HD, int NQ>
__device__ __forceinline__ void mlxcel_rope_store(float a, float c, int m, int p, const int32_t* pos,
                                                  const float* inv_freq, T* q, T* kv,
                                                  const int32_t* kvdst = nullptr, int kvrows = 0) {
  constexpr int HD2 = HD / 2;
  constexpr int NKV = (N / HD - NQ) / 2;
  const int head = p / HD2;
  const int d = p % HD2;
  if (head < NQ + NKV) {
    const float theta = static_cast<float>(pos[m]) * inv_freq[d];
    const float cs = cosf(theta);
    const float sn = sinf(theta);
    const float ra = a * cs - c * sn;
    c = a * sn + c * cs;
    a = ra;
  }
  T* out = head < NQ        ? q + size_t(m) * (NQ * HD) + size_t(head) * HD
           : kvdst != nullptr ? kv + (size_t(head - NQ) * size_t(kvrows) + size_t(kvdst[m])) * HD
                              : kv + size_t(m) * (N - NQ * HD) + size_t(head - NQ) * HD;
  out[d] = static_cast<T>(a);
  out[d + HD2] = static_cast<T>(c);
}

template <typename T, int M, int N, int K, int G, int BITS, int ROWS, int WPB, int EPI,
          int NORM, int EPS_BITS, int HD, int NQ, int XQ, int MMA, int PG, int BIAS, typename XT>
__device__ __forceinline__ void mlxcel_qgemv(const XT* x, const uint32_t* w, const T* scales,
                                             const T* biases, const T* res, const T* nw,
                                             const int32_t* pos, const float* inv_freq, T* y,
                                             T* y2, const int32_t* kvdst = nullptr, int kvrows = 0,
                                             int blk = -1) {
  static_assert(BITS == 4 || BITS == 8, "qgemv: 4 or 8 bits");
  static_assert(PG == 0 || MMA == 0, "qgemv: streaming (PG > 0) is a launch of the dp4a path, not of the tensor cores");
  static_assert(XQ == 0 || BITS == 4, "qgemv: int8 activations only with 4-bit weights");
  static_assert(EPI != 2 || (ROWS % 2 == 0 && N % 2 == 0), "qgemv: SwiGLU needs pairs of rows");
  static_assert(EPI != 3 || (ROWS % 2 == 0 && HD % 2 == 0 && N % HD == 0 && (N / 2) % (ROWS / 2) == 0 &&
                             N / HD >= NQ && (N / HD - NQ) % 2 == 0),
                "qgemv: RoPE needs pairs of rows and N = (NQ + 2 NKV) HD");
  constexpr int VPC = 128 / BITS;           // values per 16-byte chunk
  constexpr int VPW = 32 / BITS;            // values per 32-bit word
  constexpr int CPR = K / VPC;              // chunks per row
  constexpr int TPB = 32 * WPB;             // threads per block (all on the same ROWS rows)
  constexpr int ITERS = (CPR + TPB - 1) / TPB;  // chunks per thread
  constexpr int GPR = K / G;                // groups per row
  static_assert(K % VPC == 0 && G % VPC == 0, "qgemv: K and G must be multiples of 128/BITS");
  constexpr float SCALE = float(1 << BITS);
  // (the streaming path, PG > 0, alternates two buffers from one row group to the next)
  __shared__ float red[PG > 0 ? 2 : 1][WPB][ROWS * M];
  __shared__ float red_ss[WPB][M];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // the block's index in this product: blk where a kernel runs several products in stages
  // (mlxcel_qgemv_mlp), else the grid's
  const int bx = blk >= 0 ? blk : int(blockIdx.x);
  // output row of this block's row r: ROWS consecutive rows, or (EPI 2) ROWS/2 rows of
  // the gate half followed by the same rows of the up half, or (EPI 3) the first
  // rows d of ROWS/2 pairs (d, d + HD/2) of a head followed by their second rows
  constexpr int HALF = ROWS / 2;
  constexpr int HD2 = HD > 0 ? HD / 2 : 1;
  // (of row group grp: the block's index, or with PG > 0 each group the block streams)
  auto row_in = [&](int grp, int r) -> int {
    if constexpr (EPI == 2) {
      return r < HALF ? grp * HALF + r : N / 2 + grp * HALF + (r - HALF);
    } else if constexpr (EPI == 3) {
      const int p = grp * HALF + (r < HALF ? r : r - HALF);  // pair index
      return (p / HD2) * HD + p % HD2 + (r < HALF ? 0 : HD2);
    } else {
      return grp * ROWS + r;
    }
  };
  auto row_of = [&](int r) -> int { return row_in(bx, r); };
  // NORM: rsqrt(mean(x²) + eps) of row m, which scales its dot products
  auto norm_of = [&](int m) -> float {
    if constexpr (NORM && !MMA) {  // MMA: in x's scales (mlxcel_round_x)
      float t = 0.f;
#pragma unroll
      for (int i = 0; i < WPB; ++i) {
        t += red_ss[i][m];
      }
      return rsqrtf(t / float(K) + __int_as_float(EPS_BITS));
    } else {
      return 1.f;
    }
  };
  // EPI 2, 3: the block's rows r and r + HALF of batch row m, summed over its warps and normed
  auto pair_of = [&](int buf, int r, int m, float& a, float& c) {
    a = 0.f;
    c = 0.f;
#pragma unroll
    for (int i = 0; i < WPB; ++i) {
      a += red[buf][i][r * M + m];
      c += red[buf][i][(r + HALF) * M + m];
    }
    const float f = norm_of(m);
    a *= f;
    c *= f;
  };
  // what the block writes for row group grp from red[buf] (after a __syncthreads)
  auto finish = [&](int grp, int buf) {
    if constexpr (EPI == 3) {
      for (int i = tid; i < HALF * M; i += TPB) {
        const int r = i / M;
        const int m = i % M;
        float a, c;
        pair_of(buf, r, m, a, c);
        if constexpr (BIAS) {  // the projection's bias (Qwen2, in res), before the rotation
          a += static_cast<float>(res[row_in(grp, r)]);
          c += static_cast<float>(res[row_in(grp, r + HALF)]);
        }
        mlxcel_rope_store<T, N, HD, NQ>(a, c, m, grp * HALF + r, pos, inv_freq, y, y2, kvdst, kvrows);
      }
    } else if constexpr (EPI == 2) {
      for (int i = tid; i < HALF * M; i += TPB) {
        const int r = i / M;
        const int m = i % M;
        float g, u;
        pair_of(buf, r, m, g, u);
        y[size_t(m) * (N / 2) + grp * HALF + r] = static_cast<T>(g / (1.f + expf(-g)) * u);
      }
    } else {
      for (int j = tid; j < ROWS * M; j += TPB) {
        float v = 0.f;
#pragma unroll
        for (int i = 0; i < WPB; ++i) {
          v += red[buf][i][j];
        }
        const int r = j / M;
        const int m = j % M;
        v *= norm_of(m);
        const size_t at = size_t(m) * N + row_in(grp, r);
        if constexpr (EPI == 1) {
          v += static_cast<float>(res[at]);
        }
        y[at] = static_cast<T>(v);
      }
    }
  };
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* nv = reinterpret_cast<const uint4*>(nw);
  if constexpr (MMA) {
    // tensor cores, x rounded by mlxcel_round_x (see the top of the file):
    // warp `warp` takes steps warp·SPW … of every row, a step being 128 values of the row
    // (GS = 128/G groups), for ROWS/16 tiles of 16 rows; lane (gq, t) holds rows gq and
    // gq + 8 of each tile. A lane loads 16 bytes of each of its rows per step, the 4
    // lanes of a row 64 contiguous bytes (with one group of 64 4-bit values, 32 bytes,
    // per row and load, an earlier version took 1.3-1.6× the time at M = 8),
    // then the lanes of a row exchange words so that each holds
    // WPT words of every group of the step: lane t holds group q's words
    //   G = 128: 4t … 4t + 3 (no exchange)
    //   G = 64:  2σ(t), 2σ(t) + 1 with σ = (0, 2, 1, 3) (two words with lane t ^ 2)
    //   G = 32:  word t (a 4×4 transpose: two words with lane t ^ 2, one with t ^ 1)
    // and the B fragments are x's words at the same positions.
    static_assert(BITS == 4 && XQ == 1 && M <= 8 && ROWS % 16 == 0 && (G == 32 || G == 64 || G == 128) &&
                  K % 128 == 0, "qgemv: MMA needs 4-bit weights, int8 x, M <= 8, 16-row tiles, G 32/64/128, K % 128 = 0");
    constexpr int TILES = ROWS / 16;
    constexpr int WPT = G / 32;                  // words of a group per lane = MMAs per group
    constexpr int GS = 128 / G;                  // groups per step
    constexpr int SPR = K / 128;                 // steps per row
    constexpr int SPW = (SPR + WPB - 1) / WPB;   // steps per warp
    constexpr int ST0 = MLXCEL_MMA_STEPS > 0 ? MLXCEL_MMA_STEPS : (GS == 1 ? 4 : 3);
    constexpr int ST = SPW < ST0 ? SPW : ST0;    // steps whose loads a lane has in flight
    constexpr size_t KW = K / 8;                 // words per row
    // Scales and biases come CS steps at a time: lane l loads CS·GS values of row l & 15
    // of each tile, scales for l < 16 and biases for l ≥ 16 (one load for 16 rows and CS
    // steps: per-lane loads of a step's took 4 loads of 8 rows each, and the L1 data pipe
    // was the busiest unit, Nsight), and the lanes that need them take them by shuffles.
    // A chunk never straddles a warp's or a row's end (CS divides SPW and SPR).
    constexpr int CSX = GS == 4 ? 2 : 4;         // at most 16 bytes (G = 32) or 8 (G = 128)
    constexpr int CS = (SPW % CSX == 0 && SPR % CSX == 0) ? CSX : (SPW % 2 == 0 && SPR % 2 == 0) ? 2 : 1;
    constexpr int CW = CS * GS >= 2 ? CS * GS / 2 : 1;  // 32-bit words of a chunk
    constexpr int CB = 1 + (ST - 1 + CS - 1) / CS;     // chunks a lane holds (in use + loading)
    const int gq = lane >> 2;
    const int t = lane & 3;
    // the lane's position among the row's lanes for the words it ends up with (σ above)
    const int tw = G == 64 ? ((t & 1) << 1) | (t >> 1) : t;
    const uint32_t* xa = reinterpret_cast<const uint32_t*>(x);
    const float4* xd = reinterpret_cast<const float4*>(xa + size_t(M) * K / 4);
    size_t rows[TILES][2];
    size_t srow[TILES];                          // the row whose scales or biases this lane loads
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
      rows[i][0] = size_t(row_of(16 * i + gq));
      rows[i][1] = size_t(row_of(16 * i + gq + 8));
      srow[i] = size_t(row_of(16 * i + (lane & 15)));
    }
    const T* sbp = lane < 16 ? scales : biases;
    uint4 wb[ST][TILES][2];                      // the step's 16 bytes of each row
    uint32_t scw[CB][TILES][CW];                 // chunks of scales or biases (pairs of T)
    constexpr int SBW = GS > 1 ? GS / 2 : 1;
    uint32_t xfb[ST][GS][2 * WPT];               // B fragments (pairs: even, odd values)
    float4 cb[ST][GS];                           // (dq, dq·Σ xq) of rows 2t and 2t + 1
    auto load = [&](int j) {
      const int si = warp * SPW + j;
      const bool in = (SPR % WPB) == 0 || si < SPR;
      const int st = j % ST;
#pragma unroll
      for (int i = 0; i < TILES; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wb[st][i][h] = in ? *reinterpret_cast<const uint4*>(w + rows[i][h] * KW + size_t(si) * 16 + 4 * t)
                            : make_uint4(0u, 0u, 0u, 0u);
        }
        if (j % CS == 0) {  // (a chunk is wholly in or out of the row)
          const T* sp = sbp + srow[i] * (K / G) + size_t(si) * GS;
          uint32_t(&o)[CW] = scw[(j / CS) % CB][i];
          if constexpr (CS * GS == 1) {
            o[0] = in ? uint32_t(*reinterpret_cast<const unsigned short*>(sp)) : 0u;
          } else if constexpr (CW == 1) {
            o[0] = in ? *reinterpret_cast<const uint32_t*>(sp) : 0u;
          } else if constexpr (CW == 2) {
            const uint2 v = in ? *reinterpret_cast<const uint2*>(sp) : make_uint2(0u, 0u);
            o[0] = v.x;
            o[1] = v.y;
          } else {
            static_assert(CW == 4, "qgemv: scale chunks of 2 to 16 bytes");
            const uint4 v = in ? *reinterpret_cast<const uint4*>(sp) : make_uint4(0u, 0u, 0u, 0u);
            o[0] = v.x;
            o[1] = v.y;
            o[2] = v.z;
            o[3] = v.w;
          }
        }
      }
#pragma unroll
      for (int q = 0; q < GS; ++q) {
        const int gi = si * GS + q;
        if (in && gq < M) {
          // group gi of x row gq: the M rows of a group are adjacent (mlxcel_round_x)
          mlxcel_load_words<2 * WPT>(xa + 2 * ((size_t(gi) * M + gq) * (G / 8) + tw * WPT), xfb[st][q]);
        } else {
#pragma unroll
          for (int v = 0; v < 2 * WPT; ++v) {
            xfb[st][q][v] = 0u;
          }
        }
        // rows 2t, 2t + 1 of group gi (the rounding kernel writes zeros for rows ≥ M)
        cb[st][q] = in ? xd[size_t(gi) * 4 + t] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    };
    // the scale and bias words of step j (SBW each, scale_of's layout) of rows gq (h = 0)
    // and gq + 8 (h = 1) of tile i, from the lanes that loaded them
    auto scales_of = [&](int j, int i, int h, uint32_t (&sw)[SBW], uint32_t (&bw)[SBW]) {
      const int src = gq + 8 * h;
      const uint32_t(&c)[CW] = scw[(j / CS) % CB][i];
      const int p = j % CS;
      if constexpr (GS == 1) {  // one T per step: half p % 2 of word p / 2
        const uint32_t sv = __shfl_sync(0xFFFFFFFFu, c[p / 2], src);
        const uint32_t bv = __shfl_sync(0xFFFFFFFFu, c[p / 2], src + 16);
        sw[0] = (p & 1) ? (sv >> 16) | (bv & 0xFFFF0000u) : (sv & 0xFFFFu) | (bv << 16);
        bw[0] = 0u;  // (unused: scale_of reads both halves of sw)
      } else {
#pragma unroll
        for (int v = 0; v < SBW; ++v) {
          sw[v] = __shfl_sync(0xFFFFFFFFu, c[p * SBW + v], src);
          bw[v] = __shfl_sync(0xFFFFFFFFu, c[p * SBW + v], src + 16);
        }
      }
    };
    // scale (s) and bias (b) of group q of a step as floats
    auto scale_of = [&](const uint32_t (&sw)[SBW], const uint32_t (&bw)[SBW], int q, float& s, float& b) {
      if constexpr (GS == 1) {
        s = mlxcel_lo<T>(sw[0]);
        b = mlxcel_hi<T>(sw[0]);
      } else {
        const uint32_t su = sw[q / 2], bu = bw[q / 2];
        s = (q & 1) ? mlxcel_hi<T>(su) : mlxcel_lo<T>(su);
        b = (q & 1) ? mlxcel_hi<T>(bu) : mlxcel_lo<T>(bu);
      }
    };
    float acc[TILES][4];
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[i][c] = 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j + 1 < ST; ++j) {
      load(j);
    }
#pragma unroll
    for (int j = 0; j < SPW; ++j) {
      if (j + ST - 1 < SPW) {
        load(j + ST - 1);
      }
      const int st = j % ST;
#pragma unroll
      for (int i = 0; i < TILES; ++i) {
        uint32_t sw[2][SBW], bw[2][SBW];  // scales, biases of rows gq, gq + 8
        scales_of(j, i, 0, sw[0], bw[0]);
        scales_of(j, i, 1, sw[1], bw[1]);
        // the words of group q of this step for rows gq (u[0]) and gq + 8 (u[1])
        uint32_t u[2][GS][WPT];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 v = wb[st][i][h];
          if constexpr (GS == 1) {
            u[h][0][0] = v.x;
            u[h][0][1] = v.y;
            u[h][0][2] = v.z;
            u[h][0][3] = v.w;
          } else if constexpr (GS == 2) {
            // lanes 0, 1 hold group 0's words 0-3, 4-7; lanes 2, 3 group 1's: swap half
            const bool lo = t < 2;
            const uint32_t r0 = __shfl_xor_sync(0xFFFFFFFFu, lo ? v.z : v.x, 2);
            const uint32_t r1 = __shfl_xor_sync(0xFFFFFFFFu, lo ? v.w : v.y, 2);
            u[h][0][0] = lo ? v.x : r0;
            u[h][0][1] = lo ? v.y : r1;
            u[h][1][0] = lo ? r0 : v.z;
            u[h][1][1] = lo ? r1 : v.w;
          } else {
            // lane t holds group t's words 0-3; transpose so that it holds word t of each
            const bool hi2 = (t & 2) != 0;
            const uint32_t a0 = __shfl_xor_sync(0xFFFFFFFFu, hi2 ? v.x : v.z, 2);
            const uint32_t a1 = __shfl_xor_sync(0xFFFFFFFFu, hi2 ? v.y : v.w, 2);
            // now lane t has words 2·(t >> 1) + {0, 1} of groups t and t ^ 2: m of group
            // t & 1, n of group (t & 1) | 2; the partner t ^ 1 has the same words of the
            // other two groups
            const uint32_t m0 = hi2 ? a0 : v.x, m1 = hi2 ? a1 : v.y;
            const uint32_t n0 = hi2 ? v.z : a0, n1 = hi2 ? v.w : a1;
            const bool hi1 = (t & 1) != 0;
            const uint32_t b0 = __shfl_xor_sync(0xFFFFFFFFu, hi1 ? m0 : m1, 1);
            const uint32_t b1 = __shfl_xor_sync(0xFFFFFFFFu, hi1 ? n0 : n1, 1);
            // word t of groups 0, 1 from m (own or partner's), of groups 2, 3 from n
            uint32_t p[4];
            p[0] = hi1 ? b0 : m0;
            p[1] = hi1 ? m1 : b0;
            p[2] = hi1 ? b1 : n0;
            p[3] = hi1 ? n1 : b1;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              u[h][q][0] = p[q];
            }
          }
        }
#pragma unroll
        for (int q = 0; q < GS; ++q) {
          int c[4] = {0x4B400000, 0x4B400000, 0x4B400000, 0x4B400000};
#pragma unroll
          for (int v = 0; v < WPT; ++v) {
            const uint32_t u0 = u[0][q][v];
            const uint32_t u1 = u[1][q][v];
            mlxcel_mma_s8(c, u0 & 0x0F0F0F0Fu, u1 & 0x0F0F0F0Fu, (u0 >> 4) & 0x0F0F0F0Fu,
                          (u1 >> 4) & 0x0F0F0F0Fu, xfb[st][q][2 * v], xfb[st][q][2 * v + 1]);
          }
          float s0, b0, s1, b1;
          scale_of(sw[0], bw[0], q, s0, b0);
          scale_of(sw[1], bw[1], q, s1, b1);
          const float2 c0 = make_float2(cb[st][q].x, cb[st][q].y);
          const float2 c1 = make_float2(cb[st][q].z, cb[st][q].w);
          // a NaN in x makes dq NaN, an inf makes dq·0 NaN: both reach the output
          acc[i][0] = fmaf(__int_as_float(c[0]) - 12582912.f, s0 * c0.x, fmaf(b0, c0.y, acc[i][0]));
          acc[i][1] = fmaf(__int_as_float(c[1]) - 12582912.f, s0 * c1.x, fmaf(b0, c1.y, acc[i][1]));
          acc[i][2] = fmaf(__int_as_float(c[2]) - 12582912.f, s1 * c0.x, fmaf(b1, c0.y, acc[i][2]));
          acc[i][3] = fmaf(__int_as_float(c[3]) - 12582912.f, s1 * c1.x, fmaf(b1, c1.y, acc[i][3]));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int r = 16 * i + gq + (c >= 2 ? 8 : 0);
        const int m = 2 * t + (c & 1);
        if (m < M) {
          red[0][warp][r * M + m] = acc[i][c];
        }
      }
    }
  } else if constexpr (PG > 0) {
    // Streaming (M = 1 with int8 activations): a grid of PG blocks, block b taking the row
    // groups b, b + PG, … of ROWS rows each. Thread t owns chunks t, t + TPB, … of every
    // row, as on the path below, and rounds its chunks of x once for all groups. Its
    // weights, scales and biases come through shared memory by cp.async, STAGES row
    // groups in flight: the loads of later groups are issued while a group's dot products
    // are reduced and written, so the block never waits with nothing in flight (one block
    // per row group issued all of its loads, then did its math and exited; the 8B down
    // projection, 1.9 waves of such blocks, read at 2/3 of what the GPU can). A thread reads
    // back only what it copied, so its own cp.async wait orders it; the __syncthreads of
    // each group's reduction orders a stage's reads before the copy that reuses it.
    static_assert(M == 1 && XQ == 1 && BITS == 4, "qgemv: streaming needs M = 1 and int8 activations");
    static_assert(N % ROWS == 0, "qgemv: streaming needs ROWS dividing N");
    constexpr int NG = N / ROWS;                  // row groups
    constexpr int SLOTS = ITERS * ROWS;           // 16-byte chunks per thread and group
    constexpr int STAGE = SLOTS * TPB * (16 + 4 + 4);
    // static shared memory is at most 48 KB a block, the reduction's buffers included
    constexpr int FREE = 48 * 1024 - int(sizeof(float)) * (2 * WPB * ROWS * M + WPB * M);
    constexpr int STAGES = FREE / STAGE < 4 ? FREE / STAGE : 4;
    static_assert(STAGES >= 2, "qgemv: streaming needs two stages of ROWS·ITERS·TPB chunks in 48 KB");
    __shared__ uint4 wsm[STAGES][SLOTS][TPB];
    // (scales and biases are copied as the 32-bit word holding the chunk's T: their
    // arrays start 4-byte aligned, as MLX allocates them)
    __shared__ uint32_t ssm[STAGES][SLOTS][TPB];  // the pair of T holding the chunk's scale
    __shared__ uint32_t bsm[STAGES][SLOTS][TPB];  // … and bias
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    const uint32_t* s32 = reinterpret_cast<const uint32_t*>(scales);
    const uint32_t* b32 = reinterpret_cast<const uint32_t*>(biases);
    int xe[ITERS][4], xo[ITERS][4];
    float dqv[ITERS], Xv[ITERS];
    float ss0 = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = it * TPB + tid;
      const bool in = (CPR % TPB) == 0 || c < CPR;
      float xs[32];
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        if (in) {
          mlxcel_h8<T>(xv[c * 4 + v], xs + 8 * v);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            xs[8 * v + j] = 0.f;
          }
        }
      }
      if constexpr (NORM) {
        float gs[32];
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          mlxcel_h8<T>(in ? nv[c * 4 + v] : make_uint4(0u, 0u, 0u, 0u), gs + 8 * v);
        }
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          ss0 = fmaf(xs[j], xs[j], ss0);
          xs[j] *= gs[j];
        }
      }
      mlxcel_xq_chunk(xs, xe[it], xo[it], dqv[it], Xv[it]);
    }
    if constexpr (NORM) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        ss0 += __shfl_xor_sync(0xFFFFFFFFu, ss0, o);
      }
      if (lane == 0) {
        red_ss[warp][0] = ss0;  // read after the first group's __syncthreads
      }
    }
    // copy row group grp's chunks of this thread into stage st (one commit group, empty
    // past the last row group, so that the count of groups stays the same)
    auto issue = [&](int grp, int st) {
      if (grp < NG) {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          const int c = it * TPB + tid;
          if ((CPR % TPB) == 0 || c < CPR) {
            const int g = c * VPC / G;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
              const size_t row = size_t(row_in(grp, r));
              mlxcel_cp16(&wsm[st][it * ROWS + r][tid], wv + row * CPR + c);
              const size_t si = (row * GPR + g) / 2;
              mlxcel_cp4(&ssm[st][it * ROWS + r][tid], s32 + si);
              mlxcel_cp4(&bsm[st][it * ROWS + r][tid], b32 + si);
            }
          }
        }
      }
      mlxcel_cp_commit();
    };
#pragma unroll
    for (int j = 0; j + 1 < STAGES; ++j) {
      issue(bx + j * PG, j);
    }
    int i = 0;
    for (int grp = bx; grp < NG; grp += PG, ++i) {
      const int st = i % STAGES;
      issue(grp + (STAGES - 1) * PG, (i + STAGES - 1) % STAGES);
      mlxcel_cp_wait<STAGES - 1>();  // this group's copies have landed
      float acc[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = 0.f;
      }
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int c = it * TPB + tid;
        if ((CPR % TPB) != 0 && c >= CPR) {
          break;
        }
        const int g = c * VPC / G;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const uint4 qv = wsm[st][it * ROWS + r][tid];
          const bool hi = ((size_t(row_in(grp, r)) * GPR + g) & 1) != 0;
          const uint32_t su = ssm[st][it * ROWS + r][tid];
          const uint32_t bu = bsm[st][it * ROWS + r][tid];
          const float sc = hi ? mlxcel_hi<T>(su) : mlxcel_lo<T>(su);
          const float bi = hi ? mlxcel_hi<T>(bu) : mlxcel_lo<T>(bu);
          const uint32_t ws[4] = {qv.x, qv.y, qv.z, qv.w};
          int D = 0;
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            D = __dp4a(int(ws[v] & 0x0F0F0F0Fu), xe[it][v], D);
            D = __dp4a(int((ws[v] >> 4) & 0x0F0F0F0Fu), xo[it][v], D);
          }
          acc[r] = fmaf(sc * dqv[it], static_cast<float>(D), fmaf(bi, Xv[it], acc[r]));
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float v = acc[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
        }
        if (lane == 0) {
          red[i & 1][warp][r] = v;
        }
      }
      __syncthreads();
      finish(grp, i & 1);
    }
    mlxcel_cp_wait<0>();
  } else {
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    float ss[M];  // NORM: this thread's part of Σ x² of each row
#pragma unroll
    for (int m = 0; m < M; ++m) {
      ss[m] = 0.f;
    }

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        acc[r][m] = 0.f;
      }
    }

    // Issue every weight, scale and bias load of this thread before any math, so
    // each thread has ITERS·ROWS 16-byte loads in flight (chunks past the row end,
    // when CPR is not a multiple of TPB, read as zero weight and zero scale).
    uint4 q[ITERS][ROWS];
    float s[ITERS][ROWS];
    float b[ITERS][ROWS];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = it * TPB + tid;
      const bool in = (CPR % TPB) == 0 || c < CPR;
      const int g = (in ? c : 0) * VPC / G;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const size_t row = size_t(row_of(r));
        q[it][r] = in ? wv[row * CPR + c] : make_uint4(0u, 0u, 0u, 0u);
        s[it][r] = in ? static_cast<float>(scales[row * GPR + g]) * (XQ ? 1.f : SCALE) : 0.f;
        b[it][r] = in ? static_cast<float>(biases[row * GPR + g]) : 0.f;
      }
    }

#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int c = it * TPB + tid;
      if ((CPR % TPB) != 0 && c >= CPR) {
        break;
      }
      const int k0 = c * VPC;
      float gs[NORM ? VPC : 1];
      if constexpr (NORM) {
#pragma unroll
        for (int v = 0; v < VPC / 8; ++v) {
          mlxcel_h8<T>(nv[k0 / 8 + v], gs + 8 * v);
        }
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xs[VPC];
#pragma unroll
        for (int v = 0; v < VPC / 8; ++v) {
          mlxcel_h8<T>(xv[(size_t(m) * K + k0) / 8 + v], xs + 8 * v);
        }
        if constexpr (NORM) {
#pragma unroll
          for (int j = 0; j < VPC; ++j) {
            ss[m] = fmaf(xs[j], xs[j], ss[m]);
            xs[j] *= gs[j];
          }
        }
        if constexpr (XQ) {
          // this chunk of x as int8 (xq = round(x / dq), dq = max|x| / 127), packed as the
          // even and odd values of each 8-value word so they line up with the low and high
          // nibbles of the weight word under a 0x0F0F0F0F mask: two dp4a per word and row
          int xe[4], xo[4];
          float dq, X;
          mlxcel_xq_chunk(xs, xe, xo, dq, X);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            const uint32_t ws[4] = {q[it][r].x, q[it][r].y, q[it][r].z, q[it][r].w};
            int D = 0;
#pragma unroll
            for (int v = 0; v < 4; ++v) {
              D = __dp4a(int(ws[v] & 0x0F0F0F0Fu), xe[v], D);
              D = __dp4a(int((ws[v] >> 4) & 0x0F0F0F0Fu), xo[v], D);
            }
            // Σ w·x ≈ scale·dq·Σ q·xq + bias·dq·Σ xq over the group's part in this chunk
            // (a NaN in x makes dq NaN, an inf makes dq·0 NaN: both reach the output)
            acc[r][m] = fmaf(s[it][r] * dq, static_cast<float>(D), fmaf(b[it][r], X, acc[r][m]));
          }
        } else {
          float X0 = 0.f, X1 = 0.f;
#pragma unroll
          for (int j = 0; j < VPC; j += 2) {
            X0 += xs[j];
            X1 += xs[j + 1];
          }
          const float X = X0 + X1;
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            const uint4 qq = q[it][r];
            const float D = mlxcel_word_dot<BITS>(qq.x, xs) +
                mlxcel_word_dot<BITS>(qq.y, xs + VPW) +
                mlxcel_word_dot<BITS>(qq.z, xs + 2 * VPW) +
                mlxcel_word_dot<BITS>(qq.w, xs + 3 * VPW);
            acc[r][m] = fmaf(s[it][r], D - X, fmaf(b[it][r], X, acc[r][m]));
          }
        }
      }
    }

    // reduce: lanes of a warp by shuffles, then the warps of the block in shared memory
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float v = acc[r][m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
        }
        if (lane == 0) {
          red[0][warp][r * M + m] = v;
        }
      }
    }
    if constexpr (NORM) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float v = ss[m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
        }
        if (lane == 0) {
          red_ss[warp][m] = v;
        }
      }
    }
  }
  if constexpr (PG == 0) {
    __syncthreads();
    finish(bx, 0);
  }
}

// Products in stages of one kernel (mlxcel_qgemv_mlp): the first B1 blocks to start run
// the first product, the next B2 the second, which reads what the first wrote. A block of
// the second stage waits until all B1 blocks of the first have counted themselves done.
// That cannot deadlock: a block's place comes from a ticket it takes when it starts (not
// from its index: CUDA does not promise to start blocks in index order), so every block
// waited for has started before the waiting one, and it waits for nothing. (The CPU
// emulation runs blocks one at a time, so its waits are already met.) A kernel that
// waited longer than about two seconds traps rather than hanging (the CUDA context is
// then lost: the process ends with MLX's error).
// Memory order as in a grid-wide barrier: the writer's block passes a barrier, one
// thread fences and adds one to the count; the waiting block's thread 0 reads the count
// with acquire semantics, fences, and the block passes a barrier before reading.
__device__ __forceinline__ int mlxcel_ld_acquire(const int* p) {
#if defined(__CUDA_ARCH__)
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return *p;
#endif
}
// this block's writes are done: count it in *c
__device__ __forceinline__ void mlxcel_stage_arrive(int* c) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c, 1);
  }
}
// wait until *c reaches n
__device__ __forceinline__ void mlxcel_stage_wait(const int* c, int n) {
  if (threadIdx.x == 0) {
#if defined(__CUDA_ARCH__)
    const long long t0 = clock64();
    while (mlxcel_ld_acquire(c) < n) {
      __nanosleep(100);
      if (clock64() - t0 > (1ll << 32)) {
        __trap();
      }
    }
#else
    while (mlxcel_ld_acquire(c) < n) {
    }
#endif
    __threadfence();
  }
  __syncthreads();
}

// A SwiGLU MLP of a decode step in one kernel, two stages (the host's work per MLX op
// bounds decode, and this is one op where the gate/up and down GEMVs were two; on an H100
// it measured slower than the two, docs/benchmarks.md):
//   act[M, NI] = silu(g)·u of [g | u] = norm(x)·W1ᵀ    (W1 [2·NI, K]: EPI 2, NORM)
//   y[M, K]    = res + act·W2ᵀ (EPI2 = 1), or act·W2ᵀ (EPI2 = 0: a tensor-parallel rank
//                that does not add the residual)          (W2 [K, NI])
// with the two products' own rows per block (R1, R2) and the same warps per block. act
// and count are mlxcel's scratch (written through MLX's const input pointers; MLX never
// reads them; the counts in device memory, src/mlx/device_inputs.rs `counts_i32`): count[0] counts the first stage's blocks done, count[1] the second's, count[2]
// hands out the tickets, and the second stage's last block sets all three back to zero,
// so the next call finds them so. Calls sharing the scratch are ordered by `prev` (the
// previous call's output, never read). The dp4a/FMA path only (no tensor cores, no
// streaming grid): M ≤ 4.
template <typename T, int M, int NI, int K, int G, int BITS, int R1, int R2, int WPB, int NORM,
          int EPS_BITS, int XQ, int EPI2>
__device__ __forceinline__ void mlxcel_qgemv_mlp(const T* x, const uint32_t* w1, const T* s1,
                                                 const T* b1, const T* nw, const uint32_t* w2,
                                                 const T* s2, const T* b2, const T* res,
                                                 const T* act_in, const int32_t* count_in, T* y) {
  static_assert((2 * NI) % R1 == 0 && K % R2 == 0 && M <= 4 && (EPI2 == 0 || EPI2 == 1),
                "qgemv_mlp: whole row groups, at most 4 rows, a residual or none");
  constexpr int B1 = 2 * NI / R1;
  constexpr int B2 = K / R2;
  T* act = const_cast<T*>(act_in);
  int* count = const_cast<int*>(reinterpret_cast<const int*>(count_in));
  __shared__ int ticket;
  if (threadIdx.x == 0) {
    ticket = atomicAdd(count + 2, 1);
  }
  __syncthreads();
  const int bx = ticket;
  if (bx < B1) {
    mlxcel_qgemv<T, M, 2 * NI, K, G, BITS, R1, WPB, 2, NORM, EPS_BITS, 0, 0, XQ, 0, 0, 0>(
        x, w1, s1, b1, res, nw, nullptr, nullptr, act, nullptr, nullptr, 0, bx);
    mlxcel_stage_arrive(count);
    return;
  }
  mlxcel_stage_wait(count, B1);
  mlxcel_qgemv<T, M, K, NI, G, BITS, R2, WPB, EPI2, 0, EPS_BITS, 0, 0, XQ, 0, 0, 0>(
      act, w2, s2, b2, res, nw, nullptr, nullptr, y, nullptr, nullptr, 0, bx - B1);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(count + 1, 1) == B2 - 1) {  // the last block: every block has passed its wait
      atomicExch(count, 0);
      atomicExch(count + 1, 0);
      atomicExch(count + 2, 0);  // (every block has its ticket: all have counted themselves)
    }
  }
}

// x [M, K] rounded to int8 per group of G values once per GEMV, the input of the
// tensor-core path (MMA = 1), which then only loads its B fragments. Output, uint32 words,
// laid out so that what one load of the GEMV takes is adjacent:
//   [0, M·K/4)           row m's 8-value word i (k = 8i … 8i + 7) of group g = i / (G/8)
//                        at uint2 (g·M + m)·G/8 + i % (G/8) (a group's M rows together):
//                        the even values and the odd values as int8 (mlxcel_pack_i8)
//   [M·K/4, +16·K/G)     float2 (dq·f, dq·f·Σ xq) of row m and group g at 8g + m, zeros
//                        for rows M … 7 (a group's rows together, padded to the MMA's 8)
// with dq = max|x| / 127 over the group and f = 1, or with NORM the row's RMSNorm factor
// rsqrt(mean(x²) + eps) (x is then multiplied by the norm weight nw before rounding).
// One thread per 8-value word, XQ_TPB threads per block, ceil(K/8 / XQ_TPB) blocks per
// row of x (each computes its row's Σ x² for the norm: K ≤ a few 10k values).
constexpr int XQ_TPB = 256;
template <typename T, int M, int K, int G, int NORM, int EPS_BITS>
__device__ __forceinline__ void mlxcel_round_x(const T* x, const T* nw, uint32_t* xq) {
  static_assert(K % G == 0 && (G == 32 || G == 64 || G == 128) && M <= 8,
                "round_x: G 32/64/128 dividing K, at most 8 rows (the MMA's columns)");
  constexpr int WPR = K / 8;                         // 8-value words per row
  constexpr int BPR = (WPR + XQ_TPB - 1) / XQ_TPB;  // blocks per row
  constexpr int WPG = G / 8;
  const int tid = threadIdx.x;
  const int m = int(blockIdx.x) / BPR;
  const int i = (int(blockIdx.x) % BPR) * XQ_TPB + tid;
  const bool in = i < WPR;  // (a whole group is in or out: XQ_TPB is a multiple of WPG)
  const uint4* xv = reinterpret_cast<const uint4*>(x) + size_t(m) * WPR;
  float f = 1.f;
  if constexpr (NORM) {
    __shared__ float part[XQ_TPB / 32];
    float ss = 0.f;
    for (int j = tid; j < WPR; j += XQ_TPB) {
      float xs[8];
      mlxcel_h8<T>(xv[j], xs);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        ss = fmaf(xs[e], xs[e], ss);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
    }
    if ((tid & 31) == 0) {
      part[tid >> 5] = ss;
    }
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < XQ_TPB / 32; ++j) {
      t += part[j];
    }
    f = rsqrtf(t / float(K) + __int_as_float(EPS_BITS));
  }
  float xs[8];
  if (in) {
    mlxcel_h8<T>(xv[i], xs);
    if constexpr (NORM) {
      float gs[8];
      mlxcel_h8<T>(reinterpret_cast<const uint4*>(nw)[i], gs);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        xs[e] *= gs[e];
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      xs[e] = 0.f;
    }
  }
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    amax = mlxcel_max_nan(amax, fabsf(xs[e]));
  }
  // the WPG threads of a group are adjacent lanes
#pragma unroll
  for (int o = 1; o < WPG; o <<= 1) {
    amax = mlxcel_max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const float dq = amax * (1.f / 127.f) * f;  // a NaN in x (or its norm) makes it NaN
  int e8, o8;
  mlxcel_pack_i8(xs, inv, e8, o8);
  int xsum = __dp4a(e8, 0x01010101, __dp4a(o8, 0x01010101, 0));
#pragma unroll
  for (int o = 1; o < WPG; o <<= 1) {
    xsum += __shfl_xor_sync(0xFFFFFFFFu, xsum, o);
  }
  if (in) {
    const int g = i / WPG;
    reinterpret_cast<uint2*>(xq)[(size_t(g) * M + m) * WPG + i % WPG] = make_uint2(uint32_t(e8), uint32_t(o8));
    if (i % WPG == 0) {
      float2* xd = reinterpret_cast<float2*>(xq + size_t(M) * K / 4) + 8 * g;
      xd[m] = make_float2(dq, dq * static_cast<float>(xsum));
      if (m == 0) {
#pragma unroll
        for (int r = M; r < 8; ++r) {
          xd[r] = make_float2(0.f, 0.f);
        }
      }
    }
  }
}
// @@body
  mlxcel_qgemv<T, M, N, K, G, BITS, ROWS, WPB, EPI, NORM, EPS_BITS, 0, 0, XQ, MMA, PG, 0>(
      x, w, scales, biases, res, nw, nullptr, nullptr, y, nullptr);
// @@body_rope
  mlxcel_qgemv<T, M, N, K, G, BITS, ROWS, WPB, 3, NORM, EPS_BITS, HD, NQ, XQ, MMA, PG, BIAS>(
      x, w, scales, biases, qb, nw, pos, inv_freq, q, kv);
// @@body_xq
  mlxcel_round_x<T, M, K, G, NORM, EPS_BITS>(x, nw, xq);
// @@body_rope_kv
  mlxcel_qgemv<T, M, N, K, G, BITS, ROWS, WPB, 3, NORM, EPS_BITS, HD, NQ, XQ, MMA, PG, BIAS>(
      x, w, scales, biases, qb, nw, pos, inv_freq, q, const_cast<T*>(pool), dst,
      int(pool_shape[2]));
// @@body_mlp
  mlxcel_qgemv_mlp<T, M, NI, K, G, BITS, R1, R2, WPB, NORM, EPS_BITS, XQ, EPI2>(
      x, w1, s1, b1, nw, w2, s2, b2, res, act, count, y);
