"""Every TCPStore call of a PyTorch client against the store at HOST:PORT.

Prints one `name=repr(result)` line per call, so the same script run against symmem's server
and against PyTorch's own can be compared line by line. Exits non-zero on any failure.
Usage: python client_ops.py HOST PORT [--no-queues]
"""
import datetime
import sys
import threading
import time

import torch.distributed as dist

host, port = sys.argv[1], int(sys.argv[2])
queues = "--no-queues" not in sys.argv
s = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=20))


def show(name, value):
    print(f"{name}={value!r}", flush=True)


s.set("k1", "v1")
show("get", s.get("k1"))
show("add_new", s.add("cnt", 7))
show("add_neg", s.add("cnt", -10))
show("get_cnt", s.get("cnt"))
show("cas_absent_nonempty", s.compare_set("cs", "x", "y"))
show("cas_absent_empty", s.compare_set("cs", "", "first"))
show("cas_mismatch", s.compare_set("cs", "nope", "second"))
show("cas_match", s.compare_set("cs", "first", "second"))
show("check_present", s.check(["k1", "cnt"]))
show("check_missing", s.check(["k1", "missing"]))
s.append("log", "ab")
s.append("log", "cd")
show("append", s.get("log"))
s.multi_set(["m1", "m2"], ["1", "22"])
show("multi_get", s.multi_get(["m2", "m1"]))
n = s.num_keys()
show("delete_present", s.delete_key("m2"))
show("delete_absent", s.delete_key("m2"))
show("num_keys_delta", n - s.num_keys())
show("list_keys", sorted(s.list_keys()))
s.wait(["k1"])
t = time.time()
try:
    s.wait(["never"], datetime.timedelta(milliseconds=200))
    show("wait_timeout", "no error")
except Exception as e:  # DistStoreError
    show("wait_timeout", type(e).__name__)
show("after_timeout", s.get("k1"))

# A wait on one client woken by a set from another client.
other = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=20))
woken = []
waiter = threading.Thread(target=lambda: woken.append(s.get("late")))
waiter.start()
time.sleep(0.2)
other.set("late", "now")
waiter.join(10)
show("woken", woken)

# barrier across two clients (the store's BARRIER request)
done = []
b = threading.Thread(target=lambda: done.append(other.barrier("bk", 2) if hasattr(other, "barrier") else None))
b.start()
s.barrier("bk", 2)
b.join(10)
show("barrier", len(done))

if queues:
    s.queue_push("q", "x")
    s.queue_push("q", "y")
    show("queue_len", s.queue_len("q"))
    show("queue_pop", s.queue_pop("q"))
    show("queue_pop_nonblocking", s.queue_pop("q", block=False))
    try:
        s.queue_pop("q", block=False)
        show("queue_pop_empty", "no error")
    except Exception as e:
        show("queue_pop_empty", type(e).__name__)
show("done", True)
