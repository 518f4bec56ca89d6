"""plan() properties (hypothesis), StreamingDataset with real DataLoader workers, resume, audit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from torchfn.data import _stream
from torchfn.data._audit import Auditor, audit_plan
from torchfn.data._plan import global_order, plan
from torchfn.data._shards import ShardWriter
from torchfn.data._stream import StreamingDataset, StreamingLoader, state_from_stateful_loader


def _loader_order(*, num_workers: int, batch_size: int, **kw) -> tuple[list[int], list[bool]]:
    """What a DataLoader yields for one rank: round-robin over worker batches, in order."""
    queues = []
    for w in range(num_workers):
        p = plan(num_workers=num_workers, worker_id=w, batch_size=batch_size, **kw)
        cuts = np.flatnonzero(np.diff(p.positions // batch_size)) + 1
        chunks = np.split(np.arange(len(p.ids)), cuts)
        queues.append([(p.ids[c].tolist(), p.padded[c].tolist()) for c in chunks if len(c)])
    ids, pads, t = [], [], 0
    active = list(range(num_workers))
    while active:  # DataLoader: next task to the next active worker in cycle order
        w = active[t % len(active)] if len(active) == num_workers else active[0]
        if not queues[w]:
            active.remove(w)
            continue
        i, p = queues[w].pop(0)
        ids += i
        pads += p
        t += 1
    return ids, pads


sizes_st = st.lists(st.integers(0, 9), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    sizes=sizes_st, world=st.integers(1, 4), workers=st.integers(1, 3), batch=st.integers(1, 5),
    policy=st.sampled_from(["drop", "pad"]), seed=st.integers(0, 2**40), epoch=st.integers(0, 3),
    buf=st.sampled_from([None, 1, 3, 100]),
)
def test_plan_exactly_once_disjoint_equal_lengths(sizes, world, workers, batch, policy, seed,
                                                  epoch, buf):
    n = sum(sizes)
    common = dict(seed=seed, epoch=epoch, shard_sizes=sizes, world_size=world,
                  shuffle_buffer=buf, policy=policy)
    streams, pads = [], []
    for r in range(world):
        ids, pad = _loader_order(num_workers=workers, batch_size=batch, rank=r, **common)
        one = plan(**common, rank=r)  # single worker: the rank stream itself
        assert ids == one.ids.tolist() and pad == one.padded.tolist()
        assert one.remaining == len(ids)
        streams.append(ids)
        pads.append(pad)
    lengths = {len(s) for s in streams}
    assert len(lengths) == 1  # equal lengths on every rank
    real = [i for s, p in zip(streams, pads, strict=True) for i, q in zip(s, p, strict=True)
            if not q]
    assert len(real) == len(set(real))  # exactly once: no duplicates across ranks/workers
    if policy == "pad":
        assert sorted(real) == list(range(n))
        assert lengths == {-(-n // world)}
    else:
        assert set(real) <= set(range(n)) and n - len(real) < world
        assert not any(any(p) for p in pads)
        assert lengths == {n // world}
    assert sorted(global_order(seed=seed, epoch=epoch, shard_sizes=sizes,
                               shuffle_buffer=buf).tolist()) == list(range(n))


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6), world=st.integers(1, 3),
    workers=st.lists(st.integers(1, 3), min_size=3, max_size=3),
    batches=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    cuts=st.lists(st.floats(0, 1), min_size=2, max_size=2),
    policy=st.sampled_from(["drop", "pad"]), seed=st.integers(0, 1000),
)
def test_plan_resume_equals_no_resume(sizes, world, workers, batches, cuts, policy, seed):
    """Two resumes (with changed worker counts and batch sizes) == one uninterrupted run."""
    common = dict(seed=seed, epoch=1, shard_sizes=sizes, world_size=world, policy=policy)
    for r in range(world):
        full, full_pad = _loader_order(num_workers=workers[0], batch_size=batches[0], rank=r,
                                       **common)
        k1, k2 = sorted(int(c * len(full)) for c in cuts)
        got = full[:k1]
        got += _loader_order(num_workers=workers[1], batch_size=batches[1], rank=r,
                             consumed=world * k1, **common)[0][: k2 - k1]
        rest, rest_pad = _loader_order(num_workers=workers[2], batch_size=batches[2], rank=r,
                                       consumed=world * k2, **common)
        got += rest
        assert got == full
        assert rest_pad == full_pad[k2:]


def test_plan_is_deterministic_and_reshuffles_per_epoch():
    a = plan(seed=5, epoch=0, shard_sizes=[50, 50, 50]).ids
    assert np.array_equal(a, plan(seed=5, epoch=0, shard_sizes=[50, 50, 50]).ids)
    assert not np.array_equal(a, plan(seed=5, epoch=1, shard_sizes=[50, 50, 50]).ids)
    assert not np.array_equal(a, plan(seed=6, epoch=0, shard_sizes=[50, 50, 50]).ids)
    # buffer shuffle keeps locality: each position moves at most one window from its shard slot
    g = global_order(seed=1, epoch=0, shard_sizes=[10] * 10, shuffle_buffer=10)
    assert all(len({int(i) // 10 for i in g[w : w + 10]}) == 1 for w in range(0, 100, 10))
    assert plan(seed=0, epoch=0, shard_sizes=6, shuffle=False).ids.tolist() == list(range(6))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=8), buf=st.integers(1, 70),
       seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 3))
def test_global_order_is_the_stable_window_sort_of_its_keys(sizes, buf, seed, epoch):
    """The order sorts with numpy's default (unstable) sort: the keys are distinct, so it is the
    stable lexsort (shards by key, then each window of ``buf`` by key) it stands for."""
    from torchfn.data._plan import _keys

    starts = np.cumsum([0, *sizes])
    shard_keys = _keys(seed, epoch, 1, len(sizes))
    assert len(np.unique(shard_keys)) == len(sizes)
    shards = np.lexsort((shard_keys,))
    g = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in shards]).astype(np.int64)
    keys = _keys(seed, epoch, 2, len(g))
    ref = g[np.lexsort((keys, np.arange(len(g)) // buf))]
    got = global_order(seed=seed, epoch=epoch, shard_sizes=sizes, shuffle_buffer=buf)
    assert got.tolist() == ref.tolist()


def test_plan_errors_name_the_argument():
    with pytest.raises(ValueError, match="rank=2"):
        plan(seed=0, epoch=0, shard_sizes=4, world_size=2, rank=2)
    with pytest.raises(ValueError, match="worker_id=3"):
        plan(seed=0, epoch=0, shard_sizes=4, num_workers=2, worker_id=3)
    with pytest.raises(ValueError, match="policy='keep'"):
        plan(seed=0, epoch=0, shard_sizes=4, policy="keep")
    with pytest.raises(ValueError, match="batch_size"):
        plan(seed=0, epoch=0, shard_sizes=4, batch_size=0)


# ----------------------------------------------------------------- datasets on disk
@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    with ShardWriter(root, samples_per_shard=16) as w:
        for i in range(101):
            w.write({"x": torch.full((4,), float(i), dtype=torch.float64),
                     "y": torch.full((2, 2), i, dtype=torch.int32)}, label=i % 3)
    return root


def _ids(batches):
    return torch.cat([b["id"] for b in batches]).tolist()


def _rank_stream(ds):
    p = plan(seed=ds.seed, epoch=ds.epoch, shard_sizes=ds.shard_sizes, world_size=ds.world_size,
             rank=ds.rank, policy=ds.policy)
    return p.ids.tolist()


@pytest.mark.parametrize("batched", [True, False])
def test_dataloader_two_workers_yields_the_rank_stream(shard_dir, batched):
    ds = StreamingDataset(shard_dir, batch_size=8, seed=3, meta=True, batched=batched,
                          world_size=2, rank=1, policy="pad")
    loader = DataLoader(ds, batch_size=None if batched else 8, num_workers=2, prefetch_factor=3)
    batches = list(loader)
    ids = _ids(batches)
    assert ids == _rank_stream(ds) and len(ids) == 51
    assert {int(w) for b in batches for w in b["worker"]} == {0, 1}
    for b in batches:  # contents and labels follow the ids
        assert torch.equal(b["x"], b["id"].double()[:, None].expand(-1, 4))
        assert torch.equal(b["y"], b["id"].int()[:, None, None].expand(-1, 2, 2))
        assert torch.equal(b["label"], b["id"] % 3)
    assert [int(x) for b in batches for x, p in zip(b["id"], b["padded"], strict=True) if p] == \
        ds.padded_ids().tolist()
    assert len(loader) == len(batches) == 7


def test_set_epoch_reshuffles_and_epochs_cover_everything(shard_dir):
    ds = StreamingDataset(shard_dir, batch_size=10, seed=0, meta=True)
    e0 = _ids(ds)
    ds.set_epoch(1)
    e1 = _ids(ds)
    assert e0 != e1 and sorted(e0) == sorted(e1) == list(range(101))
    ds.set_epoch(0)
    assert _ids(ds) == e0


def _resume_run(shard_dir, steps_workers, batch_sizes, stateful=False):
    """Consume `steps` batches with `workers` workers per leg; resume in a fresh dataset."""
    out, state = [], None
    for (steps, workers), bs in zip(steps_workers, batch_sizes, strict=True):
        ds = StreamingDataset(shard_dir, batch_size=bs, seed=11, meta=True, world_size=2, rank=0)
        ds.set_epoch(2)
        if state is not None:
            ds.load_state_dict(state)
            ds.set_epoch(2)  # same epoch: keeps the pending resume
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


def test_resume_chain_with_changed_workers_equals_uninterrupted(shard_dir):
    full, _ = _resume_run(shard_dir, [(100, 2)], [7])
    ds = StreamingDataset(shard_dir, batch_size=7, seed=11, meta=True, world_size=2, rank=0)
    ds.set_epoch(2)
    assert full == _rank_stream(ds) and len(full) == 50
    got, state = _resume_run(shard_dir, [(2, 2), (3, 0), (100, 1)], [7, 5, 9])
    assert got == full
    assert state["consumed"] == 2 * 50 and state["epoch"] == 2


def test_state_dict_round_trip_and_errors(shard_dir):
    ds = StreamingDataset(shard_dir, batch_size=4, seed=1, meta=True)
    it = iter(ds)
    first = [next(it)["id"].tolist() for _ in range(3)]
    sd = ds.state_dict()
    assert sd == {"epoch": 0, "consumed": 12, "seed": 1, "world_size": 1, "batch_size": 4,
                  "num_samples": 101}
    ds2 = StreamingDataset(shard_dir, batch_size=4, seed=1, meta=True)
    ds2.load_state_dict(sd)
    assert _ids(ds2) == _ids(ds)[12:]
    assert [i for b in first for i in b] == _ids(ds)[:12]
    assert len(_ids(ds2)) == 101  # the resume applies to one iteration only
    with pytest.raises(ValueError, match="seed=1"):
        StreamingDataset(shard_dir, batch_size=4, seed=2).load_state_dict(sd)
    ds2.load_state_dict(sd)
    ds2.set_epoch(1)  # a new epoch drops the pending resume
    assert len(_ids(ds2)) == 101


# torchdata touches the deprecated torch.set_vital at import (inside torchdata, not ours)
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stateful_dataloader_resume(shard_dir):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        ds = StreamingDataset(shard_dir, batch_size=6, seed=4, meta=True)
        return sdl.StatefulDataLoader(ds, batch_size=None, num_workers=2)

    full = _ids(make())
    loader = make()
    it = iter(loader)
    head = [next(it)["id"].tolist() for _ in range(5)]
    sd = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(sd)  # same worker count: StatefulDataLoader's own restore
    assert [i for b in head for i in b] + _ids(resumed) == full
    # a different worker count: take the exact consumed count out of the loader state
    state = state_from_stateful_loader(sd)
    assert state["consumed"] == 30
    ds = StreamingDataset(shard_dir, batch_size=6, seed=4, meta=True)
    ds.load_state_dict(state)
    rest = _ids(DataLoader(ds, batch_size=None, num_workers=1))
    assert [i for b in head for i in b] + rest == full


def test_transform_hooks(shard_dir):
    def tf(s):
        return {"x": s["x"] * 2, "label": s["label"]}

    ds = StreamingDataset(shard_dir, batch_size=5, seed=0, transform=tf, shuffle=False)
    b = next(iter(ds))
    assert torch.equal(b["x"][:, 0], 2 * torch.arange(5, dtype=torch.float64))
    assert set(b) == {"x", "label"}
    ds = StreamingDataset(shard_dir, batch_size=5, seed=0, shuffle=False,
                          batch_transform=lambda b: {**b, "x": b["x"].float()})
    assert next(iter(ds))["x"].dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs an accelerator")
def test_pin_memory(shard_dir):
    ds = StreamingDataset(shard_dir, batch_size=8)
    b = next(iter(StreamingLoader(ds, num_workers=2, pin_memory=True)))
    assert b["x"].is_pinned()


def test_auditor_checks_coverage_duplicates_and_balance(shard_dir):
    labels = StreamingDataset(shard_dir, batch_size=8).labels
    for policy, missing in (("drop", 2), ("pad", 0)):
        audit = Auditor()
        for rank in range(3):
            ds = StreamingDataset(shard_dir, batch_size=8, seed=2, meta=True, world_size=3,
                                  rank=rank, policy=policy)
            for b in StreamingLoader(ds, num_workers=2):
                audit.record(b)
        rep = audit.report(labels, allowed_missing=2, world_size=3)
        assert rep.ok and len(rep.missing) == missing and not rep.duplicates
        assert set(rep.rank_lengths.values()) == {33 if policy == "drop" else 34}
        assert rep.padded == (1 if policy == "pad" else 0)
        assert rep.expected_class_counts == {0: 34, 1: 34, 2: 33}
        assert rep.max_class_deviation <= 2 / 33
        assert rep.records.shape == (99 if policy == "drop" else 102, 5)
    # the audit catches a duplicate and unequal ranks
    bad = Auditor()
    bad.record({"id": torch.tensor([0, 1, 1]), "padded": torch.zeros(3, dtype=torch.bool),
                "rank": torch.tensor([0, 0, 1]), "worker": torch.zeros(3, dtype=torch.int64)})
    rep = bad.report([0, 1, 0])
    assert rep.duplicates == (1,) and rep.missing == (2,) and not rep.ok


def test_audit_plan_matches_the_guarantees():
    labels = np.arange(37) % 4
    rep = audit_plan(seed=9, epoch=3, shard_sizes=[10, 10, 17], labels=labels, world_size=4,
                     num_workers=2, batch_size=3, policy="pad")
    assert rep.ok and rep.seen == 37 and rep.padded == 3 and rep.missing == ()
    rep = audit_plan(seed=9, epoch=3, shard_sizes=[10, 10, 17], labels=labels, world_size=4,
                     num_workers=2, batch_size=3, policy="drop")
    assert rep.ok and rep.seen == 36 and set(rep.rank_lengths.values()) == {9}


class _PerSamplePath(StreamingDataset):
    """The memory-map + per-sample checksum path (what ``_read_batch`` falls back to)."""

    def _read_batch(self, ids):
        return None


@pytest.mark.parametrize("checksum", ["xxh3_64", "crc32"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_readinto_batches_equal_the_per_sample_path(tmp_path, shuffle, checksum, monkeypatch):
    monkeypatch.setattr(_stream, "_READ_MIN_BYTES", 1)  # tiny samples take the readinto path
    g = torch.Generator().manual_seed(2)
    with ShardWriter(tmp_path, samples_per_shard=13, checksum=checksum) as w:
        for i in range(70):
            w.write({"x": torch.randn(3, 4, generator=g, dtype=torch.float64),
                     "z": torch.randint(-5, 5, (2,), generator=g, dtype=torch.int64)},
                    label=i % 4)
    kw = {"batch_size": 8, "seed": 1, "shuffle": shuffle, "meta": True, "policy": "pad",
          "world_size": 3, "rank": 1}
    fast = StreamingDataset(tmp_path, **kw)
    ids = fast.padded_ids()
    assert fast._read_batch(np.array([0, 13, 12, 1, 0])) is not None  # the fast path applies
    for workers in (0, 2):
        got = list(DataLoader(fast, batch_size=None, num_workers=workers))
        ref = list(DataLoader(_PerSamplePath(tmp_path, **kw), batch_size=None,
                              num_workers=workers))
        assert len(got) == len(ref) == len(fast)
        for a, b in zip(got, ref, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert set(ids.tolist()) <= set(torch.cat([b["id"] for b in got]).tolist())


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    with ShardWriter(root, samples_per_shard=4) as w:
        for i in range(10):
            w.write({"x": torch.full((2,), float(i))}, label=i % 3)
    return root


# DataLoader warns when the workers outnumber this machine's cores (a CI box with 2 cores)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
# (workers, batch size): 10 samples in 4 batches of 3 (the last one short), or in 2 batches of 6
# (fewer batches than 3 workers: one worker has nothing even in a full epoch)
@pytest.mark.parametrize(("workers", "bs"), [(0, 3), (1, 3), (2, 3), (3, 3), (3, 6)])
def test_resume_at_and_near_the_epoch_end_equals_uninterrupted(small_dir, workers, bs):
    """Regression: a worker with an empty share of the rest raised IndexError (a state saved
    at the end of an epoch, within the last workers - 1 batches, or a short epoch)."""

    def loader():
        ds = StreamingDataset(small_dir, batch_size=bs, seed=7, meta=True)
        return StreamingLoader(ds, num_workers=workers)

    full, states = [], []  # the uninterrupted run over epochs 0 and 1; a state after each batch
    ld = loader()
    for epoch in range(2):
        ld.set_epoch(epoch)
        for b in ld:
            full += b["id"].tolist()
            states.append((len(full), ld.state_dict()))
    assert len(full) == 20 and sorted(full[:10]) == sorted(full[10:]) == list(range(10))
    assert states[len(states) // 2 - 1][1]["consumed"] == 10  # the state at the end of epoch 0
    for k, state in [(0, None), *states]:
        for first in (state["epoch"], state["epoch"] + 1) if state else (0,):
            ld = loader()
            if state is not None:
                ld.load_state_dict(state)
            got = []
            for epoch in range(first, 2):
                ld.set_epoch(epoch)
                got += [i for b in ld for i in b["id"].tolist()]
            # resuming from the epoch after the saved one skips the saved epoch's rest
            skipped = 10 - state["consumed"] if state and first > state["epoch"] else 0
            assert got == full[k + skipped :], (k, first)
