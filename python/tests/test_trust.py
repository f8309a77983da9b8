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


TARGET = """
import sys, time, numpy as np, symmem
t = symmem.new_transport("tcp", flows=1)
url = t.bind()
dst = np.zeros(64 << 20, dtype=np.uint8)
m = t.register_memory(dst)
sys.stdout.write(url.decode() + "\\n" + m.to_remote_buffer().serialize().decode() + "\\n")
sys.stdout.flush()
time.sleep(120)
"""


def test_a_write_into_a_stopped_peer_returns_in_time_without_holding_the_gil():
    # Item 6: once a stopped peer's socket buffers filled, write(..., timeout=2) blocked its
    # caller for 30 s holding the GIL, and the transport stayed "not connected".
    import signal
    import threading
    import time

    import numpy as np

    import symmem

    target = subprocess.Popen([sys.executable, "-c", TARGET], stdout=subprocess.PIPE, text=True)
    try:
        url, desc = target.stdout.readline().strip(), target.stdout.readline().strip()
        t = symmem.new_transport("tcp", flows=1)
        t.connect(url.encode())
        remote = symmem.RemoteBuffer.deserialize(desc.encode()).slice(0, 16 << 20)
        src = np.full(16 << 20, 5, dtype=np.uint8)
        view = t.register_memory(src).to_view()
        t.write(view, remote, timeout=20)
        os.kill(target.pid, signal.SIGSTOP)
        ticks = []
        stop = threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.01)

        ticker = threading.Thread(target=tick)
        ticker.start()
        stuck = None
        for _ in range(8):
            start = time.monotonic()
            work = t.write(view, remote, async_op=True, timeout=2)
            assert time.monotonic() - start < 0.5, "submitting waited for the stopped peer"
            try:
                work.wait()
            except TimeoutError:
                stuck = work
            took = time.monotonic() - start
            assert took < 3, f"a write with a 2 s timeout took {took:.1f} s"
            if stuck:
                break
        stop.set()
        ticker.join()
        assert stuck is not None, "writes to a stopped peer must time out once its buffers are full"
        # The GIL was free while the writes waited: the other thread kept ticking.
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(gaps) < 0.5, f"another Python thread was held up for {max(gaps):.1f} s"
        assert t.connected()
        os.kill(target.pid, signal.SIGCONT)
        stuck.wait(20)
        t.write(view, remote, timeout=20)
        t.close()
    finally:
        target.kill()
        target.wait()
