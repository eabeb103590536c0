//! GGUF checkpoints (llama.cpp / Ollama files) as a weight source.
//!
//! A GGUF file is parsed here ([`file`]): its metadata becomes an HF-style `config.json`
//! value ([`config_json`], fed to the usual config parsers) and its tensors are offered
//! under the Hugging Face names the model code asks for (`blk.N.attn_q.weight` →
//! `model.layers.N.self_attn.q_proj.weight`, …). Quantized tensors of Q4_0, Q4_1, Q8_0
//! and Q4_K are converted block by block, exactly, into MLX's affine layout (`.weight`
//! packed, `.scales`, `.biases`, group 32, 4 or 8 bits per tensor); F32/F16/BF16, Q5_0,
//! Q5_1 and Q6_K tensors are offered as floats (the quantized ones dequantized at load,
//! with a warning); other types are refused naming the tensor.
//!
//! llama.cpp's converter permutes the rows of `attn_q` / `attn_k` of `llama` models for
//! its interleaved RoPE; they are put back in HF order here, so model code is the same
//! for both formats.
//!
//! Reads are positioned: a block of rows is one range, a block of columns one segment
//! per row (cut at 32-value group boundaries), so a tensor-parallel rank reads only its
//! slice. A split GGUF (`name-00001-of-00003.gguf`) is opened from its first part.
pub mod file;
pub mod quant;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::mlx::{Dtype, MlxError};
pub use file::{GgmlType, GgufFile, MetaValue, TensorInfo};

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a valid GGUF file: {msg}", path.display())]
    Corrupt { path: PathBuf, msg: String },
    #[error("{}: metadata `{key}`: {msg}", path.display())]
    Meta {
        path: PathBuf,
        key: String,
        msg: String,
    },
    #[error("{}: architecture `{arch}` is not supported for GGUF (supported: llama, qwen2, qwen3)", path.display())]
    Arch { path: PathBuf, arch: String },
    #[error("{}: tensor `{name}` has type {ty}, which mlxcel cannot read (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K exactly; Q5_0, Q5_1, Q6_K dequantized)", path.display())]
    Type {
        path: PathBuf,
        name: String,
        ty: String,
    },
    #[error("{}: {msg}", path.display())]
    Unsupported { path: PathBuf, msg: String },
    #[error("{}: split part {part} not found (the first part says split.count = {count}); put every part in one folder", path.display())]
    MissingPart {
        path: PathBuf,
        part: usize,
        count: usize,
    },
}

/// Architectures whose GGUF metadata maps onto mlxcel's config parsers.
pub const ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3"];

/// The parts of a (possibly split) GGUF model, given its first part: `x-00001-of-0000N.gguf`
/// → all N parts (each must exist); any other name → itself.
pub fn split_parts(first: &Path) -> Result<Vec<PathBuf>, GgufError> {
    let name = first
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let Some(stem) = name.strip_suffix(".gguf") else {
        return Ok(vec![first.to_path_buf()]);
    };
    // …-00001-of-00003
    let parts: Vec<&str> = stem.rsplitn(3, '-').collect();
    if parts.len() == 3 && parts[1] == "of" {
        let (count, index) = (parts[0], parts[2]);
        let (Some(idx_str), Ok(n)) = (index.rsplit('-').next(), count.parse::<usize>()) else {
            return Ok(vec![first.to_path_buf()]);
        };
        let base = &index[..index.len() - idx_str.len()];
        if idx_str.parse::<usize>() != Ok(1) || n == 0 {
            return Ok(vec![first.to_path_buf()]);
        }
        let width = idx_str.len();
        let dir = first.parent().unwrap_or(Path::new("."));
        let mut out = Vec::with_capacity(n);
        for i in 1..=n {
            let p = dir.join(format!("{base}{i:0width$}-of-{count}.gguf"));
            if !p.is_file() {
                return Err(GgufError::MissingPart {
                    path: first.to_path_buf(),
                    part: i,
                    count: n,
                });
            }
            out.push(p);
        }
        return Ok(out);
    }
    Ok(vec![first.to_path_buf()])
}

/// Whether a path names a GGUF file (by extension).
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Float dtype in which GGUF tensors (floats, scales and biases) are handed to MLX:
/// float32 on the CPU (exact, the reference path), float16 on a GPU (GGUF's own scale
/// type, so the scales stay exact; mlxcel's GEMV kernel takes float16 as it takes
/// bfloat16). Rounding the scales and activations to bfloat16 instead made SmolLM2-135M
/// answer the default question wrongly on an H200 (docs/gguf.md).
/// `MLXCEL_GGUF_DTYPE=float16|bfloat16|float32` overrides.
pub fn float_dtype() -> Dtype {
    if let Some(d) = std::env::var("MLXCEL_GGUF_DTYPE")
        .ok()
        .and_then(|s| Dtype::from_name(&s))
        .filter(|d| d.is_float())
    {
        return d;
    }
    match crate::mlx::backend() {
        crate::mlx::Backend::Cpu => Dtype::F32,
        _ => Dtype::F16,
    }
}

/// HF tensor prefix (without `.weight`/`.bias`) → GGUF base name.
pub fn gguf_base(hf: &str) -> Option<String> {
    let top = match hf {
        "model.embed_tokens" => Some("token_embd"),
        "model.norm" => Some("output_norm"),
        "lm_head" => Some("output"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.into());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, name) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let g = match name {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}"))
}

/// What part of an HF-named tensor is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// `.weight` (packed when the tensor converts to affine and a packed tensor is asked for).
    Weight,
    Scales,
    Biases,
    /// `.bias` (an additive bias, e.g. Qwen2's q/k/v).
    Bias,
}

pub fn split_name(name: &str) -> Option<(String, Part)> {
    let (prefix, suffix) = name.rsplit_once('.')?;
    let part = match suffix {
        "weight" => Part::Weight,
        "scales" => Part::Scales,
        "biases" => Part::Biases,
        "bias" => Part::Bias,
        _ => return None,
    };
    let g = gguf_base(prefix)?;
    let g = match part {
        Part::Bias => format!("{g}.bias"),
        _ => format!("{g}.weight"),
    };
    Some((g, part))
}

/// A GGUF model: its parts' headers, merged metadata and tensors.
pub struct GgufModel {
    pub parts: Vec<GgufFile>,
    /// Tensor name → (part index, info).
    pub tensors: BTreeMap<String, (usize, TensorInfo)>,
}

impl GgufModel {
    /// Open a GGUF file (the first part of a split one opens every part).
    pub fn open(first: &Path) -> Result<GgufModel, GgufError> {
        let paths = split_parts(first)?;
        let mut parts = Vec::with_capacity(paths.len());
        let mut tensors = BTreeMap::new();
        for (i, p) in paths.iter().enumerate() {
            let f = GgufFile::open(p)?;
            for (n, t) in &f.tensors {
                tensors.insert(n.clone(), (i, t.clone()));
            }
            parts.push(f);
        }
        Ok(GgufModel { parts, tensors })
    }

    pub fn path(&self) -> &Path {
        &self.parts[0].path
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.parts[0].get(key)
    }

    fn meta_err(&self, key: &str, msg: &str) -> GgufError {
        GgufError::Meta {
            path: self.path().to_path_buf(),
            key: key.into(),
            msg: msg.into(),
        }
    }

    pub fn need_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get(key)
            .and_then(MetaValue::as_u64)
            .ok_or_else(|| self.meta_err(key, "missing or not an integer"))
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get("general.architecture")
            .and_then(MetaValue::as_str)
            .ok_or_else(|| self.meta_err("general.architecture", "missing"))
    }

    /// Refuse tensors of types mlxcel cannot read; warn about dequantized ones.
    pub fn check_types(&self) -> Result<(), GgufError> {
        let mut dequant: BTreeMap<String, usize> = BTreeMap::new();
        for (name, (_, t)) in &self.tensors {
            if !quant::readable(t.ty) {
                return Err(GgufError::Type {
                    path: self.path().to_path_buf(),
                    name: name.clone(),
                    ty: t.ty.name(),
                });
            }
            if t.ty.block().is_some_and(|b| b.0 > 1) && quant::affine_bits(t.ty).is_none() {
                *dequant.entry(t.ty.name()).or_default() += 1;
            }
        }
        for (ty, n) in dequant {
            tracing::warn!(
                "{}: {n} {ty} tensors have no exact MLX layout; they are dequantized to floats at load",
                self.path().display()
            );
        }
        Ok(())
    }

    /// The HF-style `config.json` of this model (for `ModelConfig::from_json`).
    pub fn config_json(&self) -> Result<Value, GgufError> {
        let arch = self.architecture()?.to_string();
        if !ARCHITECTURES.contains(&arch.as_str()) {
            return Err(GgufError::Arch {
                path: self.path().to_path_buf(),
                arch,
            });
        }
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = self.need_u64(&k("embedding_length"))?;
        let heads = self.need_u64(&k("attention.head_count"))?;
        let kv_heads = self
            .get(&k("attention.head_count_kv"))
            .and_then(MetaValue::as_u64)
            .unwrap_or(heads);
        let head_dim = self
            .get(&k("attention.key_length"))
            .and_then(MetaValue::as_u64)
            .unwrap_or(hidden / heads.max(1));
        if let Some(rot) = self
            .get(&k("rope.dimension_count"))
            .and_then(MetaValue::as_u64)
        {
            if rot != head_dim {
                return Err(GgufError::Unsupported {
                    path: self.path().to_path_buf(),
                    msg: format!("{} = {rot} < head_dim {head_dim}: partial rotary embeddings are not implemented", k("rope.dimension_count")),
                });
            }
        }
        if self.tensors.contains_key("rope_freqs.weight") {
            return Err(GgufError::Unsupported {
                path: self.path().to_path_buf(),
                msg: "tensor `rope_freqs.weight` (Llama-3.1 RoPE frequency scaling) is not implemented for GGUF".into(),
            });
        }
        if let Some(t) = self
            .get(&k("rope.scaling.type"))
            .and_then(MetaValue::as_str)
        {
            if t != "none" {
                return Err(GgufError::Unsupported {
                    path: self.path().to_path_buf(),
                    msg: format!(
                        "{} = {t}: RoPE scaling is not implemented for GGUF",
                        k("rope.scaling.type")
                    ),
                });
            }
        }
        let vocab = self
            .get(&k("vocab_size"))
            .and_then(MetaValue::as_u64)
            .or_else(|| {
                self.get("tokenizer.ggml.tokens")
                    .and_then(MetaValue::as_array)
                    .map(|a| a.len() as u64)
            })
            .or_else(|| {
                self.tensors
                    .get("token_embd.weight")
                    .map(|(_, t)| t.dims[1])
            })
            .ok_or_else(|| self.meta_err(&k("vocab_size"), "missing (and no tokens)"))?;
        let ffn = self.need_u64(&k("feed_forward_length"))?;
        let mut bits = None;
        for (_, t) in self.tensors.values() {
            if let Some(b) = quant::affine_bits(t.ty) {
                // the config's default; each tensor's own bits come from the source
                bits = Some(bits.map_or(b, |x: u32| x.min(b)));
            }
        }
        let mut cfg = json!({
            "model_type": arch,
            "architectures": [format!("{arch} (GGUF)")],
            "hidden_size": hidden,
            "num_hidden_layers": self.need_u64(&k("block_count"))?,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "intermediate_size": ffn,
            "vocab_size": vocab,
            "rms_norm_eps": self.get(&k("attention.layer_norm_rms_epsilon")).and_then(MetaValue::as_f64).unwrap_or(1e-6),
            "rope_theta": self.get(&k("rope.freq_base")).and_then(MetaValue::as_f64).unwrap_or(10000.0),
            "max_position_embeddings": self.get(&k("context_length")).and_then(MetaValue::as_u64).unwrap_or(4096),
            "tie_word_embeddings": !self.tensors.contains_key("output.weight"),
            "hidden_act": "silu",
            "torch_dtype": float_dtype().name(),
        });
        if let Some(b) = bits {
            cfg["quantization"] = json!({"group_size": quant::GROUP, "bits": b});
        }
        if let Some(id) = self
            .get("tokenizer.ggml.bos_token_id")
            .and_then(MetaValue::as_u64)
        {
            cfg["bos_token_id"] = json!(id);
        }
        if let Some(id) = self
            .get("tokenizer.ggml.eos_token_id")
            .and_then(MetaValue::as_u64)
        {
            cfg["eos_token_id"] = json!(id);
        }
        Ok(cfg)
    }
}

/// GGUF tensor name → the HF name the model code uses.
pub fn hf_name(gguf: &str) -> Option<String> {
    let (base, suffix) = gguf.rsplit_once('.')?;
    let top = match base {
        "token_embd" => Some("model.embed_tokens".to_string()),
        "output_norm" => Some("model.norm".into()),
        "output" => Some("lm_head".into()),
        _ => None,
    };
    let hf = match top {
        Some(t) => t,
        None => {
            let rest = base.strip_prefix("blk.")?;
            let (layer, name) = rest.split_once('.')?;
            let n = match name {
                "attn_norm" => "input_layernorm",
                "ffn_norm" => "post_attention_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                _ => return None,
            };
            format!("model.layers.{layer}.{n}")
        }
    };
    Some(format!("{hf}.{suffix}"))
}

impl From<GgufError> for MlxError {
    fn from(e: GgufError) -> MlxError {
        MlxError::Invalid(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for (g, hf) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.3.attn_q.weight",
                "model.layers.3.self_attn.q_proj.weight",
            ),
            ("blk.3.attn_q.bias", "model.layers.3.self_attn.q_proj.bias"),
            (
                "blk.12.ffn_down.weight",
                "model.layers.12.mlp.down_proj.weight",
            ),
            (
                "blk.0.attn_k_norm.weight",
                "model.layers.0.self_attn.k_norm.weight",
            ),
            (
                "blk.0.ffn_norm.weight",
                "model.layers.0.post_attention_layernorm.weight",
            ),
        ] {
            assert_eq!(hf_name(g).as_deref(), Some(hf), "{g}");
            assert_eq!(split_name(hf).map(|x| x.0).as_deref(), Some(g), "{hf}");
        }
        assert_eq!(
            split_name("model.layers.3.self_attn.q_proj.scales"),
            Some(("blk.3.attn_q.weight".into(), Part::Scales))
        );
        assert!(split_name("model.layers.x.mlp.up_proj.weight").is_none());
        assert!(hf_name("blk.0.ffn_gate_exps.weight").is_none());
    }

    #[test]
    fn split_part_names() {
        let tmp = tempfile::Builder::new()
            .prefix("mlxcel-gguf-split-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        let p = |i: usize| dir.join(format!("m-q4-{i:05}-of-00003.gguf"));
        std::fs::write(p(1), b"").unwrap();
        std::fs::write(p(2), b"").unwrap();
        let e = split_parts(&p(1)).unwrap_err();
        assert!(e.to_string().contains("part 3 not found"), "{e}");
        std::fs::write(p(3), b"").unwrap();
        assert_eq!(split_parts(&p(1)).unwrap(), vec![p(1), p(2), p(3)]);
        let single = dir.join("model.gguf");
        assert_eq!(split_parts(&single).unwrap(), vec![single.clone()]);
    }
}
