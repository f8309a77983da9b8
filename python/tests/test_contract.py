"""PyTorch's one-sided transport contract, through ``torch.distributed._transport`` only, for
every symmem engine and for PyTorch's own NIXL backend (the reference; skipped with the reason
when the ``nixl`` package is not installed). Each case is one rule of PyTorch's ``_api.py`` or
of the transport spec; a case NIXL passes and symmem fails is a bug, unless the README lists it
as a deliberate difference."""

import asyncio
import math

import pytest
import torch
from torch.distributed._transport import Transport, available_transports, new_transport, wait_all


def _nixl():
    try:
        import nixl  # noqa: F401

        return None
    except Exception as e:  # noqa: BLE001 - the reason goes into the skip message
        return f"nixl is not installed ({type(e).__name__}: {e})"


def _symmem_engine(engine):
    try:
        new_transport("symmem", "cpu", engine=engine).close()
        return None
    except Exception as e:  # noqa: BLE001
        return f"symmem engine {engine} is unavailable here: {e.__cause__ or e}"


BACKENDS = [
    pytest.param(("symmem", {}), id="symmem"),
    pytest.param(("symmem", {"engine": "tcp"}), id="symmem-tcp"),
    pytest.param(("symmem", {"engine": "shm"}), id="symmem-shm"),
    pytest.param(("symmem", {"engine": "ucx"}), id="symmem-ucx"),
    pytest.param(("nixl", {}), id="nixl"),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    name, opts = request.param
    why = _nixl() if name == "nixl" else (_symmem_engine(opts["engine"]) if "engine" in opts else None)
    if why:
        pytest.skip(why)
    return name, opts


def make(backend):
    name, opts = backend
    return new_transport(name, "cpu", **opts)


@pytest.fixture
def pair(backend):
    a, b = make(backend), make(backend)
    ua, ub = a.bind(), b.bind()
    a.connect(ub)
    b.connect(ua)
    yield a, b
    for t in (a, b):
        try:
            t.close()
        except Exception:  # noqa: BLE001 - a case may have closed it already
            pass


def remote_of(memory):
    d = memory.to_remote_buffer()
    return type(d).deserialize(d.serialize())


BAD_TIMEOUTS = [-1.0, math.nan, math.inf]


# --- construction and registry ------------------------------------------------------------


def test_is_a_registered_supported_transport(backend):
    assert backend[0] in available_transports()
    t = make(backend)
    assert isinstance(t, Transport) and t.supported()
    t.close()


def test_a_gpu_device_is_refused_at_construction(backend):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if backend[0] == "nixl":
        pytest.skip("NIXL accepts CUDA as a device (its tensors are refused later)")
    with pytest.raises(RuntimeError, match="failed to create transport"):
        new_transport(backend[0], "cuda", **backend[1])


# --- moving bytes ------------------------------------------------------------------------


def test_sync_write_and_read_move_the_bytes(pair):
    a, b = pair
    src, dst = torch.arange(64, dtype=torch.float32), torch.zeros(64, dtype=torch.float32)
    ms, md = a.register_memory(src), b.register_memory(dst)
    assert a.write(ms.to_view(), remote_of(md)) == 0
    assert torch.equal(dst, src)
    back = torch.zeros(64, dtype=torch.float32)
    mb = b.register_memory(back)
    assert b.read(mb.to_mutable_view(), remote_of(ms)) == 0
    assert torch.equal(back, src)


def test_async_work_is_a_torch_work_and_its_future_resolves(pair):
    a, b = pair
    src, dst = torch.arange(32, dtype=torch.int64), torch.zeros(32, dtype=torch.int64)
    ms, md = a.register_memory(src), b.register_memory(dst)
    work = a.write(ms.to_view(8, 64), remote_of(md), async_op=True)
    assert isinstance(work, torch.distributed.Work)
    assert work.wait() is True or work.wait() in (None, True)
    assert work.is_completed()
    assert work.get_future().wait() == []
    assert torch.equal(dst[:8], src[1:9])


def test_a_mutable_view_can_be_the_source_of_a_write(pair):
    a, b = pair
    src, dst = torch.full((16,), 7, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    ms, md = a.register_memory(src), b.register_memory(dst)
    a.write(ms.to_mutable_view(), remote_of(md))
    assert torch.equal(dst, src)


def test_an_empty_view_completes(pair):
    a, b = pair
    ms, md = a.register_memory(torch.ones(8)), b.register_memory(torch.zeros(8))
    assert a.write(ms.to_view(4, 0), remote_of(md)) == 0


def test_asyncio_transfers_and_wait_all(pair):
    a, b = pair
    src, dst = torch.arange(128, dtype=torch.float64), torch.zeros(128, dtype=torch.float64)
    ms, md = a.register_memory(src), b.register_memory(dst)

    async def go():
        await a.write_async(ms.to_view(), remote_of(md), timeout=30.0)
        back = torch.zeros(128, dtype=torch.float64)
        mb = b.register_memory(back)
        await b.read_async(mb.to_mutable_view(), remote_of(ms))
        await wait_all([a.write(ms.to_view(), remote_of(md), async_op=True)], timeout=30.0)
        return back

    assert torch.equal(asyncio.run(go()), src) and torch.equal(dst, src)


# --- views -------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [1.5, "1", b"1"])
def test_view_bounds_must_be_integers(pair, bound):
    a, _ = pair
    m = a.register_memory(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(TypeError):
        m.to_view(bound)
    with pytest.raises(TypeError):
        m.to_mutable_view(0, bound)


@pytest.mark.parametrize(("offset", "length"), [(-1, None), (17, None), (0, 17), (8, 9), (0, -1)])
def test_view_bounds_must_lie_in_the_registration(pair, offset, length):
    a, _ = pair
    m = a.register_memory(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError):
        m.to_view(offset, length)


def test_views_report_their_size_and_mutable_ones_are_writable(pair):
    a, _ = pair
    m = a.register_memory(torch.zeros(16, dtype=torch.uint8))
    assert m.to_view().size() == 16 and m.to_view(4).size() == 12 and m.to_view(4, 2).size() == 2
    assert m.to_mutable_view().writable is True


# --- misuse is refused before anything moves ------------------------------------------------


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_invalid_timeouts_are_refused(pair, timeout):
    a, b = pair
    ms, md = a.register_memory(torch.ones(8)), b.register_memory(torch.zeros(8))
    remote = remote_of(md)
    for call in (
        lambda: a.write(ms.to_view(), remote, timeout=timeout),
        lambda: a.read(ms.to_mutable_view(), remote, timeout=timeout),
        lambda: a.register_memory(torch.ones(4), timeout=timeout),
        lambda: ms.to_remote_buffer(timeout=timeout),
    ):
        with pytest.raises(ValueError):
            call()


def test_a_view_larger_than_the_remote_buffer_is_refused(pair):
    a, b = pair
    ms, md = a.register_memory(torch.ones(16)), b.register_memory(torch.zeros(8))
    with pytest.raises(ValueError):
        a.write(ms.to_view(), remote_of(md))


def test_a_transfer_before_connect_is_refused(backend):
    a, b = make(backend), make(backend)
    try:
        a.bind(), b.bind()
        md = b.register_memory(torch.zeros(8))
        ms = a.register_memory(torch.ones(8))
        with pytest.raises((ValueError, RuntimeError)):
            a.write(ms.to_view(), remote_of(md))
    finally:
        a.close()
        b.close()


def test_a_descriptor_of_another_peer_is_refused(backend):
    a, b, c = make(backend), make(backend), make(backend)
    try:
        ua, ub = a.bind(), b.bind()
        c.bind()
        a.connect(ub)
        b.connect(ua)
        stranger = c.register_memory(torch.zeros(8))
        ms = a.register_memory(torch.ones(8))
        with pytest.raises(ValueError):
            a.write(ms.to_view(), remote_of(stranger))
    finally:
        for t in (a, b, c):
            t.close()


def test_connecting_twice_is_refused(pair):
    a, b = pair
    with pytest.raises(RuntimeError):
        a.connect(b.bind())


def test_a_raw_tensor_is_not_a_view(pair):
    a, b = pair
    md = b.register_memory(torch.zeros(8))
    with pytest.raises(TypeError):
        a.write(torch.ones(8), remote_of(md))


def test_a_read_needs_a_mutable_view(pair):
    a, b = pair
    ms, md = a.register_memory(torch.zeros(8)), b.register_memory(torch.ones(8))
    with pytest.raises(TypeError):
        a.read(ms.to_view(), remote_of(md))


def test_a_view_of_another_transport_is_refused(pair):
    a, b = pair
    mb, md = b.register_memory(torch.ones(8)), b.register_memory(torch.zeros(8))
    with pytest.raises(TypeError):
        a.write(mb.to_view(), remote_of(md))


@pytest.mark.parametrize("what", ["not a tensor", "non-contiguous", "empty"])
def test_registration_refuses_what_it_cannot_expose(pair, what):
    a, _ = pair
    bad = {"not a tensor": [1, 2, 3], "non-contiguous": torch.zeros(4, 4).t(), "empty": torch.zeros(0)}[what]
    with pytest.raises(TypeError if what == "not a tensor" else ValueError):
        a.register_memory(bad)


# --- descriptors ---------------------------------------------------------------------------


def test_descriptors_round_trip_and_name_the_backend(pair, backend):
    _, b = pair
    d = b.register_memory(torch.zeros(8)).to_remote_buffer()
    wire = d.serialize()
    assert type(wire) is bytes and wire.startswith(b'{"version":1,"backend":"' + backend[0].encode() + b'"')
    again = type(d).deserialize(wire)
    assert again == d and again.serialize() == wire


@pytest.mark.parametrize("other", ["tcp", "nixl", "symmem", "auto", ""])
def test_descriptors_of_another_backend_are_refused(pair, backend, other):
    if other == backend[0]:
        pytest.skip("the backend's own name")
    _, b = pair
    d = b.register_memory(torch.zeros(8)).to_remote_buffer()
    forged = d.serialize().replace(b'"backend":"' + backend[0].encode() + b'"', b'"backend":"' + other.encode() + b'"')
    with pytest.raises(ValueError, match="different backend"):
        type(d).deserialize(forged)


@pytest.mark.parametrize("data", [b"not json", b"\xff", b"[]", b"null", b'{"version":1,"version":1}'])
def test_malformed_descriptors_are_refused(pair, data):
    _, b = pair
    d = b.register_memory(torch.zeros(8)).to_remote_buffer()
    with pytest.raises(ValueError):
        type(d).deserialize(data)
    with pytest.raises(TypeError):
        type(d).deserialize(data.decode("latin-1"))


# --- lifetime ------------------------------------------------------------------------------


def test_unregistering_twice_is_a_no_op_and_foreign_memory_is_refused(pair):
    a, b = pair
    m = a.register_memory(torch.zeros(8))
    a.unregister_memory(m)
    a.unregister_memory(m)
    with pytest.raises(TypeError):
        a.unregister_memory(b.register_memory(torch.zeros(8)))


def test_an_unregistered_memory_cannot_be_used(pair):
    a, b = pair
    ms, md = a.register_memory(torch.ones(8)), b.register_memory(torch.zeros(8))
    view = ms.to_view()
    a.unregister_memory(ms)
    with pytest.raises(RuntimeError):
        a.write(view, remote_of(md))


def test_close_is_idempotent_and_everything_after_it_raises(backend):
    a, b = make(backend), make(backend)
    ua, ub = a.bind(), b.bind()
    a.connect(ub)
    b.connect(ua)
    m = a.register_memory(torch.ones(8))
    md = b.register_memory(torch.zeros(8))
    remote = remote_of(md)
    a.close()
    a.close()
    assert not a.connected()
    # Close releases the registrations (NIXL says so: "memory has been unregistered").
    with pytest.raises(RuntimeError, match="closed|unregistered"):
        a.write(m.to_view(), remote)
    for call in (lambda: a.register_memory(torch.ones(4)), lambda: a.bind()):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    b.close()


def test_close_async_and_the_context_manager(backend):
    async def go():
        t = make(backend)
        t.bind()
        await t.close_async(timeout=30.0)
        return t

    t = asyncio.run(go())
    with pytest.raises(RuntimeError):
        t.register_memory(torch.ones(4))
    with make(backend) as u:
        u.bind()
    with pytest.raises(RuntimeError):
        u.register_memory(torch.ones(4))


# --- asyncio: a large copy never blocks the event loop -------------------------------------


def test_a_1_gib_write_async_on_shm_leaves_the_loop_responsive():
    why = _symmem_engine("shm")
    if why:
        pytest.skip(why)
    a, b = new_transport("symmem", "cpu", engine="shm"), new_transport("symmem", "cpu", engine="shm")
    a.connect(b.bind())
    b.connect(a.bind())
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8)
    src[:: 1 << 20] = 7  # touch a byte per MiB so the copy is real
    dst = torch.empty(n, dtype=torch.uint8)
    ms, md = a.register_memory(src), b.register_memory(dst)
    remote = remote_of(md)
    gaps = []

    async def go():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        async def ticker():
            last = loop.time()
            while not stop.is_set():
                await asyncio.sleep(0.001)
                now = loop.time()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        started = loop.time()
        await a.write_async(ms.to_view(), remote, timeout=120.0)
        took = loop.time() - started
        stop.set()
        await tick
        return took

    took = asyncio.run(go())
    print(f"1 GiB write_async took {took * 1e3:.1f} ms; the loop's longest gap {max(gaps) * 1e3:.1f} ms over {len(gaps)} ticks")
    assert torch.equal(dst[:: 1 << 20], src[:: 1 << 20])
    # The copy took a while, and the loop kept ticking through it: no gap near the copy's
    # length (a loop blocked by the write would show one). The bound grows with the copy,
    # because this VM can stall every thread at once (first touches of 2 GiB of fresh memory
    # took 7 s and one 0.75 s stall in a CI run, the loop ticking 2994 times through it).
    assert took > 0.02, took
    assert len(gaps) > 5 and max(gaps) < max(0.05, took / 4), (took, max(gaps), len(gaps))
    a.close()
    b.close()


def test_the_engine_option_reaches_the_engine():
    t = new_transport("symmem", "cpu", engine="tcp")
    u = new_transport("symmem", "cpu", engine="tcp")
    t.connect(u.bind())
    u.connect(t.bind())
    assert t.describe().startswith("tcp"), t.describe()
    with pytest.raises(RuntimeError, match="failed to create transport"):
        new_transport("symmem", "cpu", engine="carrier-pigeon")
    t.close()
    u.close()
