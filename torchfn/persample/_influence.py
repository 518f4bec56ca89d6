"""Influence functions (Koh & Liang 2017): ``-g_query^T (H + damping I)^{-1} g_train``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.func import grad, jacrev, jvp, vjp, vmap

from torchfn._checks import _call_model, math_attention
from torchfn.persample._attribution import grad_inner_products
from torchfn.persample._ekfac import EKFAC, ekfac_inverse_hvp, ekfac_self_influence, fit_ekfac
from torchfn.persample._ghost_norms import GhostModel
from torchfn.persample._ihvp import _solve, inverse_hvp

__all__ = ["influence_scores", "self_influence"]

TensorDict = dict[str, Tensor]
LossFn = Callable[[Any, Any], Tensor]
_METHODS = ("cg", "lissa", "ekfac", "identity")
_SELF_METHODS = (*_METHODS, "tracin")
_EKFAC_KEYS = ("ekfac", "fisher", "other_layers", "chunk_size")
_SOLVER_KEYS = ("tol", "max_iter", "scale", "depth", "repeats", "batch_size", "generator",
                "hvp_mode", "curvature")
_SOLVE_DEFAULTS = {"tol": 1e-6, "max_iter": None, "scale": None, "depth": 100, "repeats": 1,
                   "batch_size": None, "generator": None}
_CURVATURES = ("hessian", "ggn")


def _pair(data: Any, name: str, where: str) -> tuple[Any, Any]:
    if not isinstance(data, tuple | list) or len(data) != 2:
        raise TypeError(f"{where}({name}=...): expected a pair (inputs, targets), got "
                        f"{type(data).__name__}" + (f" of length {len(data)}"
                                                    if isinstance(data, tuple | list) else ""))
    return data[0], data[1]


def _loss_vector(model_fn: Any, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                 loss_fn: LossFn, where: str) -> Callable[[TensorDict, Any, Any], Tensor]:
    def losses(p: TensorDict, inputs: Any, targets: Any) -> Tensor:
        out = _call_model(model_fn, {**params, **p}, buffers, inputs, where)[0]
        vals = loss_fn(out, targets)
        if not isinstance(vals, Tensor) or vals.dim() != 1:
            seen = (f"shape {tuple(vals.shape)}" if isinstance(vals, Tensor)
                    else type(vals).__name__)
            raise ValueError(f"{where}: loss_fn(outputs, targets) must return the (B,) "
                             f"per-sample losses (e.g. reduction='none'), got {seen}")
        return vals
    return losses


def _check_damping(damping: Any, method: str, where: str) -> float:
    if isinstance(damping, bool) or not isinstance(damping, int | float) or damping < 0:
        raise ValueError(f"{where}(damping=...): expected a float >= 0, got {damping!r}")
    if method in ("ekfac", "identity") and damping <= 0:
        raise ValueError(f"{where}(method={method!r}): needs damping > 0 (its curvature may be "
                         f"0 in some directions), got {damping!r}")
    return float(damping)


def _split_options(method: str, options: dict[str, Any], where: str) -> None:
    allowed = (_EKFAC_KEYS if method == "ekfac" else _SOLVER_KEYS if method in ("cg", "lissa")
               else ())
    bad = sorted(set(options) - set(allowed))
    if bad:
        raise TypeError(f"{where}(method={method!r}): unexpected options {bad}; this method "
                        f"takes {list(allowed) or 'none'}")


def _inverse(method: str, model_fn: Any, params: Mapping[str, Tensor],
             buffers: Mapping[str, Tensor], loss_fn: LossFn, losses: Callable[..., Tensor],
             p0: TensorDict, g: TensorDict, hdata: tuple[Any, Any], damping: float,
             options: dict[str, Any], where: str) -> TensorDict:
    """``(H + damping I)^{-1} g`` for stacked ``g`` (leaves ``(k, *shape)``)."""
    if method == "identity":
        return {k: t / damping for k, t in g.items()}
    if method == "ekfac":
        if not isinstance(model_fn, GhostModel):
            raise TypeError(f"{where}(method='ekfac'): model_fn must be a GhostModel (from "
                            f"make_ghost_model; it records the linear layers' inputs and output "
                            f"gradients), got {type(model_fn).__name__}")
        ek = options.get("ekfac")
        if ek is None:
            ek = fit_ekfac(model_fn, params, buffers, loss_fn, *hdata,
                           **{k: v for k, v in options.items() if k != "ekfac"})
        elif not isinstance(ek, EKFAC):
            raise TypeError(f"{where}(ekfac=...): expected an EKFAC from fit_ekfac, got "
                            f"{type(ek).__name__}")
        return ekfac_inverse_hvp(ek, g, damping=damping, stacked=True)

    options = dict(options)
    curvature = options.pop("curvature", "hessian")
    if curvature not in _CURVATURES:
        raise ValueError(f"{where}(curvature=...): expected one of {_CURVATURES}, got "
                         f"{curvature!r}")
    if curvature == "ggn":
        if "hvp_mode" in options:
            raise TypeError(f"{where}(curvature='ggn'): hvp_mode is for the Hessian; the "
                            "Gauss-Newton product is jvp, output Hessian, vjp")
        res = _solve(_ggn_matvec(model_fn, params, buffers, loss_fn, where), p0, g, hdata,
                     damping=damping, method=method, stacked=True,
                     **{**_SOLVE_DEFAULTS, **options})
    else:
        def mean_loss(p: TensorDict, inputs: Any, targets: Any) -> Tensor:
            return losses(p, inputs, targets).mean()

        res = inverse_hvp(mean_loss, p0, g, *hdata, damping=damping,  # type: ignore[arg-type]
                          method=method, stacked=True, **options)
    if method == "cg" and not bool(res.converged.all()):
        raise ValueError(f"{where}(method='cg'): CG did not reach tol for every right-hand side "
                         f"(relative residuals {res.residual.tolist()} after "
                         f"{res.iterations.tolist()} iterations); raise max_iter or damping "
                         "(a better-conditioned system), or loosen tol")
    return res.x


def _ggn_matvec(model_fn: Any, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                loss_fn: LossFn, where: str) -> Callable[..., Tensor]:
    """``G vec``: the Gauss-Newton matrix ``mean_n J_n^T H_out,n J_n`` of the mean loss."""
    def matvec(flat: Tensor, unravel: Callable[[Tensor], TensorDict], vec: Tensor, inputs: Any,
               targets: Any) -> Tensor:
        def out_fn(pf: Tensor) -> Tensor:
            out = _call_model(model_fn, {**params, **unravel(pf)}, buffers, inputs, where)[0]
            if not isinstance(out, Tensor):
                raise TypeError(f"{where}(curvature='ggn'): the model must return a tensor, got "
                                f"{type(out).__name__}; use curvature='hessian'")
            return out

        def loss_grad(o: Tensor) -> Tensor:
            return grad(lambda o: loss_fn(o, targets).sum())(o)

        out, jv = jvp(out_fn, (flat,), (vec,))
        h_jv = jvp(loss_grad, (out,), (jv,))[1]
        return vjp(out_fn, flat)[1](h_jv)[0] / out.shape[0]

    return matvec


def _dot_train(losses: Callable[..., Tensor], p0: TensorDict, x: TensorDict, inputs: Any,
               targets: Any) -> Tensor:
    """``(k, N)``: ``<x_q, grad l_i>`` as directional derivatives of the ``(N,)`` losses.

    Forward mode (one ``jvp`` per ``x_q``, vmapped); where an op has no forward-mode rule, the
    transpose of a ``vjp`` (reverse over reverse). No per-sample gradient is formed.
    """
    def by_jvp(xq: TensorDict) -> Tensor:
        return jvp(lambda p: losses(p, inputs, targets), (p0,), (xq,))[1]

    try:
        return vmap(by_jvp)(x)
    except (RuntimeError, NotImplementedError):
        return _dot_train_reverse(losses, p0, x, inputs, targets)


def _dot_train_reverse(losses: Callable[..., Tensor], p0: TensorDict, x: TensorDict,
                       inputs: Any, targets: Any) -> Tensor:
    out, pull = vjp(lambda p: losses(p, inputs, targets), p0)
    u0 = torch.zeros_like(out)

    def jt(u: Tensor) -> TensorDict:  # u -> J^T u, linear in u
        return pull(u)[0]

    _, pull2 = vjp(jt, u0)
    return torch.stack([pull2({k: t[q] for k, t in x.items()})[0]
                        for q in range(next(iter(x.values())).shape[0])])


def _setup(model_fn: Any, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
           loss_fn: LossFn, method: str, methods: tuple[str, ...], where: str
           ) -> tuple[Callable[..., Tensor], TensorDict]:
    if method not in methods:
        raise ValueError(f"{where}(method=...): expected one of {methods}, got {method!r}")
    if not callable(model_fn) or not callable(loss_fn):
        raise TypeError(f"{where}: model_fn and loss_fn must be callables, got "
                        f"{type(model_fn).__name__} and {type(loss_fn).__name__}")
    # frozen params (requires_grad=False in the module: the model_fn's ``frozen``, from
    # make_functional or make_ghost_model) are not trained, so they are not part of the
    # gradients and curvature the scores are made of
    frozen = set(getattr(model_fn, "frozen", ()))
    trainable = {k: t for k, t in params.items() if k not in frozen}
    if not trainable:
        raise ValueError(f"{where}: every parameter is frozen (model_fn.frozen = "
                         f"{sorted(frozen)}): there is no gradient to attribute with")
    return _loss_vector(model_fn, params, buffers, loss_fn, where), trainable


@math_attention
def influence_scores(model_fn: Any, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                     loss_fn: LossFn, train: tuple[Any, Any], query: tuple[Any, Any], *,
                     method: Literal["cg", "lissa", "ekfac", "identity"] = "cg",
                     damping: float, hessian_data: tuple[Any, Any] | None = None,
                     **options: Any) -> Tensor:
    """Return ``(N_query, N_train)``: ``-grad l_q^T (H + damping I)^{-1} grad l_i``.

    Sign convention (Koh & Liang 2017, ``I_up,loss``): entry ``[q, i]`` is the first-order
    change of query ``q``'s loss when training sample ``i`` is up-weighted by a small ``eps``
    in the training objective, divided by ``eps``. Positive: up-weighting ``i`` raises the query
    loss (harmful); negative: helpful. Removing ``i`` from ``N`` training samples is ``eps =
    -1/N``. ``H`` is the Hessian of the MEAN training loss over ``hessian_data`` (default
    ``train``), at ``params``.

    ``model_fn(params, buffers, inputs) -> (outputs, new_buffers)`` (:func:`make_functional`'s
    or a :class:`GhostModel`; the parameters it records as frozen, ``requires_grad=False`` in
    the module, are left out: gradients and curvature are over the trained ones); ``loss_fn(outputs,
    targets) -> (B,)`` per-sample losses; ``train`` and ``query`` are ``(inputs, targets)``.

    Computed as: the ``N_query`` query gradients (``jacrev``), ``N_query`` inverse-HVPs, then
    one forward-mode directional derivative of the ``N_train`` losses per query (no per-sample
    training gradient is formed). ``method``:

    - ``"cg"``: :func:`inverse_hvp` by conjugate gradient, batched over the queries; options
      ``tol``, ``max_iter``, ``hvp_mode``. Not converging raises ``ValueError``; so does an
      indefinite ``H + damping I`` (raise ``damping``, or use the Gauss-Newton matrix).
    - ``"lissa"``: :func:`inverse_hvp` by LiSSA; options ``scale`` (required), ``depth``,
      ``repeats``, ``batch_size``, ``generator`` (required), ``hvp_mode``.
    - with either, option ``curvature="ggn"`` replaces ``H`` by the Gauss-Newton matrix
      ``mean_n J_n^T H_out,n J_n`` (``J_n`` the Jacobian of sample ``n``'s model output,
      ``H_out,n`` the Hessian of its loss in that output): positive semi-definite for convex
      losses such as cross-entropy, the matrix EK-FAC approximates; the model must return a
      tensor. Each product is a jvp, an output-space HVP and a vjp.
    - ``"ekfac"``: EK-FAC curvature of the ``nn.Linear`` layers (:func:`fit_ekfac` on
      ``hessian_data``, a Gauss-Newton approximation: positive semi-definite, so any
      ``damping > 0`` works); ``model_fn`` must be a :class:`GhostModel`; options ``ekfac``
      (a fitted :class:`EKFAC` to reuse), ``fisher``, ``other_layers``, ``chunk_size``.
    - ``"identity"``: ``H`` taken as 0: ``-grad l_q^T grad l_i / damping`` (gradient
      similarity; ghost inner products with a :class:`GhostModel`).

    Example::

        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from torchfn.functional import make_functional
        >>> model_fn, params, buffers = make_functional(nn.Linear(4, 3))
        >>> loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> train = (torch.randn(20, 4), torch.randint(0, 3, (20,)))
        >>> query = (torch.randn(2, 4), torch.randint(0, 3, (2,)))
        >>> influence_scores(model_fn, params, buffers, loss_fn, train, query,
        ...                  damping=0.01).shape
        torch.Size([2, 20])
    """
    where = "influence_scores"
    losses, p0 = _setup(model_fn, params, buffers, loss_fn, method, _METHODS, where)
    damping = _check_damping(damping, method, where)
    _split_options(method, options, where)
    xt, yt = _pair(train, "train", where)
    xq, yq = _pair(query, "query", where)
    hdata = _pair(train if hessian_data is None else hessian_data, "hessian_data", where)
    if method == "identity" and isinstance(model_fn, GhostModel):
        dots = grad_inner_products(model_fn, loss_fn, params, buffers, xt, yt, xq, yq)
        assert isinstance(dots, Tensor)
        return -dots.T / damping
    gq = jacrev(losses)(p0, xq, yq)  # {name: (N_query, *shape)}
    x = _inverse(method, model_fn, params, buffers, loss_fn, losses, p0, gq, hdata, damping,
                 options, where)
    return -_dot_train(losses, p0, x, xt, yt)


@math_attention
def self_influence(model_fn: Any, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                   loss_fn: LossFn, train: tuple[Any, Any], *,
                   method: Literal["cg", "lissa", "ekfac", "identity", "tracin"] = "ekfac",
                   damping: float | None = None, hessian_data: tuple[Any, Any] | None = None,
                   checkpoints: Sequence[Mapping[str, Tensor]] | None = None,
                   lrs: Sequence[float] | None = None, **options: Any) -> Tensor:
    """Return ``(N_train,)``: each training sample's ``grad l_i^T (H + damping I)^{-1} grad l_i``.

    The diagonal of :func:`influence_scores` with train as query, with the sign flipped so
    that it is ``>= 0`` for a positive definite ``H + damping I``: how much a sample's own loss
    would drop if it were up-weighted, a score for memorised, atypical or mislabelled samples.
    Same arguments and options as :func:`influence_scores`. Cost, by ``method``:

    - ``"ekfac"`` (default; ``model_fn`` a :class:`GhostModel`): one EK-FAC fit, then one
      ghost pass over ``train``: per linear layer the rotated per-sample gradients
      ``(N, d_out, d_in')``; no solve per sample.
    - ``"cg"`` / ``"lissa"``: one inverse-HVP PER TRAINING SAMPLE (batched; memory ``N x P``
      for the per-sample gradients and the solutions): for small models.
    - ``"identity"``: ``||grad l_i||^2 / damping`` (ghost norms with a :class:`GhostModel`).
    - ``"tracin"``: TracIn self-influence ``sum_k lr_k ||grad l_i(w_k)||^2`` over
      ``checkpoints`` (parameter dicts saved during training) and their learning rates
      ``lrs`` (``params`` unused, no ``damping``): one per-sample-norm pass per checkpoint.

    Example::

        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from torchfn.persample import make_ghost_model
        >>> ghost, params, buffers = make_ghost_model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
        ...                                                         nn.Linear(8, 3)))
        >>> loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")
        >>> train = (torch.randn(20, 4), torch.randint(0, 3, (20,)))
        >>> self_influence(ghost, params, buffers, loss_fn, train, damping=0.1).shape
        torch.Size([20])
    """
    where = "self_influence"
    losses, p0 = _setup(model_fn, params, buffers, loss_fn, method, _SELF_METHODS, where)
    xt, yt = _pair(train, "train", where)
    if method == "tracin":
        return _tracin_self(model_fn, buffers, loss_fn, xt, yt, checkpoints, lrs, damping,
                            options, where)
    if checkpoints is not None or lrs is not None:
        raise ValueError(f"{where}(method={method!r}): checkpoints/lrs are for method='tracin'")
    damping = _check_damping(damping, method, where)
    _split_options(method, options, where)
    hdata = _pair(train if hessian_data is None else hessian_data, "hessian_data", where)
    if method == "ekfac":
        ghost = model_fn
        if not isinstance(ghost, GhostModel):
            raise TypeError(f"{where}(method='ekfac'): model_fn must be a GhostModel (from "
                            f"make_ghost_model), got {type(ghost).__name__}")
        ek = options.get("ekfac")
        if ek is None:
            ek = fit_ekfac(ghost, params, buffers, loss_fn, *hdata,
                           **{k: v for k, v in options.items() if k != "ekfac"})
        grads = ghost.per_sample(params, buffers, xt, yt, loss_fn).grads
        return ekfac_self_influence(ek, grads, damping)
    if method == "identity" and isinstance(model_fn, GhostModel):
        sq = model_fn.per_sample(params, buffers, xt, yt, loss_fn).grads.sq_norms()
        assert isinstance(sq, Tensor)
        return sq / damping
    g = jacrev(losses)(p0, xt, yt)  # {name: (N, *shape)}
    x = _inverse(method, model_fn, params, buffers, loss_fn, losses, p0, g, hdata, damping,
                 options, where)
    return sum((g[k] * x[k]).flatten(1).sum(1) for k in g)  # type: ignore[return-value]


def _tracin_self(model_fn: Any, buffers: Mapping[str, Tensor], loss_fn: LossFn, xt: Any,
                 yt: Any, checkpoints: Any, lrs: Any, damping: Any, options: dict[str, Any],
                 where: str) -> Tensor:
    if damping is not None or options:
        raise TypeError(f"{where}(method='tracin'): takes checkpoints and lrs only, got "
                        f"damping={damping!r} and options {sorted(options)}")
    checkpoints = list(checkpoints or [])
    lrs = list(lrs or [])
    if not checkpoints or len(checkpoints) != len(lrs):
        raise ValueError(f"{where}(method='tracin'): expected one learning rate per checkpoint "
                         f"(at least one), got {len(checkpoints)} checkpoints and {len(lrs)} "
                         "lrs")
    total: Tensor | None = None
    for w, lr in zip(checkpoints, lrs, strict=True):
        if isinstance(model_fn, GhostModel):
            sq = model_fn.per_sample(w, buffers, xt, yt, loss_fn).grads.sq_norms()
            assert isinstance(sq, Tensor)
        else:
            losses = _loss_vector(model_fn, w, buffers, loss_fn, where)
            g = jacrev(losses)(dict(w), xt, yt)
            sq = sum(t.flatten(1).square().sum(1) for t in g.values())  # type: ignore[assignment]
        total = lr * sq if total is None else total + lr * sq
    assert total is not None
    return total
