//! All-gather across hosts by host push (see `ops/hostpush.rs` for the protocol): the
//! all-reduce's exchange without the reduction. Every rank's input travels once to each other
//! host's leader; after the leader's release every rank of a host copies the inputs of its
//! host's ranks from their slots, and the other hosts' from its leader's inbox. The
//! reduce-scatter's host push is the same exchange ([`exchange_inputs`]), each rank reducing
//! its slice of the inputs instead of copying them.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::error::Result;
use crate::group::Group;
use crate::ops::hostpush::*;
use crate::symm::SymmHandle;
use crate::symm::hostsync::settle;
use crate::tensor::Tensor;

/// The kind of the all-gather's workspace.
const KIND: &str = "all_gather";

/// The bytes of the all-gather workspace of `world` ranks after its words, for inputs of `cap`
/// bytes: two parities of a slot per rank.
pub(crate) fn layout(world: usize) -> impl Fn(usize) -> usize {
    move |cap| 2 * world * cap
}

/// The entry of a call across hosts above the limit of [`exchange_inputs`] (pulled) of the
/// operator whose workspace is `kind` (reduction `op`, further arguments `args`): meets host
/// push's calls on that workspace ([`crate::ops::hostpush::meet`]), so a rank whose size is on
/// the other side of the limit disagrees at once.
pub(crate) fn meet(
    input: &Tensor,
    group: &Group,
    h: &SymmHandle,
    kind: &'static str,
    op: Option<crate::ops::reduce::ReduceOp>,
    args: &[u64],
) -> Result<()> {
    let stamp = crate::ops::check::Stamp::new(kind, input, h.offset(), args);
    let sig = crate::ops::check::counts_stamped(input, op, &stamp);
    let disagree = |f, r, t| crate::ops::check::counts_disagree(kind, f, r, t);
    let timeout = crate::ops::common::timeout();
    crate::ops::hostpush::meet(group, kind, layout(group.world_size()), sig, disagree, timeout)
}

/// An operator whose ranks each need their part of every rank's input (the fused matmuls,
/// `reduce_scatter_offset`, `all_to_all_nd`, the tile reductions; `h`: the handle of
/// `parts[0]`; the input is `parts`, one after another, each packed row by row, see
/// [`exchange_inputs`]). On one host (or of no bytes), the checked entry with the operator's
/// arguments (`kind`, the rest `args`), then `pulled`. Across hosts, with host push (`push`:
/// the operator's own selection, such as the reduce-scatter's where pull reads only the parts;
/// `None`, [`super::select`] for the parts' bytes, the limits of operators that need every rank's
/// whole input, not the all-gather's own [`super::select_all_gather`]), the exchange with `finish` given every
/// rank's packed input (of another host's, what `travels` sends this host: [`Travels`]), the
/// arguments and reduction `op` folded into the signature; otherwise its entry meeting host
/// push's calls ([`meet`], on `parts[0]`), then `pulled`.
#[allow(clippy::too_many_arguments, reason = "the operator's call and its two ways")]
pub(crate) fn inputs_to_hosts(
    parts: &[&Tensor],
    group: &Group,
    h: &SymmHandle,
    kind: &'static str,
    op: Option<crate::ops::reduce::ReduceOp>,
    args: &[u64],
    push: Option<bool>,
    travels: Travels<'_>,
    finish: impl FnOnce(&[*const u8]) -> Result<()>,
    pulled: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let Some(&input) = parts.first() else { return Ok(()) };
    let bytes = parts.iter().map(|t| t.nbytes()).fold(0usize, usize::saturating_add);
    if h.all_local() || bytes == 0 {
        crate::ops::common::enter_on(kind, input, group, h, args)?;
        return pulled();
    }
    let push = push
        .unwrap_or_else(|| super::select(bytes, h.max_ranks_per_host(), 2, h.link_backend()) == super::Algo::HostPush);
    // Ranks that took different algorithms (sizes on either side of the limit) or left a call
    // at different points are out of step: refused from then on.
    guarded(group, kind, || {
        if push {
            let stamp = crate::ops::check::Stamp::new(kind, input, h.offset(), args).digest();
            let [n, code] = crate::ops::check::counts_at(input, op, h.offset());
            // The count is of every part (all of the first's element type): what travels.
            let all: usize = parts.iter().map(|t| t.numel()).sum();
            let n = n & !crate::ops::check::COUNT_BITS | all as u64 & crate::ops::check::COUNT_BITS;
            let sig = [n ^ stamp >> 40 << 40, code];
            let timeout = crate::ops::common::timeout();
            return exchange_inputs(parts, group, h, kind, sig, travels, timeout, || {}, finish);
        }
        meet(input, group, h, kind, op, args)?;
        pulled()
    })
}

/// All-gather of a small or medium `input` on a group that spans hosts into `out` (`world`
/// inputs, in rank order): [`exchange_inputs`], this rank's own input copied into `out` while
/// the others travel (2 ranks on 2 played hosts, 1 MiB gathered: 0.88x the time of copying it
/// after), then the others'. A call that fails leaves `out` unspecified, as MPI's do.
pub(crate) fn all_gather(input: &Tensor, out: &Tensor, group: &Group, h: &SymmHandle, timeout: Duration) -> Result<()> {
    let n = input.nbytes();
    let sig = crate::ops::check::counts_at(input, None, h.offset());
    let me = group.rank();
    // SAFETY: the input is contiguous, n bytes, sharing no byte with `out` (checked), which
    // holds world blocks of n bytes.
    let own = || unsafe { std::ptr::copy_nonoverlapping(input.data_ptr().cast_const(), out.data_ptr().add(me * n), n) };
    exchange_inputs(&[input], group, h, KIND, sig, Travels::All, timeout, own, |inputs| {
        for k in 1..inputs.len() {
            let r = (group.rank() + k) % inputs.len();
            // SAFETY: `inputs[r]` holds rank r's n input bytes for the length of this call (see
            // `exchange_inputs`); `out` holds world blocks of n bytes (checked) and shares no
            // byte with the workspace nor with the input.
            unsafe { std::ptr::copy_nonoverlapping(inputs[r], out.data_ptr().add(r * n), n) };
        }
        Ok(())
    })
}

/// What of the ranks' inputs an exchange ([`exchange_inputs`]) sends to other hosts.
#[derive(Clone, Copy)]
pub(crate) enum Travels<'a> {
    /// Every rank's whole input.
    All,
    /// Rank `root`'s input alone (the broadcast).
    Root(usize),
    /// Of every rank's packed input, the bytes `range(ranks of a host)` = (start, length) to
    /// that host: what they read of it. Whole inputs where a leader gathers its host's.
    Range(&'a dyn Fn(&[usize]) -> (usize, usize)),
}

/// The [`Travels::Range`] of inputs cut into one slice per rank, in rank order (`slice` bytes
/// each, rank r's at r·slice), of which each rank reads its own slice of every input (the
/// reduce-scatter's, the n-d all-to-all's and the fused matmul-reduce-scatter's along rows):
/// a host gets the slices of its ranks, from its lowest rank's to its highest's.
pub(crate) fn slices_of(slice: usize) -> impl Fn(&[usize]) -> (usize, usize) {
    move |ranks| {
        let lo = ranks.iter().copied().min().unwrap_or(0);
        let hi = ranks.iter().copied().max().map_or(0, |r| r + 1);
        (lo.saturating_mul(slice), hi.saturating_sub(lo).saturating_mul(slice))
    }
}

/// The host-push exchange of every rank's `input` (`h`: its handle) on a group that spans
/// hosts, on the workspace of `kind` with the ranks' signatures `sig`, running `meanwhile`
/// once this rank's sends are on their way; then `finish` gets, per rank, where its input is,
/// readable until `finish` returns. Every rank copies its input into its slot and, unless its
/// leader gathers (inputs up to [`GATHERED_MAX`]), writes it to the same slot of every other
/// host's leader, then raises that leader's FROM word; a gathering leader packs its host's
/// slots into its own and sends them as runs of consecutive ranks. Once its leader releases
/// the host (every slot of the call landed, every signature agreed), `finish` reads its host's
/// ranks' slots and its leader's slots of the others. The slots alternate as in the all-reduce:
/// a slot of call e is rewritten only in call e+2, which no rank of a host starts before every
/// rank of it finished call e (its leader releases call e+1 only once they all arrived in it,
/// and raises or waits for their FROM words of call e+1 only then). A rank sends a contiguous
/// input of [`DIRECT_MIN`] bytes or more ([`SHARED_DIRECT_MIN`] on a host of several ranks)
/// straight from the input instead, and waits for those writes before `finish`; its slot
/// stays unwritten, and `finish` gets the inputs themselves for this host's ranks, which then
/// raise their COPIED words once `finish` returned and wait for each other's before returning
/// (the inputs are the callers' again after): one copy fewer per rank and call.
///
/// `travels` says what of the inputs goes to other hosts ([`Travels`]): every rank's whole
/// input; the root's alone (the broadcast: every other rank sends its signature and FROM word
/// alone, and `finish` may read only `root`'s input); or, when each rank sends its own message
/// (above [`GATHERED_MAX`]), only the bytes of its input that the ranks of the host it goes to
/// read (the reduce-scatter's slices), written where they lie in the whole input: `finish` may
/// read of another host's rank's input only what the range gives this rank's host.
///
/// The input is `parts` (`h`: the handle of the first), which travel one after another, each
/// packed row by row: a contiguous tensor whole, a 2-D view with contiguous rows (a tile) as its
/// rows back to back; `finish` gets, per rank, where its packed input is. Only a lone
/// contiguous part may leave straight from the tensor.
#[allow(clippy::too_many_arguments, reason = "the operator's call and its two hooks")]
pub(crate) fn exchange_inputs(
    parts: &[&Tensor],
    group: &Group,
    h: &SymmHandle,
    kind: &'static str,
    sig: [u64; 2],
    travels: Travels<'_>,
    timeout: Duration,
    meanwhile: impl FnOnce(),
    finish: impl FnOnce(&[*const u8]) -> Result<()>,
) -> Result<()> {
    let packable = |t: &&Tensor| t.is_contiguous() || (t.shape().len() == 2 && t.strides()[1] == 1);
    let (Some(&input), true) = (parts.first(), parts.iter().all(packable)) else {
        return Err(crate::error::Error::InvalidArgument(format!(
            "{kind}: what travels must be contiguous tensors or 2-D views with contiguous rows"
        )));
    };
    let n = parts
        .iter()
        .try_fold(0usize, |n, t| n.checked_add(t.nbytes()))
        .ok_or_else(|| crate::error::Error::InvalidArgument(format!("{kind}: the inputs' sizes overflow")))?;
    let gathered = n <= GATHERED_MAX;
    let stride = n.next_multiple_of(16);
    let (me, world) = (group.rank(), group.world_size());
    let disagree = |f, r, t| crate::ops::check::counts_disagree(kind, f, r, t);
    let ws = workspace(group, kind, stride, layout(world), sig, disagree, timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let hw = w.words.h.clone();
    let parity = (e % 2) as usize;
    let sigs = Sigs::new(hw.offset(), world, parity);
    let base = hw.offset() + words_bytes(world) + sigs_bytes(world);
    let cap = w.cap;
    let slot = |r: usize| base + parity * world * cap + r * stride;
    let own = |at: usize| (hw.read_ptr(me) + at) as *mut u8;
    let locals = hw.local_ranks();
    let leader = locals[0];
    let other_leaders: Vec<usize> = hw.leaders().filter(|&l| l != leader).collect();
    let min = if locals.len() == 1 { DIRECT_MIN } else { SHARED_DIRECT_MIN };
    let direct = !gathered && n >= min && parts.len() == 1 && input.is_contiguous();
    // Its host's other ranks then read its input itself, and it returns only once they have
    // (their COPIED words, below).
    let read_inputs = direct && locals.len() > 1;
    // Ranks that disagree on it disagree on the signature: a rank never reads another's input
    // in the layout of a slot, nor a slot left unwritten.
    let sig = [sig[0], sig[1] ^ u64::from(direct) << 63];
    let root = match travels {
        Travels::Root(r) => Some(r),
        _ => None,
    };
    let mine_travels = root.is_none_or(|r| r == me);
    // The bytes of this rank's packed input that go to the host of leader `l`: what its ranks
    // read, or all of it (bounded by the input, whatever the range says).
    let part = |l: usize| match travels {
        Travels::Range(range) => {
            let (at, len) = range(hw.ranks_on(hw.host_of(l)));
            let at = at.min(n);
            (at, len.min(n - at))
        }
        _ => (0, n),
    };

    // The sends of call e-2 read this call's slots: they must have landed; those of call e-1
    // may still be in flight.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    if !direct && mine_travels {
        // SAFETY: slot `me` of parity p lies in this rank's own workspace (sized for `cap` >=
        // stride bytes per slot), and the parts hold n bytes in all, each contiguous or a 2-D
        // view with contiguous rows (checked above); nobody reads the slot before this rank's
        // ARRIVE and FROM words below, nobody still reads it from call e-2 (see above), and its
        // sends of call e-2 landed.
        unsafe { pack(parts, own(slot(me))) };
    }
    for (i, v) in sig.into_iter().enumerate() {
        // Relaxed: published with the slot, by ARRIVE here and by FROM on other hosts.
        word(&hw, me, sigs.slot(me) + 8 * i).store(v, Ordering::Relaxed);
    }
    // Writes straight from the input: waited for before returning, even after a failure.
    let mut from_input = Named::new();
    let sent = (|| -> Result<()> {
        if gathered {
            return Ok(());
        }
        for &l in &other_leaders {
            // The input, its signature and the FROM word leave together.
            hw.batch(l, || -> Result<()> {
                let (from, len) = if mine_travels { part(l) } else { (0, 0) };
                if len == 0 {
                    // Nothing of this rank's input travels, or is read there: its signature and
                    // FROM word alone.
                } else if direct {
                    let push = |at: usize, len: usize| {
                        hw.start_push_from(h, l, h.offset() + from + at, len, slot(me) + from + at, timeout)
                    };
                    send_from_tensor(&hw, l, len, push, &mut from_input)?;
                } else {
                    for work in send_before_signal(&hw, l, slot(me) + from, slot(me) + from, len, timeout)? {
                        w.sent.push((l, e, work));
                    }
                }
                send_own_sig(w, l, e, &sigs, timeout)
            })?;
        }
        Ok(())
    })();
    if let Err(e) = sent {
        let _ = landed(&hw, &mut from_input, timeout);
        return Err(e);
    }
    meanwhile();
    // Gathered by Bruck's rounds, the rounds wait for their senders.
    let senders: Vec<usize> = match (gathered, by_bruck(&hw, root)) {
        (true, true) => Vec::new(),
        (true, false) => other_leaders.clone(),
        (false, _) => (0..world).filter(|&r| !hw.is_local(r)).collect(),
    };
    let gather = |w: &mut Workspace| -> Result<()> {
        if gathered { send_gathered(w, e, &sigs, slot, stride, n, root, timeout) } else { Ok(()) }
    };
    let judged = exchange_and_judge(w, e, &sigs, senders.into_iter(), gather, timeout);
    let written = landed(&hw, &mut from_input, timeout);
    let verdict = judged?;
    if verdict != 0 {
        written?;
        return Err(verdict_error(kind, &hw, leader, &sigs, verdict));
    }
    // A local rank's slot of call e is final (published before its ARRIVE, which the leader saw
    // before RELEASE e, seen with Acquire), another host's rank's slot in the leader's inbox
    // landed before the FROM word the leader waited for; neither is rewritten before call e+2,
    // which waits for this rank to finish call e (see above). In direct mode a local rank's
    // input is in its tensor (this rank's own, or another's through its mapping, at the same
    // offset of the same symmetric allocation), which holds its input of call e until that rank
    // returns, after this rank's COPIED word below.
    let inputs: Vec<*const u8> = (0..world)
        .map(|r| match (direct, hw.is_local(r)) {
            (true, true) if r == me => input.data_ptr().cast_const(),
            (true, true) => (h.read_ptr(r) + h.offset()) as *const u8,
            (false, true) => (hw.read_ptr(r) + slot(r)) as *const u8,
            (_, false) => (hw.read_ptr(leader) + slot(r)) as *const u8,
        })
        .collect();
    // A write from this rank's input that failed fails its call, after the host's COPIED
    // words all the same: its host-mates, released, read its input and wait for its word.
    let finished = written.and_then(|()| finish(&inputs));
    if read_inputs {
        // COPIED: word `me` of this rank's own workspace, which no other step of the protocol
        // uses (ARRIVE[r] is word r of r's leader's, and a leader does not arrive at itself).
        // Raised even after this rank's call failed past its release, so that no rank of the
        // host waits for it in vain, and awaited all the same: its input is the caller's again
        // once this returns.
        w.words.publish(me, me, e);
        let p = hw.patience(timeout);
        for &r in locals.iter().filter(|&&r| r != me) {
            w.words.wait_on(r, r, e, r, &p, timeout)?;
        }
    }
    finished
}

/// Writes `parts` one after another at `dst`, each packed row by row.
///
/// # Safety
/// `dst` holds the parts' bytes in all and shares none with them; each part is contiguous or a
/// 2-D view whose rows are contiguous (stride 1 in its last dimension).
unsafe fn pack(parts: &[&Tensor], dst: *mut u8) {
    let mut at = 0;
    for t in parts {
        let n = t.nbytes();
        if t.is_contiguous() {
            // SAFETY: the part's n bytes are contiguous; dst has room for them at `at`.
            unsafe { std::ptr::copy_nonoverlapping(t.data_ptr().cast_const(), dst.add(at), n) };
        } else {
            let es = t.dtype().size();
            let (rows, row) = (t.shape()[0], t.shape()[1] * es);
            for r in 0..rows {
                // SAFETY: row r of the view is `row` contiguous bytes at r · stride elements
                // from its start; dst has room for the part's rows back to back at `at`.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        t.data_ptr().add(r * t.strides()[0] * es).cast_const(),
                        dst.add(at + r * row),
                        row,
                    )
                };
            }
        }
        at += n;
    }
}
