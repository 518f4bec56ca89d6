"""``TarSource``: webdataset-style tar shards as a ``SampleSource`` (see ``_sources.py``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ._alloc import batch_tensor, empty_batch
from ._fsio import file_size, is_url, open_binary, read_range
from ._sources import _as_ids, _digest, _expand, collate_values

__all__ = ["TarError", "TarSource", "decode_member"]


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
    return batch_tensor(dst)


class TarError(RuntimeError):
    """A tar shard is truncated or corrupt, or one of its members cannot be decoded."""


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
        return batch_tensor(dst)

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
