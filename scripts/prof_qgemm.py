#!/usr/bin/env python3
"""Run single products of mlxcel's quantized GEMM (kernels/qgemm.cu) for a profiler, and
read the profiler's per-instruction report back as a ledger.

    python3 scripts/prof_qgemm.py run 8B:gate_up:4:64 8B:qkv:4:32   # MODEL:PRODUCT:BITS:ROWS[:fused] ...
    python3 scripts/prof_qgemm.py ledger sass.csv [TOP]               # stalls by instruction and opcode
    python3 scripts/prof_qgemm.py times times.csv SPEC...             # kernel µs per product

`run` calls each product (launch as `launch_for` picks it; `MLXCEL_QGEMM_SOURCE`,
`MLXCEL_QGEMM_WIDE`,
`MLXCEL_QGEMM_SPLITK`, `MLXCEL_QGEMM_BOUNDED` as in scripts/check_qgemm.py) three times on a
random weight, after a warm-up that compiles it: under Nsight Compute with `-k regex:qgemm
-s 1 -c N` the profiled launches are the products in order. A SPEC ending in `:fused` runs
the launch the engine makes for that product instead of the plain one: the RMSNorm with
SwiGLU (gate_up) or with RoPE (qkv, 32 query heads of 128), the residual add (o, down).

`ledger` reads `ncu -i REP --page source --csv --print-source sass` output: per instruction
its opcode and warp-stall samples by reason. It prints the stall reasons' shares of all
samples, the opcodes' shares, and the TOP instructions (default 30) with their leading
reasons: where the kernel's warps wait, instruction by instruction.

`times` reads `ncu --csv --metrics gpu__time_duration.sum -k regex:qgemm` output of a `run` of
the same SPECs (every launch profiled: the warm-up's one per product, then three each) and
prints each product's median kernel time in µs and the weight bytes over it.
"""
import csv
import os
import re
import sys
from collections import defaultdict

import check_qgemm as cq


def run(specs):
    import mlx.core as mx
    import check_qgemv as qv
    dt = mx.bfloat16
    qv.DT = dt
    g = cq.Gemm(mx, dt)
    prods = []
    for spec in specs:
        model, name, bits, m, fused = parse(spec)
        n, k, nq = next((n, k, nq) for n, k, nm, nq in cq.SHAPES[model] if nm == name)
        wq, s, b = qv.quantized(n, k, 64, bits, 7)
        x = mx.random.normal((m, k)).astype(dt)
        extra = {}
        if fused and name in ("o", "down"):
            extra["res"] = mx.random.normal((m, n)).astype(dt)
        elif fused:
            extra["norm"] = ((1 + 0.1 * mx.random.normal((k,))).astype(dt), 1e-5)
            if name == "gate_up":
                extra["swiglu"] = True
            else:  # q/k/v: RoPE on q and k
                inv, pos = cq.rope_inputs(mx, m)
                extra["rope"] = (pos, inv, nq, 128)
        mx.eval(x, *[v for v in extra.values() if isinstance(v, mx.array)])
        print(f"{spec}: N {n} K {k} launch (MT WR WN SK ST) {cq.launch_for(m, n, k, bits)}", flush=True)
        prods.append((x, wq, s, b, bits, extra))
    for x, wq, s, b, bits, extra in prods:  # warm-up: compile (not what a profiler should look at first)
        mx.eval(g.call(x, wq, s, b, 64, bits, **extra))
    mx.synchronize()
    # QGEMM_WARM_X=1: before each launch a 256 MB read (not a qgemm kernel, so not profiled)
    # pushes the weights out of L2 and x is written anew, so that under `--cache-control none`
    # a launch finds the caches as a decode step does: x (the previous kernel's output) in L2,
    # the weights not
    warm_x = os.environ.get("QGEMM_WARM_X") == "1"
    big = mx.ones((64 << 20,), dtype=mx.float32) if warm_x else None
    for x, wq, s, b, bits, extra in prods:
        for _ in range(3):
            if warm_x:
                mx.eval(mx.sum(big))
                x = x * mx.array(1, dtype=dt)
                mx.eval(x)
            mx.eval(g.call(x, wq, s, b, 64, bits, **extra))
    mx.synchronize()


def parse(spec):
    """MODEL:PRODUCT:BITS:ROWS[:fused] -> (model, product, bits, rows, fused)."""
    parts = spec.split(":")
    if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "fused"):
        sys.exit(f"{spec}: want MODEL:PRODUCT:BITS:ROWS or MODEL:PRODUCT:BITS:ROWS:fused")
    model, name, bits, m = parts[:4]
    if model not in cq.SHAPES or name not in [nm for _, _, nm, _ in cq.SHAPES[model]]:
        sys.exit(f"{spec}: unknown model or product (models: {', '.join(cq.SHAPES)})")
    return model, name, int(bits), int(m), len(parts) == 5


REASON = re.compile(r"^Warp Stall Sampling \(All Samples\)$|^stall_(\w+)$", re.I)


def ledger(path, top=30):
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"#"') or l.startswith('"Address"')
                  or '"Source"' in l), None)
    if start is None:
        sys.exit(f"{path}: no source-page csv header found")
    rd = list(csv.reader(lines[start:]))
    head = rd[0]
    src = next(i for i, h in enumerate(head) if h == "Source")
    total_col = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
    # per-reason columns: ncu names them like "stall_long_sb" or "Stall Long Scoreboard" by version
    reason_cols = [(i, h) for i, h in enumerate(head)
                   if (h.lower().startswith("stall") or h.startswith("smsp__pcsamp_warps_issue_stalled"))
                   and "Sampling" not in h]
    by_reason, by_op, rows = defaultdict(float), defaultdict(float), []
    total = 0.0
    for r in rd[1:]:
        if len(r) != len(head):
            continue
        text = r[src].strip()
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0] if text else "?"
        samples = cq_num(r[total_col]) if total_col is not None else 0
        reasons = {h: cq_num(r[i]) for i, h in reason_cols}
        if total_col is None:
            samples = sum(reasons.values())
        total += samples
        by_op[op] += samples
        for h, v in reasons.items():
            by_reason[h] += v
        rows.append((samples, r[0], text, reasons))
    if not total:
        sys.exit(f"{path}: no stall samples (columns: {head[:12]}…)")
    print(f"{len(rows)} instructions, {total:.0f} samples")
    print("reasons:", ", ".join(f"{h} {v / total:.1%}" for h, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:12]))
    print("opcodes:", ", ".join(f"{o} {v / total:.1%}" for o, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:16]))
    for samples, addr, text, reasons in sorted(rows, key=lambda r: -r[0])[:top]:
        lead = ", ".join(f"{h} {v:.0f}" for h, v in sorted(reasons.items(), key=lambda kv: -kv[1])[:3] if v)
        print(f"{samples / total:6.1%}  {addr:>8}  {text[:60]:60}  {lead}")


def times(path, specs):
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{path}: no ncu csv header found")
    rd = list(csv.reader(lines[start:]))
    head = rd[0]
    val, unit = head.index("Metric Value"), head.index("Metric Unit")
    us = []
    for r in rd[1:]:
        if len(r) == len(head):
            scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3,
                     "ms": 1e3}.get(r[unit])
            if scale is None:
                sys.exit(f"{path}: unknown time unit {r[unit]!r}")
            us.append(cq_num(r[val]) * scale)
    if len(us) != 4 * len(specs):
        sys.exit(f"{path}: {len(us)} launches for {len(specs)} products (want 4 each)")
    for i, spec in enumerate(specs):
        model, name, bits, m, _ = parse(spec)
        n, k = next((n, k) for n, k, nm, _ in cq.SHAPES[model] if nm == name)
        t = sorted(us[len(specs) + 3 * i: len(specs) + 3 * i + 3])[1]
        wbytes = n * k * bits / 8 + 2 * 2 * n * k / 64
        print(f"| {spec} | {cq.launch_for(m, n, k, bits)} | {t:.1f} | {wbytes / t / 1e6:.2f} |")


def cq_num(v):
    try:
        return float(v.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("run", "ledger", "times"):
        sys.exit(__doc__)
    if sys.argv[1] == "run":
        run(sys.argv[2:])
    elif sys.argv[1] == "times":
        times(sys.argv[2], sys.argv[3:])
    else:
        ledger(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 30)
