//! Symmetric memory: every rank allocates the same buffer, [`rendezvous`] gives access to every
//! peer's, and signal pads synchronize them (PyTorch's `torch.distributed._symmetric_memory`).
//!
//! ```text
//!   empty(shape, dtype)  ──▶ a tensor over a new shared segment [header | pad | data]
//!   rendezvous(t, group) ──▶ collective the first time per (allocation, group): ranks publish
//!                            where their segment is, check they agree (step, shape, dtype),
//!                            map the segments of the peers on their host, register theirs on
//!                            a transport link to each peer on another host, confirm; later
//!                            calls hit the cache
//!   handle               ──▶ buffer pointers (peers on this host), signal pads, barrier /
//!                            put_signal / wait_signal (every peer), views of peers' buffers
//! ```
//!
//! Peers on other hosts are reached through `tcp` transport links (see `remote`): one-sided
//! reads and writes of their buffers, and signals as remote atomics; their memory cannot be
//! addressed, and the calls that would hand out an address say so. A group spanning hosts
//! synchronizes hierarchically (see `hostsync`).
//!
//! Checks PyTorch does not make: ranks that allocate or rendezvous out of order, with other
//! shapes or dtypes, get an error naming both ranks and both shapes, on every rank, instead of
//! a hang or silent corruption; a rank that never arrives gives a timeout naming it; a peer
//! whose host is lost is named.
//!
//! Layer: uses `group` (rendezvous through its store), `transport` (peers on other hosts),
//! `tensor`, `sys` and `wire`.

pub(crate) mod hostsync;
mod pool;
mod remote;
pub(crate) use remote::tcp_link_flows;
mod segment;
mod signal;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::group::Group;
use crate::sync::Patience;
use crate::sync::slot::{self, Failure};
pub use crate::tensor::Device;
use crate::tensor::{DType, Storage, Tensor};
use crate::transport::{Memory, Work};
use crate::wire::symm::{PeerRecord, RECORD_VERSION};
pub use pool::MemPool;
use remote::{Link, Links, Mirror, Remote};
use segment::{Pad, Segment};
pub use signal::{nccl_put_with_signal, nccl_wait_for_signal, nvshmem_put_with_signal, nvshmem_wait_for_signal};

/// The name of the CPU shared-memory backend.
pub const BACKEND: &str = "CPU";

/// PyTorch's default signal pad: 32 channels × 72 ranks × 4 bytes.
pub const DEFAULT_SIGNAL_PAD_SIZE: usize = 9216;

/// Process-wide settings: the signal pad size of the allocations to come.
struct Globals {
    signal_pad_size: usize,
}

fn globals() -> MutexGuard<'static, Globals> {
    static G: Mutex<Globals> = Mutex::new(Globals { signal_pad_size: DEFAULT_SIGNAL_PAD_SIZE });
    // The settings stay consistent even if a holder panicked.
    G.lock().unwrap_or_else(|p| p.into_inner())
}

/// What symmetric memory keeps per group, in the group ([`Group::state`]): it dies with the
/// group, closing the group's links and dropping its barrier, and takes the group's entries
/// out of every allocation's cache on the way.
#[derive(Default)]
struct GroupState {
    /// The group's id, set at first use.
    id: std::sync::OnceLock<u64>,
    /// Rendezvous steps taken on the group: its keys never depend on other groups' activity.
    steps: AtomicU64,
    /// Signal-pad operations of the group are serialized across threads.
    lock: Arc<Mutex<()>>,
    /// The transport links to the group's ranks on other hosts.
    links: Mutex<Option<Arc<Links>>>,
    /// The group's barrier across hosts, once made.
    sync: Mutex<Option<Arc<hostsync::HostSync>>>,
    /// Set while the barrier's own words are being rendezvoused (they get no barrier).
    making_sync: AtomicBool,
    /// The caches of the allocations rendezvoused on the group.
    caches: Mutex<Vec<Weak<Mutex<Cache>>>>,
}

impl GroupState {
    fn of(group: &Group) -> Arc<GroupState> {
        let s = group.state::<GroupState>();
        s.id.get_or_init(|| group.id());
        s
    }

    fn id(&self) -> u64 {
        self.id.get().copied().unwrap_or(0)
    }

    /// Remembers that `cache` holds entries of this group.
    fn touched(&self, cache: &Arc<Mutex<Cache>>) {
        let mut caches = lock(&self.caches);
        if !caches.iter().any(|c| std::ptr::eq(c.as_ptr(), Arc::as_ptr(cache))) {
            caches.retain(|c| c.strong_count() > 0);
            caches.push(Arc::downgrade(cache));
        }
    }
}

impl Drop for GroupState {
    fn drop(&mut self) {
        let id = self.id();
        for cache in lock(&self.caches).drain(..).filter_map(|c| c.upgrade()) {
            let mut c = lock(&cache);
            c.peers.remove(&id);
            c.handles.retain(|(g, _), _| *g != id);
        }
    }
}

/// An allocation's peers and handles, per group id (per byte offset for handles).
#[derive(Debug, Default)]
struct Cache {
    peers: HashMap<u64, Arc<PeerSet>>,
    handles: HashMap<(u64, usize), Arc<SymmHandle>>,
}

/// Sets the backend. `"CPU"` is the only one on this machine; GPU backends answer with an
/// "unsupported" error naming what they need.
pub fn set_backend(name: &str) -> Result<()> {
    match name.to_ascii_uppercase().as_str() {
        BACKEND => Ok(()),
        gpu @ ("CUDA" | "NVSHMEM" | "NCCL") => Err(Error::Unsupported {
            what: format!("symmetric-memory backend {gpu}"),
            needs: "a CUDA device; this machine has none (available: CPU)".into(),
        }),
        other => Err(Error::InvalidArgument(format!("unknown symmetric-memory backend {other:?} (available: CPU)"))),
    }
}

/// The backend for `device`: `Some("CPU")` for the CPU, `None` where there is none.
pub fn get_backend(device: Device) -> Option<&'static str> {
    matches!(device, Device::Cpu).then_some(BACKEND)
}

/// Sets the signal pad size of future allocations, in bytes (a positive multiple of 4), as
/// PyTorch's: allocations made before keep theirs (a pool's block keeps the pad it was made
/// with). Ranks must agree on the pad of each allocation: a rendezvous of pads of different
/// sizes fails on every rank, naming both.
pub fn set_signal_pad_size(size: usize) -> Result<()> {
    if size == 0 || !size.is_multiple_of(4) {
        return Err(Error::InvalidArgument(format!("signal pad size {size} must be a positive multiple of 4 bytes")));
    }
    globals().signal_pad_size = size;
    Ok(())
}

/// The signal pad size of future allocations, in bytes.
pub fn get_signal_pad_size() -> usize {
    globals().signal_pad_size
}

/// A symmetric allocation: the storage behind tensors made by [`empty`] and [`MemPool`].
#[derive(Debug)]
pub struct Allocation {
    segment: Arc<Segment>,
    /// Peer mappings and handles per group; a group's entries go with it.
    cache: Arc<Mutex<Cache>>,
}

impl Allocation {
    fn new(data_size: usize) -> Result<Allocation> {
        let pad = globals().signal_pad_size;
        Ok(Allocation { segment: Arc::new(Segment::create(pad, data_size)?), cache: Arc::default() })
    }

    /// The data buffer's size in bytes.
    pub fn buffer_size(&self) -> usize {
        self.segment.data_size()
    }
}

// SAFETY: delegates to the segment, which the Arc keeps mapped.
unsafe impl Storage for Allocation {
    fn ptr(&self) -> *mut u8 {
        self.segment.data_ptr()
    }
    fn len(&self) -> usize {
        self.segment.data_size()
    }
    fn parent(&self) -> Option<(&(dyn std::any::Any + Send + Sync), usize)> {
        Some((self, 0))
    }
    fn shared_file(&self) -> Option<(i32, u64)> {
        self.segment.shared_file()
    }
    fn sleepers(&self) -> Option<&AtomicU32> {
        Some(self.segment.sleepers())
    }
}

/// A signal slot whose waiter, between its looks, serves what the slot's remote putter sent
/// (`Transport::serve_arrived`), so the put lands by this thread rather than the link's.
struct Serving<'a> {
    slot: &'a AtomicU32,
    link: &'a crate::transport::Transport,
}

impl crate::sync::SlotWord for Serving<'_> {
    fn load(&self) -> u32 {
        crate::sync::SlotWord::load(self.slot)
    }
    fn cas(&self, current: u32, new: u32) -> std::result::Result<u32, u32> {
        crate::sync::SlotWord::cas(self.slot, current, new)
    }
    fn sleep(&self, expected: u32, timeout: Duration) {
        crate::sync::SlotWord::sleep(self.slot, expected, timeout)
    }
    fn wake(&self) {
        crate::sync::SlotWord::wake(self.slot)
    }
    fn relax(&self) {
        self.link.serve_arrived();
        std::hint::spin_loop();
    }
    fn yield_now(&self) {
        self.link.serve_arrived();
        std::thread::yield_now();
    }
}

/// Allocates a zeroed symmetric tensor. Not collective; [`rendezvous`] it on a group next.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::tensor::DType;
///
/// let t = symm::empty(&[4, 4], DType::F32, Device::Cpu)?;
/// assert!(symm::is_symm_mem_tensor(&t));
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn empty(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    device.require_cpu("symmetric allocation")?;
    let bytes = crate::tensor::nbytes_of(shape, dtype)?;
    let alloc: Arc<dyn Storage> = Arc::new(Allocation::new(bytes)?);
    Ok(Tensor::from_storage(alloc, shape, dtype))
}

/// Whether `t` lives in symmetric memory (O(1), not collective).
pub fn is_symm_mem_tensor(t: &Tensor) -> bool {
    allocation_of(t).is_some()
}

/// The symmetric allocation behind `t`, if any, with the byte offset of `t`'s first element in
/// the allocation's data buffer.
pub fn allocation_of(t: &Tensor) -> Option<(&Allocation, usize)> {
    let (parent, base) = t.storage().parent()?;
    let alloc = parent.downcast_ref::<Allocation>()?;
    Some((alloc, base + t.storage_offset() * t.dtype().size()))
}

/// One peer's copy of an allocation: mapped (same host) or reached through a link.
#[derive(Debug)]
enum Peer {
    Local(Arc<Segment>),
    Remote(Box<Remote>),
}

/// The peers of one allocation in one group.
#[derive(Debug)]
struct PeerSet {
    rank: usize,
    world_size: usize,
    group: String,
    own: Arc<Segment>,
    peers: Vec<Peer>,
    /// The handles of this rank's allocation, for its signal pad views (`signal::PadView`).
    cache: Weak<Mutex<Cache>>,
    /// The host of every rank, numbered in order of first appearance.
    host_of: Vec<usize>,
    /// The ranks of every host, in order (a host's first is its leader).
    ranks_of_host: Vec<Vec<usize>>,
    /// The group's barrier across hosts (none on one host, or for that barrier's own words).
    sync: std::sync::OnceLock<Arc<hostsync::HostSync>>,
    /// This rank's signal pad and data buffer as registered on each link, by peer.
    exposed: HashMap<usize, (Arc<Link>, Memory, Memory)>,
    lock: Arc<Mutex<()>>,
    /// Whether this host's ranks outnumber the CPUs their affinity masks give them together
    /// (as every rank of the host computes it from the same records).
    crowded: bool,
    /// The group's rendezvous step that made it: the same on every rank for one allocation,
    /// different for two.
    step: u64,
    /// The backend of every link between the group's hosts (the same on every rank), if they
    /// all share one.
    link_backend: Option<String>,
}

impl Drop for PeerSet {
    fn drop(&mut self) {
        // The links outlive allocations: withdraw this one from them, or the registrations
        // would keep the segment alive.
        for (link, pad, data) in self.exposed.values() {
            for m in [pad, data] {
                if let Err(e) = link.transport.unregister_memory(m) {
                    tracing::warn!("symmetric memory: unregistering from the link to rank {}: {e}", link.peer);
                }
            }
        }
    }
}

/// A rendezvoused symmetric allocation, seen from one rank: peer buffers, signal pads, and the
/// synchronization on them.
#[derive(Debug)]
pub struct SymmHandle {
    peers: Arc<PeerSet>,
    /// This tensor's byte offset in the allocation's data buffer.
    offset: usize,
}

/// Establishes symmetric memory for `tensor` among the ranks of `group`.
///
/// Collective the first time for each (allocation, group): every rank of the group must call
/// it, in the same order relative to its other rendezvous on the group, with a tensor of the
/// same shape and dtype. Later calls return the cached handle.
pub fn rendezvous(tensor: &Tensor, group: &Group) -> Result<Arc<SymmHandle>> {
    let Some((alloc, offset)) = allocation_of(tensor) else {
        return Err(Error::InvalidArgument(
            "rendezvous: the tensor is not inside a symmetric allocation; allocate it with symm::empty or a MemPool"
                .into(),
        ));
    };
    // The hot path (every operator rendezvouses its input): one lookup, no allocation.
    let key = (group.id(), offset);
    if let Some(h) = lock(&alloc.cache).handles.get(&key) {
        return Ok(h.clone());
    }
    let state = GroupState::of(group);
    let cached = lock(&alloc.cache).peers.get(&group.id()).cloned();
    let peers = match cached {
        Some(p) => p,
        None => {
            let p = Arc::new(exchange(alloc, tensor, offset, group, &state)?);
            if !p.exposed.is_empty()
                && let Some(sync) = host_sync(group, &state)?
            {
                let _ = p.sync.set(sync);
            }
            lock(&alloc.cache).peers.insert(group.id(), p.clone());
            state.touched(&alloc.cache);
            p
        }
    };
    let h = Arc::new(SymmHandle { peers, offset });
    lock(&alloc.cache).handles.insert(key, h.clone());
    Ok(h)
}

/// The barrier of a group that spans hosts, made at its first rendezvous across hosts (every
/// rank reaches that point in the same order, so the nested rendezvous is collective too).
fn host_sync(group: &Group, state: &GroupState) -> Result<Option<Arc<hostsync::HostSync>>> {
    if state.making_sync.load(Ordering::Relaxed) {
        return Ok(None);
    }
    if let Some(s) = lock(&state.sync).clone() {
        return Ok(Some(s));
    }
    // Relaxed: only this thread's nested rendezvous reads it (a group's collectives are
    // called by one thread at a time).
    state.making_sync.store(true, Ordering::Relaxed);
    let made = (|| {
        let words = empty(&[hostsync::words(group.world_size())], DType::U32, Device::Cpu)?;
        let h = rendezvous(&words, group)?;
        Ok::<_, Error>(Arc::new(hostsync::HostSync::new(words, h)))
    })();
    state.making_sync.store(false, Ordering::Relaxed);
    let s = made?;
    *lock(&state.sync) = Some(s.clone());
    Ok(Some(s))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn describe(r: &PeerRecord) -> String {
    let dtype = DType::from_code(r.dtype).map_or_else(|| format!("dtype#{}", r.dtype), |d| d.to_string());
    format!("{:?} {dtype} ({} bytes at offset {}, pad {} bytes)", r.shape, r.buffer_size, r.offset, r.pad_size)
}

fn exchange(alloc: &Allocation, tensor: &Tensor, offset: usize, group: &Group, state: &GroupState) -> Result<PeerSet> {
    let (rank, ws, name) = (group.rank(), group.world_size(), group.name().to_string());
    // Relaxed: a counter; every rank of the group takes the same steps in the same order.
    let step = state.steps.fetch_add(1, Ordering::Relaxed) + 1;
    let me = PeerRecord {
        version: RECORD_VERSION,
        host: crate::topo::this_host(),
        pid: std::process::id(),
        fd: alloc.segment.fd_number(),
        segment_len: alloc.segment.len() as u64,
        pad_size: alloc.segment.pad_size() as u64,
        buffer_size: alloc.segment.data_size() as u64,
        shape: tensor.shape().iter().map(|&d| d as u64).collect(),
        dtype: tensor.dtype().code(),
        offset: offset as u64,
        cpus: crate::topo::affinity(),
    };
    let timeout = crate::config::op_timeout();
    let raw = group.exchange_bytes(&format!("symm/{step}"), &me.encode(), timeout).map_err(|e| match e {
        Error::Timeout { what, after } => Error::timeout(format!("symmetric rendezvous step {step}: {what}"), after),
        e => e,
    })?;
    let records = raw
        .iter()
        .enumerate()
        .map(|(r, b)| PeerRecord::decode(b).map_err(|e| Error::Rendezvous(format!("rank {r}: {e}"))))
        .collect::<Result<Vec<_>>>()?;

    // Every rank checks the same records, so every rank reaches the same verdict.
    let same = |a: &PeerRecord, b: &PeerRecord| {
        a.shape == b.shape
            && a.dtype == b.dtype
            && a.buffer_size == b.buffer_size
            && a.pad_size == b.pad_size
            && a.offset == b.offset
    };
    if let Some((r, rec)) = records.iter().enumerate().find(|(_, rec)| !same(rec, &records[0])) {
        return Err(Error::Rendezvous(format!(
            "symmetric rendezvous step {step} of group {name:?}: rank 0 has {} but rank {r} has {}; every rank must \
             allocate and rendezvous in the same order with the same shapes and dtypes",
            describe(&records[0]),
            describe(rec)
        )));
    }
    let hosts: Vec<String> = records.iter().map(|r| r.host.clone()).collect();
    let remote: Vec<usize> = (0..ws).filter(|&r| hosts[r] != hosts[rank]).collect();
    let mut connected_now = false;
    let links = if remote.is_empty() {
        Arc::new(Links::new())
    } else {
        let cached = lock(&state.links).clone();
        match cached {
            Some(l) if remote.iter().all(|r| l.contains_key(r)) => l,
            _ => {
                let l = Arc::new(remote::connect(group, step, &remote, &hosts)?);
                *lock(&state.links) = Some(l.clone());
                connected_now = true;
                l
            }
        }
    };

    // Expose this allocation on every link; map the peers on this host.
    let own = alloc.segment.clone();
    let mut exposed = HashMap::new();
    let mut offers = Vec::new();
    let mut failure = String::new();
    for &peer in &remote {
        let link = links[&peer].clone();
        let pad = Tensor::from_storage(Arc::new(Pad(own.clone())), &[own.pad_size() / 4], DType::U32);
        let data = Tensor::from_storage(own.clone(), &[own.data_size()], DType::U8);
        let regs = link.transport.register_memory(&pad).and_then(|p| Ok((p, link.transport.register_memory(&data)?)));
        match regs.and_then(|(p, d)| Ok((p.to_remote_buffer()?, d.to_remote_buffer()?, p, d))) {
            Ok((pd, dd, p, d)) => {
                offers.push(Offer {
                    to: peer,
                    pad: String::from_utf8_lossy(&pd.serialize()).into_owned(),
                    data: String::from_utf8_lossy(&dd.serialize()).into_owned(),
                });
                exposed.insert(peer, (link, p, d));
            }
            Err(e) => {
                failure = format!("rank {rank} could not expose its allocation to rank {peer}: {e}");
                break;
            }
        }
    }
    let mut segments: Vec<Option<Arc<Segment>>> = vec![None; ws];
    for (r, rec) in records.iter().enumerate() {
        if r == rank {
            segments[r] = Some(own.clone());
        } else if failure.is_empty() && hosts[r] == hosts[rank] {
            match Segment::open(r, rec) {
                Ok(s) => segments[r] = Some(Arc::new(s)),
                Err(e) => failure = format!("rank {rank} could not map rank {r}'s segment: {e}"),
            }
        }
    }
    // The host's leader (its lowest rank) makes the shared mirrors of the remote ranks.
    let mut distinct: Vec<&String> = Vec::new();
    let host_of: Vec<usize> = hosts
        .iter()
        .map(|h| {
            distinct.iter().position(|d| *d == h).unwrap_or_else(|| {
                distinct.push(h);
                distinct.len() - 1
            })
        })
        .collect();
    // The first rank of a host is its leader.
    let leader = host_of.iter().position(|&h| h == host_of[rank]).unwrap_or(rank);
    let mut mirrors: HashMap<usize, Arc<Mirror>> = HashMap::new();
    let mut mirror_offers = Vec::new();
    if leader == rank && failure.is_empty() {
        for &r in &remote {
            match Mirror::create(records[r].buffer_size as usize) {
                Ok(m) => {
                    mirror_offers.push(MirrorOffer { of: r, pid: std::process::id(), fd: m.fd_number() });
                    mirrors.insert(r, Arc::new(m));
                }
                Err(e) => {
                    failure = format!("rank {rank} could not make a mirror of rank {r}'s buffer: {e}");
                    break;
                }
            }
        }
    }
    // Confirm: nobody returns (and may free its segment) before everyone has mapped, and a
    // failure on one rank becomes an error on all. Descriptors for remote peers and the shared
    // mirrors ride along.
    // The backend of this rank's links to other hosts, if they share one.
    let mut names = remote.iter().map(|r| links[r].transport.backend_name().to_string());
    let first = names.next().unwrap_or_default();
    let link_backend = if names.all(|n| n == first) { first } else { MIXED.to_string() };
    let confirm = Confirm { failure, offers, mirrors: mirror_offers, links: link_backend };
    let raw = serde_json::to_vec(&confirm).map_err(|e| Error::Rendezvous(format!("encoding the confirmation: {e}")))?;
    let verdicts = group.exchange_bytes(&format!("symm/{step}/mapped"), &raw, timeout)?;
    let verdicts = verdicts
        .iter()
        .enumerate()
        .map(|(r, v)| {
            serde_json::from_slice::<Confirm>(v).map_err(|e| Error::Rendezvous(format!("rank {r}'s confirmation: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    if connected_now {
        // Every peer has connected its link (it confirmed after that), so the URLs this rank
        // published for them have been read.
        remote::forget(group, step, &remote)?;
    }
    if let Some(v) = verdicts.iter().find(|v| !v.failure.is_empty()) {
        return Err(Error::Rendezvous(v.failure.clone()));
    }
    if leader != rank {
        for o in &verdicts[leader].mirrors {
            let m = Mirror::open(o.pid, o.fd, records[o.of].buffer_size as usize).map_err(|e| {
                Error::Rendezvous(format!("rank {rank} could not map its host's mirror of rank {}: {e}", o.of))
            })?;
            mirrors.insert(o.of, Arc::new(m));
        }
    }
    let mut peers = Vec::with_capacity(ws);
    for (r, seg) in segments.into_iter().enumerate() {
        if let Some(seg) = seg {
            peers.push(Peer::Local(seg));
            continue;
        }
        let offer = verdicts[r].offers.iter().find(|o| o.to == rank).ok_or_else(|| {
            Error::Rendezvous(format!("rank {r} on host {} offered no descriptors to rank {rank}", hosts[r]))
        })?;
        let pad = crate::transport::RemoteBuffer::deserialize(offer.pad.as_bytes())?;
        let data = crate::transport::RemoteBuffer::deserialize(offer.data.as_bytes())?;
        if pad.len() != records[r].pad_size || data.len() != records[r].buffer_size {
            return Err(Error::Rendezvous(format!(
                "rank {r} offered a pad of {} and a buffer of {} bytes, but announced {} and {}",
                pad.len(),
                data.len(),
                records[r].pad_size,
                records[r].buffer_size
            )));
        }
        let mirror = mirrors.get(&r).cloned().ok_or_else(|| {
            Error::Rendezvous(format!("rank {leader} (this host's leader) made no mirror of rank {r}"))
        })?;
        peers.push(Peer::Remote(Box::new(Remote::new(links[&r].clone(), pad, data, mirror))));
    }
    // The backend of every link between hosts, as every rank reads it from the same
    // confirmations (so choices made by it agree): none on one host, or when they differ.
    let mut backends = verdicts.iter().map(|v| v.links.as_str()).filter(|b| !b.is_empty());
    let link_backend = backends.next().filter(|&b| b != MIXED && backends.all(|o| o == b)).map(str::to_string);
    let lock = state.lock.clone();
    let mut ranks_of_host = vec![Vec::new(); distinct.len()];
    for (r, &h) in host_of.iter().enumerate() {
        ranks_of_host[h].push(r);
    }
    // The same records on every rank of the host: the same verdict (an algorithm chosen by it
    // agrees across ranks).
    let mates = &ranks_of_host[host_of[rank]];
    let crowded = crate::topo::crowded(mates.len(), mates.iter().map(|&r| records[r].cpus.as_slice()));
    Ok(PeerSet {
        rank,
        world_size: ws,
        group: name,
        own,
        peers,
        cache: Arc::downgrade(&alloc.cache),
        host_of,
        ranks_of_host,
        sync: Default::default(),
        exposed,
        lock,
        crowded,
        step,
        link_backend,
    })
}

/// What a rank offers a peer on another host: descriptors of its pad and data buffer.
#[derive(serde::Serialize, serde::Deserialize)]
struct Offer {
    to: usize,
    pad: String,
    data: String,
}

/// A host leader's shared mirror of one remote rank's buffer, for the other ranks of its host.
#[derive(serde::Serialize, serde::Deserialize)]
struct MirrorOffer {
    of: usize,
    pid: u32,
    fd: i32,
}

/// A rank's answer in the rendezvous's confirm step.
#[derive(serde::Serialize, serde::Deserialize)]
struct Confirm {
    /// Empty on success, else why this rank failed.
    failure: String,
    offers: Vec<Offer>,
    mirrors: Vec<MirrorOffer>,
    /// The backend of this rank's links to other hosts: empty without any, [`MIXED`] when
    /// they differ.
    links: String,
}

/// In a confirmation: this rank's links to other hosts are not all on one backend.
const MIXED: &str = "mixed";

impl SymmHandle {
    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.peers.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.peers.world_size
    }

    /// The group's name.
    pub fn group_name(&self) -> &str {
        &self.peers.group
    }

    /// The byte offset of the rendezvoused tensor in the allocation.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Whether `rank` is on this host (its memory is mapped here). Panics if out of range.
    pub fn is_local(&self, rank: usize) -> bool {
        matches!(self.peers.peers[rank], Peer::Local(_))
    }

    /// Whether every rank of the group is on this host.
    pub fn all_local(&self) -> bool {
        self.peers.exposed.is_empty()
    }

    /// The ranks on other hosts, reached through the transport.
    pub fn remote_ranks(&self) -> Vec<usize> {
        (0..self.world_size()).filter(|&r| !self.is_local(r)).collect()
    }

    #[cold]
    fn not_addressable(&self, what: &str, rank: usize) -> Error {
        let host = match &self.peers.peers[rank] {
            Peer::Remote(r) => r.link.host.clone(),
            Peer::Local(_) => crate::topo::this_host(),
        };
        Error::InvalidArgument(format!(
            "{what}: rank {rank} is on host {host}, so its memory cannot be addressed from this host; reach it \
             with put/get (nvshmem_put, nvshmem_get, put_signal) or the operators"
        ))
    }

    fn local(&self, rank: usize) -> Option<&Arc<Segment>> {
        match &self.peers.peers[rank] {
            Peer::Local(s) => Some(s),
            Peer::Remote(_) => None,
        }
    }

    /// The count of threads sleeping on a word of `rank`'s segment, when it is on this host
    /// (see [`crate::sync::sleep_on`]); a rank on another host has only a mirror here, whose
    /// stores always wake.
    pub(crate) fn sleepers(&self, rank: usize) -> Option<&AtomicU32> {
        self.local(rank).map(|s| s.sleepers())
    }

    pub(crate) fn remote(&self, rank: usize) -> Option<&Remote> {
        match &self.peers.peers[rank] {
            Peer::Remote(r) => Some(r),
            Peer::Local(_) => None,
        }
    }

    /// The error `e` of a transfer `what` (`"writing to"`, ...) `rank`, naming the rank and its
    /// host when it is on another host (the failures of a lost link name no rank themselves).
    pub(crate) fn failed(&self, what: &str, rank: usize, e: Error) -> Error {
        match self.remote(rank) {
            Some(r) => r.link.error(what, &e),
            None => e,
        }
    }

    /// The address of `rank`'s data buffer in this process; an error for a rank on another
    /// host. Panics if `rank` is out of range.
    pub fn buffer_ptr(&self, rank: usize) -> Result<usize> {
        self.local(rank).map(|s| s.data_ptr() as usize).ok_or_else(|| self.not_addressable("buffer_ptr", rank))
    }

    /// The address of every rank's data buffer, in this process's address space; an error when
    /// the group spans hosts.
    pub fn buffer_ptrs(&self) -> Result<Vec<usize>> {
        (0..self.world_size())
            .map(|r| self.local(r).map(|s| s.data_ptr() as usize).ok_or_else(|| self.not_addressable("buffer_ptrs", r)))
            .collect()
    }

    /// The address of every rank's signal pad, in this process's address space; an error when
    /// the group spans hosts.
    pub fn signal_pad_ptrs(&self) -> Result<Vec<usize>> {
        (0..self.world_size())
            .map(|r| {
                self.local(r).map(|s| s.pad_ptr() as usize).ok_or_else(|| self.not_addressable("signal_pad_ptrs", r))
            })
            .collect()
    }

    /// Where operators read `rank`'s data buffer: its mapping, or for a rank on another host
    /// the mirror that [`SymmHandle::fetch`] filled.
    pub(crate) fn read_ptr(&self, rank: usize) -> usize {
        match &self.peers.peers[rank] {
            Peer::Local(s) => s.data_ptr() as usize,
            Peer::Remote(r) => r.mirror_ptr(),
        }
    }

    /// The 8-byte word at byte `at` of `rank`'s data buffer (its mapping, or its mirror for a
    /// rank on another host), for words every process touches only atomically: operators'
    /// epochs, stamps and signals. Panics if the word is not inside the buffer or not 8-aligned,
    /// which would be a bug in the caller's layout, never a matter of input.
    pub(crate) fn word64(&self, rank: usize, at: usize) -> &AtomicU64 {
        let p = self.word_ptr(rank, at, 8);
        // SAFETY: `word_ptr` checked that the 8 bytes lie inside `rank`'s buffer (mapped, or
        // mirrored, while `self` lives, so for the returned borrow) and are 8-aligned; the
        // memory is shared, and every process and thread touches these words only atomically.
        unsafe { &*(p as *const AtomicU64) }
    }

    /// The 4-byte word at byte `at` of `rank`'s data buffer, as [`SymmHandle::word64`]; also
    /// the futex half (the low half, little-endian) of an 8-byte word.
    pub(crate) fn word32(&self, rank: usize, at: usize) -> &AtomicU32 {
        let p = self.word_ptr(rank, at, 4);
        // SAFETY: as in word64, for 4 bytes, 4-aligned.
        unsafe { &*(p as *const AtomicU32) }
    }

    fn word_ptr(&self, rank: usize, at: usize, width: usize) -> usize {
        let p = self.read_ptr(rank).checked_add(at).expect("word address overflows");
        assert!(
            at.checked_add(width).is_some_and(|end| end <= self.buffer_size()) && p.is_multiple_of(width),
            "{width}-byte word at byte {at} of a {}-byte buffer is out of place",
            self.buffer_size()
        );
        p
    }

    /// Fetches, from every rank on another host, the bytes `range(rank)` (offset and length in
    /// its data buffer) into its mirror, all at once; a no-op when every rank is local.
    pub(crate) fn fetch(&self, range: &dyn Fn(usize) -> (usize, usize), timeout: Duration) -> Result<()> {
        if self.all_local() {
            return Ok(());
        }
        let mut works = Vec::new();
        for p in &self.peers.peers {
            if let Peer::Remote(r) = p {
                let (at, len) = range(r.link.peer);
                if len > 0 {
                    works.push((&**r, r.start_fetch(at, len, timeout)));
                }
            }
        }
        remote::wait_all(works, "reading from")
    }

    /// Reads, from every rank on another host, the bytes `range(rank) = (at, len, to)` of its
    /// data buffer straight into bytes `[to, to + len)` of `out` (any contiguous tensor,
    /// symmetric or not), all at once, and runs `meanwhile` while they travel; returns once
    /// every read landed (or failed). With every rank on this host it just runs `meanwhile`.
    /// `out` is registered privately on each link for the call only
    /// (`Transport::register_private`: unreachable by peers, and leaving any registration of
    /// its own in place). A read larger than the link's [`remote::Link::read_piece`] goes as
    /// pieces, all in flight.
    pub(crate) fn fetch_into(
        &self,
        out: &Tensor,
        range: &dyn Fn(usize) -> (usize, usize, usize),
        timeout: Duration,
        meanwhile: impl FnOnce(),
    ) -> Result<()> {
        let mut regs = Vec::new();
        let mut works = Vec::new();
        for r in (0..self.world_size()).filter_map(|r| self.remote(r)) {
            let (at, len, to) = range(r.link.peer);
            if len == 0 {
                continue;
            }
            let reg = match r.link.transport.register_private(out) {
                Ok(reg) => reg,
                Err(e) => {
                    works.push((r, Err(e)));
                    continue;
                }
            };
            for (o, n) in remote::pieces(len, r.link.read_piece()) {
                let view = reg.to_mutable_view(to + o, Some(n));
                works.push((r, view.and_then(|v| r.start_read_into(&v, at + o, n, timeout))));
            }
            regs.push((r, reg));
        }
        meanwhile();
        let fetched = remote::wait_all(works, "reading from");
        for (r, reg) in &regs {
            unregister_temporary(r, reg);
        }
        fetched
    }

    /// Like [`SymmHandle::fetch`] for a range every rank of this host reads alike: the ranks
    /// of the host share the remote ranks out among themselves, each fetches its share into
    /// the host's mirrors, and a barrier among the host's ranks makes every share visible to
    /// all. Collective over the ranks of the group. Each remote byte crosses hosts once per
    /// host instead of once per rank.
    pub(crate) fn fetch_shared(&self, range: &dyn Fn(usize) -> (usize, usize), timeout: Duration) -> Result<()> {
        if self.all_local() {
            return Ok(());
        }
        let locals = self.local_ranks();
        let me = locals.iter().position(|&r| r == self.rank()).unwrap_or(0);
        let mut works = Vec::new();
        for (i, r) in (0..self.world_size()).filter_map(|r| self.remote(r)).enumerate() {
            let (at, len) = range(r.link.peer);
            if i % locals.len() == me && len > 0 {
                works.push((r, r.start_fetch(at, len, timeout)));
            }
        }
        let fetched = remote::wait_all(works, "reading from");
        // The barrier happens even after a failure, so that no rank of the host is left waiting.
        let synced = self.local_barrier(0, timeout);
        fetched.and(synced)
    }

    /// Copies `len` bytes at `from` in this rank's own data buffer to `to` in `rank`'s data
    /// buffer: a memcpy on this host, a transport write to another. Every write has landed
    /// when it returns.
    pub(crate) fn push(&self, ranks: &[usize], from: usize, len: usize, to: usize, timeout: Duration) -> Result<()> {
        let mut works = Vec::new();
        for &rank in ranks {
            match &self.peers.peers[rank] {
                Peer::Local(s) => {
                    if from + len > self.peers.own.data_size() || to + len > s.data_size() {
                        return Err(Error::InvalidArgument(format!("push of {len} bytes is out of bounds")));
                    }
                    // SAFETY: both ranges lie inside mapped data buffers (checked above); the
                    // caller's barriers give this rank the destination range; `copy` tolerates
                    // the overlap of a rank pushing to itself.
                    unsafe {
                        std::ptr::copy(self.peers.own.data_ptr().add(from), s.data_ptr().add(to), len);
                    }
                }
                Peer::Remote(r) => {
                    let (_, _, data) = &self.peers.exposed[&rank];
                    let src = data.to_view(from, Some(len))?;
                    works.push((&**r, r.start_write_from(&src, to, timeout)));
                }
            }
        }
        remote::wait_all(works, "writing to")
    }

    /// Starts writing `len` bytes at `from` in this rank's own data buffer to `to` in the data
    /// buffer of `rank`, on another host, without waiting. Writes of at most 64 KiB that one
    /// thread starts on one link land in the order started, atomics included. Posted: the
    /// Work may complete once the bytes are sent (the peer learns of them from the signal
    /// that follows).
    pub(crate) fn start_push(
        &self,
        rank: usize,
        from: usize,
        len: usize,
        to: usize,
        timeout: Duration,
    ) -> Result<crate::transport::Work> {
        self.start_push_from(self, rank, from, len, to, timeout)
    }

    /// As [`start_push`](Self::start_push), from `src`: this allocation or another of the same
    /// group (so registered on the same link), at byte `from` of this rank's data buffer of
    /// it. The caller keeps those bytes unchanged until the Work completes.
    pub(crate) fn start_push_from(
        &self,
        src: &SymmHandle,
        rank: usize,
        from: usize,
        len: usize,
        to: usize,
        timeout: Duration,
    ) -> Result<crate::transport::Work> {
        let r = self.remote(rank).ok_or_else(|| Error::InvalidArgument(format!("rank {rank} is not remote")))?;
        let exposed = src.peers.exposed.get(&rank).filter(|(link, _, _)| Arc::ptr_eq(link, &r.link));
        let Some((_, _, data)) = exposed else {
            return Err(Error::InvalidArgument(format!(
                "push from another allocation to rank {rank}: it is not registered on this allocation's link"
            )));
        };
        let view = data.to_view(from, Some(len))?;
        r.post_write_from(&view, to, timeout).map_err(|e| r.link.error("writing to", &e))
    }

    /// Runs `f`, which starts transfers to `rank` (on another host), and sends the small ones
    /// together when it returns (see `Transport::batch`); `f` must not wait for them.
    pub(crate) fn batch<R>(&self, rank: usize, f: impl FnOnce() -> R) -> R {
        match self.remote(rank) {
            Some(r) => r.link.transport.batch(f),
            None => f(),
        }
    }

    /// The size of the whole data buffer of the allocation, in bytes.
    pub fn buffer_size(&self) -> usize {
        self.peers.own.data_size()
    }

    /// The size of each signal pad, in bytes.
    pub fn signal_pad_size(&self) -> usize {
        self.peers.own.pad_size()
    }

    /// The multicast address: none on CPUs.
    pub fn multicast_ptr(&self) -> Option<usize> {
        None
    }

    /// The number of signal channels: `pad_size / (4 · world_size)`.
    pub fn num_channels(&self) -> usize {
        self.signal_pad_size() / (4 * self.world_size())
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.world_size() {
            return Err(Error::InvalidArgument(format!("rank must be in [0, {}) (got {rank})", self.world_size())));
        }
        Ok(())
    }

    fn check_channel(&self, channel: usize) -> Result<()> {
        let n = self.num_channels();
        if channel >= n {
            return Err(Error::InvalidArgument(format!(
                "The maximum supported channel for barrier(), put_signal() and wait_signal() is {} (got {channel})",
                n.saturating_sub(1)
            )));
        }
        Ok(())
    }

    /// A view of `rank`'s data buffer, `storage_offset` elements in; an error for a rank on
    /// another host.
    pub fn get_buffer(&self, rank: usize, sizes: &[usize], dtype: DType, storage_offset: usize) -> Result<Tensor> {
        self.check_rank(rank)?;
        let seg = self.local(rank).ok_or_else(|| self.not_addressable("get_buffer", rank))?;
        // Checked: sizes and offsets come from the caller, and a wrapped end would pass.
        let es = dtype.size();
        let end = sizes
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|numel| numel.checked_mul(es))
            .and_then(|bytes| storage_offset.checked_mul(es)?.checked_add(bytes));
        if end.is_none_or(|end| end > seg.data_size()) {
            let asked = end.map_or_else(|| "more than fit in memory".to_string(), |e| format!("{e} bytes"));
            return Err(Error::InvalidArgument(format!(
                "SymmetricMemory::get_buffer: the requested size ({asked}: sizes {sizes:?} of {dtype} at element \
                 offset {storage_offset}) exceeds the allocated size ({} bytes)",
                seg.data_size()
            )));
        }
        let strides = crate::tensor::contiguous_strides(sizes);
        Tensor::view_of(seg.clone(), sizes, &strides, storage_offset, dtype)
    }

    /// A view of `peer`'s copy of the rendezvoused tensor (at this handle's offset); an error
    /// for a peer on another host.
    pub fn get_remote_tensor(&self, peer: usize, sizes: &[usize], dtype: DType) -> Result<Tensor> {
        if !self.offset.is_multiple_of(dtype.size()) {
            return Err(Error::InvalidArgument(format!(
                "get_remote_tensor: handle offset {} is not aligned to {dtype}",
                self.offset
            )));
        }
        self.check_rank(peer)?;
        if !self.is_local(peer) {
            return Err(self.not_addressable("get_remote_tensor", peer));
        }
        self.get_buffer(peer, sizes, dtype, self.offset / dtype.size())
    }

    /// A `u32` view of `rank`'s signal pad; an error for a rank on another host. A word of it
    /// names the same word on every rank ([`nvshmem_put_with_signal`] takes it as the signal).
    pub fn get_signal_pad(&self, rank: usize) -> Result<Tensor> {
        self.check_rank(rank)?;
        let seg = self.local(rank).ok_or_else(|| self.not_addressable("get_signal_pad", rank))?.clone();
        let n = seg.pad_size() / 4;
        let view = signal::PadView { segment: seg, cache: self.peers.cache.clone() };
        Ok(Tensor::from_storage(Arc::new(view), &[n], DType::U32))
    }

    /// The 8-byte word at byte `at` of `rank`'s signal pad (on this host), for words every
    /// process touches only atomically (signals). Panics if the word is not inside the pad or
    /// not 8-aligned, or the rank is on another host: a bug in the caller, never a matter of
    /// input (callers check).
    pub(crate) fn pad_word64(&self, rank: usize, at: usize) -> &AtomicU64 {
        let p = self.pad_word_ptr(rank, at, 8);
        // SAFETY: `pad_word_ptr` checked that the 8 bytes lie inside `rank`'s pad (mapped while
        // `self` lives, so for the returned borrow) and are 8-aligned; the memory is shared,
        // and every process and thread touches pad words only atomically.
        unsafe { &*(p as *const AtomicU64) }
    }

    /// The 4-byte word at byte `at` of `rank`'s signal pad, as [`SymmHandle::pad_word64`].
    pub(crate) fn pad_word32(&self, rank: usize, at: usize) -> &AtomicU32 {
        let p = self.pad_word_ptr(rank, at, 4);
        // SAFETY: as in pad_word64, for 4 bytes, 4-aligned.
        unsafe { &*(p as *const AtomicU32) }
    }

    fn pad_word_ptr(&self, rank: usize, at: usize, width: usize) -> usize {
        let seg = self.local(rank).expect("a signal pad word of a rank on another host");
        let p = (seg.pad_ptr() as usize).checked_add(at).expect("word address overflows");
        assert!(
            at.checked_add(width).is_some_and(|end| end <= seg.pad_size()) && p.is_multiple_of(width),
            "{width}-byte word at byte {at} of a {}-byte signal pad is out of place",
            seg.pad_size()
        );
        p
    }

    pub(crate) fn patience(&self, timeout: Duration) -> Patience {
        Patience::new(timeout, self.peers.crowded)
    }

    /// Whether the ranks on this host outnumber the CPUs their affinity masks allow them
    /// together (read at the rendezvous): then a wait hands its core over instead of spinning,
    /// and the small all-reduce takes more sizes. Every rank of a host gets the same answer.
    pub fn crowded(&self) -> bool {
        self.peers.crowded
    }

    /// The transport backend (`"tcp"`, `"ucx"`) of every link between the group's hosts, the
    /// same on every rank: `None` on one host, or when the links do not all share one. The
    /// operators choose their algorithms by it across hosts.
    pub fn link_backend(&self) -> Option<&str> {
        self.peers.link_backend.as_deref()
    }

    /// The allocation's identity in its group: the rendezvous step that made it, the same on
    /// every rank (so ranks can check they passed the same allocation).
    pub(crate) fn allocation_id(&self) -> u64 {
        self.peers.step
    }

    /// Raises a signal at `dst_rank` on `channel`; blocks while the previous signal on that
    /// slot is unconsumed, at most `timeout`.
    pub fn put_signal(&self, dst_rank: usize, channel: usize, timeout: Duration) -> Result<()> {
        self.check_rank(dst_rank)?;
        self.check_channel(channel)?;
        let _g = lock(&self.peers.lock);
        self.put_all(&[dst_rank], channel, &self.patience(timeout), "put_signal", timeout)
    }

    /// Consumes a signal from `src_rank` on `channel`, waiting at most `timeout`.
    pub fn wait_signal(&self, src_rank: usize, channel: usize, timeout: Duration) -> Result<()> {
        self.check_rank(src_rank)?;
        self.check_channel(channel)?;
        let _g = lock(&self.peers.lock);
        self.wait(src_rank, channel, &self.patience(timeout), "wait_signal", timeout)
    }

    /// Waits until every rank of the group has reached a barrier on `channel`: a signal to and
    /// from every peer. The pads are all zeros afterwards.
    pub fn barrier(&self, channel: usize, timeout: Duration) -> Result<()> {
        self.check_channel(channel)?;
        let _g = lock(&self.peers.lock);
        let p = self.patience(timeout);
        if !self.all_local() {
            return self.host_sync()?.barrier(&p, timeout);
        }
        let (me, ws) = (self.rank(), self.world_size());
        let others: Vec<usize> = (1..ws).map(|k| (me + k) % ws).collect();
        self.put_all(&others, channel, &p, "barrier", timeout)?;
        for k in 1..ws {
            self.wait((me + ws - k) % ws, channel, &p, "barrier", timeout)?;
        }
        Ok(())
    }

    /// On a group that spans hosts, the barrier of [`SymmHandle::barrier`] carrying `digest`
    /// (what this rank passed to the call it enters): returns the verdict every rank gets, 0
    /// when every rank's digest equals rank 0's, else 1 + the first rank whose differs. `None`
    /// on one host (the caller checks by reading its peers' stamps, which costs nothing there).
    pub(crate) fn barrier_agreeing(&self, digest: u64, timeout: Duration) -> Result<Option<u64>> {
        if self.all_local() {
            return Ok(None);
        }
        let _g = lock(&self.peers.lock);
        self.host_sync()?.barrier_agreeing(&self.patience(timeout), timeout, digest).map(Some)
    }

    /// The words of the group's barrier across hosts, whose alarm word is the group's
    /// ([`hostsync::Words::sound`]); none on one host.
    pub(crate) fn group_alarm(&self) -> Option<&hostsync::Words> {
        self.peers.sync.get().map(|s| s.words())
    }

    /// The group's barrier across hosts, on a group that spans hosts.
    fn host_sync(&self) -> Result<&hostsync::HostSync> {
        // Only the barrier's own words have none, and nothing calls their barrier.
        self.peers.sync.get().map(|s| &**s).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "SymmetricMemory::barrier: group {:?} spans hosts but this allocation has no host barrier",
                self.peers.group
            ))
        })
    }

    /// The ranks on this host, this one included, in order.
    pub fn local_ranks(&self) -> &[usize] {
        self.ranks_on(self.host_of(self.rank()))
    }

    /// How many hosts the group spans.
    pub fn hosts(&self) -> usize {
        self.peers.ranks_of_host.len()
    }

    /// The host of `rank`, as an index (hosts are numbered in order of their lowest rank).
    pub fn host_of(&self, rank: usize) -> usize {
        self.peers.host_of[rank]
    }

    /// The ranks on host `host`, in order.
    pub fn ranks_on(&self, host: usize) -> &[usize] {
        &self.peers.ranks_of_host[host]
    }

    /// The most ranks any one host of the group has.
    pub fn max_ranks_per_host(&self) -> usize {
        self.peers.ranks_of_host.iter().map(Vec::len).max().unwrap_or(1)
    }

    /// Every host's leader (its lowest rank), in order.
    pub fn leaders(&self) -> impl Iterator<Item = usize> + '_ {
        self.peers.ranks_of_host.iter().map(|ranks| ranks[0])
    }

    /// A barrier among the ranks of this host only.
    pub(crate) fn local_barrier(&self, channel: usize, timeout: Duration) -> Result<()> {
        let _g = lock(&self.peers.lock);
        let p = self.patience(timeout);
        let me = self.rank();
        let others: Vec<usize> = self.local_ranks().iter().copied().filter(|&r| r != me).collect();
        self.put_all(&others, channel, &p, "barrier", timeout)?;
        for &r in &others {
            self.wait(r, channel, &p, "barrier", timeout)?;
        }
        Ok(())
    }

    /// Raises signals at every rank of `dsts`: remote ones all in flight at once, then the
    /// local ones.
    fn put_all(&self, dsts: &[usize], channel: usize, p: &Patience, op: &str, timeout: Duration) -> Result<()> {
        let slot = channel * self.world_size() + self.rank();
        let remote: Vec<(&Remote, usize)> = if self.all_local() {
            Vec::new()
        } else {
            dsts.iter().filter_map(|&d| self.remote(d).map(|r| (r, slot))).collect()
        };
        if !remote.is_empty() {
            let what = |peer: usize| {
                format!(
                    "SymmetricMemory::{op}: rank {} of group {:?} to send a signal to rank {peer} on channel {channel}",
                    self.rank(),
                    self.peers.group
                )
            };
            remote::slot_puts(&remote, timeout, &what)?;
        }
        for &dst in dsts {
            if let Some(seg) = self.local(dst) {
                slot::put(seg.slot(slot), p)
                    .map_err(|f| self.signal_error(f, op, "send a signal to", dst, channel, timeout))?;
            }
        }
        Ok(())
    }

    fn wait(&self, src: usize, channel: usize, p: &Patience, op: &str, timeout: Duration) -> Result<()> {
        let slot = self.peers.own.slot(channel * self.world_size() + src);
        let Some(r) = self.remote(src) else {
            return slot::wait(slot, p)
                .map_err(|f| self.signal_error(f, op, "receive a signal from", src, channel, timeout));
        };
        // A peer on another host: wait in slices, watching its link between them, so a lost
        // host is reported at once rather than at the timeout. While it spins, this thread
        // applies the peer's signal itself once it has arrived (no hand-off to the link's
        // thread, then a wake-up, on the way).
        let serving = Serving { slot, link: &r.link.transport };
        loop {
            let slice = p.until(Instant::now() + crate::sync::MAX_NAP);
            match slot::wait(&serving, &slice) {
                Ok(()) => return Ok(()),
                Err(Failure::TimedOut) if Instant::now() < p.deadline() => {
                    if let Some(why) = r.link.lost() {
                        return Err(Error::transfer(
                            crate::error::TransferKind::PeerLost,
                            format!(
                                "SymmetricMemory::{op}: rank {} of group {:?} lost rank {src} on host {} while waiting \
                             for its signal on channel {channel}: {why}",
                                self.rank(),
                                self.peers.group,
                                r.link.host
                            ),
                        ));
                    }
                }
                Err(f) => return Err(self.signal_error(f, op, "receive a signal from", src, channel, timeout)),
            }
        }
    }

    /// After a timeout in a group that spans hosts: which ranks on other hosts no longer answer
    /// (a probe of one word each, all at once, for at most a second).
    #[cold]
    pub(crate) fn diagnose(&self) -> String {
        if self.all_local() {
            return String::new();
        }
        let remotes: Vec<&Remote> = (0..self.world_size()).filter_map(|r| self.remote(r)).collect();
        let lost = remote::unanswered(&remotes, Duration::from_secs(1));
        if lost.is_empty() {
            return "; every rank on other hosts still answers".into();
        }
        let hosts: std::collections::BTreeSet<&str> =
            lost.iter().filter_map(|&r| self.remote(r)).map(|r| r.link.host.as_str()).collect();
        format!(
            "; ranks {lost:?} on host(s) {} do not answer: lost or unreachable",
            hosts.into_iter().collect::<Vec<_>>().join(", ")
        )
    }

    #[cold]
    fn signal_error(&self, f: Failure, op: &str, verb: &str, peer: usize, channel: usize, t: Duration) -> Error {
        let host = self.remote(peer).map(|r| format!(" on host {}", r.link.host)).unwrap_or_default();
        match f {
            Failure::TimedOut => Error::timeout(
                format!(
                    "SymmetricMemory::{op}: rank {} of group {:?} to {verb} rank {peer}{host} on channel {channel}{}",
                    self.rank(),
                    self.peers.group,
                    self.diagnose()
                ),
                t,
            ),
            Failure::Corrupt(v) => Error::Corrupt(format!(
                "SymmetricMemory::{op}: signal slot of channel {channel} between ranks {} and {peer} holds {v}; \
                 something other than the signal protocol wrote into the pad",
                self.rank()
            )),
        }
    }
}

/// Copies `dst.numel()` elements from `peer`'s allocation behind `hdl`, starting `offset`
/// elements (of `dst`'s dtype) after the handle's offset, into `dst`. One-sided: `peer` takes
/// no part, on this host or another.
pub fn get(dst: &Tensor, hdl: &SymmHandle, peer: usize, offset: usize) -> Result<()> {
    get_bytes("get", dst, hdl, peer, offset, dst.nbytes())
}

fn get_bytes(op: &str, dst: &Tensor, hdl: &SymmHandle, peer: usize, offset: usize, len: usize) -> Result<()> {
    if !dst.is_contiguous() {
        return Err(Error::InvalidArgument(format!("{op}: dst must be contiguous")));
    }
    if peer >= hdl.world_size() {
        return Err(Error::InvalidArgument(format!("{op}: invalid peer {peer} (world size {})", hdl.world_size())));
    }
    if len > dst.nbytes() {
        return Err(Error::InvalidArgument(format!(
            "{op}: dst holds {} bytes, fewer than the {len} asked",
            dst.nbytes()
        )));
    }
    let es = dst.dtype().size();
    if !hdl.offset.is_multiple_of(es) {
        return Err(Error::InvalidArgument(format!("{op}: handle offset is not element-aligned")));
    }
    let start = offset.checked_mul(es).and_then(|o| o.checked_add(hdl.offset));
    let size = hdl.buffer_size();
    let Some(start) = start.filter(|s| s.checked_add(len).is_some_and(|end| end <= size)) else {
        let from = offset.saturating_mul(es).saturating_add(hdl.offset);
        return Err(Error::InvalidArgument(format!(
            "{op}: requested range [{from}, {}) exceeds symmetric allocation of {size} bytes",
            from.saturating_add(len)
        )));
    };
    match &hdl.peers.peers[peer] {
        Peer::Local(seg) => {
            // SAFETY: [start, start+len) lies inside the peer's data buffer (checked above),
            // which stays mapped while `hdl` lives; dst is contiguous with at least len bytes.
            // The two may overlap only if peer is this rank and dst views the same allocation,
            // hence `copy`.
            unsafe { std::ptr::copy(seg.data_ptr().add(start), dst.data_ptr(), len) };
            Ok(())
        }
        Peer::Remote(r) => {
            let t = crate::config::op_timeout();
            // dst registered for this one read (privately: it may be a symmetric tensor that
            // peers reach through a registration of its own, which must stay).
            let reg = r.link.transport.register_private(dst)?;
            let res = reg.to_mutable_view(0, Some(len)).and_then(|v| r.start_read_into(&v, start, len, t)?.wait(None));
            unregister_temporary(r, &reg);
            res.map_err(|e| r.link.error(&format!("{op}: reading from"), &e))
        }
    }
}

/// Drops a registration made for one transfer (`Transport::register_private`).
fn unregister_temporary(r: &Remote, reg: &Memory) {
    if let Err(e) = r.link.transport.unregister_memory(reg) {
        tracing::warn!("symmetric memory: unregistering a temporary registration: {e}");
    }
}

/// Checks a put of contiguous `src` to byte `at` of `peer`'s data buffer; its length.
fn check_put(op: &str, src: &Tensor, hdl: &SymmHandle, peer: usize, at: usize) -> Result<usize> {
    if !src.is_contiguous() {
        return Err(Error::InvalidArgument(format!("{op}: src must be contiguous")));
    }
    hdl.check_rank(peer).map_err(|_| {
        Error::InvalidArgument(format!("{op}: peer {peer} must be smaller than world size {}", hdl.world_size()))
    })?;
    let len = src.nbytes();
    if at.checked_add(len).is_none_or(|end| end > hdl.buffer_size()) {
        return Err(Error::InvalidArgument(format!(
            "{op}: {len} bytes at offset {at} exceed the symmetric allocation of {} bytes",
            hdl.buffer_size()
        )));
    }
    Ok(len)
}

/// Writes `len` bytes of contiguous `src` to byte `at` of `peer`'s data buffer and returns when
/// they have landed.
fn put_bytes(op: &str, src: &Tensor, hdl: &SymmHandle, peer: usize, at: usize) -> Result<()> {
    let len = check_put(op, src, hdl, peer, at)?;
    match &hdl.peers.peers[peer] {
        Peer::Local(seg) => {
            // SAFETY: the destination range lies inside the peer's buffer (checked above); src
            // is contiguous inside its storage; `copy` tolerates overlap.
            unsafe { std::ptr::copy(src.data_ptr(), seg.data_ptr().add(at), len) };
            Ok(())
        }
        Peer::Remote(r) => {
            let t = crate::config::op_timeout();
            // src registered for this one write, privately (as dst in `get_bytes`).
            let reg = r.link.transport.register_private(src)?;
            let res = reg.to_view(0, Some(len)).and_then(|v| r.start_write_from(&v, at, t)?.wait(None));
            unregister_temporary(r, &reg);
            res.map_err(|e| r.link.error(&format!("{op}: writing to"), &e))
        }
    }
}

/// Writes the `len` bytes of contiguous `src` (a put [`check_put`] passed) to byte `at` of the
/// data buffer of remote peer `r`, as posted writes that what `then` starts next on the link (a
/// signal) follows in the link's order, in one batch with it; returns once `src` may be reused
/// and `then`'s Work completed. A signal thus costs no round trip for the data's
/// acknowledgement: NVSHMEM's and OpenSHMEM's put-with-signal, whose blocking form returns once
/// the source may be reused.
fn post_bytes(
    op: &str,
    src: &Tensor,
    r: &Remote,
    (at, len): (usize, usize),
    then: impl FnOnce() -> Result<Option<Work>>,
) -> Result<()> {
    let t = crate::config::op_timeout();
    // src registered for these writes, privately (as in `put_bytes`); a write in flight keeps
    // its registration alive whatever happens here.
    let reg = r.link.transport.register_private(src)?;
    let started = r.link.transport.batch(|| -> Result<Vec<Work>> {
        let piece = |o: usize, n: usize| r.post_write_from(&reg.to_view(o, Some(n))?, at + o, t);
        let mut works = r.link.write_before_signal(len, piece)?;
        works.extend(then()?);
        Ok(works)
    });
    let res = started.and_then(|works| works.into_iter().try_for_each(|w| w.wait(None)));
    unregister_temporary(r, &reg);
    res.map_err(|e| r.link.error(&format!("{op}: writing to"), &e))
}

/// Copies contiguous `src` into `peer`'s allocation at the handle's offset, then raises a
/// signal at `peer` on channel 0: the peer's [`wait_signal`] returns after the data landed, and
/// so does this call (the signal is acknowledged). To a peer on another host the data leave
/// as posted writes the signal follows on the link, so the call costs one round trip.
pub fn put_signal(src: &Tensor, hdl: &SymmHandle, peer: usize) -> Result<()> {
    let len = check_put("put_signal", src, hdl, peer, hdl.offset)?;
    let t = crate::config::op_timeout();
    match hdl.remote(peer) {
        Some(r) => {
            // The data and the signal's first try leave together (one message, the signal after
            // the writes it vouches for); the try's answer says whether it landed or found the
            // slot still holding the previous signal, which the retries below then wait out.
            let _g = lock(&hdl.peers.lock);
            let deadline = crate::sync::deadline(t);
            let mut first = None;
            post_bytes("put_signal", src, r, (hdl.offset, len), || {
                first = Some(r.start_slot_put(hdl.rank(), t));
                Ok(None)
            })?;
            match first.map(|w| w.and_then(|w| w.wait(None))) {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) if !remote::is_busy(&e) => return Err(r.link.error("put_signal: signalling", &e)),
                _ => {}
            }
            // The retries get what is left of the call's timeout, not a fresh one.
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            hdl.put_all(&[peer], 0, &hdl.patience(left), "put_signal", left)
        }
        None => {
            put_bytes("put_signal", src, hdl, peer, hdl.offset)?;
            // Data first (a local copy), then the signal, whose Release CAS orders the copy
            // before the peer's Acquire in wait_signal. As in PyTorch, the caller must not
            // overwrite data the peer has not read: signals say "data is here", not "data was
            // consumed".
            let _g = lock(&hdl.peers.lock);
            hdl.put_all(&[peer], 0, &hdl.patience(t), "put_signal", t)
        }
    }
}

/// Waits (up to [`crate::config::op_timeout`]) for a signal from `peer` on channel 0, as raised by
/// [`put_signal`].
pub fn wait_signal(hdl: &SymmHandle, peer: usize) -> Result<()> {
    hdl.wait_signal(peer, 0, crate::config::op_timeout())
}

/// The one handle of a symmetric tensor: the group it was rendezvoused on, at its offset.
fn handle_of(op: &str, t: &Tensor) -> Result<Arc<SymmHandle>> {
    let Some((alloc, offset)) = allocation_of(t) else {
        return Err(Error::InvalidArgument(format!("{op}: the tensor is not in symmetric memory")));
    };
    let cache = lock(&alloc.cache);
    let mut found = cache.handles.iter().filter(|((_, o), _)| *o == offset).map(|(_, h)| h.clone());
    match (found.next(), found.next()) {
        (Some(h), None) => Ok(h),
        (None, _) => Err(Error::InvalidArgument(format!("{op}: rendezvous the tensor on a group first"))),
        (Some(_), Some(_)) => Err(Error::InvalidArgument(format!(
            "{op}: the tensor was rendezvoused on several groups; use the handle's get/put_signal instead"
        ))),
    }
}

/// NVSHMEM's host-initiated put: copies the whole of contiguous symmetric `tensor` into the
/// same symmetric tensor on `peer` (on this host or another). The bytes have landed when it
/// returns; the peer learns of them only through your synchronization
/// ([`nvshmem_put_with_signal`], a barrier).
pub fn nvshmem_put(tensor: &Tensor, peer: usize) -> Result<()> {
    let h = handle_of("nvshmem_put", tensor)?;
    put_bytes("nvshmem_put", tensor, &h, peer, h.offset)
}

/// NVSHMEM's host-initiated get: copies the same symmetric tensor on `peer` into `tensor`.
pub fn nvshmem_get(tensor: &Tensor, peer: usize) -> Result<()> {
    let h = handle_of("nvshmem_get", tensor)?;
    get_bytes("nvshmem_get", tensor, &h, peer, 0, tensor.nbytes())
}

/// Copies `size` elements (of `dst`'s dtype) starting `offset` elements after the handle's
/// offset in `peer`'s allocation into `dst` (which must hold `size` elements).
pub fn nvshmem_get_out(dst: &Tensor, hdl: &SymmHandle, offset: usize, size: usize, peer: usize) -> Result<()> {
    let len = size
        .checked_mul(dst.dtype().size())
        .ok_or_else(|| Error::InvalidArgument(format!("nvshmem_get_out: size {size} is too large")))?;
    get_bytes("nvshmem_get_out", dst, hdl, peer, offset, len)
}

/// Rendezvouses `x` on `group` and returns every rank's copy of it.
pub fn get_remote_tensors(x: &Tensor, group: &Group) -> Result<Vec<Tensor>> {
    let h = rendezvous(x, group)?;
    (0..h.world_size()).map(|r| h.get_remote_tensor(r, x.shape(), x.dtype())).collect()
}

/// The symmetric memory pool of `device`, created on first use.
pub fn get_mem_pool(device: Device) -> Result<Arc<MemPool>> {
    device.require_cpu("a symmetric memory pool")?;
    static POOL: std::sync::OnceLock<Arc<MemPool>> = std::sync::OnceLock::new();
    Ok(POOL.get_or_init(|| Arc::new(MemPool::new())).clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inode of the symmem memfd mapped at `addr`, if one is.
    fn memfd_at(addr: usize) -> Option<u64> {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().filter(|l| l.contains("memfd:symmem")).find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (lo, hi) = f[0].split_once('-')?;
            let (lo, hi) = (usize::from_str_radix(lo, 16).ok()?, usize::from_str_radix(hi, 16).ok()?);
            (lo..hi).contains(&addr).then(|| f[4].parse().ok())?
        })
    }

    /// Whether any mapping of this process is of inode `ino`.
    fn mapped(ino: u64) -> bool {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines().any(|l| l.contains("memfd:symmem") && l.split_whitespace().nth(4) == Some(&ino.to_string()))
    }

    #[test]
    fn a_segment_lives_exactly_as_long_as_its_tensors() {
        // Other tests map segments concurrently: follow this one by its inode.
        let t = empty(&[1 << 16], DType::U8, Device::Cpu).unwrap();
        let ino = memfd_at(t.data_ptr() as usize).expect("the tensor is in a symmem memfd");
        let view = t.narrow(0, 10, 100).unwrap();
        drop(t);
        assert!(mapped(ino), "a view keeps the segment");
        drop(view);
        assert!(!mapped(ino), "unmapped with the last view");
    }

    /// Every storage made of one segment (the allocation, a pool's slice of it, its pad, the
    /// segment a peer maps) reports the same sleepers count, the segment's own word after its
    /// header: a signal's store, wherever it comes from, skips its wake-up only when no thread
    /// of any process sleeps on the segment.
    #[test]
    fn every_view_of_a_segment_counts_its_sleepers_in_one_word() {
        let t = empty(&[256], DType::U8, Device::Cpu).unwrap();
        let (alloc, _) = allocation_of(&t).unwrap();
        let seg = &alloc.segment;
        let word = |s: &dyn Storage| s.sleepers().map(|c| c as *const AtomicU32);
        let own = Some(seg.sleepers() as *const AtomicU32);
        assert_eq!(word(alloc), own);
        assert_eq!(word(&**seg), own);
        assert_eq!(word(&Pad(seg.clone())), own);
        assert_eq!(word(&**t.storage()), own);
        // Outside the header, the pad and the data: filling both leaves it alone.
        let (at, pad, data) =
            (seg.sleepers() as *const AtomicU32 as usize, seg.pad_ptr() as usize, seg.data_ptr() as usize);
        assert!(at == pad - 64 && pad + seg.pad_size() <= data, "the count is the 64 bytes after the header");
        // A pool's slices count in their block's segment.
        let pool = std::sync::Arc::new(MemPool::new());
        let p = pool.empty(&[16], DType::F32).unwrap();
        let (block, _) = allocation_of(&p).unwrap();
        assert_eq!(word(&**p.storage()), Some(block.segment.sleepers() as *const AtomicU32));
        assert_ne!(word(&**p.storage()), own);
        // A thread sleeping on a word of the segment is counted there while it sleeps.
        let w = alloc.segment.slot(0);
        std::thread::scope(|s| {
            let sleeper = s.spawn(|| crate::sync::sleep_on(w, 0, Duration::from_secs(20), Some(seg.sleepers())));
            let t0 = std::time::Instant::now();
            while seg.sleepers().load(Ordering::SeqCst) == 0 {
                assert!(t0.elapsed() < Duration::from_secs(10), "the sleeper was never counted");
                std::thread::yield_now();
            }
            w.store(1, Ordering::Release);
            crate::sync::wake_word(w, Some(seg.sleepers()));
            sleeper.join().unwrap();
            assert!(t0.elapsed() < Duration::from_secs(10), "the sleeper was not woken");
        });
        assert_eq!(seg.sleepers().load(Ordering::SeqCst), 0);
    }

    /// A link that delivers nothing by itself: a peer's signal lands only when a caller serves
    /// it (`serve_arrived`), as over tcp or ucx a waiting caller applies what has arrived.
    struct ServedOnly {
        slot: Arc<AtomicU32>,
        serves: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl crate::transport::Backend for ServedOnly {
        fn name(&self) -> &str {
            "served-only"
        }
        fn caps(&self) -> crate::transport::Caps {
            crate::transport::tcp::CAPS
        }
        fn bind(&self, _: Duration) -> Result<Vec<u8>> {
            Ok(Vec::new())
        }
        fn connect(&self, _: &[u8], _: Duration) -> Result<()> {
            Ok(())
        }
        fn connected(&self) -> bool {
            true
        }
        fn expose(&self, _: &Arc<crate::transport::Registration>) -> Result<()> {
            Ok(())
        }
        fn withdraw(&self, _: &crate::transport::Registration) {}
        fn submit(&self, _: crate::transport::Request) -> Result<()> {
            Err(Error::InvalidArgument("nothing to submit".into()))
        }
        fn serve_arrived(&self) {
            // The peer's put has arrived by the third look: applied as the owner applies one.
            if self.serves.fetch_add(1, Ordering::SeqCst) == 2 {
                slot::put(&*self.slot, &Patience::once()).unwrap();
            }
        }
        fn shutdown(&self) {}
        fn default_timeout(&self) -> Duration {
            Duration::from_secs(5)
        }
    }

    /// A rank waiting for a signal from another host applies the peer's put itself while it
    /// spins (no hand-off to the link's thread, then a wake-up): with a link that delivers only
    /// to a serving caller, the wait ends, the signal consumed.
    #[test]
    fn a_wait_for_a_remote_signal_serves_the_link_itself() {
        let (slot_word, serves) = (Arc::new(AtomicU32::new(0)), Arc::new(std::sync::atomic::AtomicUsize::new(0)));
        let backend = ServedOnly { slot: slot_word.clone(), serves: serves.clone() };
        let link = crate::transport::Transport::new(Box::new(backend), None);
        let serving = Serving { slot: &slot_word, link: &link };
        let p = Patience::with(Duration::from_millis(1), Duration::from_millis(1), Duration::from_secs(5));
        let t = Instant::now();
        assert_eq!(slot::wait(&serving, &p), Ok(()));
        assert!(t.elapsed() < Duration::from_secs(4), "the wait ended only at its deadline");
        assert!(serves.load(Ordering::SeqCst) >= 3);
        assert_eq!(slot_word.load(Ordering::SeqCst), slot::EMPTY, "the signal was consumed");
    }

    #[test]
    fn gpu_devices_and_backends_are_refused_clearly() {
        let err = empty(&[4], DType::F32, Device::Cuda(0)).unwrap_err().to_string();
        assert!(err.contains("unsupported on this device") && err.contains("CUDA"), "{err}");
        assert_eq!(Device::parse("cuda:1").unwrap(), Device::Cuda(1));
        assert!(Device::parse("tpu").is_err());
        assert_eq!(get_backend(Device::Cuda(0)), None);
        assert!(set_backend("cpu").is_ok());
        assert!(matches!(set_backend("NCCL"), Err(Error::Unsupported { .. })));
        assert!(set_signal_pad_size(3).is_err());
    }
}
