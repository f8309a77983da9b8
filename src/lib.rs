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
//! # The paved paths
//!
//! **A one-sided write between two processes.** The owner registers memory and hands its
//! descriptor (bytes) to a peer, which writes into it without the owner taking part. Here both
//! endpoints live in one program; in a job each is its own process and the URLs and the
//! descriptor travel through the job's store ([`transport::new_transport_rank`] pairs two
//! ranks that way).
//!
//! ```
//! use symmem::transport::{Options, RemoteBuffer, new_transport};
//! use symmem::{DType, Tensor};
//!
//! let owner = new_transport("tcp", None, &Options::new())?;
//! let writer = new_transport("tcp", None, &Options::new())?;
//! let (owner_url, writer_url) = (owner.bind(None)?, writer.bind(None)?);
//! owner.connect(&writer_url, None)?;
//! writer.connect(&owner_url, None)?;
//!
//! // The owner: memory peers may write, and its descriptor.
//! let weights = Tensor::zeros(&[4], DType::F32)?;
//! let exposed = owner.register_memory(&weights)?;
//! let descriptor: Vec<u8> = exposed.to_remote_buffer()?.serialize();
//!
//! // The writer: its own registered tensor, written into the owner's.
//! let update = Tensor::from_slice(&[4], &[1.0f32, 2.0, 3.0, 4.0])?;
//! let source = writer.register_memory(&update)?;
//! writer.write(&source.to_view(0, None)?, &RemoteBuffer::deserialize(&descriptor)?, None)?;
//! assert_eq!(weights.to_vec::<f32>()?, [1.0, 2.0, 3.0, 4.0]);
//! # Ok::<(), symmem::Error>(())
//! ```
//!
//! **Symmetric memory with a handle and a signal.** Every rank allocates the same tensor and
//! rendezvouses; the handle maps every peer's buffer and signal pad. A rank started by
//! `symmem run` or torchrun joins its job with [`Group::from_env`]; here
//! [`group::run_threads`] plays the two ranks on threads of one program.
//!
//! ```
//! use std::time::Duration;
//!
//! use symmem::symm::{self, Device};
//! use symmem::{DType, Group};
//!
//! /// One rank's program.
//! fn rank(group: Group) -> symmem::Result<()> {
//!     let t = Duration::from_secs(30);
//!     let x = symm::empty(&[4], DType::F32, Device::Cpu)?;
//!     let h = symm::rendezvous(&x, &group)?;
//!     if group.rank() == 0 {
//!         x.fill(42.0f32)?; // write my buffer, then tell rank 1 it is ready
//!         h.put_signal(1, 0, t)?;
//!     } else {
//!         h.wait_signal(0, 0, t)?; // rank 0's writes are visible after its signal
//!         let theirs = h.get_remote_tensor(0, &[4], DType::F32)?;
//!         assert_eq!(theirs.to_vec::<f32>()?, [42.0; 4]);
//!     }
//!     h.barrier(0, t) // nobody unmaps while a peer still reads
//! }
//!
//! symmem::group::run_threads(2, rank)?; // two ranks, as threads of this program
//! # Ok::<(), symmem::Error>(())
//! ```
//!
//! **An operator.** Collectives run on symmetric tensors, with PyTorch's names and semantics,
//! and give every rank bitwise the same result:
//!
//! ```
//! use symmem::symm::{self, Device};
//! use symmem::{DType, Group, ReduceOp, ops};
//!
//! fn rank(group: Group) -> symmem::Result<()> {
//!     let x = symm::empty(&[1024], DType::F32, Device::Cpu)?;
//!     x.fill(group.rank() as f32 + 1.0)?;
//!     ops::all_reduce(&x, ReduceOp::Sum, &group)?; // in place; one-shot or two-shot by size
//!     assert!(x.to_vec::<f32>()?.iter().all(|&v| v == 6.0));
//!     Ok(())
//! }
//!
//! symmem::group::run_threads(3, rank)?;
//! # Ok::<(), symmem::Error>(())
//! ```
//!
//! Custom operators are built from a handle's buffer pointers and signal pads, as
//! `examples/custom_all_reduce.rs` shows. `docs/` describes the protocols and algorithms the
//! code follows (the store's wire format, the transport contract, symmetric memory's signal
//! pads and operators).

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

    /// The flows of a tcp link between hosts in a group that spans `hosts` hosts:
    /// `SYMMEM_TRANSPORT_TCP_FLOWS` if set (and valid), else the links' own choice (the
    /// link-setup benchmark's model of what a rank holds).
    pub fn tcp_link_flows(hosts: usize) -> usize {
        crate::config::tcp_flows().ok().flatten().unwrap_or_else(|| crate::symm::tcp_link_flows(hosts))
    }

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
