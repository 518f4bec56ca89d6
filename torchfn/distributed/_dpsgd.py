"""Distributed DP-SGD: clip on each rank, all-reduce the clipped sums, add the noise once.

One logical step over ``W`` ranks::

    draw   B_t by Poisson sampling over the WHOLE dataset (same seed on every rank), then
           rank r takes every W-th selected index (selected[r::W])
    rank r g_r = sum_{i in B_t, i on r} clip_C(grad l_i)         local clipped sum
    all    g   = sum_r g_r                                        one sum all-reduce
    all    g~  = (g + N(0, sigma^2 C^2 I)) / (q N)                noise from state.key
    all    theta <- optimizer(theta, g~)

The noise is drawn from the counter-based generator under ``state.key``, which is the same on
every rank (replicated state), so every rank adds the *same* draw to the *same* reduced sum:
the global noise has std ``sigma C`` -- not ``sqrt(W) sigma C`` as it would if each rank noised
its own part -- and all replicas stay bitwise equal. The mechanism is exactly the
single-process one over the global Poisson batch (sampling rate ``q``, dataset size ``N``), so
the accountant is stepped once per logical step with the global ``q``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from torchfn._checks import _check_rank
from torchfn.distributed._env import world_info
from torchfn.distributed._reduce import DEFAULT_BUCKET_MB, all_reduce_tree
from torchfn.persample import (
    ClippedSum,
    DPState,
    DPTrainStep,
    PLDAccountant,
    PoissonSampler,
    RDPAccountant,
    run_chunks,
)

__all__ = ["DistributedDPStep", "all_reduce_clipped_sum", "shard_poisson_sample"]

Chunks = list[tuple[Tensor, Tensor]]


def shard_poisson_sample(sampler: PoissonSampler, step: int, *, rank: int, world_size: int,
                         physical_batch_size: int | None = None) -> Chunks:
    """Return rank ``rank``'s physical batches ``[(indices, valid), ...]`` of logical step ``step``.

    ``sampler`` is the GLOBAL :class:`torchfn.functional.PoissonSampler` (whole dataset, same
    seed on every rank); its Bernoulli mask is drawn in full on every rank (cheap, counter
    based) and the selected indices are dealt round-robin, ``selected[rank::world_size]``, so
    the ranks' shares are disjoint, their union is exactly the Poisson draw, and their sizes
    differ by at most one. The share is packed like :meth:`PoissonSampler.sample`: padded
    ``(physical_batch_size,)`` chunks (default: the sampler's), at least one, never truncated.

    Example:
        >>> from torchfn.persample import PoissonSampler
        >>> s = PoissonSampler(1000, 0.05, 64, seed=0)
        >>> a = shard_poisson_sample(s, 0, rank=0, world_size=2, physical_batch_size=40)
        >>> b = shard_poisson_sample(s, 0, rank=1, world_size=2, physical_batch_size=40)
        >>> n = sum(int(v.sum()) for _, v in a + b)
        >>> n == int(s.mask(0).sum())
        True
    """
    _check_rank(world_size, rank, "shard_poisson_sample")
    size = sampler.physical_batch_size if physical_batch_size is None else physical_batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"shard_poisson_sample(physical_batch_size=...): expected an int >= 1, "
                         f"got {physical_batch_size!r}")
    selected = torch.nonzero(sampler.mask(step)).flatten()[rank::world_size]
    n_chunks = max(1, -(-selected.numel() // size))
    padded = torch.zeros(n_chunks * size, dtype=torch.int64)
    padded[: selected.numel()] = selected
    valid = torch.arange(n_chunks * size) < selected.numel()
    return list(zip(padded.split(size), valid.split(size), strict=True))


def all_reduce_clipped_sum(total: ClippedSum, *, group: ProcessGroup | None = None,
                           bucket_mb: float = DEFAULT_BUCKET_MB) -> ClippedSum:
    """Return the :class:`ClippedSum` summed over the ranks (grads, count, loss_sum, ...).

    Everything goes in the same buckets (one all-reduce for a small model). No noise is added
    here; :meth:`DistributedDPStep.apply` adds it once to the result.
    """
    packed = {f"grad/{k}": v for k, v in total.grads.items()}
    for name in ("count", "loss_sum", "clipped", "norm_sum"):
        packed[name] = getattr(total, name)
    red = all_reduce_tree(packed, op="sum", group=group, bucket_mb=bucket_mb)
    return ClippedSum(grads={k: red[f"grad/{k}"] for k in total.grads}, count=red["count"],
                      loss_sum=red["loss_sum"], clipped=red["clipped"],
                      norm_sum=red["norm_sum"])


class DistributedDPStep:
    """DP-SGD over ranks from a single-process :class:`torchfn.functional.DPTrainStep`.

    ``DistributedDPStep(step)`` with ``step = make_dp_train_step(..., sample_rate=q,
    dataset_size=N)`` for the GLOBAL dataset. Calls:

    - ``dstep(state, local_batch, valid)``: one logical step whose local share fits one
      physical batch: local clipped sum, sum all-reduce, noise once, update;
    - :meth:`run`: one logical step on :func:`shard_poisson_sample` chunks (any number per
      rank; ranks may differ), stepping an accountant with the global ``q``;
    - :meth:`compile`: the same with the local clipped sum and the reduce+apply each compiled
      with ``fullgraph=True``.

    Every rank must start from the same :func:`torchfn.functional.init_dp_state` (same seed),
    so the noise keys agree; with ``secure_noise=True`` (a key from the OS, no seed) build
    the state on every rank and broadcast the key: ``torch.distributed.broadcast(state.key,
    src=0)``. Attributes of ``step`` (``noise_std``, ``sample_rate``, ...)
    are forwarded.
    """

    def __init__(self, step: DPTrainStep, *, group: ProcessGroup | None = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        if not isinstance(step, DPTrainStep):
            raise TypeError(f"DistributedDPStep(step): expected a DPTrainStep from "
                            f"make_dp_train_step, got {type(step).__name__}")
        world_info(group, "DistributedDPStep")
        self.step_fn, self.group, self.bucket_mb = step, group, bucket_mb
        self._sum: Callable[..., Any] = step.clipped_sum
        self._reduce_apply: Callable[..., Any] = self._reduce_and_apply
        self._one: Callable[..., Any] = self._one_chunk

    def __getattr__(self, name: str) -> Any:
        if name in ("noise_multiplier", "sample_rate", "dataset_size", "expected_batch_size",
                    "max_grad_norm", "layer_thresholds", "noise_std", "clipping",
                    "automatic_gamma", "adaptive_clipping", "grad_noise_multiplier"):
            return getattr(self.step_fn, name)
        raise AttributeError(name)

    def _reduce_and_apply(self, state: DPState,
                          local: ClippedSum) -> tuple[DPState, dict[str, Tensor]]:
        total = all_reduce_clipped_sum(local, group=self.group, bucket_mb=self.bucket_mb)
        return self.step_fn._apply(state, total)

    def _one_chunk(self, state: DPState, batch: tuple[Any, Any],
                   valid: Tensor) -> tuple[DPState, dict[str, Tensor]]:
        return self._reduce_and_apply(state, self.step_fn._clipped_sum(state, batch, valid))

    def __call__(self, state: DPState, batch: tuple[Any, Any],
                 valid: Tensor) -> tuple[DPState, dict[str, Tensor]]:
        """Return ``(new_state, metrics)``; ``batch``/``valid`` are this rank's ``(P, ...)``/``(P,)``.

        ``metrics`` are global (``loss`` is the mean over all valid examples of all ranks,
        ``batch_size`` the global count).
        """
        return self._one(state, batch, valid)

    def apply(self, state: DPState, local: ClippedSum) -> tuple[DPState, dict[str, Tensor]]:
        """Sum ``local`` over the ranks, add the noise once, divide by ``q N``, update."""
        return self._reduce_apply(state, local)

    def compile(self, **kwargs: Any) -> DistributedDPStep:
        """Return a copy whose local part and reduce+apply are ``torch.compile(fullgraph=True)``.

        ``kwargs`` go to ``torch.compile``. As in :meth:`DPTrainStep.compile`, Inductor's buffer
        reuse is switched off unless ``mode``, ``options`` or another ``backend`` is given
        (a CUDA launch failure of the kernel advancing the noise key, torch 2.11).
        """
        kwargs.setdefault("fullgraph", True)
        if "mode" not in kwargs and kwargs.get("backend", "inductor") == "inductor":
            kwargs.setdefault("options", {"allow_buffer_reuse": False})
        new = DistributedDPStep.__new__(DistributedDPStep)
        new.__dict__.update(self.__dict__)
        new._sum = torch.compile(self.step_fn.clipped_sum, **kwargs)
        new._reduce_apply = torch.compile(self._reduce_and_apply, **kwargs)
        new._one = torch.compile(self._one_chunk, **kwargs)
        return new

    def run(self, state: DPState, chunks: Sequence[tuple[Tensor, Tensor]],
            get_batch: Callable[[Tensor], tuple[Any, Any]],
            accountant: RDPAccountant | PLDAccountant | None = None,
            ) -> tuple[DPState, dict[str, Any]]:
        """Take one logical step on this rank's ``chunks`` (:func:`shard_poisson_sample`).

        ``get_batch(indices)`` returns ``(inputs, targets)`` for global dataset indices.
        ``accountant`` (every rank may keep one; they agree) is stepped once with the GLOBAL
        ``noise_multiplier`` and ``sample_rate``; with ``make_dp_train_step(..., delta=...)``
        ``metrics["epsilon"]`` reports its epsilon (:meth:`DPTrainStep.account`).
        """
        if not chunks:
            raise ValueError("DistributedDPStep.run: chunks is empty; pass "
                             "shard_poisson_sample(sampler, step, rank=..., world_size=...)")
        state, metrics = run_chunks(self, self._sum, self.apply, state, chunks, get_batch)
        if accountant is not None:
            metrics = {**metrics, **self.step_fn.account(accountant)}
        return state, metrics
