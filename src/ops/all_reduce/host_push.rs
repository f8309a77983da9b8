//! All-reduce across hosts by host push (see `ops/hostpush.rs` for the protocol).

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::error::Result;
use crate::group::Group;
use crate::ops::hostpush::*;
use crate::ops::reduce::{self, ReduceOp};
use crate::symm::SymmHandle;
use crate::symm::hostsync::settle;
use crate::tensor::Tensor;

/// The bytes of the all-reduce workspace of `world` ranks after its words, for messages of
/// `cap` bytes: two parities of an inbox slot per rank, and two of the host's result.
fn layout(world: usize) -> impl Fn(usize) -> usize {
    move |cap| 2 * world * cap + 2 * cap
}

/// The entry of an all-reduce across hosts above host push's limit (the chain, or two-shot
/// named `name` in its stamp), meeting host push's calls on its workspace
/// ([`crate::ops::hostpush::meet`]).
pub(crate) fn meet(tensor: &Tensor, op: ReduceOp, group: &Group, h: &SymmHandle, name: &'static str) -> Result<()> {
    let stamp = crate::ops::check::Stamp::new(name, tensor, h.offset(), &[op.code()]);
    let sig = crate::ops::check::counts_stamped(tensor, Some(op), &stamp);
    let disagree = |f, r, t| crate::ops::check::counts_disagree(name, f, r, t);
    crate::ops::hostpush::meet(
        group,
        "all_reduce",
        layout(group.world_size()),
        sig,
        disagree,
        crate::ops::common::timeout(),
    )
}

/// From this many hosts on, an all-reduce above [`GATHERED_MAX`] is scattered: each rank sends
/// each other host's leader only the slice of its input that host reduces (host k's slice, of
/// about n / H bytes), each leader reduces its host's slice over every rank's input in rank
/// order (the one-host kernel and order, so bitwise the same) and writes it to every other
/// leader, then releases its host once every slice arrived. A leader then receives about
/// 2·n·(H − 1)/H bytes per rank of its host rather than n·(H − 1): host push's reduce-scatter
/// and all-gather.
pub(crate) const SCATTER_FROM: usize = 4;

/// The byte range `(offset, length)` of `tensor` that host `host` of `hosts` reduces when
/// scattered: whole elements, the first hosts taking one more when they do not divide evenly.
fn slice_of(tensor: &Tensor, hosts: usize, host: usize) -> (usize, usize) {
    let (numel, size) = (tensor.numel(), tensor.dtype().size());
    let (per, extra) = (numel / hosts, numel % hosts);
    let start = host * per + host.min(extra);
    let len = per + usize::from(host < extra);
    (start * size, len * size)
}

/// In-place all-reduce of a small message on a group that spans hosts (see the module docs);
/// `h` is the tensor's handle. From [`DIRECT_MIN`] bytes, a rank's input leaves straight from
/// its tensor (those writes are waited for before the tensor is written, and before the call
/// returns), its leader reads it there, and a host of one rank reduces straight into its
/// tensor: the workspace then only receives the other hosts' inputs and holds the host's
/// result.
pub(crate) fn all_reduce(
    tensor: &Tensor,
    op: ReduceOp,
    group: &Group,
    h: &SymmHandle,
    timeout: Duration,
) -> Result<()> {
    let n = tensor.nbytes();
    let gathered = n <= GATHERED_MAX;
    let direct = !gathered && n >= DIRECT_MIN;
    let scattered = !gathered && h.hosts() >= SCATTER_FROM;
    let stride = n.next_multiple_of(16);
    let (me, world) = (group.rank(), group.world_size());
    let sig = crate::ops::check::counts(tensor, Some(op));
    let disagree = |f, r, t| crate::ops::check::counts_disagree("all_reduce", f, r, t);
    let ws = workspace(group, "all_reduce", stride, layout(world), sig, disagree, timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let hw = w.words.h.clone();
    let p = hw.patience(timeout);
    let parity = (e % 2) as usize;
    let sigs = Sigs::new(hw.offset(), world, parity);
    let base = hw.offset() + words_bytes(world) + sigs_bytes(world);
    let cap = w.cap;
    let inbox = |r: usize| base + parity * world * cap + r * stride;
    let result = base + 2 * world * cap + parity * cap;
    let own = |at: usize| (hw.read_ptr(me) + at) as *mut u8;
    let (arrive, release, from) = (|r: usize| r, world, |r: usize| world + 1 + r);
    let locals = hw.local_ranks();
    let leader = locals[0];
    let other_leaders: Vec<usize> = hw.leaders().filter(|&l| l != leader).collect();
    let slice = |host: usize| slice_of(tensor, hw.hosts(), host);
    let second = |r: usize| from2(world, r);

    // The sends of call e-2 read this call's buffers: they must have landed; those of call e-1
    // may still be in flight.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    if !direct {
        // SAFETY: slot `me` of inbox p lies in this rank's own workspace (sized for `cap` >=
        // stride bytes per slot); nobody reads it before this rank's ARRIVE and FROM below,
        // nobody still reads it from call e-2, and its sends of call e-2 have landed (above).
        unsafe { std::ptr::copy_nonoverlapping(tensor.data_ptr().cast_const(), own(inbox(me)), n) };
    }
    for (i, v) in sig.into_iter().enumerate() {
        // Relaxed: published with the input, by ARRIVE here and by FROM on other hosts.
        word(&hw, me, sigs.slot(me) + 8 * i).store(v, Ordering::Relaxed);
    }
    // Writes from the tensor: waited for before it is written, and before returning.
    let mut from_tensor = Named::new();
    let written = |works: &mut Named| landed(&hw, works, timeout);
    let outcome = (|| -> Result<()> {
        if !gathered {
            for &l in &other_leaders {
                // The data, its signature and the FROM word leave together.
                // All of the input, or scattered, the slice that host reduces.
                let (off, len) = if scattered { slice(hw.host_of(l)) } else { (0, n) };
                hw.batch(l, || -> Result<()> {
                    if len == 0 {
                        // Nothing for that host: the signature and FROM word alone.
                    } else if direct {
                        let push = |at: usize, len: usize| {
                            hw.start_push_from(h, l, h.offset() + off + at, len, inbox(me) + off + at, timeout)
                        };
                        send_from_tensor(&hw, l, len, push, &mut from_tensor)?;
                    } else {
                        for work in send_before_signal(&hw, l, inbox(me) + off, inbox(me) + off, len, timeout)? {
                            w.sent.push((l, e, work));
                        }
                    }
                    send_own_sig(w, l, e, &sigs, timeout)
                })?;
            }
        }
        if me != leader {
            if gathered {
                // Its leader may raise its FROM word for it (see land_own_raises).
                land_own_raises(w, timeout)?;
            }
            w.words.publish(leader, arrive(me), e);
            w.words.wait_for(release, e, leader, &p, timeout)?;
            w.epoch = e;
            // Relaxed: the leader stored it before RELEASE (Release, seen with Acquire above).
            let verdict = word(&hw, leader, sigs.verdict()).load(Ordering::Relaxed);
            if verdict != 0 {
                return Err(verdict_error("all_reduce", &hw, leader, &sigs, verdict));
            }
            let res = (hw.read_ptr(leader) + result) as *const u8;
            written(&mut from_tensor)?;
            // SAFETY: the leader's result p is final (RELEASE e seen with Acquire) and is not
            // rewritten before this rank arrives for call e+2; nothing reads the tensor any more
            // (its leader released the host, its writes landed).
            unsafe { std::ptr::copy_nonoverlapping(res, tensor.data_ptr(), n) };
            w.epoch = e;
            return Ok(());
        }
        for &r in &locals[1..] {
            w.words.wait_for(arrive(r), e, r, &p, timeout)?;
        }
        if gathered {
            // The host's inputs, as runs of consecutive ranks, to every other leader in one go.
            send_gathered(w, e, &sigs, inbox, stride, n, None, timeout)?;
        }
        // Ranks of this host on either side of the gathering limit: raise the FROM words of
        // those that left their messages to this leader, which others may wait for.
        let split = host_split(&hw, &sigs);
        if split {
            raise_for_gathered(w, e, &sigs, timeout)?;
        }
        // Gathered by Bruck's rounds, the rounds waited for their senders.
        let by_bruck = if gathered { w.bruck_of(e) } else { None };
        let bruck = by_bruck.is_some();
        let senders =
            (0..world).filter(|&r| if gathered { !bruck && other_leaders.contains(&r) } else { !hw.is_local(r) });
        for r in senders {
            w.words.wait_for(from(r), e, r, &p, timeout)?;
        }
        // Every leader holds every rank's signature and reaches the same verdict; its host learns
        // it with RELEASE.
        // Rounds that a partner left mean the ranks disagree: judged from every signature.
        let mut verdict = if by_bruck == Some(false) { u64::MAX } else { verdict_of(&hw, me, &sigs) };
        if verdict != 0 && bruck {
            verdict = judge_after_bruck(w, e, &sigs, split, timeout)?;
        }
        word(&hw, me, sigs.verdict()).store(verdict, Ordering::Relaxed);
        if verdict != 0 {
            if !split && !bruck {
                raise_for_gathered(w, e, &sigs, timeout)?;
            }
            for &r in &locals[1..] {
                w.words.publish(r, release, e);
            }
            w.epoch = e;
            return Err(verdict_error("all_reduce", &hw, me, &sigs, verdict));
        }
        // A local rank's input is in its tensor (direct) or its own slot, a remote rank's in this
        // leader's slot.
        let input = |r: usize| match (hw.is_local(r), direct) {
            (true, true) => h.read_ptr(r) + h.offset(),
            (true, false) => hw.read_ptr(r) + inbox(r),
            (false, _) => hw.read_ptr(me) + inbox(r),
        };
        if scattered {
            // This host's slice, reduced in rank order, to every other leader; theirs here.
            let (off, len) = slice(hw.host_of(me));
            let srcs: Vec<*const u8> = (0..world).map(|r| (input(r) + off) as *const u8).collect();
            // SAFETY: as below, for the slice [off, off + len) of every input (remote ones
            // were sent that slice, at its offset in their slot) and of result p.
            unsafe {
                reduce::reduce(tensor.dtype(), op, &srcs, &[own(result + off)], len / tensor.dtype().size(), world)?
            };
            for &l in &other_leaders {
                hw.batch(l, || -> Result<()> {
                    for work in send_before_signal(&hw, l, result + off, result + off, len, timeout)? {
                        w.sent.push((l, e, work));
                    }
                    w.sent.push((l, e, w.words.start_remote(l, second(me), e, timeout)?));
                    Ok(())
                })?;
            }
            // Each other leader's slice landed in result p before its word. It writes result p
            // of call e+2 only after every rank of this host raised its FROM word of e+2, so
            // after each copied result p of call e.
            for &l in &other_leaders {
                w.words.wait_for(second(l), e, l, &p, timeout)?;
            }
            for &r in &locals[1..] {
                w.words.publish(r, release, e);
            }
            written(&mut from_tensor)?;
            // SAFETY: result p holds the whole result of call e (above) and n <= cap bytes;
            // the tensor's writes to other hosts have landed.
            unsafe { std::ptr::copy_nonoverlapping(own(result).cast_const(), tensor.data_ptr(), n) };
            w.epoch = e;
            return Ok(());
        }
        let srcs: Vec<*const u8> = (0..world).map(|r| input(r) as *const u8).collect();
        if direct && locals.len() == 1 {
            written(&mut from_tensor)?;
            w.epoch = e;
            // SAFETY: every input read is of call e (this rank's tensor; remote ones landed before
            // their FROM word, seen with Acquire) and not rewritten before call e+2; the tensor
            // holds numel elements, its writes to other hosts have landed, and `reduce` allows a
            // destination that is also a source.
            return unsafe { reduce::reduce(tensor.dtype(), op, &srcs, &[tensor.data_ptr()], tensor.numel(), world) };
        }
        // SAFETY: every input read holds its rank's input of call e (local ones published before
        // ARRIVE, and unchanged until RELEASE; remote ones landed before their FROM word, both seen
        // with Acquire) and is not rewritten before call e+2; result p holds `cap` >= n bytes and
        // nobody reads it until RELEASE e.
        unsafe { reduce::reduce(tensor.dtype(), op, &srcs, &[own(result)], tensor.numel(), world)? };
        for &r in &locals[1..] {
            w.words.publish(r, release, e);
        }
        written(&mut from_tensor)?;
        // SAFETY: as above; the tensor holds n bytes, and its writes to other hosts have landed.
        unsafe { std::ptr::copy_nonoverlapping(own(result).cast_const(), tensor.data_ptr(), n) };
        w.epoch = e;
        Ok(())
    })();
    let sent = written(&mut from_tensor);
    outcome.and(sent)
}
