//! The built-in demo model used when no `-m` is given: a small Llama-family
//! model (8 heads, 4 KV heads, so it also shards 2 and 4 ways) with seeded
//! random weights and a byte-level tokenizer, written deterministically into
//! the cache on first use. Its text is not meaningful: it exists so that every
//! command works on a fresh machine without downloads.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use serde_json::json;

/// Bump when anything written here changes, so old caches are not reused.
const DEMO_VERSION: &str = "demo-llama-v2";
const SPECIALS: &[&str] = &[
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
];
const HIDDEN: usize = 256;
const LAYERS: usize = 4;
const HEADS: usize = 8;
const KV_HEADS: usize = 4;
const INTERMEDIATE: usize = 512;
const VOCAB: usize = 264; // 256 bytes + 5 specials, padded
const CONTEXT: usize = 8192;

const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";

/// Where the demo model lives: `$MLXCEL_CACHE` or `~/.cache/mlxcel`, then `demo-llama-v2/`.
pub fn demo_dir() -> PathBuf {
    crate::cache_root().join(DEMO_VERSION)
}

/// The demo model folder, written on first use.
pub fn ensure_demo_model() -> std::io::Result<PathBuf> {
    let dir = demo_dir();
    if dir.join(".complete").is_file() {
        return Ok(dir);
    }
    let tmp = dir.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    write_demo(&tmp)?;
    std::fs::write(tmp.join(".complete"), DEMO_VERSION)?;
    let _ = std::fs::remove_dir_all(&dir);
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // another process won the race: use its copy
        Err(_) if dir.join(".complete").is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(e),
    }
}

fn write_json(path: &Path, v: &serde_json::Value) -> std::io::Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v).expect("json"))
}

fn write_demo(dir: &Path) -> std::io::Result<()> {
    let bos = 256;
    let eot = 260;
    write_json(
        &dir.join("config.json"),
        &json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "intermediate_size": INTERMEDIATE,
            "vocab_size": VOCAB,
            "max_position_embeddings": CONTEXT,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": false,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": bos,
            "eos_token_id": [257, eot],
        }),
    )?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({"bos_token_id": bos, "eos_token_id": [257, eot]}),
    )?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": false,
            "model_max_length": CONTEXT,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }),
    )?;
    write_json(&dir.join("tokenizer.json"), &tokenizer_json())?;
    write_weights(&dir.join("model.safetensors"))
}

/// GPT-2's reversible byte → printable character map used by byte-level BPE.
fn bytes_to_unicode() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut map = vec!['\0'; 256];
    for (b, c) in printable.iter().zip(chars) {
        map[*b as usize] = char::from_u32(c).expect("valid char");
    }
    map
}

fn tokenizer_json() -> serde_json::Value {
    let map = bytes_to_unicode();
    let vocab: BTreeMap<String, usize> = map
        .iter()
        .enumerate()
        .map(|(b, c)| (c.to_string(), b))
        .collect();
    let added: Vec<_> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| json!({"id": 256 + i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let bos = SPECIALS[0];
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [256], "tokens": [bos]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
}

fn write_weights(path: &Path) -> std::io::Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6d6c7863656c);
    let mut normal = |n: usize, std: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                // Box-Muller
                let u1: f32 = rng.random_range(f32::EPSILON..1.0);
                let u2: f32 = rng.random();
                (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos() * std
            })
            .collect()
    };
    let hd = HIDDEN / HEADS;
    let s = (HIDDEN as f32).powf(-0.5);
    // Hidden dimension 0 is a constant "bias channel": every embedding holds 4.0 there and
    // no layer writes to it (row 0 of o_proj and down_proj is zero), so after the final norm
    // it is a positive constant, and lm_head's column 0 then favours printable ASCII. The
    // text stays meaningless, but it is readable rather than a stream of invalid bytes.
    let mut embed = normal(VOCAB * HIDDEN, 1.0);
    for t in 0..VOCAB {
        embed[t * HIDDEN] = 4.0;
    }
    let zero_row0 = |mut w: Vec<f32>| {
        let cols = w.len() / HIDDEN;
        w[..cols].iter_mut().for_each(|x| *x = 0.0);
        w
    };
    let mut lm_head = normal(VOCAB * HIDDEN, 2.0 * s);
    for t in 0..VOCAB {
        let printable = t < 256 && ((0x20..0x7f).contains(&t) || t == b'\n' as usize);
        lm_head[t * HIDDEN] = if printable { 1.5 } else { -3.0 };
    }
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    tensors.push((
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        embed,
    ));
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        tensors.push((
            format!("{p}.self_attn.q_proj.weight"),
            vec![HEADS * hd, HIDDEN],
            normal(HEADS * hd * HIDDEN, s),
        ));
        tensors.push((
            format!("{p}.self_attn.k_proj.weight"),
            vec![KV_HEADS * hd, HIDDEN],
            normal(KV_HEADS * hd * HIDDEN, s),
        ));
        tensors.push((
            format!("{p}.self_attn.v_proj.weight"),
            vec![KV_HEADS * hd, HIDDEN],
            normal(KV_HEADS * hd * HIDDEN, s),
        ));
        tensors.push((
            format!("{p}.self_attn.o_proj.weight"),
            vec![HIDDEN, HEADS * hd],
            zero_row0(normal(HIDDEN * HEADS * hd, s)),
        ));
        tensors.push((
            format!("{p}.mlp.gate_proj.weight"),
            vec![INTERMEDIATE, HIDDEN],
            normal(INTERMEDIATE * HIDDEN, s),
        ));
        tensors.push((
            format!("{p}.mlp.up_proj.weight"),
            vec![INTERMEDIATE, HIDDEN],
            normal(INTERMEDIATE * HIDDEN, s),
        ));
        tensors.push((
            format!("{p}.mlp.down_proj.weight"),
            vec![HIDDEN, INTERMEDIATE],
            zero_row0(normal(
                HIDDEN * INTERMEDIATE,
                (INTERMEDIATE as f32).powf(-0.5),
            )),
        ));
        tensors.push((
            format!("{p}.input_layernorm.weight"),
            vec![HIDDEN],
            vec![1.0; HIDDEN],
        ));
        tensors.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![HIDDEN],
            vec![1.0; HIDDEN],
        ));
    }
    tensors.push(("model.norm.weight".into(), vec![HIDDEN], vec![1.0; HIDDEN]));
    tensors.push(("lm_head.weight".into(), vec![VOCAB, HIDDEN], lm_head));
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, shape, v)| (n, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, shape, data)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .expect("valid view"),
            )
        })
        .collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path).map_err(std::io::Error::other)
}
