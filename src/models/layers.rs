//! Building blocks that model files call like single-device layers: linear
//! (dense or MLX-affine-quantized), embedding, rotary embedding.
//! Each layer loads its tensors from its parameter specs (`models::layout`).
use std::rc::Rc;

use crate::kernels::{self, qgemv::Epilogue};
use crate::mlx::distributed::Group;
use crate::mlx::{self, fast, Array, Dtype};

use super::blocks::norm::RmsNorm;
use super::config::{ModelConfig, QuantConfig, RopeScaling};
use super::layout::{ParamSpec, Split};
use super::shard::VocabShard;
use super::weights::{device_const, LoadError, RowBlock, WeightSource};

pub type Result<T> = std::result::Result<T, LoadError>;

enum Weight {
    Dense(Array),
    Quantized {
        w: Array,
        scales: Array,
        biases: Array,
        q: QuantConfig,
    },
}

impl Weight {
    /// `[weight]`, or `[packed weight, scales, biases]` with `quant`.
    fn from_parts(parts: Vec<Array>, quant: Option<QuantConfig>) -> Weight {
        let mut it = parts.into_iter();
        match (quant, it.next(), it.next(), it.next()) {
            (Some(q), Some(w), Some(scales), Some(biases)) => Weight::Quantized {
                w,
                scales,
                biases,
                q,
            },
            (_, Some(w), ..) => Weight::Dense(w),
            _ => unreachable!("a linear's tensors start with its weight"),
        }
    }
}

fn invalid(msg: String) -> LoadError {
    LoadError::Mlx(mlx::MlxError::Invalid(msg))
}

/// `y = x Wᵀ (+ b)`, with W dense `[out, in]` or MLX affine-quantized, possibly one
/// rank's block of it (see [`Split`]); model code calls it like a plain linear layer.
pub struct Linear {
    weight: Weight,
    /// A dense weight transposed, `[in, out]`: a view of it made once (evaluated with the
    /// first step that uses it), so that no step builds a transpose per matmul.
    wt: Option<Array>,
    bias: Option<Array>,
    reduce: Option<Rc<Group>>,
}

impl Linear {
    fn new(weight: Weight, bias: Option<Array>, reduce: Option<Rc<Group>>) -> Result<Linear> {
        let wt = match &weight {
            Weight::Dense(w) => Some(w.t()?),
            Weight::Quantized { .. } => None,
        };
        Ok(Linear {
            weight,
            wt,
            bias,
            reduce,
        })
    }

    /// Load the tensors of `spec` ([`ParamSpec::tensors`]: `.weight`, and `.scales` /
    /// `.biases` when quantized, `.bias`), reading only this rank's block of each; a
    /// row-parallel spec's partial sums are `all_sum`med over `reduce` when given. A
    /// vocab-parallel spec loads its rows like a column-parallel one; [`VocabRows`]
    /// gathers what they compute.
    pub fn load(
        src: &dyn WeightSource,
        spec: &ParamSpec,
        reduce: Option<Rc<Group>>,
    ) -> Result<Linear> {
        let quant = spec.quantization_stored(
            |n| src.contains(n),
            |n| src.info(n).ok().flatten().map(|i| i.shape),
        );
        let reduce = reduce.filter(|_| matches!(spec.split, Split::Row(_)));
        let mut bias = None;
        let mut parts = Vec::with_capacity(3);
        for t in spec.tensors(quant) {
            let a = src.load_block(&t.name, &t.shape, t.rows, t.cols, t.kind)?;
            match t.suffix {
                "bias" => bias = Some(a),
                _ => parts.push(a),
            }
        }
        Linear::new(Weight::from_parts(parts, quant), bias, reduce)
    }

    /// One linear computing several column-parallel (or whole) linears side by side, so one
    /// matmul replaces several; callers split the output. `parts` have the same input,
    /// bias and quantization. Their weights (and scales/biases when quantized, and output
    /// biases) are stacked along the output axis as they are read, not concatenated
    /// afterwards.
    pub fn load_merged(src: &dyn WeightSource, parts: &[&ParamSpec]) -> Result<Linear> {
        if let Some(p) = parts
            .iter()
            .find(|p| matches!(p.split, Split::Row(_) | Split::Vocab(_)))
        {
            return Err(invalid(format!(
                "Linear::load_merged: {} is row- or vocab-parallel; only column-parallel \
                 or whole linears can be merged",
                p.name
            )));
        }
        let quants: Vec<_> = parts
            .iter()
            .map(|p| {
                p.quantization_stored(
                    |n| src.contains(n),
                    |n| src.info(n).ok().flatten().map(|i| i.shape),
                )
            })
            .collect();
        let quant = quants.first().copied().flatten();
        if quants.iter().any(|q| *q != quant) {
            return Err(invalid(format!(
                "Linear::load_merged: {} of {} parts ({}) are quantized",
                quants.iter().filter(|q| q.is_some()).count(),
                parts.len(),
                parts
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        // tensor i of every part, stacked: the parts' tensors come in the same order
        let tensors: Vec<_> = parts.iter().map(|p| p.tensors(quant)).collect();
        let mut bias = None;
        let mut stacked = Vec::with_capacity(3);
        for i in 0..tensors.first().map_or(0, |t| t.len()) {
            let blocks: Vec<RowBlock> = tensors
                .iter()
                .map(|t| (t[i].name.clone(), t[i].shape.clone(), t[i].rows.clone()))
                .collect();
            let a = src.load_concat(&blocks, tensors[0][i].kind)?;
            match tensors[0][i].suffix {
                "bias" => bias = Some(a),
                _ => stacked.push(a),
            }
        }
        Linear::new(Weight::from_parts(stacked, quant), bias, None)
    }

    pub fn forward(&self, x: &Array) -> mlx::Result<Array> {
        if let (Weight::Dense(_), Some(b), None) = (&self.weight, &self.bias, &self.reduce) {
            return x.addmm(self.dense_t(), b);
        }
        let y = self.local(x)?;
        let y = match &self.reduce {
            Some(g) => g.all_sum(&y)?,
            None => y,
        };
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    /// `x · Wᵀ` of this rank's block alone: no reduction, no bias.
    fn local(&self, x: &Array) -> mlx::Result<Array> {
        match &self.weight {
            // a decode step's rows on mlxcel's dense GEMV kernel (CUDA; MLXCEL_GEMV_DENSE=0 turns it off)
            Weight::Dense(w) if dense_gemv_fits(x, w) => {
                let mut shape = x.shape();
                *shape.last_mut().expect("x has a last axis") = w.dim(0);
                kernels::gemv::gemv(x, w, &shape, Epilogue::None, None)
            }
            Weight::Dense(_) => x.matmul(self.dense_t()),
            Weight::Quantized {
                w,
                scales,
                biases,
                q,
            } => quantized_forward(x, w, scales, biases, q),
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
    /// decode step). On the quantized GEMV kernel the add is fused into the kernel; a
    /// dense weight with a 2-D `res` (a decode step's rows) adds it in the matmul (one
    /// `AddMM` op; row-parallel, rank 0's, before the reduction; `MLXCEL_ADDMM_RESIDUAL=0`:
    /// a matmul and an add). Row-parallel with `MLXCEL_TP_RESIDUAL=1`: rank 0 adds the
    /// residual before the reduction (in the kernel's epilogue where one runs), the other
    /// ranks reduce their product alone, and no add follows the reduction.
    pub fn forward_residual(&self, x: &Array, res: &Array) -> mlx::Result<Array> {
        let knobs = kernels::knobs::get();
        // (every rank must reduce the same dtype: a residual of another dtype would make
        // rank 0's sum wider than the others')
        let same_dtype = res.dtype() == x.dtype();
        if let Some(g) = self
            .reduce
            .as_ref()
            .filter(|_| self.bias.is_none() && same_dtype)
        {
            if knobs.tp_residual {
                // row-parallel, MLXCEL_TP_RESIDUAL=1: rank 0 adds the (replicated)
                // residual to its partial product, so the reduction's result is already
                // `res + x · Wᵀ` on every rank
                return g.all_sum(&self.local_residual(x, res, g.rank() == 0)?);
            }
        }
        if let Some(y) = self.fused(x, &res.shape(), Epilogue::Residual(res), None) {
            return y;
        }
        if res.ndim() == 2
            && self.bias.is_none()
            && matches!(self.weight, Weight::Dense(_))
            && knobs.addmm_residual
        {
            let x = x.reshape(&[res.dim(0), self.in_dim() as i32])?;
            return match &self.reduce {
                None => x.addmm(self.dense_t(), res),
                // row-parallel: rank 0 adds the (replicated) residual to its partial sum,
                // so the reduction's result is already `res + x · Wᵀ`, on every rank
                Some(g) if g.rank() == 0 => g.all_sum(&x.addmm(self.dense_t(), res)?),
                Some(g) => g.all_sum(&x.matmul(self.dense_t())?),
            };
        }
        res.add(&self.forward(&self.input_like(x, res)?)?)
    }

    /// This rank's `res + x · Wᵀ` (`add`) or `x · Wᵀ`, shaped like `res`, with no
    /// reduction and no bias: in the GEMV/GEMM kernel's epilogue where one runs, else one
    /// `AddMM` for a dense weight and a 2-D `res` (`MLXCEL_ADDMM_RESIDUAL=1`), else the
    /// product and an add.
    fn local_residual(&self, x: &Array, res: &Array, add: bool) -> mlx::Result<Array> {
        let epi = match add {
            true => Epilogue::Residual(res),
            false => Epilogue::None,
        };
        if let Some(y) = self.fused_local(x, &res.shape(), epi, None) {
            return y;
        }
        let dense = matches!(self.weight, Weight::Dense(_));
        if add && res.ndim() == 2 && dense && kernels::knobs::get().addmm_residual {
            let x = x.reshape(&[res.dim(0), self.in_dim() as i32])?;
            return x.addmm(self.dense_t(), res);
        }
        let y = self.local(&self.input_like(x, res)?)?;
        match add {
            true => res.add(&y),
            false => Ok(y),
        }
    }

    /// `x` shaped like `res` with this layer's input size as its last axis (`x` may hold
    /// `res`'s rows in another shape, e.g. `[B, heads, 1, head_dim]`).
    fn input_like(&self, x: &Array, res: &Array) -> mlx::Result<Array> {
        // same rank as res too: a [B, heads, 1, D] input with D equal to the input size
        // (one head per rank) would otherwise broadcast against res
        if x.dim(-1) as usize == self.in_dim() && x.ndim() == res.ndim() {
            return Ok(x.clone());
        }
        let mut shape = res.shape();
        *shape.last_mut().expect("res has a last axis") = self.in_dim() as i32;
        x.reshape(&shape)
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

    /// The dense weight transposed (`[in, out]`, see [`Linear::wt`]).
    fn dense_t(&self) -> &Array {
        self.wt
            .as_ref()
            .expect("a dense linear has its transposed view")
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

    /// Whether a one-token step's q/k/v projection may run on one of mlxcel's GEMV kernels
    /// (CUDA, the kernel for its weight's kind on, no reduction after it; a bias, which
    /// the q/k/v + RoPE entry points add): what [`Linear::forward_qkv_rope`] needs before
    /// the shapes are looked at.
    pub fn on_gemv_kernel(&self) -> bool {
        let kernel = match &self.weight {
            Weight::Dense(_) => kernels::gemv::enabled(),
            Weight::Quantized { .. } => kernels::qgemv::enabled(),
        };
        kernel && self.reduce.is_none()
    }

    /// The merged q/k/v projection of a one-token step, `norm(x) · Wᵀ` for `nq` query
    /// heads and equally many key and value heads of `head_dim`, with `rope` applied to
    /// q and k at positions `pos` (one per row of x), in one run of mlxcel's GEMV kernel:
    /// q `[B, nq, 1, head_dim]` and kv `[B, 2·nkv, 1, head_dim]` (key heads, then value
    /// heads, as the KV cache stores them). With `into` (a layer's KV pool and the step's
    /// rows there, see `kernels::qgemv::qgemv_rope`) k and v go straight into the pool and
    /// kv is `None`; the GEMV kernels do that, the quantized GEMM (9–128 rows) does not, so
    /// `into` is ignored there. A bias (Qwen2's q/k/v biases) is added in the kernels before
    /// the rotation. `None` when the kernel does not cover it (see
    /// [`Linear::fused`]; also a partial rotary dimension): the caller runs the plain ops.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_qkv_rope(
        &self,
        x: &Array,
        norm: Option<&RmsNorm>,
        pos: &Array,
        rope: &Rope,
        nq: usize,
        head_dim: usize,
        into: Option<(&Array, &Array)>,
    ) -> Option<mlx::Result<(Array, Option<Array>)>> {
        if self.reduce.is_some() {
            return None;
        }
        let f = self.fusable(x, norm, true)?;
        let bias = self.bias.as_ref();
        let inv = rope.whole_head_inv_freq(head_dim)?;
        let fits = pos.size() == f.m && pos.dtype() == Dtype::I32;
        let nw = norm.map(|n| (&n.weight, n.eps));
        let (w, scales, biases, group, bits) = (f.w, f.scales, f.biases, f.group, f.bits);
        if f.dense {
            let fits = fits && kernels::gemv::supports_rope(f.m, f.n, nq, head_dim);
            // (MLXCEL_GEMV_MMA_KV=0: the tensor-core launch (4-16 rows) returns k and v
            // for the cache to write, see `kernels::gemv::writes_kv`)
            let into = into.filter(|_| kernels::gemv::writes_kv(f.m, f.n, w.dim(1) as usize));
            return fits
                .then(|| kernels::gemv::gemv_rope(x, w, nw, pos, inv, nq, head_dim, into, bias));
        }
        // the GEMM for 9-128 rows (4-bit: 17-128; MLXCEL_QGEMM=0 off), else the GEMV
        if f.gemm {
            let fits = fits && kernels::qgemm::supports_rope(f.n, nq, head_dim);
            return fits.then(|| {
                kernels::qgemm::qgemm_rope(
                    x, w, scales, biases, group, bits, nw, pos, inv, nq, head_dim, bias,
                )
            });
        }
        let fits = fits && kernels::qgemv::supports_rope(f.m, f.n, group, bits, nq, head_dim);
        let into = into.filter(|_| f.m <= kernels::qgemv::MAX_M);
        fits.then(|| {
            kernels::qgemv::qgemv_rope(
                x, w, scales, biases, group, bits, nw, pos, inv, nq, head_dim, into, bias,
            )
        })
    }

    /// The quantized weight and sizes when mlxcel's GEMV kernel (or, for batches of
    /// 9–128 rows, 17–128 at 4 bits, its GEMM) can compute `norm(x) · Wᵀ` of this rank's
    /// block: a quantized weight with no bias to apply after an epilogue (the callers
    /// decide about a reduction), a shape and dtypes the
    /// kernel covers, and (with a norm) a norm weight of x's dtype with one value per input
    /// feature.
    fn fusable(&self, x: &Array, norm: Option<&RmsNorm>, bias_ok: bool) -> Option<Fusable<'_>> {
        // (a bias only where the caller's kernel adds it: the q/k/v + RoPE entry points, for
        // a bias of x's dtype with one value per output)
        let bias_ok = bias_ok && kernels::knobs::get().qkv_bias;
        let bias_fits = self
            .bias
            .as_ref()
            .is_none_or(|b| bias_ok && b.dtype() == x.dtype() && b.size() == self.out_dim());
        if !bias_fits {
            return None;
        }
        let (n, k) = (self.out_dim(), self.in_dim());
        let m = x.size().checked_div(k).unwrap_or(0);
        let norm_fits = norm.is_none_or(|n| n.weight.size() == k && n.weight.dtype() == x.dtype());
        let (w, scales, biases, q) = match &self.weight {
            Weight::Quantized {
                w,
                scales,
                biases,
                q,
            } => (w, scales, biases, q),
            // a dense weight on mlxcel's dense GEMV kernel (CUDA; MLXCEL_GEMV_DENSE=0 turns it off)
            Weight::Dense(w) => {
                let fits = norm_fits && dense_gemv_fits(x, w);
                return fits.then_some(Fusable {
                    w,
                    scales: w,
                    biases: w,
                    group: 0,
                    bits: 0,
                    m,
                    n,
                    dense: true,
                    gemm: false,
                });
            }
        };
        let (group, bits) = (q.group_size as usize, q.bits as usize);
        let dtypes = [x.dtype(), scales.dtype()];
        // batches of 9-128 rows (4-bit: 17-128) on the GEMM, the rest on the GEMV
        let gemm =
            kernels::qgemm::enabled() && kernels::qgemm::supports(m, n, k, group, bits, dtypes);
        if !gemm && !kernels::qgemv::enabled() {
            return None;
        }
        let fits = norm_fits
            && m * k == x.size()
            && (gemm || kernels::qgemv::supports(m, n, k, group, bits, dtypes));
        fits.then_some(Fusable {
            w,
            scales,
            biases,
            group,
            bits,
            m,
            n,
            dense: false,
            gemm,
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
        match self.reduce {
            Some(_) => None,
            None => self.fused_local(x, shape, epi, norm),
        }
    }

    /// [`Linear::fused`] of this rank's block alone, for a caller that reduces the result
    /// itself (the epilogue then must be one that sums: none, or rank 0's residual).
    fn fused_local(
        &self,
        x: &Array,
        shape: &[i32],
        epi: Epilogue<'_>,
        norm: Option<&RmsNorm>,
    ) -> Option<mlx::Result<Array>> {
        let f = self.fusable(x, norm, false)?;
        let epi_fits = match epi {
            Epilogue::Residual(r) => r.dtype() == x.dtype() && r.size() == f.m * f.n,
            Epilogue::SwiGlu if f.dense => kernels::gemv::supports_swiglu(f.m, f.n, self.in_dim()),
            Epilogue::SwiGlu if f.gemm => kernels::qgemm::supports_swiglu(f.n),
            Epilogue::SwiGlu => kernels::qgemv::supports_swiglu(f.m, f.n, f.group, f.bits),
            Epilogue::None => true,
        };
        let norm_w = norm.map(|n| (&n.weight, n.eps));
        if f.dense {
            return epi_fits.then(|| kernels::gemv::gemv(x, f.w, shape, epi, norm_w));
        }
        let run = if f.gemm {
            kernels::qgemm::qgemm as Product
        } else {
            kernels::qgemv::qgemv as Product
        };
        epi_fits.then(|| {
            run(
                x, f.w, f.scales, f.biases, f.group, f.bits, shape, epi, norm_w,
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

/// `h + down(silu(g) · u)` where `[g | u] = gate_up(norm(h))`, for a decode step's rows of
/// `h` (at most [`kernels::qgemv::MLP_MAX_M`]), as one kernel of two stages
/// (`kernels::qgemv::qgemv_mlp`, `MLXCEL_QGEMV_MLP=1`) where it covers these linears:
/// both quantized alike, no biases, gate/up not reduced. Under tensor parallelism rank 0
/// adds the residual and the result is reduced (as [`Linear::forward_residual`] does).
/// `scratch` is the MLP's own, made at its first call. `None`: the caller runs the two
/// products.
pub fn mlp_fused(
    gate_up: &Linear,
    down: &Linear,
    h: &Array,
    norm: &RmsNorm,
    scratch: &std::cell::OnceCell<kernels::qgemv::MlpScratch>,
) -> Option<mlx::Result<Array>> {
    let knobs = kernels::knobs::get();
    if !knobs.qgemv_mlp || gate_up.bias.is_some() || down.bias.is_some() || gate_up.reduce.is_some()
    {
        return None;
    }
    let (
        Weight::Quantized {
            w: w1,
            scales: s1,
            biases: b1,
            q: q1,
        },
        Weight::Quantized {
            w: w2,
            scales: s2,
            biases: b2,
            q: q2,
        },
    ) = (&gate_up.weight, &down.weight)
    else {
        return None;
    };
    // (under TP only with MLXCEL_TP_RESIDUAL=1: the kernel adds the residual before the
    // reduction on rank 0)
    let add = match &down.reduce {
        None => true,
        Some(g) if knobs.tp_residual => g.rank() == 0,
        Some(_) => return None,
    };
    let (hidden, inter) = (gate_up.in_dim(), gate_up.out_dim() / 2);
    let m = h.size().checked_div(hidden).unwrap_or(0);
    let (group, bits) = (q1.group_size as usize, q1.bits as usize);
    let fits = q1 == q2
        && m * hidden == h.size()
        && norm.weight.size() == hidden
        && norm.weight.dtype() == h.dtype()
        && (down.in_dim(), down.out_dim()) == (inter, hidden)
        && kernels::qgemv::mlp_supported(m, inter, hidden, group, bits, [h.dtype(), s1.dtype()]);
    if !fits {
        return None;
    }
    let run = || -> mlx::Result<Array> {
        if scratch.get().is_none() {
            let _ = scratch.set(kernels::qgemv::MlpScratch::new(inter, h.dtype())?);
        }
        let scratch = scratch.get().expect("the scratch was made above");
        let q = |w, scales, biases| kernels::qgemv::QWeight { w, scales, biases };
        let y = kernels::qgemv::qgemv_mlp(
            h,
            q(w1, s1, b1),
            q(w2, s2, b2),
            group,
            bits,
            Some((&norm.weight, norm.eps)),
            h,
            add,
            scratch,
        )?;
        match &down.reduce {
            Some(g) => g.all_sum(&y),
            None => Ok(y),
        }
    };
    Some(run())
}

/// What [`Linear::fusable`] found: the quantized weight, its group and bits, and the
/// product's rows (`m`) and output features (`n`), for the GEMV or (`gemm`) the GEMM; or
/// (`dense`) a dense weight `w` for mlxcel's dense GEMV kernel (scales and biases are `w`
/// then, group and bits 0).
struct Fusable<'a> {
    w: &'a Array,
    scales: &'a Array,
    biases: &'a Array,
    group: usize,
    bits: usize,
    m: usize,
    n: usize,
    dense: bool,
    gemm: bool,
}

/// `qgemv::qgemv` or `qgemm::qgemm` (the same arguments): x, weight, scales, biases, group,
/// bits, output shape, epilogue, norm.
type Product = for<'a, 'b, 'c, 'd, 'e, 'f, 'g, 'h> fn(
    &'a Array,
    &'b Array,
    &'c Array,
    &'d Array,
    usize,
    usize,
    &'e [i32],
    Epilogue<'f>,
    Option<(&'g Array, f32)>,
) -> mlx::Result<Array>;

/// Whether mlxcel's dense GEMV kernel computes `x · wᵀ` for a dense weight `w [n, k]`:
/// the kernel on (CUDA, unless `MLXCEL_GEMV_DENSE=0`), x holding whole rows
/// of `k` (a decode step's rows: at most 3, or a batch on the tensor-core path), and a
/// shape and dtypes the kernel covers.
fn dense_gemv_fits(x: &Array, w: &Array) -> bool {
    if w.ndim() != 2 || !kernels::gemv::enabled() {
        return false;
    }
    let (n, k) = (w.dim(0) as usize, w.dim(1) as usize);
    let m = x.size().checked_div(k).unwrap_or(0);
    m * k == x.size() && kernels::gemv::supports(m, n, k, [x.dtype(), w.dtype()])
}

fn apply_norm(x: &Array, norm: Option<&RmsNorm>) -> mlx::Result<Array> {
    match norm {
        Some(n) => n.forward(x),
        None => Ok(x.clone()),
    }
}

/// Rows of x from which a GPU multiplies by the dequantized weight (one bf16 GEMM,
/// the weight dequantized into a temporary) rather than with `quantized_matmul`. On CUDA
/// (H200, MLX 0.32.4, `scripts/qmm_crossover.py`: the 8B shapes' down, gate_up and qkv)
/// MLX's quantized GEMM on `[m, k]` is 1.7–3.9× faster than dequantize + GEMM at 16–128
/// rows, the two meet near 256 rows at 4 bits and 512 at 8 (fewer bytes to dequantize per
/// row than the quantized GEMM reads), and dequantize + GEMM wins above (3.4× at 2048
/// rows, 4-bit); elsewhere the earlier 32 rows. With mlxcel's GEMM on (it takes up to
/// [`kernels::qgemm::MAX_M`] rows) CUDA goes straight from it to dequantize + GEMM, leaving
/// `quantized_matmul` out: MLX compiles its kernel at first use, and on an H100 the first
/// streams after a cold start waited ~30 s for it (their prompts, 129–255 rows together),
/// against the few hundred µs a layer the 129–255 rows' products cost either way.
fn dequant_gemm_min_rows(bits: usize) -> usize {
    match (mlx::backend(), bits) {
        (mlx::Backend::Cuda, _) if kernels::qgemm::enabled() => kernels::qgemm::MAX_M + 1,
        (mlx::Backend::Cuda, 8) => 512,
        (mlx::Backend::Cuda, _) => 256,
        _ => 32,
    }
}

/// `x · dequantize(w)ᵀ`: mlxcel's GEMV kernel for decode on CUDA (its GEMM for batches of
/// 9–128 rows, 17–128 at 4 bits, unless `MLXCEL_QGEMM=0`), dequantize + GEMM for long
/// inputs on a GPU, MLX's `quantized_matmul` otherwise.
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
    let dtypes = [x.dtype(), scales.dtype()];
    let mut shape = x.shape();
    *shape.last_mut().expect("x has a last axis") = n as i32;
    let run = if kernels::qgemm::enabled() && kernels::qgemm::supports(m, n, k, group, bits, dtypes)
    {
        Some(kernels::qgemm::qgemm as Product)
    } else if kernels::qgemv::enabled() && kernels::qgemv::supports(m, n, k, group, bits, dtypes) {
        Some(kernels::qgemv::qgemv as Product)
    } else {
        None
    };
    if let Some(run) = run {
        return run(
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
    if m >= dequant_gemm_min_rows(bits) && mlx::backend() != mlx::Backend::Cpu {
        return dequant_gemm(x, w, scales, biases, q);
    }
    // MLX's CUDA quantized GEMM takes each leading index of x as its own batch: decode's
    // `[b, 1, k]` runs b one-row products, each reading the whole weight (4–19× slower
    // than `[b, k]` at 12–64 rows on H200). As `[m, k]` it reads the weight once.
    let flat = x.ndim() > 2 && m > 1 && x.dim(-2) != m as i32;
    let rows = match flat {
        true => x.reshape(&[m as i32, k as i32])?,
        false => x.clone(),
    };
    let y = fast::quantized_matmul(&rows, w, scales, biases, true, q.group_size, q.bits)?;
    match flat {
        true => y.reshape(&shape),
        false => Ok(y),
    }
}

/// `x · dequantize(w)ᵀ` as a dense GEMM. The dequantization is ordered after `x`
/// exists, so MLX does not dequantize weights before their input is there; across
/// layers the bound that matters on a GPU is the forward pass's layers in flight
/// (`Model::forward`, one slot's chunk).
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
    pub fn load(src: &dyn WeightSource, spec: &ParamSpec) -> Result<Self> {
        Ok(Embedding {
            table: Linear::load(src, spec, None)?,
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

/// What a vocab-parallel rank ([`VocabShard`]) needs beside its rows of the embedding and
/// lm_head: its lookups are its rows for its own ids and zeros for the others' ids, summed
/// over the group (exactly the replicated lookup: one rank adds a row, the others zeros);
/// its logits (`[m, held]`) are gathered into the whole vocabulary's, column for column
/// those of the replicated lm_head.
pub struct VocabRows {
    /// `[vocab]` int32: the row of this rank's table for each token id (0 for the ids of
    /// other ranks, whose rows `own` zeroes).
    local: Array,
    /// `[vocab, 1]` of the table's output dtype: 1 for this rank's ids, 0 elsewhere.
    own: Array,
    /// Rows this rank holds.
    held: usize,
    shard: VocabShard,
    group: Option<Rc<Group>>,
}

impl VocabRows {
    /// The tables of `shard`, lookups in `dtype`, over `group` (`None`: the shard loads,
    /// but its steps fail; the memory plan's tests load ranks without a group).
    pub fn new(shard: &VocabShard, dtype: Dtype, group: Option<Rc<Group>>) -> mlx::Result<Self> {
        let rows = &shard.rows;
        let local: Vec<i32> = (0..shard.vocab)
            .map(|t| {
                if rows.contains(&t) {
                    (t - rows.start) as i32
                } else {
                    0
                }
            })
            .collect();
        let own: Vec<f32> = (0..shard.vocab)
            .map(|t| f32::from(u8::from(rows.contains(&t))))
            .collect();
        let n = shard.vocab as i32;
        let v = VocabRows {
            local: Array::from_slice(&local, &[n])?,
            own: Array::from_slice(&own, &[n, 1])?.astype(dtype)?,
            held: rows.len(),
            shard: shard.clone(),
            group,
        };
        mlx::eval(&[&v.local, &v.own])?;
        Ok(v)
    }

    fn group(&self) -> mlx::Result<&Group> {
        self.group.as_deref().ok_or_else(|| {
            mlx::MlxError::Invalid(format!(
                "vocab-parallel rows {:?} of {} without a tensor-parallel group",
                self.shard.rows, self.shard.vocab
            ))
        })
    }

    /// The embedding of `ids` (any shape) from `table`, this rank's rows of it → `[..., hidden]`.
    pub fn embed(&self, table: &Embedding, ids: &Array) -> mlx::Result<Array> {
        let rows = table.forward(&self.local.take(ids, 0)?)?;
        let own = self.own.take(ids, 0)?;
        self.group()?.all_sum(&rows.mul(&own)?)
    }

    /// The shape this rank's logits are computed in for `rows` positions: `[rows, held]`.
    pub fn local_shape(&self, rows: usize) -> [i32; 2] {
        [rows as i32, self.held as i32]
    }

    /// The whole vocabulary's logits `[m, vocab]` from every rank's `local` (`[m, held]`):
    /// padded to `per_rank` columns (the last ranks of an uneven split), gathered in rank
    /// order (`[ranks · m, per_rank]`), laid out row by row and cut to the vocabulary.
    pub fn gather(&self, local: &Array) -> mlx::Result<Array> {
        let g = self.group()?;
        let (m, per) = (local.dim(0), self.shard.per_rank as i32);
        let local = match self.shard.per_rank - self.held {
            0 => local.clone(),
            pad => {
                let zeros = Array::zeros(&[m, pad as i32], local.dtype())?;
                mlx::concatenate(&[local, &zeros], 1)?
            }
        };
        let all = g.all_gather(&local)?;
        let n = g.size();
        let wide = if m == 1 {
            all.reshape(&[1, n * per])?
        } else {
            all.reshape(&[n, m, per])?
                .transpose(&[1, 0, 2])?
                .reshape(&[m, n * per])?
        };
        if (n * per) as usize > self.shard.vocab {
            wide.slice_axis(1, 0, self.shard.vocab as i32)
        } else {
            Ok(wide)
        }
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
                Some(device_const(Array::from_slice(&periods, &[dims / 2])?)?)
            }
        };
        let inv_freq = device_const(Array::from_slice(&inv, &[dims / 2])?)?;
        Ok(Rope {
            dims,
            base: cfg.rope.theta,
            freqs,
            inv_freq,
        })
    }

    /// The inverse frequencies (float32 `[head_dim / 2]`) when the rotation covers whole
    /// heads of `head_dim`, as the kernels that rotate take them; `None` for a partial one.
    pub fn whole_head_inv_freq(&self, head_dim: usize) -> Option<&Array> {
        (self.dims as usize == head_dim).then_some(&self.inv_freq)
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
        let lin = Linear::new(Weight::Dense(w.clone()), None, None).unwrap();
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
    fn quantized_forward_of_batched_rows_keeps_shape_and_values() {
        // decode's [b, 1, k] and a batch of prompts' [b, l, k] go to quantized_matmul as
        // [m, k]: the result has x's leading shape and each row's product is the dequantized
        // weight's
        let (n, k) = (64usize, 128usize);
        let q = QuantConfig {
            group_size: 64,
            bits: 4,
        };
        let key = mlx::random::key(7).unwrap();
        let w = mlx::random::normal(&[n as i32, k as i32], Dtype::F32, 0.0, 0.05, &key).unwrap();
        let (wq, s, b) = fast::quantize(&w, 64, 4).unwrap();
        let wd = fast::dequantize(&wq, &s, &b, 64, 4).unwrap();
        for shape in [
            vec![5, 1, k as i32],
            vec![3, 2, k as i32],
            vec![1, 4, k as i32],
        ] {
            let rows: i32 = shape[..2].iter().product();
            let key = mlx::random::key(rows as u64).unwrap();
            let x = mlx::random::normal(&shape, Dtype::F32, 0.0, 1.0, &key).unwrap();
            let y = quantized_forward(&x, &wq, &s, &b, &q).unwrap();
            assert_eq!(y.shape(), vec![shape[0], shape[1], n as i32]);
            let want = x
                .reshape(&[rows, k as i32])
                .unwrap()
                .matmul(&wd.t().unwrap())
                .unwrap();
            let (y, want) = (y.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
            assert_eq!(y.len(), want.len());
            let worst = y
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-3, "{shape:?}: off by {worst}");
        }
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
