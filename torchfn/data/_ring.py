"""Batch blocks that DataLoader workers reuse: a ring of shared memory per worker process.

Sending a tensor from a DataLoader worker costs a file-descriptor hand-over per shared-memory
block (a socket connection to the worker's resource-sharer thread, answered only when that
thread gets the worker's GIL) plus mapping and page-faulting a fresh block on both sides. For
batches of a few MB that is most of an epoch's time on a small machine. Here each worker
process keeps, per block size class, one shared-memory region of ``n`` blocks that stays
mapped and populated in the worker and in the main process:

- ``take(nbytes)`` (worker) returns a free block as a uint8 tensor (``torch.from_numpy`` of a
  numpy view, so the worker knows when its last view dies); a batch built from such blocks is
  yielded as a :class:`RingBatch` (a ``dict``);
- pickled for a ``multiprocessing`` queue (``ForkingPickler``, which the DataLoader uses), a
  ``RingBatch`` becomes ``(ring id, block, offset, dtype, shape, stride)`` per tensor that lies
  in a ring block; the region itself (a torch shared storage) travels only until the main
  process says it has it. Other values pickle as usual. Any other pickling (``torch.save``,
  ``copy.deepcopy``) sees a plain ``dict`` subclass and copies the data;
- the main process rebuilds the tensors as views of its own mapping of the region and, when
  the last view of a block dies, counts the block released in the region's header.

A block is reused only when the worker holds no view of it and the main process has released
every hand-over of it (per-block counters, each written by one process). With no free block
``take`` returns None and the caller allocates a fresh shared block as before, so a consumer
holding many batches only costs speed. The header also says when the worker has exited (after
its queue flushed) and how many batches it sent, so the main process drops a region once all
of them arrived and died.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
import weakref
from multiprocessing import util as _mp_util
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

_MIN_BLOCK = 1 << 16
_MAX_BLOCK = 1 << 22  # bigger batches: the per-batch hand-over is a small part of their cost
_REGION = 1 << 25  # bytes of blocks per size class (at least _MIN_BLOCKS blocks)
_MIN_BLOCKS, _MAX_BLOCKS = 4, 16
_KEEP_CLOSED = 8  # closed regions whose hand-overs never all arrived: kept at most
# header words (int64): magic, closed (worker), registered (main), sent batches (worker),
# then sent[n] (worker) and released[n] (main)
_MAGIC, _CLOSED, _REGISTERED, _SENT = 0, 1, 2, 3
_WORDS = 4
_MAGIC_VALUE = 0x746F7263686672  # "torchfr"

_local = threading.local()  # .on: ring blocks allowed for this thread's allocations
_lock = threading.RLock()  # (re-entrant: a finalizer may run inside a locked section)
_rings: dict[int, _Ring] = {}  # worker side: block size -> ring
_pid = [0]  # the process the rings belong to (a forked child starts without them)


class _Mem:
    """Exposes a torch storage's bytes to numpy; arrays over it keep the storage alive."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage
        self.__array_interface__ = {"data": (storage.data_ptr(), False),
                                    "shape": (storage.nbytes(),), "typestr": "|u1",
                                    "version": 3}


def _layout(n: int, block: int) -> tuple[int, int, int, int]:
    """``(total bytes, header bytes, block bytes, blocks)`` of a region."""
    header = -(-8 * (_WORDS + 2 * n) // 4096) * 4096
    return header + n * block, header, block, n


class _Ring:
    """A worker's region of ``n`` blocks of ``block`` bytes."""

    def __init__(self, block: int, n: int) -> None:
        self.layout = _layout(n, block)
        total, self.header, self.block, self.n = self.layout
        proto = torch.empty(0, dtype=torch.uint8)
        self.storage = proto._typed_storage()._new_shared(total, device=proto.device)._untyped_storage
        self.whole = np.asarray(_Mem(self.storage))
        self.whole[:self.header] = 0
        self.words = self.whole[:self.header].view(np.int64)
        self.words[_MAGIC] = _MAGIC_VALUE
        self.sent = self.words[_WORDS:_WORDS + n]
        self.released = self.words[_WORDS + n:_WORDS + 2 * n]
        self.id = uuid.uuid4().hex
        self.base = self.storage.data_ptr()
        self.alive: set[int] = set()  # blocks with a live view in this process
        # after the DataLoader queue's feeder thread has flushed (its finalizer: priority -5)
        _mp_util.Finalize(self, _close, (self.words,), exitpriority=-10)

    def free(self) -> int | None:
        """The lowest free block: a loader's few batches in flight keep reusing the same
        blocks, so only those are ever touched (resident in shared memory)."""
        with _lock:
            for b in range(self.n):
                if b not in self.alive and self.sent[b] == self.released[b]:
                    return b
        return None

    def take(self, nbytes: int) -> torch.Tensor | None:
        with _lock:
            b = self.free()
            if b is None:
                return None
            self.alive.add(b)
        start = self.header + b * self.block
        view = self.whole[start:start + self.block].view()
        weakref.finalize(view, self._dead, b)
        return torch.from_numpy(view)[:nbytes]

    def _dead(self, b: int) -> None:
        with _lock:
            self.alive.discard(b)

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """``(block, byte offset in it)`` of a tensor whose elements all lie in one block."""
        if t.device.type != "cpu" or t.numel() == 0 or any(s < 0 for s in t.stride()):
            return None
        off = t.data_ptr() - self.base - self.header
        if off < 0:
            return None
        b, within = divmod(off, self.block)
        last = sum((d - 1) * s for d, s in zip(t.shape, t.stride(), strict=True))
        if b >= self.n or within + (last + 1) * t.element_size() > self.block:
            return None
        return b, within


def _close(words: np.ndarray) -> None:
    words[_CLOSED] = 1


def _size_class(nbytes: int) -> int | None:
    if nbytes > _MAX_BLOCK:
        return None
    return max(_MIN_BLOCK, 1 << (max(nbytes, 1) - 1).bit_length())


def active(nbytes: int) -> bool:
    """Whether ``take(nbytes)`` may serve this allocation (a worker, the ring enabled, a block
    size class for it)."""
    return (getattr(_local, "on", False) and _size_class(nbytes) is not None
            and get_worker_info() is not None)


def _ring_for(nbytes: int) -> _Ring | None:
    """This worker's ring for ``nbytes`` (made on first use), or None where none may serve."""
    if not active(nbytes):
        return None
    size = _size_class(nbytes)
    assert size is not None
    with _lock:
        if _pid[0] != os.getpid():  # inherited through fork: not this process's rings
            _rings.clear()
            _pid[0] = os.getpid()
        ring = _rings.get(size)
        if ring is None:
            ring = _rings[size] = _Ring(size, max(_MIN_BLOCKS, min(_MAX_BLOCKS, _REGION // size)))
    return ring


def has_free(nbytes: int) -> bool:
    """Whether ``take(nbytes)`` would return a block now (only this worker's own thread takes
    blocks, so a free block stays free until it does)."""
    ring = _ring_for(nbytes)
    return ring is not None and ring.free() is not None


def take(nbytes: int) -> torch.Tensor | None:
    """A ``(nbytes,)`` uint8 tensor in a reusable shared block, inside a DataLoader worker
    whose current allocation allows it (``enabled``); None otherwise (allocate as before)."""
    ring = _ring_for(nbytes)
    return None if ring is None else ring.take(nbytes)


class enabled:
    """Context manager: the allocations of this thread inside it may come from the ring."""

    def __enter__(self) -> None:
        self.prev = getattr(_local, "on", False)
        _local.on = True

    def __exit__(self, *exc: object) -> None:
        _local.on = self.prev


class RingBatch(dict):
    """A batch whose tensors may lie in ring blocks: a plain ``dict`` to every reader; a
    ``multiprocessing`` queue sends those tensors as block references (see the module)."""


def wrap(batch: Any) -> Any:
    """``batch`` as a :class:`RingBatch` when it is a plain dict and this process has rings."""
    if type(batch) is dict and _rings and _pid[0] == os.getpid():
        return RingBatch(batch)
    return batch


def _reduce(batch: RingBatch) -> tuple[Any, tuple[Any, ...]]:
    plain = (dict, (dict(batch),))
    if _pid[0] != os.getpid():
        return plain
    rings = list(_rings.values())
    blocks: dict[int, set[int]] = {}  # ring index -> blocks this batch refers to
    items = []
    for key, value in batch.items():
        ref = None
        if type(value) is torch.Tensor and not value.requires_grad:
            for r_i, ring in enumerate(rings):
                loc = ring.locate(value)
                if loc is not None:
                    b, within = loc
                    blocks.setdefault(r_i, set()).add(b)
                    ref = (r_i, b, within, value.dtype, tuple(value.shape), value.stride())
                    break
        items.append((key, ref, None if ref else value))
    if not blocks:
        return plain
    refs = []
    for r_i, bs in blocks.items():
        ring = rings[r_i]
        with _lock:
            for b in bs:
                ring.sent[b] += 1
            ring.words[_SENT] += 1
            registered = bool(ring.words[_REGISTERED])
        refs.append((r_i, ring.id, ring.layout, None if registered else ring.storage))
    return _rebuild, (refs, items)


ForkingPickler.register(RingBatch, _reduce)


# ------------------------------------------------------------------ main-process side

class _Region:
    """The main process's mapping of one worker region."""

    def __init__(self, storage: torch.UntypedStorage, layout: tuple[int, int, int, int]) -> None:
        total, self.header, self.block, self.n = layout
        if storage.nbytes() != total:
            raise RuntimeError(f"torchfn data ring: region of {storage.nbytes()} bytes, "
                               f"expected {total}")
        self.whole = np.asarray(_Mem(storage))
        self.words = self.whole[:self.header].view(np.int64)
        if int(self.words[_MAGIC]) != _MAGIC_VALUE:
            raise RuntimeError("torchfn data ring: the region's header is not a ring header")
        self.released = self.words[_WORDS + self.n:_WORDS + 2 * self.n]
        self.live = 0  # block views alive in this process
        self.received = 0  # batches rebuilt from it
        self.order = next(_order)

    def view(self, b: int) -> torch.Tensor:
        start = self.header + b * self.block
        base = self.whole[start:start + self.block].view()
        self.live += 1
        weakref.finalize(base, self._release, b)
        return torch.from_numpy(base)

    def _release(self, b: int) -> None:
        with _lock:
            self.released[b] += 1
            self.live -= 1

    def drained(self) -> bool:
        return bool(self.words[_CLOSED]) and self.live == 0 and self.received == int(
            self.words[_SENT])


_order = itertools.count()
_regions: dict[str, _Region] = {}  # main side: ring id -> region


def _sweep() -> None:
    """Drops regions whose worker exited and whose batches all arrived and died (and, beyond
    ``_KEEP_CLOSED``, the oldest closed regions with no live view: hand-overs that never
    arrive, from a loader shut down early)."""
    for rid in [rid for rid, r in _regions.items() if r.drained()]:
        del _regions[rid]
    idle = sorted((r.order, rid) for rid, r in _regions.items()
                  if r.words[_CLOSED] and r.live == 0)
    for _, rid in idle[:max(0, len(idle) - _KEEP_CLOSED)]:
        del _regions[rid]


def _rebuild(refs: list[Any], items: list[Any]) -> dict[str, Any]:
    regions = {}
    with _lock:
        for r_i, rid, layout, storage in refs:
            region = _regions.get(rid)
            if region is None:
                if storage is None:
                    raise RuntimeError(
                        "torchfn data ring: a batch refers to a worker's shared-memory region "
                        "this process never received (was a batch pickled for another "
                        "process?)")
                _sweep()
                region = _regions[rid] = _Region(storage, layout)
                region.words[_REGISTERED] = 1
            region.received += 1
            regions[r_i] = region
        out: dict[str, Any] = {}
        bases: dict[tuple[int, int], torch.Tensor] = {}
        for key, ref, value in items:
            if ref is None:
                out[key] = value
                continue
            r_i, b, within, dtype, shape, stride = ref
            base = bases.get((r_i, b))
            if base is None:
                base = bases[(r_i, b)] = regions[r_i].view(b)
            item = torch.empty(0, dtype=dtype).element_size()
            last = sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
            flat = base[within:within + (last + 1) * item].view(dtype)
            out[key] = flat.as_strided(shape, stride)
    return out
