"""Where MLX's quantized_matmul stops beating dequantize + dense GEMM on this GPU: µs per
call of both for 8B-shape weights at M rows (wall clock over a chain of calls, MLX's host
work included). Sets src/models/layers.rs DEQUANT_GEMM_MIN_ROWS.
    python3 scripts/qmm_crossover.py [--ms 8,16,...] [--bits 4,8]"""
import argparse, time
import mlx.core as mx

SHAPES = [("down", 4096, 14336), ("gate_up", 28672, 4096), ("qkv", 6144, 4096)]


def timed(f, reps=20):
    mx.eval(f())
    t = time.perf_counter()
    mx.eval([f() for _ in range(reps)])
    return (time.perf_counter() - t) / reps * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="8,16,32,64,128,256,512,1024,2048")
    ap.add_argument("--bits", default="4,8")
    a = ap.parse_args()
    print("| shape (N×K) | bits | M | quantized_matmul µs | dequant + matmul µs | faster |")
    print("|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        w = mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02
        for bits in map(int, a.bits.split(",")):
            wq, s, b = mx.quantize(w, group_size=64, bits=bits)
            for m in map(int, a.ms.split(",")):
                x = mx.random.normal((m, k)).astype(mx.bfloat16)
                mx.eval(x, wq, s, b)
                q = timed(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits))
                d = timed(lambda: x @ mx.dequantize(wq, s, b, group_size=64, bits=bits).T)
                print(f"| {name} {n}×{k} | {bits} | {m} | {q:.1f} | {d:.1f} | {'qmm' if q < d else 'dequant'} |", flush=True)


main()
