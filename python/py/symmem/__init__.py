"""symmem: symmetric memory and one-sided tensor transports, from Rust.

The transport API follows ``torch.distributed._transport``: ``new_transport``, ``bind``,
``connect``, ``register_memory``, views, descriptors with ``serialize``/``deserialize``, and
``write``/``read`` synchronous or returning a ``Work``. Tensors are torch tensors (CPU) or NumPy
arrays, registered without copies. With torch installed, ``symmem.torch_backend`` plugs symmem
into PyTorch itself: ``torch.distributed._transport.new_transport("symmem", "cpu")``.
Symmetric memory and its operators are in ``symmem.symm`` (after
``torch.distributed._symmetric_memory``), for ranks launched by ``symmem run`` or torchrun.
"""

import asyncio

from . import _native, errors
from ._native import MemoryView, MutableMemoryView, RemoteBuffer, Work, available_transports
from ._native import Transport as _NativeTransport

__version__ = _native.__version__
#: The commit the extension (and the ``symmem`` command it carries) was built from.
__commit__ = _native.commit

__all__ = [
    "Memory",
    "MemoryView",
    "MutableMemoryView",
    "RemoteBuffer",
    "Transport",
    "Work",
    "available_transports",
    "errors",
    "from_dlpack",
    "new_transport",
    "new_transport_rank",
    "wait_all",
]


def from_dlpack(obj):
    """A NumPy array (or, without NumPy, a torch tensor) viewing ``obj``'s memory through
    ``__dlpack__``, without a copy."""
    try:
        import numpy as np

        return np.from_dlpack(obj)
    except ImportError:
        import torch

        return torch.from_dlpack(obj)


def _ptr_and_size(obj):
    """The address and byte size of a contiguous CPU torch tensor, NumPy array, or anything
    with ``__dlpack__``; and the object that owns the memory."""
    if not hasattr(obj, "data_ptr") and not hasattr(obj, "__array_interface__") and hasattr(obj, "__dlpack__"):
        obj = from_dlpack(obj)
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if not obj.is_contiguous():
            raise ValueError("symmem transport requires a contiguous tensor")
        if obj.device.type != "cpu":
            raise ValueError(f"symmem transport requires CPU tensors, got {obj.device}")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    interface = getattr(obj, "__array_interface__", None)
    if interface is not None:
        if not obj.flags["C_CONTIGUOUS"]:
            raise ValueError("symmem transport requires a contiguous array")
        return interface["data"][0], obj.nbytes, obj
    raise TypeError(f"expected a torch tensor, a NumPy array or an object with __dlpack__, got {type(obj).__name__}")


class Memory:
    """Registered memory: make views of it, or a descriptor for the peer."""

    def __init__(self, native, owner):
        self._native = native
        self._owner = owner

    def to_view(self, offset=None, length=None):
        return self._native.to_view(offset or 0, length)

    def to_mutable_view(self, offset=None, length=None):
        return self._native.to_mutable_view(offset or 0, length)

    def to_remote_buffer(self, *, timeout=None):
        return self._native.to_remote_buffer()


class Transport:
    """A one-sided transport endpoint: one peer, registered memory, reads and writes."""

    def __init__(self, backend="auto", *, _native=None, **options):
        self._t = _native or _NativeTransport(backend, {k: str(v) for k, v in options.items()})

    def bind(self, *, timeout=None):
        return self._t.bind(timeout)

    def connect(self, peer_url, *, timeout=None):
        self._t.connect(bytes(peer_url), timeout)
        return 0

    def connected(self):
        return self._t.connected()

    def describe(self):
        return self._t.describe()

    def register_memory(self, tensor, *, read_only=False, timeout=None):
        ptr, nbytes, owner = _ptr_and_size(tensor)
        return Memory(self._t.register(ptr, nbytes, owner, read_only), owner)

    def unregister_memory(self, memory, *, timeout=None):
        self._t.unregister(memory._native)

    def write(self, local, remote, *, async_op=False, timeout=None):
        if async_op:
            return self._t.start_write(local, remote, timeout)
        # Synchronous: a small shared-memory copy happens here, with no Work.
        self._t.write(local, remote, timeout)
        return 0

    def read(self, local, remote, *, async_op=False, timeout=None):
        if async_op:
            return self._t.start_read(local, remote, timeout)
        self._t.read(local, remote, timeout)
        return 0

    async def write_async(self, local, remote, *, timeout=None):
        """``write`` for asyncio callers: awaits completion without blocking the event loop.
        Cancelling the await does not cancel the transfer."""
        await _await_work(self._t.start_write(local, remote, timeout), timeout)

    async def read_async(self, local, remote, *, timeout=None):
        """``read`` for asyncio callers (see :meth:`write_async`)."""
        await _await_work(self._t.start_read(local, remote, timeout), timeout)

    def close(self, *, timeout=None):
        self._t.close(timeout)

    async def close_async(self, *, timeout=None):
        """``close`` for asyncio callers: waits for in-flight transfers off the event loop."""
        await asyncio.to_thread(self._t.close, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


async def _await_work(work, timeout):
    # Work.wait releases the GIL, so a worker thread waits while the loop runs.
    await asyncio.to_thread(work.wait, timeout)


async def wait_all(works, *, timeout=None):
    """Awaits every ``Work`` in ``works``; raises the first failure after all have finished."""
    results = await asyncio.gather(*(_await_work(w, timeout) for w in works), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def _store_addr(store):
    """``host:port`` of a ``torch.distributed.TCPStore``, a ``"host:port"`` string, or (None)
    the launcher's ``MASTER_ADDR:MASTER_PORT``."""
    import os

    if store is None:
        try:
            host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        except KeyError as e:
            raise ValueError(f"store is None and {e.args[0]} is not set (run under symmem run or torchrun)") from None
    elif isinstance(store, str):
        return store
    elif hasattr(store, "host") and hasattr(store, "port"):
        host, port = store.host, store.port
    else:
        raise TypeError(f"store must be a torch.distributed.TCPStore or 'host:port', not {type(store).__name__}")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def new_transport_rank(
    backend="auto", device=None, *, store=None, peer_rank, rank=None, bootstrap_timeout=30.0, **options
):
    """A transport bound and connected to ``peer_rank`` through ``store`` (PyTorch's key scheme:
    it pairs with ``torch.distributed._transport.new_transport_rank`` on the other side, and the
    Nth call on each side meets the Nth on the other). ``rank`` defaults to ``RANK``."""
    import os

    if device is not None and str(device) != "cpu":
        raise ValueError(f"symmem transports support the CPU only, not {device}")
    if rank is None:
        if "RANK" not in os.environ:
            raise ValueError("rank is None and RANK is not set")
        rank = int(os.environ["RANK"])
    native = _native.new_transport_rank(
        backend or "auto",
        _store_addr(store),
        int(peer_rank),
        int(rank),
        float(bootstrap_timeout),
        {k: str(v) for k, v in options.items()},
    )
    return Transport(_native=native)


def new_transport(backend="auto", device=None, **options):
    """A transport of ``backend`` ("auto", "tcp" or "shm"); ``device`` must be the CPU."""
    if device is not None and str(device) != "cpu":
        raise ValueError(f"symmem transports support the CPU only, not {device}")
    return Transport(backend, **options)
