//! `reduce_scatter_offset` and `all_to_all_nd` (`reference/torch-symm-mem-internals.md` §3.5,
//! §3.6): block reductions and exchanges of 2-D symmetric inputs, pulled from the peers between
//! two barriers.

use super::check::{Stamp, enter};
use super::reduce::{self, ReduceOp};
use super::{bad, barrier, fetch_shared, symmetric};
use crate::error::Result;
use crate::group::Group;
use crate::tensor::Tensor;

/// Reduces blocks of a 2-D symmetric `input` along `dim` (0: rows, 1: columns). Block i spans
/// `[offsets[i-1], offsets[i])` (`offsets` is the inclusive prefix sum; by default `ws` equal
/// blocks) and goes to rank `dst_ranks[i]` (default `i % ws`), which receives the reduction in
/// `out[j]`, j counting the blocks it owns. Every rank must own the same number of blocks, and
/// the j-th owned block must have the same size on every rank. `input` is left unmodified.
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
    let h = symmetric(OP, input, group)?;
    let mut args = vec![dim as u64, op.code(), offsets.len() as u64];
    args.extend(offsets.iter().chain(dst).map(|&v| v as u64));
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &args))?;
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

/// All-to-all between dimensions of a symmetric input with `G = world size` blocks:
/// - `(scatter_dim 1, gather_dim 0)`: input `[rows, G·lc]` (or `[rows, G, lc]`), out
///   `[G, rows, lc]` (or `[G·rows, lc]`); `out[j]` is peer j's column block r (r = this rank);
/// - `(scatter_dim 0, gather_dim 1)`: input `[G·lr, cols]` (or `[G, lr, cols]`), out
///   `[lr, G, cols]` (or `[lr, G·cols]`); `out[:, j, :]` is peer j's row block r.
pub fn all_to_all_nd(input: &Tensor, out: &Tensor, scatter_dim: usize, gather_dim: usize, group: &Group) -> Result<()> {
    const OP: &str = "all_to_all_nd";
    let g = group.world_size();
    if !out.is_contiguous() || out.dtype() != input.dtype() || out.numel() != input.numel() {
        return Err(bad(OP, "out must be contiguous, with the input's dtype and number of elements"));
    }
    let (is, os) = (input.shape(), out.shape());
    // Both pairs are a [G-blocked] 2-D view of the input: rows × cols.
    let (rows, cols) = match is.len() {
        2 => (is[0], is[1]),
        3 if (scatter_dim, gather_dim) == (1, 0) && is[1] == g => (is[0], is[1] * is[2]),
        3 if (scatter_dim, gather_dim) == (0, 1) && is[0] == g => (is[0] * is[1], is[2]),
        _ => {
            return Err(bad(
                OP,
                format!("input shape {is:?} does not fit scatter_dim={scatter_dim}, gather_dim={gather_dim}"),
            ));
        }
    };
    let expected: (Vec<usize>, Vec<usize>) = match (scatter_dim, gather_dim) {
        (1, 0) => {
            if !cols.is_multiple_of(g) {
                return Err(bad(OP, format!("input columns {cols} are not divisible by world size {g}")));
            }
            let lc = cols / g;
            (vec![g, rows, lc], vec![g * rows, lc])
        }
        (0, 1) => {
            if !rows.is_multiple_of(g) {
                return Err(bad(OP, format!("input rows {rows} are not divisible by world size {g}")));
            }
            let lr = rows / g;
            (vec![lr, g, cols], vec![lr, g * cols])
        }
        _ => return Err(bad(OP, "supported (scatter_dim, gather_dim) pairs are (1, 0) and (0, 1)")),
    };
    if os != expected.0.as_slice() && os != expected.1.as_slice() {
        return Err(bad(OP, format!("out shape {os:?}; expected {:?} or {:?}", expected.0, expected.1)));
    }
    let h = symmetric(OP, input, group)?;
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[scatter_dim as u64, gather_dim as u64]))?;
    fetch_shared(&h, |_| (0, input.nbytes()))?;
    let (me, es) = (h.rank(), input.dtype().size());
    let peer = |r: usize, elem: usize| (h.read_ptr(r) + h.offset() + elem * es) as *const u8;
    for k in 0..g {
        let j = (me + k) % g;
        if (scatter_dim, gather_dim) == (1, 0) {
            let lc = cols / g;
            for row in 0..rows {
                // SAFETY: peer j's row, column block `me`, inside its input (not written between
                // the barriers); out block j, row `row` holds lc elements.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        peer(j, row * cols + me * lc),
                        out.data_ptr().add((j * rows + row) * lc * es),
                        lc * es,
                    )
                };
            }
        } else {
            let lr = rows / g;
            for row in 0..lr {
                // SAFETY: peer j's row me·lr + row inside its input; out[row, j, :] holds cols.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        peer(j, (me * lr + row) * cols),
                        out.data_ptr().add((row * g + j) * cols * es),
                        cols * es,
                    )
                };
            }
        }
    }
    barrier(&h)
}
