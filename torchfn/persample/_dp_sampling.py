"""Poisson subsampling with static shapes for DP-SGD, reproducible from ``(seed, step)``."""

from __future__ import annotations

import torch

from torchfn.persample._dp_random import fold_in, key_from_seed, uniform

__all__ = ["PoissonSampler"]

Tensor = torch.Tensor
_SAMPLE_SALT = 0x73616D70  # "samp"


class PoissonSampler:
    """Poisson subsampling into fixed-size physical batches, reproducible from ``(seed, step)``.

    ``sample(step)`` draws ``mask_i = u_i < sample_rate`` for every example ``i`` of the
    dataset (``u`` from the counter-based generator keyed by ``seed`` and ``step``), and
    returns a list of ``(indices, valid)`` pairs, each ``(physical_batch_size,)`` (int64 and
    bool, on the CPU): the selected indices in order, the last pair padded with index 0 and
    ``valid=False``. At least one pair is returned (all padding when nothing was drawn), more
    than one when the draw exceeds ``physical_batch_size`` -- never truncated, so the sampled
    set is exactly Poisson. Choose ``physical_batch_size`` a few standard deviations above
    ``q N`` (``q N + 4 sqrt(q N)``, say) to make extra physical batches rare.

    Example:
        >>> sampler = PoissonSampler(1000, 0.05, 80, seed=0)
        >>> chunks = sampler.sample(step=0)
        >>> idx, valid = chunks[0]
        >>> idx.shape, valid.dtype, 30 < int(valid.sum()) < 70
        (torch.Size([80]), torch.bool, True)
    """

    def __init__(self, dataset_size: int, sample_rate: float, physical_batch_size: int, *,
                 seed: int) -> None:
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or \
                dataset_size < 1:
            raise ValueError(f"PoissonSampler(dataset_size=...): expected an int >= 1, got "
                             f"{dataset_size!r}")
        if not 0.0 < float(sample_rate) <= 1.0:
            raise ValueError(f"PoissonSampler(sample_rate=...): expected a probability in "
                             f"(0, 1], got {sample_rate!r}")
        if isinstance(physical_batch_size, bool) or not isinstance(physical_batch_size, int) \
                or physical_batch_size < 1:
            raise ValueError(f"PoissonSampler(physical_batch_size=...): expected an int >= 1, "
                             f"got {physical_batch_size!r}")
        self.dataset_size = dataset_size
        self.sample_rate = float(sample_rate)
        self.physical_batch_size = physical_batch_size
        self._key = fold_in(key_from_seed(seed), _SAMPLE_SALT)

    @property
    def expected_batch_size(self) -> float:
        """``sample_rate * dataset_size``: what DP-SGD divides the noisy sum by."""
        return self.sample_rate * self.dataset_size

    def mask(self, step: int) -> Tensor:
        """Return the ``(dataset_size,)`` bool Bernoulli(sample_rate) mask of ``step``."""
        u = uniform(fold_in(self._key, int(step)), (self.dataset_size,))
        return u < self.sample_rate

    def sample(self, step: int) -> list[tuple[Tensor, Tensor]]:
        """Return the physical batches ``[(indices, valid), ...]`` of logical step ``step``."""
        selected = torch.nonzero(self.mask(step)).flatten()
        size = self.physical_batch_size
        n_chunks = max(1, -(-selected.numel() // size))
        padded = torch.zeros(n_chunks * size, dtype=torch.int64)
        padded[: selected.numel()] = selected
        valid = torch.arange(n_chunks * size) < selected.numel()
        return list(zip(padded.split(size), valid.split(size), strict=True))
