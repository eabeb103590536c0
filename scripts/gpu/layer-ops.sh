#!/usr/bin/env bash
# The decode-layer op cuts on one GPU, in one invocation: the fixtures' greedy tokens with
# the default-off paths on (MLXCEL_QGEMV_MLP=1 MLXCEL_ATTN_SINGLE=1), then `mlxcel bench`
# on rank proxies (scripts/rank_proxies.py, dummy weights) with each setting, alternated,
# a line each: decode tok/s at batch 1, host build/eval/wait per token, ops per layer,
# host µs per op (docs/benchmarks.md, "The MLP in one kernel, and the residual add under TP").
#   bash scripts/gpu/layer-ops.sh [NAME...]     # default: 70b-tp8-q4 8b-q4
# Environment (and scripts/gpu/lib.sh's): ROUNDS (2), DECODE tokens (128), LIMIT seconds
# after which no new run starts (540), SETTINGS (space-separated runs, each VAR=value[,VAR=value]),
# SKIP_FIXTURES=1, TINY=1 (toy sizes of the same proxies: a CPU check of the script).
. "$(dirname "$0")/lib.sh"
T0=$SECONDS
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(70b-tp8-q4 8b-q4)
settings=(${SETTINGS:-MLXCEL_POOL_VIEW=0 X=1 MLXCEL_QGEMV_MLP=1 MLXCEL_ATTN_SINGLE=1 MLXCEL_QGEMV_MLP=1,MLXCEL_ATTN_SINGLE=1})
if [ -z "${SKIP_FIXTURES:-}" ]; then
  step "fixtures, MLXCEL_QGEMV_MLP=1 MLXCEL_ATTN_SINGLE=1"
  MLXCEL_QGEMV_MLP=1 MLXCEL_ATTN_SINGLE=1 timeout 90 python3 scripts/check_fixtures.py "$B" -n 12 2>&1 |
    grep -v "ok (" | tail -4 | tee "$OUT/layer-ops-fixtures.txt"
fi
demo_tokenizer
only=$(IFS=,; echo "${names[*]}")
python3 scripts/rank_proxies.py --out "$CK/proxies" --only "$only" --tokenizer-from "$TOK" ${TINY:+--tiny} >/dev/null || exit 1
one() { # one NAME SETTING: a bench run, a line
  pkill -u "$(id -u)" -f "mlxcel _nvrtc" 2>/dev/null # (compile processes a timed-out run left would load the host)
  local f="$OUT/layer-ops-$1-${2//[=,]/-}.json"
  env ${2//,/ } timeout ${BENCH_S:-60} $B bench -m "$CK/proxies/$1" --load-format dummy --prompt-lens 128 \
    --decode-tokens "${DECODE:-128}" --repeats 1 2>/dev/null | tail -1 >"$f"
  python3 - "$f" "$1" "$2" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))["decode"]
except Exception as e:  # noqa: BLE001 (a failed run is a line too)
    print(f"{sys.argv[2]} | {sys.argv[3]} | no result ({e})"); sys.exit()
h = {k: round(v, 3) for k, v in d.get("host_per_token", {}).items()}
print(f"{sys.argv[2]} | {sys.argv[3]} | {d['tokens_per_second']:.1f} tok/s | {h} | "
      f"{d.get('ops_per_layer')} ops/layer | {d.get('host_us_per_op', 0):.2f} host us/op")
PY
}
step "rank proxies: ${names[*]}; settings ${settings[*]}"
for n in "${names[@]}"; do
  for r in $(seq "${ROUNDS:-2}"); do
    for e in "${settings[@]}"; do
      [ $((SECONDS - T0)) -lt "${LIMIT:-540}" ] && one "$n" "$e"
    done
  done
done | tee "$OUT/layer-ops.txt"
