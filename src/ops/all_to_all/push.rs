//! The all-to-all-v family across hosts by host push (the protocol of `ops/hostpush.rs`).
//!
//! ```text
//!   per group, a symmetric workspace: [ epoch words | signatures | two parities of
//!     [ stage | inbox slot per source rank ] ], every slot laid out alike:
//!     [ header: major_align, row bytes | the source's metadata | its input's rows ]
//!   call e (parity p = e % 2):
//!     every rank   stages its header, metadata and the rows its host's other ranks take from
//!                  it; writes to each other host's leader, into its own slot of inbox p, the
//!                  header, the metadata and the rows for that host's ranks (at the same
//!                  places as in the input: small ones staged first, large ones straight from
//!                  the input), then its signature and FROM[rank] = e; tells its leader (ARRIVE)
//!     each leader  waits for its host (ARRIVE) and every remote rank (FROM), judges the
//!                  signatures, releases its host (RELEASE)
//!     every rank   plans from every source's metadata (this host's in their stages, the
//!                  others' in its leader's inbox) and copies its rows from the same places
//!                  (its own from its input); waits for its writes from the input, and returns
//! ```
//!
//! What a rank sends a host is exactly what that host's ranks take from it: both are
//! `source_chunks` of its metadata. A source whose metadata is invalid sends no rows; every
//! rank's plan then finds it and reports the same error. Parities alternate with the same
//! argument as host-push all-to-all, so nothing is rewritten while still read and no barrier
//! ends the call.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::vdev::{Kind, Plan, plan, row_bytes, rows_of, source_chunks};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::ops::common::bad;
use crate::ops::hostpush::*;
use crate::symm::SymmHandle;
use crate::symm::hostsync::{Words, settle};
use crate::tensor::Tensor;

/// Bytes of a slot's header, five i64: major_align, the row size, and `out`'s rows, byte
/// offset in its allocation and allocation's identity in the group (what a writer into it
/// needs; 0 when `out` is not written to).
const HEADER: usize = 40;

/// The largest workspace this path makes (both parities, every slot); above it, the family
/// pulls.
const WORKSPACE_MAX: usize = 64 << 20;

/// Bytes before the rows in a slot, for `meta_len` metadata values.
fn rows_at(meta_len: usize) -> usize {
    (HEADER + 8 * meta_len).next_multiple_of(64)
}

/// Bytes of a slot.
fn slot(input_bytes: usize, meta_len: usize) -> usize {
    rows_at(meta_len) + input_bytes.next_multiple_of(64)
}

/// Bytes of the words that tell a rank another's rows are in its `out` (one per rank).
fn done_bytes(world: usize) -> usize {
    (4 * world).next_multiple_of(128)
}

/// Bytes after the words and signatures of a workspace whose slots hold `cap` bytes.
fn workspace_bytes(cap: usize, world: usize) -> usize {
    done_bytes(world) + 2 * (world + 1) * cap
}

/// Whether a workspace for this call stays within [`WORKSPACE_MAX`].
pub(crate) fn fits(input_bytes: usize, meta_len: usize, world: usize) -> bool {
    // As `workspace` rounds it: a power of two, at least 4 KiB.
    let cap = slot(input_bytes, meta_len).max(4096).next_power_of_two();
    cap.checked_mul(2 * (world + 1)).and_then(|b| b.checked_add(done_bytes(world))).is_some_and(|b| b <= WORKSPACE_MAX)
}

/// A rank's signature for the call: the input's elements, and its dtype, operator, way
/// (`write`: rows written into the symmetric `out`s) and metadata length. Equal signatures
/// mean equal workspace layouts and the same way.
fn signature(kind: Kind, input: &Tensor, meta_len: usize, write: bool) -> [u64; 2] {
    let code = u64::from(input.dtype().code()) | kind.code() << 8 | u64::from(write) << 12 | (meta_len as u64) << 16;
    [input.numel() as u64, code]
}

/// Bit of a signature's second word that marks a pulled call's entry ([`meet`]), whose words
/// also carry 39 bits of the digest of its arguments (bits 40.. of the first, 48..63 of the
/// second); a host-push call leaves those 0 (its element count stays below 2^40, its split
/// count below 2^32).
const PULLED: u64 = 1 << 63;

/// The bits of a signature's words that are not the pulled entry's digest.
const COUNTS: [u64; 2] = [(1 << 40) - 1, (1 << 48) - 1];

/// The entry of a call of the family across hosts that pulls, in place of the checked barrier
/// (`crate::ops::hostpush::meet`): an exchange of signatures on the family's workspace, so that
/// ranks that took host push (a smaller input, or a symmetric `out`) meet it and every rank
/// gets the same disagreement at once. `stamp`: every argument the ranks must agree on.
pub(crate) fn meet(
    op: &str,
    kind: Kind,
    input: &Tensor,
    meta_len: usize,
    stamp: &crate::ops::check::Stamp,
    group: &Group,
    timeout: Duration,
) -> Result<()> {
    let [n, code] = signature(kind, input, meta_len, false);
    let d = stamp.digest();
    let sig = [n | (d & 0xff_ffff) << 40, code | PULLED | (d >> 24 & 0x7fff) << 48];
    let world = group.world_size();
    let bytes = move |cap| workspace_bytes(cap, world);
    crate::ops::hostpush::meet(group, "all_to_all_vdev", bytes, sig, |f, r, t| disagree(op, f, r, t), timeout)
}

#[cold]
fn disagree(op: &str, first: [u64; 2], r: usize, theirs: [u64; 2]) -> Error {
    let show = |w: [u64; 2]| {
        let dtype = crate::tensor::DType::from_code(w[1] as u8).map_or_else(|| "?".into(), |d| d.to_string());
        let op = ["?", "all_to_all_vdev", "all_to_all_vdev_2d", "all_to_all_vdev_2d_offset"]
            .get((w[1] >> 8 & 0xf) as usize)
            .copied()
            .unwrap_or("?");
        let how = match (w[1] & PULLED != 0, w[1] >> 12 & 1 == 1) {
            (true, _) => " (pulled)",
            (false, true) => " (rows written into a symmetric out)",
            (false, false) => "",
        };
        format!(
            "{op} an input of {} {dtype} elements and {} split values{how}",
            w[0] & COUNTS[0],
            w[1] >> 16 & 0xffff_ffff
        )
    };
    let counts = |w: [u64; 2]| [w[0] & COUNTS[0], w[1] & COUNTS[1]];
    let what = if counts(first) == counts(theirs) {
        format!("rank 0 and rank {r} passed {} with different arguments (shape, offset or algorithm)", show(first))
    } else {
        format!("rank 0 passed {} but rank {r} passed {}", show(first), show(theirs))
    };
    bad(
        op,
        format!(
            "the ranks' arguments disagree: {what}; every rank of the group must pass inputs of the same shape and \
             dtype and splits of the same length"
        ),
    )
}

/// One call of the family across hosts: `meta` is this rank's metadata (its splits, and for
/// the combine its offsets), `align` the 2-D dispatch's major_align (1 otherwise), `h` the
/// input's handle. With `out`'s handle (`oh`: `out` is symmetric), the rows do not travel with
/// the splits: once every rank has every rank's splits, each writes its rows straight into the
/// `out` of each other rank, then tells it (no staging and no workspace for rows, so any input
/// size); without, they travel with the splits to the leaders' inboxes (one trip, bounded).
#[allow(clippy::too_many_arguments)]
pub(crate) fn all_to_all_v(
    op: &str,
    kind: Kind,
    meta: &[i64],
    align: i64,
    (input, h): (&Tensor, &SymmHandle),
    (out, oh): (&Tensor, Option<&SymmHandle>),
    out_splits_offsets: &Tensor,
    group: &Group,
    timeout: Duration,
) -> Result<()> {
    let (me, world) = (group.rank(), group.world_size());
    let (row, m, input_rows) = (row_bytes(input), meta.len(), rows_of(input));
    let rows_at = rows_at(m);
    let carried = if oh.is_some() { 0 } else { input.nbytes() };
    let sig = signature(kind, input, m, oh.is_some());
    let bytes = move |cap| workspace_bytes(cap, world);
    let ws =
        workspace(group, "all_to_all_vdev", slot(carried, m), bytes, sig, |f, r, t| disagree(op, f, r, t), timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let (hw, cap) = (w.words.h.clone(), w.cap);
    let parity = (e % 2) as usize;
    let sigs = Sigs::new(hw.offset(), world, parity);
    let done_at = words_bytes(world) + sigs_bytes(world);
    let base = hw.offset() + done_at + done_bytes(world) + parity * (world + 1) * cap;
    let (stage, inbox) = (base, |s: usize| base + (1 + s) * cap);
    let at = |rank: usize, off: usize| (hw.read_ptr(rank) + off) as *mut u8;
    let locals = hw.local_ranks();
    let (leader, my_host) = (locals[0], hw.host_of(me));

    // What goes where, from this rank's own metadata (`None` where it is invalid: nothing
    // goes there, and every receiver's plan reports it).
    let chunks: Vec<Option<Vec<(i64, i64)>>> =
        (0..world).map(|d| source_chunks(kind, meta, world, input_rows, d)).collect();
    // Rows that travel with the splits (none when they are written into the outs after).
    let carries = |d: usize| if oh.is_some() { None } else { chunks[d].as_ref() };
    let span_of = |dsts: &[usize]| {
        let all = dsts.iter().filter_map(|&d| carries(d)).flatten().filter(|c| c.1 > 0);
        all.fold(None, |acc: Option<(i64, i64)>, &(a, n)| {
            let (lo, hi) = acc.unwrap_or((a, a + n));
            Some((lo.min(a), hi.max(a + n)))
        })
    };
    // Rows this host's other ranks take from this rank are staged, and so are the rows for
    // another host when they are few (they leave in one message with the metadata). More leave
    // straight from the input, and are waited for before returning: the caller may rewrite
    // its input then. This rank's own rows are copied from its input.
    let bytes = |(a, b): (i64, i64)| (a as usize * row, b as usize * row);
    let hosts: Vec<(usize, Option<(usize, usize)>)> =
        (0..hw.hosts()).filter(|&x| x != my_host).map(|x| (x, span_of(hw.ranks_on(x)).map(bytes))).collect();
    let direct = |span: Option<(usize, usize)>| span.filter(|(a, b)| b - a >= DIRECT_MIN);
    let mut staged: Vec<(usize, usize)> = locals
        .iter()
        .filter(|&&d| d != me)
        .filter_map(|&d| carries(d))
        .flatten()
        .map(|&(a, n)| bytes((a, a + n)))
        .collect();
    staged.extend(hosts.iter().filter(|h| direct(h.1).is_none()).filter_map(|h| h.1));

    // As in host-push all-to-all: only the sends of call e-2 must have landed.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    let (out_at, out_id) = oh.map_or((0, 0), |oh| (oh.offset() as i64, oh.allocation_id() as i64));
    let header = [align, row as i64, rows_of(out), out_at, out_id];
    // SAFETY: this rank's stage p holds a slot of at least rows_at + the input's bytes (the
    // workspace was sized for this call's slot); nobody reads it before this rank's ARRIVE and
    // FROM words, nobody still reads it from call e-2, and its sends of call e-2 have landed.
    // The staged ranges are within the input (the chunks were checked against its rows).
    unsafe {
        let s = at(me, stage);
        std::ptr::copy_nonoverlapping(header.as_ptr().cast::<u8>(), s, HEADER);
        std::ptr::copy_nonoverlapping(meta.as_ptr().cast::<u8>(), s.add(HEADER), 8 * m);
        for &(a, b) in &staged {
            std::ptr::copy_nonoverlapping(input.data_ptr().add(a).cast_const(), s.add(rows_at + a), b - a);
        }
    }
    for (i, v) in sig.into_iter().enumerate() {
        // Relaxed: published with the stage, by ARRIVE here and by FROM on other hosts.
        word(&hw, me, sigs.slot(me) + 8 * i).store(v, Ordering::Relaxed);
    }
    // Writes from the input, to wait for before returning.
    let mut from_input = Named::new();
    let exchanged = (|| -> Result<()> {
        for &(host, span) in &hosts {
            let l = hw.ranks_on(host)[0];
            // The header and metadata, the rows for that host's ranks (one span, where they
            // are in the input; joined to the metadata when staged and the gap is small), the
            // signature and the FROM word leave together.
            let mut pieces = vec![(0, HEADER + 8 * m)];
            if let Some((a, b)) = span.filter(|_| direct(span).is_none()) {
                if rows_at + a <= 4096 {
                    pieces[0].1 = rows_at + b;
                } else {
                    pieces.push((rows_at + a, rows_at + b));
                }
            }
            hw.batch(l, || -> Result<()> {
                for (a, b) in pieces {
                    for work in send_before_signal(&hw, l, stage + a, inbox(me) + a, b - a, timeout)? {
                        w.sent.push((l, e, work));
                    }
                }
                if let Some((a, b)) = direct(span) {
                    let (src, dst) = (h.offset() + a, inbox(me) + rows_at + a);
                    let push = |at: usize, n: usize| hw.start_push_from(h, l, src + at, n, dst + at, timeout);
                    send_from_tensor(&hw, l, b - a, push, &mut from_input)?;
                }
                send_own_sig(w, l, e, &sigs, timeout)
            })?;
        }
        Ok(())
    })();
    let outcome = exchanged.and_then(|()| {
        let remote = (0..world).filter(|&r| !hw.is_local(r));
        let verdict = exchange_and_judge(w, e, &sigs, remote, |_| Ok(()), timeout)?;
        if verdict != 0 {
            let r = (verdict - 1) as usize;
            let of = |r: usize| read_sig(&hw, if hw.is_local(r) { r } else { leader }, sigs.slot(r));
            return Err(disagree(op, of(0), r, of(r)));
        }
        // Every source's slot: this host's ranks' stages, the others' slots in the leader's inbox.
        // Equal signatures: every slot has this rank's layout.
        let slot_of = |s: usize| if hw.is_local(s) { at(s, stage) } else { at(leader, inbox(s)) }.cast_const();
        let values = |s: usize, first: usize, count: usize| -> Vec<i64> {
            // SAFETY: a local rank's stage p is complete (it arrived before the leader released
            // this host), a remote rank's slot landed before its FROM word rose, which the leader
            // saw before releasing; neither is rewritten before call e+2, which needs this rank's
            // ARRIVE of call e+1. Both hold HEADER + 8·m bytes of values (equal signatures).
            (0..count).map(|i| unsafe { slot_of(s).add(first + 8 * i).cast::<i64>().read_unaligned() }).collect()
        };
        // Rows are written into the outs only if every rank passed the same allocation.
        let same_out = |r: usize| values(r, 32, 1) == values(0, 32, 1);
        if let Some(r) = (1..world).find(|&r| !same_out(r)) {
            return Err(bad(
                op,
                format!(
                    "the ranks' arguments disagree: rank 0 and rank {r} passed outs in different symmetric \
                     allocations; every rank must pass the same (its rows are written into the others')"
                ),
            ));
        }
        let first = values(0, 0, 2);
        if let Some(r) = (1..world).find(|&r| values(r, 0, 2) != first) {
            let theirs = values(r, 0, 2);
            return Err(bad(
                op,
                format!(
                    "the ranks' arguments disagree: rank 0 passed major_align {} and rows of {} bytes, but rank {r} passed \
                     major_align {} and rows of {} bytes",
                    first[0], first[1], theirs[0], theirs[1]
                ),
            ));
        }
        // Every source's metadata, read once.
        let metas: Vec<Vec<i64>> = (0..world).map(|s| values(s, HEADER, m)).collect();
        if let Some(oh) = oh {
            let outs = |d: usize| {
                let v = values(d, 16, 2);
                (v[0], v[1])
            };
            let done = Words::new(hw.clone(), done_at);
            let ctx = Write { op, kind, align, row, input: (input, h), oh, done: &done, epoch: e, timeout };
            return ctx.run(w, &metas, &outs, &mut from_input, out, out_splits_offsets);
        }
        let Plan { copies, splits_offsets } = plan(op, kind, &metas, (me, world), align, input_rows, rows_of(out))?;
        for (s, first, to, rows) in copies.into_iter().filter(|c| c.3 > 0) {
            // This rank's own rows come from its input, the others' from where their sources
            // staged or sent them.
            let rows_of_source = if s == me { input.data_ptr().cast_const() } else { slot_of(s).wrapping_add(rows_at) };
            // SAFETY: the plan checked [first, first+rows) inside the source's input and
            // [to, to+rows) inside out; the source staged (or sent this host) exactly those rows,
            // its `source_chunks` for this rank; the slots stay as argued above; out is
            // contiguous and shares no byte with the input (checked) or the workspace.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    rows_of_source.add(first as usize * row),
                    out.data_ptr().add(to as usize * row),
                    rows as usize * row,
                )
            };
        }
        out_splits_offsets.copy_from_slice(&splits_offsets)
    });
    // Then the input is the caller's again.
    let sent = landed(&hw, &mut from_input, timeout);
    outcome.and(sent)
}

/// The second trip of a call whose rows are written into the symmetric `out`s.
struct Write<'a> {
    op: &'a str,
    kind: Kind,
    align: i64,
    /// Bytes per row.
    row: usize,
    input: (&'a Tensor, &'a SymmHandle),
    /// `out`'s handle.
    oh: &'a SymmHandle,
    /// One word per source rank: its rows are in this rank's `out`.
    done: &'a Words,
    epoch: u32,
    timeout: Duration,
}

impl Write<'_> {
    /// Every rank plans every rank's call from the splits all now have, so each knows where its
    /// rows go in every `out`; it writes them (on this host into the mapped `out`s, on other
    /// hosts from its input, then the DONE word on the same link, in order), copies its own,
    /// and waits for every rank's DONE. `outs(d)` is rank d's `out` rows and byte offset, from
    /// its header. A destination whose plan fails gets no rows, only DONE, and reports it.
    fn run(
        &self,
        w: &mut Workspace,
        metas: &[Vec<i64>],
        outs: &dyn Fn(usize) -> (i64, i64),
        from_input: &mut Named,
        out: &Tensor,
        out_splits_offsets: &Tensor,
    ) -> Result<()> {
        let (input, h, oh) = (self.input.0, self.input.1, self.oh);
        let (me, world, row, e, timeout) = (h.rank(), h.world_size(), self.row, self.epoch, self.timeout);
        let hw = w.words.h.clone();
        let input_rows = rows_of(input);
        let plan_of =
            |d: usize, out_rows: i64| plan(self.op, self.kind, metas, (d, world), self.align, input_rows, out_rows);
        // Where d's out starts in its buffer, and (first row in this rank's input, first row in
        // d's out, rows) for each chunk this rank sends d.
        let to = |d: usize| -> (usize, Vec<(i64, i64, i64)>) {
            let (rows, at) = outs(d);
            // d's out must lie in its buffer (the header came from d: checked).
            let fits = usize::try_from(rows)
                .ok()
                .zip(usize::try_from(at).ok())
                .and_then(|(r, a)| r.checked_mul(row)?.checked_add(a))
                .is_some_and(|end| end <= oh.buffer_size());
            match plan_of(d, rows) {
                Ok(p) if fits => (
                    at as usize,
                    p.copies.into_iter().filter(|c| c.0 == me && c.3 > 0).map(|c| (c.1, c.2, c.3)).collect(),
                ),
                _ => (0, Vec::new()),
            }
        };
        // A failed send to one rank (no DONE follows it: its rows are not all there) does not
        // keep the others from theirs; it is reported once every rank's DONE is in.
        let mut failed = None;
        for d in (1..world).map(|k| (me + k) % world) {
            let (at, chunks) = to(d);
            if hw.is_local(d) {
                for &(first, into, rows) in &chunks {
                    // SAFETY: the plan checked [first, first+rows) inside this rank's input and
                    // [into, into+rows) inside d's out, which lies in d's mapped buffer (checked
                    // above); d reads its out only after this rank's DONE below, and no other
                    // rank writes these rows (the plan gives each source its own).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            input.data_ptr().add(first as usize * row).cast_const(),
                            (oh.read_ptr(d) + at + into as usize * row) as *mut u8,
                            rows as usize * row,
                        )
                    };
                }
                self.done.publish(d, me, e);
                continue;
            }
            let sent = hw.batch(d, || -> Result<()> {
                for &(first, into, rows) in &chunks {
                    let (src, dst) = (h.offset() + first as usize * row, at + into as usize * row);
                    let push = |k: usize, n: usize| oh.start_push_from(h, d, src + k, n, dst + k, timeout);
                    send_from_tensor(&hw, d, rows as usize * row, push, from_input)?;
                }
                w.sent.push((d, e, self.done.start_remote(d, me, e, timeout)?));
                Ok(())
            });
            if let Err(err) = sent {
                failed.get_or_insert(err);
            }
        }
        let mine = plan_of(me, rows_of(out));
        if let Ok(p) = &mine {
            for &(_, first, into, rows) in p.copies.iter().filter(|c| c.0 == me && c.3 > 0) {
                // SAFETY: the plan checked both ranges, in this rank's input and out, which
                // share no byte.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        input.data_ptr().add(first as usize * row).cast_const(),
                        out.data_ptr().add(into as usize * row),
                        rows as usize * row,
                    )
                };
            }
        }
        let p = hw.patience(timeout);
        let waited = (1..world).map(|k| (me + k) % world).try_for_each(|s| self.done.wait_for(s, e, s, &p, timeout));
        if let Some(err) = failed {
            return Err(err);
        }
        waited?;
        out_splits_offsets.copy_from_slice(&mine?.splits_offsets)
    }
}
