#!/usr/bin/env python3
"""Summarise Nsight Compute's raw metrics (`ncu ... --page raw --csv > f.csv`) per kernel:
time, throughputs, occupancy, L1 wavefronts and the warp stall reasons, largest first.

    python3 scripts/ncu_summary.py f.csv
    python3 scripts/ncu_summary.py --totals STEPS f.csv   # kernel time by kind, per step

With `--totals`, the kernels (e.g. those of `mlxcel bench --profile-steps STEPS` under
`ncu --profile-from-start off --metrics gpu__time_duration.sum`) are grouped by kind (the
name without template arguments, hashes and shapes) with their count and µs per step,
largest first, and the sum: what one step costs the GPU, kernel by kernel.
"""
import csv
import re
import sys

KEYS = [
    ("time us", "gpu__time_duration.sum"),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM % (2)", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L1 %", "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM bytes", "dram__bytes_read.sum"),
    ("regs", "launch__registers_per_thread"),
    ("block", "launch__block_size"),
    ("grid", "launch__grid_size"),
    ("waves/SM", "launch__waves_per_multiprocessor"),
    ("occ. theor. %", "sm__maximum_warps_per_active_cycle_pct"),
    ("occ. achieved %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("issue active %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("instructions", "smsp__inst_executed.sum"),
    ("LSU wavefronts", "l1tex__data_pipe_lsu_wavefronts.sum"),
    ("global ld requests", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"),
    ("global ld sectors", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"),
    ("L1 hit %", "l1tex__t_sector_hit_rate.pct"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
]
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def rows(path):
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{path}: no ncu csv header (\"ID\", ...) found")
    rd = list(csv.reader(lines[start:]))
    head, units, data = rd[0], rd[1], rd[2:]
    for r in data:
        if len(r) == len(head):
            yield dict(zip(head, r)), dict(zip(head, units))


def num(v):
    try:
        return float(v.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def micros(v, unit):
    """A duration `v` in `unit` (as ncu names it) in µs."""
    return v * {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3}.get(unit, 1)


def kind(name):
    """A kernel's name without its arguments, template values, hashes and shapes."""
    n = re.sub(r"^void ", "", name.split("(")[0])
    inner = re.search(r"<\s*((?:cutlass|sm\d+|ampere|hopper)\w*)", n)  # a library GEMM's own name
    n = inner[1] if inner else re.sub(r"<.*", "", n)
    n = re.sub(r"^(custom_kernel_)?(mlxcel_\w+?)_[0-9a-f]{8}(_rope)?.*", r"\2\3", n)
    n = re.sub(r"(_[0-9a-z]+_t)?(_\d+)+$", "", n)
    return n[:80]


def totals(path, steps):
    by = {}
    for r, u in rows(path):
        v = num(r.get("gpu__time_duration.sum", ""))
        if v is None:
            continue
        k = kind(r.get("Kernel Name", "?"))
        c, t = by.get(k, (0, 0.0))
        by[k] = (c + 1, t + micros(v, u.get("gpu__time_duration.sum", "")))
    total = sum(t for _, t in by.values())
    print(f"| kernel | launches per step | µs per step | share |\n|---|---|---|---|")
    for k, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {c / steps:.1f} | {t / steps:.1f} | {100 * t / total:.1f}% |")
    print(f"| all | {sum(c for c, _ in by.values()) / steps:.1f} | {total / steps:.1f} | |")


def main(path):
    for r, u in rows(path):
        name = r.get("Kernel Name", "?")
        m = re.search(r"qgemv_\w+?_t_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)", name)
        short = (f"M={m[1]} N={m[2]} K={m[3]} G={m[4]} bits={m[5]} ROWS={m[6]} WPB={m[7]}"
                 if m else name[:100])
        print(f"== {short}\n   {name[:160]}")
        for label, key in KEYS:
            if key in r and r[key] != "":
                v, unit = r[key], u.get(key, "")
                if key == "gpu__time_duration.sum" and num(v) is not None:
                    v, unit = f"{micros(num(v), unit):.2f}", "us"
                print(f"   {label:20s} {v} {unit}")
        stalls = sorted(((num(v) or 0.0, STALL.match(k)[1]) for k, v in r.items() if STALL.match(k)),
                        reverse=True)
        if stalls:
            tot = sum(s for s, _ in stalls)
            print("   stalls (warp cycles per issued instruction):",
                  ", ".join(f"{n} {s:.2f}" for s, n in stalls[:8] if s > 0), f"(sum {tot:.2f})")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--totals":
        totals(sys.argv[3], float(sys.argv[2]))
    else:
        main(sys.argv[1])
