"""torchfn.meta.imaml vs the implicit gradient from dense Hessians and torch.linalg.solve (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import nn
from torch.func import functional_call, grad, hessian

from torchfn.functional import make_functional
from torchfn.meta import ImplicitMetaLearner, MetaLearner, imaml
from torchfn.meta._step import init_meta_state, make_meta_train_step
from torchfn.meta._tasks import Task, sinusoid_tasks

DT = torch.float64


def _mlp(bn: bool = False, hidden: int = 5) -> nn.Module:
    torch.manual_seed(3)
    norm = [nn.BatchNorm1d(hidden)] if bn else []
    return nn.Sequential(nn.Linear(1, hidden), *norm, nn.Tanh(), nn.Linear(hidden, 1)).to(DT)


def _tasks(n: int = 4) -> Task:
    return sinusoid_tasks(n, 6, 7, generator=torch.Generator().manual_seed(1), dtype=DT)[0]


def _flat(d: dict) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in d.values()])


def _unflat(v: torch.Tensor, like: dict) -> dict:
    out, i = {}, 0
    for k, t in like.items():
        out[k] = v[i:i + t.numel()].view_as(t)
        i += t.numel()
    return out


def _rel(got: dict, want: dict) -> float:
    return float((_flat(got) - _flat(want)).norm() / _flat(want).norm())


# -- the exact implicit gradient ---------------------------------------------------------------


def _exact_implicit_grad(loss_s, loss_q, theta: dict, lam: float, phi0: torch.Tensor):
    """Newton on the proximal objective to machine precision, then a dense solve."""
    th = _flat(theta)

    def prox(v):
        return loss_s(v) + 0.5 * lam * ((v - th) ** 2).sum()

    phi = phi0.clone()
    for _ in range(30):
        phi = phi - torch.linalg.solve(hessian(prox)(phi), grad(prox)(phi))
    assert float(grad(prox)(phi).norm()) < 1e-12
    h = hessian(loss_s)(phi)
    a = torch.eye(th.numel(), dtype=DT) + h / lam
    assert float(torch.linalg.eigvalsh(a).min()) > 0.05  # positive definite: CG applies
    return torch.linalg.solve(a, grad(loss_q)(phi)), phi


@pytest.mark.parametrize("damping", [0.0, 0.7])
def test_linear_regression_meta_grad_equals_closed_form_implicit_gradient(damping):
    gen = torch.Generator().manual_seed(0)
    n_tasks, k, d, lam = 3, 8, 3, 1.5
    xs = torch.randn(n_tasks, 2 * k, d, generator=gen, dtype=DT)
    ys = torch.randn(n_tasks, 2 * k, 1, generator=gen, dtype=DT)
    tasks = Task(xs[:, :k], ys[:, :k], xs[:, k:], ys[:, k:])
    theta = {"w": torch.randn(d, 1, generator=gen, dtype=DT),
             "b": torch.randn(1, generator=gen, dtype=DT)}

    def model_fn(p, b, x):
        return x @ p["w"] + p["b"], b

    want, losses = [], []
    for t in range(n_tasks):
        def loss_on(x, y):
            return lambda v: F.mse_loss(model_fn(_unflat(v, theta), {}, x)[0], y)

        ls = loss_on(tasks.support_x[t], tasks.support_y[t])
        lq = loss_on(tasks.query_x[t], tasks.query_y[t])
        # ridge: phi* = (H + lam I)^{-1} (lam theta - grad L_s(0)), then (I + H/lam) g = grad L_q
        h = hessian(ls)(torch.zeros(d + 1, dtype=DT))
        eye = torch.eye(d + 1, dtype=DT)
        phi = torch.linalg.solve(h + lam * eye, lam * _flat(theta) - grad(ls)(0 * _flat(theta)))
        want.append(torch.linalg.solve((1 + damping) * eye + h / lam, grad(lq)(phi)))
        losses.append(lq(phi))
    want_g = _unflat(torch.stack(want).mean(0), theta)
    learner = imaml(model_fn, F.mse_loss, lam=lam, inner_lr=0.1, inner_steps=600, cg_steps=8,
                    cg_damping=damping)
    got, loss, _ = learner.meta_grad(theta, {}, tasks)
    assert _rel(got, want_g) < 1e-9, (got, want_g)
    torch.testing.assert_close(loss, torch.stack(losses).mean(), rtol=1e-10, atol=0)
    # dict inputs (a Hugging Face style batch): the model gets them as keywords
    dict_tasks = Task({"inputs": tasks.support_x}, tasks.support_y, {"inputs": tasks.query_x},
                      tasks.query_y)
    learner = imaml(lambda p, b, inputs: model_fn(p, b, inputs), F.mse_loss, lam=lam,
                    inner_lr=0.1, inner_steps=600, cg_steps=8, cg_damping=damping)
    for k, v in learner.meta_grad(theta, {}, dict_tasks)[0].items():
        torch.testing.assert_close(v, got[k], rtol=1e-12, atol=0, msg=k)


def test_mlp_meta_grad_equals_exact_implicit_gradient():
    """Inner problem solved to convergence, CG to convergence: the exact implicit gradient."""
    module = _mlp()
    model_fn, params, buffers = make_functional(module)
    tasks, lam = _tasks(3), 4.0
    want, phis = [], []
    for t in range(3):
        def loss_on(x, y):
            return lambda v: F.mse_loss(functional_call(module, _unflat(v, params), (x,)), y)

        g, phi = _exact_implicit_grad(loss_on(tasks.support_x[t], tasks.support_y[t]),
                                      loss_on(tasks.query_x[t], tasks.query_y[t]),
                                      params, lam, _flat(params))
        want.append(g)
        phis.append(phi)
    want_g = _unflat(torch.stack(want).mean(0), params)
    n = _flat(params).numel()
    learner = imaml(model_fn, F.mse_loss, lam=lam, inner_lr=0.1, inner_steps=400,
                    cg_steps=2 * n)
    got, _, _ = learner.meta_grad(params, buffers, tasks)
    assert _rel(got, want_g) < 1e-6, _rel(got, want_g)
    # the inner solution itself
    phi0, _ = learner.adapt(params, buffers, tasks.support_x[0], tasks.support_y[0])
    torch.testing.assert_close(_flat(phi0), phis[0], rtol=1e-9, atol=1e-11)
    # few CG steps: an approximation, not the exact value (the test above can fail)
    rough = imaml(model_fn, F.mse_loss, lam=lam, inner_lr=0.1, inner_steps=400, cg_steps=1)
    assert _rel(rough.meta_grad(params, buffers, tasks)[0], want_g) > 1e-4


# -- a plain autograd loop at finite inner steps, BatchNorm, chunks --------------------------------


def _loop_reference(module, tasks, *, lam, lr, steps):
    """Per task: ``steps`` SGD steps on the proximal loss (autograd.grad), dense solve at phi_k."""
    ref = copy.deepcopy(module)
    theta = {k: v.detach() for k, v in ref.named_parameters()}
    total, losses = 0, []
    for t in range(tasks.support_x.shape[0]):
        phi = dict(theta)
        for _ in range(steps):
            phi = {k: v.detach().requires_grad_() for k, v in phi.items()}
            loss = F.mse_loss(functional_call(ref, phi, (tasks.support_x[t],)),
                              tasks.support_y[t])
            g = torch.autograd.grad(loss, list(phi.values()))
            phi = {k: phi[k] - lr * (gk + lam * (phi[k] - theta[k]))
                   for k, gk in zip(phi, g, strict=True)}
        phi = {k: v.detach() for k, v in phi.items()}

        def ls(v, t=t):
            return F.mse_loss(functional_call(ref, _unflat(v, theta), (tasks.support_x[t],)),
                              tasks.support_y[t])

        h = torch.autograd.functional.hessian(ls, _flat(phi))
        q = _flat(phi).requires_grad_()
        lq = F.mse_loss(functional_call(ref, _unflat(q, theta), (tasks.query_x[t],)),
                        tasks.query_y[t])
        (gq,) = torch.autograd.grad(lq, q)
        total = total + torch.linalg.solve(torch.eye(q.numel(), dtype=DT) + h / lam, gq)
        losses.append(lq.detach())
    return _unflat(total / len(losses), theta), torch.stack(losses).mean()


@pytest.mark.parametrize("bn", [False, True])
def test_batched_meta_grad_equals_per_task_loop(bn):
    module = _mlp(bn)
    model_fn, params, buffers = make_functional(module)
    tasks, lam, lr, steps = _tasks(5), 2.0, 0.05, 4
    n = _flat(params).numel()
    want, want_loss = _loop_reference(module, tasks, lam=lam, lr=lr, steps=steps)
    kw = {"lam": lam, "inner_lr": lr, "inner_steps": steps, "cg_steps": 3 * n}
    batched, loss, bufs = imaml(model_fn, F.mse_loss, **kw).meta_grad(params, buffers, tasks)
    chunked, _, bufs_c = imaml(model_fn, F.mse_loss, chunk_size=2, **kw).meta_grad(
        params, buffers, tasks)
    assert _rel(batched, want) < 1e-8, _rel(batched, want)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    for k in want:
        torch.testing.assert_close(chunked[k], batched[k], rtol=1e-10, atol=1e-13, msg=k)
    # one task at a time through the same learner, averaged
    learner = imaml(model_fn, F.mse_loss, **kw)
    singles = [learner.meta_grad(params, buffers, Task(*(f[t:t + 1] for f in tasks)))
               for t in range(5)]
    for k in want:
        mean = torch.stack([s[0][k] for s in singles]).mean(0)
        torch.testing.assert_close(batched[k], mean, rtol=1e-10, atol=1e-13, msg=k)
    if bn:  # post-query running statistics, averaged over tasks
        mean_rm = torch.stack([s[2]["1.running_mean"] for s in singles]).mean(0)
        torch.testing.assert_close(bufs["1.running_mean"], mean_rm, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(bufs_c["1.running_mean"], mean_rm, rtol=1e-12, atol=1e-14)
        assert not torch.equal(bufs["1.running_mean"], buffers["1.running_mean"])


def test_wrt_and_loss_scale_and_inner_opt():
    module = _mlp()
    model_fn, params, buffers = make_functional(module)
    tasks = _tasks(3)
    learner = imaml(model_fn, F.mse_loss, lam=2.0, inner_lr=0.05, inner_steps=3, cg_steps=4)
    full, loss, _ = learner.meta_grad(params, buffers, tasks)
    part, loss2, _ = learner.meta_grad(params, buffers, tasks, wrt={"2.weight"},
                                       loss_scale=torch.tensor(8.0, dtype=DT))
    assert sorted(part) == ["2.weight"]
    torch.testing.assert_close(part["2.weight"], 8 * full["2.weight"], rtol=1e-12, atol=0)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    # torchopt.sgd(lr) as inner_opt is the default inner step
    via_opt = imaml(model_fn, F.mse_loss, lam=2.0, inner_opt=torchopt.sgd(0.05), inner_steps=3,
                    cg_steps=4)
    for k, v in via_opt.meta_grad(params, buffers, tasks)[0].items():
        torch.testing.assert_close(v, full[k], rtol=1e-12, atol=0, msg=k)


# -- compile, the outer step ---------------------------------------------------------------------


def _counting_backend():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    return backend, calls


def test_compiled_outer_step_equals_eager_and_does_not_recompile():
    model_fn, params, buffers = make_functional(_mlp(bn=True))
    learner = imaml(model_fn, F.mse_loss, lam=2.0, inner_lr=0.05, inner_steps=3, cg_steps=4)
    opt = torchopt.sgd(lr=0.1)
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


def test_outer_step_is_sgd_on_the_meta_gradient():
    model_fn, params, buffers = make_functional(_mlp())
    learner = imaml(model_fn, F.mse_loss, lam=2.0, inner_lr=0.05, inner_steps=3, cg_steps=6)
    assert isinstance(learner, MetaLearner) and isinstance(learner, ImplicitMetaLearner)
    opt = torchopt.sgd(lr=0.3)
    state = init_meta_state(learner, params, buffers, opt)
    tasks = _tasks()
    new_state, metrics = make_meta_train_step(learner, opt)(state, tasks)
    g, loss, _ = learner.meta_grad(params, buffers, tasks)
    torch.testing.assert_close(metrics["loss"], loss, rtol=1e-12, atol=0)
    for k in params:
        assert float(g[k].abs().max()) > 0, k
        torch.testing.assert_close(new_state.params[k], params[k] - 0.3 * g[k], rtol=1e-12,
                                   atol=1e-14, msg=k)


# -- memory: the inner loop keeps no autograd graph --------------------------------------------------


def _recording_sgd(lr: float, seen: list) -> torchopt.base.GradientTransformation:
    """``torchopt.sgd(lr)`` that records the gradient and params of every inner step."""
    inner = torchopt.sgd(lr)

    def update(updates, state, *, params=None, inplace=True):
        seen.extend([*updates.values(), *params.values()])
        return inner.update(updates, state, params=params, inplace=inplace)

    return torchopt.base.GradientTransformation(inner.init, update)


def test_inner_loop_keeps_no_autograd_graph():
    """Meta-params that require grad, yet no inner iterate or gradient carries autograd history:
    each step's graph is freed when the step ends, so memory does not grow with inner_steps."""
    model_fn, params, buffers = make_functional(_mlp(bn=True))
    theta = {k: v.clone().requires_grad_() if v.is_floating_point() else v
             for k, v in params.items()}
    tasks = _tasks(2)
    seen: list = []
    learner = imaml(model_fn, F.mse_loss, lam=2.0, inner_opt=_recording_sgd(0.05, seen),
                    inner_steps=12, cg_steps=2)
    phi, bufs = learner.adapt(theta, buffers, tasks.support_x[0], tasks.support_y[0])
    assert len(seen) == 12 * 2 * len(theta)
    assert all(t.grad_fn is None and not t.requires_grad for t in seen)
    assert all(v.grad_fn is None and not v.requires_grad for v in [*phi.values(), *bufs.values()])
    g, loss, bufs = learner.meta_grad(theta, buffers, tasks)
    assert all(v.grad_fn is None for v in [*g.values(), loss, *bufs.values()])
    # the same iterates without the detach would carry history (the check can fail)
    w = theta["0.weight"]
    assert (w - 0.05 * (w - theta["0.weight"].detach())).grad_fn is not None


# -- dropout: randomness= ---------------------------------------------------------------------


def test_dropout_needs_randomness_and_same_masks_repeat_across_copies():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1)).to(DT)
    model_fn, params, buffers = make_functional(net)
    tasks = _tasks(1)
    copies = Task(*(f.expand(6, *f.shape[1:]) for f in tasks))
    kw = {"lam": 2.0, "inner_lr": 0.05, "inner_steps": 3, "cg_steps": 4}
    with pytest.raises(RuntimeError, match=r"ImplicitMetaLearner\.meta_grad\(meta_params, "
                       r"buffers, tasks\): the model draws random numbers .*randomness="):
        imaml(model_fn, F.mse_loss, **kw).meta_grad(params, buffers, tasks)
    out = {}
    for mode, t in (("same", copies), ("different", copies), ("single", tasks)):
        torch.manual_seed(5)
        learner = imaml(model_fn, F.mse_loss, randomness="same" if mode == "single" else mode,
                        **kw)
        out[mode] = learner.meta_grad(params, buffers, t)
    for k in params:
        torch.testing.assert_close(out["same"][0][k], out["single"][0][k], rtol=1e-12,
                                   atol=1e-14, msg=k)
        assert torch.isfinite(out["different"][0][k]).all()
    assert not torch.allclose(out["different"][1], out["single"][1])  # copies drew own masks


# -- errors -------------------------------------------------------------------------------------


def test_bad_arguments_raise_clear_errors():
    def m(p, b, x):
        return x @ p["w"], b

    with pytest.raises(ValueError, match=r"imaml\(lam=\.\.\.\): expected a finite number > 0.*got 0"):
        imaml(m, F.mse_loss, lam=0)
    with pytest.raises(ValueError, match=r"imaml\(lam=\.\.\.\).*got -1\.0"):
        imaml(m, F.mse_loss, lam=-1.0)
    with pytest.raises(ValueError, match=r"imaml\(lam=\.\.\.\).*got nan"):
        imaml(m, F.mse_loss, lam=float("nan"))
    with pytest.raises(ValueError, match=r"imaml\(cg_steps=\.\.\.\): expected an int >= 1.*got 0"):
        imaml(m, F.mse_loss, cg_steps=0)
    with pytest.raises(ValueError, match=r"imaml\(cg_steps=\.\.\.\).*got 2\.5"):
        imaml(m, F.mse_loss, cg_steps=2.5)
    with pytest.raises(ValueError, match=r"imaml\(cg_damping=\.\.\.\): expected a finite number "
                                         r">= 0.*got -0\.1"):
        imaml(m, F.mse_loss, cg_damping=-0.1)
    with pytest.raises(ValueError, match=r"MetaLearner\(inner_steps=\.\.\.\): expected an int >= 1"):
        imaml(m, F.mse_loss, inner_steps=0)
    with pytest.raises(ValueError, match=r"inner_opt makes the inner steps and would ignore "
                                         r"inner_lr"):
        imaml(m, F.mse_loss, inner_lr=0.1, inner_opt=torchopt.sgd(0.1))
    with pytest.raises(ValueError, match=r"randomness must be one of"):
        imaml(m, F.mse_loss, randomness="sometimes")
    learner = imaml(m, F.mse_loss)
    with pytest.raises(ValueError, match=r"ImplicitMetaLearner\.meta_loss: iMAML's meta-gradient "
                                         r"is implicit.*use meta_grad"):
        learner.meta_loss({"w": torch.zeros(1, 1)}, {}, _tasks())
    with pytest.raises(TypeError, match=r"ImplicitMetaLearner\.meta_grad.*expected tasks as a "
                                        r"Task"):
        learner.meta_grad({"w": torch.zeros(1, 1)}, {}, (1, 2))
