//! `mlxcel bench-masks`: the host's share of a constrained decode step, per step of
//! `--streams` sequences (32 by default) following a JSON schema (by default the one
//! `scripts/gpu/schema.sh` serves with, `scripts/bench_schema.json`) over the model's
//! tokenizer (the default model: SmolLM2's 49k tokens). No weights are loaded.
//!
//! Each stream writes documents that the schema accepts (made from the schema with
//! seeded random words and numbers, laid out as constrained decoding lays out JSON, then
//! tokenized); at every step each stream's grammar gives its mask for the next token
//! of its document and then takes that token, as the server's engine thread does between
//! a step's sampling and the next. Timed, over `--steps` steps:
//! - `mask_us_per_seq`, `accept_us_per_seq`: one mask and one grammar advance alone;
//! - `per_step_ms`: the masks of all streams as the engine computes them, turning them
//!   into the sampler's mask words, and advancing every grammar by its token;
//! - `graph`: building (host) and evaluating (this device) the sampling of a
//!   `[streams, vocab]` batch at temperature 0.7 (scripts/bench_server.py's), without
//!   and with the masks, and the MLX ops each builds.
//!
//! CPU numbers: llguidance's masks cost what this machine's cores take, whatever the GPU.
//!
//! `--engine` also loads the model and runs the scheduler as the server's engine thread
//! does: `--streams` requests of one chat prompt decoding `--max-tokens` tokens each at
//! temperature 0.7, without the schema (ignoring end-of-sequence, so both sides decode
//! as long) and with it, alternated `--runs` times; per run the decode rate and the
//! engine thread's ms per pipelined step by part (`mlxcel:decode_host_seconds_total`'s
//! parts: masks, queue, wait, deliver).
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::engine::grammar::{
    accept_all, apply_mask_words, fill_masks, pool, Constraint, GrammarMatcher, GrammarVocab,
};
use crate::engine::sampler::{sample_batch_lazy, SamplingParams, SequenceSampler};
use crate::engine::scheduler::{
    default_max_itl_ratio, Event, HostPart, Observer, Request, Scheduler, SchedulerConfig,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
};
use crate::engine::step::{Executor, LocalExecutor};
use crate::mlx::host_written::HostWritten;
use crate::mlx::{self, Array};
use crate::runtime::{load_weights, open_model, ModelArgs, OpenedModel};
use crate::tokenizer::chat::ChatMessage;
use crate::tokenizer::Tokenizer;

/// The benchmark's schema, as `scripts/gpu/schema.sh` sends it.
const DEFAULT_SCHEMA: &str = include_str!("../../scripts/bench_schema.json");

#[derive(Debug, Args)]
pub struct BenchMasksArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// JSON schema file (default: scripts/bench_schema.json, built in).
    #[arg(long, value_name = "FILE")]
    pub schema: Option<PathBuf>,
    /// Constrained sequences per step.
    #[arg(long, default_value_t = 32)]
    pub streams: usize,
    /// Steps to time.
    #[arg(long, default_value_t = 256)]
    pub steps: usize,
    /// Steps of the sampling graph to time (each builds and evaluates a [streams, vocab] batch).
    #[arg(long, default_value_t = 32)]
    pub graph_steps: usize,
    /// Seed of the documents.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also run the engine with the model's weights (see the module docs).
    #[arg(long)]
    pub engine: bool,
    /// Tokens each request decodes in --engine runs.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Unconstrained and constrained --engine runs, alternated.
    #[arg(long, default_value_t = 2)]
    pub runs: usize,
}

pub fn run(args: &BenchMasksArgs) -> Result<()> {
    if args.streams == 0 || args.steps == 0 {
        bail!("--streams and --steps must be at least 1");
    }
    let schema: Value = match &args.schema {
        Some(p) => serde_json::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("--schema {}", p.display()))?,
        )
        .with_context(|| format!("--schema {}: not JSON", p.display()))?,
        None => serde_json::from_str(DEFAULT_SCHEMA).expect("the built-in schema is JSON"),
    };
    if args.engine && (args.max_tokens < 2 || args.runs == 0) {
        bail!("--engine: --max-tokens must be at least 2 and --runs at least 1");
    }
    let mut margs = args.model.clone();
    margs.ctx_size = Some(margs.ctx_size.unwrap_or(0).max(args.max_tokens + 256));
    let opened = open_model(&margs)?;
    let vocab_size = opened.cfg.vocab_size;
    let tokenizer = opened.tokenizer.clone();
    let t = Instant::now();
    let tok_json: Value = serde_json::from_str(
        &tokenizer
            .inner()
            .to_string(false)
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    )?;
    let vocab = GrammarVocab::new(&tok_json, vocab_size, tokenizer.eos_token_ids())?;
    let vocab_secs = t.elapsed().as_secs_f64();
    let constraint = Constraint::JsonSchema(schema.clone());
    vocab.check(&constraint).context("--schema")?;
    let eos = *tokenizer
        .eos_token_ids()
        .first()
        .context("the tokenizer has no end-of-sequence token")?;
    let docs = Docs {
        schema: &schema,
        tokenizer: &tokenizer,
        seed: args.seed,
    };

    // each stream's next mask alone, then its grammar's advance alone
    let mut mask_us = Vec::new();
    let mut accept_us = Vec::new();
    let (mut forced, mut allowed_sum) = (0usize, 0usize);
    let mut streams = Streams::new(&docs, &vocab, &constraint, args.streams, eos)?;
    for _ in 0..args.steps {
        for k in 0..args.streams {
            let t = Instant::now();
            let mask = streams.matchers[k].allowed()?;
            mask_us.push(t.elapsed().as_secs_f64() * 1e6);
            streams.check(k, &mask)?;
            let n: usize = mask.iter().map(|w| w.count_ones() as usize).sum();
            allowed_sum += n;
            forced += usize::from(n == 1);
        }
        accept_us.extend(streams.advance_each(&docs, &vocab, &constraint)?);
    }
    let (docs_done, tokens_done) = (streams.docs, streams.tokens);

    // the same steps as the engine computes them: every mask of a step on the mask
    // threads, straight into the words the sampling reads; every grammar's advance
    let w = vocab_size.div_ceil(32);
    let mut all_ms = Vec::new();
    let mut accept_ms = Vec::new();
    let mut step_words: Vec<Vec<u32>> = Vec::new();
    let mut streams = Streams::new(&docs, &vocab, &constraint, args.streams, eos)?;
    for step in 0..args.steps {
        let mut words = vec![u32::MAX; args.streams * w];
        let t = Instant::now();
        let results = {
            let mut rows: Vec<(usize, &mut GrammarMatcher)> =
                streams.matchers.iter_mut().enumerate().collect();
            fill_masks(&mut rows, &mut words, w)
        };
        all_ms.push(t.elapsed().as_secs_f64() * 1e3);
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        for (k, m) in words.chunks(w).enumerate() {
            streams.check(k, m)?;
        }
        if step < args.graph_steps {
            step_words.push(words);
        }
        let t = Instant::now();
        streams.advance_all(&docs, &vocab, &constraint)?;
        accept_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }

    let graph = sampling_graphs(args, vocab_size, &step_words)?;
    let engine = match args.engine {
        true => engine_runs(args, &opened, &vocab, &constraint)?,
        false => Value::Null,
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let out = json!({
        "model": opened.dir.root.display().to_string(),
        "vocab_size": vocab_size,
        "streams": args.streams,
        "steps": args.steps,
        "cores": threads,
        "mask_threads": pool().current_num_threads(),
        "grammar_vocab_seconds": vocab_secs,
        "documents": {"finished": docs_done, "tokens": tokens_done},
        "forced_fraction": forced as f64 / (args.steps * args.streams) as f64,
        "allowed_tokens_mean": allowed_sum as f64 / (args.steps * args.streams) as f64,
        "mask_us_per_seq": stats(&mut mask_us),
        "accept_us_per_seq": stats(&mut accept_us),
        "per_step_ms": {
            "masks_serial": mask_us.iter().sum::<f64>() / 1e3 / args.steps as f64,
            "masks": stats(&mut all_ms),
            "accept": stats(&mut accept_ms),
        },
        "graph": graph,
        "engine": engine,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// Build and evaluate the sampling of a random `[streams, vocab]` batch, plain and with
/// each step's masks: host build ms, evaluation ms, ops.
fn sampling_graphs(args: &BenchMasksArgs, vocab: usize, steps: &[Vec<u32>]) -> Result<Value> {
    let b = args.streams;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed ^ 0x5eed);
    let data: Vec<f32> = (0..b * vocab)
        .map(|_| rng.random_range(-8.0f32..8.0))
        .collect();
    let logits = Array::from_slice(&data, &[b as i32, vocab as i32])?;
    let mut samplers: Vec<SequenceSampler> = (0..b)
        .map(|i| {
            SequenceSampler::new(
                SamplingParams {
                    temperature: 0.7,
                    seed: Some(i as u64),
                    ..SamplingParams::default()
                },
                &[],
            )
        })
        .collect::<mlx::Result<_>>()?;
    let w = vocab.div_ceil(32);
    let mut rows = Vec::new();
    for masked in [false, true] {
        let (mut build, mut eval) = (Vec::new(), Vec::new());
        let mut ops = None;
        for words in steps {
            // the engine thread makes the words' array and builds on it; the mask threads
            // set and write the words (not timed here)
            let mut secs = 0.0;
            let (x, _host) = match masked {
                true => {
                    let t = Instant::now();
                    let mut host = HostWritten::<u32>::new(&[b as i32, w as i32, 1])?;
                    secs += t.elapsed().as_secs_f64();
                    // SAFETY: nothing is evaluated while the slice is alive
                    unsafe { host.parts() }.1.fill(0xFF).copy_from_slice(words);
                    let t = Instant::now();
                    let x = apply_mask_words(&logits, host.array())?;
                    secs += t.elapsed().as_secs_f64();
                    (x, Some(host))
                }
                false => (logits.clone(), None),
            };
            let t = Instant::now();
            let mut refs: Vec<&mut SequenceSampler> = samplers.iter_mut().collect();
            let sample = sample_batch_lazy(&x, &mut refs)?;
            build.push((secs + t.elapsed().as_secs_f64()) * 1e3);
            if ops.is_none() {
                ops = Some(mlx::graph::count_ops(&sample.arrays(), &[&logits]));
            }
            let t = Instant::now();
            let tokens = sample.read()?;
            eval.push(t.elapsed().as_secs_f64() * 1e3);
            for (s, x) in samplers.iter_mut().zip(tokens) {
                s.observe(x.token);
            }
        }
        let ops = ops.unwrap_or_default();
        rows.push(json!({
            "masked": masked,
            "build_ms": stats(&mut build),
            "eval_ms": stats(&mut eval),
            "ops": ops.total(),
            "ops_by_name": ops.to_json(),
        }));
    }
    Ok(Value::Array(rows))
}

/// The engine thread's time by part over the pipelined steps (see [`HostPart`]).
#[derive(Default)]
struct Parts {
    seconds: std::cell::Cell<[f64; 4]>,
    pipelined: std::cell::Cell<u64>,
}

impl Observer for Parts {
    fn host_time(&self, part: HostPart, seconds: f64) {
        let mut s = self.seconds.get();
        s[HostPart::ALL
            .iter()
            .position(|&p| p == part)
            .expect("a part")] += seconds;
        self.seconds.set(s);
    }
    fn decode_pipelined(&self) {
        self.pipelined.set(self.pipelined.get() + 1);
    }
}

/// `--engine`: unconstrained and constrained runs of the scheduler, alternated.
fn engine_runs(
    args: &BenchMasksArgs,
    opened: &OpenedModel,
    vocab: &GrammarVocab,
    c: &Constraint,
) -> Result<Value> {
    let tokenizer = &opened.tokenizer;
    let prompt = tokenizer.encode_chat(
        &[ChatMessage::new(
            "user",
            "Write a recipe for tomato pasta as JSON: a title, the steps, a rating.",
        )],
        true,
    )?;
    let ctx = prompt.len() + args.max_tokens + 8;
    let model = load_weights(&args.model, opened)?;
    let mut exec = LocalExecutor::new(model, args.streams, ctx);
    exec.worker.warm_up()?;
    let mut runs = Vec::new();
    // the first pair warms up (kernels of every batch size met, the grammar's caches)
    for run in 0..=args.runs {
        for constrained in [false, true] {
            let obs = Parts::default();
            let mut sched = Scheduler::new(
                SchedulerConfig {
                    slots: args.streams,
                    ctx_size: ctx,
                    max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
                    kv: Some(exec.kv_pool()),
                    prefix_caching: true,
                    max_itl_ratio: default_max_itl_ratio(),
                },
                tokenizer.clone(),
            );
            let mut rxs = Vec::new();
            for i in 0..args.streams {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let grammar = match constrained {
                    true => Some(Box::new(GrammarMatcher::new(vocab, c)?)),
                    false => None,
                };
                sched.submit(
                    Request {
                        prompt: prompt.clone(),
                        params: SamplingParams {
                            temperature: 0.7,
                            seed: Some((run * args.streams + i) as u64),
                            ..SamplingParams::default()
                        },
                        max_tokens: args.max_tokens,
                        stop: Vec::new(),
                        ignore_eos: !constrained,
                        skip_special_tokens: true,
                        grammar,
                        arrived: Instant::now(),
                        events: tx,
                    },
                    &obs,
                );
                rxs.push(rx);
            }
            let start = Instant::now();
            let (mut tokens, mut errors) = (0usize, Vec::new());
            while sched.has_work() {
                sched.step(&mut exec, &obs)?;
                for rx in &mut rxs {
                    while let Ok(ev) = rx.try_recv() {
                        match ev {
                            Event::Delta { .. } => tokens += 1,
                            Event::Error { message, .. } => errors.push(message),
                            Event::Done { .. } => {}
                        }
                    }
                }
            }
            let secs = start.elapsed().as_secs_f64();
            if !errors.is_empty() {
                bail!("--engine: {} requests failed: {}", errors.len(), errors[0]);
            }
            if run == 0 {
                continue;
            }
            let steps = obs.pipelined.get().max(1) as f64;
            let parts: serde_json::Map<String, Value> = HostPart::ALL
                .iter()
                .zip(obs.seconds.get())
                .map(|(p, s)| (p.name().to_string(), json!(s * 1e3 / steps)))
                .collect();
            runs.push(json!({
                "run": run,
                "schema": constrained,
                "tokens": tokens,
                "seconds": secs,
                "tokens_per_second": tokens as f64 / secs,
                "pipelined_steps": obs.pipelined.get(),
                "host_ms_per_step": parts,
            }));
        }
    }
    Ok(json!({"backend": mlx::backend().to_string(), "max_tokens": args.max_tokens, "runs": runs}))
}

/// Mean, median, 90th and 99th percentile and maximum.
fn stats(v: &mut [f64]) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    json!({
        "mean": v.iter().sum::<f64>() / v.len() as f64,
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "max": v[v.len() - 1],
    })
}

/// The streams' grammars and where each is in its document.
struct Streams {
    matchers: Vec<GrammarMatcher>,
    /// Per stream: its document's tokens and the next one's index.
    docs_of: Vec<(Vec<u32>, usize, u64)>,
    next_doc: u64,
    eos: u32,
    /// Documents finished, tokens taken.
    docs: usize,
    tokens: usize,
}

impl Streams {
    fn new(
        docs: &Docs,
        vocab: &GrammarVocab,
        c: &Constraint,
        n: usize,
        eos: u32,
    ) -> Result<Streams> {
        let mut s = Streams {
            matchers: Vec::with_capacity(n),
            docs_of: Vec::with_capacity(n),
            next_doc: 0,
            eos,
            docs: 0,
            tokens: 0,
        };
        for _ in 0..n {
            let doc = s.next_doc;
            s.next_doc += 1;
            s.matchers.push(GrammarMatcher::new(vocab, c)?);
            s.docs_of.push((docs.tokens(doc)?, 0, doc));
        }
        Ok(s)
    }

    /// Stream `k`'s next token (end-of-sequence after its document).
    fn next_token(&self, k: usize) -> u32 {
        let (toks, at, _) = &self.docs_of[k];
        toks.get(*at).copied().unwrap_or(self.eos)
    }

    /// The mask of stream `k` allows its next token.
    fn check(&self, k: usize, mask: &[u32]) -> Result<()> {
        let t = self.next_token(k);
        if mask
            .get(t as usize / 32)
            .is_some_and(|w| w >> (t % 32) & 1 == 1)
        {
            return Ok(());
        }
        let (toks, at, doc) = &self.docs_of[k];
        bail!(
            "document {doc}: token {at} ({t}) is not allowed by the schema's grammar (a document this \
             benchmark cannot make for that schema); its tokens: {:?}",
            &toks[..(*at + 1).min(toks.len())]
        )
    }

    /// Advance every stream by its token as the engine does, on the mask threads (a
    /// finished document starts the next one with a new grammar).
    fn advance_all(&mut self, docs: &Docs, vocab: &GrammarVocab, c: &Constraint) -> Result<()> {
        let tokens: Vec<u32> = (0..self.matchers.len())
            .map(|k| self.next_token(k))
            .collect();
        for (k, &t) in tokens.iter().enumerate() {
            if t == self.eos {
                self.restart(k, docs, vocab, c)?;
            }
        }
        let mut items: Vec<(&mut GrammarMatcher, u32)> = self
            .matchers
            .iter_mut()
            .zip(&tokens)
            .filter(|(_, &t)| t != self.eos)
            .map(|(m, &t)| (m, t))
            .collect();
        accept_all(&mut items)
            .into_iter()
            .collect::<Result<Vec<()>, _>>()?;
        for (k, &t) in tokens.iter().enumerate() {
            if t != self.eos {
                self.docs_of[k].1 += 1;
                self.tokens += 1;
            }
        }
        Ok(())
    }

    /// Stream `k` starts its next document with a new grammar.
    fn restart(
        &mut self,
        k: usize,
        docs: &Docs,
        vocab: &GrammarVocab,
        c: &Constraint,
    ) -> Result<()> {
        let doc = self.next_doc;
        self.next_doc += 1;
        self.matchers[k] = GrammarMatcher::new(vocab, c)?;
        self.docs_of[k] = (docs.tokens(doc)?, 0, doc);
        self.docs += 1;
        Ok(())
    }

    /// Advance every stream by its token, one at a time (a finished document starts the
    /// next one with a new grammar): µs per advance.
    fn advance_each(
        &mut self,
        docs: &Docs,
        vocab: &GrammarVocab,
        c: &Constraint,
    ) -> Result<Vec<f64>> {
        let mut us = Vec::with_capacity(self.matchers.len());
        for k in 0..self.matchers.len() {
            let t = self.next_token(k);
            if t == self.eos {
                self.restart(k, docs, vocab, c)?;
                continue;
            }
            let start = Instant::now();
            self.matchers[k].accept(t)?;
            us.push(start.elapsed().as_secs_f64() * 1e6);
            self.docs_of[k].1 += 1;
            self.tokens += 1;
        }
        Ok(us)
    }
}

/// Documents the schema accepts, as token ids: document `i` from seed `seed + i`.
struct Docs<'a> {
    schema: &'a Value,
    tokenizer: &'a Tokenizer,
    seed: u64,
}

const WORDS: &[&str] = &[
    "the", "pasta", "water", "boil", "salt", "stir", "minutes", "until", "tender", "drain",
    "sauce", "garlic", "olive", "oil", "pan", "heat", "add", "onion", "slowly", "golden",
    "tomatoes", "simmer", "season", "pepper", "serve", "fresh", "basil", "cheese", "grated",
    "bowl", "mix", "gently", "large", "small", "pot", "lid", "cover", "low", "medium", "high",
    "about", "then", "while", "before", "after", "taste", "adjust", "plate", "warm", "cold",
];

impl Docs<'_> {
    fn tokens(&self, i: u64) -> Result<Vec<u32>> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(i));
        let text = instance(self.schema, &mut rng, 0)?;
        Ok(self.tokenizer.encode(&text, false)?)
    }
}

/// JSON text that `schema` accepts, laid out as constrained decoding lays it out (`", "`
/// between items, `": "` after keys): every property of an object in order, arrays of
/// a few more than `minItems` items, strings of words up to their `maxLength`.
fn instance(schema: &Value, rng: &mut rand::rngs::StdRng, depth: usize) -> Result<String> {
    if depth > 16 {
        bail!("--schema: nested deeper than 16 levels");
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        let v = options
            .get(rng.random_range(0..options.len().max(1)))
            .context("--schema: an empty enum")?;
        return Ok(serde_json::to_string(v)?);
    }
    if let Some(v) = schema.get("const") {
        return Ok(serde_json::to_string(v)?);
    }
    let n = |key: &str| schema.get(key).and_then(Value::as_i64);
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => {
            let props = schema.get("properties").and_then(Value::as_object);
            let mut parts = Vec::new();
            for (k, sub) in props.into_iter().flatten() {
                parts.push(format!(
                    "{}: {}",
                    serde_json::to_string(k)?,
                    instance(sub, rng, depth + 1)?
                ));
            }
            Ok(format!("{{{}}}", parts.join(", ")))
        }
        Some("array") => {
            let min = n("minItems").unwrap_or(1).max(0) as usize;
            let max = n("maxItems").map_or(usize::MAX, |m| m as usize);
            let count = (min + rng.random_range(0..6usize)).min(max);
            let items = schema
                .get("items")
                .cloned()
                .unwrap_or(json!({"type": "string"}));
            let parts: Vec<String> = (0..count)
                .map(|_| instance(&items, rng, depth + 1))
                .collect::<Result<_>>()?;
            Ok(format!("[{}]", parts.join(", ")))
        }
        Some("string") => {
            let min = n("minLength").unwrap_or(0).max(0) as usize;
            let max = n("maxLength").map_or(120, |m| m.max(0) as usize);
            let target = rng.random_range(min.max(max / 4)..=max.max(min));
            let mut s = String::new();
            loop {
                let w = WORDS[rng.random_range(0..WORDS.len())];
                let extra = w.len() + usize::from(!s.is_empty());
                if s.len() + extra > target {
                    break;
                }
                if !s.is_empty() {
                    s.push(' ');
                }
                s.push_str(w);
            }
            while s.len() < min {
                s.push('a');
            }
            Ok(serde_json::to_string(&s)?)
        }
        Some("integer") => {
            let lo = n("minimum").unwrap_or(0);
            let hi = n("maximum").unwrap_or(lo + 100).max(lo);
            Ok(rng.random_range(lo..=hi).to_string())
        }
        Some("number") => Ok(format!("{}.5", rng.random_range(0..100))),
        Some("boolean") => Ok(rng.random_bool(0.5).to_string()),
        Some("null") => Ok("null".into()),
        other => bail!(
            "--schema: a schema of type {other:?} (only object, array, string, integer, number, \
             boolean, null, enum and const are made into documents here)"
        ),
    }
}
