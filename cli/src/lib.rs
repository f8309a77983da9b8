//! The `symmem` command: parses arguments, calls the library, maps outcomes to exit codes.
//!
//! A library so that the same command ships in two ways: the `symmem` binary (`cargo install`)
//! and the Python wheel's `symmem` console script, which calls [`main_with`] through the
//! extension module.

mod bench;

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bench::{BenchResult, StoreBenchOptions};
use clap::{Args, Parser, Subcommand};
use symmem::launch::{self, LaunchOptions};
use symmem::ops::{self, ReduceOp};
use symmem::store::{Secret, ServerOptions, StoreServer};
use symmem::symm::{self, Device};
use symmem::tensor::{DType, Tensor};
use symmem::transport::{Options, RemoteBuffer, new_transport_rank};

/// Prints a line to stdout; a closed stdout (`symmem ... | head`) ends the program quietly.
macro_rules! say {
    () => { emit(format_args!("")) };
    ($($arg:tt)*) => { emit(format_args!($($arg)*)) };
}

fn emit(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if out.write_fmt(line).and_then(|()| out.write_all(b"\n")).and_then(|()| out.flush()).is_err() {
        std::process::exit(0);
    }
}

#[derive(Parser)]
#[command(name = "symmem", version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("CLI_GIT_COMMIT"), ")"), about = "Symmetric memory and one-sided transports for CPU processes")]
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
        /// Ranks to launch (per host, with --hosts).
        #[arg(short = 'n', long, default_value_t = 2)]
        nproc: usize,
        /// Play this many hosts on this machine: one launcher per host, and ranks on different
        /// "hosts" reach each other only through the tcp transport, as on separate machines.
        #[arg(long, default_value_t = 1)]
        hosts: usize,
    },
    /// One rank of the demo (started by `symmem demo`).
    #[command(hide = true)]
    DemoRank,
    /// One rank of `symmem bench signal`.
    #[command(name = "__bench-signal-rank", hide = true)]
    BenchSignalRank {
        #[arg(long)]
        iters: usize,
        /// Pin each rank to its own core and time only the ping-pong.
        #[arg(long)]
        pin: bool,
    },
    /// One rank of the flag ping-pong baseline of `symmem bench signal`.
    #[command(name = "__bench-flag-rank", hide = true)]
    BenchFlagRank {
        #[arg(long)]
        iters: usize,
        /// Pin each rank to its own core.
        #[arg(long)]
        pin: bool,
    },
    /// One rank of `symmem bench <collective>`.
    #[command(name = "__bench-op-rank", hide = true)]
    BenchOpRank {
        #[arg(long)]
        op: String,
        #[arg(long)]
        algo: String,
        #[arg(long)]
        dtype: String,
        #[arg(long)]
        iters: usize,
        #[arg(long)]
        warmup: usize,
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<usize>,
        #[arg(long)]
        pin: bool,
    },
    /// One rank of `symmem bench transport`.
    #[command(name = "__bench-transport-rank", hide = true)]
    BenchTransportRank {
        #[arg(long)]
        backend: String,
        #[arg(long)]
        window: usize,
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<usize>,
    },
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
    /// Print sizes (as `--sizes` takes them) in bytes, space-separated: the one size parser,
    /// for the scripts under bench/.
    #[command(name = "__sizes", hide = true)]
    Sizes {
        #[arg(required = true, num_args = 1.., allow_hyphen_values = true, value_parser = sizes_arg)]
        sizes: Vec<Sizes>,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Ranks on this host (torchrun's --nproc-per-node).
    #[arg(
        short = 'n',
        long = "nproc",
        visible_alias = "nproc-per-node",
        alias = "nproc_per_node",
        default_value_t = 1
    )]
    nproc: usize,
    /// Hosts in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This host's index (node 0 hosts the store).
    #[arg(long, alias = "node_rank", default_value_t = 0)]
    node_rank: usize,
    /// Address of the store host, as the ranks reach it.
    #[arg(long, alias = "master_addr", default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the store (0: pick a free one; single-host jobs only).
    #[arg(long, alias = "master_port", default_value_t = 0)]
    master_port: u16,
    /// Stop the job and exit 124 if it runs longer than this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// The job's secret, from this file (mode 0600) [default: SYMMEM_STORE_SECRET; else a random
    /// one on one host, this user's key (~/.config/symmem/secret) across hosts].
    #[arg(long, conflicts_with = "no_auth")]
    secret_file: Option<std::path::PathBuf>,
    /// Run the job's store without a secret, for PyTorch ranks on other hosts (which cannot
    /// authenticate): anyone who reaches it can read and change the job's keys.
    #[arg(long)]
    no_auth: bool,
    /// Bind each rank to CPUs of its own: `cores` splits the CPUs this launcher may use into
    /// equal blocks, one per rank on this host (more ranks than CPUs: a CPU each, taken round),
    /// as mpirun binds; `none` leaves them to the scheduler, as torchrun does.
    #[arg(long, value_enum, default_value_t = BindArg::None)]
    bind: BindArg,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

/// `symmem run --bind`'s values (see [`launch::Bind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum BindArg {
    /// Where the scheduler puts them.
    None,
    /// A block of CPUs of its own for each rank.
    Cores,
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
struct StoreArgs {
    /// Talk to a running store instead of serving one.
    #[command(subcommand)]
    client: Option<StoreClientCommand>,
    /// Address to listen on [default: every interface; 127.0.0.1 with --no-auth].
    #[arg(long)]
    host: Option<String>,
    /// Port to listen on (0: pick one and print it).
    #[arg(long, default_value_t = 29500)]
    port: u16,
    /// Read the shared secret from this file (mode 0600) [default: SYMMEM_STORE_SECRET, else
    /// this user's key, ~/.config/symmem/secret, made on first use].
    #[arg(long, conflicts_with = "no_auth")]
    secret_file: Option<std::path::PathBuf>,
    /// Serve without a secret, for PyTorch clients on other hosts (they cannot authenticate):
    /// anyone who reaches the port can then read and change every key. Other users' processes
    /// on this host are refused all the same.
    #[arg(long)]
    no_auth: bool,
}

/// One store operation from a shell script; keys are named as PyTorch's client names them.
#[derive(Subcommand)]
enum StoreClientCommand {
    /// Print the value of KEY, waiting for it to exist.
    Get {
        key: String,
        #[command(flatten)]
        at: StoreAt,
    },
    /// Set KEY to VALUE.
    Set {
        key: String,
        value: String,
        #[command(flatten)]
        at: StoreAt,
    },
    /// Add DELTA to the integer at KEY and print the result.
    Add {
        key: String,
        #[arg(allow_hyphen_values = true)]
        delta: i64,
        #[command(flatten)]
        at: StoreAt,
    },
    /// Wait until every KEY exists.
    Wait {
        #[arg(required = true)]
        keys: Vec<String>,
        #[command(flatten)]
        at: StoreAt,
    },
    /// Check that the store answers; print the round-trip time.
    Ping {
        #[command(flatten)]
        at: StoreAt,
    },
}

#[derive(Args)]
struct StoreAt {
    /// The store's HOST:PORT.
    #[arg(long, env = "SYMMEM_STORE_ADDR")]
    addr: String,
    /// Prove the secret in this file (mode 0600) [default: SYMMEM_STORE_SECRET, if set]. Not
    /// needed by this user's processes on the store's host.
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
    /// Seconds to wait (for keys, and for the store to answer).
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
}

#[derive(Args, Clone)]
struct CollectiveArgs {
    /// One JSON object per result line instead of a table.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Comma-separated values with a header line instead of a table.
    #[arg(long)]
    csv: bool,
    /// Ranks to launch (in all).
    #[arg(short = 'n', long = "nproc", visible_alias = "ranks", default_value_t = 2)]
    nproc: usize,
    /// Hosts to play on this machine: the ranks split evenly over them, and ranks on different
    /// "hosts" reach each other through the transport SYMMEM_XHOST_BACKEND names (tcp).
    #[arg(long, default_value_t = 1)]
    hosts: usize,
    /// Message sizes: bytes with an optional unit (B, K or KiB, M or MiB, G or GiB; powers of
    /// 1024), separated by commas or spaces. As nccl-tests counts them: all-reduce, the tensor;
    /// all-gather, the gathered output; reduce-scatter and all-to-all, each rank's input.
    #[arg(long, num_args = 1.., value_parser = sizes_arg, default_value = "8,4K,64K,1M,16M")]
    sizes: Vec<Sizes>,
    /// Element type.
    #[arg(long, default_value = "float32", value_parser = dtype_arg)]
    dtype: DType,
    /// Timed iterations per size (fewer for large messages: at most 256 MiB moved per size).
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Untimed iterations before timing.
    #[arg(long, default_value_t = 100)]
    warmup: usize,
    /// Bind each rank's calling thread to a core of its own (rank modulo the CPUs), as mpirun
    /// binds its ranks, once its links exist (its transport threads stay free); rows say so.
    #[arg(long)]
    pin: bool,
    /// Also draw latency and bus bandwidth against size into this file (.png or .svg).
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Skip the baseline: all-reduce and all-to-all on one host also run Open MPI's
    /// MPI_Allreduce / MPI_Alltoall at the same sizes and rank count when mpicc and mpirun are
    /// installed.
    #[arg(long)]
    no_baseline: bool,
}

/// The all-reduce algorithms `--algo` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum AllReduceAlgo {
    /// What `ops::all_reduce` picks: on one host, one-shot up to 1 KiB (up to 8 KiB when ranks
    /// outnumber cores), two-shot above; across hosts, host-push for small messages.
    Auto,
    /// Every rank reads every peer's input (one_shot_all_reduce).
    #[value(name = "one_shot", alias = "one-shot")]
    OneShot,
    /// Reduce-scatter then all-gather (two_shot_all_reduce_).
    #[value(name = "two_shot", alias = "two-shot")]
    TwoShot,
}

impl AllReduceAlgo {
    fn name(self) -> &'static str {
        match self {
            AllReduceAlgo::Auto => "auto",
            AllReduceAlgo::OneShot => "one_shot",
            AllReduceAlgo::TwoShot => "two_shot",
        }
    }
}

#[derive(Args, Clone)]
struct AllReduceArgs {
    #[command(flatten)]
    common: CollectiveArgs,
    /// The algorithm.
    #[arg(long, value_enum, default_value_t = AllReduceAlgo::Auto)]
    algo: AllReduceAlgo,
}

/// Message sizes, from one command-line value.
#[derive(Clone, Debug)]
struct Sizes(Vec<usize>);

/// Flattens every `--sizes` value into one list.
fn flat(sizes: &[Sizes]) -> Vec<usize> {
    sizes.iter().flat_map(|s| s.0.iter().copied()).collect()
}

/// A size in bytes: digits with an optional unit, B, K or KiB, M or MiB, G or GiB (powers of
/// 1024, any case), checked for overflow.
fn size_arg(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        _ => 0,
    };
    num.parse::<usize>().ok().filter(|_| mult != 0).and_then(|n| n.checked_mul(mult)).ok_or_else(|| {
        format!(
            "size {t:?} is not a number of bytes that fits in memory (digits with an optional unit: B, K or KiB, \
             M or MiB, G or GiB)"
        )
    })
}

/// One or more sizes separated by commas or spaces.
fn sizes_arg(s: &str) -> std::result::Result<Sizes, String> {
    let v = s.split(|c: char| c == ',' || c.is_whitespace()).filter(|p| !p.is_empty()).map(size_arg);
    let v = v.collect::<std::result::Result<Vec<_>, _>>()?;
    if v.is_empty() {
        return Err("no sizes given".into());
    }
    Ok(Sizes(v))
}

/// An element type by PyTorch's name (`float32`, `bfloat16`, ...) or its short one (`f32`).
fn dtype_arg(s: &str) -> std::result::Result<DType, String> {
    bench::parse_dtype(s).map_err(|_| {
        let valid: Vec<String> =
            DType::ALL.iter().map(|d| format!("{d} ({})", format!("{d:?}").to_lowercase())).collect();
        format!("unknown dtype {s:?}; valid: {}", valid.join(", "))
    })
}

fn bench_collective(op: &str, a: &CollectiveArgs, algo: AllReduceAlgo) -> Result<u8> {
    let sizes = flat(&a.sizes);
    let options = bench::OpBenchOptions {
        op: op.into(),
        algo: algo.name().into(),
        ranks: a.nproc,
        sizes: sizes.clone(),
        dtype: a.dtype,
        iters: a.iters,
        warmup: a.warmup,
        exe: self_exe()?,
        hosts: a.hosts,
        pin: a.pin,
    };
    let mut table = Table::new(Format::of(a.json, a.csv));
    // A progress bar on a terminal only (indicatif draws nothing when stderr is not one).
    let bar = indicatif::ProgressBar::new(sizes.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} [{bar:20}] {pos}/{len} sizes, {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(format!("{op} on {} ranks", options.ranks));
    bar.enable_steady_tick(Duration::from_millis(120));
    let mut rows = Vec::new();
    let baseline = !a.no_baseline
        && a.hosts <= 1
        && matches!(op, "all_reduce" | "all_to_all")
        && a.dtype == DType::F32
        && bench::have_open_mpi();
    if baseline {
        bar.set_length(2 * sizes.len() as u64);
    }
    let mut show = |r: BenchResult| {
        bar.suspend(|| table.row(&r));
        bar.inc(1);
        rows.push(r);
    };
    let result = bench::collective(&options, &mut show);
    let result = result.and_then(|()| {
        if baseline {
            bar.set_message(format!("Open MPI's {op} on {} ranks (the baseline)", options.ranks));
            bench::open_mpi(op, options.ranks, &sizes, &mut show)
        } else {
            Ok(())
        }
    });
    bar.finish_and_clear();
    result?;
    if !baseline && !a.no_baseline && matches!(op, "all_reduce" | "all_to_all") && a.hosts <= 1 {
        eprintln!(
            "symmem bench: no baseline ({}; bench/compare_mpi.sh installs Open MPI)",
            if a.dtype != DType::F32 { "Open MPI's is measured for float32 only" } else { "Open MPI is not installed" }
        );
    }
    if let Some(path) = &a.plot {
        bench::plot(&rows, path)?;
        eprintln!("symmem bench: plotted {}", path.display());
    }
    Ok(SUCCESS)
}

/// Rows of a benchmark whose count is not known ahead, printed as they come, with a spinner on
/// a terminal.
fn bench_rows(
    what: &str,
    format: Format,
    plot: Option<&std::path::Path>,
    run: impl FnOnce(&mut dyn FnMut(BenchResult)) -> symmem::Result<()>,
) -> Result<u8> {
    let mut table = Table::new(format);
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(what.to_string());
    spinner.enable_steady_tick(Duration::from_millis(120));
    let mut rows = Vec::new();
    let result = run(&mut |r| {
        spinner.suspend(|| table.row(&r));
        rows.push(r);
    });
    spinner.finish_and_clear();
    result?;
    if let Some(path) = plot {
        bench::plot(&rows, path)?;
        eprintln!("symmem bench: plotted {}", path.display());
    }
    Ok(SUCCESS)
}

/// How results print: `--json`, `--csv`, or a table.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Table,
    Json,
    Csv,
}

impl Format {
    fn of(json: bool, csv: bool) -> Format {
        if json {
            Format::Json
        } else if csv {
            Format::Csv
        } else {
            Format::Table
        }
    }
}

/// `--json` and `--csv`, for benchmarks that take no other common argument.
#[derive(Args, Clone, Copy)]
struct OutputArgs {
    /// One JSON object per result line instead of a table.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Comma-separated values with a header line instead of a table.
    #[arg(long)]
    csv: bool,
}

impl OutputArgs {
    fn format(self) -> Format {
        Format::of(self.json, self.csv)
    }
}

/// What the collectives' columns mean (nccl-tests' definitions).
const COLLECTIVE_FIELDS: &str =
    "Columns (one row per size, printed as each finishes; --json and --csv carry the same names):
  size      bytes: all-reduce and broadcast, the tensor; all-gather, the gathered output;
            reduce-scatter (and -offset) and all-to-all, each rank's input (as nccl-tests counts
            them)
  count     elements of dtype in size
  time_us   median time of one call (rank 0's view), p99_us its 99th percentile
  algbw     size / time_us, GB/s (10^9 bytes per second)
  busbw     algbw x the collective's factor on n ranks: all-reduce 2(n-1)/n; all-gather,
            reduce-scatter, all-to-all (n-1)/n; broadcast 1; comparable with the hardware's link
            bandwidth
  algo      the algorithm that ran";

#[derive(Subcommand)]
enum BenchCommand {
    /// All-reduce on symmetric memory (one-shot, two-shot, or picked by size).
    #[command(after_help = COLLECTIVE_FIELDS)]
    AllReduce(AllReduceArgs),
    /// All-gather into a tensor.
    #[command(after_help = COLLECTIVE_FIELDS)]
    AllGather(CollectiveArgs),
    /// Reduce-scatter.
    #[command(after_help = COLLECTIVE_FIELDS)]
    ReduceScatter(CollectiveArgs),
    /// Fused all-gather-matmul (fused_all_gather_matmul) of [1, n] shards, gathered along rows,
    /// times an [n, 8] matrix; sizes are the gathered A's.
    #[command(after_help = COLLECTIVE_FIELDS)]
    AllGatherMatmul(CollectiveArgs),
    /// Fused matmul-reduce-scatter (fused_matmul_reduce_scatter) of a [ranks, 8] x [8, n / ranks]
    /// product, along its rows; sizes are the product's.
    #[command(after_help = COLLECTIVE_FIELDS)]
    MatmulReduceScatter(CollectiveArgs),
    /// Reduce-scatter-offset (nccl_reduce_scatter_offset) of a [ranks, n] input along its rows,
    /// one row per rank.
    #[command(after_help = COLLECTIVE_FIELDS)]
    ReduceScatterOffset(CollectiveArgs),
    /// Tile reduction (tile_reduce) to rank 0 of the left half of every rank's [rows, 2 x cols]
    /// symmetric matrix (a strided tile of up to 256 columns); sizes are the tile's.
    #[command(after_help = COLLECTIVE_FIELDS)]
    TileReduce(CollectiveArgs),
    /// Tile reductions to every rank at once (multi_root_tile_reduce): of every rank's [rows,
    /// ranks x cols] symmetric matrix, tile i (columns i x cols.., up to 256 columns) reduced
    /// into rank i's out; sizes are a tile's.
    #[command(after_help = COLLECTIVE_FIELDS)]
    MultiRootTileReduce(CollectiveArgs),
    /// Equal-split all-to-all.
    #[command(after_help = COLLECTIVE_FIELDS)]
    AllToAll(CollectiveArgs),
    /// All-to-all between dimensions (nccl_all_to_all_nd) of a [ranks, n] input: scattered
    /// along its rows, gathered along its columns.
    #[command(after_help = COLLECTIVE_FIELDS)]
    AllToAllNd(CollectiveArgs),
    /// All-to-all with per-peer splits (all_to_all_vdev), equal splits.
    #[command(after_help = COLLECTIVE_FIELDS)]
    AllToAllV(CollectiveArgs),
    /// Broadcast from rank 0, in place (nvshmem_broadcast); timed on the slowest rank.
    #[command(after_help = COLLECTIVE_FIELDS)]
    Broadcast(CollectiveArgs),
    /// One-sided write and read latency and bandwidth between two processes, next to the
    /// baselines of the same run: a plain TCP stream and ping-pong (blocking, and both sides
    /// busy-polling) between the same two processes (cross-host backends), memcpy and
    /// process_vm_writev (same-host ones).
    #[command(after_help = "Columns: time_us is the median time of one transfer (one at a time) and p99_us its 99th
percentile; algbw = busbw = size / time_us (GB/s); stream_gbps is the bandwidth with --window
transfers in flight (for the TCP stream: the stream's own, and time_us is its mean per message).")]
    Transport {
        #[command(flatten)]
        output: OutputArgs,
        /// The transport backend (see `symmem info`).
        #[arg(long, default_value = "tcp")]
        backend: String,
        /// Message sizes: bytes with an optional unit (B, K or KiB, M or MiB, G or GiB; powers
        /// of 1024), separated by commas or spaces.
        #[arg(long, num_args = 1.., value_parser = sizes_arg, default_value = "8,4K,64K,1M,16M,64M")]
        sizes: Vec<Sizes>,
        /// Transfers in flight for the bandwidth runs.
        #[arg(long, default_value_t = 8)]
        window: usize,
        /// Also draw latency and bandwidth against size into this file (.png or .svg).
        #[arg(long)]
        plot: Option<std::path::PathBuf>,
    },
    /// Signal-pad ping-pong (2 ranks) and barrier latency (2 to 8 ranks), next to a plain
    /// shared-memory flag ping-pong between two pinned processes.
    Signal {
        #[command(flatten)]
        output: OutputArgs,
        /// Rank counts for the barrier runs, separated by commas or spaces.
        #[arg(short = 'n', long = "nproc", visible_alias = "ranks", num_args = 1.., value_parser = counts_arg, default_value = "2,4,8")]
        nproc: Vec<Counts>,
        /// Measured iterations per run.
        #[arg(long, default_value_t = 10000)]
        iters: usize,
        /// Play this many hosts: the ranks of the signal runs split evenly over them, so the
        /// ping-pongs cross hosts (the flag baseline, plain shared memory, stays on one host).
        #[arg(long, default_value_t = 1)]
        hosts: usize,
    },
    /// Rendezvous at scale: N simulated ranks exchange real rendezvous records through a store,
    /// with per-key gets (PyTorch's default), one multi-get each (symmem's default), and through
    /// rank 0 (`SYMMEM_RENDEZVOUS=gather`, PyTorch's `use_pg_for_symm_mem_rendezvous`).
    Rendezvous {
        #[command(flatten)]
        output: OutputArgs,
        /// Simulated rank counts, separated by commas or spaces.
        #[arg(short = 'n', long = "nproc", visible_alias = "ranks", num_args = 1.., value_parser = counts_arg, default_value = "2,16,128,1024,4096")]
        nproc: Vec<Counts>,
        /// Largest rank count measured with per-key gets (N² requests).
        #[arg(long, default_value_t = 1024)]
        per_key_max: usize,
    },
    /// Link setup at scale: H simulated hosts of R ranks exchange their link URLs through a
    /// real store as cross-host groups do (a MULTI_SET, a MULTI_GET, a DELETE_MANY per rank),
    /// in today's layout (every rank to every rank on another host) and with leaders only; with
    /// the time, the store's keys and what a linking rank would hold, and today's layout
    /// extrapolated to the largest host count.
    LinkSetup {
        #[command(flatten)]
        output: OutputArgs,
        /// Simulated host counts, separated by commas or spaces.
        #[arg(long, num_args = 1.., value_parser = counts_arg, default_value = "4,16,64,256,1024")]
        hosts: Vec<Counts>,
        /// Ranks per simulated host.
        #[arg(long, default_value_t = 8)]
        per_host: usize,
        /// Largest rank count run in today's layout (its keys grow with the square of the ranks).
        #[arg(long, default_value_t = 512)]
        all_pairs_max: usize,
    },
    /// Store throughput (set, get, add with K clients) and rendezvous of N simulated ranks.
    Store {
        #[command(flatten)]
        output: OutputArgs,
        /// Concurrent client counts for the throughput runs, separated by commas or spaces.
        #[arg(long, num_args = 1.., value_parser = counts_arg, default_value = "1,4,16,64")]
        clients: Vec<Counts>,
        /// Operations per client.
        #[arg(long, default_value_t = 2000)]
        ops: usize,
        /// Value size for set and get (bytes, units as for --sizes elsewhere).
        #[arg(long, value_parser = size_arg, default_value = "64")]
        bytes: usize,
        /// Simulated rank counts for the rendezvous runs, separated by commas or spaces.
        #[arg(short = 'n', long = "nproc", visible_alias = "ranks", num_args = 1.., value_parser = counts_arg, default_value = "2,16,128,1024,4096")]
        nproc: Vec<Counts>,
        /// Largest rank count measured with per-key gets (N² requests).
        #[arg(long, default_value_t = 1024)]
        per_key_max: usize,
        /// Benchmark the store at HOST:PORT (e.g. a PyTorch TCPStore) instead of a local one.
        #[arg(long)]
        addr: Option<String>,
    },
}

/// Counts (ranks, clients), from one command-line value.
#[derive(Clone, Debug)]
struct Counts(Vec<usize>);

/// One or more positive counts separated by commas or spaces.
fn counts_arg(s: &str) -> std::result::Result<Counts, String> {
    let v = s
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| format!("{p:?} is not a positive count")))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if v.is_empty() {
        return Err("no counts given".into());
    }
    Ok(Counts(v))
}

fn flat_counts(c: &[Counts]) -> Vec<usize> {
    c.iter().flat_map(|c| c.0.iter().copied()).collect()
}

/// The commit this command was built from (`git describe`-like; "unknown" outside a git tree).
pub const COMMIT: &str = env!("CLI_GIT_COMMIT");

/// The exit status of a command that succeeded.
const SUCCESS: u8 = 0;

/// The program to start again for a rank, a guard or a benchmark job: this binary, or the
/// wheel's console script (set by [`main_with`]).
static SELF_EXE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

fn self_exe() -> Result<std::path::PathBuf> {
    match SELF_EXE.get() {
        Some(p) => Ok(p.clone()),
        None => std::env::current_exe().context("find the symmem executable"),
    }
}

/// Runs the `symmem` command with `args` (the first is the program's name, as in
/// [`std::env::args_os`]). `exe` is what to start again for ranks, guards and benchmark jobs
/// when that is not the current executable (the wheel's console script runs inside Python).
pub fn main_with(args: impl IntoIterator<Item = OsString>, exe: Option<std::path::PathBuf>) -> ExitCode {
    ExitCode::from(run_with(args, exe))
}

/// [`main_with`], returning the exit status as a number (for the Python console script).
pub fn run_with(args: impl IntoIterator<Item = OsString>, exe: Option<std::path::PathBuf>) -> u8 {
    use std::io::IsTerminal;
    if let Some(exe) = exe {
        let _ = SELF_EXE.set(exe);
    }
    // Logs go through a thread of their own and are dropped, not waited for, when stderr is not
    // drained: a log line never stalls a server (the store) or a launcher. Colour only on a
    // terminal. 4096 lines in flight: the default (128,000) costs every process (each rank of a
    // job) about 5 MB of zeroed pages at start, some 1,200 page faults.
    let (writer, _flush_on_exit) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(4096)
        .finish(std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(
            symmem::config::log_filter()
                .and_then(|f| tracing_subscriber::EnvFilter::try_new(f).ok())
                .unwrap_or_else(|| "warn".into()),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(writer)
        .try_init()
        .ok();
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version print and succeed; mistakes print and exit 2, as clap does.
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    match dispatch(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("symmem: error: {e:#}");
            1
        }
    }
}

fn dispatch(command: Command) -> Result<u8> {
    match command {
        Command::Run(args) => run(args),
        Command::Demo { nproc, hosts } => demo(nproc, hosts),
        Command::DemoRank => demo_rank().map(|()| SUCCESS),
        Command::BenchSignalRank { iters, pin } => bench::signal_rank(iters, pin).map(|()| SUCCESS).map_err(Into::into),
        Command::BenchFlagRank { iters, pin } => bench::flag_rank(iters, pin).map(|()| SUCCESS).map_err(Into::into),
        Command::BenchOpRank { op, algo, dtype, iters, warmup, sizes, pin } => {
            let dtype = bench::parse_dtype(&dtype)?;
            bench::collective_rank(&op, &algo, dtype, iters, warmup, &sizes, pin).map(|()| SUCCESS).map_err(Into::into)
        }
        Command::BenchTransportRank { backend, window, sizes } => {
            bench::transport_rank(&backend, window, &sizes).map(|()| SUCCESS).map_err(Into::into)
        }
        Command::Guard { command } => Ok(exit_code(launch::guard(&command[0], &command[1..]))),
        Command::Store(args) => store(args),
        Command::Info => {
            info();
            Ok(SUCCESS)
        }
        Command::Bench { which: BenchCommand::AllReduce(a) } => bench_collective("all_reduce", &a.common, a.algo),
        Command::Bench { which: BenchCommand::AllGather(a) } => bench_collective("all_gather", &a, AllReduceAlgo::Auto),
        Command::Bench { which: BenchCommand::ReduceScatter(a) } => {
            bench_collective("reduce_scatter", &a, AllReduceAlgo::Auto)
        }
        Command::Bench { which: BenchCommand::AllToAll(a) } => bench_collective("all_to_all", &a, AllReduceAlgo::Auto),
        Command::Bench { which: BenchCommand::AllToAllV(a) } => {
            bench_collective("all_to_all_v", &a, AllReduceAlgo::Auto)
        }
        Command::Bench { which: BenchCommand::MatmulReduceScatter(a) } => {
            bench_collective("matmul_reduce_scatter", &a, AllReduceAlgo::Auto)
        }
        Command::Bench { which: BenchCommand::AllGatherMatmul(a) } => {
            bench_collective("all_gather_matmul", &a, AllReduceAlgo::Auto)
        }
        Command::Bench { which: BenchCommand::AllToAllNd(a) } => {
            bench_collective("all_to_all_nd", &a, AllReduceAlgo::Auto)
        }
        Command::Bench { which: BenchCommand::ReduceScatterOffset(a) } => {
            bench_collective("reduce_scatter_offset", &a, AllReduceAlgo::Auto)
        }
        Command::Bench { which: BenchCommand::TileReduce(a) } => {
            bench_collective("tile_reduce", &a, AllReduceAlgo::Auto)
        }
        Command::Bench { which: BenchCommand::MultiRootTileReduce(a) } => {
            bench_collective("multi_root_tile_reduce", &a, AllReduceAlgo::Auto)
        }
        Command::Bench { which: BenchCommand::Broadcast(a) } => bench_collective("broadcast", &a, AllReduceAlgo::Auto),
        Command::Bench { which: BenchCommand::Transport { output, backend, sizes, window, plot } } => {
            let exe = self_exe()?;
            let what = format!("transport over {backend}");
            let options = bench::TransportBenchOptions { backend, sizes: flat(&sizes), window, exe };
            bench_rows(&what, output.format(), plot.as_deref(), |emit| bench::transport(&options, emit))
        }
        Command::Bench { which: BenchCommand::Signal { output, nproc, iters, hosts } } => {
            let exe = self_exe()?;
            let options = bench::SignalBenchOptions { ranks: flat_counts(&nproc), iters, hosts, exe };
            bench_rows("signals and barriers", output.format(), None, |emit| bench::signal(&options, emit))
        }
        Command::Bench { which: BenchCommand::Rendezvous { output, nproc, per_key_max } } => {
            bench_rows("rendezvous", output.format(), None, |emit| {
                bench::rendezvous_scaling(&flat_counts(&nproc), per_key_max, emit)
            })
        }
        Command::Bench { which: BenchCommand::LinkSetup { output, hosts, per_host, all_pairs_max } } => {
            bench_rows("link setup", output.format(), None, |emit| {
                bench::link_setup(&flat_counts(&hosts), per_host, all_pairs_max, emit)
            })
        }
        Command::Bench { which: BenchCommand::Store { output, clients, ops, bytes, nproc, per_key_max, addr } } => {
            let options = StoreBenchOptions {
                clients: flat_counts(&clients),
                ops_per_client: ops,
                value_bytes: bytes,
                rendezvous_ranks: flat_counts(&nproc),
                per_key_max_ranks: per_key_max,
                addr,
                secret: Secret::from_env(),
            };
            bench_rows("store", output.format(), None, |emit| bench::store(&options, emit))
        }
        Command::Sizes { sizes } => {
            say!("{}", flat(&sizes).iter().map(usize::to_string).collect::<Vec<_>>().join(" "));
            Ok(SUCCESS)
        }
    }
}

fn exit_code(code: i32) -> u8 {
    u8::try_from(code.clamp(0, 255)).unwrap_or(1)
}

fn launch_and_report(options: &LaunchOptions) -> Result<u8> {
    // This process is only the launcher: what a rank's guard killed from outside leaves comes
    // here, and goes with the job.
    let _reaper = launch::Subreaper::adopt();
    let mut options = options.clone();
    let exe = self_exe()?;
    options.guard = Some((exe.into(), vec!["__guard".into(), "--".into()]));
    let outcome = launch::run(&options)?;
    if outcome != launch::Outcome::Success {
        eprintln!("symmem run: {outcome}");
    }
    Ok(exit_code(outcome.exit_code()))
}

fn run(args: RunArgs) -> Result<u8> {
    let mut command = args.command.into_iter();
    let Some(program) = command.next() else { bail!("no program given") };
    let timeout = args
        .timeout
        .map(|s| {
            symmem::config::timeout_from_secs(s).context("--timeout must be a finite, non-negative number of seconds")
        })
        .transpose()?;
    let options = LaunchOptions {
        nproc_per_node: args.nproc,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        timeout,
        secret: args.secret_file.as_deref().map(Secret::from_file).transpose()?,
        no_auth: args.no_auth,
        program,
        args: command.collect(),
        env: Vec::new(),
        guard: None,
        bind: match args.bind {
            BindArg::None => launch::Bind::None,
            BindArg::Cores => launch::Bind::Cores,
        },
    };
    launch_and_report(&options)
}

fn demo(nproc: usize, hosts: usize) -> Result<u8> {
    let exe = self_exe()?;
    let mut options = LaunchOptions::local(nproc, exe.clone(), vec!["demo-rank".into()]);
    options.env.push((symmem::config::env::OMP_NUM_THREADS.into(), "1".into()));
    options.timeout = Some(Duration::from_secs(120));
    if hosts > 1 {
        say!(
            "symmem demo: playing {hosts} hosts on this machine, {nproc} ranks of {} each; ranks on different hosts \
             reach each other only through the tcp transport",
            exe.display()
        );
        options.guard = Some((exe.into(), vec!["__guard".into(), "--".into()]));
        let reaper = launch::Subreaper::adopt();
        let outcome = launch::run_hosts(&options, hosts)?;
        drop(reaper);
        if outcome != launch::Outcome::Success {
            eprintln!("symmem demo: {outcome}");
        }
        return Ok(exit_code(outcome.exit_code()));
    }
    say!("symmem demo: launching {nproc} ranks of {} on this host", exe.display());
    let code = launch_and_report(&options)?;
    open_mpi_figures(nproc);
    Ok(code)
}

/// When Open MPI is installed, its MPI_Allreduce at the demo's sizes, for comparison: medians,
/// as the demo's own all-reduce figures are.
fn open_mpi_figures(nproc: usize) {
    if !bench::have_open_mpi() {
        say!("(Open MPI is not installed; bench/compare_mpi.sh installs it and compares all-reduce side by side)");
        return;
    }
    let mut figures = Vec::new();
    let measured = bench::open_mpi("all_reduce", nproc, &[4096, 1 << 20], &mut |r| {
        figures.push(format!("{}: median {:.2} us", bench::human_size(r.size.unwrap_or(0) as f64), r.time_us));
    });
    match measured {
        Ok(()) if !figures.is_empty() => {
            say!("Open MPI MPI_Allreduce on {nproc} ranks, for comparison: {}", figures.join(", "))
        }
        Ok(()) => say!("(Open MPI is installed but its all-reduce could not be measured)"),
        Err(e) => say!("(Open MPI is installed but its all-reduce could not be measured: {e})"),
    }
}

fn demo_rank() -> Result<()> {
    let t = Instant::now();
    let group = symmem::Group::from_env().context("join the job")?;
    let joined = t.elapsed();
    let (rank, world) = (group.rank(), group.world_size());
    say!(
        "rank {rank}/{world}: joined the store at {} in {:.2} ms",
        format!(
            "{}:{}",
            symmem::config::value(symmem::config::env::MASTER_ADDR).unwrap_or_default(),
            symmem::config::value(symmem::config::env::MASTER_PORT).unwrap_or_default()
        ),
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
        say!("rank 0: all-gather through the store in {:.2} ms: {}", gathered.as_secs_f64() * 1e3, list.join(", "));
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
    say!("rank {rank}: 200 store barriers: median {median:.0} us, p99 {p99:.0} us");

    // Symmetric memory: allocate, rendezvous, pass a signal around the ring, read a peer.
    let t = Instant::now();
    let x = symm::empty(&[1024], DType::F32, Device::Cpu)?;
    x.fill(rank as f32)?;
    let h = symm::rendezvous(&x, &group)?;
    let rdzv = t.elapsed();
    if rank == 0 {
        say!(
            "rank 0: allocated and rendezvoused a 4 KiB symmetric tensor in {:.2} ms ({} signal channels)",
            rdzv.as_secs_f64() * 1e3,
            h.num_channels()
        );
        if !h.all_local() {
            say!(
                "rank 0: the group spans hosts; ranks {:?} are on other hosts, reached through tcp links \
                 (their memory is not addressable: {})",
                h.remote_ranks(),
                h.buffer_ptrs().err().map(|e| e.to_string()).unwrap_or_default()
            );
        }
    }
    h.barrier(0, timeout)?;
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let laps = 1000;
    let t = Instant::now();
    for _ in 0..laps {
        if rank == 0 {
            h.put_signal(next, 1, timeout)?;
            h.wait_signal(prev, 1, timeout)?;
        } else {
            h.wait_signal(prev, 1, timeout)?;
            h.put_signal(next, 1, timeout)?;
        }
    }
    let lap = t.elapsed() / laps;
    if rank == 0 {
        say!(
            "rank 0: {laps} laps of a signal around the {world}-rank ring: {:.2} us per lap, {:.2} us per hop",
            lap.as_secs_f64() * 1e6,
            lap.as_secs_f64() * 1e6 / world as f64
        );
    }
    let t = Instant::now();
    let (seen, how) = if h.is_local(next) {
        (h.get_remote_tensor(next, &[1024], DType::F32)?.to_vec::<f32>()?, "directly (same host)")
    } else {
        let into = Tensor::zeros(&[1024], DType::F32)?;
        symm::get(&into, &h, next, 0)?;
        (into.to_vec::<f32>()?, "one-sidedly from another host (symm::get over tcp)")
    };
    let read = t.elapsed();
    if seen.iter().any(|&v| v != next as f32) {
        anyhow::bail!("rank {rank} read unexpected values from rank {next}'s buffer");
    }
    say!("rank {rank}: read rank {next}'s 4 KiB buffer {how} in {:.2} us: all {next}.0", read.as_secs_f64() * 1e6);
    h.barrier(0, timeout)?;
    let t = Instant::now();
    for _ in 0..1000 {
        h.barrier(0, timeout)?;
    }
    let sbar = t.elapsed() / 1000;
    let kind = if h.all_local() { "signal-pad" } else { "hierarchical (across hosts)" };
    say!("rank {rank}: 1000 {kind} barriers: {:.2} us each", sbar.as_secs_f64() * 1e6);
    group.barrier(timeout)?;

    // Collectives on symmetric memory: all-reduce, small (one-shot) and large (two-shot).
    for (bytes, label) in [(4096usize, "4 KiB"), (1 << 20, "1 MiB")] {
        let n = bytes / 4;
        let v = symm::empty(&[n], DType::F32, Device::Cpu)?;
        let mut lat = Vec::with_capacity(200);
        for _ in 0..200 {
            v.fill(rank as f32 + 1.0)?;
            let t = Instant::now();
            ops::all_reduce(&v, ReduceOp::Sum, &group)?;
            lat.push(t.elapsed());
        }
        let want = (world * (world + 1) / 2) as f32;
        if v.to_vec::<f32>()?.iter().any(|&x| x != want) {
            anyhow::bail!("all-reduce of {label} gave a wrong result on rank {rank}");
        }
        let (median, _) = bench::percentiles(&mut lat);
        if rank == 0 {
            let algo = ops::all_reduce::select_for(&v, ReduceOp::Sum, &h).name().replace('_', "-");
            say!(
                "rank 0: all-reduce of {label} ({algo}) on {world} ranks: median {median:.2} us, result checked on every rank"
            );
        }
    }
    group.barrier(timeout)?;

    // All-to-all-v: every rank sends (src + dst) % 3 + 1 rows of 256 floats to each peer.
    let rows = 3 * world;
    let input = symm::empty(&[rows, 256], DType::F32, Device::Cpu)?;
    input.copy_from_slice(&(0..rows * 256).map(|i| (rank * 1_000_000 + i) as f32).collect::<Vec<_>>())?;
    let split = |src: usize, dst: usize| ((src + dst) % 3 + 1) as i64;
    let splits = symm::empty(&[world], DType::I64, Device::Cpu)?;
    splits.copy_from_slice(&(0..world).map(|d| split(rank, d)).collect::<Vec<_>>())?;
    let out = Tensor::zeros(&[rows * world, 256], DType::F32)?;
    let layout = Tensor::zeros(&[2, world], DType::I64)?;
    // The first call rendezvouses the tensors; time the second.
    ops::all_to_all_vdev(&input, &out, &splits, &layout, &group)?;
    let t = Instant::now();
    ops::all_to_all_vdev(&input, &out, &splits, &layout, &group)?;
    let took = t.elapsed();
    let got = out.to_vec::<f32>()?;
    let mut at = 0;
    for src in 0..world {
        let first: i64 = (0..rank).map(|d| split(src, d)).sum();
        for r in 0..split(src, rank) as usize {
            if got[(at + r) * 256] != (src * 1_000_000 + (first as usize + r) * 256) as f32 {
                anyhow::bail!("all-to-all-v delivered a wrong row to rank {rank}");
            }
        }
        at += split(src, rank) as usize;
    }
    if rank == 0 {
        say!(
            "rank 0: all-to-all-v with uneven splits ({at} rows arrived here) in {:.2} us, rows checked on every rank",
            took.as_secs_f64() * 1e6
        );
    }
    group.barrier(timeout)?;

    // A one-sided transport: the trainer (rank 0) pushes weights to a replica (rank 1); other
    // ranks only join the exchanges.
    let n = 4 << 20; // 16 MiB of f32
    let link = if rank < 2 && world >= 2 {
        let t = Instant::now();
        let link =
            new_transport_rank("auto", None, group.store(), 1 - rank as u64, rank as u64, timeout, &Options::new())?;
        let setup = t.elapsed();
        let weights = if rank == 0 {
            Tensor::from_slice(&[n], &(0..n).map(|i| i as f32).collect::<Vec<f32>>())?
        } else {
            Tensor::zeros(&[n], DType::F32)?
        };
        let mem = link.register_memory(&weights)?;
        Some((link, setup, weights, mem))
    } else {
        None
    };
    let mine = link.as_ref().map(|(_, _, _, m)| m.to_remote_buffer()).transpose()?.map(|d| d.serialize());
    let descriptors = group.all_gather_bytes("replica", &mine.unwrap_or_default())?;
    if let (0, Some((link, setup, _, mem))) = (rank, &link) {
        let remote = RemoteBuffer::deserialize(&descriptors[1])?;
        let t = Instant::now();
        link.write(&mem.to_view(0, None)?, &remote, None)?;
        let d = t.elapsed();
        say!(
            "rank 0: trainer connected to the replica ({}) in {:.2} ms and wrote 16 MiB of weights in {:.2} ms ({:.2} GB/s)",
            link.describe(),
            setup.as_secs_f64() * 1e3,
            d.as_secs_f64() * 1e3,
            (n * 4) as f64 / d.as_secs_f64() / 1e9
        );
    }
    group.barrier(timeout)?;
    if let (1, Some((_, _, weights, _))) = (rank, &link) {
        if weights.to_vec::<f32>()?.iter().enumerate().any(|(i, &v)| v != i as f32) {
            anyhow::bail!("the replica received corrupted weights");
        }
        say!("rank 1: replica verified all {n} weights it received");
    }
    group.barrier(timeout)?;
    if let Some((link, ..)) = link {
        link.close(Some(timeout))?;
    }
    group.barrier(timeout)?;
    if rank == 0 {
        say!(
            "rank 0: done: {world} ranks joined, synchronized through the store and shared memory{}, and moved a tensor \
             one-sidedly",
            match (h.all_local(), h.link_backend()) {
                (true, _) => String::new(),
                (false, Some(backend)) => format!(" and {backend} links between hosts"),
                (false, None) => " and links between hosts".to_string(),
            }
        );
    }
    Ok(())
}

fn store_client(cmd: StoreClientCommand) -> Result<u8> {
    use symmem::Store;
    let connect = |at: &StoreAt| -> Result<(symmem::TcpStore, Duration)> {
        let timeout = symmem::config::timeout_from_secs(at.timeout)
            .context("--timeout must be a finite, non-negative number of seconds")?;
        let secret = match &at.secret_file {
            Some(p) => Some(Secret::from_file(p)?),
            None => Secret::from_env(),
        };
        let options = symmem::store::ClientOptions { timeout, secret };
        Ok((symmem::TcpStore::connect(&at.addr, options)?, timeout))
    };
    match cmd {
        StoreClientCommand::Get { key, at } => {
            let (s, t) = connect(&at)?;
            let v = s.get_timeout(&key, t)?;
            say!("{}", String::from_utf8_lossy(&v));
        }
        StoreClientCommand::Set { key, value, at } => {
            let (s, _) = connect(&at)?;
            s.set(&key, value.as_bytes())?;
            // SET has no reply: a round trip makes sure it was applied before we exit.
            s.check(&[&key])?;
        }
        StoreClientCommand::Add { key, delta, at } => {
            let (s, _) = connect(&at)?;
            say!("{}", s.add(&key, delta)?);
        }
        StoreClientCommand::Wait { keys, at } => {
            let (s, t) = connect(&at)?;
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            s.wait_timeout(&refs, t)?;
        }
        StoreClientCommand::Ping { at } => {
            let (s, _) = connect(&at)?;
            say!("{:.1} us", s.ping()?.as_secs_f64() * 1e6);
        }
    }
    Ok(SUCCESS)
}

fn store(args: StoreArgs) -> Result<u8> {
    if let Some(cmd) = args.client {
        return store_client(cmd);
    }
    let (secret, source) = if args.no_auth {
        (None, None)
    } else {
        let (s, from) = Secret::resolve(args.secret_file.as_deref())?;
        (Some(s), Some(from))
    };
    let host = args.host.unwrap_or_else(|| if args.no_auth { "127.0.0.1" } else { "0.0.0.0" }.into());
    let addr = format!("{host}:{}", args.port);
    // Signal handlers first: once the address is printed, a SIGTERM must stop the server
    // cleanly, not kill it.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (mut term, mut int) = {
        let _ctx = rt.enter();
        use tokio::signal::unix::{SignalKind, signal};
        (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?)
    };
    let server = StoreServer::start(&addr, ServerOptions { secret, ..Default::default() })?;
    match source {
        Some(from) => say!(
            "symmem store listening on {} (clients prove they hold the secret in {from}; this user's processes on \
             this host need not)",
            server.local_addr()
        ),
        None => say!(
            "symmem store listening on {} WITHOUT AUTHENTICATION: any process that reaches this port can read and \
             change every key (other users' processes on this host are refused)",
            server.local_addr()
        ),
    }
    rt.block_on(async {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    });
    drop(server);
    Ok(SUCCESS)
}

fn info() {
    say!("symmem {} (commit {})", env!("CARGO_PKG_VERSION"), env!("CLI_GIT_COMMIT"));
    say!();
    say!("backends");
    say!("  store      tcp: PyTorch TCPStore protocol (torch 2.15), server and client; needs a reachable TCP port");
    say!(
        "  transport  tcp: any two hosts; listens on and publishes {} (the route to MASTER_ADDR in a job; SYMMEM_TRANSPORT_TCP_HOST)",
        symmem::topo::advertised_host()
    );
    say!(
        "             shm: same host, one copy (memcpy through mappings, or process_vm_writev/readv); needs the same user and no ptrace restriction"
    );
    let ucx = symmem::transport::ucx::version();
    match &ucx {
        Ok(v) => {
            say!("             ucx: any two hosts over UCX {v} (UCX_TLS, UCX_NET_DEVICES pass through), through:");
            match symmem::transport::ucx::resources() {
                Ok(all) => {
                    for r in all {
                        say!("                  {}/{} ({})", r.tl, r.device, r.kind);
                    }
                }
                Err(why) => say!("                  (its transports cannot be listed: {why})"),
            }
        }
        Err(why) => say!("             ucx: unavailable ({why})"),
    }
    let network = if symmem::config::xhost_backend().as_deref() == Some("ucx") {
        "ucx (SYMMEM_XHOST_BACKEND=ucx, on any UCX transport), else tcp".to_string()
    } else {
        match symmem::transport::ucx::fabric() {
            Ok(net) => {
                let names: Vec<String> = net.iter().map(|r| format!("{}/{}", r.tl, r.device)).collect();
                format!("ucx over {} (never UCX's tcp), else tcp", names.join(", "))
            }
            Err(why) if ucx.is_ok() => format!("tcp (not ucx: {why})"),
            Err(_) => "tcp".to_string(),
        }
    };
    say!("             auto: shm for a peer on this host when the kernel allows it, else {network}");
    say!("             links of symmetric memory between hosts: the same network choice");
    say!("  symmetric  CPU: shared memory (memfd) between ranks of one host; needs /proc/<pid>/fd access to peers");
    say!();
    say!("this machine");
    let uname = rustix::system::uname();
    say!("  kernel            {} {}", uname.sysname().to_string_lossy(), uname.release().to_string_lossy());
    say!("  cpus              {}", std::thread::available_parallelism().map_or(0, |n| n.get()));
    match rustix::fs::statvfs("/dev/shm") {
        Ok(s) => say!(
            "  /dev/shm          {:.1} GiB total, {:.1} GiB free",
            (s.f_blocks * s.f_frsize) as f64 / (1u64 << 30) as f64,
            (s.f_bavail * s.f_frsize) as f64 / (1u64 << 30) as f64
        ),
        Err(e) => say!("  /dev/shm          unavailable: {e}"),
    }
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    say!(
        "  open files        soft {}, hard {} (a store needs one per client)",
        nofile.current.map_or("unlimited".into(), |v| v.to_string()),
        nofile.maximum.map_or("unlimited".into(), |v| v.to_string())
    );
    let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").map(|s| s.trim().to_string());
    say!(
        "  ptrace_scope      {}",
        yama.unwrap_or_else(|_| "no Yama (cross-memory attach allowed for same uid)".into())
    );
    let l = symmem::store::Limits::SERVER;
    say!();
    say!("limits");
    say!("  store key         {} bytes", l.max_key_len);
    say!("  store value       {} bytes", l.max_value_len);
    say!("  keys per message  {}", l.max_keys);
    say!();
    say!("configuration (environment variable, default: meaning)");
    for k in symmem::config::KNOBS {
        say!("  {:<30} {:<12} {}", k.env, k.default, k.doc);
    }
}

/// Prints bench results as a table (nccl-tests' columns), JSON lines or CSV, a row at a time.
struct Table {
    format: Format,
    header: bool,
}

/// `v` to six significant digits (a float's last digits are noise in a measurement).
fn sig6(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let scale = 10f64.powi(5 - v.abs().log10().floor() as i32);
    (v * scale).round() / scale
}

/// `r` with every float rounded to six significant digits.
fn tidy(r: &BenchResult) -> BenchResult {
    let mut r = r.clone();
    r.time_us = sig6(r.time_us);
    for v in [&mut r.p99_us, &mut r.algbw, &mut r.busbw].into_iter().flatten() {
        *v = sig6(*v);
    }
    for v in r.extra.values_mut() {
        if let Some(f) = v.as_f64().filter(|_| v.is_f64()) {
            *v = serde_json::json!(sig6(f));
        }
    }
    r
}

/// A float for people: a fixed number of decimals, or `-`.
fn fixed(v: Option<f64>, decimals: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.decimals$}"))
}

impl Table {
    fn new(format: Format) -> Table {
        Table { format, header: false }
    }

    fn row(&mut self, r: &BenchResult) {
        let r = &tidy(r);
        let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
        match self.format {
            Format::Json => say!("{}", serde_json::to_string(r).unwrap_or_default()),
            Format::Csv => {
                if !self.header {
                    let mut names: Vec<&str> = bench::FIELDS.to_vec();
                    names.extend(bench::CSV_EXTRA);
                    say!("{}", names.join(","));
                    self.header = true;
                }
                let plain = |v: Option<u64>| v.map_or(String::new(), |v| v.to_string());
                let float = |v: Option<f64>| v.map_or(String::new(), |v| v.to_string());
                let mut cells = vec![
                    r.bench.clone(),
                    r.ranks.to_string(),
                    r.hosts.to_string(),
                    plain(r.size),
                    plain(r.count),
                    r.dtype.clone().unwrap_or_default(),
                    r.iters.to_string(),
                    format!("{}", r.time_us),
                    float(r.p99_us),
                    float(r.algbw),
                    float(r.busbw),
                ];
                for k in bench::CSV_EXTRA {
                    cells.push(match r.extra.get(k) {
                        Some(serde_json::Value::String(s)) => s.replace(',', ";"),
                        Some(v) => v.to_string(),
                        None => String::new(),
                    });
                }
                say!("{}", cells.join(","));
            }
            Format::Table => {
                if !self.header {
                    say!(
                        "{:<18} {:>5} {:>5} {:>11} {:>11} {:>8} {:>7} {:>10} {:>10} {:>8} {:>8}  {}",
                        "bench",
                        "ranks",
                        "hosts",
                        "size",
                        "count",
                        "dtype",
                        "iters",
                        "time_us",
                        "p99_us",
                        "algbw",
                        "busbw",
                        "notes"
                    );
                    self.header = true;
                }
                let extra: Vec<String> = r
                    .extra
                    .iter()
                    .filter(|(k, v)| *k != "note" || v.as_str().is_some_and(|n| n.starts_with("baseline")))
                    .map(|(k, v)| match v {
                        _ if k == "note" => "(baseline)".to_string(),
                        serde_json::Value::Number(n) if n.is_f64() => {
                            let f = n.as_f64().unwrap_or(0.0);
                            if f.abs() >= 100.0 { format!("{k}={f:.0}") } else { format!("{k}={f:.2}") }
                        }
                        serde_json::Value::String(s) => format!("{k}={s}"),
                        v => format!("{k}={v}"),
                    })
                    .collect();
                say!(
                    "{:<18} {:>5} {:>5} {:>11} {:>11} {:>8} {:>7} {:>10.2} {:>10} {:>8} {:>8}  {}",
                    r.bench,
                    r.ranks,
                    r.hosts,
                    opt(r.size),
                    opt(r.count),
                    r.dtype.as_deref().unwrap_or("-"),
                    r.iters,
                    r.time_us,
                    fixed(r.p99_us, 2),
                    fixed(r.algbw, 2),
                    fixed(r.busbw, 2),
                    extra.join(" ")
                );
            }
        }
    }
}
