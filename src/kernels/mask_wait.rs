//! A constrained decode step's token masks given by the host after the step is queued,
//! without MLX's CPU-to-GPU events: the host writes the masks' words and then a flag into
//! page-locked memory the GPU can read (the CUDA driver's `cuMemHostAlloc`, mapped), and
//! `kernels/mask_wait.cu`, queued where the sampling needs the masks, polls the flag
//! and copies the words. The host needs no CUDA call to give them, so nothing it does can
//! wait behind the polling kernel. (MLX's cross-stream event for this, a spinning kernel
//! on managed memory signalled from a CPU stream, is known to lose updates and to block
//! `cudaFree`: ml-explore/mlx #2229, #2391.) CUDA only; [`MaskBuffer::new`] says `None`
//! elsewhere.
use std::ffi::c_void;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::OnceLock;

use super::driver::{libcuda, sym};
use super::qgemv::one_body_kernel;
use crate::mlx::fast::CudaKernel;
use crate::mlx::{self, Array, Backend, Dtype, Result};

const SOURCE: &str = include_str!("../../kernels/mask_wait.cu");

type MemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, u32) -> i32;
type MemHostGetDevicePointer = unsafe extern "C" fn(*mut u64, *mut c_void, u32) -> i32;
type MemFreeHost = unsafe extern "C" fn(*mut c_void) -> i32;
type CtxGetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> i32;
type DeviceGet = unsafe extern "C" fn(*mut i32, i32) -> i32;
type PrimaryCtxRetain = unsafe extern "C" fn(*mut *mut c_void, i32) -> i32;
type CtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> i32;

/// The CUDA driver's functions this module needs, from `libcuda.so.1` (which MLX's CUDA
/// backend links; its runtime is static, so the runtime's own `cudaHostAlloc` is not
/// reachable).
struct Driver {
    alloc: MemHostAlloc,
    device_pointer: MemHostGetDevicePointer,
    free: MemFreeHost,
    ctx_get_current: CtxGetCurrent,
    device_get: DeviceGet,
    primary_ctx_retain: PrimaryCtxRetain,
    ctx_set_current: CtxSetCurrent,
}

fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Option<Driver>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let lib = libcuda()?;
            // SAFETY: each name is the CUDA driver's function of that type (cuda.h).
            unsafe {
                Some(Driver {
                    alloc: sym(lib, c"cuMemHostAlloc")?,
                    device_pointer: sym(lib, c"cuMemHostGetDevicePointer_v2")?,
                    free: sym(lib, c"cuMemFreeHost")?,
                    ctx_get_current: sym(lib, c"cuCtxGetCurrent")?,
                    device_get: sym(lib, c"cuDeviceGet")?,
                    primary_ctx_retain: sym(lib, c"cuDevicePrimaryCtxRetain")?,
                    ctx_set_current: sym(lib, c"cuCtxSetCurrent")?,
                })
            }
        })
        .as_ref()
}

impl Driver {
    /// Make device 0's primary context (MLX's) current on this thread if none is.
    fn ensure_context(&self) -> bool {
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointers to locals.
        unsafe {
            if (self.ctx_get_current)(&mut ctx) == 0 && !ctx.is_null() {
                return true;
            }
            let mut dev = 0i32;
            (self.device_get)(&mut dev, 0) == 0
                && (self.primary_ctx_retain)(&mut ctx, dev) == 0
                && (self.ctx_set_current)(ctx) == 0
        }
    }
}

/// Whether this process can make a [`MaskBuffer`]: CUDA, with the driver's functions.
pub fn available() -> bool {
    mlx::backend() == Backend::Cuda && driver().is_some()
}

/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`.
const HOST_ALLOC_FLAGS: u32 = 0x01 | 0x02;

/// How long the kernel waits for the host before giving up (`MLXCEL_MASK_TIMEOUT_NS` in
/// `kernels/mask_wait.cu`).
pub const TIMEOUT_SECS: u64 = 30;

/// Page-locked host memory of a flag word, a give-up word and `capacity` mask words,
/// mapped for the GPU, and the array of its device addresses the kernel reads (int64
/// `[3]`: flag, words, give-up word).
pub struct MaskBuffer {
    host: *mut u32,
    capacity: usize,
    addresses: Array,
    /// the flag's last value given
    seq: u32,
}

// SAFETY: the buffer is plain host memory; `give` (one writer at a time: it takes
// `&mut self`) writes the words, then the flag, as the kernel's protocol says.
unsafe impl Send for MaskBuffer {}

impl MaskBuffer {
    /// Room for `capacity` words, or `None` off CUDA (or when the runtime refuses).
    pub fn new(capacity: usize) -> Option<MaskBuffer> {
        if mlx::backend() != Backend::Cuda {
            return None;
        }
        let drv = driver()?;
        if !drv.ensure_context() {
            return None;
        }
        let bytes = 4 * (capacity + 2);
        let mut host: *mut c_void = std::ptr::null_mut();
        let mut dev: u64 = 0;
        // SAFETY: out-pointers to locals; the sizes are what is asked for.
        unsafe {
            if (drv.alloc)(&mut host, bytes, HOST_ALLOC_FLAGS) != 0 || host.is_null() {
                return None;
            }
            if (drv.device_pointer)(&mut dev, host, 0) != 0 || dev == 0 {
                (drv.free)(host);
                return None;
            }
            std::ptr::write_bytes(host.cast::<u8>(), 0, bytes);
        }
        let d = dev;
        let addresses =
            Array::from_slice(&[d as i64, (d + 8) as i64, (d + 4) as i64], &[3]).ok()?;
        mlx::eval(&[&addresses]).ok()?;
        Some(MaskBuffer {
            host: host.cast(),
            capacity,
            addresses,
            seq: 0,
        })
    }

    /// Words it holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// A `[rows, words, 1]` uint32 array of the words given for flag value `seq` (queued:
    /// the device waits for [`MaskBuffer::give`]). `rows · words` at most the capacity.
    pub fn read(&self, seq: u32, rows: usize, words: usize) -> Result<Array> {
        let n = rows * words;
        if n > self.capacity {
            return Err(mlx::MlxError::Invalid(format!(
                "mask_wait: {n} words for a buffer of {}",
                self.capacity
            )));
        }
        static KERNEL: OnceLock<(String, String, String)> = OnceLock::new();
        let (name, header, body) =
            KERNEL.get_or_init(|| one_body_kernel("mlxcel_mask_wait", "mask_wait.cu", SOURCE));
        static NAMES: OnceLock<([String; 2], [String; 1], [String; 1])> = OnceLock::new();
        let (inputs, outputs, tnames) = NAMES.get_or_init(|| {
            (
                ["src", "want"].map(String::from),
                ["out".to_string()],
                ["N".to_string()],
            )
        });
        let kernel = CudaKernel {
            name,
            input_names: inputs,
            output_names: outputs,
            header,
            body,
            shared_memory: 0,
        };
        let want = Array::from_slice(&[seq], &[1])?;
        let threads = 256i32;
        let blocks = (n.div_ceil(threads as usize) as i32).clamp(1, 64);
        let mut out = kernel.call(
            &[&self.addresses, &want],
            &[&[rows as i32, words as i32, 1]],
            Dtype::U32,
            tnames,
            &[n as i32],
            Dtype::U32,
            [blocks * threads, 1, 1],
            [threads, 1, 1],
        )?;
        Ok(out.remove(0))
    }

    /// Give the words for flag value `seq` (at most the capacity; the rest is not read).
    /// `Ok(false)` when the kernel had given up waiting for them (its step read zeros).
    pub fn give(&mut self, seq: u32, words: &[u32]) -> Result<bool> {
        if words.len() > self.capacity {
            return Err(mlx::MlxError::Invalid(format!(
                "mask_wait: {} words for a buffer of {}",
                words.len(),
                self.capacity
            )));
        }
        // SAFETY: `host` holds the flag (word 0), the give-up word (1) and capacity words
        // from word 2. The kernel reads the words only once it sees the flag at `seq`,
        // which is stored after a fence; the give-up word is read after another, so either
        // the kernel saw the flag or this sees that it gave up (kernels/mask_wait.cu).
        let gave_up = unsafe {
            std::ptr::copy_nonoverlapping(words.as_ptr(), self.host.add(2), words.len());
            fence(Ordering::SeqCst);
            (*self.host.cast::<AtomicU32>()).store(seq, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            (*self.host.add(1).cast::<AtomicU32>()).load(Ordering::SeqCst)
        };
        self.seq = seq;
        Ok(gave_up != seq)
    }
}

impl Drop for MaskBuffer {
    fn drop(&mut self) {
        if let Some(drv) = driver() {
            // SAFETY: allocated by `cuMemHostAlloc` in `new`.
            unsafe {
                (drv.free)(self.host.cast());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_file_has_its_markers() {
        let (header, body) = super::super::qgemv::header_and_body(SOURCE).unwrap();
        assert!(header.contains("mlxcel_globaltimer"));
        assert!(body.contains("want[0]") && body.contains("src[1]"));
    }

    #[test]
    fn a_buffer_exactly_where_cuda_has_the_driver() {
        assert_eq!(MaskBuffer::new(16).is_some(), available());
    }
}
