"""The outer step of meta-training: meta-gradient plus an outer optimizer update, compile-ready."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torchopt
from torch import Tensor
from torchopt.base import GradientTransformation

from torchfn.functional import TrainState, init_train_state
from torchfn.meta._maml import MetaLearner
from torchfn.meta._tasks import Task

__all__ = ["init_meta_state", "make_meta_train_step"]


def init_meta_state(
    learner: MetaLearner,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    optimizer: GradientTransformation,
    *,
    seed: int | Tensor = 0,
) -> TrainState:
    """Return the initial :class:`torchfn.functional.TrainState` of meta-training.

    ``state.params`` are ``learner.init(params)`` (Meta-SGD's learned rates included), so the
    state saves and loads with :func:`torchfn.functional.save_checkpoint`.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from torchfn.optim import adam
        >>> from torchfn.meta import maml
        >>> learner = maml(lambda p, b, x: (x @ p["w"], b), F.mse_loss)
        >>> state = init_meta_state(learner, {"w": torch.zeros(1, 1)}, {}, adam(1e-3))
        >>> int(state.step)
        0
    """
    return init_train_state(learner.init(params), dict(buffers), optimizer, seed=seed)


def make_meta_train_step(
    learner: MetaLearner, optimizer: GradientTransformation
) -> Callable[[TrainState, Task], tuple[TrainState, dict[str, Tensor]]]:
    """Return ``step(state, tasks) -> (new_state, {"loss": meta_loss})``: one outer update.

    The step computes :meth:`MetaLearner.meta_grad` over the task batch ``tasks`` (task dim
    0), applies ``optimizer`` (e.g. :func:`torchfn.functional.adam`, compile-safe) out of
    place and stores the task-averaged buffers. It is pure, does no host syncs and compiles
    with ``torch.compile(step, fullgraph=True)`` without recompiling between steps (same
    shapes).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from torchfn.optim import adam
        >>> from torchfn.meta import maml, sinusoid_tasks
        >>> learner = maml(lambda p, b, x: (x @ p["w"], b), F.mse_loss)
        >>> opt = adam(1e-2)
        >>> state = init_meta_state(learner, {"w": torch.zeros(1, 1)}, {}, opt)
        >>> step = make_meta_train_step(learner, opt)
        >>> tasks, _, _ = sinusoid_tasks(4, 5, 5, generator=torch.Generator().manual_seed(0))
        >>> state, metrics = step(state, tasks)
        >>> int(state.step), metrics["loss"].shape
        (1, torch.Size([]))
    """
    if not isinstance(learner, MetaLearner):
        raise TypeError(f"make_meta_train_step(learner, ...): expected a MetaLearner, "
                        f"got {type(learner).__name__}")

    def step(state: TrainState, tasks: Task) -> tuple[TrainState, dict[str, Any]]:
        grads, loss, buffers = learner.meta_grad(state.params, state.buffers, tasks)
        updates, opt_state = optimizer.update(
            grads, state.opt_state, params=state.params, inplace=False
        )
        params = torchopt.apply_updates(state.params, updates, inplace=False)
        new_state = state._replace(
            params=params, buffers=buffers, opt_state=opt_state, step=state.step + 1
        )
        return new_state, {"loss": loss}

    return step
