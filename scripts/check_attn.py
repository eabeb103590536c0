#!/usr/bin/env python3
"""Check and time mlxcel's decode attention kernel (kernels/attn.cu) on a GPU box.

Runs the kernel through MLX (`mx.fast.cuda_kernel`, launched as src/kernels/attn.rs does)
on random bfloat16 (or, with ATTN_DTYPE=float16, float16) inputs in a paged pool (blocks of ATTN_BS tokens, default 32, each
sequence's blocks in shuffled order, read through its block table) and compares it with
softmax(q·kᵀ·scale)·v in float32 (MLX's `fast.scaled_dot_product_attention` on float32
copies of the same values, gathered through the table), for
the 8B and 70B head shapes (and a 70B rank's under TP = 8), head_dim 64, GQA up to 8,
batch rows reading other sequences (and two rows one sequence) at other lengths, one to
32 splits. Each case runs
twice (a count the merge failed to reset would change the second result) and the
counts must be zero afterwards. Prints max |error| / max |reference| for the kernel
and for MLX's bfloat16 sdpa on the gathered values, then times both at batch 1 (a chain
of calls, GPU time per call; the kernel over blocks in order and shuffled, sdpa on views
of a run of rows as mlxcel's batch-1 path reads it).

    python3 scripts/check_attn.py [--quick]
    ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/check_attn.py --marks > ncu.txt
    python3 scripts/check_attn.py --parse ncu.txt

The timings use the 8B's heads (32 query, 8 kv); ATTN_TIME_HEADS=8,1 a 70B rank's at TP = 8.
ATTN_SRC=file checks and times another kernel file, ATTN_TW its tiles per round,
ATTN_SPLITS a fixed count of blocks per (row, kv head) (default: as many as the longest row
needs, as mlxcel launches it).
"""
import argparse
import math
import os
import pathlib
import random
import re
import struct
import sys
import time

import mlx.core as mx

ROOT = pathlib.Path(__file__).resolve().parent.parent
NSPLIT = int(os.environ.get("ATTN_NSPLIT", "32"))  # as src/kernels/attn.rs; other values: experiments
BS = int(os.environ.get("ATTN_BS", "32"))  # tokens per KV block (--block-size; a multiple of 32)
DT = getattr(mx, os.environ.get("ATTN_DTYPE", "bfloat16"))  # bfloat16 or float16 (GGUF models)
CTXS = tuple(int(c) for c in os.environ.get("ATTN_CTXS", "128,384,2048,8192,32768").split(","))
# the heads the timings use: query heads, kv heads (default the 8B's; "8,1" a 70B rank at TP = 8)
TIME_HEADS = tuple(int(c) for c in os.environ.get("ATTN_TIME_HEADS", "32,8").split(","))


def kernel():
    text = pathlib.Path(os.environ.get("ATTN_SRC", ROOT / "kernels" / "attn.cu")).read_text()
    header, body = text.split("// @@header\n", 1)[1].split("// @@body\n", 1)
    return mx.fast.cuda_kernel(name="mlxcel_attn_check_" + hex(hash(text) & 0xffffffff)[2:], input_names=["q", "pool", "table", "pos", "part", "count"],
                               output_names=["out"], source=body, header=header)


def attn(k, q, pool, table, pos, part, count, hq, hkv, d, scale, max_len):
    """max_len: the most positions a row attends to (max pos + 1), which sets the blocks
    launched per (row, kv head) as src/kernels/attn.rs's launch_splits does (ATTN_SPLITS:
    a fixed count instead, at most NSPLIT)."""
    b = q.shape[0]
    g = hq // hkv
    warps = g * int(os.environ.get("ATTN_TW", 0) or max(1, 16 // g))  # as src/kernels/attn.rs; ATTN_TW: tiles per round
    chunk = 32 * (warps // g)
    splits = int(os.environ.get("ATTN_SPLITS", 0) or min(NSPLIT, max(1, -(-max_len // chunk))))
    sb = struct.unpack("<i", struct.pack("<f", scale * math.log2(math.e)))[0]
    return k(inputs=[q, pool, table, pos, part, count],
             template=[("T", DT), ("D", d), ("HQ", hq), ("HKV", hkv), ("NSPLIT", NSPLIT), ("WARPS", warps),
                       ("BS", BS), ("SCALE_BITS", sb)],
             grid=(splits * 32 * warps, b * hkv, 1), threadgroup=(32 * warps, 1, 1),
             output_shapes=[(b, hq, 1, d)], output_dtypes=[DT])[0]


def scratch(slots_n, hq, hkv, d):
    part = mx.zeros((slots_n * hkv * NSPLIT * (hq // hkv) * (d + 2),), dtype=mx.float32)
    count = mx.zeros((slots_n * hkv * (NSPLIT + 1),), dtype=mx.int32)  # (room for a split-flag kernel file)
    mx.eval(part, count)
    return part, count


def rel(a, ref):
    return (mx.abs(a.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()


def paged_pool(seqs, cap, hkv, d, shuffle=True, seed=0):
    """A pool of `seqs` sequences' blocks of BS tokens (cap positions each), in
    shuffled order: ([1, 2·hkv, blocks·BS, d] bfloat16, per sequence its block table)."""
    nb = -(-cap // BS)
    order = list(range(seqs * nb))
    if shuffle:
        random.Random(seed).shuffle(order)
    pool = mx.random.normal((1, 2 * hkv, seqs * nb * BS, d)).astype(DT)
    return pool, [order[s * nb:(s + 1) * nb] for s in range(seqs)]


def rows_of(table, p):
    """Pool rows of positions 0..=p through a block table."""
    return mx.array([table[i // BS] * BS + i % BS for i in range(p + 1)], dtype=mx.int32)


def check(k, name, hq, hkv, d, rows, cap, slots_n=4, seed=0):
    """rows: [(sequence, pos)]; row b attends to positions 0..=pos of its sequence,
    read through the sequence's (shuffled) block table."""
    mx.random.seed(seed)
    b = len(rows)
    pool, tables = paged_pool(slots_n, cap, hkv, d, seed=seed)
    q = (2 * mx.random.normal((b, hq, 1, d))).astype(DT)
    table = mx.array([tables[r[0]] for r in rows], dtype=mx.int32)
    pos = mx.array([r[1] for r in rows], dtype=mx.int32)
    part, count = scratch(max(slots_n, b), hq, hkv, d)
    scale = d ** -0.5
    outs = []
    for _ in range(2):
        outs.append(attn(k, q, pool, table, pos, part, count, hq, hkv, d, scale, max(r[1] for r in rows) + 1))
        mx.eval(outs[-1])
    refs, sdpa = [], []
    for i, (s, p) in enumerate(rows):
        kv = pool[:, :, rows_of(tables[s], p)]  # what mlxcel's gather path reads
        kk, vv = kv[:, :hkv], kv[:, hkv:]
        refs.append(mx.fast.scaled_dot_product_attention(q[i:i + 1].astype(mx.float32), kk.astype(mx.float32),
                                                         vv.astype(mx.float32), scale=scale))
        sdpa.append(mx.fast.scaled_dot_product_attention(q[i:i + 1], kk, vv, scale=scale))
    ref = mx.concatenate(refs, 0)
    e1, e2 = rel(outs[0], ref), rel(outs[1], ref)
    e_mlx = rel(mx.concatenate(sdpa, 0), ref)
    left = int(mx.abs(count).sum().item())
    same = mx.array_equal(outs[0], outs[1]).item()
    ok = max(e1, e2) < max(2e-2, 2 * e_mlx + 4e-3) and left == 0 and same
    print(f"| {name} | {hq}/{hkv}×{d} | {rows} | {e1:.2e} | {e_mlx:.2e} | {'yes' if same else 'NO'} | {left} | "
          f"{'ok' if ok else 'NO'} |", flush=True)
    return ok


def timing(k, hq, hkv, d, ctx, n=200, marks=False):
    """Wall time per call of a chain of n calls (host-bound for short contexts); with
    marks, n = 3 calls each between marker lines, for `ncu` (see --parse). The kernel
    reads one sequence's blocks in order ("run") and shuffled; MLX's sdpa reads the run
    as views (what mlxcel's batch-1 path does for a sequence whose blocks are one run)."""
    pool, (run,) = paged_pool(1, ctx + 256, hkv, d, shuffle=False)
    _, (shuffled,) = paged_pool(1, ctx + 256, hkv, d, shuffle=True)
    q = mx.random.normal((1, hq, 1, d)).astype(DT)
    # in device memory, as mlxcel's step inputs (src/mlx/device_inputs.rs): MLX keeps arrays
    # made from host data, and results of 8 bytes or less, in unified memory
    t_run, t_shuf = mx.array([run], dtype=mx.int32) + 0, mx.array([shuffled], dtype=mx.int32) + 0
    pos = mx.arange(ctx - 1, ctx + 2, dtype=mx.int32)[:1]
    part, count = scratch(1, hq, hkv, d)
    kv_k, kv_v = pool[:, :hkv, :ctx], pool[:, hkv:, :ctx]
    mx.eval(pool, q, t_run, t_shuf, pos, kv_k, kv_v)
    scale = d ** -0.5
    fns = {
        "mlxcel": lambda y: attn(k, y, pool, t_run, pos, part, count, hq, hkv, d, scale, ctx),
        "mlxcel-shuffled": lambda y: attn(k, y, pool, t_shuf, pos, part, count, hq, hkv, d, scale, ctx),
        "sdpa": lambda y: mx.fast.scaled_dot_product_attention(y, kv_k, kv_v, scale=scale),
    }
    res = {}
    for name, f in fns.items():
        if marks:
            mx.eval(f(q))  # compiles
            print(f"@@ {name} {ctx}", flush=True)
            for _ in range(3):
                mx.eval(f(q))
            print("@@ end", flush=True)
            continue
        best = 1e9
        for _ in range(3):
            y = q
            t = time.perf_counter()
            for _ in range(n):
                y = f(y)
            mx.eval(y)
            best = min(best, (time.perf_counter() - t) / n * 1e6)
        res[name] = best
    if not marks:
        print(f"| {hq}/{hkv}×{d} | {ctx} | {res['mlxcel']:.1f} | {res['mlxcel-shuffled']:.1f} | {res['sdpa']:.1f} |",
              flush=True)


def parse(path):
    """GPU µs per call between the markers of `--marks` in ncu's output: ncu prints its
    results at the end, in launch order, and a progress line ("==PROF== Profiling ...")
    per launch as the kernels run, between the markers."""
    seg, seg_of, results = None, {}, []
    unit = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    for line in open(path, errors="replace"):
        if line.startswith("@@ "):
            seg = None if line.startswith("@@ end") else tuple(line.split()[1:3])
            continue
        # (launches in order: ncu numbers them, except under a kernel filter `-k`)
        if line.startswith("==PROF== Profiling"):
            seg_of[len(seg_of)] = seg
            continue
        t = re.search(r"gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)", line)
        if t:
            results.append(float(t.group(2).replace(",", "")) * unit.get(t.group(1), 1.0))
    times = {}
    for i, us in enumerate(results):
        if seg_of.get(i):
            times.setdefault(seg_of[i], []).append(us)
    print("| positions | mlxcel µs/call (GPU, blocks in order) | mlxcel, shuffled blocks | MLX sdpa µs/call (GPU, all its kernels) |")
    print("|---|---|---|---|")
    for ctx in sorted({int(c) for _, c in times}):
        m, sh, s = (times.get((f, str(ctx)), []) for f in ("mlxcel", "mlxcel-shuffled", "sdpa"))
        print(f"| {ctx} | {sum(m) / 3:.1f} | {sum(sh) / 3:.1f} | {sum(s) / 3:.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--marks", action="store_true", help="only the timing calls, between markers (run under ncu)")
    ap.add_argument("--parse", help="summarise ncu output of a --marks run")
    a = ap.parse_args()
    if a.parse:
        return parse(a.parse)
    k = kernel()
    if a.marks:
        for ctx in CTXS:
            timing(k, *TIME_HEADS, 128, ctx, marks=True)
        return
    print(f"blocks of {BS} tokens, {DT}")
    print(f"| case | heads q/kv × d | rows (sequence, last position) | kernel error | MLX {DT} sdpa error | "
          "run 2 = run 1 | counts left | ok |")
    print("|---|---|---|---|---|---|---|---|")
    cases = [
        ("8B, one position", 32, 8, 128, [(0, 0)], 256),
        ("8B, 384 positions (3 splits)", 32, 8, 128, [(1, 383)], 512),
        ("8B, 2,201 positions (18 splits)", 32, 8, 128, [(2, 2200)], 2304),
        ("8B, 20,001 positions (32 splits)", 32, 8, 128, [(0, 20000)], 20224),
        ("8B, batch of 5", 32, 8, 128, [(3, 10), (0, 700), (1, 255), (2, 256), (3, 4000)], 4096),
        ("70B", 64, 8, 128, [(0, 1000), (1, 3000)], 3072),
        ("70B rank of 8", 8, 1, 128, [(0, 5000), (2, 17)], 5120),
        ("head_dim 64, GQA 2", 16, 8, 64, [(1, 600), (0, 1)], 1024),
        ("G = 7", 28, 4, 128, [(0, 900)], 1024),
        ("SmolLM2 (9/3 × 64)", 9, 3, 64, [(0, 300), (1, 40)], 512),
    ]
    if a.quick:
        cases = cases[:5]
    ok = all([check(k, *c) for c in cases])
    print("\n| heads q/kv × d | positions | mlxcel µs/call (wall, chain) | mlxcel, shuffled blocks | MLX sdpa µs/call (views) |")
    print("|---|---|---|---|---|")
    for ctx in CTXS:
        timing(k, *TIME_HEADS, 128, ctx)
    print("all ok" if ok else "SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
