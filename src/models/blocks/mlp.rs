//! The SwiGLU MLP: gate and up projections merged into one linear (this rank's columns
//! of each, column-parallel), `down(silu(gate) · up)` row-parallel, added to the residual.
use std::cell::OnceCell;
use std::ops::Range;
use std::rc::Rc;

use crate::kernels::qgemv::MlpScratch;
use crate::mlx::distributed::Group;
use crate::mlx::{self, Array};

use super::super::config::{ModelConfig, QuantConfig};
use super::super::layers::{mlp_fused, Linear, Result};
use super::super::layout::{ParamSpec, Split};
use super::super::weights::WeightSource;
use super::norm::RmsNorm;

/// The parameters of one MLP block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpLayout {
    pub gate_proj: ParamSpec,
    pub up_proj: ParamSpec,
    pub down_proj: ParamSpec,
}

impl MlpLayout {
    /// `{prefix}.gate_proj`, `.up_proj` (column-parallel) and `.down_proj` (row-parallel)
    /// over this rank's intermediate columns `inter`.
    pub fn new(
        prefix: &str,
        cfg: &ModelConfig,
        inter: Range<usize>,
        quant: Option<QuantConfig>,
    ) -> MlpLayout {
        MlpLayout::sized(prefix, cfg.hidden_size, cfg.intermediate_size, inter, quant)
    }

    /// [`MlpLayout::new`] of hidden size `h` and intermediate size `i` (a MoE block's
    /// shared expert).
    pub fn sized(
        prefix: &str,
        h: usize,
        i: usize,
        inter: Range<usize>,
        quant: Option<QuantConfig>,
    ) -> MlpLayout {
        let name = |n: &str| format!("{prefix}.{n}");
        let col = |n: &str| {
            ParamSpec::linear(name(n), i, h, false)
                .quantized(quant)
                .split(Split::Column(inter.clone()))
        };
        MlpLayout {
            gate_proj: col("gate_proj"),
            up_proj: col("up_proj"),
            down_proj: ParamSpec::linear(name("down_proj"), h, i, false)
                .quantized(quant)
                .split(Split::Row(inter.clone())),
        }
    }

    pub fn params(&self) -> Vec<&ParamSpec> {
        vec![&self.gate_proj, &self.up_proj, &self.down_proj]
    }
}

pub struct Mlp {
    /// gate and up projections merged (this rank's columns of each): one matmul.
    pub gate_up_proj: Linear,
    pub down_proj: Linear,
    /// The scratch of the one-kernel MLP (`MLXCEL_QGEMV_MLP=1`), made at its first use.
    scratch: Box<OnceCell<MlpScratch>>,
}

impl Mlp {
    /// This rank's MLP under `layout`; `down`'s partial sums are reduced over `tp`.
    pub fn load(src: &dyn WeightSource, layout: &MlpLayout, tp: Option<Rc<Group>>) -> Result<Mlp> {
        Ok(Mlp {
            gate_up_proj: Linear::load_merged(src, &[&layout.gate_proj, &layout.up_proj])?,
            down_proj: Linear::load(src, &layout.down_proj, tp)?,
            scratch: Box::default(),
        })
    }

    /// Arrays held (for memory accounting).
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.gate_up_proj.arrays();
        v.extend(self.down_proj.arrays());
        v
    }

    /// `h + down(silu(gate(x)) · up(x))` with `x = norm(h)`
    pub fn forward_residual(&self, h: &Array, norm: &RmsNorm) -> mlx::Result<Array> {
        // a decode step's rows of a quantized MLP: one kernel for both products
        if let Some(y) = mlp_fused(&self.gate_up_proj, &self.down_proj, h, norm, &self.scratch) {
            return y;
        }
        self.down_proj
            .forward_residual(&self.gate_up_proj.forward_swiglu(h, Some(norm))?, h)
    }
}
