"""torchfn's compile-safe adam/adamw against torch.optim, torchopt, finite differences, compile."""

from __future__ import annotations

import pytest
import torch
import torchopt
from torchopt.transform.scale_by_adam import ScaleByAdamState

from torchfn.optim import adam, adamw, scale_by_adam


def _problem(dtype: torch.dtype, seed: int = 0):
    """Return params of a tiny MLP and a loss(params, step) on fresh random data each step."""
    g = torch.Generator().manual_seed(seed)
    params = {
        "0.weight": torch.randn(5, 3, generator=g, dtype=dtype),
        "0.bias": torch.randn(5, generator=g, dtype=dtype),
        "2.weight": torch.randn(2, 5, generator=g, dtype=dtype),
    }
    data = [
        (torch.randn(8, 3, generator=g, dtype=dtype), torch.randn(8, 2, generator=g, dtype=dtype))
        for _ in range(40)
    ]

    def loss(p, t):
        x, y = data[t]
        h = torch.tanh(x @ p["0.weight"].T + p["0.bias"])
        return ((h @ p["2.weight"].T - y) ** 2).mean()

    return params, loss


def _adam_state(chain_state):
    (found,) = [s for s in chain_state if isinstance(s, ScaleByAdamState)]
    return found


def _grads(loss, params, t):
    ps = {k: v.detach().requires_grad_() for k, v in params.items()}
    gs = torch.autograd.grad(loss(ps, t), list(ps.values()))
    return dict(zip(ps, gs, strict=True))


def _run_ours(opt, params, loss, steps):
    state = opt.init(params)
    for t in range(steps):
        updates, state = opt.update(_grads(loss, params, t), state, params=params, inplace=False)
        params = torchopt.apply_updates(params, updates, inplace=False)
    return params, state


def _run_torch(make_opt, params, loss, steps, make_sched=None):
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = make_opt(list(ps.values()))
    sched = make_sched(opt) if make_sched is not None else None
    for t in range(steps):
        opt.zero_grad()
        loss(ps, t).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return {k: v.detach() for k, v in ps.items()}


def _assert_close(a, b, **kw):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **kw)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("maximize", [False, True])
def test_adam_matches_torch_optim_float64(weight_decay, maximize):
    params, loss = _problem(torch.float64)
    kw = dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay, maximize=maximize)
    ours, state = _run_ours(adam(**kw), params, loss, 30)
    ref = _run_torch(lambda ps: torch.optim.Adam(ps, **kw), params, loss, 30)
    _assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    assert not torch.equal(ours["0.bias"], params["0.bias"])
    adam_state = _adam_state(state)
    assert isinstance(adam_state, ScaleByAdamState)
    assert all(int(c) == 30 for c in adam_state.count.values())


def test_adamw_matches_torch_optim_float64():
    params, loss = _problem(torch.float64, seed=1)
    kw = dict(lr=0.03, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.2)
    ours, _ = _run_ours(adamw(**kw), params, loss, 30)
    ref = _run_torch(lambda ps: torch.optim.AdamW(ps, **kw), params, loss, 30)
    _assert_close(ours, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("which", ["adam", "adamw"])
def test_schedule_matches_lambda_lr_float64(which):
    params, loss = _problem(torch.float64, seed=2)
    init_lr, end_lr, n = 0.05, 0.005, 20
    sched = torchopt.schedule.linear_schedule(init_lr, end_lr, transition_steps=n)
    ours_opt = (adam if which == "adam" else adamw)(lr=sched, weight_decay=0.1)
    ours, _ = _run_ours(ours_opt, params, loss, 25)
    torch_cls = torch.optim.Adam if which == "adam" else torch.optim.AdamW

    def factor(t):
        return (init_lr + (end_lr - init_lr) * min(t, n) / n) / init_lr

    ref = _run_torch(
        lambda ps: torch_cls(ps, lr=init_lr, weight_decay=0.1),
        params,
        loss,
        25,
        make_sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor),
    )
    # torchopt's schedule evaluates in float32, so the lr carries float32 rounding
    _assert_close(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"weight_decay": 0.1, "eps_root": 1e-9},
        {"maximize": True, "betas": (0.5, 0.9)},
    ],
)
@pytest.mark.parametrize("which", ["adam", "adamw"])
def test_matches_torchopt_eager(which, kw):
    params, loss = _problem(torch.float32, seed=3)
    ours_fn, ref_fn = (adam, torchopt.adam) if which == "adam" else (adamw, torchopt.adamw)
    ours, ours_state = _run_ours(ours_fn(lr=0.02, **kw), params, loss, 20)
    ref, ref_state = _run_ours(ref_fn(lr=0.02, **kw), params, loss, 20)
    _assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    ours_mu = _adam_state(ours_state).mu
    # torchopt's default (flat) chain keeps the moments as a list in leaf order
    ref_mu = dict(zip(sorted(params), _adam_state(ref_state).mu, strict=True))
    _assert_close(ours_mu, ref_mu, rtol=1e-6, atol=1e-7)


def test_compiled_equals_eager_and_compiles_once():
    params, loss = _problem(torch.float32, seed=4)
    sched = torchopt.schedule.linear_schedule(0.05, 0.01, transition_steps=10)
    opt = adamw(lr=sched, weight_decay=0.1, eps_root=1e-10)
    compiles = 0

    def backend(gm, example_inputs):
        nonlocal compiles
        compiles += 1
        return gm.forward

    def update(params, grads, state):
        updates, state = opt.update(grads, state, params=params, inplace=False)
        return torchopt.apply_updates(params, updates, inplace=False), state

    compiled = torch.compile(update, fullgraph=True, backend=backend)
    p_e, s_e = params, opt.init(params)
    p_c, s_c = params, opt.init(params)
    for t in range(6):
        p_e, s_e = update(p_e, _grads(loss, p_e, t), s_e)
        p_c, s_c = compiled(p_c, _grads(loss, p_c, t), s_c)
        _assert_close(p_c, p_e, rtol=1e-6, atol=1e-6)
    assert compiles == 1


def test_compiled_with_inductor_equals_eager():
    params, loss = _problem(torch.float32, seed=5)
    opt = adam(lr=0.05, weight_decay=0.01)

    def update(params, grads, state):
        updates, state = opt.update(grads, state, params=params, inplace=False)
        return torchopt.apply_updates(params, updates, inplace=False), state

    compiled = torch.compile(update, fullgraph=True)
    p_e, s_e = params, opt.init(params)
    p_c, s_c = params, opt.init(params)
    for t in range(4):
        p_e, s_e = update(p_e, _grads(loss, p_e, t), s_e)
        p_c, s_c = compiled(p_c, _grads(loss, p_c, t), s_c)
    _assert_close(p_c, p_e, rtol=1e-5, atol=1e-6)
    _assert_close(_adam_state(s_c).nu, _adam_state(s_e).nu, rtol=1e-5, atol=1e-9)


def _pow_after_element_loop(code: str, numel: int) -> bool:
    """Whether Inductor's C++ ``code`` computes a ``std::pow`` inside (after the start of) the
    first loop over ``numel`` elements."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if "for(int64_t" in line and f"<static_cast<int64_t>({numel}L)" in line)
    return any("std::pow" in line for line in lines[start:])


@pytest.mark.parametrize("which", ["adam", "stacked"])
def test_compiled_bias_corrections_are_computed_once_not_per_element(which):
    # the bias corrections 1 - beta**count are 0-d: Inductor inlined their float64 pow into
    # the per-element update kernel (compute-bound on a GPU) until compute_once realised them
    from torch._inductor.utils import run_and_get_code

    from torchfn.ops import reference

    g, m, v = torch.randn(4, 1000), torch.zeros(4, 1000), torch.zeros(4, 1000)
    count, lr = torch.tensor(3), torch.full((4,), 0.1)  # inputs: constants would be folded
    if which == "stacked":
        def fn(g, m, v, count):
            return reference.stacked_adam_update(g, m, v, None, count, lr, None)
    else:
        opt = adam(lr=0.1)

        def fn(g, m, v, count):
            state = opt.init({"w": m})
            state = (state[0]._replace(count={"w": count}), *state[1:])
            return opt.update({"w": g}, state, inplace=False)[0]["w"]
    torch._dynamo.reset()
    out, (code, *_) = run_and_get_code(torch.compile(fn, fullgraph=True), g, m, v, count)
    assert "std::pow" in code
    # the stacked update loops over (member, element); adam over the flat leaf
    assert not _pow_after_element_loop(code, 1000 if which == "stacked" else 4000)
    ref = fn(g, m, v, count)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)


def _unrolled(opt_fn, w0, x, y, steps, use_func_grad):
    """Return the loss after ``steps`` differentiable updates of a linear model from ``w0``."""

    def inner_loss(w):
        return ((x @ w - y) ** 2).mean()

    opt = opt_fn()
    params = {"w": w0}
    state = opt.init(params)
    for _ in range(steps):
        if use_func_grad:
            g = torch.func.grad(inner_loss)(params["w"])
        else:
            (g,) = torch.autograd.grad(inner_loss(params["w"]), params["w"], create_graph=True)
        updates, state = opt.update({"w": g}, state, params=params, inplace=False)
        params = torchopt.apply_updates(params, updates, inplace=False)
    return inner_loss(params["w"])


@pytest.mark.parametrize("which", ["adam", "adamw"])
def test_differentiable_through_updates(which):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(10, 3, generator=g, dtype=torch.float64)
    y = torch.randn(10, 1, generator=g, dtype=torch.float64)
    w0 = torch.randn(3, 1, generator=g, dtype=torch.float64)
    fn = adam if which == "adam" else adamw

    def opt_fn():
        return fn(lr=0.1, weight_decay=0.05, eps_root=1e-8)

    def outer(w):
        return _unrolled(opt_fn, w, x, y, 3, use_func_grad=False)

    # finite differences are the reference
    assert torch.autograd.gradcheck(outer, (w0.clone().requires_grad_(),))
    w = w0.clone().requires_grad_()
    (g_autograd,) = torch.autograd.grad(outer(w), w)
    g_func = torch.func.grad(lambda w: _unrolled(opt_fn, w, x, y, 3, use_func_grad=True))(w0)
    torch.testing.assert_close(g_func, g_autograd, rtol=1e-10, atol=1e-12)
    assert g_func.abs().sum() > 0


def test_tensor_lr_is_differentiable():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(10, 3, generator=g, dtype=torch.float64)
    y = torch.randn(10, 1, generator=g, dtype=torch.float64)
    w0 = torch.randn(3, 1, generator=g, dtype=torch.float64)

    def outer(lr):
        w = w0.clone().requires_grad_()  # the inner autograd.grad needs a graph from step 1

        def opt_fn():
            return adamw(lr=lr, weight_decay=0.1, eps_root=1e-8)

        return _unrolled(opt_fn, w, x, y, 3, use_func_grad=False)

    lr = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(outer, (lr,))
    with pytest.raises(ValueError, match=r"0-d tensor, got dtype torch.float64 and shape \(2,\)"):
        adam(lr=torch.ones(2, dtype=torch.float64))


def test_moment_dtype():
    params, loss = _problem(torch.float32, seed=7)
    opt = adam(lr=0.01, moment_dtype=torch.float64)
    state = opt.init(params)
    assert all(m.dtype == torch.float64 for m in _adam_state(state).mu.values())
    grads = _grads(loss, params, 0)
    updates, state = opt.update(grads, state, params=params, inplace=False)
    assert all(u.dtype == torch.float32 for u in updates.values())
    assert all(v.dtype == torch.float64 for v in _adam_state(state).nu.values())
    ref_opt = adam(lr=0.01)
    params64 = {k: v.double() for k, v in params.items()}
    ref, _ = ref_opt.update(
        {k: v.double() for k, v in grads.items()}, ref_opt.init(params64), inplace=False
    )
    _assert_close(updates, {k: v.float() for k, v in ref.items()}, rtol=1e-6, atol=0)


def test_none_gradient_leaves_state_untouched():
    opt = scale_by_adam()
    params = {"a": torch.ones(2), "b": torch.ones(3)}
    state = opt.init(params)
    updates, new_state = opt.update({"a": torch.ones(2), "b": None}, state, inplace=False)
    assert updates["b"] is None
    assert int(new_state.count["a"]) == 1 and int(new_state.count["b"]) == 0
    assert torch.equal(new_state.mu["b"], state.mu["b"])
    torch.testing.assert_close(updates["a"], torch.ones(2))


def test_out_of_place():
    params, loss = _problem(torch.float32)
    opt = adam(lr=0.1, weight_decay=0.1)
    state = opt.init(params)
    grads = _grads(loss, params, 0)
    before = {k: v.clone() for k, v in grads.items()}
    _, new_state = opt.update(grads, state, params=params, inplace=True)
    _assert_close(grads, before, rtol=0, atol=0)
    assert all(int(c) == 0 for c in _adam_state(state).count.values())
    assert all(torch.count_nonzero(m) == 0 for m in _adam_state(state).mu.values())
    assert all(int(c) == 1 for c in _adam_state(new_state).count.values())


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"lr": -1.0}, r"adam\(lr=...\): expected a float >= 0.*got -1.0"),
        ({"betas": (1.0, 0.9)}, r"betas\[0\] must be in \[0, 1\), got 1.0"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
        ({"eps": -1.0}, r"eps >= 0"),
        ({"weight_decay": -0.1}, r"weight_decay >= 0, got -0.1"),
    ],
)
def test_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        adam(**kw)


def test_weight_decay_needs_params():
    opt = adam(weight_decay=0.1)
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="needs the parameters"):
        opt.update({"w": torch.ones(2)}, opt.init(params), inplace=False)


@pytest.mark.parametrize("kw", [dict(momentum=0.9), dict(momentum=0.9, dampening=0.3),
                                dict(momentum=0.8, nesterov=True),
                                dict(momentum=0.5, weight_decay=0.1), dict()])
def test_sgd_equals_torch_optim_sgd_and_resumes_exactly(kw) -> None:
    """torchfn.optim.sgd == torch.optim.SGD over 6 steps (float64), and 3 steps + a state
    handed to a NEW optimizer object + 3 steps == 6 steps (torchopt.sgd(momentum>0) keeps a
    first-call flag outside its state and fails this); compiled (fullgraph) == eager."""
    import torchopt

    from torchfn.optim import sgd

    torch.manual_seed(0)
    w0 = torch.randn(4, 3, dtype=torch.float64)
    grads = [torch.randn(4, 3, dtype=torch.float64) for _ in range(6)]
    ref = w0.clone().requires_grad_(True)
    topt = torch.optim.SGD([ref], lr=0.1, **kw)
    for g in grads:
        ref.grad = g.clone()
        topt.step()

    def run(opt, state, p, gs):
        for g in gs:
            u, state = opt.update({"w": g}, state, params=p, inplace=False)
            p = torchopt.apply_updates(p, u, inplace=False)
        return p, state

    opt = sgd(0.1, **kw)
    full, _ = run(opt, opt.init({"w": w0}), {"w": w0}, grads)
    torch.testing.assert_close(full["w"], ref.detach(), rtol=1e-12, atol=1e-12)
    half, state = run(opt, opt.init({"w": w0}), {"w": w0}, grads[:3])
    fresh = sgd(0.1, **kw)  # a resumed process builds its optimizer anew
    resumed, _ = run(fresh, state, half, grads[3:])
    assert torch.equal(resumed["w"], full["w"])
    compiled = torch.compile(lambda s, p, g: fresh.update({"w": g}, s, params=p, inplace=False),
                             fullgraph=True, backend="aot_eager")
    s_e = s_c = fresh.init({"w": w0})
    for g in grads[:3]:
        u_e, s_e = fresh.update({"w": g}, s_e, params={"w": w0}, inplace=False)
        u_c, s_c = compiled(s_c, {"w": w0}, g)
        assert torch.equal(u_e["w"], u_c["w"])


def test_sgd_argument_errors() -> None:
    from torchfn.optim import sgd, trace

    with pytest.raises(ValueError, match=r"trace\(nesterov=True\): Nesterov momentum needs "
                                         r"momentum > 0 and dampening 0"):
        sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"trace\(momentum=...\): expected momentum >= 0"):
        trace(momentum=-1.0)
    with pytest.raises(ValueError, match=r"sgd\(lr=...\): expected a float >= 0"):
        sgd(-0.1)
