#!/usr/bin/env bash
# Mixture-of-experts speed on one GPU, dummy weights, mlxcel and mlx-lm side by side on the same
# shapes (mlx-lm's model built in memory with random weights: scripts/bench_mlx_lm.py --random-weights),
# both under MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=4000 (docs/benchmarks.md, "Mixture
# of experts", says what each number is):
#   bash scripts/gpu/moe.sh          # qwen30 then mixtral
#   bash scripts/gpu/moe.sh qwen30   # Qwen3-30B-A3B shape bf16 and 4-bit g64: decode batch 1/8/32, prefill 2048
#   bash scripts/gpu/moe.sh qwen30-bf16 / qwen30-q4   # one of them (qwen30-q4 with the gather_qmm prefill)
#   bash scripts/gpu/moe.sh mixtral  # Mixtral-8x7B shape bf16 (93 GB): decode batch 1
#   bash scripts/gpu/moe.sh plan     # `mlxcel plan` of the Qwen3-235B-A22B shape at TP 1/2/4/8, bf16 and 4-bit,
#                                    # per rank against one H200 (runs on a CPU machine too)
# TINY=1: tiny float32 shapes of the same families (a dry run, e.g. on a CPU, where MLX's
# gather_mm takes float32 only). Environment: see scripts/gpu/lib.sh.
. "$(dirname "$0")/lib.sh"
export MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=4000
MC=$CK/moe-configs${TINY:+-tiny}
REPEATS=${REPEATS:-2}

configs() {
  [ -f "$MC/mixtral-8x7b-bf16/tokenizer.json" ] && return
  demo_tokenizer
  python3 scripts/make_moe_configs.py --out "$MC" --tokenizer-from "$TOK" ${TINY:+--tiny} >/dev/null
}

# side NAME BATCHES PROMPT_LENS: mlxcel bench and mlx-lm on config NAME, one table row per number
side() {
  local m=$MC/$1 batches=$2 lens=$3 flags=()
  [ -n "$batches" ] && flags=(--decode-batch "$batches")
  step "$1: mlxcel bench (dummy weights)"
  timeout ${BENCH_S:-900} $B bench -m "$m" --load-format dummy --prompt-lens "$lens" --decode-tokens 128 \
    --repeats $REPEATS "${flags[@]}" 2>"$OUT/moe-$1-mlxcel.log" | tail -1 > "$OUT/moe-$1-mlxcel.json"
  step "$1: mlx-lm (random weights in memory)"
  timeout ${BENCH_S:-900} python3 scripts/bench_mlx_lm.py "$m" --random-weights --prompt-lens "$lens" --decode-tokens 128 \
    --repeats $REPEATS "${flags[@]}" 2>"$OUT/moe-$1-mlxlm.log" | tail -1 > "$OUT/moe-$1-mlxlm.json"
  python3 - "$1" "$OUT/moe-$1-mlxcel.json" "$OUT/moe-$1-mlxlm.json" <<'PY' | tee -a "$OUT/moe.txt"
import json, sys
name, a, b = sys.argv[1:]
def read(p):
    try:
        return json.load(open(p))
    except Exception as e:
        return {"error": f"{p}: {e}"}
x, y = read(a), read(b)
if "error" in x or "error" in y:
    print(name, x.get("error", ""), y.get("error", "")); sys.exit()
rows = [("decode b1", x["decode"]["tokens_per_second"], y["decode"]["tokens_per_second"])]
mb = {r["batch"]: r["tokens_per_second"] for r in y.get("decode_batched", [])}
rows += [(f"decode b{r['batch']}", r["tokens_per_second"], mb.get(r["batch"])) for r in x.get("decode_batched", [])]
mp = {r["tokens"]: r["tokens_per_second"] for r in y["prefill"]}
rows += [(f"prefill {r['tokens']}", r["tokens_per_second"], mp.get(r["tokens"])) for r in x["prefill"]]
print(f"{name}: weights {x.get('weights_gb', 0):.2f} GB, peak mlxcel {x['peak_memory_bytes']/1e9:.2f} GB, mlx-lm {y['peak_memory_bytes']/1e9:.2f} GB")
for what, m, l in rows:
    ratio = f"{m / l:.2f}x" if l else "-"
    print(f"  {what:<13} mlxcel {m:10.1f} tok/s   mlx-lm {l or 0:10.1f} tok/s   {ratio}")
PY
}

# 4-bit prefill with MLX's gather_qmm instead of dequantized experts + gather_mm
nodequant() {
  step "qwen3-30b-a3b-q4 prefill 2048 with MLXCEL_MOE_DEQUANT=0 (gather_qmm)"
  MLXCEL_MOE_DEQUANT=0 timeout ${BENCH_S:-900} $B bench -m "$MC/qwen3-30b-a3b-q4" --load-format dummy \
    --prompt-lens 2048 --decode-tokens 16 --repeats $REPEATS 2>/dev/null | tail -1 | python3 -c 'import json,sys
print("  prefill 2048 (gather_qmm)", round(json.load(sys.stdin)["prefill"][0]["tokens_per_second"], 1), "tok/s")' | tee -a "$OUT/moe.txt"
}

plan() {
  configs
  step "mlxcel plan, Qwen3-235B-A22B shape, ctx 8192, one H200 per rank (150.11 GB free, as measured)"
  for m in qwen3-235b-a22b-bf16 qwen3-235b-a22b-q4; do for n in 1 2 4 8; do
    echo "$m --tp-size $n: $(MLXCEL_PLAN_DEVICE_MEMORY=150110000000 $B plan -m "$MC/$m" --load-format dummy \
      --tp-size $n -c 8192 --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); r=max(d["ranks"], key=lambda r: r["total_bytes"])
print("per rank: weights %.2f GB, KV %.2f GB, margin %.2f GB, total %.2f GB: %s one H200" % (r["weight_bytes"]/1e9, r["kv_bytes"]/1e9, r["margin_bytes"]/1e9, r["total_bytes"]/1e9, "fits" if r["total_bytes"] <= 150110000000 else "does not fit"))')"
  done; done 2>&1 | tee "$OUT/moe-plan.txt"
}

cmd=${1:-all}
case "$cmd" in
qwen30) configs; side qwen3-30b-a3b-bf16 8,32 2048; side qwen3-30b-a3b-q4 8,32 2048; nodequant ;;
qwen30-bf16) configs; side qwen3-30b-a3b-bf16 8,32 2048 ;;
qwen30-q4) configs; side qwen3-30b-a3b-q4 8,32 2048; nodequant ;;
mixtral) configs; side mixtral-8x7b-bf16 "" 128 ;;
plan) plan ;;
all) configs; side qwen3-30b-a3b-bf16 8,32 2048; side qwen3-30b-a3b-q4 8,32 2048; nodequant
  side mixtral-8x7b-bf16 "" 128 ;;
*) echo "unknown: $cmd (qwen30, qwen30-bf16, qwen30-q4, mixtral, plan, all)" >&2; exit 2 ;;
esac
