//! The only place symmem calls the operating system unsafely.
//!
//! Today: arranging for a launched rank to die with its launcher, so that not even `kill -9` of
//! `symmem run` leaves ranks behind.

use rustix::process::{Pid, Signal};

/// Makes the child started by `cmd` receive SIGKILL when this process dies, and exit at once if
/// this process is already gone by the time it starts.
pub(crate) fn die_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let parent = rustix::process::getpid();
    // SAFETY: `pre_exec` runs this closure in the forked child before exec, where only
    // async-signal-safe calls are allowed. It makes two raw syscalls through rustix (prctl and
    // getppid), allocates nothing and takes no lock, so it is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
            // The parent may have died between fork and prctl; then no signal will come.
            if rustix::process::getppid() != Some(parent) {
                return Err(std::io::Error::other("launcher exited before the rank started"));
            }
            Ok(())
        });
    }
}

/// Makes the child started by `cmd` run on the CPUs of `cpus` only (every thread it starts
/// inherits the mask).
pub(crate) fn bind_to(cmd: &mut tokio::process::Command, cpus: rustix::thread::CpuSet) {
    // SAFETY: `pre_exec` runs this closure in the forked child before exec, where only
    // async-signal-safe calls are allowed. It makes one raw syscall through rustix
    // (sched_setaffinity) on a set built before the fork and moved in by value, allocates
    // nothing and takes no lock, so it is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || rustix::thread::sched_setaffinity(None, &cpus).map_err(std::io::Error::from));
    }
}

/// Sends `signal` to every process in the process group led by `pid`; a group that is already
/// gone is not an error.
pub(crate) fn signal_group(pid: u32, signal: Signal) {
    let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) else { return };
    if let Err(e) = rustix::process::kill_process_group(pid, signal)
        && e != rustix::io::Errno::SRCH
    {
        tracing::warn!("signal process group {pid:?} with {signal:?}: {e}");
    }
}

/// The end of a child process, watched through a pidfd without reaping it: a launcher that
/// signals its children's process groups keeps their pids (and so the groups' ids) from being
/// reused until it reaps them itself.
pub(crate) struct ChildExit {
    pidfd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl ChildExit {
    /// Watches child `pid`, which must not have been reaped yet (then the pidfd names it).
    /// Needs a tokio runtime with I/O enabled, and Linux 5.3 or later.
    pub(crate) fn watch(pid: u32) -> std::io::Result<ChildExit> {
        let pid = i32::try_from(pid).ok().and_then(Pid::from_raw).ok_or_else(|| std::io::Error::other("no pid"))?;
        let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::NONBLOCK)?;
        // SAFETY: the AsyncFd owns the OwnedFd, which stays open and names the same pidfd
        // until the AsyncFd drops it; nothing else can close or replace it.
        let pidfd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(ChildExit { pidfd })
    }

    /// Waits until the child has ended; returns its exit code or the signal that killed it,
    /// leaving it a zombie for its parent to reap.
    pub(crate) async fn status(&self) -> std::io::Result<(Option<i32>, Option<i32>)> {
        use rustix::process::{WaitId, WaitIdOptions, waitid};
        loop {
            // A pidfd polls readable once its process has exited.
            let mut ready = self.pidfd.readable().await?;
            let how = waitid(
                WaitId::PidFd(std::os::fd::AsFd::as_fd(self.pidfd.get_ref())),
                WaitIdOptions::EXITED | WaitIdOptions::NOWAIT | WaitIdOptions::NOHANG,
            )?;
            match how {
                Some(s) => return Ok((s.exit_status(), s.terminating_signal())),
                None => ready.clear_ready(),
            }
        }
    }
}

/// Raises the soft limit on open files to the hard limit, for servers and benchmarks that hold
/// thousands of connections. Returns the new soft limit.
pub fn raise_fd_limit() -> u64 {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::debug!("raise RLIMIT_NOFILE: {e}");
        }
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

pub(crate) mod cma;
pub(crate) mod futex;
pub(crate) mod peercred;
pub(crate) mod shm;
pub(crate) mod uct;
pub(crate) mod ucx;

/// For the tests that check a binding's hand-written layouts: the output of a C program
/// `body` (the statements of `main`, after `#include <stdio.h>`, `<stddef.h>` and `header`),
/// compiled against the installed headers; `None`, having said SKIPPED, where `header` or a
/// C compiler is absent.
#[cfg(test)]
pub(crate) fn c_program_output(header: &str, body: &str) -> Option<String> {
    if !std::path::Path::new("/usr/include").join(header).exists() {
        eprintln!("SKIPPED: no {header} (Debian: libucx-dev)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("l.c");
    let program = format!(
        "#include <stdio.h>\n#include <stddef.h>\n#include <{header}>\nint main(void){{\n{body}\nreturn 0;}}\n"
    );
    std::fs::write(&src, program).unwrap();
    let exe = dir.path().join("l");
    let Ok(cc) = std::process::Command::new("cc").arg(&src).arg("-o").arg(&exe).output() else {
        eprintln!("SKIPPED: no C compiler");
        return None;
    };
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    Some(String::from_utf8(std::process::Command::new(&exe).output().unwrap().stdout).unwrap())
}
