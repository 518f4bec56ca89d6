"""Per-layer rules of ghost per-sample gradients: norms, weighted sums, materialisation.

Every rule turns what one forward and one backward left behind for a layer -- the inputs of
each call of the layer (``calls``: ``(args, kwargs)``) and the gradients of the summed loss
with respect to each call's outputs (``grads``: one list of tensors per call, batch dim 0) --
into a :class:`Prepared` object with three methods:

- ``sq_norms()`` -> ``(B,)``: ``||grad_theta l_i||^2`` over the layer's parameters;
- ``weighted_sum(coef)`` -> ``{local_name: tensor}``: ``sum_i coef_i grad_theta l_i``
  (book-keeping DP-SGD's clipped sum; no second backward through the model);
- ``materialize()`` -> ``{local_name: (B, *shape)}``: the per-sample gradients themselves.

Rules (``y = layer(x)``, ``g = dL/dy``; calls of one layer are concatenated along time):

- ``nn.Linear``: ``G_i = g_i^T a_i`` with ``a = x`` flattened to ``(B, T, d_in)``; norms and sums
  by :func:`torchfn.ops.linear_grad_norms_sq` / :func:`torchfn.ops.clipped_linear_grad_sum`.
  HF transformers' ``Conv1D`` (``y = x W + b``, ``W (d_in, d_out)``: GPT-2's projections) is
  the same map with the weight stored transposed: the same forms, ``G_i^T`` reported.
- ``nn.Conv1d``/``nn.Conv2d``: the same with ``a`` = the input unfolded into patches
  ``(B, L, C_in/groups * prod(kernel))`` (any stride, padding -- also ``'same'`` and non-zero
  padding modes --, dilation); grouped and depthwise convs (``groups > 1``) form every
  group's per-sample gradient in one batched GEMM from the patches (or the grouped Gram form
  where that is cheaper), with no loop over groups; or, opt-in, weight-gradient
  convolutions with the batch folded into the groups (no unfold: less memory).
- ``nn.Embedding``: ``G_i[v] = sum_{t: id_it = v} g_it``; ``||G_i||^2`` sums the squared
  norms of the per-id segment sums after a per-sample sort (``O(B T D)``, no ``T x T`` Gram);
  ``padding_idx`` rows get no gradient.
- normalisation layers and the vmap fallback instantiate per-sample gradients
  (:mod:`torchfn.persample._ghost_instantiated`).
- torchfn's ``RNN``/``GRU``/``LSTM``: the linear forms per weight, time as the sequence axis
  (:mod:`torchfn.persample._ghost_recurrent`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from torchfn.ops import (
    clipped_linear_grad_sum,
    fused_gram_norms_sq,
    gram_is_cheaper,
    linear_grad_norms_sq,
    reference,
)

__all__: list[str] = []  # private: used by torchfn.persample._ghost_norms

Calls = Sequence[tuple[tuple[Any, ...], dict[str, Any]]]
Grads = Sequence[Sequence[Tensor]]
TensorDict = dict[str, Tensor]

class GhostLayerError(ValueError):
    """A layer that ghost per-sample gradients cannot handle (the message says why and how)."""


def input_of(args: tuple[Any, ...], kwargs: dict[str, Any], kind: str, name: str) -> Tensor:
    """Return the single input tensor of a call of a built-in layer."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor) or len(args) + len(kwargs) != 1:
        raise GhostLayerError(
            f"ghost layer {name!r} ({kind}): expected one tensor input per call, got "
            f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
        )
    return x


def _coef(coef: Tensor, like: Tensor) -> Tensor:
    return coef.to(like.dtype)


def _common(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Cast ``a`` and ``g`` to one dtype (autocast may leave them different).

    Under bf16 autocast a layer computes with its input cast to bfloat16, so its output
    gradient ``g`` is bfloat16 (linear and conv taps record that cast input already; other
    layers may record a float32 ``a``): both go to bfloat16, which is what the layer (and
    autograd's own parameter gradient) used, and keeps the per-sample work on the
    half-precision GEMM path. Otherwise the promoted dtype (float16 stays out: its squares and
    Gram entries overflow, loss-scaled ``g`` above all).
    """
    dtype = _compute_dtype(a.dtype, g.dtype)
    return a.to(dtype), g.to(dtype)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """bfloat16 where bfloat16 meets float32 (bf16 autocast, see :func:`_common`), else the
    promoted dtype."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return torch.bfloat16 if out == torch.float32 and torch.bfloat16 in dtypes else out


def _sq_norm_dtype(t: Tensor) -> Tensor:
    """``t`` in at least float32: per-sample squared norms of half-precision layers are summed
    over layers and compared with the clipping bound in float32."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class Prepared:
    """One layer's per-sample gradients in a form the three methods can use (see module doc)."""

    def sq_norms(self) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def weighted_sum(self, coef: Tensor) -> TensorDict:  # pragma: no cover - interface
        raise NotImplementedError

    def materialize(self) -> TensorDict:  # pragma: no cover - interface
        raise NotImplementedError

    def weighted_sum_parts(self, coef: Tensor) -> tuple[TensorDict, TensorDict]:
        """``weighted_sum`` in two parts: the sums already formed, and small per-sample
        ``(B, ...)`` gradients (biases, norm scales) whose sums ``coef @ x`` are left to the
        caller, which contracts those of all layers in one GEMM (one kernel instead of one per
        parameter: in a transformer they are half its parameters by count)."""
        return self.weighted_sum(coef), {}

    def expect_weighted_sum(self) -> None:
        """Hint: ``weighted_sum`` will follow ``sq_norms`` (book-keeping DP-SGD)."""

    def linear_parts(self) -> list[_LinearLike] | None:
        """The linear maps this layer's gradients consist of (each owning its own parameters),
        whose inner products have a ghost form; None where there is no such decomposition."""
        return None


class Instantiated(Prepared):
    """Per-sample gradients held explicitly (small parameters, or the vmap fallback)."""

    def __init__(self, grads: TensorDict) -> None:
        self.grads = grads

    def sq_norms(self) -> Tensor:
        return sum(_sq_norm_dtype(g.reshape(g.shape[0], -1)).square().sum(1)  # type: ignore[return-value]
                   for g in self.grads.values())

    def weighted_sum(self, coef: Tensor) -> TensorDict:
        return {k: torch.tensordot(_coef(coef, g), g, dims=1) for k, g in self.grads.items()}

    def weighted_sum_parts(self, coef: Tensor) -> tuple[TensorDict, TensorDict]:
        small = {k: g for k, g in self.grads.items() if g[0].numel() <= SMALL_PART}
        return {k: torch.tensordot(_coef(coef, g), g, dims=1)
                for k, g in self.grads.items() if k not in small}, small

    def materialize(self) -> TensorDict:
        return dict(self.grads)


# per-sample gradients up to this many numbers per sample are contracted with the clipping
# coefficients in one GEMM across layers (GhostGrads.weighted_sum); larger ones alone, so that
# concatenating them costs little
SMALL_PART = 1 << 16


class _LinearLike(Prepared):
    """``G_i = sum_t g_it^T a_it`` per group of a (grouped) linear map; optional bias.

    Sequence inputs (one group) whose per-sample gradients get materialised keep them: the
    norms are their squares, and the weighted sum of book-keeping DP-SGD is then ``sum_i c_i
    G_i`` over the ``B d_out d_in`` numbers already computed, instead of a second GEMM over the
    ``B T`` activations. Materialised: when cheaper than the Gram form for the norms alone
    (``T (d_in + d_out) > d_in d_out``, e.g. convs, ``T`` = output positions), or, once a
    weighted sum is expected, in float32 without TF32 when the Gram form's ``2 B T^2 (d_in +
    d_out)`` multiply-adds outweigh moving ``G`` a few times (``T^2 (d_in + d_out) >= 64 d_in
    d_out``; its memory is then at most 1.5 times that of the layer's own ``a`` and ``g``).
    Both cases made graphed DP-SGD steps faster on CUDA: the benchmark CNN (its convs) and the
    benchmark transformer (its linears at T = 128); see ``benchmarks/README.md``.
    """

    def __init__(self, a: Tensor, g: Tensor, groups: int, weight_shape: torch.Size,
                 bias: bool, transposed: bool = False) -> None:
        self.a, self.g = _common(a, g)  # (B, d_in) / (B, d_out) or (B, T, d_in) / (B, T, d_out)
        self.groups, self.weight_shape, self.bias = groups, weight_shape, bias
        self.transposed = transposed  # weight stored as (d_in, d_out) (HF's Conv1D); groups 1
        self._kept: Tensor | None = None  # (B, d_out, d_in) once materialised by sq_norms
        self._bias_grads: Tensor | None = None  # (B, d_out): sum_t g_it, for norm and sum
        self._padded: tuple[Tensor, Tensor] | None = None  # see _gram_operands
        self._bookkeeping = False

    def expect_weighted_sum(self) -> None:
        self._bookkeeping = True

    def linear_parts(self) -> list[_LinearLike] | None:
        return [self]

    def _grouped(self) -> tuple[Tensor, Tensor]:
        """``a`` and ``g`` as ``(B, T, G, k)`` and ``(B, T, G, o)``."""
        a, g, n = self.a, self.g, self.groups
        if a.dim() == 2:
            a, g = a[:, None], g[:, None]
        return a.unflatten(-1, (n, -1)), g.unflatten(-1, (n, -1))

    def _keeps_per_sample(self) -> bool:
        a, g = self.a, self.g
        if self.groups != 1 or a.dim() != 3:
            return False
        t, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
        if not gram_is_cheaper(t, d_in, d_out):
            return True
        # fp32 SIMT GEMMs do few flops per byte of memory bandwidth on current GPUs; with tensor
        # cores (TF32, half types) the Gram form's FLOPs are far cheaper: not measured, not chosen
        simt = a.dtype == torch.float32 and _fp32_matmul_is_highest()
        return self._bookkeeping and simt and t * t * (d_in + d_out) >= 64 * d_in * d_out

    def _gram_operands(self) -> tuple[Tensor, Tensor, str]:
        """``(a, g, method)`` for the plain Gram norms of one group.

        While compiling, for CUDA half-precision inputs with a feature width that is not a
        multiple of 8 (GPT-2's tied LM head: ``d_out`` = 50257), ``a`` and ``g`` zero-padded
        for tensor cores (:func:`torchfn.ops.reference.pad_for_tensor_cores`), kept for the
        weighted sum: the Gram GEMMs pad them anyway, and the sum's GEMM, reading the same
        padded copies, needs no padded copy of its own (Inductor pads an unaligned GEMM
        operand itself: for the LM head a second pass over the ``B x T x 50257`` ``g``).
        Zero rows and columns add nothing to the norms or the sum."""
        a, g = self.a, self.g
        if (torch.compiler.is_compiling() and a.dim() == 3
                and (a.shape[-1] % 8 or g.shape[-1] % 8)
                and gram_is_cheaper(a.shape[1], a.shape[2], g.shape[2])):
            a_p, g_p = reference.pad_for_tensor_cores(a), reference.pad_for_tensor_cores(g)
            if a_p is not a or g_p is not g:
                self._padded = (a_p, g_p)
                return a_p, g_p, "gram"
        return a, g, "auto"

    def sq_norms(self) -> Tensor:
        if self._keeps_per_sample():
            if self._kept is None:
                self._kept = torch.bmm(self.g.transpose(1, 2), self.a)  # (B, d_out, d_in)
            out = _sq_norm_dtype(self._kept).square().sum((1, 2))
            return out + self._bias_sq_norms() if self.bias else out
        if self.groups == 1:
            fused = fused_gram_norms_sq(self.a, self.g, self.bias)  # None unless CUDA half 3-D
            if fused is not None:
                return fused
            a, g, method = self._gram_operands()
            return _sq_norm_dtype(linear_grad_norms_sq(a, g, bias=self.bias, method=method))
        a, g = self._grouped()
        b = a.shape[0]
        a_f = rearrange(a, "b t n k -> (b n) t k")
        g_f = rearrange(g, "b t n o -> (b n) t o")
        out = rearrange(_sq_norm_dtype(linear_grad_norms_sq(a_f, g_f)), "(b n) -> b n",
                        b=b).sum(1)
        return out + self._bias_sq_norms() if self.bias else out

    def weighted_sum(self, coef: Tensor) -> TensorDict:
        out = {"weight": self.weight_sum(coef)}
        if self.bias:
            out["bias"] = _coef(coef, self.a) @ self.per_sample_bias()
        return out

    def weighted_sum_parts(self, coef: Tensor) -> tuple[TensorDict, TensorDict]:
        weight = {"weight": self.weight_sum(coef)}
        return (weight, {"bias": self.per_sample_bias()}) if self.bias else (weight, {})

    def per_sample_bias(self) -> Tensor:
        """``(B, d_out)`` per-sample bias gradients, formed once for the norms and the sum."""
        if self._bias_grads is None:
            self._bias_grads = self.g if self.g.dim() == 2 else self.g.sum(1)
        return self._bias_grads

    def _bias_sq_norms(self) -> Tensor:
        return _sq_norm_dtype(self.per_sample_bias()).square().sum(1)

    def weight_sum(self, coef: Tensor) -> Tensor:
        """``sum_i coef_i G_i``, shaped like the weight."""
        c = _coef(coef, self.a)
        if self._kept is not None:
            w = torch.tensordot(c, self._kept, dims=1)
        elif self._padded is not None:  # the Gram norms' padded copies (_gram_operands)
            rows, cols = self.a.shape[-1], self.g.shape[-1]
            if not self.transposed:
                rows, cols = cols, rows
            w = _weighted_gemm(*self._padded, c, self.transposed)[:rows, :cols]
            w = w if w.is_contiguous() else w.contiguous()
        elif self.groups == 1:  # transposed (HF Conv1D): the GEMM gives (d_in, d_out) itself
            w = _weighted_gemm(self.a, self.g, c, self.transposed)
        else:
            a, g = self._grouped()
            w = torch.einsum("btgo,btgk->gok", g * c[:, None, None, None], a)
        if self.transposed and (self._kept is not None or self.groups != 1):
            w = w.transpose(-1, -2)
        return w.reshape(self.weight_shape)

    def materialize(self) -> TensorDict:
        if self._kept is not None:
            w = self._kept
        else:
            a, g = self._grouped()
            w = torch.einsum("btgo,btgk->bgok", g, a)
        if self.transposed:
            w = w.reshape(w.shape[0], -1, w.shape[-1]).transpose(-1, -2)
        out = {"weight": w.reshape(w.shape[0], *self.weight_shape)}
        if self.bias:
            out["bias"] = self.per_sample_bias()
        return out


def _fp32_matmul_is_highest() -> bool:
    """Whether float32 matmuls run in full fp32 (no TF32); read once per compile (a speed
    choice only: both paths give the same numbers up to rounding)."""
    return torch.get_float32_matmul_precision() == "highest"


# what ``torch.compiler.assume_constant_result`` sets (Dynamo calls the function and keeps the
# result as a constant), set here without that call's import of torch._dynamo, which would
# add seconds to ``import torchfn`` in programs that never compile (a test checks the name)
_fp32_matmul_is_highest._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _weighted_gemm(a: Tensor, g: Tensor, c: Tensor, transposed: bool = False) -> Tensor:
    """``sum_i c_i g_i^T a_i`` (``(d_out, d_in)``), or with ``transposed`` its transpose
    ``sum_i c_i a_i^T g_i`` (``(d_in, d_out)``, HF ``Conv1D``'s weight layout) computed as such.

    Eagerly torchfn's op (its kernel; the transposed sum is the op with ``a`` and ``g``
    swapped). Under ``torch.compile`` one ``(B T, .)^T (B T, .)`` GEMM with ``c`` folded into
    the narrower of ``a`` and ``g`` (the scaled copy is written and read by the GEMM: for
    GPT-2's tied ``lm_head``, ``d_out`` = 50257 and ``d_in`` = 768). Producing the weight's own
    layout keeps the clipped sum contiguous: a transposed view would make every later pass
    over it (the noise add, the non-finite guard's norm, the optimizer update) read it
    column-wise.
    """
    if not torch.compiler.is_compiling():
        return clipped_linear_grad_sum(g, a, c) if transposed else clipped_linear_grad_sum(a, g, c)
    scale = c.reshape(-1, *([1] * (g.dim() - 1)))
    if a.shape[-1] <= g.shape[-1]:
        a = a * scale
    else:
        g = g * scale
    a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    return a2.transpose(0, 1) @ g2 if transposed else g2.transpose(0, 1) @ a2


def _as_time(x: Tensor, batch: int) -> Tensor:
    """``(B, ..., d)`` -> ``(B, T, d)`` (``(B, d)`` -> ``(B, 1, d)``)."""
    return x.reshape(batch, -1, x.shape[-1])


def _cat_time(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Concatenate the ``(a, g)`` of several calls along time; one 2-D call stays 2-D."""
    if len(pairs) == 1:
        return pairs[0]
    a = torch.cat([_as_time(p[0], p[0].shape[0]) for p in pairs], 1)
    g = torch.cat([_as_time(p[1], p[1].shape[0]) for p in pairs], 1)
    return a, g


# ---------------------------------------------------------------------------------------------
# Rules


class Rule:
    """How ghost per-sample gradients treat one kind of layer."""

    kind = "fallback"
    # whether a call whose output has leading dim 1 in a pass of batch B > 1 is a call shared
    # by the batch (expanded to B on the tape); False where dim 0 of an output is not the batch
    expands_shared_calls = True
    # whether the layer's op is one autocast runs in its lower precision (linear, conv): then
    # its tap casts a float32 input to the autocast dtype before the call, so the cast the
    # layer computes with is the tensor recorded for the per-sample work (one cast, not two)
    casts_input_under_autocast = False

    def check(self, module: nn.Module, name: str) -> None:
        """Raise :class:`GhostLayerError` if ``module`` has settings this rule cannot handle."""

    def batch_dims_ok(self, module: nn.Module, calls: Calls, grads: Grads,
                      batch: int) -> str | None:
        """Describe the first recorded output without the batch where this rule needs it."""
        return batch_dims_ok(calls, grads, batch)

    def prepare(self, module: nn.Module, name: str, params: TensorDict, buffers: TensorDict,
                calls: Calls, grads: Grads) -> Prepared:  # pragma: no cover - interface
        raise NotImplementedError


class LinearRule(Rule):
    """``nn.Linear`` (``y = x W^T + b``, ``W (d_out, d_in)``), or with ``transposed=True`` HF
    transformers' ``Conv1D`` (``y = x W + b``, ``W (d_in, d_out)``; GPT-2's ``c_attn``,
    ``c_proj``, ``c_fc``): the same kernels, the weight's gradients transposed."""

    kind = "linear"
    casts_input_under_autocast = True

    def __init__(self, transposed: bool = False) -> None:
        self.transposed = transposed

    def prepare(self, module: nn.Module, name: str, params: TensorDict, buffers: TensorDict,
                calls: Calls, grads: Grads) -> Prepared:
        pairs = []
        for (args, kwargs), (g,) in zip(calls, grads, strict=True):
            x = input_of(args, kwargs, self.kind, name)
            if x.dim() < 2:
                raise GhostLayerError(f"ghost layer {name!r} (Linear): expected a batched input "
                                      f"(B, ..., d_in), got shape {tuple(x.shape)}")
            if x.dim() > 3:
                x, g = _as_time(x, x.shape[0]), _as_time(g, g.shape[0])
            pairs.append((x, g))
        a, g = _cat_time(pairs)
        weight = params["weight"]
        dtype = _compute_dtype(weight.dtype, g.dtype)  # bf16 under bf16 autocast
        return _LinearLike(a.to(dtype), g.to(dtype), 1, weight.shape,
                           "bias" in params, self.transposed)


def _pair(v: Any, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


CONV_METHODS = ("unfold", "grouped")


class _ConvGrouped(Prepared):
    """Per-sample conv gradients from weight-gradient convolutions, no unfold.

    Sample ``i``'s weight gradient is the weight gradient of a convolution of ``x_i`` alone;
    folding the batch into the channel dim (``(1, B C_in, H, W)``) and running one weight
    gradient with ``B * groups`` groups yields all of them at once, ``(B C_out, C_in/groups,
    *k)``. The weighted sum is the ordinary (whole-batch) weight gradient with ``g`` scaled per
    sample. ``x``: inputs already padded for non-zero padding modes, 2-D (1-D convs as height
    1); one ``(x, g)`` pair per call of the layer.

    It never holds the ``prod(kernel)``-times-larger patches of the unfold route, but it is
    slower on CUDA: the benchmark CNN's graphed DP-SGD step got slower with conv1 (1->32
    channels) on this route, though conv1's norms alone were faster
    (``benchmarks/conv_norms.py``), and cuDNN's batch-as-groups kernel is far slower than the
    unfold GEMMs for conv2 (32->64); see ``benchmarks/README.md``. Hence opt-in:
    ``make_ghost_model(conv_method="grouped")``.
    """

    def __init__(self, pairs: list[tuple[Tensor, Tensor]], geometry: tuple[Any, ...],
                 groups: int, weight_shape: torch.Size, bias: bool) -> None:
        self.pairs = [_common(x, g) for x, g in pairs]
        self.stride, self.padding, self.dilation, self.kernel = geometry
        self.groups, self.weight_shape, self.bias = groups, weight_shape, bias

    def _wgrad(self, x: Tensor, g: Tensor, groups: int) -> Tensor:
        c_out = g.shape[1]
        weight = x.new_empty(c_out, x.shape[1] // groups, *self.kernel)  # only its shape is read
        _, dw, _ = torch.ops.aten.convolution_backward(
            g, x, weight, None, list(self.stride), list(self.padding), list(self.dilation),
            False, [0, 0], groups, [False, True, False])
        return dw

    def _per_sample_weight(self) -> Tensor:
        """``(B, C_out * C_in/groups * prod(k))``: every sample's weight gradient, flat."""
        total: Tensor | None = None
        for x, g in self.pairs:
            b = x.shape[0]
            dw = self._wgrad(x.reshape(1, b * x.shape[1], *x.shape[2:]),
                             g.reshape(1, b * g.shape[1], *g.shape[2:]), b * self.groups)
            dw = dw.reshape(b, -1)
            total = dw if total is None else total + dw
        assert total is not None
        return total

    def _bias_per_sample(self) -> Tensor:
        return sum(g.sum((2, 3)) for _, g in self.pairs)  # type: ignore[return-value]

    def sq_norms(self) -> Tensor:
        out = _sq_norm_dtype(self._per_sample_weight()).square().sum(1)
        return (out + _sq_norm_dtype(self._bias_per_sample()).square().sum(1) if self.bias
                else out)

    def weighted_sum(self, coef: Tensor) -> TensorDict:
        c = _coef(coef, self.pairs[0][1])[:, None, None, None]
        scaled = [(x, g * c) for x, g in self.pairs]
        w = sum(self._wgrad(x, gc, self.groups) for x, gc in scaled)
        out = {"weight": w.reshape(self.weight_shape)}  # type: ignore[union-attr]
        if self.bias:
            out["bias"] = sum(gc.sum((0, 2, 3)) for _, gc in scaled)  # type: ignore[assignment]
        return out

    def materialize(self) -> TensorDict:
        w = self._per_sample_weight()
        out = {"weight": w.reshape(w.shape[0], *self.weight_shape)}
        if self.bias:
            out["bias"] = self._bias_per_sample()
        return out


class ConvRule(Rule):
    """``nn.Conv1d`` / ``nn.Conv2d`` (1-D as height-1 2-D), by one of two routes.

    ``"unfold"``: the input unfolded into patches, then the linear-layer forms;
    ``"grouped"``: weight-gradient convolutions with the batch as groups (:class:`_ConvGrouped`).
    """

    kind = "conv"
    casts_input_under_autocast = True

    def __init__(self, method: str = "unfold") -> None:
        self.method = method  # one of CONV_METHODS, checked by make_ghost_model

    def check(self, module: nn.Module, name: str) -> None:
        assert isinstance(module, (nn.Conv1d, nn.Conv2d))
        if module.padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise GhostLayerError(f"ghost layer {name!r}: unsupported padding_mode "
                                  f"{module.padding_mode!r}")

    def _geometry(self, m: nn.Conv1d | nn.Conv2d, x: Tensor, name: str
                  ) -> tuple[Tensor, tuple[tuple[int, ...], ...]]:
        """``x`` as a 2-D conv input, padded here unless zero padding is left to the conv,
        and ``(stride, padding, dilation, kernel)`` of that 2-D conv."""
        nd = 1 if isinstance(m, nn.Conv1d) else 2
        if x.dim() != nd + 2:
            raise GhostLayerError(
                f"ghost layer {name!r} ({type(m).__name__}): expected a batched input with "
                f"{nd + 2} dims (B, C, {'L' if nd == 1 else 'H, W'}), got shape "
                f"{tuple(x.shape)}"
            )
        k, s, d = _pair(m.kernel_size, nd), _pair(m.stride, nd), _pair(m.dilation, nd)
        if isinstance(m.padding, str) or m.padding_mode != "zeros":
            if m.padding == "same":
                total = [dd * (kk - 1) for dd, kk in zip(d, k, strict=True)]
                lr = [(t // 2, t - t // 2) for t in total]
            elif m.padding == "valid":
                lr = [(0, 0)] * nd
            else:
                lr = [(p, p) for p in _pair(m.padding, nd)]
            flat = [v for pair in reversed(lr) for v in pair]  # F.pad: last dim first
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            x = F.pad(x, flat, mode=mode)
            pad: tuple[int, ...] = (0,) * nd
        else:
            pad = _pair(m.padding, nd)
        if nd == 1:
            x = x.unsqueeze(2)
            k, s, d, pad = (1, *k), (1, *s), (1, *d), (0, *pad)
        return x, (s, pad, d, k)

    def prepare(self, module: nn.Module, name: str, params: TensorDict, buffers: TensorDict,
                calls: Calls, grads: Grads) -> Prepared:
        assert isinstance(module, (nn.Conv1d, nn.Conv2d))
        weight = params["weight"]
        dtype = _compute_dtype(weight.dtype, grads[0][0].dtype)  # bf16 under bf16 autocast
        inputs = [input_of(args, kwargs, self.kind, name).to(dtype) for args, kwargs in calls]
        shaped = [self._geometry(module, x, name) for x in inputs]
        geometry = shaped[0][1]
        if self.method == "grouped":
            pairs = [(x, g.to(dtype).reshape(x.shape[0], g.shape[1], -1, g.shape[-1]))
                     for (x, _), (g,) in zip(shaped, grads, strict=True)]
            return _ConvGrouped(pairs, geometry, module.groups, weight.shape, "bias" in params)
        s, pad, d, k = geometry
        unfolded = [_unfold2d(x, k, d, pad, s) for x, _ in shaped]
        if module.groups > 1:
            grouped = _grouped_per_sample(unfolded, [g.to(dtype) for (g,) in grads],
                                          module.groups, weight, "bias" in params)
            if grouped is not None:
                return grouped
        patches = [rearrange(u, "b ck l -> b l ck") for u in unfolded]  # (B, L, C*prod(k))
        gs = [rearrange(g.to(dtype), "b c ... -> b (...) c") for (g,) in grads]
        a = torch.cat(patches, 1) if len(patches) > 1 else patches[0]
        g = torch.cat(gs, 1) if len(gs) > 1 else gs[0]
        return _LinearLike(a, g, module.groups, weight.shape, "bias" in params)


def _unfold2d(x: Tensor, kernel: tuple[int, ...], dilation: tuple[int, ...],
              padding: tuple[int, ...], stride: tuple[int, ...]) -> Tensor:
    """``F.unfold(x, kernel, dilation, padding, stride)``: the ``(B, C * kh * kw, L)`` patches of
    a ``(B, C, H, W)`` input (zero padding), the same numbers in the same layout.

    Formed as a strided view of the (padded) input and copied once, so the whole batch is one
    kernel: ``F.unfold`` (im2col) runs one kernel per sample on CUDA and CPU, which for
    thousands of small images costs more host time than the per-sample GEMMs that follow.
    """
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel, dilation, padding, stride
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    b, c = x.shape[:2]
    # (B, C, H_out, W_out, span_h, span_w) windows, then every dilation-th tap: (.., kh, kw)
    v = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]
    return v.permute(0, 1, 4, 5, 2, 3).reshape(b, c * kh * kw, v.shape[2] * v.shape[3])


def _grouped_per_sample(unfolded: list[Tensor], grads: list[Tensor], groups: int,
                        weight: Tensor, bias: bool) -> Instantiated | None:
    """Per-sample gradients of a grouped (e.g. depthwise) conv, all groups in one batched
    GEMM from the ``(B, C_in * prod(k), L)`` patches, or None where the Gram form is cheaper.

    Per group the weight is ``(o, k)`` with ``o = C_out / groups``, ``k = C_in / groups *
    prod(kernel)``; materialising ``(B, groups, o, k)`` costs ``B L C_out k`` multiply-adds
    against the Gram form's ``B groups L^2 (k + o)``, so it wins unless ``L (k + o) <= k o``
    (always for depthwise convs, ``o = 1``). The patches stay in their unfold layout, and no
    ``(B groups, L, k)`` copy is made.
    """
    b, c_k = unfolded[0].shape[:2]
    c_out = weight.shape[0]
    k, o = c_k // groups, c_out // groups
    total_length = sum(u.shape[-1] for u in unfolded)
    if gram_is_cheaper(total_length, k, o):
        return None
    w: Tensor | None = None
    bias_sum: Tensor | None = None
    for u, g in zip(unfolded, grads, strict=True):
        u, g = _common(u, g)
        g = g.reshape(b, c_out, -1)  # (B, C_out, L)
        part = torch.matmul(g.reshape(b, groups, o, -1), u.reshape(b, groups, k, -1).mT)
        w = part if w is None else w + part
        if bias:
            s = g.sum(-1)
            bias_sum = s if bias_sum is None else bias_sum + s
    assert w is not None
    out = {"weight": w.reshape(b, *weight.shape)}
    if bias_sum is not None:
        out["bias"] = bias_sum
    return Instantiated(out)


class _EmbeddingGrads(Prepared):
    def __init__(self, ids: Tensor, g: Tensor, num_embeddings: int) -> None:
        self.ids, self.g, self.n = ids, g, num_embeddings  # (B, T), (B, T, D); padding zeroed

    def sq_norms(self) -> Tensor:
        # ||G_i||^2 = sum over distinct ids v of ||sum_{t: id_t = v} g_t||^2: sort each sample's
        # ids, number the runs of equal ids, sum g within runs, square, sum.
        ids, order = torch.sort(self.ids, dim=1)
        g = torch.gather(self.g, 1, order[..., None].expand_as(self.g))
        new_run = torch.ones_like(ids, dtype=torch.bool)
        new_run[:, 1:] = ids[:, 1:] != ids[:, :-1]
        run = torch.cumsum(new_run.long(), 1) - 1
        sums = torch.zeros_like(g).scatter_add(1, run[..., None].expand_as(g), g)
        return sums.flatten(1).square().sum(1)

    def weighted_sum(self, coef: Tensor) -> TensorDict:
        d = self.g.shape[-1]
        src = (self.g * _coef(coef, self.g)[:, None, None]).reshape(-1, d)
        w = self.g.new_zeros(self.n, d).index_add(0, self.ids.reshape(-1), src)
        return {"weight": w}

    def materialize(self) -> TensorDict:
        b, _, d = self.g.shape
        idx = self.ids[..., None].expand_as(self.g)
        return {"weight": self.g.new_zeros(b, self.n, d).scatter_add(1, idx, self.g)}


class EmbeddingRule(Rule):
    kind = "embedding"

    def check(self, module: nn.Module, name: str) -> None:
        assert isinstance(module, nn.Embedding)
        if module.max_norm is not None:
            raise GhostLayerError(
                f"ghost layer {name!r}: nn.Embedding(max_norm={module.max_norm}) renormalises "
                "its weight in place during the forward, which per-sample gradients (and "
                "pure functions) cannot follow; use max_norm=None"
            )
        if module.scale_grad_by_freq:
            raise GhostLayerError(
                f"ghost layer {name!r}: nn.Embedding(scale_grad_by_freq=True) scales gradients "
                "by word counts over the whole batch, which mixes samples; per-sample "
                "gradients are undefined. Use scale_grad_by_freq=False"
            )

    def prepare(self, module: nn.Module, name: str, params: TensorDict, buffers: TensorDict,
                calls: Calls, grads: Grads) -> Prepared:
        assert isinstance(module, nn.Embedding)
        weight = params["weight"]
        all_ids, all_g = [], []
        for (args, kwargs), (g,) in zip(calls, grads, strict=True):
            ids = input_of(args, kwargs, self.kind, name)
            if ids.dim() < 1:
                raise GhostLayerError(f"ghost layer {name!r} (Embedding): expected batched ids "
                                      f"(B, ...), got shape {tuple(ids.shape)}")
            b = ids.shape[0]
            ids, g = ids.reshape(b, -1), g.to(weight.dtype).reshape(b, -1, weight.shape[1])
            if module.padding_idx is not None:
                g = g * (ids != module.padding_idx)[..., None].to(g.dtype)
            all_ids.append(ids)
            all_g.append(g)
        ids = torch.cat(all_ids, 1) if len(all_ids) > 1 else all_ids[0]
        g = torch.cat(all_g, 1) if len(all_g) > 1 else all_g[0]
        return _EmbeddingGrads(ids, g, module.num_embeddings)


def batch_dims_ok(calls: Calls, grads: Grads, batch: int) -> str | None:
    """Return a description of the first recorded output whose dim 0 is not ``batch``."""
    for k, g in enumerate(grads):
        for t in g:
            if t.dim() == 0 or t.shape[0] != batch:
                return f"call {k} has an output of shape {tuple(t.shape)}"
    return None


def local(d: Mapping[str, Tensor], names: Mapping[str, str]) -> TensorDict:
    """``{local: d[global]}`` for a ``{local: global}`` name map."""
    return {loc: d[glob] for loc, glob in names.items()}
