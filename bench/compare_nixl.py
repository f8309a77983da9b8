#!/usr/bin/env python3
"""symmem vs NIXL through PyTorch's transport API (torch.distributed._transport), two processes.

For each backend and size, the initiator times:
  - write/read latency: one synchronous call (``write(view, remote)``), median of many;
  - windowed bandwidth: WINDOW asynchronous writes (or reads) in flight, then wait on all,
    median over rounds, reported in GB/s (1e9 bytes per second).

Both processes run the same backend with the same sizes in one run. Setup (run once):

    python -m venv /tmp/v && /tmp/v/bin/pip install torch==2.15.0 maturin pytest numpy
    /tmp/v/bin/pip install nixl-cu13==1.5.1 nixl-cu12==1.5.1 nixl==1.5.1 --no-deps
    SYMMEM_TORCH_PYTHON=/tmp/v/bin/python python/test.sh      # installs symmem into /tmp/v
    /tmp/v/bin/python bench/compare_nixl.py [--backends symmem,nixl] [--sizes 8,4K,1M]

The peer process only registers its buffer and waits; the initiator does all the work, as a
one-sided transfer should let it.
"""

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

WINDOW = 16


def parse_sizes(text):
    """Sizes through symmem's one size parser (the `symmem` command the wheel installs, or the
    cargo-built one): B, K or KiB, M or MiB, G or GiB, separated by commas or spaces."""
    import os
    import shutil
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    exe = shutil.which("symmem", path=os.path.dirname(sys.executable)) or shutil.which("symmem")
    exe = exe or os.path.join(here, "..", "target", "release", "symmem")
    out = subprocess.run([exe, "__sizes", text], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr.strip())
    return [int(v) for v in out.stdout.split()]


def fmt_size(n):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def new_transport(backend, device):
    """PyTorch's transport of ``backend``; ``symmem-py`` is symmem's own Python API (no torch
    layer in between), to show what the torch backend adds."""
    if backend == "symmem-py":
        import symmem

        return symmem.new_transport("auto", device)
    from torch.distributed._transport import new_transport as torch_new_transport

    return torch_new_transport(backend, device)


def peer(backend, nbytes, conn):
    """The passive side: registers a buffer, publishes it, and waits to be told to stop."""
    import torch

    with new_transport(backend, "cpu") as t:
        conn.send(t.bind())
        t.connect(conn.recv())
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        mem = t.register_memory(buf)
        desc = mem.to_remote_buffer()
        conn.send(desc.serialize())
        conn.recv()  # done
        t.unregister_memory(mem)
        conn.send("closed")


def median_time(fn, iters):
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run_backend(backend, sizes, budget):
    import torch

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    max_size = max(sizes)
    p = ctx.Process(target=peer, args=(backend, max_size, there))
    p.start()
    rows = []
    try:
        with new_transport(backend, "cpu") as t:
            url = t.bind()
            peer_url = here.recv()
            here.send(url)
            t.connect(peer_url)
            src = torch.arange(max_size, dtype=torch.int64).to(torch.uint8)
            mem = t.register_memory(src)
            remote_desc = here.recv()
            remote = type(mem.to_remote_buffer()).deserialize(remote_desc)
            for size in sizes:
                view = mem.to_view(0, size)
                mview = mem.to_mutable_view(0, size)
                rbuf = remote  # PyTorch's API writes a view to the start of a remote buffer
                # Warm up, and check the data lands.
                for _ in range(10):
                    t.write(view, rbuf)
                    t.read(mview, rbuf)
                iters = max(20, min(2000, int(budget / max(size / 2e9, 10e-6))))
                w_lat = median_time(lambda: t.write(view, rbuf), iters)
                r_lat = median_time(lambda: t.read(mview, rbuf), iters)
                # Windowed: WINDOW transfers in flight (all to the buffer's start: the API has no
                # remote offsets).
                rounds = max(5, min(200, int(budget / max(size * WINDOW / 2e9, 50e-6))))

                def window(op, local):
                    works = [op(local, rbuf, async_op=True) for i in range(WINDOW)]
                    for w in works:
                        w.wait()

                w_bw = size * WINDOW / median_time(lambda: window(t.write, view), rounds) / 1e9
                r_bw = size * WINDOW / median_time(lambda: window(t.read, mview), rounds) / 1e9
                rows.append((size, w_lat, r_lat, w_bw, r_bw))
                print(
                    f"{backend:7} {fmt_size(size):>8}  write {w_lat * 1e6:9.2f} us  read {r_lat * 1e6:9.2f} us  "
                    f"write bw {w_bw:7.2f} GB/s  read bw {r_bw:7.2f} GB/s",
                    flush=True,
                )
            here.send("done")
            here.recv()
            t.unregister_memory(mem)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="symmem,nixl", help="comma-separated; symmem-py = symmem's own API")
    ap.add_argument(
        "--sizes", default="8,64,512,4K,64K,256K,1M,4M,16M,64M", help="B, K/KiB, M/MiB or G/GiB, commas or spaces"
    )
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per measurement (approx.)")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    results = {b: run_backend(b, sizes, args.budget) for b in args.backends.split(",")}
    names = list(results)
    print()
    print(
        "| size | " + " | ".join(f"{b} write µs | {b} read µs | {b} write GB/s | {b} read GB/s" for b in names) + " |"
    )
    print("|---" * (1 + 4 * len(names)) + "|")
    for i, size in enumerate(sizes):
        cells = []
        for b in names:
            _, wl, rl, wb, rb = results[b][i]
            cells += [f"{wl * 1e6:.2f}", f"{rl * 1e6:.2f}", f"{wb:.2f}", f"{rb:.2f}"]
        print(f"| {fmt_size(size)} | " + " | ".join(cells) + " |")
    if len(names) == 2:
        a, b = names
        print(f"\nratios {a}/{b} (latency: {b}/{a}, higher is better for {a}):")
        for i, size in enumerate(sizes):
            ra, rb = results[a][i], results[b][i]
            print(
                f"  {fmt_size(size):>8}: write lat {rb[1] / ra[1]:.1f}x  read lat {rb[2] / ra[2]:.1f}x  "
                f"write bw {ra[3] / rb[3]:.1f}x  read bw {ra[4] / rb[4]:.1f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
