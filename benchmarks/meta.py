"""MAML second-order outer step: per-task loop vs torchfn eager vs torchfn compiled (vs JAX).

The standard few-shot setting: 4-block conv net (64 channels, BatchNorm, ReLU, max-pool), 28x28
single-channel inputs, 5-way 1-shot with 15 queries per class, 32 tasks, 5 inner SGD steps,
second order. Times the full meta-gradient (forward + double backward) per outer step, median
of ``--repeats``, and peak CUDA memory; JAX is run if importable (same model, same precision).
``--small`` shrinks everything for a CPU smoke test. ``--out results.json`` writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from torchfn.functional import make_functional
from torchfn.meta._maml import maml
from torchfn.meta._tasks import Task


def conv_net(channels: int, n_way: int, size: int) -> nn.Module:
    layers, c_in = [], 1
    for _ in range(4):
        layers += [nn.Conv2d(c_in, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                   nn.MaxPool2d(2)]
        c_in = channels
    side = size // 16
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * side * side, n_way))


def make_tasks(n_tasks, n_way, k_shot, n_query, size, device, dtype) -> Task:
    g = torch.Generator().manual_seed(0)
    def rnd(n):
        return torch.randn(n_tasks, n, 1, size, size, generator=g).to(device, dtype)
    def lab(k):
        return torch.arange(n_way).repeat_interleave(k).expand(n_tasks, -1).to(device)
    return Task(rnd(n_way * k_shot), lab(k_shot), rnd(n_way * n_query), lab(n_query))


def loop_meta_grad(module, tasks, inner_lr, steps):
    """The learn2learn/higher pattern: one task at a time, autograd.grad(create_graph=True)."""
    params = dict(module.named_parameters())
    total = 0
    n = tasks.support_x.shape[0]
    for t in range(n):
        fast = dict(params)
        for _ in range(steps):
            loss = F.cross_entropy(functional_call(module, fast, (tasks.support_x[t],)),
                                   tasks.support_y[t])
            g = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
            fast = {k: v - inner_lr * gk for (k, v), gk in zip(fast.items(), g, strict=True)}
        total = total + F.cross_entropy(functional_call(module, fast, (tasks.query_x[t],)),
                                        tasks.query_y[t])
    return torch.autograd.grad(total / n, list(params.values()))


def timeit(fn, repeats, device) -> dict:
    fn()  # warm-up (and compile)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"median_s": statistics.median(times), "times_s": times, "peak_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true", help="tiny sizes for a CPU smoke test")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="", help="comma list of: loop,eager,compiled,jax")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    cfg = dict(channels=64, n_tasks=32, n_way=5, k_shot=1, n_query=15, size=28, steps=5)
    if args.small:
        cfg.update(channels=8, n_tasks=4, n_query=3, size=16, steps=2)
    inner_lr = 0.01
    torch.manual_seed(0)
    module = conv_net(cfg["channels"], cfg["n_way"], cfg["size"]).to(device, dtype)
    tasks = make_tasks(cfg["n_tasks"], cfg["n_way"], cfg["k_shot"], cfg["n_query"],
                       cfg["size"], device, dtype)
    model_fn, params, buffers = make_functional(module)
    learner = maml(model_fn, F.cross_entropy, inner_lr=inner_lr, inner_steps=cfg["steps"])
    skip = set(args.skip.split(",")) - {""}
    results = {"config": cfg, "device": str(device), "dtype": args.dtype,
               "torch": torch.__version__, "runs": {}}
    ref = copy.deepcopy(module)
    runs = {
        "loop": lambda: loop_meta_grad(ref, tasks, inner_lr, cfg["steps"]),
        "torchfn_eager": lambda: learner.meta_grad(params, buffers, tasks),
    }
    compiled = torch.compile(learner.meta_grad, fullgraph=True)
    runs["torchfn_compiled"] = lambda: compiled(params, buffers, tasks)
    for name, fn in runs.items():
        if name.removeprefix("torchfn_") in skip:
            continue
        results["runs"][name] = timeit(fn, args.repeats, device)
        print(f"{name:18s} {results['runs'][name]['median_s'] * 1e3:9.1f} ms  "
              f"peak {results['runs'][name]['peak_bytes']}")
    try:
        import jax  # noqa: F401
    except ImportError:
        results["runs"]["jax"] = {"skipped": "jax is not importable"}
        print("jax: not importable, skipped")
    else:  # pragma: no cover - needs jax
        results["runs"]["jax"] = {"skipped": "JAX twin not written yet"}
        print("jax: importable, but the JAX twin is not written yet")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
