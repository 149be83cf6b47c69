//! `cargo xtask bench --serve`: aggregate decode throughput of `mlxcel serve` against
//! `mlx_lm.server` (both batch concurrent requests) on SmolLM2-135M-Instruct 4-bit, with 1 and
//! 8 concurrent clients, in the same run. Both servers stay up side by side (an idle one costs
//! nothing) and the runs alternate between them. Each client sends one non-streamed greedy chat
//! request with its own prompt; a run's figure is the completion tokens of all its requests
//! over the wall time from the first request sent to the last reply read (prefill included).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use super::stats::median;

/// Concurrent clients per measured point.
const CONCURRENCY: [usize; 2] = [1, 8];
/// Tokens each request asks for.
const MAX_TOKENS: usize = 128;
const SUBJECTS: [&str; 8] = [
    "a dragon who collects maps",
    "a lighthouse keeper on Mars",
    "two rival bakers in Lyon",
    "a robot learning to paint",
    "a river that flows uphill",
    "the last library on Earth",
    "a cat who runs a train station",
    "an orchestra of clocks",
];

/// A server process, killed when dropped.
struct Server {
    name: &'static str,
    child: Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A minimal HTTP/1.1 exchange (one request per connection).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("no HTTP header block from {addr}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("no status line from {addr}"))?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = rest;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || after.len() < n {
                break;
            }
            out.push_str(&after[..n]);
            rest = after[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        rest.to_string()
    };
    Ok((status, body))
}

fn start(name: &'static str, mut cmd: Command, port: u16, logs: &Path) -> Result<Server> {
    let log = std::fs::File::create(logs.join(format!("serve-{name}.log")))?;
    cmd.stdout(log.try_clone()?)
        .stderr(log)
        .stdin(Stdio::null());
    let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
    let server = Server {
        name,
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
    };
    let t = Instant::now();
    while !matches!(http(server.addr, "GET", "/health", ""), Ok((200, _))) {
        if t.elapsed() > Duration::from_secs(180) {
            bail!(
                "{name} did not answer on {} within 180 s (log: {})",
                server.addr,
                logs.join(format!("serve-{name}.log")).display()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(server)
}

/// `clients` concurrent greedy requests; returns (completion tokens, wall seconds).
fn measure(server: &Server, clients: usize, round: usize) -> Result<(u64, f64)> {
    let barrier = Arc::new(Barrier::new(clients + 1));
    let addr = server.addr;
    let threads: Vec<_> = (0..clients)
        .map(|i| {
            let barrier = barrier.clone();
            let subject = SUBJECTS[(i + round) % SUBJECTS.len()];
            // No `model`: both serve the one they loaded (mlx_lm.server would fetch another).
            let body = json!({
                "messages": [{"role": "user", "content": format!("Write a long story about {subject}.")}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
            })
            .to_string();
            std::thread::spawn(move || -> Result<u64> {
                barrier.wait();
                let (status, body) = http(addr, "POST", "/v1/chat/completions", &body)?;
                if status != 200 {
                    bail!("HTTP {status}: {body}");
                }
                let v: Value = serde_json::from_str(&body)?;
                v["usage"]["completion_tokens"]
                    .as_u64()
                    .ok_or_else(|| anyhow!("no usage.completion_tokens in {body}"))
            })
        })
        .collect();
    barrier.wait();
    let t = Instant::now();
    let mut tokens = 0;
    for th in threads {
        tokens += th
            .join()
            .map_err(|_| anyhow!("a client thread panicked"))?
            .with_context(|| format!("{} request", server.name))?;
    }
    Ok((tokens, t.elapsed().as_secs_f64()))
}

/// Runs the comparison; returns the markdown table.
pub fn run(logs: &Path, bin: &Path, py: &Path, model: &Path, runs: usize) -> Result<String> {
    let (ours_port, theirs_port) = (free_port()?, free_port()?);
    let mut ours = Command::new(bin);
    ours.arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--port", &ours_port.to_string()])
        .args(["--parallel", "8", "--max-queue", "32"]);
    let mut theirs = Command::new(py);
    theirs
        .args(["-m", "mlx_lm", "server", "--model"])
        .arg(model)
        .args(["--port", &theirs_port.to_string(), "--log-level", "WARNING"])
        // The default already batches; stated so the comparison is explicit.
        .args(["--decode-concurrency", "8"]);
    let servers = [
        start("mlxcel", ours, ours_port, logs)?,
        start("mlx_lm.server", theirs, theirs_port, logs)?,
    ];
    // A warm-up request each (kernels, caches).
    for s in &servers {
        measure(s, 1, 0)?;
    }
    let mut rows = Vec::new();
    for clients in CONCURRENCY {
        let mut tps = [Vec::new(), Vec::new()];
        for round in 0..runs {
            for (k, s) in servers.iter().enumerate() {
                let (tokens, wall) = measure(s, clients, round)?;
                eprintln!(
                    "serve bench: {} x{clients} run {round}: {tokens} tokens in {wall:.2} s",
                    s.name
                );
                tps[k].push(tokens as f64 / wall);
            }
        }
        rows.push((clients, median(&tps[0]), median(&tps[1])));
    }
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
        _ => "-".into(),
    };
    let mut out = String::from(
        "| clients | mlxcel serve tok/s | mlx_lm.server tok/s | mlxcel / mlx_lm |\n|---|---|---|---|\n",
    );
    for (clients, a, b) in &rows {
        out.push_str(&format!(
            "| {clients} | {} | {} | {} |\n",
            f(*a),
            f(*b),
            ratio(*a, *b)
        ));
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        out.push_str(&format!(
            "\nmlxcel with {} clients vs its own single stream: {}; mlx_lm.server: {}.\n",
            last.0,
            ratio(last.1, first.1),
            ratio(last.2, first.2)
        ));
    }
    out.push_str(&format!(
        "\nModel {}, greedy chat requests of {MAX_TOKENS} tokens, median of {runs} runs per point; \
         tok/s = completion tokens of all requests / wall time of the run (prefill included).\n",
        model.display()
    ));
    Ok(out)
}
