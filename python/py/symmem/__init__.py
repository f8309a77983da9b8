"""symmem: symmetric memory and one-sided tensor transports, from Rust.

The transport API follows ``torch.distributed._transport``: ``new_transport``, ``bind``,
``connect``, ``register_memory``, views, descriptors with ``serialize``/``deserialize``, and
``write``/``read`` synchronous or returning a ``Work``. Tensors are torch tensors (CPU) or NumPy
arrays, registered without copies. With torch installed, ``symmem.torch_backend`` plugs symmem
into PyTorch itself: ``torch.distributed._transport.new_transport("symmem", "cpu")``.
Symmetric memory and its operators are in ``symmem.symm`` (after
``torch.distributed._symmetric_memory``), for ranks launched by ``symmem run`` or torchrun.
"""

from ._native import MemoryView, MutableMemoryView, RemoteBuffer, Work, available_transports
from ._native import Transport as _NativeTransport

__all__ = [
    "Memory",
    "MemoryView",
    "MutableMemoryView",
    "RemoteBuffer",
    "Transport",
    "Work",
    "available_transports",
    "new_transport",
]


def _ptr_and_size(obj):
    """The address and byte size of a contiguous CPU torch tensor or NumPy array."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if not obj.is_contiguous():
            raise ValueError("symmem transport requires a contiguous tensor")
        if obj.device.type != "cpu":
            raise ValueError(f"symmem transport requires CPU tensors, got {obj.device}")
        return obj.data_ptr(), obj.numel() * obj.element_size()
    interface = getattr(obj, "__array_interface__", None)
    if interface is not None:
        if not obj.flags["C_CONTIGUOUS"]:
            raise ValueError("symmem transport requires a contiguous array")
        return interface["data"][0], obj.nbytes
    raise TypeError("expected a torch tensor or a NumPy array")


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

    def __init__(self, backend="auto", **options):
        self._t = _NativeTransport(backend, {k: str(v) for k, v in options.items()})

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
        ptr, nbytes = _ptr_and_size(tensor)
        return Memory(self._t.register(ptr, nbytes, tensor, read_only), tensor)

    def unregister_memory(self, memory, *, timeout=None):
        self._t.unregister(memory._native)

    def write(self, local, remote, *, async_op=False, timeout=None):
        work = self._t.start_write(local, remote, timeout)
        if async_op:
            return work
        work.wait()
        return 0

    def read(self, local, remote, *, async_op=False, timeout=None):
        work = self._t.start_read(local, remote, timeout)
        if async_op:
            return work
        work.wait()
        return 0

    def close(self, *, timeout=None):
        self._t.close(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def new_transport(backend="auto", device=None, **options):
    """A transport of ``backend`` ("auto", "tcp" or "shm"); ``device`` must be the CPU."""
    if device is not None and str(device) != "cpu":
        raise ValueError(f"symmem transports support the CPU only, not {device}")
    return Transport(backend, **options)
