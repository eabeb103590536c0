//! Tensor parallelism across the GPUs of one node: one process per GPU.
pub mod placement;
pub mod shard;
