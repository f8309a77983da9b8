//! All-reduce across hosts by a chain of hosts, in rank order.
//!
//! ```text
//!   hosts 0..k, each with the same number m of ranks, host h holding ranks h·m .. (h+1)·m;
//!   the tensor cut into m slices, slice i belonging to each host's i-th rank
//!   enter (a checked barrier: every rank is in the call, with the same arguments)
//!   stage 0        host 0's rank i folds slice i of its host's inputs, in rank order, into its
//!                  own slice i (the partial); raises PARTIAL at rank i of host 1
//!   stage h < k-1  host h's rank i waits for PARTIAL, reads host h-1's rank i's partial
//!                  (one-sided) and folds its host's slices i into it, into its own slice i;
//!                  raises PARTIAL at host h+1
//!   stage k-1      the last host's rank i does the same into every one of its host's slices i
//!                  (the result; an average divides here), writes it into slice i of rank i on
//!                  every other host, and raises DONE there
//!   then           rank i of every other host, at DONE, copies its slice i to its host's
//!                  ranks; each host's ranks meet in a barrier of their own
//!   (PARTIAL and DONE are epoch words: a remote atomic, not awaited; the waiter applies what
//!   arrived on its link itself)
//! ```
//!
//! Each element is folded exactly as on one host (`((x0 ∘ x1) ∘ x2) ∘ x3 ...`), so the result is
//! bitwise the same, as long as a partial loses nothing in the element type: any reduction of
//! f32, f64 and integers (their accumulator is the element), min and max of f16 and bf16 (their
//! result is one of the inputs); a sum of f16 or bf16 accumulates in f32 and takes two-shot
//! (carrying f32 partials through a scratch was tried: bitwise right, but slower than two-shot,
//! 4 ranks on 2 played hosts, bf16 1 MiB 2.2-2.3 ms against 1.6 ms, 16 MiB 37-39 against
//! 34-36 ms, and f32 about 5% slower through the scratch than in place).
//!
//! What crosses between hosts: each byte of the tensor once along the chain and once back from
//! the last host to each other: `2·(k-1)·n` bytes for n-byte tensors, where two-shot moves each
//! rank's slice to and from every rank of the other hosts (`2·m·(k-1)·n`). With m = 2 ranks per
//! host that halves the bytes between hosts and the CPU the copies of a TCP stack cost. The
//! hosts' stages run one after the other, a host's ranks on their slices at once (3 played
//! hosts of 2 ranks, tcp, 1 MiB: 1.77-1.78 ms against two-shot's 2.36-2.50; 4 MiB 5.5-5.6
//! against 7.0-7.2).
//!
//! Nothing is read while written: slice i of host h's tensors is read, then written, only by
//! its rank i, and its rank i's partial read by rank i of host h+1 after PARTIAL; the last
//! host writes slice i of another host's rank i only after that rank's partial was read, and
//! that rank copies it to its host only at DONE. A rank's next call's partial is written after
//! its DONE of this one, so after every read of this one's.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::Result;
use crate::group::Group;
use crate::ops::common::*;
use crate::ops::hostpush::{Named, landed, lock, send_from_tensor};
use crate::ops::reduce::{self, ReduceOp};
use crate::symm::hostsync::{Sent, Words, settle};
use crate::symm::{self, Device, SymmHandle};
use crate::tensor::{DType, Tensor};

/// Whether the chain takes an all-reduce of `dtype` by `op` on the group behind `h`: it spans
/// hosts, every host has the same number of ranks, at least 2 (with 1, two-shot moves as few
/// bytes and spreads the work), each host's ranks are consecutive, and a partial result is
/// exact in the element type. The same on every rank (the topology and the arguments are).
pub(crate) fn suits(dtype: DType, op: ReduceOp, h: &SymmHandle) -> bool {
    let (hosts, m) = (h.hosts(), h.local_ranks().len());
    let exact = !matches!(dtype, DType::F16 | DType::BF16) || matches!(op, ReduceOp::Min | ReduceOp::Max);
    exact && hosts > 1 && m >= 2 && (0..hosts).all(|k| h.ranks_on(k).iter().copied().eq(k * m..(k + 1) * m))
}

/// A group's chain words: in a small symmetric allocation of its own, per rank PARTIAL (raised
/// by the previous host's rank of the same position when its partial is final) and DONE (raised
/// by the last host's one when the result landed here), both counting the group's chain calls.
struct Chain {
    _tensor: Tensor,
    words: Words,
    epoch: u32,
    /// Signals in flight (they carry no buffer: only their failures matter).
    sent: Sent,
}

/// Word indices: PARTIAL of piece j at `PARTIAL + j`, DONE of piece j at `DONE + j`.
const PARTIAL: usize = 0;
const DONE: usize = MAX_PIECES;

/// The group's chain words, made collectively at its first chain call (every rank is in it:
/// the checked entry passed on all).
#[derive(Default)]
struct Chains(Mutex<Option<Arc<Mutex<Chain>>>>);

fn chain_words(group: &Group, t: Duration) -> Result<Arc<Mutex<Chain>>> {
    let state = group.state::<Chains>();
    let mut slot = lock(&state.0);
    if let Some(c) = &*slot {
        return Ok(c.clone());
    }
    let tensor = symm::empty(&[2 * MAX_PIECES], DType::U32, Device::Cpu)?;
    let h = symm::rendezvous(&tensor, group)?;
    h.barrier(0, t)?;
    let c = Arc::new(Mutex::new(Chain { _tensor: tensor, words: Words::new(h, 0), epoch: 0, sent: Vec::new() }));
    *slot = Some(c.clone());
    Ok(c)
}

/// The most pieces a rank's slice is cut into, and the least bytes a piece holds: hosts work
/// on different pieces at once (host h folds piece p while host h+1 folds piece p-1 and the
/// result of piece p-2 travels back), so the chain takes about (2·(k-1) + pieces - 1) piece
/// times instead of 2·(k-1) slice times.
const MAX_PIECES: usize = 16;
const PIECE_MIN: usize = 64 << 10;

/// In-place all-reduce of `tensor` (symmetric, behind `h`) by the chain; the caller checked
/// [`suits`].
pub(crate) fn all_reduce(tensor: &Tensor, op: ReduceOp, group: &Group, h: &SymmHandle) -> Result<()> {
    const OP: &str = "all_reduce";
    check_symmetric(OP, tensor)?;
    // The entry meets host push's calls (a rank whose size is on the other side of its limit
    // disagrees at once); named "all_reduce" in the stamp, so a rank that took two-shot (named
    // for it) disagrees too.
    super::host_push::meet(tensor, op, group, h, OP)?;
    let t = timeout();
    let c = chain_words(group, t)?;
    let mut c = lock(&c);
    let c = &mut *c;
    settle(&c.words.h, &mut c.sent, |_| false, t)?;
    let e = c.epoch.wrapping_add(1);
    c.epoch = e;
    let p = h.patience(t);
    let (dtype, es, ws) = (tensor.dtype(), tensor.dtype().size(), h.world_size());
    let locals = h.local_ranks();
    let (host, last) = (h.host_of(h.rank()), h.hosts() - 1);
    let i = h.rank() - locals[0];
    let chain = |k: usize| h.ranks_on(k)[i];
    let align = alignment(dtype) / es;
    let (start, len) = slice(tensor.numel(), locals.len(), i, align);
    let pieces = (len * es / PIECE_MIN).clamp(1, MAX_PIECES);
    // Sums fold without dividing until the last host: an average divides once, at the end.
    let fold = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
    let own = h.rank();
    let mut writes = Named::new();
    let r = (|| -> Result<()> {
        for j in 0..pieces {
            let (s, l) = slice(len, pieces, j, align);
            let (at, bytes) = ((start + s) * es, l * es);
            let all = peers(h, at);
            let mut srcs: Vec<*const u8> = Vec::with_capacity(locals.len() + 1);
            if host > 0 {
                // The previous host's partial of this piece is final once its word reaches this
                // call (its rank wrote it before raising the word; the read below follows).
                c.words.wait_for(PARTIAL + j, e, chain(host - 1), &p, t)?;
                fetch(h, |r| if r == chain(host - 1) { (at, bytes) } else { (0, 0) })?;
                srcs.push(all[chain(host - 1)]);
            }
            srcs.extend(locals.iter().map(|&r| all[r]));
            if host < last {
                // SAFETY: piece j of slice i of this host's tensors is read and written in this
                // call by this rank only (and this rank's piece read by the next host's rank i
                // once signalled below); every rank is in the call (the checked entry is a
                // barrier), the previous host's partial is final (its word, above) and in this
                // host's mirror; the pointers address `l` elements inside mapped buffers
                // (rendezvous checked the shapes), and `reduce` allows a destination that is
                // also a source.
                unsafe { reduce::reduce(dtype, fold, &srcs, &[all[own].cast_mut()], l, ws)? };
                let next = chain(host + 1);
                c.sent.push((next, e, c.words.start_remote(next, PARTIAL + j, e, t)?));
            } else {
                let dsts: Vec<*mut u8> = locals.iter().map(|&r| all[r].cast_mut()).collect();
                // SAFETY: as above; the result goes to piece j of slice i of every tensor of
                // this host, which no other rank reads or writes in this call.
                unsafe { reduce::reduce(dtype, op, &srcs, &dsts, l, ws)? };
                if last > 0 {
                    send_result(h, c, chain(0), at, bytes, j, e, t, &mut writes)?;
                }
            }
        }
        if host < last {
            // The result comes back along the chain, piece by piece: from the last host to the
            // first, then host after host; each rank hands it to its host and to the next.
            let from = if host == 0 { chain(last) } else { chain(host - 1) };
            for j in 0..pieces {
                let (s, l) = slice(len, pieces, j, align);
                let (at, bytes) = ((start + s) * es, l * es);
                c.words.wait_for(DONE + j, e, from, &p, t)?;
                if host + 1 < last {
                    send_result(h, c, chain(host + 1), at, bytes, j, e, t, &mut writes)?;
                }
                let all = peers(h, at);
                for &r in locals.iter().filter(|&&r| r != own) {
                    // SAFETY: this rank's piece holds the result (its word, above); piece j of
                    // slice i of the host's other tensors is written by this rank only, and read
                    // by nobody until the host's barrier below.
                    unsafe { std::ptr::copy_nonoverlapping(all[own], all[r].cast_mut(), l * es) };
                }
            }
        }
        Ok(())
    })();
    // The tensor is the caller's again only once the writes from it left.
    let landed = landed(h, &mut writes, t);
    r.and(landed)?;
    // Nobody leaves while a rank of its host still writes its slice into their tensors.
    h.local_barrier(0, t)
}

/// Sends piece `j` of the result (`bytes` at `at` of this rank's tensor) to the same place of
/// `to`'s, then raises `to`'s DONE word of the piece, which lands after it. `to`'s piece is
/// free: its partial was read by the next host before the result of the piece existed.
#[allow(clippy::too_many_arguments, reason = "one piece of the chain's way back")]
fn send_result(
    h: &SymmHandle,
    c: &mut Chain,
    to: usize,
    at: usize,
    bytes: usize,
    j: usize,
    e: u32,
    t: Duration,
    writes: &mut Named,
) -> Result<()> {
    if bytes > 0 {
        let from = h.offset() + at;
        send_from_tensor(h, to, bytes, |a, n| h.start_push(to, from + a, n, from + a, t), writes)?;
    }
    c.sent.push((to, e, c.words.start_remote(to, DONE + j, e, t)?));
    Ok(())
}
