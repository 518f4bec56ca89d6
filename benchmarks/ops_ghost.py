"""Benchmark op 3 (per-sample gradient norms of a linear layer, clipped gradient sum).

For each case and dtype, times forward and forward+backward of

- ``kernel``: torchfn's kernel (forward: the raw library op; forward+backward: the
  autograd.Function around the kernels, bypassing the dispatch rule),
- ``kernel-raw`` (2-D norms, forward+backward): the forward and backward library ops alone,
  the backward reusing the forward's ``aux`` (the GPU time of the kernels, no autograd),
- ``twin``: the pure-PyTorch reference twin (:mod:`torchfn.ops.reference`), eager,
- ``twin-compiled``: the twin under ``torch.compile`` (what the dispatch rule runs while
  compiling),

reporting the median time; for the bandwidth-bound 2-D norms also the effective bandwidth over
the minimal bytes (forward: read a and g; forward+backward: that, then read a, g and write
da, dg) as a % of a device-to-device copy measured in the same run; for the GEMM-bound cases
the achieved TFLOP/s of the kernel's multiply-adds. ``--sweep`` times each op family (kernel vs
eager twin, fwd and fwd+bwd) over batch sizes for each family, to place the dispatch rule's
``min_numel`` / ``min_numel_grad``.

    python benchmarks/ops_ghost.py                      # CUDA if present, H100-filling sizes
    python benchmarks/ops_ghost.py --small --device cpu # smoke test
    python benchmarks/ops_ghost.py --sweep
    python benchmarks/ops_ghost.py --ops norms-2d norms-2d-narrow --impls kernel kernel-raw
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import event_median_ms, write_json
from ops import DTYPES, copy_bandwidth  # benchmarks/ops.py

from torchfn import ops
from torchfn.ops import _ghost, reference

# name -> (batch, time or None, d_in, d_out, method); "full" sizes fill an H100.
CASES_FULL = {
    "norms-2d": (16384, None, 8192, 8192, "gram"),
    "norms-2d-narrow": (1 << 20, None, 128, 128, "gram"),
    "norms-2d-wide": (16, None, 1 << 23, 1 << 22, "gram"),
    "norms-3d-gram": (64, 256, 2048, 2048, "gram"),
    "norms-3d-materialize": (64, 2048, 256, 256, "materialize"),
    "clipped-2d": (16384, None, 4096, 4096, None),
    "clipped-3d": (64, 256, 2048, 2048, None),
}
CASES_SMALL = {
    "norms-2d": (256, None, 512, 256, "gram"),
    "norms-3d-gram": (8, 16, 64, 64, "gram"),
    "norms-3d-materialize": (8, 64, 16, 16, "materialize"),
    "clipped-2d": (256, None, 128, 64, None),
    "clipped-3d": (8, 16, 64, 64, None),
}


def _case_fns(method: str | None) -> dict[str, Callable]:
    if method is None:  # clipped sum: (a, g, coef)
        return {
            "kernel_fwd": torch.ops.torchfn.clipped_linear_grad_sum,
            "function": _ghost._ClippedSumFn.apply,
            "twin": reference.clipped_linear_grad_sum,
        }
    return {
        "kernel_fwd": lambda a, g: torch.ops.torchfn.linear_grad_norms_sq(a, g, False, method),
        "function": lambda a, g: _ghost._NormsFn.apply(a, g, False, method)[0],
        "twin": lambda a, g: reference.linear_grad_norms_sq(a, g, method=method),
    }


def _raw_fwd_bwd(a: torch.Tensor, g: torch.Tensor, w: torch.Tensor,
                 method: str) -> Callable[[], object]:
    """Forward then backward library ops (the backward reusing the forward's aux), no autograd."""

    def step() -> object:
        _, aux = torch.ops.torchfn.linear_grad_norms_sq(a, g, False, method)
        return torch.ops.torchfn.linear_grad_norms_sq_backward(w, a, g, aux, False, method)

    return step


def _macs(batch: int, time: int | None, d_in: int, d_out: int, method: str | None) -> float:
    """Multiply-adds of the forward kernel (GEMM-bound cases)."""
    t = time or 1
    if method == "gram":
        return batch * t * t * (d_in + d_out + 1)
    return batch * t * d_in * d_out


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    report = ops.build_ops()
    kernels_ok = report["ok"] and device.type in report["devices"]
    if not kernels_ok:
        print(f"[ghost bench] no {device.type} kernels: "
              f"{report['reason'] or report['cuda_reason']}", file=sys.stderr)
    cases = CASES_SMALL if args.small else CASES_FULL
    copy_gbs = copy_bandwidth(device, 1 << (16 if args.small else 28), args.warmup, args.repeats)
    rows = []
    for name, (batch, time, d_in, d_out, method) in cases.items():
        if args.ops and name not in args.ops:
            continue
        fns = _case_fns(method)
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            lead = (batch,) if time is None else (batch, time)
            gen = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(*lead, d_in, generator=gen, device=device, dtype=dtype)
            g = torch.randn(*lead, d_out, generator=gen, device=device, dtype=dtype)
            a.mul_(d_in**-0.5)
            g.mul_(d_out**-0.5)
            extra = [torch.rand(batch, generator=gen, device=device, dtype=dtype)] if (
                method is None) else []
            leaves = [x.detach().requires_grad_(True) for x in (a, g, *extra)]
            w = torch.randn(batch if method else d_out, *(() if method else (d_in,)),
                            generator=gen, device=device, dtype=dtype)
            compiled_twin = torch.compile(fns["twin"], dynamic=False)

            def fwd_bwd(fn: Callable, leaves: list = leaves, w: torch.Tensor = w) -> Callable:
                return lambda: torch.autograd.grad(fn(*leaves), leaves, w)

            inputs = (a, g, *extra)
            impls: list[tuple[str, str, Callable[[], object]]] = []
            if kernels_ok:
                impls.append(("fwd", "kernel", lambda f=fns["kernel_fwd"], x=inputs: f(*x)))
            impls += [
                ("fwd", "twin", lambda f=fns["twin"], x=inputs: f(*x)),
                ("fwd", "twin-compiled", lambda f=compiled_twin, x=inputs: f(*x)),
            ]
            if kernels_ok and method is not None:  # the library ops alone: GPU time
                impls.append(("fwd+bwd", "kernel-raw", _raw_fwd_bwd(a, g, w, method)))
            if kernels_ok:
                impls.append(("fwd+bwd", "kernel", fwd_bwd(fns["function"])))
            impls += [
                ("fwd+bwd", "twin", fwd_bwd(fns["twin"])),
                ("fwd+bwd", "twin-compiled", fwd_bwd(compiled_twin)),
            ]
            if args.impls:
                impls = [i for i in impls if i[1] in args.impls]
            in_bytes = (a.numel() + g.numel()) * a.element_size()
            for pass_name, impl, fn in impls:
                try:
                    ms = event_median_ms(device, fn, args.warmup, args.repeats)
                except torch.OutOfMemoryError:
                    rows.append({"op": name, "dtype": dtype_name, "pass": pass_name,
                                 "impl": impl, "ms": float("nan"), "note": "out of memory"})
                    torch.cuda.empty_cache()
                    continue
                row = {"op": name, "dtype": dtype_name, "pass": pass_name, "impl": impl,
                       "shape": f"B={batch} T={time} d_in={d_in} d_out={d_out}", "ms": ms}
                if time is None and method is not None:  # bandwidth-bound
                    gbs = (1 if pass_name == "fwd" else 3) * in_bytes / (ms * 1e-3) / 1e9
                    row.update({"GB/s": gbs, "pct_copy": 100 * gbs / copy_gbs})
                else:
                    macs = _macs(batch, time, d_in, d_out, method)
                    flops = 2 * macs * (1 if pass_name == "fwd" else 3)
                    row["TFLOP/s"] = flops / (ms * 1e-3) / 1e12
                rows.append(row)
            del a, g, extra, leaves, w, inputs, impls
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "copy_GB/s": copy_gbs,
        "repeats": args.repeats,
        "kernels": {k: report[k] for k in ("ok", "devices", "reason", "cuda_reason")},
        "rows": rows,
    }


# family -> (batch sizes, shape of one sample of a, of g, method or None for the clipped sum)
SWEEP = {
    "norms-2d": ([1 << k for k in range(0, 17, 2)], (256,), (256,), "gram"),
    "norms-3d-gram": ([1 << k for k in range(0, 9, 2)], (64, 512), (64, 512), "gram"),
    "norms-3d-materialize": ([1 << k for k in range(0, 9, 2)], (512, 64), (512, 64),
                             "materialize"),
    "clipped-2d": ([1 << k for k in range(0, 17, 2)], (256,), (256,), None),
}


def sweep(args: argparse.Namespace) -> dict:
    """fp32, kernel vs eager twin, fwd and fwd+bwd, over batch sizes: where the kernel wins."""
    device = torch.device(args.device)
    report = ops.build_ops()
    if not (report["ok"] and device.type in report["devices"]):
        raise SystemExit(f"no {device.type} kernels: {report['reason'] or report['cuda_reason']}")
    rows = []
    for family, (batches, a_shape, g_shape, method) in SWEEP.items():
        if args.ops and family not in args.ops:
            continue
        fns = _case_fns(method)
        for batch in batches:
            xs = [torch.randn(batch, *a_shape, device=device),
                  torch.randn(batch, *g_shape, device=device)]
            if method is None:
                xs.append(torch.rand(batch, device=device))
            leaves = [x.detach().requires_grad_(True) for x in xs]
            w = torch.randn(batch, device=device) if method else torch.randn(
                g_shape[-1], a_shape[-1], device=device)
            row = {"op": family, "batch": batch, "numel_a": xs[0].numel()}
            for impl, fwd, fn in [("kernel", fns["kernel_fwd"], fns["function"]),
                                  ("twin", fns["twin"], fns["twin"])]:
                row[f"{impl}_fwd_ms"] = event_median_ms(device, lambda f=fwd, x=xs: f(*x),
                                               args.warmup, args.repeats)
                row[f"{impl}_fwdbwd_ms"] = event_median_ms(
                    device, lambda f=fn, x=leaves, w=w: torch.autograd.grad(f(*x), x, w),
                    args.warmup, args.repeats)
            rows.append(row)
    print(f"{'op':<21} {'batch':>7} {'numel(a)':>10} {'fwd kernel':>11} {'fwd twin':>9} "
          f"{'f+b kernel':>11} {'f+b twin':>9}  (ms)")
    for r in rows:
        print(f"{r['op']:<21} {r['batch']:>7} {r['numel_a']:>10} {r['kernel_fwd_ms']:>11.4f} "
              f"{r['twin_fwd_ms']:>9.4f} {r['kernel_fwdbwd_ms']:>11.4f} "
              f"{r['twin_fwdbwd_ms']:>9.4f}")
    return {"device": str(device), "torch": torch.__version__, "sweep": rows}


def print_table(result: dict) -> None:
    print(f"device: {result['device']}  torch {result['torch']}  "
          f"copy {result['copy_GB/s']:.1f} GB/s (median of {result['repeats']})")
    print(f"{'case':<21} {'dtype':<5} {'pass':<8} {'impl':<14} {'ms':>9} {'GB/s':>8} "
          f"{'%copy':>6} {'TFLOP/s':>8}  shape")
    for r in result["rows"]:
        gbs = f"{r['GB/s']:>8.1f} {r['pct_copy']:>5.0f}%" if "GB/s" in r else " " * 15
        tfl = f"{r['TFLOP/s']:>8.1f}" if "TFLOP/s" in r else " " * 8
        print(f"{r['op']:<21} {r['dtype']:<5} {r['pass']:<8} {r['impl']:<14} {r['ms']:>9.3f} "
              f"{gbs} {tfl}  {r.get('shape', r.get('note', ''))}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--ops", nargs="*", default=None, help="subset of case names")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--sweep", action="store_true", help="2-D norms over batch sizes")
    parser.add_argument("--impls", nargs="+", default=None,
                        choices=["kernel", "kernel-raw", "twin", "twin-compiled"],
                        help="time only these implementations (default: all)")
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
