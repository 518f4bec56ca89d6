"""Host overhead of torchfn's eager Adam: the per-leaf loop vs the multi-tensor fast path.

Side by side in one process, on the same tensors, with the fast path switched off
(``torchfn._checks._USE_FOREACH = False``: the per-leaf loop of small ops that differentiable
and compiled updates use) and on (``torch._foreach_*`` ops per (device, dtype) group):

1. ``update``: ``torchfn.optim.adam(...).update`` alone (and ``adamw`` with weight decay) on
   ``--leaves`` leaves of ``--numel`` elements.
2. ``train-step``: an eager ``make_train_step`` step (Adam) of an MLP of ``--layers`` small
   ``Linear(--width, --width)`` layers (2 leaves each), batch 32.

Wall time per call, median of synchronized repeats (host included). Each row first checks that
both paths give the same numbers (max abs difference of params and optimizer state over
``--check-steps`` steps; 0 expected on CPU).

    OMP_NUM_THREADS=1 python benchmarks/optim_overhead.py
    python benchmarks/optim_overhead.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import torch
import torchopt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench import time_calls

import torchfn._checks as _checks
from torchfn.functional import init_train_state, make_train_step
from torchfn.optim import adam, adamw


def _set_fast(on: bool) -> None:
    _checks._USE_FOREACH = on


def _max_diff(a: Any, b: Any) -> float:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    return max(
        ((x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
        for x, y in zip(la, lb, strict=True)
    )


def _update_case(make: Callable[[], Any], params: dict[str, torch.Tensor], steps: int
                 ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Return ``(one_update, run_steps)``: one ``update`` from a fixed state, and
    ``steps`` updates from init (for the equality check)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    grads = [{k: torch.randn(v.shape, generator=gen, dtype=v.dtype).to(v.device)
              for k, v in params.items()} for _ in range(steps)]
    opt = make()
    state = opt.init(params)

    def one() -> Any:
        return opt.update(grads[0], state, params=params, inplace=False)

    def run() -> Any:
        p, s = params, opt.init(params)
        for g in grads:
            u, s = opt.update(g, s, params=p, inplace=False)
            p = torchopt.apply_updates(p, u, inplace=False)
        return p, s

    return one, run


def _train_step_case(layers: int, width: int, device: str, steps: int
                     ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(layers)
                                for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
    net = net.to(device)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def model_fn(p: Any, b: Any, x: torch.Tensor) -> Any:
        return torch.func.functional_call(net, p, (x,)), b

    opt = adam(1e-3)
    step = make_train_step(model_fn, lambda o, y: ((o - y) ** 2).mean(), opt)
    x = torch.randn(32, width, device=device)
    y = torch.randn(32, width, device=device)
    state0 = init_train_state(params, {}, opt, seed=0)

    def one() -> Any:
        return step(state0, (x, y))

    def run() -> Any:
        s = state0
        for _ in range(steps):
            s, _ = step(s, (x, y))
        return s.params, s.opt_state

    return one, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--leaves", type=int, default=200)
    ap.add_argument("--numel", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--check-steps", type=int, default=3)
    args = ap.parse_args()
    dev = args.device
    print(f"torch {torch.__version__}, device {dev}, threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(1)
    params = {f"p{i:03d}": torch.randn(args.numel, generator=gen).to(dev)
              for i in range(args.leaves)}
    tree = f"{args.leaves} leaves x {args.numel}"
    cases: list[tuple[str, tuple[Callable[[], Any], Callable[[], Any]]]] = [
        (f"adam().update, {tree}",
         _update_case(lambda: adam(1e-3), params, args.check_steps)),
        (f"adamw(weight_decay=0.01).update, {tree}",
         _update_case(lambda: adamw(1e-3, weight_decay=0.01), params, args.check_steps)),
        (f"adam(tensor lr, weight_decay=0.01, maximize=True).update, {tree}",
         _update_case(lambda: adam(torch.tensor(1e-3, device=dev), weight_decay=0.01,
                                   maximize=True), params, args.check_steps)),
        (f"eager make_train_step, MLP {args.layers} x Linear({args.width}, {args.width}), "
         f"batch 32, adam",
         _train_step_case(args.layers, args.width, dev, args.check_steps)),
    ]
    print("| case | per-leaf (ms) | foreach (ms) | speed-up | max abs diff |")
    print("|---|---|---|---|---|")
    for name, (one, run) in cases:
        _set_fast(False)
        ref = run()
        _set_fast(True)
        diff = _max_diff(ref, run())
        ms = {}
        for fast in (False, True):
            _set_fast(fast)
            ms[fast] = time_calls(one, dev, warmup=3, repeats=args.repeats).median_ms
        _set_fast(True)
        print(f"| {name} | {ms[False]:.3f} | {ms[True]:.3f} | {ms[False] / ms[True]:.2f}x "
              f"| {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
