//! The barrier of a group that spans hosts: hierarchical, and one one-way message per pair of
//! hosts.
//!
//! ```text
//!   rank (not leader) ──store e──▶ leader's ARRIVE[rank]        (shared memory)
//!   leader            ──Set32 e──▶ every other leader's FROM[me] (a remote atomic, not awaited)
//!   leader            ──store e──▶ each local rank's RELEASE     (shared memory)
//! ```
//!
//! Each rank counts its barriers (`e`, wrapping); a word reached `e` when `word - e`, read as
//! signed, is not negative. Words only grow, so nothing needs consuming and nothing is ever
//! "busy": a leader sends its epoch and moves on to wait for the others'. A failed send is
//! reported at the next barrier; a lost leader is noticed while waiting for it.
//!
//! Ordering: every store is Release and every load Acquire (the remote atomic's store on the
//! target is Release too), so what a rank wrote before arriving is visible to every rank after
//! leaving, on its host directly, and on other hosts to one-sided reads (which read the owner's
//! memory after the barrier). The words live in a small symmetric allocation of their own,
//! made at the group's first rendezvous across hosts.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{SymmHandle, lock};
use crate::error::{Error, Result, TransferKind};
use crate::sync::{Patience, Stop, wait_until};
use crate::tensor::Tensor;
use crate::transport::Work;

/// Epoch words in a symmetric allocation, `at` bytes into every rank's buffer: a rank
/// publishes into a word of a rank on its host, or waits for one of its own to reach an epoch.
#[derive(Debug)]
pub(crate) struct Words {
    pub(crate) h: Arc<SymmHandle>,
    at: usize,
}

/// Whether `v` has reached epoch `e` (wrapping).
fn reached(v: u32, e: u32) -> bool {
    (v.wrapping_sub(e) as i32) >= 0
}

impl Words {
    /// The words at byte `at` of the buffers behind `h`.
    pub(crate) fn new(h: Arc<SymmHandle>, at: usize) -> Words {
        Words { h, at }
    }

    /// The byte offset of word `i` in a rank's data buffer.
    pub(crate) fn offset(&self, i: usize) -> usize {
        self.h.offset() + self.at + 4 * i
    }

    fn word(&self, rank: usize, i: usize) -> &AtomicU32 {
        assert!(self.offset(i) + 4 <= self.h.buffer_size(), "epoch word {i} outside the buffer");
        assert!(self.h.is_local(rank), "epoch words are addressed on this host only");
        let p = self.h.read_ptr(rank) + self.offset(i);
        // SAFETY: `rank` is on this host (asserted), so its buffer is mapped for as long as
        // `self.h` lives; the word lies inside it (asserted) and is 4-aligned (buffers are
        // page-aligned, offsets multiples of 4); every process touches these words only
        // atomically.
        unsafe { &*(p as *const AtomicU32) }
    }

    /// Sets word `i` of `rank` (on this host) to `e` and wakes its sleeper.
    pub(crate) fn publish(&self, rank: usize, i: usize, e: u32) {
        let w = self.word(rank, i);
        // Release: pairs with the Acquire load in `wait_for`.
        w.store(e, Ordering::Release);
        crate::sys::futex::wake(w);
    }

    /// Waits until this rank's word `i` reaches `e`; `from` names who should move it (its link
    /// is watched when it is on another host).
    pub(crate) fn wait_for(&self, i: usize, e: u32, from: usize, p: &Patience, timeout: Duration) -> Result<()> {
        let w = self.word(self.h.rank(), i);
        let lost = || match self.h.remote(from) {
            Some(r) => match r.link.lost() {
                Some(why) => Err(Error::transfer(
                    TransferKind::PeerLost,
                    format!(
                        "rank {} of group {:?} lost rank {from} on host {}: {why}",
                        self.h.rank(),
                        self.h.group_name(),
                        r.link.host
                    ),
                )),
                None => Ok(()),
            },
            None => Ok(()),
        };
        // Acquire: pairs with the Release store of `publish` or of the remote atomic.
        let seen = || reached(w.load(Ordering::Acquire), e);
        let link = self.h.remote(from).map(|r| &r.link.transport);
        // A word a rank on another host moves: what it sent may have arrived, and this thread
        // applies it itself rather than wait for the link's thread to wake.
        let done = || {
            seen()
                || link.is_some_and(|t| {
                    t.serve_arrived();
                    seen()
                })
        };
        match wait_until(w, done, p, lost, |seen, nap| crate::sys::futex::wait(w, seen, nap)) {
            Ok(()) => Ok(()),
            Err(Stop::Failed(err)) => Err(err),
            Err(Stop::TimedOut) => Err(Error::timeout(
                format!(
                    "rank {} of group {:?} waiting for rank {from}{}{}",
                    self.h.rank(),
                    self.h.group_name(),
                    self.h.remote(from).map(|r| format!(" on host {}", r.link.host)).unwrap_or_default(),
                    self.h.diagnose()
                ),
                timeout,
            )),
        }
    }

    /// Starts setting word `i` of `rank` (on another host) to `e`, without waiting; posted (the
    /// Work may complete once sent: the peer learns of it by watching the word).
    pub(crate) fn start_remote(&self, rank: usize, i: usize, e: u32, timeout: Duration) -> Result<Work> {
        let r = self.h.remote(rank).ok_or_else(|| Error::InvalidArgument(format!("rank {rank} is not remote")))?;
        r.start_set(self.offset(i), 4, u64::from(e), timeout, true).map_err(|err| r.link.error("signalling", &err))
    }
}

/// Sends still in flight: (peer, epoch of the call that started it, its work).
pub(crate) type Sent = Vec<(usize, u32, Work)>;

/// Forgets the sends that have completed and waits for those whose epoch `must(epoch)` says
/// must be complete (their source buffer is about to be reused); the others may stay in
/// flight. Reports the first failure, naming its peer.
pub(crate) fn settle(h: &SymmHandle, sent: &mut Sent, must: impl Fn(u32) -> bool, timeout: Duration) -> Result<()> {
    let mut first = None;
    sent.retain(|(peer, epoch, w)| {
        if !w.is_completed() && !must(*epoch) {
            return true;
        }
        if let Err(e) = w.wait(Some(timeout))
            && first.is_none()
        {
            first = Some(match h.remote(*peer) {
                Some(r) => r.link.error("sending to", &e),
                None => e,
            });
        }
        false
    });
    first.map_or(Ok(()), Err)
}

/// The words of one group's barrier, and where it stands.
#[derive(Debug)]
pub(crate) struct HostSync {
    _words: Tensor,
    words: Words,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    epoch: u32,
    /// Epochs sent to the other leaders, not yet known to have landed.
    sent: Sent,
}

/// Word indices in the allocation: ARRIVE[r] = r, RELEASE = ws, FROM[l] = ws + 1 + l.
pub(crate) fn words(world_size: usize) -> usize {
    2 * world_size + 1
}

impl HostSync {
    pub(crate) fn new(words: Tensor, h: Arc<SymmHandle>) -> HostSync {
        HostSync { _words: words, words: Words::new(h, 0), state: Mutex::new(State::default()) }
    }

    /// The barrier (see the module docs).
    pub(crate) fn barrier(&self, p: &Patience, timeout: Duration) -> Result<()> {
        let mut st = lock(&self.state);
        let e = st.epoch.wrapping_add(1);
        let w = &self.words;
        let h = &w.h;
        let (me, ws) = (h.rank(), h.world_size());
        let locals = h.local_ranks();
        let leader = locals[0];
        let what = |e: Error| match e {
            Error::Timeout { what, after } => Error::timeout(format!("SymmetricMemory::barrier: {what}"), after),
            Error::Transfer { kind, message } => Error::transfer(kind, format!("SymmetricMemory::barrier: {message}")),
            e => e,
        };
        if me != leader {
            w.publish(leader, me, e);
            w.wait_for(ws, e, leader, p, timeout).map_err(what)?;
            st.epoch = e;
            return Ok(());
        }
        for &r in &locals[1..] {
            w.wait_for(r, e, r, p, timeout).map_err(what)?;
        }
        // Earlier sends carry no buffer: only their failures matter, and nothing waits for them.
        settle(h, &mut st.sent, |_| false, timeout).map_err(what)?;
        let others: Vec<usize> = h.leaders().filter(|&l| l != me).collect();
        for &l in &others {
            let sent = w.start_remote(l, ws + 1 + me, e, timeout).map_err(what)?;
            st.sent.push((l, e, sent));
        }
        for &l in &others {
            w.wait_for(ws + 1 + l, e, l, p, timeout).map_err(what)?;
        }
        for &r in &locals[1..] {
            w.publish(r, ws, e);
        }
        st.epoch = e;
        Ok(())
    }
}
