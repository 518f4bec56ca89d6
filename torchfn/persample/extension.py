"""The ghost machinery's building blocks, for code outside :mod:`torchfn.persample` that runs
the ghost pass piece by piece.

Its one user is :mod:`torchfn.distributed`'s per-block sharded DP-SGD step
(``make_sharded_dp_train_step(..., blocks=...)``): it gathers one block of parameters at a time,
replays that block's ghost layers on a :class:`Tape`, and forms the block's per-sample norms and
clipped sums itself. The names here are the pieces it needs, gathered in one module so that the
dependency is explicit; they follow the ghost machinery's internals and may change between
releases, unlike the names :mod:`torchfn.persample` exports.

- :class:`Tape`, :func:`batch_size_of`, :func:`fill_slots`, :func:`input_signature`,
  :func:`lift_inputs`, :func:`template_of`, :func:`tensors_of`: the ghost model's recording of
  layer inputs and output gradients (``torchfn.persample._ghost_tape``);
- :class:`Layer`, :class:`Prepared`, :func:`local`: one ghost layer's rule and its prepared
  ``(a, g)`` state (``_ghost_grads`` / ``_ghost_layers``);
- :func:`clip_coefficients`: per-sample clip factors from squared norms (``_dp_clipping``);
- :func:`check_batch`: the DP step's batch check (``_dpsgd``).
"""

from __future__ import annotations

from torchfn.persample._dp_clipping import clip_coefficients
from torchfn.persample._dpsgd import _check_batch as check_batch
from torchfn.persample._ghost_grads import Layer
from torchfn.persample._ghost_layers import Prepared, local
from torchfn.persample._ghost_tape import (
    Tape,
    batch_size_of,
    fill_slots,
    input_signature,
    lift_inputs,
    template_of,
    tensors_of,
)

__all__ = [
    "Layer",
    "Prepared",
    "Tape",
    "batch_size_of",
    "check_batch",
    "clip_coefficients",
    "fill_slots",
    "input_signature",
    "lift_inputs",
    "local",
    "template_of",
    "tensors_of",
]
