//! `_launch-costs`: the host's cost of a GPU kernel launched as an MLX op of its own, against
//! one launched by an op that launches several ([`crate::mlx::Array::launch_chain`]), per
//! kernel. A decode step is bound by the host's work per op (docs/benchmarks.md, "Rank
//! proxies"); this tells how much of that work an op that launched a whole layer's kernels
//! would keep. One JSON line per way of launching:
//! - `add`: MLX's own elementwise op, one kernel each;
//! - `custom`: a custom kernel op (`fast::cuda_kernel`, as mlxcel's decode kernels are made);
//! - `chain/G`: ops that launch G kernels each.
//!
//! Every way chains the same number of kernels, each adding 1 to the last one's output, and
//! the result is checked.
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde::Serialize;

use crate::mlx::{self, fast::CudaKernel, Array, Backend, Dtype, Stream};

#[derive(Debug, Args)]
pub struct LaunchCostsArgs {
    /// Kernels each way chains in one evaluated graph.
    #[arg(long, default_value_t = 480, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub kernels: u32,
    /// Kernels per op of the `chain/G` ways (comma-separated); each must divide --kernels.
    #[arg(long, value_delimiter = ',', default_value = "1,2,6,8,32")]
    pub per_op: Vec<u32>,
    /// Elements of the chained float32 array.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=1 << 24))]
    pub elements: u32,
    /// Timed runs of each way (the one with the least host time is reported).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeats: u32,
}

/// One way's line.
#[derive(Debug, Serialize)]
struct WayReport {
    way: String,
    kernels: u32,
    ops: u32,
    /// Building the graph, µs per kernel.
    build_us_per_kernel: f64,
    /// `async_eval` (MLX encodes and launches), µs per kernel.
    eval_us_per_kernel: f64,
    /// Both, µs per kernel.
    host_us_per_kernel: f64,
    /// Waiting for the device after `async_eval` returned, ms.
    wait_ms: f64,
}

pub fn run(args: &LaunchCostsArgs) -> Result<()> {
    for &g in &args.per_op {
        ensure!(
            g >= 1 && args.kernels.is_multiple_of(g),
            "--per-op {g} does not divide --kernels {}",
            args.kernels
        );
    }
    if mlx::backend() != Backend::Cuda {
        bail!(
            "_launch-costs needs MLX's CUDA backend (this is {})",
            mlx::backend()
        );
    }
    if let Some(why) = mlx::launch_chain_unavailable() {
        bail!("_launch-costs: kernels launched by one op are not available here: {why}");
    }
    let stream = Stream::default_for(true)?;
    let n = args.elements as i32;
    let x = Array::zeros(&[n], Dtype::F32)?.add_scalar(0.0)?;
    mlx::eval(&[&x])?;
    let mut ways = vec![Way::Add, Way::Custom];
    ways.extend(args.per_op.iter().map(|&g| Way::Chain(g)));
    let mut failed = Vec::new();
    for &way in &ways {
        // a way that fails is reported and the others still run
        match time_way(way, &x, args, &stream) {
            Ok(r) => println!("{}", serde_json::to_string(&r)?),
            Err(e) => {
                println!(
                    "{}",
                    serde_json::json!({ "way": way.to_string(), "error": format!("{e:#}") })
                );
                failed.push(way.to_string());
            }
        }
    }
    ensure!(failed.is_empty(), "ways that failed: {}", failed.join(", "));
    Ok(())
}

/// The host's time per kernel of `way` (the run with the least of it), the result checked.
fn time_way(way: Way, x: &Array, args: &LaunchCostsArgs, stream: &Stream) -> Result<WayReport> {
    let build = |x: &Array| -> Result<(Array, u32)> { chain(way, x, args.kernels, stream) };
    // (first run untimed: module loads and compiles)
    let (y, _) = build(x)?;
    mlx::eval(&[&y])?;
    let mut best: Option<WayReport> = None;
    for _ in 0..args.repeats {
        let t0 = Instant::now();
        let (y, ops) = build(x)?;
        let t1 = Instant::now();
        mlx::async_eval(&[&y])?;
        let t2 = Instant::now();
        mlx::eval(&[&y])?;
        let t3 = Instant::now();
        check(&y, args.kernels, way)?;
        let k = f64::from(args.kernels);
        let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
        let r = WayReport {
            way: way.to_string(),
            kernels: args.kernels,
            ops,
            build_us_per_kernel: us(t0, t1) / k,
            eval_us_per_kernel: us(t1, t2) / k,
            host_us_per_kernel: us(t0, t2) / k,
            wait_ms: us(t2, t3) / 1e3,
        };
        if best
            .as_ref()
            .is_none_or(|b| r.host_us_per_kernel < b.host_us_per_kernel)
        {
            best = Some(r);
        }
    }
    best.context("no timed run")
}

/// A way of launching the chain's kernels (see the module docs).
#[derive(Debug, Clone, Copy)]
enum Way {
    Add,
    Custom,
    /// Ops of this many kernels each.
    Chain(u32),
}

impl std::fmt::Display for Way {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Way::Add => f.write_str("add"),
            Way::Custom => f.write_str("custom"),
            Way::Chain(g) => write!(f, "chain/{g}"),
        }
    }
}

/// `x` + `kernels`, by `way`; the ops it built.
fn chain(way: Way, x: &Array, kernels: u32, stream: &Stream) -> Result<(Array, u32)> {
    let ops = match way {
        Way::Chain(g) => kernels / g,
        _ => kernels,
    };
    let mut y = x.clone();
    for _ in 0..ops {
        y = match way {
            Way::Add => y.add_scalar(1.0)?,
            Way::Custom => add_one_kernel(&y)?,
            Way::Chain(g) => y.launch_chain(g as i32, stream)?,
        };
    }
    Ok((y, ops))
}

/// `x` + 1 by a custom kernel op.
fn add_one_kernel(x: &Array) -> Result<Array> {
    let n = x.size() as i32;
    let (inputs, outputs) = (["x".to_string()], ["y".to_string()]);
    let k = CudaKernel {
        name: "mlxcel_launch_costs_add_one",
        input_names: &inputs,
        output_names: &outputs,
        header: "",
        body: "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\nif (i < N) y[i] = x[i] + 1.0f;\n",
        shared_memory: 0,
    };
    let mut out = k.call(
        &[x],
        &[&[n]],
        Dtype::F32,
        &["N".to_string()],
        &[n],
        Dtype::F32,
        [n, 1, 1],
        [256, 1, 1],
    )?;
    Ok(out.remove(0))
}

/// Every element of `y` is `kernels` (the chain started at 0).
fn check(y: &Array, kernels: u32, way: Way) -> Result<()> {
    let v = y.to_vec::<f32>()?;
    let want = kernels as f32;
    match v.iter().position(|&e| e != want) {
        Some(i) => bail!("{way}: element {i} is {} (want {want})", v[i]),
        None => Ok(()),
    }
}
