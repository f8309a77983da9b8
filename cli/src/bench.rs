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

/// One result line, in nccl-tests' and OSU's terms.
///
/// `time_us` is the median time of one operation (one at a time), `p99_us` its 99th
/// percentile; `algbw` is `size / time_us` and `busbw` is `algbw` times nccl-tests' factor for
/// the collective ([`bus_factor`]), both in GB/s (10^9 bytes per second). `stream_gbps` (in
/// `extra`) is the bandwidth of transfers issued back to back, `window` of them in flight.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResult {
    /// What was measured, e.g. `all_reduce`, `write` or `store_set`.
    pub bench: String,
    /// Ranks (or concurrent clients) taking part.
    pub ranks: usize,
    /// Hosts (played on this machine) the ranks span.
    pub hosts: usize,
    /// Message size in bytes, where one applies.
    pub size: Option<u64>,
    /// Elements per message, where a dtype applies.
    pub count: Option<u64>,
    /// Element type, where one applies.
    pub dtype: Option<String>,
    /// Measured iterations (per rank).
    pub iters: u64,
    /// Median time of one operation, microseconds.
    pub time_us: f64,
    /// 99th-percentile time of one operation, microseconds (absent for streams).
    pub p99_us: Option<f64>,
    /// Algorithm bandwidth, `size / time_us`, GB/s.
    pub algbw: Option<f64>,
    /// Bus bandwidth, `algbw` times the collective's factor, GB/s.
    pub busbw: Option<f64>,
    /// Anything else worth reporting (`algo`, `backend`, `memory`, `window`, `stream_gbps`,
    /// `ops_per_s`, `note`, ...).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl BenchResult {
    /// A timing row without a message size.
    pub fn timing(bench: &str, ranks: usize, iters: usize, time_us: f64, p99_us: f64) -> BenchResult {
        BenchResult {
            bench: bench.into(),
            ranks,
            hosts: 1,
            size: None,
            count: None,
            dtype: None,
            iters: iters as u64,
            time_us,
            p99_us: Some(p99_us),
            algbw: None,
            busbw: None,
            extra: serde_json::Map::new(),
        }
    }

    /// Adds the message size, and the bandwidths it implies (`factor`: the bus factor).
    pub fn sized(mut self, size: usize, factor: f64) -> BenchResult {
        self.size = Some(size as u64);
        let algbw = if self.time_us > 0.0 { size as f64 / (self.time_us * 1e3) } else { 0.0 };
        self.algbw = Some(algbw);
        self.busbw = Some(algbw * factor);
        self
    }

    /// Sets the host count the row is for.
    pub fn with_hosts(mut self, hosts: usize) -> BenchResult {
        self.hosts = hosts;
        self
    }

    /// Adds an extra field.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> BenchResult {
        self.extra.insert(key.into(), value.into());
        self
    }
}

/// The fields every row has, in the order tables and CSV print them.
pub const FIELDS: [&str; 11] =
    ["bench", "ranks", "hosts", "size", "count", "dtype", "iters", "time_us", "p99_us", "algbw", "busbw"];

/// The extra fields CSV gives columns of (a row's other extras are left out of CSV).
pub const CSV_EXTRA: [&str; 6] = ["algo", "backend", "memory", "window", "stream_gbps", "ops_per_s"];

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
    emit(group_barrier(&addr, &copts, options.ops_per_client)?);
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

fn latency_row(bench: &str, lat: &mut [Duration], note: &str) -> BenchResult {
    let iters = lat.len();
    let total: Duration = lat.iter().sum();
    let (median, p99) = percentiles(lat);
    BenchResult::timing(bench, 1, iters, median, p99)
        .with("ops_per_s", (iters as f64 / total.as_secs_f64()).round())
        .with("note", note)
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
    Ok(latency_row("tcp_pingpong", &mut lat, "baseline: blocking 8-byte TCP round trip, two threads"))
}

/// `read_exact` on a non-blocking socket, busy-polling for the bytes.
fn spin_read_exact(mut s: &std::net::TcpStream, mut buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::{ErrorKind, Read};
    while !buf.is_empty() {
        match s.read(buf) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` on a non-blocking socket, busy-polling for room.
fn spin_write_all(mut s: &std::net::TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    use std::io::{ErrorKind, Write};
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
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
    Ok(latency_row("store_add_sync", &mut lat, "TcpStore::add, the path a rank uses"))
}

/// `Group::barrier` of two ranks (threads, each with its own connection): what the demo and
/// the launcher's rendezvous wait on. One round trip is the floor.
fn group_barrier(addr: &str, options: &ClientOptions, iters: usize) -> Result<BenchResult> {
    use std::sync::Arc;
    let run = |rank: usize| -> Result<Vec<Duration>> {
        let store: Arc<dyn symmem::store::Store> = Arc::new(symmem::store::TcpStore::connect(addr, options.clone())?);
        let g = symmem::Group::new(rank, 2, Arc::new(symmem::store::PrefixStore::new("bench/barrier", store)))?;
        let mut lat = Vec::with_capacity(iters);
        for i in 0..iters + iters / 10 {
            let t = Instant::now();
            g.barrier(Duration::from_secs(60))?;
            if i >= iters / 10 {
                lat.push(t.elapsed());
            }
        }
        Ok(lat)
    };
    let mut lat = std::thread::scope(|s| {
        let other = s.spawn(|| run(1));
        let mine = run(0);
        other.join().map_err(|_| Error::InvalidArgument("barrier benchmark thread panicked".into()))??;
        mine
    })?;
    let mut row = latency_row("store_barrier", &mut lat, "Group::barrier of 2 ranks through TcpStore");
    row.ranks = 2;
    Ok(row)
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
    let note = match op {
        Op::Set => "set+check round trip",
        Op::Get => "wait+get, as torch's get",
        Op::Add => "add",
    };
    let name = match op {
        Op::Set => "store_set",
        Op::Get => "store_get",
        Op::Add => "store_add",
    };
    let mut row = BenchResult::timing(name, clients, ops, median, p99)
        .with("ops_per_s", ((clients * ops) as f64 / wall.as_secs_f64()).round())
        .with("note", format!("{note}; ops_per_s over all clients"));
    if !matches!(op, Op::Add) {
        row.size = Some(value_bytes as u64);
    }
    Ok(row)
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
    Ok(BenchResult::timing(how.name(), n, 1, median, p99)
        .with("total_ms", wall.as_secs_f64() * 1e3)
        .with("ops_per_s", (requests as f64 / wall.as_secs_f64()).round())
        .with("record_bytes", record_bytes))
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
        // 8 ranks of a 56-CPU host, each bound to its 7 CPUs.
        cpus: vec![[(rank % 8 * 7) as u32, (rank % 8 * 7 + 6) as u32]],
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

/// Who links to whom across hosts, for [`link_setup`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayout {
    /// Today's: every rank to every rank on another host (`symm/remote.rs`).
    AllPairs,
    /// The plan (`docs/many-hosts.md`): each host's leader to every other leader, the other
    /// ranks none (they reach their leader through shared memory).
    Leaders,
}

impl LinkLayout {
    fn name(self) -> &'static str {
        match self {
            LinkLayout::AllPairs => "links_all_pairs",
            LinkLayout::Leaders => "links_leaders",
        }
    }

    /// The ranks that link, and the peers each links to, among `hosts` hosts of `per_host`.
    fn peers(self, hosts: usize, per_host: usize) -> Vec<(usize, Vec<usize>)> {
        let ranks = hosts * per_host;
        match self {
            LinkLayout::AllPairs => {
                (0..ranks).map(|r| (r, (0..ranks).filter(|&p| p / per_host != r / per_host).collect())).collect()
            }
            LinkLayout::Leaders => (0..hosts)
                .map(|h| (h * per_host, (0..hosts).filter(|&o| o != h).map(|o| o * per_host).collect()))
                .collect(),
        }
    }
}

/// A link's URL as a rank publishes it (a tcp endpoint with its flows and token).
fn link_url(rank: usize, peer: usize) -> Vec<u8> {
    format!(
        "tcp://10.{}.{}.{}:{}?flows=4&token={:032x}",
        rank >> 16 & 255,
        rank >> 8 & 255,
        rank & 255,
        40_000 + peer % 20_000,
        rank * 7919 + peer
    )
    .into_bytes()
}

/// Threads and descriptors a rank holds with `remote` peers on other hosts over links of
/// `flows` flows, today's transports (one tcp transport per peer, with a listener and an
/// accept thread, and a sender, a receiver and a serving thread per flow: measured by
/// `bench/xhost_resources.sh`, docs/many-hosts.md sections 1 and 4: 2 + 13 threads and about
/// 33 descriptors per peer with 4 flows, 2 + 4 and about 12 with 1).
fn rank_resources(remote: usize, flows: usize) -> (usize, usize) {
    (2 + (1 + 3 * flows) * remote, (5 + 7 * flows) * remote)
}

/// `symmem bench link-setup`: the link rendezvous of `hosts` simulated hosts of `per_host`
/// ranks (each linking rank one store connection and task, in this process) through a real
/// local store, as `symm/remote.rs` runs it: one MULTI_SET of the rank's link URLs, one
/// WAIT+MULTI_GET of its peers' URLs for it, one DELETE_MANY once all are read; in
/// [`LinkLayout::AllPairs`] up to `all_pairs_max` ranks, and [`LinkLayout::Leaders`]. Each row
/// gives the time, the keys the store held at once, and what a linking rank would hold with
/// today's transports (per-rank threads and descriptors, from measured costs); then, for the
/// largest host count asked, today's layout extrapolated from the largest measured one at its
/// keys per second (a model: a store of that many keys was not run).
pub fn link_setup(
    hosts: &[usize],
    per_host: usize,
    all_pairs_max: usize,
    mut emit: impl FnMut(BenchResult),
) -> Result<()> {
    let per_host = per_host.max(1);
    // Arguments from the command line: the largest layout's ranks and all-pairs keys (ranks ×
    // ranks) must be countable before anything is simulated or modelled.
    if let Some(&h) = hosts.iter().find(|&&h| h.checked_mul(per_host).and_then(|r| r.checked_mul(r)).is_none()) {
        return Err(Error::InvalidArgument(format!(
            "--hosts {h} with --per-host {per_host}: too many ranks to count their links"
        )));
    }
    symmem::internals::raise_fd_limit();
    let server = StoreServer::start("127.0.0.1:0", ServerOptions::default())?;
    let addr = server.local_addr().to_string();
    let copts = ClientOptions { timeout: Duration::from_secs(600), secret: None };
    symmem::internals::block_on(async {
        let mut run = 0u64;
        // Keys per second of the largest all-pairs run, for the model.
        let mut rate: Option<(usize, f64)> = None;
        for &h in hosts {
            for layout in [LinkLayout::AllPairs, LinkLayout::Leaders] {
                if h < 2 || layout == LinkLayout::AllPairs && h * per_host > all_pairs_max {
                    continue;
                }
                run += 1;
                let row = link_run(&addr, &copts, h, per_host, layout, run).await?;
                if layout == LinkLayout::AllPairs {
                    let keys = row.extra.get("keys").and_then(serde_json::Value::as_u64).unwrap_or(0) as usize;
                    let ms = row.extra.get("total_ms").and_then(serde_json::Value::as_f64).unwrap_or(0.0);
                    if ms > 0.0 {
                        rate = Some((h, keys as f64 / (ms / 1e3)));
                    }
                }
                emit(row);
            }
        }
        if let (Some(&top), Some((measured, keys_per_s))) = (hosts.iter().max(), rate)
            && top * per_host > all_pairs_max
        {
            let ranks = top * per_host;
            let remote = ranks - per_host;
            let keys = ranks * remote;
            let (threads, fds) = rank_resources(remote, symmem::internals::tcp_link_flows(top));
            let secs = keys as f64 / keys_per_s;
            emit(
                BenchResult::timing("links_all_pairs_model", ranks, 1, secs * 1e6, secs * 1e6)
                    .with_hosts(top)
                    .with("total_ms", secs * 1e3)
                    .with("keys", keys)
                    .with("rank_threads", threads)
                    .with("rank_fds", fds)
                    .with("note", format!("extrapolated at {keys_per_s:.0} keys/s measured on {measured} hosts")),
            );
        }
        Ok::<_, Error>(())
    })?;
    drop(server);
    Ok(())
}

async fn link_run(
    addr: &str,
    options: &ClientOptions,
    hosts: usize,
    per_host: usize,
    layout: LinkLayout,
    run: u64,
) -> Result<BenchResult> {
    let linking = layout.peers(hosts, per_host);
    let conns = connect_all(addr, options, linking.len()).await?;
    let start_line = Arc::new(tokio::sync::Barrier::new(linking.len() + 1));
    let read = Arc::new(tokio::sync::Barrier::new(linking.len()));
    let keys: usize = linking.iter().map(|(_, p)| p.len()).sum();
    let most = linking.iter().map(|(_, p)| p.len()).max().unwrap_or(0);
    let mut tasks = Vec::new();
    for (mut c, (me, peers)) in conns.into_iter().zip(linking) {
        let (start_line, read) = (start_line.clone(), read.clone());
        tasks.push(tokio::spawn(async move {
            let mine: Vec<(String, Vec<u8>)> =
                peers.iter().map(|&p| (format!("symm-net/{run}/{me}/{p}"), link_url(me, p))).collect();
            let theirs: Vec<String> = peers.iter().map(|&p| format!("symm-net/{run}/{p}/{me}")).collect();
            start_line.wait().await;
            let t = Instant::now();
            let pairs: Vec<(&str, &[u8])> = mine.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
            c.multi_set(&pairs).await?;
            let refs: Vec<&str> = theirs.iter().map(String::as_str).collect();
            let got = c.multi_get(&refs, Duration::from_secs(600)).await?;
            debug_assert_eq!(got.len(), peers.len());
            // Every peer read this rank's URLs (it connected) before they go.
            read.wait().await;
            let own: Vec<&str> = mine.iter().map(|(k, _)| k.as_str()).collect();
            c.delete_many(&own).await?;
            Ok::<_, Error>(t.elapsed())
        }));
    }
    start_line.wait().await;
    let t0 = Instant::now();
    let mut lat = Vec::with_capacity(tasks.len());
    for t in tasks {
        lat.push(t.await.map_err(join_error)??);
    }
    let wall = t0.elapsed();
    let ranks = lat.len();
    let (median, p99) = percentiles(&mut lat);
    let (threads, fds) = rank_resources(most, symmem::internals::tcp_link_flows(hosts));
    Ok(BenchResult::timing(layout.name(), hosts * per_host, 1, median, p99)
        .with_hosts(hosts)
        .with("linking_ranks", ranks)
        .with("total_ms", wall.as_secs_f64() * 1e3)
        .with("keys", keys)
        .with("requests", 3 * ranks)
        .with("rank_threads", threads)
        .with("rank_fds", fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn benchmark_sizes_are_ones_the_operators_accept() {
        // 8 B of f32 on 2 ranks: reduce-scatter takes whole 16-byte vectors per rank (8
        // elements), the all-to-alls a multiple of the ranks, all-reduce whole words.
        assert_eq!(bench_numel("reduce_scatter", 8, 4, 2), 8);
        assert_eq!(bench_numel("reduce_scatter", 8, 2, 3), 24);
        assert_eq!(bench_numel("all_to_all", 8, 4, 2), 2);
        assert_eq!(bench_numel("all_reduce", 8, 4, 2), 2);
        assert_eq!(bench_numel("all_reduce", 2, 2, 2), 2, "a bf16 all-reduce of whole words");
        assert_eq!(bench_numel("all_gather", 64, 4, 8), 2);
        for ws in 1..=9 {
            for es in [1, 2, 4, 8] {
                for size in [1, 8, 100, 4096, 65_540] {
                    let n = bench_numel("reduce_scatter", size, es, ws);
                    assert!(n * es >= size.min(16 * ws) && (n * es).is_multiple_of(16 * ws), "{size} B, {es}, {ws}");
                }
            }
        }
    }

    #[test]
    fn link_layouts_link_ranks_on_other_hosts_only() {
        // 3 hosts of 2: ranks {0,1}, {2,3}, {4,5}.
        let all = LinkLayout::AllPairs.peers(3, 2);
        assert_eq!(all.len(), 6);
        assert_eq!(all[1], (1, vec![2, 3, 4, 5]));
        assert_eq!(all.iter().map(|(_, p)| p.len()).sum::<usize>(), 6 * 4);
        let leaders = LinkLayout::Leaders.peers(3, 2);
        assert_eq!(leaders, vec![(0, vec![2, 4]), (2, vec![0, 4]), (4, vec![0, 2])]);
        // Every link is published by one side and read by the other: the pairs are symmetric.
        for layout in [LinkLayout::AllPairs, LinkLayout::Leaders] {
            let links = layout.peers(4, 3);
            for (me, peers) in &links {
                for p in peers {
                    let theirs = &links.iter().find(|(r, _)| r == p).unwrap().1;
                    assert!(theirs.contains(me), "{layout:?}: {me} links {p} but not back");
                }
            }
        }
        assert_eq!(rank_resources(7, 4), (93, 231), "8 hosts of one rank, 4 flows: section 1's measured 93 threads");
        assert_eq!(rank_resources(7, 1).0, 30, "8 hosts of one rank, 1 flow: section 4's measured 30 threads");
    }

    #[test]
    fn pinning_stays_inside_the_cpus_the_thread_may_use() {
        let cpus = |s: &rustix::thread::CpuSet| {
            (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| s.is_set(c)).collect::<Vec<_>>()
        };
        let allowed = cpus(&rustix::thread::sched_getaffinity(None).unwrap());
        // A thread held (as by `taskset`) on the last CPU it may use, then pinned as rank 0, 1
        // and 2: it stays there, never moved to CPU 0 outside its mask.
        let last = *allowed.last().unwrap();
        std::thread::spawn(move || {
            let mut only = rustix::thread::CpuSet::new();
            only.set(last);
            rustix::thread::sched_setaffinity(None, &only).unwrap();
            for rank in 0..3 {
                assert!(pin_to_cpu(rank));
                assert_eq!(cpus(&rustix::thread::sched_getaffinity(None).unwrap()), [last], "rank {rank}");
            }
        })
        .join()
        .unwrap();
        // Unrestricted, rank i goes to the i-th CPU it may use, round.
        std::thread::spawn(move || {
            for rank in 0..allowed.len() + 1 {
                assert!(pin_to_cpu(rank));
                let on = cpus(&rustix::thread::sched_getaffinity(None).unwrap());
                assert_eq!(on, [allowed[rank % allowed.len()]], "rank {rank}");
                let mut back = rustix::thread::CpuSet::new();
                allowed.iter().for_each(|&c| back.set(c));
                rustix::thread::sched_setaffinity(None, &back).unwrap();
            }
        })
        .join()
        .unwrap();
    }

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
    /// Hosts to play for the signal runs (the flag baseline stays on one host).
    pub hosts: usize,
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
    launch.env.push((symmem::config::env::OMP_NUM_THREADS.into(), "1".into()));
    launch.timeout = Some(timeout);
    // The job runs on a thread of its own; this one hands on every row as soon as it lands.
    let job = std::thread::spawn(move || symmem::launch::run_hosts(&launch, hosts));
    // Reads only what was appended since the last look; a row still being written (no newline
    // yet) waits in `partial` for the rest.
    let mut file: Option<std::fs::File> = None;
    let mut partial = Vec::new();
    let mut drain = |last: bool| -> Result<()> {
        use std::io::Read;
        if file.is_none() {
            match std::fs::File::open(&out) {
                Ok(f) => file = Some(f),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(Error::io(format!("open {}", out.display()), e)),
            }
        }
        if let Some(f) = &mut file {
            f.read_to_end(&mut partial).map_err(|e| Error::io(format!("read {}", out.display()), e))?;
        }
        let end = if last { partial.len() } else { partial.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) };
        let whole: Vec<u8> = partial.drain(..end).collect();
        for line in String::from_utf8_lossy(&whole).lines().filter(|l| !l.trim().is_empty()) {
            emit(serde_json::from_str(line).map_err(|e| Error::InvalidArgument(format!("bad result {line:?}: {e}")))?);
        }
        Ok(())
    };
    let mut result = Ok(());
    while !job.is_finished() {
        std::thread::sleep(Duration::from_millis(50));
        if result.is_ok() {
            result = drain(false);
        }
    }
    let outcome = job.join().map_err(|_| Error::InvalidArgument("the benchmark launcher panicked".into()));
    let result = result.and_then(|()| {
        let outcome = outcome??;
        if outcome != symmem::launch::Outcome::Success {
            return Err(Error::InvalidArgument(format!("benchmark job of {ranks} ranks failed: {outcome}")));
        }
        drain(true)
    });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Signal ping-pong and barrier latency across launched ranks, next to the floor: a plain
/// atomic-flag ping-pong between two processes. Both ping-pongs run pinned (each process on
/// its own core: the hardware's floor) and unpinned (where the scheduler puts them, as a job
/// runs unless it pins).
///
/// With `hosts` > 1 the signal runs span played hosts (2 ranks: one per host, on two of them;
/// the barrier runs split their ranks over all of them), and the 2-rank ones also time NVSHMEM's put-with-signal and PyTorch's put_signal of 8 bytes across them.
pub fn signal(options: &SignalBenchOptions, mut emit: impl FnMut(BenchResult)) -> Result<()> {
    let iters = options.iters.to_string();
    let hosts = options.hosts.max(1);
    let mut jobs: Vec<(usize, usize, Vec<&str>)> = vec![
        (2, 1, vec!["__bench-flag-rank", "--iters", &iters, "--pin"]),
        (2, 1, vec!["__bench-flag-rank", "--iters", &iters]),
        // Two ranks span at most two hosts, one each.
        (2, hosts.min(2), vec!["__bench-signal-rank", "--iters", &iters, "--pin"]),
    ];
    for &n in &options.ranks {
        jobs.push((n, hosts, vec!["__bench-signal-rank", "--iters", &iters]));
    }
    for (n, hosts, args) in jobs {
        let args = args.into_iter().map(Into::into).collect();
        launch_bench(&options.exe, args, n, hosts, Duration::from_secs(300), &mut emit)?;
    }
    Ok(())
}

fn report(rows: &[BenchResult]) -> Result<()> {
    let mut out = Reporter::new(true)?;
    for r in rows {
        out.row(r.clone())?;
    }
    Ok(())
}

/// Elements of a rank's input for a benchmark of `op` at `size` bytes (as nccl-tests counts
/// them) of `es`-byte elements on `ws` ranks, rounded up to what the operator accepts: whole
/// 4-byte words; a multiple of the ranks where each takes a share; for `reduce_scatter`, whole
/// 16-byte vectors per rank, as PyTorch's kernels (and so symmem's checks) count them.
fn bench_numel(op: &str, size: usize, es: usize, ws: usize) -> usize {
    let aligned = es.max(4) / es;
    let unit = match op {
        "reduce_scatter" => (16 / es).max(1) * ws,
        "reduce_scatter_offset" | "all_to_all" | "all_to_all_v" | "all_to_all_nd" | "matmul_reduce_scatter" => {
            aligned * ws
        }
        _ => aligned,
    };
    match op {
        "all_gather" | "all_gather_matmul" => (size / es / ws).max(1),
        _ => (size / es).div_ceil(unit).max(1) * unit,
    }
}

/// Hands a launched rank's rows to `symmem bench` as each is measured: one JSON line each,
/// appended to the file [`BENCH_OUT_ENV`] names, which the launcher reads as it grows.
struct Reporter {
    file: Option<std::fs::File>,
}

impl Reporter {
    /// Whether this rank reports (`active`), else rows are dropped.
    fn new(active: bool) -> Result<Reporter> {
        if !active {
            return Ok(Reporter { file: None });
        }
        let path = symmem::config::value(BENCH_OUT_ENV)
            .ok_or(Error::Env { var: BENCH_OUT_ENV, reason: "not set (run through `symmem bench`)".into() })?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .map_err(|e| Error::io(format!("open {path:?}"), e))?;
        Ok(Reporter { file: Some(file) })
    }

    fn row(&mut self, r: BenchResult) -> Result<()> {
        use std::io::Write;
        let Some(f) = &mut self.file else { return Ok(()) };
        let mut line = serde_json::to_string(&r).map_err(|e| Error::InvalidArgument(format!("encode a row: {e}")))?;
        line.push('\n');
        // One write per line: the reader never sees half a row followed by another's.
        f.write_all(line.as_bytes()).map_err(|e| Error::io("report a row", e))
    }
}

/// Binds the calling thread to the `i`-th (modulo their count) of the CPUs it may use: under
/// `taskset` or a cgroup those need not be CPUs 0, 1, ...
fn pin_to_cpu(i: usize) -> bool {
    let Ok(mine) = rustix::thread::sched_getaffinity(None) else { return false };
    let allowed: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| mine.is_set(c)).collect();
    let Some(&cpu) = allowed.get(i % allowed.len().max(1)) else { return false };
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).is_ok()
}

fn half_round_trips(mut rtt: Vec<Duration>, name: &str, ranks: usize, note: &str) -> BenchResult {
    for d in &mut rtt {
        *d /= 2;
    }
    let (median, p99) = percentiles(&mut rtt);
    BenchResult::timing(name, ranks, rtt.len(), median, p99).with("note", note)
}

/// Times `iters` round trips between ranks 0 and 1 (after a tenth as many untimed): rank 0
/// sends then receives, the other receives then sends, `send(k)` and `recv(k)` in round k
/// (from 1).
fn ping_pong(
    me: usize,
    iters: usize,
    send: impl Fn(u64) -> Result<()>,
    recv: impl Fn(u64) -> Result<()>,
) -> Result<Vec<Duration>> {
    let mut rtt = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let start = Instant::now();
        let k = i as u64 + 1;
        if me == 0 {
            send(k)?;
            recv(k)?;
        } else {
            recv(k)?;
            send(k)?;
        }
        if i >= iters / 10 {
            rtt.push(start.elapsed());
        }
    }
    Ok(rtt)
}

/// One rank of the signal benchmark (run by `symmem bench signal` through the launcher).
/// `pin`: each rank's thread on its own core, and only the ping-pong is timed. It is pinned
/// once its links to other hosts exist, so their transport threads stay free to run anywhere
/// (pinned with it, they would wait for its spinning to end: 3x slower across played hosts).
pub fn signal_rank(iters: usize, pin: bool) -> Result<()> {
    use symmem::symm::{self, Device};
    use symmem::tensor::DType;
    let group = symmem::Group::from_env()?;
    let (me, ws) = (group.rank(), group.world_size());
    let x = symm::empty(&[64], DType::U8, Device::Cpu)?;
    let h = symm::rendezvous(&x, &group)?;
    let t = Duration::from_secs(60);
    let mut rows = Vec::new();
    h.barrier(0, t)?;
    let pinned = pin && pin_to_cpu(me);
    if ws == 2 {
        let other = 1 - me;
        let rtt = ping_pong(me, iters, |_| h.put_signal(other, 1, t), |_| h.wait_signal(other, 1, t))?;
        rows.push(match (pin, pinned) {
            (false, _) => {
                half_round_trips(rtt, "signal_pingpong", 2, "put_signal+wait_signal, one way (RTT/2), unpinned")
            }
            (true, true) => half_round_trips(
                rtt,
                "signal_pingpong_pinned",
                2,
                "put_signal+wait_signal, one way (RTT/2), the callers pinned to cores 0 and 1",
            ),
            (true, false) => half_round_trips(rtt, "signal_pingpong_pinned", 2, "pinning refused: unpinned"),
        });
        if !pin {
            // 8 bytes of data with their signal, each way: NVSHMEM's put-with-signal (the signal
            // a word the waiter watches) and PyTorch's put_signal (a signal-pad slot).
            let data = symm::empty(&[8], DType::U8, Device::Cpu)?;
            let flag = symm::empty(&[1], DType::I64, Device::Cpu)?;
            let hd = symm::rendezvous(&data, &group)?;
            symm::rendezvous(&flag, &group)?;
            hd.barrier(0, t)?;
            let rtt = ping_pong(
                me,
                iters,
                |k| symm::nvshmem_put_with_signal(&data, &flag, k, other),
                |k| symm::nvshmem_wait_for_signal(&flag, k, other),
            )?;
            rows.push(half_round_trips(
                rtt,
                "put_with_signal_pingpong",
                2,
                "nvshmem_put_with_signal+wait_for_signal of 8 B, one way (RTT/2)",
            ));
            hd.barrier(0, t)?;
            let rtt = ping_pong(me, iters, |_| symm::put_signal(&data, &hd, other), |_| symm::wait_signal(&hd, other))?;
            rows.push(half_round_trips(
                rtt,
                "put_signal_pingpong",
                2,
                "put_signal+wait_signal of 8 B, one way (RTT/2)",
            ));
            hd.barrier(0, t)?;
        }
    }
    let hosts = symmem::config::hosts();
    for row in &mut rows {
        row.hosts = hosts;
    }
    if pin {
        group.barrier(t)?;
        return if me == 0 { report(&rows) } else { Ok(()) };
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
    let (median, p99) = percentiles(&mut lat);
    let mut row =
        BenchResult::timing("barrier", ws, lat.len(), median, p99).with("note", "signal-pad barrier (rank 0's view)");
    row.hosts = hosts;
    rows.push(row);
    group.barrier(t)?;
    if me == 0 { report(&rows) } else { Ok(()) }
}

/// One rank of the baseline: two processes (`pin`: on different cores) bounce a plain atomic
/// flag through shared memory, with nothing else (no protocol, no timeouts, no sleeping).
pub fn flag_rank(iters: usize, pin: bool) -> Result<()> {
    use std::sync::atomic::{AtomicU32, Ordering};

    use symmem::symm::{self, Device};
    use symmem::tensor::DType;
    let group = symmem::Group::from_env()?;
    let me = group.rank();
    let pinned = pin && pin_to_cpu(me);
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
    let (name, note) = match (pin, pinned) {
        (true, true) => ("flag_pingpong", "baseline: atomic flag ping-pong, one way (RTT/2), pinned to cores 0 and 1"),
        (true, false) => ("flag_pingpong", "baseline: atomic flag ping-pong, one way (RTT/2), pinning refused"),
        (false, _) => ("flag_pingpong_unpinned", "baseline: atomic flag ping-pong, one way (RTT/2), unpinned"),
    };
    if me == 0 { report(&[half_round_trips(rtt, name, 2, note)]) } else { Ok(()) }
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
    // `hi` wins over `lo` (a user's `--iters 5` means 5), and at least one always runs.
    (budget / size.max(1)).max(lo).min(hi).max(1)
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
    let mut out = Reporter::new(me == 0)?;

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
            // Echo 8-byte pings, blocking, then busy-polling.
            let mut b = [0u8; 8];
            for _ in 0..PINGS {
                s.read_exact(&mut b).map_err(|e| Error::io("baseline ping", e))?;
                s.write_all(&b).map_err(|e| Error::io("baseline pong", e))?;
            }
            s.set_nonblocking(true).map_err(|e| Error::io("baseline socket", e))?;
            for _ in 0..PINGS {
                spin_read_exact(&s, &mut b).map_err(|e| Error::io("baseline ping", e))?;
                spin_write_all(&s, &b).map_err(|e| Error::io("baseline pong", e))?;
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
                // A stream has no per-message latency: its time is the mean per message.
                let mut row = BenchResult::timing("tcp_stream", 2, ops, d.as_secs_f64() * 1e6 / ops as f64, 0.0)
                    .sized(size, 1.0)
                    .with("stream_gbps", gbps(ops * size, d))
                    .with("note", "baseline: plain TCP stream between the two processes; time is the mean per message");
                row.p99_us = None;
                out.row(row)?;
            }
            // 8-byte round trips, `trip` each, as one row.
            let mut pings = |bench: &str, note: &str, trip: &dyn Fn(&mut [u8; 8]) -> std::io::Result<()>| {
                let mut b = [0u8; 8];
                let mut lat = Vec::with_capacity(PINGS);
                for _ in 0..PINGS {
                    let start = Instant::now();
                    trip(&mut b).map_err(|e| Error::io("baseline ping-pong", e))?;
                    lat.push(start.elapsed());
                }
                let mut row = latency_row(bench, &mut lat[PINGS / 10..], note);
                row.ranks = 2;
                row.extra.remove("ops_per_s");
                out.row(row.sized(8, 1.0))
            };
            pings("tcp_pingpong", "baseline: 8-byte TCP round trip between the two processes", &|b| {
                (&s).write_all(b)?;
                (&s).read_exact(b)
            })?;
            // The same, both sides busy-polling non-blocking sockets as MPI libraries wait: no
            // wake-up of a sleeping thread on the way (on a virtual machine, of a halted vCPU),
            // the floor of any request and reply over TCP here.
            s.set_nonblocking(true).map_err(|e| Error::io("baseline socket", e))?;
            pings(
                "tcp_pingpong_spin",
                "baseline: 8-byte TCP round trip between the two processes, both busy-polling",
                &|b| {
                    spin_write_all(&s, b)?;
                    spin_read_exact(&s, b)
                },
            )?;
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
                out.row(
                    BenchResult::timing(name, 2, iters, median, p99)
                        .sized(size, 1.0)
                        .with("stream_gbps", gbps(ops * size, d))
                        .with("note", note),
                )?;
            }
        }
    }
    group.barrier(t)?;

    if me == 0 {
        for (k, kind) in kinds.iter().enumerate() {
            let (mem, remote) = (&mems[k].1, &theirs[k]);
            for &size in sizes {
                for dir in ["write", "read"] {
                    // Like the baselines, every transfer targets the same region; views and
                    // descriptors are made once, as a program reusing its buffers does.
                    let r = remote.slice(0, size as u64)?;
                    let (view, sink) = (mem.to_view(0, Some(size))?, mem.to_mutable_view(0, Some(size))?);
                    let run = || -> Result<symmem::transport::Work> {
                        if dir == "write" {
                            transport.start_write(&view, &r, Some(t))
                        } else {
                            transport.start_read(&sink, &r, Some(t))
                        }
                    };
                    // Latency: one transfer at a time, through the synchronous call.
                    let iters = ops_for(size, 64 << 20, 5, 2000);
                    let mut lat = Vec::with_capacity(iters);
                    for i in 0..iters + iters / 10 {
                        let s = Instant::now();
                        if dir == "write" {
                            transport.write(&view, &r, Some(t))?;
                        } else {
                            transport.read(&sink, &r, Some(t))?;
                        }
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
                    out.row(
                        BenchResult::timing(dir, 2, iters, median, p99)
                            .sized(size, 1.0)
                            .with("backend", transport.describe())
                            .with("memory", *kind)
                            .with("window", window)
                            .with("stream_gbps", gbps(ops * size, d)),
                    )?;
                }
            }
        }
    }
    group.barrier(Duration::from_secs(600))?;
    transport.close(Some(t))?;
    Ok(())
}

/// What `symmem bench <collective>` measures.
#[derive(Clone, Debug)]
pub struct OpBenchOptions {
    /// `all_reduce`, `all_gather`, `reduce_scatter`, `reduce_scatter_offset`, `all_to_all`,
    /// `all_to_all_v`, `all_to_all_nd`, `all_gather_matmul`, `matmul_reduce_scatter`,
    /// `tile_reduce`, `multi_root_tile_reduce` or `broadcast`.
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
    /// Bind each rank's calling thread to a core (`--pin`).
    pub pin: bool,
}

use symmem::tensor::DType;

/// nccl-tests' bus-bandwidth factor for `op` on `n` ranks.
fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "broadcast" => 1.0,
        _ => (n - 1.0) / n,
    }
}

/// Latency and bandwidth of a collective across launched ranks.
pub fn collective(options: &OpBenchOptions, mut emit: impl FnMut(BenchResult)) -> Result<()> {
    let sizes = options.sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let mut args: Vec<std::ffi::OsString> = vec![
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
    if options.pin {
        args.push("--pin".into());
    }
    launch_bench(&options.exe, args, options.ranks, options.hosts, Duration::from_secs(1200), &mut emit)
}

/// Whether Open MPI's compiler wrapper and launcher are installed.
pub fn have_open_mpi() -> bool {
    let have = |tool: &str| {
        std::process::Command::new(tool)
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    have("mpicc") && have("mpirun")
}

/// The baseline of `symmem bench all-reduce` and `all-to-all` on one host: Open MPI's
/// `MPI_Allreduce` (float sum) or `MPI_Alltoall` at the same sizes and rank count
/// (bench/mpi_allreduce.c, built with `mpicc`), each row handed to `emit` as it is measured.
pub fn open_mpi(op: &str, ranks: usize, sizes: &[usize], emit: &mut dyn FnMut(BenchResult)) -> Result<()> {
    use std::io::BufRead;
    let dir = std::env::temp_dir().join(format!("symmem-bench-mpi-{}", std::process::id()));
    let mut run = || -> Result<()> {
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let src = dir.join("mpi_allreduce.c");
        std::fs::write(&src, include_str!("../../bench/mpi_allreduce.c"))
            .map_err(|e| Error::io("write the MPI source", e))?;
        let bin = dir.join("mpi_allreduce");
        let built = std::process::Command::new("mpicc")
            .args(["-O2", "-o"])
            .arg(&bin)
            .arg(&src)
            .output()
            .map_err(|e| Error::io("run mpicc", e))?;
        if !built.status.success() {
            return Err(Error::InvalidArgument(format!("mpicc failed: {}", String::from_utf8_lossy(&built.stderr))));
        }
        let mut child = std::process::Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", &ranks.to_string()])
            .arg(&bin)
            .args(sizes.iter().map(usize::to_string))
            .env("MPI_BENCH_OP", if op == "all_to_all" { "alltoall" } else { "allreduce" })
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| Error::io("run mpirun", e))?;
        if let Some(out) = child.stdout.take() {
            for line in std::io::BufReader::new(out).lines().map_while(std::result::Result::ok) {
                let Ok(r) = serde_json::from_str::<BenchResult>(&line) else { continue };
                let size = r.size.unwrap_or(0) as usize;
                emit(r.sized(size, bus_factor(op, ranks)));
            }
        }
        let out = child.wait_with_output().map_err(|e| Error::io("wait for mpirun", e))?;
        if !out.status.success() {
            return Err(Error::InvalidArgument(format!(
                "mpirun failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).lines().take(5).collect::<Vec<_>>().join(" / ")
            )));
        }
        Ok(())
    };
    let result = run();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Parses `float32`, `f32`, `bf16`, ... into a dtype.
pub fn parse_dtype(s: &str) -> Result<DType> {
    let s = s.to_ascii_lowercase();
    DType::ALL
        .into_iter()
        .find(|d| d.to_string() == s || format!("{d:?}").to_ascii_lowercase() == s)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown dtype {s:?}")))
}

/// The least time a collective benchmark warms up for before it times its first size. The
/// launched ranks are not bound to cores (torchrun does not bind them either; mpirun does), and
/// their threads take up to ~200 ms after the launch to settle on the cores: until then two
/// spinning ranks may share one. 2 ranks on 2 played hosts, the first 8-byte row of a run took
/// 28-36 us, the same size right after 10.6 (and 36 us with both ranks held on one core).
const SETTLE: Duration = Duration::from_millis(500);

/// Runs `run` (a collective every rank calls) in rounds until every rank has spent [`SETTLE`]
/// here: the ranks agree after each round (the all-reduce of a flag), so all make the same
/// calls.
fn settle(group: &symmem::Group, mut run: impl FnMut() -> Result<()>) -> Result<()> {
    use symmem::symm::{self, Device};
    let t0 = Instant::now();
    let more = symm::empty(&[1], DType::F32, Device::Cpu)?;
    loop {
        for _ in 0..20 {
            run()?;
        }
        more.fill(if t0.elapsed() < SETTLE { 1.0f32 } else { 0.0 })?;
        symmem::ops::all_reduce(&more, symmem::ops::ReduceOp::Max, group)?;
        if more.to_vec::<f32>()?.first().is_none_or(|&v| v == 0.0) {
            return Ok(());
        }
    }
}

/// One rank of `symmem bench <collective>`.
/// `pin`: its calling thread bound to a core of its own once its links exist (rows say
/// whether it was: `pinned` true or false).
pub fn collective_rank(
    op: &str,
    algo: &str,
    dtype: DType,
    iters: usize,
    warmup: usize,
    sizes: &[usize],
    pin: bool,
) -> Result<()> {
    use symmem::ops::{self, ReduceOp};
    use symmem::symm::{self, Device};
    use symmem::tensor::Tensor;
    let group = symmem::Group::from_env()?;
    let ws = group.world_size();
    let es = dtype.size();
    let mut out_rows = Reporter::new(group.rank() == 0)?;
    let mut settled = false;
    let mut pinned = None;
    for &size in sizes {
        let numel = bench_numel(op, size, es, ws);
        // tile_reduce: the left half of a [rows, 2 x cols] symmetric matrix, numel elements.
        let tile_cols = numel.min(256);
        let tile_rows = numel.div_ceil(tile_cols);
        // multi_root_tile_reduce: ws tiles side by side, tile i reduced into rank i's out.
        let tiled = matches!(op, "tile_reduce" | "multi_root_tile_reduce");
        let numel = if tiled { tile_rows * tile_cols } else { numel };
        let input = if op == "tile_reduce" {
            symm::empty(&[tile_rows, 2 * tile_cols], dtype, Device::Cpu)?
        } else if op == "multi_root_tile_reduce" {
            symm::empty(&[tile_rows, ws * tile_cols], dtype, Device::Cpu)?
        } else {
            symm::empty(&[numel], dtype, Device::Cpu)?
        };
        // all_gather_matmul: the gathered [ws, numel] times a [numel, 8] matrix.
        let bmat = if op == "all_gather_matmul" { Some(Tensor::zeros(&[numel, 8], dtype)?) } else { None };
        // matmul_reduce_scatter: a [ws, 8] times [8, numel / ws] product (numel elements),
        // reduce-scattered along its rows.
        let (amat, bwide) = if op == "matmul_reduce_scatter" {
            (Some(Tensor::zeros(&[ws, 8], dtype)?), Some(Tensor::zeros(&[8, numel / ws], dtype)?))
        } else {
            (None, None)
        };
        // all_to_all_v: equal splits of rows (one element each), through the vdev operator.
        let splits = symm::empty(&[ws], DType::I64, Device::Cpu)?;
        splits.fill((numel / ws) as i64)?;
        let splits_out = Tensor::zeros(&[2, ws], DType::I64)?;
        let out_len = match op {
            "all_gather" => numel * ws,
            "reduce_scatter" | "reduce_scatter_offset" => numel / ws,
            _ => numel,
        };
        // all_to_all_v's out is symmetric, as PyTorch's operator requires.
        let out = if op == "all_to_all_v" {
            symm::empty(&[out_len], dtype, Device::Cpu)?
        } else {
            Tensor::zeros(&[out_len], dtype)?
        };
        let run = || -> Result<()> {
            match (op, algo) {
                ("all_reduce", "one_shot") => ops::one_shot_all_reduce_out(&input, ReduceOp::Sum, &group, &out),
                ("all_reduce", "two_shot") => ops::two_shot_all_reduce_(&input, ReduceOp::Sum, &group),
                ("all_reduce", _) => ops::all_reduce(&input, ReduceOp::Sum, &group),
                ("all_gather", _) => ops::all_gather_into(&input, &group, &out),
                ("reduce_scatter", _) => ops::reduce_scatter_out(&input, ReduceOp::Sum, &group, false, &out),
                ("all_to_all", _) => ops::all_to_all(&input, &out, &group),
                ("all_to_all_v", _) => ops::all_to_all_vdev(&input, &out, &splits, &splits_out, &group),
                ("broadcast", _) => ops::broadcast_(&input, 0, &group),
                ("matmul_reduce_scatter", _) => match (&amat, &bwide) {
                    (Some(a), Some(b)) => ops::fused_matmul_reduce_scatter(a, b, ReduceOp::Sum, 0, &group).map(|_| ()),
                    _ => Ok(()),
                },
                ("all_gather_matmul", _) => {
                    let b = bmat.as_slice();
                    ops::fused_all_gather_matmul(&input.view(&[1, numel])?, b, 0, &group, false).map(|_| ())
                }
                // The input as [ws, numel / ws], scattered along its rows, gathered along columns.
                ("all_to_all_nd", _) => {
                    ops::all_to_all_nd(&input.view(&[ws, numel / ws])?, &out.view(&[1, numel])?, 0, 1, &group)
                }
                // The input as [ws, numel / ws], each rank receiving the sum of its row.
                ("reduce_scatter_offset", _) => ops::reduce_scatter_offset(
                    &input.view(&[ws, numel / ws])?,
                    std::slice::from_ref(&out.view(&[1, numel / ws])?),
                    &group,
                    0,
                    None,
                    None,
                    ReduceOp::Sum,
                ),
                ("tile_reduce", _) => ops::tile_reduce(
                    &input.tile(0..tile_rows, 0..tile_cols)?,
                    &out.view(&[tile_rows, tile_cols])?,
                    0,
                    &group,
                    ReduceOp::Sum,
                ),
                ("multi_root_tile_reduce", _) => {
                    let tiles = (0..ws)
                        .map(|i| input.tile(0..tile_rows, i * tile_cols..(i + 1) * tile_cols))
                        .collect::<Result<Vec<_>>>()?;
                    let roots: Vec<usize> = (0..ws).collect();
                    let out = out.view(&[tile_rows, tile_cols])?;
                    ops::multi_root_tile_reduce(&tiles, &out, &roots, &group, ReduceOp::Sum)
                }
                (other, _) => Err(Error::InvalidArgument(format!("unknown collective {other:?}"))),
            }
        };
        let n_iters = ops_for(size, 256 << 20, 10, iters);
        for _ in 0..warmup.min(n_iters) {
            run()?;
        }
        if pin && pinned.is_none() {
            // After the first calls: its links to other hosts exist, and their transport threads
            // stay free to run anywhere (pinned with it, they wait for its spinning to end).
            pinned = Some(pin_to_cpu(group.rank()));
        }
        if !settled {
            settle(&group, &run)?;
            settled = true;
        }
        let mut lat = Vec::with_capacity(n_iters);
        for _ in 0..n_iters {
            let t = Instant::now();
            run()?;
            lat.push(t.elapsed());
        }
        let bytes = match op {
            "all_gather" | "all_gather_matmul" => numel * ws * es,
            _ => numel * es,
        };
        let (mut median, mut p99) = percentiles(&mut lat);
        if op == "broadcast" {
            // The root may finish first: a broadcast takes as long as its slowest rank.
            let worst = symm::empty(&[2], DType::F64, Device::Cpu)?;
            worst.copy_from_slice(&[median, p99])?;
            ops::all_reduce(&worst, ReduceOp::Max, &group)?;
            [median, p99] = worst.to_vec::<f64>()?[..].try_into().unwrap_or([median, p99]);
        }
        let hosts = symmem::config::hosts();
        // What the operator decided from (its input's handle, made by its first call).
        let h = symm::rendezvous(&input, &group)?;
        let link = h.link_backend();
        let used = match (op, algo) {
            ("all_reduce", "auto") => symmem::ops::all_reduce::select_for(&input, ReduceOp::Sum, &h).name(),
            ("all_reduce", a) => a,
            ("all_to_all", _) => symmem::ops::all_to_all::select(bytes, hosts, link).name(),
            ("all_to_all_v", _) => symmem::ops::all_to_all::select_v(bytes, ws, ws, hosts, true).name(),
            ("all_gather", _) => symmem::ops::all_gather::select_for(&input, &h).name(),
            ("reduce_scatter", _) => symmem::ops::reduce_scatter::select_for(&input, &h).name(),
            ("broadcast", _) => symmem::ops::broadcast::select_for(&input, &h).name(),
            // The product's partials are `bytes` a rank, scattered along rows.
            ("matmul_reduce_scatter", _) => symmem::ops::matmul::select_mrs(bytes, 0, &h).name(),
            ("all_to_all_nd", _) => symmem::ops::all_to_all::select_nd_for(&input, 0, &h).name(),
            // The input as [ws, numel / ws], a row per rank: PyTorch's default blocks.
            ("reduce_scatter_offset", _) => {
                let view = input.view(&[ws, numel / ws])?;
                let (offsets, dst): (Vec<usize>, Vec<usize>) = ((1..=ws).collect(), (0..ws).collect());
                symmem::ops::reduce_scatter::select_offset(&view, 0, &offsets, &dst, &h).name()
            }
            ("all_gather_matmul", _) => {
                symmem::ops::all_gather::select(input.nbytes(), h.max_ranks_per_host(), hosts.min(2), link).name()
            }
            ("tile_reduce", _) => symmem::ops::tile::select(bytes, ws, hosts.min(2)).name(),
            // Every rank's ws tiles travel packed.
            ("multi_root_tile_reduce", _) => {
                symmem::ops::tile::select(bytes.saturating_mul(ws), ws, hosts.min(2)).name()
            }
            _ => "pull",
        };
        let mut row =
            BenchResult::timing(op, ws, n_iters, median, p99).sized(bytes, bus_factor(op, ws)).with("algo", used);
        row.hosts = hosts;
        row.count = Some((bytes / es) as u64);
        row.dtype = Some(dtype.to_string());
        if let Some(p) = pinned {
            row = row.with("pinned", p);
        }
        out_rows.row(row)?;
        // Every rank starts the next size together.
        group.barrier(Duration::from_secs(60))?;
    }
    Ok(())
}

/// The font the plots use (Debian's fonts-dejavu-core).
pub const PLOT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// A size in bytes as a person reads it: `8 B`, `4 KiB`, `16 MiB`, `1.5 GiB`.
pub fn human_size(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if (v - v.round()).abs() < 1e-9 { format!("{v:.0} {}", units[u]) } else { format!("{v:.1} {}", units[u]) }
}

/// What a plot's title says besides the rows: the machine.
pub fn machine() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {cores} cores")
}

/// One line of a plot: its label, whether it is a baseline, and (size, time, p99, bandwidth)
/// points.
struct Line {
    label: String,
    baseline: bool,
    points: Vec<(f64, f64, f64, Option<f64>)>,
    /// The algorithm of each point, where the rows name one.
    algos: Vec<Option<String>>,
}

/// Draws median time (with p99 dotted) and bandwidth against message size into `path`
/// (`.svg`, or `.png`): one line per measured thing, baselines of the same run dashed in grey
/// tones, sizes on a log axis in B/KiB/MiB, a title naming the operation, ranks, hosts, dtype
/// and machine, and the legend below the panels. Collectives plot bus bandwidth; transports the
/// bandwidth of back-to-back transfers (`stream_gbps`).
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
    let mut lines: Vec<Line> = Vec::new();
    let mut transport = false;
    for r in rows {
        let Some(size) = r.size.filter(|&b| b > 0) else { continue };
        let note = r.extra.get("note").and_then(|n| n.as_str()).unwrap_or("");
        let baseline = note.starts_with("baseline");
        let mut label = match (baseline, r.bench.as_str()) {
            (true, "mpi_allreduce") => "Open MPI MPI_Allreduce".to_string(),
            (true, "mpi_alltoall") => "Open MPI MPI_Alltoall".to_string(),
            (true, "tcp_stream") => "TCP stream".to_string(),
            (true, "tcp_pingpong") => "TCP ping-pong (8 B)".to_string(),
            (true, "tcp_pingpong_spin") => "TCP ping-pong, busy-polling (8 B)".to_string(),
            (true, other) => other.to_string(),
            (false, other) => format!("symmem {}", other.replace('_', "-")),
        };
        let algo = r.extra.get("algo").and_then(|a| a.as_str()).map(|a| a.replace('_', "-"));
        if let Some(m) = r.extra.get("memory").and_then(|a| a.as_str()) {
            label = format!("{label}, {m} memory");
            transport = true;
        }
        if baseline {
            label = format!("{label} (baseline)");
        }
        // Transports: transfers back to back; collectives (and their baselines): busbw; a
        // ping-pong has no bandwidth worth drawing.
        let bw = r.extra.get("stream_gbps").and_then(|v| v.as_f64()).or(r.busbw.filter(|_| r.count.is_some()));
        let point =
            (size as f64, r.time_us.max(1e-3), r.p99_us.unwrap_or(r.time_us).max(1e-3), bw.filter(|&b| b > 0.0));
        match lines.iter_mut().find(|l| l.label == label) {
            Some(l) => {
                l.points.push(point);
                l.algos.push(algo);
            }
            None => lines.push(Line { label, baseline, points: vec![point], algos: vec![algo] }),
        }
    }
    if lines.is_empty() {
        return Err(Error::InvalidArgument("nothing to plot: no result has a message size".into()));
    }
    // symmem's lines first (drawn under nothing, listed first), then the baselines.
    lines.sort_by_key(|l| l.baseline);
    let main =
        rows.iter().find(|r| !r.extra.get("note").and_then(|n| n.as_str()).unwrap_or("").starts_with("baseline"));
    let main = main.unwrap_or(&rows[0]);
    let what = if transport {
        format!("one-sided transport ({})", main.extra.get("backend").and_then(|b| b.as_str()).unwrap_or("?"))
    } else {
        main.bench.replace('_', "-")
    };
    let dtype = main.dtype.as_deref().map(|d| format!(", {d}")).unwrap_or_default();
    let title = format!(
        "symmem {what}: {} ranks on {} host{}{dtype}; {}",
        main.ranks,
        main.hosts,
        if main.hosts == 1 { "" } else { "s" },
        machine()
    );
    let bw_label = if transport {
        "bandwidth, transfers back to back (GB/s)".to_string()
    } else {
        "bus bandwidth, busbw (GB/s)".to_string()
    };
    let result = if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("png")) {
        draw_plot(BitMapBackend::new(path, (1400, 640)).into_drawing_area(), &lines, &title, &bw_label)
    } else {
        draw_plot(SVGBackend::new(path, (1400, 640)).into_drawing_area(), &lines, &title, &bw_label)
    };
    result.map_err(|e| Error::InvalidArgument(format!("plot {}: {e}", path.display())))
}

/// Powers of two from below `lo` to above `hi`, every `step`-th one, at most about 8.
fn size_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (a, b) = (lo.log2().floor() as i32, hi.log2().ceil() as i32);
    let step = ((b - a) / 8 + 1).max(1);
    // The smallest and the largest size always have their labels; between them, every
    // `step`-th power of two that is not crowding the last.
    let mut v: Vec<f64> =
        (a..b).step_by(step as usize).filter(|&e| e == a || b - e >= step).map(|e| 2f64.powi(e)).collect();
    v.push(2f64.powi(b));
    v
}

/// Decades and their 2 and 5 multiples between `lo` and `hi`, for a log value axis.
fn value_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut v = Vec::new();
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let mults: &[f64] = if b - a <= 3 { &[1.0, 2.0, 5.0] } else { &[1.0] };
    for e in a..=b {
        for m in mults {
            let x = m * 10f64.powi(e);
            if x >= lo && x <= hi {
                v.push(x);
            }
        }
    }
    v
}

fn value_label(v: f64) -> String {
    if v >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        let decimals = (1.0 - v.log10().floor()).max(1.0) as usize;
        let s = format!("{v:.decimals$}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn draw_plot<DB: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    lines: &[Line],
    title: &str,
    bw_label: &str,
) -> std::result::Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 20))?;
    // Legend rows below the panels: three entries a row.
    let legend_rows = lines.len().div_ceil(3) as u32;
    let (panels, legend) = root.split_vertically(root.dim_in_pixel().1 - 28 * legend_rows - 16);
    let halves = panels.split_evenly((1, 2));
    let pts = || lines.iter().flat_map(|l| l.points.iter());
    let (x0, x1) = pts().fold((f64::MAX, 1.0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let colors: Vec<RGBAColor> = {
        let (mut main, mut base) = (0, 0);
        let strong = [
            RGBColor(31, 119, 180),
            RGBColor(214, 39, 40),
            RGBColor(44, 160, 44),
            RGBColor(148, 103, 189),
            RGBColor(255, 127, 14),
            RGBColor(23, 190, 207),
        ];
        let grey = [RGBColor(90, 90, 90), RGBColor(150, 150, 150), RGBColor(60, 60, 60), RGBColor(180, 180, 180)];
        lines
            .iter()
            .map(|l| {
                if l.baseline {
                    base += 1;
                    grey[(base - 1) % grey.len()].to_rgba()
                } else {
                    main += 1;
                    strong[(main - 1) % strong.len()].to_rgba()
                }
            })
            .collect()
    };
    for (k, area) in halves.iter().enumerate() {
        let values: Vec<f64> =
            if k == 0 { pts().flat_map(|p| [p.1, p.2]).collect() } else { pts().filter_map(|p| p.3).collect() };
        if values.is_empty() {
            continue;
        }
        let (lo, hi) = values.iter().fold((f64::MAX, 0.0f64), |(a, b), &v| (a.min(v), b.max(v)));
        let (lo, hi) = (lo * 0.7, hi * 1.4);
        let caption = if k == 0 { "time per operation (us): median, p99 dotted" } else { bw_label };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 16))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(
                (x0 * 0.8..x1 * 1.25).log_scale().with_key_points(size_ticks(x0, x1)),
                (lo..hi).log_scale().with_key_points(value_ticks(lo, hi)),
            )?;
        chart
            .configure_mesh()
            .x_desc("message size")
            .x_label_formatter(&|v| human_size(*v))
            .y_label_formatter(&|v| value_label(*v))
            .label_style(("sans-serif", 13))
            .axis_desc_style(("sans-serif", 14))
            .light_line_style(WHITE)
            .bold_line_style(RGBColor(225, 225, 225))
            .draw()?;
        for (l, &color) in lines.iter().zip(&colors) {
            let line: Vec<(f64, f64)> = if k == 0 {
                l.points.iter().map(|p| (p.0, p.1)).collect()
            } else {
                l.points.iter().filter_map(|p| p.3.map(|b| (p.0, b))).collect()
            };
            if line.is_empty() {
                continue;
            }
            let style = color.stroke_width(if l.baseline { 2 } else { 3 });
            if l.baseline {
                chart.draw_series(DashedLineSeries::new(line.clone(), 8, 5, style))?;
            } else {
                chart.draw_series(LineSeries::new(line.clone(), style))?;
            }
            chart.draw_series(line.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            if k == 0 && !l.baseline {
                let p99: Vec<(f64, f64)> = l.points.iter().map(|p| (p.0, p.2)).collect();
                chart.draw_series(DashedLineSeries::new(p99, 2, 4, color.stroke_width(1)))?;
                // Name the algorithm where it changes along the line.
                let mut last: Option<&String> = None;
                for (p, a) in l.points.iter().zip(&l.algos) {
                    if let Some(a) = a
                        && last != Some(a)
                    {
                        chart.draw_series(std::iter::once(Text::new(
                            a.clone(),
                            (p.0 * 1.1, p.1 * 0.8),
                            ("sans-serif", 13).into_font().color(&color),
                        )))?;
                        last = Some(a);
                    }
                }
            }
        }
    }
    // The legend, outside the data.
    let cells = legend.margin(4, 4, 60, 20).split_evenly((legend_rows as usize, 3));
    for ((l, &color), cell) in lines.iter().zip(&colors).zip(cells.iter()) {
        let y = 12;
        if l.baseline {
            for x in (0..36).step_by(12) {
                cell.draw(&PathElement::new(vec![(x, y), (x + 7, y)], color.stroke_width(2)))?;
            }
        } else {
            cell.draw(&PathElement::new(vec![(0, y), (36, y)], color.stroke_width(3)))?;
        }
        cell.draw(&Circle::new((18, y), 4, color.filled()))?;
        cell.draw(&Text::new(l.label.clone(), (46, y - 8), ("sans-serif", 15)))?;
    }
    root.present()?;
    Ok(())
}
