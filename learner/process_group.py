"""How the learner's ranks find each other. Rank 0 opens torch.distributed's store on a port that its own node's
kernel picks and that it holds from then on; the other ranks join it at rank 0's node address. A port chosen by
binding a probe socket and closing it (the env:// rendezvous fed a "free" port) can be taken by any other process's
outgoing connection before the store listens on it (EADDRINUSE); and an address taken on the process that starts the
actors is the wrong node's wherever Ray puts rank 0 elsewhere."""

from __future__ import annotations

import os

import torch


def open_store(world: int):
    """Rank 0's store, listening on every interface of this node at a port the kernel picked (its `.port`)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)


def join_process_group(rank: int, world: int, address: tuple[str, int] | None, store=None) -> None:
    """This rank in the default process group: rank 0 through `store` (open_store's, or one of its own when the
    group is this rank alone), another rank through rank 0's `address` (host, port). A process whose default group
    already exists (the colocated worker: vLLM's group of one) keeps it."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if dist.is_initialized():
        return
    if rank == 0 and store is None:
        if world != 1:
            raise ValueError(f"learner rank 0 of {world}: no store; Learner.rendezvous() opens it before setup()")
        store = open_store(1)
    if rank != 0:
        if address is None:
            raise ValueError(f"learner rank {rank} of {world}: setup() needs rank 0's rendezvous address (host, port)")
        host, port = address
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=default_pg_timeout)
    if world == 1:  # no communicator to build: every collective of a group of one is done in place (OneRankGroup)
        dist.init_process_group(ONE_RANK, store=store, rank=0, world_size=1, timeout=default_pg_timeout)
        return
    cuda = torch.cuda.is_available()
    kwargs = {}
    if cuda and world > 1:  # binds the rank's GPU to its communicator, as DeepSpeed's own init does
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                            timeout=default_pg_timeout, **kwargs)


ONE_RANK = "tandem_one_rank"


def _done(result=None):
    """A collective's handle, already complete."""
    from torch._C._distributed_c10d import _create_work_from_future
    from torch.futures import Future

    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
        dst.copy_(src.reshape(dst.shape))


def _one_rank_group_class():
    import torch.distributed as dist

    class OneRankGroup(dist.ProcessGroup):
        """torch.distributed's group for a learner alone. Each collective of a group of one leaves its tensors as they
        are, or copies its input into its output where the two differ; no reduction changes a value (PREMUL_SUM, the
        one that would, is refused). In a world of one DeepSpeed still broadcasts every parameter at `initialize`,
        all-reduces the gradients each step and takes barriers at each save: under NCCL the first of those brings up a
        communicator, half a GiB of the GPU for nothing to talk to (`learner/outside_allocator_gib`). The method names
        are those torch.distributed calls: `_allgather_base`/`_reduce_scatter_base` (torch 2.11) and
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

        def reduce_scatter(self, outputs, inputs, opts=None):
            return self.scatter(outputs, inputs)

        def _allgather_base(self, output, input, opts=None):
            _copy(output, input)
            return _done([output])

        all_gather_single = _reduce_scatter_base = reduce_scatter_single = _allgather_base

        def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
            for out, t in zip(outputs, inputs, strict=True):
                _copy(out, t)
            return _done(outputs)

        all_gather_single_coalesced = reduce_scatter_single_coalesced = allgather_into_tensor_coalesced
        reduce_scatter_tensor_coalesced = allgather_into_tensor_coalesced

        def alltoall_base(self, output, input, output_splits=None, input_splits=None, opts=None):
            _copy(output, input)
            return _done([output])

        all_to_all_single = alltoall_base

        def alltoall(self, outputs, inputs, opts=None):
            return self.allgather_into_tensor_coalesced(outputs, inputs)

    return OneRankGroup


def _register_one_rank_group() -> None:
    import torch.distributed as dist

    if not hasattr(dist.Backend, ONE_RANK.upper()):
        group = _one_rank_group_class()
        dist.Backend.register_backend(ONE_RANK, lambda store, rank, size, timeout: group(), devices=["cpu", "cuda"])


_register_one_rank_group()
