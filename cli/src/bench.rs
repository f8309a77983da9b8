//! The measurements behind `symmem bench`.
//!
//! Every benchmark reports [`BenchResult`] lines: `bench` (what was measured), `ranks`, `bytes`
//! (message size, where one applies), `iters`, `lat_us` (median), `p99_us`, `gbps` (10^9
//! bytes/s, where one applies), and extra fields such as `ops_per_s` or `backend`. The CLI
//! prints them as a table or, with `--json`, one JSON object per line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use symmem::store::{AsyncStoreClient, ClientOptions, Secret, ServerOptions, StoreServer};
use symmem::{Error, Result};

/// One result line.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResult {
    /// What was measured, e.g. `store_set` or `rendezvous_multi_get`.
    pub bench: String,
    /// Ranks (or concurrent clients) taking part.
    pub ranks: usize,
    /// Message size in bytes, where one applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Measured iterations (per rank).
    pub iters: u64,
    /// Median latency, microseconds.
    pub lat_us: f64,
    /// 99th-percentile latency, microseconds.
    pub p99_us: f64,
    /// Bandwidth in 10^9 bytes per second, where one applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gbps: Option<f64>,
    /// Anything else worth reporting (`ops_per_s`, `backend`, `algo`, ...).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// The median and 99th percentile of `samples`, in microseconds.
pub fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    if samples.is_empty() {
        return (0.0, 0.0);
    }
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((samples.len() - 1) as f64 * q).round() as usize;
        samples[i].as_secs_f64() * 1e6
    };
    (at(0.5), at(0.99))
}

/// What `symmem bench store` measures.
#[derive(Clone, Debug)]
pub struct StoreBenchOptions {
    /// Concurrent client counts for the throughput runs.
    pub clients: Vec<usize>,
    /// Operations per client in each throughput run.
    pub ops_per_client: usize,
    /// Value size for `set` and `get`.
    pub value_bytes: usize,
    /// Simulated rank counts for the rendezvous runs.
    pub rendezvous_ranks: Vec<usize>,
    /// The largest rank count for which per-key gets are measured (they cost N² requests).
    pub per_key_max_ranks: usize,
    /// Benchmark the store at this address instead of starting one in this process.
    pub addr: Option<String>,
    /// The store's secret, if it has one.
    pub secret: Option<Secret>,
}

impl Default for StoreBenchOptions {
    fn default() -> Self {
        StoreBenchOptions {
            clients: vec![1, 4, 16, 64],
            ops_per_client: 2000,
            value_bytes: 64,
            rendezvous_ranks: vec![2, 16, 128, 1024, 4096],
            per_key_max_ranks: 1024,
            addr: None,
            secret: None,
        }
    }
}

/// Runs the store benchmarks, handing each result to `emit` as soon as it is measured.
///
/// The first two lines set the scale: `tcp_pingpong` is a plain blocking TCP round trip between
/// two threads (the floor for any request/reply store on this machine), and `store_add_sync` is
/// the same round trip through [`TcpStore`](symmem::TcpStore), the path ranks use.
pub fn store(options: &StoreBenchOptions, mut emit: impl FnMut(BenchResult)) -> Result<()> {
    symmem::internals::raise_fd_limit();
    let server = match &options.addr {
        Some(_) => None,
        None => Some(StoreServer::start(
            "127.0.0.1:0",
            ServerOptions { secret: options.secret.clone(), ..Default::default() },
        )?),
    };
    let addr =
        options.addr.clone().unwrap_or_else(|| server.as_ref().map(|s| s.local_addr().to_string()).unwrap_or_default());
    let copts = ClientOptions { timeout: Duration::from_secs(120), secret: options.secret.clone() };
    emit(tcp_pingpong(options.ops_per_client)?);
    emit(sync_add(&addr, &copts, options.ops_per_client)?);
    symmem::internals::block_on(async {
        let mut run = 0u64;
        for op in [Op::Set, Op::Get, Op::Add] {
            for &k in &options.clients {
                run += 1;
                emit(throughput(&addr, &copts, op, k, options.ops_per_client, options.value_bytes, run).await?);
            }
        }
        for &n in &options.rendezvous_ranks {
            for multi in [false, true] {
                if !multi && n > options.per_key_max_ranks {
                    continue;
                }
                run += 1;
                let how = if multi { Exchange::MultiGet } else { Exchange::PerKey };
                let value = |i: usize| format!("handle-of-rank-{i}").into_bytes();
                emit(rendezvous(&addr, &copts, n, how, run, &value).await?);
            }
        }
        Ok::<_, Error>(())
    })?;
    drop(server);
    Ok(())
}

fn latency_row(bench: &str, bytes: Option<u64>, lat: &mut [Duration], note: &str) -> BenchResult {
    let iters = lat.len() as u64;
    let total: Duration = lat.iter().sum();
    let (median, p99) = percentiles(lat);
    let mut extra = serde_json::Map::new();
    extra.insert("ops_per_s".into(), (iters as f64 / total.as_secs_f64()).round().into());
    extra.insert("note".into(), note.into());
    BenchResult { bench: bench.into(), ranks: 1, bytes, iters, lat_us: median, p99_us: p99, gbps: None, extra }
}

/// The floor: an 8-byte blocking TCP ping-pong between two threads over loopback.
fn tcp_pingpong(iters: usize) -> Result<BenchResult> {
    use std::io::{Read, Write};
    let io = |e| Error::io("tcp ping-pong baseline", e);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 8];
        while s.read_exact(&mut b).is_ok() {
            s.write_all(&b)?;
        }
        Ok(())
    });
    let mut c = std::net::TcpStream::connect(addr).map_err(io)?;
    c.set_nodelay(true).map_err(io)?;
    let mut b = [0u8; 8];
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        c.write_all(&b).map_err(io)?;
        c.read_exact(&mut b).map_err(io)?;
        if i >= iters / 10 {
            lat.push(t.elapsed());
        }
    }
    drop(c);
    let _ = echo.join();
    Ok(latency_row("tcp_pingpong", Some(8), &mut lat, "baseline: blocking TCP round trip, two threads"))
}

/// One rank's synchronous store round trip, through `TcpStore`.
fn sync_add(addr: &str, options: &ClientOptions, iters: usize) -> Result<BenchResult> {
    use symmem::store::Store;
    let store = symmem::store::TcpStore::connect(addr, options.clone())?;
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        store.add("bench/sync_add", 1)?;
        if i >= iters / 10 {
            lat.push(t.elapsed());
        }
    }
    Ok(latency_row("store_add_sync", None, &mut lat, "TcpStore::add, the path a rank uses"))
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Set,
    Get,
    Add,
}

async fn connect_all(addr: &str, options: &ClientOptions, n: usize) -> Result<Vec<AsyncStoreClient>> {
    // Connect in waves so the listen backlog never overflows into SYN retries.
    let mut clients = Vec::with_capacity(n);
    while clients.len() < n {
        let wave = (n - clients.len()).min(256);
        let batch = futures::future::join_all((0..wave).map(|_| AsyncStoreClient::connect(addr, options))).await;
        for c in batch {
            clients.push(c?);
        }
    }
    Ok(clients)
}

fn join_error(e: tokio::task::JoinError) -> Error {
    Error::InvalidArgument(format!("benchmark task failed: {e}"))
}

async fn throughput(
    addr: &str,
    options: &ClientOptions,
    op: Op,
    clients: usize,
    ops: usize,
    value_bytes: usize,
    run: u64,
) -> Result<BenchResult> {
    let conns = connect_all(addr, options, clients).await?;
    let value = Arc::new(vec![0xabu8; value_bytes]);
    let start_line = Arc::new(tokio::sync::Barrier::new(clients + 1));
    let mut tasks = Vec::new();
    for (i, mut c) in conns.into_iter().enumerate() {
        let (value, start_line) = (value.clone(), start_line.clone());
        tasks.push(tokio::spawn(async move {
            let key = format!("bench/{run}/{i}");
            if matches!(op, Op::Get) {
                c.set(&key, &value).await?;
            }
            start_line.wait().await;
            let mut lat = Vec::with_capacity(ops);
            for _ in 0..ops {
                let t = Instant::now();
                match op {
                    Op::Set => {
                        c.set(&key, &value).await?;
                        // SET has no reply; the CHECK after it makes each iteration a round
                        // trip, so the latency includes the store applying the SET.
                        c.check(&[&key]).await?;
                    }
                    Op::Get => {
                        c.get(&key, Duration::from_secs(10)).await?;
                    }
                    Op::Add => {
                        c.add(&key, 1).await?;
                    }
                }
                lat.push(t.elapsed());
            }
            Ok::<_, Error>(lat)
        }));
    }
    start_line.wait().await;
    let t0 = Instant::now();
    let mut lat = Vec::with_capacity(clients * ops);
    for t in tasks {
        lat.extend(t.await.map_err(join_error)??);
    }
    let wall = t0.elapsed();
    let (median, p99) = percentiles(&mut lat);
    let mut extra = serde_json::Map::new();
    extra.insert("ops_per_s".into(), ((clients * ops) as f64 / wall.as_secs_f64()).round().into());
    let note = match op {
        Op::Set => "set+check round trip",
        Op::Get => "wait+get, as torch's get",
        Op::Add => "add",
    };
    extra.insert("note".into(), note.into());
    let name = match op {
        Op::Set => "store_set",
        Op::Get => "store_get",
        Op::Add => "store_add",
    };
    Ok(BenchResult {
        bench: name.into(),
        ranks: clients,
        bytes: (!matches!(op, Op::Add)).then_some(value_bytes as u64),
        iters: ops as u64,
        lat_us: median,
        p99_us: p99,
        gbps: None,
        extra,
    })
}

/// How simulated ranks exchange their rendezvous records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exchange {
    /// PyTorch's default: one set, then one WAIT+GET per other rank (N² requests in all).
    PerKey,
    /// symmem's default: one set and one WAIT+MULTI_GET of every other key.
    MultiGet,
    /// Through rank 0 (`SYMMEM_RENDEZVOUS=gather`): ranks set, rank 0 multi-gets them all and
    /// sets one blob, every other rank gets the blob: O(N) requests.
    Gather,
}

impl Exchange {
    fn name(self) -> &'static str {
        match self {
            Exchange::PerKey => "rendezvous_get",
            Exchange::MultiGet => "rendezvous_multi_get",
            Exchange::Gather => "rendezvous_gather",
        }
    }
}

/// N simulated ranks each publish one value (`value(rank)`) and obtain every rank's.
async fn rendezvous(
    addr: &str,
    options: &ClientOptions,
    n: usize,
    how: Exchange,
    run: u64,
    value: &(dyn Fn(usize) -> Vec<u8> + Sync),
) -> Result<BenchResult> {
    let conns = connect_all(addr, options, n).await?;
    let start_line = Arc::new(tokio::sync::Barrier::new(n + 1));
    let mut tasks = Vec::new();
    let values: Vec<Vec<u8>> = (0..n).map(value).collect();
    let record_bytes = values.first().map_or(0, Vec::len);
    for (i, (mut c, mine)) in conns.into_iter().zip(values).enumerate() {
        let start_line = start_line.clone();
        tasks.push(tokio::spawn(async move {
            let prefix = format!("rdzv/{run}");
            let others: Vec<String> = (0..n).filter(|&j| j != i).map(|j| format!("{prefix}/{j}")).collect();
            let refs: Vec<&str> = others.iter().map(String::as_str).collect();
            start_line.wait().await;
            let t = Instant::now();
            let timeout = Duration::from_secs(600);
            let all = format!("{prefix}/all");
            match how {
                Exchange::Gather if i == 0 => {
                    let mut got = vec![mine];
                    got.extend(c.multi_get(&refs, timeout).await?);
                    c.set(&all, &symmem::internals::wire::symm::pack_gathered(&got)).await?;
                }
                Exchange::Gather => {
                    c.set(&format!("{prefix}/{i}"), &mine).await?;
                    let blob = c.get(&all, timeout).await?;
                    let got = symmem::internals::wire::symm::unpack_gathered(&blob, n).map_err(Error::Rendezvous)?;
                    debug_assert_eq!(got.len(), n);
                }
                Exchange::MultiGet => {
                    c.set(&format!("{prefix}/{i}"), &mine).await?;
                    let got = c.multi_get(&refs, timeout).await?;
                    debug_assert_eq!(got.len(), n - 1);
                }
                Exchange::PerKey => {
                    c.set(&format!("{prefix}/{i}"), &mine).await?;
                    for k in &refs {
                        c.get(k, timeout).await?;
                    }
                }
            }
            Ok::<_, Error>(t.elapsed())
        }));
    }
    start_line.wait().await;
    let t0 = Instant::now();
    let mut lat = Vec::with_capacity(n);
    for t in tasks {
        lat.push(t.await.map_err(join_error)??);
    }
    let wall = t0.elapsed();
    let (median, p99) = percentiles(&mut lat);
    // Requests on the wire: SET, then per key WAIT+GET, or one WAIT+MULTI_GET; through rank 0,
    // N-1 SETs and WAIT+GETs plus rank 0's WAIT+MULTI_GET and SET.
    let requests = match how {
        Exchange::MultiGet => n * 3,
        Exchange::PerKey => n + 2 * n * (n - 1),
        Exchange::Gather => 3 * (n - 1) + 3,
    };
    let mut extra = serde_json::Map::new();
    extra.insert("total_ms".into(), (wall.as_secs_f64() * 1e3).into());
    extra.insert("ops_per_s".into(), (requests as f64 / wall.as_secs_f64()).round().into());
    extra.insert("record_bytes".into(), record_bytes.into());
    Ok(BenchResult {
        bench: how.name().into(),
        ranks: n,
        bytes: None,
        iters: 1,
        lat_us: median,
        p99_us: p99,
        gbps: None,
        extra,
    })
}

/// A rank's symmetric-rendezvous record as a real job publishes it (JSON, about 200 bytes):
/// 8 ranks per host, a 1 MiB float32 tensor.
pub fn sample_record(rank: usize) -> Vec<u8> {
    symmem::internals::wire::symm::PeerRecord {
        version: symmem::internals::wire::symm::RECORD_VERSION,
        host: format!("node{:04}/6f1d3c2a-9b8e-4c7d-a5f0-{:012x}", rank / 8, rank / 8),
        pid: 100_000 + rank as u32,
        fd: 17,
        segment_len: (1 << 20) + 16384,
        pad_size: 9216,
        buffer_size: 1 << 20,
        shape: vec![512, 512],
        dtype: symmem::tensor::DType::F32.code(),
        offset: 0,
    }
    .encode()
}

/// `symmem bench rendezvous`: N simulated ranks (one store connection each, in this process)
/// exchange real rendezvous records through a local store, each way in [`Exchange`]; per-key
/// gets only up to `per_key_max` ranks (they cost N² requests).
pub fn rendezvous_scaling(ranks: &[usize], per_key_max: usize, mut emit: impl FnMut(BenchResult)) -> Result<()> {
    symmem::internals::raise_fd_limit();
    let server = StoreServer::start("127.0.0.1:0", ServerOptions::default())?;
    let addr = server.local_addr().to_string();
    let copts = ClientOptions { timeout: Duration::from_secs(600), secret: None };
    symmem::internals::block_on(async {
        let mut run = 1_000_000u64;
        for &n in ranks {
            for how in [Exchange::PerKey, Exchange::MultiGet, Exchange::Gather] {
                if n < 2 || how == Exchange::PerKey && n > per_key_max {
                    continue;
                }
                run += 1;
                emit(rendezvous(&addr, &copts, n, how, run, &sample_record).await?);
            }
        }
        Ok::<_, Error>(())
    })?;
    drop(server);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_ranks() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let (m, p) = percentiles(&mut v);
        assert_eq!((m.round(), p.round()), (51.0, 99.0));
        assert_eq!(percentiles(&mut []), (0.0, 0.0));
    }
}

/// What `symmem bench signal` measures.
#[derive(Clone, Debug)]
pub struct SignalBenchOptions {
    /// Rank counts for the barrier runs (the ping-pong always uses 2 ranks).
    pub ranks: Vec<usize>,
    /// Measured iterations per run.
    pub iters: usize,
    /// The `symmem` executable to launch ranks of.
    pub exe: std::path::PathBuf,
}

/// The environment variable through which a launched benchmark rank returns its results.
const BENCH_OUT_ENV: &str = symmem::config::env::BENCH_OUT;

/// Launches `ranks` ranks of `exe args`, split evenly over `hosts` played hosts
/// ([`symmem::launch::run_hosts`]), and hands `emit` every row the ranks report (through a file
/// named by [`BENCH_OUT_ENV`], removed afterwards).
fn launch_bench(
    exe: &std::path::Path,
    args: Vec<std::ffi::OsString>,
    ranks: usize,
    hosts: usize,
    timeout: Duration,
    emit: &mut dyn FnMut(BenchResult),
) -> Result<()> {
    static JOBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let hosts = hosts.max(1);
    if !ranks.is_multiple_of(hosts) {
        return Err(Error::InvalidArgument(format!("{ranks} ranks do not split evenly over {hosts} hosts")));
    }
    let job = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("symmem-bench-{}-{job}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let out = dir.join("rows.jsonl");
    let mut launch = symmem::launch::LaunchOptions::local(ranks / hosts, exe, args);
    launch.env.push((BENCH_OUT_ENV.into(), out.clone().into()));
    launch.timeout = Some(timeout);
    let result = symmem::launch::run_hosts(&launch, hosts).and_then(|outcome| {
        if outcome != symmem::launch::Outcome::Success {
            return Err(Error::InvalidArgument(format!("benchmark job of {ranks} ranks failed: {outcome}")));
        }
        let text = std::fs::read_to_string(&out).map_err(|e| Error::io(format!("read {}", out.display()), e))?;
        for line in text.lines() {
            emit(serde_json::from_str(line).map_err(|e| Error::InvalidArgument(format!("bad result {line:?}: {e}")))?);
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Signal ping-pong and barrier latency across launched ranks, next to the floor: a plain
/// atomic-flag ping-pong between two processes pinned to different cores.
pub fn signal(options: &SignalBenchOptions, mut emit: impl FnMut(BenchResult)) -> Result<()> {
    let iters = options.iters.to_string();
    let mut jobs: Vec<(usize, Vec<&str>)> = vec![(2, vec!["__bench-flag-rank", "--iters", &iters])];
    for &n in &options.ranks {
        jobs.push((n, vec!["__bench-signal-rank", "--iters", &iters]));
    }
    for (n, args) in jobs {
        let args = args.into_iter().map(Into::into).collect();
        launch_bench(&options.exe, args, n, 1, Duration::from_secs(300), &mut emit)?;
    }
    Ok(())
}

fn report(rows: &[BenchResult]) -> Result<()> {
    let path = symmem::config::value(BENCH_OUT_ENV)
        .ok_or(Error::Env { var: BENCH_OUT_ENV, reason: "not set (run through `symmem bench`)".into() })?;
    let mut text = String::new();
    for r in rows {
        text.push_str(&serde_json::to_string(r).unwrap_or_default());
        text.push('\n');
    }
    std::fs::write(path, text).map_err(|e| Error::io(format!("write {path:?}"), e))
}

fn pin_to_cpu(cpu: usize) -> bool {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu % n);
    rustix::thread::sched_setaffinity(None, &set).is_ok()
}

fn half_round_trips(mut rtt: Vec<Duration>, name: &str, ranks: usize, note: &str) -> BenchResult {
    for d in &mut rtt {
        *d /= 2;
    }
    let mut row = latency_row(name, Some(4), &mut rtt, note);
    row.ranks = ranks;
    row.extra.remove("ops_per_s");
    row
}

/// One rank of the signal benchmark (run by `symmem bench signal` through the launcher).
pub fn signal_rank(iters: usize) -> Result<()> {
    use symmem::symm::{self, Device};
    use symmem::tensor::DType;
    let group = symmem::Group::from_env()?;
    let (me, ws) = (group.rank(), group.world_size());
    let x = symm::empty(&[64], DType::U8, Device::Cpu)?;
    let h = symm::rendezvous(&x, &group)?;
    let t = Duration::from_secs(60);
    let mut rows = Vec::new();
    h.barrier(0, t)?;
    if ws == 2 {
        let other = 1 - me;
        let mut rtt = Vec::with_capacity(iters);
        for i in 0..iters + iters / 10 {
            let start = Instant::now();
            if me == 0 {
                h.put_signal(other, 1, t)?;
                h.wait_signal(other, 1, t)?;
            } else {
                h.wait_signal(other, 1, t)?;
                h.put_signal(other, 1, t)?;
            }
            if i >= iters / 10 {
                rtt.push(start.elapsed());
            }
        }
        rows.push(half_round_trips(rtt, "signal_pingpong", 2, "put_signal+wait_signal, one way (RTT/2), unpinned"));
    }
    h.barrier(0, t)?;
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let start = Instant::now();
        h.barrier(0, t)?;
        if i >= iters / 10 {
            lat.push(start.elapsed());
        }
    }
    let mut row = latency_row("barrier", None, &mut lat, "signal-pad barrier (rank 0's view)");
    row.ranks = ws;
    row.extra.remove("ops_per_s");
    rows.push(row);
    group.barrier(t)?;
    if me == 0 { report(&rows) } else { Ok(()) }
}

/// One rank of the baseline: two processes pinned to different cores bounce a plain atomic
/// flag through shared memory, with nothing else (no protocol, no timeouts, no sleeping).
pub fn flag_rank(iters: usize) -> Result<()> {
    use std::sync::atomic::{AtomicU32, Ordering};

    use symmem::symm::{self, Device};
    use symmem::tensor::DType;
    let group = symmem::Group::from_env()?;
    let me = group.rank();
    let pinned = pin_to_cpu(me);
    // Two flags on separate cache lines.
    let x = symm::empty(&[256], DType::U8, Device::Cpu)?;
    let h = symm::rendezvous(&x, &group)?;
    let base = h.buffer_ptrs()?[0] as *const u8;
    // SAFETY: both flags lie in rank 0's data buffer (256 bytes; offsets 0 and 128, 4-aligned),
    // mapped while `h` lives; every process touches them only atomically.
    let (ping, pong) = unsafe { (&*base.cast::<AtomicU32>(), &*base.add(128).cast::<AtomicU32>()) };
    h.barrier(0, Duration::from_secs(60))?;
    let mut rtt = Vec::with_capacity(iters);
    for i in 1..=(iters + iters / 10) as u32 {
        let start = Instant::now();
        if me == 0 {
            // Release/Acquire pairs: the store to ping with rank 1's load of ping, and rank 1's
            // store to pong with this load of pong.
            ping.store(i, Ordering::Release);
            while pong.load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
        } else {
            while ping.load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
            pong.store(i, Ordering::Release);
        }
        if i as usize > iters / 10 {
            rtt.push(start.elapsed());
        }
    }
    h.barrier(0, Duration::from_secs(60))?;
    let note = if pinned {
        "baseline: atomic flag ping-pong, one way (RTT/2), pinned to cores 0 and 1"
    } else {
        "baseline: atomic flag ping-pong, one way (RTT/2), pinning refused"
    };
    if me == 0 { report(&[half_round_trips(rtt, "flag_pingpong", 2, note)]) } else { Ok(()) }
}

/// What `symmem bench transport` measures.
#[derive(Clone, Debug)]
pub struct TransportBenchOptions {
    /// The backend.
    pub backend: String,
    /// Message sizes in bytes.
    pub sizes: Vec<usize>,
    /// Transfers kept in flight for the bandwidth runs.
    pub window: usize,
    /// The `symmem` executable to launch ranks of.
    pub exe: std::path::PathBuf,
}

/// Latency and bandwidth of one-sided writes and reads between two launched processes, next to
/// a plain TCP stream between the same two processes.
pub fn transport(options: &TransportBenchOptions, mut emit: impl FnMut(BenchResult)) -> Result<()> {
    let sizes = options.sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let args: Vec<std::ffi::OsString> = vec![
        "__bench-transport-rank".into(),
        "--backend".into(),
        options.backend.clone().into(),
        "--window".into(),
        options.window.to_string().into(),
        "--sizes".into(),
        sizes.into(),
    ];
    launch_bench(&options.exe, args, 2, 1, Duration::from_secs(600), &mut emit)
}

/// Operations per size: enough to take a measurable time, bounded at both ends.
fn ops_for(size: usize, budget: usize, lo: usize, hi: usize) -> usize {
    (budget / size.max(1)).clamp(lo, hi)
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

const PINGS: usize = 2200;

/// One rank of the transport benchmark (run by `symmem bench transport` through the launcher).
pub fn transport_rank(backend: &str, window: usize, sizes: &[usize]) -> Result<()> {
    use std::io::{Read, Write};

    use symmem::tensor::{DType, Tensor};
    use symmem::transport::{Options, RemoteBuffer, new_transport_rank};
    let group = symmem::Group::from_env()?;
    let (me, peer) = (group.rank() as u64, 1 - group.rank() as u64);
    let t = Duration::from_secs(60);
    let transport = new_transport_rank(backend, None, group.store(), peer, me, t, &Options::new())?;
    let max = sizes.iter().copied().max().unwrap_or(1);
    let same_host = transport.caps().reach == symmem::transport::Reach::SameHost;
    // Heap memory everywhere; for same-host backends also memory in a shared-memory file, which
    // shm moves through a mapping instead of cross-memory attach.
    let kinds: &[&str] = if same_host { &["heap", "shared"] } else { &["heap"] };
    let mut mems = Vec::new();
    let mut mine = Vec::new();
    for kind in kinds {
        let buf = if *kind == "shared" {
            symmem::transport::shm::alloc(&[max], DType::U8)?
        } else {
            Tensor::zeros(&[max], DType::U8)?
        };
        buf.fill(me as u8 + 1)?;
        let mem = transport.register_memory(&buf)?;
        mine.push(String::from_utf8_lossy(&mem.to_remote_buffer()?.serialize()).into_owned());
        mems.push((buf, mem));
    }
    let descs = group.all_gather_bytes("descriptor", mine.join("\n").as_bytes())?;
    let theirs: Vec<RemoteBuffer> = String::from_utf8_lossy(&descs[peer as usize])
        .lines()
        .map(|l| RemoteBuffer::deserialize(l.as_bytes()))
        .collect::<Result<_>>()?;
    let mut rows = Vec::new();

    if !same_host {
        // The baseline: a plain TCP stream between the two processes.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("bind baseline stream", e))?;
        let ports = group.all_gather_bytes(
            "stream",
            listener.local_addr().map_err(|e| Error::io("addr", e))?.to_string().as_bytes(),
        )?;
        let stream_sizes: Vec<usize> = sizes.iter().copied().filter(|&s| s >= 64 * 1024).collect();
        if me == 1 {
            let (mut s, _) = listener.accept().map_err(|e| Error::io("accept baseline stream", e))?;
            let mut sink = vec![0u8; max.max(1)];
            for &size in &stream_sizes {
                let total = ops_for(size, 1 << 30, 16, 100_000) * size;
                let mut got = 0;
                while got < total {
                    let n = s.read(&mut sink[..size.min(total - got)]).map_err(|e| Error::io("baseline read", e))?;
                    if n == 0 {
                        return Err(Error::io("baseline read", std::io::ErrorKind::UnexpectedEof.into()));
                    }
                    got += n;
                }
                s.write_all(&[1]).map_err(|e| Error::io("baseline ack", e))?;
            }
            // Echo 8-byte pings.
            let mut b = [0u8; 8];
            for _ in 0..PINGS {
                s.read_exact(&mut b).map_err(|e| Error::io("baseline ping", e))?;
                s.write_all(&b).map_err(|e| Error::io("baseline pong", e))?;
            }
        } else {
            let addr = String::from_utf8_lossy(&ports[1]).into_owned();
            let mut s = std::net::TcpStream::connect(&addr).map_err(|e| Error::io("connect baseline stream", e))?;
            let _ = s.set_nodelay(true);
            let data = vec![7u8; max.max(1)];
            for &size in &stream_sizes {
                let ops = ops_for(size, 1 << 30, 16, 100_000);
                let start = Instant::now();
                for _ in 0..ops {
                    s.write_all(&data[..size]).map_err(|e| Error::io("baseline write", e))?;
                }
                let mut ack = [0u8];
                s.read_exact(&mut ack).map_err(|e| Error::io("baseline ack", e))?;
                let d = start.elapsed();
                let mut extra = serde_json::Map::new();
                extra.insert("note".into(), "baseline: plain TCP stream between the two processes".into());
                rows.push(BenchResult {
                    bench: "tcp_stream".into(),
                    ranks: 2,
                    bytes: Some(size as u64),
                    iters: ops as u64,
                    lat_us: 0.0,
                    p99_us: 0.0,
                    gbps: Some(gbps(ops * size, d)),
                    extra,
                });
            }
            let mut b = [0u8; 8];
            let mut lat = Vec::with_capacity(PINGS);
            for _ in 0..PINGS {
                let start = Instant::now();
                s.write_all(&b).map_err(|e| Error::io("baseline ping", e))?;
                s.read_exact(&mut b).map_err(|e| Error::io("baseline pong", e))?;
                lat.push(start.elapsed());
            }
            let mut row = latency_row(
                "tcp_pingpong",
                Some(8),
                &mut lat[PINGS / 10..],
                "baseline: 8-byte TCP round trip between the two processes",
            );
            row.ranks = 2;
            rows.push(row);
        }
    }

    // Same-host baselines: memcpy, and process_vm_writev straight into the peer's heap buffer.
    let whereabouts = format!("{} {}", std::process::id(), mems[0].0.data_ptr() as usize);
    let places = group.all_gather_bytes("whereabouts", whereabouts.as_bytes())?;
    if same_host && me == 0 {
        let place = String::from_utf8_lossy(&places[1]).into_owned();
        let mut it = place.split(' ').map(|v| v.parse::<usize>().unwrap_or(0));
        let (pid, addr) = (it.next().unwrap_or(0) as i32, it.next().unwrap_or(0));
        let src = vec![3u8; max];
        let mut dst = vec![0u8; max];
        for &size in sizes {
            for (name, note) in [
                ("memcpy", "baseline: memcpy between two buffers of one process"),
                ("process_vm_writev", "baseline: process_vm_writev into the peer's buffer"),
            ] {
                let mut copy = || -> Result<()> {
                    if name == "memcpy" {
                        dst[..size].copy_from_slice(&src[..size]);
                        std::hint::black_box(&dst);
                        Ok(())
                    } else {
                        symmem::internals::cma_write(pid, &src[..size], addr)
                            .map_err(|e| Error::InvalidArgument(format!("process_vm_writev baseline: {e}")))
                    }
                };
                let iters = ops_for(size, 64 << 20, 5, 2000);
                let mut lat = Vec::with_capacity(iters);
                for i in 0..iters + iters / 10 {
                    let s = Instant::now();
                    copy()?;
                    if i >= iters / 10 {
                        lat.push(s.elapsed());
                    }
                }
                let ops = ops_for(size, 1 << 30, 16, 20_000);
                let start = Instant::now();
                for _ in 0..ops {
                    copy()?;
                }
                let d = start.elapsed();
                let (median, p99) = percentiles(&mut lat);
                let mut extra = serde_json::Map::new();
                extra.insert("note".into(), note.into());
                rows.push(BenchResult {
                    bench: name.into(),
                    ranks: 2,
                    bytes: Some(size as u64),
                    iters: iters as u64,
                    lat_us: median,
                    p99_us: p99,
                    gbps: Some(gbps(ops * size, d)),
                    extra,
                });
            }
        }
    }
    group.barrier(t)?;

    if me == 0 {
        for (k, kind) in kinds.iter().enumerate() {
            let (mem, remote) = (&mems[k].1, &theirs[k]);
            for &size in sizes {
                for dir in ["write", "read"] {
                    let run = || -> Result<symmem::transport::Work> {
                        // Like the baselines, every transfer targets the same region.
                        let r = remote.slice(0, size as u64)?;
                        if dir == "write" {
                            transport.start_write(&mem.to_view(0, Some(size))?, &r, Some(t))
                        } else {
                            transport.start_read(&mem.to_mutable_view(0, Some(size))?, &r, Some(t))
                        }
                    };
                    // Latency: one transfer at a time.
                    let iters = ops_for(size, 64 << 20, 5, 2000);
                    let mut lat = Vec::with_capacity(iters);
                    for i in 0..iters + iters / 10 {
                        let s = Instant::now();
                        run()?.wait(None)?;
                        if i >= iters / 10 {
                            lat.push(s.elapsed());
                        }
                    }
                    let (median, p99) = percentiles(&mut lat);
                    // Bandwidth: `window` transfers in flight.
                    let ops = ops_for(size, 1 << 30, 16, 20_000);
                    let start = Instant::now();
                    let mut inflight = std::collections::VecDeque::with_capacity(window);
                    for _ in 0..ops {
                        if inflight.len() == window
                            && let Some(w) = inflight.pop_front()
                        {
                            symmem::transport::Work::wait(&w, None)?;
                        }
                        inflight.push_back(run()?);
                    }
                    for w in inflight {
                        w.wait(None)?;
                    }
                    let d = start.elapsed();
                    let mut extra = serde_json::Map::new();
                    extra.insert("backend".into(), transport.describe().into());
                    extra.insert("memory".into(), (*kind).into());
                    extra.insert("window".into(), window.into());
                    extra.insert("ops_per_s".into(), (ops as f64 / d.as_secs_f64()).round().into());
                    rows.push(BenchResult {
                        bench: dir.into(),
                        ranks: 2,
                        bytes: Some(size as u64),
                        iters: iters as u64,
                        lat_us: median,
                        p99_us: p99,
                        gbps: Some(gbps(ops * size, d)),
                        extra,
                    });
                }
            }
        }
    }
    group.barrier(Duration::from_secs(600))?;
    transport.close(Some(t))?;
    if me == 0 { report(&rows) } else { Ok(()) }
}

/// What `symmem bench <collective>` measures.
#[derive(Clone, Debug)]
pub struct OpBenchOptions {
    /// `all_reduce`, `all_gather`, `reduce_scatter` or `all_to_all`.
    pub op: String,
    /// For all-reduce: `one_shot`, `two_shot` or `auto`.
    pub algo: String,
    /// Ranks to launch.
    pub ranks: usize,
    /// Message sizes in bytes (all-reduce: the tensor; all-gather: the gathered output;
    /// reduce-scatter and all-to-all: the input), as nccl-tests counts them.
    pub sizes: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Timed iterations per size (fewer for large sizes).
    pub iters: usize,
    /// Untimed iterations first.
    pub warmup: usize,
    /// The `symmem` executable to launch ranks of.
    pub exe: std::path::PathBuf,
    /// Hosts to play (`--hosts`): the ranks are split evenly over them, and ranks on
    /// different "hosts" reach each other through the tcp transport.
    pub hosts: usize,
}

use symmem::tensor::DType;

/// nccl-tests' bus-bandwidth factor for `op` on `n` ranks.
fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        _ => (n - 1.0) / n,
    }
}

/// Latency and bandwidth of a collective across launched ranks.
pub fn collective(options: &OpBenchOptions, mut emit: impl FnMut(BenchResult)) -> Result<()> {
    let sizes = options.sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let args: Vec<std::ffi::OsString> = vec![
        "__bench-op-rank".into(),
        "--op".into(),
        options.op.clone().into(),
        "--algo".into(),
        options.algo.clone().into(),
        "--dtype".into(),
        options.dtype.to_string().into(),
        "--iters".into(),
        options.iters.to_string().into(),
        "--warmup".into(),
        options.warmup.to_string().into(),
        "--sizes".into(),
        sizes.into(),
    ];
    launch_bench(&options.exe, args, options.ranks, options.hosts, Duration::from_secs(1200), &mut emit)
}

/// Parses `float32`, `f32`, `bf16`, ... into a dtype.
pub fn parse_dtype(s: &str) -> Result<DType> {
    let s = s.to_ascii_lowercase();
    DType::ALL
        .into_iter()
        .find(|d| d.to_string() == s || format!("{d:?}").to_ascii_lowercase() == s)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown dtype {s:?}")))
}

/// One rank of `symmem bench <collective>`.
pub fn collective_rank(op: &str, algo: &str, dtype: DType, iters: usize, warmup: usize, sizes: &[usize]) -> Result<()> {
    use symmem::ops::{self, ReduceOp};
    use symmem::symm::{self, Device};
    use symmem::tensor::Tensor;
    let group = symmem::Group::from_env()?;
    let ws = group.world_size();
    let es = dtype.size();
    let mut rows = Vec::new();
    for &size in sizes {
        // Elements per rank's input, rounded to what every operator accepts.
        let aligned = es.max(4) / es;
        let unit = if matches!(op, "reduce_scatter" | "all_to_all" | "all_to_all_v") { aligned * ws } else { aligned };
        let numel = match op {
            "all_gather" => (size / es / ws).max(1),
            _ => (size / es).div_ceil(unit).max(1) * unit,
        };
        let input = symm::empty(&[numel], dtype, Device::Cpu)?;
        // all_to_all_v: equal splits of rows (one element each), through the vdev operator.
        let splits = symm::empty(&[ws], DType::I64, Device::Cpu)?;
        splits.fill((numel / ws) as i64)?;
        let splits_out = Tensor::zeros(&[2, ws], DType::I64)?;
        let out_len = match op {
            "all_gather" => numel * ws,
            "reduce_scatter" => numel / ws,
            _ => numel,
        };
        let out = Tensor::zeros(&[out_len], dtype)?;
        let run = || -> Result<()> {
            match (op, algo) {
                ("all_reduce", "one_shot") => ops::one_shot_all_reduce_out(&input, ReduceOp::Sum, &group, &out),
                ("all_reduce", "two_shot") => ops::two_shot_all_reduce_(&input, ReduceOp::Sum, &group),
                ("all_reduce", _) => ops::all_reduce(&input, ReduceOp::Sum, &group),
                ("all_gather", _) => ops::all_gather_into(&input, &group, &out),
                ("reduce_scatter", _) => ops::reduce_scatter_out(&input, ReduceOp::Sum, &group, false, &out),
                ("all_to_all", _) => ops::all_to_all(&input, &out, &group),
                ("all_to_all_v", _) => ops::all_to_all_vdev(&input, &out, &splits, &splits_out, &group),
                (other, _) => Err(Error::InvalidArgument(format!("unknown collective {other:?}"))),
            }
        };
        let n_iters = ops_for(size, 256 << 20, 10, iters);
        for _ in 0..warmup.min(n_iters) {
            run()?;
        }
        let mut lat = Vec::with_capacity(n_iters);
        let start = Instant::now();
        for _ in 0..n_iters {
            let t = Instant::now();
            run()?;
            lat.push(t.elapsed());
        }
        let total = start.elapsed();
        let bytes = match op {
            "all_gather" => numel * ws * es,
            _ => numel * es,
        };
        let (median, p99) = percentiles(&mut lat);
        let algbw = bytes as f64 / (median / 1e6) / 1e9;
        let mut extra = serde_json::Map::new();
        let hosts = symmem::config::hosts();
        let used = match (op, algo) {
            ("all_reduce", "auto") => symmem::ops::all_reduce::select(bytes, ws, ws.div_ceil(hosts), hosts).name(),
            ("all_reduce", a) => a,
            ("all_to_all", _) => symmem::ops::all_to_all::select(bytes, hosts).name(),
            _ => "pull",
        };
        extra.insert("algo".into(), used.into());
        extra.insert("hosts".into(), (hosts as u64).into());
        extra.insert("dtype".into(), dtype.to_string().into());
        extra.insert("busbw_gbps".into(), (algbw * bus_factor(op, ws)).into());
        extra.insert("ops_per_s".into(), (n_iters as f64 / total.as_secs_f64()).round().into());
        rows.push(BenchResult {
            bench: op.into(),
            ranks: ws,
            bytes: Some(bytes as u64),
            iters: n_iters as u64,
            lat_us: median,
            p99_us: p99,
            gbps: Some(algbw),
            extra,
        });
    }
    group.barrier(Duration::from_secs(60))?;
    if group.rank() == 0 { report(&rows) } else { Ok(()) }
}

/// The font the plots use (Debian's fonts-dejavu-core).
pub const PLOT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Draws latency and bandwidth against message size, one line per (bench, algo), into `path`
/// (`.svg`, or `.png`).
pub fn plot(rows: &[BenchResult], path: &std::path::Path) -> Result<()> {
    use plotters::prelude::*;
    static FONT: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    FONT.get_or_init(|| {
        let bytes =
            std::fs::read(PLOT_FONT).map_err(|e| format!("read {PLOT_FONT} (install fonts-dejavu-core): {e}"))?;
        // The font must live as long as the process: plotters keeps a reference to it.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| "register the plot font".to_string())
    })
    .clone()
    .map_err(Error::InvalidArgument)?;
    let mut series: PlotSeries = Vec::new();
    for r in rows {
        let Some(bytes) = r.bytes.filter(|&b| b > 0) else { continue };
        let label = match r.extra.get("algo").and_then(|a| a.as_str()) {
            Some(a) => format!("{} ({a})", r.bench),
            None => r.bench.clone(),
        };
        let bw = r.extra.get("busbw_gbps").and_then(|v| v.as_f64()).or(r.gbps).unwrap_or(0.0);
        let point = (bytes as f64, r.lat_us.max(1e-3), bw.max(1e-6));
        match series.iter_mut().find(|(l, _)| *l == label) {
            Some((_, v)) => v.push(point),
            None => series.push((label, vec![point])),
        }
    }
    let pts = || series.iter().flat_map(|(_, v)| v.iter());
    let (x0, x1) = pts().fold((f64::MAX, 1.0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (l0, l1) = pts().fold((f64::MAX, 0.0f64), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let (b0, b1) = pts().fold((f64::MAX, 0.0f64), |(a, b), p| (a.min(p.2), b.max(p.2)));
    if series.is_empty() {
        return Err(Error::InvalidArgument("nothing to plot: no result has a message size".into()));
    }
    let bounds = [x0, x1, l0, l1, b0, b1];
    let result = if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("png")) {
        draw_plot(BitMapBackend::new(path, (1200, 480)).into_drawing_area(), &series, bounds)
    } else {
        draw_plot(SVGBackend::new(path, (1200, 480)).into_drawing_area(), &series, bounds)
    };
    result.map_err(|e| Error::InvalidArgument(format!("plot {}: {e}", path.display())))
}

/// Series of (size, latency, bandwidth) points, by label.
type PlotSeries = Vec<(String, Vec<(f64, f64, f64)>)>;

fn draw_plot<DB: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    series: &PlotSeries,
    [x0, x1, l0, l1, b0, b1]: [f64; 6],
) -> std::result::Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;
    root.fill(&WHITE)?;
    let halves = root.split_evenly((1, 2));
    for (k, area) in halves.iter().enumerate() {
        let (title, lo, hi) = if k == 0 { ("median latency (us)", l0, l1) } else { ("bandwidth (GB/s)", b0, b1) };
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d((x0 * 0.8..x1 * 1.25).log_scale(), (lo * 0.8..hi * 1.25).log_scale())?;
        chart.configure_mesh().x_desc("message size (bytes)").label_style(("sans-serif", 12)).draw()?;
        for (i, (label, v)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let line: Vec<(f64, f64)> = v.iter().map(|p| (p.0, if k == 0 { p.1 } else { p.2 })).collect();
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
                .label(label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            chart.draw_series(line.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()?;
    }
    root.present()?;
    Ok(())
}
