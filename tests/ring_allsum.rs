//! MLX's ring backend across real processes: N copies of `mlxcel _allsum-probe`
//! on loopback, each `all_sum`s values made from (seed, rank) and `all_gather`s
//! its rank; every rank must get the exact sum and `[0, 1, ..]`.
//!
//! The ring backend reads `MLX_RANK` and `MLX_HOSTFILE` (a JSON list, one
//! entry per rank, of lists of "ip:port" the rank listens on); the probe also
//! checks the group size against `MLX_WORLD_SIZE`.
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mlxcel::cli::probe::{probe_values, AllsumReport};

const RANK_TIMEOUT: Duration = Duration::from_secs(90);
const ATTEMPTS: usize = 3;

/// `n` distinct free loopback ports (all bound at once, then released).
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

struct Rank {
    child: Child,
    pid: u32,
}

fn kill_all(ranks: &mut [Rank]) {
    for r in ranks.iter_mut() {
        let _ = r.child.kill();
        let _ = r.child.wait();
    }
}

/// One try: spawn `n` ranks on fresh ports and collect their reports.
fn try_ring(
    n: usize,
    count: u32,
    seed: u64,
    attempt: usize,
) -> Result<Vec<(u32, AllsumReport)>, String> {
    let ports = free_ports(n);
    let hosts: Vec<Vec<String>> = ports
        .iter()
        .map(|p| vec![format!("127.0.0.1:{p}")])
        .collect();
    // removed when this try returns, whichever way
    let hostfile = tempfile::Builder::new()
        .prefix(&format!("mlxcel-ring-{n}-{attempt}-"))
        .suffix(".json")
        .tempfile()
        .unwrap();
    std::fs::write(hostfile.path(), serde_json::to_string(&hosts).unwrap()).unwrap();

    let mut ranks = Vec::new();
    for rank in 0..n {
        let child = Command::new(env!("CARGO_BIN_EXE_mlxcel"))
            .args(["_allsum-probe", "--backend", "ring"])
            .args(["--count", &count.to_string(), "--seed", &seed.to_string()])
            .env("MLX_RANK", rank.to_string())
            .env("MLX_WORLD_SIZE", n.to_string())
            .env("MLX_HOSTFILE", hostfile.path())
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawning rank {rank}: {e}"))?;
        let pid = child.id();
        ranks.push(Rank { child, pid });
    }

    // wait for all, killing everyone at the deadline
    let deadline = Instant::now() + RANK_TIMEOUT;
    let mut done = vec![false; n];
    while done.iter().any(|d| !d) {
        for (i, r) in ranks.iter_mut().enumerate() {
            if !done[i] {
                match r.child.try_wait() {
                    Ok(Some(_)) => done[i] = true,
                    Ok(None) => {}
                    Err(e) => {
                        kill_all(&mut ranks);
                        return Err(format!("waiting for rank {i}: {e}"));
                    }
                }
            }
        }
        if Instant::now() >= deadline {
            kill_all(&mut ranks);
            return Err(format!(
                "ranks did not finish within {RANK_TIMEOUT:?} (killed)"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(hostfile);

    let mut reports = Vec::new();
    let mut errors = Vec::new();
    for (i, r) in ranks.into_iter().enumerate() {
        let out = r.child.wait_with_output().map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            errors.push(format!("rank {i} exited with {}: {stderr}", out.status));
            continue;
        }
        let line = stdout.lines().rev().find(|l| l.starts_with('{'));
        match line.map(serde_json::from_str::<AllsumReport>) {
            Some(Ok(rep)) => reports.push((r.pid, rep)),
            _ => errors.push(format!("rank {i} printed no report: {stdout:?} / {stderr}")),
        }
    }
    if errors.is_empty() {
        Ok(reports)
    } else {
        Err(errors.join("\n"))
    }
}

fn check_ring(n: usize, count: u32, seed: u64) {
    let mut last_err = String::new();
    for attempt in 0..ATTEMPTS {
        match try_ring(n, count, seed, attempt) {
            Ok(reports) => return check_reports(n, count, seed, &reports),
            Err(e) => {
                eprintln!("ring of {n}, attempt {}: {e}", attempt + 1);
                last_err = e;
                // let whatever got in the way (a port taken, a busy machine) pass
                std::thread::sleep(Duration::from_secs(2));
            }
        }
    }
    panic!("ring of {n} failed {ATTEMPTS} times; last error:\n{last_err}");
}

fn check_reports(n: usize, count: u32, seed: u64, reports: &[(u32, AllsumReport)]) {
    assert_eq!(reports.len(), n);
    let mut expected = vec![0f32; count as usize];
    for rank in 0..n {
        for (e, v) in expected
            .iter_mut()
            .zip(probe_values(seed, rank as u32, count as usize))
        {
            *e += v;
        }
    }
    let mut pids: Vec<u32> = reports.iter().map(|(pid, _)| *pid).collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids.len(), n, "ranks must be distinct processes");
    for (i, (pid, r)) in reports.iter().enumerate() {
        assert_eq!(r.pid, *pid, "report pid is the child's pid");
        assert_eq!(r.rank as usize, i, "rank order");
        assert_eq!(r.size as usize, n);
        assert_eq!(r.backend, "ring");
        assert_eq!(
            r.sum, expected,
            "rank {i}: all_sum differs from the expected sum"
        );
        assert_eq!(
            r.gathered,
            (0..n as i32).collect::<Vec<_>>(),
            "rank {i}: all_gather"
        );
    }
}

#[test]
fn ring_allsum_2_ranks() {
    check_ring(2, 1000, 42);
}

#[test]
fn ring_allsum_3_ranks() {
    // not a multiple of the rank count, so the ring's chunks are uneven
    check_ring(3, 1001, 7);
}

#[test]
fn allsum_probe_without_hostfile_fails_clearly() {
    let out = Command::new(env!("CARGO_BIN_EXE_mlxcel"))
        .args(["_allsum-probe", "--backend", "ring"])
        .env("MLX_RANK", "0")
        .env_remove("MLX_HOSTFILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("MLX_HOSTFILE"), "stderr: {stderr}");
}
