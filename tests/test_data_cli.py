"""`torchfn data convert|inspect|verify|stats` on small tar / npy / parquet / .tfs data, the
format detection and its errors, and sources over fsspec URLs (memory://) equal to local files."""

from __future__ import annotations

import importlib.util
import io
import json
import pickle
import tarfile

import numpy as np
import pytest
import torch

from torchfn.cli import main
from torchfn.data import (
    NumpySource,
    ParquetSource,
    RemoteNpy,
    ShardSource,
    StreamingDataset,
    StreamingLoader,
    TarSource,
    detect_format,
    open_source,
    plan,
    write_shards,
)

N = 23
SIZES = [9, 8, 6]


def _x(i):
    return np.full((3,), float(i))


def _tar_bytes(start, count):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(start, start + count):
            npy = io.BytesIO()
            np.save(npy, _x(i))
            for ext, data in (("x.npy", npy.getvalue()), ("cls", str(i % 3).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _tars():
    out, start = {}, 0
    for k, n in enumerate(SIZES):
        out[f"shard-{k:03d}.tar"] = _tar_bytes(start, n)
        start += n
    return out


@pytest.fixture
def data(tmp_path):
    """One small dataset (x = full((3,), id), label = id % 3) in every format."""
    (tmp_path / "tar").mkdir()
    for name, blob in _tars().items():
        (tmp_path / "tar" / name).write_bytes(blob)
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "x.npy", np.stack([_x(i) for i in range(N)]))
    np.save(tmp_path / "npy" / "y.npy", np.arange(N) % 3)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [_x(i).tolist() for i in range(N)], "y": np.arange(N) % 3}),
                   tmp_path / "d.parquet", row_group_size=10)
    import pyarrow.ipc

    (tmp_path / "hf").mkdir()  # datasets' save_to_disk layout: state.json + Arrow streams
    table = pa.table({"x": [_x(i).tolist() for i in range(N)], "label": np.arange(N) % 3})
    with pa.OSFile(str(tmp_path / "hf" / "data-00000-of-00001.arrow"), "wb") as f, \
            pyarrow.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (tmp_path / "hf" / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    write_shards(NumpySource({"x": np.stack([_x(i) for i in range(N)])},
                             labels=np.arange(N) % 3), tmp_path / "tfs", samples_per_shard=10)
    return tmp_path


# (path under `data`, --label, field name)
KINDS = {"tar": ("tar", None, "x.npy"), "npy": ("npy", "y", "x"),
         "parquet": ("d.parquet", "y", "x"), "tfs": ("tfs", None, "x"), "hf": ("hf", None, "x")}


def _args(kind, data):
    path, label, _ = KINDS[kind]
    return [str(data / path)] + ([] if label is None else ["--label", label])


def _run(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_detect_inspect_and_stats(kind, data, capsys):
    assert detect_format(data / KINDS[kind][0]) == kind
    rc, out, _ = _run(capsys, ["data", "inspect", *_args(kind, data)])
    field = KINDS[kind][2]
    assert rc == 0
    assert f"format    {kind}" in out and f"samples   {N} in" in out
    assert f"{field}" in out and "float64 [3]" in out
    assert "labels    0: 8, 1: 8, 2: 7 (3 classes)" in out
    rc, out, _ = _run(capsys, ["data", "stats", "--no-progress", *_args(kind, data)])
    assert rc == 0
    assert f"{field:<16} {N * 24} " in out
    assert "sample bytes min 24, mean 24.0, max 24" in out
    assert "labels       0: 8, 1: 8, 2: 7" in out


@pytest.mark.parametrize("kind", ["hf", "npy", "parquet", "tar"])
def test_convert_then_verify_round_trip(kind, data, capsys):
    dst = data / f"out-{kind}"
    rc, out, err = _run(capsys, ["data", "convert", *_args(kind, data), str(dst),
                                 "--samples-per-shard", "7"])
    assert rc == 0 and f"wrote {N} samples" in out and "as 4 .tfs shards" in out
    # the progress bar: on stderr with tqdm, nothing without it
    assert ("write_shards" in err) == (importlib.util.find_spec("tqdm") is not None)
    rc, out, _ = _run(capsys, ["data", "verify", str(dst)])
    assert rc == 0 and f"ok: {N} samples verified" in out
    src = open_source(data / KINDS[kind][0], label=KINDS[kind][1])
    shards = ShardSource(dst)
    assert shards.labels.tolist() == src.labels.tolist() == [i % 3 for i in range(N)]
    field = KINDS[kind][2]
    for i in range(N):
        assert torch.equal(shards.read_sample(i)[field], src.read_sample(i)[field])
    # --workers: the same bytes from two processes
    rc, _, _ = _run(capsys, ["data", "convert", *_args(kind, data), str(dst) + "-w2",
                             "--samples-per-shard", "7", "--workers", "2", "--no-progress"])
    assert rc == 0 and sorted(p.name for p in dst.iterdir()) == sorted(
        p.name for p in (data / f"out-{kind}-w2").iterdir())
    for f in sorted(p.name for p in dst.iterdir()):
        assert (dst / f).read_bytes() == (data / f"out-{kind}-w2" / f).read_bytes()
        assert shards.read_sample(i)[field].tolist() == _x(i).tolist()


def test_verify_names_the_corrupt_tar_member(data, capsys):
    path = data / "tar" / "shard-001.tar"
    with tarfile.open(path) as tf:
        off = tf.getmember("000011.x.npy").offset_data
    blob = bytearray(path.read_bytes())
    blob[off:off + 6] = b"BROKEN"
    path.write_bytes(bytes(blob))
    rc, out, _ = _run(capsys, ["data", "verify", str(data / "tar")])
    assert rc == 1
    assert f"CORRUPT {path} sample 2 (id 11): sample '000011'" in out
    assert "000011.x.npy" in out and f"1 of {N} samples corrupt" in out
    # a truncated tar cannot be opened at all: exit 1 naming the file; the others are verified
    path.write_bytes(bytes(blob[: off + 100]))
    rc, out, _ = _run(capsys, ["data", "verify", str(data / "tar")])
    assert rc == 1
    assert f"CORRUPT {path}: TarSource: {str(path)!r} is truncated: member '000011.x.npy'" in out
    assert f"0 of {N - SIZES[1]} samples corrupt, 1 files unreadable" in out


def test_verify_names_the_corrupt_shard_sample(data, capsys):
    shard = data / "tfs" / "shard-00001.tfs"
    blob = bytearray(shard.read_bytes())
    x = ShardSource(data / "tfs").read_sample(13)["x"].numpy().tobytes()
    at = bytes(blob).index(x)  # sample 3 of the second shard
    blob[at] ^= 0xFF
    shard.write_bytes(bytes(blob))
    rc, out, _ = _run(capsys, ["data", "verify", str(data / "tfs")])
    assert rc == 1
    assert f"CORRUPT {shard} sample 3 (id 13): " in out and "checksum mismatch" in out
    assert f"1 of {N} samples corrupt" in out


def test_errors_name_the_path_and_what_was_expected(data, tmp_path, capsys):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "a.csv").write_text("1,2\n")
    rc, _, err = _run(capsys, ["data", "inspect", str(tmp_path / "odd")])
    assert rc == 2
    assert f"detect_format({str(tmp_path / 'odd')!r}): a directory, but its entries are " \
           "['a.csv']; expected a .tfs shard directory (manifest.json)" in err
    rc, _, err = _run(capsys, ["data", "stats", str(tmp_path / "missing.tar")])
    assert rc == 2 and "missing.tar" in err and "no such file" in err
    rc, _, err = _run(capsys, ["data", "inspect", str(data / "tfs"), "--label", "y"])
    assert rc == 2 and "keep their labels in manifest.json" in err
    rc, _, err = _run(capsys, ["data", "inspect", str(data / "npy"), "--label", "z"])
    assert rc == 2 and "no z.npy; the arrays are ['x', 'y']" in err
    rc, _, err = _run(capsys, ["data", "convert", str(data / "npy"), str(tmp_path / "o")])
    assert rc == 2 and "has no labels" in err and "--default-label" in err
    rc, _, err = _run(capsys, ["data", "convert", str(data / "npy"), str(tmp_path / "o"),
                               "--label", "y", "--workers", "0"])
    assert rc == 2 and "--workers must be >= 1; got 0" in err
    rc, _, _ = _run(capsys, ["data", "convert", str(data / "npy"), str(tmp_path / "o"),
                             "--default-label", "0", "--no-progress"])
    assert rc == 0 and ShardSource(tmp_path / "o").labels.tolist() == [0] * N
    with pytest.raises(ValueError, match=r"a glob must end in one of"):
        detect_format(str(tmp_path / "*.csv"))


# ---------------------------------------------------------------------- fsspec memory://
@pytest.fixture
def mem():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = "/torchfn-test-data-cli"
    for name, blob in _tars().items():
        fs.pipe(f"{root}/tar/{name}", blob)
    for name, arr in (("x", np.stack([_x(i) for i in range(N)])), ("y", np.arange(N) % 3)):
        buf = io.BytesIO()
        np.save(buf, arr)
        fs.pipe(f"{root}/npy/{name}.npy", buf.getvalue())
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def _stream(src, world, bs, seed=5):
    out = []
    for r in range(world):
        ds = StreamingDataset(src, batch_size=bs, seed=seed, meta=True, world_size=world, rank=r,
                              policy="pad")
        ds.set_epoch(1)
        out.append([(b["id"].tolist(), b["x.npy" if "x.npy" in b else "x"].tolist(),
                     b["label"].tolist()) for b in ds])
    return out


def _resume(src, legs):
    out, state = [], None
    for steps, bs in legs:
        ds = StreamingDataset(src, batch_size=bs, seed=7, meta=True, world_size=2, rank=0)
        ds.set_epoch(3)
        if state is not None:
            ds.load_state_dict(state)
            ds.set_epoch(3)
        loader = StreamingLoader(ds, num_workers=0)
        it = iter(loader)
        for _ in range(steps):
            b = next(it, None)
            if b is None:
                break
            out += b["id"].tolist()
        state = loader.state_dict()
        del it
    return out


@pytest.mark.parametrize("kind", ["tar", "npy"])
def test_memory_url_sources_equal_local_files(kind, mem, data):
    if kind == "tar":
        remote, local = TarSource(f"{mem}/tar"), TarSource(str(data / "tar"))
        assert remote.files[0].startswith("memory://") and remote.shard_sizes == SIZES
    else:
        remote = NumpySource({"x": f"{mem}/npy/x.npy"}, labels=f"{mem}/npy/y.npy")
        local = NumpySource({"x": str(data / "npy" / "x.npy")}, labels=str(data / "npy" / "y.npy"))
        assert isinstance(remote.arrays["x"], RemoteNpy)
    assert remote.labels.tolist() == local.labels.tolist()
    assert remote.fingerprint() == local.fingerprint()
    ids = [5, 0, 22, 5, 9]
    for k, v in remote.read(ids).items():
        assert torch.equal(v, local.read(ids)[k])
    # exactly once over ranks, same batches as the local files
    got = _stream(remote, 3, 4)
    assert got == _stream(local, 3, 4)
    seen = sorted(i for rank in got for ids_, _, _ in rank for i in ids_)
    assert set(seen) == set(range(N))
    for rank in got:
        for ids_, xs, labels in rank:
            assert xs == [_x(i).tolist() for i in ids_] and labels == [i % 3 for i in ids_]
    ds = StreamingDataset(remote, batch_size=4, seed=5, world_size=3, rank=1, policy="pad")
    ds.set_epoch(1)
    expect = plan(seed=5, epoch=1, shard_sizes=remote.shard_sizes, world_size=3, rank=1,
                  policy="pad").ids.tolist()
    assert [i for ids_, _, _ in got[1] for i in ids_] == expect
    # resume mid-epoch (changed batch sizes) == uninterrupted == the local files
    full = _resume(remote, [(100, 4)])
    assert _resume(remote, [(1, 3), (2, 5), (100, 2)]) == full == _resume(local, [(100, 4)])
    # pickles by URL (workers re-open it)
    again = pickle.loads(pickle.dumps(remote))
    assert torch.equal(again.read([3])[KINDS["tar" if kind == "tar" else "npy"][2]],
                       remote.read([3])[KINDS["tar" if kind == "tar" else "npy"][2]])


def test_memory_url_parquet_and_cli(mem, data, capsys):
    pytest.importorskip("pyarrow")
    import fsspec

    fsspec.filesystem("memory").pipe(mem.removeprefix("memory://") + "/d.parquet",
                                     (data / "d.parquet").read_bytes())
    remote = ParquetSource(f"{mem}/d.parquet", label_column="y")
    local = ParquetSource(str(data / "d.parquet"), label_column="y")
    assert remote.shard_sizes == local.shard_sizes == [10, 10, 3]
    assert torch.equal(remote.read([22, 1])["x"], local.read([22, 1])["x"])
    assert remote.labels.tolist() == local.labels.tolist()
    assert detect_format(f"{mem}/tar") == "tar" and detect_format(f"{mem}/npy") == "npy"
    rc, out, _ = _run(capsys, ["data", "inspect", f"{mem}/tar"])
    assert rc == 0 and f"samples   {N} in 3 units (3 files" in out
    rc, out, _ = _run(capsys, ["data", "convert", f"{mem}/npy", "--label", "y",
                               str(data / "from-mem"), "--no-progress"])
    assert rc == 0
    assert ShardSource(data / "from-mem").read([4])["x"].tolist() == [_x(4).tolist()]


def test_remote_npy_rows_and_errors(mem):
    a = RemoteNpy(f"{mem}/npy/x.npy")
    ref = np.stack([_x(i) for i in range(N)])
    rows = np.array([7, 3, 3, 22, 8, 0])
    assert np.array_equal(a[rows], ref[rows]) and np.array_equal(a[5:9], ref[5:9])
    with pytest.raises(IndexError, match=r"rows must lie in \[0, 23\)"):
        a[np.array([23])]
    with pytest.raises(ValueError, match=r"not a readable \.npy file"):
        RemoteNpy(f"{mem}/tar/shard-000.tar")


def test_file_urls_equal_local_paths(data):
    pytest.importorskip("fsspec")
    remote, local = TarSource(f"file://{data}/tar"), TarSource(str(data / "tar"))
    assert remote.files[0].startswith("file://") and remote.fingerprint() == local.fingerprint()
    assert torch.equal(remote.read([20, 2])["x.npy"], local.read([20, 2])["x.npy"])
    npy = NumpySource({"x": f"file://{data}/npy/x.npy"})
    assert npy.read([6])["x"].tolist() == [_x(6).tolist()]


def test_urls_without_fsspec_say_so(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=r"reading URLs needs fsspec, which is not installed: "
                                          r"pip install fsspec"):
        TarSource("memory://nowhere/a.tar")
    with pytest.raises(ImportError, match=r"RemoteNpy\('memory://n/x.npy'\): reading URLs "
                                          r"needs fsspec"):
        NumpySource({"x": "memory://n/x.npy"})
