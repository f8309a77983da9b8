//! Signals on a word of symmetric memory, as NVSHMEM's put-with-signal and PyTorch's NCCL
//! backend have them: a put of a whole symmetric tensor followed by a store of a value into
//! the same word on the peer, and a wait until this rank's word holds a value.
//!
//! ```text
//!   the word:  the first element of a symmetric tensor (in the data buffers), or a word of a
//!              signal pad view (`SymmHandle::get_signal_pad`), the same place on every rank
//!   put:       data first (local copy, or posted writes the signal follows on the link), then
//!              a Release store of the value (or a remote atomic set), then a futex wake
//!   wait:      Acquire loads until the value is there (NVSHMEM: equal; NCCL: at least), spin
//!              then sleep on the word's low half, bounded by the operator timeout
//! ```
//!
//! A signal pad view knows its allocation (not one handle): the word is named to the peers
//! through the allocation's one rendezvoused group, as a symmetric tensor is ([`super::handle_of`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::remote::Remote;
use super::segment::Segment;
use super::{Cache, Peer, SymmHandle, handle_of, lock};
use crate::error::{Error, Result};
use crate::sync::{Stop, wait_until};
use crate::tensor::{DType, Storage, Tensor};
use crate::transport::Work;

/// A view of one rank's signal pad, as [`SymmHandle::get_signal_pad`] hands it out: the pad's
/// bytes, and the allocation the pad belongs to (its peers and handles), so that a word of it
/// can be named on every rank.
#[derive(Debug)]
pub(crate) struct PadView {
    /// The segment whose pad this views (this rank's, or a peer's on this host).
    pub(crate) segment: Arc<Segment>,
    /// The handles of the allocation (this rank's) whose pads these are.
    pub(crate) cache: Weak<Mutex<Cache>>,
}

// SAFETY: the pad region lies inside the segment's mapping, which the Arc keeps mapped (at a
// fixed address) as long as this storage lives.
unsafe impl Storage for PadView {
    fn ptr(&self) -> *mut u8 {
        self.segment.pad_ptr()
    }
    fn len(&self) -> usize {
        self.segment.pad_size()
    }
    fn parent(&self) -> Option<(&(dyn std::any::Any + Send + Sync), usize)> {
        Some((self, 0))
    }
    fn sleepers(&self) -> Option<&AtomicU32> {
        Some(self.segment.sleepers())
    }
}

/// Where a signal lives: byte `at` of every rank's data buffer or signal pad, `width` bytes
/// (4 or 8), on the group of `h`.
pub(crate) struct SignalWord {
    pub(crate) h: Arc<SymmHandle>,
    pub(crate) pad: bool,
    pub(crate) at: usize,
    pub(crate) width: usize,
}

impl SignalWord {
    /// The word of `sigpad`: the first element of a symmetric tensor, or of a signal pad view.
    pub(crate) fn of(op: &str, sigpad: &Tensor) -> Result<SignalWord> {
        let width = sigpad.dtype().size();
        if !matches!(sigpad.dtype(), DType::I64 | DType::I32 | DType::U32) || sigpad.numel() == 0 {
            return Err(Error::InvalidArgument(format!(
                "{op}: the signal must be a non-empty int64, int32 or uint32 symmetric tensor or signal pad (got {} \
                 of {})",
                sigpad.numel(),
                sigpad.dtype()
            )));
        }
        let pad = sigpad.storage().parent().and_then(|(p, base)| Some((p.downcast_ref::<PadView>()?, base)));
        let Some((view, base)) = pad else {
            let h = handle_of(op, sigpad)?;
            if !h.offset.is_multiple_of(width) {
                return Err(Error::InvalidArgument(format!("{op}: the signal word is not {width}-byte aligned")));
            }
            let at = h.offset;
            return Ok(SignalWord { h, pad: false, at, width });
        };
        let at = base + sigpad.storage_offset() * width;
        if !at.is_multiple_of(width) || at + width > view.segment.pad_size() {
            return Err(Error::InvalidArgument(format!(
                "{op}: the signal word at byte {at} of the signal pad is not {width}-byte aligned inside its {} bytes",
                view.segment.pad_size()
            )));
        }
        Ok(SignalWord { h: pad_handle(op, view)?, pad: true, at, width })
    }

    /// The first 8 bytes of the signal pad of `tensor`'s allocation (PyTorch's NCCL backend's
    /// signal), on the group `tensor` was rendezvoused on.
    pub(crate) fn first_of_pad(op: &str, tensor: &Tensor) -> Result<SignalWord> {
        let h = handle_of(op, tensor)?;
        if h.signal_pad_size() < 8 {
            return Err(Error::InvalidArgument(format!(
                "{op}: a signal pad of {} bytes holds no 8-byte signal",
                h.signal_pad_size()
            )));
        }
        Ok(SignalWord { h, pad: true, at: 0, width: 8 })
    }

    /// The word on `rank` (on this host), as a 32-bit atomic: the whole of a 4-byte word, the
    /// low half (the futex word, little-endian) of an 8-byte one.
    pub(crate) fn word32(&self, rank: usize) -> &AtomicU32 {
        if self.pad { self.h.pad_word32(rank, self.at) } else { self.h.word32(rank, self.at) }
    }

    /// The 8-byte word on `rank` (on this host).
    pub(crate) fn word64(&self, rank: usize) -> &AtomicU64 {
        if self.pad { self.h.pad_word64(rank, self.at) } else { self.h.word64(rank, self.at) }
    }

    /// The word's value on `rank` (on this host). Acquire: pairs with the putter's Release
    /// store (local) or the transport thread's (a peer on another host).
    pub(crate) fn load(&self, rank: usize) -> u64 {
        if self.width == 8 {
            self.word64(rank).load(Ordering::Acquire)
        } else {
            u64::from(self.word32(rank).load(Ordering::Acquire))
        }
    }

    /// Stores `value` into the word on `peer` (on this host) and wakes its sleepers.
    pub(crate) fn store_local(&self, peer: usize, value: u64) {
        if self.width == 8 {
            // Release: pairs with the Acquire load in `load`, after the data the signal vouches for.
            self.word64(peer).store(value, Ordering::Release);
        } else {
            // Release: as above.
            self.word32(peer).store(value as u32, Ordering::Release);
        }
        // The low half of a 64-bit word is the futex word sleepers wait on.
        crate::sync::wake_word(self.word32(peer), self.h.sleepers(peer));
    }

    /// Starts storing `value` into the word of remote peer `r` (see `Remote::start_set`).
    pub(crate) fn start_set(&self, r: &Remote, value: u64, timeout: Duration, posted: bool) -> Result<Work> {
        r.start_set(self.pad, self.at, self.width, value, timeout, posted)
    }

    /// Waits (up to the operator timeout) until this rank's word satisfies `reached` (given
    /// the value). `peer`, when known, is the rank expected to signal: its link (to another
    /// host) is watched for its loss, and served while spinning. `what` names the wait in the
    /// timeout's message.
    pub(crate) fn wait(&self, op: &str, peer: Option<usize>, what: &str, reached: impl Fn(u64) -> bool) -> Result<()> {
        let h = &self.h;
        if let Some(peer) = peer
            && peer >= h.world_size()
        {
            return Err(Error::InvalidArgument(format!(
                "{op}: peer {peer} must be smaller than world size {}",
                h.world_size()
            )));
        }
        let timeout = crate::config::op_timeout();
        let me = h.rank();
        // Sleep on the word's low half (little-endian), which every putter wakes after storing.
        let low = self.word32(me);
        // The peer's link when it is on another host: watched for its loss, and served while
        // spinning (see `done`).
        let remote = peer.and_then(|p| h.remote(p));
        let from = peer.map_or_else(String::new, |p| format!(" from rank {p}"));
        let lost = || match remote.and_then(|r| r.link.lost().map(|why| (r, why))) {
            Some((r, why)) => Err(Error::transfer(
                crate::error::TransferKind::PeerLost,
                format!("{op}: rank {me} lost rank {} on host {}: {why}", r.link.peer, r.link.host),
            )),
            None => Ok(()),
        };
        // A 64-bit signal that changes only its high half does not change the futex word, so its
        // wake-up can slip past a sleeper that is about to sleep: nap briefly then.
        let wide = self.width == 8;
        let sleep = |seen: u32, nap: Duration| {
            let nap = if wide { nap.min(Duration::from_millis(1)) } else { nap };
            crate::sync::sleep_on(low, seen, nap, h.sleepers(me))
        };
        // A signal from another host: while spinning, this thread applies it itself once it has
        // arrived (no hand-off to the link's thread on the way).
        let done = || {
            reached(self.load(me))
                || remote.is_some_and(|r| {
                    r.link.transport.serve_arrived();
                    reached(self.load(me))
                })
        };
        match wait_until(low, done, &h.patience(timeout), lost, sleep) {
            Ok(()) => Ok(()),
            Err(Stop::Failed(e)) => Err(e),
            Err(Stop::TimedOut) => Err(Error::timeout(format!("{op}: rank {me} waiting for {what}{from}"), timeout)),
        }
    }
}

/// The handle that names a signal pad view's words on every rank: its allocation's one group
/// (as [`handle_of`] finds a symmetric tensor's).
fn pad_handle(op: &str, view: &PadView) -> Result<Arc<SymmHandle>> {
    let gone = || Error::InvalidArgument(format!("{op}: the allocation of this signal pad was freed"));
    let cache = view.cache.upgrade().ok_or_else(gone)?;
    let cache = lock(&cache);
    let mut handles = cache.handles.iter();
    let Some(((group, _), h)) = handles.next() else { return Err(gone()) };
    if handles.any(|((g, _), _)| g != group) {
        return Err(Error::InvalidArgument(format!(
            "{op}: the signal pad's allocation was rendezvoused on several groups; signal through a tensor of it \
             instead"
        )));
    }
    Ok(h.clone())
}

/// NVSHMEM's put with signal: puts the whole of `tensor` into the same symmetric tensor on
/// `peer`, then sets `peer`'s copy of the word `sigpad` names (its first element: a symmetric
/// int64/int32/uint32 tensor, or a view of a signal pad as `get_signal_pad` returns it) to
/// `signal`. The peer sees the signal only after the data landed.
///
/// It returns once `tensor` may be reused, as NVSHMEM's and OpenSHMEM's blocking
/// put-with-signal do: on this host the data and the signal are then in place; to a peer on
/// another host, when `tensor` and `sigpad` belong to the same group (one link), the data and
/// the signal may still be on their way, the link landing the signal after the data (no round
/// trip is waited for). A refusal of those writes by the peer ends the link with the reason.
pub fn nvshmem_put_with_signal(tensor: &Tensor, sigpad: &Tensor, signal: u64, peer: usize) -> Result<()> {
    const OP: &str = "nvshmem_put_with_signal";
    let word = SignalWord::of(OP, sigpad)?;
    put_then_signal(OP, tensor, &word, signal, peer)
}

/// Puts the whole of symmetric `tensor` into the same tensor on `peer`, then stores `signal`
/// into `peer`'s copy of `word` (ordered after the data, one link's order across hosts).
pub(crate) fn put_then_signal(op: &str, tensor: &Tensor, word: &SignalWord, signal: u64, peer: usize) -> Result<()> {
    let t = crate::config::op_timeout();
    let h = handle_of(op, tensor)?;
    let len = super::check_put(op, tensor, &h, peer, h.offset)?;
    let sh = &word.h;
    // The signal's group may be another, and smaller.
    sh.check_rank(peer).map_err(|e| Error::InvalidArgument(format!("{op}: the signal's peer: {e}")))?;
    if let (Some(rd), Some(rs)) = (h.remote(peer), sh.remote(peer))
        && Arc::ptr_eq(&rd.link, &rs.link)
    {
        return super::post_bytes(op, tensor, rd, (h.offset, len), || word.start_set(rs, signal, t, true).map(Some));
    }
    super::put_bytes(op, tensor, &h, peer, h.offset)?;
    match &sh.peers.peers[peer] {
        Peer::Local(_) => {
            word.store_local(peer, signal);
            Ok(())
        }
        Peer::Remote(r) => word
            .start_set(r, signal, t, false)
            .and_then(|w| w.wait(None))
            .map_err(|e| r.link.error(&format!("{op}: signalling"), &e)),
    }
}

/// NVSHMEM's wait for signal: waits until this rank's copy of the word `sigpad` names (see
/// [`nvshmem_put_with_signal`]) equals `signal` (set by a peer's put with signal), at most the
/// operator timeout (`SYMMEM_OP_TIMEOUT`). `peer` names who is expected to signal, for the
/// error message.
pub fn nvshmem_wait_for_signal(sigpad: &Tensor, signal: u64, peer: usize) -> Result<()> {
    const OP: &str = "nvshmem_wait_for_signal";
    let word = SignalWord::of(OP, sigpad)?;
    let want = if word.width == 8 { signal } else { signal & 0xffff_ffff };
    word.wait(OP, Some(peer), &format!("signal {signal}"), |v| v == want)
}

/// PyTorch's NCCL backend's put with signal: puts the whole of symmetric `tensor` into the same
/// tensor on `peer`, then sets the first 8 bytes of the signal pad of `tensor`'s allocation on
/// `peer` to `signal` (a uint64, after the data). As there, that word is also where the
/// allocation's barriers on channel 0 keep their first slots: between uses it must be zero
/// again before a barrier on the allocation (PyTorch's contract for user signals in the pad).
pub fn nccl_put_with_signal(tensor: &Tensor, signal: u64, peer: usize) -> Result<()> {
    const OP: &str = "nccl_put_with_signal";
    let word = SignalWord::first_of_pad(OP, tensor)?;
    put_then_signal(OP, tensor, &word, signal, peer)
}

/// PyTorch's NCCL backend's wait for signal: waits until the first 8 bytes of this rank's
/// signal pad of `sigpad`'s allocation (a symmetric tensor; see [`nccl_put_with_signal`]) hold
/// at least `signal`, at most the operator timeout (`SYMMEM_OP_TIMEOUT`).
pub fn nccl_wait_for_signal(sigpad: &Tensor, signal: u64) -> Result<()> {
    const OP: &str = "nccl_wait_for_signal";
    let word = SignalWord::first_of_pad(OP, sigpad)?;
    word.wait(OP, None, &format!("a signal of at least {signal}"), |v| v >= signal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symm::{self, Device};

    /// A signal pad view, as `get_signal_pad` hands it out (PyTorch's test_nvshmem_put passes
    /// `hdl.get_signal_pad(rank)`), names the same word on the peer: the whole view its first
    /// word, a narrowed view the word it starts at; the pad's other words stay zero.
    #[test]
    fn a_signal_pad_view_is_a_signal() {
        crate::group::run_threads(2, |group| {
            let me = group.rank();
            let data = symm::empty(&[16], DType::F32, Device::Cpu)?;
            data.fill(me as f32)?;
            let h = symm::rendezvous(&data, &group)?;
            let pad = h.get_signal_pad(me)?;
            for (word, signal) in [(0, 5u64), (7, 9)] {
                let sig = pad.narrow(0, word, 1)?;
                if me == 0 {
                    nvshmem_put_with_signal(&data, &sig, signal, 1)?;
                } else {
                    nvshmem_wait_for_signal(&sig, signal, 0)?;
                    assert_eq!(data.to_vec::<f32>()?, vec![0.0; 16]);
                    let words = pad.to_vec::<u32>()?;
                    assert_eq!((words[word], words.iter().filter(|&&w| w != 0).count()), (signal as u32, 1));
                    sig.fill(0u32)?; // the pad is zero again after use, as PyTorch asks
                }
                group.barrier(Duration::from_secs(30))?;
            }
            // A peer's pad view names the same words: the signal lands in the peer's own pad.
            if me == 0 {
                let theirs = h.get_signal_pad(1)?.narrow(0, 3, 1)?;
                nvshmem_put_with_signal(&data, &theirs, 4, 1)?;
            } else {
                nvshmem_wait_for_signal(&pad.narrow(0, 3, 1)?, 4, 0)?;
                pad.fill(0u32)?;
            }
            group.barrier(Duration::from_secs(30))?;
            Ok(())
        })
        .unwrap();
    }

    /// PyTorch's NCCL signal: the first 8 bytes of the tensor's pad, waited for until they hold
    /// at least the value.
    #[test]
    fn the_nccl_signal_is_the_pads_first_word_and_waits_for_at_least() {
        crate::group::run_threads(2, |group| {
            let me = group.rank();
            let data = symm::empty(&[8], DType::I64, Device::Cpu)?;
            data.fill(me as i64 + 1)?;
            let h = symm::rendezvous(&data, &group)?;
            if me == 0 {
                nccl_put_with_signal(&data, 9, 1)?;
            } else {
                nccl_wait_for_signal(&data, 7)?;
                assert_eq!(data.to_vec::<i64>()?, vec![1; 8]);
                let pad = h.get_signal_pad(1)?;
                assert_eq!(pad.narrow(0, 0, 3)?.to_vec::<u32>()?, [9, 0, 0]);
                pad.fill(0u32)?;
            }
            group.barrier(Duration::from_secs(30))?;
            Ok(())
        })
        .unwrap();
    }

    /// A word past the pad, or a pad whose allocation is gone, is refused with what is wrong.
    #[test]
    fn bad_signal_pad_words_are_refused() {
        crate::group::run_threads(1, |group| {
            let data = symm::empty(&[4], DType::F32, Device::Cpu)?;
            let h = symm::rendezvous(&data, &group)?;
            let pad = h.get_signal_pad(0)?;
            let odd = pad.reinterpret(DType::I64, &[1], &[1], 4);
            assert!(odd.is_err() || SignalWord::of("t", &odd?).is_err());
            drop((h, data));
            let err = nvshmem_wait_for_signal(&pad, 1, 0).unwrap_err().to_string();
            assert!(err.contains("freed"), "{err}");
            Ok(())
        })
        .unwrap();
    }
}
