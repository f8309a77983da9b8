//! The launcher behind `symmem run`: one host's share of a job.
//!
//! It starts the job's store (on node 0), starts one process per local rank with the variables
//! torchrun sets, prefixes each line a rank prints with `[rank]`, forwards SIGINT and SIGTERM,
//! and when a rank fails stops the others (SIGTERM, then SIGKILL half a second later) and
//! reports which rank failed and how. Each rank runs in its own process group, so the ranks'
//! own children are stopped with them; and each rank is killed by the kernel if the launcher
//! itself dies, even by `kill -9`. With a [`guard`] in front of each rank (as `symmem run`
//! puts one), nothing a rank starts outlives it, not even what leaves the group or the session
//! (`setsid`): see `launch/reap.rs`.
//!
//! Its files (the ranks' error files, and what says the launch is alive) are in a run folder
//! of its own (`launch/run_folder.rs`).
//!
//! The launcher signals only process groups it still owns. It learns that a rank ended from a
//! pidfd and reads its status without reaping it (`waitid(P_PIDFD, WNOWAIT)`): until the end of
//! the job every rank is alive or a zombie, so its pid, which names its process group, cannot
//! be reused by an unrelated process. The ranks are reaped only after the last signal.
//!
//! Across hosts (`nnodes > 1`) the launchers meet in the store: a launcher whose rank fails
//! raises an abort key that makes every other launcher stop its ranks, and node 0 keeps the
//! store up until every node's ranks have finished.

#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::fmt;
use std::io::Write;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use rustix::process::Signal;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;

use crate::config::env;
use crate::error::{Error, Result};
use crate::group;
use crate::store::{AsyncStoreClient, ClientOptions, Secret, ServerOptions, StoreServer};

mod reap;
mod run_folder;

pub use reap::Subreaper;
use run_folder::RunFolder;

/// How long ranks get between SIGTERM and SIGKILL once the job is being stopped.
pub const GRACE: Duration = Duration::from_millis(500);

/// How the launcher binds its ranks to CPUs (`symmem run --bind`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bind {
    /// Where the scheduler puts them, as torchrun leaves them.
    #[default]
    None,
    /// Each rank on a share of its own of the CPUs the launcher may use, every thread of the
    /// rank included (its transports' too), as mpirun binds a rank per core: the host's ranks
    /// split those CPUs into equal blocks of neighbouring ones, rank by rank; with more ranks
    /// than CPUs, a CPU each, taken round (several ranks per CPU). Ranks that spin while they
    /// wait for each other then never share a core while another core idles.
    Cores,
    /// [`Bind::Cores`] for a launcher that shares the machine with others of the same job
    /// (played hosts): its ranks are ranks `first..` of the `of` ranks on the machine.
    CoresFrom {
        /// The machine-wide index of this launcher's first rank.
        first: usize,
        /// Ranks on the machine, every launcher's.
        of: usize,
    },
}

/// What to launch, and where this host stands in the job.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// Ranks on this host.
    pub nproc_per_node: usize,
    /// Hosts in the job.
    pub nnodes: usize,
    /// This host's index, `0..nnodes`; node 0 hosts the store.
    pub node_rank: usize,
    /// The host of the store, as the ranks should reach it.
    pub master_addr: String,
    /// The store's port; 0 lets node 0 pick a free one (single-host jobs only).
    pub master_port: u16,
    /// Stop the job (exit code 124) if it runs longer than this.
    pub timeout: Option<Duration>,
    /// The job's secret: the store's (ranks and other hosts' launchers must prove it) and the
    /// key of the ranks' links, passed to the ranks in `SYMMEM_STORE_SECRET`. `None`: drawn at
    /// random for a job on one host, [`Secret::resolve`]d (`SYMMEM_STORE_SECRET`, else this
    /// user's key) for one spanning hosts, so that every host finds the same.
    pub secret: Option<Secret>,
    /// Run the job's store without a secret (for PyTorch ranks on other hosts, which cannot
    /// authenticate): anyone who reaches it can read and change the job's keys.
    pub no_auth: bool,
    /// The program each rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment variables for every rank.
    pub env: Vec<(OsString, OsString)>,
    /// A command that runs [`guard`] (e.g. `symmem __guard --`), to put in front of the rank
    /// program. Without it a rank's own children outlive a `kill -9` of the launcher, and what
    /// a rank starts outside its process group (`setsid`) outlives the job.
    pub guard: Option<(OsString, Vec<OsString>)>,
    /// Whether and how the ranks are bound to CPUs.
    pub bind: Bind,
}

impl LaunchOptions {
    /// Options for `n` ranks of `program` on this host alone.
    pub fn local(n: usize, program: impl Into<OsString>, args: Vec<OsString>) -> LaunchOptions {
        LaunchOptions {
            nproc_per_node: n,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            timeout: None,
            secret: None,
            no_auth: false,
            program: program.into(),
            args,
            env: Vec::new(),
            guard: None,
            bind: Bind::None,
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |s: String| Err(Error::InvalidArgument(s));
        if self.nproc_per_node == 0 {
            return bad("-n must be at least 1".into());
        }
        if self.nnodes == 0 {
            return bad("--nnodes must be at least 1".into());
        }
        if self.node_rank >= self.nnodes {
            return bad(format!("--node-rank {} is not below --nnodes {}", self.node_rank, self.nnodes));
        }
        if self.nnodes > 1 && self.master_port == 0 {
            return bad("a multi-host job needs --master-port, the same on every host".into());
        }
        Ok(())
    }
}

/// How a rank ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Termination {
    /// It exited with this code.
    Exit(i32),
    /// It was killed by this signal.
    Signal(i32),
}

impl Termination {
    fn from_parts(code: Option<i32>, signal: Option<i32>) -> Termination {
        match (code, signal) {
            (Some(c), _) => Termination::Exit(c),
            (None, Some(s)) => Termination::Signal(s),
            // A process ends either by an exit or by a signal on Unix.
            (None, None) => Termination::Exit(1),
        }
    }

    /// The shell's exit code for this termination: the code, or 128 + the signal.
    pub fn exit_code(self) -> i32 {
        match self {
            Termination::Exit(c) => c,
            Termination::Signal(s) => 128 + s,
        }
    }
}

impl fmt::Display for Termination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Termination::Exit(c) => write!(f, "exited with code {c}"),
            Termination::Signal(s) => write!(f, "was killed by signal {s}{}", signal_name(s)),
        }
    }
}

/// How a job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank on this host exited with code 0.
    Success,
    /// A rank failed first; the others were stopped.
    RankFailed {
        /// The global rank.
        rank: usize,
        /// How it ended.
        how: Termination,
        /// What the rank recorded in its error file (torchrun's `TORCHELASTIC_ERROR_FILE`,
        /// e.g. through `torch.distributed.elastic.multiprocessing.errors.record`): the message,
        /// and the traceback when there is one.
        error: Option<RankError>,
    },
    /// Another host's launcher reported a failure and this host's ranks were stopped.
    Aborted {
        /// The other launcher's message.
        reason: String,
    },
    /// The job ran past `--timeout`.
    TimedOut {
        /// The timeout.
        after: Duration,
    },
    /// The launcher received this signal and forwarded it to the ranks.
    Interrupted {
        /// The signal number.
        signal: i32,
    },
}

impl Outcome {
    /// The launcher's exit code: 0, the failed rank's code (128 + signal if it was killed),
    /// 124 on timeout, 128 + signal when interrupted, 1 when aborted by another host.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Success => 0,
            Outcome::RankFailed { how, .. } => how.exit_code(),
            Outcome::Aborted { .. } => 1,
            Outcome::TimedOut { .. } => 124,
            Outcome::Interrupted { signal } => 128 + signal,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Success => write!(f, "all ranks succeeded"),
            Outcome::RankFailed { rank, how, error } => {
                write!(f, "rank {rank} {how}; stopped the other ranks")?;
                if let Some(e) = error {
                    write!(f, "\nroot cause (rank {rank}'s error file): {}", e.message)?;
                    if let Some(tb) = &e.traceback {
                        write!(f, "\n{}", tb.trim_end())?;
                    }
                }
                Ok(())
            }
            Outcome::Aborted { reason } => write!(f, "another host failed ({reason}); stopped this host's ranks"),
            Outcome::TimedOut { after } => write!(f, "the job ran longer than {after:?}; stopped every rank"),
            Outcome::Interrupted { signal } => write!(f, "interrupted by signal {signal}; forwarded it to every rank"),
        }
    }
}

/// What a failed rank recorded in its error file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankError {
    /// The message (`"RuntimeError: ..."`).
    pub message: String,
    /// The Python traceback, when the rank recorded one.
    pub traceback: Option<String>,
    /// The file's whole JSON, as the rank wrote it.
    pub json: serde_json::Value,
}

/// Records the job's root cause where the launcher's own `TORCHELASTIC_ERROR_FILE` says, as
/// torchrun's `@record` does: the failed rank's error file with its exit code as `errorCode`,
/// or, when the rank wrote none, a message of its own.
fn record_root_cause(outcome: &Outcome) {
    let Some(path) = crate::config::value(crate::config::env::ERROR_FILE) else { return };
    let Outcome::RankFailed { rank, how, error } = outcome else { return };
    let timestamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let json = match error {
        Some(e) => {
            let mut json = e.json.clone();
            if let Some(m) = json.get_mut("message").and_then(|m| m.as_object_mut()) {
                m.insert("errorCode".into(), how.exit_code().into());
            }
            json
        }
        None => serde_json::json!({
            "message": {
                "message": format!("ChildFailedError: rank {rank} {how} (it wrote no error file)"),
                "extraInfo": { "py_callstack": "", "timestamp": timestamp.to_string() },
                "errorCode": how.exit_code(),
            }
        }),
    };
    if let Err(e) = std::fs::write(path, json.to_string()) {
        tracing::warn!("could not write the job's error file {path}: {e}");
    }
}

/// A run id as torchrun's `--standalone` makes one: random hex.
fn run_id() -> String {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

const ABORT_KEY: &str = "symmem/launch/abort";
const FINISHED_KEY: &str = "symmem/launch/finished";

/// Runs this host's share of a job to completion and reports how it ended.
///
/// Errors are reserved for failures of the launcher itself (a port that cannot be bound, a
/// program that cannot be started); how the ranks ended is the [`Outcome`].
pub fn run(options: &LaunchOptions) -> Result<Outcome> {
    options.validate()?;
    crate::rt::block_on(run_async(options))
}

/// Plays a job of `hosts` hosts on this machine: one launcher per host (in threads of this
/// process), each with `options.nproc_per_node` ranks, a free port for the store, and
/// `SYMMEM_HOST_ID=host<i>` so the ranks of different "hosts" reach each other only through
/// the transport, as on separate machines. Returns the first host's outcome that is not a
/// success, else success.
pub fn run_hosts(options: &LaunchOptions, hosts: usize) -> Result<Outcome> {
    if hosts <= 1 {
        return run(options);
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::io("pick a port for the store", e))?
        .port();
    // The played hosts share one process, so they share a secret without any file.
    let secret = match (&options.secret, options.no_auth) {
        (Some(s), _) => Some(s.clone()),
        (None, true) => None,
        (None, false) => Some(Secret::random()?),
    };
    let outcomes: Vec<Result<Outcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..hosts)
            .map(|i| {
                let mut o = options.clone();
                o.nnodes = hosts;
                o.node_rank = i;
                o.master_addr = "127.0.0.1".into();
                o.master_port = port;
                o.secret = secret.clone();
                o.env.push((crate::config::env::HOST_ID.into(), format!("host{i}").into()));
                if o.bind == Bind::Cores {
                    let n = o.nproc_per_node;
                    o.bind = Bind::CoresFrom { first: i * n, of: hosts * n };
                }
                s.spawn(move || run(&o))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::InvalidArgument("a launcher panicked".into()))))
            .collect()
    });
    let mut first = Outcome::Success;
    for o in outcomes {
        let o = o?;
        if first == Outcome::Success {
            first = o;
        }
    }
    Ok(first)
}

/// The CPUs each of this launcher's ranks is bound to (by local rank), or none ([`Bind`]).
fn cpu_shares(o: &LaunchOptions) -> Result<Vec<rustix::thread::CpuSet>> {
    let (first, of) = match o.bind {
        Bind::None => return Ok(Vec::new()),
        Bind::Cores => (0, o.nproc_per_node),
        Bind::CoresFrom { first, of } => (first, of),
    };
    let mine = rustix::thread::sched_getaffinity(None).map_err(|e| Error::io("read the launcher's CPUs", e.into()))?;
    let cpus: Vec<usize> = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| mine.is_set(c)).collect();
    if cpus.is_empty() || first.checked_add(o.nproc_per_node).is_none_or(|last| last > of) {
        return Err(Error::InvalidArgument(format!(
            "cannot bind ranks {first}.. ({} of them) of {of} to the {} CPUs this launcher may use",
            o.nproc_per_node,
            cpus.len()
        )));
    }
    let blocks = cpu_blocks(cpus.len(), of);
    let shares: Vec<_> = (first..first + o.nproc_per_node)
        .map(|r| {
            let (from, to) = blocks[r % blocks.len()];
            let mut set = rustix::thread::CpuSet::new();
            for &c in &cpus[from..to] {
                set.set(c);
            }
            set
        })
        .collect();
    if of > cpus.len() {
        tracing::warn!("--bind cores: {of} ranks on {} CPUs, so several ranks share each CPU", cpus.len());
    }
    tracing::info!(
        "ranks bound to CPUs: {}",
        shares
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let on: Vec<String> = cpus.iter().filter(|&&c| s.is_set(c)).map(|c| c.to_string()).collect();
                format!("local rank {i} on {}", on.join(","))
            })
            .collect::<Vec<_>>()
            .join("; ")
    );
    Ok(shares)
}

/// `[from, to)` index ranges that split `cpus` CPUs among `ranks` ranks: one block of
/// neighbours per rank, their sizes differing by one at most, or, with more ranks than CPUs,
/// a CPU per block (ranks take them round).
fn cpu_blocks(cpus: usize, ranks: usize) -> Vec<(usize, usize)> {
    let n = ranks.min(cpus).max(1);
    (0..n).map(|i| (i * cpus / n, (i + 1) * cpus / n)).collect()
}

/// The job's secret (see [`LaunchOptions::secret`]).
fn job_secret(o: &LaunchOptions) -> Result<Option<Secret>> {
    if o.no_auth {
        return Ok(None);
    }
    if let Some(s) = &o.secret {
        return Ok(Some(s.clone()));
    }
    if o.nnodes == 1 {
        return Ok(Some(match Secret::from_env() {
            Some(s) => s,
            None => Secret::random()?,
        }));
    }
    let (secret, from) = Secret::resolve(None)?;
    tracing::info!("the job's secret is {from}");
    Ok(Some(secret))
}

/// Where node 0's store listens: where the job needs it. One host: `master_addr` (loopback by
/// default). Several: `master_addr` if it is an address of this host, else every interface
/// (the store is authenticated; a name this host resolves to loopback, as Debian's
/// `127.0.1.1 hostname` does, is not what the other hosts reach).
fn store_bind_host(o: &LaunchOptions) -> String {
    use std::net::ToSocketAddrs;
    if o.nnodes == 1 {
        return o.master_addr.clone();
    }
    let literal = o.master_addr.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>().ok();
    let resolved = (o.master_addr.as_str(), 0).to_socket_addrs().ok().and_then(|mut a| a.next()).map(|a| a.ip());
    match resolved {
        Some(ip) if (!ip.is_loopback() || literal.is_some()) && std::net::UdpSocket::bind((ip, 0)).is_ok() => {
            if ip.is_ipv6() { format!("[{ip}]") } else { ip.to_string() }
        }
        _ => "0.0.0.0".into(),
    }
}

async fn run_async(o: &LaunchOptions) -> Result<Outcome> {
    let secret = job_secret(o)?;
    let server = if o.node_rank == 0 {
        let addr = format!("{}:{}", store_bind_host(o), o.master_port);
        Some(StoreServer::start(&addr, ServerOptions { secret: secret.clone(), ..Default::default() })?)
    } else {
        None
    };
    let port = server.as_ref().map_or(o.master_port, |s| s.local_addr().port());
    let env = group::RankEnv {
        rank: 0,
        world_size: o.nproc_per_node * o.nnodes,
        local_rank: 0,
        local_world_size: o.nproc_per_node,
        master_addr: o.master_addr.clone(),
        master_port: port,
        agent_store: true,
    };
    let store_addr = env.store_addr();
    // Across hosts: one connection to report, one to watch for other hosts' failures (a
    // pending WAIT occupies its connection).
    let (mut coordinator, watcher) = if o.nnodes > 1 {
        let opts = ClientOptions { secret: secret.clone(), ..ClientOptions::default() };
        (
            Some(AsyncStoreClient::connect(&store_addr, &opts).await?),
            Some(AsyncStoreClient::connect(&store_addr, &opts).await?),
        )
    } else {
        (None, None)
    };

    let out = Arc::new(std::sync::Mutex::new(()));
    let run_folder = RunFolder::new()?;
    // torchrun's defaults for what it does not get: one OpenMP thread per rank when several
    // share the host, said once.
    let omp = if crate::config::value(crate::config::env::OMP_NUM_THREADS).is_none()
        && !o.env.iter().any(|(k, _)| k == env::OMP_NUM_THREADS)
        && o.nproc_per_node > 1
    {
        tracing::warn!(
            "setting OMP_NUM_THREADS=1 for each of the {} ranks (it was unset; as torchrun does), to avoid \
             overloading the host; set it to tune",
            o.nproc_per_node
        );
        Some("1")
    } else {
        None
    };
    let cpus = cpu_shares(o)?;
    let guarded = o.guard.is_some();
    let id = run_id();
    let mut pids = Vec::new();
    let mut children = Vec::new();
    let mut waits = FuturesUnordered::new();
    let mut printers = Vec::new();
    for local in 0..o.nproc_per_node {
        let rank = o.node_rank * o.nproc_per_node + local;
        let mut cmd = match &o.guard {
            Some((guard, guard_args)) => {
                let mut c = tokio::process::Command::new(guard);
                c.args(guard_args).arg(&o.program);
                c
            }
            None => tokio::process::Command::new(&o.program),
        };
        cmd.args(&o.args)
            .envs(o.env.iter().map(|(k, v)| (k, v)))
            .env(env::RANK, rank.to_string())
            .env(env::WORLD_SIZE, env.world_size.to_string())
            .env(env::LOCAL_RANK, local.to_string())
            .env(env::LOCAL_WORLD_SIZE, o.nproc_per_node.to_string())
            .env("GROUP_RANK", o.node_rank.to_string())
            .env(env::GROUP_WORLD_SIZE, o.nnodes.to_string())
            .env(env::MASTER_ADDR, &o.master_addr)
            .env(env::MASTER_PORT, port.to_string())
            .env(env::AGENT_STORE, "True")
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_NAME", "default")
            .env("ROLE_WORLD_SIZE", env.world_size.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", "0")
            .env("TORCHELASTIC_MAX_RESTARTS", "0")
            .env("TORCHELASTIC_RUN_ID", &id)
            .env(env::ERROR_FILE, run_folder.prepare(rank)?)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if let Some(n) = omp {
            cmd.env(env::OMP_NUM_THREADS, n);
        }
        match &secret {
            Some(secret) => cmd.env(env::STORE_SECRET, secret.expose_os()),
            None => cmd.env_remove(env::STORE_SECRET),
        };
        crate::sys::die_with_parent(cmd.as_std_mut());
        if let Some(set) = cpus.get(local) {
            crate::sys::bind_to(&mut cmd, *set);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                abandon(&pids, guarded);
                return Err(Error::io(format!("start rank {rank}: {:?}", o.program), e));
            }
        };
        // A spawned child has a pid until it is reaped, which happens only at the end.
        let pid = child.id().unwrap_or(0);
        // Opened before anything can reap the child, so it names this process.
        let ended = match crate::sys::ChildExit::watch(pid) {
            Ok(e) => e,
            Err(e) => {
                abandon(&pids, guarded);
                let _ = child.start_kill();
                return Err(Error::io(format!("pidfd_open rank {rank} (pid {pid}); Linux 5.3 or later is needed"), e));
            }
        };
        pids.push(pid);
        if let Some(stdout) = child.stdout.take() {
            printers.push(tokio::spawn(forward(stdout, rank, false, out.clone())));
        }
        if let Some(stderr) = child.stderr.take() {
            printers.push(tokio::spawn(forward(stderr, rank, true, out.clone())));
        }
        children.push(child);
        waits.push(async move { (rank, ended.status().await.map(|(code, sig)| Termination::from_parts(code, sig))) });
    }

    let mut sigint = signal(SignalKind::interrupt()).map_err(|e| Error::io("install SIGINT handler", e))?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(|e| Error::io("install SIGTERM handler", e))?;
    let job_deadline = o.timeout.map(|t| Instant::from_std(crate::sync::deadline(t)));
    let mut kill_at: Option<Instant> = None;
    let mut asked_guards = false;
    let mut outcome: Option<Outcome> = None;
    let far = Instant::from_std(crate::sync::deadline(Duration::MAX));

    // Across hosts, a failure elsewhere shows up as the abort key.
    let abort_watch = async move {
        match watcher {
            Some(mut c) => loop {
                match c.get(ABORT_KEY, Duration::from_secs(3600)).await {
                    Ok(v) => return String::from_utf8_lossy(&v).into_owned(),
                    Err(e) if e.is_timeout() => continue,
                    Err(e) => {
                        tracing::warn!("lost the job's store: {e}");
                        return std::future::pending().await;
                    }
                }
            },
            None => std::future::pending().await,
        }
    };
    tokio::pin!(abort_watch);
    let mut aborted = false;

    let mut remaining = pids.len();
    while remaining > 0 {
        tokio::select! {
            Some((rank, status)) = waits.next() => {
                remaining -= 1;
                let how = match status {
                    Ok(how) => how,
                    Err(e) => {
                        abandon(&pids, guarded);
                        return Err(Error::io(format!("wait for rank {rank}"), e));
                    }
                };
                if how != Termination::Exit(0) && outcome.is_none() {
                    // The others first: what the rank left in its error file can wait.
                    stop(&pids, Signal::TERM);
                    kill_at = Some(Instant::now() + GRACE);
                    let error = run_folder::read_error_file(rank, run_folder.error_file(rank)).await;
                    outcome = Some(Outcome::RankFailed { rank, how, error });
                }
            }
            _ = sigint.recv() => {
                stop(&pids, Signal::INT);
                outcome.get_or_insert(Outcome::Interrupted { signal: Signal::INT.as_raw() });
                kill_at.get_or_insert(Instant::now() + GRACE * 6);
            }
            _ = sigterm.recv() => {
                stop(&pids, Signal::TERM);
                outcome.get_or_insert(Outcome::Interrupted { signal: Signal::TERM.as_raw() });
                kill_at.get_or_insert(Instant::now() + GRACE);
            }
            reason = &mut abort_watch, if !aborted => {
                aborted = true;
                if outcome.is_none() {
                    outcome = Some(Outcome::Aborted { reason });
                    stop(&pids, Signal::TERM);
                    kill_at = Some(Instant::now() + GRACE);
                }
            }
            _ = tokio::time::sleep_until(job_deadline.unwrap_or(far)), if job_deadline.is_some() && outcome.is_none() => {
                outcome = Some(Outcome::TimedOut { after: o.timeout.unwrap_or_default() });
                stop(&pids, Signal::TERM);
                kill_at = Some(Instant::now() + GRACE);
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or(far)), if kill_at.is_some() => {
                if guarded && !asked_guards {
                    // A guard ends its rank and everything that rank started, wherever it went;
                    // a SIGKILL to the group would end the guard first, and leave the rest.
                    asked_guards = true;
                    ask_guards(&pids);
                    kill_at = Some(Instant::now() + GRACE);
                } else {
                    stop(&pids, Signal::KILL);
                    kill_at = None;
                }
            }
        }
    }
    // Whatever the ranks left running in their process groups goes with them. Every rank is a
    // zombie now, still holding its pid and so its group's id: this is the last signal, and
    // the ranks are reaped after it.
    stop(&pids, Signal::KILL);
    for mut c in children {
        let _ = c.wait().await;
    }
    for p in printers {
        // A grandchild that escaped its group could hold a pipe open; do not wait for it.
        let _ = tokio::time::timeout(Duration::from_secs(1), p).await;
    }
    let outcome = outcome.unwrap_or(Outcome::Success);
    record_root_cause(&outcome);

    if let Some(c) = &mut coordinator {
        // The store may sit on a host that is gone: never wait long for it.
        let brief = Duration::from_secs(5);
        if let Outcome::RankFailed { rank, how, .. } = &outcome {
            let reason = format!("rank {rank} {how} on node {}", o.node_rank);
            let _ = tokio::time::timeout(brief, c.set(ABORT_KEY, reason.as_bytes())).await;
        }
        let _ = tokio::time::timeout(brief, c.add(FINISHED_KEY, 1)).await;
        if server.is_some() {
            // Keep the store up until every host's ranks are done with it: a minute after a
            // success, a few seconds after a failure (the other hosts may be unreachable).
            let patience = if matches!(outcome, Outcome::Success) { Duration::from_secs(60) } else { brief };
            let wait = async {
                while c.add(FINISHED_KEY, 0).await.is_ok_and(|n| n < o.nnodes as i64) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            };
            if tokio::time::timeout(patience, wait).await.is_err() {
                tracing::warn!("gave up after {patience:?} waiting for the other hosts to finish");
            }
        }
    }
    drop(server);
    Ok(outcome)
}

/// Signals the process group of every rank; every pid is still this launcher's (alive or a
/// zombie, see the module docs).
fn stop(pids: &[u32], signal: Signal) {
    for &pid in pids {
        crate::sys::signal_group(pid, signal);
    }
}

/// Asks every rank's guard to end its rank and all the rank started, now ([`guard`]'s SIGUSR1).
/// Each pid is still the guard's (alive or a zombie, see the module docs).
fn ask_guards(pids: &[u32]) {
    for &pid in pids {
        if let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, Signal::USR1);
        }
    }
}

/// Ends the ranks started so far, when the launcher cannot go on: through their guards, given
/// [`GRACE`] to end what their ranks started, then SIGKILL to every group. No pid is reaped here.
fn abandon(pids: &[u32], guarded: bool) {
    use rustix::process::{WaitId, WaitIdOptions, waitid};
    if guarded {
        ask_guards(pids);
        let running = |&pid: &u32| {
            i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw).is_some_and(|p| {
                matches!(
                    waitid(WaitId::Pid(p), WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT),
                    Ok(None)
                )
            })
        };
        let deadline = std::time::Instant::now() + GRACE;
        while pids.iter().any(running) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    stop(pids, Signal::KILL);
}

/// Copies a rank's output line by line, each line prefixed with `[rank] `.
async fn forward(stream: impl AsyncRead + Unpin, rank: usize, stderr: bool, lock: Arc<std::sync::Mutex<()>>) {
    let mut reader = BufReader::new(stream);
    let mut line = Vec::with_capacity(256);
    let prefix = format!("[{rank}] ");
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        // One line at a time, whole, so ranks' lines never interleave mid-line.
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let r = if stderr {
            let mut e = std::io::stderr().lock();
            e.write_all(prefix.as_bytes()).and_then(|()| e.write_all(&line))
        } else {
            let mut s = std::io::stdout().lock();
            s.write_all(prefix.as_bytes()).and_then(|()| s.write_all(&line)).and_then(|()| s.flush())
        };
        if r.is_err() {
            return;
        }
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        1 => " (SIGHUP)",
        2 => " (SIGINT)",
        3 => " (SIGQUIT)",
        4 => " (SIGILL)",
        6 => " (SIGABRT)",
        7 => " (SIGBUS)",
        8 => " (SIGFPE)",
        9 => " (SIGKILL)",
        11 => " (SIGSEGV)",
        13 => " (SIGPIPE)",
        15 => " (SIGTERM)",
        _ => "",
    }
}

/// How long ending a rank's leftovers may take before the guard gives up on them.
const END_PATIENCE: Duration = Duration::from_secs(10);

/// Runs `program` as the guard of a rank, and returns the exit code to exit with. The launcher
/// starts the guard as the leader of a new process group; the guard starts the rank program in
/// that group and waits for it.
///
/// The guard is a child subreaper (see `launch/reap.rs`): whatever the rank starts stays under
/// the guard, even when it leaves the group (`setsid`) or its parent. When the rank ends, the
/// guard kills everything the rank left running, so nothing a rank starts outlives it.
///
/// The guard asks the kernel for SIGTERM when the launcher dies. On SIGTERM or SIGINT it checks
/// whether the launcher is still its parent: if so, the signal was the launcher stopping the
/// job, which the rank received too (the guard passes it on to a rank that left the group), and
/// the guard keeps waiting; if not, the launcher is gone, and the guard kills the rank and
/// everything under it with SIGKILL. SIGUSR1 from the launcher, its last word to a rank that
/// will not stop, does the same.
///
/// A rank killed by a signal is reported by the guard killing itself with the same signal (or,
/// for SIGTERM and SIGINT, which it handles, exiting with 128 + the signal).
pub fn guard(program: &OsString, args: &[OsString]) -> i32 {
    let launcher = rustix::process::getppid();
    if let Err(e) = rustix::process::set_parent_process_death_signal(Some(Signal::TERM)) {
        eprintln_guard(&format!("cannot watch the launcher: {e}"));
    }
    if rustix::process::getppid() != launcher {
        return 1;
    }
    if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
        eprintln_guard(&format!("cannot adopt what the rank leaves behind: {e}"));
    }
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln_guard(&format!("cannot start: {e}"));
            return 1;
        }
    };
    rt.block_on(async {
        // Handlers first: once the rank runs, a SIGTERM with the default action would kill the
        // guard alone and leave the rank's children behind.
        let (Ok(mut term), Ok(mut int), Ok(mut end), Ok(mut child)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::user_defined1()),
            signal(SignalKind::child()),
        ) else {
            eprintln_guard("cannot install signal handlers");
            return 1;
        };
        if rustix::process::getppid() != launcher {
            return 1;
        }
        let mut cmd = std::process::Command::new(program);
        cmd.args(args);
        crate::sys::die_with_parent(&mut cmd);
        // The guard reaps its children itself (the rank, and the orphans it adopts).
        let rank = match cmd.spawn().map(|c| i32::try_from(c.id()).ok().and_then(rustix::process::Pid::from_raw)) {
            Ok(Some(pid)) => pid,
            Ok(None) => return 1,
            Err(e) => {
                eprintln_guard(&format!("cannot start {program:?}: {e}"));
                return 127;
            }
        };
        let status = std::cell::Cell::new(None);
        let mut seen = |pid, s| {
            if pid == rank {
                status.set(Some(s));
            }
        };
        loop {
            let sig = tokio::select! {
                _ = child.recv() => None,
                _ = term.recv() => Some(Signal::TERM),
                _ = int.recv() => Some(Signal::INT),
                _ = end.recv() => Some(Signal::USR1),
                // Signals of one kind merge: a look now and then misses no ended child.
                _ = tokio::time::sleep(Duration::from_secs(1)) => None,
            };
            let orphaned = rustix::process::getppid() != launcher;
            if orphaned || sig == Some(Signal::USR1) {
                reap::end_descendants(END_PATIENCE, &mut seen);
                if orphaned {
                    // The launcher is gone: nobody reads this code.
                    return 128 + Signal::TERM.as_raw();
                }
            } else if let Some(sig) = sig {
                // The launcher's TERM or INT reached the rank through the group, unless the
                // rank left it. The rank is not reaped yet, so its pid is still the rank's.
                if rustix::process::getpgid(Some(rank)).is_ok_and(|g| g != rustix::process::getpgrp()) {
                    let _ = rustix::process::kill_process(rank, sig);
                }
                tracing::trace!("guard: {sig:?} from the launcher; waiting for the rank");
            }
            reap::reap(&mut seen);
            if let Some(s) = status.get() {
                // Nothing the rank started outlives it.
                reap::end_descendants(END_PATIENCE, |_, _| {});
                return match Termination::from_parts(s.exit_status(), s.terminating_signal()) {
                    Termination::Exit(c) => c,
                    Termination::Signal(s) => {
                        if let Some(sig) = Signal::from_named_raw(s).filter(|&g| g != Signal::TERM && g != Signal::INT)
                        {
                            let _ = rustix::process::kill_process(rustix::process::getpid(), sig);
                        }
                        128 + s
                    }
                };
            }
        }
    })
}

#[allow(clippy::print_stderr, reason = "the guard has no caller to return errors to but its rank's stderr")]
fn eprintln_guard(msg: &str) {
    eprintln!("symmem guard: {msg}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_blocks_split_the_cpus_evenly_or_take_them_round() {
        assert_eq!(cpu_blocks(4, 2), [(0, 2), (2, 4)]);
        assert_eq!(cpu_blocks(5, 2), [(0, 2), (2, 5)]);
        assert_eq!(cpu_blocks(64, 3), [(0, 21), (21, 42), (42, 64)]);
        assert_eq!(cpu_blocks(2, 2), [(0, 1), (1, 2)]);
        // More ranks than CPUs: a CPU per block; ranks take them round.
        assert_eq!(cpu_blocks(2, 5), [(0, 1), (1, 2)]);
        assert_eq!(cpu_blocks(1, 1), [(0, 1)]);
    }

    fn listed(s: &rustix::thread::CpuSet) -> Vec<usize> {
        (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| s.is_set(c)).collect()
    }

    #[test]
    fn a_played_hosts_ranks_get_their_machine_wide_shares() {
        let mine = listed(&rustix::thread::sched_getaffinity(None).unwrap());
        let mut o = LaunchOptions::local(2, "true", Vec::new());
        o.bind = Bind::Cores;
        let alone = cpu_shares(&o).unwrap();
        // A launcher whose 2 ranks are ranks 1 and 2 of 3 on the machine: not the shares of
        // local ranks 0 and 1 (on 2 or more CPUs).
        o.bind = Bind::CoresFrom { first: 1, of: 3 };
        let later = cpu_shares(&o).unwrap();
        let blocks = cpu_blocks(mine.len(), 3);
        for (local, share) in later.iter().enumerate() {
            let (from, to) = blocks[(1 + local) % blocks.len()];
            assert_eq!(listed(share), mine[from..to], "local rank {local}");
        }
        let blocks = cpu_blocks(mine.len(), 2);
        for (local, share) in alone.iter().enumerate() {
            let (from, to) = blocks[local];
            assert_eq!(listed(share), mine[from..to]);
        }
        o.bind = Bind::None;
        assert!(cpu_shares(&o).unwrap().is_empty());
        // Ranks past the machine's count, or a count that overflows, are refused by name.
        for (first, of) in [(3, 4), (usize::MAX, usize::MAX)] {
            o.bind = Bind::CoresFrom { first, of };
            let e = cpu_shares(&o).unwrap_err().to_string();
            assert!(e.contains("cannot bind ranks") && e.contains(&format!("of {of}")), "{e}");
        }
    }
}
