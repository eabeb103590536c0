#!/usr/bin/env python3
"""Build the tiny random-weight mixture-of-experts test models under tests/fixtures/
(next to scripts/make_fixtures.py, with the same pinned versions:
scripts/requirements-fixtures.txt).

    /tmp/fixvenv/bin/python scripts/make_moe_fixtures.py            # rewrites them
    /tmp/fixvenv/bin/python scripts/make_moe_fixtures.py --out /tmp/fx

What is built (float32 unless said; every folder: config.json, model.safetensors,
token_reference.json with the prompt ids and greedy tokens, token_reference.safetensors
with the prompt's logits at every position; named apart from make_fixtures.py's
tokenizer-based reference.json, which check_fixtures.py and --verify read):
  * qwen3_moe         transformers Qwen3MoeForCausalLM, 3 layers (layer 1 dense through
                      mlp_only_layers), 4 experts top-2, norm_topk_prob, the per-expert
                      layout save_pretrained writes (`mlp.experts.{e}.gate_proj.weight`).
  * qwen3_moe_packed  the same model's weights as transformers 5 holds them in memory
                      (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj
                      [E, H, I]`); config and references are qwen3_moe's (not copied).
  * mixtral           transformers MixtralForCausalLM, 2 layers, 4 experts top-2
                      (`block_sparse_moe.experts.{e}.w1/w2/w3`).
  * qwen2_moe         transformers Qwen2MoeForCausalLM, 2 layers, 4 experts top-2 plus a
                      shared expert with its sigmoid gate, q/k/v biases.
  * qwen3_moe_q4      MLX affine 4-bit (group 32; the router 8-bit, group 64, as mlx-lm's
                      predicate says) made by mlx-lm's convert from a float qwen3_moe:
                      stacked `mlp.switch_mlp.*` weights; references from mlx-lm.
No tokenizer: tests feed token ids. Prompts are random ids (fixed seed); 32 prompt
tokens x top-2 = 64 (token, expert) pairs, which takes the sorted expert path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
INIT_STD = 0.25
VOCAB = 64
PROMPT_LEN = 32
N_GREEDY = 8
MIN_GAP = 2e-3

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "initializer_range": INIT_STD,
    "bos_token_id": None,
    "eos_token_id": None,
}

SPECS = {
    "qwen3_moe": {
        "seed": 27,
        "config": {
            **COMMON,
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_hidden_layers": 3,
            "intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "attention_bias": False,
        },
    },
    "mixtral": {
        "seed": 28,
        "config": {
            **COMMON,
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "num_hidden_layers": 2,
            "intermediate_size": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": None,
        },
    },
    "qwen2_moe": {
        "seed": 29,
        "config": {
            **COMMON,
            "model_type": "qwen2_moe",
            "architectures": ["Qwen2MoeForCausalLM"],
            "num_hidden_layers": 2,
            "intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 16,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": False,
            "qkv_bias": True,
        },
    },
}

Q4_SPEC = {
    "seed": 30,
    "config": {
        **COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
    },
}


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def prompt_ids(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(0, VOCAB, PROMPT_LEN)]


def hf_model(spec: dict, folder: Path):
    """The random float32 transformers model of `spec`, its config written to `folder`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", spec["config"])
    # config.json as transformers 5 writes it (rope_parameters, dtype, ...)
    AutoConfig.from_pretrained(folder).save_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=gen))
    model.eval()
    return model


def save_per_expert(model, folder: Path) -> None:
    """model.safetensors as save_pretrained writes it (per-expert tensors)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        shutil.copy(Path(tmp) / "model.safetensors", folder / "model.safetensors")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not any(k.endswith("gate_up_proj") for k in keys), keys
    assert any(".experts.0." in k for k in keys), keys


def save_packed(model, folder: Path) -> None:
    """model.safetensors of the in-memory (transformers 5 packed) parameter names."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().clone() for k, v in sorted(model.state_dict().items())}
    sd.pop("lm_head.weight", None)  # tied
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd), list(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def hf_references(model, ids: list[int]) -> tuple[np.ndarray, list[int], float]:
    """All-position prompt logits, greedy tokens, and the smallest top-2 gap of a step."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=N_GREEDY,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    steps = np.stack([s[0].float().numpy() for s in out.scores])
    gap = min(top2_gaps(steps) + [top2_gaps(logits)[-1]])
    return logits, [int(t) for t in out.sequences[0, len(ids):]], gap


def top2_gaps(logits: np.ndarray) -> list[float]:
    s = np.sort(logits, axis=-1)
    return [float(g) for g in (s[:, -1] - s[:, -2])]


def write_refs(
    folder: Path, ids, logits: np.ndarray, greedy, source: str, seed: int, gap: float
) -> None:
    save_file(
        {"prompt_logits": torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))},
        str(folder / "token_reference.safetensors"),
    )
    write_json(
        folder / "token_reference.json",
        {
            "source": source,
            "seed": seed,
            "prompt_ids": ids,
            "greedy": greedy,
            "min_greedy_top2_gap": gap,
        },
    )


def build_float(name: str, out: Path) -> None:
    spec = dict(SPECS[name])
    folder = out / name
    # a seed whose greedy steps are clear (top-2 gap >= MIN_GAP), so greedy tokens
    # compare exactly under 1e-4 logit differences
    for attempt in range(20):
        if folder.exists():
            shutil.rmtree(folder)
        model = hf_model(spec, folder)
        ids = prompt_ids(spec["seed"])
        logits, greedy, gap = hf_references(model, ids)
        if gap >= MIN_GAP:
            break
        spec["seed"] += 100
    else:
        raise SystemExit(f"{name}: no seed with clear greedy steps")
    save_per_expert(model, folder)
    write_refs(folder, ids, logits, greedy, "transformers", spec["seed"], gap)
    if name == "qwen3_moe":
        packed = out / "qwen3_moe_packed"
        if packed.exists():
            shutil.rmtree(packed)
        save_packed(model, packed)
        # the packed folder shares qwen3_moe's config and references
        shutil.copy(folder / "config.json", packed / "config.json")


def build_q4(out: Path) -> None:
    import mlx.core as mx
    from mlx_lm import convert, load

    folder = out / "qwen3_moe_q4"
    if folder.exists():
        shutil.rmtree(folder)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "float"
        model = hf_model(Q4_SPEC, src)
        save_per_expert(model, src)
        # mlx-lm reads the classic fields (num_experts, rope_theta)
        write_json(src / "config.json", Q4_SPEC["config"])
        # mlx-lm's convert reads a tokenizer: a minimal word-level one for the vocab
        from tokenizers import Tokenizer, models

        vocab = {f"t{i}": i for i in range(VOCAB)}
        Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(src / "tokenizer.json"))
        write_json(src / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})
        convert(str(src), mlx_path=str(folder), quantize=True, q_group_size=32, q_bits=4)
    for f in list(folder.iterdir()):
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    mx.set_default_device(mx.cpu)
    m, _ = load(str(folder))
    ids = prompt_ids(Q4_SPEC["seed"])[:16]
    logits = np.array(m(mx.array([ids])).astype(mx.float32)[0])
    seq, gaps = list(ids), []
    for _ in range(N_GREEDY):
        last = np.array(m(mx.array([seq]))[0, -1].astype(mx.float32))
        gaps.append(top2_gaps(last[None])[0])
        seq.append(int(np.argmax(last)))
    write_refs(folder, ids, logits, seq[len(ids):], "mlx-lm", Q4_SPEC["seed"], min(gaps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures")
    ap.add_argument("--only", default="qwen3_moe,mixtral,qwen2_moe,qwen3_moe_q4")
    args = ap.parse_args()
    for name in args.only.split(","):
        if name == "qwen3_moe_q4":
            build_q4(args.out)
        else:
            build_float(name, args.out)
        print(f"built {name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
