//! `mlxcel tp-parity`: teacher-forced comparison of a tensor-parallel run with a
//! single-process run of the same model: the same random token sequence is fed to
//! both (prefill in chunks, every position's logits returned), and the command reports
//! top-1 agreement and the cosine similarity of the logits per position. One JSON line.
//!
//! The single-process side runs in this process on the default device (it needs the
//! whole model's memory there); the TP side runs the usual rank processes.
use anyhow::{bail, Context, Result};
use clap::Args;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::engine::step::{Executor, LocalExecutor, SeqStart, SeqStep, StepPlan};
use crate::mlx::Dtype;
use crate::models::LoadFormat;
use crate::parallel::driver::TpExecutor;
use crate::runtime::{load_weights, open_model, ModelArgs, TpArgs};

#[derive(Debug, Args)]
pub struct TpParityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub tp: TpArgs,
    /// Teacher-forced positions to compare.
    #[arg(long, default_value_t = 256)]
    pub steps: usize,
    /// Positions per step (logits of a chunk travel back in one message).
    #[arg(long, default_value_t = 16)]
    pub chunk: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also run one process with every weight cast to float32 and compare both runs with it:
    /// how far the TP run is from exact math next to how far the one-process run is.
    #[arg(long)]
    pub f32_reference: bool,
}

/// Top-1 agreement, cosine (min, mean) and max-abs difference of two runs' logits.
fn compare(a: &[Vec<f32>], b: &[Vec<f32>]) -> serde_json::Value {
    let n = a.len().min(b.len());
    let agree = (0..n).filter(|&i| argmax(&a[i]) == argmax(&b[i])).count();
    let cos: Vec<f64> = (0..n).map(|i| cosine(&a[i], &b[i])).collect();
    let max_abs = (0..n)
        .flat_map(|i| a[i].iter().zip(&b[i]).map(|(x, y)| (x - y).abs()))
        .fold(0f32, f32::max);
    json!({
        "positions": n,
        "top1_agreement": agree as f64 / n.max(1) as f64,
        "cosine_min": cos.iter().cloned().fold(f64::MAX, f64::min),
        "cosine_mean": cos.iter().sum::<f64>() / n.max(1) as f64,
        "logits_max_abs_diff": max_abs,
    })
}

/// Every position's logits for `tokens`, `chunk` positions per step.
fn all_logits(exec: &mut dyn Executor, tokens: &[u32], chunk: usize) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::new();
    for (k, part) in tokens.chunks(chunk.max(1)).enumerate() {
        let step = SeqStep {
            seq_id: 1,
            slot: 0,
            pos: k * chunk.max(1),
            tokens: part.to_vec(),
            start: (k == 0).then(|| SeqStart {
                params: Default::default(),
                prompt: vec![],
            }),
            sample: false,
            blocks: None,
            restart: false,
        };
        let r = exec.execute(&StepPlan {
            seqs: vec![step],
            return_logits: true,
            ..Default::default()
        })?;
        let flat = r.logits.into_iter().next().unwrap_or_default();
        let v = flat.len() / part.len().max(1);
        out.extend(flat.chunks(v).map(|c| c.to_vec()));
    }
    Ok(out)
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (*x as f64, *y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    ab / (aa.sqrt() * bb.sqrt()).max(1e-30)
}

pub fn run(args: &TpParityArgs) -> Result<()> {
    if !args.tp.uses_ranks() {
        bail!("tp-parity compares a --tp-size N run (N > 1, or --tp-backend) with one process: give --tp-size");
    }
    if args.model.load_format == LoadFormat::Dummy {
        bail!(
            "tp-parity needs checkpoint weights, not --load-format dummy: a rank draws its own \
             blocks of the split tensors, so the two runs would be different models"
        );
    }
    let m = open_model(&args.model)?;
    if args.steps + 1 > m.ctx_size {
        bail!(
            "--steps {} does not fit in --ctx-size {}",
            args.steps,
            m.ctx_size
        );
    }
    let vocab = m.cfg.vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let tokens: Vec<u32> = (0..args.steps)
        .map(|_| rng.random_range(0..vocab))
        .collect();

    let tp_logits = {
        let opts = args.tp.options(args.model.load_format, m.ctx_size, 1);
        let mut tp = TpExecutor::launch(&m.dir, opts)?;
        let l = all_logits(&mut tp, &tokens, args.chunk)?;
        tp.shutdown();
        l
    };
    let one_logits = {
        let model = load_weights(&args.model, &m)?;
        let mut local = LocalExecutor::new(model, 1, m.ctx_size);
        all_logits(&mut local, &tokens, args.chunk)?
    };
    let mut out = compare(&one_logits, &tp_logits);
    out["model"] = json!(m.dir.root.display().to_string());
    out["tp_size"] = json!(args.tp.tp_size);
    if args.f32_reference {
        let model =
            crate::models::load_as(&m.dir, args.model.load_format, Some(Dtype::F32), |_, _| {})
                .with_context(|| format!("loading {} as float32", m.dir.root.display()))?
                .model;
        let mut local = LocalExecutor::new(model, 1, m.ctx_size);
        let exact = all_logits(&mut local, &tokens, args.chunk)?;
        out["f32_reference"] = json!({
            "tp": compare(&exact, &tp_logits),
            "one_process": compare(&exact, &one_logits),
        });
    }
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
