//! All-reduce: every algorithm and the one function that picks among them ([`select`]).
//!
//! ```text
//!   one_shot   barrier; every rank reads every rank's buffer and reduces in rank order into
//!              its output; barrier. Each rank reads ws·n bytes: latency-optimal.
//!   two_shot   barrier; rank r reduces slice r from every rank and pushes it to every rank
//!              (in place) or keeps it and everyone pulls (out of place); barrier. Each rank
//!              moves about 2·n bytes: bandwidth-optimal.
//!   small      (small.rs) one-shot through a double-buffered workspace, one synchronization
//!              per call, any size or alignment up to 8 KiB
//!   host_push  (host_push.rs) across hosts: each host's inputs travel to every other host in
//!              one one-way message, received by its leader
//!   chain      (chain.rs) across hosts with equal hosts of consecutive ranks: each host folds
//!              its slices into the previous host's partial, the last one sends the result back
//! ```

mod chain;
pub(crate) mod host_push;
mod small;

use crate::error::Result;
use crate::group::Group;
use crate::ops::common::*;
use crate::ops::hostpush;
use crate::ops::reduce::{self, ReduceOp};
use crate::symm;
use crate::tensor::Tensor;

/// The algorithms of [`all_reduce`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// Through the group's small workspace, one synchronization per call.
    Small,
    /// Every rank reduces a slice and pushes it to all.
    TwoShot,
    /// Each host's inputs in one message to every other host (a group spanning hosts).
    HostPush,
    /// Across hosts, host after host in rank order, the last sending the result back.
    Chain,
}

impl Algo {
    /// Its name, as benchmarks report it (`"one_shot"` for [`Algo::Small`], which is one-shot).
    pub fn name(self) -> &'static str {
        match self {
            Algo::Small => "one_shot",
            Algo::TwoShot => "two_shot",
            Algo::HostPush => "host_push",
            Algo::Chain => "chain",
        }
    }
}

/// The one selection: the algorithm [`all_reduce`] uses for `bytes`, at most `ranks_per_host`
/// ranks on a host, spanning `hosts` hosts, `crowded` when a host's ranks outnumber the CPUs
/// they may use ([`crate::symm::SymmHandle::crowded`], the same on every rank of a host), over
/// links between hosts of backend `link` ([`crate::symm::SymmHandle::link_backend`], the same
/// on every rank). On one host: one-shot up to 1 KiB, or up to 8 KiB when crowded (then every
/// extra synchronization costs a context switch), two-shot above (measured crossovers on 2
/// cores: 2 ranks ~1 KiB, 4 ranks ~8 KiB). Across hosts: host-push while a host's inputs fit in
/// 1 MiB (over ucx 512 KiB, or 1 MiB for hosts of one rank), two-shot above (measured on 2
/// played hosts, 4 ranks: over tcp host push ahead up to 512 KiB each and two-shot from 768
/// KiB; over ucx host push ahead at 256 KiB each, 422-480 vs 518-623 us, and two-shot at 512
/// KiB, 715-785 vs 1057-1078 us; 2 ranks over tcp, host push even at 1 MiB and two-shot 2.5x
/// ahead at 2 MiB; over ucx, host push to 1 MiB: 0.70-0.81x two-shot's time at 640-768 KiB, a
/// tie at 1 MiB, 1.24x at 1.5 MiB).
///
/// A leader receives a host's inputs from each of the `hosts - 1` other hosts, so from three
/// hosts on the limit on a host's inputs is the two-host one divided by `hosts - 1`: what a
/// leader receives stays within what two hosts measured (8 ranks on 8 played hosts over tcp,
/// host push against two-shot, 2 runs: 64 KiB 2,336-2,547 vs 4,569-4,660 us, 256 KiB
/// 8,176-8,640 vs 6,446-6,592, 1 MiB 28,119-29,930 vs 13,197-13,332; 4 on 4: 512 KiB 3,151
/// vs 3,823, 1 MiB 10,377 vs 5,027).
///
/// From four hosts (`host_push::SCATTER_FROM`) host push scatters: a leader receives a slice
/// of each input and the reduced slices (about twice a host's inputs in all), so the limit is
/// `hostpush::scattered_block_max` instead (4 MiB of a host's inputs over tcp, and at most
/// 32 MiB / hosts, which bounds the workspace). Over tcp, `symmem bench all-reduce`, 2 runs,
/// scattered host push against what the one-round limit picked: 8 ranks on 8 played hosts,
/// 256 KiB 3,461-3,791 vs 11,155-13,194 us (two-shot), 1 MiB 9,175-10,325 vs 17,688-18,588,
/// 4 MiB 30,447-31,233 vs 40,766-45,872; 16 on 8, 1 MiB 18,127-18,527 vs 26,122-29,701
/// (chain), 2 MiB 29,631-29,979 vs 41,445-48,953; 4 on 4, 512 KiB 1,400-1,882 vs 3,667-3,704
/// (two-shot).
pub fn select(bytes: usize, crowded: bool, ranks_per_host: usize, hosts: usize, link: Option<&str>) -> Algo {
    if hosts > 1 {
        let max = if hosts >= host_push::SCATTER_FROM {
            hostpush::scattered_block_max(link, ranks_per_host, hosts)
        } else {
            hostpush::host_block_max(link, ranks_per_host) / (hosts - 1)
        };
        return if hostpush::fits_host(bytes, ranks_per_host, max) { Algo::HostPush } else { Algo::TwoShot };
    }
    let max = if crowded { ONE_SHOT_MAX } else { 1024 };
    if bytes <= max { Algo::Small } else { Algo::TwoShot }
}

/// The algorithm [`all_reduce`] takes for `tensor` by `op` on the group of `h` (the tensor's
/// handle or any of the group's: what matters is its topology): [`select`] by size, then,
/// across hosts, the chain instead of two-shot where it applies (hosts of the same number of
/// consecutive ranks, at least 2 each, and partials exact in the element type: see
/// `chain.rs`). The same on every rank that passes the same arguments.
pub fn select_for(tensor: &Tensor, op: ReduceOp, h: &symm::SymmHandle) -> Algo {
    match select(tensor.nbytes(), h.crowded(), h.max_ranks_per_host(), h.hosts(), h.link_backend()) {
        Algo::TwoShot if h.hosts() > 1 && chain::suits(tensor.dtype(), op, h) => Algo::Chain,
        algo => algo,
    }
}

/// Out-of-place all-reduce of a symmetric tensor, reading every peer's copy (latency-optimal).
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = symm::empty(&[4], DType::F32, Device::Cpu)?;
///     x.fill(group.rank() as f32 + 1.0)?;
///     let sum = ops::one_shot_all_reduce(&x, ReduceOp::Sum, &group)?;
///     assert_eq!(sum.to_vec::<f32>()?, [3.0; 4]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn one_shot_all_reduce(input: &Tensor, op: ReduceOp, group: &Group) -> Result<Tensor> {
    let out = Tensor::zeros(input.shape(), input.dtype())?;
    one_shot_all_reduce_out(input, op, group, &out)?;
    Ok(out)
}

/// [`one_shot_all_reduce`] into `out` (any contiguous tensor of the same shape and dtype).
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = symm::empty(&[4], DType::F32, Device::Cpu)?;
///     x.fill(group.rank() as f32 + 1.0)?;
///     let out = Tensor::zeros(&[4], DType::F32)?; // any memory
///     ops::one_shot_all_reduce_out(&x, ReduceOp::Max, &group, &out)?;
///     assert_eq!(out.to_vec::<f32>()?, [2.0; 4]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn one_shot_all_reduce_out(input: &Tensor, op: ReduceOp, group: &Group, out: &Tensor) -> Result<()> {
    const OP: &str = "one_shot_all_reduce";
    same_shape(OP, input, out)?;
    disjoint(OP, input, out)?;
    reducible(OP, input)?;
    let h = symmetric(OP, input, group)?;
    if input.numel() == 0 {
        return Ok(());
    }
    if h.all_local() {
        enter_on(OP, input, group, &h, &[op.code()])?;
        return one_shot_pulled(input, op, out, &h);
    }
    // Across hosts, within host push's limits, the all-gather's exchange: every rank's input
    // reaches every host once, and each rank reduces them all, in rank order, into `out`.
    // Ranks that took different ways, or left a call at different points, are out of step:
    // refused from then on.
    hostpush::guarded(group, OP, || {
        let (bytes, rph) = (input.nbytes(), h.max_ranks_per_host());
        if crate::ops::all_gather::select(bytes, rph, 2, h.link_backend()) == crate::ops::all_gather::Algo::HostPush {
            let sig = crate::ops::check::counts_at(input, Some(op), h.offset());
            let ws = h.world_size();
            return crate::ops::all_gather::exchange_inputs(
                &[input],
                group,
                &h,
                OP,
                sig,
                crate::ops::all_gather::Travels::All,
                timeout(),
                || {},
                |inputs| {
                    // SAFETY: `inputs[r]` holds rank r's numel elements for the length of the call
                    // (`exchange_inputs`); `out` is a contiguous tensor of numel elements sharing no
                    // byte with any of them.
                    unsafe { reduce::reduce(input.dtype(), op, inputs, &[out.data_ptr()], input.numel(), ws) }
                },
            );
        }
        crate::ops::all_gather::meet(input, group, &h, OP, Some(op), &[op.code()])?;
        one_shot_pulled(input, op, out, &h)
    })
}

/// The pull path of [`one_shot_all_reduce_out`], once the ranks entered: every input fetched
/// (each other host's once per host), reduced in rank order into `out`, then a barrier.
fn one_shot_pulled(input: &Tensor, op: ReduceOp, out: &Tensor, h: &symm::SymmHandle) -> Result<()> {
    fetch_shared(h, |_| (0, input.nbytes()))?;
    // SAFETY: between the barriers no rank writes its input (the operator's contract), every
    // peer pointer addresses numel elements inside that peer's mapped buffer or its mirror
    // (rendezvous checked the shapes), and `out` is a contiguous tensor of numel elements.
    unsafe { reduce::reduce(input.dtype(), op, &peers(h, 0), &[out.data_ptr()], input.numel(), h.world_size())? };
    barrier(h)
}

/// In-place all-reduce of a symmetric tensor: every rank reduces one slice and pushes it to all
/// (bandwidth-optimal).
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = symm::empty(&[1 << 16], DType::BF16, Device::Cpu)?;
///     x.fill(half::bf16::from_f32(group.rank() as f32 + 1.0))?;
///     ops::two_shot_all_reduce_(&x, ReduceOp::Avg, &group)?; // in place, f32 accumulation
///     assert!(x.to_vec::<half::bf16>()?.iter().all(|v| v.to_f32() == 1.5));
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn two_shot_all_reduce_(input: &Tensor, op: ReduceOp, group: &Group) -> Result<()> {
    const OP: &str = "two_shot_all_reduce_";
    reducible(OP, input)?;
    let Some(h) = prologue(OP, input, group, &[op.code()])? else { return Ok(()) };
    two_shot_in_place(input, op, &h)
}

/// The body of [`two_shot_all_reduce_`], after its prologue.
fn two_shot_in_place(input: &Tensor, op: ReduceOp, h: &symm::SymmHandle) -> Result<()> {
    let (es, ws) = (input.dtype().size(), h.world_size());
    let (start, len) = slice(input.numel(), ws, h.rank(), alignment(input.dtype()) / es);
    fetch(h, |_| (start * es, len * es))?;
    let srcs = peers(h, start * es);
    // The reduced slice goes into the buffers of this host's ranks; those on other hosts get it
    // by a write below (their mirrors here are not read again).
    let mut inline = [std::ptr::null_mut::<u8>(); 64];
    let heap: Vec<*mut u8>;
    let locals = (0..ws).filter(|&r| h.is_local(r));
    let dsts: &[*mut u8] = if ws <= inline.len() {
        let mut n = 0;
        for r in locals {
            inline[n] = srcs[r].cast_mut();
            n += 1;
        }
        &inline[..n]
    } else {
        heap = locals.map(|r| srcs[r].cast_mut()).collect();
        &heap
    };
    // SAFETY: slice [start, start+len) of every rank's buffer is read and written by this rank
    // only, between the barriers; the pointers address mapped buffers (checked shapes).
    unsafe { reduce::reduce(input.dtype(), op, &srcs, dsts, len, ws)? };
    // Ranks on other hosts get the reduced slice by a write from this rank's buffer.
    if !h.all_local() {
        let at = h.offset() + start * es;
        h.push(&h.remote_ranks(), at, len * es, at, timeout())?;
    }
    barrier(h)
}

/// Out-of-place two-shot all-reduce into `out`. Like PyTorch's, it also leaves this rank's
/// reduced slice in `input`.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = symm::empty(&[1024], DType::I64, Device::Cpu)?;
///     x.fill(group.rank() as i64 * 10)?;
///     let out = Tensor::zeros(&[1024], DType::I64)?;
///     ops::two_shot_all_reduce_out(&x, ReduceOp::Sum, &group, &out)?;
///     assert_eq!(out.to_vec::<i64>()?, vec![10; 1024]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn two_shot_all_reduce_out(input: &Tensor, op: ReduceOp, group: &Group, out: &Tensor) -> Result<()> {
    const OP: &str = "two_shot_all_reduce_out";
    same_shape(OP, input, out)?;
    disjoint(OP, input, out)?;
    reducible(OP, input)?;
    let Some(h) = prologue(OP, input, group, &[op.code()])? else { return Ok(()) };
    let (es, ws) = (input.dtype().size(), h.world_size());
    let per_align = alignment(input.dtype()) / es;
    let (start, len) = slice(input.numel(), ws, h.rank(), per_align);
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

/// The largest message [`all_reduce`] ever sends one-shot (when ranks outnumber cores).
pub const ONE_SHOT_MAX: usize = 8 * 1024;

/// In-place all-reduce of a symmetric tensor, picking the algorithm by size ([`select`]):
/// small messages go one-shot through a double-buffered workspace with a single
/// synchronization per call; larger ones two-shot. Across hosts, hosts exchange their inputs
/// in one message each up to a few hundred KiB; above, hosts of the same number of
/// consecutive ranks fold their inputs one after the other (the chain, [`select_for`]), others
/// two-shot; results are bitwise those of one host.
///
/// ```
/// use symmem::symm::{self, Device};
/// use symmem::{DType, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(2, |group| {
///     let x = symm::empty(&[8], DType::F64, Device::Cpu)?;
///     x.fill(group.rank() as f64)?;
///     ops::all_reduce(&x, ReduceOp::Min, &group)?; // picks one-shot or two-shot by size
///     assert_eq!(x.to_vec::<f64>()?, [0.0; 8]);
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
pub fn all_reduce(tensor: &Tensor, op: ReduceOp, group: &Group) -> Result<()> {
    const OP: &str = "all_reduce";
    reducible(OP, tensor)?;
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
    // Small, once the group's small workspace exists: its handle says what the choice needs
    // (one host? crowded?), so the tensor's own handle is not looked up.
    if tensor.nbytes() <= ONE_SHOT_MAX
        && let Some(done) = small::all_reduce_on_host(tensor, op, group, timeout())
    {
        return done;
    }
    let h = symm::rendezvous(tensor, group)?;
    let call = || match select_for(tensor, op, &h) {
        Algo::Small => small::all_reduce(tensor, op, group, timeout()),
        Algo::HostPush => host_push::all_reduce(tensor, op, group, &h, timeout()),
        Algo::Chain => chain::all_reduce(tensor, op, group, &h),
        Algo::TwoShot => {
            // two_shot_all_reduce_ itself, on the handle already in hand.
            const TWO: &str = "two_shot_all_reduce_";
            check_symmetric(TWO, tensor)?;
            if h.all_local() {
                enter_on(TWO, tensor, group, &h, &[op.code()])?;
            } else {
                // Across hosts, an entry that meets host push's calls (see the chain's).
                host_push::meet(tensor, op, group, &h, TWO)?;
            }
            two_shot_in_place(tensor, op, &h)
        }
    };
    // Across hosts, ranks that took different algorithms (sizes on either side of a limit) or
    // left a call at different points are out of step: refused from then on.
    if h.all_local() { call() } else { hostpush::guarded(group, OP, call) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_four_hosts_host_push_scatters_up_to_its_own_limit() {
        let tcp = Some("tcp");
        // Three hosts: a leader takes every host's whole inputs, 1 MiB / 2 of them.
        assert_eq!(select(512 << 10, false, 1, 3, tcp), Algo::HostPush);
        assert_eq!(select((512 << 10) + 16, false, 1, 3, tcp), Algo::TwoShot);
        // Eight: scattered, 4 MiB of a host's inputs.
        assert_eq!(select(4 << 20, false, 1, 8, tcp), Algo::HostPush);
        assert_eq!(select((4 << 20) + 16, false, 1, 8, tcp), Algo::TwoShot);
        assert_eq!(select(2 << 20, false, 2, 8, tcp), Algo::HostPush);
        assert_eq!(select((2 << 20) + 16, false, 2, 8, tcp), Algo::TwoShot);
        // Sixty-four: the workspace's bound, 32 MiB / 64 = 512 KiB of a host's inputs.
        assert_eq!(select(512 << 10, false, 1, 64, tcp), Algo::HostPush);
        assert_eq!(select((512 << 10) + 16, false, 1, 64, tcp), Algo::TwoShot);
        // Over ucx, its own host limit, not measured scattered.
        assert_eq!(select(256 << 10, false, 2, 8, Some("ucx")), Algo::HostPush);
        assert_eq!(select((256 << 10) + 16, false, 2, 8, Some("ucx")), Algo::TwoShot);
    }

    #[test]
    fn host_push_takes_a_hosts_inputs_up_to_a_limit_of_its_links() {
        let k = 1 << 10;
        // 2 ranks per host: a host's inputs are twice a rank's.
        for (bytes, tcp, ucx) in [
            (8, Algo::HostPush, Algo::HostPush),
            (256 * k, Algo::HostPush, Algo::HostPush),
            (256 * k + 16, Algo::HostPush, Algo::TwoShot),
            (512 * k, Algo::HostPush, Algo::TwoShot),
            (512 * k + 16, Algo::TwoShot, Algo::TwoShot),
        ] {
            assert_eq!(select(bytes, false, 2, 2, Some("tcp")), tcp, "{bytes} bytes over tcp");
            assert_eq!(select(bytes, false, 2, 2, None), tcp, "{bytes} bytes over mixed links");
            assert_eq!(select(bytes, false, 2, 2, Some("ucx")), ucx, "{bytes} bytes over ucx");
        }
        assert_eq!(select(8, false, 2, 1, None), Algo::Small, "one host");
        // A rank per host: over ucx, host push takes twice the block, as over tcp.
        for link in [Some("tcp"), Some("ucx"), None] {
            assert_eq!(select(1 << 20, false, 1, 2, link), Algo::HostPush, "1 MiB over {link:?}");
            assert_eq!(select((1 << 20) + 16, false, 1, 2, link), Algo::TwoShot, "1 MiB + 16 over {link:?}");
        }
        // Three hosts: a leader receives a host's inputs from each other host, within the same
        // total (1 MiB / 2 a host). From four, scattered: 4 MiB of a host's inputs, at most 32
        // MiB / hosts (16 hosts of 8: 2 MiB, 262,144 bytes a rank).
        for (hosts, rph, fits) in
            [(3, 1, 524_288), (3, 2, 262_144), (4, 1, 4 << 20), (8, 1, 4 << 20), (4, 2, 2 << 20), (16, 8, 262_144)]
        {
            let at = |b: usize| select(b, false, rph, hosts, Some("tcp"));
            assert_eq!(at(fits), Algo::HostPush, "{fits} bytes, {rph} x {hosts}");
            assert_eq!(at(fits + 16), Algo::TwoShot, "{fits} + 16 bytes, {rph} x {hosts}");
        }
        assert_eq!(select(8, false, 8, 1024, Some("tcp")), Algo::HostPush, "8 B at a thousand hosts");
    }
}
