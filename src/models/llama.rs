//! Llama 2/3/3.1/3.2 and Mistral (the same architecture): config parsing.
//! The forward pass is the shared [`super::transformer`].
use serde_json::Value;

use super::config::{parse_common, refuse_sliding_window, ConfigError, Fields, ModelConfig};

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
