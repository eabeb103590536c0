// mlxcel: the rest of a Qwen3 decode step's q/k/v after the projection, in one kernel: RMSNorm
// of each query and key head (Qwen3's q_norm and k_norm), RoPE on them, and the KV cache write.
// The GEMV kernels (kernels/gemv.cu, kernels/qgemv.cu) apply RoPE and write the cache
// themselves where no per-head norm comes between (Llama, Qwen2); with Qwen3's norms a head's
// 128 rows are a reduction over rows that their blocks split, so the projection (with the
// layer's RMSNorm fused) writes y and this kernel does the rest: 2 MLX ops a layer where the
// separate ops were 7–8 (a split, two norms, two RoPEs, the cache write).
//
//   y        T [M, NQ + 2·NKV, 1, HD]  q heads, key heads, value heads of each batch row
//   qw, kw   T [HD]                    the q and k norm weights; eps the float of EPS_BITS
//   pos      int32 [M]                 each row's position; inv_freq float32 [HD/2]
//   pool     T [1, 2·NKV, R, HD]       the layer's KV pool (key heads first), written at row
//                                      dst[m] (int32 [M]) of batch row m; mlxcel's own array,
//                                      passed as a view that holds no reference to it
//   q        T [M, NQ, 1, HD]          normed and rotated query heads
// One block per (batch row, head) of HD/2 threads: thread d holds the pair (d, d + HD/2),
// as half-split RoPE (MLX's `fast::rope`, traditional = false) pairs them. The norm rounds to
// T, as MLX's rms_norm output is; RoPE computes in float from that. Value heads are copied.
// Template constants: NQ, NKV, HD (64 or 128: whole warps), EPS_BITS.
// @@header
template <typename T, int NQ, int NKV, int HD, int EPS_BITS>
__device__ __forceinline__ void mlxcel_qk_rope(const T* y, const T* qw, const T* kw,
                                               const int32_t* pos, const float* inv_freq, T* pool,
                                               const int32_t* dst, int rows, T* q) {
  constexpr int H = NQ + 2 * NKV;
  constexpr int HD2 = HD / 2;
  constexpr int W = HD2 / 32;
  static_assert(HD2 % 32 == 0, "qk_rope: HD/2 must be whole warps");
  __shared__ float part[W];
  const int m = int(blockIdx.x) / H;
  const int h = int(blockIdx.x) % H;
  const int d = int(threadIdx.x);
  const T* src = y + (size_t(m) * H + h) * HD;
  float a = static_cast<float>(src[d]);
  float c = static_cast<float>(src[d + HD2]);
  if (h < NQ + NKV) {  // (the same for the whole block)
    float ss = a * a + c * c;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
    }
    if ((d & 31) == 0) {
      part[d >> 5] = ss;
    }
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      t += part[i];
    }
    const float r = rsqrtf(t / float(HD) + __int_as_float(EPS_BITS));
    const T* g = h < NQ ? qw : kw;
    a = static_cast<float>(static_cast<T>(a * r * static_cast<float>(g[d])));
    c = static_cast<float>(static_cast<T>(c * r * static_cast<float>(g[d + HD2])));
    const float theta = static_cast<float>(pos[m]) * inv_freq[d];
    const float cs = cosf(theta);
    const float sn = sinf(theta);
    const float ra = a * cs - c * sn;
    c = a * sn + c * cs;
    a = ra;
  }
  T* out = h < NQ ? q + (size_t(m) * NQ + h) * HD
                  : pool + (size_t(h - NQ) * size_t(rows) + size_t(dst[m])) * HD;
  out[d] = static_cast<T>(a);
  out[d + HD2] = static_cast<T>(c);
}
// @@body
  mlxcel_qk_rope<T, NQ, NKV, HD, EPS_BITS>(y, qw, kw, pos, inv_freq, const_cast<T*>(pool), dst,
                                           int(pool_shape[2]), q);
