"""PyTorch's exception types from symmem's symmetric memory (issue 52, item 2), as
PyTorch's SymmMemNegativeTest and test_get assert them: RuntimeError for a timeout of barrier,
put_signal or wait_signal, for a channel past the pad and for a rank out of range; ValueError
for get's bad arguments (a negative offset included, not OverflowError). symmem's own types stay
true too: a timeout is a TimeoutError, an invalid argument a ValueError. The process stays
usable after each. Run under torchrun (gloo) on 2 ranks; prints "errors worker ok RANK" at the
end, or each failed section and exits 1."""

import re
import sys

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

import symmem.symm

symmem.symm.install()
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
assert ws == 2, "the errors worker runs on two ranks"
peer = 1 - rank
t = symm_mem.empty(64, device="cpu")
hdl = symm_mem.rendezvous(t, dist.group.WORLD)
from sections import failed, section  # noqa: E402


def raises(types, pattern, call):
    """`call()` raises an instance of every type in `types`, with `pattern` in its message."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - checked below
        missing = [t.__name__ for t in types if not isinstance(e, t)]
        assert not missing, f"{type(e).__mro__} is not {missing}: {e}"
        assert re.search(pattern, str(e)), f"{pattern!r} not in {e}"
        return
    raise AssertionError(f"no {types} raised")


@section("a barrier's timeout is a RuntimeError (and a TimeoutError)")
def _():
    if rank == 0:
        # Rank 1 never enters: rank 0's signal lands, rank 1's never comes.
        raises((RuntimeError, TimeoutError), "barrier", lambda: hdl.barrier(channel=1, timeout_ms=300))


@section("the pad is clean again")
def _():
    if rank == 1:
        hdl.wait_signal(src_rank=0, channel=1)  # consumes rank 0's signal of its timed-out barrier


@section("put_signal's timeout is a RuntimeError (and a TimeoutError)")
def _():
    if rank == 0:
        # Rank 1 does not wait: the first signal stays, the second cannot land.
        hdl.put_signal(dst_rank=1, channel=2)
        raises((RuntimeError, TimeoutError), "", lambda: hdl.put_signal(dst_rank=1, channel=2, timeout_ms=300))


@section("the second pad is clean again")
def _():
    if rank == 1:
        hdl.wait_signal(src_rank=0, channel=2)


@section("wait_signal's timeout is a RuntimeError (and a TimeoutError)")
def _():
    if rank == 0:
        raises((RuntimeError, TimeoutError), "", lambda: hdl.wait_signal(src_rank=1, channel=3, timeout_ms=300))


@section("a channel past the pad is a RuntimeError (and a ValueError)")
def _():
    max_channel = hdl.signal_pad_size // 4 // ws
    for call in (
        lambda: hdl.barrier(channel=max_channel),
        lambda: hdl.put_signal(dst_rank=peer, channel=max_channel),
        lambda: hdl.wait_signal(src_rank=peer, channel=max_channel),
    ):
        raises((RuntimeError, ValueError), "maximum supported channel", call)
    raises((RuntimeError, ValueError), "non-negative", lambda: hdl.barrier(channel=-1))
    # The last channel works.
    hdl.put_signal(dst_rank=peer, channel=max_channel - 1)
    hdl.wait_signal(src_rank=peer, channel=max_channel - 1)


@section("a rank out of range is a RuntimeError (and a ValueError)")
def _():
    for bad in (-1, ws):
        raises((RuntimeError, ValueError), r"must be in \[0", lambda: hdl.put_signal(dst_rank=bad))
        raises((RuntimeError, ValueError), r"must be in \[0", lambda: hdl.wait_signal(src_rank=bad))
        raises((RuntimeError, ValueError), r"must be in \[0", lambda: hdl.get_signal_pad(bad))
        raises((RuntimeError, ValueError), r"must be in \[0", lambda: hdl.get_buffer(bad, (4,), torch.float32))


@section("get's bad arguments are ValueErrors, as torch's test_get asserts")
def _():
    dst = torch.empty(8)
    raises((ValueError,), "non-negative", lambda: symm_mem.get(dst, hdl, peer=peer, offset=-1))
    raises((ValueError,), "invalid peer", lambda: symm_mem.get(dst, hdl, peer=ws))
    raises((ValueError,), "invalid peer", lambda: symm_mem.get(dst, hdl, peer=-1))
    raises((ValueError,), "contiguous", lambda: symm_mem.get(torch.empty(16)[::2], hdl, peer=peer))
    end = hdl.buffer_size // 4
    raises((ValueError,), "exceeds", lambda: symm_mem.get(torch.empty(1), hdl, peer=peer, offset=end))


@section("still usable: a barrier and a get")
def _():
    t.fill_(float(rank))
    hdl.barrier(channel=0, timeout_ms=60_000)
    got = torch.empty(64)
    symm_mem.get(got, hdl, peer)
    assert torch.equal(got, torch.full((64,), float(peer))), got
    hdl.barrier(channel=0, timeout_ms=60_000)


if failed:
    print(f"errors worker FAILED {rank}: {failed}", flush=True)
    sys.exit(1)
print(f"errors worker ok {rank}", flush=True)
dist.destroy_process_group()
