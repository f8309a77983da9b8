//! Every environment variable symmem reads: its name, default and meaning in one table
//! ([`KNOBS`]), which `symmem info` prints, and its value, read from the environment once (at
//! its first use) through this module and nowhere else. A test keeps it so: no other file
//! reads the environment, and every `SYMMEM_*` name in the sources is in the table.
//!
//! Layer: a foundation (uses only `error`); every layer takes its knobs from here.

#![forbid(unsafe_code)]

use std::sync::OnceLock;
use std::time::Duration;

use crate::error::{Error, Result};

/// One environment variable.
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    /// The environment variable.
    pub env: &'static str,
    /// The default, as text.
    pub default: &'static str,
    /// What it controls.
    pub doc: &'static str,
}

macro_rules! knobs {
    ($($(#[$m:meta])* $name:ident = $env:literal, $default:literal, $doc:literal;)*) => {
        /// The names of the environment variables, for code that sets them (launchers) or
        /// names them in messages.
        pub mod env {
            $($(#[$m])* pub const $name: &str = $env;)*
        }

        /// Every knob, in the order `symmem info` lists them.
        pub const KNOBS: &[Knob] = &[$(Knob { env: $env, default: $default, doc: $doc }),*];
    };
}

knobs! {
    /// This process's rank in the job.
    RANK = "RANK", "(required)", "this process's rank in the job; set by `symmem run` and torchrun";
    /// The number of ranks.
    WORLD_SIZE = "WORLD_SIZE", "(required)", "the number of ranks in the job";
    /// The rank among this host's.
    LOCAL_RANK = "LOCAL_RANK", "RANK", "this process's rank among the ranks on its host";
    /// The number of ranks on this host.
    LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE", "WORLD_SIZE", "the number of ranks on this host";
    /// The store's host.
    MASTER_ADDR = "MASTER_ADDR", "(required)", "host of the job's store";
    /// The store's port.
    MASTER_PORT = "MASTER_PORT", "(required)", "port of the job's store";
    /// The number of hosts.
    GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE", "1", "the number of hosts (torchrun's node count); set by `symmem run`";
    /// Whether a launcher hosts the store.
    AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE", "unset",
        "\"True\": the launcher hosts the store and every rank connects as a client; otherwise rank 0 hosts it";
    /// OpenMP's thread count.
    OMP_NUM_THREADS = "OMP_NUM_THREADS", "unset",
        "threads of each rank's OpenMP pool; `symmem run` sets 1 when it starts several ranks and it is unset, as torchrun does";
    /// torchrun's error file.
    ERROR_FILE = "TORCHELASTIC_ERROR_FILE", "unset",
        "where a rank records its failure (torchrun's JSON; `symmem run` sets one per rank); set for `symmem run` itself, where it records the job's root cause";
    /// The job's secret.
    STORE_SECRET = "SYMMEM_STORE_SECRET", "`symmem run`: random (one host), the user's key (hosts)",
        "the job's secret: the store's clients prove it (HMAC-SHA256), except this user's processes on the store's host; also keys the ranks' links";
    /// The links' secret when the store cannot carry one.
    JOB_SECRET = "SYMMEM_JOB_SECRET", "SYMMEM_STORE_SECRET",
        "the secret symmem's links between ranks require (both ends prove it), for jobs whose store cannot carry one (torchrun)";
    /// Store operations' timeout.
    STORE_TIMEOUT = "SYMMEM_STORE_TIMEOUT", "300",
        "seconds before store operations and connection attempts time out";
    /// Operators' timeout.
    OP_TIMEOUT = "SYMMEM_OP_TIMEOUT", "60",
        "seconds every operator, rendezvous, signal and cross-host link waits (when given no timeout) before failing with who it waited for";
    /// This rank's host.
    HOST_ID = "SYMMEM_HOST_ID", "hostname/boot id",
        "this rank's host: ranks with the same one share memory, others reach each other through a transport";
    /// How rendezvous exchanges go.
    RENDEZVOUS = "SYMMEM_RENDEZVOUS", "auto",
        "rendezvous exchanges: `store` (a multi-get per rank), `gather` (through rank 0), auto: gather above 32 ranks";
    /// How long waits spin before sleeping.
    SPIN_US = "SYMMEM_SPIN_US", "100",
        "microseconds a wait spins before yielding and sleeping (when ranks do not outnumber cores), and the threads serving a tcp flow or a ucx endpoint keep looking after they fell idle";
    /// The tcp transport's flows.
    TCP_FLOWS = "SYMMEM_TRANSPORT_TCP_FLOWS", "4", "connections per tcp transport endpoint (large transfers are striped over them)";
    /// How the tcp transport's frames travel between holders of the job's secret.
    TCP_FRAMES = "SYMMEM_TRANSPORT_TCP_FRAMES", "sealed",
        "`sealed`: with the job's secret, every tcp transport frame is encrypted and authenticated (AES-128-GCM, keys per connection); `exposed`: only the handshake is, and whoever is on the network path can read and change the frames (for fabrics the operator trusts; taken only when both ends say so)";
    /// The tcp transport's published address.
    TCP_HOST = "SYMMEM_TRANSPORT_TCP_HOST", "the route to MASTER_ADDR",
        "the address a tcp transport endpoint listens on and publishes to its peers; by default, in a job, the local address of the route to its store (loopback on one host), else 127.0.0.1";
    /// The backend of symmetric memory's links between hosts.
    XHOST_BACKEND = "SYMMEM_XHOST_BACKEND", "ucx over RDMA, else tcp",
        "the transport symmetric memory's links between hosts use: by default ucx where UCX reaches other hosts without its tcp transport (an RDMA fabric), else tcp; `ucx` forces UCX on whatever UCX_TLS allows (UCX's tcp does not authenticate its peers), `tcp` forces tcp; set, every rank must say the same";
    /// The tcp transport's chunk size.
    TCP_CHUNK_SIZE = "SYMMEM_TRANSPORT_TCP_CHUNK_SIZE", "1048576", "the largest chunk of a striped tcp transfer, in bytes";
    /// The store the `symmem store` client commands talk to.
    STORE_ADDR = "SYMMEM_STORE_ADDR", "(none)", "HOST:PORT of the store `symmem store get|set|...` talks to (their --addr)";
    /// Where a benchmark rank writes its results.
    BENCH_OUT = "SYMMEM_BENCH_OUT", "(set by `symmem bench`)", "the file a launched benchmark rank appends its result rows to";
    /// The log filter.
    LOG = "SYMMEM_LOG", "warn", "log filter (tracing-subscriber EnvFilter syntax), e.g. `symmem=debug`";
    /// UCX's transports, read by UCX itself.
    UCX_TLS = "UCX_TLS", "(UCX's: all)",
        "the transports UCX may use (read by UCX); where symmem picks ucx by itself it leaves UCX's tcp out of them";
    /// UCX's tcp send segment, read by UCX.
    UCX_TCP_TX_SEG_SIZE = "UCX_TCP_TX_SEG_SIZE", "64K (symmem's; UCX's: 8K)",
        "UCX's tcp send segment (read by UCX): unless this or UCX_TCP_RX_SEG_SIZE is set, symmem sets 64K and 256K, so a message UCX sends eagerly (symmem's up to 64 KiB) leaves whole rather than in 8 KiB fragments";
    /// UCX's tcp receive segment, read by UCX.
    UCX_TCP_RX_SEG_SIZE = "UCX_TCP_RX_SEG_SIZE", "256K (symmem's; UCX's: 64K)",
        "UCX's tcp receive segment (read by UCX): see UCX_TCP_TX_SEG_SIZE; set either, and UCX's values hold for both unless set";
    /// Where this user's configuration lives.
    XDG_CONFIG_HOME = "XDG_CONFIG_HOME", "~/.config", "where this user's key is kept (`symmem/secret` under it)";
    /// The user's home.
    HOME = "HOME", "(the user's home)", "the default of XDG_CONFIG_HOME is `$HOME/.config`";
}

/// The values, each read at its first use.
static VALUES: [OnceLock<Option<std::ffi::OsString>>; KNOBS.len()] = [const { OnceLock::new() }; KNOBS.len()];

fn raw(env: &str) -> Option<&'static std::ffi::OsStr> {
    let Some(i) = KNOBS.iter().position(|k| k.env == env) else {
        debug_assert!(false, "{env} is not a knob: add it to config::KNOBS");
        return None;
    };
    VALUES[i].get_or_init(|| std::env::var_os(env).filter(|v| !v.is_empty())).as_deref()
}

/// The value of knob `env` (one of [`env`](mod@env)'s names), read from the environment the first time
/// it is asked for; `None` when unset, empty or not UTF-8.
pub fn value(env: &str) -> Option<&'static str> {
    raw(env).and_then(std::ffi::OsStr::to_str)
}

/// The bytes of knob `env`, for values that need not be text (secrets).
pub fn bytes(env: &str) -> Option<&'static [u8]> {
    raw(env).map(std::ffi::OsStr::as_encoded_bytes)
}

/// The process's environment, through [`value`].
pub fn from_env(name: &str) -> Option<String> {
    value(name).map(str::to_string)
}

/// A timeout of `secs` seconds, as every timeout given in seconds (an environment variable, a
/// transport option, a command-line flag, a Python argument) is read: `None` unless finite and
/// nonnegative; a value past what a [`Duration`] holds (about 1.8e19 s) is [`Duration::MAX`],
/// which every wait takes as "no deadline" (rather than refusing a finite number).
///
/// ```
/// use std::time::Duration;
/// use symmem::config::timeout_from_secs;
///
/// assert_eq!(timeout_from_secs(1.5), Some(Duration::from_millis(1500)));
/// assert_eq!(timeout_from_secs(1e300), Some(Duration::MAX));
/// assert_eq!(timeout_from_secs(-1.0), None);
/// assert_eq!(timeout_from_secs(f64::NAN), None);
/// assert_eq!(timeout_from_secs(f64::INFINITY), None);
/// ```
pub fn timeout_from_secs(secs: f64) -> Option<Duration> {
    if !secs.is_finite() || secs < 0.0 {
        return None;
    }
    // Finite and nonnegative: the only failure left is a value too large.
    Some(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

fn seconds(s: &str) -> Option<Duration> {
    s.trim().parse::<f64>().ok().and_then(timeout_from_secs)
}

/// `SYMMEM_OP_TIMEOUT`: the bound on every operator's waits, and the default of every
/// symmetric-memory wait given no timeout of its own (handle barriers and signals, rendezvous,
/// links); 60 s by default (and when malformed).
pub fn op_timeout() -> Duration {
    static T: OnceLock<Duration> = OnceLock::new();
    *T.get_or_init(|| value(env::OP_TIMEOUT).and_then(seconds).unwrap_or(Duration::from_secs(60)))
}

/// `SYMMEM_STORE_TIMEOUT`: the store's default timeout, 300 s unless set.
pub fn store_timeout() -> Result<Duration> {
    match value(env::STORE_TIMEOUT) {
        None => Ok(Duration::from_secs(300)),
        Some(s) => seconds(s).ok_or_else(|| Error::Env {
            var: env::STORE_TIMEOUT,
            reason: format!("{s:?} is not a non-negative number of seconds"),
        }),
    }
}

/// `SYMMEM_SPIN_US`: how long a wait spins before yielding (100 µs: longer than a futex wake,
/// so the common case never sleeps).
pub fn spin() -> Duration {
    static S: OnceLock<Duration> = OnceLock::new();
    *S.get_or_init(|| {
        value(env::SPIN_US)
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map_or(Duration::from_micros(100), Duration::from_micros)
    })
}

/// `SYMMEM_HOST_ID`, if set.
pub fn host_id() -> Option<&'static str> {
    value(env::HOST_ID)
}

/// How a group's rendezvous exchanges go (`SYMMEM_RENDEZVOUS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// Through rank 0 above 32 ranks, through the store below.
    Auto,
    /// Through rank 0.
    Gather,
    /// A multi-get per rank from the store.
    Store,
}

/// `SYMMEM_RENDEZVOUS` (auto when unset or unknown).
pub fn rendezvous() -> Rendezvous {
    match value(env::RENDEZVOUS).map(str::to_ascii_lowercase).as_deref() {
        Some("gather") => Rendezvous::Gather,
        Some("store") => Rendezvous::Store,
        _ => Rendezvous::Auto,
    }
}

/// `SYMMEM_STORE_SECRET`'s bytes, if set.
pub fn store_secret() -> Option<&'static [u8]> {
    bytes(env::STORE_SECRET)
}

/// `SYMMEM_JOB_SECRET`'s bytes, if set.
pub fn job_secret() -> Option<&'static [u8]> {
    bytes(env::JOB_SECRET)
}

fn parsed<T: std::str::FromStr>(env: &'static str) -> Result<Option<T>> {
    value(env)
        .map(|v| v.trim().parse().map_err(|_| Error::Env { var: env, reason: format!("{v:?} is not valid") }))
        .transpose()
}

/// `SYMMEM_TRANSPORT_TCP_FLOWS`, if set.
pub fn tcp_flows() -> Result<Option<usize>> {
    parsed(env::TCP_FLOWS)
}

/// `SYMMEM_TRANSPORT_TCP_CHUNK_SIZE`, if set.
pub fn tcp_chunk_size() -> Result<Option<usize>> {
    parsed(env::TCP_CHUNK_SIZE)
}

/// `SYMMEM_TRANSPORT_TCP_FRAMES`, if set: whether the tcp transport's frames travel exposed
/// (`exposed`) rather than sealed (`sealed`).
pub fn tcp_frames_exposed() -> Result<Option<bool>> {
    match value(env::TCP_FRAMES).map(str::trim) {
        None => Ok(None),
        Some("sealed") => Ok(Some(false)),
        Some("exposed") => Ok(Some(true)),
        Some(other) => {
            Err(Error::Env { var: env::TCP_FRAMES, reason: format!("{other:?} is not `sealed` or `exposed`") })
        }
    }
}

/// `SYMMEM_XHOST_BACKEND`, if set (trimmed, lower case).
pub fn xhost_backend() -> Option<String> {
    value(env::XHOST_BACKEND).map(|v| v.trim().to_ascii_lowercase()).filter(|v| !v.is_empty())
}

/// `SYMMEM_TRANSPORT_TCP_HOST`, if set.
pub fn tcp_host() -> Option<&'static str> {
    value(env::TCP_HOST)
}

/// `GROUP_WORLD_SIZE`: the number of hosts, 1 unless set (and valid).
pub fn hosts() -> usize {
    value(env::GROUP_WORLD_SIZE).and_then(|v| v.trim().parse().ok()).filter(|&n| n > 0).unwrap_or(1)
}

/// `SYMMEM_LOG`, if set.
pub fn log_filter() -> Option<&'static str> {
    value(env::LOG)
}

/// `UCX_TLS`, if set: the transports UCX may use.
pub fn ucx_tls() -> Option<&'static str> {
    value(env::UCX_TLS)
}

/// Whether `UCX_TCP_TX_SEG_SIZE` or `UCX_TCP_RX_SEG_SIZE` is set: UCX's tcp segments are then
/// the user's (and UCX's defaults), not symmem's.
pub fn ucx_tcp_segments_set() -> bool {
    value(env::UCX_TCP_TX_SEG_SIZE).is_some() || value(env::UCX_TCP_RX_SEG_SIZE).is_some()
}

/// Where this user's configuration lives: `$XDG_CONFIG_HOME`, else `$HOME/.config`.
pub fn config_home() -> Option<std::path::PathBuf> {
    value(env::XDG_CONFIG_HOME)
        .map(std::path::PathBuf::from)
        .or_else(|| value(env::HOME).map(|h| std::path::PathBuf::from(h).join(".config")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_knob_has_a_name_a_default_and_a_meaning_once() {
        for (i, k) in KNOBS.iter().enumerate() {
            assert!(!k.env.is_empty() && !k.default.is_empty() && !k.doc.is_empty(), "{k:?}");
            assert!(KNOBS[..i].iter().all(|o| o.env != k.env), "{} listed twice", k.env);
        }
        assert_eq!(env::OP_TIMEOUT, "SYMMEM_OP_TIMEOUT");
    }
}
