"""Class-balanced index sampler (oversample / undersample / inverse-frequency weights).

Also the small helpers every torchfn sampler shares: label encoding, seed mixing (a per-epoch
``torch.Generator`` derived from ``(seed, epoch, ...)``, never global RNG state), rank checks
and the drop/pad split of one epoch's global index list across ranks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch.utils.data import Sampler

from torchfn._checks import _check_rank, _resolve_seed

__all__ = ["ClassBalancedSampler"]

_MASK64 = (1 << 64) - 1


def _mix_seed(*values: int) -> int:
    """Return a 63-bit seed mixing ``values`` (SplitMix64 rounds), so nearby inputs decorrelate."""
    z = 0x9E3779B97F4A7C15
    for v in values:
        z = (z ^ (int(v) & _MASK64)) & _MASK64
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z >> 1


def _generator(*values: int) -> torch.Generator:
    """Return a fresh CPU ``torch.Generator`` seeded from ``_mix_seed(*values)``."""
    return torch.Generator().manual_seed(_mix_seed(*values))


def _encode_labels(labels: Any, owner: str) -> tuple[list[Hashable], torch.Tensor]:
    """Return ``(classes, codes)``: sorted distinct labels and an int64 tensor of class positions.

    ``labels`` may be a 1-D integer tensor / numpy array or any sequence of sortable hashables
    (ints, strings).
    """
    if isinstance(labels, torch.Tensor) or hasattr(labels, "__array__"):
        t = torch.as_tensor(labels)
        if t.dim() != 1 or t.is_floating_point() or t.is_complex():
            raise ValueError(
                f"{owner}(labels=...): expected a 1-D integer tensor, got dtype={t.dtype} "
                f"shape={tuple(t.shape)}"
            )
        classes_t, codes = torch.unique(t.cpu(), sorted=True, return_inverse=True)
        return classes_t.tolist(), codes.to(torch.int64)
    if not isinstance(labels, Sequence) or isinstance(labels, (str, bytes)):
        raise TypeError(
            f"{owner}(labels=...): expected a sequence or 1-D tensor of class labels, "
            f"got {type(labels).__name__}"
        )
    try:
        classes = sorted(set(labels))
    except TypeError as e:
        raise TypeError(f"{owner}(labels=...): labels must be hashable and sortable ({e})") from e
    pos = {c: i for i, c in enumerate(classes)}
    return classes, torch.tensor([pos[y] for y in labels], dtype=torch.int64)


def _split_for_rank(
    indices: torch.Tensor, world_size: int, rank: int, drop_last: bool
) -> tuple[torch.Tensor, int]:
    """Return ``(rank_indices, num_padded)`` for one epoch's global list ``indices``.

    ``drop_last=True`` drops the last ``len % world_size`` entries; ``False`` pads by repeating
    the list from its start (wrapping around if needed), so every rank gets the same length.
    Rank ``r`` takes positions ``r, r + world_size, ...`` of the (dropped/padded) list.
    """
    n = indices.numel()
    if drop_last:
        indices = indices[: (n // world_size) * world_size]
        num_padded = 0
    else:
        total = -(-n // world_size) * world_size
        num_padded = total - n
        if num_padded:
            reps = -(-num_padded // n)
            indices = torch.cat([indices, indices.repeat(reps)[:num_padded]])
    return indices[rank::world_size], num_padded


class ClassBalancedSampler(Sampler[int]):
    """Yield dataset indices whose class frequencies are balanced; one ``int`` per sample.

    Modes (``C`` classes, ``n_c`` samples in class ``c``):

    * ``"oversample"``: every class contributes the majority count ``max(n_c)`` per epoch
      (so ``num_samples = C * max(n_c)`` by default). Without replacement (default) each class
      is cycled through: every sample of class ``c`` appears ``q // n_c`` or ``q // n_c + 1``
      times for a quota ``q``; with ``replacement=True`` the quota is drawn uniformly with
      replacement.
    * ``"undersample"``: every class contributes the minority count ``min(n_c)``
      (``num_samples = C * min(n_c)``), a random subset drawn without replacement by default.
    * ``"weights"``: ``num_samples`` (default ``len(labels)``) draws of
      ``torch.multinomial`` with weight ``1 / n_c`` per sample, so each draw's class is uniform;
      ``replacement=True`` by default.

    In the balanced modes an explicit ``num_samples`` gives each class ``num_samples // C`` and
    ``num_samples % C`` random classes one more; the epoch's list is then shuffled.

    Randomness: epoch ``e`` uses a fresh ``torch.Generator`` seeded from ``(seed, e)`` and
    nothing else, so every rank computes the same global list without communicating.

    Distribution: the global list (length ``num_samples``) is split as in
    ``DistributedSampler``: ``drop_last=False`` (default) pads it by repeating its first entries
    up to a multiple of ``world_size`` (``num_padded`` says how many); ``drop_last=True`` drops
    the tail. Rank ``r`` takes positions ``r::world_size``, so ranks get disjoint positions and
    equal lengths ``len(sampler)``.

    Resume: ``state_dict()`` records the epoch and how many indices this epoch's iterator has
    yielded; after ``load_state_dict`` the next ``iter`` yields exactly the rest of the epoch.
    ``set_epoch(e)`` with a new epoch restarts at position 0; with the current epoch it keeps the
    position (so ``for e in range(start, n): sampler.set_epoch(e)`` after a resume is safe). An
    iterator started after the epoch was fully consumed replays the epoch from the start
    (except right after loading a finished state: that yields nothing, the exact rest). With a
    prefetching ``DataLoader`` (workers), the sampler runs ahead of training: pass the count the
    loop really consumed, ``state_dict(consumed=n)``, or use torchdata's ``StatefulDataLoader``,
    which snapshots the sampler at the right step.

    Example:
        >>> s = ClassBalancedSampler([0, 0, 0, 1], mode="oversample", seed=0)
        >>> idx = list(s)
        >>> len(idx), sorted(idx).count(3)
        (6, 3)
    """

    def __init__(
        self,
        labels: Sequence[Hashable] | torch.Tensor,
        mode: Literal["oversample", "undersample", "weights"] = "oversample",
        num_samples: int | None = None,
        *,
        seed: int | torch.Generator,
        world_size: int = 1,
        rank: int = 0,
        replacement: bool | None = None,
        drop_last: bool = False,
    ) -> None:
        owner = "ClassBalancedSampler"
        if mode not in ("oversample", "undersample", "weights"):
            raise ValueError(
                f"{owner}(mode={mode!r}): expected 'oversample', 'undersample' or 'weights'"
            )
        _check_rank(world_size, rank, owner)
        self.classes, self._codes = _encode_labels(labels, owner)
        if self._codes.numel() == 0:
            raise ValueError(f"{owner}(labels=...): got an empty label sequence")
        self.mode = mode
        self.seed = _resolve_seed(seed, owner)
        self.world_size, self.rank, self.drop_last = world_size, rank, drop_last
        self.replacement = (mode == "weights") if replacement is None else bool(replacement)
        self.class_counts = torch.bincount(self._codes, minlength=len(self.classes))
        c = len(self.classes)
        if num_samples is None:
            if mode == "oversample":
                num_samples = c * int(self.class_counts.max())
            elif mode == "undersample":
                num_samples = c * int(self.class_counts.min())
            else:
                num_samples = self._codes.numel()
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"{owner}(num_samples={num_samples!r}): expected an int >= 1")
        if mode == "weights" and not self.replacement and num_samples > self._codes.numel():
            raise ValueError(
                f"{owner}(mode='weights', replacement=False, num_samples={num_samples}): cannot "
                f"draw more than len(labels)={self._codes.numel()} distinct indices; pass "
                f"replacement=True or a smaller num_samples"
            )
        if drop_last and num_samples < world_size:
            raise ValueError(
                f"{owner}(num_samples={num_samples}, world_size={world_size}, drop_last=True): "
                f"every rank would get 0 indices; use drop_last=False or more samples"
            )
        self.num_samples = num_samples
        # the per-class index lists, in dataset order
        order = torch.argsort(self._codes, stable=True)
        self._class_indices = list(torch.split(order, self.class_counts.tolist()))
        self.epoch = 0
        self._consumed = 0
        self._loaded = False
        self._cache: tuple[int, torch.Tensor, int] | None = None

    # -- the plan: a pure function of (seed, epoch, config) -----------------------------------
    def global_indices(self, epoch: int | None = None) -> torch.Tensor:
        """Return epoch ``epoch``'s global index list ``(num_samples,)`` before the rank split."""
        epoch = self.epoch if epoch is None else epoch
        g = _generator(self.seed, epoch)
        if self.mode == "weights":
            w = (1.0 / self.class_counts.to(torch.float64))[self._codes]
            return torch.multinomial(w, self.num_samples, self.replacement, generator=g)
        c = len(self.classes)
        quota = torch.full((c,), self.num_samples // c, dtype=torch.int64)
        quota[torch.randperm(c, generator=g)[: self.num_samples % c]] += 1
        parts = []
        for idx, q in zip(self._class_indices, quota.tolist(), strict=True):
            n = idx.numel()
            if self.replacement:
                parts.append(idx[torch.randint(0, n, (q,), generator=g)])
            else:  # full cycles + a random subset; order is irrelevant before the shuffle below
                parts.append(idx.repeat(q // n))
                parts.append(idx[torch.randperm(n, generator=g)[: q % n]])
        out = torch.cat(parts)
        return out[torch.randperm(out.numel(), generator=g)]

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """Return this rank's full index list ``(len(self),)`` for ``epoch`` (default: current)."""
        epoch = self.epoch if epoch is None else epoch
        if self._cache is None or self._cache[0] != epoch:
            mine, padded = _split_for_rank(
                self.global_indices(epoch), self.world_size, self.rank, self.drop_last
            )
            self._cache = (epoch, mine, padded)
        return self._cache[1]

    @property
    def num_padded(self) -> int:
        """Number of entries appended to the global list so it splits evenly (0 if drop_last)."""
        n, w = self.num_samples, self.world_size
        return 0 if self.drop_last else -(-n // w) * w - n

    def __len__(self) -> int:
        n, w = self.num_samples, self.world_size
        return n // w if self.drop_last else -(-n // w)

    def __iter__(self) -> Iterator[int]:
        if self._consumed >= len(self) and not self._loaded:
            self._consumed = 0  # a new pass over a finished epoch (not right after a resume)
        self._loaded = False
        return self._iterate(self.epoch)

    def _iterate(self, epoch: int) -> Iterator[int]:
        mine = self.indices(epoch).tolist()
        while self._consumed < len(mine) and self.epoch == epoch:
            i = mine[self._consumed]
            self._consumed += 1
            yield i

    # -- epoch and resume ---------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``iter`` yields; a new epoch restarts at position 0."""
        if epoch != self.epoch:
            self.epoch, self._consumed = int(epoch), 0

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "rank": self.rank,
            "replacement": self.replacement,
            "drop_last": self.drop_last,
            "dataset_size": self._codes.numel(),
        }

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Return ``{"epoch", "consumed", ...config}``; ``consumed`` overrides the position."""
        pos = self._consumed if consumed is None else int(consumed)
        return {"epoch": self.epoch, "consumed": pos, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore epoch and position; the config keys must match this sampler's."""
        _check_state(state, self._fingerprint(), "ClassBalancedSampler", len(self))
        self.epoch, self._consumed = int(state["epoch"]), int(state["consumed"])
        self._loaded = True


def _check_state(state: dict[str, Any], expected: dict[str, Any], owner: str, length: int) -> None:
    for key, value in expected.items():
        if key not in state:
            raise KeyError(f"{owner}.load_state_dict: missing key {key!r}")
        if state[key] != value:
            raise ValueError(
                f"{owner}.load_state_dict: state has {key}={state[key]!r} but this sampler has "
                f"{key}={value!r}; build the sampler with the same arguments to resume"
            )
    if not 0 <= int(state["consumed"]) <= length:
        raise ValueError(
            f"{owner}.load_state_dict: consumed={state['consumed']} outside [0, {length}]"
        )
