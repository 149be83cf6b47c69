//! `mlxcel-server` with runtime LoRA adapters (`ModelBuilder::runtime_adapter`, what
//! `mlxcel serve --adapter NAME=DIR` registers): requests choosing different adapters (by
//! `model`, by the `adapter` field, a blend, none) each get that adapter's own output, the same as
//! `Model::generate` with the same mix; an unknown adapter is a 400 naming it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use mlxcel_models::{AdapterMix, Generation, Model};
use mlxcel_server::{spawn, ServerConfig};
use mlxcel_tests::{fixtures_dir, model_dir};
use serde_json::{json, Value};

/// `(status, JSON body)` of one request.
fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a header block");
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(rest).expect("a JSON body"))
}

#[test]
fn requests_select_their_own_adapter() {
    let adapters = fixtures_dir().join("adapters");
    let model = Model::load(model_dir("llama"))
        .runtime_adapter("a", adapters.join("llama-lora-mlx"))
        .runtime_adapter("b", adapters.join("llama-lora-mlx-b"))
        .build()
        .unwrap();
    let server = spawn(model.clone(), ServerConfig::default(), "127.0.0.1:0").unwrap();
    let addr = server.addr();

    let (status, models) = request(addr, "GET", "/v1/models", "");
    assert_eq!(status, 200);
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["llama", "a", "b"]);

    let prompt = "Once upon a time";
    let want = |mix: AdapterMix| {
        model
            .generate(
                prompt,
                Generation {
                    max_new_tokens: Some(8),
                    adapters: Some(mix),
                    ..Generation::default()
                },
            )
            .and_then(|s| s.finish())
            .unwrap()
            .0
    };
    let complete = |extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0.0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        request(addr, "POST", "/v1/completions", &body.to_string())
    };
    let text = |reply: (u16, Value)| {
        assert_eq!(reply.0, 200, "{}", reply.1);
        (
            reply.1["choices"][0]["text"].as_str().unwrap().to_string(),
            reply.1["model"].as_str().unwrap().to_string(),
        )
    };

    let want_a = want(AdapterMix::single("a"));
    let want_b = want(AdapterMix::single("b"));
    let want_base = want(AdapterMix::none());
    assert_ne!(want_a, want_b, "the adapters give the same text");
    assert_ne!(want_a, want_base, "adapter a gives the base text");

    // Alternating requests: each gets its own adapter's output.
    assert_eq!(
        text(complete(json!({"model": "a"}))),
        (want_a.clone(), "a".into())
    );
    assert_eq!(
        text(complete(json!({"model": "b"}))),
        (want_b.clone(), "b".into())
    );
    assert_eq!(text(complete(json!({"adapter": "a"}))).0, want_a);
    assert_eq!(
        text(complete(json!({"model": "llama"}))),
        (want_base.clone(), "llama".into())
    );
    assert_eq!(text(complete(json!({}))).0, want_base);
    let blend = AdapterMix::blend([("a", 0.5), ("b", -0.8)]);
    assert_eq!(
        text(complete(json!({"adapter": {"a": 0.5, "b": -0.8}}))).0,
        want(blend)
    );
    assert_eq!(
        text(complete(json!({"adapter": {"a": 0.0}}))).0,
        want_base,
        "weight 0"
    );

    let (status, err) = complete(json!({"adapter": "c"}));
    assert_eq!(status, 400, "{err}");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("no adapter named `c`") && msg.contains("a, b"),
        "{msg}"
    );
    assert_eq!(err["error"]["param"], "adapter");
    let (status, err) = complete(json!({"adapter": {"a": "x"}}));
    assert_eq!(status, 400, "{err}");
}
