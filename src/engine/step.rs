//! Step plans and the worker that executes them.
//!
//! A step plan says, for each sequence in the step, its id, KV-cache slot,
//! position, block table (the driver owns the paged KV cache's block tables; each
//! rank holds its heads' part of every block) and new tokens, and whether to sample
//! after it. The same plan is
//! executed by the single-process engine and by every tensor-parallel rank,
//! so every rank issues the same collectives in the same order; ranks never
//! decide anything on their own. Only the sampling rank (0) returns tokens.
//!
//! A plan may mix decodes (one token each, run as one batch) and several prefill
//! chunks (run as one pass over all their tokens, see `Model::forward`).
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::grammar::{self, apply_mask_words, apply_masks, mask_words};
use super::sampler::{sample_batch_lazy, LazySample, SamplingParams, SequenceSampler};
use crate::kernels;
use crate::kernels::mask_wait::MaskBuffer;
use crate::mlx::host_fill::HostFill;
use crate::mlx::host_written::HostWritten;
use crate::mlx::{self, Array};
use crate::models::kv_cache::{KvCache, KvConfig, DEFAULT_BLOCK_SIZE};
use crate::models::{ForwardError, Logits, Model, SeqInput, StepInput};

/// First step of a sequence: reset its slot and set up its sampler.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SeqStart {
    pub params: SamplingParams,
    /// The whole prompt (repetition penalty looks at it).
    pub prompt: Vec<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SeqStep {
    pub seq_id: u64,
    pub slot: usize,
    /// Position of the first new token (must equal the slot's cached length).
    pub pos: usize,
    pub tokens: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<SeqStart>,
    /// Sample a token after this step (last prefill chunk, or decode).
    pub sample: bool,
    /// The sequence's block table in the paged KV cache, covering positions
    /// `0..pos + tokens.len()`; `None`: the slot's fixed blocks (see
    /// [`crate::models::kv_cache`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<u32>>,
    /// The sequence (re)starts here with its first `pos` positions already in its
    /// blocks (a cached prefix, or recomputation after preemption) and keeps its
    /// sampler; `start` implies it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub restart: bool,
}

impl SeqStep {
    /// A sequence's first step: its whole `prompt` into `slot` from position 0, sampled
    /// after with `params`.
    pub fn whole_prompt(seq_id: u64, slot: usize, prompt: &[u32], params: SamplingParams) -> Self {
        SeqStep {
            seq_id,
            slot,
            pos: 0,
            tokens: prompt.to_vec(),
            start: Some(SeqStart {
                params,
                prompt: prompt.to_vec(),
            }),
            sample: true,
            blocks: None,
            restart: false,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StepPlan {
    pub seqs: Vec<SeqStep>,
    /// Sequences that ended: drop their samplers.
    #[serde(default)]
    pub release: Vec<u64>,
    /// Return every position's logits (reference tests; large).
    #[serde(default)]
    pub return_logits: bool,
    /// Token masks of constrained sequences that sample in this step (see
    /// [`crate::engine::grammar`]): the driver computes them, every sampling rank
    /// applies them, so the ranks draw the same tokens.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub masks: Vec<SeqMask>,
    /// Sequences that share the prompt of a sequence in this step (the other choices of
    /// an `n` > 1 request): after the step, each starts with the prompt's positions
    /// ([`KvCache::fork`]: its table shares the prompt's full blocks, and the rows of a
    /// partly filled last block are copied into its own) and samples its first token
    /// from the same logits with its own sampler.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forks: Vec<Fork>,
}

/// A sequence started from another one's prefill (see [`StepPlan::forks`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fork {
    /// The sequence of the plan whose last prompt chunk (sampled) this one shares.
    pub from: u64,
    pub seq_id: u64,
    pub slot: usize,
    pub start: SeqStart,
    /// Its block table, covering the prompt: the full blocks of `from`'s, then a block
    /// of its own for a partly filled last one.
    pub blocks: Vec<u32>,
}

/// The tokens a constrained sequence may sample next: bit `t % 32` of word `t / 32`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SeqMask {
    pub seq_id: u64,
    pub allowed: Vec<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SampledToken {
    pub seq_id: u64,
    pub token: u32,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StepResult {
    pub sampled: Vec<SampledToken>,
    /// Per sequence, `[T * vocab]` row-major, when `return_logits`.
    pub logits: Vec<Vec<f32>>,
    /// MLX memory of the process after the step (TP ranks fill it in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
}

/// MLX memory counters of one process, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryStats {
    pub active: u64,
    pub peak: u64,
    pub cache: u64,
}

impl MemoryStats {
    /// This process's counters now.
    pub fn now() -> MemoryStats {
        MemoryStats {
            active: mlx::memory::active(),
            peak: mlx::memory::peak(),
            cache: mlx::memory::cache(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(
        "step plan: sequence {seq_id} at position {pos}, but slot {slot} holds {cached} tokens"
    )]
    Position {
        seq_id: u64,
        slot: usize,
        pos: usize,
        cached: usize,
    },
    #[error("step plan: sequence {0} samples without a sampler (no `start`)")]
    NoSampler(u64),
    #[error("step plan: fork {seq_id} shares sequence {from}, which does not sample in the step")]
    BadFork { seq_id: u64, from: u64 },
    #[error("sequence {0} cannot be decoded pipelined here (not started, a sampler with penalties, or an executor without pipelining)")]
    NotPipelined(u64),
    #[error("sampling parameters: {0}")]
    Params(String),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Mlx(#[from] mlx::MlxError),
    /// A tensor-parallel rank failed (message names the rank).
    #[error("{0}")]
    Rank(String),
}

/// The blocks of an executor's paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvPool {
    pub block_size: usize,
    pub num_blocks: usize,
}

/// Executes step plans: the single-process engine, or the driver of N ranks.
pub trait Executor {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepResult, StepError>;
    /// Maximum tokens per sequence.
    fn ctx_size(&self) -> usize;
    /// Most sequences at once (KV-cache slots).
    fn slots(&self) -> usize;
    /// The paged KV cache's pool, whose block tables the scheduler keeps. The default:
    /// every slot's whole context in blocks of [`DEFAULT_BLOCK_SIZE`].
    fn kv_pool(&self) -> KvPool {
        KvPool {
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks: self.slots() * self.ctx_size().div_ceil(DEFAULT_BLOCK_SIZE),
        }
    }
    /// Whether the executor is still usable, checked without waiting (the
    /// scheduler calls it while idle). `Err` ([`StepError::Rank`]) means it is not.
    fn check_health(&mut self) -> Result<(), StepError> {
        Ok(())
    }
    /// Restart peak-memory accounting (no-op where the memory lives in other processes).
    fn reset_peak_memory(&mut self) {}
    /// Peak device memory in bytes since the last reset: this process's MLX peak, or the
    /// largest rank's. Never touches a GPU in a tensor-parallel driver.
    fn peak_memory(&self) -> u64;

    /// Whether decode of `seq_id` can be pipelined here (see
    /// [`Executor::queue_decode`]): the local engine, for samplers that need no
    /// host state between tokens (no penalties).
    fn can_pipeline(&self, _seq_id: u64) -> bool {
        false
    }
    /// Queue one decode step of the sequences `rows` (`(seq_id, slot, pos)`, in this
    /// order) without waiting for it. Their inputs are `tokens` (one per row), or
    /// (`None`) the tokens the previously queued step samples for the same rows,
    /// still on the device. The step is evaluated asynchronously;
    /// [`Executor::take_sampled`] reads the oldest queued step's tokens. So step
    /// t+1 runs on the device while the host reads, detokenizes and streams step t.
    ///
    /// `tables` updates slots' block tables first (`(slot, table)`, the table covering
    /// the row's position), as a plan's [`SeqStep::blocks`] would.
    fn queue_decode(
        &mut self,
        rows: &[(u64, usize, usize)],
        _tokens: Option<&[u32]>,
        _tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        Err(StepError::NotPipelined(rows.first().map_or(0, |r| r.0)))
    }
    /// Like [`Executor::queue_decode`], but the step's sampling waits for
    /// [`Executor::sample_queued`]: the forward pass is queued and evaluated
    /// asynchronously, so the host computes the step's token masks (which depend on
    /// the tokens of the step before, read meanwhile) while the device runs it.
    fn queue_forward(
        &mut self,
        rows: &[(u64, usize, usize)],
        _tokens: Option<&[u32]>,
        _tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        Err(StepError::NotPipelined(rows.first().map_or(0, |r| r.0)))
    }
    /// Sample the newest step queued by [`Executor::queue_forward`], with `masks` applied
    /// to the rows of constrained sequences (rows without one sample unmasked).
    fn sample_queued(&mut self, _masks: &[SeqMask]) -> Result<(), StepError> {
        Err(StepError::Rank("no forward step queued".into()))
    }
    /// Sample the newest step queued by [`Executor::queue_forward`] (its rows are the
    /// sequences `ids`) with the masks `fill` writes, then queue `next`'s forward pass on
    /// its tokens (as [`Executor::queue_forward`] without tokens). `fill` gets the step's
    /// mask words, `[rows, words_per_row]` row-major with every bit set (a row left so
    /// samples unmasked), and `words_per_row` (⌈vocab / 32⌉).
    ///
    /// The local executor runs `fill` on the mask threads ([`grammar::pool`]) while this
    /// thread builds the sampling graph and `next`'s forward pass, with the words as their
    /// input, and evaluates them once `fill` is done (the sampling first, in an evaluation
    /// of its own, so the device starts on it before the forward pass is encoded): the masks cost
    /// this thread only what is left of them when the building is. Returns that wait.
    /// The default computes the masks first, then [`Executor::sample_queued`] and
    /// [`Executor::queue_forward`] (the driver of ranks sends them the masks).
    fn sample_masked(
        &mut self,
        ids: &[u64],
        words_per_row: usize,
        fill: &mut MaskFill<'_>,
        next: Option<NextForward<'_>>,
    ) -> Result<Duration, StepError> {
        let start = Instant::now();
        let mut words = vec![u32::MAX; ids.len() * words_per_row];
        fill(&mut words, words_per_row);
        let masks: Vec<SeqMask> = ids
            .iter()
            .zip(words.chunks(words_per_row.max(1)))
            .filter(|(_, row)| row.iter().any(|&w| w != u32::MAX))
            .map(|(&seq_id, row)| SeqMask {
                seq_id,
                allowed: row.to_vec(),
            })
            .collect();
        let waited = start.elapsed();
        self.sample_queued(&masks)?;
        if let Some(next) = next {
            self.queue_forward(next.rows, None, next.tables)?;
        }
        Ok(waited)
    }
    /// Whether [`Executor::sample_deferred`] is available and worth it: on a GPU, where
    /// the device can wait for masks that the host gives later.
    fn defers_masks(&self) -> bool {
        false
    }
    /// Like [`Executor::sample_queued`] with the masks given later, through the returned
    /// [`MaskSink`] (from any thread): the sampling is queued now and waits on the device
    /// for them, so the next step can be queued on top of it while the host computes them.
    fn sample_deferred(&mut self) -> Result<MaskSink, StepError> {
        Err(StepError::Rank("masks cannot be deferred here".into()))
    }
    /// The tokens of the oldest queued decode step, in its row order (waits for it).
    fn take_sampled(&mut self) -> Result<Vec<SampledToken>, StepError> {
        Err(StepError::Rank("no decode step queued".into()))
    }
    /// Drop queued steps whose tokens are no longer wanted.
    fn discard_queued(&mut self) {}
}

/// Writes a step's token masks (see [`Executor::sample_masked`]): the words and the
/// words per row.
pub type MaskFill<'a> = dyn FnMut(&mut [u32], usize) + Send + 'a;

/// The forward pass [`Executor::sample_masked`] queues after the step it samples: rows
/// `(seq_id, slot, pos)` and block-table updates, as [`Executor::queue_forward`] takes.
#[derive(Debug, Clone, Copy)]
pub struct NextForward<'a> {
    pub rows: &'a [(u64, usize, usize)],
    pub tables: &'a [(usize, Vec<u32>)],
}

/// A decode step queued by [`Worker::queue_decode`] or [`Worker::queue_forward`].
struct Queued {
    seq_ids: Vec<u64>,
    stage: Stage,
}

enum Stage {
    /// Forward pass queued; its `[B, vocab]` logits wait for their masks.
    Logits(Array),
    /// Sampling queued.
    Sampled(LazySample),
}

/// The model, its KV cache and per-sequence samplers, on the MLX thread.
pub struct Worker {
    pub model: Model,
    pub cache: KvCache,
    samplers: HashMap<u64, SequenceSampler>,
    /// Whether this worker samples (rank 0, or the only process).
    sampling: bool,
    /// Pipelined decode steps queued and not yet read, oldest first.
    queued: std::collections::VecDeque<Queued>,
    /// Whether constrained steps defer their masks ([`Executor::defers_masks`]).
    defer_masks: bool,
    /// On CUDA, the pinned memory deferred masks go through (made and checked by
    /// [`Worker::set_defer_masks`]), and the flag value of the last deferred step.
    mask_buffer: Option<Arc<Mutex<MaskBuffer>>>,
    mask_seq: u32,
    /// When set, each step's forward pass is counted here before it is evaluated (see
    /// [`StepOps`]).
    pub step_ops: Option<Vec<StepOps>>,
}

/// The MLX ops a step's forward pass built ([`mlx::graph::count_ops`] of its logits, down to
/// its input ids; sampling not included), with its rows: what a served step costs the
/// host, comparable with `Model::decode_ops` and `mlxcel bench`'s step.
#[derive(Debug, Clone)]
pub struct StepOps {
    /// Sequences in the step.
    pub rows: usize,
    /// Every sequence had one new token.
    pub decode: bool,
    pub ops: mlx::graph::OpCounts,
}

/// Where the masks of a step sampled by [`Executor::sample_deferred`] go: its rows'
/// sequence ids and what the device waits for. Dropped without [`MaskSink::provide`], the
/// step samples with no token allowed (its tokens are garbage: only for steps that are
/// discarded).
pub struct MaskSink {
    ids: Vec<u64>,
    vocab: usize,
    target: Option<MaskTarget>,
}

/// What a deferred step's sampling reads its masks from.
enum MaskTarget {
    /// An array filled by a task on a CPU stream (the CPU backend; see [`HostFill`]).
    Fill(HostFill),
    /// Pinned host memory read by mlxcel's kernel once the flag says `seq` (CUDA; see
    /// [`kernels::mask_wait`]); `given` once the words are written.
    Pinned {
        buf: Arc<Mutex<MaskBuffer>>,
        seq: u32,
        words: usize,
        given: bool,
    },
}

impl MaskSink {
    /// The step's masks: `allowed(seq_id)` for each row's sequence (`None`: it samples
    /// unmasked).
    pub fn provide<'a>(
        mut self,
        allowed: impl Fn(u64) -> Option<&'a [u32]>,
    ) -> Result<(), StepError> {
        let rows: Vec<Option<&[u32]>> = self.ids.iter().map(|&id| allowed(id)).collect();
        let words = mask_words(&rows, self.vocab);
        match self.target.as_mut() {
            Some(MaskTarget::Pinned {
                buf, seq, given, ..
            }) => {
                let in_time = lock(buf).give(*seq, &words)?;
                *given = true;
                match in_time {
                    true => Ok(()),
                    false => Err(late_masks(kernels::mask_wait::TIMEOUT_SECS)),
                }
            }
            Some(MaskTarget::Fill(fill)) => match fill.provide(&words)? {
                true => Ok(()),
                false => Err(late_masks(MASK_WAIT.as_secs())),
            },
            None => Err(StepError::Rank("the masks were given already".into())),
        }
    }
}

impl Drop for MaskTarget {
    fn drop(&mut self) {
        // a pinned step never given its masks gets zeros now, so that the device does not
        // wait for the kernel's timeout (a HostFill does the same on its own drop)
        if let MaskTarget::Pinned {
            buf,
            seq,
            words,
            given: false,
        } = self
        {
            let _ = lock(buf).give(*seq, &vec![0; *words]);
        }
    }
}

/// Words given to `buf` after a read of them was queued come back (the kernel compiled
/// and the device sees the host's writes), or why not: checked once before deferring.
fn mask_round_trip(buf: &Mutex<MaskBuffer>, seq: u32) -> Result<(), String> {
    let want = [0xA5A5_0001u32, 0x5A5A_0002];
    let mut b = lock(buf);
    let words = b.read(seq, 1, 2).map_err(|e| e.to_string())?;
    mlx::async_eval(&[&words]).map_err(|e| e.to_string())?;
    let in_time = b.give(seq, &want).map_err(|e| e.to_string())?;
    let got: Vec<u32> = words.to_vec().map_err(|e| e.to_string())?;
    if !in_time || got != want {
        return Err(format!(
            "the pinned-memory check read {got:x?} for {want:x?} (in time: {in_time})"
        ));
    }
    Ok(())
}

/// The error of masks given after their step stopped waiting `secs` for them.
fn late_masks(secs: u64) -> StepError {
    StepError::Rank(format!(
        "the masks came after the step stopped waiting for them ({secs} s)"
    ))
}

fn lock(buf: &Mutex<MaskBuffer>) -> std::sync::MutexGuard<'_, MaskBuffer> {
    buf.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long a step sampled with deferred masks waits for them before sampling with none
/// allowed (the host failed to give them; that step's tokens are discarded).
const MASK_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Longer prompts a server's warm-up runs too (those that fit a slot): 64 tokens take the
/// quantized GEMM of MLX where mlxcel's is off (`MLXCEL_QGEMM=0`; 9–255 rows at 4 bits),
/// 512 dequantize + GEMM (from 256 rows at 4 bits, 512 at 8, and above 128 rows with
/// mlxcel's GEMM on), and both MLX's causal attention over a chunk, so MLX's own kernels for
/// a batch of prompts compile at start too. Without them the first requests did: on one
/// H200 the first 8 streams after a cold start waited 12.4 s for their first tokens. On
/// CUDA only (where MLX compiles its kernels at run time).
const WARM_LONG_PROMPTS: [usize; 2] = [64, 512];

/// One step of [`Worker::warm_up`]: a decode step at a batch size, or a prompt of a length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WarmStep {
    Decode(usize),
    Prompt(usize),
}

impl std::fmt::Display for WarmStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WarmStep::Decode(b) => write!(f, "decode {b}"),
            WarmStep::Prompt(t) => write!(f, "prompt {t}"),
        }
    }
}

impl Worker {
    /// A worker of `slots` sequences of `ctx_size` tokens over a KV pool of `kv`.
    pub fn new(
        model: Model,
        slots: usize,
        ctx_size: usize,
        kv: KvConfig,
        sampling: bool,
    ) -> Worker {
        let cache = model.new_paged_cache(slots, ctx_size, kv);
        let mut w = Worker {
            model,
            cache,
            samplers: HashMap::new(),
            sampling,
            queued: std::collections::VecDeque::new(),
            defer_masks: false,
            mask_buffer: None,
            mask_seq: 0,
            step_ops: None,
        };
        if mlx::backend() != mlx::Backend::Cpu && kernels::knobs::get().defer_masks {
            w.set_defer_masks(true);
        }
        w
    }

    /// Run a decode step (then forget it) at each batch size up to one past the quantized
    /// GEMV's [`kernels::qgemv::MAX_M`] (as far as the slots allow; larger batches run it on
    /// row chunks of those sizes), and with more than one
    /// slot (a server) prompts of 2..=MAX_M tokens, on a GPU backend, so MLX compiles the
    /// run-time kernels of the decode path (mlxcel's GEMV is one per weight shape, batch
    /// size and fused epilogue) at start-up rather than while requests stream: a server
    /// on H200 stalled 34 s when 8 streams first met batch sizes 2–8. With one slot
    /// (`mlxcel generate`) the prompt's kernels compile at its first use, which costs the
    /// same once, so only decode is warmed. Compiled variants are kept in the cache folder
    /// ([`kernels::cache`]), which makes later starts quicker. With the quantized GEMM on
    /// (the default on CUDA; `MLXCEL_QGEMM=0` off) also a decode step and a prompt in each
    /// of its variants (whole tiles of 8 rows, [`kernels::qgemm::warm_rows`]) as far as the
    /// slots and the context allow. With more than one slot on CUDA also prompts of [`WARM_LONG_PROMPTS`] tokens
    /// (MLX's kernels for prefill). A no-op on the CPU.
    pub fn warm_up(&mut self) -> Result<(), StepError> {
        if mlx::backend() == mlx::Backend::Cpu || self.cache.slots() == 0 {
            return Ok(());
        }
        let background = kernels::knobs::get().warm_background;
        self.run_warm_up(mlx::kernel_cache::get().is_some(), false, background)
            .map(drop)
    }

    /// [`Worker::warm_up`]'s steps on any backend; `build_first`: every step's graph is
    /// built (and dropped) before any is evaluated; `long_prompts_anywhere`: the
    /// [`WARM_LONG_PROMPTS`] off CUDA too; `background` (with `build_first`): only batch
    /// 1 is evaluated. Returns the steps evaluated.
    fn run_warm_up(
        &mut self,
        build_first: bool,
        long_prompts_anywhere: bool,
        background: bool,
    ) -> Result<usize, StepError> {
        let start = std::time::Instant::now();
        let max_batch = self.cache.slots().min(kernels::qgemv::MAX_M + 1);
        // with the GEMM on, a batch in each of the GEMM's variants too (its kernels are one
        // per whole tile of 8 rows, not per batch size)
        let gemm = kernels::qgemm::warm_rows(max_batch + 1, self.cache.slots());
        // prompts (or last prefill chunks) of 2..=MAX_M tokens take the kernel at M = T with
        // the norm as its own op
        let prompt_max = if self.cache.slots() > 1 {
            kernels::qgemv::MAX_M.min(self.cache.max_capacity())
        } else {
            1
        };
        let (gemm_prompts, long_prompts) = if self.cache.slots() > 1 {
            let cap = self.cache.max_capacity();
            (
                kernels::qgemm::warm_rows(prompt_max + 1, cap),
                WARM_LONG_PROMPTS
                    .iter()
                    .copied()
                    .filter(|&t| {
                        t <= cap && (long_prompts_anywhere || mlx::backend() == mlx::Backend::Cuda)
                    })
                    .collect(),
            )
        } else {
            (Vec::new(), Vec::new())
        };
        let steps: Vec<WarmStep> = (1..=max_batch)
            .chain(gemm.iter().copied())
            .map(WarmStep::Decode)
            .chain(
                (2..=prompt_max)
                    .chain(gemm_prompts.iter().copied())
                    .chain(long_prompts)
                    .map(WarmStep::Prompt),
            )
            .collect();
        // With the compiled-kernel cache on, every step's graph is built once before any is
        // evaluated: building a graph names its kernel variants, and the cache compiles each
        // missing one on its own thread at once, so the first evaluation waits for all of
        // them together rather than step after step (on H200 one variant compiles in ~10 s;
        // the steps one by one took 86 s for 60 variants). The graphs are dropped unevaluated.
        // With `MLXCEL_WARM_BACKGROUND=1` batch 1's graph is built first and kept, the others
        // after it (so its compilations are the first started), and only batch 1 is evaluated,
        // waiting for its own kernels alone; the others' go on compiling in the background,
        // and a step that meets one still compiling waits for that one (MLX's own kernels of
        // those steps compile at their first use). Two versions measured on an H100 (8B
        // 4-bit, 103 variants): batch 1 evaluated before any other graph was built ran out
        // of device memory while the others were being built (not diagnosed); batch 1
        // evaluated after them, with every graph chained to the next by the GEMM's token
        // (see below), ran all of them: ready after 57 s.
        let background = build_first && background;
        let mut phases = Vec::new();
        let mut first: Option<(Array, crate::models::kv_cache::CacheState, Vec<u64>)> = None;
        if build_first {
            // (nothing evaluated while the graphs are built: see `BuildOnly`)
            let build_only = crate::models::model::BuildOnly::start();
            let before = self.cache.save();
            if background {
                let b1 = self.warm_graph(WarmStep::Decode(1))?;
                let keys = mlx::kernel_cache::take_needed();
                first = Some((b1, self.cache.save(), keys));
                self.cache.restore(before);
            }
            for &step in steps
                .iter()
                .filter(|&&s| !background || s != WarmStep::Decode(1))
            {
                // (each from the same cache: a graph built on the last one's pools would
                // have them evaluated with the next step, and its writes settle the views
                // of the one before, which waits for their kernels)
                let saved = self.cache.save();
                self.warm_graph(step)?;
                self.cache.restore(saved);
            }
            // (the GEMM orders its calls through a token: kept, the next evaluation would
            // run every dropped graph, and batch 1 in the background waited for all of them)
            kernels::qgemm::forget_dropped_calls();
            drop(build_only);
            tracing::debug!(
                "warm-up: {} steps built in {:.1} s",
                steps.len(),
                start.elapsed().as_secs_f64()
            );
        }
        let now: Vec<WarmStep> = match first {
            Some((b1, state, keys)) => {
                self.cache.restore(state);
                mlx::kernel_cache::set_needed(keys);
                b1.eval()?;
                phases.push(format!(
                    "{}: {:.1} s",
                    WarmStep::Decode(1),
                    start.elapsed().as_secs_f64()
                ));
                vec![WarmStep::Decode(1)]
            }
            None => {
                for &step in &steps {
                    self.warm_graph(step)?.eval()?;
                    phases.push(format!("{step}: {:.1} s", start.elapsed().as_secs_f64()));
                }
                steps.clone()
            }
        };
        if background {
            phases.push(format!(
                "{} steps left to the background with {} compilations under way",
                steps.len() - now.len(),
                mlx::kernel_cache::pending()
            ));
        }
        for s in 0..max_batch.max(gemm.last().copied().unwrap_or(0)) {
            self.cache.reset(s);
        }
        tracing::info!(
            "decode kernels warmed up (batch 1..={max_batch}{}) in {:.2} s (cumulative: {}){}",
            if gemm.is_empty() {
                String::new()
            } else {
                format!(", GEMM batches {gemm:?}")
            },
            start.elapsed().as_secs_f64(),
            phases.join(", "),
            kernels::cache::summary().map_or(String::new(), |s| format!("; {s}"))
        );
        Ok(now.len())
    }

    /// The (unevaluated) graph of one warm-up step, from reset slots: the argmax of its
    /// logits.
    fn warm_graph(&mut self, step: WarmStep) -> Result<Array, StepError> {
        let (slots, ids, logits): (Vec<usize>, Array, Logits) = match step {
            WarmStep::Decode(b) => (
                (0..b).collect(),
                Array::from_slice(&vec![0i32; b], &[b as i32, 1])?,
                Logits::Rows,
            ),
            WarmStep::Prompt(t) => (
                vec![0],
                Array::from_slice(&vec![0i32; t], &[1, t as i32])?,
                Logits::Last,
            ),
        };
        for &s in &slots {
            self.cache.reset(s);
        }
        let out = self.model.forward(
            &mut self.cache,
            StepInput::Device {
                slots: &slots,
                ids: &ids,
            },
            logits,
        )?;
        Ok(out[0].argmax(-1, false)?)
    }

    /// See [`Executor::can_pipeline`].
    pub fn can_pipeline(&self, seq_id: u64) -> bool {
        self.sampling
            && self
                .samplers
                .get(&seq_id)
                .is_some_and(|s| !s.params().has_penalties())
    }

    /// See [`Executor::queue_decode`].
    pub fn queue_decode(
        &mut self,
        rows: &[(u64, usize, usize)],
        tokens: Option<&[u32]>,
        tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        self.queue_step(rows, tokens, tables, true)
    }

    /// See [`Executor::queue_forward`].
    pub fn queue_forward(
        &mut self,
        rows: &[(u64, usize, usize)],
        tokens: Option<&[u32]>,
        tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        self.queue_step(rows, tokens, tables, false)
    }

    /// The newest queued step, taken off the queue, when its forward pass waits for its
    /// sampling: its rows' sequence ids and logits (left queued otherwise).
    fn pop_unsampled(&mut self) -> Result<(Vec<u64>, Array), StepError> {
        let q = self
            .queued
            .pop_back()
            .ok_or_else(|| StepError::Rank("no forward step queued".into()))?;
        let Stage::Logits(logits) = q.stage else {
            self.queued.push_back(q);
            return Err(StepError::Rank(
                "the newest queued step is sampled already".into(),
            ));
        };
        Ok((q.seq_ids, logits))
    }

    /// See [`Executor::sample_queued`].
    pub fn sample_queued(&mut self, masks: &[SeqMask]) -> Result<(), StepError> {
        let (seq_ids, logits) = self.pop_unsampled()?;
        let logits = masked(&logits, &seq_ids, masks)?;
        let sample = self.sample_lazy(&seq_ids, &logits)?;
        mlx::async_eval(&sample.arrays())?;
        self.queued.push_back(Queued {
            seq_ids,
            stage: Stage::Sampled(sample),
        });
        Ok(())
    }

    /// See [`Executor::sample_masked`].
    pub fn sample_masked(
        &mut self,
        ids: &[u64],
        fill: &mut MaskFill<'_>,
        next: Option<NextForward<'_>>,
    ) -> Result<Duration, StepError> {
        let (seq_ids, logits) = self.pop_unsampled()?;
        if ids != seq_ids {
            return Err(StepError::Rank(format!(
                "masks for rows {ids:?}, but the queued step has {:?}",
                seq_ids
            )));
        }
        let (b, vocab) = (logits.dim(0), logits.dim(1) as usize);
        let w = vocab.div_ceil(32);
        let mut words = HostWritten::<u32>::new(&[b, w as i32, 1])?;
        let mut built_at = None;
        // SAFETY: nothing is evaluated before the scope has waited for the words to be
        // set and `fill` to write them: the closure below only builds graphs
        // (`sample_lazy` and `forward_rows` evaluate nothing).
        let (array, writer) = unsafe { words.parts() };
        let built = grammar::pool().in_place_scope(|scope| {
            // every token allowed, then the masks
            scope.spawn(move |_| fill(writer.fill(0xFF), w));
            let built = self.build_masked(&seq_ids, &logits, array, next);
            built_at = Some(Instant::now());
            built
        });
        let waited = built_at.map_or(Duration::ZERO, |t| t.elapsed());
        let (sample, next_logits) = built?;
        // the sampling first, on its own: its tokens are read next, and MLX commits what
        // one evaluation encoded only at its end (or every MLX_MAX_OPS_PER_BUFFER ops), so
        // queued together the device would start on it only once the next forward pass
        // had been encoded too (`MLXCEL_SAMPLE_FIRST=0`: together, for A/B runs)
        if crate::kernels::knobs::get().sample_first || next_logits.is_none() {
            mlx::async_eval(&sample.arrays())?;
            if let Some(logits) = &next_logits {
                mlx::async_eval(&[logits])?;
            }
        } else {
            let mut all = sample.arrays();
            all.extend(next_logits.iter());
            mlx::async_eval(&all)?;
        }
        self.check_kv_writes();
        self.queued.push_back(Queued {
            seq_ids,
            stage: Stage::Sampled(sample),
        });
        if let (Some(n), Some(logits)) = (next, next_logits) {
            self.queued.push_back(Queued {
                seq_ids: n.rows.iter().map(|r| r.0).collect(),
                stage: Stage::Logits(logits),
            });
        }
        Ok(waited)
    }

    /// The graphs of [`Worker::sample_masked`], unevaluated: the sampling of `logits` (rows
    /// `ids`) masked by `words`, and `next`'s forward pass on its tokens.
    fn build_masked(
        &mut self,
        ids: &[u64],
        logits: &Array,
        words: &Array,
        next: Option<NextForward<'_>>,
    ) -> Result<(LazySample, Option<Array>), StepError> {
        let masked =
            apply_mask_words(logits, words).map_err(|e| StepError::Params(e.to_string()))?;
        let sample = self.sample_lazy(ids, &masked)?;
        let next_logits = match next {
            Some(n) => {
                if !n.rows.iter().map(|r| r.0).eq(ids.iter().copied()) {
                    return Err(StepError::Rank(format!(
                        "pipelined decode: the next step's rows {:?} are not those sampled ({ids:?})",
                        n.rows
                    )));
                }
                self.check_rows(n.rows, n.tables)?;
                let b = ids.len() as i32;
                let ids = sample.tokens().astype(mlx::Dtype::I32)?.reshape(&[b, 1])?;
                Some(self.forward_rows(n.rows, &ids)?)
            }
            None => None,
        };
        Ok((sample, next_logits))
    }

    /// See [`Executor::defers_masks`]: on a GPU backend with `MLXCEL_DEFER_MASKS=1` (off
    /// by default until measured there), or as [`Worker::set_defer_masks`] says.
    pub fn defers_masks(&self) -> bool {
        self.defer_masks
    }

    /// Defer masks (see [`Executor::sample_deferred`]) or not, whatever the backend: on
    /// the CPU only worth it to test the path (the masks must then come from another
    /// thread than the one queueing steps, as the scheduler does). On CUDA the masks go
    /// through pinned host memory, made here for every slot's row and checked with one
    /// round trip through the kernel: without it (no CUDA driver functions, the allocation
    /// refused, or the check failed) masks are not deferred, with a warning.
    pub fn set_defer_masks(&mut self, on: bool) {
        self.defer_masks = on;
        if on && mlx::backend() == mlx::Backend::Cuda && self.mask_buffer.is_none() {
            let words = self.cache.slots().max(1) * self.model.cfg.vocab_size.div_ceil(32);
            self.mask_buffer = MaskBuffer::new(words).map(|b| Arc::new(Mutex::new(b)));
            let why = match &self.mask_buffer {
                None => Some(format!("no pinned host memory for {words} mask words")),
                Some(buf) => {
                    self.mask_seq = self.mask_seq.wrapping_add(1);
                    mask_round_trip(buf, self.mask_seq).err()
                }
            };
            if let Some(why) = why {
                tracing::warn!("MLXCEL_DEFER_MASKS: {why}; constrained steps are not deferred");
                self.mask_buffer = None;
                self.defer_masks = false;
            }
        }
    }

    /// The pinned mask memory for `rows` rows of `words` words (CUDA: `None` elsewhere).
    fn mask_buffer(&self, rows: usize, words: usize) -> Option<Arc<Mutex<MaskBuffer>>> {
        let buf = self.mask_buffer.as_ref()?;
        (lock(buf).capacity() >= rows * words).then(|| Arc::clone(buf))
    }

    /// See [`Executor::sample_deferred`].
    pub fn sample_deferred(&mut self) -> Result<MaskSink, StepError> {
        let (seq_ids, logits) = self.pop_unsampled()?;
        let (b, vocab) = (logits.dim(0), logits.dim(1) as usize);
        let w = vocab.div_ceil(32);
        let (words, target) = match self.mask_buffer(b as usize, w) {
            Some(buf) => {
                self.mask_seq = self.mask_seq.wrapping_add(1);
                let seq = self.mask_seq;
                let words = lock(&buf).read(seq, b as usize, w)?;
                let target = MaskTarget::Pinned {
                    buf,
                    seq,
                    words: b as usize * w,
                    given: false,
                };
                (words, target)
            }
            // (MLX's CPU-stream-to-GPU event is not used on CUDA: see kernels::mask_wait)
            None if mlx::backend() == mlx::Backend::Cuda => {
                self.queued.push_back(Queued {
                    seq_ids,
                    stage: Stage::Logits(logits),
                });
                return Err(StepError::Rank(format!(
                    "deferred masks: no pinned buffer for {b} rows of {w} words"
                )));
            }
            None => {
                let fill = HostFill::new::<u32>(&[b, w as i32, 1], MASK_WAIT)?;
                (fill.array(), MaskTarget::Fill(fill))
            }
        };
        let masked =
            apply_mask_words(&logits, &words).map_err(|e| StepError::Params(e.to_string()))?;
        let sample = self.sample_lazy(&seq_ids, &masked)?;
        mlx::async_eval(&sample.arrays())?;
        let sink = MaskSink {
            ids: seq_ids.clone(),
            vocab,
            target: Some(target),
        };
        self.queued.push_back(Queued {
            seq_ids,
            stage: Stage::Sampled(sample),
        });
        Ok(sink)
    }

    /// Queue the forward pass of one decode step (after setting `tables`), and its
    /// sampling with `sample`.
    fn queue_step(
        &mut self,
        rows: &[(u64, usize, usize)],
        tokens: Option<&[u32]>,
        tables: &[(usize, Vec<u32>)],
        sample: bool,
    ) -> Result<(), StepError> {
        self.check_rows(rows, tables)?;
        let b = rows.len() as i32;
        let seq_ids: Vec<u64> = rows.iter().map(|r| r.0).collect();
        let ids = match tokens {
            Some(t) if t.len() == rows.len() => {
                let t: Vec<i32> = t.iter().map(|&x| x as i32).collect();
                Array::from_slice(&t, &[b, 1])?
            }
            Some(t) => {
                return Err(StepError::Rank(format!(
                    "pipelined decode: {} tokens for {} rows",
                    t.len(),
                    rows.len()
                )))
            }
            None => {
                let prev = self
                    .queued
                    .back()
                    .filter(|q| q.seq_ids == seq_ids)
                    .ok_or_else(|| {
                        StepError::Rank(format!(
                            "pipelined decode of {seq_ids:?}: the last queued step has other rows"
                        ))
                    })?;
                let Stage::Sampled(prev) = &prev.stage else {
                    return Err(StepError::Rank(format!(
                        "pipelined decode of {seq_ids:?}: the last queued step is not sampled"
                    )));
                };
                prev.tokens().astype(mlx::Dtype::I32)?.reshape(&[b, 1])?
            }
        };
        let logits = self.forward_rows(rows, &ids)?;
        let stage = if sample {
            let sample = self.sample_lazy(&seq_ids, &logits)?;
            mlx::async_eval(&sample.arrays())?;
            Stage::Sampled(sample)
        } else {
            mlx::async_eval(&[&logits])?;
            Stage::Logits(logits)
        };
        self.queued.push_back(Queued { seq_ids, stage });
        self.check_kv_writes();
        Ok(())
    }

    /// After a step is queued or run: whether its KV writes updated the pools in place
    /// (see [`crate::models::kv_cache`]); a copy is logged (a warning the first time).
    fn check_kv_writes(&mut self) {
        let copied = self.cache.check_in_place();
        if copied == 0 {
            return;
        }
        let total = self.cache.pool_copies();
        let msg = format!(
            "a KV cache write copied {copied} layer pool(s) instead of updating them in place \
             ({total} so far; {:.2} GB per layer): the step took that much more memory and time",
            self.cache.full_bytes() as f64 / self.cache.num_layers().max(1) as f64 / 1e9
        );
        match total == copied as u64 {
            true => tracing::warn!("{msg}"),
            false => tracing::debug!("{msg}"),
        }
    }

    /// Writes so far that copied a layer's KV pool instead of updating it in place.
    pub fn kv_pool_copies(&self) -> u64 {
        self.cache.pool_copies()
    }

    /// Record the ops of a step's forward pass (`outputs`, down to `inputs`) when counting.
    fn count_step(&mut self, rows: usize, decode: bool, outputs: &[&Array], inputs: &[&Array]) {
        if let Some(v) = &mut self.step_ops {
            v.push(StepOps {
                rows,
                decode,
                ops: mlx::graph::count_ops(outputs, inputs),
            });
        }
    }

    /// Set `tables`, then check that the decode `rows` may be pipelined and sit where
    /// their slots are.
    fn check_rows(
        &mut self,
        rows: &[(u64, usize, usize)],
        tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        if rows.is_empty() {
            return Err(StepError::Rank("pipelined decode: an empty step".into()));
        }
        for (slot, table) in tables {
            self.cache.check_slot(*slot).map_err(ForwardError::from)?;
            self.cache.set_table(*slot, table);
        }
        for &(seq_id, slot, pos) in rows {
            if !self.can_pipeline(seq_id) {
                return Err(StepError::NotPipelined(seq_id));
            }
            self.cache.check_slot(slot).map_err(ForwardError::from)?;
            let cached = self.cache.len(slot);
            if cached != pos {
                return Err(StepError::Position {
                    seq_id,
                    slot,
                    pos,
                    cached,
                });
            }
        }
        Ok(())
    }

    /// The `[B, vocab]` logits of one decode step of `rows` on the device tokens `ids`
    /// (`[B, 1]`), unevaluated.
    fn forward_rows(
        &mut self,
        rows: &[(u64, usize, usize)],
        ids: &Array,
    ) -> Result<Array, StepError> {
        let slots: Vec<usize> = rows.iter().map(|r| r.1).collect();
        let logits = self
            .model
            .forward(
                &mut self.cache,
                StepInput::Device { slots: &slots, ids },
                Logits::Rows,
            )?
            .remove(0);
        self.count_step(rows.len(), true, &[&logits], &[ids]);
        Ok(logits)
    }

    /// See [`Executor::take_sampled`].
    pub fn take_sampled(&mut self) -> Result<Vec<SampledToken>, StepError> {
        let q = self
            .queued
            .pop_front()
            .ok_or_else(|| StepError::Rank("no decode step queued".into()))?;
        match q.stage {
            Stage::Sampled(sample) => self.read_sampled(&q.seq_ids, sample),
            Stage::Logits(_) => Err(StepError::Rank(
                "the oldest queued step was never sampled".into(),
            )),
        }
    }

    /// See [`Executor::discard_queued`]. The cache keeps the discarded steps'
    /// positions; the sequence is over, and its slot is reset when reused.
    pub fn discard_queued(&mut self) {
        self.queued.clear();
    }

    pub fn execute(&mut self, plan: &StepPlan) -> Result<StepResult, StepError> {
        let r = self.execute_plan(plan);
        self.check_kv_writes();
        r
    }

    fn execute_plan(&mut self, plan: &StepPlan) -> Result<StepResult, StepError> {
        for id in &plan.release {
            self.samplers.remove(id);
        }
        for s in &plan.seqs {
            self.cache.check_slot(s.slot).map_err(ForwardError::from)?;
            if s.start.is_some() || s.restart {
                self.cache.restart(s.slot, s.pos, s.blocks.as_deref());
            } else if let Some(blocks) = &s.blocks {
                self.cache.set_table(s.slot, blocks);
            }
            if let Some(start) = &s.start {
                if self.sampling {
                    let sampler = SequenceSampler::new(start.params.clone(), &start.prompt)
                        .map_err(|e| StepError::Params(e.to_string()))?;
                    self.samplers.insert(s.seq_id, sampler);
                }
            }
            let cached = self.cache.len(s.slot);
            if cached != s.pos {
                return Err(StepError::Position {
                    seq_id: s.seq_id,
                    slot: s.slot,
                    pos: s.pos,
                    cached,
                });
            }
        }
        for f in &plan.forks {
            self.cache.check_slot(f.slot).map_err(ForwardError::from)?;
            if !plan.seqs.iter().any(|s| s.seq_id == f.from && s.sample) {
                return Err(StepError::BadFork {
                    seq_id: f.seq_id,
                    from: f.from,
                });
            }
            if self.sampling {
                let sampler = SequenceSampler::new(f.start.params.clone(), &f.start.prompt)
                    .map_err(|e| StepError::Params(e.to_string()))?;
                self.samplers.insert(f.seq_id, sampler);
            }
        }
        let inputs: Vec<SeqInput> = plan
            .seqs
            .iter()
            .map(|s| SeqInput {
                slot: s.slot,
                tokens: &s.tokens,
            })
            .collect();
        let pure_decode = !plan.return_logits
            && plan.forks.is_empty()
            && plan.seqs.len() > 1
            && plan.seqs.iter().all(|s| s.tokens.len() == 1 && s.sample);
        if pure_decode {
            // one graph, one `[B, vocab]` logits array straight into the sampler
            let logits = self
                .model
                .forward(&mut self.cache, StepInput::Host(&inputs), Logits::Rows)?
                .remove(0);
            self.count_step(plan.seqs.len(), true, &[&logits], &[]);
            if !self.sampling {
                logits.eval()?;
                return Ok(StepResult::default());
            }
            let ids: Vec<u64> = plan.seqs.iter().map(|s| s.seq_id).collect();
            return self.sample_rows(plan, ids, logits);
        }
        let mode = if plan.return_logits {
            Logits::All
        } else {
            Logits::Last
        };
        let logits = self
            .model
            .forward(&mut self.cache, StepInput::Host(&inputs), mode)?;
        let decode = plan.seqs.iter().all(|s| s.tokens.len() == 1);
        self.count_step(
            plan.seqs.len(),
            decode,
            &logits.iter().collect::<Vec<_>>(),
            &[],
        );
        if !plan.forks.is_empty() {
            // the step's reads of the pools run before the forks write into them (a write
            // built while a read of the same pool is still to be evaluated copies it)
            mlx::eval(&logits.iter().collect::<Vec<_>>())?;
        }
        // every rank starts the forks (the same evaluations in the same order)
        for f in &plan.forks {
            let s = plan
                .seqs
                .iter()
                .find(|s| s.seq_id == f.from)
                .expect("checked above");
            self.cache
                .fork(s.slot, f.slot, s.pos + s.tokens.len(), &f.blocks)
                .map_err(ForwardError::from)?;
        }
        let mut result = StepResult::default();
        if plan.return_logits {
            for l in &logits {
                result.logits.push(l.to_vec::<f32>()?);
            }
        }
        if !self.sampling {
            mlx::eval(&logits.iter().collect::<Vec<_>>())?;
            return Ok(result);
        }
        let rows: Vec<usize> = (0..plan.seqs.len())
            .filter(|&i| plan.seqs[i].sample)
            .collect();
        if rows.is_empty() {
            mlx::eval(&logits.iter().collect::<Vec<_>>())?;
            return Ok(result);
        }
        if rows.len() > 1 || plan.seqs.len() > 1 || !plan.forks.is_empty() {
            // Evaluate the whole step the way the non-sampling TP ranks do
            // (above) before sampling: the sampled rows alone would leave a
            // prefill chunk that does not sample unevaluated, or order the
            // graph differently, and ranks that run their collectives
            // (all_sum) in different orders deadlock.
            mlx::eval(&logits.iter().collect::<Vec<_>>())?;
        }
        let mut last: Vec<Array> = rows
            .iter()
            .map(|&i| {
                let l = &logits[i];
                let t = l.dim(0);
                l.slice_axis(0, t - 1, t)
            })
            .collect::<mlx::Result<_>>()?;
        let mut ids: Vec<u64> = rows.iter().map(|&i| plan.seqs[i].seq_id).collect();
        // each fork samples from the row of the sequence it shares
        for f in &plan.forks {
            let k = ids
                .iter()
                .position(|&id| id == f.from)
                .expect("checked above");
            last.push(last[k].clone());
            ids.push(f.seq_id);
        }
        let batch = if last.len() == 1 {
            last[0].clone()
        } else {
            mlx::concatenate(&last.iter().collect::<Vec<_>>(), 0)?
        };
        let mut out = self.sample_rows(plan, ids, batch)?;
        out.logits = result.logits;
        Ok(out)
    }

    /// Sample one token for each sequence `ids[k]` from row k of `batch` (`[n, vocab]`),
    /// with the masks of `plan`.
    fn sample_rows(
        &mut self,
        plan: &StepPlan,
        ids: Vec<u64>,
        batch: Array,
    ) -> Result<StepResult, StepError> {
        let batch = masked(&batch, &ids, &plan.masks)?;
        let sample = self.sample_lazy(&ids, &batch)?;
        Ok(StepResult {
            sampled: self.read_sampled(&ids, sample)?,
            ..StepResult::default()
        })
    }

    /// The sampling graph for sequences `ids`, row k of `logits` for `ids[k]`,
    /// unevaluated (advances their random streams).
    fn sample_lazy(&mut self, ids: &[u64], logits: &Array) -> Result<LazySample, StepError> {
        // take the samplers out so they can be borrowed mutably together
        let mut taken: Vec<(u64, SequenceSampler)> = Vec::with_capacity(ids.len());
        for &id in ids {
            match self.samplers.remove(&id) {
                Some(s) => taken.push((id, s)),
                None => {
                    for (id, s) in taken {
                        self.samplers.insert(id, s);
                    }
                    return Err(StepError::NoSampler(id));
                }
            }
        }
        let sample = {
            let mut refs: Vec<&mut SequenceSampler> = taken.iter_mut().map(|(_, s)| s).collect();
            sample_batch_lazy(logits, &mut refs)
        };
        for (id, s) in taken {
            self.samplers.insert(id, s);
        }
        Ok(sample?)
    }

    /// Read `sample` back and record each token with its sequence's sampler (a
    /// sequence released meanwhile has none).
    fn read_sampled(
        &mut self,
        ids: &[u64],
        sample: LazySample,
    ) -> Result<Vec<SampledToken>, StepError> {
        let sampled = sample.read()?;
        let mut out = Vec::with_capacity(sampled.len());
        for (&id, x) in ids.iter().zip(sampled) {
            if let Some(s) = self.samplers.get_mut(&id) {
                s.observe(x.token);
            }
            out.push(SampledToken {
                seq_id: id,
                token: x.token,
                logprob: x.logprob,
                top_logprobs: x.top_logprobs,
            });
        }
        Ok(out)
    }
}

/// CUDA memory outside MLX's count that may still appear after warm-up (CUDA graphs and
/// kernel modules of shapes met later, the library handles of a new stream, the rounding
/// of CUDA's memory pool): kept out of MLX's memory limit.
pub const OUTSIDE_MLX_BYTES: u64 = 2 << 30;

/// MLX's (memory limit, cache limit) for a process whose arrays take `active` bytes (the
/// weights and the whole KV pool, after warm-up) on a device with `free` bytes free (as
/// CUDA reports them to the process with MLX's cache emptied), or `None` when it reported
/// nothing. MLX may hold what the device has, less [`OUTSIDE_MLX_BYTES`]: above the
/// limit it frees its cache before it allocates, and the host waits for the device
/// before it queues more. MLX's default (0.95 of the device, its cache as large) counts
/// neither what the device already gave to others nor what CUDA holds outside MLX. Its
/// cache keeps at most half of that headroom, the rest is for a step's temporaries.
pub fn allocator_limits(active: u64, free: u64) -> Option<(u64, u64)> {
    if free == 0 {
        return None;
    }
    let headroom = free.saturating_sub(OUTSIDE_MLX_BYTES);
    Some((active + headroom, headroom / 2))
}

impl Worker {
    /// On CUDA with a KV pool sized by a memory budget, once it is allocated and the
    /// kernels are warmed up: MLX's memory and cache limits from the memory the device
    /// has left ([`allocator_limits`]). Elsewhere (the CPU, Metal, a pool that grows)
    /// MLX's defaults stay.
    pub fn fit_memory_limits(&mut self) {
        if mlx::backend() != mlx::Backend::Cuda || !self.cache.preallocated() {
            return;
        }
        mlx::memory::clear_cache();
        let _ = mlx::synchronize();
        // the driver's count for this process; else NVML's for the device (via MLX), which
        // counts the memory the driver reserves as free
        let (free, source) = match kernels::driver::mem_info() {
            Some((free, _)) => (free, "cuMemGetInfo"),
            None => match mlx::device_info(0) {
                Ok(d) => (d.free_memory, "the device"),
                Err(_) => return,
            },
        };
        let active = mlx::memory::active();
        let Some((limit, cache)) = allocator_limits(active, free) else {
            return;
        };
        let was = mlx::memory::set_limit(limit);
        let cache_was = mlx::memory::set_cache_limit(cache);
        let gb = |b: u64| b as f64 / 1e9;
        tracing::info!(
            "MLX memory limit {:.2} GB (was {:.2}), cache limit {:.2} GB (was {:.2}): arrays (weights, KV pool) {:.2} GB, free {:.2} GB ({source}), {:.2} GB kept for CUDA outside MLX",
            gb(limit),
            gb(was),
            gb(cache),
            gb(cache_was),
            gb(active),
            gb(free),
            gb(OUTSIDE_MLX_BYTES)
        );
        if free < 2 * OUTSIDE_MLX_BYTES {
            tracing::warn!(
                "only {:.2} GB of the GPU is free after the weights and the KV pool: steps may run out of memory; lower --gpu-memory-utilization or --kv-cache-gb",
                gb(free)
            );
        }
    }
}

/// `logits` (`[B, vocab]`, row k for sequence `ids[k]`) with each sequence's mask in
/// `masks` applied (unchanged without masks).
fn masked(logits: &Array, ids: &[u64], masks: &[SeqMask]) -> Result<Array, StepError> {
    if masks.is_empty() {
        return Ok(logits.clone());
    }
    let rows: Vec<Option<&[u32]>> = ids
        .iter()
        .map(|id| {
            masks
                .iter()
                .find(|m| m.seq_id == *id)
                .map(|m| m.allowed.as_slice())
        })
        .collect();
    apply_masks(logits, &rows).map_err(|e| StepError::Params(e.to_string()))
}

/// Executor that runs the worker in this process.
pub struct LocalExecutor {
    pub worker: Worker,
    ctx_size: usize,
}

impl LocalExecutor {
    /// Room for `slots` sequences of `ctx_size` tokens.
    pub fn new(model: Model, slots: usize, ctx_size: usize) -> LocalExecutor {
        let kv = KvConfig::for_slots(slots, ctx_size, DEFAULT_BLOCK_SIZE);
        LocalExecutor::with_kv(model, slots, ctx_size, kv)
    }

    /// At most `slots` sequences of `ctx_size` tokens over a KV pool of `kv`.
    pub fn with_kv(model: Model, slots: usize, ctx_size: usize, kv: KvConfig) -> LocalExecutor {
        LocalExecutor {
            worker: Worker::new(model, slots, ctx_size, kv, true),
            ctx_size,
        }
    }
}

impl Executor for LocalExecutor {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepResult, StepError> {
        self.worker.execute(plan)
    }
    fn ctx_size(&self) -> usize {
        self.ctx_size
    }
    fn slots(&self) -> usize {
        self.worker.cache.slots()
    }
    fn kv_pool(&self) -> KvPool {
        KvPool {
            block_size: self.worker.cache.block_size(),
            num_blocks: self.worker.cache.num_blocks(),
        }
    }
    fn reset_peak_memory(&mut self) {
        mlx::memory::reset_peak();
    }
    fn peak_memory(&self) -> u64 {
        mlx::memory::peak()
    }
    fn can_pipeline(&self, seq_id: u64) -> bool {
        self.worker.can_pipeline(seq_id)
    }
    fn queue_decode(
        &mut self,
        rows: &[(u64, usize, usize)],
        tokens: Option<&[u32]>,
        tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        self.worker.queue_decode(rows, tokens, tables)
    }
    fn queue_forward(
        &mut self,
        rows: &[(u64, usize, usize)],
        tokens: Option<&[u32]>,
        tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        self.worker.queue_forward(rows, tokens, tables)
    }
    fn sample_queued(&mut self, masks: &[SeqMask]) -> Result<(), StepError> {
        self.worker.sample_queued(masks)
    }
    fn sample_masked(
        &mut self,
        ids: &[u64],
        _words_per_row: usize,
        fill: &mut MaskFill<'_>,
        next: Option<NextForward<'_>>,
    ) -> Result<Duration, StepError> {
        self.worker.sample_masked(ids, fill, next)
    }
    fn defers_masks(&self) -> bool {
        self.worker.defers_masks()
    }
    fn sample_deferred(&mut self) -> Result<MaskSink, StepError> {
        self.worker.sample_deferred()
    }
    fn take_sampled(&mut self) -> Result<Vec<SampledToken>, StepError> {
        self.worker.take_sampled()
    }
    fn discard_queued(&mut self) {
        self.worker.discard_queued()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_dir::ModelDir;
    use crate::models::LoadFormat;
    use rand::{Rng, SeedableRng};

    /// The llama3 fixture (384 tokens) with `streams` sequences prefilled, sampling at
    /// temperature 0.7: the executor, each sequence's first token and the next position.
    fn prefilled(streams: usize) -> (LocalExecutor, Vec<u32>, usize) {
        prefilled_after(streams, 32, |_| {})
    }

    /// [`prefilled`] with room for `ctx` tokens per slot, `before` run on the executor
    /// first.
    fn prefilled_after(
        streams: usize,
        ctx: usize,
        before: impl FnOnce(&mut LocalExecutor),
    ) -> (LocalExecutor, Vec<u32>, usize) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama3");
        let model = crate::models::load(
            &ModelDir::open(&dir).unwrap(),
            LoadFormat::Safetensors,
            |_, _| {},
        )
        .unwrap()
        .model;
        let mut exec = LocalExecutor::new(model, streams, ctx);
        before(&mut exec);
        let prompt = [5u32, 6, 7, 8];
        let seqs = (0..streams)
            .map(|i| {
                let params = SamplingParams {
                    temperature: 0.7,
                    seed: Some(i as u64),
                    ..SamplingParams::default()
                };
                SeqStep::whole_prompt(i as u64, i, &prompt, params)
            })
            .collect();
        let first = exec
            .execute(&StepPlan {
                seqs,
                ..StepPlan::default()
            })
            .unwrap();
        let tokens = first.sampled.iter().map(|t| t.token).collect();
        (exec, tokens, prompt.len())
    }

    #[test]
    fn warm_up_leaves_the_slots_as_it_found_them() {
        // the warm-up's graphs, built first and dropped unevaluated, then run one by one,
        // must not change what the slots compute next: the same seeded prompt and decode
        // give the same tokens as on an executor never warmed up
        #[derive(PartialEq, Clone, Copy)]
        enum Warm {
            Steps,
            BuildFirst,
            Background,
        }
        let run = |warm: Option<Warm>| {
            // (a context that holds the warm-up's longer prompts)
            let (mut exec, mut last, prompt) = prefilled_after(2, 544, |exec| {
                if let Some(build_first) = warm {
                    let (build_first, background) =
                        (build_first != Warm::Steps, build_first == Warm::Background);
                    let evaluated = exec
                        .worker
                        .run_warm_up(build_first, true, background)
                        .unwrap();
                    // (batch 1 only in the background mode, every step otherwise)
                    assert_eq!(evaluated == 1, background, "{evaluated} steps evaluated");
                }
            });
            let mut tokens: Vec<u32> = Vec::new();
            for pos in prompt..prompt + 4 {
                tokens.extend(&last);
                let seqs = (0..2)
                    .map(|i| SeqStep {
                        seq_id: i as u64,
                        slot: i,
                        pos,
                        tokens: vec![last[i]],
                        start: None,
                        sample: true,
                        blocks: None,
                        restart: false,
                    })
                    .collect();
                let out = exec
                    .execute(&StepPlan {
                        seqs,
                        ..StepPlan::default()
                    })
                    .unwrap();
                last = out.sampled.iter().map(|t| t.token).collect();
            }
            tokens
        };
        let cold = run(None);
        assert_eq!(run(Some(Warm::BuildFirst)), cold);
        assert_eq!(run(Some(Warm::Steps)), cold);
        assert_eq!(run(Some(Warm::Background)), cold);
    }

    fn rows(streams: usize, pos: usize) -> Vec<(u64, usize, usize)> {
        (0..streams).map(|i| (i as u64, i, pos)).collect()
    }

    /// A pipelined constrained step builds the ops of an unconstrained one plus the
    /// mask's: its sampling and the next forward pass are one graph (the masks are an
    /// input written on the host), and the mask is an AND, a reshape, a cast and a select.
    #[test]
    fn a_constrained_step_builds_the_ops_of_an_unconstrained_one_and_the_mask() {
        let b = 32;
        let (mut exec, tokens, pos) = prefilled(b);
        let w = &mut exec.worker;
        let ids: Vec<u64> = (0..b as u64).collect();
        w.queue_forward(&rows(b, pos), Some(&tokens), &[]).unwrap();
        let Some(Queued {
            stage: Stage::Logits(logits),
            ..
        }) = w.queued.back()
        else {
            panic!("a forward step is queued")
        };
        let logits = logits.clone();
        let mut words = HostWritten::<u32>::new(&[b as i32, 12, 1]).unwrap();
        // SAFETY: the words are set here, before anything is evaluated
        unsafe { words.parts() }.1.fill(0xFF);
        let next = rows(b, pos + 1);
        let next = NextForward {
            rows: &next,
            tables: &[],
        };
        let (sample, next_logits) = w
            .build_masked(&ids, &logits, words.array(), Some(next))
            .unwrap();
        let next_logits = next_logits.expect("the next step is built");
        let mut outs = sample.arrays();
        outs.push(&next_logits);
        let constrained = mlx::graph::count_ops(&outs, &[&logits]);
        mlx::eval(&outs).unwrap();
        // an unconstrained pipelined step: the forward pass on the tokens sampled before,
        // then its sampling
        let prev = sample
            .tokens()
            .astype(mlx::Dtype::I32)
            .unwrap()
            .reshape(&[b as i32, 1])
            .unwrap();
        let l = w.forward_rows(&rows(b, pos + 2), &prev).unwrap();
        let plain = w.sample_lazy(&ids, &l).unwrap();
        let unconstrained = mlx::graph::count_ops(&plain.arrays(), &[sample.tokens()]);
        let mask = apply_mask_words(&logits, words.array()).unwrap();
        let mask = mlx::graph::count_ops(&[&mask], &[&logits, words.array()]);
        let real: Vec<(&str, usize)> = mask
            .by_name
            .iter()
            .filter(|(k, _)| k.as_str() != "Broadcast")
            .map(|(k, v)| (k.as_str(), *v))
            .collect();
        assert_eq!(
            real,
            [
                ("AsType", 1),
                ("BitwiseAnd", 1),
                ("Reshape", 1),
                ("Select", 1)
            ],
            "{mask:?}"
        );
        assert!(mask.get("Broadcast") <= 3, "{mask:?}");
        // (the forward pass of two layers and the sampling: 252 ops when written)
        assert!(unconstrained.total() > 100, "{unconstrained:?}");
        assert_eq!(
            constrained.total(),
            unconstrained.total() + mask.total(),
            "constrained {constrained:?}\nunconstrained {unconstrained:?}"
        );
    }

    /// Masks written by `sample_masked`'s fill (on the mask threads, while the step is
    /// built) sample what `sample_queued` samples with the same masks, only allowed
    /// tokens; the next step is queued on the sampled tokens.
    #[test]
    fn masks_written_while_building_sample_as_masks_given_first() {
        let b = 6;
        let w = 12; // words per row of 384 tokens
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // rows 0..4 masked (a few allowed tokens each, one forced), 4..6 unmasked
        let masks: Vec<SeqMask> = (0..4u64)
            .map(|id| {
                let mut allowed = vec![0u32; w];
                for _ in 0..if id == 2 { 1 } else { 5 } {
                    let t = rng.random_range(0..384usize);
                    allowed[t / 32] |= 1 << (t % 32);
                }
                SeqMask {
                    seq_id: id,
                    allowed,
                }
            })
            .collect();
        let ids: Vec<u64> = (0..b as u64).collect();
        let (mut first, tokens, pos) = prefilled(b);
        first
            .queue_forward(&rows(b, pos), Some(&tokens), &[])
            .unwrap();
        first.sample_queued(&masks).unwrap();
        let want = first.take_sampled().unwrap();
        let (mut during, tokens2, _) = prefilled(b);
        assert_eq!(tokens, tokens2);
        during
            .queue_forward(&rows(b, pos), Some(&tokens), &[])
            .unwrap();
        let mut calls = 0;
        let mut fill = |words: &mut [u32], per_row: usize| {
            calls += 1;
            assert_eq!((words.len(), per_row), (b * w, w));
            assert!(
                words.iter().all(|&x| x == u32::MAX),
                "every token allowed to start with"
            );
            for m in &masks {
                let row = m.seq_id as usize;
                words[row * w..(row + 1) * w].copy_from_slice(&m.allowed);
            }
        };
        let next = rows(b, pos + 1);
        let next = NextForward {
            rows: &next,
            tables: &[],
        };
        during
            .sample_masked(&ids, w, &mut fill, Some(next))
            .unwrap();
        assert_eq!(calls, 1);
        let got = during.take_sampled().unwrap();
        let tok = |s: &[SampledToken]| s.iter().map(|t| t.token).collect::<Vec<_>>();
        assert_eq!(tok(&got), tok(&want));
        for m in &masks {
            let t = got[m.seq_id as usize].token as usize;
            assert!(
                m.allowed[t / 32] >> (t % 32) & 1 == 1,
                "row {}: token {t}",
                m.seq_id
            );
        }
        // the next step's forward pass is queued on those tokens: its sampling follows
        during.sample_queued(&[]).unwrap();
        assert_eq!(during.take_sampled().unwrap().len(), b);
        // masks for other rows than the queued step's are refused
        during
            .queue_forward(&rows(b, pos + 2), Some(&tokens), &[])
            .unwrap();
        let e = during
            .sample_masked(&ids[..3], w, &mut |_, _| {}, None)
            .unwrap_err();
        assert!(e.to_string().contains("masks for rows"), "{e}");
    }

    /// The limits follow the memory the device has left, not its size: the server that ran
    /// out of memory on an H200 (16 GB of weights, a 113.76 GB pool) had its limit raised
    /// to the device less 1 GiB (149.68 GB), above what CUDA left it.
    #[test]
    fn allocator_limits_follow_the_free_memory() {
        const GB: u64 = 1_000_000_000;
        let active = 129_820_000_000;
        // what an H200 would have free beside them (150.1 GB less the CUDA context)
        let free = 19_800_000_000;
        let (limit, cache) = allocator_limits(active, free).unwrap();
        assert_eq!(limit, active + free - OUTSIDE_MLX_BYTES);
        assert!(limit < 149 * GB);
        assert_eq!(cache, (free - OUTSIDE_MLX_BYTES) / 2);
        // a small pool on an empty device: most of it
        let (limit, _) = allocator_limits(20 * GB, 128 * GB).unwrap();
        assert_eq!(limit, 148 * GB - OUTSIDE_MLX_BYTES);
        // less free than the margin: no headroom, no cache
        assert_eq!(allocator_limits(active, GB), Some((active, 0)));
        // an unknown device changes nothing
        assert_eq!(allocator_limits(active, 0), None);
    }
}
