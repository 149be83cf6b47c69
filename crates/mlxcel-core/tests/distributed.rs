//! MLX's distributed layer through the bindings: real processes joined by the TCP ring backend
//! on loopback. The test re-runs its own binary as the ranks (`ring_rank`, which does nothing
//! unless `MLXCEL_TEST_RING` is set).

use std::process::Command;

use mlxcel_core::distributed::{self, Backend};
use mlxcel_core::{Array, Dtype};

/// A JSON ring hostfile for `n` ranks on loopback, on ports free right now.
fn loopback_hostfile(n: usize) -> String {
    let ports: Vec<u16> = (0..n)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free loopback port")
        })
        .collect();
    let ranks: Vec<String> = ports
        .iter()
        .map(|p| format!("[\"127.0.0.1:{p}\"]"))
        .collect();
    format!("[{}]", ranks.join(","))
}

fn run_ring(n: usize) -> Vec<std::process::Output> {
    let dir = std::env::temp_dir().join(format!("mlxcel-ring-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hostfile = dir.join("hosts.json");
    std::fs::write(&hostfile, loopback_hostfile(n)).unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..n)
        .map(|rank| {
            let mut c = Command::new(&exe);
            c.args(["ring_rank", "--exact", "--nocapture", "--test-threads", "1"])
                .env("MLXCEL_TEST_RING", "1")
                .env("MLX_RANK", rank.to_string())
                .env("MLX_HOSTFILE", &hostfile);
            c.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

#[test]
fn ring_collectives_over_loopback() {
    for n in [2, 3] {
        let outputs = run_ring(n);
        for (rank, o) in outputs.iter().enumerate() {
            let err = String::from_utf8_lossy(&o.stderr);
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(
                o.status.success(),
                "rank {rank} of {n} failed:\n{out}\n{err}"
            );
            assert!(out.contains("ring rank ok"), "rank {rank} of {n}:\n{out}");
        }
    }
}

#[test]
fn ring_rank() {
    if std::env::var_os("MLXCEL_TEST_RING").is_none() {
        return;
    }
    assert!(distributed::is_available(Backend::Ring).unwrap());
    let g = distributed::init(Backend::Ring, true).unwrap();
    let (rank, size) = (g.rank(), g.size());
    assert_eq!(rank.to_string(), std::env::var("MLX_RANK").unwrap());
    let r = rank as f32;
    let x = Array::from_slice(&[r, 10.0 * r, 1.0], &[3]).unwrap();
    let n = size as f32;
    let tri = n * (n - 1.0) / 2.0;
    assert_eq!(
        g.all_sum(&x).unwrap().to_vec::<f32>().unwrap(),
        [tri, 10.0 * tri, n]
    );
    assert_eq!(
        g.all_max(&x).unwrap().to_vec::<f32>().unwrap(),
        [n - 1.0, 10.0 * (n - 1.0), 1.0]
    );
    let gathered = g.all_gather(&x.reshape(&[1, 3]).unwrap()).unwrap();
    assert_eq!(gathered.shape(), vec![size as i32, 3]);
    let rows = gathered.to_vec::<f32>().unwrap();
    for k in 0..size {
        assert_eq!(rows[3 * k], k as f32);
    }
    // Around the ring: each rank sends to the next and receives from the previous.
    let next = (rank + 1) % size;
    let prev = (rank + size - 1) % size;
    let payload = Array::from_slice(&[r; 4], &[2, 2]).unwrap();
    let received = if rank % 2 == 0 {
        let sent = g.send(&payload, next).unwrap();
        sent.eval().unwrap();
        g.recv(&[2, 2], Dtype::Float32, prev).unwrap()
    } else {
        let got = g.recv(&[2, 2], Dtype::Float32, prev).unwrap();
        got.eval().unwrap();
        g.send(&payload, next).unwrap().eval().unwrap();
        got
    };
    assert_eq!(received.to_vec::<f32>().unwrap(), [prev as f32; 4]);
    // `depends`: the first result carries the second's evaluation with it.
    let tied = distributed::depends(std::slice::from_ref(&x), &[g.all_sum(&x).unwrap()]).unwrap();
    assert_eq!(tied[0].to_vec::<f32>().unwrap(), [r, 10.0 * r, 1.0]);
    println!("ring rank ok");
}
