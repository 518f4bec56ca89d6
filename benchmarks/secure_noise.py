"""The cost of ``secure_noise=True``: ChaCha20 normals vs the counter-based ones, and a DP step.

Two tables:

1. standard normals per second, ``n`` float64 draws in one call: the default counter-based
   generator (``_dp_random.normal``: a keyed integer hash, Box-Muller, 1.5 words per
   normal) vs the secure one (``_dp_secure.secure_normal``: ChaCha20, four Box-Muller
   normals with 53-bit uniforms summed per output, 8 words per normal), eager and
   ``torch.compile(fullgraph=True)``;
2. one DP-SGD step (``make_dp_train_step``, SGD) of a small MLP (784-512-512-10, 670k
   parameters, batch 64), eager and compiled, with and without ``secure_noise``.

Each entry is the median of ``--repeats`` timed calls after a warm-up; "first" is the first
call alone (compilation included).

Run: ``python benchmarks/secure_noise.py [--device cuda] [--sizes 1e6,1e7,1e8] [--no-compile]
[--repeats 5] [--out result.json]``
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import torchopt
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import time_calls, write_json

from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model
from torchfn.persample._dp_random import key_from_seed, normal
from torchfn.persample._dp_secure import secure_key, secure_normal

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", default="cpu")
parser.add_argument("--sizes", default="1e6,1e7", help="comma-separated numbers of normals")
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--no-compile", action="store_true", help="eager only")
parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
args = parser.parse_args()
device = torch.device(args.device)
modes = ["eager"] if args.no_compile else ["eager", "compiled"]


def draws() -> list[dict]:
    rows = []
    ckey, skey = key_from_seed(0, device), secure_key(device)
    for n in [int(float(s)) for s in args.sizes.split(",")]:
        step = torch.tensor(0, device=device)

        def counter(n: int = n) -> torch.Tensor:
            return normal(ckey, (n,), torch.float64)

        def secure(n: int = n, step: torch.Tensor = step) -> torch.Tensor:
            return secure_normal(skey, n, step)

        for name, fn in (("counter", counter), ("secure", secure)):
            for mode in modes:
                torch._dynamo.reset()
                call = torch.compile(fn, fullgraph=True) if mode == "compiled" else fn
                t = time_calls(call, device, warmup=2, repeats=args.repeats)
                rows.append({"n": n, "generator": name, "mode": mode, "median_s": t.median_s,
                             "first_s": t.first_call_s, "draws_per_s": n / t.median_s})
                print(f"  {name:8s} {mode:8s} n={n:.0e}: {t.median_s * 1e3:10.1f} ms "
                      f"({n / t.median_s:.3g}/s), first {t.first_call_s:.1f} s", flush=True)
    return rows


def dp_steps() -> list[dict]:
    rows = []
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                        nn.Linear(512, 10)).to(device)
    n_params = sum(p.numel() for p in net.parameters())
    x = torch.randn(64, 784, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    valid = torch.ones(64, dtype=torch.bool, device=device)
    for secure in (False, True):
        for mode in modes:
            torch._dynamo.reset()
            ghost, params, buffers = make_ghost_model(net)
            opt = torchopt.sgd(0.1)
            step = make_dp_train_step(
                ghost, lambda o, t: F.cross_entropy(o, t, reduction="none"), opt,
                noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.01, dataset_size=6400,
                secure_noise=secure)
            if mode == "compiled":
                step = step.compile()
            state = (init_dp_state(params, buffers, opt, secure_noise=True) if secure
                     else init_dp_state(params, buffers, opt, seed=0))
            t = time_calls(lambda step=step, state=state: step(state, (x, y), valid), device,
                           warmup=2, repeats=args.repeats)
            noise = "secure" if secure else "counter"
            rows.append({"params": n_params, "noise": noise, "mode": mode,
                         "median_s": t.median_s, "first_s": t.first_call_s})
            print(f"  DP step, {noise:8s} {mode:8s}: {t.median_s * 1e3:8.1f} ms, first "
                  f"{t.first_call_s:.1f} s", flush=True)
    return rows


print(f"torch {torch.__version__}, {device}, {platform.processor() or platform.machine()}, "
      f"{torch.get_num_threads()} threads")
print("normal draws (float64):")
draw_rows = draws()
print("DP-SGD step, MLP 784-512-512-10, batch 64:")
step_rows = dp_steps()

print("\n| n | mode | counter-based (draws/s) | secure ChaCha20 (draws/s) | secure / counter time |")
print("|---|---|---|---|---|")
for n in sorted({r["n"] for r in draw_rows}):
    for mode in modes:
        c, s = (next(r for r in draw_rows if r["n"] == n and r["mode"] == mode
                     and r["generator"] == g) for g in ("counter", "secure"))
        print(f"| {n:.0e} | {mode} | {c['draws_per_s']:.3g} | {s['draws_per_s']:.3g} | "
              f"{s['median_s'] / c['median_s']:.1f}x |")
print(f"\n| DP step ({step_rows[0]['params']:,} params) | counter-based noise | secure noise | "
      "secure / counter | first call, secure (s) |")
print("|---|---|---|---|---|")
for mode in modes:
    c, s = (next(r for r in step_rows if r["mode"] == mode and r["noise"] == g)
            for g in ("counter", "secure"))
    print(f"| {mode} | {c['median_s'] * 1e3:.1f} ms | {s['median_s'] * 1e3:.1f} ms | "
          f"{s['median_s'] / c['median_s']:.2f}x | {s['first_s']:.1f} |")
write_json(args.out, {"torch": torch.__version__, "device": str(device), "draws": draw_rows,
                      "dp_step": step_rows})
