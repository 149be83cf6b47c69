//! Speculative decoding ([`mlxcel_loading::generate_text_speculative`]): a draft model's
//! proposals checked by the model in one pass. The output must be the model's own, token for
//! token, against plain decoding of the same request: greedy and seeded sampling, drafts that
//! agree always (the model itself), rarely (an early-exit draft of the real SmolLM2, a quantized
//! copy of a tiny model), caches that cannot take tokens back (a full sliding-window ring, a
//! recurrent state), and the errors for drafts that cannot propose.

use mlxcel_arch::generate::Session;
use mlxcel_arch::sampling::SamplingParams;
use mlxcel_loading::{
    generate_text, generate_text_speculative, generate_text_with, load_model, Draft,
    GenerateRequest, GenerationStats, LoadOptions, Loaded, SpeculationStats, StepHooks,
};
use mlxcel_tests::{model_dir, reference};

fn load(dir: impl AsRef<std::path::Path>) -> Loaded {
    let dir = dir.as_ref();
    load_model(dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn request(max_new: usize, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        max_new_tokens: max_new,
        sampling,
        ..Default::default()
    }
}

/// Plain decoding of `prompt`, then speculative decoding with `draft` proposing `k` a round,
/// each from fresh sessions: returns both outputs and the speculative run's stats.
fn both(
    model: &Loaded,
    draft: &Loaded,
    k: usize,
    prompt: &[u32],
    req: &GenerateRequest,
) -> (Vec<u32>, Vec<u32>, SpeculationStats) {
    let mut session = model.session();
    let (plain, _) = generate_text(&mut session, None, prompt, req, |_| {}, |_| {}).unwrap();
    let mut session = model.session();
    let mut draft_session = draft.session();
    let (spec, stats): (Vec<u32>, GenerationStats) = generate_text_speculative(
        &mut session,
        Draft {
            session: &mut draft_session,
            tokens: k,
        },
        None,
        prompt,
        req,
        StepHooks::default(),
        |_| {},
        |_, _| {},
    )
    .unwrap();
    // The session holds what was decoded (the last token is not fed, as in plain decoding).
    assert_eq!(
        session.tokens(),
        [prompt, &spec[..spec.len() - 1]].concat(),
        "the model's caches hold the prompt and the kept tokens"
    );
    let s = stats.speculation.expect("speculative stats");
    // The rounds' graph-building and evaluation times are measured and lie within decode time.
    if s.rounds > 0 {
        assert!(s.build_seconds > 0.0 && s.eval_seconds > 0.0, "{s:?}");
        assert!(
            s.build_seconds + s.eval_seconds <= stats.decode_seconds + 1e-6,
            "{s:?} against {} s of decode",
            stats.decode_seconds
        );
    }
    (plain, spec, s)
}

#[test]
fn smollm2_greedy_and_sampled_outputs_are_the_models_own() {
    let Some(folder) = mlxcel_tests::fetched_smollm2() else {
        return;
    };
    let model = load(&folder);
    let tokenizer = model.tokenizer.as_ref().unwrap();
    let prompt = tokenizer
        .encode("The three primary colors are", true)
        .unwrap();
    let early = tempfile::tempdir().unwrap();
    let early_dir = early.path().join("draft");
    mlxcel_loading::speculative::write_early_exit_draft(&folder, &early_dir, 20).unwrap();
    let early_exit = load(&early_dir);
    mlxcel_loading::check_draft_tokenizer(
        (&folder, tokenizer),
        (&early_dir, early_exit.tokenizer.as_ref().unwrap()),
    )
    .unwrap();

    let greedy = request(48, SamplingParams::default());
    // The model drafting for itself agrees with every proposal.
    let (plain, spec, stats) = both(&model, &model, 4, &prompt, &greedy);
    assert_eq!(spec, plain);
    assert_eq!(stats.accepted, stats.proposed, "{stats:?}");
    assert!(
        stats.rounds >= 9 && stats.tokens_per_round() > 4.0,
        "{stats:?}"
    );
    // The first 20 of 30 layers agree rarely: most rounds reject, the output is unchanged.
    let (plain, spec, stats) = both(&model, &early_exit, 3, &prompt, &greedy);
    assert_eq!(spec, plain);
    assert!(stats.accepted < stats.proposed, "{stats:?}");
    assert!(stats.rounds > 10, "{stats:?}");

    // Seeded sampling draws once per token in order: the same tokens as without a draft.
    let sampled = request(
        40,
        SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: 11,
            repetition_penalty: 1.1,
            ..Default::default()
        },
    );
    for draft in [&model, &early_exit] {
        let (plain, spec, stats) = both(&model, draft, 3, &prompt, &sampled);
        assert_eq!(spec, plain, "sampled, {stats:?}");
    }

    // Log-probabilities come from the model's own rows, as without a draft.
    let hooks = || StepHooks {
        logprobs: Some(2),
        processor: None,
    };
    let mut plain_lp = Vec::new();
    let mut session = model.session();
    generate_text_with(
        &mut session,
        None,
        &prompt,
        &greedy,
        hooks(),
        |_| {},
        |_, lp| plain_lp.push(lp.unwrap()),
    )
    .unwrap();
    let mut spec_lp = Vec::new();
    let mut session = model.session();
    let mut draft_session = early_exit.session();
    generate_text_speculative(
        &mut session,
        Draft {
            session: &mut draft_session,
            tokens: 3,
        },
        None,
        &prompt,
        &greedy,
        hooks(),
        |_| {},
        |_, lp| spec_lp.push(lp.unwrap()),
    )
    .unwrap();
    assert_eq!(spec_lp.len(), plain_lp.len());
    for (s, p) in spec_lp.iter().zip(&plain_lp) {
        assert_eq!(s.token, p.token);
        assert!((s.logprob - p.logprob).abs() < 1e-3, "{s:?} vs {p:?}");
    }
}

#[test]
fn a_quantized_copy_drafts_for_a_tiny_model() {
    let model = load(model_dir("llama"));
    let draft = load(model_dir("llama-affine4-g32"));
    mlxcel_loading::check_draft_tokenizer(
        (&model.folder, model.tokenizer.as_ref().unwrap()),
        (&draft.folder, draft.tokenizer.as_ref().unwrap()),
    )
    .unwrap();
    let prompt = reference("llama").prompt_ids;
    for k in [1, 2, 5] {
        let (plain, spec, stats) =
            both(&model, &draft, k, &prompt, &request(40, Default::default()));
        assert_eq!(spec, plain, "k = {k}: {stats:?}");
        assert!(stats.rounds > 0 && stats.proposed > 0, "k = {k}: {stats:?}");
    }
}

#[test]
fn caches_that_cannot_take_tokens_back_fall_back_to_plain_steps() {
    // Mistral's sliding window is 8 positions: rounds speculate while the ring is not full,
    // then fall back to one plain step each.
    let model = load(model_dir("mistral"));
    let prompt = &reference("mistral").prompt_ids[..2];
    let (plain, spec, stats) = both(&model, &model, 2, prompt, &request(24, Default::default()));
    assert_eq!(spec, plain);
    assert!(stats.rounds > 0, "{stats:?}");
    assert!(
        stats.rounds * 3 < 24,
        "rounds after the ring filled: {stats:?}"
    );
    // A recurrent state cannot be un-applied: no round speculates.
    let model = load(model_dir("mamba"));
    let prompt = reference("mamba").prompt_ids;
    let (plain, spec, stats) = both(&model, &model, 3, &prompt, &request(12, Default::default()));
    assert_eq!(spec, plain);
    assert_eq!(stats.rounds, 0, "{stats:?}");
}

#[test]
fn drafts_that_cannot_propose_are_refused_by_name() {
    let a = load(model_dir("llama"));
    // The same tokenizer with two tokens' ids swapped.
    let other = mlxcel_tests::copy_fixture("llama");
    let path = other.path().join("tokenizer.json");
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = tokenizer["model"]["vocab"].as_object_mut().unwrap();
    vocab.insert("!".into(), 4.into());
    vocab.insert("\"".into(), 3.into());
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let err = mlxcel_loading::check_draft_tokenizer(
        (&a.folder, a.tokenizer.as_ref().unwrap()),
        (
            other.path(),
            &mlxcel_loading::load_tokenizer(other.path()).unwrap(),
        ),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains(&other.path().display().to_string())
            && err.contains("models/llama")
            && err.contains("token id 3"),
        "{err}"
    );

    let mut session = a.session();
    let mut draft: Session = a.session();
    let prompt = reference("llama").prompt_ids;
    let err = generate_text_speculative(
        &mut session,
        Draft {
            session: &mut draft,
            tokens: 0,
        },
        None,
        &prompt,
        &request(4, Default::default()),
        StepHooks::default(),
        |_| {},
        |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("draft tokens = 0"), "{err}");
    assert!(session.tokens().is_empty(), "nothing was prefilled");

    let dir = tempfile::tempdir().unwrap();
    let err = mlxcel_loading::speculative::write_early_exit_draft(
        &model_dir("llama"),
        &dir.path().join("d"),
        9,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("config.json") && err.contains("1 to 2 layers"),
        "{err}"
    );
}
