// mlxcel: attention of a decode step (one new token per sequence) over the paged KV pool.
//
//   q     T [B, HQ, 1, D]              the step's query heads (RoPE applied)
//   pool  T [1, 2·HKV, cap, D]         the layer's KV pool: key heads, then value heads;
//                                      the cap rows are cap / BS blocks of BS rows
//   table int32 [B, NB]                row b's block table: its position p is pool row
//                                      table[b, p / BS]·BS + p % BS
//   pos   int32 [B] (or a scalar, B = 1)  row b attends to positions 0 ..= pos[b] (the
//                                      new token's keys/values already written there)
//   part  float32, count int32         scratch (below); count starts, and ends, all zero
//                                      (this kernel uses count[b·HKV + h]; mlxcel sizes it
//                                      B·HKV·(NSPLIT + 1), room for a split-flag variant)
//   out   T [B, HQ, 1, D]              softmax(q·kᵀ·scale)·v per head
// T is bfloat16 or float16 (MLX's template type); D is 64 or 128; query head j reads key/value head j / (HQ/HKV) (GQA).
// Compiled at run time by MLX (`fast::cuda_kernel`); template constants D, HQ, HKV,
// NSPLIT, WARPS, BS (tokens per block, a multiple of 32), SCALE_BITS (the bits of the
// float scale·log2(e)).
//
// One op replaces MLX's two views of the pool and `fast::scaled_dot_product_attention`
// (which took 6-8 µs of GPU time per layer at 384 positions on H200), and the batch
// rows may read any blocks at any lengths, so a batched step needs no gather and no masks.
//
// Work split: a block of WARPS = G·TW warps (G = HQ/HKV) per (row b, kv head h, split
// s): blockIdx.y = b·HKV + h, blockIdx.x = s < gridDim.x ≤ NSPLIT (the launch gives as
// many splits as the step's longest row needs: a block that returns at once still holds
// an SM's registers while it reads the position). Warp w takes query head w % G of the
// block's tile w / G, so a round covers TW tiles of 32 positions; the positions are cut
// into ns ≤ gridDim.x ranges of whole tiles (about one round each, so short contexts
// still spread over many warps and long ones over more SMs); blocks past ns return at once.
// Per tile lane l owns position p = tile + l and its score against its head's q (kept
// in shared memory pre-scaled by scale·log2 e, so exp2 gives the softmax): the warp
// reads the tile's key rows 8 lanes a row, 4 rows a pass (the block's G warps of a tile
// share them through L1), adds up each row's partial dot products by shuffles and hands
// row l's score to lane l; the warp updates its running max / sum (online softmax) and
// accumulates the tile's value rows with lanes over d (D/32 values each), the weights
// broadcast by shuffles. The warps of a head are merged in shared memory. With ns = 1 the
// block writes out; otherwise it writes its partial result to part[b, h, s] and bumps
// count[b, h] (a release at GPU scope), and the block that brings it to ns merges the ns
// partials, writes out and sets the count back to zero, so the scratch is ready for the
// next layer with no clearing op. (MLX hands inputs to a kernel as
// const pointers; part and count are mlxcel's own arrays, never read by MLX, and the
// kernels that use them run one after another, each layer's after the previous one's.)
//
// Loop trip counts are uniform over the block, so the CPU emulation in
// tests/attn_emulated.rs (one thread per CUDA thread, shuffles as block barriers) runs
// this code unchanged.
// @@header
// Ask for the 128-byte line at p in L1 (no register, no wait): ptxas otherwise spaces a
// tile's loads out between the math, and each paid a full memory round trip.
__device__ __forceinline__ void mlxcel_prefetch_l1(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
#endif
}

// Bump the split count by one for the whole block (after a __syncthreads, by one thread),
// as a release and an acquire at GPU scope: the block's partial result (ordered before the
// release by the barrier) is visible to the block that sees the count reach ns, and the
// last block sees every other block's (its threads read after a barrier that follows
// this acquire). This replaced a __threadfence() by every thread before a relaxed
// atomicAdd and another after it, each a full fence (MEMBAR.SC) plus an L1 invalidation.
__device__ __forceinline__ int mlxcel_attn_arrive(int32_t* count) {
#if defined(__CUDA_ARCH__)
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(count) : "memory");
  return old;
#else
  return atomicAdd(count, 1);
#endif
}

// the two 16-bit values of a word as floats (low half first), picked by overload on a null
// T pointer: a bfloat16 is the top half of an f32, a float16 goes through the hardware
// conversion
__device__ __forceinline__ float2 mlxcel_attn_unpack2(uint32_t u, const __nv_bfloat16*) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
__device__ __forceinline__ float2 mlxcel_attn_unpack2(uint32_t u, const __half*) {
  return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(u & 0xffffu))),
                     __half2float(__ushort_as_half(static_cast<unsigned short>(u >> 16))));
}

// a lane's DPL values of a value row as one load
template <int DPL> struct mlxcel_vword { using type = uint32_t; };
template <> struct mlxcel_vword<4> { using type = uint2; };

template <typename T, int D, int HQ, int HKV, int NSPLIT, int WARPS, int BS, int SCALE_BITS>
__device__ void mlxcel_attn_decode(const T* q, const T* pool, const int32_t* table,
                                   const int32_t* pos, const float* part_in,
                                   const int32_t* count_in, T* out, int cap, int nb) {
  constexpr int G = HQ / HKV;
  constexpr int TW = WARPS / G;  // tiles in flight: warp w takes query head w % G of tile w / G
  constexpr int CHUNK = 32 * TW;  // positions a block takes per round
  constexpr int DPL = D / 32;     // values of a value row per lane
  constexpr int KL = D / 64;      // 16-byte loads a lane makes of a key row (8 lanes a row)
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(HQ % HKV == 0 && G <= 16, "1-16 query heads per kv head");
  static_assert(WARPS % G == 0 && TW >= 1 && NSPLIT >= 1 && WARPS * D <= 8192);
  static_assert(BS >= 32 && BS % 32 == 0, "blocks of whole 32-position tiles");
  const float NEG_INF = -__int_as_float(0x7f800000);
  const T* tz = nullptr;  // picks the 16-bit unpacking
  const unsigned FULL = 0xffffffffu;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = warp % G, tw = warp / G;
  const int s = blockIdx.x, h = blockIdx.y % HKV, b = blockIdx.y / HKV;
  // the splits launched per (row, kv head): enough for the step's longest row
  const int nsl = min(int(gridDim.x), NSPLIT);
  // q is read before the position is known, so the two loads overlap
  __shared__ float sq[G][D];
  const float qs = __int_as_float(SCALE_BITS);
  for (int i = threadIdx.x; i < G * D; i += 32 * WARPS)
    sq[i / D][i % D] = float(q[(size_t(b) * HQ + size_t(h) * G) * D + i]) * qs;
  const int len = pos[b] + 1;
  if (len <= 0) {  // a negative position: nothing to attend to
    if (s == 0)
      for (int i = threadIdx.x; i < G * D; i += 32 * WARPS)
        out[(size_t(b) * HQ + size_t(h) * G) * D + i] = T(0.f);
    return;
  }
  // positions per split in whole tiles; ns ≤ nsl splits, each non-empty
  const int ns0 = min(nsl, (len + CHUNK - 1) / CHUNK);
  const int per = (((len + ns0 - 1) / ns0) + 31) & ~31;
  const int ns = (len + per - 1) / per;
  if (s >= ns) return;
  const int p0 = s * per, p1 = min(len, p0 + per);

  __syncthreads();
  // the values of q (this warp's head) at the key values this lane reads: 8 from each 64
  const int ksub = lane & 7, kgrp = lane >> 3;
  float qk[KL][8];
#pragma unroll
  for (int c = 0; c < KL; ++c)
#pragma unroll
    for (int e = 0; e < 8; ++e) qk[c][e] = sq[g][64 * c + 8 * ksub + e];

  const size_t kbase = size_t(h) * size_t(cap) * D;
  const size_t vbase = kbase + size_t(HKV) * cap * D;
  const int32_t* btab = table + size_t(b) * nb;
  float m = NEG_INF, l = 0.f, acc[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) acc[i] = 0.f;
  // value rows as lanes read them (D/32 values = DPL/2 words); row index clamped to the
  // range so that every load is in bounds and can be issued early (clamped rows weigh 0)
  using VW = typename mlxcel_vword<DPL>::type;
  const VW* vcol = reinterpret_cast<const VW*>(pool + vbase + lane * DPL);
  // (rb: a tile's pool row minus its position, see below)
  auto vrow = [&](long long rb, int t0, int j) {
    return vcol[size_t(rb + min(t0 + j, p1 - 1)) * (D / DPL)];
  };
  auto add_rows = [&](const VW (&vw)[16], int j0, float e) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float wj = __shfl_sync(FULL, e, j0 + j);
      uint32_t u[2];
      if constexpr (DPL == 4) u[0] = vw[j].x, u[1] = vw[j].y;
      else u[0] = vw[j];
#pragma unroll
      for (int i = 0; i < DPL / 2; ++i) {
        const float2 f = mlxcel_attn_unpack2(u[i], tz);
        acc[2 * i] += wj * f.x;
        acc[2 * i + 1] += wj * f.y;
      }
    }
  };
  for (int base = p0; base < p1; base += CHUNK) {
    const int t0 = base + 32 * tw;  // this warp's tile (may be past p1: empty)
    const int p = t0 + lane;
    const bool ok = p < p1;
    // t0 is a multiple of 32 and a block holds whole tiles, so the tile's (clamped)
    // positions x lie in one block: pool row rb + x
    const int tc = min(t0, p1 - 1);
    const long long rb = (long long)btab[tc / BS] * BS + tc % BS - tc;
    // the tile's key and value rows into L1 in one round trip: lane l asks for row
    // t0 + l. (The compiler places each key load next to its use, 2 loads at a time, so
    // without this the tile's key rows cost 8 round trips to memory in a row.)
    const size_t row = size_t(rb + min(p, p1 - 1)) * D;
#pragma unroll
    for (int off = 0; off < D; off += 64) {
      mlxcel_prefetch_l1(pool + kbase + row + off);
      mlxcel_prefetch_l1(pool + vbase + row + off);
    }
    // the key rows, 8 lanes a row (4 rows a load instruction, each lane 16 bytes of a
    // row's every 128 bytes): row j of the tile is read in pass j / 4 by lanes
    // 8·(j % 4) …, whose partial dot products with q add up over those 8 lanes. (Each
    // lane reading a whole row of its own touched 32 lines per load instruction.)
    uint4 kw[8][KL];
#pragma unroll
    for (int ps = 0; ps < 8; ++ps) {
      const uint4* kr = reinterpret_cast<const uint4*>(
          pool + kbase + size_t(rb + min(t0 + 4 * ps + kgrp, p1 - 1)) * D + 8 * ksub);
#pragma unroll
      for (int c = 0; c < KL; ++c) kw[ps][c] = kr[8 * c];
    }
    VW va[16], vb[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) va[j] = vrow(rb, t0, j);
    float sc = 0.f;
#pragma unroll
    for (int ps = 0; ps < 8; ++ps) {
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < KL; ++c) {
        const uint32_t wd[4] = {kw[ps][c].x, kw[ps][c].y, kw[ps][c].z, kw[ps][c].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 k = mlxcel_attn_unpack2(wd[j], tz);
          s += qk[c][2 * j] * k.x + qk[c][2 * j + 1] * k.y;
        }
      }
      s += __shfl_xor_sync(FULL, s, 1);
      s += __shfl_xor_sync(FULL, s, 2);
      s += __shfl_xor_sync(FULL, s, 4);
      // lane l takes row l's score: pass l / 4, lanes 8·(l % 4) …
      const float v = __shfl_sync(FULL, s, 8 * (lane & 3));
      if ((lane >> 2) == ps) sc = v;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) vb[j] = vrow(rb, t0, 16 + j);
    float mt = ok ? sc : NEG_INF;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(FULL, mt, o));
    const float mn = fmaxf(m, mt);
    const float corr = mn == NEG_INF ? 1.f : exp2f(m - mn);
    l *= corr;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] *= corr;
    m = mn;
    const float e = ok ? exp2f(sc - mn) : 0.f;
    l += e;
    // the tile's value rows, lanes over d, weighted by their lanes' e
    add_rows(va, 0, e);
    add_rows(vb, 16, e);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(FULL, l, o);

  // merge the warps of each query head
  __shared__ float sm[TW][G], sl[TW][G], sa[TW][G][D];
#pragma unroll
  for (int i = 0; i < DPL; ++i) sa[tw][g][lane * DPL + i] = acc[i];
  if (lane == 0) sm[tw][g] = m, sl[tw][g] = l;
  __syncthreads();
  float* part = const_cast<float*>(part_in) + ((size_t(b) * HKV + h) * NSPLIT) * G * (D + 2);
  for (int i = threadIdx.x; i < G * D; i += 32 * WARPS) {
    const int g = i / D, d = i % D;
    float mx = NEG_INF;
    for (int w = 0; w < TW; ++w) mx = fmaxf(mx, sm[w][g]);
    float sum = 0.f, a = 0.f;
    for (int w = 0; w < TW; ++w) {
      const float f = sm[w][g] == NEG_INF ? 0.f : exp2f(sm[w][g] - mx);
      sum += sl[w][g] * f;
      a += sa[w][g][d] * f;
    }
    if (ns == 1) {
      out[(size_t(b) * HQ + size_t(h) * G + g) * D + d] = T(a / sum);
    } else {
      float* ps = part + size_t(s) * G * (D + 2) + g * (D + 2);
      ps[d] = a;
      if (d == 0) ps[D] = mx, ps[D + 1] = sum;
    }
  }
  if (ns == 1) return;
  // the last split's block to finish merges them all
  __shared__ int last;
  __syncthreads();
  int32_t* count = const_cast<int32_t*>(count_in) + size_t(b) * HKV + h;
  if (threadIdx.x == 0) last = mlxcel_attn_arrive(count) == ns - 1;
  __syncthreads();
  if (!last) return;
  // the splits' maxima and sums into shared memory first, each thread one, then every
  // (head, d) weighs its ns values with up to 8 loads issued at once (loaded one split
  // after another, each was a round trip to L2). With the key rows read 8 lanes a row
  // (above), a batch-1 call of a 70B TP=8 rank at 384 positions went from 15.6 to 13.8 µs
  // (Nsight, two H100 boxes; MLX's sdpa 9.4 and 9.9 on them).
  __shared__ float pm[NSPLIT][G], pl[NSPLIT][G];
  for (int i = threadIdx.x; i < ns * G; i += 32 * WARPS) {
    const float* ps = part + size_t(i / G) * G * (D + 2) + (i % G) * (D + 2);
    pm[i / G][i % G] = __ldcg(ps + D);
    pl[i / G][i % G] = __ldcg(ps + D + 1);
  }
  __syncthreads();
  constexpr int MU = NSPLIT < 8 ? NSPLIT : 8;  // the splits' values loaded at once
  for (int i = threadIdx.x; i < G * D; i += 32 * WARPS) {
    const int g = i / D, d = i % D;
    float mx = NEG_INF;
    for (int t = 0; t < ns; ++t) mx = fmaxf(mx, pm[t][g]);
    float sum = 0.f, a = 0.f;
    for (int t0 = 0; t0 < ns; t0 += MU) {
      // split indices past ns are clamped and weighed 0, so the MU loads are unconditional
      // and issued together (as conditional L2-coherent loads, which the compiler does
      // not hoist above their condition, each waited for the one before)
      float v[MU];
#pragma unroll
      for (int u = 0; u < MU; ++u)
        v[u] = __ldcg(part + size_t(min(t0 + u, ns - 1)) * G * (D + 2) + g * (D + 2) + d);
#pragma unroll
      for (int u = 0; u < MU; ++u) {
        const int t = min(t0 + u, ns - 1);
        const float f = t0 + u < ns ? exp2f(pm[t][g] - mx) : 0.f;
        sum += pl[t][g] * f;
        a += v[u] * f;
      }
    }
    out[(size_t(b) * HQ + size_t(h) * G + g) * D + d] = T(a / sum);
  }
  if (threadIdx.x == 0) atomicExch(count, 0);
}
// @@body
  mlxcel_attn_decode<T, D, HQ, HKV, NSPLIT, WARPS, BS, SCALE_BITS>(
      q, pool, table, pos, part, count, out, pool_shape[2], table_shape[1]);
