#!/usr/bin/env bash
# symmem's ucx transport next to UCX's own ucx_perftest, both on UCX's tcp transport
# (UCX_TLS=tcp, loopback: what two hosts without RDMA use), same sizes, each run RUNS times
# (default 3); prints medians side by side.
#   symmem: `symmem bench transport --backend ucx` (a one-sided write or read of SIZE bytes,
#           latency = until its completion is known to the initiator, i.e. a round trip;
#           bandwidth = WINDOW transfers in flight, 8 unless set).
#   UCX:    ucp_put_lat (one-way latency of a put ping-pong, i.e. half a round trip) and
#           ucp_put_bw (bandwidth of back-to-back puts, with no bound on those outstanding:
#           perftest's -O 0; WINDOW=128 comes closer to that for symmem's small writes, each
#           of which its owner acknowledges), and ucp_put_bw with at most WINDOW outstanding
#           (-O WINDOW). perftest counts a put done once UCX has its bytes (local completion;
#           one flush at the end), where a symmem write's Work completes once its bytes are in
#           the peer's memory: for small writes, what it does per transfer is not symmem's.
#   UCX put+flush: bench/ucp_put_flush.c, ucp_put_nbx and ucp_ep_flush_nbx per transfer (remote
#           completion, as NIXL's UCX backend waits for it), WINDOW of them in flight, with
#           peer-failure handling as symmem's endpoints: the like-for-like rate (last columns).
# Needs ucx-utils (ucx_perftest), libucx0 and libucx-dev (installed if missing, as root).
#   bench/compare_ucx.sh [SIZES]      e.g. bench/compare_ucx.sh 8,65536,1048576,16777216
#   WINDOW=128 bench/compare_ucx.sh 8,4096
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${1:-8,65536,1048576,16777216}
RUNS=${RUNS:-3}
WINDOW=${WINDOW:-8}
export WINDOW
if ! command -v ucx_perftest >/dev/null || [ ! -f /usr/include/ucp/api/ucp.h ]; then
    apt-get update -qq && apt-get install -y -qq ucx-utils libucx0 libucx-dev >/dev/null
fi
export UCX_TLS=${UCX_TLS:-tcp}
cargo build --release -q
# One size parser for every command and script: symmem's (B, K/KiB, M/MiB, G/GiB).
SIZES_B=$(target/release/symmem __sizes "$SIZES")
out=target/bench/compare_ucx.txt
mkdir -p target/bench
gcc -O2 -o target/bench/ucp_put_flush bench/ucp_put_flush.c -lucp -lucs
: > "$out"
port=$((20000 + RANDOM % 20000))
for run in $(seq "$RUNS"); do
    target/release/symmem bench transport --backend ucx --json --window "$WINDOW" --sizes "$SIZES" | sed 's/^/SYMMEM /' >> "$out"
    for s in $SIZES_B; do
        # ucp_put_bw_window: ucp_put_bw with at most WINDOW puts outstanding (-O), as symmem's
        # bandwidth run keeps WINDOW writes in flight: the like-for-like rate.
        for t in ucp_put_lat ucp_put_bw ucp_put_bw_window; do
            n=$(( s >= 1048576 ? 200 : 2000 ))
            port=$((port + 1))
            args=(-t "${t%_window}")
            [ "$t" = ucp_put_bw_window ] && args+=(-O "$WINDOW")
            ucx_perftest -p "$port" >/dev/null 2>&1 &
            srv=$!
            sleep 0.3
            line=$(timeout 120 ucx_perftest 127.0.0.1 -p "$port" "${args[@]}" -s "$s" -n "$n" 2>/dev/null | grep '^Final:' || true)
            wait "$srv" 2>/dev/null || true
            echo "UCX $t $s $line" >> "$out"
        done
        n=$(( s >= 1048576 ? 200 : 20000 ))
        PEER=1 timeout 120 target/bench/ucp_put_flush "$s" "$WINDOW" "$n" | sed 's/^/FLUSH /' >> "$out" || true
    done
done
python3 - "$out" <<'PY'
import json, statistics, sys
sym, ucx, flush = {}, {}, {}
for l in open(sys.argv[1]):
    if l.startswith("SYMMEM "):
        r = json.loads(l[7:])
        if r["bench"] in ("write", "read"):
            sym.setdefault((r["bench"], r["size"]), []).append((r["time_us"], r.get("stream_gbps") or 0.0))
    elif l.startswith("FLUSH "):
        r = json.loads(l[6:])
        flush.setdefault(r["size"], []).append((r["latency_us"], r["stream_gbps"]))
    elif l.startswith("UCX "):
        p = l.split()
        if len(p) >= 12:
            # Final: iters p50 avg overall bw_avg bw_overall ...
            ucx.setdefault((p[1], int(p[2])), []).append((float(p[5]), float(p[9]) * 1.048576e6 / 1e9))
med = lambda xs, i: statistics.median(x[i] for x in xs) if xs else float("nan")
sizes = sorted({b for (_, b) in sym} | {b for (_, b) in ucx})
env = __import__('os').environ
print(f"ucx transport over UCX_TLS={env.get('UCX_TLS')}, symmem's window {env.get('WINDOW')}, medians of runs")
print(f"{'bytes':>10} {'write RTT us':>13} {'put_lat x2 us':>14} {'write GB/s':>11} {'put_bw GB/s':>12} {'bw ratio':>9}"
      f" {'put_bw -O GB/s':>15} {'ratio':>7} {'put+flush RTT us':>17} {'put+flush GB/s':>15} {'ratio':>7}")
for b in sizes:
    w = sym.get(("write", b), [])
    lat = ucx.get(("ucp_put_lat", b), [])
    bw = ucx.get(("ucp_put_bw", b), [])
    bww = ucx.get(("ucp_put_bw_window", b), [])
    wl, ul = med(w, 0), 2 * med(lat, 0)
    wb, ub, uw = med(w, 1), med(bw, 1), med(bww, 1)
    ratio = lambda u: wb / u if u else float('nan')
    fl = flush.get(b, [])
    fr, fb = med(fl, 0), med(fl, 1)
    print(f"{b:>10} {wl:>13.2f} {ul:>14.2f} {wb:>11.4g} {ub:>12.4g} {ratio(ub):>8.2f}x {uw:>15.4g} {ratio(uw):>6.2f}x"
          f" {fr:>17.2f} {fb:>15.4g} {ratio(fb):>6.2f}x")
PY
