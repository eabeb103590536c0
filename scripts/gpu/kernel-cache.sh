#!/usr/bin/env bash
# The compiled-kernel cache on a GPU box (docs/kernel-cache.md): an 8B-shape 4-bit g64 server
# (dummy weights, --parallel 16, so the warm-up compiles every GEMV variant of batches 1-9 and
# prompts of 2-8 tokens) started three times, each time until /health answers:
#   1. an empty cache folder (first start: the warm-up waits for the compiles),
#   2. the same folder again (second start: the compiled kernels are read back),
#   3. MLXCEL_WARM_BACKGROUND=1 with another empty folder (first start that waits for batch 1's
#      compiles only; the rest compile in the background while it serves),
#   4. MLXCEL_KERNEL_CACHE=0 with another empty folder (MLX compiles every variant itself),
# printing each start's wall seconds, the warm-up line (its seconds and the cache's counts)
# and the decode rate and TTFT of 8 streams sent at once after /health (scripts/bench_server.py),
# which a cached kernel must not change (in the background start they meet what is still
# compiling).
#   bash scripts/gpu/kernel-cache.sh
# Environment: see scripts/gpu/lib.sh; PARALLEL (16); SKIP_PLAIN=1 leaves out runs 1 and 2,
# SKIP_BACKGROUND=1 and SKIP_CACHE_OFF=1 runs 3 and 4.
. "$(dirname "$0")/lib.sh"
q4cfg
PORT=${PORT:-18490}
P=${PARALLEL:-16}
dir=$(mktemp -d) off=$(mktemp -d) bg=$(mktemp -d)
run() {
  local tag=$1 d=$2; shift 2
  step "$tag"
  local t0=$(date +%s.%N)
  env "$@" MLX_PTX_CACHE_DIR=$d $S -m "$CK/c8b-q4" --load-format dummy --port $PORT --parallel $P \
    --ctx-size 2048 > "$OUT/kernel-cache-$tag.log" 2>&1 &
  spid=$!
  for _ in $(seq 600); do curl -sf "localhost:$PORT/health" >/dev/null && break
    kill -0 $spid 2>/dev/null || { echo "server exited:"; tail -5 "$OUT/kernel-cache-$tag.log"; return 1; }; sleep 0.5; done
  echo "$tag: ready after $(python3 -c "import sys,time; print(round(time.time()-float(sys.argv[1]),1))" $t0) s"
  grep -o "warmed up.*" "$OUT/kernel-cache-$tag.log" | head -1
  echo "cache folder: $(ls "$d" | wc -l) files, $(du -sh "$d" | cut -f1)"
  touch "$d/.ready"
  timeout 120 python3 scripts/bench_server.py --port $PORT --concurrency 8 --max-tokens 128 --rounds 1 \
    > "$OUT/kernel-cache-$tag.json" && bench_summary "$OUT/kernel-cache-$tag.json"
  # the modules compiled while the streams ran (MLX's own and mlxcel's), by kernel name
  echo "compiled after ready: $(find "$d" -name '*.txt' -newer "$d/.ready" | wc -l) modules:" \
    $(find "$d" -name '*.txt' -newer "$d/.ready" -exec basename {} .txt \; | sed 's/_[0-9]*$//' | sort | uniq -c | sort -rn | head -12)
  unserve
}
{
  [ -n "${SKIP_PLAIN:-}" ] || run first-start "$dir" X=1
  [ -n "${SKIP_PLAIN:-}" ] || run second-start "$dir" X=1
  [ -n "${SKIP_BACKGROUND:-}" ] || run background-first-start "$bg" MLXCEL_WARM_BACKGROUND=1
  [ -n "${SKIP_CACHE_OFF:-}" ] || run cache-off "$off" MLXCEL_KERNEL_CACHE=0
} 2>&1 | tee "$OUT/kernel-cache.txt"
