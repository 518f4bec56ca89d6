"""The eager multi-tensor (``torch._foreach_*``) fast path of adam/adamw/sgd and of the step
core's update application equals the per-leaf loop bit for bit on CPU, and is not taken where
an update is differentiated, compiled or transformed."""

from __future__ import annotations

import optree
import pytest
import torch
import torchopt

import torchfn._checks as _checks
import torchfn.optim._adam as _adam
from torchfn.functional import init_train_state, make_train_step
from torchfn.optim import adam, adamw, scale_by_adam, sgd

_INT64_MAX = torch.iinfo(torch.int64).max


@pytest.fixture
def spy(monkeypatch):
    """Count the multi-tensor calls of torchfn.optim._adam: taken / refused."""
    calls = {"fast": 0, "slow": 0}
    orig = _adam._foreach_map

    def wrapped(*a, **k):
        r = orig(*a, **k)
        calls["fast" if r is not None else "slow"] += 1
        return r

    monkeypatch.setattr(_adam, "_foreach_map", wrapped)
    return calls


def _params(dtype, mixed=False):
    g = torch.Generator().manual_seed(0)
    p = {f"w{i}": torch.randn(5, 2 + i, generator=g, dtype=dtype) for i in range(6)}
    if mixed:  # a second (device, dtype) group
        p["h"] = torch.randn(4, generator=g, dtype=torch.float64)
        p["s"] = torch.randn((), generator=g, dtype=torch.float64)
    return p


def _run(make, params, fast, steps=4, none_at=None):
    """``steps`` updates from init; grads fixed by a seed; leaf w2 has no grad at step
    ``none_at``. Return every param and state leaf."""
    old = _checks._USE_FOREACH
    _checks._USE_FOREACH = fast
    try:
        g = torch.Generator().manual_seed(1)
        opt = make()
        state, p = opt.init(params), params
        for k in range(steps):
            grads = {n: torch.randn(t.shape, generator=g, dtype=t.dtype) * 3
                     for n, t in p.items()}
            if k == none_at:
                grads["w2"] = None
            updates, state = opt.update(grads, state, params=p, inplace=False)
            p = torchopt.apply_updates(p, updates, inplace=False)
        return optree.tree_leaves((p, state))
    finally:
        _checks._USE_FOREACH = old


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


_CONFIGS = {
    "adam": lambda: adam(1e-2),
    "adam_l2": lambda: adam(1e-2, weight_decay=0.1),
    "adam_maximize_eps_root": lambda: adam(1e-2, maximize=True, eps_root=1e-8, eps=1e-6),
    "adam_moment_f64": lambda: adam(1e-2, moment_dtype=torch.float64),
    "adam_moment_bf16": lambda: adam(1e-2, moment_dtype=torch.bfloat16),
    "adam_betas": lambda: adam(3e-2, betas=(0.5, 0.7)),
    "adam_tensor_lr": lambda: adam(torch.tensor(1e-2, dtype=torch.float64), weight_decay=0.1),
    "adam_schedule": lambda: adam(torchopt.schedule.linear_schedule(0.01, 0.001, 3, 1)),
    "adamw": lambda: adamw(1e-2, weight_decay=0.1),
    "adamw_maximize": lambda: adamw(1e-2, weight_decay=0.1, maximize=True),
    "adamw_mask": lambda: adamw(1e-2, weight_decay=0.1,
                                mask=lambda p: {k: not k.startswith("w1") for k in p}),
    "sgd": lambda: sgd(0.1, momentum=0.9, weight_decay=0.01, nesterov=True, maximize=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_fast_path_equals_per_leaf_bitwise(name, dtype, spy):
    make = _CONFIGS[name]
    for mixed in (False, True):
        params = _params(dtype, mixed)
        spy.update(fast=0, slow=0)
        fast = _run(make, params, True)
        assert spy["fast"] > 0 and spy["slow"] == 0
        _assert_bitwise(fast, _run(make, params, False))
    if "mask" not in name:  # torchopt's masked() does not take None grads
        params = _params(dtype)
        # a None grad at step 1: per-leaf counts then differ (w2 lags one step)
        _assert_bitwise(_run(make, params, True, none_at=1),
                        _run(make, params, False, none_at=1))


def test_count_saturates_like_the_per_leaf_loop(spy):
    opt = scale_by_adam()
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    state = opt.init(params)
    count = {"a": torch.tensor(_INT64_MAX), "b": torch.tensor(_INT64_MAX - 1)}
    state = state._replace(count=count)
    grads = {"a": torch.full((3,), 2.0), "b": torch.full((2,), -1.0)}
    out = []
    for fast in (True, False):
        _checks._USE_FOREACH = fast
        try:
            out.append(optree.tree_leaves(opt.update(grads, state, inplace=False)))
        finally:
            _checks._USE_FOREACH = True
    assert spy["fast"] == 1
    _assert_bitwise(*out)
    new = opt.update(grads, state, inplace=False)[1].count
    assert int(new["a"]) == _INT64_MAX and int(new["b"]) == _INT64_MAX


def test_fast_path_outputs_are_fresh_tensors():
    params = _params(torch.float32)
    opt = adam(1e-2)
    state = opt.init(params)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    _, new = opt.update(grads, state, params=params, inplace=False)
    ptrs = [t.data_ptr() for t in optree.tree_leaves(new)]
    assert len(set(ptrs)) == len(ptrs)  # no aliasing between leaves (counts included)
    assert all(int(c) == 0 for c in state[0].count.values())  # the input state is untouched


def test_differentiated_updates_take_the_per_leaf_path(spy):
    w0 = torch.randn(3, dtype=torch.float64)

    def unrolled(w, use_func):
        opt = adam(0.1, weight_decay=0.1, eps_root=1e-8)
        params = {"w": w}
        state = opt.init(params)
        for _ in range(2):
            loss = (params["w"] ** 3).sum()
            if use_func:  # inside torch.func.grad: functorch-wrapped leaves
                grads = {"w": 3 * params["w"] ** 2}
            else:
                grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()),
                                                             create_graph=True), strict=True))
            updates, state = opt.update(grads, state, params=params, inplace=False)
            params = torchopt.apply_updates(params, updates, inplace=False)
        return params["w"].sum()

    w = w0.clone().requires_grad_()
    (g_autograd,) = torch.autograd.grad(unrolled(w, False), w)
    assert spy["fast"] == 0 and spy["slow"] > 0
    spy.update(slow=0)
    g_func = torch.func.grad(lambda w: unrolled(w, True))(w0)
    assert spy["fast"] == 0 and spy["slow"] > 0
    torch.testing.assert_close(g_func, g_autograd, rtol=1e-12, atol=1e-12)
    # a learning rate tracked by autograd keeps the per-leaf scale
    lr = torch.tensor(0.1, requires_grad=True)
    opt = adam(lr)
    p = {"w": torch.ones(2)}
    spy.update(fast=0, slow=0)
    u, _ = opt.update({"w": torch.ones(2)}, opt.init(p), inplace=False)
    assert u["w"].requires_grad and spy["slow"] == 1


def test_foreach_ok_refuses_unsafe_leaves():
    t = torch.ones(2)
    assert _checks._foreach_ok([t, torch.ones(3)])
    assert not _checks._foreach_ok([t, None])
    assert not _checks._foreach_ok([t.to_sparse()])
    assert not _checks._foreach_ok([torch.ones(2, requires_grad=True)])
    with torch.no_grad():
        assert _checks._foreach_ok([torch.ones(2, requires_grad=True)])
    assert torch.func.grad(lambda x: (x * float(_checks._foreach_ok([x]))).sum() + x.sum())(
        t).eq(1).all()  # inside a transform: refused (the factor is 0)
    assert _checks._foreach_map(lambda a, b: (a,), [[t], [torch.ones(3)]]) is None  # shapes


def test_train_step_fast_path_equals_per_leaf_bitwise():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    params = {k: v.detach() for k, v in net.named_parameters()}

    def model_fn(p, b, x):
        return torch.func.functional_call(net, p, (x,)), b

    x, y = torch.randn(16, 4), torch.randn(16, 3)
    out = []
    for fast in (True, False):
        _checks._USE_FOREACH = fast
        try:
            opt = adamw(1e-2, weight_decay=0.1)
            step = make_train_step(model_fn, lambda o, t: ((o - t) ** 2).mean(), opt,
                                   max_grad_norm=1.0)
            state = init_train_state(params, {}, opt, seed=0)
            for _ in range(3):
                state, _ = step(state, (x, y))
            out.append(optree.tree_leaves((state.params, state.opt_state)))
        finally:
            _checks._USE_FOREACH = True
    _assert_bitwise(*out)
