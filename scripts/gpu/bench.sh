#!/usr/bin/env bash
# Speed on a GPU box (8B shape, random weights; docs/benchmarks.md says which numbers each gives).
#   bash scripts/gpu/bench.sh ckpt        # the 8B bf16 and 4-bit checkpoints under $CKPT_DIR
#   bash scripts/gpu/bench.sh mlx-lm      # mlxcel bench and scripts/bench_mlx_lm.py, bf16 and 4-bit
#   bash scripts/gpu/bench.sh side        # scripts/bench_side_by_side.py (4-bit, bf16), 4-bit without the GEMV kernel,
#                                         # generate pipelined vs --no-pipeline
#   bash scripts/gpu/bench.sh ab          # old vs new binary (MLXCEL_OLD vs MLXCEL) alternated: decode at batch 1
#                                         # and 8 of 8B bf16 and 4-bit, RUNS (default 3) times each
#   bash scripts/gpu/bench.sh knobs SETTING...   # 8B 4-bit decode (dummy weights) at batch 1 and BATCHES
#                                         # (default 4,8) per setting, alternated RUNS (default 2) times;
#                                         # e.g. `knobs MLXCEL_ATTN=0 X=1` (X=1: the defaults)
#   bash scripts/gpu/bench.sh batched SETTING... # 8B 4-bit, bf16 and 8-bit decode (dummy weights) at BATCHES
#                                         # (default 8,32,64), each with its host build + eval + wait a step,
#                                         # per setting alternated, RUNS (default 2) times (8-bit once;
#                                         # MODELS picks from c8b-q4 c8b c8b-q8);
#                                         # e.g. `batched MLXCEL_FORGET_VIEW=0 X=1` (< 8 min; LIMIT s caps it)
#   bash scripts/gpu/bench.sh agree SETTING...   # greedy token ids of 8B 4-bit dummy weights per setting
#   bash scripts/gpu/bench.sh long SETTING...    # decode after a 2048-token prompt per setting
#   bash scripts/gpu/bench.sh peak        # prefill(2048) peak memory and batched decode 2/4/8, bf16 and 4-bit
#   bash scripts/gpu/bench.sh envsweep    # decode under MLX's CUDA-graph settings (MODELS, default 8b-q4 8b-bf16)
#   bash scripts/gpu/bench.sh proxies [NAME...]  # the rank proxies, mlxcel beside mlx-lm (scripts/gpu/rank-proxies.sh)
#   bash scripts/gpu/bench.sh qwen        # Qwen2/Qwen3 configs (dummy weights): one Qwen2.5-72B rank at TP=8 in bf16
#                                         # and 4-bit, Qwen2.5-7B 4-bit, one Qwen3-32B rank at TP=8 4-bit; decode at
#                                         # batch 1, 8 and 32 (the 4-bit GEMM's q/k/v with the biases; BATCHES
#                                         # sets them), default vs MLXCEL_QKV_BIAS=0 MLXCEL_QK_ROPE=0, alternated
#                                         # RUNS (2) times (LIMIT s caps it)
# Environment: see scripts/gpu/lib.sh.
. "$(dirname "$0")/lib.sh"
cmd=${1:-mlx-lm}; shift || true
case "$cmd" in
ckpt) ckpt ;;
proxies) exec bash "$(dirname "$0")/rank-proxies.sh" "$@" ;;
mlx-lm)
  ckpt
  for m in 8b-bf16 8b-q4; do
    step "mlxcel bench $m"; $B bench -m "$CK/$m" --repeats 3 2>/dev/null | tee "$OUT/mlxcel-$m.json"
    step "mlx-lm bench $m"; python3 scripts/bench_mlx_lm.py "$CK/$m" --repeats 3 | tee "$OUT/mlxlm-$m.json"
  done
  ;;
side)
  ckpt
  step "mlxcel vs mlx-lm, same weights"
  python3 scripts/bench_side_by_side.py --mlxcel $B "$CK/8b-q4" "$CK/8b-bf16" 2>/dev/null | tee "$OUT/side.txt"
  step "mlxcel 4-bit without its GEMV kernel"
  python3 scripts/bench_side_by_side.py --mlxcel $B --skip-mlx-lm --env MLXCEL_QGEMV=0 "$CK/8b-q4" 2>/dev/null | tee -a "$OUT/side.txt"
  step "mlxcel generate: pipelined decode vs --no-pipeline"
  for m in 8b-q4 8b-bf16; do for f in "" --no-pipeline; do
    echo "$m $f: $($B generate -m "$CK/$m" -n 256 --ignore-eos -p hello $f 2>&1 | grep -o 'generated: .*tok/s')"; done; done
  ;;
ab)
  # box-to-box spread is ±15%, so a change is judged against the old binary on the same box,
  # alternating runs
  ckpt
  O=${MLXCEL_OLD:-$(dirname $B)/mlxcel-old}
  step "decode, $O vs $B alternated, ${RUNS:-3} runs, batch 1 and ${BATCHES:-8}"
  for m in ${MODELS:-8b-bf16 8b-q4}; do for r in $(seq ${RUNS:-3}); do for bin in $O $B; do
    echo "$m $(basename $bin) run $r: $(B=$bin bench_line X=1 "$CK/$m" "${BATCHES:-8}")"
  done; done; done 2>&1 | tee -a "$OUT/ab.txt"
  ;;
knobs)
  [ $# -gt 0 ] || set -- X=1
  step "decode 8B 4-bit (dummy weights): $*, alternated, batches ${BATCHES:-4,8}"
  for r in $(seq ${RUNS:-2}); do q4decode "${BATCHES:-4,8}" "$@"; done 2>&1 | tee -a "$OUT/decode-knobs.txt"
  ;;
batched)
  [ $# -gt 0 ] || set -- X=1
  q4cfg; q8cfg
  T0=${T0:-$(date +%s)}
  step "batched decode 8B (dummy weights) at ${BATCHES:-8,32,64}: $*, alternated"
  for r in $(seq ${RUNS:-2}); do for m in ${MODELS:-c8b-q4 c8b c8b-q8}; do
    [ $r -gt 1 ] && [ $m = c8b-q8 ] && continue
    for e in "$@"; do
      [ $(( ${LIMIT:-100000} - ($(date +%s) - T0) )) -lt 40 ] && break 3
      echo "$m [$e] run $r: $(DECODE_TOKENS=${DECODE_TOKENS:-128} bench_line "$e" "$CK/$m" "${BATCHES:-8,32,64}" --load-format dummy)"
    done
  done; done 2>&1 | tee -a "$OUT/decode-batched.txt"
  ;;
agree)
  [ $# -gt 0 ] || set -- X=1
  q4cfg
  step "greedy tokens, 8B 4-bit dummy weights: $*"
  for e in "$@"; do echo "[$e] $(env $e timeout 100 $B generate -m "$CK/c8b-q4" --load-format dummy -p "The capital of France is" -n 48 --ignore-eos --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["generated_token_ids"])')"; done 2>&1 | tee -a "$OUT/agree.txt"
  ;;
long)
  [ $# -gt 0 ] || set -- X=1
  q4cfg
  step "decode 8B 4-bit at 2048 positions: $*"
  for e in "$@"; do
    echo "[$e] $(env $e timeout 100 $B bench -m "$CK/c8b-q4" --load-format dummy --prompt-lens 2048 --decode-tokens 256 --repeats 1 2>/dev/null | tail -1 | python3 -c 'import json,sys; d=json.load(sys.stdin)["decode"]; print(round(d["tokens_per_second"],1), "tok/s", {k: round(v,3) for k,v in d["host_per_token"].items()})')"
  done 2>&1 | tee -a "$OUT/decode-long.txt"
  ;;
peak)
  ckpt
  step "prefill(2048) peak memory and batched decode 2/4/8"
  $B bench -m "$CK/8b-q4" --prompt-lens 2048 --decode-batch 2,4,8 --repeats 1 2>/dev/null | tee "$OUT/q4-bench.json"
  $B bench -m "$CK/8b-bf16" --prompt-lens 2048 --decode-batch 2,4,8 --repeats 1 2>/dev/null | tee "$OUT/bf16-bench.json"
  ;;
envsweep)
  # MLX's CUDA graph batching (MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER; H100/H200
  # default 30 ops / 400 MB per graph) and graphs off; decode only, host time split per token
  ckpt
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
qwen)
  t0=$(date +%s); left() { echo $(( ${LIMIT:-540} - ($(date +%s) - t0) )); }
  demo_tokenizer
  # qcfg_qwen DIR BITS HIDDEN LAYERS HEADS KV_HEADS INTER FAMILY: a config for --load-format dummy
  qcfg_qwen() {
    mkdir -p "$1" && cp "$TOK"/tokenizer* "$1"/ && python3 - "$@" <<'PY'
import json, sys
d, bits, h, l, nh, kv, inter, fam = sys.argv[1], *map(int, sys.argv[2:8]), sys.argv[8]
c = {"architectures": [fam.capitalize() + "ForCausalLM"], "model_type": fam, "hidden_size": h,
     "head_dim": 128, "num_hidden_layers": l, "num_attention_heads": nh, "num_key_value_heads": kv,
     "intermediate_size": inter, "vocab_size": 152064, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
     "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
if bits:
    c["quantization"] = {"group_size": 64, "bits": bits}
json.dump(c, open(d + "/config.json", "w"))
PY
  }
  qcfg_qwen "$CK/q72-tp8-bf16" 0 8192 80 8 1 3696 qwen2
  qcfg_qwen "$CK/q72-tp8-q4" 4 8192 80 8 1 3696 qwen2
  qcfg_qwen "$CK/q7-q4" 4 3584 28 28 4 18944 qwen2
  qcfg_qwen "$CK/q3-32-tp8-q4" 4 5120 64 8 1 3200 qwen3
  step "Qwen decode: the fused q/k/v paths (default) vs MLXCEL_QKV_BIAS=0 MLXCEL_QK_ROPE=0, alternated"
  for r in $(seq ${RUNS:-2}); do for m in q72-tp8-bf16 q72-tp8-q4 q7-q4 q3-32-tp8-q4; do
    for e in X=1 "MLXCEL_QKV_BIAS=0 MLXCEL_QK_ROPE=0"; do
      [ "$(left)" -lt 45 ] && break 3
      echo "$m [$e] run $r: $(DECODE_TOKENS=128 BENCH_S=$(( $(left) - 5 )) bench_line "$e" "$CK/$m" "${BATCHES:-8,32}" --load-format dummy)"
    done
  done; done 2>&1 | tee -a "$OUT/qwen.txt"
  ;;
*) echo "unknown: $cmd (ckpt, mlx-lm, side, ab, knobs, agree, long, peak, envsweep, proxies, qwen)" >&2; exit 2 ;;
esac
