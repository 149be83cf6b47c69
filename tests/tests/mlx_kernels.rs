//! The model paths GPUs take, run on the CPU with mlxcel's CPU kernels switched off
//! (`MLXCEL_CPU_KERNELS=0`): MLX's own matmul primitives, and the decode-step layout built for
//! them (gathered expert matmuls given their token rows explicitly). Greedy decoding must give
//! the reference's ids. Its own test binary, because the switch is read once per process.

use mlxcel_core::Array;
use mlxcel_loading::{load_model, LanguageModel, LoadOptions};
use mlxcel_models::generate::greedy;
use mlxcel_tests::{max_abs_diff, model_dir, reference};

#[test]
fn mlx_kernel_paths_match_the_reference() {
    std::env::set_var("MLXCEL_CPU_KERNELS", "0");
    assert!(!mlxcel_core::ops::cpu_kernels_active().unwrap());
    for name in [
        "qwen3_moe-affine4-g64",
        "mixtral-affine4-g32",
        "qwen3_moe",
        "olmoe",
        "llama-affine4-g64",
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
        assert!(diff <= 1e-3, "{name}: prefill logits differ by {diff:.2e}");
        // Decode steps (one token each) take the explicit-rows layout for routed experts.
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
