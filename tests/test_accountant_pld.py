"""PLD accountant: dp_accounting's numbers reproduced, tighter than RDP, state, sigma search, CLI."""

from __future__ import annotations

import math
import sys

import pytest

from torchfn.cli import main
from torchfn.persample import (
    PLDAccountant,
    RDPAccountant,
    noise_multiplier_for_epsilon,
    pld_epsilon,
)

dp_accounting = pytest.importorskip(
    "dp_accounting", reason='the accounting extra is not installed: pip install "torchfn[accounting]"'
)

# (q, sigma, steps, delta, PLD epsilon of dp-accounting 0.6.0, RDP epsilon): issue 19's settings
SETTINGS = [
    (0.01, 1.1, 1000, 1e-5, 1.5154, 1.7118),
    (0.032, 0.639, 93, 1e-5, 6.7469, 8.0024),
    (0.004, 0.8, 10_000, 1e-5, 3.5349, 3.9405),
]


def _direct(history, delta, interval=1e-4):
    """dp_accounting's PLD accountant called directly on a (sigma, q, steps) history."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    acct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    for sigma, q, steps in history:
        acct.compose(dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps))
    return acct.get_epsilon(delta)


@pytest.mark.parametrize(("q", "sigma", "steps", "delta", "pld_ref", "rdp_ref"), SETTINGS)
def test_pld_is_tighter_than_rdp_on_issue_settings(q, sigma, steps, delta, pld_ref, rdp_ref):
    acct = PLDAccountant()
    acct.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    eps = acct.get_epsilon(delta)
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    eps_rdp = rdp.get_epsilon(delta)
    assert eps == pytest.approx(pld_ref, abs=1e-3)
    assert eps_rdp == pytest.approx(rdp_ref, abs=1e-3)
    assert eps < 0.92 * eps_rdp  # at least 8% tighter on each
    assert pld_epsilon(q, sigma, steps, delta) == eps


def test_pld_equals_dp_accounting_directly_heterogeneous_history():
    acct = PLDAccountant(value_discretization_interval=1e-3)
    acct.step(noise_multiplier=1.0, sample_rate=0.02, steps=200)
    acct.step(noise_multiplier=1.0, sample_rate=0.02, steps=100)  # merged with the first
    acct.step(noise_multiplier=2.0, sample_rate=0.05, steps=50)
    acct.step(noise_multiplier=1.0, sample_rate=0.02, steps=0)  # no-op
    assert acct.history == ((1.0, 0.02, 300), (2.0, 0.05, 50))
    for delta in (1e-5, 1e-3):
        assert acct.get_epsilon(delta) == _direct(acct.history, delta, 1e-3)
    eps, order = acct.get_privacy_spent(1e-5)
    assert eps == acct.get_epsilon(1e-5) and math.isnan(order)
    # composing more can only cost more
    before = acct.get_epsilon(1e-5)
    acct.step(noise_multiplier=1.0, sample_rate=0.02)
    assert acct.get_epsilon(1e-5) > before


def test_pld_edge_cases():
    acct = PLDAccountant()
    assert acct.get_epsilon(1e-5) == 0.0  # nothing recorded
    acct.step(noise_multiplier=1.0, sample_rate=0.0, steps=100)
    assert acct.get_epsilon(1e-5) == 0.0  # data never sampled
    acct.step(noise_multiplier=0.0, sample_rate=0.1)
    assert acct.get_epsilon(1e-5) == math.inf  # no noise
    # q == 1: the plain Gaussian mechanism composed; PLD is exact up to discretisation
    from scipy.stats import norm

    sigma, steps, delta = 4.0, 16, 1e-5
    mu = math.sqrt(steps) / sigma  # composed Gaussian: GDP with mu = sqrt(T) / sigma

    def gauss_delta(e):
        return norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2)

    eps = pld_epsilon(1.0, sigma, steps, delta)
    assert gauss_delta(eps) <= delta * (1 + 1e-6)
    assert gauss_delta(eps - 2e-3) > delta  # tight to the discretisation


def test_pld_state_round_trip():
    acct = PLDAccountant(value_discretization_interval=2e-4)
    acct.step(noise_multiplier=1.1, sample_rate=0.01, steps=300)
    acct.step(noise_multiplier=0.9, sample_rate=0.02, steps=20)
    state = acct.state_dict()
    assert state == {
        "format": "torchfn.pld_accountant", "version": 1,
        "value_discretization_interval": 2e-4,
        "history": [[1.1, 0.01, 300], [0.9, 0.02, 20]],
    }
    resumed = PLDAccountant()
    resumed.load_state_dict(state)
    assert resumed.history == acct.history
    assert resumed.value_discretization_interval == 2e-4
    assert resumed.get_epsilon(1e-5) == acct.get_epsilon(1e-5)
    with pytest.raises(ValueError, match=r"only a PLDAccountant\.state_dict\(\) loads here"):
        resumed.load_state_dict(RDPAccountant().state_dict())
    with pytest.raises(ValueError, match=r"missing keys \['history'\]"):
        resumed.load_state_dict({k: v for k, v in state.items() if k != "history"})
    with pytest.raises(ValueError, match=r"history\[0\]: sample_rate must be in \[0, 1\]"):
        resumed.load_state_dict({**state, "history": [[1.0, 2.0, 3]]})
    with pytest.raises(TypeError, match="expected a dict from state_dict"):
        resumed.load_state_dict([1, 2])
    assert resumed.history == acct.history  # failed loads changed nothing


def test_noise_multiplier_for_epsilon_pld():
    q, steps, delta, target = 0.02, 200, 1e-5, 1.5
    sigma_rdp = noise_multiplier_for_epsilon(target, delta, q, steps)
    sigma_pld = noise_multiplier_for_epsilon(target, delta, q, steps, accountant="pld", rtol=3e-3)
    assert sigma_pld < sigma_rdp
    eps = pld_epsilon(q, sigma_pld, steps, delta)
    assert eps <= target
    assert eps == pytest.approx(target, rel=1e-2)
    # 0.6% less noise overshoots the target: the sigma is the threshold, not just any valid one
    assert pld_epsilon(q, sigma_pld * (1 - 3e-3) ** 2, steps, delta) > target
    assert noise_multiplier_for_epsilon(target, delta, 0.0, steps, accountant="pld") == 0.0
    # the default accountant is unchanged
    assert noise_multiplier_for_epsilon(target, delta, q, steps, accountant="rdp") == sigma_rdp


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match='accountant must be "rdp", "pld" or "prv"; got \'gdp\''):
        noise_multiplier_for_epsilon(1.0, 1e-5, 0.01, 100, accountant="gdp")
    with pytest.raises(ValueError, match='orders and conversion apply to accountant="rdp" only'):
        noise_multiplier_for_epsilon(1.0, 1e-5, 0.01, 100, accountant="pld", orders=(2.0, 4.0))
    with pytest.raises(ValueError, match=r"value_discretization_interval must be in \(0, 1\]"):
        PLDAccountant(value_discretization_interval=0.0)
    with pytest.raises(TypeError, match="value_discretization_interval must be a number"):
        PLDAccountant(value_discretization_interval="fine")
    acct = PLDAccountant()
    with pytest.raises(ValueError, match=r"PLDAccountant\.step: noise_multiplier must be a finite"):
        acct.step(noise_multiplier=-1.0, sample_rate=0.1)
    with pytest.raises(ValueError, match=r"PLDAccountant.step: sample_rate must be in \[0, 1\]"):
        acct.step(noise_multiplier=1.0, sample_rate=1.5)
    with pytest.raises(TypeError, match=r"PLDAccountant\.step: steps must be an int"):
        acct.step(noise_multiplier=1.0, sample_rate=0.1, steps=2.5)
    with pytest.raises(ValueError, match=r"get_epsilon: delta must be in the open interval"):
        acct.get_epsilon(0.0)
    with pytest.raises(ValueError, match=r"pld_epsilon: q must be in \[0, 1\]"):
        pld_epsilon(-0.1, 1.0, 10, 1e-5)
    assert acct.history == ()


def test_missing_dp_accounting_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # makes `import dp_accounting` fail
    with pytest.raises(ImportError, match=r'pip install "torchfn\[accounting\]"'):
        PLDAccountant()
    with pytest.raises(ImportError, match=r'pip install "torchfn\[accounting\]"'):
        noise_multiplier_for_epsilon(1.0, 1e-5, 0.01, 100, accountant="pld")
    assert main(["dp", "epsilon", "--q", "0.01", "--sigma", "1.1", "--steps", "10",
                 "--delta", "1e-5", "--accountant", "pld"]) == 2
    # RDP needs nothing optional
    assert noise_multiplier_for_epsilon(8.0, 1e-5, 0.04, 100) > 0


@pytest.mark.parametrize(("accountant", "expected"), [("rdp", "1.711770"), ("pld", "1.515370"),
                                                      (None, "1.711770")])
def test_cli_dp_epsilon(capsys, accountant, expected):
    argv = ["dp", "epsilon", "--q", "0.01", "--sigma", "1.1", "--steps", "1000",
            "--delta", "1e-5"]
    if accountant is not None:
        argv += ["--accountant", accountant]
    assert main(argv) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_cli_dp_epsilon_bad_arguments(capsys):
    assert main(["dp", "epsilon", "--q", "1.5", "--sigma", "-1", "--steps", "10",
                 "--delta", "1e-5"]) == 2
    err = capsys.readouterr().err
    assert "--q must be a sampling probability in [0, 1]; got 1.5" in err
    assert "--sigma must be a finite noise multiplier >= 0; got -1.0" in err
    with pytest.raises(SystemExit) as exc:
        main(["dp", "epsilon", "--q", "0.01", "--sigma", "1", "--steps", "10", "--delta", "1e-5",
              "--accountant", "gdp"])
    assert exc.value.code == 2
    assert "invalid choice: 'gdp'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["dp", "epsilon", "--q", "0.01"])
    assert "required: --sigma, --steps, --delta" in capsys.readouterr().err


def test_dp_step_run_steps_a_pld_accountant() -> None:
    """DPTrainStep.run takes a PLDAccountant as it takes an RDPAccountant: one logical step,
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
    pld, rdp = PLDAccountant(), RDPAccountant()
    state = init_dp_state(params, buffers, opt, seed=0)
    for acct in (pld, rdp):
        for _ in range(3):
            step.run(state, chunks, lambda i: (x[i], y[i]), acct)
    assert pld.history == rdp.history == ((1.0, 0.1, 3),)
    assert 0 < pld.get_epsilon(1e-5) < rdp.get_epsilon(1e-5)
