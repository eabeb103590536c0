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
            tie_gap = ref.get("tolerance", {}).get("greedy_tie_gap", 1e-3)
            tie = next((i for i, g in enumerate(p["gaps"]) if g < tie_gap), len(p["gaps"]))
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
            if "tolerance" in ref:
                bad += sampled_logprobs_check(exe, model, fam, k, p, chat, n, extra, ref["tolerance"])
    print(f"fixtures: {'all ok' if bad == 0 else f'{bad} mismatches'}")
    sys.exit(1 if bad else 0)


def sampled_logprobs_check(exe, model, fam, k, p, chat, n, extra, tol):
    """A reduced-precision fixture (bfloat16 weights; float32 references): its greedy
    tokens soon repeat, so also sample n tokens (temperature 1, fixed seed) with their top-5
    log-probabilities and compare every step with transformers in float32, teacher-forced
    along the same tokens (where transformers is installed, as on the GPU boxes). A log-softmax
    moves by at most twice a logit's error, so the bound is 2 x the fixture's logits_max_abs
    (3x what transformers itself gives in bfloat16). Returns 1 on a mismatch."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        print(f"{fam}[{k}]: sampled log-probabilities not checked (no torch/transformers here)")
        return 0
    out = subprocess.run([exe, "generate", "-m", model, *chat, "-p", p["text"], "-n", str(n), "--ignore-eos",
                          "--temp", "1", "--seed", str(1000 + k), "--json", "--logprobs", "5", *extra],
                         capture_output=True, text=True)
    if out.returncode != 0:
        print(f"{fam}[{k}] sampled: FAILED to run: {out.stderr.strip()[-400:]}")
        return 1
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ids, gen = got["prompt_token_ids"], got["generated_token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids + gen])).logits[0].float(), -1)
    worst, at = 0.0, None
    for s, e in enumerate(got["logprobs"]):
        row = lp[len(ids) - 1 + s]
        for t, v in [(e["token"], e["logprob"])] + [tuple(x) for x in e["top"]]:
            d = abs(row[t].item() - v)
            if d > worst:
                worst, at = d, s
    bound = 2 * tol["logits_max_abs"]
    ok = worst <= bound and len(got["logprobs"]) == len(gen)
    print(f"{fam}[{k}] sampled: {'ok' if ok else 'MISMATCH'} ({len(gen)} steps, distinct tokens {len(set(gen))}, "
          f"top-5 log-probabilities vs transformers float32: max |d| {worst:.3g} at step {at}, bound {bound:.3g})")
    return 0 if ok else 1


if __name__ == "__main__":
    main()
