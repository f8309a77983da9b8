"""CPU kernels for PyTorch's ``torch.ops.symm_mem`` operators, and the switch that makes
``torch.distributed._symmetric_memory`` use symmem for CPU tensors (``symmem.symm.install()``).

Each kernel takes the operator's exact PyTorch schema (torch 2.15) and runs symmem's
operator; those that mutate return what the schema says. Operators PyTorch defines only with
a handle argument (``nvshmem_get_out``, ``nccl_put_signal``, ...) or for GPU hardware
(multimem, FP8) are not registered here: on the CPU they keep PyTorch's own "no kernel" error.
"""

import functools

_installed = False
_lib = None


def _kernels(symm):
    """symm_mem operator name -> CPU kernel, on the schemas of torch 2.15."""

    def one_shot_all_reduce(input, reduce_op, group_name):
        return symm.one_shot_all_reduce(input, reduce_op, group_name)

    def one_shot_all_reduce_out(input, reduce_op, group_name, out):
        return symm.one_shot_all_reduce_out(input, reduce_op, group_name, out)

    def one_shot_all_reduce_copy(symm_buffer, local_input, reduce_op, group_name):
        return symm.one_shot_all_reduce_copy(symm_buffer, local_input, reduce_op, group_name)

    def one_shot_all_reduce_copy_out(symm_buffer, local_input, reduce_op, group_name, out):
        return symm.one_shot_all_reduce_copy_out(symm_buffer, local_input, reduce_op, group_name, out)

    def two_shot_all_reduce_(input, reduce_op, group_name):
        return symm.two_shot_all_reduce_(input, reduce_op, group_name)

    def two_shot_all_reduce_out(input, reduce_op, group_name, output):
        return symm.two_shot_all_reduce_out(input, reduce_op, group_name, output)

    def reduce_scatter_out(input, group_name, split_last_dim, output):
        return symm.reduce_scatter_out(input, group_name, split_last_dim, output)

    def nvshmem_broadcast(input, root, group_name):
        return symm.broadcast(input, root, group_name)

    def nvshmem_all_to_all(input, out, group_name):
        return symm.all_to_all(input, out, group_name)

    def all_to_all_vdev(input, out, in_splits, out_splits_offsets, group_name):
        symm.all_to_all_vdev(input, out, in_splits, out_splits_offsets, group_name)

    def all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group_name, major_align=None):
        symm.all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group_name, major_align)

    def all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group_name):
        symm.all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group_name)

    def tile_reduce(in_tile, out_tile, root, group_name, reduce_op="sum"):
        symm.tile_reduce(in_tile, out_tile, root, group_name, reduce_op)

    def multi_root_tile_reduce(in_tiles, out_tile, roots, group_name, reduce_op="sum"):
        symm.multi_root_tile_reduce(in_tiles, out_tile, roots, group_name, reduce_op)

    def nccl_reduce_scatter_offset(input, out, group_name, dim, offsets=None, dst_ranks=None, red_op="sum"):
        symm.reduce_scatter_offset(input, out, group_name, dim, offsets, dst_ranks, red_op=red_op)

    def nccl_all_to_all_nd(input, out, scatter_dim, gather_dim, group_name):
        symm.all_to_all_nd(input, out, scatter_dim, gather_dim, group_name)

    def nvshmem_put(tensor, peer):
        symm.nvshmem_put(tensor, peer)

    def nvshmem_get(tensor, peer):
        symm.nvshmem_get(tensor, peer)

    def nvshmem_put_with_signal(tensor, sigpad, signal, peer):
        symm.nvshmem_put_with_signal(tensor, sigpad, signal, peer)

    def nvshmem_wait_for_signal(sigpad, signal, peer):
        symm.nvshmem_wait_for_signal(sigpad, signal, peer)

    def get_remote_tensors(x, group_name):
        hdl = symm.rendezvous(x, group_name)
        return [hdl.get_remote_tensor(r, list(x.shape), x.dtype) for r in range(hdl.world_size)]

    def fused_all_gather_matmul(A, Bs, gather_dim, group_name, *, return_A=True):
        a, outs = symm.fused_all_gather_matmul(A, Bs, gather_dim, group_name, return_A=return_A)
        return a, outs

    def fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
        return symm.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)

    return {f.__name__: f for f in locals().values() if callable(f)}


def install():
    """Registers the CPU kernels (once) and points ``torch.distributed._symmetric_memory``'s
    ``empty``, ``rendezvous`` and configuration functions at symmem for CPU tensors (other
    devices keep PyTorch's own)."""
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
    for name in (
        "is_symm_mem_tensor",
        "set_backend",
        "get_backend",
        "set_signal_pad_size",
        "get_signal_pad_size",
        "get_mem_pool",
        "get_symm_mem_workspace",
        "enable_symm_mem_for_group",
        "is_symm_mem_enabled_for_group",
        "is_nvshmem_available",
    ):
        setattr(torch_symm, name, getattr(symm, name))
    _installed = True
