#!/usr/bin/env bash
# mlxcel-server on a GPU box (scripts/bench_server.py; docs/server.md).
#   bash scripts/gpu/server.sh bench              # 8B bf16, --parallel 32: one streaming chat, bench at 1/8/32 streams
#   bash scripts/gpu/server.sh knobs SETTING...   # 8B 4-bit dummy weights, --parallel 32, once per setting
#                                                 # (e.g. MLXCEL_QGEMV_CHUNKS=0 X=1): bench at 1/8/32 streams
#   bash scripts/gpu/server.sh compare [B,...]    # 8B bf16 and 4-bit g64 dummy weights: engine (bench --serve-workload)
#                                                 # and server (--parallel max B, --ctx-size 1024) side by side, once
#                                                 # per server token budget in BUDGETS (default 2048; e.g. "512 1024
#                                                 # 2048" to choose the default), and per --max-itl-ratio in
#                                                 # ITL_RATIOS (default "0"; "0 3" A/Bs the cut of prefill beside
#                                                 # decodes); MODELS (default "c8b c8b-q4"); LOGS=1 keeps
#                                                 # the server's log ($OUT/compare-*.log: kernels compiled
#                                                 # after the warm-up, each prefill cut)
#   bash scripts/gpu/server.sh pipeline           # 8B bf16, 1/8 streams, pipelined vs --no-pipeline
#   bash scripts/gpu/server.sh cold               # 8B 4-bit, cold kernel cache: the warm-up takes the compiles
#   bash scripts/gpu/server.sh tp                 # TP=2 (emulated on one GPU): openai client, kill -9 of rank 1
#                                                 # (needs the openai wheels on PYTHONPATH)
# Environment: see scripts/gpu/lib.sh.
. "$(dirname "$0")/lib.sh"
cmd=${1:-bench}; shift || true
case "$cmd" in
bench)
  ckpt
  serve "$CK/8b-bf16" 8123 --parallel 32 --ctx-size 2048 || exit 1
  step "server: one streaming chat request"
  curl -sN localhost:8123/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}' | head -12
  python3 scripts/bench_server.py --port 8123 --concurrency 8,32 --rounds 1 --max-tokens 32 >/dev/null  # warm-up (kernel compilation for each batch size)
  step "server: bench 1/8/32 streams"; python3 scripts/bench_server.py --port 8123 --concurrency 1,8,32 --max-tokens 128 > "$OUT/server-bench.json"
  bench_summary "$OUT/server-bench.json"
  step "memory"; nvidia-smi --query-gpu=index,memory.used --format=csv
  curl -s localhost:8123/metrics | grep -E "^mlxcel:(num_requests|generation_tokens_total|prompt_tokens_total|device)" | head
  unserve
  ;;
compare)
  q4cfg
  levels=${1:-1,8,32,64}
  for m in ${MODELS:-c8b c8b-q4}; do
    for t in ${BUDGETS:-2048}; do
      for r in ${ITL_RATIOS:-0}; do
        step "engine vs server, $m (dummy weights), B = $levels, --max-num-batched-tokens $t --max-itl-ratio $r"
        if [ -n "${LOGS:-}" ]; then
          # the server's log, with each kernel compiled and each prefill cut (debug)
          RUST_LOG=info,mlxcel::mlx::kernel_cache=debug,mlxcel::engine::scheduler=debug \
            python3 scripts/bench_server.py --compare-engine --mlxcel "$B" -m "$CK/$m" --load-format dummy \
            --concurrency "$levels" --warmup 16 --server-log \
            --server-args "--max-queue 256 --max-num-batched-tokens $t --max-itl-ratio $r" \
            2> "$OUT/compare-$m-t$t-r$r.log" | tee "$OUT/compare-$m-t$t-r$r.txt"
          echo "kernels compiled after the warm-up: $(awk '/warmed up/{w=1} w && /kernel cache: compiled/' \
            "$OUT/compare-$m-t$t-r$r.log" | wc -l); prefill cuts: $(grep -c 'prefill cut' "$OUT/compare-$m-t$t-r$r.log")"
        else
          python3 scripts/bench_server.py --compare-engine --mlxcel "$B" -m "$CK/$m" --load-format dummy \
            --concurrency "$levels" --warmup 16 \
            --server-args "--max-queue 256 --max-num-batched-tokens $t --max-itl-ratio $r" |
            tee "$OUT/compare-$m-t$t-r$r.txt"
        fi
      done
    done
  done
  ;;
knobs)
  # file names hold no '=': such files do not come back from the box
  [ $# -gt 0 ] || set -- X=1
  q4cfg
  for e in "$@"; do
    f=$(echo "$e" | tr '= ' '--')
    step "server, 8B 4-bit dummy weights, --parallel 32, $e: bench 1/8/32 streams"
    env $e $S -m "$CK/c8b-q4" --load-format dummy --port 8123 --parallel 32 --ctx-size 2048 > "$OUT/server-$f.log" 2>&1 &
    spid=$!
    for i in $(seq 150); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
    timeout 60 python3 scripts/bench_server.py --port 8123 --concurrency 8,32 --rounds 1 --max-tokens 32 >/dev/null  # warm-up
    timeout 120 python3 scripts/bench_server.py --port 8123 --concurrency 1,8,32 --max-tokens 128 > "$OUT/server-bench-$f.json"
    echo "[$e]"; bench_summary "$OUT/server-bench-$f.json" | tee -a "$OUT/server-knobs.txt"
    unserve
  done
  ;;
pipeline)
  ckpt
  for f in "" --no-pipeline; do
    serve "$CK/8b-bf16" 8125 --parallel 8 --ctx-size 2048 $f || continue
    python3 scripts/bench_server.py --port 8125 --concurrency 1,8 --rounds 1 --max-tokens 32 >/dev/null
    echo "server ${f:-pipelined}:"; python3 scripts/bench_server.py --port 8125 --concurrency 1,8 --max-tokens 128 > "$OUT/server-bench$f.json"
    bench_summary "$OUT/server-bench$f.json"
    unserve
  done
  ;;
cold)
  ckpt
  step "server 4-bit, 8 streams, cold kernel cache: the warm-up at load takes the compiles"
  for f in "" --no-pipeline; do
    MLX_PTX_CACHE_DIR=$(mktemp -d) serve "$CK/8b-q4" 8126 --parallel 8 --ctx-size 2048 $f || continue
    echo "server q4 ${f:-pipelined}:"; python3 scripts/bench_server.py --port 8126 --concurrency 1,8 --max-tokens 128 --rounds 1 > "$OUT/server-cold$f.json"
    python3 -c 'import json,sys; [print(r["concurrency"], round(r["tokens_per_s"],1), "tok/s, inter-token p50", round(r["inter_token_s"]["p50"]*1e3,2), "ms, max", round(r["inter_token_s"]["max"],2), "s") for r in json.load(open(sys.argv[1]))["results"]]' "$OUT/server-cold$f.json"
    unserve
  done
  ;;
tp)
  ckpt
  serve "$CK/8b-bf16" 8124 --parallel 4 --ctx-size 4096 --tp-size 2 --tp-emulate || exit 1
  step "GPU processes while the TP server runs (server pid $spid)"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
  step "openai client + kill -9 of rank 1"; python3 scripts/tp_server_check.py --port 8124 --rank 1 | tee "$OUT/tpserver-check.json"
  unserve
  sleep 1; step "processes left"; pgrep -fa "_rank" || echo "no rank process left"
  ;;
*) echo "unknown: $cmd (bench, knobs, pipeline, cold, tp)" >&2; exit 2 ;;
esac
