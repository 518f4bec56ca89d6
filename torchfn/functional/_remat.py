"""Activation checkpointing (rematerialisation) that works inside torch.func transforms.

``torch.utils.checkpoint.checkpoint`` relies on saved-tensor hooks (non-reentrant form) or an
old-style ``autograd.Function`` (reentrant form); ``torch.func.grad``/``vjp`` support neither, so
a model that checkpoints its blocks fails in every torchfn path that differentiates with
``torch.func`` (per-sample gradients, meta-learning, the train steps, DP). :func:`checkpoint`
picks, per call, the form that works where it runs:

- plain eager autograd (no ``torch.func`` transform active, grad enabled): torch's
  non-reentrant checkpoint; the backward recomputes ``fn``, so its activations are not kept;
- eagerly inside ``torch.func`` transforms (``grad``, ``vmap``, ``grad`` of ``grad``): ``fn``
  runs directly. There is no recomputation there -- a recomputing autograd.Function would not
  see the parameters a module reads from its attributes (``functional_call`` puts them there),
  so it would drop their gradients -- and the memory is that of the model without
  checkpointing;
- under ``torch.compile``: ``fn`` is traced directly. Dynamo's form of torch's checkpoint (a
  ``tag_activation_checkpoint`` region) fails when AOTAutograd traces it inside a ``torch.func``
  transform (the same saved-tensor-hooks error), and whether a transform is active cannot be
  read reliably while Dynamo traces, so no region is tagged; Inductor's partitioner still
  decides which activations to recompute, as for any compiled step.

The numbers are those of ``fn(*args, **kwargs)`` in every case.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["checkpoint"]


def _in_functorch_transform() -> bool:
    """Return True while a torch.func transform (grad, vmap, jvp, ...) is active."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Return ``fn(*args, **kwargs)``, recomputing its activations in the backward where possible.

    A drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` that
    also works inside ``torch.func`` transforms and so in every torchfn path. ``kwargs`` all go
    to ``fn`` (none are taken for checkpointing options). Same outputs and gradients (first and
    second order) as calling ``fn`` directly; random ops inside ``fn`` replay the same numbers
    in the recomputation (torch's ``preserve_rng_state``).

    Where memory is saved: in plain eager autograd (torch's non-reentrant checkpoint). Inside
    ``torch.func`` transforms (every torchfn path) and under ``torch.compile`` ``fn`` runs
    directly and saves nothing; the module docstring says why. Use it so that one model runs
    in every path.

    Example::

        >>> from torch import nn
        >>> from torchfn.functional import checkpoint
        >>> block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        >>> x = torch.randn(2, 4)
        >>> y = checkpoint(block, x)
        >>> torch.equal(y, block(x)), tuple(y.shape)
        (True, (2, 4))
    """
    if not callable(fn):
        raise TypeError(f"torchfn.functional.checkpoint(fn, *args): fn must be callable, got "
                        f"{type(fn).__name__}")
    call = functools.partial(fn, **kwargs) if kwargs else fn
    if torch.compiler.is_compiling() or _in_functorch_transform() or not torch.is_grad_enabled():
        return call(*args)
    return torch.utils.checkpoint.checkpoint(call, *args, use_reentrant=False)
