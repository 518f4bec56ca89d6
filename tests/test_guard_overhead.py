"""Compiled model_fn / train steps: few Dynamo guards on FunctionalModel, same numbers, same
recompiles; CUDA graphs (``mode="reduce-overhead"``) with the state cloned between steps.

What a compiled caller guards on a FunctionalModel: ONE string (``_signature``: keys, dtype
kinds, devices, shapes of the layout) instead of every key, shape entry, dtype and device of
the layout, and no per-slot bookkeeping (owners are found from the given keys along the path
forward() walks). The module tree itself is still guarded (types, ``forward``, attributes
forward reads), so the model can't change under a compiled graph unnoticed.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.functional import adam, init_train_state, make_functional, make_train_step
from torchfn.ops import stacked_adam

DT = torch.float64


class CountingBackend:
    """torch.compile backend that counts compilations and runs the captured graph as is."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.compiles += 1
        return gm.forward


class GuardRecorder:
    """``guard_filter_fn`` that keeps every guard and remembers their names (sources)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, entries):
        self.names += [e.name for e in entries]
        return [True] * len(entries)


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


def test_compiled_train_step_guards_one_string_of_the_layout(dynamo_reset):
    model_fn, params, buffers = make_functional(mlp())
    opt = adam(1e-2)
    state = init_train_state(params, buffers, opt, seed=0)
    recorder = GuardRecorder()
    step = torch.compile(make_train_step(model_fn, F.cross_entropy, opt), fullgraph=True,
                         backend="eager", options={"guard_filter_fn": recorder})
    step(state, (torch.randn(6, 4, dtype=DT), torch.randint(3, (6,))))
    on_model = [n for n in recorder.names if "cell_contents._" in n]
    assert on_model, "expected guards on the model_fn closure (recorder saw none)"
    for private in ("._layout", "._param_slots", "._buffer_slots", ".param_names"):
        assert not [n for n in on_model if private in n], f"guards on {private}: {on_model}"
    assert len([n for n in on_model if n.endswith("._signature")]) == 1
    # the tied names (none here) are read as one tuple: a length guard, nothing per name
    assert len([n for n in on_model if "_ties" in n]) <= 2
    # what remains is the module tree forward() walks: types, forward, hooks, attributes
    assert [n for n in on_model if "._module" in n]


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
