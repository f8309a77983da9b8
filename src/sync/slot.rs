//! The signal-pad slot protocol: PyTorch's self-resetting slots, plus sleeping.
//!
//! A pad is an array of `u32` slots; the slot that rank `src` signals on channel `c` of rank
//! `dst`'s pad is `pad_dst[c * world_size + src]` (`docs/symm-mem-algorithms.md`
//! §1). PyTorch's protocol (§2 there): put turns 0 into 1 and blocks while the slot is still 1
//! (the previous signal not yet consumed); wait turns 1 into 0. Signals are boolean and the
//! pad returns to all zeros after balanced use.
//!
//! On CPUs a rank may have to sleep: eight ranks on two cores cannot all spin. Each slot has
//! exactly one putter (its source rank) and one waiter (its owner), so two more states suffice
//! to say who sleeps on the slot's futex:
//!
//! ```text
//!   0 EMPTY      no signal                      put: 0 → 1          wait: 0 → 2, sleep
//!   1 SIGNALED   a signal, not consumed          put: 1 → 3, sleep   wait: 1 → 0
//!   2 WAITER     no signal, the waiter sleeps   put: 2 → 1, wake    wait: sleep
//!   3 PUTTER     a signal, the putter sleeps    put: sleep          wait: 3 → 0, wake
//! ```
//!
//! Both sides spin first (a futex wake costs tens of microseconds), then publish that they
//! sleep with a CAS and sleep only while the slot holds that value, so no wake is lost. A side
//! that gives up at its deadline withdraws its sleeping mark with a CAS (2 → 0, 3 → 1); if that
//! CAS fails the other side has just acted, and the loop looks again. Balanced use leaves every
//! slot 0.
//!
//! Ordering: every state change is a CAS with AcqRel. A put's CAS releases the data written
//! before it, and pairs with the Acquire of the wait's CAS that consumes the signal; the
//! consuming CAS releases the waiter's reads of the data, and pairs with the Acquire of the
//! putter's next CAS, so a putter never overwrites data the waiter is still reading.
//!
//! The protocol is generic over [`SlotWord`] so that a loom test explores every interleaving of
//! the same code with model-checked atomics.

use super::{Patience, SlotWord, Spinner};

/// Why a put or wait did not complete.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The deadline passed.
    TimedOut,
    /// The slot held a value the protocol never writes (user code wrote into the pad).
    Corrupt(u32),
}

/// No signal.
pub(crate) const EMPTY: u32 = 0;
/// A signal not yet consumed.
pub(crate) const SIGNALED: u32 = 1;
/// No signal, and the waiter sleeps on the slot.
pub(crate) const WAITER: u32 = 2;
/// A signal, and the putter sleeps on the slot until it is consumed.
pub(crate) const PUTTER: u32 = 3;

/// Raises the signal in `slot`, waiting while the previous one is unconsumed.
pub(crate) fn put<W: SlotWord>(slot: &W, p: &Patience) -> Result<(), Failure> {
    let mut spinner = Spinner::new();
    loop {
        match slot.load() {
            EMPTY => {
                if slot.cas(EMPTY, SIGNALED).is_ok() {
                    return Ok(());
                }
            }
            WAITER => {
                if slot.cas(WAITER, SIGNALED).is_ok() {
                    slot.wake();
                    return Ok(());
                }
            }
            SIGNALED => {
                if spinner.keep_spinning(p, slot) {
                    continue;
                }
                let Some(t) = p.nap() else { return Err(Failure::TimedOut) };
                if slot.cas(SIGNALED, PUTTER).is_ok() {
                    slot.sleep(PUTTER, t);
                }
            }
            PUTTER => match p.nap() {
                Some(t) => slot.sleep(PUTTER, t),
                // Withdraw the sleeping mark; if the waiter consumed meanwhile, try again.
                None if slot.cas(PUTTER, SIGNALED).is_ok() => return Err(Failure::TimedOut),
                None => {}
            },
            other => return Err(Failure::Corrupt(other)),
        }
    }
}

/// Consumes the signal in `slot`, waiting until there is one.
pub(crate) fn wait<W: SlotWord>(slot: &W, p: &Patience) -> Result<(), Failure> {
    let mut spinner = Spinner::new();
    loop {
        match slot.load() {
            SIGNALED => {
                if slot.cas(SIGNALED, EMPTY).is_ok() {
                    return Ok(());
                }
            }
            PUTTER => {
                if slot.cas(PUTTER, EMPTY).is_ok() {
                    slot.wake();
                    return Ok(());
                }
            }
            EMPTY => {
                if spinner.keep_spinning(p, slot) {
                    continue;
                }
                let Some(t) = p.nap() else { return Err(Failure::TimedOut) };
                if slot.cas(EMPTY, WAITER).is_ok() {
                    slot.sleep(WAITER, t);
                }
            }
            WAITER => match p.nap() {
                Some(t) => slot.sleep(WAITER, t),
                None if slot.cas(WAITER, EMPTY).is_ok() => return Err(Failure::TimedOut),
                None => {}
            },
            other => return Err(Failure::Corrupt(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicU32;
    use std::time::{Duration, Instant};

    fn patience(spin_us: u64, timeout_ms: u64) -> Patience {
        let spin = Duration::from_micros(spin_us);
        Patience::with(spin, spin, Duration::from_millis(timeout_ms))
    }

    #[test]
    fn balanced_use_leaves_zero_across_threads_with_sleeping() {
        for spin_us in [0, 50] {
            let slot = Arc::new(AtomicU32::new(0));
            let s = slot.clone();
            let putter = std::thread::spawn(move || {
                for _ in 0..2000 {
                    put(&*s, &patience(spin_us, 10_000)).unwrap();
                }
            });
            for _ in 0..2000 {
                wait(&*slot, &patience(spin_us, 10_000)).unwrap();
            }
            putter.join().unwrap();
            assert_eq!(slot.load(std::sync::atomic::Ordering::SeqCst), EMPTY);
        }
    }

    #[test]
    fn timeouts_withdraw_and_leave_the_slot_usable() {
        let slot = AtomicU32::new(0);
        let t = Instant::now();
        assert_eq!(wait(&slot, &patience(10, 50)), Err(Failure::TimedOut));
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert_eq!(SlotWord::load(&slot), EMPTY, "the waiter withdrew its mark");
        put(&slot, &patience(10, 50)).unwrap();
        // A second put blocks on the unconsumed first one, and times out.
        assert_eq!(put(&slot, &patience(10, 50)), Err(Failure::TimedOut));
        assert_eq!(SlotWord::load(&slot), SIGNALED, "the putter withdrew its mark");
        wait(&slot, &patience(10, 50)).unwrap();
        assert_eq!(SlotWord::load(&slot), EMPTY);
        slot.store(7, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(wait(&slot, &patience(10, 50)), Err(Failure::Corrupt(7)));
    }

    /// Model-checks the protocol with loom: every interleaving of the same `put` and `wait`
    /// code, with sleeping modelled as a spurious-wakeup-allowed yield.
    #[allow(unsafe_code, reason = "loom's UnsafeCell detects the data races the protocol must prevent")]
    mod model {
        use super::super::*;
        use loom::sync::Arc;
        use loom::sync::atomic::{AtomicU32, Ordering};
        use std::time::Duration;

        struct LoomSlot(AtomicU32);

        impl SlotWord for LoomSlot {
            fn load(&self) -> u32 {
                self.0.load(Ordering::Acquire)
            }
            fn cas(&self, current: u32, new: u32) -> Result<u32, u32> {
                self.0.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
            }
            fn sleep(&self, _expected: u32, _timeout: Duration) {
                loom::thread::yield_now();
            }
            fn wake(&self) {}
            fn relax(&self) {
                loom::thread::yield_now();
            }
            fn yield_now(&self) {
                loom::thread::yield_now();
            }
        }

        fn forever() -> Patience {
            // No spinning: go straight to the sleeping states, the interesting part.
            Patience::with(Duration::ZERO, Duration::ZERO, Duration::from_secs(3600))
        }

        #[test]
        fn ping_pong_orders_data_both_ways_and_ends_empty() {
            loom::model(|| {
                // ready: writer → reader; done: reader → writer. The payload cell is written by
                // the writer and read by the reader; loom reports a data race unless the
                // protocol's orderings make every access happen-after the previous one.
                let ready = Arc::new(LoomSlot(AtomicU32::new(0)));
                let done = Arc::new(LoomSlot(AtomicU32::new(0)));
                let data = Arc::new(loom::cell::UnsafeCell::new(0u32));
                let (r, d, cell) = (ready.clone(), done.clone(), data.clone());
                let writer = loom::thread::spawn(move || {
                    for round in 1..=2 {
                        cell.with_mut(|p| {
                            // SAFETY: the protocol orders this write after the reader's last
                            // read; loom checks exactly that.
                            unsafe { *p = round }
                        });
                        put(&*r, &forever()).unwrap();
                        wait(&*d, &forever()).unwrap();
                    }
                });
                for round in 1..=2 {
                    wait(&*ready, &forever()).unwrap();
                    let seen = data.with(|p| {
                        // SAFETY: ordered after the writer's write by ready's CAS pair.
                        unsafe { *p }
                    });
                    assert_eq!(seen, round);
                    put(&*done, &forever()).unwrap();
                }
                writer.join().unwrap();
                assert_eq!((ready.load(), done.load()), (EMPTY, EMPTY));
            });
        }

        #[test]
        fn two_puts_block_until_consumed() {
            loom::model(|| {
                let slot = Arc::new(LoomSlot(AtomicU32::new(0)));
                let s = slot.clone();
                let putter = loom::thread::spawn(move || {
                    put(&*s, &forever()).unwrap();
                    put(&*s, &forever()).unwrap();
                });
                wait(&*slot, &forever()).unwrap();
                wait(&*slot, &forever()).unwrap();
                putter.join().unwrap();
                assert_eq!(slot.load(), EMPTY);
            });
        }

        #[test]
        fn two_rank_barrier_ends_with_zero_pads() {
            loom::model(|| {
                // pads[r] is rank r's slot for signals from the other rank.
                let pads = Arc::new([LoomSlot(AtomicU32::new(0)), LoomSlot(AtomicU32::new(0))]);
                let p = pads.clone();
                let other = loom::thread::spawn(move || {
                    put(&p[0], &forever()).unwrap();
                    wait(&p[1], &forever()).unwrap();
                });
                put(&pads[1], &forever()).unwrap();
                wait(&pads[0], &forever()).unwrap();
                other.join().unwrap();
                assert_eq!((pads[0].load(), pads[1].load()), (EMPTY, EMPTY));
            });
        }
    }
}
