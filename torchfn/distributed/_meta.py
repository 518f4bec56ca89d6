"""Distributed meta-learning: a meta-batch's tasks split over ranks, meta-gradients averaged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torchopt.base import GradientTransformation

from torchfn._checks import STEP_INDUCTOR_OPTIONS, _check_rank, _leading_size, _replace
from torchfn.distributed._env import world_info
from torchfn.distributed._reduce import DEFAULT_BUCKET_MB, all_reduce_tree
from torchfn.functional import TrainState
from torchfn.meta import MetaLearner, Task, make_meta_train_step

__all__ = ["make_distributed_meta_train_step", "shard_tasks"]


def shard_tasks(tasks: Task, *, rank: int, world_size: int) -> Task:
    """Return rank ``rank``'s tasks of a meta-batch: tasks ``[r T/W, (r+1) T/W)`` (task dim 0).

    ``T`` must be divisible by ``world_size`` (``ValueError`` naming both otherwise), so every
    rank holds the same number of tasks and the mean of the ranks' meta-gradients is the
    meta-gradient of the whole meta-batch. Dict (pytree) fields are sharded leaf by leaf.

    Example:
        >>> import torch
        >>> from torchfn.meta import sinusoid_tasks
        >>> tasks, _, _ = sinusoid_tasks(8, 5, 5, generator=torch.Generator().manual_seed(0))
        >>> shard_tasks(tasks, rank=1, world_size=2).support_x.shape
        torch.Size([4, 5, 1])
    """
    n = _leading_size(tasks.support_x, "shard_tasks(tasks)", "tasks.support_x")
    _check_rank(world_size, rank, "shard_tasks")
    if n % world_size:
        raise ValueError(f"shard_tasks(tasks, world_size={world_size}): the meta-batch has "
                         f"{n} tasks, not divisible by the world size; use a meta-batch that "
                         f"is a multiple of {world_size}")
    per = n // world_size
    lo, hi = rank * per, (rank + 1) * per
    return Task(*(optree.tree_map(lambda t: t[lo:hi], f) for f in tasks))


def make_distributed_meta_train_step(
    learner: MetaLearner,
    optimizer: GradientTransformation,
    *,
    group: ProcessGroup | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    **meta_step_kwargs: Any,
) -> Callable[[TrainState, Task], tuple[TrainState, dict[str, Tensor]]]:
    """Return ``step(state, local_tasks) -> (new_state, metrics)``: one distributed outer update.

    The distributed twin of :func:`torchfn.meta.make_meta_train_step` (every keyword of it
    passes through: ``max_grad_norm``, ``amp``, ``trainable``, ``grad_accum_steps``, ...):
    each rank computes :meth:`MetaLearner.meta_grad` over its ``local_tasks`` (``T / W``
    tasks, task dim 0, e.g. :func:`shard_tasks`; every rank the same count), the
    meta-gradients are averaged over the ranks (a bucketed all-reduce, before unscaling,
    clipping and the non-finite check, so every rank takes the same decision), the outer
    ``optimizer`` updates the replicated state, and the meta-loss and floating-point buffers
    are averaged too. Equal to the single-process step over all ``T`` tasks (up to float
    rounding); integer buffers stay as each rank computed them. Pure; compiles with
    ``torch.compile(step, fullgraph=True)``.

    Example::

        step = make_distributed_meta_train_step(maml(model_fn, F.mse_loss), adam(1e-3))
        state, metrics = step(state, shard_tasks(tasks, rank=rank, world_size=world))
    """
    if not isinstance(learner, MetaLearner):
        raise TypeError(f"make_distributed_meta_train_step(learner, ...): expected a "
                        f"MetaLearner, got {type(learner).__name__}")
    if "grad_transform" in meta_step_kwargs:
        raise TypeError("make_distributed_meta_train_step(grad_transform=...): the distributed "
                        "step sets grad_transform itself (the all-reduce)")
    world_info(group, "make_distributed_meta_train_step")

    def reduce(grads: dict[str, Tensor]) -> dict[str, Tensor]:
        return all_reduce_tree(grads, op="mean", group=group, bucket_mb=bucket_mb)

    inner = make_meta_train_step(learner, optimizer, grad_transform=reduce, **meta_step_kwargs)

    def step(state: TrainState, tasks: Task) -> tuple[TrainState, dict[str, Any]]:
        new_state, metrics = inner(state, tasks)
        small = {"loss": metrics["loss"]}
        small.update({f"buffer/{k}": v for k, v in new_state.buffers.items()
                      if torch.is_floating_point(v)})
        red = all_reduce_tree(small, op="mean", group=group, bucket_mb=bucket_mb)
        buffers = {k: red.get(f"buffer/{k}", v) for k, v in new_state.buffers.items()}
        return _replace(new_state, buffers=buffers), {**metrics, "loss": red["loss"]}

    step.inductor_options = STEP_INDUCTOR_OPTIONS  # type: ignore[attr-defined]
    return step
