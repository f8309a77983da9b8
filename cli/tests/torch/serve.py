"""Serve a PyTorch TCPStore (libuv or legacy) on an ephemeral port; print the port; serve until
stdin closes. Usage: python serve.py libuv|legacy"""
import sys

import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=sys.argv[1] != "legacy", wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()
