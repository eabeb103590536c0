//! The paged KV cache's writes update its pools in place, whatever the step: a step that
//! copied a layer's pool would take a whole pool more memory (on a GPU whose memory the
//! pool fills, out of memory: an H200 server failed every 32-stream step this way). MLX's
//! peak memory over each kind of step is measured with a small and a large pool; it may
//! not grow with the pool. And a write while a read of the pool is still queued (as on a
//! GPU that runs behind the host) stays in place. In their own process, one test at a
//! time: MLX's memory counters are per process, and the queued reads wait behind a long
//! task on the stream.
use std::sync::{Mutex, MutexGuard};

use mlxcel::engine::sampler::SamplingParams;
use mlxcel::engine::step::{Executor, Fork, LocalExecutor, SeqStart, SeqStep, StepPlan};
use mlxcel::mlx::{self, memory};
use mlxcel::models::kv_cache::{KvCache, KvConfig, NewKv};

#[allow(dead_code)] // (the tensor-parallel helpers)
mod support;

const BLOCK: usize = 32;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `shape` filled with `from`, `from + 1`, ...
fn values(shape: &[i32], from: f32) -> mlx::Array {
    let n: i32 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| from + i as f32).collect();
    mlx::Array::from_slice(&v, shape).unwrap()
}

/// A long task on this thread's stream: reads queued after it wait until it is done.
fn busy() -> mlx::Array {
    let m = mlx::Array::full(&[768, 768], 1e-3, mlx::Dtype::F32).unwrap();
    let mut busy = m.clone();
    for _ in 0..2 {
        busy = busy.matmul(&m).unwrap();
    }
    mlx::async_eval(&[&busy]).unwrap();
    busy
}

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
    let _one = serial();
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

/// A write into a pool whose earlier read is still queued on the device (here behind
/// a long task on the same stream, as a GPU runs behind the host) updates the pool in
/// place, and the read sees the positions as they were: reads go through unowned
/// views (an ordinary view would keep the pool referenced until the read has run, and
/// the write would copy the pool).
#[test]
fn a_write_while_a_read_is_queued_updates_the_pool_in_place() {
    let _one = serial();
    let (h, d) = (2i32, 4i32);
    for gather in [false, true] {
        let kv = KvConfig {
            block_size: 4,
            num_blocks: 64,
            preallocate: true,
        };
        let mut c = KvCache::new(1, 1, h as usize, d as usize, mlx::Dtype::F32, 32, kv);
        c.restart(0, 0, Some(if gather { &[3, 1] } else { &[0, 1] }));
        c.prepare(1, &[(0, 6)]).unwrap();
        let r = c.seq_rows(0, 0, 6).unwrap();
        assert_eq!(r.is_run(), !gather);
        c.write(0, &r, &NewKv::Merged(values(&[1, 2 * h, 6, d], 1.0)))
            .unwrap();
        c.advance(0, 6);
        c.pool(0).eval().unwrap();
        assert_eq!(c.check_in_place(), 0);
        let busy = busy();
        let (k, v) = c.read(0, &r).unwrap();
        let sum = k
            .sum(&[0, 1, 2, 3], false)
            .unwrap()
            .add(&v.sum(&[0, 1, 2, 3], false).unwrap())
            .unwrap();
        drop((k, v));
        mlx::async_eval(&[&sum]).unwrap();
        c.prepare(1, &[(0, 7)]).unwrap();
        let r = c.seq_rows(0, 6, 1).unwrap();
        c.write(0, &r, &NewKv::Merged(values(&[1, 2 * h, 1, d], 1e6)))
            .unwrap();
        c.pool(0).eval().unwrap();
        assert_eq!(c.check_in_place(), 0, "gather {gather}: the write copied");
        busy.eval().unwrap();
        let n = (2 * h * 6 * d) as f32;
        assert_eq!(sum.item::<f32>().unwrap(), n * (n + 1.0) / 2.0);
    }
}

/// What the KV cache's reads rely on: an update of an array whose earlier read is still
/// queued (here behind a long task on the same stream) reuses the array's buffer when
/// the read went through unowned views (one, or two made by one op), and copies the whole
/// array when it went through an ordinary slice; the read sees the contents from before
/// the update.
#[test]
fn an_update_after_a_queued_unowned_read_reuses_the_buffer() {
    let _one = serial();
    #[derive(Clone, Copy, Debug)]
    enum Read {
        Slice,
        Unowned,
        UnownedPair,
    }
    let update_after_read = |how: Read| -> (bool, f32) {
        let pool = mlx::Array::zeros(&[1, 4, 256, 8], mlx::Dtype::F32).unwrap();
        pool.eval().unwrap();
        let id = pool.buffer_id();
        assert_ne!(id, 0);
        // a long task first, so that the read is still queued when the update is built
        let busy = busy();
        let (lo, hi) = ([0, 0, 0, 0], [1, 4, 2, 8]);
        let (lo2, hi2) = ([0, 2, 0, 0], [1, 4, 3, 8]);
        let views = match how {
            Read::Unowned => vec![pool.unowned_slice(&lo, &hi).unwrap()],
            Read::Slice => vec![pool.slice(&lo, &hi, &[1; 4]).unwrap()],
            Read::UnownedPair => pool.unowned_slices(&[(&lo, &hi), (&lo2, &hi2)]).unwrap(),
        };
        let mut read = views[0].sum(&[0, 1, 2, 3], false).unwrap();
        for v in &views[1..] {
            read = read.add(&v.sum(&[0, 1, 2, 3], false).unwrap()).unwrap();
        }
        drop(views);
        mlx::async_eval(&[&read]).unwrap();
        let ones = mlx::Array::full(&[1, 4, 1, 8], 1.0, mlx::Dtype::F32).unwrap();
        let updated = pool
            .slice_update(&ones, &[0, 0, 0, 0], &[1, 4, 1, 8], &[1; 4])
            .unwrap();
        drop(pool);
        updated.eval().unwrap();
        let in_place = updated.buffer_id() == id;
        busy.eval().unwrap();
        (in_place, read.item::<f32>().unwrap())
    };
    assert_eq!(update_after_read(Read::Unowned), (true, 0.0));
    assert_eq!(update_after_read(Read::UnownedPair), (true, 0.0));
    assert_eq!(update_after_read(Read::Slice), (false, 0.0));
}
