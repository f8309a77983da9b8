"""One rank of the two-process PyTorch transport test (run under torchrun): PyTorch's own
new_transport_rank with backend "symmem" pairs the ranks through torchrun's store, then rank 0
writes into and reads from rank 1's tensor, one-sided, as in the spec's example."""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed._transport import new_transport_rank

rank = int(os.environ["RANK"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
store.set_timeout(datetime.timedelta(seconds=60))
with new_transport_rank("symmem", "cpu", store=store, peer_rank=1 - rank, rank=rank, bootstrap_timeout=60.0) as t:
    if rank == 1:
        received = torch.zeros(1024, dtype=torch.float32)
        weights = torch.full((1024,), 7.0)
        descriptors = [t.register_memory(x).to_remote_buffer().serialize() for x in (received, weights)]
        store.set("descriptors", b"\n".join(descriptors))
        store.wait(["written"])
        assert torch.equal(received, torch.arange(1024, dtype=torch.float32)), received[:4]
    else:
        into, from_ = store.get("descriptors").split(b"\n")
        weights = torch.arange(1024, dtype=torch.float32)
        source = t.register_memory(weights)
        remote = type(source.to_remote_buffer()).deserialize(into)
        work = t.write(source.to_view(), remote, async_op=True)
        work.wait()
        back = torch.zeros(1024, dtype=torch.float32)
        t.read(t.register_memory(back).to_mutable_view(), type(remote).deserialize(from_))
        assert torch.equal(back, torch.full((1024,), 7.0)), back[:4]
        store.set("written", b"1")
    store.set(f"checked/{rank}", b"1")
    store.wait(["checked/0", "checked/1"])  # coordinate before closing either endpoint
assert type(t).__name__ == "SymmemTransport", type(t)
print(f"transport worker ok {rank}", flush=True)
