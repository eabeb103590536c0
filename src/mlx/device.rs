//! Devices and streams: what MLX sees, and where work runs.
//!
//! MLX 0.32.4 cannot drive two GPUs from one process (allocator cache, JIT
//! cache and fences ignore the device; no peer copy), so mlxcel runs one
//! process per GPU. The device-indexed calls here still check indices, so a
//! wrong index is a typed [`MlxError::InvalidGpuIndex`] instead of MLX's
//! `std::out_of_range` or a silent fall-back to GPU 0.
use std::fmt;
use std::marker::PhantomData;

use super::ffi::ffi;
use super::{MlxError, Result};

/// Which MLX build the process runs on (decided by the loaded `libmlx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
    Metal,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Metal => "metal",
        })
    }
}

/// The backend of the `libmlx` loaded at run time (not the one linked at build time).
pub fn backend() -> Backend {
    match ffi::backend_name().as_str() {
        "cuda" => Backend::Cuda,
        "metal" => Backend::Metal,
        _ => Backend::Cpu,
    }
}

/// MLX's version string, e.g. `0.32.4`.
pub fn version() -> String {
    ffi::mlx_version()
}

/// The file of the MLX library loaded in this process (`None` if the loader does not say).
pub fn library_path() -> Option<std::path::PathBuf> {
    Some(ffi::mlx_library_path())
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
}

/// Number of GPUs MLX can use in this process (0 on the CPU backend).
pub fn gpu_device_count() -> usize {
    ffi::gpu_device_count().max(0) as usize
}

fn check_index(index: i32) -> Result<()> {
    let count = ffi::gpu_device_count();
    if index < 0 || index >= count {
        return Err(MlxError::InvalidGpuIndex { index, count });
    }
    Ok(())
}

/// One GPU as MLX describes it.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub index: i32,
    pub name: String,
    pub architecture: String,
    pub total_memory: u64,
    /// Free memory (CUDA only; 0 where the backend does not say).
    pub free_memory: u64,
    pub pci_bus_id: String,
    pub uuid: String,
}

/// Information about GPU `index`.
pub fn device_info(index: i32) -> Result<DeviceInfo> {
    check_index(index)?;
    let d = ffi::gpu_device_info(index)?;
    Ok(DeviceInfo {
        index,
        name: d.name,
        architecture: d.architecture,
        total_memory: d.total_memory,
        free_memory: d.free_memory,
        pci_bus_id: d.pci_bus_id,
        uuid: d.uuid,
    })
}

/// An MLX stream (a queue of work on one device). Not `Send`: streams belong to a thread.
#[derive(Clone, Copy)]
pub struct Stream {
    pub(super) raw: ffi::StreamRef,
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dev = if self.raw.gpu { "gpu" } else { "cpu" };
        write!(
            f,
            "Stream({}, {dev}:{})",
            self.raw.index, self.raw.device_index
        )
    }
}

impl Stream {
    fn from_raw(raw: ffi::StreamRef) -> Stream {
        Stream {
            raw,
            _not_send: PhantomData,
        }
    }

    /// A new stream on the CPU.
    pub fn new_cpu() -> Result<Stream> {
        Ok(Stream::from_raw(ffi::new_cpu_stream()?))
    }

    /// This thread's default stream on the CPU (`gpu = false`) or the default GPU.
    pub fn default_for(gpu: bool) -> Result<Stream> {
        Ok(Stream::from_raw(ffi::default_stream_ref(gpu)?))
    }

    pub fn is_gpu(&self) -> bool {
        self.raw.gpu
    }

    /// Index of the device the stream runs on.
    pub fn device_index(&self) -> i32 {
        self.raw.device_index
    }

    /// Wait until all work queued on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        Ok(ffi::synchronize_stream(&self.raw)?)
    }
}

/// A new stream on GPU `index`.
pub fn new_stream_on_gpu(index: i32) -> Result<Stream> {
    check_index(index)?;
    Ok(Stream::from_raw(ffi::new_stream_on_gpu(index)?))
}

/// Make `stream` (and its device) the default for this thread.
pub fn set_default_stream(stream: &Stream) -> Result<()> {
    Ok(ffi::set_default_stream_ref(&stream.raw)?)
}

/// Make GPU `index` this thread's default device, with a fresh default stream on it.
///
/// MLX 0.32.4's `default_stream(Device(gpu, i))` drops the index, so this sets
/// the stream explicitly. Returns the new default stream.
pub fn set_default_gpu(index: i32) -> Result<Stream> {
    let s = new_stream_on_gpu(index)?;
    set_default_stream(&s)?;
    Ok(s)
}

/// Make the CPU this thread's default device.
pub fn set_default_cpu() -> Result<()> {
    Ok(ffi::set_default_device_cpu()?)
}

/// Wait for all work queued on this thread's default stream.
pub fn synchronize() -> Result<()> {
    Ok(ffi::synchronize_default()?)
}
