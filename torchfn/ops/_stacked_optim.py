"""Op 4: fused, differentiable Adam and SGD updates over stacked parameters ``(N, ...)``.

Ensembles keep N members' parameters stacked along dim 0 of every leaf; per-member
hyperparameters (learning rate, weight decay) are ``(N,)`` tensors. Library ops (schemas in
``csrc/ops.cpp``, math in ``csrc/stacked_optim.h``) update one leaf in a single pass (one read
of each input, one write of each output): ``torchfn::stacked_adam_update`` and
``torchfn::stacked_sgd_update``, and a list of leaves in one launch: ``..._multi`` (what the
optimizers of :mod:`torchfn.ops._stacked_optimizers` call, once per step). Around each: a fake
kernel and an ``autograd.Function`` (``setup_context``, ``vmap`` and ``jvp`` rules, a
``backward`` in plain differentiable torch ops from :mod:`torchfn.ops._stacked_optim_grad`, so
meta-learning can backpropagate through an inner step to any order w.r.t. the gradients,
parameters, moments, lr and weight decay), then the public per-leaf functions.

Dtypes: the update is computed in float32 for float16/bfloat16 parameters (float64 for
float64) and rounded once; moments may be float32 for float16/bfloat16 parameters.

Dispatch (:mod:`torchfn.ops._dispatch`): eager calls run the kernel (through the raw library op
when nothing needs a derivative, which skips the Function's Python overhead); while
``torch.compile`` traces they run the reference twin, which Inductor fuses (see
``benchmarks/README.md``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchfn._checks import _check_like, _fmt, _member_tensor, check_float_tensor
from torchfn.ops import _build, reference
from torchfn.ops._dispatch import use_kernel
from torchfn.ops._stacked_optim_grad import (
    _adam_jvp,
    _adam_vjp,
    _fold,
    _sgd_jvp,
    _sgd_vjp,
    _unfold,
)

__all__ = ["stacked_adam_update", "stacked_sgd_update"]



# ---------------------------------------------------------------------------------------------
# autograd.Functions around the kernels

_ADAM_KINDS = "LLLL" + "MMM" + "------"  # grad mu nu param | count lr wd | hyperparameters
_SGD_KINDS = "LLL" + "MMM" + "----"


class _StackedAdamFn(torch.autograd.Function):
    """``torchfn::stacked_adam_update`` with derivatives in plain torch ops."""

    @staticmethod
    def forward(*args):  # type: ignore[no-untyped-def, override]
        # (grad, mu, nu, param, count, lr, weight_decay, beta1, beta2, eps, eps_root,
        #  decoupled, maximize); ``*args`` because Function.apply binds the signature of
        # forward with inspect on every call, which is slow for 13 named parameters.
        return tuple(torch.ops.torchfn.stacked_adam_update(*args))

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(*inputs[:7])
        ctx.save_for_forward(*inputs[:7])
        ctx.hyper = tuple(inputs[7:])

    @staticmethod
    def backward(ctx, gu, gm, gv):  # type: ignore[no-untyped-def, override]
        grads = _adam_vjp(ctx.saved_tensors, ctx.hyper, ctx.needs_input_grad, gu, gm, gv)
        return (*grads, None, None, None, None, None, None)

    @staticmethod
    def jvp(ctx, *tangents):  # type: ignore[no-untyped-def, override]
        return _adam_jvp(ctx.saved_tensors, ctx.hyper, tangents[:7])

    @staticmethod
    def vmap(info, in_dims, *args):  # type: ignore[no-untyped-def]
        folded, n = _fold(info.batch_size, in_dims, args, _ADAM_KINDS)
        out = _StackedAdamFn.apply(*folded)
        return tuple(_unfold(o, info.batch_size, n) for o in out), (0, 0, 0)


class _StackedSgdFn(torch.autograd.Function):
    """``torchfn::stacked_sgd_update`` with derivatives in plain torch ops.

    Without a momentum buffer the second output is an empty ``(0,)`` tensor (not
    differentiable).
    """

    @staticmethod
    def forward(*args):  # type: ignore[no-untyped-def, override]
        # (grad, momentum_buffer, param, count, lr, weight_decay, momentum, dampening,
        #  nesterov, maximize); ``*args``: see _StackedAdamFn.forward.
        return tuple(torch.ops.torchfn.stacked_sgd_update(*args))

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(*inputs[:6])
        ctx.save_for_forward(*inputs[:6])
        ctx.hyper = tuple(inputs[6:])
        if inputs[1] is None:
            ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, gu, gb):  # type: ignore[no-untyped-def, override]
        grads = _sgd_vjp(ctx.saved_tensors, ctx.hyper, ctx.needs_input_grad, gu, gb)
        return (*grads, None, None, None, None)

    @staticmethod
    def jvp(ctx, *tangents):  # type: ignore[no-untyped-def, override]
        return _sgd_jvp(ctx.saved_tensors, ctx.hyper, tangents[:6])

    @staticmethod
    def vmap(info, in_dims, *args):  # type: ignore[no-untyped-def]
        folded, n = _fold(info.batch_size, in_dims, args, _SGD_KINDS)
        update, buf = _StackedSgdFn.apply(*folded)
        if args[1] is None:
            return (_unfold(update, info.batch_size, n), buf), (0, None)
        return (_unfold(update, info.batch_size, n), _unfold(buf, info.batch_size, n)), (0, 0)


def _register_fakes() -> None:
    """Register the fake (meta) kernels once the C++ library (and so the schemas) is loaded."""

    def fake_adam(grad, mu, nu, param, count, lr, weight_decay, *_):  # type: ignore[no-untyped-def]
        return grad.new_empty(grad.shape), mu.new_empty(mu.shape), nu.new_empty(nu.shape)

    def fake_sgd(grad, momentum_buffer, *_):  # type: ignore[no-untyped-def]
        buf = (grad.new_empty((0,)) if momentum_buffer is None
               else momentum_buffer.new_empty(momentum_buffer.shape))
        return grad.new_empty(grad.shape), buf

    def fake_adam_multi(grad, mu, nu, *_):  # type: ignore[no-untyped-def]
        return ([g.new_empty(g.shape) for g in grad], [m.new_empty(m.shape) for m in mu],
                [v.new_empty(v.shape) for v in nu])

    def fake_sgd_multi(grad, momentum_buffer, *_):  # type: ignore[no-untyped-def]
        return ([g.new_empty(g.shape) for g in grad],
                [b.new_empty(b.shape) for b in momentum_buffer])

    torch.library.register_fake("torchfn::stacked_adam_update", fake_adam)
    torch.library.register_fake("torchfn::stacked_sgd_update", fake_sgd)
    torch.library.register_fake("torchfn::stacked_adam_update_multi", fake_adam_multi)
    torch.library.register_fake("torchfn::stacked_sgd_update_multi", fake_sgd_multi)


_build.on_load(_register_fakes)


# ---------------------------------------------------------------------------------------------
# Public per-leaf functions: validate, convert, dispatch


def _check_leaf(op: str, grad: object) -> Tensor:
    check_float_tensor(op, "grad", grad)
    assert isinstance(grad, Tensor)
    if grad.ndim == 0:
        raise ValueError(
            f"torchfn.ops.{op}(grad=...): expected a stacked leaf of shape (N, ...) with the "
            "members along dim 0, got a 0-d tensor"
        )
    return grad


def _count_tensor(op: str, count: object, grad: Tensor) -> Tensor:
    n = grad.shape[0]
    if isinstance(count, int) and not isinstance(count, bool):
        return torch.full((), count, dtype=torch.int64, device=grad.device)
    if not isinstance(count, Tensor) or count.is_floating_point() or count.is_complex() or \
            count.dtype == torch.bool:
        raise TypeError(
            f"torchfn.ops.{op}(count=...): expected an int or an integer tensor (the step "
            f"number, 1 on the first step), got "
            f"{count.dtype if isinstance(count, Tensor) else type(count).__name__}"
        )
    if not (count.ndim == 0 or (count.ndim == 1 and count.shape[0] == n)):
        raise ValueError(
            f"torchfn.ops.{op}(count=...): expected a 0-d tensor or one of shape (N,) = ({n},), "
            f"got shape {_fmt(count.shape)}"
        )
    if count.device != grad.device:
        raise ValueError(
            f"torchfn.ops.{op}(count=...): expected count on grad's device {grad.device}, got "
            f"{count.device}"
        )
    return count.to(torch.int64)


def _weight_decay(op: str, weight_decay: object, param: object, grad: Tensor) -> tuple[
        Tensor | None, Tensor | None]:
    """Return (weight_decay tensor or None, param or None); a float 0.0 means no decay."""
    if weight_decay is None or (isinstance(weight_decay, (int, float))
                                and not isinstance(weight_decay, bool) and weight_decay == 0.0):
        return None, None
    wd = _member_tensor(op, "weight_decay", weight_decay, grad)
    if param is None:
        raise ValueError(
            f"torchfn.ops.{op}(weight_decay=...): weight decay needs the parameters; pass "
            "param=<the stacked parameter leaf>"
        )
    return wd, _check_like(op, "param", param, grad, state=False)


def _needs_autograd(args: tuple[Any, ...]) -> bool:
    """Return True unless the raw op gives the same result as the autograd.Function.

    The Function is needed under torch.func transforms (vmap, grad, jvp: its rules), inside
    a forward-AD ``dual_level`` and when an input requires grad; otherwise calling the library
    op directly skips the Function's Python cost per call (``Function.apply`` binds its
    arguments with ``inspect``), which matters for an optimizer step over many small leaves.
    """
    if torch._C._are_functorch_transforms_active():
        return True
    # Inside torch.autograd.forward_ad.dual_level() the raw op would drop the tangents.
    if getattr(torch.autograd.forward_ad, "_current_level", 0) >= 0:
        return True
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, Tensor) and a.requires_grad for a in args)


def use_stacked_kernel(op: str, grad: Tensor) -> bool:
    """The dispatch rule of op 4: the shared rule (which also covers nested forward-mode AD)."""
    return use_kernel(op, grad)


def stacked_adam_update(
    grad: Tensor,
    mu: Tensor,
    nu: Tensor,
    count: Tensor | int,
    lr: float | Tensor,
    *,
    param: Tensor | None = None,
    weight_decay: float | Tensor | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    eps_root: float = 0.0,
    decoupled: bool = False,
    maximize: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``(update, new_mu, new_nu)``: one Adam step of a stacked leaf ``(N, ...)``.

    Member ``n`` (``grad[n]``) is updated with learning rate ``lr[n]`` and weight decay
    ``weight_decay[n]`` (floats and 0-d tensors are shared by all members) exactly as
    ``torch.optim.Adam`` (``decoupled=False``: L2 decay added to the gradient) or
    ``torch.optim.AdamW`` (``decoupled=True``) would; ``param + update`` is the new
    parameter. ``count`` is the number of this step (1 on the first), 0-d or ``(N,)``; the
    bias corrections are computed from it on the device (no host sync). ``update`` has
    grad's shape and dtype; the moments keep theirs (float32 moments for float16/bfloat16
    params are accepted). Differentiable (any order) w.r.t. grad, mu, nu, param, lr and
    weight_decay; composes with ``vmap``/``grad``/``jvp`` and ``torch.compile``.

    Args:
        grad: float tensor ``(N, ...)``; members along dim 0.
        mu, nu: first and second moments, shape of ``grad``.
        count: int or integer tensor, 0-d or ``(N,)``: this step's number (>= 1).
        lr: float, 0-d or ``(N,)`` floating tensor on grad's device.
        param: the parameters (needed only for weight decay).
        weight_decay: None, a float, or a 0-d/``(N,)`` floating tensor.
        betas, eps: as in ``torch.optim.Adam``; ``eps_root`` is added inside the square
            root (use a small positive value when differentiating through the update).
        decoupled: AdamW's decoupled decay ``-lr * wd * param`` instead of L2.
        maximize: ascend instead of descend.

    Example:
        >>> import torch
        >>> from torchfn.ops import stacked_adam_update
        >>> g = torch.ones(2, 3)
        >>> z = torch.zeros(2, 3)
        >>> u, mu, nu = stacked_adam_update(g, z, z, 1, torch.tensor([0.1, 0.2]))
        >>> u[:, 0]  # the first Adam step moves each member by its own lr
        tensor([-0.1000, -0.2000])
    """
    op = "stacked_adam_update"
    grad = _check_leaf(op, grad)
    mu = _check_like(op, "mu", mu, grad, state=True)
    nu = _check_like(op, "nu", nu, grad, state=True)
    if mu.dtype != nu.dtype:
        raise TypeError(f"torchfn.ops.{op}(mu=..., nu=...): expected one dtype for both "
                        f"moments, got {mu.dtype} and {nu.dtype}")
    count_t = _count_tensor(op, count, grad)
    lr_t = _member_tensor(op, "lr", lr, grad)
    wd_t, param_t = _weight_decay(op, weight_decay, param, grad)
    b1, b2 = (float(b) for b in betas)
    args = (grad, mu, nu, param_t, count_t, lr_t, wd_t, b1, b2, float(eps), float(eps_root),
            bool(decoupled), bool(maximize))
    if not use_stacked_kernel(op, grad):
        return reference.stacked_adam_update(*args)
    if _needs_autograd(args):
        return _StackedAdamFn.apply(*args)  # type: ignore[no-any-return]
    return tuple(torch.ops.torchfn.stacked_adam_update(*args))  # type: ignore[return-value]


def stacked_sgd_update(
    grad: Tensor,
    momentum_buffer: Tensor | None,
    count: Tensor | int,
    lr: float | Tensor,
    *,
    param: Tensor | None = None,
    weight_decay: float | Tensor | None = None,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Return ``(update, new_momentum_buffer)``: one SGD step of a stacked leaf ``(N, ...)``.

    Member ``n`` is updated as ``torch.optim.SGD`` would with ``lr[n]`` and
    ``weight_decay[n]`` (L2; floats and 0-d tensors are shared). With a momentum buffer the
    buffer starts as the gradient on the first step (``count <= 1``, per member), then
    ``b = momentum * b + (1 - dampening) * g``; Nesterov uses ``g + momentum * b``. Pass
    ``momentum_buffer=None`` for plain SGD (the returned buffer is then None).
    Differentiable (any order) w.r.t. grad, buffer, param, lr and weight_decay.

    Example:
        >>> import torch
        >>> from torchfn.ops import stacked_sgd_update
        >>> g = torch.ones(2, 3)
        >>> u, buf = stacked_sgd_update(g, torch.zeros(2, 3), 1, torch.tensor([0.1, 0.2]),
        ...                             momentum=0.9)
        >>> u[:, 0], buf[:, 0]
        (tensor([-0.1000, -0.2000]), tensor([1., 1.]))
    """
    op = "stacked_sgd_update"
    grad = _check_leaf(op, grad)
    buf = (None if momentum_buffer is None
           else _check_like(op, "momentum_buffer", momentum_buffer, grad, state=True))
    count_t = _count_tensor(op, count, grad)
    lr_t = _member_tensor(op, "lr", lr, grad)
    wd_t, param_t = _weight_decay(op, weight_decay, param, grad)
    args = (grad, buf, param_t, count_t, lr_t, wd_t, float(momentum), float(dampening),
            bool(nesterov), bool(maximize))
    if not use_stacked_kernel(op, grad):
        return reference.stacked_sgd_update(*args)
    if _needs_autograd(args):
        update, new_buf = _StackedSgdFn.apply(*args)
    else:
        update, new_buf = torch.ops.torchfn.stacked_sgd_update(*args)
    return update, (None if buf is None else new_buf)
