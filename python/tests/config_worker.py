"""Configuration as PyTorch's (issue 52, item 6): set_signal_pad_size after an allocation
applies to later allocations and torch's own getter (`_SymmetricMemory.signal_pad_size`)
reflects it, as PyTorch's test_set_signal_pad_size(_with_allocation) check; ranks that disagree
on an allocation's pad get a clear error, not a hang; is_symm_mem_enabled_for_group answers for
the groups this process has and False for unknown names. Run under torchrun (gloo) on 2 ranks;
prints "config worker ok RANK", or each failed section and exits 1."""

import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch._C._distributed_c10d import _SymmetricMemory

import symmem.symm

symmem.symm.install()
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
from sections import failed, section  # noqa: E402


first = symm_mem.empty(64, device="cpu")
first_hdl = symm_mem.rendezvous(first, dist.group.WORLD)
original = symm_mem.get_signal_pad_size()


@section("set_signal_pad_size after an allocation, as PyTorch's test_set_signal_pad_size")
def _():
    assert isinstance(original, int) and original > 0 and _SymmetricMemory.signal_pad_size == original
    new_size = 1024 * 1024
    symm_mem.set_signal_pad_size(new_size)
    assert symm_mem.get_signal_pad_size() == new_size
    assert _SymmetricMemory.signal_pad_size == new_size, _SymmetricMemory.signal_pad_size
    symm_mem.set_signal_pad_size(original)
    assert symm_mem.get_signal_pad_size() == original and _SymmetricMemory.signal_pad_size == original


@section("later allocations use the new size, as PyTorch's test_set_signal_pad_size_with_allocation")
def _():
    custom = original * 2
    symm_mem.set_signal_pad_size(custom)
    try:
        t = symm_mem.empty(64, device="cpu")
        hdl = symm_mem.rendezvous(t, group=dist.group.WORLD)
        assert hdl.signal_pad_size == custom, hdl.signal_pad_size
        pad = hdl.get_signal_pad(rank)
        assert pad.numel() == custom // 4
        pad.fill_(0)
        pad[0] = 42
        assert pad[0].item() == 42
        pad.fill_(0)
        # Every rank is done writing its own pad before any peer signals into it: a peer's
        # barrier signal landing before this rank's fill_ would be wiped out, and this rank
        # would wait for it until the timeout.
        dist.barrier()
        # The earlier allocation keeps its pad; both synchronize.
        assert first_hdl.signal_pad_size == original
        hdl.barrier(channel=custom // 4 // ws - 1)
        first_hdl.barrier(channel=original // 4 // ws - 1)
    finally:
        symm_mem.set_signal_pad_size(original)


@section("ranks that disagree on a pad get an error naming it, on every rank")
def _():
    symm_mem.set_signal_pad_size(original * 2 if rank == 0 else original)
    try:
        t = symm_mem.empty(64, device="cpu")
        try:
            symm_mem.rendezvous(t, group=dist.group.WORLD)
            raise AssertionError("a rendezvous of pads of different sizes was accepted")
        except RuntimeError as e:
            assert "pad" in str(e), e
    finally:
        symm_mem.set_signal_pad_size(original)


@section("is_symm_mem_enabled_for_group")
def _():
    sub = dist.new_group([0])
    assert symm_mem.is_symm_mem_enabled_for_group(dist.group.WORLD.group_name)
    if rank == 0:
        assert symm_mem.is_symm_mem_enabled_for_group(sub.group_name)
    assert not symm_mem.is_symm_mem_enabled_for_group("no-such-group")
    assert not symmem.symm.is_symm_mem_enabled_for_group("no-such-group")


if failed:
    print(f"config worker FAILED {rank}: {failed}", flush=True)
    sys.exit(1)
print(f"config worker ok {rank}", flush=True)
dist.destroy_process_group()
