"""Any timeout, no panic (issue 51, item 3). A finite but huge timeout (1e19 s, 1e22 ms) made
the native module panic ("overflow when adding duration to instant"), which reached Python as
PyO3's PanicException: a BaseException, which `except Exception` does not catch, and the rank
that raised it left its group out of step. Such a timeout now means "no deadline", and NaN,
infinite and negative ones raise ValueError naming the argument (test_panics.py: a panic
raises RuntimeError)."""

import datetime
import os
import subprocess
import sys

import numpy as np
import pytest

import symmem

HUGE = [1e19, 1e22, 1e300]
BAD = [float("nan"), float("inf"), -1.0]


def pair(backend):
    a, b = symmem.new_transport(backend), symmem.new_transport(backend)
    ua, ub = a.bind(timeout=1e19), b.bind(timeout=1e19)
    a.connect(ub, timeout=1e19)
    b.connect(ua, timeout=1e19)
    return a, b


@pytest.mark.parametrize("backend", ["tcp", "shm", "auto"])
def test_huge_transfer_timeouts_mean_no_deadline(backend):
    a, b = pair(backend)
    n = 70_000  # past the small-copy path that runs holding the GIL
    src, dst, back = np.arange(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    ms, md, mb = a.register_memory(src), b.register_memory(dst), a.register_memory(back)
    remote = md.to_remote_buffer()
    for t in HUGE:
        dst[:] = 0
        a.write(ms.to_view(), remote, timeout=t)
        assert (dst == src).all()
        a.read(mb.to_mutable_view(), remote, timeout=t)
        assert (back == src).all()
        assert a.write(ms.to_view(), remote, async_op=True, timeout=t).wait(t)
        assert a.read(mb.to_mutable_view(), remote, async_op=True, timeout=t).wait(t)
    for bad in BAD:
        with pytest.raises(ValueError, match="timeout"):
            a.write(ms.to_view(), remote, timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            a.write(ms.to_view(), remote, async_op=True, timeout=10).wait(bad)
    # Still in step: an ordinary timeout works after them.
    dst[:] = 0
    a.write(ms.to_view(), remote, timeout=10)
    assert (dst == src).all()
    a.close(timeout=1e19)
    b.close(timeout=1e19)


@pytest.mark.parametrize("engine", ["tcp", "shm"])
def test_huge_timeouts_through_pytorchs_transport_api(engine):
    import torch
    from torch.distributed._transport import new_transport

    a, b = (new_transport("symmem", "cpu", engine=engine, timeout=1e19) for _ in range(2))
    ua, ub = a.bind(timeout=1e19), b.bind(timeout=1e19)
    a.connect(ub, timeout=1e19)
    b.connect(ua, timeout=1e19)
    src, dst = torch.arange(20_000, dtype=torch.float32), torch.zeros(20_000, dtype=torch.float32)
    ms, md = a.register_memory(src, timeout=1e19), b.register_memory(dst, timeout=1e19)
    remote = type(md.to_remote_buffer()).deserialize(md.to_remote_buffer(timeout=1e19).serialize())
    a.write(ms.to_view(), remote, timeout=1e19)
    assert torch.equal(dst, src)
    work = a.read(ms.to_mutable_view(), remote, async_op=True, timeout=1e19)
    assert work.wait(1e19) in (None, True)
    assert work.wait(datetime.timedelta.max) in (None, True)
    a.write(ms.to_view(), remote)  # the transport's default, 1e19 s
    a.close(timeout=1e19)
    b.close(timeout=1e19)


def test_huge_timeouts_across_two_ranks_keep_them_in_step():
    worker = os.path.join(os.path.dirname(__file__), "timeouts_worker.py")
    env = dict(os.environ, SYMMEM_OP_TIMEOUT="1e22", SYMMEM_STORE_TIMEOUT="1e19")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", worker]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(2):
        assert f"timeouts worker ok {r}" in out.stdout, out.stdout + out.stderr
