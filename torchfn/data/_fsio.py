"""File access for the sources: local paths through ``os``, URLs (``memory://``, ``file://``,
``s3://``, ...) through ``fsspec`` when it is installed (the ``remote`` extra).

Reads are byte ranges (``os.pread`` locally, the filesystem's ``cat_file(path, start, end)``
remotely), so tar members and ``.npy`` rows are read at random without fetching whole files.
"""

from __future__ import annotations

import glob
import io
import os
from typing import Any

import numpy as np

__all__ = ["RemoteNpy", "expand", "file_size", "is_url", "open_binary", "read_range", "url_fs"]


def is_url(path: Any) -> bool:
    """Returns True when ``path`` is a string with a protocol (``"memory://x.tar"``)."""
    return isinstance(path, str) and "://" in path


def url_fs(url: str, who: str = "torchfn.data") -> tuple[Any, str]:
    """Returns ``(filesystem, path)`` of a URL (needs ``fsspec``)."""
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"{who}({url!r}): reading URLs needs fsspec, which is not installed: "
            'pip install fsspec (or pip install "torchfn[remote]")'
        ) from None
    return fsspec.core.url_to_fs(url)


def expand(paths: Any, ext: str, who: str) -> list[str]:
    """Returns the files of ``paths`` (a file, a directory's ``*ext``, a glob, or a list of
    those; local paths or URLs), each glob sorted by name, the list's order kept."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    out: list[str] = []
    for p in items:
        p = str(p)
        if is_url(p):
            fs, path = url_fs(p, who)
            if fs.isdir(path):
                found = sorted(fs.glob(path.rstrip("/") + "/*" + ext))
            elif any(c in path for c in "*?["):
                found = sorted(fs.glob(path))
            else:
                found = [path] if fs.exists(path) else []
            found = [fs.unstrip_protocol(f) for f in found]
        elif os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*" + ext)))
        elif any(c in p for c in "*?["):
            found = sorted(glob.glob(p))
        else:
            found = [p]
        if not found:
            raise FileNotFoundError(f"{who}(paths={p!r}): no {ext} files match")
        out += found
    return out


def file_size(path: str) -> int:
    """Returns the size of a local file or URL in bytes."""
    if is_url(path):
        fs, p = url_fs(path)
        return int(fs.size(p))
    return os.path.getsize(path)


def open_binary(path: str) -> Any:
    """Returns a seekable binary file object of a local file or URL (close it)."""
    if is_url(path):
        fs, p = url_fs(path)
        return fs.open(p, "rb")
    return open(path, "rb")


def read_range(path: str, offset: int, n: int) -> bytes:
    """Returns bytes ``[offset, offset + n)`` of a URL (fewer at the end of the file)."""
    fs, p = url_fs(path)
    return bytes(fs.cat_file(p, start=offset, end=offset + n))


class RemoteNpy:
    """Returns an array-like over a ``.npy`` file at a URL: ``shape``, ``dtype``, ``ndim``,
    ``len`` and ``a[rows]`` (int array or slice), reading only those rows (byte ranges, one
    per run of consecutive rows). C order only; no pickled (object) arrays.

    Example:
        >>> import fsspec, io, numpy as np
        >>> buf = io.BytesIO(); np.save(buf, np.arange(8.0).reshape(4, 2))
        >>> fsspec.filesystem("memory").pipe("/doc/a.npy", buf.getvalue())
        >>> a = RemoteNpy("memory://doc/a.npy")
        >>> a.shape, a[np.array([3, 0])].tolist()
        ((4, 2), [[6.0, 7.0], [0.0, 1.0]])
    """

    def __init__(self, url: str) -> None:
        self.url = url
        fs, self._path = url_fs(url, "RemoteNpy")
        with fs.open(self._path, "rb") as fh:
            head = io.BytesIO(fh.read(1 << 16))
        try:
            version = np.lib.format.read_magic(head)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(head)
        except ValueError as e:
            raise ValueError(f"RemoteNpy({url!r}): not a readable .npy file: {e}") from None
        if dtype.hasobject or (fortran and len(shape) > 1):
            raise ValueError(
                f"RemoteNpy({url!r}): expected a C-order array of numbers, bools or strings, "
                f"got dtype {dtype}{' in Fortran order' if fortran else ''}"
            )
        self.shape = tuple(shape)
        self.dtype = dtype
        self.ndim = len(shape)
        self._offset = head.tell()
        self._row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: Any) -> np.ndarray:
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(len(self)))
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"RemoteNpy({self.url!r}): rows must lie in [0, {len(self)})")
        uniq = np.unique(rows)
        parts: list[bytes] = []
        if uniq.size:  # runs of consecutive rows: one byte range each
            breaks = np.flatnonzero(np.diff(uniq) != 1) + 1
            for run in np.split(uniq, breaks):
                a, b = int(run[0]), int(run[-1]) + 1
                data = read_range(self.url, self._offset + a * self._row, (b - a) * self._row)
                if len(data) != (b - a) * self._row:
                    raise ValueError(
                        f"RemoteNpy({self.url!r}) is truncated: rows [{a}, {b}) need "
                        f"{(b - a) * self._row} bytes, got {len(data)}"
                    )
                parts.append(data)
        out = np.frombuffer(b"".join(parts), dtype=self.dtype).reshape(-1, *self.shape[1:])
        return out[np.searchsorted(uniq, rows)].copy()
