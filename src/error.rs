//! The one error type of symmem: each variant says what happened, with the context needed to act
//! on it, and each message names the exact cause once.

#![forbid(unsafe_code)]

use std::io;
use std::time::Duration;

/// Any error a lower layer's codec reports (`wire`'s decode errors), kept as the source.
pub type Source = Box<dyn std::error::Error + Send + Sync>;

/// Everything that can go wrong in symmem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A bounded wait ran out: a store key that never appeared, a barrier some rank never
    /// reached, a peer that never answered. The process stays usable.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// How long the wait lasted.
        after: Duration,
    },

    /// An operating-system call failed; `context` names the call and its arguments.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, e.g. "connect to store at 127.0.0.1:29500".
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// A peer sent bytes that break the protocol; the connection was closed.
    #[error("malformed message from {peer}: {source}")]
    Protocol {
        /// Who sent it.
        peer: String,
        /// What was wrong (the codec's error).
        #[source]
        source: Source,
    },

    /// A peer answered with a well-formed reply that the protocol does not allow here.
    #[error("unexpected reply from {peer} to {request}: {reply}")]
    UnexpectedReply {
        /// Who answered.
        peer: String,
        /// The request answered.
        request: String,
        /// The reply, as decoded.
        reply: String,
    },

    /// A request is refused before it is sent, because the server would refuse it (a key or
    /// value beyond the protocol's limits).
    #[error("refused to send: {0}")]
    TooLarge(Source),

    /// The store server closed the connection, which is how TCPStore servers report a request
    /// they reject (an ADD on a non-integer value, a missing key on a legacy server) or a failed
    /// authentication.
    #[error("store at {peer} closed the connection during {during}")]
    ConnectionClosed {
        /// The server's address.
        peer: String,
        /// The request in flight.
        during: String,
    },

    /// Shared-secret authentication failed, or one side has a secret and the other does not.
    #[error("authentication with {peer} failed: {reason}")]
    Auth {
        /// The other side.
        peer: String,
        /// Why.
        reason: String,
    },

    /// An environment variable a rank needs is missing or malformed.
    #[error("environment variable {var}: {reason}")]
    Env {
        /// The variable's name.
        var: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// An argument is out of range or inconsistent; the message names it.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The operation needs hardware or a backend this machine does not have.
    #[error("{what} is unsupported on this device: it needs {needs}")]
    Unsupported {
        /// What was asked for.
        what: String,
        /// What it would need.
        needs: String,
    },

    /// Ranks disagree in a collective setup step (allocation order, shapes, dtypes), or a peer
    /// cannot be reached; every rank gets the same error. Also: an operator across hosts
    /// refused on a group where an earlier call of it failed part-way, its ranks being
    /// possibly out of step.
    #[error("{0}")]
    Rendezvous(String),

    /// A transfer failed; `kind` says how, for code to decide on (retry a busy slot, give up on
    /// a lost peer), and `message` says why, for people.
    #[error("transfer failed: {message}")]
    Transfer {
        /// How it failed.
        kind: TransferKind,
        /// The exact cause, with who and what.
        message: String,
    },

    /// Shared memory holds what its protocol never writes (user code wrote into a signal pad).
    #[error("{0}")]
    Corrupt(String),

    /// The object was used after `close`.
    #[error("{0} is closed")]
    Closed(&'static str),
}

/// How a transfer failed: the part of a failure that code acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferKind {
    /// The memory's owner refused it: an unknown, stale or read-only descriptor, a range out
    /// of bounds. Retrying the same transfer fails the same way.
    Refused,
    /// The peer is gone or unreachable: its process exited, its connection broke.
    PeerLost,
    /// A remote signal slot still holds an unconsumed signal: retry later.
    Busy,
    /// It did not complete within its timeout (it may still complete).
    TimedOut,
    /// The backend cannot do it (a remote atomic on a backend without them).
    Unsupported,
}

/// What a backend completes a transfer with: success, or how and why it failed.
pub type Completion = std::result::Result<(), Failed>;

/// A failed transfer, as a backend reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failed {
    /// How.
    pub kind: TransferKind,
    /// Why, for people.
    pub message: String,
}

impl Failed {
    /// A failure of `kind`.
    #[cold]
    pub fn new(kind: TransferKind, message: impl Into<String>) -> Failed {
        Failed { kind, message: message.into() }
    }
}

impl From<Failed> for Error {
    fn from(f: Failed) -> Error {
        Error::Transfer { kind: f.kind, message: f.message }
    }
}

/// symmem's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Io`] with its context.
    #[cold]
    pub fn io(context: impl Into<String>, source: io::Error) -> Error {
        Error::Io { context: context.into(), source }
    }

    /// An [`Error::Timeout`].
    #[cold]
    pub fn timeout(what: impl Into<String>, after: Duration) -> Error {
        Error::Timeout { what: what.into(), after }
    }

    /// Whether this error is a timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::Transfer { kind: TransferKind::TimedOut, .. })
    }

    /// A [`Error::Transfer`].
    #[cold]
    pub fn transfer(kind: TransferKind, message: impl Into<String>) -> Error {
        Error::Transfer { kind, message: message.into() }
    }

    /// A transfer failure saying `message`, of this error's kind: its own for a transfer
    /// failure, `TimedOut` for a timeout, `PeerLost` for I/O, `Refused` for anything else.
    #[cold]
    pub(crate) fn as_transfer(&self, message: impl Into<String>) -> Error {
        let kind = match self {
            Error::Transfer { kind, .. } => *kind,
            Error::Timeout { .. } => TransferKind::TimedOut,
            Error::Io { .. } | Error::Closed(_) => TransferKind::PeerLost,
            _ => TransferKind::Refused,
        };
        Error::Transfer { kind, message: message.into() }
    }

    /// The kind of a transfer failure, if this is one.
    pub fn transfer_kind(&self) -> Option<TransferKind> {
        match self {
            Error::Transfer { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}
