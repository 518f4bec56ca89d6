"""Op 1: ``softmax_cross_entropy`` on fused C++/CUDA kernels, composable with torch.func.

Three library ops (schemas in ``csrc/ops.cpp``; kernels in ``csrc/{cpu,cuda}/cross_entropy.*``)
work on ``(N, C)`` logits and ``(N,)`` int64 targets, one row per class distribution:

- ``torchfn::softmax_cross_entropy`` -> per-row ``loss`` ``(N,)`` and ``stats`` ``(N, 2)``
  (row max and log-sum-exp past it, saved for the backward so that the log-softmax there is as
  exact as torch's), both in the accumulation dtype (float32 for half/bfloat16 logits);
- ``torchfn::softmax_cross_entropy_backward`` -> ``grad_logits = g * (softmax - q)``, with
  ``q = (1 - eps) onehot(target) + eps / C``;
- ``torchfn::softmax_cross_entropy_double_backward`` -> the derivatives of that backward in
  ``g`` and in the logits, applied to a cotangent ``v``: ``<v, softmax - q>`` and
  ``g * (p * v - p * <p, v>)`` (the softmax Hessian times ``v``), in one pass.

Each op has an ``autograd.Function`` (``setup_context``, ``vmap`` and ``jvp`` rules) whose
``backward`` calls the next one, so first and second derivatives run on the kernels; the
third and higher ones are plain torch ops. The reduction (``none``/``sum``/``mean`` over rows
that are not ``ignore_index``) is done outside the Functions in torch ops, so it composes with
``vmap`` for free: a batched ``(B, N, C)`` is flattened to ``(B * N, C)`` for the kernel and
reduced per batch.

Out-of-range targets: the CPU kernels check every index on the host and raise (and so does the
public op before the twin, on CPU in eager mode). The CUDA kernels and the twin do not
synchronise to check; a row whose target is outside ``[0, C)`` (and is not ``ignore_index``)
gets a NaN loss and NaN gradients instead, so the error is visible in the loss without a
device-side assert (which would poison the CUDA context, as torch's does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchfn.ops import _build, reference
from torchfn.ops._dispatch import (
    Function,
    check_float_tensor,
    functorch_stack,
    get_rule,
    nested_forward_ad,
    plain_backward,
    set_rule,
    use_kernel,
    vmapped_numel,
)

__all__ = ["softmax_cross_entropy"]

_OP = "softmax_cross_entropy"
_REDUCTIONS = ("none", "sum", "mean")

# Dispatch rules, from benchmarks/ops.py (see benchmarks/README.md). The kernels themselves run
# near copy bandwidth and beat the twin, Inductor's twin and F.cross_entropy on large logits;
# what decides small sizes is host overhead: the autograd.Function path costs more host time per
# forward + backward than the twin's few eager ops, so the twin wins while both are host-bound.
# CPU: always the twin. torch's log_softmax/nll vectorise exp (SLEEF, AVX2/AVX-512), the C++
# kernel uses scalar std::exp; the CPU kernel stays the portable reference of the CUDA one (opt
# in with set_rule("softmax_cross_entropy", "cpu", min_numel=0, min_numel_grad=0)).
# CUDA, eager: the kernel from 2^25 logits elements, forward only or with backward (around
# 2^25 bf16 already gains from the kernel and fp32 roughly breaks even; above it both gain).
RULES: dict[str, dict[str, int | None]] = {
    "cpu": {"min_numel": None, "min_numel_grad": None},
    "cuda": {"min_numel": 1 << 25, "min_numel_grad": 1 << 25},
}
for _device, _fields in RULES.items():
    set_rule(_OP, _device, **_fields)
# Inside torch.func transforms an autograd.Function costs several times more host time (every
# level re-wraps it, e.g. three levels under MAML's vmap(grad(grad))), so the kernel path needs
# the whole vmapped batch to hold this many logits elements (MAML second-order loss: the twin
# wins up to 2^26, the kernel at 2^28).
TRANSFORM_MIN_NUMEL: dict[str, int] = {"cuda": 1 << 27}


# ---------------------------------------------------------------------------------------------
# Plain-torch formulas (jvp rules and the derivatives of the double backward). ``p`` is
# recomputed with torch.softmax so that these formulas stay correct when differentiated again.


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _probs(logits: Tensor) -> Tensor:
    return torch.softmax(logits.to(_opmath(logits.dtype)), dim=-1)


def _mask(target: Tensor, ignore_index: int) -> Tensor:
    """``(N, 1)`` bool: the rows that count (target != ignore_index)."""
    return (target != ignore_index).unsqueeze(-1)


def _smoothed_onehot(target: Tensor, n_classes: int, eps: float, dtype: torch.dtype) -> Tensor:
    """``(N, C)``: ``(1 - eps) * onehot(target) + eps / C`` (ignored rows: any value)."""
    classes = torch.arange(n_classes, device=target.device)
    hit = (classes == target.unsqueeze(-1)).to(dtype)
    return hit * (1.0 - eps) + eps / n_classes


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    return (a * b).sum(-1, keepdim=True)


def _where_rows(mask: Tensor, value: Tensor) -> Tensor:
    return torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))


def _batch_first(x: Tensor, bdim: int | None, batch_size: int) -> Tensor:
    """Move the vmap batch dim of ``x`` to 0 (expanding an unbatched ``x`` to the batch)."""
    if bdim is None:
        return x.unsqueeze(0).expand(batch_size, *x.shape)
    return x.movedim(bdim, 0)


def _flatten_rows(info: Any, in_dims: tuple, tensors: tuple[Tensor, ...]) -> list[Tensor]:
    """Batch-first each ``(N, ...)`` input and merge ``(B, N, ...)`` into ``(B * N, ...)``."""
    out = []
    for t, d in zip(tensors, in_dims, strict=False):
        b = _batch_first(t, d, info.batch_size)
        out.append(b.reshape(b.shape[0] * b.shape[1], *b.shape[2:]))
    return out


def _split_rows(t: Tensor, batch_size: int) -> Tensor:
    return t.reshape(batch_size, t.shape[0] // batch_size, *t.shape[1:])


# ---------------------------------------------------------------------------------------------
# autograd.Functions


class _XentGradGradFn(Function):
    """Fused double backward ``(v, g, x) -> (<v, p - q>, g * p * (v - <p, v>))`` per row.

    Its own derivatives (third order and up) are plain torch ops.
    """

    @staticmethod
    def forward(gg: Tensor, grad_loss: Tensor, logits: Tensor, target: Tensor, stats: Tensor,
                eps: float, ignore_index: int) -> tuple[Tensor, Tensor]:
        return torch.ops.torchfn.softmax_cross_entropy_double_backward(
            gg, grad_loss, logits, target, stats, eps, ignore_index)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        gg, grad_loss, logits, target, _lse, eps, ignore_index = inputs
        ctx.save_for_backward(gg, grad_loss, logits, target)
        ctx.save_for_forward(gg, grad_loss, logits, target)
        ctx.eps, ctx.ignore_index = eps, ignore_index

    @staticmethod
    def backward(ctx, a: Tensor, b: Tensor):  # type: ignore[no-untyped-def, override]
        gg, g, x, target = ctx.saved_tensors
        p = _probs(x)
        mask = _mask(target, ctx.ignore_index)
        q = _smoothed_onehot(target, x.shape[-1], ctx.eps, p.dtype)
        a = a.to(p.dtype).unsqueeze(-1)
        b = b.to(p.dtype)
        gg_o = gg.to(p.dtype)
        g_col = g.unsqueeze(-1)
        s = _rowdot(p, gg_o)
        bp = _rowdot(b, p)
        d_gg = d_g = d_x = None
        if ctx.needs_input_grad[0]:
            d_gg = _where_rows(mask, a * (p - q) + g_col * p * (b - bp)).to(gg.dtype)
        if ctx.needs_input_grad[1]:
            d_g = _where_rows(mask, _rowdot(b * p, gg_o) - s * bp).squeeze(-1)
        if ctx.needs_input_grad[2]:
            r = _where_rows(mask, a * gg_o + g_col * (b * gg_o - bp * gg_o - s * b))
            d_x = (p * (r - _rowdot(p, r))).to(x.dtype)
        return d_gg, d_g, d_x, None, None, None, None

    @staticmethod
    def jvp(ctx, gg_t, g_t, x_t, _t_t, _stats_t, _eps_t, _ii_t):  # type: ignore[no-untyped-def, override]
        gg, g, x, target = ctx.saved_tensors
        p = _probs(x)
        mask = _mask(target, ctx.ignore_index)
        q = _smoothed_onehot(target, x.shape[-1], ctx.eps, p.dtype)
        gg_o = gg.to(p.dtype)
        s = _rowdot(p, gg_o)
        da = torch.zeros_like(s)
        db = torch.zeros_like(p)
        if gg_t is not None:
            gg_t = gg_t.to(p.dtype)
            da = da + _rowdot(gg_t, p - q)
            db = db + g.unsqueeze(-1) * p * (gg_t - _rowdot(p, gg_t))
        if g_t is not None:
            db = db + g_t.unsqueeze(-1) * p * (gg_o - s)
        if x_t is not None:
            x_t = x_t.to(p.dtype)
            dp = p * (x_t - _rowdot(p, x_t))
            ds = _rowdot(dp, gg_o)
            da = da + ds
            db = db + g.unsqueeze(-1) * (dp * (gg_o - s) - p * ds)
        return (_where_rows(mask, da).squeeze(-1), _where_rows(mask, db).to(x.dtype))

    @staticmethod
    def vmap(info, in_dims, gg, grad_loss, logits, target, stats, eps, ignore_index):  # type: ignore[no-untyped-def]
        if all(d is None for d in in_dims[:5]):
            return _XentGradGradFn.apply(gg, grad_loss, logits, target, stats, eps,
                                         ignore_index), (None, None)
        flat = _flatten_rows(info, in_dims[:5], (gg, grad_loss, logits, target, stats))
        d_g, d_x = _XentGradGradFn.apply(*flat, eps, ignore_index)
        return (_split_rows(d_g, info.batch_size), _split_rows(d_x, info.batch_size)), (0, 0)


class _XentGradFn(Function):
    """``grad_logits = g * (softmax(x) - q)`` per row on the kernel (zero for ignored rows);
    backward through :class:`_XentGradGradFn`."""

    @staticmethod
    def forward(grad_loss: Tensor, logits: Tensor, target: Tensor, stats: Tensor, eps: float,
                ignore_index: int) -> Tensor:
        return torch.ops.torchfn.softmax_cross_entropy_backward(
            grad_loss, logits, target, stats, eps, ignore_index)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        grad_loss, logits, target, stats, eps, ignore_index = inputs
        ctx.save_for_backward(grad_loss, logits, target, stats)
        ctx.save_for_forward(grad_loss, logits, target)
        ctx.eps, ctx.ignore_index = eps, ignore_index

    @staticmethod
    def backward(ctx, gg: Tensor):  # type: ignore[no-untyped-def, override]
        grad_loss, logits, target, stats = ctx.saved_tensors
        d_g = d_x = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            d_g, d_x = _XentGradGradFn.apply(gg.to(logits.dtype), grad_loss, logits, target,
                                             stats, ctx.eps, ctx.ignore_index)
        # stats caches the row max / log-sum-exp of the logits: their dependence on the logits is
        # already part of d_x, so stats gets no gradient of its own.
        return d_g, d_x, None, None, None, None

    @staticmethod
    def jvp(ctx, g_t, x_t, _t_t, _stats_t, _eps_t, _ii_t):  # type: ignore[no-untyped-def, override]
        g, x, target = ctx.saved_tensors
        p = _probs(x)
        mask = _mask(target, ctx.ignore_index)
        out = torch.zeros_like(p)
        if g_t is not None:
            q = _smoothed_onehot(target, x.shape[-1], ctx.eps, p.dtype)
            out = out + g_t.unsqueeze(-1) * (p - q)
        if x_t is not None:
            x_t = x_t.to(p.dtype)
            out = out + g.unsqueeze(-1) * p * (x_t - _rowdot(p, x_t))
        return _where_rows(mask, out).to(x.dtype)

    @staticmethod
    def vmap(info, in_dims, grad_loss, logits, target, stats, eps, ignore_index):  # type: ignore[no-untyped-def]
        if all(d is None for d in in_dims[:4]):
            return _XentGradFn.apply(grad_loss, logits, target, stats, eps, ignore_index), None
        flat = _flatten_rows(info, in_dims[:4], (grad_loss, logits, target, stats))
        return _split_rows(_XentGradFn.apply(*flat, eps, ignore_index), info.batch_size), 0


class _XentFn(Function):
    """Per-row ``(loss (N,), stats (N, 2))`` of ``(N, C)`` logits on the kernel; ``stats`` is a
    cache for the backward (non-differentiable). Backward through :class:`_XentGradFn`."""

    @staticmethod
    def forward(logits: Tensor, target: Tensor, eps: float,
                ignore_index: int) -> tuple[Tensor, Tensor]:
        return torch.ops.torchfn.softmax_cross_entropy(logits, target, eps, ignore_index)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        logits, target, eps, ignore_index = inputs
        _, stats = output
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)  # else every backward fills zeros for stats' grad
        ctx.save_for_backward(logits, target, stats)
        ctx.save_for_forward(logits, target)
        ctx.eps, ctx.ignore_index = eps, ignore_index

    @staticmethod
    def backward(ctx, grad_loss: Tensor | None, _grad_lse: Tensor | None):  # type: ignore[no-untyped-def, override]
        if grad_loss is None:  # grads are not materialised (setup_context): the loss got none
            return None, None, None, None
        logits, target, stats = ctx.saved_tensors
        args = (grad_loss.to(stats.dtype), logits, target, stats, ctx.eps, ctx.ignore_index)
        if plain_backward():  # nothing differentiates this backward: the kernel alone
            return torch.ops.torchfn.softmax_cross_entropy_backward(*args), None, None, None
        return _XentGradFn.apply(*args), None, None, None

    @staticmethod
    def jvp(ctx, x_t, _t_t, _eps_t, _ii_t):  # type: ignore[no-untyped-def, override]
        x, target = ctx.saved_tensors
        p = _probs(x)
        x_t = x_t.to(p.dtype)
        q = _smoothed_onehot(target, x.shape[-1], ctx.eps, p.dtype)
        loss_t = _where_rows(_mask(target, ctx.ignore_index), _rowdot(p - q, x_t))
        return loss_t.squeeze(-1), None  # stats is non-differentiable

    @staticmethod
    def vmap(info, in_dims, logits, target, eps, ignore_index):  # type: ignore[no-untyped-def]
        if in_dims[0] is None and in_dims[1] is None:
            return _XentFn.apply(logits, target, eps, ignore_index), (None, None)
        flat = _flatten_rows(info, in_dims[:2], (logits, target))
        loss, stats = _XentFn.apply(*flat, eps, ignore_index)
        return (_split_rows(loss, info.batch_size), _split_rows(stats, info.batch_size)), (0, 0)


# ---------------------------------------------------------------------------------------------
# Fake kernels


def _register_fakes() -> None:
    """Register the fake (meta) kernels once the C++ library (and so the schemas) is loaded."""

    def _rows(logits: Tensor, *width: int) -> Tensor:
        return logits.new_empty((logits.shape[0], *width), dtype=_opmath(logits.dtype))

    def _check(name: str, logits: Tensor, target: Tensor) -> None:
        torch._check(logits.dim() == 2, lambda: f"torchfn::{name}: argument 'logits' must be "
                     f"2-D (N, C), got shape {tuple(logits.shape)}")
        torch._check(target.dtype == torch.int64, lambda: f"torchfn::{name}: argument 'target' "
                     f"must hold int64 class indices, got dtype {target.dtype}")
        torch._check(target.dim() == 1 and target.shape[0] == logits.shape[0],
                     lambda: f"torchfn::{name}: argument 'target' must have shape (N,) = "
                     f"[{logits.shape[0]}], got {tuple(target.shape)}")

    def fake_forward(logits, target, label_smoothing, ignore_index):  # type: ignore[no-untyped-def]
        _check("softmax_cross_entropy", logits, target)
        return _rows(logits), _rows(logits, 2)

    def fake_backward(grad_loss, logits, target, stats, label_smoothing, ignore_index):  # type: ignore[no-untyped-def]
        _check("softmax_cross_entropy_backward", logits, target)
        return logits.new_empty(logits.shape)

    def fake_double_backward(gg, grad_loss, logits, target, stats, label_smoothing,  # type: ignore[no-untyped-def]
                             ignore_index):
        _check("softmax_cross_entropy_double_backward", logits, target)
        torch._check(gg.shape == logits.shape, lambda: "torchfn::softmax_cross_entropy_double_"
                     f"backward: argument 'grad_grad_logits' must have the shape of 'logits' "
                     f"{tuple(logits.shape)}, got {tuple(gg.shape)}")
        return _rows(logits), logits.new_empty(logits.shape)

    torch.library.register_fake("torchfn::softmax_cross_entropy", fake_forward)
    torch.library.register_fake("torchfn::softmax_cross_entropy_backward", fake_backward)
    torch.library.register_fake("torchfn::softmax_cross_entropy_double_backward",
                                fake_double_backward)


_build.on_load(_register_fakes)


# ---------------------------------------------------------------------------------------------
# Public function


def _check_args(logits: object, target: object, label_smoothing: object, ignore_index: object,
                reduction: object) -> float:
    """Validate the public arguments; return ``label_smoothing`` as a float."""
    check_float_tensor(_OP, "logits", logits)
    assert isinstance(logits, Tensor)
    call = f"torchfn.ops.{_OP}"
    if not isinstance(target, Tensor):
        raise TypeError(f"{call}(target=...): expected target to be a torch.Tensor of int64 class "
                        f"indices, got {type(target).__name__}")
    if target.dtype != torch.int64:
        hint = (" (class probabilities are not supported: pass class indices, or use "
                "torch.nn.functional.cross_entropy)" if target.is_floating_point() else
                "; convert it with target.long()")
        raise TypeError(f"{call}(target=...): expected int64 class indices, got "
                        f"target.dtype={target.dtype}{hint}")
    if logits.dim() == 0:
        raise ValueError(f"{call}(logits=...): expected logits of shape (C,), (N, C) or "
                         "(N, C, d1, ...), got a 0-D tensor")
    want = tuple(logits.shape[:1]) + tuple(logits.shape[2:]) if logits.dim() > 1 else ()
    if tuple(target.shape) != want:
        raise ValueError(f"{call}(target=...): expected target of shape {want} for logits of "
                         f"shape {tuple(logits.shape)} (the class dim is dim "
                         f"{1 if logits.dim() > 1 else 0}), got {tuple(target.shape)}")
    if logits.shape[1 if logits.dim() > 1 else 0] == 0 and target.numel() > 0:
        raise ValueError(f"{call}(logits=...): expected at least one class, got logits of shape "
                         f"{tuple(logits.shape)}")
    if target.device != logits.device:
        raise ValueError(f"{call}(target=...): expected target on the device of logits "
                         f"({logits.device}), got {target.device}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"{call}(label_smoothing=...): expected a Python float in [0, 1], got "
                        f"{type(label_smoothing).__name__}")
    eps = float(label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"{call}(label_smoothing=...): expected a value in [0, 1], got {eps}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{call}(ignore_index=...): expected a Python int, got "
                        f"{type(ignore_index).__name__}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{call}(reduction=...): expected one of {_REDUCTIONS}, got "
                         f"{reduction!r}")
    return eps


def _check_target_range(target: Tensor, n_classes: int, ignore_index: int) -> None:
    """Raise unless every target is in ``[0, C)`` or ``ignore_index`` (CPU, eager: no sync
    cost; the CPU kernels check the same in C++)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bool(bad.any()):
        first = bad.reshape(-1).nonzero()[0, 0]
        raise ValueError(
            f"torchfn.ops.{_OP}(target=...): holds class index "
            f"{int(target.reshape(-1)[first])} at position {int(first)}, outside [0, C) = "
            f"[0, {n_classes}) and not ignore_index ({ignore_index})"
        )


def _as_rows(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``(M, C)`` logits and ``(M,)`` targets (class dim moved last, rows flattened)."""
    if logits.dim() == 1:
        return logits.unsqueeze(0), target.reshape(1)
    if logits.dim() == 2:
        return logits, target
    return logits.movedim(1, -1).reshape(-1, logits.shape[1]), target.reshape(-1)


def _reduce(rows: Tensor, target: Tensor, ignore_index: int, reduction: str,
            dtype: torch.dtype) -> Tensor:
    """Reduce per-row losses (accumulation dtype) like ``F.cross_entropy``; cast to ``dtype``."""
    if reduction == "none":
        return rows.reshape(target.shape).to(dtype)
    total = rows.sum()
    if reduction == "sum":
        return total.to(dtype)
    count = (target != ignore_index).sum()  # int64; the division promotes to rows.dtype
    return (total / count).to(dtype)  # all rows ignored: 0 / 0 = nan, like torch


def _use_kernel(logits: Tensor) -> bool:
    """Return True when this call should run the kernels (else the twin).

    Outside ``torch.func`` transforms (and while compiling) this is the shared rule,
    :func:`torchfn.ops._dispatch.use_kernel`. Inside transforms the size that matters is the
    whole vmapped batch (the kernel runs once on all of it), and the Function's host overhead is
    several times larger, so the batched element count is compared with
    ``TRANSFORM_MIN_NUMEL[device]`` (default: the eager ``min_numel_grad``); two or more
    forward-mode levels always use the twin (:func:`torchfn.ops._dispatch.nested_forward_ad`).
    """
    if torch.compiler.is_compiling():
        return use_kernel(_OP, logits)
    stack = functorch_stack()
    if not stack:
        return use_kernel(_OP, logits)
    device = logits.device.type
    if nested_forward_ad(stack) or _build.mode() == "reference":
        return False
    threshold = TRANSFORM_MIN_NUMEL.get(device, get_rule(_OP, device).min_numel_grad)
    if threshold is None:
        return False
    return vmapped_numel(logits, stack) >= threshold and _build.has_kernels(device)


def softmax_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Return the cross-entropy of ``softmax(logits)`` and class indices ``target``.

    The same numbers as ``torch.nn.functional.cross_entropy(logits, target,
    ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)`` for
    class-index targets: ``reduction="none"`` gives a tensor of ``target``'s shape (``(N,)`` for
    ``(N, C)`` logits), ``"sum"``/``"mean"`` a scalar, all in the dtype of ``logits``. Rows whose
    target is ``ignore_index`` contribute 0 and are left out of the mean's denominator (a mean
    over no rows is NaN, like torch). Half/bfloat16 logits are accumulated in float32.

    Runs torchfn's fused kernels (forward, backward and double backward) where safe and fast,
    else the reference twin :func:`torchfn.ops.reference.softmax_cross_entropy`; differentiable
    to any order in the logits, and composes with ``torch.func`` transforms and
    ``torch.compile``. Under ``vmap``, a batched ``(B, N, C)`` gives per-batch reductions.

    Args:
        logits: ``(N, C)``, ``(C,)`` or ``(N, C, d1, ...)`` float32/float64/float16/bfloat16.
        target: int64 class indices in ``[0, C)`` or ``ignore_index``, of shape ``(N,)``,
            ``()`` or ``(N, d1, ...)``, on the device of ``logits``. On CPU an index out of
            range raises (eagerly); on CUDA, and under ``torch.func`` transforms or
            ``torch.compile``, where checking would need a host sync, its row's loss and
            gradient become NaN instead (never a device-side assert).
        label_smoothing: ``eps`` in ``[0, 1]``: the target distribution is
            ``(1 - eps) * onehot(target) + eps / C``.
        ignore_index: a target value whose rows are ignored.
        reduction: ``"none"``, ``"sum"`` or ``"mean"``.

    Example:
        >>> import torch, torchfn
        >>> logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        >>> torchfn.ops.softmax_cross_entropy(logits, torch.tensor([0, -100]))
        tensor(0.2395)
    """
    eps = _check_args(logits, target, label_smoothing, ignore_index, reduction)
    if not _use_kernel(logits):
        if (target.device.type == "cpu" and not torch.compiler.is_compiling()
                and not functorch_stack()):
            _check_target_range(target, logits.shape[1 if logits.dim() > 1 else 0], ignore_index)
        return reference.softmax_cross_entropy(logits, target, label_smoothing=eps,
                                               ignore_index=ignore_index, reduction=reduction)
    x2, t1 = _as_rows(logits, target)
    rows, _ = _XentFn.apply(x2, t1, eps, ignore_index)
    return _reduce(rows, target, ignore_index, reduction, logits.dtype)
