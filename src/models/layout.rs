//! The parameter layout of a model, declared once: each family returns, from its
//! config and a rank's shard plan, the list of its parameters ([`ParamSpec`]: the
//! checkpoint name, shape, quantization and how it splits under tensor parallelism).
//! The loader reads its tensors from that list, the memory plan counts their bytes
//! (`parallel::plan`), [`Layout::num_parameters`] counts their elements and the
//! TP-size checks (`models::shard`) look at its row-parallel splits, so none of them
//! can disagree with another about what a model holds.
//!
//! A spec can describe more than the Llama family needs: experts stacked on a leading
//! axis (MoE), a quantization per tensor (GGUF files mix them), and vocab-parallel rows
//! of an embedding or output projection.
use std::collections::HashMap;
use std::ops::Range;

use super::config::QuantConfig;
use super::weights::{TensorEntry, TensorKind};
use crate::mlx::Dtype;

/// How a parameter splits across tensor-parallel ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds it whole.
    Replicated,
    /// Output rows `rows` of this rank (column-parallel linear): no communication.
    Column(Range<usize>),
    /// Input columns `cols` of this rank (row-parallel linear): partial sums are
    /// `all_sum`med, then the bias is added once.
    Row(Range<usize>),
    /// Vocabulary rows `rows` of this rank (vocab-parallel embedding or output projection).
    Vocab(Range<usize>),
    /// Whole experts `experts` of a stacked MoE parameter (expert parallelism): the rank's
    /// block of the leading axis; the block's output is `all_sum`med like a row split's.
    Experts(Range<usize>),
}

/// What a parameter is, with its full (unsplit, unquantized) shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `y = x Wᵀ (+ b)`: `{name}.weight` `[out, inp]` (`.scales` / `.biases` when quantized),
    /// `{name}.bias` `[out]` when `bias`.
    Linear { out: usize, inp: usize, bias: bool },
    /// A table of `rows` vectors of `dim` (token embeddings), stored as a linear's weight.
    Embedding { rows: usize, dim: usize },
    /// A norm's scale, `{name}` `[dim]` (the name is the whole tensor name).
    Norm { dim: usize },
}

/// One parameter of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// The checkpoint name: a linear's or embedding's prefix
    /// (`model.layers.0.self_attn.q_proj`), a norm's tensor (`model.norm.weight`).
    pub name: String,
    pub kind: Kind,
    /// Experts stacked on a leading axis (`[experts, out, inp]`), for MoE blocks.
    pub experts: Option<usize>,
    /// The quantization this tensor is declared with (`None`: float). A checkpoint may
    /// still hold it as float; see [`ParamSpec::quantization`].
    pub quant: Option<QuantConfig>,
    pub split: Split,
}

/// One checkpoint tensor of a parameter, and the block of it a rank loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorBlock {
    /// `weight`, `scales`, `biases`, `bias`, or empty for a norm.
    pub suffix: &'static str,
    pub name: String,
    /// The stored full shape (packed `uint32` columns for quantized weights).
    pub shape: Vec<usize>,
    pub kind: TensorKind,
    /// This rank's rows and columns (`None`: all).
    pub rows: Option<Range<usize>>,
    pub cols: Option<Range<usize>>,
    /// This rank's experts of a stacked tensor's leading axis (`None`: all).
    pub experts: Option<Range<usize>>,
}

impl TensorBlock {
    /// Elements of the whole tensor and of this rank's block. Rows and columns are those of
    /// the last two axes (of the last axis for a vector: a bias, a norm); a leading axis
    /// (stacked experts) is whole unless `experts` says.
    pub fn elements(&self) -> (usize, usize) {
        let full: usize = self.shape.iter().product();
        let vector = self.suffix == "bias" || self.kind == TensorKind::Norm;
        let n = self.shape.len();
        let len = |r: &Option<Range<usize>>, d: usize| r.as_ref().map_or(d, |r| r.len());
        let lead = |dims: &[usize]| match (&self.experts, dims.split_first()) {
            (Some(e), Some((_, rest))) => e.len() * rest.iter().product::<usize>(),
            _ => dims.iter().product::<usize>(),
        };
        let block = if vector || n < 2 {
            lead(&self.shape[..n - 1]) * len(&self.rows, self.shape[n - 1])
        } else {
            lead(&self.shape[..n - 2])
                * len(&self.rows, self.shape[n - 2])
                * len(&self.cols, self.shape[n - 1])
        };
        (full, block)
    }
}

impl ParamSpec {
    pub fn linear(name: impl Into<String>, out: usize, inp: usize, bias: bool) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            kind: Kind::Linear { out, inp, bias },
            experts: None,
            quant: None,
            split: Split::Replicated,
        }
    }

    pub fn norm(name: impl Into<String>, dim: usize) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            kind: Kind::Norm { dim },
            experts: None,
            quant: None,
            split: Split::Replicated,
        }
    }

    pub fn embedding(name: impl Into<String>, rows: usize, dim: usize) -> ParamSpec {
        ParamSpec {
            name: name.into(),
            kind: Kind::Embedding { rows, dim },
            experts: None,
            quant: None,
            split: Split::Replicated,
        }
    }

    pub fn quantized(mut self, quant: Option<QuantConfig>) -> ParamSpec {
        self.quant = quant;
        self
    }

    pub fn split(mut self, split: Split) -> ParamSpec {
        self.split = split;
        self
    }

    /// The last component of the name (`o_proj`), for messages.
    pub fn short_name(&self) -> &str {
        let n = self.name.strip_suffix(".weight").unwrap_or(&self.name);
        n.rsplit('.').next().unwrap_or(n)
    }

    /// `(out, in)` of the float matrix (a norm: `(dim, 1)`).
    fn matrix(&self) -> (usize, usize) {
        match self.kind {
            Kind::Linear { out, inp, .. } => (out, inp),
            Kind::Embedding { rows, dim } => (rows, dim),
            Kind::Norm { dim } => (dim, 1),
        }
    }

    /// The quantization it loads with: the declared one where the checkpoint has the
    /// scales (`has(name)` says which tensors the checkpoint holds; dummy weights have all).
    pub fn quantization(&self, has: impl Fn(&str) -> bool) -> Option<QuantConfig> {
        match self.kind {
            Kind::Norm { .. } => None,
            _ => self.quant.filter(|_| has(&format!("{}.scales", self.name))),
        }
    }

    /// As [`ParamSpec::quantization`], with the bits and group size its stored tensors imply
    /// where the checkpoint says (`shape_of(name)`: a tensor's stored shape): packed
    /// `.weight` `[.., out, inp · bits / 32]`, `.scales` `[.., out, inp / group]`. A GGUF
    /// sets them per tensor (SmolLM2: Q4_1 linears beside a Q8_0 embedding).
    pub fn quantization_stored(
        &self,
        has: impl Fn(&str) -> bool,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Option<QuantConfig> {
        let q = self.quantization(has)?;
        let (_, inp) = self.matrix();
        let w = shape_of(&format!("{}.weight", self.name));
        let sc = shape_of(&format!("{}.scales", self.name));
        match (
            w.as_deref().and_then(|w| w.last()),
            sc.as_deref().and_then(|s| s.last()),
        ) {
            (Some(&wc), Some(&gc)) if inp > 0 && gc > 0 && (wc * 32) % inp == 0 => {
                Some(QuantConfig {
                    bits: (wc * 32 / inp) as i32,
                    group_size: (inp / gc) as i32,
                })
            }
            _ => Some(q),
        }
    }

    /// Elements of the float parameter (quantized weights counted as their float shape).
    pub fn num_parameters(&self) -> u64 {
        let (out, inp) = self.matrix();
        let bias = matches!(self.kind, Kind::Linear { bias: true, .. }) as usize * out;
        (self.experts.unwrap_or(1) * (out * inp + bias)) as u64
    }

    /// The tensors a rank loads for this parameter with quantization `quant` (see
    /// [`ParamSpec::quantization`]), and its block of each: a column or vocab split takes
    /// output rows, a row split input columns (of the packed words and the quantization
    /// groups, when quantized); the bias follows the output rows. In the order
    /// `weight`, `scales`, `biases`, `bias` (a norm: its one tensor).
    pub fn tensors(&self, quant: Option<QuantConfig>) -> Vec<TensorBlock> {
        let lead: Vec<usize> = self.experts.into_iter().collect();
        let with_lead =
            |dims: &[usize]| -> Vec<usize> { lead.iter().chain(dims).copied().collect() };
        if let Kind::Norm { dim } = self.kind {
            return vec![TensorBlock {
                suffix: "",
                name: self.name.clone(),
                shape: with_lead(&[dim]),
                kind: TensorKind::Norm,
                rows: None,
                cols: None,
                experts: None,
            }];
        }
        let (out, inp) = self.matrix();
        let (rows, cols) = match &self.split {
            Split::Replicated | Split::Experts(_) => (None, None),
            Split::Column(r) | Split::Vocab(r) => (Some(r.clone()), None),
            Split::Row(c) => (None, Some(c.clone())),
        };
        let experts = match &self.split {
            Split::Experts(e) => Some(e.clone()),
            _ => None,
        };
        let block = |suffix: &'static str, shape: Vec<usize>, kind, cols: Option<Range<usize>>| {
            TensorBlock {
                suffix,
                name: format!("{}.{suffix}", self.name),
                shape: with_lead(&shape),
                kind,
                rows: rows.clone(),
                cols,
                experts: experts.clone(),
            }
        };
        let mut v = match quant {
            Some(q) => {
                let (bits, g) = (q.bits as usize, q.group_size as usize);
                let packed = cols.clone().map(|c| c.start * bits / 32..c.end * bits / 32);
                let groups = cols.clone().map(|c| c.start / g..c.end / g);
                vec![
                    block(
                        "weight",
                        vec![out, inp * bits / 32],
                        TensorKind::Packed,
                        packed,
                    ),
                    block(
                        "scales",
                        vec![out, inp / g],
                        TensorKind::Scales,
                        groups.clone(),
                    ),
                    block(
                        "biases",
                        vec![out, inp / g],
                        TensorKind::QuantBiases,
                        groups,
                    ),
                ]
            }
            None => vec![block("weight", vec![out, inp], TensorKind::Float, cols)],
        };
        if let Kind::Linear { bias: true, .. } = self.kind {
            v.push(block("bias", vec![out], TensorKind::Float, None));
        }
        v
    }
}

/// A rank's parameters: the ones every decoder has, and its layers'.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Whether the plan splits anything (more than one rank).
    pub sharded: bool,
    pub embed_tokens: ParamSpec,
    pub layers: Vec<LayerLayout>,
    pub norm: ParamSpec,
    /// `None`: tied to the embedding.
    pub lm_head: Option<ParamSpec>,
}

/// One decoder layer's parameters, by block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerLayout {
    pub input_layernorm: ParamSpec,
    pub attn: super::blocks::attention::AttentionLayout,
    pub post_attention_layernorm: ParamSpec,
    pub mlp: FeedForwardLayout,
}

/// A decoder layer's feed-forward block: a dense SwiGLU MLP or a mixture of experts.
// built once per load or plan: the size difference does not matter
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedForwardLayout {
    Dense(super::blocks::mlp::MlpLayout),
    Moe(super::blocks::moe::MoeLayout),
}

impl FeedForwardLayout {
    pub fn params(&self) -> Vec<&ParamSpec> {
        match self {
            FeedForwardLayout::Dense(m) => m.params(),
            FeedForwardLayout::Moe(m) => m.params(),
        }
    }
}

impl LayerLayout {
    pub fn params(&self) -> Vec<&ParamSpec> {
        let mut v = vec![&self.input_layernorm, &self.post_attention_layernorm];
        v.extend(self.attn.params());
        v.extend(self.mlp.params());
        v
    }
}

/// A rank's weight bytes by the plan's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WeightBytes {
    /// This rank's blocks of the split parameters.
    pub sharded: u64,
    /// The parameters every rank holds whole.
    pub replicated: u64,
    /// The split parameters whole (all ranks together).
    pub sharded_full: u64,
}

impl Layout {
    /// Every parameter, in load order.
    pub fn params(&self) -> Vec<&ParamSpec> {
        let mut v = vec![&self.embed_tokens];
        for l in &self.layers {
            v.extend(l.params());
        }
        v.push(&self.norm);
        v.extend(self.lm_head.iter());
        v
    }

    /// Elements of the float model (quantized weights counted as their float shape).
    pub fn num_parameters(&self) -> u64 {
        self.params().iter().map(|p| p.num_parameters()).sum()
    }

    /// The bytes a rank loads: each tensor's dtype from `catalog` (the checkpoint's
    /// headers), else packed words `uint32` and everything else `float` (dummy weights).
    /// With one rank nothing is split.
    pub fn weight_bytes(
        &self,
        catalog: Option<&HashMap<String, TensorEntry>>,
        float: Dtype,
    ) -> WeightBytes {
        let has = |n: &str| catalog.is_none_or(|c| c.contains_key(n));
        let mut b = WeightBytes::default();
        for p in self.params() {
            let split = self.sharded && p.split != Split::Replicated;
            let stored = |n: &str| catalog.and_then(|c| c.get(n)).map(|e| e.shape.clone());
            for t in p.tensors(p.quantization_stored(has, stored)) {
                let default = match t.kind {
                    TensorKind::Packed => Dtype::U32,
                    _ => float,
                };
                let dtype = catalog
                    .and_then(|c| c.get(&t.name))
                    .map_or(default, |e| e.dtype);
                let sz = dtype.size() as u64;
                let (full, block) = t.elements();
                if split {
                    b.sharded += block as u64 * sz;
                    b.sharded_full += full as u64 * sz;
                } else {
                    b.replicated += full as u64 * sz;
                }
            }
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_follow_the_split_and_the_quantization() {
        let q = QuantConfig {
            group_size: 64,
            bits: 4,
        };
        let row = ParamSpec::linear("o", 512, 1024, false)
            .quantized(Some(q))
            .split(Split::Row(256..512));
        let t = row.tensors(row.quantization(|_| true));
        let names: Vec<&str> = t.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["o.weight", "o.scales", "o.biases"]);
        assert_eq!(t[0].shape, vec![512, 128]);
        assert_eq!(t[0].cols, Some(32..64)); // packed words of columns 256..512
        assert_eq!(t[1].cols, Some(4..8)); // their groups
        assert_eq!(t[0].elements(), (512 * 128, 512 * 32));
        // no scales in the checkpoint: float
        assert_eq!(row.quantization(|_| false), None);
        let col = ParamSpec::linear("q", 8, 4, true).split(Split::Column(2..6));
        let t = col.tensors(None);
        assert_eq!((t[0].rows.clone(), t[1].suffix), (Some(2..6), "bias"));
        assert_eq!(t[1].elements(), (8, 4));
        assert_eq!(col.num_parameters(), 8 * 4 + 8);
    }

    #[test]
    fn stacked_experts_and_vocab_rows() {
        let mut e = ParamSpec::linear("experts.gate", 16, 8, false);
        e.experts = Some(4);
        assert_eq!(e.num_parameters(), 4 * 16 * 8);
        assert_eq!(e.tensors(None)[0].shape, vec![4, 16, 8]);
        let v = ParamSpec::embedding("embed", 100, 8).split(Split::Vocab(50..100));
        assert_eq!(v.tensors(None)[0].elements(), (800, 400));
        assert_eq!(
            ParamSpec::norm("a.b.q_norm.weight", 8).short_name(),
            "q_norm"
        );
    }
}
