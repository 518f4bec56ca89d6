"""Meta-training checkpointed mid-run and resumed in a fresh state == one uninterrupted run.

The run: MAML (second order, BatchNorm with running stats, float64) with an outer Adam, fed by
torchfn.data's EpisodicBatchSampler through a stream that moves to the next epoch when one is
used up; meta-batches straddle epoch boundaries. The resumed run rebuilds everything (model,
learner, step, sampler) from scratch and restores only what ``save_checkpoint`` wrote: params,
buffers, optimizer state, step, and the sampler's ``state_dict`` as ``extra``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchfn.data import EpisodicBatchSampler
from torchfn.functional import TrainState, load_checkpoint, make_functional, save_checkpoint
from torchfn.meta import (
    batchnorm_names,
    imaml,
    init_meta_state,
    make_meta_train_step,
    maml,
    maml_plus_plus,
    protonet,
    stack_episodes,
)
from torchfn.optim import adam

DT = torch.float64
N_WAY, K_SHOT, N_QUERY, META_BATCH = 3, 1, 2, 3
EPISODES_PER_EPOCH = 4  # not a multiple of META_BATCH: batches cross epochs


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(8).repeat_interleave(5)
    x = torch.randn(y.numel(), 4, generator=g, dtype=DT) + y[:, None].to(DT) * 0.3
    return x, y


def _fresh(kind: str = "maml"):
    """Build model, learner, optimizer, step and sampler from scratch (as a new process would)."""
    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, N_WAY))
    model_fn, params, buffers = make_functional(net.to(DT))
    if kind == "maml":
        learner = maml(model_fn, F.cross_entropy, inner_lr=0.2, inner_steps=2)
    elif kind == "maml++":  # the step counter (loss annealing, order switch) lives in buffers
        learner = maml_plus_plus(model_fn, F.cross_entropy, inner_lr=0.2, inner_steps=2,
                                 msl_anneal_steps=4, first_order_until=3,
                                 per_step_bn=batchnorm_names(net))
    elif kind == "imaml":
        learner = imaml(model_fn, F.cross_entropy, lam=1.0, inner_lr=0.2, inner_steps=3,
                        cg_steps=3)
    else:
        assert kind == "protonet"
        learner = protonet(model_fn, n_way=N_WAY)
    opt = adam(1e-2)
    _, y = _data()
    sampler = EpisodicBatchSampler(y, N_WAY, K_SHOT, N_QUERY,
                                   episodes_per_epoch=EPISODES_PER_EPOCH, seed=3)
    state = init_meta_state(learner, params, buffers, opt)
    return learner, opt, make_meta_train_step(learner, opt), sampler, state


def _stream(sampler: EpisodicBatchSampler) -> Iterator[list[int]]:
    while True:  # a resumed sampler first finishes its epoch
        yield from sampler
        sampler.set_epoch(sampler.epoch + 1)


def _train(step, state: TrainState, sampler, stream, until: int) -> TrainState:
    x, y = _data()
    while int(state.step) < until:
        batch = [next(stream) for _ in range(META_BATCH)]
        tasks = stack_episodes(x, y, batch, n_way=N_WAY, k_shot=K_SHOT, n_query=N_QUERY)
        state, _ = step(state, tasks)
    return state


def _leaves(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize(("kind", "stop_at"), [("maml", 2), ("maml", 4), ("maml++", 2),
                                             ("imaml", 4), ("protonet", 2)])
def test_resumed_meta_training_is_bitwise_identical(tmp_path, kind, stop_at):
    """stop_at 2: mid-epoch (MAML++: in the first-order phase, with its loss weights still
    annealing); 4: right after an epoch boundary."""
    total = 6
    _, _, step, sampler, state = _fresh(kind)
    want = _train(step, state, sampler, _stream(sampler), total)

    _, _, step, sampler, state = _fresh(kind)
    state = _train(step, state, sampler, _stream(sampler), stop_at)
    path = tmp_path / "meta.ckpt"
    save_checkpoint(path, state, extra={"sampler": sampler.state_dict()})
    at_checkpoint = {k: v.clone() for k, v in state.params.items()}
    del step, sampler, state

    _, opt, step, sampler, _ = _fresh(kind)
    state, extra = load_checkpoint(path, optimizer=opt)
    assert extra is not None
    sampler.load_state_dict(extra["sampler"])
    assert int(state.step) == stop_at
    got = _train(step, state, sampler, _stream(sampler), total)

    assert int(got.step) == int(want.step) == total
    assert sampler.epoch == (total * META_BATCH - 1) // EPISODES_PER_EPOCH
    for k in want.params:
        assert torch.equal(got.params[k], want.params[k]), k
    # every meta-param trained after the resume, except MAML++'s inner rate of the bias before
    # BatchNorm: that bias's inner gradient is zero (BatchNorm removes the mean), so its rate's
    # meta-gradient is too
    still = {k for k in want.params if torch.equal(got.params[k], at_checkpoint[k])}
    assert still <= {"lslr:0.bias"}, f"{sorted(still)} did not train after resume"
    for k in want.buffers:
        assert torch.equal(got.buffers[k], want.buffers[k]), k
    for a, b in zip(_leaves(got.opt_state), _leaves(want.opt_state), strict=True):
        assert torch.equal(a, b)
