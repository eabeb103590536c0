#!/usr/bin/env python3
"""Check mlxcel's dense GEMV kernel (kernels/gemv.cu) against MLX ops, and time it.

Runs on a CUDA box with the `mlx` Python package (MLX's CUDA backend):

    python3 scripts/check_gemv.py            # 8B and 70B-rank (TP=8, TP=4) shapes, bf16
    python3 scripts/check_gemv.py --quick    # two shapes, for iterating on the kernel
    python3 scripts/check_gemv.py --dtype float16
    python3 scripts/check_gemv.py --time     # also bandwidth against MLX's matmul
    python3 scripts/check_gemv.py --sweep    # time ROWS × WPB launches on the large shapes
    python3 scripts/check_gemv.py --mma --ms 4,8,16   # the tensor-core path (MMA = 1) at every M

For every shape (N, K) a Llama-3.1-8B decode step, one rank of Llama-3-70B at TP=8 (8 query
heads, 1 KV head, intermediate 3584) and at TP=4 (16, 2, 7168) multiply by, and batch
M = 1, 3, 8 (`--ms`; up to 16 on the tensor-core path), it takes a random weight of the dtype and compares the kernel with
`x @ w.T` in MLX and with the float32 product (the reference): the plain product, the
residual add, SwiGLU over merged gate/up rows, the RMSNorm prologue, and (q/k/v shapes) the
merged q/k/v projection with RoPE against `mx.fast.rope`. Exit status 1 if any result is off.

The launch is mlxcel's (`launch_config`, which reads MLXCEL_GEMV_MMA / MLXCEL_GEMV_MMA_MAX as
the engine does); `--mma` puts every M on the tensor-core path. `--time` prints the CUDA-core
path (M ≤ 8), the tensor-core path and MLX's matmul side by side.

`--time` reports wall-clock bandwidth of many independent calls in one evaluation, which
includes MLX's host work per op (~10-20 µs), so it understates the kernel on small shapes;
kernel times on the GPU come from Nsight (`nsys`/`ncu`) around this script. The issue's
target is ≥ 3.5 TB/s on the large shapes (gate/up, down, lm_head).
"""
import argparse
import math
import os
import pathlib
import struct
import sys
import time

import mlx.core as mx

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "kernels" / "gemv.cu"

ROPE_MARK = "// @@body_rope\n"
ROPE_KV_MARK = "// @@body_rope_kv\n"
DT = mx.bfloat16  # weights, activations and outputs (--dtype)
ROPE_KV = None  # the q/k/v entry point that writes the KV pool (make_kernel sets it)

# (N, K, name, query heads for the q/k/v shape or None)
SHAPES_8B = [(6144, 4096, "qkv", 32), (4096, 4096, "o", None), (28672, 4096, "gate_up", None),
             (4096, 14336, "down", None), (128256, 4096, "lm_head", None)]
SHAPES_70B_TP8 = [(1280, 8192, "qkv", 8), (8192, 1024, "o", None), (7168, 8192, "gate_up", None),
                  (8192, 3584, "down", None), (128256, 8192, "lm_head", None)]
SHAPES_70B_TP4 = [(2560, 8192, "qkv", 16), (8192, 2048, "o", None), (14336, 8192, "gate_up", None),
                  (8192, 7168, "down", None)]


def load_source(path):
    text = path.read_text()
    head, body = text.split("// @@header\n", 1)[1].split("// @@body\n", 1)
    body, body_rope = body.split(ROPE_MARK, 1)
    body_rope, _, body_rope_kv = body_rope.partition(ROPE_KV_MARK)
    return head, body, body_rope, body_rope_kv


def kernel_name(header, body, body_rope, body_rope_kv):
    """`mlxcel_gemv_<FNV-1a of the source>`, as src/kernels/gemv.rs names it."""
    h = 0xcbf29ce484222325
    for b in (header + body + ROPE_MARK + body_rope + ROPE_KV_MARK + body_rope_kv).encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"mlxcel_gemv_{h & 0xFFFFFFFF:08x}"


def make_kernel(path):
    global ROPE_KV
    header, body, body_rope, body_rope_kv = load_source(path)
    name = kernel_name(header, body, body_rope, body_rope_kv)
    ROPE_KV = mx.fast.cuda_kernel(
        name=name + "_rope_kv", input_names=["x", "w", "nw", "pos", "inv_freq", "pool", "dst", "qb"],
        output_names=["q"], source=body_rope_kv, header=header)
    plain = mx.fast.cuda_kernel(name=name, input_names=["x", "w", "res", "nw"], output_names=["y"],
                                source=body, header=header)
    rope = mx.fast.cuda_kernel(name=name + "_rope", input_names=["x", "w", "nw", "pos", "inv_freq", "qb"],
                               output_names=["q", "kv"], source=body_rope, header=header)
    return plain, rope


MMA_LOADS = 8  # src/kernels/gemv.rs MMA_LOADS


def mma_launch(n, k):
    """ROWS, WPB and MMA of the tensor-core path (src/kernels/gemv.rs `mma_launch`)."""
    tiles = 2 if n >= 8192 and n % 32 == 0 else 1
    rows = 16 * tiles
    chunks = -(-k // 32)
    per_round = max(1, MMA_LOADS // (2 * tiles))
    wpb = 16 if n // rows < 256 else 8
    while wpb > 1 and chunks < wpb * per_round:
        wpb //= 2
    return rows, wpb, 1


def takes_mma(m, n):
    """Whether mlxcel puts M rows on the tensor-core path (MLXCEL_GEMV_MMA from, 0 off by
    default; MLXCEL_GEMV_MMA_MAX to, default 8; --mma: every M)."""
    lo = 1 if ALL_MMA else int(os.environ.get("MLXCEL_GEMV_MMA", "0"))
    hi = 16 if ALL_MMA else int(os.environ.get("MLXCEL_GEMV_MMA_MAX", "8"))
    return n % 16 == 0 and 0 < lo <= m <= hi


ALL_MMA = False  # --mma


def launch_config(m, n, k):
    """ROWS, WPB and MMA as mlxcel picks them (src/kernels/gemv.rs `launch_config`; the
    previous launch with MLXCEL_GEMV_WIDE=0 in the environment)."""
    if takes_mma(m, n) or m > 8:  # (the CUDA-core path takes at most 8 rows)
        return mma_launch(n, k)
    return cuda_core_launch(m, n, k) + (0,)


def cuda_core_launch(m, n, k):
    """ROWS and WPB of the CUDA-core path."""
    def fit(r):
        while n % r:
            r //= 2
        return max(r, 1)
    vectors = k // 8
    if os.environ.get("MLXCEL_GEMV_WIDE", "1") != "0":
        wpb = 4
        while wpb < 16 and -(-vectors // (32 * wpb)) > 4:
            wpb *= 2
        iters = max(1, -(-vectors // (32 * wpb)))
        return fit(2 if m > 4 else min(4, max(2, 8 // iters))), wpb
    r = fit(4 if m <= 4 else 2)
    wpb = 4
    while wpb < 8 and -(-vectors // (32 * wpb)) > 8:
        wpb *= 2
    return r, wpb


def eps_bits(eps):
    return struct.unpack("<i", struct.pack("<f", eps))[0]


def gemv(kernel, x, w, res=None, swiglu=False, norm=None, rows=None, wpb=None, launch=None):
    m, k = x.shape
    n = w.shape[0]
    r0, w0, mma = launch or launch_config(m, n, k)
    rows, wpb = rows or r0, wpb or w0
    epi = 2 if swiglu else (1 if res is not None else 0)
    return kernel(
        inputs=[x, w, x if res is None else res, x if norm is None else norm[0]],
        template=[("T", DT), ("M", m), ("N", n), ("K", k), ("ROWS", rows), ("WPB", wpb),
                  ("EPI", epi), ("NORM", int(norm is not None)),
                  ("EPS_BITS", 0 if norm is None else eps_bits(norm[1])), ("MMA", mma)],
        grid=(n // rows * 32 * wpb, 1, 1),
        threadgroup=(32 * wpb, 1, 1),
        output_shapes=[(m, n // 2 if swiglu else n)],
        output_dtypes=[DT],
    )[0]


def gemv_rope(kernel, x, w, norm, pos, inv_freq, nq, hd, rows=None, wpb=None, into=False, qb=None):
    """q and kv of the q/k/v + RoPE entry point (qb: the projection's bias, added before
    RoPE); with `into` the one that writes k and v into a KV pool ([`kv_pool`]), kv then the
    rows it wrote ([`pool_rows`])."""
    m, k = x.shape
    n = w.shape[0]
    r0, w0, mma = launch_config(m, n, k)
    rows, wpb = rows or r0, wpb or w0
    pool, dst = kv_pool(m, n // hd - nq, hd, DT) if into else (None, None)
    out = (ROPE_KV if into else kernel)(
        inputs=[x, w, norm[0], pos, inv_freq] + ([pool, dst] if into else [])
        + [norm[0] if qb is None else qb],
        template=[("T", DT), ("M", m), ("N", n), ("K", k), ("ROWS", rows), ("WPB", wpb),
                  ("NORM", 1), ("EPS_BITS", eps_bits(norm[1])), ("HD", hd), ("NQ", nq),
                  ("MMA", mma), ("BIAS", int(qb is not None))],
        grid=(n // rows * 32 * wpb, 1, 1),
        threadgroup=(32 * wpb, 1, 1),
        output_shapes=[(m, nq, 1, hd)] + ([] if into else [(m, n // hd - nq, 1, hd)]),
        output_dtypes=[DT] * (1 if into else 2),
    )
    if not into:
        return out
    mx.eval(out)
    return out[0], pool_rows(pool, dst)


def rel_err(a, ref):
    a = a.astype(mx.float32)
    return (mx.abs(a - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-6)).item()


def within(e, e_mlx):
    """Float32 sums of the same 16-bit products: the error is the output's rounding, MLX's
    order (at most 1e-2 and 2× MLX's + 4e-3)."""
    return e <= 1e-2 and e <= 2 * e_mlx + 4e-3


def weight(n, k, seed):
    mx.random.seed(seed)
    w = (mx.random.normal((n, k)) * 0.02).astype(DT)
    mx.eval(w)
    return w


def rms(x, nw, eps=1e-5):
    xf = x.astype(mx.float32)
    return xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps) * nw.astype(mx.float32)


def check(kernel, rope_kernel, n, k, nq, ms, seed=0):
    w = weight(n, k, seed)
    wf = w.astype(mx.float32)
    rows = []
    for m in ms:
        x = mx.random.normal((m, k)).astype(DT)
        ref = x.astype(mx.float32) @ wf.T
        mm = x @ w.T
        e, em = rel_err(gemv(kernel, x, w), ref), rel_err(mm, ref)
        rows.append((m, "", e, em, within(e, em)))
        res = mx.random.normal((m, n)).astype(DT)
        ref_res = res.astype(mx.float32) + ref
        e, em = rel_err(gemv(kernel, x, w, res=res), ref_res), rel_err(res + mm, ref_res)
        rows.append((m, " +res", e, em, within(e, em)))
        if n % 4 == 0:
            g, u = ref[:, : n // 2], ref[:, n // 2:]
            ref_glu = g * mx.sigmoid(g) * u
            gm, um = mm[:, : n // 2], mm[:, n // 2:]
            e = rel_err(gemv(kernel, x, w, swiglu=True), ref_glu)
            em = rel_err(gm * mx.sigmoid(gm) * um, ref_glu)
            rows.append((m, " swiglu", e, em, within(e, em)))
        nw = (1 + 0.1 * mx.random.normal((k,))).astype(DT)
        ref_n = rms(x, nw) @ wf.T
        e = rel_err(gemv(kernel, x, w, norm=(nw, 1e-5)), ref_n)
        em = rel_err(mx.fast.rms_norm(x, nw, 1e-5) @ w.T, ref_n)
        rows.append((m, " norm", e, em, within(e, em)))
        if nq is not None:
            rows.append(check_rope(rope_kernel, x, w, wf, nw, n, nq, m))
    return rows


def check_rope(kernel, x, w, wf, nw, n, nq, m, hd=128, base=500000.0):
    nkv = (n // hd - nq) // 2
    inv_freq = mx.array([base ** (-2.0 * i / hd) for i in range(hd // 2)], dtype=mx.float32)
    pos = mx.array(([7, 30000, 4095, 1, 0, 12, 999, 2] * 2)[:m], dtype=mx.int32)

    def heads_rope(y):  # y [m, n] -> q, kv as the kernel lays them out, RoPE per row
        y = y.reshape(m, n // hd, 1, hd)
        qk = mx.concatenate([mx.fast.rope(y[i:i + 1, : nq + nkv], hd, traditional=False, base=base,
                                          scale=1.0, offset=int(pos[i].item())) for i in range(m)], axis=0)
        return qk[:, :nq], mx.concatenate([qk[:, nq:], y[:, nq + nkv:]], axis=1)

    ref_q, ref_kv = heads_rope(rms(x, nw) @ wf.T)
    q, kv = gemv_rope(kernel, x, w, (nw, 1e-5), pos, inv_freq, nq, hd)
    mq, mkv = heads_rope(mx.fast.rms_norm(x, nw, 1e-5) @ w.T)
    e = max(rel_err(q, ref_q), rel_err(kv, ref_kv))
    em = max(rel_err(mq, ref_q), rel_err(mkv, ref_kv))
    # the entry point that writes k and v into a KV pool: the same values at the given rows
    q2, kv2 = gemv_rope(kernel, x, w, (nw, 1e-5), pos, inv_freq, nq, hd, into=True)
    e2 = max(rel_err(q2, ref_q), rel_err(kv2, ref_kv))
    # and with the projection's bias (Qwen2), added before RoPE
    qb = (0.5 * mx.random.normal((n,))).astype(DT)
    ref_qb, ref_kvb = heads_rope(rms(x, nw) @ wf.T + qb.astype(mx.float32))
    mqb, mkvb = heads_rope(mx.fast.rms_norm(x, nw, 1e-5) @ w.T + qb)
    q3, kv3 = gemv_rope(kernel, x, w, (nw, 1e-5), pos, inv_freq, nq, hd, into=True, qb=qb)
    e3 = max(rel_err(q3, ref_qb), rel_err(kv3, ref_kvb))
    em3 = max(rel_err(mqb, ref_qb), rel_err(mkvb, ref_kvb))
    return (m, " norm+rope(+bias)", max(e, e2, e3), max(em, em3), within(max(e, e2, e3), max(em, em3)))


def kv_pool(m, nkv2, hd, dt):
    """A KV pool [1, nkv2, R, hd] of -7 for a pool-writing q/k/v entry point (R = 2·M + 5)
    and the rows it is to write, batch row i at R - 1 - 2i (int32)."""
    r = 2 * m + 5
    pool = mx.full((1, nkv2, r, hd), -7.0, dtype=dt)
    dst = mx.array([r - 1 - 2 * i for i in range(m)], dtype=mx.int32)
    mx.eval(pool, dst)
    return pool, dst


def pool_rows(pool, dst):
    """The rows `dst` of `pool` as kv [M, nkv2, 1, hd]; NaNs if any other row was written."""
    at = dst.tolist()
    untouched = [i for i in range(pool.shape[2]) if i not in at]
    if untouched and (pool[0][:, untouched] != -7.0).any().item():
        return mx.full((len(at), pool.shape[1], 1, pool.shape[3]), float("nan"))
    return pool[0][:, dst].transpose(1, 0, 2)[:, :, None]


def bench(fn, reps=5):
    best = math.inf
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def timing(kernel, n, k, m, rows=None, wpb=None, budget=1e9, launches=None):
    """TB/s of each launch in `launches` (default: mlxcel's) and of MLX's matmul, and µs per
    call of the first."""
    w0 = weight(n, k, 1)
    copies = max(2, math.ceil(budget / w0.nbytes))
    ws = [w0 + i for i in range(copies)]  # distinct weight buffers
    mx.eval(ws)
    x = mx.random.normal((m, k)).astype(DT)
    ours = [bench(lambda: [gemv(kernel, x, w, rows=rows, wpb=wpb, launch=l) for w in ws])
            for l in (launches or [None])]
    mm = bench(lambda: [x @ w.T for w in ws])
    return [w0.nbytes * copies / t / 1e12 for t in ours], w0.nbytes * copies / mm / 1e12, \
        ours[0] / copies * 1e6


def main():
    # (line by line even into a pipe: a run cut by a time limit still shows its results)
    sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", type=pathlib.Path, default=SOURCE)
    ap.add_argument("--quick", action="store_true", help="two 8B shapes")
    ap.add_argument("--only", choices=["8B", "70B-TP8", "70B-TP4"], help="only this model's shapes")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--ms", default="1,3,8", type=lambda v: tuple(int(i) for i in v.split(",")),
                    help="batch sizes M to check (1-8; 1-16 with --mma)")
    ap.add_argument("--mma", action="store_true", help="every M on the tensor-core path")
    ap.add_argument("--time", action="store_true", help="also wall-clock bandwidth against x @ w.T")
    ap.add_argument("--sweep", action="store_true", help="only time ROWS × WPB on the large shapes")
    ap.add_argument("--no-check", action="store_true",
                    help="with --time: time only (the correctness table of every shape takes minutes)")
    args = ap.parse_args()
    global DT, ALL_MMA
    DT = getattr(mx, args.dtype)
    ALL_MMA = args.mma
    if not mx.cuda.is_available():
        sys.exit("check_gemv: needs MLX's CUDA backend")
    kernel, rope_kernel = make_kernel(args.source)
    shapes = [(n, k, "8B " + t, q) for n, k, t, q in SHAPES_8B] + \
        [(n, k, "70B-TP8 " + t, q) for n, k, t, q in SHAPES_70B_TP8] + \
        [(n, k, "70B-TP4 " + t, q) for n, k, t, q in SHAPES_70B_TP4]
    if args.quick:
        shapes = [shapes[0], shapes[3]]
    if args.only:
        shapes = [sh for sh in shapes if sh[2].startswith(args.only + " ")]
    bad = 0
    if not args.sweep and not (args.no_check and args.time):
        print(f"## correctness ({args.dtype}): max |y - ref| / max |ref|, ref = x·wᵀ in float32")
        print("| shape (N×K) | M | ROWS×WPB | gemv | MLX ops | ok |")
        print("|---|---|---|---|---|---|")
        for n, k, name, nq in shapes:
            for m, epi, e, em, ok in check(kernel, rope_kernel, n, k, nq, args.ms):
                bad += not ok
                r, wp, mma = launch_config(m, n, k)
                print(f"| {name} {n}×{k}{epi} | {m} | {r}×{wp}{' mma' if mma else ''} | {e:.2e} | {em:.2e} | "
                      f"{'yes' if ok else 'NO'} |", flush=True)
    if args.time and not args.sweep:
        print()
        print("## wall-clock bandwidth incl. MLX per-op host work (TB/s, the weight read once a call)")
        print("| shape (N×K) | M | CUDA cores TB/s | tensor cores TB/s | µs/call (mlxcel's launch) "
              "| x @ w.T TB/s | mlxcel's launch / x @ w.T |")
        print("|---|---|---|---|---|---|---|")
        for n, k, name, _ in shapes:
            for m in args.ms:
                paths = ([cuda_core_launch(m, n, k) + (0,)] if m <= 8 else []) + \
                    ([mma_launch(n, k)] if n % 16 == 0 else [])
                tbs, mm, us = timing(kernel, n, k, m, launches=[launch_config(m, n, k)] + paths)
                cc = f"{tbs[1]:.2f}" if m <= 8 else "—"
                tc = f"{tbs[-1]:.2f}" if n % 16 == 0 else "—"
                print(f"| {name} {n}×{k} | {m} | {cc} | {tc} | {us:.1f} | {mm:.2f} | {tbs[0] / mm:.2f}× |",
                      flush=True)
    if args.sweep:
        print("## sweep: rows per block (ROWS) × warps per block (WPB) → TB/s")
        for n, k, name, _ in shapes:
            if not any(t in name for t in ("gate_up", "down", "lm_head")):
                continue
            for m in (1, 8):
                for rows in (1, 2, 4, 8):
                    if n % rows:
                        continue
                    line = [f"WPB={wpb} {timing(kernel, n, k, m, rows, wpb)[0][0]:.2f}" for wpb in (2, 4, 8, 16)]
                    print(f"{name} M={m} ROWS={rows}: " + ", ".join(line), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
