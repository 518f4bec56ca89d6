"""grad_inner_products and tracin_scores on zoo models against explicit dot products of
per-sample gradients from a loop of torch.autograd.grad, float64 on CPU.

Rows of different kinds (tests/zoo.py): a ResNet in eval mode (convs, BatchNorm on running
statistics, a 1x1 shortcut), torch's nn.TransformerEncoder (attention, LayerNorm, embedding),
an LSTM classifier (recurrent weights) and tiny HF BERT (dict inputs, padding) and GPT-2
(Conv1D, tied wte/lm_head). Each row: the default cost rule, both inner-product routes forced
for every linear part, the train set scored in chunks, and TracIn over two checkpoints.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import zoo
from torch import Tensor

from torchfn.persample import grad_inner_products, make_ghost_model, tracin_scores

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}
N_TRAIN, N_QUERY = 5, 3
ROWS = {  # zoo row: the layer kinds its ghost model must have (what the row is here for)
    "resnet_eval": {"conv", "norm", "linear"},
    "tfm_encoder": {"attention", "norm", "linear", "embedding"},
    "lstm_cls": {"recurrent", "linear", "embedding"},
    "bert": {"linear", "embedding", "norm"},
    "gpt2": {"linear", "embedding", "norm"},
}


def _sample(inputs: Any, i: int) -> Any:
    if isinstance(inputs, Tensor):
        return inputs[i:i + 1]
    if isinstance(inputs, Mapping):
        return {k: _sample(v, i) for k, v in inputs.items()}
    return type(inputs)(_sample(v, i) for v in inputs)


def _call(ghost, params, buffers, inputs):
    if isinstance(inputs, Mapping):
        return ghost(params, buffers, **inputs)[0]
    return ghost(params, buffers, inputs)[0]


def loop_flat(ghost, params, buffers, inputs, y, loss_fn) -> Tensor:
    """(B, P): every sample's gradient over the trainable parameters, by autograd.grad."""
    names = [k for k in params if k not in ghost.frozen]
    rows = []
    for i in range(y.shape[0]):
        p = {k: v.clone().requires_grad_(k in names) for k, v in params.items()}
        loss = loss_fn(_call(ghost, p, buffers, _sample(inputs, i)), y[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, [p[k] for k in names], allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p[k]) if g is None else g).flatten()
                               for k, g in zip(names, grads, strict=True)]))
    return torch.stack(rows)


def _setup(name: str):
    for pkg in zoo.NEEDS.get(name, ()):
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"zoo row {name!r} needs {pkg}")
    entry = zoo.build(name)
    ghost, params, buffers = make_ghost_model(entry.module)
    assert ROWS[name] <= set(ghost.layer_kinds.values()), ghost.layer_kinds
    assert "fallback" not in ghost.layer_kinds.values(), ghost.layer_kinds
    xs, ys = entry.batch(N_TRAIN, 1)
    xq, yq = entry.batch(N_QUERY, 2)
    return ghost, params, buffers, xs, ys, xq, yq, entry.loss_fn


@pytest.mark.parametrize("name", list(ROWS))
def test_zoo_inner_products_and_tracin_equal_explicit_dot_products(name: str,
                                                                   monkeypatch) -> None:
    from torchfn.persample import _ghost_grads

    ghost, params, buffers, xs, ys, xq, yq, loss = _setup(name)
    later = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v
             for k, v in params.items()}
    refs = [loop_flat(ghost, w, buffers, xs, ys, loss) @ loop_flat(ghost, w, buffers, xq, yq,
                                                                   loss).T
            for w in (params, later)]
    got = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
    assert got.shape == (N_TRAIN, N_QUERY) and got.dtype == F64
    assert refs[0].abs().max() > 1e-6  # not a trivial zero comparison
    torch.testing.assert_close(got, refs[0], **TOL)
    per_layer = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq,
                                    per_layer=True, chunk_size=2)
    torch.testing.assert_close(sum(per_layer.values()), refs[0], **TOL)
    tracin = tracin_scores(ghost, loss, [params, later], [0.3, 0.1], buffers, xs, ys, xq, yq,
                           chunk_size=3)
    torch.testing.assert_close(tracin, 0.3 * refs[0] + 0.1 * refs[1], **TOL)
    for route in ("ghost", "materialize"):  # each form on every linear part
        seen: list[str] = []
        monkeypatch.setattr(_ghost_grads, "inner_route",
                            lambda x, y, r=route, s=seen: s.append(r) or r)
        forced = grad_inner_products(ghost, loss, params, buffers, xs, ys, xq, yq)
        torch.testing.assert_close(forced, refs[0], **TOL, msg=route)
        assert seen, f"{name}: no linear part took the {route} route"
