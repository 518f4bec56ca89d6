"""The one call convention of torchfn's steps: a dict of inputs goes to the model as keywords."""

import pytest
import torch
import torchopt

from torchfn.distributed import shard_tasks
from torchfn.ensembles import Ensemble, ensemble_apply
from torchfn.functional import init_train_state, make_train_step, split_batch
from torchfn.meta import Task

D = torch.float64


def _mse(out, y):
    return ((out - y) ** 2).mean()


def test_train_step_dict_inputs_as_keywords_equal_a_tensor_batch():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 2, generator=g, dtype=D)
    x = torch.randn(6, 3, generator=g, dtype=D)
    y = torch.randn(6, 2, generator=g, dtype=D)
    opt = torchopt.sgd(0.1)
    state = init_train_state({"w": w}, {}, opt, seed=0)
    by_kw, _ = make_train_step(lambda p, b, *, a: (a @ p["w"], b), _mse, opt,
                               grad_accum_steps=2)(state, ({"a": x}, y))
    by_pos, _ = make_train_step(lambda p, b, a: (a @ p["w"], b), _mse, opt)(state, (x, y))
    torch.testing.assert_close(by_kw.params["w"], by_pos.params["w"], rtol=1e-13, atol=0)
    assert not torch.equal(by_kw.params["w"], w)


def test_a_model_fn_that_takes_the_dict_positionally_is_told_the_convention():
    opt = torchopt.sgd(0.1)
    state = init_train_state({"w": torch.ones(3, 2, dtype=D)}, {}, opt, seed=0)
    step = make_train_step(lambda p, b, inputs: (inputs["a"] @ p["w"], b), _mse, opt)
    with pytest.raises(TypeError, match=r"train step: the inputs are a dict with keys \['a'\], "
                       r"which torchfn passes to the model as keywords.*def model_fn\(params, "
                       r"buffers, \*\*inputs\)"):
        step(state, ({"a": torch.ones(4, 3, dtype=D)}, torch.ones(4, 2, dtype=D)))


def test_split_batch_names_the_dict_key_that_disagrees():
    batch = ({"input_ids": torch.zeros(6, 2), "mask": torch.zeros(5, 2)}, torch.zeros(6))
    with pytest.raises(ValueError, match=r"got sizes \[5, 6\] \(6 for batch\[0\]\['input_ids'\]"
                       r", 5 for batch\[0\]\['mask'\]\)"):
        split_batch(batch, 2, "train step")
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by grad_accum_steps=4 "
                       r"\(split along dim 0, size read from batch\[0\]\['input_ids'\]\)"):
        split_batch(({"input_ids": torch.zeros(6, 2)}, torch.zeros(6)), 4, "train step")


def test_ensemble_apply_passes_one_dict_argument_as_keywords():
    ens = Ensemble.from_seeds(lambda: torch.nn.Linear(3, 2).double(), seeds=[0, 1])
    x = torch.randn(4, 3, dtype=D)
    by_kw, _ = ensemble_apply(lambda p, b, *, input: ens.model_fn(p, b, input), ens.params,
                              ens.buffers, {"input": x})
    by_pos, _ = ensemble_apply(ens.model_fn, ens.params, ens.buffers, x)
    torch.testing.assert_close(by_kw, by_pos, rtol=0, atol=0)


def test_shard_tasks_shards_dict_fields_leaf_by_leaf():
    ids = torch.arange(4 * 3 * 2).reshape(4, 3, 2)
    tasks = Task({"input_ids": ids, "mask": ids + 1}, ids[..., 0], {"input_ids": ids},
                 ids[..., 0])
    part = shard_tasks(tasks, rank=1, world_size=2)
    assert torch.equal(part.support_x["mask"], ids[2:] + 1)
    assert torch.equal(part.query_x["input_ids"], ids[2:])
    assert torch.equal(part.support_y, ids[2:, :, 0])
    with pytest.raises(ValueError, match="the meta-batch has 4 tasks, not divisible"):
        shard_tasks(tasks, rank=0, world_size=3)
