//! Attention of a decode step over the KV pool as one MLX op: `kernels/attn.cu`, an MLX
//! custom CUDA kernel (CUDA backend only; elsewhere callers gather from the pool and use
//! `fast::sdpa`). It reads each batch row's positions through its own block table up to
//! its own position (no gather, no masks), and spreads long contexts over more blocks.
//! `MLXCEL_ATTN=0` turns it off.
use std::sync::OnceLock;

use super::qgemv::one_body_kernel;
use crate::mlx::fast::CudaKernel;
use crate::mlx::{self, Array, Backend, Dtype, MlxError, Result};

const SOURCE: &str = include_str!("../../kernels/attn.cu");

/// The kernel's name, header and body: from `kernels/attn.cu` as embedded, or from the
/// file `MLXCEL_ATTN_SOURCE` names (another name, so MLX and the cache keep both apart).
fn kernel() -> Result<&'static (String, String, String)> {
    static KERNEL: OnceLock<std::result::Result<(String, String, String), String>> =
        OnceLock::new();
    KERNEL
        .get_or_init(|| match &super::knobs::get().attn_source {
            None => Ok(one_body_kernel("mlxcel_attn", "attn.cu", SOURCE)),
            Some(path) => {
                let var = format!("MLXCEL_ATTN_SOURCE={}", path.display());
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("{var}: cannot read it: {e}"))?;
                match super::qgemv::header_and_body(&text) {
                    Some(_) => Ok(one_body_kernel("mlxcel_attn", "attn.cu", &text)),
                    None => Err(format!(
                        "{var}: no `// @@header` and `// @@body` marker lines"
                    )),
                }
            }
        })
        .as_ref()
        .map_err(|e| MlxError::Invalid(e.clone()))
}

/// At most this many blocks per (row, kv head).
pub const NSPLIT: usize = 32;

/// Whether the kernel reads a pool of `block_size`-token blocks: whole 32-position tiles
/// per block.
pub fn block_size_fits(block_size: usize) -> bool {
    block_size > 0 && block_size.is_multiple_of(32)
}

/// The heads of one [`decode`] call, the pool's block size, and the positions the step's
/// longest row attends to (at most; it sets the blocks launched, not the result).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_len: usize,
}

/// Whether [`decode`] runs for these shapes: CUDA, bfloat16 or float16 (the GGUF default),
/// head_dim 64 or 128, 1-16 query heads per kv head, and not turned off.
pub fn supported(q_heads: usize, kv_heads: usize, head_dim: usize, dtype: Dtype) -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF.get_or_init(|| !super::knobs::get().attn);
    !off && mlx::backend() == Backend::Cuda
        && matches!(dtype, Dtype::BF16 | Dtype::F16)
        && matches!(head_dim, 64 | 128)
        && kv_heads > 0
        && q_heads.is_multiple_of(kv_heads)
        && q_heads / kv_heads <= 16
}

/// The kernel's scratch for a cache of `slots` slots: per (slot, kv head, split) a
/// partial result of `G·(head_dim + 2)` floats, and per (slot, kv head) `NSPLIT + 1`
/// counts that start at zero and are left at zero by every call: the embedded kernel uses
/// the first as its split count; the rest leave room for a kernel file
/// (`MLXCEL_ATTN_SOURCE`) that hands splits over through a ticket and a flag per split
/// (docs/benchmarks.md, "The attention kernel's memory round trips"). Both are evaluated
/// at once, so the kernel gets plain contiguous buffers of their own. Clones share them.
#[derive(Clone)]
pub struct Scratch {
    part: Array,
    count: Array,
    /// what it was sized for: batch rows (slots), kv heads, query heads per kv head, head_dim
    slots: usize,
    kv_heads: usize,
    g: usize,
    head_dim: usize,
}

impl Scratch {
    pub fn new(slots: usize, q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        let g = q_heads / kv_heads.max(1);
        let n = slots * kv_heads * NSPLIT * g * (head_dim + 2);
        let part = Array::zeros(&[n as i32], Dtype::F32)?;
        // (in device memory even for one slot of one kv head, a 70B TP=8 rank's batch 1)
        let count = crate::mlx::device_inputs::counts_i32(slots * kv_heads * (NSPLIT + 1))?;
        // materialised now: MLX's zeros is a fill op, and the kernel must get these buffers
        mlx::eval_fresh(&[&part, &count])?;
        Ok(Scratch {
            part,
            count,
            slots,
            kv_heads,
            g,
            head_dim,
        })
    }
}

/// Warps per block: G = q_heads/kv_heads times the tiles a round takes, ⌊16/G⌋ (≥ 1):
/// 14–16 warps, each with one query head of one 32-position tile.
fn warps(g: usize) -> usize {
    g * (16 / g).max(1)
}

/// Positions a block takes per round: a 32-position tile per group of G warps.
fn chunk(g: usize) -> usize {
    32 * (warps(g) / g)
}

/// Blocks launched per (row, kv head) for a step whose longest row attends to `max_len`
/// positions: the splits the kernel cuts that row into, ⌈max_len / chunk⌉, at most
/// [`NSPLIT`] (every shorter row needs as many or fewer). A block past its row's splits
/// returns at once, but until it has read the position it holds an SM's registers (one
/// 512-thread block of ~70 registers a thread per SM), so NSPLIT blocks for every (row,
/// kv head) made a batch of 64 short rows wait for 15,000 such blocks.
/// `MLXCEL_ATTN_ALL_SPLITS=1` launches NSPLIT whatever the lengths (A/B runs).
pub fn launch_splits(max_len: usize, g: usize) -> usize {
    if super::knobs::get().attn_all_splits {
        return NSPLIT;
    }
    max_len.div_ceil(chunk(g)).clamp(1, NSPLIT)
}

/// The kernel writes `scratch` (through MLX's const input pointers; MLX never reads
/// it): calls sharing one scratch must run one after another (see
/// `KvCache::attn_scratch`).
///
/// `softmax(q·kᵀ·scale)·v` for each batch row b of `q` (`[B, q_heads, 1, head_dim]`)
/// over positions `0..=pos[b]` of `pool` (`[1, 2·kv_heads, blocks·block_size,
/// head_dim]`, key heads then value heads, the new token already written), position p
/// of row b at block `table[b, p / block_size]`; `table` int32 `[B, max blocks]`, `pos`
/// int32 `[B]` (or a scalar when B = 1). Returns `[B, q_heads, 1, head_dim]`. Check
/// [`supported`] and [`block_size_fits`] first.
pub fn decode(
    q: &Array,
    pool: &Array,
    table: &Array,
    pos: &Array,
    scratch: &Scratch,
    shape: Shape,
    scale: f32,
) -> Result<Array> {
    let Shape {
        q_heads,
        kv_heads,
        head_dim,
        block_size,
        max_len,
    } = shape;
    let b = q.dim(0) as usize;
    let ps = pool.shape();
    let ts = table.shape();
    if ps.len() != 4
        || ps[0] != 1
        || ps[1] as usize != 2 * kv_heads
        || ps[3] as usize != head_dim
        || !block_size_fits(block_size)
        || !(ps[2] as usize).is_multiple_of(block_size)
        || q.size() != b * q_heads * head_dim
        || ts.len() != 2
        || ts[0] as usize != b
        || pos.size() != b
        || b > scratch.slots
        || (scratch.kv_heads, scratch.g, scratch.head_dim)
            != (kv_heads, q_heads / kv_heads.max(1), head_dim)
        || !matches!(q.dtype(), Dtype::BF16 | Dtype::F16)
        || pool.dtype() != q.dtype()
        || table.dtype() != Dtype::I32
        || pos.dtype() != Dtype::I32
    {
        return Err(MlxError::Invalid(format!(
            "attn::decode: q {:?} {:?}, pool {ps:?} {:?}, table {ts:?}, pos {:?} do not fit \
             {q_heads} query and {kv_heads} kv heads of {head_dim} in bfloat16 or float16 with int32 \
             tables/positions in blocks of {block_size} (scratch for {} rows, {} kv heads, \
             {} query heads each, {})",
            q.shape(),
            q.dtype(),
            pool.dtype(),
            pos.shape(),
            scratch.slots,
            scratch.kv_heads,
            scratch.g,
            scratch.head_dim
        )));
    }
    let (name, header, body) = kernel()?;
    static NAMES: OnceLock<([String; 6], [String; 1], [String; 7])> = OnceLock::new();
    let (inputs, outputs, tnames) = NAMES.get_or_init(|| {
        (
            ["q", "pool", "table", "pos", "part", "count"].map(String::from),
            ["out".to_string()],
            ["D", "HQ", "HKV", "NSPLIT", "WARPS", "BS", "SCALE_BITS"].map(String::from),
        )
    });
    let g = q_heads / kv_heads;
    let w = warps(g);
    let kernel = CudaKernel {
        name,
        input_names: inputs,
        output_names: outputs,
        header,
        body,
        shared_memory: 0,
    };
    let tvals = [
        head_dim as i32,
        q_heads as i32,
        kv_heads as i32,
        NSPLIT as i32,
        w as i32,
        block_size as i32,
        (scale * std::f32::consts::LOG2_E).to_bits() as i32,
    ];
    // blockIdx.x: the split, blockIdx.y: (row, kv head)
    let splits = launch_splits(max_len, g) as i32;
    let threads = 32 * w as i32;
    let mut out = kernel.call(
        &[q, pool, table, pos, &scratch.part, &scratch.count],
        &[&[b as i32, q_heads as i32, 1, head_dim as i32]],
        q.dtype(),
        tnames,
        &tvals,
        q.dtype(),
        [splits * threads, (b * kv_heads) as i32, 1],
        [threads, 1, 1],
    )?;
    Ok(out.remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_has_whole_groups_of_query_heads_and_at_most_16_warps() {
        for (g, want) in [(1, 16), (3, 15), (4, 16), (7, 14), (8, 16), (16, 16)] {
            let w = warps(g);
            assert_eq!(w, want, "G {g}");
            assert_eq!(w % g, 0);
        }
    }

    #[test]
    fn the_kernel_file_has_its_markers() {
        let (header, body) = super::super::qgemv::header_and_body(SOURCE).unwrap();
        assert!(header.contains("mlxcel_attn_decode"));
        // MLX passes the pool's and the table's shapes only when the body names them
        assert!(body.contains("pool_shape") && body.contains("table_shape"));
    }

    #[test]
    fn the_launch_has_the_splits_of_the_longest_row() {
        for g in [1, 3, 4, 8, 16] {
            let c = chunk(g);
            for max_len in [
                1,
                2,
                c - 1,
                c,
                c + 1,
                5 * c,
                31 * c + 1,
                32 * c,
                32 * c + 1,
                1 << 20,
            ] {
                let s = launch_splits(max_len, g);
                // as many as the kernel cuts the longest row into, capped at NSPLIT
                assert_eq!(
                    s,
                    max_len.div_ceil(c).min(NSPLIT),
                    "G {g}, {max_len} positions"
                );
                assert!((1..=NSPLIT).contains(&s));
                // so a shorter row never needs more splits than were launched
                assert!((1..=max_len)
                    .step_by(c / 2)
                    .all(|len| len.div_ceil(c).min(NSPLIT) <= s));
            }
        }
        // the 8B's heads (G = 4: 4 tiles a round, 128 positions): 384 positions in 3
        // blocks instead of 32; a 70B TP=8 rank's (G = 8: 2 tiles, 64 positions) in 6
        assert_eq!(launch_splits(384, 4), 3);
        assert_eq!(launch_splits(384, 8), 6);
    }

    #[test]
    fn blocks_hold_whole_tiles() {
        assert!(block_size_fits(32) && block_size_fits(64) && block_size_fits(256));
        assert!(!block_size_fits(16) && !block_size_fits(0) && !block_size_fits(48));
    }

    #[test]
    fn only_cuda_16_bit_floats_and_known_head_sizes() {
        // this machine's backend decides the rest; the shapes are refused anywhere
        assert!(!supported(32, 8, 96, Dtype::BF16));
        assert!(!supported(32, 8, 128, Dtype::F32));
        assert!(!supported(30, 8, 128, Dtype::BF16));
        assert!(!supported(64, 2, 128, Dtype::BF16));
        for dtype in [Dtype::BF16, Dtype::F16] {
            assert_eq!(
                supported(32, 8, 128, dtype),
                mlx::backend() == Backend::Cuda
            );
        }
    }
}
