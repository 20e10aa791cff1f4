"""How the learner's ranks find each other. Rank 0 opens torch.distributed's store on a port that its own node's
kernel picks and that it holds from then on; the other ranks join it at rank 0's node address. A port chosen by
binding a probe socket and closing it (the env:// rendezvous fed a "free" port) can be taken by any other process's
outgoing connection before the store listens on it (EADDRINUSE); and an address taken on the process that starts the
actors is the wrong node's wherever Ray puts rank 0 elsewhere."""

from __future__ import annotations

import os

import torch

from tandem.learner.one_rank_group import ONE_RANK


def open_store(world: int):
    """Rank 0's store, listening on every interface of this node at a port the kernel picked (its `.port`)."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)


def join_process_group(rank: int, world: int, address: tuple[str, int] | None, store=None) -> None:
    """This rank in the default process group: rank 0 through `store` (open_store's), another rank through rank 0's
    `address` (host, port); a rank alone through a group of one that needs no rendezvous. A process whose default
    group already exists (the colocated worker: vLLM's group of one) keeps it."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if dist.is_initialized():
        return
    forget_stale_deepspeed_groups()
    if world == 1:  # nothing to communicate: each collective done in place (learner/one_rank_group.py)
        dist.init_process_group(ONE_RANK, store=store or dist.HashStore(), rank=0, world_size=1,
                                timeout=default_pg_timeout)
        return
    if rank == 0 and store is None:
        raise ValueError(f"learner rank 0 of {world}: no store; Learner.rendezvous() opens it before setup()")
    if rank != 0:
        if address is None:
            raise ValueError(f"learner rank {rank} of {world}: setup() needs rank 0's rendezvous address (host, port)")
        host, port = address
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=default_pg_timeout)
    kwargs = {}
    if torch.cuda.is_available():  # binds the rank's GPU to its communicator, as DeepSpeed's own init does
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=rank, world_size=world,
                            timeout=default_pg_timeout, **kwargs)


def forget_stale_deepspeed_groups() -> None:
    """DeepSpeed caches the groups it made (its world group among them) and forgets them only when its own
    destroy_process_group runs. Where torch's was called instead (a transformers or TRL trainer earlier in the same
    process ends that way), the cache outlives the groups, and the next engine fails on one torch no longer knows
    ("Group ... is not registered"). Called before this process's default group is made anew."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)
