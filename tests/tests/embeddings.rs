//! The embedding kind: the three tiny encoder fixtures against transformers (hidden states and
//! mean-pooled embeddings), batching against one-by-one runs, Matryoshka truncation, the decoder
//! embedders (Qwen3-Embedding causal, EmbeddingGemma bidirectional) against sentence-transformers,
//! and the real all-MiniLM-L6-v2 (skipped, saying so, when `cargo xtask fetch-models` has not
//! run).

use mlxcel_arch::EmbeddingModel;
use mlxcel_core::Array;
use mlxcel_loading::{load_embedding_model, EmbedOptions, EmbeddingLoaded, LoadOptions, Overflow};
use mlxcel_tests::{fixtures_dir, max_abs_diff, model_dir};
use safetensors::SafeTensors;
use serde_json::Value;

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn i32s(st: &SafeTensors, name: &str) -> Vec<i32> {
    st.tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn load(name: &str) -> EmbeddingLoaded {
    load_embedding_model(model_dir(name), &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn check_encoder(name: &str) {
    let model = load(name);
    let bytes = std::fs::read(model_dir(name).join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = i32s(&st, "input_ids");
    let mask = i32s(&st, "attention_mask");
    let want_hidden = f32s(&st, "last_hidden_state");
    let want_pooled = f32s(&st, "pooled_mean");
    let l = ids.len() as i32;
    let tok = Array::from_slice(&ids, &[1, l]).unwrap();
    let m = Array::from_slice(&mask, &[1, l]).unwrap();
    let hidden = model
        .model
        .hidden_states(&tok, &m)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let (dh, at) = max_abs_diff(&hidden, &want_hidden);
    assert!(
        dh <= 1e-4,
        "{name}: last_hidden_state max |Δ| {dh:.2e} at {at}"
    );
    // No modules.json: the default pipeline, mean pooling + L2 normalisation.
    assert!(!model.head.from_modules_json);
    let ids_u: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    let pooled = model.embed_ids(&[ids_u], None, 8).unwrap().remove(0);
    let (dp, at) = max_abs_diff(&pooled, &want_pooled);
    assert!(dp <= 1e-5, "{name}: pooled_mean max |Δ| {dp:.2e} at {at}");
    eprintln!("{name}: hidden max |Δ| {dh:.2e}, pooled max |Δ| {dp:.2e}");
}

#[test]
fn bert_matches_transformers() {
    check_encoder("bert");
}

#[test]
fn xlm_roberta_matches_transformers() {
    check_encoder("xlm-roberta");
}

#[test]
fn modernbert_matches_transformers() {
    check_encoder("modernbert");
}

/// Texts of different lengths in one padded batch give the one-by-one embeddings, in input
/// order (the batch is sorted by length inside).
#[test]
fn batched_equals_one_by_one_in_input_order() {
    for name in ["bert", "xlm-roberta", "modernbert"] {
        let model = load(name);
        // Longer than the local window (8) so ModernBERT's padded rows cross it.
        let texts = [
            "short",
            "a rather longer sentence about the capital of France and its rivers",
            "mid length text here",
            "x",
            "another sentence, of medium length, with commas",
        ];
        let opts = EmbedOptions {
            batch_size: 8,
            ..EmbedOptions::default()
        };
        let batched = model.embed(&texts, &opts).unwrap();
        assert_eq!(batched.len(), texts.len());
        for (i, t) in texts.iter().enumerate() {
            let single = model.embed(&[t], &opts).unwrap().remove(0);
            let (d, _) = max_abs_diff(&batched[i], &single);
            assert!(
                d <= 1e-5,
                "{name}: text {i} batched vs alone max |Δ| {d:.2e}"
            );
        }
        // Distinct texts give distinct vectors (input order really is kept).
        assert!(max_abs_diff(&batched[0], &batched[1]).0 > 1e-3, "{name}");
    }
}

#[test]
fn matryoshka_truncation_renormalises() {
    let model = load("bert");
    let texts = ["the first text", "and a second one, longer than the first"];
    let full = model.embed(&texts, &EmbedOptions::default()).unwrap();
    let cut = model
        .embed(
            &texts,
            &EmbedOptions {
                dimensions: Some(16),
                ..EmbedOptions::default()
            },
        )
        .unwrap();
    for (f, c) in full.iter().zip(&cut) {
        assert_eq!(f.len(), 64);
        assert_eq!(c.len(), 16);
        let norm: f32 = c.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
        let head_norm: f32 = f[..16].iter().map(|x| x * x).sum::<f32>().sqrt();
        let want: Vec<f32> = f[..16].iter().map(|x| x / head_norm).collect();
        assert!(max_abs_diff(c, &want).0 < 1e-5);
    }
    for bad in [0, 65] {
        let err = model
            .embed(
                &texts,
                &EmbedOptions {
                    dimensions: Some(bad),
                    ..EmbedOptions::default()
                },
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("dimensions"), "{err}");
    }
}

#[test]
fn overlong_text_is_refused_when_asked() {
    let model = load("bert");
    let long = "word ".repeat(400);
    let refuse = EmbedOptions {
        overflow: Overflow::Refuse,
        ..EmbedOptions::default()
    };
    let err = model
        .embed(&[long.as_str()], &refuse)
        .unwrap_err()
        .to_string();
    assert!(err.contains("limit of 256 tokens"), "{err}");
    let truncated = model
        .embed(
            &[long.as_str()],
            &EmbedOptions {
                overflow: Overflow::Truncate,
                ..EmbedOptions::default()
            },
        )
        .unwrap();
    assert_eq!(truncated[0].len(), 64);
}

#[test]
fn generation_loader_points_encoders_elsewhere() {
    let err = mlxcel_loading::load_model(model_dir("bert"), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("load_embedding_model"), "{err}");
    let err = load_embedding_model(model_dir("llama"), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("not an embedding model"), "{err}");
}

#[test]
fn minilm_matches_sentence_transformers() {
    let cache = mlxcel_core::cache_dir().unwrap_or_default();
    let folder = cache.join("models/all-MiniLM-L6-v2");
    if !folder.join("config.json").is_file() {
        println!(
            "skip: {} missing (run `cargo xtask fetch-models`)",
            folder.display()
        );
        return;
    }
    let model = load_embedding_model(&folder, &LoadOptions::default()).unwrap();
    assert!(model.head.from_modules_json && model.head.normalize);
    assert_eq!(model.max_tokens, Some(256));
    let dir = fixtures_dir().join("real/minilm");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let bytes = std::fs::read(dir.join("embeddings.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mean = f32s(&st, "mean_pooled");
    let normalized = f32s(&st, "normalized");
    let sentences = reference["sentences"].as_array().unwrap();
    let texts: Vec<&str> = sentences
        .iter()
        .map(|s| s["text"].as_str().unwrap())
        .collect();
    for (s, t) in sentences.iter().zip(&texts) {
        let want: Vec<u32> = s["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let (got, truncated) = model.tokenize(t, &EmbedOptions::default()).unwrap();
        assert_eq!(got, want, "token ids of {t:?}");
        assert!(!truncated);
    }
    let got = model.embed(&texts, &EmbedOptions::default()).unwrap();
    let d = 384;
    for (i, g) in got.iter().enumerate() {
        let want = &normalized[i * d..(i + 1) * d];
        let (diff, _) = max_abs_diff(g, want);
        let cos = cosine(g, want);
        assert!(cos >= 0.99999, "sentence {i}: cosine {cos}");
        assert!(diff <= 1e-4, "sentence {i}: max |Δ| {diff:.2e}");
    }
    // The un-normalised mean pooling, straight from the encoder.
    let ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| model.tokenize(t, &EmbedOptions::default()).unwrap().0)
        .collect();
    for (i, row) in ids.iter().enumerate() {
        let l = row.len() as i32;
        let tok: Vec<i32> = row.iter().map(|&t| t as i32).collect();
        let tok = Array::from_slice(&tok, &[1, l]).unwrap();
        let mask = Array::from_slice(&vec![1i32; row.len()], &[1, l]).unwrap();
        let pooled = model
            .model
            .pooled(&tok, &mask, mlxcel_arch::Pooling::Mean)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let (diff, _) = max_abs_diff(&pooled, &mean[i * d..(i + 1) * d]);
        assert!(diff <= 1e-4, "sentence {i}: mean_pooled max |Δ| {diff:.2e}");
    }
}

/// The facade: an `Embedder` handle on its worker thread, usable from another thread, giving
/// what the pipeline gives; `Model::load` on an encoder folder points at it.
#[test]
fn facade_embedder_runs_on_its_worker() {
    use mlxcel_models::{Embedder, Model};
    let embedder = Embedder::load(model_dir("modernbert")).build().unwrap();
    assert_eq!(embedder.info().dimensions, 64);
    assert!(embedder.info().normalized);
    let texts = ["one text", "and another, longer text than the first"];
    let handle = embedder.clone();
    let got = std::thread::spawn(move || handle.embed(&texts))
        .join()
        .unwrap()
        .unwrap();
    let want = load("modernbert")
        .embed(&texts, &EmbedOptions::default())
        .unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!(max_abs_diff(g, w).0 <= 1e-6);
    }
    let cut = Embedder::load(model_dir("modernbert"))
        .dimensions(32)
        .build()
        .unwrap()
        .embed(&texts)
        .unwrap();
    assert_eq!(cut[0].len(), 32);
    let err = Model::load(model_dir("modernbert"))
        .build()
        .unwrap_err()
        .to_string();
    assert!(err.contains("Embedder"), "{err}");
}

/// A decoder embedder in Qwen3-Embedding's layout (config `Qwen3ForCausalLM`, weights saved
/// from the bare decoder, tokenizer appending `<|endoftext|>`, last-token pooling, a `Dense`
/// layer with tanh, `Normalize`, `max_seq_length` and instruction prompts) against
/// sentence-transformers, which pads on the left: token ids (Korean, emoji, truncated long
/// text, prompt), vectors without and with the `query` prompt, in batches of 1, 4 and 8.
#[test]
fn qwen3_embedding_matches_sentence_transformers() {
    let model = load("qwen3-embedding");
    assert!(matches!(
        model.model,
        mlxcel_loading::EmbeddingBackbone::Decoder { .. }
    ));
    assert_eq!(model.head.pooling, vec![mlxcel_arch::Pooling::LastToken]);
    assert_eq!(model.head.dense.len(), 1);
    assert!(model.head.normalize);
    assert_eq!(model.max_tokens, Some(40));
    let dir = model_dir("qwen3-embedding");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let texts: Vec<&str> = reference["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let query = EmbedOptions {
        prompt_name: Some("query".into()),
        overflow: Overflow::Truncate,
        ..EmbedOptions::default()
    };
    let plain = EmbedOptions {
        overflow: Overflow::Truncate,
        ..EmbedOptions::default()
    };
    for (key, options) in [("ids", &plain), ("query_ids", &query)] {
        for (i, t) in texts.iter().enumerate() {
            let want: Vec<u32> = reference[key][i]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(model.tokenize(t, options).unwrap().0, want, "{key} {i}");
        }
    }
    let d = 32;
    let mut worst = 0f32;
    for (name, options) in [("plain", plain), ("query", query)] {
        let want = f32s(&st, name);
        for batch in [1, 4, 8] {
            let options = EmbedOptions {
                batch_size: batch,
                ..options.clone()
            };
            let got = model.embed(&texts, &options).unwrap();
            for (i, g) in got.iter().enumerate() {
                assert_eq!(g.len(), d);
                let w = &want[i * d..(i + 1) * d];
                let (diff, _) = max_abs_diff(g, w);
                worst = worst.max(diff);
                assert!(
                    diff <= 1e-4 && cosine(g, w) >= 0.99999,
                    "{name} text {i} batch {batch}: max |Δ| {diff:.2e}"
                );
            }
        }
    }
    eprintln!("qwen3-embedding: max |Δ| {worst:.2e} over both prompts and batch sizes");
    // A generator without sentence-transformers modules stays a generator.
    let err = load_embedding_model(model_dir("qwen3"), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("not an embedding model"), "{err}");
}

/// A tiny EmbeddingGemma (`gemma3_text` with `use_bidirectional_attention`: layer 0 sliding
/// with window 6, i.e. 3 positions either side; layer 1 full; mean pooling, two bias-free
/// `Dense` projections 64 → 256 → 64, `Normalize`, EmbeddingGemma's prompts) against
/// sentence-transformers: token ids, vectors without a prompt and with the `query` and
/// `document` prompts in batches of 1, 4 and 8, and Matryoshka truncation to 32 dimensions
/// (`truncate_dim` + `normalize_embeddings`). The generator checked that a causal run or one
/// without the window gives other vectors.
#[test]
fn embeddinggemma_matches_sentence_transformers() {
    let model = load("embeddinggemma");
    assert!(matches!(
        model.model,
        mlxcel_loading::EmbeddingBackbone::Decoder {
            bidirectional: true,
            ..
        }
    ));
    assert_eq!(model.head.pooling, vec![mlxcel_arch::Pooling::Mean]);
    assert_eq!(model.head.dense.len(), 2);
    assert!(model.head.normalize);
    assert_eq!(model.max_tokens, Some(48));
    let dir = model_dir("embeddinggemma");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let texts: Vec<&str> = reference["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let with_prompt = |prompt: Option<&str>| EmbedOptions {
        prompt_name: prompt.map(str::to_string),
        overflow: Overflow::Truncate,
        ..EmbedOptions::default()
    };
    for (key, options) in [
        ("ids", with_prompt(None)),
        ("query_ids", with_prompt(Some("query"))),
    ] {
        for (i, t) in texts.iter().enumerate() {
            let want: Vec<u32> = reference[key][i]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(model.tokenize(t, &options).unwrap().0, want, "{key} {i}");
        }
    }
    let truncated = EmbedOptions {
        dimensions: Some(32),
        ..with_prompt(Some("query"))
    };
    let mut worst = 0f32;
    for (name, options, d) in [
        ("plain", with_prompt(None), 64),
        ("query", with_prompt(Some("query")), 64),
        ("document", with_prompt(Some("document")), 64),
        ("query_truncated", truncated, 32),
    ] {
        let want = f32s(&st, name);
        for batch in [1, 4, 8] {
            let options = EmbedOptions {
                batch_size: batch,
                ..options.clone()
            };
            let got = model.embed(&texts, &options).unwrap();
            for (i, g) in got.iter().enumerate() {
                assert_eq!(g.len(), d, "{name}");
                let w = &want[i * d..(i + 1) * d];
                let (diff, _) = max_abs_diff(g, w);
                worst = worst.max(diff);
                assert!(
                    diff <= 1e-4 && cosine(g, w) >= 0.99999,
                    "{name} text {i} batch {batch}: max |Δ| {diff:.2e}"
                );
            }
        }
    }
    eprintln!("embeddinggemma: max |Δ| {worst:.2e} over three prompts, truncation and batch sizes");
}

/// A decoder configured bidirectional must be plain key/value attention in every layer: one
/// with multi-head latent attention (DeepSeek V2, whose layers read a latent cache) is refused
/// by name rather than run causally.
#[test]
fn bidirectional_latent_attention_decoders_are_refused_by_name() {
    let dir = mlxcel_tests::copy_fixture("deepseek_v2");
    let path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["use_bidirectional_attention"] = Value::Bool(true);
    std::fs::write(&path, config.to_string()).unwrap();
    let err = load_embedding_model(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("use_bidirectional_attention") && err.contains("not a key/value attention"),
        "{err}"
    );
}

/// The real all-MiniLM-L6-v2 on 281 varied sentences (English variants, Korean, emoji, accents,
/// texts truncated at 256 tokens) against sentence-transformers' `encode` (batches of 32):
/// token ids identical to the HF tokenizer's, cosine ≥ 0.99999 and max |Δ| ≤ 1e-4 per sentence.
/// Skipped, saying so, when `cargo xtask fetch-models` has not run.
#[test]
fn minilm_many_sentences_match_sentence_transformers() {
    let cache = mlxcel_core::cache_dir().unwrap_or_default();
    let folder = cache.join("models/all-MiniLM-L6-v2");
    if !folder.join("config.json").is_file() {
        println!(
            "skip: {} missing (run `cargo xtask fetch-models`)",
            folder.display()
        );
        return;
    }
    let model = load_embedding_model(&folder, &LoadOptions::default()).unwrap();
    let dir = fixtures_dir().join("real/minilm");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("many.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("many.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want = f32s(&st, "normalized");
    let sentences = reference["sentences"].as_array().unwrap();
    assert!(sentences.len() >= 250, "{}", sentences.len());
    let texts: Vec<&str> = sentences
        .iter()
        .map(|s| s["text"].as_str().unwrap())
        .collect();
    let options = EmbedOptions {
        overflow: Overflow::Truncate,
        ..EmbedOptions::default()
    };
    let mut truncated = 0;
    for (s, t) in sentences.iter().zip(&texts) {
        let ids: Vec<u32> = s["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let (got, cut) = model.tokenize(t, &options).unwrap();
        assert_eq!(got, ids, "token ids of {t:?}");
        truncated += cut as usize;
    }
    assert_eq!(truncated as u64, reference["truncated"].as_u64().unwrap());
    let got = model.embed(&texts, &options).unwrap();
    let d = 384;
    let (mut worst, mut worst_cos) = (0f32, 1f64);
    for (i, g) in got.iter().enumerate() {
        let w = &want[i * d..(i + 1) * d];
        let (diff, _) = max_abs_diff(g, w);
        let cos = cosine(g, w);
        assert!(
            cos >= 0.99999 && diff <= 1e-4,
            "sentence {i}: cosine {cos}, max |Δ| {diff:.2e}"
        );
        worst = worst.max(diff);
        worst_cos = worst_cos.min(cos);
    }
    eprintln!(
        "minilm: {} sentences ({truncated} truncated), max |Δ| {worst:.2e}, min cosine {worst_cos:.8}",
        texts.len()
    );
}
