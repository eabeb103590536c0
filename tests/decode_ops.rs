//! The MLX ops a batch-1 decode step builds (`Model::decode_ops`): what bounds decode on a
//! GPU, where each op costs host time. The llama3 fixture's count per layer may not grow
//! back (33 before the decode path was trimmed, 18 after: docs/benchmarks.md, "Ops per
//! decode layer (CPU count)"); the counter itself is checked against the step it counts.
use std::path::Path;

use mlxcel::model_dir::ModelDir;
use mlxcel::models::{self, LoadFormat, Logits, SeqInput, StepInput};

fn load(name: &str) -> models::Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let md = ModelDir::open(&dir).unwrap();
    models::load(&md, LoadFormat::Safetensors, |_, _| {})
        .unwrap()
        .model
}

/// The llama3 fixture's decode ops after a short prompt, printed for the docs.
fn llama3_decode_ops() -> models::DecodeOps {
    let model = load("llama3");
    let mut cache = model.new_cache(1, 64);
    let prompt = [5u32, 17, 42, 99];
    let seqs = [SeqInput {
        slot: 0,
        tokens: &prompt,
    }];
    let logits = model
        .forward(&mut cache, StepInput::Host(&seqs), Logits::Last)
        .unwrap();
    mlxcel::mlx::eval(&logits.iter().collect::<Vec<_>>()).unwrap();
    let ops = model.decode_ops(&mut cache, 0).unwrap();
    eprintln!(
        "llama3 decode step: {} ops, {} per layer, {} outside the layers; layer 0: {:?}; step: {:?}",
        ops.step.total(),
        ops.per_layer(),
        ops.outside_layers(),
        ops.layers[0].by_name,
        ops.step.by_name
    );
    ops
}

#[test]
fn counter_accounts_for_the_whole_step() {
    let ops = llama3_decode_ops();
    assert_eq!(ops.layers.len(), 2);
    // every layer builds the same ops
    assert_eq!(ops.layers[0], ops.layers[1]);
    // each layer has its projections, its attention and its KV-cache write
    let l = &ops.layers[0];
    assert_eq!(l.get("ScaledDotProductAttention"), 1, "{l:?}");
    assert_eq!(l.get("RMSNorm"), 2, "{l:?}");
    assert_eq!(l.get("RoPE"), 1, "{l:?}");
    assert!(l.get("SliceUpdate") >= 1, "{l:?}");
    // the layers are inside the step, and the step has ops of its own (embedding, head)
    let mut sum = mlxcel::mlx::graph::OpCounts::default();
    for l in &ops.layers {
        sum.add(l);
    }
    for (name, n) in &sum.by_name {
        assert!(
            ops.step.get(name) >= *n,
            "{name}: {n} in the layers, step {:?}",
            ops.step
        );
    }
    assert!(ops.outside_layers() >= 3, "{:?}", ops.step);
}

/// Ops per layer of the llama3 fixture's batch-1 decode step, as measured after the decode
/// path was trimmed (33 before) and the keys and values came to be read by one op: 19.
/// `MLXCEL_ADDMM_RESIDUAL=1` folds the two residual adds into the products (17);
/// `MLXCEL_POOL_VIEW=0` reads the keys and values by an op each (one more).
fn max_layer_ops() -> usize {
    let k = mlxcel::kernels::knobs::get();
    let base = if k.addmm_residual { 17 } else { 19 };
    base + usize::from(!k.pool_view)
}

/// Views of the pool a layer's reads take: one op for keys and values, or one each.
fn view_ops() -> usize {
    match mlxcel::kernels::knobs::get().pool_view {
        true => 1,
        false => 2,
    }
}

#[test]
fn llama3_decode_layer_ops_stay_down() {
    let ops = llama3_decode_ops();
    assert!(
        ops.per_layer() <= max_layer_ops(),
        "{} ops per layer, at most {} expected: {:?}",
        ops.per_layer(),
        max_layer_ops(),
        ops.layers[0].by_name
    );
    // the heavy ones: 4 products, 2 norms, RoPE, attention, SwiGLU, 2 KV-cache writes
    let l = &ops.layers[0];
    assert_eq!(l.get("Matmul") + l.get("AddMM"), 4, "{l:?}");
    assert_eq!(l.get("SliceUpdate"), 2, "{l:?}");
    // the layer's keys and values read back as two views of the pool by one op
    assert_eq!(l.get("UnownedSlice"), view_ops(), "{l:?}");
    // no per-step weight transposes, no flatten/unflatten around the products
    for name in ["Transpose", "Flatten", "Unflatten"] {
        assert_eq!(l.get(name), 0, "{name}: {l:?}");
    }
}
