# Shared by the scripts/gpu/ entry points (sourced, not run). On a GPU box after
# `source /root/.mlxcel-gpu/env.sh`. MLXCEL=path/to/mlxcel (default .gpu/bin/mlxcel),
# MLXCEL_SERVER (default: mlxcel-server beside it), OUT=results folder (default ./gpu-out),
# CKPT_DIR=checkpoints (default /root/ckpt). KERNEL_CACHE_TGZ=a tarball of an earlier box's
# compiled kernels (`save_kernel_cache` writes one under $OUT; carry it, e.g. in .gpu/kc/):
# unpacked into $MLXCEL_CACHE once, so a fresh box skips the warm-up compiles of the same
# kernels (entries are keyed by kernel source, GPU and versions; others are compiled anew).
set -uo pipefail
B=${MLXCEL:-.gpu/bin/mlxcel}
S=${MLXCEL_SERVER:-$(dirname "$B")/mlxcel-server}
OUT=${OUT:-./gpu-out}
CK=${CKPT_DIR:-/root/ckpt}
mkdir -p "$OUT" "$CK"
export MLXCEL_CACHE=${MLXCEL_CACHE:-/root/.mlxcel-cache}
TOK=$MLXCEL_CACHE/demo-llama-v2
# (once per box: entries compiled here already are kept)
if [ -n "${KERNEL_CACHE_TGZ:-}" ] && [ -f "$KERNEL_CACHE_TGZ" ] && [ ! -f "$MLXCEL_CACHE/.kernel-cache-seeded" ]; then
  mkdir -p "$MLXCEL_CACHE" && tar -C "$MLXCEL_CACHE" --skip-old-files -xzf "$KERNEL_CACHE_TGZ" &&
    touch "$MLXCEL_CACHE/.kernel-cache-seeded" && echo "kernel cache from $KERNEL_CACHE_TGZ"
fi
# the compiled-kernel cache as a tarball under $OUT (to carry to the next box)
save_kernel_cache() { [ -d "$MLXCEL_CACHE/cuda-kernels" ] && tar -C "$MLXCEL_CACHE" -czf "$OUT/kernel-cache.tgz" cuda-kernels; }
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
step() { echo; echo "=== $(date +%T) $*"; }

# the demo model's tokenizer (written by the first generate), for the random checkpoints
demo_tokenizer() { [ -f "$TOK/tokenizer.json" ] || $B generate -m demo -n 1 >/dev/null 2>&1; }

# 8B-shape checkpoints: bf16 written with random weights, 4-bit g64 converted by mlx-lm
ckpt() {
  demo_tokenizer
  [ -f "$CK/8b-bf16/config.json" ] ||
    python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/8b-bf16" --tokenizer-from "$TOK"
  [ -f "$CK/8b-q4/config.json" ] ||
    python3 -m mlx_lm convert --hf-path "$CK/8b-bf16" --mlx-path "$CK/8b-q4" -q --q-group-size 64 --q-bits 4 2>&1 | tail -1
}

# config.json of the 8B shape, bf16 (c8b) and BITS-bit g64 (c8b-q4, c8b-q8), for
# --load-format dummy: qcfg BITS (q4cfg, q8cfg)
qcfg() {
  local bits=$1
  [ -f "$CK/c8b-q$bits/config.json" ] && return
  demo_tokenizer
  [ -f "$CK/c8b/config.json" ] || python3 scripts/make_random_checkpoint.py --shape llama3-8b --out "$CK/c8b" \
    --tokenizer-from "$TOK" --config-only || return
  python3 - "$CK" "$bits" <<'PY'
import json, os, shutil, sys
ck, bits = sys.argv[1], int(sys.argv[2]); src, dst = f"{ck}/c8b", f"{ck}/c8b-q{bits}"
os.makedirs(dst, exist_ok=True)
for f in os.listdir(src): shutil.copy(f"{src}/{f}", dst)
c = json.load(open(f"{dst}/config.json")); c["quantization"] = {"group_size": 64, "bits": bits}
json.dump(c, open(f"{dst}/config.json", "w"))
PY
}
q4cfg() { qcfg 4; }
q8cfg() { qcfg 8; }

# one `mlxcel bench` line: decode tok/s at batch 1 and at the comma-separated batches (each
# with its host build + eval + wait ms a step), batch 1's host time per token. bench_line ENV
# MODEL BATCHES [bench flags...]; ENV: VAR=value settings for this run (X=1: none);
# DECODE_TOKENS (256) per decode run
bench_line() {
  local e=$1 m=$2 batches=$3; shift 3
  env $e timeout ${BENCH_S:-150} $B bench -m "$m" --prompt-lens 128 --decode-tokens ${DECODE_TOKENS:-256} --decode-batch "$batches" \
    --repeats 1 "$@" 2>/dev/null | tail -1 | python3 -c 'import json,sys; d=json.load(sys.stdin)
h = lambda x: " (host %.2f+%.2f+%.2f ms)" % tuple(x["host_per_step"][k] for k in ("build_ms", "eval_ms", "wait_ms")) if "host_per_step" in x else ""
print("b1", round(d["decode"]["tokens_per_second"],1), " ".join("b%d %.1f%s" % (x["batch"], x["tokens_per_second"], h(x)) for x in d["decode_batched"]), "tok/s; b1 host", {k: round(v,3) for k,v in d["decode"]["host_per_token"].items()}, *([d["decode"]["ops_per_layer"], "ops/layer"] if "ops_per_layer" in d["decode"] else []))'
}

# decode of the 8B 4-bit config (dummy weights) once per environment setting (X=1: the
# defaults), a line each: q4decode BATCHES SETTING...
q4decode() {
  local batches=$1 e; shift
  q4cfg
  for e in "$@"; do echo "[$e] $(bench_line "$e" "$CK/c8b-q4" "$batches" --load-format dummy)"; done
}

# Nsight Compute kernel times of scripts/prof_qgemv.py ($1: tag of the output files;
# the rest: prof_qgemv.py's flags), parsed into a table
ncut() {
  local tag=$1; shift
  timeout ${NCU_S:-200} ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'qgemv|qmv|qmm|gemv|ceiling' \
    python3 scripts/prof_qgemv.py "$@" > "$OUT/ncu-$tag.txt" 2>&1
  python3 scripts/prof_qgemv.py --parse "$OUT/ncu-$tag.txt" | tee "$OUT/ncu-$tag-parsed.txt"
}

# start mlxcel-server in the background: serve MODEL PORT FLAGS...; waits for /health
serve() {
  local m=$1 port=$2; shift 2
  $S -m "$m" --port "$port" "$@" > "$OUT/server-$port.log" 2>&1 &
  spid=$!
  for _ in $(seq 400); do curl -sf "localhost:$port/health" >/dev/null && break
    kill -0 $spid 2>/dev/null || { echo "server exited:"; tail -5 "$OUT/server-$port.log"; return 1; }; sleep 1; done
  grep -o "warmed up.*" "$OUT/server-$port.log" | head -1
}
# stop it: SIGTERM, then SIGKILL if it has not exited within 15 s (a server stuck in a step
# would otherwise hold the GPU through every later run)
unserve() {
  kill -TERM $spid 2>/dev/null
  for _ in $(seq 30); do kill -0 $spid 2>/dev/null || break; sleep 0.5; done
  kill -0 $spid 2>/dev/null && { echo "server did not stop: SIGKILL"; kill -KILL $spid; }
  wait $spid; echo "server exit: $?"
}

# scripts/bench_server.py summarised: bench_summary FILE.json
# (a level whose requests failed says how many and the first error)
bench_summary() {
  python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    line = f'{r["concurrency"]} streams: {round(r["tokens_per_s"], 1)} tok/s'
    if r["ttft_s"] and r["inter_token_s"]:
        it = r["inter_token_s"]
        line += f', ttft {round(r["ttft_s"]["mean"], 3)} s, inter-token mean/p50/p90 ms ' + " ".join(
            str(round(it[k] * 1e3, 2)) for k in ("mean", "p50", "p90"))
    if r.get("errors"):
        line += f', {r["errors"]} of {r["requests"]} requests failed: {r["first_error"]}'
    print(line)
PY
}
