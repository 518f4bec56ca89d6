"""DP fine-tuning of a tiny Hugging Face ViT with LoRA on scikit-learn's digits: accuracy vs epsilon.

The story of DP fine-tuning, at a size that runs on a CPU in a few minutes (no downloads):

1. "pretrain" a tiny ``ViTForImageClassification`` (8x8 images, patch 2, 2 layers, hidden
   48) non-privately on the *public* part of the training set: the images of digits 0-4
   from 40% of it (a 5-class head);
2. on the *private* part (the other 60%, all ten digits), fine-tune with DP-SGD only LoRA
   adapters (peft ``LoraConfig(r=4)`` on the attention's query and value projections) and a
   fresh 10-class head; the rest of the ViT is frozen. torchfn's ghost norms clip each
   example's gradient of the trained parameters; Poisson sampling (``PoissonSampler``), an
   RDP accountant, and for each target epsilon (delta = 1e-5) the smallest noise multiplier
   that stays within it (``noise_multiplier_for_epsilon``);
3. compare with the same fine-tuning without privacy, and with DP-SGD from a random
   (un-pretrained) ViT at the largest epsilon.

Test accuracy is on a held-out 20% (all ten digits). Prints what it does and a table, and
writes the table as JSON to ``DIR/dp_lora_digits.json``.
Run: ``python examples/dp_lora_digits.py [--out DIR] [--epsilons 1,3,8] [--smoke]``
(``--smoke``: one short epoch per setting, a check that everything runs; ``--data synthetic``
uses generated 8x8 class patterns instead of scikit-learn's digits, for machines without
scikit-learn). Needs transformers and peft; the digits need the ``examples`` extra.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import tempfile
import time

import torch
import torch.nn.functional as F
import torchopt
from _progress import progress  # tqdm if installed
from torch import Tensor, nn

from torchfn.functional import init_train_state, make_functional, make_train_step
from torchfn.persample import (
    PoissonSampler,
    RDPAccountant,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
    noise_multiplier_for_epsilon,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "torchfn_out",
                                                  "dp_lora_digits"),
                    help="output directory (the results JSON goes there)")
parser.add_argument("--epsilons", default="1,3,8")
parser.add_argument("--epochs", type=int, default=20, help="fine-tuning epochs")
parser.add_argument("--pretrain-epochs", type=int, default=40)
parser.add_argument("--data", choices=("digits", "synthetic"), default="digits")
parser.add_argument("--smoke", action="store_true", help="1 epoch each: check that it runs")
args = parser.parse_args()
if args.smoke:
    args.epochs, args.pretrain_epochs = 1, 1
os.makedirs(args.out, exist_ok=True)
print(f"output directory: {args.out}")
torch.set_num_threads(min(torch.get_num_threads(), 2))

DELTA, BATCH, CLIP, RANK = 1e-5, 64, 1.0, 4
DP_LR, LR, PRE_LR = 2e-2, 5e-3, 3e-3  # Adam everywhere (DP: on the noisy mean gradient)


# --- data: 1797 digits, 8x8; test 20%, then public (digits 0-4 of 40%) / private (60%) ----
def load_data() -> tuple[Tensor, Tensor]:
    if args.data == "digits":
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        return torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0, \
            torch.tensor(labels)
    # generated stand-in: a smooth random pattern per class, shifted by up to one pixel, noised
    g = torch.Generator().manual_seed(123)
    protos = F.avg_pool2d(torch.rand(10, 1, 10, 10, generator=g), 3, 1)  # (10, 1, 8, 8)
    y = torch.arange(1797) % 10
    shift = torch.randint(-1, 2, (1797, 2), generator=g)
    x = torch.stack([protos[c].roll((int(s[0]), int(s[1])), (1, 2)) for c, s in zip(y, shift, strict=True)])
    return (x + 0.15 * torch.randn(x.shape, generator=g)).clamp(0, 1), y


X, Y = load_data()
perm = torch.randperm(len(Y), generator=torch.Generator().manual_seed(0))
n_test, n_pub = int(0.2 * len(Y)), int(0.32 * len(Y))
test, pub, priv = perm[:n_test], perm[n_test:n_test + n_pub], perm[n_test + n_pub:]
pub = pub[Y[pub] < 5]
mean, std = X[pub].mean(), X[pub].std()  # normalised with public statistics only
X = (X - mean) / std
X_test, Y_test = X[test], Y[test]
X_pub, Y_pub, X_priv, Y_priv = X[pub], Y[pub], X[priv], Y[priv]
N = len(Y_priv)
q = BATCH / N
steps_per_epoch = max(1, round(1 / q))
total_steps = args.epochs * steps_per_epoch
physical = BATCH + math.ceil(4 * math.sqrt(BATCH))


class Classifier(nn.Module):
    """``pixels (B, 1, 8, 8) -> logits``: the HF model's ``.logits`` (the step's output)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(pixel_values=x).logits


def make_vit(num_labels: int, seed: int) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=48,
                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                    num_labels=num_labels, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg)


def with_lora(vit: nn.Module, seed: int) -> Classifier:
    """A fresh 10-class head and LoRA adapters on the attention's query/value projections;
    everything else frozen (``requires_grad=False``: no per-sample gradient, no noise)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    vit.classifier = nn.Linear(vit.config.hidden_size, 10)
    vit.config.num_labels = 10
    names = {n.rsplit(".", 1)[-1] for n, _ in vit.named_modules()}
    targets = [t for t in ("query", "value", "q_proj", "v_proj") if t in names]  # by version
    model = get_peft_model(vit, LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                                           target_modules=targets))
    for p in model.base_model.model.classifier.parameters():
        p.requires_grad_(True)
    return Classifier(model).train()


def per_sample_xent(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def mean_xent(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y)


def accuracy(model_fn, params, buffers, x: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        logits, _ = model_fn(params, buffers, x)
    return float((logits.argmax(1) == y).float().mean())


def train_plain(model: nn.Module, x: Tensor, y: Tensor, epochs: int, lr: float,
                seed: int) -> tuple[nn.Module, float]:
    """Non-private minibatch Adam on (x, y); returns the trained module and the time taken."""
    t0 = time.time()
    model_fn, params, buffers = make_functional(model)
    opt = torchopt.adam(lr)
    step = make_train_step(model_fn, mean_xent, opt)
    state = init_train_state(params, buffers, opt, seed=seed, trainable=model_fn.trainable)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for b in range(0, len(y), BATCH):
            idx = order[b:b + BATCH]
            state, _ = step(state, (x[idx], y[idx]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state.params:
                p.copy_(state.params[name])
    return model, time.time() - t0


def train_dp(model: nn.Module, sigma: float, seed: int) -> tuple[float, float, float]:
    """DP-SGD (Adam on the noisy mean) of the trainable params on the private data; returns
    (test accuracy, epsilon spent, seconds)."""
    t0 = time.time()
    ghost, params, buffers = make_ghost_model(model)
    opt = torchopt.adam(DP_LR)
    step = make_dp_train_step(ghost, per_sample_xent, opt, noise_multiplier=sigma,
                              max_grad_norm=CLIP, sample_rate=q, dataset_size=N)
    sampler = PoissonSampler(N, q, physical, seed=1000 + seed)
    state = init_dp_state(params, buffers, opt, seed=seed, trainable=ghost.trainable)
    acct = RDPAccountant()
    for t in progress(range(total_steps), desc="DP fine-tuning"):
        state, _ = step.run(state, sampler.sample(t), lambda i: (X_priv[i], Y_priv[i]), acct)
    acc = accuracy(ghost, state.params, buffers, X_test, Y_test)
    eps = acct.get_epsilon(DELTA) if sigma > 0 else math.inf
    return acc, eps, time.time() - t0


print(f"data: {args.data}; {len(Y_pub)} public images (digits 0-4), {N} private (all digits), "
      f"{len(Y_test)} test")
print(f"1) pretraining a tiny ViT (patch 2, 2 layers, hidden 48) on the public digits 0-4, "
      f"{args.pretrain_epochs} epochs ...", flush=True)
pretrained, secs = train_plain(Classifier(make_vit(5, seed=0)), X_pub, Y_pub,
                               args.pretrain_epochs, PRE_LR, seed=0)
model_fn, p0, b0 = make_functional(pretrained)
low = Y_test < 5
print(f"   done in {secs:.0f} s: test accuracy on digits 0-4 "
      f"{accuracy(model_fn, p0, b0, X_test[low], Y_test[low]):.3f}")
pre_vit = pretrained.model

n_train = sum(p.numel() for p in with_lora(copy.deepcopy(pre_vit), 1)
              .parameters() if p.requires_grad)
print(f"2) fine-tuning LoRA (r={RANK}, query/value) + a new 10-class head: {n_train} trained "
      f"parameters; expected batch {BATCH} (q = {q:.4f}, physical {physical}), "
      f"{args.epochs} epochs = {total_steps} steps, C = {CLIP}, delta = {DELTA}", flush=True)
rows = []
targets = [float(e) for e in args.epsilons.split(",")]
for target in targets:
    sigma = noise_multiplier_for_epsilon(target, DELTA, sample_rate=q, steps=total_steps)
    print(f"   DP-SGD at epsilon {target:g}: noise multiplier {sigma:.3f} ...", flush=True)
    acc, eps, secs = train_dp(with_lora(copy.deepcopy(pre_vit), 1), sigma, 0)
    rows.append({"setting": f"DP LoRA, eps={target:g}", "sigma": sigma, "epsilon": eps,
                 "test_accuracy": acc, "seconds": secs})
print("   non-private LoRA fine-tuning (same epochs, Adam) ...", flush=True)
tuned, secs = train_plain(with_lora(copy.deepcopy(pre_vit), 1), X_priv, Y_priv,
                          args.epochs, LR, seed=0)
fn, p, b = make_functional(tuned)
rows.append({"setting": "non-private LoRA", "sigma": 0.0, "epsilon": math.inf,
             "test_accuracy": accuracy(fn, p, b, X_test, Y_test), "seconds": secs})
top = max(targets)
sigma = noise_multiplier_for_epsilon(top, DELTA, sample_rate=q, steps=total_steps)
print(f"3) DP-SGD at epsilon {top:g} from a random (not pretrained) ViT, same LoRA + head ...",
      flush=True)
acc, eps, secs = train_dp(with_lora(make_vit(5, seed=0), 1), sigma, 0)
rows.append({"setting": f"DP LoRA, eps={top:g}, no pretraining", "sigma": sigma,
             "epsilon": eps, "test_accuracy": acc, "seconds": secs})

print(f"\n{'setting':<36}{'sigma':>8}{'eps spent':>11}{'test acc':>10}{'time s':>8}")
for r in rows:
    eps_s = "inf" if math.isinf(r["epsilon"]) else f"{r['epsilon']:.3f}"
    print(f"{r['setting']:<36}{r['sigma']:>8.3f}{eps_s:>11}{r['test_accuracy']:>10.3f}"
          f"{r['seconds']:>8.1f}")
path = os.path.join(args.out, "dp_lora_digits.json")
with open(path, "w") as f:
    json.dump({"data": args.data, "epochs": args.epochs, "delta": DELTA, "batch": BATCH,
               "clip": CLIP, "lora_rank": RANK, "trained_params": n_train,
               "rows": [{**r, "epsilon": None if math.isinf(r["epsilon"]) else r["epsilon"]}
                        for r in rows]}, f, indent=2)
print(f"\nresults saved to {path}")
