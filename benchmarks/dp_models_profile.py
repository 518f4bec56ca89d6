"""Where the DP step's time goes on the Hugging Face models of ``benchmarks/dp_models.py``.

Builds one workload (same model, batch and hyper-parameters as ``dp_models.py``) and runs
``torchfn.compile.profile_step`` on the chosen variants, printing each profile's table: wall,
host and kernel time per step, the step's named parts (``torchfn.forward_backward``,
``torchfn.ghost_pass``, ``torchfn.clipped_sum``, ``torchfn.noise``, ...) and the top kernels.
With ``--trace-dir`` each profile's Chrome trace is written there. ``--diff`` (two variants)
also prints the kernel-family difference of the second minus the first: kernels grouped by
name without Triton's trailing index, ms and calls per step, largest differences first
(give ``--top`` a large value, e.g. 2000, so every kernel is counted).

    python benchmarks/dp_models_profile.py --workload gpt2 --precision fp32
    python benchmarks/dp_models_profile.py --workload vit --variants dpsgd-eager --top 40
    python benchmarks/dp_models_profile.py --workload vit --precision bf16 \
        --variants nonprivate-compiled,dpsgd-compiled --inductor shape_padding=False --top 40
    python benchmarks/dp_models_profile.py --workload gpt2 --precision bf16 --batch 32 \
        --variants nonprivate-graphed,dpsgd-graphed --top 2000 --diff 40
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench import set_tf32_off
from dp_models import (  # the benchmark's own models, batches and variants
    VARIANTS,
    WORKLOADS,
    _set_inductor,
    build_model,
    configs,
    loss_kind,
    make_batch,
    make_variant,
)

from torchfn.compile import profile_step


def kernel_families(top: Any) -> dict[str, tuple[float, float]]:
    """``{family: (ms, calls)}`` per step from a profile's ``top`` (:class:`OpTime` rows):
    names without a trailing ``_<index>`` (Triton's kernel number), device time where
    profiled, else host time."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in top:
        fam = re.sub(r"_\d+$", "", row.name)
        ms = row.device_ms if row.device_ms is not None else row.host_ms
        out[fam][0] += ms
        out[fam][1] += row.calls
    return {k: (v[0], v[1]) for k, v in out.items()}


def family_diff(base: Any, other: Any, rows: int) -> str:
    """Table of ``other - base`` per kernel family, the ``rows`` largest |differences|."""
    a, b = kernel_families(base), kernel_families(other)
    keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]))
    lines = [f"{'diff ms':>8} {'ms':>8} {'calls':>6} {'base ms':>8} {'calls':>6}  family"]
    for k in keys[:rows]:
        (ms_b, n_b), (ms_a, n_a) = b.get(k, (0.0, 0.0)), a.get(k, (0.0, 0.0))
        lines.append(f"{ms_b - ms_a:+8.3f} {ms_b:8.3f} {n_b:6.0f} {ms_a:8.3f} {n_a:6.0f}  {k[:110]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gpt2", choices=WORKLOADS)
    ap.add_argument("--variants", default="nonprivate-eager,dpsgd-eager",
                    help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    ap.add_argument("--batch", type=int, default=None,
                    help="samples per step (default: the workload's, as in dp_models.py)")
    ap.add_argument("--top", type=int, default=25, help="kernel rows per table")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--trace-dir", type=Path, default=None, help="write Chrome traces here")
    ap.add_argument("--diff", type=int, default=0, metavar="ROWS",
                    help="with two variants: print ROWS rows of their kernel-family difference")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="set torch._inductor.config.KEY for the compiled variants "
                         "(as dp_models.py --inductor)")
    args = ap.parse_args(argv)
    _set_inductor(args.inductor)
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}; expected a subset of {', '.join(VARIANTS)}")
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {args.device}, TF32 {set_tf32_off()}, workload "
          f"{args.workload}, precision {args.precision}", flush=True)
    try:
        cfg = configs(args.tiny, args.batch)[args.workload]
    except ValueError as e:
        ap.error(f"--batch: {e}")
    template = build_model(args.workload, cfg, untie=False, expand_positions=True)
    if args.diff and len(variants) != 2:
        ap.error(f"--diff: expected exactly two --variants, got {len(variants)}")
    profiles = []
    for variant in variants:
        model = template.to(device)
        x, y = make_batch(args.workload, cfg, device)
        fn, _info = make_variant(variant, model, x, y, loss_kind(args.workload), args.precision)

        def step(state: Any, batch: Any, fn: Any = fn) -> tuple[Any, Any]:
            fn()
            return state, None

        trace = None
        if args.trace_dir is not None:
            args.trace_dir.mkdir(parents=True, exist_ok=True)
            trace = args.trace_dir / f"{args.workload}-{args.precision}-{variant}.json"
        prof = profile_step(step, None, None, warmup=3, steps=args.steps, top_k=args.top,
                            trace=trace, device=device)
        profiles.append(prof)
        print(f"\n### {variant}\n{prof.table()}", flush=True)
    if args.diff:
        print(f"\n### kernel families, {variants[1]} minus {variants[0]} (per step)\n"
              + family_diff(profiles[0].top, profiles[1].top, args.diff), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
