//! Arrays whose contents the host gives after the graphs that read them are queued: a
//! decode step's token masks, computed on the host while the device runs the step, so
//! that the step's sampling and the next forward pass can be queued before the masks
//! exist. The array is evaluated on a CPU stream of the calling thread's own, whose task
//! waits until [`HostFill::provide`] (or the drop of the [`HostFill`], or the timeout:
//! zeros then); a GPU op that reads it in a later [`super::async_eval`] waits on the device
//! (MLX's cross-stream event), so the host goes on building. See `cpp/shim.h`.
//!
//! Read it only from an evaluation started after it was made (as every later graph is):
//! one `eval` of a graph holding both a new `HostFill` array and a wait for it on the host
//! would wait for the host that is evaluating. Worth it on a GPU only: on the CPU backend
//! the reading graph's ops queue behind the fill on MLX's CPU tasks, and an evaluation
//! that queues more than MLX's 10 active tasks waits on the host for them (so for the
//! fill, until its timeout).
use std::time::Duration;

use cxx::UniquePtr;

use super::ffi::ffi;
use super::{Array, Element, Result};

/// An array queued now, filled later (see the module docs).
pub struct HostFill {
    raw: UniquePtr<ffi::HostFill>,
    given: bool,
}

// SAFETY: the C++ side's `provide` and `cancel` take the slot's mutex, and its array is
// only read (cloned) by `array`, on the thread that made it (MLX arrays are per thread);
// a `HostFill` may be given its contents from another thread.
unsafe impl Send for HostFill {}

impl HostFill {
    /// A `[shape]` array of `T`, filled by [`HostFill::provide`] within `timeout`
    /// (zeros after it, or when dropped unfilled).
    pub fn new<T: Element>(shape: &[i32], timeout: Duration) -> Result<HostFill> {
        Ok(HostFill {
            raw: ffi::host_fill_new(shape, T::DTYPE, timeout.as_secs_f64())?,
            given: false,
        })
    }

    /// The array (its values once given).
    pub fn array(&self) -> Array {
        Array::from_ptr(ffi::host_fill_array(&self.raw))
    }

    /// Give the contents: exactly the array's elements, of its type. `Ok(false)` when the
    /// wait had ended already (the timeout: the array holds zeros), or they were given.
    pub fn provide<T: Element>(&mut self, data: &[T]) -> Result<bool> {
        // SAFETY: T is a plain numeric type (or bool, one byte 0/1), so its bytes are initialised.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
        };
        let given = ffi::host_fill_provide(&self.raw, bytes)?;
        self.given = true;
        Ok(given)
    }
}

impl Drop for HostFill {
    fn drop(&mut self) {
        if !self.given {
            ffi::host_fill_cancel(&self.raw);
        }
    }
}
