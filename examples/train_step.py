"""Train a tiny MLP (BatchNorm + dropout) with a compiled, pure train step; print the loss curve.

``make_train_step`` gives ``step(state, batch) -> (state, metrics)``: gradient accumulation,
global-norm clipping and a torchopt optimizer (torchfn's compile-safe AdamW with a linear
schedule), all in one ``torch.compile(fullgraph=True)`` graph that compiles once.
``step_rng(state)`` seeds dropout from ``(seed, step)`` around the compiled call.
Run: ``python examples/train_step.py [--steps 200] [--eager]``
"""

import argparse
import time

import torch
import torchopt
from torch import nn

from torchfn.compile import compile_step
from torchfn.functional import init_train_state, make_functional, make_train_step, step_rng
from torchfn.optim import adamw

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--eager", action="store_true", help="do not torch.compile the step")
args = parser.parse_args()

torch.manual_seed(0)
true_w = torch.randn(8, 1)


def make_batch(t: int, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data; batch ``t`` is a pure function of ``t``."""
    g = torch.Generator().manual_seed(t)
    x = torch.randn(batch_size, 8, generator=g)
    y = torch.sin(x @ true_w / 2) + 0.05 * torch.randn(batch_size, 1, generator=g)
    return x, y


net = nn.Sequential(
    nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)
)
model_fn, params, buffers = make_functional(net)


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).mean()


lr = torchopt.schedule.linear_schedule(1e-2, 1e-3, transition_steps=args.steps)
optimizer = adamw(lr=lr, weight_decay=1e-2)
step = make_train_step(
    model_fn, mse, optimizer, grad_accum_steps=2, max_grad_norm=1.0, lr_schedule=lr
)
if not args.eager:
    # logs 'compiling the step (first call; ...)...' and how long it took
    step = compile_step(step, name="the step", log=lambda m: print(m, flush=True))

state = init_train_state(params, buffers, optimizer, seed=0)
start = time.perf_counter()
for t in range(args.steps):
    with step_rng(state):  # the eager step seeds itself; a compiled one needs this
        state, metrics = step(state, make_batch(t))
    if t == 0:
        first = time.perf_counter() - start  # includes compilation
        start = time.perf_counter()
    if t % 20 == 0 or t == args.steps - 1:
        # reading metrics syncs with the device: do it only when printing
        print(
            f"step {t:4d}  loss {float(metrics['loss']):.4f}  "
            f"grad_norm {float(metrics['grad_norm']):.3f}  lr {float(metrics['lr']):.2e}"
        )
per_step = (time.perf_counter() - start) / max(args.steps - 1, 1)
print(
    f"{'eager' if args.eager else 'compiled'}: first step {first:.1f}s, then "
    f"{1e3 * per_step:.2f} ms/step; BatchNorm saw "
    f"{int(state.buffers['1.num_batches_tracked'])} micro-batches"
)
