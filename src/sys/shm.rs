//! Shared memory: anonymous memory files (memfd) and their mappings.
//!
//! A segment's lifecycle: create (memfd, no name in any file system) → size (`fallocate`, so a
//! full tmpfs fails here with ENOSPC instead of SIGBUS on first touch, as NCCL does) → map →
//! share (peers open `/proc/<pid>/fd/<fd>` while the owner is alive) → unmap on drop. Nothing
//! ever appears in /dev/shm, so no crash, not even `kill -9`, can leave a file behind: the
//! kernel frees the memory when the last mapping and descriptor are gone.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use rustix::fs::{FallocateFlags, MemfdFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};

/// Creates an anonymous shared-memory file of `len` bytes, all zero.
pub(crate) fn create(name: &str, len: usize) -> Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC)
        .map_err(|e| Error::io(format!("memfd_create {name:?}"), e.into()))?;
    rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len as u64).map_err(|e| {
        Error::io(format!("fallocate memfd {name:?} to {len} bytes (is /dev/shm or memory full?)"), e.into())
    })?;
    Ok(fd)
}

/// Creates an anonymous shared-memory file of `len` bytes, all zero, whose pages are allocated
/// only when first written (for mirrors that are filled piecemeal; a failed allocation then
/// fails the write that needed it, which the transport reports).
pub(crate) fn create_sparse(name: &str, len: usize) -> Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC)
        .map_err(|e| Error::io(format!("memfd_create {name:?}"), e.into()))?;
    rustix::fs::ftruncate(&fd, len as u64)
        .map_err(|e| Error::io(format!("size memfd {name:?} to {len} bytes"), e.into()))?;
    Ok(fd)
}

/// Opens another process's shared-memory file through `/proc/<pid>/fd/<fd>`. The kernel allows
/// it when this process may inspect that one (same user, no ptrace restriction).
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
    Ok(file.into())
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
