//! Cross-memory attach: copying to and from another process's address space with
//! `process_vm_writev`/`process_vm_readv` (one copy, the other process takes no part), and
//! pidfds to notice that process's death.

#![forbid(unsafe_code)]

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::OwnedFd;

use nix::sys::uio::{RemoteIoVec, process_vm_readv, process_vm_writev};
use nix::unistd::Pid;

/// The largest piece moved by one system call: big enough to run at full speed, small enough
/// that a transfer's pages are not all pinned at once.
const PIECE: usize = 1 << 20;

/// Why a cross-memory copy failed.
#[derive(Debug)]
pub(crate) enum CmaError {
    /// The kernel refused (another user, a ptrace restriction).
    Refused(nix::Error),
    /// The process is gone.
    Gone,
    /// The remote range is not mapped in the process.
    BadAddress,
    /// Anything else.
    Other(nix::Error),
}

impl std::fmt::Display for CmaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CmaError::Refused(e) => {
                write!(f, "the kernel refused cross-memory attach ({e}): another user or a ptrace restriction")
            }
            CmaError::Gone => f.write_str("the peer process has exited"),
            CmaError::BadAddress => f.write_str("the remote range is not mapped in the peer (freed memory?)"),
            CmaError::Other(e) => write!(f, "cross-memory attach failed: {e}"),
        }
    }
}

fn classify(e: nix::Error) -> CmaError {
    match e {
        nix::Error::EPERM | nix::Error::EACCES => CmaError::Refused(e),
        nix::Error::ESRCH => CmaError::Gone,
        nix::Error::EFAULT => CmaError::BadAddress,
        e => CmaError::Other(e),
    }
}

/// Copies `local` to address `remote` in process `pid`.
pub(crate) fn write(pid: i32, local: &[u8], remote: usize) -> Result<(), CmaError> {
    let mut done = 0;
    while done < local.len() {
        let n = (local.len() - done).min(PIECE);
        let iov = [IoSlice::new(&local[done..done + n])];
        let rio = [RemoteIoVec { base: remote + done, len: n }];
        match process_vm_writev(Pid::from_raw(pid), &iov, &rio) {
            Ok(0) => return Err(CmaError::BadAddress),
            Ok(k) => done += k,
            Err(nix::Error::EINTR) => {}
            Err(e) => return Err(classify(e)),
        }
    }
    Ok(())
}

/// Copies from address `remote` in process `pid` into `local`.
pub(crate) fn read(pid: i32, local: &mut [u8], remote: usize) -> Result<(), CmaError> {
    let mut done = 0;
    while done < local.len() {
        let n = (local.len() - done).min(PIECE);
        let mut iov = [IoSliceMut::new(&mut local[done..done + n])];
        let rio = [RemoteIoVec { base: remote + done, len: n }];
        match process_vm_readv(Pid::from_raw(pid), &mut iov, &rio) {
            Ok(0) => return Err(CmaError::BadAddress),
            Ok(k) => done += k,
            Err(nix::Error::EINTR) => {}
            Err(e) => return Err(classify(e)),
        }
    }
    Ok(())
}

/// A descriptor that becomes readable when process `pid` exits.
pub(crate) fn pidfd(pid: i32) -> std::io::Result<OwnedFd> {
    let pid = rustix::process::Pid::from_raw(pid).ok_or_else(|| std::io::Error::other("pid 0"))?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).map_err(Into::into)
}

/// Whether the process behind `pidfd` has exited (never blocks).
pub(crate) fn exited(pidfd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 };
    matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
}
