#!/usr/bin/env python3
"""mlx-lm's numbers measured the way `mlxcel bench` measures (same weights, same
libmlx): prefill time of one forward pass over N random tokens (best of 2, after a
warm-up), and batch-1 greedy decode of T tokens after a C-token prompt using
mlx-lm's own pipelined `generate_step`. Prints one JSON line.

    python3 scripts/bench_mlx_lm.py MODEL_DIR [--prompt-lens 512,2048] [--decode-tokens 128]
    python3 scripts/bench_mlx_lm.py CONFIG_DIR --random-weights ...

With --random-weights the folder needs only config.json: the model is built in memory
(mlx-lm's model class with its own random initialisation, cast to the config's dtype,
`nn.quantize`d when the config has "quantization"), as `mlxcel bench --load-format dummy`
does, for shapes whose checkpoints the disk cannot hold (scripts/rank_proxies.py).
--decode-batch also times greedy decode of B
sequences at once (the same prompt, one token each per step, the next step queued before
the previous is read, as generate_step does).
"""
import argparse
import json
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_model

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def random_model(path):
    """The model of `path`/config.json with random weights, made in memory."""
    with open(path / "config.json") as f:
        config = json.load(f)
    model_class, args_class = _get_classes(config=config)
    model = model_class(args_class.from_dict(config))
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    model.set_dtype(DTYPES[dtype])
    q = config.get("quantization")
    if q:
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"])
    # layer by layer: one layer's float32 draws alive at a time
    for layer in getattr(model, "layers", []):
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model, config


def batched_decode(model, vocab, batch, context, tokens, repeats):
    """Greedy decode of `batch` sequences after the same `context`-token prompt."""
    best = 1e9
    for _ in range(repeats):
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(0, vocab, (1, context))
        prompt = mx.broadcast_to(prompt, (batch, context))
        y = mx.argmax(model(prompt, cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        t = time.perf_counter()
        for _ in range(tokens):
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(nxt)
            y = nxt
        mx.eval(y)
        best = min(best, time.perf_counter() - t)
    return {"batch": batch, "tokens": tokens, "seconds": best,
            "tokens_per_second": batch * tokens / best}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-lens", default="512,2048")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--decode-context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--random-weights", action="store_true",
                    help="build the model of MODEL/config.json in memory with random weights")
    ap.add_argument("--decode-batch", default="", help="also time batched decode at these batches")
    a = ap.parse_args()
    from pathlib import Path
    model, config = random_model(Path(a.model)) if a.random_weights else load_model(Path(a.model))
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
    rows = [prefill(int(n)) for n in a.prompt_lens.split(",") if n.strip()]
    best = 1e9
    for _ in range(a.repeats):
        prompt = mx.random.randint(0, vocab, (a.decode_context,))
        gen = generate_step(prompt, model, max_tokens=a.decode_tokens + 1)
        next(gen)  # prefill + first token
        t = time.perf_counter()
        for _ in range(a.decode_tokens):
            next(gen)
        best = min(best, time.perf_counter() - t)
    batched = [batched_decode(model, vocab, int(b), a.decode_context, a.decode_tokens, a.repeats)
               for b in a.decode_batch.split(",") if b]
    print(json.dumps({
        "engine": "mlx-lm", "model": a.model, "random_weights": a.random_weights,
        "weights_gb": sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9, "prefill": rows,
        "decode": {"batch": 1, "context": a.decode_context, "tokens": a.decode_tokens, "seconds": best,
                   "tokens_per_second": a.decode_tokens / best, "ms_per_token": best * 1e3 / a.decode_tokens},
        "decode_batched": batched,
        "peak_memory_bytes": mx.get_peak_memory(),
    }))


if __name__ == "__main__":
    main()
