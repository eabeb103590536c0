//! Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases)
//! with a mixture-of-experts block ([`super::blocks::moe`]) of routed experts plus a
//! shared expert scaled by `sigmoid(shared_expert_gate(x))`.
use serde_json::Value;

use super::blocks::attention::AttentionOptions;
use super::config::ModelConfig;
use super::config::{parse_common, parse_qwen_moe, refuse_sliding_window, ConfigError, Fields};
use super::layout::Layout;
use super::model::decoder_layout;
use super::shard::ShardPlan;
use super::Family;

pub const FAMILY: Family = Family {
    model_type: "qwen2_moe",
    parse_config,
    layout,
};

pub fn layout(cfg: &ModelConfig, plan: &ShardPlan) -> Layout {
    let attn = AttentionOptions {
        qkv_bias: true,
        qk_norm: false,
    };
    decoder_layout(cfg, plan, attn)
}

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
