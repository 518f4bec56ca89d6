"""A direct decoder for the Parquet column chunks ``ParquetSource`` reads most: numbers and
lists of numbers without nulls, PLAIN or dictionary encoded.

pyarrow spends most of a row group's read rebuilding list columns from their repetition and
definition levels value by value; for a column with no nulls or empty lists the levels say
only where each row starts, which this module reads run by run (RLE/bit-packed hybrid runs,
numpy for the bit-packed groups) while the values are one ``np.frombuffer`` per page (PLAIN)
or one ``take`` from the dictionary page (RLE_DICTIONARY).

``decode_chunk`` returns None for anything else (other physical types or encodings, nulls,
empty lists, nested lists, DATA_PAGE headers it cannot read), and the caller reads that
column with pyarrow: the result is the same Arrow array either way. A page whose header
carries a CRC32 is checked against it (``CorruptParquetError``).

Format references: parquet-format ``parquet.thrift`` (PageHeader, DataPageHeader,
DataPageHeaderV2, DictionaryPageHeader), ``Encodings.md`` (RLE/bit-packed hybrid, PLAIN,
RLE_DICTIONARY), Thrift's compact protocol.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# PageType
_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 1, 2, 3
# Encoding
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8

_CODECS = {"UNCOMPRESSED": None, "SNAPPY": "snappy", "GZIP": "gzip", "ZSTD": "zstd",
           "LZ4_RAW": "lz4_raw", "BROTLI": "brotli"}  # LZ4 (Hadoop framing): pyarrow reads it
_DTYPES = {"FLOAT": np.dtype("<f4"), "DOUBLE": np.dtype("<f8"), "INT32": np.dtype("<i4"),
           "INT64": np.dtype("<i8")}


class CorruptParquetError(RuntimeError):
    """A Parquet page failed its CRC32 check."""

    def __init__(self, path: str, row_group: int, column: str, reason: str) -> None:
        self.path, self.row_group, self.column, self.reason = path, row_group, column, reason
        super().__init__(
            f"corrupt Parquet file {path!r} (row group {row_group}, column {column!r}): "
            f"{reason}. Re-write the file."
        )


class _Unsupported(Exception):
    """Internal: this chunk is not one the fast path decodes (the caller uses pyarrow)."""


# ---------------------------------------------------------------- Thrift compact protocol

def _varint(b: Any, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        c = b[pos]
        pos += 1
        out |= (c & 0x7F) << shift
        if c < 0x80:
            return out, pos
        shift += 7
        if shift > 70:
            raise _Unsupported("varint too long")


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _value(b: Any, pos: int, t: int, depth: int) -> tuple[Any, int]:
    if t == 1:  # BOOLEAN_TRUE (a field); in a list or map a bool is one byte of its own
        return True, pos
    if t == 2:
        return False, pos
    if t == 3:  # i8
        return (b[pos] ^ 0x80) - 0x80, pos + 1
    if t in (4, 5, 6):  # i16, i32, i64: zigzag varints
        v, pos = _varint(b, pos)
        return _zigzag(v), pos
    if t == 7:  # double
        return struct.unpack_from("<d", b, pos)[0], pos + 8
    if t == 8:  # binary / string
        n, pos = _varint(b, pos)
        if pos + n > len(b):
            raise _Unsupported("binary past the end")
        return bytes(b[pos:pos + n]), pos + n
    if t in (9, 10):  # list, set
        h = b[pos]
        pos += 1
        n, et = h >> 4, h & 0x0F
        if n == 15:
            n, pos = _varint(b, pos)
        return _elements(b, pos, et, n, depth)
    if t == 11:  # map
        n, pos = _varint(b, pos)
        if n == 0:
            return [], pos
        kv = b[pos]  # the keys and values in turn, as one list
        keys, pos = _elements(b, pos + 1, kv >> 4, n, depth, interleave=kv & 0x0F)
        return keys, pos
    if t == 12:
        return _struct(b, pos, depth + 1)
    raise _Unsupported(f"thrift type {t}")


def _elements(b: Any, pos: int, et: int, n: int, depth: int,
              interleave: int | None = None) -> tuple[list[Any], int]:
    out = []
    types = (et,) if interleave is None else (et, interleave)
    for _ in range(n):
        for t in types:
            if t in (1, 2):
                v, pos = b[pos] == 1, pos + 1
            else:
                v, pos = _value(b, pos, t, depth)
            out.append(v)
    return out, pos


class _Fields(dict):  # type: ignore[type-arg]
    """A struct's ``{field id: value}`` with each field's compact type in ``types``."""

    __slots__ = ("types",)


def _struct(b: Any, pos: int, depth: int = 0) -> tuple[dict[int, Any], int]:
    """Returns a compact-protocol struct at ``pos`` as ``{field id: value}`` (nested structs
    as dicts, lists as lists) and the position after it; unknown fields are read and kept."""
    if depth > 16:
        raise _Unsupported("thrift structs nested too deep")
    fields = _Fields()
    fields.types = {}
    last = 0
    while True:
        byte = b[pos]
        pos += 1
        if byte == 0:  # STOP
            return fields, pos
        t, delta = byte & 0x0F, byte >> 4
        if delta:
            fid = last + delta
        else:
            v, pos = _varint(b, pos)
            fid = _zigzag(v)
        last = fid
        fields[fid], pos = _value(b, pos, t, depth)
        fields.types[fid] = 1 if t == 2 else t  # (a bool field's type holds its value)


# the fields read of each header: {field id: compact type} (5: i32, 12: struct, 1: bool),
# and which are required (a header breaking these is left to pyarrow, which rejects it)
_I32, _BOOL, _STRUCT = 5, 1, 12
_HEADERS = {
    "page": ({1: _I32, 2: _I32, 3: _I32, 4: _I32, 5: _STRUCT, 7: _STRUCT, 8: _STRUCT},
             (1, 2, 3)),
    5: ({1: _I32, 2: _I32, 3: _I32, 4: _I32}, (1, 2, 3, 4)),
    7: ({1: _I32, 2: _I32, 3: _BOOL}, (1, 2)),
    8: ({1: _I32, 2: _I32, 3: _I32, 4: _I32, 5: _I32, 6: _I32, 7: _BOOL}, (1, 2, 3, 4, 5, 6)),
}


def _check_fields(d: Any, kind: Any) -> None:
    types, required = _HEADERS[kind]
    if any(f not in d for f in required) or any(
            t != types[f] for f, t in d.types.items() if f in types):
        raise _Unsupported("a header field of the wrong type, or missing")


def page_header(b: Any, pos: int) -> tuple[dict[int, Any], int]:
    """Returns the PageHeader at ``pos`` of the buffer ``b`` as ``{field id: value}`` and the
    position of the page's data (``_Unsupported`` when it cannot be read)."""
    try:
        h, pos = _struct(b, pos)
    except (IndexError, struct.error) as e:
        raise _Unsupported("page header runs past the chunk") from e
    _check_fields(h, "page")
    for f in (5, 7, 8):
        if f in h:
            _check_fields(h[f], f)
    return h, pos


# ---------------------------------------------------------------- RLE / bit-packed hybrid

class _Runs:
    """The runs of an RLE/bit-packed hybrid, as ``(k,)`` int64 arrays: RLE runs (``rle_i``
    first value index, ``rle_n`` values, ``rle_v`` value) and bit-packed runs (``first``
    value indices, ``sizes`` value counts, ``offs`` byte offsets, ``nbytes`` byte sizes)."""

    __slots__ = ("first", "nbytes", "offs", "rle_i", "rle_n", "rle_v", "sizes")

    def __init__(self, rle: list[np.ndarray], packed: list[np.ndarray]) -> None:
        self.rle_i, self.rle_n, self.rle_v = rle
        self.first, self.sizes, self.offs, self.nbytes = packed


# a run of bytes that repeats (e.g. the repetition levels of rows of one length: the same
# runs for every row) is parsed once and then compared as bytes; periods of up to this many
# runs are looked for, after 2, 4, 8, ... runs parsed one by one
_PERIOD_RUNS = 8


def _tile(parts: list[list[np.ndarray]], lists: tuple[list[int], ...], k: int, m: int,
          steps: tuple[int, ...]) -> None:
    """Moves ``lists`` (the runs parsed one by one) into ``parts`` as arrays, followed by their
    last ``k`` entries repeated ``m`` times, field ``f`` of the ``j``-th copy shifted by
    ``j * steps[f]`` (``j`` from 1)."""
    for f, lst in enumerate(lists):
        a = np.asarray(lst, np.int64)
        parts[f].append(a)
        if k and m:
            shift = np.arange(1, m + 1, dtype=np.int64) * steps[f]
            parts[f].append((a[len(a) - k:][None, :] + shift[:, None]).reshape(-1))
        lst.clear()


def _runs(b: Any, pos: int, end: int, width: int, count: int) -> _Runs:
    """Returns the runs of ``count`` values of ``width`` bits in ``b[pos:end]`` (a bit-packed
    run holds a multiple of 8 values: the last one may go past ``count``).

    Runs are parsed one by one, except where they repeat: where the bytes of the last few runs
    repeat (e.g. the repetition levels of rows of one length: the same runs for every row),
    and where bit-packed runs of one size follow each other (their headers repeat), the
    repeats (as many as fit before ``count`` values and ``end``) are found with one numpy
    comparison and their runs copied, shifted: the same bytes are the same runs."""
    rle_i: list[int] = []
    rle_n: list[int] = []
    rle_v: list[int] = []
    first: list[int] = []
    sizes: list[int] = []
    offs: list[int] = []
    rle_lists, packed_lists = (rle_i, rle_n, rle_v), (first, sizes, offs)
    rle_parts: list[list[np.ndarray]] = [[], [], []]
    packed_parts: list[list[np.ndarray]] = [[], [], []]
    raw: np.ndarray | None = None
    # each run parsed one by one since the last repeat: (byte offset, value index, packed?)
    seen: list[tuple[int, int, bool]] = []
    try_at = 2  # look for repeated runs when ``seen`` holds 2, 4, 8, ... runs
    last_h = -1  # the previous run's header when it was bit-packed
    i = 0
    vbytes = (width + 7) // 8
    try:
        while i < count:
            if pos >= end:
                raise _Unsupported("levels end early")
            at = pos
            h = b[pos]
            pos += 1
            if h >= 0x80:  # a varint of more than one byte
                h &= 0x7F
                shift = 7
                while True:
                    c = b[pos]
                    pos += 1
                    h |= (c & 0x7F) << shift
                    if c < 0x80:
                        break
                    shift += 7
                    if shift > 35:
                        raise _Unsupported("run header too long")
            g = h >> 1
            if g == 0:
                raise _Unsupported("empty run")
            if h & 1:
                seen.append((at, i, True))
                first.append(i)
                sizes.append(g * 8)
                offs.append(pos)
                hl = pos - at
                pos += g * width
                i += g * 8
                if h == last_h and i < count:  # bit-packed runs of one size: more of them?
                    stride = pos - at
                    fits = min((end - pos) // stride, (count - i) // (g * 8))
                    if fits > 0:
                        if raw is None:
                            raw = np.frombuffer(b, np.uint8)
                        heads = raw[pos:pos + fits * stride].reshape(fits, stride)[:, :hl]
                        same = (heads == raw[at:at + hl]).all(axis=1)
                        m = fits if same.all() else int(np.argmin(same))
                        if m:
                            _tile(rle_parts, rle_lists, 0, 0, ())
                            _tile(packed_parts, packed_lists, 1, m, (g * 8, 0, stride))
                            i += m * g * 8
                            pos += m * stride
                            seen = []
                    continue
                last_h = h
            else:
                seen.append((at, i, False))
                rle_i.append(i)
                rle_n.append(g)
                rle_v.append(b[pos] if vbytes == 1 else
                             int.from_bytes(b[pos:pos + vbytes], "little"))
                pos += vbytes
                i += g
                last_h = -1
            if len(seen) < try_at or i >= count:
                continue
            try_at *= 2
            if raw is None:
                raw = np.frombuffer(b, np.uint8)
            for k in range(1, min(_PERIOD_RUNS, len(seen) // 2) + 1):
                p0, i0, _ = seen[-k]  # the last k runs: bytes p0..pos, values i0..i
                size = pos - p0
                if p0 - seen[-2 * k][0] != size or raw[p0 - size:p0].tobytes() != raw[
                        p0:pos].tobytes():
                    continue  # (they do not repeat the k runs before them)
                di = i - i0
                fits = min((end - pos) // size, (count - i) // di)
                if fits > 0:
                    same = (raw[pos:pos + fits * size].reshape(fits, size)
                            == raw[p0:pos]).all(axis=1)
                    m = fits if same.all() else int(np.argmin(same))
                    if m:
                        kp = sum(1 for s in seen[-k:] if s[2])
                        _tile(rle_parts, rle_lists, k - kp, m, (di, 0, 0))
                        _tile(packed_parts, packed_lists, kp, m, (di, 0, size))
                        i += m * di
                        pos += m * size
                        # (few repeats: look again only after as many more runs, so short
                        # repeats cost a numpy comparison per many runs, not per few)
                        seen, try_at = [], 2 if m >= 8 else try_at
                        last_h = -1
                break
    except IndexError as e:
        raise _Unsupported("levels run past the page") from e
    if pos > end:
        raise _Unsupported("levels run past their length")
    _tile(rle_parts, rle_lists, 0, 0, ())
    _tile(packed_parts, packed_lists, 0, 0, ())
    rle = [np.concatenate(p) if len(p) > 1 else p[0] for p in rle_parts]
    packed = [np.concatenate(p) if len(p) > 1 else p[0] for p in packed_parts]
    packed.append(packed[1] // 8 * width)
    return _Runs(rle, packed)


def _unpack(b: Any, r: _Runs, width: int) -> np.ndarray:
    """Returns the values of the bit-packed runs, concatenated, as ``(sum sizes,)`` uint32
    (each run holds groups of 8 values in ``width`` bytes, least significant bit first)."""
    total = 8 * int(r.nbytes.sum()) // width if width else int(r.sizes.sum())
    if width == 0 or total == 0:
        return np.zeros(total, np.uint32)
    raw = np.frombuffer(b, np.uint8)
    nbytes = total // 8 * width
    buf = np.zeros(nbytes + 8, np.uint8)  # 8 spare bytes: each value is read as a uint64
    if len(r.offs) == 1:
        buf[:nbytes] = raw[r.offs[0]:r.offs[0] + nbytes]
    elif nbytes < 64 * len(r.offs):  # many short runs: their bytes gathered at once
        buf[:nbytes] = raw[_aranges(r.offs, r.nbytes)]
    elif (len(r.offs) > 2 and (r.nbytes == r.nbytes[0]).all()
          and (np.diff(r.offs) == r.offs[1] - r.offs[0]).all()):  # runs of one size, strided
        m, step, off = int(r.nbytes[0]), int(r.offs[1] - r.offs[0]), int(r.offs[0])
        k = len(r.offs)
        rows = np.lib.stride_tricks.as_strided(raw[off:], (k, m), (step, 1))
        buf[:nbytes].reshape(k, m)[:] = rows
    else:
        k = 0
        for off, m in zip(r.offs.tolist(), r.nbytes.tolist(), strict=True):
            buf[k:k + m] = raw[off:off + m]
            k += m
    if width == 1:
        return np.unpackbits(buf[:nbytes], bitorder="little").astype(np.uint32)
    if width in (8, 16, 32):
        return buf[:nbytes].view(f"<u{width // 8}").astype(np.uint32)
    groups = total // 8
    out = np.empty((groups, 8), np.uint32)
    mask = np.uint64((1 << width) - 1)
    for j in range(8):  # value j of every group: a uint64 read at a fixed byte, shifted
        bit = j * width
        win = np.ndarray((groups,), "<u8", buf, bit >> 3, (width,))
        out[:, j] = (win >> np.uint64(bit & 7)) & mask
    return out.reshape(-1)


def _place(r: _Runs, values: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns the value indices of the unpacked bit-packed ``values`` and a mask of those
    before ``count`` (the last run's padding is not)."""
    idx = np.repeat(r.first - (np.cumsum(r.sizes) - r.sizes), r.sizes) + np.arange(len(values))
    return idx, idx < count


def _aranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Returns the concatenated ``arange(s, s + n)`` of each ``(s, n)`` of ``(k,)`` int64
    ``starts`` and ``lens``."""
    return np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))


def _hybrid(b: Any, pos: int, end: int, width: int, count: int) -> np.ndarray:
    """Returns ``count`` values of the RLE/bit-packed hybrid in ``b[pos:end]`` as uint32."""
    r = _runs(b, pos, end, width, count)
    values = _unpack(b, r, width)
    if not len(r.rle_i):
        return values[:count]
    out = np.empty(count, np.uint32)
    n = np.minimum(r.rle_n, count - r.rle_i)  # (the last run may go past ``count``)
    if len(n) <= 8:
        for i, k, v in zip(r.rle_i.tolist(), n.tolist(), r.rle_v.tolist(), strict=True):
            out[i:i + k] = v
    else:
        out[_aranges(r.rle_i, n)] = np.repeat(r.rle_v, n)
    if len(r.first):
        idx, ok = _place(r, values, count)
        out[idx[ok]] = values[ok]
    return out


def _all_equal(b: Any, pos: int, end: int, width: int, count: int, level: int) -> bool:
    """Returns whether all ``count`` levels in ``b[pos:end]`` equal ``level``."""
    r = _runs(b, pos, end, width, count)
    if (r.rle_v != level).any():
        return False
    if not len(r.first):
        return True
    values = _unpack(b, r, width)
    bad = values != level
    if not bad.any():
        return True
    _, ok = _place(r, values, count)
    return not bad[ok].any()


def _zeros(b: Any, pos: int, end: int, count: int) -> np.ndarray:
    """Returns the indices of the 1-bit levels in ``b[pos:end]`` that are 0 (row starts)."""
    r = _runs(b, pos, end, 1, count)
    if (r.rle_v > 1).any():
        raise _Unsupported("repetition level above 1")
    zero = r.rle_v == 0
    parts = [_aranges(r.rle_i[zero], r.rle_n[zero])] if zero.any() else []
    if len(r.first):
        values = _unpack(b, r, 1)
        at = np.cumsum(r.sizes) - r.sizes  # where each run starts in ``values``
        k = np.flatnonzero(values == 0)
        run = np.searchsorted(at, k, side="right") - 1
        idx = k - at[run] + r.first[run]
        parts.append(idx[idx < count])  # the last run's padding past ``count`` left out
    if not parts:
        return np.zeros(0, np.int64)
    out = np.concatenate(parts)
    if zero.any() and len(r.first):
        out.sort()
    return out


# ---------------------------------------------------------------- column chunks

@dataclass(frozen=True)
class ChunkInfo:
    """What ``decode_chunk`` needs of one column chunk (from the file's metadata)."""

    path: str  # the file, for errors
    row_group: int
    column: str
    offset: int  # of the first page (the dictionary page's when there is one)
    size: int  # total_compressed_size
    codec: str  # ``ColumnChunkMetaData.compression``
    physical_type: str
    max_def: int
    max_rep: int
    num_values: int  # levels in the chunk
    num_rows: int
    uncompressed: int  # total_uncompressed_size (bounds each page's decompressed size)


def chunk_info(md: Any, path: str, row_group: int, leaf: int, column: str) -> ChunkInfo:
    """Returns the ``ChunkInfo`` of leaf column ``leaf`` of ``row_group`` in the file whose
    ``FileMetaData`` is ``md``."""
    rg = md.row_group(row_group)
    cc = rg.column(leaf)
    sc = md.schema.column(leaf)
    offset = cc.data_page_offset
    if cc.has_dictionary_page and cc.dictionary_page_offset is not None:
        offset = min(offset, cc.dictionary_page_offset)
    return ChunkInfo(path, row_group, column, offset, cc.total_compressed_size, cc.compression,
                     cc.physical_type, sc.max_definition_level, sc.max_repetition_level,
                     cc.num_values, rg.num_rows, cc.total_uncompressed_size)


def _decompress(pa: Any, data: Any, size: int, codec: str | None) -> Any:
    if codec is None:
        if len(data) != size:
            raise _Unsupported("uncompressed page size differs")
        return data
    out = memoryview(pa.decompress(data, decompressed_size=size, codec=codec)).cast("B")
    if len(out) != size:
        raise _Unsupported("decompressed size differs")
    return out


def _check_crc(info: ChunkInfo, page: Any, header: dict[int, Any], at: int) -> None:
    crc = header.get(4)
    if crc is None:
        return
    got = zlib.crc32(page)
    if got != crc & 0xFFFFFFFF:
        raise CorruptParquetError(
            info.path, info.row_group, info.column,
            f"page at byte {at} fails its CRC32 check (stored {crc & 0xFFFFFFFF:#010x}, "
            f"computed {got:#010x})",
        )


def decode_chunk(pa: Any, data: Any, info: ChunkInfo,
                 dest: Callable[[tuple[int, ...], np.dtype], np.ndarray | None] | None = None,
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """Returns a column chunk's ``(num_values,)`` values (its physical type) and, for a list
    column (``max_rep == 1``), the ``(num_rows + 1,)`` int64 offsets of its rows; ``data`` is
    the chunk's bytes. Raises ``_Unsupported`` for what it does not decode (the caller reads
    the chunk with pyarrow) and ``CorruptParquetError`` when a page fails its CRC32.

    ``dest(shape, dtype)``: asked once, before decoding, for a C-contiguous array to decode
    the values into, ``shape`` the column as numpy would hold it when each row has the same
    length: ``(num_rows,)``, or ``(num_rows, num_values // num_rows)`` for a list column (its
    rows' lengths are checked only later, by the caller); None: the values are gathered into
    an array of their own. The values returned are then that array, flattened."""
    dtype = _DTYPES.get(info.physical_type)
    if (dtype is None or info.codec not in _CODECS or info.max_rep > 1
            or len(data) != info.size):
        raise _Unsupported("type, codec or nesting")
    flat = None  # the destination's values, when there is one
    if dest is not None and info.num_rows > 0 and info.num_values % info.num_rows == 0:
        shape = ((info.num_rows,) if not info.max_rep
                 else (info.num_rows, info.num_values // info.num_rows))
        out_arr = dest(shape, dtype)
        if out_arr is not None:
            if (out_arr.dtype != dtype or out_arr.shape != shape
                    or not out_arr.flags.c_contiguous or not out_arr.flags.writeable):
                raise ValueError(f"decode_chunk: dest must return a writable C-contiguous "
                                 f"{shape} {dtype} array, got {out_arr.shape} {out_arr.dtype}")
            flat = out_arr.reshape(-1)
    codec = _CODECS[info.codec]
    mv = memoryview(data).cast("B")
    rep_w = int(info.max_rep).bit_length()
    def_w = int(info.max_def).bit_length()
    values: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    dictionary: np.ndarray | None = None
    done = 0  # values decoded so far
    pos = 0
    while pos < len(mv):
        at = pos
        h, pos = page_header(mv, pos)
        ptype, usize, csize = h.get(1), h.get(2), h.get(3)
        if not (isinstance(usize, int) and isinstance(csize, int)
                and 0 <= usize <= info.uncompressed and csize >= 0):
            raise _Unsupported("page sizes")
        if pos + csize > len(mv):  # (pyarrow raises its own error for it)
            raise _Unsupported("page runs past its column chunk")
        page = mv[pos:pos + csize]
        pos += csize
        _check_crc(info, page, h, info.offset + at)
        if ptype == _INDEX_PAGE:
            continue
        if ptype == _DICTIONARY_PAGE:
            dh = h.get(7)
            if dictionary is not None or values or not isinstance(dh, dict) or dh.get(2) not in (
                    _PLAIN, _PLAIN_DICTIONARY):
                raise _Unsupported("dictionary page")
            n = dh.get(1, -1)
            raw = _decompress(pa, page, usize, codec)
            if n < 0 or len(raw) != n * dtype.itemsize:
                raise _Unsupported("dictionary page size")
            dictionary = np.frombuffer(raw, dtype, n)
            continue
        if ptype == _DATA_PAGE:
            dh = h.get(5)
            if not isinstance(dh, dict):
                raise _Unsupported("data page header")
            n, enc = dh.get(1, -1), dh.get(2)
            if n < 0 or (info.max_def and dh.get(3) != _RLE) or (
                    info.max_rep and dh.get(4) != _RLE):
                raise _Unsupported("level encoding")
            raw = _decompress(pa, page, usize, codec)
            p = 0
            levels = []
            for w in (rep_w, def_w):
                if not w:
                    levels.append(None)
                    continue
                if p + 4 > len(raw):
                    raise _Unsupported("levels")
                m = int.from_bytes(raw[p:p + 4], "little")
                levels.append((p + 4, p + 4 + m))
                p += 4 + m
            rep, dfn = levels
            lv = raw
        elif ptype == _DATA_PAGE_V2:
            dh = h.get(8)
            if not isinstance(dh, dict):
                raise _Unsupported("data page v2 header")
            n, nulls, rows, enc = dh.get(1, -1), dh.get(2, -1), dh.get(3, -1), dh.get(4)
            dlen, rlen = dh.get(5, -1), dh.get(6, -1)
            # num_rows is unused here, but pyarrow rejects a negative one: so do we (fallback)
            if (n < 0 or nulls != 0 or rows < 0 or dlen < 0 or rlen < 0
                    or rlen + dlen > csize):
                raise _Unsupported("v2 page with nulls or bad lengths")
            lv = page
            rep = (0, rlen) if rep_w else None
            dfn = (rlen, rlen + dlen) if def_w else None
            body = page[rlen + dlen:]
            if dh.get(7, True) and codec is not None:
                raw = _decompress(pa, body, usize - rlen - dlen, codec)
            else:
                raw = body
            p = 0
        else:
            raise _Unsupported(f"page type {ptype}")
        if dfn is not None and not _all_equal(lv, dfn[0], dfn[1], def_w, n, info.max_def):
            raise _Unsupported("nulls or empty lists")
        if rep is not None:
            starts.append(_zeros(lv, rep[0], rep[1], n) + done)
        body = raw[p:]
        if flat is not None and done + n > len(flat):
            raise _Unsupported("value count differs from the metadata")
        if enc == _PLAIN:
            if len(body) != n * dtype.itemsize:
                raise _Unsupported("PLAIN values size")
            page_values = np.frombuffer(body, dtype, n)
            if flat is None:
                values.append(page_values)
            else:  # the page's one copy: into the destination
                flat[done:done + n] = page_values
        elif enc in (_RLE_DICTIONARY, _PLAIN_DICTIONARY):
            if dictionary is None or len(body) < 1 or body[0] > 32:
                raise _Unsupported("dictionary indices")
            idx = _hybrid(body, 1, len(body), body[0], n)
            if n and int(idx.max()) >= len(dictionary):
                raise _Unsupported("dictionary index out of range")
            if flat is None:
                values.append(dictionary[idx])
            else:
                # (indices checked above; mode="raise" would buffer the output)
                np.take(dictionary, idx, out=flat[done:done + n], mode="clip")
        else:
            raise _Unsupported(f"encoding {enc}")
        done += n
    if done != info.num_values:
        raise _Unsupported("value count differs from the metadata")
    if flat is not None:
        out = flat
    else:
        out = (values[0] if len(values) == 1 else np.concatenate(values) if values
               else np.zeros(0, dtype))
    if not info.max_rep:
        if done != info.num_rows:
            raise _Unsupported("row count")
        return out, None
    first = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    if len(first) != info.num_rows or (len(first) and first[0] != 0):
        raise _Unsupported("row count")
    return out, np.append(first, done)


# ---------------------------------------------------------------- files

_ARROW = {"float": "FLOAT", "double": "DOUBLE", "int32": "INT32", "int64": "INT64"}


def _leaves(pa: Any, t: Any) -> int:
    if isinstance(t, pa.ExtensionType):
        t = t.storage_type
    if pa.types.is_struct(t):
        return sum(_leaves(pa, t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _leaves(pa, t.key_type) + _leaves(pa, t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _leaves(pa, t.value_type)
    return 1


def _is_list(pa: Any, t: Any) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def plan_columns(pa: Any, pf: Any, columns: list[str]) -> dict[str, tuple[int, Any]]:
    """Returns ``{column: (leaf index, Arrow field)}`` for the ``columns`` of the
    ``ParquetFile`` ``pf`` that ``decode_chunk`` may read: float32/float64/int32/int64 numbers
    or one level of lists of them, stored as the matching physical type."""
    schema, md = pf.schema_arrow, pf.metadata
    leaf, where = 0, {}
    for field in schema:
        where[field.name] = (leaf, field)
        leaf += _leaves(pa, field.type)
    if leaf != md.num_columns or len(where) != len(schema):
        return {}  # a layout this does not follow (or duplicate names): pyarrow reads all
    out = {}
    for c in columns:
        if c not in where:
            continue
        j, field = where[c]
        t = field.type
        is_list = _is_list(pa, t)
        value = t.value_type if is_list else t
        sc = md.schema.column(j)
        if (str(value) in _ARROW and sc.physical_type == _ARROW[str(value)]
                and sc.max_repetition_level == int(is_list)
                and (sc.path == c or sc.path.startswith(c + "."))):
            out[c] = (j, field)
    return out


class FastReader:
    """Reads row groups of one local Parquet file: the columns ``decode_chunk`` handles
    directly from a memory map of the file, the others with pyarrow (``pf``)."""

    def __init__(self, pa: Any, pf: Any, path: str, columns: list[str]) -> None:
        self.pf, self.path = pf, path
        self.plan = plan_columns(pa, pf, columns)
        self._map: Any = None

    def _bytes(self, offset: int, size: int) -> memoryview:
        if self._map is None:
            import mmap

            with open(self.path, "rb") as f:
                self._map = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        if offset < 0 or offset + size > len(self._map):
            raise _Unsupported("column chunk outside the file")
        return self._map[offset:offset + size]

    def _array(self, pa: Any, g: int, c: str, alloc: Any = None) -> Any:
        j, field = self.plan[c]
        info = chunk_info(self.pf.metadata, self.path, g, j, c)
        dest = None if alloc is None else (lambda shape, dtype: alloc(c, shape, dtype))
        values, offsets = decode_chunk(pa, self._bytes(info.offset, info.size), info, dest)
        t = field.type
        if offsets is None:
            return pa.array(values, type=t)
        vals = pa.array(values, type=t.value_type)
        if pa.types.is_fixed_size_list(t):
            if not (np.diff(offsets) == t.list_size).all():
                raise _Unsupported("fixed-size lists of other sizes")
            return pa.FixedSizeListArray.from_arrays(vals, type=t)
        if pa.types.is_large_list(t):
            return pa.LargeListArray.from_arrays(pa.array(offsets), vals, type=t)
        if offsets[-1] >= 2**31:
            raise _Unsupported("list offsets past int32")
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), vals, type=t)

    def read_row_group(self, pa: Any, g: int, columns: list[str],
                       alloc: Callable[[str, tuple[int, ...], np.dtype], np.ndarray | None]
                       | None = None) -> Any:
        """Returns row group ``g``'s ``columns`` as a ``pyarrow.Table`` (what
        ``ParquetFile.read_row_group`` returns, the same values). ``alloc(column, shape,
        dtype)``: where to decode a column's values (``decode_chunk``'s ``dest``); the
        table's column then wraps that memory (pyarrow wraps numbers without copying them)."""
        fast: dict[str, Any] = {}
        for c in columns:
            if c in self.plan and c not in fast:
                try:
                    fast[c] = self._array(pa, g, c, alloc)
                except (_Unsupported, TypeError, ValueError, IndexError, OSError, struct.error):
                    # (a header this misreads, e.g. a damaged file, is also left to pyarrow)
                    del self.plan[c]  # nulls, empty lists, other encodings: pyarrow from now
        if not fast:
            return self.pf.read_row_group(g, columns=columns, use_threads=False)
        rest = [c for c in columns if c not in fast]
        table = (self.pf.read_row_group(g, columns=rest, use_threads=False) if rest
                 else None)
        schema = self.pf.schema_arrow
        arrays = [fast[c] if c in fast else table.column(c) for c in columns]
        return pa.Table.from_arrays(arrays, schema=pa.schema([schema.field(c) for c in columns]))
