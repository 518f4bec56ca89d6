"""Checkpoints of a replicated state: written once by rank 0, readable on any world size."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from torchfn.distributed._env import world_info
from torchfn.functional import TrainState, save_checkpoint

__all__ = ["save_checkpoint_once"]


def save_checkpoint_once(path: str | os.PathLike[str], state: TrainState, *,
                         group: ProcessGroup | None = None,
                         extra: dict[str, Any] | None = None) -> None:
    """Write the replicated ``state`` once, from rank 0, atomically; returns ``None``.

    A collective: every rank calls it; rank 0 writes with
    :func:`torchfn.functional.save_checkpoint` (temp file, fsync, rename) and a barrier holds
    the others until the file is complete. Data-parallel, meta and DP states are the same on
    every rank, so the file is an ordinary single-process checkpoint: load it with
    :func:`torchfn.functional.load_checkpoint` on each rank of any world size (``map_location``
    = that rank's device), or in one process. (Ensembles, whose members are split over the
    ranks, use :func:`save_ensemble_gathered` / :func:`load_ensemble_shard`.) Per-rank data
    positions belong in ``extra`` only if they mean the same on every world size, e.g. a
    :class:`torchfn.data.StreamingDataset` ``state_dict()`` (a global position).

    Example::

        save_checkpoint_once("ckpt.pt", state, extra={"data": dataset.state_dict()})
        state, extra = load_checkpoint("ckpt.pt", map_location=info.device, optimizer=opt)
    """
    rank, _ = world_info(group, "save_checkpoint_once")
    if rank == 0:
        save_checkpoint(path, state, extra=extra)
    dist.barrier(group)
