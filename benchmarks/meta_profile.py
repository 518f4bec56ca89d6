"""Where the compiled MAML step's time goes: compile phases, cuDNN precision, conv shapes.

Compiles the outer step of ``benchmarks/meta.py`` (same net, tasks and config) ONCE with
``torchfn.compile.inductor_options(channels_last=...)``, then, without recompiling (the cuDNN
switches are read at call time):

1. prints the first call's time and Dynamo/Inductor's compile-phase breakdown
   (``torch._dynamo.utils.compile_times``);
2. times 10 synchronised calls (after 2 more warm-up calls) under cuDNN TF32 off, TF32 on,
   ``cudnn.benchmark`` on, and TF32 off again (matmul TF32 stays off throughout);
3. profiles one call at TF32 off: the top kernels by device time, then the convolution ops
   grouped by input shape (which conv of which layer costs what).

CUDA only (the point is cuDNN's kernels). A compile takes 6-8 minutes on the H100 machine.

    python benchmarks/meta_profile.py --channels-last
    python benchmarks/meta_profile.py --no-channels-last --rows 40
    python benchmarks/meta_profile.py --inductor loop_ordering_after_fusion=False
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench import time_calls
from meta import conv_net, make_tasks  # the benchmark's own net and tasks

from torchfn.compile import inductor_options
from torchfn.functional import make_functional
from torchfn.meta import maml

CFG = dict(channels=64, n_tasks=32, n_way=5, k_shot=1, n_query=15, size=28, steps=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                    help="inductor_options(channels_last=...) (default: on)")
    ap.add_argument("--rows", type=int, default=25, help="kernel rows to print")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Inductor option (Python literal value), e.g. "
                         "loop_ordering_after_fusion=False; repeatable")
    args = ap.parse_args()
    extra = {}
    for item in args.inductor:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--inductor: expected KEY=VALUE, got {item!r}")
        try:
            extra[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            ap.error(f"--inductor {key}: expected a Python literal value, got {value!r}")
    if not torch.cuda.is_available():
        raise SystemExit("meta_profile.py: needs a CUDA device (it profiles cuDNN kernels)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, config {CFG}, "
          f"channels_last={args.channels_last}, extra Inductor options {extra}", flush=True)
    torch.manual_seed(0)
    module = conv_net(CFG["channels"], CFG["n_way"], CFG["size"]).to(dev)
    tasks = make_tasks(CFG["n_tasks"], CFG["n_way"], CFG["k_shot"], CFG["n_query"],
                       CFG["size"], dev, torch.float32)
    model_fn, params, buffers = make_functional(module)
    learner = maml(model_fn, F.cross_entropy, inner_lr=0.01, inner_steps=CFG["steps"])
    step = torch.compile(learner.meta_grad, fullgraph=True,
                         options={**inductor_options(channels_last=args.channels_last),
                                  **extra})

    def call() -> None:
        step(params, buffers, tasks)
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    call()
    print(f"first call (compile) {time.perf_counter() - t0:.1f} s", flush=True)
    from torch._dynamo.utils import compile_times
    print(compile_times(repr="str", aggregate=True), flush=True)

    for tf32, bench in [(False, False), (True, False), (False, True), (False, False)]:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = tf32, bench
        timing = time_calls(call, "cuda", warmup=2, repeats=10)
        print(f"cudnn tf32={tf32} benchmark={bench}: median {timing.median_ms:.2f} ms  "
              f"{[round(t * 1e3, 1) for t in timing.times_s]}", flush=True)
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = False, False

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        call()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows,
                                    max_name_column_width=90))
    convs = [e for e in prof.key_averages(group_by_input_shape=True)
             if "convolution" in e.key and e.device_time_total > 0]
    convs.sort(key=lambda e: -e.device_time_total)
    for e in convs[:40]:
        print(f"{e.device_time_total / 1e3:8.2f} ms  n={e.count:3d}  {e.key[:40]:40s} "
              f"{str(e.input_shapes)[:200]}")


if __name__ == "__main__":
    main()
