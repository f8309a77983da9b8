//! All-gather: every rank pulls every rank's input between two barriers (the fused
//! all-gather-matmul is in `matmul.rs`).

use crate::error::Result;
use crate::group::Group;
use crate::ops::common::*;
use crate::tensor::Tensor;

/// All-gather: `out` (shape `[ws · d0, ...]`) receives every rank's `input` in rank order.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = symm::empty(&[2], DType::I32, Device::Cpu)?;
///     x.fill(group.rank() as i32)?;
///     let out = Tensor::zeros(&[4], DType::I32)?;
///     ops::all_gather_into(&x, &group, &out)?;
///     assert_eq!(out.to_vec::<i32>()?, [0, 0, 1, 1]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
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
    disjoint(OP, input, out)?;
    let Some(h) = prologue(OP, input, group, &[])? else { return Ok(()) };
    let n = input.nbytes();
    fetch_shared(&h, |_| (0, n))?;
    let ptrs = peers(&h, 0);
    for k in 0..ws {
        let r = (h.rank() + k) % ws;
        // SAFETY: rank r's input is not written between the barriers; out has ws·n bytes.
        unsafe { std::ptr::copy_nonoverlapping(ptrs[r], out.data_ptr().add(r * n), n) };
    }
    barrier(&h)
}
