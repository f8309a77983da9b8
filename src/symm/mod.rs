//! Symmetric memory on one host: every rank allocates the same buffer, [`rendezvous`] maps every
//! peer's, and signal pads synchronize them (`spec/symmetric-memory.md`).
//!
//! ```text
//!   empty(shape, dtype)  ──▶ a tensor over a new shared segment [header | pad | data]
//!   rendezvous(t, group) ──▶ collective the first time per (allocation, group): ranks publish
//!                            where their segment is, check they agree (step, shape, dtype,
//!                            host), map each other's, confirm; later calls hit the cache
//!   handle               ──▶ buffer_ptrs, signal pads, barrier / put_signal / wait_signal,
//!                            views of peers' buffers
//! ```
//!
//! Checks PyTorch does not make: ranks that allocate or rendezvous out of order, with other
//! shapes or dtypes, get an error naming both ranks and both shapes, on every rank, instead of
//! a hang or silent corruption; a rank that never arrives gives a timeout naming it.
//!
//! Layer: uses `group` (rendezvous through its store), `tensor`, `sys` and `wire`.

mod pool;
mod segment;
pub(crate) mod signal;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::group::Group;
use crate::tensor::{DType, Storage, Tensor};
use crate::wire::symm::{PeerRecord, RECORD_VERSION};
pub use pool::MemPool;
use segment::{Pad, Segment};
use signal::{Failure, Patience};

/// The name of the CPU shared-memory backend.
pub const BACKEND: &str = "CPU";

/// PyTorch's default signal pad: 32 channels × 72 ranks × 4 bytes.
pub const DEFAULT_SIGNAL_PAD_SIZE: usize = 9216;

/// The environment variable that sets how long signal waits spin before sleeping (µs).
pub const SPIN_ENV: &str = "SYMMEM_SPIN_US";

/// Default spin before sleeping: longer than a futex wake (about 30 µs here), so the common
/// case never sleeps.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);

/// A device tensors can live on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device (no backend yet).
    Cuda(usize),
}

impl Device {
    /// Parses `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> Result<Device> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| Error::InvalidArgument(format!("unknown device {s:?} (expected cpu or cuda[:N])"))),
        }
    }

    fn require_cpu(self, what: &str) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(n) => Err(Error::Unsupported {
                what: format!("{what} on cuda:{n}"),
                needs: "a CUDA device and symmem's CUDA backend; this build has the CPU backend only".into(),
            }),
        }
    }
}

/// Process-wide settings and bookkeeping.
struct Globals {
    signal_pad_size: usize,
    allocated: bool,
    /// Rendezvous steps taken per group name: keys never depend on other groups' activity.
    steps: HashMap<String, u64>,
    /// One lock per group: signal-pad operations of a group are serialized across threads.
    locks: HashMap<String, Arc<Mutex<()>>>,
}

fn globals() -> MutexGuard<'static, Globals> {
    static G: std::sync::LazyLock<Mutex<Globals>> = std::sync::LazyLock::new(|| {
        Mutex::new(Globals {
            signal_pad_size: DEFAULT_SIGNAL_PAD_SIZE,
            allocated: false,
            steps: HashMap::new(),
            locks: HashMap::new(),
        })
    });
    // The bookkeeping stays consistent even if a holder panicked.
    G.lock().unwrap_or_else(|p| p.into_inner())
}

/// The CPUs this process may use. Cached: `available_parallelism` reads cgroup files, far too
/// slow for the signal path.
pub(crate) fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        std::env::var(SPIN_ENV)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map_or(DEFAULT_SPIN, Duration::from_micros)
    })
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

/// Sets the signal pad size of future allocations, in bytes (a positive multiple of 4). An
/// error once anything has been allocated, since ranks must agree on it.
pub fn set_signal_pad_size(size: usize) -> Result<()> {
    if size == 0 || !size.is_multiple_of(4) {
        return Err(Error::InvalidArgument(format!("signal pad size {size} must be a positive multiple of 4 bytes")));
    }
    let mut g = globals();
    if g.allocated && g.signal_pad_size != size {
        return Err(Error::InvalidArgument(format!(
            "signal pad size cannot change after the first symmetric allocation (it is {} bytes)",
            g.signal_pad_size
        )));
    }
    g.signal_pad_size = size;
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
    /// Peer mappings per group name.
    peers: Mutex<HashMap<String, Arc<PeerSet>>>,
    /// Handles per (group name, byte offset).
    handles: Mutex<HashMap<(String, usize), Arc<SymmHandle>>>,
}

impl Allocation {
    fn new(data_size: usize) -> Result<Allocation> {
        let pad = {
            let mut g = globals();
            g.allocated = true;
            g.signal_pad_size
        };
        Ok(Allocation {
            segment: Arc::new(Segment::create(pad, data_size)?),
            peers: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
        })
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
    fn as_symm(&self) -> Option<(&Allocation, usize)> {
        Some((self, 0))
    }
    fn shared_file(&self) -> Option<(i32, u64)> {
        self.segment.shared_file()
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
    let numel = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .and_then(|n| n.checked_mul(dtype.size()))
        .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} of {dtype} is too large")))?;
    let alloc: Arc<dyn Storage> = Arc::new(Allocation::new(numel)?);
    Ok(Tensor::from_storage(alloc, shape, dtype))
}

/// Whether `t` lives in symmetric memory (O(1), not collective).
pub fn is_symm_mem_tensor(t: &Tensor) -> bool {
    t.storage().as_symm().is_some()
}

/// The peers of one allocation in one group: their mapped segments.
#[derive(Debug)]
struct PeerSet {
    rank: usize,
    world_size: usize,
    group: String,
    segments: Vec<Arc<Segment>>,
    lock: Arc<Mutex<()>>,
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
    let Some((alloc, base)) = tensor.storage().as_symm() else {
        return Err(Error::InvalidArgument(
            "rendezvous: the tensor is not inside a symmetric allocation; allocate it with symm::empty or a MemPool"
                .into(),
        ));
    };
    let offset = base + tensor.storage_offset() * tensor.dtype().size();
    // The hot path (every operator rendezvouses its input): find the cached handle without
    // allocating a key.
    if let Some(h) =
        lock(&alloc.handles).iter().find(|((g, o), _)| *o == offset && g == group.name()).map(|(_, h)| h.clone())
    {
        return Ok(h);
    }
    let key = (group.name().to_string(), offset);
    let cached = lock(&alloc.peers).get(group.name()).cloned();
    let peers = match cached {
        Some(p) => p,
        None => {
            let p = Arc::new(exchange(alloc, tensor, offset, group)?);
            lock(&alloc.peers).insert(group.name().to_string(), p.clone());
            p
        }
    };
    let h = Arc::new(SymmHandle { peers, offset });
    lock(&alloc.handles).insert(key, h.clone());
    Ok(h)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The environment variable that overrides which host this rank is on (see [`this_host`]).
pub const HOST_ID_ENV: &str = "SYMMEM_HOST_ID";

/// This host's identity: ranks with the same identity map each other's memory. By default the
/// hostname and the kernel's boot id; `SYMMEM_HOST_ID` overrides it (for hosts whose names
/// collide, or to make one machine play several hosts).
pub(crate) fn this_host() -> String {
    if let Ok(id) = std::env::var(HOST_ID_ENV)
        && !id.is_empty()
    {
        return id;
    }
    let name = rustix::system::uname().nodename().to_string_lossy().into_owned();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{name}/{}", boot.trim())
}

fn describe(r: &PeerRecord) -> String {
    let dtype = DType::from_code(r.dtype).map_or_else(|| format!("dtype#{}", r.dtype), |d| d.to_string());
    format!("{:?} {dtype} ({} bytes at offset {}, pad {} bytes)", r.shape, r.buffer_size, r.offset, r.pad_size)
}

fn exchange(alloc: &Allocation, tensor: &Tensor, offset: usize, group: &Group) -> Result<PeerSet> {
    let (rank, ws, name) = (group.rank(), group.world_size(), group.name().to_string());
    let step = {
        let mut g = globals();
        let s = g.steps.entry(name.clone()).or_insert(0);
        *s += 1;
        *s
    };
    let me = PeerRecord {
        version: RECORD_VERSION,
        host: this_host(),
        pid: std::process::id(),
        fd: alloc.segment.fd_number(),
        segment_len: alloc.segment.len() as u64,
        pad_size: alloc.segment.pad_size() as u64,
        buffer_size: alloc.segment.data_size() as u64,
        shape: tensor.shape().iter().map(|&d| d as u64).collect(),
        dtype: tensor.dtype().code(),
        offset: offset as u64,
    };
    let raw = group.all_gather_bytes(&format!("symm/{step}"), &me.encode()).map_err(|e| match e {
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
    if let Some((r, rec)) = records.iter().enumerate().find(|(_, rec)| rec.host != records[0].host) {
        return Err(Error::Rendezvous(format!(
            "rank {r} of group {name:?} is on host {} and rank 0 on {}: peers on other hosts are not reachable \
             through shared memory (symmetric memory across hosts is not supported yet)",
            rec.host, records[0].host
        )));
    }

    let mut segments = Vec::with_capacity(ws);
    let mut failure = String::new();
    for (r, rec) in records.iter().enumerate() {
        if r == rank {
            segments.push(alloc.segment.clone());
            continue;
        }
        match Segment::open(r, rec) {
            Ok(s) => segments.push(Arc::new(s)),
            Err(e) => {
                failure = format!("rank {rank} could not map rank {r}'s segment: {e}");
                break;
            }
        }
    }
    // Confirm: nobody returns (and may free its segment) before everyone has mapped, and a
    // failure on one rank becomes an error on all.
    let verdicts = group.all_gather_bytes(&format!("symm/{step}/mapped"), failure.as_bytes())?;
    if let Some(v) = verdicts.iter().find(|v| !v.is_empty()) {
        return Err(Error::Rendezvous(String::from_utf8_lossy(v).into_owned()));
    }
    let lock = globals().locks.entry(name.clone()).or_default().clone();
    Ok(PeerSet { rank, world_size: ws, group: name, segments, lock })
}

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

    /// The address of `rank`'s data buffer in this process (no allocation; panics if `rank`
    /// is out of range).
    pub fn buffer_ptr(&self, rank: usize) -> usize {
        self.peers.segments[rank].data_ptr() as usize
    }

    /// The address of every rank's data buffer, in this process's address space.
    pub fn buffer_ptrs(&self) -> Vec<usize> {
        self.peers.segments.iter().map(|s| s.data_ptr() as usize).collect()
    }

    /// The address of every rank's signal pad, in this process's address space.
    pub fn signal_pad_ptrs(&self) -> Vec<usize> {
        self.peers.segments.iter().map(|s| s.pad_ptr() as usize).collect()
    }

    /// The size of the whole data buffer of the allocation, in bytes.
    pub fn buffer_size(&self) -> usize {
        self.peers.segments[self.rank()].data_size()
    }

    /// The size of each signal pad, in bytes.
    pub fn signal_pad_size(&self) -> usize {
        self.peers.segments[self.rank()].pad_size()
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

    /// A view of `rank`'s data buffer, `storage_offset` elements in.
    pub fn get_buffer(&self, rank: usize, sizes: &[usize], dtype: DType, storage_offset: usize) -> Result<Tensor> {
        self.check_rank(rank)?;
        let seg = &self.peers.segments[rank];
        let numel: usize = sizes.iter().product();
        let start = storage_offset * dtype.size();
        let end = start + numel * dtype.size();
        if end > seg.data_size() {
            return Err(Error::InvalidArgument(format!(
                "SymmetricMemory::get_buffer: the requested size ({end} bytes) exceeds the allocated size ({} bytes)",
                seg.data_size()
            )));
        }
        let strides = contiguous(sizes);
        Tensor::view_of(seg.clone(), sizes, &strides, storage_offset, dtype)
    }

    /// A view of `peer`'s copy of the rendezvoused tensor (at this handle's offset).
    pub fn get_remote_tensor(&self, peer: usize, sizes: &[usize], dtype: DType) -> Result<Tensor> {
        if !self.offset.is_multiple_of(dtype.size()) {
            return Err(Error::InvalidArgument(format!(
                "get_remote_tensor: handle offset {} is not aligned to {dtype}",
                self.offset
            )));
        }
        self.get_buffer(peer, sizes, dtype, self.offset / dtype.size())
    }

    /// A `u32` view of `rank`'s signal pad.
    pub fn get_signal_pad(&self, rank: usize) -> Result<Tensor> {
        self.check_rank(rank)?;
        let seg = self.peers.segments[rank].clone();
        let n = seg.pad_size() / 4;
        Ok(Tensor::from_storage(Arc::new(Pad(seg)), &[n], DType::U32))
    }

    fn patience(&self, timeout: Duration) -> Patience {
        // When ranks outnumber cores, spinning only steals time from the rank being waited for:
        // yield the core to it instead, and sleep only after that.
        let (spin, yield_for) = if self.world_size() > cores() {
            (Duration::ZERO, Duration::from_millis(2))
        } else {
            (spin(), Duration::from_micros(100))
        };
        Patience { spin, yield_for, deadline: Instant::now() + timeout }
    }

    /// Raises a signal at `dst_rank` on `channel`; blocks while the previous signal on that
    /// slot is unconsumed, at most `timeout`.
    pub fn put_signal(&self, dst_rank: usize, channel: usize, timeout: Duration) -> Result<()> {
        self.check_rank(dst_rank)?;
        self.check_channel(channel)?;
        let _g = lock(&self.peers.lock);
        self.put(dst_rank, channel, &self.patience(timeout), "put_signal", timeout)
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
        let (me, ws) = (self.rank(), self.world_size());
        for k in 1..ws {
            self.put((me + k) % ws, channel, &p, "barrier", timeout)?;
        }
        for k in 1..ws {
            self.wait((me + ws - k) % ws, channel, &p, "barrier", timeout)?;
        }
        Ok(())
    }

    fn put(&self, dst: usize, channel: usize, p: &Patience, op: &str, timeout: Duration) -> Result<()> {
        let slot = self.peers.segments[dst].slot(channel * self.world_size() + self.rank());
        signal::put(slot, p).map_err(|f| self.signal_error(f, op, "send a signal to", dst, channel, timeout))
    }

    fn wait(&self, src: usize, channel: usize, p: &Patience, op: &str, timeout: Duration) -> Result<()> {
        let slot = self.peers.segments[self.rank()].slot(channel * self.world_size() + src);
        signal::wait(slot, p).map_err(|f| self.signal_error(f, op, "receive a signal from", src, channel, timeout))
    }

    #[cold]
    fn signal_error(&self, f: Failure, op: &str, verb: &str, peer: usize, channel: usize, t: Duration) -> Error {
        match f {
            Failure::TimedOut => Error::timeout(
                format!(
                    "SymmetricMemory::{op}: rank {} of group {:?} to {verb} rank {peer} on channel {channel}",
                    self.rank(),
                    self.peers.group
                ),
                t,
            ),
            Failure::Corrupt(v) => Error::Rendezvous(format!(
                "SymmetricMemory::{op}: signal slot of channel {channel} between ranks {} and {peer} holds {v}; \
                 something other than the signal protocol wrote into the pad",
                self.rank()
            )),
        }
    }
}

fn contiguous(sizes: &[usize]) -> Vec<usize> {
    let mut s = vec![1; sizes.len()];
    for i in (0..sizes.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * sizes[i + 1];
    }
    s
}

/// The default timeout of module-level signal operations.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Copies `dst.numel()` elements from `peer`'s allocation behind `hdl`, starting `offset`
/// elements (of `dst`'s dtype) after the handle's offset, into `dst`. One-sided: `peer` takes
/// no part.
pub fn get(dst: &Tensor, hdl: &SymmHandle, peer: usize, offset: usize) -> Result<()> {
    if !dst.is_contiguous() {
        return Err(Error::InvalidArgument("get: dst must be contiguous".into()));
    }
    if peer >= hdl.world_size() {
        return Err(Error::InvalidArgument(format!("get: invalid peer {peer} (world size {})", hdl.world_size())));
    }
    let es = dst.dtype().size();
    if !hdl.offset.is_multiple_of(es) {
        return Err(Error::InvalidArgument("get: handle offset is not element-aligned".into()));
    }
    let start = hdl.offset + offset * es;
    let end = start + dst.nbytes();
    let seg = &hdl.peers.segments[peer];
    if start > seg.data_size() || end > seg.data_size() {
        return Err(Error::InvalidArgument(format!(
            "get: requested range [{start}, {end}) exceeds symmetric allocation of {} bytes",
            seg.data_size()
        )));
    }
    // SAFETY: [start, end) lies inside the peer's data buffer (checked above), which stays
    // mapped while `hdl` lives; dst is contiguous with nbytes bytes inside its storage. The two
    // may overlap only if peer is this rank and dst views the same allocation, hence `copy`.
    unsafe { std::ptr::copy(seg.data_ptr().add(start), dst.data_ptr(), dst.nbytes()) };
    Ok(())
}

/// Copies contiguous `src` into `peer`'s allocation at the handle's offset, then raises a
/// signal at `peer` on channel 0: the peer's [`wait_signal`] returns after the data landed.
pub fn put_signal(src: &Tensor, hdl: &SymmHandle, peer: usize) -> Result<()> {
    if !src.is_contiguous() {
        return Err(Error::InvalidArgument("put_signal: src must be contiguous".into()));
    }
    hdl.check_rank(peer)
        .map_err(|_| Error::InvalidArgument("put_signal: peer must be smaller than world size".into()))?;
    let seg = &hdl.peers.segments[peer];
    let end = hdl.offset + src.nbytes();
    if end > seg.data_size() {
        return Err(Error::InvalidArgument(format!(
            "put_signal: {} bytes at offset {} exceed the symmetric allocation of {} bytes",
            src.nbytes(),
            hdl.offset,
            seg.data_size()
        )));
    }
    let _g = lock(&hdl.peers.lock);
    let p = hdl.patience(DEFAULT_TIMEOUT);
    // Data first, then the signal, whose Release CAS orders the copy before the peer's Acquire
    // in wait_signal. As in PyTorch, the caller must not overwrite data the peer has not read:
    // signals say "data is here", not "data was consumed".
    // SAFETY: the destination range lies inside the peer's buffer (checked above); src is
    // contiguous inside its storage; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src.data_ptr(), seg.data_ptr().add(hdl.offset), src.nbytes()) };
    hdl.put(peer, 0, &p, "put_signal", DEFAULT_TIMEOUT)
}

/// Waits (up to [`DEFAULT_TIMEOUT`]) for a signal from `peer` on channel 0, as raised by
/// [`put_signal`].
pub fn wait_signal(hdl: &SymmHandle, peer: usize) -> Result<()> {
    hdl.wait_signal(peer, 0, DEFAULT_TIMEOUT)
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

    fn symmem_mappings() -> usize {
        std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("memfd:symmem")).count()
    }

    #[test]
    fn a_segment_lives_exactly_as_long_as_its_tensors() {
        let before = symmem_mappings();
        let t = empty(&[1 << 16], DType::U8, Device::Cpu).unwrap();
        let view = t.narrow(0, 10, 100).unwrap();
        assert_eq!(symmem_mappings(), before + 1);
        drop(t);
        assert_eq!(symmem_mappings(), before + 1, "a view keeps the segment");
        drop(view);
        assert_eq!(symmem_mappings(), before, "unmapped with the last view");
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
