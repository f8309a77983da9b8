//! `symmem._native`: the Rust core of the `symmem` Python package. The Python layer
//! (`py/symmem`) gives it PyTorch's transport API; this module only moves bytes.

use std::collections::BTreeMap;
use std::time::Duration;

use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};
use symmem::tensor::Tensor;
use symmem::transport::{self, Memory, MemoryView, MutableMemoryView, RemoteBuffer, Transport, Work};
use symmem_python_macros::catch_panics;

mod log;
mod panics;
mod symm;

/// The largest synchronous transfer that may run holding the GIL (when the backend finishes it
/// on the calling thread): a 64 KiB copy takes about a microsecond, less than what releasing
/// and taking back the GIL costs a small call under contention.
const GIL_HELD_BYTES: usize = 64 << 10;

fn err(e: symmem::Error) -> PyErr {
    use symmem::TransferKind::*;
    match e {
        symmem::Error::Timeout { .. } | symmem::Error::Transfer { kind: TimedOut, .. } => {
            PyTimeoutError::new_err(e.to_string())
        }
        symmem::Error::Transfer { kind: Unsupported, .. } => PyNotImplementedError::new_err(e.to_string()),
        symmem::Error::Transfer { kind: PeerLost, .. } => typed("PeerLostError", e.to_string()),
        symmem::Error::Transfer { kind: Refused, .. } => typed("RefusedError", e.to_string()),
        symmem::Error::Transfer { kind: Busy, .. } => typed("BusyError", e.to_string()),
        symmem::Error::InvalidArgument(_) => PyValueError::new_err(e.to_string()),
        symmem::Error::Unsupported { .. } => PyNotImplementedError::new_err(e.to_string()),
        e => PyRuntimeError::new_err(e.to_string()),
    }
}

/// The exception `name` of `symmem.errors` (each a RuntimeError too), or a plain RuntimeError
/// if that module cannot be imported (the extension used without its package).
fn typed(name: &str, msg: String) -> PyErr {
    Python::attach(|py| {
        match py
            .import("symmem.errors")
            .and_then(|m| m.getattr(name))
            .and_then(|c| c.cast_into::<PyType>().map_err(Into::into))
        {
            Ok(cls) => PyErr::from_type(cls, msg),
            Err(_) => PyRuntimeError::new_err(msg),
        }
    })
}

/// The argument `timeout` in seconds (`None`: none given). Finite and nonnegative, however large:
/// past what a `Duration` holds it means no deadline (see `symmem::config::timeout_from_secs`).
fn seconds(t: Option<f64>) -> PyResult<Option<Duration>> {
    t.map(|s| seconds_of("timeout", s)).transpose()
}

/// Argument `name`, `s` seconds, as a timeout; a `ValueError` naming it unless finite and
/// nonnegative.
fn seconds_of(name: &str, s: f64) -> PyResult<Duration> {
    symmem::config::timeout_from_secs(s).ok_or_else(|| {
        PyValueError::new_err(format!("{name} must be a finite, nonnegative number of seconds, not {s}"))
    })
}

/// A one-sided transport endpoint.
#[pyclass(name = "Transport", module = "symmem._native")]
struct PyTransport(Transport);

#[catch_panics]
#[pymethods]
impl PyTransport {
    #[new]
    #[pyo3(signature = (backend = "auto", options = None))]
    fn new(backend: &str, options: Option<BTreeMap<String, String>>) -> PyResult<Self> {
        Ok(PyTransport(transport::new_transport(backend, None, &options.unwrap_or_default()).map_err(err)?))
    }

    #[pyo3(signature = (timeout = None))]
    fn bind<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyBytes>> {
        let t = seconds(timeout)?;
        let url = py.detach(|| self.0.bind(t)).map_err(err)?;
        Ok(PyBytes::new(py, &url))
    }

    #[pyo3(signature = (peer_url, timeout = None))]
    fn connect(&self, py: Python<'_>, peer_url: Vec<u8>, timeout: Option<f64>) -> PyResult<()> {
        let t = seconds(timeout)?;
        py.detach(|| self.0.connect(&peer_url, t)).map_err(err)
    }

    fn connected(&self) -> bool {
        self.0.connected()
    }

    fn describe(&self) -> String {
        self.0.describe()
    }

    /// Registers `nbytes` at address `ptr`, owned by `owner` (kept alive while registered).
    #[pyo3(signature = (ptr, nbytes, owner, read_only = false))]
    fn register(&self, ptr: usize, nbytes: usize, owner: Py<PyAny>, read_only: bool) -> PyResult<PyMemory> {
        // SAFETY: the Python layer passes the data pointer and size of a contiguous tensor or
        // array, and `owner` (that object) keeps the memory alive and in place while the
        // registration (which holds the tensor) lives.
        let t = unsafe { Tensor::from_raw_parts(ptr as *mut u8, nbytes, Box::new(owner)) };
        let m = if read_only { self.0.register_memory_read_only(&t) } else { self.0.register_memory(&t) };
        Ok(PyMemory(m.map_err(err)?))
    }

    fn unregister(&self, memory: &PyMemory) -> PyResult<()> {
        self.0.unregister_memory(&memory.0).map_err(err)
    }

    /// Starts a write; the GIL is released while it is submitted (a submit may wait for room
    /// in a socket, at most the timeout).
    #[pyo3(signature = (local, remote, timeout = None))]
    fn start_write(
        &self,
        py: Python<'_>,
        local: &PyView,
        remote: &PyRemoteBuffer,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let t = seconds(timeout)?;
        Ok(PyWork(py.detach(|| self.0.start_write(&local.0, &remote.0, t)).map_err(err)?))
    }

    /// Starts a read; the GIL is released while it is submitted.
    #[pyo3(signature = (local, remote, timeout = None))]
    fn start_read(
        &self,
        py: Python<'_>,
        local: &PyMutableView,
        remote: &PyRemoteBuffer,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let t = seconds(timeout)?;
        Ok(PyWork(py.detach(|| self.0.start_read(&local.0, &remote.0, t)).map_err(err)?))
    }

    /// Writes `local` to the start of `remote` and waits for it. A transfer of at most
    /// `GIL_HELD_BYTES` that the backend finishes on this thread (shm's copy) runs holding the
    /// GIL, as a small memcpy would; anything that can wait (a peer, a socket, a long copy)
    /// releases it.
    #[pyo3(signature = (local, remote, timeout = None))]
    fn write(&self, py: Python<'_>, local: &PyView, remote: &PyRemoteBuffer, timeout: Option<f64>) -> PyResult<()> {
        let t = seconds(timeout)?;
        if local.0.size() <= GIL_HELD_BYTES
            && let Some(done) = self.0.try_write_now(&local.0, &remote.0)
        {
            return done.map_err(err);
        }
        py.detach(|| self.0.write(&local.0, &remote.0, t)).map_err(err)
    }

    /// Reads the start of `remote` into `local` and waits for it (the GIL as in `write`).
    #[pyo3(signature = (local, remote, timeout = None))]
    fn read(
        &self,
        py: Python<'_>,
        local: &PyMutableView,
        remote: &PyRemoteBuffer,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let t = seconds(timeout)?;
        if local.0.size() <= GIL_HELD_BYTES
            && let Some(done) = self.0.try_read_now(&local.0, &remote.0)
        {
            return done.map_err(err);
        }
        py.detach(|| self.0.read(&local.0, &remote.0, t)).map_err(err)
    }

    #[pyo3(signature = (timeout = None))]
    fn close(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let t = seconds(timeout)?;
        py.detach(|| self.0.close(t)).map_err(err)
    }
}

/// Registered memory.
#[pyclass(name = "Memory", module = "symmem._native")]
struct PyMemory(Memory);

#[catch_panics]
#[pymethods]
impl PyMemory {
    #[pyo3(signature = (offset = 0, length = None))]
    fn to_view(&self, offset: usize, length: Option<usize>) -> PyResult<PyView> {
        Ok(PyView(self.0.to_view(offset, length).map_err(err)?))
    }

    #[pyo3(signature = (offset = 0, length = None))]
    fn to_mutable_view(&self, offset: usize, length: Option<usize>) -> PyResult<PyMutableView> {
        Ok(PyMutableView(self.0.to_mutable_view(offset, length).map_err(err)?))
    }

    fn to_remote_buffer(&self) -> PyResult<PyRemoteBuffer> {
        Ok(PyRemoteBuffer(self.0.to_remote_buffer().map_err(err)?))
    }

    fn nbytes(&self) -> usize {
        self.0.len()
    }

    fn is_live(&self) -> bool {
        self.0.is_live()
    }
}

/// A read-only view of registered memory.
#[pyclass(name = "MemoryView", module = "symmem._native")]
struct PyView(MemoryView);

#[catch_panics]
#[pymethods]
impl PyView {
    fn size(&self) -> usize {
        self.0.size()
    }
}

/// A writable view of registered memory.
#[pyclass(name = "MutableMemoryView", module = "symmem._native")]
struct PyMutableView(MutableMemoryView);

#[catch_panics]
#[pymethods]
impl PyMutableView {
    fn size(&self) -> usize {
        self.0.size()
    }

    fn as_view(&self) -> PyView {
        PyView(self.0.as_view().clone())
    }
}

/// A descriptor of a peer's registration.
#[pyclass(name = "RemoteBuffer", module = "symmem._native")]
#[derive(Clone)]
struct PyRemoteBuffer(RemoteBuffer);

#[catch_panics]
#[pymethods]
impl PyRemoteBuffer {
    fn serialize<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.serialize())
    }

    /// Parses a descriptor strictly; the GIL is released while it parses.
    #[staticmethod]
    fn deserialize(py: Python<'_>, data: Vec<u8>) -> PyResult<Self> {
        Ok(PyRemoteBuffer(py.detach(|| RemoteBuffer::deserialize(&data)).map_err(err)?))
    }

    fn slice(&self, offset: u64, length: u64) -> PyResult<Self> {
        Ok(PyRemoteBuffer(self.0.slice(offset, length).map_err(err)?))
    }

    fn nbytes(&self) -> u64 {
        self.0.len()
    }

    fn backend(&self) -> String {
        self.0.backend().to_string()
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

/// The completion of one transfer.
#[pyclass(name = "Work", module = "symmem._native")]
struct PyWork(Work);

#[catch_panics]
#[pymethods]
impl PyWork {
    /// Waits up to `timeout` seconds (None: the transfer's own timeout); the GIL is released.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let t = seconds(timeout)?;
        py.detach(|| self.0.wait(t)).map_err(err)?;
        Ok(true)
    }

    fn is_completed(&self) -> bool {
        self.0.is_completed()
    }

    fn is_success(&self) -> bool {
        self.0.is_success()
    }

    fn exception(&self) -> Option<String> {
        self.0.exception()
    }
}

/// Constructs, binds and connects a transport to `peer_rank` through the store at `store_addr`
/// (a PyTorch TCPStore or a symmem store), with PyTorch's key scheme, so it pairs with
/// `torch.distributed._transport.new_transport_rank` on the other side. The GIL is released.
#[catch_panics]
#[pyfunction]
#[pyo3(signature = (backend, store_addr, peer_rank, rank, bootstrap_timeout = 30.0, options = None))]
fn new_transport_rank(
    py: Python<'_>,
    backend: &str,
    store_addr: &str,
    peer_rank: u64,
    rank: u64,
    bootstrap_timeout: f64,
    options: Option<BTreeMap<String, String>>,
) -> PyResult<PyTransport> {
    let timeout = seconds_of("bootstrap_timeout", bootstrap_timeout)?;
    let options = options.unwrap_or_default();
    py.detach(|| {
        let mut client = symmem::store::ClientOptions::from_env()?;
        client.timeout = client.timeout.min(timeout);
        symmem::store::warn_if_unauthenticated(store_addr, &client);
        let store: std::sync::Arc<dyn symmem::store::Store> =
            std::sync::Arc::new(symmem::store::TcpStore::connect(store_addr, client)?);
        transport::new_transport_rank(backend, None, &store, peer_rank, rank, timeout, &options)
    })
    .map(PyTransport)
    .map_err(err)
}

/// The names of the registered transports.
#[catch_panics]
#[pyfunction]
fn available_transports() -> Vec<String> {
    transport::available_transports()
}

/// Runs the `symmem` command with `argv` (the program's name first) and returns its exit
/// status; `exe` is what to start again for ranks, guards and benchmark jobs (the console
/// script). The interpreter is released for the whole run.
#[catch_panics]
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<std::ffi::OsString>, exe: std::path::PathBuf) -> u8 {
    py.detach(move || symmem_cli::run_with(argv, Some(exe)))
}

#[catch_panics]
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Warnings (an unauthenticated store, a lost peer) reach Python's logging, logger `symmem`.
    log::install();
    // The package's version, and the version of the symmem library it was built with.
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("library_version", symmem::VERSION)?;
    m.add("commit", symmem_cli::COMMIT)?;
    m.add_class::<PyTransport>()?;
    m.add_class::<PyMemory>()?;
    m.add_class::<PyView>()?;
    m.add_class::<PyMutableView>()?;
    m.add_class::<PyRemoteBuffer>()?;
    m.add_class::<PyWork>()?;
    m.add_function(wrap_pyfunction!(available_transports, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(new_transport_rank, m)?)?;
    m.add_function(wrap_pyfunction!(panics::_panic_for_test, m)?)?;
    symm::register(m)?;
    Ok(())
}
