//! Qwen3 (dense): Llama with RMSNorm on q and k per head and no q/k/v biases (the
//! decoder of [`super::model`]).
use serde_json::Value;

use super::blocks::attention::AttentionOptions;
use super::config::{parse_common, refuse_sliding_window, ConfigError, Fields, ModelConfig};
use super::layout::Layout;
use super::model::decoder_layout;
use super::shard::ShardPlan;
use super::Family;

pub const FAMILY: Family = Family {
    model_type: "qwen3",
    parse_config,
    layout,
};

pub fn layout(cfg: &ModelConfig, plan: &ShardPlan) -> Layout {
    let attn = AttentionOptions {
        qkv_bias: false,
        qk_norm: true,
    };
    decoder_layout(cfg, plan, attn)
}

pub fn parse_config(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields(v);
    refuse_sliding_window(&f)?;
    f.refuse_unless(
        "attention_bias",
        |v| v == false,
        "attention biases are not implemented for qwen3",
    )?;
    let mut cfg = parse_common(v)?;
    cfg.qk_norm = true;
    Ok(cfg)
}
