"""Per-call cost of symmem's all-reduce from Python: `symm.all_reduce` (what programs call) next
to the native call with the group and tensor already looked up, so the wrapper's share shows.

    symmem run -n 2 -- python bench/python_allreduce.py [sizes, e.g. 8,4K,1M]

Prints rank 0's medians of 7 runs, in microseconds per call. (DeepSpeed's CPU shared-memory
op, the issue's reference, is not installed by this script: see the closing notes.)
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


def main():
    sizes = sys.argv[1] if len(sys.argv) > 1 else "8,4K,64K,1M"
    units = {"K": 1 << 10, "M": 1 << 20}
    rank = int(os.environ.get("RANK", "0"))
    for s in sizes.split(","):
        nbytes = int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)
        t = symm.empty(max(nbytes // 4, 1), dtype=torch.float32)
        n = max(200, min(20000, (64 << 20) // max(nbytes, 1)))
        wrapped = per_call_us(lambda: symm.all_reduce(t), n)
        native_t, group = symm._native_tensor(t, symmetric=True), symm._group(None)
        native = per_call_us(lambda: _native.all_reduce(native_t, "sum", group), n)
        if rank == 0:
            print(f"{nbytes:>10} B  symm.all_reduce {wrapped:9.2f} us  native call {native:9.2f} us", flush=True)


if __name__ == "__main__":
    main()
