//! The HTTP surface: routes, auth, body handling, streaming (SSE) and the
//! fallbacks that keep every error in OpenAI's JSON shape.
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;

use super::error::ApiError;
use super::metrics::Metrics;
use super::openai::{self, Api, Envelope, GenRequest, PromptInput};
use super::{Engine, EventReceiver, ModelInfo, BODY_LIMIT};
use crate::engine::scheduler::{Event, Request as EngineRequest, TokenInfo};

pub struct AppState {
    pub engine: Arc<Engine>,
    pub metrics: Arc<Metrics>,
    pub model: ModelInfo,
    pub api_key: Option<String>,
    /// Server start (unix seconds), the `created` of the model.
    pub created: u64,
}

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
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
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

async fn model(State(st): St, Path(id): Path<String>) -> Response {
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
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(st): St, req: Request) -> Response {
    generate(st, req, Api::Completions)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The body as JSON: content type, size limit (413) and syntax (400).
async fn read_json(req: Request) -> Result<Value, ApiError> {
    check_content_type(req.headers())?;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > BODY_LIMIT as u64) {
        return Err(ApiError::too_large(BODY_LIMIT));
    }
    let bytes = axum::body::to_bytes(req.into_body(), BODY_LIMIT)
        .await
        .map_err(|e| {
            // http-body-util's LengthLimitError: "length limit exceeded"
            if e.to_string().contains("length limit") {
                ApiError::too_large(BODY_LIMIT)
            } else {
                ApiError::bad_request(format!("reading the request body: {e}"))
            }
        })?;
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "the request body is empty; send a JSON object",
        ));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))
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
        Err(ApiError::bad_request(format!(
            "Content-Type must be application/json (got '{mime}')"
        ))
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
    let body = read_json(req).await?;
    let g = openai::parse(api, &body)?;
    if let Some(m) = &g.model {
        if *m != st.model.name {
            return Err(model_not_found(m));
        }
    }
    if let Some(e) = st.engine.unavailable() {
        return Err(e);
    }
    let prompt = tokenize(&st, &g).await?;
    let ctx = st.model.ctx_size;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            g.prompt_param(),
            "the prompt is empty (0 tokens)",
        ));
    }
    if prompt.len() >= ctx {
        return Err(ApiError::invalid(
            g.prompt_param(),
            format!(
                "this model's maximum context length is {ctx} tokens, but the prompt has {} tokens (at least one more is needed to generate)",
                prompt.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = ctx - prompt.len();
    let max_tokens = match (g.max_tokens, api) {
        (Some(n), _) => n.min(room),
        (None, Api::Completions) => 16.min(room),
        (None, Api::Chat) => room,
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let prompt_len = prompt.len();
    st.engine.submit(EngineRequest {
        prompt,
        params: g.params.clone(),
        max_tokens,
        stop: g.stop.clone(),
        ignore_eos: g.ignore_eos,
        skip_special_tokens: g.skip_special_tokens,
        arrived,
        events: tx,
    })?;
    let env = Envelope {
        id: new_id(match api {
            Api::Chat => "chatcmpl",
            Api::Completions => "cmpl",
        }),
        created: now_secs(),
        model: st.model.name.clone(),
    };
    tracing::debug!(
        "{} submitted: {prompt_len} prompt tokens, max {max_tokens}",
        env.id
    );
    if g.stream {
        Ok(stream_response(st, g, env, rx))
    } else {
        collect_response(&st, &g, &env, rx).await
    }
}

/// Prompt ids: chat template or plain text (tokenized off the async workers), or ids.
async fn tokenize(st: &AppState, g: &GenRequest) -> Result<Vec<u32>, ApiError> {
    let param = g.prompt_param();
    let ids = match &g.prompt {
        PromptInput::Ids(ids) => ids.clone(),
        p => {
            let tok = st.model.tokenizer.clone();
            let p = p.clone();
            tokio::task::spawn_blocking(move || match p {
                PromptInput::Chat(messages) => tok.encode_chat(&messages, true),
                PromptInput::Text(text) => tok.encode(&text, true),
                PromptInput::Ids(ids) => Ok(ids),
            })
            .await
            .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))?
            .map_err(|e| ApiError::invalid(param, e.to_string()))?
        }
    };
    let vocab = st.model.vocab_size;
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            param,
            format!("token id {bad} is out of range (the vocabulary has {vocab} tokens)"),
        ));
    }
    Ok(ids)
}

async fn collect_response(
    st: &AppState,
    g: &GenRequest,
    env: &Envelope,
    mut rx: EventReceiver,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut tokens: Vec<(TokenInfo, usize)> = Vec::new();
    let want_logprobs = g.params.logprobs;
    loop {
        match rx.recv().await {
            Some(Event::Delta { text: t, token }) => {
                if want_logprobs {
                    tokens.push((token, text.chars().count()));
                }
                text.push_str(&t);
            }
            Some(Event::Done {
                finish_reason,
                usage,
            }) => {
                let tok = &st.model.tokenizer;
                let body = match g.api {
                    Api::Chat => env.chat_response(
                        &text,
                        finish_reason,
                        usage,
                        want_logprobs.then(|| {
                            tokens
                                .iter()
                                .map(|(t, _)| openai::chat_logprob(tok, t))
                                .collect()
                        }),
                    ),
                    Api::Completions => env.completion_response(
                        &text,
                        finish_reason,
                        usage,
                        want_logprobs.then(|| {
                            openai::completion_logprobs(tok, &tokens, g.params.top_logprobs > 0)
                        }),
                    ),
                };
                return Ok(json_response(body));
            }
            Some(Event::Error { kind, message }) => return Err(ApiError::from_fail(kind, message)),
            None => return Err(ApiError::unavailable("the engine stopped")),
        }
    }
}

struct SseState {
    st: Arc<AppState>,
    g: GenRequest,
    env: Envelope,
    rx: EventReceiver,
    started: bool,
    done: bool,
    /// Characters of completion text sent so far (completions `text_offset`).
    sent_chars: usize,
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
        if !self.started {
            self.started = true;
            if api == Api::Chat {
                let delta = json!({"role": "assistant", "content": ""});
                return Some(sse(&self.env.chat_chunk(delta, None, None, usage_on)));
            }
        }
        let want_logprobs = self.g.params.logprobs;
        loop {
            match self.rx.recv().await {
                Some(Event::Delta { text, token }) => {
                    if text.is_empty() && !want_logprobs {
                        continue;
                    }
                    let tok = &self.st.model.tokenizer;
                    let chunk = match api {
                        Api::Chat => self.env.chat_chunk(
                            json!({"content": text}),
                            want_logprobs
                                .then(|| json!({"content": [openai::chat_logprob(tok, &token)]})),
                            None,
                            usage_on,
                        ),
                        Api::Completions => self.env.completion_chunk(
                            &text,
                            want_logprobs.then(|| {
                                openai::completion_logprobs(
                                    tok,
                                    &[(token, self.sent_chars)],
                                    self.g.params.top_logprobs > 0,
                                )
                            }),
                            None,
                            usage_on,
                        ),
                    };
                    self.sent_chars += text.chars().count();
                    return Some(sse(&chunk));
                }
                Some(Event::Done {
                    finish_reason,
                    usage,
                }) => {
                    self.done = true;
                    let last = match api {
                        Api::Chat => {
                            self.env
                                .chat_chunk(json!({}), None, Some(finish_reason), usage_on)
                        }
                        Api::Completions => {
                            self.env
                                .completion_chunk("", None, Some(finish_reason), usage_on)
                        }
                    };
                    let mut out = sse(&last);
                    if usage_on {
                        out.push_str(&sse(&self.env.usage_chunk(api, usage)));
                    }
                    out.push_str("data: [DONE]\n\n");
                    return Some(out);
                }
                Some(Event::Error { kind, message }) => {
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

fn stream_response(st: Arc<AppState>, g: GenRequest, env: Envelope, rx: EventReceiver) -> Response {
    let state = SseState {
        st,
        g,
        env,
        rx,
        started: false,
        done: false,
        sent_chars: 0,
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
            StatusCode::BAD_REQUEST
        );
        assert_eq!(route_label("/v1/models/x"), "/v1/models/{id}");
        assert_eq!(route_label("/nope"), "other");
    }
}
