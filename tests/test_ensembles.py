"""Ensembles: build/apply, vmapped training == N torch.optim models, compile, metrics, io."""

from __future__ import annotations

import os

import pytest
import torch
import torchopt
from torch import nn

from torchfn.ensembles._build import Ensemble, ensemble_apply
from torchfn.ensembles._io import load_ensemble, save_ensemble
from torchfn.ensembles._metrics import (
    ensemble_metrics,
    ensemble_probs,
    expected_calibration_error,
    member_disagreement,
    negative_log_likelihood,
    predictive_variance,
)
from torchfn.ensembles._train import (
    init_ensemble_state,
    make_ensemble_train_step,
    member_batches,
    member_orders,
)
from torchfn.functional import step_rng
from torchfn.optim import (
    per_member_adam,
    per_member_optimizer,
    per_member_sgd,
    stacked_adam,
    stacked_sgd,
)

N, B, D, H, C = 3, 6, 5, 7, 4
F64 = torch.float64


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C)).to(F64)


def data(seed: int = 0, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lead = () if shared else (N,)
    return (torch.randn(*lead, B, D, generator=g, dtype=F64),
            torch.randint(C, (*lead, B), generator=g))


def reference_run(optim_factory, steps: int, shared: bool = False) -> list[nn.Module]:
    """Train N separate modules with torch.optim; member n uses optim_factory(n, params)."""
    models = []
    for n in range(N):
        torch.manual_seed(n)
        models.append(mlp())
    opts = [optim_factory(n, m.parameters()) for n, m in enumerate(models)]
    for t in range(steps):
        x, y = data(t, shared)
        for n, (m, o) in enumerate(zip(models, opts, strict=True)):
            xn, yn = (x, y) if shared else (x[n], y[n])
            o.zero_grad()
            nn.functional.cross_entropy(m(xn), yn).backward()
            o.step()
    return models


def run_ensemble(opt, steps: int, shared: bool = False, compile_backend=None, chunk_size=None):
    ens = Ensemble.from_seeds(mlp, seeds=range(N))
    state = init_ensemble_state(ens, opt, seed=0)
    step = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt,
                                    shared_batch=shared, chunk_size=chunk_size)
    if compile_backend is not None:
        step = torch.compile(step, backend=compile_backend, fullgraph=True)
    for t in range(steps):
        state, metrics = step(state, data(t, shared))
    return ens, state, metrics


def assert_matches(ens: Ensemble, state, models: list[nn.Module]) -> None:
    for n, m in enumerate(models):
        for k, p in m.named_parameters():
            torch.testing.assert_close(state.params[k][n], p.detach(), rtol=1e-10, atol=1e-12)


LR = torch.tensor([1e-3, 3e-2, 1e-1], dtype=F64)
WD = torch.tensor([0.0, 1e-2, 0.3], dtype=F64)


@pytest.mark.parametrize("shared", [False, True])
def test_adam_per_member_lr_wd_matches_torch_optim(shared: bool) -> None:
    ens, state, metrics = run_ensemble(stacked_adam(lr=LR, weight_decay=WD), 4, shared)
    models = reference_run(lambda n, p: torch.optim.Adam(p, lr=float(LR[n]),
                                                         weight_decay=float(WD[n])), 4, shared)
    assert_matches(ens, state, models)
    assert metrics["loss"].shape == (N,) and metrics["grad_norm"].shape == (N,)
    # members as ordinary modules give the same outputs as the reference models
    x = data(9, shared=True)[0]
    for n, m in enumerate(ens.members(state.params, state.buffers)):
        torch.testing.assert_close(m(x), models[n](x), rtol=1e-10, atol=1e-12)


def test_grad_norm_false_skips_only_the_metric() -> None:
    opt = stacked_adam(lr=LR, weight_decay=WD)
    ens = Ensemble.from_seeds(mlp, seeds=range(N))
    with_norm = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt)
    without = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt,
                                       grad_norm=False)
    a = b = init_ensemble_state(ens, opt, seed=0)
    for t in range(3):
        a, m_a = with_norm(a, data(t))
        b, m_b = without(b, data(t))
    assert sorted(m_b) == ["loss", "skipped"] and sorted(m_a) == ["grad_norm", "loss", "skipped"]
    torch.testing.assert_close(m_b["loss"], m_a["loss"], rtol=0, atol=0)
    for k in a.params:
        torch.testing.assert_close(b.params[k], a.params[k], rtol=0, atol=0)


def test_per_member_hyperparameters_really_differ() -> None:
    # same init for every member, same data: only the (N,) lr / wd can make them differ
    shared_lr = torch.full((N,), float(LR[1]), dtype=F64)
    _, same, _ = run_ensemble(stacked_adam(lr=shared_lr), 3, shared=True)
    _, diff, _ = run_ensemble(stacked_adam(lr=LR, weight_decay=WD), 3, shared=True)
    init = Ensemble.from_seeds(mlp, seeds=range(N)).params["0.weight"]
    moved = (diff.params["0.weight"] - init).flatten(1).norm(dim=1)
    assert moved[0] < moved[1] < moved[2]
    assert not torch.allclose(diff.params["0.weight"][1], same.params["0.weight"][1])


def test_sgd_momentum_nesterov_matches_torch_optim() -> None:
    opt = stacked_sgd(lr=LR * 10, momentum=0.9, weight_decay=WD, nesterov=True)
    ens, state, _ = run_ensemble(opt, 4)
    models = reference_run(lambda n, p: torch.optim.SGD(
        p, lr=float(LR[n] * 10), momentum=0.9, weight_decay=float(WD[n]), nesterov=True), 4)
    assert_matches(ens, state, models)


def test_per_member_optimizer_vmapped_torchopt_matches_torch_optim() -> None:
    lrs = LR * 10
    opt = per_member_optimizer(lambda lr: torchopt.sgd(lambda _: lr), {"lr": lrs})
    ens, state, _ = run_ensemble(opt, 3)
    models = reference_run(lambda n, p: torch.optim.SGD(p, lr=float(lrs[n])), 3)
    assert_matches(ens, state, models)


MOM = torch.tensor([0.0, 0.5, 0.9], dtype=F64)
DAMP = torch.tensor([0.0, 0.1, 0.5], dtype=F64)


@pytest.mark.parametrize("nesterov", [False, True])
def test_per_member_sgd_momentum_matches_torch_optim(nesterov: bool) -> None:
    mom = MOM + 0.05 if nesterov else MOM  # Nesterov needs momentum > 0 for every member
    damp = torch.zeros(N, dtype=F64) if nesterov else DAMP
    opt = per_member_sgd(LR * 10, momentum=mom, dampening=damp, weight_decay=WD,
                         nesterov=nesterov)
    ens, state, _ = run_ensemble(opt, 4)
    models = reference_run(lambda n, p: torch.optim.SGD(
        p, lr=float(LR[n] * 10), momentum=float(mom[n]), dampening=float(damp[n]),
        weight_decay=float(WD[n]), nesterov=nesterov), 4)
    assert_matches(ens, state, models)


@pytest.mark.parametrize("decoupled", [False, True])
def test_per_member_adam_betas_eps_match_torch_optim(decoupled: bool) -> None:
    b1 = torch.tensor([0.5, 0.8, 0.95], dtype=F64)
    b2 = torch.tensor([0.9, 0.99, 0.999], dtype=F64)
    eps = torch.tensor([1e-8, 1e-3, 1e-1], dtype=F64)
    opt = per_member_adam(LR, betas=(b1, b2), eps=eps, weight_decay=WD, decoupled=decoupled)
    ens, state, _ = run_ensemble(opt, 4)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    models = reference_run(lambda n, p: cls(p, lr=float(LR[n]), betas=(float(b1[n]),
                                                                      float(b2[n])),
                                            eps=float(eps[n]), weight_decay=float(WD[n])), 4)
    assert_matches(ens, state, models)


def test_per_member_fused_dispatch_and_native_agree() -> None:
    # float momentum/betas -> the fused stacked op; fused=False -> the pure-PyTorch version
    auto = per_member_sgd(LR, momentum=0.9, weight_decay=WD, nesterov=True)
    native = per_member_sgd(LR, momentum=0.9, weight_decay=WD, nesterov=True, fused=False)
    adam_auto = per_member_adam(LR, weight_decay=WD, decoupled=True)
    adam_native = per_member_adam(LR, weight_decay=WD, decoupled=True, fused=False)
    assert auto.update.__qualname__.startswith("stacked_sgd")
    assert adam_auto.update.__qualname__.startswith("stacked_adam")
    assert native.update.__qualname__.startswith("per_member_sgd")
    for a, b in ((auto, native), (adam_auto, adam_native)):
        _, sa, _ = run_ensemble(a, 3)
        _, sb, _ = run_ensemble(b, 3)
        for k in sa.params:
            torch.testing.assert_close(sb.params[k], sa.params[k], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"fused=True.*betas and eps as shared floats"):
        per_member_adam(LR, betas=(MOM, 0.999), fused=True)


def test_per_member_momentum_resumes_with_a_fresh_optimizer() -> None:
    # "first step" comes from state.count, not Python state: a new transformation object
    # continuing from a saved state gives the same run (torchopt's trace would not)
    def make():
        return per_member_sgd(LR, momentum=MOM, dampening=DAMP)
    ens = Ensemble.from_seeds(mlp, seeds=range(N))
    opt = make()
    step = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt)
    state = init_ensemble_state(ens, opt, seed=0)
    for t in range(4):
        state, _ = step(state, data(t))
    resumed = init_ensemble_state(ens, opt, seed=0)
    for t in range(2):
        resumed, _ = step(resumed, data(t))
    step2 = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, make())
    for t in range(2, 4):
        resumed, _ = step2(resumed, data(t))
    for k in state.params:
        torch.testing.assert_close(resumed.params[k], state.params[k], rtol=0, atol=0)


def test_per_member_optimizer_refuses_python_state_momentum() -> None:
    ens = Ensemble.from_seeds(mlp, seeds=range(N))
    opt = per_member_optimizer(lambda lr: torchopt.sgd(lambda _: lr, momentum=0.9),
                               {"lr": LR})
    with pytest.raises(ValueError, match=r"keeps state in Python.*per_member_sgd"):
        init_ensemble_state(ens, opt, seed=0)
    # a transformation whose state is all in the optimizer state is accepted: see
    # test_per_member_optimizer_vmapped_torchopt_matches_torch_optim


def test_per_member_optimizer_errors() -> None:
    with pytest.raises(ValueError, match=r"betas\[0\]=\.\.\.\): every value must be in "
                                         r"\[0.0, 1.0\)"):
        per_member_adam(betas=(torch.tensor([0.9, 1.0]), 0.999))
    with pytest.raises(ValueError, match=r"nesterov=True.*momentum > 0"):
        per_member_sgd(0.1, momentum=MOM, nesterov=True)
    ens = Ensemble.from_seeds(mlp, seeds=range(N))
    with pytest.raises(ValueError, match=r"momentum=\.\.\.\).*\(N,\) = \(3,\).*got shape \(2,\)"):
        init_ensemble_state(ens, per_member_sgd(0.1, momentum=torch.ones(2, dtype=F64) / 2),
                            seed=0)
    with pytest.raises(ValueError, match=r"fused=.*expected True, False or 'auto'"):
        per_member_sgd(0.1, fused="yes")


def test_per_member_adam_compiled_equals_eager_without_recompiles() -> None:
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    opt = per_member_adam(LR, betas=(MOM / 2 + 0.5, 0.999), weight_decay=WD)
    _, eager, _ = run_ensemble(opt, 3)
    _, comp, _ = run_ensemble(opt, 3, compile_backend=counting_backend)
    assert len(compiles) == 1, f"expected one compile over 3 steps, got {len(compiles)}"
    for k in eager.params:
        torch.testing.assert_close(comp.params[k], eager.params[k], rtol=1e-10, atol=1e-12)


def test_eager_fast_path_equals_functorch_path_and_keeps_outer_graph() -> None:
    # eager, unchunked steps take plain autograd over a vmapped forward; params that already
    # require grad (an outer graph to keep) take vmap(grad): same numbers
    ens = Ensemble.from_seeds(mlp, seeds=range(N))
    opt = stacked_sgd(lr=LR, momentum=0.9)
    step = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt)
    state = init_ensemble_state(ens, opt, seed=0)
    fast, fast_m = step(state, data(0))
    leaves = {k: v.clone().requires_grad_(True) for k, v in state.params.items()}
    slow, slow_m = step(state._replace(params=leaves), data(0))
    for k in fast.params:
        assert fast.params[k].is_contiguous()
        torch.testing.assert_close(slow.params[k], fast.params[k], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(slow_m["grad_norm"], fast_m["grad_norm"], rtol=1e-12, atol=0)
    outer = torch.autograd.grad(sum(v.square().sum() for v in slow.params.values()),
                                list(leaves.values()))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in outer)


def test_chunked_training_equals_unchunked() -> None:
    _, a, _ = run_ensemble(stacked_adam(lr=LR), 2)
    _, b, _ = run_ensemble(stacked_adam(lr=LR), 2, chunk_size=2)
    for k in a.params:
        torch.testing.assert_close(a.params[k], b.params[k], rtol=1e-12, atol=1e-14)


def test_compiled_equals_eager_without_recompiles() -> None:
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    opt = stacked_adam(lr=LR, weight_decay=WD)
    _, eager, _ = run_ensemble(opt, 4)
    _, comp, _ = run_ensemble(opt, 4, compile_backend=counting_backend)
    assert len(compiles) == 1, f"expected one compile over 4 steps, got {len(compiles)}"
    for k in eager.params:
        torch.testing.assert_close(comp.params[k], eager.params[k], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(comp.opt_state.nu["2.bias"], eager.opt_state.nu["2.bias"])
    assert int(comp.step) == 4


def test_compiled_inductor_equals_eager() -> None:
    torch._dynamo.reset()
    opt = stacked_sgd(lr=LR, momentum=0.9)
    _, eager, _ = run_ensemble(opt, 2)
    _, comp, _ = run_ensemble(opt, 2, compile_backend="inductor")
    for k in eager.params:
        torch.testing.assert_close(comp.params[k], eager.params[k], rtol=1e-9, atol=1e-11)


def deep_mlp() -> nn.Module:
    # 12 parameter leaves
    layers = []
    for i in range(6):
        layers += [nn.Linear(D if i == 0 else H, C if i == 5 else H), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(F64)


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_compiled_norms_and_guard_equal_eager_with_a_nonfinite_member(max_grad_norm) -> None:
    # one float64 norm per member is both the grad_norm metric and the non-finite guard (and,
    # zeroed for a skipped member, the clipping norm): compiled equals eager, step by step, when
    # one member's batch holds a NaN (that member skips, the others clip and step)
    torch._dynamo.reset()
    ens = Ensemble.from_seeds(deep_mlp, seeds=range(N))
    opt = stacked_adam(lr=torch.full((N,), 1e-2, dtype=F64))
    step = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt,
                                    max_grad_norm=max_grad_norm)
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    s_e = init_ensemble_state(ens, opt, seed=0)
    s_c = init_ensemble_state(ens, opt, seed=0)
    # the first step's grad_norm against autograd on the members as plain modules
    x0, y0 = data(0)
    want = []
    for n, m in enumerate(ens.members(s_e.params, s_e.buffers)):
        grads = torch.autograd.grad(nn.functional.cross_entropy(m(x0[n]), y0[n]),
                                    list(m.parameters()))
        want.append(torch.sqrt(sum((g**2).sum() for g in grads)))
    for t in range(3):
        x, y = data(t)
        if t == 1:
            x[1, 0, 0] = float("nan")
        s_e, m_e = step(s_e, (x, y))
        s_c, m_c = compiled(s_c, (x, y))
        assert m_e["skipped"].tolist() == m_c["skipped"].tolist() == [False, t == 1, False]
        torch.testing.assert_close(m_c["grad_norm"][[0, 2]], m_e["grad_norm"][[0, 2]],
                                   rtol=1e-12, atol=0)
        assert not torch.isfinite(m_c["grad_norm"][1]) or t != 1
        if t == 0:
            torch.testing.assert_close(m_c["grad_norm"], torch.stack(want), rtol=1e-12, atol=0)
        for k in s_e.params:
            torch.testing.assert_close(s_c.params[k], s_e.params[k], rtol=1e-10, atol=1e-12)
    assert int(s_c.skipped[1]) == 1 and int(s_c.skipped[0]) == 0


def dropout_net() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 32), nn.Dropout(0.5), nn.Linear(32, C)).to(F64)


def test_dropout_randomness_per_member_and_seeded() -> None:
    # identical members (same seed), same batch: only dropout masks can differ
    ens = Ensemble.from_seeds(dropout_net, seeds=[0] * N)
    x = data(0, shared=True)[0]
    with pytest.raises(RuntimeError, match="randomness"):
        ens(x)
    out, _ = ens(x, randomness="different")
    assert not torch.allclose(out[0], out[1])
    same, _ = ens(x, randomness="same")
    torch.testing.assert_close(same[0], same[1])
    opt = stacked_sgd(lr=0.1)
    step = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt,
                                    shared_batch=True, randomness="different")
    state = init_ensemble_state(ens, opt, seed=5)
    _, m1 = step(state, data(0, shared=True))
    _, m2 = step(state, data(0, shared=True))  # seeded from (seed, step): repeatable
    torch.testing.assert_close(m1["loss"], m2["loss"], rtol=0, atol=0)
    assert len(set(m1["loss"].tolist())) == N  # each member got its own masks
    with step_rng(state):  # the eager step used exactly this generator state
        ref, _ = ensemble_apply(ens.model_fn, ens.params, ens.buffers, x,
                                randomness="different")
    torch.testing.assert_close(
        torch.stack([nn.functional.cross_entropy(o, data(0, shared=True)[1]) for o in ref]),
        m1["loss"])


def test_apply_shared_per_member_and_chunked() -> None:
    ens = Ensemble.from_seeds(mlp, seeds=range(N))
    x, _ = data(1)
    out, _ = ens(x, per_member=True)
    out_c, _ = ens(x, per_member=True, chunk_size=2)
    shared, _ = ens(x[0])
    assert out.shape == (N, B, C)
    for n, m in enumerate(ens.members()):
        torch.testing.assert_close(out[n], m(x[n]))
        torch.testing.assert_close(shared[n], m(x[0]))
    torch.testing.assert_close(out_c, out)


def test_batchnorm_ensemble_buffers_per_member() -> None:
    def bn_net() -> nn.Module:
        return nn.Sequential(nn.Linear(D, H), nn.BatchNorm1d(H), nn.Linear(H, C)).to(F64)
    ens = Ensemble.from_seeds(bn_net, seeds=range(N))
    x, _ = data(2)
    out, new_buffers = ens(x, per_member=True)
    for n in range(N):
        m = ens.member(n)
        torch.testing.assert_close(out[n], m(x[n]))
        torch.testing.assert_close(new_buffers["1.running_mean"][n], m[1].running_mean)


def test_bad_architecture_and_mismatched_n_errors() -> None:
    with pytest.raises(ValueError, match=r"member 1 .*'0.weight' has shape \(8, 5\)"):
        Ensemble.from_modules([mlp(), nn.Sequential(nn.Linear(D, 8), nn.Tanh(),
                                                    nn.Linear(8, C)).to(F64)])
    with pytest.raises(ValueError, match=r"member 2 .*'1' is a ReLU, expected a Tanh"):
        Ensemble.from_modules([mlp(), mlp(), nn.Sequential(nn.Linear(D, H), nn.ReLU(),
                                                           nn.Linear(H, C)).to(F64)])
    with pytest.raises(ValueError, match=r"member 1 .*'0.weight' is torch.float32"):
        Ensemble.from_modules([mlp(), mlp().float()])
    ens = Ensemble.from_seeds(mlp, seeds=range(N))
    with pytest.raises(ValueError, match=r"\(N,\) = \(3,\).*got shape \(2,\)"):
        init_ensemble_state(ens, stacked_adam(lr=torch.ones(2, dtype=F64)), seed=0)
    with pytest.raises(ValueError, match=r"weight_decay.*got shape \(4,\)"):
        init_ensemble_state(ens, stacked_sgd(lr=0.1, weight_decay=torch.ones(4, dtype=F64)),
                            seed=0)
    opt = stacked_sgd(lr=0.1)
    step = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt)
    state = init_ensemble_state(ens, opt, seed=0)
    x, y = data(0)
    with pytest.raises(ValueError, match=r"N=3 members along dim 0.*got \(2, 6, 5\) for inputs"):
        step(state, (x[:2], y))
    with pytest.raises(ValueError, match=r"got \(6,\) for targets"):
        step(state, (x, y[0]))
    with pytest.raises(ValueError, match=r"per_member=True.*got shape \(2, 6, 5\)"):
        ens(x[:2], per_member=True)
    with pytest.raises(ValueError, match=r"hyperparams\['lr'\] has 2 values.*N=3"):
        init_ensemble_state(ens, per_member_optimizer(lambda lr: torchopt.sgd(lambda _: lr),
                                                      {"lr": torch.ones(2)}), seed=0)


def test_member_orders_and_batches() -> None:
    orders = member_orders(10, seeds=[0, 1, 2])
    for row in orders:
        assert sorted(row.tolist()) == list(range(10))
    assert not torch.equal(orders[0], orders[1])
    torch.testing.assert_close(orders, member_orders(10, seeds=[0, 1, 2]))
    assert not torch.equal(orders, member_orders(10, seeds=[0, 1, 2], epoch=1))
    boot = member_orders(50, seeds=[0, 1], bootstrap=True)
    assert boot.shape == (2, 50) and len(set(boot[0].tolist())) < 50
    x, y = torch.arange(10.0)[:, None] * 10, torch.arange(10)
    batches = list(member_batches((x, y), orders, 4))
    assert len(batches) == 2
    xb, yb = batches[1]
    assert xb.shape == (3, 4, 1) and torch.equal(yb, orders[:, 4:8])
    torch.testing.assert_close(xb[..., 0], yb.double().float() * 10)


def test_metrics_against_loops() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, 40, C, generator=g, dtype=F64) * 2
    y = torch.randint(C, (40,), generator=g)
    probs = ensemble_probs(logits)
    ref = sum(torch.softmax(logits[n], -1) for n in range(N)) / N
    torch.testing.assert_close(probs, ref)
    torch.testing.assert_close(predictive_variance(logits), torch.stack(
        [torch.softmax(logits[n], -1) for n in range(N)]).var(0, unbiased=False))
    torch.testing.assert_close(negative_log_likelihood(probs, y),
                               -torch.log(ref[torch.arange(40), y]).mean())
    pred = logits.argmax(-1)
    pairs = [(i, j) for i in range(N) for j in range(N) if i != j]
    dis = sum((pred[i] != pred[j]).double().mean() for i, j in pairs) / len(pairs)
    torch.testing.assert_close(member_disagreement(logits), dis)
    # ECE by an explicit loop over bins
    conf, hat = probs.max(-1)
    ece = torch.zeros((), dtype=F64)
    for k in range(10):
        mask = (conf > k / 10) & (conf <= (k + 1) / 10)
        if mask.any():
            ece += mask.double().mean() * ((hat[mask] == y[mask]).double().mean()
                                           - conf[mask].mean()).abs()
    torch.testing.assert_close(expected_calibration_error(probs, y, n_bins=10), ece)
    m = ensemble_metrics(logits, y)
    torch.testing.assert_close(m["accuracy"], (probs.argmax(-1) == y).double().mean())
    with pytest.raises(ValueError, match=r"\(N, B, C\)"):
        ensemble_probs(logits[0])


def test_save_load_roundtrip_resumes_identically(tmp_path) -> None:
    opt = stacked_adam(lr=LR, weight_decay=WD)
    ens = Ensemble.from_seeds(mlp, seeds=range(N))
    step = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt)
    state = init_ensemble_state(ens, opt, seed=0)
    state, _ = step(state, data(0))
    path = os.path.join(tmp_path, "ens.pt")
    save_ensemble(path, state, extra={"epoch": 1})
    loaded, extra = load_ensemble(path, optimizer=opt, n_members=N)
    assert extra == {"epoch": 1}
    a, _ = step(state, data(1))
    b, _ = step(loaded, data(1))
    for k in a.params:
        torch.testing.assert_close(b.params[k], a.params[k], rtol=0, atol=0)
    with pytest.raises(ValueError, match="holds 3 members"):
        load_ensemble(path, optimizer=opt, n_members=4)


def test_save_ensemble_removes_temporary_files_of_killed_saves(tmp_path) -> None:
    """Regression: temporary files of killed saves were never removed."""
    state = init_ensemble_state(Ensemble.from_seeds(mlp, seeds=range(N)), stacked_adam(lr=LR),
                                seed=0)
    for name in (".ens.pt.a1b2c3d4.tmp", f".ens.pt.{os.getpid()}@h.0123abcd.tmp",
                 ".other.pt.a1b2c3d4.tmp"):  # the last one belongs to another target
        (tmp_path / name).write_bytes(b"\x00" * 64)
        old = os.stat(tmp_path / name).st_mtime - 2 * 3600  # untouched for two hours
        os.utime(tmp_path / name, (old, old))
    save_ensemble(tmp_path / "ens.pt", state)
    assert sorted(os.listdir(tmp_path)) == [".other.pt.a1b2c3d4.tmp", "ens.pt"]
