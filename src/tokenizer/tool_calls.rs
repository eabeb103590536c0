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
            parsed.add(e);
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

impl Parsed {
    /// Add a streaming parser's event (the way a client accumulates stream deltas).
    pub fn add(&mut self, e: ToolEvent) {
        match e {
            ToolEvent::Content(c) => self.content.push_str(&c),
            ToolEvent::Call(c) => self.tool_calls.push(c),
            ToolEvent::CallStart(name) => self.tool_calls.push(ToolCall {
                name,
                arguments: String::new(),
            }),
            ToolEvent::CallArgs(a) => {
                if let Some(c) = self.tool_calls.last_mut() {
                    c.arguments.push_str(&a);
                }
            }
            ToolEvent::CallEnd => {}
        }
    }
}

/// What a streaming parser releases. A call comes as `CallStart`, `CallArgs` pieces and
/// `CallEnd` when its markup streams (`{"name": …, "arguments": {…}}` with the name
/// first: its arguments are the model's text of the object, released as it arrives),
/// or whole as `Call` when it cannot (other key orders, quoted arguments: parsed once the
/// markup is complete).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text for `content` (never part of a call's markup).
    Content(String),
    /// A complete call, parsed whole.
    Call(ToolCall),
    /// A call begins: its function name.
    CallStart(String),
    /// The next piece of the started call's arguments (JSON text).
    CallArgs(String),
    /// The started call is complete.
    CallEnd,
}

/// Parses text as it streams in: content is released as soon as it cannot be the start of
/// a call's markup; a call's name as soon as it is known and its arguments as they come
/// (or the call whole once its markup is complete, see [`ToolEvent`]).
#[derive(Debug)]
pub struct ToolCallStream {
    format: ToolCallFormat,
    buf: String,
    state: State,
    /// Calls started in the current markup (a Mistral or Llama call list).
    started: usize,
    /// Mistral: the calls are `name[ARGS]{…}` pieces, not a JSON list.
    named_args: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Outside any call (Hermes, Mistral), or (Llama) before the first non-blank character.
    Text,
    /// Inside `<tool_call>` … (Hermes), after `[TOOL_CALLS]` (Mistral), or a JSON reply (Llama).
    Call(Phase),
    /// Llama: the reply is plain text, passed through.
    Plain,
}

/// Where a call's markup is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before its name and the start of its arguments: nothing released yet.
    Head,
    /// Inside the arguments object, released as it comes (JSON nesting depth, and
    /// whether in a string / after a backslash there).
    Args { depth: u32, in_str: bool, esc: bool },
    /// After the arguments: the rest of the call's markup (dropped).
    Tail,
    /// Mistral, after a JSON list's `]`: nothing more is a call.
    Done,
    /// Markup that does not stream: parsed whole when it is complete.
    Whole,
}

/// How far a call's head (`{"name": "…", "arguments": {`) has arrived.
enum Head {
    Incomplete,
    No,
    /// The name, and the byte offset of the arguments' `{`.
    Yes(String, usize),
}

impl ToolCallStream {
    pub fn new(format: ToolCallFormat) -> Self {
        ToolCallStream {
            format,
            buf: String::new(),
            state: State::Text,
            started: 0,
            named_args: false,
        }
    }

    /// Whether the text so far holds (the start of) a call.
    pub fn in_call(&self) -> bool {
        matches!(self.state, State::Call(_))
    }

    fn enter_call(&mut self) {
        self.state = State::Call(Phase::Head);
        self.started = 0;
        self.named_args = false;
    }

    /// Feed the next piece of text.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            let before = (self.buf.len(), self.state);
            match (self.format, self.state) {
                (_, State::Plain) => {
                    push_content(&mut out, std::mem::take(&mut self.buf));
                }
                (ToolCallFormat::Hermes, State::Text) => {
                    self.release_until(HERMES_START, &mut out);
                }
                (ToolCallFormat::Mistral, State::Text) => {
                    self.release_until(MISTRAL_START, &mut out);
                }
                (ToolCallFormat::Llama3Json, State::Text) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        // blank so far: undecided
                    } else if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                        self.enter_call();
                    } else if PYTHON_TAG.starts_with(t) {
                        // maybe the tag, still arriving
                    } else {
                        self.state = State::Plain;
                    }
                }
                (_, State::Call(Phase::Head)) => self.head(&mut out),
                (_, State::Call(Phase::Args { depth, in_str, esc })) => {
                    self.args(depth, in_str, esc, &mut out)
                }
                (_, State::Call(Phase::Tail)) => self.tail(&mut out),
                (_, State::Call(Phase::Done)) => self.buf.clear(),
                (ToolCallFormat::Hermes, State::Call(Phase::Whole)) => {
                    if let Some(end) = self.buf.find(HERMES_END) {
                        let body: String = self.buf[..end].to_string();
                        self.buf.drain(..end + HERMES_END.len());
                        self.state = State::Text;
                        self.whole(&body, &mut out);
                    }
                }
                // Mistral and Llama markup runs to the end of the reply.
                (_, State::Call(Phase::Whole)) => {}
            }
            if (self.buf.len(), self.state) == before {
                break;
            }
        }
        out
    }

    /// A call's head: start streaming it, or parse the markup whole.
    fn head(&mut self, out: &mut Vec<ToolEvent>) {
        let found = match self.format {
            ToolCallFormat::Mistral if self.started == 0 => {
                let t = self.buf.trim_start();
                let skip = self.buf.len() - t.len();
                if t.is_empty() {
                    Head::Incomplete
                } else if let Some(rest) = t.strip_prefix('[') {
                    // a JSON list: its first object
                    match object_head(rest) {
                        Head::Yes(n, at) => Head::Yes(n, at + skip + 1),
                        h => h,
                    }
                } else if t.starts_with('{') {
                    object_head(&self.buf)
                } else {
                    self.named_args = true;
                    named_args_head(&self.buf)
                }
            }
            ToolCallFormat::Mistral if self.named_args => named_args_head(&self.buf),
            ToolCallFormat::Llama3Json if self.started == 0 => {
                let t = self.buf.trim_start();
                let skip = self.buf.len() - t.len();
                match t.strip_prefix(PYTHON_TAG) {
                    Some(rest) => match object_head(rest) {
                        Head::Yes(n, at) => Head::Yes(n, at + skip + PYTHON_TAG.len()),
                        h => h,
                    },
                    None => object_head(&self.buf),
                }
            }
            _ => object_head(&self.buf),
        };
        match found {
            Head::Yes(name, at) => {
                self.buf.drain(..at);
                self.started += 1;
                out.push(ToolEvent::CallStart(name));
                self.state = State::Call(Phase::Args {
                    depth: 0,
                    in_str: false,
                    esc: false,
                });
            }
            Head::No => self.state = State::Call(Phase::Whole),
            Head::Incomplete => {
                // a Hermes call that ends before its head is complete is parsed whole
                if self.format == ToolCallFormat::Hermes && self.buf.contains(HERMES_END) {
                    self.state = State::Call(Phase::Whole);
                }
            }
        }
    }

    /// Release the arguments text that has arrived, up to the end of the object.
    fn args(&mut self, mut depth: u32, mut in_str: bool, mut esc: bool, out: &mut Vec<ToolEvent>) {
        let mut end = None;
        for (i, b) in self.buf.bytes().enumerate() {
            if in_str {
                match b {
                    _ if esc => esc = false,
                    b'\\' => esc = true,
                    b'"' => in_str = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_str = true,
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = Some(i + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        let piece: String = self.buf.drain(..end.unwrap_or(self.buf.len())).collect();
        if !piece.is_empty() {
            out.push(ToolEvent::CallArgs(piece));
        }
        self.state = State::Call(if end.is_some() {
            Phase::Tail
        } else {
            Phase::Args { depth, in_str, esc }
        });
    }

    /// After a call's arguments: its end, and where the next call may start.
    fn tail(&mut self, out: &mut Vec<ToolEvent>) {
        let (sep, next): (&str, State) = match self.format {
            ToolCallFormat::Hermes => (HERMES_END, State::Text),
            ToolCallFormat::Llama3Json => (";", State::Call(Phase::Head)),
            ToolCallFormat::Mistral if self.named_args => (MISTRAL_START, State::Call(Phase::Head)),
            ToolCallFormat::Mistral => {
                // `}, {` or `}]`
                match self.buf.find([',', ']']) {
                    Some(i) => {
                        let list_end = self.buf.as_bytes()[i] == b']';
                        self.buf.drain(..=i);
                        out.push(ToolEvent::CallEnd);
                        self.state = State::Call(if list_end { Phase::Done } else { Phase::Head });
                    }
                    None => self.buf.clear(),
                }
                return;
            }
        };
        match self.buf.find(sep) {
            Some(i) => {
                self.buf.drain(..i + sep.len());
                out.push(ToolEvent::CallEnd);
                self.state = next;
            }
            None => {
                let keep = partial_tag_suffix(&self.buf, sep);
                self.buf.drain(..self.buf.len() - keep);
            }
        }
    }

    /// Markup that did not stream, complete: its calls, or content (markup included)
    /// when it does not parse.
    fn whole(&mut self, body: &str, out: &mut Vec<ToolEvent>) {
        match self.format {
            ToolCallFormat::Hermes => match call_from_json(body.trim()) {
                Some(c) => out.push(ToolEvent::Call(c)),
                None => push_content(out, format!("{HERMES_START}{body}{HERMES_END}")),
            },
            ToolCallFormat::Mistral => match mistral_calls(body) {
                Some(calls) => out.extend(calls.into_iter().map(ToolEvent::Call)),
                None if self.started > 0 => {}
                None => push_content(out, format!("{MISTRAL_START}{body}")),
            },
            ToolCallFormat::Llama3Json => match llama_calls(body) {
                Some(calls) => out.extend(calls.into_iter().map(ToolEvent::Call)),
                None if self.started > 0 => {}
                None => push_content(out, body.to_string()),
            },
        }
    }

    /// The reply has ended: release what was held back.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        match self.state {
            State::Call(Phase::Head | Phase::Whole) => {
                // an unterminated Hermes call is one if its JSON is complete; the text
                // after a streamed Llama or Mistral call is dropped when blank
                if !(self.started > 0 && rest.trim().is_empty()) {
                    self.whole(&rest, &mut out);
                }
            }
            State::Call(Phase::Args { .. } | Phase::Tail) => out.push(ToolEvent::CallEnd),
            State::Call(Phase::Done) => {}
            State::Text | State::Plain => push_content(&mut out, rest),
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
            self.enter_call();
        } else {
            let keep = partial_tag_suffix(&self.buf, tag);
            let text: String = self.buf.drain(..self.buf.len() - keep).collect();
            push_content(out, text);
        }
    }
}

/// Blanks from byte `i` of `s` on: the next non-blank byte offset.
fn skip_ws(s: &str, i: usize) -> usize {
    i + s[i..].len() - s[i..].trim_start().len()
}

/// The JSON string literal at byte `i` of `s`: its value and the offset after it.
fn string_at(s: &str, i: usize) -> Result<Option<(String, usize)>, ()> {
    let b = s.as_bytes();
    match b.get(i) {
        None => return Ok(None),
        Some(b'"') => {}
        Some(_) => return Err(()),
    }
    let mut esc = false;
    for (k, &c) in b.iter().enumerate().skip(i + 1) {
        match c {
            _ if esc => esc = false,
            b'\\' => esc = true,
            b'"' => {
                let v: String = serde_json::from_str(&s[i..=k]).map_err(|_| ())?;
                return Ok(Some((v, k + 1)));
            }
            _ => {}
        }
    }
    Ok(None)
}

/// `{"name": "…", "arguments" | "parameters": {` at the start of `s` (after blanks).
fn object_head(s: &str) -> Head {
    let lit = |i: usize, c: u8| -> Result<Option<usize>, ()> {
        let i = skip_ws(s, i);
        match s.as_bytes().get(i) {
            None => Ok(None),
            Some(&x) if x == c => Ok(Some(i + 1)),
            Some(_) => Err(()),
        }
    };
    let head = || -> Result<Option<Head>, ()> {
        let Some(i) = lit(0, b'{')? else {
            return Ok(None);
        };
        let Some((key, i)) = string_at(s, skip_ws(s, i))? else {
            return Ok(None);
        };
        if key != "name" {
            return Err(());
        }
        let Some(i) = lit(i, b':')? else {
            return Ok(None);
        };
        let Some((name, i)) = string_at(s, skip_ws(s, i))? else {
            return Ok(None);
        };
        let Some(i) = lit(i, b',')? else {
            return Ok(None);
        };
        let Some((key, i)) = string_at(s, skip_ws(s, i))? else {
            return Ok(None);
        };
        if key != "arguments" && key != "parameters" {
            return Err(());
        }
        let Some(i) = lit(i, b':')? else {
            return Ok(None);
        };
        Ok(lit(i, b'{')?.map(|i| Head::Yes(name, i - 1)))
    };
    match head() {
        Ok(Some(h)) => h,
        Ok(None) => Head::Incomplete,
        Err(()) => Head::No,
    }
}

/// Mistral v11's `name[ARGS]{` at the start of `s`.
fn named_args_head(s: &str) -> Head {
    let Some(i) = s.find(MISTRAL_ARGS) else {
        // a name has no JSON structure
        return if s.contains(['{', '"', '[']) && partial_tag_suffix(s, MISTRAL_ARGS) == 0 {
            Head::No
        } else {
            Head::Incomplete
        };
    };
    let name = s[..i].trim();
    let at = skip_ws(s, i + MISTRAL_ARGS.len());
    match s.as_bytes().get(at) {
        None => Head::Incomplete,
        Some(b'{') if !name.is_empty() => Head::Yes(name.to_string(), at),
        Some(_) => Head::No,
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
            // every started call ends, once
            let starts = events
                .iter()
                .filter(|e| matches!(e, ToolEvent::CallStart(_)))
                .count();
            let ends = events
                .iter()
                .filter(|e| matches!(e, ToolEvent::CallEnd))
                .count();
            assert_eq!(starts, ends, "{format:?} in pieces of {step}: {events:?}");
            let mut p = Parsed::default();
            for e in events {
                p.add(e);
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
                call("get_weather", r#"{"city": "Paris"}"#),
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
        assert_eq!(p.tool_calls, vec![call("f", r#"{"a": 1}"#)]);
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
            vec![call("get_weather", r#"{"city": "Paris"}"#)]
        );
        let p = streamed(
            ToolCallFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": [1, 2]}}",
        );
        assert_eq!(
            p.tool_calls,
            vec![call("a", "{}"), call("b", r#"{"x": [1, 2]}"#)]
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
                call("get_weather", r#"{"city": "Paris"}"#),
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
                call("get_weather", r#"{"city": "Paris"}"#),
                call("now", "{}")
            ]
        );
        let p = streamed(ToolCallFormat::Mistral, "no calls [TOOL here");
        assert_eq!(p.content, "no calls [TOOL here");
    }

    /// Fed a character at a time, a call's name is released once its head is complete
    /// and its arguments in pieces before the markup ends (what a client sees as
    /// argument deltas); markup that does not stream comes whole at its end.
    #[test]
    fn calls_stream_name_then_argument_pieces() {
        let cases = [
            (
                ToolCallFormat::Hermes,
                "ok <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}</tool_call>",
            ),
            (
                ToolCallFormat::Llama3Json,
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 3}}",
            ),
            (
                ToolCallFormat::Mistral,
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}]",
            ),
            (
                ToolCallFormat::Mistral,
                "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"days\": 3}",
            ),
        ];
        for (format, text) in cases {
            let mut s = ToolCallStream::new(format);
            // (chars fed, event) for every event
            let mut events = vec![];
            for (k, c) in text.chars().enumerate() {
                for e in s.push(&c.to_string()) {
                    events.push((k + 1, e));
                }
            }
            events.extend(s.finish().into_iter().map(|e| (text.len(), e)));
            let start = events
                .iter()
                .position(|(_, e)| *e == ToolEvent::CallStart("get_weather".into()))
                .unwrap_or_else(|| panic!("{format:?}: {events:?}"));
            let pieces: Vec<&(usize, ToolEvent)> = events[start..]
                .iter()
                .filter(|(_, e)| matches!(e, ToolEvent::CallArgs(_)))
                .collect();
            assert!(pieces.len() > 10, "{format:?}: {events:?}");
            // the first piece right after `{`, long before the end of the markup
            assert!(pieces[0].0 < text.len() - 20, "{format:?}: {events:?}");
            assert_eq!(
                format.parse(text).tool_calls,
                vec![call("get_weather", r#"{"city": "Paris", "days": 3}"#)]
            );
        }
        // the arguments before the name, or quoted: parsed whole at the end
        for text in [
            "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
        ] {
            let mut s = ToolCallStream::new(ToolCallFormat::Hermes);
            let mut events = vec![];
            for c in text.chars() {
                events.extend(s.push(&c.to_string()));
            }
            events.extend(s.finish());
            assert_eq!(events.len(), 1, "{text}: {events:?}");
            assert!(
                matches!(&events[0], ToolEvent::Call(c) if c.name == "f"),
                "{events:?}"
            );
        }
        // a streamed call, then one that does not stream
        let p = streamed(
            ToolCallFormat::Llama3Json,
            "{\"name\": \"a\", \"parameters\": {}}; {\"parameters\": {\"x\": 1}, \"name\": \"b\"}",
        );
        assert_eq!(p.tool_calls, vec![call("a", "{}"), call("b", r#"{"x":1}"#)]);
        assert_eq!(p.content, "");
        // braces and brackets inside argument strings do not end the arguments
        let p = streamed(
            ToolCallFormat::Hermes,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"s\": \"}]{\\\"\"}}</tool_call>after",
        );
        assert_eq!(p.tool_calls, vec![call("f", r#"{"s": "}]{\""}"#)]);
        assert_eq!(p.content, "after");
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
