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
dominates writing a decoded row group). A decoder that can write its values where it is told
(``get(..., into=True)``: the fast Parquet decoder) decodes straight into a file mapped from
that pool (or a new one) at its temporary name, which is then renamed as written, so a
row group's values are copied once (page to shared memory) rather than decoded into memory
of their own and written again. A reader share-locks (``flock``) each file it maps
for as long as the map lives, and a writer takes a free file only under an exclusive lock
it gets at once, so no file is overwritten while a process still maps it. The directory is
removed when the process that created the source exits or drops it.
"""

from __future__ import annotations

import contextlib
import io
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
            decode: Callable[..., dict[str, np.ndarray | None]],
            wait: bool = True, into: bool = False) -> dict[str, np.ndarray | None] | None:
        """Returns unit ``unit``'s decoded columns: mapped from shared memory, or decoded here
        (``decode()``) and shared. ``wait=False``: None instead of waiting while another
        process (or thread) decodes it.

        ``into=True``: ``decode`` is called as ``decode(alloc)``, and ``alloc(column, shape,
        dtype)`` (or None) returns a writable array mapped from a new ``.npy`` file of the
        cache (a recycled one when one is free) for the decoder to write the column into; a
        returned column that is that array (the same memory, shape and dtype) is published
        by renaming its file, without being written again. ``decode()`` without sharing."""
        if self.path is None:
            return decode(None) if into else decode()
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
                if not into:
                    arrays = decode()
                    placed: dict[int, _Placed] = {}
                else:
                    placed = {}
                    try:
                        arrays = decode(lambda c, shape, dtype: self._place(
                            placed, columns, c, shape, dtype))
                    except BaseException:
                        for p in placed.values():
                            p.discard()
                        raise
                shared = []
                for i, c in enumerate(columns):
                    a = arrays[c]
                    p = placed.pop(i, None)
                    if p is not None and p.holds(a):
                        p.publish(os.path.join(self.path, f"{unit}-{i}.npy"))
                    else:
                        if p is not None:
                            p.discard()
                        if a is None:
                            continue
                        self._write_npy(f"{unit}-{i}.npy", a)
                    shared.append(c)
                for p in placed.values():  # (columns asked for twice, or not in ``columns``)
                    p.discard()
                self._atomic(f"{unit}.json", lambda f: f.write(json.dumps(shared).encode()))
                return arrays
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _place(self, placed: dict[int, _Placed], columns: list[str], column: str,
               shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """``get``'s ``alloc``: a writable ``shape`` array of ``dtype`` mapped from a new
        ``.npy`` file at a temporary name (recycled when one is free; exclusively locked until
        it is published or discarded), or None."""
        assert self.path is not None
        dtype = np.dtype(dtype)
        if column not in columns or dtype.hasobject or int(np.prod(shape, dtype=np.int64)) == 0:
            return None
        i = columns.index(column)
        old = placed.pop(i, None)
        if old is not None:
            old.discard()
        f = self._take_free()
        if f is None:
            tmp = os.path.join(self.path, f".{uuid.uuid4().hex}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)  # (no other process knows the name yet)
        else:
            fd, tmp = os.dup(f.fileno()), f.name  # the duplicate keeps the lock
            f.close()
        try:
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(head, {
                "descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                "shape": tuple(int(s) for s in shape)})
            header = head.getvalue()
            size = len(header) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            # a recycled file keeps its shared-memory pages up to the new size
            os.ftruncate(fd, size)
            os.pwrite(fd, header, 0)
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        a = np.frombuffer(m, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)),
                          offset=len(header)).reshape(shape)
        placed[i] = _Placed(fd, tmp, a)
        return a

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


class _Placed:
    """A ``.npy`` file ``SharedDecodeCache.get`` maps for a decoder to write into: its
    descriptor (exclusively locked), temporary path and the array mapped from it."""

    def __init__(self, fd: int, tmp: str, array: np.ndarray) -> None:
        self.fd, self.tmp, self.array = fd, tmp, array

    def holds(self, a: np.ndarray | None) -> bool:
        """Whether ``a`` is the mapped array itself (its memory, shape and dtype)."""
        b = self.array
        return (isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.flags.c_contiguous
                and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])

    def publish(self, path: str) -> None:
        """Renames the file to ``path``; this process's maps of it keep it share-locked (as a
        reader's do), so it is not recycled while the decoded arrays live."""
        # the lock turned shared before the rename: no other process knows the file yet
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        os.replace(self.tmp, path)
        os.close(self.fd)  # the map holds a duplicate
        self.array = None  # type: ignore[assignment]

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)
        os.close(self.fd)
        self.array = None  # type: ignore[assignment]


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
