//! `mlxcel launch`: one process per rank of a model spread over several processes (tensor or
//! pipeline parallelism over MLX's distributed layer), and the other side of it: a rank
//! started by `launch` finds its part in the environment ([`parallelism_from_env`]), so
//! `generate`, `chat` and `logits` run under it unchanged.
//!
//! The launcher sets each rank's environment for the chosen MLX backend (ring: `MLX_RANK` and
//! `MLX_HOSTFILE`, a JSON list of `"ip:port"` lists, written for loopback unless `--hosts`
//! gives one; NCCL: `MLX_RANK`, `MLX_WORLD_SIZE`, `NCCL_HOST_IP`, `NCCL_PORT` and one
//! `CUDA_VISIBLE_DEVICES` per rank), plus `MLXCEL_PARALLEL` (`tensor` or `pipeline`) and
//! `MLXCEL_DIST_BACKEND`. Rank 0's stdout and stderr are the launcher's; the others' stdout is
//! dropped (every rank computes the same tokens) and their stderr kept in a log, shown when
//! that rank fails. Standard input goes to every rank (a chat's turns). When a rank fails,
//! every other is stopped and the launcher exits with an error naming it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use mlxcel_arch::parallel::{Parallelism, PipelinePlan, TensorParallel};
use mlxcel_core::distributed::{self, Backend};

/// How the model is spread over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Every layer on every rank, heads and MLP columns split (one all_sum per block half).
    Tensor,
    /// Contiguous layer ranges per rank; hidden states passed on with send/recv.
    Pipeline,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Tensor => "tensor",
            Mode::Pipeline => "pipeline",
        }
    }
}

/// `mlxcel launch` flags; the command to run in each rank follows `--`.
#[derive(Args, Debug)]
pub struct LaunchFlags {
    /// Processes (ranks) to start.
    #[arg(long)]
    pub nproc: usize,
    /// MLX's transport: `ring` (TCP, CPU), `nccl` (CUDA GPUs, one per rank), or `any` (NCCL
    /// when this MLX has it and a GPU, else the ring).
    #[arg(long, default_value = "any")]
    pub backend: String,
    /// A ring hostfile (MLX's JSON: one list of "ip:port" per rank) instead of loopback ports.
    #[arg(long, value_name = "FILE")]
    pub hosts: Option<PathBuf>,
    /// Start only these ranks here (comma-separated; default: all): with `--hosts`, run
    /// `mlxcel launch` on each host for the ranks its addresses belong to.
    #[arg(long, value_delimiter = ',', requires = "hosts")]
    pub ranks: Option<Vec<usize>>,
    /// Tensor or pipeline parallelism.
    #[arg(long, value_enum, default_value_t = Mode::Tensor)]
    pub mode: Mode,
    /// Pipeline parallelism: layers per rank, comma-separated in rank order (sized to each
    /// rank's memory; default: as even as possible).
    #[arg(long, value_delimiter = ',')]
    pub layers: Option<Vec<usize>>,
    /// Print each rank's share of the memory estimate and exit (the command's `--model`,
    /// `--max-context` and `--prefill-chunk` are read).
    #[arg(long)]
    pub estimate_memory: bool,
    /// Seconds the other ranks may take to finish after one has ended successfully.
    #[arg(long, default_value_t = 30)]
    pub grace: u64,
    /// The mlxcel command each rank runs (`generate ...`, `chat ...`, `logits ...`).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// `MLXCEL_PIPELINE_LAYERS` (`--layers`): layers per rank, comma-separated.
fn layers_per_rank_from_env() -> anyhow::Result<Option<Vec<usize>>> {
    match std::env::var("MLXCEL_PIPELINE_LAYERS") {
        Ok(v) if !v.is_empty() => Ok(Some(
            v.split(',')
                .map(|c| c.trim().parse::<usize>())
                .collect::<Result<_, _>>()
                .with_context(|| {
                    format!("MLXCEL_PIPELINE_LAYERS={v}: expected counts like 10,22")
                })?,
        )),
        _ => Ok(None),
    }
}

/// The part of a model this process builds when `mlxcel launch` started it (`MLXCEL_PARALLEL`
/// set): joins the group through the backend the launcher chose. `None` for a plain run.
pub fn parallelism_from_env() -> anyhow::Result<Option<Parallelism>> {
    let Ok(mode) = std::env::var("MLXCEL_PARALLEL") else {
        return Ok(None);
    };
    let backend = std::env::var("MLXCEL_DIST_BACKEND").unwrap_or_else(|_| "any".into());
    let backend = Backend::parse(&backend)?;
    let group = distributed::init(backend, true).with_context(|| {
        format!(
            "joining the {} group (rank {})",
            backend.name(),
            std::env::var("MLX_RANK").unwrap_or_default()
        )
    })?;
    if group.size() == 1 {
        return Ok(None);
    }
    Ok(Some(match mode.as_str() {
        "tensor" => Parallelism::Tensor(TensorParallel::new(group)),
        "pipeline" => Parallelism::Pipeline(PipelinePlan {
            group,
            layers_per_rank: layers_per_rank_from_env()?,
        }),
        other => bail!("MLXCEL_PARALLEL={other}: expected `tensor` or `pipeline`"),
    }))
}

/// This process's part for the memory estimate (the whole model outside `mlxcel launch`).
pub fn rank_part_from_env() -> mlxcel_loading::memory::RankPart {
    let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    match (
        std::env::var("MLXCEL_PARALLEL"),
        var("MLX_RANK"),
        var("MLX_WORLD_SIZE"),
    ) {
        (Ok(mode), Some(rank), Some(size)) if rank < size => mlxcel_loading::memory::RankPart {
            pipeline: mode == "pipeline",
            rank,
            size,
            layers_per_rank: layers_per_rank_from_env().ok().flatten(),
        },
        _ => mlxcel_loading::memory::RankPart::WHOLE,
    }
}

/// Whether this process writes the run's outputs: always, but under `mlxcel launch` only rank 0
/// (every rank computes the same result).
pub fn writes_outputs() -> bool {
    std::env::var_os("MLXCEL_PARALLEL").is_none()
        || std::env::var("MLX_RANK").map_or(true, |r| r == "0")
}

/// The backend `--backend` names, `any` resolved.
fn resolve_backend(name: &str) -> anyhow::Result<Backend> {
    let backend = Backend::parse(name)?;
    if backend != Backend::Any {
        if !distributed::is_available(backend)? {
            bail!(
                "--backend {name}: this MLX ({}) was built without it",
                mlxcel_core::mlx_version()?
            );
        }
        return Ok(backend);
    }
    let gpu = mlxcel_core::Device::Gpu.is_available()?;
    Ok(if gpu && distributed::is_available(Backend::Nccl)? {
        Backend::Nccl
    } else {
        Backend::Ring
    })
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A ring hostfile of `n` ranks on loopback ports free now.
fn loopback_hostfile(n: usize) -> anyhow::Result<String> {
    let ranks = (0..n)
        .map(|_| Ok(format!("[\"127.0.0.1:{}\"]", free_port()?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(format!("[{}]\n", ranks.join(",")))
}

/// Ranks listed in a ring hostfile (checking its shape).
fn hostfile_ranks(path: &Path) -> anyhow::Result<usize> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let ranks = value
        .as_array()
        .filter(|a| {
            a.iter()
                .all(|r| r.as_array().is_some_and(|r| !r.is_empty()))
        })
        .with_context(|| {
            format!(
                "{}: a ring hostfile is a list with one non-empty list of \"ip:port\" per rank",
                path.display()
            )
        })?;
    Ok(ranks.len())
}

pub fn run(flags: LaunchFlags) -> anyhow::Result<()> {
    if flags.nproc == 0 {
        bail!("--nproc 0: at least one process");
    }
    let sub = flags.command.first().map(String::as_str).unwrap_or("");
    if !["generate", "chat", "logits"].contains(&sub) {
        bail!(
            "mlxcel launch runs `generate`, `chat` or `logits` in each rank, not `{sub}` (serving from several ranks is not supported yet)"
        );
    }
    if flags.estimate_memory {
        return estimate(&flags);
    }
    let backend = resolve_backend(&flags.backend)?;
    let layers: Vec<String> = flags
        .layers
        .iter()
        .flatten()
        .map(usize::to_string)
        .collect();
    let dir = std::env::temp_dir().join(format!("mlxcel-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    if flags.layers.is_some() && flags.mode != Mode::Pipeline {
        bail!("--layers sizes pipeline stages: add --mode pipeline");
    }
    // One process is a plain run: no group to join.
    let common = if flags.nproc == 1 {
        Vec::new()
    } else {
        distributed_env(&flags, backend, &layers, &dir)?
    };
    let exe = std::env::current_exe().context("locating the mlxcel executable")?;
    let local: Vec<usize> = flags
        .ranks
        .clone()
        .unwrap_or_else(|| (0..flags.nproc).collect());
    if let Some(bad) = local.iter().find(|r| **r >= flags.nproc) {
        bail!("--ranks: rank {bad} is not below --nproc {}", flags.nproc);
    }
    let mut children: Vec<Child> = Vec::with_capacity(local.len());
    let mut logs: Vec<Option<PathBuf>> = Vec::with_capacity(local.len());
    for &rank in &local {
        let mut cmd = Command::new(&exe);
        cmd.args(&flags.command)
            .env("MLX_RANK", rank.to_string())
            .stdin(Stdio::piped());
        for (k, v) in &common {
            cmd.env(k, v);
        }
        if backend == Backend::Nccl {
            cmd.env("CUDA_VISIBLE_DEVICES", rank.to_string());
        }
        if rank == 0 {
            cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit());
            logs.push(None);
        } else {
            let log = dir.join(format!("rank{rank}.log"));
            let file = std::fs::File::create(&log)
                .with_context(|| format!("creating {}", log.display()))?;
            cmd.stdout(Stdio::null()).stderr(file);
            logs.push(Some(log));
        }
        match cmd.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                stop_all(&mut children);
                bail!("starting rank {rank}: {e}");
            }
        }
    }
    forward_stdin(&mut children);
    let outcome = supervise(
        &mut children,
        &local,
        &logs,
        Duration::from_secs(flags.grace),
    );
    if outcome.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    outcome
}

/// The environment every rank of a job of more than one process shares: mlxcel's own
/// variables and those `backend` reads.
fn distributed_env(
    flags: &LaunchFlags,
    backend: Backend,
    layers: &[String],
    dir: &Path,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut common: Vec<(String, String)> = vec![
        ("MLXCEL_PARALLEL".into(), flags.mode.name().into()),
        ("MLXCEL_DIST_BACKEND".into(), backend.name().into()),
        ("MLX_WORLD_SIZE".into(), flags.nproc.to_string()),
        ("MLXCEL_PIPELINE_LAYERS".into(), layers.join(",")),
    ];
    match backend {
        Backend::Ring => {
            let hostfile = match &flags.hosts {
                Some(path) => {
                    let ranks = hostfile_ranks(path)?;
                    if ranks != flags.nproc {
                        bail!(
                            "--hosts {}: {ranks} ranks listed, --nproc {}",
                            path.display(),
                            flags.nproc
                        );
                    }
                    path.clone()
                }
                None => {
                    let path = dir.join("hosts.json");
                    std::fs::write(&path, loopback_hostfile(flags.nproc)?)?;
                    path
                }
            };
            common.push(("MLX_HOSTFILE".into(), hostfile.display().to_string()));
        }
        Backend::Nccl => {
            common.push(("NCCL_HOST_IP".into(), "127.0.0.1".into()));
            common.push(("NCCL_PORT".into(), free_port()?.to_string()));
        }
        other => bail!(
            "--backend {}: mlxcel launch sets up ring and nccl only",
            other.name()
        ),
    }
    Ok(common)
}

/// Copies this process's standard input to every rank, in a thread of its own (it ends with
/// the input or when the ranks stop reading).
fn forward_stdin(children: &mut [Child]) {
    let mut pipes: Vec<_> = children.iter_mut().filter_map(|c| c.stdin.take()).collect();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = [0u8; 8192];
        loop {
            let n = match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            pipes.retain_mut(|p| p.write_all(&buf[..n]).and_then(|_| p.flush()).is_ok());
            if pipes.is_empty() {
                break;
            }
        }
        // Dropping the pipes closes every rank's input.
    });
}

fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return format!("was killed by signal {signal}");
        }
    }
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => "ended".into(),
    }
}

fn stop_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
    }
    for c in children.iter_mut() {
        let _ = c.wait();
    }
}

fn log_tail(log: &Option<PathBuf>) -> String {
    let Some(path) = log else {
        return String::new();
    };
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(10)..];
    if tail.is_empty() {
        String::new()
    } else {
        format!(
            "\n  its log ({}):\n    {}",
            path.display(),
            tail.join("\n    ")
        )
    }
}

/// Whether a rank ended through a peer's failure rather than its own: killed by SIGPIPE
/// (writing to a socket the failed peer closed) or SIGTERM/SIGKILL sent by this launcher.
fn followed_a_peer(status: ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal() == Some(libc::SIGPIPE)
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        false
    }
}

/// Waits for every rank; on the first failure stops the others and names the rank that
/// failed (preferring one that failed on its own over one that died writing to it). Ranks
/// still running `grace` after one finished successfully are stopped too (a rank waiting for a
/// peer that is gone).
fn supervise(
    children: &mut [Child],
    ranks: &[usize],
    logs: &[Option<PathBuf>],
    grace: Duration,
) -> anyhow::Result<()> {
    let mut status: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut first_done: Option<Instant> = None;
    loop {
        for (rank, c) in children.iter_mut().enumerate() {
            if status[rank].is_none() {
                status[rank] = c.try_wait()?;
            }
        }
        let failed: Vec<usize> = (0..children.len())
            .filter(|r| status[*r].is_some_and(|s| !s.success()))
            .collect();
        if !failed.is_empty() {
            // A peer's own failure is seen a moment before the ranks it takes down; give them
            // that moment, then name the one that failed first.
            std::thread::sleep(Duration::from_millis(200));
            for (rank, c) in children.iter_mut().enumerate() {
                if status[rank].is_none() {
                    status[rank] = c.try_wait()?;
                }
            }
            stop_all(children);
            let failed: Vec<usize> = (0..children.len())
                .filter(|r| status[*r].is_some_and(|s| !s.success()))
                .collect();
            let first = failed
                .iter()
                .copied()
                .find(|r| !followed_a_peer(status[*r].expect("failed")))
                .unwrap_or(failed[0]);
            let others: Vec<String> = failed
                .iter()
                .filter(|r| **r != first)
                .map(|r| {
                    format!(
                        "rank {} {}",
                        ranks[*r],
                        describe(status[*r].expect("failed"))
                    )
                })
                .collect();
            bail!(
                "rank {} {}; stopped the other ranks{}{}",
                ranks[first],
                describe(status[first].expect("failed")),
                if others.is_empty() {
                    String::new()
                } else {
                    format!(" (then {})", others.join(", "))
                },
                log_tail(&logs[first])
            );
        }
        if status.iter().all(Option::is_some) {
            return Ok(());
        }
        if status.iter().any(Option::is_some) {
            let since = *first_done.get_or_insert_with(Instant::now);
            if since.elapsed() > grace {
                let stuck: Vec<usize> = (0..children.len())
                    .filter(|r| status[*r].is_none())
                    .map(|r| ranks[r])
                    .collect();
                stop_all(children);
                bail!(
                    "ranks {stuck:?} were still running {}s after another rank finished; stopped them",
                    grace.as_secs()
                );
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of `--flag VALUE` or `--flag=VALUE` in a rank's command.
fn command_flag<'a>(command: &'a [String], flag: &str) -> Option<&'a str> {
    let eq = format!("{flag}=");
    command.iter().enumerate().find_map(|(i, a)| {
        if a == flag {
            command.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix(&eq)
        }
    })
}

/// `--estimate-memory`: each rank's share of the run's memory.
fn estimate(flags: &LaunchFlags) -> anyhow::Result<()> {
    let model = match command_flag(&flags.command, "--model") {
        Some(m) => PathBuf::from(m),
        None => crate::generate::default_model()?,
    };
    let number = |flag: &str, default: u64| -> anyhow::Result<u64> {
        match command_flag(&flags.command, flag) {
            Some(v) => v
                .parse()
                .with_context(|| format!("{flag} {v}: not a number")),
            None => Ok(default),
        }
    };
    let context = number("--max-context", 4096)?;
    let chunk = number("--prefill-chunk", 512)?;
    let folder = mlxcel_loading::resolve_model_dir(&model)?;
    let config = mlxcel_loading::read_config(&folder)?;
    let dtype = mlxcel_loading::compute_dtype(&config)?;
    for rank in 0..flags.nproc {
        let part = mlxcel_loading::memory::RankPart {
            pipeline: flags.mode == Mode::Pipeline,
            rank,
            size: flags.nproc,
            layers_per_rank: flags.layers.clone(),
        };
        let est =
            mlxcel_loading::memory::estimate_rank(&folder, &config, dtype, context, chunk, &part)?;
        println!(
            "== rank {rank} of {} ({} parallel)",
            flags.nproc,
            flags.mode.name()
        );
        crate::generate::print_estimate(&est, context);
    }
    Ok(())
}
