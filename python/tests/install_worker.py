"""After symmem.symm.install(), torch.distributed._symmetric_memory's own functions run on CPU
tensors (issue 52, item 1): every one of its functions that dispatches on the backend or reads
the handle is symmem's, with torch's signature, and the handle has the attributes torch's code
reads. Run under torchrun (gloo); prints "install worker ok RANK" at the end, or each failed
section and exits 1."""

import inspect
import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import symmem.symm

# torch's own functions, before the switch: those that dispatch on the backend
# (`get_backend(`) or call torch's C++ handle class (`_SymmetricMemory`).
dispatching = {}
for name in dir(symm_mem):
    f = getattr(symm_mem, name)
    if name.startswith("_") or not inspect.isfunction(f) or f.__module__ != symm_mem.__name__:
        continue
    source = inspect.getsource(f)
    if "_SymmetricMemory" in source or "get_backend(" in source:
        dispatching[name] = f
symmem.symm.install()

dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
group_name = dist.group.WORLD.group_name
from sections import failed, section  # noqa: E402


@section("every dispatching function of torch's module is symmem's")
def _():
    # A sanity check of the selection itself: the functions issue 52 names are in it.
    assert {"get", "put_signal", "wait_signal", "reduce_scatter_offset", "all_to_all_nd"} <= set(dispatching)
    kept = sorted(n for n, f in dispatching.items() if getattr(symm_mem, n) is f)
    assert not kept, f"still torch's own after install(): {kept}"


@section("the handle has torch's device")
def _():
    t = symm_mem.empty(16, device="cpu")
    hdl = symm_mem.rendezvous(t, group_name)
    assert hdl.device == torch.device("cpu") == t.device, hdl.device


@section("get, as torch's tests call it")
def _():
    numel = 64
    src = symm_mem.empty(2 * numel, dtype=torch.float32, device="cpu")
    src.copy_(torch.arange(2 * numel, dtype=torch.float32) + rank * 2 * numel)
    hdl = symm_mem.rendezvous(src, group=group_name)
    dist.barrier()
    peer = (rank + 1) % ws
    dst = torch.empty(numel)
    symm_mem.get(dst, hdl, peer=peer, offset=numel // 2)
    want = torch.arange(numel // 2, numel // 2 + numel, dtype=torch.float32) + peer * 2 * numel
    torch.testing.assert_close(dst, want)
    larger = torch.full((numel + 1,), -1.0)
    symm_mem.get(larger[:numel], hdl, peer)
    torch.testing.assert_close(larger[:numel], torch.arange(numel, dtype=torch.float32) + peer * 2 * numel)
    assert larger[numel].item() == -1.0
    dist.barrier()


@section("put_signal and wait_signal at module level")
def _():
    src = symm_mem.empty(32, device="cpu").fill_(float(rank))
    dst = symm_mem.empty(32, device="cpu").fill_(-1.0)
    symm_mem.rendezvous(src, group=group_name)
    hdl = symm_mem.rendezvous(dst, group=group_name)
    # Pairs as torch's test_put_wait_signal: odd ranks send to the even rank before them.
    if rank % 2 == 1:
        symm_mem.put_signal(src, hdl, rank - 1)
    elif rank + 1 < ws:
        symm_mem.wait_signal(hdl, rank + 1)
        torch.testing.assert_close(dst, torch.full_like(dst, float(rank + 1)))


@section("reduce_scatter_offset with torch's keyword-only dim")
def _():
    rows, cols = 4, 3
    buf = symm_mem.empty(rows, ws * cols, device="cpu")
    for i in range(ws):
        buf[:, i * cols : (i + 1) * cols] = float((rank + 1) * (i + 1))
    symm_mem.rendezvous(buf, group=group_name)
    out = [torch.zeros(rows, cols)]
    offsets = [i * cols for i in range(1, ws + 1)]
    symm_mem.reduce_scatter_offset(buf, out, group_name, dim=1, offsets=offsets, dst_ranks=list(range(ws)))
    want = float(rank + 1) * sum(r + 1 for r in range(ws))
    torch.testing.assert_close(out[0], torch.full((rows, cols), want))


@section("all_to_all_nd with torch's keyword-only group")
def _():
    rows, local_cols = 2, 3
    buf = symm_mem.empty(rows, ws * local_cols, device="cpu").fill_(float(rank))
    symm_mem.rendezvous(buf, group=group_name)
    out = torch.empty(ws, rows, local_cols)
    symm_mem.all_to_all_nd(buf, out, scatter_dim=1, gather_dim=0, group=group_name)
    for j in range(ws):
        torch.testing.assert_close(out[j], torch.full((rows, local_cols), float(j)))


if failed:
    print(f"install worker FAILED {rank}: {failed}", flush=True)
    sys.exit(1)
print(f"install worker ok {rank}", flush=True)
dist.destroy_process_group()
