"""Class-balanced sampling over a stream of ``(sample, label)`` of unknown length.

The balancer keeps one bounded buffer per class. An arriving item goes into its class's buffer
(a full buffer evicts a random buffered item, which is counted as dropped). After each arrival
the balancer emits while it can: the next class is one whose emitted count lags its target
ratio the most (ties broken at random); if none of those classes has a buffered item, it waits
for more input. So the output never runs ahead of the targets, memory stays bounded, and the
price of a rare class is dropped majority items, which the report counts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch.utils.data import IterableDataset, get_worker_info

from torchfn._checks import _check_rank, _resolve_seed

from ._samplers import _mix_seed

__all__ = ["StreamBalanceReport", "StreamClassBalancer"]

_TIE = 1e-9


class StreamBalanceReport(NamedTuple):
    """What a ``StreamClassBalancer`` pass did so far; dicts are keyed by class label.

    ``seen``: items of this rank read from the stream; ``emitted``: items yielded;
    ``dropped``: items evicted from a full buffer; ``buffered``: items waiting now (at the end of
    a pass, the leftovers that could not be emitted without overshooting a target);
    ``target_ratios`` / ``achieved_ratios``: shares of the emitted stream (achieved is 0 before
    the first emission); ``max_ratio_error``: ``max |achieved - target|``.
    """

    seen: dict[Hashable, int]
    emitted: dict[Hashable, int]
    dropped: dict[Hashable, int]
    buffered: dict[Hashable, int]
    target_ratios: dict[Hashable, float]
    achieved_ratios: dict[Hashable, float]
    max_ratio_error: float


@dataclass
class _Live:
    """The mutable state of one pass (everything ``state_dict`` records, plus the samples)."""

    epoch: int
    rng: random.Random
    position: int = 0  # stream items read (all ranks' items count)
    seen: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    buffers: list[list[tuple[int, Any, Any]]] = field(default_factory=list)  # (pos, x, y)
    finished: bool = False


class StreamClassBalancer(IterableDataset):
    """Yield ``(sample, label)`` pairs from ``source`` re-balanced to target class ratios.

    ``source`` is a re-iterable of ``(sample, label)`` (a list, a ``StreamingDataset``, a
    generator factory's result per epoch, ...). ``classes`` is the number of classes (labels
    ``0..classes-1``) or the list of labels; an unknown label raises an error naming its
    stream position. ``ratios`` (default uniform) are the target shares, positive, normalized
    here. Each class buffer holds at most ``buffer_size`` items.

    Guarantee: at every point of the output, no class is ahead of its target by a whole item:
    ``emitted[c] < ratios[c] * total + 1``; with uniform ratios the class counts differ by at
    most 1. Each input item is yielded at most once.

    Randomness: a private ``random.Random`` seeded from ``(seed, epoch, rank)``; no global state.

    Distribution: with ``world_size > 1`` every rank reads the same stream and keeps positions
    ``p`` with ``p % world_size == rank`` (disjoint). A stream of unknown length cannot give
    equal lengths per rank without communication: pass ``limit`` (items per rank per pass, at
    most what every rank can produce) when DDP needs equal lengths.

    Resume: ``state_dict()`` records counters, the RNG state and the buffers' contents as
    stream positions. After ``load_state_dict``, the next ``iter`` continues exactly where the
    saved pass stopped: by default it re-reads ``source`` from position 0 and keeps the
    buffered items (``source`` must replay the same stream); with ``fetch`` (``position ->
    (sample, label)``) it refills the buffers through ``fetch`` and treats ``source`` as
    already resumed at the saved position. ``set_epoch`` starts a fresh pass (buffers are not
    carried across epochs) and forwards to ``source.set_epoch`` when it exists.

    Example:
        >>> stream = [(i, 0) for i in range(8)] + [(100 + i, 1) for i in range(2)]
        >>> bal = StreamClassBalancer(stream, classes=2, buffer_size=4, seed=0)
        >>> labels = [y for _, y in bal]
        >>> labels.count(0), labels.count(1), bal.report().dropped[0], bal.report().buffered[0]
        (3, 2, 3, 2)
    """

    def __init__(
        self,
        source: Iterable[tuple[Any, Any]],
        classes: int | Sequence[Hashable],
        *,
        buffer_size: int,
        seed: int | Any,
        ratios: Sequence[float] | None = None,
        world_size: int = 1,
        rank: int = 0,
        limit: int | None = None,
        fetch: Callable[[int], tuple[Any, Any]] | None = None,
    ) -> None:
        owner = "StreamClassBalancer"
        if isinstance(classes, int) and not isinstance(classes, bool):
            if classes < 1:
                raise ValueError(f"{owner}(classes={classes}): expected >= 1 classes")
            classes = list(range(classes))
        self.classes = list(classes)
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ValueError(
                f"{owner}(classes={classes!r}): expected a non-empty list of distinct labels"
            )
        self._pos_of = {c: i for i, c in enumerate(self.classes)}
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"{owner}(buffer_size={buffer_size!r}): expected an int >= 1")
        if ratios is None:
            ratios = [1.0] * len(self.classes)
        ratios = [float(r) for r in ratios]
        if len(ratios) != len(self.classes) or any(not r > 0 for r in ratios):
            raise ValueError(
                f"{owner}(ratios={ratios}): expected {len(self.classes)} positive numbers, one "
                f"per class"
            )
        self.ratios = [r / sum(ratios) for r in ratios]
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"{owner}(limit={limit!r}): expected None or an int >= 1")
        _check_rank(world_size, rank, owner)
        self.source, self.fetch = source, fetch
        self.buffer_size, self.limit = buffer_size, limit
        self.seed = _resolve_seed(seed, owner)
        self.world_size, self.rank = world_size, rank
        self.epoch = 0
        self._live = self._fresh(0)
        self._pending: dict[str, Any] | None = None

    def _fresh(self, epoch: int) -> _Live:
        c = len(self.classes)
        return _Live(
            epoch=epoch,
            rng=random.Random(_mix_seed(self.seed, epoch, self.rank)),
            seen=[0] * c,
            emitted=[0] * c,
            dropped=[0] * c,
            buffers=[[] for _ in range(c)],
        )

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                f"StreamClassBalancer is iterated by DataLoader worker {info.id} of "
                f"{info.num_workers}: each worker would re-read the whole source. Use "
                f"num_workers <= 1, or balance the output stream of the loader instead"
            )
        if self._pending is not None:
            state, self._pending = self._pending, None
            return self._resume(state)
        self._live = self._fresh(self.epoch)
        return self._run(self._live, iter(self.source))

    def _run(self, live: _Live, it: Iterator[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        yield from self._emit(live)
        cap, w = self.buffer_size, self.world_size
        while not live.finished:
            try:
                x, y = next(it)
            except StopIteration:
                break
            pos = live.position
            live.position += 1
            if pos % w != self.rank:
                continue
            c = self._class_of(y, pos)
            live.seen[c] += 1
            buf = live.buffers[c]
            if len(buf) < cap:
                buf.append((pos, x, y))
            else:
                buf[live.rng.randrange(cap)] = (pos, x, y)
                live.dropped[c] += 1
            yield from self._emit(live)

    def _emit(self, live: _Live) -> Iterator[tuple[Any, Any]]:
        while not live.finished:
            if self.limit is not None and sum(live.emitted) >= self.limit:
                live.finished = True
                return
            total = sum(live.emitted) + 1
            deficit = [r * total - e for r, e in zip(self.ratios, live.emitted, strict=True)]
            best = max(deficit)
            ready = [
                c for c, d in enumerate(deficit) if d >= best - _TIE and live.buffers[c]
            ]
            if not ready:
                return
            c = ready[live.rng.randrange(len(ready))] if len(ready) > 1 else ready[0]
            buf = live.buffers[c]
            j = live.rng.randrange(len(buf))
            buf[j], buf[-1] = buf[-1], buf[j]
            _, x, y = buf.pop()
            live.emitted[c] += 1
            yield x, y

    def _class_of(self, y: Any, pos: int) -> int:
        key = y.item() if hasattr(y, "item") else y
        c = self._pos_of.get(key)
        if c is None:
            raise ValueError(
                f"StreamClassBalancer: the item at stream position {pos} has label {key!r}, "
                f"which is not one of classes={self.classes}"
            )
        return c

    # -- report, epoch, resume ----------------------------------------------------------------
    def report(self) -> StreamBalanceReport:
        """Return a ``StreamBalanceReport`` of the current (or last) pass."""
        live, cls = self._live, self.classes
        total = sum(live.emitted)
        achieved = [e / total if total else 0.0 for e in live.emitted]
        err = max(abs(a - r) for a, r in zip(achieved, self.ratios, strict=True)) if total else 0.0
        return StreamBalanceReport(
            seen=dict(zip(cls, live.seen, strict=True)),
            emitted=dict(zip(cls, live.emitted, strict=True)),
            dropped=dict(zip(cls, live.dropped, strict=True)),
            buffered={c: len(b) for c, b in zip(cls, live.buffers, strict=True)},
            target_ratios=dict(zip(cls, self.ratios, strict=True)),
            achieved_ratios=dict(zip(cls, achieved, strict=True)),
            max_ratio_error=err,
        )

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass (a new seed stream); forwards to ``source``."""
        self.epoch = int(epoch)
        self._pending = None
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def _config(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "classes": list(self.classes),
            "ratios": list(self.ratios),
            "buffer_size": self.buffer_size,
            "world_size": self.world_size,
            "rank": self.rank,
            "limit": self.limit,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the pass's state: counters, RNG state, buffers as lists of stream positions."""
        if self._pending is not None:
            return dict(self._pending)
        live = self._live
        version, internal, gauss = live.rng.getstate()
        return {
            "epoch": live.epoch,
            "position": live.position,
            "seen": list(live.seen),
            "emitted": list(live.emitted),
            "dropped": list(live.dropped),
            "buffers": [[p for p, _, _ in b] for b in live.buffers],
            "rng": [version, list(internal), gauss],
            "finished": live.finished,
            **self._config(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter`` continue the saved pass exactly (see the class doc)."""
        for key, value in self._config().items():
            if state.get(key) != value:
                raise ValueError(
                    f"StreamClassBalancer.load_state_dict: state has {key}={state.get(key)!r} "
                    f"but this balancer has {key}={value!r}; build it with the same arguments"
                )
        self.epoch = int(state["epoch"])
        self._pending = dict(state)

    def _resume(self, state: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
        live = self._fresh(int(state["epoch"]))
        version, internal, gauss = state["rng"]
        live.rng.setstate((version, tuple(internal), gauss))
        live.position = int(state["position"])
        live.seen, live.emitted = list(state["seen"]), list(state["emitted"])
        live.dropped, live.finished = list(state["dropped"]), bool(state["finished"])
        slot = {p: (c, j) for c, b in enumerate(state["buffers"]) for j, p in enumerate(b)}
        buffers: list[list[Any]] = [[None] * len(b) for b in state["buffers"]]
        it = iter(self.source)
        if self.fetch is not None:
            for p, (c, j) in slot.items():
                x, y = self.fetch(p)
                buffers[c][j] = (p, x, y)
        else:  # replay the prefix, keeping the buffered items
            for p in range(live.position):
                try:
                    x, y = next(it)
                except StopIteration:
                    raise ValueError(
                        f"StreamClassBalancer: resuming needs the source to replay "
                        f"{live.position} items, but it ended after {p}; pass the same stream, "
                        f"or fetch=... with a source resumed at position {live.position}"
                    ) from None
                if p in slot:
                    c, j = slot[p]
                    buffers[c][j] = (p, x, y)
        for c, b in enumerate(buffers):
            for p, _x, y in b:
                if self._class_of(y, p) != c:
                    raise ValueError(
                        f"StreamClassBalancer: resumed stream position {p} has label {y!r}, but "
                        f"the saved buffer of class {self.classes[c]!r} held it; the source "
                        f"does not replay the same stream"
                    )
        live.buffers = buffers
        self._live = live
        return self._run(live, it)
