"""One rank of the trust tests (issue 13); run under torchrun with TRUST_PART set to the item
to check ("offsets" or "timeouts"). Prints "trust worker ok RANK"."""

import os
import time

import torch
from symmem import symm

g = symm.world()
rank, ws = g.rank, g.world_size
assert ws == 2, "the trust worker runs on two ranks"
other = 1 - rank
part = os.environ["TRUST_PART"]

y = symm.empty(512, dtype=torch.float32)
h = symm.rendezvous(y[256:])
assert h.offset == 256 * 4, h.offset

if part == "offsets":
    # Item 14: a handle of a view at a nonzero offset addresses the peer's same view.
    remote = h.get_remote_tensor(other, [256], torch.float32)
    h.barrier()
    remote.fill_(rank + 1.0)
    h.barrier()
    assert torch.all(y[:256] == 0), "a peer's write meant for y[256:] landed in y[:256]"
    assert torch.all(y[256:] == other + 1.0), y[256:260]
    assert h.get_remote_tensor(other, [64], torch.float64).numel() == 64
    try:
        h.get_remote_tensor(other, [257], torch.float32)
        raise AssertionError("257 floats from offset 256 of 512 must be refused")
    except ValueError as e:
        assert "exceeds the allocated size" in str(e), e

if part == "timeouts":
    # Item 13: waits given no timeout honour SYMMEM_OP_TIMEOUT (2 s here), not 300 s.
    assert os.environ["SYMMEM_OP_TIMEOUT"] == "2"
    symm.barrier(timeout=60)
    if rank == 1:
        for what, call in [
            ("barrier", lambda: h.barrier(channel=2)),
            ("wait_signal", lambda: h.wait_signal(0, channel=3)),
            ("module wait_signal", lambda: symm.wait_signal(h, 0)),
        ]:
            start = time.monotonic()
            try:
                call()
                raise AssertionError(f"{what} with nobody answering must time out")
            except TimeoutError:
                pass
            took = time.monotonic() - start
            assert 1.5 < took < 15, f"{what} waited {took:.1f} s"

symm.barrier(timeout=120)
print(f"trust worker ok {rank}", flush=True)
