//! Tensor parallelism across the GPUs of one node: one process per GPU.
pub mod channel;
pub mod child;
pub mod driver;
pub mod launcher;
pub mod placement;
pub mod plan;
pub mod protocol;
pub mod rank;
/// The shard plan lives with the models (their layout decides how they split).
pub use crate::models::shard;
pub mod supervisor;
