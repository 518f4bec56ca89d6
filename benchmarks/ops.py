"""Benchmark torchfn's custom ops against their reference twins (eager and torch.compile).

For each op and dtype, times forward and forward+backward of

- ``kernel``: torchfn's C++/CUDA kernel (forward: the raw library op; forward+backward: the
  autograd.Function around the kernels, bypassing the dispatch rule),
- ``twin``: the pure-PyTorch reference twin, eager,
- ``twin-compiled``: the twin under ``torch.compile`` (what the dispatch rule runs while
  compiling),

and reports the median time, the effective bandwidth over the minimal bytes each pass must
move (forward: read x, write y; forward+backward: that plus read grad_out and y/x, write
grad_in) and that bandwidth as a % of a device-to-device copy measured in the same run.
CUDA timings use CUDA events after warm-up; CPU timings use perf_counter.

    python benchmarks/ops.py                       # CUDA if present, 2^28 elements
    python benchmarks/ops.py --small --device cpu  # smoke test
    python benchmarks/ops.py --out benchmarks/results/ops_h100.json
    python benchmarks/ops.py --sweep   # kernel vs eager twin over sizes 2^10..2^26 (fp32):
                                       # where the kernel starts to win (dispatch min_numel)
    python benchmarks/ops.py --ops softmax_cross_entropy --table-only \
        --xent-shapes 4096x50257 --impls kernel-raw kernel twin-compiled   # one case, quickly

Op 3 (``linear_grad_norms_sq``, ``clipped_linear_grad_sum``: inputs ``(B, [T,] d)`` pairs,
GEMM-bound 3-D paths) has its own driver with the same columns, reusing ``_bench.event_median_ms`` and
``copy_bandwidth`` from here: ``python benchmarks/ops_ghost.py [--sweep]``.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import event_median_ms, write_json

from torchfn import ops
from torchfn.ops import _activations, reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
SLOPE = 0.01


def copy_bandwidth(device: torch.device, numel: int, warmup: int, repeats: int) -> float:
    """Return device-to-device copy bandwidth in GB/s (bytes read + written), fp32."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = event_median_ms(device, lambda: dst.copy_(src), warmup, repeats)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def _ops_table() -> dict[str, dict[str, Callable]]:
    return {
        "sigmoid": {
            "kernel_fwd": lambda x: torch.ops.torchfn.sigmoid(x),
            "function": _activations._SigmoidFn.apply,
            "twin": reference.sigmoid,
        },
        "leaky_relu": {
            "kernel_fwd": lambda x: torch.ops.torchfn.leaky_relu(x, SLOPE),
            "function": lambda x: _activations._LeakyReluFn.apply(x, SLOPE),
            "twin": lambda x: reference.leaky_relu(x, SLOPE),
        },
    }


# --- softmax_cross_entropy (op 1) -------------------------------------------------------------
# Rows are (N, C) logits with int64 targets (1/8 of rows ignored), mean reduction. Bytes moved:
# forward reads the logits once; forward+backward reads them twice and writes the gradient.
# ``kernel`` is the public op with the dispatch rule forced onto the kernel (what a user gets
# above the rule's threshold: includes the autograd.Function's Python overhead), ``kernel-raw``
# the library ops alone (forward, then the backward kernel: the GPU time of the kernels),
# ``torch`` is F.cross_entropy for context.
XENT_SHAPES = [(262_144, 1024), (8192, 32_768), (4096, 50_257)]  # warp rows; block rows; odd C
XENT_SWEEP = [(64, 128), (512, 512), (2048, 1024), (8192, 1024), (16_384, 2048), (32_768, 2048),
              (65_536, 2048)]  # eager fwd+bwd, 2^13 .. 2^27 elements: where the kernel starts to win
# (tasks, rows, classes): MAML's second-order loss, vmap over tasks of grad(grad); 2^12 .. 2^28
XENT_MAML = [(32, 25, 5), (8, 512, 1000), (16, 4096, 1024), (16, 8192, 2048)]
XENT_SMALL = [(512, 1000), (64, 4099)]


def _xent_inputs(n: int, c: int, dtype: torch.dtype, device: torch.device, *lead: int):
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(*lead, n, c, generator=gen, dtype=torch.float32).to(device, dtype)
    t = torch.randint(0, c, (*lead, n), generator=gen)
    t[..., ::8] = -100
    return x, t.to(device)


def _xent_raw_fwd_bwd(x: torch.Tensor, t: torch.Tensor) -> Callable[[], object]:
    g = torch.full((x.shape[0],), 1.0 / x.shape[0], device=x.device,
                   dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)

    def step() -> torch.Tensor:
        _, stats = torch.ops.torchfn.softmax_cross_entropy(x, t, 0.0, -100)
        return torch.ops.torchfn.softmax_cross_entropy_backward(g, x, t, stats, 0.0, -100)

    return step


def _xent_rows(args: argparse.Namespace, device: torch.device, copy_gbs: float) -> list[dict]:
    from torchfn.ops import _dispatch, _xent

    op = "softmax_cross_entropy"
    saved = _dispatch.get_rule(op, device.type)
    saved_transform = dict(_xent.TRANSFORM_MIN_NUMEL)
    _dispatch.set_rule(op, device.type, min_numel=0, min_numel_grad=0)  # kernel at every size
    _xent.TRANSFORM_MIN_NUMEL.clear()
    rows: list[dict] = []

    def record(name: str, dtype_name: str, pass_name: str, impl: str, numel: int,
               n_moves: float, elem: int, fn: Callable[[], object]) -> None:
        ms = event_median_ms(device, fn, args.warmup, args.repeats)
        gbs = n_moves * numel * elem / (ms * 1e-3) / 1e9
        rows.append({"op": name, "dtype": dtype_name, "pass": pass_name, "impl": impl,
                     "numel": numel, "ms": ms, "GB/s": gbs, "pct_copy": 100 * gbs / copy_gbs})

    def fwd_bwd(fn: Callable, x: torch.Tensor, t: torch.Tensor) -> Callable[[], object]:
        xr = x.detach().requires_grad_(True)
        return lambda: torch.autograd.grad(fn(xr, t), xr)

    def wanted(impl: str) -> bool:
        return not args.impls or impl in args.impls

    try:
        large = args.small is False and device.type == "cuda"
        shapes = XENT_SHAPES if large else XENT_SMALL
        if args.xent_shapes:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.xent_shapes]
        for n, c in shapes:
            for dtype_name in args.dtypes:
                dtype = DTYPES[dtype_name]
                x, t = _xent_inputs(n, c, dtype, device)
                name, elem = f"xent {n}x{c}", x.element_size()
                impls = [("kernel", ops.softmax_cross_entropy),
                         ("twin", reference.softmax_cross_entropy),
                         ("twin-compiled", reference.softmax_cross_entropy),
                         ("torch", F.cross_entropy)]
                for impl, fn in impls:
                    if impl == "kernel":  # raw library ops, then the public op (fwd+bwd)
                        if wanted("kernel-raw"):
                            record(name, dtype_name, "fwd", "kernel-raw", n * c, 1, elem,
                                   lambda x=x, t=t:
                                   torch.ops.torchfn.softmax_cross_entropy(x, t, 0.0, -100))
                            record(name, dtype_name, "fwd+bwd", "kernel-raw", n * c, 3, elem,
                                   _xent_raw_fwd_bwd(x, t))
                        if wanted("kernel"):
                            record(name, dtype_name, "fwd+bwd", impl, n * c, 3, elem,
                                   fwd_bwd(fn, x, t))
                        continue
                    if not wanted(impl):
                        continue
                    if impl == "twin-compiled":
                        fn = torch.compile(fn, dynamic=False)
                    record(name, dtype_name, "fwd", impl, n * c, 1, elem,
                           lambda fn=fn, x=x, t=t: fn(x, t))
                    record(name, dtype_name, "fwd+bwd", impl, n * c, 3, elem, fwd_bwd(fn, x, t))
                del x, t
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if args.table_only:
            return rows
        if device.type == "cuda" and not args.small:
            for (n, c), dtype_name in itertools.product(XENT_SWEEP, args.dtypes):
                x, t = _xent_inputs(n, c, DTYPES[dtype_name], device)
                for impl, fn in [("kernel", ops.softmax_cross_entropy),
                                 ("twin", reference.softmax_cross_entropy)]:
                    record(f"xent {n}x{c}", dtype_name, "fwd", impl, n * c, 1,
                           x.element_size(), lambda fn=fn, x=x, t=t: fn(x, t))
                    record(f"xent {n}x{c}", dtype_name, "fwd+bwd", impl, n * c, 3,
                           x.element_size(), fwd_bwd(fn, x, t))
        for tasks, n, c in XENT_MAML if large else XENT_MAML[:2]:
            x, t = _xent_inputs(n, c, torch.float32, device, tasks)
            direction = torch.randn_like(x[0])
            for impl, fn in [("kernel", ops.softmax_cross_entropy),
                             ("twin", reference.softmax_cross_entropy)]:
                inner = torch.func.grad(lambda x, t, fn=fn: (fn(x, t, reduction="none") ** 2).sum())
                outer = torch.func.vmap(torch.func.grad(
                    lambda x, t, inner=inner, d=direction: (inner(x, t) * d).sum()))
                record(f"xent maml {tasks}x{n}x{c}", "fp32", "grad2", impl, tasks * n * c, 5, 4,
                       lambda outer=outer, x=x, t=t: outer(x, t))
    finally:
        _dispatch.set_rule(op, device.type, **vars(saved))
        _xent.TRANSFORM_MIN_NUMEL.update(saved_transform)
    return rows


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    numel = args.numel or ((1 << 16) if args.small else (1 << 28))
    report = ops.build_ops()
    kernels_ok = report["ok"] and device.type in report["devices"]
    if not kernels_ok:
        print(f"[ops bench] no {device.type} kernels: {report['reason'] or report['cuda_reason']}",
              file=sys.stderr)
    copy_gbs = copy_bandwidth(device, numel, args.warmup, args.repeats)
    rows = []
    for op_name, fns in _ops_table().items():
        if args.ops and op_name not in args.ops:
            continue
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            gen = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(numel, generator=gen, dtype=torch.float32).to(device, dtype)
            g = torch.randn(numel, generator=gen, dtype=torch.float32).to(device, dtype)
            xr = x.detach().requires_grad_(True)
            compiled_twin = torch.compile(fns["twin"], dynamic=False)
            elem = x.element_size()

            def fwd_bwd(fn: Callable, xr: torch.Tensor = xr, g: torch.Tensor = g) -> Callable:
                return lambda: torch.autograd.grad(fn(xr), xr, g)

            impls: list[tuple[str, str, Callable[[], object], int]] = []
            if kernels_ok:
                impls.append(("fwd", "kernel", lambda f=fns["kernel_fwd"], x=x: f(x), 2))
            impls += [
                ("fwd", "twin", lambda f=fns["twin"], x=x: f(x), 2),
                ("fwd", "twin-compiled", lambda f=compiled_twin, x=x: f(x), 2),
            ]
            if kernels_ok:
                impls.append(("fwd+bwd", "kernel", fwd_bwd(fns["function"]), 5))
            impls += [
                ("fwd+bwd", "twin", fwd_bwd(fns["twin"]), 5),
                ("fwd+bwd", "twin-compiled", fwd_bwd(compiled_twin), 5),
            ]
            for pass_name, impl, fn, n_moves in impls:
                ms = event_median_ms(device, fn, args.warmup, args.repeats)
                gbs = n_moves * numel * elem / (ms * 1e-3) / 1e9
                rows.append({
                    "op": op_name, "dtype": dtype_name, "pass": pass_name, "impl": impl,
                    "numel": numel, "ms": ms, "GB/s": gbs, "pct_copy": 100 * gbs / copy_gbs,
                })
            del x, g, xr
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not args.ops or "softmax_cross_entropy" in args.ops:
        rows += _xent_rows(args, device, copy_gbs)
    if not args.ops or "stacked_optim" in args.ops:  # op 4 (ensemble step: ops_stacked_optim.py)
        from ops_stacked_optim import rows_for_ops_table

        rows += rows_for_ops_table(min(numel, 1 << 26), device, copy_gbs, args.warmup,
                                   args.repeats)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "numel": numel,
        "copy_GB/s": copy_gbs,
        "repeats": args.repeats,
        "kernels": {k: report[k] for k in ("ok", "devices", "reason", "cuda_reason")},
        "rows": rows,
    }


def sweep(args: argparse.Namespace) -> dict:
    """Time kernel vs eager twin, fwd and fwd+bwd, fp32, over sizes 2^10 .. 2^26."""
    device = torch.device(args.device)
    report = ops.build_ops()
    if not (report["ok"] and device.type in report["devices"]):
        raise SystemExit(f"no {device.type} kernels: {report['reason'] or report['cuda_reason']}")
    rows = []
    for op_name, fns in _ops_table().items():
        if args.ops and op_name not in args.ops:
            continue
        for log2 in range(10, 27, 2):
            numel = 1 << log2
            x = torch.randn(numel, device=device)
            g = torch.randn(numel, device=device)
            xr = x.detach().requires_grad_(True)
            row = {"op": op_name, "numel": numel}
            for impl, fwd, fn in [("kernel", fns["kernel_fwd"], fns["function"]),
                                  ("twin", fns["twin"], fns["twin"])]:
                row[f"{impl}_fwd_ms"] = event_median_ms(device, lambda f=fwd, x=x: f(x), args.warmup,
                                               args.repeats)
                row[f"{impl}_fwdbwd_ms"] = event_median_ms(
                    device, lambda f=fn, xr=xr, g=g: torch.autograd.grad(f(xr), xr, g),
                    args.warmup, args.repeats)
            rows.append(row)
    print(f"{'op':<11} {'numel':>10} {'fwd kernel':>11} {'fwd twin':>9} "
          f"{'f+b kernel':>11} {'f+b twin':>9}  (ms)")
    for r in rows:
        print(f"{r['op']:<11} {r['numel']:>10} {r['kernel_fwd_ms']:>11.4f} "
              f"{r['twin_fwd_ms']:>9.4f} {r['kernel_fwdbwd_ms']:>11.4f} "
              f"{r['twin_fwdbwd_ms']:>9.4f}")
    return {"device": str(device), "torch": torch.__version__, "sweep": rows}


def print_table(result: dict) -> None:
    print(f"device: {result['device']}  torch {result['torch']}  numel {result['numel']}  "
          f"copy {result['copy_GB/s']:.1f} GB/s (median of {result['repeats']})")
    print(f"{'op':<24} {'dtype':<5} {'pass':<8} {'impl':<14} {'ms':>9} {'GB/s':>8} {'%copy':>6}")
    for r in result["rows"]:
        print(f"{r['op']:<24} {r['dtype']:<5} {r['pass']:<8} {r['impl']:<14} "
              f"{r['ms']:>9.3f} {r['GB/s']:>8.1f} {r['pct_copy']:>5.0f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="2^16 elements (smoke test)")
    parser.add_argument("--numel", type=int, default=None, help="elements (default 2^28)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--ops", nargs="*", default=None, help="subset of op names")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--sweep", action="store_true",
                        help="kernel vs eager twin over sizes instead of the main table")
    parser.add_argument("--xent-shapes", nargs="+", default=None, metavar="NxC",
                        help="softmax_cross_entropy: these shapes instead of the default ones")
    parser.add_argument("--table-only", action="store_true",
                        help="softmax_cross_entropy: the main table only (no size sweep, no MAML)")
    parser.add_argument("--impls", nargs="+", default=None,
                        choices=["kernel-raw", "kernel", "twin", "twin-compiled", "torch"],
                        help="softmax_cross_entropy: time only these implementations")
    args = parser.parse_args(argv)
    if args.sweep:
        result = sweep(args)
    else:
        result = run(args)
        print_table(result)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
