//! Waiting, once for the whole crate: the one patience policy (spin, then yield the core, then
//! sleep on a futex, until a deadline), the signal-pad slot protocol ([`slot`]), and waiting for
//! a word to reach a value (epoch words, flags).
//!
//! ```text
//!   Patience::new(timeout, crowded)   spin SYMMEM_SPIN_US (none when ranks outnumber cores),
//!                                     yield 100 µs (2 ms when crowded), sleep until the deadline
//!   slot::put / slot::wait            PyTorch's signal protocol with sleeping (loom-checked)
//!   wait_until(word, done, p, check)  spin/yield by the policy, then nap on the word's futex,
//!                                     `check` between naps (a lost peer fails the wait at once)
//!   Backoff                           retrying what a remote peer must make possible (no futex
//!                                     to sleep on): 20 µs doubling to 2 ms, until a deadline
//!   Work completions (transport)      spin the same budget (SYMMEM_SPIN_US), then a condvar
//! ```
//!
//! Every wait has a deadline and honours it. Code written against [`SlotWord`] runs on real
//! atomics and futexes, and under loom on model-checked ones.
//!
//! Layer: above `sys` (futexes) and `config` (the spin budget); below everything that waits.

#![deny(unsafe_code)] // the loom model test alone reads an UnsafeCell

pub(crate) mod slot;

use std::sync::OnceLock;
use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

/// A slot: an atomic word that can be slept on.
pub(crate) trait SlotWord {
    /// The current value (Acquire).
    fn load(&self) -> u32;
    /// Compare-and-swap (AcqRel on success, Acquire on failure).
    fn cas(&self, current: u32, new: u32) -> Result<u32, u32>;
    /// Sleeps while the word is `expected`, at most `timeout`; may return early.
    fn sleep(&self, expected: u32, timeout: Duration);
    /// Wakes whoever sleeps on the word.
    fn wake(&self);
    /// One step of busy waiting.
    fn relax(&self);
    /// Gives the core to another runnable thread or process.
    fn yield_now(&self);
}

/// How long to spin, then yield the core, before sleeping; and when to give up.
#[derive(Clone, Debug)]
pub(crate) struct Patience {
    pub(crate) spin: Duration,
    /// After spinning: how long to keep yielding the core (`sched_yield`) before sleeping.
    /// When ranks outnumber cores, the rank being waited for is often runnable on this very
    /// core, and yielding lets it run at once instead of after a futex round trip.
    pub(crate) yield_for: Duration,
    /// How long the wait may last, counted from its first clock reading.
    timeout: Duration,
    /// When the wait gives up: fixed at the first clock reading (a [`Spinner`]'s first look at
    /// the time, or the first [`Patience::nap`]), so a wait that ends within its first spins
    /// reads no clock at all (a signal ping-pong read it twice per message, 40 ns of 130).
    deadline: OnceLock<Instant>,
}

impl Patience {
    /// The policy for a wait of at most `timeout`. `crowded`: the processes that must make
    /// progress outnumber the cores, so spinning only steals time from the one waited for:
    /// yield the core to it at once instead, and sleep only after that.
    pub(crate) fn new(timeout: Duration, crowded: bool) -> Patience {
        let (spin, yield_for) = if crowded {
            (Duration::ZERO, Duration::from_millis(2))
        } else {
            (crate::config::spin(), Duration::from_micros(100))
        };
        Patience { spin, yield_for, timeout, deadline: OnceLock::new() }
    }

    /// One look, no waiting (a remote atomic that must never block its serving thread).
    pub(crate) fn once() -> Patience {
        Patience::with(Duration::ZERO, Duration::ZERO, Duration::ZERO)
    }

    /// Spin `spin`, yield `yield_for`, give up `timeout` after the first clock reading.
    pub(crate) fn with(spin: Duration, yield_for: Duration, timeout: Duration) -> Patience {
        Patience { spin, yield_for, timeout, deadline: OnceLock::new() }
    }

    /// The same policy, giving up at `deadline` if that comes first.
    pub(crate) fn until(&self, deadline: Instant) -> Patience {
        let fixed = OnceLock::from(self.deadline().min(deadline));
        Patience { spin: self.spin, yield_for: self.yield_for, timeout: Duration::ZERO, deadline: fixed }
    }

    /// When the wait gives up (fixed now if no clock was read yet).
    pub(crate) fn deadline(&self) -> Instant {
        self.started(Instant::now())
    }

    /// Fixes the deadline from `now` if this is the wait's first clock reading; the deadline.
    fn started(&self, now: Instant) -> Instant {
        *self.deadline.get_or_init(|| now + self.timeout)
    }

    /// How long to sleep next: the time left, at most [`MAX_NAP`]; `None` once it is past.
    pub(crate) fn nap(&self) -> Option<Duration> {
        let now = Instant::now();
        let left = self.started(now).saturating_duration_since(now);
        (!left.is_zero()).then(|| left.min(MAX_NAP))
    }
}

/// Longest single futex sleep, so a sleeper rechecks its deadline (and its peers) regularly.
pub(crate) const MAX_NAP: Duration = Duration::from_millis(50);

/// Busy-waiting by a [`Patience`]: spin, then yield the core, then say it is time to sleep.
pub(crate) struct Spinner {
    /// When the first spin happened: read then, so that a wait whose condition already holds
    /// never reads the clock.
    start: Option<Instant>,
    spins: u32,
    yielding: bool,
}

impl Spinner {
    pub(crate) fn new() -> Spinner {
        Spinner { start: None, spins: 0, yielding: false }
    }

    /// Whether to keep busy-waiting (spinning or yielding) rather than sleep; yields the core
    /// itself once past the spinning phase.
    pub(crate) fn keep_spinning<W: SlotWord>(&mut self, p: &Patience, slot: &W) -> bool {
        self.spins += 1;
        // Crowded (no spin budget): the one waited for may need this very core, so hand it
        // over from the first look (64 pauses would cost microseconds of its time slice).
        if p.spin.is_zero() {
            self.yielding = true;
        }
        // Reading the clock costs ~20 ns; while spinning, do it every 64 spins. The spinning
        // phase and the wait's deadline start at the first reading (64 pauses in, at most a
        // few microseconds late).
        if !self.yielding && (self.spins < 64 || !self.spins.is_multiple_of(64)) {
            slot.relax();
            return true;
        }
        let now = Instant::now();
        let start = *self.start.get_or_insert(now);
        p.started(now);
        let elapsed = now.saturating_duration_since(start);
        if elapsed < p.spin {
            slot.relax();
            return true;
        }
        if elapsed < p.spin + p.yield_for {
            self.yielding = true;
            slot.yield_now();
            return true;
        }
        false
    }
}

/// Retrying what another process must make possible and cannot wake us for (a remote signal
/// slot still holding its previous signal): sleep 20 µs, doubling up to 2 ms, never past the
/// deadline.
pub(crate) struct Backoff {
    next: Duration,
    deadline: Instant,
}

impl Backoff {
    pub(crate) fn new(deadline: Instant) -> Backoff {
        Backoff { next: Duration::from_micros(20), deadline }
    }

    /// Sleeps before the next attempt; false (without sleeping) once the deadline has passed.
    pub(crate) fn pause(&mut self) -> bool {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        std::thread::sleep(self.next.min(left));
        self.next = (self.next * 2).min(Duration::from_millis(2));
        true
    }
}

/// Why [`wait_until`] stopped without its condition.
pub(crate) enum Stop<E> {
    /// The deadline passed.
    TimedOut,
    /// `check` failed (a peer was lost).
    Failed(E),
}

/// Waits until `done()` holds. `word` is the atomic whose changes may make it hold: the wait
/// spins and yields by `p`, then naps on the word's futex (through `sleep`, given the value
/// last seen and the nap's length, so a caller can announce itself to wakers first), calling
/// `check` before each nap; a failed check ends the wait unless `done()` holds by then.
pub(crate) fn wait_until<E>(
    word: &AtomicU32,
    mut done: impl FnMut() -> bool,
    p: &Patience,
    mut check: impl FnMut() -> Result<(), E>,
    mut sleep: impl FnMut(u32, Duration),
) -> Result<(), Stop<E>> {
    let mut spinner = Spinner::new();
    loop {
        // Acquire (of the caller's load in `done`): pairs with the Release store that makes
        // it hold; the word's own load below only picks the futex value.
        let seen = word.load(std::sync::atomic::Ordering::Acquire);
        if done() {
            return Ok(());
        }
        if spinner.keep_spinning(p, word) {
            continue;
        }
        let Some(nap) = p.nap() else { return Err(Stop::TimedOut) };
        if let Err(e) = check() {
            // What made it hold may have landed just before the failure was seen (a peer's
            // last signal, then its orderly exit): look once more.
            return if done() { Ok(()) } else { Err(Stop::Failed(e)) };
        }
        sleep(seen, nap);
    }
}

/// A slot in shared memory, slept on with a process-shared futex.
impl SlotWord for AtomicU32 {
    fn load(&self) -> u32 {
        // Acquire: pairs with the AcqRel CAS of the other side.
        self.load(std::sync::atomic::Ordering::Acquire)
    }

    fn cas(&self, current: u32, new: u32) -> Result<u32, u32> {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        // AcqRel: see the slot protocol's docs for the pairs.
        self.compare_exchange(current, new, AcqRel, Acquire)
    }

    fn sleep(&self, expected: u32, timeout: Duration) {
        crate::sys::futex::wait(self, expected, timeout);
    }

    fn wake(&self) {
        crate::sys::futex::wake(self);
    }

    fn relax(&self) {
        std::hint::spin_loop();
    }

    fn yield_now(&self) {
        std::thread::yield_now();
    }
}
