"""Every torch.ops.symm_mem operator symmem has a CPU kernel for, called as PyTorch code calls
it (PyTorch's schema, positional, a group name from torch.distributed), after
symmem.symm.install(); each result checked. Run with torchrun."""

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import symmem.symm

symmem.symm.install()
from symmem._torch_ops import _kernels  # noqa: E402 - the list of registered kernels

dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
g = dist.group.WORLD.group_name
ops = torch.ops.symm_mem
called = set()


def use(name):
    called.add(name)
    return getattr(ops, name)


def sym(*shape, dtype=torch.float32, fill=None):
    t = symm_mem.empty(*shape, dtype=dtype, device="cpu")
    symm_mem.rendezvous(t, dist.group.WORLD)
    if fill is not None:
        t.fill_(fill)
    return t


tri = ws * (ws + 1) / 2  # 1 + 2 + ... + ws
x = sym(64, fill=rank + 1)
assert torch.equal(use("one_shot_all_reduce")(x, "sum", g), torch.full((64,), tri))
out = torch.empty(64)
assert use("one_shot_all_reduce_out")(x, "max", g, out) is out and torch.equal(out, torch.full((64,), float(ws)))
buf = sym(128)
local = torch.full((8, 4), float(rank))
r = use("one_shot_all_reduce_copy")(buf, local, "sum", g)
assert r.shape == (8, 4) and torch.equal(r, torch.full((8, 4), ws * (ws - 1) / 2))
out = torch.empty(8, 4)
use("one_shot_all_reduce_copy_out")(buf, local, "sum", g, out)
assert torch.equal(out, torch.full((8, 4), ws * (ws - 1) / 2))
y = sym(ws * 32, fill=rank + 1)
assert use("two_shot_all_reduce_")(y, "sum", g) is y and torch.equal(y, torch.full((ws * 32,), tri))
y.fill_(rank + 1)
out = torch.empty(ws * 32)
use("two_shot_all_reduce_out")(y, "sum", g, out)
assert torch.equal(out, torch.full((ws * 32,), tri))
y.fill_(1.0)
piece = torch.empty(32)
use("reduce_scatter_out")(y, g, False, piece)
assert torch.equal(piece, torch.full((32,), float(ws)))
b = sym(16, fill=float(rank))
use("nvshmem_broadcast")(b, ws - 1, g)
assert torch.equal(b, torch.full((16,), float(ws - 1)))
a = sym(ws * 2, dtype=torch.int64)
a.copy_(torch.arange(ws * 2) + 100 * rank)
a_out = torch.empty(ws * 2, dtype=torch.int64)
use("nvshmem_all_to_all")(a, a_out, g)
assert a_out.tolist() == [100 * j + 2 * rank + k for j in range(ws) for k in range(2)], a_out
# all_to_all_vdev: one row of 3 to every peer.
inp = sym(ws, 3, fill=float(rank))
splits = sym(ws, dtype=torch.int64, fill=1)
vout = sym(ws, 3)
so = sym(2, ws, dtype=torch.int64)
use("all_to_all_vdev")(inp, vout, splits, so, g)
assert so[0].tolist() == [1] * ws and torch.equal(vout[:, 0], torch.arange(ws, dtype=torch.float32))
# all_to_all_vdev_2d and its offset inverse: two experts, a row to each of every rank.
ne = 2
inp2 = sym(ws * ne, 2)
inp2.copy_(torch.arange(ws * ne * 2, dtype=torch.float32).view(ws * ne, 2) + 1000 * rank)
sp2 = sym(ws * ne, dtype=torch.int64, fill=1)
mid = sym(ws * ne * 4, 2)
mid_so = sym(2, ws * ne, dtype=torch.int64)
use("all_to_all_vdev_2d")(inp2, mid, sp2, mid_so, g, 4)
back = sym(ws * ne, 2)
back_so = sym(2, ws * ne, dtype=torch.int64)
use("all_to_all_vdev_2d_offset")(mid, back, mid_so, back_so, g)
assert torch.equal(back, inp2) and back_so[0].tolist() == [1] * (ws * ne)
# Tiles.
full = sym(4, 4, fill=float(rank + 1))
tile = torch.zeros(2, 2)
use("tile_reduce")(full[2:4, 2:4], tile, 0, g, "sum")
assert torch.equal(tile, torch.full((2, 2), tri if rank == 0 else 0.0))
tiles = [full[0:2, 0:2] for _ in range(ws)]
mout = torch.zeros(2, 2)
use("multi_root_tile_reduce")(tiles, mout, list(range(ws)), g, "sum")
assert torch.equal(mout, torch.full((2, 2), tri))
# reduce_scatter_offset (NCCL's name): ws equal row blocks, round-robin.
rso = sym(ws * 2, 3, fill=1.0)
rout = [torch.empty(2, 3)]
use("nccl_reduce_scatter_offset")(rso, rout, g, 0)
assert torch.equal(rout[0], torch.full((2, 3), float(ws)))
# all_to_all_nd (NCCL's name): scatter columns, gather rows.
nd_in = sym(1, ws * 2)
nd_in.copy_(torch.arange(ws * 2, dtype=torch.float32).view(1, ws * 2) + 100 * rank)
nd_out = torch.empty(ws, 1, 2)
use("nccl_all_to_all_nd")(nd_in, nd_out, 1, 0, g)
assert nd_out[:, 0, 0].tolist() == [100 * j + 2 * rank for j in range(ws)], nd_out
# One-sided: nvshmem get, put and put with signal, one direction at a time (a ring of gets
# would overwrite each rank's tensor while its neighbour reads it).
s = sym(8, fill=float(rank))
dist.barrier()
if rank == 0:
    use("nvshmem_get")(s, 1)
    assert torch.equal(s, torch.full((8,), 1.0)), s
dist.barrier()
if rank == 1:
    s.fill_(5.0)
    use("nvshmem_put")(s, 0)
dist.barrier()
if rank == 0:
    assert torch.equal(s, torch.full((8,), 5.0)), s
sig = sym(1, dtype=torch.int64, fill=0)
pay = sym(4, fill=float(rank))
dist.barrier()
if rank == 1:
    use("nvshmem_put_with_signal")(pay, sig, 7, 0)
if rank == 0:
    use("nvshmem_wait_for_signal")(sig, 7, 1)
    assert torch.equal(pay, torch.full((4,), 1.0)), pay
called.update({"nvshmem_get", "nvshmem_put", "nvshmem_put_with_signal", "nvshmem_wait_for_signal"})
dist.barrier()
# NCCL's names: the same puts and gets, and its signal in the first 8 bytes of the pad.
n = sym(8, fill=float(rank))
dist.barrier()
if rank == 1:
    use("nccl_put_with_signal")(n, 3, 0)
if rank == 0:
    use("nccl_wait_for_signal")(n, 3)
    assert torch.equal(n, torch.full((8,), 1.0)), n
    symm_mem.rendezvous(n, dist.group.WORLD).get_signal_pad(0).fill_(0)
    n.fill_(0.0)
    use("nccl_get")(n, 1)
    assert torch.equal(n, torch.full((8,), 1.0)), n
dist.barrier()
if rank == 1:
    n.fill_(6.0)
    use("nccl_put")(n, 0)
dist.barrier()
if rank == 0:
    assert torch.equal(n, torch.full((8,), 6.0)), n
called.update({"nccl_put_with_signal", "nccl_wait_for_signal", "nccl_get", "nccl_put"})
dist.barrier()
# The low-contention collectives, on ordinary tensors.
lc = use("_low_contention_all_gather")(torch.full((2, 3), float(rank)), g)
assert lc.shape == (2 * ws, 3) and torch.equal(lc[::2, 0], torch.arange(ws, dtype=torch.float32)), lc
lr = use("_low_contention_reduce_scatter")(torch.ones(ws * 2, 4), "avg", g)
assert lr.shape == (2, 4) and torch.equal(lr, torch.ones(2, 4)), lr
# Remote tensors, and the fused matmuls.
rt = sym(4, fill=float(rank))
dist.barrier()  # every rank's fill lands before anyone reads
remotes = use("get_remote_tensors")(rt, g)
assert [t[0].item() for t in remotes] == [float(r) for r in range(ws)], remotes
shard = sym(2, 3, fill=float(rank + 1))
B = torch.ones(3, 5)
A, outs = use("fused_all_gather_matmul")(shard, [B], 0, g, return_A=True)
assert A.shape == (2 * ws, 3) and torch.equal(outs[0], A @ B)
mm = use("fused_matmul_reduce_scatter")(torch.ones(ws * 2, 3), torch.ones(3, 4), "sum", 0, g)
assert mm.shape == (2, 4) and torch.equal(mm, torch.full((2, 4), 3.0 * ws))
# The stream writes, on a symmetric flag array and an ordinary one.
flags = sym(8, dtype=torch.uint32, fill=0)
assert use("memset32_")(flags, 2, 7, 3) is flags and flags.tolist() == [0, 0, 7, 7, 7, 0, 0, 0], flags
plain = torch.zeros(4, dtype=torch.uint32)
assert use("stream_write_value32_")(plain, 3, 9) is plain and plain.tolist() == [0, 0, 0, 9], plain

missing = set(_kernels(symmem.symm)) - called
assert not missing, f"kernels never called here: {sorted(missing)}"
dist.barrier()
print(f"torch ops ok {rank}", flush=True)
dist.destroy_process_group()
