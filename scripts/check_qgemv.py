#!/usr/bin/env python3
"""Check mlxcel's quantized GEMV kernel (kernels/qgemv.cu) against MLX.

Runs on a CUDA box with the `mlx` Python package (MLX's CUDA backend):

    python3 scripts/check_qgemv.py            # all 8B and 70B shapes, 4 and 8 bits
    python3 scripts/check_qgemv.py --quick    # two shapes, for iterating on the kernel
    python3 scripts/check_qgemv.py --time     # also wall-clock timing (see below)

For every shape (N, K) a Llama-3.1 8B / 70B decode step multiplies by, for 4 and 8
bits, group sizes 32/64/128 (64 only past the first shape of each model) and batch
M = 1 and 4 (`--ms`: mlxcel uses the kernel up to M = 8, the tensor-core path from M = 5
at 4 bits), it quantizes a random bf16 weight
with `mx.quantize` and compares the kernel with `mx.quantized_matmul` and with
dequantize + matmul in float32 (the reference). Exit status 1 if any result is off.

Kernel times: use scripts/prof_qgemv.py under Nsight Compute. `--time` measures
wall-clock time of many independent calls from Python, which includes MLX's
per-op host overhead (~10-20 µs, comparable to the kernels themselves), so it
understates the kernel's bandwidth on all but the largest shapes.
"""
import argparse
import struct
import math
import os
import pathlib
import sys
import time

import mlx.core as mx

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "kernels" / "qgemv.cu"

SHAPES_8B = [(6144, 4096, "qkv"), (4096, 4096, "o"), (28672, 4096, "gate_up"),
             (4096, 14336, "down"), (128256, 4096, "lm_head")]
# SmolLM2-135M (the default model, a GGUF: float16 on a GPU, groups of 32)
SHAPES_SMOL = [(960, 576, "qkv"), (576, 576, "o"), (3072, 576, "gate_up"), (576, 1536, "down"),
               (49152, 576, "lm_head")]
SHAPES_70B = [(10240, 8192, "qkv"), (8192, 8192, "o"), (57344, 8192, "gate_up"),
              (8192, 28672, "down"), (128256, 8192, "lm_head")]


ROPE_MARK = "// @@body_rope\n"
XQ_MARK = "// @@body_xq\n"
ROPE_KV_MARK = "// @@body_rope_kv\n"
MLP_MARK = "// @@body_mlp\n"
DT = mx.bfloat16  # activations, scales and biases (--dtype)
ROUND_X = None  # the x-rounding kernel of the tensor-core path (make_kernel sets it)
ROPE_KV = None  # the q/k/v entry point that writes the KV pool (make_kernel sets it)


def load_source(path):
    text = path.read_text()
    head, body = text.split("// @@header\n", 1)[1].split("// @@body\n", 1)
    body, body_rope = body.split(ROPE_MARK, 1)
    body_rope, body_xq = body_rope.split(XQ_MARK, 1)
    body_xq, _, body_mlp = body_xq.partition(MLP_MARK)
    body_xq, _, body_rope_kv = body_xq.partition(ROPE_KV_MARK)
    return head, body, body_rope, body_xq, body_rope_kv, body_mlp


def kernel_name(header, body, body_rope, body_xq, body_rope_kv="", body_mlp=""):
    """`mlxcel_qgemv_<FNV-1a of the source>`, as mlxcel names it: MLX caches compiled
    kernels by name (also on disk), so another source must get another name."""
    h = 0xcbf29ce484222325
    for b in (header + body + ROPE_MARK + body_rope + XQ_MARK + body_xq + ROPE_KV_MARK
              + body_rope_kv + MLP_MARK + body_mlp).encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"mlxcel_qgemv_{h & 0xFFFFFFFF:08x}"


def make_kernel(path):
    """The plain kernel (epilogues 0-2) and the q/k/v + RoPE entry point (and ROUND_X)."""
    global ROUND_X
    global ROPE_KV
    header, body, body_rope, body_xq, body_rope_kv, body_mlp = load_source(path)
    name = kernel_name(header, body, body_rope, body_xq, body_rope_kv, body_mlp)
    ROPE_KV = mx.fast.cuda_kernel(
        name=name + "_rope_kv",
        input_names=["x", "w", "scales", "biases", "nw", "pos", "inv_freq", "pool", "dst", "qb"],
        output_names=["q"], source=body_rope_kv, header=header)
    ROUND_X = mx.fast.cuda_kernel(
        name=name + "_xq",
        input_names=["x", "nw"],
        output_names=["xq"],
        source=body_xq,
        header=header,
    )
    plain = mx.fast.cuda_kernel(
        name=name,
        input_names=["x", "w", "scales", "biases", "res", "nw"],
        output_names=["y"],
        source=body,
        header=header,
    )
    rope = mx.fast.cuda_kernel(
        name=name + "_rope",
        input_names=["x", "w", "scales", "biases", "nw", "pos", "inv_freq", "qb"],
        output_names=["q", "kv"],
        source=body_rope,
        header=header,
    )
    return plain, rope


XQ = os.environ.get("MLXCEL_QGEMV_XQ", "1") != "0"  # as mlxcel: int8 activations for 4-bit


MMA_MIN_M = int(os.environ.get("MLXCEL_QGEMV_MMA", "5") or "5")  # as mlxcel; 0: no tensor cores


STREAM = os.environ.get("MLXCEL_QGEMV_STREAM", "1") != "0"  # as mlxcel: the streaming M = 1 path


def stream_config(m, n, k, bits, group=64, pairs=False):
    """ROWS, WPB and PG of the streaming M = 1 path, or None (src/kernels/qgemv.rs
    `stream_config_for`); pairs: the epilogue needs an even ROWS (SwiGLU, RoPE)."""
    if not (STREAM and XQ and bits == 4 and m == 1 and k > STREAM_MIN_K and k % 32 == 0
            and k % group == 0 and MMA_MIN_M != 1):  # (MLXCEL_QGEMV_MMA=1: tensor cores at M = 1)
        return None
    chunks = k // 32
    iters = -(-chunks // (32 * 16))
    wpb = -(-chunks // (32 * iters))

    def fits(rows):
        return n % rows == 0 and 2 * rows * iters * 32 * wpb * 24 <= STREAM_SMEM
    rows = 2 if fits(2) else 1
    if (pairs and rows != 2) or not fits(rows):
        return None
    return rows, wpb, min(n // rows, STREAM_BLOCKS)


STREAM_MIN_K = 8192             # rows of K ≤ this keep the one-block-per-group launch
STREAM_SMEM = 46 * 1024         # what the kernel's stages may take (48 KB less its reductions)
STREAM_BLOCKS = int(os.environ.get("MLXCEL_QGEMV_STREAM_BLOCKS", "264"))


def launch_config(m, n, k, bits, group=64):
    """ROWS, WPB and MMA as mlxcel picks them (src/kernels/qgemv.rs `launch_config_for`);
    `stream_config` may take M = 1 instead."""
    if (XQ and bits == 4 and group in (32, 64, 128) and MMA_MIN_M and m >= MMA_MIN_M
            and n % 16 == 0 and k % 128 == 0):
        steps = k // 128
        wpb = 16 if steps > 64 else 8
        while wpb > 1 and steps < 2 * wpb:
            wpb //= 2
        return 16, wpb, 1

    def fit(r):  # the largest of r, r/2, ..., 1 dividing n
        while n % r:
            r //= 2
        return r
    chunks = k // (128 // bits)

    def loads(rows, wpb):
        return rows * -(-chunks // (32 * wpb))
    if bits == 4 and m == 1 and XQ:
        rows, wpb = (fit(16), 8) if k > 4096 else (fit(8), 4)
        while rows > 4 and loads(rows, wpb) > 16:
            rows = fit(rows // 2)
    elif bits == 4 and m == 1:
        rows, wpb = fit(4 if n >= 16384 else 2), 2
    else:
        rows, wpb = fit(4), 4
    while wpb < 8 and loads(rows, wpb) > 28:
        wpb *= 2
    while rows > 2 and loads(rows, wpb) > 28:
        rows = fit(rows // 2)
    return rows, wpb, 0


XQ_TPB = 256  # threads per block of the rounding kernel (kernels/qgemv.cu)


def round_x(x, group, norm=None):
    """x [m, k] rounded to int8 per group (the tensor-core path's input)."""
    m, k = x.shape
    bpr = -(-(k // 8) // XQ_TPB)
    return ROUND_X(
        inputs=[x, x if norm is None else norm[0]],
        template=[("T", DT), ("M", m), ("K", k), ("G", group),
                  ("NORM", int(norm is not None)),
                  ("EPS_BITS", 0 if norm is None else struct.unpack("<i", struct.pack("<f", norm[1]))[0])],
        grid=(m * bpr * XQ_TPB, 1, 1),
        threadgroup=(XQ_TPB, 1, 1),
        output_shapes=[(m * k // 4 + 2 * 8 * (k // group),)],
        output_dtypes=[mx.uint32],
    )[0]


def launch(m, n, k, bits, group, rows=None, wpb=None, mma=None, pg=None, pairs=False):
    """(rows, wpb, mma, pg): mlxcel's launch (streaming where it streams) unless given;
    another launch is the dp4a/FMA path unless mma=1 or pg > 0 (the streaming path)."""
    if rows is None and mma is None and pg is None:
        sc = stream_config(m, n, k, bits, group, pairs)
        if sc and wpb is None:
            return sc[0], sc[1], 0, sc[2]
        r0, w0, m0 = launch_config(m, n, k, bits, group)
        return r0, wpb or w0, m0, 0
    r0, w0, _ = launch_config(m, n, k, bits, group)
    return rows or r0, wpb or w0, mma or 0, pg or 0


def qgemv(kernel, x, w, s, b, group, bits, rows=None, wpb=None, res=None, swiglu=False,
          norm=None, mma=None, pg=None):
    """EPI 0: x·Wᵀ; 1 (res given): res + x·Wᵀ; 2 (swiglu): silu(g)·u of the halves.
    norm = (weight, eps): RMSNorm of x first, in the kernel. rows/wpb/mma/pg: another
    launch than mlxcel's (mma=1: the tensor-core path; pg > 0: the streaming path's blocks)."""
    m, k = x.shape
    n = w.shape[0]
    rows, wpb, mma, pg = launch(m, n, k, bits, group, rows, wpb, mma, pg, pairs=swiglu)
    epi = 2 if swiglu else (1 if res is not None else 0)
    xin = round_x(x, group, norm) if mma else x
    return kernel(
        inputs=[xin, w, s, b, x if res is None else res, x if norm is None else norm[0]],
        template=[("T", DT), ("M", m), ("N", n), ("K", k), ("G", group),
                  ("BITS", bits), ("ROWS", rows), ("WPB", wpb), ("EPI", epi),
                  ("NORM", int(norm is not None)),
                  ("EPS_BITS", 0 if norm is None else
                   struct.unpack("<i", struct.pack("<f", norm[1]))[0]),
                  ("XQ", int(XQ and bits == 4)), ("MMA", mma), ("PG", pg)],
        grid=((pg or n // rows) * 32 * wpb, 1, 1),
        threadgroup=(32 * wpb, 1, 1),
        output_shapes=[(m, n // 2 if swiglu else n)],
        output_dtypes=[DT],
    )[0]


def qgemv_rope(kernel, x, w, s, b, group, bits, norm, pos, inv_freq, nq, hd, into=False, qb=None):
    """q [M, nq, 1, hd] and kv [M, 2·nkv, 1, hd] of norm(x)·Wᵀ (+ qb, the projection's bias,
    when given) with RoPE on q and k; with `into` the entry point that writes k and v into a
    KV pool (check_gemv.kv_pool), kv then the rows it wrote (check_gemv.pool_rows: NaNs if it
    wrote any other row)."""
    from check_gemv import kv_pool, pool_rows
    m, k = x.shape
    n = w.shape[0]
    rows, wpb, mma, pg = launch(m, n, k, bits, group, pairs=True)
    xin = round_x(x, group, norm) if mma else x
    pool, dst = kv_pool(m, n // hd - nq, hd, DT) if into else (None, None)
    out = (ROPE_KV if into else kernel)(
        inputs=[xin, w, s, b, norm[0], pos, inv_freq] + ([pool, dst] if into else [])
        + [norm[0] if qb is None else qb],
        template=[("T", DT), ("M", m), ("N", n), ("K", k), ("G", group),
                  ("BITS", bits), ("ROWS", rows), ("WPB", wpb), ("NORM", 1),
                  ("EPS_BITS", struct.unpack("<i", struct.pack("<f", norm[1]))[0]),
                  ("HD", hd), ("NQ", nq), ("XQ", int(XQ and bits == 4)), ("MMA", mma),
                  ("PG", pg), ("BIAS", int(qb is not None))],
        grid=((pg or n // rows) * 32 * wpb, 1, 1),
        threadgroup=(32 * wpb, 1, 1),
        output_shapes=[(m, nq, 1, hd)] + ([] if into else [(m, n // hd - nq, 1, hd)]),
        output_dtypes=[DT] * (1 if into else 2),
    )
    if not into:
        return out
    mx.eval(out)
    return out[0], pool_rows(pool, dst)


def check_rope(kernel, n, k, group, bits, ms, nq, hd=128, seed=0):
    """The q/k/v + RoPE entry point against rms_norm, quantized_matmul and MLX's
    fast.rope (base 500000, positions up to 30000), all in float32 for the reference."""
    wq, s, b = quantized(n, k, group, bits, seed)
    wd = mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32)
    nkv = (n // hd - nq) // 2
    base = 500000.0
    inv_freq = mx.array([base ** (-2.0 * i / hd) for i in range(hd // 2)], dtype=mx.float32)
    rows = []
    for m in ms:
        x = mx.random.normal((m, k)).astype(DT)
        nw = (1 + 0.1 * mx.random.normal((k,))).astype(DT)
        pos = mx.array([7, 30000, 4095, 1, 0, 12, 999, 2][:m], dtype=mx.int32)
        xf = x.astype(mx.float32)
        xn = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + 1e-5) * nw.astype(mx.float32)

        def heads_rope(y):  # y [m, n] -> q, kv as the kernel lays them out, RoPE per row
            y = y.reshape(m, n // hd, 1, hd)
            qk = mx.concatenate([mx.fast.rope(y[i:i + 1, : nq + nkv], hd, traditional=False,
                                              base=base, scale=1.0, offset=int(pos[i].item()))
                                 for i in range(m)], axis=0)
            return qk[:, :nq], mx.concatenate([qk[:, nq:], y[:, nq + nkv:]], axis=1)

        ref_q, ref_kv = heads_rope(xn @ wd.T)
        q, kv = qgemv_rope(kernel, x, wq, s, b, group, bits, (nw, 1e-5), pos, inv_freq, nq, hd)
        qmm = mx.quantized_matmul(mx.fast.rms_norm(x, nw, 1e-5), wq, s, b, transpose=True,
                                  group_size=group, bits=bits)
        mq, mkv = heads_rope(qmm)
        e = max(rel_err(q, ref_q), rel_err(kv, ref_kv))
        eq = max(rel_err(mq, ref_q), rel_err(mkv, ref_kv))
        rows.append((m, " norm+rope", e, eq, within(e, eq, bits)))
        if m <= 8:  # the entry point that writes k and v into a KV pool (no row chunks)
            q2, kv2 = qgemv_rope(kernel, x, wq, s, b, group, bits, (nw, 1e-5), pos, inv_freq,
                                 nq, hd, into=True)
            e2 = max(rel_err(q2, ref_q), rel_err(kv2, ref_kv))
            rows.append((m, " norm+rope into pool", e2, eq, within(e2, eq, bits)))
            # with the projection's bias (Qwen2), added before RoPE
            qb = (0.5 * mx.random.normal((n,))).astype(DT)
            ref_qb, ref_kvb = heads_rope(xn @ wd.T + qb.astype(mx.float32))
            mqb, mkvb = heads_rope(qmm + qb)
            q3, kv3 = qgemv_rope(kernel, x, wq, s, b, group, bits, (nw, 1e-5), pos, inv_freq,
                                 nq, hd, into=True, qb=qb)
            e3 = max(rel_err(q3, ref_qb), rel_err(kv3, ref_kvb))
            eqb = max(rel_err(mqb, ref_qb), rel_err(mkvb, ref_kvb))
            rows.append((m, " norm+rope+bias into pool", e3, eqb, within(e3, eqb, bits)))
    return rows


def within(e, e_mlx, bits):
    """The kernel's error is MLX's order: at most 1e-2 and 2× MLX's + 4e-3; with int8
    activations (4-bit, XQ) x itself carries a rounding of up to 1/254 of its chunk's
    largest value, so 2e-2 and 3× MLX's + 6e-3."""
    if XQ and bits == 4:
        return e <= 2e-2 and e <= 3 * e_mlx + 6e-3
    return e <= 1e-2 and e <= 2 * e_mlx + 4e-3


def rel_err(a, ref):
    a = a.astype(mx.float32)
    return (mx.abs(a - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-6)).item()


def quantized(n, k, group, bits, seed):
    mx.random.seed(seed)
    w = (mx.random.normal((n, k)) * 0.02).astype(DT)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    mx.eval(wq, s, b)
    return wq, s, b


def check(kernel, n, k, group, bits, ms, seed=0):
    wq, s, b = quantized(n, k, group, bits, seed)
    wd = mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32)
    rows = []
    for m in ms:
        x = mx.random.normal((m, k)).astype(DT)
        ref = x.astype(mx.float32) @ wd.T
        ours = qgemv(kernel, x, wq, s, b, group, bits)
        qmm = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
        mx.eval(ref, ours, qmm)
        e_ours, e_qmm = rel_err(ours, ref), rel_err(qmm, ref)
        ok = within(e_ours, e_qmm, bits)
        rows.append((m, "", e_ours, e_qmm, ok))
        # fused epilogues against the same ops done by MLX after quantized_matmul
        res = mx.random.normal((m, n)).astype(DT)
        ref_res = res.astype(mx.float32) + ref
        e1 = rel_err(qgemv(kernel, x, wq, s, b, group, bits, res=res), ref_res)
        e1q = rel_err(res + qmm, ref_res)
        rows.append((m, " +res", e1, e1q, within(e1, e1q, bits)))
        if n % 4 == 0:
            g, u = ref[:, : n // 2], ref[:, n // 2:]
            ref_glu = g * mx.sigmoid(g) * u
            e2 = rel_err(qgemv(kernel, x, wq, s, b, group, bits, swiglu=True), ref_glu)
            gq, uq = qmm[:, : n // 2], qmm[:, n // 2:]
            e2q = rel_err(nn_silu(gq) * uq, ref_glu)
            rows.append((m, " swiglu", e2, e2q, within(e2, e2q, bits)))
        # RMSNorm of x in the kernel, against MLX's rms_norm then quantized_matmul
        nw = (1 + 0.1 * mx.random.normal((k,))).astype(DT)
        xf = x.astype(mx.float32)
        xn = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + 1e-5) * nw.astype(mx.float32)
        ref_n = xn @ wd.T
        e3 = rel_err(qgemv(kernel, x, wq, s, b, group, bits, norm=(nw, 1e-5)), ref_n)
        e3q = rel_err(mx.quantized_matmul(mx.fast.rms_norm(x, nw, 1e-5), wq, s, b, transpose=True,
                                          group_size=group, bits=bits), ref_n)
        rows.append((m, " norm", e3, e3q, within(e3, e3q, bits)))
    return rows


def nn_silu(x):
    return x * mx.sigmoid(x)


def bench(fn, reps=5):
    best = math.inf
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def timing(kernel, n, k, group, bits, m, rows=None, wpb=None, budget=512e6):
    wq, s, b = quantized(n, k, group, bits, 1)
    nbytes = wq.nbytes + s.nbytes + b.nbytes
    copies = max(2, math.ceil(budget / nbytes))
    ws = [(wq + i, s, b) for i in range(copies)]  # distinct weight buffers (uint32 + i)
    mx.eval(ws)
    x = mx.random.normal((m, k)).astype(DT)
    ours = bench(lambda: [qgemv(kernel, x, w, s_, b_, group, bits, rows, wpb) for w, s_, b_ in ws])
    qmm = bench(lambda: [mx.quantized_matmul(x, w, s_, b_, transpose=True, group_size=group,
                                             bits=bits) for w, s_, b_ in ws])
    return nbytes * copies / ours / 1e12, nbytes * copies / qmm / 1e12, ours / copies * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", type=pathlib.Path, default=SOURCE)
    ap.add_argument("--quick", action="store_true", help="two 8B shapes, 4-bit g64 only")
    ap.add_argument("--only", choices=["8B", "70B", "SmolLM2"], help="only this model's shapes")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                    help="activations, scales and biases (float16: GGUF models on a GPU)")
    ap.add_argument("--skip", default="", help="comma-separated shape names to leave out (e.g. qkv,o)")
    ap.add_argument("--time", action="store_true", help="also wall-clock timing (host-bound)")
    ap.add_argument("--ms", default="1,4", type=lambda v: tuple(int(i) for i in v.split(",")),
                    help="batch sizes M to check (default 1,4; the tensor-core path takes M ≥ 5 at 4 bits)")
    ap.add_argument("--configs", type=lambda v: [tuple(map(int, c.split("g"))) for c in v.split(",")],
                    help="bits and groups to check, e.g. 4g32,4g128 (all groups on every shape)")
    ap.add_argument("--sweep", action="store_true",
                    help="only time launch shapes (ROWS × WPB) on the 8B shapes, to pick defaults")
    args = ap.parse_args()
    global DT
    DT = getattr(mx, args.dtype)
    if not mx.cuda.is_available():
        sys.exit("check_qgemv: needs MLX's CUDA backend")
    kernel, rope_kernel = make_kernel(args.source)
    shapes = [(6144, 4096, "8B qkv"), (4096, 14336, "8B down")] if args.quick else \
        [(n, k, "8B " + t) for n, k, t in SHAPES_8B] + [(n, k, "70B " + t) for n, k, t in SHAPES_70B] + \
        [(n, k, "SmolLM2 " + t) for n, k, t in SHAPES_SMOL]
    if args.only:
        shapes = [sh for sh in shapes if sh[2].startswith(args.only + " ")]
    skip = {t for t in args.skip.split(",") if t}
    shapes = [sh for sh in shapes if sh[2].split(" ", 1)[1] not in skip]
    configs = args.configs or ([(4, 64)] if args.quick else [(4, 64), (8, 64), (4, 32), (4, 128), (8, 32), (8, 128)])
    bad = 0
    if args.sweep:
        shapes = [(n, k, "8B " + t) for n, k, t in SHAPES_8B]
    print("## correctness: max |y - ref| / max |ref|, ref = x·dequantize(w)ᵀ in float32")
    print("| shape (N×K) | bits | group | M | qgemv | quantized_matmul | ok |")
    print("|---|---|---|---|---|---|---|")
    for n, k, name in ([] if args.sweep else shapes):
        for bits, group in configs:
            # all group sizes on the first shape of each model, group 64 on the rest
            if group != 64 and not name.endswith("qkv") and not args.configs:
                continue
            found = check(kernel, n, k, group, bits, args.ms)
            if name.startswith("SmolLM2") and name.endswith("qkv"):  # 9 query, 3 KV heads of 64
                found += check_rope(rope_kernel, n, k, group, bits, args.ms, nq=9, hd=64)
            elif name.endswith("qkv"):  # 32 (8B) or 64 (70B) query heads, 8 KV heads of 128
                found += check_rope(rope_kernel, n, k, group, bits, args.ms, nq=n // 128 - 16)
            for m, epi, e1, e2, ok in found:
                bad += not ok
                lc = launch(m, n, k, bits, group)
                path = "mma" if lc[2] else ("stream" if lc[3] else "dp")
                print(f"| {name} {n}×{k}{epi} | {bits} | {group} | {m} {path} | {e1:.2e} | {e2:.2e} | "
                      f"{'yes' if ok else 'NO'} |")
    if args.time:
        print()
        print("## wall-clock bandwidth incl. MLX per-op overhead (TB/s; weights+scales+biases once per call)")
        print("| shape (N×K) | bits | M | qgemv TB/s | µs/call | quantized_matmul TB/s | speed-up |")
        print("|---|---|---|---|---|---|---|")
    for n, k, name in (shapes if args.time and not args.sweep else []):
        for bits in ((4,) if args.quick else (4, 8)):
            for m in (1, 4):
                ours, qmm, us = timing(kernel, n, k, 64, bits, m)
                print(f"| {name} {n}×{k} | {bits} | {m} | {ours:.2f} | {us:.1f} | {qmm:.2f} | "
                      f"{ours / qmm:.1f}× |")
    if args.sweep:
        print()
        print("## sweep (4-bit g64): rows per block (ROWS) × warps per block (WPB) → TB/s")
        for n, k, name in shapes[:4]:
            for m in (1, 8):
                for rows in (1, 2, 4):
                    line = [f"WPB={wpb} {timing(kernel, n, k, 64, 4, m, rows, wpb)[0]:.2f}"
                            for wpb in (1, 2, 4, 8)]
                    print(f"{name} M={m} ROWS={rows}: " + ", ".join(line), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
