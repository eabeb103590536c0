//! The tuning knobs of mlxcel's kernels: environment variables read once, in one
//! place, validated (a bad value is an error naming the variable), and logged at
//! debug level (`-v`) when they differ from the default. docs/tuning.md lists them
//! with what each one is for.
//!
//! Every binary calls [`check`] at start-up, so a bad value stops it before any work;
//! the kernels read [`get`]. Only tuning knobs live here: secrets (`MLXCEL_API_KEY`,
//! the rank control secret), paths of the cache and test-only variables do not.
use crate::mlx;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The kernels' tuning choices, from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Knobs {
    /// `MLXCEL_QGEMV`: use the quantized GEMV kernel on CUDA (`0`: MLX's kernels only).
    pub qgemv: bool,
    /// `MLXCEL_QGEMV_XQ`: 4-bit weights meet int8-rounded activations (`0`: float math).
    pub qgemv_xq: bool,
    /// `MLXCEL_QGEMV_F16`: the GEMV kernel for float16 activations and scales too (`0`:
    /// bfloat16 only, float16 goes to MLX's kernels).
    pub qgemv_f16: bool,
    /// `MLXCEL_QGEMV_MMA`: smallest batch on the tensor-core path; `Some(0)` turns it
    /// off, `None` keeps the default ([`super::qgemv::MMA_MIN_M`]).
    pub qgemv_mma: Option<usize>,
    /// `MLXCEL_QGEMV_CHUNKS`: batches above `MAX_M` run the kernel in row chunks.
    pub qgemv_chunks: bool,
    /// `MLXCEL_QGEMV_STREAM`: the streaming launch for long batch-1 rows.
    pub qgemv_stream: bool,
    /// `MLXCEL_QGEMV_MLP=1`: a quantized SwiGLU MLP of a decode step of up to 4 rows runs
    /// its gate/up and down GEMVs as one kernel of two stages (one MLX op instead of two;
    /// [`super::qgemv::qgemv_mlp`]); off by default until timed on a GPU.
    pub qgemv_mlp: bool,
    /// `MLXCEL_QGEMV_MLP_ROWS2`: rows per block of the one-kernel MLP's down stage
    /// (default: [`super::qgemv::mlp_launch`]'s choice).
    pub qgemv_mlp_rows2: Option<usize>,
    /// `MLXCEL_QGEMV_MLP_BOUNDED=1`: the one-kernel MLP compiled for two blocks per SM
    /// (`__launch_bounds__(256, 2)`: at most 128 registers a thread).
    pub qgemv_mlp_bounded: bool,
    /// `MLXCEL_QGEMV_STREAM_BLOCKS`: the streaming launch's grid (default: from the GPU).
    pub qgemv_stream_blocks: Option<usize>,
    /// `MLXCEL_QGEMV_SOURCE`: a kernel file read at run time instead of the embedded one.
    pub qgemv_source: Option<PathBuf>,
    /// `MLXCEL_QGEMM` (default 1): the quantized GEMM (`kernels/qgemm.cu`) for batches of
    /// [`super::qgemm::MIN_M`] (4-bit: [`super::qgemm::MIN_M_4BIT`])–[`super::qgemm::MAX_M`]
    /// rows on CUDA; 0: the GEMV on row chunks and MLX's kernels there.
    pub qgemm: bool,
    /// `MLXCEL_QGEMM_MIN_M`, `MLXCEL_QGEMM_MAX_M`: the batch rows the GEMM takes, whatever
    /// the bits (default [`super::qgemm::MIN_M`], 4-bit [`super::qgemm::MIN_M_4BIT`], and
    /// [`super::qgemm::MAX_M`]).
    pub qgemm_min_m: Option<usize>,
    pub qgemm_max_m: Option<usize>,
    /// `MLXCEL_QGEMM_SPLITK`: the most blocks the GEMM splits a row's K over (1: none;
    /// default [`super::qgemm::MAX_SPLITS`]).
    pub qgemm_splitk: Option<usize>,
    /// `MLXCEL_QGEMM_RING_BYTES`: shared memory the GEMM's ring of stages may take (default
    /// [`super::qgemm::RING_BYTES`]), for A/B runs of deeper rings (e.g. 3 stages for the
    /// wgmma flavour's 8-bit launches, where its x pass a step ahead needs them).
    pub qgemm_ring_bytes: Option<usize>,
    /// `MLXCEL_QGEMM_SOURCE`: a GEMM kernel file read at run time instead of the embedded one.
    pub qgemm_source: Option<PathBuf>,
    /// `MLXCEL_QGEMM_BOUNDED=1`: launches of up to [`super::qgemm::BOUNDED_MAX_M`] rows in
    /// the GEMM's 128-register flavour, two warps per row of tiles
    /// ([`super::qgemm::bounded`]). Off until measured in the engine.
    pub qgemm_bounded: bool,
    /// `MLXCEL_QGEMM_WIDE` (default 1): GEMM blocks of [`super::qgemm::BLOCK_WARPS`] warps;
    /// 0: [`super::qgemm::NARROW_BLOCK_WARPS`] (128 weight rows a block), for A/B runs.
    pub qgemm_wide: bool,
    /// `MLXCEL_QGEMM_WGMMA` (default 1): the GEMM's wide blocks of up to
    /// [`super::qgemm::WGMMA_MAX_M`] rows in the warpgroup-MMA flavour on Hopper (sm_90;
    /// [`super::qgemm::WGMMA_PREFIX`]); 0: `mma.sync` everywhere, for A/B runs.
    pub qgemm_wgmma: bool,
    /// `MLXCEL_QGEMM_FILL=1`: split K over the fewest blocks that fill every SM's slots (the
    /// rule before [`super::qgemm::split_cost`]), for A/B runs.
    pub qgemm_fill: bool,
    /// `MLXCEL_KERNEL_INCLUDE`: pass kernel headers to MLX as an `#include` of a cached
    /// file (`0`: inline).
    pub kernel_include: bool,
    /// `MLXCEL_ATTN`: mlxcel's decode attention kernel for batched steps on CUDA.
    pub attn: bool,
    /// `MLXCEL_ATTN_ALL_SPLITS=1`: the attention kernel is launched with its most splits
    /// for every (row, kv head), whatever the step's lengths (the launch before
    /// [`super::attn::launch_splits`]), for A/B runs.
    pub attn_all_splits: bool,
    /// `MLXCEL_ATTN_SOURCE`: an attention kernel file read at run time instead of the
    /// embedded `kernels/attn.cu` (A/B runs of kernel versions in one binary).
    pub attn_source: Option<PathBuf>,
    /// `MLXCEL_ATTN_SINGLE`: a single sequence's decode step (blocks in one run, the q/k/v
    /// kernel writing the pool) runs that kernel over the pool the q/k/v kernel wrote through
    /// (one op per layer for attention), instead of MLX's sdpa over two views of the pool
    /// (two ops).
    pub attn_single: bool,
    /// `MLXCEL_KERNEL_CACHE`: keep compiled kernels in the cache folder between runs.
    pub kernel_cache: bool,
    /// `MLXCEL_VOCAB_PARALLEL`: under tensor parallelism each rank holds its rows of the
    /// vocabulary (embedding, lm_head) and the logits are gathered (`0`: every rank
    /// holds both whole).
    pub vocab_parallel: bool,
    /// `MLXCEL_ADDMM_RESIDUAL`: a decode step's residual add is folded into the dense
    /// matmul before it (one `AddMM` op instead of `Matmul` + `Add`; `0`: two ops).
    pub addmm_residual: bool,
    /// `MLXCEL_KERNEL_REUSE`: a custom kernel's later calls reuse the op MLX made at its
    /// variant's first call instead of generating its source again (`0`: MLX's kernel
    /// function every call).
    pub kernel_reuse: bool,
    /// `MLXCEL_GEMV_DENSE`: mlxcel's dense GEMV kernel (with the quantized kernel's fusions)
    /// for bf16/f16 linears of decode steps on CUDA (the default; `0`: MLX's matmul).
    pub gemv_dense: bool,
    /// `MLXCEL_GEMV_WIDE` (default 1): the dense GEMV's one-round launch
    /// ([`super::gemv::launch_config`]); 0: the previous 4-rows-per-block launch.
    pub gemv_wide: bool,
    /// `MLXCEL_GEMV_MMA`: the smallest batch whose decode steps take the dense GEMV's
    /// tensor-core path (`mma.sync` bf16/f16; 0: never; unset: [`super::gemv::MMA_FROM`]).
    pub gemv_mma: Option<usize>,
    /// `MLXCEL_GEMV_MMA_MAX`: the largest batch on that path (unset:
    /// [`super::gemv::MMA_MAX`]); larger batches stay on MLX's matmul.
    pub gemv_mma_max: Option<usize>,
    /// `MLXCEL_GEMV_MMA_KV` (default 1): the tensor-core q/k/v launch writes the new keys and
    /// values into the KV pool itself, as the CUDA-core one does; 0: it returns them for the
    /// cache to write (see `kernels::gemv::writes_kv`).
    pub gemv_mma_kv: bool,
    /// `MLXCEL_QKV_BIAS` (default 1): a q/k/v projection with biases (Qwen2) runs the GEMV
    /// kernels' q/k/v + RoPE entry point, which adds them; 0: the plain ops, as before.
    pub qkv_bias: bool,
    /// `MLXCEL_QK_ROPE` (default 1): Qwen3's q/k norms, RoPE and the cache write of a decode
    /// step in one kernel (`kernels/qk_rope.cu`); 0: the separate ops, as before.
    pub qk_rope: bool,
    /// `MLXCEL_DEVICE_INPUTS` (default 1): a step's int32 kernel inputs (positions, KV
    /// write rows, block tables) in device memory on CUDA (`crate::mlx::device_inputs`);
    /// 0: host arrays in MLX's unified memory, as before.
    pub device_inputs: bool,
    /// `MLXCEL_STEP_STAGING` (default 1): those inputs are written into host arrays kept
    /// from step to step, each reused once the device has copied it
    /// (`crate::mlx::device_inputs`); 0: a new host array each step, as before (on CUDA MLX
    /// may give it a cached device buffer, which it moves to unified memory with a
    /// synchronous copy).
    pub step_staging: bool,
    /// `MLXCEL_DEVICE_CONSTS` (default 1): small constant arrays the decode kernels read
    /// every layer (RoPE's frequencies, weights under 1 MiB: norms, biases) copied into
    /// device memory on CUDA once at load (`crate::mlx::device_inputs::device_copy`); 0: as
    /// made from host data, in MLX's unified memory.
    pub device_consts: bool,
    /// `MLXCEL_KV_FUSED` (default 1): a decode step's q/k/v kernel (the GEMV's, up to 8
    /// rows) writes the new keys and values straight into the KV pool; 0: a cache write
    /// op per layer, as before.
    pub kv_fused: bool,
    /// `MLXCEL_POOL_VIEW` (default 1): views of the KV pool cost fewer ops: a layer's
    /// whole-pool view, once evaluated, is kept and given to later steps as an input (one
    /// op per layer less where the q/k/v kernel writes the pool or a kernel or gather reads
    /// it whole), and a sequence's keys and values are read as two views made by one op;
    /// 0: a new whole-pool view every step, one op per view.
    pub pool_view: bool,
    /// `MLXCEL_FORGET_VIEW` (default 1): a whole-pool view made for a q/k/v kernel that
    /// returned its keys and values instead of writing them (the batched GEMM) is forgotten
    /// (`KvCache::forget_unused_view`); 0: kept, so each layer's
    /// cache write evaluates it on its own first, as before.
    pub forget_view: bool,
    /// `MLXCEL_FUSED_STEP=1`: a single sequence's decode step evaluates its layers as one
    /// op ([`crate::mlx::fuse_graph`]: MLX's evaluation loop runs once for the layers'
    /// ops instead of once per op; each op encodes its kernels as before). Off by default:
    /// on one H100 it was no faster (its graph walk cost the build what it saved the
    /// evaluation; docs/benchmarks.md).
    pub fused_step: bool,
    /// `MLXCEL_TP_RESIDUAL=1`: under tensor parallelism a row-parallel linear that feeds
    /// the residual stream (o_proj, down_proj) has rank 0 add the residual to its partial
    /// product (in the GEMV/GEMM kernel's epilogue where one runs), so the reduction
    /// already gives `res + x·Wᵀ`: no add op after the reduction. Off by default: each
    /// step of the reduction then rounds at the residual's magnitude (16-bit activations),
    /// not yet measured on GPUs.
    pub tp_residual: bool,
    /// `MLXCEL_NVRTC_PROCESSES` (default 1): the compiled-kernel cache compiles each
    /// kernel in a process of its own (`<this program> _nvrtc`), so several compile at
    /// once (NVRTC runs one compilation at a time per process); 0: on threads of this
    /// process.
    pub nvrtc_processes: bool,
    /// `MLXCEL_WARM_BACKGROUND=1`: with the compiled-kernel cache on, a server's warm-up
    /// starts compiling every warm-up step's kernels but waits only for batch 1's; the
    /// others compile in the background, and a step that meets one still compiling waits
    /// for that one only (MLX's own kernels of those steps compile at their first use).
    /// Off by default until the first start is measured on a GPU.
    pub warm_background: bool,
    /// `MLXCEL_DEFER_MASKS=1`: on a GPU, a constrained decode step's sampling and the next
    /// forward pass are queued before its token masks exist (the device waits for them),
    /// and the masks are computed meanwhile on another thread. Off by default until
    /// measured on a GPU (docs/tuning.md).
    pub defer_masks: bool,
    /// `MLXCEL_SAMPLE_FIRST`: a pipelined constrained step's masked sampling is evaluated
    /// on its own before the next forward pass, so the device starts it at once (`0`: one
    /// evaluation of both, committed once the forward pass is encoded too).
    pub sample_first: bool,
    /// `MLXCEL_MASK_THREADS`: the threads that compute token masks and advance grammars
    /// (default: one per core, at most 8).
    pub mask_threads: Option<usize>,
    /// `MLXCEL_GEMV_SOURCE`: a dense GEMV kernel file read at run time instead of the
    /// embedded one.
    pub gemv_source: Option<PathBuf>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            qgemv: true,
            qgemv_xq: true,
            qgemv_f16: true,
            qgemv_mma: None,
            qgemv_chunks: true,
            qgemv_stream: true,
            qgemv_mlp: false,
            qgemv_mlp_rows2: None,
            qgemv_mlp_bounded: false,
            qgemv_stream_blocks: None,
            qgemv_source: None,
            qgemm: true,
            qgemm_min_m: None,
            qgemm_max_m: None,
            qgemm_splitk: None,
            qgemm_ring_bytes: None,
            qgemm_source: None,
            qgemm_bounded: false,
            qgemm_fill: false,
            qgemm_wide: true,
            qgemm_wgmma: true,
            kernel_include: true,
            attn: true,
            attn_single: false,
            attn_all_splits: false,
            attn_source: None,
            kernel_cache: true,
            vocab_parallel: true,
            addmm_residual: false,
            kernel_reuse: true,
            gemv_dense: true,
            gemv_wide: true,
            gemv_mma: None,
            gemv_mma_max: None,
            gemv_mma_kv: true,
            qkv_bias: true,
            qk_rope: true,
            device_inputs: true,
            step_staging: true,
            device_consts: true,
            kv_fused: true,
            pool_view: true,
            forget_view: true,
            fused_step: false,
            tp_residual: false,
            warm_background: false,
            nvrtc_processes: true,
            defer_masks: false,
            sample_first: true,
            mask_threads: None,
            gemv_source: None,
        }
    }
}

/// The variables [`Knobs`] reads, in the order docs/tuning.md lists them.
pub const VARS: &[&str] = &[
    "MLXCEL_QGEMV",
    "MLXCEL_QGEMV_XQ",
    "MLXCEL_QGEMV_F16",
    "MLXCEL_QGEMV_MMA",
    "MLXCEL_QGEMV_CHUNKS",
    "MLXCEL_QGEMV_STREAM",
    "MLXCEL_QGEMV_STREAM_BLOCKS",
    "MLXCEL_QGEMV_MLP",
    "MLXCEL_QGEMV_MLP_ROWS2",
    "MLXCEL_QGEMV_MLP_BOUNDED",
    "MLXCEL_QGEMV_SOURCE",
    "MLXCEL_QGEMM",
    "MLXCEL_QGEMM_MIN_M",
    "MLXCEL_QGEMM_MAX_M",
    "MLXCEL_QGEMM_SPLITK",
    "MLXCEL_QGEMM_RING_BYTES",
    "MLXCEL_QGEMM_SOURCE",
    "MLXCEL_QGEMM_BOUNDED",
    "MLXCEL_QGEMM_WIDE",
    "MLXCEL_QGEMM_WGMMA",
    "MLXCEL_KERNEL_INCLUDE",
    "MLXCEL_ATTN",
    "MLXCEL_ATTN_SINGLE",
    "MLXCEL_ATTN_ALL_SPLITS",
    "MLXCEL_ATTN_SOURCE",
    "MLXCEL_KERNEL_CACHE",
    "MLXCEL_VOCAB_PARALLEL",
    "MLXCEL_ADDMM_RESIDUAL",
    "MLXCEL_KERNEL_REUSE",
    "MLXCEL_GEMV_DENSE",
    "MLXCEL_GEMV_WIDE",
    "MLXCEL_GEMV_MMA",
    "MLXCEL_GEMV_MMA_MAX",
    "MLXCEL_GEMV_MMA_KV",
    "MLXCEL_QKV_BIAS",
    "MLXCEL_QK_ROPE",
    "MLXCEL_DEVICE_INPUTS",
    "MLXCEL_STEP_STAGING",
    "MLXCEL_DEVICE_CONSTS",
    "MLXCEL_KV_FUSED",
    "MLXCEL_POOL_VIEW",
    "MLXCEL_FORGET_VIEW",
    "MLXCEL_FUSED_STEP",
    "MLXCEL_TP_RESIDUAL",
    "MLXCEL_WARM_BACKGROUND",
    "MLXCEL_NVRTC_PROCESSES",
    "MLXCEL_GEMV_SOURCE",
    "MLXCEL_DEFER_MASKS",
    "MLXCEL_SAMPLE_FIRST",
    "MLXCEL_MASK_THREADS",
];

/// Where an on/off knob keeps its value.
type Field = fn(&mut Knobs) -> &mut bool;

/// The on/off knobs: each variable and its field, in the order they are parsed and listed.
const SWITCHES: &[(&str, Field)] = &[
    ("MLXCEL_QGEMV", |k| &mut k.qgemv),
    ("MLXCEL_QGEMV_XQ", |k| &mut k.qgemv_xq),
    ("MLXCEL_QGEMV_F16", |k| &mut k.qgemv_f16),
    ("MLXCEL_QGEMV_CHUNKS", |k| &mut k.qgemv_chunks),
    ("MLXCEL_QGEMV_STREAM", |k| &mut k.qgemv_stream),
    ("MLXCEL_QGEMV_MLP", |k| &mut k.qgemv_mlp),
    ("MLXCEL_QGEMV_MLP_BOUNDED", |k| &mut k.qgemv_mlp_bounded),
    ("MLXCEL_QGEMM", |k| &mut k.qgemm),
    ("MLXCEL_QGEMM_BOUNDED", |k| &mut k.qgemm_bounded),
    ("MLXCEL_QGEMM_FILL", |k| &mut k.qgemm_fill),
    ("MLXCEL_QGEMM_WIDE", |k| &mut k.qgemm_wide),
    ("MLXCEL_QGEMM_WGMMA", |k| &mut k.qgemm_wgmma),
    ("MLXCEL_KERNEL_INCLUDE", |k| &mut k.kernel_include),
    ("MLXCEL_ATTN", |k| &mut k.attn),
    ("MLXCEL_ATTN_SINGLE", |k| &mut k.attn_single),
    ("MLXCEL_ATTN_ALL_SPLITS", |k| &mut k.attn_all_splits),
    ("MLXCEL_KERNEL_CACHE", |k| &mut k.kernel_cache),
    ("MLXCEL_VOCAB_PARALLEL", |k| &mut k.vocab_parallel),
    ("MLXCEL_ADDMM_RESIDUAL", |k| &mut k.addmm_residual),
    ("MLXCEL_KERNEL_REUSE", |k| &mut k.kernel_reuse),
    ("MLXCEL_GEMV_DENSE", |k| &mut k.gemv_dense),
    ("MLXCEL_GEMV_WIDE", |k| &mut k.gemv_wide),
    ("MLXCEL_GEMV_MMA_KV", |k| &mut k.gemv_mma_kv),
    ("MLXCEL_QKV_BIAS", |k| &mut k.qkv_bias),
    ("MLXCEL_QK_ROPE", |k| &mut k.qk_rope),
    ("MLXCEL_DEVICE_INPUTS", |k| &mut k.device_inputs),
    ("MLXCEL_STEP_STAGING", |k| &mut k.step_staging),
    ("MLXCEL_DEVICE_CONSTS", |k| &mut k.device_consts),
    ("MLXCEL_KV_FUSED", |k| &mut k.kv_fused),
    ("MLXCEL_POOL_VIEW", |k| &mut k.pool_view),
    ("MLXCEL_FORGET_VIEW", |k| &mut k.forget_view),
    ("MLXCEL_FUSED_STEP", |k| &mut k.fused_step),
    ("MLXCEL_TP_RESIDUAL", |k| &mut k.tp_residual),
    ("MLXCEL_WARM_BACKGROUND", |k| &mut k.warm_background),
    ("MLXCEL_NVRTC_PROCESSES", |k| &mut k.nvrtc_processes),
    ("MLXCEL_DEFER_MASKS", |k| &mut k.defer_masks),
    ("MLXCEL_SAMPLE_FIRST", |k| &mut k.sample_first),
];

/// A tuning variable with a value it cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment variable {var}={value:?}: {expected}")]
pub struct KnobError {
    pub var: &'static str,
    pub value: String,
    pub expected: String,
}

impl Knobs {
    /// Parse the knobs from `get(name)` (the environment, or a test's map). Unset and
    /// empty variables keep their defaults.
    pub fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Result<Knobs, KnobError> {
        let mut k = Knobs::default();
        let text = |var: &'static str| -> Result<Option<String>, KnobError> {
            match get(var) {
                None => Ok(None),
                Some(v) => match v.into_string() {
                    Ok(s) if s.trim().is_empty() => Ok(None),
                    Ok(s) => Ok(Some(s.trim().to_string())),
                    Err(v) => Err(KnobError {
                        var,
                        value: v.to_string_lossy().into_owned(),
                        expected: "not valid UTF-8".into(),
                    }),
                },
            }
        };
        let switch = |var: &'static str, default: bool| -> Result<bool, KnobError> {
            match text(var)?.as_deref() {
                None => Ok(default),
                Some("0") => Ok(false),
                Some("1") => Ok(true),
                Some(v) => Err(KnobError {
                    var,
                    value: v.into(),
                    expected: "expected 0 (off) or 1 (on)".into(),
                }),
            }
        };
        let number = |var: &'static str, range: std::ops::RangeInclusive<usize>, what: &str| {
            match text(var)? {
                None => Ok(None),
                Some(v) => match v.parse::<usize>() {
                    Ok(n) if range.contains(&n) => Ok(Some(n)),
                    _ => Err(KnobError {
                        var,
                        value: v,
                        expected: format!("expected {what} {}-{}", range.start(), range.end()),
                    }),
                },
            }
        };
        for (var, field) in SWITCHES {
            let f = field(&mut k);
            *f = switch(var, *f)?;
        }
        k.qgemv_mma = number(
            "MLXCEL_QGEMV_MMA",
            0..=super::qgemv::MAX_M,
            "0 (off) or the smallest batch on the tensor cores,",
        )?;
        k.qgemv_stream_blocks = number("MLXCEL_QGEMV_STREAM_BLOCKS", 1..=65535, "a block count")?;
        k.qgemv_mlp_rows2 = number("MLXCEL_QGEMV_MLP_ROWS2", 1..=32, "rows per block")?;
        k.qgemv_source = get("MLXCEL_QGEMV_SOURCE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        let batch = 2..=super::qgemm::MAX_M;
        k.qgemm_min_m = number("MLXCEL_QGEMM_MIN_M", batch.clone(), "a batch size")?;
        k.qgemm_max_m = number("MLXCEL_QGEMM_MAX_M", batch, "a batch size")?;
        k.qgemm_splitk = number(
            "MLXCEL_QGEMM_SPLITK",
            1..=super::qgemm::SPLITS_LIMIT,
            "a number of splits",
        )?;
        k.qgemm_ring_bytes = number(
            "MLXCEL_QGEMM_RING_BYTES",
            16_384..=232_448,
            "a byte count (an SM's shared memory at most),",
        )?;
        k.qgemm_source = get("MLXCEL_QGEMM_SOURCE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        k.mask_threads = number("MLXCEL_MASK_THREADS", 1..=256, "a thread count")?;
        k.gemv_mma = number(
            "MLXCEL_GEMV_MMA",
            0..=super::gemv::MMA_MAX_M,
            "0 (off) or the smallest batch on the tensor cores,",
        )?;
        k.gemv_mma_max = number(
            "MLXCEL_GEMV_MMA_MAX",
            1..=super::gemv::MMA_MAX_M,
            "the largest batch on the tensor cores,",
        )?;
        k.gemv_source = get("MLXCEL_GEMV_SOURCE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        k.attn_source = get("MLXCEL_ATTN_SOURCE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        Ok(k)
    }

    /// `VAR=value` of every knob that differs from its default.
    pub fn non_default(&self) -> Vec<String> {
        let mut out = Vec::new();
        let (mut me, mut d) = (self.clone(), Knobs::default());
        for (var, field) in SWITCHES {
            let v = *field(&mut me);
            if v != *field(&mut d) {
                out.push(format!("{var}={}", u8::from(v)));
            }
        }
        if let Some(n) = self.qgemv_mma {
            out.push(format!("MLXCEL_QGEMV_MMA={n}"));
        }
        if let Some(n) = self.qgemv_stream_blocks {
            out.push(format!("MLXCEL_QGEMV_STREAM_BLOCKS={n}"));
        }
        if let Some(n) = self.qgemv_mlp_rows2 {
            out.push(format!("MLXCEL_QGEMV_MLP_ROWS2={n}"));
        }
        if let Some(p) = &self.qgemv_source {
            out.push(format!("MLXCEL_QGEMV_SOURCE={}", p.display()));
        }
        for (var, v) in [
            ("MLXCEL_QGEMM_MIN_M", self.qgemm_min_m),
            ("MLXCEL_QGEMM_MAX_M", self.qgemm_max_m),
            ("MLXCEL_QGEMM_SPLITK", self.qgemm_splitk),
            ("MLXCEL_QGEMM_RING_BYTES", self.qgemm_ring_bytes),
            ("MLXCEL_MASK_THREADS", self.mask_threads),
            ("MLXCEL_GEMV_MMA", self.gemv_mma),
            ("MLXCEL_GEMV_MMA_MAX", self.gemv_mma_max),
        ] {
            if let Some(n) = v {
                out.push(format!("{var}={n}"));
            }
        }
        if let Some(p) = &self.qgemm_source {
            out.push(format!("MLXCEL_QGEMM_SOURCE={}", p.display()));
        }
        if let Some(p) = &self.gemv_source {
            out.push(format!("MLXCEL_GEMV_SOURCE={}", p.display()));
        }
        if let Some(p) = &self.attn_source {
            out.push(format!("MLXCEL_ATTN_SOURCE={}", p.display()));
        }
        out
    }
}

fn parsed() -> &'static Result<Knobs, KnobError> {
    static KNOBS: OnceLock<Result<Knobs, KnobError>> = OnceLock::new();
    KNOBS.get_or_init(|| {
        let k = Knobs::from_lookup(|v| std::env::var_os(v));
        if let Ok(k) = &k {
            mlx::fast::set_kernel_reuse(k.kernel_reuse);
            mlx::device_inputs::set_staging(k.step_staging);
        }
        k
    })
}

/// Parse the knobs (once) and log the non-default ones at debug level; a bad value is
/// an error naming the variable. Binaries call it at start-up.
pub fn check() -> Result<&'static Knobs, KnobError> {
    let k = parsed().as_ref().map_err(Clone::clone)?;
    for kv in k.non_default() {
        tracing::debug!("tuning knob {kv}");
    }
    Ok(k)
}

/// The knobs the kernels run with. Where [`check`] was not called and a value is bad
/// (library use), the defaults, with a warning once.
pub fn get() -> &'static Knobs {
    static DEFAULTS: OnceLock<Knobs> = OnceLock::new();
    match parsed() {
        Ok(k) => k,
        Err(e) => DEFAULTS.get_or_init(|| {
            tracing::warn!("{e}; using the default kernel settings");
            Knobs::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Knobs, KnobError> {
        let m: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        Knobs::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn unset_and_empty_keep_the_defaults() {
        assert_eq!(parse(&[]).unwrap(), Knobs::default());
        assert_eq!(parse(&[("MLXCEL_QGEMV", " ")]).unwrap(), Knobs::default());
        assert!(Knobs::default().non_default().is_empty());
    }

    #[test]
    fn values_are_parsed_and_listed() {
        let k = parse(&[
            ("MLXCEL_QGEMV", "0"),
            ("MLXCEL_QGEMV_MMA", " 1 "),
            ("MLXCEL_QGEMV_STREAM_BLOCKS", "396"),
            ("MLXCEL_ATTN", "1"),
            ("MLXCEL_QGEMV_SOURCE", "/tmp/k.cu"),
        ])
        .unwrap();
        assert!(!k.qgemv && k.attn);
        assert_eq!((k.qgemv_mma, k.qgemv_stream_blocks), (Some(1), Some(396)));
        assert_eq!(
            k.non_default(),
            vec![
                "MLXCEL_QGEMV=0",
                "MLXCEL_QGEMV_MMA=1",
                "MLXCEL_QGEMV_STREAM_BLOCKS=396",
                "MLXCEL_QGEMV_SOURCE=/tmp/k.cu"
            ]
        );
        assert_eq!(
            parse(&[("MLXCEL_QGEMV_MMA", "0")]).unwrap().qgemv_mma,
            Some(0)
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (var, value) in [
            ("MLXCEL_QGEMV", "off"),
            ("MLXCEL_ATTN", "2"),
            ("MLXCEL_QGEMV_MMA", "9"),
            ("MLXCEL_QGEMV_MMA", "x"),
            ("MLXCEL_QGEMV_STREAM_BLOCKS", "0"),
            ("MLXCEL_QGEMV_STREAM_BLOCKS", "70000"),
            ("MLXCEL_KERNEL_INCLUDE", "no"),
            ("MLXCEL_ADDMM_RESIDUAL", "yes"),
            ("MLXCEL_GEMV_DENSE", "off"),
            ("MLXCEL_KERNEL_REUSE", "2"),
            ("MLXCEL_QGEMM", "yes"),
            ("MLXCEL_QGEMM_MIN_M", "1"),
            ("MLXCEL_QGEMM_MAX_M", "129"),
            ("MLXCEL_QGEMM_SPLITK", "0"),
            ("MLXCEL_QGEMM_RING_BYTES", "1000"),
            ("MLXCEL_GEMV_MMA", "17"),
            ("MLXCEL_GEMV_MMA_MAX", "0"),
        ] {
            let e = parse(&[(var, value)]).unwrap_err();
            assert_eq!(e.var, var);
            let m = e.to_string();
            assert!(m.contains(var) && m.contains(value), "{m}");
        }
    }

    #[test]
    fn every_listed_variable_is_read() {
        // each variable, set to a value its parser refuses or that is not the default,
        // changes the result: none is listed without being read
        for var in VARS {
            let v = if var.ends_with("_SOURCE") {
                "/x"
            } else {
                "bad"
            };
            let changed = match parse(&[(var, v)]) {
                Err(e) => e.var == *var,
                Ok(k) => k != Knobs::default(),
            };
            assert!(changed, "{var} is listed but not read");
        }
    }
}
