"""Per-sample gradients of a batch in factored (ghost) form: norms, weighted sums, tensors."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from torchfn.persample._ghost_layers import Prepared, Rule, _LinearLike
from torchfn.persample._ghost_tied import cross_dot, shared_pairs, tied_groups

__all__ = ["GhostGrads", "GhostResult"]

TensorDict = dict[str, Tensor]


class Layer(NamedTuple):
    module: nn.Module  # the layer (meta tensors; only its structure and settings are used)
    rule: Rule
    params: dict[str, str]  # local name -> global (make_functional) name
    buffers: dict[str, str]
    # local -> global names of the other parameters a rule's recompute needs as constants
    # (a "direct" layer: the parameters of the module's children)
    consts: Mapping[str, str] = MappingProxyType({})


class GhostResult(NamedTuple):
    """What :meth:`GhostModel.per_sample` returns.

    Fields: ``grads`` (:class:`GhostGrads`), ``losses`` ``(B,)`` (per-sample losses),
    ``outputs`` (the model's outputs), ``new_buffers`` (as from ``model_fn``).
    """

    grads: GhostGrads
    losses: Tensor
    outputs: Any
    new_buffers: TensorDict


class GhostGrads:
    """The per-sample gradients of one batch in factored (ghost) form.

    Built by :meth:`GhostModel.per_sample`. Holds, per layer, what its rule needs (input
    activations and output gradients, or small instantiated per-sample gradients).
    ``layer_names`` (tuple) lists the layers called in this batch; ``batch_size`` is ``B``.

    A parameter tied across layers gets the sum of its uses' gradients; its norms include
    the cross terms, and layers that share parameters form one clipping group named after
    its first layer (:mod:`torchfn.persample._ghost_tied`).
    """

    def __init__(self, layers: dict[str, Prepared], spec: dict[str, Layer],
                 params: Mapping[str, Tensor], frozen: tuple[str, ...], batch_size: int,
                 like: Tensor) -> None:
        self._layers, self._spec, self._params = layers, spec, params
        self._frozen, self.batch_size, self._like = frozen, batch_size, like
        self.layer_names = tuple(layers)
        layer_params = {n: lay.params for n, lay in spec.items()}
        self._group = tied_groups(layer_params)  # layer -> first layer of its tied group
        self._pairs = shared_pairs(layer_params)
        self._cache: dict[Any, list[Tensor]] = {}  # materialised layers of inner(): [(B, P_k)]

    def sq_norms(self, per_layer: bool = False) -> Tensor | TensorDict:
        """Return the ``(B,)`` squared per-sample gradient norms (all parameters together).

        With ``per_layer=True`` return ``{layer_name: (B,)}`` for every trainable layer of
        the model (zeros for a layer this batch did not call); their sum is the total.

        Example::

            >>> from torch import nn
            >>> from torchfn.persample import make_ghost_model
            >>> ghost, params, buffers = make_ghost_model(nn.Linear(3, 2))
            >>> loss_fn = lambda out, y: ((out - y) ** 2).sum(1)
            >>> res = ghost.per_sample(params, buffers, torch.randn(5, 3), torch.randn(5, 2),
            ...                        loss_fn)
            >>> res.grads.sq_norms().shape, list(res.grads.sq_norms(per_layer=True))
            (torch.Size([5]), [''])
        """
        zeros = self._like.new_zeros(self.batch_size)
        out = {name: (self._layers[name].sq_norms().to(zeros.dtype) if name in self._layers
                      else zeros) for name in self._spec}
        materialized: dict[int, TensorDict] = {}
        for a, b, shared in self._pairs:  # tied parameters: 2 <G_a,i, G_b,i>
            if a in self._layers and b in self._layers:
                cross = cross_dot(self._layers[a], self._layers[b], shared, materialized)
                head = self._group[a]
                out[head] = out[head] + 2 * cross.to(zeros.dtype)
        for name, head in self._group.items():  # a tied group counts as its first layer
            if head != name:
                out[head] = out[head] + out[name]
                out[name] = zeros
        if per_layer:
            return out
        total = zeros
        for v in out.values():
            total = total + v
        return total

    def weighted_sum(self, coef: Tensor | Mapping[str, Tensor]) -> TensorDict:
        """Return ``{param_name: sum_i coef_i grad_i}``, shaped like the parameters.

        ``coef`` is ``(B,)`` for all layers, or ``{layer_name: (B,)}`` (per-layer clipping;
        the first layer of every clipping group must be present -- ``GhostModel.clip_groups``;
        layers tied to an earlier one use its coefficient, extra keys are ignored). With ``coef_i = min(1, C / ||grad_i||)`` this
        is DP-SGD's clipped sum, computed book-keeping style (one GEMM per linear/conv layer
        from the recorded activations and output gradients; no second backward). With ones it
        is the ordinary summed gradient. Frozen parameters get zeros.
        """
        if isinstance(coef, Mapping):
            heads = list(dict.fromkeys(self._group[n] for n in self._spec))
            missing = [n for n in heads if n not in coef]
            if missing:
                raise ValueError(f"GhostGrads.weighted_sum(coef=...): per-layer coef is missing "
                                 f"layers {missing} (expected keys {heads}: one per clipping "
                                 "group, layers tied to an earlier one use its coefficient)")
        out: TensorDict = {}
        # small per-sample parts (biases, norm scales): one `coef @ cat(parts)` GEMM per
        # (clipping group, dtype, device) instead of one small GEMM each
        small: dict[tuple[Any, ...], tuple[Tensor, list[tuple[str, Tensor]]]] = {}
        for name, layer in self._spec.items():
            head = self._group[name] if isinstance(coef, Mapping) else None
            c = coef[head] if head is not None else coef
            sums, parts = (self._layers[name].weighted_sum_parts(c) if name in self._layers
                           else ({}, {}))
            for loc, glob in layer.params.items():
                p = self._params[glob]
                if loc in parts:
                    x = parts[loc]
                    small.setdefault((head, x.dtype, x.device), (c, []))[1].append((glob, x))
                    continue
                s = sums[loc].to(p.dtype) if loc in sums else torch.zeros_like(p)
                out[glob] = out[glob] + s if glob in out else s  # tied: sum of the uses
        for c, items in small.values():
            flat = [x.reshape(x.shape[0], -1) for _, x in items]
            summed = c.to(flat[0].dtype) @ (torch.cat(flat, 1) if len(flat) > 1 else flat[0])
            for (glob, x), s in zip(items, summed.split([f.shape[1] for f in flat]), strict=True):
                s = s.reshape(x.shape[1:]).to(self._params[glob].dtype)
                out[glob] = out[glob] + s if glob in out else s
        for glob in self._frozen:
            out[glob] = torch.zeros_like(self._params[glob])
        return {k: out[k] for k in self._params}

    def materialize(self) -> TensorDict:
        """Return ``{param_name: (B, *param.shape)}``: every per-sample gradient, explicitly.

        For tests, small models and statistics that need more than norms; memory is ``B``
        times the (trainable) model. Frozen parameters are left out.
        """
        out: TensorDict = {}
        for name, layer in self._spec.items():
            grads = self._layers[name].materialize() if name in self._layers else {}
            for loc, glob in layer.params.items():
                p = self._params[glob]
                g = (grads[loc].to(p.dtype) if loc in grads
                     else p.new_zeros(self.batch_size, *p.shape))
                out[glob] = out[glob] + g if glob in out else g  # tied: sum of the uses
        return {k: out[k] for k in self._params if k in out}

    def inner(self, other: GhostGrads, per_layer: bool = False) -> Tensor | TensorDict:
        """Return ``(B1, B2)``: ``<grad l_i, grad l'_j>`` between this batch's per-sample
        gradients and ``other``'s (a batch of the same :class:`GhostModel`).

        All trainable parameters count (frozen ones have zero gradient). Linear maps
        (``nn.Linear``, HF ``Conv1D``, convs on the default unfold route, grouped or not) use
        the ghost form ``<G_i, G'_j> = sum_{t,s} (a_it . a'_js) (g_it . g'_js)`` (plus ``(sum_t
        g_it) . (sum_s g'_js)`` for a bias), never forming a per-sample gradient, where that is
        cheaper than materialising both batches' gradients and one matmul (the cost rule of
        :func:`torchfn.persample._ghost_grads.inner_route`: dense layers, short sequences, convs
        with few output positions; grouped maps sum the ghost form over the groups). The
        same goes for the linear maps inside attention and recurrent layers. Every other layer
        (and every group of layers that share a parameter) is materialised and dotted; a
        materialised layer is kept on its :class:`GhostGrads`, so scoring one query batch
        against many train batches materialises the query once. With ``per_layer=True``
        return ``{layer_name: (B1, B2)}`` (a tied group under its first layer, the others
        zeros, as in :meth:`sq_norms`); their sum is the total. ``self.inner(self)`` has
        ``sq_norms()`` on its diagonal.

        Example::

            >>> from torch import nn
            >>> from torchfn.persample import make_ghost_model
            >>> ghost, params, buffers = make_ghost_model(nn.Linear(3, 2))
            >>> loss_fn = lambda out, y: ((out - y) ** 2).sum(1)
            >>> a = ghost.per_sample(params, buffers, torch.randn(5, 3), torch.randn(5, 2), loss_fn)
            >>> b = ghost.per_sample(params, buffers, torch.randn(4, 3), torch.randn(4, 2), loss_fn)
            >>> a.grads.inner(b.grads).shape
            torch.Size([5, 4])
        """
        if not isinstance(other, GhostGrads):
            raise TypeError(f"GhostGrads.inner(other=...): expected a GhostGrads, got "
                            f"{type(other).__name__}")
        if list(self._spec) != list(other._spec) or set(self._params) != set(other._params):
            raise ValueError("GhostGrads.inner(other=...): other comes from a different model "
                             f"(layers {list(other._spec)}, expected {list(self._spec)}); use "
                             "two batches of the same GhostModel")
        b1, b2 = self.batch_size, other.batch_size
        dtype = torch.promote_types(self._like.dtype, other._like.dtype)
        zeros = self._like.new_zeros(b1, b2, dtype=dtype)
        out = {name: zeros for name in self._spec}
        grouped = {n for n, h in self._group.items() if h != n} | {
            h for n, h in self._group.items() if h != n}
        for name in self._spec:
            if name in grouped:
                continue
            x, y = self._layers.get(name), other._layers.get(name)
            if x is None or y is None:  # the layer was not called in one of the batches
                continue
            out[name] = _layer_inner(x, y, name, self._cache, other._cache).to(dtype)
        heads = dict.fromkeys(self._group[n] for n in grouped)
        for head in heads:  # tied groups: per-sample gradients of the union of their params
            members = [n for n in self._spec if self._group[n] == head]
            gx, gy = self._materialize_group(members), other._materialize_group(members)
            for glob, t in gx.items():
                if glob in gy:
                    out[head] = out[head] + _flat_dot(t, gy[glob]).to(dtype)
        if per_layer:
            return out
        total = zeros
        for v in out.values():
            total = total + v
        return total

    def _materialize_group(self, members: list[str]) -> TensorDict:
        """``{param_name: (B, *shape)}`` over ``members``' calls in this batch (uses summed)."""
        out: TensorDict = {}
        for name in members:
            if name not in self._layers:
                continue
            grads = self._layers[name].materialize()
            for loc, glob in self._spec[name].params.items():
                if glob in self._frozen or loc not in grads:
                    continue
                g = grads[loc]
                out[glob] = out[glob] + g if glob in out else g
        return out


def _flat_dot(x: Tensor, y: Tensor) -> Tensor:
    """``(B1, ...), (B2, ...)`` -> ``(B1, B2)`` dot products of the flattened samples."""
    dtype = torch.promote_types(x.dtype, y.dtype)
    return x.reshape(x.shape[0], -1).to(dtype) @ y.reshape(y.shape[0], -1).to(dtype).T


_GHOST_INNER_BLOCK = 1 << 24  # elements of one (rows, B2, T, S, groups) block of the ghost form


def inner_route(x: _LinearLike, y: _LinearLike) -> str:
    """``"ghost"`` or ``"materialize"``: the cheaper form of one linear map's ``(B1, B2)`` inner
    products (multiply-adds; the two batches' shapes are read, nothing is computed).

    Per group the map is ``(o, k)`` (``k`` inputs, ``o`` outputs; a conv: ``k = C_in/groups *
    prod(kernel)`` patch entries, positions ``T``/``S`` its output positions). The ghost form
    ``sum_{t,s} (a_it . a'_js)(g_it . g'_js)`` costs ``B1 B2 T S (k + o)``; materialising
    both sides and one ``(B1, ok) @ (ok, B2)`` matmul costs ``(B1 T + B2 S + B1 B2) o k`` (and
    holds ``(B1 + B2) o k`` numbers). The ghost form is taken iff it costs no more: for large
    batches iff ``T S (k + o) <= o k`` -- dense layers (``T = S = 1``) always, sequence linears
    only at short lengths, convs only when the output positions are few (e.g. late, strided
    layers): the benchmark CNN's convs (``T = 784, 196``) are materialised, its dense layers not.
    """
    t = x.a.shape[1] if x.a.dim() == 3 else 1
    s = y.a.shape[1] if y.a.dim() == 3 else 1
    b1, b2 = x.a.shape[0], y.a.shape[0]
    k, o = x.a.shape[-1] // x.groups, x.g.shape[-1] // x.groups
    ghost = b1 * b2 * t * s * (k + o)
    materialize = (b1 * t + b2 * s + b1 * b2) * o * k
    return "ghost" if ghost <= materialize else "materialize"


def _linear_inner(x: _LinearLike, y: _LinearLike) -> Tensor:
    """``(B1, B2)``: ``sum_{t,s,group} (a_it . a'_js)(g_it . g'_js)`` (+ the bias term)."""
    dtype = torch.promote_types(x.a.dtype, y.a.dtype)
    ax, gx, ay, gy = (t.to(dtype) for t in (x.a, x.g, y.a, y.g))
    n = x.groups
    if ax.dim() == 2 and ay.dim() == 2 and n == 1:  # one position per sample
        out = (ax @ ay.T) * (gx @ gy.T)
        return out + gx @ gy.T if x.bias else out
    ax, gx, ay, gy = (t if t.dim() == 3 else t[:, None] for t in (ax, gx, ay, gy))
    bias = gx.sum(1) @ gy.sum(1).T if x.bias else None
    b1, t, s, b2 = ax.shape[0], ax.shape[1], ay.shape[1], ay.shape[0]
    rows = max(1, _GHOST_INNER_BLOCK // max(1, b2 * t * s * n))
    blocks = []
    if n == 1:
        for i in range(0, b1, rows):  # bound the (rows, B2, T, S) Gram blocks
            aa = torch.einsum("itd,jsd->ijts", ax[i:i + rows], ay)
            gg = torch.einsum("ito,jso->ijts", gx[i:i + rows], gy)
            blocks.append((aa * gg).sum((2, 3)))
    else:  # grouped: the groups' Gram products, summed over the groups too
        ax, gx, ay, gy = (u.unflatten(-1, (n, -1)) for u in (ax, gx, ay, gy))
        for i in range(0, b1, rows):
            aa = torch.einsum("itgd,jsgd->ijtsg", ax[i:i + rows], ay)
            gg = torch.einsum("itgo,jsgo->ijtsg", gx[i:i + rows], gy)
            blocks.append((aa * gg).sum((2, 3, 4)))
    out = torch.cat(blocks, 0)
    return out + bias if bias is not None else out


def _flat(p: Prepared, cache: dict[Any, list[Tensor]], key: Any) -> list[Tensor]:
    """``[(B, P_k)]``: ``p``'s per-sample gradients materialised, one flattened view per
    parameter (names sorted), kept in ``cache`` under ``key`` (a query batch scored against
    many train chunks is materialised once)."""
    if key not in cache:
        grads = p.materialize()
        cache[key] = [grads[k].reshape(grads[k].shape[0], -1) for k in sorted(grads)]
    return cache[key]


def _dot_lists(xs: list[Tensor], ys: list[Tensor]) -> Tensor:
    """``sum_k x_k @ y_k^T`` over matching ``(B1, P_k)``, ``(B2, P_k)`` pairs: ``(B1, B2)``."""
    total = _flat_dot(xs[0], ys[0])
    for x, y in zip(xs[1:], ys[1:], strict=True):
        total = total + _flat_dot(x, y)
    return total


def _layer_inner(x: Prepared, y: Prepared, name: str, cache_x: dict[Any, list[Tensor]],
                 cache_y: dict[Any, list[Tensor]]) -> Tensor:
    """``(B1, B2)`` inner products of one layer's per-sample gradients in two batches: per
    linear part (a linear/conv layer, an attention layer's four maps, a recurrent layer's
    weights) the cheaper of the ghost form and materialising (:func:`inner_route`); any other
    layer materialised."""
    px, py = x.linear_parts(), y.linear_parts()
    if px is None or py is None or len(px) != len(py):
        return _dot_lists(_flat(x, cache_x, name), _flat(y, cache_y, name))
    total: Tensor | None = None
    for i, (a, b) in enumerate(zip(px, py, strict=True)):
        if inner_route(a, b) == "ghost":
            d = _linear_inner(a, b)
        else:
            d = _dot_lists(_flat(a, cache_x, (name, i)), _flat(b, cache_y, (name, i)))
        total = d if total is None else total + d
    assert total is not None
    return total
