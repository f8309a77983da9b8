#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets/: one per decoder of bytes from the network) for
# SECONDS each (default 30), and fails if any input crashes one. `fuzz/run.sh SECONDS dev`
# builds the targets unoptimized (1 min 20 s instead of 3 min 50 s on 2 cores, a tenth of the
# inputs per second: the descriptor target ran 60,738 inputs in 10 s against 631,383), which
# the test command in README.md does; without it they build optimized. Needs cargo-fuzz
# (`cargo install cargo-fuzz`; .ci/run installs it); without it, says SKIPPED and succeeds.
# Crashing inputs are left in fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-30}"
profile=(-O)
case "${2:-}" in
    dev) profile=(--dev) ;;
    "") ;;
    *) echo "usage: fuzz/run.sh [SECONDS] [dev]" >&2; exit 2 ;;
esac
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "SKIPPED fuzzing: cargo-fuzz is not installed (cargo install cargo-fuzz)"
    exit 0
fi
# cargo-fuzz builds with sanitizers, which need nightly flags; the stable toolchain takes them
# with RUSTC_BOOTSTRAP.
export RUSTC_BOOTSTRAP=1
cargo fuzz build "${profile[@]}"
for target in $(cargo fuzz list); do
    mkdir -p "corpus/$target"
    seeds=()
    [ -d "seeds/$target" ] && seeds=("seeds/$target")
    log="$(mktemp)"
    if ! cargo fuzz run "${profile[@]}" "$target" "corpus/$target" "${seeds[@]}" -- \
        -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        tail -n 40 "$log"
        echo "fuzz target $target FAILED (crashing input in fuzz/artifacts/$target/)"
        rm -f "$log"
        exit 1
    fi
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    echo "fuzz $target: $runs inputs in ${secs}s, no crash"
    rm -f "$log"
done
