//! [`Model`]: the one decoder loop of every family (Llama, Mistral, Qwen2, Qwen3),
//! written like single-device code: embedding → N × (attention block + MLP block,
//! pre-norm, residual; `super::blocks`) → norm → lm_head. What each family loads is
//! its layout ([`decoder_layout`] with the family's block choices).
//!
//! A forward step takes a batch of sequences, each with its KV-cache slot and
//! new tokens; their positions are the slots' current lengths.
use std::rc::Rc;

use crate::kernels;
use crate::mlx::distributed::Group;
use crate::mlx::{self, fast, Array, Dtype};

use super::blocks::attention::{Attention, AttentionLayout, AttentionOptions};
use super::blocks::mlp::{Mlp, MlpLayout};
use super::blocks::moe::{MoeBlock, MoeLayout};
use super::blocks::norm::RmsNorm;
use super::config::ModelConfig;
use super::kv_cache::{self, KvCache, KvConfig, KvError, NewKv, SeqRows};
use super::layers::{Embedding, Linear, Result, Rope, VocabRows};
use super::layout::{FeedForwardLayout, LayerLayout, Layout, ParamSpec, Split};
use super::shard::ShardPlan;
use super::weights::WeightSource;

/// Inputs of at least this many tokens keep at most two layers in flight on a GPU
/// (see `Model::forward`, one slot's chunk): a decode step must not wait inside itself.
const PREFILL_BOUND_MIN_ROWS: usize = 32;

thread_local! {
    /// Set while a warm-up builds graphs it drops unevaluated ([`BuildOnly`]).
    static BUILD_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, long inputs' graphs on this thread are built without the two-layer bound:
/// nothing is evaluated on the way. For a warm-up that builds graphs only to name their
/// kernel variants and drops them: with the bound, each long prompt evaluated its layers
/// as it was built, which waited for every kernel compiling by then (on an H100 the
/// background warm-up's builds took 48 s instead of building batch 1's kernels first).
#[must_use = "the bound is back as soon as the guard is dropped"]
pub struct BuildOnly(bool);

impl BuildOnly {
    pub fn start() -> Self {
        BuildOnly(BUILD_ONLY.with(|b| b.replace(true)))
    }
}

impl Drop for BuildOnly {
    fn drop(&mut self) {
        BUILD_ONLY.with(|b| b.set(self.0));
    }
}

/// Whether a long input of `rows` keeps at most two layers in flight (on a GPU, unless a
/// [`BuildOnly`] is alive).
fn bound_in_flight(rows: usize) -> bool {
    rows >= PREFILL_BOUND_MIN_ROWS
        && mlx::backend() != mlx::Backend::Cpu
        && !BUILD_ONLY.with(|b| b.get())
}

/// A decode step's layers as one op (`MLXCEL_FUSED_STEP`, [`mlx::fuse_graph`]), or `h` as
/// it is where they cannot be (ops on two streams), said once.
fn fused_layers(h: Array) -> Array {
    match mlx::fuse_graph(&[&h]) {
        Ok(mut v) => v.remove(0),
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!("MLXCEL_FUSED_STEP: the layers stay separate ops: {e}")
            });
            h
        }
    }
}

/// At most two layers of a long input in flight, where `bound` (else nothing is done).
struct TwoInFlight {
    bound: bool,
    last: Option<Array>,
}

impl TwoInFlight {
    fn new(bound: bool) -> Self {
        TwoInFlight { bound, last: None }
    }

    /// Queue layer output `h` and wait for the one before it.
    fn keep(&mut self, h: &Array) -> mlx::Result<()> {
        if !self.bound {
            return Ok(());
        }
        mlx::async_eval(&[h])?;
        if let Some(prev) = self.last.replace(h.clone()) {
            prev.eval()?;
        }
        Ok(())
    }
}

struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
}

/// A layer's feed-forward block.
enum FeedForward {
    Dense(Mlp),
    Moe(Box<MoeBlock>),
}

impl FeedForward {
    fn load(
        src: &dyn WeightSource,
        layout: &FeedForwardLayout,
        cfg: &ModelConfig,
        tp: Option<Rc<Group>>,
    ) -> Result<FeedForward> {
        Ok(match layout {
            FeedForwardLayout::Dense(l) => FeedForward::Dense(Mlp::load(src, l, tp)?),
            FeedForwardLayout::Moe(l) => {
                let e = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
                FeedForward::Moe(Box::new(MoeBlock::load(src, l, e, tp)?))
            }
        })
    }

    /// `h + ffn(norm(h))`.
    fn forward_residual(&self, h: &Array, norm: &RmsNorm) -> mlx::Result<Array> {
        match self {
            FeedForward::Dense(m) => m.forward_residual(h, norm),
            FeedForward::Moe(m) => m.forward_residual(h, norm),
        }
    }

    fn arrays(&self) -> Vec<&Array> {
        match self {
            FeedForward::Dense(m) => m.arrays(),
            FeedForward::Moe(m) => m.arrays(),
        }
    }
}

/// One sequence's part of a forward step.
#[derive(Debug, Clone, Copy)]

pub struct SeqInput<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
}

/// The token ids of one forward step.
#[derive(Debug, Clone, Copy)]
pub enum StepInput<'a> {
    /// Ids on the host, per sequence: one token is a decode row, more a prefill chunk.
    /// Ids are range-checked.
    Host(&'a [SeqInput<'a>]),
    /// Ids already on the device (e.g. the previous step's samples), so that a decode loop
    /// can queue step t+1 before it reads step t's tokens: `[B, 1]` int32, one decode row
    /// for each of `slots`, or `[1, T]` for a chunk of one slot. Not range-checked.
    Device { slots: &'a [usize], ids: &'a Array },
}

/// Which logits a step returns (float32, in input order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Each sequence's last position: one `[1, vocab]` array per sequence.
    Last,
    /// Every position of every sequence (tests): one `[T, vocab]` per sequence.
    All,
    /// Each sequence's last position as a single `[n_seqs, vocab]` array (row i for
    /// sequence i, no per-row slicing): what a decode step hands its sampler.
    Rows,
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
    #[error("all-position logits need a single sequence when the ids are on the device")]
    AllLogitsOfRows,
}

/// The MLX ops of a decode step ([`Model::decode_ops`]).
#[derive(Debug, Clone, Default)]
pub struct DecodeOps {
    /// The whole step: embedding, every layer, final norm and lm_head (to float32 logits).
    pub step: mlx::graph::OpCounts,
    /// Each layer alone, from its input to its output and its KV-cache writes (empty when the
    /// slot's blocks are scattered).
    pub layers: Vec<mlx::graph::OpCounts>,
}

impl DecodeOps {
    /// The most ops of any layer (every layer of a model builds the same ops).
    pub fn per_layer(&self) -> usize {
        self.layers.iter().map(|l| l.total()).max().unwrap_or(0)
    }

    /// Ops outside the layers: embedding, final norm, lm_head, logits cast.
    pub fn outside_layers(&self) -> usize {
        let in_layers: usize = self.layers.iter().map(|l| l.total()).sum();
        self.step.total().saturating_sub(in_layers)
    }
}

pub struct Model {
    pub cfg: ModelConfig,
    /// KV heads held by this process (all, or this rank's shard).
    kv_heads: usize,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// This rank's vocabulary rows when the embedding and lm_head are vocab-parallel.
    vocab: Option<VocabRows>,
    rope: Rope,
}

impl Model {
    /// Load every weight named as in the HF / mlx-community checkpoint.
    pub fn load(
        cfg: &ModelConfig,
        src: &dyn WeightSource,
        progress: impl FnMut(usize, usize),
    ) -> Result<Model> {
        Self::load_shard(cfg, src, &ShardPlan::full(cfg), None, progress)
    }

    /// Load this rank's shard under `plan`, as `cfg`'s family lays it out
    /// ([`super::layout`]); row-parallel layers reduce over `tp`.
    pub fn load_shard(
        cfg: &ModelConfig,
        src: &dyn WeightSource,
        plan: &ShardPlan,
        tp: Option<Rc<Group>>,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Model> {
        let layout = super::layout(cfg, plan);
        // with one rank nothing splits, whatever the layout's ranges say
        let tp = tp.filter(|_| layout.sharded);
        let eps = cfg.rms_norm_eps;
        let embed_tokens = Embedding::load(src, &layout.embed_tokens)?;
        let vocab = vocab_rows(&layout, plan, &embed_tokens, tp.clone())?;
        let mut layers = Vec::with_capacity(layout.layers.len());
        for (i, l) in layout.layers.iter().enumerate() {
            layers.push(Block {
                input_layernorm: RmsNorm::load(src, &l.input_layernorm, eps)?,
                self_attn: Attention::load(src, &l.attn, cfg, plan, tp.clone())?,
                post_attention_layernorm: RmsNorm::load(src, &l.post_attention_layernorm, eps)?,
                mlp: FeedForward::load(src, &l.mlp, cfg, tp.clone())?,
            });
            // materialise layer by layer so file pages and host copies are released early
            let arrays = layers.last().unwrap().arrays();
            mlx::eval(&arrays)?;
            progress(i + 1, layout.layers.len());
        }
        let norm = RmsNorm::load(src, &layout.norm, eps)?;
        let lm_head = match &layout.lm_head {
            None => None,
            Some(spec) => Some(Linear::load(src, spec, None)?),
        };
        let kv_heads = plan.kv_heads.len();
        let model = Model {
            kv_heads,
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            vocab,
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

    /// A KV cache for this model: room for `slots` sequences of `max_len` tokens.
    pub fn new_cache(&self, slots: usize, max_len: usize) -> KvCache {
        let kv = KvConfig::for_slots(slots, max_len, kv_cache::DEFAULT_BLOCK_SIZE);
        self.new_paged_cache(slots, max_len, kv)
    }

    /// A KV cache for this model over a block pool of `kv`.
    pub fn new_paged_cache(&self, slots: usize, max_len: usize, kv: KvConfig) -> KvCache {
        KvCache::new(
            self.cfg.num_layers,
            slots,
            self.kv_heads,
            self.cfg.head_dim,
            self.activation_dtype(),
            max_len,
            kv,
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

    /// Run one step: the model's one entry point. Host sequences with one token are batched
    /// together (decode); longer ones (prefill chunks) run together as one pass when there
    /// are several and only the last positions' logits are wanted, one at a time otherwise. With
    /// [`Logits::Rows`] the result is one `[n_seqs, vocab]` array; otherwise one array per
    /// sequence. Device ids of several slots are decode rows and give one `[B, vocab]` array
    /// (`Logits::All` needs a single slot).
    pub fn forward(
        &self,
        cache: &mut KvCache,
        input: StepInput<'_>,
        mode: Logits,
    ) -> std::result::Result<Vec<Array>, ForwardError> {
        match (input, mode) {
            (StepInput::Host(seqs), Logits::Rows) => {
                Ok(vec![self.forward_decode_rows(cache, seqs)?])
            }
            (StepInput::Host(seqs), _) => self.forward_host(cache, seqs, mode),
            (StepInput::Device { slots: [slot], ids }, _) => {
                let mode = if mode == Logits::All {
                    Logits::All
                } else {
                    Logits::Last
                };
                Ok(vec![self.forward_slot_ids(cache, *slot, ids, mode)?])
            }
            (StepInput::Device { .. }, Logits::All) => Err(ForwardError::AllLogitsOfRows),
            (StepInput::Device { slots, ids }, _) => {
                Ok(vec![self.forward_decode_ids(cache, slots, ids)?])
            }
        }
    }

    fn forward_host(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        mode: Logits,
    ) -> std::result::Result<Vec<Array>, ForwardError> {
        let vocab = self.cfg.vocab_size;
        let mut needs = Vec::with_capacity(seqs.len());
        for s in seqs {
            cache.check_slot(s.slot)?;
            if s.tokens.is_empty() {
                return Err(ForwardError::Empty);
            }
            if let Some(&id) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(ForwardError::BadToken { id, vocab });
            }
            needs.push((s.slot, cache.len(s.slot) + s.tokens.len()));
        }
        cache.prepare(self.layers.len(), &needs)?;
        if mode == Logits::Last && seqs.len() > 1 {
            // several sequences: one pass, whose one write per layer holds all their new
            // keys and values (a second write into a pool after a read of it in the same
            // step would copy the pool: kv_cache's notes)
            let decode: Vec<usize> = (0..seqs.len())
                .filter(|&i| seqs[i].tokens.len() == 1)
                .collect();
            let chunks: Vec<usize> = (0..seqs.len())
                .filter(|&i| seqs[i].tokens.len() > 1)
                .collect();
            if chunks.is_empty() {
                let logits = self.forward_decode_batch(cache, seqs, &decode)?;
                return (0..seqs.len() as i32)
                    .map(|k| Ok(logits.slice_axis(0, k, k + 1)?))
                    .collect();
            }
            let slots: Vec<usize> = decode.iter().map(|&i| seqs[i].slot).collect();
            let ids: Vec<i32> = decode.iter().map(|&i| seqs[i].tokens[0] as i32).collect();
            let ids = Array::from_slice(&ids, &[ids.len() as i32, 1])?;
            let parts: Vec<(usize, &[u32])> = chunks
                .iter()
                .map(|&i| (seqs[i].slot, seqs[i].tokens))
                .collect();
            let dec = (!decode.is_empty()).then_some((slots.as_slice(), &ids));
            let (dec_logits, chunk_logits) = self.forward_mixed(cache, dec, &parts)?;
            let mut out: Vec<Option<Array>> = vec![None; seqs.len()];
            if let Some(l) = dec_logits {
                for (row, &i) in decode.iter().enumerate() {
                    out[i] = Some(l.slice_axis(0, row as i32, row as i32 + 1)?);
                }
            }
            for (l, &i) in chunk_logits.into_iter().zip(&chunks) {
                out[i] = Some(l);
            }
            return Ok(out.into_iter().map(|a| a.expect("every row")).collect());
        }
        // one sequence, or every position's logits (reference tests): each alone, with a
        // write of its own
        let mut out = Vec::with_capacity(seqs.len());
        for s in seqs {
            out.push(self.forward_one(cache, s, mode)?);
        }
        Ok(out)
    }

    /// A step of only single-token sequences (a decode step) as one `[n_seqs, vocab]` float32
    /// array, row i for sequence i: no per-row slicing.
    fn forward_decode_rows(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
    ) -> std::result::Result<Array, ForwardError> {
        let vocab = self.cfg.vocab_size;
        let mut needs = Vec::with_capacity(seqs.len());
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
            needs.push((s.slot, cache.len(s.slot) + 1));
        }
        cache.prepare(self.layers.len(), &needs)?;
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
    fn forward_slot_ids(
        &self,
        cache: &mut KvCache,
        slot: usize,
        ids: &Array,
        mode: Logits,
    ) -> std::result::Result<Array, ForwardError> {
        self.forward_slot_ids_probed(cache, slot, ids, mode, None)
    }

    /// [`Model::forward_slot_ids`], pushing the residual stream onto `probe` (when given)
    /// after the embedding and after each layer (a run of rows only; scattered blocks
    /// push nothing).
    fn forward_slot_ids_probed(
        &self,
        cache: &mut KvCache,
        slot: usize,
        ids: &Array,
        mode: Logits,
        mut probe: Option<&mut Vec<Array>>,
    ) -> std::result::Result<Array, ForwardError> {
        cache.check_slot(slot)?;
        let t = ids.dim(1);
        let pos = cache.len(slot);
        cache.prepare(self.layers.len(), &[(slot, pos + t as usize)])?;
        let rows = cache.seq_rows(slot, pos, t as usize)?;
        if t == 1 && !rows.is_run() {
            // one token over scattered blocks: the batched decode path reads through the
            // block table (the kernel, or a gather)
            return Ok(self
                .forward_decode_batch_ids(cache, &[slot], ids)?
                .reshape(&[-1, self.cfg.vocab_size as i32])?);
        }
        // (on CUDA in device memory: every layer's q/k/v kernel reads it) and, where the
        // q/k/v kernel writes the new keys and values into the pool, the rows it writes
        // (each its own array: a single value is made on the device by an `arange`)
        let dst = match kernels::knobs::get().kv_fused {
            true => cache.seq_kv_dst(&rows),
            false => None,
        };
        let made = |v: &[i32], shape: &[i32]| -> mlx::Result<Array> {
            Ok(kv_cache::step_i32(&[(v, shape)])?.pop().expect("one part"))
        };
        let offset = made(&[pos as i32], &[])?;
        let dst = dst.map(|row| made(&[row], &[1])).transpose()?;
        // `MLXCEL_ATTN_SINGLE=1`: where the q/k/v kernel writes the pool, mlxcel's attention
        // kernel reads it through the run's block table (consecutive block ids: an `arange`
        // on the device) in one op per layer, instead of MLX's sdpa over two views (two)
        let single = match &rows {
            SeqRows::Run { start, .. }
                if dst.is_some()
                    && kernels::knobs::get().attn_single
                    && self.attn_kernel_fits()
                    && kernels::attn::block_size_fits(cache.block_size()) =>
            {
                let bs = cache.block_size();
                let b0 = (start / bs) as i32;
                let nb = (pos + 1).div_ceil(bs) as i32;
                let ids: Vec<i32> = (b0..b0 + nb).collect();
                let table = made(&ids, &[1, nb])?;
                Some((table, cache.attn_scratch(self.q_heads())?.clone()))
            }
            _ => None,
        };
        if probe.is_some() {
            // (counting ops per layer: the step's inputs are made once per step, not in
            // each layer that reads them, so they are evaluated before the layers are counted)
            let inputs: Vec<&Array> = std::iter::once(&offset)
                .chain(dst.as_ref())
                .chain(single.as_ref().map(|s| &s.0))
                .collect();
            mlx::eval(&inputs)?;
        }
        let mut h = self.embed(ids)?;
        if t == 1 {
            h = self.decode_rows(h)?;
        }
        // On a GPU the host encodes a long input's layers far ahead of the device, and a
        // temporary is only freed once the device is done with it, so without a bound every
        // layer's temporaries are alive at once: activations, and for a quantized model each
        // layer's dequantized weight (layers::dequant_gemm; 4-bit 8B prefill(2048) peaked
        // at 22.7 GB on H200, 8.3 GB with the bound). Keep at most two layers in flight.
        let mut in_flight = TwoInFlight::new(bound_in_flight(t as usize));
        if let Some(p) = probe.as_deref_mut() {
            p.push(h.clone());
        }
        for (li, block) in self.layers.iter().enumerate() {
            let a = &block.self_attn;
            let pool = match &dst {
                Some(_) => Self::pool_for(cache, li, a, &h)?,
                None => None,
            };
            let into = pool.as_ref().zip(dst.as_ref());
            let (q, kv) = a.qkv(&h, &block.input_layernorm, 1, t, &self.rope, &offset, into)?;
            let pool = Self::pool_written(cache, li, pool, &kv);
            let o = match (&single, &pool, &kv) {
                // the pool view the q/k/v kernel wrote through, read by mlxcel's kernel
                (Some((table, scratch)), Some(p), NewKv::Written) => {
                    cache.write(li, &rows, &kv)?;
                    a.decode_attention(&q, p, table, &offset, scratch, cache.block_size(), pos + 1)?
                }
                // one sequence whose blocks are one run of rows reads them as views with
                // MLX's attention (by default: at batch 1 it beat mlxcel's kernel on H100
                // and H200); scattered blocks (a prefill after a cached prefix) are gathered
                _ => {
                    let (kk, vv) = cache.write_and_read(li, &rows, &kv)?;
                    let mask = if t > 1 {
                        fast::Mask::Causal
                    } else {
                        fast::Mask::None
                    };
                    fast::sdpa(&q, &kk, &vv, a.scale, mask)?
                }
            };
            h = a.out_residual(&o, &h, 1, t)?;
            h = block
                .mlp
                .forward_residual(&h, &block.post_attention_layernorm)?;
            in_flight.keep(&h)?;
            if let Some(p) = probe.as_deref_mut() {
                p.push(h.clone());
            }
        }
        cache.advance(slot, t as usize);
        if t == 1 && kernels::knobs::get().fused_step && probe.is_none() {
            h = fused_layers(h);
        }
        let h = if mode == Logits::Last && t > 1 {
            h.slice_axis(1, t - 1, t)?
        } else {
            h
        };
        let logits = self.head(&h)?;
        Ok(logits.reshape(&[-1, self.cfg.vocab_size as i32])?)
    }

    /// One pass over a batched decode (`decode`: slots, one token each, ids `[B, 1]` int32
    /// already on the device) and prefill chunks (`chunks`: slot and tokens, two or more
    /// each, in other slots): the chunks' tokens end to end in one `[1, N]` input, so
    /// their projections, MLPs and norms run once over all `N` rows; each layer's new
    /// keys and values of the whole step go into its pool in one write
    /// ([`KvCache::write_step`]) before any of them is read; then the decode rows attend
    /// through their block tables (mlxcel's kernel, or MLX's attention over a gather) and
    /// each chunk over its own slot's cache (causal, after the positions cached before
    /// it). Returns the decode rows' logits (`[B, vocab]`) and each chunk's last-position
    /// logits (`[1, vocab]`), in order. Ids are not range-checked here.
    fn forward_mixed(
        &self,
        cache: &mut KvCache,
        decode: Option<(&[usize], &Array)>,
        chunks: &[(usize, &[u32])],
    ) -> std::result::Result<(Option<Array>, Vec<Array>), ForwardError> {
        let (slots, ids_d): (&[usize], Option<&Array>) = match decode {
            Some((s, ids)) => (s, Some(ids)),
            None => (&[], None),
        };
        let b = slots.len() as i32;
        let mut needs: Vec<(usize, usize)> = slots.iter().map(|&s| (s, cache.len(s) + 1)).collect();
        needs.extend(chunks.iter().map(|&(s, t)| (s, cache.len(s) + t.len())));
        cache.prepare(self.layers.len(), &needs)?;
        // the decode rows: positions, block tables (or gathers), the kernel's scratch
        let positions: Vec<usize> = slots.iter().map(|&s| cache.len(s)).collect();
        // (the most positions a decode row attends to: its new token's included)
        let max_len = positions.iter().max().map_or(0, |p| p + 1);
        // mlxcel's attention kernel: one op per layer whatever the rows' blocks and
        // lengths, read through their block tables (MLX's needs a gather and a mask);
        // 8B 4-bit on H200, batch 8: 2,111-2,517 tok/s with it, 1,612-1,731 without
        let kernel = self.attn_kernel_fits() && kernels::attn::block_size_fits(cache.block_size());
        let index = match b > 0 {
            true => Some(cache.batch_index(slots, &positions, kernel)?),
            false => None,
        };
        let scratch = match kernel && b > 0 {
            true => Some(cache.attn_scratch(self.q_heads())?.clone()),
            false => None,
        };
        // the chunks: lengths, rows, offsets, ids end to end
        let lens: Vec<i32> = chunks.iter().map(|(_, t)| t.len() as i32).collect();
        let n: i32 = lens.iter().sum();
        let mut rows = Vec::with_capacity(chunks.len());
        let mut offsets = Vec::with_capacity(chunks.len());
        for &(slot, t) in chunks {
            let pos = cache.len(slot);
            rows.push(cache.seq_rows(slot, pos, t.len())?);
            offsets.push(Array::scalar_i32(pos as i32)?);
        }
        let writes = cache.step_writes(index.as_ref(), &rows)?;
        let mut hd = match ids_d {
            Some(ids) => Some(self.decode_rows(self.embed(ids)?)?),
            None => None,
        };
        let mut hc = match chunks.is_empty() {
            true => None,
            false => {
                let ids: Vec<i32> = chunks
                    .iter()
                    .flat_map(|(_, t)| t.iter().map(|&x| x as i32))
                    .collect();
                Some(self.embed(&Array::from_slice(&ids, &[1, n])?)?)
            }
        };
        let mut in_flight = TwoInFlight::new(bound_in_flight(n as usize));
        // decode rows above the quantized GEMM's 128 take dequantize + GEMM too, whose
        // dequantized weights would otherwise be alive for every layer at once
        let mut in_flight_d =
            TwoInFlight::new(b as usize > kernels::qgemm::MAX_M && bound_in_flight(b as usize));
        for (li, block) in self.layers.iter().enumerate() {
            let a = &block.self_attn;
            let norm = &block.input_layernorm;
            let mut pool = None;
            let (q_d, kv_d) = match (&hd, &index) {
                (Some(h), Some(index)) => {
                    // The q/k/v kernel writes the pool through an input, which MLX does not
                    // see as a write: on CUDA its graph orders a kernel after the last one
                    // that *output* a buffer it reads, so only a reader that takes this
                    // kernel's q (mlxcel's attention kernel) is sure to see the new rows.
                    // So not where MLX's attention reads a gather of the pool (no kernel
                    // for the head size: the gather may run before the write; a batched
                    // bf16 Qwen2 fixture with heads of 16 drifted 0.58 from transformers on
                    // an H100), nor in a step with prefill chunks (their scatter into the
                    // pool had the same blind spot and lost the decode rows where MLX copied
                    // the pool for it: off by 0.18); the cache's scatter writes the decode
                    // rows then.
                    if kernels::knobs::get().kv_fused && chunks.is_empty() && kernel {
                        pool = Self::pool_for(cache, li, a, h)?;
                    }
                    let into = pool.as_ref().map(|p| (p, index.kv_dst()));
                    let positions = index.positions();
                    let (q, kv) = a.qkv(h, norm, b, 1, &self.rope, positions, into)?;
                    pool = Self::pool_written(cache, li, pool, &kv);
                    (Some(q), Some(kv))
                }
                _ => (None, None),
            };
            let (q_c, kv_c): (Vec<Array>, Vec<_>) = match &hc {
                Some(h) => a
                    .qkv_segments(h, norm, &lens, &offsets, &self.rope)?
                    .into_iter()
                    .unzip(),
                None => (Vec::new(), Vec::new()),
            };
            cache.write_step(li, &writes, kv_d.as_ref(), &kv_c)?;
            if let (Some(h), Some(q), Some(index)) = (&hd, &q_d, &index) {
                let o = match &scratch {
                    // every row its own slot and length, in one kernel
                    // (the view the q/k/v kernel wrote through; where the cache's scatter
                    // wrote the decode rows instead (a step with prefill chunks, which makes
                    // no such view; the GEMM of 9-128 rows; a projection the kernels do not
                    // cover), a view made after that write, which the attention op depends on)
                    Some(scratch) => a.decode_attention(
                        q,
                        &match pool.take() {
                            Some(p) => p,
                            None => cache.pool_view(li)?,
                        },
                        index.table().expect("made for the kernel"),
                        index.positions(),
                        scratch,
                        cache.block_size(),
                        max_len,
                    )?,
                    None => a.attend_gathered(q, cache, li, index)?,
                };
                let h = a.out_residual(&o, h, b, 1)?;
                let h = block
                    .mlp
                    .forward_residual(&h, &block.post_attention_layernorm)?;
                in_flight_d.keep(&h)?;
                hd = Some(h);
            }
            if let Some(h) = &hc {
                let mut outs = Vec::with_capacity(chunks.len());
                for ((q, r), &t) in q_c.iter().zip(&rows).zip(&lens) {
                    let (kk, vv) = cache.read(li, r)?;
                    let o = fast::sdpa(q, &kk, &vv, a.scale, fast::Mask::Causal)?;
                    // [1, heads, t, head_dim] → [1, t, heads·head_dim]
                    outs.push(o.transpose(&[0, 2, 1, 3])?.reshape(&[1, t, -1])?);
                }
                let o = match outs.len() {
                    1 => outs.pop().expect("one chunk"),
                    _ => mlx::concatenate(&outs.iter().collect::<Vec<_>>(), 1)?,
                };
                let h = a.out_residual_merged(&o, h)?;
                let h = block
                    .mlp
                    .forward_residual(&h, &block.post_attention_layernorm)?;
                in_flight.keep(&h)?;
                hc = Some(h);
            }
        }
        for &s in slots {
            cache.advance(s, 1);
        }
        for (&(s, _), &t) in chunks.iter().zip(&lens) {
            cache.advance(s, t as usize);
        }
        let vocab = self.cfg.vocab_size as i32;
        let dec_logits = match &hd {
            Some(h) => Some(self.head(h)?.reshape(&[b, vocab])?),
            None => None,
        };
        let chunk_logits = match &hc {
            Some(h) => {
                // each chunk's last row, then the head over those rows only
                let mut ends = Vec::with_capacity(chunks.len());
                let mut end = 0;
                for &t in &lens {
                    end += t;
                    ends.push(end - 1);
                }
                let last = h.take(&Array::from_slice(&ends, &[ends.len() as i32])?, 1)?;
                let logits = self.head(&last)?.reshape(&[-1, vocab])?;
                (0..chunks.len() as i32)
                    .map(|k| Ok(logits.slice_axis(0, k, k + 1)?))
                    .collect::<std::result::Result<Vec<_>, ForwardError>>()?
            }
            None => Vec::new(),
        };
        Ok((dec_logits, chunk_logits))
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
    fn forward_decode_ids(
        &self,
        cache: &mut KvCache,
        slots: &[usize],
        ids: &Array,
    ) -> std::result::Result<Array, ForwardError> {
        if slots.is_empty() {
            return Err(ForwardError::Empty);
        }
        let mut needs = Vec::with_capacity(slots.len());
        for &s in slots {
            cache.check_slot(s)?;
            needs.push((s, cache.len(s) + 1));
        }
        cache.prepare(self.layers.len(), &needs)?;
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
        let (logits, _) = self.forward_mixed(cache, Some((slots, ids)), &[])?;
        Ok(logits.expect("decode rows give logits"))
    }

    /// The MLX ops of one batch-1 decode step of `slot` (after two steps run first), as
    /// [`Model::forward`] builds it from device ids (`mlxcel bench`'s decode loop), counted
    /// before evaluation ([`mlx::graph::count_ops`]): the whole step (embedding, layers
    /// with their KV-cache writes, head) and each layer alone. MLX's fast ops count as one
    /// op each, as on a GPU ([`mlx::graph::FastOpsAsGpu`]); other choices of the backend
    /// are this one's (on a CPU, 4-bit linears are MLX's `quantized_matmul`, not mlxcel's
    /// CUDA GEMV kernel). The counted step is built, not run: it leaves `slot` three positions
    /// on, the last with keys and values that can never be evaluated on a CPU, so `cache`
    /// is for counting only afterwards (reset the slot, or drop the cache).
    pub fn decode_ops(
        &self,
        cache: &mut KvCache,
        slot: usize,
    ) -> std::result::Result<DecodeOps, ForwardError> {
        cache.check_slot(slot)?;
        let ids = Array::from_slice(&[1i32], &[1, 1])?;
        // steps run first make what a model makes on first use (its weights' views), and
        // what a decode loop keeps from one step to the next: the KV cache's whole-pool
        // views are kept only once their pool has been evaluated, which a new cache's
        // first step has not (MLXCEL_POOL_VIEW)
        for _ in 0..2 {
            let warm = self.forward_slot_ids(cache, slot, &ids, Logits::Last)?;
            mlx::eval(&[&warm])?;
        }
        cache.prepare(self.layers.len(), &[(slot, cache.len(slot) + 1)])?;
        // the pools' own growth is not the step's
        let pools: Vec<Array> = (0..self.layers.len())
            .map(|li| cache.pool(li).clone())
            .collect();
        mlx::eval(&pools.iter().collect::<Vec<_>>())?;
        let _as_gpu = mlx::graph::FastOpsAsGpu::new();
        let mut probe = Vec::with_capacity(self.layers.len() + 1);
        let logits =
            self.forward_slot_ids_probed(cache, slot, &ids, Logits::Last, Some(&mut probe))?;
        let pools: Vec<&Array> = (0..self.layers.len()).map(|li| cache.pool(li)).collect();
        let mut outputs = vec![&logits];
        outputs.extend(pools.iter().copied());
        let step = mlx::graph::count_ops(&outputs, &[]);
        let layers = match probe.len() == self.layers.len() + 1 {
            true => (0..self.layers.len())
                .map(|li| mlx::graph::count_ops(&[&probe[li + 1], pools[li]], &[&probe[li]]))
                .collect(),
            false => Vec::new(),
        };
        Ok(DecodeOps { step, layers })
    }

    /// `layer`'s KV pool as a view for its q/k/v kernel to write the step's keys and values
    /// into (`MLXCEL_KV_FUSED`), when attention `a` runs that kernel and the pool holds the
    /// activations' dtype (the kernel writes that); `None`: the cache writes them.
    fn pool_for(
        cache: &KvCache,
        layer: usize,
        a: &Attention,
        h: &Array,
    ) -> mlx::Result<Option<Array>> {
        match a.qkv_on_kernel() && cache.pool(layer).dtype() == h.dtype() {
            true => Ok(Some(cache.pool_view(layer)?)),
            false => Ok(None),
        }
    }

    /// `pool` ([`Model::pool_for`]'s view of `layer`'s pool) where the q/k/v product wrote
    /// `kv` through it; where it returned them instead (the GEMM of 9-128 rows, a shape or
    /// switch the GEMV's pool write does not take) the view is forgotten
    /// ([`KvCache::forget_unused_view`]) and `None` comes back.
    fn pool_written(
        cache: &KvCache,
        layer: usize,
        pool: Option<Array>,
        kv: &NewKv,
    ) -> Option<Array> {
        match pool {
            Some(p) if !matches!(kv, NewKv::Written) => {
                cache.forget_unused_view(layer, &p);
                None
            }
            p => p,
        }
    }

    /// A decode step's residual stream (`[B, 1, hidden]` from the embedding) as `[B, hidden]`:
    /// MLX multiplies a 2-D input by a weight as it is, where a 3-D one costs a flatten and
    /// an unflatten around every matmul (two ops per linear per layer).
    fn decode_rows(&self, h: Array) -> mlx::Result<Array> {
        let hidden = h.dim(-1);
        h.reshape(&[-1, hidden])
    }

    /// The embedding of `ids`: a table lookup, or this rank's part of it summed over the
    /// ranks (vocab-parallel).
    fn embed(&self, ids: &Array) -> mlx::Result<Array> {
        match &self.vocab {
            Some(v) => v.embed(&self.embed_tokens, ids),
            None => self.embed_tokens.forward(ids),
        }
    }

    /// Float32 logits of the final norm of `h` (the norm fused into the GEMV when it runs);
    /// vocab-parallel, this rank's columns gathered with the others' into `[rows, vocab]`.
    fn head(&self, h: &Array) -> mlx::Result<Array> {
        let lin = match &self.lm_head {
            Some(l) => l,
            None => self.embed_tokens.as_linear(),
        };
        let logits = match &self.vocab {
            Some(v) => {
                let rows = h.size() / lin.in_dim();
                let local = lin.forward_shaped(h, &v.local_shape(rows), Some(&self.norm))?;
                v.gather(&local)?
            }
            None => {
                let mut shape = h.shape();
                *shape.last_mut().expect("h has a last axis") = lin.out_dim() as i32;
                lin.forward_shaped(h, &shape, Some(&self.norm))?
            }
        };
        logits.astype(Dtype::F32)
    }
}

impl Block {
    fn arrays(&self) -> Vec<&Array> {
        let mut v: Vec<&Array> = vec![
            &self.input_layernorm.weight,
            &self.post_attention_layernorm.weight,
        ];
        v.extend(self.self_attn.arrays());
        v.extend(self.mlp.arrays());
        v
    }
}

/// The vocab-parallel tables of a rank whose layout splits the embedding by vocabulary
/// rows (`plan.vocab`); the lm_head, when not tied, must split the same way.
fn vocab_rows(
    layout: &Layout,
    plan: &ShardPlan,
    table: &Embedding,
    tp: Option<Rc<Group>>,
) -> Result<Option<VocabRows>> {
    let invalid = |msg: String| super::weights::LoadError::Mlx(mlx::MlxError::Invalid(msg));
    let split = &layout.embed_tokens.split;
    if let Some(head) = &layout.lm_head {
        if head.split != *split {
            return Err(invalid(format!(
                "{} splits as {:?} but {} as {split:?}: the lm_head and the embedding must \
                 split the vocabulary alike",
                head.name, head.split, layout.embed_tokens.name
            )));
        }
    }
    match (split, &plan.vocab) {
        (Split::Vocab(rows), Some(shard)) if *rows == shard.rows => {
            Ok(Some(VocabRows::new(shard, table.out_dtype(), tp)?))
        }
        (Split::Vocab(rows), _) => Err(invalid(format!(
            "{}: vocabulary rows {rows:?} are not the shard plan's ({:?})",
            layout.embed_tokens.name,
            plan.vocab.as_ref().map(|v| &v.rows)
        ))),
        _ => Ok(None),
    }
}

/// The layout of the Llama-like decoder (what [`Model`] loads): `model.embed_tokens`,
/// `model.layers.{i}` of an attention block with `attn`'s choices and a SwiGLU MLP, each
/// pre-normed (`input_layernorm`, `post_attention_layernorm`), `model.norm`, and
/// `lm_head` unless tied; column/row/vocabulary splits of `plan`, quantized as the config
/// says. A config with experts ([`ModelConfig::moe`]) gets a MoE block in its sparse
/// layers.
pub fn decoder_layout(cfg: &ModelConfig, plan: &ShardPlan, attn: AttentionOptions) -> Layout {
    let q = cfg.quantization;
    let h = cfg.hidden_size;
    let layers = (0..cfg.num_layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            LayerLayout {
                input_layernorm: ParamSpec::norm(format!("{p}.input_layernorm.weight"), h),
                attn: AttentionLayout::new(&format!("{p}.self_attn"), cfg, plan, q, attn),
                post_attention_layernorm: ParamSpec::norm(
                    format!("{p}.post_attention_layernorm.weight"),
                    h,
                ),
                mlp: match &cfg.moe {
                    Some(moe) if moe.is_sparse(i) => FeedForwardLayout::Moe(MoeLayout::new(
                        i,
                        cfg,
                        moe,
                        (plan.rank, plan.size, plan.expert_parallel),
                        q,
                    )),
                    _ => FeedForwardLayout::Dense(MlpLayout::new(
                        &format!("{p}.mlp"),
                        cfg,
                        plan.intermediate.clone(),
                        q,
                    )),
                },
            }
        })
        .collect();
    Layout {
        sharded: plan.is_sharded(),
        embed_tokens: ParamSpec::embedding("model.embed_tokens", cfg.vocab_size, h)
            .quantized(q)
            .split(plan.vocab_split()),
        layers,
        norm: ParamSpec::norm("model.norm.weight", h),
        lm_head: (!cfg.tie_word_embeddings).then(|| {
            ParamSpec::linear("lm_head", cfg.vocab_size, h, false)
                .quantized(q)
                .split(plan.vocab_split())
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_dir::ModelDir;
    use crate::models::LoadFormat;

    fn fixture(name: &str) -> Model {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        let md = ModelDir::open(&dir).unwrap();
        crate::models::load(&md, LoadFormat::Safetensors, |_, _| {})
            .unwrap()
            .model
    }

    fn max_diff(a: &Array, b: &Array) -> f32 {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// A step of several prefill chunks (one after a cached prefix over scattered blocks,
    /// two from position 0) and a decode runs as one pass with one KV write per layer
    /// ([`Model::forward_mixed`]): its logits, and those of a decode step after it (so
    /// the keys and values it wrote), equal running each chunk on its own, for a family
    /// with q/k norms (qwen3), a dense one (llama3) and a mixture of experts.
    #[test]
    fn prefill_chunks_in_one_pass_equal_each_chunk_alone() {
        for name in ["llama3", "qwen3", "qwen2_moe"] {
            let model = fixture(name);
            let vocab = model.cfg.vocab_size as u32;
            let toks = |n: usize, k: u32| -> Vec<u32> {
                (0..n as u32)
                    .map(|t| (t * 37 + k * 11 + 5) % vocab)
                    .collect()
            };
            let (prefix, a, b, c, d) =
                (toks(9, 1), toks(6, 2), toks(11, 3), toks(3, 4), toks(1, 5));
            // blocks of 4 tokens, slot tables scattered: the fused pass gathers them
            let kv = KvConfig::for_slots(4, 64, 4);
            let run = |fused: bool| -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
                let mut cache = model.new_paged_cache(4, 64, kv);
                for s in 0..4 {
                    let table: Vec<u32> = (0..16).map(|j| (j * 4 + 3 - s) as u32).collect();
                    cache.restart(s as usize, 0, Some(&table));
                }
                // slot 0 has a cached prefix; slot 3 decodes after a short prompt
                let first = [
                    SeqInput {
                        slot: 0,
                        tokens: &prefix,
                    },
                    SeqInput {
                        slot: 3,
                        tokens: &c,
                    },
                ];
                for s in &first {
                    model
                        .forward(&mut cache, StepInput::Host(&[*s]), Logits::Last)
                        .unwrap();
                }
                let step = [
                    SeqInput {
                        slot: 0,
                        tokens: &a,
                    },
                    SeqInput {
                        slot: 3,
                        tokens: &d,
                    },
                    SeqInput {
                        slot: 1,
                        tokens: &b,
                    },
                    SeqInput {
                        slot: 2,
                        tokens: &c,
                    },
                ];
                let logits: Vec<Array> = if fused {
                    model
                        .forward(&mut cache, StepInput::Host(&step), Logits::Last)
                        .unwrap()
                } else {
                    step.iter()
                        .flat_map(|s| {
                            model
                                .forward(&mut cache, StepInput::Host(&[*s]), Logits::Last)
                                .unwrap()
                        })
                        .collect()
                };
                let next: Vec<u32> = (0..4).map(|k| (k * 13 + 7) % vocab).collect();
                let after: Vec<Array> = [0usize, 3, 1, 2]
                    .iter()
                    .zip(&next)
                    .map(|(&slot, t)| {
                        let s = [SeqInput {
                            slot,
                            tokens: std::slice::from_ref(t),
                        }];
                        model
                            .forward(&mut cache, StepInput::Host(&s), Logits::Last)
                            .unwrap()
                            .remove(0)
                    })
                    .collect();
                let host = |v: Vec<Array>| v.iter().map(|x| x.to_vec::<f32>().unwrap()).collect();
                (host(logits), host(after))
            };
            let (fused, fused_after) = run(true);
            let (alone, alone_after) = run(false);
            for (k, (x, y)) in fused
                .iter()
                .zip(&alone)
                .chain(fused_after.iter().zip(&alone_after))
                .enumerate()
            {
                let (x, y) = (
                    Array::from_slice(x, &[x.len() as i32]).unwrap(),
                    Array::from_slice(y, &[y.len() as i32]).unwrap(),
                );
                let diff = max_diff(&x, &y);
                assert!(diff < 1e-4, "{name}: row {k} differs by {diff}");
            }
        }
    }
}
