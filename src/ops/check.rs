//! Collective argument checks: ranks that pass an operator different shapes, dtypes, offsets
//! or arguments get the same clear error on every rank, instead of silently inconsistent
//! results (or a hang).
//!
//! ```text
//!   per group, a symmetric board per rank:  [ digest u64 (own 64-byte line) | stamp, 128 bytes ]
//!   stamp: dtype | byte offset | ndim | dims (8) | arguments' hash | op name
//!   operator:  write my stamp (if it changed) ─▶ entry barrier ─▶ read every rank's digest,
//!              compare to rank 0's (the stamps themselves only to say what differs)
//! ```
//!
//! The entry barrier every pulling operator makes anyway orders the stamps (written before it,
//! read after it: the barrier's Release/Acquire on the signal pads); the exit barrier keeps a
//! stamp in place until every rank has read it. A rank that calls with the same arguments as
//! last time writes nothing, so its digest's cache line stays shared and reading it costs
//! nothing. Ranks on this host are read where they are; ranks on other hosts with one small
//! read each, all in flight at once. Every rank reads every digest, so every rank reaches the
//! same verdict, and names the first rank (in rank order) that disagrees with rank 0.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::common::{bad, timeout};
use super::reduce::ReduceOp;
use crate::error::Result;
use crate::group::Group;
use crate::symm::{self, Device, SymmHandle};
use crate::tensor::{DType, Tensor};

/// Words in a stamp.
const WORDS: usize = 16;
/// Dimensions a stamp spells out; more are folded into the arguments' hash.
const DIMS: usize = 8;
/// Bytes of the operator's name a stamp keeps.
const NAME: usize = 24;

/// What one rank passed to one operator call.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp([u64; WORDS]);

/// FNV-1a, folding `words` into `h`.
fn fold(mut h: u64, words: impl IntoIterator<Item = u64>) -> u64 {
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

impl Stamp {
    /// The stamp of `op` on `input` (at byte `offset` of its allocation) with `args`: anything
    /// else every rank must agree on (reduction, root, dims, splits' shapes, ...).
    pub(crate) fn new(op: &str, input: &Tensor, offset: usize, args: &[u64]) -> Stamp {
        Stamp::of(op, input.dtype(), input.shape(), input.strides(), offset, args)
    }

    /// The stamp of `op` on a tensor of `dtype`, `shape` and `strides` (see [`Stamp::new`]).
    pub(crate) fn of(op: &str, dtype: DType, shape: &[usize], strides: &[usize], offset: usize, args: &[u64]) -> Stamp {
        let mut w = [0u64; WORDS];
        w[0] = u64::from(dtype.code());
        w[1] = offset as u64;
        w[2] = shape.len() as u64;
        for (i, &d) in shape.iter().take(DIMS).enumerate() {
            w[3 + i] = d as u64;
        }
        let extra = shape.iter().skip(DIMS).map(|&d| d as u64);
        let strides = strides.iter().map(|&s| s as u64);
        w[11] = fold(0xcbf2_9ce4_8422_2325, extra.chain(strides).chain(args.iter().copied()));
        let mut name = [0u8; 32];
        let n = op.len().min(NAME);
        name[..n].copy_from_slice(&op.as_bytes()[..n]);
        for i in 0..4 {
            w[12 + i] = u64::from_le_bytes(name[8 * i..8 * i + 8].try_into().unwrap_or_default());
        }
        Stamp(w)
    }

    fn op(&self) -> String {
        let bytes: Vec<u8> = self.0[12..16].iter().flat_map(|w| w.to_le_bytes()).take_while(|&b| b != 0).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn describe(&self) -> String {
        let dtype = DType::from_code(self.0[0] as u8).map_or_else(|| format!("dtype#{}", self.0[0]), |d| d.to_string());
        let ndim = self.0[2] as usize;
        let dims: Vec<String> = self.0[3..3 + ndim.min(DIMS)].iter().map(u64::to_string).collect();
        let more = if ndim > DIMS { ", ..." } else { "" };
        format!("{}({dtype} [{}{more}] at byte {})", self.op(), dims.join(", "), self.0[1])
    }
}

impl Stamp {
    /// One word that differs when the stamps do (FNV-1a of every word; never 0, the value of
    /// a board nobody wrote).
    pub(crate) fn digest(&self) -> u64 {
        fold(0xcbf2_9ce4_8422_2325, self.0.iter().copied()) | 1
    }
}

/// Words of a rank's board: the digest, alone on its cache line, then the stamp.
const DIGEST: usize = 0;
const STAMP: usize = 8;
const BOARD_WORDS: usize = STAMP + WORDS;

/// A group's board of stamps.
struct Board {
    _tensor: Tensor,
    h: Arc<SymmHandle>,
    /// What this rank last wrote, so an unchanged call writes nothing.
    last: Mutex<Option<Stamp>>,
}

impl Board {
    /// Board word `i` of `rank` (on this host, or this host's copy of a remote rank's).
    fn word(&self, rank: usize, i: usize) -> &AtomicU64 {
        // The board holds BOARD_WORDS words per rank (allocated below).
        self.h.word64(rank, self.h.offset() + 8 * i)
    }

    // Relaxed loads: the entry barrier (Release/Acquire on the signal pads) orders the
    // owner's stores before them.
    fn digest(&self, rank: usize) -> u64 {
        self.word(rank, DIGEST).load(Ordering::Relaxed)
    }

    fn read(&self, rank: usize) -> Stamp {
        let mut w = [0u64; WORDS];
        for (i, v) in w.iter_mut().enumerate() {
            *v = self.word(rank, STAMP + i).load(Ordering::Relaxed);
        }
        Stamp(w)
    }
}

/// A group's board, made collectively at its first checked call (kept in the group).
#[derive(Default)]
struct State(Mutex<Option<Arc<Board>>>);

fn board(group: &Group) -> Result<Arc<Board>> {
    let state = group.state::<State>();
    let mut slot = state.0.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(b) = &*slot {
        return Ok(b.clone());
    }
    let t = symm::empty(&[BOARD_WORDS], DType::I64, Device::Cpu)?;
    let h = symm::rendezvous(&t, group)?;
    let b = Arc::new(Board { _tensor: t, h, last: Mutex::new(None) });
    *slot = Some(b.clone());
    Ok(b)
}

/// Publishes this rank's stamp for the call about to synchronize on `h`.
pub(crate) fn post(group: &Group, stamp: &Stamp) -> Result<Posted> {
    let b = board(group)?;
    let me = b.h.rank();
    let mut last = b.last.lock().unwrap_or_else(|p| p.into_inner());
    if last.as_ref() != Some(stamp) {
        for (i, &v) in stamp.0.iter().enumerate() {
            // Relaxed: published by the entry barrier's Release (see `Board::digest`).
            b.word(me, STAMP + i).store(v, Ordering::Relaxed);
        }
        b.word(me, DIGEST).store(stamp.digest(), Ordering::Relaxed);
        *last = Some(*stamp);
    }
    drop(last);
    Ok(Posted { board: b, stamp: *stamp })
}

/// A stamp published, to check once the entry barrier has passed.
pub(crate) struct Posted {
    board: Arc<Board>,
    stamp: Stamp,
}

impl Posted {
    /// Compares every rank's stamp with rank 0's; every rank gets the same verdict.
    pub(crate) fn check(&self) -> Result<()> {
        let b = &self.board;
        // Ranks on other hosts: one read of each board, all at once.
        b.h.fetch(&|_| (b.h.offset(), 8 * BOARD_WORDS), timeout())?;
        let first = b.digest(0);
        match (1..b.h.world_size()).find(|&r| b.digest(r) != first) {
            None => Ok(()),
            Some(r) => Err(disagree(&self.stamp, &b.read(0), r, &b.read(r))),
        }
    }
}

#[cold]
fn disagree(mine: &Stamp, first: &Stamp, r: usize, theirs: &Stamp) -> crate::error::Error {
    let what = if first.0[..11] == theirs.0[..11] && first.op() == theirs.op() {
        format!("rank 0 and rank {r} pass {} with different arguments", first.describe())
    } else {
        format!("rank 0 passed {} but rank {r} passed {}", first.describe(), theirs.describe())
    };
    bad(
        &mine.op(),
        format!(
            "the ranks' arguments disagree: {what}; every rank of the group must call the same operator with the same \
             shapes, dtypes, offsets and arguments"
        ),
    )
}

/// What a rank passed to a reduction that synchronizes through its own workspace instead of
/// a barrier (the small all-reduce, the ones across hosts): its element count, and its dtype
/// and reduction, as two words those operators publish with their inputs.
pub(crate) fn counts(t: &Tensor, op: Option<ReduceOp>) -> [u64; 2] {
    [t.numel() as u64, u64::from(t.dtype().code()) | op.map_or(0, ReduceOp::code) << 8]
}

/// Bits of a signature's first word that hold the element count; those above hold, for the
/// operators that read every rank's view where they read their own ([`counts_at`]), a digest
/// of the view's offset.
pub(crate) const COUNT_BITS: u64 = (1 << 40) - 1;

/// [`counts`] for an operator whose single-host algorithm reads every rank's view at this
/// rank's own offset (all-gather, reduce-scatter, one-shot): the view's byte `offset` in its
/// allocation is digested into the first word's upper bits, so ranks that pass views at
/// different offsets disagree across hosts as on one host.
pub(crate) fn counts_at(t: &Tensor, op: Option<ReduceOp>, offset: usize) -> [u64; 2] {
    let [n, code] = counts(t, op);
    let digest = (offset as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
    [n & COUNT_BITS | digest << 40, code]
}

/// [`counts`] with the [`Stamp`] of the whole call folded into its upper bits: the signature
/// of a call across hosts that takes another algorithm than host push (above its limit), which
/// meets host push's calls on their workspace ([`crate::ops::hostpush::meet`]). A host-push
/// call's signature leaves those bits 0, so the two never agree: ranks whose sizes straddle
/// the limit differ in their counts anyway, and ranks that agree on them take the same path.
pub(crate) fn counts_stamped(t: &Tensor, op: Option<ReduceOp>, stamp: &Stamp) -> [u64; 2] {
    let [n, code] = counts(t, op);
    [n, code | stamp.digest() << 16]
}

/// The error every rank reports when rank `r`'s [`counts`] (or [`counts_stamped`]) differ from
/// rank 0's.
#[cold]
pub(crate) fn counts_disagree(op: &str, first: [u64; 2], r: usize, theirs: [u64; 2]) -> crate::error::Error {
    let show = |w: [u64; 2]| {
        let dtype = DType::from_code(w[1] as u8).map_or_else(|| "?".into(), |d| d.to_string());
        let reduction =
            ["", " (sum)", " (avg)", " (min)", " (max)"].get((w[1] >> 8 & 0x7f) as usize).copied().unwrap_or("");
        // Bit 15: a reduce-scatter split along the last dimension (`reduce_scatter_out`).
        let split = if w[1] >> 15 & 1 == 1 { " split along the last dimension" } else { "" };
        format!("{} {dtype} elements{reduction}{split}", w[0] & COUNT_BITS)
    };
    let low = |w: [u64; 2]| [w[0] & COUNT_BITS, w[1] & 0xffff];
    let what = if low(first) == low(theirs) {
        format!(
            "rank 0 and rank {r} passed {} with different arguments (shape, offset, root or algorithm)",
            show(first)
        )
    } else {
        format!("rank 0 passed {} but rank {r} passed {}", show(first), show(theirs))
    };
    bad(
        op,
        format!(
            "the ranks' arguments disagree: {what}; every rank of the group must pass the same number of elements, \
             dtype and arguments"
        ),
    )
}

/// The stamp's posting, the entry barrier on `h`, and the check: the start of every pulling
/// operator.
pub(crate) fn enter(group: &Group, h: &SymmHandle, stamp: &Stamp) -> Result<()> {
    let posted = post(group, stamp)?;
    // Across hosts the barrier carries the stamps' digests: when they agree, nobody needs to
    // read another host's board. When they do not, every rank learns it alike and reads the
    // boards, for the error.
    match h.barrier_agreeing(stamp.digest(), super::common::timeout())? {
        Some(0) => return Ok(()),
        Some(_) => {}
        None => super::common::barrier(h)?,
    }
    let verdict = posted.check();
    if verdict.is_err() {
        // Every rank reaches this verdict, and returns at once: a first rank back would post
        // its next call's stamp over this one while a slower rank still reads it (which then
        // saw a call rank 0 never made with this one). The operator's own final barrier does
        // this on success.
        let _ = super::common::barrier(&posted.board.h);
    }
    verdict
}

/// A check with a barrier of its own (on the board), for an operator that must know the ranks
/// agree before anything collective, such as growing a workspace. Ends with a barrier, so the
/// stamps are read before the next call rewrites them.
pub(crate) fn agree(group: &Group, stamp: &Stamp) -> Result<()> {
    let posted = post(group, stamp)?;
    let h = posted.board.h.clone();
    super::common::barrier(&h)?;
    let verdict = posted.check();
    super::common::barrier(&h)?;
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_that_straddle_or_only_stamps_that_differ_are_told_apart() {
        let a = Tensor::zeros(&[4, 8], DType::F32).unwrap();
        let b = Tensor::zeros(&[8, 4], DType::F32).unwrap();
        let sum = Some(ReduceOp::Sum);
        let (sa, sb) = (Stamp::new("all_reduce", &a, 0, &[1]), Stamp::new("all_reduce", &b, 0, &[1]));
        // Host push's signature never equals a stamped one of the same counts.
        assert_ne!(counts(&a, sum), counts_stamped(&a, sum, &sa));
        assert_ne!(counts_stamped(&a, sum, &sa), counts_stamped(&b, sum, &sb));
        let e =
            counts_disagree("all_reduce", counts_stamped(&a, sum, &sa), 2, counts_stamped(&b, sum, &sb)).to_string();
        assert!(e.contains("rank 0 and rank 2 passed 32 float32 elements (sum) with different arguments"), "{e}");
        let c = Tensor::zeros(&[64], DType::F32).unwrap();
        let e = counts_disagree("all_reduce", counts(&c, sum), 1, counts_stamped(&a, sum, &sa)).to_string();
        assert!(
            e.contains("rank 0 passed 64 float32 elements (sum) but rank 1 passed 32 float32 elements (sum)"),
            "{e}"
        );
    }

    #[test]
    fn stamps_tell_what_differs() {
        let a = Tensor::zeros(&[4, 8], DType::F32).unwrap();
        let b = Tensor::zeros(&[4, 4], DType::F32).unwrap();
        let s = Stamp::new("all_reduce", &a, 0, &[1]);
        assert!(s == Stamp::new("all_reduce", &a, 0, &[1]));
        assert!(s != Stamp::new("all_reduce", &a, 0, &[2]), "arguments count");
        assert!(s != Stamp::new("all_reduce", &a, 64, &[1]), "offsets count");
        assert!(s != Stamp::new("all_gather", &a, 0, &[1]), "operators count");
        let e = disagree(&s, &s, 3, &Stamp::new("all_reduce", &b, 0, &[1])).to_string();
        assert!(e.contains("rank 0 passed all_reduce(float32 [4, 8] at byte 0)"), "{e}");
        assert!(e.contains("rank 3 passed all_reduce(float32 [4, 4] at byte 0)"), "{e}");
        let e = disagree(&s, &s, 1, &Stamp::new("all_reduce", &a, 0, &[2])).to_string();
        assert!(e.contains("with different arguments"), "{e}");
    }
}
