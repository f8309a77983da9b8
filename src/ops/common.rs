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

use std::sync::Arc;
use std::time::Duration;

use super::check::{Stamp, enter};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::symm::{self, SymmHandle};
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
