//! Small and medium collectives across hosts: one one-way message from each rank to each
//! other host, received by that host's leader (its lowest rank).
//!
//! ```text
//!   per group and operator, a symmetric workspace: [ epoch words | buffers, twice ]
//!   all-reduce, call e (parity p = e % 2), n bytes:
//!     every rank   copies its input into slot `rank` of inbox p (its own buffer); writes it
//!                  into slot `rank` of every other host's leader's inbox p and raises that
//!                  leader's FROM[rank] word to e (a write and a remote atomic on one flow, so
//!                  in order, not awaited); tells its own leader (ARRIVE)
//!     each leader  waits for its host (ARRIVE) and every remote rank (FROM); reduces slots
//!                  0..ws in rank order (its host's ranks read in their own buffers) into
//!                  result p; releases its host (RELEASE)
//!     the others   copy the leader's result p
//!   all-to-all: the same, with each rank sending the blocks for another host's ranks, and
//!   every rank copying its blocks from its host's ranks' stages and its leader's inbox
//!   tiny messages (up to 16 KiB per rank): the leader gathers its host's data first and sends
//!   one message per other host (FROM words then count leaders, not ranks)
//! ```
//!
//! Buffers alternate, so nothing is overwritten while still read: a rank writes a leader's
//! inbox p of call e+2 only after it finished call e+1, which needed (through its own leader)
//! the FROM words of call e+1 of every rank of that leader's host, which they raise only after
//! they finished call e, reads of the inbox included. A rank's own slot is rewritten only
//! after the sends of call e-2 from it have landed. The reduction is the same kernel in the
//! same rank order as on one host, so the results are bitwise the same.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::reduce::{self, ReduceOp};
use crate::error::Result;
use crate::group::Group;
use crate::symm::hostsync::{Sent, Words, settle};
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
    sent: Sent,
}

/// Bytes of epoch words at the start of the workspace.
fn words_bytes(ws: usize) -> usize {
    (4 * (2 * ws + 1)).div_ceil(128) * 128
}

/// Workspaces per (group, operator), each locked for the length of a call; the map itself only
/// for a lookup, so calls on different groups never wait for each other.
type Workspaces = HashMap<(String, &'static str), Arc<Mutex<Workspace>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The workspace of `kind` on `group` for messages of up to `cap` bytes, `bytes(cap)` after
/// the words; made (or grown) collectively, which every rank does at the same call since the
/// sizes are the same everywhere.
fn workspace(
    group: &Group,
    kind: &'static str,
    cap: usize,
    bytes: impl Fn(usize) -> usize,
    timeout: Duration,
) -> Result<Arc<Mutex<Workspace>>> {
    static W: std::sync::OnceLock<Mutex<Workspaces>> = std::sync::OnceLock::new();
    let key = (group.name().to_string(), kind);
    let mut all = lock(W.get_or_init(|| Mutex::new(HashMap::new())));
    if let Some(w) = all.get(&key)
        && lock(w).cap >= cap
    {
        return Ok(w.clone());
    }
    let cap = cap.max(4096).next_power_of_two();
    let t = symm::empty(&[words_bytes(group.world_size()) + bytes(cap)], DType::U8, Device::Cpu)?;
    let handle = symm::rendezvous(&t, group)?;
    handle.barrier(0, timeout)?;
    let words = Words::new(handle, 0);
    let w = Arc::new(Mutex::new(Workspace { _tensor: t, words, cap, epoch: 0, sent: Vec::new() }));
    all.insert(key, w.clone());
    Ok(w)
}

/// Above this, a block goes as one striped write (every flow of the link) that is waited for
/// before the signal; below, as in-order pieces on one flow that the signal can follow at once.
const STRIPED: usize = 512 * 1024;

/// Writes `len` bytes at `src` of this rank's buffer to `dst` of `leader`'s, so that a remote
/// atomic started next lands after them; returns the writes still in flight.
fn send_before_signal(
    h: &SymmHandle,
    leader: usize,
    src: usize,
    dst: usize,
    len: usize,
    timeout: Duration,
) -> Result<Vec<Work>> {
    if len > STRIPED {
        let w = h.start_push(leader, src, len, dst, timeout)?;
        w.wait(None).map_err(|e| match h.remote(leader) {
            Some(r) => r.link.error("writing to", &e),
            None => e,
        })?;
        return Ok(Vec::new());
    }
    (0..len)
        .step_by(IN_ORDER)
        .map(|at| h.start_push(leader, src + at, IN_ORDER.min(len - at), dst + at, timeout))
        .collect()
}

/// Whether a message of `bytes` with at most `ranks_per_host` ranks on a host takes this path.
pub(crate) fn fits_size(bytes: usize, ranks_per_host: usize) -> bool {
    bytes > 0 && bytes.next_multiple_of(16) * ranks_per_host <= HOST_BLOCK_MAX
}

/// Whether a message of `bytes` on the group behind `h` takes this path.
pub(crate) fn fits(h: &SymmHandle, bytes: usize) -> bool {
    fits_size(bytes, h.max_ranks_per_host())
}

/// Up to this many bytes per rank, a host's leader aggregates its host's sends (fewer messages);
/// above, every rank sends its own (no copies through the leader, every rank's link busy).
const GATHERED_MAX: usize = 16 * 1024;

/// In-place all-reduce of a small message on a group that spans hosts (see the module docs).
pub(crate) fn all_reduce(tensor: &Tensor, op: ReduceOp, group: &Group, timeout: Duration) -> Result<()> {
    if tensor.nbytes() <= GATHERED_MAX {
        return all_reduce_gathered(tensor, op, group, timeout);
    }
    let n = tensor.nbytes();
    let stride = n.next_multiple_of(16);
    let (me, world) = (group.rank(), group.world_size());
    let ws = workspace(group, "all_reduce", stride, |cap| 2 * world * cap + 2 * cap, timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let hw = w.words.h.clone();
    let p = hw.patience(timeout);
    let parity = (e % 2) as usize;
    let base = hw.offset() + words_bytes(world);
    let inbox = |r: usize| base + parity * world * w.cap + r * stride;
    let result = base + 2 * world * w.cap + parity * w.cap;
    let own = |at: usize| (hw.read_ptr(me) + at) as *mut u8;
    let (arrive, release, from) = (|r: usize| r, world, |r: usize| world + 1 + r);
    let locals = hw.local_ranks();
    let leader = locals[0];

    // The sends of call e-2 read this call's buffers: they must have landed; those of call e-1
    // may still be in flight.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    // SAFETY: slot `me` of inbox p lies in this rank's own workspace (sized for `cap` >= stride
    // bytes per slot); nobody reads it before this rank's ARRIVE and FROM below, nobody still
    // reads it from call e-2, and its sends of call e-2 have landed (above).
    unsafe { std::ptr::copy_nonoverlapping(tensor.data_ptr().cast_const(), own(inbox(me)), n) };
    for l in hw.leaders().into_iter().filter(|&l| l != leader) {
        for work in send_before_signal(&hw, l, inbox(me), inbox(me), n, timeout)? {
            w.sent.push((l, e, work));
        }
        w.sent.push((l, e, w.words.start_remote(l, from(me), e, timeout)?));
    }
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
    for &r in &locals[1..] {
        w.words.wait_for(arrive(r), e, r, &p, timeout)?;
    }
    for r in (0..world).filter(|&r| !hw.is_local(r)) {
        w.words.wait_for(from(r), e, r, &p, timeout)?;
    }
    // A local rank's input is in its own slot, a remote rank's in this leader's.
    let srcs: Vec<*const u8> =
        (0..world).map(|r| (hw.read_ptr(if hw.is_local(r) { r } else { me }) + inbox(r)) as *const u8).collect();
    // SAFETY: every slot read holds its rank's input of call e (local ones published before
    // ARRIVE, remote ones landed before FROM, both seen with Acquire) and is not rewritten
    // before call e+2; result p holds `cap` >= n bytes and nobody reads it until RELEASE e.
    unsafe { reduce::reduce(tensor.dtype(), op, &srcs, &[own(result)], tensor.numel(), world)? };
    for &r in &locals[1..] {
        w.words.publish(r, release, e);
    }
    // SAFETY: as above; the tensor holds n bytes.
    unsafe { std::ptr::copy_nonoverlapping(own(result).cast_const(), tensor.data_ptr(), n) };
    w.epoch = e;
    Ok(())
}

/// Equal-split all-to-all on a group that spans hosts (`h`: the input's handle): every rank
/// stages its input in its workspace and writes, to each other host's leader, the blocks for
/// that host's ranks (then raises the leader's FROM word); each rank copies its blocks from the
/// stages of the ranks on its host and from its leader's inbox. One message from each rank to
/// each other host; the buffers alternate as in the all-reduce, with the same argument.
pub(crate) fn all_to_all(input: &Tensor, out: &Tensor, group: &Group, h: &SymmHandle, timeout: Duration) -> Result<()> {
    if input.nbytes() <= GATHERED_MAX {
        return all_to_all_gathered(input, out, group, h, timeout);
    }
    let (me, world) = (group.rank(), group.world_size());
    let b = input.nbytes() / world;
    let bs = b.next_multiple_of(16);
    let (hosts, lmax) = (h.hosts(), h.max_ranks_per_host());
    // Per parity: the stage (world blocks) and the inbox ([source host][sender][receiver]).
    let per = move |cap: usize| world * cap + hosts * lmax * lmax * cap;
    let ws = workspace(group, "all_to_all", bs, move |cap| 2 * per(cap), timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let hw = w.words.h.clone();
    let p = hw.patience(timeout);
    let base = hw.offset() + words_bytes(world) + (e % 2) as usize * per(w.cap);
    let stage = |d: usize| base + d * bs;
    let inbox = |host: usize, ls: usize, ld: usize| base + world * w.cap + ((host * lmax + ls) * lmax + ld) * bs;
    let at = |rank: usize, off: usize| (hw.read_ptr(rank) + off) as *mut u8;
    let local_index = |r: usize| hw.ranks_on(hw.host_of(r)).iter().position(|&x| x == r).unwrap_or(0);
    let (arrive, release, from) = (|r: usize| r, world, |r: usize| world + 1 + r);
    let locals = hw.local_ranks();
    let (leader, my_host, ls) = (locals[0], hw.host_of(me), local_index(me));

    // As in the all-reduce: only the sends of call e-2 must have landed.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    for d in 0..world {
        // SAFETY: this rank's stage p holds world blocks of bs >= b bytes; nobody reads it
        // before this rank's ARRIVE and FROM words, nobody still reads it from call e-2, and its
        // sends of call e-2 have landed; the input is contiguous, world blocks of b bytes.
        unsafe { std::ptr::copy_nonoverlapping(input.data_ptr().add(d * b).cast_const(), at(me, stage(d)), b) };
    }
    for host in (0..hosts).filter(|&x| x != my_host) {
        let theirs = hw.ranks_on(host);
        let l = theirs[0];
        // Runs of consecutive ranks of that host: their blocks are consecutive in the stage and
        // in the inbox row of this rank.
        let mut ld = 0;
        while ld < theirs.len() {
            let mut end = ld + 1;
            while end < theirs.len() && theirs[end] == theirs[end - 1] + 1 {
                end += 1;
            }
            let len = (end - ld - 1) * bs + b;
            for work in send_before_signal(&hw, l, stage(theirs[ld]), inbox(my_host, ls, ld), len, timeout)? {
                w.sent.push((l, e, work));
            }
            ld = end;
        }
        w.sent.push((l, e, w.words.start_remote(l, from(me), e, timeout)?));
    }
    if me != leader {
        w.words.publish(leader, arrive(me), e);
        w.words.wait_for(release, e, leader, &p, timeout)?;
    } else {
        for &r in &locals[1..] {
            w.words.wait_for(arrive(r), e, r, &p, timeout)?;
        }
        for r in (0..world).filter(|&r| !hw.is_local(r)) {
            w.words.wait_for(from(r), e, r, &p, timeout)?;
        }
        for &r in &locals[1..] {
            w.words.publish(r, release, e);
        }
    }
    for s in 0..world {
        let src = if hw.is_local(s) { at(s, stage(me)) } else { at(leader, inbox(hw.host_of(s), local_index(s), ls)) };
        // SAFETY: a local rank's stage p is complete (it arrived before the leader released this
        // host); a remote rank's blocks landed in the leader's inbox before its FROM word rose,
        // which the leader saw before releasing; out holds world blocks of b bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.cast_const(), out.data_ptr().add(s * b), b) };
    }
    w.epoch = e;
    Ok(())
}

/// [`all_reduce`] for tiny messages: each host's leader gathers its host's inputs and sends
/// them to every other leader in one message (the sends of a host's ranks are aggregated, so a
/// leader receives one message per other host rather than one per remote rank).
fn all_reduce_gathered(tensor: &Tensor, op: ReduceOp, group: &Group, timeout: Duration) -> Result<()> {
    let n = tensor.nbytes();
    let stride = n.next_multiple_of(16);
    let (me, world) = (group.rank(), group.world_size());
    let ws = workspace(group, "all_reduce_gathered", stride, |cap| 2 * world * cap + 2 * cap, timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
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
    // The sends of call e-2 read this call's buffers: they must have landed; those of call e-1
    // may still be in flight.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
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
            for work in send_before_signal(&hw, l, inbox(a), inbox(a), len, timeout)? {
                w.sent.push((l, e, work));
            }
        }
        w.sent.push((l, e, w.words.start_remote(l, from(leader), e, timeout)?));
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

/// [`all_to_all`] for tiny messages: each host's leader packs, for every other host, the blocks
/// its ranks send to that host's ranks into one region and writes it to that host's leader
/// (one message per pair of hosts); each rank copies its blocks from the stages of the ranks on
/// its host and from its leader's inbox.
fn all_to_all_gathered(input: &Tensor, out: &Tensor, group: &Group, h: &SymmHandle, timeout: Duration) -> Result<()> {
    let (me, world) = (group.rank(), group.world_size());
    let b = input.nbytes() / world;
    let bs = b.next_multiple_of(16);
    let (hosts, lmax) = (h.hosts(), h.max_ranks_per_host());
    // Per parity: the stage (world blocks), the outbox and the inbox (hosts × lmax² blocks each).
    let per = move |cap: usize| world * cap + 2 * hosts * lmax * lmax * cap;
    let ws = workspace(group, "all_to_all_gathered", bs, move |cap| 2 * per(cap), timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let hw = w.words.h.clone();
    let p = hw.patience(timeout);
    let base = hw.offset() + words_bytes(world) + (e % 2) as usize * per(w.cap);
    let stage = |d: usize| base + d * bs;
    let boxes = base + world * w.cap;
    let outbox = |host: usize, ls: usize, ld: usize| boxes + ((host * lmax + ls) * lmax + ld) * bs;
    let inbox = |host: usize, ls: usize, ld: usize| outbox(host, ls, ld) + hosts * lmax * lmax * w.cap;
    let at = |rank: usize, off: usize| (hw.read_ptr(rank) + off) as *mut u8;
    let local_index = |r: usize| hw.ranks_on(hw.host_of(r)).iter().position(|&x| x == r).unwrap_or(0);
    let (arrive, release, from) = (|r: usize| r, world, |l: usize| world + 1 + l);
    let locals = hw.local_ranks();
    let (leader, my_host) = (locals[0], hw.host_of(me));

    // SAFETY (for the copies into this rank's stage p): it holds world blocks of bs >= b bytes,
    // nobody reads it before this rank's ARRIVE, and nobody still reads it from call e-2.
    for d in 0..world {
        // SAFETY: see above; the input is contiguous, world blocks of b bytes.
        unsafe { std::ptr::copy_nonoverlapping(input.data_ptr().add(d * b).cast_const(), at(me, stage(d)), b) };
    }
    if me != leader {
        w.words.publish(leader, arrive(me), e);
        w.words.wait_for(release, e, leader, &p, timeout)?;
    } else {
        // As in the all-reduce: only the sends of call e-2 must have landed.
        settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
        for &r in &locals[1..] {
            w.words.wait_for(arrive(r), e, r, &p, timeout)?;
        }
        for host in (0..hosts).filter(|&x| x != my_host) {
            let theirs = hw.ranks_on(host);
            for (ls, &s) in locals.iter().enumerate() {
                for (ld, &d) in theirs.iter().enumerate() {
                    // SAFETY: rank s's stage p is complete (its ARRIVE seen with Acquire) and
                    // not rewritten before call e+2; this leader's outbox p is rewritten only
                    // after the sends of call e settled (above, at call e+2).
                    unsafe {
                        std::ptr::copy_nonoverlapping(at(s, stage(d)).cast_const(), at(me, outbox(host, ls, ld)), b)
                    };
                }
            }
            let l = theirs[0];
            let (src, dst, len) = (outbox(host, 0, 0), inbox(my_host, 0, 0), lmax * lmax * bs);
            for work in send_before_signal(&hw, l, src, dst, len, timeout)? {
                w.sent.push((l, e, work));
            }
            w.sent.push((l, e, w.words.start_remote(l, from(leader), e, timeout)?));
        }
        for host in (0..hosts).filter(|&x| x != my_host) {
            let l = hw.ranks_on(host)[0];
            w.words.wait_for(from(l), e, l, &p, timeout)?;
        }
        for &r in &locals[1..] {
            w.words.publish(r, release, e);
        }
    }
    let ld = local_index(me);
    for s in 0..world {
        let src = if hw.host_of(s) == my_host {
            at(s, stage(me))
        } else {
            at(leader, inbox(hw.host_of(s), local_index(s), ld))
        };
        // SAFETY: a local rank's stage p is complete (it arrived before the leader released this
        // host); the leader's inbox region from s's host landed before that host's FROM word
        // rose, which the leader saw before releasing; out holds world blocks of b bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.cast_const(), out.data_ptr().add(s * b), b) };
    }
    w.epoch = e;
    Ok(())
}
