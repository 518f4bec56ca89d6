"""DevicePrefetcher / prefetch_to_device: nested batches pass through, the CPU path copies
nothing, and resuming from its state_dict (batches in flight included) equals an
uninterrupted run; on CUDA the batches arrive pinned-copied and equal the host ones."""

from __future__ import annotations

from collections import OrderedDict, deque, namedtuple

import numpy as np
import pytest
import torch

from torchfn.data import (
    DevicePrefetcher,
    NumpySource,
    StreamingDataset,
    StreamingLoader,
    prefetch_to_device,
)
from torchfn.data._prefetch import _bucket, _stage, _StagingPool

N = 53
Pair = namedtuple("Pair", "a b")


def _loader(state=None, workers=0, bs=4):
    src = NumpySource({"x": np.arange(N * 2, dtype=np.float32).reshape(N, 2)},
                      labels=np.arange(N) % 3)
    ds = StreamingDataset(src, batch_size=bs, seed=5, meta=True)
    loader = StreamingLoader(ds, num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def _nested():
    return [{"x": torch.arange(3.0) + i, "pair": Pair(torch.ones(2) * i, "tag"),
             "list": [torch.zeros(1), 7], "od": OrderedDict(y=torch.tensor(i))}
            for i in range(4)]


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_cpu_passes_nested_batches_through_without_copies(depth):
    host = _nested()
    got = list(prefetch_to_device(host, "cpu", depth=depth))
    assert len(got) == len(host)
    for g, h in zip(got, host, strict=True):
        assert g["x"] is h["x"] and g["pair"].a is h["pair"].a  # .to("cpu"): the same tensors
        assert isinstance(g["pair"], Pair) and g["pair"].b == "tag"
        assert g["list"][1] == 7 and isinstance(g["od"], OrderedDict)
        assert g["od"]["y"] is h["od"]["y"]


def _pf(loader, depth, background):
    pf = DevicePrefetcher(loader, "cpu", depth=depth)
    pf._background = background  # the CUDA path's thread, run on the CPU
    return pf


@pytest.mark.parametrize("depth,workers,background",
                         [(1, 0, False), (3, 0, False), (2, 2, False), (1, 0, True),
                          (3, 0, True), (2, 2, True)])
def test_resume_mid_epoch_loses_and_repeats_nothing(depth, workers, background):
    full = [i for b in _pf(_loader(workers=workers), depth, background)
            for i in b["id"].tolist()]
    assert sorted(full) == list(range(N))
    for stop in (0, 1, 5, 13, 14):  # 14 batches in the epoch
        loader = _loader(workers=workers)
        pf = _pf(loader, depth, background)
        it = iter(pf)
        head = [i for _ in range(stop) for i in next(it)["id"].tolist()]
        state = pf.state_dict()
        if 0 < stop < 14:  # the loader itself has already handed out the batches in flight
            assert loader.state_dict()["consumed"] == min(4 * (stop + depth), N)
        assert state["consumed"] == min(4 * stop, N)
        del it
        pf2 = _pf(_loader(workers=workers), depth, background)
        pf2.load_state_dict(state)
        tail = [i for b in pf2 for i in b["id"].tolist()]
        assert head + tail == full
    # after a full epoch the state is the loader's end-of-epoch state
    loader = _loader()
    pf = _pf(loader, depth, background)
    list(pf)
    assert pf.state_dict() == loader.state_dict() and pf.state_dict()["consumed"] == N


class _FakeEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_staging_pool_reuses_a_buffer_only_after_its_copy_ran():
    sizes = []
    pool = _StagingPool(lambda n: sizes.append(n) or torch.empty(n, dtype=torch.uint8))
    assert [_bucket(n) for n in (1, 512, 513, 4096, 4097)] == [512, 512, 1024, 4096, 8192]
    a, b = pool.take(3000), pool.take(3000)  # both in the 4096 bucket
    assert a.numel() == b.numel() == 4096 and a.data_ptr() != b.data_ptr()
    e1, e2 = _FakeEvent(), _FakeEvent()
    keep = [torch.ones(1)]
    pool.give_back([a], e1, keep)
    pool.give_back([b], e2)
    assert pool.free_count() == 0 and pool.take(4000).data_ptr() not in (a.data_ptr(),
                                                                         b.data_ptr())
    e2.done = True  # events of one stream complete in order: b waits behind a
    assert pool.free_count() == 0
    e1.done = True
    assert pool.free_count() == 2 and pool._busy == deque()  # the kept batch is released
    got = {pool.take(2049).data_ptr(), pool.take(4096).data_ptr()}
    assert got == {a.data_ptr(), b.data_ptr()} and pool.allocated == 3
    assert pool.take(100).numel() == 512 and sizes == [4096, 4096, 4096, 512]
    done = _FakeEvent()
    done.done = True
    for _ in range(5):  # nothing taken (batches already pinned): kept batches still go
        pool.give_back([], done, [torch.ones(1)])
    assert len(pool._busy) == 1


def test_stage_copies_unpinned_tensors_into_pool_buffers():
    pool = _StagingPool(lambda n: torch.empty(n, dtype=torch.uint8))
    host = _nested()[2]
    host["t"] = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # not contiguous
    host["e"] = torch.zeros(0, 5)
    host["b"] = torch.tensor([True, False])
    used = []
    staged = _stage(host, pool, used)
    assert len(used) == 6  # x, pair.a, list[0], od.y, t, b; the empty one passes through
    assert staged["e"] is host["e"] and staged["pair"].b == "tag" and staged["list"][1] == 7
    for k in ("x", "t", "b"):
        assert staged[k].dtype == host[k].dtype and torch.equal(staged[k], host[k])
        assert staged[k].data_ptr() in {u.data_ptr() for u in used}
    assert torch.equal(staged["od"]["y"], host["od"]["y"]) and staged["od"]["y"].shape == ()


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"DevicePrefetcher\(depth=0\): expected an int >= 1"):
        DevicePrefetcher([], "cpu", depth=0)
    with pytest.raises(TypeError, match=r"DevicePrefetcher\.state_dict: the loader \(list\) "
                       r"has no state_dict\(\); use a resumable loader"):
        DevicePrefetcher([], "cpu").state_dict()
    with pytest.raises(TypeError, match=r"load_state_dict: the loader \(list\) has no"):
        DevicePrefetcher([], "cpu").load_state_dict({})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"device='cuda'\): CUDA is not available"):
            DevicePrefetcher([], "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("depth", [1, 3])
def test_cuda_batches_equal_host_batches_and_resume(depth):
    host = _nested()
    out = []
    pf = DevicePrefetcher(host, "cuda", depth=depth)
    assert pf.pin_memory
    for b in pf:
        # work queued on the current stream right away must see the copied values
        out.append({"x": (b["x"] * 2).cpu(), "a": (b["pair"].a + 1).cpu(),
                    "y": b["od"]["y"].cpu(), "dev": b["x"].device.type})
    torch.cuda.synchronize()
    for o, h in zip(out, host, strict=True):
        assert o["dev"] == "cuda"
        assert torch.equal(o["x"], h["x"] * 2) and torch.equal(o["a"], h["pair"].a + 1)
        assert torch.equal(o["y"], h["od"]["y"])
    # large copies racing the consumer: each batch cloned on the device (queued, no sync) while
    # the next copies into the staging buffers run; a buffer reused too early shows as a
    # changed clone (the copies are exact)
    big = [torch.randn(256, 1024, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    pf_big = prefetch_to_device(big, "cuda", depth)
    got = [b.clone() for b in pf_big]
    assert all(torch.equal(g.cpu(), t) for g, t in zip(got, big, strict=True))
    pf_big = prefetch_to_device(big, "cuda", depth)
    for b, t in zip(pf_big, big, strict=True):  # a consumer that waits for each batch
        assert torch.equal(b.cpu(), t)
    assert pf_big._pool.allocated < len(big)  # staging buffers are reused
    full = [i for b in DevicePrefetcher(_loader(workers=2), "cuda", depth=depth)
            for i in b["id"].cpu().tolist()]
    pf = DevicePrefetcher(_loader(workers=2), "cuda", depth=depth)
    it = iter(pf)
    head = [i for _ in range(5) for i in next(it)["id"].cpu().tolist()]
    state = pf.state_dict()
    del it
    pf2 = DevicePrefetcher(_loader(state, workers=2), "cuda", depth=depth)
    assert head + [i for b in pf2 for i in b["id"].cpu().tolist()] == full
