//! All-to-all: equal splits ([`all_to_all`], pulled, or host-pushed across hosts), n-d
//! ([`all_to_all_nd`], `docs/symm-mem-algorithms.md` §6), and the variable-split
//! family of `vdev.rs` (`docs/symm-mem-algorithms.md` §5; host-pushed across hosts by
//! `push.rs`).

mod host_push;
mod push;
mod vdev;

pub use vdev::{
    VDEV_CARRY_MAX, VDEV_PUSH_MAX, all_to_all_vdev, all_to_all_vdev_2d, all_to_all_vdev_2d_offset, select_v,
};

use crate::error::Result;
use crate::group::Group;
use crate::ops::all_gather::Travels;
use crate::ops::common::*;
use crate::ops::hostpush;
use crate::symm::SymmHandle;
use crate::tensor::Tensor;

/// The algorithms of [`all_to_all`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// Every rank pulls its blocks from every rank.
    Pull,
    /// Across hosts: each rank's blocks for another host in one message to its leader.
    HostPush,
    /// Across hosts, the all-to-all-v family with a symmetric `out`: after one exchange of the
    /// splits, each rank writes its rows straight into the other ranks' `out`s.
    Write,
}

impl Algo {
    /// Its name, as benchmarks report it.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Pull => "pull",
            Algo::HostPush => "host_push",
            Algo::Write => "write",
        }
    }
}

/// The one selection: host-push across hosts up to [`ALL_TO_ALL_PUSH_MAX`] bytes per rank
/// ([`UCX_ALL_TO_ALL_PUSH_MAX`] when the links between hosts are ucx, `link` being
/// [`crate::symm::SymmHandle::link_backend`], the same on every rank), pull otherwise.
pub fn select(bytes: usize, hosts: usize, link: Option<&str>) -> Algo {
    let max = if link == Some("ucx") { UCX_ALL_TO_ALL_PUSH_MAX } else { ALL_TO_ALL_PUSH_MAX };
    if hosts > 1 && bytes <= max { Algo::HostPush } else { Algo::Pull }
}

/// Across hosts, [`all_to_all`] inputs up to this size (per rank) go hierarchically, one
/// message per pair of hosts through the hosts' leaders (`"host_push"`); larger ones are
/// pulled by every rank (`"pull"`: each reads its blocks from the other hosts' ranks straight
/// into its `out` and copies its own host's while they travel), which spreads the copying
/// over every rank and flow.
pub const ALL_TO_ALL_PUSH_MAX: usize = 1 << 20;

/// [`ALL_TO_ALL_PUSH_MAX`] over ucx links, whose large messages go by rendezvous: measured on 2
/// played hosts, 4 ranks, 3 alternated rounds, pulling took 744-819 us at 1 MiB where pushing
/// took 1067-1097 (over tcp, pushing still led: 568-614 vs 620-737), and pushing led at
/// 512 KiB (400/439/569 vs 494/531/513 us).
pub const UCX_ALL_TO_ALL_PUSH_MAX: usize = 512 << 10;

/// Equal-split all-to-all: `input` and `out` have the same shape, the first dimension divisible
/// by the world size, and share no byte (in place is refused); block j of rank i's `out` is
/// block i of rank j's `input`.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let r = group.rank() as i32;
///     let x = symm::empty(&[4], DType::I32, Device::Cpu)?;
///     x.copy_from_slice(&[10 * r, 10 * r + 1, 10 * r + 2, 10 * r + 3])?;
///     let out = Tensor::zeros(&[4], DType::I32)?;
///     ops::all_to_all(&x, &out, &group)?; // block j of my out is block `rank` of peer j's input
///     let want = if r == 0 { [0, 1, 10, 11] } else { [2, 3, 12, 13] };
///     assert_eq!(out.to_vec::<i32>()?, want);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn all_to_all(input: &Tensor, out: &Tensor, group: &Group) -> Result<()> {
    const OP: &str = "all_to_all";
    same_shape(OP, input, out)?;
    disjoint(OP, input, out)?;
    let ws = group.world_size();
    if input.shape().first().is_none_or(|d| d % ws != 0) {
        return Err(bad(
            OP,
            format!("the first dimension {:?} must be divisible by world size {ws}", input.shape().first()),
        ));
    }
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    if h.all_local() {
        return pulled(input, out, group, &h);
    }
    // Across hosts, ranks that took different algorithms (sizes on either side of a limit) or
    // left a call at different points are out of step: refused from then on.
    hostpush::guarded(group, OP, || {
        if select(input.nbytes(), 2, h.link_backend()) == Algo::HostPush {
            // Host push checks the ranks' arguments itself, in its one exchange (no entry barrier).
            return host_push::all_to_all(input, out, group, &h, timeout());
        }
        pulled(input, out, group, &h)
    })
}

/// The pull path of [`all_to_all`]: every rank reads its blocks from every rank.
fn pulled(input: &Tensor, out: &Tensor, group: &Group, h: &SymmHandle) -> Result<()> {
    const OP: &str = "all_to_all";
    let (ws, block) = (group.world_size(), input.nbytes() / group.world_size());
    if h.all_local() {
        enter_on(OP, input, group, h, &[])?;
    } else {
        // Across hosts, an entry that meets host push's calls: a rank whose size is on the
        // other side of its limit disagrees at once.
        host_push::meet(input, group, h, timeout())?;
    }
    // Blocks of ranks on other hosts are read straight into `out`; those of this host's ranks
    // are copied while the reads travel.
    let me = h.rank();
    let copy_local = || {
        let from = peers(h, me * block);
        for j in (0..ws).map(|k| (me + k) % ws).filter(|&j| h.is_local(j)) {
            let src = from[j];
            // SAFETY: inputs are not written between the barriers; out has ws blocks, and does
            // not overlap the input (checked); remote reads land in other blocks.
            unsafe { std::ptr::copy_nonoverlapping(src, out.data_ptr().add(j * block), block) };
        }
    };
    h.fetch_into(out, &|r| (h.offset() + me * block, block, r * block), timeout(), copy_local)?;
    barrier(h)
}

/// All-to-all between dimensions of a symmetric input with `G = world size` blocks:
/// - `(scatter_dim 1, gather_dim 0)`: input `[rows, G·lc]` (or `[rows, G, lc]`), out
///   `[G, rows, lc]` (or `[G·rows, lc]`); `out[j]` is peer j's column block r (r = this rank);
/// - `(scatter_dim 0, gather_dim 1)`: input `[G·lr, cols]` (or `[G, lr, cols]`), out
///   `[lr, G, cols]` (or `[lr, G·cols]`); `out[:, j, :]` is peer j's row block r.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     // Scatter columns, gather rows: input [rows 1, 2 ranks x 2 columns], out [2, 1, 2].
///     let r = group.rank() as f32;
///     let x = symm::empty(&[1, 4], DType::F32, Device::Cpu)?;
///     x.copy_from_slice(&[r, r, r + 10.0, r + 10.0])?;
///     let out = Tensor::zeros(&[2, 1, 2], DType::F32)?;
///     ops::all_to_all_nd(&x, &out, 1, 0, &group)?;
///     let want = if r == 0.0 { [0.0, 0.0, 1.0, 1.0] } else { [10.0, 10.0, 11.0, 11.0] };
///     assert_eq!(out.to_vec::<f32>()?, want);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn all_to_all_nd(input: &Tensor, out: &Tensor, scatter_dim: usize, gather_dim: usize, group: &Group) -> Result<()> {
    const OP: &str = "all_to_all_nd";
    let g = group.world_size();
    if !out.is_contiguous() || out.dtype() != input.dtype() || out.numel() != input.numel() {
        return Err(bad(OP, "out must be contiguous, with the input's dtype and number of elements"));
    }
    disjoint(OP, input, out)?;
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
    let args = [scatter_dim as u64, gather_dim as u64];
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    let (me, es) = (h.rank(), input.dtype().size());
    // Copies this rank's block of every rank's input (`inputs[r]`: rank r's; of another host's
    // rank, scattered along rows, only this rank's row block need be there) into `out`.
    let copy_blocks = |inputs: &[*const u8]| -> Result<()> {
        let peer = |r: usize, elem: usize| inputs[r].wrapping_add(elem * es);
        for k in 0..g {
            let j = (me + k) % g;
            if (scatter_dim, gather_dim) == (1, 0) {
                let lc = cols / g;
                for row in 0..rows {
                    // SAFETY: peer j's row, column block `me`, inside its input (readable and
                    // unchanged for the call, the caller's promise); out block j, row `row` holds
                    // lc elements.
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
        Ok(())
    };
    // Scattered along rows, rank r reads row block r of every input, which lies whole in one
    // place (`slice` bytes at r·slice); along columns, every row holds a block of each rank's.
    let by_rows = scatter_dim == 0;
    let slice = input.nbytes() / g;
    // The pull path, once the ranks entered (inputs are not written between the barriers):
    // along rows, this rank's row block of every input on another host; along columns, every
    // rank's whole input, read by one rank of each host for its host.
    let pulled = || -> Result<()> {
        if by_rows {
            fetch(&h, |_| (me * slice, slice))?;
        } else {
            fetch_shared(&h, |_| (0, input.nbytes()))?;
        }
        copy_blocks(&peers(&h, 0))?;
        barrier(&h)
    };
    // Pulled on one host; across hosts, as the all-gather, by host push or pull
    // ([`select_nd_for`]). Along rows, each other host gets only its ranks' row blocks
    // (`inputs[r]`, for the length of the call, holds at least this rank's row block of rank
    // r's input, where it lies in the whole input); along columns every input travels whole.
    let push = Some(select_nd_for(input, scatter_dim, &h) == crate::ops::all_gather::Algo::HostPush);
    let theirs = crate::ops::all_gather::slices_of(slice);
    let travels = if by_rows { Travels::Range(&theirs) } else { Travels::All };
    crate::ops::all_gather::inputs_to_hosts(&[input], group, &h, OP, None, &args, push, travels, copy_blocks, pulled)
}

/// The algorithm [`all_to_all_nd`] takes across hosts for `input` (`h`: its handle): scattered
/// along rows (`scatter_dim` 0), each rank reads its row block of every input, the traffic of a
/// reduce-scatter split along the first dimension, whose limits it takes
/// ([`crate::ops::reduce_scatter::select`]); along columns every input travels whole, within
/// the all-gather's ([`crate::ops::all_gather::select`]). Pull on one host.
pub fn select_nd_for(input: &Tensor, scatter_dim: usize, h: &SymmHandle) -> crate::ops::all_gather::Algo {
    let hosts = if h.all_local() { 1 } else { 2 };
    let (bytes, rph, link) = (input.nbytes(), h.max_ranks_per_host(), h.link_backend());
    if scatter_dim == 0 {
        crate::ops::reduce_scatter::select(bytes, rph, hosts, link)
    } else {
        crate::ops::all_gather::select(bytes, rph, hosts, link)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_push_stops_sooner_over_ucx_links() {
        let k = 1 << 10;
        assert_eq!(select(1 << 20, 1, None), Algo::Pull, "one host always pulls");
        for (bytes, tcp, ucx) in [
            (16, Algo::HostPush, Algo::HostPush),
            (512 * k, Algo::HostPush, Algo::HostPush),
            (512 * k + 16, Algo::HostPush, Algo::Pull),
            (1 << 20, Algo::HostPush, Algo::Pull),
            ((1 << 20) + 16, Algo::Pull, Algo::Pull),
        ] {
            assert_eq!(select(bytes, 2, Some("tcp")), tcp, "{bytes} bytes over tcp");
            assert_eq!(select(bytes, 2, None), tcp, "{bytes} bytes over mixed links");
            assert_eq!(select(bytes, 2, Some("ucx")), ucx, "{bytes} bytes over ucx");
        }
    }
}
