//! Symmetric memory and its operators for Python: allocations exported through the buffer
//! protocol (so torch and NumPy view them without copies), the world group from the launcher's
//! environment, handles, signals and the operators.

use std::os::raw::c_int;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use symmem::Group;
use symmem::ops::{self, ReduceOp};
use symmem::symm::{self, Device, SymmHandle};
use symmem::tensor::{DType, Tensor};
use symmem_python_macros::catch_panics;

use crate::seconds;

/// A symmetric-memory error as PyTorch raises it, and as symmem's own types say it: a timeout
/// is `symmem.errors.WaitTimeoutError` (a RuntimeError and a TimeoutError), an invalid argument
/// `symmem.errors.InvalidArgumentError` (a ValueError and a RuntimeError); the rest as
/// everywhere ([`crate::err`]).
fn err(e: symmem::Error) -> PyErr {
    use symmem::TransferKind::TimedOut;
    match e {
        symmem::Error::Timeout { .. } | symmem::Error::Transfer { kind: TimedOut, .. } => {
            crate::typed("WaitTimeoutError", e.to_string())
        }
        symmem::Error::InvalidArgument(_) => crate::typed("InvalidArgumentError", e.to_string()),
        e => crate::err(e),
    }
}

fn dtype(name: &str) -> PyResult<DType> {
    let name = name.strip_prefix("torch.").unwrap_or(name);
    DType::ALL
        .into_iter()
        .find(|d| d.to_string() == name)
        .ok_or_else(|| PyValueError::new_err(format!("dtype {name:?} is not supported by symmem")))
}

fn op(name: &str) -> PyResult<ReduceOp> {
    ReduceOp::parse(name).map_err(err)
}

/// A wait's timeout: the caller's, else `SYMMEM_OP_TIMEOUT` (what every operator waits).
fn timeout(t: Option<f64>) -> PyResult<Duration> {
    Ok(seconds(t)?.unwrap_or_else(symmem::config::op_timeout))
}

/// Memory that Rust owns or maps (a symmetric allocation, a peer's buffer, an operator's
/// result), exported through the buffer protocol as writable bytes.
#[pyclass(name = "Buffer", module = "symmem._native", frozen, weakref)]
pub struct PyBuffer(Tensor);

#[catch_panics]
#[pymethods]
impl PyBuffer {
    /// The address of the first byte.
    fn address(&self) -> usize {
        self.0.data_ptr() as usize
    }

    /// The size in bytes.
    fn nbytes(&self) -> usize {
        self.0.nbytes()
    }

    /// The shape of the tensor this buffer holds.
    fn shape(&self) -> Vec<usize> {
        self.0.shape().to_vec()
    }

    /// The dtype name (`float32`, `bfloat16`, ...) of the tensor this buffer holds.
    fn dtype(&self) -> String {
        self.0.dtype().to_string()
    }

    /// Whether this is (part of) a symmetric allocation.
    fn is_symmetric(&self) -> bool {
        symm::is_symm_mem_tensor(&self.0)
    }

    /// A tensor reference to part of this buffer: `shape` and `strides` (in elements of `dtype`)
    /// from `byte_offset`.
    fn tensor(
        &self,
        dtype_name: &str,
        shape: Vec<usize>,
        strides: Vec<usize>,
        byte_offset: usize,
    ) -> PyResult<PyTensor> {
        Ok(PyTensor(self.0.reinterpret(dtype(dtype_name)?, &shape, &strides, byte_offset).map_err(err)?))
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let t = &slf.get().0;
        let len = ffi::Py_ssize_t::try_from(t.nbytes()).map_err(|_| PyValueError::new_err("buffer too large"))?;
        // SAFETY: `view` is the caller's Py_buffer to fill (the protocol's contract). The bytes
        // [data_ptr, data_ptr + nbytes) belong to the tensor, whose storage stays mapped while
        // this object lives; FillInfo stores a new reference to `slf` in the view, so the
        // exporter outlives every consumer (torch.frombuffer, numpy.frombuffer, memoryview).
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), t.data_ptr().cast(), len, 0, flags) };
        if rc == -1 { Err(PyErr::fetch(slf.py())) } else { Ok(()) }
    }
}

/// A typed, shaped view of memory that an operator reads or writes.
#[pyclass(name = "Tensor", module = "symmem._native", frozen)]
pub struct PyTensor(Tensor);

#[catch_panics]
#[pymethods]
impl PyTensor {
    /// A view of `nbytes` bytes at `ptr` owned by `owner` (a torch tensor or NumPy array, kept
    /// alive by this object) with the given layout.
    #[staticmethod]
    fn external(
        ptr: usize,
        nbytes: usize,
        owner: Py<PyAny>,
        dtype_name: &str,
        shape: Vec<usize>,
        strides: Vec<usize>,
    ) -> PyResult<PyTensor> {
        // SAFETY: the Python layer passes the address and extent of a CPU torch tensor or NumPy
        // array, and `owner` (that object) keeps its memory allocated and in place while this
        // tensor lives.
        let bytes = unsafe { Tensor::from_raw_parts(ptr as *mut u8, nbytes, Box::new(owner)) };
        Ok(PyTensor(bytes.reinterpret(dtype(dtype_name)?, &shape, &strides, 0).map_err(err)?))
    }
}

/// A group of ranks: the world of this process, from the launcher's environment.
#[pyclass(name = "Group", module = "symmem._native", frozen, weakref)]
pub struct PyGroup(Arc<Group>);

#[catch_panics]
#[pymethods]
impl PyGroup {
    #[getter]
    fn rank(&self) -> usize {
        self.0.rank()
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    #[getter]
    fn group_name(&self) -> String {
        self.0.name().to_string()
    }

    /// The global ranks of the members, in group-rank order.
    #[getter]
    fn ranks(&self) -> Vec<usize> {
        self.0.members().to_vec()
    }

    /// A sub-group of these group ranks (in that order), or None on ranks outside it. Every
    /// member calls it with the same ranks; it exchanges nothing until first used.
    fn split(&self, ranks: Vec<usize>) -> PyResult<Option<PyGroup>> {
        Ok(self.0.split(&ranks).map_err(err)?.map(|g| PyGroup(Arc::new(g))))
    }

    /// Waits until every rank of the group reached the barrier.
    #[pyo3(signature = (timeout = None))]
    fn barrier(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let t = crate::symm::timeout(timeout)?;
        py.detach(|| self.0.barrier(t)).map_err(err)
    }
}

/// The world group, joined on first use through the store at `MASTER_ADDR:MASTER_PORT` (as set
/// by `symmem run` or torchrun).
#[catch_panics]
#[pyfunction]
fn world(py: Python<'_>) -> PyResult<PyGroup> {
    static WORLD: Mutex<Option<Arc<Group>>> = Mutex::new(None);
    // The lock is taken without the GIL: a thread waiting for it while holding the GIL would
    // keep the joining thread from taking the GIL back.
    py.detach(|| {
        let mut slot = WORLD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(g) = &*slot {
            return Ok(g.clone());
        }
        let g = Arc::new(Group::from_env()?);
        *slot = Some(g.clone());
        Ok(g)
    })
    .map(PyGroup)
    .map_err(err)
}

/// Allocates a zeroed symmetric buffer for `shape` elements of `dtype` (not collective).
#[catch_panics]
#[pyfunction]
fn empty(shape: Vec<usize>, dtype_name: &str) -> PyResult<PyBuffer> {
    Ok(PyBuffer(symm::empty(&shape, dtype(dtype_name)?, Device::Cpu).map_err(err)?))
}

/// Selects the symmetric-memory backend by name (only "CPU" exists here).
#[catch_panics]
#[pyfunction]
fn set_backend(name: &str) -> PyResult<()> {
    symm::set_backend(name).map_err(err)
}

/// The backend for `device` ("cpu": "CPU"; None for devices without one).
#[catch_panics]
#[pyfunction]
fn get_backend(device: &str) -> PyResult<Option<&'static str>> {
    Ok(symm::get_backend(Device::parse(device).map_err(err)?))
}

/// Sets the signal pad size of future allocations, in bytes.
#[catch_panics]
#[pyfunction]
fn set_signal_pad_size(size: usize) -> PyResult<()> {
    symm::set_signal_pad_size(size).map_err(err)
}

/// The signal pad size of future allocations, in bytes.
#[catch_panics]
#[pyfunction]
fn get_signal_pad_size() -> usize {
    symm::get_signal_pad_size()
}

/// The symmetric memory pool of the CPU: allocations from it are symmetric and reuse freed
/// blocks.
#[pyclass(name = "MemPool", module = "symmem._native", frozen)]
pub struct PyMemPool(Arc<symm::MemPool>);

#[catch_panics]
#[pymethods]
impl PyMemPool {
    /// A zeroed symmetric buffer of `shape` elements of `dtype_name` from the pool.
    fn empty(&self, shape: Vec<usize>, dtype_name: &str) -> PyResult<PyBuffer> {
        Ok(PyBuffer(self.0.empty(&shape, dtype(dtype_name)?).map_err(err)?))
    }

    /// Blocks the pool holds.
    fn blocks(&self) -> usize {
        self.0.blocks()
    }
}

/// The symmetric memory pool of `device` (the CPU's).
#[catch_panics]
#[pyfunction]
fn get_mem_pool(device: &str) -> PyResult<PyMemPool> {
    Ok(PyMemPool(symm::get_mem_pool(Device::parse(device).map_err(err)?).map_err(err)?))
}

/// Establishes symmetric memory for `tensor` among the ranks of `group` (collective).
#[catch_panics]
#[pyfunction]
fn rendezvous(py: Python<'_>, tensor: &PyTensor, group: &PyGroup) -> PyResult<PyHandle> {
    Ok(PyHandle(py.detach(|| symm::rendezvous(&tensor.0, &group.0)).map_err(err)?))
}

/// A rendezvoused symmetric allocation seen from this rank.
#[pyclass(name = "SymmetricMemory", module = "symmem._native", frozen)]
pub struct PyHandle(Arc<SymmHandle>);

#[catch_panics]
#[pymethods]
impl PyHandle {
    #[getter]
    fn rank(&self) -> usize {
        self.0.rank()
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    #[getter]
    fn buffer_ptrs(&self) -> PyResult<Vec<usize>> {
        self.0.buffer_ptrs().map_err(err)
    }

    #[getter]
    fn signal_pad_ptrs(&self) -> PyResult<Vec<usize>> {
        self.0.signal_pad_ptrs().map_err(err)
    }

    #[getter]
    fn buffer_size(&self) -> usize {
        self.0.buffer_size()
    }

    #[getter]
    fn signal_pad_size(&self) -> usize {
        self.0.signal_pad_size()
    }

    #[getter]
    fn offset(&self) -> usize {
        self.0.offset()
    }

    #[getter]
    fn group_name(&self) -> String {
        self.0.group_name().to_string()
    }

    /// The ranks on other hosts (reached through the transport).
    #[getter]
    fn remote_ranks(&self) -> Vec<usize> {
        self.0.remote_ranks()
    }

    /// The ranks on this host, this one included.
    #[getter]
    fn local_ranks(&self) -> Vec<usize> {
        self.0.local_ranks().to_vec()
    }

    /// Rank `rank`'s buffer as `sizes` elements of `dtype` from element `storage_offset`.
    fn get_buffer(
        &self,
        rank: usize,
        sizes: Vec<usize>,
        dtype_name: &str,
        storage_offset: usize,
    ) -> PyResult<PyBuffer> {
        Ok(PyBuffer(self.0.get_buffer(rank, &sizes, dtype(dtype_name)?, storage_offset).map_err(err)?))
    }

    /// Peer `peer`'s copy of the rendezvoused tensor: `sizes` elements of `dtype` from this
    /// handle's offset in the allocation.
    fn get_remote_tensor(&self, peer: usize, sizes: Vec<usize>, dtype_name: &str) -> PyResult<PyBuffer> {
        Ok(PyBuffer(self.0.get_remote_tensor(peer, &sizes, dtype(dtype_name)?).map_err(err)?))
    }

    /// Rank `rank`'s signal pad (uint32 words).
    fn get_signal_pad(&self, rank: usize) -> PyResult<PyBuffer> {
        Ok(PyBuffer(self.0.get_signal_pad(rank).map_err(err)?))
    }

    #[pyo3(signature = (channel = 0, timeout = None))]
    fn barrier(&self, py: Python<'_>, channel: usize, timeout: Option<f64>) -> PyResult<()> {
        let t = crate::symm::timeout(timeout)?;
        py.detach(|| self.0.barrier(channel, t)).map_err(err)
    }

    #[pyo3(signature = (dst_rank, channel = 0, timeout = None))]
    fn put_signal(&self, py: Python<'_>, dst_rank: usize, channel: usize, timeout: Option<f64>) -> PyResult<()> {
        let t = crate::symm::timeout(timeout)?;
        py.detach(|| self.0.put_signal(dst_rank, channel, t)).map_err(err)
    }

    #[pyo3(signature = (src_rank, channel = 0, timeout = None))]
    fn wait_signal(&self, py: Python<'_>, src_rank: usize, channel: usize, timeout: Option<f64>) -> PyResult<()> {
        let t = crate::symm::timeout(timeout)?;
        py.detach(|| self.0.wait_signal(src_rank, channel, t)).map_err(err)
    }
}

/// Copies from `peer`'s allocation behind `hdl` (at element `offset`) into `dst`.
#[catch_panics]
#[pyfunction]
fn get(py: Python<'_>, dst: &PyTensor, hdl: &PyHandle, peer: usize, offset: usize) -> PyResult<()> {
    py.detach(|| symm::get(&dst.0, &hdl.0, peer, offset)).map_err(err)
}

/// Copies `src` into `peer`'s allocation, then signals `peer`.
#[catch_panics]
#[pyfunction]
fn put_signal(py: Python<'_>, src: &PyTensor, hdl: &PyHandle, peer: usize) -> PyResult<()> {
    py.detach(|| symm::put_signal(&src.0, &hdl.0, peer)).map_err(err)
}

/// Waits for `peer`'s [`put_signal`].
#[catch_panics]
#[pyfunction]
fn wait_signal(py: Python<'_>, hdl: &PyHandle, peer: usize) -> PyResult<()> {
    py.detach(|| symm::wait_signal(&hdl.0, peer)).map_err(err)
}

/// NVSHMEM's put: the whole of symmetric `tensor` into the same tensor on `peer`.
#[catch_panics]
#[pyfunction]
fn nvshmem_put(py: Python<'_>, tensor: &PyTensor, peer: usize) -> PyResult<()> {
    py.detach(|| symm::nvshmem_put(&tensor.0, peer)).map_err(err)
}

/// NVSHMEM's get: the same symmetric tensor on `peer` into `tensor`.
#[catch_panics]
#[pyfunction]
fn nvshmem_get(py: Python<'_>, tensor: &PyTensor, peer: usize) -> PyResult<()> {
    py.detach(|| symm::nvshmem_get(&tensor.0, peer)).map_err(err)
}

/// `size` elements from element `offset` of `peer`'s allocation behind `hdl` into `dst`.
#[catch_panics]
#[pyfunction]
fn nvshmem_get_out(
    py: Python<'_>,
    dst: &PyTensor,
    hdl: &PyHandle,
    offset: usize,
    size: usize,
    peer: usize,
) -> PyResult<()> {
    py.detach(|| symm::nvshmem_get_out(&dst.0, &hdl.0, offset, size, peer)).map_err(err)
}

/// Puts `tensor` into `peer`'s copy, then sets `peer`'s `sigpad` to `signal`.
#[catch_panics]
#[pyfunction]
fn nvshmem_put_with_signal(
    py: Python<'_>,
    tensor: &PyTensor,
    sigpad: &PyTensor,
    signal: u64,
    peer: usize,
) -> PyResult<()> {
    py.detach(|| symm::nvshmem_put_with_signal(&tensor.0, &sigpad.0, signal, peer)).map_err(err)
}

/// Waits until this rank's `sigpad` equals `signal`.
#[catch_panics]
#[pyfunction]
fn nvshmem_wait_for_signal(py: Python<'_>, sigpad: &PyTensor, signal: u64, peer: usize) -> PyResult<()> {
    py.detach(|| symm::nvshmem_wait_for_signal(&sigpad.0, signal, peer)).map_err(err)
}

/// PyTorch's NCCL put with signal: `tensor` into `peer`'s copy, then the first 8 bytes of
/// `peer`'s signal pad of its allocation set to `signal`.
#[catch_panics]
#[pyfunction]
fn nccl_put_with_signal(py: Python<'_>, tensor: &PyTensor, signal: u64, peer: usize) -> PyResult<()> {
    py.detach(|| symm::nccl_put_with_signal(&tensor.0, signal, peer)).map_err(err)
}

/// Waits until the first 8 bytes of this rank's signal pad of `sigpad`'s allocation hold at
/// least `signal`.
#[catch_panics]
#[pyfunction]
fn nccl_wait_for_signal(py: Python<'_>, sigpad: &PyTensor, signal: u64) -> PyResult<()> {
    py.detach(|| symm::nccl_wait_for_signal(&sigpad.0, signal)).map_err(err)
}

/// Runs an operator with the GIL released.
fn run(py: Python<'_>, f: impl FnOnce() -> symmem::Result<()> + Send) -> PyResult<()> {
    py.detach(f).map_err(err)
}

/// One-shot all-reduce of symmetric `input` into a new buffer.
#[catch_panics]
#[pyfunction]
fn one_shot_all_reduce(py: Python<'_>, input: &PyTensor, reduce_op: &str, group: &PyGroup) -> PyResult<PyBuffer> {
    let op = op(reduce_op)?;
    Ok(PyBuffer(py.detach(|| ops::one_shot_all_reduce(&input.0, op, &group.0)).map_err(err)?))
}

/// One-shot all-reduce of symmetric `input` into `out`.
#[catch_panics]
#[pyfunction]
fn one_shot_all_reduce_out(
    py: Python<'_>,
    input: &PyTensor,
    reduce_op: &str,
    group: &PyGroup,
    out: &PyTensor,
) -> PyResult<()> {
    let op = op(reduce_op)?;
    run(py, || ops::one_shot_all_reduce_out(&input.0, op, &group.0, &out.0))
}

/// Two-shot all-reduce of symmetric `input` in place.
#[catch_panics]
#[pyfunction]
fn two_shot_all_reduce_(py: Python<'_>, input: &PyTensor, reduce_op: &str, group: &PyGroup) -> PyResult<()> {
    let op = op(reduce_op)?;
    run(py, || ops::two_shot_all_reduce_(&input.0, op, &group.0))
}

/// Two-shot all-reduce of symmetric `input` into `out`.
#[catch_panics]
#[pyfunction]
fn two_shot_all_reduce_out(
    py: Python<'_>,
    input: &PyTensor,
    reduce_op: &str,
    group: &PyGroup,
    out: &PyTensor,
) -> PyResult<()> {
    let op = op(reduce_op)?;
    run(py, || ops::two_shot_all_reduce_out(&input.0, op, &group.0, &out.0))
}

/// All-reduce of symmetric `tensor` in place, choosing the algorithm by size.
#[catch_panics]
#[pyfunction]
fn all_reduce(py: Python<'_>, tensor: &PyTensor, reduce_op: &str, group: &PyGroup) -> PyResult<()> {
    let op = op(reduce_op)?;
    run(py, || ops::all_reduce(&tensor.0, op, &group.0))
}

/// Reduce-scatter of symmetric `input`: this rank's slice of the reduction into `out`.
#[catch_panics]
#[pyfunction]
fn reduce_scatter_out(
    py: Python<'_>,
    input: &PyTensor,
    reduce_op: &str,
    group: &PyGroup,
    split_last_dim: bool,
    out: &PyTensor,
) -> PyResult<()> {
    let op = op(reduce_op)?;
    run(py, || ops::reduce_scatter_out(&input.0, op, &group.0, split_last_dim, &out.0))
}

/// All-gather of symmetric `input` into `out`.
#[catch_panics]
#[pyfunction]
fn all_gather_into(py: Python<'_>, input: &PyTensor, group: &PyGroup, out: &PyTensor) -> PyResult<()> {
    run(py, || ops::all_gather_into(&input.0, &group.0, &out.0))
}

/// PyTorch's low-contention all-gather of `input` (symmetric or not) into a new buffer.
#[catch_panics]
#[pyfunction]
fn low_contention_all_gather(py: Python<'_>, input: &PyTensor, group: &PyGroup) -> PyResult<PyBuffer> {
    Ok(PyBuffer(py.detach(|| ops::low_contention_all_gather(&input.0, &group.0)).map_err(err)?))
}

/// PyTorch's low-contention reduce-scatter of `input` (symmetric or not) along its first
/// dimension into a new buffer.
#[catch_panics]
#[pyfunction]
fn low_contention_reduce_scatter(
    py: Python<'_>,
    input: &PyTensor,
    reduce_op: &str,
    group: &PyGroup,
) -> PyResult<PyBuffer> {
    let op = op(reduce_op)?;
    Ok(PyBuffer(py.detach(|| ops::low_contention_reduce_scatter(&input.0, op, &group.0)).map_err(err)?))
}

/// Broadcast of `root`'s symmetric `input` to every rank, in place.
#[catch_panics]
#[pyfunction]
fn broadcast_(py: Python<'_>, input: &PyTensor, root: usize, group: &PyGroup) -> PyResult<()> {
    run(py, || ops::broadcast_(&input.0, root, &group.0))
}

/// All-to-all of symmetric `input` into `out`.
#[catch_panics]
#[pyfunction]
fn all_to_all(py: Python<'_>, input: &PyTensor, out: &PyTensor, group: &PyGroup) -> PyResult<()> {
    run(py, || ops::all_to_all(&input.0, &out.0, &group.0))
}

/// Variable-size all-to-all: `in_splits[j]` rows of `input` go to rank j; `out_splits_offsets`
/// receives (splits, offsets) of what arrived.
#[catch_panics]
#[pyfunction]
fn all_to_all_vdev(
    py: Python<'_>,
    input: &PyTensor,
    out: &PyTensor,
    in_splits: &PyTensor,
    out_splits_offsets: &PyTensor,
    group: &PyGroup,
) -> PyResult<()> {
    run(py, || ops::all_to_all_vdev(&input.0, &out.0, &in_splits.0, &out_splits_offsets.0, &group.0))
}

/// Expert-parallel dispatch: rank-major in, expert-major out, segments aligned to `major_align`.
#[catch_panics]
#[pyfunction]
#[pyo3(signature = (input, out, in_splits, out_splits_offsets, group, major_align = None))]
fn all_to_all_vdev_2d(
    py: Python<'_>,
    input: &PyTensor,
    out: &PyTensor,
    in_splits: &PyTensor,
    out_splits_offsets: &PyTensor,
    group: &PyGroup,
    major_align: Option<usize>,
) -> PyResult<()> {
    run(py, || ops::all_to_all_vdev_2d(&input.0, &out.0, &in_splits.0, &out_splits_offsets.0, &group.0, major_align))
}

/// Expert-parallel combine: the inverse of [`all_to_all_vdev_2d`], with explicit input offsets.
#[catch_panics]
#[pyfunction]
fn all_to_all_vdev_2d_offset(
    py: Python<'_>,
    input: &PyTensor,
    out: &PyTensor,
    in_splits_offsets: &PyTensor,
    out_splits_offsets: &PyTensor,
    group: &PyGroup,
) -> PyResult<()> {
    run(py, || ops::all_to_all_vdev_2d_offset(&input.0, &out.0, &in_splits_offsets.0, &out_splits_offsets.0, &group.0))
}

/// Reduces every rank's `in_tile` into `root`'s `out_tile`.
#[catch_panics]
#[pyfunction]
fn tile_reduce(
    py: Python<'_>,
    in_tile: &PyTensor,
    out_tile: &PyTensor,
    root: usize,
    group: &PyGroup,
    reduce_op: &str,
) -> PyResult<()> {
    let op = op(reduce_op)?;
    run(py, || ops::tile_reduce(&in_tile.0, &out_tile.0, root, &group.0, op))
}

/// Reduces tile i of every rank into `roots[i]`'s `out_tile`.
#[catch_panics]
#[pyfunction]
fn multi_root_tile_reduce(
    py: Python<'_>,
    in_tiles: Vec<PyRef<'_, PyTensor>>,
    out_tile: &PyTensor,
    roots: Vec<usize>,
    group: &PyGroup,
    reduce_op: &str,
) -> PyResult<()> {
    let op = op(reduce_op)?;
    let tiles: Vec<Tensor> = in_tiles.iter().map(|t| t.0.clone()).collect();
    run(py, || ops::multi_root_tile_reduce(&tiles, &out_tile.0, &roots, &group.0, op))
}

/// Reduce-scatter of `input` along `dim` into one `out` per destination block.
#[catch_panics]
#[pyfunction]
#[pyo3(signature = (input, out, group, dim, offsets, dst_ranks, reduce_op))]
#[expect(clippy::too_many_arguments, reason = "the operator's Python signature, plus the GIL token")]
fn reduce_scatter_offset(
    py: Python<'_>,
    input: &PyTensor,
    out: Vec<PyRef<'_, PyTensor>>,
    group: &PyGroup,
    dim: usize,
    offsets: Option<Vec<usize>>,
    dst_ranks: Option<Vec<usize>>,
    reduce_op: &str,
) -> PyResult<()> {
    let op = op(reduce_op)?;
    let outs: Vec<Tensor> = out.iter().map(|t| t.0.clone()).collect();
    run(py, || ops::reduce_scatter_offset(&input.0, &outs, &group.0, dim, offsets.as_deref(), dst_ranks.as_deref(), op))
}

/// All-to-all that scatters `scatter_dim` and gathers `gather_dim`.
#[catch_panics]
#[pyfunction]
fn all_to_all_nd(
    py: Python<'_>,
    input: &PyTensor,
    out: &PyTensor,
    scatter_dim: usize,
    gather_dim: usize,
    group: &PyGroup,
) -> PyResult<()> {
    run(py, || ops::all_to_all_nd(&input.0, &out.0, scatter_dim, gather_dim, &group.0))
}

/// All-gather of `a_shard` fused with a matmul by each of `bs`: (gathered A or None, outputs).
#[catch_panics]
#[pyfunction]
fn fused_all_gather_matmul(
    py: Python<'_>,
    a_shard: &PyTensor,
    bs: Vec<PyRef<'_, PyTensor>>,
    gather_dim: usize,
    group: &PyGroup,
    return_a: bool,
) -> PyResult<(Option<PyBuffer>, Vec<PyBuffer>)> {
    let bs: Vec<Tensor> = bs.iter().map(|t| t.0.clone()).collect();
    let (a, outs) =
        py.detach(|| ops::fused_all_gather_matmul(&a_shard.0, &bs, gather_dim, &group.0, return_a)).map_err(err)?;
    Ok((a.map(PyBuffer), outs.into_iter().map(PyBuffer).collect()))
}

/// A matmul fused with a reduce-scatter of its result along `scatter_dim`.
#[catch_panics]
#[pyfunction]
fn fused_matmul_reduce_scatter(
    py: Python<'_>,
    a: &PyTensor,
    b: &PyTensor,
    reduce_op: &str,
    scatter_dim: usize,
    group: &PyGroup,
) -> PyResult<PyBuffer> {
    let op = op(reduce_op)?;
    Ok(PyBuffer(py.detach(|| ops::fused_matmul_reduce_scatter(&a.0, &b.0, op, scatter_dim, &group.0)).map_err(err)?))
}

// The operators that need GPU hardware: each calls its Rust counterpart, which answers
// "unsupported" with what it needs (NotImplementedError in Python).

#[catch_panics]
#[pyfunction]
fn multimem_all_reduce_(input: &PyTensor, reduce_op: &str, group: &PyGroup) -> PyResult<()> {
    ops::multimem_all_reduce_(&input.0, op(reduce_op)?, &group.0).map_err(err)
}

#[catch_panics]
#[pyfunction]
fn multimem_all_gather_out(input: &PyTensor, group: &PyGroup, out: &PyTensor) -> PyResult<()> {
    ops::multimem_all_gather_out(&input.0, &group.0, &out.0).map_err(err)
}

#[catch_panics]
#[pyfunction]
fn multimem_one_shot_all_reduce(input: &PyTensor, reduce_op: &str, group: &PyGroup) -> PyResult<PyBuffer> {
    ops::multimem_one_shot_all_reduce(&input.0, op(reduce_op)?, &group.0).map(PyBuffer).map_err(err)
}

#[catch_panics]
#[pyfunction]
fn multimem_one_shot_reduce_out(
    input: &PyTensor,
    reduce_op: &str,
    root: usize,
    group: &PyGroup,
    out: &PyTensor,
) -> PyResult<()> {
    ops::multimem_one_shot_reduce_out(&input.0, op(reduce_op)?, root, &group.0, &out.0).map_err(err)
}

#[catch_panics]
#[pyfunction]
fn memset32_(input: &PyTensor, offset: usize, value: u32, count: usize) -> PyResult<()> {
    ops::memset32_(&input.0, offset, value, count).map_err(err)
}

#[catch_panics]
#[pyfunction]
fn memcpy_to_multicast_(out: &PyTensor, src: &PyTensor, byte_offset: usize, group: &PyGroup) -> PyResult<()> {
    ops::memcpy_to_multicast_(&out.0, &src.0, byte_offset, &group.0).map_err(err)
}

#[catch_panics]
#[pyfunction]
fn stream_write_value32_(input: &PyTensor, offset: usize, value: u32) -> PyResult<()> {
    ops::stream_write_value32_(&input.0, offset, value).map_err(err)
}

#[catch_panics]
#[pyfunction]
fn fused_all_gather_scaled_matmul() -> PyResult<()> {
    ops::fused_all_gather_scaled_matmul().map_err(err)
}

#[catch_panics]
#[pyfunction]
fn fused_scaled_matmul_reduce_scatter() -> PyResult<()> {
    ops::fused_scaled_matmul_reduce_scatter().map_err(err)
}

/// Adds the symmetric-memory classes and functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBuffer>()?;
    m.add_class::<PyTensor>()?;
    m.add_class::<PyGroup>()?;
    m.add_class::<PyHandle>()?;
    m.add_class::<PyMemPool>()?;
    m.add_function(wrap_pyfunction!(set_backend, m)?)?;
    m.add_function(wrap_pyfunction!(get_backend, m)?)?;
    m.add_function(wrap_pyfunction!(set_signal_pad_size, m)?)?;
    m.add_function(wrap_pyfunction!(get_signal_pad_size, m)?)?;
    m.add_function(wrap_pyfunction!(get_mem_pool, m)?)?;
    m.add_function(wrap_pyfunction!(world, m)?)?;
    m.add_function(wrap_pyfunction!(empty, m)?)?;
    m.add_function(wrap_pyfunction!(rendezvous, m)?)?;
    m.add_function(wrap_pyfunction!(get, m)?)?;
    m.add_function(wrap_pyfunction!(put_signal, m)?)?;
    m.add_function(wrap_pyfunction!(wait_signal, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_put, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_get, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_get_out, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_put_with_signal, m)?)?;
    m.add_function(wrap_pyfunction!(nvshmem_wait_for_signal, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_put_with_signal, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_wait_for_signal, m)?)?;
    m.add_function(wrap_pyfunction!(one_shot_all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(one_shot_all_reduce_out, m)?)?;
    m.add_function(wrap_pyfunction!(two_shot_all_reduce_, m)?)?;
    m.add_function(wrap_pyfunction!(two_shot_all_reduce_out, m)?)?;
    m.add_function(wrap_pyfunction!(all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(reduce_scatter_out, m)?)?;
    m.add_function(wrap_pyfunction!(all_gather_into, m)?)?;
    m.add_function(wrap_pyfunction!(low_contention_all_gather, m)?)?;
    m.add_function(wrap_pyfunction!(low_contention_reduce_scatter, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast_, m)?)?;
    m.add_function(wrap_pyfunction!(all_to_all, m)?)?;
    m.add_function(wrap_pyfunction!(all_to_all_vdev, m)?)?;
    m.add_function(wrap_pyfunction!(all_to_all_vdev_2d, m)?)?;
    m.add_function(wrap_pyfunction!(all_to_all_vdev_2d_offset, m)?)?;
    m.add_function(wrap_pyfunction!(tile_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(multi_root_tile_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(reduce_scatter_offset, m)?)?;
    m.add_function(wrap_pyfunction!(all_to_all_nd, m)?)?;
    m.add_function(wrap_pyfunction!(fused_all_gather_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(fused_matmul_reduce_scatter, m)?)?;
    m.add_function(wrap_pyfunction!(multimem_all_reduce_, m)?)?;
    m.add_function(wrap_pyfunction!(multimem_all_gather_out, m)?)?;
    m.add_function(wrap_pyfunction!(multimem_one_shot_all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(multimem_one_shot_reduce_out, m)?)?;
    m.add_function(wrap_pyfunction!(memset32_, m)?)?;
    m.add_function(wrap_pyfunction!(memcpy_to_multicast_, m)?)?;
    m.add_function(wrap_pyfunction!(stream_write_value32_, m)?)?;
    m.add_function(wrap_pyfunction!(fused_all_gather_scaled_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(fused_scaled_matmul_reduce_scatter, m)?)?;
    Ok(())
}
