#!/usr/bin/env python3
"""mlxcel and mlx-lm on the same weights, one invocation: batch-1 decode and
prefill(2048) for each model directory given, and the fraction of the memory
roofline each decode reaches (bytes of weights read per token / bandwidth).

    python3 scripts/bench_side_by_side.py --mlxcel .gpu/bin/mlxcel /root/ckpt/8b-bf16 /root/ckpt/8b-q4
    python3 scripts/bench_side_by_side.py ... --env MLXCEL_QGEMV=0   # mlxcel without its GEMV kernel

Runs `mlxcel bench` and scripts/bench_mlx_lm.py (mlx-lm's own pipelined
`generate_step`) as subprocesses, one after the other, and prints a markdown table
and one JSON line per model. `--bandwidth` is the device's usable memory bandwidth
(default 4.3 TB/s: a device-to-device copy on H200 measured with torch).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def run_json(cmd, env):
    out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", type=pathlib.Path)
    ap.add_argument("--mlxcel", default="mlxcel", help="path of the mlxcel binary")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--bandwidth", type=float, default=4.3, help="TB/s for the roofline")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for mlxcel's run")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    a = ap.parse_args()
    env = dict(os.environ)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    common = ["--decode-tokens", str(a.decode_tokens), "--repeats", str(a.repeats)]
    rows = []
    for m in a.models:
        ours = run_json([a.mlxcel, "bench", "-m", str(m), "--prompt-lens", str(a.prompt_len)] + common, env)
        theirs = None if a.skip_mlx_lm else run_json(
            [sys.executable, str(HERE / "bench_mlx_lm.py"), str(m), "--prompt-lens", str(a.prompt_len)] + common,
            dict(os.environ))
        gb = ours["weights_gb"]
        roof = a.bandwidth * 1e3 / gb  # tokens/s if every weight byte is read once per token at full bandwidth
        row = {"model": str(m), "weights_gb": gb, "roofline_tokens_per_second": roof, "env": a.env,
               "mlxcel": {"decode": ours["decode"]["tokens_per_second"],
                          "prefill": ours["prefill"][-1]["tokens_per_second"],
                          "peak_gb": ours["peak_memory_bytes"] / 1e9}}
        if theirs:
            row["mlx_lm"] = {"decode": theirs["decode"]["tokens_per_second"],
                             "prefill": theirs["prefill"][-1]["tokens_per_second"],
                             "peak_gb": theirs["peak_memory_bytes"] / 1e9}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"| model | weights GB | engine | decode tok/s | ms/token | of roofline ({a.bandwidth} TB/s) "
          f"| prefill({a.prompt_len}) tok/s | peak GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for name in ("mlxcel", "mlx_lm"):
            if name not in r:
                continue
            e = r[name]
            print(f"| {pathlib.Path(r['model']).name} | {r['weights_gb']:.2f} | {name.replace('_', '-')} "
                  f"| {e['decode']:.1f} | {1e3 / e['decode']:.2f} | {e['decode'] / r['roofline_tokens_per_second']:.0%} "
                  f"| {e['prefill']:.0f} | {e['peak_gb']:.1f} |")
        if "mlx_lm" in r:
            print(f"| | | mlxcel / mlx-lm | {r['mlxcel']['decode'] / r['mlx_lm']['decode']:.2f}× | | "
                  f"| {r['mlxcel']['prefill'] / r['mlx_lm']['prefill']:.2f}× | |")


if __name__ == "__main__":
    main()
