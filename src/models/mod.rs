//! Model families. Each family file parses its `config.json` (refusing
//! features it does not implement); the Llama-like ones share the forward pass
//! in [`transformer`], built from the layers in [`layers`].
pub mod config;
pub mod demo;
pub mod gguf;
pub mod kv_cache;
pub mod layers;
pub mod llama;
pub mod qwen2;
pub mod qwen3;
pub mod rope;
pub mod shard;
pub mod transformer;
pub mod weights;

pub use config::{ConfigError, ModelConfig};
pub use transformer::{ForwardError, Logits, SeqInput, Transformer};
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
    pub model: Transformer,
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
    let model = Transformer::load(&cfg, src.as_ref(), progress)?;
    Ok(Loaded {
        model,
        bytes_read: src.bytes_read(),
        seconds: t0.elapsed().as_secs_f64(),
    })
}
