//! The runtime model configuration shared by the Llama-like families, and the
//! dispatch from `config.json`'s `model_type` to each family's parser.
//!
//! A family parser reads its own `config.json` fields and refuses any feature
//! it does not implement, naming the field (never silently ignoring it).
use serde_json::Value;

use crate::mlx::Dtype;

/// Errors in `config.json`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config.json: unsupported model_type `{0}` (supported: {supported})", supported = SUPPORTED.join(", "))]
    UnknownModelType(String),
    #[error("config.json: missing field `model_type`")]
    NoModelType,
    #[error("config.json: field `{field}`: {msg}")]
    Field { field: String, msg: String },
    #[error("config.json: `{field}` = {value} is not supported by mlxcel ({why})")]
    Unsupported {
        field: String,
        value: String,
        why: String,
    },
}

/// `model_type` values mlxcel can run.
pub const SUPPORTED: &[&str] = &["llama", "mistral", "qwen2", "qwen3"];

/// Rotary embedding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    /// Llama-3 frequency scaling (`rope_scaling.rope_type = "llama3"`).
    pub llama3: Option<Llama3RopeScaling>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

/// MLX affine quantization of the checkpoint (`"quantization": {group_size, bits}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantConfig {
    pub group_size: i32,
    pub bits: i32,
}

/// A decoder-only transformer of the Llama lineage.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope: RopeConfig,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (Qwen2).
    pub qkv_bias: bool,
    /// RMSNorm on q and k per head (Qwen3).
    pub qk_norm: bool,
    pub max_position_embeddings: usize,
    pub quantization: Option<QuantConfig>,
    /// `torch_dtype`/`dtype` of the checkpoint (dummy weights use it).
    pub dtype: Dtype,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl ModelConfig {
    /// Parse `config.json`, dispatching on `model_type`.
    pub fn from_json(v: &Value) -> Result<ModelConfig, ConfigError> {
        let mt = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or(ConfigError::NoModelType)?;
        match mt {
            "llama" | "mistral" => super::llama::parse_config(v),
            "qwen2" => super::qwen2::parse_config(v),
            "qwen3" => super::qwen3::parse_config(v),
            other => Err(ConfigError::UnknownModelType(other.to_string())),
        }
    }

    /// Parameters (elements) in the model, counting quantized weights as their float shape.
    pub fn num_parameters(&self) -> u64 {
        let h = self.hidden_size as u64;
        let q = (self.num_heads * self.head_dim) as u64;
        let kv = (self.num_kv_heads * self.head_dim) as u64;
        let i = self.intermediate_size as u64;
        let per_layer = h * q * 2 + h * kv * 2 + 3 * h * i + 2 * h;
        let emb = self.vocab_size as u64 * h;
        per_layer * self.num_layers as u64 + emb * if self.tie_word_embeddings { 1 } else { 2 } + h
    }
}

/// Typed access to `config.json` fields with errors that name the field.
pub(crate) struct Fields<'a>(pub &'a Value);

impl<'a> Fields<'a> {
    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    pub fn usize(&self, k: &str) -> Result<usize, ConfigError> {
        self.opt_usize(k)?.ok_or_else(|| ConfigError::Field {
            field: k.into(),
            msg: "missing".into(),
        })
    }

    pub fn opt_usize(&self, k: &str) -> Result<Option<usize>, ConfigError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| Some(n as usize))
                .ok_or_else(|| ConfigError::Field {
                    field: k.into(),
                    msg: format!("expected a positive integer, got {v}"),
                }),
        }
    }

    pub fn f32_or(&self, k: &str, default: f32) -> Result<f32, ConfigError> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| ConfigError::Field {
                    field: k.into(),
                    msg: format!("expected a number, got {v}"),
                }),
        }
    }

    pub fn bool_or(&self, k: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| ConfigError::Field {
                field: k.into(),
                msg: format!("expected true or false, got {v}"),
            }),
        }
    }

    /// Refuse a field whose presence (with a value other than the allowed ones) changes the math.
    pub fn refuse_unless(
        &self,
        k: &str,
        ok: impl Fn(&Value) -> bool,
        why: &str,
    ) -> Result<(), ConfigError> {
        match self.get(k) {
            Some(v) if !ok(v) => Err(ConfigError::Unsupported {
                field: k.into(),
                value: v.to_string(),
                why: why.into(),
            }),
            _ => Ok(()),
        }
    }

    fn token_ids(&self, k: &str) -> Vec<u32> {
        match self.get(k) {
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64().map(|x| x as u32))
                .collect(),
            _ => vec![],
        }
    }
}

/// The fields every Llama-like family shares; family parsers adjust the result.
pub(crate) fn parse_common(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields(v);
    let hidden_size = f.usize("hidden_size")?;
    let num_heads = f.usize("num_attention_heads")?;
    let num_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
    if hidden_size % num_heads != 0 && f.opt_usize("head_dim")?.is_none() {
        return Err(ConfigError::Field {
            field: "head_dim".into(),
            msg: format!("missing, and hidden_size {hidden_size} is not divisible by num_attention_heads {num_heads}"),
        });
    }
    let head_dim = f.opt_usize("head_dim")?.unwrap_or(hidden_size / num_heads);
    if num_heads % num_kv_heads != 0 {
        return Err(ConfigError::Field {
            field: "num_key_value_heads".into(),
            msg: format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
        });
    }
    f.refuse_unless(
        "hidden_act",
        |v| v == "silu",
        "only SiLU MLPs are implemented",
    )?;
    f.refuse_unless("mlp_bias", |v| v == false, "MLP biases are not implemented")?;
    f.refuse_unless(
        "pretraining_tp",
        |v| v == 1,
        "pretraining_tp > 1 changes the math",
    )?;
    let dtype_name = f
        .get("torch_dtype")
        .or_else(|| f.get("dtype"))
        .and_then(Value::as_str)
        .unwrap_or("bfloat16");
    let dtype = Dtype::from_name(dtype_name)
        .filter(|d| d.is_float())
        .ok_or_else(|| ConfigError::Unsupported {
            field: "torch_dtype".into(),
            value: dtype_name.into(),
            why: "expected float32, float16 or bfloat16".into(),
        })?;
    let quantization = match f.get("quantization") {
        None => None,
        Some(q) => {
            let qf = Fields(q);
            qf.refuse_unless(
                "mode",
                |v| v == "affine",
                "only MLX affine quantization is implemented",
            )?;
            let group_size = qf.usize("group_size").map_err(|_| ConfigError::Field {
                field: "quantization.group_size".into(),
                msg: "missing or not a positive integer".into(),
            })? as i32;
            let bits = qf.usize("bits").map_err(|_| ConfigError::Field {
                field: "quantization.bits".into(),
                msg: "missing or not a positive integer".into(),
            })? as i32;
            if ![4, 8].contains(&bits) || ![32, 64, 128].contains(&group_size) {
                return Err(ConfigError::Unsupported {
                    field: "quantization".into(),
                    value: q.to_string(),
                    why: "bits must be 4 or 8 and group_size 32, 64 or 128".into(),
                });
            }
            Some(QuantConfig { group_size, bits })
        }
    };
    let rope = parse_rope(&f)?;
    Ok(ModelConfig {
        model_type: v
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        hidden_size,
        num_layers: f.usize("num_hidden_layers")?,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size: f.usize("intermediate_size")?,
        vocab_size: f.usize("vocab_size")?,
        rms_norm_eps: f.f32_or("rms_norm_eps", 1e-6)?,
        rope,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        qkv_bias: false,
        qk_norm: false,
        max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(4096),
        quantization,
        dtype,
        eos_token_ids: f.token_ids("eos_token_id"),
        bos_token_id: f.token_ids("bos_token_id").first().copied(),
    })
}

fn parse_rope(f: &Fields<'_>) -> Result<RopeConfig, ConfigError> {
    let theta = f.f32_or("rope_theta", 10000.0)?;
    let Some(s) = f.get("rope_scaling") else {
        return Ok(RopeConfig {
            theta,
            llama3: None,
        });
    };
    let sf = Fields(s);
    let kind = sf
        .get("rope_type")
        .or_else(|| sf.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("");
    match kind {
        "default" => Ok(RopeConfig {
            theta,
            llama3: None,
        }),
        "llama3" => {
            let need = |k: &str| -> Result<f32, ConfigError> {
                sf.get(k)
                    .and_then(Value::as_f64)
                    .map(|x| x as f32)
                    .ok_or_else(|| ConfigError::Field {
                        field: format!("rope_scaling.{k}"),
                        msg: "missing or not a number".into(),
                    })
            };
            Ok(RopeConfig {
                theta,
                llama3: Some(Llama3RopeScaling {
                    factor: need("factor")?,
                    low_freq_factor: need("low_freq_factor")?,
                    high_freq_factor: need("high_freq_factor")?,
                    original_max_position_embeddings: need("original_max_position_embeddings")?,
                }),
            })
        }
        other => Err(ConfigError::Unsupported {
            field: "rope_scaling.rope_type".into(),
            value: format!("\"{other}\""),
            why: "only llama3 rope scaling is implemented".into(),
        }),
    }
}
