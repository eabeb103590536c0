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

With `--compare-engine` the script runs everything itself and prints the engine and
the server side by side, one row per batch size B of `--concurrency`:

    python3 scripts/bench_server.py --compare-engine --mlxcel target/release/mlxcel \
        -m MODEL_DIR [--load-format dummy] --concurrency 1,8,32,64 [--warmup 16]

- engine: `mlxcel bench --serve-workload B` (B prompts of `--prompt-tokens` random
  tokens prefilled, then decode until each has `--max-tokens` tokens, as one batch),
  aggregate generated tok/s over the whole wall time;
- server: `mlxcel serve --parallel max(B) --ctx-size 1024` started by the script, then
  per B a burst of B concurrent streaming /v1/completions of `--prompt-tokens` random
  token ids each (greedy, `ignore_eos`, `--max-tokens` generated; `logprobs: 0`, so
  every token is its own chunk), aggregate generated tok/s over the burst's wall time;
- the ratio server/engine, the burst's TTFT p50 against the target
  1.5 × (B × prompt tokens ÷ the engine's prefill rate at `--prefill-len` + one decode
  step at batch B), and the p99 inter-token gap against the engine's decode step.
"""
import argparse
import http.client
import json
import os
import random
import re
import shlex
import statistics
import subprocess
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
    pieces = []
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
                pieces.append(piece)
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
    conn.close()
    if response_format:
        # the constrained output must be JSON (a cut one, at max_tokens, cannot be; without
        # a usage chunk the length is unknown)
        try:
            json.loads("".join(pieces))
        except ValueError:
            if 0 < tokens < args.max_tokens:
                raise RuntimeError("constrained output is not JSON: " + "".join(pieces)[:200])
    return ttft, gaps, tokens


def metrics_text(args):
    """The server's /metrics page ("" when it has none)."""
    try:
        conn = http.client.HTTPConnection(args.host, args.port, timeout=10)
        conn.request("GET", "/metrics", headers=headers(args))
        text = conn.getresponse().read().decode()
        conn.close()
        return text
    except (OSError, http.client.HTTPException):
        return ""


def server_counter(args, name):
    """A counter of the server's /metrics (None when it has no such page or line)."""
    for line in metrics_text(args).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


HOST = "mlxcel:decode_host_seconds_total"


def host_seconds(args):
    """The server's engine-thread seconds of pipelined decode steps by part ({} when it
    has no such counters)."""
    out = {}
    for line in metrics_text(args).splitlines():
        if line.startswith(HOST + '{part="'):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


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
    host0 = host_seconds(args)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    pipelined1 = server_counter(args, PIPELINED)
    host1 = host_seconds(args)
    steps = None if pipelined0 is None or pipelined1 is None else pipelined1 - pipelined0
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
        "pipelined_steps": steps,
        # the engine thread's ms per pipelined step, by part (masks, queue, wait, deliver)
        "host_ms_per_step": {k: (host1[k] - host0.get(k, 0.0)) * 1e3 / steps
                             for k in host1} if steps else None,
    }


PIPELINED = "mlxcel:pipelined_decode_steps_total"


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def merge_runs(rs):
    """Runs of one level and mode as one: mean rates, summed counts, mean host parts."""
    out = dict(rs[0])
    for k in ("tokens_per_s", "decode_tokens_per_s"):
        out[k] = mean(r[k] for r in rs)
    for k in ("pipelined_steps", "errors", "requests"):
        if all(isinstance(r.get(k), (int, float)) for r in rs):
            out[k] = sum(r[k] for r in rs)
    parts = [r.get("host_ms_per_step") for r in rs if r.get("host_ms_per_step")]
    if parts:
        out["host_ms_per_step"] = {k: mean(p.get(k) for p in parts) for k in parts[0]}
    out["runs"] = len(rs)
    return out


def compare_pairs(us, ks):
    """Constrained vs unconstrained at one level over alternated pairs of runs: the ratio
    of the mean rates, and each pair's own ratio (with their median)."""
    u, k = merge_runs(us), merge_runs(ks)
    per = [ratio(b["tokens_per_s"], a["tokens_per_s"]) for a, b in zip(us, ks)]
    per_decode = [ratio(b["decode_tokens_per_s"], a["decode_tokens_per_s"]) for a, b in zip(us, ks)]
    known = [x for x in per if x is not None]
    return {
        "concurrency": u["concurrency"],
        "pairs": len(us),
        "tokens_per_s": [u["tokens_per_s"], k["tokens_per_s"]],
        "decode_tokens_per_s": [u["decode_tokens_per_s"], k["decode_tokens_per_s"]],
        "ratio_tokens_per_s": ratio(k["tokens_per_s"], u["tokens_per_s"]),
        "ratio_decode": ratio(k["decode_tokens_per_s"], u["decode_tokens_per_s"]),
        "ratio_per_pair": per,
        "ratio_decode_per_pair": per_decode,
        "ratio_median": statistics.median(known) if known else None,
        "pipelined_steps": [u["pipelined_steps"], k["pipelined_steps"]],
        "errors": [u["errors"], k["errors"]],
        "host_ms_per_step": [u.get("host_ms_per_step"), k.get("host_ms_per_step")],
    }


def ratio(a, b):
    return a / b if a is not None and b else None


# ---- --compare-engine: the engine (`mlxcel bench --serve-workload`) and the server


def engine_run(args, levels):
    """`mlxcel bench --serve-workload` at every level, and prefill at --prefill-len."""
    cmd = [
        args.mlxcel, "bench", "-m", args.model_dir, "--load-format", args.load_format,
        "--prompt-lens", str(args.prefill_len), "--decode-tokens", "8",
        "--decode-context", "8", "--serve-workload", ",".join(map(str, levels)),
        "--workload-prompt", str(args.prompt_tokens), "--workload-tokens", str(args.max_tokens),
        "--repeats", str(args.engine_repeats),
    ] + shlex.split(args.engine_args)
    print("engine: " + " ".join(cmd), file=sys.stderr)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


class Served:
    """`mlxcel serve` on a free port, until stopped; its log goes to stderr."""

    def __init__(self, args, parallel):
        cmd = [
            args.mlxcel, "serve", "-m", args.model_dir, "--load-format", args.load_format,
            "--host", "127.0.0.1", "--port", "0", "--parallel", str(parallel),
            "--ctx-size", str(args.ctx_size),
        ] + shlex.split(args.server_args)
        print("server: " + " ".join(cmd), file=sys.stderr)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.port = None
        found = threading.Event()

        def read_log():
            for line in self.proc.stderr:
                if args.server_log:
                    sys.stderr.write(line)
                m = re.search(r"listening on http://[^:\s]+:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    found.set()

        threading.Thread(target=read_log, daemon=True).start()
        deadline = time.time() + args.start_timeout
        while not found.wait(0.2):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise SystemExit("the server did not start (run with --server-log)")
        while time.time() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit("the server never became healthy")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def burst(args, model, b, vocab, max_tokens, seed):
    """b streaming requests released at once; the burst's wall time, TTFTs and gaps."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(b)]
    go = threading.Barrier(b + 1)
    ttfts, gaps, errors, tokens = [], [], [], [0]
    lock = threading.Lock()

    def worker(i):
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0,
                "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection(args.host, args.port, timeout=args.timeout)
        go.wait()
        try:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers(args))
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"{resp.status} {resp.read()[:300]!r}")
            first, last, g, n = None, None, [], 0
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    if line == b"data: [DONE]":
                        break
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message"))
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if first is None:
                        first = now - t0
                    else:
                        g.append(now - last)
                    last = now
            with lock:
                if first is not None:
                    ttfts.append(first)
                gaps.extend(g)
                tokens[0] += n
        except Exception as e:  # noqa: BLE001 - report and go on
            with lock:
                errors.append(str(e))
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(b)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, ttfts, gaps, tokens[0], errors


def compare_engine(args, levels):
    eng = engine_run(args, levels)
    with open(os.path.join(eng["model"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prefill = {row["tokens"]: row["tokens_per_second"] for row in eng["prefill"]}
    prefill_rate = prefill.get(args.prefill_len)
    engine_rows = {row["batch"]: row for row in eng["serve_workload"]}
    srv = Served(args, max(levels))
    args.host, args.port = "127.0.0.1", srv.port
    rows = []
    try:
        model = get_model(args)
        for b in levels:
            if args.warmup > 0:
                burst(args, model, b, vocab, args.warmup, seed=b)
            wall, ttfts, gaps, n, errors = burst(args, model, b, vocab, args.max_tokens,
                                                 seed=1000 + b)
            e = engine_rows[b]
            step_s = e["ms_per_decode_step"] / 1e3
            server_tps = n / wall if wall > 0 else 0.0
            ttft_p50 = percentile(ttfts, 50)
            gap_p99 = percentile(gaps, 99)
            target = (1.5 * (b * args.prompt_tokens / prefill_rate + step_s)
                      if prefill_rate else None)
            rows.append({
                "batch": b,
                "engine_tokens_per_s": e["tokens_per_second"],
                "server_tokens_per_s": server_tps,
                "ratio": ratio(server_tps, e["tokens_per_second"]),
                "server_completion_tokens": n,
                "server_wall_s": wall,
                "ttft_p50_s": ttft_p50,
                "ttft_target_s": target,
                "inter_token_p99_s": gap_p99,
                "engine_decode_step_s": step_s,
                "gap_p99_over_step": ratio(gap_p99, step_s),
                "errors": len(errors),
                "first_error": errors[0] if errors else None,
            })
    finally:
        srv.stop()
    fmt = lambda x, k=1.0, d=1: "-" if x is None else f"{x * k:,.{d}f}"  # noqa: E731
    print(f"{eng['model']} ({eng['load_format']}, {eng['backend']}, {eng['device']}): "
          f"{args.prompt_tokens} prompt + {args.max_tokens} generated tokens per stream; "
          f"prefill({args.prefill_len}) {fmt(prefill_rate)} tok/s")
    print("| B | engine tok/s | server tok/s | server/engine | TTFT p50 s | TTFT target s "
          "| p99 gap ms | decode step ms | p99 gap / step | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {fmt(r['engine_tokens_per_s'])} | {fmt(r['server_tokens_per_s'])} "
              f"| {fmt(r['ratio'], 100)}% | {fmt(r['ttft_p50_s'], d=3)} "
              f"| {fmt(r['ttft_target_s'], d=3)} | {fmt(r['inter_token_p99_s'], 1e3)} "
              f"| {fmt(r['engine_decode_step_s'], 1e3)} | {fmt(r['gap_p99_over_step'], d=2)} "
              f"| {r['errors']} |")
    print(json.dumps({"engine": eng, "prompt_tokens": args.prompt_tokens,
                      "max_tokens": args.max_tokens, "rows": rows}))
    if any(r["errors"] or not r["server_completion_tokens"] for r in rows):
        sys.exit(1)


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
    ap.add_argument("--pairs", type=int, default=1,
                    help="with --response-format: run the unconstrained/constrained pair this many "
                    "times at each level, alternated (the comparison: ratio of the mean rates, and "
                    "each pair's ratio with their median)")
    ap.add_argument("--no-compare", action="store_true",
                    help="with --response-format: the constrained runs only")
    ap.add_argument("--warmup", type=int, default=0,
                    help="tokens per stream of one unmeasured round at each level and mode first "
                    "(kernel compilation, the grammar's first use); 0: none")
    cmp = ap.add_argument_group("--compare-engine: engine and server side by side")
    cmp.add_argument("--compare-engine", action="store_true",
                     help="run `mlxcel bench --serve-workload` and a server started here, "
                     "and print them side by side (see above)")
    cmp.add_argument("--mlxcel", default="mlxcel", help="the mlxcel binary")
    cmp.add_argument("-m", "--model-dir", default="demo", help="mlxcel -m (default: demo)")
    cmp.add_argument("--load-format", default="safetensors")
    cmp.add_argument("--prompt-tokens", type=int, default=128,
                     help="random prompt tokens per stream")
    cmp.add_argument("--prefill-len", type=int, default=2048,
                     help="prompt length of the engine's prefill rate in the TTFT target")
    cmp.add_argument("--ctx-size", type=int, default=1024)
    cmp.add_argument("--engine-repeats", type=int, default=2)
    cmp.add_argument("--engine-args", default="", help="more `mlxcel bench` arguments")
    cmp.add_argument("--server-args", default="", help="more `mlxcel serve` arguments")
    cmp.add_argument("--server-log", action="store_true", help="copy the server's log to stderr")
    cmp.add_argument("--start-timeout", type=float, default=1800.0)
    args = ap.parse_args()
    if args.compare_engine:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        compare_engine(args, levels)
        return
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
    pairs = max(1, args.pairs) if rf and not args.no_compare else 1
    for c in levels:
        # the modes alternate at each level (`--pairs` times), so drift hits both alike
        for _ in range(pairs):
            for m in modes:
                runs[id(m)].append(run_level(args, model, c, m))
    results = runs[id(modes[0])]
    extra = {}
    if rf and not args.no_compare:
        constrained = runs[id(rf)]
        extra["constrained_results"] = constrained
        extra["comparison"] = [
            compare_pairs(results[i:i + pairs], constrained[i:i + pairs])
            for i in range(0, len(results), pairs)
        ]
        if pairs > 1:
            results = [merge_runs(results[i:i + pairs]) for i in range(0, len(results), pairs)]
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
