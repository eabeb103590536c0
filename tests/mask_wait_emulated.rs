//! The deferred-mask kernel (`kernels/mask_wait.cu`) run on the CPU (see `common`), with a
//! host thread that follows `kernels::mask_wait::MaskBuffer::give`'s protocol (words, a
//! fence, the flag, a fence, the give-up word): masks given while the blocks wait are
//! copied whole; a flag from an earlier step does not release a later one; and masks given
//! after the kernel's timeout are reported by the give-up word, the output then zeros.

mod common;
use common::PRELUDE;

const MAIN: &str = r#"
#include <atomic>
#include <chrono>
int main() {
  // pinned buffer: [0] flag, [1] give-up word, [2..] words
  std::vector<uint32_t> buf(2 + N, 0);
  const int64_t src[3] = {int64_t(uintptr_t(&buf[0])), int64_t(uintptr_t(&buf[2])),
                          int64_t(uintptr_t(&buf[1]))};
  auto give = [&](uint32_t seq, uint32_t base) {
    for (int i = 0; i < N; ++i) buf[2 + i] = base + i;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    reinterpret_cast<std::atomic<uint32_t>*>(&buf[0])->store(seq);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return reinterpret_cast<std::atomic<uint32_t>*>(&buf[1])->load() != seq;
  };
  constexpr int tpb = 32, blocks = 3;
  blockDim.x = tpb;
  gridDim.x = blocks;
  auto run = [&](uint32_t want, std::vector<uint32_t>& out) {
    for (int blk = 0; blk < blocks; ++blk) run_block(blk, tpb, [&] { kernel(src, &want, out.data()); });
  };
  std::vector<uint32_t> out(N, 7);
  // step 1: given 50 ms after the blocks start waiting
  std::thread h([&] { std::this_thread::sleep_for(std::chrono::milliseconds(50));
                      if (!give(1, 1000)) std::printf("step 1 reported late\n"); });
  run(1, out);
  h.join();
  for (int i = 0; i < N; ++i)
    if (out[i] != 1000u + i) { std::printf("step 1: word %d is %u\n", i, out[i]); return 1; }
  // step 2: the flag still says 1, so the blocks wait for step 2's words
  std::thread h2([&] { std::this_thread::sleep_for(std::chrono::milliseconds(50));
                       if (!give(2, 5000)) std::printf("step 2 reported late\n"); });
  run(2, out);
  h2.join();
  for (int i = 0; i < N; ++i)
    if (out[i] != 5000u + i) { std::printf("step 2: word %d is %u\n", i, out[i]); return 1; }
  // step 3: never given within the timeout: zeros, and the give-up word says 3
  run(3, out);
  for (int i = 0; i < N; ++i)
    if (out[i] != 0u) { std::printf("step 3: word %d is %u\n", i, out[i]); return 1; }
  if (give(3, 9000)) { std::printf("step 3: a late give was not reported\n"); return 1; }
  std::printf("protocol ok: %d words, 3 steps\n", N);
  return 0;
}
"#;

#[test]
fn masks_given_late_early_and_never_follow_the_protocol() {
    let (header, body) = common::one_body("mask_wait.cu");
    let mut src = String::from(PRELUDE);
    // a short timeout for the step that is never given (200 ms)
    src += "#include <atomic>\n#include <chrono>\n#define MLXCEL_MASK_TIMEOUT_NS 200000000ull\n";
    src += &header;
    src += "constexpr int N = 100;\nusing T = uint32_t;\n";
    // MLX's signature for inputs src (int64), want (uint32) and output out (uint32)
    src += "void kernel(const int64_t* src, const uint32_t* want, uint32_t* out) {\n";
    src += &body;
    src += "\n}\n";
    src += MAIN;
    common::run_checked("mask-wait", &src, &"N = 100", "protocol ok");
}
