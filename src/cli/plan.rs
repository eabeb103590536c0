//! `mlxcel plan`: each rank's memory (weights, KV cache, working margin) against
//! the free memory of the device it would run on, without loading any weight or
//! touching a GPU in this process (free GPU memory comes from a child process).
//! Exits non-zero when the plan does not fit. See `docs/multi-gpu.md`.
use anyhow::{bail, Result};
use clap::Args;
use serde_json::json;

use crate::mlx::{self, Backend};
use crate::models::{self, LoadFormat};
use crate::parallel::placement;
use crate::parallel::plan::{self, Budget, Placement, PlanInput};
use crate::parallel::shard;
use crate::runtime::{ctx_size_of, resolve_dir, KvArgs, ModelArgs, TpArgs};

#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Sequences at once (KV-cache slots), as `serve --parallel`.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Tokens per step, decodes and prefill chunks together, as `serve
    /// --max-num-batched-tokens` (`--prefill-chunk` is an alias): sizes the working margin.
    #[arg(long, visible_alias = "prefill-chunk", default_value_t = crate::engine::scheduler::DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: usize,
    #[command(flatten)]
    pub tp: TpArgs,
    #[command(flatten)]
    pub kv: KvArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn gb(b: u64) -> String {
    if b >= 100_000_000 {
        format!("{:.2} GB", b as f64 / 1e9)
    } else {
        format!("{:.1} MB", b as f64 / 1e6)
    }
}

pub fn run(args: &PlanArgs) -> Result<()> {
    let dir = resolve_dir(&args.model)?;
    let cfg = models::read_config(&dir)?;
    let ctx_size = ctx_size_of(&args.model, &cfg)?;
    if args.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    let n = args.tp.tp_size;
    let ep = args.tp.enable_expert_parallel;
    shard::validate_with(&cfg, n, ep)?;
    let catalog = match args.model.load_format {
        LoadFormat::Safetensors => Some(models::weights::catalog(&dir)?),
        LoadFormat::Dummy => None,
    };
    let backend = mlx::backend();
    let input = PlanInput {
        cfg: &cfg,
        catalog: catalog.as_ref(),
        tp_size: n,
        ctx_size,
        slots: args.parallel,
        max_num_batched_tokens: args.max_num_batched_tokens,
        backend,
        vocab_parallel: crate::kernels::knobs::get().vocab_parallel,
        kv_tokens: None,
    };
    let gpus = mlx::gpu_device_count();
    let entries: Vec<usize> = match &args.tp.devices {
        Some(d) if d.len() != n => {
            bail!("--devices lists {} GPU(s) but --tp-size is {n}", d.len())
        }
        Some(d) => d.clone(),
        None if args.tp.tp_emulate => vec![0; n],
        None => (0..n).collect(),
    };
    let shared = args.tp.tp_emulate || backend != Backend::Cuda;
    let mut notes = Vec::new();
    if backend == Backend::Cuda && !args.tp.tp_emulate && n > gpus {
        notes.push(format!(
            "--tp-size {n} needs {n} GPUs but {gpus} are visible (add --tp-emulate to share one)"
        ));
    }
    let (budget, _) = plan::budget(
        backend,
        &Placement {
            entries: &entries,
            shared,
            child: Some(None),
        },
    );
    let budget = match budget {
        Ok(b) => Some(b),
        Err(note) => {
            notes.push(format!("free memory unknown, not checked: {note}"));
            None
        }
    };
    // the paged KV cache: tokens that fit as `serve` would size its pool
    let per_token = plan::kv_bytes_per_token(&input)?.max(1);
    let bs = args.kv.block_size.max(1) as u64;
    let kv_fit: Option<(u64, String)> = if let Some(gb) = args.kv.kv_cache_gb {
        Some((
            (gb * 1e9 / per_token as f64) as u64,
            format!("--kv-cache-gb {gb}"),
        ))
    } else {
        let fraction = args.kv.gpu_memory_utilization.or((!shared).then_some(0.9));
        let device = match (&budget, shared) {
            (Some(Budget::Shared(d)), true) => Some(d.free_bytes),
            (_, false) => plan::gpu_memory_via_child(None).ok().and_then(|g| {
                entries
                    .iter()
                    .filter_map(|&e| g.get(e).map(|x| x.total_bytes))
                    .min()
            }),
            _ => None,
        };
        match (fraction, device) {
            (Some(f), Some(d)) => Some((
                plan::kv_tokens_fit(&input, d, f, shared)?,
                format!("--gpu-memory-utilization {f}"),
            )),
            _ => None,
        }
    }
    .map(|(t, how)| (t / bs * bs, how));
    // a pool sized by memory is allocated at once: the plan holds it
    let input = PlanInput {
        kv_tokens: kv_fit.as_ref().map(|k| k.0 as usize),
        ..input
    };
    let mem = plan::plan_memory_with(&input, ep)?;
    let verdict = budget.as_ref().map(|b| plan::check_fit(&input, &mem, b));
    let device_of = |r: usize| -> (String, Option<String>) {
        if backend != Backend::Cuda {
            return (
                if backend == Backend::Metal {
                    "Metal GPU".into()
                } else {
                    "CPU".into()
                },
                None,
            );
        }
        let e = entries[r];
        let physical = placement::visible_devices_for(e).ok().and_then(|env| {
            env.into_iter()
                .find(|(k, _)| k == placement::VISIBLE_DEVICES_VAR)
                .map(|(_, v)| v)
        });
        (format!("GPU {e}"), physical)
    };
    let free_of = |r: usize| -> Option<u64> {
        match &budget {
            Some(Budget::PerRank(d)) => d.get(r).map(|d| d.free_bytes),
            _ => None,
        }
    };
    let shared_free = match &budget {
        Some(Budget::Shared(d)) => Some(d),
        _ => None,
    };
    if args.json {
        let ranks: Vec<_> = mem
            .ranks
            .iter()
            .map(|r| {
                let (device, physical) = device_of(r.rank);
                json!({
                    "rank": r.rank,
                    "device": device,
                    "cuda_visible_devices": physical,
                    "weight_bytes": r.weight_bytes,
                    "sharded_bytes": r.sharded_bytes,
                    "replicated_bytes": r.replicated_bytes,
                    "kv_bytes": r.kv_bytes,
                    "margin_bytes": r.margin_bytes,
                    "total_bytes": r.total_bytes,
                    "device_free_bytes": free_of(r.rank),
                })
            })
            .collect();
        let (fits, message, smallest, max_ctx) = match &verdict {
            None => (None, None, None, None),
            Some(Ok(())) => (Some(true), None, None, None),
            Some(Err(e)) => (
                Some(false),
                Some(e.message.clone()),
                e.smallest_tp_size,
                e.max_ctx_size,
            ),
        };
        let out = json!({
            "model": dir.root.display().to_string(),
            "model_type": cfg.model_type,
            "load_format": format!("{:?}", args.model.load_format).to_lowercase(),
            "backend": backend.to_string(),
            "tp_size": n,
            "tp_emulate": args.tp.tp_emulate,
            "expert_parallel": ep,
            "ctx_size": ctx_size,
            "parallel": args.parallel,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_dtype": mem.kv_dtype,
            "sharded_total_bytes": mem.sharded_total_bytes,
            "replicated_total_bytes": mem.replicated_total_bytes,
            "vocab_rows_per_rank": mem.vocab_rows_per_rank,
            "total_bytes": mem.sum_total(),
            "ranks": ranks,
            "shared_device": shared_free.map(|d| json!({"device": d.label, "free_bytes": d.free_bytes, "source": d.source})),
            "per_rank_free_source": match &budget { Some(Budget::PerRank(d)) => d.first().map(|d| d.source.clone()), _ => None },
            "fits": fits,
            "message": message,
            "smallest_fitting_tp_size": smallest,
            "max_ctx_size": max_ctx,
            "kv_bytes_per_token": per_token,
            "block_size": bs,
            "kv_tokens_fit": kv_fit.as_ref().map(|k| k.0),
            "kv_tokens_fit_by": kv_fit.as_ref().map(|k| k.1.clone()),
            "notes": notes,
        });
        println!("{out}");
    } else {
        println!(
            "{} ({}, {} layers), {} weights, KV cache {}",
            dir.root.display(),
            cfg.model_type,
            cfg.num_layers,
            match args.model.load_format {
                LoadFormat::Safetensors if dir.is_gguf() => "gguf".to_string(),
                f => format!("{f:?}").to_lowercase(),
            },
            mem.kv_dtype
        );
        println!(
            "--tp-size {n}{}, --ctx-size {ctx_size}, --parallel {}, --max-num-batched-tokens {}, backend {backend}",
            if args.tp.tp_emulate { " (emulated on one device)" } else { "" },
            args.parallel,
            args.max_num_batched_tokens
        );
        println!(
            "split tensors {} in all, replicated {} per rank; embedding and lm_head {}",
            gb(mem.sharded_total_bytes),
            gb(mem.replicated_total_bytes),
            match mem.vocab_rows_per_rank {
                Some(r) => format!("vocab-parallel, {r} of {} rows per rank", cfg.vocab_size),
                None if n > 1 => "replicated".to_string(),
                None => "whole".to_string(),
            }
        );
        println!(
            "{:<5} {:<12} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "RANK", "DEVICE", "WEIGHTS", "KV CACHE", "MARGIN", "TOTAL", "FREE"
        );
        for r in &mem.ranks {
            let (device, physical) = device_of(r.rank);
            let device = match physical {
                Some(p) if p != device.trim_start_matches("GPU ") => format!("{device} (={p})"),
                _ => device,
            };
            println!(
                "{:<5} {:<12} {:>10} {:>10} {:>10} {:>10} {:>10}",
                r.rank,
                device,
                gb(r.weight_bytes),
                gb(r.kv_bytes),
                gb(r.margin_bytes),
                gb(r.total_bytes),
                free_of(r.rank).map(gb).unwrap_or_else(|| "-".into())
            );
        }
        if let Some(d) = shared_free {
            println!(
                "all ranks share {}: {} needed, {} free ({})",
                d.label,
                gb(mem.sum_total()),
                gb(d.free_bytes),
                d.source
            );
        }
        match &kv_fit {
            Some((tokens, how)) => println!(
                "paged KV cache ({per_token} bytes a token, blocks of {bs}): {tokens} tokens fit per \
                 rank with {how} = {:.1} sequences of --ctx-size {ctx_size}, or {} of 512 tokens",
                *tokens as f64 / ctx_size.max(1) as f64,
                tokens / 512
            ),
            None => println!(
                "paged KV cache ({per_token} bytes a token, blocks of {bs}): --parallel × --ctx-size \
                 = {} tokens (give --kv-cache-gb or --gpu-memory-utilization to size it by memory)",
                args.parallel * ctx_size
            ),
        }
        for note in &notes {
            println!("note: {note}");
        }
        match &verdict {
            Some(Ok(())) => println!("fits"),
            Some(Err(_)) => println!("does not fit"),
            None => println!("fit not checked"),
        }
    }
    if let Some(Err(e)) = verdict {
        return Err(e.into());
    }
    Ok(())
}
