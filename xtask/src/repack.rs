//! `cargo xtask repack` and `cargo xtask importance`: thin wrappers over
//! [`mlxcel_loading::repack`] (the same code `mlxcel convert --hf DIR -q` runs).

pub use mlxcel_loading::repack::*;

#[cfg(test)]
#[path = "repack_tests.rs"]
mod tests;
