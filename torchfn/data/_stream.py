"""StreamingDataset: an IterableDataset over shards whose order comes from ``plan``."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.ma  # np.unique imports it on first use (10-30 ms): forked workers inherit it
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from torchfn._checks import _check_rank

from . import _ring
from ._alloc import alloc_bytes as _alloc_bytes
from ._alloc import reserve_tail, take_tail
from ._plan import Policy, plan
from ._shards import (
    _DTYPES,
    CorruptShardError,
    ShardReader,
    VerifyReport,
    _manifest_mismatch,
    read_manifest,
    verify_shards,
)
from ._sources import SampleSource, ShardSource

__all__ = ["StreamingDataset", "StreamingLoader", "state_from_stateful_loader"]

_log = logging.getLogger("torchfn.data")
_META = ("id", "padded", "rank", "worker", "position")
# Samples at least this large are read with preadv into the batch (see benchmarks/README.md:
# for large samples faster than copying from a fresh memory map; for small ones slower).
_READ_MIN_BYTES = 16384


def _dist_layout() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


class StreamingDataset(IterableDataset):
    """Returns an ``IterableDataset`` that streams the shards in ``root`` in ``plan`` order.

    With ``batched=True`` (default, fastest) it yields batches ``{field: (b, *shape), "label":
    (b,)}`` of up to ``batch_size`` samples: use ``DataLoader(ds, batch_size=None, ...)`` (or
    ``StreamingLoader``). With ``batched=False`` it yields single samples: the DataLoader's
    ``batch_size`` must then equal ``batch_size`` (the worker round-robin is per batch). Pinned
    memory, prefetching and workers are the DataLoader's (``pin_memory=True``,
    ``prefetch_factor``, ``num_workers``); every worker memory-maps the shards itself.

    Progress (``state_dict``): ``{"epoch", "consumed", "seed", ...}``, ``consumed`` counting
    the items of the epoch consumed by all ranks together. It is tracked where batches are
    yielded: by the dataset itself when iterated in the main process (``num_workers=0``), by
    ``StreamingLoader`` (a DataLoader wrapper) with workers, and per worker under torchdata's
    ``StatefulDataLoader`` (whose ``state_dict`` restores the same worker count; for a new
    worker count use ``state_from_stateful_loader``). ``load_state_dict`` makes the *next*
    iteration start after ``consumed`` items; later iterations start at 0. ``set_epoch`` with a
    new epoch drops a pending resume; with the loaded epoch it keeps it. A state saved at the end
    of an epoch resumes with the (empty) rest of that epoch, so a loop that calls
    ``set_epoch(e)`` for every ``e`` from ``state["epoch"]`` on (or from ``state["epoch"] + 1``)
    yields exactly what an uninterrupted run yields; a worker whose share of the rest is empty
    (fewer batches left than workers) yields nothing.

    Args:
        root: a directory written by ``ShardWriter`` (or a ``ShardSource`` over one: the same),
            or any ``SampleSource`` (``NumpySource``, ``TarSource``, ...): the plan is the same,
            batches are the source's ``read(ids)`` plus ``"label"`` (when the source has
            labels), ``state_dict`` adds the source's ``"fingerprint"`` (checked on resume).
            ``verify``/``on_corrupt``/``verify()`` are the shards'; a source raises its own
            errors.
        batch_size: items per batch (also the worker round-robin unit).
        seed, shuffle, shuffle_buffer, policy: passed to ``plan``.
        world_size, rank: default to ``torch.distributed``'s when initialized, else 1 and 0.
        transform: per-sample ``dict -> dict`` hook (runs in the workers; with ``batched=True``
            it switches to per-sample assembly + ``default_collate``).
        batch_transform: ``dict -> dict`` hook on each assembled batch (``batched=True``).
        verify: check each sample's checksum (the algorithm its shard header names: xxh3_64,
            or crc32 for shards written with ``checksum="crc32"`` or before the field existed)
            when it is read.
        on_corrupt: ``"raise"`` (``CorruptShardError`` naming file and sample) or ``"skip"``.
            With ``"skip"``, shards with unreadable headers or truncated data are found at
            construction and left out of the plan (``skipped`` lists them); samples failing
            their checksum while streaming are dropped and logged (``torchfn.data`` logger),
            which shortens that rank's epoch: call ``verify()`` first to find them up front.
        meta: add ``"id"``, ``"padded"``, ``"rank"``, ``"worker"``, ``"position"`` to batches
            (``padded`` marks ``policy="pad"`` repeats, to mask them out of a loss).

    In DataLoader workers a batch from a source keeps its ``"label"`` in the shared-memory
    block of its first field (one block, one descriptor handed to the main process per
    batch): ``torch.save`` of the label tensor alone saves that block; ``clone()`` it first.

    Example:
        >>> import tempfile, torch
        >>> from torchfn.data._shards import ShardWriter
        >>> d = tempfile.mkdtemp()
        >>> with ShardWriter(d, samples_per_shard=4) as w:
        ...     for i in range(10):
        ...         w.write({"x": torch.full((2,), float(i))}, label=i % 3)
        >>> ds = StreamingDataset(d, batch_size=4, seed=0)
        >>> sorted(torch.cat([b["x"][:, 0] for b in ds]).int().tolist())
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | SampleSource,
        *,
        batch_size: int,
        batched: bool = True,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int | None = None,
        policy: Policy = "drop",
        world_size: int | None = None,
        rank: int | None = None,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        batch_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        verify: bool = True,
        on_corrupt: Literal["raise", "skip"] = "raise",
        meta: bool = False,
    ) -> None:
        super().__init__()
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(
                f"StreamingDataset(on_corrupt={on_corrupt!r}): expected 'raise' or 'skip'"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"StreamingDataset(batch_size=...): expected an int >= 1, got {batch_size!r}"
            )
        if isinstance(root, ShardSource):
            root = root.root
        self.source: SampleSource | None = None
        self._fingerprint: str | None = None
        if isinstance(root, str | os.PathLike):
            self.root: Path | None = Path(root)
            manifest = read_manifest(root)
            self.files = [str(self.root / s["file"]) for s in manifest["shards"]]
            self.shard_sizes = [int(s["num_samples"]) for s in manifest["shards"]]
            self.labels: np.ndarray | None = np.asarray(
                [lab for s in manifest["shards"] for lab in s["labels"]], dtype=np.int64
            )
        else:
            self._use_source(root, on_corrupt)
        self._starts = np.cumsum([0, *self.shard_sizes])
        self.num_samples = int(self._starts[-1])
        dw, dr = _dist_layout()
        self.world_size = dw if world_size is None else world_size
        self.rank = dr if rank is None else rank
        _check_rank(self.world_size, self.rank, "StreamingDataset")
        self.batch_size, self.batched, self.seed = batch_size, batched, seed
        self.shuffle, self.shuffle_buffer, self.policy = shuffle, shuffle_buffer, policy
        self.transform, self.batch_transform = transform, batch_transform
        self.verify_reads, self.on_corrupt, self.meta = verify, on_corrupt, meta
        self.epoch = 0
        self.skipped: list[tuple[int, str, int, str]] = []
        self._excluded: set[int] = set()
        if on_corrupt == "skip":
            self._exclude(verify_shards(root, full=False))
        self._resume = 0
        self._worker_resume: dict[str, int] | None = None
        self._progress = (0, 0, 0)  # (epoch, start consumed, items consumed on this rank)
        self._readers: dict[int, ShardReader] = {}

    def _use_source(self, source: Any, on_corrupt: str) -> None:
        if not isinstance(source, SampleSource):
            raise TypeError(
                "StreamingDataset(root=...): expected a shard directory or a SampleSource "
                "(len, shard_sizes, labels, read, read_sample, fingerprint, describe), got "
                f"{type(source).__name__}"
            )
        if on_corrupt != "raise":
            raise ValueError(
                f"StreamingDataset(on_corrupt={on_corrupt!r}): skipping applies to .tfs shard "
                f"directories; {source.describe()} raises its own errors"
            )
        self.source, self.root, self.files = source, None, []
        self.shard_sizes = [int(s) for s in source.shard_sizes]
        if sum(self.shard_sizes) != len(source):
            raise ValueError(
                f"StreamingDataset: {source.describe()} has shard_sizes summing to "
                f"{sum(self.shard_sizes)}, not its length {len(source)}"
            )
        labels = source.labels
        self.labels = None if labels is None else np.asarray(labels, dtype=np.int64)
        if self.labels is not None and self.labels.shape != (len(source),):
            raise ValueError(
                f"StreamingDataset: {source.describe()} has labels of shape "
                f"{self.labels.shape}, expected ({len(source)},)"
            )
        self._fingerprint = source.fingerprint()

    # ------------------------------------------------------------------ state
    def _exclude(self, report: VerifyReport) -> None:
        for b in report.bad:
            if b[0] not in self._excluded:
                self._excluded.add(b[0])
                self.skipped.append(b)

    def verify(self) -> VerifyReport:
        """Returns a full-checksum ``VerifyReport``; with ``on_corrupt="skip"`` excludes the bad ids.

        With ``on_corrupt="raise"`` a bad sample raises ``CorruptShardError``.
        """
        if self.root is None:
            raise ValueError(
                f"StreamingDataset.verify: checksums are the .tfs shards'; this dataset reads "
                f"{self.source.describe()}"  # type: ignore[union-attr]
            )
        report = verify_shards(self.root, full=True)
        if report.bad and self.on_corrupt == "raise":
            _, path, index, reason = report.bad[0]
            raise CorruptShardError(path, index, reason)
        self._exclude(report)
        return report

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (reshuffles); drops a pending resume unless it is for this epoch."""
        if epoch != self.epoch:
            self._resume, self._worker_resume = 0, None
            self._progress = (epoch, 0, 0)
        self.epoch = epoch

    def _plan(self, num_workers: int, worker_id: int, consumed: int):
        return plan(
            seed=self.seed, epoch=self.epoch, shard_sizes=self.shard_sizes,
            world_size=self.world_size, rank=self.rank, num_workers=num_workers,
            worker_id=worker_id, batch_size=self.batch_size, consumed=consumed,
            shuffle=self.shuffle, shuffle_buffer=self.shuffle_buffer, policy=self.policy,
            exclude=sorted(self._excluded),
        )

    def padded_ids(self) -> np.ndarray:
        """Returns the ids this rank repeats this epoch (``policy="pad"``), ``(p,)`` int64."""
        p = self._plan(1, 0, 0)
        return p.ids[p.padded]

    def __len__(self) -> int:
        """Number of batches (``batched=True``) or samples this rank yields in a full epoch."""
        n = self._plan(1, 0, 0).remaining
        return -(-n // self.batch_size) if self.batched else n

    def state_dict(self) -> dict[str, Any]:
        """Returns ``{"epoch", "consumed", "seed", "world_size", "batch_size", "num_samples"}``.

        Inside a DataLoader worker (StatefulDataLoader) it adds ``"worker"``: the worker's own
        position, and ``consumed`` is that worker's lower bound (the max over workers is exact).
        """
        epoch, start, items = self._progress
        consumed = start + self.world_size * items if epoch == self.epoch else self._resume
        sd: dict[str, Any] = {
            "epoch": self.epoch, "consumed": consumed, "seed": self.seed,
            "world_size": self.world_size, "batch_size": self.batch_size,
            "num_samples": self.num_samples,
        }
        if self._fingerprint is not None:
            sd["fingerprint"] = self._fingerprint
        if self._worker_state is not None:
            sd["worker"] = dict(self._worker_state)
        return sd

    _worker_state: dict[str, int] | None = None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Makes the next iteration resume at ``state["consumed"]`` of ``state["epoch"]``."""
        if int(state["num_samples"]) != self.num_samples or int(state["seed"]) != self.seed:
            raise ValueError(
                "StreamingDataset.load_state_dict: state is for num_samples="
                f"{state['num_samples']}, seed={state['seed']}; this dataset has "
                f"num_samples={self.num_samples}, seed={self.seed}"
            )
        fp = state.get("fingerprint")
        if fp is not None and self._fingerprint is not None and fp != self._fingerprint:
            raise ValueError(
                f"StreamingDataset.load_state_dict: state is for a source with fingerprint "
                f"{fp}; this dataset reads {self.source.describe()} with fingerprint "  # type: ignore[union-attr]
                f"{self._fingerprint} (the data changed)"
            )
        self.epoch = int(state["epoch"])
        self._resume = int(state["consumed"])
        self._progress = (self.epoch, self._resume, 0)
        w = state.get("worker")
        same_chunks = w is not None and w["batch_size"] == self.batch_size
        self._worker_resume = dict(w) if same_chunks else None

    # -------------------------------------------------------------- reading
    def _reader(self, shard: int) -> ShardReader:
        r = self._readers.get(shard)
        if r is None:
            r = ShardReader(self.files[shard])
            a, b = int(self._starts[shard]), int(self._starts[shard + 1])
            reason = _manifest_mismatch(r, b - a, self.labels[a:b].tolist())
            if reason is not None:
                raise CorruptShardError(r.path, None, reason)
            self._readers[shard] = r
        return r

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self._starts, ids, side="right") - 1
        return shard, ids - self._starts[shard]

    def _good(self, ids: np.ndarray) -> np.ndarray:
        """Returns a keep-mask over ``ids``; raises or logs corrupt samples."""
        keep = np.ones(len(ids), dtype=bool)
        if self.source is not None:  # a source raises its own errors when read
            return keep
        ok = np.zeros(len(ids), dtype=bool)  # samples known good: skip the per-sample loop
        shards, local = self._locate(ids)
        if not self.verify_reads:  # fast path: only the structural checks of the shards
            try:
                if not any(self._reader(s).bad for s in np.unique(shards).tolist()):
                    return keep
            except CorruptShardError:
                pass  # handled per sample below
        else:  # all checks at once per shard; only failures take the per-sample path below
            try:
                for s in np.unique(shards).tolist():
                    rows = np.flatnonzero(shards == s)
                    ok[rows] = self._reader(s).check_many(local[rows].tolist())
            except CorruptShardError:
                ok[:] = False
            if ok.all():
                return keep
        for j, (s, i) in enumerate(zip(shards.tolist(), local.tolist(), strict=True)):
            if ok[j]:
                continue
            try:
                r = self._reader(s)
            except CorruptShardError as e:
                err = CorruptShardError(e.path, i, f"shard header rejected ({e.reason})")
            else:
                if not self.verify_reads and i not in r.bad:
                    continue
                if r.check(i):
                    continue
                err = CorruptShardError(r.path, i, r.bad.get(i, r.mismatch))
            if self.on_corrupt == "raise":
                raise CorruptShardError(err.path, i, f"{err.reason}; global id {ids[j]}") from None
            keep[j] = False
            self.skipped.append((int(ids[j]), err.path, i, err.reason))
            _log.warning("skipped sample %d (%s, index %d): %s", ids[j], err.path, i, err.reason)
        return keep

    def _batch(self, ids: np.ndarray) -> dict[str, Any]:
        """Gathers a batch: fixed-shape fields stacked, ragged fields as lists of tensors."""
        if self.transform is not None:
            return self._collate_samples(ids)
        in_worker = get_worker_info() is not None
        if self.source is not None:
            if self.labels is None:
                return dict(self.source.read(ids))
            if not in_worker:
                return {**self.source.read(ids), "label": self._labels(ids, False)}
            # the labels go into the source's first batch buffer: one shared-memory block
            # (one descriptor handed to the main process) instead of two
            reserve_tail(8 * len(ids))
            try:
                out = dict(self.source.read(ids))
            finally:
                tail = take_tail()
            out["label"] = self._labels(ids, in_worker, tail)
            return out
        shards, local = self._locate(ids)
        uniq = np.unique(shards).tolist()
        readers = {s: self._reader(s) for s in uniq}
        out: dict[str, Any] = {}
        tail = None  # the labels, in the first field's block (one descriptor per batch)
        for name in readers[uniq[0]].fields:
            srcs = {s: r.fixed(name) for s, r in readers.items()}
            if any(v is None for v in srcs.values()) or len(
                {(v.shape[1:], v.dtype) for v in srcs.values()}  # type: ignore[union-attr]
            ) != 1:
                out[name] = [self._reader(s).sample(i, verify=False)[name]
                             for s, i in zip(shards.tolist(), local.tolist(), strict=True)]
                continue
            src0 = srcs[uniq[0]]
            shape = (len(ids), *src0.shape[1:])
            nbytes = int(np.prod(shape)) * src0.element_size()
            if tail is None and in_worker:
                start = -(-nbytes // 64) * 64
                block = _alloc_bytes(start + 8 * len(ids), True)
                tail, dst = block[start:], block[:nbytes].view(src0.dtype).view(shape)
            else:
                dst = _alloc_bytes(nbytes, in_worker).view(src0.dtype).view(shape)
            if len(uniq) == 1:
                torch.index_select(src0, 0, torch.from_numpy(local), out=dst)
            else:
                for s in uniq:
                    rows = np.flatnonzero(shards == s)
                    dst[torch.from_numpy(rows)] = srcs[s][torch.from_numpy(local[rows])]
            out[name] = dst
        out["label"] = self._labels(ids, in_worker, tail)
        return out

    def _labels(self, ids: np.ndarray, shared: bool,
                buf: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the ``(b,)`` int64 labels of ``ids`` (in shared memory in a worker, like the
        fields: a plain tensor would be copied into a new shared segment when sent), written
        into ``buf`` (``8 * b`` bytes) when given."""
        assert self.labels is not None
        out = (_alloc_bytes(8 * len(ids), shared) if buf is None else buf).view(torch.int64)
        np.take(self.labels, ids, out=out.numpy())
        return out

    def _read_batch(self, ids: np.ndarray) -> dict[str, Any] | None:
        """Returns the batch of ``ids`` read with ``ShardReader.readinto``, or None.

        The fast path for shards of fixed-shape fields of at least ``_READ_MIN_BYTES`` bytes
        per sample (smaller samples share pages, so the memory map is cheaper there): the ids are sorted by (shard, index) and
        each run of consecutive samples is read with one ``preadv`` straight into the batch
        buffers (shared memory in a worker), checksums checked on the delivered bytes. None when
        it does not apply (ragged fields, shards that differ) or any sample failed: the caller
        then takes the per-sample path, which raises or skips with the usual messages.
        """
        if self.source is not None:
            return None
        shards, local = self._locate(ids)
        order = np.lexsort((local, shards))
        sorted_shards = shards[order]
        cuts = [0, *(np.flatnonzero(np.diff(sorted_shards)) + 1).tolist(), len(ids)]
        try:
            readers = [self._reader(int(sorted_shards[a])) for a in cuts[:-1]]
        except CorruptShardError:
            return None
        layout = readers[0].layout
        if layout is None or sum(m[3] for m in layout) < _READ_MIN_BYTES:
            return None
        key = [(name, dt, shape, nb) for name, dt, shape, nb, _ in layout]
        for r in readers[1:]:
            if r.layout is None or [(a, b, c, d) for a, b, c, d, _ in r.layout] != key:
                return None
        n = len(ids)
        shared = get_worker_info() is not None
        starts, total = {}, 0  # the fields and the labels in one block: one descriptor
        for name, _dt, _shape, nb in key:
            starts[name], total = total, total + -(-(n * nb) // 64) * 64
        block = _alloc_bytes(total + 8 * n, shared)
        bufs = {name: block[starts[name]:starts[name] + n * nb] for name, _dt, _shape, nb in key}
        views = {name: memoryview(b.numpy()) for name, b in bufs.items()}
        for r, a, b in zip(readers, cuts[:-1], cuts[1:], strict=True):
            rows = order[a:b]
            if r.readinto(local[rows].tolist(), rows.tolist(), views, verify=self.verify_reads):
                return None
        out: dict[str, Any] = {
            name: bufs[name].view(_DTYPES[dt]).view(n, *shape) for name, dt, shape, _nb in key
        }
        out["label"] = self._labels(ids, shared, block[total:])
        return out

    def _collate_samples(self, ids: np.ndarray) -> dict[str, Any]:
        """``default_collate`` of the transformed samples; in a worker, a field whose values are
        all tensors of one shape and dtype (or all Python ints) is stacked into a shared block
        of its own (a ring block when one is free: sent as a reference, not a descriptor)."""
        samples = [self._sample(int(i)) for i in ids]
        if get_worker_info() is None or not samples or not all(
                type(smp) is dict and smp.keys() == samples[0].keys() for smp in samples):
            return default_collate(samples)
        out: dict[str, Any] = {}
        for key in samples[0]:
            vals = [smp[key] for smp in samples]
            v0 = vals[0]
            if all(type(v) is int for v in vals):  # default_collate: an int64 tensor
                dst = _alloc_bytes(8 * len(vals), True).view(torch.int64)
                dst.copy_(torch.tensor(vals, dtype=torch.int64))
            elif type(v0) is torch.Tensor and v0.device.type == "cpu" and all(
                    type(v) is torch.Tensor and v.shape == v0.shape and v.dtype == v0.dtype
                    and v.device == v0.device and not v.requires_grad for v in vals):
                nbytes = len(vals) * v0.numel() * v0.element_size()
                dst = _alloc_bytes(nbytes, True).view(v0.dtype).view(len(vals), *v0.shape)
                torch.stack(vals, out=dst)
            else:
                dst = default_collate(vals)
            out[key] = dst
        return out

    def _sample(self, gid: int) -> dict[str, Any]:
        if self.source is not None:
            sample = dict(self.source.read_sample(gid))
            if self.labels is not None:
                sample["label"] = int(self.labels[gid])
            return self.transform(sample) if self.transform is not None else sample
        s, i = self._locate(np.asarray([gid]))
        sample: dict[str, Any] = dict(self._reader(int(s[0])).sample(int(i[0]), verify=False))
        sample["label"] = int(self.labels[gid])
        return self.transform(sample) if self.transform is not None else sample

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        nw, wid = (1, 0) if info is None else (info.num_workers, info.id)
        start, self._resume = self._resume, 0
        wres, self._worker_resume = self._worker_resume, None
        first_chunk = 0
        if wres is not None and wres["num_workers"] == nw and wres["worker_id"] == wid:
            start, first_chunk = wres["base"], wres["next_chunk"]
        self._progress = (self.epoch, start, 0)
        p = self._plan(nw, wid, start)
        if not len(p.ids):  # nothing left for this worker: the epoch's rest is empty or short
            return
        chunk = p.positions // self.batch_size
        bounds = np.flatnonzero(np.diff(chunk)) + 1
        edges = [0, *bounds.tolist(), len(chunk)]
        # a source that decodes ahead (``prefetch``, optional) is told the next ids (a shuffle
        # window's worth, again each half window; it bounds what it starts); what is read does
        # not change
        ahead = getattr(self.source, "prefetch", None) if self.source is not None else None
        # in a worker, batch buffers may be blocks it reuses (``_ring``): the yielded dict
        # then reaches the main process as block references; a batch_transform may return
        # anything, so its batches keep fresh blocks
        ring = (_ring.enabled() if info is not None and self.batch_transform is None
                else contextlib.nullcontext())
        look = self.shuffle_buffer or 2 * max(max(self.shard_sizes, default=1), 1)
        told = -1
        for a, b in itertools.pairwise(edges):
            c = int(chunk[a])
            if c < first_chunk:
                continue
            if ahead is not None and a >= told:
                ahead(p.ids[a:a + look])
                told = a + max(look // 2, 1)
            ids, padded, pos = p.ids[a:b], p.padded[a:b], p.positions[a:b]
            batch = None
            if self.batched and self.transform is None and len(ids):
                with ring:
                    batch = self._read_batch(ids)
            if batch is None:
                keep = self._good(ids)
                if not keep.all():
                    ids, padded, pos = ids[keep], padded[keep], pos[keep]
            end = int(p.positions[b - 1]) + 1
            if info is not None:
                self._worker_state = {
                    "num_workers": nw, "worker_id": wid, "base": start,
                    "next_chunk": c + nw, "batch_size": self.batch_size,
                }
            self._progress = (self.epoch, start, end)
            if self.batched:
                if batch is None:
                    with ring:
                        batch = self._batch(ids) if len(ids) else {}
                if self.meta:
                    with ring:
                        batch.update(self._meta(ids, padded, pos, wid, info is not None))
                if self.batch_transform is not None:
                    batch = self.batch_transform(batch)
                yield _ring.wrap(batch)  # (unchanged outside a worker: no rings there)
            else:
                for j, gid in enumerate(ids.tolist()):
                    sample = self._sample(gid)
                    if self.meta:
                        sample.update({
                            "id": gid, "padded": bool(padded[j]), "rank": self.rank,
                            "worker": wid, "position": int(pos[j]),
                        })
                    yield sample

    def _meta(self, ids: np.ndarray, padded: np.ndarray, pos: np.ndarray, wid: int,
              shared: bool = False) -> dict:
        """The ``meta`` fields of a batch: ``(b,)`` int64 ``id``, ``rank``, ``worker``,
        ``position`` and bool ``padded``, in one block (one shared-memory block in a worker,
        sent as one)."""
        n = len(ids)
        block = _alloc_bytes(33 * n, shared)
        ints = block[:32 * n].view(torch.int64).view(4, n)
        ints[0].copy_(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
        ints[1].fill_(self.rank)
        ints[2].fill_(wid)
        ints[3].copy_(torch.from_numpy(np.asarray(pos, dtype=np.int64)))
        flags = block[32 * n:].view(torch.bool)
        flags.copy_(torch.from_numpy(np.asarray(padded, dtype=np.bool_)))
        return {"id": ints[0], "padded": flags, "rank": ints[1], "worker": ints[2],
                "position": ints[3]}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = {}  # memory maps are reopened in each worker
        return state


def _batch_len(batch: Any) -> int:
    """Returns the number of items in a yielded batch (1 for a non-dict item)."""
    if not isinstance(batch, Mapping) or not batch:
        return 1
    for key in ("label", "id"):
        if key in batch:
            return len(batch[key])
    return len(next(iter(batch.values())))


class StreamingLoader:
    """Returns an iterable DataLoader over a ``StreamingDataset`` that tracks consumed items.

    It builds ``DataLoader(dataset, batch_size=..., **dataloader_kwargs)`` (batch size None for
    ``batched=True`` datasets, else the dataset's) and counts, in the main process, the
    samples of every batch it yields, so ``state_dict()`` is exact with any ``num_workers``.
    Resume: ``loader.load_state_dict(sd)`` (any worker count), then iterate.

    Example:
        >>> import tempfile, torch
        >>> from torchfn.data._shards import ShardWriter
        >>> d = tempfile.mkdtemp()
        >>> with ShardWriter(d, samples_per_shard=4) as w:
        ...     for i in range(10):
        ...         w.write({"x": torch.zeros(2)}, label=0)
        >>> loader = StreamingLoader(StreamingDataset(d, batch_size=4, shuffle=False))
        >>> it = iter(loader); _ = next(it)
        >>> loader.state_dict()["consumed"]
        4
    """

    def __init__(self, dataset: StreamingDataset, **dataloader_kwargs: Any) -> None:
        self.dataset = dataset
        bs = None if dataset.batched else dataset.batch_size
        if dataloader_kwargs.get("batch_size", bs) != bs:
            raise ValueError(
                f"StreamingLoader(batch_size={dataloader_kwargs['batch_size']}): the dataset's "
                f"batch_size={dataset.batch_size} (batched={dataset.batched}) needs {bs}"
            )
        dataloader_kwargs["batch_size"] = bs
        if dataloader_kwargs.get("persistent_workers"):
            raise ValueError(
                "StreamingLoader(persistent_workers=True): persistent workers keep their own "
                "copy of the dataset and would not see set_epoch/load_state_dict; leave it False"
            )
        self.num_workers = int(dataloader_kwargs.get("num_workers", 0))
        self.loader = DataLoader(dataset, **dataloader_kwargs)

    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        start = max(ds._resume, 0)
        it = iter(self.loader)  # workers took a copy with the pending resume
        if self.num_workers == 0:
            yield from it  # the dataset counts for itself in the main process
            return
        ds._resume, ds._worker_resume = 0, None
        items = 0
        ds._progress = (ds.epoch, start, 0)
        for batch in it:
            items += _batch_len(batch)
            ds._progress = (ds.epoch, start, items)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Returns the dataset's progress state (see ``StreamingDataset.state_dict``)."""
        return self.dataset.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes the next iteration after ``state["consumed"]`` items (any worker count)."""
        clean = {k: v for k, v in state.items() if k != "worker"}
        self.dataset.load_state_dict(clean)


def state_from_stateful_loader(loader_state: Mapping[str, Any]) -> dict[str, Any]:
    """Returns a ``StreamingDataset`` state (no worker part) from a ``StatefulDataLoader`` state.

    ``consumed`` is the max over the worker snapshots (each worker's lower bound), which is
    the exact prefix the loader yielded. Load it with ``StreamingDataset.load_state_dict`` to
    resume with a different number of workers.
    """
    states: list[Mapping[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, Mapping):
            if "consumed" in x and "num_samples" in x:
                states.append(x)
                return
            for v in x.values():
                walk(v)

    walk(loader_state)
    if not states:
        raise ValueError("state_from_stateful_loader: no StreamingDataset state found")
    best = max(states, key=lambda s: (s["epoch"], s["consumed"]))
    return {k: v for k, v in best.items() if k != "worker"}
