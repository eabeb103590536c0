//! Mistral 7B (v0.1–v0.3): Llama's architecture (grouped-query attention without
//! biases, SwiGLU MLP), so its config is read with Llama's checks, which refuse a
//! sliding window that is in effect (`sliding_window` below `max_position_embeddings`),
//! and it is laid out as Llama is.
use serde_json::Value;

use super::config::{ConfigError, ModelConfig};
use super::Family;

pub const FAMILY: Family = Family {
    model_type: "mistral",
    parse_config,
    layout: super::llama::layout,
};

pub fn parse_config(v: &Value) -> Result<ModelConfig, ConfigError> {
    super::llama::parse_config(v)
}
