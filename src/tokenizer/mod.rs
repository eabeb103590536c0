//! Tokenizer of a model folder.
//!
//! This module owns [`Tokenizer`]: a cheap-to-clone wrapper around a Hugging Face
//! `tokenizers::Tokenizer` loaded from a model folder's `tokenizer.json`, together with what the
//! folder's `tokenizer_config.json`, `generation_config.json`, `chat_template.jinja` and the
//! model's `config.json` say about special tokens, end-of-sequence ids, decoding clean-up, the
//! chat template and sampling defaults. Encoding/decoding match HF `transformers`
//! (`tokenizer(text)`, `tokenizer.decode(ids)`); chat rendering lives in [`chat`], streaming
//! detokenization and stop strings in [`stream`].

pub mod chat;
pub mod gguf;
pub mod reasoning;
pub mod stream;
pub mod tool_calls;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

pub use chat::{ChatError, ChatMessage, ChatTemplate};
pub use stream::{StopMatcher, StopOutput, StreamDecoder};

/// The fast-tokenizer file of a model folder (required).
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Special tokens, chat template and decode options (optional).
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Sampling defaults and extra `eos_token_id`s (optional).
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// A chat template kept in its own file; overrides tokenizer_config.json's (optional).
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// Errors from loading or using a [`Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "{} not found: the model folder needs a fast (Hugging Face `tokenizers`) tokenizer; \
         re-save it with transformers' `AutoTokenizer.from_pretrained(...).save_pretrained(...)`",
        .0.display()
    )]
    MissingTokenizerJson(PathBuf),
    #[error("cannot load {}: {message}; check that it is a valid `tokenizers` JSON file", path.display())]
    Load { path: PathBuf, message: String },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not valid JSON: {source}; fix or remove the file", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("tokenizer failed to encode the text: {0}")]
    Encode(String),
    #[error("tokenizer failed to decode ids: {0}")]
    Decode(String),
    #[error(
        "this model has no chat template: {} has no `chat_template` field and the folder has no \
         {CHAT_TEMPLATE_FILE}; send a raw prompt instead, or add a template",
        .0.display()
    )]
    NoChatTemplate(PathBuf),
    #[error("the chat template of {} cannot be used: {message}", path.display())]
    BadChatTemplate { path: PathBuf, message: String },
    #[error(transparent)]
    Chat(#[from] ChatError),
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// Sampling defaults from `generation_config.json` (each `None` when absent).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub max_new_tokens: Option<usize>,
}

impl GenerationDefaults {
    fn from_json(v: &Value) -> Self {
        let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
        let u = |k: &str| {
            v.get(k)
                .and_then(Value::as_u64)
                .and_then(|x| usize::try_from(x).ok())
        };
        Self {
            do_sample: v.get("do_sample").and_then(Value::as_bool),
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: u("top_k"),
            repetition_penalty: f("repetition_penalty"),
            max_new_tokens: u("max_new_tokens"),
        }
    }
}

/// How decoding treats one id; see [`Tokenizer::stream_class`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TokenClass {
    /// Not decoded at all (unknown id, or a special token while skipping them).
    Dropped,
    /// A `<0xNN>` byte token of a `ByteFallback` decoder: joined with neighbouring byte tokens
    /// before UTF-8 decoding, all-or-nothing.
    Byte,
    Normal,
}

#[derive(Debug)]
enum ChatState {
    Ready(Box<ChatTemplate>),
    Missing,
    Unusable(String),
}

#[derive(Debug)]
struct Inner {
    tok: tokenizers::Tokenizer,
    eos_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    clean_up_spaces: bool,
    /// The decoder has a `ByteFallback` step (`<0xNN>` tokens are grouped before UTF-8 decoding).
    byte_fallback: bool,
    chat: ChatState,
    chat_source: PathBuf,
    generation: GenerationDefaults,
    /// The special-token variables every chat-template render gets.
    specials: serde_json::Map<String, Value>,
}

/// A model's tokenizer. Cloning is cheap (shared, immutable state).
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

/// Reads and parses an optional JSON file: `Ok(None)` when it does not exist.
fn read_json_opt(path: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|source| TokenizerError::Json {
                path: path.to_path_buf(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// A special-token entry of tokenizer_config.json: `"<s>"` or `{"content": "<s>", ...}`.
fn token_content(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `eos_token_id` as an int or a list of ints.
fn id_list(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// HF `clean_up_tokenization` (applied by `decode` when `clean_up_tokenization_spaces` is set).
pub(crate) fn clean_up_tokenization(s: &str) -> String {
    s.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

impl Tokenizer {
    /// Loads the tokenizer of the model folder `dir`. `model_config` is the parsed `config.json`
    /// (used for `eos_token_id`; pass `Value::Null` if unavailable).
    /// A GGUF model (`dir` is its `.gguf` file): the tokenizer of its metadata.
    pub fn from_dir(dir: &Path, model_config: &Value) -> Result<Tokenizer> {
        if dir.is_file() && crate::gguf::is_gguf(dir) {
            return gguf::from_gguf(dir, model_config);
        }
        let tok_path = dir.join(TOKENIZER_FILE);
        if !tok_path.is_file() {
            return Err(TokenizerError::MissingTokenizerJson(tok_path));
        }
        let bytes = std::fs::read(&tok_path).map_err(|source| TokenizerError::Read {
            path: tok_path.clone(),
            source,
        })?;
        let tok = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Load {
            path: tok_path.clone(),
            message: e.to_string(),
        })?;

        let byte_fallback = tok
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .is_some_and(|s| s.contains("\"ByteFallback\""));

        let cfg_path = dir.join(TOKENIZER_CONFIG_FILE);
        let tok_cfg = read_json_opt(&cfg_path)?.unwrap_or_else(|| {
            tracing::warn!(
                "{} not found; no chat template or special-token names",
                cfg_path.display()
            );
            Value::Null
        });
        let gen_cfg = read_json_opt(&dir.join(GENERATION_CONFIG_FILE))?.unwrap_or(Value::Null);
        Self::build(
            tok,
            byte_fallback,
            &tok_cfg,
            &gen_cfg,
            model_config,
            Some(&dir.join(CHAT_TEMPLATE_FILE)),
            cfg_path,
        )
    }

    /// The tokenizer of `tok` with what tokenizer_config.json (`tok_cfg`), generation_config
    /// .json and config.json say; the chat template from `jinja` when that file exists, else
    /// from `tok_cfg` (whose source is named `cfg_path` in messages).
    fn build(
        tok: tokenizers::Tokenizer,
        byte_fallback: bool,
        tok_cfg: &Value,
        gen_cfg: &Value,
        model_config: &Value,
        jinja: Option<&Path>,
        cfg_path: PathBuf,
    ) -> Result<Tokenizer> {
        let bos_token = tok_cfg.get("bos_token").and_then(token_content);
        let eos_token = tok_cfg.get("eos_token").and_then(token_content);

        let mut eos_ids = Vec::new();
        let cfg_eos = model_config.get("eos_token_id").or_else(|| {
            model_config
                .get("text_config")
                .and_then(|t| t.get("eos_token_id"))
        });
        let mut candidates = id_list(cfg_eos);
        candidates.extend(id_list(gen_cfg.get("eos_token_id")));
        if let Some(t) = &eos_token {
            match tok.token_to_id(t) {
                Some(id) => candidates.push(id),
                None => tracing::warn!(
                    "{}: eos_token {t:?} is not in the vocabulary",
                    cfg_path.display()
                ),
            }
        }
        for id in candidates {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }

        let clean_up_spaces = tok_cfg
            .get("clean_up_tokenization_spaces")
            .and_then(Value::as_bool)
            .unwrap_or(false);

        // Special tokens visible to the chat template (HF `special_tokens_map`).
        let mut specials = serde_json::Map::new();
        for key in SPECIAL_TOKEN_KEYS {
            if let Some(t) = tok_cfg.get(key).and_then(token_content) {
                specials.insert(key.to_string(), Value::String(t));
            }
        }
        if let Some(Value::Array(extra)) = tok_cfg.get("additional_special_tokens") {
            let list: Vec<Value> = extra
                .iter()
                .filter_map(token_content)
                .map(Value::String)
                .collect();
            specials.insert("additional_special_tokens".into(), Value::Array(list));
        }

        let (chat, chat_source) = load_chat_template(jinja, &cfg_path, tok_cfg, &specials)?;
        if let ChatState::Unusable(msg) = &chat {
            tracing::warn!("chat template of {} unusable: {msg}", chat_source.display());
        }

        Ok(Tokenizer {
            inner: Arc::new(Inner {
                tok,
                eos_ids,
                bos_token,
                eos_token,
                clean_up_spaces,
                byte_fallback,
                chat,
                chat_source,
                generation: GenerationDefaults::from_json(gen_cfg),
                specials,
            }),
        })
    }

    /// This tokenizer with the chat template read from `path` (`--chat-template FILE`),
    /// whatever the model has.
    pub fn with_chat_template_file(&self, path: &Path) -> Result<Tokenizer> {
        let source = std::fs::read_to_string(path).map_err(|source| TokenizerError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let i = &self.inner;
        let chat = ChatTemplate::new(&source, &i.specials).map_err(|e| {
            TokenizerError::BadChatTemplate {
                path: path.to_path_buf(),
                message: e.to_string(),
            }
        })?;
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                tok: i.tok.clone(),
                eos_ids: i.eos_ids.clone(),
                bos_token: i.bos_token.clone(),
                eos_token: i.eos_token.clone(),
                clean_up_spaces: i.clean_up_spaces,
                byte_fallback: i.byte_fallback,
                chat: ChatState::Ready(Box::new(chat)),
                chat_source: path.to_path_buf(),
                generation: i.generation.clone(),
                specials: i.specials.clone(),
            }),
        })
    }

    /// Token ids of `text`; equals HF `tokenizer(text, add_special_tokens=...)["input_ids"]`
    /// (with `true`, the post-processor adds e.g. Llama-3's BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .tok
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    /// Text of `ids`; equals HF `tokenizer.decode(ids, skip_special_tokens=...)`, including
    /// `clean_up_tokenization_spaces` when tokenizer_config.json sets it.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let raw = self.decode_raw(ids, skip_special_tokens)?;
        Ok(if self.inner.clean_up_spaces {
            clean_up_tokenization(&raw)
        } else {
            raw
        })
    }

    /// Decoding without HF's clean-up step.
    pub(crate) fn decode_raw(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .tok
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// How `decode` treats `id` (for streaming).
    pub(crate) fn stream_class(&self, id: u32, skip_special_tokens: bool) -> TokenClass {
        let tok = &self.inner.tok;
        let Some(piece) = tok.id_to_token(id) else {
            return TokenClass::Dropped;
        };
        if skip_special_tokens && tok.get_added_vocabulary().is_special_token(&piece) {
            return TokenClass::Dropped;
        }
        let b = piece.as_bytes();
        if self.inner.byte_fallback
            && b.len() == 6
            && piece.starts_with("<0x")
            && b[5] == b'>'
            && b[3..5].iter().all(u8::is_ascii_hexdigit)
        {
            TokenClass::Byte
        } else {
            TokenClass::Normal
        }
    }

    /// Whether `decode` applies HF's `clean_up_tokenization` (tokenizer_config.json
    /// `clean_up_tokenization_spaces`, default false).
    pub fn clean_up_tokenization_spaces(&self) -> bool {
        self.inner.clean_up_spaces
    }

    /// End-of-sequence ids: union (in this order, deduplicated) of config.json `eos_token_id`,
    /// generation_config.json `eos_token_id` and tokenizer_config.json `eos_token`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos_ids
    }

    /// `bos_token` of tokenizer_config.json, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.inner.bos_token.as_deref()
    }

    /// `eos_token` of tokenizer_config.json, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.inner.eos_token.as_deref()
    }

    /// Id of `bos_token`, if it is in the vocabulary.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token().and_then(|t| self.token_to_id(t))
    }

    /// Number of tokens including added tokens (HF `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.tok.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tok.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tok.id_to_token(id)
    }

    /// Sampling defaults from generation_config.json.
    pub fn generation_defaults(&self) -> &GenerationDefaults {
        &self.inner.generation
    }

    /// Whether the folder has a usable chat template.
    pub fn has_chat_template(&self) -> bool {
        matches!(self.inner.chat, ChatState::Ready(_))
    }

    /// Renders `messages` with the model's chat template, byte-identical to HF
    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with(messages, add_generation_prompt, &Value::Null)
    }

    /// Like [`apply_chat_template`](Self::apply_chat_template) with extra template variables
    /// (a JSON object, e.g. `{"enable_thinking": false}`).
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &Value,
    ) -> Result<String> {
        match &self.inner.chat {
            ChatState::Ready(t) => Ok(t.render_with(messages, add_generation_prompt, extra)?),
            ChatState::Missing => Err(TokenizerError::NoChatTemplate(
                self.inner.chat_source.clone(),
            )),
            ChatState::Unusable(message) => Err(TokenizerError::BadChatTemplate {
                path: self.inner.chat_source.clone(),
                message: message.clone(),
            }),
        }
    }

    /// Prompt ids of a conversation: the rendered template encoded without adding special
    /// tokens (the template already has them), as HF `apply_chat_template(tokenize=True)`.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, add_generation_prompt)?;
        self.encode(&text, false)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner.tok
    }
}

/// Finds the chat template: `chat_template.jinja` (which, as in transformers, overrides the
/// config), else tokenizer_config.json `chat_template` (a string, or a list of
/// `{name, template}` from which "default" is used). Returns the state and the file it came from
/// (or should have come from).
fn load_chat_template(
    jinja: Option<&Path>,
    cfg_path: &Path,
    tok_cfg: &Value,
    specials: &serde_json::Map<String, Value>,
) -> Result<(ChatState, PathBuf)> {
    let jinja_path = jinja.map(Path::to_path_buf).unwrap_or_default();
    let read = match jinja {
        Some(p) => std::fs::read_to_string(p),
        None => Err(std::io::ErrorKind::NotFound.into()),
    };
    let (source, from) = match read {
        Ok(s) => (s, jinja_path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match tok_cfg.get("chat_template") {
            None | Some(Value::Null) => return Ok((ChatState::Missing, cfg_path.to_path_buf())),
            Some(Value::String(s)) => (s.clone(), cfg_path.to_path_buf()),
            Some(Value::Array(list)) => {
                let found = list
                    .iter()
                    .find(|e| e.get("name").and_then(Value::as_str) == Some("default"));
                match found
                    .and_then(|e| e.get("template"))
                    .and_then(Value::as_str)
                {
                    Some(s) => (s.to_string(), cfg_path.to_path_buf()),
                    None => {
                        let names: Vec<&str> = list
                            .iter()
                            .filter_map(|e| e.get("name").and_then(Value::as_str))
                            .collect();
                        let msg = format!(
                            "`chat_template` is a list with no entry named \"default\" \
                                 (names: {names:?})"
                        );
                        return Ok((ChatState::Unusable(msg), cfg_path.to_path_buf()));
                    }
                }
            }
            Some(_) => {
                let msg =
                    "`chat_template` must be a string or a list of {name, template}".to_string();
                return Ok((ChatState::Unusable(msg), cfg_path.to_path_buf()));
            }
        },
        Err(source) => {
            return Err(TokenizerError::Read {
                path: jinja_path,
                source,
            })
        }
    };
    let state = match ChatTemplate::new(&source, specials) {
        Ok(t) => ChatState::Ready(Box::new(t)),
        Err(e) => ChatState::Unusable(e.to_string()),
    };
    Ok((state, from))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    /// A fresh empty folder under the system temp dir, removed when the guard drops.
    pub(crate) fn temp_dir(tag: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("mlxcel-tok-test-{tag}-"))
            .tempdir()
            .expect("create temp dir")
    }

    /// A byte-level BPE tokenizer (GPT-2 / Llama-3 style): all 256 byte symbols, a few merges,
    /// and specials `<|begin_of_text|>` (BOS via post-processor) and `<|eot_id|>`.
    pub(crate) fn byte_level_json() -> String {
        // GPT-2 bytes_to_unicode
        let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
            .chain(0xA1..=0xAC)
            .chain(0xAE..=0xFF)
            .collect();
        let mut cs = bs.clone();
        let mut n = 0;
        for b in 0..256u32 {
            if !bs.contains(&b) {
                bs.push(b);
                cs.push(256 + n);
                n += 1;
            }
        }
        let mut pairs: Vec<(u32, char)> = bs
            .iter()
            .zip(cs.iter())
            .map(|(b, c)| (*b, char::from_u32(*c).unwrap()))
            .collect();
        pairs.sort();
        let mut vocab = serde_json::Map::new();
        for (i, (_, c)) in pairs.iter().enumerate() {
            vocab.insert(c.to_string(), serde_json::json!(i));
        }
        let merges = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "Ġ w", "o r"];
        for (i, m) in merges.iter().enumerate() {
            let tok: String = m.split(' ').collect();
            vocab.insert(tok, serde_json::json!(256 + i));
        }
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 263, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 264, "content": "<|eot_id|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [263], "tokens": ["<|begin_of_text|>"]}}
            },
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
        })
        .to_string()
    }

    /// A SentencePiece-style (Llama-2 / Mistral) BPE with byte fallback and Metaspace-like
    /// decoding (Replace ▁, ByteFallback, Fuse, Strip).
    pub(crate) fn metaspace_json() -> String {
        let mut vocab = serde_json::Map::new();
        vocab.insert("<unk>".into(), serde_json::json!(0));
        vocab.insert("<s>".into(), serde_json::json!(1));
        vocab.insert("</s>".into(), serde_json::json!(2));
        for b in 0..256u32 {
            vocab.insert(format!("<0x{b:02X}>"), serde_json::json!(3 + b));
        }
        let pieces = [
            "▁", "H", "e", "l", "o", "w", "r", "d", "▁w", "▁H", "ll", "llo", "▁Hello", "n", "'",
            "t", ".",
        ];
        let mut id = 259;
        for p in pieces {
            vocab.insert(p.into(), serde_json::json!(id));
            id += 1;
        }
        let merges = ["▁ w", "▁ H", "l l", "ll o", "▁H e", "▁He llo"];
        vocab.insert("▁He".into(), serde_json::json!(id));
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null,
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
            },
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges}
        })
        .to_string()
    }

    /// Writes a model folder with the given tokenizer JSON and tokenizer_config.
    /// The folder is removed when the returned guard drops.
    pub(crate) fn write_folder(tag: &str, tok_json: &str, tok_cfg: &Value) -> tempfile::TempDir {
        let d = temp_dir(tag);
        std::fs::write(d.path().join(TOKENIZER_FILE), tok_json).unwrap();
        std::fs::write(d.path().join(TOKENIZER_CONFIG_FILE), tok_cfg.to_string()).unwrap();
        d
    }

    pub(crate) fn byte_level_tokenizer(clean_up: bool) -> Tokenizer {
        let cfg = serde_json::json!({
            "bos_token": "<|begin_of_text|>",
            "eos_token": {"content": "<|eot_id|>", "special": true},
            "clean_up_tokenization_spaces": clean_up,
            "chat_template": "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
        });
        let d = write_folder("bl", &byte_level_json(), &cfg);
        Tokenizer::from_dir(d.path(), &serde_json::json!({"eos_token_id": [264, 5]})).unwrap()
    }

    pub(crate) fn metaspace_tokenizer() -> Tokenizer {
        let cfg = serde_json::json!({"bos_token": "<s>", "eos_token": "</s>"});
        let d = write_folder("ms", &metaspace_json(), &cfg);
        Tokenizer::from_dir(d.path(), &serde_json::json!({"eos_token_id": 2})).unwrap()
    }

    #[test]
    fn shareable_across_threads() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Tokenizer>();
        check::<StreamDecoder>();
        check::<StopMatcher>();
        check::<TokenizerError>();
    }

    #[test]
    fn missing_tokenizer_json_names_path() {
        let d = temp_dir("missing");
        let err = Tokenizer::from_dir(d.path(), &Value::Null).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, TokenizerError::MissingTokenizerJson(_)));
        assert!(
            msg.contains(&d.path().join("tokenizer.json").display().to_string()),
            "{msg}"
        );
    }

    #[test]
    fn bad_json_names_file() {
        let d = write_folder("badcfg", &byte_level_json(), &Value::Null);
        std::fs::write(d.path().join(TOKENIZER_CONFIG_FILE), "{not json").unwrap();
        let msg = Tokenizer::from_dir(d.path(), &Value::Null)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("tokenizer_config.json"), "{msg}");
        std::fs::write(d.path().join(TOKENIZER_FILE), "{}").unwrap();
        let msg = Tokenizer::from_dir(d.path(), &Value::Null)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("tokenizer.json"), "{msg}");
    }

    #[test]
    fn byte_level_roundtrip_and_bos() {
        let t = byte_level_tokenizer(false);
        let with = t.encode("hello the world", true).unwrap();
        let without = t.encode("hello the world", false).unwrap();
        assert_eq!(with[0], 263);
        assert_eq!(&with[1..], &without[..]);
        assert_eq!(t.decode(&with, true).unwrap(), "hello the world");
        assert_eq!(
            t.decode(&with, false).unwrap(),
            "<|begin_of_text|>hello the world"
        );
        let multi = "héllo 日本 🦀";
        assert_eq!(
            t.decode(&t.encode(multi, false).unwrap(), false).unwrap(),
            multi
        );
        assert_eq!(t.vocab_size(), 265); // 256 bytes + 7 merges + 2 added
    }

    #[test]
    fn eos_union_and_specials() {
        let t = byte_level_tokenizer(false);
        assert_eq!(t.eos_token_ids(), &[264, 5]);
        assert_eq!(t.bos_token(), Some("<|begin_of_text|>"));
        assert_eq!(t.eos_token(), Some("<|eot_id|>"));
        assert_eq!(t.bos_token_id(), Some(263));
        assert_eq!(t.token_to_id("<|eot_id|>"), Some(264));
        assert_eq!(t.id_to_token(264).as_deref(), Some("<|eot_id|>"));

        let d = write_folder(
            "eos",
            &byte_level_json(),
            &serde_json::json!({"eos_token": "<|begin_of_text|>"}),
        );
        std::fs::write(
            d.path().join(GENERATION_CONFIG_FILE),
            r#"{"eos_token_id": [7, 264], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": true}"#,
        )
        .unwrap();
        let t = Tokenizer::from_dir(d.path(), &serde_json::json!({"eos_token_id": 264})).unwrap();
        assert_eq!(t.eos_token_ids(), &[264, 7, 263]);
        let g = t.generation_defaults();
        assert_eq!(g.temperature, Some(0.6));
        assert_eq!(g.top_p, Some(0.9));
        assert_eq!(g.top_k, Some(20));
        assert_eq!(g.do_sample, Some(true));
        assert_eq!(g.repetition_penalty, None);
        assert_eq!(g.max_new_tokens, None);
    }

    #[test]
    fn chat_template_sources() {
        let t = byte_level_tokenizer(false);
        let msgs = [ChatMessage::new("user", " hi ")];
        assert_eq!(
            t.apply_chat_template(&msgs, true).unwrap(),
            "<|begin_of_text|><user>hi<|eot_id|><assistant>"
        );
        let ids = t.encode_chat(&msgs, true).unwrap();
        assert_eq!(ids[0], 263);
        assert_eq!(ids.iter().filter(|&&i| i == 263).count(), 1);

        // no template
        let d = write_folder("nochat", &byte_level_json(), &serde_json::json!({}));
        let t = Tokenizer::from_dir(d.path(), &Value::Null).unwrap();
        assert!(!t.has_chat_template());
        let msg = t.apply_chat_template(&msgs, true).unwrap_err().to_string();
        assert!(
            msg.contains("tokenizer_config.json") && msg.contains("chat_template"),
            "{msg}"
        );

        // list form, and chat_template.jinja overriding it
        let cfg = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D{{ messages | length }}"}
        ]});
        let d = write_folder("list", &byte_level_json(), &cfg);
        let t = Tokenizer::from_dir(d.path(), &Value::Null).unwrap();
        assert_eq!(t.apply_chat_template(&msgs, true).unwrap(), "D1");
        std::fs::write(
            d.path().join(CHAT_TEMPLATE_FILE),
            "J{{ messages[0].role }}\n",
        )
        .unwrap();
        let t = Tokenizer::from_dir(d.path(), &Value::Null).unwrap();
        assert_eq!(t.apply_chat_template(&msgs, true).unwrap(), "Juser");

        // list without default
        let cfg = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"}]});
        let d = write_folder("nodefault", &byte_level_json(), &cfg);
        let t = Tokenizer::from_dir(d.path(), &Value::Null).unwrap();
        let msg = t.apply_chat_template(&msgs, true).unwrap_err().to_string();
        assert!(msg.contains("default") && msg.contains("tool_use"), "{msg}");

        // broken template: loads, but using it errors
        let cfg = serde_json::json!({"chat_template": "{% if %}"});
        let d = write_folder("broken", &byte_level_json(), &cfg);
        let t = Tokenizer::from_dir(d.path(), &Value::Null).unwrap();
        assert!(matches!(
            t.apply_chat_template(&msgs, true),
            Err(TokenizerError::BadChatTemplate { .. })
        ));
    }

    #[test]
    fn clean_up_spaces_applied() {
        let t = byte_level_tokenizer(true);
        let ids = t.encode("I do n't know , he 's here .", false).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), "I don't know, he's here.");
        let t = byte_level_tokenizer(false);
        assert_eq!(
            t.decode(&ids, false).unwrap(),
            "I do n't know , he 's here ."
        );
    }

    #[test]
    fn metaspace_prefix_and_byte_fallback() {
        let t = metaspace_tokenizer();
        let ids = t.encode("Hello world", true).unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(t.decode(&ids, true).unwrap(), "Hello world");
        let ids = t.encode("Hé 🦀", false).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), "Hé 🦀");
        assert_eq!(t.eos_token_ids(), &[2]);
    }

    // ---- reference fixtures (tests/fixtures/*/reference.json, made by HF transformers) ----

    pub(crate) const FIXTURES: [&str; 6] = [
        "llama3",
        "llama_gqa2_tied",
        "llama_q4",
        "mistral",
        "qwen2",
        "qwen3",
    ];

    pub(crate) fn fixture_dir(name: &str) -> PathBuf {
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures")).join(name)
    }

    fn read_json(path: &Path) -> Value {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("fixture {} unreadable: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The fixture's tokenizer and its reference.json.
    pub(crate) fn load_fixture(name: &str) -> (Tokenizer, Value) {
        let dir = fixture_dir(name);
        let config = read_json(&dir.join("config.json"));
        let tok =
            Tokenizer::from_dir(&dir, &config).unwrap_or_else(|e| panic!("fixture {name}: {e}"));
        (tok, read_json(&dir.join("reference.json")))
    }

    pub(crate) fn ids_of(v: &Value) -> Vec<u32> {
        v.as_array()
            .expect("ids array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    }

    pub(crate) fn cases<'a>(r: &'a Value, key: &str) -> &'a Vec<Value> {
        let c = r[key].as_array().expect("reference array");
        assert!(!c.is_empty(), "no {key} cases");
        c
    }

    #[test]
    fn fixtures_encode_prompts() {
        for name in FIXTURES {
            let (tok, r) = load_fixture(name);
            for p in cases(&r, "prompts") {
                let text = p["text"].as_str().unwrap();
                assert_eq!(
                    tok.encode(text, true).unwrap(),
                    ids_of(&p["ids"]),
                    "{name}: {text:?}"
                );
            }
        }
    }

    #[test]
    fn fixtures_chat_rendering() {
        for name in FIXTURES {
            let (tok, r) = load_fixture(name);
            for c in cases(&r, "chat") {
                let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
                let rendered = tok
                    .apply_chat_template(&msgs, true)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(
                    rendered,
                    c["rendered"].as_str().unwrap(),
                    "{name}: {msgs:?}"
                );
                assert_eq!(
                    tok.encode(&rendered, false).unwrap(),
                    ids_of(&c["ids"]),
                    "{name}"
                );
                assert_eq!(
                    tok.encode_chat(&msgs, true).unwrap(),
                    ids_of(&c["ids"]),
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn fixtures_decode() {
        for name in FIXTURES {
            let (tok, r) = load_fixture(name);
            for d in cases(&r, "decode") {
                let skip = d["skip_special_tokens"].as_bool().unwrap();
                let ids = ids_of(&d["ids"]);
                assert_eq!(
                    tok.decode(&ids, skip).unwrap(),
                    d["text"].as_str().unwrap(),
                    "{name}: {ids:?} skip={skip}"
                );
            }
        }
    }

    #[test]
    fn fixtures_special_tokens() {
        let expect: [(&str, &[u32], Option<&str>, &str); 6] = [
            (
                "llama3",
                &[377, 380],
                Some("<|begin_of_text|>"),
                "<|eot_id|>",
            ),
            (
                "llama_gqa2_tied",
                &[377, 380],
                Some("<|begin_of_text|>"),
                "<|eot_id|>",
            ),
            (
                "llama_q4",
                &[377, 380],
                Some("<|begin_of_text|>"),
                "<|eot_id|>",
            ),
            (
                "mistral",
                &[377],
                Some("<|begin_of_text|>"),
                "<|end_of_text|>",
            ),
            ("qwen2", &[382, 383], None, "<|im_end|>"),
            ("qwen3", &[382, 383], None, "<|im_end|>"),
        ];
        for (name, eos, bos, eos_tok) in expect {
            let (tok, r) = load_fixture(name);
            assert_eq!(tok.eos_token_ids(), eos, "{name}");
            assert_eq!(tok.bos_token(), bos, "{name}");
            assert_eq!(tok.eos_token(), Some(eos_tok), "{name}");
            assert_eq!(
                tok.vocab_size() as u64,
                r["vocab_size"].as_u64().unwrap(),
                "{name}"
            );
            assert!(tok.has_chat_template(), "{name}");
            assert!(!tok.clean_up_tokenization_spaces(), "{name}");
        }
        let (tok, _) = load_fixture("qwen2");
        assert_eq!(tok.generation_defaults().temperature, None);
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(382));
    }

    #[test]
    fn fixture_template_errors_and_kwargs() {
        let (tok, _) = load_fixture("mistral");
        let bad = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
        match tok.apply_chat_template(&bad, true) {
            Err(TokenizerError::Chat(ChatError::Raised(m))) => assert_eq!(
                m,
                "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."
            ),
            other => panic!("unexpected {other:?}"),
        }
        let (tok, _) = load_fixture("qwen3");
        let msgs = [ChatMessage::new("user", "hi")];
        let on = tok.apply_chat_template(&msgs, true).unwrap();
        let off = tok
            .apply_chat_template_with(&msgs, true, &serde_json::json!({"enable_thinking": false}))
            .unwrap();
        assert_eq!(off, format!("{on}<think>\n\n</think>\n\n"));
    }
}
