"""Symmetric memory in Python, after ``torch.distributed._symmetric_memory``.

Every rank allocates the same buffer with :func:`empty`, then :func:`rendezvous` maps the peers'
buffers and signal pads; the handle gives peer buffers as tensors viewing the shared memory,
signals, barriers, and the operators run on top. The group is the world of the launcher
(``symmem run`` or torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

Tensors are torch tensors (CPU) when the dtype is a ``torch.dtype``, NumPy arrays otherwise;
both view the shared memory without copies::

    import torch, symmem.symm as symm
    t = symm.empty(1024, dtype=torch.float32)
    hdl = symm.rendezvous(t)
    t.fill_(hdl.rank)
    symm.all_reduce(t, "sum")        # every element is now 0 + 1 + ... + world_size - 1
"""

import operator
import weakref

from . import _native
from .errors import InvalidArgumentError

__all__ = [
    "MemPool",
    "SymmetricMemory",
    "enable_symm_mem_for_group",
    "install",
    "one_shot_all_reduce_copy",
    "one_shot_all_reduce_copy_out",
    "get_backend",
    "get_mem_pool",
    "get_mempool_allocator",
    "get_signal_pad_size",
    "get_symm_mem_workspace",
    "has_multicast_support",
    "is_nvshmem_available",
    "is_symm_mem_enabled_for_group",
    "set_backend",
    "set_signal_pad_size",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_nd",
    "all_to_all_vdev",
    "all_to_all_vdev_2d",
    "all_to_all_vdev_2d_offset",
    "barrier",
    "broadcast",
    "empty",
    "fused_all_gather_matmul",
    "fused_all_gather_scaled_matmul",
    "fused_scaled_matmul_reduce_scatter",
    "memcpy_to_multicast_",
    "memset32_",
    "multimem_all_gather_out",
    "multimem_all_reduce_",
    "multimem_one_shot_all_reduce",
    "multimem_one_shot_reduce_out",
    "stream_write_value32_",
    "fused_matmul_reduce_scatter",
    "get",
    "is_symm_mem_tensor",
    "low_contention_all_gather",
    "low_contention_reduce_scatter",
    "multi_root_tile_reduce",
    "nccl_put_with_signal",
    "nccl_wait_for_signal",
    "new_group",
    "nvshmem_get",
    "nvshmem_get_out",
    "nvshmem_put",
    "nvshmem_put_with_signal",
    "nvshmem_wait_for_signal",
    "one_shot_all_reduce",
    "one_shot_all_reduce_out",
    "put_signal",
    "reduce_scatter_offset",
    "reduce_scatter_out",
    "rendezvous",
    "tile_reduce",
    "two_shot_all_reduce_",
    "two_shot_all_reduce_out",
    "wait_signal",
    "world",
]

# Symmetric buffers by base address, so a tensor (or a view of one) finds its allocation.
_buffers = weakref.WeakValueDictionary()
# Signal pad views handed out by get_signal_pad, by identity (several may view one pad), so a
# tensor viewing one finds it when passed as a signal.
_pads = weakref.WeakValueDictionary()
# The buffer found last, as (base, end, weak reference): operators are called on the same
# tensors again and again, and scanning the weak dictionary costs microseconds.
_last_found = (0, 0, None)
# The native tensor made last, with what it was made from: (tensor type, address, shape,
# strides, dtype, native tensor, weak reference to its buffer). A torch tensor of that type,
# address and layout gets it back without reading its layout again nor building a native view
# (1.3 us of the 2.3 us a call spent in Python). The buffer's death clears it, so it never holds
# freed memory nor outlives its allocation.
_NO_NATIVE = (None, 0, None, None, None, None, None)
_last_native = _NO_NATIVE

# Whether a type is torch's tensor type, decided once per type (the per-call path avoids
# string operations).
_torch_types = {}
# symmem's name of each torch dtype met so far.
_torch_dtype_names = {}


def _is_torch(x):
    t = type(x)
    known = _torch_types.get(t)
    if known is None:
        known = _torch_types[t] = t.__module__.startswith("torch") and hasattr(t, "data_ptr")
    return known


def _is_torch_dtype(dtype):
    return type(dtype).__module__.startswith("torch")


def _dtype_name(dtype):
    """symmem's name of a torch dtype, a NumPy dtype, or a dtype name."""
    if _is_torch_dtype(dtype):
        return str(dtype).removeprefix("torch.")
    import numpy as np

    return np.dtype(dtype).name


def _wrap(buf, dtype, shape):
    """A tensor or array of ``dtype`` and ``shape`` viewing ``buf`` (no copy)."""
    if _is_torch_dtype(dtype):
        import torch

        if buf.nbytes() == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).view(shape)
    import numpy as np

    return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)


def _layout(x):
    """(address, dtype name, shape, element strides, itemsize, owner) of a torch tensor, an
    array, or anything with ``__dlpack__``."""
    if not _is_torch(x) and not hasattr(x, "__array_interface__") and hasattr(x, "__dlpack__"):
        from . import from_dlpack

        x = from_dlpack(x)
    if _is_torch(x):
        if not x.is_cpu:
            raise ValueError(f"symmem supports CPU tensors only, got {x.device}")
        dtype = x.dtype
        name = _torch_dtype_names.get(dtype)
        if name is None:
            name = _torch_dtype_names[dtype] = _dtype_name(dtype)
        # torch.Size and the stride tuple are sequences the native side takes as they are.
        return x.data_ptr(), name, x.shape, x.stride(), x.element_size(), x
    interface = getattr(x, "__array_interface__", None)
    if interface is None:
        raise TypeError(f"expected a torch tensor or a NumPy array, got {type(x).__name__}")
    item = x.itemsize
    if any(s < 0 for s in x.strides):
        raise ValueError("arrays with negative strides are not supported; pass a copy")
    strides = [s // item for s in x.strides]
    return interface["data"][0], x.dtype.name, list(x.shape), strides, item, x


def _find(addr):
    global _last_found
    base, end, ref = _last_found
    if base <= addr < end:
        buf = ref()
        if buf is not None:
            return base, buf
    # A whole tensor starts at its buffer's base: one lookup; a view needs the scan.
    buf = _buffers.get(addr)
    found = (addr, buf) if buf is not None else None
    if found is None:
        for base, buf in list(_buffers.items()):
            if base <= addr < base + buf.nbytes():
                found = (base, buf)
                break
    if found is not None:
        base, buf = found
        _last_found = (base, base + buf.nbytes(), weakref.ref(buf))
    return found


def _forget_native(ref):
    """Weak-reference callback: the buffer behind the remembered native tensor died."""
    global _last_native
    if _last_native[6] is ref:
        _last_native = _NO_NATIVE


def _remembered(x):
    """The native tensor made last, if ``x`` is a tensor of its type, address and layout."""
    kind, addr, shape, strides, dtype, native, _ = _last_native
    if (
        type(x) is kind
        and x.data_ptr() == addr
        and x.dtype is dtype
        and x.shape == shape
        and x.stride() == strides
        and x.is_cpu
    ):
        return native
    return None


def _symmetric_view(x, found, addr, name, shape, strides):
    """The native view of ``x`` in its symmetric buffer ``found``, remembered for the next call."""
    global _last_native
    base, buf = found
    native = buf.tensor(name, shape, strides, addr - base)
    if _is_torch(x):
        _last_native = (type(x), addr, shape, strides, x.dtype, native, weakref.ref(buf, _forget_native))
    return native


def _symmetric_lookup(x):
    """(the native view of ``x`` in its symmetric buffer, or None if it has none; ``x``'s
    layout, or None when the view was remembered)."""
    native = _remembered(x)
    if native is not None:
        return native, None
    layout = _layout(x)
    addr, name, shape, strides, _, _ = layout
    found = _find(addr)
    if found is None:
        return None, layout
    return _symmetric_view(x, found, addr, name, shape, strides), layout


def _symmetric_or_none(x, what="tensor"):
    """The native tensor of symmetric ``x``, or None when ``x`` has no elements (operators
    return at once); raises for a tensor that is not symmetric."""
    native, _ = _symmetric_lookup(x)
    if native is not None:
        return native
    if _numel(x) == 0:
        return None
    raise ValueError(f"{what} must be allocated with symmem.symm.empty")


def _native_tensor(x, *, symmetric=False, what="tensor"):
    """The native tensor behind ``x``: its symmetric allocation, or (unless ``symmetric``) its
    own memory, borrowed for the call."""
    native, layout = _symmetric_lookup(x)
    if native is not None:
        return native
    if symmetric:
        raise ValueError(f"{what} must be allocated with symmem.symm.empty")
    addr, name, shape, strides, item, owner = layout
    extent = item
    for d, s in zip(shape, strides):
        if d == 0:
            extent = 0
            break
        extent += (d - 1) * s * item
    return _native.Tensor.external(addr, extent, owner, name, shape, strides)


_world = None


def world():
    """The world group (joined on first use through the launcher's store)."""
    global _world
    if _world is None:
        _world = _native.world()
    return _world


# Groups made by new_group, by name, so operators accept a group name as PyTorch's do.
_groups = {}
# symmem's group of each torch.distributed process group, by the process group itself, held
# weakly: it goes with the process group, and a name torch gives out again after
# destroy_process_group (the first new_group of a new world is "1" again, maybe with other
# ranks) is a new group, never the one kept under the old name.
_torch_groups = weakref.WeakKeyDictionary()


def new_group(ranks):
    """A sub-group of the world's ``ranks`` (in that order): every rank calls it with the same
    ranks; ranks outside get None. Pass it, or its ``group_name``, to rendezvous and operators."""
    g = world().split([int(r) for r in ranks])
    if g is not None:
        _groups[g.group_name] = g
    return g


def _torch_process_group(group):
    """The ``torch.distributed`` process group ``group`` is (or names), if torch knows it."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, str):
        try:
            return dist.distributed_c10d._resolve_process_group(group)
        except Exception:  # noqa: BLE001 - not a name torch knows
            return None
    return None


def _from_torch(pg):
    """symmem's group of the same ranks as PyTorch process group ``pg``, made on first use (by
    the members only: a split exchanges nothing)."""
    import torch.distributed as dist

    g = _torch_groups.get(pg)
    if g is not None:
        return g
    w = world()
    ranks = dist.get_process_group_ranks(pg)
    if ranks == list(range(w.world_size)):
        g = w
    else:
        g = w.split(ranks)
        if g is None:
            raise ValueError(f"this rank ({w.rank}) is not in process group {pg.group_name!r} (ranks {ranks})")
    _torch_groups[pg] = g
    return g


def _group(group):
    w = world()
    if group is None or group is w or group == w.group_name:
        return w
    if isinstance(group, _native.Group):
        return group
    if isinstance(group, str) and group in _groups:
        return _groups[group]
    pg = _torch_process_group(group)
    if pg is not None:
        return _from_torch(pg)
    raise ValueError(
        f"unknown group {group!r}: use None (the world), a group from new_group or its name, or a "
        "torch.distributed ProcessGroup (dist.group.WORLD, dist.new_group(...)) or its group_name"
    )


def empty(*size, dtype=None, device="cpu"):
    """A zeroed symmetric tensor (``torch.dtype``) or array (NumPy dtype); not collective."""
    if str(device) != "cpu":
        raise ValueError(f"symmem symmetric memory supports the CPU only, not {device}")
    return _allocate(_native.empty, size, dtype)


def _allocate(alloc, size, dtype):
    """A tensor or array of ``size`` (sizes, or one tuple of them) and ``dtype`` (float32 by
    default) over a symmetric buffer from ``alloc(shape, dtype name)``, findable by address."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    if dtype is None:
        import torch

        dtype = torch.float32
    buf = alloc(list(size), _dtype_name(dtype))
    if buf.nbytes():
        _buffers[buf.address()] = buf
    return _wrap(buf, dtype, tuple(size))


def install():
    """One switch for PyTorch code: registers CPU kernels for ``torch.ops.symm_mem`` (e.g.
    ``torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group_name)``) and makes
    ``torch.distributed._symmetric_memory``'s ``empty``/``rendezvous``, its configuration names
    and every function of it that dispatches on the backend or the handle (``get``,
    ``put_signal``, ``wait_signal``, ``reduce_scatter_offset``, ``all_to_all_nd``) use symmem for
    CPU tensors, so a GPU program's symmetric-memory code runs on CPUs in CI."""
    from ._torch_ops import install as _install

    _install()


def one_shot_all_reduce_copy(symm_buffer, local_input, reduce_op, group_name=None):
    """Copies ``local_input`` (any memory) into symmetric ``symm_buffer``, then all-reduces it
    into a new tensor (PyTorch's ``one_shot_all_reduce_copy``)."""
    flat = symm_buffer.view(-1)[: local_input.numel()]
    flat.copy_(local_input.reshape(-1))
    return one_shot_all_reduce(flat, reduce_op, group_name).view(local_input.shape)


def one_shot_all_reduce_copy_out(symm_buffer, local_input, reduce_op, group_name, out):
    """:func:`one_shot_all_reduce_copy` into ``out``."""
    flat = symm_buffer.view(-1)[: local_input.numel()]
    flat.copy_(local_input.reshape(-1))
    one_shot_all_reduce_out(flat, reduce_op, group_name, out.view(-1))
    return out


def set_backend(name):
    """Selects the symmetric-memory backend, as PyTorch's: "CPU" here; "CUDA", "NVSHMEM" and
    "NCCL" answer that they need a CUDA device."""
    _native.set_backend(str(name))


def get_backend(device="cpu"):
    """The backend of ``device``: "CPU" for the CPU, None for a device without one."""
    return _native.get_backend(str(device))


def set_signal_pad_size(size):
    """Sets the signal pad size of future allocations, in bytes, as PyTorch's: earlier
    allocations keep theirs. Ranks must agree on each allocation's pad (a rendezvous of pads of
    different sizes fails on every rank, naming both)."""
    _native.set_signal_pad_size(_nonnegative(size, "signal pad size"))


def get_signal_pad_size():
    """The signal pad size of allocations, in bytes."""
    return _native.get_signal_pad_size()


class MemPool:
    """The CPU's symmetric memory pool: ``pool.empty(*size, dtype=...)`` allocates symmetric
    tensors that reuse blocks freed back to it (PyTorch's pool hooks the CUDA allocator; on the
    CPU the pool allocates itself)."""

    def __init__(self, native):
        self._p = native

    def empty(self, *size, dtype=None):
        return _allocate(self._p.empty, size, dtype)


def get_mem_pool(device="cpu"):
    """The symmetric memory pool of ``device`` (the CPU's; one per process)."""
    return MemPool(_native.get_mem_pool(str(device)))


def get_mempool_allocator(device="cpu"):
    """PyTorch's pluggable allocator for its CUDA memory pools; there is none for the CPU."""
    raise NotImplementedError(
        f"get_mempool_allocator({device!r}): a pluggable allocator exists for CUDA memory pools only; on the CPU, "
        "allocate from symmem.symm.get_mem_pool().empty(...)"
    )


def enable_symm_mem_for_group(group_name):
    """PyTorch's deprecated switch, which nothing needs any more (here neither): checks that
    ``group_name`` names a group of this process, and makes nothing (a group is made at its
    first collective use, by its members)."""
    if not is_symm_mem_enabled_for_group(group_name):
        raise InvalidArgumentError(f"enable_symm_mem_for_group: unknown group {group_name!r}")


def is_symm_mem_enabled_for_group(group_name):
    """Whether symmetric memory can be used with ``group_name``, as PyTorch answers it: True for a
    group this process has (symmem's world once joined, a group from :func:`new_group`, or a
    ``torch.distributed`` process group, by name or object), False otherwise, and so False in a
    process without any. It joins and makes nothing."""
    if isinstance(group_name, _native.Group):
        return True
    if isinstance(group_name, str):
        if group_name in _groups or (_world is not None and group_name == _world.group_name):
            return True
    return _torch_process_group(group_name) is not None


def get_symm_mem_workspace(group_name, min_size):
    """A rendezvoused symmetric workspace of at least ``min_size`` bytes for ``group_name``
    (collective: every rank asks for the same size), reused while big enough."""
    return _workspace(_group(group_name), _nonnegative(min_size, "min_size"))[1]


def _workspace(g, size):
    """(uint8 tensor, handle) of ``g``'s workspace, grown to ``size`` bytes (collective when it
    grows: every rank asks for the same sizes in the same order)."""
    import torch

    held = _workspaces.get(g)
    if held is None or held[0].numel() < size:
        t = empty(max(size, 1), dtype=torch.uint8)
        held = (t, rendezvous(t, g))
        _workspaces[g] = held
    return held


# Each group's workspace, held weakly by the group: it goes with the group.
_workspaces = weakref.WeakKeyDictionary()


def is_nvshmem_available():
    """NVSHMEM needs CUDA devices: never here."""
    return False


def has_multicast_support(device_type="cpu", device_idx=0):
    """Multicast (NVLink SHARP) needs CUDA devices: never here."""
    return False


def is_symm_mem_tensor(x):
    """Whether ``x`` views a symmetric allocation of this process."""
    return _find(_layout(x)[0]) is not None


class SymmetricMemory:
    """A rendezvoused symmetric allocation seen from this rank (PyTorch's ``_SymmetricMemory``)."""

    def __init__(self, native, tensor):
        self._h = native
        self._tensor = tensor

    rank = property(lambda self: self._h.rank)
    world_size = property(lambda self: self._h.world_size)
    buffer_ptrs = property(lambda self: self._h.buffer_ptrs)
    signal_pad_ptrs = property(lambda self: self._h.signal_pad_ptrs)
    buffer_size = property(lambda self: self._h.buffer_size)
    signal_pad_size = property(lambda self: self._h.signal_pad_size)
    offset = property(lambda self: self._h.offset)
    group_name = property(lambda self: self._h.group_name)
    remote_ranks = property(lambda self: self._h.remote_ranks)
    local_ranks = property(lambda self: self._h.local_ranks)

    #: The multicast address: none on CPUs (PyTorch's handle has it on NVLink SHARP GPUs).
    multicast_ptr = 0

    @property
    def device(self):
        """The device of the allocation, as PyTorch's handle has it: ``torch.device("cpu")`` for
        a torch tensor (torch's ``get`` and ``wait_signal`` read it), ``"cpu"`` for an array."""
        if _is_torch(self._tensor):
            return self._tensor.device
        return "cpu"

    def _rank(self, rank):
        rank = operator.index(rank)
        if not 0 <= rank < self.world_size:
            raise InvalidArgumentError(f"rank must be in [0, {self.world_size}) (got {rank})")
        return rank

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        """Rank ``rank``'s buffer as a tensor of ``sizes`` and ``dtype`` viewing its memory."""
        sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        offset = _nonnegative(storage_offset, "storage_offset")
        return _wrap(self._h.get_buffer(self._rank(rank), sizes, _dtype_name(dtype), offset), dtype, tuple(sizes))

    def get_remote_tensor(self, peer, sizes, dtype):
        """Peer ``peer``'s copy of the rendezvoused tensor: ``sizes`` elements from the handle's
        offset in the allocation (for ``rendezvous(y[256:])``, the peer's ``y[256:]``)."""
        sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        return _wrap(self._h.get_remote_tensor(self._rank(peer), sizes, _dtype_name(dtype)), dtype, tuple(sizes))

    def get_signal_pad(self, rank, sizes=None, dtype=None, storage_offset=0):
        """Rank ``rank``'s signal pad, as PyTorch's: by default its uint32 words; with ``sizes``
        and ``dtype``, a tensor of them from element ``storage_offset``. A uint32, int32 or
        int64 view of it is a signal for :func:`nvshmem_put_with_signal` and
        :func:`nvshmem_wait_for_signal` (its first element, the same word on every rank)."""
        buf = self._h.get_signal_pad(self._rank(rank))
        _pads[id(buf)] = buf
        torch_like = _is_torch(self._tensor)
        if dtype is None:
            if torch_like:
                import torch

                dtype = torch.uint32
            else:
                dtype = "uint32"
        whole = _wrap(buf, dtype, (buf.nbytes() // _itemsize(dtype),))
        offset = _nonnegative(storage_offset, "storage_offset")
        if sizes is None:
            return whole[offset:]
        sizes = [sizes] if isinstance(sizes, int) else list(sizes)
        n = 1
        for d in sizes:
            n *= d
        if offset + n > whole.shape[0]:
            raise ValueError(
                f"signal pad of {buf.nbytes()} bytes is too small for {sizes} elements at offset {offset}"
            )
        return whole[offset : offset + n].reshape(tuple(sizes))

    def barrier(self, channel=0, timeout_ms=0):
        """Waits for every rank on signal channel ``channel`` (0 ms: the default timeout)."""
        self._h.barrier(_channel(channel), _seconds(timeout_ms))

    def put_signal(self, dst_rank, channel=0, timeout_ms=0):
        """Raises a signal at ``dst_rank`` on ``channel``."""
        self._h.put_signal(self._rank(dst_rank), _channel(channel), _seconds(timeout_ms))

    def wait_signal(self, src_rank, channel=0, timeout_ms=0):
        """Waits for a signal from ``src_rank`` on ``channel``, then clears it."""
        self._h.wait_signal(self._rank(src_rank), _channel(channel), _seconds(timeout_ms))


def _itemsize(dtype):
    if _is_torch_dtype(dtype):
        return dtype.itemsize
    import numpy as np

    return np.dtype(dtype).itemsize


def _nonnegative(v, what):
    v = operator.index(v)
    if v < 0:
        raise InvalidArgumentError(f"{what} must be non-negative (got {v})")
    return v


def _channel(channel):
    channel = operator.index(channel)
    if channel < 0:
        raise InvalidArgumentError(
            f"channel for barrier(), put_signal() and wait_signal() must be non-negative (got {channel})"
        )
    return channel


def _peer(peer, op):
    """A peer's rank as a non-negative int (the native side takes unsigned ints): a negative one
    is invalid, as PyTorch says it."""
    peer = operator.index(peer)
    if peer < 0:
        raise InvalidArgumentError(f"{op}: invalid peer {peer}")
    return peer


def _seconds(timeout_ms):
    return None if not timeout_ms else timeout_ms / 1000.0


def rendezvous(tensor, group=None):
    """Establishes symmetric memory for ``tensor`` among the ranks of ``group`` (collective)."""
    native = _native_tensor(tensor, symmetric=True, what="rendezvous: tensor")
    return SymmetricMemory(_native.rendezvous(native, _group(group)), tensor)


def barrier(group=None, timeout=None):
    """A store barrier over ``group`` (seconds)."""
    _group(group).barrier(timeout)


def get(dst, hdl, peer, offset=0):
    """Copies ``dst.numel()`` elements from ``peer``'s allocation (element ``offset``) into ``dst``.
    Bad arguments raise ValueError (``InvalidArgumentError``) with PyTorch's messages."""
    offset = operator.index(offset)
    if offset < 0:
        raise InvalidArgumentError("get: offset must be non-negative")
    _native.get(_native_tensor(dst), hdl._h, _peer(peer, "get"), offset)


def put_signal(src, hdl, peer):
    """Copies ``src`` into ``peer``'s allocation, then signals it; see :func:`wait_signal`."""
    _native.put_signal(_native_tensor(src), hdl._h, _peer(peer, "put_signal"))


def wait_signal(hdl, peer):
    """Waits until ``peer``'s :func:`put_signal` data has landed."""
    _native.wait_signal(hdl._h, _peer(peer, "wait_signal"))


def nvshmem_put(tensor, peer):
    """Copies the whole of symmetric ``tensor`` into the same tensor on ``peer`` (any host)."""
    _native.nvshmem_put(_native_tensor(tensor, symmetric=True), _peer(peer, "nvshmem_put"))


def nvshmem_get(tensor, peer):
    """Copies the same symmetric tensor on ``peer`` (any host) into ``tensor``."""
    _native.nvshmem_get(_native_tensor(tensor, symmetric=True), _peer(peer, "nvshmem_get"))


def nvshmem_get_out(dst, hdl, offset, size, peer):
    """Copies ``size`` elements from element ``offset`` of ``peer``'s allocation into ``dst``."""
    offset, size = _nonnegative(offset, "nvshmem_get_out: offset"), _nonnegative(size, "nvshmem_get_out: size")
    _native.nvshmem_get_out(_native_tensor(dst), hdl._h, offset, size, _peer(peer, "nvshmem_get_out"))


def _signal(sigpad, op):
    """The native tensor of a signal: a symmetric tensor, or a view of a signal pad from
    ``get_signal_pad``."""
    native, layout = _symmetric_lookup(sigpad)
    if native is not None:
        return native
    addr, name, shape, strides, _, _ = layout
    for buf in list(_pads.values()):
        base = buf.address()
        if base <= addr < base + buf.nbytes():
            return buf.tensor(name, shape, strides, addr - base)
    raise InvalidArgumentError(
        f"{op}: the signal must be a symmetric tensor (symmem.symm.empty) or a view of a signal pad (get_signal_pad)"
    )


def nvshmem_put_with_signal(tensor, sigpad, signal, peer):
    """Puts ``tensor`` into ``peer``'s copy, then sets ``peer``'s copy of the first element of
    ``sigpad`` (a symmetric int64/int32/uint32 tensor, or a signal pad view) to ``signal``."""
    _native.nvshmem_put_with_signal(
        _native_tensor(tensor, symmetric=True),
        _signal(sigpad, "nvshmem_put_with_signal"),
        _nonnegative(signal, "nvshmem_put_with_signal: signal"),
        _peer(peer, "nvshmem_put_with_signal"),
    )


def nvshmem_wait_for_signal(sigpad, signal, peer):
    """Waits until this rank's ``sigpad`` equals ``signal`` (set by ``peer``'s put with signal)."""
    signal = _nonnegative(signal, "nvshmem_wait_for_signal: signal")
    native = _signal(sigpad, "nvshmem_wait_for_signal")
    _native.nvshmem_wait_for_signal(native, signal, _peer(peer, "nvshmem_wait_for_signal"))


def nccl_put_with_signal(tensor, signal, peer):
    """PyTorch's NCCL put with signal: puts symmetric ``tensor`` into ``peer``'s copy, then sets
    the first 8 bytes (a uint64) of ``peer``'s signal pad of its allocation to ``signal``. That
    word holds channel 0's first barrier slots too: zero it after use, as PyTorch asks of any
    signal a user keeps in the pad."""
    _native.nccl_put_with_signal(
        _native_tensor(tensor, symmetric=True),
        _nonnegative(signal, "nccl_put_with_signal: signal"),
        _peer(peer, "nccl_put_with_signal"),
    )


def nccl_wait_for_signal(sigpad, signal):
    """PyTorch's NCCL wait for signal: waits until the first 8 bytes of this rank's signal pad of
    symmetric ``sigpad``'s allocation hold at least ``signal`` (see :func:`nccl_put_with_signal`)."""
    signal = _nonnegative(signal, "nccl_wait_for_signal: signal")
    _native.nccl_wait_for_signal(_native_tensor(sigpad, symmetric=True), signal)


def _like(x, buf):
    return _wrap(buf, x.dtype, tuple(x.shape))


def _numel(x):
    if _is_torch(x):
        return x.numel()
    return int(getattr(x, "size", 1))


def one_shot_all_reduce(input, reduce_op="sum", group_name=None):
    """All-reduce of symmetric ``input`` into a new tensor: every rank reads every peer."""
    if _numel(input) == 0:
        return input.clone() if _is_torch(input) else input.copy()
    g = _group(group_name)
    return _like(input, _native.one_shot_all_reduce(_native_tensor(input, symmetric=True), reduce_op, g))


def one_shot_all_reduce_out(input, reduce_op, group_name, out):
    """All-reduce of symmetric ``input`` into ``out``."""
    if _numel(input) == 0:
        return out
    g = _group(group_name)
    _native.one_shot_all_reduce_out(_native_tensor(input, symmetric=True), reduce_op, g, _native_tensor(out))
    return out


def two_shot_all_reduce_(input, reduce_op="sum", group_name=None):
    """In-place all-reduce of symmetric ``input``: reduce-scatter, then all-gather."""
    if _numel(input) == 0:
        return input
    _native.two_shot_all_reduce_(_native_tensor(input, symmetric=True), reduce_op, _group(group_name))
    return input


def two_shot_all_reduce_out(input, reduce_op, group_name, out):
    """Two-shot all-reduce of symmetric ``input`` into ``out``."""
    if _numel(input) == 0:
        return out
    g = _group(group_name)
    _native.two_shot_all_reduce_out(_native_tensor(input, symmetric=True), reduce_op, g, _native_tensor(out))
    return out


def all_reduce(tensor, reduce_op="sum", group_name=None):
    """In-place all-reduce of symmetric ``tensor``, the algorithm chosen by size."""
    # The hot path first: a symmetric tensor found by address; an empty one has no address.
    native = _symmetric_or_none(tensor)
    if native is not None:
        _native.all_reduce(native, reduce_op, _group(group_name))
    return tensor


def reduce_scatter_out(input, group_name, split_last_dim, output, *, reduce_op="sum"):
    """This rank's slice of the sum of symmetric ``input``, into ``output`` (PyTorch's schema:
    ``reduce_scatter_out(input, group_name, split_last_dim, output)``); ``reduce_op`` ("sum",
    "avg", "min", "max") is symmem's own, by keyword."""
    if _numel(input) == 0:
        return output
    g = _group(group_name)
    src = _native_tensor(input, symmetric=True)
    _native.reduce_scatter_out(src, reduce_op, g, bool(split_last_dim), _native_tensor(output))
    return output


def all_gather_into_tensor(input, group_name, out):
    """Every rank's symmetric ``input``, concatenated into ``out``."""
    if _numel(input) == 0:
        return out
    _native.all_gather_into(_native_tensor(input, symmetric=True), _group(group_name), _native_tensor(out))
    return out


def low_contention_all_gather(tensor, group_name=None):
    """PyTorch's ``_low_contention_all_gather``: every rank's ``tensor`` (symmetric or not: an
    ordinary one is first copied into the group's workspace), in rank order, in a new tensor of
    ``ws * tensor.shape[0]`` rows."""
    return _result(_native.low_contention_all_gather(_native_tensor(tensor), _group(group_name)), tensor)


def low_contention_reduce_scatter(tensor, reduce_op, group_name=None):
    """PyTorch's ``_low_contention_reduce_scatter``: this rank's block (of ``ws`` along the first
    dimension) of the ``reduce_op`` ("sum" or "avg") of every rank's ``tensor`` (symmetric or
    not), in a new tensor."""
    native = _native.low_contention_reduce_scatter(_native_tensor(tensor), reduce_op, _group(group_name))
    return _result(native, tensor)


def broadcast(input, root, group_name=None):
    """``root``'s symmetric ``input`` copied to every rank's, in place."""
    g = _group(group_name)
    root = _nonnegative(root, "root")
    if root >= g.world_size:
        raise ValueError(f"root must be in [0, {g.world_size}) (got {root})")
    if _numel(input) == 0:
        return input
    _native.broadcast_(_native_tensor(input, symmetric=True), root, g)
    return input


def all_to_all(input, out, group_name=None):
    """Block ``j`` of symmetric ``input`` to rank ``j``; ``out`` receives one block per rank."""
    if _numel(input) == 0:
        return out
    _native.all_to_all(_native_tensor(input, symmetric=True), _native_tensor(out), _group(group_name))
    return out


def _result(buf, like):
    """A tensor (like ``like``: torch or NumPy) over an operator's result buffer."""
    if _is_torch(like):
        import torch

        return _wrap(buf, getattr(torch, buf.dtype()), tuple(buf.shape()))
    return _wrap(buf, buf.dtype(), tuple(buf.shape()))


def all_to_all_vdev(input, out, in_splits, out_splits_offsets, group_name=None):
    """Variable-size all-to-all: ``in_splits[j]`` rows of symmetric ``input`` go to rank ``j``;
    ``out_splits_offsets`` (2 x world_size, int64) receives the splits and offsets that arrived."""
    _native.all_to_all_vdev(
        _native_tensor(input, symmetric=True),
        _native_tensor(out),
        _native_tensor(in_splits, symmetric=True, what="in_splits"),
        _native_tensor(out_splits_offsets),
        _group(group_name),
    )


def all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group_name=None, major_align=None):
    """Expert-parallel dispatch: rank-major input, expert-major output aligned to ``major_align``."""
    _native.all_to_all_vdev_2d(
        _native_tensor(input, symmetric=True),
        _native_tensor(out),
        _native_tensor(in_splits, symmetric=True, what="in_splits"),
        _native_tensor(out_splits_offsets),
        _group(group_name),
        major_align,
    )


def all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group_name=None):
    """Expert-parallel combine, the inverse of :func:`all_to_all_vdev_2d`."""
    _native.all_to_all_vdev_2d_offset(
        _native_tensor(input, symmetric=True),
        _native_tensor(out),
        _native_tensor(in_splits_offsets, symmetric=True, what="in_splits_offsets"),
        _native_tensor(out_splits_offsets),
        _group(group_name),
    )


def tile_reduce(in_tile, out_tile, root, group_name=None, reduce_op="sum"):
    """Reduces every rank's ``in_tile`` (a view of a symmetric tensor) into ``root``'s ``out_tile``."""
    _native.tile_reduce(
        _native_tensor(in_tile, symmetric=True), _native_tensor(out_tile), root, _group(group_name), reduce_op
    )


def multi_root_tile_reduce(in_tiles, out_tile, roots, group_name=None, reduce_op="sum"):
    """Reduces tile ``i`` of every rank into ``roots[i]``'s ``out_tile``."""
    tiles = [_native_tensor(t, symmetric=True) for t in in_tiles]
    _native.multi_root_tile_reduce(tiles, _native_tensor(out_tile), list(roots), _group(group_name), reduce_op)


def reduce_scatter_offset(input, out, group_name=None, dim=0, offsets=None, dst_ranks=None, red_op="sum"):
    """Reduce-scatter of symmetric ``input`` along ``dim`` into the blocks of ``out`` this rank
    owns (PyTorch's ``nccl_reduce_scatter_offset`` schema; ``red_op``)."""
    reduce_op = red_op
    _native.reduce_scatter_offset(
        _native_tensor(input, symmetric=True),
        [_native_tensor(o) for o in out],
        _group(group_name),
        dim,
        None if offsets is None else list(offsets),
        None if dst_ranks is None else list(dst_ranks),
        reduce_op,
    )


def all_to_all_nd(input, out, scatter_dim, gather_dim, group_name=None):
    """All-to-all that scatters ``scatter_dim`` of symmetric ``input`` and gathers ``gather_dim``."""
    _native.all_to_all_nd(
        _native_tensor(input, symmetric=True), _native_tensor(out), scatter_dim, gather_dim, _group(group_name)
    )


def fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name=None, *, return_A=True):
    """``all_gather(A_shard, gather_dim) @ B`` for each ``B`` in ``Bs``. Returns
    ``(A or None, [outputs])``. ``A_shard`` may be symmetric or, as PyTorch allows, an ordinary
    tensor, which is first copied into the group's symmetric workspace. A 2-D ``A_shard``
    multiplies shards as they arrive; an N-D one (PyTorch's tests use ``[8, 64, 32]``) is
    gathered along any ``gather_dim`` and multiplied as PyTorch's fallback does, with the same
    values and strides."""
    if A_shard.dim() == 2 and gather_dim in (0, 1, -1, -2):
        a, outs = _native.fused_all_gather_matmul(
            _native_tensor(A_shard),
            [_native_tensor(b) for b in Bs],
            gather_dim % 2,
            _group(group_name),
            return_A,
        )
        return (None if a is None else _result(a, A_shard)), [_result(o, A_shard) for o in outs]
    import torch

    g = _group(group_name)
    ws = g.world_size
    gathered = torch.empty((ws * A_shard.numel(),), dtype=A_shard.dtype)
    flat = A_shard.reshape(-1)
    if not is_symm_mem_tensor(flat):
        # An ordinary shard goes through the group's workspace first, as in PyTorch.
        nbytes = flat.numel() * flat.element_size()
        staged = _workspace(g, nbytes)[0][:nbytes].view(flat.dtype)
        staged.copy_(flat)
        flat = staged
    all_gather_into_tensor(flat, g, gathered)
    # From here, PyTorch's fallback step by step, so values and strides are the same.
    A = gathered.view(ws * A_shard.shape[0], *A_shard.shape[1:])
    if gather_dim == A.ndim - 1 or gather_dim == -1:
        A_mm = torch.cat(A.chunk(ws), dim=-1)
        return (A_mm if return_A else None), [torch.matmul(A_mm, B) for B in Bs]
    A = A.view(ws, *A_shard.shape).movedim(gather_dim + 1, 1).flatten(0, 1)
    res = [torch.matmul(A, B).movedim(0, gather_dim) for B in Bs]
    return (A.movedim(0, gather_dim) if return_A else None), res


def fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name=None):
    """``reduce_scatter(A @ B)`` along ``scatter_dim``: rank r gets block r of the sum (or
    mean) over ranks. A 2-D ``A`` runs the pipelined kernel; an N-D one is reduce-scattered
    along any ``scatter_dim`` as PyTorch's fallback does."""
    if A.dim() == 2 and scatter_dim in (0, 1, -1, -2):
        return _result(
            _native.fused_matmul_reduce_scatter(
                _native_tensor(A), _native_tensor(B), reduce_op, scatter_dim % 2, _group(group_name)
            ),
            A,
        )
    import torch

    g = _group(group_name)
    C = torch.matmul(A, B)
    dim = scatter_dim % C.dim()
    if C.shape[dim] % g.world_size:
        raise ValueError(
            f"fused_matmul_reduce_scatter: dimension {dim} of A @ B ({C.shape[dim]}) is not divisible by the "
            f"group size {g.world_size}"
        )
    front = C.movedim(dim, 0)
    # The group's workspace (symmetric) holds this rank's product for the reduce-scatter.
    buf = _workspace(g, front.numel() * C.element_size())[0][: front.numel() * C.element_size()].view(C.dtype)
    buf.view(front.shape).copy_(front)
    out = torch.empty((front.numel() // g.world_size,), dtype=C.dtype)
    reduce_scatter_out(buf, g, False, out, reduce_op=reduce_op)
    # Contiguous, as PyTorch's fallback (a reduce-scatter's output) is.
    return out.view(front.shape[0] // g.world_size, *front.shape[1:]).movedim(0, dim).contiguous()


def memset32_(input, offset, val, count=1):
    """Sets words ``offset .. offset + count`` of ``input`` (a flat, contiguous uint32 tensor,
    symmetric or not) to ``val``, each with a Release store and a wake of whoever waits on it:
    PyTorch's ``memset32_`` (a ``cuMemsetD32Async`` on the stream there), with its checks and
    messages. Returns ``input``."""
    offset, val, count = operator.index(offset), operator.index(val), operator.index(count)
    if offset < 0:
        raise InvalidArgumentError(f"memset32_: offset must be greater than or equal to 0 (got {offset})")
    if count <= 0:
        raise InvalidArgumentError(f"memset32_: count must be a positive integer (got {count})")
    _check_u32("memset32_", val)
    _native.memset32_(_native_tensor(input), offset, val, count)
    return input


def _check_u32(op, val):
    if not 0 <= val <= 0xFFFFFFFF:
        raise InvalidArgumentError(f"{op}: val must be in the range of [0, 4294967295] (uint32_t) (got {val})")


def stream_write_value32_(input, offset, val):
    """Stores ``val`` into word ``offset`` of ``input`` (a flat, contiguous uint32 tensor,
    symmetric or not) with a Release store, then wakes whoever waits on it: PyTorch's
    ``stream_write_value32_`` (a ``cuStreamWriteValue32`` there), with its checks and messages.
    Returns ``input``."""
    offset, val = operator.index(offset), operator.index(val)
    if offset < 0:
        raise InvalidArgumentError(
            f"stream_write_value32_: offset must be greater than or equal to 0 (got {offset})"
        )
    _check_u32("stream_write_value32_", val)
    _native.stream_write_value32_(_native_tensor(input), offset, val)
    return input


# Operators that need GPU hardware (NVLink SHARP multicast, FP8 tensor cores):
# PyTorch's schemas, answering NotImplementedError (a RuntimeError) with what they need.


def multimem_all_reduce_(input, reduce_op, group_name):
    """Needs NVLink SHARP multicast: raises NotImplementedError here."""
    _native.multimem_all_reduce_(_native_tensor(input), reduce_op, _group(group_name))


def multimem_all_gather_out(input, group_name, out):
    """Needs NVLink SHARP multicast: raises NotImplementedError here."""
    _native.multimem_all_gather_out(_native_tensor(input), _group(group_name), _native_tensor(out))


def multimem_one_shot_all_reduce(input, reduce_op, group_name):
    """Needs NVLink SHARP multicast: raises NotImplementedError here."""
    _native.multimem_one_shot_all_reduce(_native_tensor(input), reduce_op, _group(group_name))


def multimem_one_shot_reduce_out(input, reduce_op, root, group_name, out):
    """Needs NVLink SHARP multicast: raises NotImplementedError here."""
    g = _group(group_name)
    _native.multimem_one_shot_reduce_out(_native_tensor(input), reduce_op, _nonnegative(root, "root"), g, _native_tensor(out))


def memcpy_to_multicast_(symm_mem_out, src, byte_offset, group_name):
    """Needs a multicast object (CUDA, NVLink SHARP): raises NotImplementedError here."""
    g = _group(group_name)
    _native.memcpy_to_multicast_(_native_tensor(symm_mem_out), _native_tensor(src), _nonnegative(byte_offset, "byte_offset"), g)


def fused_all_gather_scaled_matmul(*args, **kwargs):
    """Needs FP8 tensor cores (CUDA): raises NotImplementedError here."""
    _native.fused_all_gather_scaled_matmul()


def fused_scaled_matmul_reduce_scatter(*args, **kwargs):
    """Needs FP8 tensor cores (CUDA): raises NotImplementedError here."""
    _native.fused_scaled_matmul_reduce_scatter()
