//! Mixtral (8x7B, 8x22B): Mistral's attention with a mixture-of-experts block
//! ([`super::blocks::moe`]) in every layer, `block_sparse_moe.experts.{e}.w1/w3/w2`
//! (gate, up, down) of `intermediate_size`, the top-k routing weights always
//! renormalised.
use serde_json::Value;

use super::config::{
    check_top_k, parse_common, refuse_sliding_window, ConfigError, Fields, ModelConfig, MoeConfig,
    MoeNames,
};
use super::Family;

pub const FAMILY: Family = Family {
    model_type: "mixtral",
    parse_config,
    // llama's attention; the MoE blocks come from the config (`cfg.moe`)
    layout: super::llama::layout,
};

pub fn parse_config(v: &Value) -> Result<ModelConfig, ConfigError> {
    let f = Fields(v);
    refuse_sliding_window(&f)?;
    let mut cfg = parse_common(v)?;
    cfg.moe = Some(check_top_k(MoeConfig {
        num_experts: f.usize("num_local_experts")?,
        top_k: f.usize("num_experts_per_tok")?,
        expert_intermediate: cfg.intermediate_size,
        norm_topk_prob: true,
        sparse_layers: vec![true; cfg.num_layers],
        shared_expert_intermediate: None,
        names: MoeNames::MIXTRAL,
    })?);
    Ok(cfg)
}
