"""One rank of the two-machine torchrun test: a symmetric all-reduce across both."""
import os

import torch
from symmem import symm

g = symm.world()
x = symm.empty(1024, dtype=torch.float32)
x.fill_(g.rank + 1)
symm.all_reduce(x, "sum")
# One write per line: the ranks of a machine share torchrun's stdout.
os.write(1, f"rank {g.rank} of {g.world_size} sum {float(x[0])}\n".encode())
