#!/usr/bin/env bash
# The quantized GEMM for 9-128 batch rows (kernels/qgemm.cu, MLXCEL_QGEMM) on a GPU box.
#   bash scripts/gpu/qgemm.sh check [FLAGS...]  # scripts/check_qgemm.py --time: every 8B and 70B-rank
#                                               # shape at M = 9..128, 4 and 8 bits, against dequantize +
#                                               # matmul, and µs per call against today's path (< 4 min)
#   bash scripts/gpu/qgemm.sh bench             # mlxcel bench --decode-batch 8,16,32,64 on the 8B 4-bit g64,
#                                               # 8-bit g64 and bf16 configs (dummy weights), each of SETTINGS
#                                               # (default "MLXCEL_QGEMM=1 MLXCEL_QGEMM=0"; commas join
#                                               # variables, e.g. "MLXCEL_QGEMV_CHUNKS=0 X=1") alternated,
#                                               # RUNS (2) times (< 8 min)
#   bash scripts/gpu/qgemm.sh steps             # Nsight kernel times of one decode step at batch STEP_BATCH (64)
#                                               # of the 8B 4-bit, 8-bit and bf16 configs (mlxcel bench
#                                               # --profile-steps under ncu --profile-from-start off), by kernel
#                                               # kind: what a step costs the GPU besides the GEMMs (< 5 min;
#                                               # STEP_MODELS picks the configs)
#   bash scripts/gpu/qgemm.sh stalls [SPEC...]  # Nsight Compute, full set with per-instruction stall samples, of
#                                               # one launch per SPEC (MODEL:PRODUCT:BITS:ROWS[:fused], :fused
#                                               # the engine's launch with the norm and SwiGLU/RoPE or the
#                                               # residual (scripts/prof_qgemm.py), default
#                                               # 8B:gate_up:4:64 8B:qkv:4:32 8B:down:4:64): the details page and
#                                               # scripts/prof_qgemm.py's ledger of where the warps wait (< 3 min)
#   bash scripts/gpu/qgemm.sh times [SPEC...]   # Nsight kernel times (µs, TB/s of weights) of products (SPECs as
#                                               # for stalls, default the 8B products at 4 bits, 32 and 64 rows,
#                                               # and down and gate/up at 8), once per kernel file of SOURCES
#                                               # ("name=path ...", default the embedded file); the plain product,
#                                               # without the norm or an epilogue unless a SPEC ends in :fused
#                                               # (< 1 min each)
#   NCU_CACHE=none (for steps and times): Nsight leaves the caches as the previous kernel left
#   them, as a decode step finds them (x just written, in L2); its default, all, flushes them
#   before each kernel. With times, also set QGEMM_WARM_X=1 (scripts/prof_qgemm.py: the
#   weights pushed out of L2 and x written anew before each launch).
#   bash scripts/gpu/qgemm.sh all               # check and bench
# Targets (issue 25): 4-bit decode ≥ 1.3× bf16 at batch 8, 32 and 64 and rising with the batch;
# 8-bit ≥ bf16 at 32 and 64. Environment: scripts/gpu/lib.sh; BATCHES (8,16,32,64), RUNS,
# DECODE_TOKENS (128).
. "$(dirname "$0")/lib.sh"
cmd=${1:-all}; shift || true
check() {
  step "check_qgemm.py --time $*"
  timeout ${CHECK_S:-230} python3 scripts/check_qgemm.py --time "$@" 2>&1 | tee "$OUT/check-qgemm.txt" |
    grep -E "^\||NO|Error|error|checks" | tail -150
}
bench() {
  q4cfg; q8cfg
  local b=${BATCHES:-8,16,32,64}
  step "decode 8B (dummy weights) at batches $b, settings ${SETTINGS:-MLXCEL_QGEMM=1 MLXCEL_QGEMM=0} alternated, ${RUNS:-2} runs"
  for r in $(seq ${RUNS:-2}); do
    for m in c8b-q4 c8b-q8 c8b; do
      local first=1
      for e in ${SETTINGS:-MLXCEL_QGEMM=1 MLXCEL_QGEMM=0}; do
        # (bf16 has no quantized linears: one run, with the first setting)
        [ $m = c8b ] && [ $first = 0 ] && continue
        first=0
        e=${e//,/ }
        # (the first runs with MLXCEL_QGEMM=1 also compile its kernels, before bench's timing)
        echo "$m [$e] run $r: $(DECODE_TOKENS=${DECODE_TOKENS:-128} bench_line "$e" "$CK/$m" "$b" --load-format dummy)"
      done
    done
  done 2>&1 | tee -a "$OUT/qgemm-bench.txt"
}
steps() {
  q4cfg; q8cfg
  local b=${STEP_BATCH:-64} m
  for m in ${STEP_MODELS:-c8b-q4 c8b-q8 c8b}; do
    step "Nsight: one decode step at batch $b, $m"
    timeout ${NCU_S:-150} ncu --profile-from-start off --clock-control none --cache-control ${NCU_CACHE:-all} --csv --page raw \
      --metrics gpu__time_duration.sum $B bench -m "$CK/$m" --load-format dummy --prompt-lens 128 \
      --decode-tokens 16 --decode-batch "$b" --repeats 1 --profile-steps 2 > "$OUT/ncu-step-$m-b$b.csv" 2> "$OUT/ncu-step-$m-b$b.err" ||
      { echo "failed:"; tail -3 "$OUT/ncu-step-$m-b$b.err"; continue; }
    python3 scripts/ncu_summary.py --totals 2 "$OUT/ncu-step-$m-b$b.csv" | tee "$OUT/ncu-step-$m-b$b.txt" | head -25
  done
}
stalls() {
  local spec tag
  for spec in ${@:-8B:gate_up:4:64 8B:qkv:4:32 8B:down:4:64}; do
    tag=${spec//:/-}
    step "Nsight, full set with sources: $spec"
    timeout ${NCU_S:-120} ncu --set full --import-source yes -k regex:qgemm -s 1 -c 1 -f -o "$OUT/ncu-$tag" \
      python3 scripts/prof_qgemm.py run "$spec" > "$OUT/ncu-$tag.log" 2>&1 || { echo "failed:"; tail -5 "$OUT/ncu-$tag.log"; continue; }
    grep -E "launch" "$OUT/ncu-$tag.log"
    ncu -i "$OUT/ncu-$tag.ncu-rep" --page details --csv > "$OUT/ncu-$tag-details.csv" 2>&1
    grep -E '"(Duration|Memory Throughput|DRAM Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Executed Ipc Active|Theoretical Occupancy|Block Limit Registers|Block Limit Shared Mem)"' \
      "$OUT/ncu-$tag-details.csv" | awk -F'","' '{print $(NF-2)": "$NF" "$(NF-1)}' | tr -d '"' | head -12
    ncu -i "$OUT/ncu-$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-$tag-sass.csv" 2>&1
    python3 scripts/prof_qgemm.py ledger "$OUT/ncu-$tag-sass.csv" 40 2>&1 | tee "$OUT/ncu-$tag-ledger.txt" || head -3 "$OUT/ncu-$tag-sass.csv"
  done
  # (the box returns few files: the reports' exports in one archive, the ledgers beside it)
  (cd "$OUT" && tar -czf ncu-stalls.tgz ncu-*-details.csv ncu-*-sass.csv ncu-*.log 2>/dev/null &&
    rm -f ncu-*-details.csv ncu-*-sass.csv ncu-*.log ncu-*.ncu-rep)
}
times() {
  local specs=${*:-8B:qkv:4:32 8B:o:4:32 8B:gate_up:4:32 8B:down:4:32 8B:qkv:4:64 8B:o:4:64 8B:gate_up:4:64 8B:down:4:64 8B:gate_up:8:32 8B:down:8:32 8B:down:8:64}
  local v name path
  for v in ${SOURCES:-embedded=}; do
    name=${v%%=*} path=${v#*=}
    step "Nsight kernel times, kernel file $name${path:+ ($path)}"
    echo "| product | launch (MT WR WN SK ST) | µs | TB/s of weights |"
    echo "|---|---|---|---|"
    MLXCEL_QGEMM_SOURCE=$path timeout ${NCU_S:-150} ncu --clock-control none --cache-control ${NCU_CACHE:-all} --csv --metrics gpu__time_duration.sum -k regex:qgemm \
      python3 scripts/prof_qgemm.py run $specs > "$OUT/ncu-times-$name.csv" 2> "$OUT/ncu-times-$name.err" &&
      python3 scripts/prof_qgemm.py times "$OUT/ncu-times-$name.csv" $specs || tail -3 "$OUT/ncu-times-$name.err"
  done 2>&1 | tee -a "$OUT/qgemm-times.txt"
}
case "$cmd" in
check) check "$@" ;;
bench) bench ;;
steps) steps ;;
stalls) stalls "$@" ;;
times) times "$@" ;;
all) check "$@"; bench ;;
*) echo "unknown: $cmd (check, bench, steps, stalls, times, all)" >&2; exit 2 ;;
esac
