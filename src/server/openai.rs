//! OpenAI request parsing and response bodies.
//!
//! Requests are read field by field from a JSON object, so every error names
//! the field (`param`) and says what was wrong. Unknown fields are ignored;
//! known fields that ask for something this server does not do (`echo`, `suffix`,
//! `best_of > n`, `functions`, audio, ...) are refused with 400. `response_format` and a
//! `required` / named `tool_choice` become a [`Constraint`] for constrained decoding.
use serde_json::{json, Map, Value};

use super::error::ApiError;
use crate::engine::generate::FinishReason;
use crate::engine::grammar::Constraint;
use crate::engine::sampler::{SamplingParams, MAX_TOP_LOGPROBS};
use crate::engine::scheduler::{TokenInfo, Usage};
use crate::tokenizer::chat::ChatMessage;
use crate::tokenizer::tool_calls::ToolCall;
use crate::tokenizer::Tokenizer;

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Chat(Vec<ChatMessage>),
    Text(String),
    Ids(Vec<u32>),
}

/// A parsed request of either endpoint.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub api: Api,
    pub model: Option<String>,
    pub prompt: PromptInput,
    /// `max_completion_tokens` or `max_tokens`, when given.
    pub max_tokens: Option<usize>,
    pub params: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// `response_format` `json_object` / `json_schema`, a `required` / named
    /// `tool_choice`, or `guided_regex`: what the output must match.
    pub constraint: Option<Constraint>,
    /// The field the constraint came from (for errors about it).
    pub constraint_param: &'static str,
    /// Choices to generate (`n`), each its own sequence.
    pub n: usize,
    /// Chat `tools` (function tools, as sent), rendered by the chat template.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// vLLM's `chat_template_kwargs`: extra chat-template variables (e.g.
    /// `{"enable_thinking": false}`).
    pub chat_template_kwargs: Map<String, Value>,
    /// vLLM's `return_tokens_as_token_ids`: log-probability entries name their tokens
    /// `token_id:{id}` instead of the token's text (which may be part of a character).
    pub tokens_as_ids: bool,
}

impl GenRequest {
    /// The extra chat-template variables: `chat_template_kwargs`, and `tools` unless
    /// `tool_choice` is none.
    pub fn template_vars(&self) -> Value {
        let mut vars = self.chat_template_kwargs.clone();
        if self.tool_choice != ToolChoice::None {
            vars.insert("tools".into(), Value::Array(self.tools.clone()));
        }
        Value::Object(vars)
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// No tools, or `"none"`: the tools are not rendered and the output is plain content.
    None,
    /// `"auto"` (the default with tools): the model's tool-call text is parsed.
    Auto,
    /// `"required"`: the output is constrained to a list of one or more calls.
    Required,
    /// `"required"` with `parallel_tool_calls: false`: a list of exactly one call.
    RequiredOne,
    /// `{"type": "function", "function": {"name": …}}`: the output is one call of it.
    Named(String),
}

/// `tools` and `tool_choice` (chat only). Each tool must be
/// `{"type": "function", "function": {"name", "description"?, "parameters"?}}`.
fn parse_tools(api: Api, f: &Fields) -> Result<(Vec<Value>, ToolChoice), ApiError> {
    let tools: Vec<Value> = match f.get("tools") {
        None => vec![],
        Some(Value::Array(a)) => a.clone(),
        Some(v) => return Err(Fields::wrong("tools", "an array of tools", v)),
    };
    if api == Api::Completions {
        if !tools.is_empty() {
            return Err(ApiError::unsupported("tools", "tools on /v1/completions"));
        }
        match f.get("tool_choice") {
            None => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(_) => {
                return Err(ApiError::unsupported(
                    "tool_choice",
                    "tool_choice on /v1/completions",
                ))
            }
        }
    }
    let mut names = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Some(o) = t.as_object() else {
            return Err(Fields::wrong(&at, "a tool object", t));
        };
        match o.get("type").and_then(Value::as_str) {
            Some("function") => {}
            _ => {
                return Err(ApiError::invalid(
                    format!("{at}.type"),
                    format!("'{at}.type' must be \"function\""),
                ))
            }
        }
        let Some(func) = o.get("function").and_then(Value::as_object) else {
            return Err(ApiError::invalid(
                format!("{at}.function"),
                format!("'{at}.function' must be an object"),
            ));
        };
        let Some(name) = func
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        else {
            return Err(ApiError::invalid(
                format!("{at}.function.name"),
                format!("'{at}.function.name' must be a non-empty string"),
            ));
        };
        match func.get("parameters") {
            None | Some(Value::Null) | Some(Value::Object(_)) => {}
            Some(v) => {
                return Err(Fields::wrong(
                    &format!("{at}.function.parameters"),
                    "a JSON schema (an object)",
                    v,
                ))
            }
        }
        names.push(name.to_string());
    }
    let choice = match f.get("tool_choice") {
        None => {
            if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, got {other:?}"),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => ToolChoice::Named(n.to_string()),
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "a named 'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ))
                }
            }
        }
        Some(v) => return Err(Fields::wrong("tool_choice", "a string or an object", v)),
    };
    if tools.is_empty() && choice != ToolChoice::None && f.get("tool_choice").is_some() {
        if choice == ToolChoice::Auto {
            return Ok((tools, ToolChoice::None));
        }
        return Err(ApiError::invalid(
            "tool_choice",
            "'tool_choice' needs 'tools' to choose from",
        ));
    }
    if f.bool("parallel_tool_calls")? == Some(false) {
        match choice {
            ToolChoice::Required => return Ok((tools, ToolChoice::RequiredOne)),
            ToolChoice::Auto => {
                return Err(ApiError::unsupported(
                    "parallel_tool_calls",
                    "parallel_tool_calls: false with tool_choice auto",
                ))
            }
            _ => {}
        }
    }
    if let ToolChoice::Named(n) = &choice {
        if !names.contains(n) {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("'tool_choice' names the function {n:?}, which is not in 'tools'"),
            ));
        }
    }
    Ok((tools, choice))
}

/// The constraint of `tool_choice` `required` (a JSON list of one or more
/// `{"name", "arguments"}` calls of the tools) or named (one such call of that function).
pub fn tool_constraint(tools: &[Value], choice: &ToolChoice) -> Option<Constraint> {
    let call = |t: &Value| {
        let f = &t["function"];
        let params = match f.get("parameters") {
            Some(p @ Value::Object(_)) => p.clone(),
            _ => json!({"type": "object"}),
        };
        json!({
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": false
        })
    };
    match choice {
        ToolChoice::None | ToolChoice::Auto => None,
        ToolChoice::Required | ToolChoice::RequiredOne => {
            let mut list = json!({
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": tools.iter().map(call).collect::<Vec<_>>()}
            });
            if *choice == ToolChoice::RequiredOne {
                list["maxItems"] = json!(1);
            }
            Some(Constraint::JsonSchema(list))
        }
        ToolChoice::Named(n) => tools
            .iter()
            .find(|t| t["function"]["name"] == json!(n))
            .map(|t| Constraint::JsonSchema(call(t))),
    }
}

/// The calls in the output of a `required` / named `tool_choice` (its constraint's
/// JSON: a list of calls, or one call); `None` when it is not complete JSON (cut short
/// by `max_tokens`).
pub fn forced_tool_calls(text: &str) -> Option<Vec<ToolCall>> {
    let v: Value = serde_json::from_str(text).ok()?;
    let calls = match v {
        Value::Array(a) => a,
        one @ Value::Object(_) => vec![one],
        _ => return None,
    };
    calls
        .into_iter()
        .map(|c| {
            Some(ToolCall {
                name: c.get("name")?.as_str()?.to_string(),
                arguments: c.get("arguments")?.to_string(),
            })
        })
        .collect()
}

/// `tool_calls` of a message or delta: `[{"id", "type": "function", "function": {"name",
/// "arguments"}}]`, with `index` in stream deltas.
pub fn tool_calls_json(
    calls: &[ToolCall],
    first_index: Option<usize>,
    ids: &mut impl FnMut() -> String,
) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let mut v = json!({
                    "id": ids(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if let Some(i) = first_index {
                    v["index"] = json!(i + k);
                }
                v
            })
            .collect(),
    )
}

/// Most choices (`n`) one request may ask for.
pub const MAX_N: i64 = 16;

impl GenRequest {
    /// The name of the prompt field (for errors).
    pub fn prompt_param(&self) -> &'static str {
        match self.api {
            Api::Chat => "messages",
            Api::Completions => "prompt",
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed access to the fields of a request object; `null` counts as absent.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn wrong(name: &str, expected: &str, v: &Value) -> ApiError {
        ApiError::invalid(
            name,
            format!("'{name}' must be {expected}, got {}", type_name(v)),
        )
    }

    fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| Self::wrong(name, "a number", v)),
        }
    }

    fn f32(&self, name: &str) -> Result<Option<f32>, ApiError> {
        Ok(self.number(name)?.map(|x| x as f32))
    }

    fn int(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => {
                if let Some(i) = v.as_i64() {
                    return Ok(Some(i));
                }
                if let Some(u) = v.as_u64() {
                    return Ok(Some(u.min(i64::MAX as u64) as i64));
                }
                match v.as_f64() {
                    Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
                    _ => Err(Self::wrong(name, "an integer", v)),
                }
            }
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| Self::wrong(name, "a boolean", v)),
        }
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| Self::wrong(name, "a string", v)),
        }
    }
}

/// Parse a request body (already known to be JSON) for `api`.
pub fn parse(api: Api, body: &Value) -> Result<GenRequest, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_request(format!(
            "the request body must be a JSON object, got {}",
            type_name(body)
        )));
    };
    let f = Fields(obj);
    refuse_unsupported(&f)?;
    let model = f.string("model")?.map(str::to_string);
    let prompt = match api {
        Api::Chat => PromptInput::Chat(parse_messages(obj.get("messages"))?),
        Api::Completions => parse_prompt(obj.get("prompt"))?,
    };
    let max_tokens = match f.int("max_completion_tokens")? {
        Some(n) => Some(("max_completion_tokens", n)),
        None => f.int("max_tokens")?.map(|n| ("max_tokens", n)),
    };
    let max_tokens = match max_tokens {
        None => None,
        Some((name, n)) if n < 1 => {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' must be at least 1, got {n}"),
            ))
        }
        Some((_, n)) => Some(n as usize),
    };
    let mut params = SamplingParams::default();
    if let Some(t) = f.f32("temperature")? {
        params.temperature = t;
    }
    if let Some(p) = f.f32("top_p")? {
        params.top_p = p;
    }
    if let Some(k) = f.int("top_k")? {
        if k < -1 {
            return Err(ApiError::invalid(
                "top_k",
                format!("'top_k' must be -1 (off), 0 (off) or positive, got {k}"),
            ));
        }
        params.top_k = k.clamp(0, u32::MAX as i64) as u32;
    }
    if let Some(m) = f.f32("min_p")? {
        params.min_p = m;
    }
    if let Some(r) = f.f32("repetition_penalty")? {
        params.repetition_penalty = r;
    }
    if let Some(p) = f.f32("presence_penalty")? {
        params.presence_penalty = p;
    }
    if let Some(p) = f.f32("frequency_penalty")? {
        params.frequency_penalty = p;
    }
    if let Some(s) = f.int("seed")? {
        params.seed = Some(s as u64);
    }
    match api {
        Api::Chat => {
            params.logprobs = f.bool("logprobs")?.unwrap_or(false);
            if let Some(n) = f.int("top_logprobs")? {
                if !(0..=MAX_TOP_LOGPROBS as i64).contains(&n) {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        format!("'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                    ));
                }
                if n > 0 && !params.logprobs {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        "'top_logprobs' requires 'logprobs' to be true",
                    ));
                }
                params.top_logprobs = n as u32;
            }
        }
        Api::Completions => {
            let n = match f.get("logprobs") {
                Some(Value::Bool(b)) => b.then_some(0),
                _ => f.int("logprobs")?,
            };
            if let Some(n) = n {
                if !(0..=MAX_TOP_LOGPROBS as i64).contains(&n) {
                    return Err(ApiError::invalid(
                        "logprobs",
                        format!("'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                    ));
                }
                params.logprobs = true;
                params.top_logprobs = n as u32;
            }
        }
    }
    params.logit_bias = parse_logit_bias(f.get("logit_bias"))?;
    if let Err(msg) = params.validate() {
        let param = msg.split_whitespace().next().unwrap_or("").to_string();
        return Err(ApiError::invalid(param, msg));
    }
    let stop = match f.get("stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, v) in items.iter().enumerate() {
                match v {
                    Value::String(s) => out.push(s.clone()),
                    other => {
                        return Err(ApiError::invalid(
                            "stop",
                            format!(
                                "'stop' must be a string or a list of strings; item {i} is {}",
                                type_name(other)
                            ),
                        ))
                    }
                }
            }
            out
        }
        Some(v) => return Err(Fields::wrong("stop", "a string or a list of strings", v)),
    };
    let (tools, tool_choice) = parse_tools(api, &f)?;
    let mut constraint = parse_response_format(f.get("response_format"))?;
    let mut constraint_param = match constraint {
        Some(Constraint::JsonSchema(_)) => "response_format.json_schema",
        _ => "response_format",
    };
    if let Some(c) = tool_constraint(&tools, &tool_choice) {
        constraint_param = "tools";
        if constraint.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a 'required' or named 'tool_choice' cannot be combined with a JSON 'response_format'",
            ));
        }
        constraint = Some(c);
    }
    if let Some(r) = f.string("guided_regex")? {
        if constraint.is_some() {
            return Err(ApiError::invalid(
                "guided_regex",
                "'guided_regex' cannot be combined with a JSON 'response_format' or a 'required' or named 'tool_choice'",
            ));
        }
        constraint = Some(Constraint::Regex(r.to_string()));
        constraint_param = "guided_regex";
    }
    let chat_template_kwargs = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) if api == Api::Chat => o.clone(),
        Some(Value::Object(_)) => {
            return Err(ApiError::unsupported(
                "chat_template_kwargs",
                "chat_template_kwargs on /v1/completions",
            ))
        }
        Some(v) => return Err(Fields::wrong("chat_template_kwargs", "an object", v)),
    };
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o)
            .bool("include_usage")
            .map_err(|_| {
                ApiError::invalid(
                    "stream_options.include_usage",
                    "'stream_options.include_usage' must be a boolean",
                )
            })?
            .unwrap_or(false),
        Some(v) => return Err(Fields::wrong("stream_options", "an object", v)),
    };
    Ok(GenRequest {
        api,
        model,
        prompt,
        max_tokens,
        params,
        stop,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        skip_special_tokens: f.bool("skip_special_tokens")?.unwrap_or(true),
        tokens_as_ids: f.bool("return_tokens_as_token_ids")?.unwrap_or(false),
        stream,
        include_usage,
        constraint,
        constraint_param,
        tools,
        tool_choice,
        chat_template_kwargs,
        n: match f.int("n")?.unwrap_or(1) {
            n @ 1..=MAX_N => n as usize,
            n => {
                return Err(ApiError::invalid(
                    "n",
                    format!("'n' must be between 1 and {MAX_N}, got {n}"),
                ))
            }
        },
    })
}

/// `logit_bias`: `{"token id": bias}`, bias in [-100, 100] (ids are checked against the
/// vocabulary later).
fn parse_logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let m = match v {
        None => return Ok(vec![]),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(Fields::wrong(
                "logit_bias",
                "an object of token id to bias",
                v,
            ))
        }
    };
    let mut out = Vec::with_capacity(m.len());
    for (k, b) in m {
        let t: u32 = k.trim().parse().map_err(|_| {
            ApiError::invalid(
                "logit_bias",
                format!("'logit_bias' keys must be token ids, got {k:?}"),
            )
        })?;
        let b = b
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!(
                        "'logit_bias' values must be numbers in [-100, 100], got {b} for token {t}"
                    ),
                )
            })?;
        out.push((t, b as f32));
    }
    Ok(out)
}

/// `response_format`: `text` (no constraint), `json_object` or `json_schema`
/// (`{"name", "schema", "strict", "description"}`; the schema is enforced whether or not
/// `strict` is set). The schema itself is checked when the grammar is built.
fn parse_response_format(v: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(Fields::wrong("response_format", "an object", v)),
    };
    let f = Fields(o);
    let kind = f.string("type").map_err(|_| {
        ApiError::invalid(
            "response_format.type",
            "'response_format.type' must be a string",
        )
    })?;
    match kind {
        None => Err(ApiError::invalid(
            "response_format.type",
            "'response_format' needs a 'type': \"text\", \"json_object\" or \"json_schema\"",
        )),
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let param = "response_format.json_schema";
            let js = match o.get("json_schema") {
                Some(Value::Object(js)) => js,
                None => {
                    return Err(ApiError::invalid(
                        param,
                        "'response_format' of type \"json_schema\" needs a 'json_schema' object",
                    ))
                }
                Some(v) => return Err(Fields::wrong(param, "an object", v)),
            };
            let jf = Fields(js);
            let wrong = |name: &str, what: &str| {
                ApiError::invalid(
                    format!("{param}.{name}"),
                    format!("'{param}.{name}' must be {what}"),
                )
            };
            jf.string("name").map_err(|_| wrong("name", "a string"))?;
            jf.string("description")
                .map_err(|_| wrong("description", "a string"))?;
            jf.bool("strict").map_err(|_| wrong("strict", "a boolean"))?;
            let schema = match js.get("schema") {
                None => json!({}),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                Some(_) => return Err(wrong("schema", "a JSON schema (an object)")),
            };
            Ok(Some(Constraint::JsonSchema(schema)))
        }
        Some(other) => Err(ApiError::invalid(
            "response_format.type",
            format!(
                "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got {other:?}"
            ),
        )),
    }
}

/// 400 for fields that ask for what this server does not do.
fn refuse_unsupported(f: &Fields) -> Result<(), ApiError> {
    // best_of > n (keep the n most likely of best_of) is not done; best_of = n is plain n
    if let Some(b) = f.int("best_of")? {
        let n = f.int("n")?.unwrap_or(1);
        if b != 1 && b != n {
            return Err(ApiError::unsupported(
                "best_of",
                "best_of other than 1 or n",
            ));
        }
    }
    if f.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::unsupported("echo", "echo"));
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix", "suffix"));
    }
    // the legacy function-calling fields: use `tools` / `tool_choice`
    match f.get("functions") {
        None => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "functions",
                "`functions` (use `tools`)",
            ))
        }
    }
    match f.get("function_call") {
        None => {}
        Some(Value::String(s)) if s == "none" => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "function_call",
                "`function_call` (use `tool_choice`)",
            ))
        }
    }
    match f.get("modalities") {
        None => {}
        Some(Value::Array(a)) if a.iter().all(|m| m.as_str() == Some("text")) => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "modalities",
                "output other than text",
            ))
        }
    }
    for name in ["audio", "prediction", "web_search_options"] {
        if f.get(name).is_some() {
            return Err(ApiError::unsupported(name, name));
        }
    }
    Ok(())
}

fn parse_messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match v {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("messages", "'messages' is required"))
        }
        Some(Value::Array(a)) => a,
        Some(v) => return Err(Fields::wrong("messages", "an array of messages", v)),
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(o) = m.as_object() else {
            return Err(Fields::wrong(&at, "an object", m));
        };
        let role = match o.get("role") {
            Some(Value::String(r)) => r.as_str(),
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    format!("'{at}.role' is required"),
                ))
            }
            Some(v) => return Err(Fields::wrong(&format!("{at}.role"), "a string", v)),
        };
        let role = match role {
            "system" | "user" | "assistant" | "tool" => role,
            "developer" => "system",
            other => {
                return Err(ApiError::invalid(
                    format!("{at}.role"),
                    format!(
                        "'{at}.role' must be one of system, user, assistant, tool (got '{other}')"
                    ),
                ))
            }
        };
        let mut fields = Map::new();
        match o.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) if role == "assistant" => {
                fields.insert(
                    "tool_calls".into(),
                    Value::Array(message_tool_calls(&at, calls)?),
                );
            }
            Some(Value::Array(_)) => {
                return Err(ApiError::invalid(
                    format!("{at}.tool_calls"),
                    format!("'{at}.tool_calls' is only allowed in assistant messages"),
                ))
            }
            Some(v) => return Err(Fields::wrong(&format!("{at}.tool_calls"), "an array", v)),
        }
        for key in ["tool_call_id", "name"] {
            match o.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(v)) => {
                    fields.insert(key.into(), Value::String(v.clone()));
                }
                Some(v) => return Err(Fields::wrong(&format!("{at}.{key}"), "a string", v)),
            }
        }
        let content = match o.get("content") {
            None | Some(Value::Null) if role == "assistant" => String::new(),
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(
                    format!("{at}.content"),
                    format!("'{at}.content' is required"),
                ))
            }
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, p) in parts.iter().enumerate() {
                    let pat = format!("{at}.content[{j}]");
                    let Some(po) = p.as_object() else {
                        return Err(Fields::wrong(&pat, "a content part object", p));
                    };
                    match po.get("type").and_then(Value::as_str) {
                        Some("text") => match po.get("text") {
                            Some(Value::String(t)) => texts.push(t.clone()),
                            Some(v) => {
                                return Err(Fields::wrong(&format!("{pat}.text"), "a string", v))
                            }
                            None => {
                                return Err(ApiError::invalid(
                                    format!("{pat}.text"),
                                    format!("'{pat}.text' is required"),
                                ))
                            }
                        },
                        Some(other) => {
                            return Err(ApiError::unsupported(
                                &format!("{pat}.type"),
                                &format!("content of type '{other}' (only text)"),
                            ))
                        }
                        None => {
                            return Err(ApiError::invalid(
                                format!("{pat}.type"),
                                format!("'{pat}.type' is required"),
                            ))
                        }
                    }
                }
                texts.join("\n")
            }
            Some(v) => {
                return Err(Fields::wrong(
                    &format!("{at}.content"),
                    "a string or an array of content parts",
                    v,
                ))
            }
        };
        let mut msg = ChatMessage::new(role, content);
        msg.fields = fields;
        out.push(msg);
    }
    Ok(out)
}

/// An assistant message's `tool_calls` for the chat template: each
/// `{"id", "type": "function", "function": {"name", "arguments"}}`, with `arguments` (a
/// JSON string in the API) turned into the object templates expect (kept as a string
/// if it is not JSON).
fn message_tool_calls(at: &str, calls: &[Value]) -> Result<Vec<Value>, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let cat = format!("{at}.tool_calls[{k}]");
            let name = c["function"]["name"].as_str().ok_or_else(|| {
                ApiError::invalid(
                    format!("{cat}.function.name"),
                    format!("'{cat}.function.name' must be a string"),
                )
            })?;
            let arguments = match &c["function"]["arguments"] {
                Value::String(a) => serde_json::from_str::<Value>(a)
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| Value::String(a.clone())),
                Value::Null => json!({}),
                a @ Value::Object(_) => a.clone(),
                v => {
                    return Err(Fields::wrong(
                        &format!("{cat}.function.arguments"),
                        "a string",
                        v,
                    ))
                }
            };
            let mut call = json!({
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            });
            if let Some(id) = c.get("id").and_then(Value::as_str) {
                call["id"] = json!(id);
            }
            Ok(call)
        })
        .collect()
}

fn parse_prompt(v: Option<&Value>) -> Result<PromptInput, ApiError> {
    let ids_of = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter()
            .map(|x| {
                x.as_u64()
                    .filter(|&i| i <= u32::MAX as u64)
                    .map(|i| i as u32)
            })
            .collect()
    };
    match v {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(Value::String(s)) => Ok(PromptInput::Text(s.clone())),
        Some(Value::Array(a)) if a.is_empty() => {
            Err(ApiError::invalid("prompt", "'prompt' must not be empty"))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            if a.len() > 1 {
                return Err(ApiError::unsupported(
                    "prompt",
                    "a batch of several prompts (send one request per prompt)",
                ));
            }
            Ok(PromptInput::Text(
                a[0].as_str().unwrap_or_default().to_string(),
            ))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => match ids_of(a) {
            Some(ids) => Ok(PromptInput::Ids(ids)),
            None => Err(ApiError::invalid(
                "prompt",
                "token ids in 'prompt' must be non-negative integers",
            )),
        },
        Some(Value::Array(a)) if a.iter().all(Value::is_array) => {
            if a.len() > 1 {
                return Err(ApiError::unsupported(
                    "prompt",
                    "a batch of several prompts (send one request per prompt)",
                ));
            }
            match a[0].as_array().and_then(|x| ids_of(x)) {
                Some(ids) => Ok(PromptInput::Ids(ids)),
                None => Err(ApiError::invalid(
                    "prompt",
                    "token ids in 'prompt' must be non-negative integers",
                )),
            }
        }
        Some(v) => Err(Fields::wrong(
            "prompt",
            "a string, a list of one string, or a list of token ids",
            v,
        )),
    }
}

// ---- responses ----

pub fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

pub fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// Log-probabilities are finite in practice; JSON has no -inf.
fn lp(x: f32) -> f64 {
    if x.is_finite() {
        x as f64
    } else {
        -9999.0
    }
}

fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// How log-probability entries name tokens: by their text, or as `token_id:{id}`
/// (`return_tokens_as_token_ids`).
#[derive(Clone, Copy)]
pub struct TokenNames<'a> {
    pub tokenizer: &'a Tokenizer,
    pub as_ids: bool,
}

impl TokenNames<'_> {
    fn name(&self, id: u32) -> String {
        match self.as_ids {
            true => format!("token_id:{id}"),
            false => token_text(self.tokenizer, id),
        }
    }

    /// The name and the UTF-8 bytes of the token's own text.
    fn name_and_bytes(&self, id: u32) -> (String, Vec<u8>) {
        let text = token_text(self.tokenizer, id);
        let bytes = text.as_bytes().to_vec();
        match self.as_ids {
            true => (self.name(id), bytes),
            false => (text, bytes),
        }
    }
}

/// One entry of chat `logprobs.content`.
pub fn chat_logprob(names: TokenNames<'_>, t: &TokenInfo) -> Value {
    let (name, bytes) = names.name_and_bytes(t.id);
    let top: Vec<Value> = t
        .top_logprobs
        .iter()
        .map(|&(id, l)| {
            let (s, b) = names.name_and_bytes(id);
            json!({"token": s, "logprob": lp(l), "bytes": b})
        })
        .collect();
    json!({
        "token": name,
        "logprob": lp(t.logprob.unwrap_or(0.0)),
        "bytes": bytes,
        "top_logprobs": top,
    })
}

/// Completions `logprobs` for tokens that start at the given text offsets.
pub fn completion_logprobs(
    names: TokenNames<'_>,
    tokens: &[(TokenInfo, usize)],
    top: bool,
) -> Value {
    let mut texts = Vec::with_capacity(tokens.len());
    let mut lps = Vec::with_capacity(tokens.len());
    let mut tops = Vec::with_capacity(tokens.len());
    let mut offsets = Vec::with_capacity(tokens.len());
    for (t, off) in tokens {
        texts.push(names.name(t.id));
        lps.push(lp(t.logprob.unwrap_or(0.0)));
        offsets.push(*off);
        if top {
            let mut m = Map::new();
            for &(id, l) in &t.top_logprobs {
                m.insert(names.name(id), json!(lp(l)));
            }
            tops.push(Value::Object(m));
        }
    }
    json!({
        "tokens": texts,
        "token_logprobs": lps,
        "top_logprobs": if top { Value::Array(tops) } else { Value::Null },
        "text_offset": offsets,
    })
}

/// The fixed parts of every response / chunk of one request.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Envelope {
    /// One choice of a chat response.
    pub fn chat_choice(
        index: usize,
        message: Value,
        finish: &str,
        logprobs: Option<Vec<Value>>,
    ) -> Value {
        json!({
            "index": index,
            "message": message,
            "logprobs": logprobs.map(|c| json!({"content": c})),
            "finish_reason": finish,
        })
    }

    /// One choice of a completion response.
    pub fn completion_choice(
        index: usize,
        text: &str,
        finish: FinishReason,
        logprobs: Option<Value>,
    ) -> Value {
        json!({
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_str(finish),
        })
    }

    /// A whole (not streamed) response with these choices.
    pub fn response(&self, api: Api, choices: Vec<Value>, usage: Usage) -> Value {
        json!({
            "id": self.id,
            "object": match api {
                Api::Chat => "chat.completion",
                Api::Completions => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_json(usage),
        })
    }

    /// A streaming chat chunk of choice `index`; `usage` is `Some(null)` in chunks of a
    /// stream with `include_usage`, absent otherwise.
    pub fn chat_chunk(
        &self,
        index: usize,
        delta: Value,
        logprobs: Option<Value>,
        finish: Option<&str>,
        include_usage: bool,
    ) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
            }],
        });
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    pub fn completion_chunk(
        &self,
        index: usize,
        text: &str,
        logprobs: Option<Value>,
        finish: Option<FinishReason>,
        include_usage: bool,
    ) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish.map(finish_str),
            }],
        });
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The last chunk of a stream with `include_usage`: no choices, the usage.
    pub fn usage_chunk(&self, api: Api, usage: Usage) -> Value {
        json!({
            "id": self.id,
            "object": match api {
                Api::Chat => "chat.completion.chunk",
                Api::Completions => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_json(usage),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(api: Api, v: Value) -> Result<GenRequest, ApiError> {
        parse(api, &v)
    }

    #[test]
    fn parses_chat_and_names_bad_fields() {
        let r = p(
            Api::Chat,
            json!({"model": "m", "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ], "max_completion_tokens": 5, "temperature": 0.5, "seed": 3, "stop": "x",
               "logprobs": true, "top_logprobs": 2, "stream": true,
               "stream_options": {"include_usage": true}, "top_k": -1}),
        )
        .unwrap();
        assert_eq!(
            r.prompt,
            PromptInput::Chat(vec![
                ChatMessage::new("system", "s"),
                ChatMessage::new("user", "a\nb")
            ])
        );
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.params.seed, Some(3));
        assert_eq!(r.params.top_logprobs, 2);
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert!(r.stream && r.include_usage);
        let bad = |v: Value| p(Api::Chat, v).unwrap_err().param.unwrap_or_default();
        let m = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(bad(json!({"messages": m, "max_tokens": -3})), "max_tokens");
        assert_eq!(
            bad(json!({"messages": m, "temperature": "hot"})),
            "temperature"
        );
        assert_eq!(
            bad(json!({"messages": m, "temperature": -1})),
            "temperature"
        );
        assert_eq!(bad(json!({"messages": m, "n": 0})), "n");
        assert_eq!(bad(json!({"messages": m, "n": 17})), "n");
        assert_eq!(bad(json!({"messages": m, "best_of": 3})), "best_of");
        assert_eq!(bad(json!({"messages": m, "n": 2, "best_of": 3})), "best_of");
        let r = p(Api::Chat, json!({"messages": m, "n": 3, "best_of": 3})).unwrap();
        assert_eq!(r.n, 3);
        assert_eq!(bad(json!({"messages": m, "echo": true})), "echo");
        assert_eq!(bad(json!({"messages": m, "suffix": "x"})), "suffix");
        assert_eq!(
            bad(json!({"messages": m, "tools": [{"type": "function"}]})),
            "tools[0].function"
        );
        assert_eq!(
            bad(
                json!({"messages": m, "tools": [{"type": "function", "function": {"name": "f"}}],
                       "tool_choice": {"type": "function", "function": {"name": "g"}}})
            ),
            "tool_choice"
        );
        assert_eq!(
            bad(
                json!({"messages": m, "tools": [{"type": "function", "function": {"name": "f"}}],
                       "tool_choice": "required", "response_format": {"type": "json_object"}})
            ),
            "tool_choice"
        );
        let r = p(
            Api::Chat,
            json!({"messages": [
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                  "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}
            ], "tools": [{"type": "function", "function": {"name": "f"}}]}),
        )
        .unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Auto);
        let PromptInput::Chat(ms) = &r.prompt else {
            panic!()
        };
        assert_eq!(
            ms[0].fields["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1}),
            "arguments become an object for the template"
        );
        assert_eq!(ms[1].fields["tool_call_id"], "c1");
        assert_eq!(
            bad(json!({"messages": m, "response_format": {"type": "xml"}})),
            "response_format.type"
        );
        assert_eq!(
            bad(json!({"messages": m, "response_format": {"type": "json_schema"}})),
            "response_format.json_schema"
        );
        assert_eq!(
            bad(
                json!({"messages": m, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}})
            ),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            bad(
                json!({"messages": m, "response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}})
            ),
            "response_format.json_schema.strict"
        );
        let r = p(
            Api::Chat,
            json!({"messages": m, "response_format": {"type": "json_object"}}),
        )
        .unwrap();
        assert_eq!(r.constraint, Some(Constraint::JsonObject));
        assert_eq!(
            bad(json!({"messages": m, "top_logprobs": 2})),
            "top_logprobs"
        );
        assert_eq!(bad(json!({"messages": "hi"})), "messages");
        assert_eq!(bad(json!({})), "messages");
        assert_eq!(
            bad(json!({"messages": [{"role": "robot", "content": "x"}]})),
            "messages[0].role"
        );
        assert_eq!(
            bad(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})),
            "messages[0].content[0].type"
        );
    }

    #[test]
    fn parses_completion_prompts() {
        let r = p(
            Api::Completions,
            json!({"prompt": ["hello"], "logprobs": 3}),
        )
        .unwrap();
        assert_eq!(r.prompt, PromptInput::Text("hello".into()));
        assert!(r.params.logprobs);
        assert_eq!(r.params.top_logprobs, 3);
        let r = p(Api::Completions, json!({"prompt": [1, 2, 3]})).unwrap();
        assert_eq!(r.prompt, PromptInput::Ids(vec![1, 2, 3]));
        let e = p(Api::Completions, json!({"prompt": ["a", "b"]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = p(Api::Completions, json!({"prompt": "a", "echo": true})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"));
        let e = p(Api::Completions, json!({"prompt": "a", "best_of": 2})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("best_of"));
        let e = p(Api::Completions, json!({"prompt": 5})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }
}
