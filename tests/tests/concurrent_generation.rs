//! Continuous batching through the library's `Model`: generations started together run as one
//! batch on the worker, and each produces exactly what it produces alone — greedy or sampled,
//! with logprobs, cancelled midway, or on a model that cannot batch.

use mlxcel_models::{Generation, Model, Prompt, Sampling};
use mlxcel_tests::{model_dir, reference};

struct Output {
    tokens: Vec<u32>,
    text: String,
    logprobs: Vec<f32>,
}

fn collect(stream: mlxcel_models::TokenStream) -> Output {
    let mut out = Output {
        tokens: Vec::new(),
        text: String::new(),
        logprobs: Vec::new(),
    };
    for piece in stream {
        let piece = piece.unwrap();
        out.tokens.extend(&piece.tokens);
        out.text.push_str(&piece.text);
        out.logprobs
            .extend(piece.logprobs.iter().map(|l| l.logprob));
    }
    out
}

/// Four requests of different lengths and options.
fn requests(name: &str) -> Vec<(Prompt, Generation)> {
    let ids = reference(name).prompt_ids;
    let greedy = |n| Generation {
        max_new_tokens: Some(n),
        // The random fixtures end early at their EOS id otherwise.
        extra_eos_token_ids: vec![],
        ..Generation::default()
    };
    vec![
        (Prompt::Ids(ids[..6].to_vec()), greedy(24)),
        (
            Prompt::Ids(ids[..31].to_vec()),
            Generation {
                logprobs: Some(2),
                ..greedy(17)
            },
        ),
        (
            Prompt::Ids(ids[4..20].to_vec()),
            Generation {
                sampling: Sampling {
                    temperature: 0.8,
                    top_p: 0.9,
                    seed: 7,
                    ..Sampling::default()
                },
                ..greedy(20)
            },
        ),
        (Prompt::Ids(ids[10..13].to_vec()), greedy(9)),
    ]
}

fn check(name: &str, expect_batched: bool) {
    let model = Model::load(model_dir(name)).build().unwrap();
    let solo: Vec<Output> = requests(name)
        .into_iter()
        .map(|(p, g)| collect(model.generate(p, g).unwrap()))
        .collect();
    let before = model.batch_stats().unwrap();
    let streams: Vec<_> = requests(name)
        .into_iter()
        .map(|(p, g)| model.generate(p, g).unwrap())
        .collect();
    let together: Vec<Output> = streams.into_iter().map(collect).collect();
    let after = model.batch_stats().unwrap();
    for (i, (a, b)) in solo.iter().zip(&together).enumerate() {
        assert_eq!(a.tokens, b.tokens, "{name}: request {i} tokens");
        assert_eq!(a.text, b.text, "{name}: request {i} text");
        assert_eq!(a.logprobs.len(), b.logprobs.len(), "{name}: request {i}");
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!(
                (x - y).abs() <= 1e-4,
                "{name}: request {i} logprob {x} vs {y}"
            );
        }
    }
    assert!(solo.iter().all(|o| !o.tokens.is_empty()));
    // Run together, the requests of a model that batches shared forward passes.
    let steps = after.steps - before.steps;
    let rows = after.rows - before.rows;
    if expect_batched {
        assert!(
            after.largest >= 2,
            "{name}: largest batch {}",
            after.largest
        );
        assert!(steps < rows, "{name}: {steps} passes for {rows} rows");
    } else {
        assert_eq!(after.largest, 1, "{name}");
        assert_eq!(steps, rows, "{name}");
    }
}

#[test]
fn concurrent_generations_equal_solo_ones() {
    // Attention-only models batch in one forward pass (sliding windows and MoE included);
    // a state-space model steps each generation in turn, with the same results.
    for (name, batched) in [
        ("llama", true),
        ("gemma2", true),
        ("mixtral", true),
        ("mamba2", false),
    ] {
        check(name, batched);
    }
}

#[test]
fn a_cancelled_generation_leaves_the_batch_without_disturbing_it() {
    let name = "qwen3";
    let model = Model::load(model_dir(name)).build().unwrap();
    let ids = reference(name).prompt_ids;
    let gen = |n| Generation {
        max_new_tokens: Some(n),
        ..Generation::default()
    };
    let alone = collect(
        model
            .generate(Prompt::Ids(ids[..9].to_vec()), gen(30))
            .unwrap(),
    );
    let keep = model
        .generate(Prompt::Ids(ids[..9].to_vec()), gen(30))
        .unwrap();
    let mut cancelled = model
        .generate(Prompt::Ids(ids[2..25].to_vec()), gen(200))
        .unwrap();
    let first = cancelled.next().unwrap().unwrap();
    assert!(!first.tokens.is_empty());
    cancelled.cancel();
    let rest: Vec<_> = cancelled.by_ref().collect();
    assert!(rest.iter().all(|p| p.is_ok()));
    assert_eq!(
        cancelled.stats().map(|s| s.finish),
        Some(mlxcel_models::FinishReason::Cancelled)
    );
    assert!(cancelled.stats().unwrap().generated_tokens < 200);
    assert_eq!(collect(keep).tokens, alone.tokens);
}

/// Forces a fixed token sequence (a scripted reply), whatever the model.
struct Script(Vec<u32>);

impl mlxcel_models::LogitsProcessor for Script {
    fn process(&mut self, generated: &[u32], logits: &mut [f32]) -> Result<(), String> {
        let next = self.0[generated.len().min(self.0.len() - 1)] as usize;
        for (i, l) in logits.iter_mut().enumerate() {
            if i != next {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
}

/// `keep_special_tokens` (what the server sets for harmony-format models, whose replies are
/// channel markup) keeps special tokens in the text; by default they are left out. The reply
/// is scripted: `<|im_start|>` (id 1), two ordinary tokens, `<|im_end|>` (id 2, the fixture's
/// end of sequence, which ends it unseen).
#[test]
fn special_tokens_stay_in_the_text_when_asked() {
    let model = Model::load(model_dir("llama")).build().unwrap();
    let ids = reference("llama").prompt_ids;
    let reply = |keep: bool| {
        let g = Generation {
            max_new_tokens: Some(8),
            keep_special_tokens: keep,
            logits_processor: Some(mlxcel_models::SharedLogitsProcessor::new(Script(vec![
                1, 300, 301, 2,
            ]))),
            ..Generation::default()
        };
        collect(model.generate(Prompt::Ids(ids[..8].to_vec()), g).unwrap())
    };
    let (kept, plain) = (reply(true), reply(false));
    assert_eq!(kept.tokens, vec![1, 300, 301]);
    assert_eq!(plain.tokens, kept.tokens);
    let words = model.decode(&[300, 301]).unwrap();
    assert_eq!(kept.text, format!("<|im_start|>{words}"));
    assert_eq!(plain.text, words);
    // A chat template with harmony's channel markup names that format.
    let template = mlxcel_models::loading::ChatTemplate::new(
        "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}<|start|>assistant<|channel|>final<|message|>",
        &serde_json::json!({}),
    )
    .unwrap();
    assert_eq!(
        template.tool_call_format(),
        Some(mlxcel_models::ToolCallFormat::Harmony)
    );
}

/// Greedy generations without hooks run one step ahead of the host (the next step is queued
/// on the device's picks before they are read). Rows that end at different steps leave such a
/// batch with caches that still agree with their tokens: each conversation's next turn, which
/// reuses those caches, equals the same turn computed from scratch.
#[test]
fn pipelined_greedy_rows_leave_consistent_caches() {
    let name = "llama";
    let model = Model::load(model_dir(name)).build().unwrap();
    let ids = reference(name).prompt_ids;
    let greedy = |n| Generation {
        max_new_tokens: Some(n),
        extra_eos_token_ids: vec![],
        ..Generation::default()
    };
    let firsts: Vec<(Vec<u32>, usize)> = vec![
        (ids[..5].to_vec(), 4),
        (ids[3..20].to_vec(), 11),
        (ids[8..14].to_vec(), 7),
        (ids[1..30].to_vec(), 16),
    ];
    let solo: Vec<Vec<u32>> = firsts
        .iter()
        .map(|(p, n)| collect(model.generate(Prompt::Ids(p.clone()), greedy(*n)).unwrap()).tokens)
        .collect();
    let before = model.batch_stats().unwrap();
    let mut sessions: Vec<_> = firsts.iter().map(|_| model.session()).collect();
    let streams: Vec<_> = sessions
        .iter_mut()
        .zip(&firsts)
        .map(|(s, (p, n))| s.generate(Prompt::Ids(p.clone()), greedy(*n)).unwrap())
        .collect();
    let together: Vec<Vec<u32>> = streams.into_iter().map(|s| collect(s).tokens).collect();
    assert_eq!(together, solo);
    let after = model.batch_stats().unwrap();
    assert!(after.largest >= 2, "largest batch {}", after.largest);
    // Second turns: prompt + reply + more ids, resumed from each session's caches, against a
    // fresh model run of the same ids.
    for (i, (session, ((prompt, _), reply))) in sessions
        .iter_mut()
        .zip(firsts.iter().zip(&together))
        .enumerate()
    {
        let cached = session.cached_tokens().unwrap();
        let mut turn: Vec<u32> = prompt.iter().chain(reply).copied().collect();
        assert!(turn.starts_with(&cached), "row {i}: caches hold {cached:?}");
        turn.extend(&ids[20..26]);
        let mut resumed = session
            .generate(Prompt::Ids(turn.clone()), greedy(6))
            .unwrap();
        let tokens: Vec<u32> = resumed.by_ref().flat_map(|p| p.unwrap().tokens).collect();
        assert!(
            resumed.stats().unwrap().reused_tokens >= prompt.len(),
            "row {i}"
        );
        let fresh = collect(model.generate(Prompt::Ids(turn), greedy(6)).unwrap()).tokens;
        assert_eq!(tokens, fresh, "row {i}");
    }
    assert!(before.steps < after.steps);
}
