#!/usr/bin/env python3
"""config.json folders of mixture-of-experts shapes, for `--load-format dummy` runs
(`mlxcel bench`, `mlxcel plan`) and scripts/bench_mlx_lm.py --random-weights:

    python3 scripts/make_moe_configs.py --out DIR [--tokenizer-from TOKDIR] [--tiny]

writes DIR/{qwen3-30b-a3b-bf16, qwen3-30b-a3b-q4, mixtral-8x7b-bf16,
qwen3-235b-a22b-bf16, qwen3-235b-a22b-q4}/config.json, the shapes of the published
configs (4-bit: MLX affine, group 64). --tiny shrinks every shape (float32, a few
experts) for a dry run on a CPU, where MLX's gather_mm only takes float32.
--tokenizer-from copies tokenizer.json / tokenizer_config.json (mlxcel needs one).
"""
import argparse
import json
import shutil
from pathlib import Path

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts_per_tok": 8, "num_experts": 128,
    "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645, "sliding_window": None, "use_sliding_window": False,
}
SHAPES = {
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": {**QWEN3_MOE, "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "max_window_layers": 48},
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-a22b": {**QWEN3_MOE, "hidden_size": 4096, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "max_window_layers": 94},
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "vocab_size": 32000, "tie_word_embeddings": False,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
                     "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1,
                     "eos_token_id": 2, "sliding_window": None},
}
TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 256, "moe_intermediate_size": 64, "vocab_size": 1000,
        "torch_dtype": "float32"}
FOLDERS = [("qwen3-30b-a3b", False), ("qwen3-30b-a3b", True), ("mixtral-8x7b", False),
           ("qwen3-235b-a22b", False), ("qwen3-235b-a22b", True)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer-from", type=Path)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    for shape, q4 in FOLDERS:
        cfg = dict(SHAPES[shape])
        if a.tiny:
            cfg.update({k: v for k, v in TINY.items() if k in cfg or k == "head_dim"})
            if "num_experts" in cfg:
                cfg["num_experts"], cfg["num_experts_per_tok"] = 16, 4
            else:
                cfg["intermediate_size"] = 128
        if q4:
            cfg["quantization"] = {"group_size": 64, "bits": 4}
        folder = a.out / f"{shape}-{'q4' if q4 else 'bf16'}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        if a.tokenizer_from:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (a.tokenizer_from / f).exists():
                    shutil.copy(a.tokenizer_from / f, folder / f)
        print(folder)


if __name__ == "__main__":
    main()
