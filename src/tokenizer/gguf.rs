//! The tokenizer of a GGUF model, from its `tokenizer.ggml.*` metadata.
//!
//! `tokenizer.ggml.model = gpt2` (byte-level BPE) is built as a `tokenizers` BPE model from
//! the file's tokens and merges; the pre-tokenizer follows `tokenizer.ggml.pre` as llama.cpp
//! splits text for it (see [`pre_tokenizer`]); tokens typed CONTROL (3) are special added
//! tokens and USER_DEFINED (4) plain added tokens, as llama.cpp matches both whole. BOS/EOS
//! ids, `add_bos_token` and `tokenizer.chat_template` come from the metadata too.
//! SentencePiece vocabularies (`llama`) are refused with a message.
use std::path::Path;

use serde_json::{json, Value};

use super::{Result, Tokenizer, TokenizerError};
use crate::gguf::{GgufFile, MetaValue};

/// llama.cpp's split for Llama 3 style vocabularies (as in HF's Llama 3 tokenizer.json).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's split for Qwen2 vocabularies (as in HF's Qwen2 tokenizer.json).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizers` pre-tokenizer for a `tokenizer.ggml.pre` value (`None`: not known).
pub fn pre_tokenizer(pre: &str) -> Option<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |re: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    Some(match pre {
        // GPT-2's regex
        "default" | "gpt2" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "poro-chat" => {
            byte_level(true)
        }
        // digits one by one, then GPT-2's regex (llama.cpp: `\p{N}` before the GPT-2 split)
        "smollm" | "starcoder" | "refact" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "smaug-bpe" | "dbrx" => {
            split(LLAMA3_SPLIT)
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" => split(QWEN2_SPLIT),
        _ => return None,
    })
}

fn strings(v: Option<&MetaValue>) -> Option<Vec<&str>> {
    v?.as_array()?.iter().map(MetaValue::as_str).collect()
}

/// The tokenizer of the GGUF file `path`; `model_config` is the config made from its
/// metadata (for `eos_token_id`).
pub fn from_gguf(path: &Path, model_config: &Value) -> Result<Tokenizer> {
    let bad = |message: String| TokenizerError::Load {
        path: path.to_path_buf(),
        message,
    };
    let f = GgufFile::open(path).map_err(|e| bad(e.to_string()))?;
    let model = f
        .get("tokenizer.ggml.model")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| bad("no `tokenizer.ggml.model` in the metadata".into()))?;
    if model != "gpt2" {
        return Err(bad(format!(
            "`tokenizer.ggml.model` = {model:?}: only byte-level BPE (`gpt2`) vocabularies are \
             implemented for GGUF (SentencePiece `llama` ones are not); use the model's Hugging Face \
             folder instead"
        )));
    }
    let pre_name = f
        .get("tokenizer.ggml.pre")
        .and_then(MetaValue::as_str)
        .unwrap_or("default");
    let pre = pre_tokenizer(pre_name).ok_or_else(|| {
        bad(format!(
            "`tokenizer.ggml.pre` = {pre_name:?} is not a pre-tokenizer mlxcel knows (known: \
             default/gpt2, smollm/starcoder/refact, llama3/llama-bpe, qwen2)"
        ))
    })?;
    let tokens = strings(f.get("tokenizer.ggml.tokens"))
        .ok_or_else(|| bad("no `tokenizer.ggml.tokens` string array".into()))?;
    let merges = strings(f.get("tokenizer.ggml.merges")).ok_or_else(|| {
        bad("no `tokenizer.ggml.merges` string array (a gpt2 vocabulary needs them)".into())
    })?;
    let types: Vec<u64> = f
        .get("tokenizer.ggml.token_type")
        .and_then(MetaValue::as_array)
        .map(|a| a.iter().filter_map(MetaValue::as_u64).collect())
        .unwrap_or_default();
    let id_of = |k: &str| f.get(k).and_then(MetaValue::as_u64).map(|x| x as usize);
    let name_of = |id: Option<usize>| id.and_then(|i| tokens.get(i)).map(|s| s.to_string());
    let bos = name_of(id_of("tokenizer.ggml.bos_token_id"));
    let eos = name_of(id_of("tokenizer.ggml.eos_token_id"));
    let add_bos = f
        .get("tokenizer.ggml.add_bos_token")
        .and_then(MetaValue::as_bool)
        .unwrap_or(false);

    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), json!(i)))
        .collect();
    let added: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter_map(|(i, t)| {
            let special = match types.get(i) {
                Some(3) => true,
                Some(4) => false,
                _ => return None,
            };
            Some(
                json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": !special, "special": special}),
            )
        })
        .collect();
    let post = match (&bos, add_bos) {
        (Some(b), true) => {
            let id = id_of("tokenizer.ggml.bos_token_id");
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {b.as_str(): {"id": b, "ids": [id], "tokens": [b]}}})
        }
        _ => Value::Null,
    };
    let ignore_merges = pre.to_string().contains("Split") && pre_name.starts_with("llama");
    let tok_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    });
    let bytes = serde_json::to_vec(&tok_json).map_err(|e| bad(e.to_string()))?;
    let tok = tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| bad(format!("building the BPE tokenizer: {e}")))?;
    let mut tok_cfg = json!({"clean_up_tokenization_spaces": false});
    if let Some(b) = &bos {
        tok_cfg["bos_token"] = json!(b);
    }
    if let Some(e) = &eos {
        tok_cfg["eos_token"] = json!(e);
    }
    if let Some(t) = f.get("tokenizer.chat_template").and_then(MetaValue::as_str) {
        tok_cfg["chat_template"] = json!(t);
    }
    let source = path.to_path_buf();
    Tokenizer::build(
        tok,
        false,
        &tok_cfg,
        &Value::Null,
        model_config,
        None,
        source,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::file::write;

    fn tiny_gguf(path: &Path, pre: &str, model: &str) {
        let s = |x: &str| MetaValue::Str(x.into());
        let list = |v: &[&str]| MetaValue::Array(v.iter().map(|x| s(x)).collect());
        // a byte-level vocabulary: "<|end|>", "a", "b", "ab", "Ġ", "Ġab", "1", "2"
        write(
            path,
            &[
                ("general.architecture", s("llama")),
                ("tokenizer.ggml.model", s(model)),
                ("tokenizer.ggml.pre", s(pre)),
                (
                    "tokenizer.ggml.tokens",
                    list(&["<|end|>", "a", "b", "ab", "Ġ", "Ġab", "1", "2", "12"]),
                ),
                ("tokenizer.ggml.merges", list(&["a b", "Ġ ab", "1 2"])),
                (
                    "tokenizer.ggml.token_type",
                    MetaValue::Array([3u64, 1, 1, 1, 1, 1, 1, 1, 1].map(MetaValue::U64).to_vec()),
                ),
                ("tokenizer.ggml.bos_token_id", MetaValue::U64(0)),
                ("tokenizer.ggml.eos_token_id", MetaValue::U64(0)),
                ("tokenizer.ggml.add_bos_token", MetaValue::Bool(true)),
                (
                    "tokenizer.chat_template",
                    s("{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"),
                ),
            ],
            &[],
        )
        .unwrap();
    }

    #[test]
    fn gpt2_vocabulary_from_metadata() {
        let tmp = tempfile::Builder::new()
            .prefix("mlxcel-gguf-tok-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        let p = dir.join("t.gguf");
        tiny_gguf(&p, "smollm", "gpt2");
        let t = Tokenizer::from_dir(&p, &json!({"eos_token_id": 0})).unwrap();
        // BOS added, merges applied, the control token kept whole, digits split one by one
        assert_eq!(t.encode("ab ab<|end|>", true).unwrap(), vec![0, 3, 5, 0]);
        assert_eq!(t.encode("12", false).unwrap(), vec![6, 7]);
        assert_eq!(t.decode(&[3, 5], false).unwrap(), "ab ab");
        assert_eq!(t.eos_token_ids(), &[0]);
        let msgs = [super::super::ChatMessage::new("user", "ab")];
        assert_eq!(t.apply_chat_template(&msgs, true).unwrap(), "ab<|end|>");
        // the default GPT-2 split keeps "12" whole
        tiny_gguf(&p, "gpt2", "gpt2");
        let t = Tokenizer::from_dir(&p, &Value::Null).unwrap();
        assert_eq!(t.encode("12", false).unwrap(), vec![8]);
        // a template file overrides the model's
        let tpl = dir.join("t.jinja");
        std::fs::write(&tpl, "X{{ messages[0].content }}").unwrap();
        let t2 = t.with_chat_template_file(&tpl).unwrap();
        assert_eq!(t2.apply_chat_template(&msgs, true).unwrap(), "Xab");
        // refusals name what is missing
        tiny_gguf(&p, "weird-pre", "gpt2");
        let e = Tokenizer::from_dir(&p, &Value::Null)
            .unwrap_err()
            .to_string();
        assert!(e.contains("weird-pre"), "{e}");
        tiny_gguf(&p, "default", "llama");
        let e = Tokenizer::from_dir(&p, &Value::Null)
            .unwrap_err()
            .to_string();
        assert!(e.contains("SentencePiece"), "{e}");
    }
}
