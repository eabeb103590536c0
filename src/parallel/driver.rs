//! The driver side of tensor parallelism: validates the split, starts the N
//! rank processes with their placement and rendezvous, and executes step plans
//! by sending each plan to every rank and taking rank 0's result. The driver
//! itself never loads weights or touches a GPU.
//!
//! Any rank failure (exit, crash, stall past the step deadline, error reply)
//! stops every rank within seconds and fails the step with an error that names
//! the rank and shows its last stderr lines.
use std::path::PathBuf;
use std::time::Duration;

use super::launcher::{pick_free_ports, LaunchOptions, RankError, RankGroup};
use super::placement::{parse_visible_devices, visible_devices_for, VISIBLE_DEVICES_VAR};
use super::plan::{self, DoesNotFit, GpuMemory, Placement, PlanInput};
use super::protocol::{FromRank, Identity, RankReport, ToRank};
use super::rank::MEMORY_LIMIT_VAR;
use super::shard::{self, ShardError};
use crate::engine::step::{
    Executor, KvPool, MemoryStats, SampledToken, SeqMask, StepError, StepPlan, StepResult,
};
use crate::mlx::{self, distributed::GroupBackend};
use crate::model_dir::ModelDir;
use crate::models::kv_cache::{KvConfig, DEFAULT_BLOCK_SIZE};
use crate::models::{self, LoadFormat, ModelError};

/// `--tp-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TpBackend {
    /// NCCL when the CUDA backend sees at least N GPUs, else ring.
    #[default]
    Auto,
    Nccl,
    Ring,
}

#[derive(Debug, Clone)]
pub struct TpOptions {
    pub tp_size: usize,
    pub backend: TpBackend,
    /// Run all ranks on the one device there is, over ring.
    pub emulate: bool,
    /// Split the embedding and lm_head by vocabulary rows (default: `MLXCEL_VOCAB_PARALLEL`).
    pub vocab_parallel: bool,
    /// Rank r → this process's GPU entry `devices[r]` (default 0..N).
    pub devices: Option<Vec<usize>>,
    pub load_format: LoadFormat,
    /// MoE models: each rank holds whole experts (`--enable-expert-parallel`).
    pub expert_parallel: bool,
    pub ctx_size: usize,
    pub slots: usize,
    /// The paged KV cache's pool (every rank holds its kv heads of each block).
    pub kv: KvConfig,
    /// Tokens per step, decodes and prefill chunks together (the scheduler's budget;
    /// sizes the memory plan's working margin).
    pub max_num_batched_tokens: usize,
    /// The binary to run as ranks (default: this executable).
    pub program: Option<PathBuf>,
    /// Deadline for loading (per launch).
    pub load_timeout: Duration,
    /// Deadline for the first step (kernel compilation) and for later steps.
    pub first_step_timeout: Duration,
    pub step_timeout: Duration,
    /// A rank that sends no heartbeat for this long fails the group (idle or busy).
    pub heartbeat_timeout: Duration,
    /// Once one rank has answered a step, the others must within this (the
    /// first step: [`FIRST_STEP_STRAGGLER`] at least).
    pub straggler_timeout: Duration,
}

/// The straggler deadline of a group's first step at least (its kernels may
/// still compile at different speeds on the ranks).
pub const FIRST_STEP_STRAGGLER: Duration = Duration::from_secs(30);

impl TpOptions {
    pub fn new(tp_size: usize, ctx_size: usize, slots: usize) -> TpOptions {
        let secs = |var: &str, default: u64| {
            Duration::from_secs(
                std::env::var(var)
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(default),
            )
        };
        TpOptions {
            tp_size,
            expert_parallel: false,
            backend: TpBackend::Auto,
            emulate: false,
            vocab_parallel: crate::kernels::knobs::get().vocab_parallel,
            devices: None,
            load_format: LoadFormat::Safetensors,
            ctx_size,
            slots,
            kv: KvConfig::for_slots(slots, ctx_size, DEFAULT_BLOCK_SIZE),
            max_num_batched_tokens: 512,
            program: None,
            load_timeout: secs("MLXCEL_TP_LOAD_TIMEOUT", 1800),
            first_step_timeout: secs("MLXCEL_TP_FIRST_STEP_TIMEOUT", 600),
            step_timeout: secs("MLXCEL_TP_STEP_TIMEOUT", 60),
            heartbeat_timeout: secs("MLXCEL_TP_HEARTBEAT_TIMEOUT", 5),
            straggler_timeout: secs("MLXCEL_TP_STRAGGLER_TIMEOUT", 5),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Memory(#[from] DoesNotFit),
    #[error(
        "--tp-size {tp} needs {tp} GPUs but {found} {what} visible; add --tp-emulate to run the {tp} ranks on one device over the ring backend"
    )]
    NotEnoughGpus {
        tp: usize,
        found: usize,
        what: &'static str,
    },
    #[error(
        "--tp-backend nccl needs the CUDA backend of MLX (this process runs MLX's {0} backend)"
    )]
    NcclNeedsCuda(String),
    #[error("--devices lists {given} GPU(s) but --tp-size is {tp}")]
    DevicesCount { given: usize, tp: usize },
    #[error("--devices: {0}")]
    Devices(String),
    #[error(transparent)]
    Rank(#[from] RankError),
    #[error("rank {rank} failed while loading: {msg}")]
    RankFailed { rank: usize, msg: String },
    #[error("{0}")]
    Io(String),
}

/// Executes step plans on N rank processes.
pub struct TpExecutor {
    group: RankGroup,
    reports: Vec<RankReport>,
    /// Each rank's MLX memory, from its load report, then from its latest step.
    memory: Vec<MemoryStats>,
    backend: GroupBackend,
    opts: TpOptions,
    steps: u64,
    failed: Option<String>,
    /// Sequences started and not released, and whether their sampler has
    /// penalties (then their decode is not pipelined).
    penalised: std::collections::HashMap<u64, bool>,
    /// Pipelined decode steps queued on the ranks and not taken yet.
    queued: usize,
    _hostfile: Option<tempfile_path::TempPath>,
}

mod tempfile_path {
    /// A file removed on drop.
    pub struct TempPath(pub std::path::PathBuf);
    impl Drop for TempPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// Start of a ring hostfile's name, then the driver's pid, `-`, its first port, `.json`.
const HOSTFILE_PREFIX: &str = "mlxcel-ring-";

/// Remove the ring hostfiles in `dir` left by drivers that no longer run (a driver
/// removes its own on drop, which a killed one never reaches). Files of live processes,
/// and any other file, are left alone; failures are ignored.
fn remove_stale_hostfiles(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(HOSTFILE_PREFIX))
            .and_then(|n| n.strip_suffix(".json"))
            .and_then(|n| n.split_once('-'))
            .filter(|(_, port)| port.parse::<u16>().is_ok())
            .and_then(|(pid, _)| pid.parse::<i32>().ok())
            .filter(|&pid| pid > 0)
        else {
            continue;
        };
        // SAFETY: signal 0 only checks that the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// GPUs this process can use, counted without creating a context on them.
fn visible_gpus() -> usize {
    mlx::gpu_device_count()
}

impl TpExecutor {
    /// Broadcast a queued decode step `msg` of `rows` (no reply).
    fn queue_msg(&mut self, rows: &[(u64, usize, usize)], msg: ToRank) -> Result<(), StepError> {
        if let Some(msg) = &self.failed {
            return Err(StepError::Rank(format!(
                "the TP group has failed earlier: {msg}"
            )));
        }
        if let Some(&(id, _, _)) = rows.iter().find(|r| !self.can_pipeline(r.0)) {
            return Err(StepError::NotPipelined(id));
        }
        if let Err(e) = self.group.broadcast(&msg) {
            return Err(self.fail(e.to_string()));
        }
        self.queued += 1;
        Ok(())
    }
    /// Validate, spawn, handshake, load: returns once every rank is ready.
    pub fn launch(dir: &ModelDir, opts: TpOptions) -> Result<TpExecutor, LaunchError> {
        let n = opts.tp_size;
        let cfg = models::read_config(dir)?;
        shard::validate_with(&cfg, n, opts.expert_parallel)?;
        let backend_name = mlx::backend().to_string();
        let gpus = visible_gpus();
        let backend = match (opts.backend, opts.emulate) {
            (TpBackend::Ring, _) | (TpBackend::Auto, true) => GroupBackend::Ring,
            (TpBackend::Nccl, _) => {
                if mlx::backend() != mlx::Backend::Cuda {
                    return Err(LaunchError::NcclNeedsCuda(backend_name));
                }
                GroupBackend::Nccl
            }
            (TpBackend::Auto, false) => {
                if mlx::backend() == mlx::Backend::Cuda && gpus >= n {
                    GroupBackend::Nccl
                } else {
                    GroupBackend::Ring
                }
            }
        };
        // placement: rank r -> GPU entry devices[r]
        let entries: Vec<usize> = match &opts.devices {
            Some(d) => {
                if d.len() != n {
                    return Err(LaunchError::DevicesCount {
                        given: d.len(),
                        tp: n,
                    });
                }
                d.clone()
            }
            None if opts.emulate => vec![0; n],
            None => (0..n).collect(),
        };
        if !opts.emulate && gpus < n {
            let what = if gpus == 1 { "is" } else { "are" };
            return Err(LaunchError::NotEnoughGpus {
                tp: n,
                found: gpus,
                what,
            });
        }
        if let Some(&bad) = entries.iter().find(|&&e| gpus > 0 && e >= gpus) {
            return Err(LaunchError::Devices(format!(
                "GPU {bad} does not exist ({gpus} visible)"
            )));
        }
        let gpu_memory = check_memory(dir, &opts, &cfg, &entries, gpus)?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::try_launch(dir, &opts, &cfg, backend, &entries, gpus, &gpu_memory) {
                Err(LaunchError::Rank(e)) if attempt < 3 && looks_like_port_clash(&e) => {
                    tracing::warn!("TP start-up failed on a port clash, retrying: {e}");
                }
                other => return other,
            }
        }
    }

    fn try_launch(
        dir: &ModelDir,
        opts: &TpOptions,
        cfg: &models::ModelConfig,
        backend: GroupBackend,
        entries: &[usize],
        gpus: usize,
        gpu_memory: &[GpuMemory],
    ) -> Result<TpExecutor, LaunchError> {
        let n = opts.tp_size;
        let mut hostfile = None;
        let mut rank_envs: Vec<Vec<(String, String)>> = (0..n)
            .map(|r| {
                vec![
                    ("MLX_RANK".to_string(), r.to_string()),
                    ("MLX_WORLD_SIZE".to_string(), n.to_string()),
                ]
            })
            .collect();
        match backend {
            GroupBackend::Nccl => {
                let port = pick_free_ports(1)
                    .map_err(|e| LaunchError::Io(format!("picking a free port: {e}")))?[0];
                for env in rank_envs.iter_mut() {
                    env.push(("NCCL_HOST_IP".into(), "127.0.0.1".into()));
                    env.push(("NCCL_PORT".into(), port.to_string()));
                    if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
                        env.push(("NCCL_SOCKET_IFNAME".into(), "lo".into()));
                    }
                }
            }
            _ => {
                let ports = pick_free_ports(n)
                    .map_err(|e| LaunchError::Io(format!("picking free ports: {e}")))?;
                let hosts: Vec<Vec<String>> = ports
                    .iter()
                    .map(|p| vec![format!("127.0.0.1:{p}")])
                    .collect();
                let dir = std::env::temp_dir();
                remove_stale_hostfiles(&dir);
                let path = dir.join(format!(
                    "{HOSTFILE_PREFIX}{}-{}.json",
                    std::process::id(),
                    ports[0]
                ));
                std::fs::write(&path, serde_json::to_string(&hosts).unwrap_or_default())
                    .map_err(|e| LaunchError::Io(format!("writing {}: {e}", path.display())))?;
                for env in rank_envs.iter_mut() {
                    env.push(("MLX_HOSTFILE".into(), path.display().to_string()));
                }
                hostfile = Some(tempfile_path::TempPath(path));
            }
        }
        if gpus > 0 {
            for (r, env) in rank_envs.iter_mut().enumerate() {
                env.extend(
                    visible_devices_for(entries[r])
                        .map_err(|e| LaunchError::Devices(e.to_string()))?,
                );
            }
            if opts.emulate {
                // the GPU's total memory as the child query saw it: the driver opens no context
                if let Some(g) = gpu_memory
                    .iter()
                    .find(|g| g.index == entries[0] && g.total_bytes > 0)
                {
                    let share = (g.total_bytes as f64 * 0.9 / n as f64) as u64;
                    for env in rank_envs.iter_mut() {
                        env.push((MEMORY_LIMIT_VAR.into(), share.to_string()));
                    }
                }
            }
        } else if std::env::var_os(VISIBLE_DEVICES_VAR)
            .is_some_and(|v| parse_visible_devices(&v.to_string_lossy()).is_empty())
        {
            // nothing to do: no GPUs in this process's view
        }
        let mut args: Vec<String> = vec![
            "_rank".into(),
            "--model".into(),
            dir.root.display().to_string(),
            "--load-format".into(),
            match opts.load_format {
                LoadFormat::Dummy => "dummy".into(),
                LoadFormat::Safetensors => "safetensors".into(),
            },
            "--ctx-size".into(),
            opts.ctx_size.to_string(),
            "--slots".into(),
            opts.slots.to_string(),
            "--block-size".into(),
            opts.kv.block_size.to_string(),
            "--kv-blocks".into(),
            opts.kv.num_blocks.to_string(),
            "--tp-size".into(),
            n.to_string(),
            "--backend".into(),
            backend.name().into(),
            "--vocab-parallel".into(),
            opts.vocab_parallel.to_string(),
        ];
        if opts.expert_parallel {
            args.push("--enable-expert-parallel".into());
        }
        if opts.kv.preallocate {
            args.push("--kv-preallocate".into());
        }
        let config_bytes = std::fs::read(&dir.config)
            .map_err(|e| LaunchError::Io(format!("{}: {e}", dir.config.display())))?;
        let weight_files = if opts.load_format == LoadFormat::Dummy {
            vec![]
        } else {
            dir.weights.clone()
        };
        let expected =
            serde_json::to_value(Identity::of(&config_bytes, n, &weight_files)).unwrap_or_default();
        let check = |ids: &[serde_json::Value]| -> Result<(), super::channel::IdentityMismatch> {
            for (rank, id) in ids.iter().enumerate() {
                if let Some(what) = super::channel::first_difference(&expected, id) {
                    return Err(super::channel::IdentityMismatch {
                        rank,
                        what: format!("{what} (driver vs rank; config.json, --tp-size or weight files differ)"),
                    });
                }
            }
            Ok(())
        };
        let launch = LaunchOptions {
            startup_timeout: Duration::from_secs(120),
            heartbeat_timeout: Some(opts.heartbeat_timeout),
            ..LaunchOptions::default()
        };
        tracing::info!(
            "starting {n} TP ranks ({} backend{}) for {} ({} layers)",
            backend,
            if opts.emulate {
                ", emulated on one device"
            } else {
                ""
            },
            dir.root.display(),
            cfg.num_layers
        );
        let mut group = match &opts.program {
            Some(p) => RankGroup::spawn_with(p.as_os_str(), &args, rank_envs, &launch, check)?,
            None => RankGroup::spawn(&args, rank_envs, &launch, check)?,
        };
        let replies: Vec<FromRank> = group.recv_all(opts.load_timeout)?;
        let mut reports = Vec::with_capacity(n);
        for (rank, r) in replies.into_iter().enumerate() {
            match r {
                FromRank::Ready(rep) => reports.push(rep),
                FromRank::Error(msg) => {
                    group.shutdown(Duration::from_secs(2));
                    return Err(LaunchError::RankFailed { rank, msg });
                }
                FromRank::Step(_) | FromRank::Sampled(_) => {
                    group.shutdown(Duration::from_secs(2));
                    return Err(LaunchError::RankFailed {
                        rank,
                        msg: "sent a step result before loading".into(),
                    });
                }
            }
        }
        for r in &reports {
            tracing::info!("{}", r.summary());
        }
        let memory = reports
            .iter()
            .map(|r| MemoryStats {
                active: r.active_memory,
                peak: r.peak_memory,
                cache: 0,
            })
            .collect();
        Ok(TpExecutor {
            group,
            reports,
            memory,
            backend,
            opts: opts.clone(),
            steps: 0,
            failed: None,
            penalised: std::collections::HashMap::new(),
            queued: 0,
            _hostfile: hostfile,
        })
    }

    /// What each rank reported after loading.
    pub fn reports(&self) -> &[RankReport] {
        &self.reports
    }

    pub fn backend(&self) -> GroupBackend {
        self.backend
    }

    /// Each rank's MLX memory as of its latest step (its load report before the first).
    pub fn memory(&self) -> &[MemoryStats] {
        &self.memory
    }

    pub fn pids(&self) -> Vec<u32> {
        self.group.pids()
    }

    /// Stop all ranks (clean exit requested first).
    pub fn shutdown(&mut self) {
        let _ = self.group.broadcast(&ToRank::Shutdown);
        self.group.shutdown(Duration::from_secs(2));
    }

    fn fail(&mut self, msg: String) -> StepError {
        self.group.shutdown(Duration::from_secs(2));
        self.failed = Some(msg.clone());
        StepError::Rank(msg)
    }
}

/// The memory plan, checked before anything is spawned: refuses with the numbers and
/// what would fit. Free GPU memory is asked of a short-lived child process, so the
/// driver creates no CUDA context. Returns the GPUs' memory when it was looked up.
fn check_memory(
    dir: &ModelDir,
    opts: &TpOptions,
    cfg: &models::ModelConfig,
    entries: &[usize],
    gpus: usize,
) -> Result<Vec<GpuMemory>, LaunchError> {
    let catalog = match opts.load_format {
        LoadFormat::Safetensors => Some(models::weights::catalog(dir).map_err(ModelError::from)?),
        LoadFormat::Dummy => None,
    };
    let input = PlanInput {
        cfg,
        catalog: catalog.as_ref(),
        tp_size: opts.tp_size,
        ctx_size: opts.ctx_size,
        slots: opts.slots,
        max_num_batched_tokens: opts.max_num_batched_tokens,
        backend: mlx::backend(),
        vocab_parallel: opts.vocab_parallel,
        kv_tokens: opts
            .kv
            .preallocate
            .then_some(opts.kv.num_blocks * opts.kv.block_size),
    };
    let mem = plan::plan_memory_with(&input, opts.expert_parallel)?;
    let place = Placement {
        entries,
        shared: opts.emulate || gpus == 0,
        child: Some(opts.program.as_deref()),
    };
    let (budget, mut gpu_memory) = plan::budget(mlx::backend(), &place);
    let r = mem.ranks.iter().max_by_key(|r| r.total_bytes);
    if let Some(r) = r {
        tracing::info!(
            "memory plan: up to {:.3} GB per rank (weights {:.3} GB, KV cache {:.3} GB, margin {:.3} GB)",
            r.total_bytes as f64 / 1e9,
            r.weight_bytes as f64 / 1e9,
            r.kv_bytes as f64 / 1e9,
            r.margin_bytes as f64 / 1e9
        );
    }
    match budget {
        Ok(b) => plan::check_fit(&input, &mem, &b)?,
        Err(note) => tracing::warn!("memory plan not checked against free memory: {note}"),
    }
    if gpu_memory.is_empty() && gpus > 0 && opts.emulate {
        gpu_memory = plan::gpu_memory_via_child(opts.program.as_deref()).unwrap_or_default();
    }
    Ok(gpu_memory)
}

fn looks_like_port_clash(e: &RankError) -> bool {
    let text = e.to_string().to_lowercase();
    text.contains("address already in use")
        || text.contains("couldn't bind")
        || text.contains("bind")
}

impl Executor for TpExecutor {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepResult, StepError> {
        if let Some(msg) = &self.failed {
            return Err(StepError::Rank(format!(
                "the TP group has failed earlier: {msg}"
            )));
        }
        let mut plan = plan.clone();
        for id in &plan.release {
            self.penalised.remove(id);
        }
        let starts = plan
            .seqs
            .iter_mut()
            .filter_map(|s| Some((s.seq_id, s.start.as_mut()?)))
            .chain(plan.forks.iter_mut().map(|f| (f.seq_id, &mut f.start)));
        for (seq_id, start) in starts {
            // every rank samples, and pipelined decode feeds each rank its own
            // samples: they must draw from one random stream
            if start.params.seed.is_none() {
                start.params.seed = Some(rand::random::<u64>());
            }
            self.penalised.insert(seq_id, start.params.has_penalties());
        }
        if let Err(e) = self.group.broadcast(&ToRank::Step(plan)) {
            return Err(self.fail(e.to_string()));
        }
        let (timeout, straggler) = if self.steps == 0 {
            (
                self.opts.first_step_timeout,
                self.opts.straggler_timeout.max(FIRST_STEP_STRAGGLER),
            )
        } else {
            (self.opts.step_timeout, self.opts.straggler_timeout)
        };
        let replies: Vec<FromRank> = match self.group.recv_all_within(timeout, Some(straggler)) {
            Ok(r) => r,
            Err(e) => return Err(self.fail(e.to_string())),
        };
        self.steps += 1;
        let mut out = None;
        for (rank, r) in replies.into_iter().enumerate() {
            if let FromRank::Step(StepResult {
                memory: Some(m), ..
            }) = &r
            {
                if let Some(slot) = self.memory.get_mut(rank) {
                    *slot = *m;
                }
            }
            match r {
                FromRank::Step(res) if rank == 0 => out = Some(res),
                FromRank::Step(_) => {}
                FromRank::Error(msg) => {
                    let tail = self.group.stderr_tail(rank).join("\n    ");
                    return Err(self.fail(format!("TP rank {rank} failed: {msg}\n    {tail}")));
                }
                FromRank::Ready(_) | FromRank::Sampled(_) => {
                    return Err(self.fail(format!("TP rank {rank} sent an unexpected message")))
                }
            }
        }
        Ok(out.unwrap_or_default())
    }

    fn can_pipeline(&self, seq_id: u64) -> bool {
        self.failed.is_none() && self.penalised.get(&seq_id) == Some(&false)
    }

    fn queue_decode(
        &mut self,
        rows: &[(u64, usize, usize)],
        tokens: Option<&[u32]>,
        tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        let msg = ToRank::QueueDecode {
            rows: rows.to_vec(),
            tokens: tokens.map(<[u32]>::to_vec),
            tables: tables.to_vec(),
        };
        self.queue_msg(rows, msg)
    }

    fn queue_forward(
        &mut self,
        rows: &[(u64, usize, usize)],
        tokens: Option<&[u32]>,
        tables: &[(usize, Vec<u32>)],
    ) -> Result<(), StepError> {
        let msg = ToRank::QueueForward {
            rows: rows.to_vec(),
            tokens: tokens.map(<[u32]>::to_vec),
            tables: tables.to_vec(),
        };
        self.queue_msg(rows, msg)
    }

    fn sample_queued(&mut self, masks: &[SeqMask]) -> Result<(), StepError> {
        if let Some(msg) = &self.failed {
            return Err(StepError::Rank(format!(
                "the TP group has failed earlier: {msg}"
            )));
        }
        if self.queued == 0 {
            return Err(StepError::Rank("no forward step queued".into()));
        }
        let msg = ToRank::SampleQueued {
            masks: masks.to_vec(),
        };
        if let Err(e) = self.group.broadcast(&msg) {
            return Err(self.fail(e.to_string()));
        }
        Ok(())
    }

    fn take_sampled(&mut self) -> Result<Vec<SampledToken>, StepError> {
        if let Some(msg) = &self.failed {
            return Err(StepError::Rank(format!(
                "the TP group has failed earlier: {msg}"
            )));
        }
        if self.queued == 0 {
            return Err(StepError::Rank("no decode step queued".into()));
        }
        if let Err(e) = self.group.broadcast(&ToRank::TakeSampled) {
            return Err(self.fail(e.to_string()));
        }
        self.queued -= 1;
        let replies: Vec<FromRank> = match self
            .group
            .recv_all_within(self.opts.step_timeout, Some(self.opts.straggler_timeout))
        {
            Ok(r) => r,
            Err(e) => return Err(self.fail(e.to_string())),
        };
        self.steps += 1;
        let mut out: Option<Vec<SampledToken>> = None;
        for (rank, r) in replies.into_iter().enumerate() {
            match r {
                FromRank::Sampled(toks) => match &out {
                    None => out = Some(toks),
                    Some(first) => {
                        let a: Vec<u32> = first.iter().map(|t| t.token).collect();
                        let b: Vec<u32> = toks.iter().map(|t| t.token).collect();
                        if a != b {
                            return Err(self.fail(format!(
                                "TP ranks sampled different tokens (rank 0 {a:?}, rank {rank} {b:?}): \
                                 their logits are not bitwise replicated"
                            )));
                        }
                    }
                },
                FromRank::Error(msg) => {
                    let tail = self.group.stderr_tail(rank).join("\n    ");
                    return Err(self.fail(format!("TP rank {rank} failed: {msg}\n    {tail}")));
                }
                _ => return Err(self.fail(format!("TP rank {rank} sent an unexpected message"))),
            }
        }
        Ok(out.unwrap_or_default())
    }

    fn discard_queued(&mut self) {
        if self.queued > 0 && self.failed.is_none() {
            if let Err(e) = self.group.broadcast(&ToRank::DiscardQueued) {
                self.fail(e.to_string());
            }
        }
        self.queued = 0;
    }

    fn ctx_size(&self) -> usize {
        self.opts.ctx_size
    }

    fn slots(&self) -> usize {
        self.opts.slots
    }

    fn kv_pool(&self) -> KvPool {
        KvPool {
            block_size: self.opts.kv.block_size,
            num_blocks: self.opts.kv.num_blocks,
        }
    }

    /// Takes in what the ranks sent meanwhile without waiting: a rank that has
    /// died (or closed its channel) fails the group here, and every rank is stopped.
    fn peak_memory(&self) -> u64 {
        self.memory.iter().map(|m| m.peak).max().unwrap_or(0)
    }

    fn check_health(&mut self) -> Result<(), StepError> {
        if let Some(msg) = &self.failed {
            return Err(StepError::Rank(format!(
                "the TP group has failed earlier: {msg}"
            )));
        }
        match self.group.check_health() {
            Ok(()) => Ok(()),
            Err(e) => Err(self.fail(e.to_string())),
        }
    }
}

impl Drop for TpExecutor {
    fn drop(&mut self) {
        if self.failed.is_none() {
            let _ = self.group.broadcast(&ToRank::Shutdown);
        }
        self.group.shutdown(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostfiles_of_drivers_that_are_gone_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        // the pid of a child that has exited and been reaped
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let live = std::process::id();
        let names = [
            format!("{HOSTFILE_PREFIX}{gone}-40000.json"),
            format!("{HOSTFILE_PREFIX}{live}-40001.json"),
            format!("{HOSTFILE_PREFIX}{gone}-port.json"),
            format!("{HOSTFILE_PREFIX}{gone}-40002.txt"),
            "other.json".to_string(),
        ];
        for n in &names {
            std::fs::write(dir.path().join(n), "[]").unwrap();
        }
        remove_stale_hostfiles(dir.path());
        let kept: Vec<bool> = names.iter().map(|n| dir.path().join(n).exists()).collect();
        assert_eq!(kept, [false, true, true, true, true]);
    }
}
