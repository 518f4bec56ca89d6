"""Op 4 over many leaves at once: one library call (one CUDA launch) per optimizer step.

``torchfn::stacked_adam_update_multi`` / ``torchfn::stacked_sgd_update_multi`` take lists of
stacked leaves that share N, dtype and device, and one count, lr and weight decay; the
``autograd.Function`` classes here give them the same derivatives, jvp and vmap rules as the
single-leaf Functions in :mod:`torchfn.ops._stacked_optim` (applied leaf by leaf, with the
derivatives of lr and weight decay summed over the leaves). The stacked optimizers of
:mod:`torchfn.optim` call :func:`stacked_adam_update_multi` / :func:`stacked_sgd_update_multi`
once per group of leaves; one call instead of one per leaf is what makes an eager ensemble
step fast (the per-leaf Python cost exceeds the kernels' time).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchfn.ops import reference
from torchfn.ops._stacked_optim import _needs_autograd, use_stacked_kernel
from torchfn.ops._stacked_optim_grad import _adam_jvp, _adam_vjp, _fold, _sgd_jvp, _sgd_vjp, _unfold


class _StackedAdamMultiFn(torch.autograd.Function):
    """``torchfn::stacked_adam_update_multi`` over k leaves with derivatives in torch ops.

    Arguments, flat: ``(k, has_param, *grads, *mus, *nus, *params, count, lr, weight_decay,
    beta1, beta2, eps, eps_root, decoupled, maximize)`` with ``k`` params when ``has_param``
    else none; outputs ``(*updates, *new_mus, *new_nus)``. Leaves share N, count, lr and
    weight decay; the derivatives of lr and weight decay sum over the leaves.
    """

    @staticmethod
    def forward(*args):  # type: ignore[no-untyped-def, override]
        k, has_p = args[0], args[1]
        t = args[2:]
        np_ = k if has_p else 0
        grads, mus, nus = t[:k], t[k:2 * k], t[2 * k:3 * k]
        params = t[3 * k:3 * k + np_]
        rest = t[3 * k + np_:]
        u, m, v = torch.ops.torchfn.stacked_adam_update_multi(grads, mus, nus, params, *rest)
        return (*u, *m, *v)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        k, has_p = inputs[0], inputs[1]
        n_t = (4 if has_p else 3) * k + 3
        ctx.save_for_backward(*inputs[2:2 + n_t])
        ctx.save_for_forward(*inputs[2:2 + n_t])
        ctx.k, ctx.has_p, ctx.hyper = k, has_p, tuple(inputs[2 + n_t:])

    @staticmethod
    def _leaf(ctx, saved: tuple[Any, ...], i: int) -> tuple[Any, ...]:  # type: ignore[no-untyped-def]
        k = ctx.k
        p = saved[3 * k + i] if ctx.has_p else None
        return (saved[i], saved[k + i], saved[2 * k + i], p, *saved[-3:])

    @staticmethod
    def backward(ctx, *grad_outputs):  # type: ignore[no-untyped-def, override]
        k, has_p = ctx.k, ctx.has_p
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        np_ = k if has_p else 0
        need_lr, need_wd = needs[3 * k + np_ + 1], needs[3 * k + np_ + 2]
        d = [[], [], [], []]
        d_lr = d_wd = None
        for i in range(k):
            leaf_needs = (needs[i], needs[k + i], needs[2 * k + i],
                          needs[3 * k + i] if has_p else False, False, need_lr, need_wd)
            dg, dm, dv, dp, _, dl, dw = _adam_vjp(
                _StackedAdamMultiFn._leaf(ctx, saved, i), ctx.hyper, leaf_needs,
                grad_outputs[i], grad_outputs[k + i], grad_outputs[2 * k + i])
            for lst, x in zip(d, (dg, dm, dv, dp), strict=True):
                lst.append(x)
            d_lr = dl if d_lr is None else (d_lr if dl is None else d_lr + dl)
            d_wd = dw if d_wd is None else (d_wd if dw is None else d_wd + dw)
        return (None, None, *d[0], *d[1], *d[2], *(d[3] if has_p else ()), None, d_lr, d_wd,
                *([None] * len(ctx.hyper)))

    @staticmethod
    def jvp(ctx, *tangents):  # type: ignore[no-untyped-def, override]
        k, has_p = ctx.k, ctx.has_p
        saved = ctx.saved_tensors
        t = tangents[2:]
        np_ = k if has_p else 0
        t_count, t_lr, t_wd = t[3 * k + np_:3 * k + np_ + 3]
        outs = [_adam_jvp(_StackedAdamMultiFn._leaf(ctx, saved, i), ctx.hyper,
                          (t[i], t[k + i], t[2 * k + i], t[3 * k + i] if has_p else None,
                           t_count, t_lr, t_wd))
                for i in range(k)]
        return tuple(o[j] for j in range(3) for o in outs)

    @staticmethod
    def vmap(info, in_dims, *args):  # type: ignore[no-untyped-def]
        k, has_p = args[0], args[1]
        kinds = "--" + "L" * ((4 if has_p else 3) * k) + "MMM" + "------"
        folded, n = _fold(info.batch_size, in_dims, args, kinds)
        out = _StackedAdamMultiFn.apply(*folded)
        return tuple(_unfold(o, info.batch_size, n) for o in out), (0,) * len(out)


class _StackedSgdMultiFn(torch.autograd.Function):
    """``torchfn::stacked_sgd_update_multi`` over k leaves with derivatives in torch ops.

    Arguments, flat: ``(k, has_buf, has_param, *grads, *buffers, *params, count, lr,
    weight_decay, momentum, dampening, nesterov, maximize)``; outputs ``(*updates,
    *new_buffers)`` (no buffers when ``has_buf`` is False).
    """

    @staticmethod
    def forward(*args):  # type: ignore[no-untyped-def, override]
        k, has_b, has_p = args[0], args[1], args[2]
        t = args[3:]
        nb, np_ = (k if has_b else 0), (k if has_p else 0)
        grads, bufs = t[:k], t[k:k + nb]
        params = t[k + nb:k + nb + np_]
        rest = t[k + nb + np_:]
        u, b = torch.ops.torchfn.stacked_sgd_update_multi(grads, bufs, params, *rest)
        return (*u, *b)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        k, has_b, has_p = inputs[0], inputs[1], inputs[2]
        n_t = k * (1 + has_b + has_p) + 3
        ctx.save_for_backward(*inputs[3:3 + n_t])
        ctx.save_for_forward(*inputs[3:3 + n_t])
        ctx.k, ctx.has_b, ctx.has_p = k, has_b, has_p
        ctx.hyper = tuple(inputs[3 + n_t:])

    @staticmethod
    def _leaf(ctx, saved: tuple[Any, ...], i: int) -> tuple[Any, ...]:  # type: ignore[no-untyped-def]
        k, nb = ctx.k, (ctx.k if ctx.has_b else 0)
        b = saved[k + i] if ctx.has_b else None
        p = saved[k + nb + i] if ctx.has_p else None
        return (saved[i], b, p, *saved[-3:])

    @staticmethod
    def backward(ctx, *grad_outputs):  # type: ignore[no-untyped-def, override]
        k, has_b, has_p = ctx.k, ctx.has_b, ctx.has_p
        nb, np_ = (k if has_b else 0), (k if has_p else 0)
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        need_lr, need_wd = needs[k + nb + np_ + 1], needs[k + nb + np_ + 2]
        d_g, d_b, d_p = [], [], []
        d_lr = d_wd = None
        for i in range(k):
            leaf_needs = (needs[i], needs[k + i] if has_b else False,
                          needs[k + nb + i] if has_p else False, False, need_lr, need_wd)
            gb = grad_outputs[k + i] if has_b else None
            dg, db, dp, _, dl, dw = _sgd_vjp(_StackedSgdMultiFn._leaf(ctx, saved, i), ctx.hyper,
                                             leaf_needs, grad_outputs[i], gb)
            d_g.append(dg)
            d_b.append(db)
            d_p.append(dp)
            d_lr = dl if d_lr is None else (d_lr if dl is None else d_lr + dl)
            d_wd = dw if d_wd is None else (d_wd if dw is None else d_wd + dw)
        return (None, None, None, *d_g, *(d_b if has_b else ()), *(d_p if has_p else ()), None,
                d_lr, d_wd, *([None] * len(ctx.hyper)))

    @staticmethod
    def jvp(ctx, *tangents):  # type: ignore[no-untyped-def, override]
        k, has_b, has_p = ctx.k, ctx.has_b, ctx.has_p
        nb, np_ = (k if has_b else 0), (k if has_p else 0)
        saved = ctx.saved_tensors
        t = tangents[3:]
        t_count, t_lr, t_wd = t[k + nb + np_:k + nb + np_ + 3]
        outs = [_sgd_jvp(_StackedSgdMultiFn._leaf(ctx, saved, i), ctx.hyper,
                         (t[i], t[k + i] if has_b else None, t[k + nb + i] if has_p else None,
                          t_count, t_lr, t_wd))
                for i in range(k)]
        return (*(o[0] for o in outs), *((o[1] for o in outs) if has_b else ()))

    @staticmethod
    def vmap(info, in_dims, *args):  # type: ignore[no-untyped-def]
        k, has_b, has_p = args[0], args[1], args[2]
        kinds = "---" + "L" * (k * (1 + has_b + has_p)) + "MMM" + "----"
        folded, n = _fold(info.batch_size, in_dims, args, kinds)
        out = _StackedSgdMultiFn.apply(*folded)
        return tuple(_unfold(o, info.batch_size, n) for o in out), (0,) * len(out)


# ---------------------------------------------------------------------------------------------
# Many leaves at once (what the optimizers call): one launch, one Python call per step


def stacked_adam_update_multi(
    grads: list[Tensor],
    mus: list[Tensor],
    nus: list[Tensor],
    params: list[Tensor] | None,
    count: Tensor,
    lr: Tensor,
    weight_decay: Tensor | None,
    hyper: tuple[float, float, float, float, bool, bool],
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Return ``(updates, new_mus, new_nus)`` of one Adam step of leaves sharing N, dtype and
    device; ``count``, ``lr`` and ``weight_decay`` are already checked tensors (compute dtype).
    ``params`` is needed only with weight decay. ``hyper``: (beta1, beta2, eps, eps_root,
    decoupled, maximize).

    Example:
        >>> import torch
        >>> from torchfn.ops import stacked_adam_update_multi
        >>> g, m, v = [torch.ones(2, 3)], [torch.zeros(2, 3)], [torch.zeros(2, 3)]
        >>> u, m, v = stacked_adam_update_multi(g, m, v, None, torch.tensor(1),
        ...                                     torch.tensor([0.1, 0.2]), None,
        ...                                     (0.9, 0.999, 1e-8, 0.0, False, False))
        >>> u[0][:, 0]
        tensor([-0.1000, -0.2000])
    """
    ps = params if weight_decay is not None else None
    if not use_stacked_kernel("stacked_adam_update", grads[0]):
        outs = [reference.stacked_adam_update(g, m, v, None if ps is None else ps[i], count, lr,
                                              weight_decay, *hyper)
                for i, (g, m, v) in enumerate(zip(grads, mus, nus, strict=True))]
        return [o[0] for o in outs], [o[1] for o in outs], [o[2] for o in outs]
    k = len(grads)
    flat = (*grads, *mus, *nus, *(ps or ()), count, lr, weight_decay)
    if _needs_autograd(flat):
        out = _StackedAdamMultiFn.apply(k, ps is not None, *flat, *hyper)
        return list(out[:k]), list(out[k:2 * k]), list(out[2 * k:])
    u, m, v = torch.ops.torchfn.stacked_adam_update_multi(
        grads, mus, nus, ps or [], count, lr, weight_decay, *hyper)
    return list(u), list(m), list(v)


def stacked_sgd_update_multi(
    grads: list[Tensor],
    bufs: list[Tensor] | None,
    params: list[Tensor] | None,
    count: Tensor,
    lr: Tensor,
    weight_decay: Tensor | None,
    hyper: tuple[float, float, bool, bool],
) -> tuple[list[Tensor], list[Tensor] | None]:
    """Return ``(updates, new_buffers or None)`` of one SGD step of leaves sharing N, dtype and
    device (see :func:`stacked_adam_update_multi`). ``hyper``: (momentum, dampening, nesterov, maximize).

    Example:
        >>> import torch
        >>> from torchfn.ops import stacked_sgd_update_multi
        >>> u, b = stacked_sgd_update_multi([torch.ones(2, 3)], [torch.zeros(2, 3)], None,
        ...                                 torch.tensor(1), torch.tensor([0.1, 0.2]), None,
        ...                                 (0.9, 0.0, False, False))
        >>> u[0][:, 0]
        tensor([-0.1000, -0.2000])
    """
    ps = params if weight_decay is not None else None
    if not use_stacked_kernel("stacked_sgd_update", grads[0]):
        outs = [reference.stacked_sgd_update(g, None if bufs is None else bufs[i],
                                             None if ps is None else ps[i], count, lr,
                                             weight_decay, *hyper)
                for i, g in enumerate(grads)]
        return [o[0] for o in outs], (None if bufs is None else [o[1] for o in outs])
    k = len(grads)
    flat = (*grads, *(bufs or ()), *(ps or ()), count, lr, weight_decay)
    if _needs_autograd(flat):
        out = _StackedSgdMultiFn.apply(k, bufs is not None, ps is not None, *flat, *hyper)
        return list(out[:k]), (None if bufs is None else list(out[k:]))
    u, b = torch.ops.torchfn.stacked_sgd_update_multi(
        grads, bufs or [], ps or [], count, lr, weight_decay, *hyper)
    return list(u), (None if bufs is None else list(b))
