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

# Negative ranks, channels and offsets: PyTorch's errors (its C++ checks raise RuntimeError), not
# OverflowError; and symmem's own type for an invalid argument, ValueError (issue 52, item 2).
for bad in (lambda: hdl.get_buffer(-1, [4], torch.float32), lambda: hdl.put_signal(ws)):
    try:
        bad()
        raise AssertionError("accepted")
    except RuntimeError as e:
        assert isinstance(e, ValueError) and "rank must be in [0," in str(e), e
for bad in (lambda: hdl.barrier(channel=-1), lambda: hdl.get_buffer(0, [4], torch.float32, storage_offset=-4)):
    try:
        bad()
        raise AssertionError("accepted")
    except RuntimeError as e:
        assert isinstance(e, ValueError) and "non-negative" in str(e), e

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

# The fused matmuls on N-D A, as PyTorch's tests call them, against PyTorch's fallback computed
# here from every rank's (known) shard: the same values and the same strides.
def shard_of(r, shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) / 7 + r


shape = (2, 4, 3)
for gather_dim in (0, 1, 2):
    a_shard = symm.empty(*shape, dtype=torch.float32)
    a_shard.copy_(shard_of(rank, shape))
    B = torch.arange(3 * (ws if gather_dim == 2 else 1) * 5, dtype=torch.float32).view(-1, 5) / 11
    A, outs = symm.fused_all_gather_matmul(a_shard, [B], gather_dim, world.group_name, return_A=True)
    want_A = torch.cat([shard_of(r, shape) for r in range(ws)], dim=gather_dim)
    want = torch.matmul(want_A, B)
    assert torch.equal(A, want_A), (gather_dim, A.shape, want_A.shape)
    torch.testing.assert_close(outs[0], want)
    # What PyTorch's fallback gathers (`_c10d_functional.all_gather_into_tensor`: the shards
    # concatenated along dim 0), built here from the known shards rather than through gloo: a
    # gloo collective's work keeps its tensors until a later barrier's work is freed, on gloo's
    # thread, which can happen after the interpreter began to finalize; that thread then takes
    # the GIL to free a Python tensor and the process aborts ("terminate called without an
    # active exception", the thread pt_gloo_runloop in ~AsyncBarrierWork ->
    # ~AsyncAllgatherCoalescedWork -> decref_pyobject -> take_gil -> pthread_exit; PyTorch's,
    # pytorch/pytorch#179291), about one run in 15 here.
    fallback = torch.cat([shard_of(r, shape) for r in range(ws)], dim=0)
    assert outs[0].shape == want.shape, (outs[0].shape, want.shape)
    if gather_dim != 2:
        ref = torch.matmul(fallback.view(ws, *shape).movedim(gather_dim + 1, 1).flatten(0, 1), B).movedim(0, gather_dim)
        assert outs[0].stride() == ref.stride(), (gather_dim, outs[0].stride(), ref.stride())
for scatter_dim in (0, 1):
    A = shard_of(rank, (ws * 2, ws * 2, 3))
    B = torch.arange(15, dtype=torch.float32).view(3, 5) / 13
    got = symm.fused_matmul_reduce_scatter(A, B, "sum", scatter_dim, world.group_name)
    total = sum(torch.matmul(shard_of(r, (ws * 2, ws * 2, 3)), B) for r in range(ws))
    want = total.chunk(ws, dim=scatter_dim)[rank]
    torch.testing.assert_close(got, want)
    assert got.is_contiguous() and got.shape == want.shape

# Operators that need GPU hardware answer NotImplementedError (a RuntimeError) naming the need.
hw = symm.empty(16, dtype=torch.float32)
for call, need in (
    (lambda: symm.multimem_all_reduce_(hw, "sum", world.group_name), "multicast"),
    (lambda: symm.multimem_one_shot_all_reduce(hw, "sum", world.group_name), "multicast"),
    (lambda: symm.multimem_all_gather_out(hw, world.group_name, torch.empty(16 * ws)), "multicast"),
    (lambda: symm.multimem_one_shot_reduce_out(hw, "sum", 0, world.group_name, torch.empty(16)), "multicast"),
    (lambda: symm.memcpy_to_multicast_(hw, torch.ones(16), 0, world.group_name), "multicast"),
    (lambda: symm.fused_all_gather_scaled_matmul(hw, [], None, [], 0, world.group_name), "FP8"),
    (lambda: symm.fused_scaled_matmul_reduce_scatter(hw, hw, None, None, "sum", 0, 0, world.group_name), "FP8"),
):
    try:
        call()
        raise AssertionError("a GPU operator ran on the CPU")
    except NotImplementedError as e:
        assert need in str(e), e

dist.barrier()
print(f"pytorch style ok {rank}", flush=True)
dist.destroy_process_group()
