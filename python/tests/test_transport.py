"""The symmem Python package: its own transport API and the PyTorch backend."""

import asyncio
import datetime

import pytest
import symmem
import torch
from symmem.torch_backend import SymmemRemoteBuffer, SymmemTransport, SymmemWork
from torch.distributed._transport import available_transports, new_transport, wait_all


def pair(backend="auto"):
    a, b = symmem.new_transport(backend), symmem.new_transport(backend)
    ua, ub = a.bind(), b.bind()
    a.connect(ub)
    b.connect(ua)
    return a, b


def _have(backend):
    try:
        symmem.new_transport(backend).close()
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("backend", ["auto", "tcp", "shm", "ucx"])
def test_native_api_moves_torch_tensors_without_copies(backend):
    if not _have(backend):
        pytest.skip(f"the {backend} backend is unavailable here")
    a, b = pair(backend)
    src = torch.arange(1000, dtype=torch.float64)
    dst = torch.zeros(1000, dtype=torch.float64)
    ms, md = a.register_memory(src), b.register_memory(dst)
    remote = symmem.RemoteBuffer.deserialize(md.to_remote_buffer().serialize())
    a.write(ms.to_view(), remote)
    assert torch.equal(dst, src), "the registered tensor itself received the bytes"
    back = torch.zeros(10, dtype=torch.float64)
    mb = a.register_memory(back)
    work = a.read(mb.to_mutable_view(), remote.slice(80, 80), async_op=True)
    assert work.wait(5.0) and work.is_completed() and work.is_success()
    assert torch.equal(back, src[10:20])
    a.close()
    b.close()


def test_errors_map_to_python_exceptions():
    a, b = pair()
    src = torch.zeros(16, dtype=torch.uint8)
    ms = a.register_memory(src)
    ro = b.register_memory(torch.zeros(16, dtype=torch.uint8), read_only=True)
    with pytest.raises(ValueError, match="read-only"):
        a.write(ms.to_view(), ro.to_remote_buffer())
    with pytest.raises(ValueError, match="outside the registered memory"):
        ms.to_view(17)
    with pytest.raises(ValueError, match="malformed descriptor"):
        symmem.RemoteBuffer.deserialize(b"not json")
    with pytest.raises(ValueError, match="contiguous"):
        a.register_memory(torch.zeros(4, 4)[:, 1])


def test_pytorch_discovers_the_backend():
    assert "symmem" in available_transports()
    t = new_transport("symmem", "cpu")
    assert isinstance(t, SymmemTransport)
    t.close()


def test_the_spec_example_runs_unchanged():
    backend = "symmem"
    with (
        new_transport(backend, "cpu") as trainer,
        new_transport(backend, "cpu") as replica,
    ):
        trainer_url, replica_url = trainer.bind(), replica.bind()
        trainer.connect(replica_url)
        replica.connect(trainer_url)
        weights = torch.arange(8, dtype=torch.float32)
        received = torch.empty_like(weights)
        source = trainer.register_memory(weights)
        target = replica.register_memory(received)
        descriptor = target.to_remote_buffer()
        remote = type(descriptor).deserialize(descriptor.serialize())
        work = trainer.write(source.to_view(), remote, async_op=True)
        assert isinstance(work, torch.distributed.Work)
        work.wait()
        torch.testing.assert_close(received, weights)

    # The spec's asyncio part, verbatim, on a fresh pair.
    async def push_weights(trainer, source, remote):
        await trainer.write_async(source.to_view(), remote, timeout=30.0)
        # Coordinate with peers before cleanup; cancellation does not cancel DMA.
        await trainer.close_async(timeout=30.0)

    trainer, replica = new_transport(backend, "cpu"), new_transport(backend, "cpu")
    trainer.connect(replica.bind())
    replica.connect(trainer.bind())
    weights = torch.arange(8, dtype=torch.float32)
    received = torch.empty_like(weights)
    source = trainer.register_memory(weights)
    descriptor = replica.register_memory(received).to_remote_buffer()
    asyncio.run(push_weights(trainer, source, type(descriptor).deserialize(descriptor.serialize())))
    torch.testing.assert_close(received, weights)
    assert not trainer.connected()
    replica.close()


def test_torch_contract_details():
    trainer, replica = new_transport("symmem", "cpu"), new_transport("symmem", "cpu")
    trainer.connect(replica.bind())
    replica.connect(trainer.bind())
    with pytest.raises(RuntimeError, match="already connected"):
        trainer.connect(replica.bind())
    x = torch.arange(64, dtype=torch.int32)
    y = torch.zeros(64, dtype=torch.int32)
    mx, my = trainer.register_memory(x), replica.register_memory(y)
    remote = SymmemRemoteBuffer.deserialize(my.to_remote_buffer().serialize())
    assert remote == my.to_remote_buffer()
    with pytest.raises(TypeError, match="must be bytes"):
        SymmemRemoteBuffer.deserialize("not bytes")
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        trainer.register_memory([1, 2, 3])
    with pytest.raises(TypeError, match="not registered by this transport"):
        trainer.write(my.to_view(), remote)
    with pytest.raises(TypeError):
        trainer.read(mx.to_view(), remote)  # a read needs a mutable view
    # An empty view at the end is legal and completes.
    assert trainer.write(mx.to_view(256), remote) == 0
    # Work: timedelta(0) means the transfer's own timeout; futures resolve to [].
    work = trainer.write(mx.to_view(), remote, async_op=True)
    assert isinstance(work, SymmemWork)
    assert work.wait(datetime.timedelta(0))
    assert work.get_future().wait() == []
    assert work.exception() is None and work.is_success()

    async def go():
        await trainer.write_async(mx.to_view(0, 32), remote, timeout=10.0)
        works = [trainer.write(mx.to_view(), remote, async_op=True) for _ in range(8)]
        await wait_all(works, timeout=10.0)
        back = torch.zeros(64, dtype=torch.int32)
        await replica.read_async(replica.register_memory(back).to_mutable_view(), mx.to_remote_buffer())
        assert torch.equal(back, x)

    asyncio.run(go())
    assert torch.equal(y, x)
    # A stale descriptor fails its Work with the peer's reason.
    replica.unregister_memory(my)
    with pytest.raises(symmem.errors.RefusedError, match="unknown remote buffer"):
        trainer.write(mx.to_view(), remote)
    trainer.close()
    replica.close()


class DLPackOnly:
    """Something that exposes its memory through DLPack only (as JAX or CuPy arrays do)."""

    def __init__(self, tensor):
        self._t = tensor

    def __dlpack__(self, **kwargs):
        return self._t.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


def test_native_api_accepts_dlpack_and_serves_asyncio_callers():
    a, b = pair()
    backing = torch.zeros(64, dtype=torch.int32)
    src = torch.arange(64, dtype=torch.int32)
    ms, md = a.register_memory(src), b.register_memory(DLPackOnly(backing))
    assert md.to_remote_buffer().nbytes() == 256
    remote = md.to_remote_buffer()

    async def go():
        await a.write_async(ms.to_view(), remote, timeout=10.0)
        assert torch.equal(backing, src), "the DLPack exporter's own memory received the bytes"
        works = [a.write(ms.to_view(4 * i, 4), remote.slice(4 * i, 4), async_op=True) for i in range(8)]
        await symmem.wait_all(works, timeout=10.0)
        back = torch.zeros(64, dtype=torch.int32)
        await a.read_async(a.register_memory(back).to_mutable_view(), remote, timeout=10.0)
        assert torch.equal(back, src)
        await a.close_async(timeout=10.0)
        await b.close_async(timeout=10.0)

    asyncio.run(go())
    with pytest.raises(TypeError, match="__dlpack__"):
        symmem.new_transport().register_memory(object())


def test_new_transport_rank_pairs_through_a_torch_tcpstore():
    import threading

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = {}

    def rank(r):
        try:
            results[r] = symmem.new_transport_rank("auto", store=store, peer_rank=1 - r, rank=r, bootstrap_timeout=30)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    a, b = results[0], results[1]
    assert isinstance(a, symmem.Transport) and isinstance(b, symmem.Transport), results
    assert a.connected() and b.connected()
    src, dst = torch.arange(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    a.write(a.register_memory(src).to_view(), b.register_memory(dst).to_remote_buffer())
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="peer_rank"):
        symmem.new_transport_rank(store=store, peer_rank=0, rank=0)
    with pytest.raises(TypeError, match="TCPStore"):
        symmem.new_transport_rank(store=42, peer_rank=1, rank=0)
    a.close()
    b.close()


PEER = """
import sys, time, numpy as np, symmem
t = symmem.new_transport("tcp", flows=1)
url = t.bind()
m = t.register_memory(np.zeros(4096, dtype=np.uint8))
sys.stdout.write(url.decode() + "\\n" + m.to_remote_buffer().serialize().decode() + "\\n")
sys.stdout.flush()
time.sleep(120)
"""


def test_transfer_failures_raise_the_exception_of_their_kind():
    import subprocess
    import sys
    import time

    from symmem.errors import PeerLostError, RefusedError, TransferError

    # Refused by the owner: a descriptor of memory it no longer has.
    a, b = pair("tcp")
    ms = a.register_memory(torch.zeros(16, dtype=torch.uint8))
    mb = b.register_memory(torch.zeros(16, dtype=torch.uint8))
    remote = mb.to_remote_buffer()
    b.unregister_memory(mb)
    with pytest.raises(RefusedError, match="unknown remote buffer") as refused:
        a.write(ms.to_view(), remote)
    assert isinstance(refused.value, PermissionError) and isinstance(refused.value, RuntimeError)
    a.close()
    b.close()

    # The peer is gone: its process was killed.
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
    try:
        url, desc = peer.stdout.readline().strip(), peer.stdout.readline().strip()
        t = symmem.new_transport("tcp", flows=1)
        t.connect(url.encode())
        remote = symmem.RemoteBuffer.deserialize(desc.encode())
        view = t.register_memory(torch.ones(4096, dtype=torch.uint8)).to_view()
        t.write(view, remote, timeout=10)
        peer.kill()
        peer.wait()
        deadline = time.monotonic() + 10
        with pytest.raises(PeerLostError) as lost:
            while time.monotonic() < deadline:
                t.write(view, remote, timeout=2)
        assert isinstance(lost.value, ConnectionError) and isinstance(lost.value, TransferError)
        t.close()
    finally:
        peer.kill()
        peer.wait()


def test_the_package_reports_its_version():
    from importlib.metadata import version

    assert symmem.__version__ == version("symmem"), symmem.__version__
    assert symmem._native.library_version.count(".") == 2
