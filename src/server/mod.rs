//! `mlxcel-server` / `mlxcel serve`: an OpenAI-compatible HTTP server with
//! continuous batching, streaming and Prometheus metrics.
//!
//! Threads: one engine thread owns everything MLX (it opens the model, loads
//! the weights or launches the TP ranks, warms up, then runs the
//! [`Scheduler`] loop); the tokio runtime serves HTTP and never touches MLX.
//! Handlers tokenize, validate and submit [`Request`]s over a std channel and
//! read the request's [`Event`]s from a tokio channel.
//!
//! See `docs/server.md` for the endpoints, parameters, flags and metrics.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::cli::generate::{load_weights, open_model, ModelArgs, TpArgs};
use crate::engine::sampler::SamplingParams;
use crate::engine::scheduler::{
    Command, Event, Observer, Outcome, Request, Scheduler, SchedulerConfig, Usage,
};
use crate::engine::step::{Executor, LocalExecutor, SeqStart, SeqStep, StepError, StepPlan};
use crate::mlx;
use crate::parallel::driver::TpExecutor;
use crate::tokenizer::Tokenizer;

pub mod error;
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
    /// Sequences generated at once (KV-cache slots).
    #[arg(long, default_value_t = 8)]
    pub parallel: usize,
    /// Requests that may wait for a slot; more get 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Model name in the API (default: the model folder's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Prompt tokens per prefill step (long prompts are prefilled in chunks between decode steps).
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Seconds to let running requests finish after SIGINT/SIGTERM before cancelling them.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
    #[command(flatten)]
    pub tp: TpArgs,
}

const LOADING: u8 = 0;
const READY: u8 = 1;
const FAILED: u8 = 2;
const STOPPING: u8 = 3;

/// What the HTTP side shares with the engine thread.
pub struct Engine {
    tx: Mutex<Sender<Command>>,
    state: AtomicU8,
    failure: Mutex<Option<String>>,
    /// Requests submitted and not yet finished (queued + running).
    in_system: AtomicUsize,
    /// Set by the engine thread once the executor is loaded and warmed up.
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
            _ => {
                let why = self
                    .failure
                    .lock()
                    .ok()
                    .and_then(|f| f.clone())
                    .unwrap_or_default();
                Some(ApiError::unavailable(format!(
                    "the engine has failed: {why}"
                )))
            }
        }
    }

    fn set_failed(&self, why: String) {
        if let Ok(mut f) = self.failure.lock() {
            *f = Some(why);
        }
        self.state.store(FAILED, Ordering::Release);
    }

    fn set_stopping(&self) {
        let _ = self
            .state
            .compare_exchange(READY, STOPPING, Ordering::AcqRel, Ordering::Acquire);
        let _ = self
            .state
            .compare_exchange(LOADING, STOPPING, Ordering::AcqRel, Ordering::Acquire);
    }

    fn send(&self, cmd: Command) -> bool {
        self.tx
            .lock()
            .map(|tx| tx.send(cmd).is_ok())
            .unwrap_or(false)
    }

    /// Queue a request: 503 unless ready, 429 when `--parallel + --max-queue` are in.
    pub fn submit(&self, req: Request) -> Result<(), ApiError> {
        if let Some(e) = self.unavailable() {
            return Err(e);
        }
        let cap = self.parallel + self.max_queue;
        let admitted = self
            .in_system
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            });
        if admitted.is_err() {
            return Err(ApiError::busy(format!(
                "the server is busy: {} requests running and {} waiting (--max-queue {})",
                self.parallel, self.max_queue, self.max_queue
            )));
        }
        if !self.send(Command::Submit(Box::new(req))) {
            self.in_system.fetch_sub(1, Ordering::AcqRel);
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
    fn engine_error(&self, error: &StepError, fatal: bool) {
        self.metrics.engine_errors.fetch_add(1, Ordering::Relaxed);
        if fatal {
            // Restarting the TP group would go here (a later issue); for now the
            // engine stays down and /health says so.
            self.engine.set_failed(error.to_string());
        }
    }
}

fn publish_memory(m: &Metrics) {
    m.memory_active
        .store(mlx::memory::active(), Ordering::Relaxed);
    m.memory_peak.store(mlx::memory::peak(), Ordering::Relaxed);
    m.memory_cache
        .store(mlx::memory::cache(), Ordering::Relaxed);
}

/// One tiny step so the first request does not pay for kernel set-up.
fn warm_up(exec: &mut dyn Executor, tokenizer: &Tokenizer) -> Result<(), StepError> {
    let token = tokenizer
        .bos_token_id()
        .or_else(|| tokenizer.eos_token_ids().first().copied())
        .unwrap_or(0);
    exec.execute(&StepPlan {
        seqs: vec![SeqStep {
            seq_id: 0,
            slot: 0,
            pos: 0,
            tokens: vec![token],
            start: Some(SeqStart {
                params: SamplingParams {
                    seed: Some(0),
                    ..SamplingParams::default()
                },
                prompt: vec![token],
            }),
            sample: true,
        }],
        ..Default::default()
    })?;
    exec.execute(&StepPlan {
        release: vec![0],
        ..Default::default()
    })?;
    Ok(())
}

/// The engine thread: open, load, warm up, then schedule until told to stop.
fn engine_main(
    args: ServeArgs,
    info_tx: Sender<Result<ModelInfo>>,
    loaded_tx: tokio::sync::oneshot::Sender<Result<(), String>>,
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
    }));
    let local = !args.tp.uses_ranks();
    let loaded: Result<Box<dyn Executor>> = (|| {
        let mut exec: Box<dyn Executor> = if local {
            let model = load_weights(&args.model, &m)?;
            Box::new(LocalExecutor::new(model, args.parallel, m.ctx_size))
        } else {
            let opts = args
                .tp
                .options(args.model.load_format, m.ctx_size, args.parallel);
            Box::new(TpExecutor::launch(&m.dir, opts)?)
        };
        warm_up(exec.as_mut(), &m.tokenizer).context("warm-up step")?;
        Ok(exec)
    })();
    let mut exec = match loaded {
        Ok(e) => e,
        Err(e) => {
            let msg = format!("{e:#}");
            engine.set_failed(msg.clone());
            let _ = loaded_tx.send(Err(msg));
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
            prefill_chunk: args.prefill_chunk,
        },
        m.tokenizer.clone(),
    );
    let obs = EngineObserver {
        metrics,
        engine: engine.clone(),
        local,
    };
    engine.loaded.store(true, Ordering::Release);
    engine
        .state
        .compare_exchange(LOADING, READY, Ordering::AcqRel, Ordering::Acquire)
        .ok();
    let _ = loaded_tx.send(Ok(()));
    sched.run(exec.as_mut(), &rx, &obs);
    drop(exec);
    tracing::debug!("engine thread done");
}

/// Run the server until SIGINT/SIGTERM (exit 0) or a failed model load (error).
pub fn run(args: &ServeArgs) -> Result<()> {
    if args.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    let api_key = args.api_key.clone().filter(|k| !k.is_empty());
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let engine = Arc::new(Engine::new(cmd_tx, args.parallel, args.max_queue));
    let metrics = Arc::new(Metrics::new());
    let (info_tx, info_rx) = mpsc::channel();
    let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel();
    let thread = {
        let (args, engine, metrics) = (args.clone(), engine.clone(), metrics.clone());
        std::thread::Builder::new()
            .name("mlxcel-engine".into())
            .spawn(move || engine_main(args, info_tx, loaded_tx, cmd_rx, engine, metrics))
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
    });
    let result = rt.block_on(serve(args, state, loaded_rx));
    engine.set_stopping();
    engine.send(Command::Shutdown);
    if engine.loaded.load(Ordering::Acquire) {
        // the engine finishes its current step, cancels the rest and stops its ranks
        let _ = thread.join();
    }
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn serve(
    args: &ServeArgs,
    state: Arc<routes::AppState>,
    loaded_rx: tokio::sync::oneshot::Receiver<Result<(), String>>,
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
    let load_failure: Arc<Mutex<Option<String>>> = Arc::default();
    {
        let engine = state.engine.clone();
        let load_failure = load_failure.clone();
        let name = state.model.name.clone();
        tokio::spawn(async move {
            let loaded = async {
                match loaded_rx.await {
                    Ok(Ok(())) => {
                        tracing::info!("model {name} is ready");
                        std::future::pending::<()>().await
                    }
                    Ok(Err(msg)) => {
                        tracing::error!("loading the model failed: {msg}");
                        if let Ok(mut f) = load_failure.lock() {
                            *f = Some(msg);
                        }
                    }
                    Err(_) => {
                        if let Ok(mut f) = load_failure.lock() {
                            *f = Some("the engine thread stopped while loading".into());
                        }
                    }
                }
            };
            tokio::select! {
                _ = shutdown_signal() => tracing::info!("shutting down: no new requests; waiting for running ones"),
                _ = loaded => {}
            }
            engine.set_stopping();
            let _ = stop_tx.send(true);
        });
    }
    let app = routes::router(state.clone());
    let graceful = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|v| *v).await;
        }
    };
    let server = axum::serve(listener, app).with_graceful_shutdown(graceful);
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
        r = async { server.await } => r.context("serving HTTP")?,
        _ = deadline => tracing::warn!("connections still open after the shutdown timeout; closing them"),
    }
    if let Some(msg) = load_failure.lock().ok().and_then(|f| f.clone()) {
        bail!("loading the model failed: {msg}");
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
