//! Tensor parallelism across the GPUs of one node: one process per GPU.
pub mod channel;
pub mod driver;
pub mod launcher;
pub mod placement;
pub mod plan;
pub mod protocol;
pub mod rank;
pub mod shard;
pub mod supervisor;
