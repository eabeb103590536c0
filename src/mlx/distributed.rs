//! MLX distributed groups and the two collectives the TP path uses.
//!
//! Backends: `nccl` (reads `MLX_RANK`, `MLX_WORLD_SIZE`, `NCCL_HOST_IP`,
//! `NCCL_PORT`; one GPU per rank; on any NCCL/CUDA error MLX calls `exit(1)`)
//! and `ring` (reads `MLX_HOSTFILE`, `MLX_RANK`; TCP over loopback; runs
//! several ranks on one device). Ring has no `sum_scatter` and neither
//! supports send/recv here, so tensor parallelism uses only `all_sum` and
//! `all_gather`.
use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;

use cxx::UniquePtr;

use super::ffi::ffi;
use super::{Array, MlxError, Result, Stream};

/// A distributed backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBackend {
    Any,
    Nccl,
    Ring,
}

impl GroupBackend {
    pub fn name(self) -> &'static str {
        match self {
            GroupBackend::Any => "any",
            GroupBackend::Nccl => "nccl",
            GroupBackend::Ring => "ring",
        }
    }
}

impl fmt::Display for GroupBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GroupBackend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "any" => Ok(GroupBackend::Any),
            "nccl" => Ok(GroupBackend::Nccl),
            "ring" => Ok(GroupBackend::Ring),
            _ => Err(format!(
                "unknown distributed backend `{s}` (expected any, nccl or ring)"
            )),
        }
    }
}

/// Whether MLX was built with this backend.
pub fn is_available(backend: GroupBackend) -> bool {
    ffi::distributed_available(backend.name())
}

/// A group of processes that reduce together. Not `Send`.
pub struct Group {
    ptr: UniquePtr<ffi::Group>,
    backend: GroupBackend,
    _not_send: PhantomData<*const ()>,
}

/// Join the group described by the environment (see the module docs).
///
/// With `strict`, a failed initialisation is an error; without it MLX returns
/// a size-1 group whose collectives are no-ops, so callers that expect N ranks
/// must check [`Group::size`].
pub fn init(backend: GroupBackend, strict: bool) -> Result<Group> {
    let ptr = ffi::distributed_init(backend.name(), strict)?;
    Ok(Group {
        ptr,
        backend,
        _not_send: PhantomData,
    })
}

impl Group {
    fn raw(&self) -> &ffi::Group {
        self.ptr.as_ref().expect("Group is never null")
    }

    pub fn rank(&self) -> i32 {
        ffi::group_rank(self.raw())
    }

    pub fn size(&self) -> i32 {
        ffi::group_size(self.raw())
    }

    pub fn backend(&self) -> GroupBackend {
        self.backend
    }

    /// The stream collectives run on: the CPU for ring (its transport is host
    /// sockets), the default device's stream otherwise.
    fn stream(&self) -> Result<Stream> {
        match self.backend {
            GroupBackend::Ring => Stream::default_for(false),
            _ => Stream::default_for(super::gpu_device_count() > 0),
        }
    }

    /// Element-wise sum of `x` over all ranks; every rank gets the result.
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        let s = self.stream()?;
        Ok(Array::from_ptr(ffi::all_sum(x.raw(), self.raw(), &s.raw)?))
    }

    /// Concatenation of every rank's `x` along axis 0, in rank order.
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        let s = self.stream()?;
        Ok(Array::from_ptr(ffi::all_gather(
            x.raw(),
            self.raw(),
            &s.raw,
        )?))
    }

    /// Check that the group has the expected size (a failed init gives size 1).
    pub fn expect_size(&self, n: i32) -> Result<()> {
        if self.size() != n {
            return Err(MlxError::Invalid(format!(
                "distributed group ({}) has {} rank(s), expected {n}",
                self.backend,
                self.size()
            )));
        }
        Ok(())
    }
}
