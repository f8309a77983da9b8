//! All-to-all across hosts by host push (see `ops/hostpush.rs` for the protocol).

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::error::Result;
use crate::group::Group;
use crate::ops::hostpush::*;
use crate::symm::SymmHandle;
use crate::symm::hostsync::settle;
use crate::tensor::Tensor;

/// The bytes of one parity of the all-to-all workspace, for `world` ranks on `hosts` hosts of at
/// most `lmax` ranks and blocks of `cap` bytes: a stage (a block per rank), an inbox and an
/// outbox (a block per pair of ranks of a host and another).
fn parity_bytes(world: usize, hosts: usize, lmax: usize) -> impl Fn(usize) -> usize + Copy {
    move |cap| world * cap + 2 * hosts * lmax * lmax * cap
}

/// The bytes of the all-to-all workspace after its words: two parities.
fn layout(world: usize, hosts: usize, lmax: usize) -> impl Fn(usize) -> usize {
    let per = parity_bytes(world, hosts, lmax);
    move |cap| 2 * per(cap)
}

/// The entry of an all-to-all across hosts above host push's limit (pulled), meeting host
/// push's calls on its workspace ([`crate::ops::hostpush::meet`]).
pub(crate) fn meet(input: &Tensor, group: &Group, h: &SymmHandle, timeout: Duration) -> Result<()> {
    const OP: &str = "all_to_all";
    let stamp = crate::ops::check::Stamp::new(OP, input, h.offset(), &[]);
    let sig = crate::ops::check::counts_stamped(input, None, &stamp);
    let disagree = |f, r, t| crate::ops::check::counts_disagree(OP, f, r, t);
    let bytes = layout(group.world_size(), h.hosts(), h.max_ranks_per_host());
    crate::ops::hostpush::meet(group, OP, bytes, sig, disagree, timeout)
}

/// Equal-split all-to-all on a group that spans hosts (`h`: the input's handle): every rank
/// writes, to each other host's leader, the blocks for that host's ranks (staged in its
/// workspace when small; from [`DIRECT_MIN`] bytes straight from the input, waited for
/// before returning), then raises the leader's FROM word; up to [`GATHERED_MAX`] per rank
/// the leader packs its host's blocks for another host into one message instead (every block
/// staged, those its host's ranks take too). Each rank copies its blocks from its input, its
/// leader's inbox, and its host's other ranks' inputs (their stages when the leader
/// gathers, or blocks under [`SHARED_DIRECT_MIN`]): having read those, it raises its COPIED
/// word, and it returns only once its host's other ranks raised theirs (they read its input no
/// more). One copy of each block that stays on its host, where staging it made two: 4 ranks on
/// 2 played hosts over tcp, `bench/ab_builds.py 8`, 0.86x the time at 512 KiB and 1 MiB per
/// rank. The buffers alternate as in the all-reduce, with the same argument.
pub(crate) fn all_to_all(input: &Tensor, out: &Tensor, group: &Group, h: &SymmHandle, timeout: Duration) -> Result<()> {
    let (me, world) = (group.rank(), group.world_size());
    let gathered = input.nbytes() <= GATHERED_MAX;
    let b = input.nbytes() / world;
    let bs = b.next_multiple_of(16);
    let (hosts, lmax) = (h.hosts(), h.max_ranks_per_host());
    // Per parity: the stage (world blocks), the inbox and the leader's outbox, both laid out
    // [host][sender][receiver] (the inbox by source host, the outbox by destination host).
    let boxes = move |cap: usize| hosts * lmax * lmax * cap;
    let per = parity_bytes(world, hosts, lmax);
    let sig = crate::ops::check::counts(input, None);
    let disagree = |f, r, t| crate::ops::check::counts_disagree("all_to_all", f, r, t);
    let ws = workspace(group, "all_to_all", bs, layout(world, hosts, lmax), sig, disagree, timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let (hw, cap) = (w.words.h.clone(), w.cap);
    let sigs = Sigs::new(hw.offset(), world, (e % 2) as usize);
    let base = hw.offset() + words_bytes(world) + sigs_bytes(world) + (e % 2) as usize * per(cap);
    let stage = |d: usize| base + d * bs;
    let inbox = |host: usize, ls: usize, ld: usize| base + world * cap + ((host * lmax + ls) * lmax + ld) * bs;
    let outbox = |host: usize, ls: usize, ld: usize| inbox(host, ls, ld) + boxes(cap);
    let at = |rank: usize, off: usize| (hw.read_ptr(rank) + off) as *mut u8;
    let local_index = |r: usize| hw.ranks_on(hw.host_of(r)).iter().position(|&x| x == r).unwrap_or(0);
    let locals = hw.local_ranks();
    let (leader, my_host, ls) = (locals[0], hw.host_of(me), local_index(me));
    let other_hosts: Vec<usize> = (0..hosts).filter(|&x| x != my_host).collect();

    // Runs of consecutive ranks of each other host whose blocks are laid out alike in the input
    // and the inbox: above DIRECT_MIN bytes they leave straight from the input (not gathered).
    // Each host's runs (indices into its ranks), and whether each leaves from the input.
    let host_runs: Vec<Vec<(usize, usize, bool)>> = (0..hosts)
        .map(|x| {
            let direct = |(a, end): (usize, usize)| !gathered && b == bs && (end - a) * b >= DIRECT_MIN;
            runs(hw.ranks_on(x)).map(|r| (r.0, r.1, x != my_host && direct(r))).collect()
        })
        .collect();
    // Blocks staged: the ones for another host that leave from the stage, and when the leader
    // gathers, every block (it packs them from the stages). Otherwise this host's other ranks
    // copy their blocks straight from this rank's input (`read_inputs`), and each rank waits,
    // before its input is the caller's again, until they have (`COPIED`). This rank's own
    // block is copied from its input.
    let read_inputs = !gathered && locals.len() > 1 && b >= SHARED_DIRECT_MIN;
    // COPIED: rank r's word r in its own workspace, which no protocol of the workspace uses
    // otherwise (ARRIVE[r] is word r of r's leader's, and a leader does not arrive at itself).
    let copied = |r: usize| r;
    let mut sent_directly = vec![false; world];
    for (x, runs) in host_runs.iter().enumerate() {
        for &(a, end, _) in runs.iter().filter(|r| r.2) {
            for &d in &hw.ranks_on(x)[a..end] {
                sent_directly[d] = true;
            }
        }
    }
    // As in the all-reduce: only the sends of call e-2 must have landed.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    let staged = |d: usize| d != me && !sent_directly[d] && !(read_inputs && hw.is_local(d));
    for d in (0..world).filter(|&d| staged(d)) {
        // SAFETY: this rank's stage p holds world blocks of bs >= b bytes; nobody reads it
        // before this rank's ARRIVE and FROM words, nobody still reads it from call e-2, and its
        // sends of call e-2 have landed; the input is contiguous, world blocks of b bytes.
        unsafe { std::ptr::copy_nonoverlapping(input.data_ptr().add(d * b).cast_const(), at(me, stage(d)), b) };
    }
    for (i, v) in sig.into_iter().enumerate() {
        // Relaxed: published with the stage, by ARRIVE here and by FROM on other hosts.
        word(&hw, me, sigs.slot(me) + 8 * i).store(v, Ordering::Relaxed);
    }
    // Writes from the input, to wait for before returning.
    let mut from_input = Named::new();
    let outcome = (|| -> Result<()> {
        if !gathered {
            for &host in &other_hosts {
                let theirs = hw.ranks_on(host);
                let l = theirs[0];
                // The blocks, the signature and the FROM word leave together.
                hw.batch(l, || -> Result<()> {
                    // Blocks for a run of consecutive ranks of that host are consecutive in the
                    // stage, in the input and in this rank's row of the inbox.
                    for &(a, end, direct) in &host_runs[host] {
                        let dst = inbox(my_host, ls, a);
                        if direct {
                            let src = h.offset() + theirs[a] * b;
                            let push = |at: usize, n: usize| hw.start_push_from(h, l, src + at, n, dst + at, timeout);
                            send_from_tensor(&hw, l, (end - a) * b, push, &mut from_input)?;
                            continue;
                        }
                        let len = (end - a - 1) * bs + b;
                        for work in send_before_signal(&hw, l, stage(theirs[a]), dst, len, timeout)? {
                            w.sent.push((l, e, work));
                        }
                    }
                    send_own_sig(w, l, e, &sigs, timeout)
                })?;
            }
        }
        let senders: Vec<usize> = if gathered {
            other_hosts.iter().map(|&host| hw.ranks_on(host)[0]).collect()
        } else {
            (0..world).filter(|&r| !hw.is_local(r)).collect()
        };
        let gather = |w: &mut Workspace| -> Result<()> {
            if !gathered {
                return Ok(());
            }
            gather_sigs(&hw, &sigs);
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
                // The host's blocks, their signatures and the FROM word leave together.
                hw.batch(l, || -> Result<()> {
                    for work in send_before_signal(&hw, l, src, dst, len, timeout)? {
                        w.sent.push((l, e, work));
                    }
                    send_host_sigs(w, l, e, &sigs, timeout)
                })?;
            }
            Ok(())
        };
        let verdict = exchange_and_judge(w, e, &sigs, senders.into_iter(), gather, timeout)?;
        if verdict != 0 {
            return Err(verdict_error("all_to_all", &hw, leader, &sigs, verdict));
        }
        for s in 0..world {
            let src = if s == me {
                input.data_ptr().wrapping_add(me * b)
            } else if hw.is_local(s) && read_inputs {
                (h.read_ptr(s) + h.offset() + me * b) as *mut u8
            } else if hw.is_local(s) {
                at(s, stage(me))
            } else {
                at(leader, inbox(hw.host_of(s), local_index(s), ls))
            };
            // SAFETY: this rank's own block is in its input (world blocks of b bytes); another
            // local rank's input holds its input of this call (it arrived before the leader
            // released this host) until that rank sees this rank's COPIED word (below), and its
            // stage p is complete (it arrived); a remote rank's blocks landed in the leader's
            // inbox before their FROM word rose, which the leader saw before releasing; out holds
            // world blocks of b bytes and does not overlap the input (checked), as the pulled
            // path reads its host's inputs.
            unsafe { std::ptr::copy_nonoverlapping(src.cast_const(), out.data_ptr().add(s * b), b) };
        }
        if read_inputs {
            // This rank read its host's inputs: it says so, then waits until they read its own.
            w.words.publish(me, copied(me), e);
            let p = hw.patience(timeout);
            for &s in locals.iter().filter(|&&s| s != me) {
                w.words.wait_on(s, copied(s), e, s, &p, timeout)?;
            }
        }
        Ok(())
    })();
    // Then the input is the caller's again.
    let sent = landed(&hw, &mut from_input, timeout);
    outcome.and(sent)
}
