"""Random projections of per-sample gradients from the ghost pass (TRAK / LoGra style).

A linear map's per-sample gradient is ``G_i = sum_t g_it^T a_it`` (``(d_out, d_in)``; ``a``
its inputs -- a conv's unfolded patches --, ``g`` its output gradients, both recorded by
:meth:`GhostModel.per_sample`). Its Kronecker-structured projection (LoGra: Choe et al. 2024,
"What is Your Data Worth to GPT?")

    ``P_out^T G_i P_in = sum_t (g_it P_out)^T (a_it P_in)``    ``(k_out, k_in)``

is formed from the projected inputs and output gradients, never from ``G_i``: per sample
``T (d_in k_in + d_out k_out + k_in k_out)`` multiply-adds instead of ``T d_in d_out``. With
``P`` entries i.i.d. of mean 0 and variance ``1/k`` (Rademacher ``+-1/sqrt(k)`` or Gaussian),
``E[P P^T] = I``, so ``<proj_i, proj_j>`` is an unbiased estimate of ``<G_i, G_j>`` whose
variance shrinks as ``k_in k_out`` grows; scores become ``train_feats @ query_feats.T``
plus the exact products of the maps kept factored (below; :class:`ProjectedGrads`,
:func:`~torchfn.persample.projected_scores`).

Per layer (what :func:`layer_features` does, ``k`` the :class:`Projection`'s size per side):

- linear maps kept *factored* (:func:`is_factored`; ``Projection(factored=True)``, the
  default): a map applied once per sample (``T = 1``: ``G_i = g_i^T a_i`` is rank one), or
  one whose exact pair score costs no more than its projected one (``T^2 (d_in + 1 + d_out)
  <= k_in k_out``, per group) is not projected: its factors ``a`` (``(B, d_in + 1)`` with
  a bias, the ones column appended; ``(B, T, groups, d_in [+ 1])`` when ``T > 1`` or
  grouped) and ``g`` (``(B, d_out)``; ``(B, T, groups, d_out)``) are stored and the pair
  score is the exact ghost product ``<G_i, G_j> = sum_{t,s} (a_it . a_js)(g_it . g_js)``
  (``T = 1``: ``(A_x A_y^T) * (G_x G_y^T)``, two GEMMs and an elementwise product;
  :func:`factored_inner`). A dense head ``Linear(3136, 128)`` is so kept exactly with
  ``3136 + 1 + 128`` numbers per sample instead of ``k^2`` noisy ones;
- other linear maps (``nn.Linear``, HF ``Conv1D``, convs on the unfold route -- grouped convs
  per group, one ``P_in``/``P_out`` shared by the groups --, the four projections of
  ``nn.MultiheadAttention``, the weights of torchfn's recurrent layers): the form above. A
  bias is the gradient of an extra input column of ones: ``[G_i | b_i]`` ``(d_out, d_in +
  1)`` is projected, ``P_in`` having ``d_in + 1`` rows. Sizes (:func:`side_sizes`): ``k``
  per side; a side with ``d <= k`` is not projected (``P`` the identity: exact on that side)
  and leaves its share of the ``k^2`` budget to the other side;
- ``nn.Embedding`` (``(V, D)``, ``G_i = sum_t e_{id_it} g_it^T``): ``sum_t P_V[id_it]^T (g_it
  P_D)``, ``(k_V, k_D)``: rows of ``P_V`` gathered, no one-hot formed;
- every other layer (norms, vmap-fallback and direct layers, convs on the ``"grouped"``
  route) and every group of layers tied by a shared parameter: its per-sample gradients
  materialised ``(B, P_l)`` (all its parameters, names sorted) and multiplied by a dense
  random ``(P_l, k^2)`` matrix (generated in row blocks), or kept exactly when ``P_l <=
  k^2``.

The random matrices depend only on the seed, the layer's name (and part), the dimension and
the kind: generated on the CPU in float64 (``torch.Generator``), then cast to the features'
dtype and device, so CPU and CUDA features agree up to rounding and train features stored
once match query features computed later.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from torchfn.persample._ghost_grads import GhostGrads
from torchfn.persample._ghost_layers import Prepared, _EmbeddingGrads, _LinearLike

__all__ = ["ProjectedGrads", "Projection", "Projector", "dense_matrix", "factored_inner",
           "is_factored", "layer_features", "side_matrix", "side_sizes"]

TensorDict = dict[str, Tensor]
FactorDict = dict[str, tuple[Tensor, Tensor]]
KINDS = ("rademacher", "gaussian")
_DENSE_BLOCK = 1 << 22  # elements of one generated row block of a dense projection
_DENSE_CACHE = 1 << 24  # dense projections up to this many elements are kept between chunks


@dataclass(frozen=True)
class Projection:
    """A seeded random projection of per-sample gradients (see :func:`project_grads`).

    ``k``: the projected size per side of every linear map (``(k_out, k_in)``: up to ``k^2``
    features per map; a side of dimension ``<= k`` is kept exactly), and of every other layer
    ``k^2`` (kept exactly when it has at most ``k^2`` parameters). ``seed``: an int in ``[0,
    2^63)``; the same seed gives the same projection on every device and in every call.
    ``kind``: ``"rademacher"`` (entries ``+-1/sqrt(k)``) or ``"gaussian"`` (``N(0, 1/k)``).
    ``factored``: keep the linear maps of :func:`is_factored` (applied once per sample, or
    few positions) exact, stored as their factors ``a``/``g`` instead of projected (see
    :class:`ProjectedGrads`); ``False``: project every linear map.

    Example::

        >>> from torchfn.persample import Projection
        >>> Projection(k=32, seed=0)
        Projection(k=32, seed=0, kind='rademacher', factored=True)
    """

    k: int
    seed: int = 0
    kind: str = "rademacher"
    factored: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"Projection(k={self.k!r}): expected a positive int (the projected "
                             "size per side of each linear map)")
        if (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                or not 0 <= self.seed < 2**63):
            raise ValueError(f"Projection(seed={self.seed!r}): expected an int in [0, 2**63)")
        if self.kind not in KINDS:
            raise ValueError(f"Projection(kind={self.kind!r}): expected one of {KINDS}")
        if not isinstance(self.factored, bool):
            raise ValueError(f"Projection(factored={self.factored!r}): expected a bool (keep "
                             "rank-one / few-position linear maps exact as factors)")


def is_factored(projection: Projection, t: int, d_in: int, d_out: int) -> bool:
    """Whether a linear map (per group: ``d_in`` inputs, the bias's ones column included,
    ``d_out`` outputs, ``t`` positions per sample) is kept exact as factors: with
    ``projection.factored``, when ``t == 1`` (rank one per sample: ``d_in + d_out`` numbers,
    a pair score two dot products, exact whatever ``k``) or when the exact pair score's ``t^2
    (d_in + d_out)`` multiply-adds are at most the ``k_in k_out`` of the projected one
    (:func:`side_sizes`; then the factors' ``t (d_in + d_out)`` numbers are fewer than its
    features too). A map whose projection is the identity on both sides is exact either way
    and factored only when that is cheaper."""
    if not projection.factored:
        return False
    if t == 1:
        return True
    k_in, k_out = side_sizes(projection.k, d_in, d_out)
    return t * t * (d_in + d_out) <= k_in * k_out


def factored_inner(ax: Tensor, gx: Tensor, ay: Tensor, gy: Tensor) -> Tensor:
    """Return ``(N, M)``: ``<G_i, G_j> = sum_groups sum_{t,s} (a_it . a_js)(g_it . g_js)``
    between the factors of two sample sets: ``a`` ``(N, d_in)`` / ``g`` ``(N, d_out)``
    (``T = 1``, one group: ``(A_x A_y^T) * (G_x G_y^T)``) or ``(N, T, groups, d_*)`` (then
    one GEMM pair per position and group of ``x``, ``(N, M, S)`` at a time)."""
    if ax.dim() == 2 and ay.dim() == 2:
        return (ax @ ay.T) * (gx @ gy.T)
    ax, gx, ay, gy = (v[:, None, None] if v.dim() == 2 else v for v in (ax, gx, ay, gy))
    n, t, ng = ax.shape[:3]
    m, s = ay.shape[:2]
    out = ax.new_zeros(n, m)
    for g in range(ng):
        ya = ay[:, :, g].reshape(m * s, -1).T
        yg = gy[:, :, g].reshape(m * s, -1).T
        for i in range(t):
            out += ((ax[:, i, g] @ ya) * (gx[:, i, g] @ yg)).reshape(n, m, s).sum(2)
    return out


def _key_seed(seed: int, key: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _random(projection: Projection, key: str, rows: int, cols: int) -> Tensor:
    """``(rows, cols)`` float64 CPU: i.i.d. entries of mean 0, variance ``1 / cols``."""
    gen = torch.Generator().manual_seed(_key_seed(projection.seed, key))
    if projection.kind == "rademacher":
        m = torch.randint(0, 2, (rows, cols), generator=gen, dtype=torch.float64) * 2 - 1
    else:
        m = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    return m / math.sqrt(cols)


def side_sizes(k: int, d_in: int, d_out: int) -> tuple[int, int]:
    """Return ``(k_in, k_out)``: the projected sizes of a ``(d_out, d_in)`` map's two sides.

    ``min(d, k)`` each, except that a side kept exactly (``d <= k``) leaves its share of the
    ``k^2`` budget to the other side: ``k_other = min(d_other, max(k, k^2 // d_exact))`` (a
    10-class head's 129 inputs: all kept at ``k = 32``, ``10 * 129 <= 32^2``).
    """
    k_out = min(d_out, k)
    k_in = min(d_in, max(k, k * k // k_out))
    if k_in == d_in:
        k_out = min(d_out, max(k, k * k // k_in))
    return k_in, k_out


def side_matrix(projection: Projection, key: str, d: int, k: int) -> Tensor:
    """Return ``(d, k)`` float64 on the CPU: the projection of one side ``key`` (dimension
    ``d``, projected size ``k`` from :func:`side_sizes`), the identity when ``k == d``.

    Keys: ``"{layer}#{part}/in"`` and ``"{layer}#{part}/out"`` for part ``part`` of a linear
    layer (its ``linear_parts()`` order; ``in`` has ``d_in + 1`` rows with a bias) and for an
    embedding (part 0; ``in``: the ids side ``V``, ``out``: ``D``).
    """
    if k >= d:
        return torch.eye(d, dtype=torch.float64)
    return _random(projection, key, d, k)


def dense_matrix(projection: Projection, key: str, p: int) -> Tensor:
    """Return ``(p, min(p, k^2))`` float64 on the CPU: the dense projection of layer ``key``
    (``"{layer}/dense"``), concatenated from its row blocks; the identity when ``p <= k^2``.
    Built whole for tests; :class:`Projector` uses the blocks."""
    m = projection.k ** 2
    if p <= m:
        return torch.eye(p, dtype=torch.float64)
    return torch.cat([b for _, b in _dense_blocks(projection, key, p)], 0)


def _dense_blocks(projection: Projection, key: str, p: int) -> Iterator[tuple[slice, Tensor]]:
    m = projection.k ** 2
    rows = max(1, _DENSE_BLOCK // m)
    for i, lo in enumerate(range(0, p, rows)):
        hi = min(p, lo + rows)
        yield slice(lo, hi), _random(projection, f"{key}/{i}", hi - lo, m)


class Projector:
    """A :class:`Projection` with its matrices cached per key, dtype and device (one per
    :func:`project_grads` / :func:`grad_inner_products` call: shared by its chunks)."""

    def __init__(self, projection: Projection) -> None:
        self.projection = projection
        self._cache: dict[tuple[str, int, torch.dtype, torch.device], Tensor] = {}
        self._dense: dict[tuple[str, int, torch.dtype, torch.device],
                          list[tuple[slice, Tensor]]] = {}

    def side(self, key: str, d: int, k: int, like: Tensor) -> Tensor:
        ck = (key, d, like.dtype, like.device)
        if ck not in self._cache:
            self._cache[ck] = side_matrix(self.projection, key, d, k).to(like.device, like.dtype)
        return self._cache[ck]

    def dense(self, flat: Tensor, key: str) -> Tensor:
        """``(B, P)`` -> ``(B, min(P, k^2))``: ``flat`` times the dense projection of ``key``."""
        p, m = flat.shape[1], self.projection.k ** 2
        if p <= m:
            return flat
        ck = (key, p, flat.dtype, flat.device)
        blocks = self._dense.get(ck)
        if blocks is None:
            blocks = ((s, b.to(flat.device, flat.dtype))
                      for s, b in _dense_blocks(self.projection, key, p))
            if p * m <= _DENSE_CACHE:
                blocks = self._dense[ck] = list(blocks)
        out: Tensor | None = None
        for s, b in blocks:
            part = flat[:, s] @ b
            out = part if out is None else out + part
        assert out is not None
        return out


def _factors(p: _LinearLike, proj: Projector) -> tuple[Tensor, Tensor] | None:
    """``(a, g)`` of a linear part kept factored (:func:`is_factored`), the bias's ones column
    appended to ``a``: ``(B, d_in [+ 1])``/``(B, d_out)`` for ``T = 1`` and one group, else
    ``(B, T, groups, *)``; ``None`` for a part to project."""
    a, g = p._grouped()  # (B, T, G, k), (B, T, G, o)
    if not is_factored(proj.projection, a.shape[1], a.shape[-1] + int(p.bias), g.shape[-1]):
        return None
    if p.bias:
        a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], -1)
    if a.shape[1] == 1 and a.shape[2] == 1:
        return a[:, 0, 0], g[:, 0, 0]
    return a, g


def _linear(p: _LinearLike, key: str, proj: Projector) -> Tensor:
    """``(B, groups * k_out * k_in)``: ``P_out^T [G_i | b_i] P_in`` per group, from ``a``/``g``
    (a side kept exactly is not multiplied by its identity)."""
    a, g = p._grouped()  # (B, T, G, k), (B, T, G, o)
    kin, o = a.shape[-1], g.shape[-1]
    k_in, k_out = side_sizes(proj.projection.k, kin + int(p.bias), o)
    if k_in == kin + int(p.bias):
        ap = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], -1) if p.bias else a
    else:
        p_in = proj.side(f"{key}/in", kin + int(p.bias), k_in, a)
        ap = a @ p_in[:kin]
        if p.bias:
            ap = ap + p_in[kin]  # the column of ones
    gp = g if k_out == o else g @ proj.side(f"{key}/out", o, k_out, g)
    b, t, n = ap.shape[:3]
    if n == 1:  # (B, k_out, T) @ (B, T, k_in)
        feats = torch.bmm(gp.reshape(b, t, -1).transpose(1, 2), ap.reshape(b, t, -1))
    else:
        feats = torch.einsum("btgq,btgp->bgqp", gp, ap)
    return feats.reshape(b, -1)


def _embedding(p: _EmbeddingGrads, key: str, proj: Projector) -> Tensor:
    """``(B, k_V * k_D)``: ``sum_t P_V[id_it]^T (g_it P_D)``."""
    k_in, k_out = side_sizes(proj.projection.k, p.n, p.g.shape[-1])
    p_in = proj.side(f"{key}/in", p.n, k_in, p.g)
    p_out = proj.side(f"{key}/out", p.g.shape[-1], k_out, p.g)
    feats = torch.einsum("btp,btq->bpq", p_in[p.ids], p.g @ p_out)
    return feats.reshape(feats.shape[0], -1)


def _flat(grads: TensorDict) -> Tensor:
    names = sorted(grads)
    b = grads[names[0]].shape[0]
    dtype = grads[names[0]].dtype
    return torch.cat([grads[n].reshape(b, -1).to(dtype) for n in names], 1)


def _layer(p: Prepared, name: str, proj: Projector, factored: FactorDict) -> Tensor:
    """``(B, K_layer)``: the layer's projected features (``(B, 0)`` when every part is kept
    factored); its factored parts go to ``factored["{name}#{part}"]``."""
    if isinstance(p, _EmbeddingGrads):
        return _embedding(p, f"{name}#0", proj)
    parts = p.linear_parts()
    if parts is not None:
        feats = []
        for i, q in enumerate(parts):
            f = _factors(q, proj)
            if f is None:
                feats.append(_linear(q, f"{name}#{i}", proj))
            else:
                factored[f"{name}#{i}"] = f
        if not feats:
            return q.g.new_zeros(q.g.shape[0], 0)
        return torch.cat(feats, 1)
    return proj.dense(_flat(p.materialize()), f"{name}/dense")


def layer_features(grads: GhostGrads, proj: Projector) -> tuple[TensorDict, FactorDict]:
    """Return ``({layer: (B, K_layer)}, {"layer#part": (a, g)})``: the projected per-sample
    gradients of every layer called in this batch (a group of layers tied by a shared
    parameter under its first layer; the others absent; ``(B, 0)`` for a layer whose parts
    are all factored) and the factors of the linear parts kept exact (:func:`is_factored`),
    all in the dtype of the per-sample losses."""
    spec, group, layers = grads._spec, grads._group, grads._layers
    dtype = grads._like.dtype
    out: TensorDict = {}
    factored: FactorDict = {}
    for name in spec:
        head = group[name]
        members = [n for n in spec if group[n] == head]
        if len(members) > 1:
            if name == head:
                union = grads._materialize_group(members)
                if union:
                    out[head] = proj.dense(_flat(union), f"{head}/dense").to(dtype)
            continue
        if name in layers:
            out[name] = _layer(layers[name], name, proj, factored).to(dtype)
    return out, {k: (a.to(dtype), g.to(dtype)) for k, (a, g) in factored.items()}


def part_layer(key: str) -> str:
    """The layer of a factored part's key ``"{layer}#{part}"``."""
    return key.rpartition("#")[0]


class ProjectedGrads(NamedTuple):
    """Per-sample gradient features from :func:`~torchfn.persample.project_grads`: store them
    once for a train set, score query sets with :func:`~torchfn.persample.projected_scores`.

    ``projected``: ``(N, K)`` random projections (every projected layer's block, in
    ``ghost.layer_names`` order), or ``{layer: (N, K_layer)}`` with ``per_layer=True``
    (``(N, 0)`` for a layer kept wholly factored). ``factored``: ``{"{layer}#{part}": (a,
    g)}``, the exact factors of the linear maps :func:`is_factored` keeps (part: the index in
    the layer's linear parts, 0 for a plain linear or conv): ``a`` ``(N, d_in + 1)`` (the
    inputs and, with a bias, a column of ones) and ``g`` ``(N, d_out)`` (the output
    gradients) for a map applied once per sample; ``(N, T, groups, *)`` for few positions or
    grouped. ``projection``: the :class:`Projection` they were made with. The score of a
    pair is ``<proj_i, proj_j> + sum_parts <G_i, G_j>`` (:func:`factored_inner`).
    """

    projected: Tensor | TensorDict
    factored: FactorDict
    projection: Projection

    @property
    def num_features(self) -> int:
        """Numbers stored per sample: projected features plus the factors."""
        p = self.projected
        k = sum(v.shape[1] for v in p.values()) if isinstance(p, dict) else p.shape[1]
        return int(k + sum(a[0].numel() + g[0].numel() for a, g in self.factored.values()))


def feature_inner(fx: ProjectedGrads, fy: ProjectedGrads, names: tuple[str, ...] | None,
                  like: Tensor, per_layer: bool, where: str) -> Tensor | TensorDict:
    """``(N, M)``: ``fx.projected @ fy.projected.T`` plus every factored part's exact product;
    ``per_layer`` (both ``projected`` dicts): ``{layer: (N, M)}`` over ``names`` (or every
    layer seen), zeros where a layer has no features in one of the sets."""
    if fx.projection != fy.projection:
        raise ValueError(f"{where}: the two feature sets were made with different projections "
                         f"({fx.projection} vs {fy.projection}); compute both with one")
    if set(fx.factored) != set(fy.factored):
        diff = sorted(set(fx.factored) ^ set(fy.factored))
        raise ValueError(f"{where}: linear parts {diff} are kept factored in one feature set "
                         "and projected in the other (the rule depends on the positions T per "
                         "sample: different sequence lengths?); pass Projection(..., "
                         "factored=False) for both")
    px, py = fx.projected, fy.projected
    if isinstance(px, dict) != isinstance(py, dict):
        raise ValueError(f"{where}: one feature set is per layer (per_layer=True) and the "
                         "other is not; compute both the same way")
    if not isinstance(px, dict):
        if per_layer:
            raise ValueError(f"{where}(per_layer=True): needs features from "
                             "project_grads(..., per_layer=True)")
        assert isinstance(py, Tensor)
        if px.shape[1] != py.shape[1]:
            raise ValueError(f"{where}: {px.shape[1]} projected features in one set but "
                             f"{py.shape[1]} in the other (different models or layers called)")
    fac = {k: factored_inner(*fx.factored[k], *fy.factored[k]) for k in fx.factored}
    if not isinstance(px, dict):
        total = px @ py.T  # type: ignore[union-attr]
        for v in fac.values():
            total = total + v
        return total
    assert isinstance(py, dict)
    zeros = like.new_zeros(next(iter(px.values())).shape[0], next(iter(py.values())).shape[0])
    if names is None:
        names = tuple(dict.fromkeys([*px, *py, *(part_layer(k) for k in fac)]))
    out = {n: (px[n] @ py[n].T if n in px and n in py else zeros) for n in names}
    for k, v in fac.items():
        out[part_layer(k)] = out[part_layer(k)] + v
    if per_layer:
        return out
    total = zeros
    for v in out.values():
        total = total + v
    return total
