//! Chat-template rendering.
//!
//! This module owns [`ChatMessage`] and [`ChatTemplate`]: a Hugging Face chat template (Jinja)
//! compiled once with minijinja and rendered so that the output is byte-identical to
//! `transformers`' `tokenizer.apply_chat_template(messages, tokenize=False, ...)`.
//!
//! What is emulated from the Python side:
//! - jinja2 `trim_blocks=True`, `lstrip_blocks=True`, `keep_trailing_newline=False`, no autoescape,
//!   and the `loopcontrols` extension (`break`/`continue`);
//! - globals `raise_exception(msg)` (becomes [`ChatError::Raised`] carrying `msg`) and
//!   `strftime_now(fmt)` (UTC);
//! - the `tojson` filter as HF defines it (`json.dumps(x, ensure_ascii=False, indent=...,
//!   separators=..., sort_keys=...)`, insertion order kept for messages);
//! - Python string/dict methods (`.strip()`, `.startswith()`, `.split()`, `.items()`, `.get()`, ...)
//!   through `minijinja_contrib::pycompat`;
//! - Python rendering of `True`/`False`/`None`;
//! - the `{% generation %}`/`{% endgeneration %}` tags of HF's `AssistantTracker` (rendered as a
//!   no-op block);
//! - variables `messages`, `add_generation_prompt`, `tools`/`documents` (= `None`), and the
//!   tokenizer's special tokens (`bos_token`, `eos_token`, ...), plus caller-supplied extras such
//!   as `enable_thinking`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior};
use serde::{Deserialize, Serialize};

/// Name under which the single chat template is registered in the environment.
const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation, as passed to a chat template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
    /// The tool-calling fields a template may read ([`MESSAGE_FIELDS`]): an assistant
    /// message's `tool_calls`, a tool result's `tool_call_id` and `name`.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub fields: serde_json::Map<String, serde_json::Value>,
}

/// The message fields besides `role` and `content` passed to templates.
pub const MESSAGE_FIELDS: [&str; 3] = ["tool_calls", "tool_call_id", "name"];

impl ChatMessage {
    /// Builds a message from a role and its content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            fields: serde_json::Map::new(),
        }
    }
}

/// Errors from compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template source does not parse.
    #[error("chat template does not compile: {0}")]
    Compile(String),
    /// The template called `raise_exception(msg)`; usually the conversation breaks one of the
    /// model's rules (e.g. roles must alternate user/assistant).
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    /// Any other rendering failure (undefined attribute, type error, ...).
    #[error("chat template failed to render: {0}")]
    Render(String),
    /// `extra` variables passed to [`ChatTemplate::render_with`] were not a JSON object.
    #[error("extra chat-template variables must be a JSON object, got {0}")]
    BadExtra(String),
}

/// A compiled chat template plus the fixed variables (special tokens) it is rendered with.
///
/// Compile once (per tokenizer) with [`ChatTemplate::new`], render many times.
pub struct ChatTemplate {
    env: Environment<'static>,
    globals: BTreeMap<String, Value>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("globals", &self.globals.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Marker carried as the source of the minijinja error raised by `raise_exception`.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

impl ChatTemplate {
    /// Compiles `source`. `special_tokens` are the variables every render gets (e.g.
    /// `{"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": [...]}`), as in
    /// HF's `tokenizer.special_tokens_map`.
    pub fn new(
        source: &str,
        special_tokens: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson_filter);
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|e| ChatError::Compile(describe(&e)))?;
        let globals = special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        Ok(Self { env, globals })
    }

    /// Renders `messages`, like HF `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=...)`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with(messages, add_generation_prompt, &serde_json::Value::Null)
    }

    /// Like [`render`](Self::render) with extra template variables (HF's `**kwargs`, e.g.
    /// `{"enable_thinking": false}` for Qwen3, or `{"tools": [...]}`). `extra` must be a JSON
    /// object or `null`. Extra variables override the special tokens and `tools`/`documents`.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String, ChatError> {
        let mut ctx = self.globals.clone();
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        match extra {
            serde_json::Value::Null => {}
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    ctx.insert(k.clone(), Value::from_serialize(v));
                }
            }
            other => return Err(ChatError::BadExtra(kind_name(other).into())),
        }
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut fields = vec![
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ];
                for key in MESSAGE_FIELDS {
                    if let Some(v) = m.fields.get(key) {
                        fields.push((key, Value::from_serialize(v)));
                    }
                }
                Value::from_object(OrderedMap(fields))
            })
            .collect();
        ctx.insert("messages".into(), Value::from(msgs));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Render(describe(&e)))?;
        tmpl.render(Value::from(ctx))
            .map_err(|e| match find_raised(&e) {
                Some(msg) => ChatError::Raised(msg),
                None => ChatError::Render(describe(&e)),
            })
    }
}

fn kind_name(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Full description of a minijinja error including its detail and location.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    if let Some(line) = e.line() {
        if !s.contains("line") {
            s.push_str(&format!(" (template line {line})"));
        }
    }
    s
}

fn find_raised(e: &Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<RaisedException>() {
            return Some(r.0.clone());
        }
        cur = err.source();
    }
    None
}

/// A map that keeps insertion order (minijinja's own maps are sorted without `preserve_order`),
/// so `message | tojson` and `message.items()` match Python dict order.
#[derive(Debug)]
struct OrderedMap(Vec<(&'static str, Value)>);

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(k, _)| Value::from(*k)).collect())
    }
}

/// Replaces HF's `{% generation %}` / `{% endgeneration %}` (AssistantTracker extension) with an
/// always-true `if` block, keeping whitespace-control modifiers intact.
fn rewrite_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        let Some(end) = tag[2..].find("%}").map(|e| e + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (pre, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, post) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[body.len() - 1..]),
            None => (body, ""),
        };
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(pre);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(post);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Renders values like Python's `str()`: `True`/`False`/`None`; everything else as minijinja does.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Bool => {
            let s = if value.is_true() { "True" } else { "False" };
            out.write_str(s).map_err(Error::from)
        }
        ValueKind::None => out.write_str("None").map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(RaisedException(msg)))
}

// ---------------------------------------------------------------------------------------------
// strftime_now
// ---------------------------------------------------------------------------------------------

fn strftime_now(fmt: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(strftime_utc(&fmt, secs))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// (year, month 1..=12, day 1..=31) from days since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// A subset of C `strftime` over a UTC timestamp: `%Y %y %m %d %e %H %I %M %S %p %b %B %h %a %A
/// %j %u %w %F %T %D %R %%`; unknown directives are copied through.
fn strftime_utc(fmt: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (sod / 3600, (sod % 3600) / 60, sod % 60);
    let wd = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; 0 = Monday
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + u32::from(m > 2 && is_leap(y));
    let month = MONTHS[(m - 1) as usize];
    let weekday = WEEKDAYS[wd];
    let h12 = if hh % 12 == 0 { 12 } else { hh % 12 };
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        let s = match spec {
            'Y' => y.to_string(),
            'y' => format!("{:02}", y.rem_euclid(100)),
            'm' => format!("{m:02}"),
            'd' => format!("{d:02}"),
            'e' => format!("{d:>2}"),
            'H' => format!("{hh:02}"),
            'I' => format!("{h12:02}"),
            'M' => format!("{mm:02}"),
            'S' => format!("{ss:02}"),
            'p' => (if hh < 12 { "AM" } else { "PM" }).to_string(),
            'b' | 'h' => month[..3].to_string(),
            'B' => month.to_string(),
            'a' => weekday[..3].to_string(),
            'A' => weekday.to_string(),
            'j' => format!("{yday:03}"),
            'u' => (wd + 1).to_string(),
            'w' => ((wd + 1) % 7).to_string(),
            'F' => format!("{y}-{m:02}-{d:02}"),
            'T' => format!("{hh:02}:{mm:02}:{ss:02}"),
            'R' => format!("{hh:02}:{mm:02}"),
            'D' => format!("{m:02}/{d:02}/{:02}", y.rem_euclid(100)),
            '%' => "%".to_string(),
            other => format!("%{other}"),
        };
        out.push_str(&s);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// tojson (Python json.dumps)
// ---------------------------------------------------------------------------------------------

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// HF: `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`.
fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            if let Some(n) = v.as_i64() {
                Some(" ".repeat(n.max(0) as usize))
            } else if let Some(s) = v.as_str() {
                Some(s.to_string())
            } else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        }
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match (
                parts.first().and_then(|p| p.as_str()),
                parts.get(1).and_then(|p| p.as_str()),
            ) {
                (Some(a), Some(b)) if parts.len() == 2 => (a.to_string(), b.to_string()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        _ => {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_string(), ": ".to_string())
        }
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_newline_indent(out: &mut String, opts: &JsonOpts, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined => Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: Object of type Undefined is not JSON serializable",
        )),
        ValueKind::None => {
            out.push_str("null");
            Ok(())
        }
        ValueKind::Bool => {
            out.push_str(if v.is_true() { "true" } else { "false" });
            Ok(())
        }
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float_repr(f));
            }
            Ok(())
        }
        ValueKind::String => {
            write_json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii);
            Ok(())
        }
        ValueKind::Bytes => Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: Object of type bytes is not JSON serializable",
        )),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                write_newline_indent(out, opts, level + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None if k.is_none() => "null".to_string(),
                    None if k.kind() == ValueKind::Bool => {
                        (if k.is_true() { "true" } else { "false" }).to_string()
                    }
                    None => k.to_string(),
                };
                write_json_str(out, &key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                let item = v.get_item(k)?;
                write_json(out, &item, opts, level + 1)?;
            }
            write_newline_indent(out, opts, level);
            out.push('}');
            Ok(())
        }
        _ => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                write_newline_indent(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            write_newline_indent(out, opts, level);
            out.push(']');
            Ok(())
        }
    }
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `repr(float)` as used by `json.dumps`.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let exp = f.abs().log10().floor() as i32;
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        // Rust gives e.g. "1e-5" / "1.5e16"; Python gives "1e-05" / "1.5e+16".
        let s = format!("{f:e}");
        match s.split_once('e') {
            Some((mant, e)) => {
                let (sign, digits) = match e.strip_prefix('-') {
                    Some(d) => ('-', d),
                    None => ('+', e),
                };
                format!("{mant}e{sign}{digits:0>2}")
            }
            None => s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials() -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("bos_token".into(), "<s>".into());
        m.insert("eos_token".into(), "</s>".into());
        m
    }

    fn render(src: &str, msgs: &[ChatMessage], gen: bool) -> Result<String, ChatError> {
        ChatTemplate::new(src, &specials())?.render(msgs, gen)
    }

    fn convo() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "  Hi there  "),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", "What is 2+2?"),
        ]
    }

    #[test]
    fn trim_and_lstrip_blocks() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let out = render(src, &convo(), false).unwrap();
        assert_eq!(out, "[  Hi there  ]\n[What is 2+2?]\n");
    }

    #[test]
    fn python_methods_and_specials() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m['content'].strip().startswith('Hi') %}{{ m.content.strip().split(' ') | join('|') }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}";
        assert_eq!(render(src, &convo(), true).unwrap(), "<s>Hi|there</s>");
        assert_eq!(render(src, &convo(), false).unwrap(), "<s>Hi|there");
    }

    #[test]
    fn raise_exception_carries_message() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}";
        match render(src, &convo(), true) {
            Err(ChatError::Raised(m)) => assert_eq!(
                m,
                "Conversation roles must alternate user/assistant/user/assistant/..."
            ),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn compile_error() {
        for bad in ["{% for %}", "{%}", "{%", "x {%- generation", "{% endfor %}"] {
            assert!(
                matches!(
                    ChatTemplate::new(bad, &specials()),
                    Err(ChatError::Compile(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn tojson_like_python() {
        let src = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ x | tojson }}|{{ x | tojson(separators=(',', ':'), sort_keys=true) }}";
        let t = ChatTemplate::new(src, &specials()).unwrap();
        let extra = serde_json::json!({"x": {"b": [1, 2.5, 1e-5, true, null], "a": "é\"\n<"}});
        let out = t
            .render_with(&[ChatMessage::new("user", "hi")], false, &extra)
            .unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \"hi\"}|{\n  \"role\": \"user\",\n  \"content\": \"hi\"\n}|{\"a\": \"é\\\"\\n<\", \"b\": [1, 2.5, 1e-05, true, null]}|{\"a\":\"é\\\"\\n<\",\"b\":[1,2.5,1e-05,true,null]}"
        );
    }

    #[test]
    fn python_literals_and_tools_none() {
        let src = "{{ true }} {{ none }} {{ tools }} {{ tools is none }} {{ missing is defined }}";
        assert_eq!(
            render(src, &[], false).unwrap(),
            "True None None True False"
        );
    }

    #[test]
    fn extra_vars_and_bad_extra() {
        let src =
            "{% if enable_thinking is defined and enable_thinking is false %}no-think{% endif %}";
        let t = ChatTemplate::new(src, &specials()).unwrap();
        let out = t
            .render_with(&[], true, &serde_json::json!({"enable_thinking": false}))
            .unwrap();
        assert_eq!(out, "no-think");
        assert_eq!(t.render(&[], true).unwrap(), "");
        assert!(matches!(
            t.render_with(&[], true, &serde_json::json!([1])),
            Err(ChatError::BadExtra(_))
        ));
    }

    #[test]
    fn generation_tags_and_loop_controls() {
        let src = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{%- generation -%} {{ m.role }};{%- endgeneration %}{% endfor %}";
        assert_eq!(render(src, &convo(), false).unwrap(), "system;user;");
    }

    #[test]
    fn trailing_newline_dropped() {
        assert_eq!(render("x\n", &[], false).unwrap(), "x");
    }

    #[test]
    fn strftime() {
        // 2024-07-26 13:05:09 UTC, a Friday
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(
            strftime_utc("%d %b %Y|%B %A %a %H:%M:%S %I%p %j %% %y %F %Q", t),
            "26 Jul 2024|July Friday Fri 13:05:09 01PM 208 % 24 2024-07-26 %Q"
        );
        assert_eq!(strftime_utc("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime_utc("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
        let now = ChatTemplate::new("{{ strftime_now('%Y') }}", &specials())
            .unwrap()
            .render(&[], false)
            .unwrap();
        assert!(now.len() == 4 && now.starts_with('2'), "{now}");
    }

    #[test]
    fn float_repr() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(1.5e-7), "1.5e-07");
        assert_eq!(python_float_repr(123456.789), "123456.789");
    }
}
