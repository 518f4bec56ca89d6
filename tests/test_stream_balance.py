"""StreamClassBalancer: balance bounds, accounting, determinism, ranks, resume, errors."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from torchfn.data._stream_balance import StreamClassBalancer

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


@st.composite
def streams(draw):
    """(stream, num_classes): items (position, label), labels skewed towards class 0."""
    c = draw(st.integers(1, 4))
    weights = draw(st.lists(st.integers(1, 10), min_size=c, max_size=c))
    pool = [k for k in range(c) for _ in range(weights[k])]
    labels = draw(st.lists(st.sampled_from(pool), max_size=80))
    return [(i, y) for i, y in enumerate(labels)], c


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@SETTINGS
@given(
    data=streams(),
    buffer_size=st.integers(1, 6),
    ratios=st.one_of(st.none(), st.lists(st.integers(1, 5), min_size=4, max_size=4)),
    seed=st.integers(0, 2**32),
)
def test_output_never_overshoots_targets_and_accounts_for_every_item(
    data, buffer_size, ratios, seed
):
    stream, c = data
    r = None if ratios is None else ratios[:c]
    bal = StreamClassBalancer(stream, c, buffer_size=buffer_size, seed=seed, ratios=r)
    out = list(bal)
    target = [1 / c] * c if r is None else [x / sum(r) for x in r]
    # every output is a distinct input item with its own label
    assert len({i for i, _ in out}) == len(out)
    assert all(stream[i] == (i, y) for i, y in out)
    # prefix bound: no class is ever a whole item ahead of its target share
    counts = [0] * c
    for t, (_, y) in enumerate(out, start=1):
        counts[y] += 1
        assert all(counts[k] < target[k] * t + 1 + 1e-9 for k in range(c))
        if r is None:
            assert max(counts) - min(counts) <= 1
    rep = bal.report()
    seen = Counter(y for _, y in stream)
    for k in range(c):
        assert rep.seen[k] == seen[k]
        assert rep.emitted[k] == counts[k]
        assert rep.seen[k] == rep.emitted[k] + rep.dropped[k] + rep.buffered[k]
        assert rep.buffered[k] <= buffer_size
    if out:
        ach = [counts[k] / len(out) for k in range(c)]
        assert rep.max_ratio_error == pytest.approx(max(abs(a - b) for a, b in zip(ach, target, strict=True)))
    # greedy: the pass stops only when every max-deficit class is empty
    if r is None and out:
        low = min(counts)
        assert all(rep.buffered[k] == 0 for k in range(c) if counts[k] == low)


def test_hand_computed_example():
    # 8 items of class 0 then 2 of class 1, buffers of 4:
    # emit 0 | class 1 lags -> wait; items 1-4 buffered, 5-7 evict (3 dropped) |
    # the two class-1 arrivals each release one class 1 then one class 0.
    stream = [(i, 0) for i in range(8)] + [(100, 1), (101, 1)]
    bal = StreamClassBalancer(stream, 2, buffer_size=4, seed=0)
    labels = [y for _, y in bal]
    assert labels == [0, 1, 0, 1, 0]
    rep = bal.report()
    assert rep.dropped == {0: 3, 1: 0} and rep.buffered == {0: 2, 1: 0}
    assert rep.achieved_ratios == {0: 0.6, 1: 0.4}


def test_deterministic_and_seed_and_epoch_dependent():
    stream = [(i, i % 3 if i % 5 else 0) for i in range(300)]

    def run(seed, epoch):
        bal = StreamClassBalancer(stream, 3, buffer_size=8, seed=seed)
        bal.set_epoch(epoch)
        return list(bal)

    assert run(1, 0) == run(1, 0)
    assert run(1, 0) != run(2, 0)
    assert run(1, 0) != run(1, 1)


@SETTINGS
@given(
    data=streams(),
    buffer_size=st.integers(1, 5),
    cuts=st.lists(st.integers(0, 30), min_size=1, max_size=2),
    use_fetch=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_resume_equals_no_resume(data, buffer_size, cuts, use_fetch, seed):
    stream, c = data
    kw = dict(classes=c, buffer_size=buffer_size, seed=seed, world_size=2, rank=1)
    expected = list(StreamClassBalancer(stream, **kw))
    got: list = []
    bal = StreamClassBalancer(stream, **kw)
    it = iter(bal)
    for cut in cuts:
        got += [x for _, x in zip(range(cut), it, strict=False)]
        state = _roundtrip(bal.state_dict())
        if use_fetch:  # the source itself resumed at the saved position; buffers via fetch
            bal = StreamClassBalancer(
                stream[state["position"] :], fetch=lambda p: stream[p], **kw
            )
        else:  # the source replays from the start
            bal = StreamClassBalancer(stream, **kw)
        bal.load_state_dict(state)
        it = iter(bal)
    got += list(it)
    assert got == expected


def test_ranks_take_disjoint_positions_and_limit_equalizes_lengths():
    stream = [(i, 0 if i % 4 else 1) for i in range(200)]
    outs = []
    for r in range(3):
        bal = StreamClassBalancer(stream, 2, buffer_size=4, seed=0, world_size=3, rank=r, limit=20)
        out = list(bal)
        assert all(i % 3 == r for i, _ in out)
        assert len(out) == 20 and Counter(y for _, y in out) == {0: 10, 1: 10}
        outs.append({i for i, _ in out})
    assert not (outs[0] & outs[1] or outs[0] & outs[2] or outs[1] & outs[2])


def test_target_ratios():
    stream = [(i, i % 2) for i in range(400)]
    bal = StreamClassBalancer(
        [(x, "ab"[y]) for x, y in stream], ["a", "b"], buffer_size=4, seed=0, ratios=[3, 1]
    )
    out = [y for _, y in bal]
    assert abs(out.count("a") - 0.75 * len(out)) < 1 and len(out) >= 260
    assert bal.report().target_ratios == {"a": 0.75, "b": 0.25}


def test_tensor_labels_are_accepted():
    stream = [(torch.tensor([float(i)]), torch.tensor(i % 2)) for i in range(10)]
    out = list(StreamClassBalancer(stream, 2, buffer_size=2, seed=0))
    assert [int(y) for _, y in out].count(0) == 5


def test_errors():
    with pytest.raises(ValueError, match=r"stream position 2 has label 7, which is not one of"):
        list(StreamClassBalancer([(0, 0), (1, 1), (2, 7)], 2, buffer_size=2, seed=0))
    with pytest.raises(ValueError, match=r"ratios=\[1.0\]\): expected 2 positive numbers"):
        StreamClassBalancer([], 2, buffer_size=2, seed=0, ratios=[1])
    with pytest.raises(ValueError, match=r"buffer_size=0\): expected an int >= 1"):
        StreamClassBalancer([], 2, buffer_size=0, seed=0)
    stream = [(i, 0) for i in range(10)]
    bal = StreamClassBalancer(stream, 2, buffer_size=3, seed=0)
    list(bal)
    short = StreamClassBalancer(stream[:4], 2, buffer_size=3, seed=0)
    short.load_state_dict(bal.state_dict())
    with pytest.raises(ValueError, match=r"replay 10 items, but it ended after 4"):
        list(short)
    other = StreamClassBalancer(stream, 2, buffer_size=4, seed=0)
    with pytest.raises(ValueError, match=r"state has buffer_size=3 but this balancer has"):
        other.load_state_dict(bal.state_dict())


def test_works_with_dataloader():
    stream = [(torch.tensor([float(i)]), i % 3 if i % 2 else 0) for i in range(120)]
    bal = StreamClassBalancer(stream, 3, buffer_size=6, seed=4)
    batches = list(DataLoader(bal, batch_size=6))
    ys = torch.cat([y for _, y in batches])
    assert torch.bincount(ys).max() - torch.bincount(ys).min() <= 1
    assert batches[0][0].shape == (6, 1) and len(batches) == -(-len(ys) // 6)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11
def test_stateful_dataloader_resume():
    sdl = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata not installed")
    stream = [(i, 0 if i % 3 else 1) for i in range(90)]

    def loader():
        return sdl.StatefulDataLoader(
            StreamClassBalancer(stream, 2, buffer_size=4, seed=1), batch_size=4
        )

    expected = [b[0].tolist() for b in loader()]
    first = loader()
    it = iter(first)
    got = [next(it)[0].tolist() for _ in range(3)]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    got += [b[0].tolist() for b in resumed]
    assert got == expected
