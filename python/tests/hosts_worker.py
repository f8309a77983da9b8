"""One rank of the two-host test: run by two torchrun launchers (one per played host, with
SYMMEM_HOST_ID naming it). Ranks on the other host are reached through symmem's transport."""

import os

import torch
from symmem import symm

g = symm.world()
rank, ws = g.rank, g.world_size
per_host = int(os.environ["LOCAL_WORLD_SIZE"])
host = rank // per_host
nxt, prev = (rank + 1) % ws, (rank - 1) % ws

x = symm.empty(256, dtype=torch.int64)
x.copy_(torch.arange(256) + 1000 * rank)
hdl = symm.rendezvous(x)
remote = [r for r in range(ws) if r // per_host != host]
assert hdl.remote_ranks == remote, (hdl.remote_ranks, remote)
assert hdl.local_ranks == [r for r in range(ws) if r // per_host == host]
try:
    hdl.buffer_ptrs
    raise AssertionError("buffer_ptrs must refuse a group that spans hosts")
except ValueError as e:
    assert "cannot be addressed" in str(e), e
hdl.barrier()

# One-sided reads from the next rank, wherever it is.
part = torch.empty(8, dtype=torch.int64)
symm.nvshmem_get_out(part, hdl, 10, 8, nxt)
assert torch.equal(part, torch.arange(10, 18) + 1000 * nxt), part
hdl.barrier()

# Put with signal around the ring, odd ranks first, then even ones (a tensor is never read
# and overwritten at once).
for parity in (1, 0):
    data = symm.empty(1024, dtype=torch.float32)
    sig = symm.empty(1, dtype=torch.int64)
    symm.rendezvous(data)
    symm.rendezvous(sig)
    data.fill_(float(rank))
    hdl.barrier()
    if rank % 2 == parity:
        symm.nvshmem_put_with_signal(data, sig, 7, nxt)
    elif prev % 2 == parity:
        symm.nvshmem_wait_for_signal(sig, 7, prev)
        assert torch.all(data == float(prev)), data[:4]
    hdl.barrier()

# A view of a signal pad as the signal (PyTorch's test_nvshmem_put passes one), to the next
# rank wherever it is: the word lands in the peer's pad, after the data. Channel 8's first
# word, which no barrier here uses.
data = symm.empty(1024, dtype=torch.float32)
dh = symm.rendezvous(data)
word = dh.get_signal_pad(rank)[8 * ws : 8 * ws + 1]
for parity in (1, 0):
    data.fill_(float(rank))
    hdl.barrier()
    if rank % 2 == parity:
        symm.nvshmem_put_with_signal(data, word, 3 + parity, nxt)
    elif prev % 2 == parity:
        symm.nvshmem_wait_for_signal(word, 3 + parity, prev)
        assert torch.all(data == float(prev)), data[:4]
        word.fill_(0)
    hdl.barrier()

# Operators give the single-host results.
y = symm.empty(3000, dtype=torch.float32)
y.copy_(torch.arange(3000, dtype=torch.float32) * (rank + 1))
symm.all_reduce(y, "sum")
assert torch.equal(y, torch.arange(3000, dtype=torch.float32) * sum(range(1, ws + 1)))
print(f"hosts worker ok {rank}", flush=True)
