// mlxcel: a constrained decode step's token masks, read from page-locked host memory once
// the host has written them, so that the step's sampling (and the next forward pass) can be
// queued before the masks exist: the device waits here, not the host before queueing.
//
//   src   int64 [2]    device addresses in the pinned buffer: [0] the flag (uint32),
//                      [1] the words (uint32)
//   want  uint32 [1]   the flag value that says this step's words are written
//   out   uint32 [N]   the words
// Thread 0 of every block polls the flag (volatile loads of host memory over the bus)
// until it reaches `want` (compared modulo 2^32), or gives up after TIMEOUT_NS and the
// block writes zeros (no token allowed; the host discards a step it never gave masks
// to). The host writes the words, then a fence, then the flag. Template constant N.
// Compiled at run time by MLX (`fast::cuda_kernel`).
// @@header
__device__ __forceinline__ unsigned long long mlxcel_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// how long a block waits for the host (30 s)
constexpr unsigned long long MLXCEL_MASK_TIMEOUT_NS = 30000000000ull;
// @@body
  __shared__ int ok;
  if (threadIdx.x == 0) {
    const volatile uint32_t* flag = reinterpret_cast<const volatile uint32_t*>(uintptr_t(src[0]));
    const uint32_t w = want[0];
    const unsigned long long start = mlxcel_globaltimer();
    int got = 0;
    while (true) {
      if (int32_t(*flag - w) >= 0) {
        got = 1;
        break;
      }
      if (mlxcel_globaltimer() - start > MLXCEL_MASK_TIMEOUT_NS) break;
      __nanosleep(500);
    }
    __threadfence_system();
    ok = got;
  }
  __syncthreads();
  const volatile uint32_t* words = reinterpret_cast<const volatile uint32_t*>(uintptr_t(src[1]));
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size_t(N);
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = ok ? words[i] : 0u;
  }
