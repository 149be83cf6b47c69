//! The GPU prefill path (quantized layers dequantized and run as dense GEMMs from
//! `MLXCEL_DEQUANT_ROWS` rows) forced on here: it must give the quantized kernels' results.
//! Its own test binary, because the switch is read once per process.

use mlxcel_core::Array;
use mlxcel_loading::{load_model, LanguageModel, LoadOptions};
use mlxcel_models::generate::greedy;
use mlxcel_tests::{max_abs_diff, model_dir, reference};

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
        let r = reference(name);
        let loaded = load_model(
            model_dir(name),
            &LoadOptions {
                skip_tokenizer: true,
                ..Default::default()
            },
        )
        .unwrap();
        let ids: Vec<i32> = r.prompt_ids.iter().map(|t| *t as i32).collect();
        let tokens = Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap();
        let mut caches = loaded.model.make_caches();
        let got = loaded
            .model
            .forward(&tokens, &mut caches)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let (diff, _) = max_abs_diff(&got, &r.logits);
        assert!(diff <= 1e-3, "{name}: {diff:.2e}");
        let out = greedy(
            &loaded.model,
            &r.prompt_ids,
            r.greedy_ids.len(),
            None,
            |_| false,
        )
        .unwrap();
        assert_eq!(out, r.greedy_ids, "{name}");
    }
}
