"""A PyTorch rank that pairs with a Rust rank through one store, with PyTorch's own
new_transport_rank and the symmem backend, then exchanges tensors with it.
Usage: python transport_rank.py STORE_PORT"""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed._transport import new_transport_rank

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=30))
t = new_transport_rank("symmem", "cpu", store=store, peer_rank=1, rank=0, bootstrap_timeout=30.0)
src = torch.arange(1024, dtype=torch.float32)
inbox = torch.zeros(1024, dtype=torch.float32)
ms, mi = t.register_memory(src), t.register_memory(inbox)
store.set("py_src", ms.to_remote_buffer().serialize())
store.set("py_inbox", mi.to_remote_buffer().serialize())
store.wait(["rust_done"])
assert torch.equal(inbox, src * 2), inbox[:8]
print(f"PY OK via {t._t.describe()}", flush=True)
store.set("py_done", "1")
t.close()
