//! Single-sequence generation: chunked prefill, sampling, EOS and stop-string
//! handling, streaming text, and the statistics `generate` and `bench` report.
use std::time::Instant;

use serde::Serialize;

use super::sampler::SamplingParams;
use super::step::{Executor, SampledToken, SeqStart, SeqStep, StepError, StepPlan};
use crate::mlx::{self, Array};
use crate::models::kv_cache::KvCache;
use crate::models::{ForwardError, Logits, Model, SeqInput, StepInput};
use crate::tokenizer::stream::{StopMatcher, StreamDecoder};
use crate::tokenizer::{Tokenizer, TokenizerError};

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt has {prompt} tokens, which leaves no room in the context of {ctx} (raise --ctx-size)")]
    PromptTooLong { prompt: usize, ctx: usize },
    #[error("empty prompt: nothing to generate from")]
    EmptyPrompt,
    #[error("sampling parameters: {0}")]
    Params(String),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Mlx(#[from] mlx::MlxError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Why generation ended (OpenAI's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Prompt tokens per prefill forward pass.
    pub prefill_chunk: usize,
    pub skip_special_tokens: bool,
    /// Queue decode step t+1 on the device before reading token t, where the
    /// executor can ([`Executor::can_pipeline`]); same tokens either way.
    pub pipeline: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 128,
            stop: vec![],
            ignore_eos: false,
            prefill_chunk: 512,
            skip_special_tokens: true,
            pipeline: true,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub prefill_tokens_per_second: f64,
    pub generated_tokens: usize,
    pub decode_seconds: f64,
    pub decode_tokens_per_second: f64,
    pub peak_memory_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    pub generated_token_ids: Vec<u32>,
    /// With `logprobs` in the sampling parameters: one entry per generated token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprobs>>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub stats: Stats,
}

/// A generated token's log-probability and the most likely tokens at its step
/// (`log_softmax` of the penalised logits, before temperature, as the sampler computes them).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// `[token, logprob]` pairs, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    fn of(s: &SampledToken) -> Option<Self> {
        s.logprob.map(|logprob| TokenLogprobs {
            token: s.token,
            logprob,
            top: s.top_logprobs.clone(),
        })
    }
}

/// Prefill `prompt` into `slot` in chunks directly on a model; return the last position's
/// logits `[1, vocab]` (used by `bench`).
pub fn prefill(
    model: &Model,
    cache: &mut KvCache,
    slot: usize,
    prompt: &[u32],
    chunk: usize,
) -> Result<Array, GenerateError> {
    let chunk = chunk.max(1);
    let mut last = None;
    for part in prompt.chunks(chunk) {
        let mut out = model.forward(
            cache,
            StepInput::Host(&[SeqInput { slot, tokens: part }]),
            Logits::Last,
        )?;
        let logits = out.remove(0);
        logits.eval()?;
        last = Some(logits);
    }
    last.ok_or(GenerateError::EmptyPrompt)
}

/// Generate from `prompt` as sequence `seq_id` in `slot` of `exec`, calling `on_text`
/// with each new piece of text (never a broken UTF-8 sequence, never part of a stop
/// string).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    exec: &mut dyn Executor,
    tokenizer: &Tokenizer,
    seq_id: u64,
    slot: usize,
    prompt: &[u32],
    params: SamplingParams,
    opts: &GenerateOptions,
    mut on_text: impl FnMut(&str),
) -> Result<Generation, GenerateError> {
    params.validate().map_err(GenerateError::Params)?;
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    let ctx = exec.ctx_size();
    if prompt.len() >= ctx {
        return Err(GenerateError::PromptTooLong {
            prompt: prompt.len(),
            ctx,
        });
    }
    exec.reset_peak_memory();
    let want_logprobs = params.logprobs;
    let eos: Vec<u32> = tokenizer.eos_token_ids().to_vec();
    let mut decoder = StreamDecoder::new(tokenizer, opts.skip_special_tokens);
    let mut stops = StopMatcher::new(opts.stop.clone());
    let mut text = String::new();
    let mut generated = Vec::new();
    let mut logprobs = Vec::new();

    let t0 = Instant::now();
    let chunk = opts.prefill_chunk.max(1);
    let n_chunks = prompt.len().div_ceil(chunk);
    let mut token = 0;
    let mut sampled = None;
    for (k, part) in prompt.chunks(chunk).enumerate() {
        let step = SeqStep {
            seq_id,
            slot,
            pos: k * chunk,
            tokens: part.to_vec(),
            start: (k == 0).then(|| SeqStart {
                params: params.clone(),
                prompt: prompt.to_vec(),
            }),
            sample: k + 1 == n_chunks,
            blocks: None,
            restart: false,
        };
        let r = exec.execute(&StepPlan {
            seqs: vec![step],
            ..Default::default()
        })?;
        if let Some(s) = r.sampled.first() {
            token = s.token;
            sampled = Some(s.clone());
        }
    }
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut finish = FinishReason::Length;
    let mut emit = |piece: &str, text: &mut String| {
        if !piece.is_empty() {
            text.push_str(piece);
            on_text(piece);
        }
    };
    let pipelined = opts.pipeline && exec.can_pipeline(seq_id);
    let mut queued = 0usize;
    loop {
        generated.push(token);
        if want_logprobs {
            logprobs.extend(sampled.take().as_ref().and_then(TokenLogprobs::of));
        }
        if !opts.ignore_eos && eos.contains(&token) {
            finish = FinishReason::Stop;
            break;
        }
        let delta = decoder.push(token)?;
        let out = stops.push(&delta);
        emit(&out.emit, &mut text);
        if out.stopped {
            finish = FinishReason::Stop;
            break;
        }
        let pos = prompt.len() + generated.len() - 1;
        if generated.len() >= opts.max_tokens || prompt.len() + generated.len() >= ctx {
            break;
        }
        if pipelined {
            let more =
                generated.len() + 1 < opts.max_tokens && prompt.len() + generated.len() + 1 < ctx;
            let next = (|| -> Result<SampledToken, GenerateError> {
                if queued == 0 {
                    exec.queue_decode(&[(seq_id, slot, pos)], Some(&[token]), &[])?;
                    queued += 1;
                }
                // the step after it, fed with its token on the device, if that may be wanted
                if more {
                    exec.queue_decode(&[(seq_id, slot, pos + 1)], None, &[])?;
                    queued += 1;
                }
                let s = exec.take_sampled()?.pop();
                queued -= 1;
                s.ok_or(GenerateError::Step(StepError::NoSampler(seq_id)))
            })();
            match next {
                Ok(s) => {
                    token = s.token;
                    sampled = Some(s);
                }
                Err(e) => {
                    // leave the executor without stale queued steps
                    exec.discard_queued();
                    return Err(e);
                }
            }
            continue;
        }
        let step = SeqStep {
            seq_id,
            slot,
            pos,
            tokens: vec![token],
            start: None,
            sample: true,
            blocks: None,
            restart: false,
        };
        let r = exec.execute(&StepPlan {
            seqs: vec![step],
            ..Default::default()
        })?;
        let s = r
            .sampled
            .into_iter()
            .next()
            .ok_or(GenerateError::Step(StepError::NoSampler(seq_id)))?;
        token = s.token;
        sampled = Some(s);
    }
    if queued > 0 {
        exec.discard_queued();
    }
    exec.execute(&StepPlan {
        release: vec![seq_id],
        ..Default::default()
    })?;
    if !stops.is_stopped() {
        let tail = decoder.finish()?;
        let out = stops.push(&tail);
        emit(&out.emit, &mut text);
        if out.stopped {
            finish = FinishReason::Stop;
        } else {
            let rest = stops.flush();
            emit(&rest, &mut text);
        }
    }
    let decode_seconds = t1.elapsed().as_secs_f64();
    let decoded = generated.len().saturating_sub(1);
    Ok(Generation {
        prompt_token_ids: prompt.to_vec(),
        stats: Stats {
            prompt_tokens: prompt.len(),
            prefill_seconds,
            prefill_tokens_per_second: prompt.len() as f64 / prefill_seconds.max(1e-9),
            generated_tokens: generated.len(),
            decode_seconds,
            decode_tokens_per_second: if decoded > 0 {
                decoded as f64 / decode_seconds.max(1e-9)
            } else {
                0.0
            },
            peak_memory_bytes: exec.peak_memory(),
        },
        generated_token_ids: generated,
        logprobs: want_logprobs.then_some(logprobs),
        text,
        finish_reason: finish,
    })
}
