//! The decoder forward pass shared by the Llama-like families (Llama, Mistral,
//! Qwen2, Qwen3), written like single-device code: embedding → N × (attention
//! + SwiGLU MLP, pre-norm, residual) → norm → lm_head.
//!
//! A forward step takes a batch of sequences, each with its KV-cache slot and
//! new tokens; their positions are the slots' current lengths.
use super::kv_cache::{BatchIndex, KvCache, KvError, NewKv};
use crate::kernels;
use crate::mlx::{self, fast, Array, Dtype};

use super::config::ModelConfig;
use super::layers::{Embedding, Linear, Result, RmsNorm, Rope, Shard};
use super::shard::ShardPlan;
use super::weights::WeightSource;
use crate::mlx::distributed::Group;
use std::rc::Rc;

/// Inputs of at least this many tokens keep at most two layers in flight on a GPU
/// (see `Transformer::forward_slot_ids`): a decode step must not wait inside itself.
const PREFILL_BOUND_MIN_ROWS: usize = 32;

struct Attention {
    /// q, k and v projections merged (this rank's whole heads of each): one matmul.
    qkv_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    scale: f32,
}

struct Mlp {
    /// gate and up projections merged (this rank's columns of each): one matmul.
    gate_up_proj: Linear,
    down_proj: Linear,
}

struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// One sequence's part of a forward step.
#[derive(Debug, Clone, Copy)]

pub struct SeqInput<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
}

/// Which logits a step returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only each sequence's last position: `[n_seqs, vocab]`.
    Last,
    /// Every position of every sequence (tests): one `[T, vocab]` per sequence.
    All,
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Mlx(#[from] mlx::MlxError),
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    BadToken { id: u32, vocab: usize },
    #[error("empty step: a sequence has no tokens")]
    Empty,
}

pub struct Transformer {
    pub cfg: ModelConfig,
    /// KV heads held by this process (all, or this rank's shard).
    kv_heads: usize,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    rope: Rope,
}

impl Transformer {
    /// Load every weight named as in the HF / mlx-community checkpoint.
    pub fn load(
        cfg: &ModelConfig,
        src: &dyn WeightSource,
        progress: impl FnMut(usize, usize),
    ) -> Result<Transformer> {
        Self::load_shard(cfg, src, &ShardPlan::full(cfg), None, progress)
    }

    /// Load this rank's shard under `plan`; row-parallel layers reduce over `tp`.
    pub fn load_shard(
        cfg: &ModelConfig,
        src: &dyn WeightSource,
        plan: &ShardPlan,
        tp: Option<Rc<Group>>,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Transformer> {
        let tp = tp.filter(|_| plan.is_sharded());
        let h = cfg.hidden_size;
        let q = cfg.quantization;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let eps = cfg.rms_norm_eps;
        let embed_tokens = Embedding::load(src, "model.embed_tokens", cfg.vocab_size, h, q)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let qk_norm = |name: &str| -> Result<Option<RmsNorm>> {
                if cfg.qk_norm {
                    Ok(Some(RmsNorm::load(
                        src,
                        &format!("{p}.self_attn.{name}.weight"),
                        hd,
                        eps,
                    )?))
                } else {
                    Ok(None)
                }
            };
            let heads = |r: &std::ops::Range<usize>| r.start * hd..r.end * hd;
            let row = |cols: std::ops::Range<usize>| match &tp {
                Some(g) => Shard::Row(cols, g.clone()),
                None => Shard::Full,
            };
            let col = |rows: std::ops::Range<usize>| {
                if tp.is_some() {
                    Shard::Column(rows)
                } else {
                    Shard::Full
                }
            };
            let (qh, kvh, inter) = (&plan.q_heads, &plan.kv_heads, plan.intermediate.clone());
            let attn = |name: &str| format!("{p}.self_attn.{name}");
            let self_attn = Attention {
                qkv_proj: Linear::load_merged(
                    src,
                    &[
                        (&attn("q_proj"), nh * hd, col(heads(qh))),
                        (&attn("k_proj"), nkv * hd, col(heads(kvh))),
                        (&attn("v_proj"), nkv * hd, col(heads(kvh))),
                    ],
                    h,
                    cfg.qkv_bias,
                    q,
                )?,
                o_proj: Linear::load(src, &attn("o_proj"), nh * hd, h, false, q, row(heads(qh)))?,
                q_norm: qk_norm("q_norm")?,
                k_norm: qk_norm("k_norm")?,
                n_heads: qh.len() as i32,
                n_kv_heads: kvh.len() as i32,
                head_dim: hd as i32,
                // YaRN scales q and k (cos and sin) by its attention factor: the logits take its square.
                scale: (hd as f32).powf(-0.5) * cfg.rope.logit_scale(),
            };
            let i_sz = cfg.intermediate_size;
            let mlp_name = |name: &str| format!("{p}.mlp.{name}");
            let mlp = Mlp {
                gate_up_proj: Linear::load_merged(
                    src,
                    &[
                        (&mlp_name("gate_proj"), i_sz, col(inter.clone())),
                        (&mlp_name("up_proj"), i_sz, col(inter.clone())),
                    ],
                    h,
                    false,
                    q,
                )?,
                down_proj: Linear::load(
                    src,
                    &mlp_name("down_proj"),
                    i_sz,
                    h,
                    false,
                    q,
                    row(inter),
                )?,
            };
            layers.push(Block {
                input_layernorm: RmsNorm::load(
                    src,
                    &format!("{p}.input_layernorm.weight"),
                    h,
                    eps,
                )?,
                self_attn,
                post_attention_layernorm: RmsNorm::load(
                    src,
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                    eps,
                )?,
                mlp,
            });
            // materialise layer by layer so file pages and host copies are released early
            let arrays = layers.last().unwrap().arrays();
            mlx::eval(&arrays)?;
            progress(i + 1, cfg.num_layers);
        }
        let norm = RmsNorm::load(src, "model.norm.weight", h, eps)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(Linear::load(
                src,
                "lm_head",
                h,
                cfg.vocab_size,
                false,
                q,
                Shard::Full,
            )?)
        };
        let kv_heads = plan.kv_heads.len();
        let model = Transformer {
            kv_heads,
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope: Rope::new(cfg)?,
        };
        let rest: Vec<&Array> = model
            .embed_tokens
            .arrays()
            .into_iter()
            .chain(std::iter::once(&model.norm.weight))
            .chain(model.lm_head.iter().flat_map(|l| l.arrays()))
            .collect();
        mlx::eval(&rest)?;
        Ok(model)
    }

    /// Element type of activations and of the KV cache.
    pub fn activation_dtype(&self) -> Dtype {
        self.embed_tokens.out_dtype()
    }

    /// Query heads held by this process (all, or this rank's shard).
    fn q_heads(&self) -> usize {
        self.layers
            .first()
            .map_or(0, |b| b.self_attn.n_heads as usize)
    }

    /// Whether decode steps run mlxcel's attention kernel (`kernels::attn`) here.
    fn attn_kernel_fits(&self) -> bool {
        self.layers.first().is_some_and(|b| {
            let a = &b.self_attn;
            kernels::attn::supported(
                a.n_heads as usize,
                a.n_kv_heads as usize,
                a.head_dim as usize,
                self.activation_dtype(),
            )
        })
    }

    /// A KV cache for this model.
    pub fn new_cache(&self, slots: usize, max_len: usize) -> KvCache {
        KvCache::new(
            self.cfg.num_layers,
            slots,
            self.kv_heads,
            self.cfg.head_dim,
            self.activation_dtype(),
            max_len,
        )
    }

    /// Bytes of all weights.
    pub fn weight_bytes(&self) -> usize {
        let mut all = self.embed_tokens.arrays();
        all.push(&self.norm.weight);
        if let Some(l) = &self.lm_head {
            all.extend(l.arrays());
        }
        for b in &self.layers {
            all.extend(b.arrays());
        }
        all.iter().map(|a| a.nbytes()).sum()
    }

    /// Run one step. Sequences with one token are batched together (decode);
    /// longer ones (prefill chunks) run one at a time. Logits are float32, in input order.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        mode: Logits,
    ) -> std::result::Result<Vec<Array>, ForwardError> {
        let vocab = self.cfg.vocab_size;
        let mut needed = 0;
        for s in seqs {
            cache.check_slot(s.slot)?;
            if s.tokens.is_empty() {
                return Err(ForwardError::Empty);
            }
            if let Some(&id) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(ForwardError::BadToken { id, vocab });
            }
            needed = needed.max(cache.len(s.slot) + s.tokens.len());
        }
        cache.reserve(self.layers.len(), needed)?;
        let mut out: Vec<Option<Array>> = vec![None; seqs.len()];
        let decode: Vec<usize> = (0..seqs.len())
            .filter(|&i| seqs[i].tokens.len() == 1)
            .collect();
        if decode.len() > 1 && mode == Logits::Last {
            let logits = self.forward_decode_batch(cache, seqs, &decode)?;
            for (row, &i) in decode.iter().enumerate() {
                out[i] = Some(logits.slice_axis(0, row as i32, row as i32 + 1)?);
            }
        }
        for (i, s) in seqs.iter().enumerate() {
            if out[i].is_none() {
                out[i] = Some(self.forward_one(cache, s, mode)?);
            }
        }
        Ok(out.into_iter().map(|a| a.unwrap()).collect())
    }

    /// A step of only single-token sequences (a decode step) as one `[n_seqs, vocab]` float32
    /// array, row i for sequence i: no per-row slicing.
    pub fn forward_decode_rows(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
    ) -> std::result::Result<Array, ForwardError> {
        let vocab = self.cfg.vocab_size;
        let mut needed = 0;
        for s in seqs {
            cache.check_slot(s.slot)?;
            if s.tokens.len() != 1 {
                return Err(ForwardError::Empty);
            }
            if s.tokens[0] as usize >= vocab {
                return Err(ForwardError::BadToken {
                    id: s.tokens[0],
                    vocab,
                });
            }
            needed = needed.max(cache.len(s.slot) + 1);
        }
        cache.reserve(self.layers.len(), needed)?;
        if seqs.len() == 1 {
            return self.forward_one(cache, &seqs[0], Logits::Last);
        }
        let rows: Vec<usize> = (0..seqs.len()).collect();
        self.forward_decode_batch(cache, seqs, &rows)
    }

    fn forward_one(
        &self,
        cache: &mut KvCache,
        s: &SeqInput<'_>,
        mode: Logits,
    ) -> std::result::Result<Array, ForwardError> {
        let ids: Vec<i32> = s.tokens.iter().map(|&x| x as i32).collect();
        let ids = Array::from_slice(&ids, &[1, ids.len() as i32])?;
        self.forward_slot_ids(cache, s.slot, &ids, mode)
    }

    /// One sequence's step with its token ids already on the device (`[1, T]` int32), so a
    /// decode loop can queue step i+1 before reading token i. Ids are not range-checked here.
    pub fn forward_slot_ids(
        &self,
        cache: &mut KvCache,
        slot: usize,
        ids: &Array,
        mode: Logits,
    ) -> std::result::Result<Array, ForwardError> {
        cache.check_slot(slot)?;
        let t = ids.dim(1);
        cache.reserve(self.layers.len(), cache.len(slot) + t as usize)?;
        let s = SeqInput { slot, tokens: &[] };
        let pos = cache.len(s.slot);
        let offset = Array::scalar_i32(pos as i32)?;
        let mut h = self.embed_tokens.forward(ids)?;
        // On a GPU the host encodes a long input's layers far ahead of the device, and a
        // temporary is only freed once the device is done with it, so without a bound every
        // layer's temporaries are alive at once: activations, and for a quantized model each
        // layer's dequantized weight (layers::dequant_gemm; 4-bit 8B prefill(2048) peaked
        // at 22.7 GB on H200, 8.3 GB with the bound). Keep at most two layers in flight.
        let bound = t as usize >= PREFILL_BOUND_MIN_ROWS && mlx::backend() != mlx::Backend::Cpu;
        let mut in_flight: Option<Array> = None;
        for (li, block) in self.layers.iter().enumerate() {
            let a = &block.self_attn;
            let (q, kv) = a.qkv(&h, &block.input_layernorm, 1, t, &self.rope, &offset)?;
            // one sequence reads its slot as views with MLX's attention: at batch 1 that
            // beat mlxcel's kernel (`kernels::attn`, used for batched steps) on H200
            let (kk, vv) = cache.write_and_read(li, s.slot, pos, &kv)?;
            let mask = if t > 1 {
                fast::Mask::Causal
            } else {
                fast::Mask::None
            };
            let o = fast::sdpa(&q, &kk, &vv, a.scale, mask)?;
            h = a.out_residual(&o, &h, 1, t)?;
            h = block
                .mlp
                .forward_residual(&h, &block.post_attention_layernorm)?;
            if bound {
                mlx::async_eval(&[&h])?;
                if let Some(prev) = in_flight.replace(h.clone()) {
                    prev.eval()?;
                }
            }
        }
        cache.advance(s.slot, t as usize);
        let h = if mode == Logits::Last {
            h.slice_axis(1, t - 1, t)?
        } else {
            h
        };
        let logits = self.head(&h)?;
        Ok(logits.reshape(&[-1, self.cfg.vocab_size as i32])?)
    }

    fn forward_decode_batch(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        rows: &[usize],
    ) -> std::result::Result<Array, ForwardError> {
        let b = rows.len() as i32;
        let slots: Vec<usize> = rows.iter().map(|&i| seqs[i].slot).collect();
        let ids: Vec<i32> = rows.iter().map(|&i| seqs[i].tokens[0] as i32).collect();
        let ids = Array::from_slice(&ids, &[b, 1])?;
        self.forward_decode_batch_ids(cache, &slots, &ids)
    }

    /// A decode step of the sequences in `slots` (one token each) with the token ids
    /// already on the device (`[B, 1]` int32, e.g. the previous step's samples), so a
    /// decode loop can queue step t+1 before reading step t's tokens. Returns
    /// `[B, vocab]`. Ids are not range-checked here.
    pub fn forward_decode_ids(
        &self,
        cache: &mut KvCache,
        slots: &[usize],
        ids: &Array,
    ) -> std::result::Result<Array, ForwardError> {
        if slots.is_empty() {
            return Err(ForwardError::Empty);
        }
        let mut needed = 0;
        for &s in slots {
            cache.check_slot(s)?;
            needed = needed.max(cache.len(s) + 1);
        }
        cache.reserve(self.layers.len(), needed)?;
        if slots.len() == 1 {
            let logits = self.forward_slot_ids(cache, slots[0], ids, Logits::Last)?;
            return Ok(logits.reshape(&[1, self.cfg.vocab_size as i32])?);
        }
        self.forward_decode_batch_ids(cache, slots, ids)
    }

    fn forward_decode_batch_ids(
        &self,
        cache: &mut KvCache,
        slots: &[usize],
        ids: &Array,
    ) -> std::result::Result<Array, ForwardError> {
        let b = slots.len() as i32;
        let slots = slots.to_vec();
        let positions: Vec<usize> = slots.iter().map(|&s| cache.len(s)).collect();
        let pos_i32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let offset = Array::from_slice(&pos_i32, &[b])?;
        // mlxcel's attention kernel: one op per layer whatever the rows' slots and lengths
        // (MLX's needs views, a mask and an op per run of consecutive slots); 8B 4-bit on
        // H200, batch 8: 2,111-2,517 tok/s with it, 1,612-1,731 without
        let kernel = self.attn_kernel_fits();
        let index = cache.batch_index(&slots, &positions, !kernel)?;
        let scratch = match kernel {
            true => Some(cache.attn_scratch(self.q_heads())?.clone()),
            false => None,
        };
        let mut h = self.embed_tokens.forward(ids)?;
        for (li, block) in self.layers.iter().enumerate() {
            let a = &block.self_attn;
            let (q, kv) = a.qkv(&h, &block.input_layernorm, b, 1, &self.rope, &offset)?;
            cache.write_batch(li, &index, &kv)?;
            let o = match &scratch {
                // every row its own slot and length, in one kernel
                Some(scratch) => {
                    a.decode_attention(&q, cache.pool(li), index.slot_array(), &offset, scratch)?
                }
                None => a.attend_runs(&q, cache, li, &index)?,
            };
            h = a.out_residual(&o, &h, b, 1)?;
            h = block
                .mlp
                .forward_residual(&h, &block.post_attention_layernorm)?;
        }
        for &s in &slots {
            cache.advance(s, 1);
        }
        Ok(self.head(&h)?.reshape(&[b, self.cfg.vocab_size as i32])?)
    }

    /// Float32 logits of the final norm of `h` (the norm fused into the GEMV when it runs).
    fn head(&self, h: &Array) -> mlx::Result<Array> {
        let lin = match &self.lm_head {
            Some(l) => l,
            None => self.embed_tokens.as_linear(),
        };
        let mut shape = h.shape();
        *shape.last_mut().expect("h has a last axis") = lin.out_dim() as i32;
        lin.forward_shaped(h, &shape, Some(&self.norm))?
            .astype(Dtype::F32)
    }
}

impl Attention {
    /// A batched decode step's attention with MLX's sdpa: per run of consecutive slots,
    /// the KV pool read as a view and the run's mask.
    fn attend_runs(
        &self,
        q: &Array,
        cache: &KvCache,
        layer: usize,
        index: &BatchIndex,
    ) -> mlx::Result<Array> {
        let mut outs = Vec::with_capacity(index.runs.len());
        for run in &index.runs {
            let (kk, vv) = cache.read_run(layer, run)?;
            let qr = if index.runs.len() == 1 {
                q.clone()
            } else {
                q.slice_axis(0, run.rows.start as i32, run.rows.end as i32)?
            };
            outs.push(fast::sdpa(
                &qr,
                &kk,
                &vv,
                self.scale,
                fast::Mask::Array(&run.mask),
            )?);
        }
        if outs.len() == 1 {
            return Ok(outs.pop().unwrap());
        }
        mlx::concatenate(&outs.iter().collect::<Vec<_>>(), 0)
    }

    /// A decode step's attention by mlxcel's kernel (`kernels::attn`): q `[B, heads, 1,
    /// head_dim]` over the layer's `pool`, row b at slot `slots[b]` up to `pos[b]`.
    fn decode_attention(
        &self,
        q: &Array,
        pool: &Array,
        slots: &Array,
        pos: &Array,
        scratch: &kernels::attn::Scratch,
    ) -> mlx::Result<Array> {
        kernels::attn::decode(
            q,
            pool,
            slots,
            pos,
            scratch,
            self.n_heads as usize,
            self.n_kv_heads as usize,
            self.head_dim as usize,
            self.scale,
        )
    }

    /// Project `norm(x)` to q/k/v `[B, heads, T, head_dim]`, with q/k norm and RoPE applied;
    /// k and v come as one array when the fused kernel made them so.
    fn qkv(
        &self,
        x: &Array,
        norm: &RmsNorm,
        b: i32,
        t: i32,
        rope: &Rope,
        offset: &Array,
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
            ) {
                let (q, kv) = r?;
                return Ok((q, NewKv::Merged(kv)));
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
            if self.q_norm.is_none() && self.k_norm.is_none() {
                // q and k are adjacent: one RoPE kernel for both, then split the heads
                let qk = rope.forward(&y.slice_axis(1, 0, nq + nkv)?, offset)?;
                let v = y.slice_axis(1, nq + nkv, nq + 2 * nkv)?;
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

    /// `res + o_proj(o)`: merge the heads of `o` (`[B, heads, T, head_dim]`) and project
    /// back to the hidden size, added to the residual stream `res` (`[B, T, hidden]`).
    fn out_residual(&self, o: &Array, res: &Array, b: i32, t: i32) -> mlx::Result<Array> {
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

impl Mlp {
    /// `h + down(silu(gate(x)) · up(x))` with `x = norm(h)`
    fn forward_residual(&self, h: &Array, norm: &RmsNorm) -> mlx::Result<Array> {
        self.down_proj
            .forward_residual(&self.gate_up_proj.forward_swiglu(h, Some(norm))?, h)
    }
}

impl Block {
    fn arrays(&self) -> Vec<&Array> {
        let a = &self.self_attn;
        let mut v: Vec<&Array> = vec![
            &self.input_layernorm.weight,
            &self.post_attention_layernorm.weight,
        ];
        for l in [
            &a.qkv_proj,
            &a.o_proj,
            &self.mlp.gate_up_proj,
            &self.mlp.down_proj,
        ] {
            v.extend(l.arrays());
        }
        v.extend(a.q_norm.iter().map(|n| &n.weight));
        v.extend(a.k_norm.iter().map(|n| &n.weight));
        v
    }
}
