//! What a backend does on behalf of a peer, the same for every backend that serves requests
//! itself (`tcp`, `ucx`): apply a remote atomic to a registered word, after the access check.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::{Atomic, Registration};
use crate::sync::{Patience, slot as signal};

/// Applies `op` with `operand` to the word at `offset` of `reg`, which the peer names with
/// `key`: checks access (key, liveness, bounds, write permission) and alignment first. Returns
/// whether a signal slot was busy (the initiator's to retry; this never waits), or why it was
/// refused.
pub(crate) fn apply_atomic(
    reg: &Registration,
    key: &[u8; 16],
    offset: u64,
    op: Atomic,
    operand: u64,
) -> std::result::Result<bool, String> {
    if !offset.is_multiple_of(op.width()) {
        return Err(format!("a {op:?} acts on an aligned {}-byte word", op.width()));
    }
    reg.check_access(key, offset, op.width(), true)?;
    let at = reg.ptr().wrapping_add(offset as usize);
    if !(at as usize).is_multiple_of(op.width() as usize) {
        return Err("the word is not aligned in memory".into());
    }
    match op {
        Atomic::SlotPut => {
            // SAFETY: check_access put the 4 bytes inside the live registration, which the
            // caller's reference keeps alive, and `at` is 4-aligned (checked); peers touch
            // signal slots only atomically, so viewing them as an AtomicU32 is sound.
            let slot = unsafe { &*at.cast::<AtomicU32>() };
            // One attempt, no waiting: a busy slot is the initiator's to retry, so the serving
            // thread never blocks on a peer.
            match signal::put(slot, &Patience::once()) {
                Ok(()) => Ok(false),
                Err(signal::Failure::TimedOut) => Ok(true),
                Err(signal::Failure::Corrupt(v)) => {
                    Err(format!("the signal slot holds {v}, which the signal protocol never writes"))
                }
            }
        }
        Atomic::Set32 => {
            // SAFETY: as above, for an aligned 4-byte word.
            let w = unsafe { &*at.cast::<AtomicU32>() };
            // Release: pairs with the Acquire load of whoever polls the word, after the
            // initiator's earlier writes on this link (acknowledged before it sent this).
            w.store(operand as u32, Ordering::Release);
            crate::sys::futex::wake(w);
            Ok(false)
        }
        Atomic::Set64 => {
            // SAFETY: as above, for an aligned 8-byte word.
            let w = unsafe { &*at.cast::<AtomicU64>() };
            // Release: pairs with the Acquire load of the word's poller (see Set32).
            w.store(operand, Ordering::Release);
            // SAFETY: the low 4 bytes of the aligned word (a poller sleeps on them), only
            // accessed atomically.
            crate::sys::futex::wake(unsafe { &*at.cast::<AtomicU32>() });
            Ok(false)
        }
    }
}
