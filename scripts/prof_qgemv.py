#!/usr/bin/env python3
"""Launch mlxcel's qgemv kernel (and MLX's quantized_matmul) in many launch shapes,
for timing under Nsight Compute, which reports the kernel time itself (wall-clock
timing from Python measures MLX's per-op host overhead as much as the kernel):

    ncu --clock-control none --metrics gpu__time_duration.sum \
        -k regex:'qgemv|qmv' python3 scripts/prof_qgemv.py > ncu.txt
    python3 scripts/prof_qgemv.py --parse ncu.txt

`--defaults` launches only the shape mlxcel picks for each case (fast);
`MLXCEL_QGEMV_SOURCE=path` times another version of the kernel file (the same
variable mlxcel reads). 4-bit launches run twice: float math and int8 activations (XQ).
Kernel names carry the template values: ..._M_N_K_G_BITS_ROWS_WPB_EPI_NORM_EPS_XQ.
"""
import os
import pathlib
import re
import sys

# --defaults: time only mlxcel's own launch shape per case (a few compiles, not hundreds)
DEFAULTS = "--defaults" in sys.argv[1:]
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def launch():
    import mlx.core as mx
    sys.path.insert(0, "scripts")
    import check_qgemv as c
    k, _ = c.make_kernel(pathlib.Path(os.environ.get("MLXCEL_QGEMV_SOURCE", c.SOURCE)))
    for n, kk in SHAPES:
        for bits in (4, 8):
            wq, s, b = c.quantized(n, kk, 64, bits, 0)
            for m in (1, 2, 4, 8):
                x = mx.random.normal((m, kk)).astype(mx.bfloat16)
                if DEFAULTS:  # only the launch shape mlxcel picks (launch_config)
                    cfgs = [(None, None)]
                elif bits == 8 or m > 1:
                    cfgs = [(2, 2), (4, 2), (4, 4)]
                else:
                    cfgs = [(r, w) for r in (1, 2, 4) for w in (1, 2, 4, 8)]
                for xq in ((False, True) if bits == 4 else (False,)):
                    c.XQ = xq  # read by c.qgemv for its template value
                    for rows, wpb in cfgs:
                        for _ in range(2):
                            mx.eval(c.qgemv(k, x, wq, s, b, 64, bits, rows, wpb))
                for _ in range(2):
                    mx.eval(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits))
                mx.synchronize()


def parse(path):
    name, best, qmv = None, {}, []
    for line in open(path, errors="replace"):
        if "==PROF==" in line:
            continue
        m = re.match(r"\s+(void )?(\S*(qgemv|qmv)\S*?)[(<]", line)
        if m:
            name = line.strip().split("(")[0]
            continue
        t = re.search(r"gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)", line)
        if t and name:
            us = float(t.group(2).replace(",", "")) * (1e-3 if t.group(1) == "ns" else 1)
            if "qmv" in name:  # MLX's kernel: same name for every shape, in launch order
                qmv.append(us)
            else:
                best[name] = min(best.get(name, 1e9), us)
    print("quantized_matmul (qmv), launch order (per shape: bits 4 then 8, M=1,2,4, 2 launches each; "
          "MLX runs another kernel at M=8):")
    print(" ".join(f"{u:.1f}" for u in qmv))
    for name, us in best.items():
        m = re.search(r"qgemv_\w+?_t_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)"
                      r"(?:_(\d+)_(\d+)_(-?\d+)_(\d+))?", name)
        if m:
            M, N, K, G, B, R, W = map(int, m.groups()[:7])
            xq = m.group(11) == "1"
            byts = N * K * B / 8 + 2 * 2 * N * K / G
            print(f"qgemv M={M} N={N} K={K} bits={B} ROWS={R} WPB={W}{' XQ' if xq else ''}: "
                  f"{us:.1f} us {byts / us / 1e6:.2f} TB/s")
        else:
            print(f"{name[:90]}: {us:.1f} us")


if __name__ == "__main__":
    parse(sys.argv[2]) if sys.argv[1:2] == ["--parse"] else launch()
