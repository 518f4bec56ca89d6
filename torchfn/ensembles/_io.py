"""Save and load a whole ensemble's training state (stacked params, buffers, optimizer state)."""

from __future__ import annotations

import os
from typing import Any

from torchopt.base import GradientTransformation

from torchfn.ensembles._build import n_members
from torchfn.functional import CheckpointError, TrainState, load_checkpoint, save_checkpoint

__all__ = ["load_ensemble", "save_ensemble"]

_KEY = "torchfn.ensemble"


def save_ensemble(path: str | os.PathLike[str], state: TrainState, *,
                  extra: dict[str, Any] | None = None) -> None:
    """Write an ensemble's stacked :class:`TrainState` (and ``extra``) to ``path`` atomically.

    A :func:`torchfn.functional.save_checkpoint` file that also records N, so
    :func:`load_ensemble` can check it. Returns ``None``. Like ``save_checkpoint``, it first
    removes the temporary files that killed saves of the same ``path`` left behind.

    Example:
        >>> import os, tempfile, torch
        >>> from torch import nn
        >>> from torchfn.ensembles import (Ensemble, init_ensemble_state, load_ensemble,
        ...                                save_ensemble)
        >>> from torchfn.optim import stacked_adam
        >>> ens = Ensemble.from_seeds(lambda: nn.Linear(3, 2), seeds=range(2))
        >>> opt = stacked_adam(lr=torch.tensor([1e-3, 1e-2]))
        >>> path = os.path.join(tempfile.mkdtemp(), "ens.pt")
        >>> save_ensemble(path, init_ensemble_state(ens, opt, seed=0))
        >>> state, _ = load_ensemble(path, optimizer=opt, n_members=2)
        >>> state.params["weight"].shape
        torch.Size([2, 2, 3])
    """
    n = n_members(state.params, "save_ensemble(path, state)")
    save_checkpoint(path, state, extra={_KEY: {"n_members": n, "extra": extra}})


def load_ensemble(path: str | os.PathLike[str], *, optimizer: GradientTransformation | None = None,
                  n_members: int | None = None,
                  map_location: Any = None) -> tuple[TrainState, dict[str, Any] | None]:
    """Return ``(state, extra)`` written by :func:`save_ensemble`.

    ``optimizer`` rebuilds the optimizer state on its template (see
    :func:`torchfn.functional.load_checkpoint`); ``n_members``, if given, must equal the saved
    N (``ValueError`` otherwise). Raises :class:`torchfn.functional.CheckpointError` for a file
    that is not an ensemble checkpoint.
    """
    state, saved = load_checkpoint(path, map_location=map_location, optimizer=optimizer)
    if not isinstance(saved, dict) or _KEY not in saved:
        raise CheckpointError(f"load_ensemble({os.fspath(path)!r}): not an ensemble checkpoint "
                              "(written by save_checkpoint, not save_ensemble?)")
    info = saved[_KEY]
    if n_members is not None and info["n_members"] != n_members:
        raise ValueError(f"load_ensemble({os.fspath(path)!r}, n_members={n_members}): the file "
                         f"holds {info['n_members']} members")
    return state, info["extra"]
