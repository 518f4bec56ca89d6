"""Parameters tied across ghost layers: clipping groups and the cross terms of their norms.

A parameter used by several layers (GPT-2's ``wte.weight`` is ``lm_head.weight``) gets, per
sample, the sum of each use's gradient, so its squared norm needs the cross terms:
``||G_a,i + G_b,i||^2 = ||G_a,i||^2 + ||G_b,i||^2 + 2 <G_a,i, G_b,i>`` (three or more uses: every
pair once). :func:`cross_dot` returns ``<G_a,i, G_b,i>`` over the shared parameters:

- ``nn.Embedding`` (ids ``(B, T)``, output gradients ``e (B, T, D)``) and ``nn.Linear`` (inputs
  ``a (B, S, D)``, output gradients ``g (B, S, V)``) sharing the ``(V, D)`` weight:
  ``sum_{s,t} g_i[s, id_i[t]] <a_i[s], e_i[t]>``, ``O(B S T D)``, no ``V x D`` per sample;
- two ``nn.Linear`` (same orientation): ``sum_{s,t} <g_a,i[s], g_b,i[t]> <a_a,i[s], a_b,i[t]>``
  (plus ``<sum_s g_a,i[s], sum_t g_b,i[t]>`` for a shared bias);
- any other pair: both layers' per-sample gradients materialised, then dotted.

Clipping groups (:func:`tied_groups`): layers that share a parameter (directly or through a
chain) form one group, named after its first layer (in the model's order). Its per-layer
squared norm is the norm of the gradient of the union of the group's parameters, cross terms
included; the other layers of the group report zeros and their weighted sums use the first
layer's coefficient. Per-layer clipping (``clipping="per_layer"``) therefore clips a tied
group as one block under the first layer's threshold; the others' thresholds still count in
the total sensitivity (a conservative over-count).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from torchfn.persample._ghost_layers import Prepared, _EmbeddingGrads, _LinearLike

__all__: list[str] = []  # private to torchfn.persample._ghost_grads

TensorDict = dict[str, Tensor]


def tied_groups(layer_params: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """Return ``{layer: first layer of its group}`` for layers linked by shared parameters."""
    head = {name: name for name in layer_params}

    def find(n: str) -> str:
        while head[n] != n:
            n = head[n]
        return n

    user: dict[str, str] = {}
    for name, params in layer_params.items():  # insertion order: the model's layer order
        for glob in params.values():
            if glob in user:
                a, b = find(user[glob]), find(name)
                if a != b:
                    head[b] = a  # a came first
            else:
                user[glob] = name
    return {n: find(n) for n in layer_params}


def shared_pairs(layer_params: Mapping[str, Mapping[str, str]]
                 ) -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """Return ``[(layer_a, layer_b, [(global, local_a, local_b), ...])]`` for each pair of
    layers that share parameters (``a`` before ``b``)."""
    names = list(layer_params)
    out = []
    for i, a in enumerate(names):
        inv_a = {g: loc for loc, g in layer_params[a].items()}
        for b in names[i + 1:]:
            common = [(g, inv_a[g], loc) for loc, g in layer_params[b].items() if g in inv_a]
            if common:
                out.append((a, b, common))
    return out


def _dtype(*ts: Tensor) -> torch.dtype:
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _seq(x: Tensor) -> Tensor:
    return x[:, None] if x.dim() == 2 else x


def _embedding_linear(emb: _EmbeddingGrads, lin: _LinearLike) -> Tensor:
    """``<G_emb,i, G_lin,i>`` for a ``(V, D)`` weight shared by an embedding and a linear."""
    dtype = _dtype(emb.g, lin.a, lin.g)
    e, a, g = emb.g.to(dtype), _seq(lin.a).to(dtype), _seq(lin.g).to(dtype)
    b, s, t = a.shape[0], a.shape[1], emb.ids.shape[1]
    picked = torch.gather(g, 2, emb.ids[:, None, :].expand(b, s, t))  # g_i[s, id_i[t]]
    return (picked * torch.bmm(a, e.transpose(1, 2))).sum((1, 2))


def _linear_linear(x: _LinearLike, y: _LinearLike, locals_: set[str]) -> Tensor:
    """``<G_x,i, G_y,i>`` for two linear maps of the same orientation (weight, maybe bias)."""
    dtype = _dtype(x.a, x.g, y.a, y.g)
    ax, gx, ay, gy = (_seq(t).to(dtype) for t in (x.a, x.g, y.a, y.g))
    out = (torch.bmm(gx, gy.transpose(1, 2)) * torch.bmm(ax, ay.transpose(1, 2))).sum((1, 2))
    if "bias" in locals_:
        out = out + (gx.sum(1) * gy.sum(1)).sum(1)
    return out


def _plain_linear(p: Prepared) -> bool:
    return type(p) is _LinearLike and p.groups == 1


def cross_dot(pa: Prepared, pb: Prepared, shared: list[tuple[str, str, str]],
              materialized: dict[int, TensorDict]) -> Tensor:
    """Return ``(B,)``: ``sum over shared parameters of <G_a,i, G_b,i>``.

    ``shared``: ``(global, local_a, local_b)``; ``materialized`` caches per-sample gradients
    of layers that take the generic route (keyed by ``id`` of the prepared layer).
    """
    locs_a = {la for _, la, _ in shared}
    locs_b = {lb for _, _, lb in shared}
    same_names = all(la == lb for _, la, lb in shared)
    if same_names and locs_a == {"weight"}:
        if isinstance(pa, _EmbeddingGrads) and _plain_linear(pb) and not pb.transposed:
            return _embedding_linear(pa, pb)
        if isinstance(pb, _EmbeddingGrads) and _plain_linear(pa) and not pa.transposed:
            return _embedding_linear(pb, pa)
    if (same_names and isinstance(pa, _LinearLike) and isinstance(pb, _LinearLike)
            and _plain_linear(pa) and _plain_linear(pb) and pa.transposed == pb.transposed
            and "weight" in locs_a and locs_a <= {"weight", "bias"}):
        return _linear_linear(pa, pb, locs_b)
    for p in (pa, pb):
        if id(p) not in materialized:
            materialized[id(p)] = p.materialize()
    ga, gb = materialized[id(pa)], materialized[id(pb)]
    total: Tensor | None = None
    for _, la, lb in shared:
        x, y = ga[la], gb[lb]
        dtype = _dtype(x, y)
        d = (x.to(dtype) * y.to(dtype)).flatten(1).sum(1)
        total = d if total is None else total + d
    assert total is not None
    return total
