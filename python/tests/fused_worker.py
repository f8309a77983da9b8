"""torch.ops.symm_mem.fused_all_gather_matmul on an ordinary A_shard (issue 52, item 3), as
PyTorch's AsyncTPTest.test_fused_all_gather_matmul calls it (torch.rand shards, gather_dim 0,
1 and 2 of [BATCH, M, K]) and on 2-D shards: PyTorch copies the shard into symmetric memory
itself, and so must symmem. Every result is checked against A = cat(every rank's shard) @ B,
built here from the shards' known contents, with the fallback's strides. Run under torchrun
(gloo); prints "fused worker ok RANK"."""

import torch
import torch.distributed as dist

import symmem.symm

symmem.symm.install()
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
group_name = dist.group.WORLD.group_name


def shard_of(r, shape):
    """Rank r's shard: known on every rank, so the expected result needs no collective."""
    g = torch.Generator().manual_seed(42 + r)
    return torch.rand(shape, generator=g)


Bs = [torch.rand(32, 16, generator=torch.Generator().manual_seed(7 + i)) for i in range(3)]

# 3-D, as PyTorch's test: [BATCH, M, K] = [8, 64, 32], gather_dim divided by the world size.
for gather_dim in (0, 1, 2):
    shape = [8, 64, 32]
    shape[gather_dim] //= ws
    A_shard = shard_of(rank, shape)  # an ordinary tensor
    Bs_here = Bs if gather_dim != 2 else [torch.rand(32, 16, generator=torch.Generator().manual_seed(9))]
    A, outs = torch.ops.symm_mem.fused_all_gather_matmul(A_shard, Bs_here, gather_dim=gather_dim, group_name=group_name)
    shards = [shard_of(r, shape) for r in range(ws)]
    want_A = torch.cat(shards, dim=gather_dim)
    torch.testing.assert_close(A, want_A)
    for B, out in zip(Bs_here, outs):
        torch.testing.assert_close(out, want_A @ B)
    if gather_dim != 2:
        # The fallback's layout: gathered along dim 0, then the gather dim moved back.
        ref = torch.cat(shards).view(ws, *shape).movedim(gather_dim + 1, 1).flatten(0, 1)
        assert A.stride() == ref.movedim(0, gather_dim).stride(), (gather_dim, A.stride())

# 2-D shards (symmem's pipelined kernel), gathered along rows and along columns; one
# non-contiguous (a transposed view) and one without return_A.
for gather_dim, transposed, return_A in ((0, False, True), (1, True, True), (0, True, False)):
    shape = (4, 6) if gather_dim == 0 else (6, 4)
    base = shard_of(rank, shape[::-1] if transposed else shape)
    A_shard = base.t() if transposed else base
    k = A_shard.shape[1] * (ws if gather_dim == 1 else 1)
    B = torch.rand(k, 5, generator=torch.Generator().manual_seed(11))
    A, outs = torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [B], gather_dim, group_name, return_A=return_A)
    shards = [shard_of(r, shape[::-1] if transposed else shape) for r in range(ws)]
    want_A = torch.cat([s.t() if transposed else s for s in shards], dim=gather_dim)
    assert (A is None) == (not return_A)
    if return_A:
        torch.testing.assert_close(A, want_A)
    torch.testing.assert_close(outs[0], want_A @ B)
    assert torch.equal(A_shard, base.t() if transposed else base), "the caller's shard was changed"

dist.barrier()
print(f"fused worker ok {rank}", flush=True)
dist.destroy_process_group()
