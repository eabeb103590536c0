//! `mlxcel generate` end to end: the demo model on a fresh cache, JSON output,
//! context and stop handling, seeds, and one-line errors for bad model folders.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn mlxcel(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mlxcel"))
        .args(args)
        .env("MLXCEL_CACHE", cache)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run mlxcel")
}

/// A fresh empty folder under the temp dir, removed when the guard drops.
fn tmp(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("mlxcel-test-{name}-"))
        .tempdir()
        .unwrap()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn last_json(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("last stdout line is not JSON ({e}): {stdout}"))
}

#[test]
fn demo_model_writes_itself_and_prints_stats() {
    let tmp_cache = tmp("demo");
    let cache = tmp_cache.path();
    let out = mlxcel(&["generate", "-m", "demo", "-n", "12"], cache);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap();
    assert!(
        last.starts_with("prompt: ") && last.contains("generated: 12 tokens"),
        "{stdout}"
    );
    assert!(cache.join("demo-llama-v2/model.safetensors").is_file());
    // the demo model is written deterministically: a second fresh cache gives the same bytes
    let tmp_cache2 = tmp("demo2");
    let cache2 = tmp_cache2.path();
    assert!(mlxcel(&["generate", "-m", "demo", "-n", "1"], cache2)
        .status
        .success());
    let a = std::fs::read(cache.join("demo-llama-v2/model.safetensors")).unwrap();
    let b = std::fs::read(cache2.join("demo-llama-v2/model.safetensors")).unwrap();
    assert!(a == b, "demo weights differ between two fresh writes");
}

#[test]
fn json_output_seeds_and_context_limit() {
    let tmp_cache = tmp("json");
    let cache = tmp_cache.path();
    let m = fixture("llama3");
    let m = m.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "-m", m, "--json", "--raw"];
        args.extend_from_slice(extra);
        let out = mlxcel(&args, cache);
        assert!(
            out.status.success(),
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).lines().count(),
            1,
            "exactly one JSON line"
        );
        last_json(&out)
    };
    let a = run(&[
        "-p",
        "The quick brown fox",
        "-n",
        "16",
        "--temp",
        "0.9",
        "--seed",
        "7",
        "--ignore-eos",
    ]);
    let b = run(&[
        "-p",
        "The quick brown fox",
        "-n",
        "16",
        "--temp",
        "0.9",
        "--seed",
        "7",
        "--ignore-eos",
    ]);
    let c = run(&[
        "-p",
        "The quick brown fox",
        "-n",
        "16",
        "--temp",
        "0.9",
        "--seed",
        "8",
        "--ignore-eos",
    ]);
    assert_eq!(a["generated_token_ids"], b["generated_token_ids"]);
    assert_ne!(a["generated_token_ids"], c["generated_token_ids"]);
    for k in [
        "prompt_token_ids",
        "generated_token_ids",
        "text",
        "finish_reason",
        "stats",
    ] {
        assert!(a.get(k).is_some(), "missing {k}");
    }
    // greedy output equals the transformers reference (first prompt of the fixture)
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("llama3").join("reference.json")).unwrap(),
    )
    .unwrap();
    let p0 = &reference["prompts"][0];
    let g = run(&[
        "-p",
        p0["text"].as_str().unwrap(),
        "-n",
        "8",
        "--ignore-eos",
    ]);
    assert_eq!(g["prompt_token_ids"], p0["ids"]);
    assert_eq!(
        g["generated_token_ids"].as_array().unwrap()[..],
        p0["greedy"].as_array().unwrap()[..8]
    );
    // -n beyond the context stops at the context with finish_reason length
    let prompt_len = g["prompt_token_ids"].as_array().unwrap().len();
    let ctx = prompt_len + 5;
    let l = run(&[
        "-p",
        p0["text"].as_str().unwrap(),
        "-n",
        "100",
        "--ignore-eos",
        "--ctx-size",
        &ctx.to_string(),
    ]);
    assert_eq!(l["finish_reason"], "length");
    assert_eq!(
        prompt_len + l["generated_token_ids"].as_array().unwrap().len(),
        ctx
    );
}

#[test]
fn stop_strings_end_generation_and_are_not_printed() {
    let tmp_cache = tmp("stop");
    let cache = tmp_cache.path();
    let m = fixture("qwen2");
    let m = m.to_str().unwrap();
    let base = mlxcel(
        &[
            "generate",
            "-m",
            m,
            "--raw",
            "-p",
            "Hello",
            "-n",
            "24",
            "--ignore-eos",
            "--json",
        ],
        cache,
    );
    let full = last_json(&base)["text"].as_str().unwrap().to_string();
    // pick a stop string from the middle of the greedy text
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 6, "text too short: {full:?}");
    let stop: String = chars[3..5].iter().collect();
    let out = mlxcel(
        &[
            "generate",
            "-m",
            m,
            "--raw",
            "-p",
            "Hello",
            "-n",
            "24",
            "--ignore-eos",
            "--json",
            "--stop",
            &stop,
        ],
        cache,
    );
    let j = last_json(&out);
    let text = j["text"].as_str().unwrap();
    assert_eq!(j["finish_reason"], "stop");
    assert_eq!(text, &full[..full.find(&stop).unwrap()]);
}

#[test]
fn dummy_weights_need_only_config_json() {
    let tmp_dir = tmp("dummy");
    let dir = tmp_dir.path();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("qwen3").join(f), dir.join(f)).unwrap();
    }
    let out = mlxcel(
        &[
            "generate",
            "-m",
            dir.to_str().unwrap(),
            "--load-format",
            "dummy",
            "-n",
            "4",
            "--json",
        ],
        dir,
    );
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        last_json(&out)["generated_token_ids"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
}

/// Copy a fixture, break it with `f`, and expect a one-line error containing `needle`.
/// `--logprobs N` with `--json`: one entry per generated token, its own log-probability
/// and N most likely tokens; the greedy token is the most likely one; absent without the
/// flag; a bad N or no --json is an error naming the flag.
#[test]
fn logprobs_with_json() {
    let tmp_cache = tmp("logprobs");
    let cache = tmp_cache.path();
    let m = fixture("qwen3");
    let m = m.to_str().unwrap();
    let base = [
        "generate",
        "-m",
        m,
        "--raw",
        "-p",
        "hello",
        "-n",
        "5",
        "--ignore-eos",
    ];
    let run = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        mlxcel(&args, cache)
    };
    let out = run(&["--json", "--logprobs", "3"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = last_json(&out);
    let ids = v["generated_token_ids"].as_array().unwrap();
    let lp = v["logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), ids.len());
    for (e, id) in lp.iter().zip(ids) {
        assert_eq!(&e["token"], id);
        let top = e["top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // greedy: the chosen token is the first of the list, with its own log-probability
        assert_eq!(&top[0][0], id);
        assert_eq!(top[0][1], e["logprob"]);
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
    }
    let plain = last_json(&run(&["--json"]));
    assert!(plain.get("logprobs").is_none());
    assert_eq!(plain["generated_token_ids"], v["generated_token_ids"]);
    let alone = last_json(&run(&["--json", "--logprobs"]));
    assert!(alone["logprobs"][0]["top"].as_array().unwrap().is_empty());
    for (extra, needle) in [
        (&["--json", "--logprobs", "21"][..], "--logprobs 21"),
        (&["--logprobs", "2"][..], "--json"),
    ] {
        let out = run(extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(needle),
            "{extra:?}: {stderr}"
        );
    }
}

fn expect_error(name: &str, needle: &str, f: impl FnOnce(&Path)) {
    let tmp_dir = tmp(name);
    let dir = tmp_dir.path();
    for e in std::fs::read_dir(fixture("llama3")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    f(dir);
    let out = mlxcel(&["generate", "-m", dir.to_str().unwrap(), "-n", "2"], dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{name}: expected failure");
    assert!(!stderr.contains("panicked"), "{name}: panic: {stderr}");
    let err_lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.to_lowercase().starts_with("error"))
        .collect();
    assert_eq!(err_lines.len(), 1, "{name}: {stderr}");
    assert!(
        stderr.contains(needle),
        "{name}: `{needle}` not in: {stderr}"
    );
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn bad_model_folders_give_one_line_errors() {
    expect_error("no_tokenizer", "tokenizer.json", |d| {
        std::fs::remove_file(d.join("tokenizer.json")).unwrap()
    });
    expect_error("corrupt", "model.safetensors", |d| {
        let p = d.join("model.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    });
    expect_error("garbage", "model.safetensors", |d| {
        std::fs::write(d.join("model.safetensors"), b"not a file").unwrap()
    });
    expect_error("model_type", "gpt_bigcode", |d| {
        edit_config(d, |v| v["model_type"] = "gpt_bigcode".into())
    });
    expect_error(
        "rope_dynamic",
        "`rope_parameters.rope_type` = \"dynamic\"",
        |d| edit_config(d, |v| v["rope_parameters"]["rope_type"] = "dynamic".into()),
    );
    expect_error("softcapping", "`final_logit_softcapping` = 30", |d| {
        edit_config(d, |v| v["final_logit_softcapping"] = 30.0.into())
    });
    expect_error("shape", "model.layers.0.self_attn.q_proj.weight", |d| {
        edit_config(d, |v| v["num_attention_heads"] = 4.into())
    });
}

#[test]
fn bench_reports_prefill_decode_and_batched_decode() {
    let tmp_cache = tmp("bench");
    let cache = tmp_cache.path();
    let model = fixture("llama3");
    let m = model.to_str().unwrap();
    let args = [
        "bench",
        "-m",
        m,
        "--prompt-lens",
        "8,16",
        "--decode-tokens",
        "4",
        "--decode-context",
        "5",
        "--decode-batch",
        "2,3",
        "--repeats",
        "1",
        "--serve-workload",
        "1,3",
        "--workload-prompt",
        "6",
        "--workload-tokens",
        "5",
    ];
    let out = mlxcel(&args, cache);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = last_json(&out);
    let prefill = j["prefill"].as_array().unwrap();
    assert_eq!(prefill.len(), 2);
    assert_eq!(prefill[1]["tokens"], 16);
    assert!(j["decode"]["tokens_per_second"].as_f64().unwrap() > 0.0);
    let batched = j["decode_batched"].as_array().unwrap();
    assert_eq!(batched.len(), 2);
    for (row, b) in batched.iter().zip([2u64, 3]) {
        assert_eq!(row["batch"].as_u64(), Some(b));
        assert_eq!(row["steps"].as_u64(), Some(4));
        let tps = row["tokens_per_second"].as_f64().unwrap();
        let ms = row["ms_per_step"].as_f64().unwrap();
        // tokens per second = batch × steps / seconds = batch × 1000 / ms per step
        assert!((tps - b as f64 * 1e3 / ms).abs() / tps < 1e-6, "{row}");
    }
    // the server workload: B prompts of 6 tokens, 5 tokens generated each (the first
    // from the prefill, then 4 decode steps), B · 5 tokens over the whole wall time
    let workload = j["serve_workload"].as_array().unwrap();
    assert_eq!(workload.len(), 2);
    for (row, b) in workload.iter().zip([1u64, 3]) {
        assert_eq!(row["batch"].as_u64(), Some(b), "{row}");
        assert_eq!(row["prompt_tokens"].as_u64(), Some(6));
        assert_eq!(row["decode_steps"].as_u64(), Some(4));
        let secs = row["seconds"].as_f64().unwrap();
        assert!(row["prefill_seconds"].as_f64().unwrap() <= secs, "{row}");
        let tps = row["tokens_per_second"].as_f64().unwrap();
        assert!((tps * secs - 5.0 * b as f64).abs() < 1e-6, "{row}");
    }

    let mut bad = args.to_vec();
    bad[10] = "2,0";
    let out = mlxcel(&bad, cache);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--decode-batch"), "{err}");
}
