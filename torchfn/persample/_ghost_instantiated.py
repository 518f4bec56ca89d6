"""Ghost rules that instantiate per-sample gradients: normalisation layers and the fallback.

- ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, and ``nn.BatchNorm1d/2d/3d`` in eval
  mode (running statistics; training mode is refused earlier) (:class:`NormRule`): the
  parameters are small, so the per-sample gradients are formed from the normalised input
  ``x_hat`` and the output gradient ``g``: ``sum_pos g * x_hat`` (weight), ``sum_pos g`` (bias).
- any other parameterised layer (:class:`FallbackRule`): a ``vjp`` of the layer's own forward
  at each sample's inputs with that sample's ``g``, under ``vmap`` (``randomness="error"``:
  the layer is recomputed, so it must be deterministic).
- the parameters a module owns beside child layers (:class:`DirectRule`, kind ``"direct"``):
  the same per-sample ``vjp``, with respect to those parameters only.

:func:`rule_for` picks the rule of a module (exact built-in types -- also
``nn.MultiheadAttention(batch_first=True)`` with fused QKV weights, whose projections get
linear forms (:mod:`torchfn.persample._ghost_attention`) --, and HF transformers' ``Conv1D`` recognised by its module path and name, ``transformers.pytorch_utils.Conv1D``,
without importing transformers; anything else with parameters, subclasses included, gets
the fallback).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from torchfn.persample._ghost_attention import AttentionRule, attention_rule_applies
from torchfn.persample._ghost_layers import (
    Calls,
    ConvRule,
    EmbeddingRule,
    GhostLayerError,
    Grads,
    Instantiated,
    LinearRule,
    Prepared,
    Rule,
    TensorDict,
    input_of,
)
from torchfn.persample._ghost_recurrent import RECURRENT_TYPES, RecurrentRule
from torchfn.persample._ghost_tape import fill_slots, tensors_of

__all__: list[str] = []  # private to torchfn.persample._ghost_norms

_RMSNorm = getattr(nn, "RMSNorm", None)
_NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented the batching"
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d
) + ((_RMSNorm,) if _RMSNorm is not None else ())


def _sum_calls(per_call: list[TensorDict]) -> TensorDict:
    out = dict(per_call[0])
    for d in per_call[1:]:
        out = {k: out[k] + d[k] for k in out}
    return out


def _affine_grads(g: Tensor, x_hat: Tensor, params: TensorDict, reduce: Callable[[Tensor],
                  Tensor]) -> TensorDict:
    out = {}
    if "weight" in params:
        out["weight"] = reduce(g * x_hat).to(params["weight"].dtype)
    if "bias" in params:
        out["bias"] = reduce(g).to(params["bias"].dtype)
    return out


class NormRule(Rule):
    """LayerNorm, RMSNorm, GroupNorm, eval BatchNorm: instantiate from ``x_hat`` and ``g``."""

    kind = "norm"

    def prepare(self, module: nn.Module, name: str, params: TensorDict, buffers: TensorDict,
                calls: Calls, grads: Grads) -> Prepared:
        per_call = []
        for (args, kwargs), (g,) in zip(calls, grads, strict=True):
            x = input_of(args, kwargs, type(module).__name__, name)
            dtype = torch.promote_types(x.dtype, torch.float32)
            x, g = x.to(dtype), g.to(dtype)
            if isinstance(module, nn.modules.batchnorm._BatchNorm):  # eval: running stats
                shape = (1, -1) + (1,) * (x.dim() - 2)
                mean = buffers["running_mean"].to(dtype).reshape(shape)
                var = buffers["running_var"].to(dtype).reshape(shape)
                x_hat = (x - mean) * torch.rsqrt(var + module.eps)

                def reduce(t: Tensor) -> Tensor:
                    return t.reshape(t.shape[0], t.shape[1], -1).sum(-1)
            elif isinstance(module, nn.GroupNorm):
                if x.dim() < 2:
                    raise GhostLayerError(f"ghost layer {name!r} (GroupNorm): expected (B, C, "
                                          f"...), got shape {tuple(x.shape)}")
                xr = x.reshape(x.shape[0], module.num_groups, -1)
                var, mean = torch.var_mean(xr, dim=-1, keepdim=True, correction=0)
                x_hat = ((xr - mean) * torch.rsqrt(var + module.eps)).reshape(x.shape)

                def reduce(t: Tensor) -> Tensor:
                    return t.reshape(t.shape[0], t.shape[1], -1).sum(-1)
            else:
                shape = tuple(module.normalized_shape)  # type: ignore[arg-type]
                dims = tuple(range(-len(shape), 0))
                if x.dim() < len(shape) + 1 or tuple(x.shape[-len(shape):]) != shape:
                    raise GhostLayerError(
                        f"ghost layer {name!r} ({type(module).__name__}): expected a batched "
                        f"input (B, ..., *{shape}), got shape {tuple(x.shape)}"
                    )
                if isinstance(module, nn.LayerNorm):
                    var, mean = torch.var_mean(x, dim=dims, keepdim=True, correction=0)
                    x_hat = (x - mean) * torch.rsqrt(var + module.eps)
                else:
                    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
                    x_hat = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
                n_lead = x.dim() - len(shape)

                def reduce(t: Tensor, n_lead: int = n_lead) -> Tensor:
                    return t.sum(tuple(range(1, n_lead))) if n_lead > 1 else t
            per_call.append(_affine_grads(g, x_hat, params, reduce))
        return Instantiated(_sum_calls(per_call))


def _float_leaves(tree: Any) -> list[Tensor]:
    return [t for t in tensors_of(tree, []) if t.is_floating_point()]


class FallbackRule(Rule):
    """Any other parameterised layer: per-sample vjp of its own forward under ``vmap``."""

    kind = "fallback"

    def __init__(self, chunk_size: int | None = None) -> None:
        self.chunk_size = chunk_size

    def check(self, module: nn.Module, name: str) -> None:
        if isinstance(module, nn.MultiheadAttention) and not module.batch_first:
            raise GhostLayerError(
                f"ghost layer {name!r}: nn.MultiheadAttention(batch_first=False) takes the "
                "batch in dim 1; ghost per-sample gradients need the batch in dim 0 "
                "everywhere. Build it with batch_first=True"
            )

    def prepare(self, module: nn.Module, name: str, params: TensorDict, buffers: TensorDict,
                calls: Calls, grads: Grads) -> Prepared:
        per_call = []
        for (args, kwargs), g in zip(calls, grads, strict=True):
            batch = g[0].shape[0]
            leaves = tensors_of((args, kwargs), [])
            mapped = [i for i, t in enumerate(leaves)
                      if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == batch]
            if not mapped:
                raise GhostLayerError(
                    f"ghost layer {name!r} ({type(module).__name__}, vmap fallback): none of "
                    f"its inputs has the batch size {batch} in dim 0"
                )

            def one_sample(p: TensorDict, xs: list[Tensor], gs: list[Tensor],
                           leaves: list[Tensor] = leaves, call: Any = (args, kwargs),
                           mapped: list[int] = mapped) -> TensorDict:
                full = list(leaves)
                for i, x in zip(mapped, xs, strict=True):
                    full[i] = x.unsqueeze(0)
                a, kw = fill_slots(call, iter(full))

                def f(p: TensorDict) -> list[Tensor]:
                    out = torch.func.functional_call(module, {**p, **buffers}, a, kw)
                    return _float_leaves(out)

                _, vjp_fn = torch.func.vjp(f, p)
                return vjp_fn([x.unsqueeze(0) for x in gs])[0]

            mapped_fn = torch.func.vmap(one_sample, in_dims=(None, 0, 0), randomness="error",
                                        chunk_size=self.chunk_size)
            try:
                if torch.compiler.is_compiling():
                    psg = mapped_fn(params, [leaves[i] for i in mapped], list(g))
                else:  # the fallback is the slow path by design; torch's note says so again
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", _NO_BATCHING_RULE, UserWarning)
                        psg = mapped_fn(params, [leaves[i] for i in mapped], list(g))
                per_call.append(psg)
            except RuntimeError as e:
                if "randomness" in str(e):
                    raise GhostLayerError(
                        f"ghost layer {name!r} ({type(module).__name__}): the vmap fallback "
                        "recomputes this layer per sample, so it must be deterministic, but "
                        "it draws random numbers (dropout inside it?). Set its dropout to 0 "
                        f"or call eval(). ({e})"
                    ) from e
                raise
        return Instantiated(_sum_calls(per_call))


def _is_hf_conv1d(t: type) -> bool:
    """Whether ``t`` is HF transformers' ``Conv1D`` (recognised by name: torchfn does not
    import transformers; the class is exact, its forward ``x @ W + b`` with ``W (nx, nf)``)."""
    return t.__module__ == "transformers.pytorch_utils" and t.__qualname__ == "Conv1D"


class DirectRule(FallbackRule):
    """The parameters a module owns directly, beside child layers that keep their own rules.

    The module's tap records its calls and output gradients (its children's taps record in
    the same pass); the direct parameters' per-sample gradients are a per-sample ``vjp`` of
    the module's own forward with respect to them only, under ``vmap`` (the children run
    untapped, with their parameters as constants): exact, and the children stay ghost.
    """

    kind = "direct"

    def check(self, module: nn.Module, name: str) -> None:
        """Nothing to refuse: the children are checked as layers of their own."""


def rule_for(module: nn.Module, fallback_chunk_size: int | None = None,
             conv_method: str = "unfold") -> Rule:
    """Return the rule for ``module`` (exact built-in types only; subclasses use the fallback)."""
    t = type(module)
    if t is nn.Linear or t is nn.modules.linear.NonDynamicallyQuantizableLinear:
        return LinearRule()
    if _is_hf_conv1d(t):
        return LinearRule(transposed=True)
    if t in (nn.Conv1d, nn.Conv2d):
        return ConvRule(conv_method)
    if t is nn.Embedding:
        return EmbeddingRule()
    if attention_rule_applies(module):
        return AttentionRule()
    if t in NORM_TYPES:
        return NormRule()
    if t in RECURRENT_TYPES:  # torchfn's RNN/GRU/LSTM (make_ghost_model swaps torch's in)
        return RecurrentRule()
    return FallbackRule(fallback_chunk_size)


def refuse_batchnorm_training(module: nn.Module, name: str) -> None:
    for sub_name, sub in module.named_modules():
        if not isinstance(sub, nn.modules.batchnorm._BatchNorm):
            continue
        where = ".".join(p for p in (name, sub_name) if p) or "<root>"
        if sub.training or sub.running_mean is None:
            mode = "in training mode" if sub.training else "without running statistics"
            raise GhostLayerError(
                f"make_ghost_model: {where!r} is a {type(sub).__name__} {mode}, which "
                "normalises with statistics of the whole batch, so per-sample gradients are "
                "undefined (and DP-SGD's analysis fails). Use GroupNorm/LayerNorm, or call "
                ".eval() on it (with track_running_stats=True) to use fixed running statistics"
            )
