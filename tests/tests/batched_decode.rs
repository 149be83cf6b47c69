//! Batched decode ([`mlxcel_arch::generate::step_batch`]): several conversations of different
//! lengths advanced by one forward pass give the logits and greedy tokens each gets alone.

use mlxcel_arch::generate::{argmax_token, greedy, step_batch, DecodeBatch, Session, SessionState};
use mlxcel_arch::LanguageModel;
use mlxcel_loading::{load_model, LoadOptions};
use mlxcel_tests::{max_abs_diff, model_dir, reference};

/// Three prompts of different lengths from the fixture's prompt (one longer than the sliding
/// windows of 8, one shorter), decoded together for `steps` tokens.
fn check_batched(name: &str, steps: usize) {
    let options = LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    };
    let loaded = load_model(model_dir(name), &options).unwrap_or_else(|e| panic!("{name}: {e}"));
    let model: &dyn LanguageModel = &loaded.model;
    let prompt = reference(name).prompt_ids;
    let prompts: Vec<&[u32]> = vec![&prompt[..5], &prompt[..23], &prompt[3..14]];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| greedy(model, p, steps, None, |_| false).unwrap())
        .collect();

    let mut states = Vec::new();
    let mut next = Vec::new();
    for p in &prompts {
        let mut s = Session::new(model);
        let (_, logits) = s.prefill(p, None).unwrap();
        next.push(argmax_token(&logits).unwrap());
        states.push(s.into_state());
    }
    let mut got: Vec<Vec<u32>> = next.iter().map(|t| vec![*t]).collect();
    let batched = model.batched_decode();
    let mut batch = None;
    for step in 1..steps {
        let logits = if batched {
            // Merged once; split halfway and merged again, as a scheduler does when the batch
            // changes.
            if step == steps / 2 {
                let b: DecodeBatch = batch.take().unwrap();
                states = b.into_states().unwrap();
            }
            let b = match batch.take() {
                Some(b) => b,
                None => DecodeBatch::new(model, std::mem::take(&mut states))
                    .map_err(|(e, _)| e)
                    .unwrap(),
            };
            let b = batch.insert(b);
            b.step(model, &next).unwrap()
        } else {
            let mut refs: Vec<&mut SessionState> = states.iter_mut().collect();
            step_batch(model, &mut refs, &next).unwrap()
        };
        assert_eq!(logits.shape()[0], prompts.len() as i32);
        // Row i equals conversation i's own step.
        for (i, p) in prompts.iter().enumerate() {
            let mut history = p.to_vec();
            history.extend(&got[i]);
            let row = logits
                .slice_axis(0, i as i32, i as i32 + 1)
                .unwrap()
                .reshape(&[-1])
                .unwrap();
            let mut s = Session::new(model);
            let (_, want) = s.prefill(&history, None).unwrap();
            let want = want.to_vec::<f32>().unwrap();
            let (d, _) = max_abs_diff(&row.to_vec::<f32>().unwrap(), &want);
            // The parity tests' float32 bound: max(1e-4, 2e-5 · max |logit|).
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let bound = (2e-5 * scale).max(1e-4);
            assert!(
                d <= bound,
                "{name}: row {i} at step {step}: |Δlogit| {d:.2e} > {bound:.2e}"
            );
            next[i] = argmax_token(&row).unwrap();
            got[i].push(next[i]);
        }
    }
    assert_eq!(got, alone, "{name}: batched greedy differs from each alone");
    if let Some(b) = batch {
        states = b.into_states().unwrap();
    }
    // The conversations' own caches continue exactly where the batch left them.
    for (i, s) in states.into_iter().enumerate() {
        assert_eq!(
            s.tokens().len(),
            prompts[i].len() + steps - 1,
            "{name}: recorded tokens"
        );
        let mut session = Session::resume(model, s);
        let logits = session.step(next[i]).unwrap();
        let mut history = prompts[i].to_vec();
        history.extend(&got[i]);
        let (_, want) = Session::new(model).prefill(&history, None).unwrap();
        let (d, _) = max_abs_diff(
            &logits.to_vec::<f32>().unwrap(),
            &want.to_vec::<f32>().unwrap(),
        );
        let scale = want
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()));
        let bound = (2e-5 * scale).max(1e-4);
        assert!(
            d <= bound,
            "{name}: row {i} after the batch: |Δlogit| {d:.2e} > {bound:.2e}"
        );
    }
}

#[test]
fn attention_models_decode_as_one_batch() {
    for name in ["llama", "qwen3", "gemma2", "mistral", "mixtral", "phi3"] {
        let options = LoadOptions {
            skip_tokenizer: true,
            ..Default::default()
        };
        let loaded = load_model(model_dir(name), &options).unwrap();
        assert!(loaded.model.batched_decode(), "{name} should batch");
        check_batched(name, 6);
    }
}

#[test]
fn models_that_cannot_batch_step_each_conversation() {
    for name in ["mamba2", "jamba", "deepseek_v2"] {
        let options = LoadOptions {
            skip_tokenizer: true,
            ..Default::default()
        };
        let loaded = load_model(model_dir(name), &options).unwrap();
        assert!(!loaded.model.batched_decode(), "{name} should not batch");
        check_batched(name, 4);
    }
}

#[test]
fn a_batched_step_refuses_mismatched_input() {
    let options = LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    };
    let loaded = load_model(model_dir("llama"), &options).unwrap();
    let model: &dyn LanguageModel = &loaded.model;
    let mut a = SessionState::new(model);
    let mut b = SessionState::new(model);
    let e = step_batch(model, &mut [&mut a, &mut b], &[1]).unwrap_err();
    assert!(e.to_string().contains("one token per conversation"), "{e}");
    let e = step_batch(model, &mut [&mut a, &mut b], &[1, 100_000]).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    // Empty caches cannot join a batch; the states come back.
    let (e, back) = DecodeBatch::new(model, vec![a, b]).unwrap_err();
    assert!(e.to_string().contains("empty cache"), "{e}");
    assert_eq!(back.len(), 2);
}

/// The dense decoders of issue 16 batch too: NoPE layers (smollm3, cohere2), sliding windows
/// with full-width q/k norms (olmo3), parallel blocks with one or two norms, partial rotary and a biased
/// head (phi, gpt_neox), per-head norms (stablelm-parallel), xIELU (apertus).
#[test]
fn dense_decoders_decode_as_one_batch() {
    for name in [
        "olmo3",
        "smollm3",
        "cohere2",
        "phi-tied-qk-layernorm",
        "gpt_neox",
        "stablelm-parallel",
        "apertus",
    ] {
        check_batched(name, 6);
    }
}
