#!/usr/bin/env python3
"""Server memory under huge prompts: the RSS of mlxcel-server before, at the
peak of, and 5 s after N concurrent chat requests whose prompt is far larger
than the context (each is refused with 400 context_length_exceeded).

For each count in --counts, a fresh server is started (CPU, the built-in demo
model unless --model), its peak RSS is reset (/proc/PID/clear_refs), the
requests are sent at once, RSS is sampled every 10 ms, and after the last
answer the script waits --settle seconds and reads RSS again. Prints one JSON
object per count. Linux only; standard library only.

    python3 scripts/prompt_rss.py --server target/debug/mlxcel-server --counts 1,8
"""
import argparse
import json
import os
import socket
import subprocess
import threading
import time


def rss_kib(pid, field="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def request(addr, body, timeout=300):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    s.sendall(head + body)
    out = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        out += b
    s.close()
    status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/") else 0
    payload = out.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in out else b""
    try:
        code = json.loads(payload)["error"]["code"]
    except Exception:
        code = None
    return status, code


def start(server, model, extra):
    cmd = [server, "--port", "0"] + (["-m", model] if model else []) + extra
    p = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "RUST_LOG": "info"},
        text=True,
    )
    addr = None
    t0 = time.time()
    while addr is None:
        line = p.stderr.readline()
        if not line:
            raise SystemExit(f"the server exited: {p.wait()}")
        if "listening on http://" in line:
            addr = line.split("listening on http://")[1].split()[0]
        if time.time() - t0 > 120:
            raise SystemExit("the server did not start")
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    while True:
        try:
            s = socket.create_connection(tuple([addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1])]))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            if s.recv(64).startswith(b"HTTP/1.1 200"):
                break
        except OSError:
            pass
        time.sleep(0.1)
    return p, addr


def measure(args, n):
    p, addr = start(args.server, args.model, args.server_args.split())
    try:
        time.sleep(args.warm)
        content = ("hello world " * (args.prompt_bytes // 12 + 1))[: args.prompt_bytes]
        body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()
        before = rss_kib(p.pid)
        try:
            with open(f"/proc/{p.pid}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM
        except OSError:
            pass
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_kib(p.pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        results = [None] * n
        times = [0.0] * n

        def one(i):
            t = time.time()
            results[i] = request(addr, body)
            times[i] = time.time() - t

        t0 = time.time()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        time.sleep(args.settle)
        done.set()
        sampler.join()
        hwm = rss_kib(p.pid, "VmHWM")
        after = rss_kib(p.pid)
        mb = lambda k: round(k / 1024, 1)
        bodies = n * len(body)
        return {
            "requests": n,
            "body_bytes": len(body),
            "answers": sorted(set(f"{s} {c}" for s, c in results)),
            "slowest_answer_s": round(max(times), 3),
            "wall_s": round(wall, 3),
            "rss_before_mb": mb(before),
            "rss_peak_mb": mb(max(peak[0], hwm)),
            "rss_after_mb": mb(after),
            "peak_increase_mb": mb(max(peak[0], hwm) - before),
            "peak_increase_per_body_byte": round((max(peak[0], hwm) - before) * 1024 / bodies, 2),
            "after_minus_before_mb": mb(after - before),
            "settle_s": args.settle,
        }
    finally:
        p.terminate()
        p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="target/debug/mlxcel-server")
    ap.add_argument("--model", default=None, help="model folder (default: the built-in demo model)")
    ap.add_argument("--counts", default="1,8")
    ap.add_argument("--prompt-bytes", type=int, default=4_000_000)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after the last answer")
    ap.add_argument("--warm", type=float, default=2.0, help="seconds between health 200 and the burst")
    ap.add_argument("--server-args", default="", help="extra server flags, one string")
    args = ap.parse_args()
    for n in [int(x) for x in args.counts.split(",")]:
        print(json.dumps(measure(args, n)), flush=True)


if __name__ == "__main__":
    main()
