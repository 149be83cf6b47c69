//! Runs one benchmark process: output to files (no pipe can fill up), peak RSS from `wait4`.

use std::fs::File;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

/// What a finished child left.
pub struct Finished {
    pub stdout: String,
    pub stderr: String,
    /// `ru_maxrss` of the child, in bytes.
    pub max_rss_bytes: u64,
    pub wall_s: f64,
}

/// Runs `cmd` to completion with stdout and stderr captured in `log_dir/<tag>.{out,err}`.
pub fn run(mut cmd: Command, log_dir: &Path, tag: &str) -> Result<Finished> {
    let out_path = log_dir.join(format!("{tag}.out"));
    let err_path = log_dir.join(format!("{tag}.err"));
    cmd.stdout(File::create(&out_path).with_context(|| format!("{}", out_path.display()))?);
    cmd.stderr(File::create(&err_path).with_context(|| format!("{}", err_path.display()))?);
    cmd.stdin(std::process::Stdio::null());
    let started = Instant::now();
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: `rusage` is plain data that wait4 fills; `pid` is our own child, reaped here
    // (the `Child` handle is dropped without waiting, so it is not reaped twice).
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = loop {
        let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if rc == -1 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        break rc;
    };
    drop(child);
    let wall_s = started.elapsed().as_secs_f64();
    if rc != pid {
        bail!("wait4 on {tag} failed: {}", std::io::Error::last_os_error());
    }
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        let tail: String = {
            let lines: Vec<&str> = stderr.lines().collect();
            lines[lines.len().saturating_sub(15)..].join("\n")
        };
        bail!(
            "{tag} failed (wait status {status}); stderr tail ({}):\n{tail}",
            err_path.display()
        );
    }
    Ok(Finished {
        stdout,
        stderr,
        // Linux reports ru_maxrss in KiB.
        max_rss_bytes: usage.ru_maxrss.max(0) as u64 * 1024,
        wall_s,
    })
}
