//! The one error type of symmem: each variant says what happened, with the context needed to act
//! on it, and each message names the exact cause once.

use std::io;
use std::time::Duration;

use crate::wire::store::DecodeError;

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
        /// What was wrong.
        #[source]
        source: DecodeError,
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
    TooLarge(DecodeError),

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
    /// cannot be reached; every rank gets the same error.
    #[error("{0}")]
    Rendezvous(String),

    /// A transfer failed: refused by the peer (unknown, stale or read-only descriptor, out of
    /// bounds), or the connection to the peer was lost.
    #[error("transfer failed: {0}")]
    Transfer(String),

    /// The object was used after `close`.
    #[error("{0} is closed")]
    Closed(&'static str),
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
        matches!(self, Error::Timeout { .. })
    }
}
