#!/usr/bin/env python3
"""Write the rank-proxy configs: single-process Llama configs with exactly one
tensor-parallel rank's shapes (or a whole model's), for `mlxcel bench --load-format dummy`
and `scripts/bench_mlx_lm.py --random-weights`, so one GPU measures what one rank of a
TP group decodes at. A rank of 70B at TP=N holds 64/N query heads, 8/N KV heads and
28672/N intermediate columns of each layer; the proxies keep the whole vocabulary
(what a replicated lm_head reads) except `70b-tp8-v16032-*`, whose 128256 / 8 rows
are what a vocab-parallel rank holds. The TP=2 proxy of 8B predicted the real TP=2
run on 2×H200 within 3% (50.2 vs 48.8 tok/s).

    python3 scripts/rank_proxies.py --out DIR [--tokenizer-from DIR] [--only NAME,...]
    python3 scripts/rank_proxies.py --out DIR --tiny     # the same set at toy sizes (CPU check)
    python3 scripts/rank_proxies.py --list               # names, shapes, weight GB, roofline
    python3 scripts/rank_proxies.py --table RESULTS      # the markdown table of a run of
                                                         # scripts/gpu/rank-proxies.sh

Each proxy is DIR/NAME/config.json (and the tokenizer files when --tokenizer-from is
given: mlxcel's loaders want a tokenizer, any one does, ids beyond it are valid inputs).
"""
import argparse
import json
import os
import shutil

Q4 = {"group_size": 64, "bits": 4}

# name: (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, 4-bit?)
PROXIES = {
    "70b-tp8-bf16": (8192, 80, 8, 1, 128, 3584, 128256, False),
    "70b-tp8-q4": (8192, 80, 8, 1, 128, 3584, 128256, True),
    "70b-tp8-v16032-bf16": (8192, 80, 8, 1, 128, 3584, 16032, False),
    "70b-tp8-v16032-q4": (8192, 80, 8, 1, 128, 3584, 16032, True),
    "70b-tp4-bf16": (8192, 80, 16, 2, 128, 7168, 128256, False),
    "8b-bf16": (4096, 32, 32, 8, 128, 14336, 128256, False),
    "8b-q4": (4096, 32, 32, 8, 128, 14336, 128256, True),
}

# the toy sizes of --tiny: hidden and intermediate / 8 (still whole 4-bit groups of 64),
# vocabulary / 32, two layers, head_dim 32


def config(shape, tiny=False):
    hidden, layers, heads, kv, head_dim, inter, vocab, q4 = shape
    if tiny:
        hidden, inter, vocab = hidden // 8, inter // 8, vocab // 32
        layers, head_dim = 2, 32
    c = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if q4:
        c["quantization"] = dict(Q4)
    return c


def weight_bytes(c):
    """Bytes of the weights (bf16; 4-bit g64: packed words + bf16 scales and biases)."""
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    qd, kvd = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    q = c.get("quantization")

    def mat(rows, cols):
        if q:
            return rows * cols * q["bits"] // 8 + 2 * rows * (cols // q["group_size"]) * 2
        return rows * cols * 2

    layer = mat(qd, h) + 2 * mat(kvd, h) + mat(h, qd) + 2 * mat(inter, h) + mat(h, inter) + 2 * h * 2
    return c["num_hidden_layers"] * layer + 2 * mat(v, h) + h * 2


def read_per_token(c):
    """Bytes one decoded token reads: every weight but the embedding (one row of it)."""
    h, v = c["hidden_size"], c["vocab_size"]
    q = c.get("quantization")
    emb = v * h * q["bits"] // 8 + 2 * v * (h // q["group_size"]) * 2 if q else v * h * 2
    return weight_bytes(c) - emb


def load_json_line(path):
    """The last line of a file as JSON (a bench prints one line), or None."""
    try:
        with open(path) as f:
            lines = [l for l in f.read().splitlines() if l.strip().startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def table(results, names, bandwidth):
    """Markdown rows of RESULTS/proxy-NAME-{mlxcel,mlxlm-100,mlxlm-default}.json: decode
    tok/s at batch 1, host time per token and per layer (build + eval), MLX ops per layer
    and host µs per op (mlxcel bench's ops_per_layer, host_us_per_op), roofline."""
    head = ("| proxy | weights GB | read/token GB | roofline tok/s | mlxcel tok/s | ms/token "
            "| host build + eval ms | host µs/layer | ops/layer | host µs/op "
            "| mlx-lm 100/4000 tok/s | mlx-lm MLX defaults tok/s |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in names:
        r = {k: load_json_line(os.path.join(results, f"proxy-{n}-{k}.json"))
             for k in ("mlxcel", "mlxlm-100", "mlxlm-default")}
        c = None
        if r["mlxcel"]:
            try:
                with open(os.path.join(r["mlxcel"]["model"], "config.json")) as f:
                    c = json.load(f)
            except OSError:
                pass
        c = c or config(PROXIES[n])
        rb = read_per_token(c)
        cell = ["—"] * 6
        m = r["mlxcel"]
        if m:
            d = m["decode"]
            h = d.get("host_per_token", {})
            host = h.get("build_ms", 0) + h.get("eval_ms", 0)
            cell[:4] = [f"{d['tokens_per_second']:.1f}", f"{d['ms_per_token']:.2f}",
                        f"{h.get('build_ms', 0):.2f} + {h.get('eval_ms', 0):.2f}",
                        f"{host * 1000 / c['num_hidden_layers']:.0f}"]
            if "ops_per_layer" in d:
                cell[4:] = [str(d["ops_per_layer"]), f"{d['host_us_per_op']:.2f}"]
        lm = [r[k]["decode"]["tokens_per_second"] if r[k] else None for k in ("mlxlm-100", "mlxlm-default")]
        lm = [f"{x:.1f}" if x is not None else "—" for x in lm]
        out.append(f"| {n} | {weight_bytes(c) / 1e9:.2f} | {rb / 1e9:.2f} | {bandwidth / rb:.0f} | "
                   + " | ".join(cell) + f" | {lm[0]} | {lm[1]} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder to write DIR/NAME/config.json into")
    ap.add_argument("--tokenizer-from", help="copy tokenizer.json / tokenizer_config.json from here")
    ap.add_argument("--only", help="comma-separated proxy names (default: all)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes of the same set (CPU checks)")
    ap.add_argument("--list", action="store_true", help="print names, weight GB and roofline, write nothing")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the roofline (H200: 4.3e12)")
    ap.add_argument("--table", metavar="RESULTS", help="print the markdown table of the results in RESULTS")
    a = ap.parse_args()
    names = a.only.split(",") if a.only else list(PROXIES)
    unknown = [n for n in names if n not in PROXIES]
    if unknown:
        ap.error(f"--only: unknown proxy {', '.join(unknown)} (known: {', '.join(PROXIES)})")
    if a.table:
        print(table(a.table, names, a.bandwidth))
        return
    if not a.list and not a.out:
        ap.error("--out DIR is needed (or --list, --table)")
    for n in names:
        c = config(PROXIES[n], a.tiny)
        wb, rb = weight_bytes(c), read_per_token(c)
        # roofline: the bytes a token reads; _all_weights: every weight byte (the 8B rows)
        line = {"name": n, "weights_gb": round(wb / 1e9, 2), "read_per_token_gb": round(rb / 1e9, 2),
                "roofline_tok_s": round(a.bandwidth / rb, 1),
                "roofline_all_weights_tok_s": round(a.bandwidth / wb, 1)}
        if a.list:
            print(json.dumps(line))
            continue
        d = os.path.join(a.out, n)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=1)
        if a.tokenizer_from:
            for t in ("tokenizer.json", "tokenizer_config.json"):
                src = os.path.join(a.tokenizer_from, t)
                if os.path.exists(src):
                    shutil.copy(src, d)
        line["dir"] = d
        print(json.dumps(line))


if __name__ == "__main__":
    main()
