"""Benchmark: N MLPs (784-256-256-10), batch 128 per member, Adam, one training step.

Side by side at N = 32 (``--members``): a loop of N models with ``torch.optim.Adam``, torchfn
eager, torchfn compiled (``torch.compile(fullgraph=True)``), torchfn compiled with CUDA graphs
(``mode="reduce-overhead"``, CUDA only), JAX ``jit(vmap)`` + optax (skipped with a message if
JAX is not importable) and, to show what Dynamo's guards cost per call, torchfn compiled with
only its tensor guards kept (``keep_tensor_guards_unsafe``: not for real use). Then the
scaling curve of step time vs N = 1, 2, 4, ..., 256 for torchfn compiled (a static compile per
N: ``vmap`` needs a concrete N), torchfn eager, JAX, and the loop for N <= 64, saved as a plot
and in the JSON.

Fairness: TF32 is OFF on both sides (torch: ``allow_tf32=False`` for matmul and cuDNN,
``float32_matmul_precision='highest'``; JAX: ``jax_default_matmul_precision='highest'``); the
same fixed batch on the device every step; JAX donates the params/optimizer state (its fastest
form). A "step time" is the mean over ``inner`` back-to-back steps followed by one device sync
(``inner`` chosen so a sample lasts >= 5 ms), median over ``--repeats`` samples, after a
warm-up of >= 3 steps; compile / jit time is the first call, reported separately, and the
number of Dynamo graphs compiled during the timed steps is recorded (must be 0). The whole
run stops starting new measurements after ``--budget`` seconds.

    python benchmarks/ensembles.py [--small] [--out results.json] [--plot scaling.png]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from typing import Any

import optree
import torch
from _bench import sync as sync_device
from _bench import time_calls
from torch import nn

from torchfn.compile import make_graphed_step
from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.ops import build_ops, ops_status
from torchfn.optim import stacked_adam, stacked_sgd

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def graphs() -> int:
    """Return the number of graphs Dynamo has compiled so far in this process."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def timeit(fn: Callable[[], object], wait: Callable[[], None], repeats: int,
           warmup: int = 3, min_sample_s: float = 5e-3) -> dict[str, Any]:
    """Return step-time stats of ``fn`` (seconds): first call, then ``repeats`` samples."""
    g0 = [0]

    def mark() -> None:
        g0[0] = graphs()

    t = time_calls(fn, wait=wait, warmup=warmup, repeats=repeats, min_sample_s=min_sample_s,
                   before_repeats=mark)
    return {"median": t.median_s, "p10": t.quantile_s(0.1), "p90": t.quantile_s(0.9),
            "first_call": t.first_call_s, "inner": t.inner,
            "graphs_compiled_while_timing": graphs() - g0[0]}


def make_net(sizes: list[int]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for i in range(len(sizes) - 1):
            layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
        return nn.Sequential(*layers[:-1])
    return build


def on_device(sizes: list[int], device: torch.device) -> Callable[[], nn.Module]:
    build = make_net(sizes)
    return lambda: build().to(device)

def batch_for(n: int, sizes: list[int], batch: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return (torch.randn(n, batch, sizes[0], generator=g).to(device),
            torch.randint(sizes[-1], (n, batch), generator=g).to(device))


def bench_loop(n: int, sizes: list[int], batch: int, device: torch.device, reps: int
               ) -> dict[str, Any]:
    torch.manual_seed(0)
    models = [make_net(sizes)().to(device) for _ in range(n)]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    x, y = batch_for(n, sizes, batch, device)

    def step() -> None:
        for i, (m, o) in enumerate(zip(models, opts, strict=True)):
            o.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(m(x[i]), y[i]).backward()
            o.step()
    return timeit(step, lambda: sync_device(device), reps)


class TorchfnStep:
    """The torchfn step for N members, eager or compiled: Adam with a per-member ``(N,)`` lr."""

    def __init__(self, sizes: list[int], device: torch.device, mode: str, n: int,
                 optimizer: str = "adam") -> None:
        # built on the device: a model_fn checks that params sit where its module was
        self.model_fn = Ensemble.from_seeds(on_device(sizes, device), seeds=[0]).model_fn
        lr = torch.full((n,), 1e-3, device=device)
        self.opt = stacked_adam(lr=lr) if optimizer == "adam" else stacked_sgd(lr=lr)
        # "graphed-nonorm": no grad_norm metric, i.e. the outputs JAX's step has (new params
        # and optimizer state; the loss is kept)
        # "noguard": the non-finite guard off (it is on by default), to see what it costs
        step = make_ensemble_train_step(self.model_fn, nn.functional.cross_entropy, self.opt,
                                        grad_norm="nonorm" not in mode,
                                        skip_nonfinite="noguard" not in mode)
        mode = mode.replace("-noguard", "")
        # "-reuse": Inductor's buffer reuse back on (torchfn steps switch it off, see
        # torchfn._checks.STEP_INDUCTOR_OPTIONS), to see what that costs a graphed step
        self.reuse = "-reuse" in mode
        mode = mode.replace("-reuse", "")
        self.plain_step = step
        self.mode = mode
        if mode == "compiled":
            step = torch.compile(step, fullgraph=True)
        elif mode == "reduce-overhead":
            step = torch.compile(step, fullgraph=True, mode="reduce-overhead")
        elif mode == "tensor-guards":
            # UNSAFE outside a benchmark: keeps only the guards on tensors, so a changed
            # Python attribute of the model would not trigger a recompile; shows what the
            # ~1,300 guards on the model/optimizer closures cost per call
            step = torch.compile(step, fullgraph=True, options={
                "guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe})
        self.step = step

    def bench(self, n: int, sizes: list[int], batch: int, device: torch.device, reps: int
              ) -> dict[str, Any]:
        run, holder, build_s = self.prepare(n, sizes, batch, device)
        out = timeit(run, lambda: sync_device(device), reps)
        if build_s is not None:
            out["first_call"] = build_s + out["first_call"]
        out["loss_finite"] = bool(torch.isfinite(
            holder[0].params[next(iter(holder[0].params))]).all())
        return out

    def prepare(self, n: int, sizes: list[int], batch: int, device: torch.device
                ) -> tuple[Callable[[], None], list[Any], float | None]:
        """Return ``(run, holder, build_s)``: ``run()`` does one step on ``holder[0]`` (the
        state, fed back); ``build_s`` is ``make_graphed_step``'s construction time (None for
        the other modes, whose first ``run()`` compiles)."""
        if self.mode != "eager":
            # a fresh compile: Dynamo would otherwise reuse another variant's cached graph
            torch._dynamo.reset()
        ens = Ensemble(self.model_fn,
                       Ensemble.from_seeds(on_device(sizes, device), seeds=range(n)).params, {})
        state = init_ensemble_state(ens, self.opt, seed=0)
        if self.mode == "reduce-overhead":
            # CUDA graphs are skipped for a graph with CPU ops: the step counter (a CPU tensor
            # by design, read by step_rng) goes to the GPU here; randomness="error" never
            # reads it inside the step
            state = optree.tree_map(lambda t: t.to(device), state)
        x, y = batch_for(n, sizes, batch, device)
        build_s = None
        if self.mode.startswith("graphed"):
            # torchfn.compile.make_graphed_step: compiled, captured as one CUDA graph, the
            # state donated (updated in place); construction compiles and captures
            t0 = time.perf_counter()
            # "-cdt": Inductor's coordinate-descent tuning of its kernels' launch configs
            options = {"coordinate_descent_tuning": True} if self.mode.endswith("-cdt") else {}
            if self.reuse:
                options["allow_buffer_reuse"] = True
            compile_kwargs = {"options": options} if options else True
            self.step = make_graphed_step(self.plain_step, state, (x, y), compile=compile_kwargs)
            sync_device(device)
            build_s = time.perf_counter() - t0
        holder = [state]
        mark = (torch.compiler.cudagraph_mark_step_begin if self.mode == "reduce-overhead"
                else None)

        def run() -> None:
            if mark is not None:
                # CUDA graphs: the outputs live in the graphs' pool, which the next replay
                # reuses, yet they are the next inputs -> clone the state (one extra copy)
                mark()
                holder[0] = optree.tree_map(torch.clone, self.step(holder[0], (x, y))[0])
            elif self.mode.endswith("-inputs"):
                # the batch already sits in the graph's input buffers (a loader writing into
                # step.inputs): no device copy per call, as JAX's jit gets its arrays
                holder[0], _ = self.step(holder[0], *self.step.inputs)
            else:
                holder[0], _ = self.step(holder[0], (x, y))
        return run, holder, build_s


class JaxStep:
    """JAX: ``jit(vmap(grad + optax.adam))`` with donated params/state, one jit per N."""

    def __init__(self) -> None:
        import jax
        import optax

        jax.config.update("jax_default_matmul_precision", "highest")
        self.jax, self.optax = jax, optax

    def versions(self) -> dict[str, Any]:
        import jaxlib

        return {"jax": self.jax.__version__, "jaxlib": jaxlib.__version__,
                "optax": self.optax.__version__,
                "jax_devices": [str(d) for d in self.jax.devices()],
                "jax_default_matmul_precision": str(
                    self.jax.config.jax_default_matmul_precision)}

    def bench(self, n: int, sizes: list[int], batch: int, reps: int) -> dict[str, Any]:
        run, wait = self.prepare(n, sizes, batch)
        return timeit(run, wait, reps)

    def prepare(self, n: int, sizes: list[int], batch: int, optimizer: str = "adam"
                ) -> tuple[Callable[[], None], Callable[[], None]]:
        """Return ``(run, wait)``: ``run()`` does one step (state fed back), ``wait()`` blocks
        until the last one is done. ``optimizer``: ``"adam"`` or ``"sgd"`` (optax, lr 1e-3)."""
        jax, optax = self.jax, self.optax

        def init(key: Any) -> list[tuple[Any, Any]]:
            params = []
            for i in range(len(sizes) - 1):
                key, k1, k2 = jax.random.split(key, 3)
                bound = 1.0 / sizes[i] ** 0.5
                params.append((jax.random.uniform(k1, (sizes[i], sizes[i + 1]), minval=-bound,
                                                  maxval=bound),
                               jax.random.uniform(k2, (sizes[i + 1],), minval=-bound,
                                                  maxval=bound)))
            return params

        def loss(params: list, x: Any, y: Any) -> Any:
            h = x
            for i, (wt, b) in enumerate(params):
                h = h @ wt + b
                if i < len(params) - 1:
                    h = jax.nn.relu(h)
            return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

        tx = optax.adam(1e-3) if optimizer == "adam" else optax.sgd(1e-3)
        params = jax.vmap(init)(jax.random.split(jax.random.PRNGKey(0), n))
        opt_state = jax.vmap(tx.init)(params)

        def one(p: list, s: Any, x: Any, y: Any) -> tuple:
            g = jax.grad(loss)(p, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(jax.vmap(one), donate_argnums=(0, 1))
        x = jax.random.normal(jax.random.PRNGKey(1), (n, batch, sizes[0]))
        y = jax.random.randint(jax.random.PRNGKey(2), (n, batch), 0, sizes[-1])
        holder = [(params, opt_state)]

        def run() -> None:
            holder[0] = step(*holder[0], x, y)
        return run, lambda: jax.block_until_ready(holder[0])


def guarded(name: str, budget: float, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | str:
    """Run one measurement unless the time budget is spent; errors become strings."""
    if elapsed() > budget:
        return "skipped: time budget spent"
    try:
        out = fn()
    except Exception as exc:
        msg = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(f"  {name}: {msg}", flush=True)
        return msg
    print(f"  {name}: {out['median'] * 1e3:.3f} ms/step (first call {out['first_call']:.2f} s,"
          f" inner {out['inner']}, graphs compiled while timing "
          f"{out['graphs_compiled_while_timing']})  [{elapsed():.0f} s]", flush=True)
    return out


def ms(v: Any) -> str:
    return f"{v['median'] * 1e3:.3f}" if isinstance(v, dict) else str(v)


def plot(results: dict[str, Any], path: str) -> None:
    """Save the scaling curves of ``results`` (this script's JSON) as a log-log plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (make it later with --plot-from RESULTS.json)")
        return
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, curve in results["scaling"].items():
        pts = [(int(k), v["median"] * 1e3) for k, v in curve.items() if isinstance(v, dict)]
        if pts:
            ax.loglog(*zip(*sorted(pts), strict=True), "o-", label=name)
    sizes = results["sizes"]
    ax.set_xscale("log", base=2)
    ax.set(xlabel="members N", ylabel="step time (ms)",
           title=f"{'-'.join(map(str, sizes))} MLP, batch {results['batch']}/member, Adam, "
                 f"{results.get('gpu', results['device'])}, TF32 off")
    ax.title.set_fontsize(8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny CPU smoke test")
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--plot", default="ensembles_scaling.png")
    parser.add_argument("--members", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--budget", type=float, default=200.0,
                        help="seconds after which no new measurement starts")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip the plain compiled variant (its first compile is slow)")
    parser.add_argument("--no-reduce-overhead", action="store_true",
                        help="skip the mode='reduce-overhead' variant")
    parser.add_argument("--no-tensor-guards", action="store_true",
                        help="skip the tensor-guards-only variant")
    parser.add_argument("--graphed", default="graphed,graphed-nonorm",
                        help="make_graphed_step variants of the side-by-side run: graphed "
                             "(grad_norm metric), graphed-nonorm, graphed-nonorm-cdt "
                             "(coordinate-descent tuning), graphed-nonorm-inputs (the batch "
                             "passed as the graph's own input buffers: no copy per call); a -reuse "
                             "suffix turns Inductor's buffer reuse back on")
    parser.add_argument("--curve", default="graphed-nonorm",
                        choices=("graphed", "graphed-nonorm", "graphed-nonorm-inputs", "compiled"),
                        help="torchfn variant of the scaling curve (one compile per N)")
    parser.add_argument("--ns", default=None,
                        help="scaling N values, comma-separated (default 1,2,4,...,256)")
    parser.add_argument("--plot-from", default=None, metavar="RESULTS_JSON",
                        help="only redraw the plot from a results file of this script")
    args = parser.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.load(f), args.plot)
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if args.small:
        sizes, batch, n, reps, ns, loop_max = [32, 16, 16, 10], 8, 4, 5, [1, 2, 4, 8], 8
    else:
        sizes, batch, n, reps = [784, 256, 256, 10], 128, args.members, args.repeats
        ns, loop_max = [1, 2, 4, 8, 16, 32, 64, 128, 256], 64
    if args.ns:
        ns = sorted({int(v) for v in args.ns.split(",")})
    results: dict[str, Any] = {
        "device": str(device), "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "sizes": sizes, "batch": batch, "n_members": n,
        "repeats": reps, "cpu_threads": torch.get_num_threads(),
        "tf32": {"torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                 "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                 "float32_matmul_precision": torch.get_float32_matmul_precision()}}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
        results["cuda"] = torch.version.cuda
    t = time.perf_counter()
    results["ops_build"] = {k: v for k, v in build_ops().items() if k != "log"}
    results["ops_build"]["wall_seconds"] = time.perf_counter() - t
    results["ops_status"] = ops_status()
    results["optimizer_dispatch"] = (
        "stacked_adam: the fused kernel in eager (one launch for all leaves) where it is built; "
        "its pure-PyTorch twin under torch.compile (Inductor fuses it; no graph break)")
    jax_step: JaxStep | None = None
    if args.no_jax:
        results["jax"] = "skipped: --no-jax"
    else:
        try:
            jax_step = JaxStep()
            results["jax"] = jax_step.versions()
        except ImportError as exc:
            results["jax"] = f"skipped: {exc}"
    print(json.dumps({k: v for k, v in results.items() if k != "ops_status"}, default=str),
          flush=True)
    print("TF32 off on both sides (torch allow_tf32=False, cudnn allow_tf32=False, "
          "float32_matmul_precision='highest'; JAX jax_default_matmul_precision='highest')")
    budget = args.budget

    for name in ("recompile_limit", "cache_size_limit"):  # 9 N values = 9 graphs of one frame
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    steps = {m: TorchfnStep(sizes, device, m, n) for m in ("eager", "compiled")
             if not (m == "compiled" and args.no_compiled)}
    side: dict[str, Any] = {}
    print(f"== side by side: N={n}, sizes={sizes}, batch={batch}", flush=True)
    side["torch_optim_loop"] = guarded("torch.optim loop", budget,
                                       lambda: bench_loop(n, sizes, batch, device, reps))
    for m, s in steps.items():
        side[f"torchfn_{m}"] = guarded(f"torchfn {m}", budget,
                                       lambda s=s: s.bench(n, sizes, batch, device, reps))
    for mode in args.graphed.split(","):
        gr = TorchfnStep(sizes, device, mode, n)  # "-noguard" suffix: guard off
        side[f"torchfn_{mode.replace('-', '_')}"] = guarded(
            f"torchfn make_graphed_step ({mode})", budget,
            lambda gr=gr: gr.bench(n, sizes, batch, device, reps))
    if device.type == "cuda" and not args.no_reduce_overhead:
        ro = TorchfnStep(sizes, device, "reduce-overhead", n)
        side["torchfn_compiled_cudagraphs"] = guarded(
            "torchfn compiled reduce-overhead", budget,
            lambda: ro.bench(n, sizes, batch, device, reps))
    if jax_step is not None:
        side["jax_vmap_optax"] = guarded("jax jit(vmap)+optax", budget,
                                         lambda: jax_step.bench(n, sizes, batch, reps))
    if hasattr(torch.compiler, "keep_tensor_guards_unsafe") and not args.no_tensor_guards:
        tg = TorchfnStep(sizes, device, "tensor-guards", n)
        side["torchfn_compiled_tensor_guards_only"] = guarded(
            "torchfn compiled, tensor guards only (unsafe)", budget,
            lambda: tg.bench(n, sizes, batch, device, reps))
    results["side_by_side"] = side

    print(f"== scaling (torchfn {args.curve}: a fresh static compile per N; N=" + str(n)
          + " is the side-by-side run)", flush=True)
    curve = f"torchfn_{args.curve.replace('-', '_')}"
    scaling: dict[str, dict[int, Any]] = {curve: {}, "torchfn_eager": {},
                                          "jax_vmap_optax": {}, "torch_optim_loop": {}}
    # the cheap curves first, then one compile per N, in an order that keeps the curve's ends
    # if the budget runs out (vmap needs a concrete N, so every N is its own graph)
    for k in ns:
        print(f" N={k}", flush=True)
        scaling["torchfn_eager"][k] = guarded(
            "torchfn eager", budget, lambda k=k: TorchfnStep(sizes, device, "eager", k).bench(
                k, sizes, batch, device, reps))
        if jax_step is not None:
            scaling["jax_vmap_optax"][k] = (side["jax_vmap_optax"] if k == n else guarded(
                "jax", budget, lambda k=k: jax_step.bench(k, sizes, batch, reps)))
        if k <= loop_max:
            scaling["torch_optim_loop"][k] = (side["torch_optim_loop"] if k == n else guarded(
                "torch.optim loop", budget, lambda k=k: bench_loop(k, sizes, batch, device,
                                                                   reps)))
    order = sorted(ns, key=lambda k: (k not in (ns[0], ns[-1]), abs(math.log2(k / n))))
    for k in order:
        if k == n:
            scaling[curve][k] = side[curve]
            continue
        print(f" N={k}", flush=True)
        fresh = TorchfnStep(sizes, device, args.curve, k)
        scaling[curve][k] = guarded(
            f"torchfn {args.curve}", budget, lambda k=k, f=fresh: f.bench(k, sizes, batch, device,
                                                                     reps))
    scaling = {name: dict(sorted(c.items())) for name, c in scaling.items()}
    results["scaling"] = scaling
    results["wall_seconds"] = elapsed()

    loop = side.get("torch_optim_loop")
    jx = side.get("jax_vmap_optax")
    print(f"\n{'variant (N=' + str(n) + ')':<40}{'median ms/step':>16}{'vs loop':>10}"
          f"{'vs JAX':>10}{'first call s':>14}")
    for name, v in side.items():
        row = f"{name:<40}{ms(v):>16}"
        if isinstance(v, dict):
            row += (f"{loop['median'] / v['median']:>9.1f}x" if isinstance(loop, dict)
                    else f"{'-':>10}")
            row += (f"{jx['median'] / v['median']:>9.2f}x" if isinstance(jx, dict)
                    else f"{'-':>10}")
            row += f"{v['first_call']:>14.2f}"
        print(row)
    goals = {}
    for variant in ("compiled", "graphed", "graphed_nonorm", "graphed_nonorm_inputs"):
        comp = side.get(f"torchfn_{variant}")
        if isinstance(comp, dict) and isinstance(loop, dict):
            goals[f"{variant}_vs_loop_speedup"] = loop["median"] / comp["median"]
            goals[f"{variant}_at_least_50x_loop"] = goals[f"{variant}_vs_loop_speedup"] >= 50
        if isinstance(comp, dict) and isinstance(jx, dict):
            goals[f"jax_over_{variant}_time_ratio"] = jx["median"] / comp["median"]
            goals[f"{variant}_at_least_as_fast_as_jax"] = comp["median"] <= jx["median"]
    eager = side.get("torchfn_eager")
    if isinstance(eager, dict) and isinstance(loop, dict):
        goals["eager_vs_loop_speedup"] = loop["median"] / eager["median"]
    results["goals"] = goals
    print("goals:", json.dumps(goals))
    print("\nscaling, median ms/step:")
    print(f"{'N':>5}" + "".join(f"{name:>20}" for name in scaling))
    for k in ns:
        print(f"{k:>5}" + "".join(f"{ms(scaling[name].get(k, '-')):>20}" for name in scaling))
    print(f"wall {results['wall_seconds']:.0f} s")

    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"results written to {args.out}")
    plot(results, args.plot)

if __name__ == "__main__":
    main()
