#!/usr/bin/env bash
# Constrained decoding speed on a GPU box: decode tok/s with a JSON schema
# (scripts/bench_schema.json) vs unconstrained, side by side at 1 and 32 streams, on the
# default model (SmolLM2-135M-Instruct Q4_1 GGUF: a real 49k-token vocabulary, so the
# masks cost what they do in use). Target (docs/server.md): constrained >= 90% of
# unconstrained at both levels.
#   bash scripts/gpu/schema.sh bench      # --parallel 32: scripts/bench_server.py --response-format, RUNS (2) runs
#   bash scripts/gpu/schema.sh nopipe     # the same once with --no-pipeline (masks between steps, for reference)
#   bash scripts/gpu/schema.sh defer      # servers with MLXCEL_DEFER_MASKS=1 and =0 alternated, RUNS (2) each
#                                         # (docs/tuning.md), one compare per server
#   bash scripts/gpu/schema.sh ab         # servers with each of SETTINGS ("A=1 A=0,B=2": space-separated, commas
#                                         # join variables; X=1 the defaults) in turn, RUNS (2) rounds
#   bash scripts/gpu/schema.sh engine     # the engine alone, no HTTP: mlxcel bench-masks --engine (32 requests
#                                         # without and with the schema alternated, RUNS (2) pairs after a warm-up pair;
#                                         # decode rate and engine-thread ms per step by part) and the host's mask costs
#   bash scripts/gpu/schema.sh all        # bench, nopipe
# The model must be staged first (no network on the box): scripts/gpu/gguf.sh's header
# (stage here, send .gpu/g1 then .gpu/g2). Environment: see scripts/gpu/lib.sh;
# MAX_TOKENS (256) tokens per request, LEVELS (1,32), ROUNDS (2) requests per stream, PAIRS (1) unconstrained/schema
# pairs alternated per level (more pairs: drift on a shared host hits both sides alike).
. "$(dirname "$0")/lib.sh"
G=$MLXCEL_CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$G" ] || { echo "no $G: stage it with scripts/gpu/gguf.sh (see its header)"; exit 3; }
cmd=${1:-all}; shift || true

# one side-by-side run against the server on PORT: compare TAG PORT
compare() {
  local tag=$1 port=$2
  timeout ${BENCH_S:-400} python3 scripts/bench_server.py --port "$port" --chat \
    --concurrency "${LEVELS:-1,32}" --rounds "${ROUNDS:-2}" --pairs "${PAIRS:-1}" --max-tokens "${MAX_TOKENS:-256}" --warmup 16 \
    --response-format scripts/bench_schema.json > "$OUT/schema-$tag.json" || { echo "bench failed"; return 1; }
  python3 - "$OUT/schema-$tag.json" <<'PY' | tee -a "$OUT/schema.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for c in d["comparison"]:
    (u, k), (du, dk) = c["tokens_per_s"], c["decode_tokens_per_s"]
    print(f'{c["concurrency"]:>3} streams: unconstrained {u:8.1f} tok/s (decode {du:8.1f}), '
          f'schema {k:8.1f} tok/s (decode {dk:8.1f}); ratio {c["ratio_tokens_per_s"]:.3f}, '
          f'decode ratio {c["ratio_decode"]:.3f}; pipelined steps {c["pipelined_steps"]}; errors {c["errors"]}')
    if c.get("pairs", 1) > 1:
        print(f'      {c["pairs"]} alternated pairs: ratio per pair ' + " ".join(f"{r:.3f}" for r in c["ratio_per_pair"])
              + f'; median {c["ratio_median"]:.3f}')
    for tag, h in zip(("unconstrained", "schema"), c.get("host_ms_per_step") or []):
        if h:
            print(f'      engine thread ms per step, {tag}: ' + ", ".join(f"{k} {v:.2f}" for k, v in h.items()))
PY
}

bench() {
  serve "$G" 8131 --parallel 32 --ctx-size 2048 ${SERVER_FLAGS:-} || return 1
  for r in $(seq ${RUNS:-2}); do step "schema vs unconstrained, run $r"; echo "[pipelined, run $r]" >> "$OUT/schema.txt"; compare "run$r" 8131; done
  unserve
}

nopipe() {
  serve "$G" 8132 --parallel 32 --ctx-size 2048 --no-pipeline || return 1
  step "schema vs unconstrained, --no-pipeline"; echo "[--no-pipeline]" >> "$OUT/schema.txt"; compare nopipe 8132
  unserve
}

defer() {
  for r in $(seq ${RUNS:-2}); do for d in 1 0; do
    MLXCEL_DEFER_MASKS=$d serve "$G" 8133 --parallel 32 --ctx-size 2048 ${SERVER_FLAGS:-} || continue
    step "schema vs unconstrained, MLXCEL_DEFER_MASKS=$d, run $r"
    echo "[MLXCEL_DEFER_MASKS=$d, run $r]" >> "$OUT/schema.txt"; compare "defer$d-run$r" 8133
    unserve
  done; done
}

# servers with each of SETTINGS (space-separated; one setting is VAR=value[,VAR=value...],
# X=1 for the defaults) in turn, RUNS (2) rounds, one compare per server
ab() {
  local set
  for r in $(seq ${RUNS:-2}); do for set in ${SETTINGS:-MLXCEL_SAMPLE_FIRST=1 MLXCEL_SAMPLE_FIRST=0}; do
    env ${set//,/ } bash -c true || continue
    spid=; eval "$(printf 'export %s; ' ${set//,/ })" 2>/dev/null
    serve "$G" 8134 --parallel 32 --ctx-size 2048 ${SERVER_FLAGS:-} || { unset_settings "$set"; continue; }
    unset_settings "$set"
    step "schema vs unconstrained, $set, run $r"
    echo "[$set, run $r]" >> "$OUT/schema.txt"; compare "ab-${set//[^A-Za-z0-9]/_}-run$r" 8134
    unserve
  done; done
}
unset_settings() { local v; for v in ${1//,/ }; do unset "${v%%=*}"; done; }

engine() {
  step "engine alone: mlxcel bench-masks --engine, $MAX_TOKENS_E tokens, RUNS ${RUNS:-2}"
  timeout ${BENCH_S:-400} $B bench-masks -m "$G" --engine --max-tokens "$MAX_TOKENS_E" --runs "${RUNS:-2}" \
    > "$OUT/schema-engine.json" 2> "$OUT/schema-engine.log"
  local rc=$?
  [ $rc = 0 ] || { echo "bench-masks failed (exit $rc; 124: past BENCH_S ${BENCH_S:-400} s):"; tail -5 "$OUT/schema-engine.log"; return 1; }
  python3 - "$OUT/schema-engine.json" <<'PY' | tee -a "$OUT/schema.txt"
import json, sys
d = json.load(open(sys.argv[1]))
p = d["per_step_ms"]
print(f'[engine alone, {d["streams"]} streams] host ({d["cores"]} cores, {d["mask_threads"]} mask threads): '
      f'mask {d["mask_us_per_seq"]["mean"]:.1f} us/seq (p50 {d["mask_us_per_seq"]["p50"]:.1f}), '
      f'all masks {p["masks"]["mean"]:.3f} ms/step, grammar advances {p["accept"]["mean"]:.3f} ms/step')
runs = d["engine"]["runs"]
for plain, schema in zip(runs[0::2], runs[1::2]):
    parts = lambda r: ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step"].items())
    print(f'  run {plain["run"]}: unconstrained {plain["tokens_per_second"]:8.1f} tok/s, schema '
          f'{schema["tokens_per_second"]:8.1f} tok/s; ratio {schema["tokens_per_second"] / plain["tokens_per_second"]:.3f}')
    print(f'      engine thread ms per step, unconstrained: {parts(plain)}')
    print(f'      engine thread ms per step, schema: {parts(schema)}')
PY
}

MAX_TOKENS_E=${MAX_TOKENS:-256}
case "$cmd" in
bench) bench ;;
engine) engine ;;
defer) defer ;;
ab) ab ;;
nopipe) nopipe ;;
all) bench; nopipe ;;
*) echo "unknown subcommand $cmd (see the header)"; exit 2 ;;
esac
