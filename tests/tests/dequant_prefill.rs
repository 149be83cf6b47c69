//! The GPU prefill path (quantized layers dequantized and run as dense GEMMs from
//! `MLXCEL_DEQUANT_ROWS` rows, here a `RuntimePolicy` given to the loads) forced on here: it
//! must give the quantized kernels' results. Its own test binary, because the installed policy
//! is process-wide.

use mlxcel_core::RuntimePolicy;
use mlxcel_tests::assert_matches_reference_with;

#[test]
fn dequantized_prefill_matches_the_quantized_reference() {
    let policy = RuntimePolicy {
        dequant_rows: Some(2),
        ..RuntimePolicy::default()
    };
    mlxcel_core::policy::install(&policy).unwrap();
    assert_eq!(mlxcel_arch::nn::dequantize_rows_threshold(), 2);
    for name in [
        "llama-affine4-g64",
        "llama-mxfp4",
        "llama-nvfp4",
        "qwen3-affine4-g64",
        "llama-mixed_3_6",
        "qwen3_moe-affine4-g64",
        "mixtral-affine4-g32",
    ] {
        assert_matches_reference_with(name, 1e-3, Some(policy.clone()));
        assert_eq!(mlxcel_arch::nn::dequantize_rows_threshold(), 2);
    }
}
