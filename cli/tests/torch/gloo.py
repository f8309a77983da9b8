"""A torch rank: init_process_group("gloo", env://) on the launcher's store, all_reduce, barrier."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
t = torch.tensor([float(rank + 1)] * 2)
dist.all_reduce(t)
dist.barrier()
print(f"rank {rank} all_reduce={t.tolist()}", flush=True)
dist.destroy_process_group()
