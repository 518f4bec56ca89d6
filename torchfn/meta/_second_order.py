"""What the second-order meta-gradient runs under: the math attention kernel, a composite LayerNorm.

The meta-gradient of MAML, ANIL and Meta-SGD is ``grad`` of a ``vmap`` over tasks of a
function that itself calls ``grad`` (the inner loop), so every op of the model is
differentiated twice, with the task ``vmap`` in between. Two of torch's kernels break there:

- the fused ``scaled_dot_product_attention`` kernels (flash, memory-efficient, and the CPU
  flash kernel) have no double backward ("derivative for ..._backward is not implemented");
  ``sdpa_kernel(SDPBackend.MATH)`` selects the composite math path, which has one;
- ``layer_norm`` with a weight returns silently wrong gradients for everything before it in
  exactly this nesting (``grad(vmap(grad(...)))``; measured on torch 2.13), while the
  same computation without the ``vmap``, or as ``vmap(grad(grad(...)))``, is right. A
  ``TorchFunctionMode`` computes ``F.layer_norm`` / ``torch.layer_norm`` from mean, variance
  and ``rsqrt`` instead, which differentiates correctly at any order.

First-order variants (first-order MAML, Reptile) never differentiate twice and keep the fused
kernels.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from torchfn.functional import FunctionalModel

__all__: list[str] = []


def _composite_layer_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
    bias: Tensor | None = None, eps: float = 1e-5,
) -> Tensor:
    """``F.layer_norm`` from differentiable composite ops (statistics in at least float32)."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    work = torch.promote_types(x.dtype, torch.float32)
    h = x.to(work)
    mean = h.mean(dims, keepdim=True)
    centered = h - mean
    var = (centered * centered).mean(dims, keepdim=True)
    y = centered * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    # autocast runs layer_norm in float32 and returns float32; otherwise the input's dtype
    return y if torch.is_autocast_enabled(x.device.type) else y.to(x.dtype)


class _CompositeLayerNorm(TorchFunctionMode):
    """Route ``F.layer_norm`` and ``torch.layer_norm`` to :func:`_composite_layer_norm`."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.layer_norm:
            return _composite_layer_norm(*args, **kwargs)
        if func is torch.layer_norm:  # (input, shape, weight, bias, eps, cudnn_enable)
            kwargs.pop("cudnn_enable", None)
            return _composite_layer_norm(*args[:5], **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def second_order_context(layer_norm: bool = True) -> Iterator[None]:
    """Run a second-order meta-gradient: math SDPA backend, composite layer norm.

    ``layer_norm=False`` leaves out the layer-norm mode, for models known to have no layer norm
    (:func:`may_use_layer_norm`): a ``TorchFunctionMode`` sees every torch call, and Dynamo
    cannot trace some of them through it (``Tensor.unflatten``'s ``super()`` call).
    """
    with sdpa_kernel(SDPBackend.MATH), (_CompositeLayerNorm() if layer_norm
                                        else contextlib.nullcontext()):
        yield


_LAYER_NORM_NAMES = frozenset({"layer_norm", "native_layer_norm"})


def _code_calls_layer_norm(code: types.CodeType, owner: type | None, scope: dict[str, Any],
                           depth: int, seen: set[types.CodeType]) -> bool:
    """Whether ``code`` names ``layer_norm`` (``F.layer_norm``, ``torch.layer_norm``, ...), in
    itself, its nested functions, or -- ``depth`` levels down -- the functions of its module
    (``scope``, its globals) and the methods of ``owner`` (its class) that it names."""
    if code in seen:
        return False
    seen.add(code)
    if _LAYER_NORM_NAMES & set(code.co_names):
        return True
    for const in code.co_consts:  # nested functions, lambdas, comprehensions
        if isinstance(const, types.CodeType) and _code_calls_layer_norm(
                const, owner, scope, depth, seen):
            return True
    if depth == 0:
        return False
    for name in code.co_names:
        for where in (owner, scope):
            target = (getattr(where, name, None) if isinstance(where, type)
                      else where.get(name) if isinstance(where, dict) else None)
            target = getattr(target, "__func__", target)  # classmethod/staticmethod
            if isinstance(target, types.FunctionType) and _code_calls_layer_norm(
                    target.__code__, owner, target.__globals__, depth - 1, seen):
                return True
    return False


@functools.cache
def _class_calls_layer_norm(cls: type) -> bool:
    """Whether ``cls.forward`` (or what it calls, two levels deep) names ``layer_norm``."""
    forward = getattr(cls, "forward", None)
    if not isinstance(forward, types.FunctionType):
        return True  # not Python code we can read: assume it may
    return _code_calls_layer_norm(forward.__code__, cls, forward.__globals__, 2, set())


def may_use_layer_norm(model_fn: Any) -> bool:
    """False only for a model whose modules are known and hold no layer norm.

    A :class:`torchfn.functional.FunctionalModel` is inspected: ``nn.LayerNorm`` and its
    subclasses, any module whose class name says LayerNorm (e.g. Hugging Face's), and any
    module whose ``forward`` names ``layer_norm`` -- a user's own norm module or a QK-norm
    written inline, ``F.layer_norm(...)`` -- in its code, its nested functions, or the
    functions and methods it calls, two levels deep. Any other callable may call
    ``F.layer_norm`` anywhere, so it counts as using one.
    """
    modules = getattr(model_fn, "modules", None)
    if not isinstance(model_fn, FunctionalModel) or modules is None:
        return True
    return any(isinstance(m, torch.nn.LayerNorm) or "layernorm" in type(m).__name__.lower()
               or _class_calls_layer_norm(type(m)) for m in modules())
