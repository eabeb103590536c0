//! The `mlxcel` command line: argument parsing, logging, and the subcommands.
//!
//! Every start logs one line `detected N GPUs (backend B, MLX V)` to stderr.
//! Subcommands whose names start with `_` are hidden helpers that the binary
//! runs as child processes of itself (device probes, collective tests).
use std::io::IsTerminal;

use anyhow::Result;
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use crate::mlx;

pub mod bench;
pub mod bench_masks;
pub mod devices;
pub mod generate;
pub mod launch_costs;
pub mod plan;
pub mod probe;
pub mod tp_parity;

/// LLM inference over MLX, with tensor parallelism across the GPUs of one node.
#[derive(Debug, Parser)]
#[command(name = "mlxcel", version, about, propagate_version = true)]
pub struct Cli {
    /// More log output (-v debug, -vv trace). `RUST_LOG`, when set, wins.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    // Room for the user-facing commands, added with their implementations:
    //   Generate(generate::GenerateArgs)  - run a model on a prompt (default: the built-in demo model)
    //   Bench(bench::BenchArgs)           - prefill/decode throughput
    //   Plan(plan::PlanArgs)              - how a model splits over the GPUs (TP degree, memory)
    //   Serve(serve::ServeArgs)           - OpenAI-compatible HTTP server
    /// Generate text from a prompt (default model: the built-in demo model).
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode speed; prints JSON.
    Bench(bench::BenchArgs),
    /// Measure the host's cost of constrained decoding per step (token masks, grammar
    /// advances, the masked sampling graph) with a JSON schema; prints JSON.
    BenchMasks(bench_masks::BenchMasksArgs),
    /// List the GPUs MLX sees (and, with --check, test each one in a child process).
    Devices(devices::DevicesArgs),
    /// Show each rank's memory (weights, KV cache, margin) against its device's free memory, without loading.
    Plan(plan::PlanArgs),
    /// Compare a --tp-size N run with one process, teacher-forced: top-1 agreement and logits cosine.
    TpParity(tp_parity::TpParityArgs),
    /// OpenAI-compatible HTTP server (the same as the `mlxcel-server` binary).
    Serve(crate::server::ServeArgs),

    /// (internal) A tensor-parallel rank process, started by the driver.
    #[command(name = "_rank", hide = true)]
    Rank(crate::parallel::rank::RankArgs),

    /// (internal) `devices --json` for the memory plan (works from every binary).
    #[command(name = "_devices", hide = true)]
    DevicesJson,

    /// (internal) Test the one GPU this process sees; prints one JSON line.
    #[command(name = "_probe-device", hide = true)]
    ProbeDevice(probe::ProbeDeviceArgs),

    /// (internal) Join a distributed group, all_sum and all_gather; prints one JSON line.
    #[command(name = "_allsum-probe", hide = true)]
    AllsumProbe(probe::AllsumProbeArgs),

    /// (internal) The host's cost per GPU kernel launched as an op of its own or several by
    /// one op; prints a JSON line per way (CUDA only).
    #[command(name = "_launch-costs", hide = true)]
    LaunchCosts(launch_costs::LaunchCostsArgs),

    /// (internal) Compile one kernel with NVRTC for the compiled-kernel cache: a job
    /// (JSON) on stdin, the binary on stdout (`kernels::cache::WORKER_COMMAND`).
    #[command(name = "_nvrtc", hide = true)]
    Nvrtc,
}

/// Entry point of the `mlxcel` binary.
pub fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Command::Nvrtc = cli.command {
        // (before the start-up: a compile process touches nothing of MLX but NVRTC)
        return mlx::kernel_cache::serve_worker().map_err(anyhow::Error::msg);
    }
    startup(cli.verbose)?;
    match cli.command {
        Command::Generate(args) => generate::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::BenchMasks(args) => bench_masks::run(&args),
        Command::Devices(args) => devices::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::TpParity(args) => tp_parity::run(&args),
        Command::DevicesJson => devices::run(&devices::DevicesArgs {
            json: true,
            check: false,
            timeout_s: 120,
        }),
        Command::Serve(args) => crate::server::run(&args),
        Command::Rank(args) => crate::parallel::rank::run(&args),
        Command::ProbeDevice(args) => probe::probe_device(&args),
        Command::AllsumProbe(args) => probe::allsum_probe(&args),
        Command::LaunchCosts(args) => launch_costs::run(&args),
        Command::Nvrtc => unreachable!("handled before the start-up"),
    }
}

/// Logging, the CUDA device order, the `detected N GPUs` line and the kernels' tuning
/// knobs (a bad value is an error naming the variable); every binary calls it first.
pub fn startup(verbose: u8) -> Result<()> {
    init_logging(verbose);
    prepare_cuda_env();
    tracing::info!(
        "detected {} GPUs (backend {}, MLX {})",
        mlx::gpu_device_count(),
        mlx::backend(),
        mlx::version()
    );
    crate::kernels::knobs::check()?;
    crate::kernels::cache::init();
    Ok(())
}

/// Logs go to stderr: `RUST_LOG` if set, else info (debug with -v, trace with -vv).
fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = match std::env::var("RUST_LOG") {
        Ok(s) if !s.trim().is_empty() => EnvFilter::new(s),
        _ => EnvFilter::new(level),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Number GPUs in PCI bus order (as `nvidia-smi` does) unless the user chose an
/// order, so this process's GPU `i` and a child placed on entry `i` agree.
/// Runs before any MLX call, while the process has one thread.
fn prepare_cuda_env() {
    use crate::parallel::placement::{DEFAULT_DEVICE_ORDER, DEVICE_ORDER_VAR};
    if std::env::var_os(DEVICE_ORDER_VAR).is_none() {
        std::env::set_var(DEVICE_ORDER_VAR, DEFAULT_DEVICE_ORDER);
    }
    if mlx::backend() == mlx::Backend::Cuda {
        for (name, value) in CUDA_GRAPH_DEFAULTS {
            if std::env::var_os(name).is_none() {
                std::env::set_var(name, value);
            }
        }
    }
}

/// MLX's CUDA backend records kernels into CUDA graphs and launches a graph every
/// `MLX_MAX_OPS_PER_BUFFER` kernels or `MLX_MAX_MB_PER_BUFFER` MB of inputs (30 and
/// 400 on H100/H200). A decode step is hundreds of small kernels and the host is the
/// bottleneck there; bigger graphs cost the host less per kernel. On H200, 4-bit 8B
/// decode went from 229 to 290 tok/s with these values (docs/data/envsweep-h200.txt). Set
/// before MLX's first CUDA work (its encoder reads them once), unless already set.
const CUDA_GRAPH_DEFAULTS: [(&str, &str); 2] = [
    ("MLX_MAX_OPS_PER_BUFFER", "100"),
    ("MLX_MAX_MB_PER_BUFFER", "4000"),
];
