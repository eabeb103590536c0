#!/usr/bin/env python3
"""Write a Llama-architecture GGUF of a given shape with random Q4_0 / Q4_1 / Q8_0 blocks
(standard library only, so it runs on a GPU box without packages), plus the matching
MLX 4-bit group-32 config.json for `mlxcel --load-format dummy`, to compare the speed of
a GGUF and an MLX 4-bit checkpoint of one shape.

    python3 scripts/make_test_gguf.py --out /root/ckpt/g1b --shape llama3-1b
    # -> /root/ckpt/g1b/model-q4_0.gguf and /root/ckpt/g1b-mlx4/config.json (+ tokenizer
    #    files copied from --tokenizer-from, e.g. the demo model's folder)

The weights are random (scales fixed at 2^-7, quants uniform): numbers of speed, not of text.
The vocabulary is byte-level (256 byte tokens, the rest placeholder tokens, no merges).
"""
import argparse
import json
import os
import shutil
import struct

SHAPES = {
    # Llama 3.2 1B without its RoPE scaling (GGUF keeps that in a rope_freqs tensor)
    "llama3-1b": dict(hidden=2048, layers=16, heads=32, kv=8, inter=8192, vocab=128256),
    "small": dict(hidden=256, layers=2, heads=4, kv=2, inter=512, vocab=512),
}
TYPES = {"q4_0": (2, 18), "q4_1": (3, 20), "q8_0": (8, 34)}  # ggml id, bytes per 32 values
F16_SCALE = struct.pack("<e", 2.0 ** -7)


def byte_alphabet():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def blocks(ty, n_values):
    """Random blocks of `ty` for n_values values (valid f16 scales)."""
    _, size = TYPES[ty]
    n = n_values // 32
    rnd = os.urandom(n * size)
    if ty == "q4_0":
        return b"".join(F16_SCALE + rnd[i * size + 2:(i + 1) * size] for i in range(n))
    if ty == "q4_1":
        return b"".join(F16_SCALE + struct.pack("<e", -0.06) + rnd[i * size + 4:(i + 1) * size] for i in range(n))
    return b"".join(F16_SCALE + rnd[i * size + 2:(i + 1) * size] for i in range(n))


def s(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, value):
    out = s(key)
    if isinstance(value, bool):
        return out + struct.pack("<IB", 7, value)
    if isinstance(value, int):
        return out + struct.pack("<II", 4, value)
    if isinstance(value, float):
        return out + struct.pack("<If", 6, value)
    if isinstance(value, str):
        return out + struct.pack("<I", 8) + s(value)
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return out + struct.pack("<IIQ", 9, 8, len(value)) + b"".join(s(v) for v in value)
        return out + struct.pack("<IIQ", 9, 5, len(value)) + b"".join(struct.pack("<i", v) for v in value)
    raise TypeError(value)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-1b")
    ap.add_argument("--type", choices=sorted(TYPES), default="q4_0", help="linears")
    ap.add_argument("--embedding-type", choices=sorted(TYPES), default="q4_0")
    ap.add_argument("--tokenizer-from", help="folder with tokenizer.json for the MLX config's folder")
    a = ap.parse_args()
    c = SHAPES[a.shape]
    h, hd = c["hidden"], c["hidden"] // c["heads"]
    tensors = [("token_embd.weight", [c["vocab"], h], a.embedding_type), ("output_norm.weight", [h], "f32")]
    for i in range(c["layers"]):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", [h], "f32"), (p + "ffn_norm.weight", [h], "f32"),
            (p + "attn_q.weight", [c["heads"] * hd, h], a.type), (p + "attn_k.weight", [c["kv"] * hd, h], a.type),
            (p + "attn_v.weight", [c["kv"] * hd, h], a.type), (p + "attn_output.weight", [h, c["heads"] * hd], a.type),
            (p + "ffn_gate.weight", [c["inter"], h], a.type), (p + "ffn_up.weight", [c["inter"], h], a.type),
            (p + "ffn_down.weight", [h, c["inter"]], a.type),
        ]
    alpha = byte_alphabet()
    tokens = alpha + [f"tok{i}" for i in range(c["vocab"] - 256)]
    meta = [
        ("general.architecture", "llama"), ("general.name", f"random {a.shape} {a.type}"),
        ("llama.block_count", c["layers"]), ("llama.context_length", 8192), ("llama.embedding_length", h),
        ("llama.feed_forward_length", c["inter"]), ("llama.attention.head_count", c["heads"]),
        ("llama.attention.head_count_kv", c["kv"]), ("llama.rope.freq_base", 500000.0),
        ("llama.attention.layer_norm_rms_epsilon", 1e-5), ("llama.vocab_size", c["vocab"]),
        ("llama.rope.dimension_count", hd), ("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "default"),
        ("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.merges", []),
        ("tokenizer.ggml.bos_token_id", 0), ("tokenizer.ggml.eos_token_id", 1),
    ]
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"model-{a.type}.gguf")
    with open(path, "wb") as f:
        head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
        head += b"".join(kv(k, v) for k, v in meta)
        offset, infos = 0, []
        for name, shape, ty in tensors:
            n = 1
            for d in shape:
                n *= d
            size = n * 4 if ty == "f32" else n // 32 * TYPES[ty][1]
            tid = 0 if ty == "f32" else TYPES[ty][0]
            head += s(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape))
            head += struct.pack("<IQ", tid, offset)
            infos.append((n, ty, size))
            offset = (offset + size + 31) // 32 * 32
        head += b"\0" * ((-len(head)) % 32)
        f.write(head)
        for n, ty, size in infos:
            f.write(struct.pack("<f", 1.0) * n if ty == "f32" else blocks(ty, n))
            f.write(b"\0" * ((-size) % 32))
    # the same shape as an MLX 4-bit group-32 config for --load-format dummy
    mlx = a.out.rstrip("/") + "-mlx4"
    os.makedirs(mlx, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": h, "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv"], "intermediate_size": c["inter"], "vocab_size": c["vocab"],
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
        "quantization": {"group_size": 32, "bits": 8 if a.type == "q8_0" else 4},
    }
    with open(os.path.join(mlx, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if a.tokenizer_from:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            src = os.path.join(a.tokenizer_from, name)
            if os.path.exists(src):
                shutil.copy(src, mlx)
    print(path, os.path.getsize(path), "bytes;", mlx)


if __name__ == "__main__":
    main()
