"""Ghost rule of torchfn's recurrent layers (``RNN``, ``GRU``, ``LSTM``): exact linear forms.

Every weight of a recurrent layer enters through a linear map applied at every time step:
``gi_t = W_ih x_t + b_ih``, ``gh_t = W_hh h_{t-1} + b_hh`` and, for an LSTM with a projection,
``h_t = W_hr m_t``. So sample ``i``'s gradient of ``W_ih`` is ``sum_t dgi_it^T x_it``, of
``W_hh`` ``sum_t dgh_it^T h_{i,t-1}``, of ``W_hr`` ``sum_t dh_it^T m_it``, and the biases'
are sums over time of ``dgi``/``dgh``: the linear layer's rule with time as the sequence
axis. The gradients ``dgi``, ``dgh``, ``dh`` of every step come from one batched
recomputation of the layer (:func:`torchfn.functional.recurrent_forward` with zero probes
added to those pre-activations) and one ``vjp`` of it with the recorded output gradients; no
per-sample ``vmap``. Each sample's rows only see that sample, so the result is exact.

Inter-layer dropout in training mode would be drawn again by the recomputation (different
masks): refused with :class:`GhostLayerError`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from torchfn.functional import GRU, LSTM, RNN, recurrent_forward
from torchfn.persample._ghost_layers import (
    Calls,
    GhostLayerError,
    Grads,
    Prepared,
    Rule,
    TensorDict,
    _LinearLike,
)
from torchfn.persample._ghost_tape import tensors_of

__all__: list[str] = []  # private to torchfn.persample

RECURRENT_TYPES: tuple[type[nn.Module], ...] = (RNN, GRU, LSTM)


class _RecurrentGrads(Prepared):
    """Several linear forms, each owning some of the layer's parameters under local names."""

    def __init__(self, parts: list[tuple[Prepared, dict[str, str]]]) -> None:
        self.parts = parts  # (linear form, {"weight": local name[, "bias": local name]})

    def expect_weighted_sum(self) -> None:
        for part, _ in self.parts:
            part.expect_weighted_sum()

    def linear_parts(self) -> list[_LinearLike] | None:
        parts = [part for part, _ in self.parts]
        return parts if all(type(p) is _LinearLike for p in parts) else None  # type: ignore[misc]

    def sq_norms(self) -> Tensor:
        total = self.parts[0][0].sq_norms()
        for part, _ in self.parts[1:]:
            total = total + part.sq_norms()
        return total

    def weighted_sum(self, coef: Tensor) -> TensorDict:
        return {names[k]: v for part, names in self.parts
                for k, v in part.weighted_sum(coef).items()}

    def materialize(self) -> TensorDict:
        return {names[k]: v for part, names in self.parts for k, v in part.materialize().items()}


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> tuple[Tensor, Any]:
    extra = set(kwargs) - {"input", "hx"}
    if len(args) > 2 or extra or (not args and "input" not in kwargs):
        raise GhostLayerError(f"ghost layer {name!r} (recurrent): expected a call "
                              f"layer(input[, hx]), got {len(args)} positional and "
                              f"{sorted(kwargs)} keyword arguments")
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    return x, hx


class RecurrentRule(Rule):
    """torchfn's ``RNN``/``GRU``/``LSTM``: linear forms per weight (see the module doc)."""

    kind = "recurrent"
    expands_shared_calls = False  # h_n/c_n are (layers * directions, B, H)

    def batch_dims_ok(self, module: nn.Module, calls: Calls, grads: Grads,
                      batch: int) -> str | None:
        first = bool(getattr(module, "batch_first", False))
        for k, ((args, kwargs), g) in enumerate(zip(calls, grads, strict=True)):
            try:
                x, _ = _inputs(args, kwargs, type(module).__name__)
            except GhostLayerError as e:
                return str(e)
            if not isinstance(x, Tensor) or x.dim() != 3:
                seen = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                return f"call {k} has an unbatched input ({seen})"
            # output: batch in dim 0 (batch_first) or 1; h_n, c_n: batch in dim 1
            dims = [0 if first else 1] + [1] * (len(g) - 1)
            for t, d in zip(g, dims, strict=True):
                if t.dim() <= d or t.shape[d] != batch:
                    return f"call {k} has an output of shape {tuple(t.shape)} (batch dim {d})"
        return None

    def prepare(self, module: nn.Module, name: str, params: TensorDict, buffers: TensorDict,
                calls: Calls, grads: Grads) -> Prepared:
        assert isinstance(module, RECURRENT_TYPES)
        if module.training and module.dropout > 0 and module.num_layers > 1:
            raise GhostLayerError(
                f"ghost layer {name!r} ({type(module).__name__}): inter-layer dropout "
                f"(dropout={module.dropout}) in training mode; the ghost rule recomputes the "
                "layer, which would draw other dropout masks. Use dropout=0, call eval(), or "
                "stack single-layer recurrent modules with nn.Dropout between them"
            )
        dirs = 2 if module.bidirectional else 1
        keys = [f"l{k}{'_reverse' if d else ''}" for k in range(module.num_layers)
                for d in range(dirs)]
        gate = params[f"weight_ih_{keys[0]}"].shape[0]
        dtype = params[f"weight_ih_{keys[0]}"].dtype
        pairs: dict[str, dict[str, list[tuple[Tensor, Tensor]]]] = {
            key: {"ih": [], "hh": [], "hr": []} for key in keys}
        for (args, kwargs), g in zip(calls, grads, strict=True):
            x, hx = _inputs(args, kwargs, name)
            seq_len, batch = (x.shape[1], x.shape[0]) if module.batch_first else x.shape[:2]
            probes = {}
            for key in keys:
                pr = {"ih": x.new_zeros(seq_len, batch, gate, dtype=dtype),
                      "hh": x.new_zeros(seq_len, batch, gate, dtype=dtype)}
                if module.proj_size:
                    pr["hr"] = x.new_zeros(seq_len, batch, module.proj_size, dtype=dtype)
                probes[key] = pr

            def f(pr: dict[str, dict[str, Tensor]], x: Tensor = x, hx: Any = hx
                  ) -> tuple[list[Tensor], dict[str, dict[str, Tensor]]]:
                out, hidden, rec = recurrent_forward(module, params, x, hx, probes=pr,
                                                     record=True)
                return [t for t in tensors_of((out, hidden), []) if t.is_floating_point()], rec

            _, vjp_fn, rec = torch.func.vjp(f, probes, has_aux=True)
            (d_probes,) = vjp_fn([t.to(dtype) for t in g])
            for key in keys:
                r, dp = rec[key], d_probes[key]
                pairs[key]["ih"].append((r["x"], dp["ih"]))
                pairs[key]["hh"].append((r["h_prev"], dp["hh"]))
                if module.proj_size:
                    pairs[key]["hr"].append((r["hr_in"], dp["hr"]))
        parts: list[tuple[Prepared, dict[str, str]]] = []
        for key in keys:
            for kind, bias in (("ih", module.bias), ("hh", module.bias),
                               ("hr", False)):
                if not pairs[key][kind]:
                    continue
                # time-major (T, B, d) per call -> batch-major (B, sum T, d)
                a = torch.cat([p[0] for p in pairs[key][kind]], 0).transpose(0, 1)
                gr = torch.cat([p[1] for p in pairs[key][kind]], 0).transpose(0, 1)
                weight = params[f"weight_{kind}_{key}"]
                names = {"weight": f"weight_{kind}_{key}"}
                if bias:
                    names["bias"] = f"bias_{kind}_{key}"
                parts.append((_LinearLike(a.to(dtype), gr.to(dtype), 1, weight.shape, bias),
                              names))
        return _RecurrentGrads(parts)
