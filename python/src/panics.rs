//! No call into the module raises PyO3's `PanicException` (a `BaseException`, which escapes
//! `except Exception` and leaves a job's other ranks waiting for this one): every entry point
//! carries `#[catch_panics]` (the `symmem-python-macros` crate), which runs its body under
//! [`guard`], and a panic there (a bug) reaches Python as a `RuntimeError` naming it. The panic
//! hook has already printed the panic and where it happened to stderr.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use symmem_python_macros::catch_panics;

/// Runs `f`; a panic in it becomes a `RuntimeError`.
///
/// Asserting unwind safety: what a panicking call leaves behind is what it left before, when
/// PyO3 raised `PanicException` and the caller could catch that too; symmem's own locks
/// recover from poisoning, and a store connection that fell out of step is replaced.
pub fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(panicked(payload.as_ref())))
}

#[cold]
fn panicked(payload: &(dyn Any + Send)) -> PyErr {
    let message = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    PyRuntimeError::new_err(format!("symmem: internal error (a bug; please report it): {message}"))
}

/// Test-only (the tests of `python/tests/test_panics.py`): panics on purpose, holding the
/// interpreter (`released` false) or with it released (true, as the calls that wait do), so
/// a test can check that a panic reaches Python as a `RuntimeError`.
#[catch_panics]
#[pyfunction]
pub fn _panic_for_test(py: Python<'_>, released: bool) {
    if released {
        py.detach(|| panic!("_panic_for_test, the interpreter released"));
    }
    panic!("_panic_for_test, holding the interpreter");
}
