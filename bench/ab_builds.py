#!/usr/bin/env python3
"""Two builds of symmem, alternated: the before/after figures of a change on a noisy machine.

Runs `A <args> --json` and `B <args> --json` in turn N times and prints, per result row (bench,
size), the median over the runs of each build's time_us and their ratio (B/A), with the
bandwidth where rows report one; then the median of the paired ratios (run i of B over run i of
A, its neighbour in time: this machine's speed drifts by tens of percent over minutes, which
pairing cancels) with a 90% bootstrap interval of that median. An interval that holds 1.00 says
the runs do not tell the builds apart. Rows noted "(baseline)" (Open MPI in the collective benches)
are left out; the transport bench's plain TCP rows stay, a gauge of the machine's noise (their
B/A should be near 1).

    bench/ab_builds.py N A B ARGS...
    e.g. bench/ab_builds.py 8 /tmp/before target/release/symmem \\
             bench all-reduce -n 4 --hosts 2 --sizes 2M,4M --no-baseline

Build A from the commit before the change (`git worktree add`, then `cargo build --release`
with its own target directory). Environment variables (SYMMEM_XHOST_BACKEND, UCX_TLS, ...)
apply to both.
"""
import json
import random
import statistics
import subprocess
import sys


def main() -> None:
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    n, builds, args = int(sys.argv[1]), {"a": sys.argv[2], "b": sys.argv[3]}, sys.argv[4:]
    rows = {"a": {}, "b": {}}
    for _ in range(n):
        for name, exe in builds.items():
            out = subprocess.run([exe, *args, "--json"], capture_output=True, text=True, timeout=1200, check=True)
            for line in out.stdout.splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if str(r.get("note", "")).startswith("(baseline)"):
                    continue
                got = rows[name].setdefault((r["bench"], r.get("size") or 0), {"t": [], "g": []})
                got["t"].append(r["time_us"])
                if r.get("stream_gbps"):
                    got["g"].append(r["stream_gbps"])
    for key in sorted(rows["a"]):
        a, b = rows["a"][key], rows["b"].get(key)
        if not b:
            continue
        ta, tb = statistics.median(a["t"]), statistics.median(b["t"])
        line = f"{key[0]:>26} {key[1]:>10}  time_us A={ta:10.1f} B={tb:10.1f} B/A={tb / ta:5.2f}"
        if a["g"] and b["g"]:
            line += f"   GB/s A={statistics.median(a['g']):6.2f} B={statistics.median(b['g']):6.2f}"
        if len(a["t"]) == len(b["t"]) and len(a["t"]) >= 3:
            med, lo, hi = paired(a["t"], b["t"])
            verdict = "B faster" if hi < 1 else "A faster" if lo > 1 else "no difference shown"
            line += f"   paired B/A={med:5.2f} [{lo:4.2f}, {hi:4.2f}] {verdict}"
        print(line)


def paired(a: list, b: list) -> tuple:
    """The median of b[i]/a[i] and a 90% bootstrap interval of it (a fixed seed: the same
    runs give the same interval)."""
    ratios = [y / x for x, y in zip(a, b)]
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), meds[len(meds) // 20], meds[len(meds) * 19 // 20]


if __name__ == "__main__":
    main()
