//! symmem: symmetric memory and one-sided tensor transports for CPU processes.
//!
//! symmem is PyTorch's `torch.distributed._symmetric_memory` and `torch.distributed._transport`
//! in Rust: processes on one host share memory directly, and hosts reach each other over TCP.
//!
//! # Layers
//!
//! Each layer uses only the ones below it:
//!
//! ```text
//!   cli        symmem run | demo | bench | store | info (the binary; parses arguments only)
//!   launch     the one-host launcher behind `symmem run`;   bench: the measurements
//!   ops        collectives on symmetric memory (all-reduce, reduce-scatter, all-gather, ...)
//!   symm       symmetric allocations, rendezvous, handles, signal pads, memory pool
//!   transport  one-sided read/write between two endpoints; backends: tcp, shm, auto
//!   tensor     a small strided tensor over shared storage (used by symm and transport)
//!   group      who participates: rank, world size, name, scoped store; from the environment
//!   store      rendezvous key-value store: TCP server and client (PyTorch's TCPStore
//!              protocol), in-process store, prefix store
//!   wire       every byte that crosses a process boundary; pure, never panics on input
//!   sys        the only place that calls the OS unsafely
//! ```
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

pub mod bench;
pub mod config;
mod error;
pub mod group;
pub mod launch;
pub mod ops;
mod rt;
pub mod store;
pub mod symm;
pub(crate) mod sync;
mod sys;
pub mod tensor;
pub mod topo;
pub mod transport;
pub mod wire;

/// Sends symmem's logs to stderr, filtered by `SYMMEM_LOG` (warnings by default), unless the
/// process already has a tracing subscriber: for hosts with no logging of their own, such as
/// the Python extension. Colour only on a terminal.
pub fn log_to_stderr() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("SYMMEM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}

// The paved path.
pub use error::{Completion, Error, Failed, Result, TransferKind};
pub use group::Group;
pub use store::{MemoryStore, PrefixStore, Store, TcpStore};
