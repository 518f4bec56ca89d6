"""make_train_step against torch.optim loops on nn.Modules, compile, AMP, errors."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
import torchopt
from torch import nn

from torchfn.functional._train_step import (
    DynamicLossScaler,
    TrainState,
    init_train_state,
    make_train_step,
    step_rng,
)
from torchfn.optim import adam


def mse(outputs, targets):
    return ((outputs - targets) ** 2).mean()


def make_mlp(dtype=torch.float64, *, dropout=0.0, batchnorm=False, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(4, 16), nn.Tanh()]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(16, 2))
    return nn.Sequential(*layers).to(dtype)


def functional(module):
    """A model_fn following the torchfn contract, for modules that do not update buffers."""
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in module.named_buffers()}

    def model_fn(p, b, x):
        return torch.func.functional_call(module, {**p, **b}, (x,)), b

    return model_fn, params, buffers


def batches(n, batch_size=16, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, 4, generator=g, dtype=dtype) * 2,
            torch.randn(batch_size, 2, generator=g, dtype=dtype),
        )
        for _ in range(n)
    ]


def torch_loop(module, make_opt, data, *, accum=1, max_grad_norm=None, make_sched=None):
    """The reference: a plain torch.optim loop on a copy of ``module``."""
    m = copy.deepcopy(module)
    opt = make_opt(m.parameters())
    sched = make_sched(opt) if make_sched is not None else None
    norms = []
    for x, y in data:
        opt.zero_grad()
        for xm, ym in zip(x.chunk(accum), y.chunk(accum), strict=True):
            (mse(m(xm), ym) / accum).backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), max_grad_norm))
        opt.step()
        if sched is not None:
            sched.step()
    params = {k: v.detach() for k, v in m.named_parameters()}
    buffers = {k: v.detach() for k, v in m.named_buffers()}
    return params, buffers, norms


def run(step, state, data):
    metrics = []
    for batch in data:
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


def assert_dicts(a, b, **kw):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **kw)


OPTIMIZERS = {
    "sgd_momentum": (
        lambda: torchopt.sgd(lr=0.05, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    ),
    "adam": (
        lambda: adam(lr=0.01, weight_decay=0.01),
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01),
    ),
}


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_matches_torch_optim_loop(opt_name, max_grad_norm):
    make_ours, make_ref = OPTIMIZERS[opt_name]
    module = make_mlp()
    data = batches(5)
    model_fn, params, buffers = functional(module)
    opt = make_ours()
    step = make_train_step(model_fn, mse, opt, max_grad_norm=max_grad_norm)
    state, metrics = run(step, init_train_state(params, buffers, opt, seed=0), data)
    ref_params, _, ref_norms = torch_loop(module, make_ref, data, max_grad_norm=max_grad_norm)
    assert_dicts(state.params, ref_params, rtol=1e-10, atol=1e-12)
    assert int(state.step) == 5
    if max_grad_norm is not None:
        norms = torch.stack([m["grad_norm"] for m in metrics])
        torch.testing.assert_close(norms, torch.stack(ref_norms), rtol=1e-10, atol=0)
        assert (norms > max_grad_norm).all()  # clipping was active at every step


def test_grad_accumulation_equals_big_batch():
    module = make_mlp()
    data = batches(3, batch_size=16)
    model_fn, params, buffers = functional(module)
    opt = adam(lr=0.02)
    big = make_train_step(model_fn, mse, opt, max_grad_norm=1.0)
    accum = make_train_step(model_fn, mse, opt, grad_accum_steps=4, max_grad_norm=1.0)
    s_big, m_big = run(big, init_train_state(params, buffers, opt, seed=0), data)
    s_acc, m_acc = run(accum, init_train_state(params, buffers, opt, seed=0), data)
    assert_dicts(s_acc.params, s_big.params, rtol=1e-12, atol=1e-13)
    for a, b in zip(m_acc, m_big, strict=True):
        torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-13, atol=0)
        torch.testing.assert_close(a["grad_norm"], b["grad_norm"], rtol=1e-12, atol=0)
    assert not torch.equal(s_acc.params["0.weight"], params["0.weight"])


def test_pytree_inputs_are_split():
    torch.manual_seed(0)
    w = torch.randn(3, 2, dtype=torch.float64)

    def model_fn(p, bufs, **inputs):  # a dict of inputs comes in as keywords
        return inputs["a"] @ p["w"] + inputs["b"], bufs

    g = torch.Generator().manual_seed(2)
    x = {"a": torch.randn(6, 3, generator=g, dtype=torch.float64),
         "b": torch.randn(6, 2, generator=g, dtype=torch.float64)}
    y = torch.randn(6, 2, generator=g, dtype=torch.float64)
    opt = torchopt.sgd(lr=0.1)
    state = init_train_state({"w": w}, {}, opt, seed=0)
    s1, _ = make_train_step(model_fn, mse, opt, grad_accum_steps=3)(state, (x, y))
    s2, _ = make_train_step(model_fn, mse, opt)(state, (x, y))
    torch.testing.assert_close(s1.params["w"], s2.params["w"], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("accum", [1, 2])
def test_batchnorm_buffers_match_torch(accum):
    from torchfn.functional._stateless import make_functional

    module = make_mlp(batchnorm=True)
    data = batches(4)
    model_fn, params, buffers = make_functional(module)
    opt = adam(lr=0.01)
    step = make_train_step(model_fn, mse, opt, grad_accum_steps=accum)
    state, _ = run(step, init_train_state(params, buffers, opt, seed=0), data)
    ref_params, ref_buffers, _ = torch_loop(
        module, lambda ps: torch.optim.Adam(ps, lr=0.01), data, accum=accum
    )
    assert_dicts(state.params, ref_params, rtol=1e-10, atol=1e-12)
    assert_dicts(state.buffers, ref_buffers, rtol=1e-12, atol=1e-12)
    assert int(state.buffers["2.num_batches_tracked"]) == 4 * accum


def test_lr_schedule_matches_lambda_lr():
    module = make_mlp()
    data = batches(6)
    model_fn, params, buffers = functional(module)
    sched = torchopt.schedule.linear_schedule(0.1, 0.02, transition_steps=4)
    opt = torchopt.sgd(lr=sched, momentum=0.5)
    step = make_train_step(model_fn, mse, opt, lr_schedule=sched)
    state, metrics = run(step, init_train_state(params, buffers, opt, seed=0), data)

    def factor(t):
        return (0.1 + (0.02 - 0.1) * min(t, 4) / 4) / 0.1

    ref_params, _, _ = torch_loop(
        module,
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5),
        data,
        make_sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor),
    )
    # torchopt's schedule computes in float32
    assert_dicts(state.params, ref_params, rtol=1e-6, atol=1e-7)
    lrs = torch.stack([m["lr"] for m in metrics])
    expected = torch.tensor([0.1 * factor(t) for t in range(6)], dtype=torch.float32)
    torch.testing.assert_close(lrs, expected)


def test_lr_metric_is_the_lr_applied_after_a_skipped_step():
    """A skipped step keeps the optimizer state, so the schedule's count stays; the metric
    reports the lr the next step applies (it was one schedule step ahead after each skip)."""
    model_fn, params, buffers = functional(make_mlp())

    def sched(count):
        return 0.1 * 0.5 ** torch.as_tensor(count, dtype=torch.float64)

    opt = torchopt.sgd(sched)
    step = make_train_step(model_fn, mse, opt, lr_schedule=sched)
    state = init_train_state(params, buffers, opt, seed=0)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    lrs = []
    for t in range(4):
        xt = x.clone()
        if t == 1:
            xt[0, 0] = float("nan")  # a non-finite loss: skipped
        before = state.params
        g = torch.func.grad(lambda p, xt=xt: mse(model_fn(p, buffers, xt)[0], y))(dict(before))
        state, m = step(state, (xt, y))
        lrs.append(float(m["lr"]))
        if t != 1:  # the update applied is exactly the reported lr times the gradient
            k = next(iter(before))
            torch.testing.assert_close(before[k] - state.params[k], float(m["lr"]) * g[k])
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.025]) and int(state.skipped) == 1


def test_compiled_equals_eager_without_recompiles():
    from torch._inductor.compile_fx import compile_fx

    module = make_mlp(torch.float32)
    data = batches(4, dtype=torch.float32)
    model_fn, params, buffers = functional(module)
    opt = adam(lr=0.02, weight_decay=0.01)
    step = make_train_step(model_fn, mse, opt, grad_accum_steps=2, max_grad_norm=0.5)
    compiles = 0

    def backend(gm, example_inputs):
        nonlocal compiles
        compiles += 1
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    s_eager = s_comp = init_train_state(params, buffers, opt, seed=0)
    for batch in data:
        s_eager, m_eager = step(s_eager, batch)
        s_comp, m_comp = compiled(s_comp, batch)
        assert_dicts(m_comp, m_eager, rtol=1e-5, atol=1e-6)
    assert_dicts(s_comp.params, s_eager.params, rtol=1e-5, atol=1e-6)
    assert int(s_comp.step) == 4
    assert compiles == 1


def test_compiled_fp16_batchnorm_no_recompiles():
    from torchfn.functional._stateless import make_functional

    module = make_mlp(torch.float32, batchnorm=True)
    data = batches(5, dtype=torch.float32)
    data[2] = (data[2][0] * float("inf"), data[2][1])  # a step with inf gradients
    model_fn, params, buffers = make_functional(module)
    sched = torchopt.schedule.linear_schedule(0.02, 0.01, transition_steps=3)
    opt = adam(lr=sched)
    step = make_train_step(
        model_fn,
        mse,
        opt,
        amp="fp16",
        loss_scaler=DynamicLossScaler(growth_interval=2),
        max_grad_norm=1.0,
        lr_schedule=sched,
    )
    compiles = 0

    def backend(gm, example_inputs):
        nonlocal compiles
        compiles += 1
        return gm.forward

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    s_eager = s_comp = init_train_state(params, buffers, opt, seed=0, loss_scale=1024.0)
    skipped = []
    for batch in data:
        s_eager, m_eager = step(s_eager, batch)
        s_comp, m_comp = compiled(s_comp, batch)
        skipped.append(bool(m_comp["skipped"]))
        assert_dicts(m_comp, m_eager, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert skipped == [False, False, True, False, False]
    assert_dicts(s_comp.params, s_eager.params, rtol=1e-5, atol=1e-6)
    assert_dicts(s_comp.buffers, s_eager.buffers, rtol=1e-5, atol=1e-6)
    # the skipped step's forward saw inf inputs: its buffer updates were dropped
    assert all(torch.isfinite(b).all() for b in s_comp.buffers.values())
    assert int(s_comp.buffers["2.num_batches_tracked"]) == 4
    # 1024 -> grow after 2 good steps -> back off on the inf step -> grow after 2 more
    assert float(s_comp.loss_scale.scale) == 2048.0
    assert compiles == 1


def test_bf16_autocast_close_to_fp32():
    module = make_mlp(torch.float32)
    data = batches(3, dtype=torch.float32)
    base_fn, params, buffers = functional(module)
    seen_dtypes = []

    def model_fn(p, b, x):
        out, b = base_fn(p, b, x)
        seen_dtypes.append(out.dtype)
        return out, b

    opt = adam(lr=0.01)
    s_bf16, m_bf16 = run(
        make_train_step(model_fn, mse, opt, amp="bf16"),
        init_train_state(params, buffers, opt, seed=0),
        data,
    )
    assert seen_dtypes == [torch.bfloat16] * 3
    s_fp32, m_fp32 = run(
        make_train_step(base_fn, mse, opt), init_train_state(params, buffers, opt, seed=0), data
    )
    assert all(p.dtype == torch.float32 for p in s_bf16.params.values())
    assert all(m["loss"].dtype == torch.float32 for m in m_bf16)
    for a, b in zip(m_bf16, m_fp32, strict=True):
        torch.testing.assert_close(a["loss"], b["loss"], rtol=2e-2, atol=0)
    assert_dicts(s_bf16.params, s_fp32.params, rtol=0, atol=2e-2)
    moved = sum((s_bf16.params[k] - params[k]).abs().sum() for k in params)
    assert moved > 0.1


def test_fp16_skips_inf_step_and_grows_scale():
    module = make_mlp(torch.float32)
    data = batches(4, dtype=torch.float32)
    model_fn, params, buffers = functional(module)
    opt = adam(lr=0.01)
    scaler = DynamicLossScaler(growth_interval=3, growth_factor=2.0, backoff_factor=0.5)
    step = make_train_step(model_fn, mse, opt, amp="fp16", loss_scaler=scaler)
    # 2**60 overflows float16 gradients in the backward pass: the step must be skipped
    state = init_train_state(params, buffers, opt, seed=0, loss_scale=2.0**60)
    new, metrics = step(state, data[0])
    assert bool(metrics["skipped"])
    assert not torch.isfinite(metrics["grad_norm"])
    for part in ("params", "opt_state"):  # unchanged, optimizer step counts included
        old_leaves = optree.tree_leaves(getattr(state, part))
        for a, b in zip(optree.tree_leaves(getattr(new, part)), old_leaves, strict=True):
            assert torch.equal(a, b)
    assert float(new.loss_scale.scale) == 2.0**59
    assert int(new.loss_scale.growth_tracker) == 0
    assert int(new.step) == 1

    state = init_train_state(params, buffers, opt, seed=0, loss_scale=256.0)
    scales, trackers = [], []
    for batch in data:
        state, metrics = step(state, batch)
        assert not bool(metrics["skipped"])
        scales.append(float(metrics["loss_scale"]))
        trackers.append(int(state.loss_scale.growth_tracker))
    assert scales == [256.0, 256.0, 512.0, 512.0]
    assert trackers == [1, 2, 0, 1]
    s_fp32, _ = run(
        make_train_step(model_fn, mse, opt), init_train_state(params, buffers, opt, seed=0), data
    )
    assert_dicts(state.params, s_fp32.params, rtol=0, atol=1e-2)


def test_dropout_is_seeded_per_step_and_global_rng_untouched():
    module = make_mlp(dropout=0.5)
    model_fn, params, buffers = functional(module)
    opt = torchopt.sgd(lr=0.1)
    step = make_train_step(model_fn, mse, opt)
    (batch,) = batches(1)
    state = init_train_state(params, buffers, opt, seed=5)
    torch.manual_seed(123)
    a, m_a = step(state, batch)
    after = torch.rand(3)
    torch.manual_seed(999)  # a different global stream does not change the step
    b, m_b = step(state, batch)
    assert torch.equal(m_a["loss"], m_b["loss"])
    for k in params:
        assert torch.equal(a.params[k], b.params[k])
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)  # the step did not consume the global stream
    other = init_train_state(params, buffers, opt, seed=6)
    _, m_other = step(other, batch)
    assert not torch.equal(m_other["loss"], m_a["loss"])
    _, m_next = step(a._replace(params=state.params), batch)  # same params, step 1
    assert not torch.equal(m_next["loss"], m_a["loss"])
    with step_rng(state) as derived, step_rng(a) as derived_next:
        pass
    assert derived != derived_next


def test_init_train_state():
    params = {"w": torch.ones(2, requires_grad=True)}
    state = init_train_state(params, {}, adam(), seed=torch.tensor(3))
    assert isinstance(state, TrainState)
    assert not state.params["w"].requires_grad
    assert state.step.dtype == torch.int64 and state.step.shape == ()
    assert int(state.seed) == 3 and state.seed.device.type == "cpu"
    with pytest.raises(ValueError, match=r"seed=...\): expected an int in \[0, 2\*\*63\), got -1"):
        init_train_state(params, {}, adam(), seed=-1)
    with pytest.raises(ValueError, match="integer 0-d tensor"):
        init_train_state(params, {}, adam(), seed=torch.tensor(1.5))


def test_errors():
    def model_fn(p, b, x):
        return x @ p["w"], b

    opt = torchopt.sgd(lr=0.1)
    state = init_train_state({"w": torch.zeros(3, 2)}, {}, opt, seed=0)
    x, y = torch.randn(10, 3), torch.randn(10, 2)
    step = make_train_step(model_fn, mse, opt)
    with pytest.raises(TypeError, match=r"batch must be a pair \(inputs, targets\), got Tensor"):
        step(state, x)
    with pytest.raises(TypeError, match="got tuple of length 3"):
        step(state, (x, y, y))
    with pytest.raises(ValueError, match=r"grad_accum_steps=...\): expected an int >= 1, got 0"):
        make_train_step(model_fn, mse, opt, grad_accum_steps=0)
    with pytest.raises(TypeError, match="grad_accum_steps"):
        make_train_step(model_fn, mse, opt, grad_accum_steps=2.0)
    with pytest.raises(ValueError, match=r"amp=...\): expected None, 'bf16' or 'fp16', got 'fp8'"):
        make_train_step(model_fn, mse, opt, amp="fp8")
    with pytest.raises(ValueError, match="needs amp='fp16'"):
        make_train_step(model_fn, mse, opt, amp="bf16", loss_scaler=DynamicLossScaler())
    with pytest.raises(ValueError, match="max_grad_norm"):
        make_train_step(model_fn, mse, opt, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScaler(growth_interval=0)
    bad_loss = make_train_step(model_fn, lambda o, t: (o - t) ** 2, opt)
    with pytest.raises(ValueError, match=r"scalar \(0-d\) tensor, got a tensor of shape \(10, 2\)"):
        bad_loss(state, (x, y))
    accum = make_train_step(model_fn, mse, opt, grad_accum_steps=3)
    with pytest.raises(ValueError, match="batch size 10 is not divisible by grad_accum_steps=3"):
        accum(state, (x, y))
    with pytest.raises(ValueError, match=r"share the batch size .* got sizes \[9, 10\]"):
        accum(state, (x, y[:9]))


def _apply_case(compiled: bool):
    from torchfn.functional import apply_gradients, init_train_state

    opt = torchopt.sgd(0.5)
    params = {"a": torch.zeros(3), "b": torch.zeros(2, 2)}
    state = init_train_state(params, {}, opt, seed=0)
    fn = lambda g, s, o: apply_gradients(opt, g, s, options=o, loss=torch.tensor(1.0))  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    return fn, state


@pytest.mark.parametrize("compiled", [False, True])
def test_apply_gradients_norm_guard_and_clip_match_a_per_leaf_reference(compiled):
    """The one-model fast path (multi-tensor norms in eager mode, float64 accumulation) gives
    the per-leaf reference's grad norm, clipping and skip decisions; a float32 gradient whose
    squared norm overflows float32 is finite, never skipped."""
    from torchfn.functional import StepOptions

    fn, state = _apply_case(compiled)
    g = {"a": torch.tensor([3.0, 0.0, 4.0]), "b": torch.tensor([[12.0, 0.0], [0.0, 0.0]])}
    new, m = fn(g, state, StepOptions(max_grad_norm=1.3))
    assert float(m["grad_norm"]) == pytest.approx(13.0, rel=1e-6) and not bool(m["skipped"])
    for k in g:
        torch.testing.assert_close(new.params[k], -0.5 * g[k] * (1.3 / (13.0 + 1e-6)))
    big = {"a": torch.tensor([3e30, 0.0, 4e30]), "b": torch.zeros(2, 2)}
    assert not torch.isfinite((big["a"] ** 2).sum())  # float32 squares overflow
    new, m = fn(big, state, StepOptions(max_grad_norm=1.0))
    assert not bool(m["skipped"]) and float(m["grad_norm"]) == pytest.approx(5e30, rel=1e-6)
    torch.testing.assert_close(new.params["a"], torch.tensor([-0.3, 0.0, -0.4]))
    for bad in (float("inf"), float("nan")):
        g_bad = {"a": torch.tensor([1.0, bad, 0.0]), "b": torch.ones(2, 2)}
        new, m = fn(g_bad, state, StepOptions(max_grad_norm=1.0))
        assert bool(m["skipped"]) and int(new.skipped) == 1
        assert all(torch.equal(new.params[k], state.params[k]) for k in g)
