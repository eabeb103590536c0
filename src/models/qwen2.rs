//! Qwen2 / Qwen2.5: Llama with q/k/v biases (the decoder of [`super::model`]).
use serde_json::Value;

use super::blocks::attention::AttentionOptions;
use super::config::{parse_common, refuse_sliding_window, ConfigError, Fields, ModelConfig};
use super::layout::Layout;
use super::model::decoder_layout;
use super::shard::ShardPlan;
use super::Family;

pub const FAMILY: Family = Family {
    model_type: "qwen2",
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
    // `use_sliding_window`, `sliding_window`, `max_window_layers` and `layer_types`
    // are written with harmless values by transformers 5; a window in effect is refused.
    refuse_sliding_window(&Fields(v))?;
    let mut cfg = parse_common(v)?;
    cfg.qkv_bias = true;
    Ok(cfg)
}
