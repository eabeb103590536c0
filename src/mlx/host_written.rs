//! Arrays whose elements the host writes after the graphs that read them are built, and
//! before any of those graphs is evaluated: a decode step's token masks, computed on other
//! threads while the engine thread builds the step's sampling and the next forward pass
//! on top of them, then evaluated together once the masks are written.
//!
//! The array is a constant (no op) in the allocator's host-visible memory (unified memory
//! on CUDA, as every array made from host data): building ops on it reads only its shape
//! and type, so another thread may write its elements meanwhile, all of them, before it
//! is evaluated (the first write, [`Writer::fill`], sets every byte; on CUDA that also
//! moves the memory's pages to the host on that thread, not on the one building).
//! Nothing waits on the device (compare [`super::host_fill`], whose reads wait there for
//! the host).
use std::marker::PhantomData;

use super::ffi::ffi;
use super::{Array, Element, MlxError, Result};

/// An array of `T` the host writes in place (see the module docs).
pub struct HostWritten<T: Element> {
    array: Array,
    ptr: *mut T,
    len: usize,
}

/// The elements of a [`HostWritten`] array, to write from any thread.
pub struct Writer<'a, T> {
    ptr: *mut T,
    len: usize,
    _elements: PhantomData<&'a mut [T]>,
}

// SAFETY: a `Writer` is the only access to the elements it covers while it lives (it
// borrows its `HostWritten` mutably), like a `&mut [T]`.
unsafe impl<T: Send> Send for Writer<'_, T> {}

impl<'a, T: Element> Writer<'a, T> {
    /// Set every byte of the elements to `byte` (`0xFF`: all bits set), then write them.
    pub fn fill(self, byte: u8) -> &'a mut [T] {
        assert!(
            T::DTYPE != super::Dtype::Bool || byte <= 1,
            "a bool is 0 or 1, not {byte:#x}"
        );
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `ptr` is the array's own row-contiguous buffer of `len` elements, which
        // lives as long as the `HostWritten` this borrows; once every byte is set, `T` (a
        // plain number, or a bool of 0/1 where `byte` is 0 or 1) is initialised.
        unsafe {
            std::ptr::write_bytes(self.ptr, byte, self.len);
            std::slice::from_raw_parts_mut(self.ptr, self.len)
        }
    }
}

impl<T: Element> HostWritten<T> {
    /// A `[shape]` array whose elements are written later (through [`HostWritten::parts`]).
    pub fn new(shape: &[i32]) -> Result<HostWritten<T>> {
        let array = Array::from_ptr(ffi::host_array(shape, T::DTYPE)?);
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

    /// The array, to build graphs on, and its elements, to write meanwhile.
    ///
    /// # Safety
    /// No graph that reads the array may be evaluated (`eval`, `async_eval`, reading an
    /// output back) while the writer or the slice it gives is alive, nor before the
    /// elements are written ([`Writer::fill`]): MLX would read them as they are written,
    /// or read memory never set. Building graphs on the array is fine.
    pub unsafe fn parts(&mut self) -> (&Array, Writer<'_, T>) {
        let writer = Writer {
            ptr: self.ptr,
            len: self.len,
            _elements: PhantomData,
        };
        (&self.array, writer)
    }

    /// The array.
    pub fn array(&self) -> &Array {
        &self.array
    }
}
