//! `mlxcel-server` in-process on 127.0.0.1 port 0, driven by a raw HTTP/1.1 client: the tiny
//! llama fixture (tokenizer and chat template) always, the real SmolLM2 when
//! `cargo xtask fetch-models` has run.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use mlxcel_models::{Generation, Message, Model};
use mlxcel_server::{spawn, ServerConfig, ServerHandle};
use serde_json::{json, Value};

struct Reply {
    status: u16,
    headers: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of an SSE body.
    fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).expect("utf-8 response");
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a header block");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    let headers = head.to_ascii_lowercase();
    let body = if headers.contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").expect("chunk size line");
        let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
        if size == 0 {
            return out;
        }
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    http(addr, "POST", path, &[], &body.to_string())
}

fn fixture_model() -> Model {
    Model::load(mlxcel_tests::model_dir("llama"))
        .build()
        .expect("the llama fixture loads")
}

fn start(model: &Model, config: ServerConfig) -> ServerHandle {
    spawn(model.clone(), config, "127.0.0.1:0").expect("the server starts")
}

/// The server's greedy chat reply, streamed and not, against `Model::generate`; then a follow-up
/// turn that must reuse the cached prefix.
fn check_chat(model: &Model, addr: SocketAddr, max_tokens: usize) {
    let messages = vec![
        Message::new("system", "You are terse."),
        Message::user("What is the capital of France?"),
    ];
    let want = model
        .generate(
            messages.clone(),
            Generation {
                max_new_tokens: Some(max_tokens),
                ..Generation::default()
            },
        )
        .and_then(|s| s.finish())
        .expect("Model::generate")
        .0;
    let request = json!({
        "model": "anything",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
        ],
        "temperature": 0,
        "max_tokens": max_tokens,
        "user": "ignored",
    });
    let r = post(addr, "/v1/chat/completions", &request);
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["object"], "chat.completion");
    let got = j["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(got, want, "server reply vs Model::generate");
    assert_eq!(j["choices"][0]["message"]["role"], "assistant");
    let finish = j["choices"][0]["finish_reason"]
        .as_str()
        .unwrap_or_default();
    assert!(finish == "stop" || finish == "length", "{finish}");
    let usage = &j["usage"];
    let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let completion = usage["completion_tokens"].as_u64().unwrap_or(0);
    assert!(prompt > 0 && completion > 0, "{usage}");
    assert_eq!(usage["total_tokens"].as_u64(), Some(prompt + completion));
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());

    // Streamed: the deltas concatenate to the same text; a usage chunk, then [DONE].
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = post(addr, "/v1/chat/completions", &streamed);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.headers.contains("text/event-stream"), "{}", r.headers);
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        r.body
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("a JSON chunk"))
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want, "streamed deltas vs Model::generate");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let last = chunks.last().expect("chunks");
    assert_eq!(last["choices"], json!([]), "usage chunk last: {last}");
    assert_eq!(
        last["usage"]["completion_tokens"].as_u64(),
        Some(completion)
    );
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"].as_str() == Some(finish)));

    // A follow-up turn: the conversation's prefix comes from the cache.
    let mut follow = request.clone();
    follow["messages"]
        .as_array_mut()
        .expect("messages")
        .extend([
            json!({"role": "assistant", "content": want}),
            json!({"role": "user", "content": "And of Italy?"}),
        ]);
    let r = post(addr, "/v1/chat/completions", &follow);
    assert_eq!(r.status, 200, "{}", r.body);
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(cached > 0, "follow-up turn reused nothing: {}", r.body);
}

#[test]
fn fixture_model_over_http() {
    let model = fixture_model();
    let server = start(&model, ServerConfig::default());
    let addr = server.addr();

    let r = http(addr, "GET", "/health", &[], "");
    assert_eq!(r.status, 200);
    let r = http(addr, "GET", "/v1/models", &[], "");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["data"][0]["id"], "llama");
    let r = http(addr, "GET", "/", &[], "");
    assert_eq!(r.status, 200);
    assert!(r.headers.contains("text/html"), "{}", r.headers);
    assert!(r.body.contains("<!doctype html>") && r.body.contains("/v1/chat/completions"));
    assert!(
        !r.body.contains("<script src"),
        "the page must be self-contained"
    );

    check_chat(&model, addr, 16);

    // Text completion, plain and streamed.
    let want = model
        .generate(
            "Once upon a time",
            Generation {
                max_new_tokens: Some(8),
                ..Generation::default()
            },
        )
        .and_then(|s| s.finish())
        .expect("Model::generate")
        .0;
    let req = json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0});
    let r = post(addr, "/v1/completions", &req);
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["object"], "text_completion");
    assert_eq!(j["choices"][0]["text"].as_str(), Some(want.as_str()));
    let mut s = req.clone();
    s["stream"] = json!(true);
    let r = post(addr, "/v1/completions", &s);
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        r.body
    );
    let text: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, want);
    assert!(!r.body.contains("\"usage\""), "no usage unless asked");

    // Refusals: 400 with an OpenAI error naming the field.
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        post(addr, "/v1/chat/completions", &body)
    };
    for (extra, param) in [
        (json!({"n": 2}), "n"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (json!({"temperature": -1}), "temperature"),
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"logprobs": true}), "logprobs"),
        (json!({"max_tokens": 100000}), "max_tokens"),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages[0].role",
        ),
    ] {
        let r = chat(extra.clone());
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        let e = r.json();
        assert_eq!(e["error"]["param"], param, "{extra}: {}", r.body);
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    let r = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        "{\"messages\": [",
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("JSON"));
    let r = post(addr, "/v1/completions", &json!({"prompt": 5}));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "prompt");
    let r = http(addr, "GET", "/nope", &[], "");
    assert_eq!(r.status, 404);

    // Metrics count what was served.
    let r = http(addr, "GET", "/metrics", &[], "");
    assert_eq!(r.status, 200);
    let value = |name: &str| -> f64 {
        r.body
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from\n{}", r.body))
    };
    assert!(value("mlxcel_requests_total{endpoint=\"chat\"}") >= 3.0);
    assert!(value("mlxcel_requests_total{endpoint=\"completions\"}") >= 2.0);
    assert!(value("mlxcel_prompt_tokens_total") > 0.0);
    assert!(value("mlxcel_completion_tokens_total") > 0.0);
    assert!(value("mlxcel_reused_prompt_tokens_total") > 0.0);
    assert!(value("mlxcel_last_decode_tokens_per_second") >= 0.0);
    assert!(value("mlxcel_last_prefill_tokens_per_second") > 0.0);
    assert_eq!(value("mlxcel_queue_depth"), 0.0);
    assert_eq!(value("mlxcel_requests_in_flight"), 0.0);
}

#[test]
fn api_key_and_body_limit() {
    let model = fixture_model();
    let server = start(
        &model,
        ServerConfig {
            api_key: Some("sekret".into()),
            body_limit: 1024,
            ..ServerConfig::default()
        },
    );
    let addr = server.addr();
    assert_eq!(http(addr, "GET", "/health", &[], "").status, 200);
    for path in ["/v1/models", "/metrics"] {
        let r = http(addr, "GET", path, &[], "");
        assert_eq!(r.status, 401, "{path}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        let r = http(addr, "GET", path, &[("Authorization", "Bearer wrong")], "");
        assert_eq!(r.status, 401, "{path}");
        let r = http(addr, "GET", path, &[("Authorization", "Bearer sekret")], "");
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    let body =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let r = http(addr, "POST", "/v1/chat/completions", &[], &body);
    assert_eq!(r.status, 401);
    let r = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sekret")],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(4096)}]}).to_string();
    let r = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sekret")],
        &big,
    );
    assert_eq!(r.status, 413, "{}", r.body);
}

#[test]
fn smollm2_over_http() {
    let folder = mlxcel_core::cache_dir()
        .unwrap_or_default()
        .join("models/SmolLM2-135M-Instruct-4bit");
    if !folder.join("config.json").is_file() {
        println!(
            "skip: {} missing (run `cargo xtask fetch-models`)",
            folder.display()
        );
        return;
    }
    let model = Model::load(&folder).build().expect("SmolLM2 loads");
    let server = start(&model, ServerConfig::default());
    check_chat(&model, server.addr(), 24);
}

/// Reads the gauge `name` from `/metrics`.
fn gauge(addr: SocketAddr, name: &str) -> f64 {
    let r = http(addr, "GET", "/metrics", &[], "");
    r.body
        .lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from\n{}", r.body))
}

#[test]
fn smollm2_queue_full_and_disconnect_cancels() {
    let folder = mlxcel_core::cache_dir()
        .unwrap_or_default()
        .join("models/SmolLM2-135M-Instruct-4bit");
    if !folder.join("config.json").is_file() {
        println!(
            "skip: {} missing (run `cargo xtask fetch-models`)",
            folder.display()
        );
        return;
    }
    let model = Model::load(&folder).build().expect("SmolLM2 loads");
    let server = start(
        &model,
        ServerConfig {
            max_queue: 0,
            ..ServerConfig::default()
        },
    );
    let addr = server.addr();
    // A long streamed generation: wait for its first chunk, then it is in flight.
    let body = json!({
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 4000, "stream": true, "temperature": 0.8, "seed": 1,
    })
    .to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = s.read(&mut buf).expect("the stream starts");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(gauge(addr, "mlxcel_requests_in_flight"), 1.0);
    // No room to wait: 429.
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "queue_full");
    // The client goes away: its generation stops long before 4000 tokens.
    drop(s);
    let t = std::time::Instant::now();
    while gauge(addr, "mlxcel_requests_in_flight") > 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the generation went on after its client disconnected"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(gauge(addr, "mlxcel_completion_tokens_total"), 0.0);
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

/// `POST /v1/embeddings` with the bert fixture as the embedding model: the vectors equal
/// `Embedder::embed` (order kept), `dimensions` truncates, bad requests are 400s naming the field,
/// and a server without an embedding model says none is loaded.
#[test]
fn embeddings_endpoint_matches_embedder() {
    use mlxcel_models::Embedder;
    let model = fixture_model();
    let embedder = Embedder::load(mlxcel_tests::model_dir("bert"))
        .build()
        .expect("the bert fixture loads");
    let server = start(
        &model,
        ServerConfig {
            embedder: Some(embedder.clone()),
            ..ServerConfig::default()
        },
    );
    let addr = server.addr();
    let texts = [
        "The quick brown fox.",
        "hello",
        "Embeddings keep their order, even long ones.",
    ];
    let want = embedder.embed(&texts).expect("Embedder::embed");
    let check = |got: &Value, want: &[Vec<f32>]| {
        let data = got["data"].as_array().expect("data");
        assert_eq!(data.len(), want.len());
        for (i, (d, w)) in data.iter().zip(want).enumerate() {
            assert_eq!(d["object"], "embedding");
            assert_eq!(d["index"], i);
            let v: Vec<f32> = d["embedding"]
                .as_array()
                .expect("embedding")
                .iter()
                .map(|x| x.as_f64().expect("number") as f32)
                .collect();
            assert_eq!(v.len(), w.len());
            let diff = v
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff <= 1e-6, "input {i}: max |Δ| {diff}");
        }
    };

    let r = post(
        addr,
        "/v1/embeddings",
        &json!({"model": "bert", "input": texts, "encoding_format": "float"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["object"], "list");
    assert_eq!(j["model"], "bert");
    check(&j, &want);
    let tokens = j["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(tokens >= texts.len() as u64 * 3, "{tokens}");
    assert_eq!(j["usage"]["total_tokens"], tokens);

    // A single string; the reverse order comes back reversed.
    let r = post(addr, "/v1/embeddings", &json!({"input": "hello"}));
    assert_eq!(r.status, 200, "{}", r.body);
    check(&r.json(), &want[1..2]);
    let reversed: Vec<&str> = texts.iter().rev().copied().collect();
    let r = post(addr, "/v1/embeddings", &json!({"input": reversed}));
    let want_rev: Vec<Vec<f32>> = want.iter().rev().cloned().collect();
    check(&r.json(), &want_rev);

    // Matryoshka truncation.
    let width = embedder.info().dimensions;
    let d = (width / 2).max(1);
    let opts = mlxcel_models::EmbedOptions {
        dimensions: Some(d),
        ..embedder.options().clone()
    };
    let want_d = embedder.embed_with(&texts, &opts).expect("embed_with");
    let r = post(
        addr,
        "/v1/embeddings",
        &json!({"input": texts, "dimensions": d}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    check(&r.json(), &want_d);

    // Bad requests name the field.
    for (body, param) in [
        (
            json!({"input": "x", "encoding_format": "base64"}),
            "encoding_format",
        ),
        (json!({"model": "bert"}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": 3}), "input"),
        (json!({"input": ["a", [1, 2]]}), "input[1]"),
        (json!({"input": ["a", ""]}), "input[1]"),
        (json!({"input": "x", "dimensions": 0}), "dimensions"),
        (json!({"input": "x", "dimensions": width + 1}), "dimensions"),
        (json!({"input": "x", "dimensions": "8"}), "dimensions"),
        (json!({"input": "x", "model": 5}), "model"),
        (json!({"input": "x", "bogus": 1}), "bogus"),
    ] {
        let r = post(addr, "/v1/embeddings", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{body}: {}", r.body);
    }
    let r = http(addr, "POST", "/v1/embeddings", &[], "{not json");
    assert_eq!(r.status, 400, "{}", r.body);

    // Listed in /v1/models.
    let r = http(addr, "GET", "/v1/models", &[], "");
    let ids: Vec<String> = r.json()["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_string))
        .collect();
    assert!(ids.contains(&"bert".to_string()), "{ids:?}");

    // Without an embedding model.
    let plain = start(&model, ServerConfig::default());
    let r = post(plain.addr(), "/v1/embeddings", &json!({"input": "hello"}));
    assert_eq!(r.status, 404, "{}", r.body);
    let msg = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(msg.contains("no embedding model is loaded"), "{msg}");
}

/// `POST /v1/rerank` (Cohere/Jina style) with the bert cross-encoder fixture: relevance scores
/// equal sentence-transformers' (the fixture's reference), best first, `top_n` and
/// `return_documents` honoured, `{"text": ..}` documents accepted, bad requests are 400s naming
/// the field, and a server without a reranker says none is loaded.
#[test]
fn rerank_endpoint_matches_sentence_transformers() {
    use mlxcel_models::Reranker;
    let model = fixture_model();
    let reranker = Reranker::load(mlxcel_tests::model_dir("bert-reranker"))
        .overflow(mlxcel_models::Overflow::Truncate)
        .build()
        .expect("the bert-reranker fixture loads");
    let server = start(
        &model,
        ServerConfig {
            reranker: Some(reranker),
            ..ServerConfig::default()
        },
    );
    let addr = server.addr();
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(mlxcel_tests::model_dir("bert-reranker").join("reference.json"))
            .expect("reference.json"),
    )
    .expect("valid JSON");
    // The first three pairs share the query.
    let pairs = &reference["pairs"].as_array().expect("pairs")[..3];
    let query = pairs[0]["query"].as_str().expect("query");
    let docs: Vec<&str> = pairs
        .iter()
        .map(|p| p["document"].as_str().expect("document"))
        .collect();
    let want: Vec<f64> = pairs
        .iter()
        .map(|p| p["score"].as_f64().expect("score"))
        .collect();

    let r = post(
        addr,
        "/v1/rerank",
        &json!({"model": "bert-reranker", "query": query, "documents": docs}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["model"], "bert-reranker");
    let results = j["results"].as_array().expect("results");
    assert_eq!(results.len(), 3);
    let mut previous = f64::INFINITY;
    for res in results {
        let i = res["index"].as_u64().expect("index") as usize;
        let s = res["relevance_score"].as_f64().expect("relevance_score");
        assert!(
            (s - want[i]).abs() <= 1e-4,
            "document {i}: {s} vs {}",
            want[i]
        );
        assert!(s <= previous, "best first");
        previous = s;
        assert!(res.get("document").is_none());
    }
    assert!(j["usage"]["total_tokens"].as_u64().expect("tokens") > 0);

    // top_n, return_documents, {"text": ...} documents.
    let objects: Vec<Value> = docs.iter().map(|d| json!({"text": d})).collect();
    let r = post(
        addr,
        "/v1/rerank",
        &json!({"query": query, "documents": objects, "top_n": 1, "return_documents": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let results = r.json()["results"].as_array().expect("results").clone();
    assert_eq!(results.len(), 1);
    let best = (0..3)
        .max_by(|&a, &b| want[a].total_cmp(&want[b]))
        .expect("best");
    assert_eq!(results[0]["index"], best);
    assert_eq!(results[0]["document"]["text"], docs[best]);

    for (body, param) in [
        (json!({"documents": ["a"]}), "query"),
        (json!({"query": 1, "documents": ["a"]}), "query"),
        (json!({"query": "q"}), "documents"),
        (json!({"query": "q", "documents": []}), "documents"),
        (json!({"query": "q", "documents": ["a", 3]}), "documents[1]"),
        (
            json!({"query": "q", "documents": ["a", ""]}),
            "documents[1]",
        ),
        (
            json!({"query": "q", "documents": ["a"], "top_n": 0}),
            "top_n",
        ),
        (
            json!({"query": "q", "documents": ["a"], "return_documents": "yes"}),
            "return_documents",
        ),
        (
            json!({"query": "q", "documents": ["a"], "bogus": 1}),
            "bogus",
        ),
    ] {
        let r = post(addr, "/v1/rerank", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{body}: {}", r.body);
    }

    let r = http(addr, "GET", "/v1/models", &[], "");
    assert!(r.body.contains("bert-reranker"), "{}", r.body);

    let plain = start(&model, ServerConfig::default());
    let r = post(
        plain.addr(),
        "/v1/rerank",
        &json!({"query": "q", "documents": ["a"]}),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(r.body.contains("no reranker is loaded"), "{}", r.body);
}
