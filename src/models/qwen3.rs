//! Qwen3 (dense): Llama with RMSNorm on q and k per head and no q/k/v biases.
//! Forward: [`super::transformer`].
use serde_json::Value;

use super::config::{parse_common, refuse_sliding_window, ConfigError, Fields, ModelConfig};

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
