#!/usr/bin/env python3
"""Launch mlxcel's qgemv kernel (and MLX's quantized_matmul) in many launch shapes,
for timing under Nsight Compute, which reports the kernel time itself (wall-clock
timing from Python measures MLX's per-op host overhead as much as the kernel):

    ncu --clock-control none --metrics gpu__time_duration.sum \
        -k regex:'qgemv|qmv|qmm' python3 scripts/prof_qgemv.py [--defaults|--mma] > ncu.txt
    python3 scripts/prof_qgemv.py --parse ncu.txt

Modes (8B shapes, group 64; `--70b` adds the 70B shapes):
  (none)      the full sweep of the dp4a/FMA path's ROWS × WPB (hundreds of compiles)
  --defaults  mlxcel's own launch per case (4 and 8 bits, M = 1, 2, 4, 8), plus at 4 bits
              the dp4a path at M = 2, 4 and the tensor-core path at M = 1, for comparison
  --mma       4-bit only: the tensor-core path's ROWS (16, 32) × WPB (4, 8) (or `--cfgs
              16x8,32x4,...`), and the dp4a
              path's launch at M ≤ 4 (the rounding kernel of x, `..._xq`, is timed on its own)
  --ms 2,4,8  the batch sizes (default 1, 2, 4, 8)
  --stalls    six launches (q/k/v, down at M = 1; q/k/v, o, down, gate/up at M = 8) for
              ncu's sections (`scripts/gpu/kernels.sh sections`)
  --m1        4-bit M = 1 on the dp4a path: ROWS (4, 8, 16) × WPB (2, 4, 8)
  --stream    4-bit M = 1: the dp4a launch against the streaming path's ROWS (1, 2, 4) ×
              WPB (chunks of a row over 32 or 16 lanes) × PG blocks (`--pgs 264,396,...`)
  --ks 14336  only the shapes with these row lengths K
  --ceiling   a kernel that only reads the bytes of each shape's 4-bit g64 weights (16-byte
              loads, all issued before any use): the bandwidth any GEMV could reach there
`MLXCEL_QGEMV_SOURCE=path` times another version of the kernel file (the same
variable mlxcel reads). Kernel names carry the template values:
..._M_N_K_G_BITS_ROWS_WPB_EPI_NORM_EPS_XQ_MMA.
"""
import os
import pathlib
import re
import sys

ARGS = sys.argv[1:]
# --ms 2,4,8: the batch sizes to launch (default 1, 2, 4, 8)
MS = tuple(int(v) for v in ARGS[ARGS.index("--ms") + 1].split(",")) if "--ms" in ARGS else (1, 2, 4, 8)
# --cfgs 16x8,32x4: the tensor-core launches (ROWS x WPB) --mma times (default 16, 32 × 4, 8)
MMA_CFGS = ([tuple(map(int, c.split("x"))) for c in ARGS[ARGS.index("--cfgs") + 1].split(",")]
            if "--cfgs" in ARGS else [(r, w) for r in (16, 32) for w in (4, 8)])
# --pgs 264,396: the streaming path's grid sizes --stream times
PGS = tuple(int(v) for v in ARGS[ARGS.index("--pgs") + 1].split(",")) if "--pgs" in ARGS else (132, 264, 396, 528, 792)
# --ks 14336,28672: only the shapes of these row lengths
KS = tuple(int(v) for v in ARGS[ARGS.index("--ks") + 1].split(",")) if "--ks" in ARGS else None
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
if "--70b" in ARGS:
    SHAPES += [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672), (128256, 8192)]
if KS:
    SHAPES = [(n, k) for n, k in SHAPES if k in KS]


def launch():
    import mlx.core as mx
    sys.path.insert(0, "scripts")
    import check_qgemv as c
    if "--ceiling" in ARGS:
        return ceiling()
    k, _ = c.make_kernel(pathlib.Path(os.environ.get("MLXCEL_QGEMV_SOURCE", c.SOURCE)))
    if "--stalls" in ARGS:  # a few launches for ncu's stall sections (mlxcel's own launch)
        for n, kk, m in [(6144, 4096, 1), (4096, 14336, 1), (6144, 4096, 8), (4096, 4096, 8),
                         (4096, 14336, 8), (28672, 4096, 8)]:
            wq, s, b = c.quantized(n, kk, 64, 4, 0)
            x = mx.random.normal((m, kk)).astype(mx.bfloat16)
            mx.eval(c.qgemv(k, x, wq, s, b, 64, 4))
        mx.synchronize()
        return
    for n, kk in SHAPES:
        for bits in ((4,) if "--mma" in ARGS or "--m1" in ARGS else (4, 8)):
            wq, s, b = c.quantized(n, kk, 64, bits, 0)
            for m in MS:
                x = mx.random.normal((m, kk)).astype(mx.bfloat16)
                # (rows, wpb, mma); None: mlxcel's launch (launch_config)
                if "--stream" in ARGS:
                    if bits == 8 or m != 1:
                        continue
                    ch = kk // 32
                    r0, w0, _ = c.launch_config(m, n, kk, bits)
                    cfgs = [(r0, w0, 0), None]  # the dp4a launch, mlxcel's (streaming) launch
                    for wpb in (sorted({min(16, -(-ch // 32)), min(16, -(-ch // 64))})
                                if n * kk < 2 ** 28 else ()):  # (the wide gate/up, lm_head: defaults only)
                        it = -(-ch // (32 * wpb))
                        for rows in (1, 2, 4) if kk <= 8192 else (1, 2):
                            if n % rows or rows * it * 32 * wpb * 24 * 2 > c.STREAM_SMEM:
                                continue
                            cfgs += [(rows, wpb, 0, pg) for pg in PGS if pg <= n // rows]
                elif "--m1" in ARGS:
                    if bits == 8 or m != 1:
                        continue
                    cfgs = [(r, w, 0) for r in (4, 8, 16) for w in (2, 4, 8)]
                elif "--mma" in ARGS:
                    cfgs = [(r, w, 1) for r, w in MMA_CFGS]
                    if m <= 4:
                        cfgs.append((4, 4 if m > 1 else 2, 0))  # the dp4a path, for comparison
                elif "--defaults" in ARGS:
                    cfgs = [None]
                    if bits == 4 and m in (2, 4):
                        cfgs.append((4, 4, 0))  # the dp4a path (mlxcel before the MMA path)
                    if bits == 4 and m == 1:
                        cfgs.append((16, 8, 1))
                elif bits == 8 or m > 1:
                    cfgs = [(2, 2, 0), (4, 2, 0), (4, 4, 0)]
                else:
                    cfgs = [(r, w, 0) for r in (1, 2, 4) for w in (1, 2, 4, 8)]
                for xq in ((False, True) if bits == 4 and not {"--mma", "--defaults", "--m1", "--stream"} & set(ARGS)
                           else (bits == 4,)):
                    c.XQ = xq  # read by c.qgemv for its template value
                    for cfg in cfgs:
                        if cfg is not None and cfg[2] and not xq:
                            continue
                        if cfg is not None and (n % cfg[0] or (not c.XQ and m > 4 and cfg[2] == 0)):
                            continue
                        if cfg is None and m > 4 and not c.launch_config(m, n, kk, bits)[2]:
                            continue  # mlxcel leaves this one to MLX
                        rows, wpb, mma, pg = (cfg + (0,))[:4] if cfg else (None, None, None, None)
                        for _ in range(2):
                            mx.eval(c.qgemv(k, x, wq, s, b, 64, bits, rows, wpb, mma=mma, pg=pg))
                c.XQ = True
                for _ in range(2):
                    mx.eval(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits))
                mx.synchronize()


CEIL_SRC = """
  constexpr int TPB = 256;
  const uint4* p = reinterpret_cast<const uint4*>(w);
  const size_t base = size_t(blockIdx.x) * TPB * ITERS + threadIdx.x;
  uint4 v[ITERS];
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const size_t j = base + size_t(i) * TPB;
    v[i] = j < N16 ? p[j] : make_uint4(0u, 0u, 0u, 0u);
  }
  uint32_t a = 0;
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    a ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  }
  if (a == 0x9E3779B9u) {  // (keeps the loads; practically never true)
    y[0] = a;
  }
"""


def ceiling():
    """Read-only kernels over the byte sizes of the 4-bit g64 weights of each shape."""
    import mlx.core as mx
    kern = mx.fast.cuda_kernel(name="mlxcel_ceiling_read", input_names=["w"], output_names=["y"],
                               source=CEIL_SRC)
    for n, kk in SHAPES:
        nbytes = n * kk // 2 + 2 * 2 * n * kk // 64
        n16 = nbytes // 16
        w = mx.zeros((n16 * 4,), dtype=mx.uint32)
        mx.eval(w)
        for iters in (1, 2, 4, 8):
            blocks = -(-n16 // (256 * iters))
            for _ in range(3):
                mx.eval(kern(inputs=[w], template=[("N16", n16), ("ITERS", iters)],
                             grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
                             output_shapes=[(1,)], output_dtypes=[mx.uint32]))
        mx.synchronize()


def parse(path):
    name, best, qmv = None, {}, []
    for line in open(path, errors="replace"):
        if "==PROF==" in line:
            continue
        m = re.match(r"\s+(void )?(\S*(qgemv|qmv|qmm|ceiling)\S*?)[(<]", line)
        if m:
            name = line.strip().split("(")[0]
            continue
        t = re.search(r"gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)", line)
        if t and name:
            unit = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}
            us = float(t.group(2).replace(",", "")) * unit.get(t.group(1), 1.0)
            if "ceiling" in name:
                best[name] = min(best.get(name, 1e9), us)
            elif "qgemv" not in name:  # MLX's kernels: same name for every shape, in launch order
                k = re.search(r"(qmv|qmm|gemv)\w*", name)
                qmv.append((k.group(0) if k else name[:40], us))
            else:
                best[name] = min(best.get(name, 1e9), us)
    print("MLX's quantized_matmul, launch order (per shape and bits: M = 1, 2, 4, 8, 2 launches each):")
    print(" ".join(f"{u:.1f}" for _, u in qmv))
    print("kernels:", sorted({n for n, _ in qmv}))
    for name, us in best.items():
        cm = re.search(r"ceiling_read_(\d+)_(\d+)", name)
        if cm:
            n16, iters = map(int, cm.groups())
            print(f"read-only {n16 * 16 / 1e6:.1f} MB ITERS={iters}: {us:.1f} us {n16 * 16 / us / 1e6:.2f} TB/s")
            continue
        m = re.search(r"qgemv_\w+?_t_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)"
                      r"(?:_(\d+)_(\d+)_(-?\d+)_(\d+)(?:_(\d+))?(?:_(\d+))?)?", name)
        if m:
            M, N, K, G, B, R, W = map(int, m.groups()[:7])
            xq = m.group(11) == "1"
            mma = m.group(12) == "1"
            pg = int(m.group(13) or 0)
            byts = N * K * B / 8 + 2 * 2 * N * K / G
            print(f"qgemv M={M} N={N} K={K} bits={B} ROWS={R} WPB={W}{' XQ' if xq else ''}"
                  f"{' MMA' if mma else ''}{f' PG={pg}' if pg else ''}: {us:.1f} us {byts / us / 1e6:.2f} TB/s")
        else:
            print(f"{name[:90]}: {us:.1f} us")


if __name__ == "__main__":
    parse(sys.argv[2]) if sys.argv[1:2] == ["--parse"] else launch()
