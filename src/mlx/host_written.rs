//! Arrays whose elements the host writes after the graphs that read them are built, and
//! before any of those graphs is evaluated: a decode step's token masks, computed on other
//! threads while the engine thread builds the step's sampling and the next forward pass
//! on top of them, then evaluated together once the masks are written.
//!
//! The array is a constant (no op) in the allocator's host-visible memory (unified memory
//! on CUDA, as every array made from host data): building ops on it reads only its shape
//! and type, so another thread may write its elements meanwhile. Nothing waits on the
//! device (compare [`super::host_fill`], whose reads wait there for the host).
use super::ffi::ffi;
use super::{Array, Element, MlxError, Result};

/// An array of `T` the host writes in place (see the module docs).
pub struct HostWritten<T: Element> {
    array: Array,
    ptr: *mut T,
    len: usize,
}

impl<T: Element> HostWritten<T> {
    /// A `[shape]` array with every byte of its elements `byte` (`0xFF`: all bits set).
    pub fn filled(shape: &[i32], byte: u8) -> Result<HostWritten<T>> {
        let array = Array::from_ptr(ffi::host_bytes(shape, T::DTYPE, byte)?);
        let len = array.size();
        let addr = ffi::host_data_address(array.raw())?;
        if len > 0 && addr % std::mem::align_of::<T>() as u64 != 0 {
            return Err(MlxError::Invalid(format!(
                "host-written array at {addr:#x} is not aligned for its elements"
            )));
        }
        Ok(HostWritten {
            array,
            ptr: addr as usize as *mut T,
            len,
        })
    }

    /// The array, to build graphs on, and its elements, to write meanwhile (from any
    /// thread: the slice is `Send`).
    ///
    /// # Safety
    /// No graph that reads the array may be evaluated (`eval`, `async_eval`, reading an
    /// output back) while the slice is alive: MLX would read the elements as they are
    /// written. Building graphs on the array is fine.
    pub unsafe fn parts(&mut self) -> (&Array, &mut [T]) {
        let data = if self.len == 0 {
            &mut []
        } else {
            // SAFETY: `ptr` is the array's own row-contiguous buffer of `len` elements,
            // which lives as long as the array (held by `self`); `&mut self` makes this the
            // only slice of it, and the caller keeps MLX from reading it meanwhile.
            std::slice::from_raw_parts_mut(self.ptr, self.len)
        };
        (&self.array, data)
    }

    /// The array (the elements as written so far).
    pub fn array(&self) -> &Array {
        &self.array
    }
}
