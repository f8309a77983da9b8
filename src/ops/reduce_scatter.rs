//! Reduce-scatter: `reduce_scatter_out` (the first half of the two-shot all-reduce) and
//! `reduce_scatter_offset` (`docs/symm-mem-algorithms.md` §6: blocks of a 2-D input
//! reduced to their owners), pulled from the peers between two barriers.

use crate::error::Result;
use crate::group::Group;
use crate::ops::common::*;
use crate::ops::reduce::{self, ReduceOp};
use crate::tensor::Tensor;

/// Reduce-scatter: rank r's `out` receives slice r of the reduction. Without
/// `split_last_dim`, `input` and `out` are 1-D and slice r is the r-th 1/ws of `input`; with
/// it, slice r is the r-th block of columns of the last dimension.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = symm::empty(&[4], DType::F32, Device::Cpu)?;
///     x.copy_from_slice(&[1.0f32, 2.0, 3.0, 4.0])?;
///     let out = Tensor::zeros(&[2], DType::F32)?; // slice `rank` of the sum
///     ops::reduce_scatter_out(&x, ReduceOp::Sum, &group, false, &out)?;
///     let want = if group.rank() == 0 { [2.0, 4.0] } else { [6.0, 8.0] };
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
    const OP: &str = "reduce_scatter_out";
    reducible(OP, input)?;
    if out.dtype() != input.dtype() || !out.is_contiguous() {
        return Err(bad(OP, "output must be a contiguous tensor of the input's dtype"));
    }
    disjoint(OP, input, out)?;
    let ws = group.world_size();
    let per_align = alignment(input.dtype()) / input.dtype().size();
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
    let Some(h) = prologue(OP, input, group, &[op.code(), u64::from(split_last_dim)])? else { return Ok(()) };
    let es = input.dtype().size();
    if split_last_dim {
        // Each row's column block lies apart from the next, and the ranks' blocks interleave:
        // the host fetches whole inputs once.
        fetch_shared(&h, |_| (0, input.nbytes()))?;
    } else {
        let per = input.numel() / ws;
        fetch(&h, |_| (h.rank() * per * es, per * es))?;
    }
    if split_last_dim {
        let last = *input.shape().last().unwrap_or(&1);
        let (cols, rows) = (last / ws, input.numel() / last);
        for row in 0..rows {
            let at = (row * last + h.rank() * cols) * es;
            // SAFETY: column block of this row in every rank's buffer, read-only between the
            // barriers; the output row holds `cols` elements.
            unsafe {
                reduce::reduce(input.dtype(), op, &peers(&h, at), &[out.data_ptr().add(row * cols * es)], cols, ws)?
            };
        }
    } else {
        let per = input.numel() / ws;
        // SAFETY: slice r of every rank's buffer, read-only between the barriers; out has `per`.
        unsafe { reduce::reduce(input.dtype(), op, &peers(&h, h.rank() * per * es), &[out.data_ptr()], per, ws)? };
    }
    barrier(&h)
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
    let Some(h) = prologue(OP, input, group, &args)? else { return Ok(()) };
    let es = input.dtype().size();
    let cols = shape[1];
    let peer = |r: usize, elem: usize| (h.read_ptr(r) + h.offset() + elem * es) as *const u8;
    let outcome = (|| {
        // Ranks on other hosts: fetch their whole input (the blocks this rank owns may be
        // anywhere in it).
        fetch_shared(&h, |_| (0, input.nbytes()))?;
        for (j, &i) in owned[me].iter().enumerate() {
            let start = if i == 0 { 0 } else { offsets[i - 1] };
            let len = size(i);
            let o = out[j].data_ptr();
            if dim == 0 {
                let srcs: Vec<*const u8> = (0..ws).map(|r| peer(r, start * cols)).collect();
                // SAFETY: rows [start, start+len) of every rank's input, not written between the
                // barriers; out[j] holds len·cols elements.
                unsafe { reduce::reduce(input.dtype(), op, &srcs, &[o], len * cols, ws)? };
            } else {
                for row in 0..shape[0] {
                    let srcs: Vec<*const u8> = (0..ws).map(|r| peer(r, row * cols + start)).collect();
                    // SAFETY: as above, column block of one row; out[j]'s row holds len elements.
                    unsafe { reduce::reduce(input.dtype(), op, &srcs, &[o.add(row * len * es)], len, ws)? };
                }
            }
        }
        Ok(())
    })();
    let b = barrier(&h);
    outcome.and(b)
}
