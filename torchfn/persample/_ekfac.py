"""EK-FAC: eigenvalue-corrected Kronecker-factored curvature of ``nn.Linear`` layers.

George et al. 2018 ("Fast approximate natural gradient descent in a Kronecker-factored
eigenbasis"); Grosse et al. 2023 ("Studying large language model generalization with influence
functions"). Per linear layer, with ``a`` its input (a ``1`` appended when it has a bias) and
``s`` the backpropagated "pseudo-gradient" at its output:

- ``A = sum a a^T``, ``S = sum s s^T`` over samples (and positions), eigendecomposed into
  ``Q_A``, ``Q_S`` (their scale does not matter: only the eigenbases are used);
- ``Lambda = mean_n sum_probes (Q_S^T G_n Q_A)^2`` elementwise, ``G_n = sum_t s_nt a_nt^T`` the
  per-sample pseudo-gradient of the layer's ``[W, b]`` (the eigenvalue correction);
- ``(C + damping I)^{-1} V = Q_S ((Q_S^T V Q_A) / (Lambda + damping)) Q_A^T``.

The activations ``a`` and output gradients ``s`` come from the ghost machinery
(:meth:`GhostModel.per_sample`), so no per-sample weight gradient is formed while fitting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, NamedTuple

import optree
import torch
from torch import Tensor, nn
from torch.func import hessian, vmap

from torchfn._checks import _call_model
from torchfn.persample._ghost_grads import GhostGrads
from torchfn.persample._ghost_layers import _LinearLike
from torchfn.persample._ghost_norms import GhostModel

__all__ = ["EKFAC", "EKFACLayer", "ekfac_inverse_hvp", "fit_ekfac"]

TensorDict = dict[str, Tensor]
LossFn = Callable[[Any, Any], Tensor]
_FISHERS = ("ggn", "empirical")
_OTHER = ("error", "identity")


class EKFACLayer(NamedTuple):
    """One ``nn.Linear`` layer's EK-FAC factors.

    ``weight``/``bias``: the parameter names (``bias`` None without one); ``q_a`` ``(d_in',
    d_in')`` and ``q_s`` ``(d_out, d_out)``: eigenbases of the input and output covariances
    (``d_in' = d_in + 1`` with a bias); ``lam`` ``(d_out, d_in')``: the fitted eigenvalues.
    """

    weight: str
    bias: str | None
    q_a: Tensor
    q_s: Tensor
    lam: Tensor


class EKFAC(NamedTuple):
    """What :func:`fit_ekfac` returns: ``layers`` (``{layer_name: EKFACLayer}``), ``identity``
    (names of the parameters outside ``nn.Linear`` layers, approximated by ``0``: damping
    only) and ``n_samples`` (how many samples the fit saw)."""

    layers: dict[str, EKFACLayer]
    identity: tuple[str, ...]
    n_samples: int


def _linear_layers(ghost: GhostModel, other_layers: str, where: str
                   ) -> tuple[dict[str, tuple[str, str | None]], tuple[str, ...]]:
    layers: dict[str, tuple[str, str | None]] = {}
    others: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name, lay in ghost._layers.items():
        names = [g for g in lay.params.values() if g not in ghost.frozen]
        for g in names:
            if g in seen:
                raise ValueError(f"{where}: parameter {g!r} is used by layers {seen[g]!r} and "
                                 f"{name!r} (tied); EK-FAC's per-layer factors assume each "
                                 "parameter belongs to one layer")
            seen[g] = name
        if not names:
            continue
        if type(lay.module) is nn.Linear and set(lay.params) <= {"weight", "bias"} \
                and "weight" in lay.params:
            if len(names) != len(lay.params):
                raise ValueError(f"{where}: linear layer {name!r} is partly frozen; freeze all "
                                 "or none of its parameters")
            layers[name] = (lay.params["weight"], lay.params.get("bias"))
        else:
            others[name] = ghost.layer_kinds[name]
    if others and other_layers == "error":
        listing = ", ".join(f"{n or '<root>'!r} ({k})" for n, k in others.items())
        raise ValueError(
            f"{where}: EK-FAC covers nn.Linear layers only; the model also trains {listing}. "
            "Pass other_layers='identity' to treat their parameters with damping alone "
            "(curvature 0: (H + damping I)^{-1} v ~ v / damping there), freeze them, or use "
            "method='cg'")
    identity = tuple(g for n in others for g in ghost._layers[n].params.values()
                     if g not in ghost.frozen)
    return layers, identity


def _chunks(inputs: Any, targets: Any, chunk: int | None, n: int) -> Iterator[tuple[Any, Any]]:
    step = n if chunk is None else chunk
    for i in range(0, n, step):
        def take(t: Any, i: int = i) -> Any:
            return t[i:i + step] if isinstance(t, Tensor) and t.dim() and t.shape[0] == n else t
        yield optree.tree_map(take, inputs), optree.tree_map(take, targets)


def _n(inputs: Any, where: str) -> int:
    for t in optree.tree_leaves(inputs):
        if isinstance(t, Tensor) and t.dim():
            return t.shape[0]
    raise ValueError(f"{where}: inputs hold no batched tensor")


def _records(ghost: GhostModel, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
             loss_fn: LossFn, inputs: Any, targets: Any, fisher: str, layers: Mapping[str, Any],
             where: str) -> Iterator[dict[str, tuple[Tensor, Tensor]]]:
    """Yield, per probe, ``{layer: (a (B, T, d_in'), s (B, T, d_out))}``."""
    if fisher == "empirical":
        cot_loss, probes = loss_fn, [targets]
    else:
        out = _call_model(ghost, params, buffers, inputs, where)[0]
        if not isinstance(out, Tensor):
            raise TypeError(f"{where}(fisher='ggn'): the model must return a tensor (its output "
                            f"Hessian is factored), got {type(out).__name__}; use "
                            "fisher='empirical'")
        shape = out.shape[1:]

        def one(o: Tensor, y: Any) -> Tensor:
            yb = optree.tree_map(lambda t: t[None], y)
            return loss_fn(o.reshape(1, *shape), yb)[0]

        h_out = vmap(hessian(one))(out.detach().flatten(1), targets)  # (B, O, O)
        e, q = torch.linalg.eigh(h_out)
        root = q * e.clamp_min(0).sqrt()[:, None, :]  # H_out = root root^T; probes: columns

        def cot_loss(o: Tensor, c: Tensor) -> Tensor:
            return (o.flatten(1) * c).sum(1)

        probes = [root[:, :, k] for k in range(root.shape[2])]
    for c in probes:
        grads: GhostGrads = ghost.per_sample(params, buffers, inputs, c, cot_loss).grads
        rec = {}
        for name, (_, bias) in layers.items():
            if name not in grads._layers:
                continue  # not called in this batch
            p = grads._layers[name]
            assert isinstance(p, _LinearLike)
            a, s = (p.a, p.g) if p.a.dim() == 3 else (p.a[:, None], p.g[:, None])
            if bias is not None:
                a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], -1)
            rec[name] = (a, s)
        yield rec


def fit_ekfac(ghost: GhostModel, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
              loss_fn: LossFn, inputs: Any, targets: Any, *,
              fisher: Literal["ggn", "empirical"] = "ggn",
              other_layers: Literal["error", "identity"] = "error",
              chunk_size: int | None = None) -> EKFAC:
    """Return :class:`EKFAC`: eigenbases and fitted eigenvalues of every ``nn.Linear`` layer.

    The curvature approximated is that of the MEAN of ``loss_fn(outputs, targets)`` (``(B,)``
    per-sample losses) over the batch. ``fisher`` picks the pseudo-gradients ``s``:

    - ``"ggn"`` (default): the Gauss-Newton matrix ``J^T H_out J``, exactly: each sample's
      Hessian of the loss with respect to the model's (tensor) output, ``O x O`` with ``O``
      its size, is factored ``H_out = L L^T`` (negative eigenvalues clipped to 0) and each of
      the ``O`` columns of ``L`` is backpropagated (``O`` ghost passes). For cross-entropy
      this is the true Fisher (labels sampled from the model's predictive distribution, in
      expectation, without the sampling noise); for ``0.5 * squared error`` the GGN.
    - ``"empirical"``: the gradients of the loss at the given (true) labels: the empirical
      Fisher, one pass; cheaper, but biased where the model fits poorly.

    Layers: ``nn.Linear`` (weight and bias together, one Kronecker block). Every other layer
    with trainable parameters raises ``ValueError`` unless ``other_layers="identity"``: their
    curvature is then taken as 0, so the inverse is ``v / damping`` there. Tied parameters
    are refused. ``chunk_size`` bounds how many samples one ghost pass sees. Cost: two passes
    over the data (factors, then eigenvalues), ``O`` ghost passes each with ``"ggn"``, plus
    eigendecompositions of ``d_in' x d_in'`` and ``d_out x d_out`` per layer.

    Example::

        >>> import torch.nn.functional as F
        >>> from torchfn.persample import make_ghost_model
        >>> ghost, params, buffers = make_ghost_model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
        ...                                                         nn.Linear(8, 3)))
        >>> loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> ek = fit_ekfac(ghost, params, buffers, loss_fn, x, y)
        >>> ek.layers["0"].lam.shape, ek.layers["2"].q_s.shape   # (d_out, d_in + 1)
        (torch.Size([8, 5]), torch.Size([3, 3]))
    """
    where = "fit_ekfac"
    if not isinstance(ghost, GhostModel):
        raise TypeError(f"{where}(ghost=...): expected a GhostModel (from make_ghost_model), got "
                        f"{type(ghost).__name__}")
    if fisher not in _FISHERS:
        raise ValueError(f"{where}(fisher=...): expected one of {_FISHERS}, got {fisher!r}")
    if other_layers not in _OTHER:
        raise ValueError(f"{where}(other_layers=...): expected one of {_OTHER}, got "
                         f"{other_layers!r}")
    layers, identity = _linear_layers(ghost, other_layers, where)
    n = _n(inputs, where)
    cov: dict[str, list[Tensor]] = {}
    for x, y in _chunks(inputs, targets, chunk_size, n):
        for rec in _records(ghost, params, buffers, loss_fn, x, y, fisher, layers, where):
            for name, (a, s) in rec.items():
                ca, cs = a.flatten(0, 1).T @ a.flatten(0, 1), s.flatten(0, 1).T @ s.flatten(0, 1)
                if name in cov:
                    cov[name][0] += ca
                    cov[name][1] += cs
                else:
                    cov[name] = [ca, cs]
    bases = {name: (torch.linalg.eigh(ca)[1], torch.linalg.eigh(cs)[1])
             for name, (ca, cs) in cov.items()}
    lam: dict[str, Tensor] = {}
    for x, y in _chunks(inputs, targets, chunk_size, n):
        for rec in _records(ghost, params, buffers, loss_fn, x, y, fisher, layers, where):
            for name, (a, s) in rec.items():
                q_a, q_s = bases[name]
                rot = torch.einsum("bto,bti->boi", s @ q_s, a @ q_a)  # Q_S^T G_n Q_A
                sq = rot.square().sum(0)
                lam[name] = lam[name] + sq if name in lam else sq
    out = {}
    for name, (w, b) in layers.items():
        if name not in bases:
            raise ValueError(f"{where}: layer {name!r} was not called on these inputs; its "
                             "curvature cannot be fitted")
        q_a, q_s = bases[name]
        out[name] = EKFACLayer(w, b, q_a, q_s, lam[name] / n)
    return EKFAC(out, identity, n)


def ekfac_inverse_hvp(ekfac: EKFAC, v: Mapping[str, Tensor], *, damping: float,
                      stacked: bool = False) -> TensorDict:
    """Return ``(C + damping I)^{-1} v``, ``C`` the EK-FAC curvature, shaped like ``v``.

    ``v``: ``{param_name: param.shape}`` (``stacked=True``: ``(k, *param.shape)``) for every
    parameter of ``ekfac``'s layers and its ``identity`` parameters (which get ``v /
    damping``); other keys are refused. ``damping`` must be > 0 (fitted eigenvalues may be 0).
    Per layer: ``Q_S ((Q_S^T [V_W, v_b] Q_A) / (Lambda + damping)) Q_A^T``.

    Example::

        >>> import torch.nn.functional as F
        >>> from torchfn.persample import make_ghost_model
        >>> ghost, params, buffers = make_ghost_model(nn.Linear(4, 3))
        >>> loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> ek = fit_ekfac(ghost, params, buffers, loss_fn, torch.randn(16, 4),
        ...                torch.randint(0, 3, (16,)))
        >>> x = ekfac_inverse_hvp(ek, params, damping=0.1)
        >>> sorted(x), x["weight"].shape
        (['bias', 'weight'], torch.Size([3, 4]))
    """
    where = "ekfac_inverse_hvp"
    if isinstance(damping, bool) or not isinstance(damping, int | float) or not damping > 0:
        raise ValueError(f"{where}(damping=...): EK-FAC needs damping > 0 (fitted eigenvalues "
                         f"may be 0), got {damping!r}")
    known = {n for lay in ekfac.layers.values() for n in (lay.weight, lay.bias) if n}
    known |= set(ekfac.identity)
    if set(v) != known:
        raise ValueError(f"{where}(v=...): expected the keys {sorted(known)} (the fitted "
                         f"layers' and identity parameters), got {sorted(v)}")
    out: TensorDict = {n: v[n] / damping for n in ekfac.identity}
    for lay in ekfac.layers.values():
        w = v[lay.weight]
        if w.dim() != 2 + stacked:
            raise ValueError(f"{where}(v=...): {lay.weight!r} has shape {tuple(w.shape)}, "
                             f"expected {'(k, d_out, d_in)' if stacked else '(d_out, d_in)'}")
        mat = torch.cat([w, v[lay.bias][..., None]], -1) if lay.bias else w
        rot = lay.q_s.T @ mat.to(lay.q_a.dtype) @ lay.q_a
        x = lay.q_s @ (rot / (lay.lam + damping)) @ lay.q_a.T
        x = x.to(w.dtype)
        if lay.bias:
            out[lay.weight], out[lay.bias] = x[..., :-1], x[..., -1]
        else:
            out[lay.weight] = x
    return {k: out[k] for k in v}


def ekfac_self_influence(ekfac: EKFAC, grads: GhostGrads, damping: float) -> Tensor:
    """``(B,)``: ``g_i^T (C + damping I)^{-1} g_i`` from ghost per-sample gradients."""
    total = grads._like.new_zeros(grads.batch_size)
    lin_layers = set(ekfac.layers)
    for name, lay in ekfac.layers.items():
        if name not in grads._layers:
            continue
        p = grads._layers[name]
        assert isinstance(p, _LinearLike)
        a, s = (p.a, p.g) if p.a.dim() == 3 else (p.a[:, None], p.g[:, None])
        if lay.bias is not None:
            a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], -1)
        rot = torch.einsum("bto,bti->boi", s @ lay.q_s, a @ lay.q_a)
        total = total + (rot.square() / (lay.lam + damping)).sum((1, 2)).to(total.dtype)
    if ekfac.identity:
        per_layer = grads.sq_norms(per_layer=True)
        assert isinstance(per_layer, dict)
        for name, sq in per_layer.items():
            if name not in lin_layers:
                total = total + sq.to(total.dtype) / damping
    return total
