"""Automatic and adaptive clipping of the DP-SGD step against references written out by hand.

Automatic clipping (Bu et al. 2022) equals a float64 loop of torch.autograd.grad with the
coefficients ``C / (||g_i|| + gamma)`` (flat and per layer), noise included. Adaptive quantile
clipping (Andrew et al. 2021): the threshold update equals the formula on a known stream of
norms, the threshold tracks the target quantile of a norm distribution, the raised gradient
noise multiplier is the paper's, ``normalize_update`` divides the noisy mean by ``C_t`` (the
update is the same at any threshold), compiled == eager with no recompile as ``C_t`` moves, several
physical batches == one, an old DPState checkpoint (no ``clip_norm``) still loads, and bad
settings fail with clear errors.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn.functional import init_train_state, load_checkpoint, save_checkpoint
from torchfn.persample import (
    AdaptiveClipping,
    ClippedSum,
    DPState,
    PoissonSampler,
    RDPAccountant,
    adaptive_grad_noise_multiplier,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)
from torchfn.persample._dp_random import fold_in, normal
from torchfn.persample._dpsgd import _COUNT_SALT

F64 = torch.float64


def xent(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)


def data(seed: int = 0, n: int = 10) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, dtype=F64, generator=g), torch.randint(0, 3, (n,), generator=g)


def loop_grads(ghost, params, buffers, x, y) -> dict[str, Tensor]:
    out: dict[str, list[Tensor]] = {k: [] for k in params}
    for i in range(x.shape[0]):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = xent(ghost(p, buffers, x[i : i + 1])[0], y[i : i + 1]).sum()
        for k, g in zip(p, torch.autograd.grad(loss, list(p.values())), strict=True):
            out[k].append(g)
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("clipping", ["automatic", "automatic_per_layer"])
@pytest.mark.parametrize("gamma", [None, 0.3])
def test_automatic_clipping_equals_loop_reference(clipping: str, gamma: float | None) -> None:
    ghost, params, buffers = make_ghost_model(small_net())
    opt = torchopt.sgd(0.1)
    c_total, sigma, qn = 0.7, 0.8, 10.0
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=sigma, max_grad_norm=c_total,
                              sample_rate=0.2, dataset_size=50, clipping=clipping,
                              automatic_gamma=gamma)
    g = 0.01 if gamma is None else gamma
    assert step.automatic_gamma == g and step.noise_std == pytest.approx(sigma * c_total)
    state = init_dp_state(params, buffers, opt, seed=3)
    x, y = data()
    valid = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    psg = loop_grads(ghost, params, buffers, x, y)
    mask = valid.to(F64)
    coef: dict[str, Tensor] = {}
    if clipping == "automatic":
        norm = sum(v.flatten(1).square().sum(1) for v in psg.values()).sqrt()
        coef = dict.fromkeys(psg, mask * c_total / (norm + g))
    else:
        c_layer = c_total / math.sqrt(len(ghost.layer_names))
        for names in ghost.layer_params.values():
            norm = sum(psg[k].flatten(1).square().sum(1) for k in names).sqrt()
            for k in names:
                coef[k] = mask * c_layer / (norm + g)
    expect = {k: torch.einsum("b,b...->...", coef[k], v) for k, v in psg.items()}

    total = step.clipped_sum(state, (x, y), valid)
    for k in params:
        torch.testing.assert_close(total.grads[k], expect[k], rtol=1e-10, atol=1e-13, msg=k)
    # normalised: every clipped per-sample gradient has norm below C, none is zero
    if clipping == "automatic":
        clipped_norms = coef["0.weight"] * norm
        assert bool((clipped_norms[valid] < c_total).all() and (clipped_norms[valid] > 0).all())

    new_state, _ = step(state, (x, y), valid)
    sizes = [p.numel() for p in params.values()]
    noise = normal(state.key, (sum(sizes),), F64).split(sizes)
    for (k, p), z in zip(params.items(), noise, strict=True):
        noisy = (expect[k] + sigma * c_total * z.reshape(p.shape)) / qn
        torch.testing.assert_close(new_state.params[k], p - 0.1 * noisy, rtol=1e-10, atol=1e-13)
    assert new_state.clip_norm is None


# -- adaptive clipping -----------------------------------------------------------------------

def norm_model() -> tuple:
    """``w * x`` with a per-sample loss equal to the output: the gradient of example i is x_i,
    so its norm is |x_i| whatever w is -- a stream of norms chosen by the test."""
    net = nn.Linear(1, 1, bias=False).to(F64)
    nn.init.constant_(net.weight, 0.5)
    return make_ghost_model(net)


def linear_loss(out: Tensor, y: Tensor) -> Tensor:
    return out[:, 0] * y


@pytest.mark.parametrize("normalize", [False, True])
def test_adaptive_threshold_and_noise_follow_the_formulas_by_hand(normalize: bool) -> None:
    ghost, params, buffers = norm_model()
    lr, sigma, sb, eta, tq, c0, qn = 0.05, 1.2, 2.5, 0.3, 0.6, 0.8, 8.0
    opt = torchopt.sgd(lr)
    step = make_dp_train_step(ghost, linear_loss, opt, noise_multiplier=sigma,
                              max_grad_norm=c0, sample_rate=0.1, dataset_size=80,
                              adaptive_clipping=AdaptiveClipping(tq, eta, sb,
                                                                 normalize_update=normalize))
    sigma_grad = (sigma**-2 - (2 * sb) ** -2) ** -0.5
    assert step.grad_noise_multiplier == pytest.approx(sigma_grad, rel=1e-15)
    state = init_dp_state(params, buffers, opt, seed=9, max_grad_norm=c0)
    assert state.clip_norm.dtype == F64 and float(state.clip_norm) == c0
    gen = torch.Generator().manual_seed(0)
    c, w = c0, 0.5
    for t in range(5):
        xs = torch.rand(12, 1, dtype=F64, generator=gen) * 2.0  # norms |x| in [0, 2)
        valid = torch.rand(12, generator=gen) < 0.75
        ones = torch.ones(12, dtype=F64)
        key = state.key
        state, metrics = step(state, (xs, ones), valid)
        # by hand: clip to c, count the unclipped (centred), noise from the count's own key
        norms = xs[:, 0].abs()
        v = valid.to(F64)
        coef = v * torch.clamp(c / (norms + 1e-6), max=1.0)
        z_grad = float(normal(key, (1,), F64)[0])
        # normalize_update: the noisy clipped sum is divided by q N C_t instead of q N
        divisor = qn * c if normalize else qn
        w = w - lr * (float((coef * xs[:, 0]).sum()) + sigma_grad * c * z_grad) / divisor
        z_count = float(normal(fold_in(key, _COUNT_SALT), (1,), F64)[0])
        below = float((v * (norms <= c).to(F64)).sum())
        b = (below - 0.5 * float(v.sum()) + sb * z_count) / qn + 0.5
        assert float(metrics["max_grad_norm"]) == pytest.approx(c, rel=1e-14)
        assert float(metrics["unclipped_fraction"]) == pytest.approx(b, rel=1e-12)
        c = c * math.exp(-eta * (b - tq))
        assert float(state.clip_norm) == pytest.approx(c, rel=1e-13), t
        assert float(state.params["weight"]) == pytest.approx(w, rel=1e-12), t
    assert c != pytest.approx(c0, rel=0.01)  # the threshold did move


@pytest.mark.parametrize("secure", [False, True])
def test_normalized_update_does_not_scale_with_the_threshold(secure: bool) -> None:
    # every norm is above both thresholds, so each clipped gradient is C_t g / ||g|| and the
    # noise sigma_grad C_t z: divided by q N C_t, the update is the same at C_t = 0.3 and 3
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(nn.Linear(6, 4).to(F64))
    lr, qn = 0.1, 5.0
    opt = torchopt.sgd(lr)
    kw = {"noise_multiplier": 1.3, "max_grad_norm": 1.0, "sample_rate": 0.01,
          "dataset_size": 500, "secure_noise": secure}
    def sum_loss(o: Tensor, y: Tensor) -> Tensor:  # gradient norms about 2 * 50 * ||x / 50||
        return o.sum(1)

    step = make_dp_train_step(ghost, sum_loss, opt, **kw, adaptive_clipping=AdaptiveClipping(
        count_noise_multiplier=0.8, normalize_update=True))
    plain = make_dp_train_step(ghost, sum_loss, opt, **kw, adaptive_clipping=AdaptiveClipping(
        count_noise_multiplier=0.8, normalize_update=False))
    state = (init_dp_state(params, buffers, opt, secure_noise=True, max_grad_norm=1.0)
             if secure else init_dp_state(params, buffers, opt, seed=4, max_grad_norm=1.0))
    g = torch.Generator().manual_seed(1)
    x, y = 50.0 * torch.randn(8, 6, dtype=F64, generator=g), torch.randint(0, 4, (8,), generator=g)
    valid = torch.ones(8, dtype=torch.bool)
    sg = step.grad_noise_multiplier
    deltas = {}
    for c in (0.3, 3.0):
        s = state._replace(clip_norm=torch.tensor(c, dtype=F64))
        new, m = step(s, (x, y), valid)
        assert float(m["clip_fraction"]) == 1.0  # all clipped at both thresholds
        deltas[c] = {k: state.params[k] - new.params[k] for k in params}
        plain_new, _ = plain(s, (x, y), valid)
        for k in params:  # without normalize_update the update is C_t times larger
            torch.testing.assert_close(state.params[k] - plain_new.params[k], c * deltas[c][k],
                                       rtol=1e-9, atol=1e-12)
    for k in params:
        torch.testing.assert_close(deltas[0.3][k], deltas[3.0][k], rtol=1e-9, atol=1e-12)
    # and its noise alone (an empty batch) has std lr sigma_grad / (q N) at C_t = 3
    z0 = torch.zeros((), dtype=F64)
    bghost, bp, bb = make_ghost_model(nn.Linear(100, 50).to(F64))
    big = make_dp_train_step(bghost, xent, opt, **kw, adaptive_clipping=AdaptiveClipping(
        count_noise_multiplier=0.8, normalize_update=True))
    bstate = (init_dp_state(bp, bb, opt, secure_noise=True, max_grad_norm=3.0) if secure
              else init_dp_state(bp, bb, opt, seed=4, max_grad_norm=3.0))
    new, _ = big.apply(bstate, ClippedSum({k: torch.zeros_like(v) for k, v in bp.items()},
                                          z0, z0, z0, z0))
    delta = torch.cat([(bstate.params[k] - new.params[k]).flatten() for k in bp])
    assert float(delta.std()) == pytest.approx(lr * sg / qn, rel=0.04)


def test_a_skipped_step_keeps_its_threshold() -> None:
    ghost, params, buffers = norm_model()
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, linear_loss, opt, noise_multiplier=1.0, max_grad_norm=0.5,
                              sample_rate=0.1, dataset_size=80,
                              adaptive_clipping=AdaptiveClipping(count_noise_multiplier=1.0))
    state = init_dp_state(params, buffers, opt, seed=0, max_grad_norm=0.5)
    xs = torch.full((8, 1), 2.0, dtype=F64)
    xs[3] = float("nan")  # a non-finite gradient: the step is skipped
    new, metrics = step(state, (xs, torch.ones(8, dtype=F64)), torch.ones(8, dtype=torch.bool))
    assert bool(metrics["skipped"]) and int(new.skipped) == 1
    assert torch.equal(new.clip_norm, state.clip_norm)
    assert torch.equal(new.params["weight"], state.params["weight"])
    xs[3] = 2.0  # all norms 2 > C = 0.5: the threshold grows
    new, metrics = step(new, (xs, torch.ones(8, dtype=F64)), torch.ones(8, dtype=torch.bool))
    assert not bool(metrics["skipped"]) and float(new.clip_norm) > 0.5


@pytest.mark.parametrize(("target", "normalize"),
                         [(0.5, False), (0.9, False), (0.5, True), (0.15, True)])
def test_adaptive_threshold_tracks_the_target_quantile(target: float, normalize: bool) -> None:
    # per-sample norms |x| with x ~ LogNormal(0, 0.5): the p-quantile is exp(0.5 * z_p)
    ghost, params, buffers = norm_model()
    opt = torchopt.sgd(0.0)
    qn = 64
    step = make_dp_train_step(ghost, linear_loss, opt, noise_multiplier=1.0,
                              max_grad_norm=0.05, sample_rate=0.1, dataset_size=10 * qn,
                              adaptive_clipping=AdaptiveClipping(target_quantile=target,
                                                                 normalize_update=normalize))
    # default: max(qN / 20, 3.5 sigma) = max(3.2, 3.5)
    assert step.adaptive_clipping.count_noise_multiplier == pytest.approx(3.5)
    state = init_dp_state(params, buffers, opt, seed=1, max_grad_norm=0.05)
    gen = torch.Generator().manual_seed(int(100 * target))
    ones, valid = torch.ones(qn, dtype=F64), torch.ones(qn, dtype=torch.bool)
    history = []
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(target)).item()
    true_quantile = math.exp(0.5 * z)
    assert true_quantile > 10 * 0.05  # C_0 starts far below
    for _ in range(200):
        xs = torch.exp(0.5 * torch.randn(qn, 1, dtype=F64, generator=gen))
        state, _ = step(state, (xs, ones), valid)
        history.append(float(state.clip_norm))
    late = history[-100:]
    mean_log = sum(math.log(h) for h in late) / len(late)
    assert abs(mean_log - math.log(true_quantile)) < 0.05, (math.exp(mean_log), true_quantile)
    # every late threshold has a fraction of the distribution below it near the target
    fractions = [float(torch.distributions.Normal(0.0, 0.5).cdf(torch.tensor(math.log(h))))
                 for h in late]
    assert max(abs(f - target) for f in fractions) < 0.12


def test_raised_noise_multiplier_and_noise_std_at_the_current_threshold() -> None:
    assert adaptive_grad_noise_multiplier(1.0, 3.2) == pytest.approx(
        (1.0 - 1.0 / 6.4**2) ** -0.5, rel=1e-15)
    for sigma, sb in [(0.7, 5.0), (2.0, 1.01), (0.5, 0.3), (1.0, 1e6)]:
        sg = adaptive_grad_noise_multiplier(sigma, sb)
        # the two Gaussian queries together cost exactly sigma (Andrew et al., Theorem 1)
        assert sg**-2 + (2 * sb) ** -2 == pytest.approx(sigma**-2, rel=1e-12)
        assert sg > sigma
    assert adaptive_grad_noise_multiplier(0.0, 1.0) == 0.0

    ghost, params, buffers = make_ghost_model(nn.Linear(100, 50).to(F64))
    opt = torchopt.sgd(1.0)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.3, max_grad_norm=1.0,
                              sample_rate=0.01, dataset_size=500,
                              adaptive_clipping=AdaptiveClipping(count_noise_multiplier=0.8,
                                                                 normalize_update=False))
    sg = adaptive_grad_noise_multiplier(1.3, 0.8)
    assert step.noise_std == pytest.approx(sg * 1.0)
    state = init_dp_state(params, buffers, opt, seed=4, max_grad_norm=1.0)
    state = state._replace(clip_norm=torch.tensor(3.0, dtype=F64))  # C_t moved to 3
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    z0 = torch.zeros((), dtype=F64)
    new, metrics = step.apply(state, ClippedSum(zeros, z0, z0, z0, z0))
    delta = torch.cat([(state.params[k] - new.params[k]).flatten() for k in params])
    assert float(delta.std()) == pytest.approx(sg * 3.0 / 5.0, rel=0.04)  # sigma_grad C_t / qN
    assert float(metrics["max_grad_norm"]) == 3.0
    # the accountant is stepped with the nominal sigma: the count is paid for by sigma_grad
    acct = RDPAccountant()
    sampler = PoissonSampler(500, 0.01, 16, seed=0)
    x, y = torch.randn(500, 100, dtype=F64), torch.randint(0, 50, (500,))
    step.run(state, sampler.sample(0), lambda i: (x[i], y[i]), acct)
    assert acct.history == ((1.3, 0.01, 1),)


@pytest.mark.parametrize("normalize", [False, True])
def test_adaptive_compiled_equals_eager_without_recompiles(normalize: bool) -> None:
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(nn.Linear(5, 3).to(F64))
    opt = torchopt.sgd(0.1, momentum=0.9)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.0, max_grad_norm=0.05,
                              sample_rate=0.2, dataset_size=50,
                              adaptive_clipping=AdaptiveClipping(learning_rate=0.5,
                                                                count_noise_multiplier=2.0,
                                                                normalize_update=normalize))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_state = compiled_state = init_dp_state(params, buffers, opt, seed=5, max_grad_norm=0.05)
    seen = set()
    for t in range(4):
        x, y = data(seed=t)
        valid = torch.rand(10, generator=torch.Generator().manual_seed(t)) < 0.7
        eager_state, m_e = step(eager_state, (x, y), valid)
        compiled_state, m_c = compiled(compiled_state, (x, y), valid)
        for k in params:
            torch.testing.assert_close(compiled_state.params[k], eager_state.params[k],
                                       rtol=1e-9, atol=1e-12, msg=k)
        assert sorted(m_c) == sorted(m_e)
        for k in m_e:
            torch.testing.assert_close(m_c[k], m_e[k], rtol=1e-9, atol=1e-12, msg=k)
        torch.testing.assert_close(compiled_state.clip_norm, eager_state.clip_norm,
                                   rtol=1e-12, atol=0)
        seen.add(float(eager_state.clip_norm))
        if t == 0:
            # with a cold Inductor cache Dynamo may restart its analysis of the first call once
            # (tensorify_python_scalars), which the counter also counts
            first = counter.frame_count
            assert first in (1, 2)
    assert len(seen) == 4  # C_t changed every step ...
    assert counter.frame_count == first  # ... and no step after the first compiled anything


def test_adaptive_over_several_physical_batches_equals_one() -> None:
    ghost, params, buffers = make_ghost_model(small_net())
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.0, max_grad_norm=0.3,
                              sample_rate=0.3, dataset_size=50,
                              adaptive_clipping=AdaptiveClipping())
    x, y = data(n=50)
    small, big = PoissonSampler(50, 0.3, 4, seed=2), PoissonSampler(50, 0.3, 50, seed=2)
    state = init_dp_state(params, buffers, opt, seed=0, max_grad_norm=0.3)
    s1 = s2 = state
    for t in range(3):
        assert len(small.sample(t)) > 1 and len(big.sample(t)) == 1
        s1, m1 = step.run(s1, small.sample(t), lambda i: (x[i], y[i]))
        s2, m2 = step.run(s2, big.sample(t), lambda i: (x[i], y[i]))
        torch.testing.assert_close(s1.clip_norm, s2.clip_norm, rtol=1e-12, atol=0)
        for k in ("unclipped_fraction", "max_grad_norm", "clip_fraction", "batch_size"):
            torch.testing.assert_close(m1[k], m2[k], rtol=1e-9, atol=1e-12, msg=k)
        for k in params:
            torch.testing.assert_close(s1.params[k], s2.params[k], rtol=1e-9, atol=1e-12)
    assert float(s1.clip_norm) != 0.3


def test_dp_state_saved_before_clip_norm_still_loads(tmp_path) -> None:
    _, params, buffers = make_ghost_model(small_net())
    opt = torchopt.sgd(0.1)
    dp_state = init_dp_state(params, buffers, opt, seed=0)
    path = os.path.join(tmp_path, "ckpt.pt")
    save_checkpoint(path, init_train_state({"w": torch.ones(2)}, {}, opt, seed=0),
                    extra={"dp": dp_state})
    # rewrite the file as an older torchfn wrote it: DPState without its last field
    payload = torch.load(path, weights_only=True)
    fields = payload["extra"]["values"][0]["fields"]
    assert list(fields)[-1] == "clip_norm"
    del fields["clip_norm"]
    torch.save(payload, path)
    _, extra = load_checkpoint(path)
    loaded = extra["dp"]
    assert isinstance(loaded, DPState) and loaded.clip_norm is None
    assert torch.equal(loaded.key, dp_state.key)
    # and a state with the field round-trips
    adaptive = init_dp_state(params, buffers, opt, seed=0, max_grad_norm=0.4)
    save_checkpoint(path, init_train_state({"w": torch.ones(2)}, {}, opt, seed=0),
                    extra={"dp": adaptive})
    assert float(load_checkpoint(path)[1]["dp"].clip_norm) == 0.4


@pytest.mark.parametrize("normalize", [False, True])
def test_adaptive_resume_from_a_checkpoint_is_exact(tmp_path, normalize: bool) -> None:
    ghost, params, buffers = norm_model()
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, linear_loss, opt, noise_multiplier=1.0, max_grad_norm=0.3,
                              sample_rate=0.1, dataset_size=80,
                              adaptive_clipping=AdaptiveClipping(count_noise_multiplier=1.0,
                                                                 normalize_update=normalize))
    gen = torch.Generator().manual_seed(3)
    batches = [torch.rand(8, 1, dtype=F64, generator=gen) for _ in range(4)]
    ones, valid = torch.ones(8, dtype=F64), torch.ones(8, dtype=torch.bool)
    straight = init_dp_state(params, buffers, opt, seed=2, max_grad_norm=0.3)
    for t, xs in enumerate(batches):
        straight, _ = step(straight, (xs, ones), valid)
        if t == 1:
            path = os.path.join(tmp_path, "mid.pt")
            save_checkpoint(path, init_train_state({"w": torch.ones(1)}, {}, opt, seed=0),
                            extra={"dp": straight})
    resumed = load_checkpoint(path)[1]["dp"]
    for xs in batches[2:]:
        resumed, _ = step(resumed, (xs, ones), valid)
    assert torch.equal(resumed.clip_norm, straight.clip_norm)
    assert torch.equal(resumed.params["weight"], straight.params["weight"])
    assert torch.equal(resumed.key, straight.key)


def test_bad_settings_fail_clearly() -> None:
    ghost, params, buffers = make_ghost_model(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    opt = torchopt.sgd(0.1)
    common = {"noise_multiplier": 1.0, "sample_rate": 0.1, "dataset_size": 100,
              "max_grad_norm": 1.0}
    with pytest.raises(ValueError, match=r"got clipping=.per_layer.\. Per-layer thresholds would each need their own noisy"):
        make_dp_train_step(ghost, xent, opt, clipping="per_layer",
                           adaptive_clipping=AdaptiveClipping(), **common)
    with pytest.raises(ValueError, match=r"needs clipping='flat', got 'automatic'.*no clipped"):
        make_dp_train_step(ghost, xent, opt, clipping="automatic",
                           adaptive_clipping=AdaptiveClipping(), **common)
    with pytest.raises(ValueError, match=r"count_noise_multiplier must be > noise_multiplier / "
                                         r"2 = 0\.5, got 0\.4"):
        make_dp_train_step(ghost, xent, opt,
                           adaptive_clipping=AdaptiveClipping(count_noise_multiplier=0.4),
                           **common)
    # the default count noise is never too small: max(expected batch 10 / 20, 3.5 sigma)
    step = make_dp_train_step(ghost, xent, opt, adaptive_clipping=AdaptiveClipping(), **common)
    assert step.adaptive_clipping.count_noise_multiplier == pytest.approx(3.5)
    assert step.grad_noise_multiplier == pytest.approx((1 - 1 / 49) ** -0.5)
    with pytest.raises(ValueError, match=r"count_noise_multiplier must be > noise_multiplier / "
                                         r"2 = 1\.5 .* got 1\.4"):
        adaptive_grad_noise_multiplier(3.0, 1.4)  # 1.4 > 1 / (2 * 3) but not > 3 / 2
    with pytest.raises(TypeError, match=r"expected an AdaptiveClipping.*got dict"):
        make_dp_train_step(ghost, xent, opt, adaptive_clipping={"target_quantile": 0.5},
                           **common)
    with pytest.raises(ValueError, match=r"target_quantile=...\): expected a fraction in "
                                         r"\(0, 1\), got 1\.0"):
        AdaptiveClipping(target_quantile=1.0)
    with pytest.raises(ValueError, match=r"learning_rate=...\): expected a finite number > 0"):
        AdaptiveClipping(learning_rate=-0.1)
    with pytest.raises(ValueError, match=r"count_noise_multiplier=...\): expected None or a "):
        AdaptiveClipping(count_noise_multiplier=float("nan"))
    assert AdaptiveClipping().normalize_update  # the default (docs/dp_clipping.md)
    with pytest.raises(TypeError, match=r"AdaptiveClipping\(normalize_update=...\): expected "
                                        r"True or False, got 1"):
        AdaptiveClipping(normalize_update=1)
    with pytest.raises(ValueError, match=r"automatic_gamma=...\): gamma is the stability "
                                         r"constant .* got clipping='flat'"):
        make_dp_train_step(ghost, xent, opt, automatic_gamma=0.1, **common)
    with pytest.raises(ValueError, match=r"automatic_gamma=...\): expected a finite number > 0, "
                                         r"got 0\.0"):
        make_dp_train_step(ghost, xent, opt, clipping="automatic", automatic_gamma=0.0,
                           **common)
    with pytest.raises(ValueError, match=r"expected one of \('flat', 'per_layer', 'automatic', "
                                         r"'automatic_per_layer'\), got 'auto'"):
        make_dp_train_step(ghost, xent, opt, clipping="auto", **common)
    with pytest.raises(ValueError, match=r"init_dp_state\(max_grad_norm=...\): expected a "
                                         r"finite number > 0, got -1"):
        init_dp_state(params, buffers, opt, seed=0, max_grad_norm=-1)
    step = make_dp_train_step(ghost, xent, opt, dataset_size=1000, noise_multiplier=1.0,
                              sample_rate=0.1, max_grad_norm=1.0,
                              adaptive_clipping=AdaptiveClipping())
    state = init_dp_state(params, buffers, opt, seed=0)  # no max_grad_norm: no clip_norm
    with pytest.raises(ValueError, match=r"state has no clip_norm .* build it with "
                                         r"init_dp_state\(\.\.\., max_grad_norm=1\)"):
        step(state, (torch.randn(4, 3), torch.randint(0, 2, (4,))), torch.ones(4, dtype=bool))


# -- target quantile schedules ---------------------------------------------------------------

def test_quantile_schedule_values_at_given_steps() -> None:
    ramp = AdaptiveClipping(target_quantile=(0.1, 0.5), quantile_steps=40)
    for t, want in [(0, 0.1), (10, 0.2), (20, 0.3), (39, 0.1 + 0.4 * 39 / 40), (40, 0.5),
                    (1000, 0.5)]:
        got = ramp.target_at(torch.tensor(t))
        assert got.dtype == F64 and got.shape == ()
        assert float(got) == pytest.approx(want, rel=1e-15, abs=1e-15), t
    falling = AdaptiveClipping(target_quantile=(0.9, 0.3), quantile_steps=3)
    assert [round(float(falling.target_at(torch.tensor(t))), 12) for t in range(5)] == [
        0.9, 0.7, 0.5, 0.3, 0.3]
    steps = AdaptiveClipping(target_quantile=lambda t: torch.where(t < 5, 0.2, 0.7))
    # (torch.where of Python floats is float32: the target is cast to float64 after)
    assert [float(steps.target_at(torch.tensor(t))) for t in (0, 4, 5, 9)] == pytest.approx(
        [0.2, 0.2, 0.7, 0.7], rel=1e-7)
    # a callable's later values are clamped into (0, 1)
    wild = AdaptiveClipping(target_quantile=lambda t: 0.25 + 0.25 * t.to(F64))
    assert float(wild.target_at(torch.tensor(1))) == 0.5
    assert float(wild.target_at(torch.tensor(4))) == pytest.approx(1 - 1e-3)
    assert float(AdaptiveClipping(0.3).target_at(torch.tensor(7))) == 0.3


def test_threshold_tracks_a_scheduled_quantile_on_a_stream_of_norms() -> None:
    # norms |x|, x ~ LogNormal(0, 0.5); the target jumps from 0.2 to 0.8 at step 150 (a
    # callable), or ramps 0.2 -> 0.8 over steps 0..150 and is held (a pair): both thresholds
    # end at the 0.8-quantile; the jump's threshold sits at the 0.2-quantile before it
    ghost, params, buffers = norm_model()
    opt = torchopt.sgd(0.0)
    qn = 64
    normal01 = torch.distributions.Normal(0.0, 1.0)

    def quantile(p: float) -> float:
        return math.exp(0.5 * float(normal01.icdf(torch.tensor(p))))

    schedules = {"jump": AdaptiveClipping(target_quantile=lambda t: torch.where(t < 150, 0.2, 0.8)),
                 "ramp": AdaptiveClipping(target_quantile=(0.2, 0.8), quantile_steps=150)}
    for name, adaptive in schedules.items():
        step = make_dp_train_step(ghost, linear_loss, opt, noise_multiplier=1.0,
                                  max_grad_norm=0.05, sample_rate=0.1, dataset_size=10 * qn,
                                  adaptive_clipping=adaptive)
        state = init_dp_state(params, buffers, opt, seed=2, max_grad_norm=0.05)
        gen = torch.Generator().manual_seed(7)
        ones, valid = torch.ones(qn, dtype=F64), torch.ones(qn, dtype=torch.bool)
        history, targets = [], []
        for _ in range(300):
            xs = torch.exp(0.5 * torch.randn(qn, 1, dtype=F64, generator=gen))
            targets.append(float(adaptive.target_at(state.step)))
            state, _ = step(state, (xs, ones), valid)
            history.append(float(state.clip_norm))

        def mean_log(hs: list[float]) -> float:
            return sum(math.log(h) for h in hs) / len(hs)

        assert abs(mean_log(history[-100:]) - math.log(quantile(0.8))) < 0.05, name
        if name == "jump":
            assert abs(mean_log(history[75:150]) - math.log(quantile(0.2))) < 0.05
        else:  # the ramp: the threshold follows the moving quantile, a few steps behind
            assert targets[75] == pytest.approx(0.5)
            assert abs(mean_log(history[70:90]) - math.log(quantile(0.5))) < 0.12


def test_quantile_schedule_leaves_the_accounting_unchanged() -> None:
    ghost, params, buffers = make_ghost_model(nn.Linear(5, 3).to(F64))
    opt = torchopt.sgd(0.1)
    kw = {"noise_multiplier": 1.3, "max_grad_norm": 0.5, "sample_rate": 0.1,
          "dataset_size": 60}
    fixed = make_dp_train_step(ghost, xent, opt, **kw,
                               adaptive_clipping=AdaptiveClipping(count_noise_multiplier=2.0))
    ramp = make_dp_train_step(ghost, xent, opt, **kw, adaptive_clipping=AdaptiveClipping(
        (0.05, 0.5), count_noise_multiplier=2.0, quantile_steps=10))
    assert ramp.grad_noise_multiplier == fixed.grad_noise_multiplier == pytest.approx(
        adaptive_grad_noise_multiplier(1.3, 2.0))
    x, y = data(seed=3, n=60)
    sampler = PoissonSampler(60, 0.1, 16, seed=0)
    accts = []
    for step in (fixed, ramp):
        acct = RDPAccountant()
        state = init_dp_state(params, buffers, opt, seed=1, max_grad_norm=0.5)
        for t in range(3):
            state, _ = step.run(state, sampler.sample(t), lambda i: (x[i], y[i]), acct)
        accts.append(acct)
    assert accts[0].history == accts[1].history == ((1.3, 0.1, 3),)
    assert accts[0].get_epsilon(1e-5) == accts[1].get_epsilon(1e-5)
    # the same noise draws: at step 0 both targets... differ (0.5 vs 0.05), so C_1 differs by
    # exactly exp(eta (0.5 - 0.05)) for the same count
    s0 = init_dp_state(params, buffers, opt, seed=1, max_grad_norm=0.5)
    x0, y0 = x[:8], y[:8]
    valid = torch.ones(8, dtype=torch.bool)
    a, _ = fixed(s0, (x0, y0), valid)
    b, _ = ramp(s0, (x0, y0), valid)
    assert float(b.clip_norm / a.clip_norm) == pytest.approx(math.exp(0.2 * (0.05 - 0.5)),
                                                             rel=1e-12)


def test_quantile_schedule_compiled_equals_eager_without_recompiles() -> None:
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(nn.Linear(5, 3).to(F64))
    opt = torchopt.sgd(0.1)
    for adaptive in (AdaptiveClipping((0.1, 0.6), 0.5, 2.0, quantile_steps=3),
                     AdaptiveClipping(lambda t: 0.1 + 0.4 * torch.sigmoid(t.to(F64) - 2.0),
                                      0.5, 2.0)):
        step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.0, max_grad_norm=0.05,
                                  sample_rate=0.2, dataset_size=50, adaptive_clipping=adaptive)
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        eager = comp = init_dp_state(params, buffers, opt, seed=5, max_grad_norm=0.05)
        for t in range(5):
            x, y = data(seed=t)
            valid = torch.ones(10, dtype=torch.bool)
            eager, _ = step(eager, (x, y), valid)
            comp, _ = compiled(comp, (x, y), valid)
            torch.testing.assert_close(comp.clip_norm, eager.clip_norm, rtol=1e-12, atol=0)
            for k in params:
                torch.testing.assert_close(comp.params[k], eager.params[k], rtol=1e-9,
                                           atol=1e-12, msg=k)
            if t == 0:
                first = counter.frame_count
                assert first in (1, 2)  # see test_adaptive_compiled_equals_eager_...
        assert counter.frame_count == first  # the step counter moved the target: no recompile


def test_bad_quantile_schedules_fail_clearly() -> None:
    with pytest.raises(ValueError, match=r"a \(start, end\) ramp needs quantile_steps, an int "
                                         r">= 1 .* got None"):
        AdaptiveClipping(target_quantile=(0.1, 0.5))
    with pytest.raises(ValueError, match=r"target_quantile=\(start, end\)\): expected two "
                                         r"fractions in \(0, 1\), got \(0\.1, 1\.0\)"):
        AdaptiveClipping(target_quantile=(0.1, 1.0), quantile_steps=5)
    with pytest.raises(ValueError, match=r"quantile_steps=10\): only for a \(start, end\) "
                                         r"target_quantile, got target_quantile=0\.5"):
        AdaptiveClipping(target_quantile=0.5, quantile_steps=10)
    with pytest.raises(ValueError, match=r"expected the schedule to return a fraction in "
                                         r"\(0, 1\), got 0\.0 at step 0"):
        AdaptiveClipping(target_quantile=lambda t: t.to(F64))
