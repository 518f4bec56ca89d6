"""Data attribution from per-sample gradients: inner products against a query set, TracIn."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from torchfn.persample._ghost_norms import GhostModel

__all__ = ["grad_inner_products", "tracin_scores"]

TensorDict = dict[str, Tensor]
LossFn = Callable[[Any, Any], Tensor]


def _batch(x: Any) -> int | None:
    """The batch size of a tensor, or of the first tensor of a tuple/list/dict; else None."""
    if isinstance(x, Tensor):
        return x.shape[0] if x.dim() > 0 else None
    items = x.values() if isinstance(x, Mapping) else x if isinstance(x, (tuple, list)) else ()
    for v in items:
        if isinstance(v, Tensor) and v.dim() > 0:
            return v.shape[0]
    return None


def _check_pair(inputs: Any, targets: Any, what: str, where: str) -> None:
    n_in, n_t = _batch(inputs), _batch(targets)
    if n_in is not None and n_t is not None and n_in != n_t:
        raise ValueError(f"{where}: {what}_inputs has batch {n_in} but {what}_targets has batch "
                         f"{n_t}; pass one target per {what} sample (dim 0)")


def _rows(x: Any, lo: int, hi: int, n: int) -> Any:
    """``x`` with every tensor whose dim 0 is the batch ``n`` cut to samples ``lo:hi``."""
    if isinstance(x, Tensor):
        return x[lo:hi] if x.dim() > 0 and x.shape[0] == n else x
    if isinstance(x, Mapping):
        return {k: _rows(v, lo, hi, n) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_rows(v, lo, hi, n) for v in x)
    return x


def _concat(parts: list[Tensor | TensorDict]) -> Tensor | TensorDict:
    if isinstance(parts[0], dict):
        return {k: torch.cat([p[k] for p in parts], 0) for k in parts[0]}  # type: ignore[index]
    return torch.cat(parts, 0)  # type: ignore[arg-type]


def grad_inner_products(ghost: GhostModel, loss_fn: LossFn, params: Mapping[str, Tensor],
                        buffers: Mapping[str, Tensor], train_inputs: Any, train_targets: Any,
                        query_inputs: Any, query_targets: Any, *,
                        per_layer: bool = False,
                        chunk_size: int | None = None) -> Tensor | TensorDict:
    """Return ``(N_train, N_query)``: ``<grad l_i, grad l_j>`` over all trainable parameters.

    ``l_i = loss_fn(outputs, targets)[i]`` on the train batch, ``l_j`` likewise on the query
    batch (``loss_fn`` must return the ``(B,)`` per-sample losses). Two ghost passes
    (:meth:`GhostModel.per_sample`), then :meth:`GhostGrads.inner`: per linear map (linear,
    conv, attention projections, recurrent weights) the cheaper of the ghost form ``sum_{t,s}
    (a_it . a_js)(g_it . g_js)`` (no per-sample gradient formed) and materialising both
    sides; other layers materialised.
    ``chunk_size``: score the train set in chunks of this many samples (one ghost pass each,
    against the query pass made once; a layer the query side materialises is materialised
    once), bounding memory by the chunk instead of ``N_train``; ``None``: one pass over all.
    Every tensor of the train inputs (tensor, tuple or dict, as for
    :meth:`GhostModel.per_sample`) and targets is cut along dim 0. Frozen parameters do not
    count. With ``per_layer=True`` return ``{layer_name: (N_train, N_query)}`` summing to
    the total. The similarity base of TracIn (:func:`tracin_scores`) and gradient-similarity
    attribution.

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from torchfn.persample import grad_inner_products, make_ghost_model
        >>> ghost, params, buffers = make_ghost_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
        ...                                                         nn.Linear(8, 3)))
        >>> loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> xs, ys = torch.randn(6, 4), torch.randint(0, 3, (6,))
        >>> xq, yq = torch.randn(2, 4), torch.randint(0, 3, (2,))
        >>> grad_inner_products(ghost, loss_fn, params, buffers, xs, ys, xq, yq).shape
        torch.Size([6, 2])
    """
    where = "grad_inner_products"
    if not isinstance(ghost, GhostModel):
        raise TypeError(f"{where}(ghost=...): expected a GhostModel (from make_ghost_model), "
                        f"got {type(ghost).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"{where}(loss_fn=...): expected a callable (outputs, targets) -> (B,) "
                        f"per-sample losses, got {type(loss_fn).__name__}")
    _check_pair(train_inputs, train_targets, "train", where)
    _check_pair(query_inputs, query_targets, "query", where)
    n = _batch(train_targets) if _batch(train_targets) is not None else _batch(train_inputs)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{where}(chunk_size={chunk_size!r}): expected a positive int (train "
                         "samples per ghost pass) or None (all at once)")
    query = ghost.per_sample(params, buffers, query_inputs, query_targets, loss_fn).grads
    if chunk_size is None or n is None or chunk_size >= n:
        train = ghost.per_sample(params, buffers, train_inputs, train_targets, loss_fn).grads
        return train.inner(query, per_layer=per_layer)
    parts = []
    for lo in range(0, n, chunk_size):
        hi = min(n, lo + chunk_size)
        train = ghost.per_sample(params, buffers, _rows(train_inputs, lo, hi, n),
                                 _rows(train_targets, lo, hi, n), loss_fn).grads
        parts.append(train.inner(query, per_layer=per_layer))
        del train
    return _concat(parts)


def tracin_scores(ghost: GhostModel, loss_fn: LossFn, checkpoints: Sequence[Mapping[str, Tensor]],
                  lrs: Sequence[float], buffers: Mapping[str, Tensor], train_inputs: Any,
                  train_targets: Any, query_inputs: Any, query_targets: Any, *,
                  per_layer: bool = False, chunk_size: int | None = None) -> Tensor | TensorDict:
    """Return ``(N_train, N_query)``: TracIn-CP scores ``sum_k lr_k <grad l_i(w_k), grad l_j(w_k)>``.

    ``checkpoints``: the parameter dicts ``w_k`` saved during training (keys of ``params``
    from :func:`make_ghost_model`); ``lrs``: the learning rate in effect at each (same
    length). Each term is :func:`grad_inner_products` at that checkpoint (``buffers`` shared;
    ``chunk_size`` as there); ``per_layer=True`` gives ``{layer_name: (N_train, N_query)}``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torchfn.persample import make_ghost_model, tracin_scores
        >>> ghost, params, buffers = make_ghost_model(nn.Linear(3, 1))
        >>> loss_fn = lambda out, y: ((out - y) ** 2).sum(1)
        >>> later = {k: v + 0.1 for k, v in params.items()}
        >>> x, y = torch.randn(5, 3), torch.randn(5, 1)
        >>> tracin_scores(ghost, loss_fn, [params, later], [0.1, 0.05], buffers,
        ...               x, y, x[:2], y[:2]).shape
        torch.Size([5, 2])
    """
    where = "tracin_scores"
    checkpoints, lrs = list(checkpoints), list(lrs)
    if not checkpoints or len(checkpoints) != len(lrs):
        raise ValueError(f"{where}: expected one learning rate per checkpoint (at least one), "
                         f"got {len(checkpoints)} checkpoints and {len(lrs)} lrs")
    total: Tensor | TensorDict | None = None
    for w, lr in zip(checkpoints, lrs, strict=True):
        s = grad_inner_products(ghost, loss_fn, w, buffers, train_inputs, train_targets,
                                query_inputs, query_targets, per_layer=per_layer,
                                chunk_size=chunk_size)
        if isinstance(s, dict):
            prev = total if isinstance(total, dict) else {}
            total = {k: prev[k] + lr * v if k in prev else lr * v for k, v in s.items()}
        else:
            total = lr * s if total is None else total + lr * s  # type: ignore[operator]
    assert total is not None
    return total

