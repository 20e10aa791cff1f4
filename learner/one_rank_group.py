"""torch.distributed's group for a learner alone (`num_processes: 1`): each collective of a group of one done in
place. In a world of one DeepSpeed still broadcasts every parameter at `initialize`, all-reduces the gradients each
step and takes barriers at each save; under NCCL the first of those brings up a communicator, GPU memory held for a
group with no one to talk to (`learner/outside_allocator_gib`). Registered as the backend ONE_RANK on import;
learner/process_group.py joins it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

ONE_RANK = "tandem_one_rank"


def _done(result=None):
    """A collective's handle, already complete."""
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
        dst.copy_(src.reshape(dst.shape))


class OneRankGroup(dist.ProcessGroup):
    """Each collective leaves its tensors as they are, or copies its input into its output where the two differ; no
    reduction changes a value (PREMUL_SUM, the one that would, is refused). The method names are those
    torch.distributed calls: `_allgather_base`/`_reduce_scatter_base` (torch 2.11) and
    `all_gather_single`/`reduce_scatter_single` (2.13)."""

    def __init__(self):
        super().__init__(0, 1)

    def getBackendName(self):
        return ONE_RANK

    def size(self):
        return 1

    def rank(self):
        return 0

    def barrier(self, opts=None):
        return _done()

    def _start_coalescing(self, device):  # torch's _coalescing_manager, as DeepSpeed's all_gather_coalesced uses it
        pass

    def _end_coalescing(self, device):
        return _done()

    def broadcast(self, tensors, opts=None):
        return _done(tensors)

    def allreduce(self, tensors, opts=None):
        if opts is not None and opts.reduceOp == dist.ReduceOp.PREMUL_SUM:
            raise ValueError(f"{ONE_RANK}: all_reduce with PREMUL_SUM; this group does SUM, AVG, MIN, MAX, PRODUCT")
        return _done(tensors)

    allreduce_coalesced = reduce = allreduce

    def allgather(self, outputs, inputs, opts=None):  # outputs [[t]], inputs [t]
        for out, t in zip(outputs, inputs, strict=True):
            _copy(out[0], t)
        return _done(outputs)

    allgather_coalesced = gather = allgather

    def scatter(self, outputs, inputs, opts=None):  # outputs [t], inputs [[t]]
        for out, t in zip(outputs, inputs, strict=True):
            _copy(out, t[0])
        return _done(outputs)

    reduce_scatter = scatter

    def _allgather_base(self, output, input, opts=None):
        _copy(output, input)
        return _done([output])

    all_gather_single = _reduce_scatter_base = reduce_scatter_single = _allgather_base

    def alltoall_base(self, output, input, output_splits=None, input_splits=None, opts=None):
        return self._allgather_base(output, input)

    all_to_all_single = alltoall_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, t in zip(outputs, inputs, strict=True):
            _copy(out, t)
        return _done(outputs)

    all_gather_single_coalesced = reduce_scatter_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_tensor_coalesced = alltoall = allgather_into_tensor_coalesced


if not hasattr(dist.Backend, ONE_RANK.upper()):
    dist.Backend.register_backend(ONE_RANK, lambda store, rank, size, timeout: OneRankGroup(), devices=["cpu", "cuda"])
