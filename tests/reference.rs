//! The engine against independent references made by `scripts/make_fixtures.py`
//! (HF transformers in float32; mlx-lm for the 4-bit model): prompt token ids,
//! prompt logits (max-abs diff ≤ 1e-4) and greedy tokens (equal up to the
//! reference's first near-tie, top-1/top-2 gap < 1e-3). The bfloat16 fixtures carry
//! their own bounds (`tolerance` in reference.json: 3x and 2x what transformers itself
//! gives in bfloat16 against the same float32 references).
use std::path::{Path, PathBuf};

use mlxcel::mlx::Dtype;
use mlxcel::model_dir::ModelDir;
use mlxcel::models::{self, LoadFormat, Logits, SeqInput, StepInput};
use mlxcel::tokenizer::Tokenizer;
use serde_json::Value;

const FIXTURES: &[&str] = &[
    "llama3",
    "llama_gqa2_tied",
    "mistral",
    "qwen2",
    "qwen3",
    "llama_q4",
    "rope_llama3",
    "rope_linear",
    "rope_yarn",
    "qwen2_bf16",
    "qwen3_bf16",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn reference_logits(dir: &Path, i: usize) -> (Vec<f32>, Vec<usize>) {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(&format!("logits.{i}")).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    let v = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (v, t.shape().to_vec())
}

/// Check a fixture with its `config.json` (as transformers 5 writes it), and again with
/// `config.legacy.json` (top-level `rope_theta` / `rope_scaling`) where it has one: both
/// describe the same model, so both must match the same references.
fn check_fixture(name: &str) {
    let dir = fixture(name);
    check_fixture_dir(name, &dir);
    if dir.join("config.legacy.json").is_file() {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("mlxcel-legacy-config-{name}-"))
            .tempdir()
            .unwrap();
        let legacy = tmp.path();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let file = path.file_name().unwrap();
            if file != "config.json" && file != "config.legacy.json" {
                std::fs::copy(&path, legacy.join(file)).unwrap();
            }
        }
        std::fs::copy(dir.join("config.legacy.json"), legacy.join("config.json")).unwrap();
        check_fixture_dir(&format!("{name} (legacy config)"), legacy);
    }
}

fn check_fixture_dir(name: &str, dir: &Path) {
    let md = ModelDir::open(dir).unwrap();
    let loaded = models::load(&md, LoadFormat::Safetensors, |_, _| {}).unwrap();
    let model = loaded.model;
    let config: Value = md.read_config().unwrap();
    let tok = Tokenizer::from_dir(dir, &config).unwrap();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let bound = |key: &str, default: f64| reference["tolerance"][key].as_f64().unwrap_or(default);
    let (logits_tol, tie_gap) = (
        bound("logits_max_abs", 1e-4) as f32,
        bound("greedy_tie_gap", 1e-3),
    );
    for (i, p) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let ids: Vec<u32> = p["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tok.encode(p["text"].as_str().unwrap(), true).unwrap(),
            ids,
            "{name} prompt {i} ids"
        );

        // prompt logits, all positions, in one prefill
        let mut cache = model.new_cache(1, 4096);
        let out = model
            .forward(
                &mut cache,
                StepInput::Host(&[SeqInput {
                    slot: 0,
                    tokens: &ids,
                }]),
                Logits::All,
            )
            .unwrap();
        let got = out[0].to_vec::<f32>().unwrap();
        let (want, shape) = reference_logits(dir, i);
        assert_eq!(
            out[0].shape(),
            vec![shape[0] as i32, shape[1] as i32],
            "{name} logits shape"
        );
        let max_diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!("{name} prompt {i}: logits max-abs diff {max_diff:.2e}");
        assert!(
            max_diff <= logits_tol,
            "{name} prompt {i}: logits max-abs diff {max_diff} (bound {logits_tol})"
        );

        // greedy decode with the KV cache, one token at a time
        let greedy: Vec<u32> = p["greedy"]
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
        let tie = gaps
            .iter()
            .position(|&g| g < tie_gap)
            .unwrap_or(greedy.len());
        let mut cache = model.new_cache(1, 4096);
        let mut last = model
            .forward(
                &mut cache,
                StepInput::Host(&[SeqInput {
                    slot: 0,
                    tokens: &ids,
                }]),
                Logits::Last,
            )
            .unwrap();
        let mut produced = Vec::new();
        for _ in 0..tie {
            let next = last[0]
                .argmax(-1, false)
                .unwrap()
                .astype(Dtype::U32)
                .unwrap()
                .to_vec::<u32>()
                .unwrap()[0];
            produced.push(next);
            last = model
                .forward(
                    &mut cache,
                    StepInput::Host(&[SeqInput {
                        slot: 0,
                        tokens: &[next],
                    }]),
                    Logits::Last,
                )
                .unwrap();
        }
        assert_eq!(
            produced,
            greedy[..tie],
            "{name} prompt {i}: greedy tokens (compared up to step {tie})"
        );
    }
}

#[test]
fn llama3_matches_transformers() {
    check_fixture("llama3");
}
#[test]
fn llama_gqa2_tied_head_dim_matches_transformers() {
    check_fixture("llama_gqa2_tied");
}
#[test]
fn mistral_matches_transformers() {
    check_fixture("mistral");
}
#[test]
fn qwen2_matches_transformers() {
    check_fixture("qwen2");
}
#[test]
fn qwen3_matches_transformers() {
    check_fixture("qwen3");
}
#[test]
fn llama_q4_matches_mlx_lm() {
    check_fixture("llama_q4");
}
// Scaled rope types, with prompts longer than original_max_position_embeddings (32).
#[test]
fn rope_llama3_matches_transformers_beyond_original_length() {
    check_fixture("rope_llama3");
}
#[test]
fn rope_linear_matches_transformers() {
    check_fixture("rope_linear");
}
#[test]
fn rope_yarn_matches_transformers_beyond_original_length() {
    check_fixture("rope_yarn");
}
#[test]
fn qwen2_bf16_matches_transformers() {
    check_fixture("qwen2_bf16");
}
#[test]
fn qwen3_bf16_matches_transformers() {
    check_fixture("qwen3_bf16");
}

/// The two config forms of every fixture that has both parse to the same model.
#[test]
fn legacy_and_current_configs_agree() {
    let mut both = 0;
    for f in FIXTURES {
        let legacy = fixture(f).join("config.legacy.json");
        if !legacy.is_file() {
            continue;
        }
        let read = |p: &Path| {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            models::ModelConfig::from_json(&v).unwrap()
        };
        let current = fixture(f).join("config.json");
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&current).unwrap()).unwrap();
        assert!(
            v.get("rope_parameters").is_some() && v.get("rope_theta").is_none(),
            "{f}: config.json is not in the transformers 5 form"
        );
        assert_eq!(read(&current), read(&legacy), "{f}");
        both += 1;
    }
    assert_eq!(
        both,
        FIXTURES.len() - 1,
        "every float fixture has both forms"
    );
}

/// Batched decode of several sequences in different slots at different
/// positions gives the same logits as decoding each alone.
#[test]
fn batched_decode_equals_single() {
    let dir = fixture("qwen3");
    let md = ModelDir::open(&dir).unwrap();
    let model = models::load(&md, LoadFormat::Safetensors, |_, _| {})
        .unwrap()
        .model;
    let prompts: [&[u32]; 3] = [
        &[1, 2, 3, 4, 5],
        &[9, 8],
        &[100, 101, 102, 103, 104, 105, 106, 107],
    ];
    let next = [17u32, 23, 42];
    let mut single = Vec::new();
    for (p, n) in prompts.iter().zip(next) {
        let mut c = model.new_cache(1, 64);
        model
            .forward(
                &mut c,
                StepInput::Host(&[SeqInput { slot: 0, tokens: p }]),
                Logits::Last,
            )
            .unwrap();
        single.push(
            model
                .forward(
                    &mut c,
                    StepInput::Host(&[SeqInput {
                        slot: 0,
                        tokens: &[n],
                    }]),
                    Logits::Last,
                )
                .unwrap()
                .remove(0),
        );
    }
    // one run of consecutive slots, three single-slot runs, and two runs: each run reads the
    // KV pool as a view
    for slots in [[1usize, 2, 3], [3, 0, 2], [0, 1, 3]] {
        let mut c = model.new_cache(4, 64);
        for (p, &s) in prompts.iter().zip(&slots) {
            model
                .forward(
                    &mut c,
                    StepInput::Host(&[SeqInput { slot: s, tokens: p }]),
                    Logits::Last,
                )
                .unwrap();
        }
        let step: Vec<SeqInput> = slots
            .iter()
            .zip(&next)
            .map(|(&s, n)| SeqInput {
                slot: s,
                tokens: std::slice::from_ref(n),
            })
            .collect();
        let batched = model
            .forward(&mut c, StepInput::Host(&step), Logits::Last)
            .unwrap();
        for (b, s) in batched.iter().zip(&single) {
            let d = b
                .sub(s)
                .unwrap()
                .abs()
                .unwrap()
                .max(&[0, 1], false)
                .unwrap()
                .item::<f32>()
                .unwrap();
            assert!(d < 1e-4, "batched vs single max diff {d}");
        }
    }
}

#[test]
fn all_fixture_names_exist() {
    for f in FIXTURES {
        assert!(fixture(f).join("config.json").is_file(), "{f}");
    }
}

/// Pipelined decode (step t+1 queued on the device, fed with token t still on the
/// device, before token t is read) gives the same tokens, logprobs and finish as
/// reading every token first: greedy, seeded sampling with logprobs, a stop
/// string, a max_tokens boundary; and a sampler with penalties (not pipelined).
#[test]
fn pipelined_generate_equals_step_by_step() {
    use mlxcel::engine::generate::{generate, GenerateOptions};
    use mlxcel::engine::sampler::SamplingParams;
    use mlxcel::engine::step::{Executor, LocalExecutor, SeqStep, StepPlan};

    for name in ["llama3", "qwen3", "llama_q4"] {
        let dir = fixture(name);
        let md = ModelDir::open(&dir).unwrap();
        let config: Value = md.read_config().unwrap();
        let tok = Tokenizer::from_dir(&dir, &config).unwrap();
        let model = models::load(&md, LoadFormat::Safetensors, |_, _| {})
            .unwrap()
            .model;
        let mut exec = LocalExecutor::new(model, 2, 256);
        let prompt = tok.encode("The quick brown fox", true).unwrap();
        let sampled = SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: Some(7),
            logprobs: true,
            top_logprobs: 3,
            ..SamplingParams::default()
        };
        let penalised = SamplingParams {
            temperature: 0.7,
            seed: Some(3),
            repetition_penalty: 1.3,
            ..SamplingParams::default()
        };
        let cases = [
            (SamplingParams::default(), 24, vec![]),
            (sampled.clone(), 20, vec![]),
            (sampled, 1, vec![]),
            (SamplingParams::default(), 2, vec![]),
            (penalised, 12, vec![]),
        ];
        let mut seq = 0;
        for (params, max_tokens, stop) in cases {
            let mut runs = Vec::new();
            for pipeline in [false, true] {
                seq += 1;
                let opts = GenerateOptions {
                    max_tokens,
                    stop: stop.clone(),
                    ignore_eos: true,
                    pipeline,
                    ..GenerateOptions::default()
                };
                let mut pieces = String::new();
                let g = generate(
                    &mut exec,
                    &tok,
                    seq,
                    (seq % 2) as usize,
                    &prompt,
                    params.clone(),
                    &opts,
                    |p| pieces.push_str(p),
                )
                .unwrap();
                assert_eq!(g.text, pieces);
                runs.push(g);
            }
            let (a, b) = (&runs[0], &runs[1]);
            assert_eq!(a.generated_token_ids.len(), max_tokens, "{name}");
            assert_eq!(
                a.generated_token_ids, b.generated_token_ids,
                "{name} {params:?}"
            );
            assert_eq!(a.text, b.text, "{name}");
            assert_eq!(a.finish_reason, b.finish_reason, "{name}");
            assert_eq!(a.logprobs, b.logprobs, "{name} {params:?}");
            match &a.logprobs {
                None => assert!(
                    !params.logprobs,
                    "{name}: logprobs asked for, none returned"
                ),
                Some(lp) => {
                    // one entry per generated token, the token's own, its top list sorted
                    assert_eq!(lp.len(), a.generated_token_ids.len(), "{name}");
                    for (e, &t) in lp.iter().zip(&a.generated_token_ids) {
                        assert_eq!(e.token, t, "{name}");
                        assert_eq!(e.top.len(), params.top_logprobs as usize, "{name}");
                        assert!(e.top.windows(2).all(|w| w[0].1 >= w[1].1), "{name}");
                        assert!(e.logprob <= 0.0 && e.top[0].1 >= e.logprob, "{name}");
                    }
                }
            }
        }
        // a stop string that occurs in the greedy text ends both runs at the same place
        let free = generate(
            &mut exec,
            &tok,
            100,
            0,
            &prompt,
            SamplingParams::default(),
            &GenerateOptions {
                max_tokens: 16,
                ignore_eos: true,
                ..GenerateOptions::default()
            },
            |_| {},
        )
        .unwrap();
        let text = free.text.clone();
        if text.chars().count() >= 6 {
            let stop: String = text.chars().skip(3).take(3).collect();
            let mut outs = Vec::new();
            for (i, pipeline) in [false, true].into_iter().enumerate() {
                let opts = GenerateOptions {
                    max_tokens: 16,
                    ignore_eos: true,
                    stop: vec![stop.clone()],
                    pipeline,
                    ..GenerateOptions::default()
                };
                outs.push(
                    generate(
                        &mut exec,
                        &tok,
                        200 + i as u64,
                        1,
                        &prompt,
                        SamplingParams::default(),
                        &opts,
                        |_| {},
                    )
                    .unwrap(),
                );
            }
            assert_eq!(outs[0].text, outs[1].text, "{name} stop {stop:?}");
            assert_eq!(
                outs[0].generated_token_ids, outs[1].generated_token_ids,
                "{name}"
            );
            assert!(!outs[0].text.contains(&stop));
        }
        // the local executor pipelines plain and seeded samplers, not penalised ones
        for (id, params, want) in [
            (300, SamplingParams::default(), true),
            (
                301,
                SamplingParams {
                    presence_penalty: 0.5,
                    ..SamplingParams::default()
                },
                false,
            ),
        ] {
            exec.execute(&StepPlan {
                seqs: vec![SeqStep::whole_prompt(id, 0, &prompt, params)],
                ..Default::default()
            })
            .unwrap();
            assert_eq!(exec.can_pipeline(id), want, "{name} seq {id}");
            exec.execute(&StepPlan {
                release: vec![id],
                ..Default::default()
            })
            .unwrap();
        }
    }
}

/// Decode steps at new positions, batch sizes and prompt lengths re-trace none of
/// the compiled ops after the first prefill and the first decode step (they are
/// shapeless, traced once per input rank: a prefill's residual stream is `[1, T, hidden]`,
/// a decode step's `[B, hidden]`; positions and offsets are arrays).
#[test]
fn compiled_ops_trace_once() {
    use mlxcel::mlx::fast;
    let dir = fixture("qwen3");
    let md = ModelDir::open(&dir).unwrap();
    let model = models::load(&md, LoadFormat::Safetensors, |_, _| {})
        .unwrap()
        .model;
    let mut cache = model.new_cache(3, 128);
    let warm = model
        .forward(
            &mut cache,
            StepInput::Host(&[SeqInput {
                slot: 0,
                tokens: &[1, 2, 3],
            }]),
            Logits::Last,
        )
        .unwrap();
    warm[0].eval().unwrap();
    let warm = model
        .forward(
            &mut cache,
            StepInput::Host(&[SeqInput {
                slot: 0,
                tokens: &[4],
            }]),
            Logits::Last,
        )
        .unwrap();
    warm[0].eval().unwrap();
    let traced = fast::compile_traces();
    assert!(traced >= 1, "the MLP's compiled SwiGLU was not traced");
    // single-sequence decode at growing positions
    for t in 0..8u32 {
        let out = model
            .forward(
                &mut cache,
                StepInput::Host(&[SeqInput {
                    slot: 0,
                    tokens: &[10 + t],
                }]),
                Logits::Last,
            )
            .unwrap();
        out[0].eval().unwrap();
    }
    // another prompt length, then batched decode rows of 2 and 3 sequences
    for (slot, n) in [(1usize, 7usize), (2, 2)] {
        let p: Vec<u32> = (0..n as u32).map(|i| 20 + i).collect();
        let out = model
            .forward(
                &mut cache,
                StepInput::Host(&[SeqInput { slot, tokens: &p }]),
                Logits::Last,
            )
            .unwrap();
        out[0].eval().unwrap();
    }
    for rows in [&[0usize, 1][..], &[0, 1, 2][..]] {
        let inputs: Vec<SeqInput> = rows
            .iter()
            .map(|&slot| SeqInput { slot, tokens: &[5] })
            .collect();
        model
            .forward(&mut cache, StepInput::Host(&inputs), Logits::Rows)
            .unwrap()[0]
            .eval()
            .unwrap();
    }
    assert_eq!(
        fast::compile_traces(),
        traced,
        "a compiled op was traced again after warm-up"
    );
}
