//! Small int32 arrays that a step's kernels read (positions, KV write rows, block
//! tables), placed in device memory on CUDA.
//!
//! MLX's CUDA allocator puts every array made from host data in unified (managed) memory,
//! and every result of 8 bytes or less too (a pool of managed pages shared by all such
//! scalars). A kernel that reads such a page after the host wrote to it, or to any other
//! scalar on it, takes a page fault and a migration to the GPU. The host writes new ones
//! while the device runs a step (the next step's graph is built meanwhile), so every
//! layer's kernel that read the step's position faulted: on one H100 the q/k/v kernel of a
//! 70B TP=8 rank took 28-30 µs of each layer where reading its weight takes 9.4, and the
//! decode attention kernel 23 µs (docs/benchmarks.md, "Step inputs in device memory").
//!
//! [`device_i32_parts`] makes them results of device ops of more than 8 bytes, which MLX
//! allocates in device memory: a run of consecutive values (a single sequence's position)
//! as an `arange`, which reads no memory at all; anything else through one copy of one
//! host array holding all the parts (one fault for the step, in that copy), each part then
//! a view of the copy. The copy is an op that computes (`· 1`, [`materialized`]): MLX's own
//! copy op shares its input's buffer, so it would leave every such input in the unified
//! host array. Other backends get the host arrays as they are.
//!
//! That host array is one of a few kept from step to step ([`set_staging`], on by
//! default), rewritten once the device has run the copy that read it last. A new one each
//! step comes from MLX's buffer cache, which hands out any cached buffer of about the size
//! asked, device memory too; MLX then moves such a buffer to unified memory with a new
//! managed allocation and a synchronous `cudaMemcpy`, on the thread building the step.
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

use super::host_written::HostWritten;
use super::{backend, Array, Backend, Dtype, Result, Stream};

/// Elements of a device array: MLX's results of at most 8 bytes are unified memory.
const MIN_LEN: usize = 3;

/// `parts` (values and shape each) as arrays the device reads from its own memory on
/// CUDA (see the module docs); as host arrays elsewhere.
pub fn device_i32_parts(parts: &[(&[i32], &[i32])]) -> Result<Vec<Array>> {
    if backend() != Backend::Cuda {
        return parts.iter().map(|(v, s)| Array::from_slice(v, s)).collect();
    }
    made_by_ops(parts, &Stream::default_for(true)?)
}

/// `parts` as views of one array made by ops on `stream` (an `arange`, or a copy there).
fn made_by_ops(parts: &[(&[i32], &[i32])], stream: &Stream) -> Result<Vec<Array>> {
    let mut all: Vec<i32> = parts.iter().flat_map(|(v, _)| v.iter().copied()).collect();
    let n = all.len().max(MIN_LEN);
    let consecutive = all.windows(2).all(|w| w[0].checked_add(1) == Some(w[1]));
    let dev = match all.first() {
        Some(&v0) if consecutive => {
            let v0 = v0 as f64;
            Array::arange(v0, v0 + n as f64, 1.0, Dtype::I32)?
        }
        _ => {
            all.resize(n, 0);
            staged_copy(&all, stream)?
        }
    };
    let mut out = Vec::with_capacity(parts.len());
    let mut at = 0;
    for (v, s) in parts {
        let end = at + v.len() as i32;
        out.push(dev.slice_axis(0, at, end)?.reshape(s)?);
        at = end;
    }
    Ok(out)
}

/// `a` computed anew into a buffer of its own by an op on `stream` (on a GPU stream, device
/// memory): `a · 1`, exact for every value. (MLX's copy op shares its input's buffer, on
/// every backend, so a copy of a host array is that host array.)
fn materialized(a: &Array, stream: &Stream) -> Result<Array> {
    a.copy_to_stream(stream)?.mul_scalar(1.0)
}

/// Whether [`made_by_ops`] writes its values into the kept host arrays (`MLXCEL_STEP_STAGING`).
static STAGING: AtomicBool = AtomicBool::new(true);

/// Turn the kept host arrays of the step inputs on or off (for A/B runs).
pub fn set_staging(on: bool) {
    STAGING.store(on, Ordering::Relaxed);
}

/// Most host arrays a thread keeps for [`staged_copy`]: a decode step uses one, and at
/// most two steps are in flight; a graph built and dropped unevaluated leaves its array
/// waiting for a copy that never runs (see [`staged_copy`]).
const STAGED_MAX: usize = 8;

/// Fewest elements of a kept host array.
const STAGED_MIN_LEN: usize = 1024;

/// A kept host array and the copy that reads it last (none yet: free).
struct Staged {
    host: HostWritten<i32>,
    reader: Option<Array>,
}

thread_local! {
    // per thread, as MLX's streams are
    static STAGED: RefCell<Vec<Staged>> = const { RefCell::new(Vec::new()) };
}

/// `values` copied on `stream`, from a kept host array whose last copy has run (see the
/// module docs), or from a new host array where none is free and no more may be kept.
fn staged_copy(values: &[i32], stream: &Stream) -> Result<Array> {
    let n = values.len();
    if !STAGING.load(Ordering::Relaxed) {
        return materialized(&Array::from_slice(values, &[n as i32])?, stream);
    }
    STAGED.with(|cell| {
        let mut kept = cell.borrow_mut();
        let free = |s: &Staged| {
            s.host.array().size() >= n && s.reader.as_ref().is_none_or(Array::is_available)
        };
        let i = match kept.iter().position(free) {
            Some(i) => i,
            None => {
                if kept.len() >= STAGED_MAX {
                    // the arrays whose copy was never evaluated (its graph may have been
                    // dropped) are given up: never written again, so a graph that still
                    // holds one reads what it was given
                    kept.retain(|s| s.reader.as_ref().is_none_or(|r| r.is_scheduled()));
                }
                if kept.len() >= STAGED_MAX {
                    return materialized(&Array::from_slice(values, &[n as i32])?, stream);
                }
                let len = n.next_power_of_two().max(STAGED_MIN_LEN);
                kept.push(Staged {
                    host: HostWritten::new(&[len as i32])?,
                    reader: None,
                });
                kept.len() - 1
            }
        };
        let s = &mut kept[i];
        // SAFETY: the only graphs that read this host array are the copies made here, and
        // the last one has run (`is_available`: evaluated and its event signalled, so every
        // earlier one has too) or there is none; the new copy is built after the write.
        unsafe {
            let (_, writer) = s.host.parts();
            writer.fill(0)[..n].copy_from_slice(values);
        }
        let copy = materialized(&s.host.array().slice_axis(0, 0, n as i32)?, stream)?;
        s.reader = Some(copy.clone());
        Ok(copy)
    })
}

/// At least `len` int32 zeros (a 1-D array) that land in device memory on CUDA: a kernel's
/// own counts, which its blocks update with atomics. MLX keeps results of 8 bytes or less
/// in unified memory, where every atomic add was a page round trip (a kernel of two stages
/// counting its blocks with 2 int32 ran them one after another, ~1.6 µs each, on an H100;
/// docs/benchmarks.md, "The MLP in one kernel"), so the array has at least [`MIN_LEN`]
/// elements. Not evaluated (the callers evaluate it with the rest of their scratch).
pub fn counts_i32(len: usize) -> Result<Array> {
    Array::zeros(&[len.max(MIN_LEN) as i32], Dtype::I32)
}

/// `a` copied into device memory on CUDA ([`materialized`] on the GPU stream, evaluated): an
/// array made from host data (a loaded weight, a table computed on the host) lives in
/// unified memory, and a small one may share its pages with arrays the host writes while
/// the device runs a step, so that a kernel reading it every layer would take page faults
/// (see the module docs). Elsewhere, and for arrays of 8 bytes or less (MLX keeps every
/// such result in unified memory), `a` itself.
pub fn device_copy(a: &Array) -> Result<Array> {
    if backend() != Backend::Cuda || a.nbytes() <= 8 {
        return Ok(a.clone());
    }
    let d = materialized(a, &Stream::default_for(true)?)?;
    d.eval()?;
    Ok(d)
}

/// One array of `values` shaped `shape` (see [`device_i32_parts`]).
pub fn device_i32(values: &[i32], shape: &[i32]) -> Result<Array> {
    let mut v = device_i32_parts(&[(values, shape)])?;
    Ok(v.pop().expect("one part"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept host array is rewritten only once the copy that read it has run: copies
    /// still to be evaluated keep their values whatever is staged after them, and one that
    /// has run frees its array for the next (no new one is kept for it).
    #[test]
    fn staged_copies_keep_their_values_until_they_have_run() {
        let cpu = Stream::new_cpu().unwrap();
        let kept = || STAGED.with(|c| c.borrow().len());
        let before = kept();
        let a = staged_copy(&[1, 2, 3], &cpu).unwrap();
        let b = staged_copy(&[4, 5, 6, 7], &cpu).unwrap();
        assert_eq!(
            kept(),
            before + 2,
            "a's array is still to be read: b gets another"
        );
        assert_eq!(b.to_vec::<i32>().unwrap(), [4, 5, 6, 7]);
        assert_eq!(a.to_vec::<i32>().unwrap(), [1, 2, 3]);
        let c = staged_copy(&[8, 9], &cpu).unwrap();
        assert_eq!(kept(), before + 2, "a and b have run: c reuses an array");
        assert_eq!(c.to_vec::<i32>().unwrap(), [8, 9]);
        assert_eq!(a.to_vec::<i32>().unwrap(), [1, 2, 3]);
        // copies that are never evaluated: once every kept array waits for one, those
        // arrays are given up and new ones kept, and nothing a pending copy reads changes
        let pending: Vec<Array> = (0..STAGED_MAX as i32)
            .map(|i| staged_copy(&[100 + i], &cpu).unwrap())
            .collect();
        let d = staged_copy(&[42, 43], &cpu).unwrap();
        assert_eq!(d.to_vec::<i32>().unwrap(), [42, 43]);
        for (i, p) in pending.iter().enumerate() {
            assert_eq!(p.to_vec::<i32>().unwrap(), [100 + i as i32]);
        }
        assert!(kept() <= STAGED_MAX);
    }

    /// Every part comes back with its values and shape, from an `arange` (one value, or a
    /// run) or from the copy (anything else), padded or not.
    #[test]
    fn parts_come_back_as_given() {
        let cpu = Stream::new_cpu().unwrap();
        let cases: [&[(&[i32], &[i32])]; 4] = [
            &[(&[7], &[])],
            &[(&[7], &[1]), (&[8, 9], &[2])],
            &[(&[5, 3], &[2]), (&[40, 41, 40, 9], &[2, 2])],
            &[(&[-3], &[1, 1]), (&[100], &[1])],
        ];
        for parts in cases {
            let got = made_by_ops(parts, &cpu).unwrap();
            assert_eq!(got.len(), parts.len());
            for (a, (v, s)) in got.iter().zip(parts) {
                assert_eq!(a.shape(), s.to_vec(), "{parts:?}");
                assert_eq!(a.dtype(), Dtype::I32);
                assert_eq!(a.to_vec::<i32>().unwrap(), v.to_vec(), "{parts:?}");
            }
        }
    }
}
