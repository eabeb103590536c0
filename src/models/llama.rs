//! Llama 2/3/3.1/3.2 and Mistral (the same architecture): config parsing.
//! The forward pass is the shared [`super::transformer`].
use serde_json::Value;

use super::config::{parse_common, ConfigError, Fields, ModelConfig};

pub fn parse_config(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields(v);
    f.refuse_unless(
        "attention_bias",
        |v| v == false,
        "attention biases are not implemented for llama",
    )?;
    // Mistral: a sliding window only matters once sequences outgrow it.
    if let Some(w) = f.get("sliding_window") {
        let window = w.as_u64().unwrap_or(0) as usize;
        let max_pos = f.opt_usize("max_position_embeddings")?.unwrap_or(4096);
        if window > 0 && window < max_pos {
            return Err(ConfigError::Unsupported {
                field: "sliding_window".into(),
                value: w.to_string(),
                why: format!("sliding-window attention is not implemented (window < max_position_embeddings {max_pos})"),
            });
        }
    }
    parse_common(v)
}
