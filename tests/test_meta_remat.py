"""MetaLearner(remat=True) == remat=False == a per-task loop of autograd.grad(create_graph=True).

float64 on the CPU: the checkpointed reverse pass (Hessian-vector products, _remat.py) of
second-order MAML, ANIL and Meta-SGD, on an MLP and a small conv net, for 1, 3 and 5 inner
steps; with chunks, BatchNorm, ``wrt``, ``loss_scale`` and torch.compile; the refusals; and a
count of the saved activations that grows with the inner steps without remat and not with it.
"""

from __future__ import annotations

import copy
import weakref

import optree
import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from torchfn.functional import make_functional
from torchfn.meta import (
    LR_PREFIX,
    MetaLearner,
    anil,
    fomaml,
    init_meta_state,
    make_meta_train_step,
    maml,
    meta_sgd,
    reptile,
)
from torchfn.meta._tasks import Task
from torchfn.optim import adam

DT = torch.float64
LR = 0.1


def _mlp(bn: bool = False) -> nn.Module:
    torch.manual_seed(3)
    norm = [nn.BatchNorm1d(6)] if bn else []
    return nn.Sequential(nn.Linear(2, 6), *norm, nn.Tanh(), nn.Linear(6, 3)).to(DT)


def _conv() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 3 * 3, 3)).to(DT)


def _tasks(net: str, n: int = 3) -> Task:
    gen = torch.Generator().manual_seed(1)
    shape = (2,) if net == "mlp" else (1, 5, 5)
    return Task(torch.randn(n, 4, *shape, generator=gen, dtype=DT),
                torch.randint(0, 3, (n, 4), generator=gen),
                torch.randn(n, 5, *shape, generator=gen, dtype=DT),
                torch.randint(0, 3, (n, 5), generator=gen))


def _head(name: str) -> bool:  # the last Linear of either net
    return name.startswith(("2.", "3."))


def _rates(meta):
    gen = torch.Generator().manual_seed(5)
    return {k: v * (0.5 + torch.rand(v.shape, generator=gen, dtype=DT))
            if k.startswith(LR_PREFIX) else v for k, v in meta.items()}


def _loop_reference(module, tasks, steps, *, head=None, lrs=None):
    """Per task: ``steps`` SGD steps with autograd.grad(create_graph=True), then query loss."""
    ref = copy.deepcopy(module)
    names = [k for k, _ in ref.named_parameters()]
    params = dict(ref.named_parameters())
    lr_t = {k: v.clone().requires_grad_() for k, v in (lrs or {}).items()}
    adapted = [k for k in names if head is None or head(k)]
    n = tasks.support_x.shape[0]
    total = 0
    for t in range(n):
        fast = dict(params)
        for _ in range(steps):
            loss = F.cross_entropy(functional_call(ref, fast, (tasks.support_x[t],)),
                                   tasks.support_y[t])
            g = torch.autograd.grad(loss, [fast[k] for k in adapted], create_graph=True)
            for k, gk in zip(adapted, g, strict=True):
                fast[k] = fast[k] - (lr_t[k] if lrs else LR) * gk
        total = total + F.cross_entropy(functional_call(ref, fast, (tasks.query_x[t],)),
                                        tasks.query_y[t])
    total = total / n
    grads = torch.autograd.grad(total, [params[k] for k in names] + list(lr_t.values()))
    keys = names + [LR_PREFIX + k for k in lr_t]
    return dict(zip(keys, grads, strict=True)), total.detach()


def _build(kind, model_fn, steps, remat, **kw):
    kw = {"inner_steps": steps, "inner_lr": LR, "remat": remat, **kw}
    if kind == "maml":
        return maml(model_fn, F.cross_entropy, **kw)
    if kind == "anil":
        return anil(model_fn, F.cross_entropy, head=_head, **kw)
    return meta_sgd(model_fn, F.cross_entropy, **kw)


def _close(got, want, rtol=1e-9, atol=1e-12):
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("steps", [1, 3, 5])
@pytest.mark.parametrize("net", ["mlp", "conv"])
@pytest.mark.parametrize("kind", ["maml", "anil", "meta_sgd"])
def test_remat_equals_unrolled_and_loop(kind, net, steps):
    module = _mlp() if net == "mlp" else _conv()
    model_fn, params, buffers = make_functional(module)
    tasks = _tasks(net)
    plain = _build(kind, model_fn, steps, remat=False)
    remat = _build(kind, model_fn, steps, remat=True)
    meta = plain.init(params)
    if kind == "meta_sgd":
        meta = _rates(meta)
    g_plain, l_plain, _ = plain.meta_grad(meta, buffers, tasks)
    g_remat, l_remat, _ = remat.meta_grad(meta, buffers, tasks)
    lrs = {k[len(LR_PREFIX):]: v for k, v in meta.items() if k.startswith(LR_PREFIX)}
    want, want_loss = _loop_reference(module, tasks, steps,
                                      head=_head if kind == "anil" else None,
                                      lrs=lrs or None)
    _close(g_remat, g_plain)
    _close(g_remat, want)
    torch.testing.assert_close(l_remat, l_plain, rtol=1e-12, atol=0)
    torch.testing.assert_close(l_remat, want_loss, rtol=1e-12, atol=0)
    if kind == "anil":  # the body gets its gradient through every inner step
        assert float(g_remat["0.weight"].abs().sum()) > 0


@pytest.mark.parametrize("kind", ["maml", "meta_sgd"])
def test_remat_with_chunks_wrt_and_loss_scale(kind):
    model_fn, params, buffers = make_functional(_mlp())
    tasks = _tasks("mlp", n=5)
    plain = _build(kind, model_fn, 3, remat=False, chunk_size=2)
    remat = _build(kind, model_fn, 3, remat=True, chunk_size=2)
    meta = _rates(plain.init(params))
    wrt = [k for k in meta if k != "0.bias"]
    scale = torch.tensor(8.0, dtype=DT)
    g_plain, l_plain, _ = plain.meta_grad(meta, buffers, tasks, wrt=wrt, loss_scale=scale)
    g_remat, l_remat, _ = remat.meta_grad(meta, buffers, tasks, wrt=wrt, loss_scale=scale)
    assert "0.bias" not in g_remat
    _close(g_remat, g_plain)
    torch.testing.assert_close(l_remat, l_plain, rtol=1e-12, atol=0)


@pytest.mark.parametrize("train", [True, False])
def test_remat_threads_batchnorm_buffers(train):
    module = _mlp(bn=True).train(train)
    model_fn, params, buffers = make_functional(module)
    if not train:  # non-trivial running statistics
        gen = torch.Generator().manual_seed(7)
        buffers = {k: (v + torch.rand(v.shape, generator=gen, dtype=DT)
                       if v.is_floating_point() else v) for k, v in buffers.items()}
    tasks = _tasks("mlp")
    plain = _build("maml", model_fn, 3, remat=False, chunk_size=2)
    remat = _build("maml", model_fn, 3, remat=True, chunk_size=2)
    g_plain, l_plain, b_plain = plain.meta_grad(params, buffers, tasks)
    g_remat, l_remat, b_remat = remat.meta_grad(params, buffers, tasks)
    _close(g_remat, g_plain)
    torch.testing.assert_close(l_remat, l_plain, rtol=1e-12, atol=0)
    _close(b_remat, b_plain, rtol=1e-12, atol=1e-14)
    if train:
        assert not torch.equal(b_remat["1.running_mean"], buffers["1.running_mean"])


def _counting_backend():
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    return backend, calls


@pytest.mark.parametrize("kind", ["maml", "meta_sgd"])
def test_compiled_remat_equals_eager_and_does_not_recompile(kind):
    model_fn, params, buffers = make_functional(_mlp())
    learner = _build(kind, model_fn, 3, remat=True, chunk_size=2)
    meta = _rates(learner.init(params))
    backend, calls = _counting_backend()
    compiled = torch.compile(learner.meta_grad, backend=backend, fullgraph=True)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        tasks = Task(torch.randn(4, 4, 2, generator=gen, dtype=DT),
                     torch.randint(0, 3, (4, 4), generator=gen),
                     torch.randn(4, 5, 2, generator=gen, dtype=DT),
                     torch.randint(0, 3, (4, 5), generator=gen))
        g_eager, l_eager, _ = learner.meta_grad(meta, buffers, tasks)
        g_comp, l_comp, _ = compiled(meta, buffers, tasks)
        _close(g_comp, g_eager, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(l_comp, l_eager, rtol=1e-12, atol=0)
        assert len(calls) == 1, f"recompiled on call {seed}: {len(calls)} graphs"


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created under it and still alive (activations the
    autograd graph holds count while it holds them)."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.seen = set()

    def _free(self, key, size):
        self.seen.discard(key)
        self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in self.seen or st.nbytes() == 0:
                    continue
                self.seen.add(key)
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(st, self._free, key, st.nbytes())
        return out


def _peak_live_bytes(learner, meta, buffers, tasks) -> int:
    with _LiveBytes() as mode:
        learner.meta_grad(meta, buffers, tasks)
    return mode.peak


def test_live_memory_grows_with_inner_steps_only_without_remat():
    """Without remat every inner step's activations stay alive until the outer backward; with
    it, only the iterates do (a few param-sized tensors per task and step)."""
    model_fn, params, buffers = make_functional(_conv())
    gen = torch.Generator().manual_seed(1)
    n = 2
    tasks = Task(torch.randn(n, 32, 1, 5, 5, generator=gen, dtype=DT),
                 torch.randint(0, 3, (n, 32), generator=gen),
                 torch.randn(n, 5, 1, 5, 5, generator=gen, dtype=DT),
                 torch.randint(0, 3, (n, 5), generator=gen))
    peaks = {(steps, remat): _peak_live_bytes(_build("maml", model_fn, steps, remat=remat),
                                              params, buffers, tasks)
             for steps in (1, 5) for remat in (False, True)}
    param_bytes = sum(v.numel() * v.element_size() for v in params.values())
    iterates = 4 * 2 * n * param_bytes  # 4 more steps: <= 2 param-sized tensors per task each
    assert peaks[(5, True)] - peaks[(1, True)] <= iterates, peaks
    assert peaks[(5, False)] - peaks[(1, False)] > 10 * iterates, peaks
    assert peaks[(5, True)] < peaks[(5, False)] / 3, peaks


def test_remat_refusals_name_the_option():
    model_fn, _, _ = make_functional(_mlp())
    with pytest.raises(ValueError, match=r"remat=True, inner_opt=.*default plain-SGD"):
        maml(model_fn, F.cross_entropy, inner_opt=torchopt.sgd(0.1, momentum=0.9), remat=True)
    with pytest.raises(ValueError, match=r"remat=True, inner_opt=.*default plain-SGD"):
        meta_sgd(model_fn, F.cross_entropy, inner_opt=torchopt.adam(0.1), remat=True)
    with pytest.raises(ValueError, match=r"remat=True, randomness='different'.*new masks"):
        maml(model_fn, F.cross_entropy, randomness="different", remat=True)
    with pytest.raises(ValueError, match=r"remat=True, first_order=True.*nothing to rematerialise"):
        MetaLearner(model_fn, F.cross_entropy, first_order=True, remat=True)
    with pytest.raises(ValueError, match=r"remat=True, reptile=True.*nothing to rematerialise"):
        MetaLearner(model_fn, F.cross_entropy, reptile=True, remat=True)
    with pytest.raises(ValueError, match=r"MetaLearner\(remat=\.\.\.\): expected a bool, got 1"):
        maml(model_fn, F.cross_entropy, remat=1)
    with pytest.raises(TypeError, match="remat"):
        fomaml(model_fn, F.cross_entropy, remat=True)
    with pytest.raises(TypeError, match="remat"):
        reptile(model_fn, F.cross_entropy, remat=True)
    assert "remat=True" in repr(maml(model_fn, F.cross_entropy, remat=True))


def test_remat_meta_sgd_with_adapt_filter_and_layer_norm():
    torch.manual_seed(6)
    module = nn.Sequential(nn.Linear(2, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    model_fn, params, buffers = make_functional(module)
    tasks = _tasks("mlp")
    head = lambda name: name.startswith(("1.", "3."))  # noqa: E731
    plain = meta_sgd(model_fn, F.cross_entropy, inner_steps=3, adapt_filter=head, inner_lr=LR)
    remat = meta_sgd(model_fn, F.cross_entropy, inner_steps=3, adapt_filter=head, inner_lr=LR,
                     remat=True)
    meta = _rates(plain.init(params))
    assert sorted(k for k in meta if k.startswith(LR_PREFIX)) == [
        LR_PREFIX + k for k in ("1.bias", "1.weight", "3.bias", "3.weight")]
    g_plain, _, _ = plain.meta_grad(meta, buffers, tasks)
    g_remat, _, _ = remat.meta_grad(meta, buffers, tasks)
    _close(g_remat, g_plain)
    assert float(g_remat["0.weight"].abs().sum()) > 0


def test_compiled_remat_train_step_equals_unrolled_step():
    model_fn, params, buffers = make_functional(_mlp())
    opt = adam(1e-2)
    steps = {r: make_meta_train_step(_build("anil", model_fn, 3, remat=r, chunk_size=2), opt)
             for r in (False, True)}
    backend, calls = _counting_backend()
    compiled = torch.compile(steps[True], backend=backend, fullgraph=True)
    s_plain = s_comp = init_meta_state(_build("anil", model_fn, 3, remat=False), params,
                                       buffers, opt)
    for i in range(2):
        tasks = _tasks("mlp", n=4)
        s_plain, m_plain = steps[False](s_plain, tasks)
        s_comp, m_comp = compiled(s_comp, tasks)
        torch.testing.assert_close(m_comp["loss"], m_plain["loss"], rtol=1e-12, atol=0)
        _close(s_comp.params, s_plain.params, rtol=1e-10, atol=1e-13)
        assert len(calls) == 1, f"recompiled at step {i}: {len(calls)} graphs"
