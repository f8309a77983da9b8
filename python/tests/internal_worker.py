"""torch's internal entry points on the CPU (issue 52, item 7): after symmem.symm.install(),
`_SymmetricMemory.empty_strided_p2p` (with its group name and its persistent `alloc_id`),
`_SymmetricMemory.rendezvous`, `is_symm_mem_tensor`, `get_backend` and the stream writes
(`memset32`, `stream_write_value32`, `torch.ops.symm_mem.memset32_`/`stream_write_value32_`)
run on symmem for CPU tensors with PyTorch's checks and messages, and any other device still
gets torch's own. Run under torchrun (gloo) on 2 or more ranks; prints "internal worker ok
RANK", or each failed section and exits 1."""

import gc
import random
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch._C._distributed_c10d import _SymmetricMemory as S

import symmem.symm

symmem.symm.install()
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
group = dist.group.WORLD.group_name
cpu = torch.device("cpu")
from sections import failed, section  # noqa: E402


def raises(call, kind, *fragments):
    try:
        call()
    except kind as e:
        for f in fragments:
            assert f in str(e), (f, str(e))
        return
    raise AssertionError(f"expected {kind.__name__} with {fragments}")


@section("empty_strided_p2p and rendezvous take the allocation's group name")
def _():
    t = S.empty_strided_p2p((8, 4), (4, 1), torch.float32, cpu, group_name=group)
    assert t.shape == (8, 4) and t.stride() == (4, 1) and t.dtype == torch.float32 and t.device == cpu
    assert S.is_symm_mem_tensor(t) and symm_mem.is_symm_mem_tensor(t)
    assert not S.is_symm_mem_tensor(torch.empty(4))
    t.fill_(rank + 1)
    hdl = S.rendezvous(t)  # no group: the one given at allocation
    assert hdl.world_size == ws and hdl.rank == rank
    del t  # the handle keeps the allocation
    hdl.barrier()
    for peer in range(ws):
        assert hdl.get_buffer(peer, (32,), torch.float32).eq(peer + 1).all(), peer
    hdl.barrier()


@section("a strided allocation has the memory its strides reach")
def _():
    t = S.empty_strided_p2p((3, 2), (1, 3), torch.float64, cpu, group)
    assert t.stride() == (1, 3) and S.is_symm_mem_tensor(t)
    t.copy_(torch.arange(6, dtype=torch.float64).view(3, 2))
    assert t.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


@section("rendezvous of memory outside symmetric memory is None, as in PyTorch")
def _():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert S.rendezvous(torch.empty(16), group) is None
    assert any("Pointer not within any SymmetricMemory allocation" in str(w.message) for w in seen), seen


@section("a persistent allocation gets its memory back once its tensors are gone")
def _():
    alloc_id = 1000 + random.randint(0, 1 << 30)
    args = ((16, 16), (16, 1), torch.float32, cpu)
    t = S.empty_strided_p2p(*args, group_name=group, alloc_id=alloc_id)
    ptr = t.data_ptr()
    t.fill_(7)
    raises(lambda: S.empty_strided_p2p(*args, group_name=group, alloc_id=alloc_id), RuntimeError, "still active")
    view = t[3:]
    del t
    gc.collect()
    raises(lambda: S.empty_strided_p2p(*args, alloc_id=alloc_id), RuntimeError, "still active")
    del view
    raises(
        lambda: S.empty_strided_p2p((4,), (1,), torch.float32, cpu, alloc_id=alloc_id),
        RuntimeError,
        "requested allocation size (16)",
        "same alloc_id (1024)",
    )
    again = S.empty_strided_p2p((256,), (1,), torch.int32, cpu, group_name=group, alloc_id=alloc_id)
    assert again.data_ptr() == ptr and again.dtype == torch.int32
    assert again.view(torch.float32).eq(7).all(), "the same memory, as it was left"
    again.fill_(rank)
    hdl = S.rendezvous(again)
    hdl.barrier()
    for peer in range(ws):
        assert hdl.get_buffer(peer, (256,), torch.int32).eq(peer).all(), peer
    hdl.barrier()
    # A different id is a different allocation.
    other = S.empty_strided_p2p(*args, alloc_id=alloc_id + 1)
    assert other.data_ptr() != ptr


@section("other devices keep torch's own entry points")
def _():
    raises(lambda: S.empty_strided_p2p((4,), (1,), torch.float32, torch.device("meta")), RuntimeError, "meta")
    assert S.get_backend(cpu) == "CPU" and S.get_backend(torch.device("meta")) is None
    raises(lambda: S.get_mempool_allocator(cpu), NotImplementedError, "get_mem_pool")


@section("stream_write_value32 and memset32 with PyTorch's checks and messages")
def _():
    flags = torch.zeros(4, dtype=torch.uint32)  # not symmetric: PyTorch's allow any tensor
    for i in range(4):
        assert S.stream_write_value32(flags, i, 1) is not None
        assert flags.tolist() == [1] * (i + 1) + [0] * (3 - i), flags
    assert torch.ops.symm_mem.stream_write_value32_(flags, 0, 4294967295) is flags and flags[0] == 4294967295
    raises(lambda: S.stream_write_value32(flags, offset=-1, val=1), RuntimeError, "offset must be greater than or equal to 0")
    raises(lambda: S.stream_write_value32(flags, offset=0, val=4294967296), RuntimeError, "(uint32_t)")
    raises(lambda: S.stream_write_value32(flags, offset=4, val=1), RuntimeError, "offset (4) exceeded the numel of the input (4)")
    raises(lambda: S.stream_write_value32(flags.view(2, 2), 0, 1), RuntimeError, "flat, contiguous uint32 tensor")

    t = S.empty_strided_p2p((64,), (1,), torch.uint32, cpu, group).fill_(0)
    S.memset32(t, offset=32, val=5, count=16)
    assert t[:32].eq(0).all() and t[32:48].eq(5).all() and t[48:].eq(0).all()
    assert torch.ops.symm_mem.memset32_(t, 0, 9, 1) is t and t[0] == 9 and t[1] == 0
    S.memset32(t, offset=63, val=1)  # count defaults to 1
    assert t[63] == 1 and t[62] == 0
    for bad, message in (
        (lambda: S.memset32(t.view(8, 8), offset=0, val=1, count=1), "flat, contiguous uint32 tensor"),
        (lambda: S.memset32(t.view(torch.float32), offset=0, val=1, count=1), "flat, contiguous uint32 tensor"),
        (lambda: S.memset32(t[::2], offset=0, val=1, count=1), "flat, contiguous uint32 tensor"),
        (lambda: S.memset32(t, offset=-1, val=1, count=1), "offset must be greater than or equal to 0"),
        (lambda: S.memset32(t, offset=0, val=-1, count=1), "val must be in the range of"),
        (lambda: S.memset32(t, offset=0, val=1, count=0), "count must be a positive integer"),
        (lambda: S.memset32(t, offset=0, val=1, count=-1), "count must be a positive integer"),
        (lambda: S.memset32(t, offset=64, val=1, count=1), "offset + count (65) exceeded the numel of the input (64)"),
        (lambda: S.memset32(t, offset=1, val=1, count=1 << 62), "exceeded the numel of the input (64)"),
    ):
        before = t.clone()
        raises(bad, RuntimeError, message)
        assert torch.equal(t, before), "a refused call writes nothing"


@section("a stream write is a signal: the data written before it is there when a peer sees it")
def _():
    data = S.empty_strided_p2p((1024,), (1,), torch.float32, cpu, group)
    flag = S.empty_strided_p2p((ws,), (1,), torch.uint32, cpu, group).fill_(0)
    hdl, flag_hdl = S.rendezvous(data), S.rendezvous(flag)
    flag_hdl.barrier()
    peer = (rank + 1) % ws
    for step in range(1, 51):
        # Write the peer's data, then raise this rank's flag word in the peer's flag array.
        hdl.get_buffer(peer, (1024,), torch.float32).fill_(rank * 1000 + step)
        S.stream_write_value32(flag_hdl.get_buffer(peer, (ws,), torch.uint32), rank, step)
        src = (rank - 1) % ws
        deadline = time.monotonic() + 30
        while int(flag[src]) != step:
            assert time.monotonic() < deadline, f"rank {src}'s flag for step {step} never came"
        assert data.eq(src * 1000 + step).all(), (step, data[:4])
        flag_hdl.barrier()


dist.barrier()
if failed:
    print(f"internal worker FAILED {failed} (rank {rank})", flush=True)
    dist.destroy_process_group()
    sys.exit(1)
print(f"internal worker ok {rank}", flush=True)
dist.destroy_process_group()
