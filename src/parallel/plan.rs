//! The memory plan: what each tensor-parallel rank will hold, computed from
//! `config.json`, the shard plan and the checkpoint's dtypes (safetensors
//! headers) before anything is allocated, checked against each device's free
//! memory before any rank is spawned (and before a single-device load).
//!
//! Per rank:
//! - **weights**: exact bytes of the rank's blocks (see [`super::shard`]):
//!   column/row-split tensors contribute their slice, replicated ones (embeddings,
//!   lm_head, norms) their whole size. Dtypes come from the safetensors headers
//!   (dummy weights: `config.json`'s dtype; packed quantized weights: uint32).
//! - **KV cache**: `layers × 2 × tokens × kv_heads_per_rank × head_dim × dtype size`,
//!   tokens the paged pool's (`--kv-cache-gb`, `--gpu-memory-utilization`) or by default
//!   `slots × ctx` (the pool grows to that);
//! - **working margin**, with `T = min(max(max_num_batched_tokens, slots), slots · ctx)`
//!   tokens per step (the scheduler's token budget: decodes and prefill chunks
//!   together) and `a` the activation dtype's size:
//!   - activations `2 · T · (4·hidden + q_r + 2·kv_r + 3·inter_r) · a` (the residual,
//!     normed input, attention output and partial sums; this rank's q/k/v and its
//!     gate/up/SwiGLU columns; ×2 for temporaries alive within a layer);
//!   - attention scores `2 · heads_r · T · ctx · a` on the CPU backend only (its
//!     attention materialises scores and their softmax; the CUDA and Metal kernels
//!     are fused);
//!   - logits `slots · vocab · (2·4 + a)` (lm_head output, float32 copy, sampling);
//!   - KV update: one layer's K and V pools (`kv / layers`): alive twice while a pool
//!     grows, and a pool sized up front is copied whole by a write that cannot update it
//!     in place (none should: `models::kv_cache`; `mlxcel:kv_pool_copies_total` counts
//!     them), which must not fail the step;
//!   - runtime: 1 GiB per process on CUDA (context, cuBLAS workspace, NCCL
//!     buffers), 256 MiB elsewhere;
//!   - dummy weights only: `8 · vocab · hidden` while the embedding and lm_head are
//!     drawn (float32 draws before the cast; measured on an H200: exactly this much
//!     above the weights at the end of a dummy load). Checkpoint loads copy each
//!     block once into its array: no device-side transient.
//!
//! The plan fits when every rank's total is at most its device's free memory; ranks
//! that share one device (`--tp-emulate`, the CPU, Metal's unified memory) must fit
//! together. Free memory: CUDA's free memory per GPU (asked in a short-lived child
//! process when ranks will run, so the driver never creates a CUDA context), Metal's
//! total memory, the CPU's `MemAvailable` (Linux; elsewhere the check is skipped),
//! or [`DEVICE_MEMORY_VAR`] (bytes per device) to override — a testing knob.
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::shard::{self, ShardError, ShardPlan};
use crate::mlx::{self, Backend, Dtype};
use crate::models::weights::TensorEntry;
use crate::models::{self, ModelConfig};

/// Overrides every device's free memory (bytes) in the plan; for tests and for
/// machines whose free memory the plan cannot see.
pub const DEVICE_MEMORY_VAR: &str = "MLXCEL_PLAN_DEVICE_MEMORY";

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Memory a process needs beyond its arrays (context, library workspaces, communicators).
pub fn runtime_overhead(backend: Backend) -> u64 {
    match backend {
        Backend::Cuda => GIB,
        _ => 256 * MIB,
    }
}

/// What the plan is computed from.
#[derive(Debug, Clone, Copy)]
pub struct PlanInput<'a> {
    pub cfg: &'a ModelConfig,
    /// The checkpoint's tensors (from the safetensors headers); `None` for dummy weights.
    pub catalog: Option<&'a HashMap<String, TensorEntry>>,
    pub tp_size: usize,
    pub ctx_size: usize,
    /// Sequences at once (KV-cache slots).
    pub slots: usize,
    /// Tokens per step, decodes and prefill chunks together (the scheduler's budget,
    /// `--max-num-batched-tokens`): sizes the working margin.
    pub max_num_batched_tokens: usize,
    /// The MLX backend the ranks run (decides the attention and runtime terms).
    pub backend: Backend,
    /// Whether the embedding and lm_head split by vocabulary rows
    /// ([`crate::models::shard::VocabShard`]) rather than being replicated.
    pub vocab_parallel: bool,
    /// Tokens of the KV pool, allocated at once (`--kv-cache-gb`,
    /// `--gpu-memory-utilization`); `None`: `slots × ctx`, grown as used.
    pub kv_tokens: Option<usize>,
}

/// One rank's share, in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub weight_bytes: u64,
    /// Of `weight_bytes`: this rank's slices of the split tensors.
    pub sharded_bytes: u64,
    /// Of `weight_bytes`: the tensors every rank holds whole.
    pub replicated_bytes: u64,
    pub kv_bytes: u64,
    pub margin_bytes: u64,
    pub total_bytes: u64,
}

/// The plan of every rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryPlan {
    pub tp_size: usize,
    pub ctx_size: usize,
    pub slots: usize,
    pub max_num_batched_tokens: usize,
    /// Dtype of activations and of the KV cache.
    pub kv_dtype: String,
    /// Whole-model bytes of the tensors that are split across ranks.
    pub sharded_total_bytes: u64,
    /// Bytes of the tensors every rank holds whole.
    pub replicated_total_bytes: u64,
    /// Vocabulary rows of the embedding and lm_head per rank (⌈vocab / N⌉; the last rank
    /// may hold fewer) when they are vocab-parallel; `None`: replicated.
    pub vocab_rows_per_rank: Option<usize>,
    pub ranks: Vec<RankMemory>,
}

impl MemoryPlan {
    /// The largest rank total.
    pub fn max_rank_total(&self) -> u64 {
        self.ranks.iter().map(|r| r.total_bytes).max().unwrap_or(0)
    }

    /// All ranks together.
    pub fn sum_total(&self) -> u64 {
        self.ranks.iter().map(|r| r.total_bytes).sum()
    }
}

/// Weight bytes of one rank: (sharded slice, replicated, whole-model sharded), from the
/// family's layout ([`crate::models::layout`]), which is what the loader reads.
fn weight_bytes(
    cfg: &ModelConfig,
    catalog: Option<&HashMap<String, TensorEntry>>,
    plan: &ShardPlan,
) -> (u64, u64, u64) {
    let b = models::layout(cfg, plan).weight_bytes(catalog, cfg.dtype);
    (b.sharded, b.replicated, b.sharded_full)
}

/// Dtype of activations and the KV cache (the embedding's output dtype).
pub fn activation_dtype(
    cfg: &ModelConfig,
    catalog: Option<&HashMap<String, TensorEntry>>,
) -> Dtype {
    let get = |n: &str| catalog.and_then(|c| c.get(n)).map(|e| e.dtype);
    let quantized = cfg.quantization.is_some()
        && catalog.is_none_or(|c| c.contains_key("model.embed_tokens.scales"));
    let found = if quantized {
        get("model.embed_tokens.scales")
    } else {
        get("model.embed_tokens.weight")
    };
    found.filter(|d| d.is_float()).unwrap_or(cfg.dtype)
}

/// The memory plan of every rank (validates the split first).
pub fn plan_memory(input: &PlanInput<'_>) -> Result<MemoryPlan, ShardError> {
    plan_memory_with(input, false)
}

/// [`plan_memory`] with MoE experts whole per rank when `expert_parallel`.
pub fn plan_memory_with(
    input: &PlanInput<'_>,
    expert_parallel: bool,
) -> Result<MemoryPlan, ShardError> {
    let cfg = input.cfg;
    let n = input.tp_size;
    shard::validate_with(cfg, n, expert_parallel)?;
    let act = activation_dtype(cfg, input.catalog);
    let a = act.size() as u64;
    let ctx = input.ctx_size.max(1) as u64;
    let slots = input.slots.max(1) as u64;
    // every decode takes one token of the budget, and the scheduler keeps it at least
    // `slots`; no step holds more than every slot's whole context
    let t = (input.max_num_batched_tokens as u64)
        .max(slots)
        .min(slots * ctx);
    let mut ranks = Vec::with_capacity(n);
    let mut sharded_total = 0;
    let mut replicated_total = 0;
    let mut vocab_rows_per_rank = None;
    for r in 0..n {
        let sp = if n == 1 {
            ShardPlan::full(cfg)
        } else {
            shard::plan_with(
                cfg,
                n,
                r,
                shard::SplitOptions {
                    vocab_parallel: input.vocab_parallel,
                    expert_parallel,
                },
            )?
        };
        let (sharded, replicated, full) = weight_bytes(cfg, input.catalog, &sp);
        vocab_rows_per_rank = sp.vocab.as_ref().map(|v| v.per_rank);
        sharded_total = full;
        replicated_total = replicated;
        let hd = cfg.head_dim as u64;
        let kvh = sp.kv_heads.len() as u64;
        let qh = sp.q_heads.len() as u64;
        let layers = cfg.num_layers as u64;
        let kv_tokens = input.kv_tokens.map_or(slots * ctx, |t| t as u64);
        let kv = layers * 2 * kv_tokens * kvh * hd * a;
        let activations = 2
            * t
            * (4 * cfg.hidden_size as u64
                + qh * hd
                + 2 * kvh * hd
                + 3 * sp.intermediate.len() as u64)
            * a;
        let scores = if input.backend == Backend::Cpu {
            2 * qh * t * ctx * a
        } else {
            0
        };
        let logits = slots * cfg.vocab_size as u64 * (8 + a);
        // a pool that grows, or one made at once whose write copies it
        let kv_update = kv / layers.max(1);
        // this rank's rows of the embedding (all of them, replicated)
        let vocab_rows = sp.vocab.as_ref().map_or(cfg.vocab_size, |v| v.rows.len());
        let dummy_draw = if input.catalog.is_none() {
            8 * vocab_rows as u64 * cfg.hidden_size as u64
        } else {
            0
        };
        let margin = activations
            + crate::models::blocks::moe::working_bytes(cfg, &sp, t, a)
            + scores
            + logits
            + kv_update
            + runtime_overhead(input.backend)
            + dummy_draw;
        let weights = sharded + replicated;
        ranks.push(RankMemory {
            rank: r,
            weight_bytes: weights,
            sharded_bytes: sharded,
            replicated_bytes: replicated,
            kv_bytes: kv,
            margin_bytes: margin,
            total_bytes: weights + kv + margin,
        });
    }
    Ok(MemoryPlan {
        tp_size: n,
        ctx_size: input.ctx_size,
        slots: input.slots,
        max_num_batched_tokens: input.max_num_batched_tokens,
        kv_dtype: act.name().to_string(),
        sharded_total_bytes: sharded_total,
        replicated_total_bytes: replicated_total,
        vocab_rows_per_rank,
        ranks,
    })
}

/// KV bytes per token on the rank that needs the most (its kv heads, all layers).
pub fn kv_bytes_per_token(input: &PlanInput<'_>) -> Result<u64, ShardError> {
    let one = PlanInput {
        kv_tokens: Some(1),
        ..*input
    };
    Ok(plan_memory(&one)?
        .ranks
        .iter()
        .map(|r| r.kv_bytes)
        .max()
        .unwrap_or(0))
}

/// Tokens of KV that fit when each rank may use `fraction` of `device_bytes` (its
/// device's memory; ranks sharing one device: the whole device's, shared) for its
/// weights, KV pool and working margin.
pub fn kv_tokens_fit(
    input: &PlanInput<'_>,
    device_bytes: u64,
    fraction: f64,
    shared: bool,
) -> Result<u64, ShardError> {
    let none = PlanInput {
        kv_tokens: Some(0),
        ..*input
    };
    let base = plan_memory(&none)?;
    // each token of KV also adds its share of the margin's one-layer update
    let per_token = kv_bytes_per_token(input)?.max(1);
    let per_token = per_token + per_token.div_ceil(input.cfg.num_layers.max(1) as u64);
    let budget = (device_bytes as f64 * fraction) as u64;
    Ok(if shared {
        let ranks = base.ranks.len().max(1) as u64;
        budget.saturating_sub(base.sum_total()) / (per_token * ranks)
    } else {
        budget.saturating_sub(base.max_rank_total()) / per_token
    })
}

/// Free memory on one device, and where the number came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceFree {
    /// `GPU 0`, `CPU`, `Metal GPU`.
    pub label: String,
    pub free_bytes: u64,
    /// How it was measured (`CUDA free memory`, `MemAvailable`, the override variable).
    pub source: String,
}

/// The memory the ranks have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Budget {
    /// Rank r runs alone on device `r`.
    PerRank(Vec<DeviceFree>),
    /// All ranks share one device (emulation, the CPU, Metal's unified memory).
    Shared(DeviceFree),
}

impl Budget {
    fn fits(&self, plan: &MemoryPlan) -> bool {
        match self {
            Budget::PerRank(devs) => plan
                .ranks
                .iter()
                .zip(devs)
                .all(|(r, d)| r.total_bytes <= d.free_bytes),
            Budget::Shared(d) => plan.sum_total() <= d.free_bytes,
        }
    }

    /// The same kind of budget for `n` ranks: per-rank budgets assume the least free
    /// memory of the known devices for every rank.
    fn resized(&self, n: usize) -> Budget {
        match self {
            Budget::PerRank(devs) => {
                let least =
                    devs.iter()
                        .min_by_key(|d| d.free_bytes)
                        .cloned()
                        .unwrap_or(DeviceFree {
                            label: "GPU".into(),
                            free_bytes: 0,
                            source: String::new(),
                        });
                Budget::PerRank(vec![least; n])
            }
            s => s.clone(),
        }
    }
}

/// The plan does not fit: the numbers, and what would.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct DoesNotFit {
    pub message: String,
    pub tp_size: usize,
    /// The smallest valid `--tp-size` whose plan fits the same kind of devices.
    pub smallest_tp_size: Option<usize>,
    /// The largest `--ctx-size` that fits at this `--tp-size`.
    pub max_ctx_size: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error(transparent)]
    DoesNotFit(#[from] DoesNotFit),
}

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

/// Check `plan` (made from `input`) against `budget`; on failure say which rank, by how
/// much, the smallest valid `--tp-size` that would fit and the largest `--ctx-size` that would.
pub fn check_fit(
    input: &PlanInput<'_>,
    plan: &MemoryPlan,
    budget: &Budget,
) -> Result<(), DoesNotFit> {
    if budget.fits(plan) {
        return Ok(());
    }
    let n = plan.tp_size;
    let breakdown = |r: &RankMemory| {
        format!(
            "weights {} + KV cache {} + working margin {}",
            gb(r.weight_bytes),
            gb(r.kv_bytes),
            gb(r.margin_bytes)
        )
    };
    let what = format!(
        "--tp-size {n} with --ctx-size {} × {} slot(s)",
        plan.ctx_size, plan.slots
    );
    let mut msg = match budget {
        Budget::PerRank(devs) => {
            let (r, d) = plan
                .ranks
                .iter()
                .zip(devs)
                .find(|(r, d)| r.total_bytes > d.free_bytes)
                .expect("some rank does not fit");
            format!(
                "not enough memory for {what}: rank {} needs {} ({}) but {} has {} free ({})",
                r.rank,
                gb(r.total_bytes),
                breakdown(r),
                d.label,
                gb(d.free_bytes),
                d.source
            )
        }
        Budget::Shared(d) => format!(
            "not enough memory for {what}: the {n} rank(s) share {} and together need {} (per rank up to {}: {}) but it has {} free ({})",
            d.label,
            gb(plan.sum_total()),
            gb(plan.max_rank_total()),
            breakdown(plan.ranks.iter().max_by_key(|r| r.total_bytes).expect("ranks")),
            gb(d.free_bytes),
            d.source
        ),
    };
    let valid = shard::valid_sizes(input.cfg, 64);
    let smallest = valid.iter().copied().find(|&m| {
        let inp = PlanInput {
            tp_size: m,
            ..*input
        };
        plan_memory(&inp).is_ok_and(|p| budget.resized(m).fits(&p))
    });
    let fits_ctx = |c: usize| {
        let inp = PlanInput {
            ctx_size: c,
            ..*input
        };
        plan_memory(&inp).is_ok_and(|p| budget.fits(&p))
    };
    let max_ctx = if plan.ctx_size > 1 && fits_ctx(1) {
        let (mut lo, mut hi) = (1usize, plan.ctx_size - 1);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits_ctx(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Some(lo)
    } else {
        None
    };
    let sizes = valid
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    match (smallest, budget) {
        (Some(m), Budget::PerRank(devs)) => {
            let least = devs.iter().map(|d| d.free_bytes).min().unwrap_or(0);
            msg.push_str(&format!(
                ". The smallest --tp-size that fits is {m} (valid sizes: {sizes}; assuming {} free on each GPU{})",
                gb(least),
                if m > devs.len().max(n) {
                    format!(", and {m} GPUs")
                } else {
                    String::new()
                }
            ));
        }
        (Some(m), Budget::Shared(_)) => msg.push_str(&format!(
            ". On this one shared device the smallest --tp-size that fits is {m} (valid sizes: {sizes})"
        )),
        (None, _) => msg.push_str(&format!(
            ". No valid --tp-size ({sizes}) fits these devices"
        )),
    }
    match max_ctx {
        Some(c) => msg.push_str(&format!(
            "; or lower --ctx-size to {c} or less (or run fewer sequences at once)"
        )),
        None => msg.push_str("; even --ctx-size 1 does not fit at this --tp-size"),
    }
    msg.push_str(&format!(
        ". Nothing was started; {DEVICE_MEMORY_VAR}=<bytes> overrides the free memory the plan assumes"
    ));
    Err(DoesNotFit {
        message: msg,
        tp_size: n,
        smallest_tp_size: smallest,
        max_ctx_size: max_ctx,
    })
}

// ---- inputs from the machine ----

fn proc_kib(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..]
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// This process's peak resident set size (`VmHWM`); `None` off Linux.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_kib("/proc/self/status", "VmHWM")
}

/// `MemAvailable` of `/proc/meminfo`; `None` off Linux.
pub fn mem_available_bytes() -> Option<u64> {
    proc_kib("/proc/meminfo", "MemAvailable")
}

/// One GPU's memory as `mlxcel _devices` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuMemory {
    pub index: usize,
    pub total_bytes: u64,
    /// 0 where the backend does not say.
    pub free_bytes: u64,
}

/// Parse `mlxcel devices --json` output into per-GPU memory.
pub fn parse_devices_json(text: &str) -> Result<Vec<GpuMemory>, String> {
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or("no JSON object in its output")?;
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let gpus = v
        .get("gpus")
        .and_then(|g| g.as_array())
        .ok_or("no `gpus` array")?;
    Ok(gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let bytes = |k: &str, gib: &str| {
                g.get(k).and_then(|x| x.as_u64()).unwrap_or_else(|| {
                    g.get(gib)
                        .and_then(|x| x.as_f64())
                        .map(|x| (x * GIB as f64) as u64)
                        .unwrap_or(0)
                })
            };
            GpuMemory {
                index: g
                    .get("index")
                    .and_then(|x| x.as_u64())
                    .map(|x| x as usize)
                    .unwrap_or(i),
                total_bytes: bytes("total_memory_bytes", "total_memory_gib"),
                free_bytes: bytes("free_memory_bytes", "free_memory_gib"),
            }
        })
        .collect())
}

/// Per-GPU memory asked of a short-lived child (`<program> _devices`), so this process
/// creates no CUDA context. The child sees the same `CUDA_VISIBLE_DEVICES`.
pub fn gpu_memory_via_child(program: Option<&Path>) -> Result<Vec<GpuMemory>, String> {
    let exe = match program {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe().map_err(|e| format!("locating mlxcel: {e}"))?,
    };
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg("_devices").env("RUST_LOG", "error");
    let out = super::child::run_with_timeout(cmd, Duration::from_secs(60))
        .map_err(|e| format!("running `{} _devices`: {e:#}", exe.display()))?;
    if out.timed_out {
        return Err(format!(
            "`{} _devices` did not answer in 60 s",
            exe.display()
        ));
    }
    if !out.status.is_some_and(|s| s.success()) {
        let tail: Vec<&str> = out.stderr.lines().rev().take(3).collect();
        return Err(format!(
            "`{} _devices` failed: {}",
            exe.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    parse_devices_json(&out.stdout).map_err(|e| format!("`{} _devices`: {e}", exe.display()))
}

/// Per-GPU memory asked in this process (creates a CUDA context: single-device use only).
pub fn gpu_memory_in_process() -> Vec<GpuMemory> {
    (0..mlx::gpu_device_count())
        .map(|i| {
            let d = mlx::device_info(i as i32).ok();
            GpuMemory {
                index: i,
                total_bytes: d.as_ref().map(|d| d.total_memory).unwrap_or(0),
                free_bytes: d.map(|d| d.free_memory).unwrap_or(0),
            }
        })
        .collect()
}

/// How ranks map to devices, for [`budget`].
#[derive(Debug, Clone)]
pub struct Placement<'a> {
    /// Rank r → this process's GPU `entries[r]` (ignored without GPUs).
    pub entries: &'a [usize],
    /// All ranks on one device (`--tp-emulate`).
    pub shared: bool,
    /// Ask a child process (`Some(None)`: this executable; `Some(Some(p))`: program `p`),
    /// or this process (`None`), for CUDA free memory.
    pub child: Option<Option<&'a Path>>,
}

/// The memory the ranks will have, or why it is unknown (then the check is skipped).
/// Also returns the GPUs' memory when it was looked up.
pub fn budget(backend: Backend, place: &Placement<'_>) -> (Result<Budget, String>, Vec<GpuMemory>) {
    let n = place.entries.len().max(1);
    if let Ok(v) = std::env::var(DEVICE_MEMORY_VAR) {
        let b = match v.trim().parse::<u64>() {
            Ok(bytes) => {
                let dev = |label: String| DeviceFree {
                    label,
                    free_bytes: bytes,
                    source: format!("{DEVICE_MEMORY_VAR}={v}"),
                };
                if place.shared || backend != Backend::Cuda {
                    Ok(Budget::Shared(dev("the device".into())))
                } else {
                    Ok(Budget::PerRank(
                        place
                            .entries
                            .iter()
                            .map(|e| dev(format!("GPU {e}")))
                            .collect(),
                    ))
                }
            }
            Err(_) => Err(format!(
                "{DEVICE_MEMORY_VAR}={v:?} is not a number of bytes; ignoring it"
            )),
        };
        return (b, vec![]);
    }
    match backend {
        Backend::Cpu => (
            mem_available_bytes()
                .map(|b| {
                    Budget::Shared(DeviceFree {
                        label: "the CPU's memory".into(),
                        free_bytes: b,
                        source: "MemAvailable of /proc/meminfo".into(),
                    })
                })
                .ok_or_else(|| "free memory of the CPU is unknown on this OS".to_string()),
            vec![],
        ),
        Backend::Metal => {
            let total = mlx::device_info(0).map(|d| d.total_memory).unwrap_or(0);
            let b = if total > 0 {
                Ok(Budget::Shared(DeviceFree {
                    label: "the Metal GPU".into(),
                    free_bytes: total,
                    source: "its total memory".into(),
                }))
            } else {
                Err("the Metal GPU's memory is unknown".into())
            };
            (b, vec![])
        }
        Backend::Cuda => {
            let gpus = match place.child {
                Some(p) => match gpu_memory_via_child(p) {
                    Ok(g) => g,
                    Err(e) => return (Err(e), vec![]),
                },
                None => gpu_memory_in_process(),
            };
            let dev = |e: usize| -> Result<DeviceFree, String> {
                match gpus.iter().find(|g| g.index == e) {
                    Some(g) if g.free_bytes > 0 => Ok(DeviceFree {
                        label: format!("GPU {e}"),
                        free_bytes: g.free_bytes,
                        source: "CUDA free memory".into(),
                    }),
                    Some(_) => Err(format!("GPU {e} does not report its free memory")),
                    None => Err(format!("GPU {e} is not visible")),
                }
            };
            let b = if place.shared {
                dev(place.entries.first().copied().unwrap_or(0)).map(Budget::Shared)
            } else {
                place
                    .entries
                    .iter()
                    .take(n)
                    .map(|&e| dev(e))
                    .collect::<Result<Vec<_>, _>>()
                    .map(Budget::PerRank)
            };
            (b, gpus)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::config::{QuantConfig, RopeConfig};

    /// Llama-3-8B's shapes.
    fn llama8b(quant: Option<QuantConfig>) -> ModelConfig {
        ModelConfig {
            model_type: "llama".into(),
            hidden_size: 4096,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            intermediate_size: 14336,
            vocab_size: 128256,
            rms_norm_eps: 1e-5,
            rope: RopeConfig::plain(5e5),
            tie_word_embeddings: false,
            qkv_bias: false,
            qk_norm: false,
            max_position_embeddings: 8192,
            quantization: quant,
            dtype: Dtype::BF16,
            eos_token_ids: vec![],
            bos_token_id: None,
            moe: None,
        }
    }

    fn input(cfg: &ModelConfig, tp: usize) -> PlanInput<'_> {
        PlanInput {
            cfg,
            catalog: None,
            tp_size: tp,
            ctx_size: 8192,
            slots: 1,
            max_num_batched_tokens: 512,
            backend: Backend::Cuda,
            vocab_parallel: true,
            kv_tokens: None,
        }
    }

    fn per_rank(bytes: u64, n: usize) -> Budget {
        Budget::PerRank(
            (0..n)
                .map(|i| DeviceFree {
                    label: format!("GPU {i}"),
                    free_bytes: bytes,
                    source: "test".into(),
                })
                .collect(),
        )
    }

    /// For every family's fixture and TP 1, 2 and 4, each rank's planned weight bytes are
    /// exactly the bytes of the arrays the loader makes for that rank, and the bytes it
    /// reads from the checkpoint; from the checkpoint (dtypes from its headers) and from
    /// dummy weights (the config's dtype).
    #[test]
    fn plan_bytes_equal_what_the_loader_loads() {
        use crate::model_dir::ModelDir;
        use crate::models::{DummySource, Model, SafetensorsSource, WeightSource};
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let mut families = std::collections::BTreeSet::new();
        let fixtures = [
            "llama3",
            "llama_gqa2_tied",
            "llama_q4",
            "mistral",
            "qwen2",
            "qwen3",
        ];
        for fixture in fixtures {
            let md = ModelDir::open(&root.join(fixture)).unwrap();
            let cfg = models::read_config(&md).unwrap();
            families.insert(cfg.model_type.clone());
            let catalog = models::weights::catalog(&md).unwrap();
            for (tp, checkpoint, vocab_parallel) in [1, 2, 4]
                .into_iter()
                .flat_map(|tp| [(tp, true), (tp, false)])
                .flat_map(|(tp, c)| [(tp, c, true), (tp, c, false)])
            {
                let input = PlanInput {
                    cfg: &cfg,
                    catalog: checkpoint.then_some(&catalog),
                    tp_size: tp,
                    ctx_size: 64,
                    slots: 1,
                    max_num_batched_tokens: 16,
                    backend: Backend::Cpu,
                    vocab_parallel,
                    kv_tokens: None,
                };
                let p = plan_memory(&input).unwrap();
                for r in 0..tp {
                    let sp = match tp {
                        1 => ShardPlan::full(&cfg),
                        _ => shard::plan_with(
                            &cfg,
                            tp,
                            r,
                            shard::SplitOptions {
                                vocab_parallel,
                                expert_parallel: false,
                            },
                        )
                        .unwrap(),
                    };
                    let src: Box<dyn WeightSource> = match checkpoint {
                        true => Box::new(SafetensorsSource::from_dir(&md).unwrap()),
                        false => Box::new(DummySource::new(cfg.dtype, 0)),
                    };
                    let m = Model::load_shard(&cfg, src.as_ref(), &sp, None, |_, _| {}).unwrap();
                    let what = format!(
                        "{fixture}, tp {tp}, rank {r}, checkpoint {checkpoint}, \
                         vocab-parallel {vocab_parallel}"
                    );
                    assert_eq!(m.weight_bytes() as u64, p.ranks[r].weight_bytes, "{what}");
                    if checkpoint {
                        assert_eq!(src.bytes_read(), p.ranks[r].weight_bytes, "{what}");
                    }
                    if tp > 1 {
                        assert!(p.ranks[r].sharded_bytes > 0, "{what}: nothing split");
                    }
                }
            }
        }
        assert_eq!(
            families.into_iter().collect::<Vec<_>>(),
            ["llama", "mistral", "qwen2", "qwen3"]
        );
    }

    #[test]
    fn weights_of_llama8b_split_exactly() {
        let cfg = llama8b(None);
        let one = plan_memory(&input(&cfg, 1)).unwrap();
        // 8.03 B parameters in bf16
        assert_eq!(one.ranks[0].weight_bytes, cfg.num_parameters() * 2);
        assert_eq!(one.sharded_total_bytes, 0);
        let emb = 2 * 128256 * 4096 * 2; // embedding and lm_head
        let norms = (2 * 32 + 1) * 4096 * 2;
        for vocab_parallel in [false, true] {
            let two = plan_memory(&PlanInput {
                vocab_parallel,
                ..input(&cfg, 2)
            })
            .unwrap();
            let replicated = if vocab_parallel { norms } else { emb + norms };
            assert_eq!(two.replicated_total_bytes, replicated);
            assert_eq!(
                two.sharded_total_bytes + two.replicated_total_bytes,
                one.ranks[0].weight_bytes
            );
            for r in &two.ranks {
                assert_eq!(
                    r.weight_bytes,
                    two.sharded_total_bytes / 2 + two.replicated_total_bytes
                );
            }
        }
        // KV: 32 layers × 2 × 8 heads × 128 × 8192 × 2 bytes = 1 GiB, halved per rank
        assert_eq!(one.ranks[0].kv_bytes, GIB);
        assert_eq!(
            plan_memory(&input(&cfg, 2)).unwrap().ranks[1].kv_bytes,
            GIB / 2
        );
    }

    /// One rank of Llama-3-70B at TP 8 in bf16: vocab-parallel it holds 1/8 of the
    /// embedding and lm_head rows (3.68 GB less), and reads 17.4 GB per decoded token
    /// (all its weights but the embedding's rows other than the few looked up) instead of
    /// 19.2; an uneven vocabulary gives the last rank the rows left over.
    #[test]
    fn a_70b_rank_at_tp8_holds_its_vocabulary_rows() {
        let cfg = ModelConfig {
            hidden_size: 8192,
            num_layers: 80,
            num_heads: 64,
            intermediate_size: 28672,
            ..llama8b(None)
        };
        let plan = |vocab_parallel, cfg: &ModelConfig| {
            plan_memory(&PlanInput {
                vocab_parallel,
                ..input(cfg, 8)
            })
            .unwrap()
        };
        let (split, whole) = (plan(true, &cfg), plan(false, &cfg));
        assert_eq!(
            (split.vocab_rows_per_rank, whole.vocab_rows_per_rank),
            (Some(16032), None)
        );
        let table = 128256u64 * 8192 * 2; // one of embedding, lm_head: 2.10 GB
        let norms = (2 * 80 + 1) * 8192 * 2;
        for (s, w) in split.ranks.iter().zip(&whole.ranks) {
            assert_eq!(w.weight_bytes - s.weight_bytes, 2 * (table - table / 8));
            assert_eq!(s.replicated_bytes, norms);
        }
        let r = &split.ranks[0];
        let read = |held: u64, embedding: u64| (held - embedding) as f64 / 1e9;
        assert_eq!(
            format!("{:.1}", read(r.weight_bytes, table / 8)),
            "17.4",
            "{r:?}"
        );
        let w = &whole.ranks[0];
        assert_eq!(format!("{:.1}", read(w.weight_bytes, table)), "19.2");
        // 128257 rows: 16033 per rank, 16026 on the last
        let odd = ModelConfig {
            vocab_size: 128257,
            ..cfg
        };
        let p = plan(true, &odd);
        let row = 8192u64 * 2;
        assert_eq!(
            p.ranks[0].weight_bytes - p.ranks[7].weight_bytes,
            2 * (16033 - 16026) * row
        );
        // one more row each of the embedding and lm_head than at 128256
        assert_eq!(
            p.ranks[0].sharded_bytes - split.ranks[0].sharded_bytes,
            2 * row
        );
        // dummy weights are drawn per rank's rows
        assert!(p.ranks[7].margin_bytes < p.ranks[0].margin_bytes);
    }

    #[test]
    fn kv_heads_replicated_beyond_n_kv() {
        let cfg = llama8b(None);
        let p16 = plan_memory(&input(&cfg, 16)).unwrap();
        // 8 KV heads over 16 ranks: each rank holds one whole KV head
        assert_eq!(p16.ranks[3].kv_bytes, GIB / 8);
        let kv_proj = 2 * 32 * 128 * 4096 * 2; // k and v of one head, all layers
        assert!(p16.ranks[0].sharded_bytes > p16.sharded_total_bytes / 16);
        assert_eq!(
            p16.ranks[0].sharded_bytes - p16.sharded_total_bytes / 16,
            kv_proj - kv_proj * 8 / 16
        );
    }

    #[test]
    fn quantized_weights_count_packed_scales_and_biases() {
        let q = QuantConfig {
            group_size: 64,
            bits: 4,
        };
        let cfg = llama8b(Some(q));
        let p = plan_memory(&input(&cfg, 2)).unwrap();
        let full = plan_memory(&input(&cfg, 1)).unwrap().ranks[0].weight_bytes;
        // 4 bits + 2×16 bits per 64 weights = 4.5 bits per parameter
        let params = cfg.num_parameters() - (2 * 32 + 1) * 4096;
        let expect = params * 45 / 80 + (2 * 32 + 1) * 4096 * 2;
        assert_eq!(full, expect);
        assert_eq!(
            p.ranks[0].weight_bytes,
            p.sharded_total_bytes / 2 + p.replicated_total_bytes
        );
    }

    #[test]
    fn catalog_dtypes_win_over_config() {
        let cfg = llama8b(None);
        let mut cat = HashMap::new();
        cat.insert(
            "model.norm.weight".to_string(),
            TensorEntry {
                dtype: Dtype::F32,
                shape: vec![4096],
                start: 0,
            },
        );
        let mut inp = input(&cfg, 1);
        let base = plan_memory(&inp).unwrap().ranks[0].weight_bytes;
        inp.catalog = Some(&cat);
        assert_eq!(
            plan_memory(&inp).unwrap().ranks[0].weight_bytes,
            base + 4096 * 2
        );
    }

    #[test]
    fn margin_follows_the_formula() {
        let cfg = llama8b(None);
        let p = plan_memory(&input(&cfg, 2)).unwrap();
        let t = 512u64;
        let act = 2 * t * (4 * 4096 + 16 * 128 + 2 * 4 * 128 + 3 * 7168) * 2;
        let logits = 128256 * 10;
        let growth = (GIB / 2) / 32;
        // dummy weights: the draw of this rank's rows of the embedding/lm_head
        let draw = 8 * (128256 / 2) * 4096;
        assert_eq!(p.ranks[0].margin_bytes, act + logits + growth + GIB + draw);
        let mut cpu = input(&cfg, 2);
        cpu.backend = Backend::Cpu;
        let pc = plan_memory(&cpu).unwrap();
        assert_eq!(
            pc.ranks[0].margin_bytes,
            act + logits + growth + 256 * MIB + 2 * 16 * t * 8192 * 2 + draw
        );
        // a checkpoint (catalog) has no draw
        let cat = HashMap::new();
        let real = PlanInput {
            catalog: Some(&cat),
            ..input(&cfg, 2)
        };
        assert_eq!(
            plan_memory(&real).unwrap().ranks[0].margin_bytes,
            act + logits + growth + GIB
        );
    }

    /// The pool `--gpu-memory-utilization` sizes, planned, fits the fraction of the device
    /// with its working margin, which holds one layer's pool (a write that copies a pool
    /// must not fail the step); a pool larger by a hundredth of a layer's does not.
    #[test]
    fn the_fitted_pool_leaves_the_margin_and_one_layers_pool() {
        let cfg = llama8b(None);
        let mut inp = input(&cfg, 1);
        inp.slots = 32;
        inp.max_num_batched_tokens = 2048;
        // an H200 as NVML reports it, 0.9 of it
        let device = 150_754_820_096u64;
        let budget = (device as f64 * 0.9) as u64;
        let tokens = kv_tokens_fit(&inp, device, 0.9, false).unwrap();
        let plan = |t: u64| {
            plan_memory(&PlanInput {
                kv_tokens: Some(t as usize),
                ..inp
            })
            .unwrap()
            .ranks[0]
                .clone()
        };
        let r = plan(tokens);
        assert!(r.total_bytes <= budget, "{} > {budget}", r.total_bytes);
        let layer_pool = r.kv_bytes / 32;
        let base = plan(0).margin_bytes;
        assert_eq!(r.margin_bytes, base + layer_pool);
        // 8B bf16: 131072 bytes a token; about 110 GB of KV, 3.4 GB a layer
        assert!(
            (100e9..120e9).contains(&(r.kv_bytes as f64)),
            "{}",
            r.kv_bytes
        );
        let over = tokens + tokens / 3200;
        assert!(plan(over).total_bytes > budget);
    }

    #[test]
    fn refusal_names_numbers_and_the_smallest_tp_size() {
        let cfg = llama8b(None);
        let inp = input(&cfg, 1);
        let p = plan_memory(&inp).unwrap();
        // 10 GB per GPU: the whole model (16 GB) does not fit, nor 2 ranks (8 GB of
        // weights + 2.1 GB of dummy draw + ...); 4 ranks do (4 GB + 1.05 GB draw + ...)
        let b = per_rank(10_000_000_000, 1);
        let e = check_fit(&inp, &p, &b).unwrap_err();
        assert_eq!(e.smallest_tp_size, Some(4), "{e}");
        assert_eq!(e.max_ctx_size, None, "{e}");
        let m = e.to_string();
        assert!(
            m.contains("--tp-size 1") && m.contains("rank 0 needs"),
            "{m}"
        );
        assert!(m.contains("GPU 0 has 10.00 GB free"), "{m}");
        assert!(m.contains("smallest --tp-size that fits is 4"), "{m}");
        assert!(m.contains("and 4 GPUs"), "{m}");
        // enough for the weights: a shorter context fits
        let b = per_rank(22_100_000_000, 1);
        let e = check_fit(&inp, &p, &b).unwrap_err();
        let c = e.max_ctx_size.unwrap();
        assert!(c > 0 && c < 8192, "{e}");
        let shorter = PlanInput { ctx_size: c, ..inp };
        assert!(check_fit(&shorter, &plan_memory(&shorter).unwrap(), &b).is_ok());
        let longer = PlanInput {
            ctx_size: c + 1,
            ..inp
        };
        assert!(check_fit(&longer, &plan_memory(&longer).unwrap(), &b).is_err());
        // plenty: fits
        assert!(check_fit(&inp, &p, &per_rank(100 * GIB, 1)).is_ok());
    }

    #[test]
    fn shared_device_sums_the_ranks() {
        let cfg = llama8b(None);
        let inp = input(&cfg, 2);
        let p = plan_memory(&inp).unwrap();
        let shared = |b: u64| {
            Budget::Shared(DeviceFree {
                label: "GPU 0".into(),
                free_bytes: b,
                source: "test".into(),
            })
        };
        assert!(check_fit(&inp, &p, &shared(p.sum_total())).is_ok());
        let e = check_fit(&inp, &p, &shared(p.sum_total() - 1)).unwrap_err();
        assert!(e.to_string().contains("together need"), "{e}");
        // one rank needs less in total than two (no replicated copies)
        assert_eq!(e.smallest_tp_size, Some(1), "{e}");
    }

    #[test]
    fn devices_json_is_parsed() {
        let text = "log line\n{\"gpus\":[{\"index\":0,\"total_memory_bytes\":100,\"free_memory_bytes\":60,\"free_memory_gib\":0.0},{\"index\":1,\"total_memory_gib\":1.0,\"free_memory_gib\":0.5}]}\n";
        let g = parse_devices_json(text).unwrap();
        assert_eq!(
            g[0],
            GpuMemory {
                index: 0,
                total_bytes: 100,
                free_bytes: 60
            }
        );
        assert_eq!(g[1].total_bytes, GIB);
        assert_eq!(g[1].free_bytes, GIB / 2);
        assert!(parse_devices_json("nothing").is_err());
    }
}
