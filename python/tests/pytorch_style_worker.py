"""Symmetric memory as PyTorch users write it, under torchrun with a default process group
(gloo): PyTorch's groups and group names, PyTorch's positional signatures, its configuration
names, and its errors. Prints "pytorch style ok RANK" at the end."""

import torch
import torch.distributed as dist

import symmem.symm as symm

dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
world = dist.group.WORLD

# Configuration and capability names, as PyTorch's.
assert symm.get_backend("cpu") == "CPU" and symm.get_backend("cuda") is None
symm.set_backend("CPU")
try:
    symm.set_backend("NVSHMEM")
    raise AssertionError("NVSHMEM accepted on a CPU machine")
except RuntimeError as e:
    assert "CUDA" in str(e), e
assert symm.get_signal_pad_size() > 0
assert not symm.is_nvshmem_available() and not symm.has_multicast_support("cuda", 0)
symm.enable_symm_mem_for_group(world.group_name)
assert symm.is_symm_mem_enabled_for_group(world.group_name)

# rendezvous with dist.group.WORLD, and with its group_name ("0" in PyTorch).
t = symm.empty(16, dtype=torch.float32)
hdl = symm.rendezvous(t, world)
assert hdl.world_size == ws and hdl.rank == rank and hdl.multicast_ptr == 0
t.fill_(rank + 1)
symm.all_reduce(t, "sum", world.group_name)
assert torch.equal(t, torch.full((16,), ws * (ws + 1) / 2)), t
out = symm.one_shot_all_reduce(t, "sum", world.group_name)
assert out[0].item() == ws * ws * (ws + 1) / 2

# PyTorch's positional reduce_scatter_out(input, group_name, split_last_dim, output).
rs = symm.empty(ws * 4, dtype=torch.float32)
rs.fill_(1.0)
piece = torch.empty(4)
symm.reduce_scatter_out(rs, world.group_name, False, piece)
assert torch.equal(piece, torch.full((4,), float(ws))), piece

# get_signal_pad(peer, sizes, dtype), as PyTorch's handle takes it.
pad = hdl.get_signal_pad((rank + 1) % ws, [4], dtype=torch.int32)
assert pad.shape == (4,) and pad.dtype == torch.int32
hdl.barrier(channel=0)

# Negative ranks, channels and offsets: PyTorch's errors, not OverflowError.
for bad in (lambda: hdl.get_buffer(-1, [4], torch.float32), lambda: hdl.put_signal(ws)):
    try:
        bad()
        raise AssertionError("accepted")
    except ValueError as e:
        assert "rank must be in [0," in str(e), e
for bad in (lambda: hdl.barrier(channel=-1), lambda: hdl.get_buffer(0, [4], torch.float32, storage_offset=-4)):
    try:
        bad()
        raise AssertionError("accepted")
    except ValueError as e:
        assert "non-negative" in str(e), e

# A zero-element tensor: operators return, as PyTorch's do.
z = symm.empty(0, dtype=torch.float32)
assert symm.all_reduce(z, "sum", world) is z
assert symm.one_shot_all_reduce(z, "sum", world).numel() == 0

# A PyTorch sub-group (new_group is collective in PyTorch: every rank calls it).
evens = dist.new_group([r for r in range(ws) if r % 2 == 0])
if rank % 2 == 0:
    s = symm.empty(8, dtype=torch.int64)
    s.fill_(rank)
    sh = symm.rendezvous(s, evens)
    symm.all_reduce(s, "sum", evens.group_name)
    want = sum(r for r in range(ws) if r % 2 == 0)
    assert sh.world_size == len(range(0, ws, 2)) and torch.equal(s, torch.full((8,), want)), s

# The memory pool and the workspace.
p = symm.get_mem_pool("cpu").empty(32, dtype=torch.float32)
assert symm.is_symm_mem_tensor(p)
w = symm.get_symm_mem_workspace(world.group_name, 1024)
assert w.buffer_size >= 1024 and symm.get_symm_mem_workspace(world.group_name, 512) is w

dist.barrier()
print(f"pytorch style ok {rank}", flush=True)
dist.destroy_process_group()
