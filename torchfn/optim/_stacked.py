"""Fused Adam/AdamW and SGD over stacked ensemble members, as torchopt transformations.

Every leaf of the params is ``(N, ...)`` with the N members along dim 0, and member ``n`` is
updated with its own learning rate and weight decay, exactly as N separate ``torch.optim``
optimizers would. One step is one call of a multi-leaf library op per group of leaves with one
dtype and device (one kernel launch on CUDA), see :mod:`torchfn.ops._stacked_optim`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor
from torchopt.base import GradientTransformation
from torchopt.typing import OptState, Params, Updates

from torchfn._checks import _LOW, _check_like, _fmt, _member_tensor, _opmath, check_float_tensor
from torchfn.ops import stacked_adam_update_multi, stacked_sgd_update_multi

__all__ = ["StackedAdamState", "StackedSgdState", "stacked_adam", "stacked_sgd"]


class StackedAdamState(NamedTuple):
    """State of :func:`stacked_adam`: moments like the params and one 0-d int64 step count.

    The count is shared by all leaves (the number of updates so far); a leaf whose gradient is
    None in an update keeps its moments.
    """

    mu: Params
    nu: Params
    count: Tensor


class StackedSgdState(NamedTuple):
    """State of :func:`stacked_sgd`: momentum buffers (None without momentum), step count."""

    momentum_buffer: Params | None
    count: Tensor


def _path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in path) or "<root>"


def _members(fn: str, tree: Any, what: str) -> int | None:
    """Return the common N of the (non-None) leaves of ``tree``; raise if they disagree."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    seen: tuple[str, int] | None = None
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, Tensor):
            raise TypeError(f"{fn}: expected every leaf of {what} to be a tensor, got "
                            f"{type(leaf).__name__} at {_path_name(path)!r}")
        if leaf.ndim == 0:
            raise ValueError(f"{fn}: leaf {_path_name(path)!r} of {what} is 0-d; stacked "
                             "parameters have the members along dim 0, shape (N, ...)")
        if seen is None:
            seen = (_path_name(path), leaf.shape[0])
        elif leaf.shape[0] != seen[1]:
            raise ValueError(
                f"{fn}: every leaf of {what} must stack the same number of members N along "
                f"dim 0; got N={seen[1]} for {seen[0]!r} and N={leaf.shape[0]} for "
                f"{_path_name(path)!r}"
            )
    return None if seen is None else seen[1]


def _check_member_hparam(fn: str, arg: str, value: Any, n: int | None) -> None:
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{fn}({arg}=...): expected a floating-point tensor, got "
                            f"dtype {value.dtype}")
        if value.ndim > 1 or (value.ndim == 1 and n is not None and value.shape[0] != n):
            raise ValueError(
                f"{fn}({arg}=...): expected a float, a 0-d tensor or a tensor of shape (N,) = "
                f"({n},) (one value per member; N = dim 0 of every parameter leaf), got shape "
                f"{_fmt(value.shape)}"
            )
    elif callable(value) and arg == "lr":
        return
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
        raise ValueError(f"{fn}({arg}=...): expected a float >= 0 or a tensor, got {value!r}")


def _moment_dtype(p: Tensor, moment_dtype: torch.dtype | None, fn: str) -> torch.dtype:
    if moment_dtype is None:
        return torch.float32 if p.dtype in _LOW else p.dtype
    if moment_dtype != p.dtype and not (p.dtype in _LOW and moment_dtype == torch.float32):
        raise TypeError(f"{fn}(moment_dtype={moment_dtype}): expected None, the parameter "
                        f"dtype {p.dtype}" + (" or torch.float32" if p.dtype in _LOW else ""))
    return moment_dtype


class _Hparams:
    """The per-member hyperparameter tensors of one update, for the group led by ``g``.

    Float values become 0-d tensors made once per (compute dtype, device) in eager mode
    (cached: no allocation per step); tensors are checked and cast to the compute dtype.
    """

    def __init__(self, op: str) -> None:
        self.op = op
        self._cache: dict[tuple[str, float, torch.dtype, torch.device], Tensor] = {}

    def get(self, name: str, value: Any, g: Tensor) -> Tensor:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                not torch.compiler.is_compiling():
            key = (name, float(value), _opmath(g.dtype), g.device)
            t = self._cache.get(key)
            if t is None:
                t = torch.full((), float(value), dtype=key[2], device=g.device)
                self._cache[key] = t
            return t
        return _member_tensor(self.op, name, value, g)


def _flatten_like(fn: str, spec: Any, tree: Any, what: str) -> list[Any]:
    try:
        return spec.flatten_up_to(tree)  # type: ignore[no-any-return]
    except ValueError as exc:
        raise ValueError(f"{fn}: {what} does not have the structure of the updates: {exc}"
                         ) from exc


def _groups(op: str, grads: list[Any], states: list[Any], params: list[Any] | None,
            state_arg: str) -> dict[tuple[Any, ...], list[int]]:
    """Check every leaf; return leaf indices grouped by (dtype, state dtype, device)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, g in enumerate(grads):
        if g is None:
            continue
        check_float_tensor(op, "updates", g)
        s = states[i]
        if s is not None:
            _check_like(op, state_arg, s, g, state=True)
        if params is not None:
            _check_like(op, "params", params[i], g, state=False)
        key = (g.dtype, None if s is None else s.dtype, g.device)
        groups.setdefault(key, []).append(i)
    return groups


def _count_on(count: Tensor, device: torch.device) -> Tensor:
    return count if count.device == device else count.to(device, non_blocking=True)


def _count_device(params: Params) -> torch.device:
    """Return the device of the step counter: the first parameter's, or the CPU for none."""
    leaves = optree.tree_leaves(params)
    return leaves[0].device if leaves else torch.device("cpu")


def _flatten_update(
    fn: str, updates: Updates, params: Params | None, no_decay: bool
) -> tuple[str, Any, list, list | None]:
    """Check an ``update`` call and return ``(where, spec, grads, params_flat_or_None)``."""
    where = f"{fn}.update(updates, state, params)"
    if not no_decay and params is None:
        raise ValueError(f"{where}: weight decay needs the parameters; call "
                         "update(grads, state, params=params)")
    _members(where, updates, "updates")
    spec = optree.tree_structure(updates, none_is_leaf=True)
    grads = spec.flatten_up_to(updates)
    ps = None if no_decay else _flatten_like(where, spec, params, "params")
    return where, spec, grads, ps


def stacked_adam(
    lr: float | Tensor | Callable[[Tensor], Any] = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | Tensor = 0.0,
    *,
    decoupled: bool = False,
    eps_root: float = 0.0,
    maximize: bool = False,
    moment_dtype: torch.dtype | None = None,
    moment_requires_grad: bool = False,
) -> GradientTransformation:
    """Return Adam/AdamW over stacked members as a fused, differentiable torchopt transformation.

    Every leaf of the params is ``(N, ...)`` with the N members along dim 0; member ``n`` is
    updated with ``lr[n]`` and ``weight_decay[n]`` as its own ``torch.optim.Adam``
    (``decoupled=False``, L2 decay) or ``torch.optim.AdamW`` (``decoupled=True``) would; all
    leaves in one fused kernel launch. ``lr`` and ``weight_decay`` are floats (shared), 0-d or
    ``(N,)`` floating tensors (on the params' device; the updates are differentiable w.r.t.
    them, e.g. to meta-learn per-member learning rates), and ``lr`` may be a torchopt schedule
    (a function of the 0-d int64 count returning a float or a tensor). Use out-of-place
    (always, whatever ``inplace`` says): ``updates, state = opt.update(grads, state,
    params=params)`` then ``torchopt.apply_updates(params, updates, inplace=False)``. The state
    is :class:`StackedAdamState`; moments default to float32 for float16/bfloat16 params
    (``moment_dtype`` overrides). Compiles with ``torch.compile(fullgraph=True)`` without
    recompiling across steps.

    Example:
        >>> import torch, torchopt
        >>> from torchfn.optim import stacked_adam
        >>> params = {"w": torch.zeros(3, 2)}  # 3 members
        >>> opt = stacked_adam(lr=torch.tensor([0.1, 0.2, 0.3]))
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(3, 2)}, state, params=params)
        >>> torchopt.apply_updates(params, updates, inplace=False)["w"][:, 0]
        tensor([-0.1000, -0.2000, -0.3000])
    """
    fn = "torchfn.optim.stacked_adam"
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"{fn}(betas=...): expected a pair of floats in [0, 1), got {betas!r}")
    if not eps >= 0.0 or not eps_root >= 0.0:
        raise ValueError(f"{fn}(eps=..., eps_root=...): expected values >= 0, got eps={eps!r}"
                         f", eps_root={eps_root!r}")
    _check_member_hparam(fn, "lr", lr, None)
    _check_member_hparam(fn, "weight_decay", weight_decay, None)
    hp = _Hparams("stacked_adam")
    no_decay = not isinstance(weight_decay, Tensor) and float(weight_decay) == 0.0
    hyper = (float(betas[0]), float(betas[1]), float(eps), float(eps_root), bool(decoupled),
             bool(maximize))

    def init_fn(params: Params) -> OptState:
        n = _members(f"{fn}.init(params)", params, "params")
        _check_member_hparam(fn, "lr", lr, n)
        _check_member_hparam(fn, "weight_decay", weight_decay, n)

        def moment(p: Tensor) -> Tensor:
            return torch.zeros(p.shape, dtype=_moment_dtype(p, moment_dtype, fn),
                               device=p.device, requires_grad=moment_requires_grad)

        device = _count_device(params)
        return StackedAdamState(mu=optree.tree_map(moment, params),
                                nu=optree.tree_map(moment, params),
                                count=torch.zeros((), dtype=torch.int64, device=device))

    def update_fn(
        updates: Updates,
        state: OptState,
        *,
        params: Params | None = None,
        inplace: bool = True,
    ) -> tuple[Updates, OptState]:
        del inplace  # always out-of-place
        where, spec, grads, ps = _flatten_update(fn, updates, params, no_decay)
        mus = _flatten_like(where, spec, state.mu, "state.mu")
        nus = _flatten_like(where, spec, state.nu, "state.nu")
        lr_now = lr(state.count) if callable(lr) else lr
        count = state.count + 1
        new_u: list[Any] = [None] * len(grads)
        new_mu, new_nu = list(mus), list(nus)
        for (_, _, device), idx in _groups("stacked_adam.update", grads, mus, ps, "state.mu").items():
            g0 = grads[idx[0]]
            u, m, v = stacked_adam_update_multi(
                [grads[i] for i in idx], [mus[i] for i in idx], [nus[i] for i in idx],
                None if ps is None else [ps[i] for i in idx], _count_on(count, device),
                hp.get("lr", lr_now, g0),
                None if no_decay else hp.get("weight_decay", weight_decay, g0), hyper)
            for j, i in enumerate(idx):
                new_u[i], new_mu[i], new_nu[i] = u[j], m[j], v[j]
        return spec.unflatten(new_u), StackedAdamState(
            mu=spec.unflatten(new_mu), nu=spec.unflatten(new_nu), count=count)

    return GradientTransformation(init_fn, update_fn)


def stacked_sgd(
    lr: float | Tensor | Callable[[Tensor], Any],
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float | Tensor = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    moment_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Return SGD over stacked members as a fused, differentiable torchopt transformation.

    Same arguments and semantics as ``torch.optim.SGD`` per member (momentum buffer equal to
    the gradient on the first step, dampening, Nesterov, L2 weight decay, maximize), with
    ``lr`` and ``weight_decay`` floats or 0-d/``(N,)`` tensors (``lr`` may also be a
    schedule of the count); all leaves in one fused kernel launch. The state is
    :class:`StackedSgdState`. Use out-of-place, as :func:`stacked_adam`.

    Example:
        >>> import torch, torchopt
        >>> from torchfn.optim import stacked_sgd
        >>> params = {"w": torch.zeros(2, 3)}
        >>> opt = stacked_sgd(lr=torch.tensor([0.1, 1.0]), momentum=0.9)
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2, 3)}, state, params=params)
        >>> updates["w"][:, 0]
        tensor([-0.1000, -1.0000])
    """
    fn = "torchfn.optim.stacked_sgd"
    _check_member_hparam(fn, "lr", lr, None)
    _check_member_hparam(fn, "weight_decay", weight_decay, None)
    if not momentum >= 0.0:
        raise ValueError(f"{fn}(momentum=...): expected a float >= 0, got {momentum!r}")
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(f"{fn}(nesterov=True): Nesterov momentum requires momentum > 0 and "
                         f"dampening == 0, got momentum={momentum!r}, dampening={dampening!r}")
    hp = _Hparams("stacked_sgd")
    no_decay = not isinstance(weight_decay, Tensor) and float(weight_decay) == 0.0
    use_buf = momentum != 0.0
    hyper = (float(momentum), float(dampening), bool(nesterov), bool(maximize))

    def init_fn(params: Params) -> OptState:
        n = _members(f"{fn}.init(params)", params, "params")
        _check_member_hparam(fn, "lr", lr, n)
        _check_member_hparam(fn, "weight_decay", weight_decay, n)

        def buffer(p: Tensor) -> Tensor:
            return torch.zeros(p.shape, dtype=_moment_dtype(p, moment_dtype, fn),
                               device=p.device)

        device = _count_device(params)
        return StackedSgdState(
            momentum_buffer=optree.tree_map(buffer, params) if use_buf else None,
            count=torch.zeros((), dtype=torch.int64, device=device))

    def update_fn(
        updates: Updates,
        state: OptState,
        *,
        params: Params | None = None,
        inplace: bool = True,
    ) -> tuple[Updates, OptState]:
        del inplace  # always out-of-place
        where, spec, grads, ps = _flatten_update(fn, updates, params, no_decay)
        bufs = (_flatten_like(where, spec, state.momentum_buffer, "state.momentum_buffer")
                if use_buf else [None] * len(grads))
        lr_now = lr(state.count) if callable(lr) else lr
        count = state.count + 1
        new_u: list[Any] = [None] * len(grads)
        new_b = list(bufs)
        for (_, _, device), idx in _groups("stacked_sgd.update", grads, bufs, ps,
                                           "state.momentum_buffer").items():
            g0 = grads[idx[0]]
            u, b = stacked_sgd_update_multi(
                [grads[i] for i in idx], [bufs[i] for i in idx] if use_buf else None,
                None if ps is None else [ps[i] for i in idx], _count_on(count, device),
                hp.get("lr", lr_now, g0),
                None if no_decay else hp.get("weight_decay", weight_decay, g0), hyper)
            for j, i in enumerate(idx):
                new_u[i] = u[j]
                if b is not None:
                    new_b[i] = b[j]
        return spec.unflatten(new_u), StackedSgdState(
            momentum_buffer=spec.unflatten(new_b) if use_buf else None, count=count)

    return GradientTransformation(init_fn, update_fn)
