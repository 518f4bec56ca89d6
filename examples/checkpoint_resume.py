"""Interrupt a training run, resume it from an atomic checkpoint, and get the same bits.

Trains a dropout MLP with Adam for 2*k steps straight, then again for k steps, saves a
checkpoint (TrainState + the data position as ``extra``), "crashes", loads it into a fresh
state and trains the other k steps. Dropout comes from ``(seed, step)``, so both runs end with
bitwise-identical parameters and optimizer state. Run: ``python examples/checkpoint_resume.py``
"""

import os
import tempfile

import optree
import torch
from torch import nn

from torchfn.functional import (
    init_train_state,
    load_checkpoint,
    make_functional,
    make_train_step,
    save_checkpoint,
)
from torchfn.optim import adam

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
model_fn, params, buffers = make_functional(net)
optimizer = adam(lr=1e-2)
step = make_train_step(
    model_fn, lambda out, y: ((out - y) ** 2).mean(), optimizer, max_grad_norm=1.0
)


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def train(state, start: int, stop: int):
    for t in range(start, stop):
        state, metrics = step(state, batch(t))
    print(f"  steps {start}..{stop - 1}: last loss {float(metrics['loss']):.4f}")
    return state


k = 10
print("uninterrupted run:")
straight = train(init_train_state(params, buffers, optimizer, seed=42), 0, 2 * k)

print("interrupted run:")
state = train(init_train_state(params, buffers, optimizer, seed=42), 0, k)
path = os.path.join(tempfile.mkdtemp(), "run.ckpt")
save_checkpoint(path, state, extra={"data": {"next_batch": k}})
del state  # "crash"
torch.manual_seed(1234)  # the new process's global RNG is different; it does not matter
state, extra = load_checkpoint(path)
print(f"  resumed from {path} at step {int(state.step)}")
resumed = train(state, extra["data"]["next_batch"], 2 * k)

same = all(
    torch.equal(a, b)
    for a, b in zip(optree.tree_leaves(resumed), optree.tree_leaves(straight), strict=True)
)
print(f"bitwise identical (params, buffers, optimizer state, step): {same}")
assert same
