#!/usr/bin/env bash
# The default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) and GGUF speed on a GPU box.
#   bash scripts/gpu/gguf.sh stage     # HERE (CPU machine, after `mlxcel generate` fetched the model once):
#                                      # split the cached GGUF into .gpu/g1 and .gpu/g2 (< 64 MiB each)
#   box, send A: carry .gpu/g1  -> bash .gpu/g1/keep.sh
#   box, send B: carry .gpu/g2  -> bash .gpu/g2/install.sh      # assembles, checks the sha256, puts it
#                                      # where mlxcel looks for its default model ($MLXCEL_CACHE)
#   bash scripts/gpu/gguf.sh decode    # SmolLM2 decode tok/s at batch 1 (and BATCHES, default 8), RUNS (3) runs
#   bash scripts/gpu/gguf.sh answer    # one real answer: `mlxcel generate` (no arguments), then streamed by
#                                      # mlxcel-server to a standard-library client (/v1/chat/completions)
#   bash scripts/gpu/gguf.sh vs-mlx    # one 1B shape: a Q4_0 GGUF (scripts/make_test_gguf.py) vs MLX 4-bit
#                                      # group 32 (--load-format dummy), alternated RUNS times, batch 1 and 8
#   bash scripts/gpu/gguf.sh check     # the GEMV kernel in float16 on SmolLM2's shapes (scripts/check_qgemv.py)
#   bash scripts/gpu/gguf.sh all       # check, decode, answer, vs-mlx
# Environment: see scripts/gpu/lib.sh.
if [ "${1:-}" = stage ]; then
  set -euo pipefail
  src=${MLXCEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxcel}/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$src" ] || { echo "no $src: run \`mlxcel generate\` here once (it fetches the model)"; exit 1; }
  rm -rf .gpu/g1 .gpu/g2; mkdir -p .gpu/g1 .gpu/g2
  sum=$(sha256sum "$src" | cut -d' ' -f1)
  split -n 2 -d -a 1 "$src" .gpu/tmp_gguf_
  mv .gpu/tmp_gguf_0 .gpu/g1/gguf.part0; mv .gpu/tmp_gguf_1 .gpu/g2/gguf.part1
  cat > .gpu/g1/keep.sh <<'KEEP'
#!/usr/bin/env bash
# On the GPU box: keep the first half outside the bundle, so the next send can complete it.
set -euo pipefail
mkdir -p /root/.mlxcel-gguf-in && cp "$(cd "$(dirname "$0")" && pwd)/gguf.part0" /root/.mlxcel-gguf-in/
echo "kept: $(ls -l /root/.mlxcel-gguf-in)"
KEEP
  cat > .gpu/g2/install.sh <<INST
#!/usr/bin/env bash
# On the GPU box: assemble the default model's GGUF, check it, put it in mlxcel's cache.
set -euo pipefail
here="\$(cd "\$(dirname "\$0")" && pwd)"
C=\${MLXCEL_CACHE:-/root/.mlxcel-cache}/smollm2-135m-instruct
[ -f /root/.mlxcel-gguf-in/gguf.part0 ] || { echo "first half missing: send .gpu/g1 and run keep.sh first"; exit 3; }
mkdir -p "\$C"
cat /root/.mlxcel-gguf-in/gguf.part0 "\$here/gguf.part1" > "\$C/.partial.gguf"
echo "$sum  \$C/.partial.gguf" | sha256sum -c -
mv "\$C/.partial.gguf" "\$C/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "installed: \$C/SmolLM2-135M-Instruct.Q4_1.gguf"
INST
  chmod +x .gpu/g1/keep.sh .gpu/g2/install.sh
  du -sh .gpu/g1 .gpu/g2
  exit 0
fi
. "$(dirname "$0")/lib.sh"
G=$MLXCEL_CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
need_model() { [ -f "$G" ] || { echo "no $G: send .gpu/g1 and .gpu/g2 first (see the header)"; exit 3; }; }
cmd=${1:-all}; shift || true

decode() {
  need_model
  step "SmolLM2-135M-Instruct Q4_1 GGUF: decode at batch 1 and ${BATCHES:-8}, ${RUNS:-3} runs"
  for r in $(seq ${RUNS:-3}); do echo "run $r: $(bench_line X=1 "$G" "${BATCHES:-8}")"; done 2>&1 | tee -a "$OUT/gguf-decode.txt"
  step "float16 (the default) with MLX's quantized_matmul instead of mlxcel's GEMV kernel, with float activations in the kernel, and converted to bfloat16"
  for e in MLXCEL_QGEMV_F16=0 MLXCEL_QGEMV_XQ=0 MLXCEL_GGUF_DTYPE=bfloat16; do
    echo "[$e] $(bench_line $e "$G" "${BATCHES:-8}")"
  done 2>&1 | tee -a "$OUT/gguf-decode.txt"
}

answer() {
  need_model
  step "mlxcel generate (no arguments: the default model answers the default question)"
  $B generate 2>&1 | tail -2 | tee "$OUT/gguf-answer.txt"
  step "the same with MLX's quantized_matmul, with float activations in the GEMV kernel, converted to bfloat16, and in float32"
  for e in MLXCEL_QGEMV_F16=0 MLXCEL_QGEMV_XQ=0 MLXCEL_GGUF_DTYPE=bfloat16 MLXCEL_GGUF_DTYPE=float32; do
    echo "[$e] $(env $e $B generate 2>&1 | tail -2 | tr '\n' ' ')"
  done | tee -a "$OUT/gguf-answer.txt"
  step "mlxcel-server -m GGUF, one streamed answer"
  serve "$G" 8093 || return 1
  python3 - 8093 <<'PY' 2>&1 | tee -a "$OUT/gguf-answer.txt"
import json, sys, time, urllib.request
port = sys.argv[1]
body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "stream": True,
        "max_tokens": 64, "temperature": 0}
req = urllib.request.Request(f"http://localhost:{port}/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
t0, first, text, chunks = time.time(), None, "", 0
with urllib.request.urlopen(req) as r:
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        d = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        if d:
            first = first or time.time() - t0
            chunks += 1
            text += d
            print(d, end="", flush=True)
print(f"\n[{chunks} chunks, first after {first:.3f} s, all in {time.time() - t0:.3f} s]")
PY
  unserve
}

vs_mlx() {
  demo_tokenizer
  [ -f "$CK/g1b/model-q4_0.gguf" ] ||
    python3 scripts/make_test_gguf.py --out "$CK/g1b" --shape llama3-1b --tokenizer-from "$TOK"
  step "1B shape, 4-bit group 32: Q4_0 GGUF (float16, the default; the same on MLX's quantized_matmul; with float activations in the kernel) vs MLX 4-bit (dummy), alternated"
  for r in $(seq ${RUNS:-3}); do
    echo "gguf-f16 run $r: $(bench_line X=1 "$CK/g1b/model-q4_0.gguf" 8)"
    echo "gguf-f16-mlx-qmm run $r: $(bench_line MLXCEL_QGEMV_F16=0 "$CK/g1b/model-q4_0.gguf" 8)"
    echo "gguf-f16-float-activations run $r: $(bench_line MLXCEL_QGEMV_XQ=0 "$CK/g1b/model-q4_0.gguf" 8)"
    echo "mlx4 run $r: $(bench_line X=1 "$CK/g1b-mlx4" 8 --load-format dummy)"
  done 2>&1 | tee -a "$OUT/gguf-vs-mlx4.txt"
}

check() {
  step "check_qgemv.py --dtype float16: SmolLM2 shapes, 4/8-bit group 32, batch 1, 4, 8"
  timeout ${CHECK_S:-300} python3 scripts/check_qgemv.py --dtype float16 --only SmolLM2 --configs 4g32,8g32 \
    --ms 1,4,8 2>&1 | tee "$OUT/check-qgemv-f16.txt" | grep -E "^\||Error|error|NO" | tail -40
}

case "$cmd" in
check) check ;;
decode) decode ;;
answer) answer ;;
vs-mlx) vs_mlx ;;
all) check; decode; answer; vs_mlx ;;
*) echo "unknown subcommand $cmd (see the header)"; exit 2 ;;
esac
