"""Per-call cost of symmem's all-reduce from Python: `symm.all_reduce` (what programs call) next
to the native call with the group and tensor already looked up, so the wrapper's share shows,
and next to DeepSpeed's CPU shared-memory all-reduce (`torch.ops.deepspeed.inference_all_reduce_`,
the fastest all-reduce PyTorch programs use on CPUs) in the same processes, when DeepSpeed is
importable.

    symmem run -n 2 -- python bench/python_allreduce.py [sizes, e.g. 8,4K,1M,16M]

DeepSpeed builds its op on first use (`pip install deepspeed`; it needs a C++ compiler and
ninja, and picks its CPU accelerator by itself when there is no GPU; DS_ACCELERATOR=cpu forces
it). Its fp32 kernel needs AVX2. It joins through torch.distributed (gloo) on the job's store, as
`deepspeed.init_distributed` does, and takes its all-ranks-local test from LOCAL_SIZE, which this
script sets from LOCAL_WORLD_SIZE.

Also next to torch.distributed's own all_reduce on the gloo backend (PyTorch's CPU collectives,
joined on the job's store), the baseline every PyTorch CPU program has.

Prints rank 0's medians of 7 runs, in microseconds per call, sum, of DTYPE (float32 unless set:
bfloat16 or float16); and checks that every call gave the right sum before timing it.

    DTYPE=bfloat16 symmem run -n 2 -- python bench/python_allreduce.py 64K,1M,16M
"""

import os
import statistics
import sys
import time

import torch

from symmem import _native, symm


def per_call_us(f, n):
    for _ in range(max(n // 10, 10)):
        f()
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            f()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def deepspeed_op(world):
    """DeepSpeed's shared-memory all-reduce, or None (with the reason printed) when unusable."""
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    try:
        import deepspeed  # noqa: PLC0415 (optional, heavy)

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        op = torch.ops.deepspeed.inference_all_reduce_
    except Exception as e:  # noqa: BLE001 (any reason to skip is printed)
        print(f"DeepSpeed's op is not usable here ({type(e).__name__}: {e}); symmem only", flush=True)
        return None
    return op


def gloo_group():
    """torch.distributed on gloo (joined on the job's store unless DeepSpeed already did)."""
    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


def checked(f, t, world):
    """Runs `f` once on a tensor of ones and checks the sum, so a broken path is not timed."""
    t.fill_(1.0)
    f()
    if not bool((t == float(world)).all()):
        raise SystemExit(f"wrong all-reduce result: expected {world}, got {t[:4].tolist()}")


def main():
    sizes = sys.argv[1] if len(sys.argv) > 1 else "8,4K,64K,1M,16M"
    units = {"K": 1 << 10, "M": 1 << 20}
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dtype = getattr(torch, os.environ.get("DTYPE", "float32"))
    ds = deepspeed_op(world)
    dist = gloo_group()
    if rank == 0:
        head = f"{'bytes':>10}  {'symm.all_reduce':>15}  {'native call':>11}  {'gloo':>9}  {'gloo/symm':>9}"
        print(head + (f"  {'DeepSpeed op':>12}  {'symm / DS':>9}" if ds else "") + f"   (us per call, {dtype})", flush=True)
    for s in sizes.split(","):
        nbytes = int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)
        n = max(50, min(20000, (64 << 20) // max(nbytes, 1)))
        numel = max(nbytes // dtype.itemsize, 1)
        t = symm.empty(numel, dtype=dtype)
        checked(lambda: symm.all_reduce(t), t, world)
        wrapped = per_call_us(lambda: symm.all_reduce(t), n)
        native_t, group = symm._native_tensor(t, symmetric=True), symm._group(None)
        checked(lambda: _native.all_reduce(native_t, "sum", group), t, world)
        native = per_call_us(lambda: _native.all_reduce(native_t, "sum", group), n)
        g = torch.empty(numel, dtype=dtype)
        checked(lambda: dist.all_reduce(g), g, world)
        gloo = per_call_us(lambda: dist.all_reduce(g), max(n // 10, 20))
        row = f"{nbytes:>10}  {wrapped:15.2f}  {native:11.2f}  {gloo:9.2f}  {gloo / wrapped:9.2f}"
        if ds:
            d = torch.empty(numel, dtype=dtype)
            checked(lambda: ds(d), d, world)
            theirs = per_call_us(lambda: ds(d), n)
            row += f"  {theirs:12.2f}  {wrapped / theirs:9.2f}"
        if rank == 0:
            print(row, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
