//! Shared build script of the crates whose binaries and tests link MLX through `mlxcel-core`:
//! cargo does not pass a dependency's `rustc-link-arg` on, so each such crate repeats the
//! RUNPATH that `mlxcel-core` exports as `DEP_MLX_LIB_DIR` (its `links = "mlx"` metadata).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
            println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
        }
    }
}
