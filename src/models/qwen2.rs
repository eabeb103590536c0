//! Qwen2 / Qwen2.5: Llama with q/k/v biases. Forward: [`super::transformer`].
use serde_json::Value;

use super::config::{parse_common, refuse_sliding_window, ConfigError, Fields, ModelConfig};

pub fn parse_config(v: &Value) -> Result<ModelConfig, ConfigError> {
    // `use_sliding_window`, `sliding_window`, `max_window_layers` and `layer_types`
    // are written with harmless values by transformers 5; a window in effect is refused.
    refuse_sliding_window(&Fields(v))?;
    let mut cfg = parse_common(v)?;
    cfg.qkv_bias = true;
    Ok(cfg)
}
