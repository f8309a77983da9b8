//! What every operator shares, written once: its prologue (the argument checks, the
//! rendezvous of its input, the checked entry), every rank's copy of the input as pointers,
//! the one-sided fetches that bring other hosts' bytes close, and the closing barrier.
//!
//! ```text
//!   prologue(op, input, group, args)   symmetric + contiguous + aligned input, its handle,
//!                                      then check::enter (every rank called the same op alike)
//!   peers(h, at) / fetch / fetch_shared   where each rank's bytes are, after fetching those
//!                                      of other hosts into the host's mirrors
//!   barrier(h)                         the epilogue: nobody reuses what a peer still reads
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::check::{Stamp, enter};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::symm::{self, Device, SymmHandle};
use crate::tensor::{DType, Tensor};

pub(crate) fn timeout() -> Duration {
    crate::config::op_timeout()
}

/// Bytes that every offset and size must be a multiple of (PyTorch: `max(4, esize)`).
pub(crate) fn alignment(dtype: DType) -> usize {
    dtype.size().max(4)
}

#[cold]
pub(crate) fn bad(op: &str, msg: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("{op}: {msg}"))
}

/// Checks that `input` is a contiguous, aligned symmetric tensor and returns its handle.
pub(crate) fn symmetric(op: &str, input: &Tensor, group: &Group) -> Result<Arc<SymmHandle>> {
    check_symmetric(op, input)?;
    symm::rendezvous(input, group)
}

/// PyTorch's vector alignment of a symmetric `input` (`get_and_verify_alignment`): 16, 8 or 4
/// bytes, the largest that divides both its byte offset in its allocation and its size, and at
/// least [`alignment`] (which [`check_symmetric`] checked). PyTorch's kernels move that many
/// bytes at a time, and their divisibility checks count in it; symmem's kernels need only
/// [`alignment`], but refuse what PyTorch refuses.
pub(crate) fn vector_alignment(input: &Tensor) -> usize {
    let offset = symm::allocation_of(input).map_or(0, |(_, o)| o);
    let both = offset | input.nbytes();
    [16, 8, 4].into_iter().find(|a| both.is_multiple_of(*a)).unwrap_or(4).max(alignment(input.dtype()))
}

/// The checks of [`symmetric`], for a caller that already holds the handle.
pub(crate) fn check_symmetric(op: &str, input: &Tensor) -> Result<()> {
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
    Ok(())
}

/// The prologue of an operator on a symmetric `input`: its checks and handle
/// ([`symmetric`]), then the checked entry (`args`: the operator's own arguments that every
/// rank must pass alike). `None` for an empty input, which every rank has alike (rendezvous
/// checked the shapes): there is nothing to do.
pub(crate) fn prologue(
    op: &'static str,
    input: &Tensor,
    group: &Group,
    args: &[u64],
) -> Result<Option<Arc<SymmHandle>>> {
    let h = symmetric(op, input, group)?;
    if input.numel() == 0 {
        return Ok(None);
    }
    enter_on(op, input, group, &h, args)?;
    Ok(Some(h))
}

/// The operators' symmetric workspace of a group: a matmul's partial products, or an ordinary
/// input copied in ([`stage`]). One operator of a group uses it at a time (a group's operators
/// are called by one thread, in the same order on every rank), and every operator that uses it
/// ends with a barrier, so no peer still reads it when the next one writes it.
struct Workspace {
    tensor: Tensor,
    handle: Arc<SymmHandle>,
}

/// The group's workspace, kept in the group (so it goes with it).
#[derive(Default)]
struct WorkspaceState(Mutex<Option<Workspace>>);

/// The group's workspace (`u8`), grown to at least `bytes`, and its handle. Collective when it
/// grows: every rank must ask for the same sizes in the same order (callers agree first).
pub(crate) fn workspace(group: &Group, bytes: usize) -> Result<(Tensor, Arc<SymmHandle>)> {
    let state = group.state::<WorkspaceState>();
    let mut slot = state.0.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(w) = &*slot
        && w.tensor.nbytes() >= bytes
    {
        return Ok((w.tensor.clone(), w.handle.clone()));
    }
    // Collective: every rank grows its workspace at the same call (the sizes are symmetric).
    let tensor = symm::empty(&[bytes.max(1).next_power_of_two()], DType::U8, Device::Cpu)?;
    let handle = symm::rendezvous(&tensor, group)?;
    *slot = Some(Workspace { tensor: tensor.clone(), handle: handle.clone() });
    Ok((tensor, handle))
}

/// An ordinary (not symmetric) `input` of operator `op`, copied into the group's workspace: a
/// contiguous symmetric tensor of the same shape and dtype at the workspace's start, as
/// PyTorch's operators copy an ordinary input into their symmetric workspace. Collective: the
/// ranks first agree on the call (`op`, the input's shape and dtype, `args`), since the
/// workspace may grow.
pub(crate) fn stage(op: &str, input: &Tensor, group: &Group, args: &[u64]) -> Result<Tensor> {
    // The staged copy's layout, whatever the input's strides: ranks may lay theirs out
    // differently.
    let strides = crate::tensor::contiguous_strides(input.shape());
    super::check::agree(group, &Stamp::of(op, input.dtype(), input.shape(), &strides, 0, args))?;
    let (ws, _) = workspace(group, input.nbytes())?;
    let staged = ws.reinterpret(input.dtype(), input.shape(), &strides, 0)?;
    staged.copy_from(input)?;
    Ok(staged)
}

/// The checked entry of [`prologue`] on a non-empty `input` whose checks and handle the caller
/// already has.
pub(crate) fn enter_on(op: &'static str, input: &Tensor, group: &Group, h: &SymmHandle, args: &[u64]) -> Result<()> {
    enter(group, h, &Stamp::new(op, input, h.offset(), args))
}

/// Refuses a reduction of booleans.
pub(crate) fn reducible(op: &str, input: &Tensor) -> Result<()> {
    if input.dtype() == DType::Bool {
        return Err(bad(op, "bool tensors cannot be reduced"));
    }
    Ok(())
}

/// `out` must share no byte with `input`: peers still read a rank's input while it writes its
/// out, so an in-place call would hand them half-written blocks.
pub(crate) fn disjoint(op: &str, input: &Tensor, out: &Tensor) -> Result<()> {
    let (i, o) = (input.data_ptr() as usize, out.data_ptr() as usize);
    if input.nbytes() > 0 && out.nbytes() > 0 && i < o + out.nbytes() && o < i + input.nbytes() {
        return Err(bad(
            op,
            "out overlaps the input (in-place is not supported: peers read the input while out is written)",
        ));
    }
    Ok(())
}

pub(crate) fn same_shape(op: &str, input: &Tensor, out: &Tensor) -> Result<()> {
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
pub(crate) fn peers(h: &SymmHandle, at: usize) -> Peers {
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

pub(crate) fn barrier(h: &SymmHandle) -> Result<()> {
    h.barrier(0, timeout())
}

/// Makes the bytes `range(rank)` (offset from the tensor's start, length) of every rank on
/// another host readable through [`peers`]: one-sided reads into the host's mirror, all in
/// flight at once. Ranks of a host must fetch disjoint ranges (each reads what it alone
/// needs); a no-op when the group is on one host.
pub(crate) fn fetch(h: &SymmHandle, range: impl Fn(usize) -> (usize, usize)) -> Result<()> {
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
pub(crate) fn fetch_shared(h: &SymmHandle, range: impl Fn(usize) -> (usize, usize)) -> Result<()> {
    let base = h.offset();
    h.fetch_shared(
        &|r| {
            let (at, len) = range(r);
            (base + at, len)
        },
        timeout(),
    )
}

/// The slice of `n` elements rank `r` of `ws` owns in the two-shot algorithms: equal, aligned
/// slices; the last ones may be short or empty.
pub(crate) fn slice(n: usize, ws: usize, r: usize, per_align: usize) -> (usize, usize) {
    let per = n.div_ceil(ws).div_ceil(per_align) * per_align;
    let start = (r * per).min(n);
    (start, ((r + 1) * per).min(n) - start)
}

#[cold]
pub(crate) fn unsupported(what: &str, needs: &str) -> Error {
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
