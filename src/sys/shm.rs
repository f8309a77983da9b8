//! Shared memory: anonymous memory files (memfd) and their mappings.
//!
//! A segment's lifecycle: create (memfd, no name in any file system) → size (`fallocate`, so a
//! full tmpfs fails here with ENOSPC instead of SIGBUS on first touch, as NCCL does) → map →
//! share (peers open `/proc/<pid>/fd/<fd>` while the owner is alive) → unmap on drop. Nothing
//! ever appears in /dev/shm, so no crash, not even `kill -9`, can leave a file behind: the
//! kernel frees the memory when the last mapping and descriptor are gone.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use rustix::fs::{FallocateFlags, MemfdFlags, Mode, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};

/// The seals every shared-memory file of symmem carries, and that a peer's must carry before
/// it is mapped: its size is fixed for good. A mapping of a file that shrinks faults with
/// SIGBUS on the pages cut off, so a peer that could truncate its file could kill every
/// process mapping it; sealed, `ftruncate` fails instead (`F_SEAL_SEAL`: nobody adds or
/// removes seals later).
const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

/// A new memory file, readable and writable by this user only (memfds start at mode 0777).
fn memfd(name: &str) -> Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| Error::io(format!("memfd_create {name:?}"), e.into()))?;
    rustix::fs::fchmod(&fd, Mode::RUSR | Mode::WUSR)
        .map_err(|e| Error::io(format!("fchmod memfd {name:?} to 0600"), e.into()))?;
    Ok(fd)
}

fn seal(fd: &OwnedFd, name: &str) -> Result<()> {
    rustix::fs::fcntl_add_seals(fd, SEALS).map_err(|e| Error::io(format!("seal memfd {name:?}"), e.into()))
}

/// Refuses a shared-memory file larger than this machine's memory and swap: memfds have no
/// size limit of their own, so `fallocate` would take pages until the OOM killer stepped in.
fn within_memory(name: &str, len: usize) -> Result<()> {
    let info = rustix::system::sysinfo();
    let unit = u64::from(info.mem_unit.max(1));
    let total = (info.totalram as u64).saturating_add(info.totalswap as u64).saturating_mul(unit);
    if len as u64 > total {
        return Err(Error::InvalidArgument(format!(
            "shared memory {name:?} of {len} bytes is more than this machine's memory and swap ({total} bytes)"
        )));
    }
    Ok(())
}

/// Creates an anonymous shared-memory file of `len` bytes, all zero, mode 0600, its size sealed.
pub(crate) fn create(name: &str, len: usize) -> Result<OwnedFd> {
    within_memory(name, len)?;
    let fd = memfd(name)?;
    rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64).map_err(|e| {
        Error::io(format!("fallocate memfd {name:?} to {len} bytes (is /dev/shm or memory full?)"), e.into())
    })?;
    seal(&fd, name)?;
    Ok(fd)
}

/// Creates an anonymous shared-memory file of `len` bytes, all zero, whose pages are allocated
/// only when first written (for mirrors that are filled piecemeal; a failed allocation then
/// fails the write that needed it, which the transport reports). Mode 0600, size sealed.
pub(crate) fn create_sparse(name: &str, len: usize) -> Result<OwnedFd> {
    within_memory(name, len)?;
    let fd = memfd(name)?;
    rustix::fs::ftruncate(&fd, len as u64)
        .map_err(|e| Error::io(format!("size memfd {name:?} to {len} bytes"), e.into()))?;
    seal(&fd, name)?;
    Ok(fd)
}

/// Opens another process's shared-memory file through `/proc/<pid>/fd/<fd>`. The kernel allows
/// it when this process may inspect that one (same user, no ptrace restriction). The file must
/// be sealed against shrinking (see [`SEALS`]), or mapping it would let its owner kill this
/// process with SIGBUS.
pub(crate) fn open_peer(pid: u32, fd: i32) -> Result<OwnedFd> {
    open_peer_with(pid, fd, true)
}

/// [`open_peer`], read-only or read-write.
pub(crate) fn open_peer_with(pid: u32, fd: i32, write: bool) -> Result<OwnedFd> {
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(&path)
        .map_err(|e| Error::io(format!("open peer shared memory {path}"), e))?;
    let fd = OwnedFd::from(file);
    let seals = rustix::fs::fcntl_get_seals(&fd).unwrap_or(SealFlags::empty());
    if !seals.contains(SealFlags::SHRINK) {
        return Err(Error::InvalidArgument(format!(
            "peer shared memory {path} is not sealed against shrinking (seals {seals:?}); refusing to map it, since \
             its owner could then kill this process with SIGBUS"
        )));
    }
    Ok(fd)
}

/// The size of a memory file, for checking what a peer shared.
pub(crate) fn size(fd: &OwnedFd) -> Result<usize> {
    let st = rustix::fs::fstat(fd).map_err(|e| Error::io("fstat shared memory", e.into()))?;
    Ok(st.st_size as usize)
}

/// The number of a descriptor, to tell peers where to find it.
pub(crate) fn raw(fd: &OwnedFd) -> i32 {
    fd.as_raw_fd()
}

/// A shared, read-write mapping of a whole memory file; unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping is an address range; accesses through it are raw and their synchronization
// is the callers' business (atomics for signal pads, protocol-ordered copies for data).
unsafe impl Send for Mapping {}
// SAFETY: as for Send.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared and read-write.
    pub(crate) fn new(fd: impl AsFd, len: usize) -> Result<Mapping> {
        Mapping::new_at(fd, 0, len, true)
    }

    /// Maps `len` bytes of `fd` from `offset` (a multiple of the page size), shared, and
    /// writable or read-only.
    pub(crate) fn new_at(fd: impl AsFd, offset: u64, len: usize, writable: bool) -> Result<Mapping> {
        if len == 0 {
            return Err(Error::InvalidArgument("cannot map 0 bytes".into()));
        }
        let prot = if writable { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
        // SAFETY: a fresh mapping chosen by the kernel (null hint) cannot alias any Rust
        // object; the fd is valid for the call; the result is checked before use.
        let ptr = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, offset) }
            .map_err(|e| Error::io(format!("mmap {len} bytes of shared memory at offset {offset}"), e.into()))?;
        let ptr = std::ptr::NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::io("mmap returned null", std::io::Error::other("null mapping")))?;
        Ok(Mapping { ptr, len })
    }

    /// The first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The mapping's length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: this range was mapped by `new` and is unmapped only here; every tensor and
        // handle that points into it holds an Arc to its owner, so none outlives it.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!("munmap {} bytes: {e}", self.len);
        }
    }
}

/// The page size mappings are aligned to.
pub(crate) const PAGE: u64 = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_sealed_and_unsealed_peers_refused() {
        let fd = create("symmem-test", 4096).unwrap();
        assert!(rustix::fs::fcntl_get_seals(&fd).unwrap().contains(SEALS));
        assert!(rustix::fs::ftruncate(&fd, 0).is_err(), "a sealed file cannot shrink");
        assert!(open_peer(std::process::id(), raw(&fd)).is_ok());
        // A file without the seals, as a careless or hostile peer might offer.
        let bare = rustix::fs::memfd_create("symmem-bare", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&bare, 4096).unwrap();
        let e = open_peer(std::process::id(), raw(&bare)).unwrap_err().to_string();
        assert!(e.contains("not sealed against shrinking"), "{e}");
    }
}
