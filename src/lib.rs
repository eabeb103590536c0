//! mlxcel: LLM inference over MLX, with tensor parallelism across the GPUs of one node.
pub mod cli;
pub mod engine;
pub mod mlx;
pub mod model_dir;
pub mod models;
pub mod parallel;
pub mod server;
pub mod tokenizer;

// Links the MLX library that mlx-sys found.
use mlx_sys as _;
