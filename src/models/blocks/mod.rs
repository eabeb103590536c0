//! The blocks a family's decoder layer is built from, each with its parameter layout
//! (`*Layout`: names, shapes, TP splits) and its loader and forward pass.
pub mod attention;
pub mod mlp;
pub mod moe;
pub mod norm;
