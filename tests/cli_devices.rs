//! `mlxcel devices [--json] [--check]` run as a process, on whatever backend
//! the build linked (the CPU one on CI: then 0 GPUs and a CPU probe).
use std::process::{Command, Output};

fn mlxcel(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_mlxcel"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run mlxcel");
    assert!(
        out.status.success(),
        "mlxcel {args:?} failed: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The one start line, on stderr: `detected N GPUs (backend B, MLX V)`.
fn detected_line(stderr: &str) -> (usize, String) {
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("detected ")).collect();
    assert_eq!(lines.len(), 1, "one detected line expected: {stderr}");
    let rest = lines[0].split("detected ").nth(1).unwrap();
    let n: usize = rest.split(' ').next().unwrap().parse().unwrap();
    assert!(rest.contains(" GPUs (backend "), "{rest}");
    assert!(rest.contains(", MLX "), "{rest}");
    let backend = rest
        .split("(backend ")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .to_string();
    (n, backend)
}

#[test]
fn devices_table() {
    let out = mlxcel(&["devices"]);
    let (n, backend) = detected_line(&text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("MLX "), "{stdout}");
    assert!(stdout.contains(&format!("backend {backend}")), "{stdout}");
    if n == 0 {
        assert!(stdout.contains("0 GPUs"), "{stdout}");
        if backend == "cpu" {
            assert!(
                stdout.contains("0 GPUs (CPU backend): work runs on the CPU"),
                "{stdout}"
            );
        }
    } else {
        assert!(stdout.contains("PCI BUS ID"), "{stdout}");
    }
}

#[test]
fn devices_json() {
    let out = mlxcel(&["devices", "--json"]);
    let (n, backend) = detected_line(&text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(
        stdout.trim().lines().count(),
        1,
        "one JSON object: {stdout}"
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["backend"], backend);
    assert!(v["mlx_version"].as_str().unwrap().starts_with("0."));
    assert_eq!(v["gpu_count"], n);
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), n);
    for (i, g) in gpus.iter().enumerate() {
        assert_eq!(g["index"], i);
        for key in ["name", "architecture", "total_memory_gib", "pci_bus_id"] {
            assert!(g.get(key).is_some(), "gpu {i} lacks {key}: {g}");
        }
    }
}

#[test]
fn devices_check() {
    let out = mlxcel(&["devices", "--check"]);
    let (n, _) = detected_line(&text(&out.stderr));
    let stdout = text(&out.stdout);
    let oks = stdout.lines().filter(|l| l.contains(": ok ")).count();
    assert_eq!(oks, n.max(1), "{stdout}");
    assert!(stdout.contains("check(s) passed"), "{stdout}");
    if n == 0 {
        assert!(stdout.contains("CPU (no GPU): ok"), "{stdout}");
    }
}

#[test]
fn devices_check_json() {
    let out = mlxcel(&["devices", "--check", "--json"]);
    let v: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(v["check_ok"], true);
    let checks = v["check"].as_array().unwrap();
    assert_eq!(
        checks.len(),
        v["gpu_count"].as_u64().unwrap().max(1) as usize
    );
    for c in checks {
        assert_eq!(c["ok"], true, "{c}");
        assert!(c["max_abs_err"].as_f64().unwrap() < 0.05, "{c}");
    }
}

#[test]
fn probe_device_prints_one_json_line() {
    let out = mlxcel(&["_probe-device"]);
    let stdout = text(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["ok"], true);
    for key in ["device", "max_abs_err", "ms"] {
        assert!(v.get(key).is_some(), "{v}");
    }
}

/// A tuning knob with a bad value stops every binary at start-up, naming the variable;
/// with `-v` a knob that differs from its default is logged.
#[test]
fn tuning_knobs_are_checked_at_start_up() {
    for bin in [
        env!("CARGO_BIN_EXE_mlxcel"),
        env!("CARGO_BIN_EXE_mlxcel-server"),
    ] {
        // the server gets a folder that does not exist: were the knob not checked first,
        // it would fail for that instead (and never start serving)
        let args: &[&str] = if bin.ends_with("mlxcel") {
            &["devices"]
        } else {
            &["-m", "/nonexistent/mlxcel-model", "--port", "0"]
        };
        let out = Command::new(bin)
            .args(args)
            .env_remove("RUST_LOG")
            .env("MLXCEL_QGEMV_MMA", "9")
            .output()
            .expect("run the binary");
        let err = text(&out.stderr);
        assert!(
            !out.status.success(),
            "{bin} ran with MLXCEL_QGEMV_MMA=9: {err}"
        );
        assert!(
            err.contains("MLXCEL_QGEMV_MMA") && err.contains("\"9\""),
            "{err}"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_mlxcel"))
        .args(["-v", "devices"])
        .env_remove("RUST_LOG")
        .env("MLXCEL_ATTN", "0")
        .output()
        .expect("run mlxcel");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("tuning knob MLXCEL_ATTN=0"),
        "{}",
        text(&out.stderr)
    );
}
