//! `mlxcel bench`: prefill throughput at given prompt lengths and batch-1
//! decode throughput, with peak memory, printed as one JSON object.
//!
//! `--serve-workload B` is the engine-side reference of a server load test (B
//! concurrent requests of P prompt tokens and D generated tokens each, as
//! `scripts/bench_server.py` sends): B prompts prefilled (each sampling its first
//! token; as many whole prompts per forward pass as fit in `--prefill-chunk` tokens, one
//! pass over all their rows as a server step runs them), then D − 1 decode steps at
//! batch B, timed as a whole; its aggregate rate
//! is B · D generated tokens over that wall time.
//!
//! Prompts are random token ids from a fixed seed; decoding is greedy with the
//! next step queued (`async_eval`) before the current token is read, as a
//! streaming generator does. The decode row also says how many MLX ops one step builds
//! (`Model::decode_ops`) and the host time per op (build + eval per token over them).
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::engine::generate::prefill;
use crate::mlx::{self, Dtype};
use crate::models::{Logits, SeqInput, StepInput};
use crate::runtime::{check_single_device_memory, load_weights, open_model, ModelArgs};

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths to time prefill at (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    pub prompt_lens: Vec<usize>,
    /// Tokens to decode at batch 1.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Prompt length before the timed decode.
    #[arg(long, default_value_t = 128)]
    pub decode_context: usize,
    /// Prompt tokens per prefill step (mlx-lm uses 2048).
    #[arg(long, default_value_t = 2048)]
    pub prefill_chunk: usize,
    /// Also time batched decode at these batch sizes (comma-separated): B sequences
    /// after the same prompt, one token each per step, pipelined like batch 1.
    #[arg(long, value_delimiter = ',')]
    pub decode_batch: Vec<usize>,
    /// The server workload at these batch sizes (comma-separated): B prompts of
    /// --workload-prompt tokens prefilled, then decode until each has
    /// --workload-tokens tokens (the first from its prefill), timed as a whole.
    #[arg(long, value_delimiter = ',')]
    pub serve_workload: Vec<usize>,
    /// Prompt tokens of each sequence in --serve-workload.
    #[arg(long, default_value_t = 128)]
    pub workload_prompt: usize,
    /// Generated tokens of each sequence in --serve-workload.
    #[arg(long, default_value_t = 128)]
    pub workload_tokens: usize,
    /// Repeat each measurement and keep the best.
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
    /// After each --decode-batch timing, decode this many more steps inside the CUDA
    /// profiler's capture range (`cuProfilerStart` … `cuProfilerStop`), so that
    /// `ncu --profile-from-start off` profiles those steps' kernels alone (CUDA only).
    #[arg(long, default_value_t = 0)]
    pub profile_steps: usize,
}

/// Prompt tokens of the warm-up prefill (before any timing), plus a few decode steps.
const WARM_UP_PROMPT: usize = 64;

pub fn run(args: &BenchArgs) -> Result<()> {
    let longest = args
        .prompt_lens
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(args.decode_context + args.decode_tokens + args.profile_steps + 1)
        .max(args.workload_prompt + args.workload_tokens + 1)
        .max(WARM_UP_PROMPT + 8);
    let mut margs = args.model.clone();
    margs.ctx_size = Some(margs.ctx_size.unwrap_or(longest).max(longest));
    let opened = open_model(&margs)?;
    if args.decode_batch.contains(&0) || args.serve_workload.contains(&0) {
        anyhow::bail!("--decode-batch, --serve-workload: batch sizes must be at least 1");
    }
    if !args.serve_workload.is_empty() && (args.workload_prompt == 0 || args.workload_tokens == 0) {
        anyhow::bail!("--workload-prompt and --workload-tokens must be at least 1");
    }
    let max_batch = args
        .decode_batch
        .iter()
        .chain(&args.serve_workload)
        .copied()
        .max()
        .unwrap_or(1)
        .max(1);
    if args.profile_steps > 0 && mlx::backend() != mlx::Backend::Cuda {
        anyhow::bail!("--profile-steps: the CUDA profiler's range needs MLX's CUDA backend");
    }
    check_single_device_memory(&margs, &opened, max_batch, args.prefill_chunk, None)?;
    let m = crate::runtime::LoadedModel {
        model: load_weights(&margs, &opened)?,
        dir: opened.dir,
        tokenizer: opened.tokenizer,
        ctx_size: opened.ctx_size,
    };
    let vocab = m.model.cfg.vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1234);
    let mut prompt =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    let mut cache = m.model.new_cache(1, m.ctx_size);

    // warm-up: compile kernels for both paths
    let warm = prompt(WARM_UP_PROMPT);
    cache.reset(0);
    prefill(&m.model, &mut cache, 0, &warm, args.prefill_chunk)?;
    decode_loop(&m.model, &mut cache, 4)?;

    let mut prefill_rows = Vec::new();
    for &n in &args.prompt_lens {
        let p = prompt(n);
        // one untimed pass at this length first: MLX compiles kernels per shape (a longer
        // input can pick other sort, gather and GEMM kernels than the warm-up prompt did)
        cache.reset(0);
        prefill(&m.model, &mut cache, 0, &p, args.prefill_chunk)?;
        mlx::synchronize()?;
        let mut best = f64::MAX;
        for _ in 0..args.repeats.max(1) {
            cache.reset(0);
            let t = Instant::now();
            prefill(&m.model, &mut cache, 0, &p, args.prefill_chunk)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        prefill_rows
            .push(json!({"tokens": n, "seconds": best, "tokens_per_second": n as f64 / best}));
    }
    let ctx = prompt(args.decode_context.max(1));
    let mut best = f64::MAX;
    let mut host = HostTimes::default();
    for _ in 0..args.repeats.max(1) {
        cache.reset(0);
        prefill(&m.model, &mut cache, 0, &ctx, args.prefill_chunk)?;
        mlx::synchronize()?;
        let t = Instant::now();
        let times = decode_loop(&m.model, &mut cache, args.decode_tokens)?;
        let secs = t.elapsed().as_secs_f64();
        if secs < best {
            best = secs;
            host = times;
        }
    }
    // the ops one batch-1 decode step builds, on a cache of its own (the counted step is
    // built, never run)
    let ops = m.model.decode_ops(&mut m.model.new_cache(1, 16), 0)?;
    let host = host.per_step_ms(args.decode_tokens);
    let host_ms =
        host["build_ms"].as_f64().unwrap_or(0.0) + host["eval_ms"].as_f64().unwrap_or(0.0);
    let mut batched = Vec::new();
    for &b in &args.decode_batch {
        let mut bcache = m.model.new_cache(b, m.ctx_size);
        decode_batch_loop(&m.model, &mut bcache, b, 2, None)?; // warm-up: kernels for this batch size
        let mut best = f64::MAX;
        let mut best_host = HostTimes::default();
        for _ in 0..args.repeats.max(1) {
            for slot in 0..b {
                bcache.reset(slot);
                prefill(&m.model, &mut bcache, slot, &ctx, args.prefill_chunk)?;
            }
            mlx::synchronize()?;
            let t = Instant::now();
            let host = decode_batch_loop(&m.model, &mut bcache, b, args.decode_tokens, None)?;
            let secs = t.elapsed().as_secs_f64();
            if secs < best {
                (best, best_host) = (secs, host);
            }
        }
        if args.profile_steps > 0 {
            mlx::synchronize()?;
            crate::kernels::driver::profiler(true)
                .map_err(|e| anyhow::anyhow!("--profile-steps: {e}"))?;
            decode_batch_loop(&m.model, &mut bcache, b, args.profile_steps, None)?;
            mlx::synchronize()?;
            crate::kernels::driver::profiler(false)
                .map_err(|e| anyhow::anyhow!("--profile-steps: {e}"))?;
        }
        let steps = args.decode_tokens as f64;
        batched.push(json!({
            "batch": b,
            "steps": args.decode_tokens,
            "seconds": best,
            "tokens_per_second": b as f64 * steps / best,
            "ms_per_step": best * 1e3 / steps,
            // the fastest run's host time per step: with `wait_ms` near zero the batch is
            // bound by the host's work per step, not by the GPU
            "host_per_step": best_host.per_step_ms(args.decode_tokens),
            "profiled_steps": args.profile_steps,
        }));
    }
    let mut workload = Vec::new();
    for &b in &args.serve_workload {
        let prompts: Vec<Vec<u32>> = (0..b).map(|_| prompt(args.workload_prompt)).collect();
        let mut wcache = m.model.new_cache(b, m.ctx_size);
        // warm-up: the prompt's and this batch size's kernels
        serve_workload(&m.model, &mut wcache, &prompts, 2, args.prefill_chunk)?;
        let mut best: Option<WorkloadTimes> = None;
        for _ in 0..args.repeats.max(1) {
            mlx::synchronize()?;
            let t = serve_workload(
                &m.model,
                &mut wcache,
                &prompts,
                args.workload_tokens,
                args.prefill_chunk,
            )?;
            if best.is_none_or(|x| t.total < x.total) {
                best = Some(t);
            }
        }
        let t = best.expect("at least one repeat");
        let generated = b * args.workload_tokens;
        let steps = args.workload_tokens - 1;
        workload.push(json!({
            "batch": b,
            "prompt_tokens": args.workload_prompt,
            "generated_tokens_per_sequence": args.workload_tokens,
            "seconds": t.total,
            "tokens_per_second": generated as f64 / t.total,
            "prefill_seconds": t.prefill,
            "decode_steps": steps,
            "ms_per_decode_step": if steps > 0 { (t.total - t.prefill) * 1e3 / steps as f64 } else { 0.0 },
        }));
    }
    let device = if mlx::gpu_device_count() > 0 {
        mlx::device_info(0).map(|d| d.name).unwrap_or_default()
    } else {
        "cpu".into()
    };
    let out = json!({
        "model": m.dir.root.display().to_string(),
        "load_format": format!("{:?}", args.model.load_format).to_lowercase(),
        "backend": mlx::backend().to_string(),
        "device": device,
        "weights_gb": m.model.weight_bytes() as f64 / 1e9,
        "prefill": prefill_rows,
        "decode": {
            "batch": 1,
            "context": ctx.len(),
            "tokens": args.decode_tokens,
            "seconds": best,
            "tokens_per_second": args.decode_tokens as f64 / best,
            "ms_per_token": best * 1e3 / args.decode_tokens as f64,
            "host_per_token": host,
            // MLX ops (graph nodes) of one step, MLX's fast ops counted one each as on a GPU
            "ops_per_step": ops.step.total(),
            "ops_per_layer": ops.per_layer(),
            "ops_outside_layers": ops.outside_layers(),
            "ops_layer_histogram": ops.layers.first().map(|l| l.to_json()),
            "ops_step_histogram": ops.step.to_json(),
            "host_us_per_op": host_ms * 1e3 / ops.step.total().max(1) as f64,
        },
        "decode_batched": batched,
        "serve_workload": workload,
        "peak_memory_bytes": mlx::memory::peak(),
    });
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

/// Greedy decode of `n` tokens after whatever is in slot 0, pipelined: step i+1 is
/// queued before token i is read back.
fn decode_loop(
    model: &crate::models::Model,
    cache: &mut crate::models::kv_cache::KvCache,
    n: usize,
) -> Result<HostTimes> {
    // re-feed a token stand-in: any valid id works for timing
    let mut y = mlx::Array::from_slice(&[1i32], &[1, 1])?;
    let mut pending: Option<mlx::Array> = None;
    let mut times = HostTimes::default();
    for _ in 0..n {
        let t0 = Instant::now();
        let logits = model
            .forward(
                cache,
                StepInput::Device {
                    slots: &[0],
                    ids: &y,
                },
                Logits::Last,
            )?
            .remove(0);
        let next = logits
            .argmax(-1, false)?
            .astype(Dtype::I32)?
            .reshape(&[1, 1])?;
        let t1 = Instant::now();
        mlx::async_eval(&[&next])?;
        let t2 = Instant::now();
        if let Some(prev) = pending.take() {
            let _token: i32 = prev.item()?;
        }
        times.add(t0, t1, t2, Instant::now());
        pending = Some(next.clone());
        y = next;
    }
    if let Some(prev) = pending {
        let _token: i32 = prev.item()?;
    }
    Ok(times)
}

/// Where a pipelined decode loop's wall time goes on the host, summed over its steps:
/// building the lazy graph, `async_eval` (MLX encoding and launching the step's
/// kernels) and waiting for the previous step's token. A wait near zero means the
/// GPU finishes each step before the host has queued the next one (host-bound).
#[derive(Default, Clone, Copy)]
struct HostTimes {
    build: f64,
    eval: f64,
    wait: f64,
}

impl HostTimes {
    fn add(&mut self, t0: Instant, t1: Instant, t2: Instant, t3: Instant) {
        self.build += (t1 - t0).as_secs_f64();
        self.eval += (t2 - t1).as_secs_f64();
        self.wait += (t3 - t2).as_secs_f64();
    }

    fn per_step_ms(&self, steps: usize) -> serde_json::Value {
        let k = 1e3 / steps.max(1) as f64;
        json!({"build_ms": self.build * k, "eval_ms": self.eval * k, "wait_ms": self.wait * k})
    }
}

/// Wall times of one [`serve_workload`] run, in seconds.
#[derive(Clone, Copy)]
struct WorkloadTimes {
    /// Until every prompt's first token was read.
    prefill: f64,
    total: f64,
}

/// The server workload on the engine alone: every prompt of `prompts` into its slot
/// (`0..B`, reset first), as many whole prompts per forward pass as fit in `chunk`
/// tokens (one pass over all their rows, as a server step prefills them; a longer
/// prompt alone in chunks of `chunk`), its first token sampled greedily, then
/// `tokens − 1` greedy decode steps of all B sequences as one batch, pipelined like
/// [`decode_loop`]: `tokens` generated tokens per sequence.
fn serve_workload(
    model: &crate::models::Model,
    cache: &mut crate::models::kv_cache::KvCache,
    prompts: &[Vec<u32>],
    tokens: usize,
    chunk: usize,
) -> Result<WorkloadTimes> {
    let b = prompts.len();
    let t = Instant::now();
    let argmax = |l: &mlx::Array| -> Result<mlx::Array> {
        Ok(l.argmax(-1, false)?.astype(Dtype::I32)?.reshape(&[1, 1])?)
    };
    let mut first = Vec::with_capacity(b);
    let mut slot = 0;
    while slot < b {
        cache.reset(slot);
        if prompts[slot].len() > chunk {
            let logits = prefill(model, cache, slot, &prompts[slot], chunk)?;
            first.push(argmax(&logits)?);
            slot += 1;
            continue;
        }
        // the prompts from `slot` on that fit in `chunk` tokens together
        let (mut end, mut tokens) = (slot, 0);
        while end < b && tokens + prompts[end].len() <= chunk {
            tokens += prompts[end].len();
            cache.reset(end);
            end += 1;
        }
        let inputs: Vec<SeqInput> = (slot..end)
            .map(|s| SeqInput {
                slot: s,
                tokens: &prompts[s],
            })
            .collect();
        for l in model.forward(cache, StepInput::Host(&inputs), Logits::Last)? {
            first.push(argmax(&l)?);
        }
        mlx::eval(&first[slot..end].iter().collect::<Vec<_>>())?;
        slot = end;
    }
    let first = mlx::concatenate(&first.iter().collect::<Vec<_>>(), 0)?;
    let _tokens: Vec<i32> = first.to_vec()?;
    let prefill_secs = t.elapsed().as_secs_f64();
    decode_batch_loop(model, cache, b, tokens.saturating_sub(1), Some(first))?;
    Ok(WorkloadTimes {
        prefill: prefill_secs,
        total: t.elapsed().as_secs_f64(),
    })
}

/// Greedy decode of `n` steps of `b` sequences (slots `0..b`, one token each per
/// step) as one graph per step, pipelined like [`decode_loop`], from the tokens
/// `first` (`[b, 1]` int32; a stand-in id without); the host's time per part, as
/// [`decode_loop`] reports it.
fn decode_batch_loop(
    model: &crate::models::Model,
    cache: &mut crate::models::kv_cache::KvCache,
    b: usize,
    n: usize,
    first: Option<mlx::Array>,
) -> Result<HostTimes> {
    let slots: Vec<usize> = (0..b).collect();
    let mut y = match first {
        Some(f) => f,
        None => mlx::Array::from_slice(&vec![1i32; b], &[b as i32, 1])?,
    };
    let mut pending: Option<mlx::Array> = None;
    let mut times = HostTimes::default();
    for _ in 0..n {
        let t0 = Instant::now();
        let logits = model
            .forward(
                cache,
                StepInput::Device {
                    slots: &slots,
                    ids: &y,
                },
                Logits::Rows,
            )?
            .remove(0);
        let next = logits
            .argmax(-1, false)?
            .astype(Dtype::I32)?
            .reshape(&[b as i32, 1])?;
        let t1 = Instant::now();
        mlx::async_eval(&[&next])?;
        let t2 = Instant::now();
        if let Some(prev) = pending.take() {
            let _tokens: Vec<i32> = prev.to_vec()?;
        }
        times.add(t0, t1, t2, Instant::now());
        pending = Some(next.clone());
        y = next;
    }
    if let Some(prev) = pending {
        let _tokens: Vec<i32> = prev.to_vec()?;
    }
    Ok(times)
}
