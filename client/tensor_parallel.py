"""Tensor-parallel clients: each process of a ``torch.distributed`` group runs its shard.

``load_model(..., tensor_parallel=True)`` (or a process group) asks the daemon for this rank's
shard (``Client.shard``: column-split q/k/v/gate/up, row-split o/down, the rest replicated;
``store.shard``) and binds it like any model. The model code is the stock ``transformers`` one:
attention reshapes with ``-1`` heads, so a shard's local heads run unchanged; only the two
row-split projections of each layer produce partial sums, which one forward hook each adds up
across the group (``all_reduce``, in place). Every rank then holds the same hidden states and,
with the replicated head, the same logits.
"""
from __future__ import annotations

from ..errors import ShardError
from ..store.shard import ROW


def group_of(tensor_parallel):
    """(group, rank, world) for ``tensor_parallel`` (True: the default group, or a group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ShardError("tensor_parallel: torch.distributed is not initialised in this process "
                         "(call torch.distributed.init_process_group first)", dimension="group")
    group = None if tensor_parallel is True else tensor_parallel
    return group, dist.get_rank(group), dist.get_world_size(group)


def install(model, group, rank: int, world: int) -> list:
    """The ``all_reduce`` hooks on every row-split projection; returns their handles. Checks that
    the bound model is this rank's shard (its config says so)."""
    import torch.distributed as dist

    mark = getattr(model.config, "flash_tensor_parallel", None) or {}
    if (mark.get("rank"), mark.get("world")) != (rank, world):
        raise ShardError(f"tensor_parallel: the model bound is shard {mark.get('rank')} of "
                         f"{mark.get('world')}, not {rank} of {world}", world=world, rank=rank,
                         dimension="rank")

    def reduce(module, args, output):
        dist.all_reduce(output, group=group)
        return output

    return [module.register_forward_hook(reduce) for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] in ROW]
