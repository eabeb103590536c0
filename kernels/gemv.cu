// mlxcel: dense GEMV for decode, y[M, N] = x[M, K] · w[N, K]ᵀ, M ≤ 8, w bfloat16 or float16.
//
// w is row-major [N, K] (how MLX holds a Linear weight); x and y are T, the weight's dtype
// (bfloat16 or float16); products are summed in float32. Compiled at run time by MLX
// (`fast::cuda_kernel`, nvrtc); template constants: M, N, K, ROWS, WPB, EPI, NORM, EPS_BITS,
// MMA (and HD, NQ for the RoPE entry point). The epilogues and the norm are those of
// kernels/qgemv.cu, so a dense model's decode step fuses what a quantized one does:
//
// EPI picks what is written:
//   0: y[M, N]   = x·Wᵀ
//   1: y[M, N]   = res + x·Wᵀ            (res T [M, N]: the residual stream)
//   2: y[M, N/2] = silu(g)·u, g = (x·Wᵀ)[:, :N/2], u = (x·Wᵀ)[:, N/2:]
//      (the merged gate/up projection; a block takes ROWS/2 rows of each half)
//   3: the merged q/k/v projection with RoPE applied to q and k: x·Wᵀ is NQ query heads,
//      NKV key heads, NKV value heads of HD values (N = (NQ + 2·NKV)·HD); a block takes
//      ROWS/2 pairs of rows (d, d + HD/2) of a head, rotates q and k heads by
//      pos[m]·inv_freq[d] (half-split RoPE, MLX's `fast::rope` with traditional = false),
//      and writes q heads to y ([M, NQ, 1, HD]) and key then value heads to y2
//      ([M, 2·NKV, 1, HD]).
// NORM = 1 applies RMSNorm to x first (x·w_norm·rsqrt(mean(x²) + eps), nw T [K], eps the
// float whose bits are EPS_BITS): the block's threads read all of each row of x anyway.
//
// Work split, laid out for memory bandwidth: one block of WPB warps per ROWS output rows
// (grid N/ROWS blocks). A row is K/8 16-byte vectors (8 values each); thread t reads
// vectors t, t + 32·WPB, … of each of the block's rows, so a warp streams 512 contiguous
// bytes of a row per load instruction, and a thread issues the loads of up to LOADS
// vectors (over its rows and next vectors) before the math on them, which keeps enough
// bytes in flight per SM to cover DRAM latency without a split of K. Vectors past the row
// end (K/8 not a multiple of 32·WPB) are skipped. K must be a multiple of 8 (the launch
// code refuses other shapes). Partial sums are reduced by shuffles, then across the
// block's warps in shared memory.
//
// MMA = 1 takes the same products (M ≤ 16) on tensor cores instead, for batches where the
// CUDA-core path's FMAs (8 per weight and batch row) outrun memory: ROWS = 16 or 32 (one or
// two MMA tiles of weight rows), the batch rows the MMA's columns, K split over the WPB warps
// in chunks of 32 values; the loads and the fragments are described where the path starts.
// Its sums land in the same shared-memory table, so the epilogues are shared.
//
// This file is loaded in parts split at the marker lines: the header (device code, the
// template `mlxcel_gemv`) and two kernel bodies, each the body of a `__global__` function
// MLX generates around it:
//   @@body       (const T* x, const T* w, const T* res, const T* nw, T* y)       EPI 0, 1, 2
//   @@body_rope  (const T* x, const T* w, const T* nw, const int32_t* pos,
//                 const float* inv_freq, const T* qb, T* q, T* kv)             EPI 3
//   @@body_rope_kv (const T* x, const T* w, const T* nw, const int32_t* pos,
//                 const float* inv_freq, const T* pool, <pool's shape>, const int32_t* dst,
//                 const T* qb, T* q)
//                 EPI 3 with the key and value heads written into a layer's KV pool
//                 (T [1, 2·NKV, R, HD], key heads first) at row dst[m] of batch row m: the
//                 decode step's cache write, without an op of its own
// With BIAS = 1 the RoPE entry points add qb (T [N], the q/k/v projection's bias: Qwen2)
// before the rotation; with BIAS = 0 qb is not read (callers pass any array).
// (res is read only when EPI = 1, nw only when NORM = 1; callers pass any array there).
// MLX hands inputs to a kernel as const pointers: the pool is mlxcel's own array, read only
// by kernels that take this kernel's q (so run after it), and passed as a view that holds
// no reference to it (src/models/kv_cache.rs).
// mlxcel embeds it and `MLXCEL_GEMV_SOURCE=path` replaces it at run time;
// `scripts/check_gemv.py` loads the same file from Python to check and time it.
// @@header
// Every kernel of this file runs blocks of at most 512 threads (16 warps). Saying so lets
// ptxas give a thread the registers for all of a round's loads at once (80-92 for the
// launches used): without it ptxas kept 40-60 registers and spread a round's loads between
// the math, 2-4 in flight per thread. MLX writes the `__global__` signature itself, so the
// bound comes in through that macro (device compilation only; the CPU emulation compiles
// the file as it is).
#if defined(__CUDA_ARCH__)
#undef __global__
#define __global__ __location__(global) __launch_bounds__(512)
#endif
// 16-bit floats from their bits, picked by overload on a null T pointer: a bfloat16 is the
// top half of an f32, a float16 goes through the hardware conversion.
__device__ __forceinline__ float mlxcel_gv_f16bits(uint32_t h, const __nv_bfloat16*) {
  return __uint_as_float(h << 16);
}
__device__ __forceinline__ float mlxcel_gv_f16bits(uint32_t h, const __half*) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

// 8 values of T (one 16-byte load) to floats
template <typename T>
__device__ __forceinline__ void mlxcel_gv_h8(const uint4 v, float* f) {
  const T* z = nullptr;
  f[0] = mlxcel_gv_f16bits(v.x & 0xFFFFu, z);
  f[1] = mlxcel_gv_f16bits(v.x >> 16, z);
  f[2] = mlxcel_gv_f16bits(v.y & 0xFFFFu, z);
  f[3] = mlxcel_gv_f16bits(v.y >> 16, z);
  f[4] = mlxcel_gv_f16bits(v.z & 0xFFFFu, z);
  f[5] = mlxcel_gv_f16bits(v.z >> 16, z);
  f[6] = mlxcel_gv_f16bits(v.w & 0xFFFFu, z);
  f[7] = mlxcel_gv_f16bits(v.w >> 16, z);
}

// 16-byte weight vectors one thread keeps in flight before it does the math on them
#ifndef MLXCEL_GEMV_LOADS
#define MLXCEL_GEMV_LOADS 8
#endif

// One 16-byte vector of the weight: read once, so past L1 (`.nc`, no L1 line kept). The
// asm is volatile so that the compiler keeps a round's loads ahead of its math: as plain
// loads it sank each next to its use, which left 2-4 loads in flight per thread and made
// the launches with few blocks (the q/k/v shapes of the 70B ranks) latency-bound.
__device__ __forceinline__ uint4 mlxcel_gv_ldw(const uint4* p) {
#if defined(__CUDA_ARCH__)
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  return *p;
#endif
}

// The tensor-core path's helpers (MMA = 1, below): a float rounded to T, as bits
__device__ __forceinline__ uint32_t mlxcel_gv_tobits(float f, const __nv_bfloat16*) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  return __nv_bfloat16(f).bits;
#endif
}
__device__ __forceinline__ uint32_t mlxcel_gv_tobits(float f, const __half*) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  return __half(f).bits;
#endif
}
// c += A·B of one `mma.sync.m16n8k16` with T inputs and f32 accumulators (fragments as PTX
// lays them out: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9],
// a3 = A[g+8][2t+8, 2t+9], b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; c0, c1 = C[g][2t, 2t+1],
// c2, c3 = C[g+8][2t, 2t+1]), picked by overload on a null T pointer
#if defined(__CUDA_ARCH__)
#define MLXCEL_GV_MMA(TY)                                                                               \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
      "{%0,%1,%2,%3};\n"                                                                               \
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                 \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
#endif
__device__ __forceinline__ void mlxcel_gv_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                              uint32_t a3, uint32_t b0, uint32_t b1,
                                              const __nv_bfloat16*) {
#if defined(__CUDA_ARCH__)
  MLXCEL_GV_MMA("bf16");
#else
  mlxcel_emulated_mma16<__nv_bfloat16>(c, a0, a1, a2, a3, b0, b1);
#endif
}
__device__ __forceinline__ void mlxcel_gv_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                              uint32_t a3, uint32_t b0, uint32_t b1, const __half*) {
#if defined(__CUDA_ARCH__)
  MLXCEL_GV_MMA("f16");
#else
  mlxcel_emulated_mma16<__half>(c, a0, a1, a2, a3, b0, b1);
#endif
}
// x's 8 values (one 16-byte vector of a row) times the norm weight's, rounded to T, with
// their squares added to ss (MMA = 1 with NORM: the fragments are T, so the normed x is
// rounded once, as MLX's rms_norm rounds its output)
template <typename T>
__device__ __forceinline__ uint4 mlxcel_gv_normed(const uint4 v, const uint4 g, float& ss) {
  float xf[8], gf[8];
  mlxcel_gv_h8<T>(v, xf);
  mlxcel_gv_h8<T>(g, gf);
  uint32_t o[4];
  const T* z = nullptr;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    ss = fmaf(xf[2 * j], xf[2 * j], ss);
    ss = fmaf(xf[2 * j + 1], xf[2 * j + 1], ss);
    o[j] = mlxcel_gv_tobits(xf[2 * j] * gf[2 * j], z) |
           (mlxcel_gv_tobits(xf[2 * j + 1] * gf[2 * j + 1], z) << 16);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// 16-byte vectors of weights a lane of the tensor-core path keeps in flight (a round's
// chunks × its tiles × 2 rows)
#ifndef MLXCEL_GEMV_MMA_LOADS
#define MLXCEL_GEMV_MMA_LOADS 8
#endif

template <typename T, int M, int N, int K, int ROWS, int WPB, int EPI, int NORM, int EPS_BITS,
          int HD, int NQ, int MMA, int BIAS = 0>
__device__ __forceinline__ void mlxcel_gemv(const T* x, const T* w, const T* res, const T* nw,
                                            const int32_t* pos, const float* inv_freq, T* y,
                                            T* y2, const int32_t* kvdst, int kvrows) {
  static_assert(M >= 1 && M <= (MMA ? 16 : 8), "gemv: 1 to 8 rows of x (16 on tensor cores)");
  static_assert(!MMA || (ROWS % 16 == 0 && ROWS <= 32), "gemv: tensor cores take 1 or 2 tiles of 16 rows");
  static_assert(K % 8 == 0, "gemv: K must be a multiple of 8 (16-byte vectors)");
  static_assert(N % ROWS == 0, "gemv: ROWS must divide N");
  static_assert(EPI != 2 || (ROWS % 2 == 0 && N % 2 == 0), "gemv: SwiGLU needs pairs of rows");
  static_assert(EPI != 3 || (ROWS % 2 == 0 && HD % 2 == 0 && N % HD == 0 && (N / 2) % (ROWS / 2) == 0 &&
                             N / HD >= NQ && (N / HD - NQ) % 2 == 0),
                "gemv: RoPE needs pairs of rows and N = (NQ + 2 NKV) HD");
  constexpr int CPR = K / 8;                     // 16-byte vectors per row
  constexpr int TPB = 32 * WPB;                  // threads per block (all on the same ROWS rows)
  constexpr int ITERS = (CPR + TPB - 1) / TPB;   // vectors per thread and row
  constexpr int U0 = MLXCEL_GEMV_LOADS / ROWS > 0 ? MLXCEL_GEMV_LOADS / ROWS : 1;
  constexpr int U = ITERS < U0 ? ITERS : U0;     // vectors per row loaded before the math
  __shared__ float red[WPB][ROWS * M];
  __shared__ float red_ss[WPB][M];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  constexpr int HALF = ROWS / 2;
  constexpr int HD2 = HD > 0 ? HD / 2 : 1;
  const int grp = int(blockIdx.x);
  // output row of the block's row r: ROWS consecutive rows, or (EPI 2) ROWS/2 rows of the
  // gate half followed by the same rows of the up half, or (EPI 3) the first rows d of
  // ROWS/2 pairs (d, d + HD/2) of a head followed by their second rows
  auto row_of = [&](int r) -> int {
    if constexpr (EPI == 2) {
      return r < HALF ? grp * HALF + r : N / 2 + grp * HALF + (r - HALF);
    } else if constexpr (EPI == 3) {
      const int p = grp * HALF + (r < HALF ? r : r - HALF);  // pair index
      return (p / HD2) * HD + p % HD2 + (r < HALF ? 0 : HD2);
    } else {
      return grp * ROWS + r;
    }
  };

  const uint4* wv = reinterpret_cast<const uint4*>(w);
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* nv = reinterpret_cast<const uint4*>(nw);
  if constexpr (MMA) {
    // Tensor cores: each warp multiplies the block's TILES tiles of 16 weight rows by NT
    // tiles of 8 batch rows (rows ≥ M zero) over chunks of 32 values of K, chunk c of round
    // r going to warp c % WPB, so a round of the block's warps streams UM·WPB·64 contiguous
    // bytes of each row. In a chunk lane (g, t) loads the 16-byte vector 4c + t (values
    // 8t … 8t + 7 of the chunk) of weight rows g and g + 8 of each tile and of batch row g of
    // each batch tile, and feeds them to two MMAs as they are: the first takes values 0-3
    // (a0 = row g's 0, 1; a1 = row g+8's 0, 1; a2, a3 = their 2, 3; b0 = x's 0, 1; b1 = x's
    // 2, 3), the second values 4-7. An MMA's k slots 2t, 2t+1, 2t+8, 2t+9 thus hold the
    // values 8t … 8t+3 of the chunk (or 8t+4 …) in A and in B alike, which is all the product
    // needs, and nothing is shuffled. The loop's trip count is the same for every warp (a
    // chunk past K loads zeros), since MMAs are warp-wide.
    constexpr int TILES = ROWS / 16;
    constexpr int NT = (M + 7) / 8;
    constexpr int CH = (CPR + 3) / 4;  // chunks of 4 vectors
    constexpr int UM0 = MLXCEL_GEMV_MMA_LOADS / (2 * TILES) > 0 ? MLXCEL_GEMV_MMA_LOADS / (2 * TILES) : 1;
    constexpr int PER_WARP = (CH + WPB - 1) / WPB;
    constexpr int UM = PER_WARP < UM0 ? PER_WARP : UM0;  // chunks per round and warp
    constexpr int ROUNDS = (PER_WARP + UM - 1) / UM;
    const int g = lane >> 2;
    const int t = lane & 3;
    const T* z = nullptr;
    size_t wrow[TILES][2];
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wrow[i][h] = size_t(row_of(16 * i + g + 8 * h)) * CPR;
      }
    }
    float c[TILES][NT][4];
    float ssl[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      ssl[j] = 0.f;
#pragma unroll
      for (int i = 0; i < TILES; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          c[i][j][e] = 0.f;
        }
      }
    }
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int rd = 0; rd < ROUNDS; ++rd) {
      uint4 a[UM][TILES][2];
      uint4 b[UM][NT];
#pragma unroll
      for (int u = 0; u < UM; ++u) {
        const int ch = (rd * UM + u) * WPB + warp;
        const int v = 4 * ch + t;
        const bool in = ch < CH && (CPR % 4 == 0 || v < CPR);
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            a[u][i][h] = in ? mlxcel_gv_ldw(wv + wrow[i][h] + v) : zero;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UM; ++u) {
        const int ch = (rd * UM + u) * WPB + warp;
        const int v = 4 * ch + t;
        const bool in = ch < CH && (CPR % 4 == 0 || v < CPR);
        uint4 gw = zero;
        if constexpr (NORM) {
          gw = in ? nv[v] : zero;
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int m = 8 * j + g;
          b[u][j] = in && m < M ? xv[size_t(m) * CPR + v] : zero;
          if constexpr (NORM) {
            b[u][j] = mlxcel_gv_normed<T>(b[u][j], gw, ssl[j]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UM; ++u) {
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
          const uint4 lo = a[u][i][0];
          const uint4 hi = a[u][i][1];
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            mlxcel_gv_mma(c[i][j], lo.x, hi.x, lo.y, hi.y, b[u][j].x, b[u][j].y, z);
            mlxcel_gv_mma(c[i][j], lo.z, hi.z, lo.w, hi.w, b[u][j].z, b[u][j].w, z);
          }
        }
      }
    }
    // the warp's sums: C[r][m] of tile i, batch tile j is c[i][j][e] of lane (g, t) for
    // r = 16i + g + 8·(e / 2), m = 8j + 2t + e % 2
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * i + g + 8 * (e >> 1);
          const int m = 8 * j + 2 * t + (e & 1);
          if (m < M) {
            red[warp][r * M + m] = c[i][j][e];
          }
        }
      }
    }
    if constexpr (NORM) {
      // Σ x² of batch row 8j + g: the 4 lanes t of g hold its parts
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        float v = ssl[j];
        v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
        v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
        if (t == 0 && 8 * j + g < M) {
          red_ss[warp][8 * j + g] = v;
        }
      }
    }
  } else {
    size_t rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      rows[r] = size_t(row_of(r)) * CPR;
    }
    float acc[ROWS][M];
    float ss[M];  // NORM: this thread's part of Σ x² of each row of x
#pragma unroll
    for (int m = 0; m < M; ++m) {
      ss[m] = 0.f;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        acc[r][m] = 0.f;
      }
    }

    for (int it0 = 0; it0 < ITERS; it0 += U) {
      // the loads of U vectors of each row first, then the math
      uint4 q[U][ROWS];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = (it0 + u) * TPB + tid;
        const bool in = ((ITERS % U) == 0 || it0 + u < ITERS) && ((CPR % TPB) == 0 || c < CPR);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          q[u][r] = in ? mlxcel_gv_ldw(wv + rows[r] + c) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = (it0 + u) * TPB + tid;
        const bool in = ((ITERS % U) == 0 || it0 + u < ITERS) && ((CPR % TPB) == 0 || c < CPR);
        if (!in) {
          continue;
        }
        float xs[M][8];
        float gs[NORM ? 8 : 1];
        if constexpr (NORM) {
          mlxcel_gv_h8<T>(nv[c], gs);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
          mlxcel_gv_h8<T>(xv[size_t(m) * CPR + c], xs[m]);
          if constexpr (NORM) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              ss[m] = fmaf(xs[m][j], xs[m][j], ss[m]);
              xs[m][j] *= gs[j];
            }
          }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          float wf[8];
          mlxcel_gv_h8<T>(q[u][r], wf);
#pragma unroll
          for (int m = 0; m < M; ++m) {
            float a = 0.f, b = 0.f;
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
              a = fmaf(wf[j], xs[m][j], a);
              b = fmaf(wf[j + 1], xs[m][j + 1], b);
            }
            acc[r][m] += a + b;
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
          red[warp][r * M + m] = v;
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
  __syncthreads();

  // NORM: rsqrt(mean(x²) + eps) of row m, which scales its dot products
  auto norm_of = [&](int m) -> float {
    if constexpr (NORM) {
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
  auto pair_of = [&](int r, int m, float& a, float& c) {
    a = 0.f;
    c = 0.f;
#pragma unroll
    for (int i = 0; i < WPB; ++i) {
      a += red[i][r * M + m];
      c += red[i][(r + HALF) * M + m];
    }
    const float f = norm_of(m);
    a *= f;
    c *= f;
  };
  if constexpr (EPI == 3) {
    for (int i = tid; i < HALF * M; i += TPB) {
      const int r = i / M;
      const int m = i % M;
      float a, c;
      pair_of(r, m, a, c);
      if constexpr (BIAS) {  // the projection's bias (Qwen2), before the rotation
        a += static_cast<float>(res[row_of(r)]);
        c += static_cast<float>(res[row_of(r + HALF)]);
      }
      const int p = grp * HALF + r;
      const int head = p / HD2;
      const int d = p % HD2;
      constexpr int NKV = (N / HD - NQ) / 2;
      if (head < NQ + NKV) {
        const float theta = static_cast<float>(pos[m]) * inv_freq[d];
        const float cs = cosf(theta);
        const float sn = sinf(theta);
        const float ra = a * cs - c * sn;
        c = a * sn + c * cs;
        a = ra;
      }
      T* out;
      if (head < NQ) {
        out = y + size_t(m) * (NQ * HD) + size_t(head) * HD;
      } else if (kvdst != nullptr) {  // the KV pool's row kvdst[m] of kv head (head - NQ)
        out = y2 + (size_t(head - NQ) * size_t(kvrows) + size_t(kvdst[m])) * HD;
      } else {
        out = y2 + size_t(m) * (N - NQ * HD) + size_t(head - NQ) * HD;
      }
      out[d] = static_cast<T>(a);
      out[d + HD2] = static_cast<T>(c);
    }
  } else if constexpr (EPI == 2) {
    for (int i = tid; i < HALF * M; i += TPB) {
      const int r = i / M;
      const int m = i % M;
      float g, u;
      pair_of(r, m, g, u);
      y[size_t(m) * (N / 2) + grp * HALF + r] = static_cast<T>(g / (1.f + expf(-g)) * u);
    }
  } else {
    for (int j = tid; j < ROWS * M; j += TPB) {
      float v = 0.f;
#pragma unroll
      for (int i = 0; i < WPB; ++i) {
        v += red[i][j];
      }
      const int r = j / M;
      const int m = j % M;
      v *= norm_of(m);
      const size_t at = size_t(m) * N + row_of(r);
      if constexpr (EPI == 1) {
        v += static_cast<float>(res[at]);
      }
      y[at] = static_cast<T>(v);
    }
  }
}
// @@body
  mlxcel_gemv<T, M, N, K, ROWS, WPB, EPI, NORM, EPS_BITS, 0, 0, MMA>(x, w, res, nw, nullptr, nullptr,
                                                                     y, nullptr, nullptr, 0);
// @@body_rope
  mlxcel_gemv<T, M, N, K, ROWS, WPB, 3, NORM, EPS_BITS, HD, NQ, MMA, BIAS>(x, w, qb, nw, pos, inv_freq,
                                                                           q, kv, nullptr, 0);
// @@body_rope_kv
  mlxcel_gemv<T, M, N, K, ROWS, WPB, 3, NORM, EPS_BITS, HD, NQ, MMA, BIAS>(
      x, w, qb, nw, pos, inv_freq, q, const_cast<T*>(pool), dst, int(pool_shape[2]));
