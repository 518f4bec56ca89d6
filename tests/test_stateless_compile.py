"""Compiled model_fn / train steps: the same numbers as eager with tied weights and BatchNorm
(static and dynamic shapes, one compile), a changed private module recompiles, bad inputs are
refused under compile as in eager; CUDA graphs (``mode="reduce-overhead"``) with the state
cloned between steps.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.functional import make_functional
from torchfn.ops import stacked_adam

DT = torch.float64


class CountingBackend:
    """torch.compile backend that counts compilations and runs the captured graph as is."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.compiles += 1
        return gm.forward


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class TiedBN(nn.Module):
    """A tied weight (two names, one tensor) and a BatchNorm (buffers the forward updates)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.enc.weight
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.dec(torch.tanh(self.bn(self.enc(x))))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3)).to(DT)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_model_fn_with_ties_and_buffers_equals_eager(dynamo_reset, dynamic):
    for replace_batchnorm in (True, False):
        torch.manual_seed(0)
        model_fn, params, buffers = make_functional(TiedBN().to(DT),
                                                    replace_batchnorm=replace_batchnorm)
        given = {k: v.clone() for k, v in buffers.items()}
        backend = CountingBackend()
        compiled = torch.compile(model_fn, backend=backend, fullgraph=True, dynamic=dynamic)
        for step in range(3):
            x = torch.randn(5 + step * int(dynamic), 4, dtype=DT)
            p = {k: v + step for k, v in params.items()}
            got, got_buffers = compiled(p, buffers, x)
            want, want_buffers = model_fn(p, buffers, x)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert got_buffers.keys() == want_buffers.keys()
            for k in want_buffers:
                torch.testing.assert_close(got_buffers[k], want_buffers[k], rtol=1e-12,
                                           atol=1e-12)
        assert backend.compiles == 1
        for k, v in given.items():  # the caller's buffers are never written
            assert torch.equal(buffers[k], v)
        torch._dynamo.reset()


def test_changed_private_module_still_recompiles(dynamo_reset):
    # The layout and module of a FunctionalModel never change through its API (train()/eval()
    # return new objects); even a poke at the private module copy is caught by the guards
    # Dynamo keeps on the module tree.
    model_fn, params, buffers = make_functional(mlp())
    x = torch.randn(5, 4, dtype=DT)
    backend = CountingBackend()
    compiled = torch.compile(model_fn, backend=backend, fullgraph=True)
    compiled(params, buffers, x)
    model_fn._module[1] = nn.Tanh()
    got, _ = compiled(params, buffers, x)
    want, _ = model_fn(params, buffers, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert backend.compiles == 2


def test_mismatched_inputs_are_still_refused_under_compile(dynamo_reset):
    model_fn, params, buffers = make_functional(mlp())
    x = torch.randn(5, 4, dtype=DT)
    compiled = torch.compile(model_fn, backend=CountingBackend())
    compiled(params, buffers, x)
    with pytest.raises(ValueError, match=r"params\['0.bias'\] has the wrong shape"):
        compiled({**params, "0.bias": torch.zeros(1, dtype=DT)}, buffers, x)
    with pytest.raises(ValueError, match="unexpected key 'extra'"):
        compiled({**params, "extra": torch.zeros(1, dtype=DT)}, buffers, x)
    with pytest.raises(TypeError, match="wrong dtype"):
        compiled({**params, "0.bias": torch.zeros(8, dtype=torch.int64)}, buffers, x)
    # another key order is fine (it takes the full check while tracing)
    reordered = dict(reversed(list(params.items())))
    torch.testing.assert_close(compiled(reordered, buffers, x)[0],
                               model_fn(params, buffers, x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_reduce_overhead_ensemble_step_with_cloned_state_equals_eager():
    # CUDA graph trees return outputs that live in the graph's memory pool; a new call frees
    # or overwrites the outputs of the previous one. A train step's outputs ARE its next
    # inputs, so the state must be cloned out of the pool after each compiled call (metrics
    # too, if kept). The step counter must be on the GPU: a CPU op keeps the graph eager.
    torch._dynamo.reset()
    dev = torch.device("cuda")
    ens = Ensemble.from_seeds(
        lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(dev), range(3))
    opt = stacked_adam(lr=torch.full((3,), 1e-2, device=dev))
    step = make_ensemble_train_step(ens.model_fn, F.cross_entropy, opt)
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    state = optree.tree_map(lambda t: t.to(dev), init_ensemble_state(ens, opt, seed=0))
    eager_state = state
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        batch = (torch.randn(3, 5, 4, generator=gen).to(dev),
                 torch.randint(3, (3, 5), generator=gen).to(dev))
        torch.compiler.cudagraph_mark_step_begin()
        out, metrics = compiled(state, batch)
        state = optree.tree_map(torch.clone, out)
        loss = metrics["loss"].clone()
        del out, metrics
        eager_state, eager_metrics = step(eager_state, batch)
        torch.testing.assert_close(loss, eager_metrics["loss"], rtol=1e-5, atol=1e-6)
    for k in eager_state.params:
        torch.testing.assert_close(state.params[k], eager_state.params[k], rtol=1e-4,
                                   atol=1e-5)
    assert int(state.step) == 6
    torch._dynamo.reset()
