"""DevicePrefetcher / prefetch_to_device: nested batches pass through, the CPU path copies
nothing, and resuming from its state_dict (batches in flight included) equals an
uninterrupted run; on CUDA the batches arrive pinned-copied and equal the host ones."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

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


@pytest.mark.parametrize("depth,workers", [(1, 0), (3, 0), (2, 2)])
def test_resume_mid_epoch_loses_and_repeats_nothing(depth, workers):
    full = [i for b in DevicePrefetcher(_loader(workers=workers), "cpu", depth=depth)
            for i in b["id"].tolist()]
    assert sorted(full) == list(range(N))
    for stop in (0, 1, 5, 13, 14):  # 14 batches in the epoch
        loader = _loader(workers=workers)
        pf = DevicePrefetcher(loader, "cpu", depth=depth)
        it = iter(pf)
        head = [i for _ in range(stop) for i in next(it)["id"].tolist()]
        state = pf.state_dict()
        if 0 < stop < 14:  # the loader itself has already handed out the batches in flight
            assert loader.state_dict()["consumed"] == min(4 * (stop + depth), N)
        assert state["consumed"] == min(4 * stop, N)
        del it
        pf2 = DevicePrefetcher(_loader(workers=workers), "cpu", depth=depth)
        pf2.load_state_dict(state)
        tail = [i for b in pf2 for i in b["id"].tolist()]
        assert head + tail == full
    # after a full epoch the state is the loader's end-of-epoch state
    loader = _loader()
    pf = DevicePrefetcher(loader, "cpu", depth=depth)
    list(pf)
    assert pf.state_dict() == loader.state_dict() and pf.state_dict()["consumed"] == N


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
    big = [torch.randn(256, 1024) for _ in range(6)]  # large copies racing the consumer
    sums = [float(t.sum()) for t in big]
    got = [float(b.sum().item()) for b in prefetch_to_device(big, "cuda", depth)]
    assert np.allclose(got, sums, rtol=1e-5)
    full = [i for b in DevicePrefetcher(_loader(workers=2), "cuda", depth=depth)
            for i in b["id"].cpu().tolist()]
    pf = DevicePrefetcher(_loader(workers=2), "cuda", depth=depth)
    it = iter(pf)
    head = [i for _ in range(5) for i in next(it)["id"].cpu().tolist()]
    state = pf.state_dict()
    del it
    pf2 = DevicePrefetcher(_loader(state, workers=2), "cuda", depth=depth)
    assert head + [i for b in pf2 for i in b["id"].cpu().tolist()] == full
