"""ClassBalancedSampler: balance, rank split, resume, epochs, errors, DataLoader use."""

from __future__ import annotations

import io
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchfn.data._samplers import ClassBalancedSampler

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
# per-example false-alarm rate of the statistical bounds below (union-bounded over classes)
ALPHA = 1e-6


@st.composite
def label_lists(draw, max_classes=5, max_per_class=12):
    """Shuffled integer labels with 1..max_classes classes of 1..max_per_class samples each."""
    counts = draw(st.lists(st.integers(1, max_per_class), min_size=1, max_size=max_classes))
    labels = [c for c, n in enumerate(counts) for _ in range(n)]
    perm = draw(st.permutations(range(len(labels))))
    return [labels[i] for i in perm]


def _roundtrip(state):
    """state -> torch.save -> torch.load(weights_only=True): states must be plain data."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@SETTINGS
@given(
    labels=label_lists(),
    mode=st.sampled_from(["oversample", "undersample"]),
    replacement=st.booleans(),
    extra=st.one_of(st.none(), st.integers(1, 40)),
    seed=st.integers(0, 2**32),
)
def test_balanced_modes_give_exact_class_quotas(labels, mode, replacement, extra, seed):
    counts = Counter(labels)
    c = len(counts)
    s = ClassBalancedSampler(labels, mode, extra, seed=seed, replacement=replacement)
    idx = s.global_indices().tolist()
    if extra is None:
        per = max(counts.values()) if mode == "oversample" else min(counts.values())
        assert len(idx) == c * per
        assert Counter(labels[i] for i in idx) == {k: per for k in counts}
    else:
        assert len(idx) == extra
        got = Counter(labels[i] for i in idx)
        quotas = sorted(got.get(k, 0) for k in counts)
        assert quotas[0] == extra // c and quotas[-1] - quotas[0] <= 1
    if not replacement:  # cycling: a class's samples are used floor(q/n) or ceil(q/n) times
        used = Counter(idx)
        got = Counter(labels[i] for i in idx)
        for i, y in enumerate(labels):
            q, n = got.get(y, 0), counts[y]
            assert q // n <= used.get(i, 0) <= -(-q // n)


@SETTINGS
@given(labels=label_lists(max_classes=6, max_per_class=30), seed=st.integers(0, 2**32))
def test_weights_mode_class_frequencies_within_hoeffding_bound(labels, seed):
    # each draw's class is uniform over C classes; Hoeffding + union bound over classes:
    # P(any |freq_c - 1/C| > t) <= 2 C exp(-2 N t^2) = ALPHA
    n = 600
    s = ClassBalancedSampler(labels, "weights", n, seed=seed)
    idx = s.global_indices()
    c = len(set(labels))
    t = math.sqrt(math.log(2 * c / ALPHA) / (2 * n))
    freq = Counter(labels[i] for i in idx.tolist())
    for k in set(labels):
        assert abs(freq.get(k, 0) / n - 1 / c) <= t, (k, freq, t)


def test_weights_mode_is_biased_towards_uniform_classes_not_samples():
    # 90/10 split: plain uniform sampling would give ~10% minority; balanced gives ~50%
    labels = [0] * 90 + [1] * 10
    idx = ClassBalancedSampler(labels, "weights", 2000, seed=3).global_indices()
    frac = sum(labels[i] for i in idx.tolist()) / 2000
    t = math.sqrt(math.log(2 / ALPHA) / (2 * 2000))
    assert abs(frac - 0.5) <= t


def test_weights_mode_without_replacement_draws_distinct_indices():
    labels = [0] * 30 + [1] * 5
    idx = ClassBalancedSampler(labels, "weights", 20, seed=0, replacement=False)
    got = idx.global_indices().tolist()
    assert len(set(got)) == 20


@SETTINGS
@given(
    labels=label_lists(),
    mode=st.sampled_from(["oversample", "undersample", "weights"]),
    world_size=st.integers(1, 5),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_ranks_match_distributed_sampler_split(labels, mode, world_size, drop_last, seed):
    ref = ClassBalancedSampler(labels, mode, seed=seed)
    glob = ref.global_indices().tolist()
    if drop_last and len(glob) < world_size:
        with pytest.raises(ValueError, match="every rank would get 0"):
            ClassBalancedSampler(labels, mode, seed=seed, world_size=world_size, drop_last=True)
    else:
        return_positions = []
        lengths = set()
        for r in range(world_size):
            s = ClassBalancedSampler(
                labels, mode, seed=seed, world_size=world_size, rank=r, drop_last=drop_last
            )
            # reference: torch's DistributedSampler over positions of the global list
            pos = list(
                DistributedSampler(
                    range(len(glob)), world_size, r, shuffle=False, drop_last=drop_last
                )
            )
            assert list(s) == [glob[p] for p in pos]
            lengths.add(len(s))
            return_positions.append(pos)
            assert s.num_padded == (0 if drop_last else len(pos) * world_size - len(glob))
        assert len(lengths) == 1
        flat = [p for pos in return_positions for p in pos]
        if drop_last or len(glob) % world_size == 0:  # no padding: positions are disjoint
            assert len(flat) == len(set(flat))
        covered = set(flat)
        assert covered == set(range(len(covered)))


def test_ranks_disjoint_positions_cover_epoch_exactly_once():
    labels = [0] * 7 + [1] * 3 + [2] * 2
    glob = ClassBalancedSampler(labels, seed=5).global_indices()
    parts = [list(ClassBalancedSampler(labels, seed=5, world_size=3, rank=r)) for r in range(3)]
    assert [len(p) for p in parts] == [7, 7, 7]
    assert Counter(i for p in parts for i in p) == Counter(glob.tolist())


@SETTINGS
@given(
    labels=label_lists(),
    mode=st.sampled_from(["oversample", "undersample", "weights"]),
    world_size=st.integers(1, 3),
    cuts=st.lists(st.integers(0, 40), min_size=1, max_size=2),
    epoch=st.integers(0, 3),
    seed=st.integers(0, 2**32),
)
def test_resume_equals_no_resume(labels, mode, world_size, cuts, epoch, seed):
    kw = dict(mode=mode, seed=seed, world_size=world_size, rank=world_size - 1)
    full = ClassBalancedSampler(labels, **kw)
    full.set_epoch(epoch)
    expected = list(full)
    got: list[int] = []
    s = ClassBalancedSampler(labels, **kw)
    s.set_epoch(epoch)
    for cut in cuts:  # run a while, save, rebuild from the state (a chain of resumes)
        it = iter(s)
        got += [next(it) for _ in range(min(cut, len(s) - len(got)))]
        state = _roundtrip(s.state_dict())
        s = ClassBalancedSampler(labels, **kw)
        s.load_state_dict(state)
        s.set_epoch(epoch)  # the usual loop calls set_epoch again: must keep the position
    got += list(s)
    assert got == expected


def test_state_dict_consumed_override_for_prefetching_loaders():
    s = ClassBalancedSampler([0, 1, 1, 1], seed=0)
    expected = list(s)
    it = iter(s)
    [next(it) for _ in range(5)]  # a loader prefetched 5, the loop consumed 2
    r = ClassBalancedSampler([0, 1, 1, 1], seed=0)
    r.load_state_dict(s.state_dict(consumed=2))
    assert list(r) == expected[2:]


def test_set_epoch_changes_order_deterministically():
    labels = [i % 4 for i in range(40)]
    a, b = (ClassBalancedSampler(labels, seed=11) for _ in range(2))
    orders = []
    for e in range(3):
        a.set_epoch(e)
        b.set_epoch(e)
        la, lb = list(a), list(b)
        assert la == lb
        orders.append(la)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    # iterating again within one epoch replays that epoch
    assert list(a) == orders[2]
    # a torch.Generator seed is resolved once, deterministically
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    assert list(ClassBalancedSampler(labels, seed=g1)) == list(ClassBalancedSampler(labels, seed=g2))


def test_does_not_touch_global_rng():
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    list(ClassBalancedSampler([0, 1, 1], "weights", 10, seed=1))
    assert torch.equal(before, torch.random.get_rng_state())


def test_string_and_tensor_labels():
    s = ClassBalancedSampler(["cat", "dog", "dog", "dog"], seed=0)
    assert s.classes == ["cat", "dog"]
    assert list(s) == list(ClassBalancedSampler(torch.tensor([0, 1, 1, 1]), seed=0))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"mode='balanced'"):
        ClassBalancedSampler([0, 1], "balanced", seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank=2, world_size=2"):
        ClassBalancedSampler([0, 1], seed=0, world_size=2, rank=2)
    with pytest.raises(ValueError, match=r"num_samples=0"):
        ClassBalancedSampler([0, 1], num_samples=0, seed=0)
    with pytest.raises(ValueError, match=r"replacement=False, num_samples=5.*len\(labels\)=2"):
        ClassBalancedSampler([0, 1], "weights", 5, seed=0, replacement=False)
    with pytest.raises(ValueError, match=r"1-D integer tensor, got dtype=torch.float32"):
        ClassBalancedSampler(torch.tensor([0.0, 1.0]), seed=0)
    with pytest.raises(TypeError, match=r"seed=...\): expected an int or a torch.Generator"):
        ClassBalancedSampler([0, 1], seed=1.5)  # type: ignore[arg-type]
    s = ClassBalancedSampler([0, 1], seed=0)
    with pytest.raises(ValueError, match=r"state has seed=1 but this sampler has seed=0"):
        s.load_state_dict(ClassBalancedSampler([0, 1], seed=1).state_dict())


def test_works_with_dataloader_sampler():
    labels = torch.tensor([0] * 45 + [1] * 5)
    ds = TensorDataset(torch.arange(50.0), labels)
    s = ClassBalancedSampler(labels, "oversample", seed=2)
    loader = DataLoader(ds, batch_size=10, sampler=s)
    xs, ys = zip(*loader, strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    assert x.long().tolist() == list(s)  # TensorDataset: x[i] == i
    assert torch.bincount(y).tolist() == [45, 45]


# torchdata 0.11's StatefulDataLoader calls torch.set_vital, which torch 2.13 deprecates
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stateful_dataloader_resume_with_workers():
    sdl = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata not installed")
    labels = torch.tensor([0] * 20 + [1] * 4 + [2] * 6)
    ds = TensorDataset(torch.arange(30))

    def loader():
        s = ClassBalancedSampler(labels, "oversample", seed=9)
        s.set_epoch(1)
        return sdl.StatefulDataLoader(ds, batch_size=4, sampler=s, num_workers=2)

    expected = [b[0].tolist() for b in loader()]
    first = loader()
    it = iter(first)
    got = [next(it)[0].tolist() for _ in range(6)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    got += [b[0].tolist() for b in resumed]
    assert got == expected
