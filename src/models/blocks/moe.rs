//! The mixture-of-experts feed-forward block (Qwen3-MoE, Qwen2-MoE, Mixtral): a router
//! picks `top_k` of `E` SwiGLU experts per token, their outputs are summed with the
//! routing weights, and Qwen2-MoE adds a shared expert scaled by a sigmoid gate.
//!
//! Routing is transformers': float32 softmax over the router logits, the `top_k`
//! largest probabilities (ties: the lowest expert index, MLX's stable sort — torch's
//! CPU `topk` leaves ties to its selection algorithm), divided by their sum when
//! `norm_topk_prob`, cast to the activation dtype.
//!
//! Experts are held stacked, `[E, 2·I, H]` (gate rows then up rows) and `[E, H, I]`,
//! whatever the checkpoint's layout, and multiplied with MLX's `gather_mm` /
//! `gather_qmm` as mlx-lm's `SwitchGLU` does: at one token only the routed experts'
//! weights are read; from 64 (token, expert) pairs the pairs are sorted by expert first.
//! Checkpoint layouts read: mlx-community's stacked `switch_mlp.{gate,up,down}_proj`
//! (float or MLX-quantized), transformers-5's packed `experts.gate_up_proj` /
//! `experts.down_proj`, and per-expert `experts.{e}.gate_proj…` (Mixtral `w1/w3/w2`).
//!
//! Under tensor parallelism every rank holds its slice of every expert's intermediate
//! dimension (gate/up rows, down columns, like the dense MLP) and the block's output
//! (routed plus shared) is `all_sum`med once; with expert parallelism a rank holds
//! `E / N` whole experts, routes every token over all `E` and keeps the weights of its
//! own (the others' weights are zero), and the output is `all_sum`med the same way.
use std::ops::Range;
use std::rc::Rc;

use crate::mlx::distributed::Group;
use crate::mlx::{self, fast, Array, Dtype};

use super::super::config::{ModelConfig, MoeConfig, QuantConfig};
use super::super::layers::{Linear, Result};
use super::super::layout::{ParamSpec, Split};
use super::super::weights::{LoadError, TensorKind, WeightSource};
use super::mlp::{Mlp, MlpLayout};
use super::norm::RmsNorm;

/// (token, expert) pairs from which the pairs are sorted by expert before the expert
/// matmuls (mlx-lm's threshold).
const SORT_MIN_PAIRS: usize = 64;

/// On a GPU, quantized experts are dequantized (all of them, into a temporary) and
/// multiplied with `gather_mm` from this many (token, expert) pairs per expert on
/// average: MLX's CUDA `gather_qmm` is slow on long inputs, while a prefill chunk hits
/// every expert anyway. `MLXCEL_MOE_DEQUANT=0` turns it off (to compare).
const DEQUANT_MIN_PAIRS_PER_EXPERT: usize = 4;

/// Whether long inputs dequantize quantized experts on a GPU (see
/// [`DEQUANT_MIN_PAIRS_PER_EXPERT`]).
fn dequant_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        mlx::backend() != mlx::Backend::Cpu
            && std::env::var("MLXCEL_MOE_DEQUANT").map_or(true, |v| v != "0")
    })
}

/// Working memory of a MoE model's forward pass over `rows` tokens on a rank of `plan`
/// beyond a dense MLP's, in bytes of `act`-byte activations: the (token, expert) pairs'
/// gathered inputs, gate/up, activation and down outputs (`rows · top_k · (2H + 3i)`), and
/// for quantized experts the dequantized stack of a long input (see
/// [`DEQUANT_MIN_PAIRS_PER_EXPERT`]): gate/up then down of every expert held, the
/// gate/up part (two thirds) alive at once, for the two layers a prefill keeps in
/// flight. The dequantized term is counted on every backend (it is the GPU's), so a plan
/// made on a CPU machine holds for a GPU.
pub fn working_bytes(
    cfg: &ModelConfig,
    plan: &super::super::shard::ShardPlan,
    rows: u64,
    act: u64,
) -> u64 {
    let Some(moe) = &cfg.moe else { return 0 };
    let ep = plan.expert_parallel && plan.size > 1;
    let n = plan.size.max(1);
    let (e, i) = match ep {
        true => (moe.num_experts / n, moe.expert_intermediate),
        false => (moe.num_experts, moe.expert_intermediate / n),
    };
    let (e, i, h, k) = (e as u64, i as u64, cfg.hidden_size as u64, moe.top_k as u64);
    let pairs = rows * k * (2 * h + 3 * i) * act;
    let dequant = match cfg.quantization {
        Some(_) if rows * k >= DEQUANT_MIN_PAIRS_PER_EXPERT as u64 * e => 2 * (2 * e * i * h) * act,
        _ => 0,
    };
    pairs + dequant
}

/// The parameters of one MoE block of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeLayout {
    /// The block's prefix (`model.layers.3.mlp`).
    pub prefix: String,
    /// The router, `{prefix}.gate` `[E, H]`, replicated.
    pub router: ParamSpec,
    /// The stacked experts this rank holds, by their mlx-community names
    /// (`{prefix}.switch_mlp.gate_proj` …; `experts` = the experts held).
    pub gate_proj: ParamSpec,
    pub up_proj: ParamSpec,
    pub down_proj: ParamSpec,
    /// Experts of this rank (all of them unless expert-parallel).
    pub experts: Range<usize>,
    /// Checkpoint names of the per-expert projections (`gate_proj`, Mixtral's `w1`…).
    pub per_expert: [&'static str; 3],
    pub top_k: usize,
    pub norm_topk_prob: bool,
    /// Qwen2-MoE's shared expert and its gate `[1, H]`.
    pub shared: Option<(MlpLayout, ParamSpec)>,
}

/// A range's `rank`-th of `size` equal parts.
fn part(n: usize, size: usize, rank: usize) -> Range<usize> {
    let per = n / size;
    rank * per..(rank + 1) * per
}

impl MoeLayout {
    /// The MoE block of layer `layer` for rank `rank` of `size` (`expert_parallel`: whole
    /// experts per rank, else a slice of every expert's intermediate dimension).
    pub fn new(
        layer: usize,
        cfg: &ModelConfig,
        moe: &MoeConfig,
        (rank, size, expert_parallel): (usize, usize, bool),
        quant: Option<QuantConfig>,
    ) -> MoeLayout {
        let prefix = format!("model.layers.{layer}.{}", moe.names.block);
        let (h, i, e) = (cfg.hidden_size, moe.expert_intermediate, moe.num_experts);
        let (experts, inter) = if expert_parallel && size > 1 {
            (part(e, size, rank), 0..i)
        } else {
            (0..e, part(i, size, rank))
        };
        let ep = expert_parallel && size > 1;
        let stacked = |n: &str, out, inp, split: Split| {
            let mut p = ParamSpec::linear(format!("{prefix}.switch_mlp.{n}"), out, inp, false)
                .quantized(quant)
                .split(if ep {
                    Split::Experts(experts.clone())
                } else {
                    split
                });
            p.experts = Some(e);
            p
        };
        let shared = moe.shared_expert_intermediate.map(|si| {
            let mlp = MlpLayout::sized(
                &format!("{prefix}.shared_expert"),
                h,
                si,
                part(si, size, rank),
                quant,
            );
            let gate = ParamSpec::linear(format!("{prefix}.shared_expert_gate"), 1, h, false)
                .quantized(quant);
            (mlp, gate)
        });
        MoeLayout {
            router: ParamSpec::linear(format!("{prefix}.gate"), e, h, false).quantized(quant),
            gate_proj: stacked("gate_proj", i, h, Split::Column(inter.clone())),
            up_proj: stacked("up_proj", i, h, Split::Column(inter.clone())),
            down_proj: stacked("down_proj", h, i, Split::Row(inter)),
            prefix,
            experts,
            per_expert: [moe.names.gate, moe.names.up, moe.names.down],
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
            shared,
        }
    }

    pub fn params(&self) -> Vec<&ParamSpec> {
        let mut v = vec![
            &self.router,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ];
        if let Some((mlp, gate)) = &self.shared {
            v.extend(mlp.params());
            v.push(gate);
        }
        v
    }
}

/// Stacked expert weights: dense `[E, out, in]` or MLX affine-quantized.
enum Stacked {
    Dense(Array),
    Quantized {
        w: Array,
        scales: Array,
        biases: Array,
        q: QuantConfig,
    },
}

impl Stacked {
    /// `x @ W[idx]ᵀ` for each index: x `[.., 1, in]` → `[.., 1, out]`. With `dequant`,
    /// quantized experts are dequantized first (ordered after x exists, so the temporary
    /// is not made before its input is there) and multiplied as dense ones.
    fn apply(&self, x: &Array, idx: &Array, sorted: bool, dequant: bool) -> mlx::Result<Array> {
        match self {
            Stacked::Dense(w) => fast::gather_mm(x, &w.transpose(&[0, 2, 1])?, idx, sorted),
            Stacked::Quantized {
                w,
                scales,
                biases,
                q,
            } if dequant => {
                let wd = fast::dequantize(&w.depends_on(x)?, scales, biases, q.group_size, q.bits)?;
                fast::gather_mm(x, &wd.transpose(&[0, 2, 1])?, idx, sorted)
            }
            Stacked::Quantized {
                w,
                scales,
                biases,
                q,
            } => fast::gather_qmm(x, w, scales, biases, idx, q.group_size, q.bits, sorted),
        }
    }

    /// Experts held.
    fn experts(&self) -> usize {
        match self {
            Stacked::Dense(w) | Stacked::Quantized { w, .. } => w.dim(0) as usize,
        }
    }

    fn arrays(&self) -> Vec<&Array> {
        match self {
            Stacked::Dense(w) => vec![w],
            Stacked::Quantized {
                w, scales, biases, ..
            } => vec![w, scales, biases],
        }
    }
}

pub struct MoeBlock {
    router: Linear,
    /// `[E, 2·i, H]`: this rank's gate rows, then its up rows, of every expert held.
    gate_up: Stacked,
    /// `[E, H, i]`.
    down: Stacked,
    /// Experts held (expert-parallel: a rank's block; others' routing weights are zeroed).
    experts: Range<usize>,
    num_experts: usize,
    top_k: usize,
    norm_topk_prob: bool,
    shared: Option<(Mlp, Linear)>,
    reduce: Option<Rc<Group>>,
}

fn missing(layout: &MoeLayout, src: &dyn WeightSource) -> LoadError {
    let _ = src;
    LoadError::Missing {
        name: format!(
            "{p}.switch_mlp.gate_proj.weight` (or `{p}.experts.gate_up_proj`, or `{p}.experts.0.{g}.weight",
            p = layout.prefix,
            g = layout.per_expert[0]
        ),
        files: "the checkpoint".into(),
    }
}

impl MoeBlock {
    /// This rank's block under `layout`, from whichever expert layout the checkpoint has;
    /// its output is `all_sum`med over `tp`.
    pub fn load(
        src: &dyn WeightSource,
        layout: &MoeLayout,
        num_experts: usize,
        tp: Option<Rc<Group>>,
    ) -> Result<MoeBlock> {
        let router = Linear::load(src, &layout.router, None)?;
        let (gate_up, down) = load_experts(src, layout, num_experts)?;
        let shared = match &layout.shared {
            None => None,
            Some((mlp, gate)) => Some((Mlp::load(src, mlp, None)?, Linear::load(src, gate, None)?)),
        };
        Ok(MoeBlock {
            router,
            gate_up,
            down,
            experts: layout.experts.clone(),
            num_experts,
            top_k: layout.top_k,
            norm_topk_prob: layout.norm_topk_prob,
            shared,
            reduce: tp,
        })
    }

    /// Arrays held (for memory accounting).
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.router.arrays();
        v.extend(self.gate_up.arrays());
        v.extend(self.down.arrays());
        if let Some((mlp, gate)) = &self.shared {
            v.extend(mlp.arrays());
            v.extend(gate.arrays());
        }
        v
    }

    /// The routed experts of each row of `x` (`[N, H]`): indices `[N, k]` (uint32) and
    /// weights `[N, k]` in x's dtype, as transformers computes them.
    pub fn route(&self, x: &Array) -> mlx::Result<(Array, Array)> {
        let logits = self.router.forward(x)?;
        let probs = logits.astype(Dtype::F32)?.softmax(-1, true)?;
        let k = self.top_k as i32;
        let idx = probs.neg()?.argsort(-1)?.slice_axis(-1, 0, k)?;
        let mut w = probs.take_along_axis(&idx, -1)?;
        if self.norm_topk_prob {
            w = w.div(&w.sum(&[-1], true)?)?;
        }
        Ok((idx, w.astype(x.dtype())?))
    }

    /// `h + moe(norm(h))` for `h` `[.., H]`.
    pub fn forward_residual(&self, h: &Array, norm: &RmsNorm) -> mlx::Result<Array> {
        let shape = h.shape();
        let hidden = *shape.last().expect("h has a last axis");
        let x = norm.forward(h)?.reshape(&[-1, hidden])?;
        let (idx, mut w) = self.route(&x)?;
        if self.experts.len() != self.num_experts {
            // expert-parallel: this rank computes its own experts only; the other
            // ranks' (token, expert) pairs get weight 0 and a local index in range
            let lo = Array::scalar(self.experts.start as f32, Dtype::F32)?;
            let hi = Array::scalar(self.experts.end as f32, Dtype::F32)?;
            let f = idx.astype(Dtype::F32)?;
            let mine = f.ge(&lo)?.logical_and(&f.lt(&hi)?)?;
            w = mlx::where_(&mine, &w, &Array::scalar(0.0, w.dtype())?)?;
            let local = f.sub(&lo)?;
            let zero = Array::scalar(0.0, Dtype::F32)?;
            let local = mlx::where_(&mine, &local, &zero)?.astype(Dtype::U32)?;
            let y = self.experts_forward(&x, &local, &w)?;
            return self.finish(h, &x, y, &shape);
        }
        let y = self.experts_forward(&x, &idx, &w)?;
        self.finish(h, &x, y, &shape)
    }

    /// Shared expert added, partial sums reduced, residual added.
    fn finish(&self, h: &Array, x: &Array, mut y: Array, shape: &[i32]) -> mlx::Result<Array> {
        if let Some((mlp, gate)) = &self.shared {
            let s = mlp
                .down_proj
                .forward(&mlp.gate_up_proj.forward_swiglu(x, None)?)?;
            y = y.add(&gate.forward(x)?.sigmoid()?.mul(&s)?)?;
        }
        if let Some(g) = &self.reduce {
            y = g.all_sum(&y)?;
        }
        h.add(&y.reshape(shape)?)
    }

    /// `Σ_j w[n, j] · expert_{idx[n, j]}(x[n])` for x `[N, H]` → `[N, H]`.
    fn experts_forward(&self, x: &Array, idx: &Array, w: &Array) -> mlx::Result<Array> {
        let n = x.dim(0);
        let hidden = x.dim(1);
        let k = idx.dim(1);
        let pairs = (n * k) as usize;
        let y = if pairs >= SORT_MIN_PAIRS {
            // sort the (token, expert) pairs by expert: each expert's rows are contiguous
            let flat = idx.reshape(&[-1])?;
            let order = flat.argsort(0)?;
            let inverse = order.argsort(0)?;
            let token = Array::arange(0.0, n as f64, 1.0, Dtype::U32)?.repeat(k, 0)?;
            let rows = x
                .take(&token.take(&order, 0)?, 0)?
                .reshape(&[pairs as i32, 1, hidden])?;
            let ids = flat.take(&order, 0)?;
            let out = self.swiglu_experts(&rows, &ids, true)?;
            out.take(&inverse, 0)?.reshape(&[n, k, hidden])?
        } else {
            let rows = x.reshape(&[n, 1, 1, hidden])?;
            self.swiglu_experts(&rows, idx, false)?
                .reshape(&[n, k, hidden])?
        };
        y.mul(&w.expand_dims(-1)?)?.sum(&[1], false)
    }

    /// `down(silu(gate(x)) · up(x))` of expert `idx` for each row: x `[.., 1, H]`.
    fn swiglu_experts(&self, x: &Array, idx: &Array, sorted: bool) -> mlx::Result<Array> {
        let pairs = idx.size();
        let dequant = sorted
            && pairs >= DEQUANT_MIN_PAIRS_PER_EXPERT * self.gate_up.experts()
            && dequant_enabled();
        let gu = self.gate_up.apply(x, idx, sorted, dequant)?;
        let half = gu.dim(-1) / 2;
        let mut parts = mlx::split_sections(&gu, &[half], -1)?.into_iter();
        let (Some(g), Some(u)) = (parts.next(), parts.next()) else {
            return Err(mlx::MlxError::Invalid("expert gate/up split".into()));
        };
        self.down
            .apply(&fast::swiglu(&g, &u)?, idx, sorted, dequant)
    }
}

/// The experts of `layout` stacked `[gate; up]` and `down`, from the checkpoint's layout.
fn load_experts(
    src: &dyn WeightSource,
    layout: &MoeLayout,
    num_experts: usize,
) -> Result<(Stacked, Stacked)> {
    let p = &layout.prefix;
    let (rows, cols) = match &layout.gate_proj.split {
        Split::Column(r) => (Some(r.clone()), None),
        _ => (None, None),
    };
    let down_cols = match &layout.down_proj.split {
        Split::Row(c) => Some(c.clone()),
        _ => cols,
    };
    let ex = &layout.experts;
    let e = num_experts;
    let (i, h) = match layout.gate_proj.kind {
        super::super::layout::Kind::Linear { out, inp, .. } => (out, inp),
        _ => unreachable!("experts are linears"),
    };
    let stacked_name = format!("{p}.switch_mlp.gate_proj.weight");
    if src.contains(&stacked_name) {
        // mlx-community: stacked, maybe quantized
        let quant = layout.gate_proj.quantization_stored(
            |n| src.contains(n),
            |n| src.info(n).ok().flatten().map(|i| i.shape),
        );
        // each tensor's block as the spec splits it (rows of gate/up, columns of down)
        let load = |spec: &ParamSpec| {
            spec.tensors(quant)
                .into_iter()
                .map(|t| src.load_stacked(&t.name, &t.shape, ex.clone(), t.rows, t.cols, t.kind))
                .collect::<Result<Vec<Array>>>()
        };
        let g = load(&layout.gate_proj)?;
        let u = load(&layout.up_proj)?;
        let d = load(&layout.down_proj)?;
        let cat = |a: &Array, b: &Array| mlx::concatenate(&[a, b], 1);
        let merged: Vec<Array> = g
            .iter()
            .zip(&u)
            .map(|(a, b)| cat(a, b))
            .collect::<mlx::Result<_>>()?;
        return Ok(match quant {
            Some(q) => {
                let mut m = merged.into_iter();
                let mut d = d.into_iter();
                let next = |it: &mut dyn Iterator<Item = Array>| it.next().expect("3 tensors");
                (
                    Stacked::Quantized {
                        w: next(&mut m),
                        scales: next(&mut m),
                        biases: next(&mut m),
                        q,
                    },
                    Stacked::Quantized {
                        w: next(&mut d),
                        scales: next(&mut d),
                        biases: next(&mut d),
                        q,
                    },
                )
            }
            None => (
                Stacked::Dense(merged.into_iter().next().expect("weight")),
                Stacked::Dense(d.into_iter().next().expect("weight")),
            ),
        });
    }
    let packed = format!("{p}.experts.gate_up_proj");
    if src.contains(&packed) {
        // transformers-5 packed: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]
        let shape = [e, 2 * i, h];
        let r = rows.clone().unwrap_or(0..i);
        let g = src.load_stacked(
            &packed,
            &shape,
            ex.clone(),
            Some(r.clone()),
            None,
            TensorKind::Float,
        )?;
        let up_rows = r.start + i..r.end + i;
        let u = src.load_stacked(
            &packed,
            &shape,
            ex.clone(),
            Some(up_rows),
            None,
            TensorKind::Float,
        )?;
        let d = src.load_stacked(
            &format!("{p}.experts.down_proj"),
            &[e, h, i],
            ex.clone(),
            None,
            down_cols,
            TensorKind::Float,
        )?;
        return Ok((
            Stacked::Dense(mlx::concatenate(&[&g, &u], 1)?),
            Stacked::Dense(d),
        ));
    }
    let [gn, un, dn] = layout.per_expert;
    if src.contains(&format!("{p}.experts.0.{gn}.weight")) {
        // per-expert 2-D tensors, stacked as read
        let mut gu = Vec::with_capacity(ex.len());
        let mut dw = Vec::with_capacity(ex.len());
        for x in ex.clone() {
            let name = |n: &str| format!("{p}.experts.{x}.{n}.weight");
            let g = src.load_block(&name(gn), &[i, h], rows.clone(), None, TensorKind::Float)?;
            let u = src.load_block(&name(un), &[i, h], rows.clone(), None, TensorKind::Float)?;
            gu.push(mlx::concatenate(&[&g, &u], 0)?);
            dw.push(src.load_block(
                &name(dn),
                &[h, i],
                None,
                down_cols.clone(),
                TensorKind::Float,
            )?);
        }
        let gu: Vec<&Array> = gu.iter().collect();
        let dw: Vec<&Array> = dw.iter().collect();
        return Ok((
            Stacked::Dense(mlx::stack(&gu, 0)?),
            Stacked::Dense(mlx::stack(&dw, 0)?),
        ));
    }
    Err(missing(layout, src))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dequantize + `gather_mm` path (long inputs on a GPU) computes what `gather_qmm`
    /// does, sorted or not.
    #[test]
    fn dequantized_experts_match_gather_qmm() {
        let key = mlx::random::key(7).unwrap();
        let w = mlx::random::normal(&[4, 16, 64], Dtype::F32, 0.0, 0.1, &key).unwrap();
        let (qw, scales, biases) = fast::quantize(&w, 32, 4).unwrap();
        let q = QuantConfig {
            group_size: 32,
            bits: 4,
        };
        let s = Stacked::Quantized {
            w: qw,
            scales,
            biases,
            q,
        };
        assert_eq!(s.experts(), 4);
        let x = mlx::random::normal(
            &[6, 1, 64],
            Dtype::F32,
            0.0,
            1.0,
            &mlx::random::key(8).unwrap(),
        )
        .unwrap();
        let idx = Array::from_slice(&[0u32, 0, 1, 2, 3, 3], &[6]).unwrap();
        for sorted in [false, true] {
            let a: Vec<f32> = s.apply(&x, &idx, sorted, false).unwrap().to_vec().unwrap();
            let b: Vec<f32> = s.apply(&x, &idx, sorted, true).unwrap().to_vec().unwrap();
            assert_eq!(a.len(), 6 * 16);
            let d = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(d < 1e-4, "sorted={sorted}: differ by {d}");
        }
    }
}
