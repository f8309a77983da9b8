//! All-gather: every rank pulls every rank's input between two barriers, or across hosts
//! host-pushed (`host_push.rs`) up to a limit (the fused all-gather-matmul is in `matmul.rs`).

mod host_push;

pub(crate) use host_push::{Travels, exchange_inputs, inputs_to_hosts, meet, slices_of};

use crate::error::Result;
use crate::group::Group;
use crate::ops::common::*;
use crate::ops::hostpush;
use crate::symm::SymmHandle;
use crate::tensor::Tensor;

/// The algorithms of [`all_gather_into`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// Every rank reads every rank's input (across hosts, each host's ranks share the reads of
    /// the other hosts' inputs), between two barriers.
    Pull,
    /// Across hosts: each rank's input in one message to each other host's leader (gathered
    /// by its leader when small), copied out by every rank of that host after one exchange.
    HostPush,
}

impl Algo {
    /// Its name, as benchmarks report it.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Pull => "pull",
            Algo::HostPush => "host_push",
        }
    }
}

/// The one selection: across hosts host push while a host's inputs (`bytes` per rank, at most
/// `ranks_per_host` ranks on a host) fit the limit host push has for the all-reduce over links
/// of backend `link` ([`crate::symm::SymmHandle::link_backend`], the same on every rank), pull
/// otherwise and on one host. The same crossovers held (2 played hosts, 4 alternated runs of
/// each at each gathered size): over tcp, 4 ranks, host push 0.63x pull's time at 512 KiB,
/// 0.71x at 1 MiB, 0.93x at 2 MiB, 1.19x at 4 MiB; 2 ranks 0.67x at 1 MiB, 0.82x at 2 MiB,
/// 1.14x at 4 MiB; over ucx, 4 ranks 0.61x at 256 KiB, 0.88x at 1 MiB, a tie from 2 MiB; 2
/// ranks 0.56x at 1 MiB, 0.84x at 2 MiB, 1.42x at 4 MiB.
/// Operators whose every rank needs every rank's whole input (the one-shot all-reduce, the fused
/// all-gather-matmul, ...) take it too; the all-gather itself takes [`select_all_gather`].
pub fn select(bytes: usize, ranks_per_host: usize, hosts: usize, link: Option<&str>) -> Algo {
    if hosts > 1 && hostpush::fits_size(bytes, ranks_per_host, link) { Algo::HostPush } else { Algo::Pull }
}

/// Over ucx links, [`all_gather_into`] takes host push while a host's inputs are at most this
/// many bytes ([`UCX_LONE_MAX`] on hosts of one rank), past [`select`]'s limits there: host push
/// against pull (2 played hosts, `UCX_TLS=tcp`, 6 alternated rounds, gathered sizes), 4 ranks
/// 0.79x the time at 2 MiB, 0.78x at 4 MiB, 0.81x at 8 MiB (a host's inputs of 1, 2 and 4
/// MiB); 2 ranks 0.87x at 4 MiB, 1.41x [0.92, 1.45] at 8 MiB (no difference shown).
pub const UCX_HOST_MAX: usize = 4 << 20;

/// See [`UCX_HOST_MAX`].
pub const UCX_LONE_MAX: usize = 2 << 20;

/// The all-gather's own selection: over ucx links host push while a host's inputs (`bytes` per
/// rank, at most `ranks_per_host` ranks on a host) fit [`UCX_HOST_MAX`] ([`UCX_LONE_MAX`] on
/// hosts of one rank); over other links [`select`]'s. Pull on one host.
pub fn select_all_gather(bytes: usize, ranks_per_host: usize, hosts: usize, link: Option<&str>) -> Algo {
    if link != Some("ucx") {
        return select(bytes, ranks_per_host, hosts, link);
    }
    let max = if ranks_per_host == 1 { UCX_LONE_MAX } else { UCX_HOST_MAX };
    if hosts > 1 && hostpush::fits_host(bytes, ranks_per_host, max) { Algo::HostPush } else { Algo::Pull }
}

/// The algorithm [`all_gather_into`] takes for `input` on the group of `h` (its handle).
pub fn select_for(input: &Tensor, h: &SymmHandle) -> Algo {
    let hosts = if h.all_local() { 1 } else { 2 };
    select_all_gather(input.nbytes(), h.max_ranks_per_host(), hosts, h.link_backend())
}

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
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    if h.all_local() {
        enter_on(OP, input, group, &h, &[])?;
        return pulled(input, group, out, &h);
    }
    // Across hosts, ranks that took different algorithms (sizes on either side of the limit)
    // or left a call at different points are out of step: refused from then on.
    hostpush::guarded(group, OP, || {
        if select_for(input, &h) == Algo::HostPush {
            // Host push checks the ranks' arguments itself, in its one exchange.
            return host_push::all_gather(input, out, group, &h, timeout());
        }
        host_push::meet(input, group, &h, OP, None, &[])?;
        pulled(input, group, out, &h)
    })
}

/// PyTorch's `_low_contention_all_gather`: every rank's `input`, in rank order, in a new tensor
/// `[ws · d0, ...]` (`[ws]` for a 0-d input). `input` may be ordinary or symmetric: an ordinary
/// (or non-contiguous) one is first copied into the group's workspace, as PyTorch's copies it
/// into its symmetric workspace. PyTorch's version spares the GPU's compute units by copying
/// with the copy engines; a CPU has none to spare, so this is [`all_gather_into`].
///
/// ```
/// use symmem::{DType, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = Tensor::from_slice(&[1, 2], &[group.rank() as i32; 2])?; // not symmetric
///     let out = ops::low_contention_all_gather(&x, &group)?;
///     assert_eq!((out.shape(), out.to_vec::<i32>()?), (&[2, 2][..], vec![0, 0, 1, 1]));
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn low_contention_all_gather(input: &Tensor, group: &Group) -> Result<Tensor> {
    const OP: &str = "_low_contention_all_gather";
    let shape = if input.shape().is_empty() { vec![1] } else { input.shape().to_vec() };
    let staged;
    let input = if crate::symm::is_symm_mem_tensor(input) && input.is_contiguous() {
        input.view(&shape)?
    } else {
        staged = stage(OP, input, group, &[])?;
        staged.view(&shape)?
    };
    let mut out_shape = shape;
    out_shape[0] *= group.world_size();
    let out = Tensor::zeros(&out_shape, input.dtype())?;
    all_gather_into(&input, group, &out)?;
    Ok(out)
}

/// The pull path of [`all_gather_into`], once the ranks entered: every rank's input read (the
/// other hosts' shared out among a host's ranks), copied into `out`, then a barrier. A rank
/// alone on its host reads the other hosts' inputs straight into `out` (no host's rank to
/// share them with), copying its own meanwhile.
fn pulled(input: &Tensor, group: &Group, out: &Tensor, h: &SymmHandle) -> Result<()> {
    let (ws, n) = (group.world_size(), input.nbytes());
    if !h.all_local() && h.max_ranks_per_host() == 1 {
        let me = h.rank();
        let own = || {
            // SAFETY: the input is contiguous, n bytes, sharing no byte with `out` (checked),
            // which holds ws blocks of n bytes; the reads land in the other blocks.
            unsafe { std::ptr::copy_nonoverlapping(input.data_ptr().cast_const(), out.data_ptr().add(me * n), n) };
        };
        h.fetch_into(out, &|r| (h.offset(), n, r * n), timeout(), own)?;
        return barrier(h);
    }
    fetch_shared(h, |_| (0, n))?;
    let ptrs = peers(h, 0);
    for k in 0..ws {
        let r = (h.rank() + k) % ws;
        // SAFETY: rank r's input is not written between the barriers; out has ws·n bytes.
        unsafe { std::ptr::copy_nonoverlapping(ptrs[r], out.data_ptr().add(r * n), n) };
    }
    barrier(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_all_gather_pushes_further_over_ucx() {
        let m = 1 << 20;
        assert_eq!(select_all_gather(m, 2, 1, Some("ucx")), Algo::Pull, "one host always pulls");
        assert_eq!(select_all_gather(2 * m, 2, 2, Some("ucx")), Algo::HostPush, "4 MiB of a host's inputs");
        assert_eq!(select_all_gather(2 * m + 16, 2, 2, Some("ucx")), Algo::Pull);
        assert_eq!(select_all_gather(2 * m, 1, 2, Some("ucx")), Algo::HostPush, "2 MiB alone on a host");
        assert_eq!(select_all_gather(2 * m + 16, 1, 2, Some("ucx")), Algo::Pull);
        assert_eq!(select(2 * m, 2, 2, Some("ucx")), Algo::Pull, "whole inputs elsewhere keep their limits");
        for (bytes, rph) in [(m / 2, 2), (m / 2 + 16, 2), (m, 1), (m + 16, 1), (4 * m, 1)] {
            for link in [Some("tcp"), None] {
                assert_eq!(
                    select_all_gather(bytes, rph, 2, link),
                    select(bytes, rph, 2, link),
                    "{bytes} {rph} {link:?}"
                );
            }
        }
    }

    #[test]
    fn a_host_gets_the_slices_from_its_lowest_ranks_to_its_highest() {
        let theirs = slices_of(100);
        assert_eq!(theirs(&[0]), (0, 100));
        assert_eq!(theirs(&[2, 3]), (200, 200));
        assert_eq!(theirs(&[3, 1]), (100, 300), "in any order, every rank between");
        assert_eq!(theirs(&[]), (0, 0), "no ranks, nothing");
        assert_eq!(slices_of(usize::MAX / 2)(&[3]).0, usize::MAX, "saturates, never wraps");
    }

    #[test]
    fn host_push_takes_a_hosts_inputs_up_to_the_limit_of_its_links() {
        assert_eq!(select(8, 2, 1, None), Algo::Pull, "one host always pulls");
        assert_eq!(select(512 << 10, 2, 2, Some("tcp")), Algo::HostPush);
        assert_eq!(select((512 << 10) + 1, 2, 2, Some("tcp")), Algo::Pull);
        assert_eq!(select(1 << 20, 1, 2, Some("tcp")), Algo::HostPush);
        assert_eq!(select(256 << 10, 2, 2, Some("ucx")), Algo::HostPush);
        assert_eq!(select(512 << 10, 2, 2, Some("ucx")), Algo::Pull);
        assert_eq!(select(1 << 20, 1, 2, Some("ucx")), Algo::HostPush);
        assert_eq!(select(0, 1, 2, Some("tcp")), Algo::Pull, "nothing to push");
    }
}
