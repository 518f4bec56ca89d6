"""Compile time of the compiled MAML meta-gradient versus ``inner_steps``, one design per row.

Each (design, algorithm, inner_steps) runs in its own subprocess with a fresh Inductor cache
directory (``TORCHINDUCTOR_CACHE_DIR``) and ``torch._dynamo.reset()``, so nothing cached hides
the cost. It reports the first call (compile) in wall seconds and in CPU seconds of the process
and its children (the C++/Triton kernel builds run in workers; CPU seconds are steadier than
wall seconds on a shared machine), the median step time of ``--repeats`` later calls, the
number of graphs Dynamo captured, and the max abs difference of the meta-gradient from the
eager ``torch.func`` meta-gradient of the same model function.

Designs (``--designs``):

- ``unrolled``: ``torch.compile(learner.meta_grad, fullgraph=True)`` of today's path with the
  model from ``make_functional(conv_net)``: the inner loop unrolled in one graph (the
  baseline; ``compile_regions=False``).
- ``unrolled-pure``: the same with a side-effect-free model function (the conv net written
  with ``F.conv2d``, a composite batch norm, ...): the baseline for ``region``.
- ``region``: the pure model with ``compile_regions=True`` and
  ``torch._dynamo.config.trace_autograd_ops=True``: each inner step is one call of a
  ``torch.compiler.nested_compile_region`` (traced and compiled once), the outer gradient is
  ``torch.autograd.grad`` traced into the graph. Fullgraph.
- ``region-module``: ``region`` with the ``make_functional`` model (fails in torch 2.13: the
  model call swaps module slots, a side effect inside the region; the row shows the error).
- ``inner``: the library's ``make_meta_train_step(learner, opt, compile="inner").meta_grad``:
  no outer compile; the vmapped inner step is ``torch.compile``d (compiled once, called
  ``inner_steps`` times from Python) and so is the query loss; the outer
  ``torch.autograd.grad`` runs eagerly through the compiled calls' backward. Works with the
  ``make_functional`` model; not one graph.
- ``inner-noquery``: ``inner`` with the query loss eager (only the inner step compiled).
- ``inner-step``: the whole train step ``make_meta_train_step(learner, adam(1e-3),
  max_grad_norm=1.0, compile="inner")`` (the outer update compiled as a graph of its own);
  ``max|diff|`` is then that of the updated params from the eager step's.
- ``inner-step-eagerupdate``: ``inner-step`` with the outer update (clipping + adam) eager.

    python benchmarks/meta_compile_time.py                       # the default grid
    python benchmarks/meta_compile_time.py --designs unrolled,region --steps 1,8 --algos maml
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DESIGNS = ("unrolled", "unrolled-pure", "region", "region-module", "inner", "inner-noquery",
           "inner-step", "inner-step-eagerupdate")
EPS = 1e-5


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def conv_net(blocks: int, channels: int, n_way: int, size: int):
    """``benchmarks.meta.conv_net`` with ``blocks`` conv blocks (4 there)."""
    from torch import nn

    layers: list[nn.Module] = []
    c_in = 1
    for _ in range(blocks):
        layers += [nn.Conv2d(c_in, channels, 3, padding=1),
                   nn.BatchNorm2d(channels, eps=EPS, track_running_stats=False), nn.ReLU(),
                   nn.MaxPool2d(2)]
        c_in = channels
    side = size >> blocks
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * side * side, n_way))


def pure_conv(n_blocks: int):
    """Return ``model_fn(params, buffers, x)``: :func:`conv_net` as pure ops."""
    import torch
    import torch.nn.functional as F

    def model_fn(p, b, x):
        for i in range(n_blocks):
            c, n = 4 * i, 4 * i + 1
            x = F.conv2d(x, p[f"{c}.weight"], p[f"{c}.bias"], padding=1)
            mean = x.mean(dim=(0, 2, 3), keepdim=True)
            var = ((x - mean) ** 2).mean(dim=(0, 2, 3), keepdim=True)
            x = (x - mean) * torch.rsqrt(var + EPS)
            x = x * p[f"{n}.weight"].view(1, -1, 1, 1) + p[f"{n}.bias"].view(1, -1, 1, 1)
            x = F.max_pool2d(torch.relu(x), 2)
        head = 4 * n_blocks + 1
        return F.linear(x.flatten(1), p[f"{head}.weight"], p[f"{head}.bias"]), b

    return model_fn


def run_one(cfg: dict) -> dict:
    """Measure one (design, algo, inner_steps) in this process; return the record."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, HERE)
    from meta import make_tasks

    from torchfn.functional import StepOptions, apply_gradients, make_functional
    from torchfn.meta import _regions, fomaml, init_meta_state, make_meta_train_step, maml
    from torchfn.meta._inner_compile import InnerCompiledMetaGrad
    from torchfn.optim import adam, sgd

    torch.manual_seed(0)
    torch._dynamo.reset()
    dtype = getattr(torch, cfg["dtype"])
    design, steps = cfg["design"], cfg["steps"]
    net = conv_net(cfg["blocks"], cfg["channels"], cfg["way"], cfg["size"]).to(dtype)
    module_fn, params, buffers = make_functional(net)
    pure = design in ("unrolled-pure", "region")
    model_fn = pure_conv(cfg["blocks"]) if pure else module_fn
    tasks = make_tasks(cfg["tasks"], cfg["way"], cfg["shot"], cfg["query"], cfg["size"],
                       torch.device("cpu"), dtype)
    make = maml if cfg["algo"] == "maml" else fomaml
    _regions.SECOND_ORDER_REGIONS = True  # measured here, refused by the library by default
    learner = make(model_fn, F.cross_entropy, inner_steps=steps, inner_lr=0.1,
                   compile_regions=design.startswith("region"))
    ref, _, _ = learner.meta_grad(params, buffers, tasks)  # eager torch.func path

    kw = {"backend": cfg["backend"]}
    if design in ("inner", "inner-noquery"):
        meta_grad = (make_meta_train_step(learner, sgd(0.1), compile="inner",
                                          compile_kwargs=kw).meta_grad
                     if design == "inner" else
                     InnerCompiledMetaGrad(learner, kw, compile_query=False))

        def call():
            return meta_grad(params, buffers, tasks)[0]
    elif design.startswith("inner-step"):
        opt = adam(1e-3)
        state = init_meta_state(learner, params, buffers, opt)
        eager_step = make_meta_train_step(learner, opt, max_grad_norm=1.0)
        ref = eager_step(state, tasks)[0].params
        if design == "inner-step":
            step = make_meta_train_step(learner, opt, max_grad_norm=1.0, compile="inner",
                                        compile_kwargs=kw)
        else:
            meta_grad = InnerCompiledMetaGrad(learner, kw)
            options = StepOptions(max_grad_norm=1.0, where="benchmark")

            def step(st, t):
                g, loss, bufs = meta_grad(st.params, st.buffers, t)
                return apply_gradients(opt, g, st, options=options, loss=loss, buffers=bufs)

        def call():
            return step(state, tasks)[0].params
    else:
        torch._dynamo.config.trace_autograd_ops = design.startswith("region")
        compiled = torch.compile(learner.meta_grad, fullgraph=True, backend=cfg["backend"])

        def call():
            return compiled(params, buffers, tasks)[0]

    rec = dict(cfg)
    c0, w0 = _cpu_s(), time.perf_counter()
    try:
        out = call()
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return rec
    rec["compile_s"] = time.perf_counter() - w0
    rec["compile_cpu_s"] = _cpu_s() - c0
    times = []
    for _ in range(cfg["repeats"]):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    rec["step_ms"] = statistics.median(times) * 1e3
    rec["max_abs_diff"] = max(float((out[k] - ref[k]).abs().max()) for k in ref)
    rec["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--designs", default="unrolled,unrolled-pure,region,inner,inner-step")
    ap.add_argument("--algos", default="maml,fomaml")
    ap.add_argument("--steps", default="1,2,4,8")
    ap.add_argument("--channels", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2, help="conv blocks (4 in benchmarks/meta.py)")
    ap.add_argument("--size", type=int, default=14, help="image side (>= 2**blocks)")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--way", type=int, default=5)
    ap.add_argument("--shot", type=int, default=1)
    ap.add_argument("--query", type=int, default=2)
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--out", help="append each record as a JSON line to this file")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child mode: a JSON config
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))), flush=True)
        return
    designs = args.designs.split(",")
    bad = [d for d in designs if d not in DESIGNS]
    if bad:
        raise SystemExit(f"meta_compile_time.py --designs: unknown {bad}; known: {DESIGNS}")
    print(f"torch {__import__('torch').__version__}, CPU, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS')}, {args.blocks}-block conv net with "
          f"{args.channels} channels, {args.size}x"
          f"{args.size}, {args.tasks} tasks {args.way}-way {args.shot}-shot {args.query} "
          f"query/class, {args.dtype}")
    print(f"{'design':<14} {'algo':<7} {'K':>2} {'compile s':>9} {'cpu s':>7} {'step ms':>8} "
          f"{'graphs':>6} {'max|diff|':>9}")
    for algo in args.algos.split(","):
        for design in designs:
            for k in map(int, args.steps.split(",")):
                cfg = {"design": design, "algo": algo, "steps": k, "blocks": args.blocks,
                       "channels": args.channels,
                       "size": args.size, "tasks": args.tasks, "way": args.way,
                       "shot": args.shot, "query": args.query, "dtype": args.dtype,
                       "repeats": args.repeats, "backend": args.backend}
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp())
                proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)],
                                      env=env, capture_output=True, text=True, check=False)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                rec = (json.loads(lines[-1][7:]) if lines
                       else dict(cfg, error=(proc.stderr.strip().splitlines() or ["?"])[-1]))
                rec["bwd_variants_warned"] = "traced multiple backward graphs" in proc.stderr
                if "error" in rec:
                    print(f"{design:<14} {algo:<7} {k:>2} FAILED: {rec['error']}")
                else:
                    print(f"{design:<14} {algo:<7} {k:>2} {rec['compile_s']:>9.1f} "
                          f"{rec['compile_cpu_s']:>7.1f} {rec['step_ms']:>8.2f} "
                          f"{rec['graphs']:>6} {rec['max_abs_diff']:>9.1e}"
                          + ("  (region backward traced twice)" if rec["bwd_variants_warned"]
                             else ""), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
