//! Broadcast: every rank pulls the root's buffer between two barriers (across hosts, one rank
//! of each host reads it into its own tensor and the others copy it from there), or, across
//! hosts up to host push's limit, the root's buffer travels once to each other host's leader
//! (`all_gather::exchange_inputs` with only the root's input travelling) and every rank copies
//! it from its host's copy.

use crate::error::Result;
use crate::group::Group;
use crate::ops::all_gather::Algo;
use crate::ops::common::*;
use crate::ops::hostpush;
use crate::symm::SymmHandle;
use crate::tensor::Tensor;

/// The kind of the broadcast's host-push workspace.
const KIND: &str = "broadcast";

/// The one selection, from what every rank of the group knows alike: bytes broadcast, at most
/// `ranks_per_host` ranks on a host, `hosts` hosts (1 or more), and the links between hosts
/// (`link`, [`crate::symm::SymmHandle::link_backend`]): the all-gather's of the same input
/// ([`crate::ops::all_gather::select`]: host push across hosts within its limits, the workspace
/// holding a slot per rank, as the all-gather's), over links other than ucx up to
/// [`PUSH_MAX`] bytes; pull otherwise and on one host.
pub fn select(bytes: usize, ranks_per_host: usize, hosts: usize, link: Option<&str>) -> Algo {
    match crate::ops::all_gather::select(bytes, ranks_per_host, hosts, link) {
        Algo::HostPush if bytes <= PUSH_MAX || link == Some("ucx") => Algo::HostPush,
        _ => Algo::Pull,
    }
}

/// The algorithm [`broadcast_`] takes for `input` on the group of `h` (its handle): [`select`].
pub fn select_for(input: &Tensor, h: &SymmHandle) -> Algo {
    let hosts = if h.all_local() { 1 } else { 2 };
    select(input.nbytes(), h.max_ranks_per_host(), hosts, h.link_backend())
}

/// Across hosts over links other than ucx, broadcasts of more bytes than this are pulled,
/// even where the all-gather's limits would push them (hosts of one rank, up to 1 MiB): the
/// pull path reads the root's buffer straight into one tensor per host, where host push lands
/// it in the leader's workspace and copies it out. 2 ranks on 2 played hosts over tcp,
/// `bench/ab_builds.py 6`, host push against pull: 0.52x the time at 512 KiB, 1.35x at 1 MiB,
/// 1.45x at 2 MiB. (With 2 ranks a host, the all-gather's limits stop host push at 512 KiB
/// already.) Over ucx the two came out either way at 1 MiB (host push 1.60x [1.10, 1.97] the
/// time in one set of 6 paired runs, 0.82x [0.55, 1.46] in another of 12: UCX's reads over
/// its tcp transport took 170-180 us in some runs and 400-430 in others), so the all-gather's
/// limits stand there.
pub const PUSH_MAX: usize = 512 << 10;

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
        if select_for(input, &h) == Algo::HostPush {
            // Host push checks the ranks' arguments (the root's included) in its one exchange.
            let sig = host_sig(input, root, h.offset());
            let me = h.rank();
            return crate::ops::all_gather::exchange_inputs(
                &[input],
                group,
                &h,
                KIND,
                sig,
                crate::ops::all_gather::Travels::Root(root),
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

/// The pull path of [`broadcast_`], once the ranks entered. A root on this host (or every
/// rank on one host): every rank copies the root's buffer through its mapping. A root on
/// another host: one rank of each host (its leader) reads the root's buffer straight into its
/// own tensor, and after a barrier among the host's ranks the others copy it from there (the
/// leader's tensor, mapped). Then a barrier, so no root's or leader's buffer changes while
/// read. Reading into the host's mirror of the root and copying from it into every rank's
/// tensor cost a copy more per rank (2 ranks on 2 played hosts over tcp, 4 MiB: see
/// `docs/symm-mem-algorithms.md`).
fn pulled(input: &Tensor, root: usize, h: &SymmHandle) -> Result<()> {
    let (me, n) = (h.rank(), input.nbytes());
    if h.is_local(root) {
        if me != root {
            // SAFETY: root's buffer is not written between the barriers; ours is written only here.
            unsafe { std::ptr::copy_nonoverlapping(peers(h, 0)[root], input.data_ptr(), n) };
        }
        return barrier(h);
    }
    let locals = h.local_ranks();
    let leader = locals[0];
    let fetched = if me == leader {
        h.fetch_into(input, &|r| if r == root { (h.offset(), n, 0) } else { (0, 0, 0) }, timeout(), || {})
    } else {
        Ok(())
    };
    // The host's barrier happens even after a failure, so that no rank of the host waits in vain.
    let synced = if locals.len() > 1 { h.local_barrier(0, timeout()) } else { Ok(()) };
    fetched.and(synced)?;
    if me != leader {
        // SAFETY: the leader's tensor holds the root's n bytes (read before the host's barrier,
        // which orders them before this copy) and is not written before the barrier below;
        // ours, this rank's own, is written only here.
        unsafe { std::ptr::copy_nonoverlapping(peers(h, 0)[leader], input.data_ptr(), n) };
    }
    barrier(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_push_stops_at_its_own_limit_or_the_all_gathers() {
        let k = 1 << 10;
        assert_eq!(select(8, 1, 1, None), Algo::Pull, "one host always pulls");
        for link in [Some("tcp"), None] {
            // Hosts of one rank: the all-gather pushes up to 1 MiB, the broadcast up to 512 KiB.
            assert_eq!(select(512 * k, 1, 2, link), Algo::HostPush, "{link:?}");
            assert_eq!(select(512 * k + 16, 1, 2, link), Algo::Pull, "{link:?}");
            assert_eq!(select(1 << 20, 1, 2, link), Algo::Pull, "{link:?}");
        }
        // Over ucx, the all-gather's limits.
        assert_eq!(select(1 << 20, 1, 2, Some("ucx")), Algo::HostPush);
        assert_eq!(select((1 << 20) + 16, 1, 2, Some("ucx")), Algo::Pull);
        // Hosts of two ranks: the all-gather's limits, which count both ranks' inputs.
        assert_eq!(select(512 * k, 2, 2, Some("tcp")), Algo::HostPush);
        assert_eq!(select(256 * k, 2, 2, Some("ucx")), Algo::HostPush);
        assert_eq!(select(256 * k + 16, 2, 2, Some("ucx")), Algo::Pull);
    }

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
