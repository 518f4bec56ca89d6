"""The thin-matmul Inductor pass: thin mm/bmm become broadcast-multiply + sum, same values."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from torchfn.functional import ThinMatmulPass, decompose_thin_matmuls, thin_matmul_options

aten = torch.ops.aten


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("shapes", [
    ((7, 40), (40, 3)),            # mm, N tiny (a 3-class output layer)
    ((5, 7, 40), (5, 40, 3)),      # bmm, N tiny (ensemble output layer)
    ((5, 3, 64), (5, 64, 40)),     # bmm, M tiny (dW of the output layer)
    ((5, 64, 3), (5, 3, 40)),      # bmm, K tiny (dX through the output layer)
])
def test_thin_products_are_rewritten_and_equal_the_gemm_in_float64(shapes):
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
    gm = make_fx(torch.matmul, tracing_mode="fake")(a, b)
    assert any(t in (aten.mm.default, aten.bmm.default) for t in _targets(gm))
    assert decompose_thin_matmuls(gm.graph, max_dim=4) == 1
    gm.recompile()
    assert not any(t in (aten.mm.default, aten.bmm.default) for t in _targets(gm))
    assert aten.sum.dim_IntList in _targets(gm)
    torch.testing.assert_close(gm(a, b), a @ b, rtol=1e-12, atol=1e-12)
    # every new node carries its fake value (later Inductor passes read meta["val"])
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert isinstance(node.meta.get("val"), torch.Tensor), node


@pytest.mark.parametrize("shapes, max_dim", [
    (((20, 32), (32, 24)), 16),       # every dimension above max_dim
    (((6, 32), (32, 24)), 5),         # the smallest (6) still above 5
])
def test_wide_products_stay_gemms(shapes, max_dim):
    a, b = (torch.randn(s) for s in shapes)
    gm = make_fx(torch.matmul, tracing_mode="fake")(a, b)
    assert decompose_thin_matmuls(gm.graph, max_dim=max_dim) == 0
    assert aten.mm.default in _targets(gm)


def test_integer_and_mixed_dtype_products_are_left_alone():
    a, b = torch.randint(5, (4, 8)), torch.randint(5, (8, 2))
    gm = make_fx(torch.matmul, tracing_mode="fake")(a, b)
    assert decompose_thin_matmuls(gm.graph) == 0


def test_bad_max_dim_is_refused():
    with pytest.raises(ValueError, match="max_dim must be an int >= 1, got 0"):
        ThinMatmulPass(0)
    with pytest.raises(ValueError, match="max_dim must be >= 1"):
        decompose_thin_matmuls(torch.fx.Graph(), max_dim=0)
    assert ThinMatmulPass(8).uuid() != ThinMatmulPass(16).uuid()


def test_compiled_with_the_pass_equals_eager_forward_and_backward():
    # a vmapped 3-layer classifier: forward and backward both contain thin bmms
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    n, b, d, h, c = 4, 6, 20, 24, 3
    w1 = torch.randn(n, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(n, c, h, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(n, b, d, generator=gen, dtype=torch.float64)

    def loss(w1, w2, x):
        hid = torch.relu(torch.bmm(x, w1.transpose(1, 2)))
        return torch.bmm(hid, w2.transpose(1, 2)).logsumexp(-1).sum()

    def grads(w1, w2, x):
        return torch.autograd.grad(loss(w1, w2, x), (w1, w2))

    rewritten = []

    class Counting(ThinMatmulPass):
        def __call__(self, graph):
            rewritten.append(decompose_thin_matmuls(graph, self.max_dim))

    compiled = torch.compile(grads, fullgraph=False,
                             options={"post_grad_custom_post_pass": Counting(4)})
    with torch._inductor.config.patch(fx_graph_cache=False):  # a cache hit skips passes
        got = compiled(w1, w2, x)
    for g, want in zip(got, grads(w1, w2, x)):
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-10)
    # forward: the 3-class product; backward: its dW (M=3) and dX (K=3)
    assert sum(rewritten) == 3, rewritten


def test_ensemble_step_carries_the_options_for_make_graphed_step():
    from torchfn.ensembles import Ensemble, make_ensemble_train_step
    from torchfn.ops import stacked_sgd

    ens = Ensemble.from_seeds(lambda: nn.Linear(3, 2), seeds=range(2))
    step = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy,
                                    stacked_sgd(lr=torch.tensor([0.1, 0.2])))
    opts = dict(step.inductor_options)
    assert isinstance(opts["post_grad_custom_post_pass"], ThinMatmulPass)
