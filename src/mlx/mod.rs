//! Safe Rust API over MLX (through the `cxx` bridge in [`ffi`]).
//!
//! Owns: the [`Array`] type and its operations, devices and streams,
//! memory statistics, random numbers and distributed groups. Every MLX call
//! that can throw returns [`Result`]; a C++ exception becomes [`MlxError::Mlx`].
//!
//! MLX keeps default streams, random state, `compile` caches and CUDA command
//! encoders per thread, so [`Array`], [`Stream`] and [`Group`] are neither
//! `Send` nor `Sync`: all MLX work of a process happens on one thread (the
//! engine thread); other threads talk to it over channels.

mod array;
mod device;
pub mod device_inputs;
pub mod distributed;
pub mod fast;
mod ffi;
pub mod graph;
pub mod host_fill;
pub mod host_written;
pub mod kernel_cache;
pub mod memory;
mod ops;
pub mod random;

pub use array::{Array, Element};
pub use device::{
    backend, device_info, gpu_device_count, library_path, new_stream_on_gpu, set_default_cpu,
    set_default_gpu, set_default_stream, synchronize, version, Backend, DeviceInfo, Stream,
};
pub use ffi::ffi::Dtype;
pub use ops::{
    async_eval, concatenate, eval, eval_fresh, fuse_graph, launch_chain_unavailable,
    split_sections, stack, where_,
};

/// Errors from the MLX layer.
#[derive(Debug, thiserror::Error)]
pub enum MlxError {
    /// MLX threw a C++ exception; its message is kept.
    #[error("MLX error: {0}")]
    Mlx(String),
    /// A GPU index outside `0..count`.
    #[error("invalid GPU index {index}: {count} GPU(s) visible to this process")]
    InvalidGpuIndex { index: i32, count: i32 },
    /// An array had another element type than the caller asked for.
    #[error("{what}: array has dtype {actual:?}, expected {expected:?}")]
    DtypeMismatch {
        what: &'static str,
        expected: Dtype,
        actual: Dtype,
    },
    /// Arguments that MLX would reject or misread, caught before the call.
    #[error("{0}")]
    Invalid(String),
}

impl From<cxx::Exception> for MlxError {
    fn from(e: cxx::Exception) -> Self {
        MlxError::Mlx(e.what().to_string())
    }
}

/// Result of an MLX operation.
pub type Result<T> = std::result::Result<T, MlxError>;

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::I64 => 8,
            _ => 0,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::BF16 | Dtype::F32)
    }

    /// The dtype named as in safetensors headers / `config.json` `torch_dtype`.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Some(match name {
            "BOOL" | "bool" => Dtype::Bool,
            "U8" | "uint8" => Dtype::U8,
            "U16" | "uint16" => Dtype::U16,
            "U32" | "uint32" => Dtype::U32,
            "I8" | "int8" => Dtype::I8,
            "I32" | "int32" => Dtype::I32,
            "I64" | "int64" => Dtype::I64,
            "F16" | "float16" | "half" => Dtype::F16,
            "BF16" | "bfloat16" => Dtype::BF16,
            "F32" | "float32" | "float" => Dtype::F32,
            _ => return None,
        })
    }

    /// Lower-case name (`bfloat16`, `float32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8",
            Dtype::U16 => "uint16",
            Dtype::U32 => "uint32",
            Dtype::I8 => "int8",
            Dtype::I32 => "int32",
            Dtype::I64 => "int64",
            Dtype::F16 => "float16",
            Dtype::BF16 => "bfloat16",
            Dtype::F32 => "float32",
            _ => "unsupported",
        }
    }
}

#[cfg(test)]
mod tests;
