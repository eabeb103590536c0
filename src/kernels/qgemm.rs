//! mlxcel's quantized GEMM (`kernels/qgemm.cu`): `x · dequantize(w)ᵀ` for batches of
//! [`MIN_M`]–[`MAX_M`] rows (a server's concurrent streams, short prompts) on MLX's CUDA
//! backend, reading each weight once per call where the GEMV ([`super::qgemv`], up to 8 rows
//! a launch) reads it once per chunk of 8 rows. 4- and 8-bit weights in groups of 32, 64 or
//! 128, bf16 or f16 activations, with the GEMV's fusions: RMSNorm of x, the residual add,
//! SwiGLU of a merged gate/up weight, RoPE on q and k of a merged q/k/v weight.
//!
//! On by default on CUDA for the batches where it measured faster than the other paths
//! (8B shape: 8-bit from 5 rows on an H100, 4-bit from 17 on an H200;
//! `scripts/gpu/qgemm.sh bench`, docs/benchmarks.md "Quantized GEMM"); `MLXCEL_QGEMM=0`
//! keeps the GEMV on row chunks and MLX's kernels. `MLXCEL_QGEMM_SOURCE=path` loads
//! another kernel file at run time.
use std::cell::RefCell;
use std::sync::OnceLock;

use super::gemv::{split_source, Source, ROPE_MARK};
use super::qgemv::{self, check_rope_inputs, fnv1a32, header_for_mlx, norm_input, Epilogue};
use super::{gpu, knobs};
use crate::mlx::fast::CudaKernel;
use crate::mlx::{self, Array, Backend, Dtype, MlxError, Result};

/// Smallest batch of 8-bit weights the GEMM takes by default: from 5 rows, where the GEMV
/// (its tensor-core path) was half as fast at batch 8 on an H100 (8B 8-bit g64: 523-529
/// against 1,039-1,060 tok/s, bf16 793); batches of up to 4 stay on the GEMV.
pub const MIN_M: usize = 5;
/// Smallest batch of 4-bit weights the GEMM takes by default: at 16 rows the GEMV's two row
/// chunks decoded 7% faster on an H200 (8B, 1,985 against 1,854 tok/s), from 24 rows the
/// GEMM (2,609 against 2,282; 8-bit was faster with the GEMM from 16 rows).
pub const MIN_M_4BIT: usize = 17;
/// Largest batch the kernel covers (16 tiles of 8 rows); longer inputs (prefill) keep
/// dequantize + GEMM.
pub const MAX_M: usize = 128;
/// Most splits of K per column block by default (`MLXCEL_QGEMM_SPLITK` sets another).
pub const MAX_SPLITS: usize = 16;
/// Largest value `MLXCEL_QGEMM_SPLITK` takes.
pub const SPLITS_LIMIT: usize = 64;
/// Fewest steps of 128 values a split of K takes.
pub const MIN_SPLIT_STEPS: usize = 2;
/// Shared memory the ring of a block takes at most, in bytes: two such blocks and their
/// [`block_shared_overhead`] (at most 1,568 bytes) fit an sm_90 SM's 228 KB; 4-bit at 32
/// rows, 6 stages of 18,688 bytes. (114 KB let 8-bit at 40 rows take 4 stages of 28,928
/// bytes, and then only one block fit an SM.)
pub const RING_BYTES: usize = 115_072;
/// Stages of the ring: at least 2 (one step in flight while one is multiplied), at most 6.
pub const MIN_STAGES: usize = 2;
pub const MAX_STAGES: usize = 6;

/// Shared memory a block of `mt` batch rows takes besides the ring: the 1 KB the driver
/// reserves per block (sm_80 on), Σ x² per batch row and a flag, rounded up.
pub fn block_shared_overhead(mt: usize) -> usize {
    1024 + 4 * mt + 32
}
/// Largest variant (batch rows) `MLXCEL_QGEMM_BOUNDED` compiles for 128 registers: at 64
/// rows the accumulators no longer fit without spilling (ptxas for sm_90a).
pub const BOUNDED_MAX_M: usize = 32;
/// Put before the kernel file's header for the bounded flavour (`MLXCEL_QGEMM_BOUNDED`):
/// the `__global__` function MLX generates after it is declared for two resident blocks
/// of up to 256 threads an SM, so the compiler keeps to 128 registers a thread. (MLX
/// writes the signature itself, so the attribute comes in through `__global__`; only
/// device compilation sees it, the CPU emulation compiles the file as it is.)
pub const BOUNDED_PREFIX: &str = "#define MLXCEL_QGEMM_BOUNDED 1\n\
#if defined(__CUDA_ARCH__)\n#undef __global__\n\
#define __global__ __location__(global) __launch_bounds__(256, 2)\n#endif\n";

/// Put before the kernel file's header for the warpgroup-MMA flavour (`MLXCEL_QGEMM_WGMMA`,
/// [`Launch::wgmma`]): blocks of whole warpgroups multiply with Hopper's `wgmma`, x read by the
/// tensor cores from the stage (the kernel file's `WG`); GPUs without it (the kernel compiled
/// for another architecture) run the file's `mma.sync` path.
pub const WGMMA_PREFIX: &str = "#define MLXCEL_QGEMM_WGMMA 1\n";

/// Largest variant (batch rows) the wgmma flavour runs.
pub const WGMMA_MAX_M: usize = 64;

const EMBEDDED: &str = include_str!("../../kernels/qgemm.cu");

/// `mlxcel_qgemm_<FNV-1a of the GEMV's header and this source, 32 bits>` (MLX caches
/// compiled kernels by name; `scripts/check_qgemm.py` names it the same way). The file has
/// the dense GEMV's layout (a header, `@@body`, `@@body_rope`), so it is split as that one is.
pub fn kernel_name(src: &Source, gemv_header: &str) -> String {
    let h = fnv1a32(&[
        gemv_header,
        &src.header,
        &src.body,
        ROPE_MARK,
        &src.body_rope,
    ]);
    format!("mlxcel_qgemm_{h:08x}")
}

fn source() -> Result<&'static Source> {
    static SOURCE: OnceLock<std::result::Result<Source, String>> = OnceLock::new();
    SOURCE
        .get_or_init(|| match &knobs::get().qgemm_source {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| {
                    format!(
                        "MLXCEL_QGEMM_SOURCE={}: cannot read it: {e}",
                        path.display()
                    )
                })
                .and_then(|t| {
                    split_source(&t)
                        .map_err(|e| format!("MLXCEL_QGEMM_SOURCE={}: {e}", path.display()))
                }),
            None => split_source(EMBEDDED).map_err(|e| format!("embedded kernels/qgemm.cu: {e}")),
        })
        .as_ref()
        .map_err(|e| MlxError::Invalid(e.clone()))
}

/// The plain kernel's name and the RoPE entry point's (`<name>_rope`), and the header MLX
/// gets: the GEMV's device code, then the GEMM's (an `#include` of a cached file holding
/// both, see [`header_for_mlx`]) for launch `l`'s flavour: the flavour compiled for 128
/// registers (`l.bounded`, [`BOUNDED_PREFIX`] first) or the warpgroup-MMA one (`l.wgmma`,
/// [`WGMMA_PREFIX`]): another source each, so another name.
fn kernel(l: &Launch) -> Result<&'static (String, String, String)> {
    type Made = OnceLock<std::result::Result<(String, String, String), String>>;
    static KERNEL: [Made; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let (i, prefix) = match (l.bounded, l.wgmma) {
        (true, _) => (1, BOUNDED_PREFIX),
        (false, true) => (2, WGMMA_PREFIX),
        (false, false) => (0, ""),
    };
    KERNEL[i]
        .get_or_init(|| {
            let (src, gemv) = match (source(), qgemv::header()) {
                (Ok(s), Ok(g)) => (s, g),
                (Err(e), _) | (_, Err(e)) => return Err(e.to_string()),
            };
            let flavour;
            let src = if prefix.is_empty() {
                src
            } else {
                flavour = Source {
                    header: format!("{prefix}{}", src.header),
                    ..src.clone()
                };
                &flavour
            };
            let name = kernel_name(src, gemv);
            let header = header_for_mlx(&name, &format!("{gemv}{}", src.header));
            Ok((name.clone(), name + "_rope", header))
        })
        .as_ref()
        .map_err(|e| MlxError::Invalid(e.clone()))
}

/// Whether the GEMM is used: `MLXCEL_QGEMM` not 0, MLX's CUDA backend, a GPU with bf16 MMAs.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        knobs::get().qgemm && mlx::backend() == Backend::Cuda && gpu::this_gpu().has_bf16_mma()
    })
}

/// The batch rows the GEMM takes for `bits`-bit weights (`MLXCEL_QGEMM_MIN_M`,
/// `MLXCEL_QGEMM_MAX_M`; by default [`MIN_M`] or, at 4 bits, [`MIN_M_4BIT`] to [`MAX_M`]);
/// `None`: any bits (from the smallest default).
fn batches(bits: Option<usize>) -> std::ops::RangeInclusive<usize> {
    let k = knobs::get();
    let lo = k.qgemm_min_m.unwrap_or(default_min_rows(bits));
    lo..=k.qgemm_max_m.unwrap_or(MAX_M)
}

/// The default smallest batch for `bits`-bit weights (`None`: any).
fn default_min_rows(bits: Option<usize>) -> usize {
    match bits {
        Some(4) => MIN_M_4BIT,
        _ => MIN_M,
    }
}

/// Whether the kernel covers `x [m, k] · w [n, k]ᵀ` with these bits, group and dtypes
/// (besides [`enabled`]): a batch in range, 4 or 8 bits in groups of 32/64/128, k a
/// multiple of 128, bf16 or f16 activations with scales of the same type.
pub fn supports(
    m: usize,
    n: usize,
    k: usize,
    group: usize,
    bits: usize,
    dtypes: [Dtype; 2],
) -> bool {
    batches(Some(bits)).contains(&m)
        && shape_fits(n, k, group, bits)
        && dtypes_fit(dtypes)
        && launch_fits(m, bits)
}

/// Whether the launch for these rows fits this GPU's shared memory (without a GPU, one
/// MLX did not describe, the kernel is not used: true). Its blocks' shape decides it, not
/// the split of K (which `supports`, asked per product, need not search).
fn launch_fits(m: usize, bits: usize) -> bool {
    let g = gpu::this_gpu();
    g.cc.is_none() || this_plan().shape(m, bits).fits(g.shared_memory_per_sm())
}

fn shape_fits(n: usize, k: usize, group: usize, bits: usize) -> bool {
    matches!(bits, 4 | 8)
        && matches!(group, 32 | 64 | 128)
        && n > 0
        && k > 0
        && k.is_multiple_of(128)
        && k.is_multiple_of(group)
}

fn dtypes_fit(dtypes: [Dtype; 2]) -> bool {
    matches!(
        dtypes,
        [Dtype::BF16, Dtype::BF16] | [Dtype::F16, Dtype::F16]
    )
}

/// Whether [`Epilogue::SwiGlu`] fits a merged gate/up weight of `n` rows: pairs of rows.
pub fn supports_swiglu(n: usize) -> bool {
    n.is_multiple_of(2)
}

/// Whether [`qgemm_rope`] covers a merged q/k/v weight of `n` rows for `nq` query heads of
/// `head_dim`: whole heads, as many key as value heads.
pub fn supports_rope(n: usize, nq: usize, head_dim: usize) -> bool {
    head_dim > 0
        && head_dim.is_multiple_of(2)
        && n.is_multiple_of(head_dim)
        && n / head_dim > nq
        && (n / head_dim - nq).is_multiple_of(2)
}

/// A launch: `mt` batch rows (M rounded up to the variant's tiles of 8), `wr` × `wn` warps
/// (each 32 weight rows and `mt / 8 / wn` tiles of 8 batch rows), `sk` splits of K,
/// `st` stages of the shared-memory ring (`st - 1` steps of 128 values in flight), and
/// `bits` of the weights (which, with `mt`, size a stage).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub mt: usize,
    pub wr: usize,
    pub wn: usize,
    pub sk: usize,
    pub st: usize,
    pub bits: usize,
    /// The flavour compiled for 128 registers a thread ([`BOUNDED_PREFIX`]).
    pub bounded: bool,
    /// The warpgroup-MMA flavour ([`WGMMA_PREFIX`]): blocks of whole warpgroups, one warp
    /// per row of tiles ([`Plan::wgmma`]).
    pub wgmma: bool,
}

/// The buffer a block of `rows` weight rows keeps after the ring for the scales and biases
/// of several steps at a time (`mlxcel_qgemm`'s SBUF16 chunks: two slots of 32 bytes a row
/// and kind), from 256 rows; none for narrower blocks.
pub fn scale_block_bytes(rows: usize) -> usize {
    match rows >= 256 {
        true => 128 * rows,
        false => 0,
    }
}

/// Bytes of one stage of the ring (`mlxcel_qgemm`'s STAGE16 chunks of 16 bytes): a step of
/// `32·wr` weight rows at `bits`, `mt` rows of x and the norm weight, 128 values each, and
/// a chunk a weight row for the step's scales and biases.
pub fn stage_bytes(mt: usize, wr: usize, bits: usize) -> usize {
    16 * (32 * wr * bits + mt * 16 + 16 + 32 * wr)
}

impl Launch {
    /// The launch's dynamic shared memory: the ring's `st` stages, then the scale blocks'
    /// buffer ([`Launch::scale_block_bytes`]).
    pub fn shared_memory(&self) -> usize {
        self.st * stage_bytes(self.mt, self.wr, self.bits) + self.scale_block_bytes()
    }
    /// The scale blocks' buffer ([`scale_block_bytes`]).
    pub fn scale_block_bytes(&self) -> usize {
        scale_block_bytes(self.rows())
    }
    /// Whether a block's shared memory fits an SM of `smem` bytes (with the driver's 1 KB):
    /// not 8-bit launches of 128 rows on 100 KB an SM (sm_86, sm_89), which go elsewhere.
    pub fn fits(&self, smem: usize) -> bool {
        self.shared_memory() + block_shared_overhead(self.mt) <= smem
    }
    /// Weight rows per block.
    pub fn rows(&self) -> usize {
        32 * self.wr
    }
    /// Threads per block.
    pub fn threads(&self) -> usize {
        32 * self.wr * self.wn
    }
    /// Column blocks of an `n`-row weight (the grid is these × `sk`).
    pub fn column_blocks(&self, n: usize) -> usize {
        n.div_ceil(self.rows())
    }
    /// f32 scratch the split-K reduction takes for an `n`-row weight: every column block's
    /// tile (its splits' sum, in its threads' register order), then every block's Σ x² per
    /// batch row; made as large as a tile for every block, the layout of kernel files before
    /// the sum in place, so that those still run through `MLXCEL_QGEMM_SOURCE` for A/B timings.
    pub fn scratch_floats(&self, n: usize) -> usize {
        if self.sk < 2 {
            return 0;
        }
        let tile = 2 * (self.mt / 8 / self.wn) * 4 * self.threads();
        self.column_blocks(n) * self.sk * (tile + self.mt)
    }
}

/// The batch rows of the variant that runs `m` rows: whole tiles of 8, an even number of
/// them above 8 tiles (two warps share them out).
pub fn variant_rows(m: usize) -> usize {
    let mut nt = m.div_ceil(8).max(1);
    if nt > 8 {
        nt += nt % 2;
    }
    8 * nt
}

/// Every variant's batch rows from `lo` to `hi` rows (what a warm-up runs to compile them).
pub fn variants(lo: usize, hi: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (lo.max(1)..=hi.min(MAX_M)).map(variant_rows).collect();
    v.dedup();
    v
}

/// Batch sizes from `lo` to `hi` rows, one in each of the GEMM's variants there (the
/// variant's rows, or `hi` for the last): what a warm-up runs so that MLX compiles them at
/// start-up. Empty when the GEMM is off.
pub fn warm_rows(lo: usize, hi: usize) -> Vec<usize> {
    if !enabled() {
        return Vec::new();
    }
    let r = batches(None);
    variants(lo.max(*r.start()), hi.min(*r.end()))
        .into_iter()
        .map(|v| v.min(hi))
        .collect()
}

/// The launch for `m` rows of a `[n, k]` weight on this machine (see [`launch_for`]).
pub fn launch_config(m: usize, n: usize, k: usize, bits: usize) -> Launch {
    let plan = this_plan();
    // the bounded flavour's blocks are narrow, 256 threads (its launch bounds), where it
    // has one
    if knobs::get().qgemm_bounded {
        let b = bounded(
            Plan {
                wide: false,
                ..plan
            }
            .launch(m, n, k, bits),
        );
        if b.bounded {
            return b;
        }
    }
    plan.launch(m, n, k, bits)
}

/// What this machine's launches are planned for (the GPU, the knobs).
fn this_plan() -> Plan {
    let g = gpu::this_gpu();
    Plan {
        sms: g.sms.unwrap_or(gpu::DEFAULT_SMS),
        smem: g.shared_memory_per_sm(),
        max_splits: knobs::get().qgemm_splitk.unwrap_or(MAX_SPLITS),
        fill: knobs::get().qgemm_fill,
        wide: knobs::get().qgemm_wide,
        wgmma: knobs::get().qgemm_wgmma && g.cc == Some(90),
        ring: knobs::get().qgemm_ring_bytes.unwrap_or(RING_BYTES),
    }
}

/// Warps a block has: 8 (256 weight rows a block up to 64 batch rows, two warps per row of
/// tiles above). x, staged in shared memory, is read from L2 once per block and step, so
/// fewer rows per block read it more often: with 128 weight rows a block (4 warps) the L2
/// was the busiest unit (Nsight on an H100: 59-61% of its throughput at 32 and 64 rows,
/// DRAM 16-24%), and 256 took 13-27% off every 8B product at 32 and 64 rows (gate/up at 64
/// rows 117.4 → 94.4 µs). Such a block holds an SM alone (164-254 registers a thread).
pub const BLOCK_WARPS: usize = 8;
/// Warps over a block's weight rows in a narrow launch (`MLXCEL_QGEMM_WIDE=0`, for A/B
/// runs; above 64 batch rows; the bounded flavour): 4 (128 weight rows), two warps per row
/// of tiles above 64 batch rows.
pub const NARROW_BLOCK_WARPS: usize = 4;

/// What [`Plan::launch`] plans for: the GPU's SMs and shared memory per SM, the most splits
/// of K, the rule splitting it and how wide a block is.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub sms: usize,
    pub smem: usize,
    pub max_splits: usize,
    /// K split over the fewest blocks that fill every slot the SMs hold (the most splits
    /// allowed where none does): the rule before [`split_cost`].
    pub fill: bool,
    /// [`BLOCK_WARPS`] a block, or (false) [`NARROW_BLOCK_WARPS`] over its weight rows.
    pub wide: bool,
    /// Wide blocks of up to [`WGMMA_MAX_M`] rows in the warpgroup-MMA flavour
    /// (`MLXCEL_QGEMM_WGMMA`, Hopper: sm_90): all of a block's batch rows in one `wgmma` a
    /// tile (or one per binary digit of the rows).
    pub wgmma: bool,
    /// Bytes the ring of stages may take ([`RING_BYTES`]; `MLXCEL_QGEMM_RING_BYTES`).
    pub ring: usize,
}

/// The default launch of `m` rows of a `[n, k]` weight on a GPU of `sms` SMs with `smem`
/// bytes of shared memory each (see [`Plan::launch`]).
pub fn launch_for(
    m: usize,
    n: usize,
    k: usize,
    bits: usize,
    sms: usize,
    smem: usize,
    max_splits: usize,
) -> Launch {
    Plan {
        sms,
        smem,
        max_splits,
        fill: false,
        wide: true,
        wgmma: false,
        ring: RING_BYTES,
    }
    .launch(m, n, k, bits)
}

impl Plan {
    /// One warp per row of tiles up to 8 tiles of batch rows and two above (64 accumulators a
    /// lane either way); [`BLOCK_WARPS`] a block (`wide`) or [`NARROW_BLOCK_WARPS`] over the
    /// weight rows. The ring gets as many stages as [`RING_BYTES`] (and the SM's `smem` bytes
    /// less 1 KB and the scale blocks' buffer) hold, from [`MIN_STAGES`] to [`MAX_STAGES`]:
    /// wide, 4-bit 4, 3, 3, 2 stages at 16, 32, 64, 128 rows and 8-bit 2; narrow 6, 6, 4, 2
    /// and 5, 4, 3, 2. K is split (dividing the row's steps, at least [`MIN_SPLIT_STEPS`]
    /// each, at most `max_splits`) as [`split_cost`] finds cheapest. `scripts/check_qgemm.py
    /// --sweep` times others.
    pub fn launch(&self, m: usize, n: usize, k: usize, bits: usize) -> Launch {
        let l = self.shape(m, bits);
        // blocks an SM holds: a block of 8 warps holds one alone by its registers (ptxas,
        // sm_90a: 164-254 a thread, 207-210 above 64 rows, where 128 would let two in);
        // smaller blocks by shared memory
        let per_sm = match l.threads() >= 32 * BLOCK_WARPS {
            true => 1,
            false => (self.smem / (l.shared_memory() + block_shared_overhead(l.mt))).max(1),
        };
        let cb = l.column_blocks(n).max(1);
        let steps = k / 128;
        let slots = self.sms * per_sm;
        let sk = (1..=steps)
            .filter(|&d| {
                steps.is_multiple_of(d)
                    && (d == 1 || steps / d >= MIN_SPLIT_STEPS)
                    && d <= self.max_splits
            })
            .min_by_key(|&d| match self.fill {
                // the fewest splits that fill every slot, else the most
                true if d >= slots.div_ceil(cb) => (0, d),
                true => (1, usize::MAX - d),
                false => (split_cost(cb, steps, d, slots), d),
            })
            .unwrap_or(1);
        Launch { sk, ..l }
    }

    /// [`Plan::launch`]'s blocks, K not split (`sk` 1): rows, warps and the ring's stages.
    pub fn shape(&self, m: usize, bits: usize) -> Launch {
        let mt = variant_rows(m);
        let wn = if mt > 64 { 2 } else { 1 };
        // (the wgmma flavour's warps each take every batch row: up to WGMMA_MAX_M, one warp
        // per row of tiles as above; at 128 rows its 128 accumulators spilled, ptxas for sm_90a)
        let wgmma = self.wgmma && self.wide && mt <= WGMMA_MAX_M;
        let wr = match self.wide {
            true => BLOCK_WARPS / wn,
            false => NARROW_BLOCK_WARPS,
        };
        let stage = stage_bytes(mt, wr, bits);
        // the scale blocks' buffer (blocks of 256 weight rows) besides the ring
        let over = block_shared_overhead(mt) + scale_block_bytes(32 * wr);
        let room = self.ring.min(self.smem.saturating_sub(over));
        let st = (room / stage).clamp(MIN_STAGES, MAX_STAGES);
        if self.wide && st * stage + over > self.smem {
            // a GPU with less shared memory a block (100 KB an SM: sm_86, sm_89) takes no
            // wide block at 2 stages here (8-bit at 64 rows): the narrow launch
            return Plan {
                wide: false,
                ..*self
            }
            .shape(m, bits);
        }
        Launch {
            mt,
            wr,
            wn,
            sk: 1,
            st,
            bits,
            bounded: false,
            wgmma,
        }
    }
}

/// What a block costs beyond its steps, in steps: issuing the ring's first copies and
/// waiting for them, and with splits the partial tiles written, counted and added. On an
/// H100 (Nsight's warp samples of 8B down at 64 rows, 8 steps a block) 29% of the samples
/// fell outside the main loop, ~3.4 steps' worth.
pub const BLOCK_OVERHEAD_STEPS: usize = 4;

/// The time of a launch whose blocks are bound by latency, not by memory (issue slots 15-20%
/// active, DRAM 5-10% of its peak on H100 and H200), in steps: `cb` column blocks × `d`
/// splits run in waves of `slots` blocks (those the SMs hold at once), each wave as long as
/// a block, `steps / d` steps plus [`BLOCK_OVERHEAD_STEPS`]. Filling every slot (the rule
/// before) split 8B down at 64 rows 14 ways into 1.7 waves of 8-step blocks (cost 24); 8
/// splits run one wave of 14 (cost 18).
pub fn split_cost(cb: usize, steps: usize, d: usize, slots: usize) -> usize {
    (cb * d).div_ceil(slots.max(1)) * (steps / d + BLOCK_OVERHEAD_STEPS)
}

/// `l` in the bounded flavour where it has one (`MLXCEL_QGEMM_BOUNDED`): up to
/// [`BOUNDED_MAX_M`] rows in an even number of tiles of 8, two warps per row of tiles
/// (half the accumulators each) and 128 registers a thread, so that the two blocks the
/// ring's shared memory allows an SM hold 16 warps instead of 8 (the kernel is bound by
/// latency: issue slots 18-19% active on an H200). Other launches stay as they are.
/// `l` must be a narrow launch ([`NARROW_BLOCK_WARPS`] of one row of tiles: the flavour
/// runs 256 threads a block); others stay as they are too.
pub fn bounded(l: Launch) -> Launch {
    if l.mt > BOUNDED_MAX_M || !(l.mt / 8).is_multiple_of(2) || l.wr * l.wn != NARROW_BLOCK_WARPS {
        return l;
    }
    Launch {
        wn: 2,
        bounded: true,
        ..l
    }
}

/// Per thread: the split-K scratch (f32 column tiles the kernel adds into and Σ x² partials,
/// i32 counts: all left at zero by every call) and the last call's `tok` output. A call
/// that uses the scratch takes the previous one's `tok` as an input, so MLX's graph orders
/// every call on this thread after the one before (it would otherwise run calls with no
/// data between them side by side). MLX's state is per thread, so is this.
struct Scratch {
    part: Array,
    count: Array,
    floats: usize,
    blocks: usize,
    prev: Option<Array>,
}

thread_local! {
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// The scratch with room for `floats` partial values and `blocks` counts, made (zeros,
/// evaluated now) or grown as needed.
fn scratch(floats: usize, blocks: usize) -> Result<(Array, Array, Option<Array>)> {
    SCRATCH.with(|cell| {
        let mut s = cell.borrow_mut();
        if s.as_ref()
            .is_none_or(|s| s.floats < floats || s.blocks < blocks)
        {
            let floats = floats
                .max(s.as_ref().map_or(1, |s| s.floats))
                .next_power_of_two();
            let blocks = blocks
                .max(s.as_ref().map_or(1, |s| s.blocks))
                .next_power_of_two();
            let part = Array::zeros(&[floats as i32], Dtype::F32)?;
            let count = crate::mlx::device_inputs::counts_i32(blocks)?;
            // materialised now: the kernel must get these buffers, zeroed
            mlx::eval_fresh(&[&part, &count])?;
            let prev = s.take().and_then(|s| s.prev);
            *s = Some(Scratch {
                part,
                count,
                floats,
                blocks,
                prev,
            });
        }
        let s = s.as_ref().expect("made above");
        Ok((s.part.clone(), s.count.clone(), s.prev.clone()))
    })
}

/// Drop this thread's last `tok`, so that the next call is not ordered after it. Only for
/// calls whose graphs are dropped unevaluated (a warm-up's built graphs): the next call on
/// the scratch would otherwise take the last dropped call's `tok` as an input, and its
/// evaluation would run every dropped graph (the warm-up's steps, their KV writes included).
pub fn forget_dropped_calls() {
    SCRATCH.with(|cell| {
        if let Some(s) = cell.borrow_mut().as_mut() {
            s.prev = None;
        }
    });
}

fn set_prev(tok: Array) {
    SCRATCH.with(|cell| {
        if let Some(s) = cell.borrow_mut().as_mut() {
            s.prev = Some(tok);
        }
    });
}

/// The template values both bodies start with (MT, N, K, G, BITS, WR, WN, SK, ST), then `rest`.
fn template_values(l: &Launch, [n, k, group, bits]: [usize; 4], rest: &[usize]) -> Vec<i32> {
    [l.mt, n, k, group, bits, l.wr, l.wn, l.sk, l.st]
        .iter()
        .chain(rest)
        .map(|&v| v as i32)
        .collect()
}

/// `(n, k, m)` of `x · w[n, k]ᵀ` for `bits`-bit weights, or an error naming `what` when x
/// is not whole rows of k, at most [`MAX_M`] of them, or the shape is not the kernel's.
fn dims(
    what: &str,
    x: &Array,
    w: &Array,
    group: usize,
    bits: usize,
) -> Result<(usize, usize, usize)> {
    let n = w.dim(0) as usize;
    let k = w.dim(1) as usize * 32 / bits.max(1);
    let m = x.size() / k.max(1);
    if x.size() != m * k || !(1..=MAX_M).contains(&m) || !shape_fits(n, k, group, bits) {
        return Err(MlxError::Invalid(format!(
            "{what}: x of {} elements and a [{n}, {k}] weight ({bits} bits, group {group}) do \
             not fit the kernel (whole rows of k, 1-{MAX_M} of them, k a multiple of 128)",
            x.size()
        )));
    }
    Ok((n, k, m))
}

/// What a call of either body needs besides its own inputs.
struct Call<'a> {
    name: &'a str,
    body: &'a str,
    input_names: &'a [String],
    output_names: &'a [String],
    template_names: &'a [String],
}

/// Run `call` on `inputs` (the body's inputs before `part`, `count`, `prev`) with
/// `template_values`, outputs shaped `out_shapes` (and `tok`), for launch `l` of an
/// `n`-row weight; returns the outputs before `tok`.
fn launch(
    call: Call<'_>,
    inputs: &[&Array],
    x: &Array,
    out_shapes: &[&[i32]],
    template_values: &[i32],
    l: Launch,
    n: usize,
) -> Result<Vec<Array>> {
    let (_, _, header) = kernel(&l)?;
    let blocks = l.column_blocks(n);
    let (part, count, prev) = scratch(l.scratch_floats(n), blocks)?;
    // only calls that use the scratch are chained; the others take x in its place
    let chain = l.sk > 1;
    let prev = prev.filter(|_| chain);
    let mut all: Vec<&Array> = inputs.to_vec();
    all.extend([&part, &count, prev.as_ref().unwrap_or(x)]);
    let mut shapes: Vec<&[i32]> = out_shapes.to_vec();
    shapes.push(&[1]);
    let kernel = CudaKernel {
        name: call.name,
        input_names: call.input_names,
        output_names: call.output_names,
        header,
        body: call.body,
        shared_memory: l.shared_memory() as i32,
    };
    let threads = l.threads() as i32;
    let mut out = kernel.call(
        &all,
        &shapes,
        x.dtype(),
        call.template_names,
        template_values,
        x.dtype(),
        [(blocks * l.sk) as i32 * threads, 1, 1],
        [threads, 1, 1],
    )?;
    let tok = out
        .pop()
        .ok_or_else(|| MlxError::Invalid("qgemm: the kernel returned no outputs".into()))?;
    if chain {
        set_prev(tok);
    }
    Ok(out)
}

/// `x · dequantize(w, scales, biases)ᵀ` with the kernel, x read as `m` rows of `k` (any
/// shape of `m · k` elements), the result shaped `out_shape` (`m · n` elements, `m · n / 2`
/// for [`Epilogue::SwiGlu`]); with `norm = Some((weight, eps))` each row of x is
/// RMS-normalised first, in the same kernel. The caller checks [`enabled`] and
/// [`supports`] (and [`supports_swiglu`]).
#[allow(clippy::too_many_arguments)]
pub fn qgemm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group: usize,
    bits: usize,
    out_shape: &[i32],
    epi: Epilogue<'_>,
    norm: Option<(&Array, f32)>,
) -> Result<Array> {
    let (n, k, m) = dims("qgemm", x, w, group, bits)?;
    let swiglu = matches!(epi, Epilogue::SwiGlu);
    let out_n = if swiglu { n / 2 } else { n };
    let out_size: i64 = out_shape.iter().map(|&d| d as i64).product();
    if out_size != (m * out_n) as i64 || (swiglu && !supports_swiglu(n)) {
        return Err(MlxError::Invalid(format!(
            "qgemm: output {out_shape:?} does not fit {m} rows of a [{n}, {k}] weight{}",
            if swiglu { " with SwiGLU" } else { "" }
        )));
    }
    let res = match epi {
        Epilogue::Residual(r) if r.size() != m * n || r.dtype() != x.dtype() => {
            return Err(MlxError::Invalid(format!(
                "qgemm: residual {:?} {:?} does not match the output [{m}, {n}] {:?}",
                r.shape(),
                r.dtype(),
                x.dtype()
            )))
        }
        Epilogue::Residual(r) => r,
        _ => x, // not read
    };
    let (nw, eps) = norm_input("qgemm", norm, x, k)?;
    let src = source()?;
    static NAMES: OnceLock<([String; 9], [String; 2], [String; 12])> = OnceLock::new();
    let (inputs, outputs, tnames) = NAMES.get_or_init(|| {
        (
            [
                "x", "w", "scales", "biases", "res", "nw", "part", "count", "prev",
            ]
            .map(String::from),
            ["y", "tok"].map(String::from),
            [
                "MT", "N", "K", "G", "BITS", "WR", "WN", "SK", "ST", "EPI", "NORM", "EPS_BITS",
            ]
            .map(String::from),
        )
    });
    let l = launch_config(m, n, k, bits);
    let (name, _, _) = kernel(&l)?;
    let tvals = template_values(
        &l,
        [n, k, group, bits],
        &[epi.code(), norm.is_some() as usize, eps.to_bits() as usize],
    );
    let mut out = launch(
        Call {
            name,
            body: &src.body,
            input_names: inputs,
            output_names: outputs,
            template_names: tnames,
        },
        &[x, w, scales, biases, res, nw],
        x,
        &[out_shape],
        &tvals,
        l,
        n,
    )?;
    out.pop()
        .ok_or_else(|| MlxError::Invalid("qgemm: the kernel returned no output".into()))
}

/// The q/k/v projection in one kernel: `norm(x) · Wᵀ` for a merged `[q; k; v]` weight (`nq`
/// query heads, then equally many key and value heads of `head_dim`), plus `bias` (`[n]`,
/// x's dtype: Qwen2's q/k/v biases) where given, with RoPE (half-split, angle `pos[m] ·
/// inv_freq[d]`) on the q and k heads of row m: q `[m, nq, 1, head_dim]` and kv `[m, 2·nkv,
/// 1, head_dim]`, as [`qgemv::qgemv_rope`] returns them. The caller checks [`enabled`],
/// [`supports`] and [`supports_rope`].
#[allow(clippy::too_many_arguments)]
pub fn qgemm_rope(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group: usize,
    bits: usize,
    norm: Option<(&Array, f32)>,
    pos: &Array,
    inv_freq: &Array,
    nq: usize,
    head_dim: usize,
    bias: Option<&Array>,
) -> Result<(Array, Option<Array>)> {
    let (n, k, m) = dims("qgemm_rope", x, w, group, bits)?;
    super::qgemv::check_qkv_bias("qgemm_rope", bias, n, x.dtype())?;
    if !supports_rope(n, nq, head_dim) {
        return Err(MlxError::Invalid(format!(
            "qgemm_rope: {nq} query heads of {head_dim} do not fit a weight of {n} rows"
        )));
    }
    check_rope_inputs("qgemm_rope", pos, inv_freq, m, head_dim)?;
    let (nw, eps) = norm_input("qgemm_rope", norm, x, k)?;
    let src = source()?;
    static NAMES: OnceLock<([String; 11], [String; 3], [String; 14])> = OnceLock::new();
    let (inputs, outputs, tnames) = NAMES.get_or_init(|| {
        (
            [
                "x", "w", "scales", "biases", "nw", "pos", "inv_freq", "qb", "part", "count",
                "prev",
            ]
            .map(String::from),
            ["q", "kv", "tok"].map(String::from),
            [
                "MT", "N", "K", "G", "BITS", "WR", "WN", "SK", "ST", "NORM", "EPS_BITS", "HD",
                "NQ", "BIAS",
            ]
            .map(String::from),
        )
    });
    let l = launch_config(m, n, k, bits);
    let (_, name, _) = kernel(&l)?;
    let tvals = template_values(
        &l,
        [n, k, group, bits],
        &[
            norm.is_some() as usize,
            eps.to_bits() as usize,
            head_dim,
            nq,
            bias.is_some() as usize,
        ],
    );
    let (mi, hd) = (m as i32, head_dim as i32);
    let nkv2 = (n / head_dim - nq) as i32;
    let out = launch(
        Call {
            name,
            body: &src.body_rope,
            input_names: inputs,
            output_names: outputs,
            template_names: tnames,
        },
        &[x, w, scales, biases, nw, pos, inv_freq, bias.unwrap_or(x)],
        x,
        &[&[mi, nq as i32, 1, hd], &[mi, nkv2, 1, hd]],
        &tvals,
        l,
        n,
    )?;
    super::qgemv::q_and_kv("qgemm_rope", out, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_source_splits_and_names_follow_it() {
        let s = split_source(EMBEDDED).unwrap();
        assert!(s.header.contains("mlxcel_qgemm") && !s.header.contains("@@"));
        assert!(s.body.contains("x_shape") && !s.body.contains("@@"));
        assert!(s.body_rope.contains("HD, NQ") && s.body_rope.contains("x_shape"));
        let a = kernel_name(&s, "gemv");
        assert!(a.starts_with("mlxcel_qgemm_") && a.len() == "mlxcel_qgemm_".len() + 8);
        // another GEMV header, body or RoPE body: another name
        assert_ne!(a, kernel_name(&s, "gemv2"));
        let mut b = s.clone();
        b.body.push_str("\n// edited\n");
        assert_ne!(a, kernel_name(&b, "gemv"));
        let mut c = s.clone();
        c.body_rope.push_str("\n// edited\n");
        assert_ne!(a, kernel_name(&c, "gemv"));
        assert_eq!(a, kernel_name(&s.clone(), "gemv"));
    }

    #[test]
    fn shapes_the_kernel_covers() {
        let bf = [Dtype::BF16, Dtype::BF16];
        // the default batch range (the knobs unset in tests)
        if knobs::get().qgemm_min_m.is_none() && knobs::get().qgemm_max_m.is_none() {
            // 8-bit from 5 rows, 4-bit from 17 (the GEMV below, in row chunks past 8)
            assert!(!supports(4, 4096, 4096, 64, 8, bf));
            assert!(supports(5, 4096, 4096, 64, 8, bf));
            assert!(!supports(16, 4096, 4096, 64, 4, bf));
            assert!(supports(17, 4096, 4096, 64, 4, bf));
            assert!(supports(128, 4096, 14336, 32, 8, bf));
            assert!(!supports(129, 4096, 4096, 64, 4, bf));
        }
        assert!(supports(64, 4097, 4096, 128, 4, [Dtype::F16, Dtype::F16])); // any n
        assert!(!supports(64, 4096, 4096 + 64, 64, 4, bf)); // k not a multiple of 128
        assert!(!supports(64, 4096, 4096, 16, 4, bf)); // group 16
        assert!(!supports(64, 4096, 4096, 64, 3, bf)); // 3 bits
        assert!(!supports(64, 4096, 4096, 64, 4, [Dtype::BF16, Dtype::F16]));
        assert!(!supports(64, 4096, 4096, 64, 4, [Dtype::F32, Dtype::F32]));
        assert!(supports_swiglu(28672) && !supports_swiglu(28671));
        assert!(supports_rope(6144, 32, 128)); // Llama-3 8B
        assert!(supports_rope(5 * 128, 3, 128)); // a TP rank: 3 q, 1 k, 1 v heads
        assert!(!supports_rope(6144, 33, 128) && !supports_rope(6144, 48, 128));
        assert!(!supports_rope(6144 + 64, 32, 128) && !supports_rope(21, 1, 7));
    }

    #[test]
    fn variants_round_the_batch_up_to_whole_tiles() {
        assert_eq!(variant_rows(9), 16);
        assert_eq!(variant_rows(16), 16);
        assert_eq!(variant_rows(33), 40);
        assert_eq!(variant_rows(64), 64);
        assert_eq!(variant_rows(65), 80); // 9 tiles → 10 (two warps share them)
        assert_eq!(variant_rows(128), 128);
        let v = variants(9, 128);
        assert_eq!(v, [16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]);
        assert_eq!(variants(9, 40), [16, 24, 32, 40]);
        assert!(variants(9, 8).is_empty());
        for m in 1..=MAX_M {
            let r = variant_rows(m);
            assert!(
                r >= m && r - m < 16 && r <= MAX_M && r.is_multiple_of(8),
                "{m}"
            );
        }
    }

    #[test]
    fn launches_split_k_by_cost() {
        const H200: usize = 228 * 1024;
        let l = |m, n, k, bits| launch_for(m, n, k, bits, 132, H200, MAX_SPLITS);
        let plan = |wide, fill| Plan {
            sms: 132,
            smem: H200,
            max_splits: MAX_SPLITS,
            fill,
            wide,
            wgmma: false,
            ring: RING_BYTES,
        };
        let narrow = |m, n, k, bits| plan(false, false).launch(m, n, k, bits);
        let fill = |m, n, k| plan(false, true).launch(m, n, k, 4).sk;
        // 8B shapes at 32 rows: 256 rows a block (8 warps), 3 stages (86,784 bytes), one
        // block an SM (132 slots); K split into one wave of the longest blocks
        let qkv = l(32, 6144, 4096, 4);
        assert_eq!((qkv.mt, qkv.wr, qkv.wn, qkv.sk, qkv.st), (32, 8, 1, 4, 3));
        assert_eq!(
            qkv.shared_memory(),
            3 * 16 * (256 * 4 + 32 * 16 + 16 + 256) + 128 * 256
        );
        assert_eq!(qkv.threads(), 256);
        assert_eq!(l(32, 4096, 4096, 4).sk, 8); // o: 16 column blocks, 128 blocks of 4 steps
        assert_eq!(l(32, 28672, 4096, 4).sk, 1); // gate/up: 112 column blocks, no split
        assert_eq!(l(32, 4096, 14336, 4).sk, 8); // down: 112 steps, 14 a block
                                                 // lm_head
        assert_eq!(l(32, 128256, 4096, 4).sk, 1);
        // narrow (MLXCEL_QGEMM_WIDE=0): 128 rows a block, 6 stages (112,128 bytes: 2
        // blocks an SM, 264 slots)
        let q4 = narrow(32, 6144, 4096, 4);
        assert_eq!((q4.wr, q4.sk, q4.st), (4, 4, 6));
        // the rule before: the fewest splits that fill every slot (two waves for down)
        assert_eq!(
            [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)].map(|(n, k)| fill(32, n, k)),
            [8, 16, 2, 14]
        );
        assert_eq!(split_cost(32, 112, 14, 264), 2 * (8 + BLOCK_OVERHEAD_STEPS));
        assert_eq!(split_cost(32, 112, 8, 264), 14 + BLOCK_OVERHEAD_STEPS);
        // 70B TP8 rank shapes: 5 column blocks → 16 splits of 4 steps; K = 1024: 4 of 2
        assert_eq!(l(64, 1280, 8192, 4).sk, 16);
        assert_eq!(l(64, 8192, 1024, 4).sk, 4);
        // stages by what 115,072 bytes hold: 4-bit 4, 3, 3, 2 at 16, 32, 64, 128 rows; 8-bit
        // 2 (narrow: 6, 6, 4, 2 and 5, 4, 3, 2)
        let st = |bits| [16, 32, 64, 128].map(|m| l(m, 4096, 4096, bits).st);
        assert_eq!((st(4), st(8)), ([4, 3, 3, 2], [2, 2, 2, 2]));
        let st4 = |bits| [16, 32, 64, 128].map(|m| narrow(m, 4096, 4096, bits).st);
        assert_eq!((st4(4), st4(8)), ([6, 6, 4, 2], [5, 4, 3, 2]));
        // above 64 rows two warps per row of tiles, still 8 warps a block
        let big = l(100, 4096, 4096, 8);
        assert_eq!((big.mt, big.wr, big.wn, big.st), (112, 4, 2, 2));
        // a GPU with 100 KB an SM: the narrow ring fits in 99 KB (5 stages), one block an
        // SM (132 slots: 4 splits, one wave)
        let small = Plan {
            smem: 100 * 1024,
            ..plan(false, false)
        }
        .launch(32, 4096, 4096, 4);
        assert!(small.shared_memory() <= 99 * 1024 && small.st == 5 && small.sk == 4);
        // there every launch fits a block (wide ones with fewer stages, or, 8-bit at 64 rows
        // with not even 2 stages beside the scale blocks, narrow) but 8-bit ones above 120
        // rows, which `supports` sends elsewhere
        for mt in variants(1, MAX_M) {
            for bits in [4, 8] {
                let x = launch_for(mt, 4096, 14336, bits, 132, 100 * 1024, MAX_SPLITS);
                let block = x.shared_memory() + block_shared_overhead(x.mt);
                assert_eq!(x.fits(100 * 1024), block <= 100 * 1024);
                assert_eq!(
                    x.fits(100 * 1024),
                    bits == 4 || mt <= 120,
                    "{mt} rows, {bits} bits"
                );
                assert!(x.fits(228 * 1024));
            }
        }
        let w32 = launch_for(32, 4096, 4096, 4, 132, 100 * 1024, MAX_SPLITS);
        assert_eq!((w32.wr, w32.st), (8, 2));
        assert_eq!(
            launch_for(64, 4096, 4096, 8, 132, 100 * 1024, MAX_SPLITS).wr,
            4
        );
        // capped by the knob's most splits, and by steps per split
        assert_eq!(launch_for(32, 1280, 8192, 4, 132, H200, 1).sk, 1);
        assert_eq!(launch_for(32, 1280, 8192, 4, 132, H200, 5).sk, 4);
        assert_eq!(l(32, 128, 256, 4).sk, 1); // 2 steps: a split would get 1
        for (n, k) in [
            (6144, 4096),
            (4096, 14336),
            (2560, 8192),
            (8192, 3584),
            (8192, 2048),
        ] {
            for m in [9, 16, 33, 64, 65, 128] {
                for x in [l(m, n, k, 4), narrow(m, n, k, 4)] {
                    let steps = k / 128;
                    assert!(
                        steps.is_multiple_of(x.sk)
                            && (x.sk == 1 || steps / x.sk >= MIN_SPLIT_STEPS)
                    );
                    assert!(x.mt >= m && (x.mt / 8).is_multiple_of(x.wn));
                }
            }
        }
    }

    #[test]
    fn blocks_fit_an_sm_at_every_variant() {
        // what an sm_90 SM holds: each block's ring (and scale blocks) and its overhead (the
        // driver's 1 KB, the static Σ x²), for every variant, bits and shape: once for
        // blocks of 8 warps (their registers hold an SM alone), twice for the others
        const SMEM: usize = 228 * 1024;
        for mt in variants(1, MAX_M) {
            for bits in [4, 8] {
                for (n, k) in [(6144, 4096), (4096, 14336), (28672, 4096)] {
                    for wide in [false, true] {
                        let l = Plan {
                            sms: 132,
                            smem: SMEM,
                            max_splits: MAX_SPLITS,
                            fill: false,
                            wide,
                            wgmma: false,
                            ring: RING_BYTES,
                        }
                        .launch(mt, n, k, bits);
                        let block = l.shared_memory() + block_shared_overhead(l.mt);
                        let per_sm = if l.threads() >= 32 * BLOCK_WARPS {
                            1
                        } else {
                            2
                        };
                        assert!(
                            per_sm * block <= SMEM,
                            "{mt} rows, {bits} bits: {block} bytes"
                        );
                        assert!(l.threads() <= 32 * BLOCK_WARPS);
                        // the scale blocks' buffer in blocks of 256 weight rows only
                        assert_eq!(l.scale_block_bytes() > 0, l.rows() == 256);
                    }
                }
            }
        }
    }

    #[test]
    fn scratch_covers_every_blocks_tile() {
        let l = launch_for(128, 4096, 4096, 4, 132, 228 * 1024, MAX_SPLITS);
        // 32 column blocks × 16 splits × (8 float4 × 256 threads + 128)
        assert_eq!(l.scratch_floats(4096), 32 * l.sk * (2 * 8 * 4 * 256 + 128));
        assert_eq!(l.rows() * l.mt, 2 * 8 * 4 * l.threads()); // a tile's values, per thread
        let one = launch_for(16, 28672, 4096, 4, 132, 228 * 1024, 1);
        assert_eq!((one.sk, one.scratch_floats(28672)), (1, 0));
    }

    /// What python3 prints for `script` (run in the project's root, which imports
    /// scripts/check_qgemm.py), with `MLXCEL_QGEMM_BOUNDED=1` or without it.
    fn check_script(script: &str, bounded: bool) -> String {
        check_script_env(script, bounded, true, false, None)
    }

    /// [`check_script`], and with `MLXCEL_QGEMM_WIDE=0` unless `wide`, with
    /// `MLXCEL_QGEMM_WGMMA=1` if `wgmma`, `MLXCEL_QGEMM_RING_BYTES=ring` where given.
    fn check_script_env(
        script: &str,
        bounded: bool,
        wide: bool,
        wgmma: bool,
        ring: Option<usize>,
    ) -> String {
        let mut cmd = std::process::Command::new("python3");
        cmd.args(["-c", script])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        match bounded {
            true => cmd.env("MLXCEL_QGEMM_BOUNDED", "1"),
            false => cmd.env_remove("MLXCEL_QGEMM_BOUNDED"),
        };
        cmd.env_remove("MLXCEL_QGEMM_FILL");
        match ring {
            Some(r) => cmd.env("MLXCEL_QGEMM_RING_BYTES", r.to_string()),
            None => cmd.env_remove("MLXCEL_QGEMM_RING_BYTES"),
        };
        match wide {
            true => cmd.env_remove("MLXCEL_QGEMM_WIDE"),
            false => cmd.env("MLXCEL_QGEMM_WIDE", "0"),
        };
        cmd.env("MLXCEL_QGEMM_WGMMA", if wgmma { "1" } else { "0" });
        let out = cmd.output().expect("python3");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn the_check_script_launches_as_mlxcel_does() {
        // scripts/check_qgemm.py times and checks the launches `launch_for` picks
        let cases: Vec<(usize, usize, usize, usize)> = (1..=MAX_M)
            .step_by(3)
            .chain([64, 65, 128])
            .flat_map(|m| {
                [
                    (6144, 4096),
                    (4096, 14336),
                    (1280, 8192),
                    (8192, 1024),
                    (28672, 4096),
                ]
                .into_iter()
                .flat_map(move |(n, k)| [4, 8].map(|b| (m, n, k, b)))
            })
            .collect();
        let script = format!(
            "import sys; sys.path.insert(0, 'scripts'); import check_qgemm as c\n\
             for m, n, k, b in {cases:?}: print(*c.launch_for(m, n, k, b, {MAX_SPLITS}))"
        );
        // (a deeper ring, MLXCEL_QGEMM_RING_BYTES, with the wgmma flavour's wide blocks)
        for (wide, wgmma, ring) in [
            (true, false, None),
            (false, false, None),
            (true, true, None),
            (false, true, None),
            (true, true, Some(180_000)),
        ] {
            let text = check_script_env(&script, false, wide, wgmma, ring);
            for ((m, n, k, b), line) in cases.iter().zip(text.lines()) {
                let l = Plan {
                    sms: 132,
                    smem: 228 * 1024,
                    max_splits: MAX_SPLITS,
                    fill: false,
                    wide,
                    wgmma,
                    ring: ring.unwrap_or(RING_BYTES),
                }
                .launch(*m, *n, *k, *b);
                assert_eq!(
                    line,
                    format!("{} {} {} {} {}", l.mt, l.wr, l.wn, l.sk, l.st),
                    "{m} {n} {k} {b}, wide {wide}, wgmma {wgmma}, ring {ring:?}"
                );
                assert_eq!(l.wgmma, wgmma && wide && l.mt <= WGMMA_MAX_M, "{m}");
            }
            assert_eq!(text.lines().count(), cases.len());
        }
    }

    #[test]
    fn bounded_launches_split_the_tiles_and_keep_the_rest() {
        let l = |m| {
            Plan {
                sms: 132,
                smem: 228 * 1024,
                max_splits: MAX_SPLITS,
                fill: false,
                wide: false,
                wgmma: false,
                ring: RING_BYTES,
            }
            .launch(m, 28672, 4096, 4)
        };
        // 8-warp launches have none (the flavour's launch bounds are 256 threads)
        let wide = launch_for(32, 28672, 4096, 4, 132, 228 * 1024, MAX_SPLITS);
        assert_eq!(bounded(wide), wide);
        for m in [9, 16, 25, 32] {
            let b = bounded(l(m));
            assert_eq!((b.wn, b.bounded), (2, true), "{m}");
            assert_eq!(
                (b.mt, b.sk, b.st, b.threads()),
                (l(m).mt, l(m).sk, l(m).st, 256)
            );
        }
        // 24 rows (3 tiles) and above 32 rows: as launch_for picks them
        for m in [17, 24, 33, 64, 128] {
            assert_eq!(bounded(l(m)), l(m), "{m}");
        }
        // scripts/check_qgemm.py takes the same flavour with MLXCEL_QGEMM_BOUNDED=1
        let script = "import sys; sys.path.insert(0, 'scripts'); import check_qgemm as c\n\
                      print(repr(c.BOUNDED_PREFIX)); print([c.launch_for(m, 28672, 4096, 4, 16)[2] \
                      for m in (9, 16, 17, 24, 25, 32, 33, 64)])";
        let text = check_script(script, true);
        let mut lines = text.lines();
        let prefix = lines.next().unwrap();
        assert_eq!(
            prefix.trim_matches('\'').replace("\\n", "\n"),
            BOUNDED_PREFIX
        );
        let wn: Vec<usize> = [9, 16, 17, 24, 25, 32, 33, 64]
            .map(|m| bounded(l(m)).wn)
            .to_vec();
        assert_eq!(lines.next().unwrap(), format!("{wn:?}"));
    }

    #[test]
    fn not_used_off_cuda_or_unasked() {
        if mlx::backend() != Backend::Cuda || !knobs::get().qgemm {
            assert!(!enabled());
        }
    }
}
