//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm, no
//! biases) with a mixture-of-experts block ([`super::blocks::moe`]) in every layer that
//! `decoder_sparse_step` / `mlp_only_layers` make sparse, a dense MLP in the others.
use serde_json::Value;

use super::config::{
    parse_common, parse_qwen_moe, refuse_sliding_window, ConfigError, Fields, ModelConfig,
};
use super::Family;

pub const FAMILY: Family = Family {
    model_type: "qwen3_moe",
    parse_config,
    // qwen3's attention; the MoE blocks come from the config (`cfg.moe`)
    layout: super::qwen3::layout,
};

pub fn parse_config(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields(v);
    refuse_sliding_window(&f)?;
    f.refuse_unless(
        "attention_bias",
        |v| v == false,
        "attention biases are not implemented for qwen3_moe",
    )?;
    let mut cfg = parse_common(v)?;
    cfg.qk_norm = true;
    cfg.moe = Some(parse_qwen_moe(v, cfg.num_layers, false)?);
    Ok(cfg)
}
