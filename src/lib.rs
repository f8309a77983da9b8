//! symmem: symmetric memory and one-sided tensor transports for CPU processes.
//!
//! symmem is PyTorch's `torch.distributed._symmetric_memory` and `torch.distributed._transport`
//! in Rust: processes on one host share memory directly, and hosts reach each other over TCP.
//!
//! # Layers
//!
//! Each layer uses only the ones below it (`tests/layers.rs` fails on an import that points up):
//!
//! ```text
//!   ops        collectives by collective: all_reduce, reduce_scatter, all_gather, all_to_all,
//!              matmul fusions, signal ops; each picks its algorithm in one place
//!   symm       symmetric allocations, rendezvous, handles, signal pads, memory pool, links
//!              between hosts (by backend capability), host barrier
//!   transport  one-sided read/write between two endpoints; backends (tcp, shm) declare their
//!              capabilities in one registry, auto composes them
//!   group      who participates: rank, world size, name, scoped store; from the environment
//!   store      rendezvous key-value store: TCP server and client (PyTorch's TCPStore protocol),
//!              in-process store, prefix store, authentication
//!   wire       every byte that crosses a process boundary; pure, never panics on input
//!   tensor     a small strided tensor over shared storage, dtypes, Device
//!   sync topo  waiting (one patience policy, the signal-slot protocol); host identity, cores
//!   config     every environment variable, read once
//!   sys rt     the only unsafe OS calls (shared memory, futexes, CMA, peer credentials); the
//!              background I/O runtime
//!   error      the error type and transfer failure kinds
//! ```
//!
//! `launch` (the launcher behind `symmem run`) sits on top. The `symmem` command line (`run`,
//! `demo`, `bench`, `store`, `info`) is its own crate, `symmem-cli`, so the library and the
//! Python wheel carry none of its dependencies.
//!
//! Custom operators are built from a handle's buffer pointers and signal pads, as
//! `examples/custom_all_reduce.rs` shows.
//!
//! # The paved path
//!
//! A rank started by `symmem run` or torchrun joins its job with [`Group::from_env`], then uses
//! the group's store and barrier:
//!
//! ```no_run
//! use std::time::Duration;
//!
//! let group = symmem::Group::from_env()?;
//! let peers = group.all_gather_bytes("hostname", b"my-host")?;
//! group.barrier(Duration::from_secs(30))?;
//! # Ok::<(), symmem::Error>(())
//! ```
//!

pub mod config;
mod error;
pub mod group;
pub mod launch;
pub mod ops;
mod rt;
pub mod store;
pub mod symm;
mod sync;
mod sys;
pub mod tensor;
pub mod topo;
pub mod transport;
#[cfg(feature = "internals")]
pub mod wire;
// Without `internals`, codec capabilities that only tests and fuzz targets exercise (string
// descriptor fields, the framer's query) are unused.
#[cfg(not(feature = "internals"))]
#[allow(dead_code)]
mod wire;

/// What symmem's own tools (the `symmem` command's benchmarks, the fuzz targets) reach below
/// the public API: the wire formats and a few process helpers. Not a stable API; only with
/// the `internals` feature.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod internals {
    pub use crate::rt::block_on;
    pub use crate::sys::raise_fd_limit;
    pub use crate::wire;

    /// Copies `local` to address `remote` in process `pid` with one cross-memory attach
    /// (`process_vm_writev`), as the shm transport does: the benchmark's baseline.
    pub fn cma_write(pid: i32, local: &[u8], remote: usize) -> std::io::Result<()> {
        crate::sys::cma::write(pid, local, remote).map_err(|e| std::io::Error::other(format!("{e:?}")))
    }
}

/// Sends symmem's logs to stderr, filtered by `SYMMEM_LOG` (warnings by default), unless the
/// process already has a tracing subscriber: for hosts with no logging of their own, such as
/// the Python extension. Colour only on a terminal.
pub fn log_to_stderr() {
    use std::io::IsTerminal;
    let filter = config::log_filter()
        .and_then(|f| tracing_subscriber::EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}

// The paved path.
pub use error::{Completion, Error, Failed, Result, TransferKind};
pub use group::Group;
pub use ops::ReduceOp;
pub use store::{MemoryStore, PrefixStore, Store, TcpStore};
pub use symm::{MemPool, SymmHandle};
pub use tensor::{DType, Device, Tensor};
pub use transport::{Memory, RemoteBuffer, Transport, new_transport, new_transport_rank};

/// This library's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
