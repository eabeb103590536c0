//! Rotary position embedding settings read from `config.json`, and the
//! frequencies they give.
//!
//! Two forms exist in the wild, and both are read:
//! * transformers 5 writes `rope_parameters`: `{"rope_type": …, "rope_theta": …,
//!   <the type's own keys>}` (and no top-level `rope_theta`);
//! * older files have a top-level `rope_theta` plus an optional `rope_scaling`
//!   whose type is under `rope_type` or, older still, `type`.
//!
//! Implemented types: `default`, `linear`, `llama3` and `yarn`, computed as
//! transformers' `modeling_rope_utils` does. Any other type is refused with an
//! error naming the field and its value: a wrong frequency gives wrong tokens
//! from the first position on, without any other symptom.
use serde_json::Value;

use super::config::{ConfigError, Fields};

/// Rotary embedding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// `rope_theta`: the base of the frequencies.
    pub theta: f32,
    pub scaling: RopeScaling,
}

/// How the base frequencies `theta^(-2i/d)` are changed.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `rope_type: "default"` (or no scaling at all).
    None,
    /// `rope_type: "linear"`: every frequency divided by `factor` (positions interpolated).
    Linear { factor: f32 },
    /// `rope_type: "llama3"`: Llama 3.1's wavelength bands.
    Llama3(Llama3RopeScaling),
    /// `rope_type: "yarn"`: YaRN's interpolation ramp and attention factor.
    Yarn(YarnRopeScaling),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct YarnRopeScaling {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Multiplies cos and sin, i.e. q and k: the attention logits take its square.
    pub attention_factor: f64,
    /// Round the correction range to whole dimensions (transformers' default).
    pub truncate: bool,
}

impl RopeConfig {
    /// Plain RoPE with base `theta`.
    pub fn plain(theta: f32) -> RopeConfig {
        RopeConfig {
            theta,
            scaling: RopeScaling::None,
        }
    }

    /// The angle of pair `i` (of `dims / 2`) at position `p` is `p · inv_freq[i]`.
    /// Computed in f64, then rounded.
    pub fn inv_freq(&self, dims: usize) -> Vec<f32> {
        let base = self.theta as f64;
        let d = dims as f64;
        let plain: Vec<f64> = (0..dims / 2)
            .map(|i| base.powf(-2.0 * i as f64 / d))
            .collect();
        let scaled: Vec<f64> = match &self.scaling {
            RopeScaling::None => plain,
            RopeScaling::Linear { factor } => plain.iter().map(|f| f / *factor as f64).collect(),
            RopeScaling::Llama3(s) => {
                let factor = s.factor as f64;
                let (lo, hi) = (s.low_freq_factor as f64, s.high_freq_factor as f64);
                let old = s.original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) = (old / lo, old / hi);
                plain
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn(y) => {
                // transformers' `_compute_yarn_parameters`.
                let correction_dim = |rotations: f64| {
                    d * (y.original_max_position_embeddings
                        / (rotations * 2.0 * std::f64::consts::PI))
                        .ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) =
                    (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
                if y.truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                plain
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (f / y.factor) * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect()
            }
        };
        scaled.into_iter().map(|f| f as f32).collect()
    }

    /// The factor the attention logits `q·k` take from the rotation (YaRN's
    /// attention factor squared; 1 for every other type).
    pub fn logit_scale(&self) -> f32 {
        match &self.scaling {
            RopeScaling::Yarn(y) => (y.attention_factor * y.attention_factor) as f32,
            _ => 1.0,
        }
    }
}

/// Read the rope settings of a config (either form), refusing types that are not implemented.
pub(crate) fn parse_rope(f: &Fields<'_>) -> Result<RopeConfig, ConfigError> {
    let (params, field) = match f.get("rope_parameters") {
        Some(p) => (Some(per_layer_type(p)?), "rope_parameters"),
        None => (f.get("rope_scaling"), "rope_scaling"),
    };
    let params = params.map(Fields);
    // theta: inside rope_parameters (transformers 5), else top level.
    let theta = match params.as_ref().and_then(|p| p.get("rope_theta")) {
        Some(_) if field == "rope_parameters" => params
            .as_ref()
            .unwrap()
            .f32_or("rope_theta", 10000.0)
            .map_err(|e| prefixed(e, field))?,
        _ => f.f32_or("rope_theta", 10000.0)?,
    };
    let Some(p) = params else {
        return Ok(RopeConfig::plain(theta));
    };
    // transformers 5 may keep `partial_rotary_factor` among the rope parameters.
    p.refuse_unless(
        "partial_rotary_factor",
        |v| v.as_f64() == Some(1.0),
        "partial rotary embeddings are not implemented",
    )
    .map_err(|e| prefixed(e, field))?;
    let kind = match p.get("rope_type").or_else(|| p.get("type")) {
        None => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(ConfigError::Field {
                field: format!("{field}.rope_type"),
                msg: format!("expected a string, got {other}"),
            })
        }
    };
    let num = |k: &str| -> Result<Option<f64>, ConfigError> {
        match p.get(k) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| ConfigError::Field {
                field: format!("{field}.{k}"),
                msg: format!("expected a number, got {v}"),
            }),
        }
    };
    let need = |k: &str| -> Result<f64, ConfigError> {
        num(k)?.ok_or_else(|| ConfigError::Field {
            field: format!("{field}.{k}"),
            msg: format!("missing (required by rope_type \"{kind}\")"),
        })
    };
    // transformers: a top-level `original_max_position_embeddings` wins (Phi-3 writes it
    // there), then the rope parameters' own, then `max_position_embeddings`.
    let original = || -> Result<f64, ConfigError> {
        match f.opt_usize("original_max_position_embeddings")? {
            Some(n) => Ok(n as f64),
            None => match num("original_max_position_embeddings")? {
                Some(n) => positive(n, field, "original_max_position_embeddings"),
                None => Ok(f.usize("max_position_embeddings")? as f64),
            },
        }
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: positive(need("factor")?, field, "factor")? as f32,
        },
        "llama3" => RopeScaling::Llama3(Llama3RopeScaling {
            factor: positive(need("factor")?, field, "factor")? as f32,
            low_freq_factor: need("low_freq_factor")? as f32,
            high_freq_factor: need("high_freq_factor")? as f32,
            original_max_position_embeddings: original()? as f32,
        }),
        "yarn" => {
            let original = original()?;
            // DeepSeek-V3 style: no factor, the ratio of the two lengths instead.
            let factor = match num("factor")? {
                Some(x) => positive(x, field, "factor")?,
                None => f.usize("max_position_embeddings")? as f64 / original,
            };
            let mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match num("attention_factor")? {
                Some(a) => a,
                None => match (num("mscale")?, num("mscale_all_dim")?) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                        mscale(factor, m) / mscale(factor, a)
                    }
                    _ => mscale(factor, 1.0),
                },
            };
            let truncate = match p.get("truncate") {
                None => true,
                Some(v) => v.as_bool().ok_or_else(|| ConfigError::Field {
                    field: format!("{field}.truncate"),
                    msg: format!("expected true or false, got {v}"),
                })?,
            };
            RopeScaling::Yarn(YarnRopeScaling {
                factor,
                original_max_position_embeddings: original,
                beta_fast: num("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
                beta_slow: num("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
                attention_factor,
                truncate,
            })
        }
        other => {
            return Err(ConfigError::Unsupported {
                field: format!("{field}.rope_type"),
                value: format!("\"{other}\""),
                why: "implemented rope types: default, linear, llama3, yarn".into(),
            })
        }
    };
    Ok(RopeConfig { theta, scaling })
}

/// transformers 5 writes per-layer-type rope parameters for models that mix
/// attention kinds (`{"full_attention": {...}, "sliding_attention": {...}}`):
/// the supported families only have full attention, so that entry is the one.
fn per_layer_type(p: &Value) -> Result<&Value, ConfigError> {
    let Some(obj) = p.as_object() else {
        return Err(ConfigError::Field {
            field: "rope_parameters".into(),
            msg: format!("expected an object, got {p}"),
        });
    };
    if !obj.contains_key("full_attention") {
        return Ok(p);
    }
    if let Some(k) = obj.keys().find(|k| *k != "full_attention") {
        return Err(ConfigError::Unsupported {
            field: format!("rope_parameters.{k}"),
            value: obj[k].to_string(),
            why: "only full attention is implemented".into(),
        });
    }
    Ok(&obj["full_attention"])
}

fn positive(x: f64, field: &str, k: &str) -> Result<f64, ConfigError> {
    if x > 0.0 && x.is_finite() {
        Ok(x)
    } else {
        Err(ConfigError::Field {
            field: format!("{field}.{k}"),
            msg: format!("expected a positive number, got {x}"),
        })
    }
}

/// Name a field that was read from inside `rope_parameters` / `rope_scaling` by its full path.
fn prefixed(e: ConfigError, prefix: &str) -> ConfigError {
    match e {
        ConfigError::Field { field, msg } => ConfigError::Field {
            field: format!("{prefix}.{field}"),
            msg,
        },
        ConfigError::Unsupported { field, value, why } => ConfigError::Unsupported {
            field: format!("{prefix}.{field}"),
            value,
            why,
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rope(v: Value) -> Result<RopeConfig, ConfigError> {
        parse_rope(&Fields(&v))
    }

    #[test]
    fn both_forms_read_the_same() {
        let legacy = rope(json!({
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        }))
        .unwrap();
        let v5 = rope(json!({
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}
        }))
        .unwrap();
        assert_eq!(legacy, v5);
        assert_eq!(v5.theta, 500000.0);
        assert!(matches!(v5.scaling, RopeScaling::Llama3(_)));
        // the oldest spelling, `type`
        let old =
            rope(json!({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}))
                .unwrap();
        assert_eq!(old.scaling, RopeScaling::Linear { factor: 2.0 });
        // theta only inside rope_parameters
        let q =
            rope(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})).unwrap();
        assert_eq!(q, RopeConfig::plain(1e6));
        assert_eq!(rope(json!({})).unwrap(), RopeConfig::plain(10000.0));
    }

    #[test]
    fn unknown_types_are_refused_by_field_and_value() {
        for (v, field) in [
            (
                json!({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}),
                "rope_parameters.rope_type",
            ),
            (
                json!({"rope_scaling": {"rope_type": "longrope"}}),
                "rope_scaling.rope_type",
            ),
            (
                json!({"rope_scaling": {"type": "su"}}),
                "rope_scaling.rope_type",
            ),
        ] {
            let e = rope(v).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
            assert!(
                e.contains("\"dynamic\"") || e.contains("\"longrope\"") || e.contains("\"su\""),
                "{e}"
            );
        }
        let e = rope(
            json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                  "partial_rotary_factor": 0.5}}),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("rope_parameters.partial_rotary_factor") && e.contains("0.5"),
            "{e}"
        );
        let e =
            rope(json!({"rope_scaling": {"rope_type": "linear"}, "max_position_embeddings": 4096}))
                .unwrap_err()
                .to_string();
        assert!(e.contains("rope_scaling.factor"), "{e}");
        let e = rope(
            json!({"rope_scaling": {"rope_type": "yarn", "factor": -1.0},
                            "max_position_embeddings": 4096}),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("rope_scaling.factor") && e.contains("-1"), "{e}");
    }

    /// YaRN's shape at head_dim 16, theta 1e6, factor 4, original length 32: the correction
    /// range is dims 0..1, so pair 0 keeps its frequency and the rest are divided by 4
    /// (the rope_yarn fixture checks the values against transformers).
    #[test]
    fn yarn_frequencies() {
        let r = rope(
            json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
            "factor": 4.0, "original_max_position_embeddings": 32}}),
        )
        .unwrap();
        let RopeScaling::Yarn(y) = &r.scaling else {
            panic!()
        };
        assert!((y.attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        let inv = r.inv_freq(16);
        let plain = RopeConfig::plain(1e6).inv_freq(16);
        // low dims (fast rotation) keep their frequency, high dims are interpolated by 4
        assert_eq!(inv[0], plain[0]);
        assert!((inv[7] - plain[7] / 4.0).abs() <= plain[7] * 1e-6);
    }

    #[test]
    fn per_layer_type_parameters() {
        let r = rope(json!({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}}))
            .unwrap();
        assert_eq!(r, RopeConfig::plain(1e6));
        let e = rope(json!({"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}))
        .unwrap_err()
        .to_string();
        assert!(e.contains("rope_parameters.sliding_attention"), "{e}");
    }
}
