"""Privacy accounting for DP-SGD with privacy random variables (PRV), dependency free.

Gopi, Lee, Wutschitz 2021, "Numerical Composition of Differential Privacy" (arXiv:2106.02848).
For a pair of distributions ``(P, Q)`` the privacy random variable is ``Y = log(P(w) / Q(w))``
with ``w ~ P``; the hockey-stick divergence is ``delta(eps) = E[(1 - exp(eps - Y))_+]``, and
composing mechanisms adds independent PRVs, so ``k`` steps have the PRV ``Y_1 + ... + Y_k``,
whose distribution is the convolution of theirs: computed here by FFT on a uniform mesh.

Mechanism and neighbouring relation: one DP-SGD step is the Poisson-subsampled Gaussian (sample
rate ``q``, noise multiplier ``sigma``, sensitivity 1) under add-or-remove-one neighbours, the
relation of Opacus and of ``dp_accounting`` (which :class:`torchfn.persample.PLDAccountant`
calls). As ``dp_accounting`` does, both orders of the pair are composed and the larger epsilon
is reported:

- remove: ``P = (1-q) N(0, s^2) + q N(1, s^2)``, ``Q = N(0, s^2)``;
  ``Y = log(1 - q + q exp((2u - 1) / (2 s^2)))``, ``u ~ P``, ``Y > log(1 - q)``.
- add: ``P = N(0, s^2)``, ``Q = (1-q) N(0, s^2) + q N(1, s^2)``;
  ``Y = -log(1 - q + q exp((-2u - 1) / (2 s^2)))``, ``u ~ N(0, s^2)``, ``Y < -log(1 - q)``.

In both ``Y`` is an increasing function of ``u`` with a closed-form inverse, so its CDF is a
sum of Gaussian CDFs.

Discretisation (per step, mesh ``h``, grid points ``j * h``):

1. Truncation, at the unbounded ends of the support only (remove: above; add: below; both for
   ``q = 1``), at mesh points ``a`` / ``b`` with tail mass ``delta_error / (1000 K)`` each: mass
   below ``a`` is moved up to ``a`` and mass above ``b`` becomes an atom at ``+inf`` (it counts
   fully towards delta). Both only increase ``Y``, so ``delta`` can only grow (the
   hockey-stick integrand is non-decreasing in ``Y``).
2. Mean-preserving rounding: the mass of each mesh bin ``[jh, (j+1)h]`` is split between its two
   end points in proportion to its conditional mean (``theta`` of it at ``(j+1)h``), which is
   randomised rounding of ``Y`` to ``Y' = Y + Z`` with ``E[Z | Y] = 0`` and ``Z`` in an
   interval of length ``h``. Bin masses come from Gaussian CDF differences (in upper-tail form
   where that is more accurate) and ``theta`` from ``E[(Y - jh) 1{bin}] = int_bin P(y < Y <=
   (j+1)h) dy`` by an 8-point Gauss-Legendre rule in ``y`` (a bin that holds an end of the
   support, such as ``log(1 - q)``, is integrated over its part inside the support).
3. Composition: the truncated, rounded PMFs of all steps are composed by FFT on a circular
   mesh of ``n`` points (self-composition as a power of the transform, phases of a
   heterogeneous history as a product of transforms). The circle spans a window
   ``[lo, lo + n h)`` chosen by Chernoff bounds from the moment generating functions of the
   discrete PMFs, so that the composed mass outside it, ``tau_low`` below and ``tau_high``
   above (both bounded by the same Chernoff bounds at the final window), is tiny; that mass
   wraps around the circle.

Error bounds (returned by :meth:`PRVAccountant.get_epsilon_bounds`). With ``K`` steps in all,
``Z_1 + ... + Z_K`` is, given the ``Y``'s, a sum of independent mean-zero variables each in an
interval of length ``h``, so by Hoeffding ``P(sum Z < -eps_err) <= delta_h`` for
``eps_err = h sqrt(K log(1 / delta_h) / 2)``. Hence, with ``delta_c`` the delta of the
composed mesh PMF on the circle (``+inf`` atoms included),

    delta_true(eps) <= delta_c(eps - eps_err) + tau_high + delta_h
    delta_true(eps) >= delta_c(eps + eps_err) - tau_low - delta_h - p_trunc

(``p_trunc``: the probability that truncation changed any step), which give

    eps_upper    = eps_c(delta - tau_high - delta_h) + eps_err   (>= the true epsilon)
    eps_estimate = eps_c(delta)
    eps_low      = eps_c(delta + tau_low + delta_h + p_trunc) - eps_err   (<= the true epsilon)

``eps_upper`` is the accountant's epsilon: it is an upper bound on the true epsilon of the
subsampled Gaussian up to floating-point round-off (of the FFT, about ``1e-16`` per mesh point,
and of the Gauss-Legendre ``theta`` of a smooth integrand over one mesh bin), which the bound
does not include. The mesh is chosen so that ``eps_err = eps_error`` (the
``eps_error`` argument, default 0.01), with ``delta_h = delta_error / 2``; the truncation (all
steps together) and each window tail get ``delta_error / 1000``, so that they barely move the
estimate either (``delta_error`` defaults to ``delta / 1000``).

``eps_c`` inverts ``delta_c`` exactly: ``delta_c`` is ``A - exp(eps) B`` between mesh points
(suffix sums ``A``, ``B``), so the grid interval is found by a search and the value in it in
closed form.

Everything is host-side float64 (``numpy``; ``torch.special.ndtr`` for the Gaussian CDF): call
it between steps, never inside a compiled step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from torchfn.persample._accountant import (
    _check_delta,
    _check_history,
    _check_noise,
    _check_sample_rate,
    _check_state,
    _check_steps,
    _StepHistory,
)

__all__ = ["PRVAccountant", "PRVEpsilon", "prv_epsilon"]

_STATE_FORMAT = "torchfn.prv_accountant"
_STATE_VERSION = 1
_MAX_MESH = 1 << 24  # mesh points (a 128 MiB float64 array)
_CHUNK = 1 << 16  # mesh bins per Gauss-Legendre batch
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(8)
_TAIL_SHARE = 1e-3  # of delta_error, for the truncation (all steps together) and each window tail
_LAMBDAS = np.array([1 / 8, 1 / 4, 1 / 2, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])


class PRVEpsilon(NamedTuple):
    """Epsilon of a PRV composition: ``low <= true epsilon <= upper``; ``estimate`` between."""

    low: float
    estimate: float
    upper: float


# --------------------------------------------------------------------------- validation


def _check_eps_error(value: Any, where: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: eps_error must be a number > 0; got {value!r}") from None
    if not (math.isfinite(out) and 1e-6 <= out <= 1.0):
        raise ValueError(
            f"{where}: eps_error must be in [1e-6, 1] (the allowed gap eps_upper - "
            f"eps_estimate; 0.01 is the usual choice, smaller is tighter and slower); got {value!r}"
        )
    return out


def _check_delta_error(value: Any, where: str) -> float | None:
    if value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: delta_error must be None (delta / 1000) or a number in (0, 1); "
            f"got {value!r}"
        ) from None
    if not 0.0 < out < 1.0:
        raise ValueError(
            f"{where}: delta_error must be None (delta / 1000) or in (0, 1); got {value!r}"
        )
    return out


# --------------------------------------------------------------------------- one step's PRV


def _ndtr(x: np.ndarray) -> np.ndarray:
    return torch.special.ndtr(torch.as_tensor(np.asarray(x, dtype=np.float64))).numpy()


def _interval_mass(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Return ``Phi(hi) - Phi(lo)`` (``lo <= hi``), in upper-tail form where ``lo > 0``."""
    upper = lo > 0
    return np.where(upper, _ndtr(-lo) - _ndtr(-hi), _ndtr(hi) - _ndtr(lo))


class _StepPRV:
    """The PRV of one subsampled Gaussian step in one direction (``"remove"`` or ``"add"``)."""

    def __init__(self, sigma: float, q: float, direction: str) -> None:
        self.sigma, self.q, self.direction = sigma, q, direction
        # u ~ sum_c weight_c N(mean_c, sigma^2); Y = loss(u) is increasing in u
        if direction == "remove":
            self.components = [(1.0 - q, 0.0), (q, 1.0)] if q < 1.0 else [(1.0, 1.0)]
        else:
            self.components = [(1.0, 0.0)]
        edge = math.log1p(-q) if q < 1.0 else -math.inf  # log(1 - q)
        self.support = (edge, math.inf) if direction == "remove" else (-math.inf, -edge)

    def loss(self, u: np.ndarray) -> np.ndarray:
        """Return ``Y`` as a function of ``u``."""
        sign = 1.0 if self.direction == "remove" else -1.0
        z = (2.0 * sign * u - 1.0) / (2.0 * self.sigma**2)
        if self.q == 1.0:
            return sign * z
        return sign * np.logaddexp(math.log1p(-self.q), math.log(self.q) + z)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """Return ``u`` with ``loss(u) = y``: ``-inf`` / ``+inf`` at and beyond the support."""
        q = self.q
        sign = 1.0 if self.direction == "remove" else -1.0
        t = sign * np.asarray(y, dtype=np.float64)  # z = log((exp(t) - (1 - q)) / q)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            small = np.log1p(np.expm1(np.minimum(t, 50.0)) / q)
            large = t + np.log1p(-(1.0 - q) * np.exp(-np.maximum(t, 50.0))) - math.log(q)
        z = np.where(t < 50.0, small, large)
        if q < 1.0:
            z = np.where(t <= math.log1p(-q), -np.inf, z)
        return sign * (self.sigma**2 * z + 0.5)

    def mass(self, u_lo: np.ndarray, u_hi: np.ndarray) -> np.ndarray:
        """Return ``P(u_lo < u <= u_hi)`` elementwise (``u_lo <= u_hi``)."""
        s = self.sigma
        out = np.zeros(np.broadcast(u_lo, u_hi).shape)
        for w, m in self.components:
            out += w * _interval_mass((u_lo - m) / s, (u_hi - m) / s)
        return out

    def tail_point(self, prob: float, upper: bool) -> float:
        """Return ``y`` with ``P(Y > y) <= prob`` (upper) or ``P(Y < y) <= prob`` (lower)."""
        s = self.sigma
        sign = 1.0 if upper else -1.0

        def tail(u: float) -> float:  # P(u' > u) (upper) or P(u' < u) (lower)
            return sum(w * 0.5 * math.erfc(sign * (u - m) / (s * math.sqrt(2.0)))
                       for w, m in self.components)

        lo, hi = -40.0 * s - 2.0, 40.0 * s + 2.0
        for _ in range(200):  # bisection for the u-quantile of the mixture
            mid = 0.5 * (lo + hi)
            if (tail(mid) > prob) == upper:
                lo = mid
            else:
                hi = mid
        return float(self.loss(np.array([hi if upper else lo]))[0])

    def discretise(self, h: float, tail_prob: float, where: str) -> tuple[int, np.ndarray, float, float]:
        """Return ``(j0, pmf, p_inf, p_trunc)``: mass ``pmf[i]`` at ``(j0 + i) h``, an atom
        ``p_inf`` at ``+inf`` and the probability ``p_trunc`` that truncation moved ``Y``."""
        y_lo, y_hi = self.support
        bottom = self.tail_point(tail_prob, upper=False) if math.isinf(y_lo) else y_lo
        top = self.tail_point(tail_prob, upper=True) if math.isinf(y_hi) else y_hi
        j_lo, j_hi = math.floor(bottom / h), math.ceil(top / h)
        if math.isinf(y_lo):
            bottom = j_lo * h  # a truncation point on the mesh: Y < bottom moves up to it
        if math.isinf(y_hi):
            top = j_hi * h  # Y > top becomes +inf
        j_hi = max(j_hi, j_lo + 1)  # at least one bin
        if j_hi - j_lo + 1 > _MAX_MESH:
            raise ValueError(
                f"{where}: the PRV mesh would need {j_hi - j_lo + 1} points (more than "
                f"{_MAX_MESH}) for one step's privacy loss range [{bottom:.3g}, {top:.3g}] "
                f"(noise_multiplier={self.sigma}, sample_rate={self.q}) at spacing {h:.3g}; "
                "raise eps_error or delta_error"
            )
        g = np.arange(j_lo, j_hi + 1, dtype=np.float64) * h  # mesh points; bins between them
        lo_c = np.clip(g[:-1], bottom, top)  # each bin cut to [bottom, top]
        hi_c = np.clip(g[1:], bottom, top)
        u_hi = self.inverse(hi_c)
        m = np.maximum(self.mass(self.inverse(lo_c), u_hi), 0.0)
        # first moment E[(Y - g_lo) 1{Y in bin}] = m (lo_c - g_lo) + int_lo_c^hi_c P(y < Y <= hi_c)
        inner = np.empty_like(m)
        for c in range(0, m.size, _CHUNK):
            sl = slice(c, c + _CHUNK)
            half = 0.5 * (hi_c[sl] - lo_c[sl])
            nodes = (lo_c[sl] + half)[:, None] + half[:, None] * _GL_NODES[None, :]
            inner[sl] = self.mass(self.inverse(nodes), u_hi[sl, None]) @ _GL_WEIGHTS * half
        with np.errstate(invalid="ignore", divide="ignore"):
            theta = np.where(m > 0, (m * (lo_c - g[:-1]) + inner) / (h * m), 0.5)
        theta = np.clip(theta, 0.0, 1.0)
        pmf = np.zeros(g.size)
        pmf[:-1] += m * (1.0 - theta)
        pmf[1:] += m * theta
        below = float(self.mass(np.array(-np.inf), self.inverse(bottom))) if math.isinf(y_lo) \
            else 0.0
        above = float(self.mass(self.inverse(top), np.array(np.inf))) if math.isinf(y_hi) else 0.0
        pmf[0] += below  # moved up to the lowest mesh point
        return j_lo, pmf, above, below + above


# --------------------------------------------------------------------------- composition


def _log_mgf(j0: int, pmf: np.ndarray, h: float, lambdas: np.ndarray) -> np.ndarray:
    """Return ``log sum_i pmf[i] exp(lambda (j0 + i) h)`` per lambda (the finite part only)."""
    pos = pmf > 0
    logw = np.log(pmf[pos])
    y = (j0 + np.flatnonzero(pos)) * h
    out = np.empty(lambdas.size)
    for i, lam in enumerate(lambdas.tolist()):
        x = lam * y + logw
        mx = x.max()
        out[i] = mx + math.log(np.exp(x - mx).sum())
    return out


def _fast_size(n: int) -> int:
    """Return the smallest ``2^a 3^b 5^c >= n``."""
    best = 1 << max(n - 1, 1).bit_length()
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            m = p35
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 3
        p5 *= 5
    return best


def _eps_for_delta(s: np.ndarray, w: np.ndarray, p_inf: float, delta: float) -> float:
    """Return the smallest ``eps >= 0`` with ``p_inf + sum w (1 - exp(eps - s))_+ <= delta``."""
    if delta <= p_inf:
        return math.inf
    keep = s > 0
    s, w = s[keep], w[keep]
    if s.size == 0:
        return 0.0
    # delta at eps, between mesh points s_{m-1} <= eps <= s_m: A_m - exp(eps) B_m with suffix sums
    # A_m = p_inf + sum_{j >= m} w_j and B_m = sum_{j >= m} w_j exp(-s_j) (in logs: no overflow)
    with np.errstate(divide="ignore"):
        log_b = np.logaddexp.accumulate((np.log(w) - s)[::-1])[::-1]
    a = p_inf + np.cumsum(w[::-1])[::-1]
    # delta at eps = s_m (w_m's term is 0 there): suffix sums from m + 1
    a_next = np.append(a[1:], p_inf)
    d = a_next - np.exp(np.append(log_b[1:], -np.inf) + s)
    if a[0] - math.exp(log_b[0]) <= delta:  # delta(0) is already small enough
        return 0.0
    m = int(np.searchsorted(-d, -delta, side="left"))  # first mesh point with delta <= target
    if m >= s.size:
        return math.inf  # only the +inf atom is left above; cannot happen as delta > p_inf
    # eps in [s_{m-1}, s_m] (or [0, s_0]): the terms j >= m are active
    return max(math.log(max(a[m] - delta, 1e-300)) - float(log_b[m]), 0.0)


def _compose(history: tuple[tuple[float, float, int], ...], direction: str, h: float,
             tail_prob: float, delta_alias: float, where: str
             ) -> tuple[np.ndarray, np.ndarray, float, float, float, float]:
    """Return ``(s, w, p_inf, tau_low, tau_high, p_trunc)`` of one direction's composition."""
    parts = []
    for sigma, q, steps in history:
        j0, pmf, p_inf, p_trunc = _StepPRV(sigma, q, direction).discretise(h, tail_prob, where)
        parts.append((j0, pmf, p_inf, p_trunc, steps))

    log_up = sum(k * _log_mgf(j0, pmf, h, _LAMBDAS) for j0, pmf, _, _, k in parts)
    log_dn = sum(k * _log_mgf(j0, pmf, h, -_LAMBDAS) for j0, pmf, _, _, k in parts)
    hi = float(np.min((log_up - math.log(delta_alias)) / _LAMBDAS))
    lo = float(np.max(-(log_dn - math.log(delta_alias)) / _LAMBDAS))
    lo_idx, hi_idx = math.floor(lo / h), math.ceil(hi / h)
    width = max(hi_idx - lo_idx + 1, max(pmf.size for _, pmf, _, _, _ in parts))
    n = _fast_size(width)
    if n > _MAX_MESH:
        raise ValueError(
            f"{where}: the PRV mesh would need {n} points (more than {_MAX_MESH}): spacing "
            f"{h:.3g} over a window of width {hi - lo:.3g}; raise eps_error or delta_error"
        )
    hi_idx = lo_idx + n - 1
    total = None
    p_keep = 1.0
    p_trunc = 0.0
    for j0, pmf, p_inf, p_t, k in parts:
        arr = np.zeros(n)
        arr[: pmf.size] = pmf
        f = np.fft.rfft(np.roll(arr, j0 % n))
        f = f**k if k > 1 else f
        total = f if total is None else total * f
        p_keep *= (1.0 - p_inf) ** k
        p_trunc += k * p_t
    out = np.maximum(np.fft.irfft(total, n), 0.0)
    w = np.roll(out, -(lo_idx % n))  # slot i stands for mesh point lo_idx + i
    s = (lo_idx + np.arange(n)) * h
    # Chernoff: mass of the composed finite part above hi_idx / below lo_idx (wrapped around)
    tau_high = float(np.min(np.exp(np.minimum(log_up - _LAMBDAS * (hi_idx + 1) * h, 0.0))))
    tau_low = float(np.min(np.exp(np.minimum(log_dn + _LAMBDAS * lo_idx * h, 0.0))))
    return s, w, 1.0 - p_keep, tau_low, tau_high, min(p_trunc, 1.0)


def _prv_bounds(history: tuple[tuple[float, float, int], ...], delta: float, eps_error: float,
                delta_error: float | None, where: str) -> PRVEpsilon:
    """Return the PRV epsilon bounds of a validated ``(sigma, q, steps)`` history."""
    events = []
    for sigma, q, steps in history:
        if q == 0.0 or steps == 0:
            continue  # the data is never touched
        if sigma == 0.0:
            return PRVEpsilon(math.inf, math.inf, math.inf)
        events.append((sigma, q, steps))
    if not events:
        return PRVEpsilon(0.0, 0.0, 0.0)
    d_err = delta / 1000.0 if delta_error is None else delta_error
    if d_err >= delta / 2:
        raise ValueError(
            f"{where}: delta_error must be below delta / 2 (it is spent out of delta); got "
            f"delta_error={d_err!r} for delta={delta!r}"
        )
    history = tuple(events)
    delta_h = d_err / 2.0
    total_steps = sum(k for *_, k in history)
    # Hoeffding: P(sum of the K rounding errors < -eps_err) <= delta_h for this mesh spacing
    h = eps_error / math.sqrt(total_steps * math.log(1.0 / delta_h) / 2.0)
    eps_err = h * math.sqrt(total_steps * math.log(1.0 / delta_h) / 2.0)  # = eps_error
    tail_prob = d_err * _TAIL_SHARE / total_steps
    directions = ("remove",) if all(q == 1.0 for _, q, _ in history) else ("remove", "add")
    low = est = up = 0.0
    for direction in directions:
        s, w, p_inf, tau_low, tau_high, p_trunc = _compose(
            history, direction, h, tail_prob, d_err * _TAIL_SHARE, where)
        up_d = _eps_for_delta(s, w, p_inf, delta - tau_high - delta_h)
        est_d = _eps_for_delta(s, w, p_inf, delta)
        low_d = _eps_for_delta(s, w, p_inf, min(delta + tau_low + delta_h + p_trunc, 1.0 - 1e-12))
        up = max(up, up_d + eps_err)
        est = max(est, est_d)
        low = max(low, max(low_d - eps_err, 0.0))
    return PRVEpsilon(low, est, up)


def prv_epsilon(
    q: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    *,
    eps_error: float = 0.01,
    delta_error: float | None = None,
) -> float:
    """Return the PRV epsilon (an upper bound) of ``steps`` Poisson-sampled Gaussian steps.

    Args:
        q: sampling probability of each example per step, in ``[0, 1]``.
        noise_multiplier: noise standard deviation divided by the clipping norm, ``>= 0``.
        steps: number of steps, an int ``>= 0``.
        delta: target delta in ``(0, 1)``.
        eps_error: the discretisation allowance: the returned bound exceeds the estimate by
            about this much (default 0.01; smaller is tighter and slower).
        delta_error: the part of delta spent on tail and rounding bounds, below ``delta / 2``
            (default ``delta / 1000``).

    Returns:
        ``eps_upper`` of :meth:`PRVAccountant.get_epsilon_bounds` (``0.0`` for ``q == 0`` or
        ``steps == 0``; ``inf`` for ``noise_multiplier == 0`` and ``q > 0``).

    Example:
        >>> round(prv_epsilon(q=0.01, noise_multiplier=1.1, steps=1000, delta=1e-5), 3)
        1.525
    """
    where = "prv_epsilon"
    q = _check_sample_rate(q, where)
    sigma = _check_noise(noise_multiplier, where)
    steps = _check_steps(steps, where)
    delta = _check_delta(delta, where)
    eps_error = _check_eps_error(eps_error, where)
    delta_error = _check_delta_error(delta_error, where)
    return _prv_bounds(((sigma, q, steps),), delta, eps_error, delta_error, where).upper


class PRVAccountant(_StepHistory):
    """Tracks a DP-SGD run with privacy random variables and returns its (epsilon, delta).

    The same interface as :class:`torchfn.persample.RDPAccountant` and
    :class:`torchfn.persample.PLDAccountant` (``step``, ``history``, ``get_epsilon``,
    ``get_privacy_spent``, ``state_dict`` / ``load_state_dict``), with no optional dependency;
    numbers as tight as the PLD accountant's. :meth:`get_epsilon` returns the proven upper
    bound ``eps_upper``; :meth:`get_epsilon_bounds` returns ``(low, estimate, upper)``.
    State is the step history of ``(noise_multiplier, sample_rate, steps)`` entries
    (consecutive equal entries merged) and the two error parameters, as plain Python values.

    Args:
        eps_error: the discretisation allowance ``eps_upper - eps_estimate`` (about; default
            0.01, in ``[1e-6, 1]``); the mesh spacing is ``eps_error / sqrt(steps log(2 /
            delta_error) / 2)``, so smaller costs proportionally more mesh points.
        delta_error: the part of delta spent on the tail, window and rounding bounds (default
            ``None``: ``delta / 1000``); must be below ``delta / 2`` when epsilon is asked for.

    Example:
        >>> acct = PRVAccountant()
        >>> acct.step(noise_multiplier=1.1, sample_rate=0.01, steps=1000)
        >>> round(acct.get_epsilon(delta=1e-5), 3)
        1.525
        >>> [round(e, 3) for e in acct.get_epsilon_bounds(1e-5)]  # low, estimate, upper
        [1.505, 1.515, 1.525]
        >>> resumed = PRVAccountant()
        >>> resumed.load_state_dict(acct.state_dict())
        >>> resumed.get_epsilon(1e-5) == acct.get_epsilon(1e-5)
        True
    """

    def __init__(self, eps_error: float = 0.01, delta_error: float | None = None) -> None:
        self._eps_error = _check_eps_error(eps_error, "PRVAccountant")
        self._delta_error = _check_delta_error(delta_error, "PRVAccountant")
        self._history: list[tuple[float, float, int]] = []
        self._cache: dict[tuple[Any, ...], PRVEpsilon] = {}

    @property
    def eps_error(self) -> float:
        """The discretisation allowance in epsilon."""
        return self._eps_error

    @property
    def delta_error(self) -> float | None:
        """The part of delta spent on error bounds (``None``: ``delta / 1000``)."""
        return self._delta_error

    def __repr__(self) -> str:
        return (
            f"PRVAccountant(history={self.history}, eps_error={self._eps_error!r}, "
            f"delta_error={self._delta_error!r})"
        )

    def get_epsilon_bounds(self, delta: float) -> PRVEpsilon:
        """Return ``PRVEpsilon(low, estimate, upper)`` of the recorded history at ``delta``."""
        where = "PRVAccountant.get_epsilon"
        delta = _check_delta(delta, where)
        key = (self.history, delta, self._eps_error, self._delta_error)
        if key not in self._cache:
            self._cache = {key: _prv_bounds(self.history, delta, self._eps_error,
                                            self._delta_error, where)}
        return self._cache[key]

    def get_epsilon(self, delta: float) -> float:
        """Return epsilon (the upper bound) of the recorded history at ``delta`` (a float)."""
        return self.get_epsilon_bounds(delta).upper

    def get_privacy_spent(self, delta: float) -> tuple[float, float]:
        """Return ``(epsilon, nan)``: RDPAccountant's pair; a PRV has no best Rényi order."""
        return self.get_epsilon(delta), math.nan

    def state_dict(self) -> dict[str, Any]:
        """Return the accountant's state as plain Python containers."""
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "eps_error": self._eps_error,
            "delta_error": self._delta_error,
            "history": [[sigma, q, steps] for sigma, q, steps in self._history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this accountant's error parameters and history with ``state`` (mutates)."""
        where = "PRVAccountant.load_state_dict"
        state = _check_state(state, where, _STATE_FORMAT, _STATE_VERSION,
                             {"eps_error", "delta_error", "history"}, "PRVAccountant")
        eps_error = _check_eps_error(state["eps_error"], where)
        delta_error = _check_delta_error(state["delta_error"], where)
        history = _check_history(state["history"], where)
        self._eps_error, self._delta_error = eps_error, delta_error
        self._history, self._cache = history, {}
