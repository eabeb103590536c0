//! Tool calls in a model's output text: the formats chat templates teach models, parsed
//! into `(name, arguments)` pairs, whole or while the text streams in.
//!
//! Formats (vLLM's parser names where it has one):
//! * [`ToolCallFormat::Hermes`] (`hermes`; Qwen2.5, Qwen3, Hermes, many fine-tunes):
//!   `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, any number, text around them.
//! * [`ToolCallFormat::Llama3Json`] (`llama3_json`; Llama 3.1–3.3's JSON tool calling): the
//!   whole reply is `{"name": …, "parameters": {…}}` (optionally after `<|python_tag|>`),
//!   several separated by `;`.
//! * [`ToolCallFormat::Mistral`] (`mistral`): `[TOOL_CALLS]` then a JSON list of
//!   `{"name", "arguments"}` (v0.3 tokenizers), or `name[ARGS]{…}` per call (v11+).
//!
//! Text that looks like a call but does not parse stays content: nothing is lost.
use serde_json::Value;

/// A parsed call: the function name and its arguments as a JSON object's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// One output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    Hermes,
    Llama3Json,
    Mistral,
}

/// Error for an unknown `--tool-call-parser` value.
#[derive(Debug, thiserror::Error)]
#[error("unknown tool-call parser `{0}` (known: hermes, llama3_json, mistral)")]
pub struct UnknownFormat(pub String);

impl std::str::FromStr for ToolCallFormat {
    type Err = UnknownFormat;
    fn from_str(s: &str) -> Result<Self, UnknownFormat> {
        match s {
            "hermes" | "qwen" => Ok(Self::Hermes),
            "llama3_json" | "llama3" | "llama" => Ok(Self::Llama3Json),
            "mistral" => Ok(Self::Mistral),
            other => Err(UnknownFormat(other.to_string())),
        }
    }
}

const HERMES_START: &str = "<tool_call>";
const HERMES_END: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_START: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";

impl ToolCallFormat {
    /// The format a chat template teaches, from the markers it contains; `None` when the
    /// template has no tool calling the parsers know.
    pub fn detect(template: &str) -> Option<ToolCallFormat> {
        if template.contains(HERMES_START) {
            Some(Self::Hermes)
        } else if template.contains(MISTRAL_START) {
            Some(Self::Mistral)
        } else if template.contains(PYTHON_TAG) || template.contains("\"parameters\"") {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
        }
    }

    /// Split a whole reply into content and tool calls.
    pub fn parse(self, text: &str) -> Parsed {
        let mut p = ToolCallStream::new(self);
        let mut out = p.push(text);
        out.extend(p.finish());
        let mut parsed = Parsed::default();
        for e in out {
            match e {
                ToolEvent::Content(c) => parsed.content.push_str(&c),
                ToolEvent::Call(c) => parsed.tool_calls.push(c),
            }
        }
        parsed
    }
}

/// A reply split by [`ToolCallFormat::parse`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// What a streaming parser releases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text for `content` (never part of a call's markup).
    Content(String),
    /// A complete call.
    Call(ToolCall),
}

/// Parses text as it streams in: content is released as soon as it cannot be the start of
/// a call's markup, each call once its markup is complete.
#[derive(Debug)]
pub struct ToolCallStream {
    format: ToolCallFormat,
    buf: String,
    state: State,
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    /// Outside any call (Hermes, Mistral), or (Llama) before the first non-blank character.
    Text,
    /// Inside `<tool_call>` … (Hermes), after `[TOOL_CALLS]` (Mistral), or a JSON reply (Llama).
    Call,
    /// Llama: the reply is plain text, passed through.
    Plain,
}

impl ToolCallStream {
    pub fn new(format: ToolCallFormat) -> Self {
        ToolCallStream {
            format,
            buf: String::new(),
            state: State::Text,
        }
    }

    /// Whether the text so far holds (the start of) a call.
    pub fn in_call(&self) -> bool {
        self.state == State::Call
    }

    /// Feed the next piece of text.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            let before = (self.buf.len(), matches!(self.state, State::Call));
            match (self.format, &self.state) {
                (_, State::Plain) => {
                    push_content(&mut out, std::mem::take(&mut self.buf));
                }
                (ToolCallFormat::Hermes, State::Text) => {
                    self.release_until(HERMES_START, &mut out);
                }
                (ToolCallFormat::Hermes, State::Call) => {
                    if let Some(end) = self.buf.find(HERMES_END) {
                        let body: String = self.buf[..end].to_string();
                        self.buf.drain(..end + HERMES_END.len());
                        self.state = State::Text;
                        match call_from_json(body.trim()) {
                            Some(c) => out.push(ToolEvent::Call(c)),
                            None => {
                                push_content(&mut out, format!("{HERMES_START}{body}{HERMES_END}"))
                            }
                        }
                    }
                }
                (ToolCallFormat::Mistral, State::Text) => {
                    self.release_until(MISTRAL_START, &mut out);
                }
                (ToolCallFormat::Llama3Json, State::Text) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        // blank so far: undecided
                    } else if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                        self.state = State::Call;
                    } else if PYTHON_TAG.starts_with(t) {
                        // maybe the tag, still arriving
                    } else {
                        self.state = State::Plain;
                    }
                }
                // Mistral and Llama calls run to the end of the reply.
                (_, State::Call) => {}
            }
            if (self.buf.len(), matches!(self.state, State::Call)) == before {
                break;
            }
        }
        out
    }

    /// The reply has ended: release what was held back.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match (self.format, &self.state) {
            (ToolCallFormat::Hermes, State::Call) => {
                // an unterminated <tool_call>: a call if its JSON is complete
                match call_from_json(rest.trim()) {
                    Some(c) => out.push(ToolEvent::Call(c)),
                    None => push_content(&mut out, format!("{HERMES_START}{rest}")),
                }
            }
            (ToolCallFormat::Mistral, State::Call) => match mistral_calls(&rest) {
                Some(calls) => out.extend(calls.into_iter().map(ToolEvent::Call)),
                None => push_content(&mut out, format!("{MISTRAL_START}{rest}")),
            },
            (ToolCallFormat::Llama3Json, State::Call) => match llama_calls(&rest) {
                Some(calls) => out.extend(calls.into_iter().map(ToolEvent::Call)),
                None => push_content(&mut out, rest),
            },
            _ => push_content(&mut out, rest),
        }
        self.state = State::Text;
        out
    }

    /// Release buffered text up to `tag` (entering a call after it), or up to a suffix that
    /// could be the start of `tag`.
    fn release_until(&mut self, tag: &str, out: &mut Vec<ToolEvent>) {
        if let Some(i) = self.buf.find(tag) {
            let text: String = self.buf.drain(..i).collect();
            self.buf.drain(..tag.len());
            push_content(out, text);
            self.state = State::Call;
        } else {
            let keep = partial_tag_suffix(&self.buf, tag);
            let text: String = self.buf.drain(..self.buf.len() - keep).collect();
            push_content(out, text);
        }
    }
}

fn push_content(out: &mut Vec<ToolEvent>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(ToolEvent::Content(c)) = out.last_mut() {
        c.push_str(&text);
    } else {
        out.push(ToolEvent::Content(text));
    }
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag`.
pub(crate) fn partial_tag_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// `{"name": …, "arguments" | "parameters": {…}}` → a call (arguments may also be a JSON string).
fn call_from_value(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    let arguments = match args {
        Value::String(s) => {
            // some models quote the object
            serde_json::from_str::<Value>(&s)
                .ok()
                .filter(Value::is_object)?;
            s
        }
        Value::Object(_) => args.to_string(),
        _ => return None,
    };
    Some(ToolCall { name, arguments })
}

fn call_from_json(text: &str) -> Option<ToolCall> {
    call_from_value(&serde_json::from_str(text).ok()?)
}

/// Mistral: a JSON list (or one object) of calls, or `name[ARGS]{…}` pieces.
fn mistral_calls(text: &str) -> Option<Vec<ToolCall>> {
    let t = text.trim();
    if t.starts_with('[') || t.starts_with('{') {
        return match serde_json::from_str::<Value>(t).ok()? {
            Value::Array(a) => a.iter().map(call_from_value).collect(),
            v => Some(vec![call_from_value(&v)?]),
        };
    }
    // v11+: name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
    t.split(MISTRAL_START)
        .map(|piece| {
            let (name, args) = piece.split_once(MISTRAL_ARGS)?;
            let v: Value = serde_json::from_str(args.trim()).ok()?;
            v.is_object().then(|| ToolCall {
                name: name.trim().to_string(),
                arguments: v.to_string(),
            })
        })
        .collect()
}

/// Llama 3.1 JSON: one or more objects separated by `;`, optionally after `<|python_tag|>`.
fn llama_calls(text: &str) -> Option<Vec<ToolCall>> {
    let t = text.trim();
    let mut rest = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim_start();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        calls.push(call_from_value(&values.next()?.ok()?)?);
        rest = rest[values.byte_offset()..].trim_start();
        match rest.strip_prefix(';') {
            Some(r) => rest = r.trim_start(),
            None if rest.is_empty() => {}
            None => return None,
        }
    }
    (!calls.is_empty()).then_some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args.into(),
        }
    }

    /// Feeding the text in pieces of every size gives what parsing it whole gives.
    fn streamed(format: ToolCallFormat, text: &str) -> Parsed {
        let whole = format.parse(text);
        for step in 1..=7 {
            let mut s = ToolCallStream::new(format);
            let mut events = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(step) {
                events.extend(s.push(&piece.iter().collect::<String>()));
            }
            events.extend(s.finish());
            let mut p = Parsed::default();
            for e in events {
                match e {
                    ToolEvent::Content(c) => p.content.push_str(&c),
                    ToolEvent::Call(c) => p.tool_calls.push(c),
                }
            }
            assert_eq!(p, whole, "{format:?} in pieces of {step}: {text:?}");
        }
        whole
    }

    #[test]
    fn hermes() {
        let p = streamed(
            ToolCallFormat::Hermes,
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>",
        );
        assert_eq!(p.content, "Let me check.\n\n");
        assert_eq!(
            p.tool_calls,
            vec![
                call("get_weather", r#"{"city":"Paris"}"#),
                call("now", "{}")
            ]
        );
        // no markup: all content; a `<` that is not the tag is released
        let p = streamed(ToolCallFormat::Hermes, "a < b, and <tool is not a tag");
        assert_eq!(p.content, "a < b, and <tool is not a tag");
        assert!(p.tool_calls.is_empty());
        // broken JSON stays content, markup included
        let p = streamed(
            ToolCallFormat::Hermes,
            "x<tool_call>{\"name\": 3}</tool_call>y",
        );
        assert_eq!(p.content, "x<tool_call>{\"name\": 3}</tool_call>y");
        // an unterminated call with complete JSON (the model stopped at EOS)
        let p = streamed(
            ToolCallFormat::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n",
        );
        assert_eq!(p.tool_calls, vec![call("f", r#"{"a":1}"#)]);
        assert_eq!(p.content, "");
    }

    #[test]
    fn llama3_json() {
        let p = streamed(
            ToolCallFormat::Llama3Json,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
        );
        assert_eq!(
            p.tool_calls,
            vec![call("get_weather", r#"{"city":"Paris"}"#)]
        );
        let p = streamed(
            ToolCallFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": [1, 2]}}",
        );
        assert_eq!(
            p.tool_calls,
            vec![call("a", "{}"), call("b", r#"{"x":[1,2]}"#)]
        );
        let p = streamed(ToolCallFormat::Llama3Json, "  The weather is {mild} today.");
        assert_eq!(p.content, "  The weather is {mild} today.");
        assert!(p.tool_calls.is_empty());
        // JSON that is not a call stays content
        let p = streamed(ToolCallFormat::Llama3Json, "{\"answer\": 42}");
        assert_eq!(p.content, "{\"answer\": 42}");
    }

    #[test]
    fn mistral() {
        let p = streamed(
            ToolCallFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"now\", \"arguments\": {}}]",
        );
        assert_eq!(
            p.tool_calls,
            vec![
                call("get_weather", r#"{"city":"Paris"}"#),
                call("now", "{}")
            ]
        );
        let p = streamed(
            ToolCallFormat::Mistral,
            "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]now[ARGS]{}",
        );
        assert_eq!(p.content, "Sure.");
        assert_eq!(
            p.tool_calls,
            vec![
                call("get_weather", r#"{"city":"Paris"}"#),
                call("now", "{}")
            ]
        );
        let p = streamed(ToolCallFormat::Mistral, "no calls [TOOL here");
        assert_eq!(p.content, "no calls [TOOL here");
    }

    #[test]
    fn detect_and_names() {
        assert_eq!(
            ToolCallFormat::detect("{% for tool in tools %}<tool_call>{% endfor %}"),
            Some(ToolCallFormat::Hermes)
        );
        assert_eq!(
            ToolCallFormat::detect("[AVAILABLE_TOOLS] ... [TOOL_CALLS]"),
            Some(ToolCallFormat::Mistral)
        );
        assert_eq!(
            ToolCallFormat::detect("{{- '<|python_tag|>' }} \"parameters\""),
            Some(ToolCallFormat::Llama3Json)
        );
        assert_eq!(ToolCallFormat::detect("{{ messages }}"), None);
        for f in [
            ToolCallFormat::Hermes,
            ToolCallFormat::Llama3Json,
            ToolCallFormat::Mistral,
        ] {
            assert_eq!(f.name().parse::<ToolCallFormat>().unwrap(), f);
        }
        let e = "pythonic"
            .parse::<ToolCallFormat>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("pythonic") && e.contains("hermes"), "{e}");
    }

    #[test]
    fn partial_tags() {
        assert_eq!(partial_tag_suffix("abc<tool", "<tool_call>"), 5);
        assert_eq!(partial_tag_suffix("abc", "<tool_call>"), 0);
        assert_eq!(partial_tag_suffix("日本<", "<tool_call>"), 1);
    }
}
