//! Tile reductions on strided 2-D views of symmetric tensors
//! (`docs/symm-mem-algorithms.md` §6): only the root's `out_tile` receives the
//! reduction of every rank's tile; the other ranks contribute and synchronize.
//!
//! On one host, the root reads every rank's tile where it lies, between two barriers. Across
//! hosts, while its workspace stays within [`WORKSPACE_MAX`] ([`select`]), the all-gather's
//! exchange (`all_gather::inputs_to_hosts`): every rank's tiles, packed row by row, reach the
//! hosts of their roots (every host where leaders gather them, up to 16 KiB a rank), with the
//! ranks' arguments in the signature, and each root reduces its tile from them in rank order
//! with the same kernel (bitwise the single host's); above, the same entry as the other
//! operators (meeting host push's calls), then the single host's reads.

use super::all_gather::Algo;
use super::common::{bad, barrier, fetch};
use super::reduce::{self, ReduceOp};
use crate::error::Result;
use crate::group::Group;
use crate::symm::{self, SymmHandle};
use crate::tensor::Tensor;

/// The largest workspace the tile reductions' host push makes across hosts: both parities of a
/// slot per rank, each holding a rank's packed tiles. Above it they pull, where the root reads
/// each rank's buffer from its tile's first row to its last, the columns beside the tile
/// included. Host push against pull (2 played hosts, paired runs, `symmem bench tile-reduce`
/// and `multi-root-tile-reduce`, tiles of 256 columns): `tile_reduce` over tcp 0.49-0.70x the
/// time from 256 KiB to 4 MiB with 4 ranks, 0.29-0.72x with 2; over ucx 0.51-0.67x and
/// 0.53-0.82x; `multi_root_tile_reduce` (every rank a root) over tcp 0.25-0.51x from 64 KiB to
/// 4 MiB a tile with 4 ranks, 0.40-0.64x with 2; over ucx 0.34-0.46x and 0.64-0.79x.
pub const WORKSPACE_MAX: usize = 32 << 20;

/// The algorithm a tile reduction takes for `packed` bytes of tiles per rank (the sum of a
/// rank's tiles) on `world` ranks over `hosts` hosts: host push across hosts while its
/// workspace fits [`WORKSPACE_MAX`], pull otherwise and on one host.
pub fn select(packed: usize, world: usize, hosts: usize) -> Algo {
    // As the workspace rounds a slot: to a power of two.
    let slot = packed.checked_next_multiple_of(16).and_then(usize::checked_next_power_of_two);
    let workspace = slot.and_then(|s| s.checked_mul(world.saturating_mul(2)));
    if hosts > 1 && packed > 0 && workspace.is_some_and(|b| b <= WORKSPACE_MAX) { Algo::HostPush } else { Algo::Pull }
}

fn check_tile(op: &str, t: &Tensor, out: &Tensor) -> Result<()> {
    if t.shape().len() != 2 || out.shape().len() != 2 {
        return Err(bad(op, "tiles must be 2-D"));
    }
    if t.shape() != out.shape() || t.dtype() != out.dtype() {
        return Err(bad(
            op,
            format!("in_tile {:?} {} and out_tile {:?} {} differ", t.shape(), t.dtype(), out.shape(), out.dtype()),
        ));
    }
    if t.strides()[1] != 1 || out.strides()[1] != 1 {
        return Err(bad(op, "tile rows must be contiguous (stride 1 in the last dimension)"));
    }
    if !symm::is_symm_mem_tensor(t) {
        return Err(bad(op, "in_tile must be a view of a symmetric tensor"));
    }
    Ok(())
}

/// Reduces every rank's tile behind `h` into `out`, row by row.
fn reduce_tile(h: &SymmHandle, t: &Tensor, out: &Tensor, op: ReduceOp) -> Result<()> {
    let (rows, cols) = (t.shape()[0], t.shape()[1]);
    let es = t.dtype().size();
    if rows > 0 {
        fetch(h, |_| (0, ((rows - 1) * t.strides()[0] + cols) * es))?;
    }
    for r in 0..rows {
        let at = r * t.strides()[0] * es;
        let srcs: Vec<*const u8> =
            (0..h.world_size()).map(|p| (h.read_ptr(p) + h.offset() + at) as *const u8).collect();
        // SAFETY: row r of every rank's tile lies in its mapped buffer (same view on every
        // rank: rendezvous checked the allocation; the view was checked at creation), tiles are
        // not written between the barriers, and out's row r holds `cols` elements.
        unsafe {
            reduce::reduce(
                t.dtype(),
                op,
                &srcs,
                &[out.data_ptr().add(r * out.strides()[0] * es)],
                cols,
                h.world_size(),
            )?
        };
    }
    Ok(())
}

/// Reduces tile `part` of every rank's packed tiles (`inputs[r]`: rank r's, tiles of `t`'s shape
/// back to back, each row by row) into `out`, row by row, in rank order.
fn reduce_packed(inputs: &[*const u8], part: usize, t: &Tensor, out: &Tensor, op: ReduceOp) -> Result<()> {
    let (rows, cols) = (t.shape()[0], t.shape()[1]);
    let es = t.dtype().size();
    for r in 0..rows {
        let at = (part * rows + r) * cols * es;
        let srcs: Vec<*const u8> = inputs.iter().map(|&p| p.wrapping_add(at)).collect();
        // SAFETY: every rank's packed tiles hold at least part + 1 tiles of rows x cols elements,
        // of which tile `part` (the root's, what travels to its host) stays readable and
        // unchanged for the length of the call (`all_gather::exchange_inputs`); out's row r
        // holds `cols` elements.
        unsafe {
            reduce::reduce(t.dtype(), op, &srcs, &[out.data_ptr().add(r * out.strides()[0] * es)], cols, inputs.len())?
        };
    }
    Ok(())
}

/// Reduces every rank's `in_tile` (a strided 2-D view of a symmetric tensor, the same view on
/// every rank) into `root`'s `out_tile`.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let full = symm::empty(&[4, 4], DType::F32, Device::Cpu)?;
///     full.fill(group.rank() as f32 + 1.0)?;
///     let quadrant = full.tile(2..4, 2..4)?; // a strided view of the symmetric tensor
///     let out = Tensor::zeros(&[2, 2], DType::F32)?;
///     ops::tile_reduce(&quadrant, &out, 0, &group, ReduceOp::Sum)?;
///     let want = if group.rank() == 0 { 3.0 } else { 0.0 }; // only the root receives it
///     assert_eq!(out.to_vec::<f32>()?, [want; 4]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn tile_reduce(in_tile: &Tensor, out_tile: &Tensor, root: usize, group: &Group, op: ReduceOp) -> Result<()> {
    const OP: &str = "tile_reduce";
    check_tile(OP, in_tile, out_tile)?;
    if root >= group.world_size() {
        return Err(bad(OP, format!("root must be smaller than group size ({root} >= {})", group.world_size())));
    }
    let h = symm::rendezvous(in_tile, group)?;
    let args = [root as u64, op.code()];
    let me = h.rank();
    let pulled = || {
        let outcome = if me == root { reduce_tile(&h, in_tile, out_tile, op) } else { Ok(()) };
        let b = barrier(&h);
        outcome.and(b)
    };
    let finish =
        |inputs: &[*const u8]| if me == root { reduce_packed(inputs, 0, in_tile, out_tile, op) } else { Ok(()) };
    // Only the root reads the tiles: they go to its host alone (where leaders gather their
    // hosts' tiles, to every host, whole).
    let to_root = |ranks: &[usize]| if ranks.contains(&root) { (0, usize::MAX) } else { (0, 0) };
    let travels = crate::ops::all_gather::Travels::Range(&to_root);
    let hosts = if h.all_local() { 1 } else { 2 };
    let push = Some(select(in_tile.numel() * in_tile.dtype().size(), group.world_size(), hosts) == Algo::HostPush);
    crate::ops::all_gather::inputs_to_hosts(&[in_tile], group, &h, OP, Some(op), &args, push, travels, finish, pulled)
}

/// Several tile reductions at once: tile i is reduced into the `out_tile` of rank `roots[i]`;
/// each rank is a root at most once.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let full = symm::empty(&[2, 4], DType::F32, Device::Cpu)?;
///     full.fill(1.0f32)?;
///     // The left half is reduced into rank 0's out, the right half into rank 1's.
///     let tiles = [full.tile(0..2, 0..2)?, full.tile(0..2, 2..4)?];
///     let out = Tensor::zeros(&[2, 2], DType::F32)?;
///     ops::multi_root_tile_reduce(&tiles, &out, &[0, 1], &group, ReduceOp::Sum)?;
///     assert_eq!(out.to_vec::<f32>()?, [2.0; 4]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn multi_root_tile_reduce(
    in_tiles: &[Tensor],
    out_tile: &Tensor,
    roots: &[usize],
    group: &Group,
    op: ReduceOp,
) -> Result<()> {
    const OP: &str = "multi_root_tile_reduce";
    if roots.len() != in_tiles.len() {
        return Err(bad(OP, "Number of roots must match number of tiles"));
    }
    let ws = group.world_size();
    let mut seen = vec![false; ws];
    for &r in roots {
        if r >= ws {
            return Err(bad(OP, format!("Invalid root {r}")));
        }
        if std::mem::replace(&mut seen[r], true) {
            return Err(bad(OP, "Each rank can only be a root once"));
        }
    }
    for t in in_tiles {
        check_tile(OP, t, out_tile)?;
    }
    let handles = in_tiles.iter().map(|t| symm::rendezvous(t, group)).collect::<Result<Vec<_>>>()?;
    let Some(first) = handles.first() else { return Ok(()) };
    // Every tile's view and root count, not only the first's.
    let mut args: Vec<u64> = vec![op.code()];
    for ((t, hh), &r) in in_tiles.iter().zip(&handles).zip(roots) {
        args.extend([r as u64, hh.offset() as u64]);
        args.extend(t.shape().iter().chain(t.strides()).map(|&d| d as u64));
    }
    let mine = roots.iter().position(|&r| r == first.rank());
    let pulled = || {
        let outcome = match mine {
            Some(i) => reduce_tile(&handles[i], &in_tiles[i], out_tile, op),
            None => Ok(()),
        };
        let b = barrier(first);
        outcome.and(b)
    };
    // Across hosts the tiles travel packed one after another, each root taking its own: a host
    // gets the tiles from the first to the last whose root is one of its ranks, none if no
    // root is (where leaders gather their hosts' tiles, every tile to every host).
    let parts: Vec<&Tensor> = in_tiles.iter().collect();
    let tile_bytes = out_tile.numel() * out_tile.dtype().size();
    let to_roots = |ranks: &[usize]| {
        let theirs = || roots.iter().enumerate().filter(|(_, r)| ranks.contains(r)).map(|(i, _)| i);
        match (theirs().min(), theirs().max()) {
            (Some(lo), Some(hi)) => (lo.saturating_mul(tile_bytes), (hi + 1 - lo).saturating_mul(tile_bytes)),
            _ => (0, 0),
        }
    };
    let finish = |inputs: &[*const u8]| match mine {
        Some(i) => reduce_packed(inputs, i, &in_tiles[i], out_tile, op),
        None => Ok(()),
    };
    let travels = crate::ops::all_gather::Travels::Range(&to_roots);
    let hosts = if first.all_local() { 1 } else { 2 };
    let push = Some(select(tile_bytes.saturating_mul(in_tiles.len()), group.world_size(), hosts) == Algo::HostPush);
    crate::ops::all_gather::inputs_to_hosts(&parts, group, first, OP, Some(op), &args, push, travels, finish, pulled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_push_while_the_workspace_fits() {
        let m = 1 << 20;
        assert_eq!(select(m, 4, 1), Algo::Pull, "one host always pulls");
        assert_eq!(select(0, 4, 2), Algo::Pull, "nothing to push");
        assert_eq!(select(4 * m, 4, 2), Algo::HostPush, "2 parities x 4 slots of 4 MiB: 32 MiB");
        assert_eq!(select(4 * m + 16, 4, 2), Algo::Pull, "slots round to 8 MiB");
        assert_eq!(select(3 * m, 4, 2), Algo::HostPush, "slots round to 4 MiB");
        assert_eq!(select(8 * m, 2, 2), Algo::HostPush);
        assert_eq!(select(m, 32, 2), Algo::Pull, "64 MiB with 32 ranks");
        assert_eq!(select(usize::MAX - 3, 2, 2), Algo::Pull, "never wraps");
    }
}
