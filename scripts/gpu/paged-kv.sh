#!/usr/bin/env bash
# The paged KV cache's targets on one GPU (8B shape, dummy weights; docs/benchmarks.md,
# "Paged KV cache", says what each shows). Two binaries: MLXCEL_OLD (default:
# mlxcel-old beside $MLXCEL, e.g. main's build) with its server MLXCEL_OLD_SERVER (default
# mlxcel-server-old beside it), and the new MLXCEL / MLXCEL_SERVER.
#   bash scripts/gpu/paged-kv.sh concurrency  # the same KV memory (KV_GB, default 17.18 = 16 × 8192
#                                             # tokens of 8B bf16): old at --parallel 16 --ctx-size 8192,
#                                             # new at --kv-cache-gb KV_GB --parallel 256 --ctx-size 8192;
#                                             # N (default 200) 512-token conversations (128 prompt + 384
#                                             # generated) at once: running gauge, preemptions
#   bash scripts/gpu/paged-kv.sh prefix       # a 2,000-token shared prefix: the first request's time to
#                                             # its token vs the later ones', new binary with and without
#                                             # prefix caching, and the old binary
#   bash scripts/gpu/paged-kv.sh decode       # decode tok/s at batch 1 and 32, old and new alternated
#                                             # RUNS (default 3) times: mlxcel bench (8B 4-bit and bf16)
#                                             # and the server (bench_server.py, concurrency 1 and 32;
#                                             # bf16, or SERVER_MODEL: the old binary has no kernel
#                                             # cache, and a 4-bit server warms up for ~2 minutes;
#                                             # SERVER=0: the engine only; ENGINE=0: the
#                                             # server only; NEW_FLAGS: the new server's flags, default
#                                             # none: --gpu-memory-utilization 0.9). After each server:
#                                             # its KV pool and MLX limits (log), peak memory, KV pool
#                                             # copies and preemptions (/metrics); at the end the means
#                                             # per level, new/old, and the failed requests
#   bash scripts/gpu/paged-kv.sh kernel       # scripts/check_attn.py at block sizes 32 and 64, and in float16
#   bash scripts/gpu/paged-kv.sh builds       # decode at batch 32 of each build in BUILDS (mlxcel binaries,
#                                             # e.g. the merges between old and new), 8B 4-bit; then
#                                             # old and new with each setting of SETTINGS (VAR=value ...);
#                                             # then bf16 for each of BF16_BUILDS (default: old and new)
#   bash scripts/gpu/paged-kv.sh all
# Environment: see scripts/gpu/lib.sh.
. "$(dirname "$0")/lib.sh"
O=${MLXCEL_OLD:-$(dirname "$B")/mlxcel-old}
OS=${MLXCEL_OLD_SERVER:-$(dirname "$O")/mlxcel-server-old}
NEW_S=$S
KV_GB=${KV_GB:-17.18}
N=${N:-200}
PORT=${PORT:-18480}
cmd=${1:-all}; shift || true

# config.json of the 8B shape, bf16 and 4-bit (dummy weights)
q4cfg
BF=$CK/c8b Q4=$CK/c8b-q4
VOCAB=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$BF/config.json")

concurrency() {
  step "concurrency at the same KV memory ($KV_GB GB), $N conversations of 128 + 384 tokens"
  S=$OS serve "$BF" $PORT --load-format dummy --ctx-size 8192 --parallel 16 --max-queue 1024 &&
    echo "old, fixed slots (--parallel 16 --ctx-size 8192): $(python3 scripts/paged_kv_check.py concurrency --port $PORT --vocab $VOCAB -n $N)" &&
    unserve
  S=$NEW_S serve "$BF" $PORT --load-format dummy --ctx-size 8192 --parallel 256 --max-queue 1024 --kv-cache-gb $KV_GB &&
    echo "new, paged (--kv-cache-gb $KV_GB --parallel 256): $(python3 scripts/paged_kv_check.py concurrency --port $PORT --vocab $VOCAB -n $N)" &&
    grep -o "KV cache: .*" "$OUT/server-$PORT.log" | head -1 &&
    unserve
}

prefix() {
  step "2,000-token shared prefix: time to the first token, first request vs later ones"
  for run in "new:$NEW_S:" "new-no-caching:$NEW_S:--no-enable-prefix-caching" "old:$OS:"; do
    IFS=: read -r tag srv flags <<< "$run"
    S=$srv serve "$BF" $PORT --load-format dummy --ctx-size 8192 --parallel 8 $flags &&
      echo "$tag: $(python3 scripts/paged_kv_check.py prefix --port $PORT --vocab $VOCAB --prefix-tokens 2000 --requests ${REQS:-8})" &&
      unserve
  done
}

decode() {
  step "decode, $O vs $B alternated, ${RUNS:-3} runs, batch 1 and 32${NEW_FLAGS:+; new server: $NEW_FLAGS}"
  local stamp; stamp=$(date +%H%M%S)
  for r in $(seq ${RUNS:-3}); do
    [ "${ENGINE:-1}" = 0 ] || for m in "$Q4" "$BF"; do for bin in $O $B; do
      echo "$(basename $m) $(basename $bin) run $r: $(B=$bin bench_line X=1 "$m" 32 --load-format dummy)"
    done; done
    [ "${SERVER:-1}" = 0 ] && continue
    for srv in $OS $NEW_S; do
      local f="" tag; tag=$(basename $srv); [ "$srv" = "$NEW_S" ] && f=${NEW_FLAGS:-}
      local json="$OUT/paged-decode-$stamp-$r-$tag.json"
      S=$srv serve "${SERVER_MODEL:-$BF}" $PORT --load-format dummy --parallel 32 $f &&
        python3 scripts/bench_server.py --port $PORT --concurrency 1,32 --max-tokens 256 --rounds 2 --warmup 16 > "$json" &&
        echo "server $tag run $r:" && bench_summary "$json" && server_notes $PORT
      unserve
    done
  done
  [ "${SERVER:-1}" = 0 ] || decode_means "$OUT/paged-decode-$stamp" "$(basename $OS)" "$(basename $NEW_S)"
}

# what a server said about its memory: the KV pool and MLX's limits (its log), its peak,
# the KV pool copies (none expected) and preemptions (/metrics)
server_notes() {
  grep -oE "KV cache: .*|MLX memory limit .*|KV cache write copied.*|out of memory.*" "$OUT/server-$1.log" | sort -u | head -6 | sed 's/^/  log: /'
  curl -s "localhost:$1/metrics" | grep -E '^(mlxcel:kv_pool_copies_total|mlxcel:device_memory_peak_bytes|vllm:num_preemptions) ' | sed 's/^/  metrics: /'
}

# the servers' tok/s per level, mean over the runs of one invocation, new/old, and failed
# requests: decode_means PREFIX OLD_TAG NEW_TAG (files PREFIX-RUN-TAG.json)
decode_means() {
  python3 - "$@" <<'PY'
import glob, json, statistics, sys
prefix, old, new = sys.argv[1:4]
def runs(tag):
    return [json.load(open(f))["results"] for f in sorted(glob.glob(f"{prefix}-*-{tag}.json"))]
o, n = runs(old), runs(new)
print(f"means of {len(o)} / {len(n)} runs ({old} / {new}):")
for k, lvl in enumerate(r["concurrency"] for r in (n or o)[0]):
    mean = lambda rs: statistics.fmean(r[k]["tokens_per_s"] for r in rs) if rs else float("nan")
    failed = lambda rs: sum(r[k]["errors"] for r in rs)
    a, b = mean(o), mean(n)
    print(f"  {lvl} streams: {a:.1f} / {b:.1f} tok/s = {b / a if a else float('nan'):.3f}x; "
          f"failed requests {failed(o)} / {failed(n)}")
PY
}

kernel() {
  step "decode kernel through block tables vs MLX ops"
  for bs in 32 64; do ATTN_BS=$bs python3 scripts/check_attn.py; done
  ATTN_DTYPE=float16 ATTN_CTXS=128,2048 python3 scripts/check_attn.py
}

builds() {
  step "decode at batch 32 build by build: $Q4"
  for bin in ${BUILDS:-$O $B}; do echo "c8b-q4 $(basename $bin): $(B=$bin bench_line X=1 "$Q4" 32 --load-format dummy)"; done
  for e in ${SETTINGS:-}; do for bin in $O $B; do
    echo "c8b-q4 $(basename $bin) [$e]: $(B=$bin bench_line $e "$Q4" 32 --load-format dummy)"
  done; done
  for bin in ${BF16_BUILDS:-$O $B}; do echo "c8b $(basename $bin): $(B=$bin bench_line X=1 "$BF" 32 --load-format dummy)"; done
}

case "$cmd" in
builds) builds ;;
concurrency) concurrency ;;
prefix) prefix ;;
decode) decode ;;
kernel) kernel ;;
all) kernel; concurrency; prefix; decode ;;
*) echo "unknown: $cmd (concurrency, prefix, decode, kernel, builds, all)" >&2; exit 2 ;;
esac 2>&1 | tee -a "$OUT/paged-kv.txt"
