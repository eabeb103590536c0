#!/usr/bin/env bash
# mlxcel's CUDA kernels on a GPU box: correctness against MLX, and Nsight Compute times.
#   bash scripts/gpu/kernels.sh check [FLAGS...]   # scripts/check_qgemv.py (e.g. --quick, --only 70B, --ms 1,5,8,
#                                                  # --configs 4g32,4g128, --skip qkv,o); kernel vs dequantize + matmul
#   bash scripts/gpu/kernels.sh ncu TAG [FLAGS...] # Nsight times of scripts/prof_qgemv.py (e.g. --defaults --ms 1,5,8;
#                                                  # --mma --cfgs 16x8,16x16; --stream --pgs 264,396; --ceiling)
#   bash scripts/gpu/kernels.sh sections           # Nsight sections (stalls, occupancy, memory) per GEMV, summarised
#   bash scripts/gpu/kernels.sh attn               # scripts/check_attn.py and its Nsight times
#   bash scripts/gpu/kernels.sh attn-ab FILE...    # attention kernel files against kernels/attn.cu in one call:
#                                                  # check_attn.py --quick each, Nsight µs per call at 128/384/
#                                                  # 2,048/8,192 positions (ATTN_AB_CTXS; heads 8/1, then 32/8), then batch-1 decode of
#                                                  # the 70B TP=8 proxies: sdpa (default) vs MLXCEL_ATTN_SINGLE=1
#                                                  # with each file (MLXCEL_ATTN_SOURCE), alternated (< 6 min)
#   bash scripts/gpu/kernels.sh op-costs           # host time per MLX op (scripts/op_costs.py)
#   bash scripts/gpu/kernels.sh launch-costs       # host time per kernel: an op each (MLX's add, a custom kernel)
#                                                  # against 1/2/6/8/32 kernels launched by one op (mlxcel
#                                                  # _launch-costs), at mlxcel's buffer settings (100 ops / 4,000 MB)
#                                                  # and at 20 ops / 100 MB a buffer
#   bash scripts/gpu/kernels.sh gemv-mma           # the dense GEMV's tensor-core path: check_gemv.py --mma --quick at
#                                                  # 4/8/16 rows, both paths' and MLX matmul's bandwidth at 1/4/8/16 rows
#                                                  # (8B and 70B TP=8 shapes), then bf16 decode at batches 2-16 of
#                                                  # the 8B and the 70B TP=8 proxy, default vs MLXCEL_GEMV_MMA=4
#                                                  # MLXCEL_GEMV_MMA_MAX=16, alternated (< 9 min; LIMIT s caps it)
# MLXCEL_QGEMV_SOURCE=FILE runs another kernel file (docs/tuning.md). Environment: scripts/gpu/lib.sh.
. "$(dirname "$0")/lib.sh"
cmd=${1:-check}; shift || true
case "$cmd" in
check)
  step "check_qgemv.py $*"
  timeout ${CHECK_S:-300} python3 scripts/check_qgemv.py "$@" 2>&1 | tee "$OUT/check-qgemv.txt" | grep -E "^\||Error|error|NO" | tail -80
  ;;
ncu)
  tag=${1:?a tag for the output files}; shift
  step "Nsight: prof_qgemv.py $*"; ncut "$tag" "$@"
  ;;
sections)
  step "Nsight sections (raw metrics, csv): q/k/v, down at M = 1; q/k/v, o, down, gate/up at M = 8"
  timeout ${NCU_S:-240} ncu --clock-control none -k regex:qgemv -c 16 --section SpeedOfLight \
    --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis_Tables --section InstructionStats --page raw --csv \
    python3 scripts/prof_qgemv.py --stalls > "$OUT/ncu-stalls.csv" 2> "$OUT/ncu-stalls.err"
  echo "rc $? lines $(wc -l < "$OUT/ncu-stalls.csv")"; tail -3 "$OUT/ncu-stalls.err"
  python3 scripts/ncu_summary.py "$OUT/ncu-stalls.csv" | tee "$OUT/ncu-stalls-summary.txt"
  ;;
attn)
  step "decode attention kernel vs float32 reference and MLX's sdpa (scripts/check_attn.py)"
  timeout 200 python3 scripts/check_attn.py 2>&1 | tee "$OUT/check-attn.txt"
  step "GPU time per call (ncu)"
  timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/check_attn.py --marks > "$OUT/ncu-attn.txt" 2>&1
  python3 scripts/check_attn.py --parse "$OUT/ncu-attn.txt" | tee "$OUT/ncu-attn-parsed.txt"
  ;;
attn-ab)
  [ $# -gt 0 ] || { echo "attn-ab: name one or more kernel files" >&2; exit 2; }
  files=()  # absolute paths: MLXCEL_ATTN_SOURCE is read wherever the binary runs
  for f in kernels/attn.cu "$@"; do files+=("$(realpath "$f")"); done
  for f in "${files[@]:1}"; do
    step "check_attn.py --quick with $f"
    ATTN_SRC=$f ATTN_CTXS=384 timeout 200 python3 scripts/check_attn.py --quick 2>&1 | tail -10
  done
  for hh in 8,1 32,8; do
    for f in "${files[@]}"; do
      step "Nsight µs per call, heads ${hh/,//}, $f (positions | in order | shuffled | MLX sdpa)"
      ATTN_SRC=$f ATTN_TIME_HEADS=$hh ATTN_CTXS=${ATTN_AB_CTXS:-128,384,2048,8192} timeout 120 ncu --clock-control none \
        --metrics gpu__time_duration.sum -k regex:'attn|sdpa' python3 scripts/check_attn.py --marks > "$OUT/ncu-attn-ab.txt" 2>&1
      python3 scripts/check_attn.py --parse "$OUT/ncu-attn-ab.txt" | tail -3
    done
  done 2>&1 | tee "$OUT/attn-ab.txt"
  demo_tokenizer
  python3 scripts/rank_proxies.py --out "$CK/proxies" --only 70b-tp8-bf16,70b-tp8-q4 --tokenizer-from "$TOK" >/dev/null
  step "70B TP=8 proxies, batch 1: sdpa (default) vs MLXCEL_ATTN_SINGLE=1 with each file, 2 rounds"
  for r in 1 2; do for m in 70b-tp8-bf16 70b-tp8-q4; do for f in - "${files[@]}"; do
    e=X=1; [ "$f" = - ] || e="MLXCEL_ATTN_SINGLE=1 MLXCEL_ATTN_SOURCE=$f"
    echo "$m run $r [$e] $(DECODE_TOKENS=128 bench_line "$e" "$CK/proxies/$m" 1 --load-format dummy)"
  done; done; done 2>&1 | tee -a "$OUT/attn-ab.txt"
  ;;
gemv-mma)
  t0=$(date +%s); left() { echo $(( ${LIMIT:-540} - ($(date +%s) - t0) )); }
  step "check_gemv.py --mma --quick --ms 4,8,16"
  timeout 150 python3 scripts/check_gemv.py --mma --quick --ms 4,8,16 2>&1 | tail -30 | tee "$OUT/gemv-mma-check.txt"
  step "check_gemv.py --time --no-check --ms 1,4,8,16 (8B, 70B-TP8)"
  for o in 8B 70B-TP8; do
    timeout $(( $(left) - 200 > 30 ? $(left) - 200 : 30 )) python3 scripts/check_gemv.py --time --no-check --ms 1,4,8,16 --only $o 2>&1 | grep "^|"
  done 2>&1 | tee "$OUT/gemv-mma-time.txt"
  q4cfg; demo_tokenizer
  python3 scripts/rank_proxies.py --out "$CK/proxies" --only 70b-tp8-bf16 --tokenizer-from "$TOK" >/dev/null
  step "bf16 decode at batches 2,4,8,16: default vs the tensor-core path from 4 rows, alternated"
  for r in 1 2; do for m in c8b proxies/70b-tp8-bf16; do for e in X=1 "MLXCEL_GEMV_MMA=4 MLXCEL_GEMV_MMA_MAX=16"; do
    [ "$(left)" -lt 60 ] && break 3
    echo "$m [$e] run $r: $(DECODE_TOKENS=128 BENCH_S=$(( $(left) - 5 )) bench_line "$e" "$CK/$m" 2,4,8,16 --load-format dummy)"
  done; done; done 2>&1 | tee -a "$OUT/gemv-mma-engine.txt"
  ;;
op-costs)
  step "host cost per MLX op (scripts/op_costs.py)"
  timeout 120 python3 scripts/op_costs.py 2>&1 | tee "$OUT/op-costs.txt"
  ;;
launch-costs)
  for e in X=1 "MLX_MAX_OPS_PER_BUFFER=20 MLX_MAX_MB_PER_BUFFER=100"; do
    step "host µs per kernel, an op each vs several launched by one op [$e]"
    env $e timeout 120 $B _launch-costs --repeats 7 2> "$OUT/launch-costs-err.txt" | tee -a "$OUT/launch-costs.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "failed:"; tail -5 "$OUT/launch-costs-err.txt"; }
  done
  ;;
*) echo "unknown: $cmd (check, ncu, sections, attn, attn-ab, op-costs, launch-costs, gemv-mma)" >&2; exit 2 ;;
esac
