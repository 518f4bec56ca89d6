"""The ghost machinery's building blocks, for code outside :mod:`torchfn.persample` that runs
the ghost pass piece by piece.

Its one user is :mod:`torchfn.distributed`'s per-block sharded DP-SGD step
(``make_sharded_dp_train_step(..., blocks=...)``): it gathers one block of parameters at a time,
replays that block's ghost layers on a :class:`Tape`, and forms the block's per-sample norms and
clipped sums itself. The names here are the pieces it needs, gathered in one module so that the
dependency is explicit; they follow the ghost machinery's internals and may change between
releases, unlike the names :mod:`torchfn.persample` exports.

- :class:`Tape`, :func:`batch_size_of`, :func:`input_signature`, :func:`lift_inputs`,
  :func:`template_of`, :func:`tensors_of`: the ghost model's recording of
  layer inputs and output gradients (``torchfn.persample._ghost_tape``);
- :class:`Layer`: one ghost layer (module, rule, params); :func:`prepare_layers`: the recorded
  layers' prepared ``(a, g)`` states, the end of a ghost pass (``_ghost_norms``);
- :func:`clip_coefficients`: per-sample clip factors from per-sample norms (``_dp_clipping``);
- :func:`check_batch`, :func:`check_valid`, :func:`check_buffers_unchanged`: the DP step's
  checks of the batch, of ``valid`` against the per-sample losses and of the forward's buffers
  (``_dpsgd``).
"""

from __future__ import annotations

from torchfn.persample._dp_clipping import clip_coefficients
from torchfn.persample._dpsgd import _check_batch as check_batch
from torchfn.persample._dpsgd import check_buffers_unchanged, check_valid
from torchfn.persample._ghost_grads import Layer
from torchfn.persample._ghost_norms import prepare_layers
from torchfn.persample._ghost_tape import (
    Tape,
    batch_size_of,
    input_signature,
    lift_inputs,
    template_of,
    tensors_of,
)

__all__ = [
    "Layer",
    "Tape",
    "batch_size_of",
    "check_batch",
    "check_buffers_unchanged",
    "check_valid",
    "clip_coefficients",
    "input_signature",
    "lift_inputs",
    "prepare_layers",
    "template_of",
    "tensors_of",
]
