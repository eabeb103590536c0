#!/usr/bin/env python3
"""Load test for a running mlxcel-server (or any OpenAI-compatible server).

For each concurrency level, that many threads each send `--rounds` streaming
requests one after another; the script prints one JSON object with, per level,
the aggregate generation throughput (completion tokens / wall time), the time
to first token (TTFT) and the mean inter-token time of the streams.

Standard library only (http.client + threads). Example:

    mlxcel-server -m ~/models/Qwen2.5-0.5B-Instruct --parallel 32 &
    python3 scripts/bench_server.py --port 8080 --concurrency 1,8,32 --max-tokens 128

With `--response-format` (`json_object`, or a file holding a JSON schema, e.g.
scripts/bench_schema.json), each level runs twice, unconstrained and then constrained,
and `comparison` gives the constrained/unconstrained ratios of the generation
throughput and of the decode rate (streams / mean inter-token time), with the server's
pipelined decode steps in each run (`mlxcel:pipelined_decode_steps_total`).
`--no-compare` runs the constrained requests only.
"""
import argparse
import http.client
import json
import statistics
import sys
import threading
import time


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(xs):
    if not xs:
        return None
    return {
        "mean": statistics.fmean(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs),
    }


def headers(args):
    h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if args.api_key:
        h["Authorization"] = "Bearer " + args.api_key
    return h


def get_model(args):
    conn = http.client.HTTPConnection(args.host, args.port, timeout=args.timeout)
    conn.request("GET", "/v1/models", headers=headers(args))
    resp = conn.getresponse()
    body = resp.read()
    if resp.status != 200:
        raise SystemExit(f"GET /v1/models: {resp.status} {body[:300]!r}")
    return json.loads(body)["data"][0]["id"]


def one_request(args, model, seed, response_format=None):
    """One streaming completion; returns (ttft, inter-token gaps, completion tokens)."""
    if args.chat:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": args.prompt}]}
    else:
        path = "/v1/completions"
        body = {"prompt": args.prompt}
    body.update(
        model=model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=seed,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    if response_format:
        body["response_format"] = response_format
    conn = http.client.HTTPConnection(args.host, args.port, timeout=args.timeout)
    t0 = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body), headers=headers(args))
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status} {resp.read()[:300]!r}")
    ttft = None
    last = None
    gaps = []
    tokens = 0
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"].get("message"))
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for c in chunk.get("choices") or []:
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            if piece:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
    conn.close()
    return ttft, gaps, tokens


def server_counter(args, name):
    """A counter of the server's /metrics (None when it has no such page or line)."""
    try:
        conn = http.client.HTTPConnection(args.host, args.port, timeout=10)
        conn.request("GET", "/metrics", headers=headers(args))
        text = conn.getresponse().read().decode()
        conn.close()
    except (OSError, http.client.HTTPException):
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def run_level(args, model, concurrency, response_format=None):
    ttfts, gaps, errors = [], [], []
    tokens = [0]
    lock = threading.Lock()

    def worker(w):
        for r in range(args.rounds):
            try:
                ttft, g, n = one_request(args, model, 1000 * w + r, response_format)
                with lock:
                    if ttft is not None:
                        ttfts.append(ttft)
                    gaps.extend(g)
                    tokens[0] += n
            except Exception as e:  # noqa: BLE001 - report and go on
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    pipelined0 = server_counter(args, PIPELINED)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    pipelined1 = server_counter(args, PIPELINED)
    mean_gap = statistics.fmean(gaps) if gaps else None
    return {
        "concurrency": concurrency,
        "requests": concurrency * args.rounds,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "completion_tokens": tokens[0],
        "wall_s": wall,
        "tokens_per_s": tokens[0] / wall if wall > 0 else 0.0,
        "ttft_s": summary(ttfts),
        "inter_token_s": summary(gaps),
        # the streams' decode rate: each stream gets a token every mean gap
        "decode_tokens_per_s": concurrency / mean_gap if mean_gap else None,
        "pipelined_steps": None if pipelined0 is None or pipelined1 is None else pipelined1 - pipelined0,
    }


PIPELINED = "mlxcel:pipelined_decode_steps_total"


def ratio(a, b):
    return a / b if a is not None and b else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream at each level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--prompt", default="Write a short story about a fox who learns to fly.")
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--response-format",
        default=None,
        help="constrained decoding: json_object, or a file holding a JSON schema (sent as "
        "json_schema); each level runs unconstrained and constrained, side by side (a "
        "constrained stream ends when its JSON is complete, so compare rates, not times)",
    )
    ap.add_argument("--no-compare", action="store_true",
                    help="with --response-format: the constrained runs only")
    ap.add_argument("--warmup", type=int, default=0,
                    help="tokens per stream of one unmeasured round at each level and mode first "
                    "(kernel compilation, the grammar's first use); 0: none")
    args = ap.parse_args()
    if args.response_format == "json_object":
        args.response_format = {"type": "json_object"}
    elif args.response_format:
        with open(args.response_format) as f:
            schema = json.load(f)
        args.response_format = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "strict": True, "schema": schema},
        }
    model = args.model or get_model(args)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    rf = args.response_format
    modes = [None] if not rf else [rf] if args.no_compare else [None, rf]
    if args.warmup > 0:
        warm = argparse.Namespace(**vars(args))
        warm.rounds, warm.max_tokens = 1, args.warmup
        for c in levels:
            for m in modes:
                run_level(warm, model, c, m)
    runs = {id(m): [] for m in modes}
    for c in levels:
        # the modes alternate at each level, so drift hits both alike
        for m in modes:
            runs[id(m)].append(run_level(args, model, c, m))
    results = runs[id(modes[0])]
    extra = {}
    if rf and not args.no_compare:
        constrained = runs[id(rf)]
        extra["constrained_results"] = constrained
        extra["comparison"] = [
            {
                "concurrency": u["concurrency"],
                "tokens_per_s": [u["tokens_per_s"], k["tokens_per_s"]],
                "decode_tokens_per_s": [u["decode_tokens_per_s"], k["decode_tokens_per_s"]],
                "ratio_tokens_per_s": ratio(k["tokens_per_s"], u["tokens_per_s"]),
                "ratio_decode": ratio(k["decode_tokens_per_s"], u["decode_tokens_per_s"]),
                "pipelined_steps": [u["pipelined_steps"], k["pipelined_steps"]],
                "errors": [u["errors"], k["errors"]],
            }
            for u, k in zip(results, constrained)
        ]
    json.dump(
        {
            "server": f"http://{args.host}:{args.port}",
            "model": model,
            "endpoint": "chat" if args.chat else "completions",
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "response_format": rf,
            "results": results,
            **extra,
        },
        sys.stdout,
        indent=2,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
