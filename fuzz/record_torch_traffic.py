"""Record what a PyTorch TCPStore client sends, as seeds for the store_request fuzz target.

A proxy in front of a symmem store (started by the caller) saves every client-to-server byte
stream, one file per connection. Usage:
    python fuzz/record_torch_traffic.py STORE_PORT OUT_DIR -- python cli/tests/torch/client_ops.py 127.0.0.1 {port}
"""
import os
import socket
import subprocess
import sys
import threading

store_port, out_dir = int(sys.argv[1]), sys.argv[2]
cmd = sys.argv[sys.argv.index("--") + 1 :]
os.makedirs(out_dir, exist_ok=True)
lsock = socket.socket()
lsock.bind(("127.0.0.1", 0))
lsock.listen(64)
port = lsock.getsockname()[1]


def pump(src, dst, record):
    try:
        while True:
            b = src.recv(65536)
            if not b:
                break
            if record is not None:
                record.write(b)
                record.flush()
            dst.sendall(b)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def accept():
    n = 0
    while True:
        try:
            c, _ = lsock.accept()
        except OSError:
            return
        s = socket.create_connection(("127.0.0.1", store_port))
        rec = open(os.path.join(out_dir, f"torch_client_{n}.bin"), "wb")
        n += 1
        threading.Thread(target=pump, args=(c, s, rec), daemon=True).start()
        threading.Thread(target=pump, args=(s, c, None), daemon=True).start()


threading.Thread(target=accept, daemon=True).start()
code = subprocess.call([a.replace("{port}", str(port)) for a in cmd])
sys.exit(code)
