//! mlxcel's own GPU kernels, launched through MLX's custom-kernel API: the Rust side
//! of `kernels/*.cu` (which source, which template constants, which launch), above
//! the safe MLX binding in [`crate::mlx`] and below the models that call them.
//!
//! - [`qgemv`]: the quantized GEMV of decode steps, with fused epilogues;
//! - [`qgemm`]: the quantized GEMM of batched decode steps (9–128 rows), with the same fusions;
//! - [`gemv`]: the dense (bf16/f16) GEMV of decode steps, with the same fusions;
//! - [`attn`]: the decode attention over the KV cache's pools;
//! - [`qk_rope`]: Qwen3's per-head q/k norm, RoPE and the KV cache write after the projection;
//! - [`mask_wait`]: a constrained step's token masks read from pinned host memory once given;
//! - [`gpu`]: the GPU the launch tables are keyed by (architecture, SM count);
//! - [`driver`]: the CUDA driver's functions called directly (pinned memory, free memory);
//! - [`knobs`]: every tuning environment variable, parsed and validated once;
//! - [`cache`]: compiled kernels kept in the cache folder between runs.
pub mod attn;
pub mod cache;
pub mod driver;
pub mod gemv;
pub mod gpu;
pub mod knobs;
pub mod mask_wait;
pub mod qgemm;
pub mod qgemv;
pub mod qk_rope;
