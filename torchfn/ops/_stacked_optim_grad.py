"""Derivatives of op 4's stacked Adam/SGD updates, in plain (differentiable) torch ops.

The backward and jvp rules of the ``autograd.Function`` classes in :mod:`torchfn.ops._stacked_optim`
call these; being made of ordinary torch ops, they are differentiable again, so every order of
derivative works (meta-learning through an inner optimizer step, Hessian-vector products).
Each recomputes the step's intermediates from the saved inputs (in the compute dtype) rather
than saving them, so a step that is never differentiated stores nothing extra. Also here: the
vmap helpers that fold a vmapped axis into the member axis.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchfn.ops.reference import _adam_parts, _per_member, _sgd_parts

# ---------------------------------------------------------------------------------------------
# Derivatives, in plain torch ops (differentiable again, so every order works)


def _member_sum(x: Tensor, like: Tensor) -> Tensor:
    """Sum ``x`` (N, ...) to the shape of the per-member tensor ``like`` (0-d or (N,))."""
    if like.ndim == 0:
        return x.sum().to(like.dtype)
    return (x.sum(dim=tuple(range(1, x.ndim))) if x.ndim > 1 else x).to(like.dtype)


def _zeros_like_work(x: Tensor, work: torch.dtype) -> Tensor:
    return torch.zeros(x.shape, dtype=work, device=x.device)


def _adam_vjp(
    saved: tuple[Any, ...],
    hyper: tuple[Any, ...],
    needs: tuple[bool, ...],
    gu: Tensor,
    gm: Tensor,
    gv: Tensor,
) -> tuple[Tensor | None, ...]:
    """Return the gradients w.r.t. (grad, mu, nu, param, count, lr, weight_decay)."""
    grad, mu, nu, param, _count, lr, wd = saved
    beta1, beta2, _eps, _eps_root, decoupled, maximize = hyper
    x = _adam_parts(saved, hyper)
    dir_ = x.dir
    work = x.g.dtype
    gu, gm, gv = gu.to(work), gm.to(work), gv.to(work)
    g_dir = -x.lr * gu
    g_m = gm + g_dir * x.inv_bc1 / x.d
    g_v = gv + (-g_dir * dir_ / x.d) * x.inv_bc2 / (2.0 * x.s)
    g_g = (1.0 - beta1) * g_m + (2.0 * (1.0 - beta2)) * x.g * g_v
    d_grad = (-g_g if maximize else g_g).to(grad.dtype) if needs[0] else None
    d_mu = (beta1 * g_m).to(mu.dtype) if needs[1] else None
    d_nu = (beta2 * g_v).to(nu.dtype) if needs[2] else None
    d_param = d_lr = d_wd = None
    lr_term = -gu * dir_
    if wd is not None and not decoupled:
        if needs[3]:
            d_param = (x.wd * g_g).to(param.dtype)
        if needs[6]:
            d_wd = _member_sum(g_g * x.p, wd)
    elif wd is not None:
        lr_term = lr_term - gu * x.wd * x.p
        if needs[3]:
            d_param = (-x.lr * x.wd * gu).to(param.dtype)
        if needs[6]:
            d_wd = _member_sum(-gu * x.lr * x.p, wd)
    if needs[5]:
        d_lr = _member_sum(lr_term, lr)
    return d_grad, d_mu, d_nu, d_param, None, d_lr, d_wd


def _adam_jvp(
    saved: tuple[Any, ...], hyper: tuple[Any, ...], tangents: tuple[Tensor | None, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """Return the tangents of (update, new_mu, new_nu) given those of the inputs."""
    grad, mu, nu, _param, _count, _lr, wd = saved
    beta1, beta2, _eps, _eps_root, decoupled, maximize = hyper
    t_grad, t_mu, t_nu, t_param, _t_count, t_lr, t_wd = tangents
    x = _adam_parts(saved, hyper)
    dir_ = x.dir
    work, nd = x.g.dtype, grad.ndim
    t_g = _zeros_like_work(grad, work)
    if t_grad is not None:
        t_g = t_g + (-t_grad.to(work) if maximize else t_grad.to(work))
    t_p = None if t_param is None else t_param.to(work)
    t_wd_b = None if t_wd is None else _per_member(t_wd, nd, work)
    if wd is not None and not decoupled:
        if t_wd_b is not None:
            t_g = t_g + t_wd_b * x.p
        if t_p is not None:
            t_g = t_g + x.wd * t_p
    t_m = (1.0 - beta1) * t_g
    if t_mu is not None:
        t_m = t_m + beta1 * t_mu.to(work)
    t_v = (2.0 * (1.0 - beta2)) * x.g * t_g
    if t_nu is not None:
        t_v = t_v + beta2 * t_nu.to(work)
    t_s = t_v * x.inv_bc2 / (2.0 * x.s)
    t_dir = t_m * x.inv_bc1 / x.d - dir_ * t_s / x.d
    t_u = -x.lr * t_dir
    if t_lr is not None:
        t_u = t_u - _per_member(t_lr, nd, work) * dir_
    if wd is not None and decoupled:
        if t_lr is not None:
            t_u = t_u - _per_member(t_lr, nd, work) * x.wd * x.p
        if t_wd_b is not None:
            t_u = t_u - x.lr * t_wd_b * x.p
        if t_p is not None:
            t_u = t_u - x.lr * x.wd * t_p
    return t_u.to(grad.dtype), t_m.to(mu.dtype), t_v.to(nu.dtype)


def _sgd_vjp(
    saved: tuple[Any, ...],
    hyper: tuple[Any, ...],
    needs: tuple[bool, ...],
    gu: Tensor,
    gb: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """Return the gradients w.r.t. (grad, momentum_buffer, param, count, lr, weight_decay)."""
    grad, buf, param, _count, lr, wd = saved
    momentum, dampening, nesterov, maximize = hyper
    x = _sgd_parts(saved, hyper)
    work = x.g.dtype
    gu = gu.to(work)
    g_d = -x.lr * gu
    d_buf = None
    if buf is None:
        g_g = g_d
    else:
        g_b = g_d * momentum if nesterov else g_d
        if gb is not None and gb.numel() > 0:
            g_b = g_b + gb.to(work)
        zero = torch.zeros((), dtype=work, device=grad.device)
        g_g = torch.where(x.first, g_b, (1.0 - dampening) * g_b)
        if nesterov:
            g_g = g_g + g_d
        if needs[1]:
            d_buf = torch.where(x.first, zero, momentum * g_b).to(buf.dtype)
    d_grad = (-g_g if maximize else g_g).to(grad.dtype) if needs[0] else None
    d_param = (x.wd * g_g).to(param.dtype) if wd is not None and needs[2] else None
    d_wd = _member_sum(g_g * x.p, wd) if wd is not None and needs[5] else None
    d_lr = _member_sum(-gu * x.d, lr) if needs[4] else None
    return d_grad, d_buf, d_param, None, d_lr, d_wd


def _sgd_jvp(
    saved: tuple[Any, ...], hyper: tuple[Any, ...], tangents: tuple[Tensor | None, ...]
) -> tuple[Tensor, Tensor | None]:
    """Return the tangents of (update, new_momentum_buffer) given those of the inputs."""
    grad, buf, _param, _count, _lr, wd = saved
    momentum, dampening, nesterov, maximize = hyper
    t_grad, t_buf, t_param, _t_count, t_lr, t_wd = tangents
    x = _sgd_parts(saved, hyper)
    work, nd = x.g.dtype, grad.ndim
    t_g = _zeros_like_work(grad, work)
    if t_grad is not None:
        t_g = t_g + (-t_grad.to(work) if maximize else t_grad.to(work))
    if wd is not None:
        if t_wd is not None:
            t_g = t_g + _per_member(t_wd, nd, work) * x.p
        if t_param is not None:
            t_g = t_g + x.wd * t_param.to(work)
    t_b_out: Tensor | None
    if buf is None:
        t_d = t_g
        t_b_out = None  # the empty second output is not differentiable
    else:
        rest = (1.0 - dampening) * t_g
        if t_buf is not None:
            rest = rest + momentum * t_buf.to(work)
        t_b = torch.where(x.first, t_g, rest)
        t_d = t_g + momentum * t_b if nesterov else t_b
        t_b_out = t_b.to(buf.dtype)
    t_u = -x.lr * t_d
    if t_lr is not None:
        t_u = t_u - _per_member(t_lr, nd, work) * x.d
    return t_u.to(grad.dtype), t_b_out


# ---------------------------------------------------------------------------------------------
# vmap: fold the vmapped axis into the member axis, (B, N, ...) -> (B*N, ...)


def _fold(
    batch: int, in_dims: tuple[Any, ...], args: tuple[Any, ...], kinds: str
) -> tuple[list[Any], int]:
    """Return ``args`` with the vmap axis folded into the member axis, and N.

    ``kinds`` has one letter per argument: ``L`` a leaf ``(N, ...)``, ``M`` a per-member
    tensor (0-d or ``(N,)``), ``-`` anything else (passed through).
    """
    n = next(a.shape[0] if d is None else a.movedim(d, 0).shape[1]
             for a, k, d in zip(args, kinds, in_dims, strict=True) if k == "L" and a is not None)
    out: list[Any] = []
    for a, k, d in zip(args, kinds, in_dims, strict=True):
        if k == "-" or a is None:
            out.append(a)
            continue
        if k == "L":
            a = a.movedim(d, 0) if d is not None else a.unsqueeze(0).expand(batch, *a.shape)
            out.append(a.reshape(batch * n, *a.shape[2:]))
            continue
        if d is None:  # an unbatched per-member tensor
            out.append(a if a.ndim == 0 else a.unsqueeze(0).expand(batch, n).reshape(-1))
            continue
        a = a.movedim(d, 0)
        if a.ndim == 1:  # logically 0-d: one value per batch entry, shared by its members
            a = a.unsqueeze(1).expand(batch, n)
        out.append(a.reshape(-1))
    return out, n


def _unfold(x: Tensor, batch: int, n: int) -> Tensor:
    return x.reshape(batch, n, *x.shape[1:])
