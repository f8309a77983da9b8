"""torch.compile with the eager and aot_eager backends over symmem's kernels (issue 52: inductor's
lowering of these operators is CUDA-only upstream, but compiled programs must keep working on
CPU): each function below runs eagerly, then compiled with each backend, on symmetric inputs,
and the results must be equal. Run under torchrun (gloo); prints "compile worker ok RANK", or
each failure and exits 1."""

import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import symmem.symm

symmem.symm.install()
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
group_name = dist.group.WORLD.group_name
failed = []


def one_shot(x):
    return torch.ops.symm_mem.one_shot_all_reduce(x, "sum", group_name) * 2 + 1


def low_contention_gather(x):
    res = torch.ops.symm_mem._low_contention_all_gather(x, group_name)
    return torch.ops._c10d_functional.wait_tensor(res) * 3


def fused_ag_mm(a, b):
    ag, outs = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group_name)
    return ag, outs[0]


def inputs():
    torch.manual_seed(rank)
    x = symm_mem.empty(16, 32, dtype=torch.float32, device="cpu")
    x.copy_(torch.randn(16, 32))
    symm_mem.rendezvous(x, group_name)
    a = torch.randn(8, 32)
    torch.manual_seed(42)
    b = torch.randn(32, 16)
    return x, a, b


for name, fn, args in [
    ("one_shot_all_reduce", one_shot, lambda x, a, b: (x,)),
    ("_low_contention_all_gather", low_contention_gather, lambda x, a, b: (x,)),
    ("fused_all_gather_matmul", fused_ag_mm, lambda x, a, b: (a, b)),
]:
    for backend in ("eager", "aot_eager"):
        try:
            x, a, b = inputs()
            want = fn(*args(x, a, b))
            x, a, b = inputs()
            got = torch.compile(fn, backend=backend, fullgraph=False)(*args(x, a, b))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        except Exception:  # noqa: BLE001 - every failure is reported at the end
            failed.append(f"{name} with {backend}")
            print(f"FAILED {name} with {backend} (rank {rank}):\n{traceback.format_exc()}", flush=True)
        dist.barrier()

dist.destroy_process_group()
if failed:
    print(f"compile worker failed on rank {rank}: {failed}", flush=True)
    sys.exit(1)
print(f"compile worker ok {rank}", flush=True)
