//! mlxcel's dense GEMV (`kernels/gemv.cu`): `x · wᵀ` for decode steps of bf16/f16 models
//! (batch ≤ [`MAX_M`]) on MLX's CUDA backend, with the fused prologue and epilogues of the
//! quantized kernel ([`super::qgemv`]): RMSNorm of x, residual add, SwiGLU of a merged
//! gate/up weight, RoPE on the q/k heads of a merged q/k/v weight. Each fusion saves a
//! decode step one MLX op per layer, and the kernel streams the weight rows in 16-byte
//! vectors for memory bandwidth.
//!
//! On by default (`MLXCEL_GEMV_DENSE=0` turns it off): on one H200 it matched MLX ops on
//! the 8B and 70B-rank shapes (`scripts/check_gemv.py`) and decoded the 70B TP=8 rank proxy
//! at 126–132 tok/s where MLX's matmul gave 116–123 (docs/benchmarks.md). The kernel source is embedded;
//! `MLXCEL_GEMV_SOURCE=path` loads another file at run time.
use std::sync::OnceLock;

use super::knobs;
use super::qgemv::{check_rope_inputs, fnv1a32, header_for_mlx, Epilogue};
use crate::mlx::fast::CudaKernel;
use crate::mlx::{self, Array, Backend, Dtype, MlxError, Result};

/// Largest batch (rows of x) the kernel's CUDA-core path takes; larger ones stay on MLX's
/// matmul unless the tensor-core path takes them ([`MMA_MAX_M`]).
pub const MAX_M: usize = 8;

/// Largest batch the tensor-core path (`MMA = 1` in `kernels/gemv.cu`) takes: two tiles of
/// 8 batch rows.
pub const MMA_MAX_M: usize = 16;

/// The smallest batch on the tensor-core path unless `MLXCEL_GEMV_MMA` says otherwise (0:
/// off). From 4 rows: on one H100 bf16 decode at batches 4 / 8 / 16 ran 1.22 / 1.31 / 1.07×
/// (8B) and 1.42 / 1.65 / 1.45× (a 70B TP=8 rank) MLX's matmul path (docs/benchmarks.md).
pub const MMA_FROM: usize = 4;

/// The largest batch on the tensor-core path unless `MLXCEL_GEMV_MMA_MAX` says otherwise.
pub const MMA_MAX: usize = 16;

const EMBEDDED: &str = include_str!("../../kernels/gemv.cu");
const HEADER_MARK: &str = "// @@header\n";
const BODY_MARK: &str = "// @@body\n";
pub(super) const ROPE_MARK: &str = "// @@body_rope\n";
pub(super) const ROPE_KV_MARK: &str = "// @@body_rope_kv\n";

/// The kernel file split into the device-code header and the two kernel bodies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub header: String,
    /// `x · Wᵀ` with epilogues 0–2, one output.
    pub body: String,
    /// The q/k/v projection with RoPE (epilogue 3), outputs q and kv.
    pub body_rope: String,
    /// The same with k and v written into the KV pool (output q); empty in files without
    /// a `// @@body_rope_kv` part (the quantized GEMM's).
    pub body_rope_kv: String,
}

impl Source {
    /// `mlxcel_gemv_<FNV-1a of the source, 32 bits>` (MLX caches compiled kernels by
    /// name, so an edited source must not reuse the old one; `scripts/check_gemv.py`
    /// names it the same way).
    pub fn kernel_name(&self) -> String {
        let h = fnv1a32(&[
            &self.header,
            &self.body,
            ROPE_MARK,
            &self.body_rope,
            ROPE_KV_MARK,
            &self.body_rope_kv,
        ]);
        format!("mlxcel_gemv_{h:08x}")
    }
}

/// Split a kernel file at its `// @@header`, `// @@body` and `// @@body_rope` marker lines
/// (and an optional last `// @@body_rope_kv`).
pub fn split_source(text: &str) -> std::result::Result<Source, String> {
    let (_, rest) = text
        .split_once(HEADER_MARK)
        .ok_or("no `// @@header` marker line")?;
    let (header, rest) = rest
        .split_once(BODY_MARK)
        .ok_or("no `// @@body` marker line after `// @@header`")?;
    let (body, rest) = rest
        .split_once(ROPE_MARK)
        .ok_or("no `// @@body_rope` marker line after `// @@body`")?;
    let (body_rope, body_rope_kv) = rest.split_once(ROPE_KV_MARK).unwrap_or((rest, ""));
    for (text, mark) in [(body, "@@body"), (body_rope, "@@body_rope")] {
        if text.trim().is_empty() {
            return Err(format!("the kernel body after `// {mark}` is empty"));
        }
    }
    Ok(Source {
        header: header.to_string(),
        body: body.to_string(),
        body_rope: body_rope.to_string(),
        body_rope_kv: body_rope_kv.to_string(),
    })
}

fn load_source() -> std::result::Result<Source, String> {
    match &knobs::get().gemv_source {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                format!("MLXCEL_GEMV_SOURCE={}: cannot read it: {e}", path.display())
            })?;
            split_source(&text).map_err(|e| format!("MLXCEL_GEMV_SOURCE={}: {e}", path.display()))
        }
        None => split_source(EMBEDDED).map_err(|e| format!("embedded kernels/gemv.cu: {e}")),
    }
}

fn source() -> Result<&'static Source> {
    static SOURCE: OnceLock<std::result::Result<Source, String>> = OnceLock::new();
    SOURCE
        .get_or_init(load_source)
        .as_ref()
        .map_err(|e| MlxError::Invalid(e.clone()))
}

/// The plain kernel's name, the RoPE entry point's (`<name>_rope`) and the one writing
/// the KV pool (`<name>_rope_kv`).
fn kernel_names() -> &'static (String, String, String) {
    static NAMES: OnceLock<(String, String, String)> = OnceLock::new();
    NAMES.get_or_init(|| {
        let n = source().map(|s| s.kernel_name()).unwrap_or_default();
        (n.clone(), n.clone() + "_rope", n + "_rope_kv")
    })
}

/// The header as MLX gets it (an `#include` of a cached file, see `qgemv::mlx_header`).
fn mlx_header() -> Result<&'static str> {
    static HEADER: OnceLock<String> = OnceLock::new();
    let src = source()?;
    Ok(HEADER.get_or_init(|| header_for_mlx(&kernel_names().0, &src.header)))
}

/// Whether the kernel is used at all: MLX's CUDA backend, unless `MLXCEL_GEMV_DENSE=0`.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| mlx::backend() == Backend::Cuda && knobs::get().gemv_dense)
}

/// Largest batch whose decode steps use the kernel (it takes up to [`MAX_M`]): on one H200
/// the 8B bf16 shape decoded faster on it at batch 1–3 (226.8 / 376.6 / 562.8 tok/s vs
/// 214.4 / 322.8 / 460.3 on MLX's matmul) and slower from 4 (599.8 / 793.8 / 859.6 vs 630.6 /
/// 953.2 / 1,281.3 at 4 / 6 / 8), where MLX's GEMM reads the weight once for all rows at
/// more than the kernel's bandwidth (docs/benchmarks.md).
pub const USED_MAX_M: usize = 3;

/// The batches on the tensor-core path: `MLXCEL_GEMV_MMA` (from) to `MLXCEL_GEMV_MMA_MAX`
/// (to), [`MMA_FROM`] and [`MMA_MAX`] by default; `None` when it is off.
pub fn mma_rows() -> Option<std::ops::RangeInclusive<usize>> {
    let k = knobs::get();
    let from = k.gemv_mma.unwrap_or(MMA_FROM);
    let to = k.gemv_mma_max.unwrap_or(MMA_MAX);
    (from > 0 && from <= to).then_some(from..=to)
}

/// Whether a launch of `m` rows for a weight of `n` rows takes the tensor-core path: `m`
/// in [`mma_rows`] and `n` whole tiles of 16 rows.
fn takes_mma(m: usize, n: usize) -> bool {
    n.is_multiple_of(16) && mma_rows().is_some_and(|r| r.contains(&m))
}

/// Whether the kernel is used ([`enabled`]; at most [`USED_MAX_M`] rows, or a batch on the
/// tensor-core path) and covers `x [m, k] · w [n, k]ᵀ` with `dtypes` = [x's, w's]
/// ([`shape_supported`]).
pub fn supports(m: usize, n: usize, k: usize, dtypes: [Dtype; 2]) -> bool {
    enabled() && (m <= USED_MAX_M || takes_mma(m, n)) && shape_supported(m, n, k, dtypes)
}

/// Whether the kernel can compute `x [m, k] · w [n, k]ᵀ`: 1–[`MAX_M`] rows (up to
/// [`MMA_MAX_M`] on the tensor-core path), `k` a multiple of 8 (rows of whole 16-byte
/// vectors), x and w both bfloat16 or both float16.
pub fn shape_supported(m: usize, n: usize, k: usize, dtypes: [Dtype; 2]) -> bool {
    (m >= 1 && (m <= MAX_M || (m <= MMA_MAX_M && takes_mma(m, n))))
        && n > 0
        && k > 0
        && k.is_multiple_of(8)
        && matches!(
            dtypes,
            [Dtype::BF16, Dtype::BF16] | [Dtype::F16, Dtype::F16]
        )
}

/// How the kernel is launched: rows per block and warps per block (grid `n / rows`), and
/// whether on the tensor cores (`MMA` in the kernel file; rows then 16 or 32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub rows: usize,
    pub wpb: usize,
    pub mma: bool,
}

/// Weight vectors a lane of the tensor-core path keeps in flight (`MLXCEL_GEMV_MMA_LOADS` in
/// the kernel file): a round's chunks of 32 values × its tiles × 2 rows.
const MMA_LOADS: usize = 8;

/// The tensor-core launch for `n` weight rows of `k` values: tiles of 16 rows, two per
/// block where the weight has at least 8,192 rows (the 8B's q/k/v, gate/up and lm_head:
/// a batch tile of x then serves 32 rows) and one otherwise (the 70B ranks' q/k/v and o,
/// 1,024–1,280 rows, then make 64–80 blocks); warps split K, 16 where there are fewer
/// than 256 blocks and 8 otherwise, fewer where K is too short to give each a round.
pub fn mma_launch(n: usize, k: usize) -> Launch {
    let tiles = if n >= 8192 && n.is_multiple_of(32) {
        2
    } else {
        1
    };
    let rows = 16 * tiles;
    let chunks = k.div_ceil(32);
    let per_round = (MMA_LOADS / (2 * tiles)).max(1);
    let mut wpb = if n / rows < 256 { 16 } else { 8 };
    while wpb > 1 && chunks < wpb * per_round {
        wpb /= 2;
    }
    Launch {
        rows,
        wpb,
        mma: true,
    }
}

/// Vectors per thread and row that the previous launch (`MLXCEL_GEMV_WIDE=0`) keeps a
/// block's threads within (more warps for longer rows): 4096-wide rows get 4 warps (4
/// vectors each), the 8B and 70B-rank down projections (K = 14336, 3584–7168) 8 or 4.
pub const MAX_VECTORS_PER_THREAD: usize = 8;

/// Vectors of a row per thread in the one-round launch: with two rows per block, a
/// thread's 8 loads (`MLXCEL_GEMV_LOADS`) are all in flight at once.
pub const WIDE_VECTORS_PER_THREAD: usize = 4;

/// Rows and warps per block for `x [m, k] · w [n, k]ᵀ`.
///
/// By default (`MLXCEL_GEMV_WIDE`) one round: the fewest warps (4, 8 or 16) that leave a
/// thread at most [`WIDE_VECTORS_PER_THREAD`] vectors of a row, and as many rows (2 to 4;
/// 2 above batch 4) as a thread's 8 in-flight loads cover, so every thread issues all its
/// loads before any math and the small products (the 70B ranks' q/k/v: 1,280 rows of
/// 8,192) launch 2.5× the warps they did. On one H100 the q/k/v kernel of a 70B TP=8 rank
/// took 28 µs of a decode step under the previous launch where a read of its 21 MB takes
/// 9.4 (docs/benchmarks.md, "Dense GEMV").
///
/// The previous launch (`MLXCEL_GEMV_WIDE=0`): 4 rows per block up to batch 4, 2 above
/// (the accumulators grow with rows × batch); 4 warps, up to 8 while a thread would take
/// more than [`MAX_VECTORS_PER_THREAD`] vectors of a row.
///
/// Either way fewer rows where they do not divide `n` (never fewer than 2 where `n` is
/// even: the epilogues pair rows).
pub fn launch_config(m: usize, n: usize, k: usize) -> Launch {
    if takes_mma(m, n) {
        return mma_launch(n, k);
    }
    let fit = |r: usize| {
        (0..=r.trailing_zeros())
            .map(|i| r >> i)
            .find(|&d| n.is_multiple_of(d))
            .unwrap_or(1)
    };
    let vectors = k / 8;
    if knobs::get().gemv_wide {
        let mut wpb = 4;
        while wpb < 16 && vectors.div_ceil(32 * wpb) > WIDE_VECTORS_PER_THREAD {
            wpb *= 2;
        }
        let iters = vectors.div_ceil(32 * wpb).max(1);
        let rows = if m > 4 { 2 } else { (8 / iters).clamp(2, 4) };
        return Launch {
            rows: fit(rows),
            wpb,
            mma: false,
        };
    }
    let rows = fit(if m <= 4 { 4 } else { 2 });
    let mut wpb = 4;
    while wpb < 8 && vectors.div_ceil(32 * wpb) > MAX_VECTORS_PER_THREAD {
        wpb *= 2;
    }
    Launch {
        rows,
        wpb,
        mma: false,
    }
}

/// Whether [`Epilogue::SwiGlu`] fits batch `m` of a merged gate/up weight of `n` rows:
/// pairs of rows in every block.
pub fn supports_swiglu(m: usize, n: usize, k: usize) -> bool {
    n.is_multiple_of(2) && launch_config(m, n, k).rows.is_multiple_of(2)
}

/// Whether [`gemv_rope`] covers a merged q/k/v weight of `n` rows for `nq` query heads of
/// `head_dim` values at batch `m` (besides [`supports`]): whole heads, as many key as
/// value heads, and pairs of rows (d, d + head_dim/2) dividing evenly into blocks.
pub fn supports_rope(m: usize, n: usize, nq: usize, head_dim: usize) -> bool {
    if head_dim == 0 || !head_dim.is_multiple_of(2) || !n.is_multiple_of(head_dim) {
        return false;
    }
    let heads = n / head_dim;
    let rows = launch_config(m, n, 0).rows;
    heads > nq
        && (heads - nq).is_multiple_of(2)
        && rows.is_multiple_of(2)
        && (n / 2).is_multiple_of(rows / 2)
}

/// The kernel's `nw` input and eps: the norm weight (`k` values of x's dtype), or x
/// itself when there is no norm (not read then).
fn norm_input<'a>(
    who: &str,
    norm: Option<(&'a Array, f32)>,
    x: &'a Array,
    k: usize,
) -> Result<(&'a Array, f32)> {
    match norm {
        Some((nw, eps)) if nw.size() == k && nw.dtype() == x.dtype() => Ok((nw, eps)),
        Some((nw, _)) => Err(MlxError::Invalid(format!(
            "{who}: norm weight {:?} {:?} does not match k = {k} {:?}",
            nw.shape(),
            nw.dtype(),
            x.dtype()
        ))),
        None => Ok((x, 0.0)),
    }
}

/// `x · wᵀ` for a dense `w [n, k]` with the kernel, x read as `m` rows of `k` (any shape
/// of `m · k` elements), the result shaped `out_shape` (`m · n` elements, `m · n / 2` for
/// [`Epilogue::SwiGlu`]). With `norm = Some((weight, eps))` each row of x is
/// RMS-normalised first, in the same kernel. The caller checks [`supports`].
pub fn gemv(
    x: &Array,
    w: &Array,
    out_shape: &[i32],
    epi: Epilogue<'_>,
    norm: Option<(&Array, f32)>,
) -> Result<Array> {
    let (n, k) = (w.dim(0) as usize, w.dim(1) as usize);
    let m = x.size() / k.max(1);
    let swiglu = matches!(epi, Epilogue::SwiGlu);
    let out_n = if swiglu { n / 2 } else { n };
    let out_size: i64 = out_shape.iter().map(|&d| d as i64).product();
    if w.ndim() != 2
        || x.size() != m * k
        || out_size != (m * out_n) as i64
        || !shape_supported(m, n, k, [x.dtype(), w.dtype()])
    {
        return Err(MlxError::Invalid(format!(
            "gemv: x {:?} {:?}, weight {:?} {:?} and output {out_shape:?} do not fit the kernel",
            x.shape(),
            x.dtype(),
            w.shape(),
            w.dtype()
        )));
    }
    let Launch { rows, wpb, mma } = launch_config(m, n, k);
    if swiglu && rows % 2 != 0 {
        return Err(MlxError::Invalid(format!(
            "gemv: SwiGLU needs an even number of rows per block, got {rows} for n = {n}"
        )));
    }
    let (epi_code, res) = match epi {
        Epilogue::None => (0, x),
        Epilogue::Residual(r) => {
            if r.size() != m * n || r.dtype() != x.dtype() {
                return Err(MlxError::Invalid(format!(
                    "gemv: residual {:?} {:?} does not match the output [{m}, {n}] {:?}",
                    r.shape(),
                    r.dtype(),
                    x.dtype()
                )));
            }
            (1, r)
        }
        Epilogue::SwiGlu => (2, x),
    };
    let (nw, eps) = norm_input("gemv", norm, x, k)?;
    let src = source()?;
    static NAMES: OnceLock<([String; 4], [String; 1], [String; 9])> = OnceLock::new();
    let (inputs, outputs, tnames) = NAMES.get_or_init(|| {
        (
            ["x", "w", "res", "nw"].map(String::from),
            ["y".to_string()],
            [
                "M", "N", "K", "ROWS", "WPB", "EPI", "NORM", "EPS_BITS", "MMA",
            ]
            .map(String::from),
        )
    });
    let kernel = CudaKernel {
        name: &kernel_names().0,
        input_names: inputs,
        output_names: outputs,
        header: mlx_header()?,
        body: &src.body,
        shared_memory: 0,
    };
    let tvals = [
        m,
        n,
        k,
        rows,
        wpb,
        epi_code,
        norm.is_some() as usize,
        eps.to_bits() as usize,
        mma as usize,
    ]
    .map(|v| v as i32);
    let mut out = kernel.call(
        &[x, w, res, nw],
        &[out_shape],
        x.dtype(),
        tnames,
        &tvals,
        x.dtype(),
        [((n / rows) * 32 * wpb) as i32, 1, 1],
        [(32 * wpb) as i32, 1, 1],
    )?;
    out.pop()
        .ok_or_else(|| MlxError::Invalid("gemv: the kernel returned no output".into()))
}

/// Whether [`gemv_rope`] should write the new keys and values into the KV pool itself
/// (`into`) for `x [m, k] · w [n, k]ᵀ`: always on the CUDA-core launch (1-3 rows), and on
/// the tensor-core launch (4-16 rows) unless `MLXCEL_GEMV_MMA_KV=0` (it then returns them
/// for the cache to write: one scatter op a layer more; on one H100, bf16 decode at batches
/// 4-16 ran 15-28% faster with the kernel writing the pool, docs/benchmarks.md, "The batched
/// pool write's cause"). Which readers may follow such a write is the caller's decision
/// (`Model::forward_mixed`).
pub fn writes_kv(m: usize, n: usize, k: usize) -> bool {
    !launch_config(m, n, k).mma || knobs::get().gemv_mma_kv
}

/// The q/k/v projection of a decode step in one kernel for a dense merged `[q; k; v]`
/// weight: `y = norm(x) · Wᵀ` with RoPE (half-split, angle `pos[m] · inv_freq[d]`) on the
/// q and k heads of row m. Returns q `[m, nq, 1, head_dim]` and kv `[m, 2·nkv, 1,
/// head_dim]` (key heads, then value heads), as [`super::qgemv::qgemv_rope`] does; with
/// `into` (a layer's KV pool and the step's rows there, as that takes them) k and v go
/// straight into the pool and kv is `None`. With `bias` (`[n]` of x's dtype: Qwen2's q/k/v
/// biases) it is added before the rotation. The caller checks [`supports`] and
/// [`supports_rope`].
#[allow(clippy::too_many_arguments)]
pub fn gemv_rope(
    x: &Array,
    w: &Array,
    norm: Option<(&Array, f32)>,
    pos: &Array,
    inv_freq: &Array,
    nq: usize,
    head_dim: usize,
    into: Option<(&Array, &Array)>,
    bias: Option<&Array>,
) -> Result<(Array, Option<Array>)> {
    let (n, k) = (w.dim(0) as usize, w.dim(1) as usize);
    let m = x.size() / k.max(1);
    if w.ndim() != 2
        || x.size() != m * k
        || !shape_supported(m, n, k, [x.dtype(), w.dtype()])
        || !supports_rope(m, n, nq, head_dim)
    {
        return Err(MlxError::Invalid(format!(
            "gemv_rope: x of {} elements, a [{n}, {k}] weight and {nq} query heads of \
             {head_dim} do not fit",
            x.size()
        )));
    }
    check_rope_inputs("gemv_rope", pos, inv_freq, m, head_dim)?;
    super::qgemv::check_qkv_bias("gemv_rope", bias, n, x.dtype())?;
    let nkv2 = n / head_dim - nq;
    if let Some((pool, dst)) = into {
        super::qgemv::check_kv_dst("gemv_rope", pool, dst, x.dtype(), m, nkv2, head_dim)?;
    }
    let (nw, eps) = norm_input("gemv_rope", norm, x, k)?;
    let src = source()?;
    if into.is_some() && src.body_rope_kv.trim().is_empty() {
        return Err(MlxError::Invalid(
            "gemv_rope: the kernel file has no `// @@body_rope_kv` part".into(),
        ));
    }
    let Launch { rows, wpb, mma } = launch_config(m, n, k);
    type Names = (
        [String; 6],
        [String; 2],
        [String; 8],
        [String; 1],
        [String; 11],
    );
    static NAMES: OnceLock<Names> = OnceLock::new();
    let (inputs, outputs, inputs_kv, outputs_kv, tnames) = NAMES.get_or_init(|| {
        (
            ["x", "w", "nw", "pos", "inv_freq", "qb"].map(String::from),
            ["q", "kv"].map(String::from),
            ["x", "w", "nw", "pos", "inv_freq", "pool", "dst", "qb"].map(String::from),
            ["q".to_string()],
            [
                "M", "N", "K", "ROWS", "WPB", "NORM", "EPS_BITS", "HD", "NQ", "MMA", "BIAS",
            ]
            .map(String::from),
        )
    });
    let kernel = CudaKernel {
        name: match into {
            Some(_) => &kernel_names().2,
            None => &kernel_names().1,
        },
        input_names: match into {
            Some(_) => inputs_kv.as_slice(),
            None => inputs.as_slice(),
        },
        output_names: match into {
            Some(_) => outputs_kv.as_slice(),
            None => outputs.as_slice(),
        },
        header: mlx_header()?,
        body: match into {
            Some(_) => &src.body_rope_kv,
            None => &src.body_rope,
        },
        shared_memory: 0,
    };
    let tvals = [
        m,
        n,
        k,
        rows,
        wpb,
        norm.is_some() as usize,
        eps.to_bits() as usize,
        head_dim,
        nq,
        mma as usize,
        bias.is_some() as usize,
    ]
    .map(|v| v as i32);
    let (mi, hd) = (m as i32, head_dim as i32);
    let q_shape = [mi, nq as i32, 1, hd];
    let kv_shape = [mi, nkv2 as i32, 1, hd];
    let qb = bias.unwrap_or(nw); // (not read without a bias)
    let (ins, shapes): (Vec<&Array>, Vec<&[i32]>) = match into {
        Some((pool, dst)) => (vec![x, w, nw, pos, inv_freq, pool, dst, qb], vec![&q_shape]),
        None => (vec![x, w, nw, pos, inv_freq, qb], vec![&q_shape, &kv_shape]),
    };
    let out = kernel.call(
        &ins,
        &shapes,
        x.dtype(),
        tnames,
        &tvals,
        x.dtype(),
        [((n / rows) * 32 * wpb) as i32, 1, 1],
        [(32 * wpb) as i32, 1, 1],
    )?;
    super::qgemv::q_and_kv("gemv_rope", out, into.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_source_splits_into_header_and_bodies() {
        let s = split_source(EMBEDDED).unwrap();
        assert!(s.header.contains("mlxcel_gemv"));
        assert!(s.body.contains("mlxcel_gemv<"));
        assert!(s.body_rope.contains("inv_freq"));
        assert!(s.kernel_name().starts_with("mlxcel_gemv_"));
        assert!(split_source("// @@header\nx\n// @@body\ny\n").is_err());
        assert!(split_source("// @@header\nx\n// @@body\n \n// @@body_rope\nz\n").is_err());
    }

    #[test]
    fn on_by_default_on_cuda_only() {
        // the knob defaults to on, and the CPU backend never takes the kernel
        assert!(knobs::Knobs::default().gemv_dense);
        if mlx::backend() != Backend::Cuda {
            assert!(!enabled());
        }
    }
}
