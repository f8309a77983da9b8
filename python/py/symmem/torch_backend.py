"""symmem as a PyTorch transport backend (entry point ``symmem`` in the group
``torch.distributed.transports``):

    from torch.distributed._transport import new_transport
    transport = new_transport("symmem", "cpu")

It follows PyTorch's transport contract as PyTorch's own NIXL backend does (the conformance
suite, python/tests/test_contract.py, runs both): views are byte ranges checked like NIXL's,
descriptors are ``RemoteBuffer`` objects in PyTorch's JSON v1 envelope under the backend name
``symmem`` (the same bytes a Rust peer's ``symmem`` transport writes and reads), ``Work`` is a
``torch.distributed.Work`` whose future resolves when the transfer ends.

Options: ``engine`` ("auto", the default: shared memory on one host and TCP across hosts; or
"tcp", "shm", "ucx"), ``timeout`` (seconds, the default for every call; 30), and the engine's
own (``flows``, ``host``, ``chunk_size``, ...). The engine is not named ``backend``, which is
PyTorch's parameter of ``new_transport``.

Transfers of 1 MiB and more started with ``async_op=True`` or through ``write_async`` and
``read_async`` are submitted on a worker thread: a shared-memory copy then never runs on the
caller's thread (an asyncio loop keeps running), and the GIL is released while it copies.
"""

import asyncio
import base64
import concurrent.futures
import datetime
import json
import operator
import threading
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch.distributed._transport import Transport
from torch.distributed._transport._serialization import _WireDescriptor
from torch.distributed._transport._work import _validate_timeout, wait_all

from . import _native

#: What ``engine`` may name, and the native transport each one is.
ENGINES = {"auto": "symmem", "tcp": "tcp", "shm": "shm", "ucx": "ucx"}
#: Transfers of at least this many bytes started asynchronously run on a worker thread.
OFF_THREAD_BYTES = 1 << 20
#: The default timeout of every call, in seconds, as NIXL's.
DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class SymmemRemoteBuffer(_WireDescriptor):
    """A descriptor of a peer's registered memory: PyTorch's JSON v1 envelope, backend
    ``symmem``, parsed and checked by PyTorch's own descriptor code."""

    _backend: ClassVar[str] = "symmem"
    _fields: ClassVar[dict] = {
        "buffer_id": int,
        "offset": int,
        "length": int,
        "access_key": bytes,
        "writable": int,
        "endpoint": int,
    }
    buffer_id: int
    offset: int
    length: int
    access_key: bytes
    writable: int
    endpoint: int

    @classmethod
    def _of_native(cls, native):
        fields = json.loads(bytes(native.serialize()))["fields"]
        fields["access_key"] = base64.b64decode(fields["access_key"])
        return cls(**fields)

    def _native_for(self, name):
        """The native descriptor, for a native transport called ``name`` (cached)."""
        cache = self.__dict__.get("_cache")
        if cache is not None and cache[0] == name:
            return cache[1]
        body = {
            "version": 1,
            "backend": name,
            "fields": {
                "buffer_id": self.buffer_id,
                "offset": self.offset,
                "length": self.length,
                "access_key": base64.b64encode(self.access_key).decode("ascii"),
                "writable": self.writable,
                "endpoint": self.endpoint,
            },
        }
        native = _native.RemoteBuffer.deserialize(json.dumps(body, separators=(",", ":")).encode("ascii"))
        object.__setattr__(self, "_cache", (name, native))
        return native


class _Registration:
    def __init__(self, native, tensor):
        self.native = native
        self.tensor = tensor
        self.address = tensor.data_ptr()
        self.length = tensor.numel() * tensor.element_size()
        self.active = True

    def ensure_active(self):
        if not self.active:
            raise RuntimeError("memory has been unregistered")


class SymmemMemoryView:
    """A byte range of registered memory."""

    def __init__(self, memory, offset, length):
        self._memory = memory
        self._offset = offset
        self._length = length
        self._source = self._destination = None

    def size(self):
        return self._length

    def _native_view(self, write):
        """The native view of this range as the source of a write, or (``write`` false) as the
        destination of a read; made on first use (a view that outlives its registration is
        refused by the native checks as by ``_check_transfer``)."""
        native = self._source if write else self._destination
        if native is None:
            registration = self._memory._registration.native
            if write:
                native = self._source = registration.to_view(self._offset, self._length)
            else:
                native = self._destination = registration.to_mutable_view(self._offset, self._length)
        return native


class SymmemMutableMemoryView(SymmemMemoryView):
    """A byte range that transfers may write (the destination of a read)."""

    writable: Literal[True] = True


class SymmemMemory:
    """A tensor registered with a SymmemTransport."""

    def __init__(self, transport, registration):
        self._transport = transport
        self._registration = registration

    def _range(self, offset, length):
        self._registration.ensure_active()
        total = self._registration.length
        offset = 0 if offset is None else operator.index(offset)
        if offset < 0 or offset > total:
            raise ValueError("offset is outside the registered memory")
        length = total - offset if length is None else operator.index(length)
        if length < 0 or length > total - offset:
            raise ValueError("view exceeds the registered memory")
        return offset, length

    def to_view(self, offset=None, length=None):
        return SymmemMemoryView(self, *self._range(offset, length))

    def to_mutable_view(self, offset=None, length=None):
        return SymmemMutableMemoryView(self, *self._range(offset, length))

    def to_remote_buffer(self, *, timeout=None):
        _validate_timeout(timeout)
        self._transport._ensure_open()
        self._registration.ensure_active()
        return SymmemRemoteBuffer._of_native(self._registration.native.to_remote_buffer())


def _seconds(timeout):
    if timeout is None or timeout == datetime.timedelta(0):
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class SymmemWork(torch.distributed.Work):
    """A transfer in flight: a torch.distributed.Work. ``native`` is the native Work, or a
    concurrent future of it when the transfer was submitted on a worker thread."""

    def __init__(self, native, retained, timeout=None):
        super().__init__()
        self._w = native
        self._retained = retained
        self._timeout = timeout
        self._future = None
        self._lock = threading.Lock()

    def _native(self, timeout):
        if isinstance(self._w, concurrent.futures.Future):
            try:
                return self._w.result(timeout)
            except concurrent.futures.TimeoutError as e:
                raise TimeoutError("transport wait timed out; operation remains pending") from e
        return self._w

    def wait(self, timeout=datetime.timedelta(0)):
        seconds = _seconds(timeout)
        if seconds is None:
            seconds = self._timeout
        # One deadline for both steps: the submission (when on a worker thread), then the transfer.
        deadline = None if seconds is None else time.monotonic() + seconds
        try:
            native = self._native(seconds)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            native.wait(left)
        except TimeoutError as e:
            raise TimeoutError("transport wait timed out; operation remains pending") from e
        return True

    def is_completed(self):
        if isinstance(self._w, concurrent.futures.Future):
            if not self._w.done():
                return False
            if self._w.exception() is not None:
                return True
        return self._native(None).is_completed()

    def is_success(self):
        try:
            return self.is_completed() and self._native(None).is_success()
        except Exception:  # noqa: BLE001 - a failed submission is not a success
            return False

    def exception(self):
        if isinstance(self._w, concurrent.futures.Future) and self._w.done() and self._w.exception() is not None:
            return self._w.exception()
        if not self.is_completed():
            return None
        e = self._native(None).exception()
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
                        self._native(None).wait(None)
                        fut.set_result([])
                    except Exception as e:  # noqa: BLE001 - carried to the future
                        fut.set_exception(e if isinstance(e, RuntimeError) else RuntimeError(str(e)))

                if self.is_completed():
                    settle()
                else:
                    threading.Thread(target=settle, daemon=True).start()
            return self._future


class SymmemTransport(Transport):
    """A one-sided transport on symmem: shared memory on one host, TCP (or UCX) across hosts."""

    def __init__(self, device=None, *, engine="auto", timeout=DEFAULT_TIMEOUT, **options):
        super().__init__(device)
        if self.device is not None and self.device.type != "cpu":
            raise ValueError(f"symmem transport supports CPU tensors only, not {self.device}")
        _validate_timeout(timeout)
        if engine not in ENGINES:
            raise ValueError(f"unknown symmem engine {engine!r}; valid: {', '.join(ENGINES)}")
        self._name = ENGINES[engine]
        self._t = _native.Transport(self._name, {k: str(v) for k, v in options.items()})
        self._timeout = timeout
        self._default_timeout = timeout
        self._registrations = {}
        self._lock = threading.RLock()
        self._pool = None
        self._was_connected = False
        # Lifecycle: open, then closing (new operations refused), then closed.
        self._closing = False
        self._closed = False

    @staticmethod
    def supported():
        return True

    def _ensure_open(self):
        if self._closing or self._closed:
            raise RuntimeError("transport is closed")

    def _timeout_of(self, timeout):
        _validate_timeout(timeout)
        return self._timeout if timeout is None else timeout

    def describe(self):
        """How the transport connected, e.g. "symmem via shm"."""
        return self._t.describe()

    def bind(self, *, timeout=None):
        t = self._timeout_of(timeout)
        self._ensure_open()
        return bytes(self._t.bind(t))

    def connect(self, peer_url, *, timeout=None):
        t = self._timeout_of(timeout)
        self._ensure_open()
        if self._t.connected() or self._was_connected:
            raise RuntimeError("transport is already connected")
        self._t.connect(bytes(peer_url), t)
        self._was_connected = True
        return 0

    def connected(self):
        return not (self._closing or self._closed) and self._t.connected()

    def register_memory(self, tensor, *, timeout=None):
        self._timeout_of(timeout)
        with self._lock:
            self._ensure_open()
            if not isinstance(tensor, torch.Tensor):
                raise TypeError("tensor must be a torch.Tensor")
            if not tensor.is_contiguous():
                raise ValueError("symmem transport requires a contiguous tensor")
            if tensor.numel() == 0:
                raise ValueError("cannot register an empty tensor")
            self._check_device(tensor.device)
            if tensor.device.type != "cpu":
                raise ValueError(f"symmem transport requires CPU tensors, got {tensor.device}")
            length = tensor.numel() * tensor.element_size()
            key = (tensor.data_ptr(), length)
            registration = self._registrations.get(key)
            if registration is None or not registration.active:
                native = self._t.register(tensor.data_ptr(), length, tensor, False)
                registration = _Registration(native, tensor)
                self._registrations[key] = registration
            return SymmemMemory(self, registration)

    def unregister_memory(self, memory, *, timeout=None):
        self._timeout_of(timeout)
        with self._lock:
            self._ensure_open()
            if not isinstance(memory, SymmemMemory) or memory._transport is not self:
                raise TypeError("memory was not registered by this transport")
            registration = memory._registration
            if not registration.active:
                return
            try:
                self._t.unregister(registration.native)
            except ValueError as e:
                raise RuntimeError(str(e)) from e
            registration.active = False
            key = (registration.address, registration.length)
            if self._registrations.get(key) is registration:
                del self._registrations[key]

    def _check_transfer(self, local_buffer, remote_buffer, *, mutable):
        # Every synchronous call runs this: attribute reads rather than method calls.
        kind = SymmemMutableMemoryView if mutable else SymmemMemoryView
        if not isinstance(local_buffer, kind) or local_buffer._memory._transport is not self:
            raise TypeError("local_buffer was not registered by this transport")
        if not isinstance(remote_buffer, SymmemRemoteBuffer):
            raise TypeError("remote_buffer was not registered by a symmem transport")
        if not self._was_connected:
            raise ValueError("remote buffer does not belong to the connected peer (the transport is not connected)")
        if local_buffer._length > remote_buffer.length:
            raise ValueError("local view does not fit in the remote buffer")
        registration = local_buffer._memory._registration
        if not registration.active:
            registration.ensure_active()
        # The registered memory must still be the tensor's (a resize frees it).
        tensor = registration.tensor
        if tensor.data_ptr() != registration.address or tensor.nbytes != registration.length:
            raise RuntimeError("registered tensor was resized or its storage was replaced")

    def _start(self, write, local_buffer, remote_buffer, timeout, off_thread):
        """Checks and submits one transfer; returns its SymmemWork."""
        t = self._timeout_of(timeout)
        self._ensure_open()
        self._check_transfer(local_buffer, remote_buffer, mutable=not write)
        native_remote = remote_buffer._native_for(self._name)
        length = local_buffer._length

        view = local_buffer._native_view(write)

        def submit():
            if write:
                return self._t.start_write(view, native_remote, t)
            return self._t.start_read(view, native_remote, t)

        retained = (local_buffer, remote_buffer)
        if off_thread and length >= OFF_THREAD_BYTES:
            with self._lock:
                self._ensure_open()
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="symmem-transfer")
                return SymmemWork(self._pool.submit(submit), retained, t)
        return SymmemWork(submit(), retained, t)

    def _transfer(self, write, local_buffer, remote_buffer, timeout):
        """One synchronous transfer: the checks of ``_start``, then the native call, which
        copies on this thread with no Work when the engine can (shm) and waits otherwise."""
        t = self._timeout if timeout is None else self._timeout_of(timeout)
        if self._closing or self._closed:
            self._ensure_open()
        self._check_transfer(local_buffer, remote_buffer, mutable=not write)
        view, remote = local_buffer._native_view(write), remote_buffer._native_for(self._name)
        try:
            if write:
                self._t.write(view, remote, t)
            else:
                self._t.read(view, remote, t)
        except TimeoutError as e:
            raise TimeoutError("transport wait timed out; operation remains pending") from e
        return 0

    def write(self, local_buffer, remote_buffer, *, async_op=False, timeout=None):
        if async_op:
            return self._start(True, local_buffer, remote_buffer, timeout, True)
        return self._transfer(True, local_buffer, remote_buffer, timeout)

    def read(self, local_buffer, remote_buffer, *, async_op=False, timeout=None):
        if async_op:
            return self._start(False, local_buffer, remote_buffer, timeout, True)
        return self._transfer(False, local_buffer, remote_buffer, timeout)

    async def write_async(self, local_buffer, remote_buffer, *, timeout=None):
        """Write a local view, yielding to asyncio until the transfer finishes (a large copy
        runs on a worker thread, never on the loop's)."""
        t = self._timeout_of(timeout)
        work = self._start(True, local_buffer, remote_buffer, t, True)
        await wait_all((work,), timeout=t)

    async def read_async(self, local_buffer, remote_buffer, *, timeout=None):
        """Read into a local view, yielding to asyncio until the transfer finishes."""
        t = self._timeout_of(timeout)
        work = self._start(False, local_buffer, remote_buffer, t, True)
        await wait_all((work,), timeout=t)

    def close(self, *, timeout=None):
        """Drains outstanding transfers and releases everything; repeating it is a no-op. A
        close that times out still refuses new operations and may be retried."""
        t = self._timeout_of(timeout)
        with self._lock:
            if self._closed:
                return
            self._closing = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._t.close(t)
        with self._lock:
            for registration in self._registrations.values():
                registration.active = False
            self._registrations.clear()
            self._closed = True

    async def close_async(self, *, timeout=None):
        """``close`` without blocking the event loop: the drain runs on a worker thread."""
        t = self._timeout_of(timeout)
        await asyncio.to_thread(self.close, timeout=t)
