"""Trust (issue 13) from Python: the worker checks each item across two ranks under torchrun;
these tests launch it and check each rank finished."""

import os
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(__file__), "trust_worker.py")


def test_offsets_and_default_timeouts_under_torchrun():
    env = dict(os.environ, SYMMEM_OP_TIMEOUT="2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", WORKER]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(2):
        assert f"trust worker ok {r}" in out.stdout, out.stdout + out.stderr
