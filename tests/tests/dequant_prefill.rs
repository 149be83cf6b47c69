//! The GPU prefill path (quantized layers dequantized and run as dense GEMMs from
//! `MLXCEL_DEQUANT_ROWS` rows) forced on here: it must give the quantized kernels' results.
//! Its own test binary, because the switch is read once per process.

use mlxcel_tests::assert_matches_reference;

#[test]
fn dequantized_prefill_matches_the_quantized_reference() {
    std::env::set_var("MLXCEL_DEQUANT_ROWS", "2");
    assert_eq!(mlxcel_models::nn::dequantize_rows_threshold(), 2);
    for name in [
        "llama-affine4-g64",
        "llama-mxfp4",
        "llama-nvfp4",
        "qwen3-affine4-g64",
        "llama-mixed_3_6",
        "qwen3_moe-affine4-g64",
        "mixtral-affine4-g32",
    ] {
        assert_matches_reference(name, 1e-3);
    }
}
