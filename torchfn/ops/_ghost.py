"""Op 3: per-sample gradient norms of a linear layer without per-sample gradients.

For a linear layer ``y = a @ W.T + b`` with input activations ``a`` and output gradients ``g``
(the gradient of the summed loss with respect to ``y``), sample ``i``'s weight gradient is
``G_i = g_i^T a_i`` of shape ``(d_out, d_in)`` and its bias gradient is ``s_i = sum_t g_it``.
This module computes ``||G_i||^2`` (and ``||s_i||^2``) without materialising ``G_i`` ("ghost
norms"), and the clipped sum ``sum_i coef_i G_i`` of book-keeping DP-SGD:

- 2-D ``a (B, d_in)``, ``g (B, d_out)``: ``||G_i||^2 = ||a_i||^2 ||g_i||^2``, one fused pass.
- 3-D ``a (B, T, d_in)``, ``g (B, T, d_out)`` (sequences): two exact formulas,

  * ``"gram"``: ``<a_i a_i^T, g_i g_i^T>``, ``O(B T^2 (d_in + d_out))`` work, ``2 B T^2`` memory;
  * ``"materialize"``: ``||g_i^T a_i||^2``, ``O(B T d_in d_out)`` work, ``B d_in d_out`` memory.

  ``method="auto"`` picks ``"gram"`` iff ``T * (d_in + d_out) <= d_in * d_out``
  (:func:`gram_is_cheaper`): the form with fewer multiply-adds, which then also needs the
  smaller temporaries; either way they are never larger than ``a`` and ``g`` together.

Per op: the library ops ``torchfn::linear_grad_norms_sq``, ``..._backward`` and
``torchfn::clipped_linear_grad_sum`` (schemas in ``csrc/ops.cpp``), fake kernels,
``autograd.Function``\\ s (``setup_context``, ``vmap``, ``jvp``; the norms' backward is a second
Function on a kernel, whose own backward is written below in plain differentiable torch ops,
so every order of derivative works) and public functions that validate and dispatch
(:mod:`torchfn.ops._dispatch`) to the kernel or to the twins in :mod:`torchfn.ops.reference`.
The bias-only functions are single reductions/GEMVs and always run the plain-torch twin.
Under two or more nested forward-mode levels (``jacfwd(jacfwd(f))``) the public ops run the
twins too: torch mis-differentiates a Function's ``jvp`` rule there (pytorch #197867).
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchfn.ops import _build, reference
from torchfn.ops._dispatch import (
    Function,
    check_float_tensor,
    plain_backward,
    set_rule,
    use_kernel,
)

__all__ = [
    "clipped_linear_bias_grad_sum",
    "clipped_linear_grad_sum",
    "gram_is_cheaper",
    "linear_bias_grad_norms_sq",
    "linear_grad_norms_sq",
]

_METHODS = ("auto", "gram", "materialize")


def gram_is_cheaper(time: int, d_in: int, d_out: int) -> bool:
    """Return True when the Gram form of the 3-D norms costs no more than materialising.

    The Gram form takes ``B T^2 (d_in + d_out)`` multiply-adds, the materialised form
    ``B T d_in d_out``; so Gram wins iff ``T (d_in + d_out) <= d_in d_out``, i.e. for ``T`` up
    to about ``min(d_in, d_out)`` (``T <= d/2`` when ``d_in = d_out = d``).

    Example:
        >>> gram_is_cheaper(128, 1024, 1024), gram_is_cheaper(4096, 256, 256)
        (True, False)
    """
    return time * (d_in + d_out) <= d_in * d_out


def _resolve_method(a: Tensor, g: Tensor, method: str) -> str:
    """Return ``"gram"`` or ``"materialize"``: the path ``method`` names for these shapes."""
    if method != "auto":
        return method
    if a.dim() == 2:
        return "gram"  # the closed form ||a||^2 ||g||^2 (T = 1): always the cheapest
    return "gram" if gram_is_cheaper(a.shape[1], a.shape[2], g.shape[2]) else "materialize"


def _batch_first(x: Tensor, bdim: int | None, batch_size: int) -> Tensor:
    """Move the vmap batch dim of ``x`` to 0 (expanding an unbatched ``x`` to the batch)."""
    if bdim is None:
        return x.unsqueeze(0).expand(batch_size, *x.shape)
    return x.movedim(bdim, 0)


def _fold(x: Tensor) -> Tensor:
    """Merge dims 0 (vmap) and 1 (samples) of ``x``: the ops are independent per sample."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _per_sample(x: Tensor, like: Tensor) -> Tensor:
    """View the ``(B,)`` tensor ``x`` so that it broadcasts against ``like`` (2-D or 3-D)."""
    return x.reshape(x.shape[0], *([1] * (like.dim() - 1)))


def _dot(x: Tensor, y: Tensor) -> Tensor:
    """Return the ``(B,)`` per-sample inner products of same-shaped ``x`` and ``y``."""
    return (x * y).flatten(1).sum(1)


def _hessian_terms(
    w: Tensor, a: Tensor, g: Tensor, u: Tensor, v: Tensor, bias: bool, method: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Second-order terms of ``N_i = ||g_i^T a_i||^2 + bias * ||sum_t g_it||^2``.

    With ``H`` the per-sample Hessian of ``N`` in ``(a, g)`` and ``(u, v)`` a direction of
    the shapes of ``(a, g)``, returns ``(w * (H (u, v))_a, w * (H (u, v))_g, <grad N, (u, v)>)``.
    This is at once the backward of ``(w, a, g) -> (w grad_a N, w grad_g N)`` for cotangents
    ``(u, v)`` and (by symmetry of ``H``) the ``a``/``g`` part of its forward-mode derivative.
    Plain torch ops, so derivatives of any order follow. With ``G = g^T a``, ``s = sum_t g_t``,
    ``r = sum_t v_t``, ``R = g^T u + v^T a``::

        d/da = 2w (g R + v G)            = 2w (g g^T u + (g v^T + v g^T) a)
        d/dg = 2w (a R^T + u G^T + b r)  = 2w ((a u^T + u a^T) g + a a^T v + b r)
        d/dw = 2 (<R, G> + b <r, s>)     = 2 (<g g^T, u a^T> + <a a^T, v g^T> + b <r, s>)
    (materialised and Gram forms); 2-D inputs are the case ``T = 1`` in closed form.
    """
    beta = 1.0 if bias else 0.0
    two_w = _per_sample(2 * w, a)
    if a.dim() == 2:
        sq_a, sq_g = _dot(a, a), _dot(g, g)
        ua, vg = _dot(u, a), _dot(v, g)
        d_a = two_w * (sq_g[:, None] * u + 2 * vg[:, None] * a)
        d_g = two_w * (2 * ua[:, None] * g + (sq_a + beta)[:, None] * v)
        d_w = 2 * (sq_g * ua + (sq_a + beta) * vg)
        return d_a, d_g, d_w
    g_t, a_t = g.transpose(1, 2), a.transpose(1, 2)
    if method == "gram":
        gram_g, gram_a = g @ g_t, a @ a_t  # (B, T, T)
        u_a, v_g = u @ a_t, v @ g_t  # (u a^T)_{ts} = u_t . a_s
        d_a = two_w * (gram_g @ u + (v_g.transpose(1, 2) + v_g) @ a)
        d_g = two_w * ((u_a.transpose(1, 2) + u_a) @ g + gram_a @ v)
        d_w = 2 * (_dot(gram_g, u_a) + _dot(gram_a, v_g))
    else:
        grad_w = g_t @ a  # (B, d_out, d_in)
        r_mat = g_t @ u + v.transpose(1, 2) @ a
        d_a = two_w * (g @ r_mat + v @ grad_w)
        d_g = two_w * (a @ r_mat.transpose(1, 2) + u @ grad_w.transpose(1, 2))
        d_w = 2 * _dot(r_mat, grad_w)
    if bias:
        r, s = v.sum(1), g.sum(1)
        d_g = d_g + two_w * r[:, None, :]
        d_w = d_w + 2 * _dot(r, s)
    return d_a, d_g, d_w


class _NormsGradFn(Function):
    """``(w, a, g, aux) -> (w grad_a N, w grad_g N)`` on the kernel; derivatives in torch ops.

    ``aux`` is the forward kernel's by-product (row norms, Gram matrices or ``g^T a``), a
    function of ``(a, g)`` that spares the kernel recomputing it, or None. It gets no
    gradient: :func:`_hessian_terms` differentiates through ``a`` and ``g`` directly.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        w: Tensor, a: Tensor, g: Tensor, aux: Tensor | None, bias: bool, method: str
    ) -> tuple[Tensor, Tensor]:
        return torch.ops.torchfn.linear_grad_norms_sq_backward(w, a, g, aux, bias, method)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        w, a, g, _aux, bias, method = inputs
        ctx.save_for_backward(w, a, g)
        ctx.save_for_forward(w, a, g)
        ctx.bias, ctx.method = bias, method

    @staticmethod
    def backward(ctx, u: Tensor | None, v: Tensor | None):  # type: ignore[no-untyped-def, override]
        w, a, g = ctx.saved_tensors
        u = torch.zeros_like(a) if u is None else u
        v = torch.zeros_like(g) if v is None else v
        d_a, d_g, d_w = _hessian_terms(w, a, g, u, v, ctx.bias, ctx.method)
        needs = ctx.needs_input_grad
        return (d_w if needs[0] else None, d_a if needs[1] else None,
                d_g if needs[2] else None, None, None, None)

    @staticmethod
    def jvp(  # type: ignore[no-untyped-def, override]
        ctx, w_t, a_t, g_t, _aux_t, _bias_t, _method_t
    ):
        w, a, g = ctx.saved_tensors
        a_t = torch.zeros_like(a) if a_t is None else a_t
        g_t = torch.zeros_like(g) if g_t is None else g_t
        d_a, d_g, _ = _hessian_terms(w, a, g, a_t, g_t, ctx.bias, ctx.method)
        if w_t is not None:  # the outputs are linear in w
            da_w, dg_w = _NormsGradFn.apply(w_t, a, g, None, ctx.bias, ctx.method)
            d_a, d_g = d_a + da_w, d_g + dg_w
        return d_a, d_g

    @staticmethod
    def vmap(info, in_dims, w, a, g, aux, bias, method):  # type: ignore[no-untyped-def]
        if all(d is None for d in in_dims[:4]):
            return _NormsGradFn.apply(w, a, g, aux, bias, method), (None, None)
        n = info.batch_size
        wb, ab, gb = (_batch_first(x, d, n) for x, d in zip((w, a, g), in_dims[:3], strict=True))
        auxb = None if aux is None else _fold(_batch_first(aux, in_dims[3], n))
        d_a, d_g = _NormsGradFn.apply(_fold(wb), _fold(ab), _fold(gb), auxb, bias, method)
        return (d_a.reshape(ab.shape), d_g.reshape(gb.shape)), (0, 0)


class _NormsFn(Function):
    """``(a, g) -> (N, aux)``: per-sample squared gradient norms on the kernel.

    ``aux`` (non-differentiable) is what the backward kernel reuses: ``(B, 2)`` row norms
    (2-D), ``(B, 2, T, T)`` Gram matrices or ``(B, d_out, d_in)`` ``g^T a`` (3-D).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        a: Tensor, g: Tensor, bias: bool, method: str
    ) -> tuple[Tensor, Tensor]:
        return torch.ops.torchfn.linear_grad_norms_sq(a, g, bias, method)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        a, g, bias, method = inputs
        _, aux = output
        ctx.mark_non_differentiable(aux)
        # aux gets no gradient: with materialised grads autograd would fill a zeros tensor of
        # aux's shape for it on every backward ((B, 2, T, T) or (B, d_out, d_in) in 3-D).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(a, g, aux)
        ctx.save_for_forward(a, g, aux)
        ctx.bias, ctx.method = bias, method

    @staticmethod
    def backward(  # type: ignore[no-untyped-def, override]
        ctx, w: Tensor | None, _aux_grad: Tensor | None
    ):
        if w is None:  # grads are not materialised (setup_context): the norms got none
            return None, None, None, None
        a, g, aux = ctx.saved_tensors
        if plain_backward():  # nothing differentiates this backward: the kernel alone
            d_a, d_g = torch.ops.torchfn.linear_grad_norms_sq_backward(
                w, a, g, aux, ctx.bias, ctx.method)
        else:
            d_a, d_g = _NormsGradFn.apply(w, a, g, aux, ctx.bias, ctx.method)
        needs = ctx.needs_input_grad
        return d_a if needs[0] else None, d_g if needs[1] else None, None, None

    @staticmethod
    def jvp(ctx, a_t, g_t, _bias_t, _method_t):  # type: ignore[no-untyped-def, override]
        a, g, aux = ctx.saved_tensors
        ones = a.new_ones(a.shape[0])
        d_a, d_g = _NormsGradFn.apply(ones, a, g, aux, ctx.bias, ctx.method)  # grad of N_i
        out = torch.zeros_like(ones)
        if a_t is not None:
            out = out + _dot(d_a, a_t)
        if g_t is not None:
            out = out + _dot(d_g, g_t)
        return out, None  # aux is non-differentiable

    @staticmethod
    def vmap(info, in_dims, a, g, bias, method):  # type: ignore[no-untyped-def]
        if in_dims[0] is None and in_dims[1] is None:
            return _NormsFn.apply(a, g, bias, method), (None, None)
        ab = _batch_first(a, in_dims[0], info.batch_size)
        gb = _batch_first(g, in_dims[1], info.batch_size)
        out, aux = _NormsFn.apply(_fold(ab), _fold(gb), bias, method)
        lead = ab.shape[:2]
        return (out.reshape(lead), aux.reshape(*lead, *aux.shape[1:])), (0, 0)


class _ClippedSumFn(Function):
    """``(a, g, coef) -> sum_i coef_i g_i^T a_i`` on the kernel (one GEMM); torch-op backward."""

    @staticmethod
    def forward(a: Tensor, g: Tensor, coef: Tensor) -> Tensor:  # type: ignore[override]
        return torch.ops.torchfn.clipped_linear_grad_sum(a, g, coef)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def, override]
        a, g, coef = ctx.saved_tensors
        needs = ctx.needs_input_grad
        c = _per_sample(coef, a)
        g_grad = g @ grad  # (B, [T,] d_in): sum_o g_o grad_{o,k}
        d_a = c * g_grad if needs[0] else None
        d_g = c * (a @ grad.transpose(0, 1)) if needs[1] else None
        d_c = _dot(g_grad, a) if needs[2] else None
        return d_a, d_g, d_c

    @staticmethod
    def jvp(ctx, a_t, g_t, coef_t):  # type: ignore[no-untyped-def, override]
        a, g, coef = ctx.saved_tensors  # the sum is linear in each of a, g and coef
        out = a.new_zeros(g.shape[-1], a.shape[-1])
        if a_t is not None:
            out = out + _ClippedSumFn.apply(a_t, g, coef)
        if g_t is not None:
            out = out + _ClippedSumFn.apply(a, g_t, coef)
        if coef_t is not None:
            out = out + _ClippedSumFn.apply(a, g, coef_t)
        return out

    @staticmethod
    def vmap(info, in_dims, a, g, coef):  # type: ignore[no-untyped-def]
        if all(d is None for d in in_dims):
            return _ClippedSumFn.apply(a, g, coef), None
        n = info.batch_size
        ab, gb, cb = (_batch_first(x, d, n) for x, d in zip((a, g, coef), in_dims, strict=True))
        # One batched GEMM over the vmap dim, in plain (differentiable) torch ops.
        scaled = gb * cb.reshape(*cb.shape, *([1] * (gb.dim() - 2)))
        d_in, d_out, rows = ab.shape[-1], gb.shape[-1], gb.shape[1:-1].numel()
        out = scaled.reshape(n, rows, d_out).transpose(1, 2) @ ab.reshape(n, rows, d_in)
        return out, 0


def _register_fakes() -> None:
    """Register the fake (meta) kernels once the C++ library (and so the schemas) is loaded."""

    def check(op: str, a: Tensor, g: Tensor) -> None:
        torch._check(a.dim() in (2, 3), lambda: f"torchfn::{op}: argument 'a' must have 2 or "
                     f"3 dims, got shape {tuple(a.shape)}")
        torch._check(
            g.dim() == a.dim() and g.shape[:-1] == a.shape[:-1],
            lambda: f"torchfn::{op}: arguments 'a' {tuple(a.shape)} and 'g' {tuple(g.shape)} "
            "must agree in the batch (and time) dims",
        )
        torch._check(g.dtype == a.dtype, lambda: f"torchfn::{op}: argument 'g' must have the "
                     f"dtype of 'a' ({a.dtype}), got {g.dtype}")

    def check_per_sample(op: str, arg: str, t: Tensor, a: Tensor) -> None:
        torch._check(t.dim() == 1 and t.shape[0] == a.shape[0], lambda: f"torchfn::{op}: "
                     f"argument '{arg}' must have shape ({a.shape[0]},), got {tuple(t.shape)}")
        torch._check(t.dtype == a.dtype, lambda: f"torchfn::{op}: argument '{arg}' must have "
                     f"the dtype of 'a' ({a.dtype}), got {t.dtype}")

    def aux_like(a: Tensor, g: Tensor, method: str) -> Tensor:
        if a.dim() == 2:
            acc = torch.float64 if a.dtype == torch.float64 else torch.float32
            return a.new_empty((a.shape[0], 2), dtype=acc)
        if _resolve_method(a, g, method) == "gram":
            return a.new_empty((a.shape[0], 2, a.shape[1], a.shape[1]))
        return a.new_empty((a.shape[0], g.shape[2], a.shape[2]))

    def fake_norms(
        a: Tensor, g: Tensor, bias: bool = False, method: str = "auto"
    ) -> tuple[Tensor, Tensor]:
        check("linear_grad_norms_sq", a, g)
        return a.new_empty((a.shape[0],)), aux_like(a, g, method)

    def fake_norms_backward(grad: Tensor, a: Tensor, g: Tensor, aux: Tensor | None = None,
                            bias: bool = False, method: str = "auto") -> tuple[Tensor, Tensor]:
        check("linear_grad_norms_sq_backward", a, g)
        check_per_sample("linear_grad_norms_sq_backward", "grad", grad, a)
        if aux is not None:
            want = aux_like(a, g, method)
            torch._check(aux.shape == want.shape and aux.dtype == want.dtype, lambda: (
                "torchfn::linear_grad_norms_sq_backward: argument 'aux' must be the forward's "
                f"aux for these inputs, of shape {tuple(want.shape)} and dtype {want.dtype}, "
                f"got {tuple(aux.shape)} {aux.dtype}"))
        return a.new_empty(a.shape), g.new_empty(g.shape)

    def fake_clipped_sum(a: Tensor, g: Tensor, coef: Tensor) -> Tensor:
        check("clipped_linear_grad_sum", a, g)
        check_per_sample("clipped_linear_grad_sum", "coef", coef, a)
        return a.new_empty((g.shape[-1], a.shape[-1]))

    torch.library.register_fake("torchfn::linear_grad_norms_sq", fake_norms)
    torch.library.register_fake("torchfn::linear_grad_norms_sq_backward", fake_norms_backward)
    torch.library.register_fake("torchfn::clipped_linear_grad_sum", fake_clipped_sum)


_build.on_load(_register_fakes)


# ---------------------------------------------------------------------------------------------
# Dispatch rules (eager calls; under torch.compile the twins always run). Keys: the norms are
# split by path -- "linear_grad_norms_sq" (2-D), "linear_grad_norms_sq_gram" and
# "linear_grad_norms_sq_materialize" (3-D) -- and "clipped_linear_grad_sum". Sizes are numel(a).
# Thresholds come from benchmarks/ops_ghost.py (see benchmarks/README.md):
# - Forward without autograd: the kernels are as fast as or faster than the eager twins at every
#   size on CUDA (2-D: one fused pass near copy bandwidth, where the twin makes several).
# - With autograd recording, the two Functions add a fixed Python cost per call, which the
#   kernels recover only on large inputs: hence a size threshold for the 2-D norms and for the
#   3-D Gram form; the 3-D materialised backward is the twin's own two GEMMs, so the twin is
#   picked there at every size; the clipped sum's backward is plain torch, equal at large sizes
#   (its threshold is the crossover of a noisy sweep). CPU thresholds come from a noisy sweep.
_RULES = {
    "cuda": {
        "linear_grad_norms_sq": {"min_numel": 0, "min_numel_grad": 1 << 24},
        "linear_grad_norms_sq_gram": {"min_numel": 0, "min_numel_grad": 1 << 21},
        "linear_grad_norms_sq_materialize": {"min_numel": 0, "min_numel_grad": None},
        "clipped_linear_grad_sum": {"min_numel": 0, "min_numel_grad": 1 << 22},
    },
    "cpu": {
        "linear_grad_norms_sq": {"min_numel": 0, "min_numel_grad": 1 << 16},
        "linear_grad_norms_sq_gram": {"min_numel": 0, "min_numel_grad": 1 << 16},
        "linear_grad_norms_sq_materialize": {"min_numel": 0, "min_numel_grad": 1 << 16},
        "clipped_linear_grad_sum": {"min_numel": 0, "min_numel_grad": 1 << 16},
    },
}
DISPATCH_KEYS = tuple(_RULES["cpu"])
for _device, _by_op in _RULES.items():
    for _op, _fields in _by_op.items():
        set_rule(_op, _device, **_fields)


def _norms_dispatch_key(a: Tensor, path: str) -> str:
    """The dispatch-rule key of the norms: per path, since their speed-ups differ."""
    return "linear_grad_norms_sq" if a.dim() == 2 else f"linear_grad_norms_sq_{path}"


# ---------------------------------------------------------------------------------------------
# Input validation (clear errors naming the call, the argument and what was seen)


def _check_g(op: str, call: str, g: object) -> Tensor:
    check_float_tensor(op, "g", g)
    assert isinstance(g, Tensor)
    if g.dim() not in (2, 3):
        raise ValueError(f"{call}: expected g to have 2 dims (batch, d_out) or 3 dims "
                         f"(batch, time, d_out), got g.shape={tuple(g.shape)}")
    return g


def _check_pair(op: str, call: str, a: object, g: object) -> tuple[Tensor, Tensor]:
    check_float_tensor(op, "a", a)
    check_float_tensor(op, "g", g)
    assert isinstance(a, Tensor) and isinstance(g, Tensor)
    shapes = f"a.shape={tuple(a.shape)} and g.shape={tuple(g.shape)}"
    if a.dim() not in (2, 3):
        raise ValueError(f"{call}: expected a to have 2 dims (batch, d_in) or 3 dims "
                         f"(batch, time, d_in), got a.shape={tuple(a.shape)}")
    if g.dim() != a.dim():
        raise ValueError(f"{call}: expected a and g to have the same number of dims (2: "
                         f"(batch, d) or 3: (batch, time, d)), got {shapes}")
    if g.shape[0] != a.shape[0]:
        raise ValueError(f"{call}: expected a and g to have the same batch size (dim 0), got "
                         f"{shapes}")
    if a.dim() == 3 and g.shape[1] != a.shape[1]:
        raise ValueError(f"{call}: expected a and g to have the same time length (dim 1), got "
                         f"{shapes}")
    if g.dtype != a.dtype:
        raise TypeError(f"{call}: expected a and g to have the same dtype, got "
                        f"a.dtype={a.dtype} and g.dtype={g.dtype}")
    if g.device != a.device:
        raise ValueError(f"{call}: expected a and g on the same device, got a.device={a.device} "
                         f"and g.device={g.device}")
    return a, g


def _check_coef(op: str, call: str, coef: object, g: Tensor) -> Tensor:
    check_float_tensor(op, "coef", coef)
    assert isinstance(coef, Tensor)
    if coef.shape != (g.shape[0],):
        raise ValueError(f"{call}: expected coef of shape ({g.shape[0]},) (one coefficient per "
                         f"sample of g.shape={tuple(g.shape)}), got coef.shape="
                         f"{tuple(coef.shape)}")
    if coef.dtype != g.dtype:
        raise TypeError(f"{call}: expected coef to have the dtype of g ({g.dtype}), got "
                        f"coef.dtype={coef.dtype}")
    if coef.device != g.device:
        raise ValueError(f"{call}: expected coef on the device of g ({g.device}), got "
                         f"coef.device={coef.device}")
    return coef


# ---------------------------------------------------------------------------------------------
# Public functions


def linear_grad_norms_sq(
    a: Tensor, g: Tensor, *, bias: bool = False, method: str = "auto"
) -> Tensor:
    """Return ``(B,)`` squared norms of a linear layer's per-sample parameter gradients.

    For ``y = a @ W.T + b``, sample ``i``'s weight gradient is ``G_i = g_i^T a_i``; this is
    ``||G_i||_F^2`` (plus ``||sum_t g_it||^2``, the bias gradient's, when ``bias=True``),
    computed without materialising ``G_i``: ``||a_i||^2 ||g_i||^2`` for 2-D inputs, and for
    3-D inputs the Gram form ``<a_i a_i^T, g_i g_i^T>`` or the materialised form
    ``||g_i^T a_i||^2``, whichever is cheaper (see :func:`gram_is_cheaper`).

    Runs torchfn's C++/CUDA kernel where safe and fast, else the twin
    :func:`torchfn.ops.reference.linear_grad_norms_sq`; differentiable to any order in
    ``a`` and ``g``, composes with ``torch.func`` transforms and ``torch.compile``.

    Args:
        a: input activations, ``(B, d_in)`` or ``(B, T, d_in)``.
        g: gradients of the summed loss w.r.t. the layer output, ``(B, d_out)`` or
            ``(B, T, d_out)``; same dtype (float16/bfloat16/float32/float64) and device as ``a``.
        bias: add the bias gradient's squared norm (a layer with bias).
        method: ``"auto"``, ``"gram"`` or ``"materialize"`` (3-D inputs only; 2-D inputs
            always use the closed form in the kernel).

    Example:
        >>> import torch, torchfn
        >>> a, g = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0]])
        >>> torchfn.ops.linear_grad_norms_sq(a, g)  # ||a||^2 ||g||^2 = 5 * 9
        tensor([45.])
        >>> torchfn.ops.linear_grad_norms_sq(a, g, bias=True)  # + ||g||^2
        tensor([54.])
    """
    call = "torchfn.ops.linear_grad_norms_sq(a=..., g=...)"
    _check_pair("linear_grad_norms_sq", call, a, g)
    if method not in _METHODS:
        raise ValueError(f"{call}: expected method to be one of {_METHODS}, got {method!r}")
    path = _resolve_method(a, g, method)
    flag = bool(bias)
    if use_kernel(_norms_dispatch_key(a, path), a):
        return _NormsFn.apply(a, g, flag, path)[0]
    return reference.linear_grad_norms_sq(a, g, bias=flag, method=path)


def linear_bias_grad_norms_sq(g: Tensor) -> Tensor:
    """Return ``(B,)`` squared norms ``||sum_t g_it||^2`` of per-sample bias gradients.

    ``g`` is ``(B, d_out)`` (then ``||g_i||^2``) or ``(B, T, d_out)``. One reduction in plain
    torch ops (torch and Inductor already run it at full bandwidth), so it has no kernel;
    differentiable to any order.

    Example:
        >>> import torch, torchfn
        >>> torchfn.ops.linear_bias_grad_norms_sq(torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]))
        tensor([52.])
    """
    _check_g("linear_bias_grad_norms_sq", "torchfn.ops.linear_bias_grad_norms_sq(g=...)", g)
    return reference.linear_bias_grad_norms_sq(g)


def clipped_linear_grad_sum(a: Tensor, g: Tensor, coef: Tensor) -> Tensor:
    """Return the ``(d_out, d_in)`` weighted sum ``sum_i coef_i g_i^T a_i`` of per-sample grads.

    With ``coef_i = min(1, C / ||G_i||)`` this is book-keeping DP-SGD's clipped weight
    gradient (before noise), computed as one GEMM over the batch (and time) dims, never
    materialising per-sample gradients. Runs the kernel where safe and fast, else the twin
    :func:`torchfn.ops.reference.clipped_linear_grad_sum`; differentiable to any order in
    ``a``, ``g`` and ``coef``.

    Args:
        a: ``(B, d_in)`` or ``(B, T, d_in)`` input activations.
        g: ``(B, d_out)`` or ``(B, T, d_out)`` output gradients (dtype and device of ``a``).
        coef: ``(B,)`` per-sample coefficients (dtype and device of ``a``).

    Example:
        >>> import torch, torchfn
        >>> a, g = torch.tensor([[1.0, 2.0], [0.0, 1.0]]), torch.tensor([[1.0], [2.0]])
        >>> torchfn.ops.clipped_linear_grad_sum(a, g, torch.tensor([0.5, 1.0]))
        tensor([[0.5000, 3.0000]])
    """
    call = "torchfn.ops.clipped_linear_grad_sum(a=..., g=..., coef=...)"
    _check_pair("clipped_linear_grad_sum", call, a, g)
    _check_coef("clipped_linear_grad_sum", call, coef, g)
    if use_kernel("clipped_linear_grad_sum", a):
        return _ClippedSumFn.apply(a, g, coef)
    return reference.clipped_linear_grad_sum(a, g, coef)


def clipped_linear_bias_grad_sum(g: Tensor, coef: Tensor) -> Tensor:
    """Return the ``(d_out,)`` weighted sum ``sum_i coef_i sum_t g_it`` of per-sample bias grads.

    The bias counterpart of :func:`clipped_linear_grad_sum` (one GEMV in plain torch ops, so
    no kernel); differentiable to any order.

    Example:
        >>> import torch, torchfn
        >>> g = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> torchfn.ops.clipped_linear_bias_grad_sum(g, torch.tensor([1.0, 0.5]))
        tensor([2.5000, 4.0000])
    """
    call = "torchfn.ops.clipped_linear_bias_grad_sum(g=..., coef=...)"
    _check_g("clipped_linear_bias_grad_sum", call, g)
    _check_coef("clipped_linear_bias_grad_sum", call, coef, g)
    return reference.clipped_linear_bias_grad_sum(g, coef)
