//! Broadcast: every rank pulls the root's buffer between two barriers, or, across hosts up to
//! host push's limit, the root's buffer travels once to each other host's leader
//! (`all_gather::exchange_inputs` with only the root's input travelling) and
//! every rank copies it from its host's copy.

use crate::error::Result;
use crate::group::Group;
use crate::ops::common::*;
use crate::ops::hostpush;
use crate::symm::SymmHandle;
use crate::tensor::Tensor;

/// The kind of the broadcast's host-push workspace.
const KIND: &str = "broadcast";

/// The algorithm [`broadcast_`] takes for `input` on the group of `h` (its handle): the
/// all-gather's of the same input ([`crate::ops::all_gather::select_for`]), host push across
/// hosts within its limits (the workspace holds a slot per rank, as the all-gather's), pull
/// otherwise and on one host.
pub fn select_for(input: &Tensor, h: &SymmHandle) -> crate::ops::all_gather::Algo {
    crate::ops::all_gather::select_for(input, h)
}

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
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    if h.all_local() {
        enter_on(OP, input, group, &h, &[root as u64])?;
        return pulled(input, root, &h);
    }
    // Across hosts, ranks that took different algorithms (sizes on either side of the limit)
    // or left a call at different points are out of step: refused from then on.
    hostpush::guarded(group, KIND, || {
        if select_for(input, &h) == crate::ops::all_gather::Algo::HostPush {
            // Host push checks the ranks' arguments (the root's included) in its one exchange.
            let sig = host_sig(input, root, h.offset());
            let me = h.rank();
            return crate::ops::all_gather::exchange_inputs(
                &[input],
                group,
                &h,
                KIND,
                sig,
                Some(root),
                timeout(),
                || {},
                |inputs| {
                    if me != root {
                        // SAFETY: `inputs[root]` holds the root's whole input for the length of
                        // the call (`exchange_inputs`), in the root's slot, its tensor (a root on
                        // this host, from 64 KiB) or its host's copy, never this rank's tensor; the
                        // input is contiguous, its n bytes ours.
                        unsafe {
                            std::ptr::copy_nonoverlapping(inputs[root], input.data_ptr(), input.nbytes());
                        }
                    }
                    Ok(())
                },
            );
        }
        crate::ops::all_gather::meet(input, group, &h, KIND, None, &[root as u64])?;
        pulled(input, root, &h)
    })
}

/// The signature of a host-push broadcast: [`crate::ops::check::counts_at`] with the root
/// folded into the offset's digest (the first word's upper bits), so ranks that name
/// different roots disagree, as they do on one host.
fn host_sig(input: &Tensor, root: usize, offset: usize) -> [u64; 2] {
    let [n, code] = crate::ops::check::counts_at(input, None, offset);
    let r = (root as u64).wrapping_add(1).wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 40;
    [n ^ r << 40, code]
}

/// The pull path of [`broadcast_`], once the ranks entered: the root's buffer read (on another
/// host, by one rank of each host for its host), copied, then a barrier.
fn pulled(input: &Tensor, root: usize, h: &SymmHandle) -> Result<()> {
    fetch_shared(h, |r| if r == root { (0, input.nbytes()) } else { (0, 0) })?;
    if h.rank() != root {
        // SAFETY: root's buffer is not written between the barriers; ours is written only here.
        unsafe { std::ptr::copy_nonoverlapping(peers(h, 0)[root], input.data_ptr(), input.nbytes()) };
    }
    barrier(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_changes_the_signature_but_not_its_count() {
        let t = Tensor::zeros(&[6], crate::tensor::DType::F32).unwrap();
        let (a, b) = (host_sig(&t, 0, 64), host_sig(&t, 1, 64));
        assert_ne!(a, b, "ranks naming different roots must disagree");
        assert_eq!(a[0] & crate::ops::check::COUNT_BITS, 6);
        assert_eq!(b[0] & crate::ops::check::COUNT_BITS, 6);
        assert_eq!(a[1], b[1], "the dtype word leaves the gathering logic's bits alone");
        assert_eq!(a[1] >> 16, 0, "a host-push signature is never stamped");
    }
}
