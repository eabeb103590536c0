//! RMSNorm with a learned scale.
use crate::mlx::{self, fast, Array};

use super::super::layout::ParamSpec;
use super::super::weights::{LoadError, TensorKind, WeightSource};

/// RMSNorm with a learned scale.
pub struct RmsNorm {
    pub weight: Array,
    pub eps: f32,
}

impl RmsNorm {
    /// The scale of `spec` (a [`Kind::Norm`](super::super::layout::Kind::Norm)).
    pub fn load(src: &dyn WeightSource, spec: &ParamSpec, eps: f32) -> Result<Self, LoadError> {
        let t = spec.tensors(None).remove(0);
        Ok(RmsNorm {
            weight: src.load(&t.name, &t.shape, TensorKind::Norm)?,
            eps,
        })
    }

    pub fn forward(&self, x: &Array) -> mlx::Result<Array> {
        fast::rms_norm(x, Some(&self.weight), self.eps)
    }
}
