//! The HTTP surface: routes, auth, body handling, streaming (SSE) and the
//! fallbacks that keep every error in OpenAI's JSON shape.
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;

use super::error::ApiError;
use super::metrics::Metrics;
use super::openai::{self, Api, Envelope, GenRequest, PromptInput, ToolChoice};
use super::{Engine, EventReceiver, ModelInfo, BODY_LIMIT};
use crate::engine::generate::FinishReason;
use crate::engine::grammar::{Constraint, GrammarMatcher};
use crate::engine::scheduler::{Event, Request as EngineRequest, TokenInfo, Usage};
use crate::tokenizer::reasoning::{
    prompt_opens_reasoning, split_reasoning, ReasoningEvent, ReasoningStream,
};
use crate::tokenizer::tool_calls::{ToolCallStream, ToolEvent};
use crate::tokenizer::Tokenizer;

pub struct AppState {
    pub engine: Arc<Engine>,
    pub metrics: Arc<Metrics>,
    pub model: ModelInfo,
    pub api_key: Option<String>,
    /// Server start (unix seconds), the `created` of the model.
    pub created: u64,
    /// `--body-timeout`: a request body must arrive whole within this.
    pub body_timeout: Duration,
    /// Bounds the tokenizer work running at once (see [`tokenize`]).
    pub tokenizing: tokio::sync::Semaphore,
}

/// More request headers than this get a JSON 431.
pub const MAX_HEADERS: usize = 100;
/// A request head (names and values of all headers) over this many bytes gets a JSON 431.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// Bodies at least this large hand the freed memory back to the OS after the request.
const TRIM_AFTER_BYTES: usize = 1 << 20;

type St = State<Arc<AppState>>;

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::map_response(json_errors))
        .layer(middleware::from_fn(header_limits))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// The routes of a connection over `--max-connections`: `/health` and
/// `/metrics`; anything else gets 503, and every response closes the connection.
pub fn overflow_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(too_many_connections)
        .layer(middleware::map_response(json_errors))
        .layer(middleware::map_response(close_connection))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

async fn too_many_connections() -> ApiError {
    ApiError::unavailable(
        "too many connections (--max-connections): only /health and /metrics are served on this one",
    )
    .with_code("too_many_connections")
}

async fn close_connection(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// 431 as JSON for heads hyper accepted but that are over this server's limits.
async fn header_limits(req: Request, next: Next) -> Response {
    let h = req.headers();
    let bytes: usize = h.iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
    if h.len() > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
        return ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "invalid_request_error",
            format!(
                "the request has {} headers of {bytes} bytes; the limits are {MAX_HEADERS} headers and {MAX_HEADER_BYTES} bytes",
                h.len()
            ),
        )
        .with_code("request_header_fields_too_large")
        .into_response();
    }
    next.run(req).await
}

/// Every error response in OpenAI's JSON shape: a response of the framework's
/// own (a rejection's plain text, say) is rewritten with its text as the message.
async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let mut out = ApiError::new(status, kind, message).into_response();
    for (k, v) in &parts.headers {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out
}

/// The route a path belongs to (bounded label values for metrics).
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        _ => "other",
    }
}

async fn count(State(st): St, req: Request, next: Next) -> Response {
    let label = route_label(req.uri().path());
    let resp = next.run(req).await;
    st.metrics.http_response(label, resp.status().as_u16());
    resp
}

async fn auth(State(st): St, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        match given {
            None => {
                return ApiError::unauthorized(
                    "missing API key: send the header 'Authorization: Bearer <key>'",
                )
                .into_response()
            }
            Some(g) if !bool::from(g.as_bytes().ct_eq(key.as_bytes())) => {
                return ApiError::unauthorized("incorrect API key").into_response()
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
    .with_code("unknown_url")
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "method {} is not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
    .with_code("method_not_allowed")
}

async fn health(State(st): St) -> Response {
    match st.engine.unavailable() {
        None => (
            [(header::CONTENT_TYPE, "application/json")],
            json!({"status": "ok"}).to_string(),
        )
            .into_response(),
        Some(e) => e.into_response(),
    }
}

async fn metrics(State(st): St) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

fn model_card(st: &AppState) -> Value {
    json!({
        "id": st.model.name,
        "object": "model",
        "created": st.created,
        "owned_by": "mlxcel",
        "max_model_len": st.model.ctx_size,
    })
}

async fn models(State(st): St) -> Response {
    json_response(json!({"object": "list", "data": [model_card(&st)]}))
}

async fn model(State(st): St, id: Result<Path<String>, PathRejection>) -> Response {
    let id = match id {
        Ok(Path(id)) => id,
        Err(e) => {
            return ApiError::bad_request(format!("the model id in the path is not valid: {e}"))
                .with_code("invalid_path")
                .into_response()
        }
    };
    if id == st.model.name {
        json_response(model_card(&st))
    } else {
        model_not_found(&id).into_response()
    }
}

fn model_not_found(id: &str) -> ApiError {
    ApiError {
        param: Some("model".into()),
        ..ApiError::not_found(format!("the model '{id}' does not exist"))
    }
    .with_code("model_not_found")
}

fn json_response(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

async fn chat(State(st): St, req: Request) -> Response {
    generate(st, req, Api::Chat)
        .await
        .unwrap_or_else(error_response)
}

async fn completions(State(st): St, req: Request) -> Response {
    generate(st, req, Api::Completions)
        .await
        .unwrap_or_else(error_response)
}

/// An error as a response; one that leaves the body unread (408, 413) closes the connection.
fn error_response(e: ApiError) -> Response {
    let close = matches!(
        e.status,
        StatusCode::REQUEST_TIMEOUT | StatusCode::PAYLOAD_TOO_LARGE
    );
    let mut r = e.into_response();
    if close {
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    r
}

/// The body: content type (415), size limit (413) and `--body-timeout` (408).
/// It is gathered in one buffer as it arrives (each chunk freed once copied),
/// so the JSON parse can borrow its strings.
async fn read_body(req: Request, timeout: Duration) -> Result<Vec<u8>, ApiError> {
    check_content_type(req.headers())?;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > BODY_LIMIT as u64) {
        return Err(ApiError::too_large(BODY_LIMIT));
    }
    let capacity = declared.unwrap_or(0) as usize;
    let bytes = match tokio::time::timeout(timeout, gather(req.into_body(), capacity)).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive whole within {} s (--body-timeout)",
                    timeout.as_secs_f64()
                ),
            )
            .with_code("request_timeout"))
        }
    };
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "the request body is empty; send a JSON object",
        ));
    }
    Ok(bytes)
}

async fn gather(body: Body, capacity: usize) -> Result<Vec<u8>, ApiError> {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut out = Vec::with_capacity(capacity);
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| ApiError::bad_request(format!("reading the request body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > BODY_LIMIT {
                return Err(ApiError::too_large(BODY_LIMIT));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out)
}

fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
}

/// The bytes of text in a JSON value, found without keeping a copy: a string's
/// length, the sum over a list, and over the `text` fields of an object (a
/// chat content part); 0 for anything else.
struct TextLen(usize);

impl<'de> serde::Deserialize<'de> for TextLen {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TextLen, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextLen;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E>(self, s: &str) -> Result<TextLen, E> {
                Ok(TextLen(s.len()))
            }
            fn visit_bool<E>(self, _: bool) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_i64<E>(self, _: i64) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_u64<E>(self, _: u64) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_f64<E>(self, _: f64) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_unit<E>(self) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<TextLen, A::Error> {
                let mut n = 0;
                while let Some(TextLen(x)) = a.next_element()? {
                    n += x;
                }
                Ok(TextLen(n))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<TextLen, A::Error> {
                let mut n = 0;
                while let Some(key) = a.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "text" {
                        n += a.next_value::<TextLen>()?.0;
                    } else {
                        a.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(TextLen(n))
            }
        }
        d.deserialize_any(V)
    }
}

/// Just the prompt text's size of a request body.
#[derive(serde::Deserialize)]
struct PromptView {
    #[serde(default)]
    messages: Option<Vec<MessageView>>,
    #[serde(default)]
    prompt: Option<TextLen>,
}

#[derive(serde::Deserialize)]
struct MessageView {
    #[serde(default)]
    content: Option<TextLen>,
}

/// Bytes of prompt text in a raw body (`None` if its shape is not the usual
/// one; the full parse says what is wrong then).
fn raw_prompt_bytes(api: Api, body: &[u8]) -> Option<usize> {
    let v: PromptView = serde_json::from_slice(body).ok()?;
    match api {
        Api::Chat => Some(
            v.messages?
                .iter()
                .map(|m| m.content.as_ref().map_or(0, |c| c.0))
                .sum(),
        ),
        Api::Completions => v.prompt.map(|p| p.0),
    }
}

/// Hands memory freed by a large request back to the OS (glibc keeps freed
/// heap pages otherwise, and RSS stays at the peak of the largest burst).
async fn release_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let _ = tokio::task::spawn_blocking(|| {
            // SAFETY: malloc_trim only returns free memory to the OS.
            unsafe {
                libc::malloc_trim(0);
            }
        })
        .await;
    }
}

fn check_content_type(h: &HeaderMap) -> Result<(), ApiError> {
    let Some(ct) = h.get(header::CONTENT_TYPE) else {
        return Ok(()); // lenient: a body without a type is read as JSON
    };
    let ct = ct.to_str().unwrap_or("").to_ascii_lowercase();
    let mime = ct.split(';').next().unwrap_or("").trim();
    if mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json")) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            format!("Content-Type must be application/json (got '{mime}')"),
        )
        .with_code("invalid_content_type"))
    }
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:024x}", rand::random::<u128>() >> 32)
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn generate(st: Arc<AppState>, req: Request, api: Api) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let raw = read_body(req, st.body_timeout).await?;
    let len = raw.len();
    let r = generate_raw(st, raw, api, arrived).await;
    if len >= TRIM_AFTER_BYTES {
        release_memory().await;
    }
    r
}

async fn generate_raw(
    st: Arc<AppState>,
    raw: Vec<u8>,
    api: Api,
    arrived: Instant,
) -> Result<Response, ApiError> {
    // the cheap bound, before any copy of the prompt is made
    if let Some(bytes) = raw_prompt_bytes(api, &raw) {
        let (ctx, per_token) = (st.model.ctx_size, st.model.max_token_bytes.max(1));
        if bytes >= ctx.saturating_mul(per_token) {
            let param = match api {
                Api::Chat => "messages",
                Api::Completions => "prompt",
            };
            return Err(bytes_too_long(param, ctx, bytes, per_token));
        }
    }
    let body = parse_json(&raw)?;
    drop(raw);
    let g = openai::parse(api, &body)?;
    drop(body);
    if let Some(m) = &g.model {
        if *m != st.model.name {
            return Err(model_not_found(m));
        }
    }
    if let Some(e) = st.engine.unavailable() {
        return Err(e);
    }
    let vocab = st.model.vocab_size;
    if let Some((t, _)) = g
        .params
        .logit_bias
        .iter()
        .find(|(t, _)| *t as usize >= vocab)
    {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "'logit_bias' token id {t} is out of range (the vocabulary has {vocab} tokens)"
            ),
        ));
    }
    if g.tool_choice == ToolChoice::Auto && st.model.tool_format.is_none() {
        return Err(ApiError::invalid(
            "tool_choice",
            "this model's chat template shows no tool-call format the server can parse; start the server with --tool-call-parser (hermes, llama3_json, mistral), or use tool_choice \"required\" or a named function",
        ));
    }
    let (prompt, opens_reasoning) = tokenize(&st, &g).await?;
    // reasoning is split off chat replies of templates with `<think>` blocks
    // (not of JSON: a `response_format` or forced tool call starts at the first token)
    let json = g.constraint.is_some() && g.constraint_param != "guided_regex";
    let reasoning = (g.api == Api::Chat && st.model.reasoning && !json).then_some(opens_reasoning);
    let ctx = st.model.ctx_size;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            g.prompt_param(),
            "the prompt is empty (0 tokens)",
        ));
    }
    if prompt.len() >= ctx {
        return Err(too_long(
            &g,
            ctx,
            format!("the prompt has {} tokens", prompt.len()),
        ));
    }
    let room = ctx - prompt.len();
    let max_tokens = match (g.max_tokens, api) {
        (Some(n), _) => n.min(room),
        (None, Api::Completions) => 16.min(room),
        (None, Api::Chat) => room,
    };
    let mut rxs = Vec::with_capacity(g.n);
    let mut reqs = Vec::with_capacity(g.n);
    let prompt_len = prompt.len();
    for i in 0..g.n {
        let grammar = match &g.constraint {
            None => None,
            Some(c) => Some(grammar_matcher(&st, c, g.constraint_param).await?),
        };
        let mut params = g.params.clone();
        // choice i: seed + i, so seeded choices differ and each is reproducible
        params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        reqs.push(EngineRequest {
            prompt: prompt.clone(),
            params,
            max_tokens,
            stop: g.stop.clone(),
            ignore_eos: g.ignore_eos,
            skip_special_tokens: g.skip_special_tokens,
            grammar,
            arrived,
            events: tx,
        });
        rxs.push(rx);
    }
    // the choices are queued together and share one prefill of the prompt
    st.engine.submit_all(reqs)?;
    let rx = merge_choices(rxs);
    let env = Envelope {
        id: new_id(match api {
            Api::Chat => "chatcmpl",
            Api::Completions => "cmpl",
        }),
        created: now_secs(),
        model: st.model.name.clone(),
    };
    tracing::debug!(
        "{} submitted: {prompt_len} prompt tokens, max {max_tokens}, {} choice(s)",
        env.id,
        g.n
    );
    if g.stream {
        Ok(stream_response(st, g, env, rx, reasoning))
    } else {
        collect_response(&st, &g, &env, rx, reasoning).await
    }
}

/// The matcher of a request's `response_format` (built off the async threads: the first
/// one builds the vocabulary, and a large schema takes a while); a bad schema is a 400
/// naming `param`, the field it came from (e.g. `response_format.json_schema`).
async fn grammar_matcher(
    st: &Arc<AppState>,
    c: &Constraint,
    param: &'static str,
) -> Result<Box<GrammarMatcher>, ApiError> {
    let (st, c) = (st.clone(), c.clone());
    tokio::task::spawn_blocking(move || {
        let vocab = st.model.grammar_vocab().map_err(|e| {
            ApiError::invalid(
                param,
                format!("constrained decoding is not available for this model's tokenizer: {e}"),
            )
        })?;
        GrammarMatcher::new(vocab, &c)
            .map(Box::new)
            .map_err(|e| ApiError::invalid(param, format!("'{param}': {e}")))
    })
    .await
    .map_err(|e| ApiError::internal(format!("grammar task: {e}")))?
}

fn too_long(g: &GenRequest, ctx: usize, what: String) -> ApiError {
    too_long_for(g.prompt_param(), ctx, what)
}

fn bytes_too_long(param: &str, ctx: usize, bytes: usize, per_token: usize) -> ApiError {
    too_long_for(
        param,
        ctx,
        format!(
            "the prompt has {bytes} bytes of text, and no token of this tokenizer is longer than {per_token} bytes"
        ),
    )
}

fn too_long_for(param: &str, ctx: usize, what: String) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "this model's maximum context length is {ctx} tokens, but {what} (at least one more is needed to generate)"
        ),
    )
    .with_code("context_length_exceeded")
}

/// Bytes of prompt text (of the messages' contents, for chat).
fn prompt_bytes(p: &PromptInput) -> usize {
    match p {
        PromptInput::Chat(messages) => messages.iter().map(|m| m.content.len()).sum(),
        PromptInput::Text(text) => text.len(),
        PromptInput::Ids(_) => 0,
    }
}

/// Texts longer than `ctx ×` this many bytes are first counted by prefixes
/// (see [`surely_too_long`]).
const PREFIX_BYTES_PER_TOKEN: usize = 4;
/// Tokens a prefix cut before a space may have beyond the whole text's (none
/// for the usual tokenizers; a margin all the same).
const PREFIX_SLACK: usize = 8;

/// Whether `text` alone surely has at least `ctx` tokens. It tokenizes prefixes
/// of `ctx × 4` bytes (at least 64 KiB), then 4× longer each time, cut before a
/// space: a prefix with `ctx + 8` tokens answers yes without tokenizing the rest.
/// The tokenizer's memory (tens of bytes per byte of text) is then bounded by
/// the context, not by the body.
fn surely_too_long(tok: &Tokenizer, text: &str, ctx: usize) -> bool {
    let mut n = ctx.saturating_mul(PREFIX_BYTES_PER_TOKEN).max(64 << 10);
    while n < text.len() {
        let cut = cut_before_space(text, n);
        match tok.encode(&text[..cut], false) {
            Ok(ids) if ids.len() >= ctx + PREFIX_SLACK => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
        n = n.saturating_mul(4);
    }
    false
}

/// A cut at most `n` bytes into `text`, on a char boundary and, if there is one in
/// the 4 KiB before, just before a space.
fn cut_before_space(text: &str, n: usize) -> usize {
    let mut i = n.min(text.len());
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    let from = i.saturating_sub(4096);
    match text.as_bytes()[from..i].iter().rposition(|&b| b == b' ') {
        Some(j) if from + j > 0 => from + j,
        _ => i,
    }
}

/// Prompt ids: chat template or plain text (tokenized off the async workers), or ids.
///
/// Bounded work: a prompt whose text cannot fit the context at
/// `max_token_bytes` bytes per token is refused before any tokenizing; long
/// texts are counted by prefixes first ([`surely_too_long`]); and at most a
/// few prompts are tokenized at once (`AppState::tokenizing`).
/// The prompt's token ids, and whether the rendered chat prompt leaves the model inside
/// a `<think>` block (see [`prompt_opens_reasoning`]).
async fn tokenize(st: &AppState, g: &GenRequest) -> Result<(Vec<u32>, bool), ApiError> {
    let param = g.prompt_param();
    let ctx = st.model.ctx_size;
    let bytes = prompt_bytes(&g.prompt);
    let per_token = st.model.max_token_bytes.max(1);
    if bytes >= ctx.saturating_mul(per_token) {
        return Err(bytes_too_long(param, ctx, bytes, per_token));
    }
    let ids = match &g.prompt {
        PromptInput::Ids(ids) => {
            if ids.len() >= ctx {
                return Err(too_long(
                    g,
                    ctx,
                    format!("the prompt has {} tokens", ids.len()),
                ));
            }
            (ids.clone(), false)
        }
        p => {
            let _permit = st
                .tokenizing
                .acquire()
                .await
                .map_err(|e| ApiError::internal(format!("tokenizer queue: {e}")))?;
            let tok = st.model.tokenizer.clone();
            let p = p.clone();
            let extra = g.template_vars();
            let long = ctx.saturating_mul(PREFIX_BYTES_PER_TOKEN);
            let r = tokio::task::spawn_blocking(move || {
                let texts: Vec<&str> = match &p {
                    PromptInput::Chat(messages) => {
                        messages.iter().map(|m| m.content.as_str()).collect()
                    }
                    PromptInput::Text(text) => vec![text.as_str()],
                    PromptInput::Ids(_) => vec![],
                };
                if texts
                    .iter()
                    .any(|t| t.len() > long && surely_too_long(&tok, t, ctx))
                {
                    return Ok(None);
                }
                match p {
                    PromptInput::Chat(messages) => tok
                        .apply_chat_template_with(&messages, true, &extra)
                        .and_then(|text| {
                            Ok((tok.encode(&text, false)?, prompt_opens_reasoning(&text)))
                        }),
                    PromptInput::Text(text) => tok.encode(&text, true).map(|ids| (ids, false)),
                    PromptInput::Ids(ids) => Ok((ids, false)),
                }
                .map(Some)
            })
            .await
            .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))?
            .map_err(|e| ApiError::invalid(param, e.to_string()))?;
            match r {
                Some(r) => r,
                None => {
                    return Err(too_long(
                        g,
                        ctx,
                        format!("a prefix of the prompt already has more than {ctx} tokens"),
                    ))
                }
            }
        }
    };
    let (ids, opens_reasoning) = ids;
    let vocab = st.model.vocab_size;
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            param,
            format!("token id {bad} is out of range (the vocabulary has {vocab} tokens)"),
        ));
    }
    Ok((ids, opens_reasoning))
}

/// The events of every choice of a request, tagged with the choice's index. A task per
/// choice forwards its events; when the receiver is dropped (the client left) the tasks
/// end and drop their receivers, which the scheduler sees as a disconnect.
type ChoiceEvents = tokio::sync::mpsc::UnboundedReceiver<(usize, Event)>;

fn merge_choices(rxs: Vec<EventReceiver>) -> ChoiceEvents {
    let (tx, merged) = tokio::sync::mpsc::unbounded_channel();
    for (i, mut rx) in rxs.into_iter().enumerate() {
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    ev = rx.recv() => match ev {
                        Some(ev) => if tx.send((i, ev)).is_err() { break },
                        None => break,
                    },
                    _ = tx.closed() => break,
                }
            }
        });
    }
    merged
}

/// One choice being collected.
#[derive(Default)]
struct Choice {
    text: String,
    tokens: Vec<(TokenInfo, usize)>,
    finish: Option<FinishReason>,
}

/// A chat choice's message and finish reason: with `reasoning`, the `<think>` block goes
/// to `reasoning_content`; with tools, the calls parsed out of the text (`auto`: the
/// model's format; `required` / named: the constraint's JSON) go to `tool_calls`, and
/// the reason is `tool_calls`.
fn chat_message(
    st: &AppState,
    g: &GenRequest,
    text: &str,
    finish: FinishReason,
    reasoning: Option<bool>,
) -> (Value, &'static str) {
    let (thought, text) = match reasoning {
        Some(opened) => split_reasoning(text, opened),
        None => (None, text.to_string()),
    };
    let (mut message, finish) = tool_message(st, g, &text, finish);
    if let Some(r) = thought {
        message["reasoning_content"] = json!(r);
    }
    (message, finish)
}

fn tool_message(
    st: &AppState,
    g: &GenRequest,
    text: &str,
    finish: FinishReason,
) -> (Value, &'static str) {
    let (content, calls) = match (&g.tool_choice, st.model.tool_format) {
        (ToolChoice::Auto, Some(format)) => {
            let p = format.parse(text);
            (p.content, p.tool_calls)
        }
        (ToolChoice::Required | ToolChoice::RequiredOne | ToolChoice::Named(_), _) => {
            match openai::forced_tool_calls(text) {
                Some(calls) => (String::new(), calls),
                None => (text.to_string(), vec![]),
            }
        }
        _ => (text.to_string(), vec![]),
    };
    if calls.is_empty() {
        return (
            json!({"role": "assistant", "content": content}),
            openai::finish_str(finish),
        );
    }
    let content = (!content.trim().is_empty()).then_some(content);
    let calls = openai::tool_calls_json(&calls, None, &mut || new_id("call"));
    (
        json!({"role": "assistant", "content": content, "tool_calls": calls}),
        "tool_calls",
    )
}

/// `reasoning`: `Some(whether the prompt opened the block)` when reasoning is split off.
async fn collect_response(
    st: &AppState,
    g: &GenRequest,
    env: &Envelope,
    mut rx: ChoiceEvents,
    reasoning: Option<bool>,
) -> Result<Response, ApiError> {
    let want_logprobs = g.params.logprobs;
    let mut choices: Vec<Choice> = (0..g.n).map(|_| Choice::default()).collect();
    let mut usage = Usage::default();
    let mut left = g.n;
    while left > 0 {
        match rx.recv().await {
            Some((i, Event::Delta { text: t, token })) => {
                let c = &mut choices[i];
                if want_logprobs {
                    c.tokens.push((token, c.text.chars().count()));
                }
                c.text.push_str(&t);
            }
            Some((
                i,
                Event::Done {
                    finish_reason,
                    usage: u,
                },
            )) => {
                choices[i].finish = Some(finish_reason);
                usage.prompt_tokens = u.prompt_tokens;
                usage.cached_tokens = usage.cached_tokens.max(u.cached_tokens);
                usage.completion_tokens += u.completion_tokens;
                left -= 1;
            }
            Some((_, Event::Error { kind, message })) => {
                return Err(ApiError::from_fail(kind, message))
            }
            None => return Err(ApiError::unavailable("the engine stopped")),
        }
    }
    let names = openai::TokenNames {
        tokenizer: &st.model.tokenizer,
        as_ids: g.tokens_as_ids,
    };
    let body: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let finish = c.finish.expect("every choice is done");
            match g.api {
                Api::Chat => {
                    let (message, finish) = chat_message(st, g, &c.text, finish, reasoning);
                    Envelope::chat_choice(
                        i,
                        message,
                        finish,
                        want_logprobs.then(|| {
                            c.tokens
                                .iter()
                                .map(|(t, _)| openai::chat_logprob(names, t))
                                .collect()
                        }),
                    )
                }
                Api::Completions => Envelope::completion_choice(
                    i,
                    &c.text,
                    finish,
                    want_logprobs.then(|| {
                        openai::completion_logprobs(names, &c.tokens, g.params.top_logprobs > 0)
                    }),
                ),
            }
        })
        .collect();
    Ok(json_response(env.response(g.api, body, usage)))
}

struct SseState {
    st: Arc<AppState>,
    g: GenRequest,
    env: Envelope,
    rx: ChoiceEvents,
    /// Chat: the choices whose first (role) chunk has been sent.
    started: usize,
    done: bool,
    /// Choices not finished yet.
    left: usize,
    usage: Usage,
    /// Per choice, characters of completion text sent so far (completions `text_offset`).
    sent_chars: Vec<usize>,
    /// Per choice, the tool-call parsing of a chat stream with tools.
    tools: Vec<ToolStream>,
    /// Per choice, the `<think>` splitter of a chat stream with reasoning.
    reasoning: Vec<Option<ReasoningStream>>,
}

/// How a streamed chat choice's text becomes deltas.
enum ToolStream {
    /// No tools: the text is content.
    Plain,
    /// `tool_choice` `auto`: the format's parser; content deltas never carry call markup,
    /// each call is streamed (its name, then its arguments in pieces) or, where its
    /// markup does not stream, sent whole once complete. `calls`: started so far.
    Auto {
        parser: ToolCallStream,
        calls: usize,
    },
    /// `required` / named: the constraint's JSON, sent as calls at the end.
    Forced(String),
}

impl SseState {
    /// The chunks of `text` of chat choice `i`: `reasoning_content` deltas for the
    /// `<think>` block, the rest through [`SseState::chat_deltas`].
    fn chat_pieces(
        &mut self,
        i: usize,
        text: &str,
        logprobs: Option<Value>,
        last: Option<FinishReason>,
    ) -> String {
        let Some(rs) = self.reasoning[i].as_mut() else {
            return self.chat_deltas(i, text, logprobs, last);
        };
        let mut pieces = rs.push(text);
        if last.is_some() {
            pieces.extend(rs.finish());
        }
        let usage_on = self.g.include_usage;
        let mut logprobs = logprobs;
        let mut out = String::new();
        for p in pieces {
            match p {
                ReasoningEvent::Reasoning(r) => out.push_str(&sse(&self.env.chat_chunk(
                    i,
                    json!({ "reasoning_content": r }),
                    logprobs.take(),
                    None,
                    usage_on,
                ))),
                ReasoningEvent::Content(c) => {
                    out.push_str(&self.chat_deltas(i, &c, logprobs.take(), None))
                }
            }
        }
        if logprobs.is_some() || last.is_some() {
            out.push_str(&self.chat_deltas(i, "", logprobs, last));
        }
        out
    }

    /// The delta chunks of `text` of chat choice `i` (`last`: its end, with the finish
    /// reason), the first one carrying `logprobs`.
    fn chat_deltas(
        &mut self,
        i: usize,
        text: &str,
        logprobs: Option<Value>,
        last: Option<FinishReason>,
    ) -> String {
        let usage_on = self.g.include_usage;
        let mut deltas: Vec<Value> = vec![];
        let mut calls_sent = 0;
        match &mut self.tools[i] {
            ToolStream::Plain => {
                if !text.is_empty() || logprobs.is_some() {
                    deltas.push(json!({ "content": text }));
                }
            }
            ToolStream::Auto { parser, calls } => {
                let mut events = parser.push(text);
                if last.is_some() {
                    events.extend(parser.finish());
                }
                for e in events {
                    match e {
                        ToolEvent::Content(c) => deltas.push(json!({ "content": c })),
                        ToolEvent::Call(c) => {
                            let tc =
                                openai::tool_calls_json(&[c], Some(*calls), &mut || new_id("call"));
                            *calls += 1;
                            deltas.push(json!({ "tool_calls": tc }));
                        }
                        // OpenAI's streamed call: id, type and name first, then the
                        // arguments in pieces, every chunk with the call's index
                        ToolEvent::CallStart(name) => {
                            deltas.push(json!({ "tool_calls": [{
                                "index": *calls,
                                "id": new_id("call"),
                                "type": "function",
                                "function": {"name": name, "arguments": ""},
                            }]}));
                            *calls += 1;
                        }
                        ToolEvent::CallArgs(a) => {
                            deltas.push(json!({ "tool_calls": [{
                                "index": calls.saturating_sub(1),
                                "function": {"arguments": a},
                            }]}));
                        }
                        ToolEvent::CallEnd => {}
                    }
                }
                calls_sent = *calls;
            }
            ToolStream::Forced(buf) => {
                buf.push_str(text);
                if last.is_some() {
                    match openai::forced_tool_calls(buf) {
                        Some(calls) => {
                            calls_sent = calls.len();
                            let tc =
                                openai::tool_calls_json(&calls, Some(0), &mut || new_id("call"));
                            deltas.push(json!({ "tool_calls": tc }));
                        }
                        None => deltas.push(json!({ "content": buf.clone() })),
                    }
                }
            }
        }
        if deltas.is_empty() && logprobs.is_some() {
            deltas.push(json!({}));
        }
        let mut out = String::new();
        let mut logprobs = logprobs;
        for d in deltas {
            out.push_str(&sse(&self.env.chat_chunk(
                i,
                d,
                logprobs.take(),
                None,
                usage_on,
            )));
        }
        if let Some(f) = last {
            let reason = if calls_sent > 0 {
                "tool_calls"
            } else {
                openai::finish_str(f)
            };
            out.push_str(&sse(&self.env.chat_chunk(
                i,
                json!({}),
                None,
                Some(reason),
                usage_on,
            )));
        }
        out
    }
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

impl SseState {
    /// The SSE text for the next event; `None` at the end of the stream.
    async fn next(&mut self) -> Option<String> {
        if self.done {
            return None;
        }
        let api = self.g.api;
        let usage_on = self.g.include_usage;
        if api == Api::Chat && self.started < self.g.n {
            let i = self.started;
            self.started += 1;
            let delta = json!({"role": "assistant", "content": ""});
            return Some(sse(&self.env.chat_chunk(i, delta, None, None, usage_on)));
        }
        let want_logprobs = self.g.params.logprobs;
        loop {
            match self.rx.recv().await {
                Some((i, Event::Delta { text, token })) => {
                    if text.is_empty() && !want_logprobs {
                        continue;
                    }
                    let names = openai::TokenNames {
                        tokenizer: &self.st.model.tokenizer,
                        as_ids: self.g.tokens_as_ids,
                    };
                    if api == Api::Chat {
                        let lp = want_logprobs
                            .then(|| json!({"content": [openai::chat_logprob(names, &token)]}));
                        let out = self.chat_pieces(i, &text, lp, None);
                        if out.is_empty() {
                            continue;
                        }
                        return Some(out);
                    }
                    let chunk = match api {
                        Api::Chat => unreachable!("handled above"),
                        Api::Completions => self.env.completion_chunk(
                            i,
                            &text,
                            want_logprobs.then(|| {
                                openai::completion_logprobs(
                                    names,
                                    &[(token, self.sent_chars[i])],
                                    self.g.params.top_logprobs > 0,
                                )
                            }),
                            None,
                            usage_on,
                        ),
                    };
                    self.sent_chars[i] += text.chars().count();
                    return Some(sse(&chunk));
                }
                Some((
                    i,
                    Event::Done {
                        finish_reason,
                        usage,
                    },
                )) => {
                    self.usage.prompt_tokens = usage.prompt_tokens;
                    self.usage.cached_tokens = self.usage.cached_tokens.max(usage.cached_tokens);
                    self.usage.completion_tokens += usage.completion_tokens;
                    self.left -= 1;
                    let mut out = match api {
                        Api::Chat => self.chat_pieces(i, "", None, Some(finish_reason)),
                        Api::Completions => sse(&self.env.completion_chunk(
                            i,
                            "",
                            None,
                            Some(finish_reason),
                            usage_on,
                        )),
                    };
                    if self.left == 0 {
                        self.done = true;
                        if usage_on {
                            out.push_str(&sse(&self.env.usage_chunk(api, self.usage)));
                        }
                        out.push_str("data: [DONE]\n\n");
                    }
                    return Some(out);
                }
                Some((_, Event::Error { kind, message })) => {
                    self.done = true;
                    let e = ApiError::from_fail(kind, message);
                    return Some(format!("{}data: [DONE]\n\n", sse(&e.body())));
                }
                None => {
                    self.done = true;
                    let e = ApiError::unavailable("the engine stopped");
                    return Some(format!("{}data: [DONE]\n\n", sse(&e.body())));
                }
            }
        }
    }
}

fn stream_response(
    st: Arc<AppState>,
    g: GenRequest,
    env: Envelope,
    rx: ChoiceEvents,
    reasoning: Option<bool>,
) -> Response {
    let n = g.n;
    let state = SseState {
        env,
        rx,
        started: 0,
        done: false,
        left: n,
        usage: Usage::default(),
        sent_chars: vec![0; n],
        tools: (0..n)
            .map(|_| match (&g.tool_choice, st.model.tool_format) {
                (ToolChoice::Auto, Some(f)) => ToolStream::Auto {
                    parser: ToolCallStream::new(f),
                    calls: 0,
                },
                (ToolChoice::Required | ToolChoice::RequiredOne | ToolChoice::Named(_), _) => {
                    ToolStream::Forced(String::new())
                }
                _ => ToolStream::Plain,
            })
            .collect(),
        reasoning: (0..n)
            .map(|_| reasoning.map(ReasoningStream::new))
            .collect(),
        st,
        g,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        s.next()
            .await
            .map(|text| (Ok::<String, Infallible>(text), s))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| ApiError::internal(e.to_string()).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn framework_errors_become_json() {
        let plain = (
            StatusCode::UNPROCESSABLE_ENTITY,
            [(header::CONTENT_TYPE, "text/plain")],
            "Failed to deserialize",
        )
            .into_response();
        let r = json_errors(plain).await;
        assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["message"], "Failed to deserialize");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        // an empty 5xx gets its reason; a success is left alone
        let r = json_errors(StatusCode::BAD_GATEWAY.into_response()).await;
        let body = axum::body::to_bytes(r.into_body(), 4096).await.unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["message"], "Bad Gateway");
        assert_eq!(v["error"]["type"], "server_error");
        let ok = json_errors("hi".into_response()).await;
        assert_eq!(ok.status(), StatusCode::OK);
    }

    #[test]
    fn prompt_bytes_of_raw_bodies() {
        let chat = br#"{"model": "m", "messages": [{"role": "system", "content": "ab\n"},
            {"role": "user", "content": [{"type": "text", "text": "xyz"}, {"type": "text", "text": "\u00e9"}]}],
            "max_tokens": 3}"#;
        assert_eq!(raw_prompt_bytes(Api::Chat, chat), Some(3 + 3 + 2));
        assert_eq!(raw_prompt_bytes(Api::Completions, chat), None);
        assert_eq!(
            raw_prompt_bytes(Api::Completions, br#"{"prompt": ["hello"]}"#),
            Some(5)
        );
        assert_eq!(
            raw_prompt_bytes(Api::Completions, br#"{"prompt": [1, 2, 3]}"#),
            Some(0)
        );
        assert_eq!(raw_prompt_bytes(Api::Chat, br#"{"messages": "hi"}"#), None);
        assert_eq!(raw_prompt_bytes(Api::Chat, b"{\"messages\": [}"), None);
        assert_eq!(cut_before_space("ab cd ef", 7), 5);
        assert_eq!(cut_before_space("abcdef", 4), 4);
        assert_eq!(cut_before_space("aé", 2), 1);
    }

    #[test]
    fn content_types() {
        let mut h = HeaderMap::new();
        assert!(check_content_type(&h).is_ok());
        h.insert(
            header::CONTENT_TYPE,
            "application/json; charset=utf-8".parse().unwrap(),
        );
        assert!(check_content_type(&h).is_ok());
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        assert_eq!(
            check_content_type(&h).unwrap_err().status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        assert_eq!(route_label("/v1/models/x"), "/v1/models/{id}");
        assert_eq!(route_label("/nope"), "other");
    }
}
