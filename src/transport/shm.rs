//! The `shm` backend: two processes on one host, one copy, no help from the target.
//!
//! ```text
//!   target                                        initiator
//!   registration table (memfd) ── mapped read-only ──▶ looks up the descriptor's entry:
//!     entry: generation | id | key | addr | len | flags        key, liveness, bounds, permission
//!   registered memory ◀── memcpy through a mapping of exactly the registered pages
//!                         (memory in a shared-memory file: symm tensors, shm::alloc)
//!                     ◀── process_vm_writev / readv, in 1 MiB pieces (any other memory)
//! ```
//!
//! The target never runs for a transfer: it publishes each registration in a table that the
//! peer maps read-only, with a seqlock per entry (`generation` odd while it changes or once
//! unregistered, even and non-zero while live). The initiator checks every transfer against
//! the entry, exactly as the tcp target checks requests, and drops its cached mapping of an
//! entry whose generation changed, so an unregistered range stops working at once.
//!
//! Transfers run on the caller's thread (from 4 MiB, helped by up to three scoped threads
//! copying page-aligned parts): a synchronous write returns when the bytes are in the
//! target's memory, and a Work is complete when returned. The peer's death is noticed
//! through a pidfd. Cross-memory attach needs the same user and no ptrace restriction;
//! `connect` probes it and says clearly when the kernel refuses (the `auto` backend then
//! falls back to `tcp`). Access control here protects against wrong and stale descriptors, not
//! against a hostile peer: a process allowed cross-memory attach may ptrace its peer anyway.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Backend, Caps, Direction, MemoryView, Options, Reach, Registration, RemoteBuffer, Request};
use crate::error::{Completion, Error, Failed, Result, TransferKind};
use crate::sys::cma::{self, CmaError};
use crate::sys::shm::{self, Mapping, PAGE};
use crate::tensor::{DType, Storage, Tensor};

const MAGIC: u64 = u64::from_le_bytes(*b"SYMSHM02");
/// Header word counting the owner's withdrawals, so a peer knows when to drop mappings.
const RETIRED: usize = 5;
const CAPACITY: usize = 4096;
const HEADER: usize = 128;
const ENTRY: usize = 64;
const TABLE_LEN: usize = HEADER + CAPACITY * ENTRY;

const WRITABLE: u64 = 1;
const SHARED: u64 = 2;

/// How often (at most) a transfer checks that the peer is alive.
/// Transfers of at least this many bytes are copied by several threads at once (one core's
/// copy does not saturate memory bandwidth); smaller ones are not worth a thread's start.
const PARALLEL_MIN: usize = 4 << 20;
/// At most this many threads copy one transfer.
const PARALLEL_MAX: usize = 4;

/// Runs `copy(start, len)` over `[0, len)`; when `parallel` and `len` is large, split into
/// page-aligned parts on up to [`PARALLEL_MAX`] threads (as many as there are cores). Returns
/// the first error.
fn split_copy<E: Send>(
    len: usize,
    parallel: bool,
    copy: impl Fn(usize, usize) -> std::result::Result<(), E> + Sync,
) -> std::result::Result<(), E> {
    let threads = if parallel && len >= PARALLEL_MIN { crate::topo::cores().clamp(1, PARALLEL_MAX) } else { 1 };
    if threads == 1 {
        return copy(0, len);
    }
    let part = len.div_ceil(threads).next_multiple_of(PAGE as usize);
    std::thread::scope(|s| {
        let copy = &copy;
        let others: Vec<_> = (1..threads)
            .map(|i| (i * part).min(len))
            .filter(|&start| start < len)
            .map(|start| s.spawn(move || copy(start, part.min(len - start))))
            .collect();
        let first = copy(0, part.min(len));
        others
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .fold(first, |a, b| a.and(b))
    })
}

const LIVENESS_EVERY: Duration = Duration::from_millis(1);

/// One table entry, as words in shared memory.
///
/// ```text
///   0 generation   8 id   16 key lo   24 key hi   32 addr   40 len   48 flags|fd<<32   56 file offset
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    generation: u64,
    id: u64,
    key: [u8; 16],
    addr: u64,
    len: u64,
    flags: u64,
    file_offset: u64,
}

impl Entry {
    fn fd(&self) -> i32 {
        (self.flags >> 32) as i32
    }
}

/// A registration table: the owner's writable mapping, or the peer's read-only one.
struct Table {
    map: Mapping,
}

impl Table {
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i * 8 + 8 <= TABLE_LEN);
        // SAFETY: the word lies inside the mapping (checked above), which lives as long as
        // `self`; it is 8-aligned (the mapping is page-aligned); AtomicU64 has u64's layout; and
        // every process accesses table words only atomically. The peer's mapping is read-only
        // and the peer only loads.
        unsafe { &*self.map.ptr().add(i * 8).cast::<AtomicU64>() }
    }

    fn entry_word(&self, slot: usize, k: usize) -> &AtomicU64 {
        self.word((HEADER + slot * ENTRY) / 8 + k)
    }

    /// Reads a consistent snapshot of `slot`, or None if it is changing, dead or empty.
    fn read(&self, slot: usize) -> Option<Entry> {
        // Acquire: pairs with the Release store publishing the generation in `publish`.
        let generation = self.entry_word(slot, 0).load(Ordering::Acquire);
        if generation == 0 || generation % 2 == 1 {
            return None;
        }
        let w = |k| self.entry_word(slot, k).load(Ordering::Relaxed);
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&w(2).to_le_bytes());
        key[8..].copy_from_slice(&w(3).to_le_bytes());
        let e = Entry { generation, id: w(1), key, addr: w(4), len: w(5), flags: w(6), file_offset: w(7) };
        // Acquire fence: the fields above are read before the generation is read again (the
        // seqlock's read side; pairs with the Release stores in `publish` and `retire`).
        fence(Ordering::Acquire);
        (self.entry_word(slot, 0).load(Ordering::Relaxed) == generation).then_some(e)
    }

    /// Finds the live entry with `id` (open addressing, linear probing; tombstones are odd).
    fn find(&self, id: u64) -> Option<Entry> {
        let start = (id as usize) % CAPACITY;
        for i in 0..CAPACITY {
            let slot = (start + i) % CAPACITY;
            let generation = self.entry_word(slot, 0).load(Ordering::Acquire);
            if generation == 0 {
                return None;
            }
            if self.entry_word(slot, 1).load(Ordering::Relaxed) == id {
                return self.read(slot);
            }
        }
        None
    }
}

/// The owner's side of its table.
struct OwnTable {
    table: Table,
    fd: OwnedFd,
    slots: HashMap<u64, usize>,
}

impl OwnTable {
    fn create(token: &[u8; 16]) -> Result<OwnTable> {
        let fd = shm::create("symmem-shm-table", TABLE_LEN)?;
        let table = Table { map: Mapping::new(&fd, TABLE_LEN)? };
        let w = |i: usize, v: u64| table.word(i).store(v, Ordering::Relaxed);
        w(0, MAGIC);
        w(1, u64::from(std::process::id()));
        w(2, u64::from_le_bytes(token[..8].try_into().unwrap_or_default()));
        w(3, u64::from_le_bytes(token[8..].try_into().unwrap_or_default()));
        w(4, table.map.ptr() as u64);
        Ok(OwnTable { table, fd, slots: HashMap::new() })
    }

    fn publish(&mut self, reg: &Registration) -> Result<()> {
        let start = (reg.id() as usize) % CAPACITY;
        let slot = (0..CAPACITY)
            .map(|i| (start + i) % CAPACITY)
            .find(|&s| {
                let g = self.table.entry_word(s, 0).load(Ordering::Relaxed);
                g == 0 || g % 2 == 1
            })
            .ok_or_else(|| {
                Error::InvalidArgument(format!("the shm transport holds at most {CAPACITY} registrations"))
            })?;
        let word = |k| self.table.entry_word(slot, k);
        let generation = word(0).load(Ordering::Relaxed);
        // Odd while the fields change (a fresh slot goes 0 → 1).
        let writing = if generation == 0 { 1 } else { generation };
        word(0).store(writing, Ordering::Relaxed);
        // Release fence: the odd generation is visible before any field changes (seqlock).
        fence(Ordering::Release);
        let (fd, file_offset) = reg.shared_file().unwrap_or((0, 0));
        let mut flags = u64::from(reg.remote_writable()) * WRITABLE;
        if reg.shared_file().is_some() {
            flags |= SHARED | ((fd as u32 as u64) << 32);
        }
        let key = reg.key();
        word(1).store(reg.id(), Ordering::Relaxed);
        word(2).store(u64::from_le_bytes(key[..8].try_into().unwrap_or_default()), Ordering::Relaxed);
        word(3).store(u64::from_le_bytes(key[8..].try_into().unwrap_or_default()), Ordering::Relaxed);
        word(4).store(reg.ptr() as u64, Ordering::Relaxed);
        word(5).store(reg.len() as u64, Ordering::Relaxed);
        word(6).store(flags, Ordering::Relaxed);
        word(7).store(file_offset, Ordering::Relaxed);
        // Release: pairs with the Acquire load of the generation in `Table::read`.
        word(0).store(writing + 1, Ordering::Release);
        self.slots.insert(reg.id(), slot);
        Ok(())
    }

    fn retire(&mut self, id: u64) {
        if let Some(slot) = self.slots.remove(&id) {
            let g = self.table.entry_word(slot, 0);
            // Odd: dead (a tombstone for probing). Release: pairs with the reader's re-check.
            g.store(g.load(Ordering::Relaxed) + 1, Ordering::Release);
            // Release: pairs with the Acquire load in `Peer::prune`, which then sees the
            // tombstone above.
            self.table.word(RETIRED).fetch_add(1, Ordering::Release);
        }
    }

    fn retire_all(&mut self) {
        let ids: Vec<u64> = self.slots.keys().copied().collect();
        for id in ids {
            self.retire(id);
        }
    }
}

/// A mapping of a peer's shared registration, and the registered range's offset inside it.
type PeerRange = (Mapping, usize);

/// Hashes a registration's (random) id and generation by mixing them: the ids are drawn at
/// random, so no keyed hash is needed, and SipHash would cost more than the 8-byte copy it
/// serves.
#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(29) ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type Maps = HashMap<(u64, u64), Arc<PeerRange>, std::hash::BuildHasherDefault<IdHasher>>;

/// The connected peer: its table, its pid, and mappings of its shared registrations.
struct Peer {
    pid: i32,
    table: Table,
    pidfd: OwnedFd,
    alive: AtomicBool,
    /// Nanoseconds after `epoch` of the last liveness check.
    checked: AtomicU64,
    /// The coarse monotonic clock at connect, in nanoseconds.
    epoch: u64,
    /// Mappings of shared registrations, by (id, generation), with the registered range's
    /// offset inside the mapping.
    maps: Mutex<Maps>,
    /// The owner's withdrawal count when `maps` was last pruned.
    pruned_at: AtomicU64,
}

impl Peer {
    /// Drops the mappings of registrations the owner has withdrawn since the last look, so
    /// that their memory is freed with the owner's: one load when nothing was withdrawn.
    /// Called on every transfer, and by the reaper thread for peers left idle.
    fn prune(&self) {
        // Acquire: pairs with the Release increment in `OwnTable::retire`.
        let retired = self.table.word(RETIRED).load(Ordering::Acquire);
        if retired == self.pruned_at.load(Ordering::Relaxed) {
            return;
        }
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        // A transfer in flight keeps its own Arc of the mapping; dropping ours is safe.
        maps.retain(|&(id, generation), _| self.table.find(id).is_some_and(|e| e.generation == generation));
        // Relaxed: only this counter's owner-side value matters, read again next time.
        self.pruned_at.store(retired, Ordering::Relaxed);
    }

    fn check_alive(&self) -> bool {
        if !self.alive.load(Ordering::Acquire) {
            return false;
        }
        // The coarse clock (a few ns through the vDSO, at the scheduler tick's resolution) is
        // enough to rate-limit a liveness poll.
        let now = crate::sync::coarse_nanos().saturating_sub(self.epoch);
        let last = self.checked.load(Ordering::Relaxed);
        // Relaxed: the timestamp only rate-limits the pidfd poll; racing threads at worst both
        // poll.
        if now.saturating_sub(last) >= LIVENESS_EVERY.as_nanos() as u64 {
            self.checked.store(now, Ordering::Relaxed);
            if cma::exited(&self.pidfd) {
                self.alive.store(false, Ordering::Release);
                return false;
            }
        }
        true
    }
}

/// The `shm` backend.
pub struct ShmBackend {
    token: [u8; 16],
    host: String,
    own: Mutex<OwnTable>,
    /// Every peer this backend connected to, the current one last. Kept until the backend
    /// drops so that `current` can be read without a lock (a reconnect after a peer exited
    /// adds one; connecting is refused while a peer is live).
    peers: Mutex<Vec<Arc<Peer>>>,
    /// The current peer (an element of `peers`), or null when not connected.
    current: AtomicPtr<Peer>,
    timeout: Duration,
}

/// What the shm backend can do: peers on this host only, no remote atomics; its copies are
/// done by the initiator and complete in order.
pub const CAPS: Caps = Caps { remote_atomics: false, in_order_up_to: usize::MAX, reach: Reach::SameHost };

/// The options it takes.
pub const OPTIONS: &[&str] = &["timeout"];

impl ShmBackend {
    /// A backend; options: `timeout` (seconds).
    pub fn new(options: &Options) -> Result<ShmBackend> {
        let timeout = super::timeout_option("shm", options)?;
        let mut token = [0u8; 16];
        getrandom::fill(&mut token).map_err(|e| Error::io("draw an endpoint token", std::io::Error::other(e)))?;
        Ok(ShmBackend {
            own: Mutex::new(OwnTable::create(&token)?),
            token,
            host: crate::topo::this_host(),
            peers: Mutex::new(Vec::new()),
            current: AtomicPtr::new(std::ptr::null_mut()),
            timeout,
        })
    }

    fn own(&self) -> std::sync::MutexGuard<'_, OwnTable> {
        self.own.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current peer, read with one load.
    fn peer(&self) -> Option<&Peer> {
        // Acquire: pairs with the Release store in `connect`, so the Peer's fields are seen
        // initialized.
        let p = self.current.load(Ordering::Acquire);
        // SAFETY: a non-null `current` points into an Arc held by `self.peers`, which only
        // grows while `self` lives, so the Peer outlives the borrow of `self`.
        unsafe { p.as_ref() }
    }
}

/// A tensor in a shared-memory file, so the `shm` backend moves it with one memcpy through a
/// mapping instead of cross-memory attach. Symmetric tensors qualify too.
pub fn alloc(shape: &[usize], dtype: DType) -> Result<Tensor> {
    let bytes = crate::tensor::nbytes_of(shape, dtype)?;
    let len = bytes
        .max(1)
        .checked_next_multiple_of(PAGE as usize)
        .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} of {dtype} is too large")))?;
    let fd = shm::create("symmem-shm-tensor", len)?;
    let map = Mapping::new(&fd, len)?;
    Ok(Tensor::from_storage(Arc::new(ShmStorage { map, fd, len: bytes }), shape, dtype))
}

#[derive(Debug)]
struct ShmStorage {
    map: Mapping,
    fd: OwnedFd,
    len: usize,
}

// SAFETY: the mapping lives (at a fixed address) as long as the storage, and is at least `len`
// bytes long.
unsafe impl Storage for ShmStorage {
    fn ptr(&self) -> *mut u8 {
        self.map.ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn shared_file(&self) -> Option<(i32, u64)> {
        Some((shm::raw(&self.fd), 0))
    }
}

struct Url {
    host: String,
    pid: u32,
    fd: i32,
    token: [u8; 16],
}

fn parse_url(url: &[u8]) -> Result<Url> {
    let bad = || Error::InvalidArgument(format!("invalid shm transport URL {:?}", String::from_utf8_lossy(url)));
    let s = std::str::from_utf8(url).map_err(|_| bad())?;
    let rest = s.strip_prefix("shm://").ok_or_else(bad)?;
    let (host, query) = rest.rsplit_once('?').ok_or_else(bad)?;
    let (mut pid, mut fd, mut token) = (None, None, None);
    for kv in query.split('&') {
        match kv.split_once('=').ok_or_else(bad)? {
            ("pid", v) => pid = v.parse().ok(),
            ("fd", v) => fd = v.parse().ok(),
            ("token", v) if v.len() == 32 => {
                let mut t = [0u8; 16];
                for (i, b) in t.iter_mut().enumerate() {
                    *b = u8::from_str_radix(v.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16).map_err(|_| bad())?;
                }
                token = Some(t);
            }
            _ => return Err(bad()),
        }
    }
    Ok(Url {
        host: host.to_string(),
        pid: pid.ok_or_else(bad)?,
        fd: fd.ok_or_else(bad)?,
        token: token.ok_or_else(bad)?,
    })
}

/// The host a `shm://` URL names, if it is one.
pub(crate) fn url_host(url: &[u8]) -> Option<String> {
    parse_url(url).ok().map(|u| u.host)
}

impl Backend for ShmBackend {
    fn name(&self) -> &str {
        "shm"
    }

    fn caps(&self) -> Caps {
        CAPS
    }

    fn reaches(&self, url: &[u8]) -> std::result::Result<(), String> {
        match url_host(url) {
            Some(h) if h == self.host => Ok(()),
            Some(_) => Err("the peer is on another host".into()),
            None => Err("not an shm URL".into()),
        }
    }

    fn bind(&self, _timeout: Duration) -> Result<Vec<u8>> {
        let fd = shm::raw(&self.own().fd);
        let token: String = self.token.iter().map(|b| format!("{b:02x}")).collect();
        Ok(format!("shm://{}?pid={}&fd={fd}&token={token}", self.host, std::process::id()).into_bytes())
    }

    fn connect(&self, url: &[u8], _timeout: Duration) -> Result<()> {
        let url = parse_url(url)?;
        if url.host != self.host {
            return Err(Error::InvalidArgument(format!(
                "the shm peer is on host {:?} and this process on {:?}: shm reaches peers on this host only",
                url.host, self.host
            )));
        }
        let refused = |why: String| Error::Unsupported {
            what: format!("shared memory with process {} on this host", url.pid),
            needs: format!("the same user and no ptrace restriction ({why})"),
        };
        let fd = shm::open_peer_with(url.pid, url.fd, false).map_err(|e| refused(e.to_string()))?;
        if shm::size(&fd)? < TABLE_LEN {
            return Err(Error::InvalidArgument("the shm peer's table is truncated".into()));
        }
        let table = Table { map: Mapping::new_at(&fd, 0, TABLE_LEN, false)? };
        let token =
            [table.word(2).load(Ordering::Relaxed).to_le_bytes(), table.word(3).load(Ordering::Relaxed).to_le_bytes()]
                .concat();
        if table.word(0).load(Ordering::Relaxed) != MAGIC
            || table.word(1).load(Ordering::Relaxed) != u64::from(url.pid)
            || token != url.token
        {
            return Err(Error::InvalidArgument("the shm URL does not match the peer's table (stale URL?)".into()));
        }
        // Probe cross-memory attach on the table's first word, at its address in the peer.
        let mut probe = [0u8; 8];
        cma::read(url.pid as i32, &mut probe, table.word(4).load(Ordering::Relaxed) as usize)
            .map_err(|e| refused(e.to_string()))?;
        if u64::from_le_bytes(probe) != MAGIC {
            return Err(refused("cross-memory attach read the wrong bytes".into()));
        }
        let pidfd = cma::pidfd(url.pid as i32).map_err(|e| Error::io(format!("pidfd_open {}", url.pid), e))?;
        let peer = Peer {
            pid: url.pid as i32,
            table,
            pidfd,
            alive: AtomicBool::new(true),
            checked: AtomicU64::new(0),
            epoch: crate::sync::coarse_nanos(),
            maps: Mutex::new(Maps::default()),
            pruned_at: AtomicU64::new(0),
        };
        let peer = Arc::new(peer);
        reaper::watch(&peer);
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        // The one a reconnect replaces is dead: drop its mappings now (its table goes with
        // the backend).
        if let Some(old) = peers.last() {
            old.alive.store(false, Ordering::Release);
            old.maps.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        // Release: pairs with the Acquire load in `peer`.
        self.current.store(Arc::as_ptr(&peer).cast_mut(), Ordering::Release);
        peers.push(peer);
        Ok(())
    }

    fn connected(&self) -> bool {
        self.peer().is_some_and(|p| p.check_alive())
    }

    fn expose(&self, reg: &Arc<Registration>) -> Result<()> {
        self.own().publish(reg)
    }

    fn withdraw(&self, reg: &Registration) {
        self.own().retire(reg.id());
    }

    fn submit(&self, req: Request) -> Result<()> {
        let Some(peer) = self.peer() else {
            return Err(Error::InvalidArgument("shm transport is not connected".into()));
        };
        let write = match req.direction {
            Direction::Write => true,
            Direction::Read => false,
            Direction::Atomic(..) => {
                req.complete(Err(Failed::new(TransferKind::Unsupported, "the shm transport has no remote atomics")));
                return Ok(());
            }
        };
        let result = transfer(peer, write, req.local_ptr(), req.len, &req.remote);
        req.complete(result);
        Ok(())
    }

    fn transfer_now(&self, write: bool, local: &MemoryView, remote: &RemoteBuffer) -> Option<Completion> {
        let peer = self.peer()?;
        Some(transfer(peer, write, local.as_ptr(), local.size(), remote))
    }

    fn shutdown(&self) {
        self.own().retire_all();
        // Release: pairs with the Acquire load in `peer`; the Peer itself stays in `peers`.
        let p = self.current.swap(std::ptr::null_mut(), Ordering::AcqRel);
        // SAFETY: as in `peer`: a non-null pointer is an element of `self.peers`.
        if let Some(p) = unsafe { p.as_ref() } {
            p.alive.store(false, Ordering::Release);
            p.maps.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    fn default_timeout(&self) -> Duration {
        self.timeout
    }

    fn disconnect_reason(&self) -> Option<String> {
        let p = self.peer()?;
        (!p.check_alive()).then(|| format!("the peer process {} has exited", p.pid))
    }
}

/// Drops idle peers' stale mappings: one thread for the whole process, alive while some shm
/// transport is connected, looking every [`reaper::EVERY`]. Transfers prune their own peer
/// first; this covers a peer whose owner withdraws memory while this side sends nothing.
mod reaper {
    use std::sync::{Arc, Mutex, Weak};
    use std::time::Duration;

    use super::Peer;

    /// How often idle peers are pruned.
    pub(super) const EVERY: Duration = Duration::from_millis(100);

    static PEERS: Mutex<Vec<Weak<Peer>>> = Mutex::new(Vec::new());

    /// Adds `peer` to the reaper's list, starting the reaper if it is not running.
    pub(super) fn watch(peer: &Arc<Peer>) {
        let mut peers = PEERS.lock().unwrap_or_else(|p| p.into_inner());
        let start = peers.is_empty();
        peers.push(Arc::downgrade(peer));
        if start {
            let spawned = std::thread::Builder::new().name("symmem-shm-reaper".into()).spawn(run);
            if let Err(e) = spawned {
                // Transfers still prune their own peer; only idle peers keep stale mappings.
                tracing::warn!("cannot start the shm mapping reaper: {e}");
                peers.clear();
            }
        }
    }

    fn run() {
        loop {
            std::thread::sleep(EVERY);
            let live: Vec<Arc<Peer>> = {
                let mut peers = PEERS.lock().unwrap_or_else(|p| p.into_inner());
                peers.retain(|w| w.strong_count() > 0);
                if peers.is_empty() {
                    // The next `watch` starts a new reaper (it sees the empty list).
                    return;
                }
                peers.iter().filter_map(Weak::upgrade).collect()
            };
            for p in live {
                p.prune();
            }
        }
    }
}

#[cold]
fn refused(message: impl Into<String>) -> Failed {
    Failed::new(TransferKind::Refused, message)
}

#[cold]
fn gone(peer: &Peer) -> Failed {
    Failed::new(
        TransferKind::PeerLost,
        format!("shm transport is not connected: the peer process {} has exited", peer.pid),
    )
}

/// Checks a transfer of `len` bytes between `local` and the start of `r` against the peer's
/// table and moves the bytes. `local` is valid for `len` bytes (the caller's live view or
/// request holds its registration).
fn transfer(peer: &Peer, write: bool, local: *mut u8, len: usize, r: &RemoteBuffer) -> Completion {
    if !peer.check_alive() {
        return Err(gone(peer));
    }
    peer.prune();
    let e = peer
        .table
        .find(r.buffer_id)
        .filter(|e| e.key == r.access_key)
        .ok_or_else(|| refused("unknown remote buffer"))?;
    let (n, len) = (len, len as u64);
    if r.offset.checked_add(len).is_none_or(|end| end > e.len) {
        let what = if write { "write" } else { "read" };
        return Err(refused(format!(
            "{what} of {len} bytes at offset {} exceeds the registered buffer of {} bytes",
            r.offset, e.len
        )));
    }
    if write && e.flags & WRITABLE == 0 {
        return Err(refused("remote buffer is registered read-only"));
    }
    if n == 0 {
        return Ok(());
    }
    if e.flags & SHARED != 0 {
        let m = mapping(peer, &e).map_err(refused)?;
        let at = m.0.ptr().wrapping_add(m.1 + r.offset as usize);
        // Both ranges are valid: [offset, offset+len) is inside the registered range (checked
        // above), which lies inside the mapping `m` keeps alive; the local range lies inside
        // the local registration the request keeps alive. The two are different mappings, but
        // may alias the same pages (a process registering with itself): then `copy` handles the
        // overlap, and only in one piece, so the parts are not split across threads.
        let (local, at) = (local as usize, at as usize);
        let overlap = local < at + n && at < local + n;
        let Ok(()) = split_copy::<std::convert::Infallible>(n, !overlap, |start, n| {
            let (local, at) = ((local + start) as *mut u8, (at + start) as *mut u8);
            // SAFETY: [start, start + n) lies inside [0, len), valid on both sides (above);
            // parts run in parallel only when the ranges do not overlap, so no part writes
            // bytes another part reads or writes.
            unsafe {
                if write {
                    std::ptr::copy(local.cast_const(), at, n);
                } else {
                    std::ptr::copy(at.cast_const(), local, n);
                }
            }
            Ok(())
        });
        // The entry may have been retired while we copied; the copy went to pages the owner
        // still holds, and later transfers will see the new generation.
        return Ok(());
    }
    let remote = (e.addr + r.offset) as usize;
    let local = local as usize;
    let outcome = split_copy(n, true, |start, n| {
        let part = (local + start) as *mut u8;
        if write {
            // SAFETY: the part lies inside the local registration, kept alive by the request.
            let src = unsafe { std::slice::from_raw_parts(part.cast_const(), n) };
            cma::write(peer.pid, src, remote + start)
        } else {
            // SAFETY: as above; the caller does not touch a read's destination until it
            // completes, and the parts are disjoint.
            let dst = unsafe { std::slice::from_raw_parts_mut(part, n) };
            cma::read(peer.pid, dst, remote + start)
        }
    });
    outcome.map_err(|err| match err {
        CmaError::Gone => {
            peer.alive.store(false, Ordering::Release);
            gone(peer)
        }
        other => refused(other.to_string()),
    })
}

/// The mapping of a shared registration, created on first use and cached per generation.
fn mapping(peer: &Peer, e: &Entry) -> std::result::Result<Arc<PeerRange>, String> {
    let mut maps = peer.maps.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(m) = maps.get(&(e.id, e.generation)) {
        return Ok(m.clone());
    }
    // Mappings of older generations of this id are stale: drop them.
    maps.retain(|(id, _), _| *id != e.id);
    let writable = e.flags & WRITABLE != 0;
    let fd = shm::open_peer_with(peer.pid as u32, e.fd(), writable).map_err(|err| err.to_string())?;
    // The entry is the peer's word: its range must lie in the file it names (which is sealed
    // against shrinking), or touching the mapping past the file's end would raise SIGBUS here.
    let malformed = || format!("the peer's registration {} names a range outside its memory file", e.id);
    let end = e.file_offset.checked_add(e.len).ok_or_else(malformed)?;
    if end > shm::size(&fd).map_err(|err| err.to_string())? as u64 {
        return Err(malformed());
    }
    let start = e.file_offset / PAGE * PAGE;
    let lead = (e.file_offset - start) as usize;
    let span = (end - start).checked_next_multiple_of(PAGE).ok_or_else(malformed)?;
    let span = usize::try_from(span).map_err(|_| malformed())?;
    let map = Mapping::new_at(&fd, start, span, writable).map_err(|err| err.to_string())?;
    let m = Arc::new((map, lead));
    maps.insert((e.id, e.generation), m.clone());
    Ok(m)
}
