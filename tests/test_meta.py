"""torchfn.meta vs a per-task loop of torch.autograd.grad on an ordinary nn.Module (float64)."""

from __future__ import annotations

import copy
import gc
import re

import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import nn
from torch.func import functional_call

from torchfn.functional import make_functional
from torchfn.meta._maml import LR_PREFIX, anil, fomaml, maml, meta_sgd, reptile
from torchfn.meta._step import init_meta_state, make_meta_train_step
from torchfn.meta._tasks import Task, sinusoid_tasks
from torchfn.optim import adam

DT = torch.float64
LR, STEPS = 0.1, 2


def _mlp(bn: bool) -> nn.Module:
    torch.manual_seed(3)
    norm = [nn.BatchNorm1d(6)] if bn else []
    return nn.Sequential(nn.Linear(1, 6), *norm, nn.Tanh(), nn.Linear(6, 1)).to(DT)


def _tasks(n: int = 5) -> Task:
    return sinusoid_tasks(n, 6, 7, generator=torch.Generator().manual_seed(1), dtype=DT)[0]


def _head(name: str) -> bool:
    return name.startswith(("3.", "2.weight", "2.bias")) and not name.startswith("2.running")


def _loop_reference(module, tasks, *, first_order=False, head=None, lrs=None):
    """Per task: STEPS inner SGD steps with autograd.grad(create_graph=True), then query loss."""
    ref = copy.deepcopy(module)
    names = [k for k, _ in ref.named_parameters()]
    params = dict(ref.named_parameters())
    lr_t = {k: v.clone().requires_grad_() for k, v in (lrs or {}).items()}
    adapted = [k for k in names if head is None or head(k)]
    total = 0
    for t in range(tasks.support_x.shape[0]):
        fast = dict(params)
        for _ in range(STEPS):
            loss = F.mse_loss(functional_call(ref, fast, (tasks.support_x[t],)),
                              tasks.support_y[t])
            g = torch.autograd.grad(loss, [fast[k] for k in adapted],
                                    create_graph=not first_order)
            for k, gk in zip(adapted, g, strict=True):
                step = lr_t[k] if lrs else LR
                fast[k] = fast[k] - step * gk
        total = total + F.mse_loss(functional_call(ref, fast, (tasks.query_x[t],)),
                                   tasks.query_y[t])
    total = total / tasks.support_x.shape[0]
    inputs = [params[k] for k in names] + list(lr_t.values())
    grads = torch.autograd.grad(total, inputs)
    keys = names + [LR_PREFIX + k for k in lr_t]
    return dict(zip(keys, grads, strict=True)), total.detach()


def _learner(kind, model_fn, chunk_size=None):
    kw = {"inner_lr": LR, "inner_steps": STEPS, "chunk_size": chunk_size}
    if kind == "maml":
        return maml(model_fn, F.mse_loss, **kw)
    if kind == "fomaml":
        return fomaml(model_fn, F.mse_loss, **kw)
    if kind == "anil":
        return anil(model_fn, F.mse_loss, head=_head, **kw)
    return meta_sgd(model_fn, F.mse_loss, **kw)


def _reference_for(kind, module, tasks, meta):
    if kind == "maml":
        return _loop_reference(module, tasks)
    if kind == "fomaml":
        return _loop_reference(module, tasks, first_order=True)
    if kind == "anil":
        return _loop_reference(module, tasks, head=_head)
    lrs = {k[len(LR_PREFIX):]: v for k, v in meta.items() if k.startswith(LR_PREFIX)}
    return _loop_reference(module, tasks, lrs=lrs)


def _assert_grads_close(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12, msg=k)


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("bn", [False, True])
@pytest.mark.parametrize("kind", ["maml", "fomaml", "anil", "meta_sgd"])
def test_meta_grad_equals_per_task_loop(kind, bn, chunk_size):
    module = _mlp(bn)
    model_fn, params, buffers = make_functional(module)
    learner = _learner(kind, model_fn, chunk_size)
    meta = learner.init(params)
    if kind == "meta_sgd":  # non-uniform learned rates
        gen = torch.Generator().manual_seed(4)
        meta = {k: v * (0.5 + torch.rand(v.shape, generator=gen, dtype=DT))
                if k.startswith(LR_PREFIX) else v for k, v in meta.items()}
    tasks = _tasks()
    got, loss, _ = learner.meta_grad(meta, buffers, tasks)
    want, want_loss = _reference_for(kind, module, tasks, meta)
    _assert_grads_close(got, want)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    if kind == "anil":  # the body still gets a (second-order) meta-gradient
        assert float(got["0.weight"].abs().sum()) > 0


def test_meta_loss_grad_equals_meta_grad():
    model_fn, params, buffers = make_functional(_mlp(True))
    learner = _learner("maml", model_fn)
    tasks = _tasks()
    g1 = torch.func.grad(lambda p: learner.meta_loss(p, buffers, tasks)[0])(params)
    g2, _, _ = learner.meta_grad(params, buffers, tasks)
    _assert_grads_close(g1, g2)


def test_reptile_update_equals_definition():
    module = _mlp(False)
    model_fn, params, buffers = make_functional(module)
    eps = 0.3
    learner = reptile(model_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS, chunk_size=2)
    opt = torchopt.sgd(lr=eps)
    state = init_meta_state(learner, params, buffers, opt)
    tasks = _tasks()
    new_state, _ = make_meta_train_step(learner, opt)(state, tasks)
    # definition: phi_t = k SGD steps on task t from params; params + eps * mean(phi_t - params)
    ref = copy.deepcopy(module)
    phis = []
    for t in range(tasks.support_x.shape[0]):
        net = copy.deepcopy(ref)
        sgd = torch.optim.SGD(net.parameters(), lr=LR)
        for _ in range(STEPS):
            sgd.zero_grad()
            F.mse_loss(net(tasks.support_x[t]), tasks.support_y[t]).backward()
            sgd.step()
        phis.append(dict(net.named_parameters()))
    for k, p in ref.named_parameters():
        mean_phi = torch.stack([phi[k].detach() for phi in phis]).mean(0)
        want = p.detach() + eps * (mean_phi - p.detach())
        torch.testing.assert_close(new_state.params[k], want, rtol=1e-12, atol=1e-14, msg=k)


def _counting_backend():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    return backend, calls


@pytest.mark.parametrize("kind", ["maml", "meta_sgd"])
def test_compiled_outer_step_equals_eager_and_does_not_recompile(kind):
    model_fn, params, buffers = make_functional(_mlp(False))
    learner = _learner(kind, model_fn)
    opt = adam(1e-2)
    state = init_meta_state(learner, params, buffers, opt)
    step = make_meta_train_step(learner, opt)
    backend, calls = _counting_backend()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    s_eager, s_comp = state, state
    for i in range(3):
        tasks = sinusoid_tasks(4, 5, 5, generator=gen, dtype=DT)[0]
        s_eager, m_eager = step(s_eager, tasks)
        s_comp, m_comp = compiled(s_comp, tasks)
        torch.testing.assert_close(m_comp["loss"], m_eager["loss"], rtol=1e-12, atol=0)
        for k in s_eager.params:
            torch.testing.assert_close(s_comp.params[k], s_eager.params[k], rtol=1e-10,
                                       atol=1e-13, msg=f"step {i} {k}")
        assert len(calls) == 1, f"recompiled at step {i}: {len(calls)} graphs"
    assert int(s_comp.step) == 3


def test_compiled_meta_grad_with_batchnorm_equals_loop():
    module = _mlp(True)
    model_fn, params, buffers = make_functional(module)
    learner = maml(model_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS)
    tasks = _tasks(3)
    backend, calls = _counting_backend()
    got, _, _ = torch.compile(learner.meta_grad, backend=backend, fullgraph=True)(
        params, buffers, tasks
    )
    want, _ = _loop_reference(module, tasks)
    _assert_grads_close(got, want)
    assert len(calls) == 1


@pytest.mark.slow
def test_inductor_compiled_step_with_batchnorm_equals_eager():
    """The real backend (Inductor), BatchNorm, chunks: ~50 s of compile on 2 CPU cores.

    The first Linear has no bias: a bias in front of BatchNorm has an exactly-zero gradient,
    so its computed meta-gradient is rounding noise (~1e-16) that Adam's ``g / (|g| + eps)``
    scales up by ``1 / eps`` -- compiled and eager then differ by ~1e-9 in that bias for no
    fault of either.
    """
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(1, 6, bias=False), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1))
    model_fn, params, buffers = make_functional(net.to(DT))
    learner = maml(model_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS, chunk_size=2)
    opt = adam(1e-2)
    state = init_meta_state(learner, params, buffers, opt)
    step = make_meta_train_step(learner, opt)
    compiled = torch.compile(step, fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    s_eager, s_comp = state, state
    for _ in range(2):
        tasks = sinusoid_tasks(5, 6, 7, generator=gen, dtype=DT)[0]
        s_eager, _ = step(s_eager, tasks)
        s_comp, _ = compiled(s_comp, tasks)
    for k in s_eager.params:
        torch.testing.assert_close(s_comp.params[k], s_eager.params[k], rtol=1e-10, atol=1e-13,
                                   msg=k)
    for k in s_eager.buffers:
        torch.testing.assert_close(s_comp.buffers[k], s_eager.buffers[k], rtol=1e-10, atol=1e-13,
                                   msg=k)


def test_memory_does_not_grow_over_50_meta_steps():
    model_fn, params, buffers = make_functional(_mlp(True))
    learner = _learner("maml", model_fn)
    opt = adam(1e-3)
    state = init_meta_state(learner, params, buffers, opt)
    step = make_meta_train_step(learner, opt)
    gen = torch.Generator().manual_seed(0)
    counts = []
    for i in range(50):
        state, _ = step(state, sinusoid_tasks(4, 5, 5, generator=gen, dtype=DT)[0])
        if i in (9, 49):
            gc.collect()
            counts.append(sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects()))
    assert counts[1] <= counts[0], f"live tensors grew: {counts}"
    assert all(not v.requires_grad and v.grad_fn is None for v in state.params.values())


def test_sinusoid_tasks_are_reproducible_and_in_range():
    a = sinusoid_tasks(50, 10, 10, generator=torch.Generator().manual_seed(5))
    b = sinusoid_tasks(50, 10, 10, generator=torch.Generator().manual_seed(5))
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y)
    tasks, amp, ph = a
    assert tasks.support_x.shape == (50, 10, 1) and tasks.query_y.shape == (50, 10, 1)
    assert float(amp.min()) >= 0.1 and float(amp.max()) <= 5.0
    assert float(ph.min()) >= 0 and float(ph.max()) <= torch.pi
    assert float(tasks.support_x.abs().max()) <= 5.0
    want = amp[:, None, None] * torch.sin(tasks.query_x - ph[:, None, None])
    torch.testing.assert_close(tasks.query_y, want)


def test_errors():
    model_fn, params, buffers = make_functional(_mlp(False))
    with pytest.raises(ValueError, match=re.escape("inner_steps=...): expected an int >= 1, got 0")):
        maml(model_fn, F.mse_loss, inner_steps=0)
    with pytest.raises(ValueError, match="keeps none of the params"):
        anil(model_fn, F.mse_loss, head=lambda n: False).init(params)
    with pytest.raises(ValueError, match="Reptile has no meta-loss"):
        reptile(model_fn, F.mse_loss).meta_loss(params, buffers, _tasks())
    with pytest.raises(ValueError, match=re.escape("n_tasks=...): expected an int >= 1")):
        sinusoid_tasks(0, 1, 1, generator=torch.Generator())


def test_mismatched_or_empty_task_batches_are_refused_before_vmap(monkeypatch):
    """Regression: mismatched task fields failed deep inside vmap; zero tasks in range()."""
    import torchfn.meta._maml as maml_mod

    def no_vmap(*args, **kwargs):
        raise AssertionError("vmap was reached")

    monkeypatch.setattr(maml_mod, "vmap", no_vmap)
    model_fn, params, buffers = make_functional(_mlp(False))
    t = _tasks()  # support (5, 6, 1), query (5, 7, 1)
    cases = [
        (t._replace(query_y=t.query_y[:4]), ValueError,
         r"different numbers of tasks \(dim 0\): support_x \(5, 6, 1\), support_y \(5, 6, 1\), "
         r"query_x \(5, 7, 1\), query_y \(4, 7, 1\)"),
        (t._replace(support_x=t.support_x[:3]), ValueError, r"support_x \(3, 6, 1\)"),
        (t._replace(support_y=t.support_y[:, :5]), ValueError,
         r"tasks\.support_x \(5, 6, 1\) and tasks\.support_y \(5, 5, 1\) have different numbers "
         r"of samples per task"),
        (t._replace(query_x=t.query_x[:, :2]), ValueError,
         r"tasks\.query_x \(5, 2, 1\) and tasks\.query_y \(5, 7, 1\)"),
        (Task(*(f[:0] for f in t)), ValueError, r"zero tasks \(support_x \(0, 6, 1\)"),
        (t._replace(support_x=t.support_x[0, :, 0]), ValueError,
         r"tasks\.support_x has shape \(6,\); expected \(T, n, \.\.\.\)"),
        (tuple(t), TypeError, r"expected tasks as a Task\(support_x, support_y, query_x, "
                              r"query_y\) batch \(task dim 0\), got tuple"),
    ]
    learners = [maml(model_fn, F.mse_loss, chunk_size=2), reptile(model_fn, F.mse_loss)]
    for tasks, error, pattern in cases:
        for learner in learners:
            with pytest.raises(error, match=r"MetaLearner\.meta_grad\(meta_params, buffers, "
                                            r"tasks\): .*" + pattern):
                learner.meta_grad(params, buffers, tasks)
        with pytest.raises(error, match=r"MetaLearner\.meta_loss\(.*" + pattern):
            learners[0].meta_loss(params, buffers, tasks)


def test_constructors_take_explicit_keywords_and_refuse_inner_lr_with_inner_opt():
    """Regression: **kwargs let typos and foreign options through; inner_lr was silently ignored
    when inner_opt was given."""
    import inspect

    model_fn, params, buffers = make_functional(_mlp(False))
    head = {"head": _head}
    for ctor, extra in ((maml, {}), (fomaml, {}), (anil, head), (meta_sgd, {}), (reptile, {})):
        sig = inspect.signature(ctor)
        assert all(p.kind is not p.VAR_KEYWORD for p in sig.parameters.values()), ctor
        assert all(p.annotation is not p.empty for p in sig.parameters.values()), ctor
        assert "Args:" in (ctor.__doc__ or "") and "inner_opt:" in ctor.__doc__, ctor
        with pytest.raises(TypeError, match="unexpected keyword argument 'inner_step'"):
            ctor(model_fn, F.mse_loss, inner_step=2, **extra)
        for foreign in ("first_order", "reptile", "learn_inner_lr"):  # not theirs to pass
            with pytest.raises(TypeError, match=f"unexpected keyword argument '{foreign}'"):
                ctor(model_fn, F.mse_loss, **{foreign: True}, **extra)
        if ctor is not meta_sgd:
            with pytest.raises(ValueError, match=r"inner_lr=0\.1, inner_opt=\.\.\.\): .*pass the "
                                                 r"learning rate to inner_opt instead"):
                ctor(model_fn, F.mse_loss, inner_lr=0.1, inner_opt=torchopt.sgd(lr=0.1), **extra)
        ctor(model_fn, F.mse_loss, inner_opt=torchopt.sgd(lr=0.1), **extra)  # default: not given
    # inner_opt alone is used, and equals the same rate given as inner_lr
    a = maml(model_fn, F.mse_loss, inner_opt=torchopt.sgd(lr=LR), inner_steps=STEPS)
    b = maml(model_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS)
    c = maml(model_fn, F.mse_loss, inner_steps=STEPS)  # the default rate, 0.01
    ga, gb, gc = (m.meta_grad(params, buffers, _tasks())[0] for m in (a, b, c))
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=0, atol=0)
    assert any(not torch.allclose(ga[k], gc[k]) for k in ga)
    # Meta-SGD: inner_lr is the learned rates' initial value, fine together with inner_opt
    learner = meta_sgd(model_fn, F.mse_loss, inner_lr=0.05, inner_opt=torchopt.sgd(lr=1.0))
    assert all(float(v.unique()) == 0.05 for k, v in learner.init(params).items()
               if k.startswith(LR_PREFIX))
    assert float(meta_sgd(model_fn, F.mse_loss).init(params)[LR_PREFIX + "0.weight"].unique()) \
        == 0.01
