#!/usr/bin/env python3
"""Count where the main thread was in the stack samples of scripts/host_profile.sh:
the most frequent innermost call chains, then each function by the share of samples
it appears in.   python3 scripts/fold_stacks.py stacks.txt [--depth 7]"""
import argparse
import collections
import re

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("stacks")
ap.add_argument("--depth", type=int, default=7, help="frames per call chain")
a = ap.parse_args()
samples = open(a.stacks).read().split("=== sample")[1:]
chains, funcs = collections.Counter(), collections.Counter()
n = 0
for s in samples:
    m = re.search(r"Thread 1 \(Thread.*?\n((?:#.*\n?)*)", s)
    if not m:
        continue
    n += 1
    frames = [re.sub(r"^#\d+\s+(0x[0-9a-f]+ in )?", "", line).split(" (")[0].split("(")[0]
              for line in m.group(1).strip().split("\n")]
    frames = [f for f in frames if f != "??"]
    chains[" < ".join(frames[: a.depth])] += 1
    for f in set(frames):
        funcs[f] += 1
print(f"{n} samples of the main thread")
for k, v in chains.most_common(15):
    print(f"{v:4d}  {k[:300]}")
print("---")
for k, v in funcs.most_common(40):
    print(f"{100 * v / max(n, 1):5.1f}%  {k[:150]}")
