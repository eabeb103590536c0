#!/usr/bin/env python3
"""Check mlxcel's quantized GEMM (kernels/qgemm.cu) against MLX, and time it.

Runs on a CUDA box with the `mlx` Python package (MLX's CUDA backend):

    python3 scripts/check_qgemm.py            # every 8B and 70B-rank shape, M = 9..128, 4 and 8 bits
    python3 scripts/check_qgemm.py --time     # also µs per call against MLX and the GEMV's row chunks
    python3 scripts/check_qgemm.py --quick    # two 8B shapes, 4-bit, M = 16 and 64
    python3 scripts/check_qgemm.py --sweep    # time other launches (ring stages ST, splits SK) on the 8B shapes

For every shape (N×K) of a Llama-3.1 8B decode step and of one 70B rank at TP 8 and TP 4,
4 and 8 bits (group 64; `--groups` adds others) and M = 5, 9, 16, 32, 64, 128 batch rows, it
quantizes a random bf16 weight with `mx.quantize` and compares the kernel with
`mx.dequantize` + matmul in float32 (the reference) and with `mx.quantized_matmul`; at M = 16
and 128 also the shape's fused epilogue (q/k/v: RMSNorm + RoPE; o, down: the residual;
gate/up: RMSNorm + SwiGLU). Exit status 1 if any result is off.

MLX compiles every variant (one per shape, bits, tile of 8 rows and epilogue) at its first
use, a few seconds each, so the shapes are shared out over `--jobs` processes (default 8);
with `--time` they then take turns on the GPU (a lock), each timing its shapes: the GEMM,
what mlxcel runs there without it (the GEMV on row chunks of ≤ 8 at 4 bits up to 32 rows,
`quantized_matmul` at 8 bits below 32 rows, dequantize + matmul from 32 rows) and
`quantized_matmul`, as µs per call and the weight bytes over that time (wall clock over
many calls on distinct weight copies, MLX's host work per op included: a lower bound on the
kernels' bandwidth at small shapes; Nsight gives kernel times).

The GEMM's launch follows src/kernels/qgemm.rs (`launch_for`); `MLXCEL_QGEMM_SOURCE=path`
checks another kernel file, `MLXCEL_QGEMM_SPLITK=n` caps the splits and
`MLXCEL_QGEMM_FILL=1` splits K as before `split_cost`, and
`MLXCEL_QGEMM_BOUNDED=1` takes launches of up to 32 rows (two warps per row of tiles) in
the 128-register flavour and `MLXCEL_QGEMM_WGMMA=0` the `mma.sync` flavour instead of the
warpgroup-MMA one (one warp per row of tiles up to 64 rows; the kernel uses it on sm_90a),
as for mlxcel.
"""
import argparse
import math
import multiprocessing as mp
import os
import pathlib
import queue
import struct
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

# (N, K, name, query heads for RoPE) per model
SHAPES = {
    "8B": [(6144, 4096, "qkv", 32), (4096, 4096, "o", 0), (28672, 4096, "gate_up", 0),
           (4096, 14336, "down", 0)],
    "70B-TP8": [(1280, 8192, "qkv", 8), (8192, 1024, "o", 0), (7168, 8192, "gate_up", 0),
                (8192, 3584, "down", 0)],
    "70B-TP4": [(2560, 8192, "qkv", 16), (8192, 2048, "o", 0), (14336, 8192, "gate_up", 0),
                (8192, 7168, "down", 0)],
}
ROPE_MARK = "// @@body_rope\n"
MAX_SPLITS = 16      # src/kernels/qgemm.rs
MIN_SPLIT_STEPS = 2
RING_BYTES = int(os.environ.get("MLXCEL_QGEMM_RING_BYTES") or 115_072)  # src/kernels/qgemm.rs, the knob as there
MIN_STAGES, MAX_STAGES = 2, 6


def block_shared_overhead(mt):
    """src/kernels/qgemm.rs `block_shared_overhead`: the driver's 1 KB a block, Σ x², a flag."""
    return 1024 + 4 * mt + 32


SMS = int(os.environ.get("MLXCEL_QGEMM_SMS", "132"))  # H200 / H100 SXM
SMEM = 228 * 1024  # shared memory an sm_90 SM holds (src/kernels/gpu.rs)
BOUNDED = os.environ.get("MLXCEL_QGEMM_BOUNDED") == "1"
WGMMA = os.environ.get("MLXCEL_QGEMM_WGMMA", "1") != "0"
WGMMA_PREFIX = "#define MLXCEL_QGEMM_WGMMA 1\n"  # src/kernels/qgemm.rs
WGMMA_MAX_M = 64  # src/kernels/qgemm.rs
FILL = os.environ.get("MLXCEL_QGEMM_FILL") == "1"
WIDE = os.environ.get("MLXCEL_QGEMM_WIDE", "1") != "0"
BLOCK_WARPS, NARROW_BLOCK_WARPS = 8, 4  # src/kernels/qgemm.rs
BLOCK_OVERHEAD_STEPS = 4  # src/kernels/qgemm.rs
BOUNDED_MAX_M = 32  # src/kernels/qgemm.rs
BOUNDED_PREFIX = ("#define MLXCEL_QGEMM_BOUNDED 1\n#if defined(__CUDA_ARCH__)\n#undef __global__\n"
                  "#define __global__ __location__(global) __launch_bounds__(256, 2)\n#endif\n")


def fnv1a32(text):
    h = 0xcbf29ce484222325
    for b in text.encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h & 0xFFFFFFFF


def sources(bounded=False, wgmma=False):
    """(name, header, body, body_rope): the GEMV's header then the GEMM's, as mlxcel
    passes them, named as mlxcel names them (`bounded`: the 128-register flavour; `wgmma`:
    the warpgroup-MMA one)."""
    gemv = (ROOT / "kernels" / "qgemv.cu").read_text()
    gemv_header = gemv.split("// @@header\n", 1)[1].split("// @@body\n", 1)[0]
    path = os.environ.get("MLXCEL_QGEMM_SOURCE") or str(ROOT / "kernels" / "qgemm.cu")
    text = pathlib.Path(path).read_text()
    header, rest = text.split("// @@header\n", 1)[1].split("// @@body\n", 1)
    body, body_rope = rest.split(ROPE_MARK, 1)
    if bounded:
        header = BOUNDED_PREFIX + header
    elif wgmma:
        header = WGMMA_PREFIX + header
    name = f"mlxcel_qgemm_{fnv1a32(gemv_header + header + body + ROPE_MARK + body_rope):08x}"
    return name, gemv_header + header, body, body_rope


def variant_rows(m):
    nt = max(1, -(-m // 8))
    if nt > 8:
        nt += nt % 2
    return 8 * nt


def stage_bytes(mt, wr, bits):
    """src/kernels/qgemm.rs `stage_bytes`: one stage of the shared-memory ring."""
    return 16 * (32 * wr * bits + mt * 16 + 16 + 32 * wr)


def scale_block_bytes(wr):
    """src/kernels/qgemm.rs `Launch::scale_block_bytes`: blocks of 256 weight rows or more."""
    return 128 * 32 * wr if 32 * wr >= 256 else 0


def k_splits(steps):
    """The splits of a row's `steps` steps of 128 values: dividing them, each split at least
    MIN_SPLIT_STEPS steps (src/kernels/qgemm.rs `launch_for`)."""
    return [d for d in range(1, steps + 1) if steps % d == 0 and (d == 1 or steps // d >= MIN_SPLIT_STEPS)]


def launch_for(m, n, k, bits, max_splits=None):
    """(MT, WR, WN, SK, ST) as src/kernels/qgemm.rs `launch_for` picks them."""
    if max_splits is None:
        max_splits = int(os.environ.get("MLXCEL_QGEMM_SPLITK") or MAX_SPLITS)
    mt = variant_rows(m)
    wn = 2 if mt > 64 else 1
    # src/kernels/qgemm.rs `Plan::launch`: 8 warps a block (wide), or 4 warps over the weight
    # rows (narrow: MLXCEL_QGEMM_WIDE=0, and the bounded flavour); `Gemm.call` runs wide
    # launches of up to WGMMA_MAX_M rows in the wgmma flavour where WGMMA is on
    wide = WIDE and not (BOUNDED and is_boundable(mt))
    for wide in ((True, False) if wide else (False,)):
        wr = BLOCK_WARPS // wn if wide else NARROW_BLOCK_WARPS
        stage = stage_bytes(mt, wr, bits)
        over = block_shared_overhead(mt) + scale_block_bytes(wr)
        room = min(RING_BYTES, SMEM - over)
        st = min(max(room // stage, MIN_STAGES), MAX_STAGES)
        if not wide or st * stage + over <= SMEM:
            break  # (a wide block that does not fit takes the narrow launch)
    # blocks an SM holds: one of 8 warps (its registers), smaller ones by shared memory
    per_sm = 1 if wr * wn >= BLOCK_WARPS else max(1, SMEM // (st * stage + over))
    cb = max(1, -(-n // (32 * wr)))
    steps = k // 128
    splits = [d for d in k_splits(steps) if d <= max_splits] or [1]
    slots = SMS * per_sm
    if FILL:  # MLXCEL_QGEMM_FILL=1: the fewest splits that fill every slot, else the most
        want = -(-slots // cb)
        sk = next((d for d in splits if d >= want), splits[-1])
    else:  # src/kernels/qgemm.rs `split_cost`: waves of blocks × (steps a block + overhead)
        sk = min(splits, key=lambda d: (-(-(cb * d) // slots) * (steps // d + BLOCK_OVERHEAD_STEPS), d))
    if BOUNDED and is_boundable(mt):
        wn = 2
    return mt, wr, wn, sk, st


def is_boundable(mt):
    """src/kernels/qgemm.rs `bounded`: up to BOUNDED_MAX_M rows in an even number of tiles."""
    return mt <= BOUNDED_MAX_M and (mt // 8) % 2 == 0


class Gemm:
    """The two kernels, and the split-K scratch with the call-ordering token."""

    def __init__(self, mx, dt):
        self.mx, self.dt = mx, dt
        # by flavour: None, "bounded", "wgmma"
        self.srcs = {None: sources(), "bounded": sources(bounded=True), "wgmma": sources(wgmma=True)}
        self.made = {}  # (rope, dynamic shared memory, flavour) -> kernel (MLX fixes the size per kernel)
        self.part = self.count = None
        self.prev = None

    def kernel(self, rope, smem, flavour=None):
        if (rope, smem, flavour) not in self.made:
            name, header, body, body_rope = self.srcs[flavour]
            if rope:
                k = self.mx.fast.cuda_kernel(
                    name=name + "_rope",
                    input_names=["x", "w", "scales", "biases", "nw", "pos", "inv_freq", "qb", "part", "count",
                                 "prev"],
                    output_names=["q", "kv", "tok"], source=body_rope, header=header, shared_memory=smem)
            else:
                k = self.mx.fast.cuda_kernel(
                    name=name, input_names=["x", "w", "scales", "biases", "res", "nw", "part", "count", "prev"],
                    output_names=["y", "tok"], source=body, header=header, shared_memory=smem)
            self.made[(rope, smem, flavour)] = k
        return self.made[(rope, smem, flavour)]

    def scratch(self, floats, blocks):
        mx = self.mx
        if self.part is None or self.part.size < floats or self.count.size < blocks:
            f = max(floats, 1 if self.part is None else self.part.size)
            b = max(blocks, 1 if self.count is None else self.count.size)
            self.part = mx.zeros((1 << (f - 1).bit_length(),), dtype=mx.float32)
            self.count = mx.zeros((1 << (b - 1).bit_length(),), dtype=mx.int32)
            mx.eval(self.part, self.count)

    def call(self, x, w, s, b, group, bits, res=None, swiglu=False, norm=None, rope=None, launch=None):
        """y = x·Wᵀ (+res, or SwiGLU of the halves), norm = (weight, eps) first; rope =
        (pos, inv_freq, nq, hd[, qb]): q and kv instead (qb: the projection's bias, added
        before the rotation)."""
        mx = self.mx
        m, k = x.shape
        n = w.shape[0]
        mt, wr, wn, sk, st = launch or launch_for(m, n, k, bits)
        threads = 32 * wr * wn
        cb = -(-n // (32 * wr))
        floats = cb * sk * (2 * (mt // 8 // wn) * 4 * threads + mt) if sk > 1 else 0  # (Rust: scratch_floats)
        self.scratch(floats, cb)
        prev = self.prev if (sk > 1 and self.prev is not None) else x
        eps = 0 if norm is None else struct.unpack("<i", struct.pack("<f", norm[1]))[0]
        nw = x if norm is None else norm[0]
        common = [("T", self.dt), ("MT", mt), ("N", n), ("K", k), ("G", group), ("BITS", bits),
                  ("WR", wr), ("WN", wn), ("SK", sk), ("ST", st)]
        grid = (cb * sk * threads, 1, 1)
        smem = st * stage_bytes(mt, wr, bits) + scale_block_bytes(wr)
        bounded = BOUNDED and is_boundable(mt) and wn == 2
        # src/kernels/qgemm.rs `Plan::shape`: wide launches of up to WGMMA_MAX_M rows
        wgmma = WGMMA and not bounded and wr == BLOCK_WARPS and mt <= WGMMA_MAX_M
        flavour = "bounded" if bounded else ("wgmma" if wgmma else None)
        if rope is not None:
            pos, inv_freq, nq, hd, *qb = rope
            out = self.kernel(True, smem, flavour)(
                inputs=[x, w, s, b, nw, pos, inv_freq, qb[0] if qb else x, self.part, self.count, prev],
                template=common + [("NORM", int(norm is not None)), ("EPS_BITS", eps), ("HD", hd), ("NQ", nq),
                                   ("BIAS", int(bool(qb)))],
                grid=grid, threadgroup=(threads, 1, 1),
                output_shapes=[(m, nq, 1, hd), (m, n // hd - nq, 1, hd), (1,)],
                output_dtypes=[self.dt] * 3)
        else:
            epi = 2 if swiglu else (1 if res is not None else 0)
            out = self.kernel(False, smem, flavour)(
                inputs=[x, w, s, b, x if res is None else res, nw, self.part, self.count, prev],
                template=common + [("EPI", epi), ("NORM", int(norm is not None)), ("EPS_BITS", eps)],
                grid=grid, threadgroup=(threads, 1, 1),
                output_shapes=[(m, n // 2 if swiglu else n), (1,)],
                output_dtypes=[self.dt] * 2)
        if sk > 1:
            self.prev = out[-1]
        return out[:-1] if rope is not None else out[0]


def within(e, e_mlx):
    """Off by at most 1e-2 and 2× MLX's quantized_matmul + 4e-3 (bf16 weights, f32 sums)."""
    return e <= 1e-2 and e <= 2 * e_mlx + 4e-3


def rope_inputs(mx, m, hd=128, base=500000.0):
    """RoPE's inverse frequencies for heads of `hd` and positions of `m` rows, spread out."""
    inv = mx.array([base ** (-2.0 * i / hd) for i in range(hd // 2)], dtype=mx.float32)
    pos = mx.array([(7 + 997 * i) % 30000 for i in range(m)], dtype=mx.int32)
    return inv, pos


def check_shape(mx, qv, g, dt, model, n, k, name, nq, bits, group, ms):
    """Rows (shape, bits, group, M, what, err, err of quantized_matmul, ok) for one weight."""
    wq, s, b = qv.quantized(n, k, group, bits, n + k + bits)
    wd = mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32)
    rows = []
    tag = f"{model} {name} {n}×{k}"
    for m in ms:
        x = mx.random.normal((m, k)).astype(dt)
        ref = x.astype(mx.float32) @ wd.T
        qmm = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
        y = g.call(x, wq, s, b, group, bits)
        e, eq = qv.rel_err(y, ref), qv.rel_err(qmm, ref)
        rows.append((tag, bits, group, m, "", e, eq, within(e, eq)))
        if PATTERN and not within(e, eq):
            pattern(mx, g, qv, tag, x, wq, s, b, group, bits, y, ref)
        if m not in (16, 128):
            continue
        nw = (1 + 0.1 * mx.random.normal((k,))).astype(dt)
        xf = x.astype(mx.float32)
        xn = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + 1e-5) * nw.astype(mx.float32)
        qn = mx.quantized_matmul(mx.fast.rms_norm(x, nw, 1e-5), wq, s, b, transpose=True,
                                 group_size=group, bits=bits)
        if name in ("o", "down"):
            res = mx.random.normal((m, n)).astype(dt)
            r = res.astype(mx.float32) + ref
            e, eq = qv.rel_err(g.call(x, wq, s, b, group, bits, res=res), r), qv.rel_err(res + qmm, r)
            rows.append((tag, bits, group, m, " +res", e, eq, within(e, eq)))
        elif name == "gate_up":
            refn = xn @ wd.T
            glu = lambda y: y[:, : n // 2] * mx.sigmoid(y[:, : n // 2]) * y[:, n // 2:]
            e = qv.rel_err(g.call(x, wq, s, b, group, bits, swiglu=True, norm=(nw, 1e-5)), glu(refn))
            eq = qv.rel_err(glu(qn.astype(mx.float32)), glu(refn))
            rows.append((tag, bits, group, m, " norm+swiglu", e, eq, within(e, eq)))
        elif name == "qkv":
            hd, base = 128, 500000.0
            nkv = (n // hd - nq) // 2
            inv, pos = rope_inputs(mx, m, hd, base)

            def heads(y):  # [m, n] -> q, kv as the kernel lays them out, RoPE per row
                y = y.reshape(m, n // hd, 1, hd)
                qk = mx.concatenate([mx.fast.rope(y[i:i + 1, : nq + nkv], hd, traditional=False, base=base,
                                                  scale=1.0, offset=int(pos[i].item())) for i in range(m)])
                return qk[:, :nq], mx.concatenate([qk[:, nq:], y[:, nq + nkv:]], axis=1)
            rq, rkv = heads(xn @ wd.T)
            q, kv = g.call(x, wq, s, b, group, bits, norm=(nw, 1e-5), rope=(pos, inv, nq, hd))
            mq, mkv = heads(qn.astype(mx.float32))
            e = max(qv.rel_err(q, rq), qv.rel_err(kv, rkv))
            eq = max(qv.rel_err(mq, rq), qv.rel_err(mkv, rkv))
            rows.append((tag, bits, group, m, " norm+rope", e, eq, within(e, eq)))
            # with the projection's bias (Qwen2), added before the rotation
            qb = (0.5 * mx.random.normal((n,))).astype(dt)
            qbf = qb.astype(mx.float32)
            rq, rkv = heads(xn @ wd.T + qbf)
            q, kv = g.call(x, wq, s, b, group, bits, norm=(nw, 1e-5), rope=(pos, inv, nq, hd, qb))
            mq, mkv = heads(qn.astype(mx.float32) + qbf)
            e = max(qv.rel_err(q, rq), qv.rel_err(kv, rkv))
            eq = max(qv.rel_err(mq, rq), qv.rel_err(mkv, rkv))
            rows.append((tag, bits, group, m, " norm+rope+bias", e, eq, within(e, eq)))
    return rows


PATTERN = False  # --pattern


def pattern(mx, g, qv, tag, x, wq, s, b, group, bits, y, ref):
    """What a wrong product looks like (to stderr): which batch rows and 128-row column
    blocks are off, how much of y is zero or not finite, the split-K counts after the
    call (all zero when every block finished), and whether three more calls agree."""
    m, n = y.shape
    yf = y.astype(mx.float32)
    scale = mx.maximum(mx.abs(ref).max(), 1e-6)
    bad = mx.abs(yf - ref) > 0.02 * scale  # [m, n]
    rows_bad = [i for i, v in enumerate(bad.any(axis=1).tolist()) if v]
    cols = bad.reshape(m, -1, 128).any(axis=(0, 2)).tolist() if n % 128 == 0 else []
    cb_bad = [i for i, v in enumerate(cols) if v]
    zeros = (yf == 0).mean().item()
    finite = mx.isfinite(yf).mean().item()
    counts = g.count.tolist()
    again = [qv.rel_err(g.call(x, wq, s, b, group, bits), yf) for _ in range(3)]
    print(f"PATTERN {tag} bits {bits} M {m}: launch {launch_for(m, n, x.shape[1], bits)}; "
          f"{bad.mean().item():.3f} of y off; batch rows off {rows_bad[:20]}{'…' if len(rows_bad) > 20 else ''} "
          f"({len(rows_bad)} of {m}); column blocks off {cb_bad[:20]}{'…' if len(cb_bad) > 20 else ''} "
          f"({len(cb_bad)} of {len(cols)}); zeros {zeros:.3f}, finite {finite:.3f}; "
          f"nonzero counts after {[(i, c) for i, c in enumerate(counts) if c][:10]}; "
          f"three more calls vs this one: {['%.1e' % a for a in again]}", file=sys.stderr, flush=True)


def row_chunks(m):
    """src/kernels/qgemv.rs `row_chunks`: as few chunks of ≤ 8 rows as possible, even."""
    count = max(1, -(-m // 8))
    base, extra = divmod(m, count)
    out, at = [], 0
    for i in range(count):
        r = base + (1 if i < extra else 0)
        out.append((at, r))
        at += r
    return out


def timing(mx, g, qv, dt, n, k, bits, m, group=64, budget=256e6, launches=None):
    """µs per call of the GEMM (each of `launches`, or mlxcel's), of what mlxcel runs
    without it and of quantized_matmul; and the weight bytes per call."""
    wq, s, b = qv.quantized(n, k, group, bits, 1)
    nbytes = wq.nbytes + s.nbytes + b.nbytes
    copies = max(2, math.ceil(budget / nbytes))
    ws = [(wq + i, s, b) for i in range(copies)]  # distinct weight buffers (uint32 + i)
    mx.eval(ws)
    x = mx.random.normal((m, k)).astype(dt)
    per = lambda fn: qv.bench(lambda: [fn(w, s_, b_) for w, s_, b_ in ws]) / copies * 1e6
    ours = [per(lambda w, s_, b_, l=l: g.call(x, w, s_, b_, group, bits, launch=l))
            for l in (launches or [None])]
    if bits == 4 and m <= 32:
        kern = qv.KERNEL

        def cur(w, s_, b_):
            return mx.concatenate([qv.qgemv(kern, x[lo:lo + r], w, s_, b_, group, bits)
                                   for lo, r in row_chunks(m)])
        what = f"GEMV ×{len(row_chunks(m))}"
    elif m < 32:
        cur, what = None, "qmm"
    else:
        def cur(w, s_, b_):
            return x @ mx.dequantize(w, s_, b_, group_size=group, bits=bits).T
        what = "dequant+mm"
    qmm = per(lambda w, s_, b_: mx.quantized_matmul(x, w, s_, b_, transpose=True, group_size=group, bits=bits))
    current = qmm if cur is None else per(cur)
    return ours, what, current, qmm, nbytes


def worker(idx, jobs, args, lock, out):
    try:
        out.put(work(idx, jobs, args, lock) + ("",))
    except Exception:  # noqa: BLE001 (reported by the main process, which then exits 1)
        import traceback
        out.put(([], [], f"worker {idx}: {traceback.format_exc()}"))


def work(idx, jobs, args, lock):
    import mlx.core as mx
    import check_qgemv as qv
    dt = getattr(mx, args.dtype)
    g = Gemm(mx, dt)
    qv.DT = dt  # (its quantized(), rel_err() and bench() serve here too)
    global PATTERN
    PATTERN = args.pattern
    qv.KERNEL, _ = qv.make_kernel(qv.SOURCE)
    shapes = [(mdl, *sh) for mdl in args.models for sh in SHAPES[mdl]]
    if args.quick:
        shapes = [("8B", *SHAPES["8B"][0]), ("8B", *SHAPES["8B"][3])]
    mine = shapes[idx::jobs]
    rows, times = [], []
    for model, n, k, name, nq in ([] if args.sweep else mine):
        for bits in args.bits:
            for group in args.groups:
                rows += check_shape(mx, qv, g, dt, model, n, k, name, nq, bits, group, args.ms)
    if args.time or args.sweep:
        cases = [(model, n, k, name, bits, m) for model, n, k, name, _ in mine
                 for bits in args.bits for m in args.ms]
        if args.sweep:
            cases = [c for c in cases if c[0] == "8B"]

        def launches(m, n, k, bits):
            if not args.sweep:
                return None
            base = launch_for(m, n, k, bits)
            out = [base]
            mt, steps = base[0], k // 128
            splits = k_splits(steps)
            # other block shapes (warp rows WR, warps per row of tiles WN), ring depths ST
            # (a block's ring within 227 KB) and, for each, the split of K that fills the
            # GPU with as many blocks as the SMs' shared memory holds, and the next one up
            for wr, wn in ((8, 1), (4, 1), (4, 2), (2, 1)):
                if (mt // 8) % wn:
                    continue
                for st in (2, 3, 4, 6):
                    smem = st * stage_bytes(mt, wr, bits) + scale_block_bytes(wr) + block_shared_overhead(mt)
                    if smem > SMEM - 1024:
                        continue
                    per_sm = 1 if wr * wn >= BLOCK_WARPS else SMEM // smem  # (8 warps: registers)
                    want = -(-(SMS * per_sm) // -(-n // (32 * wr)))
                    i = next((j for j, d in enumerate(splits) if d >= want), len(splits) - 1)
                    for sk in splits[i:i + 2]:
                        l = (mt, wr, wn, sk, st)
                        if l not in out:
                            out.append(l)
            return out
        # compile everything first (all workers at once), then take turns on the GPU
        for model, n, k, name, bits, m in cases:
            timing(mx, g, qv, dt, n, k, bits, m, budget=1, launches=launches(m, n, k, bits))
        with lock:
            for model, n, k, name, bits, m in cases:
                ls = launches(m, n, k, bits)
                ours, what, cur, qmm, nbytes = timing(mx, g, qv, dt, n, k, bits, m, launches=ls)
                times.append((f"{model} {name} {n}×{k}", bits, m, ours, ls or [launch_for(m, n, k, bits)],
                              what, cur, qmm, nbytes))
    return rows, times


def main():
    # (line by line even into a pipe: a run cut by a time limit still shows its results)
    sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8B q/k/v and down, 4-bit, M = 16 and 64")
    ap.add_argument("--time", action="store_true", help="also µs per call (wall clock)")
    ap.add_argument("--sweep", action="store_true", help="time other launches on the 8B shapes (no checks)")
    ap.add_argument("--models", default="8B,70B-TP8,70B-TP4", type=lambda v: v.split(","))
    ap.add_argument("--ms", default="5,9,16,32,64,128", type=lambda v: [int(i) for i in v.split(",")])
    ap.add_argument("--bits", default="4,8", type=lambda v: [int(i) for i in v.split(",")])
    ap.add_argument("--groups", default="64", type=lambda v: [int(i) for i in v.split(",")])
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--pattern", action="store_true",
                    help="for a wrong product, print which rows/column blocks are off and whether calls agree")
    ap.add_argument("--jobs", type=int, default=8, help="worker processes (they compile in parallel)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds to wait for each worker's report")
    args = ap.parse_args()
    if args.quick:
        args.bits, args.ms = [4], [16, 64]
    ctx = mp.get_context("spawn")
    lock, out = ctx.Lock(), ctx.Queue()
    nshapes = 2 if args.quick else sum(len(SHAPES[m]) for m in args.models)
    jobs = max(1, min(args.jobs, nshapes))
    t0 = time.time()
    procs = [ctx.Process(target=worker, args=(i, jobs, args, lock, out)) for i in range(jobs)]
    for p in procs:
        p.start()
    rows, times, errors = [], [], []
    for _ in procs:
        try:  # (a worker that died without reporting, e.g. on a CUDA fault, must not hang this)
            r, t, e = out.get(timeout=args.timeout)
        except queue.Empty:
            r, t, e = [], [], f"no report from a worker within {args.timeout} s"
        rows += r
        times += t
        if e:
            errors.append(e)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    for e in errors:
        print(e, file=sys.stderr)
    bad = sum(not r[-1] for r in rows) + len(errors) + sum(p.exitcode != 0 for p in procs)
    if rows:
        print("## correctness: max |y - ref| / max |ref|, ref = x·dequantize(w)ᵀ in float32")
        print("| shape (N×K) | bits | group | M | qgemm | quantized_matmul | ok |")
        print("|---|---|---|---|---|---|---|")
        for tag, bits, group, m, what, e, eq, ok in sorted(rows, key=lambda r: (r[0], r[1], r[3], r[4])):
            print(f"| {tag}{what} | {bits} | {group} | {m} | {e:.2e} | {eq:.2e} | {'yes' if ok else 'NO'} |")
    if times:
        print()
        print("## µs per call (wall clock, MLX's host work included) and weight bytes / time (TB/s)")
        print("| shape (N×K) | bits | M | launch (MT WR WN SK ST) | qgemm µs | TB/s | today's path | µs | "
              "quantized_matmul µs | qgemm speed-up vs today | vs qmm |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for tag, bits, m, ours, ls, what, cur, qmm, nbytes in sorted(times, key=lambda r: (r[0], r[1], r[2])):
            for us, l in zip(ours, ls):
                print(f"| {tag} | {bits} | {m} | {' '.join(map(str, l))} | {us:.1f} | {nbytes / us / 1e6:.2f} | "
                      f"{what} | {cur:.1f} | {qmm:.1f} | {cur / us:.2f}× | {qmm / us:.2f}× |")
    print(f"\n{len(rows)} checks, {sum(not r[-1] for r in rows)} off, {len(errors)} workers failed; "
          f"{time.time() - t0:.0f} s")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
