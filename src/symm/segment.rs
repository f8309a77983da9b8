//! One symmetric allocation's shared memory: a memfd laid out as header, signal pad, data.
//!
//! ```text
//!   0            64           128                         data_offset                 segment_len
//!   | Header     | live words | signal pad (u32 slots)     | data buffer                 |
//!   | magic, ver | sleepers   | pad_size bytes, zeroed     | data_size bytes             |
//! ```
//!
//! The header is written once by the owner; the live words after it change while the segment
//! is in use (`sleepers`: how many threads of any process sleep on a futex word of this
//! segment, [`crate::sync::sleep_on`]), on a cache line of their own.
//!
//! The pad starts 128-byte aligned and the data starts at `round_up(128 + pad_size, 128)`, so
//! filling the data never touches the pad. The owner creates the memfd and keeps it open for
//! the allocation's lifetime; peers open it through `/proc/<pid>/fd/<fd>`, check the header
//! and map it. Nothing is ever named in /dev/shm.

use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicU32;

use crate::error::{Error, Result};
use crate::sys::shm::{self, Mapping};
use crate::tensor::Storage;
use crate::wire::symm::PeerRecord;

const MAGIC: [u8; 8] = *b"SYMMEM\0\x01";
/// 2: the sleepers count at byte 64 (version 1's processes would neither count themselves nor
/// be counted on, so the two refuse each other's segments).
const VERSION: u32 = 2;
const ALIGN: usize = 128;

/// The first 64 bytes of every segment, written once by its owner.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, bytemuck::Pod, bytemuck::Zeroable)]
struct Header {
    magic: [u8; 8],
    version: u32,
    header_len: u32,
    pad_size: u64,
    data_offset: u64,
    data_size: u64,
    segment_len: u64,
    owner_pid: u32,
    _reserved: [[u8; 4]; 3],
}

/// Where the sleepers count is: after the header, in the first 128 bytes.
const SLEEPERS: usize = 64;

const _: () = assert!(size_of::<Header>() == SLEEPERS && SLEEPERS + 4 <= ALIGN);

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

/// A mapped segment: the owner's own, or a peer's.
#[derive(Debug)]
pub(crate) struct Segment {
    map: Mapping,
    /// The owner keeps its memfd open so peers can open it.
    fd: Option<OwnedFd>,
    pad_size: usize,
    data_offset: usize,
    data_size: usize,
}

impl Segment {
    /// Creates a zeroed segment with a pad of `pad_size` bytes and `data_size` bytes of data.
    pub(crate) fn create(pad_size: usize, data_size: usize) -> Result<Segment> {
        let too_big = || Error::InvalidArgument(format!("symmetric allocation of {data_size} bytes is too large"));
        let data_offset = round_up(ALIGN + pad_size, ALIGN).ok_or_else(too_big)?;
        // Page granularity (4 KiB on every Linux target symmem supports).
        let page = 4096;
        let segment_len =
            data_offset.checked_add(round_up(data_size.max(1), 16).ok_or_else(too_big)?).ok_or_else(too_big)?;
        let segment_len = round_up(segment_len, page).ok_or_else(too_big)?;
        let fd = shm::create("symmem", segment_len)?;
        let map = Mapping::new(&fd, segment_len)?;
        let header = Header {
            magic: MAGIC,
            version: VERSION,
            header_len: ALIGN as u32,
            pad_size: pad_size as u64,
            data_offset: data_offset as u64,
            data_size: data_size as u64,
            segment_len: segment_len as u64,
            owner_pid: std::process::id(),
            _reserved: [[0; 4]; 3],
        };
        // SAFETY: the mapping is at least one page (>= 128 bytes), page-aligned (so aligned for
        // Header), and no one else has it yet. The sleepers count after it starts at zero (a
        // new memfd reads as zeros).
        unsafe { map.ptr().cast::<Header>().write(header) };
        Ok(Segment { map, fd: Some(fd), pad_size, data_offset, data_size })
    }

    /// Opens and maps a peer's segment from its rendezvous record, checking that its header
    /// says what the record says.
    pub(crate) fn open(rank: usize, record: &PeerRecord) -> Result<Segment> {
        let fd = shm::open_peer(record.pid, record.fd)?;
        let len = shm::size(&fd)?;
        if len as u64 != record.segment_len || len < ALIGN {
            return Err(Error::Rendezvous(format!(
                "rank {rank}'s segment (pid {} fd {}) is {len} bytes, but it announced {}",
                record.pid, record.fd, record.segment_len
            )));
        }
        let map = Mapping::new(&fd, len)?;
        // SAFETY: the mapping is page-aligned and at least 128 bytes; Header is Pod, so any
        // bytes are a valid value; its owner wrote it before announcing the segment and never
        // again (the live words after it are not read here).
        let h = unsafe { map.ptr().cast::<Header>().read() };
        let fits = (h.data_offset as usize).checked_add(h.data_size as usize).is_some_and(|end| end <= len);
        if h.magic != MAGIC
            || h.version != VERSION
            || h.owner_pid != record.pid
            || h.pad_size != record.pad_size
            || h.data_size != record.buffer_size
            || h.data_offset < ALIGN as u64 + h.pad_size
            || !fits
        {
            return Err(Error::Rendezvous(format!(
                "rank {rank}'s segment (pid {} fd {}) is not the symmem allocation it announced (header {h:?})",
                record.pid, record.fd
            )));
        }
        Ok(Segment {
            map,
            fd: None,
            pad_size: h.pad_size as usize,
            data_offset: h.data_offset as usize,
            data_size: h.data_size as usize,
        })
    }

    /// The owner's descriptor number, for the rendezvous record.
    pub(crate) fn fd_number(&self) -> i32 {
        self.fd.as_ref().map_or(-1, shm::raw)
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn pad_size(&self) -> usize {
        self.pad_size
    }

    pub(crate) fn data_size(&self) -> usize {
        self.data_size
    }

    pub(crate) fn pad_ptr(&self) -> *mut u8 {
        self.map.ptr().wrapping_add(ALIGN)
    }

    pub(crate) fn data_ptr(&self) -> *mut u8 {
        self.map.ptr().wrapping_add(self.data_offset)
    }

    /// The count of threads sleeping on a futex word of this segment (see the module docs).
    pub(crate) fn sleepers(&self) -> &AtomicU32 {
        // SAFETY: bytes 64..68 lie inside the mapping (at least 128 bytes, checked at open and
        // made so at create), which lives as long as `self`; 4-aligned (the mapping is
        // page-aligned); AtomicU32 has u32's layout; every process touches it only atomically.
        unsafe { &*self.map.ptr().add(SLEEPERS).cast::<AtomicU32>() }
    }

    /// Slot `i` of the signal pad.
    pub(crate) fn slot(&self, i: usize) -> &AtomicU32 {
        assert!((i + 1) * 4 <= self.pad_size, "signal slot {i} outside a pad of {} bytes", self.pad_size);
        // SAFETY: the slot lies inside the pad (checked above), which lies inside the mapping
        // that lives as long as `self`; it is 4-byte aligned (the pad starts 128-aligned); and
        // AtomicU32 has the layout of u32. Every process touches pad slots only atomically.
        unsafe { &*self.pad_ptr().add(i * 4).cast::<AtomicU32>() }
    }
}

// SAFETY: the data region lies inside the mapping, which lives (at a fixed address) as long as
// the Segment.
unsafe impl Storage for Segment {
    fn ptr(&self) -> *mut u8 {
        self.data_ptr()
    }
    fn len(&self) -> usize {
        self.data_size
    }
    fn shared_file(&self) -> Option<(i32, u64)> {
        self.fd.as_ref().map(|fd| (shm::raw(fd), self.data_offset as u64))
    }
    fn sleepers(&self) -> Option<&AtomicU32> {
        Some(Segment::sleepers(self))
    }
}

/// The signal pad of a segment, as storage for a `u32` tensor view.
#[derive(Debug)]
pub(crate) struct Pad(pub(crate) std::sync::Arc<Segment>);

// SAFETY: the pad region lies inside the mapping, which the Arc keeps alive.
unsafe impl Storage for Pad {
    fn ptr(&self) -> *mut u8 {
        self.0.pad_ptr()
    }
    fn len(&self) -> usize {
        self.0.pad_size
    }
    fn sleepers(&self) -> Option<&AtomicU32> {
        Some(self.0.sleepers())
    }
}
