#!/usr/bin/env python3
"""Paged KV cache checks against a running mlxcel-server (standard library only).

    concurrency: N conversations at once, each a prompt of --prompt-tokens distinct
        token ids and --max-tokens generated (ignore_eos), while /metrics is polled:
        prints the largest `mlxcel:num_requests_running` seen, the preemptions
        (`vllm:num_preemptions`, where the server has it), the largest
        `mlxcel:kv_blocks_used`, and the requests that failed.
    prefix: a shared prefix of --prefix-tokens token ids, then --requests requests one
        after another, each the prefix and its own --tail-tokens ids, max_tokens 1
        (non-streaming: the latency is the time to the first token): prints each
        latency and `cached_tokens`, and the first request's latency over the mean of
        the later ones.

Prints one JSON object.

    python3 scripts/paged_kv_check.py concurrency --port 8080 -n 200 --prompt-tokens 128 --max-tokens 384
    python3 scripts/paged_kv_check.py prefix --port 8080 --prefix-tokens 2000 --requests 8
"""
import argparse
import http.client
import json
import random
import re
import threading
import time


def post(args, body):
    conn = http.client.HTTPConnection(args.host, args.port, timeout=args.timeout)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status} {data[:300]!r}")
    return json.loads(data)


def metrics(args):
    conn = http.client.HTTPConnection(args.host, args.port, timeout=args.timeout)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+) ([-0-9.e+]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def ids(rng, n, vocab):
    # skip the low ids (special tokens of most vocabularies)
    lo = min(1000, vocab // 4)
    return [rng.randrange(lo, vocab) for _ in range(n)]


def concurrency(args):
    rng = random.Random(args.seed)
    prompts = [ids(rng, args.prompt_tokens, args.vocab) for _ in range(args.n)]
    errors, done = [], []
    seen = {"running": 0.0, "blocks": 0.0}
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                m = metrics(args)
                seen["running"] = max(seen["running"], m.get("mlxcel:num_requests_running", 0))
                seen["blocks"] = max(seen["blocks"], m.get("mlxcel:kv_blocks_used", 0))
            except OSError:
                pass
            time.sleep(0.05)

    def one(p):
        try:
            r = post(args, {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})
            done.append(r["usage"]["completion_tokens"])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(str(e))

    before = metrics(args)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stop.set()
    poller.join()
    after = metrics(args)
    pre = after.get("vllm:num_preemptions")
    return {
        "requests": args.n,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "max_running": seen["running"],
        "preemptions": None if pre is None else pre - before.get("vllm:num_preemptions", 0),
        "max_kv_blocks_used": seen["blocks"],
        "kv_blocks": after.get("mlxcel:kv_blocks_used", 0) + after.get("mlxcel:kv_blocks_free", 0),
        "failed": len(errors),
        "first_errors": errors[:3],
        "completion_tokens": sum(done),
        "wall_s": wall,
        "tokens_per_s": sum(done) / wall,
    }


def prefix(args):
    rng = random.Random(args.seed + 1)  # not the concurrency mode's prompts
    shared = ids(rng, args.prefix_tokens, args.vocab)
    rows = []
    for i in range(args.requests):
        body = {"prompt": shared + ids(rng, args.tail_tokens, args.vocab), "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        r = post(args, body)
        dt = time.perf_counter() - t0
        u = r["usage"]
        rows.append({
            "latency_s": dt,
            "prompt_tokens": u["prompt_tokens"],
            "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        })
    later = [r["latency_s"] for r in rows[1:]]
    mean_later = sum(later) / max(1, len(later))
    m = metrics(args)
    return {
        "prefix_tokens": args.prefix_tokens,
        "requests": rows,
        "first_s": rows[0]["latency_s"],
        "later_mean_s": mean_later,
        "first_over_later": rows[0]["latency_s"] / mean_later if later else None,
        "prefix_cache_hits": m.get("vllm:prefix_cache_hits"),
        "prefix_cache_queries": m.get("vllm:prefix_cache_queries"),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["concurrency", "prefix"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    ap.add_argument("-n", type=int, default=64, help="concurrency: conversations at once")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--tail-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    a = ap.parse_args()
    print(json.dumps(concurrency(a) if a.mode == "concurrency" else prefix(a)))


if __name__ == "__main__":
    main()
