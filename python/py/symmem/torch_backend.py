"""symmem as a PyTorch transport backend (entry point ``symmem`` in the group
``torch.distributed.transports``):

    from torch.distributed._transport import new_transport
    transport = new_transport("symmem", "cpu")

Descriptors are ``RemoteBuffer`` objects in PyTorch's JSON v1 envelope; ``Work`` is a
``torch.distributed.Work`` whose futures resolve when the transfer ends. Options:
``backend`` ("auto": shared memory on one host, TCP across hosts; or "tcp", "shm") and the
backend's own (``flows``, ``host``, ``timeout``).
"""

import datetime
import threading

import torch
from torch.distributed._transport import Transport

from . import _native


class SymmemMemoryView:
    """A read-only view of registered memory."""

    def __init__(self, native, transport):
        self._native = native
        self._transport = transport

    def size(self):
        return self._native.size()


class SymmemMutableMemoryView(SymmemMemoryView):
    """A view that transfers may write (the destination of a read)."""

    writable = True


class SymmemRemoteBuffer:
    """A descriptor of a peer's registered memory (JSON v1 envelope)."""

    def __init__(self, native):
        self._native = native

    def serialize(self):
        return bytes(self._native.serialize())

    @classmethod
    def deserialize(cls, data):
        if type(data) is not bytes:
            raise TypeError("serialized descriptor must be bytes")
        return cls(_native.RemoteBuffer.deserialize(data))

    def __eq__(self, other):
        return isinstance(other, SymmemRemoteBuffer) and self._native == other._native

    def __hash__(self):
        return hash(self.serialize())


class SymmemMemory:
    """Memory registered with a SymmemTransport."""

    def __init__(self, native, tensor, transport):
        self._native = native
        self._tensor = tensor
        self._transport = transport

    def to_view(self, offset=None, length=None):
        return SymmemMemoryView(self._native.to_view(_index(offset, 0), _index(length, None)), self._transport)

    def to_mutable_view(self, offset=None, length=None):
        view = self._native.to_mutable_view(_index(offset, 0), _index(length, None))
        return SymmemMutableMemoryView(view, self._transport)

    def to_remote_buffer(self, *, timeout=None):
        return SymmemRemoteBuffer(self._native.to_remote_buffer())


def _index(v, default):
    if v is None:
        return default
    v = v.__index__()
    if v < 0:
        raise ValueError("offset is outside the registered memory")
    return v


def _seconds(timeout):
    if timeout is None or timeout == datetime.timedelta(0):
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class SymmemWork(torch.distributed.Work):
    """A transfer in flight: a torch.distributed.Work."""

    def __init__(self, native, retained):
        super().__init__()
        self._w = native
        self._retained = retained
        self._future = None
        self._lock = threading.Lock()

    def wait(self, timeout=datetime.timedelta(0)):
        try:
            self._w.wait(_seconds(timeout))
        except TimeoutError as e:
            raise TimeoutError("transport wait timed out; operation remains pending") from e
        return True

    def is_completed(self):
        return self._w.is_completed()

    def is_success(self):
        return self._w.is_success()

    def exception(self):
        e = self._w.exception()
        return None if e is None else RuntimeError(e)

    def result(self):
        return []

    def synchronize(self):
        self.wait()

    def get_future(self):
        with self._lock:
            if self._future is None:
                fut = torch.futures.Future()
                self._future = fut

                def settle():
                    try:
                        self._w.wait(None)
                        fut.set_result([])
                    except Exception as e:  # noqa: BLE001 - carried to the future
                        fut.set_exception(RuntimeError(str(e)))

                if self._w.is_completed():
                    settle()
                else:
                    threading.Thread(target=settle, daemon=True).start()
            return self._future


class SymmemTransport(Transport):
    """A one-sided transport on symmem: shared memory on one host, TCP across hosts."""

    def __init__(self, device=None, *, backend="auto", **options):
        super().__init__(device)
        self._t = _native.Transport(backend, {k: str(v) for k, v in options.items()})

    @staticmethod
    def supported():
        return True

    def bind(self, *, timeout=None):
        return bytes(self._t.bind(timeout))

    def connect(self, peer_url, *, timeout=None):
        if self._t.connected():
            raise RuntimeError("transport is already connected")
        self._t.connect(bytes(peer_url), timeout)
        return 0

    def connected(self):
        return self._t.connected()

    def register_memory(self, tensor, *, timeout=None):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("tensor must be a torch.Tensor")
        self._check_device(tensor.device)
        if tensor.device.type != "cpu":
            raise ValueError(f"symmem transport requires CPU tensors, got {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError("symmem transport requires a contiguous tensor")
        native = self._t.register(tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor, False)
        return SymmemMemory(native, tensor, self)

    def unregister_memory(self, memory, *, timeout=None):
        if not isinstance(memory, SymmemMemory) or memory._transport is not self:
            raise TypeError("memory was not registered by this transport")
        self._t.unregister(memory._native)

    def _views(self, local, remote, mutable):
        kind = SymmemMutableMemoryView if mutable else SymmemMemoryView
        if not isinstance(local, kind) or local._transport is not self:
            raise TypeError("memory view belongs to another transport")
        if not isinstance(remote, SymmemRemoteBuffer):
            raise TypeError("remote buffer is not a symmem descriptor")
        return local._native.as_view() if mutable else local._native

    def write(self, local_buffer, remote_buffer, *, async_op=False, timeout=None):
        view = self._views(local_buffer, remote_buffer, False)
        work = SymmemWork(self._t.start_write(view, remote_buffer._native, timeout), (local_buffer, remote_buffer))
        if async_op:
            return work
        work.wait()
        return 0

    def read(self, local_buffer, remote_buffer, *, async_op=False, timeout=None):
        self._views(local_buffer, remote_buffer, True)
        native = self._t.start_read(local_buffer._native, remote_buffer._native, timeout)
        work = SymmemWork(native, (local_buffer, remote_buffer))
        if async_op:
            return work
        work.wait()
        return 0

    def close(self, *, timeout=None):
        self._t.close(timeout)
