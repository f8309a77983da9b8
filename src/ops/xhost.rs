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
use std::sync::atomic::{AtomicU64, Ordering};
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

/// Bytes, after the words, of what every rank passed to the call of each parity (two words,
/// `check::counts`) and each parity's verdict (a word: 0, or 1 + the first rank that disagrees
/// with rank 0), before the buffers. Each rank sends its two words with its data; a leader has
/// every rank's (its host's in their own workspaces, the others' in its own) and so does every
/// other leader: all reach the same verdict, and hand it to their hosts with RELEASE.
fn sigs_bytes(ws: usize) -> usize {
    (2 * ws * 16 + 16).div_ceil(128) * 128
}

/// Where what rank `r` passed to the call of `parity` is, and that parity's verdict: byte
/// offsets in a workspace whose words start at `words`.
struct Sigs {
    at: usize,
    world: usize,
    parity: usize,
}

impl Sigs {
    fn new(words: usize, world: usize, parity: usize) -> Sigs {
        Sigs { at: words + words_bytes(world), world, parity }
    }

    fn slot(&self, r: usize) -> usize {
        self.at + (self.parity * self.world + r) * 16
    }

    fn verdict(&self) -> usize {
        self.at + 2 * self.world * 16 + self.parity * 8
    }
}

/// The 8-byte word at byte `at` of `rank`'s workspace (mapped on this host, or for this rank,
/// its own).
fn word(h: &SymmHandle, rank: usize, at: usize) -> &AtomicU64 {
    assert!(at + 8 <= h.offset() + h.buffer_size() && at.is_multiple_of(8), "workspace word {at} out of place");
    // SAFETY: `rank` is this rank or one on its host (callers read leaders and local ranks
    // only), so its workspace is mapped while `h` lives; the word lies inside it and is
    // 8-aligned (asserted; buffers are page-aligned); every process touches these words only
    // atomically (remote writes land before the FROM word that publishes them).
    unsafe { &*((h.read_ptr(rank) + at) as *const AtomicU64) }
}

fn read_sig(h: &SymmHandle, rank: usize, at: usize) -> [u64; 2] {
    // Relaxed: ordered by the Acquire loads of the epoch words that published them.
    [word(h, rank, at).load(Ordering::Relaxed), word(h, rank, at + 8).load(Ordering::Relaxed)]
}

/// Every rank's signature for this call, as the host's leader holds them: a local rank's in its
/// own workspace, a remote one's in the leader's.
fn verdict_of(h: &SymmHandle, leader: usize, sigs: &Sigs) -> u64 {
    let of = |r: usize| read_sig(h, if h.is_local(r) { r } else { leader }, sigs.slot(r));
    let first = of(0);
    (1..sigs.world).find(|&r| of(r) != first).map_or(0, |r| r as u64 + 1)
}

#[cold]
fn verdict_error(op: &str, h: &SymmHandle, leader: usize, sigs: &Sigs, verdict: u64) -> crate::error::Error {
    let r = (verdict - 1) as usize;
    let of = |r: usize| read_sig(h, if h.is_local(r) { r } else { leader }, sigs.slot(r));
    super::check::counts_disagree(op, of(0), r, of(r))
}

/// A group's workspaces per operator, each locked for the length of a call; the map itself only
/// for a lookup. Kept in the group, so they go with it.
#[derive(Default)]
struct Workspaces(Mutex<HashMap<&'static str, Arc<Mutex<Workspace>>>>);

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
    let state = group.state::<Workspaces>();
    let mut all = lock(&state.0);
    if let Some(w) = all.get(kind)
        && lock(w).cap >= cap
    {
        return Ok(w.clone());
    }
    let cap = cap.max(4096).next_power_of_two();
    let world = group.world_size();
    let t = symm::empty(&[words_bytes(world) + sigs_bytes(world) + bytes(cap)], DType::U8, Device::Cpu)?;
    let handle = symm::rendezvous(&t, group)?;
    handle.barrier(0, timeout)?;
    let words = Words::new(handle, 0);
    let w = Arc::new(Mutex::new(Workspace { _tensor: t, words, cap, epoch: 0, sent: Vec::new() }));
    all.insert(kind, w.clone());
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
    // Writes the link's backend keeps in order with the atomic that follows need no wait.
    let in_order = h.remote(leader).map_or(0, |r| r.link.in_order_up_to());
    if len > STRIPED || in_order == 0 {
        let w = h.start_push(leader, src, len, dst, timeout)?;
        w.wait(None).map_err(|e| match h.remote(leader) {
            Some(r) => r.link.error("writing to", &e),
            None => e,
        })?;
        return Ok(Vec::new());
    }
    (0..len)
        .step_by(in_order)
        .map(|at| h.start_push(leader, src + at, in_order.min(len - at), dst + at, timeout))
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

/// Up to this many bytes per rank, a host's leader aggregates its host's sends (one message per
/// pair of hosts); above, every rank sends its own (no copies through the leader, every rank's
/// link busy). Both ways use the same workspace: FROM words count the sender's epochs either
/// way, and a leader is a rank.
const GATHERED_MAX: usize = 16 * 1024;

/// Runs of consecutive ranks in `ranks` (sorted), as (index of the first, index past the last).
fn runs(ranks: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, &r) in ranks.iter().enumerate() {
        match out.last_mut() {
            Some((_, end)) if ranks[*end - 1] + 1 == r => *end = i + 1,
            _ => out.push((i, i + 1)),
        }
    }
    out
}

/// In-place all-reduce of a small message on a group that spans hosts (see the module docs).
pub(crate) fn all_reduce(tensor: &Tensor, op: ReduceOp, group: &Group, timeout: Duration) -> Result<()> {
    let n = tensor.nbytes();
    let gathered = n <= GATHERED_MAX;
    let stride = n.next_multiple_of(16);
    let (me, world) = (group.rank(), group.world_size());
    let ws = workspace(group, "all_reduce", stride, |cap| 2 * world * cap + 2 * cap, timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let hw = w.words.h.clone();
    let p = hw.patience(timeout);
    let parity = (e % 2) as usize;
    let sigs = Sigs::new(hw.offset(), world, parity);
    let base = hw.offset() + words_bytes(world) + sigs_bytes(world);
    let inbox = |r: usize| base + parity * world * w.cap + r * stride;
    let result = base + 2 * world * w.cap + parity * w.cap;
    let own = |at: usize| (hw.read_ptr(me) + at) as *mut u8;
    let (arrive, release, from) = (|r: usize| r, world, |r: usize| world + 1 + r);
    let locals = hw.local_ranks();
    let leader = locals[0];
    let other_leaders: Vec<usize> = hw.leaders().filter(|&l| l != leader).collect();

    // The sends of call e-2 read this call's buffers: they must have landed; those of call e-1
    // may still be in flight.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    // SAFETY: slot `me` of inbox p lies in this rank's own workspace (sized for `cap` >= stride
    // bytes per slot); nobody reads it before this rank's ARRIVE and FROM below, nobody still
    // reads it from call e-2, and its sends of call e-2 have landed (above).
    unsafe { std::ptr::copy_nonoverlapping(tensor.data_ptr().cast_const(), own(inbox(me)), n) };
    for (i, v) in super::check::counts(tensor, Some(op)).into_iter().enumerate() {
        // Relaxed: published with the input, by ARRIVE here and by FROM on other hosts.
        word(&hw, me, sigs.slot(me) + 8 * i).store(v, Ordering::Relaxed);
    }
    if !gathered {
        for &l in &other_leaders {
            for work in send_before_signal(&hw, l, inbox(me), inbox(me), n, timeout)? {
                w.sent.push((l, e, work));
            }
            w.sent.push((l, e, hw.start_push(l, sigs.slot(me), 16, sigs.slot(me), timeout)?));
            w.sent.push((l, e, w.words.start_remote(l, from(me), e, timeout)?));
        }
    }
    if me != leader {
        w.words.publish(leader, arrive(me), e);
        w.words.wait_for(release, e, leader, &p, timeout)?;
        w.epoch = e;
        // Relaxed: the leader stored it before RELEASE (Release, seen with Acquire above).
        let verdict = word(&hw, leader, sigs.verdict()).load(Ordering::Relaxed);
        if verdict != 0 {
            return Err(verdict_error("all_reduce", &hw, leader, &sigs, verdict));
        }
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
    if gathered {
        // The host's inputs, as runs of consecutive ranks, to every other leader in one go.
        for &r in &locals[1..] {
            // SAFETY: rank r's slot is final (ARRIVE e seen with Acquire) and r rewrites it only
            // for call e+2, after this leader's RELEASE e+1; this leader's copy of it is sent
            // from and rewritten only after the sends of call e-2 landed (settled above).
            unsafe { std::ptr::copy_nonoverlapping((hw.read_ptr(r) + inbox(r)) as *const u8, own(inbox(r)), n) };
            let sig = read_sig(&hw, r, sigs.slot(r));
            for (i, v) in sig.into_iter().enumerate() {
                word(&hw, me, sigs.slot(r) + 8 * i).store(v, Ordering::Relaxed);
            }
        }
        for &l in &other_leaders {
            for (a, b) in runs(locals) {
                let (first, len) = (locals[a], (b - a - 1) * stride + n);
                for work in send_before_signal(&hw, l, inbox(first), inbox(first), len, timeout)? {
                    w.sent.push((l, e, work));
                }
                let at = sigs.slot(first);
                w.sent.push((l, e, hw.start_push(l, at, (b - a) * 16, at, timeout)?));
            }
            w.sent.push((l, e, w.words.start_remote(l, from(leader), e, timeout)?));
        }
    }
    let senders: Vec<usize> = if gathered { other_leaders } else { (0..world).filter(|&r| !hw.is_local(r)).collect() };
    for r in senders {
        w.words.wait_for(from(r), e, r, &p, timeout)?;
    }
    // Every leader holds every rank's signature and reaches the same verdict; its host learns
    // it with RELEASE.
    let verdict = verdict_of(&hw, me, &sigs);
    word(&hw, me, sigs.verdict()).store(verdict, Ordering::Relaxed);
    if verdict != 0 {
        for &r in &locals[1..] {
            w.words.publish(r, release, e);
        }
        w.epoch = e;
        return Err(verdict_error("all_reduce", &hw, me, &sigs, verdict));
    }
    // A local rank's input is in its own slot, a remote rank's in this leader's.
    let srcs: Vec<*const u8> =
        (0..world).map(|r| (hw.read_ptr(if hw.is_local(r) { r } else { me }) + inbox(r)) as *const u8).collect();
    // SAFETY: every slot read holds its rank's input of call e (local ones published before
    // ARRIVE, remote ones landed before their FROM word, both seen with Acquire) and is not
    // rewritten before call e+2; result p holds `cap` >= n bytes and nobody reads it until
    // RELEASE e.
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
/// that host's ranks (then raises the leader's FROM word); up to [`GATHERED_MAX`] per rank the
/// leader packs its host's blocks for another host into one message instead. Each rank copies
/// its blocks from the stages of the ranks on its host and from its leader's inbox. The
/// buffers alternate as in the all-reduce, with the same argument.
pub(crate) fn all_to_all(input: &Tensor, out: &Tensor, group: &Group, h: &SymmHandle, timeout: Duration) -> Result<()> {
    let (me, world) = (group.rank(), group.world_size());
    let gathered = input.nbytes() <= GATHERED_MAX;
    let b = input.nbytes() / world;
    let bs = b.next_multiple_of(16);
    let (hosts, lmax) = (h.hosts(), h.max_ranks_per_host());
    // Per parity: the stage (world blocks), the inbox and the leader's outbox, both laid out
    // [host][sender][receiver] (the inbox by source host, the outbox by destination host).
    let boxes = move |cap: usize| hosts * lmax * lmax * cap;
    let per = move |cap: usize| world * cap + 2 * boxes(cap);
    let ws = workspace(group, "all_to_all", bs, move |cap| 2 * per(cap), timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let hw = w.words.h.clone();
    let p = hw.patience(timeout);
    let sigs = Sigs::new(hw.offset(), world, (e % 2) as usize);
    let base = hw.offset() + words_bytes(world) + sigs_bytes(world) + (e % 2) as usize * per(w.cap);
    let stage = |d: usize| base + d * bs;
    let inbox = |host: usize, ls: usize, ld: usize| base + world * w.cap + ((host * lmax + ls) * lmax + ld) * bs;
    let outbox = |host: usize, ls: usize, ld: usize| inbox(host, ls, ld) + boxes(w.cap);
    let at = |rank: usize, off: usize| (hw.read_ptr(rank) + off) as *mut u8;
    let local_index = |r: usize| hw.ranks_on(hw.host_of(r)).iter().position(|&x| x == r).unwrap_or(0);
    let (arrive, release, from) = (|r: usize| r, world, |r: usize| world + 1 + r);
    let locals = hw.local_ranks();
    let (leader, my_host, ls) = (locals[0], hw.host_of(me), local_index(me));
    let other_hosts: Vec<usize> = (0..hosts).filter(|&x| x != my_host).collect();

    // As in the all-reduce: only the sends of call e-2 must have landed.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    for d in 0..world {
        // SAFETY: this rank's stage p holds world blocks of bs >= b bytes; nobody reads it
        // before this rank's ARRIVE and FROM words, nobody still reads it from call e-2, and its
        // sends of call e-2 have landed; the input is contiguous, world blocks of b bytes.
        unsafe { std::ptr::copy_nonoverlapping(input.data_ptr().add(d * b).cast_const(), at(me, stage(d)), b) };
    }
    for (i, v) in super::check::counts(input, None).into_iter().enumerate() {
        // Relaxed: published with the stage, by ARRIVE here and by FROM on other hosts.
        word(&hw, me, sigs.slot(me) + 8 * i).store(v, Ordering::Relaxed);
    }
    if !gathered {
        for &host in &other_hosts {
            let theirs = hw.ranks_on(host);
            let l = theirs[0];
            // Blocks for a run of consecutive ranks of that host are consecutive both in the
            // stage and in this rank's row of the inbox.
            for (a, end) in runs(theirs) {
                let len = (end - a - 1) * bs + b;
                for work in send_before_signal(&hw, l, stage(theirs[a]), inbox(my_host, ls, a), len, timeout)? {
                    w.sent.push((l, e, work));
                }
            }
            w.sent.push((l, e, hw.start_push(l, sigs.slot(me), 16, sigs.slot(me), timeout)?));
            w.sent.push((l, e, w.words.start_remote(l, from(me), e, timeout)?));
        }
    }
    if me != leader {
        w.words.publish(leader, arrive(me), e);
        w.words.wait_for(release, e, leader, &p, timeout)?;
    } else {
        for &r in &locals[1..] {
            w.words.wait_for(arrive(r), e, r, &p, timeout)?;
        }
        if gathered {
            for &r in &locals[1..] {
                let sig = read_sig(&hw, r, sigs.slot(r));
                for (i, v) in sig.into_iter().enumerate() {
                    word(&hw, me, sigs.slot(r) + 8 * i).store(v, Ordering::Relaxed);
                }
            }
            for &host in &other_hosts {
                let theirs = hw.ranks_on(host);
                for (ls, &s) in locals.iter().enumerate() {
                    for (ld, &d) in theirs.iter().enumerate() {
                        // SAFETY: rank s's stage p is complete (its ARRIVE seen with Acquire)
                        // and not rewritten before call e+2; this leader's outbox p is
                        // rewritten only after the sends of call e-2 landed (settled above).
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
                for (a, end) in runs(locals) {
                    let at = sigs.slot(locals[a]);
                    w.sent.push((l, e, hw.start_push(l, at, (end - a) * 16, at, timeout)?));
                }
                w.sent.push((l, e, w.words.start_remote(l, from(leader), e, timeout)?));
            }
        }
        let senders: Vec<usize> = if gathered {
            other_hosts.iter().map(|&host| hw.ranks_on(host)[0]).collect()
        } else {
            (0..world).filter(|&r| !hw.is_local(r)).collect()
        };
        for r in senders {
            w.words.wait_for(from(r), e, r, &p, timeout)?;
        }
        // As in the all-reduce: the same verdict on every leader, handed on with RELEASE.
        let verdict = verdict_of(&hw, me, &sigs);
        word(&hw, me, sigs.verdict()).store(verdict, Ordering::Relaxed);
        for &r in &locals[1..] {
            w.words.publish(r, release, e);
        }
    }
    w.epoch = e;
    // Relaxed: the leader stored it before RELEASE (or is this rank).
    let verdict = word(&hw, leader, sigs.verdict()).load(Ordering::Relaxed);
    if verdict != 0 {
        return Err(verdict_error("all_to_all", &hw, leader, &sigs, verdict));
    }
    for s in 0..world {
        let src = if hw.is_local(s) { at(s, stage(me)) } else { at(leader, inbox(hw.host_of(s), local_index(s), ls)) };
        // SAFETY: a local rank's stage p is complete (it arrived before the leader released this
        // host); a remote rank's blocks landed in the leader's inbox before their FROM word rose,
        // which the leader saw before releasing; out holds world blocks of b bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.cast_const(), out.data_ptr().add(s * b), b) };
    }
    Ok(())
}
