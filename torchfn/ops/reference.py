"""Pure-PyTorch reference twins of torchfn's custom ops.

Each twin computes what its kernel computes, in plain differentiable torch ops, so it works
everywhere the kernel might not: under every ``torch.func`` transform, under ``torch.compile``
(where Inductor fuses it with its neighbours), on any device, with or without a C++ compiler.
The public ops in :mod:`torchfn.ops` route here where the kernel is unsafe or slower; tests
compare every kernel against its twin.

Example:
    >>> import torch
    >>> from torchfn.ops import reference
    >>> reference.leaky_relu(torch.tensor([-2.0, 3.0]), 0.1)
    tensor([-0.2000,  3.0000])
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchfn._checks import _opmath, compute_once

__all__ = [
    "clipped_linear_bias_grad_sum",
    "clipped_linear_grad_sum",
    "leaky_relu",
    "linear_bias_grad_norms_sq",
    "linear_grad_norms_sq",
    "pad_for_tensor_cores",
    "sigmoid",
    "softmax_cross_entropy",
    "stacked_adam_update",
    "stacked_sgd_update",
]


def sigmoid(x: Tensor) -> Tensor:
    """Return ``1 / (1 + exp(-x))``, same shape and dtype as ``x`` (twin of ``torchfn::sigmoid``).

    Example:
        >>> sigmoid(torch.zeros(2))
        tensor([0.5000, 0.5000])
    """
    return torch.sigmoid(x)


def leaky_relu(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    """Return ``x`` where ``x > 0`` else ``negative_slope * x``, same shape and dtype as ``x``.

    Twin of ``torchfn::leaky_relu``.

    Example:
        >>> leaky_relu(torch.tensor([-1.0, 2.0]), 0.5)
        tensor([-0.5000,  2.0000])
    """
    return torch.where(x > 0, x, x * negative_slope)


def softmax_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Return ``F.cross_entropy(logits, target, ...)`` for class-index targets, in plain ops.

    Twin of ``torchfn::softmax_cross_entropy`` (+ the reduction): ``(N, C)``, ``(C,)`` or
    ``(N, C, d1, ...)`` logits, int64 ``target`` of the logits' shape without the class dim;
    ``reduction="none"`` gives ``target``'s shape, ``"sum"``/``"mean"`` a scalar (the mean is
    over rows whose target is not ``ignore_index``; NaN if there are none), in the logits'
    dtype. Half/bfloat16 logits are computed in float32 and rounded once, like the kernels.
    A target outside ``[0, C)`` that is not ``ignore_index`` gives that row a NaN loss and NaN
    gradients, like the CUDA kernel (no data-dependent check, so it works under vmap/compile
    and never triggers a device-side assert).

    Example:
        >>> softmax_cross_entropy(torch.zeros(2, 4), torch.tensor([1, 3]))
        tensor(1.3863)
    """
    if logits.dim() == 1:
        x, t = logits.unsqueeze(0), target.reshape(1)
    elif logits.dim() == 2:
        x, t = logits, target
    else:
        x, t = logits.movedim(1, -1).reshape(-1, logits.shape[1]), target.reshape(-1)
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    logp = torch.log_softmax(x.to(acc), dim=-1)
    keep = t != ignore_index
    valid = (t >= 0) & (t < x.shape[-1])
    picked = logp.gather(-1, torch.where(keep & valid, t, 0).unsqueeze(-1)).squeeze(-1)
    rows = -picked
    if label_smoothing != 0.0:
        rows = (1.0 - label_smoothing) * rows - label_smoothing * logp.mean(-1)
    one = torch.ones((), dtype=acc, device=x.device)
    rows = rows * torch.where(valid | ~keep, one, one * float("nan"))  # bad target: NaN
    rows = torch.where(keep, rows, torch.zeros((), dtype=acc, device=x.device))
    if reduction == "none":
        return rows.reshape(target.shape).to(logits.dtype)
    if reduction == "sum":
        return rows.sum().to(logits.dtype)
    if reduction == "mean":
        return (rows.sum() / keep.sum().to(acc)).to(logits.dtype)
    raise ValueError(
        f"reference.softmax_cross_entropy(reduction=...): expected 'none', 'sum' or 'mean', "
        f"got {reduction!r}"
    )


# ---------------------------------------------------------------------------------------------
# Op 3: per-sample gradient norms of a linear layer (twins of torchfn/ops/_ghost.py's kernels)


def linear_grad_norms_sq(
    a: Tensor, g: Tensor, bias: bool = False, method: str = "auto"
) -> Tensor:
    """Return ``(B,)`` squared norms of the per-sample gradients ``G_i = g_i^T a_i``.

    Twin of ``torchfn::linear_grad_norms_sq``. ``method="materialize"`` is the obvious
    definition: materialise every ``G_i`` with einsum and take its squared Frobenius norm.
    ``"gram"`` uses the equal closed forms ``||a_i||^2 ||g_i||^2`` (2-D) and
    ``<a_i a_i^T, g_i g_i^T>`` (3-D); ``"auto"`` takes the closed form for 2-D inputs and,
    for 3-D, Gram iff ``T (d_in + d_out) <= d_in d_out`` (fewer multiply-adds), so this twin
    stays usable at scale under ``torch.compile``. ``bias=True`` adds ``||sum_t g_it||^2``.

    Example:
        >>> linear_grad_norms_sq(torch.ones(1, 2), torch.ones(1, 3), method="materialize")
        tensor([6.])
    """
    if method not in ("auto", "gram", "materialize"):
        raise ValueError(f"reference.linear_grad_norms_sq(method=...): expected 'auto', 'gram' "
                         f"or 'materialize', got {method!r}")
    if a.dim() == 2:
        if method == "materialize":
            out = torch.einsum("bo,bi->boi", g, a).square().sum((1, 2))
        else:
            out = a.square().sum(-1) * g.square().sum(-1)
    else:
        time, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
        if method == "gram" or (method == "auto" and time * (d_in + d_out) <= d_in * d_out):
            a_t, g_t = pad_for_tensor_cores(a), pad_for_tensor_cores(g)
            gram_a = torch.einsum("bti,bsi->bts", a_t, a_t)
            gram_g = torch.einsum("bto,bso->bts", g_t, g_t)
            out = (gram_a * gram_g).sum((1, 2))
        else:
            out = torch.einsum("bto,bti->boi", g, a).square().sum((1, 2))
    if bias:
        out = out + linear_bias_grad_norms_sq(g)
    return out


def pad_for_tensor_cores(x: Tensor) -> Tensor:
    """``x (B, T, d)`` with zeros appended so ``T`` and ``d`` are multiples of 8 (half types,
    CUDA); any other ``x`` (float32/float64, CPU, aligned already) is returned as it is.

    The Gram products ``x_i x_i^T`` are ``(B, T, T)`` batched GEMMs contracting over ``d``:
    their output rows are ``T`` elements apart and their operand rows ``d`` apart. For
    float16/bfloat16 an odd ``T`` (a ViT's 197 tokens) or ``d`` (GPT-2's 50257-way logits)
    breaks the 16-byte alignment cuBLAS's Hopper tensor-core kernels need, and it falls back
    to far slower ones. Zero rows and columns add exact zeros to every Gram entry they touch,
    so the norms are unchanged.

    Example:
        >>> pad_for_tensor_cores(torch.ones(2, 197, 51)).shape  # CPU float32: unchanged
        torch.Size([2, 197, 51])
    """
    time, width = x.shape[1], x.shape[2]
    if not x.is_cuda or x.element_size() != 2 or (time % 8 == 0 and width % 8 == 0):
        return x
    return torch.nn.functional.pad(x, (0, -width % 8, 0, -time % 8))


def linear_bias_grad_norms_sq(g: Tensor) -> Tensor:
    """Return ``(B,)`` squared norms ``||sum_t g_it||^2`` of per-sample bias gradients.

    ``g`` is ``(B, d_out)`` or ``(B, T, d_out)``.

    Example:
        >>> linear_bias_grad_norms_sq(torch.tensor([[3.0, 4.0]]))
        tensor([25.])
    """
    per_sample = g if g.dim() == 2 else g.sum(1)
    return per_sample.square().sum(-1)


def clipped_linear_grad_sum(a: Tensor, g: Tensor, coef: Tensor) -> Tensor:
    """Return the ``(d_out, d_in)`` sum ``sum_i coef_i g_i^T a_i`` (summed over time for 3-D).

    Twin of ``torchfn::clipped_linear_grad_sum``: the per-sample weight gradients weighted by
    ``coef (B,)`` and summed, as one einsum over the batch (and time) dims -- a single GEMM;
    the per-sample gradients are never materialised.

    Example:
        >>> clipped_linear_grad_sum(torch.ones(2, 1), torch.ones(2, 2), torch.tensor([1.0, 2.0]))
        tensor([[3.],
                [3.]])
    """
    if a.dim() == 2:
        return torch.einsum("bo,bi->oi", g * coef[:, None], a)
    return torch.einsum("bto,bti->oi", g * coef[:, None, None], a)


def clipped_linear_bias_grad_sum(g: Tensor, coef: Tensor) -> Tensor:
    """Return the ``(d_out,)`` sum ``sum_i coef_i sum_t g_it`` of per-sample bias gradients.

    Example:
        >>> clipped_linear_bias_grad_sum(torch.ones(2, 3), torch.tensor([1.0, 2.0]))
        tensor([3., 3., 3.])
    """
    per_sample = g if g.dim() == 2 else g.sum(1)
    return coef @ per_sample


# --- op 4: fused optimizer updates over stacked parameters (N, ...) ---------------------------


def _per_member(t: Tensor, ndim: int, dtype: torch.dtype) -> Tensor:
    """Return a 0-d or ``(N,)`` tensor in ``dtype``, shaped ``(N, 1, ...)`` to broadcast."""
    t = t.to(dtype)
    return t if t.ndim == 0 else t.reshape(t.shape[0], *([1] * (ndim - 1)))


def _inv_bias_corrections(
    count: Tensor, beta1: float, beta2: float, ndim: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Return ``1 / (1 - beta**count)`` for both betas, computed in float64, in ``dtype``
    (once per step while compiling, not per element: :func:`torchfn._checks.compute_once`)."""
    work = torch.float32 if count.device.type == "mps" else torch.float64
    t = _per_member(count, ndim, work)
    inv1 = compute_once((1.0 / (1.0 - torch.pow(beta1, t))).to(dtype))
    inv2 = compute_once((1.0 / (1.0 - torch.pow(beta2, t))).to(dtype))
    return inv1, inv2


# The forward of one step, with the intermediates the derivatives in _stacked_optim_grad reuse;
# ``saved`` = (grad, moments..., param, count, lr, weight_decay), ``hyper`` = the float flags.


class _AdamParts(NamedTuple):
    g: Tensor  # the effective gradient (sign, L2 term applied), compute dtype
    p: Tensor | None
    lr: Tensor  # broadcastable per-member tensors
    wd: Tensor | None
    inv_bc1: Tensor
    inv_bc2: Tensor
    m: Tensor  # new moments
    v: Tensor
    s: Tensor  # sqrt(nu'/bc2 + eps_root)
    d: Tensor  # s + eps

    @property
    def dir(self) -> Tensor:
        """(m/bc1) / d (computed on use: the forward twin does not need it)."""
        return (self.m * self.inv_bc1) / self.d


def _adam_parts(saved: tuple[Any, ...], hyper: tuple[Any, ...]) -> _AdamParts:
    grad, mu, nu, param, count, lr, wd = saved
    beta1, beta2, eps, eps_root, decoupled, maximize = hyper
    work, nd = _opmath(grad.dtype), grad.ndim
    lr_b = _per_member(lr, nd, work)
    wd_b = None if wd is None else _per_member(wd, nd, work)
    inv_bc1, inv_bc2 = _inv_bias_corrections(count, beta1, beta2, nd, work)
    g = grad.to(work)
    if maximize:
        g = -g
    p = None if param is None else param.to(work)
    if wd_b is not None and not decoupled:
        g = g + wd_b * p
    m = mu.to(work) * beta1 + (1.0 - beta1) * g
    v = nu.to(work) * beta2 + (1.0 - beta2) * (g * g)
    s = torch.sqrt(v * inv_bc2 + eps_root)
    d = s + eps
    return _AdamParts(g, p, lr_b, wd_b, inv_bc1, inv_bc2, m, v, s, d)


class _SgdParts(NamedTuple):
    g: Tensor
    p: Tensor | None
    lr: Tensor
    wd: Tensor | None
    first: Tensor | None  # per-member bool: first step (count <= 1)
    b: Tensor | None  # new buffer
    d: Tensor  # direction: update = -lr * d


def _sgd_parts(saved: tuple[Any, ...], hyper: tuple[Any, ...]) -> _SgdParts:
    grad, buf, param, count, lr, wd = saved
    momentum, dampening, nesterov, maximize = hyper
    work, nd = _opmath(grad.dtype), grad.ndim
    lr_b = _per_member(lr, nd, work)
    wd_b = None if wd is None else _per_member(wd, nd, work)
    p = None if param is None else param.to(work)
    g = grad.to(work)
    if maximize:
        g = -g
    if wd_b is not None:
        g = g + wd_b * p
    if buf is None:
        return _SgdParts(g, p, lr_b, wd_b, None, None, g)
    first = _per_member(count, nd, count.dtype) <= 1
    b = torch.where(first, g, momentum * buf.to(work) + (1.0 - dampening) * g)
    d = g + momentum * b if nesterov else b
    return _SgdParts(g, p, lr_b, wd_b, first, b, d)


def stacked_adam_update(
    grad: Tensor,
    mu: Tensor,
    nu: Tensor,
    param: Tensor | None,
    count: Tensor,
    lr: Tensor,
    weight_decay: Tensor | None,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    decoupled: bool = False,
    maximize: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(update, new_mu, new_nu)`` of one Adam step over stacked members ``(N, ...)``.

    Twin of ``torchfn::stacked_adam_update``. Member ``n`` (``grad[n]``) uses ``lr[n]`` and
    ``weight_decay[n]`` (0-d tensors are shared by all members) and the step number
    ``count`` (0-d or ``(N,)`` int64, 1 on the first step) for the bias corrections:
    ``g = ±grad (+ wd * param if not decoupled)``, ``mu' = b1 mu + (1 - b1) g``,
    ``nu' = b2 nu + (1 - b2) g²``, ``update = -lr (mu'/bc1) / (sqrt(nu'/bc2 + eps_root) + eps)
    (- lr wd param if decoupled)``. Computed in float32 for float16/bfloat16 inputs (float64
    for float64); ``update`` has grad's dtype, the moments keep their dtypes.

    Example:
        >>> g = torch.ones(2, 3)
        >>> z = torch.zeros(2, 3)
        >>> u, mu, nu = stacked_adam_update(g, z, z, None, torch.tensor(1),
        ...                                 torch.tensor([0.1, 0.2]), None)
        >>> u[:, 0]  # the first Adam step has magnitude lr
        tensor([-0.1000, -0.2000])
    """
    x = _adam_parts((grad, mu, nu, param, count, lr, weight_decay),
                    (beta1, beta2, eps, eps_root, decoupled, maximize))
    u = -(x.lr * (x.m * x.inv_bc1)) / x.d
    if x.wd is not None and decoupled:
        u = u - x.lr * x.wd * x.p
    return u.to(grad.dtype), x.m.to(mu.dtype), x.v.to(nu.dtype)


def stacked_sgd_update(
    grad: Tensor,
    momentum_buffer: Tensor | None,
    param: Tensor | None,
    count: Tensor,
    lr: Tensor,
    weight_decay: Tensor | None,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Return ``(update, new_momentum_buffer)`` of one SGD step over stacked members ``(N, ...)``.

    Twin of ``torchfn::stacked_sgd_update``, with torch.optim.SGD's semantics per member:
    ``g = ±grad (+ wd * param)``; with a buffer, ``b = g`` on the first step (``count <= 1``)
    else ``momentum * b + (1 - dampening) * g``, and the direction is ``g + momentum * b``
    (Nesterov) or ``b``; ``update = -lr * direction``. ``new_momentum_buffer`` is None when
    ``momentum_buffer`` is None.

    Example:
        >>> u, _ = stacked_sgd_update(torch.ones(2, 3), None, None, torch.tensor(1),
        ...                           torch.tensor([0.1, 0.2]), None)
        >>> u[:, 0]
        tensor([-0.1000, -0.2000])
    """
    x = _sgd_parts((grad, momentum_buffer, param, count, lr, weight_decay),
                   (momentum, dampening, nesterov, maximize))
    u = (-(x.lr * x.d)).to(grad.dtype)
    return u, (None if momentum_buffer is None else x.b.to(momentum_buffer.dtype))  # type: ignore[union-attr]
