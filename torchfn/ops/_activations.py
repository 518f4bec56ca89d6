"""Op 2: ``sigmoid`` and ``leaky_relu`` on C++/CUDA kernels, composable with torch.func.

Per op: the library ops ``torchfn::<op>`` and ``torchfn::<op>_backward`` (schemas in
``csrc/ops.cpp``), their fake kernels, an ``autograd.Function`` for each (``setup_context``,
``vmap`` and ``jvp`` rules, a ``backward`` that calls the next Function so that every order of
derivative works) and the public function, which validates its inputs and dispatches to the
kernel or to the reference twin (:mod:`torchfn.ops._dispatch`).

Inputs may be non-contiguous: the kernels copy them to contiguous memory first, and the
kernel path returns contiguous outputs (the twin keeps the input's layout).
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchfn.ops import _build, reference
from torchfn.ops._dispatch import check_float_scalar, check_float_tensor, set_rule, use_kernel

__all__ = ["leaky_relu", "sigmoid"]


def _batch_first(x: Tensor, bdim: int | None, batch_size: int) -> Tensor:
    """Move the vmap batch dim of ``x`` to 0 (expanding an unbatched ``x`` to the batch)."""
    if bdim is None:
        return x.unsqueeze(0).expand(batch_size, *x.shape)
    return x.movedim(bdim, 0)


def _slope_where(x: Tensor, negative_slope: float) -> Tensor:
    """Return the local derivative of leaky_relu at ``x``: 1 where ``x > 0`` else the slope."""
    one = torch.ones((), dtype=x.dtype, device=x.device)
    return torch.where(x > 0, one, one * negative_slope)


class _SigmoidGradFn(torch.autograd.Function):
    """``grad_out * y * (1 - y)`` on the kernel; its own derivatives in plain torch ops."""

    @staticmethod
    def forward(grad_out: Tensor, y: Tensor) -> Tensor:
        return torch.ops.torchfn.sigmoid_backward(grad_out, y)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        grad_out, y = inputs
        ctx.save_for_backward(grad_out, y)
        ctx.save_for_forward(grad_out, y)

    @staticmethod
    def backward(ctx, gg: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        grad_out, y = ctx.saved_tensors
        d_grad_out = gg * y * (1 - y) if ctx.needs_input_grad[0] else None
        d_y = gg * grad_out * (1 - 2 * y) if ctx.needs_input_grad[1] else None
        return d_grad_out, d_y

    @staticmethod
    def jvp(ctx, grad_out_t: Tensor | None, y_t: Tensor | None) -> Tensor:  # type: ignore[override]
        grad_out, y = ctx.saved_tensors
        out = torch.zeros_like(y)
        if grad_out_t is not None:
            out = out + grad_out_t * y * (1 - y)
        if y_t is not None:
            out = out + grad_out * y_t * (1 - 2 * y)
        return out

    @staticmethod
    def vmap(info, in_dims, grad_out: Tensor, y: Tensor):  # type: ignore[no-untyped-def]
        if in_dims[0] is None and in_dims[1] is None:
            return _SigmoidGradFn.apply(grad_out, y), None
        g = _batch_first(grad_out, in_dims[0], info.batch_size)
        return _SigmoidGradFn.apply(g, _batch_first(y, in_dims[1], info.batch_size)), 0


class _SigmoidFn(torch.autograd.Function):
    """``sigmoid(x)`` on the kernel; backward through :class:`_SigmoidGradFn`."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.ops.torchfn.sigmoid(x)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return _SigmoidGradFn.apply(grad_out, y)

    @staticmethod
    def jvp(ctx, x_t: Tensor) -> Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return x_t * y * (1 - y)

    @staticmethod
    def vmap(info, in_dims, x: Tensor):  # type: ignore[no-untyped-def]
        return _SigmoidFn.apply(x), in_dims[0]


class _LeakyReluGradFn(torch.autograd.Function):
    """``grad_out * (x > 0 ? 1 : slope)`` on the kernel; derivatives in plain torch ops."""

    @staticmethod
    def forward(grad_out: Tensor, x: Tensor, negative_slope: float) -> Tensor:
        return torch.ops.torchfn.leaky_relu_backward(grad_out, x, negative_slope)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        _, x, negative_slope = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        ctx.negative_slope = negative_slope

    @staticmethod
    def backward(ctx, gg: Tensor):  # type: ignore[no-untyped-def, override]
        (x,) = ctx.saved_tensors
        d_grad_out = gg * _slope_where(x, ctx.negative_slope) if ctx.needs_input_grad[0] else None
        # The derivative in x is zero almost everywhere (piecewise-linear function).
        d_x = torch.zeros_like(x) if ctx.needs_input_grad[1] else None
        return d_grad_out, d_x, None

    @staticmethod
    def jvp(ctx, grad_out_t: Tensor | None, x_t: Tensor | None, _slope_t: None) -> Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        if grad_out_t is None:
            return torch.zeros_like(x)
        return grad_out_t * _slope_where(x, ctx.negative_slope)

    @staticmethod
    def vmap(info, in_dims, grad_out: Tensor, x: Tensor, negative_slope: float):  # type: ignore[no-untyped-def]
        if in_dims[0] is None and in_dims[1] is None:
            return _LeakyReluGradFn.apply(grad_out, x, negative_slope), None
        g = _batch_first(grad_out, in_dims[0], info.batch_size)
        xb = _batch_first(x, in_dims[1], info.batch_size)
        return _LeakyReluGradFn.apply(g, xb, negative_slope), 0


class _LeakyReluFn(torch.autograd.Function):
    """``leaky_relu(x, slope)`` on the kernel; backward through :class:`_LeakyReluGradFn`."""

    @staticmethod
    def forward(x: Tensor, negative_slope: float) -> Tensor:
        return torch.ops.torchfn.leaky_relu(x, negative_slope)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        x, negative_slope = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        ctx.negative_slope = negative_slope

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[no-untyped-def, override]
        (x,) = ctx.saved_tensors
        return _LeakyReluGradFn.apply(grad_out, x, ctx.negative_slope), None

    @staticmethod
    def jvp(ctx, x_t: Tensor, _slope_t: None) -> Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return x_t * _slope_where(x, ctx.negative_slope)

    @staticmethod
    def vmap(info, in_dims, x: Tensor, negative_slope: float):  # type: ignore[no-untyped-def]
        return _LeakyReluFn.apply(x, negative_slope), in_dims[0]


def _register_fakes() -> None:
    """Register the fake (meta) kernels once the C++ library (and so the schemas) is loaded."""

    def _fake_unary(x: Tensor, *_: object) -> Tensor:
        return x.new_empty(x.shape)  # kernels return contiguous outputs

    def _fake_binary(name: str):  # type: ignore[no-untyped-def]
        def fake(grad_out: Tensor, other: Tensor, *_: object) -> Tensor:
            torch._check(
                grad_out.shape == other.shape,
                lambda: f"torchfn::{name}: argument 'grad_out' must have the shape of its "
                f"second argument {tuple(other.shape)}, got {tuple(grad_out.shape)}",
            )
            torch._check(
                grad_out.dtype == other.dtype,
                lambda: f"torchfn::{name}: argument 'grad_out' must have the dtype "
                f"{other.dtype}, got {grad_out.dtype}",
            )
            return other.new_empty(other.shape)

        return fake

    torch.library.register_fake("torchfn::sigmoid", _fake_unary)
    torch.library.register_fake("torchfn::leaky_relu", _fake_unary)
    torch.library.register_fake("torchfn::sigmoid_backward", _fake_binary("sigmoid_backward"))
    torch.library.register_fake("torchfn::leaky_relu_backward", _fake_binary("leaky_relu_backward"))


_build.on_load(_register_fakes)

# Eager dispatch defaults, from benchmarks/ops.py (see benchmarks/README.md).
# sigmoid: torch's own sigmoid is at least as fast as the kernel on CUDA (forward, and
# forward+backward once the Function's overhead is counted) and, on CPU, clearly faster
# (vectorised SLEEF exp vs our scalar loop): the twin everywhere.
# leaky_relu: the kernel is faster than the twin (torch.where) for a forward at every size;
# with autograd recording, the Function's Python overhead is recovered from 2^24 elements on
# CUDA and 2^18 on CPU (the CPU threshold is from noisy measurements).
set_rule("sigmoid", "cpu", min_numel=None, min_numel_grad=None)
set_rule("sigmoid", "cuda", min_numel=None, min_numel_grad=None)
set_rule("leaky_relu", "cpu", min_numel=0, min_numel_grad=1 << 18)
set_rule("leaky_relu", "cuda", min_numel=0, min_numel_grad=1 << 24)


def sigmoid(x: Tensor) -> Tensor:
    """Return ``1 / (1 + exp(-x))``, a tensor of the shape and dtype of ``x``.

    Runs torchfn's C++/CUDA kernel where it is safe and fast, else the reference twin
    (:func:`torchfn.ops.reference.sigmoid`); differentiable to any order, and composes with
    ``torch.func.grad``/``vmap``/``jvp`` and ``torch.compile``.

    Args:
        x: float32, float64, float16 or bfloat16 tensor of any shape, on any device.

    Example:
        >>> import torch, torchfn
        >>> torchfn.ops.sigmoid(torch.zeros(3))
        tensor([0.5000, 0.5000, 0.5000])
    """
    check_float_tensor("sigmoid", "x", x)
    if use_kernel("sigmoid", x):
        return _SigmoidFn.apply(x)
    return reference.sigmoid(x)


def leaky_relu(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    """Return ``x`` where ``x > 0`` else ``negative_slope * x``; shape and dtype of ``x``.

    The derivative at ``x == 0`` is ``negative_slope`` (as in ``torch.nn.functional``). Runs
    the C++/CUDA kernel where safe and fast, else :func:`torchfn.ops.reference.leaky_relu`.

    Args:
        x: float32, float64, float16 or bfloat16 tensor of any shape, on any device.
        negative_slope: a Python float (a tensor slope is refused).

    Example:
        >>> import torch, torchfn
        >>> torchfn.ops.leaky_relu(torch.tensor([-1.0, 2.0]), 0.1)
        tensor([-0.1000,  2.0000])
    """
    check_float_tensor("leaky_relu", "x", x)
    slope = check_float_scalar("leaky_relu", "negative_slope", negative_slope)
    if use_kernel("leaky_relu", x):
        return _LeakyReluFn.apply(x, slope)
    return reference.leaky_relu(x, slope)
