"""Privacy accounting for DP-SGD: Rényi DP of the Poisson-subsampled Gaussian mechanism.

One step of DP-SGD samples each example independently with probability ``q`` (the sample
rate), clips per-example gradients to norm ``C`` and adds ``N(0, (sigma * C)^2)`` noise to
their sum; ``sigma`` is the noise multiplier. Its Rényi DP of order ``alpha`` is
``log(A_alpha) / (alpha - 1)`` with (Mironov, Talwar, Zhang 2019, "Rényi Differential Privacy
of the Sampled Gaussian Mechanism", arXiv:1908.10530)

    A_alpha = E_{z ~ N(0, sigma^2)} [ ((1 - q) + q * exp((2z - 1) / (2 sigma^2)))^alpha ].

Integer orders (Section 3.2) expand the power with the binomial theorem, a finite sum. Here it is
written as ``A_alpha = 1 + sum_{k>=2} C(alpha, k) (1-q)^(alpha-k) q^k expm1((k^2 - k) /
(2 sigma^2))``, whose terms are all positive, so ``log A_alpha`` is summed in log space with no
cancellation even when ``A_alpha`` is within 1e-15 of 1. Fractional orders (Section 3.3) split the
integral at ``z0 = sigma^2 log(1/q - 1) + 1/2``, where the two summands of the base are equal, and
expand each side in a convergent binomial series whose terms carry Gaussian tail masses
(``erfc``); beyond ``k = floor(alpha) + 1`` the terms alternate in sign and decrease in magnitude,
so the series is summed until the next term is below ``exp(-36)`` of the running sum.

Composition: RDP adds over steps (and over heterogeneous steps, order by order).

Conversion to (epsilon, delta)-DP, minimised over the orders:
- ``"improved"`` (default): Balle, Barthe, Gaboardi, Hsu, Sato 2020, "Hypothesis Testing
  Interpretations and Rényi Differential Privacy" (arXiv:1905.09982), Theorem 21:
  ``eps = rdp + log((alpha - 1) / alpha) - (log(delta) + log(alpha)) / (alpha - 1)``.
  This is what Opacus (>= 1.0) and TF Privacy / Google's ``dp_accounting`` report.
- ``"classic"``: Mironov 2017, "Rényi Differential Privacy", Proposition 3:
  ``eps = rdp - log(delta) / (alpha - 1)``; always larger than the improved bound. TF Privacy's
  own ``rdp_accountant`` (before it moved to ``dp_accounting``) reported this one, e.g. the
  epsilons printed in its tutorials.
Both are clamped at 0 (a negative bound still certifies (0, delta)-DP).

Everything here is host-side float64 (``math`` and ``numpy``): call it between steps, never
inside a compiled step.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

__all__ = [
    "DEFAULT_RDP_ORDERS",
    "RDPAccountant",
    "compute_rdp",
    "noise_multiplier_for_epsilon",
    "rdp_to_epsilon",
]

Conversion = Literal["improved", "classic"]

#: Default Rényi orders: 1.1 to 2.95 in steps of 0.05, 3.0 to 10.9 in steps of 0.1, the integers
#: 11 to 63, then 128, 256, 512 (174 orders). It contains both Opacus's default grid
#: (1.1 .. 10.9 step 0.1, 12 .. 63) and TF Privacy's ``compute_dp_sgd_privacy`` grid
#: (1.25 .. 4.5, 5 .. 63, 128, 256, 512), so its epsilon is never larger than either's.
DEFAULT_RDP_ORDERS: tuple[float, ...] = (
    tuple(1 + x / 20 for x in range(2, 40))
    + tuple(x / 10 for x in range(30, 110))
    + tuple(float(a) for a in range(11, 64))
    + (128.0, 256.0, 512.0)
)

_CONVERSIONS = ("improved", "classic")
_SERIES_LOG_TOL = 36.0  # stop a fractional-order series when the next term < exp(-36) * sum
_SERIES_MAX_TERMS = 1 << 22
_STATE_FORMAT = "torchfn.rdp_accountant"
_STATE_VERSION = 1


# --------------------------------------------------------------------------- validation


def _check_sample_rate(q: Any, where: str, name: str = "q") -> float:
    try:
        value = float(q)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {name} must be a number in [0, 1]; got {q!r}") from None
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"{where}: {name} must be in [0, 1] (a sampling probability); got {q!r}")
    return value


def _check_noise(sigma: Any, where: str) -> float:
    try:
        value = float(sigma)
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: noise_multiplier must be a finite number >= 0; got {sigma!r}"
        ) from None
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{where}: noise_multiplier must be a finite number >= 0; got {sigma!r}")
    return value


def _check_steps(steps: Any, where: str) -> int:
    if isinstance(steps, bool):
        raise TypeError(f"{where}: steps must be an int >= 0; got the bool {steps!r}")
    try:
        value = operator.index(steps)
    except TypeError:
        raise TypeError(
            f"{where}: steps must be an int >= 0; got {steps!r} of type {type(steps).__name__}"
        ) from None
    if value < 0:
        raise ValueError(f"{where}: steps must be >= 0; got steps={value}")
    return value


def _check_delta(delta: Any, where: str) -> float:
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: delta must be a number in (0, 1); got {delta!r}") from None
    if not 0.0 < value < 1.0:
        raise ValueError(f"{where}: delta must be in the open interval (0, 1); got {delta!r}")
    return value


def _check_orders(orders: float | Iterable[float], where: str) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(
            f"{where}: orders must be a non-empty 1-D sequence of floats > 1; got shape "
            f"{tuple(arr.shape)}"
        )
    bad = ~(np.isfinite(arr) & (arr > 1.0))
    if bad.any():
        raise ValueError(
            f"{where}: every Rényi order must be a finite float > 1; got {arr[bad][:5].tolist()} "
            f"(at positions {np.flatnonzero(bad)[:5].tolist()})"
        )
    return arr


def _check_conversion(conversion: Any, where: str) -> Conversion:
    if conversion not in _CONVERSIONS:
        raise ValueError(
            f"{where}: conversion must be one of {_CONVERSIONS}; got {conversion!r}"
        )
    return conversion


# --------------------------------------------------------------------------- log-space helpers


def _logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """Return ``log(sum(exp(x), axis=1))`` for a 2-D array; rows of all ``-inf`` give ``-inf``."""
    m = np.max(x, axis=1)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return m_safe + np.log(np.sum(np.exp(x - m_safe[:, None]), axis=1))


def _log_half_erfc(x: np.ndarray) -> np.ndarray:
    """Return ``log(erfc(x) / 2)`` elementwise (the log Gaussian tail mass beyond ``sqrt(2) x``).

    ``math.erfc`` below 20 (``erfc(20) ~ 5e-176`` is still a normal float); above, the
    asymptotic series of ``erfc(x) exp(x^2) sqrt(pi) x`` to 5 terms (relative error < 3e-12).
    """
    out = np.empty_like(x)
    small = x < 20.0
    if small.any():
        vals = np.fromiter(map(math.erfc, x[small].tolist()), dtype=np.float64)
        out[small] = np.log(vals) - math.log(2.0)
    if not small.all():
        xl = x[~small]
        u = 0.5 / (xl * xl)
        series = -u + u * u * (3.0 - u * (15.0 - 105.0 * u))
        out[~small] = (
            -xl * xl - np.log(xl) - 0.5 * math.log(math.pi) + np.log1p(series) - math.log(2.0)
        )
    return out


# --------------------------------------------------------------------------- log A_alpha


def _log_a_integer(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """Return ``log A_alpha`` for integer orders ``alphas >= 2`` (floats), 0 < q < 1, sigma > 0.

    ``A_alpha - 1 = sum_{k=2}^{alpha} C(alpha, k) (1-q)^(alpha-k) q^k expm1((k^2 - k) / (2
    sigma^2))``: positive terms, one row per order, padded with ``-inf`` beyond ``k = alpha``.
    """
    a = alphas[:, None]
    i = np.arange(int(alphas.max()), dtype=np.float64)[None, :]  # i = 0 .. max_alpha - 1
    valid = i < a
    ratio = np.where(valid, a - i, 1.0) / (i + 1.0)  # C(alpha, i+1) / C(alpha, i)
    log_binom = np.where(valid, np.cumsum(np.log(ratio), axis=1), -np.inf)  # k = i + 1
    k = i[:, 1:] + 1.0  # k = 2 .. max_alpha
    x = (k * k - k) / (2.0 * sigma * sigma)  # > 0
    with np.errstate(divide="ignore", over="ignore"):  # x -> 0 for sigma > ~1e154: term is 0
        log_expm1 = np.where(x < 30.0, np.log(np.expm1(np.minimum(x, 30.0))),
                             x + np.log1p(-np.exp(-x)))
    terms = log_binom[:, 1:] + (a - k) * math.log1p(-q) + k * math.log(q) + log_expm1
    terms = np.where(valid[:, 1:], terms, -np.inf)
    return np.logaddexp(0.0, _logsumexp_rows(terms))  # log(1 + sum)


def _log_a_fractional(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """Return ``log A_alpha`` for non-integer orders ``alphas > 1``, 0 < q < 1, sigma > 0.

    All orders are summed together in chunks of ``k``; an order leaves once its series has
    converged.
    """
    log_q, log_1mq = math.log(q), math.log1p(-q)
    z0 = sigma * sigma * (log_1mq - log_q) + 0.5
    inv_2s2 = 1.0 / (2.0 * sigma * sigma)
    inv_sqrt2_sigma = 1.0 / (math.sqrt(2.0) * sigma)
    n = alphas.size
    result = np.empty(n)
    active = np.arange(n)
    log_binom = np.zeros(n)  # log |C(alpha, k0)|
    log_pos = np.full(n, -np.inf)
    log_neg = np.full(n, -np.inf)
    k0, chunk = 0, 64
    while active.size:
        a = alphas[active][:, None]
        floor_a = np.floor(a)
        k = np.arange(k0, k0 + chunk, dtype=np.float64)[None, :]
        j = a - k
        step = np.cumsum(np.log(np.abs(j)) - np.log1p(k), axis=1)  # log|C(a, k+1) / C(a, k)|
        lb = log_binom[active][:, None] + np.concatenate(
            (np.zeros((active.size, 1)), step[:, :-1]), axis=1
        )
        # z < z0: expand in powers of q e^{(2z-1)/(2 sigma^2)}; z > z0: in powers of (1 - q).
        t_low = (
            lb + j * log_1mq + k * log_q + (k * k - k) * inv_2s2
            + _log_half_erfc((k - z0) * inv_sqrt2_sigma)  # the same for every order
        )
        t_high = (
            lb + j * log_q + k * log_1mq + (j * j - j) * inv_2s2
            + _log_half_erfc(((z0 - j) * inv_sqrt2_sigma).ravel()).reshape(j.shape)
        )
        terms = np.logaddexp(t_low, t_high)
        negative = (k >= floor_a + 2) & ((k - floor_a) % 2 == 0)  # sign of C(alpha, k)
        log_pos[active] = np.logaddexp(
            log_pos[active], _logsumexp_rows(np.where(negative, -np.inf, terms))
        )
        log_neg[active] = np.logaddexp(
            log_neg[active], _logsumexp_rows(np.where(negative, terms, -np.inf))
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            total = log_pos[active] + np.log1p(-np.exp(log_neg[active] - log_pos[active]))
        # Past k = floor(alpha) + 1 the terms alternate and shrink, so the next term bounds the
        # truncation error.
        done = (k0 + chunk - 1 > floor_a[:, 0] + 1) & (terms[:, -1] < total - _SERIES_LOG_TOL)
        result[active[done]] = total[done]
        log_binom[active] += step[:, -1]
        active = active[~done]
        k0 += chunk
        if k0 >= _SERIES_MAX_TERMS and active.size:
            raise RuntimeError(
                f"compute_rdp: the fractional-order series for orders "
                f"{alphas[active][:5].tolist()}, q={q}, noise_multiplier={sigma} did not "
                f"converge in {k0} terms; use integer orders"
            )
        chunk = min(2 * chunk, max(64, (1 << 20) // max(active.size, 1)))
    return result


def _rdp_one_step(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """Return the RDP of one step of the sampled Gaussian mechanism at each order."""
    if q == 0.0:
        return np.zeros_like(orders)
    if sigma == 0.0:
        return np.full_like(orders, math.inf)
    if q == 1.0:
        return orders / (2.0 * sigma * sigma)
    log_a = np.empty_like(orders)
    integer = orders == np.round(orders)
    if integer.any():
        log_a[integer] = _log_a_integer(q, sigma, orders[integer])
    if not integer.all():
        log_a[~integer] = _log_a_fractional(q, sigma, orders[~integer])
    return np.maximum(log_a, 0.0) / (orders - 1.0)  # A_alpha >= 1 exactly; clamp round-off


# --------------------------------------------------------------------------- public functions


def compute_rdp(
    q: float,
    noise_multiplier: float,
    steps: int,
    orders: float | Sequence[float] = DEFAULT_RDP_ORDERS,
) -> np.ndarray:
    """Return the RDP of ``steps`` Poisson-sampled Gaussian steps per order, shape ``(n_orders,)``.

    Args:
        q: sampling probability of each example per step, in ``[0, 1]``.
        noise_multiplier: noise standard deviation divided by the clipping norm, ``>= 0``.
        steps: number of steps (RDP composes additively), an int ``>= 0``.
        orders: Rényi orders ``alpha > 1`` (finite); a float or a sequence.

    Returns:
        float64 array with the RDP ``eps(alpha)`` at each order (``inf`` where unbounded):
        0 for ``q == 0`` or ``steps == 0``; ``steps * alpha / (2 sigma^2)`` for ``q == 1``;
        ``inf`` for ``noise_multiplier == 0`` and ``q > 0``.

    Example:
        >>> rdp = compute_rdp(q=1.0, noise_multiplier=2.0, steps=3, orders=[2, 4.5])
        >>> [round(float(r), 6) for r in rdp]
        [0.75, 1.6875]
    """
    where = "compute_rdp"
    q = _check_sample_rate(q, where)
    sigma = _check_noise(noise_multiplier, where)
    steps = _check_steps(steps, where)
    orders_arr = _check_orders(orders, where)
    if steps == 0:
        return np.zeros_like(orders_arr)
    return _rdp_one_step(q, sigma, orders_arr) * steps


def rdp_to_epsilon(
    orders: float | Sequence[float],
    rdp: float | Sequence[float],
    delta: float,
    *,
    conversion: Conversion = "improved",
) -> tuple[float, float]:
    """Return ``(epsilon, best_order)``: the smallest (epsilon, delta)-DP bound over the orders.

    Args:
        orders: Rényi orders ``alpha > 1``, shape ``(n_orders,)``.
        rdp: RDP at each order (``>= 0``, ``inf`` allowed), same shape.
        delta: target delta in ``(0, 1)``.
        conversion: ``"improved"`` (default; Balle et al. 2020, Theorem 21, as in Opacus >= 1.0
            and TF Privacy) or ``"classic"`` (Mironov 2017, ``rdp - log(delta) / (alpha - 1)``).

    Returns:
        ``epsilon`` as a Python float (clamped at 0; ``inf`` if every order is unbounded) and
        the order that attains it (``nan`` when epsilon is ``inf``).

    Example:
        >>> orders = [2.0, 8.0, 32.0]
        >>> eps, order = rdp_to_epsilon(orders, compute_rdp(0.01, 1.0, 1000, orders), 1e-5)
        >>> round(eps, 3), order
        (2.108, 8.0)
    """
    where = "rdp_to_epsilon"
    orders_arr = _check_orders(orders, where)
    rdp_arr = np.atleast_1d(np.asarray(rdp, dtype=np.float64))
    if rdp_arr.shape != orders_arr.shape:
        raise ValueError(
            f"{where}: rdp must have one value per order; got rdp of shape "
            f"{tuple(rdp_arr.shape)} for orders of shape {tuple(orders_arr.shape)}"
        )
    if np.isnan(rdp_arr).any() or (rdp_arr < 0).any():
        raise ValueError(f"{where}: rdp values must be >= 0 (inf allowed); got {rdp_arr.tolist()}")
    delta = _check_delta(delta, where)
    conversion = _check_conversion(conversion, where)
    log_delta = math.log(delta)
    if conversion == "classic":
        eps = rdp_arr - log_delta / (orders_arr - 1.0)
    else:
        eps = (
            rdp_arr
            + np.log1p(-1.0 / orders_arr)
            - (log_delta + np.log(orders_arr)) / (orders_arr - 1.0)
        )
    idx = int(np.argmin(eps))
    if not math.isfinite(eps[idx]):
        return math.inf, math.nan
    return max(float(eps[idx]), 0.0), float(orders_arr[idx])


def noise_multiplier_for_epsilon(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    *,
    orders: Sequence[float] = DEFAULT_RDP_ORDERS,
    conversion: Conversion = "improved",
    rtol: float | None = None,
    accountant: Literal["rdp", "pld", "prv"] = "rdp",
) -> float:
    """Return the smallest noise multiplier whose DP-SGD run stays within ``target_epsilon``.

    Bisection on sigma (epsilon is non-increasing in sigma): the returned sigma satisfies
    ``epsilon(sigma) <= target_epsilon`` under the chosen accountant and is within a relative
    ``rtol`` of the exact threshold.

    Args:
        target_epsilon: epsilon budget, ``> 0``.
        delta: target delta in ``(0, 1)``.
        sample_rate: Poisson sampling probability per step, in ``[0, 1]``.
        steps: number of steps, an int ``>= 0``.
        orders: Rényi orders to optimise over (default :data:`DEFAULT_RDP_ORDERS`).
        conversion: ``"improved"`` (default) or ``"classic"``; see :func:`rdp_to_epsilon`.
        rtol: relative precision of the returned sigma, in ``(0, 0.1]``; default ``1e-6`` for
            ``"rdp"`` and ``1e-4`` for ``"pld"`` and ``"prv"`` (each PLD evaluation takes about
            a second, each PRV evaluation a fraction of one).
        accountant: ``"rdp"`` (default, :class:`RDPAccountant`'s bound), ``"pld"``
            (:class:`PLDAccountant`'s tighter bound, a smaller sigma; needs the optional
            ``dp_accounting`` package) or ``"prv"`` (:class:`PRVAccountant`'s upper bound
            ``eps_upper`` at its default ``eps_error=0.01``, as tight as PLD's, no optional
            dependency). ``orders`` and ``conversion`` apply to ``"rdp"`` only.

    Raises:
        ValueError: when no amount of noise reaches ``target_epsilon`` (with these orders the
            bound does not go below ``epsilon(sigma -> inf)``).

    Example:
        >>> sigma = noise_multiplier_for_epsilon(8.0, 1e-5, sample_rate=0.04, steps=2250)
        >>> round(sigma, 3)
        1.416
        >>> sigma_pld = noise_multiplier_for_epsilon(
        ...     8.0, 1e-5, sample_rate=0.04, steps=2250, accountant="pld", rtol=1e-3)
        >>> sigma_pld < sigma
        True
    """
    where = "noise_multiplier_for_epsilon"
    if accountant not in ("rdp", "pld", "prv"):
        raise ValueError(
            f'{where}: accountant must be "rdp", "pld" or "prv"; got {accountant!r}'
        )
    if rtol is None:
        rtol = 1e-6 if accountant == "rdp" else 1e-4
    try:
        target = float(target_epsilon)
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: target_epsilon must be a number > 0; got {target_epsilon!r}"
        ) from None
    if not (math.isfinite(target) and target > 0):
        raise ValueError(f"{where}: target_epsilon must be a finite number > 0; got {target!r}")
    delta = _check_delta(delta, where)
    q = _check_sample_rate(sample_rate, where, "sample_rate")
    steps = _check_steps(steps, where)
    orders_arr = _check_orders(orders, where)
    conversion = _check_conversion(conversion, where)
    if not 0.0 < rtol <= 0.1:
        raise ValueError(f"{where}: rtol must be in (0, 0.1]; got {rtol!r}")
    if accountant != "rdp":
        if orders is not DEFAULT_RDP_ORDERS or conversion != "improved":
            raise ValueError(
                f'{where}: orders and conversion apply to accountant="rdp" only; got '
                f'accountant="{accountant}" with orders or conversion={conversion!r} set'
            )
        return _curve_noise_multiplier(target, delta, q, steps, rtol, accountant, where)

    def eps_at(sigma: float) -> float:
        rdp = _rdp_one_step(q, sigma, orders_arr) * steps if steps else np.zeros_like(orders_arr)
        return rdp_to_epsilon(orders_arr, rdp, delta, conversion=conversion)[0]

    floor = rdp_to_epsilon(orders_arr, np.zeros_like(orders_arr), delta, conversion=conversion)[0]
    if floor > target:
        raise ValueError(
            f"{where}: target_epsilon={target} is unreachable at delta={delta}: even infinite "
            f"noise only certifies epsilon={floor:.6g} with orders up to {orders_arr.max():g}; "
            "raise target_epsilon or delta, or add larger orders"
        )
    if eps_at(0.0) <= target:  # q == 0 or steps == 0: no noise needed
        return 0.0
    lo, hi = 0.0, 1.0
    while eps_at(hi) > target:
        lo, hi = hi, 2.0 * hi
        if hi > 1e12:
            raise ValueError(
                f"{where}: no noise multiplier below 1e12 reaches target_epsilon={target} "
                f"(delta={delta}, sample_rate={q}, steps={steps})"
            )
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        if eps_at(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def _curve_noise_multiplier(
    target: float, delta: float, q: float, steps: int, rtol: float, accountant: str, where: str
) -> float:
    """Bisect sigma on the PLD or PRV epsilon, bracketed from the RDP sigma (rarely far)."""
    if accountant == "pld":
        from torchfn.persample._accountant_pld import _import_dp_accounting, _pld_epsilon

        _import_dp_accounting(where)

        def eps_at(sigma: float) -> float:
            return _pld_epsilon(((sigma, q, steps),), delta, 1e-4, where)
    else:
        from torchfn.persample._accountant_prv import _prv_bounds

        def eps_at(sigma: float) -> float:
            return _prv_bounds(((sigma, q, steps),), delta, 0.01, None, where).upper

    if q == 0.0 or steps == 0:
        return 0.0
    try:
        hi = noise_multiplier_for_epsilon(target, delta, q, steps, rtol=1e-3)
    except ValueError:  # below the RDP floor of the default orders; PLD may still reach it
        hi = 1.0
    hi = max(hi, 1e-2)
    while eps_at(hi) > target:
        hi *= 2.0
        if hi > 1e12:
            raise ValueError(
                f"{where}: no noise multiplier below 1e12 reaches target_epsilon={target} "
                f"(delta={delta}, sample_rate={q}, steps={steps}, accountant={accountant!r})"
            )
    lo = 0.75 * hi
    while eps_at(lo) <= target:
        hi, lo = lo, 0.75 * lo
        if lo < 1e-3:
            raise ValueError(
                f"{where}: target_epsilon={target} is met with a noise multiplier below 1e-3 "
                f"(delta={delta}, sample_rate={q}, steps={steps}); the {accountant.upper()} "
                "accountant is not reliable there, use accountant='rdp'"
            )
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        if eps_at(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


# --------------------------------------------------------------------------- accountant


def _record_steps(history: list[tuple[float, float, int]], noise_multiplier: float,
                  sample_rate: float, steps: int, where: str) -> None:
    """Append ``steps`` steps of ``(sigma, q)`` to an accountant's history (in place), merged
    into the last entry when it has the same ``(sigma, q)``; zero steps record nothing."""
    sigma = _check_noise(noise_multiplier, where)
    q = _check_sample_rate(sample_rate, where, "sample_rate")
    steps = _check_steps(steps, where)
    if steps == 0:
        return
    if history and history[-1][:2] == (sigma, q):
        history[-1] = (sigma, q, history[-1][2] + steps)
    else:
        history.append((sigma, q, steps))


def _check_state(state: Any, where: str, fmt: str, version: int, keys: set[str],
                 owner: str) -> Mapping[str, Any]:
    """Return ``state`` after checking it is a ``state_dict()`` of ``owner`` (a dict with
    ``format`` ``fmt``, ``version`` and the accountant's ``keys``); errors name ``where``."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: expected a dict from state_dict(); got {type(state).__name__}")
    if state.get("format") != fmt or state.get("version") != version:
        raise ValueError(
            f"{where}: expected format={fmt!r} version={version}; got "
            f"format={state.get('format')!r} version={state.get('version')!r} (only a "
            f"{owner}.state_dict() loads here)")
    missing = set(keys) - set(state)
    if missing:
        raise ValueError(f"{where}: state is missing keys {sorted(missing)}")
    return state


def _check_history(entries: Any, where: str) -> list[tuple[float, float, int]]:
    """Return a saved history (``[[sigma, q, steps], ...]``) checked entry by entry."""
    history: list[tuple[float, float, int]] = []
    for n, entry in enumerate(entries):
        if len(entry) != 3:
            raise ValueError(
                f"{where}: history[{n}] must be (noise_multiplier, sample_rate, steps); "
                f"got {entry!r}"
            )
        sigma = _check_noise(entry[0], f"{where}: history[{n}]")
        q = _check_sample_rate(entry[1], f"{where}: history[{n}]", "sample_rate")
        steps = _check_steps(entry[2], f"{where}: history[{n}]")
        history.append((sigma, q, steps))
    return history


class _StepHistory:
    """What every accountant keeps: the merged step history, recorded by :meth:`step`."""

    _history: list[tuple[float, float, int]]

    @property
    def history(self) -> tuple[tuple[float, float, int], ...]:
        """The ``(noise_multiplier, sample_rate, steps)`` entries recorded so far."""
        return tuple(self._history)

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record ``steps`` DP-SGD steps with this noise multiplier and sample rate (mutates)."""
        _record_steps(self._history, noise_multiplier, sample_rate, steps,
                      f"{type(self).__name__}.step")


class RDPAccountant(_StepHistory):
    """Tracks the RDP of a DP-SGD run and returns its (epsilon, delta) guarantee.

    State is the step history: a tuple of ``(noise_multiplier, sample_rate, steps)`` entries
    (consecutive steps with the same noise and rate are merged), plus the orders and the
    conversion. :meth:`state_dict` / :meth:`load_state_dict` carry it through a checkpoint as
    plain lists, floats and strings (``torch.save(..., weights_only=True)`` and JSON friendly),
    so a resumed run keeps its accounting.

    Args:
        orders: Rényi orders (default :data:`DEFAULT_RDP_ORDERS`).
        conversion: ``"improved"`` (default) or ``"classic"``; see :func:`rdp_to_epsilon`.

    Example:
        >>> acct = RDPAccountant()
        >>> for _ in range(3):
        ...     acct.step(noise_multiplier=1.5, sample_rate=0.04, steps=750)
        >>> acct.history
        ((1.5, 0.04, 2250),)
        >>> eps, order = acct.get_privacy_spent(delta=1e-5)
        >>> round(eps, 2), order
        (7.33, 3.9)
        >>> resumed = RDPAccountant()
        >>> resumed.load_state_dict(acct.state_dict())
        >>> resumed.get_epsilon(1e-5) == acct.get_epsilon(1e-5)
        True
    """

    def __init__(
        self,
        orders: Sequence[float] = DEFAULT_RDP_ORDERS,
        conversion: Conversion = "improved",
    ) -> None:
        self._orders = _check_orders(orders, "RDPAccountant")
        self._conversion: Conversion = _check_conversion(conversion, "RDPAccountant")
        self._history: list[tuple[float, float, int]] = []
        self._cache: dict[tuple[float, float], np.ndarray] = {}

    @property
    def orders(self) -> tuple[float, ...]:
        """The Rényi orders, as a tuple of floats."""
        return tuple(self._orders.tolist())

    @property
    def conversion(self) -> Conversion:
        """``"improved"`` or ``"classic"``."""
        return self._conversion

    def __repr__(self) -> str:
        return (
            f"RDPAccountant(history={self.history}, conversion={self._conversion!r}, "
            f"n_orders={self._orders.size})"
        )

    def get_rdp(self) -> np.ndarray:
        """Return the composed RDP of the recorded history at each order, shape ``(n_orders,)``."""
        total = np.zeros_like(self._orders)
        for sigma, q, steps in self._history:
            per_step = self._cache.get((sigma, q))
            if per_step is None:
                per_step = self._cache[(sigma, q)] = _rdp_one_step(q, sigma, self._orders)
            total = total + per_step * steps
        return total

    def get_privacy_spent(self, delta: float) -> tuple[float, float]:
        """Return ``(epsilon, best_order)`` of the recorded history at this ``delta``."""
        return rdp_to_epsilon(self._orders, self.get_rdp(), delta, conversion=self._conversion)

    def get_epsilon(self, delta: float) -> float:
        """Return epsilon of the recorded history at this ``delta`` (a Python float)."""
        return self.get_privacy_spent(delta)[0]

    def state_dict(self) -> dict[str, Any]:
        """Return the accountant's state as plain Python containers."""
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "orders": self._orders.tolist(),
            "conversion": self._conversion,
            "history": [[sigma, q, steps] for sigma, q, steps in self._history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this accountant's orders, conversion and history with ``state`` (mutates)."""
        where = "RDPAccountant.load_state_dict"
        state = _check_state(state, where, _STATE_FORMAT, _STATE_VERSION,
                             {"orders", "conversion", "history"}, "RDPAccountant")
        orders = _check_orders(state["orders"], where)
        conversion = _check_conversion(state["conversion"], where)
        history = _check_history(state["history"], where)
        self._orders, self._conversion, self._history = orders, conversion, history
        self._cache = {}
