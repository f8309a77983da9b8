"""The per-call lookup of a tensor's symmetric buffer (cached by address) stays right while
buffers die and new ones take their addresses, for views, and for empty tensors."""

import gc, torch
from symmem import symm
for i in range(200):
    n = 4 + (i % 7) * 1000
    t = symm.empty(n, dtype=torch.float32)
    t.fill_(1.0)
    symm.all_reduce(t)
    v = t[n//2:]
    symm.all_reduce(v)
    assert t[0].item() == 1.0 and v[0].item() == 1.0
    assert symm._find(t.data_ptr())[1].nbytes() == n * 4, (i, n)
    del t, v
    gc.collect()
e = symm.empty(0, dtype=torch.float32)
assert symm.all_reduce(e) is e
try:
    symm.all_reduce(torch.zeros(4))
    raise SystemExit("not refused")
except ValueError as err:
    print("refused:", err)
print("lookup worker ok")
