//! Finds or fetches the pinned MLX C++ library and links it; see `build.rs`.
