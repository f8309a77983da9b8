"""A recycled group name is a new group (issue 52, item 5), as PyTorch's
test_rendezvous_after_group_name_recycled has it: after destroy_process_group() and a new
init_process_group(), the first new_group() is named "1" again, with other ranks ([1, 2]
instead of [0, 1]); rank 1, a member of both, must rendezvous on the new one, not on what
symmem kept under the old name. Run under torchrun (gloo) on 3 ranks or more, with a short
SYMMEM_OP_TIMEOUT (a stale group makes the rendezvous wait for a rank that never comes);
prints "recycle worker ok RANK"."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import symmem.symm

symmem.symm.install()
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
assert ws >= 3, "the recycle worker needs 3 ranks or more"

sub = dist.new_group([0, 1])
if rank in (0, 1):
    t = symm_mem.empty(64, device="cpu")
    hdl = symm_mem.rendezvous(t, group=sub)
    assert (hdl.rank, hdl.world_size) == (rank, 2)
    old_name = sub.group_name
dist.barrier()
dist.destroy_process_group()

# A fresh store, as PyTorch's test: the old one holds the first incarnation's keys.
path = os.path.join(tempfile.gettempdir(), f"recycle-store-{os.environ['MASTER_PORT']}")
store = dist.FileStore(path, ws)
dist.init_process_group("gloo", store=store, rank=rank, world_size=ws)
sub2 = dist.new_group([1, 2])
if rank == 1:
    assert sub2.group_name == old_name, (sub2.group_name, old_name)  # the premise: the name came back
if rank in (1, 2):
    t2 = symm_mem.empty(64, device="cpu").fill_(float(rank))
    hdl2 = symm_mem.rendezvous(t2, group=sub2)
    assert (hdl2.rank, hdl2.world_size) == (rank - 1, 2), (hdl2.rank, hdl2.world_size)
    hdl2.barrier()
    peer = hdl2.get_buffer(1 - hdl2.rank, (64,), torch.float32)
    assert torch.equal(peer, torch.full((64,), float(3 - rank))), peer[:4]
    # The group's name resolves to the new group in symmem's operators too.
    out = torch.ops.symm_mem.one_shot_all_reduce(t2, "sum", sub2.group_name)
    assert torch.equal(out, torch.full((64,), 3.0)), out[:4]
    hdl2.barrier()
dist.barrier()
print(f"recycle worker ok {rank}", flush=True)
dist.destroy_process_group()
