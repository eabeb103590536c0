#!/usr/bin/env bash
# The multi-GPU validation runs (docs/multi-gpu.md, "Measured"), on a box with >= 2 GPUs,
# after `source /root/.mlxcel-gpu/env.sh`. Each call runs in under 10 minutes:
#   bash scripts/gpu/multi-gpu.sh placement   # placement (--devices), plans, a 90B dummy model served at TP=2
#                                             # (openai client, kill -9 of a rank); writes the 8B and 15B
#                                             # checkpoints and runs the 70B kernel check on GPU 1 meanwhile
#   bash scripts/gpu/multi-gpu.sh decode      # decode tok/s at batch 1 and 32: 8B TP=1/2, 70B TP=2
#   bash scripts/gpu/multi-gpu.sh parity      # teacher-forced parity 8B TP=2, 15B real-file load at TP=2
#   bash scripts/gpu/multi-gpu.sh ncu         # 8B checkpoint; Nsight kernel times on GPU 1 meanwhile
#   bash scripts/gpu/multi-gpu.sh pipeline    # TP=2 pipelined vs step-by-step decode; parity against float32
#   bash scripts/gpu/multi-gpu.sh servers     # fixtures over NCCL; 4-bit TP=2; TP=2 servers at 1 and 32 streams
#   bash scripts/gpu/multi-gpu.sh tp-overhead # TP=2 step overhead: MLX graph settings, rank 0's host stacks
#   bash scripts/gpu/multi-gpu.sh vocab       # vocab-parallel embedding/lm_head (default) vs replicated
#                                             # (MLXCEL_VOCAB_PARALLEL=0): decode tok/s and rank weights of
#                                             # 8B/70B at TP=2 (70B also at TP=4/8 when the GPUs are there),
#                                             # seeded sampled tokens alike on the 8B checkpoint, tp-parity
# MLXCEL / MLXCEL_SERVER: binaries (default .gpu/bin); OUT: results; WHEELS: the openai
# client's wheels (default .gpu/wheels). nvidia-smi memory is sampled every second into
# $OUT/smi-<call>.csv; `mark` lines in the log give the phases' times.
set -uo pipefail
B=${MLXCEL:-.gpu/bin/mlxcel}
S=${MLXCEL_SERVER:-$(dirname "$B")/mlxcel-server}
OUT=${OUT:-./gpu-out}
CK=${CKPT_DIR:-/root/ckpt}
TOK=${MLXCEL_CACHE:-/root/.mlxcel-cache}/demo-llama-v2
export MLXCEL_CACHE=${MLXCEL_CACHE:-/root/.mlxcel-cache}
mkdir -p "$OUT" "$CK"
call=${1:-placement}
step() { echo; echo "=== $(date +%T) $*"; }
mark() { echo "mark $(date '+%Y/%m/%d %H:%M:%S') $*"; }
smi() { nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader; }
nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader -lms 1000 > "$OUT/smi-$call.csv" &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT
[ -f "$TOK/tokenizer.json" ] || $B generate -m demo -n 1 >/dev/null 2>&1
cfg() { [ -f "$CK/$2/config.json" ] || python3 scripts/make_random_checkpoint.py --shape "$1" --out "$CK/$2" --tokenizer-from "$TOK" --config-only; }
cfg llama3-8b c8b; cfg llama3-70b c70b; cfg llama3-90b c90b
if ! python3 -c "import openai" 2>/dev/null; then
  pip install -q --no-index --target /root/site "${WHEELS:-.gpu/wheels}"/*.whl >/dev/null 2>&1
  export PYTHONPATH=/root/site${PYTHONPATH:+:$PYTHONPATH}
fi
# serve MODEL PORT ARGS...: start mlxcel-server in the background, wait for /health
serve() {
  local m=$1 port=$2; shift 2
  mark "server start $m $*"
  $S -m "$m" --port "$port" "$@" > "$OUT/server-$port.log" 2>&1 &
  spid=$!
  for _ in $(seq 400); do curl -sf "localhost:$port/health" >/dev/null && break
    kill -0 $spid 2>/dev/null || { echo "server exited:"; tail -5 "$OUT/server-$port.log"; return 1; }; sleep 1; done
  mark "server ready"; grep -E "rank [0-9].*(weights|GB)|warmed up|listening" "$OUT/server-$port.log" | tail -6
}
unserve() { kill -TERM $spid; wait $spid; echo "server exit: $?"; mark "server stopped"; }
gen_tps() { grep -o 'generated: .*tok/s'; }
srv_bench() { python3 scripts/bench_server.py --port "$1" --concurrency "$2" --max-tokens "${3:-128}" --rounds 1 |
  tee "$OUT/bench-$1-$2.json" | python3 -c 'import json,sys; [print("streams", r["concurrency"], round(r["tokens_per_s"],1), "tok/s, inter-token p50", round(r["inter_token_s"]["p50"]*1e3,2), "ms") for r in json.load(sys.stdin)["results"]]'; }

case "$call" in
placement)
  step "GPUs"; nvidia-smi --query-gpu=index,name,memory.used,memory.total,pci.bus_id --format=csv
  $B devices; $B devices --check 2>&1 | tail -4
  step "run 6: one rank with --devices 1 (GPU 1 must fill, GPU 0 stay empty), then --devices 1,0"
  mark "devices 1"
  $B generate -m "$CK/c8b" --load-format dummy --tp-size 1 --tp-backend nccl --devices 1 -n 256 --ignore-eos -p hi > "$OUT/dev1.log" 2>&1 &
  g=$!
  for _ in $(seq 60); do sleep 1; grep -q "generated:" "$OUT/dev1.log" && break; u=$(smi | tr '\n' ' '); case "$u" in *"1, "[1-9][0-9][0-9][0-9][0-9]*) break;; esac; done
  echo "while the rank runs: $(smi | tr '\n' ' ')"; nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory --format=csv,noheader
  wait $g; grep -E "rank 0|generated:" "$OUT/dev1.log"
  $B generate -m "$CK/c8b" --load-format dummy --tp-size 2 --devices 1,0 -n 64 --ignore-eos -p hi 2>&1 | grep -E "CUDA_VISIBLE|rank [01] |generated:"
  step "background: 8B and 15B checkpoints on GPU 0; 70B kernel check (gate/up, down, lm_head) on GPU 1"
  ( [ -f "$CK/8b-bf16/config.json" ] || CUDA_VISIBLE_DEVICES=0 python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/8b-bf16" --tokenizer-from "$TOK"
    [ -f "$CK/15b-bf16/config.json" ] || CUDA_VISIBLE_DEVICES=0 python3 scripts/make_random_checkpoint.py --shape llama-15b --out "$CK/15b-bf16" --tokenizer-from "$TOK" ) > "$OUT/ckpt.log" 2>&1 &
  ck=$!
  CUDA_VISIBLE_DEVICES=1 timeout ${CHECK_S:-420} python3 scripts/check_qgemv.py --only 70B --skip qkv,o > "$OUT/check-qgemv-70b-rest.txt" 2>&1 &
  kc=$!
  step "run 3: plans for a 91B bf16 model (182 GB)"
  $B plan -m "$CK/c90b" --load-format dummy --tp-size 1 > "$OUT/plan-90b-tp1.txt" 2>&1; echo "exit $?"; tail -3 "$OUT/plan-90b-tp1.txt"
  $B plan -m "$CK/c90b" --load-format dummy --tp-size 2 --parallel 4 --ctx-size 4096 2>&1 | tail -6
  $B plan -m "$CK/c90b" --load-format dummy --tp-size 2 --parallel 4 --ctx-size 4096 --json > "$OUT/plan-90b.json" 2>/dev/null
  step "run 3 + 5: mlxcel-server --tp-size 2 with the 91B model: openai stream, kill -9 of rank 1, restart"
  if serve "$CK/c90b" 8130 --load-format dummy --tp-size 2 --parallel 4 --ctx-size 4096; then
    echo "loaded: $(smi | tr '\n' ' ')"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
    curl -s localhost:8130/metrics | grep -E "^mlxcel:(device|rank|tp)" | head -12
    timeout 400 python3 scripts/tp_server_check.py --port 8130 --rank 1 | tee "$OUT/tp-server-90b.json"
    echo "after restart: $(smi | tr '\n' ' ')"
    unserve; sleep 1; pgrep -fa "mlxcel _rank" | grep -v pgrep || echo "no rank process left"
  fi
  step "background jobs"; wait $kc; tail -40 "$OUT/check-qgemv-70b-rest.txt"; wait $ck; tail -3 "$OUT/ckpt.log"
  ;;
decode)
  # the 8B runs use dummy weights (same shapes and speed as a file; no checkpoint needed)
  step "background: 8B and 15B checkpoints (for `parity`); on GPU 1: kernel check of the 8B o, gate/up, lm_head shapes, then Nsight times"
  ( [ -f "$CK/8b-bf16/config.json" ] || CUDA_VISIBLE_DEVICES=0 python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/8b-bf16" --tokenizer-from "$TOK"
    [ -f "$CK/15b-bf16/config.json" ] || CUDA_VISIBLE_DEVICES=0 python3 scripts/make_random_checkpoint.py --shape llama-15b --out "$CK/15b-bf16" --tokenizer-from "$TOK" ) > "$OUT/ckpt.log" 2>&1 &
  ck=$!
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 150 python3 scripts/check_qgemv.py --only 8B --skip qkv,down > "$OUT/check-qgemv-8b-rest.txt" 2>&1
    timeout ${NCU_S:-200} ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'qgemv|qmv' \
      python3 scripts/prof_qgemv.py > "$OUT/ncu.txt" 2>&1
    python3 scripts/prof_qgemv.py --parse "$OUT/ncu.txt" > "$OUT/ncu-parsed.txt" 2>&1 ) &
  kc=$!
  step "8B bf16 TP=1: bench batch 1 and 32 (GPU 0)"
  $B bench -m "$CK/c8b" --load-format dummy --prompt-lens 128 --decode-tokens 128 --decode-batch 1,32 --repeats 1 2>/dev/null | tee "$OUT/bench-8b-tp1.json" | tail -1 |
    python3 -c 'import json,sys; d=json.load(sys.stdin); print("decode bs1", round(d["decode"]["tokens_per_second"],1), "tok/s;", "batched", [(b["batch"], round(b["tokens_per_second"],1)) for b in d["decode_batched"]])'
  step "waiting for GPU 1"; wait $kc; tail -30 "$OUT/check-qgemv-8b-rest.txt"; cat "$OUT/ncu-parsed.txt" | tail -40
  step "8B bf16 TP=2 (NCCL): generate batch 1, pipelined and not"
  for f in "" --no-pipeline; do echo "tp2 $f: $($B generate -m "$CK/c8b" --load-format dummy --tp-size 2 -n 256 --ignore-eos -p hello $f 2>&1 | gen_tps)"; done
  step "8B bf16 TP=2: server, 1 and 32 streams"
  serve "$CK/c8b" 8131 --load-format dummy --tp-size 2 --parallel 32 --ctx-size 2048 && {
    srv_bench 8131 32 32 >/dev/null; srv_bench 8131 1; srv_bench 8131 32; echo "$(smi | tr '\n' ' ')"; unserve; }
  step "70B bf16 (dummy) TP=2: generate batch 1"
  $B generate -m "$CK/c70b" --load-format dummy --tp-size 2 -n 128 --ignore-eos -p hello 2>&1 | grep -E "rank [01] |generated:|warmed"
  step "70B bf16 (dummy) TP=2: server, 1 and 32 streams"
  serve "$CK/c70b" 8132 --load-format dummy --tp-size 2 --parallel 32 --ctx-size 2048 && {
    echo "loaded: $(smi | tr '\n' ' ')"; srv_bench 8132 32 16 >/dev/null; srv_bench 8132 1 64; srv_bench 8132 32 64; unserve; }
  wait $ck; tail -2 "$OUT/ckpt.log"
  ;;
parity)
  step "run 6: --devices 1,0 (rank 0 on the GPU of bus id 07)"
  $B generate -m "$CK/c8b" --load-format dummy --tp-size 2 --devices 1,0 -n 64 --ignore-eos -p hi 2>&1 | grep -E "rank [01] |generated:|error"
  step "run 2: tp-parity 8B bf16, TP=2 over NCCL, 256 teacher-forced positions"
  timeout 300 $B tp-parity -m "$CK/8b-bf16" --tp-size 2 --steps 256 2>/dev/null | tee "$OUT/tp-parity-8b.json"
  step "run 2: per-rank memory of 8B TP=2 vs plan vs nvidia-smi"
  $B plan -m "$CK/8b-bf16" --tp-size 2 --ctx-size 4096 2>&1 | tail -5
  serve "$CK/8b-bf16" 8133 --tp-size 2 --parallel 1 --ctx-size 4096 && { srv_bench 8133 1 32 >/dev/null; echo "$(smi | tr '\n' ' ')"; curl -s localhost:8133/metrics | grep -E "^mlxcel:(device|rank)" | head; unserve; }
  step "run 3: real 15B checkpoint (sharded files) at TP=2: byte-range load per rank"
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(page cache not dropped)"
  $B plan -m "$CK/15b-bf16" --tp-size 2 2>&1 | tail -4
  $B generate -m "$CK/15b-bf16" --tp-size 2 -n 64 --ignore-eos -p hello 2>&1 | grep -E "rank [01] |generated:"
  ;;
ncu)
  step "8B checkpoint (GPU 0) while Nsight times the 4-bit/8-bit GEMVs on GPU 1 (mlxcel's launch shapes)"
  ( [ -f "$CK/8b-bf16/config.json" ] || CUDA_VISIBLE_DEVICES=0 python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/8b-bf16" --tokenizer-from "$TOK" ) > "$OUT/ckpt.log" 2>&1 &
  ck=$!
  CUDA_VISIBLE_DEVICES=1 timeout ${NCU_S:-400} ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'qgemv|qmv' \
    python3 scripts/prof_qgemv.py --defaults > "$OUT/ncu.txt" 2>&1; echo "ncu exit $?"
  python3 scripts/prof_qgemv.py --parse "$OUT/ncu.txt" | tee "$OUT/ncu-parsed.txt"
  wait $ck; tail -1 "$OUT/ckpt.log"
  ;;
pipeline)
  step "TP=2 decode, pipelined vs step by step, alternated (nothing else running)"
  for m in c8b c70b; do for r in 1 2; do for f in "" --no-pipeline; do
    echo "$m run $r ${f:-pipelined}: $($B generate -m "$CK/$m" --load-format dummy --tp-size 2 -n 128 --ignore-eos -p hello $f 2>&1 | gen_tps)"
  done; done; done
  step "TP=2 8B decode without MLX's CUDA graphs (does each NCCL call cut the graph?)"
  for r in 1 2; do echo "c8b MLX_USE_CUDA_GRAPHS=0 run $r: $(MLX_USE_CUDA_GRAPHS=0 $B generate -m "$CK/c8b" --load-format dummy --tp-size 2 -n 128 --ignore-eos -p hello 2>&1 | gen_tps)"; done
  step "run 2: tp-parity 8B bf16 TP=2 with a float32 reference (how far each run is from exact math)"
  timeout 300 $B tp-parity -m "$CK/8b-bf16" --tp-size 2 --steps 256 --f32-reference 2>/dev/null | tee "$OUT/tp-parity-8b-f32.json"
  ;;
servers)
  step "fixtures over NCCL, TP=2 (every family, fused kernels on)"
  timeout 150 python3 scripts/check_fixtures.py $B -n 12 --prompts 1 --tp-size 2 2>&1 | tail -9
  python3 - "$CK" <<'PY'
import json, os, shutil, sys
ck = sys.argv[1]; src, dst = f"{ck}/c8b", f"{ck}/c8b-q4"
os.makedirs(dst, exist_ok=True)
for f in os.listdir(src): shutil.copy(f"{src}/{f}", dst)
c = json.load(open(f"{dst}/config.json")); c["quantization"] = {"group_size": 64, "bits": 4}
json.dump(c, open(f"{dst}/config.json", "w"))
PY
  step "8B 4-bit (dummy) TP=1 vs TP=2 decode, batch 1"
  $B generate -m "$CK/c8b-q4" --load-format dummy -n 256 --ignore-eos -p hello 2>&1 | gen_tps
  for r in 1 2; do $B generate -m "$CK/c8b-q4" --load-format dummy --tp-size 2 -n 256 --ignore-eos -p hello 2>&1 | gen_tps; done
  step "servers at TP=2, 1 and 32 streams, nothing else running"
  for m in c8b c70b; do
    serve "$CK/$m" 8134 --load-format dummy --tp-size 2 --parallel 32 --ctx-size 2048 >/dev/null && {
      srv_bench 8134 32 16 >/dev/null; echo "$m:"; srv_bench 8134 1 64; srv_bench 8134 32 64; unserve >/dev/null; }
  done
  ;;
tp-overhead)
  # not yet run: where a TP=2 decode step's 5-8 ms go (8B: TP=1 takes 3-5 ms)
  # MLX captures each ncclAllReduce into its CUDA graph (a child graph when NCCL records more
  # than one node); NCCL may register each new buffer with its peers at capture
  step "TP=2 8B decode under MLX's CUDA-graph and NCCL settings (ranks inherit the environment)"
  for e in "X=1" "MLX_USE_CUDA_GRAPHS=0" "MLX_MAX_OPS_PER_BUFFER=30 MLX_MAX_MB_PER_BUFFER=400" \
           "MLX_MAX_OPS_PER_BUFFER=500 MLX_MAX_MB_PER_BUFFER=8000" \
           "NCCL_GRAPH_REGISTER=0" "NCCL_PROTO=LL"; do for r in 1 2; do
    echo "[$e] run $r: $(env $e $B generate -m "$CK/c8b" --load-format dummy --tp-size 2 -n 256 --ignore-eos -p hello 2>&1 | gen_tps)"
  done; done
  step "host stacks of rank 0 during TP=2 decode (gdb samples; scripts/fold_stacks.py)"
  $B generate -m "$CK/c8b" --load-format dummy --tp-size 2 -n 100000 --ignore-eos -p hello > "$OUT/g-run.log" 2>&1 &
  g=$!
  for _ in $(seq 60); do grep -q "rank 0 (pid" "$OUT/g-run.log" && break; sleep 1; done
  rpid=$(grep -o "rank 0 (pid [0-9]*" "$OUT/g-run.log" | head -1 | grep -o "[0-9]*$")
  GDB=$(command -v gdb || command -v cuda-gdb-minimal || command -v cuda-gdb || echo /usr/local/cuda/bin/cuda-gdb)
  sleep 5
  for i in $(seq ${SAMPLES:-24}); do echo "=== sample $i"
    timeout 20 "$GDB" -p "$rpid" -batch -nx -ex "set pagination off" -ex "thread apply all bt 40" 2>/dev/null | grep -E "^(#|Thread)"
    sleep 0.2; done > "$OUT/tp-rank0-stacks.txt"
  kill $g; wait $g 2>/dev/null
  python3 scripts/fold_stacks.py "$OUT/tp-rank0-stacks.txt" | head -40
  ;;
vocab)
  ngpu=$(nvidia-smi -L | wc -l)
  sizes="2"; [ "$ngpu" -ge 4 ] && sizes="$sizes 4"; [ "$ngpu" -ge 8 ] && sizes="$sizes 8"
  step "decode at batch 1 (generate, dummy weights): MLXCEL_VOCAB_PARALLEL=1 vs 0 alternated, ${RUNS:-2} runs"
  for m in c8b c70b; do for n in $sizes; do
    [ "$m" = c8b ] && [ "$n" != 2 ] && continue
    for r in $(seq ${RUNS:-2}); do for v in 1 0; do
      o=$(MLXCEL_VOCAB_PARALLEL=$v $B generate -m "$CK/$m" --load-format dummy --tp-size $n -n 256 --ignore-eos -p hello 2>&1)
      echo "$m tp=$n vocab-parallel=$v run $r: $(echo "$o" | gen_tps); rank 0 $(echo "$o" | grep -o 'rank 0 (pid[^:]*: weights [0-9.]* GB' | grep -o 'weights.*')"
    done; done
  done; done 2>&1 | tee "$OUT/vocab-parallel-decode.txt"
  [ -f "$CK/8b-bf16/config.json" ] || python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/8b-bf16" --tokenizer-from "$TOK"
  step "seeded sampling, 8B checkpoint TP=2: the same tokens vocab-parallel and replicated"
  for v in 1 0; do
    MLXCEL_VOCAB_PARALLEL=$v $B generate -m "$CK/8b-bf16" --tp-size 2 -n 64 --ignore-eos -p "The history of" \
      --temp 0.8 --top-p 0.9 --seed 7 --json 2>/dev/null | tail -1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["generated_token_ids"])' > "$OUT/vocab-parallel-tokens-$v.txt"
  done
  cmp -s "$OUT/vocab-parallel-tokens-1.txt" "$OUT/vocab-parallel-tokens-0.txt" && echo "tokens: identical" ||
    { echo "tokens DIFFER:"; head -c 400 "$OUT"/vocab-parallel-tokens-*.txt; }
  step "tp-parity 8B bf16, TP=2 vocab-parallel against one process, 256 positions"
  timeout 300 $B tp-parity -m "$CK/8b-bf16" --tp-size 2 --steps 256 2>/dev/null | tee "$OUT/tp-parity-8b-vocab.json"
  ;;
*) echo "unknown: $call (placement, decode, parity, ncu, pipeline, servers, tp-overhead, vocab)" >&2; exit 2 ;;
esac
mark "end"
