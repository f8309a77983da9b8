#!/usr/bin/env bash
# symmem against Open MPI as played hosts grow (issue 53, item 5): for every host count in
# HOSTS, ranks per host in PER_HOST, operator in OPS, and engine pair in ENGINES, runs
# `symmem bench OP -n RANKS --hosts H` (OP=barrier: the barrier row of `symmem bench signal`,
# size 0) and Open MPI's loop (bench/mpi_allreduce.c) on the same
# number of processes, RUNS times alternated, and appends the median of each run's median
# latency to target/bench/hosts.csv (op, engine, ranks, hosts, bytes, symmem_us, mpi_us,
# speed = mpi_us / symmem_us). Then draws speed against hosts, a panel per operator and a
# line per size and engine, into target/bench/hosts.svg (bench/plot_hosts.py, stdlib only).
#
# Engines: tcp (symmem's tcp links against Open MPI's ob1 with the tcp btl) and ucx (symmem's
# ucx links against Open MPI's UCX pml, both on UCX's tcp transport, UCX_TLS=tcp). Played hosts
# share this machine's cores: compare equal process counts only (see docs/many-hosts.md for
# what changes on real hosts). A full sweep (3 host counts x 2 x 5 operators x 2 engines x 5
# sizes) takes about an hour here; narrow it with the variables. Open MPI's broadcast is timed
# as bench/mpi_allreduce.c times it, back-to-back calls on the slowest rank: small ones pipeline
# (a few microseconds a call), where symmem's broadcast returns only once every rank has it.
#
#   bench/compare_hosts.sh
#   HOSTS="2 4 8" PER_HOST=1 OPS=all-reduce ENGINES=tcp SIZES=8,64K,1M RUNS=1 bench/compare_hosts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTS=${HOSTS:-2 4 8}
PER_HOST=${PER_HOST:-1 2}
OPS=${OPS:-all-reduce all-gather reduce-scatter all-to-all broadcast barrier}
ENGINES=${ENGINES:-tcp ucx}
SIZES=${SIZES:-8,4K,64K,1M,16M}
RUNS=${RUNS:-3}
if ! command -v mpicc >/dev/null; then
    apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi
cargo build --release --locked -q
mkdir -p target/bench
mpicc -O2 -o target/bench/mpi_allreduce bench/mpi_allreduce.c
SIZES_B=$(target/release/symmem __sizes "$SIZES")
csv=target/bench/hosts.csv
[ -s "$csv" ] || echo "op,engine,ranks,hosts,bytes,symmem_us,mpi_us,speed" > "$csv"
export UCX_TLS=tcp
for op in $OPS; do
    case $op in
        all-reduce) mop=allreduce ;;
        all-gather) mop=allgather ;;
        reduce-scatter) mop=reducescatter ;;
        all-to-all) mop=alltoall ;;
        broadcast) mop=bcast ;;
        barrier) mop=barrier ;;
        *) echo "unknown operator $op" >&2; exit 2 ;;
    esac
    for engine in $ENGINES; do
        if [ "$engine" = ucx ]; then
            mpi_args=(--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any -x UCX_TLS=tcp)
        else
            mpi_args=(--mca pml ob1 --mca btl tcp,self)
        fi
        for per in $PER_HOST; do
            for h in $HOSTS; do
                n=$((per * h))
                out=$(mktemp)
                for _ in $(seq "$RUNS"); do
                    MPI_BENCH_OP=$mop mpirun --allow-run-as-root --oversubscribe "${mpi_args[@]}" -np "$n" \
                        target/bench/mpi_allreduce $SIZES_B | sed 's/^{/{"engine":"mpi",/' >> "$out"
                    if [ "$op" = barrier ]; then
                        SYMMEM_XHOST_BACKEND=$engine target/release/symmem bench signal --json -n "$n" --hosts "$h" \
                            | grep '"bench":"barrier"' | sed 's/^{/{"engine":"symmem",/; s/"size":null/"size":0/' >> "$out"
                    else
                        SYMMEM_XHOST_BACKEND=$engine target/release/symmem bench "$op" --json -n "$n" --hosts "$h" \
                            --sizes "$SIZES" --no-baseline | sed 's/^{/{"engine":"symmem",/' >> "$out"
                    fi
                done
                python3 - "$out" "$op" "$engine" "$n" "$h" >> "$csv" <<'PY'
import json, statistics, sys
path, op, engine, ranks, hosts = sys.argv[1:]
by = {}
for line in open(path):
    line = line.strip()
    if line.startswith("{"):
        r = json.loads(line)
        by.setdefault((r["engine"], r["size"]), []).append(r["time_us"])
for size in sorted({s for (_, s) in by}):
    s, m = by.get(("symmem", size)), by.get(("mpi", size))
    if s and m:
        s, m = statistics.median(s), statistics.median(m)
        print(f"{op},{engine},{ranks},{hosts},{size},{s:.2f},{m:.2f},{m / s:.3f}")
PY
                rm -f "$out"
                tail -n +2 "$csv" | awk -F, -v op="$op" -v e="$engine" -v n="$n" -v h="$h" \
                    '$1==op && $2==e && $3==n && $4==h {printf "%s %s %d ranks x %d hosts: %8s B  symmem %10s us  Open MPI %10s us  %sx\n", $1, $2, $3/$4, $4, $5, $6, $7, $8}'
            done
        done
    done
done
python3 bench/plot_hosts.py "$csv" target/bench/hosts.svg
echo "wrote $csv and target/bench/hosts.svg"
