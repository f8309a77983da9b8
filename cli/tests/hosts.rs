//! Symmetric memory across hosts: every one-sided call and operator on a group that spans two
//! or four hosts, and a short scenario on sixteen, with results equal bit for bit to the same
//! job on one host; and what happens when a host is lost.
//!
//! Hosts are played two ways: launchers on loopback with different `SYMMEM_HOST_ID`s (runs
//! everywhere), and network namespaces joined by a switch, one launcher in each (where
//! namespaces can be created; skipped with a message elsewhere).

#![allow(clippy::print_stdout, clippy::print_stderr, reason = "rank programs and skip notices print")]

mod common;

use std::collections::BTreeMap;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use common::Hosts;
use half::bf16;
use symmem::Group;
use symmem::ops::all_reduce::Algo;
use symmem::ops::{self, ReduceOp};
use symmem::symm::{self, Device};
use symmem::tensor::{DType, Tensor};

const BIN: &str = env!("CARGO_BIN_EXE_symmem");
const T: Duration = Duration::from_secs(60);

/// Where the ranks of a job run.
#[derive(Clone, Copy)]
enum Layout<'a> {
    /// One launcher, every rank on one host.
    OneHost,
    /// Two launchers on loopback, told they are different hosts.
    Loopback,
    /// So many of them.
    LoopbackN(usize),
    /// One launcher in each of the network namespaces.
    Netns(&'a Hosts),
}

/// Runs `scenario` with `per_host` ranks per host; returns each launcher's output.
fn launch(layout: Layout, per_host: usize, scenario: &str, env: &[(&str, &str)]) -> Vec<Output> {
    launch_with(layout, per_host, scenario, env, |_| {})
}

/// [`launch`], calling `during` with the launchers' pids while they run.
fn launch_with(
    layout: Layout,
    per_host: usize,
    scenario: &str,
    env: &[(&str, &str)],
    during: impl FnOnce(&[u32]),
) -> Vec<Output> {
    let me = std::env::current_exe().unwrap();
    let rank_args = ["--exact", scenario, "--include-ignored", "--nocapture", "--test-threads=1"];
    let hosts = match layout {
        Layout::OneHost => 1,
        Layout::Loopback => 2,
        Layout::LoopbackN(k) => k,
        Layout::Netns(h) => h.names.len(),
    };
    let n = per_host.to_string();
    let total = (per_host * hosts).to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    // The launchers share this machine's file system, as hosts share a home directory: this
    // user's key is the job's secret.
    let config = tempfile::tempdir().unwrap();
    let node = |i: usize| {
        let mut c = match layout {
            Layout::Netns(h) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &h.names[i], BIN]);
                c.env("SYMMEM_TRANSPORT_TCP_HOST", format!("10.213.0.{}", i + 1));
                c
            }
            _ => Command::new(BIN),
        };
        c.args(["run", "-n", &n, "--timeout", "120"]);
        match layout {
            Layout::OneHost => {}
            Layout::Loopback | Layout::LoopbackN(_) => {
                c.args(["--nnodes", &hosts.to_string(), "--node-rank", &i.to_string(), "--master-port", &port]);
            }
            Layout::Netns(_) => {
                c.args(["--nnodes", &hosts.to_string(), "--node-rank", &i.to_string(), "--master-addr", "10.213.0.1"]);
                c.args(["--master-port", "29500"]);
            }
        }
        if hosts > 1 {
            c.env("SYMMEM_HOST_ID", format!("host{i}"));
        }
        c.arg("--").arg(&me).args(rank_args);
        c.envs(env.iter().copied()).env("SYMMEM_TEST_HOSTS", hosts.to_string()).env("SYMMEM_TEST_WORLD", &total);
        c.env("XDG_CONFIG_HOME", config.path());
        c.env_remove("SYMMEM_STORE_SECRET").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let children: Vec<Child> = (0..hosts).map(node).collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    std::thread::scope(|s| {
        let waits: Vec<_> = children.into_iter().map(|c| s.spawn(move || c.wait_with_output().unwrap())).collect();
        during(&pids);
        waits.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn text(o: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Checks every launcher succeeded and every rank finished; returns each rank's digests.
fn digests(outs: &[Output], world: usize) -> BTreeMap<usize, BTreeMap<String, String>> {
    let mut all = BTreeMap::new();
    // Every launcher that failed, whole: the first to fail stops the others.
    let failed: Vec<String> = outs.iter().filter(|o| !o.status.success()).map(text).collect();
    assert!(failed.is_empty(), "launchers failed:\n{}", failed.join("\n---- the next launcher ----\n"));
    for o in outs {
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            let Some((prefix, rest)) = line.split_once("] ") else { continue };
            let Ok(rank) = prefix.trim_start_matches('[').parse::<usize>() else { continue };
            // The first line a rank prints follows the test harness's "test rank_x ... ".
            let rest = rest.strip_prefix("test ").and_then(|t| t.split_once(" ... ")).map_or(rest, |(_, r)| r);
            if let Some(d) = rest.strip_prefix("digest ") {
                let (name, hex) = d.split_once(' ').unwrap();
                all.entry(rank).or_insert_with(BTreeMap::new).insert(name.to_string(), hex.to_string());
            }
        }
    }
    for r in 0..world {
        let finished = outs.iter().any(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.starts_with(&format!("[{r}] ")) && l.ends_with(&format!("rank {r} ok")))
        });
        assert!(finished, "rank {r} did not finish:\n{}", outs.iter().map(text).collect::<String>());
    }
    all
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The bits of a contiguous tensor, hashed.
fn digest(t: &Tensor) -> String {
    let es = t.dtype().size();
    let bytes = t.reinterpret(DType::U8, &[t.nbytes()], &[1], t.storage_offset() * es).unwrap();
    format!("{:016x}", fnv(&bytes.to_vec::<u8>().unwrap()))
}

/// A value whose sums depend on the order of addition: large and small magnitudes mixed.
fn val(rank: usize, i: usize) -> f64 {
    let small = ((i * 37 + rank * 101) % 997) as f64 / 7.0;
    if (i + rank).is_multiple_of(3) { small * 1.0e6 + 0.3 } else { small - 50.0 }
}

fn fill(t: &Tensor, f: impl Fn(usize) -> f64) {
    let n = t.numel();
    match t.dtype() {
        DType::F32 => t.copy_from_slice(&(0..n).map(|i| f(i) as f32).collect::<Vec<_>>()),
        DType::F64 => t.copy_from_slice(&(0..n).map(&f).collect::<Vec<_>>()),
        DType::BF16 => t.copy_from_slice(&(0..n).map(|i| bf16::from_f64(f(i))).collect::<Vec<_>>()),
        DType::I32 => t.copy_from_slice(&(0..n).map(|i| f(i) as i32).collect::<Vec<_>>()),
        DType::I64 => t.copy_from_slice(&(0..n).map(|i| f(i) as i64).collect::<Vec<_>>()),
        other => panic!("no fill for {other}"),
    }
    .unwrap();
}

fn sym(shape: &[usize], dtype: DType) -> Tensor {
    symm::empty(shape, dtype, Device::Cpu).unwrap()
}

fn i64_sym(vals: &[i64]) -> Tensor {
    let t = sym(&[vals.len()], DType::I64);
    t.copy_from_slice(vals).unwrap();
    t
}

struct Job {
    g: Group,
    me: usize,
    ws: usize,
    hosts: usize,
}

impl Job {
    fn start() -> Option<Job> {
        std::env::var("RANK").ok()?;
        let g = Group::from_env().unwrap();
        let hosts = std::env::var("SYMMEM_TEST_HOSTS").unwrap().parse().unwrap();
        // "RANK:MS": that rank's requests to other hosts leave MS milliseconds late.
        if let Ok(late) = std::env::var("SYMMEM_TEST_LATE") {
            let (r, ms) = late.split_once(':').unwrap();
            if g.rank() == r.parse::<usize>().unwrap() {
                symmem::transport::lag_sends(Duration::from_millis(ms.parse().unwrap()));
            }
        }
        Some(Job { me: g.rank(), ws: g.world_size(), hosts, g })
    }

    fn host_of(&self, r: usize) -> usize {
        r / (self.ws / self.hosts)
    }

    fn report(&self, name: &str, t: &Tensor) {
        println!("digest {name} {}", digest(t));
    }
}

/// Topology, addressing errors, and every one-sided call, checked by value.
fn one_sided(j: &Job) {
    let (me, ws) = (j.me, j.ws);
    let (next, prev) = ((me + 1) % ws, (me + ws - 1) % ws);
    let n = 1000;
    let x = sym(&[n], DType::I32);
    fill(&x, |i| (me * 1_000_000 + i) as f64);
    let h = symm::rendezvous(&x, &j.g).unwrap();
    let remote: Vec<usize> = (0..ws).filter(|&r| j.host_of(r) != j.host_of(me)).collect();
    assert_eq!(h.remote_ranks(), remote, "the ranks on other hosts");
    // Every rank names the backend its links between hosts run on (which the operators choose
    // their algorithms by): the one forced, else the one picked (ucx only on a fabric); none on
    // one host.
    match (j.hosts, std::env::var("SYMMEM_XHOST_BACKEND").ok()) {
        (1, _) => assert_eq!(h.link_backend(), None),
        (_, Some(forced)) => assert_eq!(h.link_backend(), Some(forced.as_str())),
        _ => assert!(matches!(h.link_backend(), Some("tcp" | "ucx")), "{:?}", h.link_backend()),
    }
    if let Some(&far) = remote.first() {
        let e = h.buffer_ptrs().unwrap_err().to_string();
        assert!(e.contains(&format!("rank {far} is on host host")) && e.contains("cannot be addressed"), "{e}");
        assert!(h.signal_pad_ptrs().is_err());
        assert!(h.get_remote_tensor(far, &[n], DType::I32).unwrap_err().to_string().contains("cannot be addressed"));
        assert!(h.get_signal_pad(far).is_err() && h.buffer_ptr(far).is_err());
    } else {
        assert_eq!(h.buffer_ptrs().unwrap().len(), ws);
    }
    for r in (0..ws).filter(|r| !remote.contains(r)) {
        assert_eq!(
            h.get_remote_tensor(r, &[n], DType::I32).unwrap().to_vec::<i32>().unwrap()[1],
            (r * 1_000_000 + 1) as i32
        );
    }
    h.barrier(0, T).unwrap();

    // get and get_out from the next rank, with offsets.
    let part = Tensor::zeros(&[10], DType::I32).unwrap();
    symm::nvshmem_get_out(&part, &h, 5, 10, next).unwrap();
    assert_eq!(part.to_vec::<i32>().unwrap(), (5..15).map(|i| (next * 1_000_000 + i) as i32).collect::<Vec<_>>());
    let tail = Tensor::zeros(&[n - 3], DType::I32).unwrap();
    symm::get(&tail, &h, next, 3).unwrap();
    assert_eq!(tail.to_vec::<i32>().unwrap()[n - 4], (next * 1_000_000 + n - 1) as i32);
    assert!(symm::get(&tail, &h, next, 4).unwrap_err().to_string().contains("exceed"), "out of bounds is refused");
    assert!(symm::nvshmem_get_out(&part, &h, 0, 11, next).is_err(), "dst too small");
    // A peer out of range is refused with the reason, never a panic.
    let e = symm::put_signal(&part, &h, ws).unwrap_err().to_string();
    assert!(e.contains(&format!("peer {ws} must be smaller than world size {ws}")), "{e}");
    h.barrier(0, T).unwrap();

    // Odd ranks send (1 -> 2 and 3 -> 0 cross hosts), then even ones; receivers check.
    for parity in [1, 0] {
        let sender = me % 2 == parity;
        let receiver = prev % 2 == parity && prev != me;
        let data = sym(&[n], DType::I32);
        fill(&data, |i| (me * 1000 + i + parity) as f64);
        let sig = sym(&[1], DType::I64);
        let hd = symm::rendezvous(&data, &j.g).unwrap();
        symm::rendezvous(&sig, &j.g).unwrap();
        hd.barrier(0, T).unwrap();
        let from_prev: Vec<i32> = (0..n).map(|i| (prev * 1000 + i + parity) as i32).collect();
        let from_next: Vec<i32> = (0..n).map(|i| (next * 1000 + i + parity) as i32).collect();
        // put_with_signal / wait_for_signal, 5 rounds: the data is always there with the signal,
        // and the source is the sender's again as soon as the call returns (overwritten at once,
        // before the peer has even seen the signal across hosts).
        for k in 1..=5u64 {
            if sender {
                fill(&data, |i| (me * 1000 + i + parity) as f64 + k as f64);
                symm::nvshmem_put_with_signal(&data, &sig, k, next).unwrap();
                fill(&data, |_| -1.0);
                hd.wait_signal(next, 3, T).unwrap();
            }
            if receiver {
                symm::nvshmem_wait_for_signal(&sig, k, prev).unwrap();
                let want: Vec<i32> = from_prev.iter().map(|v| v + k as i32).collect();
                assert_eq!(data.to_vec::<i32>().unwrap(), want, "put_with_signal round {k}");
                hd.put_signal(prev, 3, T).unwrap();
            }
        }
        hd.barrier(0, T).unwrap();
        // Larger puts with a signal, the source overwritten as soon as the call returns: over
        // tcp 160 KB leave in in-order pieces the signal follows, 800 KB as one striped write
        // landed before the signal; over ucx both in one posted write or landed first.
        for (k, len) in [(6u64, 40_000usize), (7, 200_000)] {
            let big = sym(&[len], DType::I32);
            let flag = sym(&[1], DType::I64);
            let hb = symm::rendezvous(&big, &j.g).unwrap();
            symm::rendezvous(&flag, &j.g).unwrap();
            hb.barrier(0, T).unwrap();
            if sender {
                fill(&big, |i| (me * 7 + i) as f64);
                symm::nvshmem_put_with_signal(&big, &flag, k, next).unwrap();
                fill(&big, |_| -1.0);
            }
            if receiver {
                symm::nvshmem_wait_for_signal(&flag, k, prev).unwrap();
                let got = big.to_vec::<i32>().unwrap();
                let bad = (0..len).find(|&i| got[i] != (prev * 7 + i) as i32);
                assert_eq!(bad, None, "put_with_signal of {len} elements: first wrong element");
            }
            hb.barrier(0, T).unwrap();
        }
        // Peers out of range: of the data's group, or of a smaller group the signal is on.
        let e = symm::nvshmem_put_with_signal(&data, &sig, 1, ws).unwrap_err().to_string();
        assert!(e.contains(&format!("peer {ws} must be smaller than world size {ws}")), "{e}");
        // Waiting for a signal from a peer out of range: refused at once (it panicked once its
        // wait went past spinning).
        let t = std::time::Instant::now();
        let e = symm::nvshmem_wait_for_signal(&sig, 1, ws).unwrap_err().to_string();
        assert!(e.contains(&format!("nvshmem_wait_for_signal: peer {ws} must be smaller than world size {ws}")), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1), "refused after {:?}", t.elapsed());
        if let Some(pair) = j.g.split(&[0, 1]).unwrap() {
            let small = sym(&[1], DType::I64);
            symm::rendezvous(&small, &pair).unwrap();
            let e = symm::nvshmem_put_with_signal(&data, &small, 1, ws - 1).unwrap_err().to_string();
            assert!(e.contains("the signal's peer") && e.contains("rank must be in [0, 2)"), "{e}");
        }
        // A signal rendezvoused on another group (other links, no common order with the data's):
        // the data lands before the signal is sent.
        let sub = j.g.split(&(0..ws).collect::<Vec<_>>()).unwrap().unwrap();
        let flag = sym(&[1], DType::I64);
        symm::rendezvous(&flag, &sub).unwrap();
        hd.barrier(0, T).unwrap();
        if sender {
            fill(&data, |i| (me * 1000 + i + parity) as f64 + 9.0);
            symm::nvshmem_put_with_signal(&data, &flag, 9, next).unwrap();
            fill(&data, |_| -1.0);
        }
        if receiver {
            symm::nvshmem_wait_for_signal(&flag, 9, prev).unwrap();
            let want: Vec<i32> = from_prev.iter().map(|v| v + 9).collect();
            assert_eq!(data.to_vec::<i32>().unwrap(), want, "put_with_signal, the signal on another group");
        }
        hd.barrier(0, T).unwrap();
        // nvshmem_put, then nvshmem_get of the (untouched) next rank's copy.
        fill(&data, |i| (me * 1000 + i + parity) as f64);
        hd.barrier(0, T).unwrap();
        if sender {
            symm::nvshmem_put(&data, next).unwrap();
        }
        hd.barrier(0, T).unwrap();
        if receiver {
            assert_eq!(data.to_vec::<i32>().unwrap(), from_prev, "nvshmem_put");
        }
        hd.barrier(0, T).unwrap();
        fill(&data, |i| (me * 1000 + i + parity) as f64);
        hd.barrier(0, T).unwrap();
        if sender {
            symm::nvshmem_get(&data, next).unwrap();
            assert_eq!(data.to_vec::<i32>().unwrap(), from_next, "nvshmem_get");
        }
        hd.barrier(0, T).unwrap();
        // A get into a rank's own buffer leaves that buffer reachable by its peers.
        let four = Tensor::zeros(&[4], DType::I32).unwrap();
        symm::nvshmem_get_out(&four, &hd, 0, 4, prev).unwrap();
        hd.barrier(0, T).unwrap();
        // A get into the whole of another symmetric tensor (its allocation, exposed on every
        // link under a registration of its own) leaves that tensor reachable by its peers.
        let mine = data.to_vec::<i32>().unwrap();
        symm::nvshmem_get_out(&x, &hd, 0, n, next).unwrap();
        hd.barrier(0, T).unwrap();
        let back = Tensor::zeros(&[n], DType::I32).unwrap();
        symm::get(&back, &h, prev, 0).unwrap();
        assert_eq!(back.to_vec::<i32>().unwrap(), mine, "read from a get's destination");
        hd.barrier(0, T).unwrap();
        // And a put from it (registered writable on the links already): x now holds the
        // receiver's data, which the receiver cleared.
        if receiver {
            fill(&data, |_| 0.0);
        }
        hd.barrier(0, T).unwrap();
        if sender {
            symm::put_signal(&x, &hd, next).unwrap();
        }
        if receiver {
            symm::wait_signal(&hd, prev).unwrap();
            assert_eq!(data.to_vec::<i32>().unwrap(), mine, "put_signal from a symmetric tensor");
        }
        hd.barrier(0, T).unwrap();
        // put_signal / wait_signal with a heap source.
        if sender {
            let src = Tensor::from_slice(&[n], &(0..n).map(|i| (i * 3 + me) as i32).collect::<Vec<_>>()).unwrap();
            symm::put_signal(&src, &hd, next).unwrap();
        }
        if receiver {
            symm::wait_signal(&hd, prev).unwrap();
            assert_eq!(data.to_vec::<i32>().unwrap(), (0..n).map(|i| (i * 3 + prev) as i32).collect::<Vec<_>>());
        }
        hd.barrier(0, T).unwrap();
        // A put_signal whose previous signal is not yet consumed waits until it is (across
        // hosts its first try, sent with the data, finds the slot busy; the retries wait it
        // out), then lands: two waits consume two signals.
        if sender {
            symm::put_signal(&x, &hd, next).unwrap();
            let t = Instant::now();
            symm::put_signal(&x, &hd, next).unwrap();
            assert!(t.elapsed() >= Duration::from_millis(200), "put_signal returned before its slot was free");
        }
        if receiver {
            std::thread::sleep(Duration::from_millis(300));
            symm::wait_signal(&hd, prev).unwrap();
            symm::wait_signal(&hd, prev).unwrap();
        }
        hd.barrier(0, T).unwrap();
    }

    // A ring of signals on channel 1 and barriers on channel 2; the pad is all zeros after.
    for _ in 0..50 {
        h.put_signal(next, 1, T).unwrap();
        h.wait_signal(prev, 1, T).unwrap();
        h.barrier(2, T).unwrap();
    }
    h.barrier(0, T).unwrap();
    assert!(h.get_signal_pad(me).unwrap().to_vec::<u32>().unwrap().iter().all(|&v| v == 0), "balanced use");
    // A wrong channel or rank is refused before communicating.
    assert!(h.put_signal(ws, 0, T).is_err() && h.barrier(h.num_channels(), T).is_err());
}

/// Every all-reduce algorithm, digested, at sizes that take each of them.
fn all_reduces(j: &Job) {
    let (me, g) = (j.me, &j.g);
    // Across hosts the sizes take every algorithm: host push (up to 40 000 f32, gathered, each
    // rank's own, or from four hosts scattered), then the chain (f32 and i32; bf16 max) or
    // two-shot (bf16 sums) above 512 KiB (256 KiB over ucx); from four hosts over tcp scattered
    // host push takes all of these.
    for (dtype, n) in [
        (DType::F32, 5),
        (DType::F32, 3000),
        (DType::F32, 10_000),
        (DType::F32, 40_000),
        (DType::F32, 200_003),
        (DType::BF16, 1000),
        (DType::BF16, 300_002),
        (DType::I32, 4099),
        (DType::I32, 150_001),
    ] {
        let x = sym(&[n], dtype);
        let refill = || fill(&x, |i| val(me, i));
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let tag = format!("{dtype}/{n}/{op:?}");
            if n > 100_000 && symm::rendezvous(&x, g).unwrap().local_ranks().len() >= 2 {
                // What the large sizes take with 2 ranks per host: the chain across hosts, where
                // its partials are exact.
                let h = symm::rendezvous(&x, g).unwrap();
                let exact = dtype != DType::BF16 || op == ReduceOp::Max;
                let scattered = h.hosts() >= 4 && h.link_backend() != Some("ucx");
                let want = match (h.all_local(), exact) {
                    (false, _) if scattered => Algo::HostPush,
                    (true, _) | (false, false) => Algo::TwoShot,
                    (false, true) => Algo::Chain,
                };
                assert_eq!(ops::all_reduce::select_for(&x, op, &h), want, "{tag}");
            }
            refill();
            j.report(&format!("one_shot/{tag}"), &ops::one_shot_all_reduce(&x, op, g).unwrap());
            let out = Tensor::zeros(&[n], dtype).unwrap();
            ops::two_shot_all_reduce_out(&x, op, g, &out).unwrap();
            j.report(&format!("two_shot_out/{tag}"), &out);
            refill();
            ops::two_shot_all_reduce_(&x, op, g).unwrap();
            j.report(&format!("two_shot/{tag}"), &x);
            refill();
            ops::all_reduce(&x, op, g).unwrap();
            j.report(&format!("all_reduce/{tag}"), &x);
        }
    }
    // All-gathers across hosts by every way: host push with each host's leader gathering (3000
    // f32), each rank's own message (8192), straight from the input for a rank alone on its
    // host (40 000), and pulled (300 000; into out for a rank alone on its host). Each input is
    // rewritten once the call returns.
    for n in [3000, 8192, 40_000, 300_000] {
        let x = sym(&[n], DType::F32);
        fill(&x, |i| val(me, i));
        let out = Tensor::zeros(&[n * g.world_size()], DType::F32).unwrap();
        ops::all_gather_into(&x, g, &out).unwrap();
        x.fill(-1.0f32).unwrap();
        j.report(&format!("all_gather/{n}"), &out);
    }
    // Reduce-scatters the same ways (host push's exchange, each rank sending each other host
    // its ranks' slices alone and reducing its own slice; pulled above its limits, 2 MiB of a
    // host's inputs over tcp, 512 KiB a rank over ucx), split along the first or the last
    // dimension.
    let ws = g.world_size();
    for (dtype, per, last) in [
        (DType::F32, 800, false),
        (DType::F32, 4096, false),
        (DType::F32, 20_000, false),
        (DType::F32, 100_000, false),
        (DType::F32, 300_000, false),
        (DType::BF16, 8192, false),
        (DType::F32, 800, true),
        (DType::F32, 4096, true),
    ] {
        let n = per * ws;
        let x = sym(&[n], dtype);
        let x = if last { x.view(&[n / (16 * ws), 16 * ws]).unwrap() } else { x };
        let out = Tensor::zeros(&[per], dtype).unwrap();
        let out = if last { out.view(&[n / (16 * ws), 16]).unwrap() } else { out };
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            fill(&x, |i| val(me, i));
            ops::reduce_scatter_out(&x, op, g, last, &out).unwrap();
            fill(&x, |_| -1.0);
            j.report(&format!("reduce_scatter/{dtype}/{n}/{last}/{op:?}"), &out);
        }
    }
}

/// Every operator, digested; the test compares the digests across layouts.
fn operators(j: &Job) {
    let (me, ws, g) = (j.me, j.ws, &j.g);
    all_reduces(j);
    // Integer sums have one right answer: check it by value too.
    let xi = sym(&[64], DType::I32);
    fill(&xi, |i| (me * 100 + i) as f64);
    ops::all_reduce(&xi, ReduceOp::Sum, g).unwrap();
    let want: Vec<i32> = (0..64).map(|i| (0..ws).map(|r| (r * 100 + i) as i32).sum()).collect();
    assert_eq!(xi.to_vec::<i32>().unwrap(), want, "integer all-reduce");

    let per = 1024;
    let x = sym(&[per * ws], DType::F32);
    fill(&x, |i| val(me, i));
    let rs = Tensor::zeros(&[per], DType::F32).unwrap();
    ops::reduce_scatter_out(&x, ReduceOp::Sum, g, false, &rs).unwrap();
    j.report("reduce_scatter", &rs);
    let m = sym(&[6, 8 * ws], DType::F32);
    fill(&m, |i| val(me, i));
    let mo = Tensor::zeros(&[6, 8], DType::F32).unwrap();
    ops::reduce_scatter_out(&m, ReduceOp::Avg, g, true, &mo).unwrap();
    j.report("reduce_scatter_last_dim", &mo);
    let ag = Tensor::zeros(&[per * ws * ws], DType::F32).unwrap();
    ops::all_gather_into(&x, g, &ag).unwrap();
    j.report("all_gather", &ag);
    // Across hosts the 4 KiB inputs above are host-pushed with each host's leader gathering its
    // host's; 32 KiB inputs go as each rank's own message, 1.2 MB ones too over ucx (pulled
    // over tcp), and 2.4 MB ones are pulled (past host push's limits). Each input is rewritten
    // once the call returns.
    for (name, per) in [("all_gather_own", 8192), ("all_gather_1.2MB", 300_000), ("all_gather_pulled", 600_000)] {
        let x = sym(&[per], DType::F32);
        fill(&x, |i| val(me, i));
        let out = Tensor::zeros(&[per * ws], DType::F32).unwrap();
        ops::all_gather_into(&x, g, &out).unwrap();
        x.fill(-1.0f32).unwrap();
        g.barrier(T).unwrap();
        j.report(name, &out);
    }
    // Broadcasts across hosts by every way: host push with the root's leader gathering (777
    // f64), the root's own message (5000), straight from the input for a root alone on its
    // host (20 000), and pulled (100 000 past the broadcast's own limit over tcp, where hosts of
    // one rank would push an all-gather; 200 000 past every limit), the root's buffer read into
    // one tensor per host, which that host's other ranks copy; from the first rank, a rank
    // that leads no host when hosts have two, and the last. Each rank rewrites its tensor once
    // the call returns.
    let mut roots = vec![0, 1 % ws, ws - 1];
    roots.dedup();
    for n in [777, 5000, 20_000, 100_000, 200_000] {
        for &root in &roots {
            let b = sym(&[n], DType::F64);
            fill(&b, |i| val(me, i));
            ops::broadcast_(&b, root, g).unwrap();
            j.report(&format!("broadcast/{n}/{root}"), &b);
            b.fill(-1.0f64).unwrap();
            g.barrier(T).unwrap();
        }
    }
    let a2a = Tensor::zeros(&[per * ws], DType::F32).unwrap();
    ops::all_to_all(&x, &a2a, g).unwrap();
    j.report("all_to_all", &a2a);
    // Host push without the leader gathering: blocks staged (16 KiB per rank), blocks written
    // straight from the input (64 KiB), and blocks its host's ranks also read there (128 KiB,
    // ops::hostpush::SHARED_DIRECT_MIN), which its rank rewrites once the call returns.
    for (name, block) in [("all_to_all_staged", 4096), ("all_to_all_direct", 16384), ("all_to_all_read_inputs", 32768)]
    {
        let x = sym(&[block * ws], DType::F32);
        fill(&x, |i| val(me, i));
        let out = Tensor::zeros(&[block * ws], DType::F32).unwrap();
        ops::all_to_all(&x, &out, g).unwrap();
        x.fill(-1.0f32).unwrap();
        g.barrier(T).unwrap();
        j.report(name, &out);
    }
    // Above host push's limit: every rank reads its blocks from the other hosts' ranks
    // straight into out, copying its own host's meanwhile.
    let n = ws * (ops::ALL_TO_ALL_PUSH_MAX / 4 / ws + 16);
    let big = sym(&[n], DType::F32);
    fill(&big, |i| val(me, i));
    let big_out = Tensor::zeros(&[n], DType::F32).unwrap();
    ops::all_to_all(&big, &big_out, g).unwrap();
    j.report("all_to_all_pulled", &big_out);
    // Into a symmetric tensor (a whole allocation, pages exactly), which then serves as the
    // input of the next exchange across hosts: reading into it must not take it from its
    // peers.
    let n = ws * (ops::ALL_TO_ALL_PUSH_MAX / 4 / ws + 1024);
    let (first, second) = (sym(&[n], DType::F32), sym(&[n], DType::F32));
    let back = Tensor::zeros(&[n], DType::F32).unwrap();
    ops::all_to_all(&second, &back, g).unwrap(); // exposes `second` on every link
    fill(&first, |i| val(me, i));
    ops::all_to_all(&first, &second, g).unwrap();
    ops::all_to_all(&second, &back, g).unwrap();
    j.report("all_to_all_pulled_into_symmetric", &back);
    // Blocks of over 1 MiB: over ucx each remote block is read as pieces of 512 KiB
    // (symm::remote::UCX_READ_PIECE), two whole and a part.
    let n = ws * (2 * (512 << 10) / 4 + 16);
    let pieces = sym(&[n], DType::F32);
    fill(&pieces, |i| val(me, i));
    let pieces_out = Tensor::zeros(&[n], DType::F32).unwrap();
    ops::all_to_all(&pieces, &pieces_out, g).unwrap();
    j.report("all_to_all_pulled_in_pieces", &pieces_out);

    // all-to-all-v, its 2-D dispatch and combine.
    let (cap, cols) = (64, 3);
    let input = sym(&[cap, cols], DType::F32);
    fill(&input, |i| val(me, i));
    let split = |src: usize, dst: usize| ((src * 3 + dst * 5) % 4) as i64;
    let in_splits = i64_sym(&(0..ws).map(|d| split(me, d)).collect::<Vec<_>>());
    let out = sym(&[cap * ws, cols], DType::F32);
    let oso = sym(&[2, ws], DType::I64);
    ops::all_to_all_vdev(&input, &out, &in_splits, &oso, g).unwrap();
    j.report("a2av/out", &out);
    j.report("a2av/splits", &oso);
    let ne = 3;
    let s2: Vec<i64> = (0..ws * ne).map(|i| ((me * 7 + i * 3) % 5) as i64).collect();
    let in2 = i64_sym(&s2);
    let out2 = sym(&[cap * ws, cols], DType::F32);
    let oso2 = sym(&[2, ws * ne], DType::I64);
    ops::all_to_all_vdev_2d(&input, &out2, &in2, &oso2, g, Some(4)).unwrap();
    j.report("a2av_2d/out", &out2);
    j.report("a2av_2d/splits", &oso2);
    let back = sym(&[cap, cols], DType::F32);
    let back_so = sym(&[2, ws * ne], DType::I64);
    ops::all_to_all_vdev_2d_offset(&out2, &back, &oso2, &back_so, g).unwrap();
    let total = s2.iter().sum::<i64>() as usize * cols;
    assert_eq!(back.to_vec::<f32>().unwrap()[..total], input.to_vec::<f32>().unwrap()[..total], "round trip");
    j.report("a2av_2d_offset/out", &back);

    // Larger splits: each host's rows are far from the metadata in a pushed message.
    let (cap, cols) = (4096, 3);
    let input = sym(&[cap, cols], DType::F32);
    fill(&input, |i| val(me, i));
    let split = |src: usize, dst: usize| ((src * 37 + dst * 101) % 500) as i64;
    let in_splits = i64_sym(&(0..ws).map(|d| split(me, d)).collect::<Vec<_>>());
    let out = sym(&[cap * ws, cols], DType::F32);
    let oso = sym(&[2, ws], DType::I64);
    ops::all_to_all_vdev(&input, &out, &in_splits, &oso, g).unwrap();
    j.report("a2av_large/out", &out);
    j.report("a2av_large/splits", &oso);
    // Inputs above VDEV_CARRY_MAX (768 KiB, more than 64 KiB for a host): into a plain out,
    // host push sends those rows straight from the input; into a symmetric out, every rank
    // writes its rows straight into the others' outs once all have the splits. Either way the
    // input is the caller's again once the call returns: rows in flight from it must have left.
    let (cap, cols) = (16384, 12);
    assert!(cap * cols * 4 > ops::VDEV_CARRY_MAX && cap * cols * 4 <= ops::VDEV_PUSH_MAX);
    let input = sym(&[cap, cols], DType::F32);
    // Splits that fit the input's rows: these for 4 ranks or fewer, in proportion for more.
    let scale = |v: usize| (v * 4 / ws.max(4)) as i64;
    let split = |src: usize, dst: usize| scale(3000) + ((src * 37 + dst * 101) as i64 % scale(500));
    let big_splits = i64_sym(&(0..ws).map(|d| split(me, d)).collect::<Vec<_>>());
    for (name, out) in [
        ("a2av_direct", Tensor::zeros(&[cap * ws, cols], DType::F32).unwrap()),
        ("a2av_written", sym(&[cap * ws, cols], DType::F32)),
    ] {
        fill(&input, |i| val(me, i));
        ops::all_to_all_vdev(&input, &out, &big_splits, &oso, g).unwrap();
        input.fill(-1.0f32).unwrap();
        g.barrier(T).unwrap();
        j.report(&format!("{name}/out"), &out);
        j.report(&format!("{name}/splits"), &oso);
    }
    // 2-D dispatch and combine written into symmetric outs (the combine's input has gaps).
    fill(&input, |i| val(me, i));
    let s2: Vec<i64> = (0..ws * ne).map(|i| scale(900) + ((me * 7 + i * 3) as i64 % scale(200))).collect();
    let in2 = i64_sym(&s2);
    let out2 = sym(&[cap * ws, cols], DType::F32);
    ops::all_to_all_vdev_2d(&input, &out2, &in2, &oso2, g, Some(16)).unwrap();
    j.report("a2av_2d_written/out", &out2);
    j.report("a2av_2d_written/splits", &oso2);
    let back = sym(&[cap, cols], DType::F32);
    ops::all_to_all_vdev_2d_offset(&out2, &back, &oso2, &back_so, g).unwrap();
    let total = s2.iter().sum::<i64>() as usize * cols;
    assert_eq!(back.to_vec::<f32>().unwrap()[..total], input.to_vec::<f32>().unwrap()[..total], "round trip");
    j.report("a2av_2d_offset_written/out", &back);
    // Above host push's limit into a plain out: pulled, each rank reading its rows straight
    // into out.
    let cols = 3;
    let cap = ops::VDEV_PUSH_MAX / (4 * cols) + 64;
    let input = sym(&[cap, cols], DType::F32);
    fill(&input, |i| val(me, i));
    let out = Tensor::zeros(&[cap * ws, cols], DType::F32).unwrap();
    ops::all_to_all_vdev(&input, &out, &in_splits, &oso, g).unwrap();
    j.report("a2av_pulled/out", &out);
    j.report("a2av_pulled/splits", &oso);

    // Tiles, offsets, n-d exchanges, fused matmuls.
    let full = sym(&[8, 8], DType::F64);
    fill(&full, |i| val(me, i));
    let quad = full.tile(2..6, 4..8).unwrap();
    let out_tile = Tensor::zeros(&[4, 4], DType::F64).unwrap();
    ops::tile_reduce(&quad, &out_tile, ws - 1, g, ReduceOp::Sum).unwrap();
    j.report("tile_reduce", &out_tile);
    let tiles: Vec<Tensor> = (0..ws).map(|i| full.tile(i % 4 * 2..i % 4 * 2 + 2, 0..2).unwrap()).collect();
    let roots: Vec<usize> = (0..ws).rev().collect();
    let mine = Tensor::zeros(&[2, 2], DType::F64).unwrap();
    ops::multi_root_tile_reduce(&tiles, &mine, &roots, g, ReduceOp::Sum).unwrap();
    j.report("multi_root_tile_reduce", &mine);
    // Across hosts by every way of the all-gather's exchange, packed row by row: strided tiles
    // gathered by the leader (the two above), each rank's own message (40 x 100 f64 of a
    // 300-column matrix; bf16; 600 x 256 f64, 1.2 MB), from the tensor for a rank alone on its
    // host (a tile of whole rows, contiguous, 100 KiB), pulled past the limit (2100 x 256 f64,
    // 4.3 MB, past a 32 MiB workspace on 4 ranks); roots the first, a non-leader and the last
    // rank. Each matrix is rewritten once the call returns.
    for (dtype, rows, cols, width, root) in [
        (DType::F64, 40, 100, 300, 1 % ws),
        (DType::BF16, 40, 100, 300, ws - 1),
        (DType::F64, 100, 128, 128, 0),
        (DType::F64, 600, 256, 300, ws - 1),
        (DType::F64, 2100, 256, 300, 1 % ws),
    ] {
        let m = sym(&[rows + 3, width], dtype);
        fill(&m, |i| val(me, i));
        let tile = m.tile(3..rows + 3, width - cols..width).unwrap();
        let out = Tensor::zeros(&[rows, cols], dtype).unwrap();
        ops::tile_reduce(&tile, &out, root, g, ReduceOp::Sum).unwrap();
        fill(&m, |_| -1.0);
        g.barrier(T).unwrap();
        j.report(&format!("tile_reduce/{dtype}/{rows}x{cols}/{root}"), &out);
    }
    // Every rank's tiles in one message (ws tiles of 20 x 64 and of 300 x 128 f64, strided;
    // of 1100 x 128, 1.1 MB a tile, pulled), roots reversed; then the even ranks' tiles
    // first, so that the tiles of a host's roots lie apart from each other among the packed
    // tiles (what a host gets spans them).
    let evens_first: Vec<usize> = (0..ws).filter(|r| r % 2 == 0).chain((0..ws).filter(|r| r % 2 == 1)).collect();
    for (rows, cols, roots, order) in [
        (20, 64, &roots, "reversed"),
        (300, 128, &roots, "reversed"),
        (20, 64, &evens_first, "evens_first"),
        (1100, 128, &roots, "reversed"),
    ] {
        let m = sym(&[rows, cols * ws + 5], DType::F64);
        fill(&m, |i| val(me, i));
        let tiles: Vec<Tensor> = (0..ws).map(|i| m.tile(0..rows, 5 + i * cols..5 + (i + 1) * cols).unwrap()).collect();
        let out = Tensor::zeros(&[rows, cols], DType::F64).unwrap();
        ops::multi_root_tile_reduce(&tiles, &out, roots, g, ReduceOp::Max).unwrap();
        fill(&m, |_| -1.0);
        g.barrier(T).unwrap();
        j.report(&format!("multi_root_tile_reduce/{rows}x{cols}/{order}"), &out);
    }
    let rows = 4 * ws;
    let xo = sym(&[rows, 6], DType::F32);
    fill(&xo, |i| val(me, i));
    let o = Tensor::zeros(&[4, 6], DType::F32).unwrap();
    ops::reduce_scatter_offset(&xo, std::slice::from_ref(&o), g, 0, None, None, ReduceOp::Sum).unwrap();
    j.report("reduce_scatter_offset", &o);
    // PyTorch's default blocks (a reduce-scatter's: each host gets its ranks' rows alone), 800 KB
    // a rank: host push past the all-gather's limits over tcp, within the reduce-scatter's.
    let cols = 200_000 / ws;
    let xr = sym(&[ws, cols], DType::F32);
    fill(&xr, |i| val(me, i));
    let or = Tensor::zeros(&[1, cols], DType::F32).unwrap();
    ops::reduce_scatter_offset(&xr, std::slice::from_ref(&or), g, 0, None, None, ReduceOp::Sum).unwrap();
    fill(&xr, |_| -1.0);
    g.barrier(T).unwrap();
    j.report("reduce_scatter_offset/default/800k", &or);
    // Across hosts by every way of the all-gather's exchange (gathered by the leader: 12 rows
    // of 100; each rank's own message: of 1000; from the input for a rank alone on its host:
    // of 4000; pulled past the limit: of 80 000 columns), uneven blocks dealt to the ranks in
    // reverse, along either dimension, bf16 and f32. Each input is rewritten once the call
    // returns.
    for (dtype, cols) in [(DType::F32, 100), (DType::BF16, 1000), (DType::F32, 4000), (DType::F32, 80_000)] {
        let rows = 3 * ws;
        let x = sym(&[rows, cols], dtype);
        // A block of one row (or column) and one of two per rank, owners reversed (the first
        // 3·ws rows or columns).
        for dim in [0, 1] {
            let offsets: Vec<usize> = (1..=ws).chain((1..=ws).map(|k| ws + 2 * k)).collect();
            let dst: Vec<usize> = (0..2 * ws).map(|i| ws - 1 - i % ws).collect();
            let size = |i: usize| offsets[i] - if i == 0 { 0 } else { offsets[i - 1] };
            let outs: Vec<Tensor> = (0..2 * ws)
                .filter(|&i| dst[i] == me)
                .map(|i| {
                    let shape = if dim == 0 { [size(i), cols] } else { [rows, size(i)] };
                    Tensor::zeros(&shape, dtype).unwrap()
                })
                .collect();
            fill(&x, |i| val(me, i));
            ops::reduce_scatter_offset(&x, &outs, g, dim, Some(&offsets), Some(&dst), ReduceOp::Sum).unwrap();
            fill(&x, |_| -1.0);
            g.barrier(T).unwrap();
            for (k, o) in outs.iter().enumerate() {
                j.report(&format!("reduce_scatter_offset/{dtype}/{cols}/{dim}/{k}"), o);
            }
        }
    }
    let nd = sym(&[3, 2 * ws], DType::F32);
    fill(&nd, |i| val(me, i));
    let ndo = Tensor::zeros(&[3 * ws, 2], DType::F32).unwrap();
    ops::all_to_all_nd(&nd, &ndo, 1, 0, g).unwrap();
    j.report("all_to_all_nd", &ndo);
    // Across hosts by every way of the all-gather's exchange (inputs of 96 B · ws, 20 KiB · ws,
    // 80 KiB · ws and 1.2 MB · ws: gathered by the leader, each rank's own message, from the
    // input for a rank alone on its host, pulled), both pairs of dimensions. Each input is
    // rewritten once the call returns.
    for cols in [24, 5120, 20_480, 300_000] {
        let x = sym(&[ws, cols], DType::F32);
        for (sd, gd) in [(0, 1), (1, 0)] {
            if sd == 1 && cols % ws != 0 {
                continue;
            }
            let out = if sd == 0 {
                Tensor::zeros(&[1, ws * cols], DType::F32).unwrap()
            } else {
                Tensor::zeros(&[ws * ws, cols / ws], DType::F32).unwrap()
            };
            fill(&x, |i| val(me, i));
            ops::all_to_all_nd(&x, &out, sd, gd, g).unwrap();
            fill(&x, |_| -1.0);
            g.barrier(T).unwrap();
            j.report(&format!("all_to_all_nd/{cols}/{sd}"), &out);
        }
    }
    let a = sym(&[4, 5], DType::F32);
    fill(&a, |i| val(me, i) / 1000.0);
    let b = Tensor::zeros(&[5, 3], DType::F32).unwrap();
    fill(&b, |i| val(7, i) / 1000.0);
    let (ga, outs) = ops::fused_all_gather_matmul(&a, std::slice::from_ref(&b), 0, g, true).unwrap();
    j.report("fused_all_gather_matmul/a", &ga.unwrap());
    j.report("fused_all_gather_matmul/out", &outs[0]);
    // Across hosts by every way of the all-gather's exchange (shards of 2 x 300 f32: gathered by
    // the leader; of 2 x 3000: each rank's own message; of 2 x 9000: from the input for a rank
    // alone on its host; of 2 x 200 000: pulled), gathered along either dimension. Each shard
    // is rewritten once the call returns.
    for k in [300, 3000, 9000, 200_000] {
        let shard = sym(&[2, k], DType::F32);
        for gd in [0, 1] {
            let kk = if gd == 1 { k * ws } else { k };
            let bm = Tensor::zeros(&[kk, 3], DType::F32).unwrap();
            fill(&bm, |i| ((i % 7) as f64 - 3.0) / 8.0);
            fill(&shard, |i| val(me, i) / 1000.0);
            let (ga, outs) = ops::fused_all_gather_matmul(&shard, std::slice::from_ref(&bm), gd, g, true).unwrap();
            fill(&shard, |_| -1.0);
            g.barrier(T).unwrap();
            j.report(&format!("fused_all_gather_matmul/{k}/{gd}/a"), &ga.unwrap());
            j.report(&format!("fused_all_gather_matmul/{k}/{gd}/out"), &outs[0]);
        }
    }
    let am = Tensor::zeros(&[2 * ws, 5], DType::F32).unwrap();
    fill(&am, |i| val(me, i) / 1000.0);
    let rs_mm = ops::fused_matmul_reduce_scatter(&am, &b, ReduceOp::Sum, 0, g).unwrap();
    j.report("fused_matmul_reduce_scatter", &rs_mm);
    // Across hosts by every way of the all-gather's exchange (partials of 2·ws x 5, x 1024, x
    // 4096 and x 65 536 f32: gathered by the leader, each rank's own message, from the workspace
    // for a rank alone on its host, pulled), scattered along either dimension.
    for cols in [5, 1024, 4096, 65_536] {
        let bm = Tensor::zeros(&[5, cols], DType::F32).unwrap();
        fill(&bm, |i| ((i % 11) as f64 - 5.0) / 4.0 + me as f64);
        for sd in [0, 1] {
            if sd == 1 && cols % ws != 0 {
                continue;
            }
            let got = ops::fused_matmul_reduce_scatter(&am, &bm, ReduceOp::Sum, sd, g).unwrap();
            j.report(&format!("fused_matmul_reduce_scatter/{cols}/{sd}"), &got);
        }
    }
}

#[test]
#[ignore = "a rank program; run by the layout tests below"]
fn rank_hosts() {
    let Some(j) = Job::start() else { return };
    one_sided(&j);
    operators(&j);
    j.g.barrier(T).unwrap();
    println!("rank {} ok", j.me);
}

type Digests = BTreeMap<usize, BTreeMap<String, String>>;

/// The single-host digests of `rank_hosts` on `world` ranks, which every cross-host run of as
/// many ranks must reproduce.
fn reference(world: usize) -> Digests {
    reference_of("rank_hosts", world)
}

/// The single-host digests of `scenario` on `world` ranks, made once per test binary.
fn reference_of(scenario: &'static str, world: usize) -> Digests {
    type Made = BTreeMap<(&'static str, usize), Arc<OnceLock<Digests>>>;
    static REF: Mutex<Made> = Mutex::new(BTreeMap::new());
    let cell = REF.lock().unwrap_or_else(PoisonError::into_inner).entry((scenario, world)).or_default().clone();
    // The tests wanting the same digests wait for one run.
    cell.get_or_init(|| digests(&launch(Layout::OneHost, world, scenario, &[]), world)).clone()
}

/// Checks `got` has every digest of `rank_hosts`'s `want`.
fn assert_same(got: &Digests, want: &Digests) {
    assert_digests(got, want, 61, "");
}

/// Checks `got` has every digest of `want`, which has at least `at_least` a rank; `what` begins
/// each complaint.
fn assert_digests(got: &Digests, want: &Digests, at_least: usize, what: &str) {
    assert!(want.len() >= 4, "every rank reported");
    for (r, w) in want {
        assert!(w.len() >= at_least, "rank {r} digested every operator ({} digests)", w.len());
        for (name, d) in w {
            assert_eq!(got[r].get(name), Some(d), "{what}rank {r}: {name} differs from the single-host result");
        }
    }
}

/// The all-reduces alone: three hosts make a chain with a middle host.
#[test]
#[ignore = "a rank program; run by three_hosts_match_one_host_bit_for_bit"]
fn rank_all_reduces() {
    let Some(j) = Job::start() else { return };
    all_reduces(&j);
    j.g.barrier(T).unwrap();
    println!("rank {} ok", j.me);
}

#[test]
fn three_hosts_match_one_host_bit_for_bit() {
    all_reduces_match_one_host(Layout::LoopbackN(3), 3, 2);
}

/// One rank per host: a host's leader alone, reducing straight into its tensor from 64 KiB.
#[test]
fn one_rank_per_host_matches_one_host_bit_for_bit() {
    all_reduces_match_one_host(Layout::Loopback, 2, 1);
}

/// Every all-reduce (and all-gather) on `hosts` played hosts of `per_host` ranks (`layout`),
/// over tcp and over ucx, equals the same ranks' on one host bit for bit.
fn all_reduces_match_one_host(layout: Layout, hosts: usize, per_host: usize) {
    let world = hosts * per_host;
    let want = digests(&launch(Layout::OneHost, world, "rank_all_reduces", &[]), world);
    assert_eq!(want.len(), world, "every rank reported");
    for backend in ["tcp", "ucx"] {
        if backend == "ucx" && !have_ucx() {
            continue;
        }
        let env = [("SYMMEM_XHOST_BACKEND", backend)];
        let got = digests(&launch(layout, per_host, "rank_all_reduces", &env), world);
        for (r, w) in &want {
            assert!(w.len() > 90, "rank {r} digested every all-reduce ({} digests)", w.len());
            for (name, d) in w {
                assert_eq!(
                    got[r].get(name),
                    Some(d),
                    "{backend}: rank {r}: {name} differs from the single-host result"
                );
            }
        }
    }
}

#[test]
fn two_hosts_on_loopback_match_one_host_bit_for_bit() {
    let got = digests(&launch(Layout::Loopback, 2, "rank_hosts", &[]), 4);
    assert_same(&got, &reference(4));
}

/// The same with one rank's links running late (its requests leave 5 ms after they were
/// started, in order: `transport::lag_sends`), a non-leader and then a leader: whatever
/// overtakes what between links then, every result is the same bit for bit.
#[test]
fn two_hosts_with_a_late_rank_match_one_host_bit_for_bit() {
    for backend in ["tcp", "ucx"] {
        if backend == "ucx" && !have_ucx() {
            continue;
        }
        for late in ["1:5", "2:5"] {
            let env = [("SYMMEM_TEST_LATE", late), ("SYMMEM_XHOST_BACKEND", backend)];
            let got = digests(&launch(Layout::Loopback, 2, "rank_hosts", &env), 4);
            assert_same(&got, &reference(4));
        }
    }
}

/// Whether the ucx backend runs here; says SKIPPED with the reason if not.
fn have_ucx() -> bool {
    match symmem::transport::ucx::available() {
        Ok(()) => true,
        Err(why) => {
            eprintln!("SKIPPED: no ucx here ({why})");
            false
        }
    }
}

#[test]
fn two_hosts_linked_by_ucx_match_one_host_bit_for_bit() {
    if !have_ucx() {
        return;
    }
    let got = digests(&launch(Layout::Loopback, 2, "rank_hosts", &[("SYMMEM_XHOST_BACKEND", "ucx")]), 4);
    assert_same(&got, &reference(4));
}

#[test]
fn two_network_namespaces_match_one_host_bit_for_bit() {
    let hosts = match Hosts::create(2) {
        Ok(h) => h,
        Err(why) => {
            eprintln!("SKIPPED: cannot create network namespaces here ({why})");
            return;
        }
    };
    // Rendezvous exchanges go through rank 0 here (the path for large groups), across the link.
    let got = digests(&launch(Layout::Netns(&hosts), 2, "rank_hosts", &[("SYMMEM_RENDEZVOUS", "gather")]), 4);
    assert_same(&got, &reference(4));
}

#[test]
fn two_network_namespaces_linked_by_ucx_match_one_host_bit_for_bit() {
    if !have_ucx() {
        return;
    }
    let hosts = match Hosts::create(2) {
        Ok(h) => h,
        Err(why) => {
            eprintln!("SKIPPED: cannot create network namespaces here ({why})");
            return;
        }
    };
    // On UCX's tcp, as between hosts without RDMA (on one machine UCX would take its shared
    // memory, which the played hosts on loopback cover); UCX_NET_DEVICES stays unset: it finds
    // the veth link by itself.
    let env = [("SYMMEM_XHOST_BACKEND", "ucx"), ("UCX_TLS", "tcp")];
    let got = digests(&launch(Layout::Netns(&hosts), 2, "rank_hosts", &env), 4);
    assert_same(&got, &reference(4));
}

/// `k` network namespaces on a switch, or `None` having said SKIPPED with the reason.
fn namespaces(k: usize) -> Option<Hosts> {
    match Hosts::create(k) {
        Ok(h) => Some(h),
        Err(why) => {
            eprintln!("SKIPPED: cannot create network namespaces here ({why})");
            None
        }
    }
}

/// Every one-sided call and operator on four namespaces of one rank each, and the short
/// scenario on four of two ranks each (the chain between hosts), with `env`: equal bit for bit
/// to as many ranks on one host.
fn four_namespaces_match_one_host(env: &[(&str, &str)]) {
    let Some(hosts) = namespaces(4) else { return };
    let t = Instant::now();
    let got = digests(&launch(Layout::Netns(&hosts), 1, "rank_hosts", env), 4);
    eprintln!("4 hosts x 1, every operator: {:.1} s", t.elapsed().as_secs_f64());
    assert_same(&got, &reference(4));
    let t = Instant::now();
    let got = digests(&launch(Layout::Netns(&hosts), 2, "rank_short", env), 8);
    eprintln!("4 hosts x 2, short: {:.1} s", t.elapsed().as_secs_f64());
    assert_digests(&got, &reference_of("rank_short", 8), SHORT, "4 hosts x 2: ");
}

#[test]
fn four_network_namespaces_match_one_host_bit_for_bit() {
    // Rendezvous exchanges go through rank 0, as in the two namespaces'.
    four_namespaces_match_one_host(&[("SYMMEM_RENDEZVOUS", "gather")]);
}

#[test]
fn four_network_namespaces_linked_by_ucx_match_one_host_bit_for_bit() {
    if !have_ucx() {
        return;
    }
    // On UCX's tcp, as between the two namespaces above.
    four_namespaces_match_one_host(&[("SYMMEM_XHOST_BACKEND", "ucx"), ("UCX_TLS", "tcp")]);
}

/// Every one-sided call and operator on four namespaces of two ranks each, over tcp and ucx:
/// equal bit for bit to eight ranks on one host. One to three minutes on two cores, most of it
/// eight ranks on one host; the tests above run the short scenario on this layout.
#[test]
#[ignore = "long: cargo test --test hosts -- --ignored four_network_namespaces_of_two"]
fn four_network_namespaces_of_two_ranks_match_one_host_bit_for_bit() {
    let Some(hosts) = namespaces(4) else { return };
    let want = reference(8);
    let mut envs = vec![vec![("SYMMEM_RENDEZVOUS", "gather")]];
    if have_ucx() {
        envs.push(vec![("SYMMEM_XHOST_BACKEND", "ucx"), ("UCX_TLS", "tcp")]);
    }
    for env in envs {
        let got = digests(&launch(Layout::Netns(&hosts), 2, "rank_hosts", &env), 8);
        assert_digests(&got, &want, 61, &format!("{env:?}: "));
    }
}

/// How many digests `rank_short` reports a rank.
const SHORT: usize = 15;

/// A few of each operator, small and large, short enough to play many hosts on one machine.
#[test]
#[ignore = "a rank program; run by sixteen_played_hosts_match_one_host_bit_for_bit"]
fn rank_short() {
    let Some(j) = Job::start() else { return };
    let (me, ws, g) = (j.me, j.ws, &j.g);
    // All-reduces host-pushed (up to 40 000 f32) and past host push's limit (f32 and i32 sums,
    // a bf16 sum), and one-shot's and two-shot's own.
    for (dtype, n, op) in [
        (DType::F32, 5, ReduceOp::Sum),
        (DType::F32, 3000, ReduceOp::Avg),
        (DType::F32, 40_000, ReduceOp::Sum),
        (DType::F32, 200_003, ReduceOp::Sum),
        (DType::I32, 150_001, ReduceOp::Max),
        (DType::BF16, 300_002, ReduceOp::Sum),
    ] {
        let x = sym(&[n], dtype);
        fill(&x, |i| val(me, i));
        ops::all_reduce(&x, op, g).unwrap();
        j.report(&format!("all_reduce/{dtype}/{n}/{op:?}"), &x);
    }
    let x = sym(&[3000], DType::F32);
    fill(&x, |i| val(me, i));
    j.report("one_shot", &ops::one_shot_all_reduce(&x, ReduceOp::Sum, g).unwrap());
    ops::two_shot_all_reduce_(&x, ReduceOp::Sum, g).unwrap();
    j.report("two_shot", &x);
    // All-gathers host-pushed (gathered by the leader, each rank's own message); a
    // reduce-scatter; broadcasts pushed and pulled.
    for n in [3000, 40_000] {
        let x = sym(&[n], DType::F32);
        fill(&x, |i| val(me, i));
        let out = Tensor::zeros(&[n * ws], DType::F32).unwrap();
        ops::all_gather_into(&x, g, &out).unwrap();
        x.fill(-1.0f32).unwrap();
        j.report(&format!("all_gather/{n}"), &out);
    }
    let x = sym(&[1024 * ws], DType::F32);
    fill(&x, |i| val(me, i));
    let rs = Tensor::zeros(&[1024], DType::F32).unwrap();
    ops::reduce_scatter_out(&x, ReduceOp::Sum, g, false, &rs).unwrap();
    j.report("reduce_scatter", &rs);
    for (n, root) in [(5000, ws - 1), (200_000, 1)] {
        let b = sym(&[n], DType::F64);
        fill(&b, |i| val(me, i));
        ops::broadcast_(&b, root, g).unwrap();
        j.report(&format!("broadcast/{n}/{root}"), &b);
    }
    // All-to-alls host-pushed and pulled.
    for block in [1024, ops::ALL_TO_ALL_PUSH_MAX / 4 / ws + 16] {
        let x = sym(&[block * ws], DType::F32);
        fill(&x, |i| val(me, i));
        let out = Tensor::zeros(&[block * ws], DType::F32).unwrap();
        ops::all_to_all(&x, &out, g).unwrap();
        j.report(&format!("all_to_all/{block}"), &out);
    }
    g.barrier(T).unwrap();
    println!("rank {me} ok");
}

/// Sixteen played hosts of one rank each, linked by tcp: a short scenario equal bit for bit to
/// one host's.
#[test]
fn sixteen_played_hosts_match_one_host_bit_for_bit() {
    let want = reference_of("rank_short", 16);
    let t = Instant::now();
    let got = digests(&launch(Layout::LoopbackN(16), 1, "rank_short", &[("SYMMEM_XHOST_BACKEND", "tcp")]), 16);
    eprintln!("16 played hosts: {:.1} s", t.elapsed().as_secs_f64());
    assert_digests(&got, &want, SHORT, "");
}

/// Ranks that disagree, across hosts enough that the leaders meet by dissemination and Bruck's
/// rounds, and (rounds of 1, 2 and 4 hosts) some hear a host twice: every rank gets the error
/// naming the first rank that differs from rank 0, whichever ways the ranks' calls take, then
/// agreeing calls are exact.
#[test]
#[ignore = "a rank program; run by ranks_on_five_hosts_that_disagree_get_the_same_error"]
fn rank_disagree_many() {
    let Some(j) = Job::start() else { return };
    let (me, ws, g) = (j.me, j.ws, &j.g);
    // Ranks 2, 5, 8, ... pass something else; rank 2 is the first that differs.
    let odd = me % 3 == 2;
    let refused_naming = |what: &str, r: symmem::Result<()>, first: usize| match r {
        Err(e @ symmem::Error::InvalidArgument(_)) => {
            let e = e.to_string();
            let named = format!("rank {first} ");
            assert!(e.contains("disagree") && e.contains("rank 0 ") && e.contains(&named), "{what}: {e}");
        }
        other => panic!("{what}: expected every rank to be told the ranks disagree, got {other:?}"),
    };
    let refused = |what: &str, r: symmem::Result<()>| refused_naming(what, r, 2);
    let x = sym(&[1 << 16], DType::F32);
    // Rendezvoused whole first: a view is then only checked, never exchanged.
    symm::rendezvous(&x, g).unwrap();
    x.fill(1.0f32).unwrap();
    let all_reduce = |n: usize| ops::all_reduce(&x.narrow(0, 0, n).unwrap(), ReduceOp::Sum, g);
    let all_gather = |n: usize| {
        let out = Tensor::zeros(&[n * ws], DType::F32).unwrap();
        ops::all_gather_into(&x.narrow(0, 0, n).unwrap(), g, &out)
    };
    // Host-pushed calls whose ranks take different ways: gathered by their leaders against a
    // vote for a larger workspace, then (the workspace grown by an agreeing call) against
    // ranks that send their own.
    refused("all_reduce gathered / vote", all_reduce(if odd { 2048 } else { 16 }));
    refused("all_gather gathered / vote", all_gather(if odd { 2048 } else { 4 }));
    // Agreeing calls in between, scattered (through the workspace, and straight from the
    // tensors) and gathered: exact.
    for n in [10_000, 16384, 3000] {
        x.fill(1.0f32).unwrap();
        all_reduce(n).unwrap();
        let got = x.narrow(0, 0, n).unwrap().to_vec::<f32>().unwrap();
        assert!(got.iter().all(|&v| v == ws as f32), "all_reduce of {n} after a refusal");
    }
    all_gather(16384).unwrap();
    refused("all_reduce gathered / own", all_reduce(if odd { 8192 } else { 16 }));
    refused("all_gather gathered / own", all_gather(if odd { 8192 } else { 4 }));
    refused("all_reduce own / gathered", all_reduce(if odd { 16 } else { 8192 }));
    // Rank 0's host alone sending its own: every rank names host 1's first rank, whatever
    // older signatures Bruck's rounds still held for rank 0's host.
    let host0 = j.host_of(me) == 0;
    let second = ws / j.hosts;
    refused_naming("all_reduce own on host 0", all_reduce(if host0 { 8192 } else { 16 }), second);
    refused_naming("all_gather own on host 0", all_gather(if host0 { 8192 } else { 4 }), second);
    refused_naming("all_reduce gathered on host 0", all_reduce(if host0 { 16 } else { 8192 }), second);
    x.fill(1.0f32).unwrap();
    // Entered through the checked barrier (two-shot, broadcast), or host-pushed (a tiny
    // all-reduce and all-gather), each twice: a refusal leaves every rank in step.
    for _ in 0..2 {
        let op = if odd { ReduceOp::Max } else { ReduceOp::Sum };
        refused("two_shot", ops::two_shot_all_reduce_(&x, op, g));
        refused("broadcast", ops::broadcast_(&x, usize::from(odd), g));
        refused("all_reduce", ops::all_reduce(&x.narrow(0, 0, if odd { 32 } else { 16 }).unwrap(), ReduceOp::Sum, g));
        let part = x.narrow(0, if odd { 4 } else { 0 }, 4).unwrap();
        let out = Tensor::zeros(&[4 * ws], DType::F32).unwrap();
        refused("all_gather", ops::all_gather_into(&part, g, &out));
    }
    x.fill(me as f32).unwrap();
    ops::two_shot_all_reduce_(&x, ReduceOp::Sum, g).unwrap();
    let sum = (ws * (ws - 1) / 2) as f32;
    assert!(x.to_vec::<f32>().unwrap().iter().all(|&v| v == sum), "two-shot after the refusals");
    let y = x.narrow(0, 0, 16).unwrap();
    y.fill(me as f32).unwrap();
    ops::all_reduce(&y, ReduceOp::Max, g).unwrap();
    assert!(y.to_vec::<f32>().unwrap().iter().all(|&v| v == (ws - 1) as f32), "all-reduce after the refusals");
    g.barrier(T).unwrap();
    println!("rank {me} ok");
}

#[test]
fn ranks_on_five_hosts_that_disagree_get_the_same_error() {
    for (hosts, per_host) in [(5, 1), (4, 2)] {
        let outs = launch(Layout::LoopbackN(hosts), per_host, "rank_disagree_many", &[("SYMMEM_XHOST_BACKEND", "tcp")]);
        let all: String = outs.iter().map(text).collect();
        assert!(outs.iter().all(|o| o.status.success()), "{hosts} hosts of {per_host}:\n{all}");
        for r in 0..hosts * per_host {
            assert!(all.contains(&format!("rank {r} ok")), "rank {r} of {hosts} hosts did not finish:\n{all}");
        }
        assert!(!all.contains("timed out"), "{all}");
    }
}

/// All-reduces (host-pushed and chained), all-to-alls large enough that every rank reads from
/// the other host, all-to-all-vs host-pushed or written into the other ranks' outs, and the
/// other operators listed below, until something fails; rank 0 writes the marker file once it
/// is running.
#[test]
#[ignore = "a rank program; run by the lost-host tests below"]
fn rank_lost() {
    let Some(j) = Job::start() else { return };
    let x = sym(&[4096], DType::F32);
    let n = j.ws * (ops::ALL_TO_ALL_PUSH_MAX / 4 / j.ws + 16);
    let (big, big_out) = (sym(&[n], DType::F32), Tensor::zeros(&[n], DType::F32).unwrap());
    let (v_out, oso) =
        (Tensor::zeros(&[4096 * j.ws], DType::F32).unwrap(), Tensor::zeros(&[2, j.ws], DType::I64).unwrap());
    let splits = i64_sym(&vec![64; j.ws]);
    // And all-to-all-vs whose rows are written into the symmetric outs (an input above
    // VDEV_CARRY_MAX).
    let w_rows = ops::VDEV_CARRY_MAX / 4 + 1024;
    let (w_in, w_out) = (sym(&[w_rows], DType::F32), sym(&[w_rows * j.ws], DType::F32));
    let w_splits = i64_sym(&vec![4096; j.ws]);
    // And all-reduces that take the chain (above 512 KiB of a host's inputs), and broadcasts of
    // the same tensor from the last rank, pulled (a host's leader reads the root's tensor into
    // its own, and its host's other ranks copy it from there).
    let chained = sym(&[200_000], DType::F32);
    // And all-gathers by host push, gathered by the leaders (16 KiB inputs) or not (32 KiB),
    // and reduce-scatters and broadcasts by host push.
    let (own, ag_small, ag_own, rs_out) = (
        sym(&[8192], DType::F32),
        Tensor::zeros(&[4096 * j.ws], DType::F32).unwrap(),
        Tensor::zeros(&[8192 * j.ws], DType::F32).unwrap(),
        Tensor::zeros(&[4096 / j.ws], DType::F32).unwrap(),
    );
    // And all-to-alls and all-gathers by host push whose host-mates read each other's inputs
    // (ops::hostpush::SHARED_DIRECT_MIN: blocks and inputs of 128 KiB), then wait for each
    // other's COPIED words.
    let (mid, mid_out) = (sym(&[32768 * j.ws], DType::F32), Tensor::zeros(&[32768 * j.ws], DType::F32).unwrap());
    let mid_ag = Tensor::zeros(&[32768 * j.ws * j.ws], DType::F32).unwrap();
    // And tile reductions by host push (a strided 32 x 32 tile of a 64 x 64 matrix).
    let (quad, quad_out) =
        (sym(&[64, 64], DType::F32).tile(16..48, 32..64).unwrap(), Tensor::zeros(&[32, 32], DType::F32).unwrap());
    let marker = std::env::var("SYMMEM_TEST_MARKER").ok();
    let start = Instant::now();
    for i in 0.. {
        if i == 20
            && j.me == 0
            && let Some(m) = &marker
        {
            std::fs::write(m, b"running").unwrap();
        }
        fill(&x, |k| (k + i) as f64);
        let done = match i % 8 {
            0 => ops::all_reduce(&x, ReduceOp::Sum, &j.g),
            4 => ops::all_reduce(&chained, ReduceOp::Sum, &j.g),
            5 => ops::all_gather_into(&x, &j.g, &ag_small),
            6 if i % 16 == 6 => ops::all_gather_into(&own, &j.g, &ag_own),
            6 => ops::all_gather_into(&mid, &j.g, &mid_ag),
            7 if i % 16 == 7 => ops::reduce_scatter_out(&x, ReduceOp::Sum, &j.g, false, &rs_out),
            7 if i % 32 == 15 => ops::broadcast_(&chained, j.ws - 1, &j.g),
            7 => ops::broadcast_(&own, j.ws - 1, &j.g),
            1 if i % 16 == 1 => ops::all_to_all(&big, &big_out, &j.g),
            1 => ops::all_to_all(&mid, &mid_out, &j.g),
            2 => ops::all_to_all_vdev(&x, &v_out, &splits, &oso, &j.g),
            3 if i % 16 == 3 => ops::tile_reduce(&quad, &quad_out, j.ws - 1, &j.g, ReduceOp::Sum),
            _ => ops::all_to_all_vdev(&w_in, &w_out, &w_splits, &oso, &j.g),
        };
        if let Err(e) = done {
            println!("rank {} failed after {:.1} s: {e}", j.me, start.elapsed().as_secs_f64());
            std::process::exit(3);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Host 1 vanishes (its launcher by SIGKILL, its ranks with it) while host 0's ranks vote on
/// growing their all-reduce workspace: they must fail within their timeout, naming the lost
/// ranks, never wait in the vote or the growth's collective allocation.
#[test]
#[ignore = "a rank program; run by a_host_lost_during_a_vote_fails_the_others"]
fn rank_dies_in_vote() {
    let Some(j) = Job::start() else { return };
    let x = sym(&[8192], DType::F32);
    x.fill(1.0f32).unwrap();
    // The workspace, made at its first size by a small call.
    ops::all_reduce(&x.narrow(0, 0, 64).unwrap(), ReduceOp::Sum, &j.g).unwrap();
    if j.host_of(j.me) == 1 {
        // Host 0's ranks are in the vote now, waiting for this host: the test kills it.
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(std::env::var("SYMMEM_TEST_MARKER").unwrap(), b"voting").unwrap();
        std::thread::sleep(Duration::from_secs(60));
    }
    let start = Instant::now();
    // 32 KiB: more than the workspace holds, so a vote first.
    match ops::all_reduce(&x, ReduceOp::Sum, &j.g) {
        Ok(()) => panic!("rank {}: the all-reduce succeeded without host 1", j.me),
        Err(e) => {
            println!("rank {} failed after {:.1} s: {e}", j.me, start.elapsed().as_secs_f64());
            std::process::exit(3);
        }
    }
}

#[test]
fn a_host_lost_during_a_vote_fails_the_others() {
    let mut backends = vec!["tcp"];
    if have_ucx() {
        backends.push("ucx");
    }
    for backend in backends {
        let t0 = Instant::now();
        let env = [("SYMMEM_OP_TIMEOUT", "10"), ("SYMMEM_XHOST_BACKEND", backend)];
        let outs = kill_host1_at_marker(&format!("vote-{backend}"), "rank_dies_in_vote", &env);
        assert_lost(&outs, Duration::from_secs(10));
        assert!(t0.elapsed() < Duration::from_secs(60), "{backend}: nothing hung");
    }
}

/// Runs `scenario` on two played hosts with `env`, and once a rank writes the marker file
/// (`SYMMEM_TEST_MARKER`) kills host 1's launcher with SIGKILL: its ranks die with it, and
/// nothing tells the store.
fn kill_host1_at_marker(tag: &str, scenario: &str, env: &[(&str, &str)]) -> Vec<Output> {
    kill_host_at_marker(Layout::Loopback, 2, 1, tag, scenario, env)
}

/// [`kill_host1_at_marker`] on any layout, killing host `victim`.
fn kill_host_at_marker(
    layout: Layout,
    per_host: usize,
    victim: usize,
    tag: &str,
    scenario: &str,
    env: &[(&str, &str)],
) -> Vec<Output> {
    let marker = std::env::temp_dir().join(format!("symmem-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let m = marker.to_str().unwrap().to_string();
    let t0 = Instant::now();
    let mut env = env.to_vec();
    env.push(("SYMMEM_TEST_MARKER", &m));
    let outs = launch_with(layout, per_host, scenario, &env, |pids| {
        while !marker.exists() && t0.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = Command::new("kill").args(["-9", &pids[victim].to_string()]).status();
    });
    let _ = std::fs::remove_file(&marker);
    outs
}

/// Barriers (dissemination), and all-reduces and all-gathers small enough for Bruck's rounds,
/// until one fails; rank 0 writes the marker file once they run. A rank that fails reports how
/// long after the marker, then stays up (a rank that exits would be found lost in turn, and its
/// launcher would stop the others) until every survivor has had the time to report.
#[test]
#[ignore = "a rank program; run by a_host_lost_in_the_rounds_is_named_to_every_rank_at_once"]
fn rank_lost_in_rounds() {
    let Some(j) = Job::start() else { return };
    let marker = std::env::var("SYMMEM_TEST_MARKER").unwrap();
    let x = sym(&[64], DType::F32);
    let h = symm::rendezvous(&x, &j.g).unwrap();
    let out = Tensor::zeros(&[64 * j.ws], DType::F32).unwrap();
    // From four hosts a link has one flow (`remote::tcp_link_flows`): one sender thread per
    // rank on another host (the world group's links, the only ones here).
    let threads_named = |name: &str| {
        let tasks = std::fs::read_dir("/proc/self/task").unwrap();
        tasks
            .filter(|t| std::fs::read_to_string(t.as_ref().unwrap().path().join("comm")).unwrap().trim() == name)
            .count()
    };
    if std::env::var_os("SYMMEM_TRANSPORT_TCP_FLOWS").is_none() {
        assert_eq!(threads_named("symmem-tcp-send"), h.remote_ranks().len(), "rank {}: one flow per link", j.me);
    }
    for i in 0.. {
        if i == 30 && j.me == 0 {
            std::fs::write(&marker, b"running").unwrap();
        }
        let done = match i % 3 {
            0 => h.barrier(0, T),
            1 => ops::all_reduce(&x, ReduceOp::Sum, &j.g),
            _ => ops::all_gather_into(&x, &j.g, &out),
        };
        if let Err(e) = done {
            let since = || std::fs::metadata(&marker).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
            let after = since().unwrap_or_default();
            println!("rank {} failed {:.2} s after the marker: {e}", j.me, after.as_secs_f64());
            while since().is_some_and(|s| s < Duration::from_secs(15)) {
                std::thread::sleep(Duration::from_millis(100));
            }
            std::process::exit(3);
        }
    }
}

/// Dissemination barriers, then an exit without anything after them: ranks leave the last
/// barrier at different times, and a rank still in it must not take a peer that left (its
/// links closing) for a lost one.
#[test]
#[ignore = "a rank program; run by ranks_that_leave_after_the_last_barrier_fail_nobody"]
fn rank_barriers_then_exit() {
    let Some(j) = Job::start() else { return };
    let x = sym(&[64], DType::F32);
    let h = symm::rendezvous(&x, &j.g).unwrap();
    for _ in 0..200 {
        h.barrier(0, T).unwrap();
    }
    ops::all_reduce(&x, ReduceOp::Sum, &j.g).unwrap();
    println!("rank {} ok", j.me);
    // No barrier after this: leave the moment this rank's part is done.
    std::process::exit(0);
}

#[test]
fn ranks_that_leave_after_the_last_barrier_fail_nobody() {
    for _ in 0..3 {
        let outs = launch(Layout::LoopbackN(5), 1, "rank_barriers_then_exit", &[("SYMMEM_XHOST_BACKEND", "tcp")]);
        let all: String = outs.iter().map(text).collect();
        assert!(outs.iter().all(|o| o.status.success()), "{all}");
        for r in 0..5 {
            assert!(all.contains(&format!("rank {r} ok")), "rank {r} did not finish:\n{all}");
        }
    }
}

#[test]
fn a_host_lost_in_the_rounds_is_named_to_every_rank_at_once() {
    // Four hosts or more: leaders meet by dissemination and Bruck's rounds, where a leader
    // waits for one partner a round and only the lost host's partners see its links break.
    // The operations' timeout (30 s) is longer than survivors stay up (15 s after the kill):
    // a survivor that learns of the loss only at its timeout does not report.
    for (hosts, per_host, victim) in [(5, 1, 3), (4, 2, 2)] {
        let env = [("SYMMEM_OP_TIMEOUT", "30"), ("SYMMEM_XHOST_BACKEND", "tcp")];
        let tag = format!("rounds-{hosts}");
        let outs = kill_host_at_marker(Layout::LoopbackN(hosts), per_host, victim, &tag, "rank_lost_in_rounds", &env);
        let all: String = outs.iter().map(text).collect();
        let lost: Vec<String> = (0..per_host).map(|k| format!("rank {} ", victim * per_host + k)).collect();
        for r in (0..hosts * per_host).filter(|r| r / per_host != victim) {
            let report = format!("rank {r} failed ");
            let line = all.lines().find(|l| l.contains(&report)).unwrap_or_else(|| {
                panic!("{hosts} hosts of {per_host}: rank {r} did not report the loss in time:\n{all}")
            });
            let secs: f64 = line.split(&report).nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
            assert!(secs < 5.0, "{hosts} hosts of {per_host}: rank {r} learnt of the loss late: {line}");
            assert!(lost.iter().any(|l| line.contains(l)) && line.contains("lost"), "names a lost rank: {line}");
        }
    }
}

/// Checks that host 0's ranks failed in time, naming ranks of host 1. The first rank to fail
/// makes its launcher stop the other, which may not get to report: at least one must.
fn assert_lost(outs: &[Output], within: Duration) {
    let host0 = String::from_utf8_lossy(&outs[0].stdout).into_owned();
    assert!(!outs[0].status.success(), "host 0 must fail:\n{}", text(&outs[0]));
    let reports: Vec<&str> = host0.lines().filter(|l| l.contains("failed after")).collect();
    assert!(!reports.is_empty(), "no rank of host 0 reported the failure:\n{}", text(&outs[0]));
    for line in reports {
        eprintln!("host 0 reported: {line}");
        assert!(
            ["rank 2", "rank 3", "ranks [2"].iter().any(|r| line.contains(r)),
            "the error names a lost rank: {line}"
        );
        let secs: f64 = line.split("after ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        assert!(secs < within.as_secs_f64() + 5.0, "failed within its timeout: {line}");
    }
}

#[test]
fn a_vanished_host_fails_the_others_naming_its_ranks() {
    // Host 1 disappears at once; host 0's ranks notice through their links.
    let t0 = Instant::now();
    let outs = kill_host1_at_marker("vanish", "rank_lost", &[("SYMMEM_OP_TIMEOUT", "10")]);
    assert_lost(&outs, Duration::from_secs(10));
    assert!(t0.elapsed() < Duration::from_secs(100), "nothing hung");
}

#[test]
fn a_vanished_host_linked_by_ucx_fails_the_others_naming_its_ranks() {
    if !have_ucx() {
        return;
    }
    let t0 = Instant::now();
    let env = [("SYMMEM_OP_TIMEOUT", "10"), ("SYMMEM_XHOST_BACKEND", "ucx")];
    let outs = kill_host1_at_marker("vanish-ucx", "rank_lost", &env);
    assert_lost(&outs, Duration::from_secs(10));
    assert!(t0.elapsed() < Duration::from_secs(100), "nothing hung");
}

#[test]
fn cutting_the_link_fails_every_rank_within_its_timeout() {
    let hosts = match Hosts::create(2) {
        Ok(h) => h,
        Err(why) => {
            eprintln!("SKIPPED: cannot create network namespaces here ({why})");
            return;
        }
    };
    let marker = std::env::temp_dir().join(format!("symmem-cut-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let m = marker.to_str().unwrap().to_string();
    let t0 = Instant::now();
    let outs = std::thread::scope(|s| {
        let cutter = s.spawn(|| {
            while !marker.exists() && t0.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let out = common::ip(&["-n", &hosts.names[0], "link", "set", &hosts.devs[0], "down"]).unwrap();
            assert!(out.status.success(), "cutting the link: {}", String::from_utf8_lossy(&out.stderr));
        });
        let outs =
            launch(Layout::Netns(&hosts), 2, "rank_lost", &[("SYMMEM_TEST_MARKER", &m), ("SYMMEM_OP_TIMEOUT", "5")]);
        cutter.join().unwrap();
        outs
    });
    let _ = std::fs::remove_file(&marker);
    assert_lost(&outs, Duration::from_secs(5));
    for (i, o) in outs.iter().enumerate() {
        assert!(!o.status.success(), "host {i} must fail too:\n{}", text(o));
    }
    assert!(t0.elapsed() < Duration::from_secs(120), "nothing hung");
}

/// What this process holds: open fds, threads, resident bytes.
fn holdings() -> (usize, usize, u64) {
    let count = |dir: &str| std::fs::read_dir(dir).unwrap().count();
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    (count("/proc/self/fd"), count("/proc/self/task"), pages * 4096)
}

/// Creates and drops `SYMMEM_TEST_GROUPS` groups spanning both hosts, each with links (a
/// rendezvous across hosts), a barrier, and the workspaces of the small and cross-host
/// all-reduce and of the checked prologue; prints what the process held before and after.
#[test]
#[ignore = "a rank program; run by groups_with_links_die_with_their_group"]
fn rank_group_churn() {
    let Some(j) = Job::start() else { return };
    let n: usize = std::env::var("SYMMEM_TEST_GROUPS").unwrap().parse().unwrap();
    let all: Vec<usize> = (0..j.ws).collect();
    let churn = |i: usize| {
        let g = j.g.split(&all).unwrap().unwrap();
        let x = sym(&[64], DType::F32);
        x.fill(1.0f32).unwrap();
        let h = symm::rendezvous(&x, &g).unwrap();
        assert!(!h.remote_ranks().is_empty(), "group {i} has links to the other host");
        ops::all_reduce(&x, ReduceOp::Sum, &g).unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), vec![j.ws as f32; 64], "group {i}");
        h.barrier(0, T).unwrap();
    };
    // Warm up: the first groups make the process's lasting state (runtime threads, pools).
    for i in 0..20 {
        churn(i);
    }
    j.g.barrier(T).unwrap();
    let before = holdings();
    for i in 20..n {
        churn(i);
    }
    j.g.barrier(T).unwrap();
    // Link threads see their sockets close and exit on their own: give them a moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut after = holdings();
    while (after.0 > before.0 || after.1 > before.1) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        after = holdings();
    }
    println!("holdings before {before:?} after {after:?}");
    assert!(after.0 <= before.0, "fds grew from {} to {} over {} groups", before.0, after.0, n - 20);
    assert!(after.1 <= before.1, "threads grew from {} to {} over {} groups", before.1, after.1, n - 20);
    // A group's links, barrier and workspaces are hundreds of KiB; 8 MiB over 980 groups is
    // the allocator's slack, not a leak.
    assert!(after.2 <= before.2 + (8 << 20), "RSS grew from {} to {} bytes over {} groups", before.2, after.2, n - 20);
    j.g.barrier(T).unwrap();
    println!("rank {} ok", j.me);
}

/// Per-group state dies with its group: 1,000 groups with cross-host links created and dropped
/// in one process leave its fds, threads and RSS where they were.
#[test]
fn groups_with_links_die_with_their_group() {
    let t = Instant::now();
    let outs = launch(Layout::Loopback, 1, "rank_group_churn", &[("SYMMEM_TEST_GROUPS", "1000")]);
    assert!(outs.iter().all(|o| o.status.success()), "{}", outs.iter().map(text).collect::<String>());
    digests(&outs, 2);
    for o in &outs {
        let out = String::from_utf8_lossy(&o.stdout);
        let line = out.lines().find(|l| l.contains("holdings before")).unwrap_or("");
        eprintln!("{line}");
    }
    eprintln!("1000 groups in {:.1} s", t.elapsed().as_secs_f64());
}
