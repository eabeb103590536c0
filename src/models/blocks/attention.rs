//! Grouped-query self-attention: q/k/v projections merged into one linear (this rank's
//! whole heads of each), optional RMSNorm on q and k per head (Qwen3), RoPE, attention
//! over the paged KV cache (MLX's sdpa, or mlxcel's decode kernel for batched steps), and the
//! output projection (row-parallel under TP) added to the residual stream.
use std::ops::Range;
use std::rc::Rc;

use crate::kernels;
use crate::mlx::distributed::Group;
use crate::mlx::{self, fast, Array};

use super::super::config::{ModelConfig, QuantConfig};
use super::super::kv_cache::{BatchIndex, KvCache, NewKv};
use super::super::layers::{Linear, Result, Rope};
use super::super::layout::{ParamSpec, Split};
use super::super::shard::ShardPlan;
use super::super::weights::WeightSource;
use super::norm::RmsNorm;

/// What a family chooses for its attention block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttentionOptions {
    /// Biases on q, k and v (Qwen2).
    pub qkv_bias: bool,
    /// RMSNorm on q and k per head (Qwen3).
    pub qk_norm: bool,
}

/// The parameters of one attention block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionLayout {
    pub q_proj: ParamSpec,
    pub k_proj: ParamSpec,
    pub v_proj: ParamSpec,
    pub o_proj: ParamSpec,
    pub q_norm: Option<ParamSpec>,
    pub k_norm: Option<ParamSpec>,
}

impl AttentionLayout {
    /// `{prefix}.q_proj` … `{prefix}.o_proj` (and `q_norm` / `k_norm`) of `cfg`'s shapes:
    /// q/k/v column-parallel by whole heads of `plan`, o row-parallel by q heads.
    pub fn new(
        prefix: &str,
        cfg: &ModelConfig,
        plan: &ShardPlan,
        quant: Option<QuantConfig>,
        opts: AttentionOptions,
    ) -> AttentionLayout {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let heads = |r: &Range<usize>| r.start * hd..r.end * hd;
        let name = |n: &str| format!("{prefix}.{n}");
        let col = |n: &str, out: usize, r: &Range<usize>| {
            ParamSpec::linear(name(n), out, h, opts.qkv_bias)
                .quantized(quant)
                .split(Split::Column(heads(r)))
        };
        let norm = |n: &str| {
            opts.qk_norm
                .then(|| ParamSpec::norm(name(&format!("{n}.weight")), hd))
        };
        AttentionLayout {
            q_proj: col("q_proj", cfg.num_heads * hd, &plan.q_heads),
            k_proj: col("k_proj", cfg.num_kv_heads * hd, &plan.kv_heads),
            v_proj: col("v_proj", cfg.num_kv_heads * hd, &plan.kv_heads),
            o_proj: ParamSpec::linear(name("o_proj"), h, cfg.num_heads * hd, false)
                .quantized(quant)
                .split(Split::Row(heads(&plan.q_heads))),
            q_norm: norm("q_norm"),
            k_norm: norm("k_norm"),
        }
    }

    pub fn params(&self) -> Vec<&ParamSpec> {
        let mut v = vec![&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj];
        v.extend(self.q_norm.iter().chain(self.k_norm.iter()));
        v
    }
}

pub struct Attention {
    /// q, k and v projections merged (this rank's whole heads of each): one matmul.
    pub qkv_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
}

impl Attention {
    /// This rank's attention under `layout` (q heads, kv heads of `plan`); the output
    /// projection's partial sums are reduced over `tp` when given.
    pub fn load(
        src: &dyn WeightSource,
        layout: &AttentionLayout,
        cfg: &ModelConfig,
        plan: &ShardPlan,
        tp: Option<Rc<Group>>,
    ) -> Result<Attention> {
        let hd = cfg.head_dim;
        let eps = cfg.rms_norm_eps;
        let norm = |n: &Option<ParamSpec>| -> Result<Option<RmsNorm>> {
            n.as_ref().map(|n| RmsNorm::load(src, n, eps)).transpose()
        };
        Ok(Attention {
            qkv_proj: Linear::load_merged(src, &[&layout.q_proj, &layout.k_proj, &layout.v_proj])?,
            o_proj: Linear::load(src, &layout.o_proj, tp)?,
            q_norm: norm(&layout.q_norm)?,
            k_norm: norm(&layout.k_norm)?,
            n_heads: plan.q_heads.len() as i32,
            n_kv_heads: plan.kv_heads.len() as i32,
            head_dim: hd as i32,
            // YaRN scales q and k (cos and sin) by its attention factor: the logits take its square.
            scale: (hd as f32).powf(-0.5) * cfg.rope.logit_scale(),
        })
    }

    /// Arrays held (for memory accounting).
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.qkv_proj.arrays();
        v.extend(self.o_proj.arrays());
        v.extend(self.q_norm.iter().map(|n| &n.weight));
        v.extend(self.k_norm.iter().map(|n| &n.weight));
        v
    }

    /// A batched decode step's attention with MLX's sdpa over every row's keys and
    /// values gathered from the pool through its block table, masked to its length.
    pub fn attend_gathered(
        &self,
        q: &Array,
        cache: &KvCache,
        layer: usize,
        index: &BatchIndex,
    ) -> mlx::Result<Array> {
        let (kk, vv, mask) = cache.read_batch(layer, index)?;
        fast::sdpa(q, &kk, &vv, self.scale, fast::Mask::Array(&mask))
    }

    /// A decode step's attention by mlxcel's kernel (`kernels::attn`): q `[B, heads, 1,
    /// head_dim]` over the layer's `pool`, row b through its block table `table[b]` (of
    /// `block_size` tokens each) up to `pos[b]`; `max_len`: the most positions a row
    /// attends to (max `pos[b]` + 1), which sets the blocks launched.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_attention(
        &self,
        q: &Array,
        pool: &Array,
        table: &Array,
        pos: &Array,
        scratch: &kernels::attn::Scratch,
        block_size: usize,
        max_len: usize,
    ) -> mlx::Result<Array> {
        kernels::attn::decode(
            q,
            pool,
            table,
            pos,
            scratch,
            kernels::attn::Shape {
                q_heads: self.n_heads as usize,
                kv_heads: self.n_kv_heads as usize,
                head_dim: self.head_dim as usize,
                block_size,
                max_len,
            },
            self.scale,
        )
    }

    /// Whether a one-token step's q/k/v may be written into the KV pool by a kernel: the GEMV
    /// kernel that applies RoPE (no q/k norm, the kernel on; it adds q/k/v biases), or with
    /// Qwen3's q/k norms the kernel that norms, rotates and writes after the projection
    /// (`kernels::qk_rope`).
    pub fn qkv_on_kernel(&self) -> bool {
        match (&self.q_norm, &self.k_norm) {
            (None, None) => self.qkv_proj.on_gemv_kernel(),
            (Some(q), Some(_)) => {
                kernels::qk_rope::supports(self.head_dim as usize, q.weight.dtype())
            }
            _ => false,
        }
    }

    /// Project `norm(x)` to q/k/v `[B, heads, T, head_dim]`, with q/k norm and RoPE applied;
    /// k and v come as one array when the fused kernel made them so, or (one-token steps
    /// given `into`, a layer's KV pool and its rows, when the GEMV kernel runs) already
    /// written into the pool ([`NewKv::Written`]).
    #[allow(clippy::too_many_arguments)]
    pub fn qkv(
        &self,
        x: &Array,
        norm: &RmsNorm,
        b: i32,
        t: i32,
        rope: &Rope,
        offset: &Array,
        into: Option<(&Array, &Array)>,
    ) -> mlx::Result<(Array, NewKv)> {
        let (nq, nkv) = (self.n_heads, self.n_kv_heads);
        if t == 1 && self.q_norm.is_none() && self.k_norm.is_none() {
            // one kernel: projection, norm, RoPE, and k/v laid out as the cache stores them
            if let Some(r) = self.qkv_proj.forward_qkv_rope(
                x,
                Some(norm),
                offset,
                rope,
                nq as usize,
                self.head_dim as usize,
                into,
            ) {
                return Ok(match r? {
                    (q, Some(kv)) => (q, NewKv::Merged(kv)),
                    (q, None) => (q, NewKv::Written),
                });
            }
        }
        if t == 1 {
            // one position: [B, 1, heads·head_dim] is [B, heads, 1, head_dim] in memory, so
            // the projection is produced in that shape and heads are sliced from it
            let y = self.qkv_proj.forward_shaped(
                x,
                &[b, nq + 2 * nkv, 1, self.head_dim],
                Some(norm),
            )?;
            if let (Some(qn), Some(kn), Some((pool, dst))) = (&self.q_norm, &self.k_norm, into) {
                // Qwen3: the heads' norms, RoPE and the cache write in one kernel
                let hd = self.head_dim as usize;
                let inv_freq = rope.whole_head_inv_freq(hd);
                let fits = kernels::qk_rope::supports(hd, y.dtype())
                    && offset.size() == b as usize
                    && offset.dtype() == mlx::Dtype::I32
                    && qn.eps == kn.eps;
                if let Some(inv_freq) = inv_freq.filter(|_| fits) {
                    let q = kernels::qk_rope::qk_norm_rope(
                        &y,
                        &qn.weight,
                        &kn.weight,
                        qn.eps,
                        offset,
                        inv_freq,
                        nq as usize,
                        hd,
                        pool,
                        dst,
                    )?;
                    return Ok((q, NewKv::Written));
                }
            }
            if self.q_norm.is_none() && self.k_norm.is_none() {
                // q and k are adjacent: one RoPE kernel for both, then split the heads (each
                // split one op for all its parts)
                let mut parts = mlx::split_sections(&y, &[nq + nkv], 1)?.into_iter();
                let (Some(qk), Some(v)) = (parts.next(), parts.next()) else {
                    return Err(mlx::MlxError::Invalid("qk/v split".into()));
                };
                let qk = rope.forward(&qk, offset)?;
                let mut parts = mlx::split_sections(&qk, &[nq], 1)?.into_iter();
                let (Some(q), Some(k)) = (parts.next(), parts.next()) else {
                    return Err(mlx::MlxError::Invalid("qk split".into()));
                };
                return Ok((q, NewKv::Split(k, v)));
            }
            let mut parts = mlx::split_sections(&y, &[nq, nq + nkv], 1)?.into_iter();
            let (Some(q), Some(k), Some(v)) = (parts.next(), parts.next(), parts.next()) else {
                return Err(mlx::MlxError::Invalid("qkv split".into()));
            };
            let norm = |y: Array, n: &Option<RmsNorm>| match n {
                Some(nm) => nm.forward(&y),
                None => Ok(y),
            };
            let q = rope.forward(&norm(q, &self.q_norm)?, offset)?;
            let k = rope.forward(&norm(k, &self.k_norm)?, offset)?;
            return Ok((q, NewKv::Split(k, v)));
        }
        let heads = |y: Array, n: i32, norm: &Option<RmsNorm>| -> mlx::Result<Array> {
            let y = y.reshape(&[b, t, n, self.head_dim])?;
            let y = match norm {
                Some(nm) => nm.forward(&y)?,
                None => y,
            };
            y.transpose(&[0, 2, 1, 3])
        };
        let q_dim = nq * self.head_dim;
        let kv_dim = nkv * self.head_dim;
        let y = self.qkv_proj.forward(&norm.forward(x)?)?;
        let mut parts = mlx::split_sections(&y, &[q_dim, q_dim + kv_dim], -1)?.into_iter();
        let (Some(q), Some(k), Some(v)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(mlx::MlxError::Invalid("qkv split".into()));
        };
        let q = heads(q, nq, &self.q_norm)?;
        let k = heads(k, nkv, &self.k_norm)?;
        let v = heads(v, nkv, &None)?;
        Ok((
            rope.forward(&q, offset)?,
            NewKv::Split(rope.forward(&k, offset)?, v),
        ))
    }

    /// q, k and v of several sequences' chunks laid end to end in `x` (`[1, N, hidden]`,
    /// chunk i its `lens[i]` rows from position `offsets[i]`): one projection of all `N`
    /// rows, then each chunk's heads, norms and RoPE at its own offset. Returns per chunk
    /// q (`[1, heads, t, head_dim]`) and its new keys and values.
    pub fn qkv_segments(
        &self,
        x: &Array,
        norm: &RmsNorm,
        lens: &[i32],
        offsets: &[Array],
        rope: &Rope,
    ) -> mlx::Result<Vec<(Array, NewKv)>> {
        let (nq, nkv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let (q_dim, kv_dim) = (nq * hd, nkv * hd);
        let y = self.qkv_proj.forward(&norm.forward(x)?)?;
        let heads = |y: Array, t: i32, n: i32, norm: &Option<RmsNorm>| -> mlx::Result<Array> {
            let y = y.reshape(&[1, t, n, hd])?;
            let y = match norm {
                Some(nm) => nm.forward(&y)?,
                None => y,
            };
            y.transpose(&[0, 2, 1, 3])
        };
        let mut out = Vec::with_capacity(lens.len());
        let mut start = 0;
        for (&t, offset) in lens.iter().zip(offsets) {
            let seg = y.slice_axis(1, start, start + t)?;
            start += t;
            let mut parts = mlx::split_sections(&seg, &[q_dim, q_dim + kv_dim], -1)?.into_iter();
            let (Some(q), Some(k), Some(v)) = (parts.next(), parts.next(), parts.next()) else {
                return Err(mlx::MlxError::Invalid("qkv split".into()));
            };
            let q = rope.forward(&heads(q, t, nq, &self.q_norm)?, offset)?;
            let k = rope.forward(&heads(k, t, nkv, &self.k_norm)?, offset)?;
            out.push((q, NewKv::Split(k, heads(v, t, nkv, &None)?)));
        }
        Ok(out)
    }

    /// `res + o_proj(o)` with the heads of `o` already merged (`[.., heads·head_dim]`).
    pub fn out_residual_merged(&self, o: &Array, res: &Array) -> mlx::Result<Array> {
        self.o_proj.forward_residual(o, res)
    }

    /// `res + o_proj(o)`: merge the heads of `o` (`[B, heads, T, head_dim]`) and project
    /// back to the hidden size, added to the residual stream `res` (`[B, T, hidden]`).
    pub fn out_residual(&self, o: &Array, res: &Array, b: i32, t: i32) -> mlx::Result<Array> {
        if t == 1 {
            // [B, heads, 1, head_dim] is already [B, 1, heads·head_dim] in memory
            return self.o_proj.forward_residual(o, res);
        }
        let o = o
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[b, t, self.n_heads * self.head_dim])?;
        self.o_proj.forward_residual(&o, res)
    }
}
