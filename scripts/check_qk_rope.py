#!/usr/bin/env python3
"""Check mlxcel's Qwen3 q/k norm + RoPE + cache-write kernel (kernels/qk_rope.cu) against MLX
ops on a CUDA box: `mx.fast.rms_norm` per head, `mx.fast.rope` (traditional = False) at each
row's position, and the key/value heads at their pool rows (no other row written).

    python3 scripts/check_qk_rope.py          # bf16 and f16; Qwen3-32B TP=8 rank and 8B heads

Exit status 1 if any result is off by more than MLX's own rounding allows.
"""
import pathlib
import struct
import sys

import mlx.core as mx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from check_gemv import kv_pool, pool_rows  # noqa: E402


def kernel():
    text = (ROOT / "kernels" / "qk_rope.cu").read_text()
    header, body = text.split("// @@header\n", 1)[1].split("// @@body\n", 1)
    return mx.fast.cuda_kernel(name="mlxcel_qk_rope_check",
                               input_names=["y", "qw", "kw", "pos", "inv_freq", "pool", "dst"],
                               output_names=["q"], source=body, header=header)


def check(k, dt, m, nq, nkv, hd=128, base=1000000.0, eps=1e-6):
    h = nq + 2 * nkv
    y = (2 * mx.random.normal((m, h, 1, hd))).astype(dt)
    qw = (1 + 0.2 * mx.random.normal((hd,))).astype(dt)
    kw = (1 + 0.2 * mx.random.normal((hd,))).astype(dt)
    pos = mx.array([7, 30000, 4095, 1, 0, 12, 999, 2][:m], dtype=mx.int32)
    inv = mx.array([base ** (-2.0 * i / hd) for i in range(hd // 2)], dtype=mx.float32)
    pool, dst = kv_pool(m, 2 * nkv, hd, dt)
    q = k(inputs=[y, qw, kw, pos, inv, pool, dst],
          template=[("T", dt), ("NQ", nq), ("NKV", nkv), ("HD", hd),
                    ("EPS_BITS", struct.unpack("<i", struct.pack("<f", eps))[0])],
          grid=(m * h * hd // 2, 1, 1), threadgroup=(hd // 2, 1, 1),
          output_shapes=[(m, nq, 1, hd)], output_dtypes=[dt])[0]
    mx.eval(q)
    kv = pool_rows(pool, dst)
    # MLX's ops: norm per head (rounded to dt), RoPE at each row's position
    qn = mx.fast.rms_norm(y[:, :nq], qw, eps)
    kn = mx.fast.rms_norm(y[:, nq:nq + nkv], kw, eps)
    rq = mx.concatenate([mx.fast.rope(qn[i:i + 1], hd, traditional=False, base=base, scale=1.0,
                                      offset=int(pos[i].item())) for i in range(m)], axis=0)
    rk = mx.concatenate([mx.fast.rope(kn[i:i + 1], hd, traditional=False, base=base, scale=1.0,
                                      offset=int(pos[i].item())) for i in range(m)], axis=0)
    want_kv = mx.concatenate([rk, y[:, nq + nkv:]], axis=1)

    def err(a, b):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-6)).item()
    e = max(err(q, rq), err(kv, want_kv))
    ok = e <= (2e-2 if dt == mx.bfloat16 else 4e-3)
    print(f"| {dt} | M={m} | {nq} q / {nkv} kv heads | {e:.2e} | {'yes' if ok else 'NO'} |", flush=True)
    return ok


def main():
    if not mx.cuda.is_available():
        sys.exit("check_qk_rope: needs MLX's CUDA backend")
    k = kernel()
    print("| dtype | batch | heads | max rel error vs MLX ops | ok |\n|---|---|---|---|---|")
    bad = 0
    for dt in (mx.bfloat16, mx.float16):
        for m, nq, nkv in ((1, 8, 1), (3, 8, 1), (8, 32, 8)):
            bad += not check(k, dt, m, nq, nkv)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
