//! `HostFill` on the backend this binary runs against: an array queued before its contents
//! exist, read by an op on the default device (the GPU on a CUDA box, through MLX's
//! cross-stream event), its contents given from another thread after the reading graph
//! was queued, as the scheduler's deferred masks (`MLXCEL_DEFER_MASKS=1`) do. A watchdog
//! turns a hang into a failure. Built here (`cargo test --no-run`), the test binary runs
//! unchanged on a GPU box against its libmlx (the CPU run is the mechanism only).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mlxcel::mlx::host_fill::HostFill;
use mlxcel::mlx::{self, Array};

/// Exits the process (failing the test) unless `done` is set within `limit`.
fn watchdog(what: &'static str, limit: Duration) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        if !d.load(Ordering::SeqCst) {
            eprintln!("{what}: no result in {limit:?} (the read never saw the contents)");
            std::process::exit(3);
        }
    });
    done
}

#[test]
fn contents_given_from_another_thread_reach_a_queued_op() {
    let done = watchdog("HostFill", Duration::from_secs(30));
    eprintln!("backend {:?}", mlx::backend());
    for round in 0..3u32 {
        let mut h = HostFill::new::<u32>(&[2, 4], Duration::from_secs(20)).unwrap();
        let y = h
            .array()
            .add(&Array::from_slice(&[round], &[1]).unwrap())
            .unwrap();
        mlx::async_eval(&[&y]).unwrap();
        let data: Vec<u32> = (0..8).map(|i| i * 10).collect();
        let giver = {
            let data = data.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                h.provide(&data).unwrap()
            })
        };
        let got = y.to_vec::<u32>().unwrap();
        assert!(giver.join().unwrap(), "round {round}: given in time");
        let want: Vec<u32> = data.iter().map(|x| x + round).collect();
        assert_eq!(got, want, "round {round}");
    }
    done.store(true, Ordering::SeqCst);
}

/// On CUDA: masks given from another thread into pinned host memory reach an op queued
/// before them, through `kernels/mask_wait.cu` (what `MLXCEL_DEFER_MASKS=1` uses there);
/// the flag of a later step waits for its own words. Off CUDA there is no such buffer.
#[test]
fn pinned_masks_reach_a_queued_op_on_cuda() {
    use mlxcel::kernels::mask_wait::MaskBuffer;
    let Some(buf) = MaskBuffer::new(8) else {
        assert_ne!(mlx::backend(), mlx::Backend::Cuda, "CUDA has pinned memory");
        return;
    };
    let done = watchdog("mask_wait", Duration::from_secs(40));
    let buf = Arc::new(std::sync::Mutex::new(buf));
    for seq in 1..=3u32 {
        let words = buf.lock().unwrap().read(seq, 2, 4).unwrap();
        let y = words
            .add(&Array::from_slice(&[seq], &[1]).unwrap())
            .unwrap();
        mlx::async_eval(&[&y]).unwrap();
        let data: Vec<u32> = (0..8).map(|i| i * 100 + seq).collect();
        let giver = {
            let (buf, data) = (buf.clone(), data.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                assert!(buf.lock().unwrap().give(seq, &data).unwrap(), "in time");
            })
        };
        let got = y.to_vec::<u32>().unwrap();
        giver.join().unwrap();
        let want: Vec<u32> = data.iter().map(|x| x + seq).collect();
        assert_eq!(got, want, "step {seq}");
    }
    done.store(true, Ordering::SeqCst);
}
