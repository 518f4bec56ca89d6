"""Sample sources (numpy arrays / memory maps, webdataset-style tars, the .tfs adapter) streamed
by StreamingDataset: exactly once over ranks x workers, resume == uninterrupted, errors."""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import tarfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from torchfn.data import (
    HFDiskSource,
    NumpySource,
    ParquetSource,
    SampleSource,
    ShardSource,
    ShardWriter,
    StreamingDataset,
    StreamingLoader,
    TarError,
    TarSource,
    decode_member,
    plan,
    write_shards,
)

N = 37
TAR_SIZES = [10, 15, 12]


def _write_tar(path, start, count, *, extra=None, skip_cls=False):
    """One tar shard of samples start..start+count-1: x.npy = full((3,), id), cls = id % 3."""
    with tarfile.open(path, "w") as tf:
        for i in range(start, start + count):
            buf = io.BytesIO()
            np.save(buf, np.full((3,), float(i)))
            members = [("x.npy", buf.getvalue()), ("txt", f"s{i}".encode())]
            if not skip_cls:
                members.append(("cls", str(i % 3).encode()))
            for ext, data in members + list((extra or {}).items()):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def tar_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tars")
    start = 0
    for k, n in enumerate(TAR_SIZES):
        _write_tar(root / f"shard-{k:03d}.tar", start, n)
        start += n
    return root


@pytest.fixture(scope="module")
def npy_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("npy")
    np.save(root / "x.npy", np.arange(N, dtype=np.float64)[:, None].repeat(3, 1))
    np.save(root / "y.npy", np.arange(N) % 3)
    return root


def _numpy(npy_dir):  # memory-mapped .npy paths; labels from a field
    return NumpySource({"x": npy_dir / "x.npy", "y": str(npy_dir / "y.npy")}, labels="y")


def _tar(tar_dir):
    return TarSource(str(tar_dir / "shard-*.tar"))


SOURCES = {"numpy": ("npy_dir", _numpy, "x"), "tar": ("tar_dir", _tar, "x.npy")}


@pytest.fixture(params=sorted(SOURCES))
def source(request):
    fixture, make, field = SOURCES[request.param]
    return make(request.getfixturevalue(fixture)), field


def _check_contents(batches, field):
    for b in batches:  # contents and labels follow the ids
        assert torch.equal(b[field], b["id"].double()[:, None].expand(-1, 3))
        assert torch.equal(b["label"], b["id"] % 3)


def _ids(batches):
    return torch.cat([b["id"] for b in batches]).tolist() if batches else []


def _rank_stream(ds):
    return plan(seed=ds.seed, epoch=ds.epoch, shard_sizes=ds.shard_sizes,
                world_size=ds.world_size, rank=ds.rank, policy=ds.policy).ids.tolist()


def test_sources_satisfy_the_protocol(source, tar_dir, npy_dir):
    src, _ = source
    assert isinstance(src, SampleSource) and len(src) == N
    assert sum(src.shard_sizes) == N and src.labels.tolist() == [i % 3 for i in range(N)]
    assert len(src.fingerprint()) == 32
    assert src.fingerprint() == (_numpy(npy_dir) if "Numpy" in src.describe()
                                 else _tar(tar_dir)).fingerprint()


@settings(max_examples=15, deadline=None)
@given(world=st.integers(1, 3), batch=st.integers(1, 6), seed=st.integers(0, 2**30),
       policy=st.sampled_from(["drop", "pad"]), epoch=st.integers(0, 2),
       kind=st.sampled_from(sorted(SOURCES)))
def test_exactly_once_over_ranks(tar_dir, npy_dir, world, batch, seed, policy, epoch, kind):
    fixture, make, field = SOURCES[kind]
    src = make(tar_dir if fixture == "tar_dir" else npy_dir)
    real = []
    lengths = set()
    for r in range(world):
        ds = StreamingDataset(src, batch_size=batch, seed=seed, meta=True, world_size=world,
                              rank=r, policy=policy)
        ds.set_epoch(epoch)
        batches = list(ds)
        _check_contents(batches, field)
        assert _ids(batches) == _rank_stream(ds)
        lengths.add(len(_ids(batches)))
        real += [int(i) for b in batches for i, p in zip(b["id"], b["padded"], strict=True)
                 if not p]
    assert len(lengths) == 1 and len(real) == len(set(real))
    if policy == "pad":
        assert sorted(real) == list(range(N))
    else:
        assert len(real) == N - N % world


def test_dataloader_workers_over_ranks_exactly_once(source):
    src, field = source
    seen = []
    for rank in range(2):
        ds = StreamingDataset(src, batch_size=4, seed=3, meta=True, world_size=2, rank=rank,
                              policy="pad")
        batches = list(StreamingLoader(ds, num_workers=2))
        _check_contents(batches, field)
        assert _ids(batches) == _rank_stream(ds) and len(_ids(batches)) == 19
        assert {int(w) for b in batches for w in b["worker"]} == {0, 1}
        seen += [int(i) for b in batches for i, p in zip(b["id"], b["padded"], strict=True)
                 if not p]
    assert sorted(seen) == list(range(N))


def _resume_run(src, legs):
    """Consume `steps` batches with `workers` workers and batch size `bs` per leg; each leg a
    fresh dataset restored from the previous leg's state."""
    out, state = [], None
    for steps, workers, bs in legs:
        ds = StreamingDataset(src, batch_size=bs, seed=11, meta=True, world_size=2, rank=1)
        ds.set_epoch(2)
        if state is not None:
            ds.load_state_dict(state)
            ds.set_epoch(2)
        loader = StreamingLoader(ds, num_workers=workers)
        it = iter(loader)
        for _ in range(steps):
            b = next(it, None)
            if b is None:
                break
            out += b["id"].tolist()
        state = loader.state_dict()
        del it
    return out, state


def test_resume_with_changed_workers_equals_uninterrupted(source):
    src, _ = source
    full, _ = _resume_run(src, [(100, 2, 7)])
    assert len(full) == 18 and len(set(full)) == 18
    got, state = _resume_run(src, [(1, 2, 3), (2, 0, 5), (100, 1, 4)])
    assert got == full
    assert state["consumed"] == 36 and state["fingerprint"] == src.fingerprint()


def test_resume_refuses_other_data(npy_dir, tmp_path):
    ds = StreamingDataset(_numpy(npy_dir), batch_size=4)
    next(iter(ds))
    sd = ds.state_dict()
    assert sd["consumed"] == 4
    other = NumpySource({"x": np.zeros((N, 3))}, labels=np.arange(N) % 3)
    with pytest.raises(ValueError, match=r"fingerprint \w+ \(the data changed\)"):
        StreamingDataset(other, batch_size=4).load_state_dict(sd)


def test_per_sample_mode_and_transform(source):
    src, field = source
    ds = StreamingDataset(src, batch_size=5, batched=False, shuffle=False, meta=True)
    samples = list(DataLoader(ds, batch_size=5, num_workers=0))
    assert _ids(samples) == list(range(N))
    _check_contents(samples, field)
    ds = StreamingDataset(src, batch_size=5, shuffle=False,
                          transform=lambda s: {"y": s[field].sum(), "label": s["label"]})
    b = next(iter(ds))
    assert torch.equal(b["y"], 3 * torch.arange(5, dtype=torch.float64))


# ------------------------------------------------------------------------- numpy
def test_numpy_in_memory_memmap_and_strings(tmp_path):
    x = np.random.default_rng(0).standard_normal((9, 2, 2))
    mm = np.lib.format.open_memmap(tmp_path / "m.npy", mode="w+", dtype=np.int32, shape=(9,))
    mm[:] = np.arange(9) * 10
    mm.flush()
    src = NumpySource({"x": x, "m": np.load(tmp_path / "m.npy", mmap_mode="r"),
                       "s": np.array([f"w{i}" for i in range(9)])})
    assert src.labels is None and src.shard_sizes == [9]
    b = src.read(np.array([7, 2, 7]))
    assert torch.equal(b["x"], torch.from_numpy(x[[7, 2, 7]]))
    assert b["m"].tolist() == [70, 20, 70] and b["m"].dtype == torch.int32
    assert b["s"] == ["w7", "w2", "w7"]
    assert src.read_sample(4)["m"].item() == 40
    # no labels: batches have no "label"; StreamingLoader still counts the items exactly
    ds = StreamingDataset(src, batch_size=4, shuffle=False)
    loader = StreamingLoader(ds, num_workers=1)
    batches = list(loader)
    assert "label" not in batches[0] and loader.state_dict()["consumed"] == 9
    assert torch.cat([b["m"] for b in batches]).tolist() == list(range(0, 90, 10))


def test_sources_pickle_without_their_data_or_descriptors(npy_dir, tar_dir):
    src = _numpy(npy_dir)
    blob = pickle.dumps(src)
    assert len(blob) < 2000  # the memory-mapped field travels as its path
    back = pickle.loads(blob)
    assert isinstance(back.arrays["x"], np.memmap) and back.fingerprint() == src.fingerprint()
    assert torch.equal(back.read([5, 1])["x"], src.read([5, 1])["x"])
    tar = _tar(tar_dir)
    tar.read([0])  # opens a descriptor
    back = pickle.loads(pickle.dumps(tar))
    assert back._fds == {} and back.read([36])["txt"] == ["s36"]


def test_numpy_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"different lengths \{'a': 3, 'b': 4\}"):
        NumpySource({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ValueError, match=r"labels=.*expected 3 integer labels"):
        NumpySource({"a": np.zeros(3)}, labels=[0, 1])
    with pytest.raises(ValueError, match=r"field 'o' has dtype object"):
        NumpySource({"o": np.array([None, 1], dtype=object)})
    with pytest.raises(ValueError, match=r"cannot open field 'p' from .*missing\.npy"):
        NumpySource({"p": tmp_path / "missing.npy"})
    with pytest.raises(ValueError, match=r"shard_sizes=\[2\]\): expected sizes >= 0 summing"):
        NumpySource({"a": np.zeros(3)}, shard_sizes=[2])
    with pytest.raises(IndexError, match=r"ids must lie in \[0, 3\)"):
        NumpySource({"a": np.zeros(3)}).read([3])


# ------------------------------------------------------------------------- tar
def test_tar_members_decode_and_keys(tmp_path):
    weights = {"w": torch.arange(4.0)}
    buf = io.BytesIO()
    torch.save(weights, buf)
    _write_tar(tmp_path / "a.tar", 0, 3, extra={"pt": buf.getvalue(), "jpg": b"\xff\xd8"})
    src = TarSource([tmp_path / "a.tar"])
    assert src.fields == ["jpg", "pt", "txt", "x.npy"] and src.key(2) == "000002"
    s = src.read_sample(1)
    assert s["txt"] == "s1" and s["jpg"] == b"\xff\xd8" and torch.equal(s["pt"]["w"], weights["w"])
    assert torch.equal(s["x.npy"], torch.full((3,), 1.0, dtype=torch.float64))
    b = src.read([2, 0])
    assert b["txt"] == ["s2", "s0"] and b["x.npy"][:, 0].tolist() == [2.0, 0.0]
    # a pluggable decoder; no .cls members: no labels
    _write_tar(tmp_path / "b.tar", 0, 2, skip_cls=True)
    src = TarSource(tmp_path / "b.tar", decode=lambda ext, data: len(data))
    assert src.labels is None and src.read([1])["txt"].tolist() == [2]
    # a directory expands to its *.tar files in name order
    (tmp_path / "d").mkdir()
    _write_tar(tmp_path / "d" / "1.tar", 0, 3)
    _write_tar(tmp_path / "d" / "0.tar", 3, 2)
    src = TarSource(tmp_path / "d")
    assert src.shard_sizes == [2, 3] and src.read([0, 2])["txt"] == ["s3", "s0"]


def test_tar_corruption_errors_name_file_and_member(tmp_path):
    good = tmp_path / "good.tar"
    _write_tar(good, 0, 4)
    data = good.read_bytes()
    src = TarSource(good)
    _name, off, size = src._samples[2][2]["x.npy"]
    # cut inside a member's data
    (tmp_path / "cut.tar").write_bytes(data[: off + size // 2])
    with pytest.raises(TarError, match=r"cut\.tar' is truncated: member '000002\.x\.npy' needs"):
        TarSource(tmp_path / "cut.tar")
    # cut exactly at a member boundary (tarfile alone would stop silently)
    end = off + -(-size // 512) * 512
    (tmp_path / "edge.tar").write_bytes(data[:end])
    with pytest.raises(TarError, match=r"edge\.tar' is truncated or corrupt: no end-of-archive "
                       r"marker at byte \d+, after member '000002\.x\.npy'"):
        TarSource(tmp_path / "edge.tar")
    # garbage in the header after that member
    (tmp_path / "junk.tar").write_bytes(data[:end] + b"\x01" * 512 + data[end + 512 :])
    with pytest.raises(TarError, match=r"junk\.tar' is truncated or corrupt: an unreadable tar "
                       r"header .* after member '000002\.x\.npy'"):
        TarSource(tmp_path / "junk.tar")
    # bytes corrupted inside a member: the decode error names file and member
    bad = bytearray(data)
    bad[off : off + 6] = b"XXXXXX"  # the .npy magic
    (tmp_path / "bad.tar").write_bytes(bytes(bad))
    src = TarSource(tmp_path / "bad.tar")
    with pytest.raises(TarError, match=r"cannot decode member '000002\.x\.npy' of .*bad\.tar'"):
        src.read([0, 2])
    with pytest.raises(TarError, match=r"cannot read .*empty\.tar' as an uncompressed tar"):
        (tmp_path / "empty.tar").write_bytes(b"")
        TarSource(tmp_path / "empty.tar")
    with tarfile.open(tmp_path / "z.tar.gz", "w:gz") as tf:
        tf.add(good, arcname="x.txt")
    with pytest.raises(TarError, match=r"z\.tar\.gz' is gzip-compressed; random access needs"):
        TarSource(tmp_path / "z.tar.gz")
    with pytest.raises(FileNotFoundError, match=r"no \.tar files match"):
        TarSource(str(tmp_path / "nothing-*.tar"))


def test_tar_samples_must_share_fields(tmp_path):
    _write_tar(tmp_path / "a.tar", 0, 2)
    _write_tar(tmp_path / "b.tar", 2, 2, extra={"jpg": b"x"})
    with pytest.raises(TarError, match=r"sample '000002' in .*b\.tar' has members .*'jpg'"):
        TarSource([tmp_path / "a.tar", tmp_path / "b.tar"])


# ------------------------------------------------------------------------- .tfs adapter
@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfs")
    with ShardWriter(root, samples_per_shard=8) as w:
        for i in range(N):
            w.write({"x": torch.full((3,), float(i), dtype=torch.float64)}, label=i % 3)
    return root


def test_shard_source_is_the_shard_directory(shard_dir):
    kw = dict(batch_size=5, seed=4, meta=True, world_size=2, rank=1, policy="pad")
    a = StreamingDataset(ShardSource(shard_dir), **kw)
    b = StreamingDataset(shard_dir, **kw)
    assert a.source is None and a.files == b.files  # the .tfs path itself, not a wrapper
    got, ref = list(StreamingLoader(a, num_workers=2)), list(StreamingLoader(b, num_workers=2))
    assert len(got) == len(ref) == 4
    for x, y in zip(got, ref, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert a.state_dict() == b.state_dict() and "fingerprint" not in a.state_dict()
    src = ShardSource(shard_dir)
    assert src.shard_sizes == [8, 8, 8, 8, 5] and isinstance(src, SampleSource)
    batch = src.read(ref[0]["id"].numpy())
    assert torch.equal(batch["x"], ref[0]["x"])
    assert torch.equal(torch.from_numpy(src.labels[ref[0]["id"].numpy()]), ref[0]["label"])


def test_write_shards_converts_any_source(source, tmp_path):
    src, field = source
    root = write_shards(src, tmp_path / "tfs", samples_per_shard=10, batch_size=8,
                        fields=[field])
    shards = ShardSource(root)
    assert len(shards) == N and shards.labels.tolist() == src.labels.tolist()
    ids = np.arange(N)
    assert torch.equal(shards.read(ids)[field], src.read(ids)[field])
    batches = list(StreamingDataset(root, batch_size=6, seed=1, meta=True))
    _check_contents(batches, field)
    assert sorted(_ids(batches)) == list(range(N))
    with pytest.raises(ValueError, match=r"has no labels .* pass default_label=<int>"):
        write_shards(NumpySource({"x": np.zeros(3)}), tmp_path / "u", samples_per_shard=2)
    root = write_shards(NumpySource({"x": np.zeros(3)}), tmp_path / "u", samples_per_shard=2,
                        default_label=-1)
    assert ShardSource(root).labels.tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match=r"write_shards\(fields=...\): .* has no fields \['z'\]"):
        write_shards(src, tmp_path / "z", samples_per_shard=10, fields=["z"])


def test_write_shards_refuses_text_fields(tar_dir, tmp_path):
    with pytest.raises(TypeError, match=r"field 'txt' must be a torch.Tensor or numpy array"):
        write_shards(_tar(tar_dir), tmp_path, samples_per_shard=10)


def test_dataset_errors_for_sources(npy_dir):
    with pytest.raises(TypeError, match=r"StreamingDataset\(root=...\): expected a shard "
                       r"directory or a SampleSource .* got list"):
        StreamingDataset([1, 2], batch_size=2)
    with pytest.raises(ValueError, match=r"on_corrupt='skip'.*NumpySource\(37 samples"):
        StreamingDataset(_numpy(npy_dir), batch_size=2, on_corrupt="skip")
    with pytest.raises(ValueError, match=r"verify: checksums are the \.tfs shards'"):
        StreamingDataset(_numpy(npy_dir), batch_size=2).verify()


# ------------------------------------------------------------------------- Arrow (pyarrow)
@pytest.mark.parametrize("cls", [ParquetSource, HFDiskSource])
def test_arrow_sources_without_pyarrow_say_so(cls, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(ImportError, match=rf"{cls.__name__} needs pyarrow, which is not "
                       r"installed: pip install pyarrow"):
        cls(tmp_path)


def _arrow_table(pa, start, count):
    ids = list(range(start, start + count))
    return pa.table({"x": [[float(i)] * 3 for i in ids], "label": [i % 3 for i in ids],
                     "name": [f"s{i}" for i in ids]})


def _check_arrow_source(src):
    assert len(src) == N and src.labels.tolist() == [i % 3 for i in range(N)]
    b = src.read([30, 2, 17])
    assert b["x"].tolist() == [[30.0] * 3, [2.0] * 3, [17.0] * 3] and b["name"] == ["s30", "s2",
                                                                                       "s17"]
    real = []
    for rank in range(2):
        ds = StreamingDataset(src, batch_size=4, seed=3, meta=True, world_size=2, rank=rank,
                              policy="pad")
        batches = list(StreamingLoader(ds, num_workers=2))
        _check_contents(batches, "x")
        assert _ids(batches) == _rank_stream(ds)
        real += [int(i) for b in batches for i, p in zip(b["id"], b["padded"], strict=True)
                 if not p]
    assert sorted(real) == list(range(N))
    full, _ = _resume_run(src, [(100, 2, 7)])
    assert _resume_run(src, [(1, 2, 3), (2, 0, 5), (100, 1, 4)])[0] == full


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(_arrow_table(pa, 0, 20), tmp_path / "a.parquet", row_group_size=8)
    pq.write_table(_arrow_table(pa, 20, N - 20), tmp_path / "b.parquet", row_group_size=8)
    src = ParquetSource(tmp_path, label_column="label")
    assert src.shard_sizes == [8, 8, 4, 8, 8, 1] and src.columns == ["x", "name"]
    _check_arrow_source(src)
    with pytest.raises(ValueError, match=r"label_column='y'\): no such column"):
        ParquetSource(tmp_path, label_column="y")


def test_hf_disk_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc

    files = []  # the layout of datasets' Dataset.save_to_disk: state.json + Arrow streams
    for k, (start, count) in enumerate([(0, 25), (25, N - 25)]):
        name = f"data-{k:05d}-of-00002.arrow"
        table = _arrow_table(pa, start, count)
        with pa.OSFile(str(tmp_path / name), "wb") as f, pyarrow.ipc.new_stream(
                f, table.schema) as w:
            w.write_table(table)
        files.append({"filename": name})
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": files,
                                                     "_fingerprint": "abc"}))
    src = HFDiskSource(tmp_path)
    assert src.shard_sizes == [25, N - 25]
    _check_arrow_source(src)


def test_parquet_reads_each_row_group_once_per_epoch_in_own_dtypes(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    n, group = 96, 8
    x = np.arange(n * 6, dtype=np.float16).reshape(n, 2, 3)
    table = pa.table({
        "x": pa.array(list(x.reshape(n, 6)), type=pa.list_(pa.float16())),
        "k": pa.array(np.arange(n, dtype=np.int32)),
        "b": pa.array(np.arange(n) % 2 == 0),
        "r": pa.array([[1.0] * (1 + i % 2) for i in range(n)]),  # ragged: lists stay lists
        "label": pa.array(np.arange(n) % 4),
    })
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=group)
    src = ParquetSource(tmp_path, label_column="label")
    assert src.cache_units == int(np.ceil(4 * group / group)) + 1
    b = src.read([50, 3, 9])
    assert b["x"].dtype == torch.float16 and b["k"].dtype == torch.int32
    assert b["b"].dtype == torch.bool and b["b"].tolist() == [True, False, False]
    assert b["k"].tolist() == [50, 3, 9] and b["r"] == [[1.0], [1.0, 1.0], [1.0, 1.0]]
    assert torch.equal(b["x"].reshape(3, 6).float(), torch.from_numpy(
        x.reshape(n, 6)[[50, 3, 9]]).float())
    reads = []
    orig = ParquetSource._table
    monkeypatch.setattr(ParquetSource, "_table",
                        lambda self, u, *a: reads.append(u) or orig(self, u, *a))
    src = ParquetSource(tmp_path, label_column="label", columns=["k"])
    ds = StreamingDataset(src, batch_size=4, seed=1, meta=True)
    got = [int(i) for batch in ds for i in batch["k"]]
    assert sorted(got) == list(range(n))
    assert sorted(reads) == list(range(n // group))  # each row group read once this epoch
    assert src.read(np.zeros(0, dtype=np.int64)) == {"k": []}
    with pytest.raises(ValueError, match=r"ParquetSource\(cache_units=0\): expected an int >= 1"):
        ParquetSource(tmp_path, cache_units=0)


def _npy_bytes(a, version=None):
    buf = io.BytesIO()
    if version is None:
        np.save(buf, a)
    else:
        np.lib.format.write_array(buf, a, version=version)
    return buf.getvalue()


@pytest.mark.parametrize("version", [None, (1, 0), (2, 0), (3, 0)])
def test_npy_members_decode_like_np_load(version):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 4)).astype(np.float16),
              np.asfortranarray(rng.standard_normal((3, 5))), np.arange(6, dtype=np.int32),
              np.array(2.5), np.zeros((0, 3)), np.arange(4, dtype=">i4")]
    for a in arrays:
        for _ in range(2):  # the second decode uses the cached header
            if not a.dtype.isnative:  # torch refuses non-native byte order, as before
                with pytest.raises(ValueError, match="byte order"):
                    decode_member("x.npy", _npy_bytes(a, version))
                continue
            got = decode_member("x.npy", _npy_bytes(a, version))
            assert got.dtype == torch.from_numpy(a).dtype and got.shape == a.shape
            assert np.array_equal(got.numpy(), a)
    # a payload shorter than its header says: np.load's own error, not a wrong array
    with pytest.raises(ValueError, match=r"cannot reshape array|EOF"):
        decode_member("npy", _npy_bytes(arrays[0], version)[:-2])


def test_tar_npy_batches_of_mixed_layouts(tmp_path):
    rows = [np.full((2, 3), float(i), dtype=np.float32) for i in range(4)]
    rows[2] = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    rows.append(np.zeros((3, 2), dtype=np.float32))  # another shape: the batch is a list
    rows.append(np.ones((2, 3), dtype=np.int32))  # same size, another dtype: a list too
    with tarfile.open(tmp_path / "a.tar", "w") as tf:
        for i, a in enumerate(rows):
            data = _npy_bytes(a)
            info = tarfile.TarInfo(f"{i:06d}.x.npy")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    src = TarSource(tmp_path / "a.tar")
    b = src.read([3, 2, 0, 1])["x.npy"]
    assert isinstance(b, torch.Tensor) and b.shape == (4, 2, 3)
    assert np.array_equal(b.numpy(), np.stack([rows[3], rows[2], rows[0], rows[1]]))
    mixed = src.read([4, 0])["x.npy"]
    assert isinstance(mixed, list) and [t.shape for t in mixed] == [(3, 2), (2, 3)]
    typed = src.read([0, 5])["x.npy"]
    assert [t.dtype for t in typed] == [torch.float32, torch.int32] and typed[1].sum() == 6
    with pytest.raises(IndexError, match=r"TarSource\.read: ids must lie in \[0, 6\), got"):
        src.read([6])


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_write_shards_in_processes_is_byte_identical(tmp_path, tar_dir):
    rng = np.random.default_rng(0)
    src = NumpySource({"x": rng.standard_normal((N, 3)).astype(np.float32),
                       "k": np.arange(N)}, labels=np.arange(N) % 5)
    one = write_shards(src, tmp_path / "one", samples_per_shard=4, batch_size=3)
    for workers in (2, 3, 50):  # 50 > the 10 shards: one shard per process
        many = write_shards(src, tmp_path / f"w{workers}", samples_per_shard=4, batch_size=3,
                            num_workers=workers)
        assert _tree(many) == _tree(one)  # shards and manifest, byte for byte
    tar = write_shards(_tar(tar_dir), tmp_path / "tar", samples_per_shard=8, fields=["x.npy"],
                       num_workers=2)
    assert _tree(tar) == _tree(write_shards(_tar(tar_dir), tmp_path / "tar1",
                                            samples_per_shard=8, fields=["x.npy"]))
    # a worker's error comes back with its type and text; nothing is left behind
    with pytest.raises(TypeError, match=r"field 'txt' must be a torch.Tensor or numpy array"):
        write_shards(_tar(tar_dir), tmp_path / "bad", samples_per_shard=10, num_workers=2)
    assert not (tmp_path / "bad" / "manifest.json").exists()
    assert not list((tmp_path / "bad").glob(".write-*"))
    # shapes are checked across the processes as one writer checks across samples
    ragged = NumpySource({"x": np.zeros((8, 2))})
    ragged.read = lambda ids: {"x": [torch.zeros(2 if i < 4 else 3) for i in ids]}
    with pytest.raises(ValueError, match=r"sample 4 has field 'x' of shape \(3,\), but sample "
                       r"0 has shape \(2,\)"):
        write_shards(ragged, tmp_path / "r", samples_per_shard=2, num_workers=2,
                     default_label=0)
    with pytest.raises(FileExistsError, match=r"a manifest already exists there"):
        write_shards(src, one, samples_per_shard=4, num_workers=2)
    with pytest.raises(ValueError, match=r"write_shards\(num_workers=0\): expected an int >= 1"):
        write_shards(src, tmp_path / "z", samples_per_shard=4, num_workers=0)


def test_parquet_workers_share_decoded_row_groups(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    n, group = 192, 8
    pq.write_table(pa.table({"k": pa.array(np.arange(n, dtype=np.int64)),
                             "label": pa.array(np.arange(n) % 4)}),
                   tmp_path / "a.parquet", row_group_size=group)
    log = tmp_path / "reads.log"
    orig = ParquetSource._table

    def logged(self, u, *a):
        with open(log, "a") as f:  # appended by every DataLoader worker
            f.write(f"{u}\n")
        return orig(self, u, *a)

    monkeypatch.setattr(ParquetSource, "_table", logged)
    reads = {}
    for shared in (False, True):
        log.write_text("")
        src = ParquetSource(tmp_path / "a.parquet", label_column="label", shared_cache=shared)
        ds = StreamingDataset(src, batch_size=4, seed=2, meta=True)
        batches = list(StreamingLoader(ds, num_workers=2))
        got = [int(k) for b in batches for k in b["k"]]
        assert sorted(got) == list(range(n))
        for b in batches:  # the labels share the first field's shared-memory block
            assert b["label"].tolist() == [k % 4 for k in b["k"].tolist()]
            assert b["label"].untyped_storage().data_ptr() == b["k"].untyped_storage().data_ptr()
        assert got == [int(i) for i in _rank_stream(ds)]  # the plan's order, same values
        reads[shared] = len(log.read_text().split())
        shm = src._shared.path if shared else None
        del src, ds
        if shm is not None:
            import gc

            gc.collect()
            assert not os.path.exists(shm)  # removed with the source
    assert reads[False] == 2 * (n // group)  # each worker decodes every row group
    assert n // group <= reads[True] < 2 * (n // group)  # shared: (about) once in all


class _ReadInWorker(torch.utils.data.IterableDataset):
    """Reads ``ids`` from ``src`` in a DataLoader worker; yields what the worker then holds."""

    def __init__(self, src, ids):
        self.src, self.ids = src, ids

    def __iter__(self):
        x = self.src.read(self.ids)["x"].clone()
        yield {"x": x, "cached": sorted(self.src._cache), "own": self.src._pid == os.getpid(),
               "files": sorted(self.src.__dict__.get("_pfiles", {}))}


@pytest.mark.parametrize("shared", [False, True])
def test_parquet_worker_starts_its_own_cache_and_files(tmp_path, shared):
    """A forked worker does not inherit the row groups (and open files) its parent decoded
    for itself: it would evict them from the shared cache as if it had shared them."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    x = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    for k in range(2):
        pq.write_table(pa.table({"x": pa.array(list(x[16 * k:16 * k + 16]),
                                               type=pa.list_(pa.float32()))}),
                       tmp_path / f"{k}.parquet", row_group_size=8)
    src = ParquetSource(tmp_path, shared_cache=shared)
    assert np.array_equal(src.read([0, 9, 20])["x"].numpy(), x[[0, 9, 20]])  # parent: 0, 1, 2
    assert sorted(src._cache) == [0, 1, 2] and sorted(src._pfiles) == [0, 1]
    (got,) = list(DataLoader(_ReadInWorker(src, [30, 31]), batch_size=None, num_workers=1))
    assert np.array_equal(got["x"].numpy(), x[[30, 31]])
    assert got["cached"] == [3] and got["own"] and got["files"] == [1]
    assert sorted(src._cache) == [0, 1, 2]  # the parent's own cache is untouched
    assert np.array_equal(src.read([31, 1])["x"].numpy(), x[[31, 1]])


@pytest.mark.parametrize("shared", [False, True])
def test_parquet_prefetch_decodes_ahead_and_reads_the_same(tmp_path, monkeypatch, shared):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    n, group = 64, 8
    x = np.random.default_rng(0).standard_normal((n, 3)).astype(np.float32)
    pq.write_table(pa.table({"x": pa.array(list(x), type=pa.list_(pa.float32())),
                             "name": [f"s{i}" for i in range(n)],
                             "label": pa.array(np.arange(n) % 3)}),
                   tmp_path / "a.parquet", row_group_size=group)
    src = ParquetSource(tmp_path, label_column="label", shared_cache=shared)
    if shared:  # share as a DataLoader worker does (the process that made it decodes alone)
        src._shared.owner = -1
    ids = np.array([41, 3, 17, 40, 9], dtype=np.int64)
    src.prefetch(ids)
    # row groups in the order needed (5, 0, 2, 1), at most cache_units // 2 + 1 = 3 ahead
    assert src.cache_units == 5 and list(src._ahead) == [5, 0, 2]
    for fut in src._ahead.values():
        fut.result()

    def no_decode(self, u):
        raise AssertionError(f"row group {u} decoded in the foreground")

    monkeypatch.setattr(ParquetSource, "_decode_unit", no_decode)
    b = src.read(ids[:3])  # row groups 5, 0, 2: all decoded ahead
    assert np.array_equal(b["x"].numpy(), x[ids[:3]])
    monkeypatch.undo()  # row group 1 (id 9) is decoded in the foreground
    b = src.read(ids)
    assert np.array_equal(b["x"].numpy(), x[ids]) and b["name"] == [f"s{i}" for i in ids]
    assert not src._ahead
    with pytest.raises(IndexError, match=r"ParquetSource.prefetch: ids must lie in \[0, 64\)"):
        src.prefetch([64])

    def broken(self, u):
        raise RuntimeError("boom")

    # an error in the background thread: the foreground decodes the row group itself
    monkeypatch.setattr(ParquetSource, "_decode_ahead", broken)
    src2 = ParquetSource(tmp_path, label_column="label", shared_cache=shared)
    if shared:
        src2._shared.owner = -1
    src2.prefetch(ids)
    assert np.array_equal(src2.read(ids)["x"].numpy(), x[ids])


def test_streaming_announces_ids_before_reading_them(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    n = 100
    pq.write_table(pa.table({"k": pa.array(np.arange(n, dtype=np.int64)),
                             "label": pa.array(np.arange(n) % 4)}),
                   tmp_path / "a.parquet", row_group_size=8)

    class Recording(ParquetSource):
        def prefetch(self, ids):
            self.told.update(np.asarray(ids).tolist())
            super().prefetch(ids)

        def read(self, ids):
            assert set(np.asarray(ids).tolist()) <= self.told  # announced first
            return super().read(ids)

    class Plain(ParquetSource):
        prefetch = None  # a source without prefetch is read as before

    for world, rank in [(1, 0), (2, 1)]:
        src = Recording(tmp_path, label_column="label", shared_cache=False)
        src.told = set()
        ds = StreamingDataset(src, batch_size=8, seed=4, world_size=world, rank=rank, meta=True)
        got = [b["k"].tolist() for b in ds]
        plain = StreamingDataset(Plain(tmp_path, label_column="label", shared_cache=False),
                                 batch_size=8, seed=4, world_size=world, rank=rank)
        assert got == [b["k"].tolist() for b in plain]
        assert [k for b in got for k in b] == _rank_stream(ds)
        ds.load_state_dict({**ds.state_dict(), "consumed": 34 * world})  # resume mid-epoch
        src.told = set()
        assert [k for b in ds for k in b["k"].tolist()] == _rank_stream(ds)[34:]


class _Owner:
    """Something a :class:`SharedDecodeCache` can hang off (its files go when it is collected)."""


def _owned_cache():
    """``(owner, cache)``: a fresh ``SharedDecodeCache`` named "test" tied to ``owner``."""
    from torchfn.data._shmcache import SharedDecodeCache

    owner = _Owner()
    return owner, SharedDecodeCache(owner, "test")


@pytest.mark.skipif(sys.platform == "win32", reason="the shared decode cache needs fcntl")
def test_shared_decode_cache_skips_a_unit_being_decoded_elsewhere():
    import fcntl

    owner, cache = _owned_cache()
    calls = []

    def decode():
        calls.append(1)
        return {"a": np.arange(6.0).reshape(2, 3), "s": None}

    os.makedirs(cache.path, exist_ok=True)
    with open(os.path.join(cache.path, "0.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as another process decoding unit 0 does
        assert cache.get(0, ["a", "s"], decode, wait=False) is None and not calls
    got = cache.get(0, ["a", "s"], decode, wait=False)
    assert got["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and calls == [1]
    got = cache.get(0, ["a", "s"], decode)  # now mapped from shared memory
    assert calls == [1] and got["s"] is None and got["a"].dtype == np.float64
    assert got["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and not got["a"].flags.writeable
    path = cache.path
    del owner, cache, got
    import gc

    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.skipif(sys.platform == "win32", reason="the shared decode cache needs fcntl")
def test_shared_decode_cache_publishes_what_was_decoded_into_its_files():
    import gc

    owner, cache = _owned_cache()
    path = cache.path
    want = np.arange(12, dtype=np.float32).reshape(3, 4)

    def into(alloc):  # as the fast decoder does: "a" written into the cache's file
        a = alloc("a", (3, 4), np.float32)
        a[...] = want
        b = alloc("b", (3,), np.int64)  # not used: its file is discarded, "b" written
        assert b is not None
        return {"a": a.reshape(3, 4), "b": np.arange(3), "s": None}

    def temps():
        return [e for e in os.listdir(path) if e.endswith(".tmp")]

    got = cache.get(0, ["a", "b", "s"], into, into=True)
    assert np.array_equal(got["a"], want) and not temps()
    mapped = cache.get(0, ["a", "b", "s"], lambda alloc: 1 / 0, into=True)  # a reader
    assert np.array_equal(mapped["a"], want) and mapped["b"].tolist() == [0, 1, 2]
    assert mapped["s"] is None and mapped["a"].dtype == np.float32
    cache.evict(0, ["a", "b", "s"])
    assert len(os.listdir(os.path.join(path, "free"))) == 2
    del got, mapped
    gc.collect()  # unmapped: the free files can be recycled

    def fails(alloc):
        alloc("a", (3, 4), np.float32)
        raise RuntimeError("decode failed")

    with pytest.raises(RuntimeError, match="decode failed"):
        cache.get(1, ["a"], fails, into=True)
    assert not temps() and not os.path.exists(os.path.join(path, "1.json"))

    def recycled(alloc):  # into a recycled file (its old values overwritten)
        a = alloc("a", (2, 2), np.float64)
        a[...] = [[1.5, 2.5], [3.5, 4.5]]
        return {"a": a}

    cache.get(2, ["a"], recycled, into=True)
    got = cache.get(2, ["a"], lambda alloc: 1 / 0, into=True)
    assert got["a"].tolist() == [[1.5, 2.5], [3.5, 4.5]] and not got["a"].flags.writeable
    assert sorted(e for e in os.listdir(path) if e.endswith(".npy")) == ["2-0.npy"]
    del owner, cache, got
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.skipif(sys.platform == "win32", reason="the shared decode cache needs fcntl")
def test_shared_decode_cache_recycles_files_only_once_unmapped():
    import gc

    owner, cache = _owned_cache()

    def unit(v):
        return lambda: {"a": np.full((3, 4), float(v))}

    path = cache.path

    def files():  # the free pool's files as "free/..."
        pool = os.path.join(path, "free")
        free = sorted(os.listdir(pool)) if os.path.isdir(pool) else []
        return sorted([e for e in os.listdir(path) if e.endswith(".npy")]
                      + [f"free/{e}" for e in free])

    cache.get(0, ["a"], unit(0))
    mapped = cache.get(0, ["a"], unit(-1))["a"]  # a reader's map of unit 0 (share-locked)
    assert mapped.tolist() == np.full((3, 4), 0.0).tolist()
    cache.evict(0, ["a"])  # its file goes to the free pool, still mapped
    assert [f.startswith("free/") for f in files()] == [True]
    cache.get(1, ["a"], unit(1))  # must not overwrite the mapped file: a new one
    assert sorted(f.startswith("free/") for f in files()) == [False, True]
    assert mapped.tolist() == np.full((3, 4), 0.0).tolist()
    del mapped
    gc.collect()  # the map closes: the lock goes with it
    cache.get(2, ["a"], unit(2))  # reuses the free file
    assert files() == ["1-0.npy", "2-0.npy"]
    assert cache.get(2, ["a"], unit(-1))["a"].tolist() == np.full((3, 4), 2.0).tolist()
    assert cache.get(1, ["a"], unit(-1))["a"].tolist() == np.full((3, 4), 1.0).tolist()
    cache.free_files = 0  # over the cap: evicted files are deleted
    cache.evict(1, ["a"])
    assert files() == ["2-0.npy"]
    del owner, cache
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="gather_rows needs memfd_create")
def test_gather_rows_writes_rows_and_the_label_tail(monkeypatch):
    import torchfn.data._alloc as alloc

    monkeypatch.setattr(alloc, "get_worker_info", lambda: object())  # as in a worker
    a = np.arange(24, dtype=np.float32).reshape(6, 2, 2)
    b = -np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    parts = [(a, np.array([4, 0, 1, 2]), np.array([0, 2, 3, 4])),  # a run: rows 0, 1, 2
             (b, np.array([2, 1]), np.array([1, 5]))]
    alloc.reserve_tail(8 * 6)
    got = alloc.gather_rows(parts, 6)
    tail = alloc.take_tail()
    ref = np.stack([a[4], b[2], a[0], a[1], a[2], b[1]])
    assert got.tolist() == ref.tolist() and got.dtype == np.float32
    t = alloc.batch_tensor(got)
    assert t.untyped_storage().is_shared() and t.tolist() == ref.tolist()
    assert tail.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    tail.view(torch.int64)[:] = torch.arange(6)  # the labels' bytes are writable, after the rows
    assert t.tolist() == ref.tolist() and tail.view(torch.int64).tolist() == list(range(6))
    monkeypatch.setattr(alloc, "get_worker_info", lambda: None)
    assert alloc.gather_rows(parts, 6) is None  # outside a worker: the caller's own path


def test_batch_tensor_keeps_the_shared_block():
    from torchfn.data._alloc import alloc_bytes, batch_tensor

    block = alloc_bytes(64 + 16, True)
    a = block[:32].numpy().view(np.float32).reshape(2, 4)
    a[:] = np.arange(8).reshape(2, 4)
    t = batch_tensor(a)
    assert t.untyped_storage().is_shared() and t.tolist() == a.tolist()
    assert t.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
    tail = batch_tensor(block[64:].numpy().view(np.int64))
    assert tail.storage_offset() == 8 and tail.shape == (2,) and tail.untyped_storage().is_shared()
    assert not torch.from_numpy(a).untyped_storage().is_shared()  # why batch_tensor exists
    plain = np.arange(6.0).reshape(2, 3)
    assert batch_tensor(plain).tolist() == plain.tolist()
    strided = a[:, ::2]  # not contiguous: a private copy-free tensor via from_numpy
    assert batch_tensor(strided).tolist() == strided.tolist()
