"""Checkpoints written by earlier code (format 1, tests/fixtures/checkpoints_v1) still load.

The fixtures were written by ``tests/fixtures/make_checkpoints_v1.py`` before the package
layout changed; their optimizer states name NamedTuple classes by the module paths of that
day. ``expected.pt`` holds the same leaves as a flat dict, saved with plain ``torch.save``.
"""

from __future__ import annotations

import os

import optree
import pytest
import torch
import torchopt

from torchfn.ensembles import load_ensemble
from torchfn.functional import load_checkpoint
from torchfn.optim import adam, per_member_adam, stacked_adam

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "checkpoints_v1")
EXPECTED = torch.load(os.path.join(HERE, "expected.pt"), weights_only=True)

OPTIMIZERS = {
    "train_adam": lambda: adam(1e-2, weight_decay=1e-3),
    "train_torchopt_sgd": lambda: torchopt.sgd(0.1, momentum=0.9),
    "ensemble_stacked_adam": lambda: stacked_adam(lr=torch.tensor([1e-3, 1e-2, 1e-1])),
    "ensemble_per_member_adam": lambda: per_member_adam(
        torch.tensor([1e-3, 1e-2, 1e-1]), betas=(torch.tensor([0.8, 0.9, 0.95]), 0.999)),
    "meta_sgd_adam": lambda: adam(1e-2),
}


def _load(name: str, with_optimizer: bool):
    path = os.path.join(HERE, name + ".pt")
    opt = OPTIMIZERS[name]() if with_optimizer else None
    if name.startswith("ensemble"):
        return load_ensemble(path, optimizer=opt, n_members=3)
    return load_checkpoint(path, optimizer=opt)


def _assert_matches(name: str, state) -> None:
    paths, leaves, _ = optree.tree_flatten_with_path(state, none_is_leaf=False)
    seen = {name + "/" + "/".join(str(p) for p in path): leaf
            for path, leaf in zip(paths, leaves, strict=True)}
    want = {k: v for k, v in EXPECTED.items() if k.startswith(name + "/")}
    # format-1 files predate TrainState.skipped (field 6, the count of skipped non-finite
    # steps): it loads as a zero count
    skipped = seen.pop(name + "/6")
    assert skipped.dtype == torch.int64 and skipped.ndim == 0 and int(skipped) == 0
    assert sorted(seen) == sorted(want)
    for k, v in want.items():
        assert seen[k].dtype == v.dtype, k
        torch.testing.assert_close(seen[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("with_optimizer", [False, True], ids=["by-type-name", "by-template"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_v1_checkpoint_loads_with_optimizer_state(name: str, with_optimizer: bool) -> None:
    state, extra = _load(name, with_optimizer)
    _assert_matches(name, state)
    if name == "train_adam":
        assert extra == {"epoch": 2}
    if name == "ensemble_stacked_adam":
        assert extra == {"note": "v1"}
    # the loaded optimizer state drives the optimizer of today: one update runs and moves params
    opt = OPTIMIZERS[name]()
    grads = optree.tree_map(torch.ones_like, state.params)
    updates, new_opt_state = opt.update(grads, state.opt_state, params=state.params,
                                        inplace=False)
    assert optree.tree_structure(new_opt_state) == optree.tree_structure(state.opt_state)
    for u in optree.tree_leaves(updates):
        assert torch.isfinite(u).all() and u.abs().sum() > 0


def test_v1_fixture_is_intact() -> None:
    # guards the fixture itself: these are the classes the files name (module paths of the day)
    assert EXPECTED["ensemble_stacked_adam#types"] == [
        "torchfn.ops._stacked_optimizers:StackedAdamState"]
    assert "torchopt.transform.scale_by_adam:ScaleByAdamState" in EXPECTED["train_adam#types"]
