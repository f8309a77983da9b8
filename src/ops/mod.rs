//! Operators on symmetric memory (PyTorch's `torch.distributed._symmetric_memory`), with PyTorch's names and
//! semantics and its algorithms (`docs/symm-mem-algorithms.md`), one module per
//! collective, each with its algorithms and the one function that picks among them:
//!
//! ```text
//!   all_reduce/      one_shot, two_shot, small (one synchronization per call), host_push
//!                    and chain (across hosts); all_reduce() picks by all_reduce::select_for
//!   reduce_scatter   reduce_scatter_out (two-shot's first half), reduce_scatter_offset,
//!                    low_contention_reduce_scatter
//!   all_gather/      all_gather_into (pull, or host_push across hosts: all_gather::select),
//!                    low_contention_all_gather
//!   broadcast        broadcast_ (pull, or host_push across hosts: the all-gather's select)
//!   all_to_all/      all_to_all (pull, or host_push across hosts: all_to_all::select),
//!                    all_to_all_nd, the vdev family (vdev.rs)
//!   tile, matmul     tile reductions; the fused all-gather-matmul and matmul-reduce-scatter
//!   stream           stream_write_value32_ and memset32_: CUDA's stream writes as host stores
//!   common           the prologue every operator shares (checks, rendezvous, checked entry),
//!                    peers' pointers, fetches from other hosts, the closing barrier
//!   check            the entry check: every rank called the same operator alike
//!   hostpush         the workspaces and protocol of the host-push algorithms
//!   reduce           the reduction kernels
//! ```
//!
//! [`OPERATORS`] lists every operator once, with its names in PyTorch, in symmem's Python
//! package and its native module, and in Rust; a test keeps the Python package, its stubs and
//! its bindings to that list.
//!
//! Reductions (sum, avg, min, max; PyTorch has only sum) run in rank order, so results are
//! bitwise identical on every rank; f16 and bf16 accumulate in f32. Arguments are checked before
//! any communication; the synchronization is the signal pads' barrier on channel 0, so every
//! operator is bounded by a timeout (`SYMMEM_OP_TIMEOUT`, 60 s by default) and names the rank it
//! waited for.
//!
//! Layer: uses `symm`, `tensor`, `group`, `sync`.

pub mod all_gather;
pub mod all_reduce;
pub mod all_to_all;
pub mod broadcast;
mod check;
mod common;
mod hostpush;
pub mod matmul;
mod reduce;
pub mod reduce_scatter;
mod stream;
pub mod tile;

pub use all_gather::{all_gather_into, low_contention_all_gather};
pub use all_reduce::{
    ONE_SHOT_MAX, all_reduce, one_shot_all_reduce, one_shot_all_reduce_out, two_shot_all_reduce_,
    two_shot_all_reduce_out,
};
pub use all_to_all::{
    ALL_TO_ALL_PUSH_MAX, UCX_ALL_TO_ALL_PUSH_MAX, VDEV_CARRY_MAX, VDEV_PUSH_MAX, all_to_all, all_to_all_nd,
    all_to_all_vdev, all_to_all_vdev_2d, all_to_all_vdev_2d_offset,
};
pub use broadcast::broadcast_;
pub use matmul::{fused_all_gather_matmul, fused_matmul_reduce_scatter};
pub use reduce::ReduceOp;
pub use reduce_scatter::{low_contention_reduce_scatter, reduce_scatter_offset, reduce_scatter_out};
pub use stream::{memset32_, stream_write_value32_};
pub use tile::{multi_root_tile_reduce, tile_reduce};

use crate::error::Result;
use crate::group::Group;
use crate::tensor::Tensor;
use common::unsupported;

/// One operator, under each of its names.
#[derive(Clone, Copy, Debug)]
pub struct Operator {
    /// Its name in PyTorch (`torch.ops.symm_mem` or `torch.distributed._symmetric_memory`), or
    /// symmem's own where PyTorch has none.
    pub torch: &'static str,
    /// The function of symmem's Python package (`symmem.symm`); `None` where it needs a GPU.
    pub python: Option<&'static str>,
    /// The function of the native module (`symmem._native`) that the Python function calls.
    pub native: Option<&'static str>,
    /// The Rust function, under `symmem::`.
    pub rust: &'static str,
    /// The collective (or family) it belongs to.
    pub collective: &'static str,
}

macro_rules! operators {
    ($($torch:literal, $py:expr, $native:expr, $rust:literal, $coll:literal;)*) => {
        /// Every operator, once.
        pub const OPERATORS: &[Operator] = &[
            $(Operator { torch: $torch, python: $py, native: $native, rust: $rust, collective: $coll }),*
        ];
    };
}

operators! {
    "get", Some("get"), Some("get"), "symm::get", "one-sided";
    "put_signal", Some("put_signal"), Some("put_signal"), "symm::put_signal", "one-sided";
    "wait_signal", Some("wait_signal"), Some("wait_signal"), "symm::wait_signal", "one-sided";
    "nvshmem_put", Some("nvshmem_put"), Some("nvshmem_put"), "symm::nvshmem_put", "one-sided";
    "nvshmem_get", Some("nvshmem_get"), Some("nvshmem_get"), "symm::nvshmem_get", "one-sided";
    "nvshmem_get_out", Some("nvshmem_get_out"), Some("nvshmem_get_out"), "symm::nvshmem_get_out", "one-sided";
    "nvshmem_put_with_signal", Some("nvshmem_put_with_signal"), Some("nvshmem_put_with_signal"),
        "symm::nvshmem_put_with_signal", "one-sided";
    "nvshmem_wait_for_signal", Some("nvshmem_wait_for_signal"), Some("nvshmem_wait_for_signal"),
        "symm::nvshmem_wait_for_signal", "one-sided";
    "nccl_put_with_signal", Some("nccl_put_with_signal"), Some("nccl_put_with_signal"), "symm::nccl_put_with_signal",
        "one-sided";
    "nccl_wait_for_signal", Some("nccl_wait_for_signal"), Some("nccl_wait_for_signal"), "symm::nccl_wait_for_signal",
        "one-sided";
    "one_shot_all_reduce", Some("one_shot_all_reduce"), Some("one_shot_all_reduce"), "ops::one_shot_all_reduce",
        "all_reduce";
    "one_shot_all_reduce_out", Some("one_shot_all_reduce_out"), Some("one_shot_all_reduce_out"),
        "ops::one_shot_all_reduce_out", "all_reduce";
    "two_shot_all_reduce_", Some("two_shot_all_reduce_"), Some("two_shot_all_reduce_"), "ops::two_shot_all_reduce_",
        "all_reduce";
    "two_shot_all_reduce_out", Some("two_shot_all_reduce_out"), Some("two_shot_all_reduce_out"),
        "ops::two_shot_all_reduce_out", "all_reduce";
    "all_reduce", Some("all_reduce"), Some("all_reduce"), "ops::all_reduce", "all_reduce";
    "reduce_scatter_out", Some("reduce_scatter_out"), Some("reduce_scatter_out"), "ops::reduce_scatter_out",
        "reduce_scatter";
    "reduce_scatter_offset", Some("reduce_scatter_offset"), Some("reduce_scatter_offset"),
        "ops::reduce_scatter_offset", "reduce_scatter";
    "all_gather_into_tensor", Some("all_gather_into_tensor"), Some("all_gather_into"), "ops::all_gather_into",
        "all_gather";
    "_low_contention_all_gather", Some("low_contention_all_gather"), Some("low_contention_all_gather"),
        "ops::low_contention_all_gather", "all_gather";
    "_low_contention_reduce_scatter", Some("low_contention_reduce_scatter"), Some("low_contention_reduce_scatter"),
        "ops::low_contention_reduce_scatter", "reduce_scatter";
    "nvshmem_broadcast", Some("broadcast"), Some("broadcast_"), "ops::broadcast_", "broadcast";
    "nvshmem_all_to_all", Some("all_to_all"), Some("all_to_all"), "ops::all_to_all", "all_to_all";
    "all_to_all_nd", Some("all_to_all_nd"), Some("all_to_all_nd"), "ops::all_to_all_nd", "all_to_all";
    "all_to_all_vdev", Some("all_to_all_vdev"), Some("all_to_all_vdev"), "ops::all_to_all_vdev", "all_to_all";
    "all_to_all_vdev_2d", Some("all_to_all_vdev_2d"), Some("all_to_all_vdev_2d"), "ops::all_to_all_vdev_2d",
        "all_to_all";
    "all_to_all_vdev_2d_offset", Some("all_to_all_vdev_2d_offset"), Some("all_to_all_vdev_2d_offset"),
        "ops::all_to_all_vdev_2d_offset", "all_to_all";
    "tile_reduce", Some("tile_reduce"), Some("tile_reduce"), "ops::tile_reduce", "tile";
    "multi_root_tile_reduce", Some("multi_root_tile_reduce"), Some("multi_root_tile_reduce"),
        "ops::multi_root_tile_reduce", "tile";
    "fused_all_gather_matmul", Some("fused_all_gather_matmul"), Some("fused_all_gather_matmul"),
        "ops::fused_all_gather_matmul", "matmul";
    "fused_matmul_reduce_scatter", Some("fused_matmul_reduce_scatter"), Some("fused_matmul_reduce_scatter"),
        "ops::fused_matmul_reduce_scatter", "matmul";
    "multimem_all_reduce_", Some("multimem_all_reduce_"), Some("multimem_all_reduce_"), "ops::multimem_all_reduce_", "gpu";
    "multimem_all_gather_out", Some("multimem_all_gather_out"), Some("multimem_all_gather_out"), "ops::multimem_all_gather_out", "gpu";
    "multimem_one_shot_all_reduce", Some("multimem_one_shot_all_reduce"), Some("multimem_one_shot_all_reduce"), "ops::multimem_one_shot_all_reduce", "gpu";
    "multimem_one_shot_reduce_out", Some("multimem_one_shot_reduce_out"), Some("multimem_one_shot_reduce_out"), "ops::multimem_one_shot_reduce_out", "gpu";
    "memset32_", Some("memset32_"), Some("memset32_"), "ops::memset32_", "stream";
    "memcpy_to_multicast_", Some("memcpy_to_multicast_"), Some("memcpy_to_multicast_"), "ops::memcpy_to_multicast_", "gpu";
    "stream_write_value32_", Some("stream_write_value32_"), Some("stream_write_value32_"),
        "ops::stream_write_value32_", "stream";
    "fused_all_gather_scaled_matmul", Some("fused_all_gather_scaled_matmul"), Some("fused_all_gather_scaled_matmul"), "ops::fused_all_gather_scaled_matmul", "gpu";
    "fused_scaled_matmul_reduce_scatter", Some("fused_scaled_matmul_reduce_scatter"), Some("fused_scaled_matmul_reduce_scatter"), "ops::fused_scaled_matmul_reduce_scatter", "gpu";
}

/// Operators that need GPU hardware: they answer with what they need.
///
/// ```
/// use symmem::{DType, Error, ReduceOp, Tensor, ops};
///
/// symmem::group::run_threads(1, |group| {
///     let x = Tensor::zeros(&[4], DType::F32)?;
///     let e = ops::multimem_all_reduce_(&x, ReduceOp::Sum, &group).unwrap_err();
///     assert!(matches!(e, Error::Unsupported { .. }), "{e}");
///     assert!(e.to_string().contains("multicast"), "{e}");
///     Ok(())
/// })?;
/// # Ok::<(), symmem::Error>(())
/// ```
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
pub fn memcpy_to_multicast_(_out: &Tensor, _src: &Tensor, _byte_offset: usize, _group: &Group) -> Result<()> {
    Err(unsupported("memcpy_to_multicast_", "a multicast object (CUDA, NVLink SHARP)"))
}

/// See [`multimem_all_reduce_`].
pub fn fused_all_gather_scaled_matmul() -> Result<()> {
    Err(unsupported("fused_all_gather_scaled_matmul", "FP8 tensor cores (CUDA)"))
}

/// See [`multimem_all_reduce_`].
pub fn fused_scaled_matmul_reduce_scatter() -> Result<()> {
    Err(unsupported("fused_scaled_matmul_reduce_scatter", "FP8 tensor cores (CUDA)"))
}
