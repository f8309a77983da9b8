"""The exceptions symmem raises for a failed transfer, by what went wrong.

Each is a ``RuntimeError`` (what PyTorch's distributed code raises and catches) and also the
built-in exception that says the same thing, so ``except ConnectionError`` catches a lost peer.
A timeout is the built-in ``TimeoutError``; an operation a backend cannot do is
``NotImplementedError``; an invalid argument is ``ValueError``.
"""

__all__ = ["BusyError", "PeerLostError", "RefusedError", "TransferError"]


class TransferError(RuntimeError):
    """A transfer failed; the subclasses say how."""


class PeerLostError(TransferError, ConnectionError):
    """The peer is gone or unreachable: its process exited or its connection broke."""


class RefusedError(TransferError, PermissionError):
    """The memory's owner refused the transfer (an unknown, stale or read-only descriptor, a
    range out of bounds). Retrying it fails the same way."""


class BusyError(TransferError):
    """A remote signal slot still holds an unconsumed signal: retry later."""
