"""Compile-safe Adam and AdamW as torchopt ``GradientTransformation``s.

torchopt's own ``adam``/``adamw`` compute the bias correction as ``pow(decay, count)`` with a
Python float base and a tensor exponent, which Dynamo cannot trace under
``torch.compile(fullgraph=True)``. These versions compute it with tensor ops (``torch.pow`` on a
floating copy of the count, in at least float32 and in float64 for float64 moments), are
out-of-place throughout (so ``torch.func.grad`` / ``create_graph=True`` can differentiate through
an update, as meta-learning needs) and otherwise follow torchopt's signatures and semantics; their
state is torchopt's ``ScaleByAdamState`` inside a torchopt ``chain``.

In eager mode, when nothing is differentiated through the update (no leaf tracked by autograd,
no ``torch.func`` transform, not compiling), every part of the chain runs as a few
``torch._foreach_*`` multi-tensor ops per (device, dtype) group instead of a loop of small ops
per leaf; they are the same elementwise ops in the same order, so the numbers are the same bit
for bit on CPU (tests compare both paths).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torchopt.base import EmptyState, GradientTransformation, identity
from torchopt.combine import chain
from torchopt.transform import scale_by_schedule
from torchopt.transform.add_decayed_weights import masked
from torchopt.transform.scale_by_adam import ScaleByAdamState
from torchopt.typing import OptState, Params, ScalarOrSchedule, Updates

from torchfn._checks import _foreach_map, compute_once

__all__ = ["adam", "adamw", "scale_by_adam"]

_INT64_MAX = torch.iinfo(torch.int64).max


def _check_hparams(
    lr: ScalarOrSchedule | None,
    betas: tuple[float, float],
    eps: float,
    eps_root: float,
    weight_decay: float,
    fn: str,
) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.ndim != 0 or not lr.is_floating_point():
            raise ValueError(
                f"{fn}(lr=...): a tensor learning rate must be a floating 0-d tensor, got dtype "
                f"{lr.dtype} and shape {tuple(lr.shape)}"
            )
    elif lr is not None and not (callable(lr) or (isinstance(lr, (int, float)) and lr >= 0.0)):
        raise ValueError(
            f"{fn}(lr=...): expected a float >= 0, a 0-d tensor or a schedule, got {lr!r}"
        )
    if len(betas) != 2:
        raise ValueError(f"{fn}(betas=...): expected a pair (b1, b2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{fn}(betas=...): betas[{i}] must be in [0, 1), got {b!r}")
    if not eps >= 0.0:
        raise ValueError(f"{fn}(eps=...): expected eps >= 0, got {eps!r}")
    if not eps_root >= 0.0:
        raise ValueError(f"{fn}(eps_root=...): expected eps_root >= 0, got {eps_root!r}")
    if not weight_decay >= 0.0:
        raise ValueError(
            f"{fn}(weight_decay=...): expected weight_decay >= 0, got {weight_decay!r}"
        )


def _bias_correction(decay: float, count: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return ``1 - decay**count`` as a 0-d tensor in ``dtype`` promoted to at least float32
    (once per step while compiling, not per element: :func:`torchfn._checks.compute_once`)."""
    work = torch.promote_types(dtype, torch.float32)
    return compute_once(1.0 - torch.pow(decay, count.to(work)))


def _stack_cast(ts: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Return the 0-d tensors ``ts`` cast to ``dtype`` (one stack, one cast, one unbind)."""
    if ts[0].dtype == dtype:
        return ts
    return list(torch.stack(ts).to(dtype).unbind())


def _foreach_bias_correction(
    decay: float, counts: list[torch.Tensor], dtype: torch.dtype
) -> list[torch.Tensor]:
    """:func:`_bias_correction` of each 0-d count, cast to ``dtype``, by multi-tensor ops.

    ``torch.pow`` runs per 0-d count (``_foreach_pow``: Sleef's vectorized pow on a stacked
    vector may differ in the last bit from the scalar pow), and ``1 - x`` as ``(-x) + 1``,
    which IEEE arithmetic makes equal. The results stay on the device: no host sync.
    """
    work = torch.promote_types(dtype, torch.float32)
    out = torch._foreach_pow(decay, _stack_cast(counts, work))
    torch._foreach_neg_(out)
    torch._foreach_add_(out, 1.0)
    return _stack_cast(out, dtype)


def _foreach_adam(
    b1: float, b2: float, eps: float, eps_root: float
) -> Callable[..., tuple[list[torch.Tensor], ...]]:
    """Return the multi-tensor twin of ``scale_by_adam``'s per-leaf update (same ops, same
    order) over one (device, dtype) group: ``(gs, mus, nus, counts) -> (us, mus, nus, counts)``."""

    def run(
        gs: list[torch.Tensor],
        mus: list[torch.Tensor],
        nus: list[torch.Tensor],
        cs: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], ...]:
        mdt, ndt = mus[0].dtype, nus[0].dtype
        gms = gs if gs[0].dtype == mdt else [g.to(mdt) for g in gs]
        mu = torch._foreach_mul(mus, b1)
        torch._foreach_add_(mu, gms, alpha=1.0 - b1)
        nu = torch._foreach_mul(nus, b2)
        torch._foreach_addcmul_(nu, gms, gms, value=1.0 - b2)
        # count + (count != INT64_MAX): min(count, INT64_MAX - 1) + 1 is the same, overflow-free
        count = torch._foreach_clamp_max(cs, _INT64_MAX - 1)
        torch._foreach_add_(count, 1)
        u = torch._foreach_div(mu, _foreach_bias_correction(b1, count, mdt))
        den = torch._foreach_div(nu, _foreach_bias_correction(b2, count, ndt))
        torch._foreach_add_(den, eps_root)
        torch._foreach_sqrt_(den)
        torch._foreach_add_(den, eps)
        torch._foreach_div_(u, den)
        gdt = gs[0].dtype
        us = u if u[0].dtype == gdt else [x.to(gdt) for x in u]
        return us, mu, nu, count

    return run


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    moment_requires_grad: bool = False,
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Return a ``GradientTransformation`` that rescales updates by Adam's moment estimates.

    Each update ``g`` (any tensor shape) becomes ``m_hat / (sqrt(v_hat + eps_root) + eps)`` with
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g²`` and bias-corrected ``m_hat``, ``v_hat``.
    The state is torchopt's ``ScaleByAdamState(mu, nu, count)`` with one int64 0-d ``count`` per
    leaf, as in ``torchopt.transform.scale_by_adam``. Out-of-place whatever ``inplace`` says, and
    traceable by ``torch.compile(fullgraph=True)``.

    Args:
        b1, b2: decay rates of the first and second moments, in ``[0, 1)``.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root; use a small positive value when differentiating
            through the update (the derivative of ``sqrt`` at 0 is infinite).
        moment_requires_grad: create the moments with ``requires_grad=True``.
        moment_dtype: dtype to keep ``mu``/``nu`` in (e.g. ``torch.float32`` for bf16 params);
            ``None`` keeps each parameter's dtype. Updates come back in the gradient's dtype.

    Example:
        >>> import torch
        >>> from torchfn.optim import scale_by_adam
        >>> tx = scale_by_adam()
        >>> params = {"w": torch.ones(3)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.full((3,), 2.0)}, state, inplace=False)
        >>> updates["w"]  # the first Adam step has magnitude ~1
        tensor([1.0000, 1.0000, 1.0000])
    """
    _check_hparams(None, (b1, b2), eps, eps_root, 0.0, "scale_by_adam")

    def init_fn(params: Params) -> OptState:
        def moment(t: torch.Tensor) -> torch.Tensor:
            dtype = moment_dtype if moment_dtype is not None else t.dtype
            return torch.zeros_like(t, dtype=dtype, requires_grad=moment_requires_grad)

        count = optree.tree_map(
            lambda t: torch.zeros((), dtype=torch.int64, device=t.device), params
        )
        return ScaleByAdamState(
            mu=optree.tree_map(moment, params), nu=optree.tree_map(moment, params), count=count
        )

    def update_fn(
        updates: Updates,
        state: OptState,
        *,
        params: Params | None = None,
        inplace: bool = True,
    ) -> tuple[Updates, OptState]:
        del params, inplace  # always out-of-place

        def leaf(
            g: torch.Tensor | None, mu: torch.Tensor, nu: torch.Tensor, count: torch.Tensor
        ) -> tuple[Any, ...]:
            if g is None:
                return None, mu, nu, count
            gm = g.to(mu.dtype)
            mu = mu.mul(b1).add(gm, alpha=1.0 - b1)
            nu = nu.mul(b2).addcmul(gm, gm, value=1.0 - b2)
            count = count + (count != _INT64_MAX).to(torch.int64)
            mu_hat = mu.div(_bias_correction(b1, count, mu.dtype).to(mu.dtype))
            nu_hat = nu.div(_bias_correction(b2, count, nu.dtype).to(nu.dtype))
            u = mu_hat.div(nu_hat.add(eps_root).sqrt().add(eps))
            return u.to(g.dtype), mu, nu, count

        spec = optree.tree_structure(updates, none_is_leaf=True)
        g_leaves = spec.flatten_up_to(updates)
        mu_leaves = spec.flatten_up_to(state.mu)
        nu_leaves = spec.flatten_up_to(state.nu)
        c_leaves = spec.flatten_up_to(state.count)
        new = _update_foreach(g_leaves, mu_leaves, nu_leaves, c_leaves)
        if new is None:
            out = [
                leaf(*xs) for xs in zip(g_leaves, mu_leaves, nu_leaves, c_leaves, strict=True)
            ]
            new = [[o[i] for o in out] for i in range(4)]
        trees = [spec.unflatten(leaves) for leaves in new]
        return trees[0], ScaleByAdamState(mu=trees[1], nu=trees[2], count=trees[3])

    def _update_foreach(
        g_leaves: list[Any], mu_leaves: list[Any], nu_leaves: list[Any], c_leaves: list[Any]
    ) -> list[list[Any]] | None:
        """The per-leaf update by multi-tensor ops, or ``None`` where they may not run."""
        idx = [i for i, g in enumerate(g_leaves) if g is not None]  # None: state kept
        if not idx or any(
            not isinstance(c_leaves[i], torch.Tensor) or c_leaves[i].dtype != torch.int64
            for i in idx
        ):
            return None
        sub = [[xs[i] for i in idx] for xs in (g_leaves, mu_leaves, nu_leaves)]
        res = _foreach_map(run, sub, [[c_leaves[i] for i in idx]])
        if res is None:
            return None
        new: list[list[Any]] = [
            [None] * len(g_leaves), list(mu_leaves), list(nu_leaves), list(c_leaves)
        ]
        for full, part in zip(new, res, strict=True):
            for i, r in zip(idx, part, strict=True):
                full[i] = r
        return new

    run = _foreach_adam(b1, b2, eps, eps_root)

    return GradientTransformation(init_fn, update_fn)


def _map_updates(
    leaf_fn: Callable[..., torch.Tensor],
    foreach_fn: Callable[..., list[torch.Tensor]],
    updates: Updates,
    params: Params | None,
    scalars: tuple[torch.Tensor, ...] = (),
) -> Updates:
    """Return ``updates`` mapped leaf by leaf by ``leaf_fn(g[, p])`` (``None`` leaves kept), by
    ``foreach_fn(gs[, ps])`` per (device, dtype) group where :func:`_foreach_map` allows
    (every leaf a tensor; ``scalars``: 0-d tensors ``foreach_fn`` reads, on the leaves'
    device)."""
    leaves, spec = optree.tree_flatten(updates, none_is_leaf=True)
    trees = [leaves]
    if params is not None:
        if torch.compiler.is_compiling():
            # Dynamo (torch 2.11 with optree 0.20) cannot trace PyTreeSpec.__eq__: compare
            # the leaf paths (plain tuples) while tracing, the full specs in eager calls
            same = (optree.tree_paths(params, none_is_leaf=True)
                    == optree.tree_paths(updates, none_is_leaf=True))
        else:
            same = optree.tree_structure(params, none_is_leaf=True) == spec
        if same:
            trees.append(spec.flatten_up_to(params))
        else:
            trees = []  # the per-leaf map says what is wrong
    idx = [i for i, g in enumerate(leaves) if g is not None]
    if trees and idx and all(s.ndim == 0 for s in scalars):
        res = _foreach_map(
            lambda *ls: (foreach_fn(*ls[: len(trees)]),),
            [[t[i] for i in idx] for t in trees],
            [[s] * len(idx) for s in scalars],
        )
        if res is not None:
            out = list(leaves)
            for i, r in zip(idx, res[0], strict=True):
                out[i] = r
            return spec.unflatten(out)

    def f(g: torch.Tensor | None, *p: torch.Tensor | None) -> torch.Tensor | None:
        return None if g is None else leaf_fn(g, *p)

    if params is None:
        return optree.tree_map(f, updates, none_is_leaf=True)
    return optree.tree_map(f, updates, params, none_is_leaf=True)


def _stateless(
    update: Callable[[Updates, Params | None], Updates],
) -> GradientTransformation:
    """A torchopt transformation with no state (``EmptyState``) whose update is
    ``update(updates, params)``, always out of place."""

    def init_fn(params: Params) -> OptState:
        del params
        return EmptyState()

    def update_fn(
        updates: Updates,
        state: OptState,
        *,
        params: Params | None = None,
        inplace: bool = True,
    ) -> tuple[Updates, OptState]:
        del inplace
        return update(updates, params), state

    return GradientTransformation(init_fn, update_fn)


def _flip_sign_and_l2(weight_decay: float, maximize: bool) -> GradientTransformation:
    """Return a transformation mapping ``g`` to ``±g + weight_decay * p`` (L2 penalty, ascent)."""
    if not maximize and weight_decay == 0.0:
        return identity()  # dropped by chain, as in torchopt

    def leaf_fn(g: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
        g = g.neg() if maximize else g
        return g.add(p, alpha=weight_decay) if weight_decay != 0.0 else g

    def foreach_fn(
        gs: list[torch.Tensor], ps: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        if maximize:
            gs = torch._foreach_neg(gs)
        if weight_decay != 0.0:
            gs = torch._foreach_add(gs, ps, alpha=weight_decay)
        return gs

    def update(updates: Updates, params: Params | None) -> Updates:
        if weight_decay != 0.0 and params is None:
            raise ValueError(
                "adam(weight_decay=...).update(updates, state): weight decay needs the parameters;"
                " call update(updates, state, params=params, inplace=False)"
            )
        p = params if weight_decay != 0.0 else None
        return _map_updates(leaf_fn, foreach_fn, updates, p)

    return _stateless(update)


def _add_decayed_weights(
    weight_decay: float, mask: OptState | Callable[[Params], OptState] | None
) -> GradientTransformation:
    """``torchopt.transform.add_decayed_weights`` (``g + weight_decay * p``, same state), with
    the multi-tensor fast path."""

    def update(updates: Updates, params: Params | None) -> Updates:
        if params is None:
            raise ValueError(
                "adamw(weight_decay=...).update(updates, state): weight decay needs the "
                "parameters; call update(updates, state, params=params, inplace=False)"
            )
        return _map_updates(
            lambda g, p: g.add(p, alpha=weight_decay),
            lambda gs, ps: torch._foreach_add(gs, ps, alpha=weight_decay),
            updates,
            params,
        )

    inner = _stateless(update)
    return inner if mask is None else masked(inner, mask)


def _scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """``torchopt.transform.scale`` (``g * step_size``, same state), with the multi-tensor fast
    path (a tensor ``step_size`` there: on the leaves' device, not tracked by autograd)."""
    scalars = (step_size,) if isinstance(step_size, torch.Tensor) else ()
    return _stateless(lambda updates, params: _map_updates(
        lambda g: g.mul(step_size),
        lambda gs: torch._foreach_mul(gs, step_size),
        updates,
        None,
        scalars,
    ))


def _scale_by_neg_lr(lr: ScalarOrSchedule) -> GradientTransformation:
    if callable(lr):
        schedule: Callable[[Any], Any] = lr

        def neg_schedule(count: torch.Tensor) -> Any:
            return -schedule(count)

        return scale_by_schedule(neg_schedule)
    if isinstance(lr, torch.Tensor):
        return _scale(-lr)  # stays differentiable w.r.t. ``lr``
    return _scale(-float(lr))


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    eps_root: float = 0.0,
    moment_requires_grad: bool = False,
    maximize: bool = False,
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Return the Adam optimizer as a compile-safe, differentiable ``GradientTransformation``.

    Same signature and semantics as ``torchopt.adam`` (``weight_decay`` is an L2 penalty added to
    the gradient, as in ``torch.optim.Adam``); the returned updates are to be *added* to the
    params (``torchopt.apply_updates``). ``lr`` is a float, a torchopt schedule (a function of the
    int64 update count, e.g. ``torchopt.schedule.linear_schedule``) or a floating 0-d tensor
    (updates are then differentiable w.r.t. it, e.g. to meta-learn it). Use it out-of-place:
    ``updates, state = opt.update(grads, state, params=params, inplace=False)``.
    ``moment_dtype`` (not in torchopt) keeps the moments in another dtype.

    Example:
        >>> import torch, torchopt
        >>> from torchfn.optim import adam
        >>> opt = adam(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> state = opt.init(params)
        >>> grads = {"w": torch.tensor([0.5, -0.5])}
        >>> updates, state = opt.update(grads, state, params=params, inplace=False)
        >>> torchopt.apply_updates(params, updates, inplace=False)["w"]
        tensor([ 0.9000, -1.9000])
    """
    _check_hparams(lr, betas, eps, eps_root, weight_decay, "adam")
    return chain(
        _flip_sign_and_l2(weight_decay, maximize),
        scale_by_adam(
            betas[0],
            betas[1],
            eps,
            eps_root,
            moment_requires_grad=moment_requires_grad,
            moment_dtype=moment_dtype,
        ),
        _scale_by_neg_lr(lr),
    )


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    eps_root: float = 0.0,
    mask: OptState | Callable[[Params], OptState] | None = None,
    moment_requires_grad: bool = False,
    maximize: bool = False,
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Return AdamW (decoupled weight decay) as a compile-safe, differentiable transformation.

    Same signature and semantics as ``torchopt.adamw``: the update is
    ``-lr * (adam_direction + weight_decay * p)``, i.e. ``p <- p - lr*wd*p - lr*adam_direction``
    as in ``torch.optim.AdamW``. ``mask`` (a pytree of bools like the params, or a function of the
    params returning one) selects the leaves that decay. See :func:`adam` for the other arguments.

    Example:
        >>> import torch, torchopt
        >>> from torchfn.optim import adamw
        >>> opt = adamw(lr=0.1, weight_decay=0.5)
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> state = opt.init(params)
        >>> grads = {"w": torch.tensor([0.5, -0.5])}
        >>> updates, state = opt.update(grads, state, params=params, inplace=False)
        >>> torchopt.apply_updates(params, updates, inplace=False)["w"]
        tensor([ 0.8500, -1.8000])
    """
    _check_hparams(lr, betas, eps, eps_root, weight_decay, "adamw")
    parts = [
        _flip_sign_and_l2(0.0, maximize),
        scale_by_adam(
            betas[0],
            betas[1],
            eps,
            eps_root,
            moment_requires_grad=moment_requires_grad,
            moment_dtype=moment_dtype,
        ),
    ]
    if weight_decay != 0.0:
        parts.append(_add_decayed_weights(weight_decay, mask))
    parts.append(_scale_by_neg_lr(lr))
    return chain(*parts)
