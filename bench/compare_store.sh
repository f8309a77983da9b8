#!/usr/bin/env bash
# symmem's store server against PyTorch's TCPStore servers (libuv and legacy), measured in one
# run by the same client (`symmem bench store --addr`). Needs a Python with torch:
#   PYTHON=/path/to/venv/bin/python bench/compare_store.sh [extra symmem bench store args]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
cargo build --release -q
BIN=target/release/symmem
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--clients 1,16,64 --ranks 16,128,1024 --per-key-max 128)

echo "== symmem server"
"$BIN" bench store "${ARGS[@]}"
for backend in libuv legacy; do
    coproc SERVER { exec "$PYTHON" bench/torch_store_server.py "$backend"; }
    read -r port <&"${SERVER[0]}"
    echo "== PyTorch TCPStore ($backend) on port $port"
    "$BIN" bench store --addr "127.0.0.1:$port" "${ARGS[@]}" | grep -v '^tcp_pingpong' || true
    kill "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null || true
done
