//! The paged KV cache's writes update its pools in place, whatever the step: a step that
//! copied a layer's pool would take a whole pool more memory (on a GPU whose memory the
//! pool fills, out of memory: an H200 server failed every 32-stream step this way). MLX's
//! peak memory over each kind of step is measured with a small and a large pool; it may
//! not grow with the pool. One test in its own process: MLX's memory counters are per
//! process.
use mlxcel::engine::sampler::SamplingParams;
use mlxcel::engine::step::{Executor, Fork, LocalExecutor, SeqStart, SeqStep, StepPlan};
use mlxcel::mlx::memory;
use mlxcel::models::kv_cache::KvConfig;

#[allow(dead_code)] // (the tensor-parallel helpers)
mod support;

const BLOCK: usize = 32;

fn decode(seq_id: u64, slot: usize, pos: usize) -> SeqStep {
    SeqStep {
        seq_id,
        slot,
        pos,
        tokens: vec![3],
        start: None,
        sample: true,
        blocks: None,
        restart: false,
    }
}

fn prompt(seq_id: u64, slot: usize, tokens: &[u32], blocks: Vec<u32>) -> SeqStep {
    let mut s = SeqStep::whole_prompt(seq_id, slot, tokens, SamplingParams::default());
    s.blocks = Some(blocks);
    s
}

/// MLX's peak memory over each step above the memory active before it, by step, with a
/// pool of `blocks` blocks; and the writes that copied a pool.
fn step_peaks(blocks: usize) -> (Vec<(&'static str, i64)>, u64) {
    let kv = KvConfig {
        block_size: BLOCK,
        num_blocks: blocks,
        preallocate: true,
    };
    let mut ex = LocalExecutor::with_kv(support::load_fixture("llama3"), 5, 256, kv);
    let mut peaks = Vec::new();
    let mut step = |name: &'static str, ex: &mut LocalExecutor, f: &dyn Fn(&mut LocalExecutor)| {
        let before = memory::active();
        memory::reset_peak();
        f(ex);
        peaks.push((name, memory::peak() as i64 - before as i64));
    };
    // the pool is made by the first step (not measured)
    ex.execute(&StepPlan {
        seqs: vec![prompt(1, 0, &[5, 6, 7, 8], vec![0])],
        ..Default::default()
    })
    .unwrap();
    step("decode 1", &mut ex, &|ex| {
        ex.execute(&StepPlan {
            seqs: vec![decode(1, 0, 4)],
            ..Default::default()
        })
        .unwrap();
    });
    // a decode and two prompts, one of them shared by a fork (an n = 2 request)
    step("decode + 2 prompts + fork", &mut ex, &|ex| {
        let p = [12u32, 13, 14, 15, 16];
        ex.execute(&StepPlan {
            seqs: vec![
                decode(1, 0, 5),
                prompt(2, 1, &[9, 10, 11], vec![1]),
                prompt(3, 2, &p, vec![2]),
            ],
            forks: vec![Fork {
                from: 3,
                seq_id: 4,
                slot: 3,
                start: SeqStart {
                    params: SamplingParams::default(),
                    prompt: p.to_vec(),
                },
                blocks: vec![3],
            }],
            ..Default::default()
        })
        .unwrap();
    });
    step("two prompts", &mut ex, &|ex| {
        ex.execute(&StepPlan {
            seqs: vec![
                prompt(5, 4, &[20, 21, 22, 23], vec![4]),
                decode(1, 0, 6),
                decode(2, 1, 3),
            ],
            ..Default::default()
        })
        .unwrap();
    });
    step("decode 5", &mut ex, &|ex| {
        ex.execute(&StepPlan {
            seqs: vec![
                decode(1, 0, 7),
                decode(2, 1, 4),
                decode(3, 2, 5),
                decode(4, 3, 5),
                decode(5, 4, 4),
            ],
            ..Default::default()
        })
        .unwrap();
    });
    step("pipelined decode", &mut ex, &|ex| {
        let rows = |k: usize| -> Vec<(u64, usize, usize)> {
            vec![(1, 0, 8 + k), (2, 1, 5 + k), (3, 2, 6 + k), (4, 3, 6 + k)]
        };
        ex.queue_decode(&rows(0), Some(&[3, 3, 3, 3]), &[]).unwrap();
        ex.queue_decode(&rows(1), None, &[]).unwrap();
        ex.take_sampled().unwrap();
        ex.queue_decode(&rows(2), None, &[]).unwrap();
        ex.take_sampled().unwrap();
        ex.take_sampled().unwrap();
    });
    let copies = ex.worker.kv_pool_copies();
    (peaks, copies)
}

#[test]
fn no_step_copies_the_kv_pool() {
    let small = 64;
    let large = 8192;
    // llama3 fixture: 2 layers, 4 kv heads of 8, float32
    let layer_pool = (large * BLOCK * 2 * 4 * 8 * 4) as i64;
    let (a, copies_a) = step_peaks(small);
    let (b, copies_b) = step_peaks(large);
    eprintln!("peak above active per step, {small} blocks: {a:?}; {large} blocks: {b:?}");
    assert_eq!((copies_a, copies_b), (0, 0), "writes that copied a pool");
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(
            y - x < layer_pool / 8,
            "{name}: {y} bytes above active with {large} blocks, {x} with {small}: the step \
             copied a pool ({layer_pool} bytes a layer)"
        );
    }
}
