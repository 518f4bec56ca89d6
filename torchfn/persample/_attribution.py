"""Data attribution from per-sample gradients: inner products against a query set, TracIn."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from torchfn.persample._ghost_norms import GhostModel
from torchfn.persample._projection import (
    FactorDict,
    ProjectedGrads,
    Projection,
    Projector,
    feature_inner,
    layer_features,
)

__all__ = ["grad_inner_products", "project_grads", "projected_scores", "tracin_scores"]

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
    pre = f"{what}_" if what else ""
    if n_in is not None and n_t is not None and n_in != n_t:
        raise ValueError(f"{where}: {pre}inputs has batch {n_in} but {pre}targets has batch "
                         f"{n_t}; pass one target per {what + ' ' if what else ''}sample (dim 0)")


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
    if len(parts) == 1:  # one chunk: no copy
        return parts[0]
    if isinstance(parts[0], dict):
        return {k: torch.cat([p[k] for p in parts], 0) for k in parts[0]}  # type: ignore[index]
    return torch.cat(parts, 0)  # type: ignore[arg-type]


def _check_chunk(chunk_size: Any, where: str) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{where}(chunk_size={chunk_size!r}): expected a positive int (train "
                         "samples per ghost pass) or None (all at once)")


def _check_projection(projection: Any, where: str) -> None:
    if not isinstance(projection, Projection):
        raise TypeError(f"{where}(projection=...): expected a torchfn.persample.Projection(k=..., "
                        f"seed=..., kind=...), got {type(projection).__name__}")


def _chunks(inputs: Any, targets: Any, n: int | None, chunk_size: int | None
            ) -> list[tuple[Any, Any]]:
    if chunk_size is None or n is None or chunk_size >= n:
        return [(inputs, targets)]
    return [(_rows(inputs, lo, min(n, lo + chunk_size), n),
             _rows(targets, lo, min(n, lo + chunk_size), n)) for lo in range(0, n, chunk_size)]


def _features(ghost: GhostModel, loss_fn: LossFn, params: Mapping[str, Tensor],
              buffers: Mapping[str, Tensor], inputs: Any, targets: Any,
              proj: Projector) -> tuple[ProjectedGrads, Tensor]:
    """One ghost pass: ``(features, losses)``, ``projected`` per layer."""
    res = ghost.per_sample(params, buffers, inputs, targets, loss_fn)
    feats, factored = layer_features(res.grads, proj)
    return ProjectedGrads(feats, factored, proj.projection), res.losses.detach()


def project_grads(ghost: GhostModel, loss_fn: LossFn, params: Mapping[str, Tensor],
                  buffers: Mapping[str, Tensor], inputs: Any, targets: Any, *,
                  projection: Projection, per_layer: bool = False,
                  chunk_size: int | None = None) -> ProjectedGrads:
    """Return a :class:`ProjectedGrads`: every sample's gradient as features -- a seeded random
    projection ``projected`` ``(N, K)`` plus the exact factors ``factored`` of the linear
    maps applied once per sample --, so that ``projected_scores(project_grads(train),
    project_grads(query))`` approximates the ``(N_train, N_query)`` matrix of
    :func:`grad_inner_products`.

    An approximation (TRAK, LoGra): ``E[<f_i, f_j>] = <grad l_i, grad l_j>`` over the
    projection's randomness, the error shrinking as ``projection.k`` grows (measured against
    the exact scores in ``benchmarks/attribution.py``). Per layer, from one ghost pass
    (:meth:`GhostModel.per_sample`; no per-sample gradient of a linear map is formed):

    - a linear map applied once per sample (a dense layer on ``(B, d_in)`` inputs: its
      per-sample gradient ``g_i^T a_i`` is rank one), or at few positions (``T^2 (d_in + 1 +
      d_out) <= k_in k_out``, the projected size below), is kept *exact*
      (``Projection(factored=True)``, the default): its inputs ``a`` (with a column of ones
      for the bias) and output gradients ``g`` are stored in ``factored`` and scored
      ``<G_i, G_j> = (a_i . a_j)(g_i . g_j)`` (summed over position pairs when ``T > 1``);
    - every other linear map (linear, conv on the unfold route, attention projections,
      recurrent weights) gets the Kronecker-structured projection ``P_out^T [G_i | b_i] P_in
      = sum_t (g_it P_out)^T (a_it P_in)`` from ``a`` and ``g`` (``(k_out, k_in)``, ``k_* =
      min(k, d_*)``: a side no larger than ``k`` is exact; the bias is an input column of
      ones);
    - an embedding ``sum_t P_V[id_it]^T (g_it P_D)``;
    - every other layer (norms, vmap-fallback and direct layers, ``conv_method="grouped"``
      convs) and every group of layers tied by a parameter has its per-sample gradients
      materialised and multiplied by a dense random ``(P_layer, k^2)`` matrix, or kept
      exactly when it has at most ``k^2`` parameters

    (see :mod:`torchfn.persample._projection`). The projection depends on
    ``projection.seed`` and the layer names only: features computed in separate calls (train
    once, stored; queries later) and on CPU or CUDA are consistent. Which maps are factored
    depends on ``T`` as well: score feature sets with the same positions per sample (or
    ``factored=False``).

    ``chunk_size``: samples per ghost pass (``None``: all at once); every tensor of
    ``inputs``/``targets`` is cut along dim 0. ``per_layer=True``: ``projected`` is
    ``{layer: (N, K_layer)}`` (a tied group under its first layer; ``(N, 0)`` for a layer
    wholly factored) whose concatenation, in ``ghost.layer_names`` order, is the ``(N, K)``
    matrix. The features have the dtype of the per-sample losses. Frozen parameters do not
    count.

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from torchfn.persample import (Projection, make_ghost_model, project_grads,
        ...                                projected_scores)
        >>> ghost, params, buffers = make_ghost_model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
        ...                                                         nn.Linear(32, 3)))
        >>> loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> xs, ys = torch.randn(6, 16), torch.randint(0, 3, (6,))
        >>> proj = Projection(k=8, seed=0)
        >>> feats = project_grads(ghost, loss_fn, params, buffers, xs, ys, projection=proj)
        >>> sorted(feats.factored), feats.projected.shape  # both rank one: kept exact
        (['0#0', '2#0'], torch.Size([6, 0]))
        >>> a, g = feats.factored["0#0"]  # inputs with a ones column, output gradients
        >>> a.shape, g.shape
        (torch.Size([6, 17]), torch.Size([6, 32]))
        >>> projected_scores(feats, feats).shape
        torch.Size([6, 6])
        >>> off = project_grads(ghost, loss_fn, params, buffers, xs, ys,
        ...                     projection=Projection(k=8, seed=0, factored=False))
        >>> off.projected.shape  # (8 x 8) + (3 x 21) projected features
        torch.Size([6, 127])
    """
    where = "project_grads"
    if not isinstance(ghost, GhostModel):
        raise TypeError(f"{where}(ghost=...): expected a GhostModel (from make_ghost_model), "
                        f"got {type(ghost).__name__}")
    _check_projection(projection, where)
    _check_pair(inputs, targets, "", where)
    _check_chunk(chunk_size, where)
    n = _batch(targets) if _batch(targets) is not None else _batch(inputs)
    proj = Projector(projection)
    parts = [_features(ghost, loss_fn, params, buffers, x, y, proj)[0]
             for x, y in _chunks(inputs, targets, n, chunk_size)]
    first = parts[0]
    assert isinstance(first.projected, dict)
    names = [k for k in ghost.layer_names if k in first.projected]
    for p in parts:
        assert isinstance(p.projected, dict)
        if list(p.projected) != names or list(p.factored) != list(first.factored):
            raise ValueError(f"{where}: the layers called (or kept factored) differ between "
                             f"chunks ({list(p.projected)} vs {names}); pass chunk_size=None")
    out: TensorDict = _concat([p.projected for p in parts])  # type: ignore[assignment]
    factored: FactorDict = {
        k: (torch.cat([p.factored[k][0] for p in parts], 0),
            torch.cat([p.factored[k][1] for p in parts], 0)) for k in first.factored}
    if per_layer:
        return ProjectedGrads(out, factored, projection)
    missing = [k for k in ghost.layer_names if k not in out and not _tied_member(ghost, k)]
    if missing:
        raise ValueError(f"{where}: layers {missing} were not called on these inputs, so their "
                         "features have no fixed place in the (N, K) matrix; pass "
                         "per_layer=True and match layers by name")
    return ProjectedGrads(torch.cat([out[k] for k in names], 1), factored, projection)


def projected_scores(train: ProjectedGrads, query: ProjectedGrads, *,
                     per_layer: bool = False) -> Tensor | TensorDict:
    """Return ``(N_train, N_query)``: the approximate scores ``<f_i, f_j>`` of two feature sets
    from :func:`project_grads` (same :class:`Projection`): ``train.projected @
    query.projected.T`` plus, per linear part kept factored, its exact ``<G_i, G_j> = (A_train
    A_query^T) * (G_train G_query^T)`` (summed over position pairs when ``T > 1``).
    ``per_layer=True`` (both from ``project_grads(..., per_layer=True)``): ``{layer:
    (N_train, N_query)}`` summing to the total, zeros for a layer seen in one set only.

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from torchfn.persample import (Projection, make_ghost_model, project_grads,
        ...                                projected_scores)
        >>> ghost, params, buffers = make_ghost_model(nn.Linear(4, 3))
        >>> loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> proj = Projection(k=2, seed=0)
        >>> train = project_grads(ghost, loss_fn, params, buffers, torch.randn(6, 4),
        ...                       torch.randint(0, 3, (6,)), projection=proj)
        >>> query = project_grads(ghost, loss_fn, params, buffers, torch.randn(2, 4),
        ...                       torch.randint(0, 3, (2,)), projection=proj)
        >>> projected_scores(train, query).shape
        torch.Size([6, 2])
    """
    where = "projected_scores"
    for what, v in (("train", train), ("query", query)):
        if not isinstance(v, ProjectedGrads):
            raise TypeError(f"{where}({what}=...): expected the ProjectedGrads of "
                            f"project_grads, got {type(v).__name__}")
    like = _first(train).new_zeros(())
    like = like.to(torch.promote_types(like.dtype, _first(query).dtype))
    return feature_inner(train, query, None, like, per_layer, where)


def _first(f: ProjectedGrads) -> Tensor:
    p = f.projected
    return next(iter(p.values())) if isinstance(p, dict) else p


def _tied_member(ghost: GhostModel, name: str) -> bool:
    return any(name in members and name != head for head, members in ghost.clip_groups.items())


def _projected_inner(ghost: GhostModel, loss_fn: LossFn, params: Mapping[str, Tensor],
                     buffers: Mapping[str, Tensor], train_inputs: Any, train_targets: Any,
                     query_inputs: Any, query_targets: Any, per_layer: bool,
                     chunk_size: int | None, n: int | None, projection: Any
                     ) -> Tensor | TensorDict:
    _check_projection(projection, "grad_inner_products")
    proj = Projector(projection)
    fq, lq = _features(ghost, loss_fn, params, buffers, query_inputs, query_targets, proj)
    parts = []
    for x, y in _chunks(train_inputs, train_targets, n, chunk_size):
        ft, lt = _features(ghost, loss_fn, params, buffers, x, y, proj)
        like = lt.new_zeros(()).to(torch.promote_types(lt.dtype, lq.dtype))
        parts.append(feature_inner(ft, fq, ghost.layer_names, like, per_layer,
                                   "grad_inner_products"))
    return _concat(parts)


def grad_inner_products(ghost: GhostModel, loss_fn: LossFn, params: Mapping[str, Tensor],
                        buffers: Mapping[str, Tensor], train_inputs: Any, train_targets: Any,
                        query_inputs: Any, query_targets: Any, *,
                        per_layer: bool = False,
                        chunk_size: int | None = None,
                        projection: Projection | None = None) -> Tensor | TensorDict:
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

    ``projection``: a :class:`Projection` turns the exact scores into an *approximation*:
    ``projected_scores(project_grads(train), project_grads(query))`` (:func:`project_grads`:
    per linear map a Kronecker-structured random projection formed from the recorded
    activations and output gradients, TRAK/LoGra style; maps applied once per sample kept
    exact as their factors), unbiased over the projection's randomness, with an error that
    shrinks as ``projection.k`` grows (``benchmarks/attribution.py`` measures it against the
    exact scores: relative error, rank correlation, top-m overlap). To score many query sets
    against one train set, store ``project_grads(train)`` once instead.

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
    _check_chunk(chunk_size, where)
    if projection is not None:
        return _projected_inner(ghost, loss_fn, params, buffers, train_inputs, train_targets,
                                query_inputs, query_targets, per_layer, chunk_size, n,
                                projection)
    query = ghost.per_sample(params, buffers, query_inputs, query_targets, loss_fn).grads
    parts = []
    for x, y in _chunks(train_inputs, train_targets, n, chunk_size):
        train = ghost.per_sample(params, buffers, x, y, loss_fn).grads
        parts.append(train.inner(query, per_layer=per_layer))
        del train  # one chunk's recorded activations alive at a time
    return _concat(parts)


def tracin_scores(ghost: GhostModel, loss_fn: LossFn, checkpoints: Sequence[Mapping[str, Tensor]],
                  lrs: Sequence[float], buffers: Mapping[str, Tensor], train_inputs: Any,
                  train_targets: Any, query_inputs: Any, query_targets: Any, *,
                  per_layer: bool = False, chunk_size: int | None = None,
                  projection: Projection | None = None) -> Tensor | TensorDict:
    """Return ``(N_train, N_query)``: TracIn-CP scores ``sum_k lr_k <grad l_i(w_k), grad l_j(w_k)>``.

    ``checkpoints``: the parameter dicts ``w_k`` saved during training (keys of ``params``
    from :func:`make_ghost_model`); ``lrs``: the learning rate in effect at each (same
    length). Each term is :func:`grad_inner_products` at that checkpoint (``buffers`` shared;
    ``chunk_size`` and ``projection`` as there: with a :class:`Projection`, the approximate
    projected scores, one projection for every checkpoint); ``per_layer=True`` gives
    ``{layer_name: (N_train, N_query)}``.

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
                                chunk_size=chunk_size, projection=projection)
        if isinstance(s, dict):
            prev = total if isinstance(total, dict) else {}
            total = {k: prev[k] + lr * v if k in prev else lr * v for k, v in s.items()}
        else:
            total = lr * s if total is None else total + lr * s  # type: ignore[operator]
    assert total is not None
    return total

