#!/usr/bin/env bash
# Open MPI's MPI_Allreduce next to `symmem bench all-reduce`, same sizes and rank count, each
# run RUNS times (default 3); prints the median of the runs' median latencies side by side.
# Needs Debian's openmpi-bin and libopenmpi-dev (installed if missing, as root).
#   bench/compare_mpi.sh [RANKS] [SIZES]     e.g. bench/compare_mpi.sh 2 8,4096,65536,1048576,16777216
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=${1:-2}
SIZES=${2:-8,4096,65536,1048576,16777216}
RUNS=${RUNS:-3}
if ! command -v mpicc >/dev/null; then
    apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi
cargo build --release -q
mkdir -p target/bench
mpicc -O2 -o target/bench/mpi_allreduce bench/mpi_allreduce.c
out=target/bench/compare.jsonl
: > "$out"
for run in $(seq "$RUNS"); do
    mpirun --allow-run-as-root --oversubscribe -np "$RANKS" target/bench/mpi_allreduce ${SIZES//,/ } >> "$out"
    target/release/symmem bench all-reduce --json --ranks "$RANKS" --sizes "$SIZES" >> "$out"
done
python3 - "$out" "$RANKS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    by.setdefault((r["bench"], r["bytes"]), []).append(r["lat_us"])
sizes = sorted({b for (_, b) in by})
print(f"all-reduce, {sys.argv[2]} ranks, float32 sum, median of {len(by.get(('mpi_allreduce', sizes[0]), []))} runs' medians (us)")
print(f"{'bytes':>10} {'Open MPI':>12} {'symmem':>12} {'speedup':>8}")
for b in sizes:
    m = statistics.median(by.get(("mpi_allreduce", b), [float("nan")]))
    s = statistics.median(by.get(("all_reduce", b), [float("nan")]))
    print(f"{b:>10} {m:>12.2f} {s:>12.2f} {m / s:>7.2f}x")
PY
