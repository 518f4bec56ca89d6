"""Audit mode: log (rank, worker, step, id) of what was consumed and check coverage/balance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._plan import Policy, plan

__all__ = ["AuditReport", "Auditor", "audit_plan"]


@dataclass(frozen=True)
class AuditReport:
    """Coverage, duplicate and class-balance check of one epoch.

    ``records``: ``(k, 5)`` int64 rows ``(rank, worker, step, id, padded)``. ``missing``: ids
    never seen; ``duplicates``: ids seen more than once outside ``policy="pad"`` repeats;
    ``rank_lengths``: items per rank; ``class_counts``/``expected_class_counts``: seen vs
    dataset label counts (padding excluded); ``max_class_deviation``: max over classes of
    ``|seen/expected - 1|``. ``ok``: no duplicates, equal rank lengths, and at most
    ``allowed_missing`` ids missing.
    """

    num_samples: int
    seen: int
    missing: tuple[int, ...]
    duplicates: tuple[int, ...]
    padded: int
    rank_lengths: dict[int, int]
    class_counts: dict[int, int]
    expected_class_counts: dict[int, int]
    max_class_deviation: float
    allowed_missing: int
    records: np.ndarray

    @property
    def ok(self) -> bool:
        return (
            not self.duplicates
            and len(set(self.rank_lengths.values())) <= 1
            and len(self.missing) <= self.allowed_missing
        )


def _report(
    records: np.ndarray, labels: np.ndarray, allowed_missing: int, world_size: int
) -> AuditReport:
    n = len(labels)
    ids, pad = records[:, 3], records[:, 4].astype(bool)
    real = ids[~pad]
    counts = np.bincount(real, minlength=n) if n else np.zeros(0, np.int64)
    lengths = {r: 0 for r in range(world_size)}
    for r, c in zip(*np.unique(records[:, 0], return_counts=True), strict=True):
        lengths[int(r)] = int(c)
    classes = np.unique(labels)
    seen_cls = np.bincount(labels[real], minlength=int(classes.max()) + 1) if n else []
    exp_cls = np.bincount(labels, minlength=int(classes.max()) + 1) if n else []
    cc = {int(c): int(seen_cls[c]) for c in classes}
    ec = {int(c): int(exp_cls[c]) for c in classes}
    dev = max((abs(cc[c] / ec[c] - 1.0) for c in ec if ec[c]), default=0.0)
    return AuditReport(
        num_samples=n, seen=int((counts > 0).sum()),
        missing=tuple(np.flatnonzero(counts == 0).tolist()),
        duplicates=tuple(np.flatnonzero(counts > 1).tolist()), padded=int(pad.sum()),
        rank_lengths=lengths, class_counts=cc, expected_class_counts=ec,
        max_class_deviation=float(dev), allowed_missing=allowed_missing, records=records,
    )


class Auditor:
    """Records what a loader yields and returns an ``AuditReport`` of the epoch.

    Feed it the batches of a ``StreamingDataset(meta=True)`` (their ``"id"``, ``"padded"``,
    ``"rank"``, ``"worker"`` entries); ``report`` gathers the records of all ranks when
    ``torch.distributed`` is initialized (collective: call it on every rank).

    Example:
        >>> import tempfile, torch
        >>> from torchfn.data._shards import ShardWriter
        >>> from torchfn.data._stream import StreamingDataset
        >>> d = tempfile.mkdtemp()
        >>> with ShardWriter(d, samples_per_shard=4) as w:
        ...     for i in range(10):
        ...         w.write({"x": torch.zeros(1)}, label=i % 2)
        >>> ds = StreamingDataset(d, batch_size=3, meta=True)
        >>> audit = Auditor()
        >>> for batch in ds:
        ...     audit.record(batch)
        >>> audit.report(ds.labels).ok
        True
    """

    def __init__(self) -> None:
        self._rows: list[np.ndarray] = []
        self.step = 0

    def record(self, batch: Mapping[str, Any]) -> None:
        """Logs one yielded batch as rows (rank, worker, step, id, padded); returns nothing."""
        ids = torch.as_tensor(batch["id"]).reshape(-1).numpy()
        k = len(ids)

        def col(key: str) -> np.ndarray:
            return torch.as_tensor(batch[key]).reshape(-1).numpy().astype(np.int64)

        rows = np.stack(
            [col("rank"), col("worker"), np.full(k, self.step, np.int64), ids.astype(np.int64),
             col("padded")], 1,
        )
        self._rows.append(rows)
        self.step += 1

    def records(self) -> np.ndarray:
        """Returns this process's ``(k, 5)`` int64 records."""
        return np.concatenate(self._rows) if self._rows else np.zeros((0, 5), np.int64)

    def report(
        self, labels: Sequence[int] | np.ndarray, *, allowed_missing: int = 0,
        world_size: int | None = None,
    ) -> AuditReport:
        """Returns the ``AuditReport`` over all ranks (gathered when distributed)."""
        rec = self.records()
        ws = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ws = torch.distributed.get_world_size()
            parts: list[Any] = [None] * ws
            torch.distributed.all_gather_object(parts, rec)
            rec = np.concatenate(parts)
        return _report(rec, np.asarray(labels, np.int64), allowed_missing, world_size or ws)


def audit_plan(
    *,
    seed: int,
    epoch: int,
    shard_sizes: int | Sequence[int],
    labels: Sequence[int] | np.ndarray,
    world_size: int = 1,
    num_workers: int = 1,
    batch_size: int = 1,
    consumed: int = 0,
    policy: Policy = "drop",
    shuffle: bool = True,
    shuffle_buffer: int | None = None,
) -> AuditReport:
    """Returns the ``AuditReport`` of ``plan`` itself, over every rank and worker (no data read).

    ``step`` in the records is the batch index a DataLoader would yield it at.

    Example:
        >>> audit_plan(seed=0, epoch=0, shard_sizes=10, labels=[0] * 10, world_size=3,
        ...            shuffle=False).missing
        (9,)
    """
    rows = []
    for r in range(world_size):
        for w in range(num_workers):
            p = plan(
                seed=seed, epoch=epoch, shard_sizes=shard_sizes, world_size=world_size, rank=r,
                num_workers=num_workers, worker_id=w, batch_size=batch_size, consumed=consumed,
                shuffle=shuffle, shuffle_buffer=shuffle_buffer, policy=policy,
            )
            k = len(p.ids)
            rows.append(np.stack([
                np.full(k, r), np.full(k, w), p.positions // batch_size, p.ids,
                p.padded.astype(np.int64),
            ], 1).astype(np.int64))
    rec = np.concatenate(rows) if rows else np.zeros((0, 5), np.int64)
    allowed = world_size - 1 if policy == "drop" else 0
    return _report(rec, np.asarray(labels, np.int64), allowed + consumed, world_size)
