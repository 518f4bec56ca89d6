"""Privacy accounting for DP-SGD with privacy loss distributions (PLD), via ``dp_accounting``.

The PLD accountant (Koskela, Jälkö, Honkela 2020; Meiser, Mohammadi 2018; Google's
``dp_accounting`` implementation, Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022,
"Connect the Dots: Tighter Discrete Approximations of Privacy Loss Distributions") composes the
discretised privacy loss distribution of the Poisson-subsampled Gaussian mechanism by FFT
convolution and reads (epsilon, delta) off it exactly, up to the discretisation, which is
rounded pessimistically (the result is still an upper bound). It is tighter than the RDP bound
of :class:`torchfn.persample.RDPAccountant`, typically by 10-15% of epsilon for DP-SGD.

``dp_accounting`` is an optional dependency (``pip install "torchfn[accounting]"``); it is
imported only when a PLD accountant is built or queried. Host-side float64: call it between
steps, never inside a compiled step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torchfn.persample._accountant import (
    _check_delta,
    _check_history,
    _check_noise,
    _check_sample_rate,
    _check_state,
    _check_steps,
    _StepHistory,
)

__all__ = ["PLDAccountant", "pld_epsilon"]

_STATE_FORMAT = "torchfn.pld_accountant"
_STATE_VERSION = 1
_INSTALL_HINT = 'pip install "torchfn[accounting]"'


def _import_dp_accounting(where: str) -> Any:
    """Return the ``dp_accounting`` module, or raise ImportError saying how to install it."""
    try:
        import dp_accounting
    except ImportError as e:
        raise ImportError(
            f"{where}: the PLD accountant needs the optional package dp-accounting, which is not "
            f"installed ({e}); install it with: {_INSTALL_HINT}"
        ) from e
    return dp_accounting


def _check_interval(value: Any, where: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: value_discretization_interval must be a number > 0; got {value!r}"
        ) from None
    if not (math.isfinite(out) and 0.0 < out <= 1.0):
        raise ValueError(
            f"{where}: value_discretization_interval must be in (0, 1] (1e-4 is the usual "
            f"choice; smaller is tighter and slower); got {value!r}"
        )
    return out


def _pld_epsilon(
    history: tuple[tuple[float, float, int], ...], delta: float, interval: float, where: str
) -> float:
    """Return the PLD epsilon of a validated ``(sigma, q, steps)`` history at ``delta``."""
    events = []
    for sigma, q, steps in history:
        if q == 0.0 or steps == 0:
            continue  # the data is never touched
        if sigma == 0.0:
            return math.inf
        events.append((sigma, q, steps))
    if not events:
        return 0.0
    dpa = _import_dp_accounting(where)
    from dp_accounting.pld import pld_privacy_accountant

    acct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    for sigma, q, steps in events:
        event = dpa.GaussianDpEvent(sigma)
        if q < 1.0:
            event = dpa.PoissonSampledDpEvent(q, event)
        acct.compose(dpa.SelfComposedDpEvent(event, steps))
    return max(float(acct.get_epsilon(delta)), 0.0)


def pld_epsilon(
    q: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    *,
    value_discretization_interval: float = 1e-4,
) -> float:
    """Return the PLD epsilon of ``steps`` Poisson-sampled Gaussian steps at ``delta`` (a float).

    Needs the optional ``dp_accounting`` package (``pip install "torchfn[accounting]"``).

    Args:
        q: sampling probability of each example per step, in ``[0, 1]``.
        noise_multiplier: noise standard deviation divided by the clipping norm, ``>= 0``.
        steps: number of steps, an int ``>= 0``.
        delta: target delta in ``(0, 1)``.
        value_discretization_interval: privacy-loss grid spacing of the PLD, in ``(0, 1]``;
            the result is a pessimistic (valid) bound for any spacing, tighter when smaller.

    Returns:
        epsilon (``0.0`` for ``q == 0`` or ``steps == 0``; ``inf`` for ``noise_multiplier == 0``
        and ``q > 0``).

    Example:
        >>> round(pld_epsilon(q=0.01, noise_multiplier=1.1, steps=1000, delta=1e-5), 2)
        1.52
    """
    where = "pld_epsilon"
    q = _check_sample_rate(q, where)
    sigma = _check_noise(noise_multiplier, where)
    steps = _check_steps(steps, where)
    delta = _check_delta(delta, where)
    interval = _check_interval(value_discretization_interval, where)
    return _pld_epsilon(((sigma, q, steps),), delta, interval, where)


class PLDAccountant(_StepHistory):
    """Tracks a DP-SGD run with privacy loss distributions and returns its (epsilon, delta).

    The same interface as :class:`torchfn.persample.RDPAccountant` (``step``, ``history``,
    ``get_epsilon``, ``get_privacy_spent``, ``state_dict`` / ``load_state_dict``), tighter
    numbers. Needs the optional ``dp_accounting`` package (``pip install "torchfn[accounting]"``);
    constructing one without it raises ImportError. State is the step history of
    ``(noise_multiplier, sample_rate, steps)`` entries (consecutive equal entries merged) and
    the discretisation interval, as plain lists, floats and strings.

    Args:
        value_discretization_interval: privacy-loss grid spacing, in ``(0, 1]`` (default
            ``1e-4``, ``dp_accounting``'s default).

    Example:
        >>> acct = PLDAccountant()
        >>> acct.step(noise_multiplier=1.1, sample_rate=0.01, steps=1000)
        >>> acct.history
        ((1.1, 0.01, 1000),)
        >>> round(acct.get_epsilon(delta=1e-5), 2)
        1.52
        >>> resumed = PLDAccountant()
        >>> resumed.load_state_dict(acct.state_dict())
        >>> resumed.get_epsilon(1e-5) == acct.get_epsilon(1e-5)
        True
    """

    def __init__(self, value_discretization_interval: float = 1e-4) -> None:
        _import_dp_accounting("PLDAccountant")
        self._interval = _check_interval(value_discretization_interval, "PLDAccountant")
        self._history: list[tuple[float, float, int]] = []
        self._cache: dict[tuple[Any, ...], float] = {}

    @property
    def value_discretization_interval(self) -> float:
        """The privacy-loss grid spacing of the PLD."""
        return self._interval

    def __repr__(self) -> str:
        return (
            f"PLDAccountant(history={self.history}, "
            f"value_discretization_interval={self._interval!r})"
        )

    def get_epsilon(self, delta: float) -> float:
        """Return epsilon of the recorded history at this ``delta`` (a Python float)."""
        where = "PLDAccountant.get_epsilon"
        delta = _check_delta(delta, where)
        key = (self.history, delta, self._interval)
        if key not in self._cache:
            self._cache = {key: _pld_epsilon(self.history, delta, self._interval, where)}
        return self._cache[key]

    def get_privacy_spent(self, delta: float) -> tuple[float, float]:
        """Return ``(epsilon, nan)``: RDPAccountant's pair; a PLD has no best Rényi order."""
        return self.get_epsilon(delta), math.nan

    def state_dict(self) -> dict[str, Any]:
        """Return the accountant's state as plain Python containers."""
        return {
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
            "value_discretization_interval": self._interval,
            "history": [[sigma, q, steps] for sigma, q, steps in self._history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this accountant's interval and history with ``state`` (mutates)."""
        where = "PLDAccountant.load_state_dict"
        state = _check_state(state, where, _STATE_FORMAT, _STATE_VERSION,
                             {"value_discretization_interval", "history"}, "PLDAccountant")
        interval = _check_interval(state["value_discretization_interval"], where)
        history = _check_history(state["history"], where)
        self._interval, self._history, self._cache = interval, history, {}
