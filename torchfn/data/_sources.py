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
- ``describe()``: a short description for error messages.

Readers here: ``ShardSource`` (a ``.tfs`` directory: the adapter), ``NumpySource`` (arrays,
memory maps, ``.npy`` paths), ``TarSource`` (webdataset-style tar shards), and, with
``pyarrow`` installed, ``ParquetSource`` and ``HFDiskSource`` (``Dataset.save_to_disk``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tarfile
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from ._alloc import empty_batch
from ._fsio import RemoteNpy, expand, file_size, is_url, open_binary, read_range
from ._shards import ShardReader, read_manifest
from ._shmcache import SharedDecodeCache

__all__ = [
    "HFDiskSource",
    "NumpySource",
    "ParquetSource",
    "SampleSource",
    "ShardSource",
    "TarError",
    "TarSource",
    "collate_values",
    "decode_member",
]


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
        order = np.argsort(ids, kind="stable")  # rows in file order; put back after reading
        out: dict[str, Any] = {}
        for name, a in self.arrays.items():
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
            out[name] = torch.from_numpy(dst)
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


# ---------------------------------------------------------------------- tar shards
def decode_member(ext: str, data: bytes) -> Any:
    """Returns a tar member's bytes decoded by its last extension (webdataset conventions).

    ``.npy`` -> tensor (``np.load``, no pickle), ``.pt``/``.pth`` -> ``torch.load(...,
    weights_only=True)``, ``.cls``/``.cls2``/``.index`` -> int, ``.txt`` -> str, ``.json`` ->
    parsed JSON, anything else -> the raw ``bytes``.

    Example:
        >>> decode_member("cls", b"7\\n"), decode_member("txt", b"hi"), decode_member("jpg", b"x")
        (7, 'hi', b'x')
    """
    last = ext.rsplit(".", 1)[-1].lower()
    if last == "npy":
        layout = _npy_layout(data)
        if layout is not None:
            return torch.from_numpy(_npy_payload(data, layout).copy())
        a = np.load(io.BytesIO(data), allow_pickle=False)  # raises naming what is wrong
        return torch.from_numpy(a if a.flags.writeable else a.copy())
    if last in ("pt", "pth"):
        return torch.load(io.BytesIO(data), weights_only=True)
    if last in ("cls", "cls2", "index"):
        return int(data.decode().strip())
    if last == "txt":
        return data.decode()
    if last == "json":
        return json.loads(data)
    return data


class _NpyLayout(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool
    offset: int  # payload start (the header's length)
    nbytes: int  # payload length


_NPY_MAGIC = b"\x93NUMPY"
_NPY_LAYOUTS: dict[bytes, _NpyLayout] = {}  # header bytes -> layout, per process


def _npy_layout(data: bytes) -> _NpyLayout | None:
    """Returns the layout of a ``.npy`` file's bytes, parsing each distinct header once (tar
    shards repeat one header for every sample); None when ``np.load`` must handle it (not a
    ``.npy``, object dtype, a payload of the wrong size: it then raises its own error)."""
    if data[:6] != _NPY_MAGIC or len(data) < 12:
        return None
    major = data[6]
    if major == 1:
        offset = 10 + int.from_bytes(data[8:10], "little")
    elif major in (2, 3):
        offset = 12 + int.from_bytes(data[8:12], "little")
    else:
        return None
    header = bytes(data[:offset])
    layout = _NPY_LAYOUTS.get(header)
    if layout is None:
        fh = io.BytesIO(header)
        version = np.lib.format.read_magic(fh)
        try:  # numpy's own header parser, once per distinct header
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                return None
        except Exception:  # np.load then raises its own error for this member
            return None
        if dtype.hasobject or not dtype.isnative:  # np.load (and its errors) for those
            return None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if len(_NPY_LAYOUTS) >= 4096:
            _NPY_LAYOUTS.clear()
        layout = _NPY_LAYOUTS[header] = _NpyLayout(dtype, tuple(shape), bool(fortran), offset,
                                                   nbytes)
    if len(data) - layout.offset != layout.nbytes:
        return None
    return layout


def _npy_payload(data: bytes, layout: _NpyLayout) -> np.ndarray:
    """Returns the (read-only) array view of a ``.npy`` payload with a known layout."""
    count = layout.nbytes // layout.dtype.itemsize
    a = np.frombuffer(data, layout.dtype, count=count, offset=layout.offset)
    return a.reshape(layout.shape, order="F" if layout.fortran else "C")


_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
               (b"\x28\xb5\x2f\xfd", "zstd"))


def _read_at(path: str, offset: int, n: int) -> bytes:
    """Bytes ``[offset, offset + n)`` of a local file or URL (fewer at the end)."""
    if is_url(path):
        return read_range(path, offset, n)
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(n)


def _npy_batch(members: list[bytes]) -> torch.Tensor | None:
    """Returns ``.npy`` members of one layout as a ``(b, *shape)`` tensor (each payload copied
    once, into shared memory in a DataLoader worker), or None when their layouts differ."""
    layouts = [_npy_layout(d) for d in members]
    if not layouts or layouts[0] is None or any(lay != layouts[0] for lay in layouts):
        return None
    lay = layouts[0]
    dst = empty_batch((len(members), *lay.shape), lay.dtype)
    for j, d in enumerate(members):
        dst[j] = _npy_payload(d, lay)
    return torch.from_numpy(dst)


class TarError(RuntimeError):
    """A tar shard is truncated or corrupt, or one of its members cannot be decoded."""


def _expand(paths: Any, ext: str = ".tar", who: str = "TarSource") -> list[str]:
    return expand(paths, ext, who)


class TarSource:
    """Returns a ``SampleSource`` over webdataset-style tar shards (random access by index).

    A sample is the group of members sharing a key: ``dir/key.ext`` has key ``dir/key`` (the
    name up to the first dot of its last part) and field ``ext`` (``"npy"``, ``"cls"``,
    ``"input.npy"``, ...). ``paths``: a file, a directory (its ``*.tar``), a glob, or a list
    of those; shards are sorted by name within each glob and keep the list's order. Opening
    scans each shard's headers once and keeps the data offsets, so ``read`` is exact random
    access (``os.pread``). Uncompressed tars only. Paths may be fsspec URLs (``memory://``,
    ``file://``, ``s3://``, ...; needs ``fsspec``): members are then read as byte ranges
    (``cat_file(path, start, end)``), a directory URL lists its ``*.tar``.

    ``decode(ext, data) -> value`` decodes members (default ``decode_member``). ``label_ext``
    (default ``"cls"``): when every sample has that member, its integer values become
    ``labels`` (and the batches' ``"label"``, not a field); when none has it, ``labels`` is
    None. Every sample must have the same fields.

    Checked at opening (``TarError`` naming the file and member): headers that do not parse,
    a member whose data runs past the end of the file, a missing end-of-archive marker (a
    file cut at a member boundary), samples whose fields differ. Tar has no data checksums:
    bytes corrupted inside a member are seen only if decoding fails (``TarError`` naming the
    file and member).

    Example:
        >>> import io, tarfile, tempfile, numpy as np
        >>> path = tempfile.mkdtemp() + "/shard-0.tar"
        >>> with tarfile.open(path, "w") as tf:
        ...     for i in range(3):
        ...         for ext, data in (("cls", str(i % 2).encode()), ("txt", b"s%d" % i)):
        ...             info = tarfile.TarInfo(f"{i:04d}.{ext}"); info.size = len(data)
        ...             tf.addfile(info, io.BytesIO(data))
        >>> src = TarSource(path)
        >>> len(src), src.labels.tolist(), src.read([2, 0])["txt"]
        (3, [0, 1, 0], ['s2', 's0'])
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        decode: Callable[[str, bytes], Any] | None = None,
        label_ext: str | None = "cls",
    ) -> None:
        self._fds: dict[int, int] = {}
        self.files = _expand(paths)
        self.decode = decode_member if decode is None else decode
        self.label_ext = label_ext
        # per sample: (file index, key, {ext: (member name, data offset, size)})
        self._samples: list[tuple[int, str, dict[str, tuple[str, int, int]]]] = []
        self.shard_sizes: list[int] = []
        sizes_bytes = []
        label_bytes: list[bytes | None] = []
        for f, path in enumerate(self.files):
            groups, labs = self._index(path, label_ext)
            self.shard_sizes.append(len(groups))
            self._samples += [(f, key, members) for key, members in groups.items()]
            label_bytes += [labs.get(key) for key in groups]
            sizes_bytes.append(file_size(path))
        if not self._samples:
            raise ValueError(f"TarSource: no samples in {self.files}")
        exts0 = set(self._samples[0][2])
        for f, key, members in self._samples:
            if set(members) != exts0:
                raise TarError(
                    f"TarSource: sample {key!r} in {self.files[f]!r} has members "
                    f"{sorted(members)}; the first sample has {sorted(exts0)}. Every sample "
                    "needs the same fields"
                )
        self.fields = sorted(exts0 - {label_ext}) if label_ext in exts0 else sorted(exts0)
        self.labels: np.ndarray | None = None
        if label_ext in exts0:
            self.labels = np.asarray(  # label bytes were read during the scan
                [self._decode_one(i, label_ext, data) for i, data in enumerate(label_bytes)],
                np.int64,
            )
        self._fp = _digest(
            [os.path.basename(p) for p in self.files], sizes_bytes,
            [(k, sorted(m.items())) for _, k, m in self._samples],
        )

    @staticmethod
    def _index(
        path: str, label_ext: str | None
    ) -> tuple[dict[str, dict[str, tuple[str, int, int]]], dict[str, bytes]]:
        size = file_size(path)
        head = _read_at(path, 0, 10)
        for magic, kind in _COMPRESSED:
            if head.startswith(magic) and (kind != "bzip2" or head[4:] == b"1AY&SY"):
                raise TarError(
                    f"TarSource: {path!r} is {kind}-compressed; random access needs an "
                    f"uncompressed tar (decompress it once, e.g. with the {kind} tool)"
                )
        groups: dict[str, dict[str, tuple[str, int, int]]] = {}
        labels: dict[str, bytes] = {}
        last = None
        end = 0
        try:
            with open_binary(path) as fh, tarfile.open(fileobj=fh, mode="r:") as tf:
                for info in tf:
                    last = info.name
                    end = info.offset_data + -(-info.size // 512) * 512
                    if info.offset_data + info.size > size:
                        raise TarError(
                            f"TarSource: {path!r} is truncated: member {info.name!r} needs "
                            f"{info.offset_data + info.size} bytes, the file has {size}"
                        )
                    if not info.isfile():
                        continue
                    dirname, base = os.path.split(info.name)
                    if "." not in base:
                        continue  # webdataset skips names without an extension
                    stem, ext = base.split(".", 1)
                    key = f"{dirname}/{stem}" if dirname else stem
                    members = groups.setdefault(key, {})
                    if ext in members:
                        raise TarError(
                            f"TarSource: {path!r} has member {info.name!r} twice"
                        )
                    members[ext] = (info.name, info.offset_data, info.size)
                    if ext == label_ext:  # tiny; read now, not in a second pass
                        labels[key] = tf.extractfile(info).read()
        except tarfile.ReadError as e:
            raise TarError(
                f"TarSource: cannot read {path!r} as an uncompressed tar "
                f"(after member {last!r}): {e}"
            ) from None
        # tarfile stops silently at a header it cannot parse; a complete archive has the
        # end-of-archive marker (two zero blocks) right after the last member
        tail = _read_at(path, end, 1024)
        if len(tail) < 1024 or any(tail):
            what = "no end-of-archive marker" if not any(tail) else "an unreadable tar header"
            raise TarError(
                f"TarSource: {path!r} is truncated or corrupt: {what} at byte {end}, after "
                f"member {last!r}"
            )
        return groups, labels

    def __len__(self) -> int:
        return len(self._samples)

    def _bytes(self, f: int, off: int, n: int) -> bytes:
        if is_url(self.files[f]):
            data = read_range(self.files[f], off, n)
            if len(data) != n:
                raise TarError(f"TarSource: {self.files[f]!r} shrank while reading (offset {off})")
            return data
        fd = self._fds.get(f)
        if fd is None:
            fd = self._fds[f] = os.open(self.files[f], os.O_RDONLY)
        data = os.pread(fd, n, off)
        if len(data) != n:
            raise TarError(f"TarSource: {self.files[f]!r} shrank while reading (offset {off})")
        return data

    def _decode_one(self, i: int, ext: str, data: bytes | None = None) -> Any:
        f, _key, members = self._samples[i]
        name, off, n = members[ext]
        if data is None:
            data = self._bytes(f, off, n)
        try:
            return self.decode(ext, data)
        except Exception as e:
            raise TarError(
                f"TarSource: cannot decode member {name!r} of {self.files[f]!r}: "
                f"{type(e).__name__}: {e}"
            ) from e

    def read_sample(self, i: int) -> dict[str, Any]:
        if not 0 <= int(i) < len(self._samples):
            raise IndexError(f"TarSource.read_sample: index {i} out of range [0, {len(self)})")
        return {ext: self._decode_one(int(i), ext) for ext in self.fields}

    def read(self, ids: Any) -> dict[str, Any]:
        ids = _as_ids(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self._samples)):
            raise IndexError(f"TarSource.read: ids must lie in [0, {len(self)}), got "
                             f"[{ids.min()}, {ids.max()}]")
        order = np.argsort(ids, kind="stable").tolist()  # file order, then put back
        out: dict[str, Any] = {}
        rest = []
        for ext in self.fields:
            batch = None
            if self.decode is decode_member and ext.rsplit(".", 1)[-1].lower() == "npy":
                batch = self._npy_direct(ext, ids, order)
            if batch is None:
                rest.append(ext)
            else:
                out[ext] = batch
        raw: dict[str, list[bytes]] = {ext: [b""] * len(ids) for ext in rest}
        for j in order if rest else []:
            f, _key, members = self._samples[int(ids[j])]
            for ext in rest:
                _name, off, n = members[ext]
                raw[ext][j] = self._bytes(f, off, n)
        for ext in rest:
            batch = None
            if self.decode is decode_member and ext.rsplit(".", 1)[-1].lower() == "npy":
                batch = _npy_batch(raw[ext])
            if batch is None:
                batch = collate_values([self._decode_one(int(i), ext, d)
                                        for i, d in zip(ids.tolist(), raw[ext], strict=True)])
            out[ext] = batch
        return {ext: out[ext] for ext in self.fields}

    def _npy_direct(self, ext: str, ids: np.ndarray, order: list[int]) -> torch.Tensor | None:
        """Returns the ``.npy`` members ``ext`` of ``ids`` as a ``(b, *shape)`` tensor, each
        read with one ``preadv`` straight into the batch (the header into a scratch buffer and
        compared with the first member's), or None (URLs, layouts that differ)."""
        if not len(ids) or any(is_url(p) for p in self.files):
            return None
        f0, _key, members0 = self._samples[int(ids[order[0]])]
        first = self._bytes(f0, members0[ext][1], members0[ext][2])
        lay = _npy_layout(first)
        if lay is None or lay.fortran:
            return None
        header = first[: lay.offset]
        size = lay.offset + lay.nbytes
        dst = empty_batch((len(ids), *lay.shape), lay.dtype)
        flat = memoryview(dst.reshape(-1).view(np.uint8))
        nb = lay.nbytes
        scratch = bytearray(lay.offset)
        for j in order:
            f, _key, members = self._samples[int(ids[j])]
            _name, off, n = members[ext]
            if n != size:
                return None
            fd = self._fds.get(f)
            if fd is None:
                fd = self._fds[f] = os.open(self.files[f], os.O_RDONLY)
            if os.preadv(fd, [scratch, flat[j * nb : (j + 1) * nb]], off) != size or (
                    scratch != header):
                return None
        return torch.from_numpy(dst)

    def key(self, i: int) -> str:
        """Returns the webdataset key of sample ``i`` (e.g. ``"000123"``)."""
        return self._samples[i][1]

    def fingerprint(self) -> str:
        return self._fp

    def describe(self) -> str:
        return f"TarSource({len(self)} samples in {len(self.files)} tar files)"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}}  # each worker opens its own descriptors

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}


# ---------------------------------------------------------------------- Arrow: Parquet, HF
def _pyarrow(who: str) -> Any:
    try:
        import pyarrow as pa
        import pyarrow.compute
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ImportError(
            f"{who} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    return pa


def _arrow_numpy(col: Any, pa: Any) -> np.ndarray | None:
    """Returns a ``(n, *shape)`` numpy array in the column's own dtype when the column holds
    numbers (or nested lists of numbers of one shape) without nulls, read from Arrow's flat
    value buffer (zero-copy where Arrow allows: then read-only); else None."""
    if hasattr(col, "combine_chunks"):  # a ChunkedArray
        col = col.combine_chunks()
    n, shape, cur = len(col), [], col
    while (pa.types.is_list(cur.type) or pa.types.is_large_list(cur.type)
           or pa.types.is_fixed_size_list(cur.type)):
        if cur.null_count or len(cur) == 0:
            return None
        lengths = pa.compute.min_max(pa.compute.list_value_length(cur))
        lo, hi = lengths["min"].as_py(), lengths["max"].as_py()
        if lo != hi:
            return None
        shape.append(lo)
        cur = cur.flatten()
    t = cur.type
    if cur.null_count or not (pa.types.is_integer(t) or pa.types.is_floating(t)
                              or pa.types.is_boolean(t)):
        return None
    if not shape and pa.types.is_boolean(t):
        return np.asarray(cur.to_numpy(zero_copy_only=False), dtype=bool)
    if pa.types.is_boolean(t):
        return None  # lists of bools stay lists (as before)
    return cur.to_numpy(zero_copy_only=False).reshape(n, *shape)


def _arrow_fixed_shape(col: Any, pa: Any) -> Any:
    """Returns a ``(b, *shape)`` tensor in the column's own dtype when it is (nested) lists of
    numbers of one shape without nulls, read from Arrow's flat value buffer; else None."""
    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return None
    a = _arrow_numpy(col, pa)
    return None if a is None else torch.from_numpy(np.array(a))


def _arrow_column(col: Any, pa: Any) -> Any:
    """Returns an Arrow column as a ``(b, ...)`` tensor when its values are numbers of one
    shape (scalars or nested lists), else the Python list of values."""
    t = col.type
    fixed = _arrow_fixed_shape(col, pa)
    if fixed is not None:
        return fixed
    if col.null_count == 0 and (pa.types.is_integer(t) or pa.types.is_floating(t)
                                or pa.types.is_boolean(t)):
        return torch.from_numpy(np.array(col.to_pylist() if pa.types.is_boolean(t)
                                         else col.to_numpy()))
    values = col.to_pylist()
    if values and col.null_count == 0 and (
        pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    ):
        arrays = [np.asarray(v) for v in values]
        if len({(a.shape, a.dtype) for a in arrays}) == 1 and arrays[0].dtype.kind in "biuf":
            return torch.from_numpy(np.stack(arrays))
    return values


class _ArrowSource:
    """Shared reading for sources whose units are Arrow tables (row groups or files)."""

    _who = "ArrowSource"

    def _setup(self, pa: Any, schema: Any, unit_rows: list[int], columns: Sequence[str] | None,
               label_column: str | None, labels_of: Callable[[], Any],
               cache_units: int | None) -> None:
        names = list(schema.names)
        if label_column is not None and label_column not in names:
            raise ValueError(
                f"{self._who}(label_column={label_column!r}): no such column; the columns are "
                f"{names}"
            )
        cols = [c for c in names if c != label_column] if columns is None else list(columns)
        missing = [c for c in cols if c not in names]
        if missing:
            raise ValueError(
                f"{self._who}(columns=...): no columns {missing}; the columns are {names}"
            )
        self.columns = cols
        self.label_column = label_column
        self.shard_sizes = unit_rows
        self._starts = np.cumsum([0, *unit_rows])
        self.labels: np.ndarray | None = None
        if label_column is not None:
            lab = labels_of()
            if lab.null_count or not pa.types.is_integer(lab.type):
                raise ValueError(
                    f"{self._who}(label_column={label_column!r}): expected integers without "
                    f"nulls, got type {lab.type} with {lab.null_count} nulls"
                )
            self.labels = np.asarray(lab.to_numpy(), dtype=np.int64)
        if cache_units is None:
            # enough units for any two consecutive windows of the default shuffle buffer (twice
            # the largest unit), plus one: a worker's batches then find every unit they touch
            # cached, so each unit is read and decoded once per epoch per worker
            window = 4 * max(unit_rows, default=1)
            small = np.cumsum(sorted(unit_rows))
            cache_units = int(np.searchsorted(small, window)) + 2
        if not isinstance(cache_units, int) or cache_units < 1:
            raise ValueError(f"{self._who}(cache_units={cache_units!r}): expected an int >= 1")
        self.cache_units = cache_units
        self._cache: OrderedDict[int, tuple[Any, dict[str, np.ndarray | None]]] = OrderedDict()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _table(self, unit: int) -> Any:  # one unit's table with self.columns
        raise NotImplementedError

    def _unit(self, unit: int) -> tuple[Any, dict[str, np.ndarray | None]]:
        """The unit's table and its columns decoded to numpy (None: not numbers of one
        shape), from an LRU cache of ``cache_units`` units."""
        hit = self._cache.get(unit)
        if hit is not None:
            self._cache.move_to_end(unit)
            return hit
        hit = self._decode_unit(unit)
        self._cache[unit] = hit
        while len(self._cache) > self.cache_units:
            self._evicted(self._cache.popitem(last=False)[0])
        return hit

    def _decode_unit(self, unit: int) -> tuple[Any, dict[str, np.ndarray | None]]:
        pa = _pyarrow(self._who)
        table = self._table(unit)
        return table, {c: _arrow_numpy(table.column(c), pa) for c in self.columns}

    def _evicted(self, unit: int) -> None:
        pass

    def read(self, ids: Any) -> dict[str, Any]:
        ids = _as_ids(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"{self._who}.read: ids must lie in [0, {len(self)})")
        if not ids.size:
            return {c: collate_values([]) for c in self.columns}
        units = np.searchsorted(self._starts, ids, side="right") - 1
        uniq = np.unique(units).tolist()
        decoded = {u: self._unit(u) for u in uniq}
        out: dict[str, Any] = {}
        slow = []
        for c in self.columns:
            arrays = [decoded[u][1][c] for u in uniq]
            if any(a is None for a in arrays) or len(
                {(a.shape[1:], a.dtype) for a in arrays}  # type: ignore[union-attr]
            ) != 1:
                slow.append(c)
                continue
            a0 = arrays[0]
            dst = empty_batch((len(ids), *a0.shape[1:]), a0.dtype)  # type: ignore[union-attr]
            if len(uniq) == 1:
                np.take(a0, ids - self._starts[uniq[0]], axis=0, out=dst)
            else:
                for u, a in zip(uniq, arrays, strict=True):
                    rows = np.flatnonzero(units == u)
                    dst[rows] = a[ids[rows] - self._starts[u]]  # type: ignore[index]
            out[c] = torch.from_numpy(dst)
        if slow:  # strings, ragged lists, nulls, shapes that differ between units
            pa = _pyarrow(self._who)
            order = np.argsort(units, kind="stable")
            parts = [(decoded[u][0] if decoded[u][0] is not None else self._table(u)).select(
                slow).take(pa.array(ids[units == u] - self._starts[u])) for u in uniq]
            table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            inv = np.empty_like(order)
            inv[order] = np.arange(len(order))
            table = table.take(pa.array(inv))  # back to the order of ids
            out.update({c: _arrow_column(table.column(c), pa) for c in slow})
        return {c: out[c] for c in self.columns}

    def read_sample(self, i: int) -> dict[str, Any]:
        return {k: v[0] for k, v in self.read([i]).items()}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": OrderedDict()}


def _parquet_file(pa: Any, path: str) -> Any:
    # a URL is read through an fsspec file object (pyarrow reads the footer and the row
    # groups it needs as byte ranges)
    # a local file is memory-mapped (no read copy of each row group's pages)
    if is_url(path):
        return pa.parquet.ParquetFile(open_binary(path))
    return pa.parquet.ParquetFile(path, memory_map=True)


class ParquetSource(_ArrowSource):
    """Returns a ``SampleSource`` over Parquet files (needs ``pyarrow``); row groups are the
    locality units (``shard_sizes``), each read whole and decoded once into numpy arrays in the
    columns' own dtypes, kept in an LRU cache of ``cache_units`` row groups per process.

    The default ``cache_units`` covers two windows of ``StreamingDataset``'s default
    ``shuffle_buffer`` (twice the largest row group), so each row group is read once per epoch
    per worker; with a larger ``shuffle_buffer`` pass ``cache_units >= 2 * shuffle_buffer /
    rows per group + 2`` (memory: that many decoded row groups per worker).

    ``shared_cache=True`` (default; Linux/macOS): DataLoader workers share decoded row groups
    through ``.npy`` files in ``/dev/shm`` (``_shmcache.py``): the first worker that needs a
    row group decodes it under a file lock, the others map it, so each row group is decoded
    about once per epoch in all instead of once per worker. The directory is removed when the
    process that created the source drops it or exits (a killed process leaves
    ``/dev/shm/torchfn-parquet-*``). ``shared_cache=False``: each process decodes for itself.

    ``paths``: a file, a directory (its ``*.parquet``), a glob, or a list (local paths or
    fsspec URLs, e.g. ``memory://``, ``s3://``; URLs need ``fsspec``). ``columns``: the
    fields (default all but ``label_column``); ``label_column``: an integer column that becomes
    ``labels``. Numeric columns and lists of numbers of one shape become tensors, others lists.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> path = tempfile.mkdtemp() + "/a.parquet"
        >>> pq.write_table(pa.table({"x": [[0.0, 1.0], [2.0, 3.0]], "y": [1, 0]}), path)
        >>> ParquetSource(path, label_column="y").read([1])["x"].tolist()
        [[2.0, 3.0]]
    """

    _who = "ParquetSource"

    def __init__(self, paths: Any, *, columns: Sequence[str] | None = None,
                 label_column: str | None = None, cache_units: int | None = None,
                 shared_cache: bool = True) -> None:
        pa = _pyarrow(self._who)
        self.files = _expand(paths, ".parquet", self._who)
        self._units: list[tuple[int, int]] = []
        rows, schema, meta = [], None, []
        for f, path in enumerate(self.files):
            pf = _parquet_file(pa, path)
            if schema is None:
                schema = pf.schema_arrow
            elif not pf.schema_arrow.equals(schema):
                raise ValueError(
                    f"ParquetSource: {path!r} has schema {pf.schema_arrow}; the first file has "
                    f"{schema}"
                )
            md = pf.metadata
            meta.append((os.path.basename(path), md.num_rows, md.num_row_groups))
            for g in range(md.num_row_groups):
                self._units.append((f, g))
                rows.append(md.row_group(g).num_rows)

        def labels_of() -> Any:
            cols = [_parquet_file(pa, p).read(columns=[label_column]).column(0)
                    for p in self.files]
            return pa.chunked_array([c for col in cols for c in col.chunks],
                                    type=schema.field(label_column).type)

        self._setup(pa, schema, rows, columns, label_column, labels_of, cache_units)
        self._fp = _digest(meta, str(schema))
        self._shared = SharedDecodeCache(self, "parquet") if shared_cache else None

    def _decode_unit(self, unit: int) -> tuple[Any, dict[str, np.ndarray | None]]:
        if self._shared is None:
            return super()._decode_unit(unit)
        pa = _pyarrow(self._who)
        def decode() -> dict[str, np.ndarray | None]:
            table = self._table(unit)
            return {c: _arrow_numpy(table.column(c), pa) for c in self.columns}

        arrays = self._shared.get(unit, self.columns, decode)
        return None, arrays  # the table is read again only for columns not shared (strings)

    def _evicted(self, unit: int) -> None:
        if self._shared is not None:
            self._shared.evict(unit, self.columns)

    def _table(self, unit: int) -> Any:
        pa = _pyarrow(self._who)
        f, g = self._units[unit]
        pfiles = self.__dict__.setdefault("_pfiles", OrderedDict())
        pf = pfiles.get(f)
        if pf is None:  # footers parsed once per file per process (a few files kept open)
            pf = pfiles[f] = _parquet_file(pa, self.files[f])
            while len(pfiles) > self.cache_units:
                pfiles.popitem(last=False)
        pfiles.move_to_end(f)
        # one thread: a DataLoader's workers already keep the cores busy
        return pf.read_row_group(g, columns=self.columns, use_threads=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_pfiles": OrderedDict()}

    def fingerprint(self) -> str:
        return self._fp

    def describe(self) -> str:
        return f"ParquetSource({len(self)} rows in {len(self.files)} files)"


class HFDiskSource(_ArrowSource):
    """Returns a ``SampleSource`` over a Hugging Face ``Dataset.save_to_disk`` directory
    (needs ``pyarrow``, not ``datasets``): its Arrow files are memory-mapped, one unit each.

    ``path``: the directory holding ``state.json`` (for a ``DatasetDict``, the split's
    directory, e.g. ``path/train``). ``label_column`` defaults to ``"label"`` when present.
    Numeric columns are read as zero-copy numpy views of the memory-mapped Arrow buffers; the
    views of the last ``cache_units`` files are kept (``ParquetSource`` says how many).

    Example (the layout ``save_to_disk`` writes: ``state.json`` naming Arrow stream files)::

        >>> import json, os, tempfile, pyarrow as pa, pyarrow.ipc
        >>> d = tempfile.mkdtemp()
        >>> table = pa.table({"x": [[0.0, 1.0], [2.0, 3.0]], "label": [1, 0]})
        >>> with pa.OSFile(os.path.join(d, "data-00000-of-00001.arrow"), "wb") as f:
        ...     with pyarrow.ipc.new_stream(f, table.schema) as w:
        ...         w.write_table(table)
        >>> with open(os.path.join(d, "state.json"), "w") as f:
        ...     json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}, f)
        >>> src = HFDiskSource(d)
        >>> len(src), src.labels.tolist(), src.read([1])["x"].tolist()
        (2, [1, 0], [[2.0, 3.0]])
    """

    _who = "HFDiskSource"

    def __init__(self, path: str | os.PathLike[str], *, columns: Sequence[str] | None = None,
                 label_column: str | None = "label", cache_units: int | None = None) -> None:
        pa = _pyarrow(self._who)
        root = Path(path)
        if (root / "dataset_dict.json").exists():
            splits = sorted(p.name for p in root.iterdir() if p.is_dir())
            raise ValueError(
                f"HFDiskSource({str(path)!r}): this is a DatasetDict; pass one split's directory, "
                f"one of {splits}"
            )
        try:
            state = json.loads((root / "state.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"HFDiskSource({str(path)!r}): no state.json; expected a directory written by "
                "datasets' Dataset.save_to_disk"
            ) from None
        self.files = [str(root / d["filename"]) for d in state["_data_files"]]
        self._tables = [self._open(p) for p in self.files]
        schema = self._tables[0].schema
        if label_column == "label" and "label" not in schema.names:
            label_column = None
        self._setup(
            pa, schema, [t.num_rows for t in self._tables], columns, label_column,
            lambda: pa.chunked_array(
                [c for t in self._tables for c in t.column(label_column).chunks],
                type=schema.field(label_column).type,
            ),
            cache_units,
        )
        self._fp = _digest(state.get("_fingerprint"), [d["filename"] for d in state["_data_files"]],
                           self.shard_sizes)

    def _open(self, path: str) -> Any:
        pa = _pyarrow(self._who)
        try:
            return pa.ipc.open_stream(pa.memory_map(path, "r")).read_all()
        except (OSError, pa.ArrowInvalid) as e:
            raise ValueError(f"HFDiskSource: cannot read Arrow file {path!r}: {e}") from e

    def _table(self, unit: int) -> Any:
        if self._tables[unit] is None:
            self._tables[unit] = self._open(self.files[unit])
        return self._tables[unit].select(self.columns)

    def fingerprint(self) -> str:
        return self._fp

    def describe(self) -> str:
        return f"HFDiskSource({len(self)} rows in {len(self.files)} Arrow files)"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": OrderedDict(), "_tables": [None] * len(self.files)}
