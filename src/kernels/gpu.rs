//! The GPU the kernels launch on (device 0 of this process), as their launch tables
//! key it: by compute capability, and by SM count where a launch's grid depends on it.
//!
//! MLX 0.32.4 reports a CUDA device's architecture (`sm_90`) but not its SM count, so
//! the count comes from [`SMS_BY_ARCH`], a table of architectures measured so far.
use std::sync::OnceLock;

use crate::mlx::{self, Backend};

/// What the launch tables need to know of the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpu {
    /// Compute capability × 10 (`sm_90` → 90); `None` off CUDA or when MLX does not say.
    pub cc: Option<u32>,
    /// Streaming multiprocessors, where [`SMS_BY_ARCH`] knows the architecture.
    pub sms: Option<usize>,
}

/// SMs per compute capability, for launches sized by SM count. sm_90: H200 and H100
/// SXM (132 SMs), where the streaming GEMV's grid was measured (docs/data/).
pub const SMS_BY_ARCH: &[(u32, usize)] = &[(90, 132)];

/// SMs a grid is sized for when the architecture is not in [`SMS_BY_ARCH`]: the sm_90
/// count, so such GPUs launch as the measured one does until they are measured.
pub const DEFAULT_SMS: usize = 132;

/// Blocks of the streaming GEMV per SM. On H200, the 8B down projection with 2 rows per
/// group and 14 warps: 12.1-13.1 µs at 2 blocks per SM (264), 14.9-15.2 at 3 (396),
/// 13.5-13.7 at 4 (528); the one-block-per-group launch took 14.4 (Nsight Compute,
/// docs/data/qgemv-stream-h200.txt).
pub const STREAM_BLOCKS_PER_SM: usize = 2;

impl Gpu {
    /// The GPU from MLX's architecture string (`None` off CUDA).
    pub fn from_arch(arch: Option<&str>) -> Gpu {
        let cc = arch.and_then(sm_version);
        let sms = cc.and_then(|c| SMS_BY_ARCH.iter().find(|(a, _)| *a == c).map(|&(_, n)| n));
        Gpu { cc, sms }
    }

    /// `cp.async` (compute capability ≥ 8.0): the streaming GEMV's shared-memory ring.
    pub fn has_cp_async(&self) -> bool {
        self.cc >= Some(80)
    }

    /// `mma.sync.m16n8k32` with int8 (compute capability ≥ 8.0): the tensor-core GEMV.
    pub fn has_int8_mma(&self) -> bool {
        self.cc >= Some(80)
    }

    /// `mma.sync.m16n8k16` with bf16 and f16 (compute capability ≥ 8.0): the quantized GEMM.
    pub fn has_bf16_mma(&self) -> bool {
        self.cc >= Some(80)
    }

    /// Shared memory an SM holds, in bytes (CUDA's per-SM capacity by compute capability:
    /// 228 KB on sm_90 and sm_100, 164 KB on sm_80/87, 100 KB otherwise, the smallest
    /// since sm_75 and what unknown GPUs get). A block may take all but 1 KB of it.
    pub fn shared_memory_per_sm(&self) -> usize {
        match self.cc {
            Some(90 | 100 | 103) => 228 * 1024,
            Some(80 | 87) => 164 * 1024,
            _ => 100 * 1024,
        }
    }

    /// The streaming GEMV's default grid: [`STREAM_BLOCKS_PER_SM`] per SM.
    pub fn streaming_grid(&self) -> usize {
        STREAM_BLOCKS_PER_SM * self.sms.unwrap_or(DEFAULT_SMS)
    }
}

/// This process's GPU 0 (asked of MLX once).
pub fn this_gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let arch = (mlx::backend() == Backend::Cuda)
            .then(|| mlx::device_info(0).ok().map(|d| d.architecture))
            .flatten();
        Gpu::from_arch(arch.as_deref())
    })
}

/// `sm_90` → 90 (MLX's device architecture string).
pub fn sm_version(arch: &str) -> Option<u32> {
    arch.trim()
        .strip_prefix("sm_")?
        .trim_end_matches(|c: char| c.is_ascii_alphabetic())
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_key_the_launches() {
        assert_eq!(sm_version("sm_90"), Some(90));
        assert_eq!(sm_version("sm_90a"), Some(90));
        assert_eq!(sm_version("sm_75"), Some(75));
        assert_eq!(sm_version("gfx90a"), None);
        assert_eq!(sm_version(""), None);
        let h = Gpu::from_arch(Some("sm_90a"));
        assert_eq!((h.cc, h.sms), (Some(90), Some(132)));
        // the streaming grid measured on H200: 2 blocks per SM
        assert_eq!(h.streaming_grid(), 264);
        assert!(h.has_cp_async() && h.has_int8_mma() && h.has_bf16_mma());
        assert_eq!(h.shared_memory_per_sm(), 233_472);
        assert_eq!(
            Gpu::from_arch(Some("sm_86")).shared_memory_per_sm(),
            102_400
        );
        let t = Gpu::from_arch(Some("sm_75"));
        assert!(!t.has_cp_async() && !t.has_int8_mma() && !t.has_bf16_mma() && t.sms.is_none());
        assert_eq!(t.streaming_grid(), 2 * DEFAULT_SMS);
        let none = Gpu::from_arch(None);
        assert!(none.cc.is_none() && !none.has_cp_async());
    }
}
