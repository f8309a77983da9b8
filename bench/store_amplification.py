#!/usr/bin/env python3
"""The store's memory and CPU under small requests that ask for a lot (issue 13, items 2-3):
a 12 KB MULTI_GET naming one 8 MiB value 1,000 times, 300 pipelined GETs of it whose replies
are never read, 16 APPENDs of 8 MiB, and two connections streaming 256 MiB MULTI_SETs before
(not) authenticating. Prints the server's resident memory and CPU time after each, and
whether a well-behaved client is still served.

    python3 bench/store_amplification.py [path/to/symmem]   # default: target/release/symmem

Stdlib only; runs any symmem build (older ones have no --no-auth: the script notices), so a
build from before the bounds can be compared with one after. Each step gets a fresh server.
"""

import os
import socket
import struct
import subprocess
import sys
import threading
import time

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/symmem"
MIB = 1 << 20
VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)


def bytes_field(b):
    return struct.pack("<Q", len(b)) + b


def start(secret=None):
    args = [BIN, "store", "--host", "127.0.0.1", "--port", "0"]
    env = dict(os.environ, SYMMEM_LOG="error")
    env.pop("SYMMEM_STORE_SECRET", None)
    if secret:
        env["SYMMEM_STORE_SECRET"] = secret
    elif "--no-auth" in subprocess.run([BIN, "store", "--help"], capture_output=True, text=True).stdout:
        args.append("--no-auth")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    host, port = p.stdout.readline().split()[4].rsplit(":", 1)
    return p, (host, int(port))


def rss_mib(p):
    with open(f"/proc/{p.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return -1


def cpu_s(p):
    with open(f"/proc/{p.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def conn(addr):
    s = socket.create_connection(addr)
    s.sendall(VALIDATE)
    return s


def served(addr, timeout=5.0):
    """Whether a fresh client gets a PING answered within `timeout`."""
    try:
        s = conn(addr)
        s.settimeout(timeout)
        s.sendall(b"\x0d" + struct.pack("<I", 7))
        return s.recv(4) == struct.pack("<I", 7)
    except OSError:
        return False


def set_big(addr):
    s = conn(addr)
    s.sendall(b"\x01" + bytes_field(b"/big") + bytes_field(b"\x07" * (8 * MIB)))
    s.sendall(b"\x07")  # GETNUMKEYS: its answer means the SET was applied
    s.recv(8)
    return s


def step(name, run, secret=None):
    p, addr = start(secret)
    try:
        before = rss_mib(p)
        t0 = cpu_s(p)
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.is_set() and p.poll() is None:
                peak[0] = max(peak[0], rss_mib(p))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        note = run(addr)
        time.sleep(1.0)
        done.set()
        sampler.join()
        alive = p.poll() is None
        ok = alive and served(addr)
        cpu = cpu_s(p) - t0 if alive else float("nan")
        status = "served others" if ok else ("DIED" if not alive else "STALLED")
        print(f"{name:<44} RSS {before:>5} -> peak {peak[0]:>6} MiB  CPU {cpu:6.2f} s  {status}  {note}")
    finally:
        p.kill()
        p.wait()


def multi_get(addr):
    keep = set_big(addr)
    s = conn(addr)
    s.sendall(b"\x0a" + struct.pack("<Q", 1000) + bytes_field(b"/big") * 1000)
    s.settimeout(2)
    try:
        got = len(s.recv(1 << 16))
    except OSError:
        got = 0
    keep.close()
    return f"(first read: {got} bytes)"


def pipelined_gets(addr):
    keep = set_big(addr)
    s = conn(addr)
    s.sendall((b"\x03" + bytes_field(b"/big")) * 300)
    time.sleep(1.0)
    keep.close()
    return "(replies unread)"


def appends(addr):
    s = conn(addr)
    for _ in range(16):
        try:
            s.sendall(b"\x09" + bytes_field(b"/grown") + bytes_field(b"\x01" * (8 * MIB)))
        except OSError:
            return "(connection closed by the server)"
    s.sendall(b"\x03" + bytes_field(b"/grown"))
    s.settimeout(5)
    try:
        n = struct.unpack("<Q", s.recv(8))[0]
        return f"(value now {n // MIB} MiB)"
    except (OSError, struct.error):
        return "(connection closed by the server)"


def unauthenticated_streams(addr):
    pair = b"".join([bytes_field(b"k"), bytes_field(b"\x00" * (8 * MIB))])
    sent = []

    def stream():
        s = conn(addr)
        n = 0
        try:
            s.sendall(b"\x0b" + struct.pack("<Q", 131072))
            while n < 256 * MIB:
                s.sendall(pair)
                n += len(pair)
        except OSError:
            pass
        sent.append(n)

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return f"(each sent {max(sent) // MIB} MiB before the server closed it)"


if __name__ == "__main__":
    print(f"store under amplification requests: {BIN}")
    step("MULTI_GET of one 8 MiB key x1000 (12 KB)", multi_get)
    step("300 pipelined GETs of 8 MiB, never read", pipelined_gets)
    step("16 APPENDs of 8 MiB", appends)
    # Authenticated servers trust this user's local processes: the streams are judged as a
    # stranger's only on a server that does not (older builds), or from another user.
    if os.geteuid() == 0 and hasattr(os, "setresuid"):
        def as_nobody(addr):
            pid = os.fork()
            if pid == 0:
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                print("  " + unauthenticated_streams(addr), flush=True)
                os._exit(0)
            os.waitpid(pid, 0)
            return "(as nobody)"

        step("2 unauthenticated 256 MiB MULTI_SETs", as_nobody, secret="job secret")
