"""CPU kernels for PyTorch's ``torch.ops.symm_mem`` operators, and the switch that makes
``torch.distributed._symmetric_memory`` use symmem for CPU tensors (``symmem.symm.install()``).

Each kernel takes the operator's exact PyTorch schema (torch 2.15) and runs symmem's
operator; those that mutate return what the schema says. Operators PyTorch defines only with
a handle argument (``nvshmem_get_out``, ``nccl_put_signal``, ``_barrier``, ...: a TorchBind
handle, which only a C++ backend can make) or for GPU hardware (multimem, FP8) are not
registered here: on the CPU they keep PyTorch's own "no kernel" error.

torch's internal entry points, the static methods of ``torch._C._distributed_c10d._SymmetricMemory``
(``empty_strided_p2p``, ``rendezvous``, ``is_symm_mem_tensor``, ``get_backend``, ...), are
replaced by functions that route a CPU device or tensor to symmem and call torch's own for any
other; ``_originals`` keeps torch's. Its ``memset32`` and ``stream_write_value32`` reach the CPU
kernels through the dispatcher.
"""

import functools
import warnings
import weakref

_installed = False
_lib = None
# torch's own static methods of _SymmetricMemory that install() replaced, by name.
_originals = {}
# Persistent allocations (empty_strided_p2p with an alloc_id), by id: (symmetric buffer, its
# size in bytes, weak reference to the memoryview the tensor handed out last holds). As in
# PyTorch, they live as long as the process, and an id gets its same memory back once the
# tensor (and every view) of its last allocation is gone.
_persistent = {}
# The group name given to empty_strided_p2p, by symmetric buffer, for a later rendezvous
# without one (PyTorch's allocation-time group name).
_alloc_groups = weakref.WeakKeyDictionary()


def _kernels(symm):
    """symm_mem operator name -> CPU kernel, on the schemas of torch 2.15. Most are symmem's
    function of the same arguments in the same order; the rest adapt names."""

    def get_remote_tensors(x, group_name):
        hdl = symm.rendezvous(x, group_name)
        return [hdl.get_remote_tensor(r, list(x.shape), x.dtype) for r in range(hdl.world_size)]

    same = (
        "one_shot_all_reduce",
        "one_shot_all_reduce_out",
        "one_shot_all_reduce_copy",
        "one_shot_all_reduce_copy_out",
        "two_shot_all_reduce_",
        "two_shot_all_reduce_out",
        "reduce_scatter_out",
        "all_to_all_vdev",
        "all_to_all_vdev_2d",
        "all_to_all_vdev_2d_offset",
        "tile_reduce",
        "multi_root_tile_reduce",
        "nvshmem_put",
        "nvshmem_get",
        "nvshmem_put_with_signal",
        "nvshmem_wait_for_signal",
        "nccl_put_with_signal",
        "nccl_wait_for_signal",
        "fused_all_gather_matmul",
        "fused_matmul_reduce_scatter",
        "memset32_",
        "stream_write_value32_",
    )
    kernels = {name: getattr(symm, name) for name in same}
    kernels.update(
        nvshmem_broadcast=symm.broadcast,
        nvshmem_all_to_all=symm.all_to_all,
        nccl_reduce_scatter_offset=symm.reduce_scatter_offset,
        nccl_all_to_all_nd=symm.all_to_all_nd,
        nccl_put=symm.nvshmem_put,
        nccl_get=symm.nvshmem_get,
        _low_contention_all_gather=symm.low_contention_all_gather,
        _low_contention_reduce_scatter=symm.low_contention_reduce_scatter,
        get_remote_tensors=get_remote_tensors,
    )
    return kernels


def _dispatching(torch_symm, symm, on_cpu):
    """torch's functions that dispatch on the backend or the handle (and refuse a CPU one),
    with their own signatures: symmem's for a symmem handle or a CPU tensor, torch's
    otherwise."""

    names = ("get", "put_signal", "wait_signal", "reduce_scatter_offset", "all_to_all_nd", "get_mempool_allocator")
    original = {name: getattr(torch_symm, name) for name in names}

    def ours(hdl):
        return isinstance(hdl, symm.SymmetricMemory)

    @functools.wraps(original["get"])
    def get(dst, hdl, peer, offset=0):
        if ours(hdl):
            return symm.get(dst, hdl, peer, offset)
        return original["get"](dst, hdl, peer, offset)

    @functools.wraps(original["put_signal"])
    def put_signal(src, hdl, peer):
        if ours(hdl):
            return symm.put_signal(src, hdl, peer)
        return original["put_signal"](src, hdl, peer)

    @functools.wraps(original["wait_signal"])
    def wait_signal(hdl, peer):
        if ours(hdl):
            return symm.wait_signal(hdl, peer)
        return original["wait_signal"](hdl, peer)

    @functools.wraps(original["reduce_scatter_offset"])
    def reduce_scatter_offset(input, out, group, *, dim, offsets=None, dst_ranks=None, red_op="sum"):
        if on_cpu(input.device):
            return symm.reduce_scatter_offset(input, out, group, dim, offsets, dst_ranks, red_op)
        return original["reduce_scatter_offset"](
            input, out, group, dim=dim, offsets=offsets, dst_ranks=dst_ranks, red_op=red_op
        )

    @functools.wraps(original["all_to_all_nd"])
    def all_to_all_nd(input, out, scatter_dim, gather_dim, *, group):
        if on_cpu(input.device):
            return symm.all_to_all_nd(input, out, scatter_dim, gather_dim, group)
        return original["all_to_all_nd"](input, out, scatter_dim, gather_dim, group=group)

    @functools.wraps(original["get_mempool_allocator"])
    def get_mempool_allocator(device):
        if on_cpu(device):
            return symm.get_mempool_allocator(device)
        return original["get_mempool_allocator"](device)

    return get, put_signal, wait_signal, reduce_scatter_offset, all_to_all_nd, get_mempool_allocator


def _internal(torch, S, symm):
    """Replacements for the static methods of ``_SymmetricMemory`` (``S``) a CPU caller reaches:
    symmem's for a CPU device or tensor, torch's (kept in ``_originals``) otherwise."""
    names = ("empty_strided_p2p", "rendezvous", "is_symm_mem_tensor", "get_backend", "get_mempool_allocator")
    original = {name: getattr(S, name) for name in names}
    _originals.update(original)

    def cpu(device):
        return torch.device(device).type == "cpu"

    @functools.wraps(original["empty_strided_p2p"])
    def empty_strided_p2p(size, stride, dtype, device, group_name=None, alloc_id=None):
        if not cpu(device):
            return original["empty_strided_p2p"](size, stride, dtype, device, group_name, alloc_id)
        return _empty_strided_p2p(torch, symm, tuple(size), tuple(stride), dtype, group_name, alloc_id)

    @functools.wraps(original["rendezvous"])
    def rendezvous(tensor, group_name=None):
        if tensor.device.type != "cpu":
            return original["rendezvous"](tensor, group_name)
        found = symm._find(tensor.data_ptr()) if tensor.numel() else None
        if found is None:
            # PyTorch's answer for memory outside any symmetric allocation.
            warnings.warn(
                "Pointer not within any SymmetricMemory allocation, is the tensor allocated from SymmetricMemory?",
                stacklevel=2,
            )
            return None
        return symm.rendezvous(tensor, group_name or _alloc_groups.get(found[1]))

    @functools.wraps(original["is_symm_mem_tensor"])
    def is_symm_mem_tensor(tensor):
        if tensor.device.type != "cpu":
            return original["is_symm_mem_tensor"](tensor)
        return symm.is_symm_mem_tensor(tensor)

    @functools.wraps(original["get_backend"])
    def get_backend(device):
        if cpu(device):
            return symm.get_backend("cpu")
        return original["get_backend"](device)

    @functools.wraps(original["get_mempool_allocator"])
    def get_mempool_allocator(device):
        if cpu(device):
            return symm.get_mempool_allocator("cpu")
        return original["get_mempool_allocator"](device)

    return empty_strided_p2p, rendezvous, is_symm_mem_tensor, get_backend, get_mempool_allocator


def _empty_strided_p2p(torch, symm, size, stride, dtype, group_name, alloc_id):
    """PyTorch's ``empty_strided_p2p`` on the CPU: a symmetric tensor of ``size`` and
    ``stride``; with ``alloc_id``, a persistent one (see ``_persistent``)."""
    if len(size) != len(stride):
        raise RuntimeError(f"empty_strided_p2p: size {list(size)} and stride {list(stride)} differ in length")
    if any(d < 0 for d in size) or any(s < 0 for s in stride):
        raise RuntimeError(f"empty_strided_p2p: negative size or stride ({list(size)}, {list(stride)})")
    # The elements the strides reach (PyTorch allocates numel; a stride with gaps needs more).
    n = 0 if 0 in size else 1 + sum((d - 1) * s for d, s in zip(size, stride))
    nbytes = n * dtype.itemsize
    if alloc_id is None or nbytes == 0:
        flat = symm.empty(n, dtype=dtype)
        buf = symm._find(flat.data_ptr())[1] if nbytes else None
    else:
        flat, buf = _persistent_allocation(torch, symm, int(alloc_id), nbytes, dtype)
    if buf is not None and group_name is not None:
        _alloc_groups[buf] = group_name
    return flat.as_strided(size, stride)


def _persistent_allocation(torch, symm, alloc_id, nbytes, dtype):
    """(flat tensor of ``dtype``, its symmetric buffer) of allocation ``alloc_id``: the same
    memory every time, refused while a tensor of the last one lives, as PyTorch's."""
    held = _persistent.get(alloc_id)
    if held is not None:
        buf, size, issued = held
        if issued() is not None:
            raise RuntimeError(
                f"empty_strided_p2p: can not allocate with alloc_id == {alloc_id} because a previous allocation "
                "with the same alloc_id is still active."
            )
        if size != nbytes:
            raise RuntimeError(
                f"empty_strided_p2p: requested allocation size ({nbytes}) is different from the size of a previous "
                f"allocation with the same alloc_id ({size})"
            )
    else:
        # The buffer, held here for good, keeps its address in symmem's lookup.
        t = symm.empty(nbytes, dtype=torch.uint8)
        buf = symm._find(t.data_ptr())[1]
    # A fresh memoryview per allocation: the tensor's storage holds it (torch.frombuffer keeps
    # the exporter), so it dies exactly when the tensor and all its views have.
    view = memoryview(buf)
    _persistent[alloc_id] = (buf, nbytes, weakref.ref(view))
    return torch.frombuffer(view, dtype=dtype), buf


def install():
    """Registers the CPU kernels (once) and points ``torch.distributed._symmetric_memory``'s
    ``empty``, ``rendezvous``, configuration functions and every function that dispatches on
    the backend or the handle (``get``, ``put_signal``, ``wait_signal``,
    ``reduce_scatter_offset``, ``all_to_all_nd``, ``get_mempool_allocator``) at symmem for CPU
    tensors and symmem's handles (other devices keep PyTorch's own)."""
    global _installed, _lib
    if _installed:
        return
    import torch
    import torch.distributed._symmetric_memory as torch_symm

    from . import symm

    _lib = torch.library.Library("symm_mem", "IMPL")
    for name, kernel in _kernels(symm).items():
        _lib.impl(name, kernel, "CPU")

    def on_cpu(device):
        return device is None or torch.device(device).type == "cpu"

    original_empty, original_rendezvous = torch_symm.empty, torch_symm.rendezvous

    @functools.wraps(original_empty)
    def empty(*size, dtype=None, device=None):
        if on_cpu(device):
            return symm.empty(*size, dtype=dtype or torch.get_default_dtype(), device="cpu")
        return original_empty(*size, dtype=dtype, device=device)

    @functools.wraps(original_rendezvous)
    def rendezvous(tensor, group=None):
        if tensor.device.type == "cpu":
            return symm.rendezvous(tensor, group)
        return original_rendezvous(tensor, group)

    torch_symm.empty = empty
    torch_symm.rendezvous = rendezvous
    for f in _dispatching(torch_symm, symm, on_cpu):
        setattr(torch_symm, f.__name__, f)
    @functools.wraps(torch_symm.set_signal_pad_size)
    def set_signal_pad_size(size):
        symm.set_signal_pad_size(size)
        # torch's own getter (`_SymmetricMemory.signal_pad_size`, which PyTorch's tests read)
        # tells the same size.
        torch_symm._SymmetricMemory.signal_pad_size = size

    torch_symm.set_signal_pad_size = set_signal_pad_size
    for name in (
        "is_symm_mem_tensor",
        "set_backend",
        "get_backend",
        "get_signal_pad_size",
        "get_mem_pool",
        "get_symm_mem_workspace",
        "enable_symm_mem_for_group",
        "is_nvshmem_available",
    ):
        setattr(torch_symm, name, getattr(symm, name))

    @functools.wraps(torch_symm.is_symm_mem_enabled_for_group)
    def is_symm_mem_enabled_for_group(group_name):
        # torch's `_test_mode(group_names=...)` context decides while it is on, as in torch.
        if getattr(torch_symm, "_is_test_mode", False):
            mocked = getattr(torch_symm, "_mocked_group_names", None)
            return mocked is None or group_name in mocked
        return symm.is_symm_mem_enabled_for_group(group_name)

    torch_symm.is_symm_mem_enabled_for_group = is_symm_mem_enabled_for_group
    for f in _internal(torch, torch_symm._SymmetricMemory, symm):
        setattr(torch_symm._SymmetricMemory, f.__name__, staticmethod(f))
    _installed = True
