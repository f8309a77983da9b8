"""One rank of the huge-timeout tests (issue 51, item 3); run under torchrun on two ranks with
SYMMEM_OP_TIMEOUT and SYMMEM_STORE_TIMEOUT huge. Every wait given a finite but huge timeout
(1e19 s, past what Rust's Instant holds) waits as if it had none, or is refused with a
ValueError naming the argument, and never raises PanicException; a panic raises RuntimeError;
after each, the ranks are still in step. Prints "timeouts worker ok RANK"."""

import os

import torch

import symmem
from symmem import _native, symm

g = symm.world()
rank, ws = g.rank, g.world_size
assert ws == 2, "the timeouts worker runs on two ranks"
other = 1 - rank
assert float(os.environ["SYMMEM_OP_TIMEOUT"]) >= 1e19 and float(os.environ["SYMMEM_STORE_TIMEOUT"]) >= 1e19
BAD = [float("nan"), float("inf"), -1.0]


def refused(call, name):
    """`call(bad)` raises ValueError naming `name` for every bad timeout, before any waiting."""
    for bad in BAD:
        try:
            call(bad)
        except ValueError as e:
            assert name in str(e), e
        else:
            raise AssertionError(f"{name}={bad} was accepted")


# The group's barrier (through the store, whose own timeout is huge too).
for t in (1e19, 1e22, 1e300):
    g.barrier(timeout=t)
    symm.barrier(timeout=t)
refused(lambda t: g.barrier(timeout=t), "timeout")
g.barrier(timeout=60)

# The handle's barrier and signals (milliseconds), and the module's signals (the op timeout).
x = symm.empty(64, dtype=torch.float32)
h = symm.rendezvous(x)
for channel, ms in enumerate((1e22, 1e25, 1e303)):
    h.barrier(channel=channel, timeout_ms=ms)
    h.put_signal(other, channel=channel, timeout_ms=ms)
    h.wait_signal(other, channel=channel, timeout_ms=ms)
for call in (
    lambda ms: h.barrier(channel=5, timeout_ms=ms),
    lambda ms: h.put_signal(other, channel=5, timeout_ms=ms),
    lambda ms: h.wait_signal(other, channel=5, timeout_ms=ms),
):
    refused(call, "timeout")
h.barrier(channel=0, timeout_ms=60_000)
symm.put_signal(torch.full((64,), rank + 1.0), h, other)
symm.wait_signal(h, other)
assert torch.all(x == other + 1.0), x[:4]
h.barrier(timeout_ms=60_000)
# An operator, whose every wait is bounded by the (huge) op timeout.
x.fill_(rank + 1.0)
out = symm.one_shot_all_reduce(x, "sum")
assert torch.all(out == 3.0), out[:4]

# A transport paired through the store.
t = symmem.new_transport_rank("auto", peer_rank=other, bootstrap_timeout=1e19)
assert t.connected()
refused(lambda s: symmem.new_transport_rank("auto", peer_rank=other, bootstrap_timeout=s), "bootstrap_timeout")
t.close(timeout=1e19)

# A panic (a bug) raises RuntimeError, an Exception; the group stays in step.
for released in (False, True):
    try:
        _native._panic_for_test(released)
        raise AssertionError("_panic_for_test returned")
    except RuntimeError as e:
        assert "internal error" in str(e) and "_panic_for_test" in str(e), e
g.barrier(timeout=60)
h.barrier(channel=1, timeout_ms=60_000)

symm.barrier(timeout=120)
print(f"timeouts worker ok {rank}", flush=True)
