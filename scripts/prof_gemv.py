#!/usr/bin/env python3
"""Launch mlxcel's dense GEMV kernel (kernels/gemv.cu) on the decode shapes of the 8B model
and of the 70B TP=8 / TP=4 ranks, for timing under Nsight Compute (the kernel's own time:
wall-clock timing from Python measures MLX's host work per op as much as the kernel):

    ncu --clock-control none --metrics gpu__time_duration.sum -k regex:'gemv|ceiling' \
        python3 scripts/prof_gemv.py [MODE] > ncu.txt
    python3 scripts/prof_gemv.py --parse ncu.txt      # TB/s per shape and launch

Modes (batch M = 1 unless `--ms 1,2,3`):
  (none)       mlxcel's launch per shape, with the epilogue the decode step uses there
               (q/k/v: norm + RoPE; o and down: residual; gate/up: norm + SwiGLU; lm_head: norm),
               and a read-only kernel over the same bytes (16-byte loads): the ceiling any
               GEMV could reach on that shape
  --sweep      plain products of the large shapes (gate/up, down) in ROWS × WPB × LOADS
               launches (LOADS: 16-byte vectors a thread keeps in flight, `MLXCEL_GEMV_LOADS`)
  --qkv        the q/k/v shapes: the RoPE entry point (norm + RoPE) and the plain product with the
               norm, in ROWS (2, 4) × WPB (4, 8) launches
  --only 8B    one model's shapes (8B, 70B-TP8, 70B-TP4)
`--source FILE` (or `MLXCEL_GEMV_SOURCE`) times another version of the kernel file. Kernel
names carry the template values (MLX appends them): ..._M_N_K_ROWS_WPB_EPI_NORM_...
"""
import os
import pathlib
import re
import sys

ARGS = sys.argv[1:]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def arg(name, default=None):
    return ARGS[ARGS.index(name) + 1] if name in ARGS else default


MS = tuple(int(v) for v in arg("--ms", "1").split(","))



def shapes():
    sys.path.insert(0, str(ROOT / "scripts"))
    import check_gemv as c
    out = [("8B", s) for s in c.SHAPES_8B] + [("70B-TP8", s) for s in c.SHAPES_70B_TP8] + \
        [("70B-TP4", s) for s in c.SHAPES_70B_TP4]
    only = arg("--only")
    return c, [(m, s) for m, s in out if only is None or m == only]


def variant(src, loads):
    """The kernel file with MLXCEL_GEMV_LOADS set (a distinct kernel name per value)."""
    text = src.read_text()
    return text.replace("// @@header\n", f"// @@header\n#define MLXCEL_GEMV_LOADS {loads}\n", 1)


def launch():
    import mlx.core as mx
    c, todo = shapes()
    src = pathlib.Path(arg("--source", os.environ.get("MLXCEL_GEMV_SOURCE", c.SOURCE)))
    kernel, rope_kernel = c.make_kernel(src)
    from prof_qgemv import CEIL_SRC  # the read-only kernel prof_qgemv.py's --ceiling times
    ceil = mx.fast.cuda_kernel(name="mlxcel_ceiling_read", input_names=["w"], output_names=["y"],
                               source=CEIL_SRC)
    if "--qkv" in ARGS:
        # the q/k/v shapes: the RoPE entry point and the plain product in ROWS × WPB launches
        hd = 128
        inv = mx.array([500000.0 ** (-2.0 * i / hd) for i in range(hd // 2)], dtype=mx.float32)
        for model, (n, k, name, nq) in todo:
            if nq is None:
                continue
            w = c.weight(n, k, 1)
            nw = (1 + 0.1 * mx.random.normal((k,))).astype(c.DT)
            for m in MS:
                x = mx.random.normal((m, k)).astype(c.DT)
                pos = mx.array([130] * m, dtype=mx.int32)
                mx.eval(x, pos, nw, inv)
                for rows in (2, 4):
                    for wpb in (4, 8):
                        for _ in range(2):
                            mx.eval(c.gemv_rope(rope_kernel, x, w, (nw, 1e-5), pos, inv, nq, hd, rows, wpb))
                            mx.eval(c.gemv(kernel, x, w, norm=(nw, 1e-5), rows=rows, wpb=wpb))
            mx.synchronize()
        return
    if "--sweep" in ARGS:
        tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
        kernels = {}
        for loads in (8, 16):
            p = tmp / f"gemv-loads{loads}.cu"
            p.write_text(variant(src, loads))
            kernels[loads] = c.make_kernel(p)[0]
        for model, (n, k, name, _) in todo:
            if name not in ("gate_up", "down"):
                continue
            w = c.weight(n, k, 1)
            for m in MS:
                x = mx.random.normal((m, k)).astype(c.DT)
                for loads, kern in kernels.items():
                    for rows in (2, 4, 8):
                        for wpb in (2, 4, 8):
                            if n % rows:
                                continue
                            for _ in range(2):
                                mx.eval(c.gemv(kern, x, w, rows=rows, wpb=wpb))
            mx.synchronize()
            del w
        return
    for model, (n, k, name, nq) in todo:
        w = c.weight(n, k, 1)
        nw = (1 + 0.1 * mx.random.normal((k,))).astype(c.DT)
        n16 = n * k * 2 // 16
        for iters in (4, 8):
            for _ in range(2):
                mx.eval(ceil(inputs=[w], template=[("N16", n16), ("ITERS", iters)],
                             grid=(-(-n16 // (256 * iters)) * 256, 1, 1), threadgroup=(256, 1, 1),
                             output_shapes=[(1,)], output_dtypes=[mx.uint32]))
        for m in MS:
            x = mx.random.normal((m, k)).astype(c.DT)
            for _ in range(2):
                if nq is not None:
                    hd = 128
                    inv = mx.array([500000.0 ** (-2.0 * i / hd) for i in range(hd // 2)], dtype=mx.float32)
                    pos = mx.array([7] * m, dtype=mx.int32)
                    mx.eval(c.gemv_rope(rope_kernel, x, w, (nw, 1e-5), pos, inv, nq, hd))
                elif name == "gate_up":
                    mx.eval(c.gemv(kernel, x, w, swiglu=True, norm=(nw, 1e-5)))
                elif name == "lm_head":
                    mx.eval(c.gemv(kernel, x, w, norm=(nw, 1e-5)))
                else:
                    res = mx.random.normal((m, n)).astype(c.DT)
                    mx.eval(c.gemv(kernel, x, w, res=res))
        mx.synchronize()
        del w


def parse(path):
    unit = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    name, runs = None, []
    for line in open(path, errors="replace"):
        if "==PROF==" in line:
            continue
        m = re.match(r"\s+(void )?(\S*(gemv|ceiling)\S*?)[(<]", line)
        if m:
            name = line.strip().split("(")[0]
            continue
        t = re.search(r"gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)", line)
        if t and name:
            runs.append((name, float(t.group(2).replace(",", "")) * unit.get(t.group(1), 1.0)))
            name = None
    best = {}
    order = []
    for n, us in runs:  # (the fastest of each name's launches)
        if n not in best:
            order.append(n)
        best[n] = min(best.get(n, 1e9), us)
    print("| kernel | M | N×K | ROWS×WPB | epilogue | µs | TB/s |")
    print("|---|---|---|---|---|---|---|")
    for n in order:
        us = best[n]
        cm = re.search(r"ceiling_read_(\d+)_(\d+)", n)
        if cm:
            n16, iters = map(int, cm.groups())
            print(f"| read-only ITERS={iters} | | {n16 * 16 / 1e6:.1f} MB | | | {us:.1f} | {n16 * 16 / us / 1e6:.2f} |")
            continue
        gm = re.search(r"gemv_([0-9a-f]{8})(_rope)?_\w+?_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)(?:_(\d+)_(\d+))?", n)
        if gm:
            h, rope = gm.group(1), gm.group(2)
            M, N, K, R, W = map(int, gm.groups()[2:7])
            if rope:
                epi = "norm+rope"
            else:
                epi = {"0": "plain", "1": "res", "2": "swiglu"}.get(gm.group(8), gm.group(8))
                epi += "+norm" if gm.group(9) == "1" else ""
            print(f"| {h} | {M} | {N}×{K} | {R}×{W} | {epi} | {us:.1f} | {N * K * 2 / us / 1e6:.2f} |")
        else:
            print(f"| {n[:80]} | | | | | {us:.1f} | |")


if __name__ == "__main__":
    if "--parse" in ARGS:
        parse(arg("--parse"))
    else:
        launch()
