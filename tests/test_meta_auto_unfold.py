"""``unfold_convs="auto"`` of the meta learners: under torch.compile the adapted convolutions of
a make_functional model run as unfold + matmul; eager calls, names and checkpoints unchanged.

Float64 on the CPU, where ``"auto"`` leaves the convs alone, so the compiled path is forced
with ``unfold_convs=True``; the fast tests compile with ``backend="aot_eager"`` (Dynamo +
AOTAutograd: the traced graph and its numbers, no Inductor), the slow one with Inductor, and
the GPU one checks ``"auto"`` itself."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchfn.compile._unfold_conv import UnfoldConv2d
from torchfn.functional import make_functional
from torchfn.meta import (
    Task,
    anil,
    fomaml,
    imaml,
    init_meta_state,
    make_meta_train_step,
    maml,
    maml_plus_plus,
    meta_sgd,
    reptile,
)
from torchfn.meta._auto_unfold import CompiledUnfold
from torchfn.optim import sgd

DT = torch.float64
N_TASKS, N_WAY, SIZE = 2, 3, 8


def net8() -> nn.Module:
    """Two conv blocks of 8 channels (the second conv's patch 72 >= 64 unfolds; the first,
    1-channel one, patch 9, stays) and a linear head."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    c_in = 1
    for _ in range(2):
        layers += [nn.Conv2d(c_in, 8, 3, padding=1), nn.BatchNorm2d(8, track_running_stats=False),
                   nn.ReLU(), nn.MaxPool2d(2)]
        c_in = 8
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * (SIZE // 4) ** 2, N_WAY)).to(DT)


def tasks8(device: str = "cpu") -> Task:
    g = torch.Generator().manual_seed(1)
    labels = torch.arange(N_WAY).repeat(N_TASKS, 1)
    t = Task(torch.randn(N_TASKS, N_WAY, 1, SIZE, SIZE, generator=g, dtype=DT), labels,
             torch.randn(N_TASKS, N_WAY, 1, SIZE, SIZE, generator=g, dtype=DT), labels)
    return Task(*(x.to(device) for x in t))


LEARNERS: dict[str, Callable[..., object]] = {
    "maml": lambda f, **kw: maml(f, F.cross_entropy, inner_lr=0.1, inner_steps=2, **kw),
    "fomaml": lambda f, **kw: fomaml(f, F.cross_entropy, inner_lr=0.1, inner_steps=2, **kw),
    # adapts the second conv and the head: only that conv unfolds
    "anil": lambda f, **kw: anil(f, F.cross_entropy, lambda n: n[0] in "49", inner_lr=0.1,
                                 inner_steps=2, **kw),
    "meta_sgd": lambda f, **kw: meta_sgd(f, F.cross_entropy, inner_lr=0.1, inner_steps=2, **kw),
}


def _graph_text(backend_graphs: list[str]) -> str:
    return "\n".join(backend_graphs)


def _recording_backend(graphs: list[str]) -> Callable:
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def _assert_close_on_global_scale(got: dict, want: dict, tol: float) -> None:
    # conv biases in front of BatchNorm have an exactly-zero gradient: compare on the global scale
    assert list(got) == list(want)
    scale = max(float(w.abs().max()) for w in want.values())
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k].cpu(), rtol=0, atol=tol * scale, msg=k)


@pytest.mark.parametrize("kind", list(LEARNERS))
def test_compiled_meta_grad_runs_unfolded_and_equals_eager_conv2d(kind) -> None:
    model_fn, params, buffers = make_functional(net8())
    tasks = tasks8()
    want = LEARNERS[kind](model_fn, unfold_convs=False).meta_grad(
        LEARNERS[kind](model_fn).init(params), buffers, tasks)[0]
    learner = LEARNERS[kind](model_fn, unfold_convs=True)
    meta = learner.init(params)
    eager = learner.meta_grad(meta, buffers, tasks)[0]
    for k in want:  # eager calls are the nn.Conv2d path itself
        assert torch.equal(eager[k], want[k]), k
    graphs: list[str] = []
    torch._dynamo.reset()
    got = torch.compile(learner.meta_grad, backend=_recording_backend(graphs),
                        fullgraph=True)(meta, buffers, tasks)[0]
    _assert_close_on_global_scale(got, want, 1e-12)
    text = _graph_text(graphs)
    assert "unfold" in text  # the second conv went through UnfoldConv2d
    if kind == "anil":  # the first conv's weight is not adapted: it stays a convolution
        assert "conv2d" in text


def test_auto_and_false_leave_the_model_alone_where_nothing_pays() -> None:
    model_fn, _, _ = make_functional(net8())
    # "auto" unfolds only for a model on CUDA; this one is on the CPU
    assert maml(model_fn, F.cross_entropy)._model_call is model_fn
    assert maml(model_fn, F.cross_entropy, unfold_convs=False)._model_call is model_fn
    # ANIL adapting only the head: every conv is shared by the tasks, nothing to unfold
    head = anil(model_fn, F.cross_entropy, lambda n: n.startswith("9."), unfold_convs=True)
    assert head._model_call is model_fn
    # a hand-written model_fn has no modules to swap
    fn = lambda p, b, x: (F.conv2d(x, p["w"]), b)  # noqa: E731
    assert maml(fn, F.cross_entropy, unfold_convs=True)._model_call is fn


def test_names_shapes_and_state_are_unchanged() -> None:
    model_fn, params, buffers = make_functional(net8())
    learner = maml(model_fn, F.cross_entropy, unfold_convs=True)
    call = learner._model_call
    assert isinstance(call, CompiledUnfold) and learner.model_fn is model_fn
    twin = call.unfolded
    assert [type(m).__name__ for m in twin.modules()].count("UnfoldConv2d") == 1
    assert isinstance(list(twin.modules())[5], UnfoldConv2d)  # layer 4, the 8-channel conv
    assert all(type(m) is not UnfoldConv2d for m in model_fn.modules())
    assert twin.param_names == model_fn.param_names
    assert twin.buffer_names == model_fn.buffer_names
    state = init_meta_state(learner, params, buffers, sgd(0.1))
    plain = init_meta_state(maml(model_fn, F.cross_entropy, unfold_convs=False), params,
                            buffers, sgd(0.1))
    assert list(state.params) == list(plain.params) == list(params)
    assert all(state.params[k].shape == params[k].shape for k in params)


@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_bad_unfold_convs_is_named(value) -> None:
    model_fn, _, _ = make_functional(net8())
    with pytest.raises(ValueError, match=r"unfold_convs=...\): expected 'auto', True or False"):
        maml(model_fn, F.cross_entropy, unfold_convs=value)


def test_every_constructor_takes_it() -> None:
    model_fn, _, _ = make_functional(net8())
    for make in (maml, fomaml, meta_sgd, reptile):
        assert isinstance(make(model_fn, F.cross_entropy, unfold_convs=True)._model_call,
                          CompiledUnfold)
    assert isinstance(anil(model_fn, F.cross_entropy, lambda n: True,
                           unfold_convs=True)._model_call, CompiledUnfold)
    assert isinstance(imaml(model_fn, F.cross_entropy, unfold_convs=True)._model_call,
                      CompiledUnfold)
    pp = maml_plus_plus(model_fn, F.cross_entropy, multi_step_loss=False, unfold_convs=True)
    assert isinstance(pp._model_call, CompiledUnfold)
    assert "unfold_convs=False" in repr(maml(model_fn, F.cross_entropy, unfold_convs=False))


def test_compile_inner_runs_unfolded_and_equals_eager() -> None:
    model_fn, params, buffers = make_functional(net8())
    tasks = tasks8()
    opt = sgd(0.1)
    plain = maml(model_fn, F.cross_entropy, inner_lr=0.1, inner_steps=2, unfold_convs=False)
    learner = maml(model_fn, F.cross_entropy, inner_lr=0.1, inner_steps=2, unfold_convs=True)
    state = init_meta_state(plain, params, buffers, opt)
    want, _ = make_meta_train_step(plain, opt)(state, tasks)
    graphs: list[str] = []
    torch._dynamo.reset()
    step = make_meta_train_step(learner, opt, compile="inner",
                                compile_kwargs={"backend": _recording_backend(graphs)})
    got, _ = step(state, tasks)
    _assert_close_on_global_scale(got.params, want.params, 1e-12)
    assert "unfold" in _graph_text(graphs)


@pytest.mark.slow
def test_inductor_compiled_train_step_equals_eager() -> None:
    """The README's path, ``torch.compile(make_meta_train_step(...), fullgraph=True)`` with
    Inductor: same step as eager (about 80 s of compile on a 2-core CPU)."""
    model_fn, params, buffers = make_functional(net8())
    tasks, opt = tasks8(), sgd(0.1)
    learner = maml(model_fn, F.cross_entropy, inner_lr=0.1, inner_steps=1, unfold_convs=True)
    state = init_meta_state(learner, params, buffers, opt)
    want, m_want = make_meta_train_step(learner, opt)(state, tasks)
    torch._dynamo.reset()
    got, m_got = torch.compile(make_meta_train_step(learner, opt), fullgraph=True)(state, tasks)
    torch.testing.assert_close(m_got["loss"], m_want["loss"], rtol=1e-12, atol=0)
    _assert_close_on_global_scale(got.params, want.params, 1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("kind", ["maml", "fomaml"])
def test_cuda_auto_compiled_equals_eager(kind) -> None:
    """``"auto"`` on CUDA: the compiled step (Inductor, default options) runs the unfolded
    conv and gives the eager ``nn.Conv2d`` meta-gradient, float64."""
    model_fn, params, buffers = make_functional(net8().cuda())
    tasks = tasks8("cuda")
    learner = LEARNERS[kind](model_fn)
    assert isinstance(learner._model_call, CompiledUnfold)
    want = learner.meta_grad(params, buffers, tasks)[0]
    torch._dynamo.reset()
    got = torch.compile(learner.meta_grad, fullgraph=True)(params, buffers, tasks)[0]
    _assert_close_on_global_scale(got, want, 1e-10)
