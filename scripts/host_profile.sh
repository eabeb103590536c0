#!/usr/bin/env bash
# Poor man's host profiler for a decode run on a box without perf/nsys: samples the
# stacks of a running `mlxcel generate` with (cuda-)gdb and writes them to $OUT/stacks.txt;
# `python3 scripts/fold_stacks.py $OUT/stacks.txt` counts where the MLX thread is.
#   bash scripts/host_profile.sh MODEL_DIR [SAMPLES]
# BATCH=B: a batched decode instead (`mlxcel bench --decode-batch B`, dummy weights, a few
# thousand steps); MLXCEL=path: a build with symbols (strip = false) names mlxcel's frames.
set -uo pipefail
B=${MLXCEL:-.gpu/bin/mlxcel}
OUT=${OUT:-./gpu-out}
GDB=${GDB:-$(command -v gdb || command -v cuda-gdb-minimal || command -v cuda-gdb || echo /usr/local/cuda/bin/cuda-gdb)}
mkdir -p "$OUT"
if [ -n "${BATCH:-}" ]; then
  $B bench -m "$1" --load-format dummy --prompt-lens 128 --decode-tokens 2500 --decode-batch "$BATCH" \
    --repeats 1 > "$OUT/profiled-run.log" 2>&1 &
else
  $B generate -m "$1" -n 100000 --ignore-eos -p hello > "$OUT/profiled-run.log" 2>&1 &
fi
pid=$!
sleep ${WARM_S:-25}
for i in $(seq ${2:-30}); do
  echo "=== sample $i"
  timeout 20 "$GDB" -p $pid -batch -nx -ex "set pagination off" -ex "thread apply all bt 40" 2>/dev/null | grep -E "^(#|Thread)"
  sleep 0.2
done > "$OUT/stacks.txt"
kill $pid; wait $pid 2>/dev/null
tail -3 "$OUT/profiled-run.log"
