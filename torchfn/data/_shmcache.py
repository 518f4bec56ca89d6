"""Decoded units shared by the processes reading one source (DataLoader workers).

Every worker of a ``StreamingDataset`` needs every locality unit once per epoch (its batches
come from every shuffle window), so a per-process cache decodes each Parquet row group once
per worker. This cache decodes it once per machine-wide group of processes: the first process
that needs unit ``u`` takes ``u``'s file lock, decodes it and writes its numeric columns as
``.npy`` files into a directory in shared memory (``/dev/shm``), the others wait on the lock
and memory-map those files. Files appear atomically (written to a temporary name, then
renamed; the column list last), so a reader sees a unit whole or not at all. A process that
evicts a unit from its own LRU deletes its files (a process still mapping them keeps reading
them: unlinked files live until unmapped; one that looks for them later decodes again). The
directory is removed when the process that created the source exits or drops it.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import fcntl
except ImportError:  # not on Windows: there the cache is per process
    fcntl = None  # type: ignore[assignment]


def _shm_root() -> str | None:
    for d in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(d) and os.access(d, os.W_OK):
            return d
    return None


def _remove_if_owner(path: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked worker that drops its copy leaves the directory
        shutil.rmtree(path, ignore_errors=True)


def _map_npy(path: str) -> np.ndarray:
    """Returns the ``.npy`` file at ``path`` as a read-only memory-mapped array, its pages
    mapped up front (``MAP_POPULATE`` where there is one: one call instead of a page fault per
    page on first touch)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        header = {(1, 0): np.lib.format.read_array_header_1_0,
                  (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if header is None:
            return np.load(path, mmap_mode="r")
        shape, fortran, dtype = header(f)
        offset = f.tell()
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0 or dtype.hasobject:
            return np.load(path, mmap_mode="r")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(f.fileno(), offset + nbytes, flags=flags, prot=mmap.PROT_READ)
    a = np.frombuffer(m, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)), offset=offset)
    return a.reshape(shape, order="F" if fortran else "C")


class SharedDecodeCache:
    """Shared ``{column: array or None}`` per unit; ``None`` where sharing is unavailable."""

    def __init__(self, owner_obj: Any, tag: str) -> None:
        root = _shm_root()
        self.owner = os.getpid()  # the process that made it (and removes the directory)
        self.path: str | None = None
        if fcntl is None or root is None:
            return
        self.path = os.path.join(root, f"torchfn-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        weakref.finalize(owner_obj, _remove_if_owner, self.path, os.getpid())

    def _load(self, unit: int, columns: list[str]) -> dict[str, np.ndarray | None] | None:
        assert self.path is not None
        try:
            with open(os.path.join(self.path, f"{unit}.json")) as f:
                shared = json.load(f)
            return {c: (_map_npy(os.path.join(self.path, f"{unit}-{i}.npy"))
                        if c in shared else None) for i, c in enumerate(columns)}
        except (FileNotFoundError, ValueError):
            return None

    def get(self, unit: int, columns: list[str],
            decode: Callable[[], dict[str, np.ndarray | None]],
            wait: bool = True) -> dict[str, np.ndarray | None] | None:
        """Returns unit ``unit``'s decoded columns: mapped from shared memory, or decoded here
        (``decode()``) and shared. ``wait=False``: None instead of waiting while another
        process (or thread) decodes it."""
        if self.path is None:
            return decode()
        hit = self._load(unit, columns)
        if hit is not None:
            return hit
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, f"{unit}.lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            try:
                hit = self._load(unit, columns)  # decoded by another process meanwhile
                if hit is not None:
                    return hit
                arrays = decode()
                shared = []
                for i, c in enumerate(columns):
                    a = arrays[c]
                    if a is None:
                        continue
                    self._atomic(f"{unit}-{i}.npy", lambda f, a=a: np.save(f, a))
                    shared.append(c)
                self._atomic(f"{unit}.json", lambda f: f.write(json.dumps(shared).encode()))
                return arrays
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _atomic(self, name: str, write: Callable[[Any], Any]) -> None:
        assert self.path is not None
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, os.path.join(self.path, name))

    def evict(self, unit: int, columns: list[str]) -> None:
        """Deletes unit ``unit``'s shared files (its column list first)."""
        if self.path is None:
            return
        for name in (f"{unit}.json", *(f"{unit}-{i}.npy" for i in range(len(columns)))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, name))
