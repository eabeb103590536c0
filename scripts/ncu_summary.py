#!/usr/bin/env python3
"""Summarise Nsight Compute's raw metrics (`ncu ... --page raw --csv > f.csv`) per kernel:
time, throughputs, occupancy, L1 wavefronts and the warp stall reasons, largest first.

    python3 scripts/ncu_summary.py f.csv
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
                    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1, "us": 1, "msecond": 1e3}.get(unit, 1)
                    v, unit = f"{num(v) * scale:.2f}", "us"
                print(f"   {label:20s} {v} {unit}")
        stalls = sorted(((num(v) or 0.0, STALL.match(k)[1]) for k, v in r.items() if STALL.match(k)),
                        reverse=True)
        if stalls:
            tot = sum(s for s, _ in stalls)
            print("   stalls (warp cycles per issued instruction):",
                  ", ".join(f"{n} {s:.2f}" for s, n in stalls[:8] if s > 0), f"(sum {tot:.2f})")


if __name__ == "__main__":
    main(sys.argv[1])
