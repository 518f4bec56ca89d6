"""Clipping rules of the DP-SGD step: fixed, automatic (normalised) and adaptive (quantile).

Per-sample coefficients ``coef_i`` (the clipped sum is ``sum_i coef_i g_i``):

- **fixed** (Abadi et al. 2016): ``min(1, C / (||g_i|| + 1e-6))``; ``||coef_i g_i|| <= C``.
- **automatic** (Bu, Wang, Zha, Karypis 2022, "Automatic clipping: differentially private deep
  learning made easier and stronger"): ``C / (||g_i|| + gamma)``; every example is
  normalised, ``||coef_i g_i|| = C ||g_i|| / (||g_i|| + gamma) < C``, so the sensitivity is
  still ``C`` and the noise ``sigma C`` is unchanged. ``C`` then only scales the update (it
  folds into the learning rate), which removes the clipping threshold from the tuning.
  ``gamma > 0`` keeps small gradients from being blown up to norm ``C`` (and a zero
  gradient from dividing by zero).
- **adaptive** (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially private learning
  with adaptive clipping"): the fixed rule with a threshold ``C_t`` carried in the state and
  moved each step towards the ``target_quantile`` of the per-sample norms::

      b_t     = (sum_{i in B_t} (1[||g_i|| <= C_t] - 1/2) + N(0, sigma_b^2)) / (q N) + 1/2
      C_{t+1} = C_t * exp(-eta_C * (b_t - target_quantile))

  The count is centred (``1[.] - 1/2``, as in the paper's proof): under add/remove-one
  adjacency with Poisson sampling the batch size is private, and the centred sum changes by
  at most ``1/2``, so releasing it with noise ``sigma_b`` and the clipped gradient sum with
  noise ``sigma_grad C_t`` is one Gaussian mechanism of noise multiplier ``sigma`` when
  ``sigma_grad^-2 + (2 sigma_b)^-2 = sigma^-2`` (the paper's Theorem 1). The accountant sees
  ``sigma``; the gradient noise is raised to ``sigma_grad`` to pay for the count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["AdaptiveClipping", "adaptive_grad_noise_multiplier"]

Tensor = torch.Tensor

#: Default stability constant ``gamma`` of automatic clipping (Bu et al. use 0.01).
AUTOMATIC_GAMMA = 0.01


@dataclass(frozen=True)
class AdaptiveClipping:
    """Settings of adaptive quantile clipping (Andrew et al. 2021) for :func:`make_dp_train_step`.

    ``target_quantile`` (in ``(0, 1)``): the fraction of examples whose gradient norm should
    stay unclipped (0.5: ``C_t`` tracks the median norm, the paper's default; under heavy noise
    a lower target, which clips more, can do better: ``docs/dp_clipping.md``). ``learning_rate`` (``eta_C > 0``): the
    step of the geometric update ``C_{t+1} = C_t exp(-eta_C (b_t - target_quantile))``.
    ``count_noise_multiplier`` (``sigma_b``, the std of the noise on the count of unclipped
    examples, in examples): ``None`` takes ``max(qN / 20, 3.5 noise_multiplier)`` -- the
    paper's suggestion (expected batch size / 20, noise std 0.05 on the fraction), raised where
    it would cost the gradient more than 1% of extra noise. It must exceed ``noise_multiplier / 2`` (the centred
    count has sensitivity 1/2, so alone it would cost noise multiplier ``2 sigma_b``, which
    must leave budget for the gradient); the gradient noise multiplier is then
    :func:`adaptive_grad_noise_multiplier`.

    ``normalize_update``: divide the noisy clipped mean by ``C_t`` before the optimizer sees
    it, ``(sum_i coef_i g_i + N(0, (sigma_grad C_t)^2 I)) / (q N C_t)``. Every clipped example
    then contributes at most norm 1 and the noise has std ``sigma_grad / (q N)`` whatever
    ``C_t`` is, so the step size is set by the optimizer's learning rate alone (as in
    automatic clipping) and a rising ``C_t`` cannot enlarge the update and its noise. Without
    it (``False``) the update scales with ``C_t`` at a fixed learning rate, which can feed back
    on itself under heavy noise (noisier steps, larger norms, larger ``C_t``). Dividing the
    released sum by ``C_t`` is post-processing (``C_t`` is a function of the counts already
    released): the privacy cost is unchanged. The learning rate then sets the step of a
    unit-norm mean, as with a fixed threshold ``C = 1``, and takes over the step-size half of
    tuning ``C`` (under heavy noise a smaller learning rate wins, as a smaller fixed ``C``
    does). ``docs/dp_clipping.md`` has the comparison behind the default ``True``.

    **Quantile schedule.** ``target_quantile`` may also move over training:

    - a pair ``(start, end)`` with ``quantile_steps = T``: the target at logical step ``t``
      (``state.step``) is ``start + (end - start) * min(t / T, 1)``, a linear ramp held at
      ``end`` from step ``T`` on;
    - a callable ``schedule(step) -> target``: ``step`` is the int64 0-d ``state.step``, the
      result a 0-d tensor (or a float) in ``(0, 1)``. Inside a compiled step it is traced, so
      write it with tensor ops (``torch.clamp``, ``torch.where``), not Python branches on
      ``step``'s value. It is checked at step 0 only; later values are clamped to
      ``[1e-3, 1 - 1e-3]``.

    The schedule changes only which quantile the threshold chases; the noisy count and its
    privacy cost are the same at every step.

    Example:
        >>> AdaptiveClipping(target_quantile=0.7).learning_rate
        0.2
        >>> ramp = AdaptiveClipping(target_quantile=(0.1, 0.5), quantile_steps=100)
        >>> [round(float(ramp.target_at(torch.tensor(t))), 3) for t in (0, 50, 100, 200)]
        [0.1, 0.3, 0.5, 0.5]
    """

    target_quantile: float | tuple[float, float] | Callable[[Tensor], Tensor | float] = 0.5
    learning_rate: float = 0.2
    count_noise_multiplier: float | None = None
    normalize_update: bool = True
    quantile_steps: int | None = None

    def __post_init__(self) -> None:
        where = "AdaptiveClipping"
        tq, steps = self.target_quantile, self.quantile_steps
        if isinstance(tq, tuple):
            if len(tq) != 2 or not all(_is_fraction(v) for v in tq):
                raise ValueError(f"{where}(target_quantile=(start, end)): expected two fractions "
                                 f"in (0, 1), got {tq!r}")
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise ValueError(f"{where}(target_quantile={tq!r}, quantile_steps=...): a "
                                 f"(start, end) ramp needs quantile_steps, an int >= 1 (the "
                                 f"logical steps from start to end), got {steps!r}")
        elif callable(tq):
            if steps is not None:
                raise ValueError(f"{where}(quantile_steps={steps!r}): only for a (start, end) "
                                 "target_quantile; a schedule callable sets its own steps")
            first = float(tq(torch.zeros((), dtype=torch.int64)))
            if not 0.0 < first < 1.0:
                raise ValueError(f"{where}(target_quantile=<schedule>): expected the schedule to "
                                 f"return a fraction in (0, 1), got {first!r} at step 0")
        else:
            if not _is_fraction(tq):
                raise ValueError(f"{where}(target_quantile=...): expected a fraction in (0, 1), "
                                 f"got {tq!r} (0 or 1 would shrink or grow the threshold "
                                 "forever), or a (start, end) pair of them with quantile_steps, "
                                 "or a schedule callable")
            if steps is not None:
                raise ValueError(f"{where}(quantile_steps={steps!r}): only for a (start, end) "
                                 f"target_quantile, got target_quantile={tq!r}")
        lr = self.learning_rate
        if (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr)
                or lr <= 0):
            raise ValueError(f"{where}(learning_rate=...): expected a finite number > 0, got "
                             f"{lr!r}")
        sb = self.count_noise_multiplier
        if sb is not None and (isinstance(sb, bool) or not isinstance(sb, (int, float))
                               or not math.isfinite(sb) or sb < 0):
            raise ValueError(f"{where}(count_noise_multiplier=...): expected None or a finite "
                             f"number >= 0, got {sb!r}")
        if not isinstance(self.normalize_update, bool):
            raise TypeError(f"{where}(normalize_update=...): expected True or False, got "
                            f"{self.normalize_update!r}")


    def target_at(self, step: Tensor) -> Tensor:
        """Return the target quantile (float64 0-d) at logical step ``step`` (int64 0-d).

        No Python branch on ``step``'s value, so a compiled step traces it once."""
        tq = self.target_quantile
        if isinstance(tq, tuple):
            assert self.quantile_steps is not None
            frac = torch.clamp(step.to(torch.float64) / float(self.quantile_steps), max=1.0)
            return tq[0] + (tq[1] - tq[0]) * frac
        if callable(tq):
            out = torch.as_tensor(tq(step), dtype=torch.float64, device=step.device)
            return torch.clamp(out, 1e-3, 1.0 - 1e-3)
        return torch.full((), float(tq), dtype=torch.float64, device=step.device)


def _is_fraction(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and 0.0 < value < 1.0)


def adaptive_grad_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """Return ``sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)``, the gradient noise multiplier.

    With this gradient noise and ``count_noise_multiplier = sigma_b`` on the centred count of
    unclipped examples, adaptive clipping costs exactly as much privacy as plain DP-SGD with
    ``noise_multiplier = sigma`` (Andrew et al. 2021, Theorem 1). Needs
    ``2 sigma_b > sigma``, i.e. ``sigma_b > sigma / 2``; ``sigma = 0`` (no privacy) gives 0.

    Example:
        >>> round(adaptive_grad_noise_multiplier(1.0, 6.4), 6)
        1.003066
    """
    sigma, sb = float(noise_multiplier), float(count_noise_multiplier)
    if sigma == 0.0:
        return 0.0
    if not sb > sigma / 2.0:
        raise ValueError(
            f"adaptive clipping: count_noise_multiplier must be > noise_multiplier / 2 = "
            f"{sigma / 2.0:.4g} (the noisy count alone would spend the whole privacy budget of "
            f"noise_multiplier={sigma:g}), got {sb:g}; raise count_noise_multiplier (the paper "
            "suggests expected batch size / 20) or lower noise_multiplier")
    return (sigma**-2 - (2.0 * sb) ** -2) ** -0.5


def clip_coefficients(norm: Tensor, c: float | Tensor, gamma: float | None) -> Tensor:
    """Return the ``(B,)`` per-sample coefficients: fixed (``gamma`` None) or automatic."""
    if gamma is None:
        return torch.clamp(c / (norm + 1e-6), max=1.0)
    return c / (norm + gamma)


def next_clip_norm(clip_norm: Tensor, unclipped: Tensor, count: Tensor, z: Tensor, *,
                   settings: AdaptiveClipping, count_noise: float,
                   expected_batch_size: float, step: Tensor) -> tuple[Tensor, Tensor]:
    """Return ``(C_{t+1}, b_t)`` (0-d, ``clip_norm``'s dtype) from the counts and a normal ``z``;
    ``step`` (int64 0-d, the logical step ``t``) picks a scheduled target quantile."""
    dtype = clip_norm.dtype
    centred = unclipped.to(dtype) - 0.5 * count.to(dtype)
    frac = (centred + count_noise * z.to(dtype)) / expected_batch_size + 0.5
    target = settings.target_at(step).to(dtype)
    new = clip_norm * torch.exp(-settings.learning_rate * (frac - target))
    return new, frac
