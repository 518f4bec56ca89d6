"""Gradient noise scale and per-example gradient norms while training on sklearn's digits.

A small CNN is trained with plain minibatch SGD on the 8x8 digits that ship with
scikit-learn (no download). The training step itself is written with ghost per-sample
gradients: one forward and one backward give the batch gradient (``weighted_sum`` with
``1/B``) AND every example's gradient norm, so per-example norms are tracked over training
for free (``update_norm_history``). Every few steps ``grad_stats`` on a larger batch gives
unbiased estimates of ``tr(Sigma)`` and ``|G|^2`` (McCandlish et al. 2018), averaged with
EMAs into the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` -- the batch size beyond
which bigger batches stop paying off; it typically grows as the loss falls. The estimate is
checked once against the same quantities computed from explicitly materialised per-sample
gradients. Prints a table; saves a plot (loss/accuracy, B_simple, per-example norm
distribution, the examples with the largest gradient norms).
Run: ``python examples/gradient_noise_scale.py [--out DIR]`` (the plot goes to
``DIR/gradient_noise_scale.png``; ``DIR`` defaults to a folder under the system's temporary
directory).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torchopt.update import apply_updates

from torchfn.optim import sgd
from torchfn.persample import (
    grad_stats,
    init_noise_scale,
    init_norm_history,
    make_ghost_model,
    update_noise_scale,
    update_norm_history,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "torchfn_out",
                                                  "gradient_noise_scale"),
                    help="output directory (the plot goes there)")
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--stats-batch", type=int, default=512)
parser.add_argument("--stats-every", type=int, default=10, help="steps between estimates")
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)
print(f"output directory: {args.out}")

images, labels = load_digits(return_X_y=True)
X = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
Y = torch.tensor(labels)
perm = torch.randperm(len(Y), generator=torch.Generator().manual_seed(0))
n_train = int(0.8 * len(Y))
X_train, Y_train, X_test, Y_test = (X[perm[:n_train]], Y[perm[:n_train]],
                                    X[perm[n_train:]], Y[perm[n_train:]])
mean, std = X_train.mean(), X_train.std()
X_train, X_test = (X_train - mean) / std, (X_test - mean) / std
N = len(Y_train)

torch.manual_seed(0)
net = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Tanh(),
    nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(),
    nn.Linear(16 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10),
)
ghost, params, buffers = make_ghost_model(net)


def per_sample_xent(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


opt = sgd(0.05, momentum=0.9)  # torchfn.optim.sgd: its whole state is in the state
opt_state = opt.init(params)
stats_fn = grad_stats(ghost, per_sample_xent)
noise, history = init_noise_scale(), init_norm_history(N)
gen = torch.Generator().manual_seed(1)

# --- one check: ghost statistics == statistics of materialised per-sample gradients -------
idx = torch.randperm(N, generator=gen)[:64]
s = stats_fn(params, buffers, X_train[idx], Y_train[idx])
psg = ghost.per_sample(params, buffers, X_train[idx], Y_train[idx],
                       per_sample_xent).grads.materialize()
flat = torch.cat([g.flatten(1) for g in psg.values()], 1)
explicit_trace = torch.trace(torch.cov(flat.T))
print(f"check on 64 examples: tr(Sigma) ghost {float(s.trace_cov):.6f} vs explicit "
      f"{float(explicit_trace):.6f}")

rows, trace_b, trace_step, losses = [], [], [], []
steps_per_epoch, step = N // args.batch, 0
for epoch in range(args.epochs):
    order = torch.randperm(N, generator=gen)
    for b in range(steps_per_epoch):
        idx = order[b * args.batch : (b + 1) * args.batch]
        res = ghost.per_sample(params, buffers, X_train[idx], Y_train[idx], per_sample_xent)
        grads = res.grads.weighted_sum(torch.full((len(idx),), 1.0 / len(idx)))
        history = update_norm_history(history, idx, res.grads.sq_norms().sqrt())
        updates, opt_state = opt.update(grads, opt_state, params=params, inplace=False)
        params = apply_updates(params, updates, inplace=False)
        losses.append(float(res.losses.mean()))
        step += 1
        if step % args.stats_every == 0:
            sidx = torch.randperm(N, generator=gen)[: args.stats_batch]
            est = stats_fn(params, buffers, X_train[sidx], Y_train[sidx])
            noise = update_noise_scale(noise, est, decay=0.9)
            trace_b.append(float(noise.b_simple))
            trace_step.append(step)
    with torch.no_grad():
        acc = float((ghost(params, buffers, X_test)[0].argmax(1) == Y_test).float().mean())
    seen = history.count > 0
    rows.append((epoch + 1, sum(losses[-steps_per_epoch:]) / steps_per_epoch, acc,
                 float(noise.trace_cov), float(noise.grad_sq_norm), float(noise.b_simple),
                 float(history.last[seen].mean())))

print(f"\n{'epoch':>5}{'train loss':>12}{'test acc':>10}{'tr(Sigma)':>12}{'|G|^2':>11}"
      f"{'B_simple':>10}{'mean |g_i|':>12}")
for r in rows:
    print(f"{r[0]:>5}{r[1]:>12.4f}{r[2]:>10.3f}{r[3]:>12.4f}{r[4]:>11.5f}{r[5]:>10.1f}"
          f"{r[6]:>12.4f}")
print(f"(training batch {args.batch}; B_simple is the batch size where gradient noise and "
      "signal are equal: training at B << B_simple is noise-dominated)")

mean_norm = history.total / history.count.clamp_min(1)
hardest = torch.argsort(mean_norm, descending=True)[:8]
print("\nexamples with the largest mean gradient norm over training (index: label, norm):")
print("  " + ", ".join(f"{int(i)}: {int(Y_train[i])}, {float(mean_norm[i]):.2f}"
                       for i in hardest))

fig, axes = plt.subplots(2, 2, figsize=(11, 8))
ax = axes[0, 0]
ax.plot(losses, lw=0.6, label="train loss (per step)")
ax.plot([r[0] * steps_per_epoch for r in rows], [r[2] for r in rows], "o-",
        label="test accuracy (per epoch)")
ax.set(xlabel="step", title="training")
ax.legend()
ax = axes[0, 1]
ax.plot(trace_step, trace_b)
ax.axhline(args.batch, color="k", linestyle=":", label=f"training batch {args.batch}")
ax.set(xlabel="step", ylabel="B_simple = tr(Sigma) / |G|^2", yscale="log",
       title="gradient noise scale (EMA of unbiased estimates)")
ax.legend()
ax = axes[1, 0]
ax.hist(mean_norm[history.count > 0].numpy(), bins=50)
ax.set(xlabel="mean per-example gradient norm over training", ylabel="examples",
       yscale="log", title="per-example gradient norms")
ax = axes[1, 1]
ax.axis("off")
ax.set_title("largest mean gradient norm (label, norm)")
for k, i in enumerate(hardest):
    sub = ax.inset_axes([(k % 4) * 0.25, 0.5 - (k // 4) * 0.5, 0.23, 0.42])
    sub.imshow(X_train[i, 0].numpy(), cmap="gray_r")
    sub.set_title(f"{int(Y_train[i])}, {float(mean_norm[i]):.2f}", fontsize=9)
    sub.axis("off")
fig.tight_layout()
plot_path = os.path.join(args.out, "gradient_noise_scale.png")
fig.savefig(plot_path, dpi=120)
print(f"\nplot saved to {plot_path}")
