"""compile_regions=True: the compiled meta-gradient with one inner step traced once.

Checked in float64 against the eager torch.func path and a per-task loop of
torch.autograd.grad(create_graph=True); compiled with the aot_eager backend (Dynamo and
AOTAutograd, which build the region and the in-graph outer gradient; no kernel builds, so the
file stays fast).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchfn.compile import compile_step
from torchfn.functional import make_functional
from torchfn.meta import (
    LR_PREFIX,
    MetaLearner,
    Task,
    _regions,
    anil,
    fomaml,
    init_meta_state,
    make_meta_train_step,
    maml,
    meta_sgd,
    sinusoid_tasks,
)
from torchfn.optim import adam

DT = torch.float64
LR, STEPS = 0.1, 2


def _model_fn(p, b, x):
    """A pure MLP (1 -> 6 -> 1, tanh): no module, no side effects."""
    return torch.tanh(x @ p["0.weight"].T + p["0.bias"]) @ p["2.weight"].T + p["2.bias"], b


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = {"0.weight": (6, 1), "0.bias": (6,), "2.weight": (1, 6), "2.bias": (1,)}
    return {k: torch.randn(s, generator=g, dtype=DT) * 0.7 for k, s in shapes.items()}


def _tasks(seed: int = 1, n: int = 3) -> Task:
    return sinusoid_tasks(n, 6, 7, generator=torch.Generator().manual_seed(seed), dtype=DT)[0]


def _head(name: str) -> bool:
    return name.startswith("2.")


def _learner(kind: str, compile_regions: bool = True):
    kw = {"inner_lr": LR, "inner_steps": STEPS, "compile_regions": compile_regions}
    if kind == "maml":
        return maml(_model_fn, F.mse_loss, **kw)
    if kind == "fomaml":
        return fomaml(_model_fn, F.mse_loss, **kw)
    if kind == "anil":
        return anil(_model_fn, F.mse_loss, head=_head, **kw)
    return meta_sgd(_model_fn, F.mse_loss, **kw)


def _loop_reference(kind: str, meta: dict, tasks: Task):
    """Per task: STEPS SGD steps by torch.autograd.grad (create_graph unless first order)."""
    leaves = {k: v.clone().requires_grad_() for k, v in meta.items()}
    names = [k for k in leaves if not k.startswith(LR_PREFIX)]
    adapted = [k for k in names if kind != "anil" or _head(k)]
    total = 0
    for t in range(tasks.support_x.shape[0]):
        fast = {k: leaves[k] for k in names}
        for _ in range(STEPS):
            loss = F.mse_loss(_model_fn(fast, {}, tasks.support_x[t])[0], tasks.support_y[t])
            g = torch.autograd.grad(loss, [fast[k] for k in adapted],
                                    create_graph=kind != "fomaml")
            for k, gk in zip(adapted, g, strict=True):
                rate = leaves[LR_PREFIX + k] if kind == "meta_sgd" else LR
                fast[k] = fast[k] - rate * gk
        total = total + F.mse_loss(_model_fn(fast, {}, tasks.query_x[t])[0], tasks.query_y[t])
    total = total / tasks.support_x.shape[0]
    grads = torch.autograd.grad(total, list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def _close(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=k)


# Dynamo of torch < 2.13 cannot trace the region path (requires_grad_ on detached leaves):
# the library refuses it there with a clear error (test_old_torch_refuses_regions_clearly)
needs_regions = pytest.mark.skipif(
    not _regions.regions_supported(),
    reason=f"compile_regions needs torch >= {_regions.REGIONS_MIN_TORCH}, got {torch.__version__}")


@pytest.fixture(autouse=True)
def second_order_regions(monkeypatch):
    """Allow second-order regions (refused by default: Inductor miscompiles them in torch
    2.13; these tests check the graph semantics under aot_eager)."""
    monkeypatch.setattr(_regions, "SECOND_ORDER_REGIONS", True)


@pytest.fixture
def trace_autograd():
    """Turn on Dynamo's in-graph torch.autograd.grad (the region path needs it); restore."""
    old = torch._dynamo.config.trace_autograd_ops
    torch._dynamo.config.trace_autograd_ops = True
    yield
    torch._dynamo.config.trace_autograd_ops = old


def _recording_backend():
    """aot_eager that keeps every Dynamo graph it is given (one per compile)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    return backend, graphs


def _region_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph identifiers of the graph's invoke_subgraph calls, in order."""
    return [n.args[1] for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]


@needs_regions
@pytest.mark.parametrize("kind", ["maml", "fomaml", "anil", "meta_sgd"])
def test_compiled_region_meta_grad_equals_eager_and_per_task_loop(kind, trace_autograd):
    learner = _learner(kind)
    meta = learner.init(_params())
    if kind == "meta_sgd":  # non-uniform learned rates
        gen = torch.Generator().manual_seed(4)
        meta = {k: v * (0.5 + torch.rand(v.shape, generator=gen, dtype=DT))
                if k.startswith(LR_PREFIX) else v for k, v in meta.items()}
    tasks = _tasks()
    eager, eager_loss, _ = learner.meta_grad(meta, {}, tasks)
    backend, graphs = _recording_backend()
    got, loss, _ = torch.compile(learner.meta_grad, backend=backend, fullgraph=True)(
        meta, {}, tasks)
    _close(got, eager)
    _close(got, _loop_reference(kind, meta, tasks))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-12, atol=0)
    assert len(graphs) == 1
    # one region, called once per inner step: traced once, however many steps
    assert _region_calls(graphs[0]) == ["subgraph_0"] * STEPS


def test_region_path_is_off_by_default_and_the_unrolled_graph_has_no_region(trace_autograd):
    learner = _learner("maml", compile_regions=False)
    meta = learner.init(_params())
    tasks = _tasks()
    backend, graphs = _recording_backend()
    got, _, _ = torch.compile(learner.meta_grad, backend=backend, fullgraph=True)(
        meta, {}, tasks)
    _close(got, _loop_reference("maml", meta, tasks))
    assert _region_calls(graphs[0]) == []


@needs_regions
def test_compiled_region_step_equals_eager_and_does_not_recompile(trace_autograd):
    learner = _learner("maml")
    opt = adam(1e-2)
    state = init_meta_state(learner, _params(), {}, opt)
    step = make_meta_train_step(learner, opt, max_grad_norm=1.0)
    backend, graphs = _recording_backend()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    s_eager, s_comp = state, state
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(3):
            tasks = _tasks(seed=10 + i, n=4)
            s_eager, m_eager = step(s_eager, tasks)
            s_comp, m_comp = compiled(s_comp, tasks)
            torch.testing.assert_close(m_comp["loss"], m_eager["loss"], rtol=1e-12, atol=0)
            for k in s_eager.params:
                torch.testing.assert_close(s_comp.params[k], s_eager.params[k], rtol=1e-10,
                                           atol=1e-13, msg=f"step {i} {k}")
    assert len(graphs) == 1
    assert _region_calls(graphs[0]) == ["subgraph_0"] * STEPS
    assert int(s_comp.step) == 3


@needs_regions
def test_region_chunks_equal_one_chunk(trace_autograd):
    learner = maml(_model_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS, chunk_size=2,
                   compile_regions=True)
    meta, tasks = _params(), _tasks(n=4)
    backend, _ = _recording_backend()
    got, _, _ = torch.compile(learner.meta_grad, backend=backend, fullgraph=True)(
        meta, {}, tasks)
    _close(got, _loop_reference("maml", meta, tasks))


@needs_regions
def test_compile_without_trace_autograd_ops_is_refused():
    assert not torch._dynamo.config.trace_autograd_ops  # torch's default
    learner = _learner("maml")
    with pytest.raises(Exception, match="trace_autograd_ops = True before compiling"):
        torch.compile(learner.meta_grad, backend="aot_eager", fullgraph=True)(
            _params(), {}, _tasks())


@needs_regions
def test_region_with_params_that_require_grad_is_refused(trace_autograd):
    learner = _learner("maml")
    meta = {k: v.requires_grad_() for k, v in _params().items()}
    with pytest.raises(Exception, match="meta_params require grad"):
        torch.compile(learner.meta_grad, backend="aot_eager", fullgraph=True)(
            meta, {}, _tasks())


def test_eager_calls_ignore_compile_regions():
    meta, tasks = _params(), _tasks()
    on, _, _ = _learner("maml").meta_grad(meta, {}, tasks)
    off, _, _ = _learner("maml", compile_regions=False).meta_grad(meta, {}, tasks)
    _close(on, off)


def test_second_order_regions_are_refused_by_default(monkeypatch):
    monkeypatch.setattr(_regions, "SECOND_ORDER_REGIONS", False)
    for make in (maml, meta_sgd):
        with pytest.raises(ValueError, match=r"Inductor miscompiles the second-order backward"):
            make(_model_fn, F.mse_loss, compile_regions=True)
    with pytest.raises(ValueError, match=r"Inductor miscompiles the second-order backward"):
        anil(_model_fn, F.mse_loss, head=_head, compile_regions=True)
    assert fomaml(_model_fn, F.mse_loss, compile_regions=True).compile_regions


def test_bad_compile_regions_arguments_are_refused():
    model_fn, _, _ = make_functional(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"make_functional model_fn: its call swaps"):
        maml(model_fn, F.mse_loss, compile_regions=True)
    with pytest.raises(ValueError, match=r"compile_regions=True, reptile=True"):
        MetaLearner(_model_fn, F.mse_loss, reptile=True, compile_regions=True)
    with pytest.raises(ValueError, match=r"compile_regions=True, remat=True"):
        maml(_model_fn, F.mse_loss, remat=True, compile_regions=True)
    with pytest.raises(ValueError, match=r"randomness='different'\): random ops"):
        maml(_model_fn, F.mse_loss, randomness="different", compile_regions=True)
    with pytest.raises(ValueError, match=r"compile_regions=...\): expected a bool, got 1"):
        maml(_model_fn, F.mse_loss, compile_regions=1)
    assert "compile_regions=True" in repr(maml(_model_fn, F.mse_loss, compile_regions=True))


@needs_regions
def test_compile_step_turns_on_trace_autograd_ops_for_its_calls_only():
    assert not torch._dynamo.config.trace_autograd_ops
    learner = _learner("maml")
    meta, tasks = _params(), _tasks()
    cstep = compile_step(learner.meta_grad, log=None, backend="aot_eager")
    got, _, _ = cstep(meta, {}, tasks)
    _close(got, _loop_reference("maml", meta, tasks))
    assert not torch._dynamo.config.trace_autograd_ops


@pytest.mark.skipif(_regions.regions_supported(), reason="this torch supports the region path")
def test_old_torch_refuses_regions_clearly(trace_autograd):
    learner = _learner("maml")
    with pytest.raises(Exception, match=r"needs torch >= 2\.13 .*compile_regions=False"):
        torch.compile(learner.meta_grad, backend="aot_eager", fullgraph=True)(
            _params(), {}, _tasks())
