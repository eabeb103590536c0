//! The shard plan: which heads and intermediate columns a tensor-parallel rank holds,
//! validated before any process is spawned. Each family's layout
//! ([`super::layout`]) turns the plan into every parameter's split; for the
//! Llama-like decoder:
//!
//! | tensor | split |
//! |---|---|
//! | q/k/v, gate/up | column (output rows), whole heads per rank |
//! | o_proj, down_proj | row (input columns), then `all_sum`, then bias once |
//! | embed_tokens, lm_head | vocab-parallel (rows of the vocabulary, [`VocabShard`]) |
//! | norms | replicated |
//! | KV heads when N > n_kv | replicated: rank r holds kv head ⌊r·n_kv/N⌋ |
//!
//! Quantized weights split weight/scales/biases together; a row split needs
//! `(in / N) % group_size == 0`. A vocabulary split takes whole rows, so it fits any
//! quantization; with `MLXCEL_VOCAB_PARALLEL=0` (or a vocabulary too small to give
//! every rank a row) the embedding and lm_head are replicated.
//!
//! MoE blocks (`super::blocks::moe`): by default every expert's gate/up split by
//! columns and down by rows over its `moe_intermediate_size`, like the dense MLP; with
//! `--enable-expert-parallel` each rank holds `num_experts / N` whole experts. The
//! router is replicated; the shared expert (Qwen2-MoE) splits like a dense MLP.
use std::ops::Range;

use super::config::ModelConfig;
use super::layout::Split;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShardError {
    #[error(
        "--tp-size {tp}: num_attention_heads {heads} is not divisible by it (valid sizes: {valid})"
    )]
    Heads {
        tp: usize,
        heads: usize,
        valid: String,
    },
    #[error(
        "--tp-size {tp}: num_key_value_heads {kv} neither divides by it nor divides it (valid sizes: {valid})"
    )]
    KvHeads { tp: usize, kv: usize, valid: String },
    #[error(
        "--tp-size {tp}: intermediate_size {inter} is not divisible by it (valid sizes: {valid})"
    )]
    Intermediate {
        tp: usize,
        inter: usize,
        valid: String,
    },
    #[error(
        "--tp-size {tp}: the row-parallel {what} would get {per_rank} input columns per rank, not a multiple of the quantization group_size {group} (valid sizes: {valid}){hint}"
    )]
    QuantGroup {
        tp: usize,
        what: String,
        per_rank: usize,
        group: usize,
        valid: String,
        /// For a MoE expert projection: the expert-parallel alternative and its sizes.
        hint: String,
    },
    #[error("--tp-size {tp}: {field} {size} is not divisible by it (valid sizes: {valid}){hint}")]
    Experts {
        tp: usize,
        field: &'static str,
        size: usize,
        valid: String,
        hint: String,
    },
    #[error("--tp-size must be at least 1")]
    Zero,
}

/// What rank `rank` of `size` holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    pub rank: usize,
    pub size: usize,
    /// Query heads of this rank.
    pub q_heads: Range<usize>,
    /// KV heads of this rank (one replicated head when size > n_kv).
    pub kv_heads: Range<usize>,
    /// Columns of gate/up (rows of down's input) of this rank.
    pub intermediate: Range<usize>,
    /// Vocabulary rows of this rank's embedding and lm_head (`None`: both replicated).
    pub vocab: Option<VocabShard>,
    /// MoE layers: whole experts per rank (`--enable-expert-parallel`) instead of a slice
    /// of every expert's intermediate dimension.
    pub expert_parallel: bool,
}

/// A vocab-parallel rank's rows of the vocabulary. Rank r holds rows
/// `r · per_rank .. min((r + 1) · per_rank, vocab)`: every rank but the last ones holds
/// `per_rank`, so the logits every rank computes, padded to `per_rank` columns and
/// gathered in rank order, are the whole vocabulary followed by the padding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VocabShard {
    /// This rank's rows.
    pub rows: Range<usize>,
    /// ⌈vocab / size⌉: the columns of every rank's logits.
    pub per_rank: usize,
    /// The whole vocabulary.
    pub vocab: usize,
}

impl VocabShard {
    /// Rank `rank` of `size` of a vocabulary of `vocab` rows; `None` when one rank holds
    /// everything, or when the last rank would hold no row (a vocabulary smaller than
    /// about `size²`), where the rows are replicated instead.
    pub fn of(vocab: usize, size: usize, rank: usize) -> Option<VocabShard> {
        if size <= 1 || rank >= size {
            return None;
        }
        let per_rank = vocab.div_ceil(size);
        if (size - 1) * per_rank >= vocab {
            return None;
        }
        let start = rank * per_rank;
        Some(VocabShard {
            rows: start..(start + per_rank).min(vocab),
            per_rank,
            vocab,
        })
    }
}

impl ShardPlan {
    /// The plan of a single device: everything.
    pub fn full(cfg: &ModelConfig) -> ShardPlan {
        ShardPlan {
            rank: 0,
            size: 1,
            q_heads: 0..cfg.num_heads,
            kv_heads: 0..cfg.num_kv_heads,
            intermediate: 0..cfg.intermediate_size,
            vocab: None,
            expert_parallel: false,
        }
    }

    pub fn is_sharded(&self) -> bool {
        self.size > 1
    }

    /// How the embedding and lm_head split under this plan.
    pub fn vocab_split(&self) -> Split {
        match &self.vocab {
            Some(v) => Split::Vocab(v.rows.clone()),
            None => Split::Replicated,
        }
    }
}

fn list(sizes: &[usize]) -> String {
    sizes
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn check(cfg: &ModelConfig, tp: usize, ep: bool) -> Result<(), ShardError> {
    let valid = || list(&valid_sizes_with(cfg, 64, ep));
    // a MoE model refused one way may split the other way
    let hint = || {
        match (&cfg.moe, ep) {
        (None, _) => String::new(),
        (Some(_), false) => format!(
            "; or hold whole experts per rank with --enable-expert-parallel (valid sizes with it: {})",
            list(&valid_sizes_with(cfg, 64, true))
        ),
        (Some(_), true) => format!(
            "; or without --enable-expert-parallel (valid sizes: {})",
            list(&valid_sizes_with(cfg, 64, false))
        ),
    }
    };
    match fits(cfg, tp, ep) {
        Ok(()) => Ok(()),
        Err(Misfit::Zero) => Err(ShardError::Zero),
        Err(Misfit::Heads) => Err(ShardError::Heads {
            tp,
            heads: cfg.num_heads,
            valid: valid(),
        }),
        Err(Misfit::KvHeads) => Err(ShardError::KvHeads {
            tp,
            kv: cfg.num_kv_heads,
            valid: valid(),
        }),
        Err(Misfit::Intermediate) => Err(ShardError::Intermediate {
            tp,
            inter: cfg.intermediate_size,
            valid: valid(),
        }),
        Err(Misfit::QuantGroup {
            what,
            per_rank,
            group,
            expert,
        }) => Err(ShardError::QuantGroup {
            tp,
            what,
            per_rank,
            group,
            valid: valid(),
            hint: if expert { hint() } else { String::new() },
        }),
        Err(Misfit::Experts { field, size }) => Err(ShardError::Experts {
            tp,
            field,
            size,
            valid: valid(),
            hint: hint(),
        }),
    }
}

/// Why a model does not split `tp` ways.
enum Misfit {
    Zero,
    Heads,
    KvHeads,
    Intermediate,
    QuantGroup {
        what: String,
        per_rank: usize,
        group: usize,
        /// A stacked MoE expert projection.
        expert: bool,
    },
    Experts {
        field: &'static str,
        size: usize,
    },
}

/// Whether the model splits `tp` ways: whole q heads per rank, kv heads that divide
/// or are divided by `tp`, whole intermediate columns, and every quantized row-parallel
/// parameter of the family's layout ([`super::layout`]) with whole quantization groups
/// per rank; for a MoE model, whole experts per rank (`ep`: expert parallel) or whole
/// columns of every expert's (and the shared expert's) intermediate dimension.
fn fits(cfg: &ModelConfig, tp: usize, ep: bool) -> Result<(), Misfit> {
    if tp == 0 {
        return Err(Misfit::Zero);
    }
    if !cfg.num_heads.is_multiple_of(tp) {
        return Err(Misfit::Heads);
    }
    let kv = cfg.num_kv_heads;
    if !kv.is_multiple_of(tp) && !tp.is_multiple_of(kv) {
        return Err(Misfit::KvHeads);
    }
    if !cfg.intermediate_size.is_multiple_of(tp) {
        return Err(Misfit::Intermediate);
    }
    if let Some(moe) = &cfg.moe {
        let misfit = |field, size: usize| match size.is_multiple_of(tp) {
            true => Ok(()),
            false => Err(Misfit::Experts { field, size }),
        };
        match ep {
            true => misfit("num_experts", moe.num_experts)?,
            false => misfit("moe_intermediate_size", moe.expert_intermediate)?,
        }
        if let Some(s) = moe.shared_expert_intermediate {
            misfit("shared_expert_intermediate_size", s)?;
        }
    }
    let layout = super::layout(
        cfg,
        &slices(
            cfg,
            tp,
            0,
            SplitOptions {
                vocab_parallel: false,
                expert_parallel: ep,
            },
        ),
    );
    for p in layout.params() {
        if let (Split::Row(cols), Some(q)) = (&p.split, p.quant) {
            let g = q.group_size as usize;
            if !cols.len().is_multiple_of(g) {
                return Err(Misfit::QuantGroup {
                    what: p.short_name().to_string(),
                    per_rank: cols.len(),
                    group: g,
                    expert: p.experts.is_some(),
                });
            }
        }
    }
    Ok(())
}

/// Tensor-parallel sizes up to `max` that this model can be split into.
pub fn valid_sizes(cfg: &ModelConfig, max: usize) -> Vec<usize> {
    valid_sizes_with(cfg, max, false)
}

/// [`valid_sizes`] with MoE experts whole per rank when `expert_parallel`.
pub fn valid_sizes_with(cfg: &ModelConfig, max: usize, expert_parallel: bool) -> Vec<usize> {
    (1..=max)
        .filter(|&n| fits(cfg, n, expert_parallel).is_ok())
        .collect()
}

/// Check that the model splits `tp` ways (before spawning anything).
pub fn validate(cfg: &ModelConfig, tp: usize) -> Result<(), ShardError> {
    check(cfg, tp, false)
}

/// [`validate`] with MoE experts whole per rank when `expert_parallel`
/// (`--enable-expert-parallel`).
pub fn validate_with(
    cfg: &ModelConfig,
    tp: usize,
    expert_parallel: bool,
) -> Result<(), ShardError> {
    check(cfg, tp, expert_parallel)
}

/// The slice rank `rank` of `tp` holds, with the vocabulary split as
/// `MLXCEL_VOCAB_PARALLEL` says ([`crate::kernels::knobs`]).
pub fn plan(cfg: &ModelConfig, tp: usize, rank: usize) -> Result<ShardPlan, ShardError> {
    plan_with(
        cfg,
        tp,
        rank,
        SplitOptions {
            vocab_parallel: crate::kernels::knobs::get().vocab_parallel,
            expert_parallel: false,
        },
    )
}

/// The choices of how to split what may split more than one way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SplitOptions {
    /// Each rank holds its rows of the vocabulary (embedding, lm_head) instead of both
    /// whole (`MLXCEL_VOCAB_PARALLEL`).
    pub vocab_parallel: bool,
    /// MoE layers hold whole experts per rank (`--enable-expert-parallel`).
    pub expert_parallel: bool,
}

/// [`plan`] with the given split options.
pub fn plan_with(
    cfg: &ModelConfig,
    tp: usize,
    rank: usize,
    opts: SplitOptions,
) -> Result<ShardPlan, ShardError> {
    check(cfg, tp, opts.expert_parallel)?;
    Ok(slices(cfg, tp, rank, opts))
}

/// [`plan_with`] without the checks (`tp` ≥ 1 dividing the heads as [`fits`] asks).
fn slices(cfg: &ModelConfig, tp: usize, rank: usize, opts: SplitOptions) -> ShardPlan {
    let per = |n: usize| n / tp;
    let qh = per(cfg.num_heads);
    let kv_heads = if cfg.num_kv_heads.is_multiple_of(tp) {
        let k = per(cfg.num_kv_heads);
        rank * k..(rank + 1) * k
    } else {
        let h = rank * cfg.num_kv_heads / tp;
        h..h + 1
    };
    let inter = per(cfg.intermediate_size);
    ShardPlan {
        rank,
        size: tp,
        q_heads: rank * qh..(rank + 1) * qh,
        kv_heads,
        intermediate: rank * inter..(rank + 1) * inter,
        vocab: VocabShard::of(cfg.vocab_size, tp, rank).filter(|_| opts.vocab_parallel),
        expert_parallel: opts.expert_parallel && cfg.moe.is_some(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::config::{QuantConfig, RopeConfig};

    fn cfg(heads: usize, kv: usize, inter: usize, quant: Option<i32>) -> ModelConfig {
        ModelConfig {
            model_type: "llama".into(),
            hidden_size: 256,
            num_layers: 2,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: 32,
            intermediate_size: inter,
            vocab_size: 100,
            rms_norm_eps: 1e-5,
            rope: RopeConfig::plain(1e4),
            tie_word_embeddings: false,
            qkv_bias: false,
            qk_norm: false,
            max_position_embeddings: 128,
            quantization: quant.map(|g| QuantConfig {
                group_size: g,
                bits: 4,
            }),
            dtype: crate::mlx::Dtype::F32,
            eos_token_ids: vec![],
            bos_token_id: None,
            moe: None,
        }
    }

    #[test]
    fn kv_heads_shard_or_replicate() {
        let c = cfg(8, 2, 256, None);
        let p = plan(&c, 2, 1).unwrap();
        assert_eq!(
            (p.q_heads, p.kv_heads, p.intermediate),
            (4..8, 1..2, 128..256)
        );
        // N > n_kv: rank r holds kv head floor(r * n_kv / N)
        let heads: Vec<_> = (0..4).map(|r| plan(&c, 4, r).unwrap().kv_heads).collect();
        assert_eq!(heads, vec![0..1, 0..1, 1..2, 1..2]);
        for r in 0..8 {
            assert_eq!(plan(&c, 8, r).unwrap().kv_heads.start, r * 2 / 8);
        }
    }

    #[test]
    fn invalid_sizes_name_the_flag_and_valid_sizes() {
        let c = cfg(8, 2, 256, None);
        let e = validate(&c, 3).unwrap_err();
        assert!(matches!(
            e,
            ShardError::Heads {
                tp: 3,
                heads: 8,
                ..
            }
        ));
        assert!(
            e.to_string().contains("--tp-size 3") && e.to_string().contains("1, 2, 4, 8"),
            "{e}"
        );
        let c = cfg(12, 4, 384, None);
        assert!(matches!(
            validate(&c, 6),
            Err(ShardError::KvHeads { tp: 6, kv: 4, .. })
        ));
        assert!(matches!(validate(&c, 0), Err(ShardError::Zero)));
    }

    #[test]
    fn vocabulary_rows_cover_the_vocabulary_once() {
        for (vocab, n) in [
            (100, 2),
            (100, 4),
            (101, 4),
            (128256, 8),
            (49152, 3),
            (37, 5),
        ] {
            let shards: Vec<VocabShard> = (0..n)
                .map(|r| VocabShard::of(vocab, n, r).unwrap())
                .collect();
            let mut next = 0;
            for s in &shards {
                assert_eq!(
                    (s.rows.start, s.per_rank, s.vocab),
                    (next, vocab.div_ceil(n), vocab)
                );
                assert!(!s.rows.is_empty() && s.rows.len() <= s.per_rank);
                next = s.rows.end;
            }
            assert_eq!(next, vocab, "{vocab} over {n}");
        }
        // 9 rows over 4 ranks of 3 would leave the last one none: replicated
        assert_eq!(VocabShard::of(9, 4, 0), None);
        assert_eq!(VocabShard::of(100, 1, 0), None);
        let c = cfg(8, 2, 256, Some(64));
        let p = plan_with(
            &c,
            4,
            3,
            SplitOptions {
                vocab_parallel: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(p.vocab_split(), Split::Vocab(75..100));
        assert_eq!(
            plan_with(&c, 4, 3, SplitOptions::default())
                .unwrap()
                .vocab_split(),
            Split::Replicated
        );
        assert_eq!(ShardPlan::full(&c).vocab, None);
        // the layout splits the embedding and lm_head alike, whole rows of a quantized one
        let l = crate::models::layout(&c, &p);
        assert_eq!(l.embed_tokens.split, Split::Vocab(75..100));
        assert_eq!(l.lm_head.unwrap().split, Split::Vocab(75..100));
    }

    #[test]
    fn quantized_row_split_must_align_with_groups() {
        // o_proj input 8*32 = 256 columns: 4 ranks → 64 (ok for group 64), 8 → 32 (not ok)
        let c = cfg(8, 8, 512, Some(64));
        assert!(validate(&c, 4).is_ok());
        let e = validate(&c, 8).unwrap_err();
        assert!(
            matches!(
                &e,
                ShardError::QuantGroup {
                    what,
                    per_rank: 32,
                    group: 64,
                    ..
                } if what == "o_proj"
            ),
            "{e}"
        );
        assert_eq!(valid_sizes(&c, 8), vec![1, 2, 4]);
    }
}
