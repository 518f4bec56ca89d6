"""Epsilon reporting by the DP step: ``run`` steps the accountant and reports
``accountant.get_epsilon(delta)`` (RDP, PLD) as a host float, every ``epsilon_every`` steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import Tensor, nn

from torchfn.persample import (
    PLDAccountant,
    PoissonSampler,
    RDPAccountant,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)

N, Q = 60, 0.1


def xent(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _setup(**kwargs):
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(nn.Linear(4, 3))
    opt = torchopt.sgd(0.1)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.1, max_grad_norm=1.0,
                              sample_rate=Q, dataset_size=N, **kwargs)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)
    return ghost, step, init_dp_state(params, buffers, opt, seed=1), (x, y)


def _run(step, state, data, accountant, steps):
    x, y = data
    sampler = PoissonSampler(N, Q, 16, seed=0)
    reports = []
    for t in range(steps):
        state, metrics = step.run(state, sampler.sample(t), lambda i: (x[i], y[i]), accountant)
        reports.append(metrics.get("epsilon"))
    return state, reports


def test_rdp_epsilon_is_reported_every_step_and_equals_the_accountant() -> None:
    _, step, state, data = _setup(delta=1e-5)
    acct = RDPAccountant()
    ref = RDPAccountant()
    _, reports = _run(step, state, data, acct, 3)
    for t, eps in enumerate(reports):
        ref.step(noise_multiplier=1.1, sample_rate=Q)
        assert isinstance(eps, float) and eps == ref.get_epsilon(1e-5), t
    assert reports[0] < reports[1] < reports[2]
    assert reports[-1] == acct.get_epsilon(1e-5)


def test_epsilon_every_and_no_delta() -> None:
    _, step, state, data = _setup(delta=1e-6, epsilon_every=2)
    acct = RDPAccountant()
    acct.step(noise_multiplier=2.0, sample_rate=0.01, steps=3)  # a resumed history counts
    _, reports = _run(step, state, data, acct, 4)
    assert [r is None for r in reports] == [False, True, False, True]
    for t in (0, 2):  # after 3 + 1 and 3 + 3 recorded steps
        ref = RDPAccountant()
        ref.step(noise_multiplier=2.0, sample_rate=0.01, steps=3)
        ref.step(noise_multiplier=1.1, sample_rate=Q, steps=t + 1)
        assert reports[t] == ref.get_epsilon(1e-6), t
    _, plain, state, data = _setup()  # no delta: no epsilon, the accountant still steps
    acct = RDPAccountant()
    _, reports = _run(plain, state, data, acct, 2)
    assert reports == [None, None] and acct.history == ((1.1, Q, 2),)


def test_pld_epsilon_is_reported_and_equals_the_accountant() -> None:
    pytest.importorskip("dp_accounting",
                        reason='the accounting extra is not installed: pip install "torchfn[accounting]"')
    _, step, state, data = _setup(delta=1e-5, epsilon_every=2)
    acct = PLDAccountant()
    _, reports = _run(step, state, data, acct, 2)
    assert reports[0] is None
    assert isinstance(reports[1], float) and reports[1] == acct.get_epsilon(1e-5)
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=1.1, sample_rate=Q, steps=2)
    assert 0 < reports[1] < rdp.get_epsilon(1e-5)  # PLD is tighter


def test_epsilon_options_refuse_bad_values() -> None:
    ghost, _, _, _ = _setup()
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=Q, dataset_size=N)
    with pytest.raises(ValueError, match=r"make_dp_train_step\(delta=\.\.\.\): delta must be in "
                                         r"the open interval \(0, 1\); got 1.5"):
        make_dp_train_step(ghost, xent, torchopt.sgd(0.1), delta=1.5, **kw)
    with pytest.raises(ValueError, match=r"make_dp_train_step\(epsilon_every=\.\.\.\): expected "
                                         r"an int >= 1 .* got 0"):
        make_dp_train_step(ghost, xent, torchopt.sgd(0.1), delta=1e-5, epsilon_every=0, **kw)
