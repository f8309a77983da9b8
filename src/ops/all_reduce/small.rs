//! The small-message all-reduce: one synchronization per call (DeepSpeed's "symmetric naive"
//! scheme, `docs/symm-mem-algorithms.md` §3, with epoch counters), and for the smallest inputs
//! one cache line per rank per call (Open MPI's "fast boxes"): the input travels in the line
//! that carries the epoch, so a peer's arrival and its data come in one line transfer.
//!
//! ```text
//!   per group, a symmetric workspace (64-byte lines):
//!     line p (p = 0, 1):  epoch u64 | numel u64 | dtype·op u64 | inline input (40 B)
//!     line 2:             sleepers u32
//!     buf 0 | buf 1       inputs too large for the line (up to MAX)
//!   call k (parity q = k % 2):
//!            wait until every peer's line 1-q epoch >= k-1  (they finished call k-2, which read
//!                                                            line q and buf q)
//!            copy the input into my line q (≤ 40 B) or buf q, what it is into line q's words;
//!            publish line q's epoch = k
//!            wait until every peer's line q epoch >= k      (their inputs of call k are in place)
//!            check every rank passed what rank 0 did (the same error on every rank if not)
//!            reduce every rank's input of call k, in rank order, into the output
//! ```
//!
//! A rank that publishes epoch k has finished call k-1, reads included, so a line or buffer is
//! reused only after every peer is done with it: no trailing barrier. Orderings: the epoch
//! store is Release after the copy and pairs with the Acquire epoch loads of the readers; a
//! reader's next epoch store (Release) comes after its reads and pairs with the writer's
//! Acquire wait before it overwrites. Waiting follows the crate's one patience policy
//! (`sync::wait_until`: spin, yield the core, then sleep on the epoch word's futex, counted in
//! line 2 by `sync::sleep_on`); a publisher wakes sleepers only when one counted itself
//! (`sync::wake_word`, the crate's one pairing for it, with a bounded nap as a safety net).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::reduce::{self, ReduceOp};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::symm::{self, Device, SymmHandle};
use crate::sync::{Patience, Stop, sleep_on, wait_until, wake_word};
use crate::tensor::{DType, Tensor};

/// The largest message this path takes.
pub(crate) const MAX: usize = super::ONE_SHOT_MAX;
/// A cache line.
const LINE: usize = 64;
/// The largest input carried in the epoch's line (after three words).
pub(crate) const INLINE: usize = LINE - 24;
/// Where the sleepers count is.
const SLEEPERS: usize = 2 * LINE;
/// Where the buffers start.
const HEADER: usize = 3 * LINE;
/// The workspace's size: the header and the two buffers.
const SIZE: usize = HEADER + 2 * MAX;

/// The group's workspace: the symmetric tensor, its handle, and where each rank's copy is.
struct Lines {
    _tensor: Tensor,
    handle: Arc<SymmHandle>,
    /// Each rank's workspace address in this process: checked once, when made (inside the
    /// rank's mapping, line-aligned), so a word costs an addition per call.
    bases: Vec<usize>,
}

impl Lines {
    fn new(tensor: Tensor, handle: Arc<SymmHandle>) -> Lines {
        let bases = (0..handle.world_size())
            .map(|r| {
                // The checked accessors vouch for the first and the last word (in the rank's
                // buffer, aligned); every word used lies between them.
                let first = handle.word64(r, handle.offset()) as *const AtomicU64 as usize;
                let _last = handle.word64(r, handle.offset() + SIZE - 8);
                assert!(first.is_multiple_of(LINE), "the small all-reduce workspace is not line-aligned");
                first
            })
            .collect();
        Lines { _tensor: tensor, handle, bases }
    }

    /// The 8-byte word at byte `at` of `rank`'s workspace.
    fn word64(&self, rank: usize, at: usize) -> &AtomicU64 {
        debug_assert!(at + 8 <= SIZE && at.is_multiple_of(8));
        // SAFETY: bases[rank] is rank's workspace, checked in `new` to hold SIZE bytes of
        // shared memory mapped while `self.handle` lives (so for this borrow); `at` is one of
        // this module's 8-aligned offsets below SIZE. Every process touches these words only
        // atomically.
        unsafe { &*((self.bases[rank] + at) as *const AtomicU64) }
    }

    /// The 4-byte word at byte `at` of `rank`'s workspace.
    fn word32(&self, rank: usize, at: usize) -> &AtomicU32 {
        debug_assert!(at + 4 <= SIZE && at.is_multiple_of(4));
        // SAFETY: as in word64, for 4 bytes, 4-aligned.
        unsafe { &*((self.bases[rank] + at) as *const AtomicU32) }
    }

    /// The words saying what `rank` passed to the call of parity `parity`: its element count,
    /// and its dtype and reduction (bytes 8..24 of the parity's line).
    fn what(&self, rank: usize, parity: u64) -> [&AtomicU64; 2] {
        let at = LINE * parity as usize + 8;
        [self.word64(rank, at), self.word64(rank, at + 8)]
    }

    /// The epoch word of `rank`'s line `parity`.
    fn epoch(&self, rank: usize, parity: u64) -> &AtomicU64 {
        self.word64(rank, LINE * parity as usize)
    }

    /// Where `rank`'s input of a call of parity `parity` and `bytes` bytes is.
    fn input(&self, rank: usize, parity: u64, bytes: usize) -> usize {
        let at = if bytes <= INLINE { LINE * parity as usize + 24 } else { HEADER + parity as usize * MAX };
        self.bases[rank] + at
    }

    fn wait_for(&self, rank: usize, parity: u64, at_least: u64, p: &Patience, timeout: Duration) -> Result<()> {
        let epoch = self.epoch(rank, parity);
        // Acquire: pairs with the Release (SeqCst) store of `publish`. Checked once before the
        // wait's machinery is set up: usually the peer is already there.
        let done = || epoch.load(Ordering::Acquire) >= at_least;
        if done() {
            return Ok(());
        }
        let sleepers = self.word32(rank, SLEEPERS);
        // The futex word is the epoch's low half (little-endian), which changes with every
        // publish.
        let low = self.word32(rank, LINE * parity as usize);
        let sleep = |seen: u32, nap: Duration| sleep_on(low, seen, nap, Some(sleepers));
        match wait_until(low, done, p, || Ok::<(), Error>(()), sleep) {
            Ok(()) => Ok(()),
            Err(Stop::Failed(e)) => Err(e),
            Err(Stop::TimedOut) => Err(Error::timeout(
                format!(
                    "all_reduce: rank {} waiting for rank {rank} to reach call {at_least} (is it in another \
                     operator, or in an all_reduce of a size that takes another algorithm?)",
                    self.handle.rank()
                ),
                timeout,
            )),
        }
    }

    fn publish(&self, k: u64) {
        let (me, parity) = (self.handle.rank(), k % 2);
        // Release: pairs with the Acquire loads in `wait_for`; `wake_word`'s fence orders it
        // before the load of the sleepers count (its partner is the fence in `sleep_on`).
        self.epoch(me, parity).store(k, Ordering::Release);
        wake_word(self.word32(me, LINE * parity as usize), Some(self.word32(me, SLEEPERS)));
    }
}

struct Workspace {
    lines: Arc<Lines>,
    epoch: u64,
}

/// The group's workspace, made at its first small all-reduce (kept in the group).
#[derive(Default)]
struct State(Mutex<Option<Workspace>>);

/// In-place all-reduce of at most [`MAX`] bytes.
pub(crate) fn all_reduce(tensor: &Tensor, op: ReduceOp, group: &Group, timeout: Duration) -> Result<()> {
    let state = group.state::<State>();
    let mut slot = state.0.lock().unwrap_or_else(|p| p.into_inner());
    let ws = match &mut *slot {
        Some(ws) => ws,
        None => {
            // Collective: every rank's first small all-reduce on this group creates it.
            let t = symm::empty(&[SIZE], DType::U8, Device::Cpu)?;
            let handle = symm::rendezvous(&t, group)?;
            handle.barrier(0, timeout)?;
            slot.insert(Workspace { lines: Arc::new(Lines::new(t, handle)), epoch: 0 })
        }
    };
    ws.epoch += 1;
    let (k, lines) = (ws.epoch, ws.lines.clone());
    drop(slot);
    run(tensor, op, k, &lines, timeout)
}

/// [`all_reduce`] when the group has made its workspace, all its ranks are on this host and
/// [`super::select`] picks this path for the size (what the caller would learn from the
/// tensor's own rendezvous, skipped); `None` otherwise, with nothing done.
pub(crate) fn all_reduce_on_host(
    tensor: &Tensor,
    op: ReduceOp,
    group: &Group,
    timeout: Duration,
) -> Option<Result<()>> {
    let state = group.state::<State>();
    let mut slot = state.0.lock().unwrap_or_else(|p| p.into_inner());
    let ws = slot.as_mut().filter(|ws| {
        let h = &ws.lines.handle;
        h.all_local() && super::select(tensor.nbytes(), h.crowded(), 1, 1, None) == super::Algo::Small
    })?;
    ws.epoch += 1;
    let (k, lines) = (ws.epoch, ws.lines.clone());
    drop(slot);
    Some(run(tensor, op, k, &lines, timeout))
}

/// Call `k` of the small all-reduce on the workspace `w`.
fn run(tensor: &Tensor, op: ReduceOp, k: u64, w: &Lines, timeout: Duration) -> Result<()> {
    let bytes = tensor.nbytes();
    // Reads no clock until a wait must (its deadline is fixed at the first reading).
    let p = w.handle.patience(timeout);
    let q = k % 2;
    let (me, n) = (w.handle.rank(), w.handle.world_size());
    for r in (0..n).filter(|&r| r != me) {
        w.wait_for(r, 1 - q, k - 1, &p, timeout)?;
    }
    let mine = w.input(me, q, bytes) as *mut u8;
    // SAFETY: my input place of parity q holds INLINE (line) or MAX (buffer) >= bytes bytes
    // inside my workspace, and no peer reads it now (each has published k-1, so finished call
    // k-2, the last to read it).
    unsafe { std::ptr::copy_nonoverlapping(tensor.data_ptr().cast_const(), mine, bytes) };
    let sig = crate::ops::check::counts(tensor, Some(op));
    for (word, v) in w.what(me, q).into_iter().zip(sig) {
        // Relaxed: published by the epoch's Release store in `publish`.
        word.store(v, Ordering::Relaxed);
    }
    w.publish(k);
    for r in (0..n).filter(|&r| r != me) {
        w.wait_for(r, q, k, &p, timeout)?;
    }
    // Every rank reads every rank's words, so every rank reaches the same verdict. Relaxed:
    // ordered by the Acquire epoch loads above.
    let of = |r: usize| w.what(r, q).map(|word| word.load(Ordering::Relaxed));
    let first = of(0);
    if let Some(r) = (1..n).find(|&r| of(r) != first) {
        return Err(crate::ops::check::counts_disagree("all_reduce", first, r, of(r)));
    }
    // Source pointers on the stack: no allocation on the small-message path.
    let mut srcs = [std::ptr::null::<u8>(); 16];
    let mut heap = Vec::new();
    let srcs: &[*const u8] = if n <= srcs.len() {
        for (r, s) in srcs.iter_mut().enumerate().take(n) {
            *s = w.input(r, q, bytes) as *const u8;
        }
        &srcs[..n]
    } else {
        heap.extend((0..n).map(|r| w.input(r, q, bytes) as *const u8));
        &heap
    };
    // SAFETY: every rank's input place of parity q holds its input of call k (published with
    // Release, observed with Acquire; every rank agreed on the size, so on the place) and is
    // not rewritten before call k+2, which waits for our epoch k+1.
    unsafe { reduce::reduce(tensor.dtype(), op, srcs, &[tensor.data_ptr()], tensor.numel(), n) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::run_threads;

    /// The on-host entry declines (doing nothing) until the group's workspace exists; then it
    /// reduces a tensor that was never rendezvoused, as the public call does.
    #[test]
    fn the_on_host_entry_waits_for_the_workspace_then_skips_the_rendezvous() {
        let t = Duration::from_secs(30);
        run_threads(2, |g| {
            let mine = g.rank() as f32 + 1.0;
            let x = symm::empty(&[4], DType::F32, Device::Cpu)?;
            x.fill(mine)?;
            assert!(all_reduce_on_host(&x, ReduceOp::Sum, &g, t).is_none());
            assert_eq!(x.to_vec::<f32>()?, [mine; 4], "a declined call changed its input");
            crate::ops::all_reduce(&x, ReduceOp::Sum, &g)?;
            assert_eq!(x.to_vec::<f32>()?, [3.0; 4]);
            let y = symm::empty(&[3], DType::F32, Device::Cpu)?;
            y.fill(mine)?;
            all_reduce_on_host(&y, ReduceOp::Max, &g, t).expect("the workspace exists")?;
            assert_eq!(y.to_vec::<f32>()?, [2.0; 3]);
            Ok(())
        })
        .unwrap();
    }

    /// Inputs in the line and in the buffers, alternating from call to call (so each parity's
    /// line and buffer are reused in turn), on 3 ranks: every result equals the sum computed
    /// here, and a call whose ranks disagree across the boundary fails on every rank.
    #[test]
    fn inputs_in_the_line_and_in_the_buffers_alternate_and_agree() {
        let t = Duration::from_secs(30);
        run_threads(3, |g| {
            let x = symm::empty(&[4096], DType::F32, Device::Cpu)?;
            let sizes = [1usize, INLINE / 4 - 1, INLINE / 4, INLINE / 4 + 1, 2, 300, 10, MAX / 4];
            for round in 0..40usize {
                let n = sizes[round % sizes.len()];
                let v = x.narrow(0, 0, n)?;
                let mine: Vec<f32> = (0..n).map(|i| (g.rank() * 1000 + i + round) as f32).collect();
                v.copy_from_slice(&mine)?;
                all_reduce(&v, ReduceOp::Sum, &g, t)?;
                let want: Vec<f32> = (0..n).map(|i| (3000 + 3 * (i + round)) as f32).collect();
                assert_eq!(v.to_vec::<f32>()?, want, "round {round}, {n} elements");
            }
            // One rank's input fits the line, another's does not: the same error everywhere.
            let n = if g.rank() == 1 { INLINE / 4 + 1 } else { 2 };
            let e = all_reduce(&x.narrow(0, 0, n)?, ReduceOp::Sum, &g, t).unwrap_err().to_string();
            assert!(e.contains("disagree") && e.contains("rank 1 pass"), "{e}");
            // And the next call works again.
            let v = x.narrow(0, 0, 4)?;
            v.fill(1.0f32)?;
            all_reduce(&v, ReduceOp::Sum, &g, t)?;
            assert_eq!(v.to_vec::<f32>()?, vec![3.0; 4]);
            Ok(())
        })
        .unwrap();
    }
}
