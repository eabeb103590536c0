//! mlxcel: LLM inference over MLX, with tensor parallelism across the GPUs of one node.
pub mod mlx;

// Links the MLX library that mlx-sys found.
use mlx_sys as _;
