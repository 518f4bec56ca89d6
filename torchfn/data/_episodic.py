"""Episodic N-way K-shot (+ queries) batch sampler for meta-learning, and the episode splitter."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from torchfn._checks import _check_rank, _resolve_seed

from ._samplers import _check_state, _encode_labels, _generator

__all__ = ["EpisodicBatchSampler", "split_episode"]


class EpisodicBatchSampler(Sampler[list[int]]):
    """Yield episodes as index lists of length ``n_way * (k_shot + n_query)``.

    Each episode picks ``n_way`` distinct classes and, per class, ``k_shot + n_query`` distinct
    samples. The list is laid out support first, then query, each ordered by the episode's class
    slot: ``[c0 x k_shot, c1 x k_shot, ..., c0 x n_query, c1 x n_query, ...]``; slot ``j`` is
    the relabelled class ``j`` that ``split_episode`` returns.

    Randomness is counter-based: global episode ``g`` of epoch ``e`` is drawn from a fresh
    generator seeded by ``(seed, e, g)``, so an episode does not depend on which rank or resume
    produced it. Rank ``r`` of ``world_size`` takes global episodes ``r, r + world_size, ...``
    (disjoint ids). Equal lengths: ``drop_last=False`` (default) gives every rank
    ``ceil(episodes_per_epoch / world_size)`` episodes, drawing the few extra ids past
    ``episodes_per_epoch`` (``num_padded`` of them) as fresh episodes; ``drop_last=True`` gives
    ``floor(...)`` and never draws them.

    ``set_epoch``, ``state_dict()`` and ``load_state_dict()`` behave as in
    ``ClassBalancedSampler``: the state is ``(epoch, consumed episodes)`` and a resumed sampler
    yields exactly the remaining episodes.

    Use as ``DataLoader(dataset, batch_sampler=sampler)``; then
    ``sampler.split(x, y)`` (or ``split_episode``) gives support/query tensors.

    Example:
        >>> labels = [c for c in range(5) for _ in range(4)]
        >>> s = EpisodicBatchSampler(labels, n_way=3, k_shot=1, n_query=2, episodes_per_epoch=2,
        ...                          seed=0)
        >>> [len(ep) for ep in s]
        [9, 9]
    """

    def __init__(
        self,
        labels: Sequence[Hashable] | torch.Tensor,
        n_way: int,
        k_shot: int,
        n_query: int,
        episodes_per_epoch: int,
        *,
        seed: int | torch.Generator,
        world_size: int = 1,
        rank: int = 0,
        drop_last: bool = False,
    ) -> None:
        owner = "EpisodicBatchSampler"
        for name, value, low in (
            ("n_way", n_way, 1),
            ("k_shot", k_shot, 1),
            ("n_query", n_query, 0),
            ("episodes_per_epoch", episodes_per_epoch, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{owner}({name}={value!r}): expected an int >= {low}")
        _check_rank(world_size, rank, owner)
        self.classes, codes = _encode_labels(labels, owner)
        counts = torch.bincount(codes, minlength=len(self.classes))
        if n_way > len(self.classes):
            raise ValueError(
                f"{owner}(n_way={n_way}): the labels have only {len(self.classes)} classes; "
                f"use n_way <= {len(self.classes)}"
            )
        need = k_shot + n_query
        small = [(self.classes[i], int(n)) for i, n in enumerate(counts.tolist()) if n < need]
        if small:
            listed = ", ".join(f"class {c!r} has {n}" for c, n in small[:5])
            more = f" (and {len(small) - 5} more classes)" if len(small) > 5 else ""
            raise ValueError(
                f"{owner}(k_shot={k_shot}, n_query={n_query}): every class needs at least "
                f"k_shot + n_query = {need} samples, but {listed}{more}; lower k_shot/n_query "
                f"or drop those classes from labels"
            )
        if drop_last and episodes_per_epoch < world_size:
            raise ValueError(
                f"{owner}(episodes_per_epoch={episodes_per_epoch}, world_size={world_size}, "
                f"drop_last=True): every rank would get 0 episodes"
            )
        self.n_way, self.k_shot, self.n_query = n_way, k_shot, n_query
        self.episodes_per_epoch = episodes_per_epoch
        self.seed = _resolve_seed(seed, owner)
        self.world_size, self.rank, self.drop_last = world_size, rank, drop_last
        order = torch.argsort(codes, stable=True)
        self._class_indices = list(torch.split(order, counts.tolist()))
        self.epoch = 0
        self._consumed = 0
        self._loaded = False

    def episode(self, episode_id: int, epoch: int | None = None) -> list[int]:
        """Return global episode ``episode_id`` of ``epoch`` as an index list (see class doc)."""
        g = _generator(self.seed, self.epoch if epoch is None else epoch, episode_id)
        chosen = torch.randperm(len(self._class_indices), generator=g)[: self.n_way].tolist()
        need = self.k_shot + self.n_query
        picks = []
        for c in chosen:
            idx = self._class_indices[c]
            picks.append(idx[torch.randperm(idx.numel(), generator=g)[:need]])
        per_class = torch.stack(picks)  # (n_way, k_shot + n_query)
        support = per_class[:, : self.k_shot].reshape(-1)
        query = per_class[:, self.k_shot :].reshape(-1)
        return torch.cat([support, query]).tolist()

    def episode_ids(self) -> list[int]:
        """Return the global episode ids this rank yields in one epoch, in order."""
        return [i * self.world_size + self.rank for i in range(len(self))]

    @property
    def num_padded(self) -> int:
        """Number of extra episodes (ids >= episodes_per_epoch) drawn so ranks are equal."""
        e, w = self.episodes_per_epoch, self.world_size
        return 0 if self.drop_last else -(-e // w) * w - e

    def __len__(self) -> int:
        e, w = self.episodes_per_epoch, self.world_size
        return e // w if self.drop_last else -(-e // w)

    def __iter__(self) -> Iterator[list[int]]:
        if self._consumed >= len(self) and not self._loaded:
            self._consumed = 0  # a new pass over a finished epoch (not right after a resume)
        self._loaded = False
        return self._iterate(self.epoch)

    def _iterate(self, epoch: int) -> Iterator[list[int]]:
        while self._consumed < len(self) and self.epoch == epoch:
            ep = self.episode(self._consumed * self.world_size + self.rank, epoch)
            self._consumed += 1
            yield ep

    def split(
        self, x: torch.Tensor, y: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``split_episode(x, y, n_way, k_shot, n_query)`` with this sampler's sizes."""
        return split_episode(x, y, n_way=self.n_way, k_shot=self.k_shot, n_query=self.n_query)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a new epoch restarts at episode 0, the current one keeps its place."""
        if epoch != self.epoch:
            self.epoch, self._consumed = int(epoch), 0

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "n_way": self.n_way,
            "k_shot": self.k_shot,
            "n_query": self.n_query,
            "episodes_per_epoch": self.episodes_per_epoch,
            "world_size": self.world_size,
            "rank": self.rank,
            "drop_last": self.drop_last,
        }

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Return ``{"epoch", "consumed", ...config}``; ``consumed`` overrides the position."""
        pos = self._consumed if consumed is None else int(consumed)
        return {"epoch": self.epoch, "consumed": pos, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore epoch and position; the config keys must match this sampler's."""
        _check_state(state, self._fingerprint(), "EpisodicBatchSampler", len(self))
        self.epoch, self._consumed = int(state["epoch"]), int(state["consumed"])
        self._loaded = True


def split_episode(
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    n_way: int,
    k_shot: int,
    n_query: int,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(support_x, support_y, query_x, query_y)`` of one episode laid out as sampled.

    ``x`` is ``(n_way * (k_shot + n_query), ...)`` in ``EpisodicBatchSampler``'s order; the
    results are ``support_x (n_way * k_shot, ...)``, ``support_y (n_way * k_shot,)``,
    ``query_x (n_way * n_query, ...)`` and ``query_y (n_way * n_query,)``, with labels
    relabelled to the episode's class slots ``0..n_way-1`` (int64, on ``x``'s device).
    With ``y`` (the original labels) and ``check=True``, it verifies that each slot holds one
    class and the slots hold distinct classes (a host sync; pass ``check=False`` to skip).

    Example:
        >>> x = torch.arange(6.0).unsqueeze(1)  # n_way=2, k_shot=2, n_query=1
        >>> y = torch.tensor([7, 7, 3, 3, 7, 3])
        >>> sx, sy, qx, qy = split_episode(x, y, n_way=2, k_shot=2, n_query=1)
        >>> sy.tolist(), qy.tolist(), qx.squeeze(1).tolist()
        ([0, 0, 1, 1], [0, 1], [4.0, 5.0])
    """
    n_support, n_total = n_way * k_shot, n_way * (k_shot + n_query)
    if x.shape[0] != n_total:
        raise ValueError(
            f"split_episode(x, n_way={n_way}, k_shot={k_shot}, n_query={n_query}): expected "
            f"x.shape[0] == n_way * (k_shot + n_query) = {n_total}, got {tuple(x.shape)}"
        )
    slots = torch.arange(n_way, device=x.device)
    support_y = slots.repeat_interleave(k_shot)
    query_y = slots.repeat_interleave(n_query)
    if y is not None and check:
        if y.shape != (n_total,):
            raise ValueError(
                f"split_episode(y=...): expected shape ({n_total},), got {tuple(y.shape)}"
            )
        slot_of = torch.cat([support_y, query_y]).to(y.device)
        first = y[:n_support:k_shot]  # the original class in each slot
        if not torch.equal(y, first[slot_of]) or first.unique().numel() != n_way:
            raise ValueError(
                f"split_episode(y=...): labels {y.tolist()} are not laid out as an "
                f"{n_way}-way {k_shot}-shot episode with {n_query} queries per class "
                f"(support first, then query, one distinct class per slot)"
            )
    return x[:n_support], support_y, x[n_support:], query_y
