//! The small all-reduce across hosts: one one-way message per pair of hosts.
//!
//! ```text
//!   per group, a symmetric workspace: [ epoch words | inbox 0 | inbox 1 | result 0 | result 1 ]
//!   call e (parity p = e % 2), message of n bytes:
//!     every rank     copies its input into inbox p, slot `rank` (its own buffer), and tells
//!                    its host's leader (ARRIVE)
//!     each leader    copies its host's inputs into its own inbox p, writes them into every
//!                    other leader's inbox p and raises that leader's FROM word to e (a write
//!                    and a remote atomic on one link, in order, not awaited); waits until its
//!                    own FROM words reach e; reduces slots 0..ws in rank order into result p
//!                    and releases its host (RELEASE)
//!     the others     copy the leader's result p
//! ```
//!
//! Buffers alternate, so nothing is overwritten while still read: a leader writes inbox p of
//! call e+2 only after it has the other leader's FROM of call e+1, which that leader raises
//! after it finished reducing call e; a host's ranks arrive for call e+2 only after they copied
//! the result of call e. The reduction is the same kernel in the same rank order as on one
//! host, so the results are bitwise the same.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use super::reduce::{self, ReduceOp};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::symm::hostsync::{Words, settle};
use crate::symm::{self, Device, SymmHandle};
use crate::tensor::{DType, Tensor};
use crate::transport::Work;

/// The largest block of a host's inputs this path takes (above, the two-shot algorithm spreads
/// the work over every rank).
const HOST_BLOCK_MAX: usize = 256 * 1024;

/// The transport keeps writes of at most this size in order with the atomic that follows.
const IN_ORDER: usize = 64 * 1024;

struct Workspace {
    _tensor: Tensor,
    words: Words,
    /// Bytes per message this workspace holds (per rank).
    cap: usize,
    epoch: u32,
    sent: Vec<(usize, Work)>,
}

fn workspaces() -> &'static Mutex<HashMap<String, Workspace>> {
    static W: std::sync::OnceLock<Mutex<HashMap<String, Workspace>>> = std::sync::OnceLock::new();
    W.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Bytes of epoch words at the start of the workspace.
fn words_bytes(ws: usize) -> usize {
    (4 * (2 * ws + 1)).div_ceil(128) * 128
}

/// Whether a message of `bytes` with at most `ranks_per_host` ranks on a host takes this path.
pub(crate) fn fits_size(bytes: usize, ranks_per_host: usize) -> bool {
    bytes > 0 && bytes.next_multiple_of(16) * ranks_per_host <= HOST_BLOCK_MAX
}

/// Whether a message of `bytes` on the group behind `h` takes this path.
pub(crate) fn fits(h: &SymmHandle, bytes: usize) -> bool {
    fits_size(bytes, h.max_ranks_per_host())
}

/// In-place all-reduce of a small message on a group that spans hosts (see the module docs).
pub(crate) fn all_reduce(tensor: &Tensor, op: ReduceOp, group: &Group, timeout: Duration) -> Result<()> {
    let n = tensor.nbytes();
    let stride = n.next_multiple_of(16);
    let (me, world) = (group.rank(), group.world_size());
    let mut all = workspaces().lock().unwrap_or_else(|p| p.into_inner());
    if all.get(group.name()).is_none_or(|w| w.cap < stride) {
        // Collective: every rank makes (or grows) it at the same call, the sizes being equal.
        let cap = stride.max(4096).next_power_of_two();
        let t = symm::empty(&[words_bytes(world) + 2 * world * cap + 2 * cap], DType::U8, Device::Cpu)?;
        let handle = symm::rendezvous(&t, group)?;
        handle.barrier(0, timeout)?;
        all.insert(
            group.name().to_string(),
            Workspace { _tensor: t, words: Words::new(handle, 0), cap, epoch: 0, sent: Vec::new() },
        );
    }
    let w = all.get_mut(group.name()).ok_or_else(|| Error::InvalidArgument("workspace vanished".into()))?;
    let e = w.epoch.wrapping_add(1);
    let hw = w.words.h.clone();
    let p = hw.patience(timeout);
    let parity = (e % 2) as usize;
    let base = hw.offset() + words_bytes(world);
    let inbox = |r: usize| base + parity * world * w.cap + r * stride;
    let result = base + 2 * world * w.cap + parity * w.cap;
    let own = |at: usize| (hw.read_ptr(me) + at) as *mut u8;
    let (arrive, release, from) = (|r: usize| r, world, |l: usize| world + 1 + l);
    let locals = hw.local_ranks();
    let leader = locals[0];

    // SAFETY: slot `me` of inbox p lies in this rank's own workspace (sized for `cap` >= stride
    // bytes per slot); nobody reads it before the ARRIVE below, and nobody still reads it from
    // call e-2 (see the module docs).
    unsafe { std::ptr::copy_nonoverlapping(tensor.data_ptr().cast_const(), own(inbox(me)), n) };
    if me != leader {
        w.words.publish(leader, arrive(me), e);
        w.words.wait_for(release, e, leader, &p, timeout)?;
        let res = (hw.read_ptr(leader) + result) as *const u8;
        // SAFETY: the leader's result p is final (RELEASE e seen with Acquire) and is not
        // rewritten before this rank arrives for call e+2.
        unsafe { std::ptr::copy_nonoverlapping(res, tensor.data_ptr(), n) };
        w.epoch = e;
        return Ok(());
    }
    settle(&hw, &mut w.sent, timeout)?;
    for &r in &locals[1..] {
        w.words.wait_for(arrive(r), e, r, &p, timeout)?;
        // SAFETY: rank r's slot is final (ARRIVE e seen with Acquire) and r rewrites it only
        // for call e+2, after this leader's RELEASE e+1; both slots hold `n` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping((hw.read_ptr(r) + inbox(r)) as *const u8, own(inbox(r)), n);
        }
    }
    // This host's inputs, as runs of consecutive ranks, to every other leader; then its epoch.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &r in &locals {
        match runs.last_mut() {
            Some((a, b)) if *b == r => *b = r + 1,
            _ => runs.push((r, r + 1)),
        }
    }
    for l in hw.leaders().into_iter().filter(|&l| l != leader) {
        for &(a, b) in &runs {
            let len = (b - a - 1) * stride + n;
            for at in (0..len).step_by(IN_ORDER) {
                let piece = IN_ORDER.min(len - at);
                w.sent.push((l, hw.start_push(l, inbox(a) + at, piece, inbox(a) + at, timeout)?));
            }
        }
        w.sent.push((l, w.words.start_remote(l, from(leader), e, timeout)?));
    }
    for l in hw.leaders().into_iter().filter(|&l| l != leader) {
        w.words.wait_for(from(l), e, l, &p, timeout)?;
    }
    let srcs: Vec<*const u8> = (0..world).map(|r| own(inbox(r)).cast_const()).collect();
    // SAFETY: every slot of inbox p holds its rank's input of call e (local copies above, remote
    // writes landed before the FROM words, seen with Acquire); result p holds `cap` >= n bytes
    // and nobody reads it until RELEASE e.
    unsafe { reduce::reduce(tensor.dtype(), op, &srcs, &[own(result)], tensor.numel(), world)? };
    for &r in &locals[1..] {
        w.words.publish(r, release, e);
    }
    // SAFETY: as above; the tensor holds n bytes.
    unsafe { std::ptr::copy_nonoverlapping(own(result).cast_const(), tensor.data_ptr(), n) };
    w.epoch = e;
    Ok(())
}
