"""benchmarks/meta.py: ``--config`` overrides (issue 18's second config) reach the model and tasks,
bad entries fail with the argument named, and the eager variant runs on the overridden config."""

from __future__ import annotations

import argparse

import pytest
from bench_load import load_bench


def _load():
    return load_bench("meta")


def _args(**kw):
    base = dict(dtype="float64", precision="highest", small=True, inner_steps=None, config=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_config_overrides_reach_the_model_and_tasks():
    mod = _load()
    _, _, cfg, module, tasks, *_ = mod.setup(_args(config="channels=4,k_shot=3,n_way=3,steps=1"))
    assert (cfg["channels"], cfg["k_shot"], cfg["n_way"], cfg["steps"]) == (4, 3, 3, 1)
    assert cfg["n_tasks"] == 4  # --small's, not overridden
    assert module[0].out_channels == 4 and module[-1].out_features == 3
    assert tuple(tasks.support_x.shape[:2]) == (4, 3 * 3)
    _, _, cfg, *_ = mod.setup(_args(inner_steps=4, config="steps=2"))
    assert cfg["steps"] == 2  # --config applies after --inner-steps


@pytest.mark.parametrize("bad", ["ways=5", "channels", "channels=0", "channels=x", "n_way=-1"])
def test_bad_config_entries_name_the_argument(bad):
    mod = _load()
    with pytest.raises(SystemExit, match="--config"):
        mod.parse_config(bad, {"channels": 1, "n_way": 1})
