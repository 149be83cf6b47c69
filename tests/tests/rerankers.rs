//! The reranker kind: the three tiny cross-encoder fixtures (`*ForSequenceClassification`)
//! against sentence-transformers' `CrossEncoder.predict` (scores, activation applied) and
//! transformers (raw logits, pair token ids and token types, on Korean, emoji and truncated
//! long pairs); batching against one-by-one; kind selection with no fallback either way.

use mlxcel_loading::{
    load_embedding_model, load_reranker_model, EncodedPair, LoadOptions, Overflow, RerankOptions,
    RerankerLoaded, ScoreActivation,
};
use mlxcel_tests::{copy_fixture, max_abs_diff, model_dir};
use serde_json::Value;

const RERANKERS: [&str; 3] = [
    "bert-reranker",
    "xlm-roberta-reranker",
    "modernbert-reranker",
];

fn load(name: &str) -> RerankerLoaded {
    load_reranker_model(model_dir(name), &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(model_dir(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn f32s(pairs: &[Value], key: &str) -> Vec<f32> {
    pairs
        .iter()
        .map(|p| p[key].as_f64().unwrap() as f32)
        .collect()
}

fn check(name: &str, activation: ScoreActivation) {
    let model = load(name);
    let r = reference(name);
    assert_eq!(model.activation, activation, "{name}");
    assert_eq!(
        model.max_tokens,
        Some(r["max_length"].as_u64().unwrap() as usize)
    );
    let pairs = r["pairs"].as_array().unwrap();
    // Tokenization: the pair template, token types and longest-first truncation of the HF
    // tokenizer (Korean, emoji, and pairs longer than the limit on either side).
    let mut truncated_pairs = 0;
    for (i, p) in pairs.iter().enumerate() {
        let (q, d) = (
            p["query"].as_str().unwrap(),
            p["document"].as_str().unwrap(),
        );
        let (got, truncated) = model.tokenize_pair(q, d).unwrap();
        assert_eq!(got.ids, u32s(&p["ids"]), "{name}: pair {i} ids");
        if let Some(types) = p.get("token_type_ids") {
            assert_eq!(got.type_ids, u32s(types), "{name}: pair {i} token types");
        }
        truncated_pairs += truncated as usize;
    }
    assert_eq!(
        truncated_pairs, 5,
        "{name}: the pairs over 48 tokens are truncated"
    );
    let refs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|p| {
            (
                p["query"].as_str().unwrap(),
                p["document"].as_str().unwrap(),
            )
        })
        .collect();
    let options = RerankOptions {
        overflow: Overflow::Truncate,
        batch_size: 3,
        ..RerankOptions::default()
    };
    let scores = model.score_pairs(&refs, &options).unwrap();
    let (ds, at) = max_abs_diff(&scores, &f32s(pairs, "score"));
    assert!(ds <= 1e-4, "{name}: score max |Δ| {ds:.2e} at pair {at}");
    // Raw logits, each pair alone (no padding) and all in one padded batch.
    let encoded: Vec<EncodedPair> = refs
        .iter()
        .map(|(q, d)| model.tokenize_pair(q, d).unwrap().0)
        .collect();
    let want_logits = f32s(pairs, "logit");
    for batch in [1, 8] {
        let logits = model.score_encoded(&encoded, batch, false).unwrap();
        let (dl, at) = max_abs_diff(&logits, &want_logits);
        assert!(
            dl <= 1e-4,
            "{name}: logit max |Δ| {dl:.2e} at pair {at} (batch {batch})"
        );
    }
    eprintln!("{name}: score max |Δ| {ds:.2e}");
}

#[test]
fn bert_cross_encoder_matches_sentence_transformers() {
    // No activation in the config: sigmoid, sentence-transformers' default for one label.
    check("bert-reranker", ScoreActivation::Sigmoid);
}

#[test]
fn xlm_roberta_cross_encoder_matches_sentence_transformers() {
    // config.json sentence_transformers.activation_fn = Identity.
    check("xlm-roberta-reranker", ScoreActivation::Identity);
}

#[test]
fn modernbert_cross_encoder_matches_sentence_transformers() {
    check("modernbert-reranker", ScoreActivation::Sigmoid);
}

/// Token types matter: the BERT fixture's scores change when the document's types are zeroed
/// (a loader that ignored them would not match the reference above).
#[test]
fn bert_token_types_change_the_score() {
    let model = load("bert-reranker");
    let (pair, _) = model
        .tokenize_pair("Where is the river?", "The river runs to the sea.")
        .unwrap();
    assert!(pair.type_ids.contains(&1), "{:?}", pair.type_ids);
    let zeroed = EncodedPair {
        ids: pair.ids.clone(),
        type_ids: vec![0; pair.ids.len()],
    };
    let s = model.score_encoded(&[pair, zeroed], 2, false).unwrap();
    assert!((s[0] - s[1]).abs() > 1e-3, "{s:?}");
}

#[test]
fn documents_are_scored_in_input_order() {
    for name in RERANKERS {
        let model = load(name);
        let query = "Where does the river valley meet the sea?";
        let docs = [
            "x",
            "The river runs through the valley and reaches the sea at the old harbour.",
            "A small model reads every token of the sentence.",
        ];
        let options = RerankOptions::default();
        let all = model.score(query, &docs, &options).unwrap();
        for (i, d) in docs.iter().enumerate() {
            let one = model.score(query, &[d], &options).unwrap();
            assert!((all[i] - one[0]).abs() <= 1e-5, "{name}: document {i}");
        }
        assert!((all[0] - all[1]).abs() > 1e-4, "{name}: {all:?}");
    }
}

#[test]
fn overlong_pairs_are_refused_when_asked() {
    let model = load("bert-reranker");
    let long = "word ".repeat(100);
    let refuse = RerankOptions {
        overflow: Overflow::Refuse,
        ..RerankOptions::default()
    };
    let err = model
        .score("query", &[long.as_str()], &refuse)
        .unwrap_err()
        .to_string();
    assert!(err.contains("limit of 48 tokens"), "{err}");
}

/// No silent fallback in either direction: a cross-encoder does not embed, an encoder or a
/// generator does not rerank, and the generation loader names the reranker loader.
#[test]
fn kinds_do_not_fall_back() {
    let err = load_embedding_model(model_dir("bert-reranker"), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Reranker checkpoint, not an embedding model"),
        "{err}"
    );
    for other in ["bert", "llama"] {
        let err = load_reranker_model(model_dir(other), &LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not a cross-encoder reranker"),
            "{other}: {err}"
        );
    }
    let err = mlxcel_loading::load_model(model_dir("modernbert-reranker"), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("load_reranker_model"), "{err}");
}

fn edit_config(dir: &std::path::Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

#[test]
fn unsupported_heads_and_activations_are_refused_by_name() {
    let dir = copy_fixture("bert-reranker");
    edit_config(dir.path(), |c| {
        c["architectures"] = serde_json::json!(["DebertaV2ForSequenceClassification"])
    });
    let err = load_reranker_model(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`DebertaV2ForSequenceClassification` is not a supported reranker"),
        "{err}"
    );

    let dir = copy_fixture("bert-reranker");
    edit_config(
        dir.path(),
        |c| {
            c["sentence_transformers"] =
                serde_json::json!({"activation_fn": "torch.nn.modules.activation.Softmax"})
        },
    );
    let err = load_reranker_model(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("Softmax"), "{err}");

    // Two labels in the config, one row in the classifier: the tensor's shape is named.
    let dir = copy_fixture("bert-reranker");
    edit_config(dir.path(), |c| {
        c["id2label"] = serde_json::json!({"0": "LABEL_0", "1": "LABEL_1"})
    });
    let err = load_reranker_model(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tensor `classifier.") && err.contains("expected [2"),
        "{err}"
    );

    // config_sentence_transformers.json wins over config.json, as in sentence-transformers.
    let dir = copy_fixture("xlm-roberta-reranker");
    std::fs::write(
        dir.path().join("config_sentence_transformers.json"),
        r#"{"activation_fn": "torch.nn.modules.activation.Tanh"}"#,
    )
    .unwrap();
    let model = load_reranker_model(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(model.activation, ScoreActivation::Tanh);
}

/// The facade: a `Reranker` handle on its worker thread gives what the pipeline gives.
#[test]
fn facade_reranker_runs_on_its_worker() {
    use mlxcel_models::Reranker;
    let reranker = Reranker::load(model_dir("xlm-roberta-reranker"))
        .build()
        .unwrap();
    assert_eq!(reranker.info().activation, ScoreActivation::Identity);
    let docs = [
        "one document",
        "and another, longer document than the first",
    ];
    let handle = reranker.clone();
    let got = std::thread::spawn(move || handle.score("a query", &docs))
        .join()
        .unwrap()
        .unwrap();
    let want = load("xlm-roberta-reranker")
        .score("a query", &docs, &RerankOptions::default())
        .unwrap();
    assert!(max_abs_diff(&got, &want).0 <= 1e-6);
    let counts = reranker.token_counts("a query", &docs).unwrap();
    assert!(counts[1] > counts[0], "{counts:?}");
}

/// The generative Qwen3 reranker (asked for explicitly) against a reimplementation of the
/// Qwen3-Reranker model card's scoring with transformers on a tiny qwen3: prompt ids (default
/// and custom instruction, Korean, emoji, a truncated long document), P(yes) and the yes − no
/// logit margin. Without the explicit choice the same folder is a generator, not a reranker.
#[test]
fn generative_qwen3_reranker_matches_the_model_card() {
    let err = load_reranker_model(model_dir("qwen3-reranker"), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("load_generative_reranker"), "{err}");
    let model = mlxcel_loading::load_generative_reranker(
        model_dir("qwen3-reranker"),
        &LoadOptions::default(),
    )
    .unwrap();
    let r = reference("qwen3-reranker");
    let pairs = r["pairs"].as_array().unwrap();
    let mut scores = Vec::new();
    let mut margins = Vec::new();
    let mut truncated_pairs = 0;
    for (i, p) in pairs.iter().enumerate() {
        let (q, d) = (
            p["query"].as_str().unwrap(),
            p["document"].as_str().unwrap(),
        );
        let options = RerankOptions {
            overflow: Overflow::Truncate,
            instruction: p["instruction"].as_str().map(str::to_string),
            ..RerankOptions::default()
        };
        let (pair, truncated) = model
            .tokenize_pair_with(q, d, options.instruction.as_deref())
            .unwrap();
        assert_eq!(pair.ids, u32s(&p["ids"]), "pair {i} ids");
        truncated_pairs += truncated as usize;
        scores.push(model.score(q, &[d], &options).unwrap()[0]);
        margins.push(model.score_encoded(&[pair], 1, false).unwrap()[0]);
    }
    assert_eq!(truncated_pairs, 2);
    let (ds, at) = max_abs_diff(&scores, &f32s(pairs, "score"));
    assert!(ds <= 1e-4, "score max |Δ| {ds:.2e} at pair {at}");
    let (dm, at) = max_abs_diff(&margins, &f32s(pairs, "logit_yes_minus_no"));
    assert!(dm <= 1e-4, "yes - no max |Δ| {dm:.2e} at pair {at}");
    eprintln!("qwen3-reranker: score max |Δ| {ds:.2e}, yes - no max |Δ| {dm:.2e}");
    // An instruction is refused by a cross-encoder rather than ignored.
    let err = load("bert-reranker")
        .tokenize_pair_with("q", "d", Some("an instruction"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("generative rerankers"), "{err}");
}
