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
            crate::sync::wake_word(w, reg.sleepers());
            Ok(false)
        }
        Atomic::Set64 => {
            // SAFETY: as above, for an aligned 8-byte word.
            let w = unsafe { &*at.cast::<AtomicU64>() };
            // Release: pairs with the Acquire load of the word's poller (see Set32).
            w.store(operand, Ordering::Release);
            // SAFETY: the low 4 bytes of the aligned word (a poller sleeps on them), only
            // accessed atomically.
            crate::sync::wake_word(unsafe { &*at.cast::<AtomicU32>() }, reg.sleepers());
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::WAKES;
    use crate::tensor::{DType, Storage, Tensor};

    fn wakes() -> usize {
        WAKES.with(|w| w.get())
    }

    /// Memory that keeps a sleepers count, as a symmetric allocation's segment does.
    #[derive(Debug)]
    struct Counted {
        words: Box<[AtomicU64; 8]>,
        sleepers: AtomicU32,
    }

    // SAFETY: the 64 bytes are the boxed words, which live (at a fixed address) as long as the
    // storage.
    unsafe impl Storage for Counted {
        fn ptr(&self) -> *mut u8 {
            self.words.as_ptr().cast_mut().cast()
        }
        fn len(&self) -> usize {
            64
        }
        fn sleepers(&self) -> Option<&AtomicU32> {
            Some(&self.sleepers)
        }
    }

    /// A peer's signal into memory that keeps a sleepers count skips the futex wake while the
    /// count is zero, and makes it when a sleeper is counted; into memory that keeps none (a
    /// plain tensor), it always wakes.
    #[test]
    fn a_remote_store_wakes_only_where_someone_sleeps() {
        let t = crate::transport::new_transport("tcp", None, &Default::default()).unwrap();
        let counted = std::sync::Arc::new(Counted { words: Box::default(), sleepers: AtomicU32::new(0) });
        let symm = Tensor::from_storage(counted.clone(), &[64], DType::U8);
        let heap = Tensor::zeros(&[64], DType::U8).unwrap();
        let (s, h) = (t.register_memory(&symm).unwrap(), t.register_memory(&heap).unwrap());
        let word = |i: usize| counted.words[i].load(Ordering::Acquire);
        let before = wakes();
        assert_eq!(apply_atomic(&s.reg, &s.reg.key, 8, Atomic::Set32, 7), Ok(false));
        assert_eq!(apply_atomic(&s.reg, &s.reg.key, 16, Atomic::Set64, 1 << 40 | 9), Ok(false));
        assert_eq!((word(1), word(2)), (7, 1 << 40 | 9));
        assert_eq!(wakes(), before, "a store with nobody asleep made a system call");
        // A sleeper counted (as `sync::sleep_on` counts one): woken.
        counted.sleepers.fetch_add(1, Ordering::SeqCst);
        assert_eq!(apply_atomic(&s.reg, &s.reg.key, 8, Atomic::Set32, 8), Ok(false));
        assert_eq!(apply_atomic(&s.reg, &s.reg.key, 16, Atomic::Set64, 10), Ok(false));
        counted.sleepers.fetch_sub(1, Ordering::SeqCst);
        assert_eq!(wakes(), before + 2);
        // No count: every store wakes.
        assert!(h.reg.sleepers().is_none());
        assert_eq!(apply_atomic(&h.reg, &h.reg.key, 8, Atomic::Set32, 7), Ok(false));
        assert_eq!(wakes(), before + 3);
        // A refused store (a wrong key) stores and wakes nothing.
        assert!(apply_atomic(&s.reg, &[0; 16], 8, Atomic::Set32, 99).is_err());
        assert_eq!((word(1), wakes()), (8, before + 3));
    }
}
