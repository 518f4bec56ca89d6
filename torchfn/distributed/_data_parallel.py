"""Data-parallel training: the functional train step with its gradients averaged over ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torchopt.base import GradientTransformation

from torchfn._checks import STEP_INDUCTOR_OPTIONS, _replace
from torchfn.distributed._env import world_info
from torchfn.distributed._reduce import (
    DEFAULT_BUCKET_MB,
    BackwardOverlapReducer,
    all_reduce_tree,
    make_grad_reducer,
)
from torchfn.functional import TrainState, make_train_step

__all__ = ["make_data_parallel_train_step"]

Batch = tuple[Any, Any]
_RANK_SALT = 1_000_003


def make_data_parallel_train_step(
    model_fn: Callable[..., Any],
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: GradientTransformation,
    *,
    group: ProcessGroup | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    sync_buffers: bool = True,
    overlap_backward: bool = False,
    **train_step_kwargs: Any,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Tensor]]]:
    """Return ``step(state, local_batch) -> (new_state, metrics)``, data parallel over ``group``.

    It is :func:`torchfn.functional.make_train_step` (every keyword of it passes through:
    ``grad_accum_steps``, ``max_grad_norm``, ``amp``, ...) with its ``grad_transform`` set to a
    bucketed all-reduce that averages the gradient over the ranks (:func:`all_reduce_tree`).
    Each rank passes its own ``local_batch`` of equal size ``B / W`` (a mean-reduced loss over
    ``W`` equal shards averages to the mean over the global batch of ``B``), e.g. from
    :class:`torchfn.data.StreamingDataset`, which shards by rank. The state is replicated:
    start every rank from the same ``init_train_state`` and they stay equal, since clipping,
    the fp16 finite check and the update all see the same averaged gradient.

    - ``metrics["loss"]`` is averaged over the ranks too (one more small all-reduce);
      ``grad_norm`` is the global gradient's norm.
    - ``sync_buffers`` (default) averages floating-point buffers (BatchNorm running stats)
      over the ranks after the step, so replicas never drift; with batch statistics this is
      not the single-process value over the global batch (as with DDP without SyncBatchNorm).
    - Randomness (dropout): an eager step seeds each rank from ``(seed + rank * 1000003,
      step)``, so ranks draw different masks for their different examples (rank 0 draws what
      a single process would). A compiled step cannot seed itself: wrap it in
      ``with step_rng(rank_state):`` with ``rank_state = state._replace(seed=state.seed +
      rank * 1000003)``.
    - Compiles: ``torch.compile(step, fullgraph=True)`` traces the collectives (functional
      collectives) with the step, in one graph; Inductor can move each bucket's all-reduce up
      into the backward (``torch._inductor.config.reorder_for_compute_comm_overlap``).
    - ``overlap_backward`` (eager): launch each bucket's all-reduce from a gradient hook as
      soon as the backward has produced the bucket's gradients (buckets in reverse parameter
      order), overlapping the communication with the rest of the backward (same numbers).
      Not with ``grad_accum_steps > 1`` (every micro-batch would be reduced). Compiled, the
      flag changes nothing: the bucketed all-reduce is traced (Inductor may move it).

    Example::

        info = init_from_env()                       # torchrun --nproc_per_node 2 ...
        step = make_data_parallel_train_step(model_fn, loss_fn, opt, max_grad_norm=1.0)
        state, metrics = step(state, (x_local, y_local))
    """
    if "grad_transform" in train_step_kwargs:
        raise TypeError("make_data_parallel_train_step(grad_transform=...): the data-parallel "
                        "step sets grad_transform itself (the all-reduce); compose your own "
                        "transform with make_grad_reducer() and call make_train_step instead")
    reducer = make_grad_reducer(group=group, bucket_mb=bucket_mb)
    rank, _ = world_info(group, "make_data_parallel_train_step")
    if overlap_backward:
        accum = train_step_kwargs.get("grad_accum_steps", 1)
        if accum != 1:
            raise ValueError(f"make_data_parallel_train_step(overlap_backward=True, "
                             f"grad_accum_steps={accum}): the gradient hooks would all-reduce "
                             f"every micro-batch ({accum} times the traffic); use "
                             f"overlap_backward=False with gradient accumulation")
        hooks = BackwardOverlapReducer(group=group, bucket_mb=bucket_mb)
        inner = make_train_step(hooks.wrap(model_fn), loss_fn, optimizer,
                                grad_transform=hooks.reduce, **train_step_kwargs)
    else:
        inner = make_train_step(model_fn, loss_fn, optimizer, grad_transform=reducer,
                                **train_step_kwargs)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Tensor]]:
        if overlap_backward and not torch.compiler.is_compiling():
            hooks.begin()
        if rank and not torch.compiler.is_compiling():  # distinct dropout masks per rank
            new_state, metrics = inner(_replace(state, seed=state.seed + _RANK_SALT * rank), batch)
            new_state = _replace(new_state, seed=state.seed)
        else:
            new_state, metrics = inner(state, batch)
        small = {"loss": metrics["loss"]}
        if sync_buffers:
            small.update({f"buffer/{k}": v for k, v in new_state.buffers.items()
                          if torch.is_floating_point(v)})
        reduced = all_reduce_tree(small, op="mean", group=group, bucket_mb=bucket_mb)
        metrics = {**metrics, "loss": reduced["loss"]}
        if sync_buffers:
            buffers = {k: reduced.get(f"buffer/{k}", v) for k, v in new_state.buffers.items()}
            new_state = _replace(new_state, buffers=buffers)
        return new_state, metrics

    step.inductor_options = STEP_INDUCTOR_OPTIONS  # type: ignore[attr-defined]
    return step
