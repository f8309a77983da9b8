"""symm operators remember the native view they made last; a tensor that keeps its address but
changes its layout in place (as_strided_, resize_, a view of another shape or dtype) must get a
new one, and a dead buffer must not stay remembered. Two ranks, so the layout shows in sums."""

import gc
import os

import torch

from symmem import symm

rank = int(os.environ["RANK"])
t = symm.empty(8, dtype=torch.float32)


def reset():
    t.as_strided_((8,), (1,))
    t.fill_(rank + 1.0)


reset()
symm.all_reduce(t)
assert t.tolist() == [3.0] * 8, t

# Same object, same address, every other element: all_reduce takes contiguous tensors only,
# so the new layout is refused (the remembered contiguous one would have been reduced whole).
reset()
symm.all_reduce(t)  # remembered with the whole layout
reset()
t.as_strided_((4,), (2,))
try:
    symm.all_reduce(t)
    raise SystemExit("a strided layout was not seen")
except ValueError as e:
    assert "contiguous" in str(e), e
t.as_strided_((8,), (1,))
assert t.tolist() == [rank + 1.0] * 8, t

# Same address, fewer elements.
reset()
symm.all_reduce(t)
reset()
t.resize_(3)
symm.all_reduce(t)
t.as_strided_((8,), (1,))
assert t.tolist() == [3.0] * 3 + [rank + 1.0] * 5, t

# Same address, another shape and then another dtype over the same bytes.
reset()
symm.all_reduce(t)
reset()
symm.all_reduce(t.view(2, 4)[:1])
assert t.tolist() == [3.0] * 4 + [rank + 1.0] * 4, t
reset()
symm.all_reduce(t)
ints = t.view(torch.int32)
ints.fill_(rank + 1)
symm.all_reduce(ints)
assert ints.tolist() == [3] * 8, ints

# The buffer's death forgets the remembered view (nothing holds freed memory).
assert symm._last_native is not symm._NO_NATIVE
del t, ints
gc.collect()
assert symm._last_native is symm._NO_NATIVE, symm._last_native
print("layout worker ok")
