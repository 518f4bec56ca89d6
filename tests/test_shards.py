"""Shard format: round trip, memory mapping, atomic writes, corrupt and truncated shards."""

from __future__ import annotations

import base64
import json
import os
import struct
import zlib

import numpy as np
import pytest
import torch
import xxhash

from torchfn.data import _stream
from torchfn.data._shards import (
    MANIFEST,
    CorruptShardError,
    ShardReader,
    ShardWriter,
    read_manifest,
    verify_shards,
)
from torchfn.data._stream import StreamingDataset

CHECKSUMS = ["xxh3_64", "crc32"]


def _samples(n: int, seed: int = 0) -> list[tuple[dict, int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        out.append((
            {
                "x": torch.randn(5, generator=g, dtype=torch.float64),
                "img": torch.randint(0, 255, (3, 2, 2), generator=g, dtype=torch.uint8),
                "h": torch.randn(2, generator=g).to(torch.bfloat16),
                "np": np.arange(i % 3 + 1, dtype=np.int32) * i,  # ragged, numpy
            },
            i % 4,
        ))
    return out


def _write(root, samples, per_shard, checksum="xxh3_64"):
    ragged = ["np"] if "np" in samples[0][0] else []
    with ShardWriter(root, samples_per_shard=per_shard, checksum=checksum, ragged=ragged) as w:
        for s, lab in samples:
            w.write(s, label=lab)


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_round_trip_exact_and_manifest(tmp_path, checksum):
    samples = _samples(11)
    _write(tmp_path, samples, 4, checksum)
    m = read_manifest(tmp_path)
    assert [s["num_samples"] for s in m["shards"]] == [4, 4, 3]
    assert [lab for s in m["shards"] for lab in s["labels"]] == [lab for _, lab in samples]
    assert m["num_samples"] == 11
    assert m["fields"]["img"]["dtype"] == "uint8" and m["fields"]["h"]["dtype"] == "bfloat16"
    k = 0
    for shard in m["shards"]:
        r = ShardReader(tmp_path / shard["file"])
        assert r.num_samples == shard["num_samples"] and not r.bad
        assert r.checksum == checksum and all(r.check(i) for i in range(r.num_samples))
        for i in range(r.num_samples):
            got, (want, lab) = r.sample(i), samples[k]
            assert r.labels[i] == lab
            for name, v in want.items():
                v = torch.as_tensor(v)
                assert got[name].dtype == v.dtype and torch.equal(got[name], v), (name, k)
            k += 1
    assert k == 11
    # no temp files left behind by the atomic writes
    assert sorted(os.listdir(tmp_path)) == [MANIFEST, *(s["file"] for s in m["shards"])]


def test_reads_are_zero_copy_views_of_the_memory_map(tmp_path):
    _write(tmp_path, _samples(6), 6)
    r = ShardReader(tmp_path / "shard-00000.tfs")
    block = r.fixed("x")
    assert block is not None and block.shape == (6, 5)
    s = r.sample(3)["x"]
    assert s.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
    assert r.fixed("np") is None  # ragged field: no block
    # data starts 64-byte aligned
    assert block.data_ptr() % 64 == 0


def test_writer_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="samples_per_shard"):
        ShardWriter(tmp_path / "a", samples_per_shard=0)
    with pytest.raises(
        ValueError, match=r"ShardWriter\(checksum=\.\.\.\): expected one of 'xxh3_64', 'crc32', got 'md5'"
    ):
        ShardWriter(tmp_path / "a", samples_per_shard=2, checksum="md5")
    w = ShardWriter(tmp_path / "b", samples_per_shard=2)
    with pytest.raises(TypeError, match="field 'x'"):
        w.write({"x": [1, 2]}, label=0)
    with pytest.raises(ValueError, match="reserved"):
        w.write({"label": torch.zeros(1)}, label=0)
    w.write({"x": torch.zeros(1)}, label=0)
    with pytest.raises(ValueError, match="same fields"):
        w.write({"y": torch.zeros(1)}, label=0)
    _write(tmp_path / "c", _samples(2), 2)
    with pytest.raises(FileExistsError, match="manifest already exists"):
        ShardWriter(tmp_path / "c", samples_per_shard=2)


def _data_offset(path, field, i):
    r = ShardReader(path)
    meta = r.fields[field]
    return meta["offset"] + i * meta["nbytes"]


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.parametrize("field", ["x", "np"])  # a fixed field, a ragged field
def test_corrupt_sample_error_names_file_and_sample(tmp_path, checksum, field):
    _write(tmp_path, _samples(8), 4, checksum)
    path = tmp_path / "shard-00001.tfs"
    r0 = ShardReader(path)
    meta = r0.fields[field]
    offset = meta["offset"] + (meta["offsets"][2] if field == "np" else 2 * meta["nbytes"] + 3)
    del r0
    _flip(path, offset)
    r = ShardReader(path)
    assert [r.check(i) for i in range(4)] == [True, True, False, True]
    with pytest.raises(
        CorruptShardError, match=rf"shard-00001\.tfs.*sample 2.*{checksum} checksum mismatch"
    ):
        r.sample(2)
    assert torch.isfinite(r.sample(1)["x"]).all()
    rep = verify_shards(tmp_path)
    assert rep.bad_ids == [6] and rep.bad[0][2] == 2 and not rep.ok
    assert rep.bad[0][3] == f"{checksum} checksum mismatch"
    assert verify_shards(tmp_path, full=False).ok  # structure is intact


def test_truncated_shard_reports_first_missing_sample(tmp_path):
    _write(tmp_path, _samples(8), 8)
    path = tmp_path / "shard-00000.tfs"
    cut = _data_offset(path, "x", 5) + 1  # the 'x' block is the last block: x[5:] are cut
    r0 = ShardReader(path)
    assert max(m["offset"] for m in r0.fields.values()) == r0.fields["x"]["offset"]
    del r0
    with open(path, "r+b") as f:
        f.truncate(cut)
    r = ShardReader(path)
    assert sorted(r.bad) == [5, 6, 7]
    with pytest.raises(CorruptShardError, match=r"shard-00000\.tfs.*sample 5.*truncated"):
        r.sample(5)
    assert r.sample(4)["x"].shape == (5,)
    assert verify_shards(tmp_path, full=False).bad_ids == [5, 6, 7]


def test_corrupt_header_names_file(tmp_path):
    _write(tmp_path, _samples(4), 2)
    path = tmp_path / "shard-00001.tfs"
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"#")
    with pytest.raises(CorruptShardError, match=r"shard-00001\.tfs.*header"):
        ShardReader(path)
    assert verify_shards(tmp_path, full=False).bad_ids == [2, 3]


def _stream_dir(tmp_path, n=24, per_shard=6, checksum="xxh3_64"):
    with ShardWriter(tmp_path, samples_per_shard=per_shard, checksum=checksum) as w:
        for i in range(n):
            w.write({"x": torch.full((3,), float(i), dtype=torch.float64)}, label=i % 3)
    return tmp_path


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.parametrize("read_path", ["mmap", "readinto"])
def test_stream_raise_mode_names_file_sample_and_id(tmp_path, checksum, read_path, monkeypatch):
    if read_path == "readinto":  # tiny samples take the preadv batch path too
        monkeypatch.setattr(_stream, "_READ_MIN_BYTES", 1)
    root = _stream_dir(tmp_path, checksum=checksum)
    path = root / "shard-00002.tfs"
    _flip(path, _data_offset(path, "x", 4))
    ds = StreamingDataset(root, batch_size=5, seed=3)
    with pytest.raises(
        CorruptShardError,
        match=rf"shard-00002\.tfs.*sample 4.*{checksum} checksum mismatch; global id 16",
    ):
        list(ds)
    with pytest.raises(CorruptShardError, match="sample 4"):
        ds.verify()


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_stream_skip_mode_reports_and_keeps_exactly_once(tmp_path, checksum):
    root = _stream_dir(tmp_path, checksum=checksum)
    p1, p3 = root / "shard-00001.tfs", root / "shard-00003.tfs"
    _flip(p1, _data_offset(p1, "x", 1))  # checksum failure: global id 7
    with open(p3, "r+b") as f:  # truncation: global ids 22, 23
        f.truncate(_data_offset(p3, "x", 4) + 2)
    # found on the fly: dropped from the stream and reported
    ds = StreamingDataset(root, batch_size=4, seed=1, on_corrupt="skip", meta=True)
    assert [b[0] for b in ds.skipped] == [22, 23]  # structural check at construction
    seen = torch.cat([b["id"] for b in ds]).tolist()
    assert sorted(b[0] for b in ds.skipped) == [7, 22, 23]
    assert sorted(seen) == sorted(set(range(24)) - {7, 22, 23})
    # found up front by verify(): excluded from the plan, so ranks stay equal
    per_rank = []
    for rank in range(2):
        ds = StreamingDataset(root, batch_size=4, seed=1, on_corrupt="skip", meta=True,
                              world_size=2, rank=rank)
        rep = ds.verify()
        assert rep.bad_ids == [7, 22, 23]
        ids = torch.cat([b["id"] for b in ds]).tolist()
        x = torch.cat([b["x"][:, 0] for b in ds])
        assert x.long().tolist() == ids  # contents follow ids
        per_rank.append(ids)
    assert len(per_rank[0]) == len(per_rank[1]) == 10  # 21 good samples, drop 1
    both = per_rank[0] + per_rank[1]
    assert len(set(both)) == 20 and not set(both) & {7, 22, 23}


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_header_json_matches_documented_layout(tmp_path, checksum):
    samples = _samples(3)
    _write(tmp_path, samples, 3, checksum)
    raw = (tmp_path / "shard-00000.tfs").read_bytes()
    assert raw[:8] == b"TFSHARD\x01"
    hlen, hcrc = struct.unpack("<QI", raw[8:20])
    assert zlib.crc32(raw[32 : 32 + hlen]) == hcrc  # the header keeps its CRC32
    header = json.loads(raw[32 : 32 + hlen])
    assert header["num_samples"] == 3 and header["checksum"] == checksum
    assert header["file_bytes"] == len(raw)
    assert all(m["offset"] % 64 == 0 for m in header["fields"].values())
    # documented checksum: the algorithm chained over the fields in name order, from 0
    algorithm = {"xxh3_64": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}[checksum]
    want = []
    for s, _ in samples:
        value = 0
        for name in sorted(s):
            value = algorithm(_bytes(s[name]), value)
        want.append(value)
    assert header[checksum] == want
    if checksum == "crc32":  # = the CRC32 of the sample's bytes, concatenated (old definition)
        for (s, _), v in zip(samples, want, strict=True):
            assert v == zlib.crc32(b"".join(_bytes(s[k]) for k in sorted(s)))


def _bytes(v) -> bytes:
    return torch.as_tensor(v).reshape(-1).view(torch.uint8).numpy().tobytes()


def test_single_field_xxh3_is_the_plain_digest_and_keeps_all_64_bits(tmp_path):
    xs = [torch.arange(12, dtype=torch.float32) + k for k in range(64)]
    digests = [xxhash.xxh3_64_intdigest(x.numpy().tobytes()) for x in xs]
    assert max(digests) >= 2**63  # values past int64 go through JSON and compare exactly
    _write(tmp_path, [({"x": x}, 0) for x in xs], 64)
    r = ShardReader(tmp_path / "shard-00000.tfs")
    assert r.checksum == "xxh3_64" and r.checksums == digests
    assert all(r.check(i) for i in range(64))


# A shard written by torchfn before the "checksum" header field existed (commit d0d986b):
#   ShardWriter(d, samples_per_shard=3); sample i = {"x": arange(4, float32) + 10 * i,
#   "r": arange(i + 1, int16) * (i + 1)}, label i. Its header has a "crc32" list and no
#   "checksum" key. Stored zlib-compressed, base64-encoded (448 bytes).
_OLD_SHARD = (
    "eNqdkMtKxDAUQDMKfoQryTpIHm362DgFEZei7kIZOp3EKaQPkigOQ8FP0Z1Ll36ed8ZXceklJ4TSc0J7e3FzWVyf"
    "z45naD938UuKJrPFpndtFXCOQ+/qtelO/bpyK48JftDON32Hc0Zwd98ufNUOVnucC4JttdQWjooSRnhJsGm0BSvf"
    "YrfbVmEzaIg2XWASWhAddqpSrCQKBCVKsHpjvA6fHU4kYfznIVzD6Ujw4zRnbF8Fwb+D4EUgdMtN2MWZnMhpNIJd"
    "uxpezxXPBEvjTEQJEZJTKZMsYYRRxmMa83T/AVYvvkJRlI6//+gAOERH6P/zdAbbHBZwUiBEgTlwBTwDr8Ab8F78"
    "NT8AXfdfTw=="
)
_OLD_MANIFEST = {
    "format": "torchfn.shards", "version": 1, "num_samples": 3,
    "fields": {"x": {"dtype": "float32"}, "r": {"dtype": "int16"}},
    "shards": [{"file": "shard-00000.tfs", "num_samples": 3, "labels": [0, 1, 2], "bytes": 448}],
}


def _old_dir(root):
    root.mkdir(parents=True, exist_ok=True)
    (root / "shard-00000.tfs").write_bytes(zlib.decompress(base64.b64decode(_OLD_SHARD)))
    (root / MANIFEST).write_text(json.dumps(_OLD_MANIFEST))
    return root


@pytest.mark.parametrize("read_path", ["mmap", "readinto"])
def test_shards_without_checksum_field_read_and_verify_as_crc32(tmp_path, read_path,
                                                                monkeypatch):
    if read_path == "readinto":
        monkeypatch.setattr(_stream, "_READ_MIN_BYTES", 1)
    root = _old_dir(tmp_path / "old")
    path = root / "shard-00000.tfs"
    raw = path.read_bytes()
    header = json.loads(raw[32 : 32 + struct.unpack("<Q", raw[8:16])[0]])
    assert "checksum" not in header and len(header["crc32"]) == 3  # really the old layout
    r = ShardReader(path)
    assert r.checksum == "crc32" and r.checksums == header["crc32"]
    for i in range(3):
        got = r.sample(i)
        assert torch.equal(got["x"], torch.arange(4, dtype=torch.float32) + 10 * i)
        assert torch.equal(got["r"], torch.arange(i + 1, dtype=torch.int16) * (i + 1))
    assert verify_shards(root).ok
    ds = StreamingDataset(root, batch_size=3, shuffle=False)
    (batch,) = list(ds)
    assert batch["label"].tolist() == [0, 1, 2] and batch["r"][2].tolist() == [0, 3, 6]
    # corruption of one byte is still found, with the old algorithm named
    _flip(path, r.fields["x"]["offset"] + 1 * 16 + 5)
    del r
    r = ShardReader(path)
    assert [r.check(i) for i in range(3)] == [True, False, True]
    with pytest.raises(CorruptShardError, match=r"shard-00000\.tfs.*sample 1.*crc32 checksum"):
        r.sample(1)
    assert verify_shards(root).bad_ids == [1]
    with pytest.raises(CorruptShardError, match=r"sample 1.*global id 1"):
        list(StreamingDataset(root, batch_size=3, shuffle=False))


def test_unknown_checksum_in_header_is_reported_as_corrupt(tmp_path):
    _write(tmp_path, _samples(2), 2)
    path = tmp_path / "shard-00000.tfs"
    raw = bytearray(path.read_bytes())
    hlen = struct.unpack("<Q", raw[8:16])[0]
    hbytes = bytes(raw[32 : 32 + hlen]).replace(b'"checksum":"xxh3_64"', b'"checksum":"sha9999"')
    assert len(hbytes) == hlen
    raw[32 : 32 + hlen] = hbytes
    raw[16:20] = struct.pack("<I", zlib.crc32(hbytes))
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match=r"header.*unknown checksum 'sha9999'"):
        ShardReader(path)


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_readinto_matches_per_sample_path_and_flags_bad_samples(tmp_path, checksum):
    g = torch.Generator().manual_seed(5)
    with ShardWriter(tmp_path, samples_per_shard=40, checksum=checksum) as w:
        for i in range(40):
            w.write({"a": torch.randn(3, 2, generator=g, dtype=torch.float64),
                     "b": torch.randn(5, generator=g).to(torch.bfloat16),
                     "c": torch.randint(0, 9, (7,), generator=g, dtype=torch.uint8)}, label=i)
    path = tmp_path / "shard-00000.tfs"
    _flip(path, _data_offset(path, "b", 9))  # checksum failure at index 9
    with open(path, "r+b") as f:  # truncation: index 39 of the last field ("c") cut short
        f.truncate(_data_offset(path, "c", 39) + 3)
    r = ShardReader(path)
    assert r.bad.keys() == {39}
    rng = np.random.default_rng(0)
    index = sorted([*rng.choice(40, 30, replace=False).tolist(), 9, 9, 39, 12, 13, 14])
    rows = rng.permutation(len(index)).tolist()
    out = {name: bytearray(len(index) * r.fields[name]["nbytes"]) for name in ("a", "b", "c")}
    failed = r.readinto(index, rows, {k: memoryview(v) for k, v in out.items()})
    assert failed == [p for p, i in enumerate(index) if i in (9, 39)]
    unchecked = r.readinto(index, rows, {k: memoryview(v) for k, v in out.items()},
                           verify=False)
    assert unchecked == [p for p, i in enumerate(index) if i == 39]
    for name, dt in (("a", torch.float64), ("b", torch.bfloat16), ("c", torch.uint8)):
        got = torch.frombuffer(out[name], dtype=torch.uint8).view(dt).view(len(index), -1)
        for p, i in enumerate(index):
            if i != 39:
                ref = r.sample(i, verify=False)[name].reshape(-1)
                assert torch.equal(got[rows[p]].view(torch.uint8), ref.view(torch.uint8))
    r.close()
    _write(tmp_path / "rag", _samples(4), 4)
    ragged = ShardReader(tmp_path / "rag" / "shard-00000.tfs")
    with pytest.raises(ValueError, match="ragged"):
        ragged.readinto([0], [0], {})


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.parametrize("one_field", [False, True])
def test_check_many_equals_check_per_sample(tmp_path, checksum, one_field):
    samples = _samples(8)
    if one_field:  # the comprehension fast path of check_many
        samples = [({"x": s["x"]}, lab) for s, lab in samples]
    _write(tmp_path, samples, 8, checksum)
    path = tmp_path / "shard-00000.tfs"
    meta = ShardReader(path).fields["x"]
    _flip(path, meta["offset"] + 5 * meta["nbytes"] + 1)
    r = ShardReader(path)
    order = [7, 5, 0, 5, 3]
    assert r.check_many(order) == [r.check(i) for i in order] == [True, False, True, False, True]


def test_labels_must_be_integer_class_ids(tmp_path):
    """Regression: a float label was truncated (1.9 -> 1), other types gave bare int() errors."""
    w = ShardWriter(tmp_path, samples_per_shard=3)
    w.write({"x": torch.zeros(2)}, label=0)
    for bad in (1.9, 2.0, np.float32(0.5), torch.tensor(1.5), np.array([0.25])):
        with pytest.raises(TypeError, match=r"sample 1 has the non-integer label (1\.9|2\.0|0\.5|"
                                            r"1\.5|0\.25); labels are integer class ids"):
            w.write({"x": torch.zeros(2)}, label=bad)
    with pytest.raises(TypeError, match=r"label='cat'\): sample 1's label is a str; expected an"):
        w.write({"x": torch.zeros(2)}, label="cat")
    with pytest.raises(TypeError, match=r"sample 1's label has shape \(2,\)"):
        w.write({"x": torch.zeros(2)}, label=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="does not fit int64"):
        w.write({"x": torch.zeros(2)}, label=2**63)
    for good in (np.int64(3), torch.tensor(4), torch.tensor([5], dtype=torch.uint8), 6):
        w.write({"x": torch.zeros(2)}, label=good)  # the refused writes left nothing behind
    w.close()
    assert [lab for s in read_manifest(tmp_path)["shards"] for lab in s["labels"]] == \
        [0, 3, 4, 5, 6]
    assert ShardReader(tmp_path / "shard-00001.tfs").labels == [5, 6]


def test_odd_shaped_sample_is_refused_unless_the_field_is_ragged(tmp_path):
    """Regression: one odd-shaped sample silently turned its batches into lists of tensors."""
    for per_shard in (4, 1):  # within a shard, and across shards (each one fixed by itself)
        w = ShardWriter(tmp_path / f"a{per_shard}", samples_per_shard=per_shard)
        w.write({"x": torch.zeros(3), "y": torch.zeros(2, 2)}, label=0)
        w.write({"x": torch.zeros(3), "y": torch.zeros(2, 2)}, label=0)
        with pytest.raises(ValueError, match=r"sample 2 has field 'y' of shape \(2, 3\), but "
                                             r"sample 0 has shape \(2, 2\).*ragged=\['y'\]"):
            w.write({"x": torch.zeros(3), "y": torch.zeros(2, 3)}, label=0)
        w.write({"x": torch.zeros(3), "y": torch.ones(2, 2)}, label=1)
        w.close()
        ds = StreamingDataset(tmp_path / f"a{per_shard}", batch_size=3, shuffle=False)
        b = next(iter(ds))
        assert b["y"].shape == (3, 2, 2) and b["label"].tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match=r"ragged=\['z'\]\): no field named 'z'"):
        ShardWriter(tmp_path / "b", samples_per_shard=2, ragged=["z"]).write(
            {"x": torch.zeros(1)}, label=0)
    with ShardWriter(tmp_path / "c", samples_per_shard=2, ragged=["x"]) as w:  # opted in
        for i in range(3):
            w.write({"x": torch.arange(i + 1.0)}, label=i)
    b = next(iter(StreamingDataset(tmp_path / "c", batch_size=3, shuffle=False)))
    assert [t.tolist() for t in b["x"]] == [[0.0], [0.0, 1.0], [0.0, 1.0, 2.0]]


def test_manifest_labels_are_checked_against_the_shard_headers(tmp_path):
    """Regression: a manifest whose labels disagree with a shard header was read silently."""
    root = _stream_dir(tmp_path)
    m = json.loads((root / MANIFEST).read_text())
    m["shards"][2]["labels"][4] += 1  # global id 16
    (root / MANIFEST).write_text(json.dumps(m))
    rep = verify_shards(root, full=False)
    assert rep.bad_ids == list(range(12, 18))
    assert all(b[1].endswith("shard-00002.tfs") for b in rep.bad)
    assert "manifest labels differ from the shard header's (first at sample 4" in rep.bad[0][3]
    with pytest.raises(CorruptShardError, match=r"shard-00002\.tfs.*manifest labels differ"):
        list(StreamingDataset(root, batch_size=5, seed=3))
    with pytest.raises(CorruptShardError, match=r"shard-00002\.tfs.*manifest labels differ"):
        StreamingDataset(root, batch_size=5, seed=3).verify()
    ds = StreamingDataset(root, batch_size=5, seed=3, on_corrupt="skip", meta=True)
    ids = torch.cat([b["id"] for b in ds]).tolist()
    assert sorted(ids) == [i for i in range(24) if not 12 <= i < 18]
