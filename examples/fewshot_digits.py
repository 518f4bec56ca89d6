"""Few-shot classification on scikit-learn's digits: meta-train on digits 0-4, test 5-way on 5-9.

MAML (second order, BatchNorm with per-task batch statistics) on 8x8 digit images, episodes
from torchfn.data's EpisodicBatchSampler. Reports 5-way K-shot accuracy on the held-out
digits with a 95% CI over test episodes, before meta-training and after. ``--ckpt PATH``
saves the meta-training state and the sampler's position every 50 steps and resumes from
PATH if it exists. Needs scikit-learn. Run: ``python examples/fewshot_digits.py --k-shot 1``.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch import nn
from torch.func import vmap

from torchfn.data import EpisodicBatchSampler
from torchfn.functional import adam, load_checkpoint, make_functional, save_checkpoint
from torchfn.meta._maml import maml
from torchfn.meta._step import init_meta_state, make_meta_train_step
from torchfn.meta._tasks import stack_episodes
from torchfn.ops import softmax_cross_entropy


def accuracy(learner, params, buffers, tasks) -> tuple[float, float]:
    """Mean query accuracy over episodes and its 95% CI half-width."""
    def one(task):
        fast, bufs = learner.adapt(params, buffers, task.support_x, task.support_y)
        logits, _ = learner.model_fn(fast, bufs, task.query_x)
        return (logits.argmax(-1) == task.query_y).double().mean()

    acc = vmap(one)(tasks)
    return float(acc.mean()), 1.96 * float(acc.std()) / math.sqrt(acc.numel())


def main() -> None:
    from sklearn.datasets import load_digits

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--k-shot", type=int, default=1)
    ap.add_argument("--meta-batch", type=int, default=16)
    ap.add_argument("--test-episodes", type=int, default=600)
    ap.add_argument("--ckpt", default=None)
    args = ap.parse_args()
    n_way, n_query = 5, 10
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train, test = y < 5, y >= 5
    x_tr, y_tr, x_te, y_te = x[train], y[train], x[test], y[test]

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
                        nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, n_way))
    model_fn, params, buffers = make_functional(net)
    learner = maml(model_fn, softmax_cross_entropy, inner_lr=0.1, inner_steps=5)
    opt = adam(1e-3)
    step = make_meta_train_step(learner, opt)

    sampler = EpisodicBatchSampler(y_tr, n_way, args.k_shot, n_query,
                                   episodes_per_epoch=50 * args.meta_batch, seed=0)
    state = init_meta_state(learner, params, buffers, opt)
    if args.ckpt and os.path.exists(args.ckpt):
        state, extra = load_checkpoint(args.ckpt)
        sampler.load_state_dict(extra["sampler"])
        print(f"resumed from {args.ckpt} at step {int(state.step)}")

    test_sampler = EpisodicBatchSampler(y_te, n_way, args.k_shot, n_query,
                                        episodes_per_epoch=args.test_episodes, seed=1)
    test_tasks = stack_episodes(x_te, y_te, test_sampler, n_way=n_way, k_shot=args.k_shot,
                                n_query=n_query)
    acc0 = accuracy(learner, state.params, state.buffers, test_tasks)
    def episode_stream():  # epochs of 50 meta-batches; a resumed sampler finishes its epoch
        while True:
            yield from sampler
            sampler.set_epoch(sampler.epoch + 1)

    episodes = episode_stream()
    while int(state.step) < args.steps:
        batch = [next(episodes) for _ in range(args.meta_batch)]
        tasks = stack_episodes(x_tr, y_tr, batch, n_way=n_way, k_shot=args.k_shot,
                               n_query=n_query)
        state, metrics = step(state, tasks)
        if int(state.step) % 50 == 0:
            print(f"step {int(state.step):4d}  meta-loss {float(metrics['loss']):.3f}")
            if args.ckpt:
                save_checkpoint(args.ckpt, state, extra={"sampler": sampler.state_dict()})
    acc = accuracy(learner, state.params, state.buffers, test_tasks)
    print(f"5-way {args.k_shot}-shot accuracy on held-out digits 5-9, "
          f"{args.test_episodes} episodes (95% CI):")
    print(f"  before meta-training: {acc0[0]:.3f} +- {acc0[1]:.3f}")
    print(f"  after  meta-training: {acc[0]:.3f} +- {acc[1]:.3f}")


if __name__ == "__main__":
    main()
