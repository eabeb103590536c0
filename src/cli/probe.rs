//! Hidden helper subcommands that the binary runs as child processes of itself.
//!
//! * `_probe-device`: test the one GPU this process sees (a matmul checked
//!   against a Rust reference, and a CPU→GPU→CPU copy); one JSON line.
//! * `_allsum-probe`: join a distributed group, `all_sum` deterministic values
//!   and `all_gather` the rank ids; one JSON line.
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::mlx::{self, distributed::GroupBackend, Array, Stream};

/// Side of the square matrices the device probe multiplies.
pub const PROBE_N: usize = 256;
/// Largest accepted |GPU - reference| of the probe matmul. Loose enough for
/// TF32 (entries of the product are sums of 256 terms of size up to 1, with a
/// standard deviation near 5), tight enough to catch a broken device.
pub const PROBE_TOL: f32 = 5e-2;

#[derive(Debug, Args)]
pub struct ProbeDeviceArgs {
    /// Fail if this process sees no GPU (instead of probing the CPU).
    #[arg(long)]
    pub expect_gpu: bool,
    /// Seed of the probe's matrices.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// The JSON line `_probe-device` prints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProbeReport {
    pub ok: bool,
    /// `NAME (PCI bus id)` of the GPU, or `cpu`.
    pub device: String,
    pub max_abs_err: Option<f32>,
    /// Wall time of the whole probe, MLX start included.
    pub ms: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Args)]
pub struct AllsumProbeArgs {
    /// Distributed backend: ring, nccl or any.
    #[arg(long, default_value = "ring")]
    pub backend: GroupBackend,
    /// Number of f32 values each rank contributes.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub count: u32,
    /// Seed of the values (combined with the rank).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// The JSON line `_allsum-probe` prints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AllsumReport {
    pub rank: i32,
    pub size: i32,
    pub pid: u32,
    pub backend: String,
    pub sum: Vec<f32>,
    pub gathered: Vec<i32>,
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `count` values in `[-4, 4)` that depend only on `(seed, rank)`. They are
/// multiples of 1/256, so sums over many ranks are exact in f32 whatever the
/// order of the additions: a correct `all_sum` matches bit for bit.
pub fn probe_values(seed: u64, rank: u32, count: usize) -> Vec<f32> {
    let mut state = seed ^ (u64::from(rank) + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..count)
        .map(|_| {
            let q = (splitmix64(&mut state) >> 53) as i32; // 0..2048
            (q - 1024) as f32 / 256.0
        })
        .collect()
}

/// `_probe-device`: prints a [`ProbeReport`]; fails if the probe did.
pub fn probe_device(args: &ProbeDeviceArgs) -> Result<()> {
    let start = Instant::now();
    let mut device = "cpu".to_string();
    let result = run_device_probe(args, &mut device);
    let ms = (start.elapsed().as_secs_f64() * 1e4).round() / 10.0;
    let report = match result {
        Ok(err) if err <= PROBE_TOL => ProbeReport {
            ok: true,
            device,
            max_abs_err: Some(err),
            ms,
            error: None,
        },
        Ok(err) => ProbeReport {
            ok: false,
            device,
            max_abs_err: Some(err),
            ms,
            error: Some(format!(
                "matmul differs from the reference by {err:e} (tolerance {PROBE_TOL:e})"
            )),
        },
        Err(e) => ProbeReport {
            ok: false,
            device,
            max_abs_err: None,
            ms,
            error: Some(format!("{e:#}")),
        },
    };
    println!("{}", serde_json::to_string(&report)?);
    if !report.ok {
        bail!(
            "device probe failed: {}",
            report.error.as_deref().unwrap_or("unknown error")
        );
    }
    Ok(())
}

/// Runs the checks; returns the matmul's largest absolute error.
fn run_device_probe(args: &ProbeDeviceArgs, device: &mut String) -> Result<f32> {
    let n_gpus = mlx::gpu_device_count();
    if args.expect_gpu && n_gpus == 0 {
        bail!(
            "this process sees no GPU (backend {}, CUDA_VISIBLE_DEVICES={:?})",
            mlx::backend(),
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
        );
    }
    let target = if n_gpus > 0 {
        let info = mlx::device_info(0).context("reading GPU 0's properties")?;
        *device = if info.pci_bus_id.is_empty() {
            info.name.clone()
        } else {
            format!("{} ({})", info.name, info.pci_bus_id)
        };
        mlx::set_default_gpu(0).context("making GPU 0 the default device")?
    } else {
        mlx::set_default_cpu()?;
        Stream::default_for(false)?
    };

    let n = PROBE_N;
    // values in [-1, 1): probe_values gives [-4, 4)
    let a: Vec<f32> = probe_values(args.seed, 0, n * n)
        .into_iter()
        .map(|v| v / 4.0)
        .collect();
    let b: Vec<f32> = probe_values(args.seed, 1, n * n)
        .into_iter()
        .map(|v| v / 4.0)
        .collect();
    let shape = [n as i32, n as i32];

    // matmul on the target device, against an f64 reference computed here
    let c = Array::from_slice(&a, &shape)?
        .matmul(&Array::from_slice(&b, &shape)?)
        .context("matmul")?;
    let got: Vec<f32> = c.to_vec().context("evaluating the matmul")?;
    let want = reference_matmul(&a, &b, n);
    let mut max_err = 0f32;
    for (g, w) in got.iter().zip(&want) {
        let e = (f64::from(*g) - w).abs() as f32;
        if e.is_nan() || !g.is_finite() {
            bail!("matmul produced a non-finite value");
        }
        max_err = max_err.max(e);
    }

    // CPU -> target -> CPU copy must give back the same bits
    let cpu = Stream::new_cpu()?;
    let x = Array::from_slice(&a, &shape)?;
    let back = x
        .copy_to_stream(&cpu)?
        .copy_to_stream(&target)?
        .copy_to_stream(&cpu)?;
    let back: Vec<f32> = back.to_vec().context("evaluating the copies")?;
    if back
        .iter()
        .map(|v| v.to_bits())
        .ne(a.iter().map(|v| v.to_bits()))
    {
        bail!("CPU -> GPU -> CPU copy changed the data");
    }
    mlx::synchronize()?;
    Ok(max_err)
}

fn reference_matmul(a: &[f32], b: &[f32], n: usize) -> Vec<f64> {
    let mut c = vec![0f64; n * n];
    for i in 0..n {
        let row = &mut c[i * n..(i + 1) * n];
        for k in 0..n {
            let aik = f64::from(a[i * n + k]);
            for (cj, bkj) in row.iter_mut().zip(&b[k * n..(k + 1) * n]) {
                *cj += aik * f64::from(*bkj);
            }
        }
    }
    c
}

/// `_allsum-probe`: prints an [`AllsumReport`].
pub fn allsum_probe(args: &AllsumProbeArgs) -> Result<()> {
    if args.backend != GroupBackend::Any && !mlx::distributed::is_available(args.backend) {
        bail!(
            "the {} distributed backend is not available in this MLX build (backend {})",
            args.backend,
            mlx::backend()
        );
    }
    let group = mlx::distributed::init(args.backend, true).with_context(|| {
        format!(
            "joining the {} group (MLX_RANK={:?}, MLX_WORLD_SIZE={:?}, MLX_HOSTFILE={:?})",
            args.backend,
            std::env::var("MLX_RANK").ok(),
            std::env::var("MLX_WORLD_SIZE").ok(),
            std::env::var("MLX_HOSTFILE").ok()
        )
    })?;
    if let Ok(ws) = std::env::var("MLX_WORLD_SIZE") {
        let ws: i32 = ws
            .trim()
            .parse()
            .with_context(|| format!("MLX_WORLD_SIZE={ws:?} is not a number"))?;
        group.expect_size(ws)?;
    }
    let rank = group.rank();
    tracing::debug!(rank, size = group.size(), backend = %args.backend, "joined group");
    let values = probe_values(args.seed, rank as u32, args.count as usize);
    let x = Array::from_slice(&values, &[args.count as i32])?;
    let sum = group.all_sum(&x).context("all_sum")?;
    let gathered = group
        .all_gather(&Array::from_slice(&[rank], &[1])?)
        .context("all_gather")?;
    mlx::eval(&[&sum, &gathered]).context("evaluating the collectives")?;
    let report = AllsumReport {
        rank,
        size: group.size(),
        pid: std::process::id(),
        backend: args.backend.to_string(),
        sum: sum.to_vec()?,
        gathered: gathered.to_vec()?,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_values_are_deterministic_and_exact_quarters() {
        let a = probe_values(7, 1, 64);
        assert_eq!(a, probe_values(7, 1, 64));
        assert_ne!(a, probe_values(7, 2, 64));
        assert_ne!(a, probe_values(8, 1, 64));
        for v in &a {
            assert!((-4.0..4.0).contains(v));
            assert_eq!((v * 256.0).fract(), 0.0);
        }
    }

    #[test]
    fn reference_matmul_small() {
        // [[1,2],[3,4]] @ [[5,6],[7,8]] = [[19,22],[43,50]]
        let c = reference_matmul(&[1., 2., 3., 4.], &[5., 6., 7., 8.], 2);
        assert_eq!(c, vec![19., 22., 43., 50.]);
    }
}
