//! All-to-all-v on symmetric memory, with PyTorch's layouts
//! (`docs/symm-mem-algorithms.md` §5). Units are rows of dimension 0.
//!
//! Each operator is a plan and a way to carry it out. The plan ([`Plan`]) is computed by every
//! rank from every source's metadata (its splits, and for the combine its offsets): which rows
//! of which source land where in `out`, and what `out_splits_offsets` receives. What a source
//! sends to a destination is [`source_chunks`] of its metadata, the one function the plans
//! also use, so a sender and its receivers agree by construction.
//!
//! - **Pull** (one host, or large inputs): after an entry barrier, each rank reads its peers'
//!   metadata from their symmetric split tensors, plans, and copies its rows out of the peers'
//!   inputs (across hosts, reading them first, straight into `out` where the rows of a source
//!   are contiguous there); a final barrier keeps the inputs alive until everyone has read them.
//! - **Host push** (`push.rs`; across hosts up to [`VDEV_PUSH_MAX`] per rank): every rank
//!   stages its metadata and rows and writes, to each other host's leader, its metadata and the
//!   rows for that host's ranks, one way, as host-push all-to-all does; then every rank plans
//!   from the stages and inboxes of its host and copies. No barrier, no read across hosts.
//!
//! A rank that finds an error (a negative split, an output too small) still completes the
//! exchange, so no peer is left waiting, and then reports it.

use super::Algo;
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
pub(crate) fn rows_of(t: &Tensor) -> i64 {
    i64::try_from(t.shape()[0]).unwrap_or(i64::MAX)
}

/// `count` i64 values at element `at` of `rank`'s copy of the symmetric tensor behind `h`.
fn peer_i64(h: &SymmHandle, rank: usize, at: usize, count: usize) -> Vec<i64> {
    let base = (h.read_ptr(rank) + h.offset()) as *const i64;
    // SAFETY: the split tensors were checked to hold at least at+count i64 on every rank
    // (symmetric shapes), and nobody writes them between the barriers.
    (0..count).map(|i| unsafe { base.add(at + i).read() }).collect()
}

pub(crate) fn row_bytes(t: &Tensor) -> usize {
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

/// Across hosts, the family's inputs up to this size (per rank) go by host push (`push.rs`):
/// one one-way message from each rank to each other host's leader, no read and no barrier
/// across hosts. Larger ones are pulled, each rank reading just its rows.
pub const VDEV_PUSH_MAX: usize = 1 << 20;

/// The operators of the family, as their metadata tells them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `all_to_all_vdev`: `ws` splits, rank-major.
    V,
    /// `all_to_all_vdev_2d`: `ws·ne` splits, rank-major (`dst·ne + e`).
    TwoD { ne: usize },
    /// `all_to_all_vdev_2d_offset`: `ws·ne` splits then `ws·ne` offsets, expert-major
    /// (`e·ws + dst`).
    TwoDOffset { ne: usize },
}

impl Kind {
    /// A number per operator, for the ranks' signatures.
    pub(crate) fn code(self) -> u64 {
        match self {
            Kind::V => 1,
            Kind::TwoD { .. } => 2,
            Kind::TwoDOffset { .. } => 3,
        }
    }
}

/// The rows of a source's input that go to `dst`, from the source's metadata `meta`: (first
/// row, rows) per chunk, in the order the plans place them; `None` if the metadata is invalid
/// for `dst` (a negative split, a sum that overflows or exceeds the `rows` of the input, a chunk
/// outside it). Senders send these and receivers copy these, so both agree by construction.
pub(crate) fn source_chunks(kind: Kind, meta: &[i64], ws: usize, rows: i64, dst: usize) -> Option<Vec<(i64, i64)>> {
    match kind {
        Kind::V => {
            let scan = exclusive_scan(meta).filter(|_| splits_fit(meta, rows))?;
            Some(vec![(scan[dst], meta[dst])])
        }
        Kind::TwoD { ne } => {
            let scan = exclusive_scan(meta).filter(|_| splits_fit(meta, rows))?;
            Some((0..ne).map(|e| (scan[dst * ne + e], meta[dst * ne + e])).collect())
        }
        Kind::TwoDOffset { ne } => {
            let n = ws * ne;
            (0..ne)
                .map(|e| {
                    let i = e * ws + dst;
                    let (len, off) = (meta[i], meta[n + i]);
                    inside(len, off, rows).then_some((off, len))
                })
                .collect()
        }
    }
}

/// Whether `len` rows at row `off` lie inside an input of `rows` rows (checked).
fn inside(len: i64, off: i64, rows: i64) -> bool {
    len >= 0 && off >= 0 && off.checked_add(len).is_some_and(|end| end <= rows)
}

/// What one rank's call moves and reports.
pub(crate) struct Plan {
    /// (source rank, first row in its input, first row in `out`, rows), in copy order (this
    /// rank's own rows first, as on one host).
    pub(crate) copies: Vec<(usize, i64, i64, i64)>,
    /// What `out_splits_offsets` receives: the splits, then the offsets.
    pub(crate) splits_offsets: Vec<i64>,
}

/// Rank `me`'s plan among `ws`, from every source's metadata (`meta[p]`, of the operator's
/// length) and the rows of the inputs and of `out`. The same on every path; every error names the rank or
/// the sizes at fault, and every sum over metadata from peers is checked.
pub(crate) fn plan(
    op: &str,
    kind: Kind,
    meta: &[Vec<i64>],
    (me, ws): (usize, usize),
    align: i64,
    input_rows: i64,
    out_rows: i64,
) -> Result<Plan> {
    match kind {
        Kind::V => {
            let mut out_splits = vec![0i64; ws];
            let mut src_off = vec![0i64; ws];
            for p in 0..ws {
                let theirs = &meta[p];
                let Some(chunks) = source_chunks(kind, theirs, ws, input_rows, me) else {
                    return Err(bad(
                        op,
                        format!("rank {p}'s splits {theirs:?} are negative or exceed its {input_rows} rows"),
                    ));
                };
                (src_off[p], out_splits[p]) = chunks[0];
            }
            // Each split is at most its sender's row count, so neither sum can overflow;
            // checked all the same.
            let total = sum(&out_splits).filter(|&t| t <= out_rows);
            let (Some(_), Some(out_off)) = (total, exclusive_scan(&out_splits)) else {
                return Err(bad(op, format!("{:?} rows arrive but out has {out_rows}", sum(&out_splits))));
            };
            let copies = (0..ws).map(|k| (me + k) % ws).map(|p| (p, src_off[p], out_off[p], out_splits[p])).collect();
            Ok(Plan { copies, splits_offsets: [out_splits, out_off].concat() })
        }
        Kind::TwoD { ne } => {
            // out split e·ws + src = in_splits_src[me·ne + e]; the source offset is src's scan.
            let n = ws * ne;
            let mut out_splits = vec![0i64; n];
            let mut src_off = vec![0i64; n];
            for src in 0..ws {
                let Some(chunks) = source_chunks(kind, &meta[src], ws, input_rows, me) else {
                    return Err(bad(
                        op,
                        format!("rank {src}'s splits: their sum is larger than input dim, or a split is negative"),
                    ));
                };
                for (e, (off, len)) in chunks.into_iter().enumerate() {
                    out_splits[e * ws + src] = len;
                    src_off[e * ws + src] = off;
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
            if start.is_none_or(|s| s > out_rows) {
                return Err(bad(
                    op,
                    format!("{start:?} rows (with padding) arrive but out has {out_rows} (None: the sum overflows)"),
                ));
            }
            let copies = (0..n).map(|k| (me * ne + k) % n).map(|j| (j % ws, src_off[j], offsets[j], out_splits[j]));
            Ok(Plan { copies: copies.collect(), splits_offsets: [out_splits, offsets].concat() })
        }
        Kind::TwoDOffset { ne } => {
            let n = ws * ne;
            let mut out_splits = vec![0i64; n];
            let mut src_off = vec![0i64; n];
            for src in 0..ws {
                let m = &meta[src];
                let Some(chunks) = source_chunks(kind, m, ws, input_rows, me) else {
                    let at = |e: usize| (m[e * ws + me], m[n + e * ws + me]);
                    let e = (0..ne).find(|&e| !inside(at(e).0, at(e).1, input_rows)).unwrap_or(0);
                    let (len, off) = at(e);
                    return Err(bad(
                        op,
                        format!("rank {src}'s chunk for expert {e} ({len} rows at {off}) is outside its input"),
                    ));
                };
                for (e, (off, len)) in chunks.into_iter().enumerate() {
                    out_splits[src * ne + e] = len;
                    src_off[src * ne + e] = off;
                }
            }
            let total = sum(&out_splits).filter(|&t| t <= out_rows);
            let (Some(_), Some(offsets)) = (total, exclusive_scan(&out_splits)) else {
                return Err(bad(op, format!("{:?} rows arrive but out has {out_rows}", sum(&out_splits))));
            };
            let copies = (0..n).map(|k| (me * ne + k) % n).map(|j| (j / ne, src_off[j], offsets[j], out_splits[j]));
            Ok(Plan { copies: copies.collect(), splits_offsets: [out_splits, offsets].concat() })
        }
    }
}

/// Across hosts, up to this input size (per rank) the family's rows travel with the splits
/// (host push, one trip); above, when `out` is symmetric, they are written straight into the
/// other ranks' `out`s once every rank has the splits (two trips, no copy through a workspace,
/// no size limit).
pub const VDEV_CARRY_MAX: usize = 512 << 10;

/// The family's one selection: on one host, pull; across hosts (`hosts` > 1), host push up to
/// [`VDEV_CARRY_MAX`] bytes per rank, or when `out` is not symmetric up to [`VDEV_PUSH_MAX`]
/// with a bounded workspace (`meta_len`: the split values, and offsets, each rank passes);
/// write into the symmetric `out`s above; pull otherwise.
pub fn select_v(bytes: usize, meta_len: usize, world: usize, hosts: usize, out_symmetric: bool) -> Algo {
    let carried = bytes <= VDEV_PUSH_MAX && super::push::fits(bytes, meta_len, world);
    match () {
        _ if hosts <= 1 => Algo::Pull,
        _ if out_symmetric && bytes > VDEV_CARRY_MAX => Algo::Write,
        _ if carried => Algo::HostPush,
        _ => Algo::Pull,
    }
}

/// The family's name where its calls across hosts are refused once out of step.
const FAMILY: &str = "all_to_all_vdev";

/// One call of the family, once its arguments are checked: what it is and its metadata (the
/// splits, and for the combine their offsets).
struct Call<'a> {
    op: &'static str,
    kind: Kind,
    meta: &'a Tensor,
    meta_len: usize,
    align: i64,
}

impl Call<'_> {
    /// Runs it on the input's handle `h` and the metadata's `hs`, host-pushed or pulled (see
    /// [`route`]; `stamp`: the pull's entry check's arguments). Across hosts, ranks that took
    /// different ways or left a call at different points are out of step: refused from then on
    /// (the family shares one workspace).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        h: &SymmHandle,
        hs: &SymmHandle,
        stamp: &[u64],
        input: &Tensor,
        out: &Tensor,
        out_splits_offsets: &Tensor,
        group: &Group,
    ) -> Result<()> {
        let (op, kind, m, align) = (self.op, self.kind, self.meta_len, self.align);
        let call = || -> Result<()> {
            if let Route::Push(oh) = route(op, h, input, out, m, group)? {
                let meta = self.meta.to_vec::<i64>()?;
                let (input, out) = ((input, h), (out, oh.as_deref()));
                return super::push::all_to_all_v(
                    op,
                    kind,
                    &meta,
                    align,
                    input,
                    out,
                    out_splits_offsets,
                    group,
                    timeout(),
                );
            }
            // Not `prologue`: an empty input still receives (zero) splits and offsets.
            let stamp = Stamp::new(op, input, h.offset(), stamp);
            if h.all_local() {
                enter(group, h, &stamp)?;
            } else {
                // Across hosts, an entry that meets host push's calls: a rank that took host
                // push disagrees at once.
                super::push::meet(op, kind, input, m, &stamp, group, timeout())?;
            }
            pull(op, kind, h, hs, m, align, input, out, out_splits_offsets)
        };
        if h.all_local() { call() } else { crate::ops::hostpush::guarded(group, FAMILY, call) }
    }
}

/// The way a call of the family goes, and `out`'s handle when it is written into.
fn route(op: &str, h: &SymmHandle, input: &Tensor, out: &Tensor, meta_len: usize, group: &Group) -> Result<Route> {
    let out_symmetric = crate::symm::is_symm_mem_tensor(out) && out.is_contiguous();
    let hosts = if h.all_local() { 1 } else { 2 };
    Ok(match select_v(input.nbytes(), meta_len, h.world_size(), hosts, out_symmetric) {
        Algo::Pull => Route::Pull,
        Algo::HostPush => Route::Push(None),
        Algo::Write => Route::Push(Some(symmetric(op, out, group)?)),
    })
}

enum Route {
    Pull,
    /// Host push; with `out`'s handle, the rows written into the `out`s.
    Push(Option<std::sync::Arc<SymmHandle>>),
}

/// The pull path, after the entry check: every rank reads the sources' metadata, plans, and
/// copies its rows (those from other hosts read first: straight into `out` when each source's
/// rows are contiguous there, as for `all_to_all_vdev`).
#[allow(clippy::too_many_arguments)]
fn pull(
    op: &str,
    kind: Kind,
    h: &SymmHandle,
    hs: &SymmHandle,
    meta_len: usize,
    align: i64,
    input: &Tensor,
    out: &Tensor,
    out_splits_offsets: &Tensor,
) -> Result<()> {
    let (me, ws, row) = (h.rank(), h.world_size(), row_bytes(input));
    let outcome = (|| {
        fetch_shared(hs, |_| (0, meta_len * 8))?;
        let meta: Vec<Vec<i64>> = (0..ws).map(|p| peer_i64(hs, p, 0, meta_len)).collect();
        let plan = plan(op, kind, &meta, (me, ws), align, rows_of(input), rows_of(out))?;
        if kind == Kind::V {
            // One chunk per source, contiguous in out: remote ones are read straight into it,
            // this host's copied while the reads travel.
            let mut by_source = vec![(0i64, 0i64, 0i64); ws];
            for &(p, from, to, rows) in &plan.copies {
                by_source[p] = (from, to, rows);
            }
            let copy_local = || {
                for &(p, from, to, rows) in plan.copies.iter().filter(|c| h.is_local(c.0)) {
                    copy_rows(h, p, from, to, rows, row, out);
                }
            };
            let span = |p: usize| {
                let (from, to, rows) = by_source[p];
                (h.offset() + from as usize * row, rows.max(0) as usize * row, to as usize * row)
            };
            h.fetch_into(out, &span, timeout(), copy_local)?;
        } else {
            fetch_rows(h, plan.copies.iter().map(|c| (c.0, c.1, c.3)), row)?;
            for &(p, from, to, rows) in &plan.copies {
                copy_rows(h, p, from, to, rows, row, out);
            }
        }
        out_splits_offsets.copy_from_slice(&plan.splits_offsets)
    })();
    finish(h, outcome)
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
    check_rows(OP, input, out)?;
    check_splits(OP, in_splits, &[ws])?;
    check_splits(OP, out_splits_offsets, &[2, ws])?;
    let hs = symmetric(OP, in_splits, group)?;
    let h = symmetric(OP, input, group)?;
    let call = Call { op: OP, kind: Kind::V, meta: in_splits, meta_len: ws, align: 1 };
    call.run(&h, &hs, &[hs.offset() as u64, in_splits.numel() as u64], input, out, out_splits_offsets, group)
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
    check_rows(OP, input, out)?;
    let n = in_splits.numel();
    if n == 0 || !n.is_multiple_of(ws) {
        return Err(bad(OP, format!("in_splits has {n} entries; expected a positive multiple of world size {ws}")));
    }
    let kind = Kind::TwoD { ne: n / ws };
    check_splits(OP, in_splits, &[n])?;
    check_splits(OP, out_splits_offsets, &[2, n])?;
    let hs = symmetric(OP, in_splits, group)?;
    let h = symmetric(OP, input, group)?;
    let args = [hs.offset() as u64, n as u64, align as u64];
    let call = Call { op: OP, kind, meta: in_splits, meta_len: n, align };
    call.run(&h, &hs, &args, input, out, out_splits_offsets, group)
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
    check_rows(OP, input, out)?;
    let shape = in_splits_offsets.shape().to_vec();
    if shape.len() != 2 || shape[0] != 2 || shape[1] == 0 || !shape[1].is_multiple_of(ws) {
        return Err(bad(OP, format!("in_splits_offsets has shape {shape:?}; expected (2, k·{ws})")));
    }
    let n = shape[1];
    let kind = Kind::TwoDOffset { ne: n / ws };
    check_splits(OP, in_splits_offsets, &[2, n])?;
    check_splits(OP, out_splits_offsets, &[2, n])?;
    let hs = symmetric(OP, in_splits_offsets, group)?;
    let h = symmetric(OP, input, group)?;
    let call = Call { op: OP, kind, meta: in_splits_offsets, meta_len: 2 * n, align: 1 };
    call.run(&h, &hs, &[hs.offset() as u64, n as u64], input, out, out_splits_offsets, group)
}
