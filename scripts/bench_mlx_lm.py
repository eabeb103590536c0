#!/usr/bin/env python3
"""mlx-lm's numbers measured the way `mlxcel bench` measures (same weights, same
libmlx): prefill time of one forward pass over N random tokens (best of 2, after a
warm-up), and batch-1 greedy decode of T tokens after a C-token prompt using
mlx-lm's own pipelined `generate_step`. Prints one JSON line.

    python3 scripts/bench_mlx_lm.py MODEL_DIR [--prompt-lens 512,2048] [--decode-tokens 128]
"""
import argparse
import json
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-lens", default="512,2048")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--decode-context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    from pathlib import Path
    model, config = load_model(Path(a.model))
    vocab = config["vocab_size"]
    mx.random.seed(1234)

    def prefill(n):
        x = mx.random.randint(0, vocab, (1, n))
        best = 1e9
        for _ in range(a.repeats):
            cache = make_prompt_cache(model)
            mx.eval(x)
            t = time.perf_counter()
            mx.eval(model(x, cache=cache))
            best = min(best, time.perf_counter() - t)
        return {"tokens": n, "seconds": best, "tokens_per_second": n / best}

    prefill(64)  # warm-up
    rows = [prefill(int(n)) for n in a.prompt_lens.split(",")]
    best = 1e9
    for _ in range(a.repeats):
        prompt = mx.random.randint(0, vocab, (a.decode_context,))
        gen = generate_step(prompt, model, max_tokens=a.decode_tokens + 1)
        next(gen)  # prefill + first token
        t = time.perf_counter()
        for _ in range(a.decode_tokens):
            next(gen)
        best = min(best, time.perf_counter() - t)
    print(json.dumps({
        "engine": "mlx-lm", "model": a.model, "prefill": rows,
        "decode": {"batch": 1, "context": a.decode_context, "tokens": a.decode_tokens, "seconds": best,
                   "tokens_per_second": a.decode_tokens / best, "ms_per_token": best * 1e3 / a.decode_tokens},
        "peak_memory_bytes": mx.get_peak_memory(),
    }))


if __name__ == "__main__":
    main()
