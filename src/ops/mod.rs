//! Operators on symmetric memory (`spec/symmetric-memory.md`), with PyTorch's names and
//! semantics and its algorithms (`reference/torch-symm-mem-internals.md` §3.1):
//!
//! - one-shot all-reduce: barrier; every rank reads every rank's buffer and reduces in rank
//!   order into its output; barrier (so nobody overwrites a buffer a peer still reads). Each
//!   rank reads `ws·n` bytes: best for small messages.
//! - two-shot all-reduce: barrier; rank r reduces slice r from every rank and pushes it to
//!   every rank (in place) or keeps it and everyone pulls (out of place); barrier. Each rank
//!   moves about `2·n` bytes: best for large messages. `reduce_scatter_out` is its first half.
//! - all-gather, broadcast and all-to-all pull from peers' buffers between two barriers.
//!
//! Reductions (sum, avg, min, max; PyTorch has only sum) run in rank order, so results are
//! bitwise identical on every rank; f16 and bf16 accumulate in f32. Arguments are checked before
//! any communication; the synchronization is the signal pads' barrier on channel 0, so every
//! operator is bounded by a timeout (`SYMMEM_OP_TIMEOUT`, 60 s by default) and names the rank it
//! waited for.
//!
//! Layer: uses `symm`, `tensor`, `group`.

mod a2av;
mod check;
mod matmul;
mod nd;
mod reduce;
mod small;
mod tile;
mod xhost;

use std::sync::Arc;
use std::time::Duration;

pub use a2av::{all_to_all_vdev, all_to_all_vdev_2d, all_to_all_vdev_2d_offset};
pub use matmul::{fused_all_gather_matmul, fused_matmul_reduce_scatter};
pub use nd::{all_to_all_nd, reduce_scatter_offset};
pub use reduce::ReduceOp;
pub use tile::{multi_root_tile_reduce, tile_reduce};

use crate::error::{Error, Result};
use crate::group::Group;
use crate::symm::{self, SymmHandle};
use crate::tensor::{DType, Tensor};

fn timeout() -> Duration {
    crate::config::op_timeout()
}

use check::{Stamp, enter};

/// Bytes that every offset and size must be a multiple of (PyTorch: `max(4, esize)`).
fn alignment(dtype: DType) -> usize {
    dtype.size().max(4)
}

#[cold]
fn bad(op: &str, msg: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("{op}: {msg}"))
}

/// Checks that `input` is a contiguous, aligned symmetric tensor and returns its handle.
fn symmetric(op: &str, input: &Tensor, group: &Group) -> Result<Arc<SymmHandle>> {
    if !symm::is_symm_mem_tensor(input) {
        return Err(bad(op, "input must be allocated with symm::empty (a symmetric tensor)"));
    }
    if !input.is_contiguous() {
        return Err(bad(op, "input must be contiguous"));
    }
    let a = alignment(input.dtype());
    let (_, offset) = symm::allocation_of(input).ok_or_else(|| bad(op, "input is not symmetric"))?;
    if offset % a != 0 {
        return Err(bad(op, format!("input ptr + offset must be at least {a}-byte aligned")));
    }
    if !input.nbytes().is_multiple_of(a) {
        return Err(bad(op, format!("input size must be at least {a}-byte aligned")));
    }
    symm::rendezvous(input, group)
}

fn same_shape(op: &str, input: &Tensor, out: &Tensor) -> Result<()> {
    if !out.is_contiguous() {
        return Err(bad(op, "output must be contiguous"));
    }
    if out.dtype() != input.dtype() {
        return Err(bad(op, format!("output is {} but input is {}", out.dtype(), input.dtype())));
    }
    if out.shape() != input.shape() {
        return Err(bad(op, format!("input/output size mismatch: {:?} vs {:?}", input.shape(), out.shape())));
    }
    Ok(())
}

/// Pointers to every rank's copy of a tensor, on the stack for up to 64 ranks: the operators'
/// hot path allocates nothing.
pub(crate) struct Peers {
    inline: [*const u8; 64],
    heap: Vec<*const u8>,
    len: usize,
}

impl std::ops::Deref for Peers {
    type Target = [*const u8];
    fn deref(&self) -> &[*const u8] {
        if self.len <= self.inline.len() { &self.inline[..self.len] } else { &self.heap }
    }
}

/// Every rank's copy of the tensor behind `h`, as raw pointers, plus `at` bytes.
fn peers(h: &SymmHandle, at: usize) -> Peers {
    let n = h.world_size();
    let mut p = Peers { inline: [std::ptr::null(); 64], heap: Vec::new(), len: n };
    let at = |r: usize| (h.read_ptr(r) + h.offset() + at) as *const u8;
    if n <= p.inline.len() {
        for (r, slot) in p.inline.iter_mut().enumerate().take(n) {
            *slot = at(r);
        }
    } else {
        p.heap = (0..n).map(at).collect();
    }
    p
}

fn barrier(h: &SymmHandle) -> Result<()> {
    h.barrier(0, timeout())
}

/// Makes the bytes `range(rank)` (offset from the tensor's start, length) of every rank on
/// another host readable through [`peers`]: one-sided reads into the host's mirror, all in
/// flight at once. Ranks of a host must fetch disjoint ranges (each reads what it alone
/// needs); a no-op when the group is on one host.
fn fetch(h: &SymmHandle, range: impl Fn(usize) -> (usize, usize)) -> Result<()> {
    let base = h.offset();
    h.fetch(
        &|r| {
            let (at, len) = range(r);
            (base + at, len)
        },
        timeout(),
    )
}

/// [`fetch`] for ranges that every rank of a host reads alike: the host's ranks share the
/// fetching out and then share the bytes (see [`SymmHandle::fetch_shared`]). Collective.
fn fetch_shared(h: &SymmHandle, range: impl Fn(usize) -> (usize, usize)) -> Result<()> {
    let base = h.offset();
    h.fetch_shared(
        &|r| {
            let (at, len) = range(r);
            (base + at, len)
        },
        timeout(),
    )
}

/// Out-of-place all-reduce of a symmetric tensor, reading every peer's copy (latency-optimal).
pub fn one_shot_all_reduce(input: &Tensor, op: ReduceOp, group: &Group) -> Result<Tensor> {
    let out = Tensor::zeros(input.shape(), input.dtype())?;
    one_shot_all_reduce_out(input, op, group, &out)?;
    Ok(out)
}

/// [`one_shot_all_reduce`] into `out` (any contiguous tensor of the same shape and dtype).
pub fn one_shot_all_reduce_out(input: &Tensor, op: ReduceOp, group: &Group, out: &Tensor) -> Result<()> {
    const OP: &str = "one_shot_all_reduce";
    same_shape(OP, input, out)?;
    if input.dtype() == DType::Bool {
        return Err(bad(OP, "bool tensors cannot be reduced"));
    }
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[op.code()]))?;
    fetch_shared(&h, |_| (0, input.nbytes()))?;
    // SAFETY: between the barriers no rank writes its input (the operator's contract), every
    // peer pointer addresses numel elements inside that peer's mapped buffer or its mirror
    // (rendezvous checked the shapes), and `out` is a contiguous tensor of numel elements.
    unsafe { reduce::reduce(input.dtype(), op, &peers(&h, 0), &[out.data_ptr()], input.numel(), h.world_size())? };
    barrier(&h)
}

/// The slice of `n` elements rank `r` of `ws` owns in the two-shot algorithms: equal, aligned
/// slices; the last ones may be short or empty.
fn slice(n: usize, ws: usize, r: usize, per_align: usize) -> (usize, usize) {
    let per = n.div_ceil(ws).div_ceil(per_align) * per_align;
    let start = (r * per).min(n);
    (start, ((r + 1) * per).min(n) - start)
}

/// In-place all-reduce of a symmetric tensor: every rank reduces one slice and pushes it to all
/// (bandwidth-optimal).
pub fn two_shot_all_reduce_(input: &Tensor, op: ReduceOp, group: &Group) -> Result<()> {
    const OP: &str = "two_shot_all_reduce_";
    if input.dtype() == DType::Bool {
        return Err(bad(OP, "bool tensors cannot be reduced"));
    }
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    let (es, ws) = (input.dtype().size(), h.world_size());
    let (start, len) = slice(input.numel(), ws, h.rank(), alignment(input.dtype()) / es);
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[op.code()]))?;
    fetch(&h, |_| (start * es, len * es))?;
    let srcs = peers(&h, start * es);
    let mut inline = [std::ptr::null_mut::<u8>(); 64];
    let heap: Vec<*mut u8>;
    let dsts: &[*mut u8] = if ws <= inline.len() {
        for (d, s) in inline.iter_mut().zip(srcs.iter()) {
            *d = s.cast_mut();
        }
        &inline[..ws]
    } else {
        heap = srcs.iter().map(|&p| p.cast_mut()).collect();
        &heap
    };
    // SAFETY: slice [start, start+len) of every rank's buffer is read and written by this rank
    // only, between the barriers; the pointers address mapped buffers (checked shapes).
    unsafe { reduce::reduce(input.dtype(), op, &srcs, dsts, len, ws)? };
    // Ranks on other hosts get the reduced slice by a write from this rank's buffer (the
    // reduction above only filled their mirrors).
    if !h.all_local() {
        let at = h.offset() + start * es;
        h.push(&h.remote_ranks(), at, len * es, at, timeout())?;
    }
    barrier(&h)
}

/// Out-of-place two-shot all-reduce into `out`. Like PyTorch's, it also leaves this rank's
/// reduced slice in `input`.
pub fn two_shot_all_reduce_out(input: &Tensor, op: ReduceOp, group: &Group, out: &Tensor) -> Result<()> {
    const OP: &str = "two_shot_all_reduce_out";
    same_shape(OP, input, out)?;
    if input.dtype() == DType::Bool {
        return Err(bad(OP, "bool tensors cannot be reduced"));
    }
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    let (es, ws) = (input.dtype().size(), h.world_size());
    let per_align = alignment(input.dtype()) / es;
    let (start, len) = slice(input.numel(), ws, h.rank(), per_align);
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[op.code()]))?;
    fetch(&h, |_| (start * es, len * es))?;
    let own = (h.read_ptr(h.rank()) + h.offset() + start * es) as *mut u8;
    // SAFETY: as in two_shot_all_reduce_; this rank writes only its own slice of its own buffer.
    unsafe { reduce::reduce(input.dtype(), op, &peers(&h, start * es), &[own], len, ws)? };
    barrier(&h)?;
    fetch_shared(&h, |r| {
        let (s, l) = slice(input.numel(), ws, r, per_align);
        (s * es, l * es)
    })?;
    for k in 0..ws {
        let r = (h.rank() + k) % ws;
        let (s, l) = slice(input.numel(), ws, r, per_align);
        // SAFETY: rank r's reduced slice is final (second barrier) and nobody writes it until
        // the third; `out` holds numel elements.
        unsafe { std::ptr::copy_nonoverlapping(peers(&h, s * es)[r], out.data_ptr().add(s * es), l * es) };
    }
    barrier(&h)
}

/// Reduce-scatter: rank r's `out` receives slice r of the reduction. Without
/// `split_last_dim`, `input` and `out` are 1-D and slice r is the r-th 1/ws of `input`; with
/// it, slice r is the r-th block of columns of the last dimension.
pub fn reduce_scatter_out(
    input: &Tensor,
    op: ReduceOp,
    group: &Group,
    split_last_dim: bool,
    out: &Tensor,
) -> Result<()> {
    const OP: &str = "reduce_scatter_out";
    if input.dtype() == DType::Bool {
        return Err(bad(OP, "bool tensors cannot be reduced"));
    }
    if out.dtype() != input.dtype() || !out.is_contiguous() {
        return Err(bad(OP, "output must be a contiguous tensor of the input's dtype"));
    }
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
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    let es = input.dtype().size();
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[op.code(), u64::from(split_last_dim)]))?;
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

/// All-gather: `out` (shape `[ws · d0, ...]`) receives every rank's `input` in rank order.
pub fn all_gather_into(input: &Tensor, group: &Group, out: &Tensor) -> Result<()> {
    const OP: &str = "all_gather";
    let ws = group.world_size();
    let (is, os) = (input.shape(), out.shape());
    if is.is_empty()
        || os.len() != is.len()
        || os[0] != is[0] * ws
        || os[1..] != is[1..]
        || out.dtype() != input.dtype()
    {
        return Err(bad(OP, format!("output must be {} x the input's first dimension ({is:?} -> {os:?})", ws)));
    }
    if !out.is_contiguous() {
        return Err(bad(OP, "output must be contiguous"));
    }
    let h = symmetric(OP, input, group)?;
    let n = input.nbytes();
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[]))?;
    fetch_shared(&h, |_| (0, n))?;
    let ptrs = peers(&h, 0);
    for k in 0..ws {
        let r = (h.rank() + k) % ws;
        // SAFETY: rank r's input is not written between the barriers; out has ws·n bytes.
        unsafe { std::ptr::copy_nonoverlapping(ptrs[r], out.data_ptr().add(r * n), n) };
    }
    barrier(&h)
}

/// Broadcast in place: every rank's `input` becomes `root`'s.
pub fn broadcast_(input: &Tensor, root: usize, group: &Group) -> Result<()> {
    const OP: &str = "broadcast";
    if root >= group.world_size() {
        return Err(bad(OP, format!("root {root} is not a rank of a group of {}", group.world_size())));
    }
    let h = symmetric(OP, input, group)?;
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[root as u64]))?;
    fetch_shared(&h, |r| if r == root { (0, input.nbytes()) } else { (0, 0) })?;
    if h.rank() != root {
        // SAFETY: root's buffer is not written between the barriers; ours is written only here.
        unsafe { std::ptr::copy_nonoverlapping(peers(&h, 0)[root], input.data_ptr(), input.nbytes()) };
    }
    barrier(&h)
}

/// Equal-split all-to-all: `input` and `out` have the same shape, the first dimension divisible
/// by the world size; block j of rank i's `out` is block i of rank j's `input`.
pub fn all_to_all(input: &Tensor, out: &Tensor, group: &Group) -> Result<()> {
    const OP: &str = "all_to_all";
    same_shape(OP, input, out)?;
    let ws = group.world_size();
    if input.shape().first().is_none_or(|d| d % ws != 0) {
        return Err(bad(
            OP,
            format!("the first dimension {:?} must be divisible by world size {ws}", input.shape().first()),
        ));
    }
    let h = symmetric(OP, input, group)?;
    let block = input.nbytes() / ws;
    if !h.all_local() && input.nbytes() <= ALL_TO_ALL_PUSH_MAX {
        return xhost::all_to_all(input, out, group, &h, timeout());
    }
    enter(group, &h, &Stamp::new(OP, input, h.offset(), &[]))?;
    fetch(&h, |_| (h.rank() * block, block))?;
    for k in 0..ws {
        let j = (h.rank() + k) % ws;
        let src = peers(&h, h.rank() * block)[j];
        // SAFETY: inputs are not written between the barriers; out has ws blocks.
        unsafe { std::ptr::copy_nonoverlapping(src, out.data_ptr().add(j * block), block) };
    }
    barrier(&h)
}

/// Across hosts, [`all_to_all`] inputs up to this size (per rank) go hierarchically, one
/// message per pair of hosts through the hosts' leaders (`"host_push"`); larger ones are
/// pulled by every rank (`"pull"`), which spreads the copying over every rank and flow.
pub const ALL_TO_ALL_PUSH_MAX: usize = 512 << 10;

/// The largest message [`all_reduce`] ever sends one-shot (when ranks outnumber cores).
pub const ONE_SHOT_MAX: usize = 8 * 1024;

/// The algorithm [`all_reduce`] uses for `bytes` on `world_size` ranks: `"one_shot"` up to
/// 1 KiB, or up to 8 KiB when ranks outnumber cores (then every extra synchronization costs a
/// context switch), `"two_shot"` above. Measured crossovers on 2 cores: 2 ranks ~1 KiB, 4 ranks
/// ~8 KiB.
pub fn all_reduce_algo(bytes: usize, world_size: usize) -> &'static str {
    let max = if world_size > crate::topo::cores() { ONE_SHOT_MAX } else { 1024 };
    if bytes <= max { "one_shot" } else { "two_shot" }
}

/// The algorithm [`all_reduce`] uses for `bytes` on a group spanning hosts with at most
/// `ranks_per_host` ranks on a host: `"host_push"` (each host's inputs in one message to every
/// other host, one one-way trip) while a host's inputs fit in 256 KiB, `"two_shot"` above.
pub fn all_reduce_algo_across_hosts(bytes: usize, ranks_per_host: usize) -> &'static str {
    if xhost::fits_size(bytes, ranks_per_host) { "host_push" } else { "two_shot" }
}

/// In-place all-reduce of a symmetric tensor, picking the algorithm by size
/// ([`all_reduce_algo`]): small messages go one-shot through a double-buffered workspace with a
/// single synchronization per call; larger ones two-shot. Across hosts
/// ([`all_reduce_algo_across_hosts`]), hosts exchange their inputs in one message each up to a
/// few hundred KiB, two-shot above; results are bitwise those of one host.
pub fn all_reduce(tensor: &Tensor, op: ReduceOp, group: &Group) -> Result<()> {
    const OP: &str = "all_reduce";
    if tensor.dtype() == DType::Bool {
        return Err(bad(OP, "bool tensors cannot be reduced"));
    }
    // The checks of `symmetric` but its alignment ones: the small paths copy through their own
    // workspaces, so any size goes.
    if !symm::is_symm_mem_tensor(tensor) {
        return Err(bad(OP, "input must be allocated with symm::empty (a symmetric tensor)"));
    }
    if !tensor.is_contiguous() {
        return Err(bad(OP, "input must be contiguous"));
    }
    if tensor.numel() == 0 {
        return Ok(());
    }
    let bytes = tensor.nbytes();
    let h = symm::rendezvous(tensor, group)?;
    if !h.all_local() {
        // Across hosts: up to a few hundred KiB, each host's inputs travel to every other host
        // in one trip.
        if xhost::fits(&h, bytes) {
            return xhost::all_reduce(tensor, op, group, timeout());
        }
        return two_shot_all_reduce_(tensor, op, group);
    }
    if all_reduce_algo(bytes, group.world_size()) == "two_shot" {
        return two_shot_all_reduce_(tensor, op, group);
    }
    small::all_reduce(tensor, op, group, timeout())
}

/// Operators that need GPU hardware: they answer with what they need.
pub fn multimem_all_reduce_(_input: &Tensor, _op: ReduceOp, _group: &Group) -> Result<()> {
    Err(unsupported("multimem_all_reduce_", "NVLink SHARP multicast (multimem) on CUDA devices"))
}

/// See [`multimem_all_reduce_`].
pub fn multimem_all_gather_out(_input: &Tensor, _group: &Group, _out: &Tensor) -> Result<()> {
    Err(unsupported("multimem_all_gather_out", "NVLink SHARP multicast (multimem) on CUDA devices"))
}

/// See [`multimem_all_reduce_`].
pub fn multimem_one_shot_all_reduce(_input: &Tensor, _op: ReduceOp, _group: &Group) -> Result<Tensor> {
    Err(unsupported("multimem_one_shot_all_reduce", "NVLink SHARP multicast (multimem) on CUDA devices"))
}

/// See [`multimem_all_reduce_`].
pub fn multimem_one_shot_reduce_out(
    _input: &Tensor,
    _op: ReduceOp,
    _root: usize,
    _group: &Group,
    _out: &Tensor,
) -> Result<()> {
    Err(unsupported("multimem_one_shot_reduce_out", "NVLink SHARP multicast (multimem) on CUDA devices"))
}

/// See [`multimem_all_reduce_`].
pub fn memset32_(_input: &Tensor, _offset: usize, _value: u32, _count: usize) -> Result<()> {
    Err(unsupported("memset32_", "a CUDA stream"))
}

/// See [`multimem_all_reduce_`].
pub fn memcpy_to_multicast_(_out: &Tensor, _src: &Tensor, _byte_offset: usize, _group: &Group) -> Result<()> {
    Err(unsupported("memcpy_to_multicast_", "a multicast object (CUDA, NVLink SHARP)"))
}

/// See [`multimem_all_reduce_`].
pub fn stream_write_value32_(_input: &Tensor, _offset: usize, _value: u32) -> Result<()> {
    Err(unsupported("stream_write_value32_", "a CUDA stream"))
}

/// See [`multimem_all_reduce_`].
pub fn fused_all_gather_scaled_matmul() -> Result<()> {
    Err(unsupported("fused_all_gather_scaled_matmul", "FP8 tensor cores (CUDA)"))
}

/// See [`multimem_all_reduce_`].
pub fn fused_scaled_matmul_reduce_scatter() -> Result<()> {
    Err(unsupported("fused_scaled_matmul_reduce_scatter", "FP8 tensor cores (CUDA)"))
}

#[cold]
fn unsupported(what: &str, needs: &str) -> Error {
    Error::Unsupported { what: what.into(), needs: needs.into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_everything_once() {
        for n in [0, 1, 7, 64, 1000, 1001] {
            for ws in 1..=8 {
                let mut covered = 0;
                for r in 0..ws {
                    let (s, l) = slice(n, ws, r, 4);
                    assert_eq!(s, covered.min(n));
                    covered = s + l;
                }
                assert_eq!(covered, n);
            }
        }
    }
}
