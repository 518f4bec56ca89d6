"""DP-SGD on scikit-learn's handwritten digits: test accuracy at several epsilons vs non-private.

A small CNN (Conv2d/GroupNorm/Linear: every layer has a ghost-norm rule) is trained on the
8x8 digits that ship with scikit-learn (no download), with torchfn's DP-SGD step: Poisson
sampling into fixed-size physical batches (``PoissonSampler``), per-sample clipping by ghost
norms, seeded Gaussian noise, an RDP accountant. For each target epsilon (delta = 1e-5) the
noise multiplier is the smallest one whose accountant epsilon after all steps stays within
the target; "inf" clips but adds no noise; "non-private" is plain minibatch SGD (momentum
0.9) with the same batch size and epochs. Every DP setting uses the same hyperparameters
(expected batch 128, C = 1, SGD lr 0.5, 15 epochs; chosen by a small sweep at epsilon 1-8,
so the privacy of that tuning itself is not accounted). Prints a table and saves a plot
(accuracy vs epsilon, and test accuracy per epoch).
Run: ``python examples/dpsgd_digits.py [--out DIR] [--epochs 15] [--seeds 2] [--compile]``
(the plot goes to ``DIR/dpsgd_digits.png``; ``DIR`` defaults to a folder under the system's
temporary directory).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import torchopt
from _progress import progress  # tqdm if installed
from sklearn.datasets import load_digits
from torch import nn

from torchfn.compile import compile_step
from torchfn.functional import init_train_state, make_train_step
from torchfn.optim import sgd
from torchfn.persample import (
    PoissonSampler,
    RDPAccountant,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
    noise_multiplier_for_epsilon,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "torchfn_out", "dpsgd_digits"),
                    help="output directory (the plot goes there)")
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--seeds", type=int, default=2, help="runs per setting (mean is reported)")
parser.add_argument("--epsilons", default="1,3,8,inf")
parser.add_argument("--compile", action="store_true", help="torch.compile the steps")
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)
print(f"output directory: {args.out}")

DELTA, BATCH, CLIP = 1e-5, 128, 1.0
DP_LR, LR = 0.5, 0.05  # DP: SGD without momentum; non-private: SGD with momentum 0.9

# --- data: 1797 digits, 8x8, split 80/20 with a fixed permutation -------------------------
images, labels = load_digits(return_X_y=True)
X = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
Y = torch.tensor(labels)
perm = torch.randperm(len(Y), generator=torch.Generator().manual_seed(0))
n_train = int(0.8 * len(Y))
X_train, Y_train = X[perm[:n_train]], Y[perm[:n_train]]
X_test, Y_test = X[perm[n_train:]], Y[perm[n_train:]]
mean, std = X_train.mean(), X_train.std()
X_train, X_test = (X_train - mean) / std, (X_test - mean) / std
N = len(Y_train)
q = BATCH / N
steps_per_epoch = round(1 / q)
total_steps = args.epochs * steps_per_epoch
physical = BATCH + math.ceil(4 * math.sqrt(BATCH))  # extra physical batches are rare


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Tanh(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10),
    )


def per_sample_xent(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def accuracy(ghost, params, buffers) -> float:
    with torch.no_grad():
        logits, _ = ghost(params, buffers, X_test)
    return float((logits.argmax(1) == Y_test).float().mean())


def train_dp(sigma: float, seed: int) -> tuple[list[float], float]:
    ghost, params, buffers = make_ghost_model(make_net(seed))
    opt = torchopt.sgd(DP_LR)
    step = make_dp_train_step(ghost, per_sample_xent, opt, noise_multiplier=sigma,
                              max_grad_norm=CLIP, sample_rate=q, dataset_size=N, delta=DELTA,
                              epsilon_every=steps_per_epoch)
    if args.compile:
        step = step.compile()
        print(f"compiling the DP step (sigma={sigma:.3g}; first call, up to a minute)...",
              flush=True)
    sampler = PoissonSampler(N, q, physical, seed=1000 + seed)
    state, acct = init_dp_state(params, buffers, opt, seed=seed), RDPAccountant()
    curve, eps = [], math.nan
    for t in progress(range(total_steps), desc=f"DP-SGD sigma {sigma:.3g}"):
        start = time.perf_counter()
        state, metrics = step.run(state, sampler.sample(t), lambda i: (X_train[i], Y_train[i]),
                                  acct)
        eps = metrics.get("epsilon", eps)  # the accountant's epsilon, reported once per epoch
        if args.compile and t == 0:
            print(f"compiled the DP step in {time.perf_counter() - start:.1f} s", flush=True)
        if (t + 1) % steps_per_epoch == 0:
            curve.append(accuracy(ghost, state.params, buffers))
    return curve, eps  # sigma = 0: the accountant reports inf


def train_plain(seed: int) -> list[float]:
    ghost, params, buffers = make_ghost_model(make_net(seed))
    opt = sgd(LR, momentum=0.9)  # torchfn.optim.sgd: its whole state is in the state

    def mean_xent(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    step = make_train_step(ghost, mean_xent, opt)
    if args.compile:
        step = compile_step(step, name="the non-private step", log=lambda m: print(m, flush=True))
    state = init_train_state(params, buffers, opt, seed=seed)
    gen = torch.Generator().manual_seed(2000 + seed)
    curve = []
    for _ in progress(range(args.epochs), desc="non-private epochs"):
        order = torch.randperm(N, generator=gen)
        for b in range(steps_per_epoch):
            idx = order[b * BATCH : (b + 1) * BATCH]
            state, _ = step(state, (X_train[idx], Y_train[idx]))
        curve.append(accuracy(ghost, state.params, buffers))
    return curve


print(f"digits: {N} train / {len(Y_test)} test, q = {q:.4f} (expected batch {BATCH}, "
      f"physical {physical}), {args.epochs} epochs = {total_steps} steps, delta = {DELTA}, "
      f"C = {CLIP}, {args.seeds} seed(s)")
rows, curves = [], {}
for target in [float(e) for e in args.epsilons.split(",")]:
    sigma = 0.0 if math.isinf(target) else noise_multiplier_for_epsilon(
        target, DELTA, sample_rate=q, steps=total_steps)
    t0 = time.time()
    runs = [train_dp(sigma, seed) for seed in range(args.seeds)]
    accs = [r[0][-1] for r in runs]
    label = "eps=inf (clip only)" if math.isinf(target) else f"eps={target:g}"
    curves[label] = [sum(c) / len(c) for c in zip(*[r[0] for r in runs], strict=True)]
    rows.append((label, target, sigma, runs[0][1], sum(accs) / len(accs), min(accs),
                 max(accs), time.time() - t0))
t0 = time.time()
plain = [train_plain(seed) for seed in range(args.seeds)]
accs = [c[-1] for c in plain]
curves["non-private"] = [sum(c) / len(c) for c in zip(*plain, strict=True)]
rows.append(("non-private", math.inf, 0.0, math.inf, sum(accs) / len(accs), min(accs),
             max(accs), time.time() - t0))

print(f"\n{'setting':<22}{'sigma':>8}{'eps spent':>11}{'test acc':>10}{'min':>8}{'max':>8}"
      f"{'time s':>9}")
for label, _, sigma, eps, acc, lo, hi, secs in rows:
    eps_s = "inf" if math.isinf(eps) else f"{eps:.3f}"
    print(f"{label:<22}{sigma:>8.3f}{eps_s:>11}{acc:>10.3f}{lo:>8.3f}{hi:>8.3f}{secs:>9.1f}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
finite = [r for r in rows if r[1] != math.inf]
ax1.plot([r[3] for r in finite], [r[4] for r in finite], "o-", label="DP-SGD")
for label, acc in [(r[0], r[4]) for r in rows if r[1] == math.inf]:
    style = "k:" if label == "non-private" else "g--"
    ax1.axhline(acc, color=style[0], linestyle=style[1:], label=f"{label}: {acc:.3f}")
ax1.set(xlabel="epsilon spent (delta = 1e-5)", ylabel="test accuracy",
        title="DP-SGD on digits: accuracy vs privacy")
if finite:
    ax1.set_xscale("log")
    ax1.set_xticks([r[3] for r in finite], [f"{r[3]:.3g}" for r in finite])
    ax1.minorticks_off()
ax1.legend()
for label, curve in curves.items():
    ax2.plot(range(1, len(curve) + 1), curve, label=label)
ax2.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy per epoch")
ax2.legend()
fig.tight_layout()
plot_path = os.path.join(args.out, "dpsgd_digits.png")
fig.savefig(plot_path, dpi=120)
print(f"\nplot saved to {plot_path}")
