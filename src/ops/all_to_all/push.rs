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
use crate::symm::hostsync::settle;
use crate::tensor::Tensor;

/// Bytes of a slot's header: major_align and the row size, as two i64.
const HEADER: usize = 16;

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

/// Bytes after the words and signatures of a workspace whose slots hold `cap` bytes.
fn workspace_bytes(cap: usize, world: usize) -> usize {
    2 * (world + 1) * cap
}

/// Whether a workspace for this call stays within [`WORKSPACE_MAX`].
pub(crate) fn fits(input_bytes: usize, meta_len: usize, world: usize) -> bool {
    // As `workspace` rounds it: a power of two, at least 4 KiB.
    let cap = slot(input_bytes, meta_len).max(4096).next_power_of_two();
    cap.checked_mul(2 * (world + 1)).is_some_and(|b| b <= WORKSPACE_MAX)
}

/// A rank's signature for the call: the input's elements, and its dtype, operator and
/// metadata length. Equal signatures mean equal workspace layouts.
fn signature(kind: Kind, input: &Tensor, meta_len: usize) -> [u64; 2] {
    [input.numel() as u64, u64::from(input.dtype().code()) | kind.code() << 8 | (meta_len as u64) << 16]
}

#[cold]
fn disagree(op: &str, first: [u64; 2], r: usize, theirs: [u64; 2]) -> Error {
    let show = |w: [u64; 2]| {
        let dtype = crate::tensor::DType::from_code(w[1] as u8).map_or_else(|| "?".into(), |d| d.to_string());
        let op = ["?", "all_to_all_vdev", "all_to_all_vdev_2d", "all_to_all_vdev_2d_offset"]
            .get((w[1] >> 8 & 0xff) as usize)
            .copied()
            .unwrap_or("?");
        format!("{op} an input of {} {dtype} elements and {} split values", w[0], w[1] >> 16)
    };
    bad(
        op,
        format!(
            "the ranks' arguments disagree: rank 0 passed {} but rank {r} passed {}; every rank of the group must \
             pass inputs of the same shape and dtype and splits of the same length",
            show(first),
            show(theirs)
        ),
    )
}

/// One call of the family across hosts: `meta` is this rank's metadata (its splits, and for
/// the combine its offsets), `align` the 2-D dispatch's major_align (1 otherwise), `h` the
/// input's handle.
#[allow(clippy::too_many_arguments)]
pub(crate) fn all_to_all_v(
    op: &str,
    kind: Kind,
    meta: &[i64],
    align: i64,
    (input, h): (&Tensor, &SymmHandle),
    out: &Tensor,
    out_splits_offsets: &Tensor,
    group: &Group,
    timeout: Duration,
) -> Result<()> {
    let (me, world) = (group.rank(), group.world_size());
    let (row, m, input_rows) = (row_bytes(input), meta.len(), rows_of(input));
    let rows_at = rows_at(m);
    let ws =
        workspace(group, "all_to_all_vdev", slot(input.nbytes(), m), move |cap| workspace_bytes(cap, world), timeout)?;
    let mut guard = lock(&ws);
    let w = &mut *guard;
    let e = w.epoch.wrapping_add(1);
    let (hw, cap) = (w.words.h.clone(), w.cap);
    let parity = (e % 2) as usize;
    let sigs = Sigs::new(hw.offset(), world, parity);
    let base = hw.offset() + words_bytes(world) + sigs_bytes(world) + parity * (world + 1) * cap;
    let (stage, inbox) = (base, |s: usize| base + (1 + s) * cap);
    let at = |rank: usize, off: usize| (hw.read_ptr(rank) + off) as *mut u8;
    let from = |r: usize| world + 1 + r;
    let locals = hw.local_ranks();
    let (leader, my_host) = (locals[0], hw.host_of(me));

    // What goes where, from this rank's own metadata (`None` where it is invalid: nothing
    // goes there, and every receiver's plan reports it).
    let chunks: Vec<Option<Vec<(i64, i64)>>> =
        (0..world).map(|d| source_chunks(kind, meta, world, input_rows, d)).collect();
    let span_of = |dsts: &[usize]| {
        let all = dsts.iter().filter_map(|&d| chunks[d].as_ref()).flatten().filter(|c| c.1 > 0);
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
        .filter_map(|&d| chunks[d].as_ref())
        .flatten()
        .map(|&(a, n)| bytes((a, a + n)))
        .collect();
    staged.extend(hosts.iter().filter(|h| direct(h.1).is_none()).filter_map(|h| h.1));

    // As in host-push all-to-all: only the sends of call e-2 must have landed.
    settle(&hw, &mut w.sent, |epoch| epoch != e.wrapping_sub(1), timeout)?;
    let header = [align, row as i64];
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
    for (i, v) in signature(kind, input, m).into_iter().enumerate() {
        // Relaxed: published with the stage, by ARRIVE here and by FROM on other hosts.
        word(&hw, me, sigs.slot(me) + 8 * i).store(v, Ordering::Relaxed);
    }
    // Writes from the input, to wait for before returning.
    let mut from_input = Vec::new();
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
                    from_input.extend(send_pieces_before_signal(&hw, l, b - a, push)?);
                }
                w.sent.push((l, e, hw.start_push(l, sigs.slot(me), 16, sigs.slot(me), timeout)?));
                w.sent.push((l, e, w.words.start_remote(l, from(me), e, timeout)?));
                Ok(())
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
        let meta_of = |s: usize| values(s, HEADER, m);
        let Plan { copies, splits_offsets } = plan(op, kind, &meta_of, (me, world), align, input_rows, rows_of(out))?;
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
    let sent = from_input.into_iter().try_for_each(|work| work.wait(Some(timeout)));
    outcome.and(sent)
}
