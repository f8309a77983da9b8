"""One rank of the two-machine torchrun test: a symmetric all-reduce across both."""
import torch, torch.distributed as dist
from symmem import symm
g = symm.world()
x = symm.empty(1024, dtype=torch.float32)
x.fill_(g.rank + 1)
symm.all_reduce(x, "sum")
print("rank", g.rank, "of", g.world_size, "sum", float(x[0]), flush=True)
