"""CPU kernels for the rest of torch.ops.symm_mem (issue 52, item 7), called as PyTorch's own
tests call them: _low_contention_all_gather and _low_contention_reduce_scatter on symmetric and
ordinary inputs (SymmetricMemoryTest), nccl_put_with_signal, nccl_wait_for_signal, nccl_put
and nccl_get (NCCLSymmetricMemoryTest.test_nccl_symmem_put and _get). Run under torchrun
(gloo); prints "kernels worker ok RANK", or each failed section and exits 1."""

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


@section("_low_contention_all_gather, symmetric and ordinary input")
def _():
    for symm_mem_input in (True, False):
        if symm_mem_input:
            t = symm_mem.empty(64, 64, dtype=torch.float32, device="cpu").fill_(rank)
        else:
            t = torch.full((64, 64), rank, dtype=torch.float32)
        res = torch.ops.symm_mem._low_contention_all_gather(t, group_name)
        res = torch.ops._c10d_functional.wait_tensor(res)
        assert res.shape == (64 * ws, 64), res.shape
        for r, chunk in enumerate(res.chunk(ws)):
            assert chunk.eq(r).all(), (symm_mem_input, r)


@section("_low_contention_reduce_scatter, sum and avg, symmetric and ordinary input")
def _():
    for reduce_op in ("sum", "avg"):
        for symm_mem_input in (True, False):
            if symm_mem_input:
                t = symm_mem.empty(64, 64, dtype=torch.float32, device="cpu")
            else:
                t = torch.empty((64, 64), dtype=torch.float32)
            for r, chunk in enumerate(t.chunk(ws)):
                chunk.fill_(r)
            res = torch.ops.symm_mem._low_contention_reduce_scatter(t, reduce_op, group_name)
            res = torch.ops._c10d_functional.wait_tensor(res)
            assert res.shape == (64 // ws, 64), res.shape
            expect = rank * ws if reduce_op == "sum" else rank
            assert res.eq(expect).all(), (reduce_op, symm_mem_input, res[0, :4])
    try:
        torch.ops.symm_mem._low_contention_reduce_scatter(torch.zeros(ws, 4), "max", group_name)
        raise AssertionError("max accepted")
    except ValueError as e:
        assert "not supported" in str(e), e


@section("nccl_put_with_signal, nccl_wait_for_signal and nccl_put, as test_nccl_symmem_put")
def _():
    numel = 1024
    tensor = symm_mem.empty(numel, dtype=torch.float, device="cpu").fill_(rank)
    symm_mem.rendezvous(tensor, group=group_name)
    signal_val = 5
    dist.barrier()
    if rank == 1:
        torch.ops.symm_mem.nccl_put_with_signal(tensor, signal_val, 0)
    elif rank == 0:
        torch.ops.symm_mem.nccl_wait_for_signal(tensor, signal_val)
        torch.testing.assert_close(tensor, torch.ones(numel))
    dist.barrier()
    if rank == 1:
        tensor *= 2
        torch.ops.symm_mem.nccl_put(tensor, 0)
    dist.barrier()
    if rank == 0:
        torch.testing.assert_close(tensor, torch.ones(numel) * 2)


@section("nccl_get, as test_nccl_symmem_get")
def _():
    numel = 1024
    tensor = symm_mem.empty(numel, dtype=torch.float, device="cpu").fill_(rank)
    symm_mem.rendezvous(tensor, group=group_name)
    dist.barrier()
    if rank == 0:
        torch.ops.symm_mem.nccl_get(tensor, 1)
        torch.testing.assert_close(tensor, torch.ones(numel))


@section("nccl_wait_for_signal waits for at least the value")
def _():
    tensor = symm_mem.empty(16, dtype=torch.int64, device="cpu").fill_(rank)
    hdl = symm_mem.rendezvous(tensor, group=group_name)
    dist.barrier()
    if rank == 1:
        torch.ops.symm_mem.nccl_put_with_signal(tensor, 9, 0)
    elif rank == 0:
        torch.ops.symm_mem.nccl_wait_for_signal(tensor, 7)  # 9 >= 7
        assert tensor.eq(1).all() and hdl.get_signal_pad(0, dtype=torch.int64)[0].item() == 9
        hdl.get_signal_pad(0).fill_(0)  # the pad is zero again after use, as PyTorch asks
    dist.barrier()


if failed:
    print(f"kernels worker FAILED {rank}: {failed}", flush=True)
    sys.exit(1)
print(f"kernels worker ok {rank}", flush=True)
dist.destroy_process_group()
