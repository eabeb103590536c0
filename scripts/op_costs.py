#!/usr/bin/env python3
"""Host cost per MLX op on the GPU backend, by op kind (run on the box).

A decode step is a chain of a few hundred ops and, at batch 1, MLX's host work per op
bounds it (docs/benchmarks.md). For each op kind this builds a chain of N ops, each
reading the previous one's output, then `async_eval`s it and waits, and prints per op:
  build  time to make the lazy ops (Python + MLX graph construction),
  encode time inside `async_eval` (MLX's eval_gpu per op: kernel lookup, CUDA graph nodes),
  wait   time from the end of `async_eval` until the result is ready (GPU still busy).
Best of REPS, after a warm-up chain (compiles kernels). Kinds:
  add                 an MLX elementwise op (baseline)
  custom_lean/_full   a one-line custom CUDA kernel with an empty header / with the 36 KB
                      header of kernels/qgemv.cu (MLX copies header + body into every op)
  custom_include      the same 36 KB header read by nvrtc from a file (`#include "/abs"`)
  slice               a view of the KV pool, as the decode step reads it
  slice_update        a one-position write into the KV pool
  sdpa                fast.scaled_dot_product_attention at T = 1 on pool views (GQA 32/8)
Usage: python3 scripts/op_costs.py [--n 512] [--reps 5] [--ctx 384]
"""
import argparse
import os
import pathlib
import time

os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "100")  # as mlxcel sets them
os.environ.setdefault("MLX_MAX_MB_PER_BUFFER", "4000")
import mlx.core as mx  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
BODY = """
  unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < x_size) y[i] = x[i] + static_cast<T>(1.0f);
"""


def qgemv_header():
    text = (ROOT / "kernels" / "qgemv.cu").read_text()
    return text.split("// @@header\n", 1)[1].split("// @@body\n", 1)[0]


def include_file():
    """The 36 KB header in a file, for a one-line `#include` header (nvrtc reads it)."""
    path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "opcost_qgemv_header.cuh"
    path.write_text(qgemv_header())
    return path


def custom(header, name):
    k = mx.fast.cuda_kernel(name=name, input_names=["x"], output_names=["y"],
                            source=BODY.replace("x_size", "4096"), header=header)

    def op(x):
        return k(inputs=[x], template=[("T", mx.bfloat16)], grid=(4096, 1, 1),
                 threadgroup=(256, 1, 1), output_shapes=[x.shape],
                 output_dtypes=[x.dtype])[0]
    return op


def chain(make, start, n, reps):
    best = None
    for r in range(reps + 1):  # the first is the warm-up
        mx.synchronize()
        t0 = time.perf_counter()
        y = start
        for _ in range(n):
            y = make(y)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        cur = (t1 - t0, t2 - t1, t3 - t2)
        if r and (best is None or sum(cur) < sum(best)):
            best = cur
    return [v / n * 1e6 for v in best]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=384)
    a = ap.parse_args()
    bf = mx.bfloat16
    x = mx.random.normal((4096,)).astype(bf)
    cap = a.ctx + a.n + 8
    pool = mx.random.normal((1, 16, cap, 128)).astype(bf)  # [slots, 2·kv_heads, cap, D]
    kv = mx.random.normal((1, 16, 1, 128)).astype(bf)
    q = mx.random.normal((1, 32, 1, 128)).astype(bf)
    mx.eval(x, pool, kv, q)
    k_view, v_view = pool[:, :8, : a.ctx, :], pool[:, 8:, : a.ctx, :]
    kinds = {
        "add": (lambda y: y + 1, x),
        "custom_lean": (custom("", "opcost_lean"), x),
        "custom_full": (custom(qgemv_header(), "opcost_full"), x),
        "custom_include": (custom(f'#include "{include_file()}"\n', "opcost_incl"), x),
        "slice": (lambda y: y[:, :, 1:, :], pool),
        "slice_update": (None, pool),
        "sdpa": (lambda y: mx.fast.scaled_dot_product_attention(y, k_view, v_view, scale=0.088),
                 q),
    }
    print(f"# op_costs.py: N = {a.n} chained ops, best of {a.reps}, ctx {a.ctx}, "
          f"mlx {mx.__version__}, {mx.default_device()}")
    print(f"{'op':14s} {'build us':>9s} {'encode us':>10s} {'wait us':>8s} {'total us':>9s}")
    for name, (fn, start) in kinds.items():
        if name == "slice_update":
            pos = iter(range(10**9))

            def fn(y):
                p = a.ctx + next(pos) % a.n
                y[:, :, p:p + 1, :] = kv
                return y
        if name.startswith("custom"):  # it computes what it should
            assert mx.array_equal(fn(x), x + 1).item(), name
        b, e, w = chain(fn, start, a.n, a.reps)
        print(f"{name:14s} {b:9.2f} {e:10.2f} {w:8.2f} {b + e + w:9.2f}")


if __name__ == "__main__":
    main()
