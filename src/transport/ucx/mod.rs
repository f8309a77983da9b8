//! The `ucx` backend: two processes on any hosts, over UCX (the engine NIXL, Open MPI and
//! PyTorch's transports use), so the same binary takes RDMA (verbs) on a cluster and UCX's
//! tcp, shared-memory and cross-memory-attach transports here. `UCX_TLS` and
//! `UCX_NET_DEVICES` pass through; `UCX_PROTO_ENABLE` does on UCX 1.16 and later only (before,
//! UCX's new protocols were experimental, and 1.13's abort the process on symmem's messages).
//!
//! Every transfer is an active message that the owner's progress thread serves after the
//! same access check as every backend's (key, liveness, bounds, write permission): a write
//! carries its bytes (eager, or UCX's zero-copy rendezvous for large ones, which is an RDMA
//! read by the owner where the fabric has RDMA), a read is answered with the bytes the same
//! way, and a remote atomic is applied by the owner (so it wakes whoever sleeps on the word).
//! Every endpoint asks UCX for peer-failure handling (`UCP_ERR_HANDLING_MODE_PEER`), so a
//! vanished peer fails what is pending. UCX 1.13 then gives rendezvous zero-copy lanes only on
//! memory domains that can invalidate a registration, which its tcp domain cannot: over UCX's
//! tcp a large message's rendezvous travels as active-message fragments, copied at both ends
//! (UCX's debug log: `am am_bw` lanes only, where Open MPI's endpoints, made without failure
//! handling, get `rma_bw` lanes on lo and eth0). A build connecting without it (measured, not
//! kept; 8 alternated runs, 2 ranks on 2 played hosts): all-reduce 1 MiB 0.70x the time,
//! 4 MiB 0.88x, all-to-all level; and a peer killed mid-transfer then left the survivor's
//! transfer pending past the transport test's minute. RDMA domains that can invalidate keep
//! their zero-copy lanes (untested here: no RDMA device).
//!
//! Raw RMA with packed remote keys in the descriptor would skip the owner's check: UCX
//! cannot revoke a key safely on its emulated transports, nor refuse a write to read-only
//! memory; descriptors stay the same as every backend's.
//!
//! **Trust.** UCX does not authenticate the processes that connect to a worker, and some of
//! its protocols act on raw addresses: UCX 1.13's tcp transport writes a connected peer's PUT
//! wherever it names, and so do UCP's software RMA handlers. symmem's contexts leave out the
//! RMA feature (active-message rendezvous does not need it), and symmem picks `ucx` by itself
//! ([`UcxBackend::fabric_only`], for `auto` and the links between hosts) only on UCX's other
//! transports ([`fabric`]: a network other than tcp, an RDMA fabric), where its worker listens
//! on no TCP port. Named by the user, it runs on whatever `UCX_TLS` allows; over UCX's tcp
//! that is for private networks only.
//!
//! UCX promises no order between active messages; symmem's requests carry their endpoint's
//! sequence number and the owner applies them in that order (a request waits while the one
//! before it is still landing), so a signal started after a write lands after it, as over
//! tcp. A peer can park at most 4096 requests ahead of its order.
//!
//! Posted requests (`Request::posted`: the symmetric-memory layer's cross-host writes and the
//! stores that signal them) carry a flag in their id and are answered only if refused: their
//! Works complete once UCX is done with their bytes, and the owner's order lands the signal
//! after the data. A refusal, with no Work left to hear it, ends the connection with the
//! reason. FENCE, answered in order after everything before it, lets a closing endpoint make
//! sure its posted requests ran. A thread waiting for a word the peer sets progresses the
//! worker itself (`serve_arrived`), so the owner's side of a small message needs no wake-up of
//! the progress thread.
//!
//! Small requests started in a `Transport::batch` (a write, its signature and the signal after
//! them) travel as one active message (AM_BATCH, in its header, so eagerly on every
//! transport; as large as the worker's largest header, up to 8 KiB, so a 4 KiB write and its
//! signal are one system call), which the owner takes apart and serves request by request, in
//! order. Going back, the requests an owner accepted in one pass over what arrived are
//! answered together, one ACKS per peer endpoint (a window of small writes costs one message
//! back, not one each); refusals, reads' bytes and a lone acceptance go as before.
//!
//! As the process exits, an `atexit` handler takes every live endpoint's mutex before UCX's
//! libraries tear down their state, and workers dropped after that are left to the process's
//! end: a thread still inside UCX then crashed the exit (see `at_exit`).
//!
//! Each endpoint has a UCX worker in serialized mode behind a mutex. A caller sends its own
//! requests (no hand-off to another thread on the way out); a progress thread per endpoint
//! progresses the worker whenever it is not idle, serving peers and completing Works, keeps
//! looking for the spin budget (`SYMMEM_SPIN_US`) after it fell idle, and sleeps on the
//! worker's event descriptor otherwise. It stays out of the way while a caller sends or
//! progresses the worker itself (waiting for a Work or a word), and for 50 us after: the two
//! taking turns at the lock cost a futex sleep and wake-up per request. UCX's callbacks run on
//! whichever thread progresses and queue what they saw in that thread's queue, which it drains
//! before letting go of the lock.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, mpsc};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rustc_hash::FxHashMap;

use super::registry::{Caps, Reach};
use super::work::Progress;
use super::{Atomic, Backend, Direction, Options, Registration, Request};
use crate::error::{Error, Failed, Result, TransferKind};
use crate::store::Secret;
use crate::sys::ucx::{self, AmRecvParam, Handle, Started, Status, Worker};
use crate::wire::seal::Side;

mod auth;

/// What it can do: remote atomics (applied by the owner), and transfers that take effect in
/// the order they were started, whatever their size (the owner applies each endpoint's
/// requests in sequence).
pub const CAPS: Caps = Caps { remote_atomics: true, in_order_up_to: usize::MAX, reach: Reach::AnyHost };
/// The options it takes.
pub const OPTIONS: &[&str] = &["timeout"];

const URL_PREFIX: &str = "ucx://";
/// The longest worker address a URL may carry.
const MAX_ADDRESS: usize = 64 << 10;
/// The longest refusal message a reply carries.
const MAX_MESSAGE: usize = 256;

// Active-message ids.
const AM_PING: u32 = 1;
const AM_WRITE: u32 = 2;
const AM_READ: u32 = 3;
const AM_ATOMIC: u32 = 4;
const AM_DONE: u32 = 5;
const AM_READ_DATA: u32 = 6;
/// The last request of an endpoint that closes: its order state goes once all before it ran.
const AM_BYE: u32 = 7;
/// Answered (DONE) once every request its endpoint sent before it has run.
const AM_FENCE: u32 = 8;
/// Several small requests in one message (`Backend::hold`): in its header, each as
/// `id u32 | header length u32 | data length u32 | 0 u32 | header | data`.
const AM_BATCH: u32 = 9;
/// The largest batch on a UCX that does not say how large a header it takes (a batch travels
/// in the header, which UCX sends eagerly whatever the transport).
const BATCH_MIN: usize = 1024;
/// The largest batch, whatever UCX takes (8100-8140 bytes on its tcp and shared-memory
/// transports here; a batch that large is one system call where its parts alone were two).
const BATCH_CAP: usize = 8 << 10;
/// Several requests of one peer endpoint accepted: in its header, each one's id (a u64). The
/// owner answers with it the requests it accepted in one pass over what arrived, rather than
/// one DONE each.
const AM_ACKS: u32 = 10;
/// The owner's answer to a PING with the job's secret: its origin, nonce and proof
/// ([`auth`]).
const AM_CHALLENGE: u32 = 11;
/// The initiator's proof of the job's secret ([`auth`]).
const AM_AUTH: u32 = 12;
/// The token of an owner's last word to an endpoint whose session it ends (tokens are
/// numbered from 2).
const GOODBYE: u64 = 0;
/// The most ids one ACKS carries (its header: 512 bytes, sent eagerly).
const ACKS_MAX: usize = 64;
/// The largest request a batch of at most [`BATCH_MIN`] bytes takes (header and data); in a
/// larger batch, what leaves [`BATCH_MIN`] bytes for the requests after it (a signature, a
/// signal).
const BATCHED_MIN: usize = 512;

/// The largest batch and the largest request one takes, for a worker that takes headers of up
/// to `max_am_header` bytes (`None`: it does not say).
fn batch_limits(max_am_header: Option<usize>) -> (usize, usize) {
    match max_am_header {
        Some(m) if m > 2 * BATCH_MIN => {
            let max = m.min(BATCH_CAP);
            (max, max - BATCH_MIN)
        }
        _ => (BATCH_MIN, BATCHED_MIN),
    }
}

// Reply codes.
const OK: u64 = 0;
const REFUSED: u64 = 1;
const BUSY: u64 = 2;

/// Tokens of the progress thread's own sends and receives: a request id, or a served one.
const SERVED: u64 = 1 << 63;
/// In a request's id: posted (`Request::posted`), answered only if refused.
const POSTED: u64 = 1 << 62;

/// Whether UCX can be used in this process, or why not.
pub fn available() -> std::result::Result<(), String> {
    tuned();
    ucx::available()
}

/// The loaded UCX's version, or why UCX cannot be used.
pub fn version() -> std::result::Result<String, String> {
    available().and_then(|()| ucx::version())
}

/// Tells UCX's layer, once and before it makes any context (every way there starts here),
/// whether UCX's tcp segments are symmem's or the user's: the user's once they set either
/// (`config::ucx_tcp_segments_set`), so UCX never sees a receive segment of symmem's next to a
/// larger send segment of theirs.
fn tuned() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| ucx::set_tcp_segments(!crate::config::ucx_tcp_segments_set()));
}

pub use crate::sys::ucx::{DeviceKind, Resource};

/// `UCX_TLS`'s value for UCX picked by itself: the user's `UCX_TLS` (unset: every transport)
/// without tcp, whose zero-copy PUT lets any peer that connects to the worker's port write to
/// any address it names (`uct_tcp_ep_handle_put_req`); `None` when the user named nothing
/// but tcp.
fn tls_without_tcp(configured: Option<&str>) -> Option<String> {
    let v = configured.map(str::trim).unwrap_or("");
    let is_tcp = |t: &str| t.split(':').next().is_some_and(|n| n.trim().eq_ignore_ascii_case("tcp"));
    if v.is_empty() {
        return Some("^tcp".into());
    }
    if let Some(excluded) = v.strip_prefix('^') {
        let mut list: Vec<&str> = excluded.split(',').map(str::trim).filter(|t| !t.is_empty()).collect();
        if !list.iter().any(|t| is_tcp(t)) {
            list.push("tcp");
        }
        return Some(format!("^{}", list.join(",")));
    }
    let list: Vec<&str> = v.split(',').map(str::trim).filter(|t| !t.is_empty() && !is_tcp(t)).collect();
    if list.iter().any(|t| t.eq_ignore_ascii_case("all")) {
        Some("^tcp".into())
    } else if list.is_empty() {
        None
    } else {
        Some(list.join(","))
    }
}

/// UCX's transports as symmem uses them when it picks UCX by itself: tcp left out.
fn no_tcp() -> std::result::Result<ucx::Tls, String> {
    static TLS: OnceLock<Option<String>> = OnceLock::new();
    match TLS.get_or_init(|| tls_without_tcp(crate::config::ucx_tls())) {
        Some(v) => Ok(ucx::Tls::Set(v)),
        None => Err("UCX_TLS names no transport but tcp".into()),
    }
}

/// The transports and devices UCX uses here, after `UCX_TLS` and `UCX_NET_DEVICES` (what
/// `ucx` named by the user runs on), or why UCX cannot be used.
pub fn resources() -> std::result::Result<Vec<Resource>, String> {
    tuned();
    ucx::resources(ucx::Tls::Configured)
}

/// The UCX transports that reach other hosts without UCX's own tcp transport (an RDMA fabric:
/// InfiniBand, RoCE, ...), which is when symmem picks UCX by itself (`auto`, and the links of
/// symmetric memory between hosts); otherwise why not.
///
/// UCX's tcp transport is never picked by itself: its zero-copy PUT writes to whatever
/// address a connected peer names, and UCX does not authenticate who connects.
pub fn fabric() -> std::result::Result<Vec<Resource>, String> {
    static FABRIC: OnceLock<std::result::Result<Vec<Resource>, String>> = OnceLock::new();
    FABRIC
        .get_or_init(|| {
            // UCX's network transports other than tcp all run on RDMA devices (verbs: rc, ud,
            // dc), which the kernel lists here: without one, UCX need not even start.
            let rdma = std::fs::read_dir("/sys/class/infiniband").map(|mut d| d.next().is_some()).unwrap_or(false);
            if !rdma {
                return Err("no RDMA device here (/sys/class/infiniband lists none), so UCX has no network \
                            transport but tcp, which symmem does not pick by itself"
                    .into());
            }
            tuned();
            network(ucx::resources(no_tcp()?)?)
        })
        .clone()
}

/// The network transports among `resources` (a context's, tcp left out), or why none.
fn network(resources: Vec<Resource>) -> std::result::Result<Vec<Resource>, String> {
    let net: Vec<Resource> = resources.into_iter().filter(|r| r.kind == DeviceKind::Network && r.tl != "tcp").collect();
    if net.is_empty() {
        Err("UCX has no network transport here but tcp, which symmem does not pick by itself".into())
    } else {
        Ok(net)
    }
}

/// A `ucx` transport endpoint.
pub struct UcxBackend {
    shared: Arc<Shared>,
    /// The worker and everything UCX's callbacks touch; whoever holds the lock may call UCX
    /// (the worker is in serialized mode) and handles the events its calls produced before
    /// letting go.
    core: Arc<Mutex<Core>>,
    url: Vec<u8>,
    timeout: Duration,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// What a waiter for one of its Works calls while spinning (one for all of them).
    progress: Progress,
}

impl std::fmt::Debug for UcxBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxBackend").finish_non_exhaustive()
    }
}

/// What callers and the progress thread share.
struct Shared {
    /// Registrations peers may reach, by id.
    table: RwLock<HashMap<u64, Arc<Registration>>>,
    /// Wakes the progress thread to stop.
    wake: OwnedFd,
    connected: AtomicBool,
    lost: OnceLock<String>,
    stop: AtomicBool,
    /// Requests are held for a batch (`Core::stash` is not empty): a waiter then takes the
    /// core's lock to send them, rather than trying it, since it may stop trying (asleep) and
    /// nothing else sends them before the batch ends (which may wait for that waiter).
    stashed: AtomicBool,
    /// Callers inside [`UcxBackend::with_core`] (waiting for the core's lock or holding it).
    callers: AtomicUsize,
    /// When a caller last had the core (`Shared::now`): the progress thread stays out of the
    /// way of callers that progress the worker themselves.
    caller_at: AtomicU64,
    /// The origin of `caller_at`.
    epoch: Instant,
}

/// A caller starting a request progresses the worker if nobody did for this long.
const LOOK_EVERY: Duration = Duration::from_micros(20);

/// The progress thread leaves the worker to callers that had it this recently: one that waits
/// for a completion progresses the worker itself every few microseconds, and the thread taking
/// the lock between its looks only makes it wait (a futex sleep and wake-up per request).
const STEP_ASIDE: Duration = Duration::from_micros(50);

impl Shared {
    fn poke(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// Nanoseconds since `epoch`.
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// A caller had the core at `at` (`Shared::now`).
    fn caller_had_it(&self, at: u64) {
        // Relaxed: a hint read by the progress thread; acting on a stale value only costs it a
        // look at the lock, or a few microseconds' wait.
        self.caller_at.store(at, Ordering::Relaxed);
    }

    /// Whether the progress thread should leave the core to callers.
    fn callers_have_it(&self) -> bool {
        // Relaxed: hints (see `caller_had_it`); the lock orders everything done on the core.
        self.callers.load(Ordering::Relaxed) > 0
            || self.now().saturating_sub(self.caller_at.load(Ordering::Relaxed)) < STEP_ASIDE.as_nanos() as u64
    }
}

/// Counts a caller in [`Shared::callers`] while it lives (its time goes in `caller_at`).
struct CallerIn<'a>(&'a Shared);

impl<'a> CallerIn<'a> {
    fn new(s: &'a Shared) -> CallerIn<'a> {
        // Relaxed: a hint (see `Shared::callers_have_it`).
        s.callers.fetch_add(1, Ordering::Relaxed);
        CallerIn(s)
    }
}

impl Drop for CallerIn<'_> {
    fn drop(&mut self) {
        // Relaxed: as in `new`.
        self.0.callers.fetch_sub(1, Ordering::Relaxed);
    }
}

impl UcxBackend {
    /// A new endpoint with its worker and progress thread, or why UCX is unavailable.
    pub fn new(o: &Options) -> Result<UcxBackend> {
        UcxBackend::with(o, ucx::Tls::Configured, Secret::job_from_env())
    }

    /// An endpoint whose peers must prove `secret` (and whose messages are tagged with keys
    /// from it, see [`auth`]), instead of the environment's job secret: for a program that
    /// holds its job's secret itself.
    pub fn with_secret(o: &Options, secret: Secret) -> Result<UcxBackend> {
        UcxBackend::with(o, ucx::Tls::Configured, Some(secret))
    }

    /// An endpoint that uses only UCX transports that reach other hosts without UCX's tcp
    /// (see [`fabric`]): what `auto` composes. Unsupported where there are none.
    pub fn fabric_only(o: &Options) -> Result<UcxBackend> {
        fabric().map_err(|why| Error::Unsupported {
            what: "ucx picked by itself".into(),
            needs: format!("an RDMA fabric; {why}"),
        })?;
        let tls = no_tcp().map_err(|why| Error::Unsupported { what: "ucx picked by itself".into(), needs: why })?;
        UcxBackend::with(o, tls, Secret::job_from_env())
    }

    fn with(o: &Options, tls: ucx::Tls, secret: Option<Secret>) -> Result<UcxBackend> {
        tuned();
        let timeout = super::timeout_option("ucx", o)?;
        let unavailable = |why: String| Error::Unsupported {
            what: "the ucx transport".into(),
            needs: format!("UCX 1.13+ (Debian: libucx0); {why}"),
        };
        let wake =
            rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)
                .map_err(|e| Error::io("eventfd", e.into()))?;
        let shared = Arc::new(Shared {
            table: RwLock::new(HashMap::new()),
            wake,
            connected: AtomicBool::new(false),
            lost: OnceLock::new(),
            stop: AtomicBool::new(false),
            stashed: AtomicBool::new(false),
            callers: AtomicUsize::new(0),
            caller_at: AtomicU64::new(0),
            epoch: Instant::now(),
        });
        let (core, address, efd) = Core::new(shared.clone(), tls, secret).map_err(unavailable)?;
        let core = Arc::new(Mutex::new(core));
        live_cores(&core);
        let (c, s) = (core.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("symmem-ucx".into())
            .spawn(move || progress_loop(&c, &s, efd))
            .map_err(|e| Error::io("spawn the ucx progress thread", e))?;
        let url = format!("{URL_PREFIX}{}", URL_SAFE_NO_PAD.encode(address)).into_bytes();
        let progress = waiter_progress(Arc::downgrade(&core), Arc::downgrade(&shared));
        Ok(UcxBackend { shared, core, url, timeout, thread: Mutex::new(Some(thread)), progress })
    }

    /// Runs `f` on the core, then handles what UCX reported meanwhile. It progresses the worker
    /// only if UCX kept a send of `f`'s, or nobody did for [`LOOK_EVERY`] (a caller starting
    /// requests back to back still serves its peers): a look is a system call or more, and a
    /// write, its signature and its signal in a batch took 12-18 us to start with five of
    /// them (2 ranks on 2 played hosts); whoever waits for what `f` started progresses it.
    fn with_core<T>(&self, f: impl FnOnce(&mut Core) -> T) -> T {
        let _in = CallerIn::new(&self.shared);
        let mut c = self.core.lock().unwrap_or_else(|p| p.into_inner());
        let out = f(&mut c);
        let now = self.shared.now();
        let stale = now.saturating_sub(c.looked) > LOOK_EVERY.as_nanos() as u64;
        if std::mem::take(&mut c.unsent) || stale {
            c.look();
        }
        c.handle_events();
        self.shared.caller_had_it(now);
        out
    }
}

/// What a thread waiting for a Work of the backend of `core` and `shared` calls while it
/// spins: sends what is held, progresses the worker once and handles what that reported. Weak
/// references: a Work may outlive its backend.
fn waiter_progress(core: std::sync::Weak<Mutex<Core>>, shared: std::sync::Weak<Shared>) -> Progress {
    Arc::new(move || {
        let Some(core) = core.upgrade() else { return };
        // Relaxed: a hint; this thread's own held requests were stashed by this thread (in
        // program order before this wait), and a stale answer only costs a wait for the lock.
        let held = shared.upgrade().is_some_and(|s| s.stashed.load(Ordering::Relaxed));
        let guard = if held { Some(core.lock().unwrap_or_else(|p| p.into_inner())) } else { core.try_lock().ok() };
        if let Some(mut c) = guard {
            // Held, it leaves now.
            c.send_stash();
            c.look();
            c.handle_events();
            if let Some(s) = shared.upgrade() {
                s.caller_had_it(c.looked);
            }
        }
    })
}

/// The progress thread: progresses the worker while there is anything to do, serving peers
/// and completing transfers, looks again (yielding between looks, without the lock) for
/// `SYMMEM_SPIN_US` once idle, then sleeps on the worker's event descriptor. It leaves the
/// worker alone while callers have it (see [`STEP_ASIDE`]).
fn progress_loop(core: &Mutex<Core>, shared: &Shared, efd: i32) {
    // SAFETY: UCX's event descriptor lives as long as the worker, which the core keeps until
    // after this loop (it is closed below, then dropped with the last handle).
    let efd = unsafe { BorrowedFd::borrow_raw(efd) };
    // After a busy pass it keeps looking for the crate's spin budget before it sleeps: the
    // next message of a stream (the next step of a collective, a rendezvous's next leg) then
    // needs no wake-up, which on a crowded machine costs more than the looks.
    let linger = crate::config::spin();
    let mut idle_since: Option<Instant> = None;
    while !shared.stop.load(Ordering::Acquire) {
        if shared.callers_have_it() {
            // A caller progresses the worker (or is about to send): out of its way, yielding
            // (napping instead, 4 ranks on 2 played hosts took 1.3-2x the time for small
            // all-reduces and all-to-alls: a caller descheduled for a while left peers waiting
            // for the nap's end). Once the caller's looks stop, this thread looks again, the
            // spin budget afresh.
            idle_since = None;
            std::thread::yield_now();
            continue;
        }
        {
            let mut c = core.lock().unwrap_or_else(|p| p.into_inner());
            let mut busy = false;
            while c.look() > 0 {
                busy = true;
            }
            if c.handle_events() || busy {
                idle_since = None;
                continue;
            }
            let now = Instant::now();
            if now.duration_since(*idle_since.get_or_insert(now)) < linger {
                drop(c);
                std::thread::yield_now();
                continue;
            }
            idle_since = None;
            match c.worker.arm() {
                Ok(true) => {}
                Ok(false) => continue,
                Err(why) => tracing::warn!("{why}"),
            }
        }
        let mut fds = [
            rustix::event::PollFd::new(&efd, rustix::event::PollFlags::IN),
            rustix::event::PollFd::new(&shared.wake, rustix::event::PollFlags::IN),
        ];
        let _ = rustix::event::poll(&mut fds, Some(&rustix::time::Timespec { tv_sec: 0, tv_nsec: 100_000_000 }));
        let mut b = [0u8; 8];
        let _ = rustix::io::read(shared.wake.as_fd(), &mut b);
    }
    core.lock().unwrap_or_else(|p| p.into_inner()).close();
}

fn parse_url(url: &[u8]) -> Result<Vec<u8>> {
    let bad = || Error::InvalidArgument("malformed ucx peer URL (expected ucx://<worker address>)".into());
    let s = std::str::from_utf8(url).map_err(|_| bad())?;
    let rest = s.strip_prefix(URL_PREFIX).ok_or_else(bad)?;
    if rest.len() > MAX_ADDRESS * 4 / 3 + 4 {
        return Err(bad());
    }
    let a = URL_SAFE_NO_PAD.decode(rest).map_err(|_| bad())?;
    if a.is_empty() {
        return Err(bad());
    }
    Ok(a)
}

impl Backend for UcxBackend {
    fn name(&self) -> &str {
        "ucx"
    }

    fn caps(&self) -> Caps {
        CAPS
    }

    fn reaches(&self, url: &[u8]) -> std::result::Result<(), String> {
        parse_url(url).map(|_| ()).map_err(|e| e.to_string())
    }

    fn bind(&self, _timeout: Duration) -> Result<Vec<u8>> {
        Ok(self.url.clone())
    }

    fn connect(&self, url: &[u8], timeout: Duration) -> Result<()> {
        let address = parse_url(url)?;
        let (tx, rx) = mpsc::channel();
        self.with_core(|c| c.connect(address, tx));
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(Error::timeout(
                format!("ucx transport: connecting to the peer at {}", String::from_utf8_lossy(url)),
                timeout,
            )),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(Error::transfer(TransferKind::PeerLost, "ucx transport: closed while connecting"))
            }
        }
    }

    fn connected(&self) -> bool {
        self.shared.connected.load(Ordering::Acquire) && self.shared.lost.get().is_none()
    }

    fn expose(&self, reg: &Arc<Registration>) -> Result<()> {
        self.shared.table.write().unwrap_or_else(|p| p.into_inner()).insert(reg.id(), reg.clone());
        Ok(())
    }

    fn withdraw(&self, reg: &Registration) {
        self.shared.table.write().unwrap_or_else(|p| p.into_inner()).remove(&reg.id());
    }

    fn submit(&self, req: Request) -> Result<()> {
        if let Some(why) = self.shared.lost.get() {
            return Err(Error::transfer(TransferKind::PeerLost, format!("ucx transport is not connected: {why}")));
        }
        // Whoever waits for it progresses the worker while spinning, so its completion needs
        // no hand-off from the progress thread either.
        req.work.set_progress(self.progress.clone());
        // Sent from this thread: no hand-off to the progress thread on the way out.
        self.with_core(|c| c.start(req));
        Ok(())
    }

    fn hold(&self, on: bool) {
        self.with_core(|c| c.hold(on));
    }

    fn serve_arrived(&self) {
        if let Ok(mut c) = self.core.try_lock() {
            c.look();
            c.handle_events();
            self.shared.caller_had_it(c.looked);
        }
    }

    fn fence(&self, timeout: Duration) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        if !self.with_core(|c| c.start_fence(tx)) {
            return Ok(());
        }
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(Error::timeout("ucx transport: the peer answering a fence", timeout))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(Error::transfer(TransferKind::PeerLost, "ucx transport: closed while fencing"))
            }
        }
    }

    fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.poke();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
        self.shared.table.write().unwrap_or_else(|p| p.into_inner()).clear();
    }

    fn default_timeout(&self) -> Duration {
        self.timeout
    }

    fn describe(&self) -> String {
        "ucx".into()
    }

    fn disconnect_reason(&self) -> Option<String> {
        self.shared.lost.get().cloned()
    }
}

impl Drop for UcxBackend {
    fn drop(&mut self) {
        self.shutdown();
    }
}

// ---- the process's exit ----

/// The cores of the live endpoints, for [`at_exit`].
static CORES: Mutex<Vec<std::sync::Weak<Mutex<Core>>>> = Mutex::new(Vec::new());

/// Records a new endpoint's core; the first registers [`at_exit`] with the C library.
fn live_cores(core: &Arc<Mutex<Core>>) {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        // SAFETY: `at_exit` is an `extern "C"` function that never unwinds (nothing in it
        // panics: it takes locks ignoring their poison and allocates one small Vec).
        // Registered after UCX's libraries were loaded (the core was just made), it runs
        // before their destructors.
        if unsafe { libc::atexit(at_exit) } != 0 {
            tracing::debug!("ucx: could not register the exit handler");
        }
    });
    let mut cores = CORES.lock().unwrap_or_else(|p| p.into_inner());
    cores.retain(|c| c.strong_count() > 0);
    cores.push(Arc::downgrade(core));
}

/// As the process exits, before UCX's libraries tear down their global state: every live
/// endpoint's core is taken and kept, so no thread (a progress thread, a waiter, a thread
/// dropping its transport) enters UCX through it again, and no worker is destroyed from then
/// on ([`ucx::begin_exit`]). Without it a thread still progressing or destroying a worker
/// while the process exited crashed it (SIGSEGV in `ucs_async_context_cleanup`, seen in
/// `two_hosts_with_a_late_rank_match_one_host_bit_for_bit`, where a lagging transport's thread
/// dropped its endpoint as the rank exited). Each core is waited for at most 100 ms: a thread
/// inside UCX leaves it within a progress call.
extern "C" fn at_exit() {
    ucx::begin_exit();
    let cores: Vec<Arc<Mutex<Core>>> =
        CORES.lock().unwrap_or_else(|p| p.into_inner()).iter().filter_map(std::sync::Weak::upgrade).collect();
    for core in cores {
        let until = Instant::now() + Duration::from_millis(100);
        loop {
            match core.try_lock() {
                Ok(guard) => {
                    // Kept for the rest of the process's life: nobody enters UCX through this
                    // core again.
                    std::mem::forget(guard);
                    break;
                }
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    std::mem::forget(p.into_inner());
                    break;
                }
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => std::thread::yield_now(),
                Err(std::sync::TryLockError::WouldBlock) => break,
            }
        }
        // The core itself is never dropped (its worker would be destroyed): leaked with it.
        std::mem::forget(core);
    }
}

// ---- the progress thread ----

/// What UCX's callbacks report; they run on the progress thread, inside `progress`.
enum Event {
    Sent { token: u64, status: Status },
    Received { token: u64, status: Status },
    Message { id: u32, header: Vec<u8>, data: Data, reply_ep: Handle },
    EndpointFailed(Status),
}

enum Data {
    Bytes(Vec<u8>),
    /// A rendezvous descriptor and the length it brings.
    Rendezvous(*mut c_void, usize),
}

thread_local! {
    static EVENTS: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
}

fn push(e: Event) {
    EVENTS.with(|q| q.borrow_mut().push(e));
}

unsafe extern "C" fn on_sent(request: *mut c_void, status: Status, user_data: *mut c_void) {
    push(Event::Sent { token: user_data as u64, status });
    // SAFETY: UCX hands the callback its completed request, which nothing else frees.
    unsafe { ucx::request_free(request) };
}

unsafe extern "C" fn on_received(request: *mut c_void, status: Status, _length: usize, user_data: *mut c_void) {
    push(Event::Received { token: user_data as u64, status });
    // SAFETY: as in on_sent.
    unsafe { ucx::request_free(request) };
}

unsafe extern "C" fn on_endpoint_error(_arg: *mut c_void, _ep: Handle, status: Status) {
    push(Event::EndpointFailed(status));
}

unsafe extern "C" fn on_message(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const AmRecvParam,
) -> Status {
    // SAFETY: UCX passes a valid parameter struct for the duration of the call.
    let param = unsafe { &*param };
    let header = if header_length == 0 || header.is_null() {
        Vec::new()
    } else {
        // SAFETY: UCX passes `header_length` readable bytes, valid during the call.
        unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }.to_vec()
    };
    let reply_ep =
        if param.recv_attr & ucx::UCP_AM_RECV_ATTR_FIELD_REPLY_EP != 0 { param.reply_ep } else { std::ptr::null_mut() };
    let (data, status) = if param.recv_attr & ucx::UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
        // Kept for ucp_am_recv_data_nbx (or released) after progress returns.
        (Data::Rendezvous(data, length), ucx::UCS_INPROGRESS)
    } else if length == 0 || data.is_null() {
        (Data::Bytes(Vec::new()), ucx::UCS_OK)
    } else {
        // SAFETY: eager data: `length` readable bytes, valid during the call.
        (Data::Bytes(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }.to_vec()), ucx::UCS_OK)
    };
    push(Event::Message { id: arg as usize as u32, header, data, reply_ep });
    status
}

/// A transfer this endpoint started.
struct Pending {
    kind: PendingKind,
    /// The message's header, which UCX reads until the send completes.
    _header: Vec<u8>,
    /// UCX released the local buffer (or there was none).
    sent: bool,
    /// The peer's answer, once it came.
    answer: Option<std::result::Result<(), Failed>>,
}

enum PendingKind {
    Ping(mpsc::Sender<Result<()>>),
    Transfer(Request),
    /// A batch of the requests with these tokens: they are sent when it is.
    Batch(Vec<u64>),
    /// The goodbye of a closing endpoint (nobody waits for it).
    Bye,
}

/// A peer's transfer this endpoint is serving: the registration stays alive until UCX is
/// done with its bytes.
struct Served {
    _reg: Option<Arc<Registration>>,
    /// The answer's header, which UCX reads until the send completes.
    _header: Vec<u8>,
    /// For a write landing by rendezvous: where to answer, and the peer's request id.
    answer_to: Option<(Handle, u64)>,
    /// The peer endpoint whose next request waits for this one.
    order: Option<u64>,
}

struct Core {
    shared: Arc<Shared>,
    worker: Worker,
    ep: Option<Handle>,
    next: u64,
    /// This endpoint's identity in its requests (random) and its last request's number.
    origin: u64,
    seq: u64,
    /// By token: this endpoint's own, so a fast hash (no peer picks its keys).
    pending: FxHashMap<u64, Pending>,
    served: FxHashMap<u64, Served>,
    /// Per peer endpoint (its origin), the order its requests take effect in.
    orders: HashMap<u64, Order>,
    /// A posted request was sent since the last fence.
    unfenced: bool,
    /// When the worker was last progressed (`Shared::now`).
    looked: u64,
    /// A send of this caller's did not leave at once (UCX holds it, or a rendezvous started):
    /// its caller progresses the worker once before letting go.
    unsent: bool,
    /// Open holds, and the small requests held for the last release (sent as one batch).
    held: usize,
    stash: Vec<Stashed>,
    /// The largest batch, and the largest request one takes ([`batch_limits`]).
    batch_max: usize,
    batched_max: usize,
    /// Active messages of its own sent (requests and batches, not answers): tests count them.
    #[cfg(test)]
    messages: u64,
    /// Requests accepted during the current pass over the events (reply endpoint, peer
    /// endpoint's origin, id), answered at its end, together per endpoint.
    acks: Vec<(Handle, u64, u64)>,
    /// The job's secret, when peers must prove it ([`auth`]).
    secret: Option<Secret>,
    /// This endpoint's message keys on its connection, once its handshake proved the secret.
    keys: Option<auth::Keys>,
    /// The handshake under way: the PING's token and this side's nonce.
    handshake: Option<(u64, [u8; auth::NONCE_LEN])>,
    /// With a secret, the peer endpoints (by origin) in their handshake or authenticated; at
    /// most [`MAX_ORIGINS`].
    sessions: HashMap<u64, Session>,
}

/// A peer endpoint's standing with an owner that requires the job's secret.
enum Session {
    /// Challenged: its nonce and ours, for the transcript its proof must cover.
    Challenged { client_nonce: [u8; auth::NONCE_LEN], server_nonce: [u8; auth::NONCE_LEN] },
    /// Authenticated: the connection's keys, and the endpoint that proved it (where the last
    /// word goes if its session ends).
    Ready { keys: Box<auth::Keys>, ep: Handle },
}

/// A request held for a batch: its message, as `Core::send` would send it.
struct Stashed {
    token: u64,
    id: u32,
    header: Vec<u8>,
    data: *const u8,
    len: usize,
}

// SAFETY: the core's raw UCX handles (endpoints, reply endpoints, rendezvous descriptors) and
// its serialized-mode worker are touched only by the thread holding the mutex the core lives
// in, so moving the core between threads (through that mutex) is sound.
unsafe impl Send for Core {}

/// Requests of one peer endpoint take effect in the order they were started: request `next`
/// runs once the one before it completed (its bytes landed, or were sent); later ones wait.
#[derive(Default)]
struct Order {
    next: u64,
    busy: bool,
    parked: std::collections::BTreeMap<u64, Parked>,
}

/// A request waiting for its turn.
struct Parked {
    id: u32,
    header: Vec<u8>,
    data: Data,
    reply_ep: Handle,
}

/// The most requests of one peer endpoint that may wait for their turn; beyond, they are
/// refused (a peer cannot make this endpoint hold without bound).
const MAX_PARKED: usize = 4096;
/// The most peer endpoints whose order this endpoint keeps at once (each forgotten when it
/// says goodbye); beyond, new ones are refused.
const MAX_ORIGINS: usize = 4096;

/// Messages carrying up to this many bytes go eagerly (copied through UCX's buffers) whatever
/// UCX's rendezvous threshold: a rendezvous costs a round trip before the bytes move, more
/// than copying 64 KiB (over UCX's tcp here, a 64 KiB write took 1.3-1.9x longer by
/// rendezvous). Larger ones take UCX's choice (zero-copy rendezvous, RDMA where there is).
const EAGER_MAX: usize = 64 << 10;

/// The bytes of a message its tag covers: those it carried eagerly, when they are few enough
/// to have been sent so (the sender's rule, from the length: a larger message's bytes go by
/// rendezvous, whose integrity is the fabric's).
fn covered(data: &Data) -> &[u8] {
    match data {
        Data::Bytes(b) if b.len() <= EAGER_MAX => b,
        _ => &[],
    }
}

/// Peer endpoints in their handshake at once (a new one displaces one of them).
const MAX_HANDSHAKES: usize = 64;

/// The send flag for a message of `len` bytes.
fn eager(len: usize) -> u32 {
    if len <= EAGER_MAX { ucx::UCP_AM_SEND_FLAG_EAGER } else { 0 }
}

/// A header of little-endian u64 fields.
fn header(fields: &[u64], tail: &[u8]) -> Vec<u8> {
    let mut h = Vec::with_capacity(fields.len() * 8 + tail.len());
    for f in fields {
        h.extend_from_slice(&f.to_le_bytes());
    }
    h.extend_from_slice(tail);
    h
}

/// Field `i` of a header, if present.
fn field(h: &[u8], i: usize) -> Option<u64> {
    let at = i.checked_mul(8)?;
    h.get(at..at.checked_add(8)?).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
}

fn key_of(h: &[u8], at_field: usize) -> Option<[u8; 16]> {
    let at = at_field * 8;
    h.get(at..at + 16).and_then(|b| b.try_into().ok())
}

fn lost_status(what: &str, s: Status) -> Failed {
    Failed::new(
        TransferKind::PeerLost,
        format!("ucx transport: connection to the peer lost {what}: {}", ucx::status_string(s)),
    )
}

impl Core {
    /// A worker with its handlers, its address and its event descriptor.
    fn new(
        shared: Arc<Shared>,
        tls: ucx::Tls,
        secret: Option<Secret>,
    ) -> std::result::Result<(Core, Vec<u8>, i32), String> {
        let worker = Worker::new(tls)?;
        let ids = [
            AM_PING,
            AM_WRITE,
            AM_READ,
            AM_ATOMIC,
            AM_DONE,
            AM_READ_DATA,
            AM_BYE,
            AM_FENCE,
            AM_BATCH,
            AM_ACKS,
            AM_CHALLENGE,
            AM_AUTH,
        ];
        for id in ids {
            // SAFETY: on_message only pushes onto the calling thread's event queue, which the
            // lock holder drains before letting go; the id rides in `arg` as an integer, never
            // dereferenced. Sound for the worker's life.
            unsafe { worker.set_am_handler(id, on_message, id as usize as *mut c_void) }?;
        }
        let address = worker.address()?;
        let efd = worker.event_fd()?;
        let (batch_max, batched_max) = batch_limits(worker.max_am_header());
        let mut origin = [0u8; 8];
        getrandom::fill(&mut origin).map_err(|e| format!("random origin: {e}"))?;
        let core = Core {
            shared,
            worker,
            ep: None,
            next: 1,
            origin: u64::from_le_bytes(origin),
            seq: 0,
            pending: FxHashMap::default(),
            served: FxHashMap::default(),
            orders: HashMap::new(),
            unfenced: false,
            looked: 0,
            unsent: false,
            held: 0,
            batch_max,
            batched_max,
            #[cfg(test)]
            messages: 0,
            stash: Vec::new(),
            acks: Vec::new(),
            secret,
            keys: None,
            handshake: None,
            sessions: HashMap::new(),
        };
        Ok((core, address, efd))
    }

    /// Progresses the worker once; what it reported (UCX's count of events).
    fn look(&mut self) -> u32 {
        self.looked = self.shared.now();
        self.worker.progress()
    }

    fn token(&mut self) -> u64 {
        self.next += 1;
        self.next & !(SERVED | POSTED)
    }

    fn connect(&mut self, address: Vec<u8>, tx: mpsc::Sender<Result<()>>) {
        if self.ep.is_some() {
            let _ = tx.send(Err(Error::InvalidArgument("transport is already connected".into())));
            return;
        }
        // SAFETY: on_endpoint_error only pushes onto the calling thread's queue (drained by the
        // lock holder); arg is unused.
        let with_errors = unsafe { self.worker.connect(&address, Some(on_endpoint_error), std::ptr::null_mut()) };
        let ep = with_errors.or_else(|why| {
            // A UCX transport without peer failure detection (1.13's shared memory): connect
            // anyway; a vanished peer then fails transfers by their timeouts.
            // SAFETY: no callback.
            let ep = unsafe { self.worker.connect(&address, None, std::ptr::null_mut()) }?;
            tracing::warn!(
                "ucx transport: the UCX transports in use cannot detect a vanished peer ({why}); its transfers will fail by timeout"
            );
            Ok::<_, String>(ep)
        });
        match ep {
            Ok(ep) => self.ep = Some(ep),
            Err(why) => {
                let _ = tx.send(Err(Error::transfer(TransferKind::PeerLost, format!("ucx transport: {why}"))));
                return;
            }
        }
        // A ping proves the peer is there (UCX connects lazily); with the job's secret it opens
        // the handshake (`auth`), and the answer to the proof completes it.
        let t = self.token();
        let h = match &self.secret {
            None => header(&[t], &[]),
            Some(_) => match auth::nonce() {
                Ok(n) => {
                    self.handshake = Some((t, n));
                    header(&[t, self.origin], &n)
                }
                Err(why) => {
                    let _ = tx.send(Err(Error::InvalidArgument(format!("ucx transport: {why}"))));
                    return;
                }
            },
        };
        self.pending.insert(t, Pending { kind: PendingKind::Ping(tx), _header: Vec::new(), sent: false, answer: None });
        self.send(t, AM_PING, h, std::ptr::null(), 0);
    }

    /// Appends the tag of message `id` to `h` once this endpoint's connection is
    /// authenticated; `data` are the bytes it carries eagerly (none by rendezvous).
    fn tagged(&self, id: u32, mut h: Vec<u8>, data: &[u8]) -> Vec<u8> {
        if let Some(k) = &self.keys {
            let tag = k.tag(id, &h, data);
            h.extend_from_slice(&tag);
        }
        h
    }

    /// Sends an active message of ours on the endpoint, expecting an answer; `token`'s pending
    /// entry keeps the header alive until UCX is done with it.
    fn send(&mut self, token: u64, id: u32, h: Vec<u8>, data: *const u8, len: usize) {
        let Some(ep) = self.ep else {
            self.finish(token, Some(Err(Failed::new(TransferKind::PeerLost, "ucx transport is not connected"))));
            return;
        };
        #[cfg(test)]
        {
            self.messages += 1;
        }
        // SAFETY: `ep` is this worker's live endpoint; `data` is a registered local range
        // that the Request's registration keeps alive until it completes, which waits for
        // on_sent.
        let started = unsafe {
            self.worker.am_send(
                ep,
                id,
                &h,
                data,
                len,
                ucx::UCP_AM_SEND_FLAG_REPLY | eager(len),
                on_sent,
                token as usize,
            )
        };
        if let Some(p) = self.pending.get_mut(&token) {
            p._header = h;
        }
        match started {
            Started::Done => self.sent(token, ucx::UCS_OK),
            Started::Pending(_) => self.unsent = true,
            Started::Failed(s) => self.sent(token, s),
        }
    }

    fn start(&mut self, req: Request) {
        if let Some(why) = self.shared.lost.get() {
            req.complete(Err(Failed::new(TransferKind::PeerLost, format!("ucx transport is not connected: {why}"))));
            return;
        }
        let t = self.token();
        // The owner applies this endpoint's requests in the order of `seq`, whatever order UCX
        // delivers them in.
        self.seq += 1;
        let (origin, seq) = (self.origin, self.seq);
        // Posted: answered only if refused, done once UCX is done with its bytes.
        let posted = req.posted
            && matches!(req.direction, Direction::Write | Direction::Atomic(Atomic::Set32 | Atomic::Set64, _));
        let id_sent = if posted {
            self.unfenced = true;
            t | POSTED
        } else {
            t
        };
        let r = &req.remote;
        let (id, h, data, len) = match req.direction {
            Direction::Write => (
                AM_WRITE,
                header(&[id_sent, origin, seq, r.buffer_id, r.offset, req.len as u64], &r.access_key),
                req.local_ptr().cast_const(),
                req.len,
            ),
            Direction::Read => (
                AM_READ,
                header(&[t, origin, seq, r.buffer_id, r.offset, req.len as u64], &r.access_key),
                std::ptr::null(),
                0,
            ),
            Direction::Atomic(op, operand) => {
                let code = match op {
                    Atomic::SlotPut => 1,
                    Atomic::Set32 => 2,
                    Atomic::Set64 => 3,
                };
                let h = header(&[id_sent, origin, seq, r.buffer_id, r.offset, code, operand], &r.access_key);
                (AM_ATOMIC, h, std::ptr::null(), 0)
            }
        };
        // Tagged once the connection is authenticated, its bytes too when they go eagerly.
        let bytes = if len > 0 && len <= EAGER_MAX {
            // SAFETY: the request's local range, a live registration of `len` bytes that the
            // request keeps alive; only read.
            unsafe { std::slice::from_raw_parts(data, len) }
        } else {
            &[]
        };
        let h = self.tagged(id, h, bytes);
        let answer = posted.then_some(Ok(()));
        self.pending.insert(t, Pending { kind: PendingKind::Transfer(req), _header: Vec::new(), sent: false, answer });
        if self.held > 0 && h.len() + len <= self.batched_max {
            self.stash.push(Stashed { token: t, id, header: h, data, len });
            // Relaxed: read as a hint (see `Shared::stashed`); written under the core's lock.
            self.shared.stashed.store(true, Ordering::Relaxed);
            return;
        }
        // In the order started: what is held goes first.
        self.send_stash();
        self.send(t, id, h, data, len);
    }

    /// Sends the held requests: one alone as itself, several as batches.
    fn send_stash(&mut self) {
        // Relaxed: as where it is set.
        self.shared.stashed.store(false, Ordering::Relaxed);
        let mut rest = std::mem::take(&mut self.stash).into_iter().peekable();
        while rest.peek().is_some() {
            let mut buf = Vec::new();
            let mut batch: Vec<Stashed> = Vec::new();
            while let Some(next) = rest.peek() {
                if !batch.is_empty() && buf.len() + 16 + next.header.len() + next.len > self.batch_max {
                    break;
                }
                let Some(r) = rest.next() else { break };
                buf.extend_from_slice(&r.id.to_le_bytes());
                buf.extend_from_slice(&(r.header.len() as u32).to_le_bytes());
                buf.extend_from_slice(&(r.len as u32).to_le_bytes());
                buf.extend_from_slice(&0u32.to_le_bytes());
                buf.extend_from_slice(&r.header);
                if r.len > 0 {
                    // SAFETY: the request's local range, which its pending entry (holding its
                    // Registration) keeps alive until it completes, after this copy.
                    buf.extend_from_slice(unsafe { std::slice::from_raw_parts(r.data, r.len) });
                }
                batch.push(r);
            }
            if batch.len() == 1 {
                if let Some(r) = batch.pop() {
                    self.send(r.token, r.id, r.header, r.data, r.len);
                }
                continue;
            }
            let b = self.token();
            let subs = batch.iter().map(|r| r.token).collect();
            self.pending
                .insert(b, Pending { kind: PendingKind::Batch(subs), _header: Vec::new(), sent: false, answer: None });
            // The batch carries copies: its requests' own bytes are free once it is sent.
            self.send(b, AM_BATCH, buf, std::ptr::null(), 0);
        }
    }

    /// Opens (`true`) or closes (`false`) a hold; the last close sends what was held.
    fn hold(&mut self, on: bool) {
        if on {
            self.held += 1;
        } else {
            self.held = self.held.saturating_sub(1);
            if self.held == 0 {
                self.send_stash();
            }
        }
    }

    /// Starts a fence if a posted request was sent since the last one: `tx` hears when every
    /// request sent before it has run at the peer. Whether one was started.
    fn start_fence(&mut self, tx: mpsc::Sender<Result<()>>) -> bool {
        self.send_stash();
        if !std::mem::take(&mut self.unfenced) || self.ep.is_none() {
            return false;
        }
        self.seq += 1;
        let t = self.token();
        self.pending.insert(t, Pending { kind: PendingKind::Ping(tx), _header: Vec::new(), sent: false, answer: None });
        let h = self.tagged(AM_FENCE, header(&[t, self.origin, self.seq], &[]), &[]);
        self.send(t, AM_FENCE, h, std::ptr::null(), 0);
        true
    }

    /// UCX is done with the buffers of send `token`.
    fn sent(&mut self, token: u64, status: Status) {
        if token & SERVED != 0 {
            // An answer of ours went out (or failed: the peer is gone; it learns nothing more).
            if let Some(Served { order: Some(origin), .. }) = self.served.remove(&token) {
                self.advance(origin);
            }
            return;
        }
        if let Some(Pending { kind: PendingKind::Batch(_), .. }) = self.pending.get(&token) {
            if let Some(Pending { kind: PendingKind::Batch(subs), .. }) = self.pending.remove(&token) {
                for t in subs {
                    self.sent(t, status);
                }
            }
            return;
        }
        let Some(p) = self.pending.get_mut(&token) else { return };
        p.sent = true;
        if status != ucx::UCS_OK && p.answer.is_none() {
            p.answer = Some(Err(lost_status("while sending", status)));
        }
        self.try_finish(token);
    }

    fn finish(&mut self, token: u64, answer: Option<std::result::Result<(), Failed>>) {
        if let Some(p) = self.pending.get_mut(&token) {
            p.sent = true;
            if p.answer.is_none() {
                p.answer = answer;
            }
        }
        self.try_finish(token);
    }

    fn try_finish(&mut self, token: u64) {
        let done = self.pending.get(&token).is_some_and(|p| p.sent && p.answer.is_some());
        if !done {
            return;
        }
        let Some(p) = self.pending.remove(&token) else { return };
        let answer = p.answer.unwrap_or(Ok(()));
        match p.kind {
            PendingKind::Ping(tx) => {
                if answer.is_ok() {
                    self.shared.connected.store(true, Ordering::Release);
                }
                let _ = tx.send(answer.map_err(|f| Error::transfer(f.kind, f.message)));
            }
            PendingKind::Transfer(req) => req.complete(answer),
            PendingKind::Batch(_) | PendingKind::Bye => {}
        }
    }

    /// Handles what the callbacks reported, then answers the requests it accepted; whether
    /// there was anything.
    fn handle_events(&mut self) -> bool {
        let events = EVENTS.with(|q| std::mem::take(&mut *q.borrow_mut()));
        let any = !events.is_empty();
        for e in events {
            match e {
                Event::Sent { token, status } => self.sent(token, status),
                Event::Received { token, status } => self.received(token, status),
                Event::Message { id, header, data, reply_ep } => self.message(id, &header, data, reply_ep),
                Event::EndpointFailed(s) => {
                    self.peer_lost(format!("connection to the peer lost: {}", ucx::status_string(s)))
                }
            }
        }
        self.send_acks();
        any
    }

    /// Answers the requests accepted in this pass: one DONE for a reply endpoint's only one,
    /// else ACKS of up to [`ACKS_MAX`] ids each (a window of small writes costs the peer one
    /// message back, not one per write).
    fn send_acks(&mut self) {
        let mut acks = std::mem::take(&mut self.acks);
        while let Some(&(ep, origin, _)) = acks.first() {
            let mut ids = Vec::new();
            acks.retain(|&(e, o, id)| {
                let mine = e == ep && o == origin && ids.len() < ACKS_MAX;
                if mine {
                    ids.push(id);
                }
                !mine
            });
            match ids[..] {
                [id] => self.reply(ep, origin, AM_DONE, header(&[id, OK], &[]), None, std::ptr::null(), 0, None),
                _ => self.reply(ep, origin, AM_ACKS, header(&ids, &[]), None, std::ptr::null(), 0, None),
            };
        }
    }

    fn peer_lost(&mut self, why: String) {
        let _ = self.shared.lost.set(why.clone());
        // Their pending entries fail below.
        self.stash.clear();
        // Relaxed: as where it is set.
        self.shared.stashed.store(false, Ordering::Relaxed);
        let tokens: Vec<u64> = self.pending.keys().copied().collect();
        for t in tokens {
            if let Some(p) = self.pending.remove(&t) {
                let f = Failed::new(TransferKind::PeerLost, format!("ucx transport: {why}"));
                match p.kind {
                    PendingKind::Ping(tx) => {
                        let _ = tx.send(Err(Error::transfer(f.kind, f.message)));
                    }
                    PendingKind::Transfer(req) => req.complete(Err(f)),
                    PendingKind::Batch(_) | PendingKind::Bye => {}
                }
            }
        }
    }

    /// Rendezvous data `token` landed (ours: a read's bytes; served: a peer's write).
    fn received(&mut self, token: u64, status: Status) {
        if token & SERVED != 0 {
            let Some(s) = self.served.remove(&token) else { return };
            if let Some((ep, req)) = s.answer_to {
                let code = if status == ucx::UCS_OK { OK } else { REFUSED };
                let msg = if status == ucx::UCS_OK { String::new() } else { ucx::status_string(status) };
                self.answer(ep, s.order.unwrap_or(0), AM_DONE, req, code, &msg);
            }
            if let Some(origin) = s.order {
                self.advance(origin);
            }
            return;
        }
        let answer = if status == ucx::UCS_OK { Ok(()) } else { Err(lost_status("while receiving", status)) };
        self.finish(token, Some(answer));
    }

    fn message(&mut self, id: u32, h: &[u8], data: Data, reply_ep: Handle) {
        match id {
            AM_CHALLENGE => self.challenged(h, data),
            AM_DONE | AM_ACKS | AM_READ_DATA => {
                // An answer to a request of ours: once the connection is authenticated, only
                // with the owner's tag (a forged one is dropped: it neither completes nor fails
                // anything).
                let h = match &self.keys {
                    None => h,
                    Some(k) => match auth::split(h) {
                        Some((body, tag)) if k.check(id, body, covered(&data), tag) => body,
                        _ => {
                            tracing::warn!("ucx transport: dropped an answer that failed authentication");
                            return self.drop_data(data);
                        }
                    },
                };
                match id {
                    AM_DONE => {
                        self.drop_data(data);
                        let (Some(t), Some(code)) = (field(h, 0), field(h, 1)) else { return };
                        let msg = String::from_utf8_lossy(h.get(16..).unwrap_or_default()).into_owned();
                        if t == GOODBYE && self.keys.is_some() {
                            return self.peer_lost(format!("the peer ended this endpoint's session: {msg}"));
                        }
                        if let Some((ht, _)) = self.handshake
                            && ht == t & !SERVED
                        {
                            // Answered without a challenge: the peer has no secret, or refused.
                            self.handshake = None;
                            let why = if code == OK {
                                "authentication failed: the peer has no job secret and this process has one; both \
                                 ends must share SYMMEM_JOB_SECRET (or SYMMEM_STORE_SECRET)"
                                    .to_string()
                            } else {
                                msg
                            };
                            return self.finish(ht, Some(Err(Failed::new(TransferKind::Refused, why))));
                        }
                        self.done(t, code, msg);
                    }
                    AM_ACKS => {
                        self.drop_data(data);
                        // Whole ids only; at most ACKS_MAX of them.
                        for t in (0..(h.len() / 8).min(ACKS_MAX)).filter_map(|i| field(h, i)) {
                            self.done(t, OK, String::new());
                        }
                    }
                    _ => self.read_data(h, data),
                }
            }
            AM_BATCH => self.batch(h, data, reply_ep),
            AM_PING => self.pinged(h, data, reply_ep),
            AM_AUTH => self.authenticate(h, data, reply_ep),
            AM_WRITE | AM_READ | AM_ATOMIC | AM_BYE | AM_FENCE => {
                if reply_ep.is_null() {
                    // Every request of ours asks for a reply endpoint; anything else is not a peer.
                    return self.drop_data(data);
                }
                let answer_id = if id == AM_READ { AM_READ_DATA } else { AM_DONE };
                // With the job's secret, a request counts only from an authenticated endpoint and
                // with its tag (checked before it is parked or run).
                let h = if self.secret.is_some() {
                    let body = auth::split(h).map(|(body, tag)| (body, tag, field(body, 1)));
                    match body {
                        Some((body, tag, Some(origin))) => match self.sessions.get(&origin) {
                            Some(Session::Ready { keys, .. }) => {
                                if !keys.check(id, body, covered(&data), tag) {
                                    self.drop_data(data);
                                    return self.end_session(
                                        origin,
                                        "a message failed authentication (forged, replayed or changed on the way)",
                                    );
                                }
                                body
                            }
                            _ => {
                                self.drop_data(data);
                                let req = field(body, 0).unwrap_or(0);
                                let why = "this endpoint has not proved the job's secret (or its session ended)";
                                return self.answer(reply_ep, 0, answer_id, req, REFUSED, why);
                            }
                        },
                        _ => return self.drop_data(data),
                    }
                } else {
                    h
                };
                let Some(req) = field(h, 0) else { return self.drop_data(data) };
                let (Some(origin), Some(seq)) = (field(h, 1), field(h, 2)) else {
                    self.drop_data(data);
                    return self.answer(reply_ep, 0, AM_DONE, req, REFUSED, "malformed ucx request");
                };
                if !self.orders.contains_key(&origin) && self.orders.len() >= MAX_ORIGINS {
                    self.drop_data(data);
                    return self.answer(reply_ep, origin, answer_id, req, REFUSED, "too many peer endpoints");
                }
                let o = self.orders.entry(origin).or_insert_with(|| Order { next: 1, ..Order::default() });
                if seq < o.next || o.parked.contains_key(&seq) || o.parked.len() >= MAX_PARKED {
                    self.drop_data(data);
                    let why = "a request out of its endpoint's order (repeated, or too far ahead)";
                    return self.answer(reply_ep, origin, answer_id, req, REFUSED, why);
                }
                if seq == o.next && !o.busy {
                    // Its turn (nothing before it is parked or running): run at once, with no
                    // copy of its header and no stop in the parking map.
                    if self.run(origin, id, h, data, reply_ep) {
                        self.drain(origin);
                    }
                    return;
                }
                o.parked.insert(seq, Parked { id, header: h.to_vec(), data, reply_ep });
                self.drain(origin);
            }
            _ => self.drop_data(data),
        }
    }

    /// A peer's PING: answered at once without a secret here; with one, the handshake's
    /// challenge (see [`auth`]), or a refusal naming why.
    fn pinged(&mut self, h: &[u8], data: Data, reply_ep: Handle) {
        self.drop_data(data);
        let Some(req) = field(h, 0).filter(|_| !reply_ep.is_null()) else { return };
        let Some(secret) = self.secret.clone() else {
            // A peer with a secret refuses this answer itself.
            return self.answer(reply_ep, 0, AM_DONE, req, OK, "");
        };
        let refuse = |c: &mut Core, why: &str| c.answer(reply_ep, 0, AM_DONE, req, REFUSED, why);
        let (Some(origin), Some(client_nonce)) =
            (field(h, 1), h.get(16..16 + auth::NONCE_LEN).and_then(|n| <[u8; auth::NONCE_LEN]>::try_from(n).ok()))
        else {
            return refuse(
                self,
                "authentication failed: this endpoint requires the job's secret (SYMMEM_JOB_SECRET or \
                 SYMMEM_STORE_SECRET) and the peer has none",
            );
        };
        if origin == self.origin {
            return refuse(self, "the connection came back to the endpoint that made it (reflected)");
        }
        match self.sessions.get(&origin) {
            Some(Session::Ready { .. }) => return refuse(self, "this endpoint is authenticated already"),
            Some(Session::Challenged { .. }) => {}
            None if self.sessions.len() >= MAX_ORIGINS => return refuse(self, "too many peer endpoints"),
            None => {
                // Handshakes under way are few: the oldest-looking one gives way to a new one.
                let challenged =
                    self.sessions.iter().filter(|(_, s)| matches!(s, Session::Challenged { .. })).map(|(o, _)| *o);
                let challenged: Vec<u64> = challenged.collect();
                if challenged.len() >= MAX_HANDSHAKES
                    && let Some(o) = challenged.first()
                {
                    self.sessions.remove(o);
                }
            }
        }
        let server_nonce = match auth::nonce() {
            Ok(n) => n,
            Err(why) => return refuse(self, &why),
        };
        let t = auth::transcript(origin, &client_nonce, self.origin, &server_nonce);
        let mut tail = server_nonce.to_vec();
        tail.extend_from_slice(&auth::server_proof(&secret, &t));
        self.sessions.insert(origin, Session::Challenged { client_nonce, server_nonce });
        self.reply(reply_ep, 0, AM_CHALLENGE, header(&[req, OK, self.origin], &tail), None, std::ptr::null(), 0, None);
    }

    /// A peer's proof of the job's secret: its endpoint is authenticated from now on.
    fn authenticate(&mut self, h: &[u8], data: Data, reply_ep: Handle) {
        self.drop_data(data);
        let (Some(req), Some(origin), Some(proof)) = (field(h, 0), field(h, 1), h.get(16..16 + auth::PROOF_LEN)) else {
            return;
        };
        if reply_ep.is_null() {
            return;
        }
        let refuse = |c: &mut Core, why: &str| c.answer(reply_ep, 0, AM_DONE, req, REFUSED, why);
        let (Some(secret), Some(Session::Challenged { client_nonce, server_nonce })) =
            (self.secret.clone(), self.sessions.get(&origin))
        else {
            return refuse(self, "authentication failed: no handshake of this endpoint is under way");
        };
        let t = auth::transcript(origin, client_nonce, self.origin, server_nonce);
        if !auth::check_client_proof(&secret, &t, proof) {
            self.sessions.remove(&origin);
            return refuse(
                self,
                "authentication failed: its proof of the job's secret is wrong: it is not of this job",
            );
        }
        let keys = auth::Keys::derive(&secret, &t, Side::Server);
        self.sessions.insert(origin, Session::Ready { keys: Box::new(keys), ep: reply_ep });
        self.answer(reply_ep, origin, AM_DONE, req, OK, "");
    }

    /// The owner's challenge to this endpoint's PING: checks its proof, derives the keys and
    /// proves the secret back; the owner's answer to that completes the connection.
    fn challenged(&mut self, h: &[u8], data: Data) {
        self.drop_data(data);
        let (Some(t), Some(code), Some(server_origin)) = (field(h, 0), field(h, 1), field(h, 2)) else { return };
        let Some((ht, client_nonce)) = self.handshake.filter(|(ht, _)| *ht == t & !SERVED) else { return };
        self.handshake = None;
        let failed = |c: &mut Core, why: String| {
            c.finish(ht, Some(Err(Failed::new(TransferKind::Refused, format!("authentication failed: {why}")))))
        };
        let n = auth::NONCE_LEN;
        let (Some(secret), Some(server_nonce), Some(proof)) = (
            self.secret.clone(),
            h.get(24..24 + n).and_then(|b| <[u8; auth::NONCE_LEN]>::try_from(b).ok()),
            h.get(24 + n..24 + n + auth::PROOF_LEN),
        ) else {
            return failed(self, "a malformed challenge".into());
        };
        if code != OK {
            return failed(self, "the peer refused the handshake".into());
        }
        let tr = auth::transcript(self.origin, &client_nonce, server_origin, &server_nonce);
        if !auth::check_server_proof(&secret, &tr, proof) {
            return failed(self, "the peer's proof of the job's secret is wrong: it is not of this job".into());
        }
        self.keys = Some(auth::Keys::derive(&secret, &tr, Side::Client));
        // The PING is answered; whoever waits for the connection waits for the proof's answer.
        let Some(p) = self.pending.get_mut(&ht) else { return };
        let waiter = std::mem::replace(&mut p.kind, PendingKind::Bye);
        p.answer = Some(Ok(()));
        self.try_finish(ht);
        let t2 = self.token();
        self.pending.insert(t2, Pending { kind: waiter, _header: Vec::new(), sent: false, answer: None });
        let proof = auth::client_proof(&secret, &tr);
        self.send(t2, AM_AUTH, header(&[t2, self.origin], &proof), std::ptr::null(), 0);
    }

    /// Ends the session of peer endpoint `origin` (a message claiming it failed
    /// authentication): its last word goes to the endpoint that proved the secret, tagged, then
    /// its keys and order are forgotten: its later requests are refused.
    fn end_session(&mut self, origin: u64, why: &str) {
        tracing::warn!("ucx transport: ending a peer endpoint's session: {why}");
        if let Some(Session::Ready { ep, .. }) = self.sessions.get(&origin) {
            let ep = *ep;
            let h = header(&[GOODBYE, REFUSED], why.as_bytes());
            self.reply(ep, origin, AM_DONE, h, None, std::ptr::null(), 0, None);
        }
        self.sessions.remove(&origin);
        if let Some(o) = self.orders.remove(&origin) {
            for (_, q) in o.parked {
                self.drop_data(q.data);
            }
        }
    }

    /// The answer `code` (with `msg`) to request `t` of ours.
    fn done(&mut self, t: u64, code: u64, msg: String) {
        let t = t & !SERVED;
        if t & POSTED != 0 && !self.pending.contains_key(&(t & !POSTED)) {
            // Its Work completed when sent: the connection carries the refusal.
            return self.peer_lost(format!("the peer refused a posted request: {msg}"));
        }
        let posted = t & POSTED != 0;
        let t = t & !POSTED;
        let answer = match code {
            OK => Ok(()),
            BUSY => Err(Failed::new(TransferKind::Busy, "ucx transport: the signal slot is busy")),
            _ => Err(Failed::new(TransferKind::Refused, msg)),
        };
        if posted && let Some(p) = self.pending.get_mut(&t) {
            // Refused before UCX was done sending it: its Work hears it (its answer was
            // presumed).
            p.answer = Some(answer);
            return self.try_finish(t);
        }
        self.finish(t, Some(answer));
    }

    /// Takes a batch apart: each of its requests is handled as if it came alone. Only eager
    /// (a batch travels in the header) and from a peer (with a reply endpoint); a malformed
    /// entry drops it and the rest.
    fn batch(&mut self, h: &[u8], data: Data, reply_ep: Handle) {
        if reply_ep.is_null() || !matches!(&data, Data::Bytes(b) if b.is_empty()) {
            return self.drop_data(data);
        }
        let mut at = 0usize;
        while at < h.len() {
            let word = |i: usize| {
                let from = at.checked_add(4 * i)?;
                h.get(from..from.checked_add(4)?).map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
            };
            let (Some(id), Some(hl), Some(dl)) = (word(0), word(1), word(2)) else { return };
            let (hl, dl) = (hl as usize, dl as usize);
            let Some(end) = at.checked_add(16).and_then(|x| x.checked_add(hl)).and_then(|x| x.checked_add(dl)) else {
                return;
            };
            if end > h.len() || !matches!(id, AM_WRITE | AM_READ | AM_ATOMIC) {
                return;
            }
            let bytes = h[at + 16 + hl..end].to_vec();
            self.message(id, &h[at + 16..at + 16 + hl], Data::Bytes(bytes), reply_ep);
            at = end;
        }
    }

    /// Runs the requests of `origin` whose turn it is, until one is still in flight.
    fn drain(&mut self, origin: u64) {
        loop {
            let Some(o) = self.orders.get_mut(&origin) else { return };
            if o.busy {
                return;
            }
            let next = o.next;
            let Some(p) = o.parked.remove(&next) else { return };
            if !self.run(origin, p.id, &p.header, p.data, p.reply_ep) {
                return;
            }
        }
    }

    /// Runs the request of `origin` whose turn it is, then moves the order on: to the next
    /// request, or, while this one is in flight, to none. Whether the order still stands (a
    /// BYE forgets it).
    fn run(&mut self, origin: u64, id: u32, header: &[u8], data: Data, reply_ep: Handle) -> bool {
        let in_flight = match id {
            AM_BYE => {
                // Everything the endpoint sent before closing ran: forget it.
                self.drop_data(data);
                self.sessions.remove(&origin);
                if let Some(o) = self.orders.remove(&origin) {
                    for (_, q) in o.parked {
                        self.drop_data(q.data);
                    }
                }
                return false;
            }
            AM_FENCE => {
                // Everything the endpoint sent before it ran.
                self.drop_data(data);
                let req = field(header, 0).unwrap_or(0);
                self.answer(reply_ep, origin, AM_DONE, req, OK, "");
                false
            }
            AM_WRITE => self.serve_write(header, data, reply_ep, origin),
            AM_READ => {
                self.drop_data(data);
                self.serve_read(header, reply_ep, origin)
            }
            _ => {
                self.drop_data(data);
                self.serve_atomic(header, reply_ep, origin);
                false
            }
        };
        let Some(o) = self.orders.get_mut(&origin) else { return false };
        if in_flight {
            o.busy = true;
        } else {
            o.next += 1;
        }
        !in_flight
    }

    /// The request of `origin` in flight completed: the next may run.
    fn advance(&mut self, origin: u64) {
        if let Some(o) = self.orders.get_mut(&origin) {
            o.busy = false;
            o.next += 1;
        }
        self.drain(origin);
    }

    fn drop_data(&mut self, data: Data) {
        if let Data::Rendezvous(desc, _) = data {
            // SAFETY: an undelivered descriptor handed to on_message, released once.
            unsafe { self.worker.am_data_release(desc) };
        }
    }

    /// The registration a request names, after the access check.
    fn access(&self, h: &[u8], write: bool) -> std::result::Result<(Arc<Registration>, u64, u64), String> {
        let (Some(buffer), Some(offset), Some(len), Some(key)) = (field(h, 3), field(h, 4), field(h, 5), key_of(h, 6))
        else {
            return Err("malformed ucx request".into());
        };
        let reg = self.shared.table.read().unwrap_or_else(|p| p.into_inner()).get(&buffer).cloned();
        let reg = reg.ok_or("unknown remote buffer")?;
        reg.check_access(&key, offset, len, write)?;
        Ok((reg, offset, len))
    }

    /// Answers request `req` of peer endpoint `origin` (0: unknown, or not authenticated).
    fn answer(&mut self, ep: Handle, origin: u64, id: u32, req: u64, code: u64, msg: &str) {
        if code == OK && req & POSTED != 0 {
            // A posted request is answered only if refused.
            return;
        }
        if id == AM_DONE && code == OK && msg.is_empty() {
            // Answered with the pass's other acceptances (`send_acks`), which ends every pass.
            self.acks.push((ep, origin, req));
            return;
        }
        let msg = &msg.as_bytes()[..msg.len().min(MAX_MESSAGE)];
        self.reply(ep, origin, id, header(&[req, code], msg), None, std::ptr::null(), 0, None);
    }

    /// Sends an answer on a reply endpoint; its served entry keeps the header (and the
    /// registration whose bytes it carries) alive until UCX is done with them, and then lets
    /// the next request of `order` run. Whether the send is still in flight.
    #[allow(clippy::too_many_arguments, reason = "an answer's parts")]
    fn reply(
        &mut self,
        ep: Handle,
        origin: u64,
        id: u32,
        mut h: Vec<u8>,
        reg: Option<Arc<Registration>>,
        data: *const u8,
        len: usize,
        order: Option<u64>,
    ) -> bool {
        if let Some(Session::Ready { keys, .. }) = self.sessions.get(&origin) {
            // The tag covers the bytes when they go eagerly (see `covered`).
            let bytes = if len > 0 && len <= EAGER_MAX {
                // SAFETY: `data` is a checked range of the live registration `reg` holds.
                unsafe { std::slice::from_raw_parts(data, len) }
            } else {
                &[]
            };
            let tag = keys.tag(id, &h, bytes);
            h.extend_from_slice(&tag);
        }
        let t = self.token() | SERVED;
        let entry = self.served.entry(t).or_insert(Served { _reg: reg, _header: h, answer_to: None, order });
        let h = entry._header.as_slice();
        // SAFETY: `ep` is the reply endpoint UCX handed with the request; the header and the
        // bytes (a checked range of the registration) live in `served` until on_sent.
        match unsafe { self.worker.am_send(ep, id, h, data, len, eager(len), on_sent, t as usize) } {
            Started::Pending(_) => true,
            Started::Done => {
                self.served.remove(&t);
                false
            }
            Started::Failed(st) => {
                tracing::debug!("ucx transport: answering a peer: {}", ucx::status_string(st));
                self.served.remove(&t);
                false
            }
        }
    }

    /// Serves a write of `origin` (its turn); whether its bytes are still landing.
    fn serve_write(&mut self, h: &[u8], data: Data, ep: Handle, origin: u64) -> bool {
        let req = field(h, 0).unwrap_or(0);
        let (reg, offset, len) = match self.access(h, true) {
            Ok(x) => x,
            Err(msg) => {
                self.drop_data(data);
                self.answer(ep, origin, AM_DONE, req, REFUSED, &msg);
                return false;
            }
        };
        let at = reg.ptr().wrapping_add(offset as usize);
        match data {
            Data::Bytes(b) if b.len() as u64 == len => {
                // SAFETY: check_access put [offset, offset+len) inside the live registration,
                // which `reg` keeps alive; `b` is our own copy of the peer's bytes.
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), at, b.len()) };
                self.answer(ep, origin, AM_DONE, req, OK, "");
                false
            }
            Data::Rendezvous(desc, n) if n as u64 == len => {
                let t = self.token() | SERVED;
                // SAFETY: `desc` is undelivered; the destination range was checked above and
                // `reg` keeps it alive (in `served` until on_received, if in flight).
                match unsafe { self.worker.am_recv_data(desc, at, n, on_received, t as usize) } {
                    Started::Pending(_) => {
                        let s = Served {
                            _reg: Some(reg),
                            _header: Vec::new(),
                            answer_to: Some((ep, req)),
                            order: Some(origin),
                        };
                        self.served.insert(t, s);
                        true
                    }
                    Started::Done => {
                        self.answer(ep, origin, AM_DONE, req, OK, "");
                        false
                    }
                    Started::Failed(st) => {
                        self.answer(ep, origin, AM_DONE, req, REFUSED, &ucx::status_string(st));
                        false
                    }
                }
            }
            other => {
                self.drop_data(other);
                self.answer(ep, origin, AM_DONE, req, REFUSED, "the write's length does not match its data");
                false
            }
        }
    }

    /// Serves a read of `origin` (its turn); whether its bytes are still being sent.
    fn serve_read(&mut self, h: &[u8], ep: Handle, origin: u64) -> bool {
        let req = field(h, 0).unwrap_or(0);
        let (reg, offset, len) = match self.access(h, false) {
            Ok(x) => x,
            Err(msg) => {
                self.answer(ep, origin, AM_READ_DATA, req, REFUSED, &msg);
                return false;
            }
        };
        let at = reg.ptr().wrapping_add(offset as usize);
        self.reply(ep, origin, AM_READ_DATA, header(&[req, OK], &[]), Some(reg), at, len as usize, Some(origin))
    }

    /// Serves a remote atomic (its turn); it is done when this returns.
    fn serve_atomic(&mut self, h: &[u8], ep: Handle, origin: u64) {
        let req = field(h, 0).unwrap_or(0);
        let (Some(buffer), Some(offset), Some(code), Some(operand), Some(key)) =
            (field(h, 3), field(h, 4), field(h, 5), field(h, 6), key_of(h, 7))
        else {
            return self.answer(ep, origin, AM_DONE, req, REFUSED, "malformed ucx atomic");
        };
        let op = match code {
            1 => Atomic::SlotPut,
            2 => Atomic::Set32,
            3 => Atomic::Set64,
            _ => return self.answer(ep, origin, AM_DONE, req, REFUSED, &format!("unknown remote atomic {code}")),
        };
        let reg = self.shared.table.read().unwrap_or_else(|p| p.into_inner()).get(&buffer).cloned();
        let Some(reg) = reg else { return self.answer(ep, origin, AM_DONE, req, REFUSED, "unknown remote buffer") };
        match super::target::apply_atomic(&reg, &key, offset, op, operand) {
            Ok(false) => self.answer(ep, origin, AM_DONE, req, OK, ""),
            Ok(true) => self.answer(ep, origin, AM_DONE, req, BUSY, ""),
            Err(msg) => self.answer(ep, origin, AM_DONE, req, REFUSED, &msg),
        }
    }

    /// The answer to one of our reads: its bytes, or why not.
    fn read_data(&mut self, h: &[u8], data: Data) {
        let (Some(t), Some(code)) = (field(h, 0), field(h, 1)) else { return self.drop_data(data) };
        let t = t & !SERVED;
        let want = match self.pending.get(&t) {
            Some(Pending { kind: PendingKind::Transfer(r), .. }) if r.direction == Direction::Read => {
                (r.local_ptr(), r.len)
            }
            _ => return self.drop_data(data),
        };
        if code != OK {
            self.drop_data(data);
            let msg = String::from_utf8_lossy(h.get(16..).unwrap_or_default()).into_owned();
            return self.finish(t, Some(Err(Failed::new(TransferKind::Refused, msg))));
        }
        match data {
            Data::Bytes(b) if b.len() == want.1 => {
                // SAFETY: the request's local range is a live mutable registration of `len`
                // bytes, kept alive by the pending request.
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), want.0, b.len()) };
                self.finish(t, Some(Ok(())));
            }
            Data::Rendezvous(desc, n) if n == want.1 => {
                // SAFETY: `desc` is undelivered; the destination is the pending read's range.
                match unsafe { self.worker.am_recv_data(desc, want.0, n, on_received, t as usize) } {
                    Started::Done => self.received(t, ucx::UCS_OK),
                    Started::Pending(_) => {}
                    Started::Failed(s) => self.received(t, s),
                }
            }
            other => {
                self.drop_data(other);
                self.finish(
                    t,
                    Some(Err(Failed::new(TransferKind::Refused, "the peer answered a read with the wrong length"))),
                );
            }
        }
    }

    /// Closes the endpoint (flushing it for a moment, then by force), fails what is left, and
    /// lets the worker go.
    fn close(&mut self) {
        self.send_stash();
        if self.ep.is_some() {
            // Goodbye, after everything this endpoint sent (the owner forgets its order).
            self.seq += 1;
            let t = self.token();
            self.pending.insert(t, Pending { kind: PendingKind::Bye, _header: Vec::new(), sent: false, answer: None });
            let h = self.tagged(AM_BYE, header(&[t, self.origin, self.seq], &[]), &[]);
            self.send(t, AM_BYE, h, std::ptr::null(), 0);
        }
        if let Some(ep) = self.ep.take() {
            let deadline = Instant::now() + Duration::from_secs(2);
            // SAFETY: our live endpoint, closed once.
            if let Started::Pending(r) = unsafe { self.worker.close(ep, false) } {
                // SAFETY: `r` is the close request, checked until it is done, then freed.
                while unsafe { self.worker.request_status(r) } == ucx::UCS_INPROGRESS && Instant::now() < deadline {
                    self.worker.progress();
                }
                // SAFETY: as above.
                if unsafe { self.worker.request_status(r) } == ucx::UCS_INPROGRESS {
                    // SAFETY: as above.
                    unsafe { self.worker.request_cancel(r) };
                    self.worker.progress();
                }
                // SAFETY: as above; freed once.
                unsafe { ucx::request_free(r) };
            }
        }
        // Let outstanding served sends and receives finish or fail, briefly.
        let deadline = Instant::now() + Duration::from_millis(200);
        while !self.served.is_empty() && Instant::now() < deadline {
            self.worker.progress();
            self.handle_events();
        }
        self.handle_events();
        self.peer_lost("the transport is closed".into());
        // Events queued after this point have no one to read them.
        EVENTS.with(|q| q.borrow_mut().clear());
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Atomic, Options, new_transport, testkit};
    use crate::error::TransferKind;
    use crate::tensor::{DType, Tensor};

    #[test]
    fn symmem_picks_ucx_by_itself_only_for_a_network_other_than_tcp() {
        use super::{DeviceKind, Resource, network};
        let r = |tl: &str, device: &str, kind| Resource { tl: tl.into(), device: device.into(), kind };
        let here = vec![r("self", "memory0", DeviceKind::Loopback), r("posix", "memory", DeviceKind::SharedMemory)];
        assert!(network(here.clone()).unwrap_err().contains("no network transport here but tcp"));
        // tcp never counts, even if a context kept it.
        let mut with_tcp = here.clone();
        with_tcp.push(r("tcp", "eth0", DeviceKind::Network));
        assert!(network(with_tcp).is_err());
        let mut fabric = here;
        fabric.push(r("rc_mlx5", "mlx5_0:1", DeviceKind::Network));
        fabric.push(r("ud_verbs", "mlx5_0:1", DeviceKind::Network));
        let got: Vec<String> = network(fabric).unwrap().into_iter().map(|r| r.tl).collect();
        assert_eq!(got, ["rc_mlx5", "ud_verbs"]);
    }

    #[test]
    fn ucx_tls_without_tcp_keeps_the_rest_of_the_users_choice() {
        assert_eq!(super::tls_without_tcp(None).as_deref(), Some("^tcp"));
        assert_eq!(super::tls_without_tcp(Some(" ")).as_deref(), Some("^tcp"));
        assert_eq!(super::tls_without_tcp(Some("all")).as_deref(), Some("^tcp"));
        assert_eq!(super::tls_without_tcp(Some("rc,tcp,sm")).as_deref(), Some("rc,sm"));
        assert_eq!(super::tls_without_tcp(Some("rc_x, TCP:aux")).as_deref(), Some("rc_x"));
        assert_eq!(super::tls_without_tcp(Some("^ud")).as_deref(), Some("^ud,tcp"));
        assert_eq!(super::tls_without_tcp(Some("^tcp,ud")).as_deref(), Some("^tcp,ud"));
        assert_eq!(super::tls_without_tcp(Some("tcp")), None);
    }

    /// Two endpoints with these secrets (None: the environment's, which tests have none of),
    /// or `None` where UCX cannot run here.
    fn endpoints(a: Option<&str>, b: Option<&str>) -> Option<(super::UcxBackend, super::UcxBackend)> {
        let make = |s: Option<&str>| match s {
            Some(s) => super::UcxBackend::with_secret(&Options::new(), crate::store::Secret::new(s).unwrap()),
            None => super::UcxBackend::new(&Options::new()),
        };
        match (make(a), make(b)) {
            (Ok(a), Ok(b)) => Some((a, b)),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("SKIPPED: {e}");
                None
            }
        }
    }

    /// With the job's secret, only a peer holding it connects: a wrong secret, none, or an
    /// owner without one are refused, saying why, and an endpoint connecting to itself (a
    /// reflection) is refused.
    #[test]
    fn a_ucx_connection_needs_the_job_secret_on_both_ends_and_never_reflects() {
        use super::super::Backend;
        let t = std::time::Duration::from_secs(10);
        let cases = [
            (Some("right"), Some("wrong"), "not of this job"),
            (None, Some("right"), "requires the job's secret"),
            (Some("right"), None, "the peer has no job secret"),
        ];
        for (client, owner, says) in cases {
            let Some((a, b)) = endpoints(client, owner) else { return };
            let e = a.connect(&b.bind(t).unwrap(), t).unwrap_err().to_string();
            assert!(e.contains(says), "{client:?} to {owner:?}: {e}");
            assert!(!a.connected());
        }
        let Some((a, b)) = endpoints(Some("right"), Some("right")) else { return };
        a.connect(&b.bind(t).unwrap(), t).unwrap();
        assert!(a.connected());
        let e = b.connect(&b.bind(t).unwrap(), t).unwrap_err().to_string();
        assert!(e.contains("reflected"), "{e}");
    }

    /// A message claiming an authenticated endpoint without its tag (a stranger's, or one
    /// changed on the way) lands nothing and ends that endpoint's session: the owner tells it
    /// why, in a message the endpoint can check, and its pending transfers fail with that.
    #[test]
    fn a_forged_ucx_message_lands_nothing_and_ends_the_session_it_claims() {
        use super::super::{Backend, Transport};
        use super::{AM_WRITE, header};
        let t = std::time::Duration::from_secs(10);
        let Some((a, b)) = endpoints(Some("job"), Some("job")) else { return };
        let Some((stranger, _)) = endpoints(None, None) else { return };
        let url = b.bind(t).unwrap();
        let a_core = a.core.clone();
        let (a, b) = (Transport::new(Box::new(a), None), Transport::new(Box::new(b), None));
        a.connect(&url, Some(t)).unwrap();
        let dst = Tensor::zeros(&[64], DType::U8).unwrap();
        let remote = b.register_memory(&dst).unwrap().to_remote_buffer().unwrap();
        let src = Tensor::from_slice(&[8], &[3u8; 8]).unwrap();
        let view = a.register_memory(&src).unwrap().to_view(0, None).unwrap();
        a.write(&view, &remote.slice(0, 8).unwrap(), Some(t)).unwrap();
        assert_eq!(&dst.to_vec::<u8>().unwrap()[..8], &[3u8; 8]);
        // The stranger reaches the owner's worker and sends a write of zeros in a's name (its
        // origin, its next sequence number), with a made-up tag.
        let (origin, seq) = {
            let c = a_core.lock().unwrap();
            (c.origin, c.seq + 1)
        };
        // Its handshake is refused (it has no secret), but its UCX endpoint reaches the worker.
        let refused = stranger.connect(&url, t).unwrap_err().to_string();
        assert!(refused.contains("requires the job's secret"), "{refused}");
        let zeros = vec![0u8; 8];
        let (tx, rx) = std::sync::mpsc::channel();
        stranger.with_core(|c| {
            let tok = c.token();
            let mut h = header(&[tok, origin, seq, remote.buffer_id, remote.offset, 8], &remote.access_key);
            h.extend_from_slice(&[0x5a; super::auth::TAG_LEN]);
            c.pending.insert(
                tok,
                super::Pending { kind: super::PendingKind::Ping(tx), _header: Vec::new(), sent: false, answer: None },
            );
            c.send(tok, AM_WRITE, h, zeros.as_ptr(), 8);
        });
        // a learns that its session ended, and why.
        let start = std::time::Instant::now();
        while a.connected() {
            assert!(start.elapsed() < t, "the forged message did not end the session it claimed");
            std::thread::sleep(std::time::Duration::from_millis(5));
            a.serve_arrived();
        }
        let e = a.write(&view, &remote.slice(8, 8).unwrap(), Some(t)).unwrap_err().to_string();
        assert!(e.contains("failed authentication"), "{e}");
        assert!(dst.to_vec::<u8>().unwrap()[..8].iter().all(|&x| x == 3), "the forged write landed");
        // The stranger's own write was not answered (not by a tag it could check, nor at all).
        assert!(rx.recv_timeout(std::time::Duration::from_millis(200)).is_err());
        drop(zeros);
    }

    /// Remote atomics behave the same over every backend that serves them: a slot put raises
    /// the signal once and finds it busy until consumed, sets store the operand, and the
    /// owner's checks refuse what they refuse for data.
    fn atomics_on(backend: &str) {
        let (a, b) =
            match (new_transport(backend, None, &Options::new()), new_transport(backend, None, &Options::new())) {
                (Ok(a), Ok(b)) => (a, b),
                (Err(e), _) | (_, Err(e)) => {
                    assert!(matches!(e, crate::error::Error::Unsupported { .. }), "{e}");
                    eprintln!("SKIPPED: {e}");
                    return;
                }
            };
        let (ua, ub) = (a.bind(None).unwrap(), b.bind(None).unwrap());
        a.connect(&ub, None).unwrap();
        b.connect(&ua, None).unwrap();
        let scratch = Tensor::zeros(&[8], DType::U8).unwrap();
        let word = Tensor::zeros(&[2], DType::I64).unwrap();
        let ro = Tensor::zeros(&[1], DType::I64).unwrap();
        let s = a.register_memory(&scratch).unwrap();
        let (w, r) = (b.register_memory(&word).unwrap(), b.register_memory_read_only(&ro).unwrap());
        let (theirs, theirs_ro) = (w.to_remote_buffer().unwrap(), r.to_remote_buffer().unwrap());
        let four = s.to_view(0, Some(4)).unwrap();
        let eight = s.to_view(0, Some(8)).unwrap();
        let slot = theirs.slice(0, 4).unwrap();
        a.start_atomic(&four, &slot, Atomic::SlotPut, 1, None, false).unwrap().wait(None).unwrap();
        assert_eq!(word.to_vec::<i64>().unwrap()[0], 1, "{backend}: the slot holds the signal");
        let busy = a.start_atomic(&four, &slot, Atomic::SlotPut, 1, None, false).unwrap().wait(None).unwrap_err();
        assert_eq!(busy.transfer_kind(), Some(TransferKind::Busy), "{backend}: {busy}");
        let high = theirs.slice(8, 8).unwrap();
        a.start_atomic(&eight, &high, Atomic::Set64, 0x1234_5678_9abc_def0, None, false).unwrap().wait(None).unwrap();
        assert_eq!(word.to_vec::<i64>().unwrap()[1], 0x1234_5678_9abc_def0_u64 as i64, "{backend}");
        // A descriptor forged to say writable: the owner refuses anyway.
        let mut forged = theirs_ro.slice(0, 8).unwrap();
        forged.writable = true;
        let refused = a.start_atomic(&eight, &forged, Atomic::Set64, 7, None, false).unwrap().wait(None).unwrap_err();
        assert_eq!(refused.transfer_kind(), Some(TransferKind::Refused), "{backend}: {refused}");
        assert!(refused.to_string().contains("read-only"), "{backend}: {refused}");
        assert_eq!(ro.to_vec::<i64>().unwrap()[0], 0, "{backend}: read-only memory untouched");
        let misaligned = a.start_atomic(&four, &theirs.slice(2, 4).unwrap(), Atomic::Set32, 9, None, false).unwrap();
        let e = misaligned.wait(None).unwrap_err();
        assert_eq!(e.transfer_kind(), Some(TransferKind::Refused), "{backend}: {e}");
    }

    /// A signal started right after a large write (UCX rendezvous) lands after the write's
    /// bytes, without the initiator waiting in between: the owner keeps the order.
    #[test]
    fn a_signal_after_a_write_lands_after_its_bytes() {
        let (a, b) = match (new_transport("ucx", None, &Options::new()), new_transport("ucx", None, &Options::new())) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("SKIPPED: {e}");
                return;
            }
        };
        let (ua, ub) = (a.bind(None).unwrap(), b.bind(None).unwrap());
        a.connect(&ub, None).unwrap();
        b.connect(&ua, None).unwrap();
        let x = WriteThenSignal::new(&a, &b, 4 << 20);
        let (dst, flag) = (&x.dst, &x.flag);
        for round in 1..=8u8 {
            let (w, f) = x.start(&a, round);
            // Poll the flag as a peer would, then look at the bytes.
            let word = flag.data_ptr().cast::<std::sync::atomic::AtomicI64>();
            let t = std::time::Instant::now();
            // SAFETY: the flag tensor is 8 aligned bytes that live for this test; the backend's
            // owner thread stores to it atomically.
            while unsafe { &*word }.load(std::sync::atomic::Ordering::Acquire) != i64::from(round) {
                assert!(t.elapsed() < std::time::Duration::from_secs(20), "the signal never came");
                std::thread::yield_now();
            }
            let got = dst.to_vec::<u8>().unwrap();
            assert!(got.iter().all(|&x| x == round), "round {round}: the signal overtook the write");
            w.wait(None).unwrap();
            f.wait(None).unwrap();
        }
    }

    /// An owner remembers a peer endpoint's order only while it lives: the peer's goodbye
    /// (sent when it closes, after its last request) makes it forget.
    #[test]
    fn an_owner_forgets_a_peer_endpoint_that_said_goodbye() {
        let Some(owner) = backend() else {
            return;
        };
        let remembered = || owner.core.lock().unwrap().orders.len();
        let url = super::Backend::bind(&owner, std::time::Duration::from_secs(5)).unwrap();
        let a = new_transport("ucx", None, &Options::new()).unwrap();
        a.connect(&url, None).unwrap();
        let scratch = Tensor::zeros(&[8], DType::U8).unwrap();
        let s = a.register_memory(&scratch).unwrap();
        // A descriptor of a buffer the owner never registered: refused, but it ran in order.
        let forged = super::super::RemoteBuffer::deserialize(
            br#"{"version":1,"backend":"ucx","fields":{"buffer_id":7,"offset":0,"length":8,"access_key":"AAAAAAAAAAAAAAAAAAAAAA==","writable":1,"endpoint":0}}"#,
        )
        .unwrap();
        let e =
            a.start_atomic(&s.to_view(0, Some(8)).unwrap(), &forged, Atomic::Set64, 1, None, false).unwrap().wait(None);
        assert_eq!(e.unwrap_err().transfer_kind(), Some(TransferKind::Refused));
        assert_eq!(remembered(), 1, "the owner keeps the order of a live peer endpoint");
        a.close(None).unwrap();
        let t = std::time::Instant::now();
        while remembered() != 0 {
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "the owner never forgot the closed endpoint");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// What a stranger speaking UCX sends an endpoint: headers too short, ids out of place,
    /// requests without a reply endpoint, forged keys, lengths that lie, far-future sequence
    /// numbers. The endpoint refuses or drops each, and keeps serving its real peer.
    #[test]
    fn malformed_active_messages_change_nothing_and_the_owner_keeps_serving() {
        use crate::sys::ucx::{Started, UCP_AM_SEND_FLAG_REPLY};
        let (a, b) = match (new_transport("ucx", None, &Options::new()), new_transport("ucx", None, &Options::new())) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("SKIPPED: {e}");
                return;
            }
        };
        let ub = b.bind(None).unwrap();
        a.connect(&ub, None).unwrap();
        let dst = Tensor::zeros(&[64], DType::U8).unwrap();
        let md = b.register_memory(&dst).unwrap();
        let d = md.to_remote_buffer().unwrap();
        // The stranger: a raw worker of its own, that ignores whatever comes back.
        let (w, ep) = raw_peer(&ub);
        let h = |f: &[u64], tail: &[u8]| super::header(f, tail);
        let payload = [0xEEu8; 64];
        let wrong_key = [9u8; 16];
        let attempts: Vec<(u32, Vec<u8>, usize, u32)> = vec![
            (super::AM_WRITE, vec![1, 2, 3], 64, UCP_AM_SEND_FLAG_REPLY),
            (super::AM_WRITE, h(&[1, 77, 1, d.buffer_id, 0, 64], &d.access_key), 64, 0),
            (super::AM_WRITE, h(&[2, 77, 1, d.buffer_id, 0, 64], &wrong_key), 64, UCP_AM_SEND_FLAG_REPLY),
            (super::AM_WRITE, h(&[3, 77, 2, d.buffer_id, 0, 1 << 40], &d.access_key), 64, UCP_AM_SEND_FLAG_REPLY),
            (super::AM_WRITE, h(&[4, 77, 3, d.buffer_id, 60, 64], &d.access_key), 64, UCP_AM_SEND_FLAG_REPLY),
            (super::AM_WRITE, h(&[5, 78, u64::MAX, d.buffer_id, 0, 64], &d.access_key), 64, UCP_AM_SEND_FLAG_REPLY),
            (super::AM_ATOMIC, h(&[6, 79, 1, d.buffer_id, 0, 9, 1], &d.access_key), 0, UCP_AM_SEND_FLAG_REPLY),
            (super::AM_DONE, h(&[123_456, 0], &[]), 0, UCP_AM_SEND_FLAG_REPLY),
            (super::AM_READ_DATA, h(&[123_456, 0], &[]), 64, 0),
            // Acceptances: of a torn id, of ids nobody sent, more than an ACKS carries, with
            // data beside them.
            (super::AM_ACKS, vec![1, 2, 3], 0, UCP_AM_SEND_FLAG_REPLY),
            (super::AM_ACKS, h(&[123_456, 654_321], &[]), 0, 0),
            (super::AM_ACKS, h(&(1..=200).collect::<Vec<u64>>(), &[]), 64, UCP_AM_SEND_FLAG_REPLY),
            (999, vec![0; 8], 0, 0),
            // Batches: one whose entry overruns it, one with a ping and a nested batch inside,
            // one with data beside it, one without a reply endpoint.
            (
                super::AM_BATCH,
                [&2u32.to_le_bytes()[..], &[200, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[1; 8]].concat(),
                0,
                UCP_AM_SEND_FLAG_REPLY,
            ),
            (
                super::AM_BATCH,
                [&1u32.to_le_bytes()[..], &[8, 0, 0, 0], &[0; 8], &[5; 8], &9u32.to_le_bytes(), &[0; 12]].concat(),
                0,
                UCP_AM_SEND_FLAG_REPLY,
            ),
            (super::AM_BATCH, vec![0; 16], 64, UCP_AM_SEND_FLAG_REPLY),
            (
                super::AM_BATCH,
                [
                    &2u32.to_le_bytes()[..],
                    &[56, 0, 0, 0],
                    &[64, 0, 0, 0],
                    &[0; 4],
                    &h(&[7, 80, 1, d.buffer_id, 0, 64], &d.access_key),
                ]
                .concat(),
                0,
                0,
            ),
            (0, vec![0; 8], 8, UCP_AM_SEND_FLAG_REPLY),
        ];
        let keep: Vec<Vec<u8>> = attempts.iter().map(|a| a.1.clone()).collect();
        for ((id, _, len, flags), hdr) in attempts.iter().zip(&keep) {
            // SAFETY: `ep` is the stranger's live endpoint; header and payload outlive the
            // loop below, which progresses until the sends are done.
            match unsafe { w.am_send(ep, *id, hdr, payload.as_ptr(), *len, *flags, sent, 0) } {
                Started::Done | Started::Pending(_) | Started::Failed(_) => {}
            }
        }
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(500) {
            w.progress();
        }
        assert!(dst.to_vec::<u8>().unwrap().iter().all(|&x| x == 0), "nothing the stranger sent landed");
        // The real peer is still served.
        let src = Tensor::from_slice(&[64], &[7u8; 64]).unwrap();
        let ms = a.register_memory(&src).unwrap();
        a.write(&ms.to_view(0, None).unwrap(), &d, None).unwrap();
        assert_eq!(dst.to_vec::<u8>().unwrap(), vec![7u8; 64]);
        // SAFETY: the stranger's endpoint, closed once, by force.
        let _ = unsafe { w.close(ep, true) };
        w.progress();
    }

    /// Requests that arrive ahead of their turn wait for it, and run, in order, once the one
    /// before them came (whether that one runs at once, on arrival, or was parked too): two
    /// writes to the same bytes sent in the reverse of their endpoint's order leave the later
    /// one's bytes, and a third sent after them still lands.
    #[test]
    fn requests_that_arrive_out_of_their_order_land_in_it() {
        use crate::sys::ucx::{Started, UCP_AM_SEND_FLAG_REPLY};
        let b = match new_transport("ucx", None, &Options::new()) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("SKIPPED: {e}");
                return;
            }
        };
        let ub = b.bind(None).unwrap();
        let dst = Tensor::zeros(&[64], DType::U8).unwrap();
        let md = b.register_memory(&dst).unwrap();
        let d = md.to_remote_buffer().unwrap();
        // A peer of its own making, to send requests out of order (a transport never does).
        let (w, ep) = raw_peer(&ub);
        let origin = 4242;
        let write = |seq: u64| super::header(&[seq, origin, seq, d.buffer_id, 0, 64], &d.access_key);
        let bytes: Vec<[u8; 64]> = (0..=3u8).map(|i| [0x10 * i; 64]).collect();
        let send = |seq: u64, hdr: &[u8]| {
            // SAFETY: `ep` is the peer's live endpoint; header and payload outlive the sends,
            // which the caller progresses until done.
            match unsafe {
                w.am_send(ep, super::AM_WRITE, hdr, bytes[seq as usize].as_ptr(), 64, UCP_AM_SEND_FLAG_REPLY, sent, 0)
            } {
                Started::Done | Started::Pending(_) | Started::Failed(_) => {}
            }
        };
        let settle = |want: u8| {
            let t = std::time::Instant::now();
            while t.elapsed() < std::time::Duration::from_secs(10) {
                w.progress();
                if dst.to_vec::<u8>().unwrap().iter().all(|&x| x == want) {
                    return true;
                }
            }
            false
        };
        let (h1, h2, h3) = (write(1), write(2), write(3));
        // 2 first: it waits; then 1, which runs and lets 2 run after it.
        send(2, &h2);
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(200) {
            w.progress();
        }
        assert!(dst.to_vec::<u8>().unwrap().iter().all(|&x| x == 0), "a request ran before its turn");
        send(1, &h1);
        assert!(
            settle(0x20),
            "the earlier request did not let the parked one run after it: {:?}",
            dst.to_vec::<u8>().unwrap()
        );
        // The order goes on from there.
        send(3, &h3);
        assert!(settle(0x30), "the next request in order did not land");
        // SAFETY: the peer's endpoint, closed once, by force.
        let _ = unsafe { w.close(ep, true) };
        w.progress();
    }

    /// A batch takes what the worker's largest header holds: 1 KiB where UCX does not say, up
    /// to 8 KiB, always leaving 1 KiB for the requests after a large one.
    #[test]
    fn batches_are_as_large_as_the_workers_header_allows() {
        use super::{BATCH_MIN, BATCHED_MIN, batch_limits};
        assert_eq!(batch_limits(None), (BATCH_MIN, BATCHED_MIN));
        assert_eq!(batch_limits(Some(1500)), (BATCH_MIN, BATCHED_MIN), "too small to grow");
        assert_eq!(batch_limits(Some(8140)), (8140, 8140 - 1024));
        assert_eq!(batch_limits(Some(1 << 20)), (8192, 8192 - 1024), "capped");
    }

    /// A 4 KiB write and the signal after it, started in a batch, leave as one active message
    /// where the worker's header holds them (UCX's tcp here: 8140 bytes), and land in order.
    #[test]
    fn a_4_kib_write_and_its_signal_leave_together() {
        let Some(initiator) = backend() else {
            return;
        };
        let core = initiator.core.clone();
        let owner = new_transport("ucx", None, &Options::new()).unwrap();
        let (a, b) = testkit::connect(super::super::Transport::new(Box::new(initiator), None), owner);
        // What this UCX takes, asked here, not through the limits under test.
        let fits = core.lock().unwrap().worker.max_am_header().is_some_and(|m| m >= 4096 + 128 + 1024);
        let x = WriteThenSignal::new(&a, &b, 4096);
        let (dst, flag) = (&x.dst, &x.flag);
        for round in 1..=4u8 {
            let before = core.lock().unwrap().messages;
            let (w, f) = a.batch(|| x.start(&a, round));
            let sent = core.lock().unwrap().messages - before;
            assert_eq!(sent, if fits { 1 } else { 2 }, "round {round}: messages for a 4 KiB write and its signal");
            w.wait(None).unwrap();
            f.wait(None).unwrap();
            assert_eq!(flag.to_vec::<i64>().unwrap(), [i64::from(round)]);
            assert!(
                dst.to_vec::<u8>().unwrap().iter().all(|&x| x == round),
                "round {round}: the bytes did not land whole"
            );
        }
        if !fits {
            eprintln!(
                "SKIPPED the one-message case: this UCX's header holds {:?} bytes",
                core.lock().unwrap().worker.max_am_header()
            );
        }
    }

    /// `n` bytes of the initiator's to write into the owner's `dst`, and the owner's `flag` to
    /// set after them.
    struct WriteThenSignal {
        src: Tensor,
        dst: Tensor,
        flag: Tensor,
        ms: super::super::Memory,
        s8: super::super::Memory,
        theirs: super::super::RemoteBuffer,
        their_flag: super::super::RemoteBuffer,
        _keep: (Tensor, super::super::Memory, super::super::Memory),
    }

    impl WriteThenSignal {
        fn new(a: &super::super::Transport, b: &super::super::Transport, n: usize) -> WriteThenSignal {
            let src = Tensor::zeros(&[n], DType::U8).unwrap();
            let dst = Tensor::zeros(&[n], DType::U8).unwrap();
            let flag = Tensor::zeros(&[1], DType::I64).unwrap();
            let scratch = Tensor::zeros(&[8], DType::U8).unwrap();
            let (ms, s8) = (a.register_memory(&src).unwrap(), a.register_memory(&scratch).unwrap());
            let (md, mf) = (b.register_memory(&dst).unwrap(), b.register_memory(&flag).unwrap());
            let (theirs, their_flag) = (md.to_remote_buffer().unwrap(), mf.to_remote_buffer().unwrap());
            WriteThenSignal { src, dst, flag, ms, s8, theirs, their_flag, _keep: (scratch, md, mf) }
        }

        /// Fills the source with `round`, starts its write, then the flag's store of `round`.
        fn start(&self, a: &super::super::Transport, round: u8) -> (super::super::Work, super::super::Work) {
            self.src.fill(round).unwrap();
            let w = a.start_write(&self.ms.to_view(0, None).unwrap(), &self.theirs, None).unwrap();
            let s8 = self.s8.to_view(0, Some(8)).unwrap();
            let f = a.start_atomic(&s8, &self.their_flag, Atomic::Set64, u64::from(round), None, false).unwrap();
            (w, f)
        }
    }

    /// Completion callback of a raw peer's sends: frees the request.
    unsafe extern "C" fn sent(r: *mut std::ffi::c_void, _: i32, _: *mut std::ffi::c_void) {
        // SAFETY: UCX hands the completed request, freed once here.
        unsafe { crate::sys::ucx::request_free(r) };
    }

    /// A raw UCX worker connected to the endpoint at `url`, sending whatever a test makes it
    /// send and ignoring every answer (a stranger, or a peer that breaks the rules).
    fn raw_peer(url: &[u8]) -> (crate::sys::ucx::Worker, crate::sys::ucx::Handle) {
        unsafe extern "C" fn nothing(_: *mut std::ffi::c_void, _: crate::sys::ucx::Handle, _: i32) {}
        unsafe extern "C" fn ignore(
            _: *mut std::ffi::c_void,
            _: *const std::ffi::c_void,
            _: usize,
            _: *mut std::ffi::c_void,
            _: usize,
            _: *const crate::sys::ucx::AmRecvParam,
        ) -> i32 {
            0
        }
        super::tuned();
        let w = crate::sys::ucx::Worker::new(crate::sys::ucx::Tls::Configured).unwrap();
        let address = super::parse_url(super::super::split_endpoint(url).unwrap().0).unwrap();
        for id in 1..=super::AM_ACKS {
            // SAFETY: `ignore` touches nothing.
            unsafe { w.set_am_handler(id, ignore, std::ptr::null_mut()) }.unwrap();
        }
        // SAFETY: `nothing` does nothing; no arg.
        let ep = unsafe { w.connect(&address, Some(nothing), std::ptr::null_mut()) }.unwrap();
        (w, ep)
    }

    /// A ucx backend on the default options, or `None` (reported SKIPPED) without UCX.
    fn backend() -> Option<super::UcxBackend> {
        super::UcxBackend::new(&Options::new()).map_err(|e| eprintln!("SKIPPED: {e}")).ok()
    }

    /// A connected pair, `b` the owner, with the owner's core (whose lock keeps it from serving
    /// anything); `None` (reported SKIPPED) without UCX.
    fn pair_with_owner_core()
    -> Option<(super::super::Transport, super::super::Transport, std::sync::Arc<std::sync::Mutex<super::Core>>)> {
        let owner = backend()?;
        let core = owner.core.clone();
        let a = new_transport("ucx", None, &Options::new()).unwrap();
        let (a, b) = testkit::connect(a, super::super::Transport::new(Box::new(owner), None));
        Some((a, b, core))
    }

    /// Posted requests are done once sent, land in order, and a close fences them (the owner
    /// kept from serving by its locked worker).
    #[test]
    fn posted_requests_complete_once_sent_land_in_order_and_a_close_fences_them() {
        let Some((a, b, core)) = pair_with_owner_core() else { return };
        testkit::posted_requests_land_in_order_and_a_close_fences_them(a, &b, || core.lock().unwrap());
    }

    /// Requests that reach the owner in one pass over what arrived are answered together (ACKS
    /// of up to `ACKS_MAX` ids per peer endpoint), each Work with its own outcome: 100 writes
    /// and a refused one started while the owner's worker is held.
    #[test]
    fn requests_served_in_one_pass_are_answered_together_each_with_its_own_outcome() {
        let Some((a, b, core)) = pair_with_owner_core() else { return };
        let n = 100;
        let dst = Tensor::zeros(&[n * 8], DType::U8).unwrap();
        let remote = b.register_memory(&dst).unwrap().to_remote_buffer().unwrap();
        let gone = Tensor::zeros(&[8], DType::U8).unwrap();
        let m = b.register_memory(&gone).unwrap();
        let stale = m.to_remote_buffer().unwrap();
        b.unregister_memory(&m).unwrap();
        let src: Vec<u8> = (0..n * 8).map(|i| (i % 251) as u8 + 1).collect();
        let src = Tensor::from_slice(&[n * 8], &src).unwrap();
        let ms = a.register_memory(&src).unwrap();
        let long = Some(std::time::Duration::from_secs(30));
        let held = core.lock().unwrap();
        let mut works: Vec<_> = (0..n)
            .map(|i| a.start_write(&ms.to_view(i * 8, Some(8)).unwrap(), &remote.slice(i as u64 * 8, 8).unwrap(), long))
            .collect::<crate::error::Result<_>>()
            .unwrap();
        let refused = a.start_write(&ms.to_view(0, Some(8)).unwrap(), &stale, long).unwrap();
        works.extend((0..3).map(|i| {
            a.start_write(&ms.to_view(i * 8, Some(8)).unwrap(), &remote.slice(i as u64 * 8, 8).unwrap(), long).unwrap()
        }));
        // Every request reaches the owner before it looks.
        std::thread::sleep(std::time::Duration::from_millis(200));
        drop(held);
        for w in works {
            w.wait(long).unwrap();
        }
        let e = refused.wait(long).unwrap_err();
        assert_eq!(e.transfer_kind(), Some(TransferKind::Refused), "{e}");
        assert_eq!(dst.to_vec::<u8>().unwrap(), src.to_vec::<u8>().unwrap());
    }

    #[test]
    fn a_refused_posted_write_ends_the_connection_with_the_reason() {
        if let Some((a, b)) = testkit::pair("ucx") {
            testkit::a_refused_posted_write_ends_the_connection_with_the_reason(&a, &b);
        }
    }

    /// Small requests started in a batch leave as one message; the owner takes it apart and
    /// serves each in order, with its own outcome.
    #[test]
    fn a_batch_of_mixed_requests_each_get_their_own_outcome() {
        if let Some((a, b)) = testkit::pair("ucx") {
            testkit::a_batch_of_mixed_requests_each_get_their_own_outcome(&a, &b);
        }
    }

    #[test]
    fn remote_atomics_over_tcp_and_ucx_agree() {
        atomics_on("tcp");
        atomics_on("ucx");
    }

    /// A caller that starts requests back to back and waits for none of them still serves its
    /// peers: the progress thread leaves the worker to a caller that has it, so starting a
    /// request looks at the worker once nobody did for a while. Here a peer's reads complete
    /// while the caller still posts writes (the symmetric-memory layer's pattern; without
    /// those looks, each read waited for the loop's end).
    #[test]
    fn a_caller_starting_requests_back_to_back_still_serves_its_peers() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::{Duration, Instant};
        let Some((a, b)) = testkit::pair("ucx") else { return };
        let (ta, tb) = (Tensor::zeros(&[64], DType::U8).unwrap(), Tensor::zeros(&[64], DType::U8).unwrap());
        ta.copy_from_slice(&[7u8; 64]).unwrap();
        let (ma, mb) = (a.register_memory(&ta).unwrap(), b.register_memory(&tb).unwrap());
        let (ra, rb) = (ma.to_remote_buffer().unwrap(), mb.to_remote_buffer().unwrap());
        // The writer posts until the reads end (at most 60 s: a read that waited for the
        // writer's loop to end would take that long), however slowly a loaded machine runs them.
        let (writing, reads_done) = (AtomicBool::new(true), AtomicBool::new(false));
        std::thread::scope(|s| {
            s.spawn(|| {
                let view = ma.to_view(0, Some(8)).unwrap();
                let to = rb.slice(0, 8).unwrap();
                let end = Instant::now() + Duration::from_secs(60);
                // Acquire: pairs with the reader's Release store of `reads_done`.
                while !reads_done.load(Ordering::Acquire) && Instant::now() < end {
                    // Posted: done once sent, never waited for.
                    a.post_write(&view, &to, testkit::LONG).unwrap();
                }
                // Release: pairs with the Acquire load below.
                writing.store(false, Ordering::Release);
            });
            std::thread::sleep(Duration::from_millis(100));
            let sink = mb.to_mutable_view(8, Some(8)).unwrap();
            let from = ra.slice(0, 8).unwrap();
            for _ in 0..20 {
                let t = Instant::now();
                b.read(&sink, &from, testkit::LONG).unwrap();
                assert!(t.elapsed() < Duration::from_secs(5), "a read took {:?}", t.elapsed());
            }
            // Acquire: pairs with the writer's Release store.
            let still = writing.load(Ordering::Acquire);
            // Release: pairs with the writer's Acquire load.
            reads_done.store(true, Ordering::Release);
            assert!(still, "the writer stopped before the reads ended");
        });
        assert_eq!(tb.to_vec::<u8>().unwrap()[..16], [7u8; 16]);
    }

    /// A waiter inside a batch sends what the batch holds even when it spins not at all
    /// (`SYMMEM_SPIN_US=0`, in a child process, over ucx and tcp): it progresses at least once,
    /// and over ucx takes the core's lock for it rather than trying it (the progress thread,
    /// which holds it often, made a waiter that only tried sleep with its request held, until
    /// its timeout, in about one run in four).
    #[test]
    fn a_waiter_in_a_batch_sends_what_it_holds_without_spinning() {
        let mut tests = vec![
            "transport::tcp::tests::waiting_inside_a_batch_for_its_own_request_sends_it",
            "transport::tcp::tests::a_batch_of_mixed_requests_read_ahead_by_the_target_each_get_their_own_outcome",
        ];
        match super::available() {
            Ok(()) => tests.push("transport::ucx::tests::a_batch_of_mixed_requests_each_get_their_own_outcome"),
            Err(e) => eprintln!("SKIPPED over ucx: {e}"),
        }
        for _ in 0..3 {
            in_a_child(&tests, ("SYMMEM_SPIN_US", "0"));
        }
    }

    /// Runs `tests` of this binary in a child process with `env` set; asserts they all pass.
    fn in_a_child(tests: &[&str], (var, value): (&str, &str)) {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .arg("--exact")
            .args(tests)
            .args(["--test-threads=1"])
            .env(var, value)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("{} passed", tests.len())),
            "{:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `UCX_PROTO_ENABLE=y` (UCX's new protocols) changes nothing: small, batched, posted and
    /// refused requests still run, in a child process whose UCX reads the variable (UCX 1.13's
    /// experimental protocols aborted it with "stack smashing detected").
    #[test]
    fn ucx_new_protocols_asked_for_change_nothing() {
        if let Err(e) = super::available() {
            eprintln!("SKIPPED: {e}");
            return;
        }
        let tests = [
            "transport::ucx::tests::a_batch_of_mixed_requests_each_get_their_own_outcome",
            "transport::ucx::tests::a_refused_posted_write_ends_the_connection_with_the_reason",
            "transport::ucx::tests::remote_atomics_over_tcp_and_ucx_agree",
        ];
        in_a_child(&tests, ("UCX_PROTO_ENABLE", "y"));
    }

    /// The value of `name` among the transport settings symmem gave UCX's configuration, as
    /// UCX prints them (`NAME=value` lines after its own `UCX_*` ones).
    fn given(text: &str, name: &str) -> Option<String> {
        text.lines().find_map(|l| l.trim().strip_prefix(&format!("{name}="))).map(str::to_string)
    }

    /// UCX's tcp segments are set to symmem's (64K to send, 256K to receive) in the
    /// configuration a context is made from, unless the user set either: then symmem sets
    /// neither and UCX reads the user's. Run as it is (neither set under `cargo test`) and in a
    /// child with `UCX_TCP_TX_SEG_SIZE=16K` by `a_users_tcp_segment_size_is_left_alone`; that
    /// the setting reaches UCX's tcp transport is `sys::ucx`'s
    /// `symmems_tcp_segments_reach_ucxs_tcp_transport`.
    #[test]
    fn tcp_segments_are_symmems_unless_the_user_set_one() {
        if let Err(e) = super::available() {
            eprintln!("SKIPPED: {e}");
            return;
        }
        let text = crate::sys::ucx::config_text(crate::sys::ucx::Tls::Configured, crate::sys::ucx::sets_tcp_segments())
            .unwrap();
        let set = (given(&text, "TX_SEG_SIZE"), given(&text, "RX_SEG_SIZE"));
        if crate::config::ucx_tcp_segments_set() {
            assert_eq!(crate::config::value("UCX_TCP_TX_SEG_SIZE"), Some("16K"));
            assert_eq!(set, (None, None), "{text}");
        } else {
            assert_eq!(set, (Some("64K".into()), Some("256K".into())), "{text}");
        }
        // The control: a configuration symmem gives no segments to shows none.
        let plain = crate::sys::ucx::config_text(crate::sys::ucx::Tls::Configured, false).unwrap();
        assert_eq!(given(&plain, "TX_SEG_SIZE"), None, "{plain}");
    }

    /// A user's `UCX_TCP_TX_SEG_SIZE` wins: in a child with it set, symmem gives UCX no
    /// segments of its own (so UCX never pairs the user's send segment with symmem's receive
    /// segment), and requests still run.
    #[test]
    fn a_users_tcp_segment_size_is_left_alone() {
        if let Err(e) = super::available() {
            eprintln!("SKIPPED: {e}");
            return;
        }
        let tests = [
            "transport::ucx::tests::tcp_segments_are_symmems_unless_the_user_set_one",
            "transport::ucx::tests::a_batch_of_mixed_requests_each_get_their_own_outcome",
        ];
        in_a_child(&tests, ("UCX_TCP_TX_SEG_SIZE", "16K"));
    }
}
