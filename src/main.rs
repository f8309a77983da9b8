//! The `symmem` command: parses arguments, calls the library, maps outcomes to exit codes.
#![allow(clippy::print_stdout, reason = "the command prints its results; the library never does")]

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use symmem::bench::{self, BenchResult, StoreBenchOptions};
use symmem::launch::{self, LaunchOptions};
use symmem::store::{Secret, ServerOptions, StoreServer};

#[derive(Parser)]
#[command(name = "symmem", version, about = "Symmetric memory and one-sided transports for CPU processes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Launch N ranks of PROGRAM on this host (one host's share of a job), like torchrun.
    Run(RunArgs),
    /// The main job: launch ranks that rendezvous through the store, barrier, and report timings.
    Demo {
        /// Ranks to launch.
        #[arg(short = 'n', long, default_value_t = 2)]
        nproc: usize,
    },
    /// One rank of the demo (started by `symmem demo`).
    #[command(hide = true)]
    DemoRank,
    /// Guard a rank's process group (started by `symmem run`).
    #[command(name = "__guard", hide = true)]
    Guard {
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
    /// Run a standalone store server (PyTorch TCPStore protocol).
    Store(StoreArgs),
    /// Version, backends, limits, and every configuration knob.
    Info,
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Ranks on this host.
    #[arg(short = 'n', long = "nproc-per-node", default_value_t = 1)]
    nproc: usize,
    /// Hosts in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This host's index (node 0 hosts the store).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of the store host, as the ranks reach it.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the store (0: pick a free one; single-host jobs only).
    #[arg(long, default_value_t = 0)]
    master_port: u16,
    /// Stop the job and exit 124 if it runs longer than this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

#[derive(Args)]
struct StoreArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    host: String,
    /// Port to listen on (0: pick one and print it).
    #[arg(long, default_value_t = 29500)]
    port: u16,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Store throughput (set, get, add with K clients) and rendezvous of N simulated ranks.
    Store {
        /// One JSON object per result line instead of a table.
        #[arg(long)]
        json: bool,
        /// Concurrent client counts for the throughput runs.
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4, 16, 64])]
        clients: Vec<usize>,
        /// Operations per client.
        #[arg(long, default_value_t = 2000)]
        ops: usize,
        /// Value size in bytes for set and get.
        #[arg(long, default_value_t = 64)]
        bytes: usize,
        /// Simulated rank counts for the rendezvous runs.
        #[arg(long, value_delimiter = ',', default_values_t = [2usize, 16, 128, 1024, 4096])]
        ranks: Vec<usize>,
        /// Largest rank count measured with per-key gets (N² requests).
        #[arg(long, default_value_t = 1024)]
        per_key_max: usize,
        /// Benchmark the store at HOST:PORT (e.g. a PyTorch TCPStore) instead of a local one.
        #[arg(long)]
        addr: Option<String>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("SYMMEM_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match dispatch(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("symmem: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn dispatch(command: Command) -> Result<ExitCode> {
    match command {
        Command::Run(args) => run(args),
        Command::Demo { nproc } => demo(nproc),
        Command::DemoRank => demo_rank().map(|()| ExitCode::SUCCESS),
        Command::Guard { command } => Ok(exit_code(launch::guard(&command[0], &command[1..]))),
        Command::Store(args) => store(args),
        Command::Info => {
            info();
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench { which: BenchCommand::Store { json, clients, ops, bytes, ranks, per_key_max, addr } } => {
            let options = StoreBenchOptions {
                clients,
                ops_per_client: ops,
                value_bytes: bytes,
                rendezvous_ranks: ranks,
                per_key_max_ranks: per_key_max,
                addr,
                secret: Secret::from_env(),
            };
            let mut table = Table::new(json);
            bench::store(&options, |r| table.row(&r))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}

fn launch_and_report(options: &LaunchOptions) -> Result<ExitCode> {
    let mut options = options.clone();
    let exe = std::env::current_exe().context("find the symmem executable")?;
    options.guard = Some((exe.into(), vec!["__guard".into(), "--".into()]));
    let outcome = launch::run(&options)?;
    if outcome != launch::Outcome::Success {
        eprintln!("symmem run: {outcome}");
    }
    Ok(exit_code(outcome.exit_code()))
}

fn run(args: RunArgs) -> Result<ExitCode> {
    let mut command = args.command.into_iter();
    let Some(program) = command.next() else { bail!("no program given") };
    let timeout = args
        .timeout
        .map(|s| Duration::try_from_secs_f64(s).context("--timeout must be a non-negative number of seconds"))
        .transpose()?;
    let options = LaunchOptions {
        nproc_per_node: args.nproc,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        timeout,
        secret: None,
        program,
        args: command.collect(),
        env: Vec::new(),
        guard: None,
    };
    launch_and_report(&options)
}

fn demo(nproc: usize) -> Result<ExitCode> {
    let exe = std::env::current_exe().context("find the symmem executable")?;
    println!("symmem demo: launching {nproc} ranks of {} on this host", exe.display());
    let mut options = LaunchOptions::local(nproc, exe, vec!["demo-rank".into()]);
    options.timeout = Some(Duration::from_secs(120));
    launch_and_report(&options)
}

fn demo_rank() -> Result<()> {
    let t = Instant::now();
    let group = symmem::Group::from_env().context("join the job")?;
    let joined = t.elapsed();
    let (rank, world) = (group.rank(), group.world_size());
    println!(
        "rank {rank}/{world}: joined the store at {} in {:.2} ms",
        std::env::var("MASTER_ADDR").unwrap_or_default() + ":" + &std::env::var("MASTER_PORT").unwrap_or_default(),
        joined.as_secs_f64() * 1e3
    );

    let host = rustix::system::uname().nodename().to_string_lossy().into_owned();
    let me = format!("{host}/pid {}", std::process::id());
    let t = Instant::now();
    let everyone = group.all_gather_bytes("whoami", me.as_bytes())?;
    let gathered = t.elapsed();
    if rank == 0 {
        let list: Vec<String> =
            everyone.iter().enumerate().map(|(r, v)| format!("{r}={}", String::from_utf8_lossy(v))).collect();
        println!("rank 0: all-gather through the store in {:.2} ms: {}", gathered.as_secs_f64() * 1e3, list.join(", "));
    }

    let timeout = Duration::from_secs(30);
    for _ in 0..10 {
        group.barrier(timeout)?;
    }
    let mut lat = Vec::with_capacity(200);
    for _ in 0..200 {
        let t = Instant::now();
        group.barrier(timeout)?;
        lat.push(t.elapsed());
    }
    let (median, p99) = bench::percentiles(&mut lat);
    println!("rank {rank}: 200 store barriers: median {median:.0} us, p99 {p99:.0} us");
    group.barrier(timeout)?;
    if rank == 0 {
        println!("rank 0: done: {world} ranks joined, exchanged identities and synchronized");
    }
    Ok(())
}

fn store(args: StoreArgs) -> Result<ExitCode> {
    let secret = Secret::from_env();
    let authed = secret.is_some();
    let addr = format!("{}:{}", args.host, args.port);
    let server = StoreServer::start(&addr, ServerOptions { secret, ..Default::default() })?;
    println!(
        "symmem store listening on {} ({})",
        server.local_addr(),
        if authed {
            "shared-secret authentication on"
        } else {
            "no authentication; set SYMMEM_STORE_SECRET to require it"
        }
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    })?;
    drop(server);
    Ok(ExitCode::SUCCESS)
}

fn info() {
    println!("symmem {}", env!("CARGO_PKG_VERSION"));
    println!();
    println!("backends");
    println!("  store      tcp: PyTorch TCPStore protocol (torch 2.15), server and client; needs a reachable TCP port");
    println!("  transport  tcp, shm: not built yet (see the issue tracker)");
    println!("  symmetric  cpu shared memory: not built yet; needs /dev/shm");
    println!();
    println!("this machine");
    let uname = rustix::system::uname();
    println!("  kernel            {} {}", uname.sysname().to_string_lossy(), uname.release().to_string_lossy());
    println!("  cpus              {}", std::thread::available_parallelism().map_or(0, |n| n.get()));
    match rustix::fs::statvfs("/dev/shm") {
        Ok(s) => println!(
            "  /dev/shm          {:.1} GiB total, {:.1} GiB free",
            (s.f_blocks * s.f_frsize) as f64 / (1u64 << 30) as f64,
            (s.f_bavail * s.f_frsize) as f64 / (1u64 << 30) as f64
        ),
        Err(e) => println!("  /dev/shm          unavailable: {e}"),
    }
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    println!(
        "  open files        soft {}, hard {} (a store needs one per client)",
        nofile.current.map_or("unlimited".into(), |v| v.to_string()),
        nofile.maximum.map_or("unlimited".into(), |v| v.to_string())
    );
    let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").map(|s| s.trim().to_string());
    println!(
        "  ptrace_scope      {}",
        yama.unwrap_or_else(|_| "no Yama (cross-memory attach allowed for same uid)".into())
    );
    let l = symmem::wire::store::Limits::SERVER;
    println!();
    println!("limits");
    println!("  store key         {} bytes", l.max_key_len);
    println!("  store value       {} bytes", l.max_value_len);
    println!("  keys per message  {}", l.max_keys);
    println!();
    println!("configuration (environment variable, default: meaning)");
    for k in symmem::config::KNOBS {
        println!("  {:<30} {:<12} {}", k.env, k.default, k.doc);
    }
}

/// Prints bench results as a table, or as JSON lines.
struct Table {
    json: bool,
    header: bool,
}

impl Table {
    fn new(json: bool) -> Table {
        Table { json, header: false }
    }

    fn row(&mut self, r: &BenchResult) {
        if self.json {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
            return;
        }
        if !self.header {
            println!(
                "{:<22} {:>6} {:>8} {:>7} {:>11} {:>11} {:>12}  extra",
                "bench", "ranks", "bytes", "iters", "lat_us", "p99_us", "ops_per_s"
            );
            self.header = true;
        }
        let ops = r.extra.get("ops_per_s").and_then(|v| v.as_f64()).map_or("-".into(), |v| format!("{v:.0}"));
        let extra: Vec<String> =
            r.extra.iter().filter(|(k, _)| *k != "ops_per_s").map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{:<22} {:>6} {:>8} {:>7} {:>11.1} {:>11.1} {:>12}  {}",
            r.bench,
            r.ranks,
            r.bytes.map_or("-".into(), |b| b.to_string()),
            r.iters,
            r.lat_us,
            r.p99_us,
            ops,
            extra.join(" ")
        );
    }
}
