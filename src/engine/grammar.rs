//! Constrained decoding: a grammar per sequence (a JSON schema, any JSON object, a regular
//! expression or a Lark grammar), turned into the set of tokens allowed at each step by
//! llguidance, the engine vLLM, SGLang and llama.cpp use.
//!
//! [`GrammarVocab`] is built once per tokenizer (every token's bytes, as llguidance needs
//! them); [`GrammarMatcher`] follows one sequence: [`GrammarMatcher::allowed`] gives the
//! mask for the next token, [`GrammarMatcher::accept`] advances it by the sampled token.
//! [`fill_masks`] and [`accept_all`] do so for a batch on the mask threads ([`pool`]),
//! the masks straight into the words a step's sampling reads; [`apply_mask_words`] (and
//! [`apply_masks`]) apply them to the batch's logits before sampling.
use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use rayon::prelude::*;
use serde_json::Value;

use crate::mlx::{self, Array};

/// Errors from building a vocabulary or a grammar.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("tokenizer for constrained decoding: {0}")]
    Vocab(String),
    /// The grammar itself is invalid (a bad JSON schema, regex or Lark text): the message
    /// names what was wrong.
    #[error("invalid {kind}: {msg}")]
    Invalid { kind: &'static str, msg: String },
    #[error("constrained decoding: {0}")]
    Matcher(String),
    #[error(transparent)]
    Mlx(#[from] mlx::MlxError),
}

/// What a sequence's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// `response_format: {"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `response_format: {"type": "json_schema", …}`: JSON valid against the schema.
    JsonSchema(Value),
    /// A regular expression over the whole output.
    Regex(String),
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
}

impl Constraint {
    fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject | Constraint::JsonSchema(_) => "JSON schema",
            Constraint::Regex(_) => "regular expression",
            Constraint::Lark(_) => "Lark grammar",
        }
    }

    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
        }
    }
}

/// JSON laid out as `json.dumps` does (`", "` and `": "`, no other whitespace), unless
/// the schema sets llguidance's own `x-guidance` options: flexible whitespace would let a
/// model pad its output with blanks without bound.
fn compact(schema: Value) -> Value {
    let mut schema = match schema {
        Value::Bool(true) => serde_json::json!({}),
        s => s,
    };
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": "
            })
        });
    }
    schema
}

/// A tokenizer's vocabulary as llguidance sees it, shared by every matcher.
#[derive(Clone)]
pub struct GrammarVocab {
    factory: Arc<ParserFactory>,
    /// The model's vocabulary size (the logits' last axis); may exceed the tokenizer's.
    vocab_size: usize,
}

impl GrammarVocab {
    /// From the tokenizer's `tokenizer.json` content (byte-level BPE, or SentencePiece-style
    /// with byte fallback), the model's vocabulary size and its end-of-sequence ids.
    pub fn new(
        tokenizer_json: &Value,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<GrammarVocab, GrammarError> {
        let mut words = llguidance::token_bytes_from_tokenizer_json(tokenizer_json)
            .map_err(|e| GrammarError::Vocab(e.to_string()))?;
        if words.len() > vocab_size {
            return Err(GrammarError::Vocab(format!(
                "the tokenizer has {} tokens, more than the model's vocab_size {vocab_size}",
                words.len()
            )));
        }
        // ids past the tokenizer's (padding rows of the embedding) never match anything
        words.resize(vocab_size, vec![]);
        let first_eos = *eos
            .first()
            .ok_or_else(|| GrammarError::Vocab("the model has no end-of-sequence token".into()))?;
        let trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, first_eos), &words)
            .with_eos_tokens(eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocab(e.to_string()))?;
        factory.quiet();
        Ok(GrammarVocab {
            factory: Arc::new(factory),
            vocab_size,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Check a constraint without keeping a matcher (for request validation).
    pub fn check(&self, c: &Constraint) -> Result<(), GrammarError> {
        GrammarMatcher::new(self, c).map(drop)
    }
}

/// One sequence's position in its grammar.
pub struct GrammarMatcher {
    m: Matcher,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher")
            .field("vocab_size", &self.vocab_size)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl GrammarMatcher {
    pub fn new(vocab: &GrammarVocab, c: &Constraint) -> Result<GrammarMatcher, GrammarError> {
        let parser =
            vocab
                .factory
                .create_parser(c.grammar())
                .map_err(|e| GrammarError::Invalid {
                    kind: c.kind(),
                    msg: e.to_string(),
                })?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(GrammarError::Invalid {
                kind: c.kind(),
                msg: e,
            });
        }
        Ok(GrammarMatcher {
            m,
            vocab_size: vocab.vocab_size,
        })
    }

    /// The tokens allowed next, as a bit set: bit `t % 32` of word `t / 32` (end-of-sequence
    /// ids are allowed once the output is complete).
    pub fn allowed(&mut self) -> Result<Vec<u32>, GrammarError> {
        let mut words = vec![0; self.vocab_size.div_ceil(32)];
        self.allowed_into(&mut words)?;
        Ok(words)
    }

    /// [`GrammarMatcher::allowed`] written into `dst` (`⌈vocab/32⌉` words; words past the
    /// tokenizer's tokens are cleared).
    pub fn allowed_into(&mut self, dst: &mut [u32]) -> Result<(), GrammarError> {
        let v = self
            .m
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Matcher(e.to_string()))?;
        let src = v.as_slice();
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        dst[n..].fill(0);
        Ok(())
    }

    /// The model's vocabulary size (the logits' last axis), which its masks cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Advance by the sampled token.
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        self.m
            .consume_token(token)
            .map_err(|e| GrammarError::Matcher(e.to_string()))
    }

    /// The grammar is complete and nothing more may follow (only end-of-sequence).
    pub fn is_finished(&self) -> bool {
        self.m.is_stopped()
    }
}

/// The threads that compute masks and advance grammars, made on first use and kept: up to
/// 8, one per core, or `MLXCEL_MASK_THREADS` (a mask over a 50k-token vocabulary takes tens to hundreds of µs, and a
/// batch of 32 constrained sequences needs 32 per step; a thread spawned per step cost
/// more than some masks).
pub fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = crate::kernels::knobs::get()
            .mask_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(8)));
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("mlxcel-mask-{i}"))
            .build()
            .expect("a thread pool for token masks")
    })
}

/// [`GrammarMatcher::allowed`] of every matcher, in order, computed on the [`pool`].
pub fn allowed_all(matchers: &mut [&mut GrammarMatcher]) -> Vec<Result<Vec<u32>, GrammarError>> {
    if matchers.len() < 2 {
        return matchers.iter_mut().map(|m| m.allowed()).collect();
    }
    pool().install(|| matchers.par_iter_mut().map(|m| m.allowed()).collect())
}

/// The masks of `rows` (`(row, matcher)`, rows distinct) written on the [`pool`] straight
/// into `words`, the `[B, words_per_row]` block a step's sampling reads (row-major); rows
/// not named are left as they are. One result per entry of `rows`, in order.
pub fn fill_masks(
    rows: &mut [(usize, &mut GrammarMatcher)],
    words: &mut [u32],
    words_per_row: usize,
) -> Vec<Result<(), GrammarError>> {
    let mut dst: Vec<Option<&mut [u32]>> = words.chunks_mut(words_per_row).map(Some).collect();
    let mut jobs: Vec<(&mut GrammarMatcher, Option<&mut [u32]>)> = rows
        .iter_mut()
        .map(|(row, m)| (&mut **m, dst.get_mut(*row).and_then(Option::take)))
        .collect();
    pool().install(|| {
        jobs.par_iter_mut()
            .map(|(m, dst)| match dst {
                Some(dst) => m.allowed_into(dst),
                None => Err(GrammarError::Matcher(
                    "a mask row outside the step, or named twice".into(),
                )),
            })
            .collect()
    })
}

/// Advance every matcher by its token (see [`GrammarMatcher::accept`]), on the [`pool`]
/// when there are several (one takes a few µs, about what handing it to the pool costs):
/// one result per entry, in order.
pub fn accept_all(items: &mut [(&mut GrammarMatcher, u32)]) -> Vec<Result<(), GrammarError>> {
    if items.len() < 4 {
        return items.iter_mut().map(|(m, t)| m.accept(*t)).collect();
    }
    pool().install(|| items.par_iter_mut().map(|(m, t)| m.accept(*t)).collect())
}

/// Logits `[B, V]` with every token a row's mask does not allow set to −∞; rows whose mask
/// is `None` are unchanged. The bit sets go to the device as they are (`[B, V/32]` words,
/// a few KiB a row) and are expanded there, so the host's work does not grow with the
/// vocabulary times the batch.
pub fn apply_masks(logits: &Array, masks: &[Option<&[u32]>]) -> Result<Array, GrammarError> {
    let shape = logits.shape();
    let (b, v) = (shape[0] as usize, shape[1] as usize);
    if masks.len() != b || masks.iter().all(Option::is_none) {
        if masks.len() != b {
            return Err(GrammarError::Matcher(format!(
                "{} masks for {b} rows",
                masks.len()
            )));
        }
        return Ok(logits.clone());
    }
    let w = v.div_ceil(32);
    let words = Array::from_slice(&mask_words(masks, v), &[b as i32, w as i32, 1])?;
    apply_mask_words(logits, &words)
}

/// The bit sets of `masks` as one `[B, ⌈V/32⌉]` block of words (row-major), as
/// [`apply_mask_words`] reads them: rows without a mask allow everything, words past a
/// mask's end allow nothing.
pub fn mask_words(masks: &[Option<&[u32]>], vocab: usize) -> Vec<u32> {
    let w = vocab.div_ceil(32);
    let mut words = vec![u32::MAX; masks.len() * w];
    for (row, m) in masks.iter().enumerate() {
        let Some(m) = m else { continue };
        let dst = &mut words[row * w..(row + 1) * w];
        let n = m.len().min(w);
        dst[..n].copy_from_slice(&m[..n]);
        dst[n..].fill(0);
    }
    words
}

/// Logits `[B, V]` with every token whose bit is clear in `words` (uint32 `[B, ⌈V/32⌉,
/// 1]`, bit t % 32 of word t / 32) set to −∞, the words expanded on the device.
pub fn apply_mask_words(logits: &Array, words: &Array) -> Result<Array, GrammarError> {
    let shape = logits.shape();
    let (b, v) = (shape[0], shape[1] as usize);
    let w = v.div_ceil(32);
    // each word against the 32 one-bit masks, made on the host (no op): the graph is that
    // AND, a reshape, a slice where the vocabulary is not a multiple of 32, the cast to
    // bool and the select (and MLX's broadcasts of the bits, the words and −∞)
    let bits: Vec<u32> = (0..32).map(|i| 1 << i).collect();
    let bits = Array::from_slice(&bits, &[1, 1, 32])?;
    let mut keep = words.bitwise_and(&bits)?.reshape(&[b, (w * 32) as i32])?;
    if w * 32 != v {
        keep = keep.slice_axis(1, 0, v as i32)?;
    }
    let keep = keep.astype(mlx::Dtype::Bool)?;
    let neg = Array::scalar(f32::NEG_INFINITY, logits.dtype())?;
    Ok(mlx::where_(&keep, logits, &neg)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn fixture_vocab() -> (GrammarVocab, tokenizers::Tokenizer, u32) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama3");
        let text = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
        let json: Value = serde_json::from_str(&text).unwrap();
        let tok: tokenizers::Tokenizer = text.parse().unwrap();
        let eos = tok.token_to_id("<|eot_id|>").unwrap();
        (GrammarVocab::new(&json, 400, &[eos]).unwrap(), tok, eos)
    }

    /// Random walks through the grammar (uniform over the allowed tokens) always end in
    /// output the grammar accepts.
    fn walk(c: &Constraint, seed: u64) -> String {
        let (vocab, tok, eos) = fixture_vocab();
        let mut m = GrammarMatcher::new(&vocab, c).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut ids = Vec::new();
        for _ in 0..400 {
            let mask = m.allowed().unwrap();
            let ok: Vec<u32> = (0..400u32)
                .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1)
                .collect();
            assert!(!ok.is_empty());
            assert!(ok.iter().all(|&t| t < 384), "padding ids are never allowed");
            // prefer ending once allowed, so that walks terminate
            let t = if ok.contains(&eos) && rng.random_bool(0.3) {
                eos
            } else {
                ok[rng.random_range(0..ok.len())]
            };
            if t == eos {
                return tok.decode(&ids, false).unwrap();
            }
            m.accept(t).unwrap();
            ids.push(t);
        }
        panic!("no end after 400 tokens: {:?}", tok.decode(&ids, false));
    }

    #[test]
    fn json_schema_walks_give_valid_json() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "ok": {"type": "boolean"}
            },
            "required": ["name", "age"],
            "additionalProperties": false
        });
        let c = Constraint::JsonSchema(schema);
        for seed in 0..10 {
            let text = walk(&c, seed);
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            let o = v.as_object().unwrap();
            assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{text}");
            let age = o["age"].as_i64().unwrap();
            assert!((0..=120).contains(&age), "{text}");
            assert!(
                o.keys()
                    .all(|k| ["name", "age", "ok"].contains(&k.as_str())),
                "{text}"
            );
        }
    }

    #[test]
    fn regex_walks_match() {
        for seed in 0..5 {
            let text = walk(&Constraint::Regex("(yes|no), [0-9]{2}".into()), seed);
            let (word, num) = text.split_once(", ").unwrap();
            assert!(["yes", "no"].contains(&word) && num.len() == 2, "{text}");
            assert!(num.chars().all(|c| c.is_ascii_digit()), "{text}");
        }
    }

    /// The masks of many matchers at different points, computed on several threads, are
    /// those each computes alone, in order.
    #[test]
    fn allowed_all_equals_one_at_a_time() {
        let (vocab, tok, _) = fixture_vocab();
        let ids = tok
            .encode(r#"{"fox": [1, 2], "dog": null}"#, false)
            .unwrap();
        let ids = ids.get_ids();
        let mut ms: Vec<GrammarMatcher> = (0..11)
            .map(|k| {
                let mut m = GrammarMatcher::new(&vocab, &Constraint::JsonObject).unwrap();
                for &t in &ids[..k % ids.len()] {
                    m.accept(t).unwrap();
                }
                m
            })
            .collect();
        let alone: Vec<Vec<u32>> = ms.iter_mut().map(|m| m.allowed().unwrap()).collect();
        let mut refs: Vec<&mut GrammarMatcher> = ms.iter_mut().collect();
        let all: Vec<Vec<u32>> = allowed_all(&mut refs)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(all, alone);
        assert_ne!(alone[0], alone[1]);
    }

    /// json_object (unbounded, so no random walk): a JSON object's tokens are each allowed
    /// in turn and then the end; text that does not start an object is not.
    #[test]
    fn json_object_follows_an_object() {
        let (vocab, tok, eos) = fixture_vocab();
        let allowed = |m: &mut GrammarMatcher, t: u32| {
            m.allowed().unwrap()[t as usize / 32] >> (t % 32) & 1 == 1
        };
        let ids = tok
            .encode(r#"{"fox": [1, 2], "dog": null}"#, false)
            .unwrap();
        let mut m = GrammarMatcher::new(&vocab, &Constraint::JsonObject).unwrap();
        for &t in ids.get_ids() {
            assert!(allowed(&mut m, t), "token {t} refused");
            m.accept(t).unwrap();
        }
        assert!(allowed(&mut m, eos));
        let mut m = GrammarMatcher::new(&vocab, &Constraint::JsonObject).unwrap();
        let hello = tok.encode("Hello", false).unwrap();
        assert!(!allowed(&mut m, hello.get_ids()[0]));
        assert!(!allowed(&mut m, eos), "an empty output is not an object");
    }

    #[test]
    fn bad_grammars_are_errors_naming_the_kind() {
        let (vocab, _, _) = fixture_vocab();
        let e = vocab
            .check(&Constraint::JsonSchema(
                serde_json::json!({"type": "no-such-type"}),
            ))
            .unwrap_err()
            .to_string();
        assert!(e.contains("JSON schema"), "{e}");
        let e = vocab
            .check(&Constraint::Regex("(unclosed".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("regular expression"), "{e}");
    }

    #[test]
    fn masks_apply_per_row() {
        let logits = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        let only_first = [0b001u32];
        let out = apply_masks(&logits, &[Some(&only_first), None]).unwrap();
        let v = out.to_vec::<f32>().unwrap();
        assert_eq!(v[0], 1.0);
        assert!(v[1].is_infinite() && v[2].is_infinite());
        assert_eq!(&v[3..], &[4.0, 5.0, 6.0]);
        assert!(apply_masks(&logits, &[None]).is_err());
        // random bit sets over several words (the vocabulary not a multiple of 32, one
        // mask a word short): each token is kept exactly where its bit is set
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (b, v) = (3usize, 100usize);
        let vals: Vec<f32> = (0..b * v).map(|i| i as f32).collect();
        let logits = Array::from_slice(&vals, &[b as i32, v as i32]).unwrap();
        let m0: Vec<u32> = (0..4).map(|_| rng.random()).collect();
        let m2: Vec<u32> = (0..3).map(|_| rng.random()).collect();
        let out = apply_masks(&logits, &[Some(&m0), None, Some(&m2)])
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for row in 0..b {
            for t in 0..v {
                let keep = match row {
                    0 => m0[t / 32] >> (t % 32) & 1 == 1,
                    1 => true,
                    _ => m2.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1),
                };
                let x = out[row * v + t];
                assert_eq!(keep, x.is_finite(), "row {row} token {t}");
                if keep {
                    assert_eq!(x, (row * v + t) as f32);
                }
            }
        }
    }
}
