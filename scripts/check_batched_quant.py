#!/usr/bin/env python3
"""Batched decode of quantized models against mlx-lm: the check `check_fixtures.py --batched`
makes for the bfloat16 fixtures, for 4- and 8-bit weights (no committed fixture holds a
quantized model with bfloat16 activations and heads of 64, which is what takes mlxcel's
quantized GEMV / GEMM kernels, their KV-pool write and the batched attention kernel on CUDA).

    python3 scripts/check_batched_quant.py ./mlxcel [--batch 12,32] [--keep DIR]

For each case (Llama and Qwen3 shapes, 4-bit and 8-bit, group 32): random bfloat16 weights
in an HF-style folder (the tokenizer of tests/fixtures), converted by mlx-lm
(`mlx_lm.convert`, as a user would); `mlxcel serve --parallel B` then answers B concurrent
sampled completions (seed each, logprobs 5, 16 tokens), so decode steps run every row count
from B down. Each request's top-5 log-probabilities are compared with mlx-lm's float32
forward pass (the same quantized weights, CPU) teacher-forced along the same tokens. The
bound is measured, not chosen, as for the bfloat16 fixtures: mlx-lm itself in bfloat16
against that float32 reference over the prompts (max |d| of the log-probabilities), times 6
(the fixtures' 3x on logits, 2x for a log-softmax). Needs mlx and mlx-lm (the GPU boxes'
staging installs both).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

from check_fixtures import batched_run, fixtures

# heads of 64 (the attention kernel's size), GQA 2:1, hidden 128 (group 32 divides it), two
# layers; the vocabulary of the fixtures' tokenizer
BASE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "intermediate_size": 256,
    "vocab_size": 384,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}
# family: (the fixture whose tokenizer it takes, its config keys)
FAMILIES = {
    "llama": ("llama3", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}),
    "qwen3": ("qwen3", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}),
}
PROMPTS = [
    [5, 71, 200, 33, 90, 14, 250, 7, 61, 300],
    [12, 8, 140, 41, 99, 370, 2, 55, 18, 230, 77, 6, 150],
]
STEPS = 16


def random_hf_folder(out, family, seed):
    """A random bfloat16 HF-style checkpoint of `family` in `out`."""
    import mlx.core as mx
    import numpy as np

    tok_fixture, arch = FAMILIES[family]
    cfg = {**BASE, **arch}
    h, nh, nkv, hd, inter, v = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                "head_dim", "intermediate_size", "vocab_size"))
    rng = np.random.default_rng(seed)
    w = {}

    def rand(name, shape, std=0.02):
        w[name] = mx.array(rng.normal(0.0, std, shape).astype(np.float32)).astype(mx.bfloat16)

    rand("model.embed_tokens.weight", (v, h), 0.5)
    rand("lm_head.weight", (v, h))
    w["model.norm.weight"] = mx.ones((h,), dtype=mx.bfloat16)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        rand(f"{p}.self_attn.q_proj.weight", (nh * hd, h))
        rand(f"{p}.self_attn.k_proj.weight", (nkv * hd, h))
        rand(f"{p}.self_attn.v_proj.weight", (nkv * hd, h))
        rand(f"{p}.self_attn.o_proj.weight", (h, nh * hd))
        rand(f"{p}.mlp.gate_proj.weight", (inter, h))
        rand(f"{p}.mlp.up_proj.weight", (inter, h))
        rand(f"{p}.mlp.down_proj.weight", (h, inter))
        w[f"{p}.input_layernorm.weight"] = mx.ones((h,), dtype=mx.bfloat16)
        w[f"{p}.post_attention_layernorm.weight"] = mx.ones((h,), dtype=mx.bfloat16)
        if family == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = mx.ones((hd,), dtype=mx.bfloat16)
            w[f"{p}.self_attn.k_norm.weight"] = mx.ones((hd,), dtype=mx.bfloat16)
    os.makedirs(out, exist_ok=True)
    mx.save_safetensors(os.path.join(out, "model.safetensors"), w, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = os.path.join(fixtures, tok_fixture, name)
        if os.path.exists(src):
            shutil.copy(src, out)


def quantized(work, family, bits, seed):
    """The mlx-lm conversion (group 32, `bits`) of a random `family` checkpoint."""
    from mlx_lm import convert

    hf = os.path.join(work, f"{family}-hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        random_hf_folder(hf, family, seed)
    out = os.path.join(work, f"{family}-q{bits}")
    if not os.path.exists(os.path.join(out, "config.json")):
        convert(hf, out, quantize=True, q_group_size=32, q_bits=bits, dtype="bfloat16")
    return out


def forward_fn(path, dtype):
    """f(ids) -> log-softmax rows (numpy float32) of mlx-lm's model at `path` in `dtype`, on
    the CPU."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    mx.set_default_device(mx.cpu)
    model, _ = load(path)
    model.set_dtype(dtype)

    def run(ids):
        logits = model(mx.array([ids]))[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return np.array(lp)

    return run


def check(exe, model, name, batches, extra):
    """Returns the number of mismatches for one model."""
    import mlx.core as mx

    ref = forward_fn(model, mx.float32)
    low = forward_fn(model, mx.bfloat16)
    measured = max(float(abs(ref(p) - low(p)).max()) for p in PROMPTS)
    bound = 6 * measured
    bad = 0
    for batch in batches:
        try:
            worst, where, distinct, missing = batched_run(exe, model, batch, PROMPTS, 700, STEPS, ref, extra)
        except Exception as e:
            print(f"{name} batched x{batch}: FAILED to run: {e}")
            bad += 1
            continue
        if missing:
            print(f"{name} batched x{batch}: requests {missing} got no answer")
        ok = worst <= bound and len(distinct) > 1 and not missing
        bad += not ok
        print(f"{name} batched x{batch}: {'ok' if ok else 'MISMATCH'} ({STEPS} steps each, distinct tokens "
              f"{len(distinct)}, top-5 log-probabilities vs mlx-lm float32: max |d| {worst:.3g} at (request, step) "
              f"{where}, bound {bound:.3g} (6 x mlx-lm bfloat16's {measured:.3g}))")
    return bad


def main():
    sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("exe")
    ap.add_argument("--batch", default="12,32", help="concurrent requests, comma-separated")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--families", default="llama,qwen3")
    ap.add_argument("--keep", help="build the models here (kept) instead of a temporary folder")
    a, extra = ap.parse_known_args()
    work = a.keep or tempfile.mkdtemp(prefix="mlxcel-quant-")
    batches = [int(x) for x in a.batch.split(",")]
    bad = 0
    try:
        for seed, family in enumerate(a.families.split(",")):
            for bits in (int(b) for b in a.bits.split(",")):
                model = quantized(work, family, bits, 4242 + seed)
                bad += check(a.exe, model, f"{family}-q{bits}", batches, extra)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"batched quantized: {'all ok' if bad == 0 else f'{bad} mismatches'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
