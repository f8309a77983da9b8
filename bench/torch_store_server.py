"""Serve a PyTorch TCPStore on an ephemeral port until killed; print the port first.

Usage: python bench/torch_store_server.py [libuv|legacy]
"""
import sys
import time

import torch.distributed as dist

use_libuv = (sys.argv[1] if len(sys.argv) > 1 else "libuv") != "legacy"
store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=use_libuv, wait_for_workers=False)
print(store.port, flush=True)
while True:
    time.sleep(3600)
