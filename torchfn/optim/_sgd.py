"""SGD with momentum as a torchopt ``GradientTransformation`` whose whole state is in the state.

``torchopt.sgd(momentum>0)`` keeps a "first call" flag in a Python closure, outside its
state: a run resumed from a checkpoint with a freshly built optimizer treats its first update
as the very first (``trace = trace + g`` instead of ``momentum * trace + (1 - dampening) g``),
so it does not continue exactly. This version keeps a per-leaf int64 update count in the
state instead, so a checkpoint holds everything; it follows ``torch.optim.SGD``'s semantics
(first step ``buf = g``, then ``buf = momentum buf + (1 - dampening) g``; Nesterov
``g + momentum buf``), is out-of-place (differentiable, as meta-learning needs) and traces
under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torchopt.base import GradientTransformation, identity
from torchopt.combine import chain
from torchopt.typing import OptState, Params, ScalarOrSchedule, Updates

from torchfn.optim._adam import _check_hparams, _flip_sign_and_l2, _scale_by_neg_lr

__all__ = ["TraceState", "sgd", "trace"]


class TraceState(NamedTuple):
    """State of :func:`trace`: the momentum buffers and per-leaf int64 0-d update counts."""

    trace: Any
    count: Any


def trace(momentum: float = 0.9, dampening: float = 0.0, nesterov: bool = False, *,
          moment_requires_grad: bool = False) -> GradientTransformation:
    """Return the momentum transformation of ``torch.optim.SGD`` with its count in the state.

    Per leaf ``g``: ``buf = g`` on the first update, then ``buf = momentum * buf + (1 -
    dampening) * g``; the update is ``buf``, or ``g + momentum * buf`` with ``nesterov``.

    Example:
        >>> import torch
        >>> tx = trace(momentum=0.5)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> for _ in range(2):
        ...     u, state = tx.update({"w": torch.ones(2)}, state, inplace=False)
        >>> u["w"], state.count["w"]
        (tensor([1.5000, 1.5000]), tensor(2))
    """
    if not momentum >= 0.0:
        raise ValueError(f"trace(momentum=...): expected momentum >= 0, got {momentum!r}")
    if not 0.0 <= dampening <= 1.0:
        raise ValueError(f"trace(dampening=...): expected dampening in [0, 1], got {dampening!r}")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError("trace(nesterov=True): Nesterov momentum needs momentum > 0 and "
                         f"dampening 0, got momentum={momentum!r}, dampening={dampening!r}")

    def init_fn(params: Params) -> OptState:
        return TraceState(
            trace=optree.tree_map(
                lambda t: torch.zeros_like(t, requires_grad=moment_requires_grad), params),
            count=optree.tree_map(
                lambda t: torch.zeros((), dtype=torch.int64, device=t.device), params))

    def update_fn(updates: Updates, state: OptState, *, params: Params | None = None,
                  inplace: bool = True) -> tuple[Updates, OptState]:
        del params, inplace  # always out-of-place

        def leaf(g: torch.Tensor | None, buf: torch.Tensor,
                 count: torch.Tensor) -> tuple[Any, ...]:
            if g is None:
                return None, buf, count
            gb = g.to(buf.dtype)
            buf = torch.where(count == 0, gb, buf.mul(momentum).add(gb, alpha=1.0 - dampening))
            u = gb.add(buf, alpha=momentum) if nesterov else buf
            return u.to(g.dtype), buf, count + 1

        spec = optree.tree_structure(updates, none_is_leaf=True)
        out = [leaf(*xs) for xs in zip(spec.flatten_up_to(updates),
                                        spec.flatten_up_to(state.trace),
                                        spec.flatten_up_to(state.count), strict=True)]
        new = [spec.unflatten([o[i] for o in out]) for i in range(3)]
        return new[0], TraceState(trace=new[1], count=new[2])

    return GradientTransformation(init_fn, update_fn)


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    moment_requires_grad: bool = False,
    maximize: bool = False,
) -> GradientTransformation:
    """Return SGD (with momentum) as a compile-safe transformation that resumes exactly.

    ``torch.optim.SGD``'s and ``torchopt.sgd``'s signature and semantics (``weight_decay`` an
    L2 penalty added to the gradient); the momentum buffers and their update counts are all in
    the state (:class:`TraceState`), so a run resumed from a checkpoint with a new optimizer
    object continues exactly, which ``torchopt.sgd(momentum>0)`` does not (see the module
    docstring). ``lr``: a float, a torchopt schedule or a floating 0-d tensor. Use it
    out-of-place: ``updates, state = opt.update(grads, state, params=params, inplace=False)``.

    Example:
        >>> import torch, torchopt
        >>> from torchfn.optim import sgd
        >>> opt = sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> state = opt.init(params)
        >>> for _ in range(2):
        ...     u, state = opt.update({"w": torch.tensor([1.0, 1.0])}, state, params=params,
        ...                           inplace=False)
        ...     params = torchopt.apply_updates(params, u, inplace=False)
        >>> params["w"]  # -0.1 * 1, then -0.1 * (0.9 + 1)
        tensor([ 0.7100, -2.2900])
    """
    _check_hparams(lr, (0.0, 0.0), 0.0, 0.0, weight_decay, "sgd")
    momentum_tx = (trace(momentum, dampening, nesterov,
                         moment_requires_grad=moment_requires_grad)
                   if momentum != 0.0 or nesterov else identity())
    return chain(_flip_sign_and_l2(weight_decay, maximize), momentum_tx, _scale_by_neg_lr(lr))
