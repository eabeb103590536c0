#!/usr/bin/env python3
"""Run `mlxcel generate` on every fixture prompt and compare the greedy tokens
with the committed references (transformers / mlx-lm), up to the reference's
first near-tie (top-1/top-2 gap < 1e-3). Used on GPU boxes, where `cargo test`
cannot run. Extra arguments go to `mlxcel generate` (e.g. --tp-size 2 --tp-emulate).

    python3 scripts/check_fixtures.py ./mlxcel [--tp-size 2 --tp-emulate] [-n 12] [--prompts K]
    python3 scripts/check_fixtures.py ./mlxcel --batched 12   # the bfloat16 fixtures, batched

--batched B: for each fixture with a tolerance (the bfloat16 ones), `mlxcel serve --parallel B`
and B concurrent sampled completions (the fixture's prompts in turn, a seed each, logprobs 5,
return_tokens_as_token_ids), so decode steps run B rows at once (the batched path: the KV
scatter, the batched attention kernel, Qwen3's q/k norm kernel writing the pool); every
request's top-5 log-probabilities are compared with transformers as for one sequence.
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
    if "--batched" in extra:
        i = extra.index("--batched")
        batch = int(extra[i + 1])
        del extra[i:i + 2]
        sys.exit(batched(exe, batch, extra))
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


def teacher_forced_logprobs(model):
    """f(ids) -> log-softmax rows of transformers in float32 over the sequence `ids`, or None
    where torch/transformers are not installed."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        return None
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()

    def run(ids):
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return run


def worst_logprob_diff(lp, n_prompt, steps):
    """Max |d| over steps [(token, logprob, [(id, logprob)...]), ...] against the rows `lp`
    (row n_prompt - 1 + s predicts step s), and the step where it is."""
    worst, at = 0.0, None
    for s, (tok, l, top) in enumerate(steps):
        row = lp[n_prompt - 1 + s]
        for t, v in [(tok, l)] + list(top):
            d = abs(row[t].item() - v)
            if d > worst:
                worst, at = d, s
    return worst, at


def serve_batch(exe, model, batch, body_of, extra):
    """`mlxcel serve -m model --parallel B` answering B concurrent `/v1/completions` requests
    (request i's body: body_of(i)); returns the responses (None where one got no answer)."""
    import socket
    import threading
    import time
    import urllib.request
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    server = subprocess.Popen([exe, "serve", "-m", model, "--port", str(port), "--parallel", str(batch), *extra],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    results = [None] * batch
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except Exception:
                if server.poll() is not None:
                    raise RuntimeError(server.stderr.read()[-400:])
                time.sleep(0.5)

        def one(i):
            req = urllib.request.Request(url + "/v1/completions", json.dumps(body_of(i)).encode(),
                                         {"Content-Type": "application/json"})
            results[i] = json.load(urllib.request.urlopen(req, timeout=600))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.terminate()
        server.wait()
    return results


def batched_run(exe, model, batch, prompts, seed0, steps, forced, extra):
    """B concurrent sampled completions (request i: prompts[i % len], seed seed0 + i, `steps`
    tokens, top-5 log-probabilities) from `mlxcel serve --parallel B`, each compared with
    forced(ids) (log-softmax rows of a reference over the sequence) along its own tokens.
    Returns (max |d|, (request, step) of it, distinct tokens, requests with no answer)."""
    body_of = lambda i: {"prompt": prompts[i % len(prompts)], "max_tokens": steps, "temperature": 1.0,
                         "seed": seed0 + i, "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True}
    tid = lambda name: int(name.split(":", 1)[1])
    worst, where, distinct, missing = 0.0, None, set(), []
    for i, r in enumerate(serve_batch(exe, model, batch, body_of, extra)):
        if r is None:
            missing.append(i)
            continue
        l = r["choices"][0]["logprobs"]
        got = [(tid(t), v, [(tid(k), x) for k, x in top.items()])
               for t, v, top in zip(l["tokens"], l["token_logprobs"], l["top_logprobs"])]
        ids = prompts[i % len(prompts)]
        w, at = worst_logprob_diff(forced(ids + [g[0] for g in got]), len(ids), got)
        distinct.update(g[0] for g in got)
        if w > worst:
            worst, where = w, (i, at)
    return worst, where, distinct, missing


def batched(exe, batch, extra):
    """--batched B: see the module's docstring. Returns the process's exit status."""
    bad, checked = 0, 0
    for fam in sorted(os.listdir(fixtures)):
        ref_path = os.path.join(fixtures, fam, "reference.json")
        if not os.path.exists(ref_path) or "tolerance" not in json.load(open(ref_path)):
            continue
        ref = json.load(open(ref_path))
        model = os.path.join(fixtures, fam)
        forced = teacher_forced_logprobs(model)
        if forced is None:
            print(f"{fam} batched: not checked (no torch/transformers here)")
            continue
        prompts = [p["ids"] for p in ref["prompts"]]
        try:
            worst, where, distinct, missing = batched_run(exe, model, batch, prompts, 500, 16, forced, extra)
        except Exception as e:
            print(f"{fam} batched: FAILED to run: {e}")
            bad += 1
            continue
        if missing:
            print(f"{fam} batched: requests {missing} got no answer")
        bound = 2 * ref["tolerance"]["logits_max_abs"]
        ok = worst <= bound and not missing
        bad += not ok
        checked += 1
        print(f"{fam} batched x{batch}: {'ok' if ok else 'MISMATCH'} (16 steps each, distinct tokens {len(distinct)}, "
              f"top-5 log-probabilities vs transformers float32: max |d| {worst:.3g} at (request, step) {where}, "
              f"bound {bound:.3g})")
    print(f"batched fixtures: {checked} checked, {'all ok' if bad == 0 else f'{bad} mismatches'}")
    return 1 if bad else 0


def sampled_logprobs_check(exe, model, fam, k, p, chat, n, extra, tol):
    """A reduced-precision fixture (bfloat16 weights; float32 references): its greedy
    tokens soon repeat, so also sample n tokens (temperature 1, fixed seed) with their top-5
    log-probabilities and compare every step with transformers in float32, teacher-forced
    along the same tokens (where transformers is installed, as on the GPU boxes). A log-softmax
    moves by at most twice a logit's error, so the bound is 2 x the fixture's logits_max_abs
    (3x what transformers itself gives in bfloat16). Returns 1 on a mismatch."""
    forced = teacher_forced_logprobs(model)
    if forced is None:
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
    steps = [(e["token"], e["logprob"], [tuple(x) for x in e["top"]]) for e in got["logprobs"]]
    worst, at = worst_logprob_diff(forced(ids + gen), len(ids), steps)
    bound = 2 * tol["logits_max_abs"]
    ok = worst <= bound and len(got["logprobs"]) == len(gen)
    print(f"{fam}[{k}] sampled: {'ok' if ok else 'MISMATCH'} ({len(gen)} steps, distinct tokens {len(set(gen))}, "
          f"top-5 log-probabilities vs transformers float32: max |d| {worst:.3g} at step {at}, bound {bound:.3g})")
    return 0 if ok else 1


if __name__ == "__main__":
    main()
