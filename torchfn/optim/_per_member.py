"""SGD (momentum, Nesterov) and Adam/AdamW over stacked members with EVERY hyperparameter per member.

:func:`torchfn.optim.stacked_sgd` / :func:`torchfn.optim.stacked_adam` are fused kernels whose lr
and weight decay may differ per member but whose momentum, dampening, betas and eps are shared
floats. :func:`per_member_sgd` / :func:`per_member_adam` take any of those as ``(N,)`` tensors
too: when only lr / weight decay vary they return the fused transformation (``fused="auto"``),
otherwise a pure-PyTorch one written over the stacked leaves (elementwise ops that
``torch.compile`` fuses). Both keep the fused ops' state types (:class:`StackedSgdState`,
:class:`StackedAdamState`), so checkpoints are interchangeable, and both decide "first step"
from the state's count, not from Python state, so a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor
from torchopt.base import GradientTransformation
from torchopt.typing import OptState, Params, Updates

from torchfn._checks import _LOW, _fmt, _n_members, _opmath
from torchfn.optim._stacked import (
    StackedAdamState,
    StackedSgdState,
    _count_device,
    _flatten_update,
    stacked_adam,
    stacked_sgd,
)

__all__ = ["per_member_adam", "per_member_optimizer", "per_member_sgd"]

Hyper = float | Tensor


def _check_value(fn: str, name: str, value: Any, lo: float, hi: float | None,
                 hi_open: bool = False) -> None:
    """Check a float or a 0-d/(N,) floating tensor lies in [lo, hi] (or [lo, hi)); once, at build."""
    rng = f"[{lo}, {hi})" if hi_open else f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    if isinstance(value, Tensor):
        if not value.is_floating_point() or value.ndim > 1:
            raise ValueError(f"{fn}({name}=...): expected a float or a floating 0-d / (N,) tensor"
                             f", got dtype {value.dtype} shape {_fmt(value.shape)}")
        v = value.detach()
        ok = bool((v >= lo).all()) and (hi is None or bool((v < hi).all() if hi_open
                                                           else (v <= hi).all()))
        if not ok:
            raise ValueError(f"{fn}({name}=...): every value must be in {rng}, got "
                             f"{v.cpu().tolist()}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}({name}=...): expected a float or a tensor, got "
                        f"{type(value).__name__}")
    ok = value >= lo and (hi is None or (value < hi if hi_open else value <= hi))
    if not ok:
        raise ValueError(f"{fn}({name}=...): expected a value in {rng}, got {value!r}")


def _check_n(fn: str, hypers: dict[str, Any], params: Params) -> tuple[int, torch.device]:
    """Check every (N,) hyperparameter matches N of ``params`` and lives on their device."""
    leaves = [x for x in optree.tree_leaves(params) if x is not None]
    if not leaves:
        raise ValueError(f"{fn}.init(params): expected at least one stacked parameter")
    n, device = None, leaves[0].device
    for x in leaves:
        if not isinstance(x, Tensor) or x.ndim == 0:
            raise ValueError(f"{fn}.init(params): every leaf must be a stacked (N, ...) tensor, "
                             f"got {type(x).__name__} {_fmt(getattr(x, 'shape', ()))}")
        if n is None:
            n = x.shape[0]
        elif x.shape[0] != n:
            raise ValueError(f"{fn}.init(params): every leaf must stack the same N members "
                             f"along dim 0, got N={n} and N={x.shape[0]}")
    assert n is not None
    for name, v in hypers.items():
        if isinstance(v, Tensor):
            if v.ndim == 1 and v.shape[0] != n:
                raise ValueError(f"{fn}({name}=...): expected a float, a 0-d tensor or a tensor "
                                 f"of shape (N,) = ({n},) (one value per member), got shape "
                                 f"{_fmt(v.shape)}")
            if v.device != device:
                raise ValueError(f"{fn}({name}=...): expected {name} on the params' device "
                                 f"{device}, got {v.device}; move it once, e.g. "
                                 f"{name}.to({str(device)!r})")
    return n, device


def _as(v: Hyper, work: torch.dtype, nd: int) -> Hyper:
    """Return a float unchanged, a 0-d / (N,) tensor cast to ``work`` shaped to broadcast."""
    if not isinstance(v, Tensor):
        return v
    v = v.to(work)
    return v if v.ndim == 0 else v.reshape(v.shape[0], *([1] * (nd - 1)))


def _is_float(v: Any) -> bool:
    return not isinstance(v, Tensor)


def _resolve_fused(fn: str, fused: bool | str, can_fuse: bool, why: str) -> bool:
    if fused not in (True, False, "auto"):
        raise ValueError(f"{fn}(fused=...): expected True, False or 'auto', got {fused!r}")
    if fused is True and not can_fuse:
        raise ValueError(f"{fn}(fused=True): the fused kernel takes {why} as shared floats "
                         "only; pass floats, or fused='auto'/False for per-member tensors")
    return bool(fused) and can_fuse


def _zeros_state(params: Params, moment_dtype: torch.dtype | None) -> Params:
    def zero(p: Tensor) -> Tensor:
        dt = moment_dtype or (torch.float32 if p.dtype in _LOW else p.dtype)
        return torch.zeros(p.shape, dtype=dt, device=p.device)
    return optree.tree_map(zero, params)


def _lr_now(lr: Any, count: Tensor) -> Hyper:
    return lr(count) if callable(lr) else lr


def per_member_sgd(
    lr: Hyper | Callable[[Tensor], Hyper],
    momentum: Hyper = 0.0,
    dampening: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    fused: bool | str = "auto",
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Return SGD over stacked ``(N, ...)`` members, each hyperparameter a float or ``(N,)``.

    Member ``n`` follows ``torch.optim.SGD(lr=lr[n], momentum=momentum[n],
    dampening=dampening[n], weight_decay=weight_decay[n], nesterov=nesterov)`` exactly (momentum
    buffer = the gradient on the first step). ``lr``, ``momentum``, ``dampening`` and
    ``weight_decay`` are floats (shared), 0-d or ``(N,)`` floating tensors on the params' device
    (``lr`` may also be a schedule of the 0-d count). With ``fused="auto"`` and float
    ``momentum``/``dampening`` this IS :func:`torchfn.optim.stacked_sgd` (one fused kernel);
    otherwise pure PyTorch ops (compile-friendly, no host syncs). State:
    :class:`torchfn.optim.StackedSgdState`. Use out-of-place, as any torchfn optimizer.

    Example:
        >>> import torch
        >>> from torchfn.optim import per_member_sgd
        >>> opt = per_member_sgd(lr=0.1, momentum=torch.tensor([0.0, 0.9]))
        >>> params, g = {"w": torch.zeros(2, 3)}, {"w": torch.ones(2, 3)}
        >>> state = opt.init(params)
        >>> _, state = opt.update(g, state, params=params)
        >>> updates, state = opt.update(g, state, params=params)
        >>> updates["w"][:, 0]  # second step: buffer = momentum * g + g
        tensor([-0.1000, -0.1900])
    """
    fn = "torchfn.optim.per_member_sgd"
    if not callable(lr):
        _check_value(fn, "lr", lr, 0.0, None)
    _check_value(fn, "momentum", momentum, 0.0, None)
    _check_value(fn, "dampening", dampening, 0.0, 1.0)
    _check_value(fn, "weight_decay", weight_decay, 0.0, None)
    if nesterov:
        m_ok = bool((momentum > 0).all()) if isinstance(momentum, Tensor) else momentum > 0
        d_ok = bool((dampening == 0).all()) if isinstance(dampening, Tensor) else dampening == 0
        if not (m_ok and d_ok):
            raise ValueError(f"{fn}(nesterov=True): Nesterov momentum requires momentum > 0 and "
                             "dampening == 0 for every member")
    can_fuse = _is_float(momentum) and _is_float(dampening)
    if _resolve_fused(fn, fused, can_fuse, "momentum and dampening"):
        return stacked_sgd(lr, float(momentum), float(dampening), weight_decay,  # type: ignore[arg-type]
                           nesterov, maximize=maximize, moment_dtype=moment_dtype)
    use_buf = not (_is_float(momentum) and float(momentum) == 0.0)  # type: ignore[arg-type]
    no_decay = _is_float(weight_decay) and float(weight_decay) == 0.0  # type: ignore[arg-type]
    hypers = {"lr": lr, "momentum": momentum, "dampening": dampening,
              "weight_decay": weight_decay}

    def init_fn(params: Params) -> OptState:
        _check_n(fn, {k: v for k, v in hypers.items() if not callable(v)}, params)
        return StackedSgdState(
            momentum_buffer=_zeros_state(params, moment_dtype) if use_buf else None,
            count=torch.zeros((), dtype=torch.int64, device=_count_device(params)))

    def update_fn(updates: Updates, state: OptState, *, params: Params | None = None,
                  inplace: bool = True) -> tuple[Updates, OptState]:
        del inplace  # always out-of-place
        _, spec, grads, ps = _flatten_update(fn, updates, params, no_decay)
        ps = ps if ps is not None else [None] * len(grads)
        bufs = spec.flatten_up_to(state.momentum_buffer) if use_buf else [None] * len(grads)
        lr_t = _lr_now(lr, state.count)
        first = state.count == 0
        new_u: list[Any] = []
        new_b: list[Any] = []
        for g, b, p in zip(grads, bufs, ps, strict=True):
            if g is None:
                new_u.append(None)
                new_b.append(b)
                continue
            work, nd = _opmath(g.dtype), g.ndim
            d = g.to(work)
            if maximize:
                d = -d
            if not no_decay:
                d = d + _as(weight_decay, work, nd) * p.to(work)
            if use_buf:
                mom = _as(momentum, work, nd)
                later = b.to(work) * mom + (1.0 - _as(dampening, work, nd)) * d
                buf = torch.where(first.to(g.device), d, later)
                new_b.append(buf.to(b.dtype))
                d = d + mom * buf if nesterov else buf
            else:
                new_b.append(None)
            new_u.append((-_as(lr_t, work, nd) * d).to(g.dtype))
        return spec.unflatten(new_u), StackedSgdState(
            momentum_buffer=spec.unflatten(new_b) if use_buf else None, count=state.count + 1)

    return GradientTransformation(init_fn, update_fn)


def per_member_adam(
    lr: Hyper | Callable[[Tensor], Hyper] = 1e-3,
    betas: tuple[Hyper, Hyper] = (0.9, 0.999),
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    *,
    decoupled: bool = False,
    maximize: bool = False,
    fused: bool | str = "auto",
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Return Adam (or AdamW) over stacked ``(N, ...)`` members, each hyperparameter per member.

    Member ``n`` follows ``torch.optim.Adam(lr=lr[n], betas=(b1[n], b2[n]), eps=eps[n],
    weight_decay=weight_decay[n])`` (``decoupled=True``: ``torch.optim.AdamW``). Every value is
    a float (shared), a 0-d or an ``(N,)`` floating tensor on the params' device (``lr`` may be
    a schedule of the 0-d count). With ``fused="auto"`` and float ``betas``/``eps`` this IS
    :func:`torchfn.optim.stacked_adam` (one fused kernel); otherwise pure PyTorch ops. State:
    :class:`torchfn.optim.StackedAdamState` (``mu``, ``nu`` like the params, the 0-d ``count``).

    Example:
        >>> import torch
        >>> from torchfn.optim import per_member_adam
        >>> opt = per_member_adam(lr=0.1, betas=(torch.tensor([0.0, 0.9]), 0.999))
        >>> params = {"w": torch.zeros(2, 3)}
        >>> updates, _ = opt.update({"w": torch.ones(2, 3)}, opt.init(params), params=params)
        >>> updates["w"][:, 0]  # the first Adam step has magnitude lr
        tensor([-0.1000, -0.1000])
    """
    fn = "torchfn.optim.per_member_adam"
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{fn}(betas=...): expected a pair (beta1, beta2), got {betas!r}")
    b1, b2 = betas
    if not callable(lr):
        _check_value(fn, "lr", lr, 0.0, None)
    _check_value(fn, "betas[0]", b1, 0.0, 1.0, hi_open=True)
    _check_value(fn, "betas[1]", b2, 0.0, 1.0, hi_open=True)
    _check_value(fn, "eps", eps, 0.0, None)
    _check_value(fn, "weight_decay", weight_decay, 0.0, None)
    can_fuse = _is_float(b1) and _is_float(b2) and _is_float(eps)
    if _resolve_fused(fn, fused, can_fuse, "betas and eps"):
        return stacked_adam(lr, (float(b1), float(b2)), float(eps),  # type: ignore[arg-type]
                            weight_decay, decoupled=decoupled, maximize=maximize,
                            moment_dtype=moment_dtype)
    no_decay = _is_float(weight_decay) and float(weight_decay) == 0.0  # type: ignore[arg-type]
    hypers = {"lr": lr, "betas[0]": b1, "betas[1]": b2, "eps": eps,
              "weight_decay": weight_decay}

    def init_fn(params: Params) -> OptState:
        _check_n(fn, {k: v for k, v in hypers.items() if not callable(v)}, params)
        return StackedAdamState(mu=_zeros_state(params, moment_dtype),
                                nu=_zeros_state(params, moment_dtype),
                                count=torch.zeros((), dtype=torch.int64,
                                                  device=_count_device(params)))

    def update_fn(updates: Updates, state: OptState, *, params: Params | None = None,
                  inplace: bool = True) -> tuple[Updates, OptState]:
        del inplace  # always out-of-place
        _, spec, grads, ps = _flatten_update(fn, updates, params, no_decay)
        ps = ps if ps is not None else [None] * len(grads)
        mus, nus = spec.flatten_up_to(state.mu), spec.flatten_up_to(state.nu)
        lr_t = _lr_now(lr, state.count)
        count = state.count + 1
        new_u: list[Any] = []
        new_m: list[Any] = []
        new_v: list[Any] = []
        for g, m0, v0, p in zip(grads, mus, nus, ps, strict=True):
            if g is None:
                new_u.append(None)
                new_m.append(m0)
                new_v.append(v0)
                continue
            work, nd = _opmath(g.dtype), g.ndim
            t = count.to(device=g.device, dtype=work)
            beta1, beta2 = _as(b1, work, nd), _as(b2, work, nd)
            lr_b = _as(lr_t, work, nd)
            d = g.to(work)
            if maximize:
                d = -d
            if not no_decay and not decoupled:
                d = d + _as(weight_decay, work, nd) * p.to(work)
            m = m0.to(work) * beta1 + (1.0 - beta1) * d
            v = v0.to(work) * beta2 + (1.0 - beta2) * (d * d)
            bc1 = 1.0 - torch.pow(beta1, t)
            bc2 = 1.0 - torch.pow(beta2, t)
            u = -(lr_b / bc1) * m / (torch.sqrt(v) / torch.sqrt(bc2) + _as(eps, work, nd))
            if not no_decay and decoupled:
                u = u - lr_b * _as(weight_decay, work, nd) * p.to(work)
            new_u.append(u.to(g.dtype))
            new_m.append(m.to(m0.dtype))
            new_v.append(v.to(v0.dtype))
        return spec.unflatten(new_u), StackedAdamState(
            mu=spec.unflatten(new_m), nu=spec.unflatten(new_v), count=count)

    return GradientTransformation(init_fn, update_fn)


def per_member_optimizer(
    make_optimizer: Callable[..., GradientTransformation],
    hyperparams: Mapping[str, Tensor],
) -> GradientTransformation:
    """Return a transformation over stacked leaves running ``make_optimizer(**h_n)`` per member.

    ``hyperparams`` maps keyword names of ``make_optimizer`` to ``(N,)`` tensors; member ``n``
    is updated by ``make_optimizer(**{k: v[n]})`` (``init`` and ``update`` run under ``vmap``,
    so the hyperparameters reach the optimizer as 0-d batched tensors. torchopt's aliases
    check ``lr >= 0`` in Python, which vmap refuses: pass the lr as a constant schedule,
    ``lambda lr: torchopt.sgd(lambda _: lr)``). ``make_optimizer`` is called anew on every
    update, so the transformation must keep all its state in the optimizer state, none in
    Python: ``init`` checks this on member 0 (two updates from the same state must agree) and
    raises ``ValueError`` otherwise -- torchopt's momentum (``trace``) keeps a Python
    first-call flag and is refused. For SGD with momentum / Nesterov and Adam/AdamW with
    per-member momentum, betas or eps use :func:`per_member_sgd` / :func:`per_member_adam`
    (exact, and fused when only lr and weight decay vary). The state is the per-member state
    stacked on dim 0.

    Example:
        >>> import torch, torchopt
        >>> from torchfn.optim import per_member_optimizer
        >>> opt = per_member_optimizer(lambda lr: torchopt.sgd(lambda _: lr),
        ...                            {"lr": torch.tensor([0.1, 1.0])})
        >>> params = {"w": torch.zeros(2, 3)}
        >>> updates, _ = opt.update({"w": torch.ones(2, 3)}, opt.init(params), params=params)
        >>> updates["w"][:, 0]
        tensor([-0.1000, -1.0000])
    """
    where = "per_member_optimizer(make_optimizer, hyperparams)"
    names = sorted(hyperparams)
    for k in names:
        v = hyperparams[k]
        if not isinstance(v, Tensor) or v.ndim != 1:
            raise ValueError(f"{where}: hyperparams[{k!r}] must be a (N,) tensor, got "
                             f"{_fmt(v.shape) if isinstance(v, Tensor) else type(v).__name__}")
    hs = {k: hyperparams[k] for k in names}

    def check(params: Params) -> None:
        n = _n_members(params, where)
        for k, v in hs.items():
            if v.shape[0] != n:
                raise ValueError(f"{where}: hyperparams[{k!r}] has {v.shape[0]} values, but "
                                 f"the params stack N={n} members")

    def check_pure(params: Params) -> None:
        # A transformation with Python state (torchopt's trace: a first-call flag) behaves
        # differently on its first and later calls; rebuilt per update it would silently
        # drop momentum. Probe member 0: a second update from the same state must agree
        # with a fresh transformation's first update from that state.
        h0 = {k: v[0] for k, v in hs.items()}
        p0 = optree.tree_map(lambda t: t[0].detach(), params)
        gen = torch.Generator().manual_seed(0)
        g0 = optree.tree_map(lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype
                                                   ).to(t.device), p0)
        with torch.no_grad():
            used = make_optimizer(**h0)
            _, s1 = used.update(g0, used.init(p0), params=p0, inplace=False)
            again, _ = used.update(g0, s1, params=p0, inplace=False)
            fresh, _ = make_optimizer(**h0).update(g0, s1, params=p0, inplace=False)
        for a, b in zip(optree.tree_leaves(again), optree.tree_leaves(fresh), strict=True):
            if not torch.equal(a, b):
                raise ValueError(
                    f"{where}: make_optimizer(...) builds a transformation that keeps state in "
                    "Python between updates (torchopt's momentum/trace does: a first-call "
                    "flag), so rebuilding it per update would be silently wrong. Use "
                    "torchfn.optim.per_member_sgd(lr, momentum=..., nesterov=...) or "
                    "per_member_adam(lr, betas=...), whose hyperparameters may all be (N,) "
                    "tensors")

    def init_fn(params: Params) -> OptState:
        check(params)
        check_pure(params)
        return torch.func.vmap(lambda h, p: make_optimizer(**h).init(p))(hs, params)

    def update_fn(updates: Updates, state: OptState, *, params: Params | None = None,
                  inplace: bool = True) -> tuple[Updates, OptState]:
        del inplace  # always out-of-place

        def one(h: dict[str, Tensor], g: Updates, s: OptState, p: Params | None) -> Any:
            return make_optimizer(**h).update(g, s, params=p, inplace=False)

        return torch.func.vmap(one, in_dims=(0, 0, 0, None if params is None else 0))(
            hs, updates, state, params)

    return GradientTransformation(init_fn, update_fn)
