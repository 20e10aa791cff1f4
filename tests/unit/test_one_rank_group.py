"""A learner alone (`num_processes: 1`) joins torch.distributed through learner/one_rank_group.py:
every collective DeepSpeed issues in a world of one is done in place, none reaches NCCL (whose communicator would
take GPU memory for nothing to talk to). Each check runs in a fresh process, as the default group is process-wide."""

import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

SCRIPT = r"""
import torch, torch.distributed as dist
from tandem.learner.one_rank_group import ONE_RANK
from tandem.learner.process_group import join_process_group

device = "{device}"
join_process_group(0, 1, None)
assert dist.get_backend() == ONE_RANK and dist.get_world_size() == 1 and dist.get_rank() == 0
x = torch.arange(6.0, device=device)
for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
    dist.all_reduce(x, op=op)
dist.broadcast(x, src=0)
dist.barrier()
assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], x
out = torch.full((6,), -1.0, device=device)
dist.all_gather_into_tensor(out, x)
assert torch.equal(out, x), out
out = torch.full((6,), -1.0, device=device)
dist.reduce_scatter_tensor(out, x)
assert torch.equal(out, x), out
parts = [torch.zeros(6, device=device)]
dist.all_gather(parts, x)
assert torch.equal(parts[0], x)
objs = [None]
dist.all_gather_object(objs, {{"step": 3}})
assert objs == [{{"step": 3}}], objs
sub = dist.new_group(ranks=[0])  # DeepSpeed makes its data-parallel group this way
y = torch.ones(3, device=device)
dist.all_reduce(y, group=sub)
assert y.tolist() == [1.0, 1.0, 1.0] and dist.get_backend(sub) == ONE_RANK
work = dist.all_reduce(y, async_op=True)
work.wait()
from torch.distributed.distributed_c10d import _coalescing_manager  # DeepSpeed's all_gather_coalesced (ZeRO-3)
outs = [torch.full((6,), -1.0, device=device), torch.full((3,), -1.0, device=device)]
with _coalescing_manager(None, device=torch.device(device), async_ops=True) as cm:
    for o, t in zip(outs, (x, y)):
        dist.all_gather_into_tensor(o, t, async_op=True)
cm.wait()
assert torch.equal(outs[0], x) and torch.equal(outs[1], y), outs
try:
    dist.all_reduce(y, op=dist._make_nccl_premul_sum(2.0))
except ValueError as e:
    assert "PREMUL_SUM" in str(e), e
else:
    raise AssertionError("PREMUL_SUM in a group of one went through")
print("ok")
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only: bench/device/cuda_tests.sh"))])
def test_each_collective_of_a_group_of_one_is_done_in_place(device):
    """A wrong copy (output left as it was), a reduction that changes a value, or a group that fell back to gloo or
    NCCL fails here."""
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(device=device)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
