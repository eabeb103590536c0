//! Qwen2 / Qwen2.5: Llama with q/k/v biases. Forward: [`super::transformer`].
use serde_json::Value;

use super::config::{parse_common, ConfigError, Fields, ModelConfig};

pub fn parse_config(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields(v);
    f.refuse_unless(
        "use_sliding_window",
        |v| v == false,
        "sliding-window attention is not implemented",
    )?;
    let mut cfg = parse_common(v)?;
    cfg.qkv_bias = true;
    Ok(cfg)
}
