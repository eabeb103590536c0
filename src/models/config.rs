//! The runtime model configuration shared by the Llama-like families; `config.json`'s
//! `model_type` picks the family's parser ([`super::FAMILIES`]).
//!
//! A family parser reads its own `config.json` fields and refuses any feature
//! it does not implement, naming the field (never silently ignoring it).
use serde_json::Value;

use crate::mlx::Dtype;

pub use super::rope::{Llama3RopeScaling, RopeConfig, RopeScaling, YarnRopeScaling};

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

/// `model_type` values mlxcel can run (one per family in [`super::FAMILIES`]).
pub const SUPPORTED: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
];

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
    /// Mixture-of-experts feed-forward layers (`None`: every layer is a dense MLP).
    pub moe: Option<MoeConfig>,
}

/// The routed experts of a mixture-of-experts family (Qwen3-MoE, Qwen2-MoE, Mixtral).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_experts`, Mixtral's `num_local_experts`).
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Intermediate size of one expert (`moe_intermediate_size`; Mixtral's
    /// `intermediate_size`).
    pub expert_intermediate: usize,
    /// Renormalise the top-k routing weights to sum to 1 (`norm_topk_prob`; always for Mixtral).
    pub norm_topk_prob: bool,
    /// Which layers are MoE (the others are dense MLPs of `intermediate_size`): layer i is
    /// when it is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`.
    pub sparse_layers: Vec<bool>,
    /// A shared expert of this intermediate size beside the routed ones, scaled by
    /// `sigmoid(shared_expert_gate(x))` (Qwen2-MoE).
    pub shared_expert_intermediate: Option<usize>,
    /// Where the weights sit in the checkpoint: the block's prefix under
    /// `model.layers.{i}` (`mlp`, Mixtral's `block_sparse_moe`) and the per-expert names
    /// of the gate, up and down projections (`gate_proj`…, Mixtral's `w1`, `w3`, `w2`).
    pub names: MoeNames,
}

/// Checkpoint names of a MoE block ([`MoeConfig::names`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeNames {
    pub block: &'static str,
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl MoeNames {
    pub const QWEN: MoeNames = MoeNames {
        block: "mlp",
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
    };
    pub const MIXTRAL: MoeNames = MoeNames {
        block: "block_sparse_moe",
        gate: "w1",
        up: "w3",
        down: "w2",
    };
}

impl MoeConfig {
    /// Whether layer `i` is a MoE layer.
    pub fn is_sparse(&self, i: usize) -> bool {
        self.sparse_layers.get(i).copied().unwrap_or(false)
    }
}

impl ModelConfig {
    /// Parse `config.json`, dispatching on `model_type`.
    pub fn from_json(v: &Value) -> Result<ModelConfig, ConfigError> {
        let mt = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or(ConfigError::NoModelType)?;
        match super::family(mt) {
            Some(f) => (f.parse_config)(v),
            None => Err(ConfigError::UnknownModelType(mt.to_string())),
        }
    }

    /// Parameters (elements) in the model, counting quantized weights as their float
    /// shape: the family's layout ([`super::layout`]) counted.
    pub fn num_parameters(&self) -> u64 {
        super::layout(self, &super::shard::ShardPlan::full(self)).num_parameters()
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
    refuse_math_changes(&f)?;
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
            // mlx-lm's mixed recipes put per-layer settings (an object, or false) beside the defaults.
            // (a MoE router's own bits and group, as mlx-lm's predicate gives
            // `*.mlp.gate` 8 bits, are read from its stored shapes: accepted)
            if let Some((k, v)) = q
                .as_object()
                .into_iter()
                .flatten()
                .find(|(k, v)| (v.is_object() && !is_router(k)) || v.is_boolean())
            {
                return Err(ConfigError::Unsupported {
                    field: format!("quantization.{k}"),
                    value: v.to_string(),
                    why: "per-layer quantization settings are not implemented".into(),
                });
            }
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
    let rope = super::rope::parse_rope(&f)?;
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
        moe: None,
    })
}

/// Whether a per-layer quantization key names a MoE router or shared-expert gate, whose
/// bits and group size the loader reads from the stored shapes.
fn is_router(key: &str) -> bool {
    [".mlp.gate", ".block_sparse_moe.gate", ".shared_expert_gate"]
        .iter()
        .any(|s| key.ends_with(s))
}

/// The routed experts of a Qwen-style MoE config (`qwen3_moe`, `qwen2_moe`):
/// `num_experts` (transformers 5 writes `num_local_experts`), `num_experts_per_tok`,
/// `moe_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`,
/// and with `shared` the shared expert's `shared_expert_intermediate_size`.
pub(crate) fn parse_qwen_moe(
    v: &Value,
    num_layers: usize,
    shared: bool,
) -> Result<MoeConfig, ConfigError> {
    let f = Fields(v);
    let num_experts = match f.opt_usize("num_experts")? {
        Some(n) => n,
        None => f
            .usize("num_local_experts")
            .map_err(|_| ConfigError::Field {
                field: "num_experts".into(),
                msg: "missing (nor is num_local_experts set)".into(),
            })?,
    };
    let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    let dense: Vec<usize> = match f.get("mlp_only_layers") {
        None => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| ConfigError::Field {
                        field: "mlp_only_layers".into(),
                        msg: format!("expected layer indices, got {x}"),
                    })
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ConfigError::Field {
                field: "mlp_only_layers".into(),
                msg: format!("expected a list of layer indices, got {other}"),
            })
        }
    };
    let sparse_layers = (0..num_layers)
        .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
        .collect();
    let moe = MoeConfig {
        num_experts,
        top_k: f.usize("num_experts_per_tok")?,
        expert_intermediate: f.usize("moe_intermediate_size")?,
        norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
        sparse_layers,
        shared_expert_intermediate: match shared {
            true => Some(f.usize("shared_expert_intermediate_size")?),
            false => None,
        },
        names: MoeNames::QWEN,
    };
    check_top_k(moe)
}

/// Refuse more experts per token than there are.
pub(crate) fn check_top_k(moe: MoeConfig) -> Result<MoeConfig, ConfigError> {
    if moe.top_k > moe.num_experts {
        return Err(ConfigError::Field {
            field: "num_experts_per_tok".into(),
            msg: format!("{} is more than the {} experts", moe.top_k, moe.num_experts),
        });
    }
    Ok(moe)
}

/// Refuse the values of fields shared by the Llama-like families that change the math
/// and are not implemented. A field with its neutral value (or null) is fine: current
/// tools write many of them.
fn refuse_math_changes(f: &Fields<'_>) -> Result<(), ConfigError> {
    for k in ["hidden_act", "hidden_activation"] {
        f.refuse_unless(k, |v| v == "silu", "only SiLU MLPs are implemented")?;
    }
    f.refuse_unless("mlp_bias", |v| v == false, "MLP biases are not implemented")?;
    f.refuse_unless(
        "pretraining_tp",
        |v| v == 1,
        "pretraining_tp > 1 changes the math",
    )?;
    f.refuse_unless(
        "partial_rotary_factor",
        |v| v.as_f64() == Some(1.0),
        "partial rotary embeddings are not implemented",
    )?;
    f.refuse_unless(
        "rope_traditional",
        |v| v == false,
        "interleaved (traditional) RoPE is not implemented",
    )?;
    for k in ["attn_logit_softcapping", "final_logit_softcapping"] {
        f.refuse_unless(k, |_| false, "logit soft-capping is not implemented")?;
    }
    for k in [
        "embedding_multiplier",
        "logits_scaling",
        "residual_multiplier",
        "attention_multiplier",
    ] {
        f.refuse_unless(
            k,
            |v| v.as_f64() == Some(1.0),
            "scaling multipliers are not implemented",
        )?;
    }
    if let Some(q) = f.get("quantization_config") {
        Fields(q)
            .refuse_unless(
                "quant_method",
                |_| false,
                "only MLX affine checkpoints (`quantization`) and float weights are read",
            )
            .map_err(|e| match e {
                ConfigError::Unsupported { value, why, .. } => ConfigError::Unsupported {
                    field: "quantization_config.quant_method".into(),
                    value,
                    why,
                },
                e => e,
            })?;
    }
    Ok(())
}

/// Refuse a sliding window that takes effect: one that some layer uses and that is
/// shorter than `max_position_embeddings`. Layers slide when `layer_types` says so,
/// else (Qwen) when `use_sliding_window` is true from layer `max_window_layers` on,
/// else (Mistral) everywhere a `sliding_window` is given.
pub(crate) fn refuse_sliding_window(f: &Fields<'_>) -> Result<(), ConfigError> {
    let layers = f.usize("num_hidden_layers")?;
    let max_pos = f.opt_usize("max_position_embeddings")?.unwrap_or(4096);
    let window = match f.get("sliding_window") {
        None => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| ConfigError::Field {
            field: "sliding_window".into(),
            msg: format!("expected a positive integer or null, got {v}"),
        })? as usize),
    };
    let (field, sliding): (&str, Vec<bool>) = if let Some(lt) = f.get("layer_types") {
        let kinds = lt.as_array().ok_or_else(|| ConfigError::Field {
            field: "layer_types".into(),
            msg: format!("expected a list, got {lt}"),
        })?;
        if let Some(k) = kinds
            .iter()
            .find(|k| *k != "full_attention" && *k != "sliding_attention")
        {
            return Err(ConfigError::Unsupported {
                field: "layer_types".into(),
                value: k.to_string(),
                why: "only full (and inactive sliding) attention is implemented".into(),
            });
        }
        (
            "layer_types",
            kinds.iter().map(|k| k == "sliding_attention").collect(),
        )
    } else if let Some(on) = f.get("use_sliding_window") {
        let from = match f.get("max_window_layers") {
            None => 0,
            Some(v) => v.as_u64().ok_or_else(|| ConfigError::Field {
                field: "max_window_layers".into(),
                msg: format!("expected a non-negative integer, got {v}"),
            })? as usize,
        };
        let on = on == true && window.is_some();
        (
            "use_sliding_window",
            (0..layers).map(|i| on && i >= from).collect(),
        )
    } else {
        ("sliding_window", vec![window.is_some(); layers])
    };
    match window {
        Some(w) if w > 0 && w < max_pos && sliding.iter().any(|&s| s) => {
            Err(ConfigError::Unsupported {
                field: field.into(),
                value: f.get(field).map(Value::to_string).unwrap_or_default(),
                why: format!(
                    "sliding-window attention (sliding_window {w} < max_position_embeddings {max_pos}) is not implemented"
                ),
            })
        }
        None if field == "layer_types" && sliding.iter().any(|&s| s) => Err(ConfigError::Field {
            field: "sliding_window".into(),
            msg: "missing, but layer_types has sliding_attention layers".into(),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A small Llama config in the form transformers 5 writes, with `extra` merged in.
    fn config(model_type: &str, extra: Value) -> Value {
        let mut v = json!({
            "architectures": ["LlamaForCausalLM"], "model_type": model_type,
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 384,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "dtype": "bfloat16",
            "hidden_act": "silu", "attention_bias": false, "attention_dropout": 0.0,
            "mlp_bias": false, "pretraining_tp": 1, "pad_token_id": null,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "tie_word_embeddings": false, "transformers_version": "5.24.0", "use_cache": true
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        if model_type != "llama" {
            v.as_object_mut().unwrap().remove("mlp_bias");
            v.as_object_mut().unwrap().remove("pretraining_tp");
        }
        if model_type == "qwen2" {
            v.as_object_mut().unwrap().remove("attention_bias");
        }
        v
    }

    fn refusal(model_type: &str, extra: Value) -> String {
        match ModelConfig::from_json(&config(model_type, extra.clone())) {
            Ok(_) => panic!("{model_type} {extra} was accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn transformers5_harmless_fields_load() {
        for mt in SUPPORTED {
            let extra = json!({
                "layer_types": ["full_attention", "full_attention"],
                "use_sliding_window": false, "max_window_layers": 28, "sliding_window": null,
                "head_dim": 8, "partial_rotary_factor": 1.0, "attn_logit_softcapping": null,
                "final_logit_softcapping": null,
            });
            let mut v = config(mt, extra);
            if *mt == "mistral" || *mt == "llama" || *mt == "mixtral" {
                v.as_object_mut().unwrap().remove("use_sliding_window");
                v.as_object_mut().unwrap().remove("max_window_layers");
            }
            if mt.ends_with("_moe") || *mt == "mixtral" {
                let experts = json!({"num_experts": 4, "num_local_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                    "shared_expert_intermediate_size": 16, "qkv_bias": true});
                for (k, x) in experts.as_object().unwrap() {
                    v[k] = x.clone();
                }
            }
            let cfg = ModelConfig::from_json(&v).unwrap_or_else(|e| panic!("{mt}: {e}"));
            assert_eq!(cfg.rope.theta, 500000.0, "{mt}");
            assert_eq!(cfg.dtype, Dtype::BF16);
        }
        // Qwen: a window that no layer uses (use_sliding_window false, or every layer below
        // max_window_layers) is harmless too.
        for extra in [
            json!({"use_sliding_window": false, "sliding_window": 4096, "max_window_layers": 0}),
            json!({"use_sliding_window": true, "sliding_window": 1024, "max_window_layers": 2}),
            json!({"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 4096}),
        ] {
            ModelConfig::from_json(&config("qwen2", extra.clone()))
                .unwrap_or_else(|e| panic!("{extra}: {e}"));
        }
    }

    /// Every refusal names the field and its value.
    #[test]
    fn math_changing_values_are_refused_by_name() {
        let cases: &[(&str, Value, &str, &str)] = &[
            ("llama", json!({"hidden_act": "gelu"}), "hidden_act", "gelu"),
            ("qwen3", json!({"hidden_act": "relu"}), "hidden_act", "relu"),
            ("llama", json!({"mlp_bias": true}), "mlp_bias", "true"),
            (
                "llama",
                json!({"attention_bias": true}),
                "attention_bias",
                "true",
            ),
            (
                "qwen3",
                json!({"attention_bias": true}),
                "attention_bias",
                "true",
            ),
            (
                "mistral",
                json!({"attention_bias": true}),
                "attention_bias",
                "true",
            ),
            ("llama", json!({"pretraining_tp": 2}), "pretraining_tp", "2"),
            (
                "llama",
                json!({"partial_rotary_factor": 0.5}),
                "partial_rotary_factor",
                "0.5",
            ),
            (
                "qwen2",
                json!({"attn_logit_softcapping": 50.0}),
                "attn_logit_softcapping",
                "50",
            ),
            (
                "qwen3",
                json!({"final_logit_softcapping": 30.0}),
                "final_logit_softcapping",
                "30",
            ),
            (
                "llama",
                json!({"rope_traditional": true}),
                "rope_traditional",
                "true",
            ),
            (
                "llama",
                json!({"logits_scaling": 8.0}),
                "logits_scaling",
                "8",
            ),
            (
                "mistral",
                json!({"sliding_window": 1024}),
                "sliding_window",
                "1024",
            ),
            (
                "qwen2",
                json!({"use_sliding_window": true, "sliding_window": 1024, "max_window_layers": 1}),
                "use_sliding_window",
                "true",
            ),
            (
                "qwen3",
                json!({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 512}),
                "layer_types",
                "sliding_attention",
            ),
            (
                "qwen3",
                json!({"layer_types": ["full_attention", "chunked_attention"]}),
                "layer_types",
                "chunked_attention",
            ),
            (
                "llama",
                json!({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}),
                "rope_parameters.rope_type",
                "dynamic",
            ),
            (
                "qwen2",
                json!({"rope_parameters": null, "rope_theta": 1e6, "rope_scaling": {"type": "longrope"}}),
                "rope_scaling.rope_type",
                "longrope",
            ),
            (
                "llama",
                json!({"quantization_config": {"quant_method": "gptq", "bits": 4}}),
                "quantization_config.quant_method",
                "gptq",
            ),
            (
                "llama",
                json!({"quantization": {"group_size": 64, "bits": 4,
                        "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8}}}),
                "quantization.model.layers.0.mlp.down_proj",
                "\"bits\":8",
            ),
        ];
        for (mt, extra, field, value) in cases {
            let e = refusal(mt, extra.clone());
            assert!(
                e.contains(&format!("`{field}`")) && e.contains(value),
                "{mt} {extra}: {e}"
            );
        }
    }

    /// mlx-lm writes `quantization_config` as a copy of `quantization` (no quant_method).
    #[test]
    fn mlx_quantization_config_is_read() {
        let q = json!({"group_size": 64, "bits": 4, "mode": "affine"});
        let cfg = ModelConfig::from_json(&config(
            "llama",
            json!({"quantization": q, "quantization_config": q}),
        ))
        .unwrap();
        assert_eq!(
            cfg.quantization,
            Some(QuantConfig {
                group_size: 64,
                bits: 4
            })
        );
    }
}
