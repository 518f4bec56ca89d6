"""Shard format: fixed-size shard files with an index and per-sample checksums, read by memory mapping.

The byte layout is documented in ``torchfn/data/README.md``. In short, one shard file is::

    [0:8)    magic  b"TFSHARD\\x01"
    [8:16)   header length H (uint64, little endian)
    [16:20)  CRC32 of the header bytes (uint32, little endian)
    [20:32)  zero
    [32:32+H) header: UTF-8 JSON (num_samples, labels, per-field dtype/shape/offsets,
              checksum algorithm + per-sample checksums, file_bytes)
    ...      zero padding to a 64-byte boundary, then one 64-byte-aligned data block per field

Per-sample checksums: the header names the algorithm in ``"checksum"`` (``"xxh3_64"``, the
default, or ``"crc32"``) and stores one unsigned integer per sample under that same key, e.g.
``{"checksum": "xxh3_64", "xxh3_64": [...]}``. A sample's checksum runs over its bytes of every
field, fields in name order, each field's value seeding the next (``crc32(b, running)`` /
``xxh3_64(b, seed=running)``, starting from 0; for crc32 this is the CRC32 of the concatenation).
Shards written before the field existed have no ``"checksum"`` key and a ``"crc32"`` list: they
are read as ``"crc32"``, exactly as before; readers from before the field read ``"crc32"``
shards but not ``"xxh3_64"`` ones.

A field whose samples all share one shape is stored as one contiguous ``(n, *shape)`` array
("fixed" layout: reading sample ``i`` is a zero-copy view); otherwise its samples are stored back
to back with per-sample byte offsets and shapes ("ragged" layout). The writer stores a field
ragged only when asked to (``ShardWriter(..., ragged=[name])``); it refuses a sample whose shape
differs from the first sample's in any other field.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

__all__ = [
    "MAGIC",
    "MANIFEST",
    "CorruptShardError",
    "ShardReader",
    "ShardWriter",
    "VerifyReport",
    "read_manifest",
    "verify_shards",
]

MAGIC = b"TFSHARD\x01"
MANIFEST = "manifest.json"
_PREFIX = 32
_ALIGN = 64
_FORMAT = "torchfn.shards"
_VERSION = 1
try:  # iovecs per preadv call
    _IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 16

# Per-sample checksum algorithms: name -> f(bytes, running value) -> value (unsigned int).
# xxh3_64 is an order of magnitude faster than zlib's CRC32 (see benchmarks/README.md).
_CHECKSUMS: dict[str, Callable[[Any, int], int]] = {
    "xxh3_64": xxhash.xxh3_64_intdigest,
    "crc32": zlib.crc32,
}
_DEFAULT_CHECKSUM = "xxh3_64"
_LEGACY_CHECKSUM = "crc32"  # headers without a "checksum" key


def _sample_checksum(algorithm: Callable[[Any, int], int], parts: Iterable[Any]) -> int:
    """Returns one sample's checksum over its byte buffers ``parts`` (one per field, name order).

    The only place a sample checksum is computed (writer, ``check``, ``readinto``; for a one-field
    shard ``check_many`` evaluates its one-part case, ``algorithm(part, 0)``, inline): each
    part's value seeds the next, starting from 0.
    """
    value = 0
    for part in parts:
        value = algorithm(part, value)
    return value


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}


def _preadv(fd: int, mv: memoryview, iov: list[memoryview], offset: int, total: int) -> int:
    """Fills ``iov`` from file bytes ``[offset, offset + total)``; returns the bytes read."""
    if hasattr(os, "preadv"):
        got = 0
        while got < total:  # regular files only come back short at the end of the file
            n = os.preadv(fd, iov, offset + got) if got == 0 else os.preadv(
                fd, _advance(iov, got), offset + got)
            if n <= 0:
                break
            got += n
        return got
    pos = offset  # no preadv (Windows): copy from the memory map
    for b in iov:
        n = max(0, min(len(b), len(mv) - pos))
        b[:n] = mv[pos : pos + n]
        pos += n
        if n < len(b):
            break
    return pos - offset


def _advance(iov: list[memoryview], skip: int) -> list[memoryview]:
    out = []
    for b in iov:
        if skip >= len(b):
            skip -= len(b)
            continue
        out.append(b[skip:])
        skip = 0
    return out


class CorruptShardError(RuntimeError):
    """A shard (or one sample of it) failed its structural check or its checksum."""

    def __init__(self, path: str | os.PathLike[str], index: int | None, reason: str) -> None:
        self.path = str(path)
        self.index = index
        self.reason = reason
        where = "header" if index is None else f"sample {index}"
        super().__init__(
            f"corrupt shard {self.path!r} ({where}): {reason}. Re-write the shard, or pass "
            "on_corrupt='skip' to skip and report the affected samples."
        )


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
    elif isinstance(value, np.ndarray | np.generic | int | float | bool):
        t = torch.as_tensor(np.ascontiguousarray(value))
    else:
        raise TypeError(
            f"ShardWriter.write: field {name!r} must be a torch.Tensor or numpy array, "
            f"got {type(value).__name__}"
        )
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise TypeError(f"ShardWriter.write: field {name!r} has unsupported dtype {t.dtype}")
    return t.contiguous()


def _check_label(label: Any, index: int) -> int:
    """Returns ``label`` as an int; raises ``TypeError`` for anything but an integer class id."""
    call = f"ShardWriter.write(label={label!r})"
    value = label
    if isinstance(label, torch.Tensor | np.ndarray):
        numel = label.numel() if isinstance(label, torch.Tensor) else label.size
        if numel != 1:
            raise TypeError(
                f"{call}: sample {index}'s label has shape {tuple(label.shape)}; expected one "
                "integer class id"
            )
        value = label.item()
    elif isinstance(label, np.generic):
        value = label.item()
    if isinstance(value, float | complex):
        raise TypeError(
            f"{call}: sample {index} has the non-integer label {value!r}; labels are integer "
            "class ids (the shard format stores ints: torchfn/data/README.md), never truncated. "
            "Pass int(label) if it is a class id, or store a float target as a field: "
            "write({..., 'target': torch.tensor(label)}, label=0)"
        )
    if not isinstance(value, int):
        raise TypeError(
            f"{call}: sample {index}'s label is a {type(label).__name__}; expected an int "
            "class id (or a one-element integer tensor/array)"
        )
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{call}: sample {index}'s label does not fit int64")
    return int(value)


def _manifest_mismatch(reader: ShardReader, num_samples: int, labels: Sequence[int]) -> str | None:
    """Returns why ``reader``'s header disagrees with its manifest entry, or None if it agrees."""
    if reader.num_samples != num_samples:
        return f"manifest says {num_samples} samples, shard header says {reader.num_samples}"
    if len(labels) != len(reader.labels):
        return f"manifest lists {len(labels)} labels, shard header {len(reader.labels)}"
    for i, (a, b) in enumerate(zip(labels, reader.labels, strict=True)):
        if int(a) != int(b):
            return (
                f"manifest labels differ from the shard header's (first at sample {i}: manifest "
                f"{int(a)}, header {int(b)}); the manifest and the shard are out of sync"
            )
    return None


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _atomic_write(path: Path, chunks: Sequence[bytes]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(chunks))  # one write call (a shard is one chunk per sample)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _encode_shard(
    samples: list[dict[str, torch.Tensor]], labels: list[int], checksum: str
) -> list[bytes]:
    n = len(samples)
    names = sorted(samples[0])
    for i, s in enumerate(samples):
        if sorted(s) != names:
            raise ValueError(
                f"ShardWriter.write: every sample of a shard needs the same fields; expected "
                f"{names}, got {sorted(s)} for sample {i} of the shard"
            )
    fields: dict[str, dict[str, Any]] = {}
    blocks: list[list[bytes]] = []
    for name in names:
        dtypes = {s[name].dtype for s in samples}
        if len(dtypes) != 1:
            raise ValueError(f"ShardWriter.write: field {name!r} has mixed dtypes {dtypes}")
        shapes = [list(s[name].shape) for s in samples]
        raw = [_tensor_bytes(s[name]) for s in samples]
        meta: dict[str, Any] = {"dtype": str(dtypes.pop()).removeprefix("torch.")}
        if all(sh == shapes[0] for sh in shapes):
            meta["shape"] = shapes[0]
            meta["nbytes"] = len(raw[0])
        else:
            meta["shapes"] = shapes
            offs = np.cumsum([0] + [len(b) for b in raw]).tolist()
            meta["offsets"] = offs
        fields[name] = meta
        blocks.append(raw)
    algorithm = _CHECKSUMS[checksum]
    sums = [_sample_checksum(algorithm, (raw[i] for raw in blocks)) for i in range(n)]
    header: dict[str, Any] = {
        "format": _FORMAT, "version": _VERSION, "num_samples": n, "labels": labels,
        "fields": fields, "checksum": checksum, checksum: sums,
    }
    # Offsets depend on the header length, which depends on the offsets: iterate to a fixed point.
    offset_guess = 0
    while True:
        pos = offset_guess
        for name, raw in zip(names, blocks, strict=True):
            fields[name]["offset"] = pos
            pos = _align(pos + sum(len(b) for b in raw))
        header["file_bytes"] = pos
        hbytes = json.dumps(header, separators=(",", ":")).encode()
        data_start = _align(_PREFIX + len(hbytes))
        if data_start == offset_guess:
            break
        offset_guess = data_start
    out = [MAGIC, struct.pack("<QI", len(hbytes), zlib.crc32(hbytes)), b"\0" * 12, hbytes]
    pos = _PREFIX + len(hbytes)
    for name, raw in zip(names, blocks, strict=True):
        start = fields[name]["offset"]
        out.append(b"\0" * (start - pos))
        out.extend(raw)
        pos = start + sum(len(b) for b in raw)
    out.append(b"\0" * (header["file_bytes"] - pos))
    return out


class ShardWriter:
    """Writes samples into fixed-size shard files plus a ``manifest.json``; a context manager.

    Each ``write(sample, label)`` appends one sample (a dict of tensors / numpy arrays, any
    shapes, one dtype per field) with an integer class label. Every ``samples_per_shard``
    samples a shard ``shard-NNNNN.tfs`` is written atomically (temp file + fsync + rename) and
    the manifest (shards, sample counts, labels) is rewritten atomically, so a crash leaves
    only complete shards listed. ``close()`` flushes the last, possibly shorter, shard.

    ``checksum`` picks the per-sample checksum stored in each shard header: ``"xxh3_64"``
    (default, fast) or ``"crc32"`` (zlib, much slower to verify; such shards are also readable
    by torchfn versions from before the ``"checksum"`` header field).

    Every field has one shape for all samples (batches stack it into ``(b, *shape)``), except
    the fields named in ``ragged``, whose shape may vary per sample (batches then hold them as
    lists of tensors); a sample with another shape in any other field is refused with
    ``ValueError``. Labels are ints (or one-element integer tensors/arrays); a float label is
    refused with ``TypeError`` (the format stores integer labels).

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> with ShardWriter(d, samples_per_shard=2) as w:
        ...     for i in range(5):
        ...         w.write({"x": torch.full((3,), float(i))}, label=i % 2)
        >>> [s["num_samples"] for s in read_manifest(d)["shards"]]
        [2, 2, 1]
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        samples_per_shard: int,
        checksum: str = _DEFAULT_CHECKSUM,
        ragged: Iterable[str] = (),
    ) -> None:
        if not isinstance(samples_per_shard, int) or samples_per_shard < 1:
            raise ValueError(
                f"ShardWriter(samples_per_shard=...): expected a positive int, got "
                f"{samples_per_shard!r}"
            )
        if checksum not in _CHECKSUMS:
            raise ValueError(
                f"ShardWriter(checksum=...): expected one of "
                f"{', '.join(map(repr, _CHECKSUMS))}, got {checksum!r}"
            )
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if (self.root / MANIFEST).exists():
            raise FileExistsError(
                f"ShardWriter({str(self.root)!r}): a manifest already exists there; write into "
                "an empty directory"
            )
        self.samples_per_shard = samples_per_shard
        self.checksum = checksum
        self.ragged = frozenset([ragged] if isinstance(ragged, str) else map(str, ragged))
        self._shapes: dict[str, tuple[int, ...]] | None = None  # the first sample's shapes
        self._count = 0  # samples written so far (the index of the next one)
        self._samples: list[dict[str, torch.Tensor]] = []
        self._labels: list[int] = []
        self._shards: list[dict[str, Any]] = []
        self._schema: dict[str, dict[str, Any]] | None = None
        self._closed = False

    def write(self, sample: Mapping[str, Any], label: int) -> None:
        """Appends one sample; returns nothing. ``label`` is the sample's integer class."""
        if self._closed:
            raise RuntimeError("ShardWriter.write: the writer is closed")
        if not sample:
            raise ValueError("ShardWriter.write: a sample needs at least one field")
        if "label" in sample:
            raise ValueError("ShardWriter.write: 'label' is reserved; pass it as label=...")
        index = self._count
        tensors = {str(k): _as_tensor(str(k), v) for k, v in sample.items()}
        lab = _check_label(label, index)
        if self._shapes is None:
            unknown = sorted(self.ragged - set(tensors))
            if unknown:
                raise ValueError(
                    f"ShardWriter(ragged={sorted(self.ragged)}): no field named "
                    f"{', '.join(map(repr, unknown))}; the samples have {sorted(tensors)}"
                )
            self._shapes = {k: tuple(t.shape) for k, t in tensors.items()}
        for k, t in tensors.items():
            ref = self._shapes.get(k)
            if k not in self.ragged and ref is not None and tuple(t.shape) != ref:
                raise ValueError(
                    f"ShardWriter.write: sample {index} has field {k!r} of shape "
                    f"{tuple(t.shape)}, but sample 0 has shape {ref}; a field keeps one shape "
                    f"(batches stack it), or pass ShardWriter(..., ragged=[{k!r}]) to store it "
                    "ragged (batches then hold it as a list of tensors)"
                )
        self._samples.append(tensors)
        self._labels.append(lab)
        self._count += 1
        if len(self._samples) == self.samples_per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self._samples:
            return
        name = f"shard-{len(self._shards):05d}.tfs"
        chunks = _encode_shard(self._samples, self._labels, self.checksum)
        schema = {
            k: {"dtype": str(v.dtype).removeprefix("torch.")} for k, v in self._samples[0].items()
        }
        if self._schema is None:
            self._schema = schema
        elif schema != self._schema:
            raise ValueError(
                f"ShardWriter.write: fields/dtypes changed between shards: {self._schema} "
                f"then {schema}"
            )
        _atomic_write(self.root / name, chunks)
        self._shards.append({
            "file": name, "num_samples": len(self._samples), "labels": self._labels,
            "bytes": sum(len(c) for c in chunks),
        })
        self._samples, self._labels = [], []
        self._write_manifest()

    def _write_manifest(self) -> None:
        manifest = {
            "format": _FORMAT, "version": _VERSION,
            "num_samples": sum(s["num_samples"] for s in self._shards),
            "fields": self._schema or {}, "shards": self._shards,
        }
        _atomic_write(self.root / MANIFEST, [json.dumps(manifest).encode()])

    def close(self) -> None:
        """Flushes the last shard and writes the final manifest; returns nothing."""
        if not self._closed:
            self._flush()
            if not self._shards:
                self._write_manifest()
            self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Returns the manifest dict of a shard directory (``shards``: file, num_samples, labels)."""
    path = Path(root) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no {MANIFEST} in {str(root)!r}: write the shards with ShardWriter first"
        ) from None
    if manifest.get("format") != _FORMAT:
        raise ValueError(f"{str(path)!r} is not a torchfn shard manifest")
    return manifest


@dataclass
class ShardReader:
    """Memory-maps one shard file; returns zero-copy tensors of its samples.

    Opening checks the magic, the header CRC32 and the file length. Samples the file is too
    short to hold are listed in ``bad`` (index -> reason); if the header itself is unreadable,
    ``CorruptShardError`` is raised (``index=None``). ``sample(i)`` checks sample ``i``'s
    checksum (``checksum`` names the algorithm, ``checksums`` holds the stored values) when
    ``verify`` is true and raises ``CorruptShardError`` naming the file and ``i``.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> with ShardWriter(d, samples_per_shard=4) as w:
        ...     w.write({"x": torch.arange(3.0)}, label=7)
        >>> r = ShardReader(f"{d}/shard-00000.tfs")
        >>> r.sample(0)["x"].tolist(), r.labels[0]
        ([0.0, 1.0, 2.0], 7)
    """

    path: str
    num_samples: int = 0
    labels: list[int] = field(default_factory=list)
    bad: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.path = str(self.path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                prefix = f.read(_PREFIX)
                if len(prefix) < _PREFIX or prefix[:8] != MAGIC:
                    raise CorruptShardError(self.path, None, "bad magic or file too short")
                hlen, hcrc = struct.unpack("<QI", prefix[8:20])
                hbytes = f.read(hlen)
        except OSError as e:
            raise CorruptShardError(self.path, None, f"cannot read: {e}") from e
        if len(hbytes) != hlen or zlib.crc32(hbytes) != hcrc:
            raise CorruptShardError(self.path, None, "header truncated or CRC32 mismatch")
        header = json.loads(hbytes)
        self.num_samples = n = int(header["num_samples"])
        self.labels = list(header["labels"])
        self.checksum: str = header.get("checksum", _LEGACY_CHECKSUM)
        if self.checksum not in _CHECKSUMS:
            raise CorruptShardError(
                self.path, None,
                f"unknown checksum {self.checksum!r} (this torchfn reads "
                f"{', '.join(map(repr, _CHECKSUMS))}; written by a newer torchfn?)",
            )
        self.checksums: list[int] = list(header[self.checksum])
        self.mismatch = f"{self.checksum} checksum mismatch"  # reason given for a failed check
        self._algorithm = _CHECKSUMS[self.checksum]
        self.fields: dict[str, dict[str, Any]] = header["fields"]
        self.file_bytes = int(header["file_bytes"])
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="c", shape=(size,)) if size else (
            np.zeros(0, np.uint8))
        raw = torch.from_numpy(self._buf)
        self._fixed: dict[str, torch.Tensor] = {}
        self._spans: list[np.ndarray] = []  # per field: (n, 2) byte ranges of each sample
        for name, meta in self.fields.items():
            off = int(meta["offset"])
            if "shape" in meta:
                nb = int(meta["nbytes"])
                starts = off + nb * np.arange(n, dtype=np.int64)
                spans = np.stack([starts, starts + nb], 1)
                end = min(off + nb * n, size)
                usable = max(0, (end - off) // nb) if nb else n
                dt = _DTYPES[meta["dtype"]]
                view = raw[off : off + nb * usable] if nb else raw[0:0]
                self._fixed[name] = view.view(dt).view(usable, *meta["shape"]) if nb else (
                    torch.empty((n, *meta["shape"]), dtype=dt))
            else:
                o = np.asarray(meta["offsets"], dtype=np.int64) + off
                spans = np.stack([o[:-1], o[1:]], 1)
            self._spans.append(spans)
        for spans in self._spans:
            for i in np.nonzero(spans[:, 1] > size)[0].tolist():
                self.bad.setdefault(i, f"truncated: file has {size} of {self.file_bytes} bytes")
        self._raw = raw
        self._mv = memoryview(self._buf).cast("B") if size else memoryview(b"")
        self._span_list = [s.tolist() for s in self._spans]
        self._fd = -1  # raw descriptor for readinto, opened on first use, closed by close()
        self.layout: tuple[tuple[str, str, tuple[int, ...], int, int], ...] | None = (
            tuple(
                (k, m["dtype"], tuple(m["shape"]), int(m["nbytes"]), int(m["offset"]))
                for k, m in self.fields.items()
            )
            if all("shape" in m for m in self.fields.values()) else None
        )

    def check(self, i: int) -> bool:
        """Returns whether sample ``i``'s bytes match its stored checksum."""
        if i in self.bad:
            return False
        mv, parts = self._mv, []
        for spans in self._span_list:  # a plain loop: this runs per sample on the mmap path
            a, b = spans[i]
            parts.append(mv[a:b])
        return _sample_checksum(self._algorithm, parts) == self.checksums[i]

    def check_many(self, indices: Sequence[int]) -> list[bool]:
        """Returns ``[check(i) for i in indices]``, with less Python per sample.

        For a one-field shard a sample's checksum is ``algorithm(bytes, 0)`` (what
        ``_sample_checksum`` computes for one part), evaluated in one comprehension.
        """
        if len(self._span_list) != 1:
            return [self.check(i) for i in indices]
        algorithm, sums, mv, bad = self._algorithm, self.checksums, self._mv, self.bad
        spans = self._span_list[0]
        return [i not in bad and algorithm(mv[spans[i][0]:spans[i][1]], 0) == sums[i]
                for i in indices]

    def _raise_if_bad(self, i: int) -> None:
        if i in self.bad:
            raise CorruptShardError(self.path, i, self.bad[i])
        if not self.check(i):
            raise CorruptShardError(self.path, i, self.mismatch)

    def sample(self, i: int, *, verify: bool = True) -> dict[str, torch.Tensor]:
        """Returns sample ``i`` as ``{field: tensor}`` (zero-copy views for fixed fields)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"ShardReader.sample: index {i} out of range [0, {self.num_samples})")
        if verify:
            self._raise_if_bad(i)
        elif i in self.bad:
            raise CorruptShardError(self.path, i, self.bad[i])
        out = {}
        for (name, meta), spans in zip(self.fields.items(), self._spans, strict=True):
            if name in self._fixed:
                out[name] = self._fixed[name][i]
            else:
                a, b = spans[i]
                t = self._raw[a:b].view(_DTYPES[meta["dtype"]])
                out[name] = t.view(*meta["shapes"][i])
        return out

    def readinto(
        self,
        index: Sequence[int],
        rows: Sequence[int],
        out: Mapping[str, memoryview],
        *,
        verify: bool = True,
    ) -> list[int]:
        """Copies samples ``index`` into rows ``rows`` of ``out``; returns the positions that failed.

        For shards whose fields are all fixed-shape (``layout`` is not None). ``out[name]`` is a
        writable byte buffer holding rows of ``nbytes`` bytes; sample ``index[p]`` of field
        ``name`` lands in row ``rows[p]``. The bytes are read with ``os.preadv`` straight from
        the file (no memory map, so no page faults on the source), one system call per run of
        consecutive indices (pass ``index`` sorted ascending to get long runs). With ``verify``
        each sample's checksum is checked on the bytes delivered. Returned positions ``p``
        (sorted) are samples that are structurally bad, came back short, or failed their
        checksum: their rows hold garbage; ``sample``/``check`` give the reason.
        """
        if self.layout is None:
            raise ValueError(
                f"ShardReader.readinto: {self.path!r} has ragged fields; expected all fields "
                "fixed-shape"
            )
        if len(index) != len(rows):
            raise ValueError(
                f"ShardReader.readinto: index and rows need equal lengths, got {len(index)} "
                f"and {len(rows)}"
            )
        failed: set[int] = set()
        ok: list[int] = []
        for p, i in enumerate(index):
            if not 0 <= i < self.num_samples:
                raise IndexError(
                    f"ShardReader.readinto: index {i} out of range [0, {self.num_samples})"
                )
            (failed.add if i in self.bad else ok.append)(p)
        if self._fd < 0 and ok:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except OSError as e:
                raise CorruptShardError(self.path, None, f"cannot read: {e}") from e
        fd = self._fd
        k, m = 0, len(ok)
        while k < m:
            e = k + 1
            while e < m and index[ok[e]] == index[ok[e - 1]] + 1 and e - k < _IOV_MAX:
                e += 1
            run = ok[k:e]
            first = index[run[0]]
            for name, _dt, _shape, nb, off in self.layout:  # type: ignore[union-attr]
                if nb == 0:
                    continue
                buf = out[name]
                iov = [buf[rows[p] * nb : (rows[p] + 1) * nb] for p in run]
                got = _preadv(fd, self._mv, iov, off + first * nb, nb * len(run))
                if got < nb * len(run):
                    failed.update(run[got // nb :])
            k = e
        if verify:
            fields = [(out[name], nb) for name, _dt, _shape, nb, _off in self.layout]
            algorithm, sums = self._algorithm, self.checksums
            for p in ok:
                if p in failed:
                    continue
                r = rows[p]
                parts = [buf[r * nb : (r + 1) * nb] for buf, nb in fields]
                if _sample_checksum(algorithm, parts) != sums[index[p]]:
                    failed.add(p)
        return sorted(failed)

    def close(self) -> None:
        """Closes the descriptor ``readinto`` opened; returns nothing (the memory map stays)."""
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.close()

    def fixed(self, name: str) -> torch.Tensor | None:
        """Returns the ``(n, *shape)`` zero-copy tensor of a fixed-shape field, else None."""
        return self._fixed.get(name)


@dataclass(frozen=True)
class VerifyReport:
    """Result of ``verify_shards``: the bad samples as (global id, file, index, reason)."""

    num_samples: int
    bad: tuple[tuple[int, str, int, str], ...]

    @property
    def bad_ids(self) -> list[int]:
        """Global ids (manifest order) of the samples that failed."""
        return [b[0] for b in self.bad]

    @property
    def ok(self) -> bool:
        return not self.bad


def _open_or_report(
    path: Path, n: int, labels: Sequence[int]
) -> tuple[ShardReader | None, dict[int, str]]:
    try:
        r = ShardReader(str(path))
    except CorruptShardError as e:
        return None, dict.fromkeys(range(n), e.reason)
    reason = _manifest_mismatch(r, n, labels)
    if reason is not None:
        return None, dict.fromkeys(range(n), reason)
    return r, dict(r.bad)


def verify_shards(root: str | os.PathLike[str], *, full: bool = True) -> VerifyReport:
    """Returns a ``VerifyReport`` listing every sample of ``root`` that is unreadable.

    ``full=False`` only checks the headers and file lengths (cheap: one small read per shard);
    ``full=True`` also checks every sample's checksum (reads all the data once). A shard whose
    header disagrees with the manifest (sample count or labels) is listed whole, the reason
    naming the disagreement.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> with ShardWriter(d, samples_per_shard=2) as w:
        ...     for i in range(3):
        ...         w.write({"x": torch.zeros(2)}, label=0)
        >>> verify_shards(d).ok
        True
    """
    manifest = read_manifest(root)
    bad: list[tuple[int, str, int, str]] = []
    base = 0
    for shard in manifest["shards"]:
        path = Path(root) / shard["file"]
        n = int(shard["num_samples"])
        reader, errs = _open_or_report(path, n, shard["labels"])
        if reader is not None and full:
            for i in range(n):
                if i not in errs and not reader.check(i):
                    errs[i] = reader.mismatch
        bad.extend((base + i, str(path), i, errs[i]) for i in sorted(errs))
        base += n
    return VerifyReport(num_samples=base, bad=tuple(bad))
