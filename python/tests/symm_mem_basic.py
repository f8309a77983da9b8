# PyTorch's symmetric-memory guide's symm_mem_basic.py template ("How to use it"), with the
# device set to the CPU and symmem's one switch added; nothing else changed. Run with torchrun.
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import symmem.symm  # the switch: symmem for CPU tensors

symmem.symm.install()

dist.init_process_group()
rank = dist.get_rank()
world_size = dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cpu")

# 1. Allocate a symmetric tensor: same call, same size, on every rank.
t = symm_mem.empty(4096, device=device)
t.fill_(float(rank + 1))   # deterministic, rank-distinguishable content, not garbage

# 2. Rendezvous: collective handshake exchanging peer buffer/multicast/signal-pad
#    pointers. Must happen in the same order on every rank in `group`.
hdl = symm_mem.rendezvous(t, dist.group.WORLD)

# 3a. A collective SymmMem op. Every rank in the group must call it.
reduced = torch.ops.symm_mem.one_shot_all_reduce(
    t, "sum", dist.group.WORLD.group_name)
expected = sum(range(1, world_size + 1))   # 1 + 2 + ... + world_size
assert torch.allclose(reduced, torch.full_like(reduced, float(expected))), \
    (reduced, expected)

# 3b. A basic one-sided read: hdl.get_remote_tensor is a method on the handle,
#     not a standalone symm_mem function. One-sided reads need explicit
#     readiness sync. Rank 1 signals once its buffer is safe to read; rank 0 waits for
#     that signal before reading.
if rank == 1 and world_size > 1:
    hdl.put_signal(dst_rank=0)   # this rank's t is ready; unblocks rank 0's wait below

if rank == 0 and world_size > 1:
    hdl.wait_signal(src_rank=1)   # blocks until rank 1's put_signal above
    dst = hdl.get_remote_tensor(peer=1, sizes=(512,), dtype=t.dtype)  # peer 1's t[0:512]
    assert torch.equal(dst, torch.full((512,), 2.0)), dst

hdl.barrier()  # (not in the guide) nobody unmaps while rank 0 still reads
print(f"symm_mem_basic ok {rank}", flush=True)
