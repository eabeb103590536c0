//! What a lazy graph holds before it is evaluated: the MLX ops (primitives) it would run.
//! On a GPU each op costs host time to build and to encode (decode is bound by it), so
//! the op count of a decode step is the number to bring down ([`count_ops`]).
//!
//! MLX's fast ops (RMSNorm, RoPE, attention) and affine dequantization are one op each on a
//! GPU but expand into their fallback ops on the CPU; [`FastOpsAsGpu`] makes a CPU build count them as a
//! GPU would, for graphs that are only counted, never evaluated.
use std::collections::BTreeMap;

use super::array::ArrayList;
use super::ffi::ffi;
use super::Array;

/// The ops of a graph by primitive name (MLX's `Primitive::name`: `Matmul`, `Slice`, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub by_name: BTreeMap<String, usize>,
}

impl OpCounts {
    /// All ops.
    pub fn total(&self) -> usize {
        self.by_name.values().sum()
    }

    /// Ops of primitive `name`.
    pub fn get(&self, name: &str) -> usize {
        self.by_name.get(name).copied().unwrap_or(0)
    }

    /// `self` with `other`'s counts added.
    pub fn add(&mut self, other: &OpCounts) {
        for (k, v) in &other.by_name {
            *self.by_name.entry(k.clone()).or_default() += v;
        }
    }

    /// The counts as a JSON object, name → count.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::Value::Object(
            self.by_name
                .iter()
                .map(|(k, v)| (k.clone(), (*v).into()))
                .collect(),
        )
    }
}

/// The ops that evaluating `outputs` would run: every array of their graph that has a
/// primitive and that no eval has scheduled yet, a multi-output op once, by primitive.
/// Weights, constants and arrays already evaluated (or queued by `async_eval`) are
/// inputs, not ops. The walk does not enter `stop` (nor count it): `stop` = a layer's
/// input gives the ops of that layer alone.
pub fn count_ops(outputs: &[&Array], stop: &[&Array]) -> OpCounts {
    let tallies = ffi::count_ops(
        ArrayList::new(outputs.iter().copied()).raw(),
        ArrayList::new(stop.iter().copied()).raw(),
    );
    OpCounts {
        by_name: tallies
            .into_iter()
            .map(|t| (t.name, t.count as usize))
            .collect(),
    }
}

/// While alive (on this thread), MLX's fast ops and `dequantize` built on a CPU stream are
/// built as the one fused op a GPU stream gets (named like MLX's: `RMSNorm`, `RoPE`,
/// `ScaledDotProductAttention`, `Quantize`), not as their fallback ops, so that [`count_ops`] on a CPU
/// counts what a GPU builds. Arrays built meanwhile are for counting only: evaluating
/// them fails with an error. No effect on a GPU stream.
pub struct FastOpsAsGpu {
    was: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl FastOpsAsGpu {
    pub fn new() -> FastOpsAsGpu {
        let was = ffi::fast_ops_as_gpu();
        ffi::set_fast_ops_as_gpu(true);
        FastOpsAsGpu {
            was,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Default for FastOpsAsGpu {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for FastOpsAsGpu {
    fn drop(&mut self) {
        ffi::set_fast_ops_as_gpu(self.was);
    }
}
