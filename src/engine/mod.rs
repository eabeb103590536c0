//! Engine: sampling, generation loop and scheduling (all on the MLX thread).
pub mod blocks;
pub mod generate;
pub mod grammar;
pub mod sampler;
pub mod scheduler;
pub mod step;
pub mod step_cost;
