"""Ensemble predictions and metrics from member logits ``(N, B, C)``: pure tensor functions."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "ensemble_metrics",
    "ensemble_probs",
    "expected_calibration_error",
    "member_disagreement",
    "negative_log_likelihood",
    "predictive_variance",
]


def _check_logits(where: str, logits: Tensor) -> None:
    if not isinstance(logits, Tensor) or logits.ndim != 3:
        seen = f"shape {tuple(logits.shape)}" if isinstance(logits, Tensor) else type(logits)
        raise ValueError(f"{where}: expected member logits of shape (N, B, C), got {seen}")


def _check_probs(where: str, probs: Tensor, targets: Tensor) -> None:
    if probs.ndim != 2 or targets.shape != probs.shape[:1]:
        raise ValueError(f"{where}: expected probs (B, C) and targets (B,), got "
                         f"{tuple(probs.shape)} and {tuple(targets.shape)}")


def ensemble_probs(logits: Tensor) -> Tensor:
    """Return the ensemble's predictive distribution ``(B, C)``: the mean of member softmaxes.

    Example:
        >>> import torch
        >>> from torchfn.ensembles import ensemble_probs
        >>> ensemble_probs(torch.zeros(4, 2, 3)).sum(-1)
        tensor([1., 1.])
    """
    _check_logits("ensemble_probs(logits)", logits)
    return logits.softmax(-1).mean(0)


def predictive_variance(logits: Tensor) -> Tensor:
    """Return the variance over members of the class probabilities, ``(B, C)`` (biased, /N).

    Example:
        >>> import torch
        >>> from torchfn.ensembles import predictive_variance
        >>> predictive_variance(torch.zeros(4, 2, 3)).abs().max()
        tensor(0.)
    """
    _check_logits("predictive_variance(logits)", logits)
    return logits.softmax(-1).var(0, unbiased=False)


def member_disagreement(logits: Tensor) -> Tensor:
    """Return the mean pairwise top-1 disagreement, 0-d: the fraction of (sample, member pair)
    where two different members predict different classes (0 for N = 1).

    Example:
        >>> import torch
        >>> from torchfn.ensembles import member_disagreement
        >>> logits = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # 2 members, 1 sample
        >>> member_disagreement(logits)
        tensor(1.)
    """
    _check_logits("member_disagreement(logits)", logits)
    n = logits.shape[0]
    pred = logits.argmax(-1)  # (N, B)
    if n < 2:
        return torch.zeros((), dtype=logits.dtype, device=logits.device)
    differ = (pred[:, None, :] != pred[None, :, :]).to(logits.dtype).mean(-1)  # (N, N)
    return differ.sum() / (n * (n - 1))


def negative_log_likelihood(probs: Tensor, targets: Tensor, *, eps: float = 1e-12) -> Tensor:
    """Return the mean NLL ``-log probs[b, targets[b]]``, 0-d (probabilities clamped at eps).

    Example:
        >>> import torch
        >>> from torchfn.ensembles import negative_log_likelihood
        >>> negative_log_likelihood(torch.tensor([[0.5, 0.5]]), torch.tensor([0]))
        tensor(0.6931)
    """
    _check_probs("negative_log_likelihood(probs, targets)", probs, targets)
    p = probs.gather(1, targets[:, None].long()).squeeze(1)
    return -p.clamp_min(eps).log().mean()


def expected_calibration_error(probs: Tensor, targets: Tensor, *, n_bins: int = 15) -> Tensor:
    """Return the expected calibration error, 0-d: sum over equal-width confidence bins of
    ``|bin| / B * |accuracy(bin) - mean confidence(bin)|`` (top-1 confidence, bins
    ``(k/n_bins, (k+1)/n_bins]``).

    Example:
        >>> import torch
        >>> from torchfn.ensembles import expected_calibration_error
        >>> probs = torch.tensor([[0.9, 0.1], [0.9, 0.1]])
        >>> expected_calibration_error(probs, torch.tensor([0, 1]))
        tensor(0.4000)
    """
    _check_probs("expected_calibration_error(probs, targets)", probs, targets)
    if n_bins < 1:
        raise ValueError(f"expected_calibration_error(n_bins=...): expected >= 1, got {n_bins}")
    conf, pred = probs.max(-1)
    correct = (pred == targets).to(probs.dtype)
    bins = (conf * n_bins).ceil().long().clamp(1, n_bins) - 1  # (k/n, (k+1)/n] -> k
    count = torch.zeros(n_bins, dtype=probs.dtype, device=probs.device).index_add_(
        0, bins, torch.ones_like(conf))
    acc = torch.zeros_like(count).index_add_(0, bins, correct)
    cf = torch.zeros_like(count).index_add_(0, bins, conf)
    return (acc - cf).abs().sum() / probs.shape[0]


def ensemble_metrics(logits: Tensor, targets: Tensor, *, n_bins: int = 15) -> dict[str, Tensor]:
    """Return a dict of 0-d metrics of member logits ``(N, B, C)`` against targets ``(B,)``.

    Keys: ``accuracy``, ``nll``, ``ece`` (of the ensemble's mean probabilities),
    ``member_accuracy``, ``member_nll``, ``member_ece`` (averaged over members),
    ``disagreement`` (:func:`member_disagreement`) and ``variance`` (mean
    :func:`predictive_variance`).

    Example:
        >>> import torch
        >>> from torchfn.ensembles import ensemble_metrics
        >>> m = ensemble_metrics(torch.randn(3, 10, 4), torch.randint(4, (10,)))
        >>> sorted(m)[:3]
        ['accuracy', 'disagreement', 'ece']
    """
    _check_logits("ensemble_metrics(logits, targets)", logits)
    probs = ensemble_probs(logits)
    member = logits.softmax(-1)
    acc = lambda p: (p.argmax(-1) == targets).to(p.dtype).mean()  # noqa: E731
    return {
        "accuracy": acc(probs),
        "nll": negative_log_likelihood(probs, targets),
        "ece": expected_calibration_error(probs, targets, n_bins=n_bins),
        "member_accuracy": torch.stack([acc(p) for p in member]).mean(),
        "member_nll": torch.stack([negative_log_likelihood(p, targets) for p in member]).mean(),
        "member_ece": torch.stack([expected_calibration_error(p, targets, n_bins=n_bins)
                                   for p in member]).mean(),
        "disagreement": member_disagreement(logits),
        "variance": predictive_variance(logits).mean(),
    }
