//! Tensor parallelism on the CPU, emulated over MLX's ring backend: N rank
//! processes give the same logits and tokens as one process; rank failures
//! stop everything promptly with an error naming the rank; bad splits are
//! refused before anything is spawned.
//!
//! The tests in this file run one at a time (they start several processes
//! each, and CI has 2 cores).
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mlxcel::engine::step::{Executor, LocalExecutor, SeqStep, StepPlan};
use mlxcel::model_dir::ModelDir;
use mlxcel::models::{self, LoadFormat};
use mlxcel::parallel::driver::{TpExecutor, TpOptions};
use serde_json::Value;

mod support;
use support::{fixture, run_plan, serial};

fn tp_options(n: usize) -> TpOptions {
    let mut o = TpOptions::new(n, 256, 2);
    o.emulate = true;
    o.program = Some(PathBuf::from(env!("CARGO_BIN_EXE_mlxcel")));
    o
}

fn check_family(name: &str, sizes: &[usize]) {
    let dir = fixture(name);
    let md = ModelDir::open(&dir).unwrap();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let p = &reference["prompts"][0];
    let prompt: Vec<u32> = p["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let gaps: Vec<f64> = p["gaps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let steps = gaps
        .iter()
        .position(|&g| g < 1e-3)
        .unwrap_or(gaps.len())
        .min(12);
    let model = models::load(&md, LoadFormat::Safetensors, |_, _| {})
        .unwrap()
        .model;
    let mut local = LocalExecutor::new(model, 2, 256);
    let (want_logits, want_tokens) = run_plan(&mut local, &prompt, steps);
    for &n in sizes {
        let mut tp =
            TpExecutor::launch(&md, tp_options(n)).unwrap_or_else(|e| panic!("{name} tp={n}: {e}"));
        let pids = tp.pids();
        assert_eq!(pids.len(), n);
        let mut uniq = pids.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), n, "ranks are distinct processes");
        assert!(!pids.contains(&std::process::id()));
        let (logits, tokens) = run_plan(&mut tp, &prompt, steps);
        let diff = logits
            .iter()
            .zip(&want_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert_eq!(logits.len(), want_logits.len());
        assert!(diff <= 1e-4, "{name} tp={n}: logits max-abs diff {diff}");
        assert_eq!(tokens, want_tokens, "{name} tp={n}: greedy tokens");
        tp.shutdown();
    }
}

#[test]
fn llama3_tp2_tp4_match_single_process() {
    let _g = serial();
    check_family("llama3", &[2, 4]);
}

#[test]
fn gqa_with_fewer_kv_heads_than_ranks_replicates_kv() {
    let _g = serial();
    // 2 KV heads, 4 ranks: each KV head is held by two ranks
    check_family("llama_gqa2_tied", &[2, 4]);
}

#[test]
fn mistral_qwen2_qwen3_tp2_tp4_match() {
    let _g = serial();
    // mistral has 2 KV heads (replicated at TP 4); qwen2 has q/k/v biases; qwen3 q/k norms
    for f in ["mistral", "qwen2", "qwen3"] {
        check_family(f, &[2, 4]);
    }
}

#[test]
fn quantized_tp2_tp4_match() {
    let _g = serial();
    check_family("llama_q4", &[2, 4]);
}

#[test]
fn residual_added_before_the_reduction_matches() {
    let _g = serial();
    // MLXCEL_TP_RESIDUAL=1 (the rank processes inherit it): rank 0 adds the residual to its
    // partial products of o_proj and down_proj before the all_sum, the others do not
    // SAFETY: the tests of this file run one at a time (serial), and this one removes it
    // again before it returns or fails
    unsafe { std::env::set_var("MLXCEL_TP_RESIDUAL", "1") };
    let r = std::panic::catch_unwind(|| {
        check_family("llama3", &[2, 4]);
        check_family("llama_q4", &[2]);
    });
    unsafe { std::env::remove_var("MLXCEL_TP_RESIDUAL") };
    if let Err(e) = r {
        std::panic::resume_unwind(e);
    }
}

fn mlxcel() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlxcel"));
    c.env("RUST_LOG", "info");
    c
}

fn alive(pid: u32) -> bool {
    // a zombie is dead for our purposes
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
        .unwrap_or(false)
}

/// Start a long TP=2 generation; return the child and the rank pids once loaded, and
/// the guard of its cache and temporary folder (removed when the guard drops: keep it
/// while the child runs).
fn start_long_generation(
    extra_env: &[(&str, &str)],
) -> (
    std::process::Child,
    Vec<u32>,
    std::sync::mpsc::Receiver<String>,
    tempfile::TempDir,
) {
    let cache = tempfile::Builder::new()
        .prefix("mlxcel-tp-test-")
        .tempdir()
        .unwrap();
    let mut cmd = mlxcel();
    cmd.args([
        "generate",
        "-m",
        "demo",
        "--tp-size",
        "2",
        "--tp-emulate",
        "-n",
        "100000",
        "--ignore-eos",
        "--ctx-size",
        "8000",
    ])
    .env("MLXCEL_CACHE", cache.path())
    // the driver's own temporary files (its ring hostfile) too: a killed driver cannot remove them
    .env("TMPDIR", cache.path())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut pids = vec![0u32; 2];
    let deadline = Instant::now() + Duration::from_secs(120);
    while pids.contains(&0) {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("ranks did not report");
        for (r, pid) in pids.iter_mut().enumerate() {
            if let Some(rest) = line.split(&format!("rank {r} (pid ")).nth(1) {
                *pid = rest
                    .split([',', ')'])
                    .next()
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap();
            }
        }
    }
    std::thread::sleep(Duration::from_millis(500)); // let decoding start
    (child, pids, rx, cache)
}

fn wait_exit(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(t.elapsed() < limit, "driver did not exit within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn collect(rx: &std::sync::mpsc::Receiver<String>) -> String {
    std::thread::sleep(Duration::from_millis(200));
    rx.try_iter().collect::<Vec<_>>().join("\n")
}

#[test]
fn killed_rank_stops_everything_and_names_the_rank() {
    let _g = serial();
    let (mut child, pids, rx, _cache) = start_long_generation(&[]);
    unsafe { libc::kill(pids[1] as i32, libc::SIGKILL) };
    let t = Instant::now();
    let st = wait_exit(&mut child, Duration::from_secs(5));
    assert!(!st.success());
    let log = collect(&rx);
    assert!(log.contains("rank 1"), "error should name rank 1: {log}");
    assert!(t.elapsed() < Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !alive(pids[0]) && !alive(pids[1]),
        "a rank process was left behind"
    );
}

#[test]
fn stalled_rank_is_caught_by_the_step_deadline() {
    let _g = serial();
    let (mut child, pids, rx, _cache) = start_long_generation(&[("MLXCEL_TP_STEP_TIMEOUT", "2")]);
    unsafe { libc::kill(pids[1] as i32, libc::SIGSTOP) };
    let st = wait_exit(&mut child, Duration::from_secs(10));
    assert!(!st.success());
    let log = collect(&rx);
    assert!(
        log.contains("rank 1") || log.contains("rank 0"),
        "error should name a rank: {log}"
    );
    std::thread::sleep(Duration::from_millis(500));
    for p in &pids {
        unsafe { libc::kill(*p as i32, libc::SIGCONT) };
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !alive(pids[0]) && !alive(pids[1]),
        "a rank process was left behind"
    );
}

#[test]
fn killed_driver_takes_its_ranks_along() {
    let _g = serial();
    let (mut child, pids, _rx, _cache) = start_long_generation(&[]);
    child.kill().unwrap();
    let _ = child.wait();
    let t = Instant::now();
    while (alive(pids[0]) || alive(pids[1])) && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !alive(pids[0]) && !alive(pids[1]),
        "ranks outlived the driver by 5 s"
    );
}

fn generate_err(args: &[&str]) -> String {
    let out = mlxcel().arg("generate").args(args).output().unwrap();
    assert!(!out.status.success(), "expected failure for {args:?}");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn bad_splits_are_refused_before_spawning() {
    let _g = serial();
    let llama3 = fixture("llama3");
    let m = llama3.to_str().unwrap();
    let e = generate_err(&["-m", m, "--tp-size", "2"]);
    assert!(
        e.contains("--tp-size 2") && e.contains("--tp-emulate") && e.contains("0 GPUs"),
        "{e}"
    );
    let e = generate_err(&["-m", m, "--tp-size", "3", "--tp-emulate"]);
    assert!(
        e.contains("--tp-size 3")
            && e.contains("num_attention_heads 8")
            && e.contains("1, 2, 4, 8"),
        "{e}"
    );
    // 4-bit fixture: o_proj has 8*32 = 256 input columns, group 32 → at most 8 ways; down_proj 256 → 8;
    // so make the group too coarse for 4 ways by editing a copy of its config
    let tmp = tempfile::Builder::new()
        .prefix("mlxcel-tp-q4-")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    for e in std::fs::read_dir(fixture("llama_q4")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    v["quantization"]["group_size"] = 128.into();
    std::fs::write(&p, v.to_string()).unwrap();
    let e = generate_err(&[
        "-m",
        dir.to_str().unwrap(),
        "--tp-size",
        "4",
        "--tp-emulate",
        "--load-format",
        "dummy",
    ]);
    assert!(
        e.contains("group_size 128") && e.contains("--tp-size 4"),
        "{e}"
    );
    let e = generate_err(&["-m", m, "--tp-size", "2", "--tp-emulate", "--devices", "0"]);
    assert!(e.contains("--devices"), "{e}");
    // tp-parity of dummy weights would compare two different models
    let out = mlxcel()
        .args(["tp-parity", "-m", m, "--tp-size", "2", "--tp-emulate"])
        .args(["--load-format", "dummy"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("--load-format dummy"),
        "{e}"
    );
}

#[test]
fn tp_parity_command_reports_agreement_and_cosine() {
    let _g = serial();
    let m = fixture("qwen2");
    let out = mlxcel()
        .args([
            "tp-parity",
            "-m",
            m.to_str().unwrap(),
            "--tp-size",
            "2",
            "--tp-emulate",
            "--steps",
            "40",
            "--chunk",
            "8",
            "--f32-reference",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(v["positions"], 40);
    assert_eq!(v["top1_agreement"], 1.0);
    assert!(v["cosine_min"].as_f64().unwrap() > 0.99999, "{v}");
    assert!(v["logits_max_abs_diff"].as_f64().unwrap() < 1e-4, "{v}");
    // an f32 model cast to f32 is the same model: the reference is the one-process run
    let r = &v["f32_reference"];
    assert_eq!(r["one_process"]["logits_max_abs_diff"], 0.0, "{v}");
    assert_eq!(
        r["tp"]["logits_max_abs_diff"], v["logits_max_abs_diff"],
        "{v}"
    );
}

/// Pipelined decode over ranks (every rank samples, feeding its own tokens to the
/// next queued step; the driver checks all ranks sampled the same): the same
/// tokens as step-by-step TP decode with seeded sampling, and as one process
/// with greedy decode; penalised samplers are not pipelined.
#[test]
fn tp2_pipelined_decode_matches_step_by_step_and_one_process() {
    use mlxcel::engine::generate::{generate, GenerateOptions};
    use mlxcel::engine::sampler::SamplingParams;
    use mlxcel::tokenizer::Tokenizer;

    let _g = serial();
    let dir = fixture("llama3");
    let md = ModelDir::open(&dir).unwrap();
    let config: Value = md.read_config().unwrap();
    let tok = Tokenizer::from_dir(&dir, &config).unwrap();
    let prompt = tok.encode("Tensor parallel decoding", true).unwrap();
    let mut tp = TpExecutor::launch(&md, tp_options(2)).unwrap();
    let model = models::load(&md, LoadFormat::Safetensors, |_, _| {})
        .unwrap()
        .model;
    let mut one = LocalExecutor::new(model, 2, 256);
    let opts = |pipeline| GenerateOptions {
        max_tokens: 20,
        ignore_eos: true,
        pipeline,
        ..GenerateOptions::default()
    };
    let sampled = SamplingParams {
        temperature: 0.9,
        top_p: 0.9,
        seed: Some(21),
        ..SamplingParams::default()
    };
    let run = |exec: &mut dyn Executor, id: u64, params: &SamplingParams, pipeline| {
        generate(
            exec,
            &tok,
            id,
            1,
            &prompt,
            params.clone(),
            &opts(pipeline),
            |_| {},
        )
        .unwrap()
        .generated_token_ids
    };
    let a = run(&mut tp, 1, &sampled, false);
    let b = run(&mut tp, 2, &sampled, true);
    assert_eq!(a.len(), 20);
    assert_eq!(a, b, "seeded sampling, TP=2: step by step vs pipelined");
    let greedy = SamplingParams::default();
    let c = run(&mut tp, 3, &greedy, true);
    let d = run(&mut one, 4, &greedy, true);
    assert_eq!(c, d, "greedy: TP=2 pipelined vs one process");

    // the executor pipelines a plain sampler, not a penalised one
    for (id, params, want) in [
        (10, SamplingParams::default(), true),
        (
            11,
            SamplingParams {
                frequency_penalty: 0.3,
                ..SamplingParams::default()
            },
            false,
        ),
    ] {
        tp.execute(&StepPlan {
            seqs: vec![SeqStep::whole_prompt(id, 0, &prompt, params)],
            ..Default::default()
        })
        .unwrap();
        assert_eq!(tp.can_pipeline(id), want, "seq {id}");
        tp.execute(&StepPlan {
            release: vec![id],
            ..Default::default()
        })
        .unwrap();
        assert!(!tp.can_pipeline(id), "released seq {id}");
    }
}

/// Dummy weights under TP: every rank draws the tensors it holds whole (embeddings,
/// lm_head) alike, so all ranks sample the same tokens in pipelined decode (a rank-seeded
/// draw gave each rank its own lm_head and failed at the first pipelined token on H200).
#[test]
fn dummy_weights_are_replicated_alike_across_ranks() {
    let _g = serial();
    let out = mlxcel()
        .args(["generate", "-m"])
        .arg(fixture("llama3"))
        .args(["--load-format", "dummy", "--tp-size", "2", "--tp-emulate"])
        .args(["-n", "24", "--ignore-eos", "--temp", "1.0", "-p", "hi"])
        .output()
        .unwrap();
    let all = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{all}");
    assert!(all.contains("generated: 24 tokens"), "{all}");
}

/// One rank over ring (`--tp-size 1 --tp-emulate`): MLX's ring backend cannot form a group
/// of one, so the rank runs without a group; greedy text equals the single process's.
#[test]
fn one_rank_over_ring_runs_and_matches_one_process() {
    let _g = serial();
    let run = |extra: &[&str]| {
        let out = mlxcel()
            .args(["generate", "-m"])
            .arg(fixture("llama3"))
            .args([
                "-n",
                "16",
                "--ignore-eos",
                "--temp",
                "0",
                "--raw",
                "-p",
                "hello",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{extra:?}: {err}");
        let v: Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap())
                .unwrap();
        v["text"].as_str().unwrap().to_string()
    };
    let one = run(&[]);
    assert!(!one.is_empty());
    assert_eq!(run(&["--tp-size", "1", "--tp-emulate"]), one);
}

/// A copy of fixture `name` with a vocabulary of `vocab` rows (the first rows of the
/// embedding and lm_head, and of their scales and biases when quantized), so that it
/// does not divide by the TP sizes: the uneven vocab-parallel split. The copy is removed
/// when the returned guard drops.
fn with_vocab(name: &str, vocab: usize) -> tempfile::TempDir {
    let src = fixture(name);
    let tmp = tempfile::Builder::new()
        .prefix(&format!("mlxcel-vocab-{name}-{vocab}-"))
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = vocab.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (n, t) in st.tensors() {
        let mut shape = t.shape().to_vec();
        let mut data = t.data().to_vec();
        if n.starts_with("model.embed_tokens.") || n.starts_with("lm_head.") {
            data.truncate(data.len() / shape[0] * vocab);
            shape[0] = vocab;
        }
        tensors.push((n, t.dtype(), shape, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    tmp
}

/// A sampled token with its log-probabilities as bits, compared exactly.
type Sample = (u64, u32, Option<u32>, Vec<(u32, u32)>);

/// Two sequences with every sampling feature: seeded temperature sampling with top-k /
/// top-p and min-p, repetition / presence / frequency penalties, logit_bias, logprobs
/// with top_logprobs, and a constrained mask on the second; a prompt step returning
/// every position's logits, then decode steps of both sequences together. Returns the
/// prompt logits (as bits) and every sampled token.
fn sample_everything(exec: &mut dyn Executor, vocab: usize) -> (Vec<Vec<u32>>, Vec<Sample>) {
    use mlxcel::engine::sampler::SamplingParams;
    use mlxcel::engine::step::SeqMask;
    let first = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        repetition_penalty: 1.3,
        presence_penalty: 0.5,
        frequency_penalty: 0.4,
        seed: Some(5),
        logprobs: true,
        top_logprobs: 5,
        logit_bias: vec![(3, 5.0), (10, -100.0), (vocab as u32 - 1, 2.0)],
        ..SamplingParams::default()
    };
    let second = SamplingParams {
        temperature: 1.0,
        min_p: 0.02,
        seed: Some(9),
        logprobs: true,
        top_logprobs: 3,
        ..SamplingParams::default()
    };
    // the second sequence may sample every third token, and the vocabulary's last ones
    let allowed = |step: usize| -> Vec<u32> {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for t in (0..vocab).filter(|t| (t + step).is_multiple_of(3) || *t + 4 >= vocab) {
            words[t / 32] |= 1 << (t % 32);
        }
        words
    };
    let p1: Vec<u32> = (0..9).map(|i| (i * 37 + 11) % vocab as u32).collect();
    let p2: Vec<u32> = (0..5).map(|i| (i * 53 + 7) % vocab as u32).collect();
    let bits = |r: &mlxcel::engine::step::StepResult| -> Vec<Sample> {
        r.sampled
            .iter()
            .map(|s| {
                let top = s.top_logprobs.iter().map(|&(t, l)| (t, l.to_bits()));
                (
                    s.seq_id,
                    s.token,
                    s.logprob.map(f32::to_bits),
                    top.collect(),
                )
            })
            .collect()
    };
    let r = exec
        .execute(&StepPlan {
            seqs: vec![
                SeqStep::whole_prompt(1, 0, &p1, first),
                SeqStep::whole_prompt(2, 1, &p2, second),
            ],
            return_logits: true,
            masks: vec![SeqMask {
                seq_id: 2,
                allowed: allowed(0),
            }],
            ..Default::default()
        })
        .unwrap();
    let logits = r
        .logits
        .iter()
        .map(|l| l.iter().map(|x| x.to_bits()).collect())
        .collect();
    let mut samples = bits(&r);
    let mut last = [r.sampled[0].token, r.sampled[1].token];
    for step in 1..10 {
        let seq = |id: u64, slot: usize, pos: usize, tok: u32| SeqStep {
            seq_id: id,
            slot,
            pos,
            tokens: vec![tok],
            start: None,
            sample: true,
            blocks: None,
            restart: false,
        };
        let r = exec
            .execute(&StepPlan {
                seqs: vec![
                    seq(1, 0, p1.len() + step - 1, last[0]),
                    seq(2, 1, p2.len() + step - 1, last[1]),
                ],
                masks: vec![SeqMask {
                    seq_id: 2,
                    allowed: allowed(step),
                }],
                ..Default::default()
            })
            .unwrap();
        last = [r.sampled[0].token, r.sampled[1].token];
        samples.extend(bits(&r));
    }
    exec.execute(&StepPlan {
        release: vec![1, 2],
        ..Default::default()
    })
    .unwrap();
    (logits, samples)
}

/// Vocab-parallel embedding and lm_head (each rank its rows, lookups summed, logits
/// gathered) sample exactly what replicated ones do, bit for bit: tokens, logprobs and
/// top_logprobs, with penalties, logit_bias and constrained masks, for a dense untied
/// model, a quantized one and a tied one, with a vocabulary that divides by the TP size
/// and one that does not (381 rows: 191 + 190 at TP 2, 96 × 3 + 93 at TP 4); and each
/// rank holds fewer weight bytes.
#[test]
fn vocab_parallel_samples_exactly_like_replicated_tp2_tp4() {
    let _g = serial();
    let q4 = with_vocab("llama_q4", 381);
    let tied = with_vocab("llama_gqa2_tied", 381);
    let models = [
        (fixture("llama3"), 384),
        (q4.path().to_path_buf(), 381),
        (tied.path().to_path_buf(), 381),
    ];
    for (dir, vocab) in &models {
        let md = ModelDir::open(dir).unwrap();
        for n in [2, 4] {
            let run = |vocab_parallel: bool| {
                let mut o = tp_options(n);
                o.vocab_parallel = vocab_parallel;
                let mut tp = TpExecutor::launch(&md, o).unwrap();
                let out = sample_everything(&mut tp, *vocab);
                let held: Vec<u64> = tp.reports().iter().map(|r| r.weight_bytes).collect();
                tp.shutdown();
                (out, held)
            };
            let what = format!("{} tp={n}", dir.display());
            let (replicated, held_replicated) = run(false);
            let (split, held_split) = run(true);
            assert_eq!(replicated.1.len(), 20, "{what}");
            // the first difference, not thousands of numbers
            let differ = |a: &[Vec<u32>], b: &[Vec<u32>]| {
                a.iter().zip(b).enumerate().find_map(|(s, (x, y))| {
                    let i = x.iter().zip(y).position(|(p, q)| p != q);
                    i.map(|i| (s, i, f32::from_bits(x[i]), f32::from_bits(y[i])))
                })
            };
            let lens = |a: &[Vec<u32>]| a.iter().map(Vec::len).collect::<Vec<_>>();
            assert_eq!(lens(&split.0), lens(&replicated.0), "{what}: prompt logits");
            assert_eq!(
                differ(&split.0, &replicated.0),
                None,
                "{what}: prompt logits (sequence, index, vocab-parallel, replicated)"
            );
            assert_eq!(split.1, replicated.1, "{what}: sampled tokens and logprobs");
            for (r, (s, w)) in held_split.iter().zip(&held_replicated).enumerate() {
                assert!(
                    s < w,
                    "{what} rank {r}: {s} weight bytes vocab-parallel, {w} replicated"
                );
            }
        }
    }
}
