"""A torch client against an authenticated symmem store: refused (not hung) unless trusted."""
import datetime
import sys

import torch.distributed as dist

try:
    s = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=datetime.timedelta(seconds=3))
    s.set("k", "v")
    print("ACCEPTED", flush=True)
except Exception as e:
    print(f"REFUSED {type(e).__name__}", flush=True)
