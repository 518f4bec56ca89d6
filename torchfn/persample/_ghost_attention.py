"""Ghost rule of ``nn.MultiheadAttention``: its projections by the linear forms, exactly.

An ``nn.MultiheadAttention(batch_first=True)`` layer (fused ``in_proj_weight`` ``(3E, E)``,
``out_proj`` ``(E, E)``; e.g. inside ``nn.TransformerEncoderLayer``/``DecoderLayer``) is one
ghost layer: the tape sees its inputs ``query, key, value`` and masks and the gradient ``g``
of its output ``y``, not what happens inside. :class:`AttentionRule` recomputes the inside
from those, batched (no per-sample loop): the projections ``q, k, v = x W_{q,k,v}^T + b``,
the attention output ``o = softmax(q k^T / sqrt(d) + mask) v`` per head, and -- by one
``vjp`` of the attention core (``(q, k, v) -> o``, plus the returned attention weights when
``need_weights=True``) at the cotangent ``g W_o`` -- the gradients ``g_q, g_k, g_v`` at the
projection outputs. Then every parameter is a linear map with known input and output
gradient, and the linear rule's forms apply: ``out_proj`` with ``(o, g)``, and the three row
blocks of ``in_proj`` with ``(query, g_q)``, ``(key, g_k)``, ``(value, g_v)`` (the blocks are
disjoint rows, so the squared norms add). Cost: one extra forward and backward of the
attention core per call, instead of the vmap fallback's per-sample ``(4 E^2)`` gradients.

Handled: key padding masks and attention masks (bool or float, 2-D ``(L, S)`` or 3-D
``(B H, L, S)``), ``is_causal``, ``need_weights`` with or without head averaging, dropout 0
or eval mode. Other settings (``add_bias_kv``, ``add_zero_attn``, separate ``kdim``/``vdim``
weights) stay on the vmap fallback; dropout in training mode is refused (the recomputation
cannot redraw the same mask).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchfn.persample._ghost_layers import (
    Calls,
    GhostLayerError,
    Grads,
    Prepared,
    Rule,
    TensorDict,
    _cat_time,
    _LinearLike,
)

__all__: list[str] = []  # private to torchfn.persample._ghost_instantiated

_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
         "average_attn_weights", "is_causal")
_DEFAULTS: dict[str, Any] = {"key_padding_mask": None, "need_weights": True,
                             "attn_mask": None, "average_attn_weights": True,
                             "is_causal": False}


def attention_rule_applies(module: nn.Module) -> bool:
    """Whether :class:`AttentionRule` handles this ``nn.MultiheadAttention``."""
    return (type(module) is nn.MultiheadAttention and module.batch_first
            and module._qkv_same_embed_dim and module.bias_k is None
            and not module.add_zero_attn)


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> dict[str, Any]:
    if len(args) > len(_ARGS) or any(k not in _ARGS for k in kwargs):
        raise GhostLayerError(f"ghost layer {name!r} (MultiheadAttention): unexpected arguments "
                              f"{len(args)} positional, {sorted(kwargs)} keyword")
    out = dict(_DEFAULTS)
    out.update(zip(_ARGS[: len(args)], args, strict=True))
    out.update(kwargs)
    return out


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A bool (True = masked) or float mask as a float mask to add to the scores."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf"))
    return mask.to(dtype)


def _mask(call: dict[str, Any], b: int, h: int, length: int, s: int, dtype: torch.dtype,
          device: torch.device) -> Tensor | None:
    """The additive mask of ``F.multi_head_attention_forward``, broadcastable to
    ``(B, H, L, S)``."""
    kpm = _additive(call["key_padding_mask"], dtype)
    if call["is_causal"] and kpm is None and not call["need_weights"]:
        causal = torch.ones(length, s, dtype=torch.bool, device=device).tril()
        return _additive(~causal, dtype)
    mask = _additive(call["attn_mask"], dtype)
    if mask is not None and mask.dim() == 3:
        mask = mask.reshape(b, h, length, s)
    if kpm is not None:
        kpm = kpm.reshape(b, 1, 1, s)
        mask = kpm if mask is None else mask + kpm
    return mask


class _Blocks(Prepared):
    """The four linear maps of an attention layer, reported under its parameter names."""

    def __init__(self, blocks: list[_LinearLike], out: _LinearLike, bias: bool) -> None:
        self.blocks, self.out, self.bias = blocks, out, bias  # blocks: q, k, v rows of in_proj

    def expect_weighted_sum(self) -> None:
        for p in (*self.blocks, self.out):
            p.expect_weighted_sum()

    def linear_parts(self) -> list[_LinearLike]:
        return [*self.blocks, self.out]

    def sq_norms(self) -> Tensor:
        total = self.out.sq_norms()
        for p in self.blocks:
            total = total + p.sq_norms()
        return total

    def _merge(self, parts: list[TensorDict], out: TensorDict, dim: int) -> TensorDict:
        merged = {"in_proj_weight": torch.cat([p["weight"] for p in parts], dim),
                  "out_proj.weight": out["weight"]}
        if self.bias:
            merged["in_proj_bias"] = torch.cat([p["bias"] for p in parts], dim)
            merged["out_proj.bias"] = out["bias"]
        return merged

    def weighted_sum(self, coef: Tensor) -> TensorDict:
        return self._merge([p.weighted_sum(coef) for p in self.blocks],
                           self.out.weighted_sum(coef), 0)

    def weighted_sum_parts(self, coef: Tensor) -> tuple[TensorDict, TensorDict]:
        sums = {"in_proj_weight": torch.cat([p.weight_sum(coef) for p in self.blocks], 0),
                "out_proj.weight": self.out.weight_sum(coef)}
        parts = {}
        if self.bias:
            parts["in_proj_bias"] = torch.cat([p.per_sample_bias() for p in self.blocks], 1)
        if self.out.bias:
            parts["out_proj.bias"] = self.out.per_sample_bias()
        return sums, parts

    def materialize(self) -> TensorDict:
        return self._merge([p.materialize() for p in self.blocks], self.out.materialize(), 1)


class AttentionRule(Rule):
    """``nn.MultiheadAttention(batch_first=True)`` with fused QKV weights (see module doc)."""

    kind = "attention"

    def prepare(self, module: nn.Module, name: str, params: TensorDict, buffers: TensorDict,
                calls: Calls, grads: Grads) -> Prepared:
        assert isinstance(module, nn.MultiheadAttention)
        if module.training and module.dropout > 0:
            raise GhostLayerError(
                f"ghost layer {name!r} (MultiheadAttention): dropout={module.dropout} in "
                "training mode draws random numbers that the ghost rule cannot redraw. Set "
                "its dropout to 0 or call eval()"
            )
        w_in, w_out = params["in_proj_weight"], params["out_proj.weight"]
        b_in, b_out = params.get("in_proj_bias"), params.get("out_proj.bias")
        bias = b_in is not None
        e, h = module.embed_dim, module.num_heads
        streams: list[list[tuple[Tensor, Tensor]]] = [[], [], []]
        outs: list[tuple[Tensor, Tensor]] = []
        for (args, kwargs), g in zip(calls, grads, strict=True):
            call = _bind(args, kwargs, name)
            xs = [call[k].to(w_in.dtype) for k in ("query", "key", "value")]
            if any(x.dim() != 3 for x in xs):
                raise GhostLayerError(
                    f"ghost layer {name!r} (MultiheadAttention): expected batched (B, L, E) "
                    f"query/key/value, got shapes {[tuple(x.shape) for x in xs]}")
            b, length, s = xs[0].shape[0], xs[0].shape[1], xs[1].shape[1]
            wq, wk, wv = w_in.chunk(3)
            bq, bk, bv = b_in.chunk(3) if b_in is not None else (None, None, None)
            q, k, v = F.linear(xs[0], wq, bq), F.linear(xs[1], wk, bk), F.linear(xs[2], wv, bv)
            mask = _mask(call, b, h, length, s, w_in.dtype, w_in.device)
            want_w = bool(call["need_weights"])

            def core(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = mask,
                     want_w: bool = want_w, avg: bool = bool(call["average_attn_weights"])
                     ) -> tuple[Tensor, ...]:
                qh, kh, vh = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))
                scores = qh @ kh.transpose(-1, -2) / math.sqrt(qh.shape[-1])
                if mask is not None:
                    scores = scores + mask
                p = torch.softmax(scores, -1)  # (B, H, L, S)
                o = (p @ vh).transpose(1, 2).flatten(2)  # (B, L, E)
                if not want_w:
                    return (o,)
                return (o, p.mean(1) if avg else p)

            primal, vjp_fn = torch.func.vjp(core, q, k, v)
            g_y = g[0].to(w_in.dtype)
            cot = [g_y @ w_out]
            if want_w:
                cot.append(g[1].to(w_in.dtype) if len(g) > 1 else torch.zeros_like(primal[1]))
            g_q, g_k, g_v = vjp_fn(tuple(cot))
            for stream, pair in zip(streams, ((xs[0], g_q), (xs[1], g_k), (xs[2], g_v)),
                                    strict=True):
                stream.append(pair)
            outs.append((primal[0].detach(), g_y))
        blocks = [_LinearLike(*_cat_time(st), 1, torch.Size((e, e)), bias) for st in streams]
        out = _LinearLike(*_cat_time(outs), 1, w_out.shape, b_out is not None)
        return _Blocks(blocks, out, bias)
