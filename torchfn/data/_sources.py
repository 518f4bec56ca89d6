"""Sample sources: random-access readers that ``StreamingDataset`` streams in ``plan`` order.

A source numbers its samples ``0..len-1`` and reads any of them by id; the plan decides which
id goes to which rank, worker and batch, so every source streams each sample exactly once per
epoch and resumes mid-epoch exactly, as ``.tfs`` shards do. The protocol (``SampleSource``):

- ``len(source)``: the number of samples;
- ``shard_sizes``: how the ids split into locality units (files), summing to ``len``; the
  plan shuffles shards, then samples within windows of ``shuffle_buffer`` positions;
- ``labels``: ``(n,)`` int64 class labels, or None (no ``"label"`` in the batches);
- ``read(ids)``: the batch of the ``(b,)`` int64 ``ids``, in their order: ``{field: (b, *shape)
  tensor}`` for fields of one shape and dtype, else ``{field: list}``;
- ``read_sample(i)``: sample ``i`` as ``{field: value}``;
- ``fingerprint()``: a short string that changes when the data does (checked on resume);
- ``describe()``: a short description for error messages;
- optional ``prefetch(ids)``: a hint that ``ids`` are read next (``StreamingDataset`` passes
  about a shuffle window of its plan ahead); it must return at once and must not change what
  ``read`` returns (``ParquetSource`` decodes the row groups in a background thread).

Readers here: ``ShardSource`` (a ``.tfs`` directory: the adapter) and ``NumpySource`` (arrays,
memory maps, ``.npy`` paths); ``TarSource`` (webdataset-style tar shards) is in ``_tar.py``,
and, with ``pyarrow`` installed, ``ParquetSource`` and ``HFDiskSource``
(``Dataset.save_to_disk``) in ``_arrow.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ._alloc import batch_tensor, empty_batch
from ._fsio import RemoteNpy, expand, is_url
from ._shards import ShardReader, read_manifest

# Local arrays with rows at least this large are gathered straight into the batch buffer.
_DIRECT_ROW_BYTES = 4096

__all__ = ["NumpySource", "SampleSource", "ShardSource", "collate_values"]


@runtime_checkable
class SampleSource(Protocol):
    """The interface ``StreamingDataset`` reads samples through (see the module docstring)."""

    shard_sizes: Sequence[int]
    labels: np.ndarray | None

    def __len__(self) -> int: ...

    def read(self, ids: np.ndarray) -> dict[str, Any]: ...

    def read_sample(self, i: int) -> dict[str, Any]: ...

    def fingerprint(self) -> str: ...

    def describe(self) -> str: ...


def collate_values(values: Sequence[Any]) -> Any:
    """Returns ``values`` batched: a ``(b, *shape)`` tensor when they are tensors of one shape
    and dtype, a ``(b,)`` int64 / float64 tensor for Python ints / floats, else the list.

    Example:
        >>> collate_values([torch.zeros(2), torch.ones(2)]).shape
        torch.Size([2, 2])
        >>> collate_values([3, 4]).tolist(), collate_values(["a", "b"])
        ([3, 4], ['a', 'b'])
    """
    vals = list(values)
    if vals and all(isinstance(v, torch.Tensor) for v in vals):
        if len({(v.shape, v.dtype) for v in vals}) == 1:
            return torch.stack(vals)
        return vals
    if vals and all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        return torch.tensor(vals, dtype=torch.int64)
    if vals and all(isinstance(v, float) for v in vals):
        return torch.tensor(vals, dtype=torch.float64)
    return vals


def _check_labels(labels: Any, n: int, who: str) -> np.ndarray:
    lab = np.asarray(labels)
    if lab.ndim != 1 or len(lab) != n or not np.issubdtype(lab.dtype, np.integer):
        raise ValueError(
            f"{who}(labels=...): expected {n} integer labels (shape ({n},)), got dtype "
            f"{lab.dtype} shape {lab.shape}"
        )
    return lab.astype(np.int64)


def _digest(*parts: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
        h.update(b"\x00")
    return h.hexdigest()


def _as_ids(ids: Any) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


# ---------------------------------------------------------------------- .tfs shards
class ShardSource:
    """Returns a ``SampleSource`` over a ``.tfs`` shard directory written by ``ShardWriter``.

    ``StreamingDataset(ShardSource(root), ...)`` is ``StreamingDataset(root, ...)``: the same
    reads (memory maps, ``preadv`` batches, checksums, ``on_corrupt``) and the same state.
    ``read`` / ``read_sample`` check each sample's checksum and raise ``CorruptShardError``.

    Example:
        >>> import tempfile, torch
        >>> from torchfn.data import ShardWriter
        >>> d = tempfile.mkdtemp()
        >>> with ShardWriter(d, samples_per_shard=2) as w:
        ...     for i in range(3):
        ...         w.write({"x": torch.full((2,), float(i))}, label=i)
        >>> src = ShardSource(d)
        >>> len(src), src.shard_sizes, src.read([2, 0])["x"][:, 0].tolist()
        (3, [2, 1], [2.0, 0.0])
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        manifest = read_manifest(root)
        self._manifest = manifest
        self.files = [str(self.root / s["file"]) for s in manifest["shards"]]
        self.shard_sizes = [int(s["num_samples"]) for s in manifest["shards"]]
        self._starts = np.cumsum([0, *self.shard_sizes])
        self.labels: np.ndarray | None = np.asarray(
            [lab for s in manifest["shards"] for lab in s["labels"]], dtype=np.int64
        )
        self._readers: dict[int, ShardReader] = {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _reader(self, s: int) -> ShardReader:
        if s not in self._readers:
            self._readers[s] = ShardReader(self.files[s])
        return self._readers[s]

    def read_sample(self, i: int) -> dict[str, Any]:
        s = int(np.searchsorted(self._starts, i, side="right") - 1)
        return dict(self._reader(s).sample(int(i - self._starts[s])))

    def read(self, ids: Any) -> dict[str, Any]:
        samples = [self.read_sample(int(i)) for i in _as_ids(ids)]
        return {k: collate_values([s[k] for s in samples]) for k in samples[0]} if samples else {}

    def fingerprint(self) -> str:
        return _digest(json.dumps(self._manifest, sort_keys=True))

    def describe(self) -> str:
        return f"ShardSource({str(self.root)!r}: {len(self)} samples in {len(self.files)} shards)"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_readers": {}}


def _progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar on stderr, or None when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="sample")


# ---------------------------------------------------------------------- numpy
class NumpySource:
    """Returns a ``SampleSource`` over equal-length arrays: ``{field: (n, *shape)}``.

    Values may be ``np.ndarray``, ``np.memmap`` or paths to ``.npy`` files (opened with
    ``np.load(mmap_mode="r")``: only the rows a batch needs are read). A path may be an
    fsspec URL (``memory://``, ``file://``, ``s3://``, ...; needs ``fsspec``): the rows a
    batch needs are then read as byte ranges (``RemoteNpy``). ``labels``: ``(n,)``
    integers, a ``.npy`` path, or the name of one of ``arrays`` (that array then becomes the
    batches' ``"label"`` instead of a field). Batches hold ``(b, *shape)`` tensors (copies);
    string arrays come back as lists of ``str``.

    Example:
        >>> import numpy as np
        >>> src = NumpySource({"x": np.arange(12.0).reshape(6, 2), "y": np.arange(6) % 2},
        ...                   labels="y")
        >>> b = src.read([4, 1])
        >>> b["x"].tolist(), src.labels[[4, 1]].tolist(), sorted(b)
        ([[8.0, 9.0], [2.0, 3.0]], [0, 1], ['x'])
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray | str | os.PathLike[str]],
        *,
        labels: Any = None,
        shard_sizes: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(arrays, Mapping) or not arrays:
            raise ValueError(
                "NumpySource(arrays=...): expected a non-empty dict {field: array or .npy "
                f"path}}, got {type(arrays).__name__}"
            )
        self._paths: dict[str, str] = {}
        self.arrays: dict[str, np.ndarray] = {}
        for name, a in arrays.items():
            self.arrays[name] = self._open(name, a)
        if isinstance(labels, str) and labels in self.arrays:
            labels = self.arrays.pop(labels)
            if not self.arrays:
                raise ValueError("NumpySource(labels=...): the labels are the only array")
        elif isinstance(labels, str | os.PathLike):
            labels = self._open("labels", labels)
        if isinstance(labels, RemoteNpy):
            labels = labels[:]
        lengths = {name: len(a) for name, a in self.arrays.items()}
        n = next(iter(lengths.values()))
        if len(set(lengths.values())) != 1:
            raise ValueError(
                f"NumpySource(arrays=...): fields have different lengths {lengths}; every "
                "field needs one row per sample"
            )
        self.num_samples = n
        self.labels = None if labels is None else _check_labels(labels, n, "NumpySource")
        sizes = [n] if shard_sizes is None else [int(s) for s in shard_sizes]
        if sum(sizes) != n or any(s < 0 for s in sizes):
            raise ValueError(
                f"NumpySource(shard_sizes={list(shard_sizes or [])}): expected sizes >= 0 "
                f"summing to the {n} samples"
            )
        self.shard_sizes = sizes
        self._fp: str | None = None

    def _open(self, name: str, a: Any) -> np.ndarray:
        if isinstance(a, str | os.PathLike):
            self._paths[name] = str(a)
            try:
                a = _load_npy(str(a))
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"NumpySource: cannot open field {name!r} from {str(a)!r}: {e}"
                ) from e
        if not isinstance(a, np.ndarray | RemoteNpy):
            raise TypeError(
                f"NumpySource: field {name!r} must be an np.ndarray, np.memmap or .npy path, "
                f"got {type(a).__name__}"
            )
        if a.ndim == 0 or a.dtype.kind not in "biufcUS":
            raise ValueError(
                f"NumpySource: field {name!r} has dtype {a.dtype} and shape {a.shape}; expected "
                "an (n, ...) array of numbers, bools or strings"
            )
        return a

    def __len__(self) -> int:
        return self.num_samples

    def read(self, ids: Any) -> dict[str, Any]:
        ids = _as_ids(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise IndexError(
                f"{self.describe()}.read: ids must lie in [0, {self.num_samples}), got "
                f"[{ids.min()}, {ids.max()}]"
            )
        order = None
        out: dict[str, Any] = {}
        for name, a in self.arrays.items():
            row_bytes = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
            if isinstance(a, np.ndarray) and a.dtype.kind not in "US" and (
                    row_bytes >= _DIRECT_ROW_BYTES):
                # rows of a page or more: gathered in plan order straight into the batch
                # buffer (one copy; sorting would buy little read-ahead locality)
                dst = empty_batch((len(ids), *a.shape[1:]), a.dtype)
                np.take(a, ids, axis=0, out=dst, mode="clip")  # ids checked above
                out[name] = batch_tensor(dst)
                continue
            if order is None:  # rows in file order; put back after reading
                order = np.argsort(ids, kind="stable")
            rows = np.asarray(a[ids[order]])
            if a.dtype.kind in "US":
                back = np.empty_like(rows)
                back[order] = rows
                out[name] = back.tolist()
                continue
            # scattered back into plan order straight into the batch buffer (shared memory in
            # a DataLoader worker: no further copy when it is handed over)
            dst = empty_batch(rows.shape, rows.dtype)
            dst[order] = rows
            out[name] = batch_tensor(dst)
        return out

    def read_sample(self, i: int) -> dict[str, Any]:
        return {k: v[0] for k, v in self.read([i]).items()}

    def fingerprint(self) -> str:
        """Names, dtypes, shapes, labels and the first and last rows of each array."""
        if self._fp is None:
            parts: list[Any] = [self.num_samples, self.shard_sizes]
            for name, a in sorted(self.arrays.items()):
                k = min(len(a), 4)
                parts += [name, str(a.dtype), a.shape, np.ascontiguousarray(a[:k]).tobytes(),
                          np.ascontiguousarray(a[len(a) - k :]).tobytes()]
            if self.labels is not None:
                parts.append(self.labels.tobytes())
            self._fp = _digest(*parts)
        return self._fp

    def describe(self) -> str:
        fields = {k: self._paths.get(k, f"{v.dtype}{list(v.shape)}") for k, v in self.arrays.items()}
        return f"NumpySource({self.num_samples} samples, fields {fields})"

    def __getstate__(self) -> dict[str, Any]:
        # fields opened from .npy paths travel as their paths (a spawned worker maps the file
        # again instead of receiving a copy of the data)
        arrays = {k: (None if k in self._paths else v) for k, v in self.arrays.items()}
        return {**self.__dict__, "arrays": arrays}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for k, v in self.arrays.items():
            if v is None:
                self.arrays[k] = _load_npy(self._paths[k])


def _load_npy(path: str) -> np.ndarray | RemoteNpy:
    """A local ``.npy`` memory-mapped; a URL read by byte ranges (``RemoteNpy``)."""
    if is_url(path):
        return RemoteNpy(path)
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _expand(paths: Any, ext: str = ".tar", who: str = "TarSource") -> list[str]:
    return expand(paths, ext, who)
