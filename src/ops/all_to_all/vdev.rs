//! All-to-all-v on symmetric memory, with PyTorch's layouts
//! (`docs/symm-mem-algorithms.md` §5). Units are rows of dimension 0.
//!
//! Every operator pulls: after a barrier, each rank reads its peers' splits (and offsets) from
//! their symmetric split tensors, computes where everything lands, and copies its rows out of
//! the peers' inputs; a final barrier keeps the inputs alive until everyone has read them. A
//! rank that finds an error (a negative split, an output too small) still takes part in the
//! final barrier, so no peer is left waiting, and then reports it.

use crate::error::Result;
use crate::group::Group;
use crate::ops::check::{Stamp, enter};
use crate::ops::common::{bad, barrier, fetch, fetch_shared, symmetric, timeout};
use crate::symm::SymmHandle;
use crate::tensor::{DType, Tensor};

/// The exclusive prefix sums of `v`, or `None` if a sum overflows. Splits come from peers'
/// memory, so every sum over them is checked: a wrapped sum would pass the bounds checks and
/// send the copies outside their buffers.
fn exclusive_scan(v: &[i64]) -> Option<Vec<i64>> {
    let mut acc = 0i64;
    v.iter()
        .map(|&x| {
            let s = acc;
            acc = acc.checked_add(x)?;
            Some(s)
        })
        .collect()
}

/// The sum of `v`, or `None` if it overflows.
fn sum(v: &[i64]) -> Option<i64> {
    v.iter().try_fold(0i64, |acc, &x| acc.checked_add(x))
}

/// Whether every split is non-negative and they add up to at most `rows` (checked).
fn splits_fit(v: &[i64], rows: i64) -> bool {
    v.iter().all(|&x| x >= 0) && sum(v).is_some_and(|s| s <= rows)
}

/// The number of rows of `t` as an i64 (tensor sizes fit in isize, so this cannot fail for a
/// tensor that exists; saturate rather than panic anyway).
fn rows_of(t: &Tensor) -> i64 {
    i64::try_from(t.shape()[0]).unwrap_or(i64::MAX)
}

/// `count` i64 values at element `at` of `rank`'s copy of the symmetric tensor behind `h`.
fn peer_i64(h: &SymmHandle, rank: usize, at: usize, count: usize) -> Vec<i64> {
    let base = (h.read_ptr(rank) + h.offset()) as *const i64;
    // SAFETY: the split tensors were checked to hold at least at+count i64 on every rank
    // (symmetric shapes), and nobody writes them between the barriers.
    (0..count).map(|i| unsafe { base.add(at + i).read() }).collect()
}

fn row_bytes(t: &Tensor) -> usize {
    t.shape()[1..].iter().product::<usize>() * t.dtype().size()
}

fn check_rows(op: &str, input: &Tensor, out: &Tensor) -> Result<usize> {
    if input.shape().is_empty() || out.shape().is_empty() {
        return Err(bad(op, "input and out need a first dimension"));
    }
    if !out.is_contiguous() {
        return Err(bad(op, "out must be contiguous"));
    }
    crate::ops::common::disjoint(op, input, out)?;
    if input.dtype() != out.dtype() || row_bytes(input) != row_bytes(out) {
        return Err(bad(op, "input and out must have the same dtype and the same stride(0)"));
    }
    Ok(row_bytes(input))
}

fn check_splits(op: &str, t: &Tensor, shape: &[usize]) -> Result<()> {
    if t.dtype() != DType::I64 {
        return Err(bad(op, "splits and offsets must be int64"));
    }
    if t.shape() != shape || !t.is_contiguous() {
        return Err(bad(op, format!("a splits tensor has shape {:?}; expected {shape:?}", t.shape())));
    }
    Ok(())
}

/// Copies `rows` rows from `src`'s input (at row `from`) into `out` (at row `to`).
fn copy_rows(h: &SymmHandle, src: usize, from: i64, to: i64, rows: i64, row: usize, out: &Tensor) {
    if rows <= 0 {
        return;
    }
    let s = (h.read_ptr(src) + h.offset() + from as usize * row) as *const u8;
    // SAFETY: the caller checked [from, from+rows) inside src's input and [to, to+rows) inside
    // out; inputs are not written between the barriers.
    unsafe { std::ptr::copy_nonoverlapping(s, out.data_ptr().add(to as usize * row), rows as usize * row) };
}

/// Fetches, from every rank on another host, the rows this rank copies from it: `chunks` holds
/// (source rank, first row, rows); each source's rows are fetched as one span.
fn fetch_rows(h: &SymmHandle, chunks: impl Iterator<Item = (usize, i64, i64)>, row: usize) -> Result<()> {
    if h.all_local() {
        return Ok(());
    }
    let mut spans = vec![(i64::MAX, 0i64); h.world_size()];
    for (src, from, rows) in chunks.filter(|c| c.2 > 0) {
        let s = &mut spans[src];
        *s = (s.0.min(from), s.1.max(from + rows));
    }
    fetch(h, |r| {
        let (a, b) = spans[r];
        if a >= b { (0, 0) } else { (a as usize * row, (b - a) as usize * row) }
    })
}

/// Finishes a collective: the final barrier always happens, then the first error, if any.
fn finish(h: &SymmHandle, outcome: Result<()>) -> Result<()> {
    let b = barrier(h);
    outcome.and(b)
}

/// All-to-all with per-peer row counts: `in_splits[p]` rows (contiguous, in peer order) go to
/// peer p; `out_splits_offsets[0]` receives how many rows came from each peer and `[1]` where
/// they start in `out`. `input` and `in_splits` must be symmetric; `out` must hold them all.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     // Rank 0 sends 1 row to rank 0 and 2 to rank 1; rank 1 sends 3 and 1.
///     let me = group.rank();
///     let input = symm::empty(&[4, 2], DType::F32, Device::Cpu)?;
///     input.fill(me as f32)?;
///     let splits = symm::empty(&[2], DType::I64, Device::Cpu)?;
///     splits.copy_from_slice(&[[1i64, 2], [3, 1]][me])?;
///     let out = symm::empty(&[8, 2], DType::F32, Device::Cpu)?; // room for the worst case
///     let got = symm::empty(&[2, 2], DType::I64, Device::Cpu)?;
///     ops::all_to_all_vdev(&input, &out, &splits, &got, &group)?;
///     // Rows received from each peer, then where they start in `out`.
///     let want: [i64; 4] = if me == 0 { [1, 3, 0, 1] } else { [2, 1, 0, 2] };
///     assert_eq!(got.to_vec::<i64>()?, want);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn all_to_all_vdev(
    input: &Tensor,
    out: &Tensor,
    in_splits: &Tensor,
    out_splits_offsets: &Tensor,
    group: &Group,
) -> Result<()> {
    const OP: &str = "all_to_all_vdev";
    let ws = group.world_size();
    let row = check_rows(OP, input, out)?;
    check_splits(OP, in_splits, &[ws])?;
    check_splits(OP, out_splits_offsets, &[2, ws])?;
    let hs = symmetric(OP, in_splits, group)?;
    let hs_bytes = in_splits.nbytes();
    // Not `prologue`: an empty input still receives (zero) splits and offsets.
    let h = symmetric(OP, input, group)?;
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[hs.offset() as u64, in_splits.numel() as u64]))?;
    let me = h.rank();
    let outcome = (|| {
        fetch_shared(&hs, |_| (0, hs_bytes))?;
        let mut out_splits = vec![0i64; ws];
        let mut src_off = vec![0i64; ws];
        for p in 0..ws {
            let theirs = peer_i64(&hs, p, 0, ws);
            let scan = exclusive_scan(&theirs).filter(|_| splits_fit(&theirs, rows_of(input)));
            let Some(scan) = scan else {
                return Err(bad(
                    OP,
                    format!("rank {p}'s splits {theirs:?} are negative or exceed its {} rows", input.shape()[0]),
                ));
            };
            out_splits[p] = theirs[me];
            src_off[p] = scan[me];
        }
        // Each split is at most its sender's row count, so neither sum can overflow; checked
        // all the same.
        let total = sum(&out_splits).filter(|&t| t <= rows_of(out));
        let (Some(_), Some(out_off)) = (total, exclusive_scan(&out_splits)) else {
            return Err(bad(OP, format!("{:?} rows arrive but out has {}", sum(&out_splits), out.shape()[0])));
        };
        // Rows from ranks on other hosts are read straight into out (each source's rows are
        // contiguous there); those of this host's ranks are copied while the reads travel.
        let copy_local = || {
            for p in (0..ws).map(|k| (me + k) % ws).filter(|&p| h.is_local(p)) {
                copy_rows(&h, p, src_off[p], out_off[p], out_splits[p], row, out);
            }
        };
        let span = |p: usize| {
            let n = out_splits[p].max(0) as usize * row;
            (h.offset() + src_off[p] as usize * row, n, out_off[p] as usize * row)
        };
        h.fetch_into(out, &span, timeout(), copy_local)?;
        out_splits_offsets.copy_from_slice(&[out_splits, out_off].concat())
    })();
    finish(&h, outcome)
}

/// All-to-all-v for mixture-of-experts dispatch: `ne = in_splits.numel() / ws` experts per
/// rank. The input is rank-major (split `dst·ne + e`), the output expert-major (split
/// `e·ws + src`), each expert's segment padded to a multiple of `major_align` rows (an empty
/// expert still takes `major_align`). `out_splits_offsets` receives the splits and the padded
/// offsets, and must be symmetric to be fed to [`all_to_all_vdev_2d_offset`].
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     // Two experts per rank; every rank sends one row to each expert of each rank.
///     let input = symm::empty(&[4, 2], DType::F32, Device::Cpu)?;
///     input.fill(group.rank() as f32)?;
///     let splits = symm::empty(&[4], DType::I64, Device::Cpu)?; // rank-major: dst * 2 + e
///     splits.fill(1i64)?;
///     let out = symm::empty(&[16, 2], DType::F32, Device::Cpu)?;
///     let got = symm::empty(&[2, 4], DType::I64, Device::Cpu)?; // expert-major: e * 2 + src
///     ops::all_to_all_vdev_2d(&input, &out, &splits, &got, &group, Some(4))?;
///     // Each expert's segment is padded to 4 rows: offsets 0, 1 and then 4, 5.
///     assert_eq!(got.to_vec::<i64>()?, [1, 1, 1, 1, 0, 1, 4, 5]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn all_to_all_vdev_2d(
    input: &Tensor,
    out: &Tensor,
    in_splits: &Tensor,
    out_splits_offsets: &Tensor,
    group: &Group,
    major_align: Option<usize>,
) -> Result<()> {
    const OP: &str = "all_to_all_vdev_2d";
    let ws = group.world_size();
    let align = i64::try_from(major_align.unwrap_or(1)).unwrap_or(0);
    if align <= 0 {
        return Err(bad(OP, format!("major_align must be positive and fit in int64, got {major_align:?}")));
    }
    let row = check_rows(OP, input, out)?;
    let n = in_splits.numel();
    if n == 0 || !n.is_multiple_of(ws) {
        return Err(bad(OP, format!("in_splits has {n} entries; expected a positive multiple of world size {ws}")));
    }
    let ne = n / ws;
    check_splits(OP, in_splits, &[n])?;
    check_splits(OP, out_splits_offsets, &[2, n])?;
    let hs = symmetric(OP, in_splits, group)?;
    let hs_bytes = in_splits.nbytes();
    let args = [hs.offset() as u64, n as u64, align as u64];
    // Not `prologue`: an empty input still receives (zero) splits and offsets.
    let h = symmetric(OP, input, group)?;
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &args))?;
    let me = h.rank();
    let outcome = (|| {
        fetch_shared(&hs, |_| (0, hs_bytes))?;
        // out split e·ws + src = in_splits_src[me·ne + e]; the source offset is src's scan.
        let mut out_splits = vec![0i64; n];
        let mut src_off = vec![0i64; n];
        for src in 0..ws {
            let theirs = peer_i64(&hs, src, 0, n);
            let scan = exclusive_scan(&theirs).filter(|_| splits_fit(&theirs, rows_of(input)));
            let Some(scan) = scan else {
                return Err(bad(
                    OP,
                    format!("rank {src}'s splits: their sum is larger than input dim, or a split is negative"),
                ));
            };
            for e in 0..ne {
                out_splits[e * ws + src] = theirs[me * ne + e];
                src_off[e * ws + src] = scan[me * ne + e];
            }
        }
        let mut offsets = vec![0i64; n];
        let mut start = Some(0i64);
        for e in 0..ne {
            let tile = &out_splits[e * ws..(e + 1) * ws];
            let (Some(s), Some(scan)) = (start, exclusive_scan(tile)) else { break };
            for (src, off) in scan.iter().enumerate() {
                offsets[e * ws + src] = s.saturating_add(*off);
            }
            // The segment, padded up to a multiple of `align` (an empty one takes `align`).
            let padded = sum(tile).and_then(|l| l.checked_add(align - 1)).map(|l| (l / align * align).max(align));
            start = padded.and_then(|p| s.checked_add(p));
        }
        if start.is_none_or(|s| s > rows_of(out)) {
            return Err(bad(
                OP,
                format!(
                    "{start:?} rows (with padding) arrive but out has {} (None: the sum overflows)",
                    out.shape()[0]
                ),
            ));
        }
        fetch_rows(&h, (0..n).map(|j| (j % ws, src_off[j], out_splits[j])), row)?;
        for k in 0..n {
            let j = (me * ne + k) % n;
            copy_rows(&h, j % ws, src_off[j], offsets[j], out_splits[j], row, out);
        }
        out_splits_offsets.copy_from_slice(&[out_splits, offsets].concat())
    })();
    finish(&h, outcome)
}

/// The combine of [`all_to_all_vdev_2d`]: the input is expert-major (split `e·ws + dst`) at the
/// explicit offsets of `in_splits_offsets[1]` (gaps are skipped), the output rank-major (split
/// `src·ne + e`), packed. `in_splits_offsets` must be symmetric.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     // Dispatch to experts, then combine back: the round trip returns the input.
///     let input = symm::empty(&[4, 2], DType::F32, Device::Cpu)?;
///     input.copy_from_slice(&(0..8).map(|i| (group.rank() * 100 + i) as f32).collect::<Vec<_>>())?;
///     let splits = symm::empty(&[4], DType::I64, Device::Cpu)?;
///     splits.fill(1i64)?;
///     let (mid, mid_splits) = (symm::empty(&[16, 2], DType::F32, Device::Cpu)?, symm::empty(&[2, 4], DType::I64, Device::Cpu)?);
///     ops::all_to_all_vdev_2d(&input, &mid, &splits, &mid_splits, &group, Some(4))?;
///     let (back, back_splits) = (symm::empty(&[4, 2], DType::F32, Device::Cpu)?, symm::empty(&[2, 4], DType::I64, Device::Cpu)?);
///     ops::all_to_all_vdev_2d_offset(&mid, &back, &mid_splits, &back_splits, &group)?;
///     assert_eq!(back.to_vec::<f32>()?, input.to_vec::<f32>()?);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn all_to_all_vdev_2d_offset(
    input: &Tensor,
    out: &Tensor,
    in_splits_offsets: &Tensor,
    out_splits_offsets: &Tensor,
    group: &Group,
) -> Result<()> {
    const OP: &str = "all_to_all_vdev_2d_offset";
    let ws = group.world_size();
    let row = check_rows(OP, input, out)?;
    let shape = in_splits_offsets.shape().to_vec();
    if shape.len() != 2 || shape[0] != 2 || shape[1] == 0 || !shape[1].is_multiple_of(ws) {
        return Err(bad(OP, format!("in_splits_offsets has shape {shape:?}; expected (2, k·{ws})")));
    }
    let n = shape[1];
    let ne = n / ws;
    check_splits(OP, in_splits_offsets, &[2, n])?;
    check_splits(OP, out_splits_offsets, &[2, n])?;
    let hs = symmetric(OP, in_splits_offsets, group)?;
    let hs_bytes = in_splits_offsets.nbytes();
    // Not `prologue`: an empty input still receives (zero) splits and offsets.
    let h = symmetric(OP, input, group)?;
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[hs.offset() as u64, n as u64]))?;
    let me = h.rank();
    let outcome = (|| {
        fetch_shared(&hs, |_| (0, hs_bytes))?;
        let mut out_splits = vec![0i64; n];
        let mut src_off = vec![0i64; n];
        for src in 0..ws {
            let splits = peer_i64(&hs, src, 0, n);
            let offs = peer_i64(&hs, src, n, n);
            for e in 0..ne {
                let i = e * ws + me;
                let (len, off) = (splits[i], offs[i]);
                if len < 0 || off < 0 || off.checked_add(len).is_none_or(|end| end > rows_of(input)) {
                    return Err(bad(
                        OP,
                        format!("rank {src}'s chunk for expert {e} ({len} rows at {off}) is outside its input"),
                    ));
                }
                out_splits[src * ne + e] = len;
                src_off[src * ne + e] = off;
            }
        }
        let total = sum(&out_splits).filter(|&t| t <= rows_of(out));
        let (Some(_), Some(offsets)) = (total, exclusive_scan(&out_splits)) else {
            return Err(bad(OP, format!("{:?} rows arrive but out has {}", sum(&out_splits), out.shape()[0])));
        };
        fetch_rows(&h, (0..n).map(|j| (j / ne, src_off[j], out_splits[j])), row)?;
        for k in 0..n {
            let j = (me * ne + k) % n;
            copy_rows(&h, j / ne, src_off[j], offsets[j], out_splits[j], row, out);
        }
        out_splits_offsets.copy_from_slice(&[out_splits, offsets].concat())
    })();
    finish(&h, outcome)
}
