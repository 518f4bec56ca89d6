"""Open any data path as a source, and look at it: ``detect_format``, ``open_source``,
``inspect_source``, ``source_stats``, ``verify_source`` (behind ``torchfn data ...``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import numpy as np
import torch

from ._arrow import HFDiskSource, ParquetSource
from ._fsio import expand, file_size, is_url, url_fs
from ._shards import VerifyReport, verify_shards
from ._sources import NumpySource, SampleSource, ShardSource, _progress_bar
from ._tar import TarError, TarSource

__all__ = ["DataInfo", "DataStats", "detect_format", "inspect_source", "open_source",
           "source_stats", "verify_source"]

FORMATS = ("tfs", "tar", "npy", "parquet", "hf")
_EXPECTED = (
    "a .tfs shard directory (manifest.json), a .tar file or a directory of .tar files, a .npy "
    "file or a directory of .npy files, a .parquet file or a directory of them, or a Hugging "
    "Face save_to_disk directory (state.json + *.arrow)"
)
_SUFFIX = {".tar": "tar", ".npy": "npy", ".parquet": "parquet"}


def _listing(path: str) -> tuple[bool, bool, list[str]]:
    """(exists, is a directory, names in it) of a local path or URL."""
    if is_url(path):
        fs, p = url_fs(path, "detect_format")
        if not fs.exists(p):
            return False, False, []
        if fs.isdir(p):
            return True, True, [PurePosixPath(n).name for n in fs.ls(p, detail=False)]
        return True, False, []
    if os.path.isdir(path):
        return True, True, os.listdir(path)
    return os.path.exists(path), False, []


def detect_format(path: str | os.PathLike[str]) -> str:
    """Returns the format of a data path: ``"tfs"``, ``"tar"``, ``"npy"``, ``"parquet"`` or
    ``"hf"`` (local path, glob or fsspec URL).

    A directory with ``manifest.json`` is ``tfs``; with ``state.json`` and ``*.arrow`` files
    (or ``dataset_dict.json``) ``hf``; else the extension of its files (``.tar``,
    ``.parquet``, ``.npy``, in that order). A file or glob goes by its extension.

    Example:
        >>> import tempfile, numpy as np
        >>> d = tempfile.mkdtemp(); np.save(d + "/x.npy", np.zeros(3))
        >>> detect_format(d), detect_format(d + "/x.npy")
        ('npy', 'npy')
    """
    p = str(path)
    name = PurePosixPath(p.split("://", 1)[-1]).name.lower()
    if any(c in name for c in "*?["):
        for suffix, fmt in _SUFFIX.items():
            if name.endswith(suffix):
                return fmt
        raise ValueError(f"detect_format({p!r}): a glob must end in one of {sorted(_SUFFIX)}")
    exists, isdir, names = _listing(p)
    if not exists:
        raise FileNotFoundError(f"detect_format({p!r}): no such file or directory")
    if isdir:
        if "manifest.json" in names:
            return "tfs"
        if "dataset_dict.json" in names or (
            "state.json" in names and any(n.endswith(".arrow") for n in names)
        ):
            return "hf"
        for suffix in (".tar", ".parquet", ".npy"):
            if any(n.endswith(suffix) for n in names):
                return _SUFFIX[suffix]
        seen = f"its entries are {sorted(names)[:8]}" if names else "it is empty"
        raise ValueError(f"detect_format({p!r}): a directory, but {seen}; expected {_EXPECTED}"
                         " (or pass format=..., --format on the command line)")
    for suffix, fmt in _SUFFIX.items():
        if name.endswith(suffix):
            return fmt
    if name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")):
        return "tar"  # TarSource refuses it, saying how to decompress it
    raise ValueError(f"detect_format({p!r}): unknown file type; expected {_EXPECTED} (or pass "
                     "format=..., --format on the command line)")


def open_source(
    path: str | os.PathLike[str], *, format: str = "auto", label: str | None = None
) -> SampleSource:
    """Returns the ``SampleSource`` reading ``path`` (a local path, glob or fsspec URL).

    ``format``: ``"auto"`` (``detect_format``) or one of ``"tfs"``, ``"tar"``, ``"npy"``,
    ``"parquet"``, ``"hf"``. ``label`` names the labels: the tar member extension (default
    ``"cls"``), the ``.npy`` array (a file stem of the directory; default none), the Parquet
    column (default none) or the HF column (default ``"label"`` when present); ``.tfs`` shards
    keep theirs in the manifest and refuse ``label``. A ``.npy`` directory gives one field per
    file, named by the file's stem.

    Example:
        >>> import tempfile, numpy as np
        >>> d = tempfile.mkdtemp()
        >>> np.save(d + "/x.npy", np.arange(4.0)); np.save(d + "/y.npy", np.arange(4) % 2)
        >>> src = open_source(d, label="y")
        >>> len(src), src.labels.tolist(), sorted(src.read([0]))
        (4, [0, 1, 0, 1], ['x'])
    """
    p = str(path)
    fmt = detect_format(p) if format == "auto" else format
    if fmt not in FORMATS:
        raise ValueError(f"open_source(format={format!r}): expected 'auto' or one of {FORMATS}")
    if fmt == "tfs":
        if label is not None:
            raise ValueError(f"open_source({p!r}, label={label!r}): .tfs shards keep their labels"
                             " in manifest.json; leave label out")
        return ShardSource(p)
    if fmt == "tar":
        return TarSource(p, label_ext="cls" if label is None else label)
    if fmt == "parquet":
        return ParquetSource(p, label_column=label)
    if fmt == "hf":
        return HFDiskSource(p, label_column="label" if label is None else label)
    files = expand(p, ".npy", "open_source")
    arrays = {PurePosixPath(f.split("://", 1)[-1]).name[: -len(".npy")]: f for f in files}
    if label is not None and label not in arrays:
        raise ValueError(f"open_source({p!r}, label={label!r}): no {label}.npy; the arrays are "
                         f"{sorted(arrays)}")
    return NumpySource(arrays, labels=label)


def _files(src: Any) -> list[str]:
    files = getattr(src, "files", None)
    if files is None:  # NumpySource: the .npy paths it opened
        files = list(getattr(src, "_paths", {}).values())
    return [str(f) for f in files]


def _describe_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')} {list(v.shape)}"
    return type(v).__name__


@dataclass(frozen=True)
class DataInfo:
    """Result of ``inspect_source``: format, sample count, fields, labels, files."""

    path: str
    format: str
    num_samples: int
    num_units: int
    fields: dict[str, str]  # field -> "dtype [shape]" of sample 0 (or the Python type)
    label_counts: dict[int, int] | None
    files: list[str]
    total_bytes: int


def inspect_source(
    path: str | os.PathLike[str], *, format: str = "auto", label: str | None = None
) -> DataInfo:
    """Returns a ``DataInfo`` of ``path``: its format, samples, fields (from sample 0), label
    counts and files with their total size, reading one sample.

    Example:
        >>> import tempfile, numpy as np
        >>> d = tempfile.mkdtemp()
        >>> np.save(d + "/x.npy", np.zeros((4, 3), np.float32)); np.save(d + "/y.npy", np.ones(4, int))
        >>> info = inspect_source(d, label="y")
        >>> info.format, info.num_samples, info.fields, info.label_counts
        ('npy', 4, {'x': 'float32 [3]'}, {1: 4})
    """
    p = str(path)
    fmt = detect_format(p) if format == "auto" else format
    src = open_source(p, format=fmt, label=label)
    first = src.read_sample(0) if len(src) else {}
    counts = None
    if src.labels is not None:
        values, n = np.unique(src.labels, return_counts=True)
        counts = {int(v): int(c) for v, c in zip(values, n, strict=True)}
    files = _files(src)
    return DataInfo(path=p, format=fmt, num_samples=len(src), num_units=len(src.shard_sizes),
                    fields={k: _describe_value(v) for k, v in first.items()},
                    label_counts=counts, files=files,
                    total_bytes=sum(file_size(f) for f in files))


@dataclass(frozen=True)
class DataStats:
    """Result of ``source_stats``: class counts, bytes per field, sample sizes in bytes."""

    num_samples: int
    label_counts: dict[int, int] | None
    field_bytes: dict[str, int]
    sample_bytes_min: int
    sample_bytes_mean: float
    sample_bytes_max: int


def _value_bytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, bytes | bytearray):
        return len(v)
    if isinstance(v, str):
        return len(v.encode())
    if isinstance(v, bool):
        return 1
    if isinstance(v, int | float):
        return 8
    return len(json.dumps(v, default=str).encode())


def source_stats(source: SampleSource, *, batch_size: int = 256,
                 progress: bool = False) -> DataStats:
    """Returns a ``DataStats`` of every sample of ``source``: class counts, the decoded bytes
    of each field summed over samples, and the min / mean / max bytes of one sample (all
    fields). Reads all the data once, in id order.

    Example:
        >>> import numpy as np
        >>> s = source_stats(NumpySource({"x": np.zeros((3, 2))}, labels=np.array([0, 1, 1])))
        >>> s.label_counts, s.field_bytes, s.sample_bytes_max
        ({0: 1, 1: 2}, {'x': 48}, 16)
    """
    n = len(source)
    field_bytes: dict[str, int] = {}
    sizes = np.zeros(n, dtype=np.int64)
    bar = _progress_bar(n, "stats") if progress else None
    for a in range(0, n, batch_size):
        ids = np.arange(a, min(a + batch_size, n), dtype=np.int64)
        for k, v in source.read(ids).items():
            if isinstance(v, torch.Tensor):
                per = np.full(len(ids), _value_bytes(v[0]), dtype=np.int64)
            else:
                per = np.asarray([_value_bytes(x) for x in v], dtype=np.int64)
            field_bytes[k] = field_bytes.get(k, 0) + int(per.sum())
            sizes[ids] += per
        if bar is not None:
            bar.update(len(ids))
    if bar is not None:
        bar.close()
    counts = None
    if source.labels is not None:
        values, c = np.unique(source.labels, return_counts=True)
        counts = {int(v): int(k) for v, k in zip(values, c, strict=True)}
    return DataStats(num_samples=n, label_counts=counts, field_bytes=field_bytes,
                     sample_bytes_min=int(sizes.min()) if n else 0,
                     sample_bytes_mean=float(sizes.mean()) if n else 0.0,
                     sample_bytes_max=int(sizes.max()) if n else 0)


def verify_source(
    path: str | os.PathLike[str], *, format: str = "auto", label: str | None = None
) -> VerifyReport:
    """Returns a ``VerifyReport`` of every sample of ``path`` that cannot be read:
    ``(id, file, index in file, reason)``.

    ``.tfs``: ``verify_shards(full=True)`` (every checksum). Other formats: every sample is
    read and decoded (for tar, every member; the reason names the member and the sample's
    key). Tar files are opened one by one: a file too damaged to open (truncated, unreadable
    header) is one entry with id and index ``-1`` and the ``TarError`` text, the others are
    still verified (ids then count the samples of the files that opened).

    Example:
        >>> import tempfile, numpy as np
        >>> d = tempfile.mkdtemp(); np.save(d + "/x.npy", np.zeros(3))
        >>> verify_source(d).ok
        True
    """
    p = str(path)
    fmt = detect_format(p) if format == "auto" else format
    if fmt == "tfs":
        return verify_shards(p, full=True)
    if fmt == "tar":
        bad: list[tuple[int, str, int, str]] = []
        total = 0
        for f in expand(p, ".tar", "verify_source"):
            try:
                src = TarSource(f, label_ext="cls" if label is None else label)
            except TarError as e:
                bad.append((-1, f, -1, str(e)))
                continue
            bad += [(total + i, file, j, why) for i, file, j, why in _verify(src)]
            total += len(src)
        return VerifyReport(num_samples=total, bad=tuple(bad))
    src = open_source(p, format=fmt, label=label)
    return VerifyReport(num_samples=len(src), bad=tuple(_verify(src)))


def _verify(src: SampleSource) -> list[tuple[int, str, int, str]]:
    files = _files(src)
    per_file = len(files) == len(src.shard_sizes)
    starts = np.cumsum([0, *src.shard_sizes])
    key = getattr(src, "key", None)
    bad: list[tuple[int, str, int, str]] = []
    for i in range(len(src)):
        try:
            src.read_sample(i)
        except Exception as e:  # a verifier reports every failure and goes on
            u = int(np.searchsorted(starts, i, side="right") - 1)
            where = f"sample {key(i)!r}: " if key is not None else ""
            bad.append((i, files[u] if per_file else src.describe(),
                        i - int(starts[u]) if per_file else i,
                        f"{where}{type(e).__name__}: {e}"))
    return bad
