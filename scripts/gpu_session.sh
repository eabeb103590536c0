#!/usr/bin/env bash
# Runs on a GPU box after `source /root/.mlxcel-gpu/env.sh` (see ../shared/gpu/stage):
# the checks and benchmarks whose output goes into docs/benchmarks.md and issue notes.
#   bash scripts/gpu_session.sh checks   # devices, fixtures vs references, TP parity (ring/NCCL)
#   bash scripts/gpu_session.sh bench8b  # 8B-shape bf16 + 4-bit: mlxcel vs mlx-lm, TP=2 if 2 GPUs
#   bash scripts/gpu_session.sh verify   # kernel check (final kernel, 70B shapes), q4 peak memory, warm-up, server/TP pipelining
#   bash scripts/gpu_session.sh side     # fixtures on GPU, mlxcel vs mlx-lm side by side (4-bit, bf16), qgemv off, pipelined generate
#   bash scripts/gpu_session.sh envsweep # decode under MLX CUDA-graph settings, host time split per token
#   bash scripts/gpu_session.sh verify3  # 70B kernel check, bf16 prefill peak, server warm-up with a cold kernel cache
#   bash scripts/gpu_session.sh ab       # decode of two binaries alternated on one box (MLXCEL_OLD vs MLXCEL)
#   bash scripts/gpu_session.sh session4 check|bench # kernel checks (70B, RoPE, int8 activations); 4-bit A/B, side by side
#   bash scripts/gpu_session.sh session6 check|mma2|final|decode|bench # tensor-core path: checks, Nsight sweeps
#                                        # (v2 vs V1=old kernel file), decode at batch 1-8, server
#   bash scripts/gpu_session.sh session7 ceiling|final|decode|minm  # read-only ceiling; tensor cores with x rounded once per call
#   bash scripts/gpu_session.sh session8 prof|m1|mma|final|decode|check  # Nsight sections of the GEMVs;
#     M = 1 launch shapes; tensor-core variants (VARIANTS=files); mlxcel's launches; decode of
#     binaries OLD vs NEW; kernel check
#   bash scripts/gpu_session.sh ncu      # Nsight kernel times: 4-bit float vs int8 activations, 8-bit, launch shapes
# Multi-GPU runs (2+ GPUs): scripts/multi_gpu.sh.
# MLXCEL=path/to/mlxcel (default .gpu/bin/mlxcel); OUT=results folder (default ./gpu-out).
set -uo pipefail
B=${MLXCEL:-.gpu/bin/mlxcel}
OUT=${OUT:-./gpu-out}
CK=${CKPT_DIR:-/root/ckpt}
mkdir -p "$OUT"
export MLXCEL_CACHE=${MLXCEL_CACHE:-/root/.mlxcel-cache}
ngpu=$(nvidia-smi -L | wc -l)
step() { echo; echo "=== $*"; }
# one decode bench of the 8B 4-bit config (dummy weights) per environment setting, a line
# each: tok/s at batch 1 and at BATCHES (comma-separated), batch 1's host time per token
q4decode() {
  local batches=$1; shift
  for e in "$@"; do
    echo "[$e] $(env $e timeout ${BENCH_S:-150} $B bench -m "$CK/c8b-q4" --load-format dummy --prompt-lens 128 \
      --decode-tokens 256 --decode-batch "$batches" --repeats 1 2>/dev/null | tail -1 | python3 -c 'import json,sys; d=json.load(sys.stdin)
print("b1", round(d["decode"]["tokens_per_second"],1), " ".join("b%d %.1f" % (x["batch"], x["tokens_per_second"]) for x in d["decode_batched"]), "tok/s; b1 host", {k: round(v,3) for k,v in d["decode"]["host_per_token"].items()})')"
  done
}
# ncu kernel times of prof_qgemv.py mode $1 (more args passed on), parsed
ncut() {
  local tag=$1; shift
  timeout ${NCU_S:-200} ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'qgemv|qmv|qmm|gemv|ceiling' \
    python3 scripts/prof_qgemv.py "$@" > "$OUT/ncu-$tag.txt" 2>&1
  python3 scripts/prof_qgemv.py --parse "$OUT/ncu-$tag.txt" | tee "$OUT/ncu-$tag-parsed.txt"
}
# mlxcel-server on the 8B 4-bit dummy config, --parallel 32, once per setting "$@" (VAR=value;
# X=1: the defaults): bench_server.py at 1/8/32 streams after a warm-up, summarised
# (file names hold no '=': such files do not come back from the box)
srvab() {
  local S=${MLXCEL_SERVER:-$(dirname $B)/mlxcel-server} e f
  q4cfg
  for e in "$@"; do
    f=$(echo "$e" | tr '=' '-')
    step "server, 8B 4-bit dummy weights, --parallel 32, $e: bench 1/8/32 streams"
    env $e $S -m "$CK/c8b-q4" --load-format dummy --port 8123 --parallel 32 --ctx-size 2048 > "$OUT/server-$f.log" 2>&1 &
    local spid=$!
    for i in $(seq 150); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
    timeout 60 python3 scripts/bench_server.py --port 8123 --concurrency 8,32 --rounds 1 --max-tokens 32 >/dev/null  # warm-up
    timeout 120 python3 scripts/bench_server.py --port 8123 --concurrency 1,8,32 --max-tokens 128 > "$OUT/server-bench-$f.json"
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); [print(r["concurrency"], "streams:", round(r["tokens_per_s"],1), "tok/s, ttft", round(r["ttft_s"]["mean"],3), "s, inter-token mean/p50/p90 ms", round(r["inter_token_s"]["mean"]*1e3,2), round(r["inter_token_s"]["p50"]*1e3,2), round(r["inter_token_s"]["p90"]*1e3,2)) for r in d["results"]]' "$OUT/server-bench-$f.json" | tee -a "$OUT/server-ab.txt"
    kill -TERM $spid; wait $spid; echo "server exit: $?"
  done
}
# config.json of the 8B shape, 4-bit g64, for --load-format dummy (no weights written)
q4cfg() {
  [ -f "$CK/c8b-q4/config.json" ] && return
  $B generate -n 1 >/dev/null 2>&1
  python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/c8b" \
    --tokenizer-from "$MLXCEL_CACHE/demo-llama-v2" --config-only && python3 - "$CK" <<'PY'
import json, os, shutil, sys
ck = sys.argv[1]; src, dst = f"{ck}/c8b", f"{ck}/c8b-q4"
os.makedirs(dst, exist_ok=True)
for f in os.listdir(src): shutil.copy(f"{src}/{f}", dst)
c = json.load(open(f"{dst}/config.json")); c["quantization"] = {"group_size": 64, "bits": 4}
json.dump(c, open(f"{dst}/config.json", "w"))
PY
}
case "${1:-checks}" in
checks)
  step "nvidia-smi"; nvidia-smi --query-gpu=index,name,memory.used,memory.total,pci.bus_id --format=csv
  step "mlxcel devices"; $B devices
  step "mlxcel devices --check"; $B devices --check
  step "fixtures, one GPU"; python3 scripts/check_fixtures.py $B -n 12
  step "fixtures, --tp-size 2 --tp-emulate (ring, one GPU)"; python3 scripts/check_fixtures.py $B -n 12 --prompts 1 --tp-size 2 --tp-emulate
  step "fixtures, --tp-size 1 --tp-backend nccl"; python3 scripts/check_fixtures.py $B -n 12 --prompts 1 --tp-size 1 --tp-backend nccl
  if [ "$ngpu" -ge 2 ]; then
    step "fixtures, --tp-size 2 (NCCL)"; python3 scripts/check_fixtures.py $B -n 12 --prompts 1 --tp-size 2
    step "NCCL transport with per-rank CUDA_VISIBLE_DEVICES (NCCL_DEBUG=INFO)"
    NCCL_DEBUG=INFO $B generate --tp-size 2 -n 8 --ignore-eos 2>&1 | grep -E "NCCL INFO (Channel|Connected|.*via (P2P|SHM|NET))|P2P|SHM" | head -20
    step "--devices 1,0"; $B generate --tp-size 2 --devices 1,0 -n 4 --ignore-eos 2>&1 | grep -E "rank [01] \(pid" 
  fi
  step "demo generate, one GPU"; $B generate -n 24
  ;;
bench8b)
  [ -f "$CK/8b-bf16/config.json" ] || { $B generate -n 1 >/dev/null 2>&1;
    python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/8b-bf16" --tokenizer-from "$MLXCEL_CACHE/demo-llama-v2"; }
  step "mlxcel bench bf16"; $B bench -m "$CK/8b-bf16" | tee "$OUT/mlxcel-bf16.json"
  step "mlx-lm bench bf16"; python3 scripts/bench_mlx_lm.py "$CK/8b-bf16" | tee "$OUT/mlxlm-bf16.json"
  if [ "$ngpu" -ge 2 ]; then
    step "mlxcel generate --tp-size 2 (NCCL) bf16"; $B generate -m "$CK/8b-bf16" --tp-size 2 -n 128 --ignore-eos -p hello 2>&1 | tail -4
  fi
  step "mlxcel generate --tp-size 2 --tp-emulate bf16"; $B generate -m "$CK/8b-bf16" --tp-size 2 --tp-emulate -n 64 --ignore-eos -p hello 2>&1 | tail -4
  [ -f "$CK/8b-q4/config.json" ] || python3 -m mlx_lm convert --hf-path "$CK/8b-bf16" --mlx-path "$CK/8b-q4" -q --q-group-size 64 --q-bits 4 2>&1 | tail -2
  step "mlxcel bench 4-bit"; $B bench -m "$CK/8b-q4" | tee "$OUT/mlxcel-q4.json"
  step "mlx-lm bench 4-bit"; python3 scripts/bench_mlx_lm.py "$CK/8b-q4" | tee "$OUT/mlxlm-q4.json"
  ;;
ckpt)
  [ -f "$CK/8b-bf16/config.json" ] || { $B generate -n 1 >/dev/null 2>&1;
    python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/8b-bf16" --tokenizer-from "$MLXCEL_CACHE/demo-llama-v2"; }
  [ -f "$CK/8b-q4/config.json" ] || python3 -m mlx_lm convert --hf-path "$CK/8b-bf16" --mlx-path "$CK/8b-q4" -q --q-group-size 64 --q-bits 4 2>&1 | tail -1
  ;;
side)
  [ -f "$CK/8b-bf16/config.json" ] || { $B generate -n 1 >/dev/null 2>&1;
    python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/8b-bf16" --tokenizer-from "$MLXCEL_CACHE/demo-llama-v2"; }
  [ -f "$CK/8b-q4/config.json" ] || python3 -m mlx_lm convert --hf-path "$CK/8b-bf16" --mlx-path "$CK/8b-q4" -q --q-group-size 64 --q-bits 4 2>&1 | tail -1
  step "fixtures, one GPU"; python3 scripts/check_fixtures.py $B -n 12 2>&1 | tail -8
  step "mlxcel vs mlx-lm, same weights"; python3 scripts/bench_side_by_side.py --mlxcel $B "$CK/8b-q4" "$CK/8b-bf16" 2>/dev/null | tee "$OUT/side.txt"
  step "mlxcel 4-bit without its GEMV kernel"; python3 scripts/bench_side_by_side.py --mlxcel $B --skip-mlx-lm --env MLXCEL_QGEMV=0 "$CK/8b-q4" 2>/dev/null | tee -a "$OUT/side.txt"
  step "mlxcel generate: pipelined decode vs --no-pipeline"
  for m in 8b-q4 8b-bf16; do for f in "" --no-pipeline; do
    echo "$m $f: $($B generate -m "$CK/$m" -n 256 --ignore-eos -p hello $f 2>&1 | grep -o 'generated: .*tok/s')"; done; done
  ;;
verify)
  # what the second session of 2026-11-29 changed without a GPU to measure it on
  [ -f "$CK/8b-q4/config.json" ] || bash "$0" ckpt
  [ -n "${SKIP_CHECK:-}" ] || { step "qgemv: final kernel vs quantized_matmul, 8B + 70B shapes"; timeout 240 python3 scripts/check_qgemv.py 2>&1 | tee "$OUT/check-qgemv.txt" | tail -30; }
  step "4-bit prefill peak memory (dequantize ordered after its input); batched decode 2/4/8 (qgemv at M ≤ 4, MLX's kernel at 8)"
  $B bench -m "$CK/8b-q4" --prompt-lens 2048 --decode-batch 2,4,8 --repeats 1 2>/dev/null | tee "$OUT/q4-bench.json"
  $B bench -m "$CK/8b-bf16" --prompt-lens 2048 --decode-batch 2,4,8 --repeats 1 2>/dev/null | tee "$OUT/bf16-bench.json"
  step "generate 4-bit after the load-time warm-up (was 29 tok/s without)"
  for f in "" --no-pipeline; do echo "q4 $f: $($B generate -m "$CK/8b-q4" -n 256 --ignore-eos -p hello $f 2>&1 | grep -E -o 'warmed up.* in [0-9.]+ s|generated: .*tok/s' | tr '\n' ' ')"; done
  step "server: pipelined vs --no-pipeline, 1/8 streams"
  S=${MLXCEL_SERVER:-$(dirname $B)/mlxcel-server}
  for f in "" --no-pipeline; do
    $S -m "$CK/8b-bf16" --port 8125 --parallel 8 --ctx-size 2048 $f > "$OUT/server$f.log" 2>&1 &
    spid=$!
    for i in $(seq 120); do curl -sf localhost:8125/health >/dev/null && break; sleep 1; done
    python3 scripts/bench_server.py --port 8125 --concurrency 1,8 --rounds 1 --max-tokens 32 >/dev/null
    echo "server $f:"; python3 scripts/bench_server.py --port 8125 --concurrency 1,8 --max-tokens 128 | tee "$OUT/server-bench$f.json"
    kill -TERM $spid; wait $spid
  done
  if [ "$ngpu" -ge 2 ]; then
    step "TP=2 over NCCL: pipelined vs --no-pipeline"
    for f in "" --no-pipeline; do echo "tp2 $f: $($B generate -m "$CK/8b-bf16" --tp-size 2 -n 128 --ignore-eos -p hello $f 2>&1 | grep -o 'generated: .*tok/s')"; done
  fi
  ;;
envsweep)
  # MLX's CUDA graph batching (MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER; H100/H200
  # default 30 ops / 400 MB per graph) and graphs off; decode only, host time split per token
  [ -f "$CK/8b-q4/config.json" ] || bash "$0" ckpt
  which nsys ncu 2>&1 | head -3
  for m in ${MODELS:-8b-q4 8b-bf16}; do
    # first: MLX's own H200 values; mlxcel's default is 100 / 4000 (src/cli/mod.rs)
    for e in "MLX_MAX_OPS_PER_BUFFER=30 MLX_MAX_MB_PER_BUFFER=400" "MLX_USE_CUDA_GRAPHS=0" \
             "MLX_MAX_OPS_PER_BUFFER=50 MLX_MAX_MB_PER_BUFFER=4000" "MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=4000" \
             "MLX_MAX_OPS_PER_BUFFER=200 MLX_MAX_MB_PER_BUFFER=4000" "MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=1000"; do
      r=$(env $e $B bench -m "$CK/$m" --prompt-lens 128 --decode-tokens 256 --repeats 2 2>/dev/null | tail -1)
      echo "$m [$e] $(echo "$r" | python3 -c 'import json,sys; d=json.load(sys.stdin)["decode"]; print(round(d["tokens_per_second"],1), "tok/s", {k: round(v,3) for k,v in d["host_per_token"].items()})')"
    done
    [ -n "${SKIP_MLXLM:-}" ] || for e in "X=1" "MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=4000"; do
      echo "mlx-lm $m [$e] $(env $e python3 scripts/bench_mlx_lm.py "$CK/$m" --prompt-lens 128 --decode-tokens 256 --repeats 2 | tail -1 | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["decode"]["tokens_per_second"],1))') tok/s"
    done
  done 2>&1 | tee "$OUT/envsweep.txt"
  ;;
verify3)
  # what the third session of 2026-11-29 could not measure (device time ran out)
  [ -f "$CK/8b-q4/config.json" ] || bash "$0" ckpt
  step "qgemv: final kernel, 70B shapes (the 8B ones and 70B q/k/v passed)"
  timeout 400 python3 scripts/check_qgemv.py --only 70B 2>&1 | tee "$OUT/check-qgemv-70b.txt" | tail -45
  step "bf16 prefill(2048) peak with two layers in flight (was 26.8 GB; mlx-lm 22.5)"
  $B bench -m "$CK/8b-bf16" --prompt-lens 2048 --repeats 2 2>/dev/null | tee "$OUT/bf16-bench.json"
  step "server 4-bit, 8 streams, cold kernel cache: warm-up at load should take the compiles (was a 33.7 s stall)"
  S=${MLXCEL_SERVER:-$(dirname $B)/mlxcel-server}
  for f in "" --no-pipeline; do
    MLX_PTX_CACHE_DIR=$(mktemp -d) $S -m "$CK/8b-q4" --port 8126 --parallel 8 --ctx-size 2048 $f > "$OUT/server3$f.log" 2>&1 &
    spid=$!
    for i in $(seq 180); do curl -sf localhost:8126/health >/dev/null && break; sleep 1; done
    grep -o "warmed up.*" "$OUT/server3$f.log"
    echo "server q4 $f:"; python3 scripts/bench_server.py --port 8126 --concurrency 1,8 --max-tokens 128 --rounds 1 | tee "$OUT/server3-bench$f.json" | python3 -c 'import json,sys; [print(r["concurrency"], round(r["tokens_per_s"],1), "tok/s, inter-token p50", round(r["inter_token_s"]["p50"]*1e3,2), "ms, max", round(r["inter_token_s"]["max"],2), "s") for r in json.load(sys.stdin)["results"]]'
    kill -TERM $spid; wait $spid
  done
  ;;
session4)
  # what the fourth session of 2026-11-29 measured at its end, in two calls (each under
  # 10 minutes): `session4 check` then `session4 bench`; MLXCEL_OLD = the third session's binary
  case "${2:-check}" in
  check)
    ( [ -f "$CK/8b-q4/config.json" ] || bash "$0" ckpt ) > "$OUT/ckpt.log" 2>&1 &
    ck=$!
    step "qgemv --quick (8B q/k/v and down, 4-bit g64, int8 activations)"
    timeout 120 python3 scripts/check_qgemv.py --quick 2>&1 | tee "$OUT/check-qgemv-quick.txt" | tail -22
    step "qgemv: 70B shapes, final kernel"
    timeout ${CHECK_S:-200} python3 scripts/check_qgemv.py --only 70B 2>&1 | tee "$OUT/check-qgemv-70b.txt" | tail -60
    wait $ck
    step "fixtures, one GPU"; timeout 150 python3 scripts/check_fixtures.py $B -n 12 2>&1 | tail -4
    ;;
  bench)
    O=${MLXCEL_OLD:-$(dirname $B)/mlxcel-old}
    step "decode 4-bit: third session's binary, this one with float math (MLXCEL_QGEMV_XQ=0), this one"
    for c in "$O" "env MLXCEL_QGEMV_XQ=0 $B" "$B" "$B"; do
      echo "[$c] $($c bench -m "$CK/8b-q4" --prompt-lens 128 --decode-tokens 256 --repeats 2 2>/dev/null | tail -1 | python3 -c 'import json,sys; d=json.load(sys.stdin)["decode"]; print(round(d["tokens_per_second"],1), "tok/s", {k: round(v,3) for k,v in d["host_per_token"].items()})')"
    done 2>&1 | tee "$OUT/ab.txt"
    step "mlxcel vs mlx-lm, 4-bit"; timeout 200 python3 scripts/bench_side_by_side.py --mlxcel $B "$CK/8b-q4" 2>/dev/null | tee "$OUT/side-q4.txt"
    step "generate 4-bit (load-time warm-up, kernel cache warm)"
    $B generate -m "$CK/8b-q4" -n 256 --ignore-eos -p hello 2>&1 | grep -E -o 'warmed up.*|generated: .*tok/s'
    ;;
  esac
  ;;
session6)
  # the sixth session's tensor-core path (MMA, 4-bit at batch 2-8), two calls under 10
  # minutes each: `session6 check` (kernel checks, Nsight) then `session6 bench` (decode
  # at batch 1-8, MMA on / off / also at batch 1, alternated; a server at 1-8 streams)
  case "${2:-check}" in
  check)
    step "qgemv --quick at M = 1, 2, 4, 8 (tensor cores from M = 3 by default)"
    timeout 150 python3 scripts/check_qgemv.py --quick --ms 1,2,4,8 2>&1 | tee "$OUT/check-quick.txt" | tail -40
    step "qgemv: every 8B shape, M = 2 and 8"
    timeout ${CHECK_S:-200} python3 scripts/check_qgemv.py --only 8B --ms 2,8 2>&1 | tee "$OUT/check-8b.txt" | tail -80
    for mode in defaults mma; do
      step "Nsight: prof_qgemv.py --$mode"
      timeout ${NCU_S:-200} ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'qgemv|qmv|qmm|gemv' \
        python3 scripts/prof_qgemv.py --$mode > "$OUT/ncu-$mode.txt" 2>&1
      python3 scripts/prof_qgemv.py --parse "$OUT/ncu-$mode.txt" | tee "$OUT/ncu-$mode-parsed.txt"
    done
    ;;
  mma2)
    # the second version of the tensor-core path (x rounded by the warp together, loads
    # 2 groups ahead) against the first (V1, a kernel file): check, Nsight at M = 2, 4, 8
    V1=${V1:-$(dirname $B)/qgemv_v1.cu}
    step "qgemv --quick at M = 2, 8"
    timeout 120 python3 scripts/check_qgemv.py --quick --ms 2,8 2>&1 | tee "$OUT/check-quick2.txt" | tail -22
    for src in kernels/qgemv.cu "$V1"; do
      tag=$(basename "$src" .cu)
      step "Nsight: prof_qgemv.py --mma --ms 2,4,8, $src"
      MLXCEL_QGEMV_SOURCE=$src timeout ${NCU_S:-170} ncu --clock-control none --metrics gpu__time_duration.sum \
        -k regex:'qgemv|qmv|qmm|gemv' python3 scripts/prof_qgemv.py --mma --ms 2,4,8 > "$OUT/ncu-mma-$tag.txt" 2>&1
      python3 scripts/prof_qgemv.py --parse "$OUT/ncu-mma-$tag.txt" | tee "$OUT/ncu-mma-$tag-parsed.txt"
    done
    ;;
  decode)
    q4cfg
    step "decode 8B 4-bit (dummy weights), batch 1, 2, 4, 8: MMA from batch 2, off (dp4a to batch 4, MLX above), from batch 5"
    for r in 1 2; do q4decode 2,4,8 "MLXCEL_QGEMV_MMA=0" "MLXCEL_QGEMV_MMA=2" "MLXCEL_QGEMV_MMA=5"; done 2>&1 | tee "$OUT/mma-decode2.txt"
    ;;
  final)
    # the final binary and kernel: the 8B shapes the second version had not run on a GPU
    # (o, gate/up, lm_head) and 70B q/k/v, down at M = 3 and 8; decode at batch 1-8; why
    # the MMA path stalls (ncu sections of one launch each)
    step "qgemv: 8B o, gate/up, lm_head and 70B q/k/v, down at M = 3, 8"
    timeout 170 python3 scripts/check_qgemv.py --only 8B --skip qkv,down --ms 3,8 2>&1 | tee "$OUT/check-final-8b.txt" | grep -E "^\|" | tail -40
    timeout 100 python3 scripts/check_qgemv.py --only 70B --skip o,gate_up,lm_head --ms 8 2>&1 | tee "$OUT/check-final-70b.txt" | grep -E "NO|^\| 70B [a-z_]+ [0-9×]+ \|" | tail -20
    q4cfg
    step "decode 8B 4-bit (dummy weights): final defaults, twice, and MLXCEL_QGEMV_MMA=0"
    q4decode 2,3,4,6,8 "X=1" "MLXCEL_QGEMV_MMA=0" "X=1" 2>&1 | tee "$OUT/decode-final.txt"
    step "ncu sections: gate/up M = 1 (dp4a), 8 (MMA), down M = 8 (MMA)"
    timeout 90 ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
      -k regex:qgemv python3 scripts/prof_qgemv.py --stalls > "$OUT/ncu-stalls.txt" 2>&1
    grep -E "custom_kernel|Duration|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Stall|Warp Cycles Per Issued|DRAM Through|Compute \(SM\)" "$OUT/ncu-stalls.txt" | head -60
    ;;
  bench)
    q4cfg
    step "decode 8B 4-bit (dummy weights), batch 1, 2, 4, 8: MMA default (batch >= 3), off, also at batch 1"
    for r in 1 2; do q4decode 2,4,8 "X=1" "MLXCEL_QGEMV_MMA=0" "MLXCEL_QGEMV_MMA=1"; done 2>&1 | tee "$OUT/mma-decode.txt"
    step "fixtures, one GPU"; timeout 150 python3 scripts/check_fixtures.py $B -n 12 2>&1 | tail -4
    step "server 8B 4-bit (dummy), 1/4/8 streams, MMA default vs off"
    S=${MLXCEL_SERVER:-$(dirname $B)/mlxcel-server}
    for e in "X=1" "MLXCEL_QGEMV_MMA=0"; do
      env $e $S -m "$CK/c8b-q4" --load-format dummy --port 8126 --parallel 8 --ctx-size 2048 > "$OUT/server6.log" 2>&1 &
      spid=$!
      for i in $(seq 150); do curl -sf localhost:8126/health >/dev/null && break; sleep 1; done
      echo "[$e] $(grep -o 'warmed up.*' "$OUT/server6.log" | head -1)"
      python3 scripts/bench_server.py --port 8126 --concurrency 1,4,8 --max-tokens 128 2>&1 | tail -5
      kill $spid; wait $spid 2>/dev/null
    done 2>&1 | tee "$OUT/mma-server.txt"
    ;;
  esac
  ;;
session7)
  # the seventh session's tensor-core path (x rounded once per call, 64-byte weight loads)
  case "${2:-final}" in
  ceiling)
    step "ncu: read-only kernels of each 4-bit shape's bytes"; NCU_S=90 ncut ceiling --ceiling
    ;;
  final)
    step "qgemv --quick at M = 2, 3, 8"
    timeout 150 python3 scripts/check_qgemv.py --quick --ms 2,3,8 2>&1 | tee "$OUT/check-quick.txt" | grep -E "^\||Error|error" | tail -40
    step "qgemv: 8B o, gate/up, lm_head at M = 5, 8; 70B q/k/v, down at M = 8 (groups 32/64/128 on q/k/v)"
    timeout 120 python3 scripts/check_qgemv.py --only 8B --skip qkv,down --ms 5,8 2>&1 | tee "$OUT/check-8b.txt" | grep -E "^\| 8B [a-z_]+ [0-9×]+ \||NO" | tail -20
    timeout 100 python3 scripts/check_qgemv.py --only 70B --skip o,gate_up,lm_head --ms 8 2>&1 | tee "$OUT/check-70b.txt" | grep -E "NO|^\| 70B [a-z_]+ [0-9×]+ \|" | tail -20
    step "ncu: tensor-core ROWS × WPB and dp4a, M = 3, 8"; NCU_S=200 ncut mma --mma --ms 3,8
    ;;
  decode)
    q4cfg
    step "decode 8B 4-bit (dummy weights): defaults, MLXCEL_QGEMV_MMA=0, defaults"
    q4decode 2,3,4,6,8 "X=1" "MLXCEL_QGEMV_MMA=0" "X=1" 2>&1 | tee "$OUT/decode.txt"
    ;;
  minm)
    q4cfg
    step "decode 8B 4-bit (dummy weights), batch 3, 4: tensor cores from batch 3 vs 5, alternated"
    q4decode 3,4 "MLXCEL_QGEMV_MMA=3" "MLXCEL_QGEMV_MMA=5" "MLXCEL_QGEMV_MMA=3" "MLXCEL_QGEMV_MMA=5" 2>&1 | tee "$OUT/decode-minm.txt"
    ;;
  esac
  ;;
session8)
  # the eighth session: where the GEMV's time goes (Nsight sections), M = 1 launch shapes
  case "${2:-prof}" in
  prof)
    step "ncu sections (raw metrics, csv): q/k/v, down at M = 1; q/k/v, o, down, gate/up at M = 8"
    timeout ${NCU_S:-240} ncu --clock-control none -k regex:qgemv -c 16 --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis_Tables --section InstructionStats --page raw --csv \
      python3 scripts/prof_qgemv.py --stalls > "$OUT/ncu-stalls.csv" 2> "$OUT/ncu-stalls.err"
    echo "rc $? lines $(wc -l < "$OUT/ncu-stalls.csv")"; tail -3 "$OUT/ncu-stalls.err"
    python3 scripts/ncu_summary.py "$OUT/ncu-stalls.csv" | tee "$OUT/ncu-stalls-summary.txt"
    ;;
  m1)
    step "ncu: M = 1 dp4a ROWS × WPB"; ncut m1 --m1 --ms 1 ${M1_ARGS:-}
    ;;
  mma)
    # kernel files (VARIANTS, default the tracked one) at M = 8, tensor-core launches CFGS
    for v in ${VARIANTS:-kernels/qgemv.cu}; do
      step "ncu: M = 8 tensor cores, $v"
      MLXCEL_QGEMV_SOURCE=$v NCU_S=${NCU_S:-150} ncut "mma-$(basename "$v" .cu)" --mma --ms ${MS:-8} \
        --cfgs ${CFGS:-16x8,16x16,32x4,32x8}
    done
    ;;
  final)
    step "ncu: mlxcel's launches at M = 1, 5, 8 (4 and 8 bits)"; NCU_S=${NCU_S:-150} ncut defaults --defaults --ms 1,5,8
    ;;
  decode)
    # decode tok/s, 8B 4-bit g64 dummy weights: binaries OLD and NEW alternated
    B=$NEW q4cfg
    step "decode 8B 4-bit: $OLD vs $NEW, alternated, batches ${BATCHES:-4,5,8}"
    for b in "$OLD" "$NEW" "$OLD" "$NEW"; do
      echo "--- $b"; B=$b BENCH_S=${BENCH_S:-100} q4decode "${BATCHES:-4,5,8}" X=1
    done 2>&1 | tee "$OUT/decode.txt"
    ;;
  check)
    step "qgemv --quick at M = 1, 5, 8; groups 32, 128 at M = 5, 8; 70B q/k/v at M = 8 (groups 32/64/128)"
    timeout 150 python3 scripts/check_qgemv.py --quick --ms 1,5,8 2>&1 | tee "$OUT/check-quick.txt" | grep -E "^\||Error|error|NO" | tail -30
    timeout 120 python3 scripts/check_qgemv.py --quick --configs 4g32,4g128 --ms 5,8 2>&1 | tee "$OUT/check-groups.txt" | grep -E "^\| 8B|Error|error|NO" | tail -30
    timeout 120 python3 scripts/check_qgemv.py --only 70B --skip o,gate_up,down,lm_head --ms 8 2>&1 | tee "$OUT/check-70b.txt" | grep -E "NO|^\| 70B [a-z_]+ [0-9×]+ \||Error" | tail -12
    ;;
  esac
  ;;
session9)
  # the ninth session: host cost per op; the GEMV header passed to MLX as an #include
  case "${2:-include}" in
  include)
    step "host cost per MLX op (scripts/op_costs.py)"
    timeout 120 python3 scripts/op_costs.py 2>&1 | tee "$OUT/op-costs.txt"
    q4cfg
    step "decode 8B 4-bit: GEMV header inline (MLXCEL_KERNEL_INCLUDE=0) vs #include (default), alternated"
    for r in 1 2 3; do BENCH_S=${BENCH_S:-100} q4decode "${BATCHES:-4,8}" MLXCEL_KERNEL_INCLUDE=0 X=1; done 2>&1 | tee "$OUT/decode-include.txt"
    step "fixtures vs references"
    timeout 200 python3 scripts/check_fixtures.py $B -n 12 2>&1 | tail -15 | tee "$OUT/fixtures.txt"
    ;;
  attn)
    step "decode attention kernel vs float32 reference and MLX's sdpa (scripts/check_attn.py)"
    timeout 200 python3 scripts/check_attn.py 2>&1 | tee "$OUT/check-attn.txt"
    step "GPU time per call (ncu)"
    timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/check_attn.py --marks > "$OUT/ncu-attn.txt" 2>&1
    python3 scripts/check_attn.py --parse "$OUT/ncu-attn.txt" | tee "$OUT/ncu-attn-parsed.txt"
    ;;
  decode)
    # batched decode steps: mlxcel's attention kernel (default) vs MLX's sdpa on views (MLXCEL_ATTN=0), alternated
    q4cfg
    step "decode 8B 4-bit: MLXCEL_ATTN=0 vs default, alternated"
    for r in 1 2 3; do BENCH_S=${BENCH_S:-100} q4decode "${BATCHES:-4,8}" MLXCEL_ATTN=0 X=1; done 2>&1 | tee "$OUT/decode-attn.txt"
    step "decode 8B 4-bit at 2048 positions: MLXCEL_ATTN=0 vs default"
    for e in MLXCEL_ATTN=0 X=1; do
      echo "[$e] $(env $e timeout 100 $B bench -m "$CK/c8b-q4" --load-format dummy --prompt-lens 2048 --decode-tokens 256 --repeats 1 2>/dev/null | tail -1 | python3 -c 'import json,sys; d=json.load(sys.stdin)["decode"]; print(round(d["tokens_per_second"],1), "tok/s", {k: round(v,3) for k,v in d["host_per_token"].items()})')"
    done 2>&1 | tee -a "$OUT/decode-attn.txt"
    step "generate agrees: 8B 4-bit dummy weights, greedy, MLXCEL_ATTN=0 vs default"
    for e in MLXCEL_ATTN=0 X=1; do env $e timeout 100 $B generate -m "$CK/c8b-q4" --load-format dummy -p "The capital of France is" -n 48 --ignore-eos --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["generated_token_ids"])'; done 2>&1 | tee -a "$OUT/decode-attn.txt"
    ;;
  esac
  ;;
session10)
  # the tenth session: the streaming M = 1 GEMV (cp.async ring of row groups, a grid of PG blocks)
  case "${2:-stream}" in
  stream)
    step "kernel check at M = 1 (the streaming path at 4 bits), 8B shapes, all epilogues, RoPE"
    timeout 200 python3 scripts/check_qgemv.py --only 8B --ms 1 2>&1 | tail -60 | tee "$OUT/check-stream.txt"
    step "Nsight: the dp4a launch vs streaming ROWS x WPB x PG, 8B shapes, M = 1"
    NCU_S=${NCU_S:-330} ncut stream --stream --pgs ${PGS:-264,396,528,792}
    ;;
  down)
    step "kernel check at M = 1, down projections (streaming), 8B and 70B"
    timeout 150 python3 scripts/check_qgemv.py --skip qkv,o,gate_up,lm_head --ms 1 --configs 4g64,4g32,4g128 2>&1 | tail -30 | tee "$OUT/check-down.txt"
    step "Nsight: the dp4a launch vs streaming, down projections 8B and 70B, M = 1"
    NCU_S=${NCU_S:-150} ncut down --stream --70b --ks 14336,28672 --pgs ${PGS:-132,264,396}
    ;;
  final)
    step "Nsight: tensor-core down projections at M = 5, 8 with 14 / 16 / 8 warps (8B, 70B)"
    NCU_S=120 ncut mmadown --mma --70b --ms 5,8 --ks 14336,28672 --cfgs 16x14,16x16,16x8
    srvab MLXCEL_ATTN=0 X=1
    ;;
  chunks)
    # batches of 9-32 rows: the kernel on row chunks of <= 8 (default) vs MLX (MLXCEL_QGEMV_CHUNKS=0)
    q4cfg
    step "decode 8B 4-bit at batches 8/12/16/32: MLXCEL_QGEMV_CHUNKS=0 vs default, alternated"
    for r in 1 2; do BENCH_S=150 q4decode "${BATCHES:-8,12,16,32}" MLXCEL_QGEMV_CHUNKS=0 X=1; done 2>&1 | tee "$OUT/decode-chunks.txt"
    srvab MLXCEL_QGEMV_CHUNKS=0 X=1
    ;;
  decode)
    q4cfg
    step "decode 8B 4-bit: MLXCEL_QGEMV_STREAM=0 vs default (and STREAM_BLOCKS), alternated"
    for r in 1 2 3; do BENCH_S=100 q4decode "${BATCHES:-4}" MLXCEL_QGEMV_STREAM=0 X=1 ${EXTRA:-}; done 2>&1 | tee "$OUT/decode-stream.txt"
    step "generate agrees: 8B 4-bit dummy weights, greedy, MLXCEL_QGEMV_STREAM=0 vs default"
    for e in MLXCEL_QGEMV_STREAM=0 X=1; do env $e timeout 100 $B generate -m "$CK/c8b-q4" --load-format dummy -p "The capital of France is" -n 32 --ignore-eos --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["generated_token_ids"])'; done 2>&1 | tee -a "$OUT/decode-stream.txt"
    step "fixtures vs references"
    timeout 200 python3 scripts/check_fixtures.py $B -n 12 2>&1 | tail -15 | tee "$OUT/fixtures.txt"
    ;;
  esac
  ;;
ncu)
  # kernel times by Nsight Compute: every 8B shape, 4-bit with float math and with int8
  # activations, 8-bit, launch shapes ROWS × WPB; then the parsed table
  timeout ${NCU_S:-500} ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'qgemv|qmv' \
    python3 scripts/prof_qgemv.py > "$OUT/ncu.txt" 2>&1
  python3 scripts/prof_qgemv.py --parse "$OUT/ncu.txt" | tee "$OUT/ncu-parsed.txt"
  ;;
ab)
  # box-to-box spread is ±15%, so a change is judged against the old binary on the same box,
  # alternating runs; MODELS (default 8b-q4), RUNS (default 2)
  [ -f "$CK/8b-q4/config.json" ] || bash "$0" ckpt
  O=${MLXCEL_OLD:-$(dirname $B)/mlxcel-old}
  for m in ${MODELS:-8b-q4}; do for r in $(seq ${RUNS:-2}); do for bin in $O $B; do
    echo "$m $(basename $bin) run $r: $($bin bench -m "$CK/$m" --prompt-lens 128 --decode-tokens 256 --repeats 2 2>/dev/null | tail -1 | python3 -c 'import json,sys; d=json.load(sys.stdin)["decode"]; print(round(d["tokens_per_second"],1), "tok/s", {k: round(v,3) for k,v in d["host_per_token"].items()})')"
  done; done; done 2>&1 | tee -a "$OUT/ab.txt"
  ;;
bench)
  for m in 8b-bf16 8b-q4; do
    step "mlxcel bench $m"; $B bench -m "$CK/$m" --repeats 3 2>/dev/null | tee "$OUT/mlxcel-$m.json"
    step "mlx-lm bench $m"; python3 scripts/bench_mlx_lm.py "$CK/$m" --repeats 3 | tee "$OUT/mlxlm-$m.json"
  done
  ;;
tpserver)
  # needs the openai wheels (carry .whl, pip install --target /tmp/site, PYTHONPATH)
  S=${MLXCEL_SERVER:-$(dirname $B)/mlxcel-server}
  $S -m "$CK/8b-bf16" --port 8124 --parallel 4 --ctx-size 4096 --tp-size 2 --tp-emulate > "$OUT/tpserver.log" 2>&1 &
  spid=$!
  for i in $(seq 180); do curl -sf localhost:8124/health >/dev/null && break; sleep 1; done
  step "GPU processes while the TP server runs (server pid $spid)"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
  step "openai client + kill -9 of rank 1"; python3 scripts/tp_server_check.py --port 8124 --rank 1 | tee "$OUT/tpserver-check.json"
  kill -TERM $spid; wait $spid; echo "server exit: $?"
  sleep 1; step "processes left"; pgrep -fa "_rank" || echo "no rank process left"
  ;;
parity)
  # issue: multi-GPU validation, run 2 (needs >= 2 GPUs for NCCL; --tp-emulate otherwise)
  step "tp-parity 8B bf16, 256 teacher-forced positions"
  $B tp-parity -m "$CK/8b-bf16" --tp-size ${TP:-2} --steps 256 2>/dev/null | tee "$OUT/tp-parity.json"
  ;;
server)
  S=${MLXCEL_SERVER:-$(dirname $B)/mlxcel-server}
  $S -m "$CK/8b-bf16" --port 8123 --parallel 32 --ctx-size 2048 > "$OUT/server.log" 2>&1 &
  spid=$!
  for i in $(seq 120); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
  step "server: one streaming chat request"
  curl -sN localhost:8123/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}' | head -12
  python3 scripts/bench_server.py --port 8123 --concurrency 8,32 --rounds 1 --max-tokens 32 >/dev/null  # warm-up (kernel compilation for each batch size)
  step "server: bench 1/8/32 streams"; python3 scripts/bench_server.py --port 8123 --concurrency 1,8,32 --max-tokens 128 | tee "$OUT/server-bench.json"
  step "memory"; nvidia-smi --query-gpu=index,memory.used --format=csv
  curl -s localhost:8123/metrics | grep -E "^mlxcel:(num_requests|generation_tokens_total|prompt_tokens_total|device)" | head
  kill -TERM $spid; wait $spid; echo "server exit: $?"
  ;;
esac
