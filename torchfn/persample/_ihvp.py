"""Inverse Hessian-vector products ``(H + damping I)^{-1} v``: conjugate gradient and LiSSA."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import optree
import torch
from torch import Tensor
from torch.func import vmap

from torchfn._checks import math_attention
from torchfn.functional import hvp, tree_map, tree_ravel

__all__ = ["IHVPResult", "inverse_hvp"]

PyTree = Any
_METHODS = ("cg", "lissa")
_WHERE = "inverse_hvp"


class IHVPResult(NamedTuple):
    """What :func:`inverse_hvp` returns.

    Fields: ``x`` (the solution, a tree like ``v``: leaves ``(*param.shape)``, or ``(k,
    *param.shape)`` with ``stacked=True``); ``residual`` ``(k,)`` (``()`` unstacked): the
    relative residual ``||v - (H + damping I) x|| / ||v||`` (CG: of its recursion; LiSSA: one
    extra full-batch Hessian-vector product); ``iterations`` ``(k,)`` / ``()`` int64: CG
    iterations each right-hand side took, LiSSA ``depth * repeats``; ``converged`` ``(k,)`` /
    ``()`` bool: CG reached ``tol`` (LiSSA: ``residual <= tol``).
    """

    x: PyTree
    residual: Tensor
    iterations: Tensor
    converged: Tensor


def _check_damping(damping: Any) -> float:
    if isinstance(damping, bool) or not isinstance(damping, int | float) or not math.isfinite(
            damping) or damping < 0:
        raise ValueError(f"{_WHERE}(damping=...): expected a finite float >= 0, got {damping!r}")
    return float(damping)


def _stack_flat(v: PyTree, params: PyTree, stacked: bool) -> Tensor:
    """``v`` as ``(k, P)`` in :func:`tree_ravel`'s order (``k = 1`` unstacked)."""
    if optree.tree_structure(v) != optree.tree_structure(params):
        raise ValueError(f"{_WHERE}(v=...): expected a tree like params "
                         f"({optree.tree_structure(params)}), got {optree.tree_structure(v)}")
    rows = []
    k = None
    for path, leaf, p in zip(optree.tree_paths(v), optree.tree_leaves(v),
                             optree.tree_leaves(params), strict=True):
        ok = (leaf.dim() == p.dim() + 1 and leaf.shape[1:] == p.shape if stacked
              else leaf.shape == p.shape)
        if not ok:
            how = "(k, *param.shape) with stacked=True" if stacked else "param.shape"
            raise ValueError(f"{_WHERE}(v=...): leaf {'.'.join(map(str, path))!r} has shape "
                             f"{tuple(leaf.shape)}, expected {how} with param.shape "
                             f"{tuple(p.shape)}")
        k = leaf.shape[0] if stacked else 1
        rows.append(leaf.reshape(k, -1))
    if stacked and len({r.shape[0] for r in rows}) > 1:
        raise ValueError(f"{_WHERE}(v=...): stacked leaves have different leading sizes "
                         f"{sorted({r.shape[0] for r in rows})}; one k for all")
    dtype = rows[0].dtype
    for r in rows[1:]:
        dtype = torch.promote_types(dtype, r.dtype)
    return torch.cat([r.to(dtype) for r in rows], 1)


def _batch_size(args: tuple[Any, ...]) -> int:
    sizes = {leaf.shape[0] for leaf in optree.tree_leaves(args)
             if isinstance(leaf, Tensor) and leaf.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"{_WHERE}(method='lissa'): every tensor in args must be batched along "
                         f"dim 0 with one batch size (LiSSA samples minibatches of them), got "
                         f"sizes {sorted(sizes)}")
    return sizes.pop()


@math_attention
def inverse_hvp(f: Callable[..., Tensor], params: PyTree, v: PyTree, *args: Any,
                damping: float, method: Literal["cg", "lissa"] = "cg", stacked: bool = False,
                tol: float = 1e-6, max_iter: int | None = None,
                scale: float | None = None, depth: int = 100, repeats: int = 1,
                batch_size: int | None = None, generator: torch.Generator | None = None,
                hvp_mode: Literal["forward_over_reverse", "reverse_over_reverse"]
                = "forward_over_reverse") -> IHVPResult:
    """Return :class:`IHVPResult` with ``x = (H + damping I)^{-1} v``, ``H = d²f/dparams²``.

    ``f(params, *args) -> 0-d`` (e.g. the MEAN training loss of a batch ``args``); ``v`` is a
    tree like ``params`` (``stacked=True``: every leaf ``(k, *param.shape)``, ``k`` right-hand
    sides solved together). ``H`` is applied by :func:`torchfn.functional.hvp` (``hvp_mode``),
    never formed.

    ``method="cg"``: conjugate gradient over all ``args``, batched over the ``k`` right-hand
    sides, each stopped once ``||r|| <= tol ||v||`` or after ``max_iter`` iterations (default
    ``P``, the parameter count); not converging is reported in the result, not raised. CG
    needs ``H + damping I`` positive definite: a direction with ``p^T (H + damping I) p <= 0``
    (an indefinite Hessian: a non-convex loss, or parameters away from a minimum) raises
    ``ValueError`` naming the curvature seen and the fix (a larger ``damping``).

    ``method="lissa"`` (Agarwal et al. 2017; Koh & Liang 2017): ``repeats`` runs of ``depth``
    steps ``x <- v + x - (H_b + damping I) x / scale``, ``H_b`` the Hessian of ``f`` on
    ``batch_size`` rows of every tensor in ``args`` (batch dim 0) drawn without replacement
    from ``generator`` (required); the result is the mean of ``x / scale``. It converges when
    ``scale`` exceeds the largest eigenvalue of ``H + damping I`` and that is positive
    definite; Koh & Liang's ``damping`` is this one divided by ``scale``. A non-finite
    iterate raises ``ValueError`` (raise ``scale``). Cost: ``depth * repeats`` minibatch HVPs.

    Example::

        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> f = lambda p: (p["w"] ** 2).sum()            # H = 2 I
        >>> res = inverse_hvp(f, params, {"w": torch.tensor([3.0, 6.0])}, damping=1.0)
        >>> res.x, bool(res.converged)
        ({'w': tensor([1., 2.])}, True)
    """
    def matvec(flat: Tensor, unravel: Callable[[Tensor], PyTree], vec: Tensor,
               *fargs: Any) -> Tensor:
        return hvp(lambda p, *a: f(unravel(p), *a), flat, vec, *fargs, mode=hvp_mode)

    return _solve(matvec, params, v, args, damping=damping, method=method, stacked=stacked,
                  tol=tol, max_iter=max_iter, scale=scale, depth=depth, repeats=repeats,
                  batch_size=batch_size, generator=generator)


def _solve(matvec: Callable[..., Tensor], params: PyTree, v: PyTree, args: tuple[Any, ...], *,
           damping: float, method: str, stacked: bool, tol: float, max_iter: int | None,
           scale: float | None, depth: int, repeats: int, batch_size: int | None,
           generator: torch.Generator | None) -> IHVPResult:
    """:func:`inverse_hvp` for any curvature: ``matvec(flat, unravel, vec, *args) -> C vec``
    (flat ``(P,)`` vectors)."""
    damping = _check_damping(damping)
    if method not in _METHODS:
        raise ValueError(f"{_WHERE}(method=...): expected one of {_METHODS}, got {method!r}")
    flat, unravel = tree_ravel(params)
    b = _stack_flat(v, params, stacked).to(flat.dtype)

    def h_times(vecs: Tensor, *fargs: Any) -> Tensor:
        return vmap(lambda vec: matvec(flat, unravel, vec, *fargs))(vecs) + damping * vecs

    if method == "cg":
        x, res, its, conv = _cg(h_times, b, args, tol, max_iter, damping)
    else:
        x = _lissa(h_times, b, args, scale, depth, repeats, batch_size, generator)
        bnorm = b.norm(dim=1)
        res = (b - h_times(x, *args)).norm(dim=1) / torch.where(bnorm > 0, bnorm, 1.0)
        its = torch.full_like(res, depth * repeats, dtype=torch.int64)
        conv = res <= tol
    x_tree = vmap(unravel)(x)
    if not stacked:
        x_tree, res, its, conv = tree_map(lambda t: t[0], x_tree), res[0], its[0], conv[0]
    return IHVPResult(x_tree, res, its, conv)


def _cg(h_times: Callable[..., Tensor], b: Tensor, args: tuple[Any, ...], tol: float,
        max_iter: int | None, damping: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if max_iter is None:
        max_iter = b.shape[1]
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter <= 0:
        raise ValueError(f"{_WHERE}(max_iter=...): expected a positive int, got {max_iter!r}")
    k = b.shape[0]
    x, r = torch.zeros_like(b), b.clone()
    p, rs = r.clone(), (r * r).sum(1)
    bnorm = rs.sqrt()
    its = torch.zeros(k, dtype=torch.int64, device=b.device)
    active = rs.sqrt() > tol * bnorm
    active &= rs > 0
    for it in range(max_iter):
        idx = active.nonzero().flatten()
        if idx.numel() == 0:
            break
        p_a = p[idx]
        ap = h_times(p_a, *args)
        pap = (p_a * ap).sum(1)
        bad = pap <= 0
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{_WHERE}(method='cg'): H + damping*I is not positive definite: at iteration "
                f"{it + 1} CG found a direction p with p^T (H + damping I) p / ||p||^2 = "
                f"{float(pap[j] / (p_a[j] * p_a[j]).sum()):.4g} <= 0 (right-hand side "
                f"{int(idx[j])}, damping={damping}). The Hessian of a non-convex loss, or away "
                "from a minimum, is indefinite and CG diverges on it; pass a larger damping "
                "(above the magnitude of H's most negative eigenvalue), or a positive "
                "semi-definite Gauss-Newton curvature (influence_scores(..., curvature='ggn') or "
                "method='ekfac')")
        alpha = rs[idx] / pap
        x[idx] += alpha[:, None] * p_a
        r[idx] -= alpha[:, None] * ap
        rs_new = (r[idx] * r[idx]).sum(1)
        p[idx] = r[idx] + (rs_new / rs[idx])[:, None] * p_a
        rs[idx] = rs_new
        its[idx] += 1
        active[idx] = rs_new.sqrt() > tol * bnorm[idx]
    res = rs.sqrt() / torch.where(bnorm > 0, bnorm, 1.0)
    return x, res, its, res <= tol


def _lissa(h_times: Callable[..., Tensor], b: Tensor, args: tuple[Any, ...],
           scale: float | None, depth: int, repeats: int, batch_size: int | None,
           generator: torch.Generator | None) -> Tensor:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"{_WHERE}(method='lissa'): `scale` must be a float larger than the "
                         f"largest eigenvalue of H + damping I (the recursion diverges "
                         f"otherwise), got {scale!r}")
    for name, val in (("depth", depth), ("repeats", repeats)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{_WHERE}(method='lissa'): `{name}` must be a positive int, got "
                             f"{val!r}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{_WHERE}(method='lissa'): LiSSA samples minibatches and needs an "
                        f"explicit `generator` (torch.Generator().manual_seed(0)), got "
                        f"{generator!r}")
    n = _batch_size(args)
    bs = n if batch_size is None else batch_size
    if isinstance(bs, bool) or not isinstance(bs, int) or not 0 < bs <= n:
        raise ValueError(f"{_WHERE}(batch_size=...): expected an int in [1, {n}] (rows of args "
                         f"per LiSSA step), got {batch_size!r}")
    total = torch.zeros_like(b)
    for rep in range(repeats):
        x = b.clone()
        for _ in range(depth):
            idx = torch.randperm(n, generator=generator, device=generator.device)[:bs]
            sub = tree_map(lambda t, idx=idx: t[idx.to(t.device)]
                           if isinstance(t, Tensor) and t.dim() else t, args)
            x = b + x - h_times(x, *sub) / scale
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{_WHERE}(method='lissa'): the recursion diverged (non-finite "
                             f"iterate in repeat {rep}); scale={scale} must exceed the largest "
                             "eigenvalue of H + damping I, which must be positive definite: "
                             "raise scale (and damping)")
        total += x / scale
    return total / repeats
