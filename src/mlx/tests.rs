//! Op results against values computed here in Rust from fresh random inputs.
use super::fast::{self, Mask};
use super::*;
use rand::Rng;

fn rand_vec(n: usize) -> Vec<f32> {
    let mut rng = rand::rng();
    (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "length differs");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "index {i}: {x} vs {y}"
        );
    }
}

fn matmul_ref(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    out
}

#[test]
fn elementwise_and_reductions() {
    let a = rand_vec(12);
    let b = rand_vec(12);
    let x = Array::from_slice(&a, &[3, 4]).unwrap();
    let y = Array::from_slice(&b, &[3, 4]).unwrap();
    let sum: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p + q).collect();
    close(&x.add(&y).unwrap().to_vec::<f32>().unwrap(), &sum, 1e-6);
    let prod: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p * q).collect();
    close(&x.mul(&y).unwrap().to_vec::<f32>().unwrap(), &prod, 1e-6);
    let ex: Vec<f32> = a.iter().map(|v| v.exp()).collect();
    close(&x.exp().unwrap().to_vec::<f32>().unwrap(), &ex, 1e-5);
    let silu: Vec<f32> = a.iter().map(|v| v / (1.0 + (-v).exp())).collect();
    close(&x.silu().unwrap().to_vec::<f32>().unwrap(), &silu, 1e-5);
    let rows: Vec<f32> = (0..3).map(|r| a[r * 4..r * 4 + 4].iter().sum()).collect();
    close(
        &x.sum(&[1], false).unwrap().to_vec::<f32>().unwrap(),
        &rows,
        1e-5,
    );
    let amax: Vec<u32> = (0..3)
        .map(|r| {
            let row = &a[r * 4..r * 4 + 4];
            (0..4).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as u32
        })
        .collect();
    assert_eq!(x.argmax(1, false).unwrap().to_vec::<u32>().unwrap(), amax);
    let sm = x.softmax(-1, true).unwrap().to_vec::<f32>().unwrap();
    for r in 0..3 {
        let row = &a[r * 4..r * 4 + 4];
        let m = row.iter().cloned().fold(f32::MIN, f32::max);
        let z: f32 = row.iter().map(|v| (v - m).exp()).sum();
        let want: Vec<f32> = row.iter().map(|v| (v - m).exp() / z).collect();
        close(&sm[r * 4..r * 4 + 4], &want, 1e-5);
    }
}

#[test]
fn matmul_matches_reference_and_rejects_bad_shapes() {
    let (m, k, n) = (5, 7, 3);
    let a = rand_vec(m * k);
    let b = rand_vec(k * n);
    let x = Array::from_slice(&a, &[m as i32, k as i32]).unwrap();
    let y = Array::from_slice(&b, &[k as i32, n as i32]).unwrap();
    let got = x.matmul(&y).unwrap();
    assert_eq!(got.shape(), vec![m as i32, n as i32]);
    close(
        &got.to_vec::<f32>().unwrap(),
        &matmul_ref(&a, &b, m, k, n),
        1e-5,
    );
    let bad = Array::from_slice(&rand_vec(4 * 2), &[4, 2]).unwrap();
    let err = x.matmul(&bad).and_then(|r| r.eval().map(|_| r));
    assert!(matches!(err, Err(MlxError::Mlx(_))), "{err:?}");
}

#[test]
fn dtype_round_trips() {
    let a = rand_vec(16);
    let x = Array::from_slice(&a, &[16]).unwrap();
    for dt in [Dtype::BF16, Dtype::F16] {
        let back = x
            .astype(dt)
            .unwrap()
            .astype(Dtype::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        close(&back, &a, 1e-2);
        assert_eq!(x.astype(dt).unwrap().dtype(), dt);
    }
    let ints: Vec<i32> = (0..10)
        .map(|_| rand::rng().random_range(-1000..1000))
        .collect();
    assert_eq!(
        Array::from_slice(&ints, &[2, 5])
            .unwrap()
            .to_vec::<i32>()
            .unwrap(),
        ints
    );
    let bytes: Vec<u8> = (0..8).map(|_| rand::rng().random()).collect();
    assert_eq!(
        Array::from_slice(&bytes, &[8])
            .unwrap()
            .to_vec::<u8>()
            .unwrap(),
        bytes
    );
    let flags = vec![true, false, true];
    assert_eq!(
        Array::from_slice(&flags, &[3])
            .unwrap()
            .to_vec::<bool>()
            .unwrap(),
        flags
    );
    let i64s: Vec<i64> = vec![1 << 40, -3];
    assert_eq!(
        Array::from_slice(&i64s, &[2])
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        i64s
    );
    // bf16 from raw bytes (as read from safetensors): 1.0 = 0x3f80, -2.0 = 0xc000
    let raw = [0x80u8, 0x3f, 0x00, 0xc0];
    let v = Array::from_bytes(&raw, &[2], Dtype::BF16)
        .unwrap()
        .astype(Dtype::F32)
        .unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![1.0, -2.0]);
    // reading with the wrong type is a typed error
    assert!(matches!(
        x.to_vec::<i32>(),
        Err(MlxError::DtypeMismatch { .. })
    ));
    // wrong byte count is an error, not a crash
    assert!(Array::from_bytes(&raw, &[3], Dtype::BF16).is_err());
}

#[test]
fn shapes_slices_and_indexing() {
    let a = rand_vec(24);
    let x = Array::from_slice(&a, &[2, 3, 4]).unwrap();
    let t = x.transpose(&[2, 0, 1]).unwrap();
    assert_eq!(t.shape(), vec![4, 2, 3]);
    let tv = t.to_vec::<f32>().unwrap();
    assert_eq!(tv[6 + 3 + 2], a[12 + 2 * 4 + 1]);
    let s = x.slice_axis(2, 1, 3).unwrap();
    assert_eq!(s.shape(), vec![2, 3, 2]);
    assert_eq!(s.to_vec::<f32>().unwrap()[0], a[1]);
    let upd = Array::full(&[2, 3, 1], 9.0, Dtype::F32).unwrap();
    let u = x
        .slice_update(&upd, &[0, 0, 3], &[2, 3, 4], &[1, 1, 1])
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(u[3], 9.0);
    assert_eq!(u[2], a[2]);
    let start = Array::from_slice(&[2i32], &[1]).unwrap();
    let d = x.slice_dynamic(&start, &[2], &[2, 3, 2]).unwrap();
    assert_eq!(d.to_vec::<f32>().unwrap()[0], a[2]);
    let c = concatenate(&[&x, &x], 0).unwrap();
    assert_eq!(c.shape(), vec![4, 3, 4]);
    let parts = split_sections(&c, &[1, 3], 0).unwrap();
    assert_eq!(
        parts.iter().map(|p| p.dim(0)).collect::<Vec<_>>(),
        vec![1, 2, 1]
    );
    let idx = Array::from_slice(&[2u32, 0], &[2]).unwrap();
    let tk = x
        .reshape(&[6, 4])
        .unwrap()
        .take(&idx, 0)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(&tk[..4], &a[8..12]);
    assert_eq!(&tk[4..], &a[..4]);
}

#[test]
fn rms_norm_rope_and_attention() {
    let (b, h, l, d) = (1, 2, 5, 8);
    let xs = rand_vec(b * h * l * d);
    let w = rand_vec(d);
    let x = Array::from_slice(&xs, &[b as i32, h as i32, l as i32, d as i32]).unwrap();
    let wa = Array::from_slice(&w, &[d as i32]).unwrap();
    let got = fast::rms_norm(&x, Some(&wa), 1e-5)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let mut want = vec![0.0; xs.len()];
    for r in 0..b * h * l {
        let row = &xs[r * d..r * d + d];
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        for i in 0..d {
            want[r * d + i] = row[i] / (ms + 1e-5).sqrt() * w[i];
        }
    }
    close(&got, &want, 1e-4);

    // RoPE, non-traditional (half-split) as in Llama, starting at position 3.
    let base = 10000.0f32;
    let got = fast::rope(&x, d as i32, false, base, 1.0, 3)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let mut want = vec![0.0; xs.len()];
    for r in 0..b * h * l {
        let pos = (r % l + 3) as f32;
        for i in 0..d / 2 {
            let theta = pos * base.powf(-2.0 * i as f32 / d as f32);
            let (x1, x2) = (xs[r * d + i], xs[r * d + i + d / 2]);
            want[r * d + i] = x1 * theta.cos() - x2 * theta.sin();
            want[r * d + i + d / 2] = x1 * theta.sin() + x2 * theta.cos();
        }
    }
    close(&got, &want, 1e-4);
    let off = Array::scalar_i32(3).unwrap();
    let dynamic = fast::rope_dynamic(&x, d as i32, false, base, 1.0, &off)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    close(&dynamic, &want, 1e-4);

    // causal attention against a naive implementation
    let q = rand_vec(xs.len());
    let k = rand_vec(xs.len());
    let v = rand_vec(xs.len());
    let shape = [b as i32, h as i32, l as i32, d as i32];
    let (qa, ka, va) = (
        Array::from_slice(&q, &shape).unwrap(),
        Array::from_slice(&k, &shape).unwrap(),
        Array::from_slice(&v, &shape).unwrap(),
    );
    let scale = 1.0 / (d as f32).sqrt();
    let got = fast::sdpa(&qa, &ka, &va, scale, Mask::Causal)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let mut want = vec![0.0; xs.len()];
    for hh in 0..h {
        let base_i = hh * l * d;
        for i in 0..l {
            let scores: Vec<f32> = (0..=i)
                .map(|j| {
                    (0..d)
                        .map(|e| q[base_i + i * d + e] * k[base_i + j * d + e])
                        .sum::<f32>()
                        * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::MIN, f32::max);
            let z: f32 = scores.iter().map(|s| (s - m).exp()).sum();
            for e in 0..d {
                want[base_i + i * d + e] = (0..=i)
                    .map(|j| (scores[j] - m).exp() / z * v[base_i + j * d + e])
                    .sum();
            }
        }
    }
    close(&got, &want, 1e-4);
}

#[test]
fn quantized_matmul_matches_dequantized() {
    let (m, k, n) = (3, 64, 16);
    let w = Array::from_slice(&rand_vec(n * k), &[n as i32, k as i32]).unwrap();
    let x = Array::from_slice(&rand_vec(m * k), &[m as i32, k as i32]).unwrap();
    for bits in [4, 8] {
        let (wq, s, b) = fast::quantize(&w, 32, bits).unwrap();
        assert_eq!(wq.dtype(), Dtype::U32);
        assert_eq!(wq.shape(), vec![n as i32, (k * bits as usize / 32) as i32]);
        let deq = fast::dequantize(&wq, &s, &b, 32, bits).unwrap();
        let err = deq
            .sub(&w)
            .unwrap()
            .abs()
            .unwrap()
            .max(&[0, 1], false)
            .unwrap()
            .item::<f32>()
            .unwrap();
        assert!(
            err < if bits == 4 { 0.3 } else { 0.02 },
            "bits {bits}: max error {err}"
        );
        let qm = fast::quantized_matmul(&x, &wq, &s, &b, true, 32, bits)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let dm = x
            .matmul(&deq.t().unwrap())
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        close(&qm, &dm, 1e-3);
    }
}

#[test]
fn random_is_reproducible_per_key() {
    let a = random::normal(&[64], Dtype::F32, 0.0, 1.0, &random::key(7).unwrap()).unwrap();
    let b = random::normal(&[64], Dtype::F32, 0.0, 1.0, &random::key(7).unwrap()).unwrap();
    let c = random::normal(&[64], Dtype::F32, 0.0, 1.0, &random::key(8).unwrap()).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_ne!(a.to_vec::<f32>().unwrap(), c.to_vec::<f32>().unwrap());
    // a distribution with all mass on index 3 always samples 3
    let mut logits = vec![-1e9f32; 8];
    logits[3] = 0.0;
    let l = Array::from_slice(&logits, &[1, 8]).unwrap();
    for key in random::split(&random::key(1).unwrap(), 4).unwrap() {
        assert_eq!(
            random::categorical(&l, -1, &key)
                .unwrap()
                .to_vec::<u32>()
                .unwrap(),
            vec![3]
        );
    }
}

#[test]
fn devices_and_streams() {
    let n = gpu_device_count() as i32;
    assert!(matches!(
        new_stream_on_gpu(99),
        Err(MlxError::InvalidGpuIndex { index: 99, .. })
    ));
    assert!(matches!(
        set_default_gpu(n),
        Err(MlxError::InvalidGpuIndex { .. })
    ));
    assert!(matches!(
        device_info(-1),
        Err(MlxError::InvalidGpuIndex { index: -1, .. })
    ));
    assert_eq!(version(), "0.32.4");
    // a copy onto another CPU stream (the CPU<->GPU case runs in `mlxcel devices --check`)
    let a = rand_vec(6);
    let x = Array::from_slice(&a, &[6]).unwrap();
    let s = Stream::new_cpu().unwrap();
    let y = x.copy_to_stream(&s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), a);
    for i in 0..n {
        let s = new_stream_on_gpu(i).unwrap();
        assert!(s.is_gpu());
        assert_eq!(s.device_index(), i);
        let z = x.copy_to_stream(&s).unwrap();
        assert_eq!(z.to_vec::<f32>().unwrap(), a);
    }
}

#[test]
fn memory_counters_move() {
    // counters are per process and other tests run in parallel: check absolute lower bounds
    let x = Array::zeros(&[1024, 1024], Dtype::F32).unwrap();
    x.eval().unwrap();
    assert!(
        memory::active() >= 4 * 1024 * 1024,
        "active {}",
        memory::active()
    );
    assert!(memory::peak() >= 4 * 1024 * 1024, "peak {}", memory::peak());
    assert!(memory::limit() > 0);
    drop(x);
}

#[test]
fn count_ops_counts_unevaluated_primitives_once() {
    use super::graph::count_ops;
    let x = Array::from_slice(&rand_vec(8), &[2, 4]).unwrap();
    let w = Array::from_slice(&rand_vec(8), &[2, 4]).unwrap();
    // constants are inputs, not ops
    assert_eq!(count_ops(&[&x], &[]).total(), 0);
    let y = x.mul(&w).unwrap();
    let z = y.add(&y).unwrap().exp().unwrap();
    let c = count_ops(&[&z], &[]);
    assert_eq!(c.total(), 3, "{c:?}");
    assert_eq!(
        (c.get("Multiply"), c.get("Add"), c.get("Exp")),
        (1, 1, 1),
        "{c:?}"
    );
    // shared subgraphs count once; `stop` cuts the walk
    let two = count_ops(&[&z, &y], &[]);
    assert_eq!(two.total(), 3);
    assert_eq!(count_ops(&[&z], &[&y]).total(), 2);
    // one multi-output op is one op (split's outputs are siblings)
    let parts = split_sections(&z, &[1], 0).unwrap();
    let s = count_ops(&[&parts[0], &parts[1]], &[&z]);
    assert_eq!(s.total(), 1, "{s:?}");
    // broadcasting an operand is an op of its own
    let v = Array::from_slice(&rand_vec(4), &[4]).unwrap();
    let b = count_ops(&[&x.mul(&v).unwrap()], &[]);
    assert_eq!((b.get("Broadcast"), b.total()), (1, 2), "{b:?}");
    // ops no-op'd by MLX (same-shape reshape) build nothing
    let same = z.reshape(&[2, 4]).unwrap();
    assert_eq!(count_ops(&[&same], &[&z]).total(), 0);
    // an evaluated graph has no ops left to run
    z.eval().unwrap();
    assert_eq!(count_ops(&[&z], &[]).total(), 0);
}

#[test]
fn fast_ops_as_gpu_count_one_op_each() {
    use super::graph::{count_ops, FastOpsAsGpu};
    let x = Array::from_slice(&rand_vec(2 * 4 * 3 * 8), &[2, 4, 3, 8]).unwrap();
    let w = Array::from_slice(&rand_vec(8), &[8]).unwrap();
    let pos = Array::scalar_i32(5).unwrap();
    let build = || {
        let n = fast::rms_norm(&x, Some(&w), 1e-5).unwrap();
        let r = fast::rope_dynamic(&n, 8, false, 10000.0, 1.0, &pos).unwrap();
        fast::sdpa(&r, &r, &r, 0.3, Mask::Causal).unwrap()
    };
    let plain = build();
    let expanded = count_ops(&[&plain], &[]);
    let as_gpu = {
        let _g = FastOpsAsGpu::new();
        let o = build();
        assert_eq!(o.shape(), plain.shape());
        assert_eq!(o.dtype(), plain.dtype());
        let c = count_ops(&[&o], &[]);
        // a stand-in cannot be evaluated: an error, not a crash
        assert!(o.eval().is_err());
        c
    };
    assert_eq!(as_gpu.total(), 3, "{as_gpu:?}");
    for name in ["RMSNorm", "RoPE", "ScaledDotProductAttention"] {
        assert_eq!(as_gpu.get(name), 1, "{as_gpu:?}");
    }
    if backend() == Backend::Cpu {
        // on the CPU each fast op is several fallback ops
        assert!(expanded.total() > 3 * 3, "{expanded:?}");
    }
    // off again: the same build evaluates
    let again = build();
    close(
        &again.to_vec::<f32>().unwrap(),
        &plain.to_vec::<f32>().unwrap(),
        0.0,
    );
}

/// A graph over a `HostFill` array is queued before its contents exist, and reads them
/// once given. (On the CPU backend the graph's own ops wait behind the fill on MLX's
/// task queue, and an evaluation that queues more than MLX's cap of 10 active tasks
/// waits for them on the host, so the graph here is short; on a GPU its ops are the
/// device's and do not count.)
#[test]
fn host_fill_contents_arrive_after_the_graph_is_queued() {
    use std::time::Duration;
    let mut h = host_fill::HostFill::new::<f32>(&[4], Duration::from_secs(30)).unwrap();
    let mut y = h.array();
    for _ in 0..8 {
        y = y.add_scalar(1.0).unwrap();
    }
    async_eval(&[&y]).unwrap();
    let data: Vec<f32> = (0..4).map(|i| i as f32 * 0.5).collect();
    assert!(h.provide(&data).unwrap());
    let want: Vec<f32> = data.iter().map(|x| x + 8.0).collect();
    close(&y.to_vec::<f32>().unwrap(), &want, 0.0);
}

/// Unfilled (dropped, or past its timeout) the array holds zeros, and a late `provide`
/// says so.
#[test]
fn host_fill_without_contents_is_zeros() {
    use std::time::Duration;
    let h = host_fill::HostFill::new::<u32>(&[2, 3], Duration::from_secs(30)).unwrap();
    let a = h
        .array()
        .add(&Array::from_slice(&[7u32], &[1]).unwrap())
        .unwrap();
    drop(h);
    assert_eq!(a.to_vec::<u32>().unwrap(), vec![7; 6]);
    let mut h = host_fill::HostFill::new::<u32>(&[3], Duration::from_millis(10)).unwrap();
    let a = h.array();
    assert_eq!(a.to_vec::<u32>().unwrap(), vec![0; 3]);
    assert!(
        !h.provide(&[1u32, 2, 3]).unwrap(),
        "given after the timeout"
    );
    // the wrong size is an error, and the array is still filled (with zeros) on drop
    let mut h = host_fill::HostFill::new::<u32>(&[3], Duration::from_secs(30)).unwrap();
    let a = h.array();
    assert!(h.provide(&[1u32, 2]).is_err());
    drop(h);
    assert_eq!(a.to_vec::<u32>().unwrap(), vec![0; 3]);
}

#[test]
fn unowned_slices_read_like_slices() {
    let a = rand_vec(2 * 4 * 6 * 3);
    let x = Array::from_slice(&a, &[2, 4, 6, 3]).unwrap();
    let (lo, hi) = ([1, 1, 2, 0], [2, 3, 5, 3]);
    let owned = x.slice(&lo, &hi, &[1; 4]).unwrap();
    let unowned = x.unowned_slice(&lo, &hi).unwrap();
    assert_eq!(unowned.shape(), vec![1, 2, 3, 3]);
    assert_eq!(
        unowned.to_vec::<f32>().unwrap(),
        owned.to_vec::<f32>().unwrap()
    );
    // ops over the view see its elements (a reduction, a contiguous copy)
    let s = unowned
        .sum(&[0, 1, 2, 3], false)
        .unwrap()
        .item::<f32>()
        .unwrap();
    let want: f32 = owned.to_vec::<f32>().unwrap().iter().sum();
    assert!((s - want).abs() < 1e-4, "{s} vs {want}");
    // of a view: offsets add up
    let inner = x.slice(&[0, 1, 0, 0], &[2, 4, 6, 3], &[1; 4]).unwrap();
    let v = inner.unowned_slice(&[1, 0, 2, 0], &[2, 2, 5, 3]).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), owned.to_vec::<f32>().unwrap());
    // out of range, or a start past the stop: an error, not a bad view
    assert!(x.unowned_slice(&[0, 0, 0, 0], &[3, 4, 6, 3]).is_err());
    assert!(x.unowned_slice(&[0, 0, 4, 0], &[2, 4, 3, 3]).is_err());
    assert!(x.unowned_slice(&[0, 0], &[2, 4]).is_err());
}

#[test]
fn unowned_slices_are_one_op_that_reads_like_slices() {
    let a = rand_vec(2 * 4 * 6 * 3);
    let x = Array::from_slice(&a, &[2, 4, 6, 3]).unwrap();
    let ranges: [([i32; 4], [i32; 4]); 3] = [
        ([0, 0, 0, 0], [1, 2, 5, 3]),
        ([0, 2, 0, 0], [1, 4, 5, 3]),
        ([1, 1, 2, 1], [2, 3, 6, 3]),
    ];
    let refs: Vec<(&[i32], &[i32])> = ranges.iter().map(|(a, b)| (&a[..], &b[..])).collect();
    let views = x.unowned_slices(&refs).unwrap();
    assert_eq!(views.len(), 3);
    let outputs: Vec<&Array> = views.iter().collect();
    let ops = crate::mlx::graph::count_ops(&outputs, &[]);
    assert_eq!((ops.total(), ops.get("UnownedSlice")), (1, 1));
    for (v, (lo, hi)) in views.iter().zip(&ranges) {
        let owned = x.slice(lo, hi, &[1; 4]).unwrap();
        assert_eq!(v.shape(), owned.shape());
        assert_eq!(v.to_vec::<f32>().unwrap(), owned.to_vec::<f32>().unwrap());
    }
    // a range with too few entries, or out of range: an error, not a bad view
    assert!(x.unowned_slices(&[(&[0, 0], &[1, 1])]).is_err());
    assert!(x
        .unowned_slices(&[
            (&[0, 0, 0, 0], &[1, 1, 1, 1]),
            (&[0, 0, 0, 0], &[3, 1, 1, 1])
        ])
        .is_err());
    assert!(x.unowned_slices(&[]).is_err());
}

#[test]
fn kernels_launched_by_one_op_are_an_error_off_cuda_not_a_crash() {
    if super::backend() == super::Backend::Cuda {
        return;
    }
    // the CPU library exports no CUDA command encoder: the reason names what is missing
    let why = super::launch_chain_unavailable().expect("unavailable off CUDA");
    assert!(why.contains("get_command_encoder"), "{why}");
    let x = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    let s = super::Stream::default_for(false).unwrap();
    let y = x.launch_chain(3, &s).unwrap();
    let err = super::eval(&[&y]).unwrap_err().to_string();
    assert!(err.contains("CUDA stream"), "{err}");
    // a bad request is refused when the op is made
    assert!(x.launch_chain(0, &s).is_err());
    let ints = Array::from_slice(&[1i32], &[1]).unwrap();
    assert!(ints.launch_chain(1, &s).is_err());
}

#[test]
fn a_fused_graph_computes_its_outputs_in_one_op() {
    use super::graph::count_ops;
    let xs = rand_vec(8);
    let ys = rand_vec(8);
    // (x + y) · x split in two halves, their sum's exp; and x + y itself
    let build = || -> (Array, Array, Array) {
        let x = Array::from_slice(&xs, &[2, 4]).unwrap();
        let y = Array::from_slice(&ys, &[2, 4]).unwrap();
        let a = x.add(&y).unwrap();
        let b = a.mul(&x).unwrap();
        let halves = split_sections(&b, &[1], 0).unwrap();
        let out = halves[0].add(&halves[1]).unwrap().exp().unwrap();
        (out, a, b)
    };
    let (want_out, want_a, _) = build();
    eval(&[&want_out, &want_a]).unwrap();
    let (out, a, b) = build();
    let fused = fuse_graph(&[&out, &a]).unwrap();
    let c = count_ops(&[&fused[0], &fused[1]], &[]);
    assert_eq!((c.total(), c.get("FusedGraph")), (1, 1), "{c:?}");
    assert_eq!(fused[0].shape(), vec![1, 4]);
    eval(&[&fused[0], &fused[1]]).unwrap();
    assert_eq!(
        fused[0].to_vec::<f32>().unwrap(),
        want_out.to_vec::<f32>().unwrap()
    );
    assert_eq!(
        fused[1].to_vec::<f32>().unwrap(),
        want_a.to_vec::<f32>().unwrap()
    );
    // an op's array held elsewhere is left evaluated, not run again by a later graph
    assert!(b.is_available());
    assert_eq!(count_ops(&[&b.add(&b).unwrap()], &[]).total(), 1);
    // nothing left to evaluate: the arrays themselves
    let again = fuse_graph(&[&fused[0]]).unwrap();
    assert_eq!(count_ops(&[&again[0]], &[]).total(), 0);
    assert_eq!(
        again[0].to_vec::<f32>().unwrap(),
        want_out.to_vec::<f32>().unwrap()
    );
}

#[test]
fn fused_graphs_that_share_an_op_give_its_values_in_either_order() {
    let xs = rand_vec(4);
    for first in [0, 1] {
        let x = Array::from_slice(&xs, &[4]).unwrap();
        let two = Array::from_slice(&[2.0f32], &[1]).unwrap();
        let p = x.mul(&two).unwrap();
        let g = [
            fuse_graph(&[&p.add(&two).unwrap()]).unwrap().remove(0),
            fuse_graph(&[&p.mul(&p).unwrap()]).unwrap().remove(0),
        ];
        eval(&[&g[first]]).unwrap();
        eval(&[&g[1 - first]]).unwrap();
        let want: Vec<f32> = xs.iter().map(|v| v * 2.0 + 2.0).collect();
        assert_eq!(g[0].to_vec::<f32>().unwrap(), want);
        let want: Vec<f32> = xs.iter().map(|v| (v * 2.0) * (v * 2.0)).collect();
        assert_eq!(g[1].to_vec::<f32>().unwrap(), want);
        assert!(p.is_available());
    }
}

#[test]
fn updates_in_a_fused_graph_reuse_their_buffer_as_unfused() {
    // two updates in a row of an evaluated buffer that nothing else holds (a KV cache's
    // key and value writes): both in place, fused or not
    for fused in [false, true] {
        let pool = Array::zeros(&[2, 8], Dtype::F32).unwrap();
        pool.eval().unwrap();
        let id = pool.buffer_id();
        let ones = Array::full(&[1, 8], 1.0, Dtype::F32).unwrap();
        let twos = Array::full(&[1, 8], 2.0, Dtype::F32).unwrap();
        let first = pool.slice_update(&ones, &[0, 0], &[1, 8], &[1, 1]).unwrap();
        drop(pool);
        let second = first
            .slice_update(&twos, &[1, 0], &[2, 8], &[1, 1])
            .unwrap();
        drop(first);
        let out = match fused {
            true => fuse_graph(&[&second]).unwrap().remove(0),
            false => second,
        };
        eval(&[&out]).unwrap();
        assert_eq!(out.buffer_id(), id, "fused: {fused}");
        let want: Vec<f32> = [1.0f32; 8].into_iter().chain([2.0; 8]).collect();
        assert_eq!(out.to_vec::<f32>().unwrap(), want);
    }
}
