"""Shard format: round trip, memory mapping, atomic writes, corrupt and truncated shards."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

from torchfn.data._shards import (
    MANIFEST,
    CorruptShardError,
    ShardReader,
    ShardWriter,
    read_manifest,
    verify_shards,
)
from torchfn.data._stream import StreamingDataset


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


def _write(root, samples, per_shard):
    with ShardWriter(root, samples_per_shard=per_shard) as w:
        for s, lab in samples:
            w.write(s, label=lab)


def test_round_trip_exact_and_manifest(tmp_path):
    samples = _samples(11)
    _write(tmp_path, samples, 4)
    m = read_manifest(tmp_path)
    assert [s["num_samples"] for s in m["shards"]] == [4, 4, 3]
    assert [lab for s in m["shards"] for lab in s["labels"]] == [lab for _, lab in samples]
    assert m["num_samples"] == 11
    assert m["fields"]["img"]["dtype"] == "uint8" and m["fields"]["h"]["dtype"] == "bfloat16"
    k = 0
    for shard in m["shards"]:
        r = ShardReader(tmp_path / shard["file"])
        assert r.num_samples == shard["num_samples"] and not r.bad
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


def test_corrupt_sample_error_names_file_and_sample(tmp_path):
    _write(tmp_path, _samples(8), 4)
    path = tmp_path / "shard-00001.tfs"
    _flip(path, _data_offset(path, "x", 2) + 3)
    r = ShardReader(path)
    assert [r.check(i) for i in range(4)] == [True, True, False, True]
    with pytest.raises(CorruptShardError, match=r"shard-00001\.tfs.*sample 2.*CRC32"):
        r.sample(2)
    assert torch.isfinite(r.sample(1)["x"]).all()
    rep = verify_shards(tmp_path)
    assert rep.bad_ids == [6] and rep.bad[0][2] == 2 and not rep.ok
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


def _stream_dir(tmp_path, n=24, per_shard=6):
    with ShardWriter(tmp_path, samples_per_shard=per_shard) as w:
        for i in range(n):
            w.write({"x": torch.full((3,), float(i), dtype=torch.float64)}, label=i % 3)
    return tmp_path


def test_stream_raise_mode_names_file_sample_and_id(tmp_path):
    root = _stream_dir(tmp_path)
    path = root / "shard-00002.tfs"
    _flip(path, _data_offset(path, "x", 4))
    ds = StreamingDataset(root, batch_size=5, seed=3)
    with pytest.raises(CorruptShardError, match=r"shard-00002\.tfs.*sample 4.*global id 16"):
        list(ds)
    with pytest.raises(CorruptShardError, match="sample 4"):
        ds.verify()


def test_stream_skip_mode_reports_and_keeps_exactly_once(tmp_path):
    root = _stream_dir(tmp_path)
    p1, p3 = root / "shard-00001.tfs", root / "shard-00003.tfs"
    _flip(p1, _data_offset(p1, "x", 1))  # CRC failure: global id 7
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


def test_header_json_matches_documented_layout(tmp_path):
    _write(tmp_path, _samples(3), 3)
    raw = (tmp_path / "shard-00000.tfs").read_bytes()
    assert raw[:8] == b"TFSHARD\x01"
    hlen, _ = struct.unpack("<QI", raw[8:20])
    header = json.loads(raw[32 : 32 + hlen])
    assert header["num_samples"] == 3 and len(header["crc32"]) == 3
    assert header["file_bytes"] == len(raw)
    assert all(m["offset"] % 64 == 0 for m in header["fields"].values())


def test_readinto_matches_per_sample_path_and_flags_bad_samples(tmp_path):
    g = torch.Generator().manual_seed(5)
    with ShardWriter(tmp_path, samples_per_shard=40) as w:
        for i in range(40):
            w.write({"a": torch.randn(3, 2, generator=g, dtype=torch.float64),
                     "b": torch.randn(5, generator=g).to(torch.bfloat16),
                     "c": torch.randint(0, 9, (7,), generator=g, dtype=torch.uint8)}, label=i)
    path = tmp_path / "shard-00000.tfs"
    _flip(path, _data_offset(path, "b", 9))  # CRC failure at index 9
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
    no_crc = r.readinto(index, rows, {k: memoryview(v) for k, v in out.items()}, verify=False)
    assert no_crc == [p for p, i in enumerate(index) if i == 39]
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
