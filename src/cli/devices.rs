//! `mlxcel devices [--json] [--check]`: the GPUs MLX sees, and a per-GPU probe.
//!
//! `--check` runs `mlxcel _probe-device` once per GPU, each child seeing only
//! its GPU (see [`crate::parallel::placement`]), all at once, each with a
//! timeout. With no GPU it probes the CPU once.
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use serde_json::json;

use super::probe::ProbeReport;
use crate::mlx;
use crate::parallel::child::run_with_timeout;
use crate::parallel::placement;

const GIB: f64 = (1u64 << 30) as f64;

#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Run a small matmul and copy on each GPU, each in its own child process.
    #[arg(long)]
    pub check: bool,
    /// Seconds each --check child may take before it is killed.
    #[arg(long, default_value_t = 120, requires = "check")]
    pub timeout_s: u64,
}

/// One GPU as `devices` reports it.
#[derive(Debug, Clone, Serialize)]
pub struct GpuRow {
    pub index: usize,
    pub name: String,
    pub architecture: String,
    pub total_memory_bytes: u64,
    pub total_memory_gib: f64,
    /// `None` where the backend does not report free memory.
    pub free_memory_gib: Option<f64>,
    /// The same in bytes (the memory plan reads this).
    pub free_memory_bytes: Option<u64>,
    pub pci_bus_id: String,
    pub uuid: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The outcome of one `--check` child.
#[derive(Debug, Clone, Serialize)]
pub struct CheckResult {
    /// GPU index in this process's view; `None` for the CPU probe.
    pub index: Option<usize>,
    /// What the child got as `CUDA_VISIBLE_DEVICES`.
    pub visible_device: Option<String>,
    pub ok: bool,
    pub device: Option<String>,
    pub max_abs_err: Option<f32>,
    pub ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn gpu_rows() -> Vec<GpuRow> {
    (0..mlx::gpu_device_count())
        .map(|i| match mlx::device_info(i as i32) {
            Ok(d) => GpuRow {
                index: i,
                name: d.name,
                architecture: d.architecture,
                total_memory_bytes: d.total_memory,
                total_memory_gib: round2(d.total_memory as f64 / GIB),
                free_memory_gib: (d.free_memory > 0).then(|| round2(d.free_memory as f64 / GIB)),
                free_memory_bytes: (d.free_memory > 0).then_some(d.free_memory),
                pci_bus_id: d.pci_bus_id,
                uuid: d.uuid,
                error: None,
            },
            Err(e) => GpuRow {
                index: i,
                name: String::new(),
                architecture: String::new(),
                total_memory_bytes: 0,
                total_memory_gib: 0.0,
                free_memory_gib: None,
                free_memory_bytes: None,
                pci_bus_id: String::new(),
                uuid: String::new(),
                error: Some(e.to_string()),
            },
        })
        .collect()
}

/// `mlxcel devices`.
pub fn run(args: &DevicesArgs) -> Result<()> {
    let backend = mlx::backend();
    let version = mlx::version();
    let rows = gpu_rows();
    let visible = std::env::var(placement::VISIBLE_DEVICES_VAR).ok();

    if !args.json {
        print_table(&rows, backend, &version, visible.as_deref());
    }
    let checks = if args.check {
        let timeout = Duration::from_secs(args.timeout_s);
        if !args.json {
            if rows.is_empty() {
                println!(
                    "checking the CPU in a child process (timeout {}s)",
                    args.timeout_s
                );
            } else {
                println!(
                    "checking {} GPU(s), one child process each (timeout {}s)",
                    rows.len(),
                    args.timeout_s
                );
            }
        }
        let checks = run_checks(rows.len(), timeout)?;
        if !args.json {
            print_checks(&checks);
        }
        Some(checks)
    } else {
        None
    };

    if args.json {
        let mut obj = json!({
            "backend": backend.to_string(),
            "mlx_version": version,
            "gpu_count": rows.len(),
            "cuda_visible_devices": visible,
            "gpus": rows,
        });
        if let Some(c) = &checks {
            obj["check"] = serde_json::to_value(c)?;
            obj["check_ok"] = json!(c.iter().all(|r| r.ok));
        }
        println!("{obj}");
    }

    if let Some(c) = &checks {
        let failed = c.iter().filter(|r| !r.ok).count();
        if failed > 0 {
            bail!("{failed} of {} device check(s) failed", c.len());
        }
    }
    Ok(())
}

fn print_table(rows: &[GpuRow], backend: mlx::Backend, version: &str, visible: Option<&str>) {
    println!("MLX {version}, backend {backend}");
    if let Some(v) = visible {
        println!("CUDA_VISIBLE_DEVICES={v}");
    }
    if rows.is_empty() {
        if backend == mlx::Backend::Cpu {
            println!("0 GPUs (CPU backend): work runs on the CPU");
        } else {
            println!("0 GPUs ({backend} backend sees none): work runs on the CPU");
        }
        return;
    }
    println!("{} GPU(s)", rows.len());
    let name_w = rows.iter().map(|r| r.name.len()).max().unwrap_or(0).max(4);
    let arch_w = rows
        .iter()
        .map(|r| r.architecture.len())
        .max()
        .unwrap_or(0)
        .max(4);
    println!(
        "{:<5} {:<name_w$} {:<arch_w$} {:>9} {:>9}  PCI BUS ID",
        "INDEX", "NAME", "ARCH", "TOTAL GiB", "FREE GiB"
    );
    for r in rows {
        if let Some(e) = &r.error {
            println!("{:<5} error: {e}", r.index);
            continue;
        }
        let free = r
            .free_memory_gib
            .map(|f| format!("{f:.1}"))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<5} {:<name_w$} {:<arch_w$} {:>9.1} {:>9}  {}",
            r.index,
            r.name,
            r.architecture,
            r.total_memory_gib,
            free,
            if r.pci_bus_id.is_empty() {
                "-"
            } else {
                &r.pci_bus_id
            }
        );
    }
}

fn print_checks(checks: &[CheckResult]) {
    for c in checks {
        let what = match (c.index, &c.visible_device) {
            (Some(i), Some(v)) => format!("GPU {i} (CUDA_VISIBLE_DEVICES={v})"),
            (Some(i), None) => format!("GPU {i}"),
            (None, _) => "CPU (no GPU)".to_string(),
        };
        let device = c.device.as_deref().unwrap_or("?");
        if c.ok {
            println!(
                "{what}: ok  {device}  max_abs_err {:.2e}  {:.0} ms",
                c.max_abs_err.unwrap_or(0.0),
                c.ms.unwrap_or(0.0)
            );
        } else {
            println!(
                "{what}: FAILED  {device}: {}",
                c.error.as_deref().unwrap_or("unknown error")
            );
        }
    }
    let failed = checks.iter().filter(|c| !c.ok).count();
    if failed == 0 {
        println!("all {} check(s) passed", checks.len());
    }
}

/// The environment of one probe child, or why there is none.
type ChildEnv = Result<Vec<(String, String)>, String>;

/// One child per GPU (or one CPU child when `n_gpus == 0`), all at once.
fn run_checks(n_gpus: usize, timeout: Duration) -> Result<Vec<CheckResult>> {
    let exe = std::env::current_exe().context("locating the mlxcel binary")?;
    let jobs: Vec<(Option<usize>, ChildEnv)> = if n_gpus == 0 {
        vec![(None, Ok(Vec::new()))]
    } else {
        (0..n_gpus)
            .map(|i| {
                (
                    Some(i),
                    placement::visible_devices_for(i).map_err(|e| e.to_string()),
                )
            })
            .collect()
    };
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .into_iter()
            .map(|(index, env)| {
                let exe = &exe;
                s.spawn(move || check_one(exe, index, env, timeout))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("check thread panicked"))
            .collect::<Vec<_>>()
    });
    Ok(results)
}

fn check_one(
    exe: &std::path::Path,
    index: Option<usize>,
    env: ChildEnv,
    timeout: Duration,
) -> CheckResult {
    let mut result = CheckResult {
        index,
        visible_device: None,
        ok: false,
        device: None,
        max_abs_err: None,
        ms: None,
        error: None,
    };
    let env = match env {
        Ok(env) => env,
        Err(e) => {
            result.error = Some(e);
            return result;
        }
    };
    result.visible_device = env
        .iter()
        .find(|(k, _)| k == placement::VISIBLE_DEVICES_VAR)
        .map(|(_, v)| v.clone());
    let mut cmd = Command::new(exe);
    cmd.arg("_probe-device").envs(env);
    if index.is_some() {
        cmd.arg("--expect-gpu");
    }
    let out = match run_with_timeout(cmd, timeout) {
        Ok(out) => out,
        Err(e) => {
            result.error = Some(format!("could not run the probe: {e:#}"));
            return result;
        }
    };
    let report: Option<ProbeReport> = out
        .stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok());
    if let Some(r) = &report {
        result.device = Some(r.device.clone());
        result.max_abs_err = r.max_abs_err;
        result.ms = Some(r.ms);
    }
    let exited_ok = out.status.is_some_and(|s| s.success());
    result.ok = exited_ok && report.as_ref().is_some_and(|r| r.ok);
    if !result.ok {
        result.error = Some(if out.timed_out {
            format!("no answer within {}s (killed)", timeout.as_secs())
        } else if let Some(e) = report.as_ref().and_then(|r| r.error.clone()) {
            e
        } else {
            let tail: Vec<&str> = out.stderr.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            format!(
                "probe exited with {}: {}",
                out.status
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| "no status".into()),
                tail.join(" | ")
            )
        });
    }
    result
}
