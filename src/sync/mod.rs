//! Waiting, once for the whole crate: the one patience policy (spin, then yield the core, then
//! sleep on a futex, until a deadline), the signal-pad slot protocol ([`slot`]), and waiting for
//! a word to reach a value (epoch words, flags).
//!
//! ```text
//!   Patience::new(timeout, crowded)   spin SYMMEM_SPIN_US (none when ranks outnumber cores),
//!                                     yield 100 µs (2 ms when crowded), sleep until the deadline;
//!                                     contended (3 waits in 50 ms outlasted their spin while this
//!                                     thread was preempted: other load owns the cores): no spin,
//!                                     yield 20 µs, then sleep, for the next 50 ms
//!   slot::put / slot::wait            PyTorch's signal protocol with sleeping (loom-checked)
//!   wait_until(word, done, p, check)  spin/yield by the policy, then nap on the word's futex,
//!                                     `check` between naps (a lost peer fails the wait at once)
//!   sleep_on / wake_word              a futex sleep counted in its memory's sleepers count (a
//!                                     symmetric segment's), and the wake after a store skipped
//!                                     while that count is zero (a system call per signal saved)
//!   Backoff                           retrying what a remote peer must make possible (no futex
//!                                     to sleep on): 20 µs doubling to 2 ms, until a deadline
//!   Work completions (transport)      spin the same budget (SYMMEM_SPIN_US), then a condvar
//!   deadline / deadline_from          when a wait of any timeout gives up: never an overflow;
//!                                     past NO_DEADLINE (a century) a timeout means no deadline
//! ```
//!
//! Every wait has a deadline and honours it; every deadline comes from [`deadline`] or
//! [`deadline_from`], so no timeout (up to [`Duration::MAX`], as a caller, a peer's option or
//! an environment variable may give) can overflow an [`Instant`]. Code written against
//! [`SlotWord`] runs on real atomics and futexes, and under loom on model-checked ones.
//!
//! Layer: above `sys` (futexes) and `config` (the spin budget); below everything that waits.

#![deny(unsafe_code)] // the loom model test alone reads an UnsafeCell

pub(crate) mod slot;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

/// The furthest a deadline lies ahead: a longer timeout (up to [`Duration::MAX`], past what an
/// [`Instant`] can hold: `Instant::now() + Duration::MAX` panics) means "no deadline", and its
/// wait gives up a century from now, which no process lives to see. tokio caps its timers the
/// same way (its "far future" is 30 years); a deadline that near leaves room for the arithmetic
/// done on it afterwards (a nap's end, a slice of the wait).
pub(crate) const NO_DEADLINE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// When a wait of `timeout` that starts now gives up (see [`deadline_from`]).
pub(crate) fn deadline(timeout: Duration) -> Instant {
    deadline_from(Instant::now(), timeout)
}

/// When a wait of `timeout` that started at `start` gives up: `start + timeout`, at most
/// [`NO_DEADLINE`] after `start`. Never panics, whatever the timeout.
pub(crate) fn deadline_from(start: Instant, timeout: Duration) -> Instant {
    // A monotonic clock counts from boot, and an Instant holds 2^63 seconds of it: a century
    // past `start` always fits. Were it ever not to, `start` (give up at once) beats a panic.
    start.checked_add(timeout.min(NO_DEADLINE)).unwrap_or(start)
}

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
        } else if contended() {
            // Lately waits outlasted their spinning while this thread was preempted: other
            // load is taking the cores, and the one waited for may be descheduled. Spinning
            // would only burn this core's time slice: hand the core over at once, and sleep
            // soon, so the scheduler can run the waited-for process here. (A 5 µs spin first
            // measured worse at every size under a competing busy loop.)
            (Duration::ZERO, Duration::from_micros(20))
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
        *self.deadline.get_or_init(|| deadline_from(now, self.timeout))
    }

    /// How long to sleep next: the time left, at most [`MAX_NAP`]; `None` once it is past.
    pub(crate) fn nap(&self) -> Option<Duration> {
        let now = Instant::now();
        let left = self.started(now).saturating_duration_since(now);
        (!left.is_zero()).then(|| left.min(MAX_NAP))
    }
}

/// When (coarse monotonic nanoseconds) a wait last spun its whole budget without its
/// condition while this thread was being preempted: other load is taking the cores, so the
/// process waited for is likely not running either.
static LAST_OVERRUN: AtomicU64 = AtomicU64::new(0);
/// This thread's count of involuntary context switches at the last overrun (of any thread:
/// a hint).
static PREEMPTIONS: AtomicU64 = AtomicU64::new(0);
/// The window in which preempted overruns are counted, and their count.
static WINDOW_START: AtomicU64 = AtomicU64::new(0);
static IN_WINDOW: AtomicU64 = AtomicU64::new(0);
/// How long after an overrun waits stay in contended mode.
const CONTENDED_FOR_NS: u64 = 50_000_000;

/// The coarse monotonic clock in nanoseconds (a few ns to read; ticks every few ms).
pub(crate) fn coarse_nanos() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    (t.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(t.tv_nsec as u64)
}

/// A wait spun its whole budget: if this thread was preempted since the last such wait (the
/// cores are oversubscribed, not merely a slow peer, such as one copying 16 MiB), waits turn
/// contended for a while.
fn overran() {
    use nix::sys::resource::{UsageWho, getrusage};
    let Ok(usage) = getrusage(UsageWho::RUSAGE_THREAD) else { return };
    let now = usage.involuntary_context_switches() as u64;
    // Relaxed (all three): a hint (see `contended`).
    if PREEMPTIONS.swap(now, Ordering::Relaxed) >= now {
        return;
    }
    let t = coarse_nanos();
    let (start, count) = (WINDOW_START.load(Ordering::Relaxed), IN_WINDOW.load(Ordering::Relaxed));
    let (start, count, contended) = window_step(start, count, t);
    WINDOW_START.store(start, Ordering::Relaxed);
    IN_WINDOW.store(count, Ordering::Relaxed);
    if contended {
        LAST_OVERRUN.store(t, Ordering::Relaxed);
    }
}

/// Counts a preempted overrun at `t` into the window (`start`, `count`): the new window, and
/// whether it now holds three (one alone is a startup or a passing job, not contention).
fn window_step(start: u64, count: u64, t: u64) -> (u64, u64, bool) {
    if start == 0 || t.saturating_sub(start) > CONTENDED_FOR_NS {
        return (t, 1, false);
    }
    let count = count.saturating_add(1);
    (start, count, count >= 3)
}

/// Whether a wait overran its spinning within the last [`CONTENDED_FOR_NS`].
fn contended() -> bool {
    // Relaxed: a hint; a stale value only picks the other policy for one wait.
    let last = LAST_OVERRUN.load(Ordering::Relaxed);
    last != 0 && coarse_nanos().saturating_sub(last) < CONTENDED_FOR_NS
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
            if !self.yielding && !p.spin.is_zero() {
                overran();
            }
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

/// Sleeps on `word` while it holds `seen`, at most `nap`, counted in `sleepers` (the count of
/// the memory the word lies in, [`crate::tensor::Storage::sleepers`], when it has one) for as
/// long as it sleeps, so that [`wake_word`] can skip its system call when nobody sleeps there.
///
/// A count that another process of the job corrupts costs latency, never a wake-up for good:
/// too high, every store wakes (as without a count); too low, a sleeper may miss a wake-up and
/// look again when its nap ends (at most [`MAX_NAP`]). A sleeper killed while counted leaves
/// the count high.
pub(crate) fn sleep_on(word: &AtomicU32, seen: u32, nap: Duration, sleepers: Option<&AtomicU32>) {
    let Some(count) = sleepers else { return crate::sys::futex::wait(word, seen, nap) };
    // SeqCst, then a SeqCst fence: pairs with the fence in `wake_word` (store, fence, load
    // there; count, fence, the kernel's read of the word here). Either the waker sees this
    // count and wakes, or this futex wait reads the waker's store and does not sleep.
    count.fetch_add(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    crate::sys::futex::wait(word, seen, nap);
    // Relaxed: leaving only makes a later waker's system call unnecessary, never needed.
    count.fetch_sub(1, Ordering::Relaxed);
}

/// Wakes whoever sleeps on `word`, which the caller has just stored to, unless `sleepers` (see
/// [`sleep_on`]) says nobody sleeps in its memory: a futex wake on shared memory is a system
/// call of about 0.4 us here, on the path of every signal whose waiter is spinning.
pub(crate) fn wake_word(word: &AtomicU32, sleepers: Option<&AtomicU32>) {
    if let Some(count) = sleepers {
        // SeqCst fence: orders the caller's store to `word` before this load of the count;
        // pairs with the fence in `sleep_on`.
        fence(Ordering::SeqCst);
        if count.load(Ordering::Relaxed) == 0 {
            return;
        }
    }
    #[cfg(test)]
    WAKES.with(|w| w.set(w.get() + 1));
    crate::sys::futex::wake(word);
}

#[cfg(test)]
thread_local! {
    /// The futex wakes [`wake_word`] made on this thread.
    pub(crate) static WAKES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn wakes() -> usize {
        WAKES.with(|w| w.get())
    }

    /// A thread sleeping on `word` while it holds `seen` (naps of `nap`, counted in `count`),
    /// returned once it has counted itself in; it returns how long it slept.
    fn counted_sleeper(
        word: &Arc<AtomicU32>,
        count: &Arc<AtomicU32>,
        seen: u32,
        nap: Duration,
    ) -> std::thread::JoinHandle<Duration> {
        let (w, c) = (word.clone(), count.clone());
        let sleeper = std::thread::spawn(move || {
            let t = Instant::now();
            while w.load(Ordering::Acquire) == seen {
                sleep_on(&w, seen, nap, Some(&c));
            }
            t.elapsed()
        });
        let t = Instant::now();
        while count.load(Ordering::SeqCst) == 0 {
            assert!(t.elapsed() < Duration::from_secs(10), "the sleeper never counted itself");
            std::thread::yield_now();
        }
        sleeper
    }

    #[test]
    fn a_store_wakes_only_where_someone_sleeps_in_its_memory() {
        let (word, count) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        // Nobody counted: no system call. Memory without a count: always one.
        let before = wakes();
        word.store(1, Ordering::Release);
        wake_word(&word, Some(&count));
        assert_eq!(wakes(), before);
        wake_word(&word, None);
        assert_eq!(wakes(), before + 1);
        // A sleeper counts itself while it sleeps, is woken by the store, and leaves.
        let sleeper = counted_sleeper(&word, &count, 1, Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(20));
        word.store(2, Ordering::Release);
        wake_word(&word, Some(&count));
        assert_eq!(wakes(), before + 2);
        let slept = sleeper.join().unwrap();
        assert!(slept < Duration::from_secs(10), "the sleeper slept {slept:?}: its wake-up was skipped");
        assert_eq!(count.load(Ordering::SeqCst), 0, "a sleeper that woke left its count behind");
    }

    /// Another process of the job that zeroes the count under a sleeper (a bug, or a peer
    /// gone wrong) costs that sleeper at most its nap: it wakes at the nap's end and sees the
    /// value; it is never left asleep for good.
    #[test]
    fn a_count_zeroed_under_a_sleeper_costs_at_most_its_nap() {
        let (word, count) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let sleeper = counted_sleeper(&word, &count, 0, Duration::from_millis(200));
        count.store(0, Ordering::SeqCst);
        let before = wakes();
        word.store(1, Ordering::Release);
        wake_word(&word, Some(&count));
        assert_eq!(wakes(), before, "the zeroed count skipped the wake-up");
        let slept = sleeper.join().unwrap();
        assert!(slept < Duration::from_secs(5), "the sleeper slept {slept:?} past its 200 ms nap");
    }

    /// Two threads hand a word back and forth, each sleeping on it at once (no spinning) with
    /// naps longer than any hand-over takes: a wake-up skipped while the other side was
    /// counting itself in shows as a wait of a whole nap, and ends the test.
    #[test]
    fn no_wake_up_is_lost_between_a_sleeper_and_a_store() {
        const ROUNDS: u32 = 4000;
        const NAP: Duration = Duration::from_secs(3);
        let (word, count) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let lost = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let side = |first: u32| {
            let (word, count, lost) = (word.clone(), count.clone(), lost.clone());
            move || {
                let mut skipped = 0;
                for v in (first..2 * ROUNDS).step_by(2) {
                    let t = Instant::now();
                    loop {
                        let seen = word.load(Ordering::Acquire);
                        if seen == v {
                            break;
                        }
                        if lost.load(Ordering::Relaxed) {
                            return None;
                        }
                        sleep_on(&word, seen, NAP, Some(&count));
                        if t.elapsed() >= NAP {
                            lost.store(true, Ordering::Relaxed);
                            return None;
                        }
                    }
                    let before = wakes();
                    word.store(v + 1, Ordering::Release);
                    wake_word(&word, Some(&count));
                    skipped += usize::from(wakes() == before);
                }
                Some(skipped)
            }
        };
        let (a, b) = (std::thread::spawn(side(0)), std::thread::spawn(side(1)));
        let (sa, sb) = (a.join().unwrap(), b.join().unwrap());
        let (Some(sa), Some(sb)) = (sa, sb) else { panic!("a wait lasted a whole nap: a wake-up was lost") };
        // The count did its job some of the time (the other side was often not yet asleep).
        assert!(sa + sb > 0, "every store made a system call");
    }

    #[test]
    fn three_preempted_overruns_within_the_window_mean_contention() {
        let ms = 1_000_000;
        // One, then two more within 50 ms: contended at the third.
        let (s, c, hot) = window_step(0, 0, 1000 * ms);
        assert!(!hot);
        let (s, c, hot) = window_step(s, c, 1010 * ms);
        assert!(!hot);
        let (s, c, hot) = window_step(s, c, 1040 * ms);
        assert!(hot && s == 1000 * ms && c == 3);
        // Past the window a new one starts, and one alone is nothing.
        let (s, c, hot) = window_step(s, c, 1100 * ms);
        assert!(!hot && s == 1100 * ms && c == 1);
        // Spread out (one per window) never turns contended.
        let mut w = (0, 0);
        for i in 0..10 {
            let (s, c, hot) = window_step(w.0, w.1, 2000 * ms + i * 60 * ms);
            assert!(!hot);
            w = (s, c);
        }
    }

    /// Issue 51, item 3: `Instant::now() + timeout` panicked for a timeout past what an Instant
    /// holds (`1e19` s); every deadline now comes from `deadline_from`, which saturates.
    #[test]
    fn any_timeout_gives_a_deadline_and_a_huge_one_means_none() {
        let now = Instant::now();
        assert_eq!(deadline_from(now, Duration::ZERO), now);
        assert_eq!(deadline_from(now, Duration::from_millis(1500)), now + Duration::from_millis(1500));
        assert_eq!(deadline_from(now, NO_DEADLINE), now + NO_DEADLINE);
        let century = Duration::from_secs(99 * 365 * 24 * 3600);
        for t in
            [Duration::from_secs(1 << 62), Duration::from_secs_f64(1e19), Duration::from_secs(u64::MAX), Duration::MAX]
        {
            let d = deadline_from(now, t);
            assert_eq!(d, now + NO_DEADLINE, "{t:?}");
            // Room for arithmetic on it: a slice of a wait, a nap's end.
            assert!(d.checked_add(Duration::from_secs(1000 * 365 * 24 * 3600)).is_some());
            assert!(deadline(t) > Instant::now() + century);
        }
        // Waits built on it: no panic, and no giving up.
        let p = Patience::with(Duration::ZERO, Duration::ZERO, Duration::MAX);
        assert_eq!(p.nap(), Some(MAX_NAP), "a wait with no deadline naps, never times out");
        assert!(p.deadline() > Instant::now() + century);
        assert_eq!(p.until(Instant::now()).nap(), None, "`until` still bounds it");
        assert!(Backoff::new(deadline(Duration::MAX)).pause());
    }

    #[test]
    fn a_patience_fixes_its_deadline_at_the_first_clock_reading() {
        let p = Patience::with(Duration::ZERO, Duration::ZERO, Duration::from_millis(200));
        std::thread::sleep(Duration::from_millis(50));
        let before = Instant::now();
        let d = p.deadline();
        assert!(d >= before + Duration::from_millis(200), "the deadline counted from creation");
        assert_eq!(p.deadline(), d, "the deadline moved");
        // `until` takes the earlier of the two.
        assert_eq!(p.until(d + Duration::from_secs(1)).deadline(), d);
        let soon = Instant::now();
        assert_eq!(p.until(soon).deadline(), soon);
        assert!(Patience::once().nap().is_none(), "one look never sleeps");
    }
}
