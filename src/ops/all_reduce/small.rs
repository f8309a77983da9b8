//! The small-message all-reduce: one synchronization per call (DeepSpeed's "symmetric naive"
//! scheme, `docs/symm-mem-algorithms.md` §3, with epoch counters).
//!
//! ```text
//!   per group, a symmetric workspace:
//!     [ epoch u64 | (numel, dtype·op) u64×2 per parity | sleepers u32 at 64 (128 B) | buf 0 | buf 1 ]
//!   call k:  wait until every peer's epoch >= k-1   (they finished reading buf k%2 of call k-2)
//!            copy the input into my buf k%2 and what it is into my parity k%2 words;
//!            publish epoch = k
//!            wait until every peer's epoch >= k     (their inputs of call k are in place)
//!            check every rank passed what rank 0 did (the same error on every rank if not)
//!            reduce every rank's buf k%2, in rank order, into the output
//! ```
//!
//! A rank that publishes epoch k has finished call k-1, reads included, so a buffer is reused
//! only after every peer is done with it: no trailing barrier. Orderings: the epoch store is
//! Release after the copy and pairs with the Acquire epoch loads of the readers; a reader's
//! next epoch store (Release) comes after its reads and pairs with the writer's Acquire wait
//! before it overwrites. Waiting follows the crate's one patience policy
//! (`sync::wait_until`: spin, yield the core, then sleep on the epoch word's futex); a
//! publisher wakes sleepers only when one declared itself (Dekker-style on SeqCst operations,
//! with a bounded nap as a safety net).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::reduce::{self, ReduceOp};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::symm::{self, Device, SymmHandle};
use crate::sync::{Patience, Stop, wait_until};
use crate::tensor::{DType, Tensor};

/// The largest message this path takes.
pub(crate) const MAX: usize = super::ONE_SHOT_MAX;
const HEADER: usize = 128;

struct Workspace {
    _tensor: Tensor,
    handle: Arc<SymmHandle>,
    epoch: u64,
}

/// The group's workspace, made at its first small all-reduce (kept in the group).
#[derive(Default)]
struct State(Mutex<Option<Workspace>>);

/// The words saying what `rank` passed to the call of parity `parity`: its element count, and
/// its dtype and reduction.
fn what(h: &SymmHandle, rank: usize, parity: u64) -> [&AtomicU64; 2] {
    // Bytes 8..40 of the 128-byte header.
    let at = h.offset() + 8 + 16 * parity as usize;
    [h.word64(rank, at), h.word64(rank, at + 8)]
}

/// The epoch word and the sleepers count of `rank`'s workspace (bytes 0 and 64 of the header).
fn words(h: &SymmHandle, rank: usize) -> (&AtomicU64, &AtomicU32) {
    (h.word64(rank, h.offset()), h.word32(rank, h.offset() + 64))
}

fn wait_for(h: &SymmHandle, rank: usize, at_least: u64, p: &Patience, timeout: Duration) -> Result<()> {
    let (epoch, sleepers) = words(h, rank);
    // The futex word is the epoch's low half (little-endian), which changes with every publish.
    let low = h.word32(rank, h.offset());
    // Acquire: pairs with the Release (SeqCst) store of `publish`.
    let done = || epoch.load(Ordering::Acquire) >= at_least;
    let sleep = |_: u32, nap: Duration| {
        // SeqCst pairs with the SeqCst store and load in `publish` (no lost wake-up).
        sleepers.fetch_add(1, Ordering::SeqCst);
        let now = epoch.load(Ordering::SeqCst);
        if now < at_least {
            crate::sys::futex::wait(low, now as u32, nap);
        }
        sleepers.fetch_sub(1, Ordering::SeqCst);
    };
    match wait_until(low, done, p, || Ok::<(), Error>(()), sleep) {
        Ok(()) => Ok(()),
        Err(Stop::Failed(e)) => Err(e),
        Err(Stop::TimedOut) => Err(Error::timeout(
            format!(
                "all_reduce: rank {} waiting for rank {rank} to reach call {at_least} (is it in another operator, \
                 or in an all_reduce of a size that takes another algorithm?)",
                h.rank()
            ),
            timeout,
        )),
    }
}

fn publish(h: &SymmHandle, k: u64) {
    let (epoch, sleepers) = words(h, h.rank());
    // SeqCst (a Release at least): pairs with the Acquire/SeqCst loads in `wait_for`.
    epoch.store(k, Ordering::SeqCst);
    if sleepers.load(Ordering::SeqCst) > 0 {
        crate::sys::futex::wake(h.word32(h.rank(), h.offset()));
    }
}

/// In-place all-reduce of at most [`MAX`] bytes.
pub(crate) fn all_reduce(tensor: &Tensor, op: ReduceOp, group: &Group, timeout: Duration) -> Result<()> {
    let bytes = tensor.nbytes();
    let state = group.state::<State>();
    let mut slot = state.0.lock().unwrap_or_else(|p| p.into_inner());
    let ws = match &mut *slot {
        Some(ws) => ws,
        None => {
            // Collective: every rank's first small all-reduce on this group creates it.
            let t = symm::empty(&[HEADER + 2 * MAX], DType::U8, Device::Cpu)?;
            let handle = symm::rendezvous(&t, group)?;
            handle.barrier(0, timeout)?;
            slot.insert(Workspace { _tensor: t, handle, epoch: 0 })
        }
    };
    ws.epoch += 1;
    let (k, h) = (ws.epoch, ws.handle.clone());
    drop(slot);
    let p = h.patience(timeout);
    let buf = HEADER + ((k % 2) as usize) * MAX;
    let n = h.world_size();
    for r in (0..n).filter(|&r| r != h.rank()) {
        wait_for(&h, r, k - 1, &p, timeout)?;
    }
    let mine = (h.read_ptr(h.rank()) + h.offset() + buf) as *mut u8;
    // SAFETY: buf k%2 of my workspace holds MAX >= bytes bytes, and no peer reads it now (each
    // has published k-1, so finished call k-2, the last to read it).
    unsafe { std::ptr::copy_nonoverlapping(tensor.data_ptr().cast_const(), mine, bytes) };
    let sig = crate::ops::check::counts(tensor, Some(op));
    for (w, v) in what(&h, h.rank(), k % 2).into_iter().zip(sig) {
        // Relaxed: published by the epoch's Release store in `publish`.
        w.store(v, Ordering::Relaxed);
    }
    publish(&h, k);
    for r in (0..n).filter(|&r| r != h.rank()) {
        wait_for(&h, r, k, &p, timeout)?;
    }
    // Every rank reads every rank's words, so every rank reaches the same verdict. Relaxed:
    // ordered by the Acquire epoch loads above.
    let of = |r: usize| what(&h, r, k % 2).map(|w| w.load(Ordering::Relaxed));
    let first = of(0);
    if let Some(r) = (1..n).find(|&r| of(r) != first) {
        return Err(crate::ops::check::counts_disagree("all_reduce", first, r, of(r)));
    }
    // Source pointers on the stack: no allocation on the small-message path.
    let mut srcs = [std::ptr::null::<u8>(); 64];
    let mut heap = Vec::new();
    let srcs: &[*const u8] = if n <= srcs.len() {
        for (r, s) in srcs.iter_mut().enumerate().take(n) {
            *s = (h.read_ptr(r) + h.offset() + buf) as *const u8;
        }
        &srcs[..n]
    } else {
        heap.extend((0..n).map(|r| (h.read_ptr(r) + h.offset() + buf) as *const u8));
        &heap
    };
    // SAFETY: every rank's buf k%2 holds its input of call k (published with Release, observed
    // with Acquire) and is not rewritten before call k+2, which waits for our epoch k+1.
    unsafe { reduce::reduce(tensor.dtype(), op, srcs, &[tensor.data_ptr()], tensor.numel(), n) }
}
