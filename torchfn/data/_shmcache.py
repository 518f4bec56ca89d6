"""Decoded units shared by the processes reading one source (DataLoader workers).

Every worker of a ``StreamingDataset`` needs every locality unit once per epoch (its batches
come from every shuffle window), so a per-process cache decodes each Parquet row group once
per worker. This cache decodes it once per machine-wide group of processes: the first process
that needs unit ``u`` takes ``u``'s file lock, decodes it and writes its numeric columns as
``.npy`` files into a directory in shared memory (``/dev/shm``), the others wait on the lock
and memory-map those files. Files appear atomically (written to a temporary name, then
renamed; the column list last), so a reader sees a unit whole or not at all. A process that
evicts a unit from its own LRU deletes its column list and renames its column files into a
pool of free files, the ``free`` subdirectory (one that looks for the unit later decodes
again); the next unit written overwrites a free file instead of a new one, so its
shared-memory pages are reused rather than allocated and zero-filled (the cost that
dominates writing a decoded row group). A reader share-locks (``flock``) each file it maps
for as long as the map lives, and a writer takes a free file only under an exclusive lock
it gets at once, so no file is overwritten while a process still maps it. The directory is
removed when the process that created the source exits or drops it.
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
    page on first touch). The file is share-locked (``flock``) for as long as the map lives (the
    map keeps a duplicate of the descriptor), so no process recycles it meanwhile; raises
    ``FileNotFoundError`` when ``path`` was recycled between opening and locking."""
    with open(path, "rb") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_SH)
            if os.fstat(f.fileno()).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError(path)
        version = np.lib.format.read_magic(f)
        header = {(1, 0): np.lib.format.read_array_header_1_0,
                  (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if header is None:
            raise ValueError(f"{path}: .npy version {version}")
        shape, fortran, dtype = header(f)
        offset = f.tell()
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0 or dtype.hasobject:
            return np.load(path, allow_pickle=False).reshape(shape)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(f.fileno(), offset + count * dtype.itemsize, flags=flags,
                      prot=mmap.PROT_READ)
    a = np.frombuffer(m, dtype=dtype, count=count, offset=offset)
    return a.reshape(shape, order="F" if fortran else "C")


class SharedDecodeCache:
    """Shared ``{column: array or None}`` per unit; ``None`` where sharing is unavailable."""

    def __init__(self, owner_obj: Any, tag: str, free_files: int = 8) -> None:
        root = _shm_root()
        self.free_files = free_files  # evicted column files kept for recycling
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
                    self._write_npy(f"{unit}-{i}.npy", a)
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

    def _write_npy(self, name: str, a: np.ndarray) -> None:
        """Writes ``a`` as ``name`` (atomically), into a recycled file when one is free: its
        shared-memory pages are then overwritten, not allocated and zero-filled again."""
        assert self.path is not None
        f = self._take_free()
        if f is None:
            self._atomic(name, lambda f: np.save(f, a))
            return
        with f:  # exclusively locked until it has its new name
            # the raw file object: numpy writes the data straight from ``a`` (a wrapper or a
            # buffered read-write file would make it copy the array in chunks first)
            np.save(f.raw, a)
            f.truncate()
            f.flush()
            os.replace(f.name, os.path.join(self.path, name))

    def _take_free(self) -> Any:
        """Returns an evicted file no process maps (exclusively locked, renamed to a temporary
        name, opened for writing), or None."""
        assert self.path is not None
        free = os.path.join(self.path, "free")
        try:
            entries = os.listdir(free)
        except FileNotFoundError:
            return None
        for entry in entries:
            path = os.path.join(free, entry)
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a reader maps it
                if os.fstat(fd).st_ino != os.stat(path).st_ino:  # taken by another writer
                    raise BlockingIOError
                tmp = os.path.join(self.path, f".{uuid.uuid4().hex}.{os.getpid()}.tmp")
                os.replace(path, tmp)
            except (BlockingIOError, FileNotFoundError):
                os.close(fd)
                continue
            f = os.fdopen(fd, "r+b", buffering=0)
            return _Named(f, tmp)
        return None

    def evict(self, unit: int, columns: list[str]) -> None:
        """Drops unit ``unit``'s shared files (its column list first); its column files are
        kept for recycling (up to ``free_files`` of them; readers that still map one keep it
        locked, so it is reused only after them)."""
        if self.path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, f"{unit}.json"))
        # the free files in a directory of their own: counting them lists only them
        pool = os.path.join(self.path, "free")
        try:
            free = len(os.listdir(pool))
        except FileNotFoundError:
            try:
                os.mkdir(pool)
            except FileExistsError:
                pass
            except FileNotFoundError:  # the whole directory is gone
                return
            free = 0
        for i in range(len(columns)):
            path = os.path.join(self.path, f"{unit}-{i}.npy")
            with contextlib.suppress(FileNotFoundError):
                if free < self.free_files:
                    os.replace(path, os.path.join(pool, f"{uuid.uuid4().hex}.npy"))
                    free += 1
                else:
                    os.unlink(path)


class _Named:
    """A file object whose ``name`` is the path it was renamed to (``os.fdopen`` names it by
    its descriptor)."""

    def __init__(self, f: Any, name: str) -> None:
        self._f, self.name = f, name

    @property
    def raw(self) -> Any:
        """The file object itself (unbuffered: an ``io.FileIO``)."""
        return self._f

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._f, attr)

    def __enter__(self) -> _Named:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()
