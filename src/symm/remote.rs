//! Peers on other hosts: reached through `tcp` transport links, the way NVSHMEM reaches other
//! nodes over RDMA.
//!
//! ```text
//!   group spans hosts ──▶ one tcp link per (rank, remote peer), made once per group:
//!                         every rank binds all its links, publishes their URLs in the group's
//!                         store, then connects them (no ordering between pairs, no deadlock)
//!   each allocation   ──▶ its signal pad and data buffer are registered on every link; the
//!                         descriptors travel in the rendezvous's confirm step
//!   data              ──▶ one-sided reads and writes of the peer's data buffer
//!   signals           ──▶ a remote atomic: the peer's transport thread performs the signal
//!                         protocol's put on the slot (and wakes a sleeping waiter)
//! ```
//!
//! Ordering: a signal follows the writes before it on one link either in the link's own order
//! (writes up to the backend's `in_order_up_to`, started by one thread: tcp's flow 0, ucx's
//! ordered requests; the operators' posted writes are then not even acknowledged) or after
//! they were acknowledged, so the peer sees the signal only after the data landed. Waiting
//! for a remote peer's signal watches its link: a peer whose link breaks is named in the
//! error at once, not at the timeout.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::group::Group;
use crate::sys::shm::{self, Mapping};
use crate::tensor::{DType, Storage, Tensor};
use crate::transport::{self, Atomic, Memory, Options, Reach, RemoteBuffer, Transport, Work, new_transport};

/// Above this many bytes, a message a signal follows goes as one striped write (every flow of
/// the link) that is waited for before the signal; below, as in-order pieces on one flow that
/// the signal can follow at once ([`Link::write_before_signal`]). A 1 MiB message goes in
/// pieces: striped, the two ranks of a 1 MiB all-reduce between two played hosts (tcp) each
/// kept 4 sender and 4 serving threads busy on 2 cores and waited for an acknowledgement before
/// signalling, 428-719 us in 5 alternated runs against 284-617 in pieces (median 630 vs 375).
pub(crate) const STRIPED: usize = 1 << 20;

/// Over ucx links, a read into a rank's own output (`SymmHandle::fetch_into`, the pulled
/// all-to-all) larger than this goes as pieces of this size, all in flight (a read is a
/// request the owner answers with UCX's rendezvous; pieces overlap their round trips): 4 ranks
/// on 2 played hosts over UCX's tcp, all-to-all of 4 MiB / 16 MiB per rank (its blocks of 1 / 4
/// MiB pulled), bench/ab_builds.py 4 both ways round, 0.85x and 0.83x / 0.92x and 0.76x of the
/// time as one read each (pieces of 256 KiB: 0.81-0.86x / 1.01-1.06x; of 1 MiB at 16 MiB: 0.90x
/// both ways). Two-shot's reads into the host's mirrors stay whole: in pieces, the 2-rank
/// all-reduce of 4 MiB took 1.11-1.12x the time.
pub(crate) const UCX_READ_PIECE: usize = 512 << 10;

/// `(offset, length)` of the pieces of at most `piece` bytes that `len` bytes are cut into.
pub(crate) fn pieces(len: usize, piece: usize) -> impl Iterator<Item = (usize, usize)> {
    let piece = piece.max(1);
    (0..len).step_by(piece).map(move |o| (o, piece.min(len - o)))
}

/// A connection from this rank to one rank on another host.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) peer: usize,
    pub(crate) host: String,
    pub(crate) transport: Transport,
    /// A registered 8-byte word: the local side of remote atomics (it carries no data).
    scratch: Memory,
}

impl Link {
    /// Why the link is down, if it is.
    pub(crate) fn lost(&self) -> Option<String> {
        (!self.transport.connected()).then(|| {
            self.transport.disconnect_reason().unwrap_or_else(|| format!("{} link closed", self.transport.describe()))
        })
    }

    /// The error for a failed transfer to this link's peer.
    pub(crate) fn error(&self, what: &str, e: &Error) -> Error {
        e.as_transfer(format!("{what} rank {} on host {}: {e}", self.peer, self.host))
    }

    /// Transfers of at most this many bytes on this link take effect in the order started
    /// (its backend's [`crate::transport::Caps::in_order_up_to`]).
    pub(crate) fn in_order_up_to(&self) -> usize {
        self.transport.caps().in_order_up_to
    }

    /// The largest read this link is given at once ([`UCX_READ_PIECE`] over ucx; tcp stripes
    /// a large read over its flows itself).
    pub(crate) fn read_piece(&self) -> usize {
        if self.transport.backend_name() == "ucx" { UCX_READ_PIECE } else { usize::MAX }
    }

    /// Starts writing a message of `len` bytes so that the remote atomic this thread starts
    /// next on the link lands after it, each piece started by `push(at, n)` (a posted write of
    /// the `n` bytes at `at` of the message); returns the writes still in flight. Up to
    /// [`STRIPED`] bytes the pieces are at most [`Link::in_order_up_to`] each, which the link
    /// keeps in order with what follows (the signal can leave at once); a larger message goes
    /// as one write, striped over the link's flows, that is waited for here.
    pub(crate) fn write_before_signal(
        &self,
        len: usize,
        push: impl Fn(usize, usize) -> Result<Work>,
    ) -> Result<Vec<Work>> {
        let in_order = self.in_order_up_to();
        if len > STRIPED || in_order == 0 {
            push(0, len)?.wait(None)?;
            return Ok(Vec::new());
        }
        (0..len).step_by(in_order).map(|at| push(at, in_order.min(len - at))).collect()
    }

    /// Starts a remote atomic on the word at the start of `remote` (`posted`: see
    /// `Transport::start_atomic`).
    fn start_atomic(
        &self,
        remote: &RemoteBuffer,
        op: Atomic,
        operand: u64,
        timeout: Duration,
        posted: bool,
    ) -> Result<Work> {
        let scratch = self.scratch.to_view(0, Some(op.width() as usize))?;
        self.transport.start_atomic(&scratch, remote, op, operand, Some(timeout), posted)
    }
}

impl Drop for Link {
    /// A group's links close with the group: first the transfers still in flight (the last
    /// signal of a barrier, which the peer may still be waiting for) drain, at most a few
    /// seconds, so a peer never takes this rank's orderly exit for a lost host.
    fn drop(&mut self) {
        if let Err(e) = self.transport.close(Some(Duration::from_secs(5))) {
            tracing::warn!("closing the link to rank {} on host {}: {e}", self.peer, self.host);
        }
    }
}

/// The links of one group: peer rank → link.
pub(crate) type Links = HashMap<usize, Arc<Link>>;

/// How long link bootstrap may take, and the links' transfer timeout.
fn link_timeout() -> Duration {
    crate::config::op_timeout()
}

/// The backend of links between hosts, and whether the user chose it: `SYMMEM_XHOST_BACKEND`
/// if set, else the first built-in that symmem may pick by itself here with what links need
/// (remote atomics, any host): ucx over an RDMA fabric, tcp otherwise.
fn link_backend() -> Result<(String, bool)> {
    // Links signal peers with remote atomics, and cross hosts.
    let fits = |c: &transport::Caps| c.remote_atomics && c.reach == Reach::AnyHost;
    match crate::config::xhost_backend() {
        Some(name) => match transport::caps_of(&name) {
            Some(c) if fits(&c) => Ok((name, true)),
            _ => Err(Error::InvalidArgument(format!(
                "SYMMEM_XHOST_BACKEND={name:?} is not a backend that links hosts (tcp, ucx)"
            ))),
        },
        None => transport::pick(fits).map(|n| (n.to_string(), false)).ok_or_else(|| Error::Unsupported {
            what: "links between hosts".into(),
            needs: "a transport with remote atomics".into(),
        }),
    }
}

/// The backend every host can link with when two hosts picked differently by themselves (one
/// has a fabric the other lacks).
const COMMON: &str = "tcp";

/// The backend a link URL is for (`tcp://...` → `tcp`).
fn scheme(url: &str) -> &str {
    url.split_once("://").map_or("", |(s, _)| s)
}

/// What a rank does with a peer's link URL for `theirs`, having bound `mine` (`chosen`: by
/// `SYMMEM_XHOST_BACKEND`).
#[derive(Debug, PartialEq, Eq)]
enum Meet {
    /// Connect to it.
    Same,
    /// This rank cannot meet the peer: `SYMMEM_XHOST_BACKEND` chose this rank's backend, or
    /// neither is tcp.
    Refuse,
    /// Read the tcp endpoint the peer publishes besides, and connect to it.
    ReadCommon,
    /// Bind a tcp transport, publish it besides, and connect it to the peer's (tcp) URL.
    BindCommon,
}

fn meet(mine: &str, chosen: bool, theirs: &str) -> Meet {
    if mine == theirs {
        Meet::Same
    } else if mine == COMMON {
        Meet::ReadCommon
    } else if !chosen && theirs == COMMON {
        Meet::BindCommon
    } else {
        Meet::Refuse
    }
}

/// Connects this rank to each of `remote` (ranks of `group` on other hosts; `hosts[r]` names
/// rank r's host). Collective over the ranks of the group that have remote peers.
///
/// Each rank binds one transport per peer on its link backend, publishes their URLs in one
/// store request and reads its peers' in one (two round trips, whatever the peers). Where a
/// host picked ucx by itself (it has a fabric) and its peer's host tcp (it has none, or
/// `SYMMEM_XHOST_BACKEND=tcp` there), the pair meets on tcp: the ucx side binds a tcp
/// transport too and publishes it under `.../tcp`, which the tcp side reads (only that side
/// waits, and only for a key the other publishes without waiting).
pub(crate) fn connect(group: &Group, step: u64, remote: &[usize], hosts: &[String]) -> Result<Links> {
    let me = group.rank();
    let timeout = link_timeout();
    let mut common = Options::new();
    common.insert("timeout".into(), format!("{}", timeout.as_secs_f64()));
    let mut distinct: Vec<&String> = hosts.iter().collect();
    distinct.sort_unstable();
    distinct.dedup();
    // tcp's options (the common backend's) take its flows, unless the environment sets them
    // (read only for tcp: another backend never needs the variable); another backend takes
    // the timeout only.
    let opts = |backend: &str| -> Result<Options> {
        let mut o = common.clone();
        if backend == COMMON && crate::config::tcp_flows()?.is_none() {
            o.insert("flows".into(), tcp_link_flows(distinct.len()).to_string());
        }
        Ok(o)
    };
    let store = group.store();
    let (backend, chosen) = link_backend()?;
    let options = opts(&backend)?;
    // Every link's URL goes out in one request and every peer's comes back in one (a wait for
    // all of them, then their values): two store round trips per rank whatever the number of
    // peers, not two per peer.
    let mut bound = Vec::with_capacity(remote.len());
    let mut mine = Vec::with_capacity(remote.len());
    for &peer in remote {
        let t = new_transport(&backend, None, &options)?;
        let url = t.bind(Some(timeout))?;
        mine.push((format!("symm-net/{step}/{me}/{peer}"), url));
        bound.push((peer, t));
    }
    let pairs: Vec<(&str, &[u8])> = mine.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    store.multi_set(&pairs)?;
    let keys: Vec<String> = remote.iter().map(|peer| format!("symm-net/{step}/{peer}/{me}")).collect();
    let urls = store.multi_get_timeout(&keys.iter().map(String::as_str).collect::<Vec<_>>(), timeout).map_err(|e| {
        // Name the ranks whose links are missing: the wait ends at the first timeout, so ask
        // which keys exist (one more round trip, only on this error path).
        let missing: Vec<String> = remote
            .iter()
            .zip(&keys)
            .filter(|(_, k)| !store.check(&[k.as_str()]).unwrap_or(false))
            .map(|(&peer, _)| format!("rank {peer} on host {}", hosts[peer]))
            .collect();
        if missing.is_empty() {
            return Error::Rendezvous(format!("reading the links of ranks {remote:?} failed: {e}"));
        }
        Error::Rendezvous(format!("{} did not publish its link: {e}", missing.join(", ")))
    })?;
    let mut links = Links::new();
    for ((peer, mut transport), url) in bound.into_iter().zip(urls) {
        let theirs = scheme(&String::from_utf8_lossy(&url)).to_string();
        let url = match meet(&backend, chosen, &theirs) {
            Meet::Same => url,
            Meet::Refuse => {
                return Err(Error::Rendezvous(format!(
                    "rank {peer} on host {} links hosts over {theirs:?}, this rank over {backend:?} \
                     (SYMMEM_XHOST_BACKEND must be the same on every host)",
                    hosts[peer]
                )));
            }
            // The peer picked a fabric this host lacks; it publishes a tcp endpoint too.
            Meet::ReadCommon => {
                store.get_timeout(&format!("symm-net/{step}/{peer}/{me}/{COMMON}"), timeout).map_err(|e| {
                    Error::Rendezvous(format!("rank {peer} on host {} did not publish its tcp link: {e}", hosts[peer]))
                })?
            }
            // This host picked a fabric the peer lacks: meet it on tcp.
            Meet::BindCommon => {
                let t = new_transport(COMMON, None, &opts(COMMON)?)?;
                let mine = t.bind(Some(timeout))?;
                store.set(&format!("symm-net/{step}/{me}/{peer}/{COMMON}"), &mine)?;
                transport = t;
                url
            }
        };
        transport.connect(&url, Some(timeout)).map_err(|e| {
            Error::Rendezvous(format!("rank {me} could not connect to rank {peer} on host {}: {e}", hosts[peer]))
        })?;
        let word = Tensor::zeros(&[8], DType::U8)?;
        let scratch = transport.register_memory_read_only(&word)?;
        links.insert(peer, Arc::new(Link { peer, host: hosts[peer].clone(), transport, scratch }));
    }
    Ok(links)
}

/// The flows (connections, each served by its own threads at either end) of a tcp link in a
/// group that spans `hosts` hosts, unless `SYMMEM_TRANSPORT_TCP_FLOWS` says: 4 (the backend's
/// default) between two hosts, where a rank's large transfers all go to one host and striping
/// them spreads the work over cores; 4 / (hosts − 1) beyond, at least 1, so that a rank keeps
/// about four connections' worth of striping toward other hosts whatever their number. Each
/// flow costs three threads and three descriptors a link: at 8 played hosts of one rank, 93
/// threads a rank with 4 flows, 30 with 1. Times did not move with the flows from four hosts on
/// (tcp, `symmem bench all-reduce` 8 B / 64 KiB / 1 MiB and `all-to-all` 64 KiB / 1 MiB at 4 ×
/// 4, 8 × 8 and 16 × 8, flows 4, 1 and 2 alternated twice: every difference within the spread
/// between the two runs of one setting).
pub(crate) fn tcp_link_flows(hosts: usize) -> usize {
    (4 / hosts.saturating_sub(1).max(1)).max(1)
}

/// Deletes the link URLs this rank published at rendezvous `step`, once every peer has
/// connected: one store round trip.
pub(crate) fn forget(group: &Group, step: u64, remote: &[usize]) -> Result<()> {
    let me = group.rank();
    // A rank that picked another backend by itself may have published a tcp link besides.
    let besides = link_backend().is_ok_and(|(backend, chosen)| !chosen && backend != COMMON);
    let mut keys: Vec<String> = remote.iter().map(|peer| format!("symm-net/{step}/{me}/{peer}")).collect();
    if besides {
        keys.extend(remote.iter().map(|peer| format!("symm-net/{step}/{me}/{peer}/{COMMON}")));
    }
    group.store().delete_many(&keys.iter().map(String::as_str).collect::<Vec<_>>())?;
    Ok(())
}

/// A host's copy of one remote rank's data buffer: shared memory made by the host's leader
/// (its lowest rank) and mapped by every rank of the host, so that what one rank fetches
/// every rank of the host can read (same offsets as the remote buffer).
#[derive(Debug)]
pub(crate) struct Mirror {
    map: Mapping,
    /// The leader keeps its memfd open so the other ranks of the host can open it.
    fd: Option<OwnedFd>,
}

impl Mirror {
    /// A new mirror of `len` bytes (on the host's leader); memory is taken only for the ranges
    /// fetched into it.
    pub(crate) fn create(len: usize) -> Result<Mirror> {
        let len = len
            .max(1)
            .checked_next_multiple_of(4096)
            .ok_or_else(|| Error::Rendezvous(format!("a mirror of {len} bytes is too large")))?;
        let fd = shm::create_sparse("symmem-mirror", len)?;
        Ok(Mirror { map: Mapping::new(&fd, len)?, fd: Some(fd) })
    }

    /// Maps the leader's mirror (on the other ranks of the host).
    pub(crate) fn open(pid: u32, fd: i32, len: usize) -> Result<Mirror> {
        let fd = shm::open_peer(pid, fd)?;
        let size = shm::size(&fd)?;
        if size < len {
            return Err(Error::Rendezvous(format!("a shared mirror of {size} bytes cannot hold {len}")));
        }
        Ok(Mirror { map: Mapping::new(&fd, size)?, fd: None })
    }

    /// The leader's descriptor number, for the other ranks to open.
    pub(crate) fn fd_number(&self) -> i32 {
        self.fd.as_ref().map_or(-1, shm::raw)
    }
}

// SAFETY: the mapping lives (at a fixed address) as long as the Mirror.
unsafe impl Storage for Mirror {
    fn ptr(&self) -> *mut u8 {
        self.map.ptr()
    }
    fn len(&self) -> usize {
        self.map.len()
    }
}

/// One remote peer's copy of an allocation.
#[derive(Debug)]
pub(crate) struct Remote {
    pub(crate) link: Arc<Link>,
    /// The peer's signal pad and data buffer.
    pub(crate) pad: RemoteBuffer,
    pub(crate) data: RemoteBuffer,
    /// This host's shared copy of the peer's data buffer, into which operators fetch the parts
    /// they read; registered on this rank's link on first use.
    shared: Arc<Mirror>,
    mirror: OnceLock<(Tensor, Memory)>,
}

impl Remote {
    pub(crate) fn new(link: Arc<Link>, pad: RemoteBuffer, data: RemoteBuffer, shared: Arc<Mirror>) -> Remote {
        Remote { link, pad, data, shared, mirror: OnceLock::new() }
    }

    pub(crate) fn data_size(&self) -> usize {
        self.data.len() as usize
    }

    /// The mirror, registered on this rank's link on first use.
    pub(crate) fn mirror(&self) -> Result<&(Tensor, Memory)> {
        if let Some(m) = self.mirror.get() {
            return Ok(m);
        }
        let storage: Arc<dyn Storage> = self.shared.clone();
        let t = Tensor::from_storage(storage, &[self.data_size().max(1)], DType::U8);
        let m = self.link.transport.register_memory_read_only(&t)?;
        Ok(self.mirror.get_or_init(|| (t, m)))
    }

    /// Starts reading `[at, at + len)` of the peer's data buffer into the same range of the
    /// mirror.
    pub(crate) fn start_fetch(&self, at: usize, len: usize, timeout: Duration) -> Result<Work> {
        let (_, m) = self.mirror()?;
        let view = m.to_mutable_view(at, Some(len))?;
        self.link.transport.start_read(&view, &self.data.slice(at as u64, len as u64)?, Some(timeout))
    }

    /// Starts reading `[at, at + len)` of the peer's data buffer into `dst` (a view registered
    /// on this link).
    pub(crate) fn start_read_into(
        &self,
        dst: &crate::transport::MutableMemoryView,
        at: usize,
        len: usize,
        timeout: Duration,
    ) -> Result<Work> {
        self.link.transport.start_read(dst, &self.data.slice(at as u64, len as u64)?, Some(timeout))
    }

    /// Starts a posted write (`Transport::post_write`) of `src` (a view registered on this
    /// link) to `[at, ..)` of the peer's data buffer: what follows on the link lands after it.
    pub(crate) fn post_write_from(
        &self,
        src: &crate::transport::MemoryView,
        at: usize,
        timeout: Duration,
    ) -> Result<Work> {
        self.link.transport.post_write(src, &self.data.slice(at as u64, src.size() as u64)?, Some(timeout))
    }

    /// Starts writing `src` (a view registered on this link) to `[at, ..)` of the peer's data
    /// buffer.
    pub(crate) fn start_write_from(
        &self,
        src: &crate::transport::MemoryView,
        at: usize,
        timeout: Duration,
    ) -> Result<Work> {
        self.link.transport.start_write(src, &self.data.slice(at as u64, src.size() as u64)?, Some(timeout))
    }

    /// The address of this host's mirror (valid for the ranges fetched since the last barrier).
    pub(crate) fn mirror_ptr(&self) -> usize {
        self.shared.map.ptr() as usize
    }

    /// Starts a slot put on signal slot `slot` of the peer's pad.
    pub(crate) fn start_slot_put(&self, slot: usize, timeout: Duration) -> Result<Work> {
        let word = self.pad.slice(slot as u64 * 4, 4)?;
        self.link.start_atomic(&word, Atomic::SlotPut, 1, timeout, false)
    }

    /// Starts storing `value` (4 or 8 bytes wide) at byte `at` of the peer's signal pad (`pad`)
    /// or data buffer; `posted`: its Work may complete once sent (the peer learns of it by
    /// watching the word).
    pub(crate) fn start_set(
        &self,
        pad: bool,
        at: usize,
        width: usize,
        value: u64,
        timeout: Duration,
        posted: bool,
    ) -> Result<Work> {
        let op = if width == 8 { Atomic::Set64 } else { Atomic::Set32 };
        let region = if pad { &self.pad } else { &self.data };
        let word = region.slice(at as u64, width as u64)?;
        self.link.start_atomic(&word, op, value, timeout, posted)
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        if let Some((_, m)) = self.mirror.get()
            && let Err(e) = self.link.transport.unregister_memory(m)
        {
            tracing::warn!("symmetric memory: unregistering a mirror of rank {}: {e}", self.link.peer);
        }
    }
}

/// Whether a completed atomic failed only because the slot was busy.
pub(crate) fn is_busy(e: &Error) -> bool {
    e.transfer_kind() == Some(crate::error::TransferKind::Busy)
}

/// Raises signals on remote slots, retrying busy ones (the previous signal not yet consumed)
/// until `deadline`. `puts` holds (peer, slot) pairs; all are in flight at once.
pub(crate) fn slot_puts(puts: &[(&Remote, usize)], timeout: Duration, what: &dyn Fn(usize) -> String) -> Result<()> {
    let deadline = crate::sync::deadline(timeout);
    let mut todo: Vec<usize> = (0..puts.len()).collect();
    let mut backoff = crate::sync::Backoff::new(deadline);
    while !todo.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let works = todo
            .iter()
            .map(|&i| puts[i].0.start_slot_put(puts[i].1, left.max(Duration::from_millis(1))))
            .collect::<Vec<_>>();
        let mut busy = Vec::new();
        for (&i, w) in todo.iter().zip(works) {
            let r = puts[i].0;
            match w.and_then(|w| w.wait(None)) {
                Ok(()) => {}
                Err(e) if is_busy(&e) => busy.push(i),
                Err(e) => {
                    return Err(e.as_transfer(format!("{} (on host {}): {e}", what(r.link.peer), r.link.host)));
                }
            }
        }
        todo = busy;
        if !todo.is_empty() && !backoff.pause() {
            let r = puts[todo[0]].0;
            return Err(Error::timeout(
                format!("{} (its previous signal was never consumed)", what(r.link.peer)),
                timeout,
            ));
        }
    }
    Ok(())
}

/// Which of `peers` do not answer a one-word read within `timeout`: lost or unreachable.
pub(crate) fn unanswered(peers: &[&Remote], timeout: Duration) -> Vec<usize> {
    let probes: Vec<_> = peers
        .iter()
        .map(|r| {
            let read = r
                .link
                .scratch
                .to_mutable_view(0, Some(4))
                .and_then(|v| r.link.transport.start_read(&v, &r.pad.slice(0, 4)?, Some(timeout)));
            (r.link.peer, read)
        })
        .collect();
    probes.into_iter().filter(|(_, w)| w.as_ref().map_or(true, |w| w.wait(None).is_err())).map(|(p, _)| p).collect()
}

/// Waits for every work, naming the peer of the first failure.
pub(crate) fn wait_all(works: Vec<(&Remote, Result<Work>)>, what: &str) -> Result<()> {
    let mut first = None;
    for (r, w) in works {
        if let Err(e) = w.and_then(|w| w.wait(None))
            && first.is_none()
        {
            first = Some(r.link.error(what, &e));
        }
    }
    first.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_links_keep_about_four_flows_toward_other_hosts() {
        let flows = [1, 2, 3, 4, 5, 8, 16, 1024].map(tcp_link_flows);
        assert_eq!(flows, [4, 4, 2, 1, 1, 1, 1, 1]);
    }

    #[test]
    fn pieces_cover_the_range_once_in_order() {
        let all = |len, piece| pieces(len, piece).collect::<Vec<_>>();
        assert_eq!(all(0, 4), vec![]);
        assert_eq!(all(3, 4), vec![(0, 3)]);
        assert_eq!(all(8, 4), vec![(0, 4), (4, 4)]);
        assert_eq!(all(9, 4), vec![(0, 4), (4, 4), (8, 1)]);
        assert_eq!(all(9, usize::MAX), vec![(0, 9)]);
        assert_eq!(all(2, 0), vec![(0, 1), (1, 1)], "a zero piece would never end");
    }

    #[test]
    fn hosts_that_picked_differently_meet_on_tcp_unless_told_otherwise() {
        assert_eq!(meet("tcp", false, "tcp"), Meet::Same);
        assert_eq!(meet("ucx", true, "ucx"), Meet::Same);
        // A host with a fabric and one without: the fabric side offers tcp besides.
        assert_eq!(meet("ucx", false, "tcp"), Meet::BindCommon);
        assert_eq!(meet("tcp", false, "ucx"), Meet::ReadCommon);
        assert_eq!(meet("tcp", true, "ucx"), Meet::ReadCommon);
        // SYMMEM_XHOST_BACKEND=ucx on one host only, or two backends neither of which is tcp.
        assert_eq!(meet("ucx", true, "tcp"), Meet::Refuse);
        assert_eq!(meet("ucx", false, "other"), Meet::Refuse);
        assert_eq!(scheme("ucx://AAAA"), "ucx");
        assert_eq!(scheme("tcp://127.0.0.1:1?flows=4"), "tcp");
        assert_eq!(scheme("garbage"), "");
    }
}
