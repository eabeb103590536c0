//! The rank process (`mlxcel _rank`): joins the control channel and the MLX
//! group, loads its shard, then executes step plans until told to stop. It
//! decides nothing on its own; on any error it reports and exits, and on
//! control-channel EOF (the driver is gone) it exits at once.
use std::rc::Rc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use super::channel::RankChannel;
use super::protocol::{FromRank, Identity, RankReport, ToRank};
use super::shard;
use crate::engine::step::{MemoryStats, StepResult, Worker};
use crate::mlx::{self, distributed::GroupBackend};
use crate::model_dir::ModelDir;
use crate::models::kv_cache::KvConfig;
use crate::models::{self, LoadFormat, Model};

/// Environment variable with a rank's MLX memory limit in bytes (emulation).
pub const MEMORY_LIMIT_VAR: &str = "MLXCEL_RANK_MEMORY_LIMIT";

#[derive(Debug, Args, Clone)]
pub struct RankArgs {
    /// Resolved model folder.
    #[arg(long)]
    pub model: std::path::PathBuf,
    #[arg(long, value_enum)]
    pub load_format: LoadFormat,
    #[arg(long)]
    pub ctx_size: usize,
    #[arg(long)]
    pub slots: usize,
    /// Tokens per KV block.
    #[arg(long)]
    pub block_size: usize,
    /// Blocks in the KV pool (this rank holds its kv heads of each).
    #[arg(long)]
    pub kv_blocks: usize,
    /// Allocate the whole KV pool at the first step.
    #[arg(long)]
    pub kv_preallocate: bool,
    #[arg(long)]
    pub tp_size: usize,
    /// nccl or ring.
    #[arg(long)]
    pub backend: GroupBackend,
    /// Split the embedding and lm_head by vocabulary rows (the driver decides).
    #[arg(long, action = clap::ArgAction::Set)]
    pub vocab_parallel: bool,
    /// MoE models: hold whole experts per rank.
    #[arg(long)]
    pub enable_expert_parallel: bool,
}

fn env_usize(name: &str) -> Result<usize> {
    let v = std::env::var(name)
        .with_context(|| format!("{name} is not set (rank processes are started by the driver)"))?;
    v.trim()
        .parse()
        .with_context(|| format!("{name}={v} is not a number"))
}

pub fn run(args: &RankArgs) -> Result<()> {
    let rank = env_usize("MLX_RANK")?;
    let dir = match args.load_format {
        LoadFormat::Dummy => ModelDir::open_config_only(&args.model)?,
        LoadFormat::Safetensors => ModelDir::open(&args.model)?,
    };
    let config_bytes =
        std::fs::read(&dir.config).with_context(|| format!("reading {}", dir.config.display()))?;
    let weight_files = if args.load_format == LoadFormat::Dummy {
        vec![]
    } else {
        dir.weights.clone()
    };
    let identity = Identity::of(&config_bytes, args.tp_size, &weight_files);
    let mut chan = RankChannel::connect_from_env(serde_json::to_value(&identity)?)
        .context("connecting to the driver's control channel")?;
    if chan.rank() != rank {
        bail!(
            "MLX_RANK={rank} but the control channel says rank {}",
            chan.rank()
        );
    }
    // from its own thread, which touches no MLX state: the driver hears this rank
    // while it loads or runs a long step, and not once it is stopped or frozen
    chan.start_heartbeat()
        .context("starting the heartbeat thread")?;
    let result = serve(args, rank, &dir, &mut chan);
    if let Err(e) = &result {
        let _ = chan.send(&FromRank::Error(format!("rank {rank}: {e:#}")));
    }
    result
}

fn serve(args: &RankArgs, rank: usize, dir: &ModelDir, chan: &mut RankChannel) -> Result<()> {
    if let Ok(v) = std::env::var(MEMORY_LIMIT_VAR) {
        if let Ok(limit) = v.parse::<u64>() {
            mlx::memory::set_limit(limit);
        }
    }
    // MLX's ring backend cannot form a group of one (it waits for a peer that never
    // comes); one rank needs no collective, so it runs without a group
    let group = if args.tp_size == 1 && args.backend == GroupBackend::Ring {
        None
    } else {
        let group = mlx::distributed::init(args.backend, true)
            .with_context(|| format!("joining the {} group as rank {rank}", args.backend))?;
        group.expect_size(args.tp_size as i32)?;
        if group.rank() as usize != rank {
            bail!(
                "the {} group gave rank {} to MLX_RANK={rank}",
                args.backend,
                group.rank()
            );
        }
        Some(Rc::new(group))
    };
    let cfg = models::read_config(dir)?;
    let plan = shard::plan_with(
        &cfg,
        args.tp_size,
        rank,
        shard::SplitOptions {
            vocab_parallel: args.vocab_parallel,
            expert_parallel: args.enable_expert_parallel,
        },
    )?;
    let t0 = Instant::now();
    let src = models::weight_source(dir, args.load_format, &cfg)?;
    let model = Model::load_shard(&cfg, src.as_ref(), &plan, group, |_, _| {})?;
    let load_seconds = t0.elapsed().as_secs_f64();
    let bytes_read = src.bytes_read();
    let report = RankReport {
        rank,
        pid: std::process::id(),
        device: if mlx::gpu_device_count() > 0 {
            // the bus id names the physical GPU whatever CUDA_VISIBLE_DEVICES maps to 0
            mlx::device_info(0)
                .map(|d| {
                    if d.pci_bus_id.is_empty() {
                        d.name
                    } else {
                        format!("{} {}", d.name, d.pci_bus_id)
                    }
                })
                .unwrap_or_else(|_| "gpu".into())
        } else {
            "cpu".into()
        },
        weight_bytes: model.weight_bytes() as u64,
        active_memory: mlx::memory::active(),
        peak_memory: mlx::memory::peak(),
        bytes_read,
        load_seconds,
        load_gbps: if load_seconds > 0.0 {
            bytes_read as f64 / load_seconds / 1e9
        } else {
            0.0
        },
        peak_rss_bytes: super::plan::peak_rss_bytes(),
    };
    drop(src);
    // every rank samples (identically: replicated or gathered logits, seeds set by the
    // driver), so
    // pipelined decode steps can take their input tokens from the rank's own device
    let kv = KvConfig {
        block_size: args.block_size,
        num_blocks: args.kv_blocks,
        preallocate: args.kv_preallocate,
    };
    let mut worker = Worker::new(model, args.slots, args.ctx_size, kv, true);
    // every rank reaches this point after loading and runs the same step (with its
    // all-reduces) on a GPU, so the run-time kernels compile before the first request
    worker
        .warm_up()
        .with_context(|| format!("rank {rank}: warm-up step failed"))?;
    // (ranks sharing one device keep the share the driver gave them)
    if std::env::var_os(MEMORY_LIMIT_VAR).is_none() {
        worker.fit_memory_limits();
    }
    chan.send(&FromRank::Ready(report))?;
    loop {
        let msg = match chan.recv::<ToRank>() {
            Ok(m) => m,
            // the driver is gone or sent garbage: exit now
            Err(e) => {
                tracing::debug!("rank {rank}: control channel closed ({e}); exiting");
                std::process::exit(0);
            }
        };
        match msg {
            ToRank::Step(plan) => {
                let r = worker
                    .execute(&plan)
                    .with_context(|| format!("rank {rank}: step failed"))?;
                let mut reply = if rank == 0 { r } else { StepResult::default() };
                reply.memory = Some(MemoryStats::now());
                chan.send(&FromRank::Step(reply))?;
            }
            ToRank::QueueDecode {
                rows,
                tokens,
                tables,
            } => worker
                .queue_decode(&rows, tokens.as_deref(), &tables)
                .with_context(|| format!("rank {rank}: queuing a decode step failed"))?,
            ToRank::QueueForward {
                rows,
                tokens,
                tables,
            } => worker
                .queue_forward(&rows, tokens.as_deref(), &tables)
                .with_context(|| format!("rank {rank}: queuing a forward step failed"))?,
            ToRank::SampleQueued { masks } => worker
                .sample_queued(&masks)
                .with_context(|| format!("rank {rank}: sampling a queued step failed"))?,
            ToRank::TakeSampled => {
                let toks = worker
                    .take_sampled()
                    .with_context(|| format!("rank {rank}: a queued decode step failed"))?;
                chan.send(&FromRank::Sampled(toks))?;
            }
            ToRank::DiscardQueued => worker.discard_queued(),
            ToRank::Shutdown => return Ok(()),
        }
    }
}
