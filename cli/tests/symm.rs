//! Symmetric memory across real processes, started by `symmem run`.
//!
//! Each `rank_*` test is a rank program: ignored in a normal run, started by the matching
//! launcher test as every rank of a job (`symmem run -n N -- <this binary> --exact rank_x`).

#![allow(clippy::print_stdout, reason = "rank programs report to the launcher through stdout")]

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use symmem::Group;
use symmem::symm::{self, Device, MemPool};
use symmem::tensor::{DType, Tensor};

const BIN: &str = env!("CARGO_BIN_EXE_symmem");
const T: Duration = Duration::from_secs(30);

/// Runs `scenario` as every rank of an `n`-rank job; returns (exit code, stdout, stderr).
fn job(n: usize, scenario: &str, env: &[(&str, &str)]) -> (i32, String, String) {
    let me = std::env::current_exe().unwrap();
    let out = Command::new(BIN)
        .args(["run", "-n", &n.to_string(), "--timeout", "120", "--"])
        .arg(me)
        .args(["--exact", scenario, "--include-ignored", "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .env_remove("SYMMEM_STORE_SECRET")
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

fn assert_job(n: usize, scenario: &str, env: &[(&str, &str)]) -> String {
    let (code, out, err) = job(n, scenario, env);
    assert_eq!(code, 0, "{scenario} with {n} ranks failed\nstdout:\n{out}\nstderr:\n{err}");
    for r in 0..n {
        let finished = out.lines().any(|l| l.starts_with(&format!("[{r}] ")) && l.ends_with(&format!("rank {r} ok")));
        assert!(finished, "rank {r} did not finish {scenario}:\n{out}\n{err}");
    }
    out
}

fn in_job() -> Option<Group> {
    std::env::var("RANK").ok()?;
    Some(Group::from_env().unwrap())
}

fn done(g: &Group) {
    println!("rank {} ok", g.rank());
}

#[test]
#[ignore = "a rank program; run by every_call_works_for_2_3_and_4_ranks"]
fn rank_every_call() {
    let Some(g) = in_job() else { return };
    let (me, ws) = (g.rank(), g.world_size());

    // Allocation: the data is separate from the pad.
    let x = symm::empty(&[4, 8], DType::F32, Device::Cpu).unwrap();
    assert!(symm::is_symm_mem_tensor(&x));
    assert!(!symm::is_symm_mem_tensor(&Tensor::zeros(&[2], DType::F32).unwrap()));
    x.fill(me as f32 + 0.5).unwrap();
    // The pad size may change after an allocation, for later ones (as PyTorch's); then back.
    symm::set_signal_pad_size(4096).unwrap();
    assert_eq!(symm::get_signal_pad_size(), 4096);
    symm::set_signal_pad_size(symm::DEFAULT_SIGNAL_PAD_SIZE).unwrap();
    assert_eq!(symm::get_signal_pad_size(), symm::DEFAULT_SIGNAL_PAD_SIZE);
    assert_eq!(symm::get_backend(Device::Cpu), Some("CPU"));
    assert!(symm::set_backend("NVSHMEM").unwrap_err().to_string().contains("unsupported"));

    // Rendezvous and the handle's properties.
    let h = symm::rendezvous(&x, &g).unwrap();
    assert!(Arc::ptr_eq(&h, &symm::rendezvous(&x, &g).unwrap()), "later calls return the cached handle");
    assert_eq!((h.rank(), h.world_size()), (me, ws));
    assert_eq!(h.buffer_ptrs().unwrap().len(), ws);
    assert_eq!(h.signal_pad_ptrs().unwrap().len(), ws);
    assert!(h.all_local() && h.remote_ranks().is_empty());
    assert_eq!(h.buffer_size(), 4 * 8 * 4);
    assert_eq!(h.signal_pad_size(), symm::DEFAULT_SIGNAL_PAD_SIZE);
    assert_eq!(h.multicast_ptr(), None);
    // Filling the data left the pad zero; a faster peer may already have raised its channel-0
    // barrier signal, and nothing else.
    let pad = h.get_signal_pad(me).unwrap().to_vec::<u32>().unwrap();
    assert_eq!(pad.len(), 9216 / 4);
    let stray: Vec<(usize, u32)> =
        pad.iter().copied().enumerate().filter(|&(i, v)| v != 0 && !(i < ws && v == 1)).collect();
    assert!(stray.is_empty(), "pad slots written outside the protocol: {stray:?}");

    // Peers' buffers.
    h.barrier(0, T).unwrap();
    for peer in 0..ws {
        let remote = h.get_remote_tensor(peer, &[4, 8], DType::F32).unwrap();
        assert_eq!(remote.to_vec::<f32>().unwrap(), vec![peer as f32 + 0.5; 32]);
        let tail = h.get_buffer(peer, &[8], DType::F32, 24).unwrap();
        assert_eq!(tail.to_vec::<f32>().unwrap(), vec![peer as f32 + 0.5; 8]);
        let dst = Tensor::zeros(&[3], DType::F32).unwrap();
        symm::get(&dst, &h, peer, 29).unwrap();
        assert_eq!(dst.to_vec::<f32>().unwrap(), vec![peer as f32 + 0.5; 3]);
    }
    let err = h.get_buffer(0, &[33], DType::F32, 0).unwrap_err().to_string();
    assert!(err.contains("exceeds the allocated size"), "{err}");
    let err = symm::get(&Tensor::zeros(&[4], DType::F32).unwrap(), &h, 0, 30).unwrap_err().to_string();
    assert!(err.contains("exceeds symmetric allocation"), "{err}");
    assert!(symm::get(&Tensor::zeros(&[1], DType::F32).unwrap(), &h, ws, 0).unwrap_err().to_string().contains("peer"));
    let all = symm::get_remote_tensors(&x, &g).unwrap();
    assert_eq!(all.len(), ws);
    assert_eq!(all[ws - 1].to_vec::<f32>().unwrap()[0], (ws - 1) as f32 + 0.5);

    // Checked arguments.
    let err = h.barrier(h.num_channels(), T).unwrap_err().to_string();
    assert!(err.contains("maximum supported channel"), "{err}");
    assert!(h.put_signal(ws, 0, T).unwrap_err().to_string().contains(&format!("rank must be in [0, {ws})")));

    // Data and signal in one call, around the ring.
    let (next, prev) = ((me + 1) % ws, (me + ws - 1) % ws);
    let y = symm::empty(&[16], DType::I64, Device::Cpu).unwrap();
    let hy = symm::rendezvous(&y, &g).unwrap();
    hy.barrier(0, T).unwrap();
    let src = Tensor::from_slice(&[16], &[me as i64 * 100; 16]).unwrap();
    symm::put_signal(&src, &hy, next).unwrap();
    symm::wait_signal(&hy, prev).unwrap();
    assert_eq!(y.to_vec::<i64>().unwrap(), vec![prev as i64 * 100; 16]);

    // A token around the ring on channel 3, several times.
    for _ in 0..10 {
        if me == 0 {
            h.put_signal(next, 3, T).unwrap();
            h.wait_signal(prev, 3, T).unwrap();
        } else {
            h.wait_signal(prev, 3, T).unwrap();
            h.put_signal(next, 3, T).unwrap();
        }
    }

    // A wait nobody answers times out with a precise error, and the process stays usable.
    let t = Instant::now();
    let err = h.wait_signal(prev, 5, Duration::from_millis(100)).unwrap_err();
    assert!(err.is_timeout() && t.elapsed() >= Duration::from_millis(100));
    let msg = err.to_string();
    assert!(msg.contains(&format!("rank {me}")) && msg.contains(&format!("rank {prev}")), "{msg}");
    assert!(msg.contains("channel 5"), "{msg}");
    h.barrier(1, T).unwrap();

    // A sub-group: the last rank sits out.
    if ws >= 3 {
        let ranks: Vec<usize> = (0..ws - 1).collect();
        if let Some(sub) = g.split(&ranks).unwrap() {
            let z = symm::empty(&[2], DType::I32, Device::Cpu).unwrap();
            z.fill(sub.rank() as i32 * 7).unwrap();
            let hz = symm::rendezvous(&z, &sub).unwrap();
            assert_eq!(hz.world_size(), ws - 1);
            hz.barrier(0, T).unwrap();
            let last = hz.get_remote_tensor(ws - 2, &[2], DType::I32).unwrap();
            assert_eq!(last.to_vec::<i32>().unwrap(), vec![(ws as i32 - 2) * 7; 2]);
            hz.barrier(0, T).unwrap();
        }
    }

    // The pool: symmetric offsets, rendezvous of the second tensor needs no exchange.
    let pool: Arc<MemPool> = symm::get_mem_pool(Device::Cpu).unwrap();
    let a = pool.empty(&[100], DType::BF16).unwrap();
    let b = pool.empty(&[64], DType::F64).unwrap();
    b.fill(me as f64).unwrap();
    let _ha = symm::rendezvous(&a, &g).unwrap();
    let hb = symm::rendezvous(&b, &g).unwrap();
    assert_ne!(hb.offset(), 0);
    hb.barrier(0, T).unwrap();
    assert_eq!(hb.get_remote_tensor(next, &[64], DType::F64).unwrap().to_vec::<f64>().unwrap(), vec![next as f64; 64]);

    // Balanced use leaves every pad zero.
    h.barrier(0, T).unwrap();
    hb.barrier(0, T).unwrap();
    let nonzero = h.get_signal_pad(me).unwrap().to_vec::<u32>().unwrap().iter().filter(|&&v| v != 0).count();
    assert_eq!(nonzero, 0, "pad not all zeros after balanced use");
    g.barrier(T).unwrap();
    done(&g);
}

#[test]
fn every_call_works_for_2_3_and_4_ranks() {
    for n in [2, 3, 4] {
        assert_job(n, "rank_every_call", &[]);
    }
    // Rendezvous exchanges through rank 0 give the same handles.
    assert_job(3, "rank_every_call", &[("SYMMEM_RENDEZVOUS", "gather")]);
}

#[test]
#[ignore = "a rank program; run by threads_sharing_a_handle_stay_correct"]
fn rank_threads() {
    let Some(g) = in_job() else { return };
    let x = symm::empty(&[8], DType::U8, Device::Cpu).unwrap();
    let h = symm::rendezvous(&x, &g).unwrap();
    // Two threads per rank barrier on the same channel at once, 300 times each: every barrier
    // completes, nothing deadlocks, and the pads end all zero.
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let h = h.clone();
            std::thread::spawn(move || {
                for _ in 0..300 {
                    h.barrier(0, T).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    h.barrier(0, T).unwrap();
    let nonzero = h.get_signal_pad(g.rank()).unwrap().to_vec::<u32>().unwrap().iter().filter(|&&v| v != 0).count();
    assert_eq!(nonzero, 0);
    done(&g);
}

#[test]
fn threads_sharing_a_handle_stay_correct() {
    assert_job(3, "rank_threads", &[]);
}

#[test]
#[ignore = "a rank program; run by mismatched_shapes_fail_on_every_rank"]
fn rank_mismatch() {
    let Some(g) = in_job() else { return };
    let shape: &[usize] = if g.rank() == 1 { &[8] } else { &[4, 4] };
    let x = symm::empty(shape, DType::F32, Device::Cpu).unwrap();
    let err = symm::rendezvous(&x, &g).unwrap_err().to_string();
    println!("rank {}: {err}", g.rank());
    assert!(err.contains("rank 0 has [4, 4] float32") && err.contains("rank 1 has [8] float32"), "{err}");
    done(&g);
}

#[test]
fn mismatched_shapes_fail_on_every_rank() {
    assert_job(3, "rank_mismatch", &[]);
}

#[test]
#[ignore = "a rank program; run by a_missing_rank_is_named"]
fn rank_missing() {
    let Some(g) = in_job() else { return };
    if g.rank() == 2 {
        done(&g);
        return;
    }
    let x = symm::empty(&[4], DType::F32, Device::Cpu).unwrap();
    let err = symm::rendezvous(&x, &g).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(err.to_string().contains("rank(s) [2]"), "{err}");
    done(&g);
}

#[test]
fn a_missing_rank_is_named() {
    assert_job(3, "rank_missing", &[("SYMMEM_OP_TIMEOUT", "1")]);
}

#[test]
#[ignore = "a rank program; run by other_hosts_are_reached_but_not_addressed"]
fn rank_other_host() {
    let Some(g) = in_job() else { return };
    let x = symm::empty(&[4], DType::F32, Device::Cpu).unwrap();
    // The peer is on another host: reached through the transport, not addressable.
    let h = symm::rendezvous(&x, &g).unwrap();
    let peer = 1 - g.rank();
    assert_eq!(h.remote_ranks(), vec![peer]);
    let err = h.buffer_ptrs().unwrap_err().to_string();
    assert!(
        err.contains(&format!("rank {peer} is on host host{peer}")) && err.contains("cannot be addressed"),
        "{err}"
    );
    h.barrier(0, T).unwrap();
    done(&g);
}

#[test]
fn other_hosts_are_reached_but_not_addressed() {
    // Two launchers play two hosts of one job.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let me = std::env::current_exe().unwrap();
    let config = Arc::new(tempfile::tempdir().unwrap());
    let node = move |i: &str| {
        Command::new(BIN)
            .args(["run", "-n", "1", "--nnodes", "2", "--node-rank", i, "--master-port", &port, "--timeout", "60"])
            .arg("--")
            .arg(&me)
            .args(["--exact", "rank_other_host", "--include-ignored", "--nocapture"])
            .env("SYMMEM_HOST_ID", format!("host{i}"))
            .env("XDG_CONFIG_HOME", config.path())
            .env_remove("SYMMEM_STORE_SECRET")
            .output()
            .unwrap()
    };
    let node = Arc::new(node);
    let n1 = node.clone();
    let other = std::thread::spawn(move || n1("1"));
    let first = node("0");
    let second = other.join().unwrap();
    for (i, out) in [first, second].iter().enumerate() {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "node {i}: {text}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(
            text.lines().any(|l| l.starts_with(&format!("[{i}] ")) && l.ends_with(&format!("rank {i} ok"))),
            "{text}"
        );
    }
}

#[test]
#[ignore = "a rank program; run by eight_ranks_on_two_cores_complete_1000_barriers"]
fn rank_many_barriers() {
    let Some(g) = in_job() else { return };
    let x = symm::empty(&[1], DType::U8, Device::Cpu).unwrap();
    let h = symm::rendezvous(&x, &g).unwrap();
    let t = Instant::now();
    for _ in 0..1000 {
        h.barrier(0, T).unwrap();
    }
    println!("rank {}: 1000 barriers in {:?}", g.rank(), t.elapsed());
    assert!(h.get_signal_pad(g.rank()).unwrap().to_vec::<u32>().unwrap().iter().all(|&v| v == 0));
    done(&g);
}

#[test]
fn eight_ranks_on_two_cores_complete_1000_barriers() {
    assert_job(8, "rank_many_barriers", &[]);
}

#[test]
#[ignore = "a rank program; run by kill_9_of_a_rank_leaves_dev_shm_as_it_was"]
fn rank_killed() {
    let Some(g) = in_job() else { return };
    let x = symm::empty(&[1 << 20], DType::U8, Device::Cpu).unwrap();
    let h = symm::rendezvous(&x, &g).unwrap();
    h.barrier(0, T).unwrap();
    if g.rank() == 1 {
        Command::new("kill").args(["-9", &std::process::id().to_string()]).status().unwrap();
    }
    // The survivor waits for a signal that never comes; the launcher stops it.
    let _ = h.wait_signal(1, 0, Duration::from_secs(60));
}

fn dev_shm() -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir("/dev/shm").unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn kill_9_of_a_rank_leaves_dev_shm_as_it_was() {
    let before = dev_shm();
    let (code, out, err) = job(2, "rank_killed", &[]);
    assert_eq!(code, 128 + 9, "{out}\n{err}");
    assert!(err.contains("rank 1 was killed by signal 9"), "{err}");
    assert_eq!(dev_shm(), before);
}
