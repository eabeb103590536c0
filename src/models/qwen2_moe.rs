//! Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases)
//! with a mixture-of-experts block ([`super::blocks::moe`]) of routed experts plus a
//! shared expert scaled by `sigmoid(shared_expert_gate(x))`.
use serde_json::Value;

use super::config::ModelConfig;
use super::config::{parse_common, parse_qwen_moe, refuse_sliding_window, ConfigError, Fields};
use super::Family;

pub const FAMILY: Family = Family {
    model_type: "qwen2_moe",
    parse_config,
    // qwen2's attention; the MoE blocks come from the config (`cfg.moe`)
    layout: super::qwen2::layout,
};

pub fn parse_config(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields(v);
    refuse_sliding_window(&f)?;
    f.refuse_unless(
        "qkv_bias",
        |v| v == true,
        "qwen2_moe without q/k/v biases is not implemented",
    )?;
    let mut cfg = parse_common(v)?;
    cfg.qkv_bias = true;
    cfg.moe = Some(parse_qwen_moe(v, cfg.num_layers, true)?);
    Ok(cfg)
}
