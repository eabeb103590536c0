//! Model families. One file per family (`llama.rs`, `mistral.rs`, `qwen2.rs`,
//! `qwen3.rs`, and the mixture-of-experts `qwen3_moe.rs`, `qwen2_moe.rs`, `mixtral.rs`) holds its config parser (refusing features it does not implement) and
//! its parameter layout (`layout.rs`: names, shapes, quantization and TP splits, read by
//! the loader, the memory plan and the TP checks), made of the blocks in [`blocks`];
//! every family runs the one decoder loop of [`model::Model`]. A new Llama-like family
//! is one file and one line in [`FAMILIES`].
pub mod blocks;
pub mod config;
pub mod demo;
pub mod gguf;
pub mod kv_cache;
pub mod layers;
pub mod layout;
pub mod llama;
pub mod mistral;
pub mod mixtral;
pub mod model;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_moe;
pub mod rope;
pub mod shard;
pub mod weights;

pub use config::{ConfigError, ModelConfig};
pub use layout::{Layout, ParamSpec, Split};
pub use model::{DecodeOps, ForwardError, Logits, Model, SeqInput, StepInput};

/// A model family: the `model_type` it runs, its config parser and its layout.
pub struct Family {
    pub model_type: &'static str,
    pub parse_config: fn(&serde_json::Value) -> Result<ModelConfig, ConfigError>,
    /// The parameters of one rank under a shard plan.
    pub layout: fn(&ModelConfig, &shard::ShardPlan) -> Layout,
}

/// Every family mlxcel runs.
pub const FAMILIES: &[Family] = &[
    llama::FAMILY,
    mistral::FAMILY,
    qwen2::FAMILY,
    qwen3::FAMILY,
    qwen3_moe::FAMILY,
    qwen2_moe::FAMILY,
    mixtral::FAMILY,
];

/// The family of a `model_type`.
pub fn family(model_type: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.model_type == model_type)
}

/// The parameters rank `plan.rank` holds of a model of `cfg`, as its family lays them
/// out. A config made in code with another `model_type` gets the Llama-like decoder
/// with its `qkv_bias` / `qk_norm` flags.
pub fn layout(cfg: &ModelConfig, plan: &shard::ShardPlan) -> Layout {
    match family(&cfg.model_type) {
        Some(f) => (f.layout)(cfg, plan),
        None => {
            let attn = blocks::attention::AttentionOptions {
                qkv_bias: cfg.qkv_bias,
                qk_norm: cfg.qk_norm,
            };
            model::decoder_layout(cfg, plan, attn)
        }
    }
}
pub use weights::{CastSource, DummySource, LoadError, SafetensorsSource, WeightSource};

use crate::model_dir::{ModelDir, ModelDirError};

/// How weights are obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LoadFormat {
    /// Read the checkpoint's safetensors files.
    #[default]
    Safetensors,
    /// Random weights of the right shapes from config.json alone, made on the device.
    Dummy,
}

/// Any failure while loading a model folder.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Dir(#[from] ModelDirError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Mlx(#[from] crate::mlx::MlxError),
}

/// A loaded model and what loading it cost.
pub struct Loaded {
    pub model: Model,
    pub bytes_read: u64,
    pub seconds: f64,
}

/// Parse the config of a model folder.
pub fn read_config(dir: &ModelDir) -> Result<ModelConfig, ModelError> {
    Ok(ModelConfig::from_json(&dir.read_config()?)?)
}

/// The weights of the model in `dir` as `format` says: its checkpoint files, or dummy
/// weights (seed 0) in the config's dtype.
pub fn weight_source(
    dir: &ModelDir,
    format: LoadFormat,
    cfg: &ModelConfig,
) -> Result<Box<dyn WeightSource>, LoadError> {
    Ok(match format {
        LoadFormat::Safetensors if dir.is_gguf() => {
            Box::new(gguf::GgufSource::open(&dir.weights[0])?)
        }
        LoadFormat::Safetensors => Box::new(SafetensorsSource::from_dir(dir)?),
        LoadFormat::Dummy => Box::new(DummySource::new(cfg.dtype, 0)),
    })
}

/// Load the model in `dir`; `progress(done, total)` is called per layer.
pub fn load(
    dir: &ModelDir,
    format: LoadFormat,
    progress: impl FnMut(usize, usize),
) -> Result<Loaded, ModelError> {
    load_as(dir, format, None, progress)
}

/// [`load`], with every float weight cast to `dtype` when given (the model then computes
/// in it: activations and KV cache take the weights' dtype).
pub fn load_as(
    dir: &ModelDir,
    format: LoadFormat,
    dtype: Option<crate::mlx::Dtype>,
    progress: impl FnMut(usize, usize),
) -> Result<Loaded, ModelError> {
    let cfg = read_config(dir)?;
    let t0 = std::time::Instant::now();
    let src = weight_source(dir, format, &cfg)?;
    let src = match dtype {
        Some(d) => Box::new(CastSource::new(src, d)),
        None => src,
    };
    let model = Model::load(&cfg, src.as_ref(), progress)?;
    Ok(Loaded {
        model,
        bytes_read: src.bytes_read(),
        seconds: t0.elapsed().as_secs_f64(),
    })
}
