//! The barrier of a group that spans hosts: hierarchical, and one one-way message per pair of
//! hosts.
//!
//! ```text
//!   rank (not leader) ──store e──▶ leader's ARRIVE[rank]        (shared memory)
//!   leader            ──Set32 e──▶ every other leader's FROM[me] (a remote atomic, not awaited)
//!   leader            ──store e──▶ each local rank's RELEASE     (shared memory)
//!   checked (an operator's entry): each rank's stamp digest rides along: stored next to its
//!   ARRIVE, written by its leader to every other leader just before the FROM word (same link,
//!   in order); every leader compares all of them and hands the verdict on with RELEASE
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
        crate::sync::wake_word(w, self.h.sleepers(rank));
    }

    /// Waits until this rank's word `i` reaches `e`; `from` names who should move it (its link
    /// is watched when it is on another host).
    pub(crate) fn wait_for(&self, i: usize, e: u32, from: usize, p: &Patience, timeout: Duration) -> Result<()> {
        self.wait_on(self.h.rank(), i, e, from, p, timeout)
    }

    /// Waits until word `i` of `owner` (this rank or one on its host) reaches `e`; `from`
    /// names who should move it, as for [`Words::wait_for`].
    pub(crate) fn wait_on(
        &self,
        owner: usize,
        i: usize,
        e: u32,
        from: usize,
        p: &Patience,
        timeout: Duration,
    ) -> Result<()> {
        let w = self.word(owner, i);
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
        // The owner's count: whoever moves the word wakes by it (`publish`).
        let sleepers = self.h.sleepers(owner);
        match wait_until(w, done, p, lost, |seen, nap| crate::sync::sleep_on(w, seen, nap, sleepers)) {
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
        self.set_remote(rank, i, e, timeout, true)
    }

    /// [`Words::start_remote`], answered: its Work completes once the word landed (and with it
    /// whatever was started on the link before it).
    pub(crate) fn start_remote_landed(&self, rank: usize, i: usize, e: u32, timeout: Duration) -> Result<Work> {
        self.set_remote(rank, i, e, timeout, false)
    }

    fn set_remote(&self, rank: usize, i: usize, e: u32, timeout: Duration, posted: bool) -> Result<Work> {
        let r = self.h.remote(rank).ok_or_else(|| Error::InvalidArgument(format!("rank {rank} is not remote")))?;
        r.start_set(false, self.offset(i), 4, u64::from(e), timeout, posted)
            .map_err(|err| r.link.error("signalling", &err))
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
            first = Some(h.failed("sending to", *peer, e));
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
fn epoch_words(world_size: usize) -> usize {
    2 * world_size + 1
}

/// Where, after the epoch words, the checked barrier ([`HostSync::barrier_agreeing`]) keeps
/// the digest of what each rank passed (8 bytes per rank, per parity of the barrier's epoch),
/// then each parity's verdict: a byte offset in the allocation.
fn digests_at(world_size: usize) -> usize {
    (4 * epoch_words(world_size)).next_multiple_of(8)
}

/// The allocation's size in 4-byte words: the epoch words, then the digests and verdicts.
pub(crate) fn words(world_size: usize) -> usize {
    (digests_at(world_size) + 2 * world_size * 8 + 2 * 8) / 4
}

impl HostSync {
    pub(crate) fn new(words: Tensor, h: Arc<SymmHandle>) -> HostSync {
        HostSync { _words: words, words: Words::new(h, 0), state: Mutex::new(State::default()) }
    }

    /// The barrier (see the module docs).
    pub(crate) fn barrier(&self, p: &Patience, timeout: Duration) -> Result<()> {
        self.barrier_with(p, timeout, None).map(|_| ())
    }

    /// The barrier, carrying a digest of what each rank passed to the call it enters (an
    /// operator's stamp): each rank leaves it with the same verdict, 0 when every digest equals
    /// rank 0's, else 1 + the first rank whose digest differs. The digests travel with the
    /// barrier's own messages (a leader writes its host's to every other leader before its FROM
    /// word, on the same link, so in order), so checking costs no round trip of its own.
    pub(crate) fn barrier_agreeing(&self, p: &Patience, timeout: Duration, digest: u64) -> Result<u64> {
        self.barrier_with(p, timeout, Some(digest))
    }

    fn barrier_with(&self, p: &Patience, timeout: Duration, digest: Option<u64>) -> Result<u64> {
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
        // Sends of epoch e-1 may still read the digests of its parity; earlier ones may read this
        // one's, about to be rewritten, and must have finished (as in the host-push workspaces;
        // they have, in fact: the other leaders' FROM words of e-1 followed them on the link).
        // Only their failures matter otherwise.
        settle(h, &mut st.sent, |epoch| epoch != e.wrapping_sub(1), timeout).map_err(what)?;
        // Digests and verdicts alternate by parity: a leader writes another's parity p of epoch
        // e+2 only after that leader's FROM word of e+1, which it raises after it read e's.
        let parity = (e % 2) as usize;
        let base = h.offset() + digests_at(ws);
        let slot = |r: usize| base + (parity * ws + r) * 8;
        let verdict_at = base + 2 * ws * 8 + parity * 8;
        if let Some(d) = digest {
            // Relaxed: published by ARRIVE (Release) to the leader, which sends it on before its
            // FROM word.
            h.word64(me, slot(me)).store(d, Ordering::Relaxed);
        }
        if me != leader {
            w.publish(leader, me, e);
            w.wait_for(ws, e, leader, p, timeout).map_err(what)?;
            st.epoch = e;
            // Relaxed: the leader stored it before RELEASE (Release, seen with Acquire above).
            return Ok(if digest.is_some() { h.word64(leader, verdict_at).load(Ordering::Relaxed) } else { 0 });
        }
        for &r in &locals[1..] {
            w.wait_for(r, e, r, p, timeout).map_err(what)?;
        }
        if digest.is_some() {
            for &r in &locals[1..] {
                // Relaxed: r stored it before its ARRIVE (seen with Acquire above).
                let d = h.word64(r, slot(r)).load(Ordering::Relaxed);
                h.word64(me, slot(r)).store(d, Ordering::Relaxed);
            }
        }
        let others: Vec<usize> = h.leaders().filter(|&l| l != me).collect();
        for &l in &others {
            let sent = h.batch(l, || -> Result<()> {
                if digest.is_some() {
                    for (a, end) in runs(locals) {
                        let at = slot(locals[a]);
                        st.sent.push((l, e, h.start_push(l, at, (end - a) * 8, at, timeout)?));
                    }
                }
                st.sent.push((l, e, w.start_remote(l, ws + 1 + me, e, timeout)?));
                Ok(())
            });
            sent.map_err(what)?;
        }
        for &l in &others {
            w.wait_for(ws + 1 + l, e, l, p, timeout).map_err(what)?;
        }
        let verdict = match digest {
            // Relaxed: each remote host's digests landed before its leader's FROM word (seen
            // with Acquire above); this host's were copied above.
            Some(_) => {
                let of = |r: usize| h.word64(me, slot(r)).load(Ordering::Relaxed);
                (1..ws).find(|&r| of(r) != of(0)).map_or(0, |r| r as u64 + 1)
            }
            None => 0,
        };
        // Relaxed: published by RELEASE below.
        h.word64(me, verdict_at).store(verdict, Ordering::Relaxed);
        for &r in &locals[1..] {
            w.publish(r, ws, e);
        }
        st.epoch = e;
        Ok(verdict)
    }
}

/// Runs of consecutive ranks in `ranks` (sorted), as (index of the first, index past the last).
pub(crate) fn runs(ranks: &[usize]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let start = at;
        if start >= ranks.len() {
            return None;
        }
        at += 1;
        while at < ranks.len() && ranks[at - 1] + 1 == ranks[at] {
            at += 1;
        }
        Some((start, at))
    })
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn runs_are_the_stretches_of_consecutive_ranks() {
        let of = |r: &[usize]| runs(r).collect::<Vec<_>>();
        assert_eq!(of(&[0, 1, 2, 5, 6, 9]), [(0, 3), (3, 5), (5, 6)]);
        assert_eq!(of(&[4]), [(0, 1)]);
        assert_eq!(of(&[1, 3, 5]), [(0, 1), (1, 2), (2, 3)]);
        assert_eq!(of(&[]), []);
    }
}
