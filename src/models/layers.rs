//! Building blocks that model files call like single-device layers: linear
//! (dense or MLX-affine-quantized), embedding, RMSNorm, rotary embedding.
//! Each layer loads its own tensors by name, with shapes from the config.
use crate::mlx::{self, fast, Array, Dtype};

use super::config::{ModelConfig, QuantConfig};
use super::weights::{LoadError, TensorKind, WeightSource};

pub type Result<T> = std::result::Result<T, LoadError>;

/// `y = x Wᵀ (+ b)`, with W dense `[out, in]` or MLX affine-quantized.
pub enum Linear {
    Dense {
        w: Array,
        b: Option<Array>,
    },
    Quantized {
        w: Array,
        scales: Array,
        biases: Array,
        q: QuantConfig,
        b: Option<Array>,
    },
}

impl Linear {
    /// Load `{prefix}.weight` (and `.scales`/`.biases` when quantized, `.bias` when `bias`).
    pub fn load(
        src: &WeightSource,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        quant: Option<QuantConfig>,
    ) -> Result<Linear> {
        let b = if bias {
            Some(src.load(&format!("{prefix}.bias"), &[out_dim], TensorKind::Float)?)
        } else {
            None
        };
        match quant {
            Some(q) if src.contains(&format!("{prefix}.scales")) => {
                let packed = in_dim * q.bits as usize / 32;
                let groups = in_dim / q.group_size as usize;
                Ok(Linear::Quantized {
                    w: src.load(
                        &format!("{prefix}.weight"),
                        &[out_dim, packed],
                        TensorKind::Packed,
                    )?,
                    scales: src.load(
                        &format!("{prefix}.scales"),
                        &[out_dim, groups],
                        TensorKind::Scales,
                    )?,
                    biases: src.load(
                        &format!("{prefix}.biases"),
                        &[out_dim, groups],
                        TensorKind::QuantBiases,
                    )?,
                    q,
                    b,
                })
            }
            _ => Ok(Linear::Dense {
                w: src.load(
                    &format!("{prefix}.weight"),
                    &[out_dim, in_dim],
                    TensorKind::Float,
                )?,
                b,
            }),
        }
    }

    pub fn forward(&self, x: &Array) -> mlx::Result<Array> {
        match self {
            Linear::Dense { w, b: None } => x.matmul(&w.t()?),
            Linear::Dense { w, b: Some(b) } => x.addmm(&w.t()?, b),
            Linear::Quantized {
                w,
                scales,
                biases,
                q,
                b,
            } => {
                let y = fast::quantized_matmul(x, w, scales, biases, true, q.group_size, q.bits)?;
                match b {
                    Some(b) => y.add(b),
                    None => Ok(y),
                }
            }
        }
    }

    /// Arrays held (for memory accounting).
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Linear::Dense { w, b } => std::iter::once(w).chain(b.iter()).collect(),
            Linear::Quantized {
                w,
                scales,
                biases,
                b,
                ..
            } => [w, scales, biases].into_iter().chain(b.iter()).collect(),
        }
    }
}

/// Token embedding table, `[vocab, hidden]`, dense or quantized.
pub struct Embedding {
    table: Linear,
}

impl Embedding {
    pub fn load(
        src: &WeightSource,
        prefix: &str,
        vocab: usize,
        hidden: usize,
        quant: Option<QuantConfig>,
    ) -> Result<Self> {
        Ok(Embedding {
            table: Linear::load(src, prefix, hidden, vocab, false, quant)?,
        })
    }

    /// Rows for `ids` (any shape) → `[..., hidden]`.
    pub fn forward(&self, ids: &Array) -> mlx::Result<Array> {
        match &self.table {
            Linear::Dense { w, .. } => w.take(ids, 0),
            Linear::Quantized {
                w,
                scales,
                biases,
                q,
                ..
            } => {
                let rows = w.take(ids, 0)?;
                let s = scales.take(ids, 0)?;
                let b = biases.take(ids, 0)?;
                fast::dequantize(&rows, &s, &b, q.group_size, q.bits)
            }
        }
    }

    /// Use the table as the output projection (tied embeddings).
    pub fn as_linear(&self, x: &Array) -> mlx::Result<Array> {
        self.table.forward(x)
    }

    pub fn arrays(&self) -> Vec<&Array> {
        self.table.arrays()
    }

    /// Element type of the embedding output.
    pub fn out_dtype(&self) -> Dtype {
        match &self.table {
            Linear::Dense { w, .. } => w.dtype(),
            Linear::Quantized { scales, .. } => scales.dtype(),
        }
    }
}

/// RMSNorm with a learned scale.
pub struct RmsNorm {
    pub weight: Array,
    pub eps: f32,
}

impl RmsNorm {
    pub fn load(src: &WeightSource, name: &str, dim: usize, eps: f32) -> Result<Self> {
        Ok(RmsNorm {
            weight: src.load(name, &[dim], TensorKind::Norm)?,
            eps,
        })
    }

    pub fn forward(&self, x: &Array) -> mlx::Result<Array> {
        fast::rms_norm(x, Some(&self.weight), self.eps)
    }
}

/// Rotary position embedding (half-split, as in HF Llama), optionally with
/// Llama-3 frequency scaling.
pub struct Rope {
    dims: i32,
    base: f32,
    /// Llama-3 scaled periods, passed to MLX as `freqs`.
    freqs: Option<Array>,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> mlx::Result<Rope> {
        let dims = cfg.head_dim as i32;
        let base = cfg.rope.theta;
        let freqs = match &cfg.rope.llama3 {
            None => None,
            Some(s) => {
                // As mlx-lm's Llama3RoPE: periods base^(2i/d), scaled by wavelength band.
                let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
                let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
                let f: Vec<f32> = (0..dims / 2)
                    .map(|i| {
                        let period = base.powf(2.0 * i as f32 / dims as f32);
                        let wavelen = 2.0 * std::f32::consts::PI * period;
                        if wavelen > low_wavelen {
                            period * s.factor
                        } else if wavelen < high_wavelen {
                            period
                        } else {
                            let smooth = (s.original_max_position_embeddings / wavelen
                                - s.low_freq_factor)
                                / (s.high_freq_factor - s.low_freq_factor);
                            period / ((1.0 - smooth) / s.factor + smooth)
                        }
                    })
                    .collect();
                Some(Array::from_slice(&f, &[dims / 2])?)
            }
        };
        Ok(Rope { dims, base, freqs })
    }

    /// Rotate `x` (`[B, heads, L, head_dim]`); `offset` is a scalar or one start position per batch row.
    pub fn forward(&self, x: &Array, offset: &Array) -> mlx::Result<Array> {
        match &self.freqs {
            Some(f) => fast::rope_with_freqs(x, self.dims, false, 1.0, offset, f),
            None => fast::rope_dynamic(x, self.dims, false, self.base, 1.0, offset),
        }
    }
}
