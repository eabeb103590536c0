//! The CUDA driver's functions mlxcel calls itself, from `libcuda.so.1` (which MLX's CUDA
//! backend links; its CUDA runtime is linked statically, so the runtime's own functions
//! are not in the process's symbols).
use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

/// The driver library's handle (loaded by MLX already, or now; never closed), or `None`
/// where there is none (no NVIDIA driver: the CPU and Metal builds).
pub fn libcuda() -> Option<*mut c_void> {
    static LIB: OnceLock<usize> = OnceLock::new();
    let h = *LIB.get_or_init(|| {
        // SAFETY: a NUL-terminated name; RTLD_NOLOAD finds the library MLX loaded.
        unsafe {
            let name = c"libcuda.so.1".as_ptr();
            let h = libc::dlopen(name, libc::RTLD_NOW | libc::RTLD_NOLOAD);
            let h = if h.is_null() {
                libc::dlopen(name, libc::RTLD_NOW)
            } else {
                h
            };
            h as usize
        }
    });
    (h != 0).then_some(h as *mut c_void)
}

/// Function `name` of the library `lib` as a function pointer of type `F`.
///
/// # Safety
/// `lib` is a live `dlopen` handle and `F` the function's real type.
pub unsafe fn sym<F: Copy>(lib: *mut c_void, name: &CStr) -> Option<F> {
    let p = libc::dlsym(lib, name.as_ptr());
    (!p.is_null()).then(|| std::mem::transmute_copy::<*mut c_void, F>(&p))
}

type CtxGetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> i32;
type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> i32;

/// Whether this thread has a current CUDA context (`cuCtxGetCurrent`; none is made
/// here); `None` where the driver lacks the function.
fn has_context(lib: *mut c_void) -> Option<bool> {
    // SAFETY: the CUDA driver's function of this type (cuda.h), an out-pointer to a local.
    unsafe {
        let ctx_get_current: CtxGetCurrent = sym(lib, c"cuCtxGetCurrent")?;
        let mut ctx: *mut c_void = std::ptr::null_mut();
        Some(ctx_get_current(&mut ctx) == 0 && !ctx.is_null())
    }
}

/// The free and total memory of the GPU of this thread's current CUDA context, as the
/// driver reports them to this process (`cuMemGetInfo`: what allocations can still get,
/// which NVML's device-wide numbers, MLX's `device_info`, overstate by the memory the
/// driver reserves); `None` without a driver or a current context (none is made here).
pub fn mem_info() -> Option<(u64, u64)> {
    let lib = libcuda()?;
    if !has_context(lib)? {
        return None;
    }
    // SAFETY: the CUDA driver's function of this type (cuda.h), out-pointers to locals.
    unsafe {
        let mem_get_info: MemGetInfo = sym(lib, c"cuMemGetInfo_v2")?;
        let (mut free, mut total) = (0usize, 0usize);
        (mem_get_info(&mut free, &mut total) == 0).then_some((free as u64, total as u64))
    }
}

type ProfilerToggle = unsafe extern "C" fn() -> i32;

/// Open (`on`) or close the CUDA profiler's capture range on this thread's context
/// (`cuProfilerStart` / `cuProfilerStop`): under `ncu --profile-from-start off` (or a
/// profiler capturing the `cudaProfilerApi` range) only the work queued in between is
/// profiled. An error says why not (no driver, no current context, the call's status).
pub fn profiler(on: bool) -> Result<(), String> {
    let lib = libcuda().ok_or("no CUDA driver (libcuda.so.1)")?;
    let name = if on {
        c"cuProfilerStart"
    } else {
        c"cuProfilerStop"
    };
    if !has_context(lib).ok_or("no cuCtxGetCurrent in the driver")? {
        return Err("no current CUDA context on this thread".into());
    }
    // SAFETY: the CUDA driver's function of this type (cudaProfiler.h).
    unsafe {
        let toggle: ProfilerToggle =
            sym(lib, name).ok_or_else(|| format!("no {} in the driver", name.to_string_lossy()))?;
        match toggle() {
            0 => Ok(()),
            e => Err(format!("{} returned {e}", name.to_string_lossy())),
        }
    }
}
