//! Helpers shared by the tensor-parallel test files (tp.rs, moe.rs).
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use mlxcel::engine::step::{Executor, SeqStep, StepPlan};

/// The TP tests start several processes each: one at a time (CI has 2 cores).
static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The model of fixture `name`, loaded in this process.
#[allow(dead_code)] // (not every test file that includes this module loads one)
pub fn load_fixture(name: &str) -> mlxcel::models::Model {
    let md = mlxcel::model_dir::ModelDir::open(&fixture(name)).unwrap();
    mlxcel::models::load(&md, mlxcel::models::LoadFormat::Safetensors, |_, _| {})
        .unwrap()
        .model
}

/// Prompt logits of every position, then greedy tokens, through an executor.
pub fn run_plan(exec: &mut dyn Executor, prompt: &[u32], steps: usize) -> (Vec<f32>, Vec<u32>) {
    let start = SeqStep::whole_prompt(1, 1, prompt, Default::default());
    let r = exec
        .execute(&StepPlan {
            seqs: vec![start],
            return_logits: true,
            ..Default::default()
        })
        .unwrap();
    let logits = r.logits[0].clone();
    let mut tokens = vec![r.sampled[0].token];
    for i in 1..steps {
        let step = SeqStep {
            seq_id: 1,
            slot: 1,
            pos: prompt.len() + i - 1,
            tokens: vec![*tokens.last().unwrap()],
            start: None,
            sample: true,
            blocks: None,
            restart: false,
        };
        let r = exec
            .execute(&StepPlan {
                seqs: vec![step],
                ..Default::default()
            })
            .unwrap();
        tokens.push(r.sampled[0].token);
    }
    exec.execute(&StepPlan {
        release: vec![1],
        ..Default::default()
    })
    .unwrap();
    (logits, tokens)
}
