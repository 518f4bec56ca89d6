"""Benchmark op 4 (fused Adam/SGD over stacked parameters) against its twin, eager and compiled.

Two parts:

1. ``leaf``: one big stacked leaf ``(N, numel/N)``: the raw kernel, the twin eager and the twin
   under ``torch.compile`` (Inductor), forward (one optimizer step of the leaf) and
   forward+backward (a meta-gradient through the step w.r.t. grad, param and lr). Forward
   bandwidth counts the minimal bytes (Adam with decoupled decay: read grad, mu, nu, param;
   write update, mu, nu; SGD with momentum and decay: read grad, buffer, param; write update,
   buffer) and is reported as a % of a device-to-device copy measured in the same run.
2. ``ensemble``: a whole optimizer step of 32 MLPs 784-256-256-10 stacked (6 leaves):
   ``torchfn.optim.stacked_adam(...).update`` eager (one multi-leaf kernel launch) and compiled
   (the twin through Inductor), the twin eager, the raw kernels alone (per leaf, and the
   multi-leaf op), ``stacked_sgd`` with momentum, and
   ``torch.optim.Adam(foreach/fused)`` over the 6 stacked tensors (a single lr: a speed
   reference only). Wall time per step, host included (CUDA synchronised around a loop).

    python benchmarks/ops_stacked_optim.py                 # CUDA if present
    python benchmarks/ops_stacked_optim.py --small --device cpu
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench import event_median_ms, time_calls
from ops import copy_bandwidth  # benchmarks/ops.py

from torchfn import ops
from torchfn.ops import _dispatch, reference
from torchfn.ops import _stacked_optim as so


def _wall(device: torch.device, fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Milliseconds per call of ``fn`` over a loop of ``iters`` calls, host time included."""
    return time_calls(fn, device, warmup=warmup, repeats=1, inner=iters).median_ms


def leaf_rows(args: argparse.Namespace, device: torch.device, copy_gbs: float) -> list[dict]:
    numel, n = args.numel, args.members
    rows = []
    for dtype_name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        work = torch.float32
        gen = torch.Generator().manual_seed(0)
        shape = (n, numel // n)

        def rnd(dt: torch.dtype, scale: float = 1.0, shape=shape, gen=gen) -> torch.Tensor:
            return (scale * torch.randn(shape, generator=gen)).to(device, dt)

        g, p = rnd(dtype), rnd(dtype)
        mu, nu = rnd(work, 0.1), rnd(work, 0.01).abs()
        lr = torch.rand(n, generator=gen).to(device, work) * 1e-3
        wd = torch.rand(n, generator=gen).to(device, work) * 1e-2
        count = torch.tensor(3, device=device)
        eb, mb = g.element_size(), mu.element_size()
        adam_args = (g, mu, nu, p, count, lr, wd, 0.9, 0.999, 1e-8, 0.0, True, False)
        sgd_args = (g, mu, p, count, lr, wd, 0.9, 0.0, False, False)
        cases = {
            "adam": (adam_args, torch.ops.torchfn.stacked_adam_update,
                     reference.stacked_adam_update, 3 * eb + 4 * mb, so._StackedAdamFn.apply),
            "sgd": (sgd_args, torch.ops.torchfn.stacked_sgd_update,
                    reference.stacked_sgd_update, 3 * eb + 2 * mb, so._StackedSgdFn.apply),
        }
        for name, (a, kernel, twin, bytes_per_elem, function) in cases.items():
            compiled = torch.compile(twin, dynamic=False)
            impls = [("kernel", lambda k=kernel, a=a: k(*a)),
                     ("twin", lambda t=twin, a=a: t(*a)),
                     ("twin-compiled", lambda c=compiled, a=a: c(*a))]
            for impl, fn in impls:
                ms = event_median_ms(device, fn, args.warmup, args.repeats)
                gbs = bytes_per_elem * numel / (ms * 1e-3) / 1e9
                rows.append({"part": "leaf", "op": name, "dtype": dtype_name, "pass": "fwd",
                             "impl": impl, "ms": ms, "GB/s": gbs,
                             "pct_copy": 100 * gbs / copy_gbs})
            # forward+backward: meta-gradient w.r.t. (grad, param, lr) through the step
            leaves = [a[0].detach().requires_grad_(True), a[3 if name == "adam" else 2]
                      .detach().requires_grad_(True), lr.detach().requires_grad_(True)]

            def fwd_bwd(f: Callable, name: str = name, a: tuple = a, leaves=leaves) -> Callable:
                def run() -> object:
                    full = list(a)
                    full[0] = leaves[0]
                    full[3 if name == "adam" else 2] = leaves[1]
                    full[5 if name == "adam" else 4] = leaves[2]
                    out = f(*full)
                    return torch.autograd.grad(out[0].float().sum(), leaves)

                return run

            for impl, f in [("kernel", function), ("twin", twin), ("twin-compiled", compiled)]:
                ms = event_median_ms(device, fwd_bwd(f), args.warmup, args.repeats)
                rows.append({"part": "leaf", "op": name, "dtype": dtype_name,
                             "pass": "fwd+bwd", "impl": impl, "ms": ms, "GB/s": None,
                             "pct_copy": None})
        del g, p, mu, nu
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def ensemble_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    n = 32
    sizes = [784, 256, 256, 10]
    gen = torch.Generator().manual_seed(1)
    params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        params[f"{i}.weight"] = (0.05 * torch.randn(n, fan_out, fan_in, generator=gen)).to(device)
        params[f"{i}.bias"] = torch.zeros(n, fan_out).to(device)
    grads = {k: torch.randn(v.shape, generator=gen).to(device) for k, v in params.items()}
    numel = sum(v.numel() for v in params.values())
    lr = (torch.rand(n, generator=gen) * 1e-3).to(device)
    opt = ops.stacked_adam(lr=lr, weight_decay=1e-2, decoupled=True)
    state = opt.init(params)
    rows = []

    def add(impl: str, fn: Callable[[], object]) -> None:
        ms = _wall(device, fn, args.warmup, args.iters)
        rows.append({"part": "ensemble", "op": "adamw", "dtype": "fp32", "pass": "step",
                     "impl": impl, "ms": ms, "numel": numel})

    add("stacked_adam eager (kernels)", lambda: opt.update(grads, state, params=params))
    compiled_update = torch.compile(lambda g, s, p: opt.update(g, s, params=p), dynamic=False)
    add("stacked_adam compiled (twin, Inductor)",
        lambda: compiled_update(grads, state, params))
    before = _dispatch.get_rule("stacked_adam_update", device.type)
    _dispatch.set_rule("stacked_adam_update", device.type, min_numel=1 << 62)
    add("stacked_adam eager (twin)", lambda: opt.update(grads, state, params=params))
    _dispatch.set_rule("stacked_adam_update", device.type, **vars(before))
    wd = torch.full((), 1e-2, device=device)
    count = torch.tensor(1, device=device)
    leaves = [(grads[k], state.mu[k], state.nu[k], params[k]) for k in params]

    def raw() -> None:
        for g, m, v, p in leaves:
            torch.ops.torchfn.stacked_adam_update(g, m, v, p, count, lr, wd, 0.9, 0.999, 1e-8,
                                                  0.0, True, False)

    add("raw per-leaf kernels only (6 launches, no Python per leaf)", raw)
    g_l, m_l, v_l, p_l = (list(x) for x in zip(*leaves, strict=True))
    add("raw multi-leaf kernel only (1 launch)",
        lambda: torch.ops.torchfn.stacked_adam_update_multi(
            g_l, m_l, v_l, p_l, count, lr, wd, 0.9, 0.999, 1e-8, 0.0, True, False))
    sgd = ops.stacked_sgd(lr=lr, momentum=0.9, weight_decay=1e-2)
    sgd_state = sgd.init(params)
    add("stacked_sgd(momentum) eager (kernels)",
        lambda: sgd.update(grads, sgd_state, params=params))
    for flag in ("foreach", "fused"):
        if flag == "fused" and device.type != "cuda":
            continue
        ps = [v.clone() for v in params.values()]
        for q, g in zip(ps, grads.values(), strict=True):
            q.grad = g.clone()
        topt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2, **{flag: True})
        add(f"torch.optim.AdamW({flag}=True), one lr (reference)", topt.step)
    return rows


def rows_for_ops_table(numel: int, device: torch.device, copy_gbs: float, warmup: int,
                       repeats: int) -> list[dict]:
    """The leaf rows in ``benchmarks/ops.py``'s table format (fwd+bwd bandwidth: nan)."""
    args = argparse.Namespace(numel=numel, members=32, warmup=warmup, repeats=repeats)
    out = []
    for r in leaf_rows(args, device, copy_gbs):
        out.append({"op": f"stacked_{r['op']}", "dtype": r["dtype"], "pass": r["pass"],
                    "impl": r["impl"], "numel": numel, "ms": r["ms"],
                    "GB/s": r["GB/s"] if r["GB/s"] is not None else float("nan"),
                    "pct_copy": r["pct_copy"] if r["pct_copy"] is not None else float("nan")})
    return out


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if args.small:
        args.numel = 1 << 16
    report = ops.build_ops()
    assert report["ok"] and device.type in report["devices"], report
    copy_gbs = copy_bandwidth(device, args.numel, args.warmup, args.repeats)
    rows = leaf_rows(args, device, copy_gbs) + ensemble_rows(args, device)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "numel": args.numel, "members": args.members,
        "copy_GB/s": copy_gbs, "repeats": args.repeats, "rows": rows,
    }


def print_table(result: dict) -> None:
    print(f"device: {result['device']}  torch {result['torch']}  leaf numel {result['numel']} "
          f"(N={result['members']})  copy {result['copy_GB/s']:.1f} GB/s")
    for r in result["rows"]:
        if r["part"] == "leaf":
            bw = (f"{r['GB/s']:>8.1f} {r['pct_copy']:>5.0f}%" if r["GB/s"] is not None
                  else f"{'':>8} {'':>6}")
            print(f"leaf {r['op']:<5} {r['dtype']:<5} {r['pass']:<8} {r['impl']:<14} "
                  f"{r['ms']:>9.3f} ms {bw}")
        else:
            print(f"ensemble step (32 MLPs, {r['numel']} elems): {r['impl']:<52} "
                  f"{r['ms'] * 1e3:>9.1f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="2^16-element leaf (smoke test)")
    parser.add_argument("--numel", type=int, default=1 << 26)
    parser.add_argument("--members", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--iters", type=int, default=50, help="loop length of ensemble steps")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args)
    print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
