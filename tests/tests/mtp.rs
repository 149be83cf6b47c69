//! Self-speculative decoding with the multi-token-prediction (MTP) layers DeepSeek-V3 and
//! GLM-4.5 checkpoints carry ([`mlxcel_loading::generate_text_mtp`]).
//!
//! The fixtures (`tests/fixtures/mtp/*`, made by `make_mtp.py`) are the tiny DeepSeek-V3 and
//! GLM-4.5 models with one MTP layer appended as hub checkpoints store it, trained to predict
//! the model's own greedy tokens two ahead over the prompt and the first half of the
//! continuation. transformers has no MTP forward pass; the reference composes it from
//! transformers' modules (the model's hidden states after the final norm, and layer `n` as
//! transformers builds it): the MTP logits of every position of prompt + continuation.
//!
//! Checked: the MTP logits against that reference (all rows in one pass, and fed in two
//! pieces through the layer's cache); the greedy output equals plain decoding's and
//! transformers' continuation; the acceptance count equals what the reference's drafts imply;
//! a model loaded without `mtp`, and a checkpoint without MTP layers, are clear errors.

use mlxcel_arch::LanguageModel;
use mlxcel_core::Array;
use mlxcel_loading::{
    generate_text, generate_text_mtp, load_model, GenerateRequest, LoadOptions, Loaded, StepHooks,
};
use mlxcel_tests::{fixtures_dir, floats, max_abs_diff};

const FAMILIES: [&str; 2] = ["deepseek_v3", "glm4_moe"];

struct MtpReference {
    ids: Vec<u32>,
    prompt_len: usize,
    /// `[ids.len() - 1, vocab]`: row i predicts `ids[i + 2]`.
    logits: Vec<f32>,
    vocab: usize,
}

fn reference(family: &str) -> MtpReference {
    let path = fixtures_dir()
        .join("mtp")
        .join(family)
        .join("mtp_reference.safetensors");
    let map = mlxcel_core::WeightMap::open_file(&path).unwrap();
    let ints = |name: &str| -> Vec<i32> { map.get(name).unwrap().to_vec::<i32>().unwrap() };
    let ids: Vec<u32> = ints("ids").iter().map(|t| *t as u32).collect();
    let logits = map.get("mtp_logits").unwrap();
    let vocab = logits.shape()[1] as usize;
    MtpReference {
        prompt_len: ints("prompt_len")[0] as usize,
        logits: logits.to_vec::<f32>().unwrap(),
        vocab,
        ids,
    }
}

/// The checkpoint in `dir`, with its MTP layers built when `mtp`.
fn load_dir(dir: impl AsRef<std::path::Path>, mtp: bool) -> mlxcel_loading::Result<Loaded> {
    let options = LoadOptions {
        skip_tokenizer: true,
        mtp,
        ..Default::default()
    };
    load_model(dir, &options)
}

/// The MTP fixture of `family`.
fn load(family: &str, mtp: bool) -> mlxcel_loading::Result<Loaded> {
    load_dir(fixtures_dir().join("mtp").join(family), mtp)
}

fn ids_array(ids: &[u32]) -> Array {
    let v: Vec<i32> = ids.iter().map(|t| *t as i32).collect();
    Array::from_slice(&v, &[1, v.len() as i32]).unwrap()
}

/// The MTP logits of every position of `r.ids` but the last, fed to the MTP layer in pieces
/// starting at `splits` (through its cache).
fn mtp_logits(model: &dyn LanguageModel, r: &MtpReference, splits: &[usize]) -> Vec<f32> {
    let mtp = model.mtp().expect("MTP layers were built");
    let mut caches = model.make_caches();
    let (_, hidden) = mtp
        .forward_with_hidden(&ids_array(&r.ids), &mut caches, false)
        .unwrap();
    let rows = r.ids.len() - 1;
    let mut mtp_caches = mtp.mtp_caches();
    let mut bounds = splits.to_vec();
    bounds.push(rows);
    let mut out = Vec::new();
    let mut start = 0;
    for end in bounds {
        let positions: Vec<i32> = (start as i32..end as i32).collect();
        let (logits, _) = mtp
            .mtp_forward(
                0,
                &hidden.slice_axis(1, start as i32, end as i32).unwrap(),
                &ids_array(&r.ids[start + 1..end + 1]),
                &Array::from_slice(&positions, &[positions.len() as i32]).unwrap(),
                &mut mtp_caches[0],
            )
            .unwrap();
        out.extend(floats(&logits));
        start = end;
    }
    out
}

#[test]
fn mtp_logits_match_the_transformers_composed_reference() {
    for family in FAMILIES {
        let r = reference(family);
        let loaded = load(family, true).unwrap();
        let model = &loaded.model;
        assert_eq!(model.mtp().unwrap().mtp_layers(), 1, "{family}");
        let scale = r.logits.iter().fold(0f32, |m, v| m.max(v.abs()));
        for splits in [vec![], vec![r.prompt_len - 1, r.prompt_len + 5]] {
            let got = mtp_logits(model, &r, &splits);
            assert_eq!(got.len(), r.logits.len(), "{family}");
            let (diff, at) = max_abs_diff(&got, &r.logits);
            eprintln!(
                "{family} (pieces from {splits:?}): max |diff| {diff:.2e} of {scale:.1} at row {}",
                at / r.vocab
            );
            assert!(
                diff <= 1e-4 * scale.max(1.0),
                "{family}: MTP logits differ from the reference by {diff} (row {})",
                at / r.vocab
            );
        }
    }
}

/// What a round-by-round run with one draft a round accepts, from the reference's drafts:
/// `(rounds, accepted)` for `new` generated tokens after the prompt.
fn expected_acceptance(r: &MtpReference, new: usize) -> (usize, usize) {
    let drafts: Vec<u32> = r
        .logits
        .chunks(r.vocab)
        .map(|row| {
            row.iter()
                .enumerate()
                .fold(
                    (0, f32::MIN),
                    |best, (i, v)| if *v > best.1 { (i, *v) } else { best },
                )
                .0 as u32
        })
        .collect();
    // `m`: the position of the last emitted token, not yet fed.
    let (mut m, mut generated, mut rounds, mut accepted) = (r.prompt_len, 1, 0, 0);
    while generated < new {
        if new - generated >= 2 {
            rounds += 1;
            // The draft for ids[m + 1] comes from MTP row m - 1.
            if drafts[m - 1] == r.ids[m + 1] {
                accepted += 1;
                generated += 2;
                m += 2;
                continue;
            }
        }
        generated += 1;
        m += 1;
    }
    (rounds, accepted)
}

/// Self-speculative decoding of `prompt` with `k` drafts a round.
fn speculate(
    session: &mut mlxcel_arch::generate::Session<'_>,
    k: usize,
    prompt: &[u32],
    req: &GenerateRequest,
) -> (Vec<u32>, mlxcel_loading::GenerationStats) {
    generate_text_mtp(
        session,
        k,
        None,
        prompt,
        req,
        StepHooks::default(),
        |_| {},
        |_, _| {},
    )
    .unwrap()
}

#[test]
fn mtp_speculation_keeps_the_models_greedy_output() {
    for family in FAMILIES {
        let r = reference(family);
        let loaded = load(family, true).unwrap();
        let prompt = &r.ids[..r.prompt_len];
        let new = r.ids.len() - r.prompt_len;
        let req = GenerateRequest {
            max_new_tokens: new,
            eos_token_ids: Vec::new(),
            ..Default::default()
        };
        let mut session = loaded.session();
        let (plain, _) = generate_text(&mut session, None, prompt, &req, |_| {}, |_| {}).unwrap();
        assert_eq!(
            plain,
            r.ids[r.prompt_len..],
            "{family}: plain decoding vs transformers"
        );
        let mut session = loaded.session();
        let (spec, stats) = speculate(&mut session, 1, prompt, &req);
        assert_eq!(spec, plain, "{family}: MTP speculation changed the output");
        assert_eq!(
            session.tokens(),
            [prompt, &spec[..spec.len() - 1]].concat(),
            "{family}: the caches hold the prompt and the kept tokens"
        );
        let s = stats.speculation.expect("speculation stats");
        let (rounds, accepted) = expected_acceptance(&r, new);
        eprintln!(
            "{family}: {} rounds, {} of {} drafts accepted ({:.0}%)",
            s.rounds,
            s.accepted,
            s.proposed,
            100.0 * s.acceptance_rate()
        );
        assert_eq!((s.rounds, s.accepted), (rounds, accepted), "{family}");
        assert!(
            accepted > 0 && accepted < rounds,
            "{family}: both outcomes ran"
        );

        // A follow-up request in the same session: the caches' prefix is reused (the MTP rows
        // start after it, at their real positions); the output is still plain decoding's.
        let longer = [prompt, &spec[..6]].concat();
        let short = GenerateRequest {
            max_new_tokens: 8,
            ..req.clone()
        };
        let (again, stats) = speculate(&mut session, 1, &longer, &short);
        assert!(
            stats.reused_tokens > prompt.len(),
            "{family}: the prefix was reused"
        );
        let (fresh, _) =
            generate_text(&mut loaded.session(), None, &longer, &short, |_| {}, |_| {}).unwrap();
        assert_eq!(again, fresh, "{family}: MTP after a reused prefix");

        // Two drafts a round (the one MTP layer chained over its own output): same output.
        let (chained, stats) = speculate(&mut loaded.session(), 2, prompt, &req);
        assert_eq!(chained, plain, "{family}: two drafts a round");
        let s = stats.speculation.unwrap();
        assert!(s.proposed > s.rounds, "{family}: {s:?}");
    }
}

#[test]
fn mtp_needs_the_layers_and_the_load_option() {
    // Loaded without `mtp`: the layers are skipped, the model's logits unchanged.
    let loaded = load("deepseek_v3", false).unwrap();
    assert!(loaded.model.mtp().is_none());
    let r = reference("deepseek_v3");
    let mut session = loaded.session();
    let err = generate_text_mtp(
        &mut session,
        1,
        None,
        &r.ids[..r.prompt_len],
        &GenerateRequest::default(),
        StepHooks::default(),
        |_| {},
        |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("multi-token-prediction layers"), "{err}");
    let plain = mlxcel_tests::logits_for(&loaded.model, &r.ids[..r.prompt_len]);
    let base = load_dir(mlxcel_tests::model_dir("deepseek_v3"), false).unwrap();
    let want = mlxcel_tests::logits_for(&base.model, &r.ids[..r.prompt_len]);
    assert_eq!(plain, want, "the MTP layer changed the model's own logits");

    // A checkpoint without MTP layers (the plain fixture; conversions that dropped them).
    let err = load_dir(mlxcel_tests::model_dir("glm4_moe"), true)
        .map(|_| ())
        .expect_err("no MTP layers")
        .to_string();
    assert!(err.contains("num_nextn_predict_layers"), "{err}");
    let dir = mlxcel_tests::copy_fixture("deepseek_v3");
    let err = load_dir(dir.path(), true)
        .map(|_| ())
        .expect_err("config names an MTP layer the weights lack")
        .to_string();
    assert!(err.contains("model.layers.2.eh_proj.weight"), "{err}");
}
