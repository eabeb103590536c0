//! `mlxcel-server` / `mlxcel serve`: an OpenAI-compatible HTTP server with
//! continuous batching, streaming and Prometheus metrics.
//!
//! Threads: one engine thread owns everything MLX (it opens the model, loads
//! the weights or launches the TP ranks, warms up, then runs the
//! [`Scheduler`] loop); the tokio runtime serves HTTP and never touches MLX.
//! Handlers tokenize, validate and submit [`Request`]s over a std channel and
//! read the request's [`Event`]s from a tokio channel.
//!
//! With `--tp-size N` the engine thread drives N rank processes and supervises
//! them: when a rank dies or stalls (or an idle health check finds it dead),
//! the requests in flight fail, `/health` turns 503, the group is stopped and a
//! new one is started and warmed up (at most `--max-restarts` times within 10
//! minutes; past that the server exits non-zero with the reason). The server
//! process itself does no GPU work then.
//!
//! Connections are served by [`http`] (hyper with header, body and idle
//! timeouts and `--max-connections`); prompts are bounded before they are
//! tokenized (see [`routes`]).
//!
//! See `docs/server.md` for the endpoints, parameters, flags and metrics.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::engine::grammar::GrammarVocab;
use crate::engine::sampler::SamplingParams;
use crate::engine::scheduler::{
    default_max_itl_ratio, Command, Event, HostPart, Observer, Outcome, Request, RunEnd, Scheduler,
    SchedulerConfig, StepSummary, Usage, DEFAULT_MAX_NUM_BATCHED_TOKENS,
};
use crate::engine::step::{
    Executor, KvPool, LocalExecutor, SampledToken, SeqMask, SeqStep, StepError, StepPlan,
    StepResult,
};
use crate::mlx;
use crate::parallel::driver::TpExecutor;
use crate::parallel::supervisor::{window_text, RestartBudget, RestartPolicy};
use crate::runtime::{load_weights, open_model, ModelArgs, OpenedModel, TpArgs};
use crate::tokenizer::tool_calls::ToolCallFormat;
use crate::tokenizer::Tokenizer;

pub mod error;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod routes;

use error::ApiError;
use metrics::Metrics;

/// Largest request body accepted (413 above).
pub const BODY_LIMIT: usize = 4 << 20;

#[derive(Debug, Args, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the log says which).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every /v1 route.
    #[arg(long, env = "MLXCEL_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    #[command(flatten)]
    pub kv: crate::runtime::KvArgs,
    /// Turn off automatic prefix caching (sharing the KV blocks of equal prompt prefixes).
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Requests that may wait for a slot; more get 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Model name in the API (default: the model folder's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Tokens per engine step (vLLM's name; `--prefill-chunk` is an alias): each running
    /// decode takes one, the rest prefills waiting prompts together, oldest first, a long
    /// prompt split across steps (chunked prefill). Sizes the memory plan's working
    /// margin. At least --parallel is used.
    #[arg(long, visible_alias = "prefill-chunk", default_value_t = DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: usize,
    /// While streams are decoding, a step that also prefills waiting prompts takes at
    /// most this many times a decode step of the same streams (the prefill tokens per
    /// step are cut to fit, by the step times the server has measured), so arrivals do
    /// not stretch the running streams' inter-token gaps. 0: --max-num-batched-tokens
    /// alone sizes the prefill (the default: on a GPU not yet measured with the aligned
    /// chunks; 3 is the ratio to try there).
    #[arg(long)]
    pub max_itl_ratio: Option<f64>,
    /// Seconds to let running requests finish after SIGINT/SIGTERM before cancelling them.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// With --tp-size: restarts of a failed rank group allowed within 10 minutes; one more failure makes the server exit non-zero.
    #[arg(long, default_value_t = 3)]
    pub max_restarts: usize,
    /// Seconds a client has to send a whole request head (from its first byte; from
    /// the accept for a connection's first request); then the connection is closed.
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a client has to send a whole request body; then 408.
    #[arg(long, default_value_t = 30.0)]
    pub body_timeout: f64,
    /// Seconds a keep-alive connection may stay idle (no request in flight) before it is closed.
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout: f64,
    /// Connections served at once; up to 64 more get /health and /metrics only, and past those new connections are closed.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Read every decode step back before building the next (by default, while only
    /// sequences that decode are running, step t+1 is queued on the device before
    /// step t's tokens are read and streamed; same tokens).
    #[arg(long)]
    pub no_pipeline: bool,
    /// How the model writes tool calls: hermes (Qwen, Hermes), llama3_json or mistral
    /// (default: what the chat template shows).
    #[arg(long)]
    pub tool_call_parser: Option<ToolCallFormat>,
    #[command(flatten)]
    pub tp: TpArgs,
}

const LOADING: u8 = 0;
const READY: u8 = 1;
const FAILED: u8 = 2;
const STOPPING: u8 = 3;
/// The TP group failed; a new one is being started.
const RESTARTING: u8 = 4;

/// What the HTTP side shares with the engine thread.
pub struct Engine {
    tx: Mutex<Sender<Command>>,
    state: AtomicU8,
    failure: Mutex<Option<String>>,
    /// Requests submitted and not yet finished (queued + running).
    in_system: AtomicUsize,
    /// Set by the engine thread while it runs the scheduler loop (it answers
    /// `Shutdown` promptly then); clear while it loads or restarts.
    loaded: AtomicBool,
    parallel: usize,
    max_queue: usize,
}

impl Engine {
    fn new(tx: Sender<Command>, parallel: usize, max_queue: usize) -> Engine {
        Engine {
            tx: Mutex::new(tx),
            state: AtomicU8::new(LOADING),
            failure: Mutex::new(None),
            in_system: AtomicUsize::new(0),
            loaded: AtomicBool::new(false),
            parallel,
            max_queue,
        }
    }

    pub fn is_ready(&self) -> bool {
        self.state.load(Ordering::Acquire) == READY
    }

    /// Why the engine cannot take requests now (`None` when ready).
    pub fn unavailable(&self) -> Option<ApiError> {
        match self.state.load(Ordering::Acquire) {
            READY => None,
            LOADING => Some(ApiError::unavailable("the model is loading")),
            STOPPING => Some(ApiError::unavailable("the server is shutting down")),
            RESTARTING => Some(ApiError::unavailable(format!(
                "the engine failed and is restarting: {}",
                self.failure()
            ))),
            _ => Some(ApiError::unavailable(format!(
                "the engine has failed: {}",
                self.failure()
            ))),
        }
    }

    fn failure(&self) -> String {
        self.failure
            .lock()
            .ok()
            .and_then(|f| f.clone())
            .unwrap_or_default()
    }

    fn set_failure(&self, why: String) {
        if let Ok(mut f) = self.failure.lock() {
            *f = Some(why);
        }
    }

    fn set_failed(&self, why: String) {
        self.set_failure(why);
        self.state.store(FAILED, Ordering::Release);
    }

    /// The executor failed: 503 until it is replaced (unless shutting down).
    fn set_restarting(&self, why: String) {
        if self.state.load(Ordering::Acquire) == STOPPING {
            return;
        }
        self.set_failure(why);
        let _ = self
            .state
            .compare_exchange(READY, RESTARTING, Ordering::AcqRel, Ordering::Acquire);
    }

    fn is_stopping(&self) -> bool {
        self.state.load(Ordering::Acquire) == STOPPING
    }

    fn set_stopping(&self) {
        for from in [READY, LOADING, RESTARTING] {
            let _ =
                self.state
                    .compare_exchange(from, STOPPING, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    fn send(&self, cmd: Command) -> bool {
        self.tx
            .lock()
            .map(|tx| tx.send(cmd).is_ok())
            .unwrap_or(false)
    }

    /// Queue a request: 503 unless ready, 429 when `--parallel + --max-queue` are in.
    pub fn submit(&self, req: Request) -> Result<(), ApiError> {
        self.submit_all(vec![req])
    }

    /// Queue requests with one prompt (the choices of an `n` > 1 request) together, so
    /// that they share one prefill; all or none (429 when they do not all fit).
    pub fn submit_all(&self, mut reqs: Vec<Request>) -> Result<(), ApiError> {
        if let Some(e) = self.unavailable() {
            return Err(e);
        }
        let cap = self.parallel + self.max_queue;
        let k = reqs.len();
        let admitted = self
            .in_system
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n + k <= cap).then_some(n + k)
            });
        if admitted.is_err() {
            return Err(ApiError::busy(format!(
                "the server is busy: {} requests running and {} waiting (--max-queue {})",
                self.parallel, self.max_queue, self.max_queue
            )));
        }
        let cmd = if k == 1 {
            Command::Submit(Box::new(reqs.remove(0)))
        } else {
            Command::SubmitGroup(reqs)
        };
        if !self.send(cmd) {
            self.in_system.fetch_sub(k, Ordering::AcqRel);
            return Err(ApiError::unavailable("the engine has stopped"));
        }
        Ok(())
    }
}

/// The model facts the HTTP side needs.
#[derive(Clone)]
pub struct ModelInfo {
    pub name: String,
    pub tokenizer: Tokenizer,
    pub ctx_size: usize,
    pub vocab_size: usize,
    /// Bytes of the longest token's text (a prompt of `ctx_size × this` bytes cannot fit).
    pub max_token_bytes: usize,
    /// The vocabulary for constrained decoding, built at the first request that needs it.
    pub grammar: Arc<std::sync::OnceLock<Result<GrammarVocab, String>>>,
    /// How the model writes tool calls: `--tool-call-parser`, or what the chat template
    /// shows when it renders a tool; `None` when neither says.
    pub tool_format: Option<ToolCallFormat>,
    /// Whether the chat template uses `<think>` blocks: chat replies then have their
    /// reasoning split off into `reasoning_content`.
    pub reasoning: bool,
}

/// Whether the chat template uses `<think>` blocks: it renders an empty one for
/// `enable_thinking: false` (Qwen3), or its generation prompt opens one (DeepSeek-R1).
fn detect_reasoning(tok: &Tokenizer) -> bool {
    let user = [crate::tokenizer::chat::ChatMessage::new("user", "x")];
    let render = |vars: serde_json::Value| tok.apply_chat_template_with(&user, true, &vars).ok();
    render(serde_json::json!({"enable_thinking": false}))
        .is_some_and(|t| t.contains("<think>") && t.contains("</think>"))
        || render(serde_json::Value::Null)
            .is_some_and(|t| crate::tokenizer::reasoning::prompt_opens_reasoning(&t))
}

/// The tool-call format the chat template teaches: the markers it renders for a probe
/// tool (Hermes `<tool_call>`, Mistral `[TOOL_CALLS]`, Llama 3.1's JSON `"parameters"`).
fn detect_tool_format(tok: &Tokenizer) -> Option<ToolCallFormat> {
    let tools = serde_json::json!({"tools": [{"type": "function", "function": {
        "name": "probe", "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]});
    let text = tok
        .apply_chat_template_with(
            &[crate::tokenizer::chat::ChatMessage::new("user", "x")],
            true,
            &tools,
        )
        .ok()?;
    ToolCallFormat::detect(&text)
}

impl ModelInfo {
    /// The vocabulary for constrained decoding (built once, on first use: it walks
    /// every token); `Err` says why this tokenizer cannot have one.
    pub fn grammar_vocab(&self) -> Result<&GrammarVocab, &str> {
        self.grammar
            .get_or_init(|| {
                let json: serde_json::Value = self
                    .tokenizer
                    .inner()
                    .to_string(false)
                    .map_err(|e| e.to_string())
                    .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))?;
                GrammarVocab::new(&json, self.vocab_size, self.tokenizer.eos_token_ids())
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(String::as_str)
    }
}

/// The length in bytes of the longest token text of `tok` (UTF-8 of the token
/// strings, which is at least the bytes each covers: byte-level and
/// SentencePiece vocabularies spell a byte with one or more characters).
pub fn max_token_bytes(tok: &Tokenizer) -> usize {
    (0..tok.vocab_size() as u32)
        .filter_map(|id| tok.id_to_token(id))
        .map(|t| t.len())
        .max()
        .unwrap_or(1)
        .max(1)
}

/// Metrics and health, fed by the scheduler on the engine thread.
struct EngineObserver {
    metrics: Arc<Metrics>,
    engine: Arc<Engine>,
    /// Read MLX memory statistics (this process runs the model).
    local: bool,
}

impl Observer for EngineObserver {
    fn admitted(&self, queue_seconds: f64) {
        self.metrics.queue_time.observe(queue_seconds);
    }
    fn first_token(&self, ttft_seconds: f64, prompt_tokens: usize) {
        let m = &self.metrics;
        m.ttft.observe(ttft_seconds);
        m.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        m.generation_tokens.fetch_add(1, Ordering::Relaxed);
    }
    fn next_token(&self, seconds: f64) {
        self.metrics.itl.observe(seconds);
        self.metrics
            .generation_tokens
            .fetch_add(1, Ordering::Relaxed);
    }
    fn finished(&self, outcome: Outcome, _usage: Usage, e2e_seconds: f64) {
        self.metrics.finished(outcome, e2e_seconds);
        let _ = self
            .engine
            .in_system
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
    fn kv_blocks(&self, used: usize, total: usize) {
        let m = &self.metrics;
        m.kv_blocks_used.store(used as u64, Ordering::Relaxed);
        m.kv_blocks_total.store(total as u64, Ordering::Relaxed);
    }
    fn prefix_cache(&self, queried: usize, hit: usize) {
        let m = &self.metrics;
        m.prefix_cache_queries
            .fetch_add(queried as u64, Ordering::Relaxed);
        m.prefix_cache_hits.fetch_add(hit as u64, Ordering::Relaxed);
    }
    fn preempted(&self) {
        self.metrics.preemptions.fetch_add(1, Ordering::Relaxed);
    }
    fn step_done(&self, running: usize, waiting: usize) {
        let m = &self.metrics;
        m.running.store(running as u64, Ordering::Relaxed);
        // requests still in the channel count as waiting too
        let in_system = self.engine.in_system.load(Ordering::Relaxed);
        let waiting = waiting.max(in_system.saturating_sub(running));
        m.waiting.store(waiting as u64, Ordering::Relaxed);
        if self.local {
            publish_memory(m);
        }
    }
    fn prefilled(&self, tokens: usize) {
        self.metrics
            .prefill_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }
    fn step_ran(&self, summary: &StepSummary) {
        let m = &self.metrics;
        m.step_tokens
            .observe((summary.decode + summary.prefill_tokens) as f64);
        m.step_prefill_seqs.observe(summary.prefill_seqs as f64);
    }
    fn decode_pipelined(&self) {
        self.metrics.pipelined_steps.fetch_add(1, Ordering::Relaxed);
    }
    fn host_time(&self, part: HostPart, seconds: f64) {
        self.metrics.host_time(part, seconds);
    }
    fn engine_error(&self, _error: &StepError, _fatal: bool) {
        self.metrics.engine_errors.fetch_add(1, Ordering::Relaxed);
    }
    fn executor_down(&self, message: &str) {
        // the engine thread restarts the TP group (or gives up) once `run` returns
        self.engine.set_restarting(message.to_string());
    }
}

/// A TP executor that publishes its ranks' memory to the metrics after each step.
struct ServedTp {
    exec: TpExecutor,
    metrics: Arc<Metrics>,
}

impl Executor for ServedTp {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepResult, StepError> {
        let r = self.exec.execute(plan)?;
        self.metrics.set_tp_memory(self.exec.memory());
        Ok(r)
    }
    fn ctx_size(&self) -> usize {
        self.exec.ctx_size()
    }
    fn slots(&self) -> usize {
        self.exec.slots()
    }
    fn check_health(&mut self) -> Result<(), StepError> {
        self.exec.check_health()
    }
    fn peak_memory(&self) -> u64 {
        self.exec.peak_memory()
    }
    fn can_pipeline(&self, seq_id: u64) -> bool {
        self.exec.can_pipeline(seq_id)
    }
    fn kv_pool(&self) -> KvPool {
        self.exec.kv_pool()
    }
    fn queue_decode(
        &mut self,
        rows: &[(u64, usize, usize)],
        tokens: Option<&[u32]>,
        tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        self.exec.queue_decode(rows, tokens, tables)
    }
    fn queue_forward(
        &mut self,
        rows: &[(u64, usize, usize)],
        tokens: Option<&[u32]>,
        tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        self.exec.queue_forward(rows, tokens, tables)
    }
    fn sample_queued(&mut self, masks: &[SeqMask]) -> Result<(), StepError> {
        self.exec.sample_queued(masks)
    }
    fn take_sampled(&mut self) -> Result<Vec<SampledToken>, StepError> {
        self.exec.take_sampled()
    }
    fn discard_queued(&mut self) {
        self.exec.discard_queued()
    }
}

/// What the engine thread tells the HTTP side about its life.
#[derive(Debug)]
enum EngineNote {
    /// Loaded and warmed up: serving.
    Ready,
    /// A new TP group is serving after a failure.
    Restarted,
    /// The first load failed.
    LoadFailed(String),
    /// The engine is down for good (restart budget spent, or a restart failed for good).
    Down(String),
}

fn publish_memory(m: &Metrics) {
    m.memory_active
        .store(mlx::memory::active(), Ordering::Relaxed);
    m.memory_peak.store(mlx::memory::peak(), Ordering::Relaxed);
    m.memory_cache
        .store(mlx::memory::cache(), Ordering::Relaxed);
    m.kv_pool_copies.store(
        crate::models::kv_cache::pool_copies_total(),
        Ordering::Relaxed,
    );
}

/// One tiny step so the first request does not pay for kernel set-up.
fn warm_up(exec: &mut dyn Executor, tokenizer: &Tokenizer) -> Result<(), StepError> {
    let token = tokenizer
        .bos_token_id()
        .or_else(|| tokenizer.eos_token_ids().first().copied())
        .unwrap_or(0);
    exec.execute(&StepPlan {
        seqs: vec![SeqStep::whole_prompt(
            0,
            0,
            &[token],
            SamplingParams {
                seed: Some(0),
                ..SamplingParams::default()
            },
        )],
        ..Default::default()
    })?;
    exec.execute(&StepPlan {
        release: vec![0],
        ..Default::default()
    })?;
    Ok(())
}

/// Load the model (or launch and warm up the TP ranks) on the engine thread.
fn start_executor(
    args: &ServeArgs,
    m: &OpenedModel,
    metrics: &Arc<Metrics>,
) -> Result<Box<dyn Executor>> {
    let kv = crate::runtime::kv_config(
        &args.kv,
        &args.model,
        m,
        &args.tp,
        args.parallel,
        args.max_num_batched_tokens,
    )?;
    let mut exec: Box<dyn Executor> = if !args.tp.uses_ranks() {
        crate::runtime::check_single_device_memory(
            &args.model,
            m,
            args.parallel,
            args.max_num_batched_tokens,
            kv.preallocate.then_some(kv.num_blocks * kv.block_size),
        )?;
        let model = load_weights(&args.model, m)?;
        let mut local = LocalExecutor::with_kv(model, args.parallel, m.ctx_size, kv);
        local.worker.warm_up()?;
        local.worker.fit_memory_limits();
        Box::new(local)
    } else {
        let mut opts = args
            .tp
            .options(args.model.load_format, m.ctx_size, args.parallel);
        opts.max_num_batched_tokens = args.max_num_batched_tokens;
        opts.kv = kv;
        // Ranks (and the ranks of every restart) run this very binary, even
        // if its file has been replaced or deleted since the server started.
        opts.program = crate::this_executable();
        let exec = TpExecutor::launch(&m.dir, opts)?;
        metrics.set_tp_ranks(exec.reports());
        Box::new(ServedTp {
            exec,
            metrics: metrics.clone(),
        })
    };
    warm_up(exec.as_mut(), &m.tokenizer).context("warm-up step")?;
    Ok(exec)
}

/// The engine thread: open, load, warm up, then schedule until told to stop;
/// with TP ranks, restart the group when it fails (within `--max-restarts`).
fn engine_main(
    args: ServeArgs,
    info_tx: Sender<Result<ModelInfo>>,
    notes: tokio::sync::mpsc::UnboundedSender<EngineNote>,
    rx: mpsc::Receiver<Command>,
    engine: Arc<Engine>,
    metrics: Arc<Metrics>,
) {
    let m = match open_model(&args.model) {
        Ok(m) => m,
        Err(e) => {
            let _ = info_tx.send(Err(e));
            return;
        }
    };
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        m.dir
            .root
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let _ = info_tx.send(Ok(ModelInfo {
        name,
        tokenizer: m.tokenizer.clone(),
        ctx_size: m.ctx_size,
        vocab_size: m.cfg.vocab_size,
        max_token_bytes: max_token_bytes(&m.tokenizer),
        grammar: Default::default(),
        tool_format: args
            .tool_call_parser
            .or_else(|| detect_tool_format(&m.tokenizer)),
        reasoning: detect_reasoning(&m.tokenizer),
    }));
    let local = !args.tp.uses_ranks();
    let mut exec = match start_executor(&args, &m, &metrics) {
        Ok(e) => e,
        Err(e) => {
            let msg = format!("{e:#}");
            engine.set_failed(msg.clone());
            let _ = notes.send(EngineNote::LoadFailed(msg));
            return;
        }
    };
    if local {
        mlx::memory::reset_peak();
        publish_memory(&metrics);
    }
    let mut sched = Scheduler::new(
        SchedulerConfig {
            slots: exec.slots(),
            ctx_size: exec.ctx_size(),
            max_num_batched_tokens: args.max_num_batched_tokens,
            kv: Some(exec.kv_pool()),
            prefix_caching: !args.no_enable_prefix_caching,
            max_itl_ratio: args.max_itl_ratio.unwrap_or_else(default_max_itl_ratio),
        },
        m.tokenizer.clone(),
    );
    sched.set_pipeline(!args.no_pipeline);
    metrics.max_num_batched_tokens.store(
        sched.config().max_num_batched_tokens as u64,
        Ordering::Relaxed,
    );
    let obs = EngineObserver {
        metrics: metrics.clone(),
        engine: engine.clone(),
        local,
    };
    engine.loaded.store(true, Ordering::Release);
    engine
        .state
        .compare_exchange(LOADING, READY, Ordering::AcqRel, Ordering::Acquire)
        .ok();
    let _ = notes.send(EngineNote::Ready);
    let mut sup = Supervision {
        budget: RestartBudget::new(RestartPolicy::new(args.max_restarts)),
        notes,
    };
    loop {
        let why = match sched.run(exec.as_mut(), &rx, &obs) {
            RunEnd::Shutdown => break,
            RunEnd::ExecutorFailed(why) => why,
        };
        engine.loaded.store(false, Ordering::Release);
        engine.set_restarting(why.clone());
        // stops every rank that is still running and reaps them
        drop(exec);
        metrics.clear_tp_ranks();
        match restart(&args, &m, &mut sched, &rx, &obs, &mut sup, why) {
            Some(e) => exec = e,
            None => {
                tracing::debug!("engine thread done");
                return;
            }
        }
        engine.loaded.store(true, Ordering::Release);
        if engine
            .state
            .compare_exchange(RESTARTING, READY, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let _ = sup.notes.send(EngineNote::Restarted);
        }
    }
    drop(exec);
    tracing::debug!("engine thread done");
}

/// The engine thread's restart budget and its line to the HTTP side.
struct Supervision {
    budget: RestartBudget,
    notes: tokio::sync::mpsc::UnboundedSender<EngineNote>,
}

/// Start a new TP group after `why`; `None` on shutdown or when giving up
/// (the HTTP side has been told then).
fn restart(
    args: &ServeArgs,
    m: &OpenedModel,
    sched: &mut Scheduler,
    rx: &mpsc::Receiver<Command>,
    obs: &EngineObserver,
    sup: &mut Supervision,
    mut why: String,
) -> Option<Box<dyn Executor>> {
    let (engine, budget) = (&obs.engine, &mut sup.budget);
    loop {
        let busy = format!("the engine failed and is restarting: {why}");
        if sched.reject_pending(rx, &busy, obs) || engine.is_stopping() {
            return None;
        }
        let n = match budget.try_restart(Instant::now()) {
            Ok(n) => n,
            Err(give_up) => {
                let msg = format!("{give_up}; the last failure: {why}");
                tracing::error!("the TP group is down for good: {msg}");
                engine.set_failed(msg.clone());
                sched.reject_pending(rx, &msg, obs);
                let _ = sup.notes.send(EngineNote::Down(msg));
                return None;
            }
        };
        obs.metrics.tp_restarts.fetch_add(1, Ordering::Relaxed);
        let policy = budget.policy();
        tracing::warn!(
            "restarting the TP group (restart {n} of at most {} within {})",
            policy.max_restarts,
            window_text(policy.window)
        );
        let t0 = Instant::now();
        match start_executor(args, m, &obs.metrics) {
            Ok(e) => {
                tracing::info!(
                    "the TP group is serving again ({:.1}s to restart)",
                    t0.elapsed().as_secs_f64()
                );
                return Some(e);
            }
            Err(e) => {
                why = format!("restarting the TP group failed: {e:#}");
                tracing::error!("{why}");
                engine.set_failure(why.clone());
                obs.metrics.clear_tp_ranks();
            }
        }
    }
}

/// Run the server until SIGINT/SIGTERM (exit 0), a failed model load, or a
/// TP group that failed past `--max-restarts` (errors).
pub fn run(args: &ServeArgs) -> Result<()> {
    if args.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    if args.max_num_batched_tokens == 0 {
        bail!("--max-num-batched-tokens must be at least 1");
    }
    if let Some(r) = args.max_itl_ratio {
        if !(r == 0.0 || r.is_finite() && r > 1.0) {
            bail!("--max-itl-ratio must be 0 (off) or a number above 1 (got {r})");
        }
    }
    if args.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    for (flag, v) in [
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
        ("--idle-timeout", args.idle_timeout),
    ] {
        if !(v.is_finite() && v > 0.0) {
            bail!("{flag} must be a positive number of seconds (got {v})");
        }
    }
    let api_key = args.api_key.clone().filter(|k| !k.is_empty());
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let engine = Arc::new(Engine::new(cmd_tx, args.parallel, args.max_queue));
    let metrics = Arc::new(Metrics::new());
    let (info_tx, info_rx) = mpsc::channel();
    let (notes_tx, notes_rx) = tokio::sync::mpsc::unbounded_channel();
    let thread = {
        let (args, engine, metrics) = (args.clone(), engine.clone(), metrics.clone());
        std::thread::Builder::new()
            .name("mlxcel-engine".into())
            .spawn(move || engine_main(args, info_tx, notes_tx, cmd_rx, engine, metrics))
            .context("starting the engine thread")?
    };
    let info = info_rx
        .recv()
        .context("the engine thread stopped while opening the model")??;
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 8);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("mlxcel-http")
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let state = Arc::new(routes::AppState {
        engine: engine.clone(),
        metrics,
        model: info,
        api_key,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        body_timeout: Duration::from_secs_f64(args.body_timeout),
        tokenizing: tokio::sync::Semaphore::new(workers.min(4)),
    });
    let result = rt.block_on(serve(args, state, notes_rx));
    engine.set_stopping();
    engine.send(Command::Shutdown);
    if engine.loaded.load(Ordering::Acquire) || thread.is_finished() {
        // the engine finishes its current step, cancels the rest and stops its
        // ranks. (While it loads or restarts, it is not waited for: the ranks
        // die with this process.)
        let _ = thread.join();
    }
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn serve(
    args: &ServeArgs,
    state: Arc<routes::AppState>,
    mut notes: tokio::sync::mpsc::UnboundedReceiver<EngineNote>,
) -> Result<()> {
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    let local: SocketAddr = listener.local_addr()?;
    if state.api_key.is_none() && !listener.local_addr()?.ip().is_loopback() {
        tracing::warn!(
            "listening on {local} without --api-key: anyone who can reach it can use it"
        );
    }
    tracing::info!(
        "listening on http://{local} (model {}, ctx {}, --parallel {}, --max-queue {}); /health is 503 until the model is loaded",
        state.model.name,
        state.model.ctx_size,
        args.parallel,
        args.max_queue
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let failure: Arc<Mutex<Option<String>>> = Arc::default();
    {
        let engine = state.engine.clone();
        let failure = failure.clone();
        let name = state.model.name.clone();
        tokio::spawn(async move {
            let watch = async {
                let mut ready = false;
                let why = loop {
                    match notes.recv().await {
                        Some(EngineNote::Ready) => {
                            ready = true;
                            tracing::info!("model {name} is ready");
                        }
                        Some(EngineNote::Restarted) => {
                            tracing::info!("model {name} is ready again")
                        }
                        Some(EngineNote::LoadFailed(msg)) => {
                            tracing::error!("loading the model failed: {msg}");
                            break format!("loading the model failed: {msg}");
                        }
                        Some(EngineNote::Down(msg)) => {
                            break format!("the engine failed: {msg}");
                        }
                        None if ready => break "the engine thread stopped".to_string(),
                        None => break "the engine thread stopped while loading".to_string(),
                    }
                };
                if let Ok(mut f) = failure.lock() {
                    *f = Some(why);
                }
            };
            tokio::select! {
                _ = shutdown_signal() => tracing::info!("shutting down: no new requests; waiting for running ones"),
                _ = watch => {}
            }
            engine.set_stopping();
            let _ = stop_tx.send(true);
        });
    }
    let limits = http::Limits {
        header_timeout: Duration::from_secs_f64(args.header_timeout),
        idle_timeout: Duration::from_secs_f64(args.idle_timeout),
        max_connections: args.max_connections,
    };
    let server = http::serve(
        listener,
        routes::router(state.clone()),
        routes::overflow_router(state.clone()),
        limits,
        stop_rx.clone(),
    );
    let deadline = {
        let mut rx = stop_rx.clone();
        let engine = state.engine.clone();
        let timeout = Duration::from_secs(args.shutdown_timeout);
        async move {
            let _ = rx.wait_for(|v| *v).await;
            tokio::time::sleep(timeout).await;
            tracing::warn!("shutdown timeout: cancelling the requests still running");
            engine.send(Command::CancelAll("the server is shutting down".into()));
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    };
    tokio::select! {
        _ = server => {}
        _ = deadline => tracing::warn!("connections still open after the shutdown timeout; closing them"),
    }
    if let Some(msg) = failure.lock().ok().and_then(|f| f.clone()) {
        bail!("{msg}");
    }
    tracing::info!("server stopped");
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Events of one request, for the handlers.
pub type EventReceiver = tokio::sync::mpsc::UnboundedReceiver<Event>;
