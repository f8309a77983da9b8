"""One rank of the symmetric-memory tests; run under torchrun or `symmem run`. Exits nonzero
on the first failed check; prints "symm worker ok RANK" at the end."""

import numpy as np
import torch
from symmem import symm

g = symm.world()
rank, ws = g.rank, g.world_size

# Allocation and rendezvous.
t = symm.empty(64, dtype=torch.float32)
assert symm.is_symm_mem_tensor(t) and symm.is_symm_mem_tensor(t[8:])
assert not symm.is_symm_mem_tensor(torch.zeros(4))
assert torch.count_nonzero(t) == 0
hdl = symm.rendezvous(t)
assert (hdl.rank, hdl.world_size) == (rank, ws)
assert len(hdl.buffer_ptrs) == ws and hdl.buffer_ptrs[rank] == t.data_ptr()
assert hdl.buffer_size >= 256 and hdl.signal_pad_size > 0
try:
    symm.rendezvous(torch.zeros(4))
    raise AssertionError("rendezvous of a plain tensor must fail")
except ValueError as e:
    assert "symmem.symm.empty" in str(e)

# Peer buffers are views of the peers' memory: writes show up without copies.
t.copy_(torch.arange(64, dtype=torch.float32) + 100 * rank)
hdl.barrier()
for peer in range(ws):
    view = hdl.get_buffer(peer, [64], torch.float32)
    assert torch.equal(view, torch.arange(64, dtype=torch.float32) + 100 * peer), peer
hdl.barrier()
right = (rank + 1) % ws
hdl.get_buffer(right, [4], torch.float32, 60).fill_(-1.0)  # write into the right neighbour
hdl.barrier()
assert torch.equal(t[60:], torch.full((4,), -1.0)), t[60:]
hdl.barrier()

# Signals: a ring of put_signal / wait_signal on the handle and at module level.
left = (rank - 1) % ws
hdl.put_signal(right, channel=1)
hdl.wait_signal(left, channel=1, timeout_ms=10_000)
dst = torch.empty(8, dtype=torch.float32)
symm.get(dst, hdl, left, 8)
assert torch.equal(dst, torch.arange(8, 16, dtype=torch.float32) + 100 * left)
hdl.barrier()
src = torch.full((16,), float(rank))
symm.put_signal(src, hdl, right)
symm.wait_signal(hdl, left)
assert torch.equal(t[:16], torch.full((16,), float(left)))
hdl.barrier()

# Operators, torch tensors.
x = symm.empty(1000, dtype=torch.float32)
x.copy_(torch.arange(1000, dtype=torch.float32) * (rank + 1))
expect = torch.arange(1000, dtype=torch.float32) * sum(range(1, ws + 1))
y = symm.one_shot_all_reduce(x, "sum")
assert torch.equal(y, expect), (y[:4], expect[:4])
out = torch.empty(1000)
symm.one_shot_all_reduce_out(x, "max", None, out)
assert torch.equal(out, torch.arange(1000, dtype=torch.float32) * ws)
symm.two_shot_all_reduce_(x, "sum")
assert torch.equal(x, expect)
z = symm.empty(4096, dtype=torch.int64)
z.fill_(rank + 1)
symm.all_reduce(z, "sum")
assert torch.all(z == ws * (ws + 1) // 2)
try:
    symm.all_reduce(z, "product")
    raise AssertionError("an unknown reduce op must fail")
except ValueError as e:
    assert "product" in str(e)

rs_in = symm.empty(ws * 16, dtype=torch.float32)
rs_in.copy_(torch.arange(ws * 16, dtype=torch.float32) + rank)
rs_out = torch.empty(16)
symm.reduce_scatter_out(rs_in, None, False, rs_out)
full = sum(torch.arange(ws * 16, dtype=torch.float32) + r for r in range(ws))
assert torch.equal(rs_out, full[rank * 16 : (rank + 1) * 16])

ag_in = symm.empty(8, dtype=torch.int32)
ag_in.fill_(rank)
ag_out = torch.empty(ws * 8, dtype=torch.int32)
symm.all_gather_into_tensor(ag_in, None, ag_out)
assert torch.equal(ag_out, torch.arange(ws, dtype=torch.int32).repeat_interleave(8))

b = symm.empty(32, dtype=torch.bfloat16)
b.fill_(float(rank + 7))
symm.broadcast(b, ws - 1)
assert torch.all(b == float(ws + 6))

a_in = symm.empty(ws * 4, dtype=torch.int64)
a_in.copy_(torch.arange(ws * 4) + 1000 * rank)
a_out = symm.empty(ws * 4, dtype=torch.int64)
symm.all_to_all(a_in, a_out)
expect_a2a = torch.cat([torch.arange(rank * 4, rank * 4 + 4) + 1000 * r for r in range(ws)])
assert torch.equal(a_out, expect_a2a), (a_out, expect_a2a)

# Variable-size all-to-all: rank r sends j + 1 rows of width 3, valued 100 r + j, to rank j.
rows_in = ws * (ws + 1) // 2
v_in = symm.empty(rows_in, 3, dtype=torch.float32)
v_in.copy_(torch.cat([torch.full((j + 1, 3), 100.0 * rank + j) for j in range(ws)]))
splits = symm.empty(ws, dtype=torch.int64)
splits.copy_(torch.arange(1, ws + 1))
v_out = torch.full((ws * ws, 3), -1.0)
v_so = torch.zeros(2, ws, dtype=torch.int64)
symm.all_to_all_vdev(v_in, v_out, splits, v_so)
assert torch.equal(v_so[0], torch.full((ws,), rank + 1)), v_so
assert torch.equal(v_so[1], torch.arange(ws) * (rank + 1)), v_so
want = torch.cat([torch.full((rank + 1, 3), 100.0 * p + rank) for p in range(ws)])
assert torch.equal(v_out[: ws * (rank + 1)], want), v_out

# Tile reduce of a strided view into the root's tile.
grid = symm.empty(4, 4, dtype=torch.float64)
grid.fill_(rank + 1)
tile_out = torch.zeros(2, 2, dtype=torch.float64)
symm.tile_reduce(grid[1:3, 2:4], tile_out, 0)
assert torch.all(tile_out == (ws * (ws + 1) // 2 if rank == 0 else 0)), tile_out

# Fused matmuls against torch's own matmul of the gathered / reduced data.
B = torch.arange(12, dtype=torch.float32).view(3, 4)
shard = symm.empty(2, 3, dtype=torch.float32)
shard.copy_(torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank)
A, outs = symm.fused_all_gather_matmul(shard, [B], 0)
gathered = torch.cat([torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r for r in range(ws)])
assert torch.equal(A, gathered) and torch.allclose(outs[0], gathered @ B), outs[0]
mine = torch.ones(ws * 2, 3) * (rank + 1)
rs = symm.fused_matmul_reduce_scatter(mine, B, "sum", 0)
assert rs.shape == (2, 4) and torch.allclose(rs, (torch.ones(2, 3) @ B) * (ws * (ws + 1) // 2)), rs
try:
    symm.all_to_all_vdev(v_in, v_out, torch.ones(ws, dtype=torch.int64), v_so)
    raise AssertionError("non-symmetric splits must be refused")
except ValueError as e:
    assert "in_splits" in str(e)

# NumPy arrays work the same way.
n = symm.empty(256, dtype=np.int32)
assert isinstance(n, np.ndarray) and symm.is_symm_mem_tensor(n)
n[:] = rank + 1
symm.all_reduce(n, "sum")
assert (n == ws * (ws + 1) // 2).all()
nh = symm.rendezvous(n)
nh.barrier()  # the neighbour has written its result too
assert (nh.get_buffer(right, 4, np.int32) == ws * (ws + 1) // 2).all()

# A sub-group of ranks 1 and 0 (in that order): its own rendezvous and operators.
sub = symm.new_group([1, 0])
if rank > 1:
    assert sub is None
else:
    assert (sub.rank, sub.world_size, sub.ranks) == (1 - rank, 2, [1, 0])
    s = symm.empty(100, dtype=torch.float32)
    s.fill_(rank + 1)
    sh = symm.rendezvous(s, sub.group_name)
    assert sh.world_size == 2 and sh.rank == 1 - rank
    symm.all_reduce(s, "sum", sub.group_name)
    assert torch.all(s == 3.0), s
try:
    symm.all_reduce(z, "sum", "no-such-group")
    raise AssertionError("an unknown group must be refused")
except ValueError as e:
    assert "no-such-group" in str(e)

g.barrier(timeout=30)
print(f"symm worker ok {rank}", flush=True)
