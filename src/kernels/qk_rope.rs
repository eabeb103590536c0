//! Qwen3's per-head q/k RMSNorm, RoPE and the KV cache write of a decode step as one MLX op:
//! `kernels/qk_rope.cu`, run after the q/k/v projection (whose GEMV kernel fuses the layer's
//! norm) where the GEMV kernels cannot rotate themselves because a per-head norm comes
//! first. CUDA backend only; `MLXCEL_QK_ROPE=0` turns it off (the separate ops, as before).
use std::sync::OnceLock;

use super::qgemv::{check_kv_dst, check_rope_inputs, one_body_kernel};
use crate::mlx::fast::CudaKernel;
use crate::mlx::{self, Array, Backend, Dtype, MlxError, Result};

const SOURCE: &str = include_str!("../../kernels/qk_rope.cu");

fn kernel() -> &'static (String, String, String) {
    static KERNEL: OnceLock<(String, String, String)> = OnceLock::new();
    KERNEL.get_or_init(|| one_body_kernel("mlxcel_qk_rope", "qk_rope.cu", SOURCE))
}

/// Whether the kernel runs: the CUDA backend, unless `MLXCEL_QK_ROPE=0`.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| mlx::backend() == Backend::Cuda && super::knobs::get().qk_rope)
}

/// Whether [`qk_norm_rope`] covers heads of `head_dim` in `dtype`: [`enabled`], 64 or 128
/// values a head (whole warps of pairs), bfloat16 or float16.
pub fn supports(head_dim: usize, dtype: Dtype) -> bool {
    enabled() && matches!(head_dim, 64 | 128) && matches!(dtype, Dtype::BF16 | Dtype::F16)
}

/// q `[m, nq, 1, head_dim]` from the projection `y` (`[m, nq + 2·nkv, 1, head_dim]`: q,
/// key, value heads): each q and key head RMS-normed with `q_norm` / `k_norm` (`[head_dim]`,
/// y's dtype) and `eps`, then rotated (half-split RoPE, angle `pos[i] · inv_freq[d]`); the
/// key and value heads of batch row i written into `pool` (`[1, 2·nkv, R, head_dim]`, key
/// heads first, a view that holds no reference to it) at row `dst[i]`. Check [`supports`].
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    y: &Array,
    q_norm: &Array,
    k_norm: &Array,
    eps: f32,
    pos: &Array,
    inv_freq: &Array,
    nq: usize,
    head_dim: usize,
    pool: &Array,
    dst: &Array,
) -> Result<Array> {
    let heads = y.size() / head_dim.max(1);
    let m = pos.size();
    let nkv2 = heads.saturating_sub(nq * m) / m.max(1);
    if m == 0
        || y.size() != m * (nq + nkv2) * head_dim
        || !nkv2.is_multiple_of(2)
        || !supports(head_dim, y.dtype())
        || [q_norm, k_norm]
            .iter()
            .any(|w| w.size() != head_dim || w.dtype() != y.dtype())
    {
        return Err(MlxError::Invalid(format!(
            "qk_norm_rope: y {:?} {:?}, norms {:?} {:?} and {m} positions do not fit {nq} query \
             heads of {head_dim} and as many key as value heads",
            y.shape(),
            y.dtype(),
            q_norm.shape(),
            k_norm.shape()
        )));
    }
    check_rope_inputs("qk_norm_rope", pos, inv_freq, m, head_dim)?;
    check_kv_dst("qk_norm_rope", pool, dst, y.dtype(), m, nkv2, head_dim)?;
    let (name, header, body) = kernel();
    static NAMES: OnceLock<([String; 7], [String; 1], [String; 4])> = OnceLock::new();
    let (inputs, outputs, tnames) = NAMES.get_or_init(|| {
        (
            ["y", "qw", "kw", "pos", "inv_freq", "pool", "dst"].map(String::from),
            ["q".to_string()],
            ["NQ", "NKV", "HD", "EPS_BITS"].map(String::from),
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
    let tvals = [nq, nkv2 / 2, head_dim, eps.to_bits() as usize].map(|v| v as i32);
    let threads = (head_dim / 2) as i32;
    let blocks = (m * (nq + nkv2)) as i32;
    let mut out = kernel.call(
        &[y, q_norm, k_norm, pos, inv_freq, pool, dst],
        &[&[m as i32, nq as i32, 1, head_dim as i32]],
        y.dtype(),
        tnames,
        &tvals,
        y.dtype(),
        [blocks * threads, 1, 1],
        [threads, 1, 1],
    )?;
    Ok(out.remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_file_has_its_markers() {
        let (header, body) = super::super::qgemv::header_and_body(SOURCE).unwrap();
        assert!(header.contains("mlxcel_qk_rope"));
        // MLX passes the pool's shape only when the body names it
        assert!(body.contains("pool_shape"));
    }

    #[test]
    fn off_on_the_cpu() {
        if mlx::backend() != Backend::Cuda {
            assert!(!enabled() && !supports(128, Dtype::BF16));
        }
    }
}
