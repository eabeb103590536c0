//! MLX allocator statistics and limits (bytes), for the current process.
use super::ffi::ffi;

/// Bytes in arrays that are alive now.
pub fn active() -> u64 {
    ffi::active_memory()
}

/// Highest `active()` since start or the last [`reset_peak`].
pub fn peak() -> u64 {
    ffi::peak_memory()
}

/// Bytes held in the allocator's cache (freed arrays not yet returned).
pub fn cache() -> u64 {
    ffi::cache_memory()
}

pub fn reset_peak() {
    ffi::reset_peak_memory()
}

/// Set the memory limit that graph evaluation tries to stay under; returns the previous one.
pub fn set_limit(bytes: u64) -> u64 {
    ffi::set_memory_limit(bytes)
}

pub fn limit() -> u64 {
    ffi::memory_limit()
}

/// Set how much freed memory the allocator may keep cached; returns the previous limit.
pub fn set_cache_limit(bytes: u64) -> u64 {
    ffi::set_cache_limit(bytes)
}

/// Return cached buffers to the system.
pub fn clear_cache() {
    ffi::clear_cache()
}
