"""The direct Parquet column-chunk decoder (``torchfn/data/_pqdecode.py``) against pyarrow."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from torchfn.data import ParquetSource  # noqa: E402
from torchfn.data._pqdecode import (  # noqa: E402
    CorruptParquetError,
    FastReader,
    _hybrid,
    _struct,
    _Unsupported,
    _zeros,
    chunk_info,
    page_header,
)

# ------------------------------------------------ a Thrift compact-protocol writer (the oracle)


def _uvarint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _zz(n):
    return _uvarint((n << 1) ^ (n >> 63))


def _enc_value(t, v):
    if t in (4, 5, 6):
        return _zz(v)
    if t == 3:
        return struct.pack("<b", v)
    if t == 7:
        return struct.pack("<d", v)
    if t == 8:
        return _uvarint(len(v)) + v
    if t == 9:
        et, items = v
        n = len(items)
        head = bytes([(n << 4) | et]) if n < 15 else bytes([0xF0 | et]) + _uvarint(n)
        body = b"".join(bytes([1 if x else 2]) if et in (1, 2) else _enc_value(et, x)
                        for x in items)
        return head + body
    if t == 11:
        kt, vt, pairs = v
        if not pairs:
            return b"\x00"
        return _uvarint(len(pairs)) + bytes([(kt << 4) | vt]) + b"".join(
            _enc_value(kt, k) + _enc_value(vt, x) for k, x in pairs)
    if t == 12:
        return _enc_struct(v)
    raise AssertionError(t)


def _enc_struct(fields):
    """``fields``: [(id, type, value)] in increasing id order (type 1 / 2: bool)."""
    out, last = bytearray(), 0
    for fid, t, v in fields:
        if t in (1, 2):
            t, body = (1 if v else 2), b""
        else:
            body = _enc_value(t, v)
        d = fid - last
        out += bytes([(d << 4) | t]) if 0 < d <= 15 else bytes([t]) + _zz(fid)
        out += body
        last = fid
    return bytes(out + b"\x00")


def _expected(fields):
    out = {}
    for fid, t, v in fields:
        if t in (1, 2):
            out[fid] = bool(v)
        elif t == 12:
            out[fid] = _expected(v)
        elif t == 9:
            out[fid] = [bool(x) for x in v[1]] if v[0] in (1, 2) else list(v[1])
        elif t == 11:
            out[fid] = [x for pair in v[2] for x in pair]
        else:
            out[fid] = v
    return out


_scalar = st.one_of(
    st.tuples(st.just(5), st.integers(-2**31, 2**31 - 1)),
    st.tuples(st.just(6), st.integers(-2**63, 2**63 - 1)),
    st.tuples(st.just(4), st.integers(-2**15, 2**15 - 1)),
    st.tuples(st.just(3), st.integers(-128, 127)),
    st.tuples(st.just(7), st.floats(allow_nan=False)),
    st.tuples(st.just(8), st.binary(max_size=40)),
    st.tuples(st.just(1), st.booleans()),
    st.tuples(st.just(9), st.tuples(st.just(5), st.lists(st.integers(-99, 99), max_size=20))),
    st.tuples(st.just(9), st.tuples(st.just(1), st.lists(st.booleans(), max_size=20))),
    st.tuples(st.just(11), st.tuples(st.just(8), st.just(5), st.lists(
        st.tuples(st.binary(max_size=5), st.integers(-9, 9)), max_size=4))),
)


@st.composite
def _structs(draw, depth=0):
    ids = sorted(draw(st.sets(st.integers(1, 40), max_size=7)))
    fields = []
    for fid in ids:
        if depth < 2 and draw(st.integers(0, 5)) == 0:
            fields.append((fid, 12, draw(_structs(depth + 1))))
        else:
            t, v = draw(_scalar)
            fields.append((fid, t, v))
    return fields


@settings(max_examples=200, deadline=None)
@given(fields=_structs(), prefix=st.binary(max_size=3), suffix=st.binary(max_size=3))
def test_thrift_compact_struct_matches_the_writer(fields, prefix, suffix):
    enc = _enc_struct(fields)
    got, end = _struct(memoryview(prefix + enc + suffix), len(prefix))
    assert end == len(prefix) + len(enc)
    assert got == _expected(fields)


def test_page_header_reads_a_real_one_and_skips_unknown_fields():
    # PageHeader{type=DATA_PAGE, 100, 80, crc, data_page_header={...}} plus fields it does not
    # know (a future field 20 of each kind; statistics as a nested struct)
    dph = [(1, 5, 7), (2, 5, 0), (3, 5, 3), (4, 5, 3),
           (5, 12, [(1, 8, b"\x00" * 4), (3, 6, 0), (5, 8, b"ab"), (7, 1, True)])]
    hdr = _enc_struct([(1, 5, 0), (2, 5, 100), (3, 5, 80), (4, 5, -5), (5, 12, dph),
                       (20, 9, (12, [[(1, 5, 1)], [(2, 8, b"x")]])),
                       (21, 11, (5, 12, [(1, [(1, 5, 2)])])), (300, 7, 1.5)])
    h, end = page_header(memoryview(hdr + b"DATA"), 0)
    assert end == len(hdr) and h[1] == 0 and h[2] == 100 and h[3] == 80 and h[4] == -5
    assert h[5][1] == 7 and h[5][5][7] is True and h[300] == 1.5
    with pytest.raises(_Unsupported):
        page_header(memoryview(hdr[:-3]), 0)  # truncated


# ------------------------------------------------ the RLE / bit-packed hybrid


def _enc_hybrid(runs, width):
    """``runs``: [("rle", value, n) | ("packed", values (len a multiple of 8))]."""
    out = bytearray()
    for r in runs:
        if r[0] == "rle":
            out += _uvarint(r[2] << 1) + int(r[1]).to_bytes((width + 7) // 8, "little")
        else:
            vals = r[1]
            out += _uvarint(((len(vals) // 8) << 1) | 1)
            bits = 0
            for j, v in enumerate(vals):
                bits |= int(v) << (j * width)
            out += bits.to_bytes(len(vals) // 8 * width, "little")
    return bytes(out)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), width=st.integers(1, 32), pad=st.integers(0, 7))
def test_hybrid_matches_a_plain_encoder(data, width, pad):
    top = (1 << width) - 1
    runs, expect = [], []
    for _ in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()):
            v, n = data.draw(st.integers(0, top)), data.draw(st.integers(1, 300))
            runs.append(("rle", v, n))
            expect += [v] * n
        else:
            vals = data.draw(st.lists(st.integers(0, top), min_size=1, max_size=12)) * 3
            vals += [0] * (-len(vals) % 8)
            runs.append(("packed", vals))
            expect += vals
    count = len(expect) - (pad if runs[-1][0] == "packed" else 0)
    enc = _enc_hybrid(runs, width)
    got = _hybrid(memoryview(b"\x09" + enc), 1, len(enc) + 1, width, count)
    assert got.dtype == np.uint32 and got.tolist() == expect[:count]
    if width == 1:
        zeros = _zeros(memoryview(enc), 0, len(enc), count)
        assert zeros.tolist() == [i for i, v in enumerate(expect[:count]) if v == 0]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), width=st.integers(1, 24), pad=st.integers(0, 7),
       copies=st.integers(1, 40))
def test_hybrid_with_repeated_runs_matches_a_plain_encoder(data, width, pad, copies):
    """Repeated runs (the rows of a fixed-length list column: the same runs for every row) and
    chains of bit-packed runs of one size are parsed once and then compared as bytes: the
    values are those of a plain encoder, with a prefix, a changed copy and a tail breaking
    the repeats anywhere."""
    top = (1 << width) - 1

    def run():
        if data.draw(st.booleans()):
            return ("rle", data.draw(st.integers(0, top)), data.draw(st.integers(1, 100)))
        groups = data.draw(st.integers(1, 3))
        return ("packed", data.draw(st.lists(st.integers(0, top), min_size=8 * groups,
                                             max_size=8 * groups)))

    prefix = [run() for _ in range(data.draw(st.integers(0, 3)))]
    block = [run() for _ in range(data.draw(st.integers(1, 4)))]
    runs = prefix + block * copies
    if data.draw(st.booleans()):  # one copy changed (a bit-packed chain: same header)
        k = data.draw(st.integers(len(prefix), len(runs) - 1))
        if runs[k][0] == "packed":
            runs[k] = ("packed", [(v + 1) & top for v in runs[k][1]])
        else:
            runs[k] = ("rle", (runs[k][1] + 1) & top, runs[k][2])
    runs += [run() for _ in range(data.draw(st.integers(0, 3)))]
    expect = []
    for r in runs:
        expect += [r[1]] * r[2] if r[0] == "rle" else r[1]
    count = len(expect) - (pad if runs[-1][0] == "packed" else 0)
    enc = _enc_hybrid(runs, width)
    got = _hybrid(memoryview(b"\x09" + enc), 1, len(enc) + 1, width, count)
    assert got.dtype == np.uint32 and got.tolist() == expect[:count]
    cut = data.draw(st.integers(1, count))  # fewer values asked for than the runs hold
    assert _hybrid(memoryview(enc), 0, len(enc), width, cut).tolist() == expect[:cut]
    if width == 1:
        zeros = _zeros(memoryview(enc), 0, len(enc), count)
        assert zeros.tolist() == [i for i, v in enumerate(expect[:count]) if v == 0]


def test_fixed_lists_with_a_dictionary_page_read_as_pyarrow_reads_them(tmp_path):
    """The benchmark's layout (``benchmarks/data_sources.py`` small): rows of 784 float32 in
    row groups of 1024, the first page dictionary encoded (19-bit indices in a chain of
    bit-packed runs of one size), the rest PLAIN; the row starts come from repeated runs."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2500, 784), dtype=np.float32)
    offsets = np.arange(0, x.size + 1, 784, dtype=np.int32)
    col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(x.reshape(-1)))
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"x": col, "label": pa.array(np.arange(2500) % 10)}), path,
                   row_group_size=1024)
    pf = pq.ParquetFile(path)
    reader = FastReader(pa, pf, str(path), ["x", "label"])
    for g in range(pf.metadata.num_row_groups):
        got = reader.read_row_group(pa, g, ["x", "label"])
        assert sorted(reader.plan) == ["label", "x"]  # (no fallback to pyarrow)
        assert got.equals(pf.read_row_group(g, columns=["x", "label"]))


# ------------------------------------------------ column chunks against pyarrow

_CODECS = ["snappy", "zstd", "gzip", "none", "lz4", "brotli"]
_TYPES = {"float32": (pa.float32(), np.float32), "float64": (pa.float64(), np.float64),
          "int64": (pa.int64(), np.int64), "int32": (pa.int32(), np.int32)}


def _column(rng, n, dtype, kind, few, holes):
    pat, npt = _TYPES[dtype]
    width = int(rng.integers(1, 40))

    def values(m):
        if few:  # a few distinct values: dictionary encoded throughout
            return rng.integers(0, 5, m).astype(npt)
        return (rng.standard_normal(m) * 1000).astype(npt)

    if kind == "scalar":
        v = values(n)
        mask = (rng.random(n) < 0.2) if holes else None
        return pa.array(v, type=pat, mask=mask)
    lengths = (np.full(n, width) if kind == "fixed" else rng.integers(1, 2 * width, n))
    rows = [values(int(k)).tolist() for k in lengths]
    if holes:
        for i in range(0, n, 7):
            rows[i] = [] if i % 2 else None
        if n > 3 and rows[3]:
            rows[3][0] = None  # a null element
    return pa.array(rows, type=pa.list_(pat))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 300), dtype=st.sampled_from(sorted(_TYPES)),
       kind=st.sampled_from(["fixed", "varying", "scalar"]), few=st.booleans(),
       holes=st.sampled_from([False, False, False, True]), codec=st.sampled_from(_CODECS),
       version=st.sampled_from(["1.0", "2.0"]), page=st.sampled_from([None, 64, 1000, 5000]),
       dictionary=st.booleans(), group=st.sampled_from([1, 7, 64, 1000]),
       stats=st.booleans(), crc=st.booleans())
def test_fast_reader_matches_pyarrow(tmp_path_factory, seed, n, dtype, kind, few, holes, codec,
                                     version, page, dictionary, group, stats, crc):
    rng = np.random.default_rng(seed)
    table = pa.table({"x": _column(rng, n, dtype, kind, few, holes),
                      "s": pa.array([f"r{i}" for i in range(n)]),  # strings: pyarrow
                      "k": pa.array(np.arange(n, dtype=np.int64))})
    path = str(tmp_path_factory.mktemp("pq") / "a.parquet")
    kw = {} if page is None else {"data_page_size": page}
    pq.write_table(table, path, compression=codec, data_page_version=version,
                   use_dictionary=dictionary, row_group_size=group, write_statistics=stats,
                   write_page_checksum=crc, **kw)
    pf = pq.ParquetFile(path, memory_map=True)
    reader = FastReader(pa, pf, path, ["x", "s", "k"])
    assert sorted(reader.plan) == ["k", "x"]
    for g in range(pf.metadata.num_row_groups):
        for cols in (["x", "s", "k"], ["k", "x"], ["x"]):
            got = reader.read_row_group(pa, g, cols)
            want = pf.read_row_group(g, columns=cols, use_threads=False)
            assert got.schema.equals(want.schema) and got.equals(want), (g, cols)
            placed = {}

            def alloc(c, shape, dtype, placed=placed):  # destinations full of garbage
                placed[c] = np.full(shape, 7, dtype)
                return placed[c]

            got = reader.read_row_group(pa, g, cols, alloc)  # decoded into the destinations
            assert got.schema.equals(want.schema) and got.equals(want), (g, cols)
            if "k" in reader.plan and "k" in cols:
                assert np.shares_memory(got.column("k").chunks[0].to_numpy(), placed["k"])
    # pyarrow's "lz4" is Hadoop-framed LZ4 (codec LZ4, not LZ4_RAW): left to pyarrow
    direct = pf.metadata.row_group(0).column(0).compression != "LZ4"
    assert ("k" in reader.plan) == direct  # int64 without nulls
    col = table.column("x").combine_chunks()
    clean = col.null_count == 0 and (kind == "scalar" or (
        pc.min(pc.list_value_length(col)).as_py() > 0
        and col.flatten().null_count == 0))
    assert ("x" in reader.plan) == (direct and clean)  # nulls / empty lists: pyarrow


def _fixed_table(n=64, width=12, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)
    return x, pa.table({"x": pa.array(list(x), type=pa.list_(pa.float32())),
                        "label": pa.array(np.arange(n) % 3)})


@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_a_flipped_byte_fails_the_page_crc(tmp_path, version):
    x, table = _fixed_table()
    path = str(tmp_path / "a.parquet")
    pq.write_table(table, path, row_group_size=16, write_page_checksum=True,
                   data_page_version=version, use_dictionary=False, data_page_size=256)
    pf = pq.ParquetFile(path)
    info = chunk_info(pf.metadata, path, 2, 0, "x")
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    h, data = page_header(memoryview(raw), info.offset)
    assert 4 in h  # the page carries a CRC
    raw[data + h[3] // 2] ^= 0x10  # a value byte of the first page of row group 2
    with open(path, "wb") as f:
        f.write(raw)
    reader = FastReader(pa, pq.ParquetFile(path, memory_map=True), path, ["x"])
    assert reader.read_row_group(pa, 1, ["x"]).column("x").to_pylist() == x[16:32].tolist()
    with pytest.raises(CorruptParquetError, match=r"corrupt Parquet file '.*a\.parquet' "
                       r"\(row group 2, column 'x'\): page at byte \d+ fails its CRC32 check"):
        reader.read_row_group(pa, 2, ["x"])
    src = ParquetSource(path, label_column="label")
    assert np.array_equal(src.read([17, 5])["x"].numpy(), x[[17, 5]])
    with pytest.raises(CorruptParquetError, match=r"row group 2, column 'x'"):
        src.read([40])


def test_parquet_source_reads_the_same_through_the_fast_path(tmp_path, monkeypatch):
    x, table = _fixed_table(n=200, width=48, seed=3)
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=32)  # dictionary -> PLAIN
    ids = np.random.default_rng(1).permutation(200)[:77]
    src = ParquetSource(tmp_path, label_column="label", shared_cache=False)
    b = src.read(ids)
    assert b["x"].dtype.is_floating_point and np.array_equal(b["x"].numpy(), x[ids])
    assert isinstance(src._pfiles[0], FastReader) and sorted(src._pfiles[0].plan) == ["x"]

    def no_fast(self, pa, g, c):
        raise _Unsupported("off")

    monkeypatch.setattr(FastReader, "_array", no_fast)  # everything through pyarrow
    slow = ParquetSource(tmp_path, label_column="label", shared_cache=False).read(ids)
    assert np.array_equal(slow["x"].numpy(), b["x"].numpy())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), version=st.sampled_from(["1.0", "2.0"]),
       codec=st.sampled_from(["snappy", "none"]), dictionary=st.booleans(),
       flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
                      min_size=1, max_size=3))
def test_a_damaged_file_without_crcs_reads_as_pyarrow_reads_it(tmp_path_factory, seed, version,
                                                                codec, dictionary, flips):
    """Damaged bytes: the same values as pyarrow, or pyarrow's own error (the decoder leaves a
    chunk it cannot read to pyarrow)."""
    rng = np.random.default_rng(seed)
    n = 40
    table = pa.table({"x": _column(rng, n, "float32", "fixed", bool(seed % 2), False),
                      "k": pa.array(np.arange(n, dtype=np.int64))})
    path = str(tmp_path_factory.mktemp("pq") / "a.parquet")
    pq.write_table(table, path, compression=codec, data_page_version=version,
                   use_dictionary=dictionary, row_group_size=n, data_page_size=200)
    pf = pq.ParquetFile(path)
    info = chunk_info(pf.metadata, path, 0, 0, "x")
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    for at, xor in flips:  # inside the column chunk of "x"
        raw[info.offset + int(at * info.size)] ^= xor
    with open(path, "wb") as f:
        f.write(raw)
    pf = pq.ParquetFile(path, memory_map=True)
    try:
        want = pf.read_row_group(0, columns=["x", "k"], use_threads=False)
    except Exception as e:  # pyarrow's error, whichever it is
        want = type(e)
    reader = FastReader(pa, pf, path, ["x", "k"])
    try:
        got = reader.read_row_group(pa, 0, ["x", "k"])
    except Exception as e:
        got = type(e)
    if isinstance(want, type) or isinstance(got, type):
        assert got == want
    else:  # the same bits (a damaged value may be a NaN)
        assert got.schema.equals(want.schema)
        for c in ("x", "k"):
            a, b = got.column(c).combine_chunks(), want.column(c).combine_chunks()
            if c == "x":
                assert np.array_equal(a.offsets, b.offsets) and a.null_count == b.null_count
                a, b = a.flatten(), b.flatten()
            if a.null_count or b.null_count:  # damaged levels: nulls where pyarrow has them
                assert a.is_null().equals(b.is_null())
                a, b = a.fill_null(0), b.fill_null(0)
            assert a.to_numpy().view(np.int32 if c == "x" else np.int64).tolist() == \
                b.to_numpy().view(np.int32 if c == "x" else np.int64).tolist()
