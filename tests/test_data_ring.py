"""Worker batch blocks reused through a ring (torchfn.data._ring): what the main process gets
equals the in-process stream, batches kept alive are never overwritten, and every other way
out of a worker (a wrapper's own dict, plain pickling, early shutdown, persistent workers)
stays right."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from torchfn.data import NumpySource, StreamingDataset, _ring, write_shards

N, D, B = 2000, 64, 32  # 63 batches: ~32 per worker, more than a ring's 16 blocks


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(0)
    return rng.standard_normal((N, D)).astype(np.float32), (np.arange(N) * 7) % 10


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, arrays):
    x, y = arrays
    root = tmp_path_factory.mktemp("ring") / "shards"
    write_shards(NumpySource({"x": x}, labels=y), root, samples_per_shard=300)
    return root


def _dataset(kind, arrays, shard_dir, **kw):
    x, y = arrays
    src = NumpySource({"x": x}, labels=y) if kind == "numpy" else shard_dir
    return StreamingDataset(src, batch_size=B, seed=3, **kw)


def _copy(batch):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", ["numpy", "shards"])
def test_worker_batches_equal_in_process_and_kept_ones_are_not_overwritten(
        kind, arrays, shard_dir):
    ref = [_copy(b) for b in _dataset(kind, arrays, shard_dir)]
    loader = DataLoader(_dataset(kind, arrays, shard_dir), batch_size=None, num_workers=2)
    got, held, before, regions = [], {}, set(_ring._regions), set()
    for i, batch in enumerate(loader):
        assert type(batch) is dict  # what a user gets: a plain dict of tensors
        regions |= set(_ring._regions) - before
        got.append(_copy(batch))
        if i % 3 == 0:
            held[i] = batch  # alive while the workers go on reusing blocks
    assert regions  # the batches came through ring blocks of this loader's workers
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        _equal(a, b)
    for i, batch in held.items():
        _equal(batch, ref[i])  # still the batch it was


def test_holding_every_batch_falls_back_to_fresh_blocks(arrays, shard_dir):
    ref = [_copy(b) for b in _dataset("numpy", arrays, shard_dir)]
    batches = list(DataLoader(_dataset("numpy", arrays, shard_dir), batch_size=None,
                              num_workers=2))
    assert len(batches) == len(ref) > 2 * _ring._MAX_BLOCKS
    for a, b in zip(batches, ref, strict=True):
        _equal(a, b)


class _Rewrap(IterableDataset):
    """A user's wrapper: yields its own plain dict of the inner batch's tensors."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        for b in self.inner:
            yield {"inputs": b["x"], "targets": b["label"]}


def test_a_wrapper_yielding_its_own_dict_gets_copies(arrays, shard_dir):
    ref = [_copy(b) for b in _dataset("shards", arrays, shard_dir)]
    got = list(DataLoader(_Rewrap(_dataset("shards", arrays, shard_dir)), batch_size=None,
                          num_workers=2))
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a["inputs"], b["x"]) and torch.equal(a["targets"], b["label"])


def test_early_shutdown_and_persistent_workers(arrays, shard_dir):
    ds = _dataset("numpy", arrays, shard_dir, shuffle=False)
    ref = [_copy(b) for b in ds]
    for _ in range(12):  # loaders shut down early: hand-overs that never arrive
        for i, _batch in enumerate(DataLoader(ds, batch_size=None, num_workers=2)):
            if i == 3:
                break
    # bounded: drained regions are dropped, closed undrained ones kept at most _KEEP_CLOSED.
    # A sweep runs when a region registers; a worker marks its region closed as it exits,
    # which under load can come after the next loader's registration: sweep once more now
    # that every loader is gone (the +2: a worker killed by a join timeout never closes)
    del _batch
    gc.collect()
    with _ring._lock:
        _ring._sweep()
    assert len(_ring._regions) <= _ring._KEEP_CLOSED + 2
    got = [_copy(b) for b in DataLoader(ds, batch_size=None, num_workers=2)]
    for a, b in zip(got, ref, strict=True):
        _equal(a, b)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    before = set(_ring._regions)
    for _ in range(3):  # the same workers, their regions registered once
        got = [_copy(b) for b in loader]
        assert len(got) == len(ref)
        for a, b in zip(got, ref, strict=True):
            _equal(a, b)
    assert len(set(_ring._regions) - before) == 2
    del loader


def test_ring_batch_pickles_as_a_plain_dict_outside_a_queue():
    batch = _ring.RingBatch({"x": torch.arange(6.0).view(2, 3), "n": 2})
    for back in (pickle.loads(pickle.dumps(batch)), copy.deepcopy(batch)):
        assert back.keys() == batch.keys() and torch.equal(back["x"], batch["x"])
    buf = io.BytesIO()
    torch.save(batch, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)["x"], batch["x"])
    # outside a worker nothing is taken from a ring and nothing is wrapped
    assert _ring.take(1000) is None
    assert type(_ring.wrap({"x": torch.zeros(1)})) is dict


def test_a_reference_to_an_unknown_region_is_a_clear_error():
    with pytest.raises(RuntimeError, match="never received"):
        _ring._rebuild([(0, "no-such-ring", (8192, 4096, 4096, 1), None)], [])


class _Hoard(IterableDataset):
    """Keeps every inner batch in the worker (never sent) and checks them at the end."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        kept = []
        for b in self.inner:
            kept.append((b, _copy(b)))
            yield {"sum": b["x"].sum().reshape(1)}
        yield {"intact": torch.tensor([all(torch.equal(b["x"], c["x"]) and torch.equal(
            b["label"], c["label"]) for b, c in kept)])}


def test_batches_a_worker_keeps_are_not_reused():
    x = np.random.default_rng(1).standard_normal((N, D)).astype(np.float32)
    ds = StreamingDataset(NumpySource({"x": x}, labels=np.arange(N) % 3), batch_size=B,
                          seed=0)
    out = list(DataLoader(_Hoard(ds), batch_size=None, num_workers=2))
    flags = [o["intact"] for o in out if "intact" in o]
    assert len(flags) == 2 and all(bool(f) for f in flags)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs a CUDA device")
def test_pinned_batches_rebuilt_in_the_pin_thread(arrays, shard_dir):
    ref = [_copy(b) for b in _dataset("shards", arrays, shard_dir)]
    loader = DataLoader(_dataset("shards", arrays, shard_dir), batch_size=None, num_workers=2,
                        pin_memory=True)
    got = []
    for batch in loader:
        assert batch["x"].is_pinned()
        got.append(_copy(batch))
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        _equal(a, b)


def test_meta_fields_come_through_the_ring(arrays, shard_dir):
    ref = [_copy(b) for b in _dataset("shards", arrays, shard_dir, meta=True)]
    got = [_copy(b) for b in DataLoader(_dataset("shards", arrays, shard_dir, meta=True),
                                        batch_size=None, num_workers=2)]
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.keys() == b.keys() == {"x", "label", "id", "padded", "rank", "worker",
                                         "position"}
        assert a["id"].dtype == torch.int64 and a["padded"].dtype == torch.bool
        for k in a.keys() - {"worker"}:  # in-process every batch is worker 0's
            assert torch.equal(a[k], b[k]), k
        assert (a["worker"] == i % 2).all()  # the DataLoader takes workers round-robin


def _augment(sample):
    """A per-sample transform: new tensors, an int and a string field."""
    return {"x": sample["x"] * 2 + 1, "label": sample["label"], "n": int(sample["label"]) + 7,
            "tag": f"s{int(sample['label'])}"}


def test_per_sample_transform_batches_collated_into_ring_blocks(arrays, shard_dir):
    ref = list(_dataset("shards", arrays, shard_dir, transform=_augment))
    before, new = set(_ring._regions), set()
    got = []
    for batch in DataLoader(_dataset("shards", arrays, shard_dir, transform=_augment),
                            batch_size=None, num_workers=2):
        new |= set(_ring._regions) - before  # this loader's workers registered regions
        got.append(batch)
    assert new and len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):  # what default_collate gives in the main process
        assert a.keys() == b.keys()
        for k in ("x", "label", "n"):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        assert a["tag"] == b["tag"]
