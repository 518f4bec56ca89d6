"""Op 4 (fused Adam/SGD over stacked parameters): kernels == twins, == N separate torch.optim
optimizers with different lr and weight decay per member, == torchfn.optim.adam per member,
opcheck, gradcheck/gradgradcheck, jvp, vmap, the transform matrix, compile without recompiles,
and input errors. CUDA variants skip where no GPU is present."""

from __future__ import annotations

import pytest
import torch
import torchopt
from _op_matrix import (
    DEVICES,
    DIFFS,
    MODES,
    OpCase,
    assert_close_for_dtype,
    assert_matrix_case,
    matrix_inputs,
)
from _op_matrix import need_device as _need_device

from torchfn import ops, optim
from torchfn.ops import _dispatch, reference
from torchfn.ops import _stacked_optim as so
from torchfn.ops import _stacked_optim_multi as som

F64 = torch.float64


def _rand(shape, dtype, device, seed, scale=1.0, positive=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=gen, dtype=F64) if positive else \
        torch.randn(shape, generator=gen, dtype=F64)
    return (scale * x).to(device, dtype)


def _adam_inputs(shape, dtype, device, moment_dtype=None, per_member=True, seed=0):
    n = shape[0]
    moment_dtype = moment_dtype or dtype
    work = torch.float64 if dtype == F64 else torch.float32
    grad = _rand(shape, dtype, device, seed)
    mu = _rand(shape, moment_dtype, device, seed + 1, 0.1)
    nu = _rand(shape, moment_dtype, device, seed + 2, 0.01, positive=True)
    param = _rand(shape, dtype, device, seed + 3)
    if per_member:
        lr = _rand((n,), work, device, seed + 4, 0.1, positive=True) + 0.01
        wd = _rand((n,), work, device, seed + 5, 0.5, positive=True)
        count = torch.arange(1, n + 1, device=device)
    else:
        lr = torch.tensor(0.05, dtype=work, device=device)
        wd = torch.tensor(0.2, dtype=work, device=device)
        count = torch.tensor(4, device=device)
    return grad, mu, nu, param, count, lr, wd


# ---------------------------------------------------------------------------------------------
# kernels == twins

DTYPES = [torch.float32, F64, torch.bfloat16, torch.float16]
SHAPES = [(1,), (3, 7), (4, 8), (5, 3, 9), (2, 40_000)]  # inner % 4 != 0; > 1 parallel chunk
ADAM_CONFIGS = [  # (with weight decay, decoupled, maximize)
    pytest.param(False, False, False, id="plain"),
    pytest.param(True, False, True, id="l2-maximize"),
    pytest.param(True, True, False, id="decoupled"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("wd_on", "decoupled", "maximize"), ADAM_CONFIGS)
def test_adam_kernel_matches_twin(kernels, device, dtype, shape, wd_on, decoupled, maximize):
    _need_device(kernels, device)
    moment_dtypes = [dtype] + ([torch.float32] if dtype in (torch.bfloat16, torch.float16) else [])
    for moment_dtype in moment_dtypes:
        for per_member in (True, False):
            g, mu, nu, p, count, lr, wd = _adam_inputs(shape, dtype, device, moment_dtype,
                                                       per_member, seed=len(shape))
            args = (g, mu, nu, p if wd_on else None, count, lr, wd if wd_on else None,
                    0.9, 0.99, 1e-8, 1e-12, decoupled, maximize)
            got = torch.ops.torchfn.stacked_adam_update(*args)
            want = reference.stacked_adam_update(*args)
            for a, b in zip(got, want, strict=True):
                assert_close_for_dtype(a, b)
            assert got[1].dtype == moment_dtype


SGD_CONFIGS = [  # (buffer, with weight decay, nesterov, dampening, maximize)
    pytest.param(False, False, False, 0.0, False, id="plain"),
    pytest.param(False, True, False, 0.0, True, id="l2-maximize"),
    pytest.param(True, True, False, 0.3, False, id="momentum-dampening"),
    pytest.param(True, False, True, 0.0, False, id="nesterov"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("has_buf", "wd_on", "nesterov", "dampening", "maximize"), SGD_CONFIGS)
def test_sgd_kernel_matches_twin(kernels, device, dtype, shape, has_buf, wd_on, nesterov,
                                 dampening, maximize):
    _need_device(kernels, device)
    for per_member in (True, False):  # per-member counts include first steps (count == 1)
        g, buf, _, p, count, lr, wd = _adam_inputs(shape, dtype, device, None, per_member)
        args = (g, buf if has_buf else None, p if wd_on else None, count, lr,
                wd if wd_on else None, 0.9, dampening, nesterov, maximize)
        got_u, got_b = torch.ops.torchfn.stacked_sgd_update(*args)
        want_u, want_b = reference.stacked_sgd_update(*args)
        assert_close_for_dtype(got_u, want_u)
        if has_buf:
            assert_close_for_dtype(got_b, want_b)
        else:
            assert want_b is None and got_b.shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_misaligned_inputs(kernels, device):
    _need_device(kernels, device)
    g, mu, nu, p, _, lr, wd = _adam_inputs((4, 6, 8), torch.float32, device)
    views = [lambda t: t.transpose(1, 2), lambda t: t.reshape(-1)[1:].reshape(1, -1)[:, :95]]
    for view in views:
        args = (view(g), view(mu), view(nu), view(p), torch.tensor(2, device=device),
                lr[:1] if view(g).shape[0] == 1 else lr,
                wd[:1] if view(g).shape[0] == 1 else wd, 0.9, 0.999, 1e-8, 0.0, True, False)
        for a, b in zip(torch.ops.torchfn.stacked_adam_update(*args),
                        reference.stacked_adam_update(*args), strict=True):
            assert a.is_contiguous()
            assert_close_for_dtype(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_leaf(kernels, device):
    _need_device(kernels, device)
    g = torch.zeros(3, 0, device=device)
    lr = torch.ones(3, device=device)
    u, m, v = torch.ops.torchfn.stacked_adam_update(g, g, g, None, torch.tensor(1, device=device),
                                                    lr, None, 0.9, 0.99, 1e-8, 0.0, False, False)
    assert u.shape == m.shape == v.shape == (3, 0)


# ---------------------------------------------------------------------------------------------
# The multi-leaf ops (one launch per step) == the per-leaf twins

MULTI_SHAPES = [(4, 8), (4, 3, 5), (4,), (4, 0), (4, 64, 9), (4, 2, 6)]


def _multi_leaves(dtype, device, moment_dtype, n_leaves):
    shapes = (MULTI_SHAPES * 5)[:n_leaves]
    leaves = [_adam_inputs(shape, dtype, device, moment_dtype, seed=7 * i)
              for i, shape in enumerate(shapes)]
    _, _, _, _, count, lr, wd = leaves[0]
    return ([x[0] for x in leaves], [x[1] for x in leaves], [x[2] for x in leaves],
            [x[3] for x in leaves], count, lr, wd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_leaves", [1, 6, 26], ids=lambda n: f"{n}leaves")  # > 24 per launch
def test_multi_kernels_match_twins(kernels, device, dtype, n_leaves):
    _need_device(kernels, device)
    moment_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else None
    grads, mus, nus, params, count, lr, wd = _multi_leaves(dtype, device, moment_dtype, n_leaves)
    for (wd_on, decoupled, maximize), per_member in [((True, True, False), True),
                                                     ((True, False, True), False),
                                                     ((False, False, False), True)]:
        c, lr_, wd_ = (count, lr, wd) if per_member else (count[1], lr[0], wd[0])
        hyper = (0.9, 0.99, 1e-8, 1e-12, decoupled, maximize)
        got = torch.ops.torchfn.stacked_adam_update_multi(
            grads, mus, nus, params if wd_on else [], c, lr_, wd_ if wd_on else None, *hyper)
        for i in range(n_leaves):
            want = reference.stacked_adam_update(grads[i], mus[i], nus[i],
                                                 params[i] if wd_on else None, c, lr_,
                                                 wd_ if wd_on else None, *hyper)
            for out, w in zip(got, want, strict=True):
                assert_close_for_dtype(out[i], w)
    for has_buf, nesterov in [(True, False), (True, True), (False, False)]:
        bufs = mus if has_buf else []
        got_u, got_b = torch.ops.torchfn.stacked_sgd_update_multi(
            grads, bufs, params, count, lr, wd, 0.9, 0.0 if nesterov else 0.2, nesterov, False)
        assert len(got_b) == (n_leaves if has_buf else 0)
        for i in range(n_leaves):
            want_u, want_b = reference.stacked_sgd_update(
                grads[i], bufs[i] if has_buf else None, params[i], count, lr, wd, 0.9,
                0.0 if nesterov else 0.2, nesterov, False)
            assert_close_for_dtype(got_u[i], want_u)
            if has_buf:
                assert_close_for_dtype(got_b[i], want_b)


@pytest.mark.parametrize("device", DEVICES)
def test_multi_misaligned_and_non_contiguous_leaves(kernels, device):
    """Leaves at odd offsets take the scalar path inside the same launch as aligned ones."""
    _need_device(kernels, device)
    base = _rand((4, 97), torch.float32, device, 1)
    grads = [base[:, 1:33], base[:, :32], base.t().contiguous().t()[:, 5:13]]
    states = [_rand(g.shape, torch.float32, device, 2 + i, 0.1).abs() for i, g in
              enumerate(grads)]
    lr = torch.rand(4, device=device)
    count = torch.tensor(2, device=device)
    u, m, v = torch.ops.torchfn.stacked_adam_update_multi(grads, states, states, [], count, lr,
                                                          None, 0.9, 0.999, 1e-8, 0.0, False,
                                                          False)
    for i, g in enumerate(grads):
        want = reference.stacked_adam_update(g, states[i], states[i], None, count, lr, None)
        for out, w in zip((u[i], m[i], v[i]), want, strict=True):
            assert_close_for_dtype(out, w)


@pytest.mark.parametrize("device", DEVICES)
def test_multi_gradcheck_jvp_and_vmap(kernels, device):
    """The multi-leaf Functions: gradcheck/gradgradcheck, jvp and vmap equal the twins."""
    _need_device(kernels, device)
    leaves = [_adam_leaf_inputs(device, seed=s) for s in (0, 1)]
    leaves[1] = tuple(t[:, :2] if t.ndim == 2 else t for t in leaves[1])  # another shape
    count = torch.tensor([1, 2, 4], device=device)
    hyper = (0.8, 0.95, 1e-3, 1e-4, True, False)

    def adam(g0, g1, m0, m1, v0, v1, p0, p1, lr, wd):
        u, m, v = som.stacked_adam_update_multi([g0, g1], [m0, m1], [v0, v1], [p0, p1], count, lr, wd, hyper)
        return (*u, *m, *v)

    def adam_twin(g0, g1, m0, m1, v0, v1, p0, p1, lr, wd):
        outs = [reference.stacked_adam_update(g, m, v, p, count, lr, wd, *hyper)
                for g, m, v, p in ((g0, m0, v0, p0), (g1, m1, v1, p1))]
        return tuple(o[j] for j in range(3) for o in outs)

    inputs = tuple(leaves[i][j] for j in range(4) for i in range(2)) + leaves[0][4:]
    leaf_inputs = tuple(t.detach().requires_grad_(True) for t in inputs)
    assert torch.autograd.gradcheck(adam, leaf_inputs)
    assert torch.autograd.gradgradcheck(adam, leaf_inputs)
    tangents = tuple(_rand(t.shape, F64, device, 60 + i) for i, t in enumerate(inputs))
    torch.testing.assert_close(torch.func.jvp(adam, inputs, tangents),
                               torch.func.jvp(adam_twin, inputs, tangents))
    batched = tuple(torch.stack([t, 1.5 * t]) for t in inputs)
    got = torch.func.vmap(adam)(*batched)
    for b in range(2):
        want = adam_twin(*(t[b] for t in batched))
        for x, w in zip(got, want, strict=True):
            torch.testing.assert_close(x[b], w)

    def sgd(g0, g1, b0, b1, p0, p1, lr, wd):
        u, b = som.stacked_sgd_update_multi([g0, g1], [b0, b1], [p0, p1], count, lr, wd, (0.9, 0.1, False,
                                                                          True))
        return (*u, *b)

    sgd_inputs = tuple(t.detach().requires_grad_(True) for t in (*inputs[:4], *inputs[6:]))
    assert torch.autograd.gradcheck(sgd, sgd_inputs)
    assert torch.autograd.gradgradcheck(sgd, sgd_inputs)
    sgd_t = (*tangents[:4], *tangents[6:])
    _, got_t = torch.func.jvp(sgd, sgd_inputs, sgd_t)

    def sgd_twin(g0, g1, b0, b1, p0, p1, lr, wd):
        outs = [reference.stacked_sgd_update(g, b, p, count, lr, wd, 0.9, 0.1, False, True)
                for g, b, p in ((g0, b0, p0), (g1, b1, p1))]
        return tuple(o[j] for j in range(2) for o in outs)

    _, want_t = torch.func.jvp(sgd_twin, sgd_inputs, sgd_t)
    torch.testing.assert_close(got_t, want_t)


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_over_the_optimizer_update(kernels, device):
    """vmap(opt.update) over B independent ensembles equals B separate updates."""
    _need_device(kernels, device)
    b_, n = 3, 4
    grads = {"w": _rand((b_, n, 6), F64, device, 1), "b": _rand((b_, n), F64, device, 2)}
    params = {"w": _rand((b_, n, 6), F64, device, 3), "b": _rand((b_, n), F64, device, 4)}
    lr = torch.tensor([0.1, 0.01, 0.02, 0.05], dtype=F64, device=device)
    for opt in (optim.stacked_adam(lr=lr, weight_decay=0.1, decoupled=True),
                optim.stacked_sgd(lr=lr, momentum=0.9, weight_decay=0.1)):
        state0 = opt.init({k: v[0] for k, v in params.items()})

        def step(g, p, opt=opt, state0=state0):
            updates, state = opt.update(g, state0, params=p)
            return updates, state

        got_u, _ = torch.func.vmap(step)(grads, params)
        for i in range(b_):
            want_u, _ = step({k: v[i] for k, v in grads.items()},
                             {k: v[i] for k, v in params.items()})
            for k in grads:
                torch.testing.assert_close(got_u[k][i], want_u[k])


# ---------------------------------------------------------------------------------------------
# == N separate torch.optim optimizers, each with its own lr and weight decay


def _members_problem(n: int, device: str, seed: int = 0):
    """Return params {'w': (n, 3, 4), 'b': (n, 3)} and a per-member loss (different data)."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(n, 3, 4, generator=gen, dtype=F64),
              "b": torch.randn(n, 3, generator=gen, dtype=F64)}
    xs = torch.randn(n, 5, 4, generator=gen, dtype=F64)
    ys = torch.randn(n, 5, 3, generator=gen, dtype=F64)
    params = {k: v.to(device) for k, v in params.items()}
    xs, ys = xs.to(device), ys.to(device)

    def member_loss(w, b, i):
        return ((xs[i] @ w.T + b - ys[i]) ** 2).mean() + 0.1 * (w ** 4).sum()

    return params, member_loss


def _stacked_grads(params, member_loss):
    n = params["w"].shape[0]
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    total = sum(member_loss(leaves["w"][i], leaves["b"][i], i) for i in range(n))
    gw, gb = torch.autograd.grad(total, [leaves["w"], leaves["b"]])
    return {"w": gw, "b": gb}


def _run_stacked(opt, params, member_loss, steps):
    state = opt.init(params)
    for _ in range(steps):
        grads = _stacked_grads(params, member_loss)
        updates, state = opt.update(grads, state, params=params, inplace=False)
        params = torchopt.apply_updates(params, updates, inplace=False)
    return params


def _run_torch_optim(make_opt, params, member_loss, steps):
    n = params["w"].shape[0]
    out_w, out_b = [], []
    for i in range(n):
        w = params["w"][i].detach().clone().requires_grad_(True)
        b = params["b"][i].detach().clone().requires_grad_(True)
        opt = make_opt([w, b], i)
        for _ in range(steps):
            opt.zero_grad()
            member_loss(w, b, i).backward()
            opt.step()
        out_w.append(w.detach())
        out_b.append(b.detach())
    return {"w": torch.stack(out_w), "b": torch.stack(out_b)}


N_MEMBERS = 4
LRS = [0.01, 0.03, 0.002, 0.05]
WDS = [0.0, 0.1, 0.5, 0.02]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["adam", "adam-l2-maximize", "adamw", "adam-eps-betas"])
def test_stacked_adam_equals_torch_optim_per_member(kernels, device, kind):
    _need_device(kernels, device)
    params, member_loss = _members_problem(N_MEMBERS, device)
    lr = torch.tensor(LRS, dtype=F64, device=device)
    wd = torch.tensor(WDS, dtype=F64, device=device)
    betas, eps, maximize = (0.9, 0.999), 1e-8, False
    if kind == "adam":
        opt = optim.stacked_adam(lr=lr)
        cls, wds = torch.optim.Adam, [0.0] * N_MEMBERS
    elif kind == "adam-l2-maximize":
        opt = optim.stacked_adam(lr=lr, weight_decay=wd, maximize=True)
        cls, wds, maximize = torch.optim.Adam, WDS, True
    elif kind == "adamw":
        opt = optim.stacked_adam(lr=lr, weight_decay=wd, decoupled=True)
        cls, wds = torch.optim.AdamW, WDS
    else:
        betas, eps = (0.5, 0.9), 1e-3
        opt = optim.stacked_adam(lr=0.02, betas=betas, eps=eps, weight_decay=0.05)
        cls, wds = torch.optim.Adam, [0.05] * N_MEMBERS
        lr = torch.full((N_MEMBERS,), 0.02, dtype=F64)

    assert _dispatch.use_kernel("stacked_adam_update", params["w"])
    got = _run_stacked(opt, params, member_loss, steps=5)
    want = _run_torch_optim(
        lambda ps, i: cls(ps, lr=float(lr[i]), betas=betas, eps=eps, weight_decay=wds[i],
                          maximize=maximize, foreach=False),
        params, member_loss, steps=5)
    for k in ("w", "b"):
        assert not torch.equal(got[k], params[k])
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["plain", "l2", "momentum-dampening", "nesterov-maximize"])
def test_stacked_sgd_equals_torch_optim_per_member(kernels, device, kind):
    _need_device(kernels, device)
    params, member_loss = _members_problem(N_MEMBERS, device, seed=1)
    lr = torch.tensor(LRS, dtype=F64, device=device)
    wd = torch.tensor(WDS, dtype=F64, device=device)
    cfg = {
        "plain": {},
        "l2": {"weight_decay": wd},
        "momentum-dampening": {"momentum": 0.8, "dampening": 0.25, "weight_decay": wd},
        "nesterov-maximize": {"momentum": 0.9, "nesterov": True, "maximize": True,
                              "weight_decay": wd},
    }[kind]
    opt = optim.stacked_sgd(lr=lr, **cfg)
    got = _run_stacked(opt, params, member_loss, steps=5)

    def make(ps, i):
        kw = dict(cfg)
        kw["weight_decay"] = float(wd[i]) if "weight_decay" in cfg else 0.0
        return torch.optim.SGD(ps, lr=float(lr[i]), foreach=False, **kw)

    want = _run_torch_optim(make, params, member_loss, steps=5)
    for k in ("w", "b"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_stacked_adam_equals_functional_adam_per_member(kernels, decoupled):
    params, member_loss = _members_problem(3, "cpu", seed=2)
    lrs, wds = [0.02, 0.005, 0.04], [0.3, 0.0, 0.1]
    opt = optim.stacked_adam(lr=torch.tensor(lrs, dtype=F64), weight_decay=torch.tensor(wds,
                           dtype=F64), decoupled=decoupled, eps_root=1e-10)
    got = _run_stacked(opt, params, member_loss, steps=4)
    for i in range(3):
        make = optim.adamw if decoupled else optim.adam
        single = make(lr=lrs[i], weight_decay=wds[i], eps_root=1e-10)
        p = {"w": params["w"][i], "b": params["b"][i]}
        state = single.init(p)
        for _ in range(4):
            leaves = {k: v.detach().requires_grad_(True) for k, v in p.items()}
            gw, gb = torch.autograd.grad(member_loss(leaves["w"], leaves["b"], i),
                                         [leaves["w"], leaves["b"]])
            updates, state = single.update({"w": gw, "b": gb}, state, params=p, inplace=False)
            p = torchopt.apply_updates(p, updates, inplace=False)
        for k in ("w", "b"):
            torch.testing.assert_close(got[k][i], p[k], rtol=1e-10, atol=1e-12)


def test_lr_schedule_and_none_grads(kernels):
    params, member_loss = _members_problem(2, "cpu", seed=3)
    schedule = torchopt.schedule.linear_schedule(0.05, 0.01, transition_steps=3)
    opt = optim.stacked_adam(lr=schedule)
    got = _run_stacked(opt, params, member_loss, steps=3)
    want = {"w": [], "b": []}
    for i in range(2):
        single = optim.adam(lr=schedule)
        p = {"w": params["w"][i], "b": params["b"][i]}
        state = single.init(p)
        for _ in range(3):
            leaves = {k: v.detach().requires_grad_(True) for k, v in p.items()}
            gw, gb = torch.autograd.grad(member_loss(leaves["w"], leaves["b"], i),
                                         [leaves["w"], leaves["b"]])
            updates, state = single.update({"w": gw, "b": gb}, state, inplace=False)
            p = torchopt.apply_updates(p, updates, inplace=False)
        want["w"].append(p["w"])
        want["b"].append(p["b"])
    for k in ("w", "b"):
        torch.testing.assert_close(got[k], torch.stack(want[k]), rtol=1e-10, atol=1e-12)
    # A None gradient leaves its moments untouched; the shared count advances.
    state = opt.init(params)
    updates, new_state = opt.update({"w": torch.ones_like(params["w"]), "b": None}, state)
    assert updates["b"] is None and new_state.mu["b"] is state.mu["b"]
    assert int(new_state.count) == 1 and not torch.equal(new_state.mu["w"], state.mu["w"])


def test_low_precision_params_keep_float32_moments(kernels):
    params = {"w": torch.randn(3, 8, dtype=torch.bfloat16)}
    opt = optim.stacked_adam(lr=torch.tensor([0.1, 0.01, 0.001]))
    state = opt.init(params)
    assert state.mu["w"].dtype == torch.float32 and state.nu["w"].dtype == torch.float32
    grads = {"w": torch.randn(3, 8, dtype=torch.bfloat16)}
    updates, state = opt.update(grads, state, params=params)
    assert updates["w"].dtype == torch.bfloat16 and state.mu["w"].dtype == torch.float32
    # the same step in float32 from the bf16 values, rounded once
    ref = optim.stacked_adam(lr=torch.tensor([0.1, 0.01, 0.001]))
    u32, _ = ref.update({"w": grads["w"].float()}, ref.init({"w": params["w"].float()}))
    torch.testing.assert_close(updates["w"], u32["w"].to(torch.bfloat16))
    state16 = optim.stacked_adam(moment_dtype=torch.bfloat16).init(params)
    assert state16.mu["w"].dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# opcheck, gradcheck, gradgradcheck, jvp, vmap


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(kernels, device):
    _need_device(kernels, device)
    g, mu, nu, p, count, lr, wd = _adam_inputs((3, 5), torch.float32, device)
    adam = torch.ops.torchfn.stacked_adam_update.default
    sgd = torch.ops.torchfn.stacked_sgd_update.default
    for op, args in [
        (adam, (g, mu, nu, p, count, lr, wd, 0.9, 0.999, 1e-8, 0.0, False, False)),
        (adam, (g, mu, nu, None, count[0], lr[0], None, 0.8, 0.9, 1e-6, 1e-9, True, True)),
        (adam, (g.t(), mu.t(), nu.t(), p.t(), count[:1].expand(5), lr[0].expand(5),
                wd[0].expand(5), 0.9, 0.999, 1e-8, 0.0, True, False)),  # non-contiguous
        (sgd, (g, mu, p, count, lr, wd, 0.9, 0.1, False, False)),
        (sgd, (g, None, None, count, lr, None, 0.0, 0.0, False, True)),
        (torch.ops.torchfn.stacked_adam_update_multi.default,
         ([g, g[:, :2]], [mu, mu[:, :2]], [nu, nu[:, :2]], [p, p[:, :2]], count, lr, wd, 0.9,
          0.999, 1e-8, 0.0, True, False)),
        (torch.ops.torchfn.stacked_adam_update_multi.default,
         ([g], [mu], [nu], [], count[0], lr, None, 0.9, 0.999, 1e-8, 0.0, False, False)),
        (torch.ops.torchfn.stacked_sgd_update_multi.default,
         ([g, g.t().contiguous().t()], [mu, mu], [], count, lr, None, 0.9, 0.0, True, False)),
        (torch.ops.torchfn.stacked_sgd_update_multi.default,
         ([g], [], [p], count, lr, wd, 0.0, 0.0, False, False)),
    ]:
        torch.library.opcheck(op, args)


def _adam_leaf_inputs(device, seed=0):
    g, mu, nu, p, _, lr, wd = _adam_inputs((3, 4), F64, device, seed=seed)
    nu = nu + 0.05  # keep sqrt away from 0
    return g, mu, nu, p, lr, wd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decoupled", [False, True], ids=["l2", "decoupled"])
def test_adam_gradcheck_and_gradgradcheck(kernels, device, decoupled):
    _need_device(kernels, device)
    inputs = tuple(t.requires_grad_(True) for t in _adam_leaf_inputs(device))
    count = torch.tensor([1, 2, 5], device=device)

    def f(g, mu, nu, p, lr, wd):
        assert _dispatch.use_kernel("stacked_adam_update", g)
        return ops.stacked_adam_update(g, mu, nu, count, lr, param=p, weight_decay=wd,
                                       betas=(0.8, 0.95), eps=1e-3, eps_root=1e-4,
                                       decoupled=decoupled, maximize=decoupled)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_sgd_gradcheck_and_gradgradcheck(kernels, device, nesterov):
    _need_device(kernels, device)
    g, buf, _, p, lr, wd = _adam_leaf_inputs(device, seed=3)
    inputs = tuple(t.requires_grad_(True) for t in (g, buf, p, lr, wd))
    count = torch.tensor([1, 2, 3], device=device)  # member 0 takes its first step

    def f(g, buf, p, lr, wd):
        u, b = ops.stacked_sgd_update(g, buf, count, lr, param=p, weight_decay=wd,
                                      momentum=0.7, dampening=0.0 if nesterov else 0.2,
                                      nesterov=nesterov)
        return u, b

    def f_plain(g, p, lr, wd):
        return ops.stacked_sgd_update(g, None, count, lr, param=p, weight_decay=wd,
                                      maximize=True)[0]

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)
    plain_inputs = (inputs[0], inputs[2], inputs[3], inputs[4])
    assert torch.autograd.gradcheck(f_plain, plain_inputs)
    assert torch.autograd.gradgradcheck(f_plain, plain_inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_jvp_matches_twin(kernels, device):
    _need_device(kernels, device)
    g, mu, nu, p, lr, wd = _adam_leaf_inputs(device)
    count = torch.tensor(3, device=device)
    primals = (g, mu, nu, p, lr, wd)
    tangents = tuple(_rand(t.shape, F64, device, 40 + i) for i, t in enumerate(primals))
    for decoupled in (False, True):
        def op(g, mu, nu, p, lr, wd, decoupled=decoupled):
            return ops.stacked_adam_update(g, mu, nu, count, lr, param=p, weight_decay=wd,
                                           eps_root=1e-6, decoupled=decoupled)

        def twin(g, mu, nu, p, lr, wd, decoupled=decoupled):
            return reference.stacked_adam_update(g, mu, nu, p, count, lr, wd, 0.9, 0.999, 1e-8,
                                                 1e-6, decoupled, False)

        got = torch.func.jvp(op, primals, tangents)
        want = torch.func.jvp(twin, primals, tangents)
        torch.testing.assert_close(got, want)
    for nesterov, buf in [(False, mu), (True, mu), (False, None)]:
        def sgd(g, p, lr, wd, buf=buf, nesterov=nesterov):
            return ops.stacked_sgd_update(g, buf, torch.tensor([1, 2, 2], device=device), lr,
                                          param=p, weight_decay=wd, momentum=0.9,
                                          nesterov=nesterov)[0]

        def sgd_twin(g, p, lr, wd, buf=buf, nesterov=nesterov):
            return reference.stacked_sgd_update(g, buf, p, torch.tensor([1, 2, 2], device=device),
                                                lr, wd, 0.9, 0.0, nesterov, False)[0]

        sub = (g, p, lr, wd)
        sub_t = (tangents[0], tangents[3], tangents[4], tangents[5])
        torch.testing.assert_close(torch.func.jvp(sgd, sub, sub_t),
                                   torch.func.jvp(sgd_twin, sub, sub_t))


def _adam_row_fns(device):
    g, mu, nu, _, _, lr, wd = _adam_inputs((3, 4), F64, device)
    nu = nu + 0.05
    count = torch.tensor(2, device=device)
    hyper = (0.9, 0.999, 1e-8, 1e-6, True, False)

    def op(x):
        return ops.stacked_adam_update(x, mu, nu, count, lr, param=0.5 * x, weight_decay=wd,
                                       eps_root=1e-6, decoupled=True)[0].sum(0)

    def function(x):
        return so._StackedAdamFn.apply(x, mu, nu, 0.5 * x, count, lr, wd, *hyper)[0].sum(0)

    def twin(x):
        return reference.stacked_adam_update(x, mu, nu, 0.5 * x, count, lr, wd, *hyper)[0].sum(0)

    return g, op, function, twin


@pytest.mark.parametrize("device", DEVICES)
def test_second_order_forward_and_mixed_modes_match_twin(kernels, device):
    """jacfwd(jacfwd) (routed to the twin), jacrev(jacfwd) and jacfwd(jacrev) (the Function)."""
    _need_device(kernels, device)
    x, op, _, twin = _adam_row_fns(device)
    for outer, inner in [(torch.func.jacfwd, torch.func.jacfwd),
                         (torch.func.jacrev, torch.func.jacfwd),
                         (torch.func.jacfwd, torch.func.jacrev)]:
        want = outer(inner(twin))(x)
        assert want.abs().sum() > 0
        torch.testing.assert_close(outer(inner(op))(x), want, rtol=1e-10, atol=1e-14)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="pytorch #197867: forward-over-forward through an autograd.Function's "
                   "jvp drops the rule's dependence on the primal (XPASS: torch fixed it; the "
                   "nested_forward_ad routing in _dispatch can then go)")
def test_bug_reproducer_forward_over_forward_of_the_function(kernels):
    x, _, function, twin = _adam_row_fns("cpu")
    jac2 = torch.func.jacfwd(torch.func.jacfwd(function))(x)
    torch.testing.assert_close(jac2, torch.func.jacfwd(torch.func.jacfwd(twin))(x))


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_over_an_outer_axis(kernels, device):
    """vmap over B stacks of N members equals a loop; batched and unbatched hyperparameters."""
    _need_device(kernels, device)
    b_, n = 3, 4
    g, mu, nu, p, _, _, _ = _adam_inputs((b_, n, 5), F64, device)
    lr_b = _rand((b_, n), F64, device, 9, 0.1, positive=True)
    lr_u = _rand((n,), F64, device, 10, 0.1, positive=True)
    wd_b = _rand((b_,), F64, device, 11, positive=True)  # one decay per batch entry (0-d)
    count_b = torch.tensor([1, 2, 7], device=device)

    def step(g, mu, nu, p, lr, wd, count):
        return ops.stacked_adam_update(g, mu, nu, count, lr, param=p, weight_decay=wd,
                                       decoupled=True)

    for lr, lr_dim in [(lr_b, 0), (lr_u, None)]:
        got = torch.func.vmap(step, in_dims=(0, 0, None, 0, lr_dim, 0, 0))(
            g, mu, nu[0], p, lr, wd_b, count_b)
        for i in range(b_):
            want = reference.stacked_adam_update(
                g[i], mu[i], nu[0], p[i], count_b[i], lr[i] if lr_dim == 0 else lr, wd_b[i],
                0.9, 0.999, 1e-8, 0.0, True, False)
            for a, w in zip(got, want, strict=True):
                torch.testing.assert_close(a[i], w)
    # SGD without a buffer; the vmapped axis at dim 1
    got_u, got_b = torch.func.vmap(
        lambda g, lr: ops.stacked_sgd_update(g, None, 1, lr), in_dims=(1, 0), out_dims=(0, None))(
        g.movedim(0, 1), lr_b)
    assert got_b is None
    for i in range(b_):
        want_u, _ = reference.stacked_sgd_update(g[i], None, None, torch.tensor(1), lr_b[i], None)
        torch.testing.assert_close(got_u[i], want_u)


def test_meta_gradient_wrt_per_member_lr_equals_per_member_loop(kernels):
    """d(loss after 2 inner Adam steps)/d lr[n] == the same through torchfn.optim.adam."""
    params, member_loss = _members_problem(3, "cpu", seed=4)
    lr0 = torch.tensor([0.05, 0.01, 0.02], dtype=F64)

    def inner(params, lr, wd):
        opt = optim.stacked_adam(lr=lr, weight_decay=wd, decoupled=True, eps_root=1e-12)
        state = opt.init(params)
        for _ in range(2):
            grads = torch.func.grad(
                lambda ps: sum(member_loss(ps["w"][i], ps["b"][i], i) for i in range(3)))(params)
            updates, state = opt.update(grads, state, params=params)
            params = torchopt.apply_updates(params, updates, inplace=False)
        return sum(member_loss(params["w"][i], params["b"][i], i) for i in range(3))

    wd0 = torch.tensor([0.1, 0.2, 0.3], dtype=F64)
    got_lr, got_wd = torch.func.grad(inner, argnums=(1, 2))(params, lr0, wd0)

    def member(i, lr, wd):
        opt = optim.adamw(lr=lr, weight_decay=0.0, eps_root=1e-12)
        p = {"w": params["w"][i], "b": params["b"][i]}
        state = opt.init(p)
        for _ in range(2):
            grads = torch.func.grad(lambda q: member_loss(q["w"], q["b"], i))(p)
            updates, state = opt.update(grads, state, params=p)
            # decoupled decay: p <- p - lr * wd * p - lr * adam_direction
            p = {k: p[k] + updates[k] - lr * wd * p[k] for k in p}
        return member_loss(p["w"], p["b"], i)

    for i in range(3):
        want_lr, want_wd = torch.func.grad(member, argnums=(1, 2))(i, lr0[i], wd0[i])
        torch.testing.assert_close(got_lr[i], want_lr, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got_wd[i], want_wd, rtol=1e-9, atol=1e-12)
    assert got_lr.abs().min() > 0


# ---------------------------------------------------------------------------------------------
# The transform matrix: a meta-learning style function of x through one update


def _adam_fn(update):
    def fn(x):
        n = x.shape[0]
        lr = torch.linspace(0.05, 0.2, n, dtype=x.dtype, device=x.device)
        wd = torch.linspace(0.1, 0.3, n, dtype=x.dtype, device=x.device)
        mu, nu = 0.3 * torch.cos(x), 0.2 * torch.sin(x) ** 2 + 0.05
        u, m, v = update(torch.tanh(x) + x, mu, nu, x, torch.tensor(2, device=x.device), lr, wd)
        return x + u + 0.5 * m + 0.25 * v

    return fn


def _sgd_fn(update):
    def fn(x):
        n = x.shape[0]
        lr = torch.linspace(0.05, 0.2, n, dtype=x.dtype, device=x.device)
        wd = torch.linspace(0.1, 0.3, n, dtype=x.dtype, device=x.device)
        u, b = update(torch.tanh(x) + x * x, 0.3 * torch.cos(x), x,
                      torch.tensor(2, device=x.device), lr, wd)
        return x + u + 0.5 * b

    return fn


CASES = [
    OpCase(
        "adam",
        _adam_fn(lambda g, mu, nu, p, c, lr, wd: ops.stacked_adam_update(
            g, mu, nu, c, lr, param=p, weight_decay=wd, eps_root=1e-6)),
        _adam_fn(lambda g, mu, nu, p, c, lr, wd: reference.stacked_adam_update(
            g, mu, nu, p, c, lr, wd, 0.9, 0.999, 1e-8, 1e-6)),
        _adam_fn(lambda g, mu, nu, p, c, lr, wd: so._StackedAdamFn.apply(
            g, mu, nu, p, c, lr, wd, 0.9, 0.999, 1e-8, 1e-6, False, False)),
    ),
    OpCase(
        "adamw",
        _adam_fn(lambda g, mu, nu, p, c, lr, wd: ops.stacked_adam_update(
            g, mu, nu, c, lr, param=p, weight_decay=wd, eps_root=1e-6, decoupled=True)),
        _adam_fn(lambda g, mu, nu, p, c, lr, wd: reference.stacked_adam_update(
            g, mu, nu, p, c, lr, wd, 0.9, 0.999, 1e-8, 1e-6, True)),
        _adam_fn(lambda g, mu, nu, p, c, lr, wd: so._StackedAdamFn.apply(
            g, mu, nu, p, c, lr, wd, 0.9, 0.999, 1e-8, 1e-6, True, False)),
    ),
    OpCase(
        "sgd",
        _sgd_fn(lambda g, b, p, c, lr, wd: ops.stacked_sgd_update(
            g, b, c, lr, param=p, weight_decay=wd, momentum=0.9, nesterov=True)),
        _sgd_fn(lambda g, b, p, c, lr, wd: reference.stacked_sgd_update(
            g, b, p, c, lr, wd, 0.9, 0.0, True)),
        _sgd_fn(lambda g, b, p, c, lr, wd: so._StackedSgdFn.apply(
            g, b, p, c, lr, wd, 0.9, 0.0, True, False)),
    ),
]

_MULTI_HYPER = (0.9, 0.999, 1e-8, 1e-6, True, False)


def _adam_multi_fn(how):
    def fn(x):
        n = x.shape[0]
        lr = torch.linspace(0.05, 0.2, n, dtype=x.dtype, device=x.device)
        wd = torch.linspace(0.1, 0.3, n, dtype=x.dtype, device=x.device)
        grads, params = [torch.tanh(x) + x, x * x], [x, torch.sin(x)]
        mus = [0.3 * torch.cos(x), 0.1 * x]
        nus = [0.2 * torch.sin(x) ** 2 + 0.05, 0.1 * x * x + 0.02]
        count = torch.tensor(2, device=x.device)
        if how == "twin":
            outs = [reference.stacked_adam_update(g, m, v, p, count, lr, wd, *_MULTI_HYPER)
                    for g, m, v, p in zip(grads, mus, nus, params, strict=True)]
            u, m, v = ([o[j] for o in outs] for j in range(3))
        elif how == "op":
            u, m, v = som.stacked_adam_update_multi(grads, mus, nus, params, count, lr, wd, _MULTI_HYPER)
        else:
            out = som._StackedAdamMultiFn.apply(2, True, *grads, *mus, *nus, *params, count, lr,
                                               wd, *_MULTI_HYPER)
            u, m, v = out[:2], out[2:4], out[4:]
        return x + u[0] + u[1] + 0.5 * (m[0] + m[1]) + 0.25 * (v[0] + v[1])

    return fn


CASES.append(OpCase("adam_multi", _adam_multi_fn("op"), _adam_multi_fn("twin"),
                    _adam_multi_fn("function")))
_OP_OF = {"adam": "stacked_adam_update", "adamw": "stacked_adam_update",
          "sgd": "stacked_sgd_update", "adam_multi": "stacked_adam_update"}
CASE_PARAMS = [pytest.param(c, id=c.name) for c in CASES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("diff", DIFFS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_matrix(kernels, case, mode, diff, device):
    _need_device(kernels, device)
    x, _, _ = matrix_inputs(device)
    assert _dispatch.use_kernel(_OP_OF[case.name], x)
    assert_matrix_case(case, mode, diff, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("diff", ["grad", "grad_grad"])
def test_matrix_raw_function_eager(kernels, device, diff):
    """The autograd.Functions themselves (no dispatch) equal the twins under functorch."""
    _need_device(kernels, device)
    for case in CASES:
        assert_matrix_case(case, "eager", diff, device, use="function")


# ---------------------------------------------------------------------------------------------
# torch.compile: compiled steps == eager, no recompiles across steps


def _counting_backend():
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    return backend, compiles


@pytest.mark.parametrize("which", ["adamw", "sgd"])
def test_compiled_steps_equal_eager_without_recompiles(kernels, which):
    params, member_loss = _members_problem(N_MEMBERS, "cpu", seed=5)
    lr = torch.tensor(LRS, dtype=F64)
    wd = torch.tensor(WDS, dtype=F64)
    opt = (optim.stacked_adam(lr=lr, weight_decay=wd, decoupled=True) if which == "adamw"
           else optim.stacked_sgd(lr=lr, momentum=0.9, dampening=0.1, weight_decay=0.01))

    def step(params, state):
        grads = torch.func.grad(
            lambda ps: sum(member_loss(ps["w"][i], ps["b"][i], i) for i in range(N_MEMBERS))
        )(params)
        updates, state = opt.update(grads, state, params=params)
        return torchopt.apply_updates(params, updates, inplace=False), state

    backend, compiles = _counting_backend()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    p_eager, s_eager = params, opt.init(params)
    p_comp, s_comp = params, opt.init(params)
    for _ in range(4):
        p_eager, s_eager = step(p_eager, s_eager)
        p_comp, s_comp = compiled(p_comp, s_comp)
    assert len(compiles) == 1, f"recompiled: {len(compiles)} graphs for 4 steps"
    for k in ("w", "b"):
        torch.testing.assert_close(p_comp[k], p_eager[k], rtol=1e-12, atol=1e-14)


def test_compiled_inductor_adam_step(kernels):
    """One Inductor compile: the twin the dispatch rule picks, fused, equals eager."""
    g, mu, nu, p, count, lr, wd = _adam_inputs((4, 33), torch.float32, "cpu")

    def step(g, mu, nu, p, count, lr, wd):
        return ops.stacked_adam_update(g, mu, nu, count, lr, param=p, weight_decay=wd,
                                       decoupled=True)

    got = torch.compile(step, fullgraph=True)(g, mu, nu, p, count, lr, wd)
    want = step(g, mu, nu, p, count, lr, wd)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------
# Errors


def test_lr_shape_error_names_n_and_the_shape():
    g = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"stacked_adam_update\(lr=...\): expected a float, a "
                                         r"0-d tensor or a tensor of shape \(N,\) = \(4,\).*"
                                         r"got shape \(3,\)"):
        ops.stacked_adam_update(g, g, g, 1, torch.ones(3))
    with pytest.raises(ValueError, match=r"weight_decay=...\).*\(N,\) = \(4,\).*got shape "
                                         r"\(4, 1\)"):
        ops.stacked_sgd_update(g, None, 1, 0.1, param=g, weight_decay=torch.ones(4, 1))
    opt = optim.stacked_adam(lr=torch.ones(3))
    with pytest.raises(ValueError, match=r"stacked_adam\(lr=...\).*\(N,\) = \(4,\).*got shape "
                                         r"\(3,\)"):
        opt.init({"w": g})
    with pytest.raises(ValueError, match=r"stacked_sgd\(lr=...\).*got shape \(2, 2\)"):
        optim.stacked_sgd(lr=torch.ones(2, 2))


def test_leaves_with_different_n_are_refused():
    params = {"w": torch.zeros(4, 3), "b": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"stacked_adam.init\(params\): every leaf of params "
                                         r"must stack the same number of members N.*N=5 for "
                                         r"'b' and N=4 for 'w'"):
        optim.stacked_adam().init(params)
    opt = optim.stacked_sgd(lr=0.1)
    state = opt.init({"w": torch.zeros(4, 3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"stacked_sgd.update.*N=3 for 'b' and N=4 for 'w'"):
        opt.update({"w": torch.zeros(4, 3), "b": torch.zeros(3)}, state)
    with pytest.raises(ValueError, match=r"leaf 'b' of params is 0-d"):
        optim.stacked_adam().init({"w": torch.zeros(4, 3), "b": torch.zeros(())})


def test_dtype_and_device_mismatches_are_refused():
    g = torch.zeros(2, 3)
    with pytest.raises(TypeError, match=r"stacked_adam_update\(mu=...\): expected "
                                        r"mu.dtype=torch.float32 like grad, got torch.float64"):
        ops.stacked_adam_update(g, g.double(), g, 1, 0.1)
    with pytest.raises(TypeError, match=r"mu=..., nu=...\): expected one dtype"):
        ops.stacked_adam_update(g.bfloat16(), g, g.bfloat16(), 1, 0.1)
    with pytest.raises(ValueError, match=r"\(param=...\): expected param of grad's shape "
                                         r"\(2, 3\), got \(3, 2\)"):
        ops.stacked_adam_update(g, g, g, 1, 0.1, param=g.t(), weight_decay=0.1)
    with pytest.raises(ValueError, match=r"\(lr=...\): expected lr on grad's device cpu, got "
                                         r"meta"):
        ops.stacked_adam_update(g, g, g, 1, torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"\(nu=...\): expected nu on grad's device cpu, got "
                                         r"meta"):
        ops.stacked_adam_update(g, g, g.to("meta"), 1, 0.1)
    with pytest.raises(TypeError, match=r"\(lr=...\): expected a floating-point tensor, got "
                                        r"lr.dtype=torch.int64"):
        ops.stacked_adam_update(g, g, g, 1, torch.ones(2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"\(count=...\): expected an int or an integer tensor"):
        ops.stacked_adam_update(g, g, g, torch.tensor(1.0), 0.1)
    with pytest.raises(ValueError, match=r"\(count=...\).*\(N,\) = \(2,\), got shape \(3,\)"):
        ops.stacked_sgd_update(g, None, torch.ones(3, dtype=torch.int64), 0.1)
    with pytest.raises(TypeError, match=r"\(grad=...\): expected a floating-point tensor"):
        ops.stacked_sgd_update(torch.zeros(2, 3, dtype=torch.int64), None, 1, 0.1)
    with pytest.raises(ValueError, match=r"\(grad=...\): expected a stacked leaf .* got a 0-d"):
        ops.stacked_sgd_update(torch.zeros(()), None, 1, 0.1)
    with pytest.raises(TypeError, match=r"moment_dtype=torch.float32\): expected None, the "
                                        r"parameter dtype torch.float64"):
        optim.stacked_adam(moment_dtype=torch.float32).init({"w": g.double()})


def test_bad_hyperparameters_are_refused():
    g = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"weight_decay=...\): weight decay needs the "
                                         "parameters; pass param="):
        ops.stacked_adam_update(g, g, g, 1, 0.1, weight_decay=0.1)
    opt = optim.stacked_adam(weight_decay=0.1)
    with pytest.raises(ValueError, match=r"stacked_adam.update.*weight decay needs the "
                                         r"parameters; call update\(grads, state, "
                                         r"params=params\)"):
        opt.update({"w": g}, opt.init({"w": g}))
    with pytest.raises(ValueError, match=r"stacked_sgd\(nesterov=True\): Nesterov momentum "
                                         "requires momentum > 0 and dampening == 0"):
        optim.stacked_sgd(lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"stacked_adam\(betas=...\)"):
        optim.stacked_adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"stacked_sgd\(lr=...\): expected a float >= 0"):
        optim.stacked_sgd(lr=-1.0)


def test_raw_kernels_check_their_arguments(kernels):
    g = torch.zeros(2, 3)
    lr = torch.ones(2)
    c = torch.tensor(1)
    adam = torch.ops.torchfn.stacked_adam_update
    with pytest.raises(RuntimeError, match=r"torchfn::stacked_adam_update: argument 'lr' must "
                                           r"be 0-d or have shape \(N,\) = \(2,\).*got shape "
                                           r"\[3\]"):
        adam(g, g, g, None, c, torch.ones(3), None, 0.9, 0.99, 1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"argument 'lr' must have dtype Float \(the compute "
                                           r"dtype of grad's Float\), got Double"):
        adam(g, g, g, None, c, lr.double(), None, 0.9, 0.99, 1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"argument 'mu' must have the dtype of 'grad' "
                                           r"\(Float\), got Double"):
        adam(g, g.double(), g, None, c, lr, None, 0.9, 0.99, 1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"argument 'count' must be int64, got Int"):
        adam(g, g, g, None, c.int(), lr, None, 0.9, 0.99, 1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"arguments 'param' and 'weight_decay' must be given "
                                           "together"):
        adam(g, g, g, g, c, lr, None, 0.9, 0.99, 1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"torchfn::stacked_sgd_update: argument "
                                           r"'momentum_buffer' must have the shape of 'grad' "
                                           r"\[2, 3\], got \[3, 2\]"):
        torch.ops.torchfn.stacked_sgd_update(g, g.t(), None, c, lr, None, 0.9, 0.0, False, False)
    multi = torch.ops.torchfn.stacked_adam_update_multi
    with pytest.raises(RuntimeError, match=r"torchfn::stacked_adam_update_multi: argument "
                                           r"'nu' must list one tensor per leaf \(2\), got 1"):
        multi([g, g], [g, g], [g], [], c, lr, None, 0.9, 0.99, 1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"argument 'param' must list one tensor per leaf "
                                           r"\(1\) when weight_decay is given"):
        multi([g], [g], [g], [], c, lr, lr, 0.9, 0.99, 1e-8, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"torchfn::stacked_sgd_update_multi: argument "
                                           r"'momentum_buffer' must list one tensor per leaf "
                                           r"\(1\) or be empty, got 2"):
        torch.ops.torchfn.stacked_sgd_update_multi([g], [g, g], [], c, lr, None, 0.9, 0.0,
                                                   False, False)
    with pytest.raises(RuntimeError, match=r"stacked_adam_update_multi: argument 'grad' "
                                           "requires grad"):
        multi([g.clone().requires_grad_(True)], [g], [g], [], c, lr, None, 0.9, 0.99, 1e-8,
              0.0, False, False)
    with pytest.raises(RuntimeError, match=r"stacked_adam_update: argument 'grad' requires "
                                           "grad.*call the public torchfn.ops function"):
        adam(g.requires_grad_(True), g, g, None, c, lr, None, 0.9, 0.99, 1e-8, 0.0, False,
             False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_raw_kernels_check_device(kernels):
    _need_device(kernels, "cuda")
    g = torch.zeros(2, 3, device="cuda")
    with pytest.raises(RuntimeError, match=r"torchfn::stacked_adam_update: argument 'lr' must "
                                           r"be on the device of 'grad' \(cuda:0\), got cpu"):
        torch.ops.torchfn.stacked_adam_update(g, g, g, None, torch.tensor(1, device="cuda"),
                                              torch.ones(2), None, 0.9, 0.99, 1e-8, 0.0, False,
                                              False)
    with pytest.raises(ValueError, match=r"\(lr=...\): expected lr on grad's device cuda:0, got "
                                         r"cpu"):
        ops.stacked_adam_update(g, g, g, 1, torch.ones(2))
    c = torch.tensor(1, device="cuda")
    lr = torch.ones(2, device="cuda")
    with pytest.raises(RuntimeError, match=r"stacked_adam_update_multi: every leaf of 'grad' "
                                           r"must have one dtype on CUDA, got Float \(leaf 0\) "
                                           r"and Double \(leaf 1\)"):
        torch.ops.torchfn.stacked_adam_update_multi([g, g.double()], [g, g.double()],
                                                    [g, g.double()], [], c, lr, None, 0.9, 0.99,
                                                    1e-8, 0.0, False, False)
