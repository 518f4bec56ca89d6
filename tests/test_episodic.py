"""EpisodicBatchSampler and split_episode: episode structure, ranks, resume, errors, DataLoader."""

from __future__ import annotations

import io
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from torchfn.data._episodic import EpisodicBatchSampler, split_episode

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
ALPHA = 1e-6  # per-example false-alarm rate of the statistical bound below


@st.composite
def episode_setups(draw):
    """(labels, n_way, k_shot, n_query) with every class large enough."""
    k_shot, n_query = draw(st.integers(1, 3)), draw(st.integers(0, 3))
    counts = draw(st.lists(st.integers(k_shot + n_query, 8), min_size=1, max_size=7))
    n_way = draw(st.integers(1, len(counts)))
    labels = [c for c, n in enumerate(counts) for _ in range(n)]
    perm = draw(st.permutations(range(len(labels))))
    return [labels[i] for i in perm], n_way, k_shot, n_query


def _check_episode(ep, labels, n_way, k_shot, n_query):
    """Plain reference check of one episode's layout."""
    assert len(ep) == n_way * (k_shot + n_query)
    assert len(set(ep)) == len(ep)  # distinct samples: no support/query overlap
    support, query = ep[: n_way * k_shot], ep[n_way * k_shot :]
    assert not set(support) & set(query)
    slot_classes = []
    for j in range(n_way):
        s = [labels[i] for i in support[j * k_shot : (j + 1) * k_shot]]
        q = [labels[i] for i in query[j * n_query : (j + 1) * n_query]]
        assert set(s) == {s[0]} and set(q) <= {s[0]}
        slot_classes.append(s[0])
    assert len(set(slot_classes)) == n_way
    return slot_classes


@SETTINGS
@given(setup=episode_setups(), world_size=st.integers(1, 3), seed=st.integers(0, 2**32))
def test_episodes_have_n_way_k_shot_and_queries(setup, world_size, seed):
    labels, n_way, k_shot, n_query = setup
    for r in range(world_size):
        s = EpisodicBatchSampler(
            labels, n_way, k_shot, n_query, 5, seed=seed, world_size=world_size, rank=r
        )
        for ep in s:
            _check_episode(ep, labels, n_way, k_shot, n_query)


@SETTINGS
@given(
    episodes=st.integers(1, 12),
    world_size=st.integers(1, 4),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_ranks_disjoint_equal_lengths_and_rank_independent(episodes, world_size, drop_last, seed):
    labels = [i % 6 for i in range(36)]
    if drop_last and episodes < world_size:
        with pytest.raises(ValueError, match="every rank would get 0 episodes"):
            EpisodicBatchSampler(labels, 3, 2, 2, episodes, seed=seed, world_size=world_size,
                                 drop_last=True)
    else:
        single = EpisodicBatchSampler(labels, 3, 2, 2, episodes, seed=seed)
        ids, lengths = [], set()
        for r in range(world_size):
            s = EpisodicBatchSampler(labels, 3, 2, 2, episodes, seed=seed,
                                     world_size=world_size, rank=r, drop_last=drop_last)
            lengths.add(len(s))
            ids += s.episode_ids()
            # counter-based: rank r's episodes are the single-process episodes of its ids
            assert list(s) == [single.episode(g) for g in s.episode_ids()]
        assert len(lengths) == 1
        assert len(ids) == len(set(ids))  # disjoint
        n = lengths.pop() * world_size
        assert sorted(ids) == list(range(n))
        per_rank = episodes // world_size if drop_last else -(-episodes // world_size)
        assert n == per_rank * world_size
        assert s.num_padded == max(n - episodes, 0)


@SETTINGS
@given(
    setup=episode_setups(),
    cuts=st.lists(st.integers(0, 8), min_size=1, max_size=2),
    epoch=st.integers(0, 3),
    seed=st.integers(0, 2**32),
)
def test_resume_equals_no_resume(setup, cuts, epoch, seed):
    labels, n_way, k_shot, n_query = setup
    kw = dict(n_way=n_way, k_shot=k_shot, n_query=n_query, episodes_per_epoch=7, seed=seed,
              world_size=2, rank=1)
    full = EpisodicBatchSampler(labels, **kw)
    full.set_epoch(epoch)
    expected = list(full)
    got: list[list[int]] = []
    s = EpisodicBatchSampler(labels, **kw)
    s.set_epoch(epoch)
    for cut in cuts:
        it = iter(s)
        got += [next(it) for _ in range(min(cut, len(s) - len(got)))]
        buf = io.BytesIO()
        torch.save(s.state_dict(), buf)
        buf.seek(0)
        s = EpisodicBatchSampler(labels, **kw)
        s.load_state_dict(torch.load(buf, weights_only=True))
        s.set_epoch(epoch)
    got += list(s)
    assert got == expected


def test_set_epoch_changes_episodes_deterministically():
    labels = [i % 10 for i in range(100)]
    a, b = (EpisodicBatchSampler(labels, 5, 1, 3, 4, seed=7) for _ in range(2))
    per_epoch = []
    for e in range(3):
        a.set_epoch(e)
        b.set_epoch(e)
        ea = list(a)
        assert ea == list(b)
        per_epoch.append(ea)
    assert per_epoch[0] != per_epoch[1] != per_epoch[2] != per_epoch[0]
    other_seed = EpisodicBatchSampler(labels, 5, 1, 3, 4, seed=8)
    other_seed.set_epoch(2)
    assert list(other_seed) != per_epoch[2]


def test_class_choice_is_uniform_within_hoeffding_bound():
    # each class is in an episode with probability n_way / C; 3000 episodes, union over C classes
    c, n_way, n = 8, 3, 3000
    labels = [i % c for i in range(c * 5)]
    s = EpisodicBatchSampler(labels, n_way, 1, 1, n, seed=0)
    hits = Counter(labels[ep[j]] for ep in s for j in range(n_way))
    t = math.sqrt(math.log(2 * c / ALPHA) / (2 * n))
    for k in range(c):
        assert abs(hits[k] / n - n_way / c) <= t, (k, hits)


def test_split_episode_matches_reference_loop():
    n_way, k_shot, n_query = 3, 2, 4
    labels = torch.tensor([i % 5 for i in range(50)])
    feats = torch.randn(50, 2, 3, dtype=torch.float64)
    s = EpisodicBatchSampler(labels, n_way, k_shot, n_query, 3, seed=1)
    for ep in s:
        sx, sy, qx, qy = s.split(feats[ep], labels[ep])
        # reference: walk the episode and relabel by first appearance in the support
        slot = {}
        ref_sx, ref_sy, ref_qx, ref_qy = [], [], [], []
        for pos, i in enumerate(ep):
            y = int(labels[i])
            if pos < n_way * k_shot:
                slot.setdefault(y, len(slot))
                ref_sx.append(feats[i])
                ref_sy.append(slot[y])
            else:
                ref_qx.append(feats[i])
                ref_qy.append(slot[y])
        torch.testing.assert_close(sx, torch.stack(ref_sx), rtol=0, atol=0)
        torch.testing.assert_close(qx, torch.stack(ref_qx), rtol=0, atol=0)
        assert sy.tolist() == ref_sy and qy.tolist() == ref_qy
        assert sy.dtype == qy.dtype == torch.int64


def test_errors_name_class_and_counts():
    labels = [0] * 5 + [1] * 2 + [2] * 3
    with pytest.raises(ValueError, match=r"n_way=4\): the labels have only 3 classes"):
        EpisodicBatchSampler(labels, 4, 1, 1, 2, seed=0)
    with pytest.raises(
        ValueError, match=r"k_shot \+ n_query = 4 samples, but class 1 has 2, class 2 has 3"
    ):
        EpisodicBatchSampler(labels, 2, 2, 2, 2, seed=0)
    with pytest.raises(ValueError, match=r"class 'b' has 1"):
        EpisodicBatchSampler(["a", "a", "b"], 2, 1, 1, 2, seed=0)
    with pytest.raises(ValueError, match=r"k_shot=0\): expected an int >= 1"):
        EpisodicBatchSampler(labels, 2, 0, 1, 2, seed=0)
    with pytest.raises(ValueError, match=r"expected x.shape\[0\] == n_way \* \(k_shot \+ n_query\) = 6"):
        split_episode(torch.zeros(5, 2), n_way=2, k_shot=1, n_query=2)
    with pytest.raises(ValueError, match=r"not laid out as an 2-way 1-shot episode"):
        split_episode(torch.zeros(4), torch.tensor([0, 1, 1, 1]), n_way=2, k_shot=1, n_query=1)
    with pytest.raises(ValueError, match=r"state has n_way=2 but this sampler has n_way=3"):
        EpisodicBatchSampler(labels, 3, 1, 1, 2, seed=0).load_state_dict(
            EpisodicBatchSampler(labels, 2, 1, 1, 2, seed=0).state_dict()
        )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_works_with_dataloader_batch_sampler(num_workers):
    labels = torch.tensor([i % 6 for i in range(60)])
    ds = TensorDataset(torch.arange(60), labels)
    s = EpisodicBatchSampler(labels, 4, 2, 3, 6, seed=3)
    loader = DataLoader(ds, batch_sampler=s, num_workers=num_workers)
    batches = list(loader)
    assert [b[0].tolist() for b in batches] == list(s)
    for x, y in batches:
        sx, sy, qx, qy = s.split(x, y)
        assert sx.shape == (8,) and qx.shape == (12,)
        assert sy.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and qy.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        assert torch.equal(y[:8], y[:8:2].repeat_interleave(2))
