"""PRV accountant: the analytic Gaussian mechanism exactly, dp_accounting's PLD numbers, bounds
that contain the truth, heterogeneous histories, state, sigma search, CLI, errors."""

from __future__ import annotations

import math

import pytest

from torchfn.cli import main
from torchfn.persample import (
    PRVAccountant,
    PRVEpsilon,
    RDPAccountant,
    noise_multiplier_for_epsilon,
    prv_epsilon,
)

# (q, sigma, steps, delta, PLD epsilon of dp-accounting 0.6.0 at interval 1e-4, RDP epsilon):
# issue 19's settings (`torchfn dp epsilon --accountant pld|rdp` prints them)
SETTINGS = [
    (0.01, 1.1, 1000, 1e-5, 1.515370, 1.711770),
    (0.032, 0.639, 93, 1e-5, 6.746917, 8.002447),
    (0.004, 0.8, 10_000, 1e-5, 3.534866, 3.940467),
]


def _gaussian_delta(eps: float, mu: float) -> float:
    """Balle & Wang 2018 (Theorem 8): delta(eps) of the Gaussian mechanism, sensitivity /
    sigma = mu; ``Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2)``."""
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2.0))  # noqa: E731
    return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)


def _gaussian_epsilon(delta: float, mu: float) -> float:
    lo, hi = 0.0, 100.0
    for _ in range(200):  # delta(eps) is decreasing
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _gaussian_delta(mid, mu) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize(("sigma", "steps", "delta"), [(4.0, 16, 1e-5), (1.0, 1, 1e-6),
                                                       (2.0, 10, 1e-3)])
def test_gaussian_mechanism_matches_the_analytic_epsilon(sigma, steps, delta):
    """q = 1: k steps of noise sigma are one Gaussian mechanism with mu = sqrt(k) / sigma."""
    exact = _gaussian_epsilon(delta, math.sqrt(steps) / sigma)
    acct = PRVAccountant(eps_error=1e-3)
    acct.step(noise_multiplier=sigma, sample_rate=1.0, steps=steps)
    b = acct.get_epsilon_bounds(delta)
    assert isinstance(b, PRVEpsilon)
    assert b.low <= exact <= b.upper  # the bounds hold
    assert b.upper - b.low < 4e-3  # and are as tight as eps_error = 1e-3 asks
    assert b.estimate == pytest.approx(exact, abs=1e-5)
    assert acct.get_epsilon(delta) == b.upper
    # the default eps_error = 0.01: the upper bound is within 0.01 + a little of the truth
    assert exact <= prv_epsilon(1.0, sigma, steps, delta) <= exact + 0.011


@pytest.mark.parametrize("eps_error", [0.5, 0.1, 0.03])
def test_bounds_hold_on_coarse_meshes(eps_error):
    """The proven bounds contain the exact epsilon however coarse the mesh (q = 1, where the
    exact value is known); the estimate moves by less than eps_error."""
    for sigma, steps, delta in [(0.8, 1, 1e-5), (1.5, 30, 1e-6), (5.0, 400, 1e-3)]:
        exact = _gaussian_epsilon(delta, math.sqrt(steps) / sigma)
        b = PRVAccountant(eps_error=eps_error)
        b.step(noise_multiplier=sigma, sample_rate=1.0, steps=steps)
        low, estimate, upper = b.get_epsilon_bounds(delta)
        assert low <= exact <= upper
        assert abs(estimate - exact) < eps_error


@pytest.mark.parametrize(("q", "sigma", "steps", "delta", "pld_ref", "rdp_ref"), SETTINGS)
def test_prv_matches_pld_and_beats_rdp_on_issue_settings(q, sigma, steps, delta, pld_ref,
                                                         rdp_ref):
    acct = PRVAccountant()
    acct.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    low, estimate, upper = acct.get_epsilon_bounds(delta)
    # the estimate agrees with dp_accounting's PLD to 1e-4 relative; the proven upper bound is
    # within eps_error = 0.01 (plus a little for the delta spent on error bounds) above it
    assert estimate == pytest.approx(pld_ref, rel=1e-4)
    assert low < pld_ref < upper < pld_ref + 0.0115
    assert upper == pytest.approx(pld_ref, rel=1e-2)
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    assert rdp.get_epsilon(delta) == pytest.approx(rdp_ref, abs=1e-5)
    assert upper < 0.92 * rdp_ref  # the PRV bound is at least 8% tighter than RDP on each
    assert prv_epsilon(q, sigma, steps, delta) == upper
    eps, order = acct.get_privacy_spent(delta)
    assert eps == upper and math.isnan(order)


def test_issue_settings_reference_values_are_dp_accountings():
    """The PLD column of SETTINGS is what dp_accounting gives today (skipped without it)."""
    pytest.importorskip("dp_accounting", reason='the accounting extra is not installed: pip '
                        'install "torchfn[accounting]"')
    from torchfn.persample import pld_epsilon

    for q, sigma, steps, delta, pld_ref, _ in SETTINGS[:1]:  # each takes one to a few seconds
        assert pld_epsilon(q, sigma, steps, delta) == pytest.approx(pld_ref, abs=2e-6)


def test_heterogeneous_history_matches_dp_accounting():
    pytest.importorskip("dp_accounting", reason='the accounting extra is not installed: pip '
                        'install "torchfn[accounting]"')
    from torchfn.persample import PLDAccountant

    acct, pld = PRVAccountant(), PLDAccountant(value_discretization_interval=1e-3)
    for a in (acct, pld):
        a.step(noise_multiplier=1.0, sample_rate=0.02, steps=200)
        a.step(noise_multiplier=1.0, sample_rate=0.02, steps=100)  # merged with the first
        a.step(noise_multiplier=2.0, sample_rate=0.05, steps=50)
        a.step(noise_multiplier=1.0, sample_rate=0.02, steps=0)  # no-op
    assert acct.history == ((1.0, 0.02, 300), (2.0, 0.05, 50))
    for delta in (1e-5, 1e-3):
        b = acct.get_epsilon_bounds(delta)
        ref = pld.get_epsilon(delta)  # an upper bound itself, 1e-3 coarse: within 2e-3 above
        assert b.estimate == pytest.approx(ref, abs=2e-3)
        assert b.low < ref < b.upper
    # each phase alone is cheaper; composing more can only cost more
    one = PRVAccountant()
    one.step(noise_multiplier=1.0, sample_rate=0.02, steps=300)
    assert one.get_epsilon(1e-5) < acct.get_epsilon(1e-5)
    before = acct.get_epsilon_bounds(1e-5).estimate
    acct.step(noise_multiplier=1.0, sample_rate=0.02)
    assert acct.get_epsilon_bounds(1e-5).estimate > before


def test_heterogeneous_gaussian_history_is_exact():
    """q = 1 phases compose to one Gaussian with mu^2 = sum steps / sigma^2 (no dp_accounting)."""
    acct = PRVAccountant(eps_error=1e-3)
    acct.step(noise_multiplier=3.0, sample_rate=1.0, steps=5)
    acct.step(noise_multiplier=6.0, sample_rate=1.0, steps=12)
    mu = math.sqrt(5 / 9 + 12 / 36)
    exact = _gaussian_epsilon(1e-5, mu)
    b = acct.get_epsilon_bounds(1e-5)
    assert b.low <= exact <= b.upper
    assert b.estimate == pytest.approx(exact, abs=1e-5)


def test_prv_edge_cases():
    acct = PRVAccountant()
    assert acct.get_epsilon(1e-5) == 0.0  # nothing recorded
    acct.step(noise_multiplier=1.0, sample_rate=0.0, steps=100)
    assert acct.get_epsilon_bounds(1e-5) == (0.0, 0.0, 0.0)  # data never sampled
    acct.step(noise_multiplier=0.0, sample_rate=0.1)
    assert acct.get_epsilon(1e-5) == math.inf  # no noise
    # a loss support narrower than the mesh (tiny noise) still gives a (huge) finite bound
    assert 600 < prv_epsilon(0.2, 0.05, 3, 1e-5) < math.inf


def test_prv_state_round_trip():
    acct = PRVAccountant(eps_error=0.02, delta_error=1e-9)
    acct.step(noise_multiplier=1.1, sample_rate=0.01, steps=300)
    acct.step(noise_multiplier=0.9, sample_rate=0.02, steps=20)
    state = acct.state_dict()
    assert state == {
        "format": "torchfn.prv_accountant", "version": 1,
        "eps_error": 0.02, "delta_error": 1e-9,
        "history": [[1.1, 0.01, 300], [0.9, 0.02, 20]],
    }
    resumed = PRVAccountant()
    resumed.load_state_dict(state)
    assert resumed.history == acct.history
    assert (resumed.eps_error, resumed.delta_error) == (0.02, 1e-9)
    assert resumed.get_epsilon_bounds(1e-5) == acct.get_epsilon_bounds(1e-5)
    with pytest.raises(ValueError, match=r"only a PRVAccountant\.state_dict\(\) loads here"):
        resumed.load_state_dict(RDPAccountant().state_dict())
    with pytest.raises(ValueError, match=r"missing keys \['history'\]"):
        resumed.load_state_dict({k: v for k, v in state.items() if k != "history"})
    with pytest.raises(ValueError, match=r"history\[0\]: sample_rate must be in \[0, 1\]"):
        resumed.load_state_dict({**state, "history": [[1.0, 2.0, 3]]})
    with pytest.raises(ValueError, match=r"eps_error must be in \[1e-6, 1\]"):
        resumed.load_state_dict({**state, "eps_error": 0.0})
    with pytest.raises(TypeError, match="expected a dict from state_dict"):
        resumed.load_state_dict([1, 2])
    assert resumed.history == acct.history  # failed loads changed nothing
    assert resumed.eps_error == 0.02
    # an RDP accountant refuses a PRV state
    with pytest.raises(ValueError, match=r"RDPAccountant.load_state_dict: expected format=.*only a RDPAccountant"):
        RDPAccountant().load_state_dict(state)


def test_noise_multiplier_for_epsilon_prv():
    q, steps, delta, target = 0.02, 200, 1e-5, 1.5
    sigma_rdp = noise_multiplier_for_epsilon(target, delta, q, steps)
    sigma_prv = noise_multiplier_for_epsilon(target, delta, q, steps, accountant="prv",
                                             rtol=1e-3)
    assert sigma_prv < sigma_rdp
    eps = prv_epsilon(q, sigma_prv, steps, delta)
    assert eps <= target
    assert eps == pytest.approx(target, rel=5e-3)
    # 0.2% less noise overshoots the target: the sigma is the threshold, not just any valid one
    assert prv_epsilon(q, sigma_prv * (1 - 2e-3), steps, delta) > target
    assert noise_multiplier_for_epsilon(target, delta, 0.0, steps, accountant="prv") == 0.0
    with pytest.raises(ValueError, match='orders and conversion apply to accountant="rdp" only; '
                                         'got accountant="prv"'):
        noise_multiplier_for_epsilon(target, delta, q, steps, accountant="prv",
                                     orders=(2.0, 4.0))


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match='accountant must be "rdp", "pld" or "prv"; got \'gdp\''):
        noise_multiplier_for_epsilon(1.0, 1e-5, 0.01, 100, accountant="gdp")
    with pytest.raises(ValueError, match=r"PRVAccountant: eps_error must be in \[1e-6, 1\]"):
        PRVAccountant(eps_error=0.0)
    with pytest.raises(TypeError, match="PRVAccountant: eps_error must be a number"):
        PRVAccountant(eps_error="fine")
    with pytest.raises(ValueError, match=r"delta_error must be None \(delta / 1000\) or in"):
        PRVAccountant(delta_error=1.5)
    acct = PRVAccountant(delta_error=1e-3)
    acct.step(noise_multiplier=1.0, sample_rate=0.01, steps=10)
    with pytest.raises(ValueError, match=r"delta_error must be below delta / 2 .* got "
                                         r"delta_error=0.001 for delta=1e-05"):
        acct.get_epsilon(1e-5)
    with pytest.raises(ValueError, match=r"PRVAccountant\.step: noise_multiplier must be a finite"):
        acct.step(noise_multiplier=-1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match=r"PRVAccountant.step: sample_rate must be in \[0, 1\]"):
        acct.step(noise_multiplier=1.0, sample_rate=1.5)
    with pytest.raises(TypeError, match=r"PRVAccountant\.step: steps must be an int"):
        acct.step(noise_multiplier=1.0, sample_rate=0.1, steps=2.5)
    with pytest.raises(ValueError, match=r"get_epsilon: delta must be in the open interval"):
        acct.get_epsilon(0.0)
    with pytest.raises(ValueError, match=r"prv_epsilon: q must be in \[0, 1\]"):
        prv_epsilon(-0.1, 1.0, 10, 1e-5)
    with pytest.raises(ValueError, match=r"the PRV mesh would need \d+ points .* raise eps_error"):
        prv_epsilon(0.01, 0.3, 100_000, 1e-5, eps_error=1e-4)
    assert acct.history == ((1.0, 0.01, 10),)


def test_cli_dp_epsilon_prv(capsys):
    argv = ["dp", "epsilon", "--q", "0.01", "--sigma", "1.1", "--steps", "1000",
            "--delta", "1e-5", "--accountant", "prv"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out == f"{prv_epsilon(0.01, 1.1, 1000, 1e-5):.6f}\n"
    assert float(out) == pytest.approx(1.525423, abs=2e-6)


def test_dp_step_run_steps_a_prv_accountant() -> None:
    """DPTrainStep.run takes a PRVAccountant as it takes an RDPAccountant: one logical step,
    one (sigma, q) entry, and an epsilon below RDP's for the same history."""
    import torch
    import torch.nn.functional as F
    import torchopt
    from torch import nn

    from torchfn.persample import (
        PoissonSampler,
        init_dp_state,
        make_dp_train_step,
        make_ghost_model,
    )

    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(nn.Linear(4, 2))
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"), opt,
                              noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.1,
                              dataset_size=40)
    x, y = torch.randn(40, 4), torch.randint(0, 2, (40,))
    chunks = PoissonSampler(40, 0.1, 16, seed=0).sample(0)
    prv, rdp = PRVAccountant(), RDPAccountant()
    state = init_dp_state(params, buffers, opt, seed=0)
    for acct in (prv, rdp):
        for _ in range(3):
            step.run(state, chunks, lambda i: (x[i], y[i]), acct)
    assert prv.history == rdp.history == ((1.0, 0.1, 3),)
    assert 0 < prv.get_epsilon(1e-5) < rdp.get_epsilon(1e-5)
