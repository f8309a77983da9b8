"""The exceptions symmem raises, by what went wrong.

A failed transfer raises a ``TransferError``, a ``RuntimeError`` (what PyTorch's distributed
code raises and catches) that is also the built-in exception that says the same thing, so
``except ConnectionError`` catches a lost peer. A transport's timeout is the built-in
``TimeoutError``; an operation a backend cannot do is ``NotImplementedError``; an invalid
argument to a transport is ``ValueError``.

Symmetric memory raises what PyTorch's does, and stays true to those types too: a wait that
runs out of time (a barrier, a signal, an operator) raises ``WaitTimeoutError``, both a
``RuntimeError`` (as PyTorch's does) and a ``TimeoutError``; an invalid argument (a rank out of
range, a channel past the signal pad, a negative offset) raises ``InvalidArgumentError``, both a
``ValueError`` (PyTorch's Python-level checks) and a ``RuntimeError`` (its C++ checks).
"""

__all__ = ["BusyError", "InvalidArgumentError", "PeerLostError", "RefusedError", "TransferError", "WaitTimeoutError"]


class TransferError(RuntimeError):
    """A transfer failed; the subclasses say how."""


class PeerLostError(TransferError, ConnectionError):
    """The peer is gone or unreachable: its process exited or its connection broke."""


class RefusedError(TransferError, PermissionError):
    """The memory's owner refused the transfer (an unknown, stale or read-only descriptor, a
    range out of bounds). Retrying it fails the same way."""


class BusyError(TransferError):
    """A remote signal slot still holds an unconsumed signal: retry later."""


class WaitTimeoutError(RuntimeError, TimeoutError):
    """A symmetric-memory wait ran past its timeout (a barrier, ``put_signal``, ``wait_signal``,
    an operator): the ``RuntimeError`` PyTorch raises, and a ``TimeoutError``. The process stays
    usable; the message names who was waited for."""


class InvalidArgumentError(ValueError, RuntimeError):
    """An invalid argument to symmetric memory (a rank out of range, a channel past the signal
    pad, a negative offset, a range past the allocation): a ``ValueError``, and the
    ``RuntimeError`` PyTorch's C++ checks raise."""
