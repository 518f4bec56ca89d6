"""Batch buffers in shared memory inside DataLoader workers (no copy when handed over).

Each shared-memory block a worker sends costs a file-descriptor hand-over to the main process,
so ``StreamingDataset`` puts a batch's labels in the block of its first field: it reserves
the labels' bytes (``reserve_tail``) before the source reads, and the source's first
``empty_batch`` allocates them at the end of its block (``take_tail`` returns them).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numpy as np
import torch
from torch.utils.data import get_worker_info

from . import _ring

_ALIGN = 64
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: map a block's pages in one call
_POPULATE_MIN = 1 << 16
_madvise: list = []  # [libc madvise or None], looked up on first use


def _populate(t: torch.Tensor) -> None:
    """Maps the pages of a fresh shared block up front (one call instead of a page fault per
    page when the batch is written); a no-op where the kernel or platform lacks it."""
    if not _madvise:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            except (OSError, AttributeError):
                fn = None
        _madvise.append(fn)
    if _madvise[0] is not None and _madvise[0](t.data_ptr(), t.numel(), _MADV_POPULATE_WRITE):
        _madvise[0] = None  # refused (an older kernel): do not ask again
_pending = threading.local()  # per thread: [tail bytes wanted, tail tensor or None]


def alloc_bytes(nbytes: int, shared: bool) -> torch.Tensor:
    """Returns an uninitialized ``(nbytes,)`` uint8 tensor, in shared memory when ``shared``."""
    if not shared:
        return torch.empty(nbytes, dtype=torch.uint8)
    reused = _ring.take(nbytes)  # a block the worker has sent before, still mapped everywhere
    if reused is not None:
        return reused
    # Allocated straight in shared memory, as default_collate does, so handing the batch to the
    # main process costs no extra copy (no public API for this).
    proto = torch.empty(0, dtype=torch.uint8)
    t = proto.new(proto._typed_storage()._new_shared(nbytes, device=proto.device))
    if nbytes >= _POPULATE_MIN:
        _populate(t)
    return t


def reserve_tail(nbytes: int) -> None:
    """Asks the next ``empty_batch`` of this thread to allocate ``nbytes`` more at the end of
    its block (``take_tail`` returns them as a ``(nbytes,)`` uint8 tensor)."""
    _pending.slot = [nbytes, None]


def take_tail() -> torch.Tensor | None:
    """Returns the bytes ``reserve_tail`` asked for, or None when no ``empty_batch`` took the
    reservation (then the caller allocates them itself); ends the reservation."""
    slot = getattr(_pending, "slot", None)
    _pending.slot = None
    return None if slot is None else slot[1]


def empty_batch(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Returns an uninitialized numpy array, in shared memory inside a DataLoader worker; turn
    it into the batch's tensor with ``batch_tensor`` (which keeps the shared memory)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    shared = get_worker_info() is not None
    slot = getattr(_pending, "slot", None)
    if slot is not None and slot[1] is None and shared:
        start = -(-nbytes // _ALIGN) * _ALIGN
        buf = alloc_bytes(start + slot[0], True)
        slot[1] = buf[start:]
        buf = buf[:nbytes]
    else:
        buf = alloc_bytes(nbytes, shared)
    return buf.numpy().view(dtype).reshape(shape)


def batch_tensor(a: np.ndarray) -> torch.Tensor:
    """Returns ``a`` (from ``empty_batch``) as a tensor on the same memory: a view of the
    shared-memory block where ``a`` is one, so sending it to the main process moves only a
    descriptor (``torch.from_numpy`` would make a private storage, which pickling copies into
    a new shared block)."""
    t = torch.from_numpy(a)
    root = a
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    if not isinstance(root, torch.Tensor) or not a.flags.c_contiguous:
        return t
    storage = root.untyped_storage()
    offset = a.__array_interface__["data"][0] - storage.data_ptr()
    if offset % a.dtype.itemsize or not 0 <= offset <= storage.nbytes() - a.nbytes:
        return t
    return torch.empty(0, dtype=t.dtype).set_(storage, offset // a.dtype.itemsize, t.shape)


_IOV_MAX = 1024  # Linux's limit on the buffers of one pwritev


def _memfd_ok() -> bool:
    return (hasattr(os, "memfd_create") and hasattr(os, "pwritev")
            and hasattr(torch.UntypedStorage, "_new_shared_fd_cpu"))


def gather_rows(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], n: int) -> np.ndarray | None:
    """Returns the ``(n, *row_shape)`` batch whose row ``dst[j]`` is ``src[rows[j]]`` for each
    ``(src, rows, dst)`` of ``parts`` (``src``: ``(k, *row_shape)`` C-contiguous arrays of one
    dtype; the ``dst`` positions cover ``0..n-1`` once), written in a DataLoader worker (Linux)
    straight from the sources into a fresh shared-memory file with ``pwritev`` (the kernel
    allocates the pages as it copies: no page faults, no zero fill, no temporary); the labels'
    reservation (``reserve_tail``) is honoured as ``empty_batch`` does. Returns None outside a
    worker, where there is no ``memfd_create``, or where a reused ring block is free
    (``_ring``: mapped and populated already, so a plain gather into it is cheaper): the caller
    then gathers into ``empty_batch``."""
    if n == 0 or get_worker_info() is None or not _memfd_ok():
        return None
    src0 = parts[0][0]
    row_shape, dtype = src0.shape[1:], src0.dtype
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    nbytes = n * row_bytes
    if row_bytes == 0 or any(src.shape[1:] != row_shape or src.dtype != dtype
                             or not src.flags.c_contiguous for src, _, _ in parts):
        return None
    slot = getattr(_pending, "slot", None)
    tail = slot is not None and slot[1] is None
    start = -(-nbytes // _ALIGN) * _ALIGN
    total = start + slot[0] if tail else nbytes  # type: ignore[index]
    if _ring.has_free(total):
        return None  # the caller's gather into ``empty_batch``, which takes that block
    which = np.empty(n, dtype=np.int64)  # part of each batch row
    srow = np.empty(n, dtype=np.int64)  # its row in that part
    views = []
    for k, (src, rows, dst) in enumerate(parts):
        views.append(memoryview(src.reshape(-1).view(np.uint8)))
        which[dst], srow[dst] = k, rows
    # runs of consecutive source rows (file order) go in one buffer
    cut = np.flatnonzero((np.diff(which) != 0) | (np.diff(srow) != 1)) + 1
    starts = np.concatenate(([0], cut))
    lens = np.diff(starts, append=n) * row_bytes  # bytes of each run
    first = srow[starts] * row_bytes
    bufs = [views[w][a:b] for w, a, b in zip(
        which[starts].tolist(), first.tolist(), (first + lens).tolist(), strict=True)]
    # bytes written by each pwritev of up to _IOV_MAX buffers
    wants = np.add.reduceat(lens, np.arange(0, len(lens), _IOV_MAX)).tolist()
    fd = os.memfd_create("torchfn-batch", getattr(os, "MFD_CLOEXEC", 0))
    try:
        os.ftruncate(fd, total)
        off = 0
        for i, want in zip(range(0, len(bufs), _IOV_MAX), wants, strict=True):
            chunk = bufs[i:i + _IOV_MAX]
            done = os.pwritev(fd, chunk, off)
            while done < want:  # a short write (rare): write the rest one buffer at a time
                rest = b"".join(bytes(b) for b in chunk)[done:]
                done += os.pwrite(fd, rest, off + done)
            off += want
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, total)  # maps a dup of fd
    finally:
        os.close(fd)
    buf = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (total,))
    if tail:
        slot[1] = buf[start:]  # type: ignore[index]
    return buf[:nbytes].numpy().view(dtype).reshape(n, *row_shape)
