//! Broadcast: every rank pulls the root's buffer between two barriers.

use crate::error::Result;
use crate::group::Group;
use crate::ops::common::*;
use crate::tensor::Tensor;

/// Broadcast in place: every rank's `input` becomes `root`'s.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = symm::empty(&[3], DType::F32, Device::Cpu)?;
///     x.fill(if group.rank() == 1 { 7.0f32 } else { 0.0 })?;
///     ops::broadcast_(&x, 1, &group)?; // rank 1's tensor, everywhere
///     assert_eq!(x.to_vec::<f32>()?, [7.0; 3]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn broadcast_(input: &Tensor, root: usize, group: &Group) -> Result<()> {
    const OP: &str = "broadcast";
    if root >= group.world_size() {
        return Err(bad(OP, format!("root {root} is not a rank of a group of {}", group.world_size())));
    }
    let Some(h) = prologue(OP, input, group, &[root as u64])? else { return Ok(()) };
    fetch_shared(&h, |r| if r == root { (0, input.nbytes()) } else { (0, 0) })?;
    if h.rank() != root {
        // SAFETY: root's buffer is not written between the barriers; ours is written only here.
        unsafe { std::ptr::copy_nonoverlapping(peers(&h, 0)[root], input.data_ptr(), input.nbytes()) };
    }
    barrier(&h)
}
