"""Distributed ensembles: rank r trains members ``[r N/W, (r+1) N/W)``; gather to predict/save.

Training needs no communication at all -- each rank runs the ordinary
:func:`torchfn.ensembles.make_ensemble_train_step` on its slice of the stacked state. Only
predictions and checkpoints gather the members (in rank order, so the gathered stack is the
single-process stack). In a stacked state, every leaf with ``ndim >= 1`` has the members on
dim 0 (params, buffers, moments); 0-d leaves (``step``, ``seed``, an optimizer's shared
``count``) are the same on every rank and are neither sliced nor gathered.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import optree
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torchopt.base import GradientTransformation

from torchfn._checks import _check_rank
from torchfn.distributed._env import world_info
from torchfn.distributed._reduce import all_gather_tree
from torchfn.ensembles import ensemble_apply, load_ensemble, n_members, save_ensemble
from torchfn.functional import TrainState

__all__ = [
    "gather_members",
    "load_ensemble_shard",
    "member_range",
    "save_ensemble_gathered",
    "shard_members",
    "sharded_ensemble_apply",
]

T = TypeVar("T")


def member_range(n: int, *, rank: int, world_size: int) -> range:
    """Return the members ``range(r N/W, (r+1) N/W)`` that rank ``rank`` trains.

    ``ValueError`` when ``N`` is not divisible by ``world_size`` (every rank must hold the same
    number of members so the gathers line up).

    Example:
        >>> member_range(8, rank=1, world_size=2)
        range(4, 8)
    """
    _check_rank(world_size, rank, "member_range")
    if n % world_size:
        raise ValueError(f"member_range(n={n}, world_size={world_size}): {n} members cannot be "
                         f"split evenly over {world_size} ranks; use a multiple of "
                         f"{world_size} members")
    per = n // world_size
    return range(rank * per, (rank + 1) * per)


def shard_members(tree: T, *, rank: int, world_size: int) -> T:
    """Return ``tree`` (a stacked state, dict or any pytree) cut to rank ``rank``'s members.

    Leaves with ``ndim >= 1`` must share dim 0 = N and become ``(N/W, ...)``; 0-d leaves stay.
    Use it on the full :class:`TrainState` (``init_ensemble_state``) and on per-member
    hyperparameters (``(N,)`` learning rates) alike.

    Example:
        >>> import torch
        >>> shard_members({"w": torch.arange(4.0)}, rank=1, world_size=2)
        {'w': tensor([2., 3.])}
    """
    leaves = [t for t in optree.tree_leaves(tree) if isinstance(t, Tensor) and t.ndim >= 1]
    sizes = {int(t.shape[0]) for t in leaves}
    if len(sizes) != 1:
        raise ValueError(f"shard_members(tree): every leaf with ndim >= 1 must have the N "
                         f"members on dim 0; got dim-0 sizes {sorted(sizes)}")
    (n,) = sizes
    r = member_range(n, rank=rank, world_size=world_size)
    return optree.tree_map(
        lambda t: t[r.start:r.stop] if isinstance(t, Tensor) and t.ndim >= 1 else t, tree)


def gather_members(tree: T, *, group: ProcessGroup | None = None) -> T:
    """Return ``tree`` with the members of all ranks concatenated on dim 0, in rank order.

    Each rank passes its ``(N/W, ...)`` slice (same shapes on every rank); every rank gets the
    whole ``(N, ...)`` stack. 0-d leaves are taken from the calling rank. A collective: all
    ranks must call it.

    Example::

        full = gather_members(local_state)        # params (N/W, ...) -> (N, ...)
    """
    world_info(group, "gather_members")
    leaves, spec = optree.tree_flatten(tree)
    gathered = all_gather_tree({str(i): t for i, t in enumerate(leaves)}, group=group)
    return optree.tree_unflatten(spec, [gathered[str(i)] for i in range(len(leaves))])


def sharded_ensemble_apply(
    model_fn: Callable[..., tuple[Any, dict[str, Tensor]]],
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    *args: Any,
    group: ProcessGroup | None = None,
    **kwargs: Any,
) -> Any:
    """Return the outputs of ALL N members, ``(N, B, ...)``, from this rank's ``(N/W, ...)`` slice.

    Runs :func:`torchfn.ensembles.ensemble_apply` on the local members (``kwargs`` pass
    through: ``per_member``, ``chunk_size``, ``randomness``) and all-gathers the outputs (a
    tensor or a dict/pytree of tensors) along the member dim. With ``per_member=True`` pass
    the local members' inputs ``(N/W, B, ...)``. Feed the result to
    :func:`torchfn.ensembles.ensemble_metrics` / ``ensemble_probs`` on any rank.

    Example::

        logits = sharded_ensemble_apply(ens.model_fn, state.params, state.buffers, x)
        logits.shape          # (N, B, classes) on every rank
    """
    outputs, _ = ensemble_apply(model_fn, params, buffers, *args, **kwargs)
    return gather_members(outputs, group=group)


def save_ensemble_gathered(path: str | os.PathLike[str], local_state: TrainState, *,
                           group: ProcessGroup | None = None,
                           extra: dict[str, Any] | None = None) -> None:
    """Gather every rank's members and write ONE ensemble checkpoint from rank 0; returns None.

    A collective (all ranks call it with their ``(N/W, ...)`` state). Rank 0 writes the
    ``(N, ...)`` state with :func:`torchfn.ensembles.save_ensemble` (atomic); a barrier then
    makes sure the file is complete before any rank goes on (e.g. to load it). The file is a
    plain single-process ensemble checkpoint: :func:`load_ensemble_shard` reads it back on any
    world size, :func:`torchfn.ensembles.load_ensemble` in one process.
    """
    rank, _ = world_info(group, "save_ensemble_gathered")
    n_members(local_state.params, "save_ensemble_gathered(path, local_state)")
    full = gather_members(local_state, group=group)
    if rank == 0:
        save_ensemble(path, full, extra=extra)
    dist.barrier(group)


def load_ensemble_shard(path: str | os.PathLike[str], *, rank: int, world_size: int,
                        optimizer: GradientTransformation | None = None,
                        map_location: Any = None) -> tuple[TrainState, dict[str, Any] | None]:
    """Return ``(local_state, extra)``: this rank's members of an ensemble checkpoint.

    Reads a :func:`torchfn.ensembles.save_ensemble` / :func:`save_ensemble_gathered` file of
    N members (written on any world size) and keeps members :func:`member_range`
    ``(N, rank=rank, world_size=world_size)``. ``optimizer``, if given, is this rank's
    optimizer (built for ``N/W`` members); the loaded optimizer state must then have the
    structure and shapes of ``optimizer.init(local_params)`` (``ValueError`` otherwise). No
    communication: call it with ``rank=0, world_size=1`` in a single process.

    Example::

        state, extra = load_ensemble_shard("ens.pt", rank=rank, world_size=world,
                                           optimizer=stacked_adam(lr=lr[my_members]))
    """
    state, extra = load_ensemble(path, map_location=map_location)
    n = n_members(state.params, f"load_ensemble_shard({os.fspath(path)!r})")
    member_range(n, rank=rank, world_size=world_size)  # the divisibility error, named
    local = shard_members(state, rank=rank, world_size=world_size)
    if optimizer is not None:
        template = optimizer.init(local.params)
        want, got = optree.tree_structure(template), optree.tree_structure(local.opt_state)
        shapes_t = [tuple(t.shape) for t in optree.tree_leaves(template)]
        shapes_g = [tuple(t.shape) for t in optree.tree_leaves(local.opt_state)]
        if want != got or shapes_t != shapes_g:
            raise ValueError(f"load_ensemble_shard({os.fspath(path)!r}, optimizer=...): the "
                             f"saved optimizer state does not match optimizer.init(params) of "
                             f"this rank's {n // world_size} members (saved {got}, expected "
                             f"{want}); build the optimizer for the local members only")
    return local, extra


