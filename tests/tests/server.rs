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

/// Dropping the handle stops the server only after the requests in flight are answered, and
/// returns once the server thread is gone (its listener closed, its hold on the model released):
/// a server still generating at process exit would run MLX while the C++ runtime tears it down.
#[test]
fn dropping_the_handle_answers_requests_in_flight_and_waits_for_the_server() {
    let model = fixture_model();
    let server = start(&model, ServerConfig::default());
    let addr = server.addr();
    let (started_tx, started) = std::sync::mpsc::channel::<()>();
    let client = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let body = json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0.0,
                          "stream": true})
        .to_string();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        // The first event: the request is admitted and generating.
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&raw).contains("data: ") {
            let n = s.read(&mut buf).expect("a response");
            assert!(n > 0, "closed before the first event");
            raw.extend_from_slice(&buf[..n]);
        }
        started_tx.send(()).unwrap();
        s.read_to_end(&mut raw).unwrap();
        String::from_utf8(raw).expect("utf-8 response")
    });
    started.recv().expect("the client saw its first event");
    drop(server);
    assert!(
        TcpStream::connect(addr).is_err(),
        "the listener is closed once the handle is dropped"
    );
    let reply = client.join().expect("the client thread");
    assert!(
        reply.contains("data: [DONE]"),
        "the request in flight was answered to its end: {reply}"
    );
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
            json!({"tools": [{"type": "function", "function": {"name": "f g"}}]}),
            "tools[0].function.name",
        ),
        (json!({"temperature": -1}), "temperature"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "a+"}}}}),
            "response_format.json_schema.schema/pattern",
        ),
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
    // The conversations served stay in the prefix cache's KV caches.
    assert!(value("mlxcel_kv_cache_tokens") > 0.0);
    assert_eq!(value("mlxcel_kv_cache_sessions"), 4.0);
    // The weights alone are live arrays.
    assert!(value("mlxcel_memory_active_bytes") > 0.0);
    assert!(value("mlxcel_memory_peak_bytes") >= value("mlxcel_memory_active_bytes"));
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
    let Some(folder) = mlxcel_tests::fetched_smollm2() else {
        return;
    };
    let model = Model::load(&folder).build().expect("SmolLM2 loads");
    let server = start(&model, ServerConfig::default());
    check_chat(&model, server.addr(), 24);
}

/// Reads the gauge `name` from `/metrics`.
/// Requests sent at the same moment run as one batch on the worker (continuous batching), and
/// each reply equals the model's own solo generation.
#[test]
fn concurrent_requests_are_batched_and_equal_solo_replies() {
    let model = fixture_model();
    let questions = [
        "What is the capital of France?",
        "Name three colours.",
        "Count to five.",
        "Why is the sky blue? Explain slowly.",
    ];
    let max_tokens = 48;
    let want: Vec<String> = questions
        .iter()
        .map(|q| {
            model
                .generate(
                    vec![Message::user(q)],
                    Generation {
                        max_new_tokens: Some(max_tokens),
                        ..Generation::default()
                    },
                )
                .and_then(|s| s.finish())
                .expect("Model::generate")
                .0
        })
        .collect();
    let server = start(
        &model,
        ServerConfig {
            parallel: 4,
            ..ServerConfig::default()
        },
    );
    let addr = server.addr();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(questions.len()));
    let threads: Vec<_> = questions
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let barrier = barrier.clone();
            let body = json!({
                "messages": [{"role": "user", "content": q}],
                "max_tokens": max_tokens, "temperature": 0, "stream": i % 2 == 0,
            });
            std::thread::spawn(move || {
                barrier.wait();
                let r = post(addr, "/v1/chat/completions", &body);
                assert_eq!(r.status, 200, "{}", r.body);
                if body["stream"] == json!(true) {
                    r.events()
                        .iter()
                        .filter(|e| *e != "[DONE]")
                        .map(|e| serde_json::from_str::<Value>(e).expect("a JSON chunk"))
                        .filter_map(|c| {
                            c["choices"][0]["delta"]["content"]
                                .as_str()
                                .map(String::from)
                        })
                        .collect::<String>()
                } else {
                    r.json()["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string()
                }
            })
        })
        .collect();
    let got: Vec<String> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(got, want, "concurrent replies vs Model::generate");
    let largest = gauge(addr, "mlxcel_decode_batch_largest");
    assert!(largest >= 2.0, "the requests never shared a decode pass");
    assert!(
        gauge(addr, "mlxcel_decode_passes_total") < gauge(addr, "mlxcel_decode_batch_rows_total")
    );
}

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
    let Some(folder) = mlxcel_tests::fetched_smollm2() else {
        return;
    };
    let model = Model::load(&folder).build().expect("SmolLM2 loads");
    let server = start(
        &model,
        ServerConfig {
            max_queue: 0,
            parallel: 1,
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
            json!({"input": "x", "encoding_format": "hex"}),
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

/// Log-softmax of the next-token logits of a full forward pass over `ids` (fresh caches).
fn reference_logprobs(model: &Model, ids: &[u32]) -> Vec<f32> {
    let row = model.logits(ids).expect("Model::logits");
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = f64::from(max)
        + row
            .iter()
            .map(|v| f64::from(v - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|v| (f64::from(*v) - log_z) as f32).collect()
}

/// `logprobs`/`top_logprobs` on both endpoints, streamed and not: each generated token's
/// logprob and its top alternatives equal the log-softmax of a full forward pass over the
/// prompt and the tokens before it.
#[test]
fn logprobs_match_full_forward_log_softmax() {
    let model = fixture_model();
    let server = start(&model, ServerConfig::default());
    let addr = server.addr();
    let vocab = model.token_bytes().expect("token bytes");
    let top = 3usize;
    let messages = vec![Message::user("Tell me about cats.")];
    let prompt = model
        .prompt_ids(&mlxcel_models::Prompt::Messages(messages.clone()))
        .expect("prompt ids");
    // The generated ids, from the facade (its logprobs are checked below too).
    let pieces: Vec<mlxcel_models::Piece> = model
        .generate(
            messages,
            Generation {
                max_new_tokens: Some(8),
                logprobs: Some(top),
                ..Generation::default()
            },
        )
        .expect("generate")
        .collect::<Result<_, _>>()
        .expect("pieces");
    let ids: Vec<u32> = pieces.iter().flat_map(|p| p.tokens.clone()).collect();
    let facade: Vec<_> = pieces.iter().flat_map(|p| p.logprobs.clone()).collect();
    assert_eq!(facade.len(), ids.len(), "one logprob per token");
    assert!(!ids.is_empty());

    // The expected (token bytes, logprob, top [(bytes, logprob)]) per step.
    let mut context = prompt.clone();
    let mut worst = 0f32;
    let mut expected = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let lp = reference_logprobs(&model, &context);
        let mut order: Vec<usize> = (0..lp.len()).collect();
        order.sort_by(|a, b| lp[*b].total_cmp(&lp[*a]));
        let want_top: Vec<usize> = order[..top].to_vec();
        assert_eq!(facade[i].token, *id);
        worst = worst.max((facade[i].logprob - lp[*id as usize]).abs());
        let got_top: Vec<usize> = facade[i].top.iter().map(|(t, _)| *t as usize).collect();
        assert_eq!(got_top, want_top, "step {i}: facade top ids");
        for (t, l) in &facade[i].top {
            worst = worst.max((l - lp[*t as usize]).abs());
        }
        expected.push((
            *id,
            lp[*id as usize],
            want_top.iter().map(|t| (*t, lp[*t])).collect::<Vec<_>>(),
        ));
        context.push(*id);
    }
    assert!(
        worst < 1e-4,
        "facade logprobs vs full forward: max |Δ| {worst}"
    );
    println!("facade logprobs vs full-forward log-softmax: max |Δ| {worst:e}");

    let bytes_of = |v: &Value| -> Vec<u8> {
        v.as_array()
            .expect("bytes")
            .iter()
            .map(|b| b.as_u64().expect("byte") as u8)
            .collect()
    };
    let check_chat = |content: &[Value]| {
        assert_eq!(content.len(), expected.len(), "{content:?}");
        let mut worst = 0f32;
        for (entry, (id, lp, tops)) in content.iter().zip(&expected) {
            assert_eq!(bytes_of(&entry["bytes"]), vocab[*id as usize].bytes);
            assert_eq!(
                entry["token"].as_str(),
                Some(String::from_utf8_lossy(&vocab[*id as usize].bytes).as_ref())
            );
            worst = worst.max((entry["logprob"].as_f64().expect("logprob") as f32 - lp).abs());
            let got = entry["top_logprobs"].as_array().expect("top_logprobs");
            assert_eq!(got.len(), tops.len());
            for (g, (t, l)) in got.iter().zip(tops) {
                assert_eq!(bytes_of(&g["bytes"]), vocab[*t].bytes);
                worst = worst.max((g["logprob"].as_f64().expect("logprob") as f32 - l).abs());
            }
        }
        assert!(worst < 1e-4, "server chat logprobs: max |Δ| {worst}");
    };

    let request = json!({
        "messages": [{"role": "user", "content": "Tell me about cats."}],
        "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": top,
    });
    let r = post(addr, "/v1/chat/completions", &request);
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    check_chat(
        j["choices"][0]["logprobs"]["content"]
            .as_array()
            .expect("content"),
    );

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let r = post(addr, "/v1/chat/completions", &streamed);
    assert_eq!(r.status, 200, "{}", r.body);
    let content: Vec<Value> = r
        .events()
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    check_chat(&content);

    // Without logprobs: null.
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(r.json()["choices"][0]["logprobs"], Value::Null);

    // Legacy completions: `logprobs: N` gives tokens, token_logprobs, top_logprobs.
    let text_prompt = "Once upon a time";
    let prompt = model.encode(text_prompt, true).expect("encode");
    let (ids, _) = {
        let pieces: Vec<mlxcel_models::Piece> = model
            .generate(
                text_prompt,
                Generation {
                    max_new_tokens: Some(6),
                    ..Generation::default()
                },
            )
            .expect("generate")
            .collect::<Result<_, _>>()
            .expect("pieces");
        (
            pieces
                .iter()
                .flat_map(|p| p.tokens.clone())
                .collect::<Vec<u32>>(),
            (),
        )
    };
    for stream in [false, true] {
        let r = post(
            addr,
            "/v1/completions",
            &json!({"prompt": text_prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2, "stream": stream}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let choices: Vec<Value> = if stream {
            r.events()
                .iter()
                .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                .map(|c| c["choices"][0]["logprobs"].clone())
                .filter(|l| !l.is_null())
                .collect()
        } else {
            vec![r.json()["choices"][0]["logprobs"].clone()]
        };
        let tokens: Vec<String> = choices
            .iter()
            .flat_map(|l| l["tokens"].as_array().cloned().unwrap_or_default())
            .map(|t| t.as_str().unwrap_or_default().to_string())
            .collect();
        let lps: Vec<f32> = choices
            .iter()
            .flat_map(|l| l["token_logprobs"].as_array().cloned().unwrap_or_default())
            .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
            .collect();
        let offsets: Vec<u64> = choices
            .iter()
            .flat_map(|l| l["text_offset"].as_array().cloned().unwrap_or_default())
            .map(|v| v.as_u64().unwrap_or(u64::MAX))
            .collect();
        assert_eq!(tokens.len(), ids.len(), "stream {stream}");
        let mut context = prompt.clone();
        let mut offset = 0u64;
        for (i, id) in ids.iter().enumerate() {
            let lp = reference_logprobs(&model, &context);
            assert_eq!(
                tokens[i],
                String::from_utf8_lossy(&vocab[*id as usize].bytes)
            );
            assert!(
                (lps[i] - lp[*id as usize]).abs() < 1e-4,
                "step {i}: {} vs {}",
                lps[i],
                lp[*id as usize]
            );
            assert_eq!(offsets[i], offset);
            offset += vocab[*id as usize].bytes.len() as u64;
            context.push(*id);
        }
        let top = choices[0]["top_logprobs"][0]
            .as_object()
            .expect("top_logprobs");
        assert_eq!(top.len(), 2, "{top:?}");
    }

    // Bad values name the field.
    for (body, param) in [
        (
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
            "top_logprobs",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}),
            "logprobs",
        ),
    ] {
        let r = post(addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param);
    }
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "logprobs": 6}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "logprobs");
}

/// Tool declarations and tool-call history reach chat templates as transformers gives them:
/// two tool-calling templates (Hermes/Qwen and Llama 3.1 style) render the cases of
/// `fixtures/chat_tools/golden.json` to exactly the text `apply_chat_template(tools=...)` gave.
#[test]
fn chat_templates_given_tools_match_transformers() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/chat_tools");
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("golden.json")).expect("golden.json"),
    )
    .expect("golden JSON");
    let config = json!({"bos_token": golden["bos_token"], "eos_token": "<|im_end|>"});
    let cases = golden["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 6);
    for case in cases {
        let name = format!("{} / {}", case["template"], case["case"]);
        let source = std::fs::read_to_string(dir.join(case["template"].as_str().unwrap_or("")))
            .expect("template");
        let template = mlxcel_loading::ChatTemplate::new(&source, &config).expect("parses");
        assert!(template.takes_tools(), "{name}");
        let messages: Vec<Message> =
            serde_json::from_value(case["messages"].clone()).expect("messages");
        let tools = case["tools"].as_array().cloned();
        let got = template
            .render_with_tools(&messages, tools.as_deref(), true)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, case["text"].as_str().unwrap_or_default(), "{name}");
    }
}

/// An independent JSON-schema check of the subset the server enforces (type, properties,
/// required, additionalProperties: false, items, minItems/maxItems, minLength/maxLength, enum,
/// const, anyOf, local `$ref`); returns what fails.
fn schema_violation(root: &Value, schema: &Value, v: &Value) -> Option<String> {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let target = root
            .pointer(r.trim_start_matches('#'))
            .expect("$ref target");
        return schema_violation(root, target, v);
    }
    if let Some(options) = schema.get("anyOf").and_then(Value::as_array) {
        if options
            .iter()
            .all(|o| schema_violation(root, o, v).is_some())
        {
            return Some(format!("{v} matches no anyOf option"));
        }
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        if !values.contains(v) {
            return Some(format!("{v} not in enum"));
        }
    }
    if let Some(c) = schema.get("const") {
        if c != v {
            return Some(format!("{v} is not the const {c}"));
        }
    }
    let types: Vec<&str> = match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let type_ok = |t: &str| match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => false,
    };
    if !types.is_empty() && !types.iter().any(|t| type_ok(t)) {
        return Some(format!("{v} is not of type {types:?}"));
    }
    let count = |k: &str| schema.get(k).and_then(Value::as_u64);
    match v {
        Value::Object(o) => {
            let props = schema.get("properties").and_then(Value::as_object);
            for r in schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if !o.contains_key(r.as_str().unwrap_or("")) {
                    return Some(format!("{v} lacks required {r}"));
                }
            }
            for (k, x) in o {
                match props.and_then(|p| p.get(k)) {
                    Some(s) => {
                        if let Some(e) = schema_violation(root, s, x) {
                            return Some(e);
                        }
                    }
                    None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                        return Some(format!("{v} has the undeclared key {k}"))
                    }
                    None => {}
                }
            }
        }
        Value::Array(items) => {
            if count("minItems").is_some_and(|n| (items.len() as u64) < n)
                || count("maxItems").is_some_and(|n| (items.len() as u64) > n)
            {
                return Some(format!("{v}: item count out of range"));
            }
            if let Some(s) = schema.get("items") {
                for x in items {
                    if let Some(e) = schema_violation(root, s, x) {
                        return Some(e);
                    }
                }
            }
        }
        Value::String(s) => {
            let n = s.chars().count() as u64;
            if count("minLength").is_some_and(|m| n < m)
                || count("maxLength").is_some_and(|m| n > m)
            {
                return Some(format!("{v}: length out of range"));
            }
        }
        _ => {}
    }
    None
}

/// Schemas the constrained-output tests use.
fn test_schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer"},
            "ok": {"type": "boolean"},
        }, "required": ["name", "age", "ok"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
            "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
        }, "required": ["color", "scores", "note"]}),
        json!({"$defs": {"point": {"type": "object", "properties": {
                "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
            "type": "object",
            "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
                           "label": {"type": ["string", "null"], "maxLength": 5}},
            "required": ["points", "label"]}),
    ]
}

/// Sends chat requests with `response_format` json_schema (and json_object) at several seeds:
/// every reply parses and validates. Returns how many replies ended by themselves.
fn check_json_output(addr: SocketAddr, max_tokens: usize, seeds: &[u64]) -> usize {
    let mut closed = 0;
    for (i, schema) in test_schemas().iter().enumerate() {
        for &seed in seeds {
            let body = json!({
                "messages": [{"role": "user", "content": "Reply with JSON describing a person."}],
                "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": format!("s{i}"), "schema": schema, "strict": true}},
            });
            let r = post(addr, "/v1/chat/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body);
            let j = r.json();
            let text = j["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default();
            let v: Value = serde_json::from_str(text)
                .unwrap_or_else(|e| panic!("schema {i} seed {seed}: {text:?} does not parse: {e}"));
            if let Some(e) = schema_violation(schema, schema, &v) {
                panic!("schema {i} seed {seed}: {text} violates the schema: {e}");
            }
            closed += usize::from(j["choices"][0]["finish_reason"] == "stop");
        }
    }
    for &seed in seeds {
        let body = json!({
            "messages": [{"role": "user", "content": "JSON please."}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_object"}, "stream": true,
        });
        let r = post(addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let text: String = r
            .events()
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("json_object seed {seed}: {text:?}: {e}"));
        assert!(v.is_object(), "{text}");
    }
    closed
}

/// `response_format` on the random-weight fixture: the model's own choices are noise, so every
/// structural token comes from the grammar's mask and the budget closes the JSON in time.
#[test]
fn json_schema_output_parses_and_validates() {
    let model = fixture_model();
    let server = start(&model, ServerConfig::default());
    let addr = server.addr();
    let t = std::time::Instant::now();
    check_json_output(addr, 48, &[1, 2, 3]);
    println!("fixture: 12 constrained replies in {:.2?}", t.elapsed());
    // The completions endpoint takes `response_format` too.
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Data:", "max_tokens": 30, "temperature": 1.0, "seed": 4,
                "response_format": {"type": "json_object"}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let text = r.json()["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object()),
        "{text:?}"
    );

    // Refusals name the schema keyword; a budget too small for any valid output is refused.
    for (format, param) in [
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "date"}}}}}),
            "response_format.json_schema.schema/properties/a/format",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"schema": {"oneOf": [{"type": "null"}]}}}),
            "response_format.json_schema.schema/oneOf",
        ),
        (json!({"type": "xml"}), "response_format.type"),
    ] {
        let r = post(
            addr,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "response_format": format}),
        );
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                "response_format": {"type": "json_schema", "json_schema": {"schema": test_schemas()[0]}}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "max_tokens");
}

/// The llama fixture with the Hermes tool template (`fixtures/chat_tools/hermes_tools.jinja`)
/// and room for its long system prompt (rotary positions: the context length is only a config
/// number), in a temporary folder.
fn tool_template_fixture(template: &str) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture = mlxcel_tests::model_dir("llama");
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture.join(f), dir.path().join(f)).expect("copy");
    }
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(fixture.join("config.json")).expect("config"))
            .expect("json");
    config["max_position_embeddings"] = json!(4096);
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
    let mut tok: Value = serde_json::from_slice(
        &std::fs::read(fixture.join("tokenizer_config.json")).expect("tokenizer_config"),
    )
    .expect("json");
    tok["chat_template"] = json!(std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/chat_tools")
            .join(template)
    )
    .expect("template"));
    std::fs::write(dir.path().join("tokenizer_config.json"), tok.to_string()).expect("write");
    let model = Model::load(dir.path())
        .build()
        .expect("the fixture copy loads");
    (dir, model)
}

/// `tool_choice` forcing a call: the reply is a `tool_calls` entry (finish_reason `tool_calls`)
/// whose arguments validate against the function's parameters, streamed as `tool_calls`
/// deltas; tool history in OpenAI's shape is accepted.
#[test]
fn forced_tool_calls_come_back_as_tool_calls() {
    // Each template's own call format is forced (and parsed back).
    for (template, format) in [
        ("hermes_tools.jinja", mlxcel_models::ToolCallFormat::Hermes),
        (
            "llama3_tools.jinja",
            mlxcel_models::ToolCallFormat::Llama3Json,
        ),
    ] {
        let (_dir, model) = tool_template_fixture(template);
        assert!(model.template_takes_tools());
        assert_eq!(model.tool_call_format(), Some(format), "{template}");
        check_forced_tool_calls(&model);
    }
}

fn check_forced_tool_calls(model: &Model) {
    let server = start(model, ServerConfig::default());
    let addr = server.addr();
    let weather = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": weather}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
    ]);
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 21}"},
        {"role": "user", "content": "And in Rome?"},
    ]);
    for seed in [1u64, 2, 3] {
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "get_weather"}}),
        ] {
            let body = json!({"messages": messages, "tools": tools, "tool_choice": choice,
                              "max_tokens": 150, "temperature": 1.0, "seed": seed});
            let r = post(addr, "/v1/chat/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body);
            let j = r.json();
            let choice0 = &j["choices"][0];
            assert_eq!(choice0["finish_reason"], "tool_calls", "{}", r.body);
            let calls = choice0["message"]["tool_calls"]
                .as_array()
                .expect("tool_calls");
            assert_eq!(calls.len(), 1, "{}", r.body);
            assert_eq!(calls[0]["type"], "function");
            assert!(calls[0]["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("call_")));
            let name = calls[0]["function"]["name"].as_str().expect("name");
            let args: Value = serde_json::from_str(
                calls[0]["function"]["arguments"]
                    .as_str()
                    .expect("arguments"),
            )
            .expect("arguments parse");
            if name == "get_weather" {
                assert_eq!(schema_violation(&weather, &weather, &args), None, "{args}");
            } else {
                assert_eq!(name, "now", "{}", r.body);
                assert!(
                    choice["type"] != "function",
                    "the named function was forced"
                );
            }
            // Streamed: the same call as tool_calls deltas.
            let mut streamed = body.clone();
            streamed["stream"] = json!(true);
            let r = post(addr, "/v1/chat/completions", &streamed);
            assert_eq!(r.status, 200, "{}", r.body);
            let chunks: Vec<Value> = r
                .events()
                .iter()
                .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                .collect();
            let deltas: Vec<&Value> = chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
                .flatten()
                .collect();
            assert_eq!(deltas.len(), 1, "{}", r.body);
            assert_eq!(deltas[0]["index"], 0);
            assert_eq!(
                deltas[0]["function"], calls[0]["function"],
                "streamed vs not"
            );
            assert!(chunks
                .iter()
                .any(|c| c["choices"][0]["finish_reason"] == "tool_calls"));
        }
    }
    // tool_choice naming an undeclared function; tool_choice none leaves the text alone.
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "tool_choice");
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["choices"][0]["message"]["tool_calls"].is_null());
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "not json"}}]}]}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "messages[0].tool_calls[0]");
}

/// SmolLM2 (when fetched) under `response_format`: valid JSON, and mostly closed by the model
/// itself rather than by the budget.
#[test]
fn smollm2_json_schema_output() {
    let Some(folder) = mlxcel_tests::fetched_smollm2() else {
        return;
    };
    let model = Model::load(&folder).build().expect("SmolLM2 loads");
    let server = start(&model, ServerConfig::default());
    let t = std::time::Instant::now();
    let closed = check_json_output(server.addr(), 64, &[1, 2]);
    println!(
        "SmolLM2: 8 constrained replies in {:.2?}, {closed}/6 schema replies ended by EOS",
        t.elapsed()
    );
}

/// The official `openai` Python client (PyPI `openai`, see `.ci/run`) against the server on the
/// llama fixture (Hermes tool template) with the bert fixture for embeddings and an API key:
/// `tests/openai_client.py` checks chat and completions (greedy text equal to
/// `Model::generate`, streamed and not, usage), embeddings (equal to `Embedder::embed`),
/// logprobs, tool calls, `json_schema` output (a pydantic model through the client's `parse`),
/// and errors. Python is `$MLXCEL_PYTHON` or `python3`; skipped when it cannot import `openai`.
#[test]
fn openai_python_client() {
    let python = std::env::var("MLXCEL_PYTHON").unwrap_or_else(|_| "python3".into());
    let importable = std::process::Command::new(&python)
        .args(["-c", "import openai, pydantic"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !importable {
        println!(
            "skip: `{python}` cannot import `openai` (pip install openai, or set MLXCEL_PYTHON)"
        );
        return;
    }
    let (_dir, model) = tool_template_fixture("hermes_tools.jinja");
    let embedder = mlxcel_models::Embedder::load(mlxcel_tests::model_dir("bert"))
        .build()
        .expect("the bert fixture loads");
    let server = start(
        &model,
        ServerConfig {
            api_key: Some("sekret".into()),
            embedder: Some(embedder.clone()),
            model_name: Some("llama".into()),
            ..ServerConfig::default()
        },
    );
    let greedy = |prompt: mlxcel_models::Prompt, n: usize| {
        model
            .generate(
                prompt,
                Generation {
                    max_new_tokens: Some(n),
                    ..Generation::default()
                },
            )
            .and_then(|s| s.finish())
            .expect("Model::generate")
            .0
    };
    let chat_prompt = "Tell me about the weather.";
    let inputs = ["first text", "the second one"];
    let expect = json!({
        "api_key": "sekret",
        "model": "llama",
        "embedding_model": "bert",
        "chat_prompt": chat_prompt,
        "chat_greedy": greedy(mlxcel_models::Prompt::Messages(vec![Message::user(chat_prompt)]), 8),
        "completion_prompt": "Once upon a time",
        "completion_greedy": greedy(mlxcel_models::Prompt::Text("Once upon a time".into()), 6),
        "embedding_inputs": inputs,
        "embeddings": embedder.embed(&inputs).expect("embed"),
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("expect.json");
    std::fs::write(&path, expect.to_string()).expect("write");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openai_client.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(format!("http://{}", server.addr()))
        .arg(&path)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "openai_client.py failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("ok: openai"), "{stdout}");
}

/// Resident memory of this process in KiB (Linux), `None` elsewhere.
fn rss_kib() -> Option<u64> {
    std::fs::read_to_string("/proc/self/status")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// One load-test request: what was sent and whether its answer was well-formed.
fn load_request(addr: SocketAddr, kind: u32, seed: u64) -> Result<&'static str, String> {
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": format!("Request {seed}: tell a story.")}],
                              "max_tokens": 6 + seed % 12, "temperature": 0.7, "seed": seed});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        body.to_string()
    };
    let (body, expect) = match kind {
        // Streamed chat, read to the end.
        0..=4 => (
            chat(json!({"stream": true, "stream_options": {"include_usage": true}})),
            "stream",
        ),
        // Streamed chat whose client goes away after the first bytes.
        5..=6 => (
            chat(json!({"stream": true, "max_tokens": 200})),
            "disconnect",
        ),
        7 => (
            json!({"prompt": format!("Once {seed}"), "max_tokens": 8, "logprobs": 2}).to_string(),
            "completion",
        ),
        8 => (
            chat(
                json!({"max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {"schema": test_schemas()[0]}}}),
            ),
            "json",
        ),
        // Malformed: broken JSON, a bad field, a body over the limit.
        9 => ("{\"messages\": [".to_string(), "error"),
        10 => (chat(json!({"temperature": "hot"})), "error"),
        _ => (chat(json!({"pad": "x".repeat(70_000)})), "error"),
    };
    let path = if expect == "completion" {
        "/v1/completions"
    } else {
        "/v1/chat/completions"
    };
    if expect == "disconnect" {
        let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(|e| e.to_string())?;
        write!(s, "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len())
            .map_err(|e| e.to_string())?;
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).map_err(|e| e.to_string())?;
        let head = String::from_utf8_lossy(&buf[..n]).to_string();
        // 200 (then dropped mid-stream) or a 429 when the queue is full.
        return if head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.1 429") {
            Ok("disconnect")
        } else {
            Err(format!("disconnect: {head}"))
        };
    }
    let r = http(addr, "POST", path, &[], &body);
    if r.status != 200 {
        let e: Value = serde_json::from_str(&r.body)
            .map_err(|_| format!("{} non-JSON error: {}", r.status, r.body))?;
        if e["error"]["message"].as_str().is_none() {
            return Err(format!("error without a message: {}", r.body));
        }
        return match (expect, r.status) {
            ("error", 400 | 413) | (_, 429) => Ok("error"),
            _ => Err(format!("{expect}: {} {}", r.status, r.body)),
        };
    }
    match expect {
        "stream" => {
            let events = r.events();
            if events.last().map(String::as_str) != Some("[DONE]") {
                return Err(format!("stream without [DONE]: {}", r.body));
            }
            for e in &events[..events.len() - 1] {
                let c: Value = serde_json::from_str(e).map_err(|_| format!("bad chunk {e}"))?;
                if c.get("error").is_some() {
                    return Err(format!("stream error: {e}"));
                }
            }
        }
        "json" => {
            let text = r.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            serde_json::from_str::<Value>(&text).map_err(|e| format!("{text:?}: {e}"))?;
        }
        "completion" => {
            if r.json()["choices"][0]["logprobs"]["tokens"]
                .as_array()
                .is_none()
            {
                return Err(format!("completion without logprobs: {}", r.body));
            }
        }
        _ => return Err(format!("{expect} answered 200: {}", r.body)),
    }
    Ok(expect)
}

/// 200 requests from 16 concurrent clients on loopback — streamed chats (some dropped after
/// the first bytes), completions with logprobs, constrained JSON, malformed and oversized
/// bodies: every answer is complete or a JSON error, nothing is left in flight, and memory
/// after the second hundred is within 64 MiB of memory after the first.
#[test]
fn load_test_with_disconnects_and_bad_requests() {
    use rand::{Rng, SeedableRng};
    let model = fixture_model();
    let server = start(
        &model,
        ServerConfig {
            max_queue: 24,
            body_limit: 64 << 10,
            ..ServerConfig::default()
        },
    );
    let addr = server.addr();
    let t = std::time::Instant::now();
    let mut rss = Vec::new();
    let mut counts = std::collections::BTreeMap::new();
    for round in 0..2u64 {
        let results: Vec<Result<&'static str, String>> = std::thread::scope(|scope| {
            let clients: Vec<_> = (0..16u64)
                .map(|c| {
                    scope.spawn(move || {
                        let mut rng = rand::rngs::StdRng::seed_from_u64(round * 100 + c);
                        (0..100 / 16 + u64::from(c < 100 % 16))
                            .map(|i| {
                                load_request(addr, rng.gen_range(0..12), round * 1000 + c * 50 + i)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            clients
                .into_iter()
                .flat_map(|h| h.join().expect("client thread"))
                .collect()
        });
        assert_eq!(results.len(), 100);
        for r in results {
            match r {
                Ok(kind) => *counts.entry(kind).or_insert(0) += 1,
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        // Dropped streams end on the worker; then nothing is left in flight.
        let wait = std::time::Instant::now();
        while gauge(addr, "mlxcel_requests_in_flight") > 0.0
            || gauge(addr, "mlxcel_queue_depth") > 0.0
        {
            assert!(
                wait.elapsed() < Duration::from_secs(30),
                "requests left in flight"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        rss.extend(rss_kib());
    }
    let r = http(addr, "GET", "/health", &[], "");
    assert_eq!(r.status, 200);
    println!(
        "load test: {counts:?} in {:.2?}, RSS after each hundred {rss:?} KiB",
        t.elapsed()
    );
    assert!(
        counts.get("stream").copied().unwrap_or(0) > 50,
        "{counts:?}"
    );
    assert!(
        counts.get("disconnect").copied().unwrap_or(0) > 10,
        "{counts:?}"
    );
    if let [first, second] = rss[..] {
        assert!(
            second < first + 64 * 1024,
            "RSS grew from {first} to {second} KiB"
        );
    }
}

/// The chat page in a real browser: headless Chromium (`$MLXCEL_CHROMIUM` or `chromium` on
/// the PATH; Debian's `chromium` package) driven over the DevTools protocol by
/// `tests/browser_chat.py` types a message, presses Enter, and gets the streamed greedy reply
/// `Model::generate` gives, with the live figures; the screenshot is saved as
/// `chat-page.png` in Cargo's test temp folder. Skipped without Chromium or Python.
#[test]
fn chat_page_in_headless_chromium() {
    let chromium = std::env::var("MLXCEL_CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let found = std::process::Command::new(&chromium)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        println!("skip: `{chromium}` not found (apt-get install chromium, or set MLXCEL_CHROMIUM)");
        return;
    }
    let python = std::env::var("MLXCEL_PYTHON").unwrap_or_else(|_| "python3".into());
    let model = fixture_model();
    let server = start(&model, ServerConfig::default());
    let message = "Hello there, how are you?";
    let max_tokens = 12;
    let reply = model
        .generate(
            vec![Message::user(message)],
            Generation {
                max_new_tokens: Some(max_tokens),
                ..Generation::default()
            },
        )
        .and_then(|s| s.finish())
        .expect("Model::generate")
        .0;
    let dir = tempfile::tempdir().expect("tempdir");
    let expect = dir.path().join("expect.json");
    std::fs::write(
        &expect,
        json!({"message": message, "reply": reply, "max_tokens": max_tokens}).to_string(),
    )
    .expect("write");
    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page.png");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("browser_chat.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(&chromium)
        .arg(format!("http://{}/", server.addr()))
        .arg(&expect)
        .arg(&shot)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "browser_chat.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(shot.is_file(), "no screenshot at {}", shot.display());
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

/// Standard base64 with padding, by the `base64` crate (not the server's code: the tests check
/// the server's decoder against an independent encoder).
fn b64(bytes: &[u8]) -> String {
    base64::encode(bytes)
}

fn vision_image(name: &str) -> (Vec<u8>, String) {
    let bytes = std::fs::read(
        mlxcel_tests::fixtures_dir()
            .join("vision/images")
            .join(name),
    )
    .expect("a committed image");
    let mime = if name.ends_with(".jpg") {
        "image/jpeg"
    } else {
        "image/png"
    };
    let url = format!("data:{mime};base64,{}", b64(&bytes));
    (bytes, url)
}

/// A chat request whose user message holds `text` and, when given, an image part (in the
/// nested `{"url": ...}` shape, or as the plain string some clients send).
fn image_chat(text: &str, url: Option<&str>, nested: bool, max_tokens: usize) -> Value {
    let mut content = vec![json!({"type": "text", "text": text})];
    if let Some(url) = url {
        content.push(if nested {
            json!({"type": "image_url", "image_url": {"url": url, "detail": "auto"}})
        } else {
            json!({"type": "image_url", "image_url": url})
        });
    }
    json!({
        "messages": [
            {"role": "system", "content": "Look closely."},
            {"role": "user", "content": content},
        ],
        "max_tokens": max_tokens, "temperature": 0,
    })
}

/// The reply text of a chat response, streamed or not, and its usage's prompt tokens.
fn chat_reply(r: &Reply) -> (String, u64) {
    assert_eq!(r.status, 200, "{}", r.body);
    if r.headers.contains("text/event-stream") {
        let chunks: Vec<Value> = r
            .events()
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).expect("a JSON chunk"))
            .collect();
        let text = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        let prompt = chunks
            .iter()
            .find_map(|c| c["usage"]["prompt_tokens"].as_u64())
            .expect("a usage chunk");
        (text, prompt)
    } else {
        let j = r.json();
        (
            j["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            j["usage"]["prompt_tokens"].as_u64().expect("usage"),
        )
    }
}

/// `image_url` parts with base64 data URLs reach a vision-language model (the tiny Llava
/// fixture): each reply equals `Model::generate` with `Generation::images` (greedy), streamed
/// or not, alone or batched with others; another image (behind the very same prompt tokens,
/// which the prefix cache must not confuse) or none gives another reply.
#[test]
fn chat_images_reach_a_vision_model() {
    let model = Model::load(mlxcel_tests::fixtures_dir().join("vision/llava"))
        .build()
        .expect("the llava fixture loads");
    assert!(model.takes_images());
    let text = "What is in the picture?";
    let max_tokens = 16;
    let images = ["gradient.png", "photo.jpg", "alpha.png"];
    let library = |image: Option<&[u8]>| {
        let images = image
            .map(|b| vec![mlxcel_models::decode_image(b).expect("decodes")])
            .unwrap_or_default();
        let (text, stats) = model
            .generate(
                vec![Message::new("system", "Look closely."), Message::user(text)],
                Generation {
                    max_new_tokens: Some(max_tokens),
                    images,
                    ..Generation::default()
                },
            )
            .and_then(|s| s.finish())
            .expect("Model::generate");
        (text, stats.prompt_tokens as u64)
    };
    let loaded: Vec<(Vec<u8>, String)> = images.iter().map(|n| vision_image(n)).collect();
    let want: Vec<(String, u64)> = loaded.iter().map(|(b, _)| library(Some(b))).collect();
    let plain = library(None);
    // The fixture's images are 16 tokens each.
    assert!(want[0].1 >= plain.1 + 16, "{} vs {}", want[0].1, plain.1);
    assert_ne!(
        want[0].0, want[1].0,
        "the images must give different replies"
    );
    assert_ne!(want[0].0, plain.0, "the image must change the reply");

    let server = start(
        &model,
        ServerConfig {
            parallel: 4,
            sessions: 2,
            ..ServerConfig::default()
        },
    );
    let addr = server.addr();
    // One after the other, alternating images behind the same tokens (the prefix cache picks
    // the session holding the other image's conversation), nested and plain-string parts,
    // streamed and not.
    for (round, i) in [0, 1, 0, 2, 1].into_iter().enumerate() {
        let mut body = image_chat(text, Some(&loaded[i].1), round % 2 == 0, max_tokens);
        if round % 2 == 1 {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let got = chat_reply(&post(addr, "/v1/chat/completions", &body));
        assert_eq!(
            got, want[i],
            "round {round}: {} over HTTP vs Model::generate",
            images[i]
        );
    }
    let got = chat_reply(&post(
        addr,
        "/v1/chat/completions",
        &image_chat(text, None, true, max_tokens),
    ));
    assert_eq!(got, plain, "no image");

    // At once (continuous batching), with a text-only request among them.
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
    let threads: Vec<_> = [Some(0), Some(1), None, Some(2)]
        .into_iter()
        .map(|i| {
            let barrier = barrier.clone();
            let body = image_chat(text, i.map(|i| loaded[i].1.as_str()), true, max_tokens);
            std::thread::spawn(move || {
                barrier.wait();
                chat_reply(&post(addr, "/v1/chat/completions", &body))
            })
        })
        .collect();
    let got: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(
        got,
        vec![
            want[0].clone(),
            want[1].clone(),
            plain.clone(),
            want[2].clone()
        ],
        "concurrent image requests vs Model::generate"
    );
}

/// PNG's chunk checksum (CRC-32, IEEE).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                crc >> 1 ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// What the server refuses about images, each a 400 (413 for a too large one) naming the field.
#[test]
fn chat_images_refused_name_the_field() {
    let vlm = Model::load(mlxcel_tests::fixtures_dir().join("vision/llava"))
        .build()
        .expect("the llava fixture loads");
    let server = start(&vlm, ServerConfig::default());
    let addr = server.addr();
    let field = "messages[1].content[1].image_url.url";
    let refused = |body: &Value, status: u16, param: &str, says: &str| {
        let r = post(addr, "/v1/chat/completions", body);
        assert_eq!(r.status, status, "{}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["param"], param, "{}", r.body);
        let message = e["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "`{says}` not in: {message}");
    };
    for url in [
        "http://127.0.0.1:9/cat.png",
        "https://example.com/cat.png",
        "file:///etc/hostname",
    ] {
        refused(
            &image_chat("hi", Some(url), true, 4),
            400,
            field,
            "never fetches",
        );
    }
    refused(
        &image_chat(
            "hi",
            Some("data:image/png;base64,iVBORw0K*GgoAAAA"),
            true,
            4,
        ),
        400,
        field,
        "invalid base64",
    );
    refused(
        &image_chat(
            "hi",
            Some(&format!(
                "data:image/png;base64,{}",
                b64(b"not an image at all")
            )),
            true,
            4,
        ),
        400,
        field,
        "not a PNG, JPEG or WebP image",
    );
    // A PNG whose header declares 10000x10000 pixels: refused before decoding.
    let (png, _) = vision_image("gradient.png");
    let mut huge = png.clone();
    huge[16..20].copy_from_slice(&10_000u32.to_be_bytes());
    huge[20..24].copy_from_slice(&10_000u32.to_be_bytes());
    let crc = crc32(&huge[12..29]);
    huge[29..33].copy_from_slice(&crc.to_be_bytes());
    refused(
        &image_chat(
            "hi",
            Some(&format!("data:image/png;base64,{}", b64(&huge))),
            true,
            4,
        ),
        413,
        field,
        "megapixels",
    );
    // Images only in the last user message.
    let url = format!("data:image/png;base64,{}", b64(&png));
    let early = json!({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
        {"role": "assistant", "content": "A gradient."},
        {"role": "user", "content": "And its colours?"},
    ]});
    refused(
        &early,
        400,
        "messages[0].content[0].image_url.url",
        "last user message",
    );
    let assistant = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]},
    ]});
    refused(
        &assistant,
        400,
        "messages[1].content[0].type",
        "user messages",
    );
    drop(server);

    // A text-only model has no vision tower.
    let text_model = fixture_model();
    assert!(!text_model.takes_images());
    let server = start(&text_model, ServerConfig::default());
    let r = post(
        server.addr(),
        "/v1/chat/completions",
        &image_chat("hi", Some(&url), false, 4),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["param"], "messages[1].content[1].image_url");
    assert!(
        e["message"]
            .as_str()
            .unwrap_or_default()
            .contains("no vision tower"),
        "{}",
        r.body
    );
}

/// A model whose routed experts stream from disk reports its arena in `/metrics` (the seed's
/// `mlxcel_expert_arena_*`), counting what a request selected and read; a resident model
/// reports no arena.
#[test]
fn metrics_report_the_expert_arena() {
    let dir = mlxcel_tests::copy_fixture("qwen3_moe");
    let manifest = mlxcel_loading::stream::prepare_expert_stream(dir.path(), |_, _| {})
        .expect("the expert-stream layout");
    let per_slot: u64 = manifest.layers.iter().map(|l| l.expert_stride).sum();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    let top_k = config["num_experts_per_tok"].as_u64().unwrap();
    let policy = mlxcel_core::RuntimePolicy {
        expert_stream: mlxcel_stream::StreamMode::On,
        expert_arena_bytes: Some(per_slot * top_k),
        ..mlxcel_core::RuntimePolicy::default()
    };
    let model = Model::load(dir.path())
        .policy(policy)
        .build()
        .expect("the streamed model loads");
    let server = start(&model, ServerConfig::default());
    let addr = server.addr();
    assert_eq!(
        gauge(addr, "mlxcel_expert_arena_slots_per_layer"),
        top_k as f64
    );
    assert_eq!(
        gauge(addr, "mlxcel_expert_arena_bytes"),
        (per_slot * top_k) as f64
    );
    let selected = |addr| {
        gauge(addr, "mlxcel_expert_arena_hits_total")
            + gauge(addr, "mlxcel_expert_arena_misses_total")
    };
    let before = selected(addr);
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "one two three", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(selected(addr) > before, "the request selected no experts");
    // An arena of top-k slots cannot hold every layer's choices: some experts were read.
    assert!(gauge(addr, "mlxcel_expert_arena_misses_total") > 0.0);
    assert!(gauge(addr, "mlxcel_expert_arena_read_bytes_total") > 0.0);
    drop(server);
    let resident = start(&fixture_model(), ServerConfig::default());
    let m = http(resident.addr(), "GET", "/metrics", &[], "");
    assert!(!m.body.contains("mlxcel_expert_arena"), "{}", m.body);
}
