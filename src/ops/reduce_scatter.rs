//! Reduce-scatter: `reduce_scatter_out` (the first half of the two-shot all-reduce; across
//! hosts, small and medium inputs by host push, the all-gather's exchange with each rank
//! reducing its slice) and `reduce_scatter_offset` (`docs/symm-mem-algorithms.md` §6: blocks
//! of a 2-D input reduced to their owners), pulled from the peers between two barriers.

use crate::error::Result;
use crate::group::Group;
use crate::ops::all_gather::{Algo, Travels};
use crate::ops::common::*;
use crate::ops::hostpush;
use crate::ops::reduce::{self, ReduceOp};
use crate::symm::SymmHandle;
use crate::tensor::Tensor;

/// The kind of the reduce-scatter's host-push workspace.
const KIND: &str = "reduce_scatter";

/// Across hosts, host push takes a reduce-scatter while its host's inputs (`ranks per host x
/// bytes per rank`) are at most this many bytes over tcp links ([`UCX_HOST_MAX`] over ucx):
/// each rank sends another host only the slices of that host's ranks, as pull fetches only
/// the slices. Paired runs of the two ways (`bench/ab_builds.py 6`, 2 played hosts, tcp), host
/// push against pull: 2 ranks 0.35x the time at 512 KiB per rank, 0.51x at 1 MiB, 0.66x at 2
/// MiB, a tie at 4 MiB; 4 ranks 0.54x at 512 KiB, 0.77x at 1 MiB, 1.19x at 2 MiB.
pub const HOST_MAX: usize = 2 << 20;

/// [`HOST_MAX`] over ucx links, where host push also stops at [`UCX_PUSH_MAX`] bytes per rank
/// (`UCX_TLS=tcp`, host push against pull: 2 ranks 0.51x the time at 64 KiB, 0.59x at 128 KiB,
/// 0.54x at 256 KiB, 0.61x at 512 KiB, 1.20x [0.61, 1.34] at 1 MiB; 4 ranks 0.40x at 64 KiB,
/// 0.75x at 128 KiB, 0.72x at 256 and 512 KiB). When every rank sent its whole input, host
/// push lost from 128 KiB.
pub const UCX_HOST_MAX: usize = 1 << 20;

/// See [`UCX_HOST_MAX`].
pub const UCX_PUSH_MAX: usize = 512 << 10;

/// The one selection: across hosts host push while a host's inputs (`bytes` per rank, at most
/// `ranks_per_host` ranks on a host) fit [`HOST_MAX`] (over ucx links, `link`, [`UCX_HOST_MAX`]
/// and [`UCX_PUSH_MAX`]); pull otherwise and on one host.
pub fn select(bytes: usize, ranks_per_host: usize, hosts: usize, link: Option<&str>) -> Algo {
    let (host_max, max) = if link == Some("ucx") { (UCX_HOST_MAX, UCX_PUSH_MAX) } else { (HOST_MAX, usize::MAX) };
    let fits = bytes <= max && hostpush::fits_host(bytes, ranks_per_host, host_max);
    if hosts > 1 && fits { Algo::HostPush } else { Algo::Pull }
}

/// The selection of an operator that reduce-scatters whole inputs, each rank sending all of
/// its input to every other host (the fused matmul-reduce-scatter along columns): host push while a host's
/// inputs fit the all-gather's limits ([`crate::ops::all_gather::select`]), over ucx links
/// up to 64 KiB per rank (2 played hosts, `UCX_TLS=tcp`, 4 alternated runs of each, whole
/// inputs pushed against the slices pulled: 0.46x the time at 32 KiB and 0.70x at 64 KiB with
/// 4 ranks, 0.82x at 64 KiB with 2; 1.27-1.31x at 128 KiB, 1.27x and 2.07x at 256 KiB).
pub(crate) fn select_whole(bytes: usize, ranks_per_host: usize, hosts: usize, link: Option<&str>) -> Algo {
    if link == Some("ucx") && bytes > 64 << 10 {
        return Algo::Pull;
    }
    crate::ops::all_gather::select(bytes, ranks_per_host, hosts, link)
}

/// The algorithm [`reduce_scatter_out`] takes for `input` on the group of `h` (its handle).
pub fn select_for(input: &Tensor, h: &SymmHandle) -> Algo {
    let hosts = if h.all_local() { 1 } else { 2 };
    select(input.nbytes(), h.max_ranks_per_host(), hosts, h.link_backend())
}

/// A host-push call's signature: the counts at the view's `offset`, with the reduction and
/// (bit 15) the split.
fn host_sig(input: &Tensor, op: ReduceOp, split_last_dim: bool, offset: usize) -> [u64; 2] {
    let [n, code] = crate::ops::check::counts_at(input, Some(op), offset);
    [n, code | u64::from(split_last_dim) << 15]
}

/// PyTorch's `_low_contention_reduce_scatter`: block r of `ws` along the first dimension of
/// the sum (or mean) of every rank's `input`, for rank r, in a new tensor `[d0 / ws, ...]`.
/// `input` may be ordinary or symmetric: an ordinary (or non-contiguous) one is first copied
/// into the group's workspace, as PyTorch's pushes it into its symmetric workspace. A CPU has
/// no copy engines to spare compute with, so this is [`reduce_scatter_out`] (in rank order, so
/// every rank's blocks are bitwise what a one-rank sum would be).
///
/// ```
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0])?; // not symmetric
///     let out = ops::low_contention_reduce_scatter(&x, ReduceOp::Sum, &group)?;
///     let want = if group.rank() == 0 { [2.0, 4.0] } else { [6.0, 8.0] };
///     assert_eq!((out.shape(), out.to_vec::<f32>()?), (&[1, 2][..], want.to_vec()));
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn low_contention_reduce_scatter(input: &Tensor, op: ReduceOp, group: &Group) -> Result<Tensor> {
    const OP: &str = "_low_contention_reduce_scatter";
    if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        return Err(bad(OP, format!("reduce_op ({op:?}) is not supported (sum, avg)")));
    }
    let ws = group.world_size();
    let Some(&d0) = input.shape().first() else {
        return Err(bad(OP, "the input has no first dimension to scatter"));
    };
    if d0 % ws != 0 {
        return Err(bad(OP, format!("the first dimension ({d0}) must be divisible by the world size ({ws})")));
    }
    let staged;
    let input = if crate::symm::is_symm_mem_tensor(input) && input.is_contiguous() {
        input
    } else {
        staged = stage(OP, input, group, &[op.code()])?;
        &staged
    };
    let mut out_shape = input.shape().to_vec();
    out_shape[0] /= ws;
    let out = Tensor::zeros(&out_shape, input.dtype())?;
    let (flat, out_flat) = (input.view(&[input.numel()])?, out.view(&[out.numel()])?);
    scatter_out(&flat, op, group, false, &out_flat, alignment(input.dtype()))?;
    Ok(out)
}

/// Reduce-scatter: rank r's `out` receives slice r of the reduction. Without
/// `split_last_dim`, `input` and `out` are 1-D and slice r is the r-th 1/ws of `input`; with
/// it, slice r is the r-th block of columns of the last dimension.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     // Whole 16-byte vectors per rank, as PyTorch's kernels take them: 8 f32 on 2 ranks.
///     let x = symm::empty(&[8], DType::F32, Device::Cpu)?;
///     x.copy_from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])?;
///     let out = Tensor::zeros(&[4], DType::F32)?; // slice `rank` of the sum
///     ops::reduce_scatter_out(&x, ReduceOp::Sum, &group, false, &out)?;
///     let want = if group.rank() == 0 { [2.0, 4.0, 6.0, 8.0] } else { [10.0, 12.0, 14.0, 16.0] };
///     assert_eq!(out.to_vec::<f32>()?, want);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn reduce_scatter_out(
    input: &Tensor,
    op: ReduceOp,
    group: &Group,
    split_last_dim: bool,
    out: &Tensor,
) -> Result<()> {
    // Counted in PyTorch's vector width (16 bytes where the offset and size allow), as its
    // checks count: a bf16 input of 48 elements on 4 ranks is refused there, so here too.
    scatter_out(input, op, group, split_last_dim, out, vector_alignment(input))
}

/// [`reduce_scatter_out`], its divisibility counted in units of `align` bytes (PyTorch's
/// vector width for the operator itself; the element alignment for the operators built on it,
/// whose PyTorch counterparts ask only that the first dimension divide).
fn scatter_out(
    input: &Tensor,
    op: ReduceOp,
    group: &Group,
    split_last_dim: bool,
    out: &Tensor,
    align: usize,
) -> Result<()> {
    const OP: &str = "reduce_scatter_out";
    reducible(OP, input)?;
    if out.dtype() != input.dtype() || !out.is_contiguous() {
        return Err(bad(OP, "output must be a contiguous tensor of the input's dtype"));
    }
    disjoint(OP, input, out)?;
    let ws = group.world_size();
    let per_align = align / input.dtype().size();
    if split_last_dim {
        let (is, os) = (input.shape(), out.shape());
        let last = *is.last().ok_or_else(|| bad(OP, "input has no dimensions"))?;
        if is.len() != os.len() || is[..is.len() - 1] != os[..os.len() - 1] || os[os.len() - 1] * ws != last {
            return Err(bad(
                OP,
                format!("output shape {os:?} must be the input shape {is:?} with the last dimension / {ws}"),
            ));
        }
        if last % (ws * per_align) != 0 {
            return Err(bad(OP, format!("the last dimension must be divisible by world_size * {per_align}")));
        }
    } else {
        if input.shape().len() != 1 || out.shape().len() != 1 {
            return Err(bad(OP, "reduce_scatter expected 1D input/output"));
        }
        if !input.numel().is_multiple_of(ws * per_align) {
            return Err(bad(OP, format!("expected number of elements to be divisible by world_size * {per_align}")));
        }
        if out.numel() * ws != input.numel() {
            return Err(bad(OP, format!("output has {} elements; expected {}", out.numel(), input.numel() / ws)));
        }
    }
    let args = [op.code(), u64::from(split_last_dim)];
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    if h.all_local() {
        enter_on(OP, input, group, &h, &args)?;
        return pulled(input, op, split_last_dim, out, &h);
    }
    // Across hosts, ranks that took different algorithms (sizes on either side of the limit)
    // or left a call at different points are out of step: refused from then on.
    hostpush::guarded(group, KIND, || {
        if select_for(input, &h) == Algo::HostPush {
            // Host push checks the ranks' arguments itself, in its one exchange.
            let sig = host_sig(input, op, split_last_dim, h.offset());
            // Split along the first dimension, the ranks of a host read the slices of their
            // ranks only: from the lowest's to the highest's, the rest stays home (split along
            // the last, every row holds a block of each rank's, and whole inputs travel).
            let theirs = crate::ops::all_gather::slices_of(input.nbytes() / group.world_size());
            let travels = if split_last_dim { Travels::All } else { Travels::Range(&theirs) };
            return crate::ops::all_gather::exchange_inputs(
                &[input],
                group,
                &h,
                KIND,
                sig,
                travels,
                timeout(),
                || {},
                |inputs| {
                    // SAFETY: `inputs[r]` holds, for the length of the call, rank r's input: whole
                    // on this host, and on another at least this rank's slice (`theirs`), where it
                    // lies in the whole input; `reduce_own` reads no more of it.
                    unsafe { reduce_own(input, op, split_last_dim, out, inputs, h.rank()) }
                },
            );
        }
        crate::ops::all_gather::meet(input, group, &h, KIND, Some(op), &args)?;
        pulled(input, op, split_last_dim, out, &h)
    })
}

/// Reduces this rank's slice (`rank`) of every rank's input, in rank order, into `out`.
///
/// # Safety
///
/// `inputs[r]` must point to rank r's input (`input`'s shape), of which this rank's slice
/// (split along the last dimension: the whole input) must be readable and unchanged for the
/// length of the call; `out` must be contiguous, of `input`'s dtype, shaped as
/// [`reduce_scatter_out`] checked.
unsafe fn reduce_own(
    input: &Tensor,
    op: ReduceOp,
    split_last_dim: bool,
    out: &Tensor,
    inputs: &[*const u8],
    rank: usize,
) -> Result<()> {
    let (ws, es) = (inputs.len(), input.dtype().size());
    let at = |off: usize| inputs.iter().map(|&p| p.wrapping_add(off)).collect::<Vec<_>>();
    if split_last_dim {
        let last = *input.shape().last().unwrap_or(&1);
        let (cols, rows) = (last / ws, input.numel() / last);
        for row in 0..rows {
            // SAFETY: this row's column block lies inside every rank's input (the caller's
            // promise); the output row holds `cols` elements.
            unsafe {
                reduce::reduce(
                    input.dtype(),
                    op,
                    &at((row * last + rank * cols) * es),
                    &[out.data_ptr().add(row * cols * es)],
                    cols,
                    ws,
                )?
            };
        }
        return Ok(());
    }
    let per = input.numel() / ws;
    // SAFETY: slice `rank` lies inside every rank's input (the caller's promise); out has `per`.
    unsafe { reduce::reduce(input.dtype(), op, &at(rank * per * es), &[out.data_ptr()], per, ws) }
}

/// The pull path of [`reduce_scatter_out`], once the ranks entered: the slices (or, split
/// along the last dimension, whole inputs, shared by a host's ranks) fetched from other hosts,
/// this rank's slice reduced into `out`, then a barrier.
fn pulled(input: &Tensor, op: ReduceOp, split_last_dim: bool, out: &Tensor, h: &SymmHandle) -> Result<()> {
    let ws = h.world_size();
    let es = input.dtype().size();
    if split_last_dim {
        // Each row's column block lies apart from the next, and the ranks' blocks interleave:
        // the host fetches whole inputs once.
        fetch_shared(h, |_| (0, input.nbytes()))?;
    } else {
        let per = input.numel() / ws;
        fetch(h, |_| (h.rank() * per * es, per * es))?;
    }
    if split_last_dim {
        let last = *input.shape().last().unwrap_or(&1);
        let (cols, rows) = (last / ws, input.numel() / last);
        for row in 0..rows {
            let at = (row * last + h.rank() * cols) * es;
            // SAFETY: column block of this row in every rank's buffer, read-only between the
            // barriers; the output row holds `cols` elements.
            unsafe {
                reduce::reduce(input.dtype(), op, &peers(h, at), &[out.data_ptr().add(row * cols * es)], cols, ws)?
            };
        }
    } else {
        let per = input.numel() / ws;
        // SAFETY: slice r of every rank's buffer, read-only between the barriers; out has `per`.
        unsafe { reduce::reduce(input.dtype(), op, &peers(h, h.rank() * per * es), &[out.data_ptr()], per, ws)? };
    }
    barrier(h)
}

/// Reduces blocks of a 2-D symmetric `input` along `dim` (0: rows, 1: columns). Block i spans
/// `[offsets[i-1], offsets[i])` (`offsets` is the inclusive prefix sum; by default `ws` equal
/// blocks) and goes to rank `dst_ranks[i]` (default `i % ws`), which receives the reduction in
/// `out[j]`, j counting the blocks it owns. Every rank must own the same number of blocks, and
/// the j-th owned block must have the same size on every rank. `input` is left unmodified.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     // Blocks of 1, 1, 3 and 3 rows (offsets are inclusive prefix sums), dealt round-robin:
///     // each rank receives the sum of a 1-row block and of a 3-row block.
///     let x = symm::empty(&[8, 2], DType::F32, Device::Cpu)?;
///     x.fill(1.0f32)?;
///     let out = [Tensor::zeros(&[1, 2], DType::F32)?, Tensor::zeros(&[3, 2], DType::F32)?];
///     ops::reduce_scatter_offset(&x, &out, &group, 0, Some(&[1, 2, 5, 8]), None, ReduceOp::Sum)?;
///     assert_eq!(out[1].to_vec::<f32>()?, [2.0; 6]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn reduce_scatter_offset(
    input: &Tensor,
    out: &[Tensor],
    group: &Group,
    dim: usize,
    offsets: Option<&[usize]>,
    dst_ranks: Option<&[usize]>,
    op: ReduceOp,
) -> Result<()> {
    const OP: &str = "reduce_scatter_offset";
    let ws = group.world_size();
    let shape = input.shape();
    if shape.len() != 2 {
        return Err(bad(OP, "input must be 2-D"));
    }
    if dim > 1 {
        return Err(bad(OP, format!("dim must be 0 or 1, got {dim}")));
    }
    let extent = shape[dim];
    let default: Vec<usize>;
    let offsets = match offsets {
        Some(o) => o,
        None => {
            if !extent.is_multiple_of(ws) {
                return Err(bad(OP, format!("input.size({dim}) = {extent} is not divisible by world size {ws}")));
            }
            default = (1..=ws).map(|i| i * extent / ws).collect();
            &default
        }
    };
    let n = offsets.len();
    if n == 0 || offsets.windows(2).any(|w| w[1] < w[0]) || offsets[n - 1] > extent {
        return Err(bad(OP, format!("offsets exceed input size along dim {dim} (or decrease): {offsets:?}")));
    }
    let rr: Vec<usize> = (0..n).map(|i| i % ws).collect();
    let dst = dst_ranks.unwrap_or(&rr);
    if dst.len() != n || dst.iter().any(|&r| r >= ws) {
        return Err(bad(OP, "dst_ranks must name one rank of the group per block"));
    }
    let owned: Vec<Vec<usize>> = (0..ws).map(|r| (0..n).filter(|&i| dst[i] == r).collect()).collect();
    let n_owned = n / ws;
    if n % ws != 0 || owned.iter().any(|o| o.len() != n_owned) {
        return Err(bad(OP, format!("dst_ranks must distribute blocks evenly ({n} blocks, group_size={ws})")));
    }
    let size = |i: usize| offsets[i] - if i == 0 { 0 } else { offsets[i - 1] };
    for j in 0..n_owned {
        if owned.iter().any(|o| size(o[j]) != size(owned[0][j])) {
            return Err(bad(OP, format!("all output at position j={j} must have equal size across all ranks")));
        }
    }
    let me = group.rank();
    if out.len() != n_owned {
        return Err(bad(OP, format!("out.size() must be {n_owned}")));
    }
    for (j, &i) in owned[me].iter().enumerate() {
        let want = if dim == 0 { [size(i), shape[1]] } else { [shape[0], size(i)] };
        let o = &out[j];
        if o.shape() != want {
            return Err(bad(OP, format!("out[{j}] must have shape ({}, {})", want[0], want[1])));
        }
        if !o.is_contiguous() || o.dtype() != input.dtype() {
            return Err(bad(OP, format!("out[{j}] must be contiguous and have the same dtype as input")));
        }
    }
    let mut args = vec![dim as u64, op.code(), offsets.len() as u64];
    args.extend(offsets.iter().chain(dst).map(|&v| v as u64));
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    let es = input.dtype().size();
    let cols = shape[1];
    // Reduces the blocks this rank owns of every rank's input (`inputs[r]`: rank r's, of which
    // those blocks are there) into `out`, in rank order.
    let reduce_owned = |inputs: &[*const u8]| -> Result<()> {
        let at = |elem: usize| inputs.iter().map(|&p| p.wrapping_add(elem * es)).collect::<Vec<_>>();
        for (j, &i) in owned[me].iter().enumerate() {
            let start = if i == 0 { 0 } else { offsets[i - 1] };
            let len = size(i);
            let o = out[j].data_ptr();
            if dim == 0 {
                // SAFETY: rows [start, start+len) lie inside every rank's input, which the caller
                // keeps readable and unchanged for the call; out[j] holds len·cols elements.
                unsafe { reduce::reduce(input.dtype(), op, &at(start * cols), &[o], len * cols, ws)? };
            } else {
                for row in 0..shape[0] {
                    // SAFETY: as above, a column block of one row; out[j]'s row holds len elements.
                    unsafe {
                        reduce::reduce(input.dtype(), op, &at(row * cols + start), &[o.add(row * len * es)], len, ws)?
                    };
                }
            }
        }
        Ok(())
    };
    let span = |ranks: &[usize]| offset_span(input, dim, offsets, dst, ranks);
    // The pull path, once the ranks entered: of every rank's input on another host, the span
    // of this host's ranks' blocks, read by one rank of this host for all of them; reduced,
    // then a barrier.
    let pulled = || -> Result<()> {
        let outcome = fetch_shared(&h, |_| span(h.local_ranks())).and_then(|()| reduce_owned(&peers(&h, 0)));
        let b = barrier(&h);
        outcome.and(b)
    };
    // Pulled on one host; across hosts, as the all-gather ([`select_offset`]): each rank's
    // input travels once to each other host's leader, the span of that host's ranks' blocks of
    // it (host push; `inputs[r]` holds, for the length of the call, at least this host's span
    // of rank r's input, where it lies in the whole), or is read (pull).
    let push = Some(select_offset(input, dim, offsets, dst, &h) == Algo::HostPush);
    let travels = crate::ops::all_gather::Travels::Range(&span);
    crate::ops::all_gather::inputs_to_hosts(
        &[input],
        group,
        &h,
        OP,
        Some(op),
        &args,
        push,
        travels,
        reduce_owned,
        pulled,
    )
}

/// Where the blocks of [`reduce_scatter_offset`] (`offsets`, `dst`: given or defaulted) that the
/// ranks `ranks` own lie in a rank's `input`, in bytes (start, length): along rows (`dim` 0),
/// from the start of the first to the end of the last (blocks follow each other in index
/// order), nothing if they own none; along columns, every row holds a part of each block: the
/// whole input.
fn offset_span(input: &Tensor, dim: usize, offsets: &[usize], dst: &[usize], ranks: &[usize]) -> (usize, usize) {
    if dim != 0 {
        return (0, input.nbytes());
    }
    let row = input.shape().get(1).copied().unwrap_or(0) * input.dtype().size();
    let theirs = || (0..offsets.len().min(dst.len())).filter(|&i| ranks.contains(&dst[i]));
    match (theirs().next(), theirs().next_back()) {
        (Some(lo), Some(hi)) => {
            let start = if lo == 0 { 0 } else { offsets[lo - 1] };
            (start.saturating_mul(row), offsets[hi].saturating_sub(start).saturating_mul(row))
        }
        _ => (0, 0),
    }
}

/// The algorithm [`reduce_scatter_offset`] takes for `input` with blocks at `offsets` owned by
/// `dst` (both given in full: PyTorch's defaults are `offsets` `[k · extent / ranks]` for k in
/// 1..=ranks and `dst` round-robin) along `dim`, on the group of `h` (its handle): across
/// hosts, where no host's ranks' blocks span more of an input than their share (`ranks / world`
/// of it, along rows: the equal blocks a reduce-scatter takes, dealt in rank order), the
/// traffic of a reduce-scatter and its limits ([`select`]); otherwise the all-gather's, whose
/// inputs travel whole ([`crate::ops::all_gather::select`]). Pull on one host.
pub fn select_offset(input: &Tensor, dim: usize, offsets: &[usize], dst: &[usize], h: &SymmHandle) -> Algo {
    let hosts = if h.all_local() { 1 } else { 2 };
    let (bytes, rph, link, world) = (input.nbytes(), h.max_ranks_per_host(), h.link_backend(), h.world_size());
    let share = |ranks: &[usize]| bytes / world.max(1) * ranks.len();
    let spans_a_share =
        (0..h.hosts()).all(|k| offset_span(input, dim, offsets, dst, h.ranks_on(k)).1 <= share(h.ranks_on(k)));
    if spans_a_share {
        select(bytes, rph, hosts, link)
    } else {
        crate::ops::all_gather::select(bytes, rph, hosts, link)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisibility_counts_in_pytorchs_vector_width() {
        use crate::symm::{self, Device};
        use crate::tensor::{DType, Tensor};
        crate::group::run_threads(4, |g| {
            let t = symm::empty(&[256], DType::BF16, Device::Cpu)?;
            symm::rendezvous(&t, &g)?;
            // 48 bf16 from offset 0: 96 bytes, 16-byte vectors of 8 elements, 32 for 4 ranks.
            let out = Tensor::zeros(&[12], DType::BF16)?;
            let e = reduce_scatter_out(&t.narrow(0, 0, 48)?, ReduceOp::Sum, &g, false, &out).unwrap_err();
            assert!(e.to_string().contains("divisible by world_size * 8"), "{e}");
            let m = t.narrow(0, 0, 96)?.view(&[2, 48])?;
            let out = Tensor::zeros(&[2, 12], DType::BF16)?;
            let e = reduce_scatter_out(&m, ReduceOp::Sum, &g, true, &out).unwrap_err();
            assert!(e.to_string().contains("last dimension must be divisible by world_size * 8"), "{e}");
            // 64 elements: whole vectors on every rank.
            t.fill(half::bf16::from_f32(1.0))?;
            let out = Tensor::zeros(&[16], DType::BF16)?;
            reduce_scatter_out(&t.narrow(0, 0, 64)?, ReduceOp::Sum, &g, false, &out)?;
            assert_eq!(out.to_vec::<half::bf16>()?, vec![half::bf16::from_f32(4.0); 16]);
            // From 4 bytes in, vectors are 4 bytes: 40 elements are 5 vectors of 2 a rank.
            let out = Tensor::zeros(&[10], DType::BF16)?;
            reduce_scatter_out(&t.narrow(0, 2, 40)?, ReduceOp::Sum, &g, false, &out)?;
            assert_eq!(out.to_vec::<half::bf16>()?, vec![half::bf16::from_f32(4.0); 10]);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn a_hosts_span_runs_from_its_first_block_to_its_last() {
        // 12 rows of 40 bytes; blocks of 1, 1, 1, 1, 2, 2, 2, 2 rows, owners reversed.
        let input = Tensor::zeros(&[12, 10], crate::tensor::DType::F32).unwrap();
        let offsets = [1, 2, 3, 4, 6, 8, 10, 12];
        let dst = [3, 2, 1, 0, 3, 2, 1, 0];
        assert_eq!(offset_span(&input, 0, &offsets, &dst, &[0, 1]), (80, 400), "blocks 2, 3, 6, 7: rows 2..12");
        assert_eq!(offset_span(&input, 0, &offsets, &dst, &[2, 3]), (0, 320), "blocks 0, 1, 4, 5: rows 0..8");
        assert_eq!(offset_span(&input, 0, &offsets, &dst, &[3]), (0, 240), "blocks 0 and 4: rows 0..6");
        assert_eq!(offset_span(&input, 0, &offsets, &dst, &[]), (0, 0), "no ranks, nothing");
        assert_eq!(offset_span(&input, 1, &offsets, &dst, &[0]), (0, 480), "along columns, the whole input");
        // PyTorch's defaults: one equal block per rank, in rank order.
        let (offsets, dst) = ([3, 6, 9, 12], [0, 1, 2, 3]);
        assert_eq!(offset_span(&input, 0, &offsets, &dst, &[2, 3]), (240, 240), "its ranks' share");
    }

    #[test]
    fn host_push_stops_sooner_over_ucx_links() {
        let m = 1 << 20;
        assert_eq!(select(8, 2, 1, None), Algo::Pull, "one host always pulls");
        assert_eq!(select(0, 1, 2, Some("tcp")), Algo::Pull, "nothing to push");
        for link in [Some("tcp"), None] {
            assert_eq!(select(m, 2, 2, link), Algo::HostPush);
            assert_eq!(select(m + 16, 2, 2, link), Algo::Pull);
            assert_eq!(select(2 * m, 1, 2, link), Algo::HostPush);
            assert_eq!(select(2 * m + 16, 1, 2, link), Algo::Pull);
        }
        assert_eq!(select(m / 2, 2, 2, Some("ucx")), Algo::HostPush);
        assert_eq!(select(m / 2 + 16, 2, 2, Some("ucx")), Algo::Pull);
        assert_eq!(select(m / 2, 1, 2, Some("ucx")), Algo::HostPush);
        assert_eq!(select(m / 2 + 16, 1, 2, Some("ucx")), Algo::Pull, "past ucx's own limit");
        assert_eq!(select(m / 4 + 16, 4, 2, Some("ucx")), Algo::Pull, "past ucx's host limit");
    }
}
