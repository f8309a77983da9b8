"""The signal pad as PyTorch has it (issue 52, item 4): get_signal_pad returns uint32 words by
default (PyTorch's test_get_signal_pad), and the tensor it returns is a signal for
nvshmem_put_with_signal and nvshmem_wait_for_signal (PyTorch's test_nvshmem_put passes
`hdl.get_signal_pad(rank)`). Run under torchrun (gloo) on 2 ranks or more; prints "signal pad
worker ok RANK", or each failed section and exits 1."""

import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import symmem.symm

symmem.symm.install()
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
group_name = dist.group.WORLD.group_name
from sections import failed, section  # noqa: E402


@section("get_signal_pad's dtypes and sizes, as PyTorch's test_get_signal_pad")
def _():
    t = symm_mem.empty(1, device="cpu")
    hdl = symm_mem.rendezvous(t, group=dist.group.WORLD)
    peer = (rank + 1) % ws
    pad = hdl.get_signal_pad(rank)
    assert pad.data_ptr() == hdl.signal_pad_ptrs[hdl.rank]
    pad = hdl.get_signal_pad(peer)
    assert pad.dtype == torch.uint32 and pad.numel() == hdl.signal_pad_size // 4, (pad.dtype, pad.numel())
    pad = hdl.get_signal_pad(peer, (8, 8))
    assert pad.dtype == torch.uint32 and pad.numel() == 64
    pad = hdl.get_signal_pad(peer, dtype=torch.uint64)
    assert pad.dtype == torch.uint64 and pad.numel() == hdl.signal_pad_size // 8
    pad = hdl.get_signal_pad(peer, (8, 8), dtype=torch.uint64)
    assert pad.dtype == torch.uint64 and pad.numel() == 64
    # Writes to the buffer leave the pad alone.
    mine = hdl.get_signal_pad(rank)
    mine.fill_(42)
    t.fill_(0)
    assert mine.eq(42).all()
    mine.fill_(0)


@section("get_signal_pad's tensor is nvshmem_put_with_signal's signal, as PyTorch's test_nvshmem_put")
def _():
    numel = 1024
    tensor = symm_mem.empty(numel, dtype=torch.float, device="cpu").fill_(rank)
    hdl = symm_mem.rendezvous(tensor, group=group_name)
    signal_pad = hdl.get_signal_pad(rank)
    signal_val = 5
    if rank == 0:
        torch.ops.symm_mem.nvshmem_put_with_signal(tensor, signal_pad, signal_val, 1)
    elif rank == 1:
        torch.ops.symm_mem.nvshmem_wait_for_signal(signal_pad, signal_val, 0)
        torch.testing.assert_close(tensor, torch.zeros(numel))
        assert signal_pad[0].item() == signal_val
    dist.barrier()
    signal_pad.fill_(0)  # PyTorch's contract: the pad is zero again after use


@section("a view of a pad names its own word, on every rank")
def _():
    tensor = symm_mem.empty(16, device="cpu").fill_(rank)
    hdl = symm_mem.rendezvous(tensor, group=group_name)
    word = hdl.get_signal_pad(rank)[6:8].view(torch.int64)  # bytes 24..32, as one int64
    if rank == 0:
        symmem.symm.nvshmem_put_with_signal(tensor, word, 1 << 40, 1)
    elif rank == 1:
        symmem.symm.nvshmem_wait_for_signal(word, 1 << 40, 0)
        torch.testing.assert_close(tensor, torch.zeros(16))
        pad = hdl.get_signal_pad(rank)
        assert pad[7].item() == 1 << 8 and pad[6].item() == 0 and pad.view(torch.int32).count_nonzero() == 1, pad[:8]
    dist.barrier()
    hdl.get_signal_pad(rank).fill_(0)


@section("a tensor that is neither is refused, naming both")
def _():
    try:
        symmem.symm.nvshmem_wait_for_signal(torch.zeros(2, dtype=torch.int64), 1, 0)
        raise AssertionError("accepted")
    except ValueError as e:
        assert "get_signal_pad" in str(e) and "symmetric" in str(e), e


if failed:
    print(f"signal pad worker FAILED {rank}: {failed}", flush=True)
    sys.exit(1)
print(f"signal pad worker ok {rank}", flush=True)
dist.destroy_process_group()
