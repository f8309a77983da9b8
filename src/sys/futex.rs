//! Futex wait and wake on a 32-bit word in shared memory. Process-shared: never the PRIVATE
//! flag, which would never wake a waiter in another process.

#![forbid(unsafe_code)]

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex::{self, Flags};

/// Sleeps while `*word == expected`, for at most `timeout`. Returns on a wake, a timeout, a
/// signal, or at once if the word differs; callers recheck the word in every case.
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // EAGAIN (the word changed), ETIMEDOUT and EINTR are all "go and look again".
    let _ = futex::wait(word, Flags::empty(), expected, Some(&ts));
}

/// Wakes every process sleeping on `word`.
pub(crate) fn wake(word: &AtomicU32) {
    let _ = futex::wake(word, Flags::empty(), i32::MAX as u32);
}
