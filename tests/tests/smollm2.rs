//! The real model: SmolLM2-135M-Instruct as `cargo xtask fetch-models` imports it from its GGUF
//! (Q4_1 → MLX affine 4-bit, losslessly), against goldens from transformers running the same GGUF
//! dequantized in float32 (`tests/fixtures/real/smollm2/`). Skips, saying so, when the model has
//! not been fetched (CI fetches it first).

use mlxcel_arch::generate::Session;
use mlxcel_arch::sampling::SamplingParams;
use mlxcel_core::Array;
use mlxcel_loading::{
    generate_text, load_model, GenerateRequest, LanguageModel, LoadOptions, Loaded, Message,
    StreamDecoder,
};
use mlxcel_tests::fixtures_dir;
use serde_json::Value;

fn smollm2() -> Option<Loaded> {
    let folder = mlxcel_tests::fetched_smollm2()?;
    Some(load_model(&folder, &LoadOptions::default()).unwrap())
}

fn golden(name: &str) -> Value {
    let path = fixtures_dir().join("real/smollm2").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn messages(v: &Value) -> Vec<Message> {
    serde_json::from_value(v.clone()).unwrap()
}

fn greedy_request(loaded: &Loaded, max_new: usize, chunk: Option<usize>) -> GenerateRequest {
    GenerateRequest {
        max_new_tokens: max_new,
        eos_token_ids: loaded.eos_token_ids.clone(),
        prefill_chunk: chunk,
        ..Default::default()
    }
}

#[test]
fn chat_prompts_answer_with_the_golden_text() {
    let Some(loaded) = smollm2() else { return };
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let template = loaded
        .chat_template
        .as_ref()
        .expect("SmolLM2 ships a chat template");
    let g = golden("greedy.json");
    let max_new = g["max_new_tokens"].as_u64().unwrap() as usize;
    for (i, chat) in g["chats"].as_array().unwrap().iter().enumerate() {
        let text = template.render(&messages(&chat["messages"]), true).unwrap();
        assert_eq!(
            text,
            chat["prompt_text"].as_str().unwrap(),
            "chat {i}: rendered template"
        );
        let prompt = tokenizer.encode(&text, false).unwrap();
        assert_eq!(prompt, ids(&chat["prompt_ids"]), "chat {i}: prompt ids");
        let chunks: &[Option<usize>] = if i == 0 { &[None, Some(8)] } else { &[None] };
        for chunk in chunks {
            let mut session = Session::new(&loaded.model);
            let mut streamed = String::new();
            let (out, _) = generate_text(
                &mut session,
                Some(tokenizer),
                &prompt,
                &greedy_request(&loaded, max_new, *chunk),
                |t| streamed.push_str(t),
                |_| {},
            )
            .unwrap();
            // The golden ids end with the EOS token when generation stopped there; ours stop
            // before it.
            let mut want = ids(&chat["greedy_ids"]);
            if chat["stopped_at_eos"].as_bool() == Some(true) {
                assert!(
                    loaded.eos_token_ids.contains(&want.pop().unwrap()),
                    "chat {i}: golden ends at EOS"
                );
            }
            assert_eq!(out, want, "chat {i}: greedy ids (prefill chunk {chunk:?})");
            assert_eq!(
                streamed,
                chat["greedy_text"].as_str().unwrap(),
                "chat {i}: text"
            );
        }
    }
}

#[test]
fn top5_logits_along_the_prompt() {
    let Some(loaded) = smollm2() else { return };
    let g = golden("top5.json");
    let prompt: Vec<i32> = match &g["prompt"] {
        Value::Array(a) => a.iter().map(|x| x.as_i64().unwrap() as i32).collect(),
        _ => ids(&golden("greedy.json")["chats"][0]["prompt_ids"])
            .into_iter()
            .map(|t| t as i32)
            .collect(),
    };
    let tokens = Array::from_slice(&prompt, &[1, prompt.len() as i32]).unwrap();
    let mut caches = loaded.model.make_caches();
    let logits = loaded
        .model
        .forward(&tokens, &mut caches)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let vocab = loaded.model.vocab_size();
    let (top_ids, top_logits) = (
        g["top5_ids"].as_array().unwrap(),
        g["top5_logits"].as_array().unwrap(),
    );
    assert_eq!(top_ids.len(), prompt.len());
    let mut worst = 0.0f64;
    for (pos, (want_ids, want_logits)) in top_ids.iter().zip(top_logits).enumerate() {
        let row = &logits[pos * vocab..(pos + 1) * vocab];
        for (id, want) in ids(want_ids)
            .into_iter()
            .zip(want_logits.as_array().unwrap())
        {
            let want = want.as_f64().unwrap();
            let rel = (row[id as usize] as f64 - want).abs() / want.abs().max(1.0);
            worst = worst.max(rel);
        }
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|a, b| row[*b].total_cmp(&row[*a]));
        assert_eq!(order[0] as u32, ids(want_ids)[0], "position {pos}: top-1");
    }
    assert!(
        worst <= 1e-3,
        "top-5 logits: max relative error {worst:.2e}"
    );
    eprintln!("SmolLM2 top-5 logits: max relative error {worst:.2e}");
}

#[test]
fn tokenizer_round_trips_and_streams_byte_exact() {
    let Some(loaded) = smollm2() else { return };
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let g = golden("tokenizer_roundtrip.json");
    for case in g["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(
            tokenizer.encode(text, false).unwrap(),
            want,
            "ids of {text:?}"
        );
        assert_eq!(
            tokenizer.decode(&want, false).unwrap(),
            case["decoded"].as_str().unwrap()
        );
        // Streaming one token at a time gives the same bytes, never a broken character.
        let mut stream = StreamDecoder::new(tokenizer, false);
        let mut out = String::new();
        for id in &want {
            let piece = stream.push(*id).unwrap();
            assert!(
                !piece.contains('\u{FFFD}'),
                "{text:?}: replacement character streamed"
            );
            out.push_str(&piece);
        }
        out.push_str(&stream.flush().unwrap());
        assert_eq!(out, case["decoded"].as_str().unwrap(), "streamed {text:?}");
    }
    let korean = "안녕하세요, 세계! 🎉🚀 こんにちは";
    let ids = tokenizer.encode(korean, false).unwrap();
    let mut stream = StreamDecoder::new(tokenizer, false);
    let pieces: Vec<String> = ids.iter().map(|t| stream.push(*t).unwrap()).collect();
    assert!(
        pieces.iter().any(String::is_empty),
        "some tokens end mid-character and are held back"
    );
    assert_eq!(pieces.concat() + &stream.flush().unwrap(), korean);
}

#[test]
fn seeds_reproduce_sampling() {
    let Some(loaded) = smollm2() else { return };
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let prompt = tokenizer.encode("Once upon a time", false).unwrap();
    let run = |seed: u64| {
        let mut request = greedy_request(&loaded, 12, None);
        request.sampling = SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed,
            ..Default::default()
        };
        let mut session = Session::new(&loaded.model);
        generate_text(
            &mut session,
            Some(tokenizer),
            &prompt,
            &request,
            |_| {},
            |_| {},
        )
        .unwrap()
        .0
    };
    let a = run(42);
    assert_eq!(a, run(42), "same seed, same tokens");
    assert!(
        (43..48).any(|s| run(s) != a),
        "other seeds give other samples"
    );
}

#[test]
fn second_chat_turn_reuses_its_prefix() {
    let Some(loaded) = smollm2() else { return };
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let template = loaded.chat_template.as_ref().unwrap();
    // A chat client's system prompt, a first exchange, then a short follow-up.
    let system = "You are a meticulous geography tutor. Answer in one or two sentences, name the \
        country and its capital explicitly, avoid speculation, prefer the official name of a city \
        when it differs from the common one, and mention when a country has more than one capital \
        (for example, for administrative and legislative seats). Keep a friendly, encouraging tone \
        suitable for secondary-school students who are revising for an exam, and do not use lists, \
        tables or markdown formatting of any kind in your answers. When a student asks about a \
        city that is not a capital, say which city is the capital instead and explain briefly why \
        people often confuse the two. When a question is ambiguous, for instance because a region \
        shares its name with a country, answer for the sovereign country and mention the other \
        reading in a short second sentence. If a capital has moved in the last hundred years, name \
        the former capital as well and the year of the move when you are sure of it. Never invent \
        facts; if you are unsure, say so plainly and suggest checking an atlas or an encyclopedia. \
        Spell place names the way English-language atlases do, and give the local name in \
        brackets only when the student asks for it. At the end of a session, if the student asks \
        for a summary, repeat each country and capital that came up in the order they were asked, \
        one sentence per country, without adding anything new.";
    let mut history = vec![
        Message::new("system", system),
        Message::new("user", "What is the capital of France?"),
    ];
    let mut session = Session::new(&loaded.model);
    let prompt = tokenizer
        .encode(&template.render(&history, true).unwrap(), false)
        .unwrap();
    let mut reply = String::new();
    generate_text(
        &mut session,
        Some(tokenizer),
        &prompt,
        &greedy_request(&loaded, 32, None),
        |t| reply.push_str(t),
        |_| {},
    )
    .unwrap();
    let held = session.tokens().len();
    // The client re-sends the reply as text; re-tokenising need not reproduce the sampled ids.
    history.push(Message::new("assistant", &reply));
    history.push(Message::new("user", "And of Germany?"));
    let prompt = tokenizer
        .encode(&template.render(&history, true).unwrap(), false)
        .unwrap();
    let (_, stats) = generate_text(
        &mut session,
        Some(tokenizer),
        &prompt,
        &greedy_request(&loaded, 8, None),
        |_| {},
        |_| {},
    )
    .unwrap();
    let share = stats.reused_tokens as f64 / stats.prompt_tokens as f64;
    assert!(
        share >= 0.95,
        "reused {} of {} prompt tokens",
        stats.reused_tokens,
        stats.prompt_tokens
    );
    // Everything the caches held up to the first differing token was reused.
    let common = session
        .tokens()
        .iter()
        .zip(&prompt)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        stats.reused_tokens >= common.min(held).min(prompt.len() - 1),
        "resumed at {} of {common}",
        stats.reused_tokens
    );
    // And the resumed turn equals a fresh prefill of the same prompt.
    let mut fresh = Session::new(&loaded.model);
    let (a, _) = generate_text(
        &mut fresh,
        Some(tokenizer),
        &prompt,
        &greedy_request(&loaded, 8, None),
        |_| {},
        |_| {},
    )
    .unwrap();
    let (b, _) = generate_text(
        &mut session,
        Some(tokenizer),
        &prompt,
        &greedy_request(&loaded, 8, None),
        |_| {},
        |_| {},
    )
    .unwrap();
    assert_eq!(a, b, "resumed and fresh prefill agree");
}

/// The same GGUF run by llama.cpp (`real/smollm2/llama_cpp_top5.json`, llama-cpp-python 0.3.36):
/// llama.cpp multiplies by activations quantized to 8 bits, so its logits are not those of the
/// exact product of the weights; the band below is what that costs (measured and printed).
/// The top-1 tokens agree except at near ties: at the last position llama.cpp prefers 60 over
/// 504 by 0.35 while transformers' exact forward (top5.json) prefers 504 by 0.08, as mlxcel
/// does; so mlxcel's top-1 must be one that llama.cpp scores within 0.5 of its own top-1.
#[test]
fn top5_logits_match_llama_cpp_on_the_same_gguf() {
    let Some(loaded) = smollm2() else { return };
    let g = golden("llama_cpp_top5.json");
    let prompt: Vec<i32> = ids(&golden("greedy.json")["chats"][0]["prompt_ids"])
        .into_iter()
        .map(|t| t as i32)
        .collect();
    let tokens = Array::from_slice(&prompt, &[1, prompt.len() as i32]).unwrap();
    let mut caches = loaded.model.make_caches();
    let logits = loaded
        .model
        .forward(&tokens, &mut caches)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let vocab = loaded.model.vocab_size();
    let (top_ids, top_logits) = (
        g["top5_ids"].as_array().unwrap(),
        g["top5_logits"].as_array().unwrap(),
    );
    assert_eq!(top_ids.len(), prompt.len());
    let mut worst = 0.0f64;
    let mut disagreements = 0;
    for (pos, (want_ids, want_logits)) in top_ids.iter().zip(top_logits).enumerate() {
        let row = &logits[pos * vocab..(pos + 1) * vocab];
        for (id, want) in ids(want_ids)
            .into_iter()
            .zip(want_logits.as_array().unwrap())
        {
            let want = want.as_f64().unwrap();
            worst = worst.max((row[id as usize] as f64 - want).abs() / want.abs().max(1.0));
        }
        let best = (0..vocab)
            .max_by(|a, b| row[*a].total_cmp(&row[*b]))
            .unwrap() as u32;
        let cpp_ids = ids(want_ids);
        let cpp_logits: Vec<f64> = want_logits
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let at = cpp_ids.iter().position(|i| *i == best);
        assert!(
            at.is_some_and(|k| cpp_logits[0] - cpp_logits[k] <= 0.5),
            "position {pos}: mlxcel's top-1 {best} is not a near tie in llama.cpp's {cpp_ids:?}"
        );
        disagreements += usize::from(at != Some(0));
    }
    assert!(disagreements <= 1, "{disagreements} top-1 disagreements");
    eprintln!("SmolLM2 vs llama.cpp, top-5 logits: max relative error {worst:.2e}");
    // Measured 7.0e-2 (per logit, relative to max(|logit|, 1)).
    assert!(worst <= 0.1, "vs llama.cpp: max relative error {worst:.2e}");
}
