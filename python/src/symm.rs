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

use crate::{err, seconds};

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

fn timeout(t: Option<f64>) -> PyResult<Duration> {
    Ok(seconds(t)?.unwrap_or(symm::DEFAULT_TIMEOUT))
}

/// Memory that Rust owns or maps (a symmetric allocation, a peer's buffer, an operator's
/// result), exported through the buffer protocol as writable bytes.
#[pyclass(name = "Buffer", module = "symmem._native", frozen, weakref)]
pub struct PyBuffer(Tensor);

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
#[pyclass(name = "Group", module = "symmem._native", frozen)]
pub struct PyGroup(Arc<Group>);

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

    /// Waits until every rank of the group reached the barrier.
    #[pyo3(signature = (timeout = None))]
    fn barrier(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let t = crate::symm::timeout(timeout)?;
        py.detach(|| self.0.barrier(t)).map_err(err)
    }
}

/// The world group, joined on first use through the store at `MASTER_ADDR:MASTER_PORT` (as set
/// by `symmem run` or torchrun).
#[pyfunction]
fn world(py: Python<'_>) -> PyResult<PyGroup> {
    static WORLD: Mutex<Option<Arc<Group>>> = Mutex::new(None);
    let mut slot = WORLD.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(g) = &*slot {
        return Ok(PyGroup(g.clone()));
    }
    let g = Arc::new(py.detach(Group::from_env).map_err(err)?);
    *slot = Some(g.clone());
    Ok(PyGroup(g))
}

/// Allocates a zeroed symmetric buffer for `shape` elements of `dtype` (not collective).
#[pyfunction]
fn empty(shape: Vec<usize>, dtype_name: &str) -> PyResult<PyBuffer> {
    Ok(PyBuffer(symm::empty(&shape, dtype(dtype_name)?, Device::Cpu).map_err(err)?))
}

/// Establishes symmetric memory for `tensor` among the ranks of `group` (collective).
#[pyfunction]
fn rendezvous(py: Python<'_>, tensor: &PyTensor, group: &PyGroup) -> PyResult<PyHandle> {
    Ok(PyHandle(py.detach(|| symm::rendezvous(&tensor.0, &group.0)).map_err(err)?))
}

/// A rendezvoused symmetric allocation seen from this rank.
#[pyclass(name = "SymmetricMemory", module = "symmem._native", frozen)]
pub struct PyHandle(Arc<SymmHandle>);

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
    fn buffer_ptrs(&self) -> Vec<usize> {
        self.0.buffer_ptrs()
    }

    #[getter]
    fn signal_pad_ptrs(&self) -> Vec<usize> {
        self.0.signal_pad_ptrs()
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
#[pyfunction]
fn get(py: Python<'_>, dst: &PyTensor, hdl: &PyHandle, peer: usize, offset: usize) -> PyResult<()> {
    py.detach(|| symm::get(&dst.0, &hdl.0, peer, offset)).map_err(err)
}

/// Copies `src` into `peer`'s allocation, then signals `peer`.
#[pyfunction]
fn put_signal(py: Python<'_>, src: &PyTensor, hdl: &PyHandle, peer: usize) -> PyResult<()> {
    py.detach(|| symm::put_signal(&src.0, &hdl.0, peer)).map_err(err)
}

/// Waits for `peer`'s [`put_signal`].
#[pyfunction]
fn wait_signal(py: Python<'_>, hdl: &PyHandle, peer: usize) -> PyResult<()> {
    py.detach(|| symm::wait_signal(&hdl.0, peer)).map_err(err)
}

/// Runs an operator with the GIL released.
fn run(py: Python<'_>, f: impl FnOnce() -> symmem::Result<()> + Send) -> PyResult<()> {
    py.detach(f).map_err(err)
}

/// One-shot all-reduce of symmetric `input` into a new buffer.
#[pyfunction]
fn one_shot_all_reduce(py: Python<'_>, input: &PyTensor, reduce_op: &str, group: &PyGroup) -> PyResult<PyBuffer> {
    let op = op(reduce_op)?;
    Ok(PyBuffer(py.detach(|| ops::one_shot_all_reduce(&input.0, op, &group.0)).map_err(err)?))
}

/// One-shot all-reduce of symmetric `input` into `out`.
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
#[pyfunction]
fn two_shot_all_reduce_(py: Python<'_>, input: &PyTensor, reduce_op: &str, group: &PyGroup) -> PyResult<()> {
    let op = op(reduce_op)?;
    run(py, || ops::two_shot_all_reduce_(&input.0, op, &group.0))
}

/// Two-shot all-reduce of symmetric `input` into `out`.
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
#[pyfunction]
fn all_reduce(py: Python<'_>, tensor: &PyTensor, reduce_op: &str, group: &PyGroup) -> PyResult<()> {
    let op = op(reduce_op)?;
    run(py, || ops::all_reduce(&tensor.0, op, &group.0))
}

/// Reduce-scatter of symmetric `input`: this rank's slice of the reduction into `out`.
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
#[pyfunction]
fn all_gather_into(py: Python<'_>, input: &PyTensor, group: &PyGroup, out: &PyTensor) -> PyResult<()> {
    run(py, || ops::all_gather_into(&input.0, &group.0, &out.0))
}

/// Broadcast of `root`'s symmetric `input` to every rank, in place.
#[pyfunction]
fn broadcast_(py: Python<'_>, input: &PyTensor, root: usize, group: &PyGroup) -> PyResult<()> {
    run(py, || ops::broadcast_(&input.0, root, &group.0))
}

/// All-to-all of symmetric `input` into `out`.
#[pyfunction]
fn all_to_all(py: Python<'_>, input: &PyTensor, out: &PyTensor, group: &PyGroup) -> PyResult<()> {
    run(py, || ops::all_to_all(&input.0, &out.0, &group.0))
}

/// Adds the symmetric-memory classes and functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBuffer>()?;
    m.add_class::<PyTensor>()?;
    m.add_class::<PyGroup>()?;
    m.add_class::<PyHandle>()?;
    m.add_function(wrap_pyfunction!(world, m)?)?;
    m.add_function(wrap_pyfunction!(empty, m)?)?;
    m.add_function(wrap_pyfunction!(rendezvous, m)?)?;
    m.add_function(wrap_pyfunction!(get, m)?)?;
    m.add_function(wrap_pyfunction!(put_signal, m)?)?;
    m.add_function(wrap_pyfunction!(wait_signal, m)?)?;
    m.add_function(wrap_pyfunction!(one_shot_all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(one_shot_all_reduce_out, m)?)?;
    m.add_function(wrap_pyfunction!(two_shot_all_reduce_, m)?)?;
    m.add_function(wrap_pyfunction!(two_shot_all_reduce_out, m)?)?;
    m.add_function(wrap_pyfunction!(all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(reduce_scatter_out, m)?)?;
    m.add_function(wrap_pyfunction!(all_gather_into, m)?)?;
    m.add_function(wrap_pyfunction!(broadcast_, m)?)?;
    m.add_function(wrap_pyfunction!(all_to_all, m)?)?;
    Ok(())
}
