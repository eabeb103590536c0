#!/usr/bin/env bash
# Decode speed of the rank proxies (scripts/rank_proxies.py: one tensor-parallel rank's
# shapes as a single-process model, dummy weights) on one GPU, side by side in one
# invocation: per proxy `mlxcel bench --load-format dummy`, then mlx-lm with the same
# shapes built in memory (scripts/bench_mlx_lm.py --random-weights) twice, with
# MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=4000 (what mlxcel sets on CUDA) and
# with MLX's defaults; then the markdown table (docs/benchmarks.md, "Rank proxies").
#   bash scripts/gpu/rank-proxies.sh [NAME...]   # default: every proxy (rank_proxies.py --list)
# Environment (and scripts/gpu/lib.sh's): PROXY_DIR (default $CKPT_DIR/proxies),
# DECODE tokens (default 256), REPEATS (default 2), RUNS (default 1: rounds, alternated),
# BENCH_S per-run timeout (default 900), SKIP_MLX_LM=1, PY (python with mlx-lm, default
# python3), TINY=1 (toy sizes of the same proxies: a CPU check of the script).
. "$(dirname "$0")/lib.sh"
P=${PROXY_DIR:-$CK/proxies}
PY=${PY:-python3}
names=("$@")
[ ${#names[@]} -gt 0 ] || mapfile -t names < <($PY scripts/rank_proxies.py --list | $PY -c 'import json,sys; [print(json.loads(l)["name"]) for l in sys.stdin]')
only=$(IFS=,; echo "${names[*]}")
demo_tokenizer
$PY scripts/rank_proxies.py --out "$P" --only "$only" --tokenizer-from "$TOK" ${TINY:+--tiny} >/dev/null || exit 1
bench_flags=(--prompt-lens 128 --decode-tokens "${DECODE:-256}" --repeats "${REPEATS:-2}")
one() { # one NAME ENGINE: a run, its JSON line into $OUT/proxy-NAME-ENGINE.json
  local n=$1 e=$2 f="$OUT/proxy-$1-$2.json" cmd
  case $e in
  mlxcel) cmd=($B bench -m "$P/$n" --load-format dummy) ;;
  mlxlm-100) cmd=(env MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=4000
    $PY scripts/bench_mlx_lm.py "$P/$n" --random-weights) ;;
  mlxlm-default) cmd=(env -u MLX_MAX_OPS_PER_BUFFER -u MLX_MAX_MB_PER_BUFFER
    $PY scripts/bench_mlx_lm.py "$P/$n" --random-weights) ;;
  esac
  timeout "${BENCH_S:-900}" "${cmd[@]}" "${bench_flags[@]}" 2>"$f.log" | tail -1 > "$f"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "$n $e: exit $rc; last lines of $f.log:"; tail -3 "$f.log"; }
  $PY -c 'import json,sys; d=json.load(open(sys.argv[1]))["decode"]; print(sys.argv[2], sys.argv[3], round(d["tokens_per_second"],1), "tok/s", {k: round(v,3) for k,v in d.get("host_per_token",{}).items()}, *([d["ops_per_layer"], "ops/layer", round(d["host_us_per_op"],2), "host µs/op"] if "ops_per_layer" in d else []))' "$f" "$n" "$e" 2>/dev/null
}
engines=(mlxcel)
[ -n "${SKIP_MLX_LM:-}" ] || engines+=(mlxlm-100 mlxlm-default)
step "rank proxies (${names[*]}), decode ${DECODE:-256} tokens at batch 1, ${RUNS:-1} round(s)"
for r in $(seq "${RUNS:-1}"); do for n in "${names[@]}"; do for e in "${engines[@]}"; do one "$n" "$e"; done; done; done 2>&1 | tee -a "$OUT/rank-proxies.txt"
step "table (the last round)"
$PY scripts/rank_proxies.py --table "$OUT" --only "$only" | tee "$OUT/rank-proxies.md"
