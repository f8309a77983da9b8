//! [`Work`]: the completion of one transfer, for blocking and async callers alike.
//!
//! A Work is completed exactly once, by the backend, with success or an error message. Waiting
//! spins briefly (completions of small transfers arrive within microseconds, and a sleeping
//! thread's wake-up costs tens of them here), then sleeps on a condition variable. A timeout
//! bounds the wait, never the transfer: the Work stays pending and a later wait may succeed. A
//! failed Work reports its error on every wait. Until it completes, a Work holds what the
//! transfer uses (the local registration), so its memory outlives any caller that drops it.

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::{Completion, Error, Failed, Result, TransferKind};

const PENDING: u8 = 0;
const SUCCEEDED: u8 = 1;
const FAILED: u8 = 2;

/// What a waiter may call to advance its own transfer (a backend whose completions need
/// polling, such as UCX's): called while it spins, so the completion needs no other thread.
pub(crate) type Progress = Arc<dyn Fn() + Send + Sync>;

/// Shared completion state of a Work.
#[derive(Default)]
pub(crate) struct WorkState {
    state: AtomicU8,
    progress: OnceLock<Progress>,
    error: OnceLock<Failed>,
    waiters: Mutex<Waiters>,
    cv: Condvar,
    keep: Mutex<Option<super::InFlight>>,
}

/// Who waits for a Work beyond spinning: async tasks, and threads asleep on the condvar.
#[derive(Default)]
struct Waiters {
    wakers: Vec<Waker>,
    /// Threads in (or entering) `cv.wait`: `complete` notifies the condvar only when some are,
    /// since a notify costs a futex syscall even with nobody asleep.
    sleepers: usize,
}

impl std::fmt::Debug for WorkState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WorkState({})", self.state.load(Ordering::Acquire))
    }
}

impl WorkState {
    /// A pending state that holds `keep` (the transfer's claim on its registration) until it
    /// completes.
    pub(crate) fn new(keep: Option<super::InFlight>) -> Arc<WorkState> {
        Arc::new(WorkState { keep: Mutex::new(keep), ..WorkState::default() })
    }

    /// Lets waiters advance the transfer themselves while they spin.
    pub(crate) fn set_progress(&self, p: Progress) {
        let _ = self.progress.set(p);
    }

    /// Completes the work; later calls are ignored.
    pub(crate) fn complete(&self, result: Completion) {
        // Release what the transfer held before anyone can see it complete: a waiter that wakes
        // must find its registration no longer in use.
        let kept = self.keep.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(kept);
        let mut waiters = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        if self.state.load(Ordering::Acquire) != PENDING {
            return;
        }
        let state = match result {
            Ok(()) => SUCCEEDED,
            Err(e) => {
                let _ = self.error.set(e);
                FAILED
            }
        };
        // Release: pairs with the Acquire loads in `poll_state`; the transferred bytes and
        // the error message are visible to whoever sees the new state.
        self.state.store(state, Ordering::Release);
        let wakers = std::mem::take(&mut waiters.wakers);
        // Read under the lock that sleepers count themselves in before they check the state.
        let sleepers = waiters.sleepers;
        drop(waiters);
        if sleepers > 0 {
            self.cv.notify_all();
        }
        for w in wakers {
            w.wake();
        }
    }

    fn poll_state(&self) -> u8 {
        // Acquire: pairs with the Release store in `complete`.
        self.state.load(Ordering::Acquire)
    }

    fn outcome(&self) -> Option<Result<()>> {
        match self.poll_state() {
            PENDING => None,
            SUCCEEDED => Some(Ok(())),
            _ => Some(Err(self
                .error
                .get()
                .cloned()
                .unwrap_or_else(|| Failed::new(TransferKind::PeerLost, "failed"))
                .into())),
        }
    }

    /// Waits until completion or `deadline`; true if completed.
    pub(crate) fn wait_until(&self, deadline: Option<Instant>) -> bool {
        // The crate's one spin budget (SYMMEM_SPIN_US): a completion usually arrives within it.
        // The waiter progresses at least once whatever the budget, which sends what a batch of
        // its own thread still holds (nothing else would before the batch ends).
        let spin_end = crate::sync::deadline(crate::config::spin());
        loop {
            if self.poll_state() != PENDING {
                return true;
            }
            match self.progress.get() {
                Some(p) => p(),
                None => std::hint::spin_loop(),
            }
            if Instant::now() >= spin_end {
                break;
            }
            std::thread::yield_now();
        }
        let mut guard = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        // Counted while this thread may sleep; `complete` reads the count under this lock after
        // publishing, so it either sees this sleeper or this sleeper sees the new state.
        guard.sleepers += 1;
        let done = loop {
            if self.poll_state() != PENDING {
                break true;
            }
            let wait = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break false;
                    }
                    d - now
                }
                None => Duration::from_secs(3600),
            };
            guard = self.cv.wait_timeout(guard, wait).unwrap_or_else(|p| p.into_inner()).0;
        };
        guard.sleepers -= 1;
        done
    }

    pub(crate) fn is_pending(&self) -> bool {
        self.poll_state() == PENDING
    }
}

/// The completion of one transfer started with `start_write` or `start_read`.
#[derive(Clone, Debug)]
pub struct Work {
    state: Arc<WorkState>,
    /// The submission's timeout: what `wait(None)` waits at most.
    timeout: Option<Duration>,
}

impl Work {
    pub(crate) fn new(state: Arc<WorkState>, timeout: Option<Duration>) -> Work {
        Work { state, timeout }
    }

    /// Waits for completion: up to `timeout`, or the submission's timeout when `None`. A
    /// timeout returns [`Error::Timeout`] and leaves the transfer running; wait again, or close
    /// the transport, before reusing its buffers. A failed transfer returns its error on every
    /// call.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let timeout = timeout.or(self.timeout);
        let deadline = timeout.map(crate::sync::deadline);
        if !self.state.wait_until(deadline) {
            return Err(Error::timeout("transport wait (the operation remains pending)", timeout.unwrap_or_default()));
        }
        self.state.outcome().unwrap_or(Ok(()))
    }

    /// Whether the transfer has finished, successfully or not.
    pub fn is_completed(&self) -> bool {
        !self.state.is_pending()
    }

    /// Whether it finished successfully.
    pub fn is_success(&self) -> bool {
        matches!(self.state.outcome(), Some(Ok(())))
    }

    /// The error it failed with, once it has failed.
    pub fn exception(&self) -> Option<String> {
        match self.state.outcome() {
            Some(Err(e)) => Some(e.to_string()),
            _ => None,
        }
    }

    /// A future that resolves when the transfer finishes (with no timeout of its own).
    pub fn future(&self) -> WorkFuture {
        WorkFuture { state: self.state.clone() }
    }
}

/// Resolves when a [`Work`] completes; dropping it does not cancel the transfer.
#[derive(Debug)]
pub struct WorkFuture {
    state: Arc<WorkState>,
}

impl Future for WorkFuture {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Some(r) = self.state.outcome() {
            return Poll::Ready(r);
        }
        let mut waiters = self.state.waiters.lock().unwrap_or_else(|p| p.into_inner());
        // Recheck under the lock: `complete` takes it before publishing.
        if let Some(r) = self.state.outcome() {
            return Poll::Ready(r);
        }
        if !waiters.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            waiters.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// Awaits every Work, without blocking the executor. A timeout stops the waiting, not the
/// transfers. Errors are reported after every Work has finished: the first failure in
/// submission order.
pub async fn wait_all(works: impl IntoIterator<Item = Work>, timeout: Option<Duration>) -> Result<()> {
    let works: Vec<Work> = works.into_iter().collect();
    let all = futures::future::join_all(works.iter().map(Work::future));
    let results = match timeout {
        Some(t) => {
            let sleep = {
                // The timer runs on symmem's runtime, so any executor can poll it.
                let _ctx = crate::rt::runtime().enter();
                tokio::time::sleep(t)
            };
            tokio::pin!(sleep);
            tokio::pin!(all);
            match futures::future::select(all, sleep).await {
                futures::future::Either::Left((r, _)) => r,
                futures::future::Either::Right(_) => {
                    return Err(Error::timeout("transport wait_all (operations remain pending)", t));
                }
            }
        }
        None => all.await,
    };
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_leave_work_pending_and_failures_repeat() {
        let st = WorkState::new(None);
        let w = Work::new(st.clone(), Some(Duration::from_millis(20)));
        assert!(w.wait(None).unwrap_err().is_timeout());
        assert!(!w.is_completed());
        let t = std::thread::spawn({
            let st = st.clone();
            move || {
                std::thread::sleep(Duration::from_millis(20));
                st.complete(Err(Failed::new(TransferKind::Refused, "boom")));
            }
        });
        let err = w.wait(Some(Duration::from_secs(5))).unwrap_err().to_string();
        assert!(err.contains("boom"), "{err}");
        assert!(w.wait(None).unwrap_err().to_string().contains("boom"), "every wait reports it");
        assert!(w.is_completed() && !w.is_success());
        assert!(w.exception().unwrap().contains("boom"));
        st.complete(Ok(()));
        assert!(!w.is_success(), "completion happens once");
        t.join().unwrap();
    }

    #[test]
    fn futures_and_wait_all() {
        let a = WorkState::new(None);
        let b = WorkState::new(None);
        let works = vec![Work::new(a.clone(), None), Work::new(b.clone(), None)];
        let r = futures::executor::block_on(wait_all(works.clone(), Some(Duration::from_millis(20))));
        assert!(r.unwrap_err().is_timeout());
        a.complete(Ok(()));
        b.complete(Err(Failed::new(TransferKind::PeerLost, "second failed")));
        let r = futures::executor::block_on(wait_all(works, None));
        assert!(r.unwrap_err().to_string().contains("second failed"));
        assert!(futures::executor::block_on(wait_all(Vec::new(), Some(Duration::ZERO))).is_ok());
    }
}
