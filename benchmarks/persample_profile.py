"""Where the DP-SGD step's time goes: kernel tables and the ghost-norm path per layer.

Times the graphed (``make_graphed_step``) steps of one ``benchmarks/persample.py`` model --
non-private, DP-SGD as shipped, and DP-SGD with the sequence linears forced onto one ghost
path: ``dp-gram`` (Gram norms + a weighted-sum GEMM, the rule before book-keeping kept
per-sample gradients) and ``dp-materialize`` (per-sample gradients materialised and kept for
every sequence layer) -- then prints the CUDA kernel table of each (torch.profiler, 5 steps).
The forcing patches private switches of ``torchfn.functional._ghost_layers``; it is a
measurement tool, not an API. TF32 off. CUDA only.

    python benchmarks/persample_profile.py --model transformer
    python benchmarks/persample_profile.py --model cnn --rounds 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import torchfn.persample._ghost_layers as ghost_layers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import persample as P

VARIANTS = ("nonprivate", "dp", "dp-gram", "dp-materialize")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer", choices=("cnn", "transformer"))
    ap.add_argument("--rounds", type=int, default=2, help="times to repeat the variant list")
    ap.add_argument("--rows", type=int, default=22, help="kernel rows per table")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("persample_profile.py: needs a CUDA device (graphed steps)")
    P.set_tf32(False)
    device = torch.device("cuda")
    cfg = P.configs(False)[args.model]
    gram, highest = ghost_layers.gram_is_cheaper, ghost_layers._fp32_matmul_is_highest
    profiled: set[str] = set()
    for _ in range(args.rounds):
        for name in VARIANTS:
            ghost_layers.gram_is_cheaper = (lambda *a: False) if name == "dp-materialize" else gram
            ghost_layers._fp32_matmul_is_highest = (
                (lambda: False) if name == "dp-gram" else highest)
            try:
                model, x, y = P.build(args.model, cfg, device)
                torch._dynamo.reset()
                step = (P.v_nonprivate(model, x, y, "graphed") if name == "nonprivate"
                        else P.v_dpsgd(model, x, y, "graphed"))
                r = P.measure(step, device, 10, 50)
                print(f"{args.model} {name:15s} median {r['median_ms']:.3f} ms "
                      f"[{r['p10_ms']:.3f}, {r['p90_ms']:.3f}]", flush=True)
                if name not in profiled:
                    profiled.add(name)
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(5):
                            step()
                        torch.cuda.synchronize()
                    print(f"==== {name}: CUDA kernels over 5 steps")
                    print(prof.key_averages().table(sort_by="self_cuda_time_total",
                                                    row_limit=args.rows,
                                                    max_name_column_width=90), flush=True)
            finally:
                ghost_layers.gram_is_cheaper = gram
                ghost_layers._fp32_matmul_is_highest = highest
            del step, model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
