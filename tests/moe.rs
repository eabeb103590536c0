//! Mixture-of-experts families (qwen3_moe, mixtral, qwen2_moe) against independent
//! references: tiny random transformers models (float32) in the per-expert layout
//! save_pretrained writes and in transformers 5's packed layout, and an MLX 4-bit
//! qwen3_moe (mlx-community's stacked `switch_mlp` layout) against mlx-lm; then tensor
//! parallelism over emulated ranks (intermediate split and expert parallel) equal to
//! one process, the group-size refusal, and the memory plan against what ranks load.
//! Fixtures: scripts/make_moe_fixtures.py.
use std::path::{Path, PathBuf};

use mlxcel::engine::step::LocalExecutor;
use mlxcel::mlx::Array;
use mlxcel::model_dir::ModelDir;
use mlxcel::models::{self, LoadFormat, Logits, SeqInput, StepInput};
use mlxcel::parallel::driver::{TpExecutor, TpOptions};
use serde_json::Value;

mod support;
use support::{fixture, run_plan, serial};

/// A fixture's references: prompt ids, greedy tokens, prompt logits `[T, vocab]`.
struct Reference {
    ids: Vec<u32>,
    greedy: Vec<u32>,
    logits: Vec<f32>,
}

fn reference(dir: &Path) -> Reference {
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("token_reference.json")).unwrap())
            .unwrap();
    let ints = |k: &str| -> Vec<u32> {
        j[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let bytes = std::fs::read(dir.join("token_reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("prompt_logits").unwrap();
    let logits = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Reference {
        ids: ints("prompt_ids"),
        greedy: ints("greedy"),
        logits,
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// All-position prompt logits, then greedy tokens one decode step at a time.
fn run_local(model: &models::Model, prompt: &[u32], steps: usize) -> (Vec<f32>, Vec<u32>) {
    let mut cache = model.new_cache(1, 256);
    let seq = [SeqInput {
        slot: 0,
        tokens: prompt,
    }];
    let out = model
        .forward(&mut cache, StepInput::Host(&seq), Logits::All)
        .unwrap();
    let logits: Vec<f32> = out[0].to_vec().unwrap();
    let vocab = model.cfg.vocab_size;
    let mut tokens = vec![argmax(&logits[logits.len() - vocab..])];
    while tokens.len() < steps {
        let last = [*tokens.last().unwrap()];
        let seq = [SeqInput {
            slot: 0,
            tokens: &last,
        }];
        let out = model
            .forward(&mut cache, StepInput::Host(&seq), Logits::Last)
            .unwrap();
        let row: Vec<f32> = out[0].to_vec().unwrap();
        tokens.push(argmax(&row));
    }
    (logits, tokens)
}

/// The model in `weights` (its config, unless `weights` has none: then `refs`'s)
/// against the references in `refs`.
fn check_against_reference(weights: &str, refs: &str, tol: f32) {
    let dir = fixture(weights);
    let md = ModelDir::open(&dir).unwrap();
    let model = models::load(&md, LoadFormat::Safetensors, |_, _| {})
        .unwrap()
        .model;
    let r = reference(&fixture(refs));
    let (logits, tokens) = run_local(&model, &r.ids, r.greedy.len());
    let diff = max_diff(&logits, &r.logits);
    eprintln!("{weights}: all-position logits max-abs diff {diff:.2e}");
    assert!(diff <= tol, "{weights}: logits differ by {diff} (> {tol})");
    assert_eq!(tokens, r.greedy, "{weights}: greedy tokens");
}

#[test]
fn qwen3_moe_per_expert_layout_matches_transformers() {
    check_against_reference("qwen3_moe", "qwen3_moe", 1e-4);
}

#[test]
fn qwen3_moe_packed_layout_matches_transformers() {
    // transformers 5's in-memory tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]),
    // the same model as qwen3_moe
    check_against_reference("qwen3_moe_packed", "qwen3_moe", 1e-4);
}

#[test]
fn mixtral_matches_transformers() {
    check_against_reference("mixtral", "mixtral", 1e-4);
}

#[test]
fn qwen2_moe_shared_expert_matches_transformers() {
    check_against_reference("qwen2_moe", "qwen2_moe", 1e-4);
}

#[test]
fn qwen3_moe_4bit_switch_mlp_matches_mlx_lm() {
    check_against_reference("qwen3_moe_q4", "qwen3_moe_q4", 1e-4);
}

#[test]
fn config_reads_sparse_layers_and_expert_fields() {
    let md = ModelDir::open(&fixture("qwen3_moe")).unwrap();
    let cfg = models::read_config(&md).unwrap();
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate),
        (4, 2, 8)
    );
    assert!(moe.norm_topk_prob);
    // mlp_only_layers [1]: layer 1 is a dense MLP
    assert_eq!(moe.sparse_layers, vec![true, false, true]);
    let md = ModelDir::open(&fixture("qwen2_moe")).unwrap();
    let cfg = models::read_config(&md).unwrap();
    assert_eq!(cfg.moe.unwrap().shared_expert_intermediate, Some(16));
    // more experts per token than experts: refused, naming the field
    let mut v: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("mixtral").join("config.json")).unwrap(),
    )
    .unwrap();
    v["num_experts_per_tok"] = 5.into();
    let e = models::ModelConfig::from_json(&v).unwrap_err().to_string();
    assert!(e.contains("num_experts_per_tok"), "{e}");
}

/// Routing as transformers: float32 softmax, top-k, renormalised; ties go to the lowest
/// expert index.
#[test]
fn routing_ties_take_the_lowest_expert_index() {
    let p = [0.1f32, 0.3, 0.3, 0.3];
    let a = Array::from_slice(&p, &[1, 4]).unwrap();
    let idx: Vec<u32> = a
        .neg()
        .unwrap()
        .argsort(-1)
        .unwrap()
        .slice_axis(-1, 0, 2)
        .unwrap()
        .to_vec()
        .unwrap();
    assert_eq!(idx, vec![1, 2]);
}

fn tp_options(n: usize, expert_parallel: bool) -> TpOptions {
    let mut o = TpOptions::new(n, 256, 2);
    o.emulate = true;
    o.expert_parallel = expert_parallel;
    o.program = Some(PathBuf::from(env!("CARGO_BIN_EXE_mlxcel")));
    o
}

/// Emulated TP at each size equal to one process (logits within 1e-4, same tokens), and
/// every rank's weights as the memory plan says (within 1%).
fn check_tp(name: &str, sizes: &[usize], expert_parallel: bool) {
    let dir = fixture(name);
    let md = ModelDir::open(&dir).unwrap();
    // the packed folder holds qwen3_moe's weights and shares its references
    let r = reference(&fixture(name.trim_end_matches("_packed")));
    let steps = r.greedy.len();
    let model = models::load(&md, LoadFormat::Safetensors, |_, _| {})
        .unwrap()
        .model;
    let mut local = LocalExecutor::new(model, 2, 256);
    let (want_logits, want_tokens) = run_plan(&mut local, &r.ids, steps);
    let cfg = models::read_config(&md).unwrap();
    let catalog = models::weights::catalog(&md).unwrap();
    for &n in sizes {
        let what = format!("{name} tp={n} expert_parallel={expert_parallel}");
        let mut tp = TpExecutor::launch(&md, tp_options(n, expert_parallel))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (logits, tokens) = run_plan(&mut tp, &r.ids, steps);
        let diff = max_diff(&logits, &want_logits);
        assert!(diff <= 1e-4, "{what}: logits max-abs diff {diff}");
        assert_eq!(tokens, want_tokens, "{what}: greedy tokens");
        let input = mlxcel::parallel::plan::PlanInput {
            cfg: &cfg,
            catalog: Some(&catalog),
            tp_size: n,
            ctx_size: 256,
            slots: 2,
            max_num_batched_tokens: 512,
            backend: mlxcel::mlx::backend(),
            vocab_parallel: true,
            kv_tokens: None,
        };
        let plan = mlxcel::parallel::plan::plan_memory_with(&input, expert_parallel).unwrap();
        assert_eq!(tp.reports().len(), n, "{what}: one report per rank");
        eprintln!("{what}: logits max-abs diff {diff:.2e}");
        for rep in tp.reports() {
            eprintln!("{what}: {}", rep.summary());
            let want = plan.ranks[rep.rank].weight_bytes as f64;
            let got = rep.weight_bytes as f64;
            assert!(
                (got - want).abs() <= 0.01 * want,
                "{what} rank {}: holds {got} weight bytes, the plan says {want}",
                rep.rank
            );
            assert_eq!(
                rep.bytes_read,
                rep.weight_bytes,
                "{what}: {}",
                rep.summary()
            );
        }
        tp.shutdown();
    }
}

#[test]
fn qwen3_moe_tp2_tp4_match_one_process() {
    let _g = serial();
    check_tp("qwen3_moe", &[2, 4], false);
}

#[test]
fn expert_parallel_tp2_tp4_match_one_process() {
    let _g = serial();
    // 4 experts: 2 per rank at TP 2, 1 at TP 4; qwen2_moe's shared expert is still split
    check_tp("qwen3_moe", &[2, 4], true);
    check_tp("qwen2_moe", &[2], true);
}

#[test]
fn mixtral_qwen2_moe_packed_tp2_match_one_process() {
    let _g = serial();
    for f in ["mixtral", "qwen2_moe", "qwen3_moe_packed"] {
        check_tp(f, &[2], false);
    }
}

#[test]
fn quantized_split_breaking_the_group_is_refused_and_expert_parallel_runs() {
    let _g = serial();
    // moe_intermediate_size 32 with group 32: 2 ranks would get 16 columns of down_proj
    let md = ModelDir::open(&fixture("qwen3_moe_q4")).unwrap();
    let e = match TpExecutor::launch(&md, tp_options(2, false)) {
        Ok(_) => panic!("a split breaking the quantization group was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("--tp-size 2")
            && e.contains("--enable-expert-parallel")
            && e.contains("valid sizes: 1"),
        "{e}"
    );
    check_tp("qwen3_moe_q4", &[2], true);
}

/// Qwen3-30B-A3B 4-bit (group 64): 768 / 8 = 96 columns of every expert's down_proj per
/// rank breaks the group, so --tp-size 8 is refused naming the flag that works and the
/// valid sizes either way; with whole experts per rank it splits.
#[test]
fn qwen3_30b_a3b_4bit_at_tp8_needs_expert_parallel() {
    let cfg: Value = serde_json::json!({
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": true, "vocab_size": 151936,
        "rope_theta": 1e6, "torch_dtype": "bfloat16",
        "quantization": {"group_size": 64, "bits": 4},
    });
    let cfg = models::ModelConfig::from_json(&cfg).unwrap();
    let e = models::shard::validate(&cfg, 8).unwrap_err().to_string();
    assert!(
        e.contains("--tp-size 8")
            && e.contains("96 input columns")
            && e.contains("group_size 64")
            && e.contains("valid sizes: 1, 2, 4)")
            && e.contains("--enable-expert-parallel (valid sizes with it: 1, 2, 4, 8, 16, 32)"),
        "{e}"
    );
    models::shard::validate_with(&cfg, 8, true).unwrap();
    // the plan's MoE working memory over a 512-token chunk (bf16): the pairs' rows, and
    // two layers' dequantized gate/up stacks of the 128 experts
    let full = models::shard::ShardPlan::full(&cfg);
    let pairs = 512 * 8 * (2 * 2048 + 3 * 768) * 2;
    let dequant = 2 * (2 * 128 * 768 * 2048) * 2;
    assert_eq!(
        models::blocks::moe::working_bytes(&cfg, &full, 512, 2),
        pairs + dequant
    );
    // 8 ranks of 16 whole experts: each dequantizes its own
    let ep = models::shard::plan_with(
        &cfg,
        8,
        3,
        models::shard::SplitOptions {
            vocab_parallel: true,
            expert_parallel: true,
        },
    )
    .unwrap();
    assert_eq!(
        models::blocks::moe::working_bytes(&cfg, &ep, 512, 2),
        pairs + dequant / 8
    );
    // 128 experts over 3 ranks do not split whole
    let e = models::shard::validate_with(&cfg, 3, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--tp-size 3"), "{e}");
}
