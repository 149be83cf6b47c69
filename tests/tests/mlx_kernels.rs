//! The model paths GPUs take, run on the CPU with mlxcel's CPU kernels switched off
//! (`MLXCEL_CPU_KERNELS=0`, here a `RuntimePolicy` given to the loads): MLX's own matmul
//! primitives, and the decode-step layout built for them (gathered expert matmuls given their
//! token rows explicitly; the fixtures' prompts and decode steps are both small enough to take
//! it). Its own test binary, because the installed policy is process-wide.

use mlxcel_core::RuntimePolicy;
use mlxcel_tests::assert_matches_reference_with;

#[test]
fn mlx_kernel_paths_match_the_reference() {
    let policy = RuntimePolicy {
        cpu_kernels: false,
        ..RuntimePolicy::default()
    };
    mlxcel_core::policy::install(&policy).unwrap();
    assert!(!mlxcel_core::ops::cpu_kernels_active().unwrap());
    for name in [
        "qwen3_moe-affine4-g64",
        "mixtral-affine4-g32",
        "qwen3_moe",
        "olmoe",
        "llama-affine4-g64",
        // State-space layers: the MLX graph of their scans (chunked SSD, parallel scan, RWKV-7's
        // per-position delta rule), which the CPU recurrence kernels replace when on.
        "mamba",
        "mamba2",
        "jamba",
        "bamba",
        "nemotron_h",
        "falcon_h1",
        "rwkv7",
    ] {
        assert_matches_reference_with(name, 1e-3, Some(policy.clone()));
        assert!(!mlxcel_core::ops::cpu_kernels_active().unwrap());
    }
}
