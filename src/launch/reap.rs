//! Ending every process a rank started, wherever it went.
//!
//! A process can leave its process group and session (`setsid`) and its parent (a double
//! fork), so neither a signal to the rank's group nor `PR_SET_PDEATHSIG` reaches everything a
//! rank starts (torchrun, which signals process groups, leaves such processes running). What a
//! process cannot leave is the subtree of a *child subreaper* (`PR_SET_CHILD_SUBREAPER`, Linux
//! 3.4, as systemd, tini and Docker's init use it): an orphan is re-parented to its nearest
//! living subreaper ancestor instead of to init. The guard of each rank is one, so the rank and
//! everything it ever started stay the guard's descendants, and the `symmem` command's
//! launcher is one too, for what a guard killed from outside leaves.
//!
//! To end them, [`end_descendants`] walks /proc for the processes whose chain of parents leads
//! to this one, kills each with SIGKILL, and walks again until a walk finds none, reaping this
//! process's children as it goes. A process that forks between a walk and its kill leaves a
//! child for the next walk; a killed process forks no more, so the walks come to an end.
//!
//! A pid read from /proc may name another process by the time it is signalled (the one seen
//! ended, was reaped by its parent, and the pid was reused). So each is signalled through a
//! pidfd, which names one process for good, and only if that process's start time is still the
//! one the walk saw.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rustix::process::{Pid, PidfdFlags, Signal, WaitOptions, WaitStatus};

/// A process as a walk of /proc saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Proc {
    pid: i32,
    ppid: i32,
    /// Clock ticks after boot at which it started: with the pid, it names one process.
    start: u64,
}

/// What /proc/`pid`/stat says of process `pid`; `None` if it is gone.
fn stat(pid: i32) -> Option<Proc> {
    parse_stat(pid, &std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Parses a /proc/<pid>/stat line: `pid (comm) state ppid ... starttime ...`, where `comm` may
/// hold spaces and parentheses, so the fields are counted after its last `)`.
fn parse_stat(pid: i32, text: &str) -> Option<Proc> {
    let fields: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    // After `comm`: state is field 0, ppid 1, starttime 19 (fields 3, 4 and 22 of proc(5)).
    Some(Proc { pid, ppid: fields.get(1)?.parse().ok()?, start: fields.get(19)?.parse().ok()? })
}

/// Every process under `root` (its children, theirs, ...), each after its parent.
fn descendants(root: i32) -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut children: HashMap<i32, Vec<Proc>> = HashMap::new();
    for e in dir.flatten() {
        if let Some(p) = e.file_name().to_str().and_then(|n| n.parse().ok()).and_then(stat) {
            children.entry(p.ppid).or_default().push(p);
        }
    }
    let mut found = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        // Taken out of the map: a parent is visited once, even in a table read mid-change.
        for p in children.remove(&parent).unwrap_or_default() {
            parents.push(p.pid);
            found.push(p);
        }
    }
    found
}

/// Sends SIGKILL to `p` if it is still the process the walk saw.
fn kill(p: &Proc) {
    let Some(pid) = Pid::from_raw(p.pid) else { return };
    let Ok(pidfd) = rustix::process::pidfd_open(pid, PidfdFlags::empty()) else { return };
    // The pidfd names one process from now on; it is `p` if the start time at that pid is
    // still `p`'s (had `p` ended before the pidfd was opened, no later process could have it).
    if stat(p.pid).is_some_and(|now| now.start == p.start) {
        let _ = rustix::process::pidfd_send_signal(&pidfd, Signal::KILL);
    }
}

/// Reaps every child of this process that has ended; `on_reaped` sees each one's pid and status.
pub(super) fn reap(on_reaped: &mut impl FnMut(Pid, WaitStatus)) {
    while let Ok(Some((pid, status))) = rustix::process::wait(WaitOptions::NOHANG) {
        on_reaped(pid, status);
    }
}

/// Kills every process under this one with SIGKILL and reaps this process's children (each
/// one's status goes to `on_reaped`), until none is left or `patience` has passed. Returns how
/// many were left (0 but for processes the kernel takes longer to end, e.g. in uninterruptible
/// I/O).
pub(super) fn end_descendants(patience: Duration, mut on_reaped: impl FnMut(Pid, WaitStatus)) -> usize {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let deadline = Instant::now() + patience;
    let mut pause = Duration::from_micros(100);
    loop {
        reap(&mut on_reaped);
        let left = descendants(me);
        if left.is_empty() {
            return 0;
        }
        if Instant::now() >= deadline {
            tracing::warn!("{} processes under {me} were still there after {patience:?} of SIGKILL", left.len());
            return left.len();
        }
        for p in &left {
            kill(p);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Makes this process the reaper of whatever its descendants orphan, and ends all of its
/// descendants when dropped.
///
/// For a process that is nothing but a launcher (the `symmem` command): a guard killed from
/// outside leaves its rank's escaped descendants to the launcher, not to init, and the launcher
/// ends them with the job. Dropping it kills **every** process under this one, so a program
/// with children of its own must not use it.
#[derive(Debug)]
pub struct Subreaper(());

impl Subreaper {
    /// Becomes the subreaper (a failure is logged: the guards still end what their ranks start).
    pub fn adopt() -> Subreaper {
        if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
            tracing::warn!("cannot become a child subreaper: {e}");
        }
        Subreaper(())
    }
}

impl Drop for Subreaper {
    fn drop(&mut self) {
        end_descendants(Duration::from_secs(5), |_, _| {});
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_are_read_past_any_command_name() {
        let tail = "S 42 7 7 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 123456 100 10 18446744073709551615";
        for comm in ["sleep", "a b", "x) S 1 1 (y", ")"] {
            let line = format!("99 ({comm}) {tail}");
            assert_eq!(parse_stat(99, &line), Some(Proc { pid: 99, ppid: 42, start: 123456 }), "{line}");
        }
        assert_eq!(parse_stat(1, "1 (init"), None);
        assert_eq!(parse_stat(1, "1 (x) S 0"), None);
        let me = stat(std::process::id() as i32).unwrap();
        assert_eq!(me.ppid as u32, std::os::unix::process::parent_id());
    }

    #[test]
    fn descendants_are_found_under_their_root_only() {
        let mut child = std::process::Command::new("sh").args(["-c", "sleep 30 & sleep 30"]).spawn().unwrap();
        let root = child.id() as i32;
        let deadline = Instant::now() + Duration::from_secs(10);
        while descendants(root).len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let found = descendants(root);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found.iter().all(|p| p.ppid == root));
        let mine = descendants(std::process::id() as i32);
        assert!(mine.iter().any(|p| p.pid == root) && mine.len() >= 3);
        // A process seen with another start time is left alone.
        kill(&Proc { pid: root, ppid: 0, start: 1 });
        std::thread::sleep(Duration::from_millis(50));
        assert!(child.try_wait().unwrap().is_none(), "a process the walk did not see was killed");
        for p in &found {
            kill(p);
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        // Still running: the same process, not yet a zombie (whose command line is empty).
        let running = |p: &Proc| std::fs::read(format!("/proc/{}/cmdline", p.pid)).is_ok_and(|c| !c.is_empty());
        let alive = || found.iter().any(|p| stat(p.pid).is_some_and(|s| s.start == p.start) && running(p));
        while alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!alive(), "the walk's processes were killed");
    }
}
