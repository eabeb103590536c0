// mlxcel: quantized GEMM for batched decode, y[M, N] = x[M, K] · dequant(w)[N, K]ᵀ for
// M = 9 … 128 batch rows (a server's concurrent streams, short prompts), reading each weight
// once per call (the GEMV, kernels/qgemv.cu, takes M ≤ 8; 9–32 rows ran it on row chunks of
// ≤ 8, reading every weight once per chunk).
//
// Weights in MLX's affine layout, as kernels/qgemv.cu reads them:
//   w      uint32 [N, K·BITS/32]  value j of word i is bits [BITS·j, BITS·(j+1)), k = i·32/BITS + j
//   scales T      [N, K/G]        w[n, k] = q · scale + bias, G = 32, 64 or 128
//   biases T      [N, K/G]
// T is bfloat16 or float16 (x, y, scales, biases, the norm weight). This file's device code
// comes after kernels/qgemv.cu's header (mlxcel passes both to MLX as one header, so the
// GEMV's helpers are shared, not copied). Compiled at run time by MLX (`fast::cuda_kernel`);
// template constants MT, N, K, G, BITS, WR, WN, SK, ST, EPI, NORM, EPS_BITS (and HD, NQ, BIAS
// for the RoPE entry point). M itself is not one: the kernel reads it from x's shape (rows of
// K), and MT (M rounded up to whole tiles of 8 rows) picks the variant, so batch sizes
// share compiled kernels.
//
// Tensor cores, bf16/f16 MMAs (`mma.sync.m16n8k16`, f32 accumulators) with the weights
// dequantized to T in registers (in the style of Marlin), not the GEMV's int8 path (x
// rounded to int8 per group by a kernel of its own, `mma.m16n8k32` s8·s8):
// - MLX's host work per op bounds a decode step on a GPU: the int8 path costs one more op
//   per product (the rounding kernel), 4 per layer; here x is read as it is.
// - Accuracy: x is not rounded (an int8 x carries up to 1/254 of its group's largest value);
//   w is rounded to T once, as `mx.dequantize` does.
// - Instructions: the int8 path applies scale and bias per group after each MMA, for every
//   tile of 8 batch rows (4 accumulators × a conversion and two FMAs, per group and n-tile),
//   which grows with M; here they are applied once per weight while dequantizing, and the
//   MMAs accumulate across groups. bf16 MMAs run at half the int8 rate, which matters only
//   where the kernel is compute-bound (M near 128).
//
// Work split: a block has WR × WN warps. Warp (wr, wn) takes two 16-row tiles of weight
// rows (the block's rows BN = 32·WR) and n-tiles wn·NTW … of 8 batch rows (NTW = NT/WN,
// NT = MT/8), over the block's range of K: the grid is ceil(N/BN) column blocks × SK splits
// of K (split-K, so that shapes with few column blocks still fill the GPU).
// K is walked in steps of 128 values, through a ring of ST stages in shared memory (the
// launch's dynamic shared memory, mlxcel_qgemm_smem_bytes in src/kernels/qgemm.rs): each
// thread copies its part of step s + ST - 1 with `cp.async` (no registers, nothing waits
// for it) while the warps multiply step s, so ST - 1 steps of weights and x are in flight
// (ST - 2 with MLXCEL_QGEMM_CARRY) per block and no step waits a memory round trip (the
// previous design loaded into registers a step or two ahead and staged x with two barriers
// a step: latency-bound at 0.4-0.6 TB/s on an H200). One barrier a step (two with NORM or
// MLXCEL_QGEMM_XPAIR). Per step:
// - x: rows 0..MT of x[step] (rows ≥ M as zeros) land as they are; with NORM the block
//   multiplies them by the norm weight (copied with them) in place, adding up Σ x² per row.
//   Word 4t + c of a row sits at slot (4c + t) ^ 4·(row & 1), so a warp's fragment loads
//   hit distinct banks; a lane turns the 8-value word (x0 … x7) it loads into the pairs
//   (x0,x4) (x1,x5) (x2,x6) (x3,x7), the order the weights' nibbles unpack in (below);
//   with NORM the block stores them so once, in the same pass as the norm, and without it
//   in a pass of its own (MLXCEL_QGEMM_XPAIR, below).
// - w: lane (g, t) (g = lane/4, t = lane%4) of a warp reads rows g and g + 8 of each of its
//   tiles from the stage, the lane's 32 values k = 32t … 32t+31 of the step (16 bytes of
//   4-bit weights, 32 of 8-bit: one group, G being a multiple of 32, so one scale and bias
//   per row; blocks of 256 weight rows copy them for several steps at once into a buffer
//   after the ring (SBLK below); otherwise, with groups of 32 or 64 they come through the
//   ring with the step, with groups of 128 they are plain loads into registers a step
//   ahead). Word c (8 values v0 … v7) of a row becomes four T pairs
//   (v0,v4) (v1,v5) (v2,v6) (v3,v7): 4-bit by masking nibbles j and j + 4 into the
//   mantissas of T(128) (bf16) or T(1024) (f16), which makes 128 + v exactly, then one
//   FMA2 subtracting it and one FMA2 with the scale and bias (one rounding, as
//   `mx.dequantize`); 8-bit by placing the bytes in floats 2^23 + v, subtracting 2^23 and
//   packing the exact integers to T. The pairs of word c feed two MMAs:
//     A: a0 = (row g: v0, v4), a1 = (row g+8: v0, v4), a2 = (row g: v1, v5), a3 = (g+8: v1, v5)
//     B: b0 = (x0, x4) of batch row 8j + g, b1 = (x1, x5)
//   (which k of the MMA a value takes does not matter to the product as long as A and B
//   agree), then (v2,v6) (v3,v7) with (x2,x6) (x3,x7). One B fragment load (16 bytes from
//   shared memory) feeds the four MMAs of the warp's two tiles.
// Split-K: with SK > 1 each block adds its f32 partial tile into its column block's tile in
// `part` (reductions in L2, in the order of its threads' registers; with NORM it writes its
// Σ x² after the tiles), bumps `count[column block]` after a fence, and the block that
// brings it to SK reads the sum back, applies the epilogue and leaves zeros in the tile and
// the count. `part` and `count` are mlxcel's own scratch (src/kernels/qgemm.rs, made as
// zeros), written through MLX's const input pointers; calls that share it are ordered by a
// token: each call's `tok` output is the next call's `prev` input.
//
// EPI picks what is written, as in kernels/qgemv.cu:
//   0: y[M, N]   = x·Wᵀ
//   1: y[M, N]   = res + x·Wᵀ                 (res T [M, N])
//   2: y[M, N/2] = silu(g)·u of the halves g = (x·Wᵀ)[:, :N/2], u = (x·Wᵀ)[:, N/2:]
//      (a warp's first tile holds gate rows, its second the same up rows)
//   3: q/k/v with RoPE on q and k (NQ query heads, then key and value heads of HD values;
//      the first tile holds the rows d of 16 pairs (d, d + HD/2), the second their d + HD/2),
//      q to y [M, NQ, 1, HD], key then value heads to y2 [M, 2·NKV, 1, HD]; with BIAS = 1
//      the projection's bias qb (T [N], Qwen2's q/k/v biases) is added before the rotation
// NORM = 1: RMSNorm of each row of x first (x · nw · rsqrt(mean(x²) + eps), eps the float
// with bits EPS_BITS); the rsqrt factor is applied in the epilogue.
//
// Parts, split at the marker lines: the header (device code) and two bodies of the
// `__global__` function MLX generates around them:
//   @@body       (x, w, scales, biases, res, nw, part, count, prev) -> (y, tok)      EPI 0, 1, 2
//   @@body_rope  (x, w, scales, biases, nw, pos, inv_freq, qb, part, count, prev) -> (q, kv, tok)
// (res is read only with EPI 1, qb only with BIAS, nw only with NORM, part/count only with SK > 1; prev and tok
// are never touched: they only order calls in MLX's graph). The CPU tests
// (tests/qgemm_emulated.rs) compile this file as C++ with the MMA, FMA2 and conversions
// emulated (the `#else` branches below); `scripts/check_qgemm.py` runs it on a GPU.
// mlxcel embeds it; `MLXCEL_QGEMM_SOURCE=path` replaces it at run time.
// @@header
// Tuning switches (a kernel file sent through MLXCEL_QGEMM_SOURCE may define them first):
// MLXCEL_QGEMM_XPAIR 1: without NORM a pass over each landed stage stores x in the MMAs'
//   pair order once per block (one more barrier a step), as the norm's pass does; 0 (the
//   default until it is measured): every warp pairs the x fragments it loads (4 byte
//   permutes per fragment, in each of the WR warps that load the same fragment).
// MLXCEL_QGEMM_CUNROLL: how far the loop over a step's 4 words is unrolled for 4-bit launches
//   of at most 32 batch rows (their accumulators leave registers to spare); 1: not unrolled
//   (larger launches, and 8-bit, always).
#ifndef MLXCEL_QGEMM_XPAIR
#define MLXCEL_QGEMM_XPAIR 0
#endif
#ifndef MLXCEL_QGEMM_CUNROLL
#define MLXCEL_QGEMM_CUNROLL 1
#endif
// MLXCEL_QGEMM_XHOIST 1 (default): a word's x fragments are loaded from shared memory before
// its weights dequantize (NTW · 4 more registers live); 0: each beside its MMAs.
#ifndef MLXCEL_QGEMM_XHOIST
#define MLXCEL_QGEMM_XHOIST 1
#endif
// MLXCEL_QGEMM_PIPE R: in launches of at most R batch rows (0: none), the step's 4 words
// unrolled, each word's weights dequantized while the MMAs of the word before run (two
// register sets of A fragments, 16 more registers): one word at a time, a warp's
// tensor-core work waited for its own dequantizing and the dequantizing for the MMAs
// reading the registers it reuses (CUNROLL does not apply there). Above 32 rows only
// without the norm, and with the weights read from the stage word by word instead of a
// step's chunks held in registers: otherwise the second set spilled (ptxas, sm_90a). On
// one H100 (Nsight, 8B): gate/up at 32 rows 100.4 -> 86.6 us, down at 64 rows 88.4 -> 82.6.
#ifndef MLXCEL_QGEMM_PIPE
#define MLXCEL_QGEMM_PIPE 64
#endif
// MLXCEL_QGEMM_SBLOCK 1 (default): blocks of 256 weight rows copy the scales and biases of
// several steps at once into a buffer after the ring (see SBLK below); 0: a step's at a time.
#ifndef MLXCEL_QGEMM_SBLOCK
#define MLXCEL_QGEMM_SBLOCK 1
#endif
// (Not in MLXCEL_QGEMM_BOUNDED 1, the 128-register flavour of src/kernels/qgemm.rs
// BOUNDED_PREFIX: at 8 bits it spilled with it.)
#ifndef MLXCEL_QGEMM_BOUNDED
#define MLXCEL_QGEMM_BOUNDED 0
#endif
// MLXCEL_QGEMM_WGMMA 1 (the launch's wgmma flavour, src/kernels/qgemm.rs): where the GPU has
// Hopper's warpgroup MMAs (sm_90a) and a block is whole warpgroups over one row of tiles (WR
// a multiple of 4, WN 1), the products run as `wgmma.mma_async` with the weights' A
// fragments in registers (the dequantizing below, unchanged) and x read by the tensor cores
// from the stage, instead of `mma.sync` with every warp loading every x fragment into
// registers (at 64 rows a block's warps read 8 × 16 KB of x from shared memory a step for
// 16 KB of weights). See WG in mlxcel_qgemm.
#ifndef MLXCEL_QGEMM_WGMMA
#define MLXCEL_QGEMM_WGMMA 0
#endif
// MLXCEL_QGEMM_XAHEAD 1 (default): with wgmma and a ring of 3 or more stages, step s + 1's x
// pass runs while step s's first wgmmas do (it was the step's critical path: on one H100
// about 20% of gate/up's stall samples at 64 rows), not between two barriers before them
#ifndef MLXCEL_QGEMM_XAHEAD
#define MLXCEL_QGEMM_XAHEAD 1
#endif
// MLXCEL_QGEMM_CARRY 1: with wgmma, up to 64 rows and a ring of 3 or more stages, a step's
// last wgmmas still run when the next step starts (its barrier, copies and first word's
// dequantizing), instead of every warpgroup waiting for them at the step's end; the ring is
// refilled one slot later (ST - 2 steps in flight, not ST - 1), since the slot of the step
// before may still be read by the tensor cores. 0 (default): every step's wgmmas finished
// within it. On one H100 (Nsight, 8B 4-bit at 32 and 64 rows, 4 stages) within 0.3 us of the
// same ring without it: the wait at a step's end is not what bounds the loop.
#ifndef MLXCEL_QGEMM_CARRY
#define MLXCEL_QGEMM_CARRY 0
#endif
// MLXCEL_QGEMM_SKIP (profiling only: the results are wrong; 0, the default, skips nothing): a
// bit mask of the loop's parts left out, so that kernel times with and without each show what
// bounds the loop. 1: the weights' and scales' copies; 2: x's (and the norm weight's) copies;
// 4: the x pass; 8: the wgmmas (their A fragments still computed; the wgmma flavour only); 16:
// the dequantizing and the scales' loads from shared memory (the A fragments are the loaded
// words); 32: x copied from step (s + column block) of the split instead of s, so that the
// blocks do not read the same lines of x at once.
#ifndef MLXCEL_QGEMM_SKIP
#define MLXCEL_QGEMM_SKIP 0
#endif
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLXCEL_HAS_WGMMA 1
#else
#define MLXCEL_HAS_WGMMA 0
#endif

// Pairs of T: 128 + v for 4 bits v in the mantissa (bf16 0x4300 | v; f16 1024 + v, 0x6400 | v),
// 1 and minus that offset; bf: whether T is bfloat16
template <typename T>
struct mlxcel_k16;
template <>
struct mlxcel_k16<__nv_bfloat16> {
  static constexpr bool bf = true;
  static constexpr uint32_t magic = 0x43004300u, one = 0x3F803F80u, neg = 0xC300C300u;
};
template <>
struct mlxcel_k16<__half> {
  static constexpr bool bf = false;
  static constexpr uint32_t magic = 0x64006400u, one = 0x3C003C00u, neg = 0xE400E400u;
};

// d = a·b + c on pairs of T (bf16x2 / f16x2), rounded once
template <typename T>
__device__ __forceinline__ uint32_t mlxcel_fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
#if defined(__CUDA_ARCH__)
  if constexpr (mlxcel_k16<T>::bf) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
#else
  d = mlxcel_emulated_fma2<T>(a, b, c);
#endif
  return d;
}
// two floats as a pair of T (lo in the low half), rounded to nearest even
template <typename T>
__device__ __forceinline__ uint32_t mlxcel_pack2(float lo, float hi) {
  uint32_t d;
#if defined(__CUDA_ARCH__)
  if constexpr (mlxcel_k16<T>::bf) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  }
#else
  d = mlxcel_emulated_pack2<T>(lo, hi);
#endif
  return d;
}
// c += A·B of one m16n8k16 MMA with T inputs and f32 accumulators (fragments as PTX lays them
// out: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9],
// b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1])
template <typename T>
__device__ __forceinline__ void mlxcel_mma16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
#define MLXCEL_MMA16(TY)                                                                                \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
      "{%0,%1,%2,%3};\n"                                                                               \
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                 \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
  if constexpr (mlxcel_k16<T>::bf) {
    MLXCEL_MMA16("bf16");
  } else {
    MLXCEL_MMA16("f16");
  }
#undef MLXCEL_MMA16
#else
  mlxcel_emulated_mma16<T>(c, a0, a1, a2, a3, b0, b1);
#endif
}

// ---- Hopper's warpgroup MMA (wgmma), B from shared memory, K-major, no swizzle ----
// The shared-memory address of p in a matrix descriptor: the shared window's on the device;
// in the CPU emulation the offset from `base` (where the emulated wgmma reads)
__device__ __forceinline__ uint32_t mlxcel_smem_addr(const void* p, const void* base) {
#if defined(__CUDA_ARCH__)
  (void)base;
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#else
  return uint32_t(static_cast<const char*>(p) - static_cast<const char*>(base));
#endif
}
// A matrix descriptor (PTX ISA, "Matrix Descriptor Format"): the start address, the leading
// byte offset (K-major without swizzle: from a core matrix, 8 rows of 16 bytes, to the next
// one along K) and the stride byte offset (to the next 8 rows), each in 16-byte units
__device__ __forceinline__ uint64_t mlxcel_wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo & 0x3FFFFu) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFFu) >> 4) << 32);
}
// wgmma.fence (the A fragments and accumulators written before the MMAs that read them),
// commit_group, wait_group<P> (at most P committed groups still running), and the proxy
// fence that makes a thread's shared-memory stores visible to the tensor cores' reads (the
// CPU emulation queues its wgmmas and runs them at the wait that retires their group; the
// fences are no-ops there)
__device__ __forceinline__ void mlxcel_wg_fence() {
#if defined(__CUDA_ARCH__) && MLXCEL_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mlxcel_wg_commit() {
#if defined(__CUDA_ARCH__) && MLXCEL_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#elif !defined(__CUDA_ARCH__)
  mlxcel_emulated_wg_commit();
#endif
}
template <int P>
__device__ __forceinline__ void mlxcel_wg_wait() {
#if defined(__CUDA_ARCH__) && MLXCEL_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(P) : "memory");
#elif !defined(__CUDA_ARCH__)
  mlxcel_emulated_wg_wait(P);
#endif
}
__device__ __forceinline__ void mlxcel_proxy_fence() {
#if defined(__CUDA_ARCH__) && MLXCEL_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// (the m64nNk16 forms for N = 8 … 128, f32 accumulators d[N/2], A in registers: scale-d 1
// (accumulate), A and B unscaled, B K-major)
#define MLXCEL_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define MLXCEL_D8(i) MLXCEL_D4(i), MLXCEL_D4(i + 4)
#define MLXCEL_D16(i) MLXCEL_D8(i), MLXCEL_D8(i + 8)
#define MLXCEL_D32(i) MLXCEL_D16(i), MLXCEL_D16(i + 16)
#define MLXCEL_D64(i) MLXCEL_D32(i), MLXCEL_D32(i + 32)
#define MLXCEL_WGMMA8(TY) asm volatile("{ .reg .pred p; setp.ne.b32 p, %9, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32." TY "." TY " {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0; }" : MLXCEL_D4(0) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1))
#define MLXCEL_WGMMA16(TY) asm volatile("{ .reg .pred p; setp.ne.b32 p, %13, 0; wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0; }" : MLXCEL_D8(0) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1))
#define MLXCEL_WGMMA32(TY) asm volatile("{ .reg .pred p; setp.ne.b32 p, %21, 0; wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0; }" : MLXCEL_D16(0) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1))
#define MLXCEL_WGMMA64(TY) asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0; }" : MLXCEL_D32(0) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1))
#define MLXCEL_WGMMA128(TY) asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0; }" : MLXCEL_D64(0) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1))
// d[NN/2] += A · B of one m64nNk16 wgmma: A (64 rows × 16 values) the warpgroup's fragments
// a0 … a3 (each warp's 16 rows laid out as mma.m16n8k16's A), B (16 × NN) at descriptor desc
template <typename T, int NN>
__device__ __forceinline__ void mlxcel_wgmma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc, const void* base) {
#if defined(__CUDA_ARCH__) && MLXCEL_HAS_WGMMA
  (void)base;
  static_assert(NN == 8 || NN == 16 || NN == 32 || NN == 64 || NN == 128, "wgmma: N of 8 … 128, powers of two");
#define MLXCEL_WGMMA_N(TY)         \
  if constexpr (NN == 8) {         \
    MLXCEL_WGMMA8(TY);             \
  } else if constexpr (NN == 16) { \
    MLXCEL_WGMMA16(TY);            \
  } else if constexpr (NN == 32) { \
    MLXCEL_WGMMA32(TY);            \
  } else if constexpr (NN == 64) { \
    MLXCEL_WGMMA64(TY);            \
  } else {                         \
    MLXCEL_WGMMA128(TY);           \
  }
  if constexpr (mlxcel_k16<T>::bf) {
    MLXCEL_WGMMA_N("bf16");
  } else {
    MLXCEL_WGMMA_N("f16");
  }
#undef MLXCEL_WGMMA_N
#elif !defined(__CUDA_ARCH__)
  mlxcel_emulated_wgmma<T>(d, NN, a0, a1, a2, a3, desc, base);
#else
  (void)d, (void)a0, (void)a1, (void)a2, (void)a3, (void)desc, (void)base;
#endif
}
// All MT columns of B (MT batch rows of x, groups of 8 rows SBO bytes apart from addr) in
// wgmmas of 128, 64, … 8 columns (MT's binary digits: 40 = 32 + 8), accumulators d[MT/2]
template <typename T, int MT, int N0 = 0>
__device__ __forceinline__ void mlxcel_wgmma_cols(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                  uint32_t addr, uint32_t lbo, uint32_t sbo, const void* base) {
  constexpr int R = MT - N0;
  if constexpr (R > 0) {
    constexpr int P = R >= 128 ? 128 : R >= 64 ? 64 : R >= 32 ? 32 : R >= 16 ? 16 : 8;
    mlxcel_wgmma<T, P>(d + N0 / 2, a0, a1, a2, a3, mlxcel_wg_desc(addr + (N0 / 8) * sbo, lbo, sbo), base);
    mlxcel_wgmma_cols<T, MT, N0 + P>(d, a0, a1, a2, a3, addr, lbo, sbo, base);
  }
}

// The four T pairs (v0,v4) (v1,v5) (v2,v6) (v3,v7) of the 8 weights of a 4-bit word, or of
// two 8-bit words (lo: v0 … v3, hi: v4 … v7), dequantized with the pair (s, s) and (b, b).
template <typename T, int BITS>
__device__ __forceinline__ void mlxcel_dequant8(uint32_t lo, uint32_t hi, uint32_t s2, uint32_t b2,
                                                uint32_t (&p)[4]) {
  if constexpr (BITS == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t v = ((lo >> (4 * j)) & 0x000F000Fu) | mlxcel_k16<T>::magic;
      p[j] = mlxcel_fma2<T>(mlxcel_fma2<T>(v, mlxcel_k16<T>::one, mlxcel_k16<T>::neg), s2, b2);
    }
    (void)hi;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // byte j of each word in a float 2^23 + v (bytes: v, 0, 0, 0x4B), less 2^23: exact
      const float a = __uint_as_float(__byte_perm(lo, 0x4B000000u, 0x7540 + j)) - 8388608.f;
      const float c = __uint_as_float(__byte_perm(hi, 0x4B000000u, 0x7540 + j)) - 8388608.f;
      p[j] = mlxcel_fma2<T>(mlxcel_pack2<T>(a, c), s2, b2);
    }
  }
}

// 16 bytes global → shared without a register (`cp.async`, cached in L2 only), or 16 zero
// bytes when !in (the source size 0: nothing is read); the copies a thread has issued since
// its last commit form one group (mlxcel_cp_commit), and mlxcel_cp_wait<P> waits until at
// most P of its groups are still in flight (both from the GEMV's header). Plain copies,
// done at once, before sm_80 and in the CPU emulation.
__device__ __forceinline__ void mlxcel_cp16z(uint4* dst, const void* src, bool in) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(in ? 16 : 0) : "memory");
#else
  if (in) {
    std::memcpy(dst, src, 16);
  } else {
    *dst = make_uint4(0u, 0u, 0u, 0u);
  }
#endif
}

// BYTES (4 or 8) bytes global → shared (`cp.async.ca`, the sizes below 16 it takes), or zeros
// when !in; src and dst aligned to BYTES. In the CPU emulation, plain copies.
template <int BYTES>
__device__ __forceinline__ void mlxcel_cp_small(void* dst, const void* src, bool in) {
  static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(src), "n"(BYTES), "r"(in ? BYTES : 0)
               : "memory");
#else
  if (in) {
    std::memcpy(dst, src, BYTES);
  } else {
    std::memset(dst, 0, BYTES);
  }
#endif
}

// p, as a value the compiler cannot compute earlier than here
template <class P>
__device__ __forceinline__ P* mlxcel_opaque(P* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("mov.b64 %0, %0;" : "+l"(p));
#endif
  return p;
}
// Split-K partial sums: *p += v in global memory (`red.global.add.v4.f32`, one 16-byte
// reduction in L2, from sm_90; four f32 ones before), and mlxcel_take4: the sum, read from L2,
// with zeros left in its place. In the CPU emulation plain adds and copies (it runs one block
// at a time, and a block's threads add to distinct addresses).
__device__ __forceinline__ void mlxcel_red_add4(float4* p, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
#elif defined(__CUDA_ARCH__)
  float* f = reinterpret_cast<float*>(p);
  atomicAdd(f, v.x), atomicAdd(f + 1, v.y), atomicAdd(f + 2, v.z), atomicAdd(f + 3, v.w);
#else
  p->x += v.x, p->y += v.y, p->z += v.z, p->w += v.w;
#endif
}
__device__ __forceinline__ float4 mlxcel_take4(float4* p) {
#if defined(__CUDA_ARCH__)
  const float4 v = __ldcg(p);
  __stcg(p, make_float4(0.f, 0.f, 0.f, 0.f));
#else
  const float4 v = *p;
  *p = make_float4(0.f, 0.f, 0.f, 0.f);
#endif
  return v;
}

// rows of x: the product of x's first `ndim` dimensions over K. (MLX pads the shape it
// passes to MAX_NDIM entries without setting the rest, so they hold whatever was in that
// memory: reading past `ndim` made M garbage, and whole calls wrote nothing.)
template <int K, typename S>
__device__ __forceinline__ int mlxcel_qgemm_rows(const S& shape, const int ndim) {
  long long n = 1;
  for (int i = 0; i < ndim; ++i) {
    n *= shape[i];
  }
  return int(n / K);
}

template <typename T, int MT, int N, int K, int G, int BITS, int WR, int WN, int SK, int ST, int EPI,
          int NORM, int EPS_BITS, int HD, int NQ, int BIAS>
__device__ __forceinline__ void mlxcel_qgemm(const T* x, const uint32_t* w, const T* scales, const T* biases,
                                             const T* res, const T* nw, const float* part_in,
                                             const int32_t* count_in, const int M, const int32_t* pos,
                                             const float* inv_freq, T* y, T* y2) {
  static_assert(BITS == 4 || BITS == 8, "qgemm: 4 or 8 bits");
  static_assert((G == 32 || G == 64 || G == 128) && K % 128 == 0 && K % G == 0,
                "qgemm: groups of 32, 64 or 128 values, K a multiple of 128");
  static_assert(MT % 8 == 0 && MT >= 8 && MT <= 128, "qgemm: 8 to 128 batch rows in tiles of 8");
  static_assert((MT / 8) % WN == 0, "qgemm: the n-tiles split evenly over WN warps");
  static_assert((K / 128) % SK == 0 && ST >= 1, "qgemm: SK divides the steps of a row");
  static_assert(EPI < 2 || N % 2 == 0, "qgemm: SwiGLU and RoPE need pairs of rows");
  static_assert(EPI != 3 || (HD % 2 == 0 && N % HD == 0 && N / HD > NQ && (N / HD - NQ) % 2 == 0),
                "qgemm: RoPE needs N = (NQ + 2 NKV) HD");
  constexpr int NT = MT / 8;                     // n-tiles (8 batch rows each)
  constexpr int NTW = NT / WN;                   // n-tiles per warp
  constexpr int TPB = 32 * WR * WN;              // threads per block
  constexpr int BN = 32 * WR;                    // weight rows per block
  constexpr int NS = K / 128 / SK;               // steps of 128 values per split
  constexpr int KW = K * BITS / 32;              // words per weight row
  constexpr int GPR = K / G;                     // groups per row
  constexpr int LQ = BITS / 4;                   // 16-byte chunks per lane, row and step
  constexpr int XR = (MT * 16 + TPB - 1) / TPB;  // 16-byte chunks of x a thread prepares (prepare_x)
  constexpr int W16 = BN * BITS;                 // a stage's 16-byte chunks: weights,
  constexpr int X16 = MT * 16;                   // x,
  constexpr int SB16 = BN;                       // the norm weight, then a chunk a row: the
  constexpr int STAGE16 = W16 + X16 + 16 + SB16;  // step's scales, biases (stage_bytes in Rust)
  constexpr int SPS = 128 / G;  // a row's scales per step
  // Scale blocks (blocks of 256 weight rows, MLXCEL_QGEMM_SBLOCK): the scales and biases of
  // SB steps (16 groups, 32 bytes a row and kind) copied at once in pieces of CU bytes into
  // two slots after the ring, so that a row's copies take one or two 32-byte sectors (two
  // where the split's groups do not start on 32 bytes). Copied a step at a time, a row's 2-8
  // bytes took an L2 sector each: at 64 rows a third of the sectors a block read (the
  // weights' 16 KB and x's 16 KB took as many). The pieces must
  // align (rows and the split's first group); a slot is refilled ST - 1 steps before its
  // next block starts, so SB ≥ ST - 1 (otherwise the per-step copies below). (The scales'
  // and biases' arrays start on 16 bytes, as MLX allocates them.) On one H100 (Nsight, 8B,
  // 4-bit): gate/up 63.5 → 57.4 µs at 32 rows, 93.9 → 85.7 at 64; 8-bit gate/up at 32 rows
  // 73.5 → 61.0; q/k/v -4%; o and down within 3%.
  constexpr int SB = 16 / SPS;
  constexpr int CU = (GPR * 2 % 16 == 0 && NS * SPS * 2 % 16 == 0)  ? 16
                     : (GPR * 2 % 8 == 0 && NS * SPS * 2 % 8 == 0) ? 8
                     : (GPR * 2 % 4 == 0 && NS * SPS * 2 % 4 == 0) ? 4
                                                                     : 0;
  constexpr bool SBK = MLXCEL_QGEMM_SBLOCK && BN >= 256;  // the launch's buffer (Rust: scale_block_bytes)
  constexpr bool SBLK = SBK && CU > 0 && SB >= ST - 1;
  // otherwise the scales come through the ring for groups of 32 and 64 (a step's 4 or 2 per
  // row, 8 or 4 bytes, copies cp.async takes); groups of 128 (one per row and step, 2
  // bytes) are loaded into registers a step ahead
  constexpr bool SSM = !SBLK && G <= 64;
  constexpr bool SREG = !SBLK && !SSM;
  constexpr int HALF = N / 2;
  constexpr int HD2 = HD > 0 ? HD / 2 : 1;
  constexpr int CB = (N + BN - 1) / BN;          // column blocks
  // Warpgroup MMAs (MLXCEL_QGEMM_WGMMA): the block's warps in groups of 4 (warp wr's tile i
  // is rows 16·(wr % 4) … of the group's 64-row A of tile i), all MT batch rows in one wgmma
  // (or one per binary digit of MT). x lands in the stage as B's core matrices: row m's 16
  // chunks of 8 values at (m / 8 · 16 + q) · 128 + (m % 8) · 16 bytes, chunk q = 4c + t
  // holding word 4t + c (values 32t + 8c …); a pass over each landed stage (the norm's, or
  // one of its own) turns the 4 chunks of c into 4c + j = the pairs j (x_j, x_j+4) of words
  // t = 0 … 3, in t's order: the 16 values k of a wgmma (word c, pairs 2h, 2h + 1) as the A
  // fragments hold them (logical k 2t, 2t + 1 = pair 2h of lane t's word c; 2t + 8, 2t + 9 =
  // pair 2h + 1), in two core matrices 128 bytes apart (LBO), groups of 8 rows 2 KB apart (SBO).
  constexpr bool WG = MLXCEL_QGEMM_WGMMA && MLXCEL_HAS_WGMMA && WN == 1 && WR % 4 == 0;
  // (WG) that layout: chunk q of row m, in chunks from the stage's x, and its byte offsets
  // from chunk q to q + 1 (LBO) and from row m to m + 8 (SBO)
  auto wg_x = [](int m, int q) { return ((m >> 3) * 16 + q) * 8 + (m & 7); };
  constexpr uint32_t WG_LBO = 8 * 16, WG_SBO = 16 * WG_LBO;
  // (WG) a step's last wgmmas carried into the next step (MLXCEL_QGEMM_CARRY; two A sets, up to
  // 64 rows): AH steps of copies in flight, ST - 1 without it
  constexpr bool CARRY = WG && MLXCEL_QGEMM_CARRY && ST >= 3 && MT <= 64;
  constexpr int AH = CARRY ? ST - 2 : ST - 1;
  // (WG) the x pass a step ahead, during the wgmmas (MLXCEL_QGEMM_XAHEAD): step s + 1's slot is
  // neither the one step s reads nor the one refilled during step s (s + AH) only from AH = 2
  // (3 stages; 4 with CARRY, where step s - 1's slot may still be read during the pass)
  constexpr bool XAHEAD = WG && MLXCEL_QGEMM_XAHEAD && AH >= 2;
  static_assert(TPB % 16 == 0, "qgemm: a normalizing thread keeps its row of x");
  static_assert(ST >= 2 && ST <= 8, "qgemm: 2 to 8 stages in the ring");
  constexpr int SBUF16 = SBK ? 8 * BN : 0;  // the scale blocks' two slots: 2 kinds × BN rows × 32 bytes each
#if defined(__CUDA_ARCH__)
  extern __shared__ uint4 mlxcel_qgemm_smem[];  // ST × STAGE16 + SBUF16 chunks (the launch's dynamic size)
  uint4* ring = mlxcel_qgemm_smem;
#else
  static uint4 mlxcel_qgemm_smem[ST * STAGE16 + SBUF16];
  uint4* ring = mlxcel_qgemm_smem;
#endif
  uint4* sbuf = ring + ST * STAGE16;
  __shared__ float ss_sm[MT];
  __shared__ int last_sm;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wr = warp % WR;
  const int wn = warp / WR;
  const int gq = lane >> 2;
  const int t = lane & 3;
  const int cb = int(blockIdx.x) / SK;
  const int split = int(blockIdx.x) % SK;

  // weight row of row r of tile i of this warp, -1 past the end; with EPI 2 and 3 the pair
  // index p = cb·BN/2 + wr·16 + r names the first tile's row and the second's
  auto row_of_slot = [&](int wr_, int i, int r) -> int {
    if constexpr (EPI == 2 || EPI == 3) {
      const int p = cb * (BN / 2) + wr_ * 16 + r;
      if (p >= HALF) {
        return -1;
      }
      if constexpr (EPI == 2) {
        return i == 0 ? p : HALF + p;
      } else {
        return (p / HD2) * HD + p % HD2 + (i ? HD2 : 0);
      }
    } else {
      const int n = cb * BN + wr_ * 32 + i * 16 + r;
      return n < N ? n : -1;
    }
  };
  auto row_of = [&](int i, int r) { return row_of_slot(wr, i, r); };
  // the weight row of ring slot r (r = wr·32 + i·16 + h·8 + gq, as the stage lays them out)
  auto ring_row = [&](int r) { return row_of_slot(r / 32, (r / 16) % 2, r % 8 + 8 * ((r / 8) % 2)); };
  int rows[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rows[i][h] = row_of(i, gq + 8 * h);
    }
  }

  // ---- the ring: ST stages of (weights, x, norm weight) in shared memory, cp.async ----
  // Stage s of the block's split holds, for its 128 values k0 … k0+127:
  //   w:  BN rows × BITS 16-byte chunks (row slot r = wr·32 + i·16 + h·8 + gq of warp wr's
  //       tile i, the global row rows[i][h]; zeros past N); 8-bit chunk q of row r sits at
  //       q ^ (r & 1), so that a warp's fragment loads hit distinct banks
  //   x:  MT rows × 16 chunks of 8 values (zeros past M); word 4t + c of row m sits at
  //       slot (4c + t) ^ 4·(m & 1), the lanes (gq, t) of a fragment load in distinct banks
  //   nw: 16 chunks of the norm weight (NORM)
  //   sb: BN chunks, row slot r's scales of the step at bytes 0 …, its biases at 8 … (SSM)
  // A thread copies the same chunks of every stage: chunk tid + j·TPB of the weights (j <
  // WJ) and of x (j < XJ), the norm weight's chunk tid (tid < 16). Where they come from is
  // worked out once, here (per step it was most of the kernel's instructions).
  static_assert(W16 % TPB == 0 && TPB % 32 == 0, "qgemm: whole weight chunks per thread");
  constexpr int WJ = W16 / TPB;
  constexpr int XJ = (X16 + TPB - 1) / TPB;
  int woff[WJ];  // the chunk's first word in w at step 0, -1 past N
#pragma unroll
  for (int j = 0; j < WJ; ++j) {
    const int c = tid + j * TPB;
    const int r = c / BITS, q = c % BITS;
    const int row = ring_row(r);
    woff[j] = row >= 0 ? row * KW + q * 4 : -1;
  }
  const int xw = tid % 16;                                 // the thread's word of an x row,
  const int xm0 = tid / 16;                                // its first row (then + j·TPB/16,
  const int xslot = WG ? 4 * (xw % 4) + xw / 4                 // of the same parity) and slot
                       : (4 * (xw % 4) + xw / 4) ^ (4 * (xm0 & 1));
  // the lane's scale and bias of its rows' group, per step, as loaded (16 bits in 32): one
  // step ahead, two sets by the step's parity, paired only where compute uses them (paired
  // as they landed, every lane waited for the loads a step early: Nsight's warp samples on
  // an H100 put 10-13% of the GEMM's stalls there); srow: the rows' first group, -1 past N
  uint32_t sc[2][2][2] = {}, bi[2][2][2] = {};
  int srow[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      srow[i][h] = rows[i][h] >= 0 ? rows[i][h] * GPR : -1;
    }
  }
  // the scale copies this thread makes (SSM): chunk c = tid + j·TPB < 2·BN is row slot c % BN's
  // scales (c < BN) or biases; sgoff: that row's first group, -1 past N
  constexpr int SJ = SSM ? (2 * BN + TPB - 1) / TPB : 1;
  int sgoff[SJ];
#pragma unroll
  for (int j = 0; j < SJ; ++j) {
    const int c = tid + j * TPB, r = c % BN;
    const int row = ring_row(r);
    sgoff[j] = (SSM && c < 2 * BN && row >= 0) ? row * GPR : -1;
  }
  const unsigned short* s16 = reinterpret_cast<const unsigned short*>(scales);
  const unsigned short* b16 = reinterpret_cast<const unsigned short*>(biases);
  // the block's copies of scale block u (steps u·SB …) into slot u % 2: piece c = tid +
  // j·TPB of 2·BN·PR is piece c % PR of row slot (c / PR) % BN's scales (c < BN·PR) or
  // biases; pieces past N or past the split's steps are zeros (not read). (Their sources
  // are worked out at each copy, once per SB steps: held in registers they would take 16 at
  // 70B TP8 down's 4-byte pieces, 16 a thread; the arrays' addresses are made opaque at each
  // copy, or the compiler worked the sources out before the loop all the same, and 8-bit
  // launches of 64 rows spilled them.)
  constexpr int PR = CU > 0 ? 32 / CU : 1;  // pieces a row and kind
  constexpr int PJ = SBLK ? (2 * BN * PR + TPB - 1) / TPB : 1;
  auto copy_scales = [&](int u) {
    char* slot = reinterpret_cast<char*>(sbuf + (u % 2) * 4 * BN);
    const T* const scales_u = mlxcel_opaque(scales);
    const T* const biases_u = mlxcel_opaque(biases);
#pragma unroll
    for (int j = 0; j < PJ; ++j) {
      const int c = tid + j * TPB;
      if (PJ * TPB == 2 * BN * PR || c < 2 * BN * PR) {
        const int b = c / (BN * PR), at = u * SB * SPS + (c % PR) * (CU / 2);
        const int row = ring_row((c / PR) % BN);
        const bool in = row >= 0 && at < NS * SPS;
        const T* src = (b ? biases_u : scales_u) + (in ? size_t(row) * GPR + split * NS * SPS + at : 0);
        char* dst = slot + CU * c;  // = kind b, row slot, piece: 32 bytes a row and kind
        if constexpr (CU == 16) {
          mlxcel_cp16z(reinterpret_cast<uint4*>(dst), src, in);
        } else {
          mlxcel_cp_small<CU == 0 ? 4 : CU>(dst, src, in);
        }
      }
    }
  };
  // the block's copies of step s (< NS) into ring slot `slot` (and of its scale block)
  auto copy = [&](int s, int slot) {
    if (s >= NS) {
      return;
    }
    if constexpr (SBLK && !(MLXCEL_QGEMM_SKIP & 1)) {
      if (s % SB == 0) {
        copy_scales(s / SB);
      }
    }
    const int step = split * NS + s;
    const int k0 = step * 128;
    uint4* st = ring + slot * STAGE16;
    const uint32_t* ws = w + size_t(step) * 4 * BITS;
#pragma unroll
    for (int j = 0; j < (MLXCEL_QGEMM_SKIP & 1 ? 0 : WJ); ++j) {
      const int c = tid + j * TPB;
      const int r = c / BITS, q = c % BITS;
      mlxcel_cp16z(st + r * BITS + (BITS == 8 ? (q ^ (r & 1)) : q), ws + (woff[j] >= 0 ? woff[j] : 0),
                   woff[j] >= 0);
    }
#pragma unroll
    for (int j = 0; j < (MLXCEL_QGEMM_SKIP & 2 ? 0 : XJ); ++j) {
      const int m = xm0 + j * (TPB / 16);
      if (X16 % TPB == 0 || m < MT) {
        const int xk0 = MLXCEL_QGEMM_SKIP & 32 ? (split * NS + (s + cb) % NS) * 128 : k0;
        mlxcel_cp16z(st + W16 + (WG ? wg_x(m, xslot) : m * 16 + xslot),
                     x + size_t(m < M ? m : 0) * K + xk0 + 8 * xw, m < M);
      }
    }
    if (NORM && !(MLXCEL_QGEMM_SKIP & 2) && tid < 16) {
      mlxcel_cp16z(st + W16 + X16 + tid, nw + k0 + 8 * tid, true);
    }
    if constexpr (SSM && !(MLXCEL_QGEMM_SKIP & 1)) {
      // chunk r of the scale area: row slot r's scales (bytes 0 …) and biases (bytes 8 …)
#pragma unroll
      for (int j = 0; j < SJ; ++j) {
        const int c = tid + j * TPB;
        if (SJ * TPB == 2 * BN || c < 2 * BN) {
          const int r = c % BN, b = c / BN;
          const T* src = (b ? biases : scales) + (sgoff[j] >= 0 ? sgoff[j] + step * SPS : 0);
          mlxcel_cp_small<2 * SPS>(reinterpret_cast<char*>(st + W16 + X16 + 16 + r) + 8 * b, src, sgoff[j] >= 0);
        }
      }
    }
  };
  auto scales_of = [&](int s, uint32_t (&so)[2][2], uint32_t (&bo)[2][2]) {
    const int gi = ((split * NS + s) * 128 + 32 * t) / G;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int si = srow[i][h] >= 0 ? srow[i][h] + gi : 0;
        so[i][h] = srow[i][h] >= 0 ? uint32_t(s16[si]) : 0u;
        bo[i][h] = srow[i][h] >= 0 ? uint32_t(b16[si]) : 0u;
      }
    }
  };
  float ssr[XR];  // NORM: Σ x² of this thread's part of its rows
#pragma unroll
  for (int j = 0; j < XR; ++j) {
    ssr[j] = 0.f;
  }
  // The stage's x in place, each word stored as the pairs (x0,x4) (x1,x5) (x2,x6) (x3,x7)
  // the MMAs take: with NORM times the norm weight (Σ x² on the way), without it
  // (MLXCEL_QGEMM_XPAIR) as it is; otherwise the fragment loads pair them
  constexpr bool PAIRED = NORM || MLXCEL_QGEMM_XPAIR || WG;
  // (WG) items (m, c) of x: row m's words 4t + c, t = 0 … 3, into the pairs j of 4c + j
  constexpr int XI = WG ? (MT * 4 + TPB - 1) / TPB : 1;
  float ssw[XI];  // NORM: Σ x² of the thread's items
#pragma unroll
  for (int j = 0; j < XI; ++j) {
    ssw[j] = 0.f;
  }
  auto prepare_x = [&](int slot) {
    uint4* st = ring + slot * STAGE16;
    if constexpr ((MLXCEL_QGEMM_SKIP & 4) != 0) {
      (void)st;
      return;
    }
    if constexpr (WG) {
#pragma unroll
      for (int j = 0; j < XI; ++j) {
        const int item = tid + j * TPB;
        if (MT * 4 % TPB == 0 || item < MT * 4) {
          const int m = item % MT, c = item / MT;
          uint4* q0 = st + W16 + wg_x(m, 4 * c);  // chunk 4c + t at q0 + t·LBO
          uint32_t pr[4][4];                                            // pair, word t
#pragma unroll
          for (int t4 = 0; t4 < 4; ++t4) {
            const uint4 v = q0[t4 * WG_LBO / 16];
            if constexpr (NORM) {
              float f[8], g8[8];
              mlxcel_h8<T>(v, f);
              mlxcel_h8<T>(st[W16 + X16 + 4 * t4 + c], g8);
#pragma unroll
              for (int e = 0; e < 8; ++e) {
                ssw[j] = fmaf(f[e], f[e], ssw[j]);
                f[e] *= g8[e];
              }
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                pr[e][t4] = mlxcel_pack2<T>(f[e], f[e + 4]);
              }
            } else {
              pr[0][t4] = __byte_perm(v.x, v.z, 0x5410);
              pr[1][t4] = __byte_perm(v.x, v.z, 0x7632);
              pr[2][t4] = __byte_perm(v.y, v.w, 0x5410);
              pr[3][t4] = __byte_perm(v.y, v.w, 0x7632);
            }
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            q0[e * WG_LBO / 16] = make_uint4(pr[e][0], pr[e][1], pr[e][2], pr[e][3]);
          }
        }
      }
      mlxcel_proxy_fence();  // (the stores, before the tensor cores read them; a barrier follows)
      return;
    }
#pragma unroll
    for (int j = 0; j < XR; ++j) {
      const int xc = tid + j * TPB;
      if (MT * 16 % TPB == 0 || xc < MT * 16) {
        if constexpr (NORM) {
          const int m = xc / 16, p = (xc % 16) ^ (4 * (m & 1));
          const int wd = 4 * (p % 4) + p / 4;  // the word slot p holds
          float f[8], g8[8];
          mlxcel_h8<T>(st[W16 + xc], f);
          mlxcel_h8<T>(st[W16 + X16 + wd], g8);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            ssr[j] = fmaf(f[e], f[e], ssr[j]);
            f[e] *= g8[e];
          }
          st[W16 + xc] = make_uint4(mlxcel_pack2<T>(f[0], f[4]), mlxcel_pack2<T>(f[1], f[5]),
                                    mlxcel_pack2<T>(f[2], f[6]), mlxcel_pack2<T>(f[3], f[7]));
        } else {
          const uint4 v = st[W16 + xc];
          st[W16 + xc] = make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                                    __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
        }
      }
    }
  };

  // ---- the product ----
  float acc[2][NTW][4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < NTW; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[i][j][c] = 0.f;
      }
    }
  }
  // (XAHEAD: `ahead`, the slot whose x to pass during the first wgmmas, -1 for none)
  auto compute = [&](int s, int slot, const uint32_t (&scs)[2][2], const uint32_t (&bis)[2][2], int ahead) {
    const uint4* st = ring + slot * STAGE16;
    uint32_t s2[2][2], b2[2][2];
    const unsigned short* ssb = reinterpret_cast<const unsigned short*>(st + W16 + X16 + 16);
    // (SBLK) step s's scales in its block's slot: 16 halves a row and kind
    const unsigned short* sbh = reinterpret_cast<const unsigned short*>(sbuf + ((s / SB) % 2) * 4 * BN) +
                                (s % SB) * SPS;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t sv = scs[i][h], bv = bis[i][h];
        if constexpr (SBLK) {
          const int r = wr * 32 + i * 16 + h * 8 + gq, g = 32 * t / G;
          sv = sbh[16 * r + g];
          bv = sbh[16 * (BN + r) + g];
        } else if constexpr (SSM) {
          const int r = wr * 32 + i * 16 + h * 8 + gq, g = 32 * t / G;
          sv = ssb[8 * r + g];
          bv = ssb[8 * r + 4 + g];
        }
        s2[i][h] = sv * 0x10001u;  // (s, s)
        b2[i][h] = bv * 0x10001u;
      }
    }
    // the lane's 16-byte chunk q of its rows (gq, gq + 8) of both tiles: 4-bit, the whole
    // step's 32 values (chunk t); 8-bit, half of them (chunk 2t + l), loaded per half (both
    // halves at once took 16 more registers, and spilled at 128 rows)
    uint4 wq[2][2];  // tile, row
    // where that chunk lies in the stage
    auto w_chunk = [&](int i, int h, int l) {
      const int r = wr * 32 + i * 16 + h * 8 + gq;
      const int q = LQ * t + l;
      return st + r * BITS + (BITS == 8 ? (q ^ (r & 1)) : q);
    };
    auto load_w = [&](int l) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wq[i][h] = *w_chunk(i, h, l);
        }
      }
    };
    if constexpr (BITS == 4) {
      load_w(0);
    }
    // word c's A fragments (tile, row, pair), from the chunks loaded into wq, or with
    // from_stage read from the stage word by word (the pipelined loop above 32 rows: the
    // step's chunks held in registers left too few for the second A set). Word c is word k
    // of its chunk at 4 bits, words k, k + 1 of chunk c / 2 at 8.
    auto dequant = [&](int c, uint32_t (&a)[2][2][4], bool from_stage) {
      const int k = BITS == 4 ? c : (c % 2) * 2;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t lo, hi = 0u;
          if (from_stage) {
            const uint32_t* p = reinterpret_cast<const uint32_t*>(w_chunk(i, h, BITS == 8 ? c / 2 : 0));
            lo = p[k];
            if constexpr (BITS == 8) {
              hi = p[k + 1];
            }
          } else {
            const uint4 u = wq[i][h];
            lo = k == 0 ? u.x : k == 1 ? u.y : k == 2 ? u.z : u.w;
            if constexpr (BITS == 8) {
              hi = k == 0 ? u.y : u.w;
            }
          }
          if constexpr ((MLXCEL_QGEMM_SKIP & 16) != 0) {
            a[i][h][0] = a[i][h][1] = a[i][h][2] = a[i][h][3] = lo ^ hi;
          } else {
            mlxcel_dequant8<T, BITS>(lo, hi, s2[i][h], b2[i][h], a[i][h]);
          }
        }
      }
    };
    // word c's x fragment of the warp's n-tile j
    auto x_frag = [&](int c, int j) {
      const int m = 8 * (wn * NTW + j) + gq;
      return st[W16 + m * 16 + ((4 * c + t) ^ (4 * (m & 1)))];
    };
    // the four MMAs of a word's A fragments with n-tile j's x fragment v
    auto multiply = [&](const uint32_t (&a)[2][2][4], const uint4 v, int j) {
      // (x0,x1) (x2,x3) (x4,x5) (x6,x7) → (x0,x4) (x1,x5) (x2,x6) (x3,x7), the weights'
      // order (the norm's or the pair pass stored them so)
      uint32_t b0 = v.x, b1 = v.y, b2_ = v.z, b3 = v.w;
      if constexpr (!PAIRED) {
        b0 = __byte_perm(v.x, v.z, 0x5410), b1 = __byte_perm(v.x, v.z, 0x7632);
        b2_ = __byte_perm(v.y, v.w, 0x5410), b3 = __byte_perm(v.y, v.w, 0x7632);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mlxcel_mma16<T>(acc[i][j], a[i][0][0], a[i][1][0], a[i][0][1], a[i][1][1], b0, b1);
        mlxcel_mma16<T>(acc[i][j], a[i][0][2], a[i][1][2], a[i][0][3], a[i][1][3], b2_, b3);
      }
    };
    if constexpr (WG) {
      // word c's four wgmmas (tiles 0, 1; pairs 0-1, 2-3) run while word c + 1 dequantizes
      // into the other A set, once the wgmmas that read that set (word c - 1's) are done;
      // above 64 rows one set, word c + 1 dequantized after word c's wgmmas (even so the
      // accumulators' 128 registers spill at 128 rows, ptxas for sm_90a: mlxcel's launches
      // take this path up to 64 rows, qgemm::WGMMA_MAX_M)
      constexpr int AS = MT > 64 ? 1 : 2;
      const uint32_t xa = mlxcel_smem_addr(st + W16, ring);
      uint32_t a[AS][2][2][4];  // set, tile, row, pair
      if constexpr (BITS == 8) {
        load_w(0);
      }
      dequant(0, a[0], false);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        mlxcel_wg_fence();
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const uint32_t(&f)[2][4] = a[c % AS][i];
            if constexpr ((MLXCEL_QGEMM_SKIP & 8) != 0) {
#if defined(__CUDA_ARCH__)
              asm volatile("" ::"r"(f[0][2 * h2]), "r"(f[1][2 * h2]), "r"(f[0][2 * h2 + 1]), "r"(f[1][2 * h2 + 1]));
#endif
              continue;
            }
            mlxcel_wgmma_cols<T, MT>(&acc[i][0][0], f[0][2 * h2], f[1][2 * h2], f[0][2 * h2 + 1], f[1][2 * h2 + 1],
                                     xa + (4 * c + 2 * h2) * WG_LBO, WG_LBO, WG_SBO, ring);
          }
        }
        mlxcel_wg_commit();
        if (XAHEAD && c == 0 && ahead >= 0) {
          prepare_x(ahead);  // (fenced for the tensor cores; the next step's barrier orders it)
        }
        if (c + 1 < 4) {
          if (BITS == 8 && c == 1) {
            load_w(1);
          }
          mlxcel_wg_wait<AS - 1>();
          dequant(c + 1, a[(c + 1) % AS], false);
        }
      }
      // (the slot is refilled after the next barrier; with CARRY after the one after, word
      // 3's wgmmas finished during the next step's first wait)
      mlxcel_wg_wait<CARRY ? 1 : 0>();
      return;
    }
    // (above 32 rows only without the norm, whose Σ x² registers tipped it into spilling)
    if constexpr (MT <= MLXCEL_QGEMM_PIPE && (MT <= 32 || !NORM) && !MLXCEL_QGEMM_BOUNDED) {
      // word c + 1 dequantized between word c's x loads and its MMAs, into the other set
      uint32_t a0[2][2][4], a1[2][2][4];
      constexpr bool WS = MT > 32;  // weights read from the stage word by word
      if constexpr (BITS == 8 && !WS) {
        load_w(0);
      }
      dequant(0, a0, WS);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint4 xv[NTW];
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          xv[j] = x_frag(c, j);
        }
        if (c + 1 < 4) {
          if (BITS == 8 && !WS && c == 1) {
            load_w(1);
          }
          dequant(c + 1, (c & 1) ? a0 : a1, WS);
        }
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          multiply((c & 1) ? a1 : a0, xv[j], j);
        }
      }
      return;
    }
    // (one word at a time by default: unrolled, the compiler dequantized every word up
    // front, which took 64 more registers and spilled at 8 bits)
    constexpr int UNR = (BITS == 4 && MT <= 32) ? MLXCEL_QGEMM_CUNROLL : 1;
    constexpr bool XH = MLXCEL_QGEMM_XHOIST != 0;
#pragma unroll UNR
    for (int c = 0; c < 4; ++c) {
      if constexpr (BITS == 8) {
        if (c % 2 == 0) {
          load_w(c / 2);
        }
      }
      // the word's x fragments first (MLXCEL_QGEMM_XHOIST), so that their shared-memory
      // loads land while the weights dequantize: loaded beside their MMAs, the byte
      // permutes or MMAs waited on them (Nsight's warp samples, H100, 8B down at 64 rows)
      uint4 xv[XH ? NTW : 1];
      if constexpr (XH) {
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          xv[j] = x_frag(c, j);
        }
      }
      uint32_t a[2][2][4];  // tile, row, pair
      dequant(c, a, false);
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        multiply(a, XH ? xv[XH ? j : 0] : x_frag(c, j), j);
      }
    }
  };

  // the first AH steps in flight, one copy group each (empty past NS: the counts stay
  // uniform), and the first step's scales
#pragma unroll
  for (int u = 0; u < AH; ++u) {
    copy(u, u);
    mlxcel_cp_commit();
  }
  if constexpr (SREG) {
    scales_of(0, sc[0], bi[0]);
  }
  if constexpr (XAHEAD) {  // step 0's x pass (the loop's does step s + 1's)
    mlxcel_cp_wait<AH - 1>();
    __syncthreads();
    prepare_x(0);
  }
  // two steps an iteration, so that the scale sets are named at compile time (unrolled
  // over all ST slots, the kernel's code outgrew the instruction cache)
  for (int s0 = 0; s0 < NS; s0 += 2) {
#pragma unroll
    for (int par = 0; par < 2; ++par) {
      const int s = s0 + par;
      if (s < NS) {  // (uniform over the block)
        // this thread's copies of step s (XAHEAD: and s + 1) have landed …
        mlxcel_cp_wait<XAHEAD ? AH - 2 : AH - 1>();
        __syncthreads();                // … everyone's, and step s - 1's reads are done
        copy(s + AH, (s + AH) % ST);    // into the slot step s - 1 used (CARRY: s - 2)
        mlxcel_cp_commit();
        if (SREG && s + 1 < NS) {
          scales_of(s + 1, sc[par ^ 1], bi[par ^ 1]);
        }
        const int slot = s % ST;
        if constexpr (PAIRED && !XAHEAD) {
          prepare_x(slot);
          __syncthreads();
        }
        compute(s, slot, sc[par], bi[par], XAHEAD && s + 1 < NS ? (s + 1) % ST : -1);
      }
    }
  }
  mlxcel_cp_wait<0>();  // (no copy left in flight when the block exits)
  if constexpr (CARRY) {
    mlxcel_wg_wait<0>();  // (the last step's wgmmas, before the accumulators are read)
  }
  // ---- Σ x² of each row (NORM), the split-K reduction ----
  if constexpr (NORM && WG) {
    // row m's items are c = 0 … 3 at item m + c·MT
    __shared__ float ss4_sm[WG ? 4 * MT : 1];
#pragma unroll
    for (int j = 0; j < XI; ++j) {
      const int item = tid + j * TPB;
      if (MT * 4 % TPB == 0 || item < MT * 4) {
        ss4_sm[item] = ssw[j];
      }
    }
    __syncthreads();
    for (int m = tid; m < MT; m += TPB) {
      ss_sm[m] = ss4_sm[m] + ss4_sm[MT + m] + ss4_sm[2 * MT + m] + ss4_sm[3 * MT + m];
    }
  } else if constexpr (NORM) {
#pragma unroll
    for (int j = 0; j < XR; ++j) {
      float v = ssr[j];
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) {  // the 16 threads of a row are adjacent lanes
        v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
      }
      const int i = tid + j * TPB;
      if (tid % 16 == 0 && (MT * 16 % TPB == 0 || i < MT * 16)) {
        ss_sm[i / 16] = v;
      }
    }
  }
  if constexpr (SK > 1) {
    // The column block's tile, summed over its splits in place: each block adds its partial
    // tile (in its threads' register order) into it in L2, and the block that brings the
    // count to SK reads the sum back, writing zeros as it goes. Every launch leaves the
    // scratch as it found it, zeros (so launches of other shapes may share it); with NORM
    // each block's Σ x² per row lands after the tiles and is zeroed likewise. (Before, each
    // block wrote a tile of its own and the last one read the other SK - 1 back, 4 bytes a
    // load: on one H100 the sum in place took 8B down at 64 rows, 8 splits, from 52.5 to
    // 45.0 µs, o from 29.2 to 22.4.)
    constexpr int NV = 2 * NTW;  // float4s per thread
    float* part = const_cast<float*>(part_in);
    float4* tile = reinterpret_cast<float4*>(part) + size_t(cb) * NV * TPB;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        mlxcel_red_add4(tile + (i * NTW + j) * TPB + tid,
                        make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]));
      }
    }
    float* ssp = part + size_t(CB) * NV * TPB * 4;  // after every column block's tile
    if constexpr (NORM) {
      __syncthreads();  // ss_sm written
      for (int m = tid; m < MT; m += TPB) {
        ssp[(size_t(cb) * SK + split) * MT + m] = ss_sm[m];
      }
    }
    __threadfence();
    __syncthreads();
    int32_t* count = const_cast<int32_t*>(count_in) + cb;
    if (tid == 0) {
      last_sm = atomicAdd(count, 1) == SK - 1;
    }
    __syncthreads();
    if (!last_sm) {
      return;
    }
    __threadfence();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        const float4 v = mlxcel_take4(tile + (i * NTW + j) * TPB + tid);
        acc[i][j][0] = v.x, acc[i][j][1] = v.y, acc[i][j][2] = v.z, acc[i][j][3] = v.w;
      }
    }
    if constexpr (NORM) {
      for (int m = tid; m < MT; m += TPB) {
        float v = 0.f;
        for (int o = 0; o < SK; ++o) {
          float* at = ssp + (size_t(cb) * SK + o) * MT + m;
          v += __ldcg(at);
          *at = 0.f;
        }
        ss_sm[m] = v;
      }
    }
    if (tid == 0) {
      atomicExch(count, 0);
    }
  }
  if constexpr (NORM) {
    __syncthreads();  // ss_sm complete
  }

  // ---- epilogue: lane (gq, t) holds rows gq (c = 0, 1) and gq + 8 (c = 2, 3) of each tile
  // for batch rows 8·(wn·NTW + j) + 2t + (c & 1) ----
#pragma unroll
  for (int j = 0; j < NTW; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int h = c >> 1;
      const int m = 8 * (wn * NTW + j) + 2 * t + (c & 1);
      if (m >= M) {
        continue;
      }
      float f = 1.f;
      if constexpr (NORM) {
        f = rsqrtf(ss_sm[m] / float(K) + __int_as_float(EPS_BITS));
      }
      if constexpr (EPI == 0 || EPI == 1) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int row = rows[i][h];
          if (row >= 0) {
            const size_t at = size_t(m) * N + row;
            float v = acc[i][j][c] * f;
            if constexpr (EPI == 1) {
              v += static_cast<float>(res[at]);
            }
            y[at] = static_cast<T>(v);
          }
        }
      } else if (rows[0][h] >= 0) {
        float a = acc[0][j][c] * f;
        float b = acc[1][j][c] * f;
        if constexpr (EPI == 3 && BIAS) {  // the projection's bias (Qwen2, in res), before the rotation
          a += static_cast<float>(res[rows[0][h]]);
          b += static_cast<float>(res[rows[1][h]]);
        }
        const int p = cb * (BN / 2) + wr * 16 + gq + 8 * h;
        if constexpr (EPI == 2) {
          y[size_t(m) * HALF + p] = static_cast<T>(a / (1.f + expf(-a)) * b);
        } else {
          mlxcel_rope_store<T, N, HD, NQ>(a, b, m, p, pos, inv_freq, y, y2);
        }
      }
    }
  }
}
// @@body
  mlxcel_qgemm<T, MT, N, K, G, BITS, WR, WN, SK, ST, EPI, NORM, EPS_BITS, 0, 0, 0>(
      x, w, scales, biases, res, nw, part, count, mlxcel_qgemm_rows<K>(x_shape, x_ndim), nullptr, nullptr, y, nullptr);
// @@body_rope
  mlxcel_qgemm<T, MT, N, K, G, BITS, WR, WN, SK, ST, 3, NORM, EPS_BITS, HD, NQ, BIAS>(
      x, w, scales, biases, qb, nw, part, count, mlxcel_qgemm_rows<K>(x_shape, x_ndim), pos, inv_freq, q, kv);
