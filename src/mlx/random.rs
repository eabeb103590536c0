//! Counter-based random numbers with explicit keys (reproducible per seed).
use super::array::ArrayList;
use super::ffi::ffi;
use super::{Array, Dtype, Result};

/// A PRNG key from a seed.
pub fn key(seed: u64) -> Result<Array> {
    Ok(Array::from_ptr(ffi::random_key(seed)?))
}

/// `num` independent keys derived from `key`.
pub fn split(key: &Array, num: i32) -> Result<Vec<Array>> {
    ArrayList(ffi::random_split(key.raw(), num)?).into_vec()
}

/// Uniform samples in [0, 1).
pub fn uniform(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    Ok(Array::from_ptr(ffi::random_uniform(
        shape,
        dtype,
        key.raw(),
    )?))
}

/// Normal samples with mean `loc` and standard deviation `scale`.
pub fn normal(shape: &[i32], dtype: Dtype, loc: f32, scale: f32, key: &Array) -> Result<Array> {
    Ok(Array::from_ptr(ffi::random_normal(
        shape,
        dtype,
        loc,
        scale,
        key.raw(),
    )?))
}

/// One sample per row from the distribution `softmax(logits)` along `axis`.
pub fn categorical(logits: &Array, axis: i32, key: &Array) -> Result<Array> {
    Ok(Array::from_ptr(ffi::random_categorical(
        logits.raw(),
        axis,
        key.raw(),
    )?))
}
