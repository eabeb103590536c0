//! Llama 2/3/3.1/3.2: its config (refusing what it does not implement), and its
//! layout: the decoder of [`super::model`] with plain attention (no biases, no q/k norm)
//! and a SwiGLU MLP.
use serde_json::Value;

use super::blocks::attention::AttentionOptions;
use super::config::{parse_common, refuse_sliding_window, ConfigError, Fields, ModelConfig};
use super::layout::Layout;
use super::model::decoder_layout;
use super::shard::ShardPlan;
use super::Family;

pub const FAMILY: Family = Family {
    model_type: "llama",
    parse_config,
    layout,
};

pub fn layout(cfg: &ModelConfig, plan: &ShardPlan) -> Layout {
    decoder_layout(cfg, plan, AttentionOptions::default())
}

pub fn parse_config(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields(v);
    // Llama's attention_bias puts biases on q, k, v and o.
    f.refuse_unless(
        "attention_bias",
        |v| v == false,
        "attention biases are not implemented for llama",
    )?;
    // Mistral: a sliding window only matters once sequences outgrow it.
    refuse_sliding_window(&f)?;
    parse_common(v)
}
