//! Tensor-parallel loading and memory on the CPU (ranks emulated over ring):
//! each rank reads only its bytes, its peak RSS stays near its share, the memory
//! plan matches what ranks hold, and a plan that does not fit is refused before
//! anything is spawned, with the numbers and the smallest `--tp-size` that fits.
//!
//! Checkpoints are random, written here with the `safetensors` crate: Llama-3-8B's
//! shape ratios at tiny dims. The tests run one at a time (each starts several
//! processes; CI has 2 cores).
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

use mlxcel::model_dir::ModelDir;
use mlxcel::models::{self, LoadFormat};
use mlxcel::parallel::driver::{TpExecutor, TpOptions};
use mlxcel::parallel::plan::{self, PlanInput};
use mlxcel::parallel::protocol::RankReport;
use rand::{RngCore, SeedableRng};
use safetensors::tensor::TensorView;
use serde_json::{json, Value};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh empty folder under the temp dir, removed when the guard drops.
fn tmp(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("mlxcel-tpmem-{tag}-"))
        .tempdir()
        .unwrap()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Llama-3-8B's ratios (hidden : heads : kv heads : intermediate : vocab) at `hidden`.
struct Shape {
    hidden: usize,
    heads: usize,
    kv: usize,
    inter: usize,
    vocab: usize,
    layers: usize,
    dtype: &'static str,
}

impl Shape {
    fn elt(&self) -> usize {
        if self.dtype == "float32" {
            4
        } else {
            2
        }
    }

    /// (name, shape, split across ranks?) of every tensor (the embedding and lm_head by
    /// vocabulary rows).
    fn tensors(&self) -> Vec<(String, Vec<usize>, bool)> {
        let (h, hd) = (self.hidden, self.hidden / self.heads);
        let mut v = vec![
            (
                "model.embed_tokens.weight".to_string(),
                vec![self.vocab, h],
                true,
            ),
            ("model.norm.weight".to_string(), vec![h], false),
            ("lm_head.weight".to_string(), vec![self.vocab, h], true),
        ];
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            v.extend([
                (
                    format!("{p}.self_attn.q_proj.weight"),
                    vec![self.heads * hd, h],
                    true,
                ),
                (
                    format!("{p}.self_attn.k_proj.weight"),
                    vec![self.kv * hd, h],
                    true,
                ),
                (
                    format!("{p}.self_attn.v_proj.weight"),
                    vec![self.kv * hd, h],
                    true,
                ),
                (
                    format!("{p}.self_attn.o_proj.weight"),
                    vec![h, self.heads * hd],
                    true,
                ),
                (
                    format!("{p}.mlp.gate_proj.weight"),
                    vec![self.inter, h],
                    true,
                ),
                (format!("{p}.mlp.up_proj.weight"), vec![self.inter, h], true),
                (
                    format!("{p}.mlp.down_proj.weight"),
                    vec![h, self.inter],
                    true,
                ),
                (format!("{p}.input_layernorm.weight"), vec![h], false),
                (
                    format!("{p}.post_attention_layernorm.weight"),
                    vec![h],
                    false,
                ),
            ]);
        }
        v
    }

    /// (bytes of split tensors, bytes of replicated tensors).
    fn bytes(&self) -> (u64, u64) {
        let mut s = (0, 0);
        for (_, shape, split) in self.tensors() {
            let b = (shape.iter().product::<usize>() * self.elt()) as u64;
            if split {
                s.0 += b
            } else {
                s.1 += b
            }
        }
        s
    }

    fn config(&self) -> Value {
        json!({
            "model_type": "llama",
            "hidden_size": self.hidden,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv,
            "intermediate_size": self.inter,
            "vocab_size": self.vocab,
            "num_hidden_layers": self.layers,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "torch_dtype": self.dtype,
        })
    }

    /// Write config.json and random weights in `shards` files with an index.
    fn write(&self, dir: &Path, shards: usize) {
        std::fs::write(dir.join("config.json"), self.config().to_string()).unwrap();
        let dtype = if self.elt() == 4 {
            safetensors::Dtype::F32
        } else {
            safetensors::Dtype::BF16
        };
        let tensors = self.tensors();
        let per = tensors.len().div_ceil(shards);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut weight_map = serde_json::Map::new();
        for (i, chunk) in tensors.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
            let data: Vec<Vec<u8>> = chunk
                .iter()
                .map(|(_, shape, _)| {
                    let mut b = vec![0u8; shape.iter().product::<usize>() * self.elt()];
                    rng.fill_bytes(&mut b);
                    b
                })
                .collect();
            let views: Vec<(String, TensorView<'_>)> = chunk
                .iter()
                .zip(&data)
                .map(|((n, s, _), b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
                .collect();
            safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
            for (n, _, _) in chunk {
                weight_map.insert(n.clone(), file.clone().into());
            }
        }
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            json!({"metadata": {}, "weight_map": weight_map}).to_string(),
        )
        .unwrap();
    }
}

fn options(n: usize, format: LoadFormat) -> TpOptions {
    let mut o = TpOptions::new(n, 256, 1);
    o.emulate = true;
    o.vocab_parallel = true;
    o.load_format = format;
    o.program = Some(PathBuf::from(env!("CARGO_BIN_EXE_mlxcel")));
    o
}

fn launch(dir: &Path, n: usize, format: LoadFormat) -> Vec<RankReport> {
    let md = match format {
        LoadFormat::Safetensors => ModelDir::open(dir).unwrap(),
        LoadFormat::Dummy => ModelDir::open_config_only(dir).unwrap(),
    };
    let mut tp =
        TpExecutor::launch(&md, options(n, format)).unwrap_or_else(|e| panic!("tp={n}: {e}"));
    let reports = tp.reports().to_vec();
    tp.shutdown();
    for r in &reports {
        eprintln!("tp={n}: {}", r.summary());
    }
    reports
}

fn within(actual: u64, expected: u64, tol: f64) -> bool {
    let (a, e) = (actual as f64, expected as f64);
    a <= e * tol && a >= e / tol
}

fn check_bytes_read(shape: &Shape, dir: &Path, sizes: &[usize]) -> Vec<Vec<RankReport>> {
    let (split, replicated) = shape.bytes();
    sizes
        .iter()
        .map(|&n| {
            let reports = launch(dir, n, LoadFormat::Safetensors);
            assert_eq!(reports.len(), n);
            let share = split / n as u64 + replicated;
            for r in &reports {
                assert!(
                    within(r.bytes_read, share, 1.05),
                    "tp={n} rank {}: read {} bytes, its share is {share} ({split}/{n} + {replicated})",
                    r.rank,
                    r.bytes_read
                );
                assert!(r.load_gbps > 0.0, "{}", r.summary());
            }
            reports
        })
        .collect()
}

#[test]
fn ranks_read_only_their_share_tp2_tp4() {
    let _g = serial();
    // 8B ratios at hidden 128: 8 heads, 4 KV heads, intermediate 3.5x, vocab 31x; f32, ~8 MB
    let shape = Shape {
        hidden: 128,
        heads: 8,
        kv: 4,
        inter: 448,
        vocab: 4008,
        layers: 4,
        dtype: "float32",
    };
    let tmp_dir = tmp("f32");
    let dir = tmp_dir.path();
    shape.write(dir, 3);
    check_bytes_read(&shape, dir, &[2, 4]);
}

#[test]
fn peak_rss_during_load_stays_near_the_share() {
    let _g = serial();
    // 8B ratios at hidden 512, 32 layers, bf16: 250 MB in 4 files
    let shape = Shape {
        hidden: 512,
        heads: 16,
        kv: 4,
        inter: 1792,
        vocab: 16032,
        layers: 32,
        dtype: "bfloat16",
    };
    let tmp_dir = tmp("bf16");
    let dir = tmp_dir.path();
    shape.write(dir, 4);
    let (split, replicated) = shape.bytes();
    assert!(split + replicated > 200_000_000);
    let reports = check_bytes_read(&shape, dir, &[2]).remove(0);
    let share = split / 2 + replicated;
    for r in &reports {
        let rss = r
            .peak_rss_bytes
            .expect("Linux reports VmHWM of /proc/self/status");
        let bound = (1.2 * share as f64) as u64 + (1 << 30);
        assert!(
            rss <= bound,
            "rank {}: peak RSS {rss} > 1.2 × share {share} + 1 GiB",
            r.rank
        );
        // tighter: no checkpoint pages stay resident (reads are not mapped), so RSS is the
        // process's baseline (~60 MB) + the share + one tensor in flight
        assert!(
            rss <= (1.2 * share as f64) as u64 + (128 << 20),
            "rank {}: peak RSS {rss} > 1.2 × share {share} + 128 MiB",
            r.rank
        );
        eprintln!(
            "rank {}: peak RSS {:.1} MB for a share of {:.1} MB (x{:.2})",
            r.rank,
            rss as f64 / 1e6,
            share as f64 / 1e6,
            rss as f64 / share as f64
        );
        // weights held equal the bytes read (nothing materialised beyond the shard)
        assert_eq!(r.weight_bytes, r.bytes_read, "{}", r.summary());
    }
}

#[test]
fn dummy_rank_weights_match_the_plan() {
    let _g = serial();
    let shape = Shape {
        hidden: 256,
        heads: 8,
        kv: 4,
        inter: 896,
        vocab: 8016,
        layers: 4,
        dtype: "bfloat16",
    };
    let tmp_dir = tmp("dummy");
    let dir = tmp_dir.path();
    std::fs::write(dir.join("config.json"), shape.config().to_string()).unwrap();
    let md = ModelDir::open_config_only(dir).unwrap();
    let cfg = models::read_config(&md).unwrap();
    for n in [2, 4] {
        let input = PlanInput {
            cfg: &cfg,
            catalog: None,
            tp_size: n,
            ctx_size: 256,
            slots: 1,
            max_num_batched_tokens: 512,
            backend: mlxcel::mlx::backend(),
            vocab_parallel: true,
            kv_tokens: None,
        };
        let p = plan::plan_memory(&input).unwrap();
        let expected = p.sharded_total_bytes / n as u64 + p.replicated_total_bytes;
        let (split, replicated) = shape.bytes();
        assert_eq!(
            (p.sharded_total_bytes, p.replicated_total_bytes),
            (split, replicated)
        );
        let reports = launch(dir, n, LoadFormat::Dummy);
        for r in &reports {
            assert!(
                within(r.weight_bytes, expected, 1.05),
                "tp={n} rank {}: {} weight bytes, plan says {expected}",
                r.rank,
                r.weight_bytes
            );
            assert_eq!(r.weight_bytes, p.ranks[r.rank].weight_bytes);
            assert_eq!(r.bytes_read, 0);
        }
    }
}

fn mlxcel(args: &[&str], memory: Option<u64>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlxcel"));
    c.args(args).env("RUST_LOG", "info");
    match memory {
        Some(m) => c.env(plan::DEVICE_MEMORY_VAR, m.to_string()),
        None => c.env_remove(plan::DEVICE_MEMORY_VAR),
    };
    c.output().unwrap()
}

fn plan_json(args: &[&str], memory: u64) -> (bool, Value) {
    let mut a = vec!["plan", "--json"];
    a.extend_from_slice(args);
    let out = mlxcel(&a, Some(memory));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {stdout} {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), v)
}

#[test]
fn plan_command_and_refusal_before_spawning() {
    let _g = serial();
    let llama3 = fixture("llama3");
    let m = llama3.to_str().unwrap();
    let base = ["-m", m, "--ctx-size", "256", "--tp-emulate"];
    let big = 1u64 << 40;
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let args2 = with(&["--tp-size", "2"]);
    let args2: Vec<&str> = args2.iter().map(String::as_str).collect();
    let (ok, two) = plan_json(&args2, big);
    assert!(ok && two["fits"] == true, "{two}");
    let ranks = two["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    let split = two["sharded_total_bytes"].as_u64().unwrap();
    let replicated = two["replicated_total_bytes"].as_u64().unwrap();
    // the embedding and lm_head split by vocabulary rows: 384 over 2 ranks
    assert_eq!(two["vocab_rows_per_rank"], 192, "{two}");
    for r in ranks {
        assert_eq!(r["weight_bytes"].as_u64().unwrap(), split / 2 + replicated);
        assert!(r["kv_bytes"].as_u64().unwrap() > 0 && r["margin_bytes"].as_u64().unwrap() > 0);
    }
    let args1 = with(&["--tp-size", "1"]);
    let args1: Vec<&str> = args1.iter().map(String::as_str).collect();
    let (_, one) = plan_json(&args1, big);
    let need1 = one["total_bytes"].as_u64().unwrap();
    let need2 = two["total_bytes"].as_u64().unwrap();
    assert!(need1 < need2, "two ranks on one device need more than one");
    // room for one rank but not for two sharing the device
    let mem = (need1 + need2) / 2;
    let (ok, v) = plan_json(&args2, mem);
    assert!(!ok && v["fits"] == false, "{v}");
    assert_eq!(v["smallest_fitting_tp_size"], 1, "{v}");
    // generate refuses before spawning: numbers, the flag, the smallest size that fits
    let mut g = vec!["generate", "-n", "2"];
    g.extend_from_slice(&args2);
    let out = mlxcel(&g, Some(mem));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("not enough memory for --tp-size 2")
            && stderr.contains(" GB")
            && stderr.contains("smallest --tp-size that fits is 1")
            && stderr.contains("--ctx-size"),
        "{stderr}"
    );
    assert!(!stderr.contains("starting 2 TP ranks"), "{stderr}");
    // the single-device path checks before loading, too
    let out = mlxcel(&["generate", "-m", m, "-n", "2"], Some(1_000_000));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("not enough memory for --tp-size 1"),
        "{stderr}"
    );
    assert!(!stderr.contains("loaded "), "{stderr}");
}

#[test]
fn generate_reports_every_rank() {
    let _g = serial();
    let llama3 = fixture("llama3");
    let m = llama3.to_str().unwrap();
    let args = [
        "generate",
        "-m",
        m,
        "-n",
        "3",
        "--ctx-size",
        "256",
        "--tp-size",
        "2",
        "--tp-emulate",
    ];
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let out = mlxcel(&with_json, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let ranks = v["stats"]["ranks"].as_array().expect("stats.ranks");
    assert_eq!(ranks.len(), 2);
    for (i, r) in ranks.iter().enumerate() {
        assert_eq!(r["rank"], i);
        for k in [
            "pid",
            "weight_bytes",
            "active_memory",
            "bytes_read",
            "peak_rss_bytes",
        ] {
            assert!(r[k].as_u64().is_some_and(|x| x > 0), "{k}: {r}");
        }
        assert!(r["load_gbps"].as_f64().is_some_and(|x| x > 0.0), "{r}");
    }
    let out = mlxcel(&args, None);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let last = lines.last().unwrap();
    assert!(last.starts_with("prompt: "), "{stdout}");
    for r in 0..2 {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("rank {r} (pid "))
                    && l.contains("peak RSS")
                    && l.contains("GB/s")),
            "{stdout}"
        );
    }
}
