#!/usr/bin/env bash
# Open MPI's MPI_Allreduce (or MPI_Alltoall with OP=all-to-all, MPI_Allgather with
# OP=all-gather, MPI_Reduce_scatter_block with OP=reduce-scatter, MPI_Bcast from rank 0 with
# OP=broadcast (both timed on their slowest rank), or with OP=all-to-all-v an
# MPI_Alltoall of the counts then MPI_Alltoallv, as a sender-known-splits exchange takes) next to
# `symmem bench all-reduce` (all-to-all, all-gather, reduce-scatter, broadcast, all-to-all-v), same sizes
# and rank count, each run RUNS times (default 3); prints the median of the runs' median
# latencies side by side.
# HOSTS=2 plays two hosts on this machine: symmem splits the ranks over two "hosts" that reach
# each other through its tcp transport (`--hosts 2`), and Open MPI is restricted to its TCP
# transport (`--mca btl tcp,self`, every pair over TCP loopback, as between hosts).
# XHOST=ucx links symmem's played hosts with its ucx backend (SYMMEM_XHOST_BACKEND) instead of
# tcp; MPI_PML=ucx runs Open MPI on its UCX pml instead of ob1 with the tcp btl. With HOSTS=2,
# both UCX users are restricted to UCX's tcp transport (UCX_TLS=tcp), as between hosts here.
# Open MPI's UCX runs with UCX's own tcp segments (8 KiB to send) and symmem's with its own
# (64 KiB; see UCX_TCP_TX_SEG_SIZE in `symmem info`); MPI_SEGMENTS=symmem gives Open MPI
# symmem's too, to tell what the segments alone are worth to it.
# Needs Debian's openmpi-bin and libopenmpi-dev (installed if missing, as root), and libucx0
# for the UCX variants.
# SIZES take symmem's units (B, K or KiB, M or MiB, G or GiB), separated by commas or spaces.
#   bench/compare_mpi.sh [RANKS] [SIZES]     e.g. bench/compare_mpi.sh 2 8,4K,64K,1M,16M
#   HOSTS=2 OP=all-to-all bench/compare_mpi.sh 4 8,65536,1048576,16777216
#   HOSTS=2 XHOST=ucx MPI_PML=ucx bench/compare_mpi.sh 4 8,65536,1048576,16777216
#   HOSTS=2 OP=all-gather bench/compare_mpi.sh 2 8,64K,1M,16M   (sizes: the gathered output)
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=${1:-2}
SIZES=${2:-8,4096,65536,1048576,16777216}
RUNS=${RUNS:-3}
HOSTS=${HOSTS:-1}
OP=${OP:-all-reduce}
XHOST=${XHOST:-tcp}
MPI_PML=${MPI_PML:-ob1}
MPI_ARGS=()
if [ "$HOSTS" -gt 1 ]; then
    if [ "$MPI_PML" = ucx ]; then MPI_ARGS=(--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any -x UCX_TLS=tcp); else MPI_ARGS=(--mca pml ob1 --mca btl tcp,self); fi
    if [ "$MPI_PML" = ucx ] && [ "${MPI_SEGMENTS:-}" = symmem ]; then
        MPI_ARGS+=(-x UCX_TCP_TX_SEG_SIZE=64K -x UCX_TCP_RX_SEG_SIZE=256K)
    fi
    export UCX_TLS=tcp
fi
export SYMMEM_XHOST_BACKEND="$XHOST" XHOST MPI_PML
# mpirun binds each rank to a core when they do not outnumber the cores (its default); symmem's
# ranks are then bound too (`--pin`), so both run like for like. PIN=0 leaves symmem's unbound.
PIN_ARGS=()
if [ "${PIN:-1}" != 0 ] && [ "$RANKS" -le "$(nproc)" ]; then PIN_ARGS=(--pin); fi
if [ "$OP" = all-to-all ]; then export MPI_BENCH_OP=alltoall; MPI_NAME=mpi_alltoall; SYM_NAME=all_to_all;
elif [ "$OP" = all-gather ]; then export MPI_BENCH_OP=allgather; MPI_NAME=mpi_allgather; SYM_NAME=all_gather;
elif [ "$OP" = reduce-scatter ]; then export MPI_BENCH_OP=reducescatter; MPI_NAME=mpi_reduce_scatter; SYM_NAME=reduce_scatter;
elif [ "$OP" = broadcast ]; then export MPI_BENCH_OP=bcast; MPI_NAME=mpi_bcast; SYM_NAME=broadcast;
elif [ "$OP" = all-to-all-v ]; then export MPI_BENCH_OP=alltoallv; MPI_NAME=mpi_alltoallv; SYM_NAME=all_to_all_v;
else MPI_NAME=mpi_allreduce; SYM_NAME=all_reduce; fi
if ! command -v mpicc >/dev/null; then
    apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi
cargo build --release -q
# One size parser for every command and script: symmem's.
SIZES_B=$(target/release/symmem __sizes "$SIZES")
mkdir -p target/bench
mpicc -O2 -o target/bench/mpi_allreduce bench/mpi_allreduce.c
out=target/bench/compare.jsonl
: > "$out"
for run in $(seq "$RUNS"); do
    mpirun --allow-run-as-root --oversubscribe "${MPI_ARGS[@]}" -np "$RANKS" target/bench/mpi_allreduce $SIZES_B >> "$out"
    target/release/symmem bench "$OP" --json -n "$RANKS" --hosts "$HOSTS" --sizes "$SIZES" --no-baseline "${PIN_ARGS[@]}" >> "$out"
done
python3 - "$out" "$RANKS" "$MPI_NAME" "$SYM_NAME" "$HOSTS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    by.setdefault((r["bench"], r["size"]), []).append(r["time_us"])
sizes = sorted({b for (_, b) in by})
mpi, sym, hosts = sys.argv[3], sys.argv[4], sys.argv[5]
import os
how = f"symmem over {os.environ.get('XHOST', 'tcp')}, Open MPI pml {os.environ.get('MPI_PML', 'ob1')}" if hosts != "1" else "one host"
print(f"{sym}, {sys.argv[2]} ranks on {hosts} host(s) ({how}), float32, median of {len(by.get((mpi, sizes[0]), []))} runs' medians (us)")
print(f"{'bytes':>10} {'Open MPI':>12} {'symmem':>12} {'speedup':>8}")
for b in sizes:
    m = statistics.median(by.get((mpi, b), [float("nan")]))
    s = statistics.median(by.get((sym, b), [float("nan")]))
    print(f"{b:>10} {m:>12.2f} {s:>12.2f} {m / s:>7.2f}x")
PY
