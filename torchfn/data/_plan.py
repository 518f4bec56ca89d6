"""The one pure plan function: (seed, epoch, shards, rank, worker, consumed, ...) -> ids.

Everything that iterates over shards (``StreamingDataset``, the audit, the tests) derives its
sample order from ``plan``; nothing else decides which sample goes where.

The construction (also in ``torchfn/data/README.md``):

1. **Global order** ``G`` of the epoch: the shards in a seeded random order, their samples
   concatenated, then shuffled inside consecutive windows of ``shuffle_buffer`` positions
   ("buffer shuffle": a sample moves at most one window away, so reads stay shard-local).
   Excluded ids (e.g. corrupt samples) are removed. Keys come from a SplitMix64 hash of
   (seed, epoch, position), so the order does not depend on numpy's or torch's RNG streams.
2. **Remaining stream**: ``R = G[consumed:]``, ``consumed`` being the *global* number of
   items already consumed (all ranks together; ``world_size x`` the per-rank count).
3. **Equal lengths**: ``policy="drop"`` cuts ``R`` to a multiple of ``world_size``;
   ``policy="pad"`` appends ids from the start of ``G`` (flagged ``padded``) up to the next
   multiple. Every rank then gets the same number of items, so DDP never hangs.
4. **Rank stream** ``S = R[rank::world_size]`` (disjoint across ranks, same length).
5. **Workers**: ``S`` is cut into chunks of ``batch_size`` items; worker ``w`` of
   ``num_workers`` gets chunks ``j`` with ``j % num_workers == w``. A ``DataLoader`` asks its
   workers for batches round-robin (worker 0, 1, ..., in order) and yields them in that order,
   so the batches it yields are chunks 0, 1, 2, ... : the yielded stream *is* ``S``. Hence
   "consumed" is a prefix of ``S`` whatever the worker count, and resuming with any number of
   workers (or batch size) only needs ``consumed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

import numpy as np

__all__ = ["Plan", "global_order", "plan"]

Policy = Literal["drop", "pad"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on a uint64 array (wrapping arithmetic; arrays never warn)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _keys(seed: int, epoch: int, stream: int, n: int) -> np.ndarray:
    base = np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    for v in (epoch, stream):
        base = _splitmix(base ^ np.array([v & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    return _splitmix(np.arange(n, dtype=np.uint64) ^ _splitmix(base))


def _window_order(keys: np.ndarray, buf: int) -> np.ndarray:
    """Returns ``np.lexsort((keys, np.arange(n) // buf))`` for ``(n,)`` distinct ``keys``:
    each window of ``buf`` positions sorted by key, windows in place; one sort per row of the
    windows instead of a lexsort over all of them. The keys are distinct (``_keys``: SplitMix64
    of distinct inputs, a bijection on uint64), so the default (unstable, 4-5x faster than
    ``kind="stable"`` here) sort gives the stable order."""
    n = len(keys)
    full = n // buf * buf
    order = np.empty(n, dtype=np.int64)
    if full:
        rows = np.argsort(keys[:full].reshape(-1, buf), axis=1)
        order[:full] = (rows + np.arange(0, full, buf, dtype=np.int64)[:, None]).reshape(-1)
    order[full:] = np.argsort(keys[full:]) + full
    return order


class Plan(NamedTuple):
    """What one worker of one rank yields this epoch (after ``consumed``).

    ``ids``: ``(m,)`` int64 global sample ids in yield order; ``padded``: ``(m,)`` bool, True
    for ids repeated by ``policy="pad"``; ``positions``: ``(m,)`` int64 index of each item in
    the rank's remaining stream ``S``; ``remaining``: ``len(S)`` (equal on every rank).
    """

    ids: np.ndarray
    padded: np.ndarray
    positions: np.ndarray
    remaining: int


def _check_int(name: str, value: object, low: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
        raise ValueError(f"plan({name}=...): expected an int >= {low}, got {value!r}")
    return int(value)


def global_order(
    *,
    seed: int,
    epoch: int,
    shard_sizes: int | Sequence[int],
    shuffle: bool = True,
    shuffle_buffer: int | None = None,
    exclude: Iterable[int] = (),
) -> np.ndarray:
    """Returns the epoch's global order ``G``: ``(N,)`` int64 sample ids (step 1 of ``plan``).

    Sample ids number the samples of all shards in manifest order. ``shuffle_buffer``
    defaults to twice the largest shard.

    Example:
        >>> sorted(global_order(seed=0, epoch=0, shard_sizes=[3, 2]).tolist())
        [0, 1, 2, 3, 4]
    """
    sizes = [shard_sizes] if isinstance(shard_sizes, int | np.integer) else list(shard_sizes)
    for s in sizes:
        _check_int("shard_sizes", s, 0)
    n = int(sum(sizes))
    starts = np.cumsum([0, *sizes])
    if shuffle and len(sizes) > 0:
        shard_order = np.argsort(_keys(seed, epoch, 1, len(sizes)))  # distinct keys
        g = np.concatenate(
            [np.arange(starts[s], starts[s + 1], dtype=np.int64) for s in shard_order]
        )
        buf = shuffle_buffer if shuffle_buffer is not None else 2 * max(max(sizes), 1)
        buf = _check_int("shuffle_buffer", buf, 1)
        g = g[_window_order(_keys(seed, epoch, 2, n), buf)]
    else:
        g = np.arange(n, dtype=np.int64)
    excl = np.fromiter(exclude, dtype=np.int64)
    if excl.size:
        g = g[~np.isin(g, excl)]
    return g


def plan(
    *,
    seed: int,
    epoch: int,
    shard_sizes: int | Sequence[int],
    world_size: int = 1,
    rank: int = 0,
    num_workers: int = 1,
    worker_id: int = 0,
    batch_size: int = 1,
    consumed: int = 0,
    shuffle: bool = True,
    shuffle_buffer: int | None = None,
    policy: Policy = "drop",
    exclude: Iterable[int] = (),
) -> Plan:
    """Returns the ``Plan`` (sample ids, pad flags, positions) of one worker of one rank.

    Pure and deterministic: the same arguments give the same ids on every machine.
    Guarantees, for a fixed (seed, epoch, shard_sizes, world_size, policy):

    - **exactly once**: over all ranks and workers, every non-excluded sample appears once
      (``"pad"``; the ``padded`` repeats are flagged), or at most once with at most
      ``world_size - 1`` samples left out (``"drop"``; which ones changes per epoch);
    - **equal lengths**: ``remaining`` is the same on every rank;
    - **resume**: the ids for ``consumed=c`` are those for ``consumed=0`` after skipping the
      first ``c / world_size`` items of each rank stream, for any ``num_workers`` and
      ``batch_size`` (``c`` a multiple of ``world_size``: ranks step in lockstep). Resumes chain:
      consuming ``a`` then ``b`` more is resuming at ``a + b``.

    Args:
        seed, epoch: the shuffle seed and the epoch (``set_epoch``).
        shard_sizes: samples per shard (manifest order); an int means one shard.
        world_size, rank: the distributed layout. num_workers, worker_id: the DataLoader's.
        batch_size: chunk size of the round-robin over workers; must equal the DataLoader's
            batch size (or the batch size of a dataset that yields batches).
        consumed: global number of items already consumed this epoch (all ranks).
        shuffle, shuffle_buffer: see ``global_order``. policy: ``"drop"`` or ``"pad"``.
        exclude: sample ids to leave out (e.g. corrupt samples found by ``verify_shards``).

    Example:
        >>> p = plan(seed=0, epoch=0, shard_sizes=10, world_size=2, rank=1, shuffle=False)
        >>> p.ids.tolist()
        [1, 3, 5, 7, 9]
    """
    world_size = _check_int("world_size", world_size, 1)
    num_workers = _check_int("num_workers", num_workers, 1)
    batch_size = _check_int("batch_size", batch_size, 1)
    consumed = _check_int("consumed", consumed, 0)
    if not 0 <= rank < world_size:
        raise ValueError(f"plan(rank={rank}): expected 0 <= rank < world_size={world_size}")
    if not 0 <= worker_id < num_workers:
        raise ValueError(
            f"plan(worker_id={worker_id}): expected 0 <= worker_id < num_workers={num_workers}"
        )
    if policy not in ("drop", "pad"):
        raise ValueError(f"plan(policy={policy!r}): expected 'drop' or 'pad'")
    g = global_order(
        seed=seed, epoch=epoch, shard_sizes=shard_sizes, shuffle=shuffle,
        shuffle_buffer=shuffle_buffer, exclude=exclude,
    )
    r = g[consumed:]
    padded = np.zeros(len(r), dtype=bool)
    if policy == "drop":
        r = r[: len(r) // world_size * world_size]
        padded = padded[: len(r)]
    else:
        p = (-len(r)) % world_size
        r = np.concatenate([r, np.resize(g, p)])
        padded = np.concatenate([padded, np.ones(p, dtype=bool)])
    s, s_pad = r[rank::world_size], padded[rank::world_size]
    pos = np.arange(len(s), dtype=np.int64)
    mine = (pos // batch_size) % num_workers == worker_id
    return Plan(ids=s[mine], padded=s_pad[mine], positions=pos[mine], remaining=len(s))
