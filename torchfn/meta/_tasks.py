"""Task batches for meta-learning: the :class:`Task` container, sinusoid tasks, episode stacking."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

__all__ = ["Task", "sinusoid_tasks", "stack_episodes"]


class Task(NamedTuple):
    """A batch of tasks (task dim 0), or one task: support and query inputs and targets.

    Fields: ``support_x (T, K, ...)``, ``support_y (T, K, ...)``, ``query_x (T, Q, ...)``,
    ``query_y (T, Q, ...)``. A field may also be a dict (any pytree) of such tensors, e.g.
    Hugging Face inputs ``support_x={"input_ids": (T, K, L), "attention_mask": (T, K, L)}``;
    every leaf has the task dim 0 and the sample dim 1. A pytree, so it goes through ``vmap``,
    ``torch.compile`` and ``torch.utils._pytree`` as it is.
    """

    support_x: Any
    support_y: Any
    query_x: Any
    query_y: Any


def _field_leaves(tasks: Task, name: str, call: str) -> list[tuple[str, Tensor]]:
    """Return ``(label, tensor)`` for every leaf of field ``name`` (``tasks.x['key']``)."""
    value = getattr(tasks, name)
    paths = optree.tree_paths(value, none_is_leaf=True)
    leaves = optree.tree_leaves(value, none_is_leaf=True)
    if not leaves:
        raise ValueError(f"{call}: tasks.{name} holds no tensors (an empty "
                         f"{type(value).__name__}); expected a tensor or a dict of tensors")
    out = []
    for path, leaf in zip(paths, leaves, strict=True):
        label = f"tasks.{name}" + "".join(f"[{k!r}]" for k in path)
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{call}: {label} must be a tensor (or a dict of tensors), got "
                            f"{type(leaf).__name__}")
        if leaf.dim() < 2:
            raise ValueError(
                f"{call}: {label} has shape {tuple(leaf.shape)}; expected (T, n, ...): "
                "a task dim 0, then the samples of each task"
            )
        out.append((label, leaf))
    return out


def n_tasks(tasks: Task) -> int:
    """Return the number of tasks ``T`` (dim 0 of the first leaf of ``support_x``; private)."""
    return optree.tree_leaves(tasks.support_x, none_is_leaf=True)[0].shape[0]


def wrt_names(meta_params: Mapping[str, Tensor], wrt: Collection[str] | None,
              call: str) -> list[str]:
    """The meta-params ``meta_grad(wrt=...)`` differentiates, in ``meta_params`` order (all for
    ``None``); names that are not meta-params raise (a typo gave an empty gradient dict)."""
    if wrt is None:
        return list(meta_params)
    unknown = sorted(set(wrt) - set(meta_params))
    if unknown:
        raise ValueError(f"{call}(wrt=...): names {unknown} are not meta-params; the "
                         f"meta-params are {list(meta_params)}")
    return [k for k in meta_params if k in wrt]


def check_task_batch(tasks: object, call: str) -> None:
    """Raise unless ``tasks`` is a :class:`Task` batch with consistent shapes (private helper).

    Every leaf of every field is a tensor ``(T, n, ...)`` with the same number of tasks
    ``T >= 1``; the support inputs and targets have the same number of samples ``K >= 1``, and
    so do the query ones (``Q >= 1``). ``call`` restates the caller in the message
    (``"maml(...).meta_grad(...)"``); a dict leaf is named with its key
    (``tasks.support_x['attention_mask']``).
    """
    if not isinstance(tasks, Task):
        raise TypeError(
            f"{call}: expected tasks as a Task(support_x, support_y, query_x, query_y) batch "
            f"(task dim 0), got {type(tasks).__name__}"
        )
    fields = {name: _field_leaves(tasks, name, call) for name in Task._fields}
    shapes = {label: tuple(leaf.shape) for leaves in fields.values() for label, leaf in leaves}
    listing = ", ".join(f"{k.removeprefix('tasks.')} {v}" for k, v in shapes.items())
    count = next(iter(shapes.values()))[0]
    if any(v[0] != count for v in shapes.values()):
        raise ValueError(
            f"{call}: the fields of tasks have different numbers of tasks (dim 0): {listing}; "
            "every field needs the same number of tasks"
        )
    if count == 0:
        raise ValueError(f"{call}: tasks holds zero tasks ({listing}); expected at least one")
    for x, y in (("support_x", "support_y"), ("query_x", "query_y")):
        labels = [label for label, _ in fields[x] + fields[y]]
        sizes = [shapes[label][1] for label in labels]
        if any(size != sizes[0] for size in sizes):
            seen = " and ".join(f"{label} {shapes[label]}" for label in labels)
            raise ValueError(
                f"{call}: {seen} have different numbers of samples per task (dim 1); each "
                "input needs its target, and every leaf of a dict field the same samples"
            )
        if sizes[0] == 0:
            raise ValueError(f"{call}: {labels[0]} {shapes[labels[0]]} has no samples per task "
                             "(dim 1)")
    sx, qx = tasks.support_x, tasks.query_x
    if isinstance(sx, Mapping) != isinstance(qx, Mapping) or (
            isinstance(sx, Mapping) and isinstance(qx, Mapping) and set(sx) != set(qx)):
        def keys(x: object) -> str:
            return str(sorted(x)) if isinstance(x, Mapping) else type(x).__name__
        # the model would run differently on the two (e.g. a query without its attention mask)
        raise ValueError(f"{call}: tasks.support_x and tasks.query_x must be the same kind of "
                         f"input, got keys {keys(sx)} and {keys(qx)}")


def sinusoid_tasks(
    n_tasks: int,
    k_support: int,
    k_query: int,
    *,
    generator: torch.Generator,
    amplitude: tuple[float, float] = (0.1, 5.0),
    phase: tuple[float, float] = (0.0, math.pi),
    x_range: tuple[float, float] = (-5.0, 5.0),
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[Task, Tensor, Tensor]:
    """Return ``(tasks, amplitudes (T,), phases (T,))``: sinusoid regression tasks (MAML paper).

    Task ``t`` is ``y = a_t * sin(x - b_t)`` with ``a_t ~ U(amplitude)``, ``b_t ~ U(phase)`` and
    ``x ~ U(x_range)``; ``tasks.support_x`` is ``(T, k_support, 1)``, ``query_x`` ``(T, k_query,
    1)`` and the targets have the same shapes. All draws come from ``generator`` (a CPU
    generator; tensors are moved to ``device`` afterwards), so equal seeds give equal tasks.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> tasks, amp, ph = sinusoid_tasks(25, 10, 10, generator=g)
        >>> tuple(tasks.support_x.shape), tuple(amp.shape)
        ((25, 10, 1), (25,))
    """
    for name, value in (("n_tasks", n_tasks), ("k_support", k_support), ("k_query", k_query)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"sinusoid_tasks({name}=...): expected an int >= 1, got {value!r}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"sinusoid_tasks(generator=...): expected a torch.Generator, got {type(generator)}"
        )

    def uniform(shape: tuple[int, ...], lo_hi: tuple[float, float]) -> Tensor:
        lo, hi = lo_hi
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        return lo + (hi - lo) * u

    amp = uniform((n_tasks,), amplitude)
    ph = uniform((n_tasks,), phase)
    x = uniform((n_tasks, k_support + k_query, 1), x_range)
    y = amp[:, None, None] * torch.sin(x - ph[:, None, None])
    x, y = x.to(dtype=dtype, device=device), y.to(dtype=dtype, device=device)
    tasks = Task(x[:, :k_support], y[:, :k_support], x[:, k_support:], y[:, k_support:])
    return tasks, amp.to(dtype=dtype, device=device), ph.to(dtype=dtype, device=device)


def stack_episodes(
    x: Tensor,
    y: Tensor,
    episodes: Iterable[Sequence[int]],
    *,
    n_way: int,
    k_shot: int,
    n_query: int,
) -> Task:
    """Return a :class:`Task` batch ``(T, n_way * k_shot, ...)`` / ``(T, n_way * n_query, ...)``.

    ``episodes`` are index lists from :class:`torchfn.data.EpisodicBatchSampler` (support first,
    then query, by class slot); each is split with :func:`torchfn.data.split_episode`, so the
    labels are the episode's class slots ``0..n_way-1`` (int64).

    Example:
        >>> from torchfn.data import EpisodicBatchSampler
        >>> y = torch.arange(6).repeat_interleave(4)
        >>> x = torch.randn(24, 3)
        >>> s = EpisodicBatchSampler(y, n_way=2, k_shot=1, n_query=2, episodes_per_epoch=4,
        ...                          seed=0)
        >>> t = stack_episodes(x, y, s, n_way=2, k_shot=1, n_query=2)
        >>> tuple(t.support_x.shape), tuple(t.query_y.shape)
        ((4, 2, 3), (4, 4))
    """
    from torchfn.data import split_episode  # data stands alone; import lazily

    parts = []
    for idx in episodes:
        index = torch.as_tensor(list(idx), dtype=torch.long)
        parts.append(
            split_episode(x[index], y[index], n_way=n_way, k_shot=k_shot, n_query=n_query)
        )
    if not parts:
        raise ValueError("stack_episodes(episodes=...): expected at least one episode, got none")
    return Task(*(torch.stack(field) for field in zip(*parts, strict=True)))
