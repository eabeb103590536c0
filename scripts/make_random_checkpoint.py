#!/usr/bin/env python3
"""Write a random-weight Llama checkpoint of a real model's shape (HF layout,
safetensors shards + index), for speed and memory tests on a GPU box.

    python3 scripts/make_random_checkpoint.py --shape llama3-8b --out /root/ckpt/8b-bf16 \
        [--dtype bfloat16] [--tokenizer-from DIR] [--shard-gb 5]

Weights are N(0, 0.02) made with torch on the GPU when there is one (no
download). `--tokenizer-from` copies tokenizer.json/tokenizer_config.json from
another folder (e.g. mlxcel's demo model) so that loaders that want a
tokenizer find one; token ids beyond its vocabulary are still valid model inputs.
"""
import argparse
import json
import os
import shutil

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256),
    "llama3-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=128256),
    # larger than one H200 in bf16 (91.1B parameters, 182 GB): for --load-format dummy
    "llama3-90b": dict(hidden_size=8192, num_hidden_layers=104, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=128256),
    # ~30 GB in bf16 (14.8B parameters): a real sharded checkpoint for byte-range loads on 2 GPUs
    "llama-15b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                      intermediate_size=17920, vocab_size=128256),
    "llama3-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
}


def write_weights(a, s, tie):
    """Random weights of shape `s` in `a.shard_gb` files plus their index; returns the bytes written."""
    import torch  # here, so that --config-only needs no torch
    from safetensors.torch import save_file

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, a.dtype)
    g = torch.Generator(device=dev).manual_seed(a.seed)
    h, L, nh, nkv, inter, V = (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                               s["num_key_value_heads"], s["intermediate_size"], s["vocab_size"])
    hd = h // nh
    shapes = [("model.embed_tokens.weight", (V, h))]
    for i in range(L):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.self_attn.q_proj.weight", (nh * hd, h)), (f"{p}.self_attn.k_proj.weight", (nkv * hd, h)),
                   (f"{p}.self_attn.v_proj.weight", (nkv * hd, h)), (f"{p}.self_attn.o_proj.weight", (h, nh * hd)),
                   (f"{p}.mlp.gate_proj.weight", (inter, h)), (f"{p}.mlp.up_proj.weight", (inter, h)),
                   (f"{p}.mlp.down_proj.weight", (h, inter)), (f"{p}.input_layernorm.weight", (h,)),
                   (f"{p}.post_attention_layernorm.weight", (h,))]
    shapes.append(("model.norm.weight", (h,)))
    if not tie:
        shapes.append(("lm_head.weight", (V, h)))
    limit = int(a.shard_gb * 1e9)
    shards, cur, size = [], {}, 0
    for name, shp in shapes:
        if len(shp) == 1:
            t = torch.ones(shp, dtype=dt, device=dev)
        else:
            t = (torch.randn(shp, generator=g, device=dev, dtype=torch.float32) * 0.02).to(dt)
        cur[name] = t
        size += t.numel() * t.element_size()
        if size >= limit:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    weight_map, total = {}, 0
    for k, sh in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: t.cpu().contiguous() for n, t in sh.items()}, os.path.join(a.out, fname), metadata={"format": "pt"})
        for n, t in sh.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tokenizer-from")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true",
                    help="write config.json (and the tokenizer) only, for --load-format dummy")
    a = ap.parse_args()
    s = dict(SHAPES[a.shape])
    tie = s.pop("tie_word_embeddings", False)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": tie, "torch_dtype": a.dtype, "bos_token_id": 256, "eos_token_id": [257, 260],
        "attention_bias": False, "mlp_bias": False, **s,
    }
    os.makedirs(a.out, exist_ok=True)
    total = 0 if a.config_only else write_weights(a, s, tie)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if a.tokenizer_from:
        shutil.copy(os.path.join(a.tokenizer_from, "tokenizer_config.json"), os.path.join(a.out, "tokenizer_config.json"))
        # extend the (byte-level BPE) vocabulary to the model's size, so that every id the
        # random model emits decodes to some text (" t1234"); merges stay as they are
        with open(os.path.join(a.tokenizer_from, "tokenizer.json")) as f:
            tok = json.load(f)
        vocab = tok["model"]["vocab"]
        used = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
        for i in range(s["vocab_size"]):
            if i not in used:
                vocab[f"\u0120t{i}"] = i
        with open(os.path.join(a.out, "tokenizer.json"), "w") as f:
            json.dump(tok, f)
    print(f"wrote {a.out}: {total / 1e9:.2f} GB of weights" + (" (config only)" if a.config_only else ""))


if __name__ == "__main__":
    main()
