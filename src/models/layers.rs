//! Building blocks that model files call like single-device layers: linear
//! (dense or MLX-affine-quantized), embedding, RMSNorm, rotary embedding.
//! Each layer loads its own tensors by name, with shapes from the config.
use std::ops::Range;
use std::rc::Rc;

use crate::kernels::{self, qgemv::Epilogue};
use crate::mlx::distributed::Group;
use crate::mlx::{self, fast, Array, Dtype};

use super::config::{ModelConfig, QuantConfig, RopeScaling};
use super::weights::{LoadError, RowBlock, TensorKind, WeightSource};

pub type Result<T> = std::result::Result<T, LoadError>;

/// How a linear layer is split across tensor-parallel ranks.
#[derive(Clone, Default)]
pub enum Shard {
    /// The whole weight.
    #[default]
    Full,
    /// Output rows `range` (column-parallel): no communication.
    Column(Range<usize>),
    /// Input columns `range` (row-parallel): partial sums are `all_sum`med over
    /// `group`, then the bias is added once.
    Row(Range<usize>, Rc<Group>),
}

enum Weight {
    Dense(Array),
    Quantized {
        w: Array,
        scales: Array,
        biases: Array,
        q: QuantConfig,
    },
}

/// `y = x Wᵀ (+ b)`, with W dense `[out, in]` or MLX affine-quantized, possibly one
/// rank's shard of it (see [`Shard`]); model code calls it like a plain linear layer.
pub struct Linear {
    weight: Weight,
    bias: Option<Array>,
    reduce: Option<Rc<Group>>,
}

impl Linear {
    /// Load `{prefix}.weight` (and `.scales`/`.biases` when quantized, `.bias` when `bias`),
    /// reading only this rank's part under `shard`.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        src: &dyn WeightSource,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        quant: Option<QuantConfig>,
        shard: Shard,
    ) -> Result<Linear> {
        let (rows, cols, reduce) = match shard {
            Shard::Full => (None, None, None),
            Shard::Column(r) => (Some(r), None, None),
            Shard::Row(c, g) => (None, Some(c), Some(g)),
        };
        let bias = if bias {
            Some(src.load_block(
                &format!("{prefix}.bias"),
                &[out_dim],
                rows.clone(),
                None,
                TensorKind::Float,
            )?)
        } else {
            None
        };
        let quant = tensor_quant(src, prefix, in_dim, quant);
        let weight = match quant {
            Some(q) if src.contains(&format!("{prefix}.scales")) => {
                let (bits, g) = (q.bits as usize, q.group_size as usize);
                let packed = cols.clone().map(|c| c.start * bits / 32..c.end * bits / 32);
                let groups = cols.clone().map(|c| c.start / g..c.end / g);
                Weight::Quantized {
                    w: src.load_block(
                        &format!("{prefix}.weight"),
                        &[out_dim, in_dim * bits / 32],
                        rows.clone(),
                        packed,
                        TensorKind::Packed,
                    )?,
                    scales: src.load_block(
                        &format!("{prefix}.scales"),
                        &[out_dim, in_dim / g],
                        rows.clone(),
                        groups.clone(),
                        TensorKind::Scales,
                    )?,
                    biases: src.load_block(
                        &format!("{prefix}.biases"),
                        &[out_dim, in_dim / g],
                        rows,
                        groups,
                        TensorKind::QuantBiases,
                    )?,
                    q,
                }
            }
            _ => Weight::Dense(src.load_block(
                &format!("{prefix}.weight"),
                &[out_dim, in_dim],
                rows,
                cols,
                TensorKind::Float,
            )?),
        };
        Ok(Linear {
            weight,
            bias,
            reduce,
        })
    }

    /// One linear computing several column-parallel (or full) linears side by side, so one
    /// matmul replaces several; callers split the output. `parts` are `(prefix, out_dim,
    /// shard)` with the same input, bias and quantization. Their weights (and scales/biases
    /// when quantized, and output biases) are stacked along the output axis as they are
    /// read, not concatenated afterwards.
    pub fn load_merged(
        src: &dyn WeightSource,
        parts: &[(&str, usize, Shard)],
        in_dim: usize,
        bias: bool,
        quant: Option<QuantConfig>,
    ) -> Result<Linear> {
        let mut rows = Vec::with_capacity(parts.len());
        for (prefix, _, shard) in parts {
            rows.push(match shard {
                Shard::Full => None,
                Shard::Column(r) => Some(r.clone()),
                Shard::Row(..) => {
                    return Err(LoadError::Mlx(mlx::MlxError::Invalid(format!(
                        "Linear::load_merged: {prefix} is row-parallel; only column-parallel \
                         or whole linears can be merged"
                    ))))
                }
            });
        }
        // the rows of tensor `suffix` of every part, shape [out_dim, width] (or [out_dim])
        let stacked = |suffix: &str, width: Option<usize>, kind: TensorKind| {
            let specs: Vec<RowBlock> = parts
                .iter()
                .zip(&rows)
                .map(|((prefix, out, _), r)| {
                    let shape = std::iter::once(*out).chain(width).collect();
                    (format!("{prefix}.{suffix}"), shape, r.clone())
                })
                .collect();
            src.load_concat(&specs, kind)
        };
        let bias = if bias {
            Some(stacked("bias", None, TensorKind::Float)?)
        } else {
            None
        };
        let quantized = parts
            .iter()
            .filter(|(prefix, ..)| src.contains(&format!("{prefix}.scales")))
            .count();
        // per-tensor quantization (GGUF): every part must agree
        let per_part: Vec<_> = parts
            .iter()
            .map(|(p, ..)| tensor_quant(src, p, in_dim, quant))
            .collect();
        if per_part.iter().any(|q| *q != per_part[0]) {
            return Err(LoadError::Mlx(mlx::MlxError::Invalid(format!(
                "Linear::load_merged: {} have different quantization types ({per_part:?}); \
                 merging them is not implemented",
                parts.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
            ))));
        }
        let quant = per_part[0];
        let weight = match quant {
            Some(q) if quantized == parts.len() => {
                let (bits, g) = (q.bits as usize, q.group_size as usize);
                Weight::Quantized {
                    w: stacked("weight", Some(in_dim * bits / 32), TensorKind::Packed)?,
                    scales: stacked("scales", Some(in_dim / g), TensorKind::Scales)?,
                    biases: stacked("biases", Some(in_dim / g), TensorKind::QuantBiases)?,
                    q,
                }
            }
            Some(_) if quantized > 0 => {
                return Err(LoadError::Mlx(mlx::MlxError::Invalid(format!(
                    "Linear::load_merged: {} of {} parts ({}) are quantized",
                    quantized,
                    parts.len(),
                    parts.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
                ))))
            }
            _ => Weight::Dense(stacked("weight", Some(in_dim), TensorKind::Float)?),
        };
        Ok(Linear {
            weight,
            bias,
            reduce: None,
        })
    }

    pub fn forward(&self, x: &Array) -> mlx::Result<Array> {
        let y = match (&self.weight, &self.bias, &self.reduce) {
            (Weight::Dense(w), Some(b), None) => return x.addmm(&w.t()?, b),
            (Weight::Dense(w), _, _) => x.matmul(&w.t()?)?,
            (
                Weight::Quantized {
                    w,
                    scales,
                    biases,
                    q,
                },
                _,
                _,
            ) => quantized_forward(x, w, scales, biases, q)?,
        };
        let y = match &self.reduce {
            Some(g) => g.all_sum(&y)?,
            None => y,
        };
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    /// `self(norm(x))` shaped `shape` (same number of elements), written in that shape by
    /// the quantized GEMV kernel (no reshape op) when it runs, which then also applies
    /// the norm (no separate RMSNorm op).
    pub fn forward_shaped(
        &self,
        x: &Array,
        shape: &[i32],
        norm: Option<&RmsNorm>,
    ) -> mlx::Result<Array> {
        if let Some(y) = self.fused(x, shape, Epilogue::None, norm) {
            return y;
        }
        self.forward(&apply_norm(x, norm)?)?.reshape(shape)
    }

    /// `res + self(x)`, shaped like `res`. `x` may be any shape holding `res`'s rows of
    /// this layer's input size (e.g. attention output `[B, heads, 1, head_dim]` of a
    /// decode step). On the quantized GEMV kernel the add is fused into the kernel.
    pub fn forward_residual(&self, x: &Array, res: &Array) -> mlx::Result<Array> {
        if let Some(y) = self.fused(x, &res.shape(), Epilogue::Residual(res), None) {
            return y;
        }
        // same rank as res too: a [B, heads, 1, D] input with D equal to the input size
        // (one head per rank) would otherwise broadcast against res
        let x = if x.dim(-1) as usize == self.in_dim() && x.ndim() == res.ndim() {
            x.clone()
        } else {
            let mut shape = res.shape();
            *shape.last_mut().expect("res has a last axis") = self.in_dim() as i32;
            x.reshape(&shape)?
        };
        res.add(&self.forward(&x)?)
    }

    /// `silu(g) · u` for a merged `[gate; up]` projection of `norm(x)` (`[.., 2 · inter]` →
    /// `[.., inter]`). On the quantized GEMV kernel the norm, both halves and the
    /// activation are one kernel.
    pub fn forward_swiglu(&self, x: &Array, norm: Option<&RmsNorm>) -> mlx::Result<Array> {
        let mut shape = x.shape();
        *shape.last_mut().expect("x has a last axis") = (self.out_dim() / 2) as i32;
        if let Some(y) = self.fused(x, &shape, Epilogue::SwiGlu, norm) {
            return y;
        }
        let gu = self.forward(&apply_norm(x, norm)?)?;
        let half = gu.dim(-1) / 2;
        let mut parts = mlx::split_sections(&gu, &[half], -1)?.into_iter();
        let (Some(g), Some(u)) = (parts.next(), parts.next()) else {
            return Err(mlx::MlxError::Invalid("gate/up split".into()));
        };
        fast::swiglu(&g, &u)
    }

    /// Input features (columns of the unquantized weight).
    pub fn in_dim(&self) -> usize {
        match &self.weight {
            Weight::Dense(w) => w.dim(1) as usize,
            Weight::Quantized { w, q, .. } => w.dim(1) as usize * 32 / q.bits as usize,
        }
    }

    /// Output features (rows of the weight).
    pub fn out_dim(&self) -> usize {
        match &self.weight {
            Weight::Dense(w) | Weight::Quantized { w, .. } => w.dim(0) as usize,
        }
    }

    /// The merged q/k/v projection of a one-token step, `norm(x) · Wᵀ` for `nq` query
    /// heads and equally many key and value heads of `head_dim`, with `rope` applied to
    /// q and k at positions `pos` (one per row of x), in one run of mlxcel's GEMV kernel:
    /// q `[B, nq, 1, head_dim]` and kv `[B, 2·nkv, 1, head_dim]` (key heads, then value
    /// heads, as the KV cache stores them). `None` when the kernel does not cover it
    /// (see [`Linear::fused`]; also a partial rotary dimension): the caller runs the plain ops.
    pub fn forward_qkv_rope(
        &self,
        x: &Array,
        norm: Option<&RmsNorm>,
        pos: &Array,
        rope: &Rope,
        nq: usize,
        head_dim: usize,
    ) -> Option<mlx::Result<(Array, Array)>> {
        let f = self.fusable(x, norm)?;
        let fits = rope.dims as usize == head_dim
            && pos.size() == f.m
            && pos.dtype() == Dtype::I32
            && kernels::qgemv::supports_rope(f.m, f.n, f.group, f.bits, nq, head_dim);
        fits.then(|| {
            kernels::qgemv::qgemv_rope(
                x,
                f.w,
                f.scales,
                f.biases,
                f.group,
                f.bits,
                norm.map(|n| (&n.weight, n.eps)),
                pos,
                &rope.inv_freq,
                nq,
                head_dim,
            )
        })
    }

    /// The quantized weight and sizes when mlxcel's GEMV kernel can compute
    /// `norm(x) · Wᵀ`: a quantized weight with no bias or reduction to apply after an
    /// epilogue, a shape and dtypes the kernel covers, and (with a norm) a norm weight
    /// of x's dtype with one value per input feature.
    fn fusable(&self, x: &Array, norm: Option<&RmsNorm>) -> Option<Fusable<'_>> {
        let Weight::Quantized {
            w,
            scales,
            biases,
            q,
        } = &self.weight
        else {
            return None;
        };
        if self.bias.is_some() || self.reduce.is_some() || !kernels::qgemv::enabled() {
            return None;
        }
        let (n, k) = (self.out_dim(), self.in_dim());
        let m = x.size().checked_div(k).unwrap_or(0);
        let (group, bits) = (q.group_size as usize, q.bits as usize);
        let norm_fits = norm.is_none_or(|n| n.weight.size() == k && n.weight.dtype() == x.dtype());
        let fits = norm_fits
            && m * k == x.size()
            && kernels::qgemv::supports(m, n, k, group, bits, [x.dtype(), scales.dtype()]);
        fits.then_some(Fusable {
            w,
            scales,
            biases,
            group,
            bits,
            m,
            n,
        })
    }

    /// `norm(x) · Wᵀ` and `epi` in one run of mlxcel's GEMV kernel, shaped `shape`, when
    /// the kernel can do it all ([`Linear::fusable`]; SwiGLU needs an even number of rows
    /// per block; a residual of the output's size and x's dtype). `None`: the caller runs
    /// the plain ops.
    fn fused(
        &self,
        x: &Array,
        shape: &[i32],
        epi: Epilogue<'_>,
        norm: Option<&RmsNorm>,
    ) -> Option<mlx::Result<Array>> {
        let f = self.fusable(x, norm)?;
        let epi_fits = match epi {
            Epilogue::Residual(r) => r.dtype() == x.dtype() && r.size() == f.m * f.n,
            Epilogue::SwiGlu => kernels::qgemv::supports_swiglu(f.m, f.n, f.group, f.bits),
            Epilogue::None => true,
        };
        epi_fits.then(|| {
            kernels::qgemv::qgemv(
                x,
                f.w,
                f.scales,
                f.biases,
                f.group,
                f.bits,
                shape,
                epi,
                norm.map(|n| (&n.weight, n.eps)),
            )
        })
    }

    /// Arrays held (for memory accounting).
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v: Vec<&Array> = match &self.weight {
            Weight::Dense(w) => vec![w],
            Weight::Quantized {
                w, scales, biases, ..
            } => vec![w, scales, biases],
        };
        v.extend(self.bias.iter());
        v
    }
}

/// What [`Linear::fusable`] found: the quantized weight, its group and bits, and the
/// product's rows (`m`) and output features (`n`).
struct Fusable<'a> {
    w: &'a Array,
    scales: &'a Array,
    biases: &'a Array,
    group: usize,
    bits: usize,
    m: usize,
    n: usize,
}

fn apply_norm(x: &Array, norm: Option<&RmsNorm>) -> mlx::Result<Array> {
    match norm {
        Some(n) => n.forward(x),
        None => Ok(x.clone()),
    }
}

/// The quantization of linear `prefix`: the bits and group size its stored tensors imply
/// (packed `.weight` `[out, in · bits / 32]`, `.scales` `[out, in / group]`) where the source
/// says, else the config's `quant`. A checkpoint may quantize tensors differently (GGUF:
/// 4-bit Q4_1 linears beside an 8-bit Q8_0 embedding).
fn tensor_quant(
    src: &dyn WeightSource,
    prefix: &str,
    in_dim: usize,
    quant: Option<QuantConfig>,
) -> Option<QuantConfig> {
    let q = quant?;
    let info = |s: &str| src.info(&format!("{prefix}.{s}")).ok().flatten();
    match (info("weight"), info("scales")) {
        (Some(w), Some(s))
            if w.dtype == Dtype::U32 && w.shape.len() == 2 && s.shape.len() == 2 && in_dim > 0 =>
        {
            let bits = w.shape[1] * 32 / in_dim;
            let group = in_dim / s.shape[1].max(1);
            Some(QuantConfig {
                bits: bits as i32,
                group_size: group as i32,
            })
        }
        _ => Some(q),
    }
}

/// Rows of x from which a GPU multiplies by the dequantized weight (one bf16 GEMM,
/// the weight dequantized into a temporary) rather than with `quantized_matmul`:
/// prefill runs at the dense GEMM's speed (4.7× MLX's quantized GEMM on H200).
const DEQUANT_GEMM_MIN_ROWS: usize = 32;

/// `x · dequantize(w)ᵀ`: mlxcel's GEMV kernel for decode on CUDA, dequantize + GEMM
/// for long inputs on a GPU, MLX's `quantized_matmul` otherwise.
fn quantized_forward(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    q: &QuantConfig,
) -> mlx::Result<Array> {
    let k = x.dim(-1) as usize;
    let n = w.dim(0) as usize;
    let m = x.size().checked_div(k).unwrap_or(0);
    let (group, bits) = (q.group_size as usize, q.bits as usize);
    if kernels::qgemv::enabled()
        && kernels::qgemv::supports(m, n, k, group, bits, [x.dtype(), scales.dtype()])
    {
        let mut shape = x.shape();
        *shape.last_mut().expect("x has a last axis") = n as i32;
        return kernels::qgemv::qgemv(
            x,
            w,
            scales,
            biases,
            group,
            bits,
            &shape,
            Epilogue::None,
            None,
        );
    }
    if m >= DEQUANT_GEMM_MIN_ROWS && mlx::backend() != mlx::Backend::Cpu {
        return dequant_gemm(x, w, scales, biases, q);
    }
    fast::quantized_matmul(x, w, scales, biases, true, q.group_size, q.bits)
}

/// `x · dequantize(w)ᵀ` as a dense GEMM. The dequantization is ordered after `x`
/// exists, so MLX does not dequantize weights before their input is there; across
/// layers the bound that matters on a GPU is the forward pass's layers in flight
/// (`Transformer::forward_slot_ids`).
fn dequant_gemm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    q: &QuantConfig,
) -> mlx::Result<Array> {
    let wd = fast::dequantize(&w.depends_on(x)?, scales, biases, q.group_size, q.bits)?;
    x.matmul(&wd.t()?)
}

/// Token embedding table, `[vocab, hidden]`, dense or quantized.
pub struct Embedding {
    table: Linear,
}

impl Embedding {
    pub fn load(
        src: &dyn WeightSource,
        prefix: &str,
        vocab: usize,
        hidden: usize,
        quant: Option<QuantConfig>,
    ) -> Result<Self> {
        Ok(Embedding {
            table: Linear::load(src, prefix, hidden, vocab, false, quant, Shard::Full)?,
        })
    }

    /// Rows for `ids` (any shape) → `[..., hidden]`.
    pub fn forward(&self, ids: &Array) -> mlx::Result<Array> {
        match &self.table.weight {
            Weight::Dense(w) => w.take(ids, 0),
            Weight::Quantized {
                w,
                scales,
                biases,
                q,
            } => {
                let rows = w.take(ids, 0)?;
                let s = scales.take(ids, 0)?;
                let b = biases.take(ids, 0)?;
                fast::dequantize(&rows, &s, &b, q.group_size, q.bits)
            }
        }
    }

    /// The table as the output projection (tied embeddings).
    pub fn as_linear(&self) -> &Linear {
        &self.table
    }

    pub fn arrays(&self) -> Vec<&Array> {
        self.table.arrays()
    }

    /// Element type of the embedding output.
    pub fn out_dtype(&self) -> Dtype {
        match &self.table.weight {
            Weight::Dense(w) => w.dtype(),
            Weight::Quantized { scales, .. } => scales.dtype(),
        }
    }
}

/// RMSNorm with a learned scale.
pub struct RmsNorm {
    pub weight: Array,
    pub eps: f32,
}

impl RmsNorm {
    pub fn load(src: &dyn WeightSource, name: &str, dim: usize, eps: f32) -> Result<Self> {
        Ok(RmsNorm {
            weight: src.load(name, &[dim], TensorKind::Norm)?,
            eps,
        })
    }

    pub fn forward(&self, x: &Array) -> mlx::Result<Array> {
        fast::rms_norm(x, Some(&self.weight), self.eps)
    }
}

/// Rotary position embedding (half-split, as in HF Llama), with the frequencies of
/// the config's rope type ([`crate::models::config::RopeScaling`]).
pub struct Rope {
    dims: i32,
    base: f32,
    /// Scaled periods (`1 / inv_freq`), passed to MLX as `freqs`; `None` for plain RoPE.
    freqs: Option<Array>,
    /// float32 `[dims / 2]`: the angle of pair d at position p is `p · inv_freq[d]`
    /// (`base^(-2d/dims)` as the rope type scales it), for the fused q/k/v kernel.
    inv_freq: Array,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> mlx::Result<Rope> {
        let dims = cfg.head_dim as i32;
        let inv = cfg.rope.inv_freq(cfg.head_dim);
        let freqs = match cfg.rope.scaling {
            RopeScaling::None => None,
            _ => {
                let periods: Vec<f32> = inv.iter().map(|&f| (1.0 / f as f64) as f32).collect();
                Some(Array::from_slice(&periods, &[dims / 2])?)
            }
        };
        let inv_freq = Array::from_slice(&inv, &[dims / 2])?;
        Ok(Rope {
            dims,
            base: cfg.rope.theta,
            freqs,
            inv_freq,
        })
    }

    /// Rotate `x` (`[B, heads, L, head_dim]`); `offset` is a scalar or one start position per batch row.
    pub fn forward(&self, x: &Array, offset: &Array) -> mlx::Result<Array> {
        match &self.freqs {
            Some(f) => fast::rope_with_freqs(x, self.dims, false, 1.0, offset, f),
            None => fast::rope_dynamic(x, self.dims, false, self.base, 1.0, offset),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Peak memory of a 12-layer chain of 4-bit linears through the dequantize +
    /// GEMM path, as one lazy graph: with the ordering, about one dequantized
    /// weight is alive at a time; without it, MLX may hold all of them.
    fn chain_peak(ordered: bool) -> u64 {
        let (n, layers, m) = (512usize, 12usize, 64usize);
        let q = QuantConfig {
            group_size: 64,
            bits: 4,
        };
        let ws: Vec<(Array, Array, Array)> = (0..layers)
            .map(|i| {
                let key = mlx::random::key(i as u64).unwrap();
                let w = mlx::random::normal(&[n as i32, n as i32], Dtype::F32, 0.0, 0.05, &key)
                    .unwrap();
                fast::quantize(&w, 64, 4).unwrap()
            })
            .collect();
        let all: Vec<&Array> = ws.iter().flat_map(|(a, b, c)| [a, b, c]).collect();
        mlx::eval(&all).unwrap();
        let mut x = Array::full(&[m as i32, n as i32], 0.01, Dtype::F32).unwrap();
        x.eval().unwrap();
        mlx::memory::clear_cache();
        mlx::memory::reset_peak();
        let base = mlx::memory::active();
        for (w, s, b) in &ws {
            x = if ordered {
                dequant_gemm(&x, w, s, b, &q).unwrap()
            } else {
                let wd = fast::dequantize(w, s, b, 64, 4).unwrap();
                x.matmul(&wd.t().unwrap()).unwrap()
            };
        }
        x.eval().unwrap();
        mlx::memory::peak() - base
    }

    #[test]
    fn forward_residual_takes_one_head_per_rank_attention_output() {
        // [B, heads = 1, 1, D] with D equal to the input size: the result must keep res's
        // shape [B, 1, hidden] (not broadcast to [B, B, 1, hidden])
        let (b, d, hidden) = (2, 8, 4);
        let w = Array::from_slice(
            &(0..hidden * d).map(|i| i as f32 * 0.01).collect::<Vec<_>>(),
            &[hidden, d],
        )
        .unwrap();
        let lin = Linear {
            weight: Weight::Dense(w.clone()),
            bias: None,
            reduce: None,
        };
        let x = Array::from_slice(
            &(0..b * d).map(|i| i as f32 * 0.1).collect::<Vec<_>>(),
            &[b, 1, 1, d],
        )
        .unwrap();
        let res = Array::full(&[b, 1, hidden], 1.0, Dtype::F32).unwrap();
        let y = lin.forward_residual(&x, &res).unwrap();
        assert_eq!(y.shape(), vec![b, 1, hidden]);
        let want = res
            .add(
                &x.reshape(&[b, 1, d])
                    .unwrap()
                    .matmul(&w.t().unwrap())
                    .unwrap(),
            )
            .unwrap();
        let (y, want) = (y.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        assert!(
            y.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5),
            "{y:?} vs {want:?}"
        );
    }

    #[test]
    fn dequant_gemm_holds_one_layer_of_dequantized_weights() {
        let one = 512 * 512 * 4; // one dequantized f32 weight
        let ordered = chain_peak(true);
        let unordered = chain_peak(false);
        // measured on the CPU backend: ~4.4 weights ordered, ~16 unordered (all 12 alive)
        assert!(
            ordered < 6 * one as u64,
            "peak {ordered} bytes with the ordering, one weight is {one}"
        );
        assert!(
            unordered > 2 * ordered,
            "the unordered chain ({unordered} bytes) should show what the ordering prevents ({ordered})"
        );
    }

    /// The inverse frequencies the fused q/k/v kernel rotates with are the ones MLX's
    /// `fast::rope` uses: rotating by `pos · inv_freq[d]` by hand matches MLX's RoPE, for
    /// plain θ and for Llama-3 scaling (whose `freqs` are periods).
    #[test]
    fn rope_inv_freq_matches_mlx_rope() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        for fixture in [
            "llama3",
            "llama_gqa2_tied",
            "rope_llama3",
            "rope_linear",
            "rope_yarn",
        ] {
            let text = std::fs::read_to_string(dir.join(fixture).join("config.json")).unwrap();
            let cfg = ModelConfig::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
            let rope = Rope::new(&cfg).unwrap();
            let d = cfg.head_dim;
            let x: Vec<f32> = (0..d).map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0).collect();
            let xa = Array::from_slice(&x, &[1, 1, 1, d as i32]).unwrap();
            let inv = rope.inv_freq.to_vec::<f32>().unwrap();
            assert_eq!(inv.len(), d / 2);
            for pos in [0, 1, 37, 1000] {
                let got = rope
                    .forward(&xa, &Array::scalar_i32(pos).unwrap())
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
                for i in 0..d / 2 {
                    let th = pos as f64 * inv[i] as f64;
                    let (a, b) = (x[i] as f64, x[i + d / 2] as f64);
                    let want = [a * th.cos() - b * th.sin(), a * th.sin() + b * th.cos()];
                    for (g, w) in [got[i], got[i + d / 2]].into_iter().zip(want) {
                        assert!(
                            (g as f64 - w).abs() < 2e-3,
                            "{fixture} pos {pos} pair {i}: MLX {g}, by inv_freq {w}"
                        );
                    }
                }
            }
        }
    }
}
