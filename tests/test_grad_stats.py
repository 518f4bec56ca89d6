"""Gradient statistics from ghost norms against explicit per-sample gradients.

``grad_stats`` equals the same formulas evaluated on per-sample gradients from a loop of
torch.autograd.grad (the trace estimator equals the trace of the sample covariance matrix);
the estimators are unbiased on synthetic gradients with a known mean and covariance; the
two-batch form reduces to the per-sample form; EMAs and the per-example norm history match
plain Python references.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchfn.persample import (
    grad_stats,
    init_noise_scale,
    init_norm_history,
    make_ghost_model,
    two_batch_estimates,
    update_noise_scale,
    update_norm_history,
)

F64 = torch.float64


def xent(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def flat_per_sample_grads(ghost, params, buffers, x, y) -> Tensor:
    rows = []
    for i in range(x.shape[0]):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = xent(ghost(p, buffers, x[i : i + 1])[0], y[i : i + 1]).sum()
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(p.values()))]))
    return torch.stack(rows)


@pytest.mark.parametrize("masked", [False, True])
def test_grad_stats_equals_explicit_per_sample_gradients(masked) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(),
                        nn.Linear(5, 3)).to(F64)
    ghost, params, buffers = make_ghost_model(net)
    x, y = torch.randn(12, 2, 6, dtype=F64), torch.randint(0, 3, (12,))
    valid = torch.arange(12) % 4 != 1 if masked else None
    s = grad_stats(ghost, xent)(params, buffers, x, y, valid)
    grads = flat_per_sample_grads(ghost, params, buffers, x, y)
    if masked:
        grads = grads[valid]
    b = grads.shape[0]
    gbar = grads.mean(0)
    m = grads.square().sum(1).mean()
    torch.testing.assert_close(s.mean_sq_norm, m)
    torch.testing.assert_close(s.batch_grad_sq_norm, gbar.square().sum())
    cov = torch.cov(grads.T)  # unbiased sample covariance (divides by b - 1)
    torch.testing.assert_close(s.trace_cov, torch.trace(cov))
    torch.testing.assert_close(s.grad_sq_norm, gbar.square().sum() - torch.trace(cov) / b)
    torch.testing.assert_close(s.b_simple, s.trace_cov / s.grad_sq_norm)
    torch.testing.assert_close(s.snr, 1.0 / s.b_simple)
    tr, g2 = two_batch_estimates(m, 1, gbar.square().sum(), b)
    torch.testing.assert_close(tr, s.trace_cov)
    torch.testing.assert_close(g2, s.grad_sq_norm)


def test_estimators_are_unbiased_on_synthetic_gradients() -> None:
    """Per-sample 'gradients' G_i ~ N(G, Sigma): the batch estimates average to the truth."""
    gen = torch.Generator().manual_seed(0)
    d, b, trials = 6, 8, 4000
    mean = torch.linspace(-0.5, 0.5, d, dtype=F64)
    scale = torch.rand(d, d, dtype=F64, generator=gen)
    sigma = scale @ scale.T
    samples = mean + torch.randn(trials, b, d, dtype=F64, generator=gen) @ scale.T
    m = samples.square().sum(-1).mean(1)
    gbar_sq = samples.mean(1).square().sum(-1)
    tr, g2 = two_batch_estimates(m, 1, gbar_sq, b)
    se_tr, se_g2 = tr.std() / trials**0.5, g2.std() / trials**0.5
    assert abs(float(tr.mean() - torch.trace(sigma))) < 4 * float(se_tr)
    assert abs(float(g2.mean() - mean.square().sum())) < 4 * float(se_g2)
    with pytest.raises(ValueError, match="b_big > b_small"):
        two_batch_estimates(m, 4, gbar_sq, 4)


def test_noise_scale_ema_is_bias_corrected() -> None:
    class S:  # just the two fields update_noise_scale reads
        def __init__(self, tr: float, g2: float) -> None:
            self.trace_cov, self.grad_sq_norm = torch.tensor(tr), torch.tensor(g2)

    st = update_noise_scale(init_noise_scale(dtype=torch.float32), S(8.0, 2.0), decay=0.5)
    assert float(st.b_simple) == 4.0  # the first update is the batch's own estimate
    st = update_noise_scale(st, S(2.0, 2.0), decay=0.5)
    # weights 0.5 (old) and 1 (new), normalised: (0.5 * 8 + 2) / 1.5 = 4, (0.5 * 2 + 2) / 1.5
    assert float(st.trace_cov) == pytest.approx(4.0)
    assert float(st.grad_sq_norm) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="decay"):
        update_noise_scale(st, S(1.0, 1.0), decay=1.0)


def test_norm_history_matches_a_python_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    n, decay = 9, 0.8
    hist = init_norm_history(n, dtype=F64)
    ref: dict[int, list[float]] = {i: [] for i in range(n)}
    for _ in range(6):
        idx = torch.randperm(n, generator=gen)[:5]
        valid = torch.rand(5, generator=gen) < 0.7
        idx = torch.where(valid, idx, torch.zeros_like(idx))  # padding points at index 0
        norms = torch.rand(5, dtype=F64, generator=gen)
        hist = update_norm_history(hist, idx, norms, valid, decay=decay)
        for i, v, x in zip(idx.tolist(), valid.tolist(), norms.tolist(), strict=True):
            if v:
                ref[i].append(x)
    for i, seen in ref.items():
        assert int(hist.count[i]) == len(seen)
        if not seen:
            assert float(hist.last[i]) == 0.0 and float(hist.ema[i]) == 0.0
            continue
        ema = seen[0]
        for x in seen[1:]:
            ema = decay * ema + (1 - decay) * x
        assert float(hist.last[i]) == pytest.approx(seen[-1])
        assert float(hist.ema[i]) == pytest.approx(ema)
        assert float(hist.total[i]) == pytest.approx(sum(seen))
        assert float(hist.total_sq[i]) == pytest.approx(sum(x * x for x in seen))
