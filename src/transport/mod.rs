//! One-sided transports (PyTorch's `torch.distributed._transport`; `docs/transport-contract.md`): register memory, hand a descriptor to a peer,
//! and the peer reads or writes it without the owner taking part.
//!
//! ```text
//!   new_transport("tcp") ─▶ Transport ── bind() ─▶ URL bytes ──(control plane)──▶ peer.connect()
//!   register_memory(t)   ─▶ Memory ── to_remote_buffer() ─▶ RemoteBuffer ─▶ serialize() ─▶ peer
//!   peer: write(view, remote) / read(mutable view, remote), synchronous or as a Work
//! ```
//!
//! Everything backends share lives here: argument checks, registrations and their aliases,
//! views, descriptors, Works, close and drain, the registry, and rank bootstrap through a
//! store. A backend ([`Backend`]) only binds, connects, exposes registrations to its peer and
//! moves bytes. Offsets and lengths are bytes throughout.
//!
//! Beyond PyTorch's API: [`RemoteBuffer::slice`] addresses part of a remote registration, and
//! [`Transport::register_memory_read_only`] exports memory a peer may read but never write.
//!
//! Layer: uses `store` (bootstrap), `tensor`, `wire` and `sys`.

mod registry;
mod target;
#[cfg(test)]
pub(crate) mod testkit;
mod work;

pub mod auto;
pub mod shm;
pub mod tcp;
pub mod ucx;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use registry::{Caps, Factory, Reach, available_transports, register_transport};
pub(crate) use registry::{caps_of, pick};
pub(crate) use work::WorkState;
pub use work::{Work, WorkFuture, wait_all};

use crate::error::{Completion, Error, Failed, Result, TransferKind};
use crate::store::{PrefixStore, Store};
use crate::tensor::Device;
use crate::tensor::{Storage, Tensor};
use crate::wire::descriptor::{self, Kind, Value};

/// Backend constructor options, `key=value` as given to `new_transport`.
pub type Options = BTreeMap<String, String>;

/// Nanoseconds every request a transport starts waits before its backend gets it
/// ([`lag_sends`]; 0: none).
static LAG_NS: AtomicU64 = AtomicU64::new(0);

fn lag_now() -> Duration {
    // Relaxed: a test's setting, read per request started; it publishes nothing.
    Duration::from_nanos(LAG_NS.load(Ordering::Relaxed))
}

/// How a request its backend refused to start fails: the error's kind, else refused.
fn not_started(e: &Error) -> Failed {
    Failed::new(e.transfer_kind().unwrap_or(TransferKind::Refused), e.to_string())
}

/// Delays every request this process's transports start from now on by `lag` (zero: none)
/// before their backends get it, keeping their order: a fault injection for tests. One
/// process's links then run late, as on a loaded machine or a congested network, which forces
/// the orders between links that occur there only rarely (a rank's message arriving after a
/// later one another rank sent on its behalf). A transport that lagged once hands its requests
/// to a thread of its own from then on. Requests complete as usual, late; copies a backend makes
/// on the caller's thread (`shm`) are not lagged.
#[doc(hidden)]
pub fn lag_sends(lag: Duration) {
    // Relaxed: see `lag_now`.
    LAG_NS.store(u64::try_from(lag.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// A transport backend: binds, connects to one peer, exposes registrations to it, and moves
/// bytes. Everything else is [`Transport`]'s.
pub trait Backend: Send + Sync + 'static {
    /// The backend's registered name, as written into its descriptors.
    fn name(&self) -> &str;
    /// What it can do (for a composite backend, what its connected path can do).
    fn caps(&self) -> Caps;
    /// Whether it can connect to the peer at `url`, without trying (a same-host backend and a
    /// peer on another host); the reason when not.
    fn reaches(&self, _url: &[u8]) -> std::result::Result<(), String> {
        Ok(())
    }
    /// Starts listening; returns the URL peers connect to. Idempotent.
    fn bind(&self, timeout: Duration) -> Result<Vec<u8>>;
    /// Connects to the peer at `url`.
    fn connect(&self, url: &[u8], timeout: Duration) -> Result<()>;
    /// Whether connected and the connection is alive.
    fn connected(&self) -> bool;
    /// Makes a registration reachable by the peer.
    fn expose(&self, reg: &Arc<Registration>) -> Result<()>;
    /// Makes a registration unreachable.
    fn withdraw(&self, reg: &Registration);
    /// Starts a transfer; the backend completes `req.work` when it ends, successfully or not.
    fn submit(&self, req: Request) -> Result<()>;
    /// The synchronous fast path: moves the bytes of a write or a read now, on the caller's
    /// thread, when this backend can do so without a [`Work`] (a copy through a mapping or
    /// cross-memory attach), and returns how it ended; `None` when it cannot (not connected,
    /// or a backend whose transfers complete elsewhere), and the transfer goes through
    /// [`Backend::submit`]. [`Transport`] has checked `local` and `remote` as for `submit`;
    /// the transfer covers `local.size()` bytes from the start of `remote`.
    fn transfer_now(&self, _write: bool, _local: &MemoryView, _remote: &RemoteBuffer) -> Option<Completion> {
        None
    }
    /// Holds (`true`) or releases (`false`) the small requests submitted next, so that those
    /// started back to back (a write and the signal after it) leave together, in one system
    /// call, at the last release. Holds nest. A held request still leaves at once when a
    /// caller waits for it. Backends that send nothing themselves ignore it.
    fn hold(&self, _on: bool) {}
    /// Serves, on the calling thread, the peer's requests that have already arrived, so that a
    /// caller waiting for the peer's signal needs no other thread to apply it. Never waits for
    /// a request that has not begun to arrive. Backends whose peers need no serving (shm), or
    /// that serve them elsewhere, ignore it.
    fn serve_arrived(&self) {}
    /// Waits, at most `timeout`, until the posted requests ([`Request::posted`]) it completed
    /// before they landed have landed; [`Transport::close`] calls it before closing.
    fn fence(&self, _timeout: Duration) -> Result<()> {
        Ok(())
    }
    /// Releases sockets and threads, failing whatever is still pending. Never blocks long.
    fn shutdown(&self);
    /// The timeout of operations given none.
    fn default_timeout(&self) -> Duration;
    /// Whether the backend can work in this process (a missing library, a refused syscall);
    /// an unsupported backend is closed and `new_transport` fails.
    fn supported(&self) -> bool {
        true
    }
    /// A one-line account of how the backend connected (e.g. which path `auto` chose).
    fn describe(&self) -> String {
        self.name().to_string()
    }
    /// Why the backend is no longer connected, when it knows (a peer that exited, a lost
    /// connection).
    fn disconnect_reason(&self) -> Option<String> {
        None
    }
}

/// Direction of a transfer, seen from the initiator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Local view → remote buffer.
    Write,
    /// Remote buffer → local mutable view.
    Read,
    /// A remote atomic on the word at the start of the remote range (crate-internal: the
    /// symmetric-memory layer signals peers on other hosts with it). Backends without remote
    /// atomics refuse it.
    Atomic(Atomic, u64),
}

/// A remote atomic on one word of a peer's registered memory, as symmetric memory signals
/// peers on other hosts. The target performs it with an atomic instruction and wakes whoever
/// sleeps on the word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Atomic {
    /// Raise a symmetric-memory signal in a 4-byte slot (the signal-pad protocol's put, once):
    /// fails [`TransferKind::Busy`] if the slot still holds an unconsumed signal.
    SlotPut,
    /// Store the operand's low 32 bits.
    Set32,
    /// Store the 64-bit operand.
    Set64,
}

impl Atomic {
    /// The size of the word it acts on.
    pub fn width(self) -> u64 {
        match self {
            Atomic::SlotPut | Atomic::Set32 => 4,
            Atomic::Set64 => 8,
        }
    }
}

/// One transfer handed to a backend.
#[derive(Debug)]
pub struct Request {
    /// Which way the bytes go.
    pub direction: Direction,
    /// The local registration.
    pub local: Arc<Registration>,
    /// Byte offset in the local registration.
    pub local_offset: usize,
    /// Bytes to move.
    pub len: usize,
    /// The remote range (its offset is the start; `len` bytes from there).
    pub remote: RemoteBuffer,
    /// Posted (a write, or a store atomic): the initiator needs no word that it landed, so the
    /// backend may complete it once it has left this process, keeping it in order with what
    /// the caller starts next on the link; a refusal then ends the connection (nobody is left
    /// to report it to). Backends may ignore it and complete it when it lands.
    pub posted: bool,
    /// Completed by the backend.
    pub(crate) work: Arc<WorkState>,
}

impl Request {
    /// Completes the transfer; the backend calls this exactly once.
    pub fn complete(&self, result: Completion) {
        self.work.complete(result);
    }

    /// The local bytes' address.
    pub fn local_ptr(&self) -> *mut u8 {
        self.local.ptr.wrapping_add(self.local_offset)
    }
}

static NEXT_TRANSPORT: AtomicU64 = AtomicU64::new(1);

/// Memory registered with a transport. Aliases (the same address range registered again) share
/// one registration: unregistering any of them invalidates all, with their views and
/// descriptors.
#[derive(Debug)]
pub struct Registration {
    transport: u64,
    /// The owning transport's endpoint id, which its descriptors carry.
    endpoint: u64,
    backend: Arc<str>,
    /// Random 64-bit id and 128-bit key: together an unguessable capability.
    pub(crate) id: u64,
    pub(crate) key: [u8; 16],
    /// Keeps the registered memory alive as long as anything can reach it.
    storage: Arc<dyn Storage>,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    /// Whether peers may write it.
    pub(crate) remote_writable: bool,
    live: AtomicBool,
    pending: AtomicUsize,
}

// SAFETY: `ptr` points into `storage`, which the registration keeps alive; the bytes are
// accessed only through raw copies whose ordering is the transfer protocol's business.
unsafe impl Send for Registration {}
// SAFETY: as for Send.
unsafe impl Sync for Registration {}

impl Registration {
    /// The count of threads sleeping on its words, when its memory keeps one
    /// ([`Storage::sleepers`]): a remote atomic's store wakes nobody while it is zero.
    pub(crate) fn sleepers(&self) -> Option<&std::sync::atomic::AtomicU32> {
        self.storage.sleepers()
    }

    /// Whether it is still registered.
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks an access to `[offset, offset + len)`, as a serving backend must for every
    /// request: key (in constant time), liveness, bounds, and write permission.
    pub fn check_access(&self, key: &[u8; 16], offset: u64, len: u64, write: bool) -> std::result::Result<(), String> {
        let same = self.key.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        if !same {
            return Err("unknown remote buffer".into());
        }
        if !self.is_live() {
            return Err("remote buffer has been unregistered".into());
        }
        if offset.checked_add(len).is_none_or(|end| end > self.len as u64) {
            let what = if write { "write" } else { "read" };
            return Err(format!(
                "{what} of {len} bytes at offset {offset} exceeds the registered buffer of {} bytes",
                self.len
            ));
        }
        if write && !self.remote_writable {
            return Err("remote buffer is registered read-only".into());
        }
        Ok(())
    }

    /// The registered bytes' address.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its random id, as descriptors carry it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its access key.
    pub fn key(&self) -> &[u8; 16] {
        &self.key
    }

    /// Whether peers may write it.
    pub fn remote_writable(&self) -> bool {
        self.remote_writable
    }

    /// For memory in a shared-memory file of this process: descriptor number and the file
    /// offset of the registered range.
    pub fn shared_file(&self) -> Option<(i32, u64)> {
        let (fd, base) = self.storage.shared_file()?;
        Some((fd, base + (self.ptr as usize - self.storage.ptr() as usize) as u64))
    }
}

/// Counts a transfer against its local registration until dropped (with its Work's state).
pub(crate) struct InFlight(Arc<Registration>);

impl Drop for InFlight {
    fn drop(&mut self) {
        // Release: pairs with the Acquire load in unregister_memory.
        self.0.pending.fetch_sub(1, Ordering::Release);
    }
}

/// A handle to registered memory.
#[derive(Clone, Debug)]
pub struct Memory {
    reg: Arc<Registration>,
}

fn view_range(reg: &Registration, offset: usize, length: Option<usize>) -> Result<(usize, usize)> {
    let len = length.unwrap_or(reg.len.saturating_sub(offset));
    if offset > reg.len || len > reg.len - offset {
        return Err(Error::InvalidArgument(format!(
            "memory view [{offset}, {offset}+{len}) is outside the registered memory of {} bytes",
            reg.len
        )));
    }
    Ok((offset, len))
}

impl Memory {
    /// A read-only view of `length` bytes at `offset` (`None`: to the end). An empty view at
    /// the end is legal.
    pub fn to_view(&self, offset: usize, length: Option<usize>) -> Result<MemoryView> {
        let (offset, len) = view_range(&self.reg, offset, length)?;
        Ok(MemoryView { reg: self.reg.clone(), offset, len })
    }

    /// A view that transfers may write into (the destination of a read).
    pub fn to_mutable_view(&self, offset: usize, length: Option<usize>) -> Result<MutableMemoryView> {
        Ok(MutableMemoryView(self.to_view(offset, length)?))
    }

    /// The descriptor of the whole registration, to hand to the peer.
    pub fn to_remote_buffer(&self) -> Result<RemoteBuffer> {
        if !self.reg.is_live() {
            return Err(Error::InvalidArgument("memory has been unregistered".into()));
        }
        Ok(RemoteBuffer {
            backend: self.reg.backend.clone(),
            endpoint: self.reg.endpoint,
            buffer_id: self.reg.id,
            offset: 0,
            length: self.reg.len as u64,
            access_key: self.reg.key,
            writable: self.reg.remote_writable,
        })
    }

    /// The registered length in bytes.
    pub fn len(&self) -> usize {
        self.reg.len
    }

    /// Whether the registration is empty.
    pub fn is_empty(&self) -> bool {
        self.reg.len == 0
    }

    /// Whether it is still registered.
    pub fn is_live(&self) -> bool {
        self.reg.is_live()
    }
}

/// A read-only view of registered memory: the source of a write.
#[derive(Clone, Debug)]
pub struct MemoryView {
    reg: Arc<Registration>,
    offset: usize,
    len: usize,
}

impl MemoryView {
    /// Its size in bytes.
    pub fn size(&self) -> usize {
        self.len
    }

    /// The address of its first byte: valid for [`MemoryView::size`] bytes while the view
    /// lives (the view holds its registration, which holds the memory).
    pub fn as_ptr(&self) -> *mut u8 {
        self.reg.ptr.wrapping_add(self.offset)
    }
}

/// A view of registered memory that transfers may write: the destination of a read. Usable
/// wherever a read-only view is.
#[derive(Clone, Debug)]
pub struct MutableMemoryView(MemoryView);

impl MutableMemoryView {
    /// Its size in bytes.
    pub fn size(&self) -> usize {
        self.0.len
    }

    /// The same bytes as a read-only view.
    pub fn as_view(&self) -> &MemoryView {
        &self.0
    }
}

impl std::ops::Deref for MutableMemoryView {
    type Target = MemoryView;
    fn deref(&self) -> &MemoryView {
        &self.0
    }
}

/// The options of a backend that takes only `timeout` (seconds, positive and finite; 30 when
/// absent): its value, or an error naming the backend and the bad or unknown option.
pub(crate) fn timeout_option(backend: &str, options: &Options) -> Result<Duration> {
    let mut timeout = Duration::from_secs(30);
    for (k, v) in options {
        match k.as_str() {
            "timeout" => {
                timeout = v
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .and_then(crate::config::timeout_from_secs)
                    .filter(|t| !t.is_zero())
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!("{backend} transport option timeout={v:?} is not valid"))
                    })?;
            }
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown {backend} transport option {other:?} (known: timeout)"
                )));
            }
        }
    }
    Ok(timeout)
}

/// The fields of the built-in backends' descriptors, in declaration order.
const SCHEMA: &[(&str, Kind)] = &[
    ("buffer_id", Kind::Int),
    ("offset", Kind::Int),
    ("length", Kind::Int),
    ("access_key", Kind::Bytes),
    ("writable", Kind::Int),
    ("endpoint", Kind::Int),
];

/// A descriptor of (part of) a peer's registration: a capability to access it. Never holds
/// data or native handles; exchange it only with authorized peers.
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteBuffer {
    backend: Arc<str>,
    /// The owner's endpoint id: a transport refuses a descriptor of another endpoint than the
    /// one it connected to.
    pub(crate) endpoint: u64,
    pub(crate) buffer_id: u64,
    pub(crate) offset: u64,
    pub(crate) length: u64,
    pub(crate) access_key: [u8; 16],
    pub(crate) writable: bool,
}

impl std::fmt::Debug for RemoteBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is a secret; never print it.
        f.debug_struct("RemoteBuffer")
            .field("backend", &self.backend)
            .field("buffer_id", &self.buffer_id)
            .field("offset", &self.offset)
            .field("length", &self.length)
            .field("writable", &self.writable)
            .finish_non_exhaustive()
    }
}

impl RemoteBuffer {
    /// The JSON v1 envelope bytes.
    pub fn serialize(&self) -> Vec<u8> {
        descriptor::encode(
            &self.backend,
            &[
                ("buffer_id", Value::Int(self.buffer_id)),
                ("offset", Value::Int(self.offset)),
                ("length", Value::Int(self.length)),
                ("access_key", Value::Bytes(self.access_key.to_vec())),
                ("writable", Value::Int(u64::from(self.writable))),
                ("endpoint", Value::Int(self.endpoint)),
            ],
        )
    }

    /// Parses envelope bytes strictly (unknown fields, duplicates, wrong types and bad base64 are
    /// refused, as by PyTorch's parser).
    pub fn deserialize(data: &[u8]) -> Result<RemoteBuffer> {
        let bad = |e: descriptor::DescriptorError| Error::InvalidArgument(e.to_string());
        let backend = descriptor::backend_of(data).map_err(bad)?;
        let v = descriptor::decode(data, &backend, SCHEMA).map_err(bad)?;
        let int = |i: usize| match &v[i] {
            Value::Int(n) => *n,
            _ => 0,
        };
        let Value::Bytes(key) = &v[3] else {
            return Err(Error::InvalidArgument("invalid descriptor field \"access_key\"".into()));
        };
        let access_key: [u8; 16] = key
            .as_slice()
            .try_into()
            .map_err(|_| Error::InvalidArgument("invalid descriptor field \"access_key\"".into()))?;
        let writable = match int(4) {
            0 => false,
            1 => true,
            _ => return Err(Error::InvalidArgument("invalid descriptor field \"writable\"".into())),
        };
        if int(1).checked_add(int(2)).is_none() {
            return Err(Error::InvalidArgument("invalid descriptor field \"length\"".into()));
        }
        Ok(RemoteBuffer {
            backend: Arc::from(backend),
            endpoint: int(5),
            buffer_id: int(0),
            offset: int(1),
            length: int(2),
            access_key,
            writable,
        })
    }

    /// The backend it belongs to.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.length
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// Whether the owner lets peers write it.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// `length` bytes at `offset` within this range: a remote byte offset, which PyTorch's API
    /// lacks.
    pub fn slice(&self, offset: u64, length: u64) -> Result<RemoteBuffer> {
        if offset.checked_add(length).is_none_or(|end| end > self.length) {
            return Err(Error::InvalidArgument(format!(
                "remote slice [{offset}, {offset}+{length}) is outside the remote buffer of {} bytes",
                self.length
            )));
        }
        Ok(RemoteBuffer { offset: self.offset + offset, length, ..self.clone() })
    }
}

/// Lifecycle of a transport.
const OPEN: u8 = 0;
const CLOSING: u8 = 1;
const CLOSED: u8 = 2;

/// A one-sided transport endpoint: one peer, registered memory, and transfers to and from the
/// peer's registrations.
///
/// ```
/// use symmem::tensor::Tensor;
/// use symmem::transport::{new_transport, Options};
///
/// let trainer = new_transport("tcp", None, &Options::new())?;
/// let replica = new_transport("tcp", None, &Options::new())?;
/// let (trainer_url, replica_url) = (trainer.bind(None)?, replica.bind(None)?);
/// trainer.connect(&replica_url, None)?;
/// replica.connect(&trainer_url, None)?;
/// let weights = Tensor::from_slice(&[8], &[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])?;
/// let received = Tensor::zeros(&[8], weights.dtype())?;
/// let source = trainer.register_memory(&weights)?;
/// let target = replica.register_memory(&received)?;
/// // Exchange these bytes through the application's control plane.
/// let remote = symmem::transport::RemoteBuffer::deserialize(&target.to_remote_buffer()?.serialize())?;
/// let work = trainer.start_write(&source.to_view(0, None)?, &remote, None)?;
/// work.wait(None)?;
/// assert_eq!(received.to_vec::<f32>()?, weights.to_vec::<f32>()?);
/// trainer.close(None)?;
/// replica.close(None)?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub struct Transport {
    id: u64,
    /// This endpoint's random id: its URL carries it, and so do its descriptors.
    endpoint: u64,
    /// The connected peer's endpoint id, when its URL carried one.
    peer_endpoint: std::sync::OnceLock<u64>,
    backend: Arc<dyn Backend>,
    device: Option<Device>,
    regs: Mutex<HashMap<(usize, usize), Arc<Registration>>>,
    /// Where started requests wait their time once this process lags its sends
    /// ([`lag_sends`]): a thread hands them to the backend, in order.
    lagged: std::sync::OnceLock<std::sync::mpsc::Sender<(Instant, Request)>>,
    outstanding: Mutex<Vec<Arc<WorkState>>>,
    state: std::sync::atomic::AtomicU8,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport").field("id", &self.id).field("backend", &self.backend.name()).finish_non_exhaustive()
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // getrandom fails only without an entropy source, where nothing here can be secure.
    getrandom::fill(&mut b).expect("the OS random source");
    u64::from_le_bytes(b)
}

fn random_key() -> [u8; 16] {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("the OS random source");
    b
}

/// What separates a backend's URL from the endpoint id in a transport's URL.
const ENDPOINT_MARK: &str = "#e=";

/// Splits a transport URL into the backend's URL and the endpoint id after [`ENDPOINT_MARK`],
/// if it has one.
pub(crate) fn split_endpoint(url: &[u8]) -> Result<(&[u8], Option<u64>)> {
    let mark = ENDPOINT_MARK.as_bytes();
    let Some(at) = url.windows(mark.len()).rposition(|w| w == mark) else { return Ok((url, None)) };
    let hex = &url[at + mark.len()..];
    let id = std::str::from_utf8(hex)
        .ok()
        .filter(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .and_then(|h| u64::from_str_radix(h, 16).ok())
        .ok_or_else(|| Error::InvalidArgument("malformed transport URL: a bad endpoint id after #e=".into()))?;
    Ok((&url[..at], Some(id)))
}

impl Transport {
    /// Wraps a backend.
    pub fn new(backend: Box<dyn Backend>, device: Option<Device>) -> Transport {
        Transport {
            id: NEXT_TRANSPORT.fetch_add(1, Ordering::Relaxed),
            endpoint: random_u64(),
            peer_endpoint: std::sync::OnceLock::new(),
            backend: Arc::from(backend),
            device,
            regs: Mutex::new(HashMap::new()),
            lagged: std::sync::OnceLock::new(),
            outstanding: Mutex::new(Vec::new()),
            state: std::sync::atomic::AtomicU8::new(OPEN),
        }
    }

    /// The queue of lagged requests, once this process lags its sends (and from then on, so
    /// that requests stay in the order they were started).
    fn lag(&self) -> Option<&std::sync::mpsc::Sender<(Instant, Request)>> {
        if let Some(tx) = self.lagged.get() {
            return Some(tx);
        }
        if lag_now().is_zero() {
            return None;
        }
        let (tx, rx) = std::sync::mpsc::channel::<(Instant, Request)>();
        let backend = self.backend.clone();
        let spawned = std::thread::Builder::new().name("symmem-lag".into()).spawn(move || {
            for (due, req) in rx {
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                let work = req.work.clone();
                if let Err(e) = backend.submit(req) {
                    work.complete(Err(not_started(&e)));
                }
            }
        });
        if spawned.is_err() {
            return None;
        }
        Some(self.lagged.get_or_init(|| tx))
    }

    fn check_open(&self) -> Result<()> {
        if self.state.load(Ordering::Acquire) != OPEN {
            return Err(Error::Closed("transport"));
        }
        Ok(())
    }

    fn timeout(&self, t: Option<Duration>) -> Duration {
        t.unwrap_or_else(|| self.backend.default_timeout())
    }

    /// How the transport connected, e.g. "auto via shm".
    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    /// Whether the transport's backend works in this process.
    pub fn supported(&self) -> bool {
        self.backend.supported()
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &str {
        self.backend.name()
    }

    /// What the backend can do; for `auto`, what the path it connected through can do.
    pub fn caps(&self) -> Caps {
        self.backend.caps()
    }

    /// Binds the endpoint and returns its opaque connection URL (idempotent): the backend's,
    /// then `#e=` and this endpoint's id in 16 hex digits.
    pub fn bind(&self, timeout: Option<Duration>) -> Result<Vec<u8>> {
        self.check_open()?;
        let mut url = self.backend.bind(self.timeout(timeout))?;
        url.extend_from_slice(format!("{ENDPOINT_MARK}{:016x}", self.endpoint).as_bytes());
        Ok(url)
    }

    /// Connects to the peer whose `bind` returned `peer_url`. One peer per endpoint. A URL
    /// without an endpoint id (a backend's own) connects too; its descriptors are then not
    /// checked for belonging to that peer.
    pub fn connect(&self, peer_url: &[u8], timeout: Option<Duration>) -> Result<()> {
        self.check_open()?;
        if self.backend.connected() {
            return Err(Error::InvalidArgument("transport is already connected".into()));
        }
        let (url, peer) = split_endpoint(peer_url)?;
        self.backend.connect(url, self.timeout(timeout))?;
        if let Some(p) = peer {
            let _ = self.peer_endpoint.set(p);
        }
        Ok(())
    }

    /// Runs `f`, which starts transfers on this transport, and sends the small requests it
    /// starts together when it returns: on a backend that sends them itself (tcp), a write and
    /// the signal that follows it leave in one system call and reach the peer in one read.
    /// Ordering and completion are unchanged, and waiting inside `f` for a transfer it started
    /// on this transport sends what is held at once; waiting there for anything else (another
    /// transport, a peer that needs these requests first) stalls until that wait's timeout.
    pub(crate) fn batch<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Release<'a>(&'a dyn Backend);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.hold(false);
            }
        }
        self.backend.hold(true);
        let _release = Release(&*self.backend);
        f()
    }

    /// Serves the peer's requests that have already arrived on the calling thread (see
    /// [`Backend::serve_arrived`]): a caller spinning on a word the peer writes calls it.
    pub(crate) fn serve_arrived(&self) {
        self.backend.serve_arrived();
    }

    /// Whether connected to a live peer.
    pub fn connected(&self) -> bool {
        self.state.load(Ordering::Acquire) == OPEN && self.backend.connected()
    }

    /// Why the transport is no longer connected, when its backend knows (the peer exited, the
    /// connection broke).
    pub fn disconnect_reason(&self) -> Option<String> {
        self.backend.disconnect_reason()
    }

    /// Registers a contiguous tensor; peers holding its descriptor may read and write it.
    pub fn register_memory(&self, tensor: &Tensor) -> Result<Memory> {
        self.register(tensor, true)
    }

    /// Registers a contiguous tensor that peers may read but never write.
    pub fn register_memory_read_only(&self, tensor: &Tensor) -> Result<Memory> {
        self.register(tensor, false)
    }

    /// Registers a contiguous tensor for this process's own transfers only (the source of a
    /// write, the destination of a read): never exposed, so no peer can reach it whatever it
    /// sends, and a registration of its own even where the same range is registered already
    /// (a symmetric allocation's buffer), so that unregistering it withdraws nothing else.
    pub(crate) fn register_private(&self, tensor: &Tensor) -> Result<Memory> {
        self.check_open()?;
        // No backend looks up the local side of a transfer: a request carries its pointer.
        Ok(Memory { reg: self.registration(tensor, false)? })
    }

    /// What every registration needs of its tensor: on this transport's device, contiguous.
    fn check_tensor(&self, tensor: &Tensor) -> Result<()> {
        if let Some(d) = self.device
            && d != Device::Cpu
        {
            return Err(Error::InvalidArgument(format!("expected a tensor on {d:?}, got Cpu")));
        }
        if !tensor.is_contiguous() {
            return Err(Error::InvalidArgument(format!(
                "{} transport requires a contiguous tensor",
                self.backend.name()
            )));
        }
        Ok(())
    }

    /// A new registration of `tensor`, not yet exposed.
    fn registration(&self, tensor: &Tensor, writable: bool) -> Result<Arc<Registration>> {
        self.check_tensor(tensor)?;
        Ok(Arc::new(Registration {
            transport: self.id,
            endpoint: self.endpoint,
            backend: Arc::from(self.backend.name()),
            id: random_u64(),
            key: random_key(),
            storage: tensor.storage().clone(),
            ptr: tensor.data_ptr(),
            len: tensor.nbytes(),
            remote_writable: writable,
            live: AtomicBool::new(true),
            pending: AtomicUsize::new(0),
        }))
    }

    fn register(&self, tensor: &Tensor, writable: bool) -> Result<Memory> {
        self.check_open()?;
        self.check_tensor(tensor)?;
        let key = (tensor.data_ptr() as usize, tensor.nbytes());
        let mut regs = self.regs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = regs.get(&key)
            && r.is_live()
        {
            if r.remote_writable != writable {
                return Err(Error::InvalidArgument(
                    "this memory is already registered with other permissions; unregister it first".into(),
                ));
            }
            return Ok(Memory { reg: r.clone() });
        }
        let reg = self.registration(tensor, writable)?;
        self.backend.expose(&reg)?;
        regs.insert(key, reg.clone());
        Ok(Memory { reg })
    }

    /// Unregisters memory: every alias, view and descriptor of it stops working. Refused while
    /// local transfers on it are pending; repeating it is a no-op.
    pub fn unregister_memory(&self, memory: &Memory) -> Result<()> {
        self.check_open()?;
        if memory.reg.transport != self.id {
            return Err(Error::InvalidArgument("memory was not registered by this transport".into()));
        }
        if !memory.reg.is_live() {
            return Ok(());
        }
        // Acquire: pairs with the Release decrement of InFlight.
        if memory.reg.pending.load(Ordering::Acquire) > 0 {
            return Err(Error::InvalidArgument("memory has pending transfers; wait before unregistering".into()));
        }
        memory.reg.live.store(false, Ordering::Release);
        self.backend.withdraw(&memory.reg);
        let mut regs = self.regs.lock().unwrap_or_else(|p| p.into_inner());
        regs.retain(|_, r| !Arc::ptr_eq(r, &memory.reg));
        Ok(())
    }

    fn check_local(&self, view: &MemoryView) -> Result<()> {
        if view.reg.transport != self.id {
            return Err(Error::InvalidArgument("memory view belongs to another transport".into()));
        }
        if !view.reg.is_live() {
            return Err(Error::InvalidArgument("memory has been unregistered".into()));
        }
        Ok(())
    }

    fn check_remote(&self, local: &MemoryView, remote: &RemoteBuffer, write: bool) -> Result<()> {
        if &*remote.backend != self.backend.name() {
            return Err(Error::InvalidArgument(format!(
                "remote buffer is not a {} descriptor (it is {})",
                self.backend.name(),
                remote.backend
            )));
        }
        if let Some(&peer) = self.peer_endpoint.get()
            && remote.endpoint != peer
        {
            return Err(Error::InvalidArgument(
                "remote buffer does not belong to the connected peer (its descriptor names another endpoint)".into(),
            ));
        }
        if local.len as u64 > remote.length {
            return Err(Error::InvalidArgument(format!(
                "local view of {} bytes does not fit in the remote buffer of {} bytes",
                local.len, remote.length
            )));
        }
        if write && !remote.writable {
            return Err(Error::InvalidArgument("remote buffer is registered read-only".into()));
        }
        Ok(())
    }

    fn submit(
        &self,
        direction: Direction,
        local: &MemoryView,
        remote: &RemoteBuffer,
        timeout: Option<Duration>,
        posted: bool,
    ) -> Result<Work> {
        self.check_open()?;
        self.check_local(local)?;
        self.check_remote(local, remote, direction != Direction::Read)?;
        if !self.backend.connected() {
            let name = self.backend.name();
            return Err(match self.backend.disconnect_reason() {
                // It was connected: the peer is gone.
                Some(why) => {
                    Error::transfer(TransferKind::PeerLost, format!("{name} transport is not connected: {why}"))
                }
                None => Error::InvalidArgument(format!("{name} transport is not connected")),
            });
        }
        local.reg.pending.fetch_add(1, Ordering::AcqRel);
        let state = WorkState::new(Some(InFlight(local.reg.clone())));
        let req = Request {
            direction,
            local: local.reg.clone(),
            local_offset: local.offset,
            len: local.len,
            remote: RemoteBuffer { length: local.len as u64, ..remote.clone() },
            posted,
            work: state.clone(),
        };
        if let Some(lag) = self.lag() {
            if lag.send((crate::sync::deadline(lag_now()), req)).is_err() {
                // Its thread is gone (only if a backend panicked in it).
                state.complete(Err(Failed::new(TransferKind::Refused, "transport: the lagged requests' thread ended")));
                return Err(Error::Closed("transport"));
            }
        } else if let Err(e) = self.backend.submit(req) {
            state.complete(Err(not_started(&e)));
            return Err(e);
        }
        // Backends that copy on the caller's thread complete before returning; only work still
        // pending needs draining at close.
        if state.is_pending() {
            let mut out = self.outstanding.lock().unwrap_or_else(|p| p.into_inner());
            // Finished work leaves the list when it is full, and the list at least doubles
            // when over half of it is still pending: amortized constant time per transfer,
            // however many are started before any is waited for (with a sweep on every start,
            // 40 000 writes to a peer that had not answered 10 000 took 1.7 s to start; 0.1 s
            // now).
            if out.len() == out.capacity() {
                out.retain(|w| w.is_pending());
                if 2 * out.len() > out.capacity() {
                    let more = out.len().max(16);
                    out.reserve(more);
                }
            }
            out.push(state.clone());
        }
        Ok(Work::new(state, Some(self.timeout(timeout))))
    }

    /// Starts writing `local` to the start of `remote`; returns its [`Work`].
    pub fn start_write(&self, local: &MemoryView, remote: &RemoteBuffer, timeout: Option<Duration>) -> Result<Work> {
        self.submit(Direction::Write, local, remote, timeout, false)
    }

    /// Starts a posted write ([`Request::posted`]): its Work may complete once the bytes have
    /// left this process rather than when they land; what this thread starts next on the
    /// transport lands after them. For a peer that learns of the write from what follows it
    /// (a signal), so waiting for its landing would only cost a round trip.
    pub(crate) fn post_write(
        &self,
        local: &MemoryView,
        remote: &RemoteBuffer,
        timeout: Option<Duration>,
    ) -> Result<Work> {
        self.submit(Direction::Write, local, remote, timeout, true)
    }

    /// Starts reading the start of `remote` into `local`; returns its [`Work`].
    pub fn start_read(
        &self,
        local: &MutableMemoryView,
        remote: &RemoteBuffer,
        timeout: Option<Duration>,
    ) -> Result<Work> {
        self.submit(Direction::Read, &local.0, remote, timeout, false)
    }

    /// Starts a remote atomic `op` with `operand` on the word at the start of `remote`.
    /// `scratch` is any local view of the word's size (it carries no data; the bookkeeping of
    /// a transfer wants one). Fails with [`TransferKind::Busy`] when a slot put found
    /// the previous signal unconsumed. `posted`: a store may complete once sent (see
    /// [`Transport::post_write`]); a slot put is always answered.
    pub(crate) fn start_atomic(
        &self,
        scratch: &MemoryView,
        remote: &RemoteBuffer,
        op: Atomic,
        operand: u64,
        timeout: Option<Duration>,
        posted: bool,
    ) -> Result<Work> {
        if !self.backend.caps().remote_atomics {
            return Err(Error::transfer(
                TransferKind::Unsupported,
                format!("the {} transport has no remote atomics", self.backend.describe()),
            ));
        }
        if scratch.len as u64 != op.width() {
            return Err(Error::InvalidArgument(format!("a {op:?} acts on {} bytes", op.width())));
        }
        // A store needs no answer; a slot put does (it may find the slot busy).
        let posted = posted && op != Atomic::SlotPut;
        self.submit(Direction::Atomic(op, operand), scratch, remote, timeout, posted)
    }

    /// Writes `local` to the start of `remote` and waits until the bytes are in the peer's
    /// memory (at most `timeout`, or the backend's default).
    ///
    /// A backend that copies on the caller's thread (shm) does so here with no [`Work`], no
    /// allocation and no lock: the same checks, one copy.
    pub fn write(&self, local: &MemoryView, remote: &RemoteBuffer, timeout: Option<Duration>) -> Result<()> {
        self.transfer_sync(true, local, remote, timeout)
    }

    /// Reads the start of `remote` into `local` and waits for the bytes (the same fast path as
    /// [`Transport::write`]).
    pub fn read(&self, local: &MutableMemoryView, remote: &RemoteBuffer, timeout: Option<Duration>) -> Result<()> {
        self.transfer_sync(false, &local.0, remote, timeout)
    }

    /// [`Transport::write`] if the backend can finish it on this thread without waiting for a
    /// peer or a network (shm's copy between mapped memory): `Some` with its outcome (a refused
    /// write included), or `None` when the write would have to wait, and nothing was done.
    ///
    /// For callers that hold something other threads need while a call may block (Python's
    /// GIL): try this first holding it, and call [`Transport::write`] after releasing it on
    /// `None`.
    pub fn try_write_now(&self, local: &MemoryView, remote: &RemoteBuffer) -> Option<Result<()>> {
        self.transfer_now(true, local, remote)
    }

    /// [`Transport::read`] if the backend can finish it on this thread at once (see
    /// [`Transport::try_write_now`]).
    pub fn try_read_now(&self, local: &MutableMemoryView, remote: &RemoteBuffer) -> Option<Result<()>> {
        self.transfer_now(false, &local.0, remote)
    }

    /// The checks of a transfer, then the backend's synchronous path if it has one.
    fn transfer_now(&self, write: bool, local: &MemoryView, remote: &RemoteBuffer) -> Option<Result<()>> {
        let checked = self.check_open().and_then(|()| self.check_local(local));
        if let Err(e) = checked.and_then(|()| self.check_remote(local, remote, write)) {
            return Some(Err(e));
        }
        // No pending count: the copy is over when this returns, and the view keeps the local
        // memory alive meanwhile even if another thread unregisters it.
        self.backend.transfer_now(write, local, remote).map(|done| done.map_err(Error::from))
    }

    fn transfer_sync(
        &self,
        write: bool,
        local: &MemoryView,
        remote: &RemoteBuffer,
        timeout: Option<Duration>,
    ) -> Result<()> {
        if let Some(done) = self.transfer_now(write, local, remote) {
            return done;
        }
        let direction = if write { Direction::Write } else { Direction::Read };
        self.submit(direction, local, remote, timeout, false)?.wait(None)
    }

    /// [`Transport::write`] for async callers: never blocks the executor.
    pub async fn write_async(
        &self,
        local: &MemoryView,
        remote: &RemoteBuffer,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let t = self.timeout(timeout);
        let work = self.start_write(local, remote, Some(t))?;
        wait_all([work], Some(t)).await
    }

    /// [`Transport::read`] for async callers.
    pub async fn read_async(
        &self,
        local: &MutableMemoryView,
        remote: &RemoteBuffer,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let t = self.timeout(timeout);
        let work = self.start_read(local, remote, Some(t))?;
        wait_all([work], Some(t)).await
    }

    /// Drains outstanding transfers (at most `timeout`), then releases everything. A close
    /// that times out rejects new work but keeps its resources until a retried close succeeds.
    /// Idempotent.
    pub fn close(&self, timeout: Option<Duration>) -> Result<()> {
        if self.state.load(Ordering::Acquire) == CLOSED {
            return Ok(());
        }
        self.state.store(CLOSING, Ordering::Release);
        let t = self.timeout(timeout);
        let deadline = crate::sync::deadline(t);
        let pending: Vec<Arc<WorkState>> = self
            .outstanding
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|w| w.is_pending())
            .cloned()
            .collect();
        for w in &pending {
            if !w.wait_until(Some(deadline)) {
                return Err(Error::timeout("transport close (resources remain live; retry close)", t));
            }
        }
        // Posted requests completed when sent: they land before the connection ends. A peer
        // that is gone has nothing left to land them on.
        if self.backend.connected()
            && let Err(e) = self.backend.fence(deadline.saturating_duration_since(Instant::now()))
        {
            tracing::debug!("transport close: posted requests may not have landed: {e}");
        }
        self.state.store(CLOSED, Ordering::Release);
        let regs: Vec<Arc<Registration>> =
            self.regs.lock().unwrap_or_else(|p| p.into_inner()).drain().map(|(_, r)| r).collect();
        for r in &regs {
            r.live.store(false, Ordering::Release);
            self.backend.withdraw(r);
        }
        self.backend.shutdown();
        Ok(())
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        if self.state.load(Ordering::Acquire) != CLOSED {
            // Never hang in drop: give outstanding work no grace, fail it instead.
            self.state.store(CLOSED, Ordering::Release);
            self.backend.shutdown();
        }
    }
}

/// Constructs a transport of `backend` (case-insensitive), optionally restricted to `device`.
///
/// `"auto"` (or an empty name) picks `shm` for a peer on this host and `tcp` otherwise.
pub fn new_transport(backend: &str, device: Option<Device>, options: &Options) -> Result<Transport> {
    let name = if backend.is_empty() { "auto".to_string() } else { backend.to_ascii_lowercase() };
    let Some(factory) = registry::factory(&name) else {
        let list = available_transports();
        return Err(Error::InvalidArgument(format!(
            "unknown transport {name:?}; available: {}",
            if list.is_empty() { "none".to_string() } else { list.join(", ") }
        )));
    };
    if let Some(Device::Cuda(n)) = device {
        return Err(Error::Unsupported {
            what: format!("transport {name:?} on cuda:{n}"),
            needs: "a CUDA device and a GPU-capable backend".into(),
        });
    }
    let b = factory(options).map_err(|e| match e {
        // A backend this process cannot run (a missing library) says what it needs.
        e @ Error::Unsupported { .. } => e,
        e => Error::InvalidArgument(format!("failed to create transport {name:?}: {e}")),
    })?;
    if !b.supported() {
        b.shutdown();
        return Err(Error::Unsupported {
            what: format!("transport {name:?}"),
            needs: "what its backend reports missing in this process".into(),
        });
    }
    Ok(Transport::new(b, device))
}

/// Constructs, binds and connects a transport to `peer_rank` through `store`, PyTorch's way
/// (`docs/transport-contract.md` §2): the Nth call on each side meets the
/// Nth call on the other, failed calls included, so one store can pair a rank with every other.
/// `bootstrap_timeout` bounds bind, each store wait and connect.
pub fn new_transport_rank(
    backend: &str,
    device: Option<Device>,
    store: &Arc<dyn Store>,
    peer_rank: u64,
    rank: u64,
    bootstrap_timeout: Duration,
    options: &Options,
) -> Result<Transport> {
    if peer_rank == rank {
        return Err(Error::InvalidArgument("peer_rank must differ from the local rank".into()));
    }
    let name = if backend.is_empty() { "auto".to_string() } else { backend.to_ascii_lowercase() };
    let pair = format!("transport/{name}/{}/{}", rank.min(peer_rank), rank.max(peer_rank));
    let attempt = store.add(&format!("{pair}/attempts/{rank}"), 1)?;
    let scoped = PrefixStore::new(format!("{pair}/{attempt}"), store.clone());
    let transport = new_transport(&name, device, options)?;
    let result = (|| {
        let url = transport.bind(Some(bootstrap_timeout))?;
        scoped.set(&rank.to_string(), &url)?;
        let peer_url = scoped.get_timeout(&peer_rank.to_string(), bootstrap_timeout)?;
        transport.connect(&peer_url, Some(bootstrap_timeout))
    })();
    match result {
        Ok(()) => Ok(transport),
        Err(e) => {
            if let Err(c) = transport.close(Some(bootstrap_timeout)) {
                tracing::warn!("transport bootstrap cleanup failed: {c}");
            }
            Err(e)
        }
    }
}
