//! The process-wide background runtime that drives symmem's sockets (the store server and
//! clients) so that synchronous callers never need one of their own.
//!
//! Synchronous APIs enter this runtime's context and block on a future with
//! `futures::executor::block_on`: the runtime's worker threads drive the sockets and timers, so
//! this works from any thread, including from inside another tokio runtime.

#![forbid(unsafe_code)]

use std::sync::OnceLock;

use tokio::runtime::{Builder, Runtime};

/// The shared runtime, started on first use with two worker threads named `symmem-io`.
pub(crate) fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("symmem-io")
            .enable_all()
            .build()
            // Building a runtime fails only if the OS refuses threads or an epoll fd; nothing
            // in symmem can work then, and there is no caller to hand the error to.
            .expect("start the symmem I/O runtime")
    })
}

/// Runs `fut` to completion on the calling thread, with the shared runtime driving its I/O.
pub fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    let _ctx = runtime().enter();
    futures::executor::block_on(fut)
}
