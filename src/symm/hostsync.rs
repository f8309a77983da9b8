//! The barrier of a group that spans hosts: hierarchical; among the hosts' leaders one round of
//! one-way messages between every pair (up to [`DISSEMINATE_FROM`] hosts), or dissemination.
//!
//! ```text
//!   rank (not leader) ──store e──▶ leader's ARRIVE[rank]        (shared memory)
//!   leader, few hosts ──Set32 e──▶ every other leader's FROM[me] (a remote atomic, not awaited)
//!   leader, H hosts   ──Set32 e──▶ in round k = 0, 1, .. while 2^k < H, the leader 2^k hosts
//!                                  after it (in host order, wrapping) FROM[me], then waits for
//!                                  the one 2^k hosts before it: ⌈log2 H⌉ rounds, one message
//!                                  each (Hensgen, Finkel and Manber's dissemination barrier)
//!   leader            ──store e──▶ each local rank's RELEASE     (shared memory)
//!   checked (an operator's entry): each rank's stamp digest rides along: stored next to its
//!   ARRIVE, written by its leader to every other leader just before the FROM word (same link,
//!   in order); every leader compares all of them and hands the verdict on with RELEASE.
//!   Disseminating, a leader sends instead what it knows so far, folded into one `Agreement`
//!   (the lowest rank heard from, its digest, the lowest rank whose digest differs from it),
//!   which every round merges: after the last, every leader knows rank 0's digest and the first
//!   rank that differs from it, the same verdict
//! ```
//!
//! A dissemination round's sender is a different leader in every round of one barrier (its
//! distance 2^k < H differs), so its FROM word alone tells the round, as in the one-round form.
//! A leader that raised its word for barrier e+1 has left barrier e, so a word already past
//! the epoch a round waits for also means that round's sender got that far.
//!
//! Each rank counts its barriers (`e`, wrapping); a word reached `e` when `word - e`, read as
//! signed, is not negative. Words only grow, so nothing needs consuming and nothing is ever
//! "busy": a leader sends its epoch and moves on to wait for the others'. A failed send is
//! reported at the next barrier; a lost leader is noticed while waiting for it, and told to the
//! whole group through its alarm word (see [`Words`]), so that no rank waits in vain for a
//! partner that waits for the lost one.
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
///
/// The group has one alarm word, in its barrier's words ([`HostSync`]): a rank that finds a
/// rank on another host lost while waiting for it ([`Words::sound`]) tells every other host's
/// leader and the ranks of its own host, and each leader its host's ranks. Every rank waiting
/// on any words of the group (a barrier, a host-push call, whichever of them it is in; not a
/// signal pad or a transfer) then fails naming the lost rank within a nap
/// ([`crate::sync::MAX_NAP`]), instead of waiting for a
/// partner that waits in vain too until the timeout. Dissemination and Bruck's rounds need it:
/// a leader waits for one partner a round, so only the lost one's partners see its link break.
#[derive(Debug)]
pub(crate) struct Words {
    pub(crate) h: Arc<SymmHandle>,
    at: usize,
    /// The index of the alarm word (whose value is 0, or 1 + the rank found lost), if these are
    /// the group's barrier's words. Other words use the group's ([`SymmHandle::group_alarm`]).
    alarm: Option<usize>,
}

/// Whether `v` has reached epoch `e` (wrapping).
fn reached(v: u32, e: u32) -> bool {
    (v.wrapping_sub(e) as i32) >= 0
}

impl Words {
    /// The words at byte `at` of the buffers behind `h`.
    pub(crate) fn new(h: Arc<SymmHandle>, at: usize) -> Words {
        Words { h, at, alarm: None }
    }

    /// These words, with word `i` as the group's alarm (see [`Words`]). It only ever goes from
    /// 0 to a rank found lost: the group's calls across hosts fail from then on, as they must
    /// (every one of them needs every rank).
    fn with_alarm(self, i: usize) -> Words {
        Words { alarm: Some(i), ..self }
    }

    /// The words that hold the group's alarm word, and its index: these, or the group's
    /// barrier's (none on one host, or while the barrier's own words are being made).
    fn alarm_words(&self) -> Option<(&Words, usize)> {
        match self.alarm {
            Some(i) => Some((self, i)),
            None => self.h.group_alarm().and_then(|w| Some((w, w.alarm?))),
        }
    }

    /// The rank some rank of the group found lost and told this one of, if any.
    pub(crate) fn alarmed(&self) -> Option<usize> {
        let (w, i) = self.alarm_words()?;
        // Acquire: pairs with the Release of `tell_host`'s stores (or of the remote atomic's).
        let v = w.word(w.h.rank(), i).load(Ordering::Acquire);
        (v != 0).then(|| v as usize - 1)
    }

    /// Tells the group that rank `lost` (on another host) is lost: every rank of this host, and
    /// unless this rank was told already, every other host's leader (a posted remote atomic on
    /// each link still up, all of them awaited for a second at most). A leader told so tells
    /// its host's ranks in turn ([`Words::alarmed_error`]). Best effort: a leader it cannot
    /// reach finds the loss itself or from another leader.
    pub(crate) fn sound(&self, lost: usize) {
        let Some((a, i)) = self.alarm_words() else { return };
        let v = u32::try_from(lost + 1).unwrap_or(u32::MAX);
        // Told already (by a leader that sent it here first): the other leaders were told by
        // that one, and this host's ranks now (a leader forwards what it hears only when it
        // next waits; this one may not).
        let told = a.alarmed().is_some();
        a.tell_host(v);
        if told {
            return;
        }
        let h = &a.h;
        let me = h.host_of(h.rank());
        // One second for every leader together, not each: the error this ends in waits for it.
        let until = crate::sync::deadline(Duration::from_secs(1));
        let left = || until.saturating_duration_since(std::time::Instant::now());
        let mut works = Vec::new();
        for l in h.leaders().filter(|&l| h.host_of(l) != me && l != lost) {
            let up = h.remote(l).is_some_and(|r| r.link.lost().is_none());
            if up && let Ok(w) = a.start_remote(l, i, v, left()) {
                works.push(w);
            }
        }
        for w in works {
            let _ = w.wait(Some(left()));
        }
    }

    /// Stores alarm value `v` into the alarm word of every rank of this host (this one too),
    /// keeping a value already there. Nobody sleeps on it: a waiting rank reads it between
    /// naps, within [`crate::sync::MAX_NAP`]. (Another host's leader sets it outright, so a
    /// rank told of two losses may name either: each is a rank the group lost.)
    fn tell_host(&self, v: u32) {
        let Some((a, i)) = self.alarm_words() else { return };
        for &r in a.h.local_ranks() {
            // Release: pairs with the Acquire load of `alarmed`; a word already set by a
            // rank of this host stays as it is.
            let _ = a.word(r, i).compare_exchange(0, v, Ordering::Release, Ordering::Relaxed);
        }
    }

    /// The error of a wait for `from` that a loss elsewhere in the group ends, if this rank was
    /// told of one ([`Words::sound`]); a leader first tells its host's ranks, which may be
    /// waiting for it.
    fn alarmed_error(&self, from: usize) -> Option<Error> {
        let lost = self.alarmed()?;
        let v = u32::try_from(lost + 1).unwrap_or(u32::MAX);
        if self.h.local_ranks()[0] == self.h.rank() {
            self.tell_host(v);
        }
        let host = self.h.remote(lost).map(|r| format!(" on host {}", r.link.host)).unwrap_or_default();
        Some(Error::transfer(
            TransferKind::PeerLost,
            format!(
                "rank {} of group {:?} waiting for rank {from}: rank {lost}{host} was lost (found by a rank it left \
                 waiting; every rank of the group is told)",
                self.h.rank(),
                self.h.group_name(),
            ),
        ))
    }

    /// `e`, after telling the group of a lost rank if `e` says a peer was lost ([`Words::sound`]):
    /// the one this rank was told of, else the first rank on another host whose link is down
    /// (which may be a rank that left the group in order rather than the one `e` is about:
    /// the group has lost a rank either way). Told already, this rank still tells its host:
    /// its ranks may wait for it.
    pub(crate) fn report(&self, e: Error) -> Error {
        if e.transfer_kind() == Some(TransferKind::PeerLost)
            && let Some(lost) = self.alarmed().or_else(|| {
                (0..self.h.world_size()).find(|&r| self.h.remote(r).is_some_and(|r| r.link.lost().is_some()))
            })
        {
            self.sound(lost);
        }
        e
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

    /// Waits until this rank's word `i` or its word `j` reaches `e`, whichever first (`from`
    /// moves both); true for `i`. It sleeps on `i`: a move of `j` alone is seen at the end of
    /// a nap (callers use `j` for what only rank disagreement raises).
    pub(crate) fn wait_for_either(
        &self,
        i: usize,
        j: usize,
        e: u32,
        from: usize,
        p: &Patience,
        timeout: Duration,
    ) -> Result<bool> {
        self.wait_any(self.h.rank(), i, Some(j), e, from, p, timeout)
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
        self.wait_any(owner, i, None, e, from, p, timeout).map(|_| ())
    }

    /// Waits until word `i` of `owner`, or its word `or` if any, reaches `e`; true for `i`.
    #[allow(clippy::too_many_arguments, reason = "wait_on's and wait_for_either's call")]
    fn wait_any(
        &self,
        owner: usize,
        i: usize,
        or: Option<usize>,
        e: u32,
        from: usize,
        p: &Patience,
        timeout: Duration,
    ) -> Result<bool> {
        let w = self.word(owner, i);
        let other = or.map(|j| self.word(owner, j));
        // Whether the wait failed on `from`'s own link (then this rank tells the group), not
        // on the group's alarm. The group is told only once the wait has failed: a peer's last
        // message may still land after its link was seen down (its orderly exit), and
        // `wait_until` looks once more.
        let link_down = std::cell::Cell::new(false);
        let lost = || match self.h.remote(from).and_then(|r| Some((r, r.link.lost()?))) {
            Some((r, why)) => {
                link_down.set(true);
                Err(Error::transfer(
                    TransferKind::PeerLost,
                    format!(
                        "rank {} of group {:?} lost rank {from} on host {}: {why}",
                        self.h.rank(),
                        self.h.group_name(),
                        r.link.host
                    ),
                ))
            }
            None => self.alarmed_error(from).map_or(Ok(()), Err),
        };
        // Acquire: pairs with the Release store of `publish` or of the remote atomic.
        let first = || reached(w.load(Ordering::Acquire), e);
        let seen = || first() || other.is_some_and(|o| reached(o.load(Ordering::Acquire), e));
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
            Ok(()) => Ok(first()),
            Err(Stop::Failed(err)) => {
                if link_down.get() {
                    self.sound(from);
                }
                Err(err)
            }
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

/// From this many hosts on, the leaders meet by dissemination (⌈log2 H⌉ rounds of one message
/// each) rather than in one round of H − 1 messages each. 8 ranks on 8 played hosts (tcp), `symmem
/// bench signal -n 8,16 --hosts 8`, two alternated runs: 682 and 636 µs one round, 460 and 454
/// disseminating; 16 ranks: 1131 and 1138 µs against 640 and 640.
pub(crate) const DISSEMINATE_FROM: usize = 4;

/// What a set of ranks' digests agree on, as dissemination folds it: the lowest rank of the
/// set, its digest, and the lowest rank of the set whose digest differs from that one
/// (`u64::MAX`: none). Merging is associative, commutative and idempotent (a rank heard twice,
/// as dissemination does when the host count is not a power of two, changes nothing), and the
/// fold over every rank gives rank 0's digest and the first rank that differs from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Agreement {
    lowest: u64,
    digest: u64,
    differs: u64,
}

impl Agreement {
    /// Rank `rank`, alone, with its digest.
    pub(crate) fn of(rank: usize, digest: u64) -> Agreement {
        Agreement { lowest: rank as u64, digest, differs: u64::MAX }
    }

    /// What the union of two sets agrees on.
    pub(crate) fn merge(self, other: Agreement) -> Agreement {
        let (lo, hi) = if self.lowest <= other.lowest { (self, other) } else { (other, self) };
        // The higher set's ranks that differ from the lower's lowest: if their lowest ranks'
        // digests agree, the same ranks as within the higher set; else its lowest rank first.
        let theirs = if hi.digest == lo.digest { hi.differs } else { hi.lowest };
        Agreement { differs: lo.differs.min(theirs), ..lo }
    }

    /// The verdict of a fold over every rank: 0, or 1 + the first rank whose digest differs
    /// from rank 0's.
    pub(crate) fn verdict(self) -> u64 {
        if self.differs == u64::MAX { 0 } else { self.differs + 1 }
    }

    fn words(self) -> [u64; 3] {
        [self.lowest, self.digest, self.differs]
    }

    fn from_words(w: [u64; 3]) -> Agreement {
        Agreement { lowest: w[0], digest: w[1], differs: w[2] }
    }
}

/// Rounds of a dissemination among `hosts` leaders: ⌈log2 hosts⌉.
pub(crate) fn rounds(hosts: usize) -> usize {
    hosts.max(1).next_power_of_two().trailing_zeros() as usize
}

/// Bytes of one round's agreement (three words, padded).
const AGREEMENT: usize = 32;

/// Word indices in the allocation: ARRIVE[r] = r, RELEASE = ws, FROM[l] = ws + 1 + l, and
/// the alarm word at 2·ws + 1 ([`Words::sound`]).
fn epoch_words(world_size: usize) -> usize {
    2 * world_size + 2
}

/// Where, after the epoch words, the checked barrier ([`HostSync::barrier_agreeing`]) keeps
/// the digest of what each rank passed (8 bytes per rank, per parity of the barrier's epoch),
/// then each parity's verdict: a byte offset in the allocation.
fn digests_at(world_size: usize) -> usize {
    (4 * epoch_words(world_size)).next_multiple_of(8)
}

/// Where, after the digests and verdicts, a disseminating leader keeps each round's agreement:
/// per parity and round, the one it received and the one it sent (two [`AGREEMENT`]s).
fn agreements_at(world_size: usize) -> usize {
    digests_at(world_size) + 2 * world_size * 8 + 2 * 8
}

/// The byte offset (from the allocation's start) of the agreement of `round` and `parity` that
/// a leader received (`sent`: false) or sent.
fn agreement_at(world_size: usize, parity: usize, round: usize, sent: bool) -> usize {
    agreements_at(world_size) + ((parity * rounds(world_size) + round) * 2 + usize::from(sent)) * AGREEMENT
}

/// The allocation's size in 4-byte words: the epoch words, then the digests and verdicts, then
/// the agreements of dissemination (the hosts are at most the ranks).
pub(crate) fn words(world_size: usize) -> usize {
    agreement_at(world_size, 2, 0, false) / 4
}

impl HostSync {
    /// The barrier's words; their alarm word is the group's.
    pub(crate) fn words(&self) -> &Words {
        &self.words
    }

    pub(crate) fn new(words: Tensor, h: Arc<SymmHandle>) -> HostSync {
        let ws = h.world_size();
        HostSync { _words: words, words: Words::new(h, 0).with_alarm(2 * ws + 1), state: Mutex::new(State::default()) }
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
        // A lost peer: told to the group, so that leaders waiting in the rounds for partners
        // that wait in vain, and their hosts, fail too, at once.
        self.barrier_steps(p, timeout, digest).map_err(|e| self.words.report(e))
    }

    fn barrier_steps(&self, p: &Patience, timeout: Duration, digest: Option<u64>) -> Result<u64> {
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
        let leaders: Vec<usize> = h.leaders().collect();
        if leaders.len() >= DISSEMINATE_FROM {
            // Relaxed: this host's digests, copied above from words each rank stored before
            // its ARRIVE (seen with Acquire).
            let of = |r: usize| Agreement::of(r, h.word64(me, slot(r)).load(Ordering::Relaxed));
            let known = digest.map(|_| locals.iter().map(|&r| of(r)).fold(of(me), Agreement::merge));
            let verdict = self.disseminate(&mut st, e, &leaders, known, p, timeout).map_err(what)?;
            // Relaxed: published by RELEASE below.
            h.word64(me, verdict_at).store(verdict, Ordering::Relaxed);
            for &r in &locals[1..] {
                w.publish(r, ws, e);
            }
            st.epoch = e;
            return Ok(verdict);
        }
        let others: Vec<usize> = leaders.into_iter().filter(|&l| l != me).collect();
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

impl HostSync {
    /// A leader's part in barrier `e` among `leaders` (host order) by dissemination: each round
    /// it raises its FROM word on the leader `2^k` after it, after what it knows of the digests
    /// (`known`, when checked), and waits for the word of the one `2^k` before it, merging what
    /// that one sent. Returns the verdict (0 unchecked).
    fn disseminate(
        &self,
        st: &mut State,
        e: u32,
        leaders: &[usize],
        mut known: Option<Agreement>,
        p: &Patience,
        timeout: Duration,
    ) -> Result<u64> {
        let w = &self.words;
        let h = &w.h;
        let (me, ws) = (h.rank(), h.world_size());
        let n = leaders.len();
        let j = leaders.iter().position(|&l| l == me).expect("a leader is among the leaders");
        let parity = (e % 2) as usize;
        let at = |round: usize, sent: bool| h.offset() + agreement_at(ws, parity, round, sent);
        for round in 0..rounds(n) {
            let dist = 1 << round;
            let (to, from) = (leaders[(j + dist) % n], leaders[(j + n - dist) % n]);
            h.batch(to, || -> Result<()> {
                if let Some(a) = known {
                    let out = at(round, true);
                    for (i, v) in a.words().into_iter().enumerate() {
                        // Relaxed: sent by the write below, which the FROM word follows on the
                        // link (in order); rewritten two barriers on, after `settle` saw the
                        // write of this parity complete.
                        h.word64(me, out + 8 * i).store(v, Ordering::Relaxed);
                    }
                    st.sent.push((to, e, h.start_push(to, out, 24, at(round, false), timeout)?));
                }
                st.sent.push((to, e, w.start_remote(to, ws + 1 + me, e, timeout)?));
                Ok(())
            })?;
            w.wait_for(ws + 1 + from, e, from, p, timeout)?;
            if let Some(a) = &mut known {
                let inn = at(round, false);
                // Relaxed: landed before `from`'s FROM word (seen with Acquire above). `from`
                // writes this parity again only in barrier e+2, after this leader's word of
                // e+1 reached it: after this read.
                let theirs = [0, 1, 2].map(|i| h.word64(me, inn + 8 * i).load(Ordering::Relaxed));
                *a = a.merge(Agreement::from_words(theirs));
            }
        }
        Ok(known.map_or(0, Agreement::verdict))
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
    use super::{Agreement, rounds, runs};
    use proptest::prelude::*;

    #[test]
    fn dissemination_takes_the_ceiling_of_log2_hosts_rounds() {
        assert_eq!([1, 2, 3, 4, 5, 8, 9, 1024, 1025].map(rounds), [0, 1, 2, 2, 3, 3, 4, 10, 11]);
    }

    /// The verdict the one-round form computes: 1 + the first rank whose digest differs from
    /// rank 0's.
    fn direct(digests: &[u64]) -> u64 {
        (1..digests.len()).find(|&r| digests[r] != digests[0]).map_or(0, |r| r as u64 + 1)
    }

    /// Dissemination among `hosts` leaders as the barrier runs it, the ranks dealt to the hosts
    /// in turn from host `shift`: every leader's verdict.
    fn disseminated(digests: &[u64], hosts: usize, shift: usize) -> Vec<u64> {
        let host_of = |r: usize| (r + shift) % hosts;
        let mut known: Vec<Option<Agreement>> = vec![None; hosts];
        for (r, &d) in digests.iter().enumerate() {
            let k = &mut known[host_of(r)];
            *k = Some(k.map_or(Agreement::of(r, d), |a| a.merge(Agreement::of(r, d))));
        }
        let mut known: Vec<Agreement> = known.into_iter().map(|k| k.expect("every host has a rank")).collect();
        for round in 0..rounds(hosts) {
            let sent = known.clone();
            for (j, k) in known.iter_mut().enumerate() {
                *k = k.merge(sent[(j + hosts - (1 << round)) % hosts]);
            }
        }
        known.into_iter().map(Agreement::verdict).collect()
    }

    proptest! {
        #[test]
        fn every_leader_reaches_the_one_round_verdict(
            digests in proptest::collection::vec(0u64..3, 1..40),
            hosts in 1usize..40,
            shift in 0usize..40,
        ) {
            let hosts = hosts.min(digests.len());
            let expected = direct(&digests);
            for v in disseminated(&digests, hosts, shift) {
                prop_assert_eq!(v, expected);
            }
        }

        #[test]
        fn merging_is_order_free_and_idempotent(
            digests in proptest::collection::vec(0u64..3, 8), a in 0usize..8, b in 0usize..8, c in 0usize..8
        ) {
            let [a, b, c] = [a, b, c].map(|r| Agreement::of(r, digests[r]));
            prop_assert_eq!(a.merge(b), b.merge(a));
            prop_assert_eq!(a.merge(b).merge(c), a.merge(b.merge(c)));
            prop_assert_eq!(a.merge(b).merge(b), a.merge(b));
        }
    }

    #[test]
    fn runs_are_the_stretches_of_consecutive_ranks() {
        let of = |r: &[usize]| runs(r).collect::<Vec<_>>();
        assert_eq!(of(&[0, 1, 2, 5, 6, 9]), [(0, 3), (3, 5), (5, 6)]);
        assert_eq!(of(&[4]), [(0, 1)]);
        assert_eq!(of(&[1, 3, 5]), [(0, 1), (1, 2), (2, 3)]);
        assert_eq!(of(&[]), []);
    }
}
