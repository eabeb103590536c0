//! MLX `fast` kernels (RMSNorm, RoPE, attention) and affine quantization.
use super::array::ArrayList;
use super::ffi::ffi;
use super::{Array, Result};

/// RMS normalisation over the last axis, scaled by `weight` when given.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    Ok(Array::from_ptr(match weight {
        Some(w) => ffi::rms_norm(x.raw(), w.raw(), eps)?,
        None => ffi::rms_norm_no_weight(x.raw(), eps)?,
    }))
}

/// Rotary position embedding of `x` (`[..., seq, head_dim]`) starting at position `offset`.
pub fn rope(
    x: &Array,
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
    offset: i32,
) -> Result<Array> {
    Ok(Array::from_ptr(ffi::rope(
        x.raw(),
        dims,
        traditional,
        base,
        scale,
        offset,
    )?))
}

/// RoPE with the offset held in an array: a scalar, or one offset per batch row.
pub fn rope_dynamic(
    x: &Array,
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
    offset: &Array,
) -> Result<Array> {
    Ok(Array::from_ptr(ffi::rope_array_offset(
        x.raw(),
        dims,
        traditional,
        base,
        scale,
        offset.raw(),
    )?))
}

/// RoPE with explicit inverse frequencies (`freqs`, `[dims/2]`), e.g. Llama-3 scaled ones.
pub fn rope_with_freqs(
    x: &Array,
    dims: i32,
    traditional: bool,
    scale: f32,
    offset: &Array,
    freqs: &Array,
) -> Result<Array> {
    Ok(Array::from_ptr(ffi::rope_freqs(
        x.raw(),
        dims,
        traditional,
        scale,
        offset.raw(),
        freqs.raw(),
    )?))
}

/// Attention mask for [`sdpa`].
pub enum Mask<'a> {
    None,
    /// Causal with the queries aligned to the end of the keys.
    Causal,
    /// Boolean (true = attend) or additive mask, broadcastable to `[B, H, Lq, Lk]`.
    Array(&'a Array),
}

/// `softmax(q kᵀ · scale + mask) v`, with q `[B, Hq, Lq, D]`, k/v `[B, Hkv, Lk, D]` (GQA when Hq > Hkv).
pub fn sdpa(q: &Array, k: &Array, v: &Array, scale: f32, mask: Mask<'_>) -> Result<Array> {
    Ok(Array::from_ptr(match mask {
        Mask::None => ffi::sdpa(q.raw(), k.raw(), v.raw(), scale, "")?,
        Mask::Causal => ffi::sdpa(q.raw(), k.raw(), v.raw(), scale, "causal")?,
        Mask::Array(m) => ffi::sdpa_masked(q.raw(), k.raw(), v.raw(), scale, m.raw())?,
    }))
}

/// How many times this thread has traced mlxcel's compiled ops (e.g. [`swiglu`]).
/// They are compiled shapeless, so after the first call nothing re-traces: not a
/// new batch size, sequence length or position.
pub fn compile_traces() -> u64 {
    ffi::compile_traces()
}

/// `silu(gate) * up` as one compiled kernel (MLX `compile`, shapeless).
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array> {
    Ok(Array::from_ptr(ffi::swiglu(gate.raw(), up.raw())?))
}

/// `x @ dequantize(w)ᵀ` (transpose = true) for MLX affine-quantized `w`.
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    transpose: bool,
    group_size: i32,
    bits: i32,
) -> Result<Array> {
    Ok(Array::from_ptr(ffi::quantized_matmul(
        x.raw(),
        w.raw(),
        scales.raw(),
        biases.raw(),
        transpose,
        group_size,
        bits,
    )?))
}

/// `a @ b[rhs_indices]`: one matrix of the stacked `b` (`[E, K, N]`) per index, batched
/// over the indices' shape broadcast with `a`'s batch axes (MLX `gather_mm`; MoE experts).
/// `sorted`: the indices are in ascending order (tokens sorted by expert).
pub fn gather_mm(a: &Array, b: &Array, rhs_indices: &Array, sorted: bool) -> Result<Array> {
    Ok(Array::from_ptr(ffi::gather_mm(
        a.raw(),
        b.raw(),
        rhs_indices.raw(),
        sorted,
    )?))
}

/// [`gather_mm`] with `x @ dequantize(w[i])ᵀ` for stacked MLX affine-quantized experts
/// (`w` `[E, N, K·bits/32]`, scales and biases `[E, N, K/group]`; MLX `gather_qmm`).
#[allow(clippy::too_many_arguments)]
pub fn gather_qmm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    rhs_indices: &Array,
    group_size: i32,
    bits: i32,
    sorted: bool,
) -> Result<Array> {
    Ok(Array::from_ptr(ffi::gather_qmm(
        x.raw(),
        w.raw(),
        scales.raw(),
        biases.raw(),
        rhs_indices.raw(),
        group_size,
        bits,
        sorted,
    )?))
}

/// Inverse of [`quantize`].
pub fn dequantize(
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
) -> Result<Array> {
    Ok(Array::from_ptr(ffi::dequantize(
        w.raw(),
        scales.raw(),
        biases.raw(),
        group_size,
        bits,
    )?))
}

/// MLX affine quantization along the last axis: `(w_q, scales, biases)`.
pub fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<(Array, Array, Array)> {
    let mut v = ArrayList(ffi::quantize(w.raw(), group_size, bits)?).into_vec()?;
    if v.len() != 3 {
        return Err(super::MlxError::Invalid(format!(
            "quantize returned {} arrays, expected 3",
            v.len()
        )));
    }
    let b = v.pop().unwrap();
    let s = v.pop().unwrap();
    let q = v.pop().unwrap();
    Ok((q, s, b))
}

/// A CUDA kernel compiled at run time by MLX (`fast::cuda_kernel`, nvrtc): `body` is
/// the kernel body (inputs named `input_names`, outputs `output_names`), `header`
/// device code before it. Template ints (`template_names[i] = template_values[i]`)
/// become constexpr ints in the body and `T` names `tdtype`. `grid` counts threads,
/// as in MLX. Only MLX's CUDA backend runs it. The shim caches the kernel function by
/// `name` and `shared_memory`, so `name` must change whenever `header`, `body` or the
/// names do.
pub struct CudaKernel<'a> {
    pub name: &'a str,
    pub input_names: &'a [String],
    pub output_names: &'a [String],
    pub header: &'a str,
    pub body: &'a str,
    /// Dynamic shared memory of each launch in bytes (`extern __shared__`; 0: none). MLX
    /// raises the kernel's limit when it is over the default 48 KB.
    pub shared_memory: i32,
}

/// Whether custom kernels' later calls reuse the op of their variant's first call
/// (`set_kernel_reuse`; on unless turned off).
static KERNEL_REUSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turn the reuse of custom kernel ops on or off (for A/B runs: `MLXCEL_KERNEL_REUSE`).
pub fn set_kernel_reuse(on: bool) {
    KERNEL_REUSE.store(on, std::sync::atomic::Ordering::Relaxed);
}

impl CudaKernel<'_> {
    /// Run it on `inputs`; output i has shape `out_shapes[i]`, all of dtype `out_dtype`.
    #[allow(clippy::too_many_arguments)]
    pub fn call(
        &self,
        inputs: &[&Array],
        out_shapes: &[&[i32]],
        out_dtype: super::Dtype,
        template_names: &[String],
        template_values: &[i32],
        tdtype: super::Dtype,
        grid: [i32; 3],
        threadgroup: [i32; 3],
    ) -> Result<Vec<Array>> {
        let list = ArrayList::new(inputs.iter().copied());
        let mut shapes = Vec::with_capacity(8);
        let mut ndims = Vec::with_capacity(out_shapes.len());
        for s in out_shapes {
            shapes.extend_from_slice(s);
            ndims.push(s.len() as i32);
        }
        // everything besides the name that changes the source MLX generates: the shim
        // makes later calls of a variant from its first (and the kernel cache compiles it)
        let variant = super::kernel_cache::launch_key(
            self.name,
            inputs.iter().map(|a| a.dtype()),
            out_shapes.len(),
            out_dtype,
            template_values,
            tdtype,
        );
        let reuse = KERNEL_REUSE.load(std::sync::atomic::Ordering::Relaxed);
        let out = ArrayList(ffi::cuda_kernel(
            variant,
            reuse,
            self.name,
            self.input_names,
            self.output_names,
            self.body,
            self.header,
            list.raw(),
            &shapes,
            &ndims,
            out_dtype,
            template_names,
            template_values,
            tdtype,
            &grid,
            &threadgroup,
            self.shared_memory,
        )?)
        .into_vec()?;
        if let (Some(_), Some(first)) = (super::kernel_cache::get(), out.first()) {
            super::kernel_cache::note_variant(variant, first);
        }
        Ok(out)
    }
}
