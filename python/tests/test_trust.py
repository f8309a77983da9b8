"""Trust (issue 13) from Python: the worker checks each item across two ranks under torchrun;
these tests launch it and check each rank finished."""

import os
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(__file__), "trust_worker.py")


def run_worker(part):
    env = dict(os.environ, SYMMEM_OP_TIMEOUT="2", TRUST_PART=part)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", WORKER]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(2):
        assert f"trust worker ok {r}" in out.stdout, out.stdout + out.stderr


def test_remote_tensors_of_a_view_address_the_peers_view():
    # Item 14: get_remote_tensor of rendezvous(y[256:]) returned the peer's y[:256].
    run_worker("offsets")


def test_handle_waits_without_a_timeout_honour_the_operator_timeout():
    # Item 13: the handle's barrier and signals waited 300 s whatever SYMMEM_OP_TIMEOUT said.
    run_worker("timeouts")


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
        small = t.register_memory(np.zeros(4096, dtype=np.uint8))
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

        def timed_out(submit):
            start = time.monotonic()
            work = submit()
            assert time.monotonic() - start < 0.5, "submitting waited for the stopped peer"
            try:
                work.wait()
                late = False
            except TimeoutError:
                late = True
            took = time.monotonic() - start
            assert took < 3, f"a transfer with a 2 s timeout took {took:.1f} s"
            return work if late else None

        # Large writes until the buffers are full and one times out.
        stuck = None
        for _ in range(8):
            stuck = timed_out(lambda: t.write(view, remote, async_op=True, timeout=2))
            if stuck:
                break
        assert stuck is not None, "writes to a stopped peer must time out once its buffers are full"
        # Small transfers, which the caller sends itself, return within their timeouts too.
        smalls = [
            timed_out(lambda: t.write(small.to_view(), remote, async_op=True, timeout=2)),
            timed_out(lambda: t.read(small.to_mutable_view(), remote, async_op=True, timeout=2)),
        ]
        assert all(smalls), "small transfers to a stopped peer with full buffers must time out"
        # The same through the synchronous call, which holds the GIL only for a copy it can
        # finish at once (shm's): here it waits with the GIL released and times out in time.
        start = time.monotonic()
        try:
            t.write(small.to_view(), remote, timeout=2)
            raise AssertionError("a synchronous write to a stopped peer with full buffers returned")
        except TimeoutError:
            pass
        took = time.monotonic() - start
        assert took < 3, f"a synchronous write with a 2 s timeout took {took:.1f} s"
        stop.set()
        ticker.join()
        # The GIL was free while the transfers waited: the other thread kept ticking.
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(gaps) < 0.5, f"another Python thread was held up for {max(gaps):.1f} s"
        assert t.connected(), "a peer that stopped reading for a moment is not lost"
        os.kill(target.pid, signal.SIGCONT)
        stuck.wait(20)
        for w in smalls:
            w.wait(20)
        t.write(view, remote, timeout=20)
        t.close()
    finally:
        target.kill()
        target.wait()
