"""Benchmark: N MLPs (784-256-256-10), batch 128 per member, Adam, one training step.

Side by side: a loop of N torch.optim models, torchfn eager, torchfn compiled, and JAX vmap +
optax (skipped with a message if JAX is not importable); then the scaling curve of step time vs
N (torchfn compiled, 1..256), saved as a plot. Median of many synchronized repeats; TF32 state
printed. ``--small`` is a quick CPU smoke test (tiny sizes, few repeats).

    python benchmarks/ensembles.py [--small] [--out results.json] [--plot scaling.png]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from torchfn.ensembles._build import Ensemble
from torchfn.ensembles._train import init_ensemble_state, make_ensemble_train_step
from torchfn.ops import stacked_adam


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Return the median seconds of ``fn()`` over ``repeats`` synchronized calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_net(sizes: list[int]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for i in range(len(sizes) - 1):
            layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
        return nn.Sequential(*layers[:-1])
    return build


def bench_loop(n: int, sizes: list[int], batch: int, device: torch.device, w: int, r: int
               ) -> float:
    models = [make_net(sizes)().to(device) for _ in range(n)]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    x = torch.randn(n, batch, sizes[0], device=device)
    y = torch.randint(sizes[-1], (n, batch), device=device)

    def step() -> None:
        for i, (m, o) in enumerate(zip(models, opts, strict=True)):
            o.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(m(x[i]), y[i]).backward()
            o.step()
    return timeit(step, device, w, r)


def bench_torchfn(n: int, sizes: list[int], batch: int, device: torch.device, w: int, r: int,
                  compiled: bool) -> float:
    ens = Ensemble.from_seeds(make_net(sizes), seeds=range(n))
    ens.params = {k: v.to(device) for k, v in ens.params.items()}
    opt = stacked_adam(lr=torch.full((n,), 1e-3, device=device))
    holder = [init_ensemble_state(ens, opt, seed=0)]
    step = make_ensemble_train_step(ens.model_fn, nn.functional.cross_entropy, opt)
    if compiled:
        step = torch.compile(step, fullgraph=True)
    x = torch.randn(n, batch, sizes[0], device=device)
    y = torch.randint(sizes[-1], (n, batch), device=device)

    def run() -> None:
        holder[0], _ = step(holder[0], (x, y))
    return timeit(run, device, w, r)


def bench_jax(n: int, sizes: list[int], batch: int, w: int, r: int) -> float | str:
    try:
        import jax
        import optax
    except ImportError as exc:
        return f"skipped: {exc}"

    def init(key: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        params = []
        for i in range(len(sizes) - 1):
            key, k1, k2 = jax.random.split(key, 3)
            bound = 1.0 / sizes[i] ** 0.5
            params.append((jax.random.uniform(k1, (sizes[i], sizes[i + 1]), minval=-bound,
                                              maxval=bound),
                           jax.random.uniform(k2, (sizes[i + 1],), minval=-bound, maxval=bound)))
        return params

    def loss(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
        h = x
        for i, (wt, b) in enumerate(params):
            h = h @ wt + b
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    tx = optax.adam(1e-3)
    params = jax.vmap(init)(jax.random.split(jax.random.PRNGKey(0), n))
    opt_state = jax.vmap(tx.init)(params)

    def one(p: list, s: optax.OptState, x: jax.Array, y: jax.Array) -> tuple:
        g = jax.grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.vmap(one))
    x = jax.random.normal(jax.random.PRNGKey(1), (n, batch, sizes[0]))
    y = jax.random.randint(jax.random.PRNGKey(2), (n, batch), 0, sizes[-1])
    holder = [(params, opt_state)]

    def run() -> None:
        holder[0] = step(*holder[0], x, y)
        jax.block_until_ready(holder[0])
    return timeit(run, torch.device("cpu"), w, r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny CPU smoke test")
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--plot", default="ensembles_scaling.png")
    parser.add_argument("--members", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.small:
        sizes, batch, n, reps, warm, ns = [32, 16, 16, 10], 8, 4, 5, 2, [1, 2, 4, 8]
    else:
        sizes, batch, n, reps, warm = [784, 256, 256, 10], 128, args.members, args.repeats, 10
        ns = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    tf32 = {"matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
    print(f"device={device} torch={torch.__version__} tf32={tf32} sizes={sizes} batch={batch} "
          f"N={n} repeats={reps}")
    results: dict[str, object] = {"device": str(device), "torch": torch.__version__,
                                  "platform": platform.platform(), "tf32": tf32, "sizes": sizes,
                                  "batch": batch, "n_members": n, "repeats": reps}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    side: dict[str, float | str] = {
        "torch_optim_loop": bench_loop(n, sizes, batch, device, warm, reps),
        "torchfn_eager": bench_torchfn(n, sizes, batch, device, warm, reps, compiled=False),
        "torchfn_compiled": bench_torchfn(n, sizes, batch, device, warm, reps, compiled=True),
        "jax_vmap_optax": bench_jax(n, sizes, batch, warm, reps),
    }
    results["step_seconds"] = side
    loop = side["torch_optim_loop"]
    print(f"{'variant':<20}{'median step (ms)':>18}{'vs loop':>10}")
    for name, t in side.items():
        if isinstance(t, str):
            print(f"{name:<20}{t:>18}")
        else:
            assert isinstance(loop, float)
            print(f"{name:<20}{t * 1e3:>18.3f}{loop / t:>9.1f}x")
    scaling = {}
    for k in ns:
        torch._dynamo.reset()
        scaling[k] = bench_torchfn(k, sizes, batch, device, warm, reps, compiled=True)
        print(f"N={k:<4} torchfn compiled step {scaling[k] * 1e3:.3f} ms")
    results["scaling_compiled_seconds"] = scaling
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 4))
        ax.loglog(list(scaling), [v * 1e3 for v in scaling.values()], "o-",
                  label="torchfn compiled")
        ax.set(xlabel="members N", ylabel="step time (ms)", title=f"{sizes}, batch {batch}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot saved to {args.plot}")
    except ImportError:
        print("matplotlib not installed: no plot")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
