#!/usr/bin/env bash
# Threads and file descriptors per rank, and where they go, while symmem runs an all-reduce
# across played hosts (issue 53: what a rank holds as hosts grow). For each host count, runs
# `symmem bench all-reduce -n RANKS --hosts H` long enough to sample every rank's /proc, and
# prints per rank the threads (by name) and the file descriptors (by kind), as the median over
# the ranks.
#   bench/xhost_resources.sh                  # 1 and 2 ranks a host, 2 4 8 16 hosts
#   PER_HOST=1 HOSTS="2 4 8" bench/xhost_resources.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SYMMEM=${SYMMEM:-target/release/symmem}
[ -x "$SYMMEM" ] || cargo build --release --locked -q
HOSTS=${HOSTS:-2 4 8 16}
PER_HOST=${PER_HOST:-1 2}
SIZE=${SIZE:-8}
echo "ranks hosts  threads  fds  sockets  eventfds  threads-by-name"
for per in $PER_HOST; do
    for h in $HOSTS; do
        n=$((per * h))
        log=$(mktemp)
        "$SYMMEM" bench all-reduce -n "$n" --hosts "$h" --sizes "$SIZE" --iters 1000000 --warmup 10 >"$log" 2>&1 &
        bench=$!
        # Wait for every rank to have linked (its thread count stops growing), then sample.
        pids=()
        for _ in $(seq 1 300); do
            sleep 0.2
            mapfile -t pids < <(pgrep -P "$bench" || true)
            [ "${#pids[@]}" -ge "$n" ] && break
        done
        sleep 3
        rows=()
        for p in "${pids[@]}"; do
            [ -d /proc/$p ] || continue
            t=$(ls /proc/$p/task | wc -l)
            f=$(ls /proc/$p/fd | wc -l)
            s=$(ls -l /proc/$p/fd 2>/dev/null | grep -c 'socket:' || true)
            e=$(ls -l /proc/$p/fd 2>/dev/null | grep -c 'eventfd' || true)
            names=$(cat /proc/$p/task/*/comm 2>/dev/null | sort | uniq -c | sort -rn | awk '{printf "%s×%s ", $2, $1}')
            rows+=("$t $f $s $e $names")
        done
        kill "$bench" 2>/dev/null || true; wait "$bench" 2>/dev/null || true
        rm -f "$log"
        if [ "${#rows[@]}" -eq 0 ]; then echo "$n $h  (no ranks found)"; continue; fi
        med=$(printf '%s\n' "${rows[@]}" | sort -n | sed -n "$(( (${#rows[@]} + 1) / 2 ))p")
        printf '%5d %5d  %s\n' "$n" "$h" "$med"
    done
done
