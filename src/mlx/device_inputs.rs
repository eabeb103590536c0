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
//! a view of the copy. Other backends get the host arrays as they are.
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
            Array::from_slice(&all, &[n as i32])?.copy_to_stream(stream)?
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

/// At least `len` int32 zeros (a 1-D array) that land in device memory on CUDA: a kernel's
/// own counts, which its blocks update with atomics. MLX keeps results of 8 bytes or less
/// in unified memory, where every atomic add was a page round trip (a kernel of two stages
/// counting its blocks with 2 int32 ran them one after another, ~1.6 µs each, on an H100;
/// docs/benchmarks.md, "The MLP in one kernel"), so the array has at least [`MIN_LEN`]
/// elements. Not evaluated (the callers evaluate it with the rest of their scratch).
pub fn counts_i32(len: usize) -> Result<Array> {
    Array::zeros(&[len.max(MIN_LEN) as i32], Dtype::I32)
}

/// `a` copied into device memory on CUDA (a copy op on the GPU stream, evaluated): an
/// array made from host data (a loaded weight, a table computed on the host) lives in
/// unified memory, and a small one may share its pages with arrays the host writes while
/// the device runs a step, so that a kernel reading it every layer would take page faults
/// (see the module docs). Elsewhere, and for arrays of 8 bytes or less (MLX keeps every
/// such result in unified memory), `a` itself.
pub fn device_copy(a: &Array) -> Result<Array> {
    if backend() != Backend::Cuda || a.nbytes() <= 8 {
        return Ok(a.clone());
    }
    let d = a.copy_to_stream(&Stream::default_for(true)?)?;
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
