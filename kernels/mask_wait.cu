// mlxcel: a constrained decode step's token masks, read from page-locked host memory once
// the host has written them, so that the step's sampling (and the next forward pass) can be
// queued before the masks exist: the device waits here, not the host before queueing.
//
//   src   int64 [3]    device addresses in the pinned buffer: [0] the flag (uint32),
//                      [1] the words (uint32), [2] the word a block that gave up writes
//                      `want` to
//   want  uint32 [1]   the flag value that says this step's words are written
//   out   uint32 [N]   the words
// Thread 0 of every block polls the flag (volatile loads of host memory over the bus)
// until it reaches `want` (compared modulo 2^32), or gives up after
// MLXCEL_MASK_TIMEOUT_NS: then it writes `want` to the give-up word, fences, and looks at
// the flag once more; only if it is still not there does the block write zeros (no
// token allowed). The host writes the words, fences, writes the flag, fences and reads
// the give-up word: one side always sees the other's write, so a step whose masks came
// too late is either read whole or reported to the host (which fails it). Template
// constant N.
// Compiled at run time by MLX (`fast::cuda_kernel`).
// @@header
// (on the CPU, for tests/mask_wait_emulated.rs: a steady clock, a yield, a C++ fence)
__device__ __forceinline__ unsigned long long mlxcel_globaltimer() {
#if defined(__CUDA_ARCH__)
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
#endif
}
__device__ __forceinline__ void mlxcel_poll_pause() {
#if defined(__CUDA_ARCH__)
  __nanosleep(500);
#else
  std::this_thread::yield();
#endif
}
__device__ __forceinline__ void mlxcel_fence_system() {
#if defined(__CUDA_ARCH__)
  __threadfence_system();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}
// how long a block waits for the host (30 s; kernels::mask_wait::TIMEOUT_SECS)
#ifndef MLXCEL_MASK_TIMEOUT_NS
#define MLXCEL_MASK_TIMEOUT_NS 30000000000ull
#endif
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
      if (mlxcel_globaltimer() - start > MLXCEL_MASK_TIMEOUT_NS) {
        volatile uint32_t* gave_up = reinterpret_cast<volatile uint32_t*>(uintptr_t(src[2]));
        *gave_up = w;
        mlxcel_fence_system();
        got = int32_t(*flag - w) >= 0;
        break;
      }
      mlxcel_poll_pause();
    }
    mlxcel_fence_system();
    ok = got;
  }
  __syncthreads();
  const volatile uint32_t* words = reinterpret_cast<const volatile uint32_t*>(uintptr_t(src[1]));
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size_t(N);
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = ok ? words[i] : 0u;
  }
