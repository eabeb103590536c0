#!/usr/bin/env bash
# Where a batch-1 decode step's time goes on a GPU box, for the rank proxies
# (scripts/rank_proxies.py; dummy weights) and the dense GEMV's shapes.
#   bash scripts/gpu/decode-profile.sh gemv [FLAGS...]   # Nsight time of the dense GEMV per shape (mlxcel's
#                                                        # launch and epilogue) beside a read-only kernel over
#                                                        # the same bytes (scripts/prof_gemv.py); FLAGS: --sweep,
#                                                        # --only 70B-TP8, --ms 1,3, --source FILE
#   bash scripts/gpu/decode-profile.sh steps NAME...     # Nsight kernel times of STEPS (1) decode steps at batch 1
#                                                        # (mlxcel bench --profile-steps), by kernel kind, per proxy
#   bash scripts/gpu/decode-profile.sh ab NAME...        # mlxcel bench per proxy under each of SETTINGS (default
#                                                        # "X=1 MLXCEL_ATTN_SINGLE=1"; commas join variables),
#                                                        # alternated RUNS (1) times: tok/s, host ms, ops per layer
# Environment: scripts/gpu/lib.sh's; PROXY_DIR (default $CKPT_DIR/proxies), DECODE (256).
. "$(dirname "$0")/lib.sh"
P=${PROXY_DIR:-$CK/proxies}
cmd=${1:-ab}; shift || true
proxies() { # write the named proxies' config.json (once)
  demo_tokenizer
  python3 scripts/rank_proxies.py --out "$P" --only "$(IFS=,; echo "$*")" --tokenizer-from "$TOK" >/dev/null
}
# one bench run: tok/s, host build/eval/wait ms per token, ops per layer, host µs per op
run_line() {
  local e=$1 m=$2
  env ${e//,/ } timeout ${BENCH_S:-300} $B bench -m "$m" --load-format dummy --prompt-lens 128 \
    --decode-tokens ${DECODE:-256} --repeats 1 2>/dev/null | tail -1 | python3 -c 'import json,sys
d=json.load(sys.stdin)["decode"]; h=d.get("host_per_token",{})
print(round(d["tokens_per_second"],1), "tok/s", {k: round(v,3) for k,v in h.items()}, d.get("ops_per_layer"), "ops/layer", round(d.get("host_us_per_op",0),2), "µs/op")'
}
case "$cmd" in
gemv)
  tag=gemv$(echo "$*" | tr -c 'a-zA-Z0-9' '-')
  step "Nsight: prof_gemv.py $*"
  timeout ${NCU_S:-400} ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'gemv|ceiling' \
    python3 scripts/prof_gemv.py "$@" > "$OUT/ncu-$tag.txt" 2>&1 || { echo "ncu failed:"; tail -5 "$OUT/ncu-$tag.txt"; }
  python3 scripts/prof_gemv.py --parse "$OUT/ncu-$tag.txt" | tee "$OUT/ncu-$tag-parsed.txt"
  ;;
steps)
  proxies "$@"
  for n in "$@"; do
    step "Nsight: ${STEPS:-1} decode step(s) at batch 1, $n ${SETTING:-}"
    env ${SETTING:-X=1} timeout ${NCU_S:-300} ncu --profile-from-start off --clock-control none --csv --page raw \
      --metrics gpu__time_duration.sum $B bench -m "$P/$n" --load-format dummy --prompt-lens 128 \
      --decode-tokens 8 --decode-batch 1 --repeats 1 --profile-steps ${STEPS:-1} > "$OUT/ncu-step-$n.csv" 2> "$OUT/ncu-step-$n.err" ||
      { echo "failed:"; tail -3 "$OUT/ncu-step-$n.err"; continue; }
    python3 scripts/ncu_summary.py --totals ${STEPS:-1} "$OUT/ncu-step-$n.csv" | tee "$OUT/ncu-step-$n.txt" | head -20
  done
  ;;
ab)
  proxies "$@"
  step "decode at batch 1, settings ${SETTINGS:-X=1 MLXCEL_ATTN_SINGLE=1} alternated, ${RUNS:-1} run(s)"
  for r in $(seq ${RUNS:-1}); do
    for n in "$@"; do
      for e in ${SETTINGS:-X=1 MLXCEL_ATTN_SINGLE=1}; do
        echo "$n [$e] run $r: $(run_line "$e" "$P/$n")"
      done
    done
  done 2>&1 | tee -a "$OUT/decode-ab.txt"
  ;;
*) echo "unknown: $cmd (gemv, steps, ab)" >&2; exit 2 ;;
esac
