#!/usr/bin/env python3
"""Run `mlxcel generate` on every fixture prompt and compare the greedy tokens
with the committed references (transformers / mlx-lm), up to the reference's
first near-tie (top-1/top-2 gap < 1e-3). Used on GPU boxes, where `cargo test`
cannot run. Extra arguments go to `mlxcel generate` (e.g. --tp-size 2 --tp-emulate).

    python3 scripts/check_fixtures.py ./mlxcel [--tp-size 2 --tp-emulate] [-n 12] [--prompts K]
"""
import json
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
fixtures = os.path.join(here, "..", "tests", "fixtures")


def main():
    # (line by line even into a pipe: a run cut by a time limit still shows its results)
    sys.stdout.reconfigure(line_buffering=True)
    exe, extra = sys.argv[1], sys.argv[2:]
    n, limit = 12, None
    if "--prompts" in extra:
        i = extra.index("--prompts")
        limit = int(extra[i + 1])
        del extra[i:i + 2]
    if "-n" in extra:
        i = extra.index("-n")
        n = int(extra[i + 1])
        del extra[i:i + 2]
    bad = 0
    for fam in sorted(os.listdir(fixtures)):
        ref_path = os.path.join(fixtures, fam, "reference.json")
        if not os.path.exists(ref_path):
            continue
        ref = json.load(open(ref_path))
        model = os.path.join(fixtures, fam)
        if "gguf" in ref:
            # a reference of the default model's GGUF (tests/gguf.rs): the file in mlxcel's cache
            cache = os.environ.get("MLXCEL_CACHE") or os.path.join(
                os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlxcel")
            model = os.path.join(cache, "smollm2-135m-instruct", ref["gguf"])
            if not os.path.exists(model):
                print(f"{fam}: skipped ({model} not found: run `mlxcel generate` once, or stage it)")
                continue
        for k, p in enumerate(ref["prompts"][:limit]):
            chat = [] if p.get("chat") else ["--raw"]
            out = subprocess.run([exe, "generate", "-m", model, *chat, "-p", p["text"], "-n", str(n),
                                  "--ignore-eos", "--json", *extra], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{fam}[{k}]: FAILED to run: {out.stderr.strip()[-400:]}")
                bad += 1
                continue
            got = json.loads(out.stdout.strip().splitlines()[-1])
            tie = next((i for i, g in enumerate(p["gaps"]) if g < 1e-3), len(p["gaps"]))
            m = min(n, tie)
            ok_ids = got["prompt_token_ids"] == p["ids"]
            ok = got["generated_token_ids"][:m] == p["greedy"][:m]
            first_diff = next((i for i, (a, b) in enumerate(zip(got["generated_token_ids"], p["greedy"])) if a != b), None)
            gap = p["gaps"][first_diff] if first_diff is not None else None
            status = "ok" if ok and ok_ids else "MISMATCH"
            if not (ok and ok_ids):
                bad += 1
            extra_note = f", first difference at step {first_diff} (reference gap {gap:.4g})" if first_diff is not None else ""
            print(f"{fam}[{k}]: {status} ({m} tokens compared{extra_note})")
    print(f"fixtures: {'all ok' if bad == 0 else f'{bad} mismatches'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
