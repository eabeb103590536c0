//! `mlxcel generate`: run a model on one prompt, stream the text, print stats.
use std::io::Write;

use anyhow::{bail, Result};
use clap::Args;

use crate::engine::generate::{generate, GenerateOptions, Generation};
use crate::engine::sampler::{SamplingParams, MAX_TOP_LOGPROBS};
use crate::engine::step::{Executor, LocalExecutor};
use crate::parallel::driver::TpExecutor;
use crate::runtime::{check_single_device_memory, load_weights, open_model, ModelArgs, TpArgs};
use crate::tokenizer::{chat::ChatMessage, Tokenizer};

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt. Default: a chat question ("What is the capital of France?"), or "The
    /// meaning of life is" with --raw.
    #[arg(short = 'p', long)]
    pub prompt: Option<String>,
    /// Wrap the prompt as a user message in the model's chat template (the default for a
    /// model that has one; an error for one that has none).
    #[arg(
        long,
        visible_alias = "conversation",
        alias = "cnv",
        conflicts_with = "raw"
    )]
    pub chat: bool,
    /// Plain text completion: the prompt as it is, no chat template.
    #[arg(
        long,
        visible_alias = "ignore-chat-template",
        alias = "no-conversation",
        alias = "no-cnv"
    )]
    pub raw: bool,
    /// System message for the chat template.
    #[arg(long, conflicts_with = "raw")]
    pub system: Option<String>,
    /// Maximum new tokens.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// HF-style repetition penalty (1 = off).
    #[arg(
        long = "repeat-penalty",
        alias = "repetition-penalty",
        default_value_t = 1.0
    )]
    pub repetition_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating after an EOS token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Read each token before queuing the next decode step (by default step t+1
    /// runs on the device while token t is read and printed; same tokens).
    #[arg(long)]
    pub no_pipeline: bool,
    /// Prompt tokens per prefill step.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Print exactly one JSON line (ids, text, finish_reason, stats) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// With --json: each generated token's log-probability and the N most likely tokens
    /// at its step (`--logprobs` alone: N = 0), as `logprobs` entries `{token, logprob,
    /// top: [[id, logprob], ...]}`: log-softmax of the logits after the repetition penalty,
    /// before temperature and truncation (the server's `logprobs`).
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "0", requires = "json")]
    pub logprobs: Option<u32>,
    #[command(flatten)]
    pub tp: TpArgs,
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        logprobs: args.logprobs.is_some(),
        top_logprobs: args.logprobs.unwrap_or(0),
        ..SamplingParams::default()
    };
    if params.top_logprobs > MAX_TOP_LOGPROBS {
        bail!(
            "--logprobs {}: at most {MAX_TOP_LOGPROBS}",
            params.top_logprobs
        );
    }
    params
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid sampling option: {e}"))?;
    let m = open_model(&args.model)?;
    let prompt_ids = prompt_ids(args, &m.tokenizer)?;
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        prefill_chunk: args.prefill_chunk,
        skip_special_tokens: true,
        pipeline: !args.no_pipeline,
    };
    let mut tp_exec = None;
    let mut local_exec = None;
    let exec: &mut dyn Executor = if args.tp.uses_ranks() {
        let mut opts = args.tp.options(args.model.load_format, m.ctx_size, 1);
        opts.max_num_batched_tokens = args.prefill_chunk;
        tp_exec.insert(TpExecutor::launch(&m.dir, opts)?)
    } else {
        check_single_device_memory(&args.model, &m, 1, args.prefill_chunk, None)?;
        let loaded = load_weights(&args.model, &m)?;
        let mut local = LocalExecutor::new(loaded, 1, m.ctx_size);
        local.worker.warm_up()?;
        local_exec.insert(local)
    };
    let mut stdout = std::io::stdout().lock();
    let json = args.json;
    let g = generate(
        exec,
        &m.tokenizer,
        0,
        0,
        &prompt_ids,
        params,
        &opts,
        |piece| {
            if !json {
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
            }
        },
    )?;
    let ranks = tp_exec.as_ref().map(|t| t.reports().to_vec());
    if json {
        let mut v = serde_json::to_value(&g)?;
        if let Some(ranks) = &ranks {
            v["stats"]["ranks"] = serde_json::to_value(ranks)?;
        }
        writeln!(stdout, "{}", serde_json::to_string(&v)?)?;
    } else {
        writeln!(stdout)?;
        for r in ranks.iter().flatten() {
            writeln!(stdout, "{}", r.summary())?;
        }
        writeln!(stdout, "{}", stats_line(&g))?;
    }
    Ok(())
}

/// The default chat question of `generate` without `-p`.
pub const DEFAULT_QUESTION: &str = "What is the capital of France?";
/// The default completion prompt of `generate --raw` without `-p`.
pub const DEFAULT_RAW_PROMPT: &str = "The meaning of life is";

/// The prompt's token ids: the chat template (default where the model has one, required with
/// --chat) or, with --raw or no template, the text as it is.
pub fn prompt_ids(args: &GenerateArgs, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let chat = !args.raw && (args.chat || tokenizer.has_chat_template());
    if chat {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage::new("system", s.clone()));
        }
        let q = args.prompt.as_deref().unwrap_or(DEFAULT_QUESTION);
        messages.push(ChatMessage::new("user", q));
        Ok(tokenizer.encode_chat(&messages, true)?)
    } else {
        if args.system.is_some() {
            bail!("--system needs a chat template, and this model has none");
        }
        let p = args.prompt.as_deref().unwrap_or(DEFAULT_RAW_PROMPT);
        Ok(tokenizer.encode(p, true)?)
    }
}

/// `prompt: N tokens, X tok/s | generated: M tokens, Y tok/s | peak memory: Z GB | finish: stop`
pub fn stats_line(g: &Generation) -> String {
    let s = &g.stats;
    format!(
        "prompt: {} tokens, {:.1} tok/s | generated: {} tokens, {:.1} tok/s | peak memory: {:.3} GB | finish: {}",
        s.prompt_tokens,
        s.prefill_tokens_per_second,
        s.generated_tokens,
        s.decode_tokens_per_second,
        s.peak_memory_bytes as f64 / 1e9,
        serde_json::to_value(g.finish_reason).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()
    )
}
