"""Gradient statistics from per-sample gradient norms: noise scale, covariance trace, SNR.

Let ``G_1, ..., G_B`` be the per-sample gradients of a batch, i.i.d. with mean ``G`` (the true
gradient) and covariance ``Sigma``, and ``Gbar = (1/B) sum_i G_i`` the batch gradient. Then

    E |G_i|^2  = |G|^2 + tr(Sigma)
    E |Gbar|^2 = |G|^2 + tr(Sigma) / B

so, with ``m = (1/B) sum_i |G_i|^2`` (from ghost norms) and ``|Gbar|^2`` (one summed
gradient), two unbiased estimators follow by solving the pair of equations:

    S   = B / (B - 1) * (m - |Gbar|^2)          estimates tr(Sigma)
    G2  = (B |Gbar|^2 - m) / (B - 1)            estimates |G|^2   (= |Gbar|^2 - S / B)

These are McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
Training" (arXiv:1812.06162), Appendix A.1, with ``B_small = 1`` (per-sample gradients) and
``B_big = B``: ``|G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)`` and
``tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)``; :func:`two_batch_estimates`
implements the general form. ``S`` is the trace of the sample covariance of the ``G_i``.

The simple noise scale is ``B_simple = tr(Sigma) / |G|^2``, the batch size at which the
gradient noise equals the signal (the critical batch size in McCandlish et al.'s model). A
ratio of unbiased estimates is biased and ``G2`` can even be negative on one batch, so --
as the paper recommends -- average ``S`` and ``G2`` over many batches first (e.g. with
:func:`update_noise_scale`'s EMAs) and take the ratio of the averages. The per-example
gradient signal-to-noise ratio is ``|G|^2 / tr(Sigma) = 1 / B_simple`` (that of a mean over
``B`` examples is ``B`` times it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from torchfn.persample._ghost_norms import GhostModel

__all__ = [
    "GradStats",
    "NoiseScaleState",
    "NormHistory",
    "grad_stats",
    "init_noise_scale",
    "init_norm_history",
    "two_batch_estimates",
    "update_noise_scale",
    "update_norm_history",
]

Tensor = torch.Tensor
LossFn = Callable[[Any, Any], Tensor]


class GradStats(NamedTuple):
    """Gradient statistics of one batch (every field a tensor; see the module doc).

    ``sq_norms`` ``(B,)`` per-sample squared gradient norms; ``mean_sq_norm`` ``m``;
    ``batch_grad_sq_norm`` ``|Gbar|^2``; ``trace_cov`` ``S`` (unbiased ``tr(Sigma)``);
    ``grad_sq_norm`` ``G2`` (unbiased ``|G|^2``); ``b_simple`` ``S / G2`` (one batch: noisy,
    prefer averaged estimates); ``snr`` ``G2 / S`` (per example).
    """

    sq_norms: Tensor
    mean_sq_norm: Tensor
    batch_grad_sq_norm: Tensor
    trace_cov: Tensor
    grad_sq_norm: Tensor
    b_simple: Tensor
    snr: Tensor


def two_batch_estimates(
    small_sq_norm: Tensor, b_small: float, big_sq_norm: Tensor, b_big: float
) -> tuple[Tensor, Tensor]:
    """Return unbiased ``(tr(Sigma), |G|^2)`` from gradient norms at two batch sizes.

    ``small_sq_norm`` is ``|G_small|^2`` (mean-gradient squared norm at batch size
    ``b_small``, averaged over several such batches if available) and ``big_sq_norm`` the
    same at ``b_big > b_small`` (McCandlish et al. 2018, Appendix A.1).

    Example:
        >>> tr, g2 = two_batch_estimates(torch.tensor(11.0), 1, torch.tensor(2.0), 10)
        >>> float(tr), float(g2)
        (10.0, 1.0)
    """
    if not b_big > b_small > 0:
        raise ValueError(f"two_batch_estimates: need b_big > b_small > 0, got b_small={b_small} "
                         f"and b_big={b_big}")
    trace = (small_sq_norm - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
    g2 = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    return trace, g2


def _stats(sq_norms: Tensor, summed: Mapping[str, Tensor], weights: Tensor) -> GradStats:
    b = weights.sum()
    m = (sq_norms * weights).sum() / b
    total = sq_norms.new_zeros(())
    for g in summed.values():
        total = total + g.to(sq_norms.dtype).square().sum()
    gbar_sq = total / (b * b)
    trace = b / (b - 1) * (m - gbar_sq)
    g2 = (b * gbar_sq - m) / (b - 1)
    return GradStats(sq_norms, m, gbar_sq, trace, g2, trace / g2, g2 / trace)


def grad_stats(
    ghost: GhostModel, loss_fn: LossFn
) -> Callable[..., GradStats]:
    """Return ``fn(params, buffers, inputs, targets, valid=None) -> GradStats`` for a batch.

    One forward and one backward: per-sample squared norms from ghost norms and the batch
    gradient ``Gbar`` book-keeping style (``weighted_sum`` with ones), then the unbiased
    estimators of the module doc. ``loss_fn`` returns ``(B,)`` per-sample losses; ``valid``
    (optional ``(B,)`` bool) restricts the statistics to those examples (``B`` is then
    their count; needs at least 2). Compile-friendly (no host syncs).

    Example::

        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from torchfn.persample import make_ghost_model
        >>> ghost, params, buffers = make_ghost_model(nn.Linear(5, 3))
        >>> stats = grad_stats(ghost, lambda o, y: F.cross_entropy(o, y, reduction="none"))
        >>> s = stats(params, buffers, torch.randn(64, 5), torch.randint(0, 3, (64,)))
        >>> s.sq_norms.shape, s.trace_cov.shape
        (torch.Size([64]), torch.Size([]))
    """

    def fn(params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], inputs: Any,
           targets: Any, valid: Tensor | None = None) -> GradStats:
        res = ghost.per_sample(params, buffers, inputs, targets, loss_fn)
        sq = res.grads.sq_norms()
        assert isinstance(sq, Tensor)
        weights = torch.ones_like(sq) if valid is None else valid.to(sq.dtype)
        return _stats(sq * weights, res.grads.weighted_sum(weights), weights)

    return fn


class NoiseScaleState(NamedTuple):
    """EMAs of the unbiased estimates: ``trace_cov``, ``grad_sq_norm``, ``count`` (0-d each).

    ``b_simple`` (property) is the ratio of the bias-corrected averages.
    """

    trace_cov: Tensor
    grad_sq_norm: Tensor
    count: Tensor

    @property
    def b_simple(self) -> Tensor:
        """``tr(Sigma) / |G|^2`` from the averaged estimates."""
        return self.trace_cov / self.grad_sq_norm


def init_noise_scale(device: torch.device | str | None = None,
                     dtype: torch.dtype = torch.float64) -> NoiseScaleState:
    """Return an empty :class:`NoiseScaleState`.

    Example:
        >>> init_noise_scale().count
        tensor(0., dtype=torch.float64)
    """
    z = torch.zeros((), device=device, dtype=dtype)
    return NoiseScaleState(z, z, z)


def update_noise_scale(state: NoiseScaleState, stats: GradStats,
                       decay: float = 0.95) -> NoiseScaleState:
    """Return the state with ``stats`` folded into bias-corrected EMAs (``decay`` in [0, 1)).

    The averages are ``sum_k w_k x_k / sum_k w_k`` with ``w_k = decay^(n - k)``, i.e. Adam-style
    bias-corrected EMAs, so the first update returns the batch's own estimates.

    Example::

        >>> st = init_noise_scale()
        >>> for _ in range(10):
        ...     st = update_noise_scale(st, stats_fn(params, buffers, x, y))   # doctest: +SKIP
        >>> st.b_simple                                                        # doctest: +SKIP
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"update_noise_scale(decay=...): expected in [0, 1), got {decay!r}")
    count = state.count * decay + 1.0
    w = 1.0 / count

    def ema(old: Tensor, new: Tensor) -> Tensor:
        return old + w * (new.to(old.dtype) - old)

    return NoiseScaleState(ema(state.trace_cov, stats.trace_cov),
                           ema(state.grad_sq_norm, stats.grad_sq_norm), count)


class NormHistory(NamedTuple):
    """Per-example gradient-norm history over training, all ``(N,)`` tensors.

    ``count`` (int64: times seen), ``last`` (latest norm), ``ema`` (EMA of norms), ``total``
    and ``total_sq`` (sums of norms and squared norms: mean = total / count, variance =
    total_sq / count - mean^2). Unseen examples hold zeros.
    """

    count: Tensor
    last: Tensor
    ema: Tensor
    total: Tensor
    total_sq: Tensor


def init_norm_history(n: int, device: torch.device | str | None = None,
                      dtype: torch.dtype = torch.float32) -> NormHistory:
    """Return an empty :class:`NormHistory` for a dataset of ``n`` examples.

    Example:
        >>> init_norm_history(3).last
        tensor([0., 0., 0.])
    """
    z = torch.zeros(n, device=device, dtype=dtype)
    return NormHistory(torch.zeros(n, device=device, dtype=torch.int64), z, z, z, z)


def update_norm_history(history: NormHistory, indices: Tensor, norms: Tensor,
                        valid: Tensor | None = None, decay: float = 0.9) -> NormHistory:
    """Return ``history`` with the ``(B,)`` ``norms`` of examples ``indices`` recorded (pure).

    ``valid`` (optional ``(B,)`` bool) skips padding entries; the indices of valid entries must
    be distinct (as in a :class:`PoissonSampler` batch). Written as out-of-place
    ``index_add`` of differences, so duplicate padding indices are harmless and it compiles
    without host syncs.

    Example:
        >>> h = init_norm_history(4)
        >>> h = update_norm_history(h, torch.tensor([2, 0]), torch.tensor([1.5, 3.0]))
        >>> h.last, h.count
        (tensor([3.0000, 0.0000, 1.5000, 0.0000]), tensor([1, 0, 1, 0]))
    """
    norms = norms.detach().to(history.last.dtype)
    keep = (torch.ones_like(norms, dtype=torch.bool) if valid is None
            else valid.to(torch.bool))
    seen = history.count[indices] > 0
    old_last, old_ema = history.last[indices], history.ema[indices]
    new_ema = torch.where(seen, decay * old_ema + (1 - decay) * norms, norms)

    def add(t: Tensor, delta: Tensor) -> Tensor:
        return t.index_add(0, indices, torch.where(keep, delta, torch.zeros_like(delta)))

    return NormHistory(
        count=add(history.count, torch.ones_like(indices)),
        last=add(history.last, norms - old_last),
        ema=add(history.ema, new_ema - old_ema),
        total=add(history.total, norms),
        total_sq=add(history.total_sq, norms * norms),
    )
