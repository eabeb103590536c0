#!/usr/bin/env python3
"""Check a running `mlxcel-server --tp-size N` with the official `openai` client:
a streaming chat completion, then `kill -9` of one rank during a streaming request
(the client must get an error within 5 s, /health must go 503 and back to 200),
then a request after the restart. Prints one JSON summary line.

    python3 scripts/tp_server_check.py --port 8123 [--rank 1]
"""
import argparse
import json
import os
import re
import signal
import threading
import time
import urllib.request

from openai import OpenAI


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except Exception as e:  # connection refused etc.
        return None, str(e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--rank", type=int, default=1)
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    client = OpenAI(base_url=base + "/v1", api_key="none")
    out = {}
    model = client.models.list().data[0].id
    t0 = time.time()
    text, usage = "", None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                                max_tokens=24, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage.model_dump()
    out["first_stream"] = {"text": text[:80], "usage": usage, "seconds": round(time.time() - t0, 3)}

    _, metrics = get(base + "/metrics")
    m = re.search(r'mlxcel:tp_rank_pid\{tp_rank="%d"\} (\d+)' % a.rank, metrics)
    pid = int(m.group(1))
    result = {}

    def long_stream():
        n = 0
        try:
            for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Go on"}],
                                                        max_tokens=4000, stream=True):
                n += 1
            result["outcome"] = f"finished after {n} chunks (no error)"
        except Exception as e:  # the expected path
            result["outcome"] = f"error after {n} chunks: {type(e).__name__}: {str(e)[:200]}"
        result["t_end"] = time.time()

    th = threading.Thread(target=long_stream)
    th.start()
    time.sleep(1.5)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    th.join(timeout=30)
    out["killed_rank"] = {"rank": a.rank, "pid": pid, "client": result.get("outcome"),
                          "error_after_s": round(result.get("t_end", time.time()) - t_kill, 3)}
    seen, t_ok = [], None
    deadline = time.time() + 300
    while time.time() < deadline:
        st, _ = get(base + "/health")
        if not seen or seen[-1] != st:
            seen.append(st)
        if st == 200 and 503 in seen:
            t_ok = time.time()
            break
        time.sleep(0.2)
    out["health_sequence"] = seen
    out["back_to_200_after_s"] = round(t_ok - t_kill, 3) if t_ok else None
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello again"}], max_tokens=8)
    out["after_restart"] = {"finish_reason": r.choices[0].finish_reason, "usage": r.usage.model_dump()}
    _, metrics = get(base + "/metrics")
    m = re.search(r"^mlxcel:tp_restarts_total (\S+)$", metrics, re.M)
    out["tp_restarts_total"] = float(m.group(1)) if m else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
