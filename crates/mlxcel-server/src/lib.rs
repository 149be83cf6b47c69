//! # mlxcel-server
//!
//! An OpenAI-compatible HTTP server for a model loaded by [`mlxcel_models`], with a web chat
//! page. It is what `mlxcel serve` runs:
//!
//! ```no_run
//! use mlxcel_models::Model;
//! use mlxcel_server::{ServerConfig, spawn};
//!
//! let model = Model::load("~/.cache/mlxcel/models/SmolLM2-135M-Instruct-4bit").build()?;
//! let server = spawn(model, ServerConfig::default(), "127.0.0.1:0")?;
//! println!("listening on http://{}", server.addr());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Endpoints: `GET /` (the chat page), `GET /health`, `GET /v1/models`,
//! `POST /v1/chat/completions`, `POST /v1/completions` (both streamed as server-sent events
//! with `"stream": true`), `POST /v1/embeddings` (when [`ServerConfig::embedder`] holds an
//! [`Embedder`]; float or base64 vectors), `POST /v1/rerank` (Cohere/Jina style, when
//! [`ServerConfig::reranker`] holds a [`mlxcel_models::Reranker`]) and `GET /metrics`
//! (Prometheus text).
//!
//! Chat requests may ask for `logprobs`, declare `tools` (passed to the chat template; calls in
//! the reply come back as `tool_calls`, see the `tools` module) and set `response_format`
//! (`json_object` / `json_schema`, enforced by constrained decoding: the `grammar` and
//! `constraint` modules). A vision-language model's chat requests may carry images as
//! `image_url` content parts with base64 `data:` URLs (never fetched URLs or files), in the last
//! user message; they become [`Generation::images`].
//!
//! Up to [`ServerConfig::parallel`] generations run at once, batched on the model's worker (each
//! decode step advances all of them in one forward pass: continuous batching, see
//! [`mlxcel_models::Model::batch_stats`]); the others wait in a bounded queue (a request past
//! [`ServerConfig::max_queue`] waiting ones gets a 429). A small pool of
//! [`mlxcel_models::Session`]s keeps the caches of recent conversations: each request goes to
//! the idle session whose cached tokens share the longest prefix with its prompt, so a
//! follow-up chat turn prefills only its new tokens (`usage.prompt_tokens_details.cached_tokens`).
//! A client that disconnects cancels its generation.
//!
//! Runtime LoRA adapters registered on the model ([`mlxcel_models::ModelBuilder::runtime_adapter`])
//! are listed in `/v1/models` under their names; a request selects one with `"model": "NAME"`
//! (as vLLM serves LoRA adapters), or with the extension field `"adapter"`: a name, or an object
//! of weights by name for a blend (`{"a": 0.5, "b": 0.5}`; each weight multiplies the adapter's
//! own scale, 0 turns it off). Other requests run with the model's default mix.
//!
//! The server uses only the `mlxcel-models` facade.

#![warn(missing_docs)]

mod api;
mod constraint;
mod grammar;
mod harmony;
mod logprobs;
mod tools;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use api::{ApiError, EmbeddingRequest, Input, Request, RerankRequest, ToolChoice};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use logprobs::Vocab;
use mlxcel_models::{
    AsyncTokenStream, Embedder, FinishReason, Generation, GenerationStats, Model, Prompt, Session,
    SharedLogitsProcessor, TokenLogprob,
};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Mutex};

/// The chat page served at `GET /`.
const PAGE: &str = include_str!("page.html");

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// When set, every endpoint but `/health` and the page at `/` needs
    /// `Authorization: Bearer KEY` (401 otherwise).
    pub api_key: Option<String>,
    /// Requests that may wait while [`ServerConfig::parallel`] run; one more gets a 429.
    pub max_queue: usize,
    /// Generations that run at once, batched on the model's worker (each decode step advances
    /// all of them in one forward pass); more wait in the queue.
    pub parallel: usize,
    /// Largest request body in bytes (413 past it).
    pub body_limit: usize,
    /// Conversations whose caches are kept for prefix reuse.
    pub sessions: usize,
    /// The model's id in `/v1/models` and responses (default: the model folder's name).
    pub model_name: Option<String>,
    /// An embedding model served at `POST /v1/embeddings` (and listed in `/v1/models` under
    /// its folder's name). Without one that endpoint answers 404 saying none is loaded.
    pub embedder: Option<Embedder>,
    /// A reranker served at `POST /v1/rerank` (and listed in `/v1/models` under its folder's
    /// name). Without one that endpoint answers 404 saying none is loaded.
    pub reranker: Option<mlxcel_models::Reranker>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            api_key: None,
            max_queue: 16,
            parallel: 8,
            body_limit: 4 << 20,
            sessions: 4,
            model_name: None,
            embedder: None,
            reranker: None,
        }
    }
}

/// A server running on its own thread (see [`spawn`]); dropping it stops the server and waits
/// (up to [`STOP_WAIT`]) until the requests in flight are answered and the server's hold on the
/// model is released.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    /// Closed when the server thread ends (its runtime, blocking tasks and model handles gone).
    stopped: std::sync::mpsc::Receiver<()>,
}

/// How long dropping a [`ServerHandle`] waits for the server to stop. Why wait at all: a server
/// still generating when the process exits runs MLX on its model's thread while the C++ runtime
/// tears MLX's globals down, which corrupts the heap (seen as a test binary aborting in
/// `malloc_consolidate` after all its tests passed).
pub const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl ServerHandle {
    /// The address it listens on (the real port when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        // Disconnected when the thread ends; a timeout leaves it to finish on its own.
        let _ = self.stopped.recv_timeout(STOP_WAIT);
    }
}

/// Binds `addr` and serves `model` on a new thread with its own runtime; returns once it
/// listens.
pub fn spawn(
    model: Model,
    config: ServerConfig,
    addr: impl std::net::ToSocketAddrs,
) -> std::io::Result<ServerHandle> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let runtime = runtime()?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (stopped_tx, stopped) = std::sync::mpsc::channel::<()>();
    let app = router(model, config);
    std::thread::Builder::new()
        .name("mlxcel-server".into())
        .spawn(move || {
            // Locals drop in reverse order: the runtime (which waits for its blocking tasks,
            // the last holders of the model) before the stop signal.
            let _stopped = stopped_tx;
            let runtime = runtime;
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = rx.await;
                    })
                    .await;
            });
        })?;
    Ok(ServerHandle {
        addr,
        shutdown: Some(tx),
        stopped,
    })
}

/// Binds `addr` and serves `model` on the calling thread until the process ends.
pub fn run(
    model: Model,
    config: ServerConfig,
    addr: impl std::net::ToSocketAddrs,
) -> std::io::Result<()> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let app = router(model, config);
    runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        axum::serve(listener, app).await
    })
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("mlxcel-http")
        .enable_io()
        .build()
}

/// Counters for `/metrics`.
#[derive(Default)]
struct Metrics {
    chat_requests: AtomicU64,
    completion_requests: AtomicU64,
    rejected_queue_full: AtomicU64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    reused_tokens: AtomicU64,
    /// f64 bits.
    last_prefill_tps: AtomicU64,
    last_decode_tps: AtomicU64,
    /// Admitted requests not finished yet (waiting or running).
    pending: AtomicUsize,
    running: AtomicUsize,
    /// Tokens the prefix cache's sessions hold in their KV caches (updated after each request).
    cached_tokens: AtomicUsize,
}

/// One kept conversation.
struct Slot {
    session: Session,
    tokens: Vec<u32>,
    last_used: u64,
    /// A generation is running in it (its tokens are unknown until it ends).
    busy: bool,
}

struct Pool {
    slots: Vec<Slot>,
    clock: u64,
}

struct AppState {
    model: Model,
    config: ServerConfig,
    name: String,
    /// The embedding model's id (when [`ServerConfig::embedder`] is set).
    embedder_name: String,
    /// The reranker's id (when [`ServerConfig::reranker`] is set).
    reranker_name: String,
    pool: Arc<Mutex<Pool>>,
    /// One per generation that may run at once ([`ServerConfig::parallel`]).
    places: tokio::sync::Semaphore,
    /// The token trie for constrained decoding, built on first use.
    vocabulary: std::sync::OnceLock<Arc<constraint::Vocabulary>>,
    metrics: Metrics,
    next_id: AtomicU64,
}

type Shared = Arc<AppState>;

fn router(model: Model, config: ServerConfig) -> Router {
    let name = config.model_name.clone().unwrap_or_else(|| {
        model
            .info()
            .folder
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".to_string())
    });
    let embedder_name = config
        .embedder
        .as_ref()
        .and_then(|e| e.info().folder.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "embedding-model".to_string());
    let reranker_name = config
        .reranker
        .as_ref()
        .and_then(|r| r.info().folder.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "reranker".to_string());
    let slots = (0..config.sessions.max(1))
        .map(|_| Slot {
            session: model.session(),
            tokens: Vec::new(),
            last_used: 0,
            busy: false,
        })
        .collect();
    let places = tokio::sync::Semaphore::new(config.parallel.max(1));
    let state = Arc::new(AppState {
        model,
        config,
        name,
        embedder_name,
        reranker_name,
        pool: Arc::new(Mutex::new(Pool { slots, clock: 0 })),
        places,
        vocabulary: std::sync::OnceLock::new(),
        metrics: Metrics::default(),
        next_id: AtomicU64::new(1),
    });
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/rerank", post(rerank))
        .fallback(not_found)
        .with_state(state)
}

impl AppState {
    /// The vocabulary trie for constrained decoding (built once, off the async threads).
    async fn vocabulary(self: &Arc<Self>) -> Result<Arc<constraint::Vocabulary>, ApiError> {
        if let Some(v) = self.vocabulary.get() {
            return Ok(v.clone());
        }
        let model = self.model.clone();
        let built = tokio::task::spawn_blocking(move || {
            let bytes = model.token_bytes()?;
            Ok::<_, mlxcel_models::Error>(constraint::Vocabulary::new(
                bytes,
                model.info().eos_token_ids.clone(),
            ))
        })
        .await
        .map_err(|e| internal(format!("building the vocabulary failed: {e}")))?
        .map_err(|e| ApiError::invalid("response_format", e.to_string()))?;
        Ok(self.vocabulary.get_or_init(|| Arc::new(built)).clone())
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.config.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .unwrap_or("");
        // Compare in time independent of where the strings differ.
        let same = given.len() == key.len()
            && given
                .bytes()
                .zip(key.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if same {
            Ok(())
        } else {
            Err(ApiError::other(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "missing or wrong API key: send `Authorization: Bearer KEY`",
            )
            .code("invalid_api_key"))
        }
    }
}

async fn page() -> Html<&'static str> {
    Html(PAGE)
}

async fn health() -> Response {
    json_response(StatusCode::OK, &json!({"status": "ok"}))
}

async fn not_found() -> ApiError {
    ApiError::other(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such endpoint",
    )
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    s.authorize(&headers)?;
    let entry = |id: &str| json!({"id": id, "object": "model", "created": 0, "owned_by": "mlxcel"});
    let mut data = vec![entry(&s.name)];
    // Runtime adapters are models of their own name, as in vLLM's LoRA serving.
    for name in &s.model.info().adapters {
        let mut e = entry(name);
        e["parent"] = json!(s.name);
        data.push(e);
    }
    if s.config.embedder.is_some() {
        data.push(entry(&s.embedder_name));
    }
    if s.config.reranker.is_some() {
        data.push(entry(&s.reranker_name));
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": data}),
    ))
}

/// `POST /v1/embeddings`: one vector per input text, in input order.
async fn embeddings(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    s.authorize(&headers)?;
    let body = read_body(body, s.config.body_limit).await?;
    let Some(embedder) = s.config.embedder.clone() else {
        return Err(ApiError::other(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no embedding model is loaded: start the server with an embedding model \
             (`mlxcel serve --embedding-model DIR`)",
        )
        .code("model_not_found"));
    };
    let EmbeddingRequest {
        input,
        dimensions,
        base64,
    } = api::parse_embeddings(&body)?;
    let width = embedder.info().dimensions;
    let mut options = embedder.options().clone();
    if let Some(d) = dimensions {
        if d > width {
            return Err(ApiError::invalid(
                "dimensions",
                format!("`dimensions` {d} exceeds the model's {width}"),
            ));
        }
        options.dimensions = Some(d);
    }
    let (vectors, counts) = tokio::task::spawn_blocking(move || {
        let texts: Vec<&str> = input.iter().map(String::as_str).collect();
        let counts = embedder.token_counts(&texts, &options)?;
        let vectors = embedder.embed_with(&texts, &options)?;
        Ok::<_, mlxcel_models::Error>((vectors, counts))
    })
    .await
    .map_err(|e| internal(format!("the embedding task failed: {e}")))?
    .map_err(|e| match e {
        mlxcel_models::Error::Invalid(_) | mlxcel_models::Error::Load(_) => {
            ApiError::invalid("input", e.to_string())
        }
        e => internal(e.to_string()),
    })?;
    let tokens: usize = counts.iter().sum();
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(api::base64(&bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": data,
            "model": s.embedder_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }),
    ))
}

/// `POST /v1/rerank` (Cohere/Jina style): the documents scored against the query, best first,
/// at most `top_n`, each with its input `index` and `relevance_score` (and the `document` when
/// `return_documents`).
async fn rerank(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    s.authorize(&headers)?;
    let body = read_body(body, s.config.body_limit).await?;
    let Some(reranker) = s.config.reranker.clone() else {
        return Err(ApiError::other(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no reranker is loaded: start the server with one (`mlxcel serve --reranker-model DIR`)",
        )
        .code("model_not_found"));
    };
    let RerankRequest {
        query,
        documents,
        top_n,
        return_documents,
    } = api::parse_rerank(&body)?;
    let (scores, counts, documents) = tokio::task::spawn_blocking(move || {
        let docs: Vec<&str> = documents.iter().map(String::as_str).collect();
        let counts = reranker.token_counts(&query, &docs)?;
        let scores = reranker.score(&query, &docs)?;
        Ok::<_, mlxcel_models::Error>((scores, counts, documents))
    })
    .await
    .map_err(|e| internal(format!("the rerank task failed: {e}")))?
    .map_err(|e| match e {
        mlxcel_models::Error::Invalid(_) | mlxcel_models::Error::Load(_) => {
            ApiError::invalid("documents", e.to_string())
        }
        e => internal(e.to_string()),
    })?;
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    order.truncate(top_n.unwrap_or(order.len()));
    let results: Vec<Value> = order
        .into_iter()
        .map(|i| {
            let mut r = json!({"index": i, "relevance_score": scores[i]});
            if return_documents {
                r["document"] = json!({"text": documents[i]});
            }
            r
        })
        .collect();
    let tokens: usize = counts.iter().sum();
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "model": s.reranker_name,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }),
    ))
}

async fn metrics(State(s): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    s.authorize(&headers)?;
    let m = &s.metrics;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let pending = m.pending.load(Ordering::Relaxed);
    let running = m.running.load(Ordering::Relaxed);
    let model = s.model.clone();
    let (batching, arena) = tokio::task::spawn_blocking(move || {
        Ok::<_, mlxcel_models::Error>((model.batch_stats()?, model.expert_arena_stats()?))
    })
    .await
    .map_err(|_| internal("the metrics task stopped"))?
    .map_err(|e| internal(e.to_string()))?;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, lines: &[(&str, String)]| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (labels, value) in lines {
            out.push_str(&format!("{name}{labels} {value}\n"));
        }
    };
    metric(
        "mlxcel_requests_total",
        "counter",
        "Generation requests accepted, by endpoint.",
        &[
            ("{endpoint=\"chat\"}", get(&m.chat_requests).to_string()),
            (
                "{endpoint=\"completions\"}",
                get(&m.completion_requests).to_string(),
            ),
        ],
    );
    metric(
        "mlxcel_requests_rejected_total",
        "counter",
        "Requests refused with 429 because the queue was full.",
        &[("", get(&m.rejected_queue_full).to_string())],
    );
    metric(
        "mlxcel_prompt_tokens_total",
        "counter",
        "Prompt tokens of finished generations.",
        &[("", get(&m.prompt_tokens).to_string())],
    );
    metric(
        "mlxcel_completion_tokens_total",
        "counter",
        "Generated tokens.",
        &[("", get(&m.completion_tokens).to_string())],
    );
    metric(
        "mlxcel_reused_prompt_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache instead of prefilled.",
        &[("", get(&m.reused_tokens).to_string())],
    );
    metric(
        "mlxcel_last_prefill_tokens_per_second",
        "gauge",
        "Prefill speed of the last generation.",
        &[("", f64::from_bits(get(&m.last_prefill_tps)).to_string())],
    );
    metric(
        "mlxcel_last_decode_tokens_per_second",
        "gauge",
        "Decode speed of the last generation.",
        &[("", f64::from_bits(get(&m.last_decode_tps)).to_string())],
    );
    if let Ok(mem) = mlxcel_models::memory_stats() {
        metric(
            "mlxcel_memory_active_bytes",
            "gauge",
            "Bytes MLX holds in live arrays (weights, caches, work in flight).",
            &[("", mem.active_bytes.to_string())],
        );
        metric(
            "mlxcel_memory_peak_bytes",
            "gauge",
            "The most bytes MLX has held in live arrays.",
            &[("", mem.peak_bytes.to_string())],
        );
        metric(
            "mlxcel_memory_cache_bytes",
            "gauge",
            "Freed bytes MLX keeps cached for reuse.",
            &[("", mem.cache_bytes.to_string())],
        );
    }
    metric(
        "mlxcel_queue_depth",
        "gauge",
        "Requests waiting for the model.",
        &[("", pending.saturating_sub(running).to_string())],
    );
    metric(
        "mlxcel_requests_in_flight",
        "gauge",
        "Requests being generated.",
        &[("", running.to_string())],
    );
    metric(
        "mlxcel_decode_passes_total",
        "counter",
        "Decode forward passes (one per step for a batch of generations).",
        &[("", batching.steps.to_string())],
    );
    metric(
        "mlxcel_decode_batch_rows_total",
        "counter",
        "Generations advanced by decode passes, summed (over passes: the mean batch size).",
        &[("", batching.rows.to_string())],
    );
    metric(
        "mlxcel_decode_batch_largest",
        "gauge",
        "The largest batch one decode pass advanced.",
        &[("", batching.largest.to_string())],
    );
    // The seed's routed-expert arena counters, when experts stream from disk.
    if let Some(a) = arena {
        metric(
            "mlxcel_expert_arena_bytes",
            "gauge",
            "Bytes of the routed-expert arenas (all streamed layers).",
            &[("", a.arena_bytes.to_string())],
        );
        metric(
            "mlxcel_expert_arena_slots_per_layer",
            "gauge",
            "Expert slots per streamed layer.",
            &[("", a.slots_per_layer.to_string())],
        );
        metric(
            "mlxcel_expert_arena_hits_total",
            "counter",
            "Selected experts that were resident in the arena.",
            &[("", a.hits.to_string())],
        );
        metric(
            "mlxcel_expert_arena_misses_total",
            "counter",
            "Selected experts read from disk into the arena.",
            &[("", a.misses.to_string())],
        );
        metric(
            "mlxcel_expert_arena_read_bytes_total",
            "counter",
            "Bytes of experts read from the stream files.",
            &[("", a.bytes_read.to_string())],
        );
        metric(
            "mlxcel_expert_arena_read_seconds_total",
            "counter",
            "Wall-clock seconds spent reading experts.",
            &[("", a.read_seconds.to_string())],
        );
    }
    metric(
        "mlxcel_kv_cache_tokens",
        "gauge",
        "Tokens held in the KV caches of the prefix cache's sessions.",
        &[("", m.cached_tokens.load(Ordering::Relaxed).to_string())],
    );
    metric(
        "mlxcel_kv_cache_sessions",
        "gauge",
        "Sessions of the prefix cache (--sessions).",
        &[("", s.config.sessions.max(1).to_string())],
    );
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response())
}

async fn chat_completions(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    handle(s, headers, body, true).await
}

async fn completions(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    handle(s, headers, body, false).await
}

/// What the generating task tells the response.
enum Event {
    /// Text made final, and the logprobs of the tokens it came from (when asked for).
    Piece(String, Vec<TokenLogprob>),
    Done(Box<GenerationStats>),
    Failed(String),
}

/// Decrements a counter when dropped.
struct Count<'a>(&'a AtomicUsize);

impl Drop for Count<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn handle(
    s: Shared,
    headers: HeaderMap,
    body: Body,
    chat: bool,
) -> Result<Response, ApiError> {
    s.authorize(&headers)?;
    let body = read_body(body, s.config.body_limit).await?;
    let mut request = api::parse(&body, chat)?;
    let parts = std::mem::take(&mut request.images);
    if let Some(part) = parts.first() {
        if !s.model.takes_images() {
            return Err(ApiError::invalid(
                part.field.clone(),
                format!("model `{}` has no vision tower: it takes no images", s.name),
            ));
        }
    }
    let (prompt, field) = match request.input.clone() {
        Input::Chat(messages) if !request.tools.is_empty() => {
            let tools = request.tools.clone();
            let prompt = if s.model.template_takes_tools() {
                Prompt::MessagesWithTools { messages, tools }
            } else {
                Prompt::Messages(tools::described_in_system(messages, &tools))
            };
            (prompt, "messages")
        }
        Input::Chat(messages) => (Prompt::Messages(messages), "messages"),
        Input::Text(text) => (Prompt::Text(text), "prompt"),
    };
    let images = if parts.is_empty() {
        Vec::new()
    } else {
        tokio::task::spawn_blocking(move || decode_images(&parts))
            .await
            .map_err(|e| internal(format!("decoding the images failed: {e}")))??
    };
    let model = s.model.clone();
    let (ids, prompt) = tokio::task::spawn_blocking(move || {
        let ids = if images.is_empty() {
            model.prompt_ids(&prompt)
        } else {
            model.prompt_ids_with_images(&prompt, &images)
        };
        ids.map(|ids| (ids, (prompt, images)))
    })
    .await
    .map_err(|e| internal(format!("tokenizing failed: {e}")))?
    .map_err(|e| ApiError::invalid(field, e.to_string()))?;
    // The ids prompt when there are no images. With images, the messages themselves: the
    // model expands them again as it prefills; the ids above (expanded) size the prompt and
    // pick the session. A session's caches are reused only where tokens and images both agree
    // (the model keys cached image positions on the images' pixel hashes), so another image
    // behind the same placeholder tokens is never served from the cache.
    let (prompt, images) = match prompt {
        (_, images) if images.is_empty() => (Prompt::Ids(ids.clone()), images),
        (prompt, images) => (prompt, images),
    };
    if let Some(context) = s.model.info().context_length {
        let room = context.saturating_sub(ids.len());
        if room == 0 {
            return Err(ApiError::invalid(
                field,
                format!(
                    "the prompt has {} tokens; the model's context is {context}",
                    ids.len()
                ),
            )
            .code("context_length_exceeded"));
        }
        if let Some(n) = request.max_tokens.filter(|&n| n > room) {
            return Err(ApiError::invalid(
                request.max_field,
                format!(
                    "{} {n} with a {}-token prompt exceeds the model's context of {context}",
                    request.max_field,
                    ids.len()
                ),
            )
            .code("context_length_exceeded"));
        }
    }
    let counter = if chat {
        &s.metrics.chat_requests
    } else {
        &s.metrics.completion_requests
    };
    counter.fetch_add(1, Ordering::Relaxed);

    // Admission: `parallel` running plus `max_queue` waiting.
    let before = s.metrics.pending.fetch_add(1, Ordering::Relaxed);
    if before >= s.config.parallel.max(1) + s.config.max_queue {
        s.metrics.pending.fetch_sub(1, Ordering::Relaxed);
        s.metrics
            .rejected_queue_full
            .fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::other(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!(
                "the server is busy: {} requests are already waiting",
                s.config.max_queue
            ),
        )
        .code("queue_full"));
    }

    // The adapters: the `adapter` field, else a `model` naming a runtime adapter, else the
    // model's default.
    let adapters = &s.model.info().adapters;
    let by_model = request
        .model
        .as_ref()
        .filter(|m| adapters.contains(m))
        .map(|m| mlxcel_models::AdapterMix::single(m.as_str()));
    let mix = request.adapter.clone().or(by_model);
    if let Some(mix) = &request.adapter {
        if let Some((name, _)) = mix.entries.iter().find(|(n, _)| !adapters.contains(n)) {
            s.metrics.pending.fetch_sub(1, Ordering::Relaxed);
            return Err(ApiError::invalid(
                "adapter",
                format!(
                    "no adapter named `{name}` (loaded: {})",
                    if adapters.is_empty() {
                        "none".to_string()
                    } else {
                        adapters.join(", ")
                    }
                ),
            ));
        }
    }
    let answered_as = match &mix {
        Some(m) if m.entries.len() == 1 && request.adapter.is_none() => m.entries[0].0.clone(),
        _ => s.name.clone(),
    };
    // The output's shape: a JSON schema, or a forced tool call in the model's own format (Hermes
    // when the tools are described in the system message instead of by the template).
    let tool_format = if s.model.template_takes_tools() {
        s.model.tool_call_format()
    } else {
        None
    };
    let shape = match (&request.json, &request.tool_choice) {
        (Some(g), _) => Some(constraint::Shape::json(g.clone())),
        (None, ToolChoice::Required) => {
            Some(tools::forced_call(&request.tools, None, tool_format)?)
        }
        (None, ToolChoice::Named(n)) => {
            Some(tools::forced_call(&request.tools, Some(n), tool_format)?)
        }
        (None, _) => None,
    };
    let logits_processor = match shape {
        None => None,
        Some(shape) => {
            let room = s
                .model
                .info()
                .context_length
                .map_or(usize::MAX, |c| c.saturating_sub(ids.len()));
            let budget = request
                .max_tokens
                .unwrap_or(Generation::DEFAULT_MAX_NEW_TOKENS.min(room));
            // The shortest output and its end-of-sequence token.
            let need = shape.min_bytes() + 1;
            if need > budget {
                return Err(ApiError::invalid(
                    request.max_field,
                    format!(
                        "the shortest output the requested format allows takes {need} tokens; \
                         {} is {budget}",
                        request.max_field
                    ),
                ));
            }
            let vocabulary = s.vocabulary().await?;
            Some(SharedLogitsProcessor::new(constraint::JsonConstraint::new(
                shape, vocabulary, budget,
            )))
        }
    };
    let vocab = match request.logprobs {
        Some(_) => Some(Vocab(
            s.model
                .token_bytes()
                .map_err(|e| ApiError::invalid("logprobs", e.to_string()))?,
        )),
        None => None,
    };
    // A harmony-format model's chat replies keep their channel markup for the parser.
    let harmony =
        chat && s.model.tool_call_format() == Some(mlxcel_models::ToolCallFormat::Harmony);
    let options = Generation {
        keep_special_tokens: harmony,
        max_new_tokens: request.max_tokens,
        sampling: request.sampling.clone(),
        stop: request.stop.clone(),
        adapters: mix,
        logprobs: request.logprobs,
        logits_processor,
        images,
        ..Generation::default()
    };
    let (tx, rx) = mpsc::channel::<Event>(64);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<Result<(), ApiError>>();
    tokio::spawn(drive(s.clone(), ids, prompt, options, tx, started_tx));
    // The task answers once generation started (or failed to).
    started_rx
        .await
        .map_err(|_| internal("the generation task stopped"))??;

    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = Meta {
        id: if chat {
            format!("chatcmpl-{id}")
        } else {
            format!("cmpl-{id}")
        },
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: answered_as,
        chat,
        vocab,
        tool_names: (request.tool_choice != ToolChoice::None && !request.tools.is_empty())
            .then(|| request.tool_names()),
        harmony,
    };
    if request.stream {
        Ok(stream_response(meta, request, rx))
    } else {
        collect_response(meta, rx).await
    }
}

async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        ApiError::other(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body could not be read within the {limit}-byte limit: {e}"),
        )
        .code("request_too_large")
    })
}

/// Decodes a request's images, refusing (naming the field) one that is not a PNG, JPEG or WebP
/// image or that is larger than [`api::MAX_IMAGE_PIXELS`] (checked from its header, before its
/// pixels are decoded).
fn decode_images(parts: &[api::ImagePart]) -> Result<Vec<mlxcel_models::RgbImage>, ApiError> {
    parts
        .iter()
        .map(|part| {
            let refused = |e: mlxcel_models::Error| {
                ApiError::invalid(part.field.clone(), format!("`{}`: {e}", part.field))
            };
            let (width, height) =
                mlxcel_models::image_dimensions(&part.bytes).map_err(|e| refused(e.into()))?;
            if width.saturating_mul(height) > api::MAX_IMAGE_PIXELS {
                return Err(ApiError::too_large(
                    part.field.clone(),
                    format!(
                        "`{}`: the image is {width}x{height}; an image may have at most {} \
                         megapixels",
                        part.field,
                        api::MAX_IMAGE_PIXELS / 1_000_000
                    ),
                ));
            }
            mlxcel_models::decode_image(&part.bytes).map_err(|e| refused(e.into()))
        })
        .collect()
}

fn internal(message: impl Into<String>) -> ApiError {
    ApiError::other(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
}

/// Runs one generation: waits for a place among the [`ServerConfig::parallel`] running ones,
/// takes the idle session sharing the longest prefix (a fresh, unkept one when every kept
/// session is busy), forwards the pieces to `tx` and cancels when the response is gone.
async fn drive(
    s: Shared,
    ids: Vec<u32>,
    prompt: Prompt,
    options: Generation,
    tx: mpsc::Sender<Event>,
    started: tokio::sync::oneshot::Sender<Result<(), ApiError>>,
) {
    let _pending = Count(&s.metrics.pending);
    let Ok(_place) = s.places.acquire().await else {
        return;
    };
    if tx.is_closed() {
        return;
    }
    s.metrics.running.fetch_add(1, Ordering::Relaxed);
    let _running = Count(&s.metrics.running);

    let (slot, stream) = {
        let mut pool = s.pool.lock().await;
        match pick(&pool, &ids) {
            Some(index) => {
                pool.clock += 1;
                let clock = pool.clock;
                let slot = &mut pool.slots[index];
                slot.last_used = clock;
                slot.busy = true;
                // Unknown until the generation has ended.
                slot.tokens.clear();
                (Some(index), slot.session.generate(prompt, options))
            }
            None => (None, s.model.generate(prompt, options)),
        }
    };
    match stream {
        Ok(stream) => {
            let _ = started.send(Ok(()));
            forward(&s, stream.into_async(), &tx).await;
        }
        Err(e) => {
            let _ = started.send(Err(match e {
                mlxcel_models::Error::Invalid(m) => {
                    ApiError::other(StatusCode::BAD_REQUEST, "invalid_request_error", m)
                }
                e => internal(e.to_string()),
            }));
        }
    }
    if let Some(index) = slot {
        refresh(&s, index).await;
    }
}

/// The idle slot whose cached tokens share the longest prefix with `ids`; the least recently
/// used idle one when none shares any; `None` when every slot is busy.
fn pick(pool: &Pool, ids: &[u32]) -> Option<usize> {
    let shared = |t: &[u32]| t.iter().zip(ids).take_while(|(a, b)| a == b).count();
    let idle = || pool.slots.iter().enumerate().filter(|(_, s)| !s.busy);
    idle()
        .map(|(i, slot)| (i, shared(&slot.tokens)))
        .filter(|(_, len)| *len > 0)
        .max_by_key(|(i, len)| (*len, std::cmp::Reverse(*i)))
        .map(|(i, _)| i)
        .or_else(|| idle().min_by_key(|(_, s)| s.last_used).map(|(i, _)| i))
}

/// Reads slot `index`'s tokens back from the worker (after the generation, cancelled or not,
/// has ended there) and makes it idle again.
async fn refresh(s: &Shared, index: usize) {
    let s = s.clone();
    let mut pool = s.pool.clone().lock_owned().await;
    let _ = tokio::task::spawn_blocking(move || {
        if let Some(slot) = pool.slots.get_mut(index) {
            slot.tokens = slot.session.cached_tokens().unwrap_or_default();
            slot.busy = false;
        }
        let held = pool.slots.iter().map(|slot| slot.tokens.len()).sum();
        s.metrics.cached_tokens.store(held, Ordering::Relaxed);
        drop(pool);
    })
    .await;
}

async fn forward(s: &AppState, mut stream: AsyncTokenStream, tx: &mpsc::Sender<Event>) {
    use futures_core::Stream;
    loop {
        let next = tokio::select! {
            next = std::future::poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)) => next,
            _ = tx.closed() => {
                stream.cancel();
                return;
            }
        };
        match next {
            Some(Ok(piece)) => {
                if piece.text.is_empty() && piece.logprobs.is_empty() {
                    continue;
                }
                if tx
                    .send(Event::Piece(piece.text, piece.logprobs))
                    .await
                    .is_err()
                {
                    stream.cancel();
                    return;
                }
            }
            Some(Err(e)) => {
                let _ = tx.send(Event::Failed(e.to_string())).await;
                return;
            }
            None => {
                let Some(stats) = stream.stats().cloned() else {
                    let _ = tx
                        .send(Event::Failed(
                            "the generation ended without statistics".into(),
                        ))
                        .await;
                    return;
                };
                let m = &s.metrics;
                m.prompt_tokens
                    .fetch_add(stats.prompt_tokens as u64, Ordering::Relaxed);
                m.completion_tokens
                    .fetch_add(stats.generated_tokens as u64, Ordering::Relaxed);
                m.reused_tokens
                    .fetch_add(stats.reused_tokens as u64, Ordering::Relaxed);
                m.last_prefill_tps.store(
                    stats.prefill_tokens_per_second().to_bits(),
                    Ordering::Relaxed,
                );
                m.last_decode_tps.store(
                    stats.decode_tokens_per_second().to_bits(),
                    Ordering::Relaxed,
                );
                let _ = tx.send(Event::Done(Box::new(stats))).await;
                return;
            }
        }
    }
}

/// What every response and chunk repeats.
struct Meta {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    /// Set when the request asked for logprobs.
    vocab: Option<Vocab>,
    /// The declared tools' names, when the output is to be read for tool calls.
    tool_names: Option<Vec<String>>,
    /// The model replies in harmony markup (gpt-oss): always parsed.
    harmony: bool,
}

/// `finish_reason`: `tool_calls` when the reply made calls and ended by itself.
fn finish_reason(stats: &GenerationStats, called: bool) -> &'static str {
    match stats.finish {
        FinishReason::Length => "length",
        FinishReason::Eos | FinishReason::Stop if called => "tool_calls",
        FinishReason::Eos | FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

/// OpenAI's `tool_calls` entry for the `index`-th call of a response; `delta` adds the index
/// (streamed chunks carry it).
fn tool_call_json(meta: &Meta, index: usize, call: &tools::ToolCall, delta: bool) -> Value {
    let mut v = json!({
        "id": format!("call_{}_{index}", meta.id),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    });
    if delta {
        v["index"] = json!(index);
    }
    v
}

fn usage(stats: &GenerationStats) -> Value {
    json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
    })
}

async fn collect_response(meta: Meta, mut rx: mpsc::Receiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    let stats = loop {
        match rx.recv().await {
            Some(Event::Piece(t, l)) => {
                text.push_str(&t);
                lps.extend(l);
            }
            Some(Event::Done(stats)) => break stats,
            Some(Event::Failed(e)) => return Err(internal(e)),
            None => return Err(internal("the generation stopped")),
        }
    };
    let logprobs = meta.logprobs(&lps, &mut 0);
    let choice = if meta.chat {
        let mut message = json!({"role": "assistant", "content": text});
        let mut called = false;
        if let Some(mut parser) = tools::ReplyParser::new(meta.harmony, meta.tool_names.clone()) {
            let mut outputs = parser.push(&text);
            outputs.extend(parser.finish());
            let (mut content, mut reasoning) = (String::new(), String::new());
            let mut calls = Vec::new();
            for o in outputs {
                match o {
                    tools::Output::Text(t) => content.push_str(&t),
                    tools::Output::Reasoning(t) => reasoning.push_str(&t),
                    tools::Output::Call(c) => {
                        calls.push(tool_call_json(&meta, calls.len(), &c, false))
                    }
                }
            }
            message["content"] = json!(content);
            if !reasoning.is_empty() {
                message["reasoning_content"] = json!(reasoning);
            }
            if !calls.is_empty() {
                called = true;
                message["content"] = if content.trim().is_empty() {
                    Value::Null
                } else {
                    json!(content)
                };
                message["tool_calls"] = Value::Array(calls);
            }
        }
        json!({
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason(&stats, called),
        })
    } else {
        json!({
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(&stats, false),
        })
    };
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "id": meta.id,
            "object": if meta.chat { "chat.completion" } else { "text_completion" },
            "created": meta.created,
            "model": meta.model,
            "choices": [choice],
            "usage": usage(&stats),
        }),
    ))
}

impl Meta {
    /// One streamed chunk with `choices` (and `usage`: null when usage was asked for).
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Bytes {
        let mut chunk = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let (Some(u), Some(obj)) = (usage, chunk.as_object_mut()) {
            obj.insert("usage".into(), u);
        }
        Bytes::from(format!("data: {chunk}\n\n"))
    }

    /// The `logprobs` of a choice for `tokens` (null unless asked for); `offset`: see
    /// [`Vocab::completion`].
    fn logprobs(&self, tokens: &[TokenLogprob], offset: &mut usize) -> Value {
        match &self.vocab {
            None => Value::Null,
            Some(v) if self.chat => v.chat(tokens),
            Some(v) => v.completion(tokens, offset),
        }
    }

    fn delta(
        &self,
        text: Option<&str>,
        role: bool,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        if self.chat {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
        } else {
            json!([{"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}])
        }
    }
}

/// The body of a streamed response: SSE chunks read from the generating task.
struct SseBody {
    rx: mpsc::Receiver<Event>,
    meta: Meta,
    include_usage: bool,
    /// Chunks ready to send, in order.
    queue: std::collections::VecDeque<Bytes>,
    done: bool,
    /// Bytes of completion text sent so far (the legacy logprobs' `text_offset`).
    offset: usize,
    /// Reads tool calls (when the request declared tools) or harmony markup out of the text.
    tools: Option<tools::ReplyParser>,
    /// Tool calls sent so far.
    calls: usize,
}

impl SseBody {
    /// Queues the chunks for `outputs` of the tool-call parser (the first text chunk carries
    /// `logprobs`).
    fn queue_outputs(&mut self, outputs: Vec<tools::Output>, mut logprobs: Value) {
        let usage_null = self.include_usage.then_some(Value::Null);
        for o in outputs {
            let lp = std::mem::take(&mut logprobs);
            let chunk = match o {
                tools::Output::Text(t) => self.meta.chunk(
                    self.meta.delta(Some(&t), false, None, lp),
                    usage_null.clone(),
                ),
                tools::Output::Reasoning(t) => {
                    let choices = json!([{"index": 0, "delta": {"reasoning_content": t}, "logprobs": lp, "finish_reason": null}]);
                    self.meta.chunk(choices, usage_null.clone())
                }
                tools::Output::Call(c) => {
                    let call = tool_call_json(&self.meta, self.calls, &c, true);
                    self.calls += 1;
                    let choices = json!([{"index": 0, "delta": {"tool_calls": [call]}, "logprobs": lp, "finish_reason": null}]);
                    self.meta.chunk(choices, usage_null.clone())
                }
            };
            self.queue.push_back(chunk);
        }
        if !logprobs.is_null() {
            let chunk = self
                .meta
                .chunk(self.meta.delta(None, false, None, logprobs), usage_null);
            self.queue.push_back(chunk);
        }
    }
}

impl futures_core::Stream for SseBody {
    type Item = Result<Bytes, std::convert::Infallible>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if let Some(b) = this.queue.pop_front() {
                return Poll::Ready(Some(Ok(b)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            let usage_null = this.include_usage.then_some(Value::Null);
            match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Event::Piece(t, lps))) => {
                    let logprobs = this.meta.logprobs(&lps, &mut this.offset);
                    let outputs = match this.tools.as_mut() {
                        Some(parser) => parser.push(&t),
                        None => vec![tools::Output::Text(t)],
                    };
                    this.queue_outputs(outputs, logprobs);
                }
                Poll::Ready(Some(Event::Done(stats))) => {
                    if let Some(outputs) = this.tools.as_mut().map(|p| p.finish()) {
                        this.queue_outputs(outputs, Value::Null);
                    }
                    let finish = finish_reason(&stats, this.calls > 0);
                    let c = this.meta.chunk(
                        this.meta.delta(None, false, Some(finish), Value::Null),
                        usage_null,
                    );
                    this.queue.push_back(c);
                    if this.include_usage {
                        let c = this.meta.chunk(json!([]), Some(usage(&stats)));
                        this.queue.push_back(c);
                    }
                    this.queue
                        .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    this.done = true;
                }
                Poll::Ready(Some(Event::Failed(e))) => {
                    let err = internal(e).body();
                    this.queue
                        .push_back(Bytes::from(format!("data: {err}\n\n")));
                    this.queue
                        .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    this.done = true;
                }
                Poll::Ready(None) => {
                    let err = internal("the generation stopped").body();
                    this.queue
                        .push_back(Bytes::from(format!("data: {err}\n\n")));
                    this.done = true;
                }
            }
        }
    }
}

fn stream_response(meta: Meta, request: Request, rx: mpsc::Receiver<Event>) -> Response {
    let mut queue = std::collections::VecDeque::new();
    if meta.chat {
        let usage_null = request.include_usage.then_some(Value::Null);
        queue.push_back(meta.chunk(meta.delta(Some(""), true, None, Value::Null), usage_null));
    }
    let parser = tools::ReplyParser::new(meta.harmony, meta.tool_names.clone());
    let body = SseBody {
        rx,
        meta,
        include_usage: request.include_usage,
        tools: parser,
        calls: 0,
        queue,
        done: false,
        offset: 0,
    };
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}
