//! A launch's run folder: where its ranks write their error files, and what tells other
//! launchers that it is still in use.
//!
//! ```text
//!   $TMPDIR/symmem-run-XXXXXXXXXX/     mode 0700, an unpredictable name (mkdtemp: O_EXCL)
//!     lock                             flock()ed by the launcher for its whole life
//!     attempt_0/<rank>/error.json      torchrun's layout; each rank writes its own, or none
//! ```
//!
//! Another user cannot block a launch by taking its folder's name first: the name is drawn at
//! random, and a taken one is drawn again. A launcher killed with `kill -9` cannot remove its
//! folder; the next launcher of the same user does, once it can take the folder's lock: the
//! kernel drops a lock with the last descriptor of its holder, so a free lock means a dead
//! launcher in whatever pid namespace it ran, where a pid in the name would mean nothing.
//!
//! What a rank wrote is read as a stranger's input: never through a symlink, never from
//! anything but a regular file, never blocking, at most [`MAX_ERROR_FILE`] bytes, and off the
//! launcher's own thread with a deadline.

#![forbid(unsafe_code)]

use std::fs::{File, Metadata};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::fs::{FlockOperation, OFlags};

use super::RankError;
use crate::error::{Error, Result};

/// The start of every run folder's name.
const PREFIX: &str = "symmem-run-";
/// The lock file in a run folder.
const LOCK: &str = "lock";
/// The folder of the ranks' error files; its presence also says that the launcher got as far
/// as holding the lock (it makes it only then).
const ATTEMPT: &str = "attempt_0";
/// How long a folder without a lock file (an older symmem's, or of a launcher killed between
/// making its folder and its lock) is left alone: no launcher of this version can be using it.
const LOCKLESS_PATIENCE: Duration = Duration::from_secs(24 * 3600);
/// The largest error file read back from a rank.
pub(super) const MAX_ERROR_FILE: u64 = 1 << 20;
/// How long the launcher waits for a rank's error file to be read.
const READ_PATIENCE: Duration = Duration::from_secs(2);
/// How long a new folder's lock may be held by another launcher's sweep (which holds a
/// folder's lock only while it looks inside).
const LOCK_PATIENCE: Duration = Duration::from_secs(2);

/// One launch's run folder, removed when dropped (the lock goes last, after the folder).
pub(super) struct RunFolder {
    // Field order is drop order: the folder is removed while the lock is still held.
    dir: tempfile::TempDir,
    _lock: File,
}

impl RunFolder {
    /// Removes this user's dead launchers' folders, then makes and locks this launch's own in
    /// the temporary directory (`TMPDIR`, else /tmp).
    pub(super) fn new() -> Result<RunFolder> {
        RunFolder::new_in(&std::env::temp_dir())
    }

    fn new_in(tmp: &Path) -> Result<RunFolder> {
        sweep(tmp);
        let dir = tempfile::Builder::new()
            .prefix(PREFIX)
            .rand_bytes(12)
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(tmp)
            .map_err(|e| Error::io(format!("create a run folder in {}", tmp.display()), e))?;
        let path = dir.path().join(LOCK);
        let lock = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io(format!("create {}", path.display()), e))?;
        // Another launcher's sweep may hold it for the moment it takes to look inside.
        let deadline = std::time::Instant::now() + LOCK_PATIENCE;
        while let Err(e) = rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive) {
            if e != rustix::io::Errno::WOULDBLOCK || std::time::Instant::now() > deadline {
                return Err(Error::io(format!("lock {}", path.display()), e.into()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let attempt = dir.path().join(ATTEMPT);
        std::fs::create_dir(&attempt).map_err(|e| Error::io(format!("create {}", attempt.display()), e))?;
        Ok(RunFolder { dir, _lock: lock })
    }

    /// Where `rank` writes its error file.
    pub(super) fn error_file(&self, rank: usize) -> PathBuf {
        self.dir.path().join(ATTEMPT).join(rank.to_string()).join("error.json")
    }

    /// Makes the folder of `rank`'s error file (the rank writes the file itself, or not at all)
    /// and returns the file's path.
    pub(super) fn prepare(&self, rank: usize) -> Result<PathBuf> {
        let path = self.error_file(rank);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(format!("create {}", parent.display()), e))?;
        }
        Ok(path)
    }
}

/// Removes the run folders in `tmp` of this user's launchers that are gone: a folder (not a
/// symlink) owned by this user whose lock can be taken, and whose launcher had got past taking
/// it. A live launcher's lock is held, so its folder is never touched, whatever pid namespace
/// either launcher runs in. Others' folders, and anything odd in place of a lock (a symlink, a
/// FIFO, another user's file), are left alone. A folder without a lock file goes once it has
/// not changed for [`LOCKLESS_PATIENCE`].
fn sweep(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    let me = rustix::process::geteuid().as_raw();
    for e in entries.flatten() {
        if !e.file_name().as_bytes().starts_with(PREFIX.as_bytes()) {
            continue;
        }
        // The entry's own metadata: a symlink is never followed.
        let Ok(meta) = e.metadata() else { continue };
        if meta.is_dir() && meta.uid() == me {
            remove_if_dead(&e.path(), &meta, me);
        }
    }
}

fn remove_if_dead(dir: &Path, meta: &Metadata, me: u32) {
    let unchanged_long = meta.modified().ok().and_then(|m| m.elapsed().ok()).is_some_and(|a| a > LOCKLESS_PATIENCE);
    let lock = match open_untrusted(&dir.join(LOCK)) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if unchanged_long {
                let _ = std::fs::remove_dir_all(dir);
            }
            return;
        }
        Err(_) => return,
    };
    if !lock.metadata().is_ok_and(|m| m.is_file() && m.uid() == me) {
        return;
    }
    if rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive).is_err() {
        return; // its launcher is alive
    }
    // A free lock in a folder whose launcher never got to hold it may be one being made now.
    let past_locking = std::fs::symlink_metadata(dir.join(ATTEMPT)).is_ok_and(|m| m.is_dir());
    if past_locking || unchanged_long {
        tracing::debug!("removing {}, the run folder of a launcher that is gone", dir.display());
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Opens a file someone else controls for reading: not through a symlink, not blocking (a
/// FIFO with no writer, a device), not becoming its controlling terminal.
fn open_untrusted(path: &Path) -> std::io::Result<File> {
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    Ok(File::from(rustix::fs::open(path, flags, rustix::fs::Mode::empty())?))
}

/// Reads `rank`'s error file in torchrun's format, if it wrote one, without waiting for it
/// longer than [`READ_PATIENCE`]: what is wrong with it is logged, and the file ignored.
pub(super) async fn read_error_file(rank: usize, path: PathBuf) -> Option<RankError> {
    let read = tokio::task::spawn_blocking(move || {
        let r = read_error_file_now(&path);
        if let Err(why) = &r {
            tracing::warn!("ignored rank {rank}'s error file {}: {why}", path.display());
        }
        r.ok().flatten()
    });
    match tokio::time::timeout(READ_PATIENCE, read).await {
        Ok(Ok(error)) => error,
        Ok(Err(e)) => {
            tracing::warn!("reading rank {rank}'s error file failed: {e}");
            None
        }
        Err(_) => {
            tracing::warn!("gave up reading rank {rank}'s error file after {READ_PATIENCE:?}");
            None
        }
    }
}

/// Reads an error file (`{"message": {"message": ..., "extraInfo": {"py_callstack": ...,
/// "timestamp": ...}}}`, or a plain string message): `Ok(None)` if there is none, or none in
/// that format; `Err` says why the file was refused.
fn read_error_file_now(path: &Path) -> std::result::Result<Option<RankError>, String> {
    let f = match open_untrusted(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err("it is a symbolic link".into()),
        Err(e) => return Err(e.to_string()),
    };
    let meta = f.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err(format!("it is not a regular file but {}", kind(meta.file_type())));
    }
    let mut bytes = Vec::new();
    f.take(MAX_ERROR_FILE + 1).read_to_end(&mut bytes).map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_ERROR_FILE {
        return Err(format!("it is larger than {MAX_ERROR_FILE} bytes"));
    }
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(&bytes) else { return Ok(None) };
    let (message, traceback) = match &json["message"] {
        serde_json::Value::String(m) => (m.clone(), None),
        m => match m["message"].as_str() {
            Some(s) => (s.to_string(), m["extraInfo"]["py_callstack"].as_str().map(str::to_string)),
            None => return Ok(None),
        },
    };
    Ok(Some(RankError { message, traceback, json }))
}

/// What kind of file `t` is, for messages.
fn kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    match () {
        _ if t.is_dir() => "a directory",
        _ if t.is_fifo() => "a FIFO",
        _ if t.is_socket() => "a socket",
        _ if t.is_char_device() => "a character device",
        _ if t.is_block_device() => "a block device",
        _ => "not a file",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_files_are_read_only_when_they_are_small_regular_files() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("error.json");
        assert_eq!(read_error_file_now(&p), Ok(None), "no file is no error");
        std::fs::write(&p, r#"{"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": "tb"}}}"#)
            .unwrap();
        let e = read_error_file_now(&p).unwrap().unwrap();
        assert_eq!((e.message.as_str(), e.traceback.as_deref()), ("RuntimeError: boom", Some("tb")));
        std::fs::write(&p, r#"{"message": "plain"}"#).unwrap();
        assert_eq!(read_error_file_now(&p).unwrap().unwrap().message, "plain");
        std::fs::write(&p, "not json").unwrap();
        assert_eq!(read_error_file_now(&p), Ok(None));
        // One byte over the limit is refused, not cut and misread.
        let big = format!(r#"{{"message": "{}"}}"#, "x".repeat(MAX_ERROR_FILE as usize));
        std::fs::write(&p, big).unwrap();
        assert!(read_error_file_now(&p).unwrap_err().contains("larger than"));
        std::fs::remove_file(&p).unwrap();
        // A FIFO, a symlink (even to a good file), a folder, a device: refused at once.
        rustix::fs::mknodat(rustix::fs::CWD, &p, rustix::fs::FileType::Fifo, rustix::fs::Mode::RUSR, 0).unwrap();
        assert!(read_error_file_now(&p).unwrap_err().contains("not a regular file"));
        std::fs::remove_file(&p).unwrap();
        let good = d.path().join("good.json");
        std::fs::write(&good, r#"{"message": "plain"}"#).unwrap();
        std::os::unix::fs::symlink(&good, &p).unwrap();
        assert!(read_error_file_now(&p).unwrap_err().contains("symbolic link"));
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        assert!(read_error_file_now(&p).unwrap_err().contains("not a regular file"));
        assert!(read_error_file_now(Path::new("/dev/zero")).unwrap_err().contains("not a regular file"));
    }

    #[test]
    fn a_folder_is_swept_only_when_its_lock_is_free() {
        let tmp = tempfile::tempdir().unwrap();
        let folder = |name: &str| {
            let p = tmp.path().join(name);
            std::fs::create_dir(&p).unwrap();
            std::fs::create_dir(p.join(ATTEMPT)).unwrap();
            std::fs::write(p.join(LOCK), b"").unwrap();
            p
        };
        let live = folder("symmem-run-live");
        let held = File::open(live.join(LOCK)).unwrap();
        rustix::fs::flock(&held, FlockOperation::LockExclusive).unwrap();
        let dead = folder("symmem-run-dead");
        // A folder being made: its lock not yet taken, no attempt_0 yet.
        let fresh = folder("symmem-run-fresh");
        std::fs::remove_dir(fresh.join(ATTEMPT)).unwrap();
        // Older symmems' folders: no lock file at all.
        let legacy = tmp.path().join("symmem-run-123-0");
        std::fs::create_dir(&legacy).unwrap();
        // Odd things in place of a lock.
        let fifo = folder("symmem-run-fifo");
        std::fs::remove_file(fifo.join(LOCK)).unwrap();
        rustix::fs::mknodat(rustix::fs::CWD, fifo.join(LOCK), rustix::fs::FileType::Fifo, rustix::fs::Mode::RUSR, 0)
            .unwrap();
        let link = folder("symmem-run-link");
        std::fs::remove_file(link.join(LOCK)).unwrap();
        std::os::unix::fs::symlink(dead.join(LOCK), link.join(LOCK)).unwrap();
        // A symlink named like a run folder, to a folder that would be swept.
        let target = folder("elsewhere");
        std::os::unix::fs::symlink(&target, tmp.path().join("symmem-run-symlink")).unwrap();

        sweep(tmp.path());
        assert!(!dead.exists(), "a folder whose lock is free is swept");
        for kept in [&live, &fresh, &legacy, &fifo, &link, &target] {
            assert!(kept.exists(), "{} must stay", kept.display());
        }
        assert!(tmp.path().join("symmem-run-symlink").exists());
        drop(held);
        sweep(tmp.path());
        assert!(!live.exists(), "its launcher gone, the folder goes");

        // A new folder: private, locked, and the ranks' files go beside the lock.
        let made = RunFolder::new_in(tmp.path()).unwrap();
        let root = made.dir.path().to_path_buf();
        assert_eq!(std::fs::metadata(&root).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(made.prepare(3).unwrap().starts_with(root.join(ATTEMPT).join("3")));
        sweep(tmp.path());
        assert!(root.exists(), "a live launcher's folder stays");
        drop(made);
        assert!(!root.exists());
    }
}
