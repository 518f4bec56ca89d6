"""Sweep: torchfn's default steps vs JAX over six configs per workload family, one command.

Families (``--families``, default all three) and their configs (``--configs``: names or
0-based indices within each family, default all; ``--list`` prints them):

- ``maml``: second-order MAML outer step of the 4-block conv net of ``benchmarks/meta.py``
  (BatchNorm per task, 28x28x1, 15 queries per class, 32 tasks), inner SGD lr 0.01, outer
  Adam 1e-3; ways / shots / channels / inner steps vary.
- ``ensembles``: one train step of N MLPs (``benchmarks/ensembles.py``), batch 128 per member;
  members / widths / optimizer (Adam or SGD, lr 1e-3) vary.
- ``dp``: one DP-SGD step (noise multiplier 1, clipping norm 1, SGD lr 0.01; the models of
  ``benchmarks/persample.py`` and an MLP); model family and batch size vary.

Each side is what a user gets with DEFAULT options (the recipe is recorded per row):

- torchfn MAML: ``torch.compile(make_meta_train_step(maml(model_fn, F.cross_entropy,
  inner_lr, inner_steps), adam(1e-3)), fullgraph=True)`` as the docs' first example, on the
  plain ``nn.Conv2d`` model (the learner's default ``unfold_convs="auto"`` computes the adapted
  convs with a patch >= 64 as unfold + matmul inside the compiled graph on CUDA by itself);
- torchfn ensembles: ``make_graphed_step(make_ensemble_train_step(model_fn, cross_entropy,
  stacked_adam / stacked_sgd), state, (x, y))``, every option at its default;
- torchfn DP-SGD: ``make_graphed_step(make_dp_train_step(make_ghost_model(net)...), ...)``,
  defaults (flat clipping, ghost norms, counter-based noise, non-finite guard);
- JAX: ``jax.jit`` of the same program (params/optimizer state donated): MAML via
  ``benchmarks/meta_jax.py``'s meta-loss + optax Adam, ensembles via ``benchmarks/ensembles.py``'s
  ``vmap`` + optax, DP-SGD as ``vmap(value_and_grad)`` per-example gradients, flat clipping,
  Gaussian noise, SGD (``benchmarks/persample.py``'s CNN in ``jax.lax``, an MLP and the
  transformer written here). MAML and DP use the torch weights and batch; ensembles JAX's own
  init (same shapes).

Precision: fp32 with TF32 off on both sides (torch ``allow_tf32=False`` for matmul and cuDNN;
JAX ``jax_default_matmul_precision='highest'`` and ``Precision.HIGHEST`` per op).

How it runs: every (config, side) is its own process (the frameworks never share one). Phase
1 starts up to ``--jobs`` of them at once; each builds its step and makes the first call (the
compile: "first call s", measured while others compile too, so it is an upper bound), then
waits. Phase 2 lets them time one at a time (nothing else runs on the device): ``--warmup``
calls, then the median of ``--repeats`` synchronized repeats (``benchmarks/_bench.time_calls``,
repeats of at least 5 ms). Peak memory: torch's CUDA peak over the timed calls; JAX's
``peak_bytes_in_use`` of its process. ``--budget-s``: a config whose estimated compile no
longer fits is not started, one still compiling when the time left is needed for timing is
killed, and one not timed before the budget ends is not timed: each recorded as skipped. A
first call that runs out of GPU memory beside the others compiling (their compiles and JAX's
pools can fill the device together) is started once more when nothing else compiles.

Writes ``--out`` JSON, ``--md`` (table: torchfn ms, JAX ms, JAX / torchfn, first call both
sides, peak memory both sides) and ``--plot`` (ratio per config; needs matplotlib, else a
message). ``--merge a.json b.json`` combines runs (e.g. one per family) into one table/plot.

    python benchmarks/sweep.py --out sweep.json --md sweep.md --plot sweep.png
    python benchmarks/sweep.py --families maml --configs 0,5 --budget-s 400
    python benchmarks/sweep.py --small --no-jax            # CPU smoke (eager torchfn steps)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _path in (str(HERE.parent), str(HERE)):  # this repository's torchfn and the benchmarks
    if _path not in sys.path:
        sys.path.insert(0, _path)
FAMILIES = ("maml", "ensembles", "dp")
SIDES = ("torchfn", "jax")
INNER_LR, OUTER_LR, ENS_BATCH = 0.01, 1e-3, 128
MAML_QUERY, MAML_TASKS, MAML_SIZE = 15, 32, 28

# estimated compile seconds on an H100 host (cold caches): the launch order (longest first)
# and the budget check; MAML grows with the unrolled inner steps (meta-h100.md: K=5, 160-300 s)
CONFIGS: dict[str, list[dict[str, Any]]] = {
    "maml": [
        {"name": "5w1s-c32-k1", "ways": 5, "shots": 1, "channels": 32, "steps": 1},
        {"name": "5w5s-c32-k1", "ways": 5, "shots": 5, "channels": 32, "steps": 1},
        {"name": "5w1s-c64-k3", "ways": 5, "shots": 1, "channels": 64, "steps": 3},
        {"name": "5w5s-c64-k3", "ways": 5, "shots": 5, "channels": 64, "steps": 3},
        {"name": "20w1s-c64-k3", "ways": 20, "shots": 1, "channels": 64, "steps": 3},
        {"name": "5w1s-c64-k5", "ways": 5, "shots": 1, "channels": 64, "steps": 5},
    ],
    "ensembles": [
        {"name": "n8-w256-adam", "members": 8, "width": 256, "optimizer": "adam"},
        {"name": "n32-w256-adam", "members": 32, "width": 256, "optimizer": "adam"},
        {"name": "n32-w256-sgd", "members": 32, "width": 256, "optimizer": "sgd"},
        {"name": "n8-w1024-sgd", "members": 8, "width": 1024, "optimizer": "sgd"},
        {"name": "n32-w1024-adam", "members": 32, "width": 1024, "optimizer": "adam"},
        {"name": "n128-w256-adam", "members": 128, "width": 256, "optimizer": "adam"},
    ],
    "dp": [
        {"name": "mlp-b256", "model": "mlp", "batch": 256, "kw": {"sizes": [784, 512, 512, 10]}},
        {"name": "mlp-b1024", "model": "mlp", "batch": 1024,
         "kw": {"sizes": [784, 512, 512, 10]}},
        {"name": "cnn-b64", "model": "cnn", "batch": 64, "kw": {}},
        {"name": "cnn-b256", "model": "cnn", "batch": 256, "kw": {}},
        {"name": "tfm2-d128-b32", "model": "transformer", "batch": 32,
         "kw": {"vocab": 4096, "seq": 64, "d": 128, "heads": 4, "ff": 512, "layers": 2}},
        {"name": "tfm4-d256-b64", "model": "transformer", "batch": 64,
         "kw": {"vocab": 8192, "seq": 128, "d": 256, "heads": 4, "ff": 1024, "layers": 4}},
    ],
}


def estimate_s(family: str, cfg: dict[str, Any], side: str) -> float:
    """Rough first-call seconds (compile, cold caches, H100 host) of one (config, side)."""
    if side == "jax":
        return 15.0 + (8.0 * cfg["steps"] if family == "maml" else 0.0)
    if family == "maml":
        return 40.0 + 45.0 * cfg["steps"]
    if family == "ensembles":
        return 60.0
    return {"mlp": 40.0, "cnn": 60.0, "transformer": 90.0}[cfg["model"]]


def shrink(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``--small``: the same config at CPU smoke-test sizes."""
    c = json.loads(json.dumps(cfg))
    if family == "maml":
        c.update(channels=4, tasks=2, query=2, size=16)
    elif family == "ensembles":
        c.update(members=min(c["members"], 4), width=max(8, c["width"] // 32), batch=8,
                 inputs=32)
    elif c["model"] == "mlp":
        c.update(batch=8, kw={"sizes": [32, 16, 16, 10]})
    elif c["model"] == "cnn":
        c.update(batch=8, kw={"c1": 4, "c2": 8, "hidden": 16})
    else:
        c.update(batch=4, kw={"vocab": 50, "seq": 16, "d": 16, "heads": 2, "ff": 32, "layers": 2})
    return c


def get_config(family: str, name: str, small: bool) -> dict[str, Any]:
    for cfg in CONFIGS[family]:
        if cfg["name"] == name:
            return shrink(family, cfg) if small else dict(cfg)
    raise SystemExit(f"sweep.py: no config {name!r} in family {family!r} "
                     f"(known: {[c['name'] for c in CONFIGS[family]]})")


# --- the child: one (config, side) in its own process ---------------------------------------


class Prepared:
    """A built step: ``run()`` does one step (state fed back) and returns the loss or None;
    ``wait()`` blocks until the device is done; ``recipe`` says how it was built."""

    def __init__(self, run: Callable[[], Any], wait: Callable[[], None], recipe: str,
                 device: str) -> None:
        self.run, self.wait, self.recipe, self.device = run, wait, recipe, device


def torch_device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def maml_data(cfg: dict[str, Any], device: Any) -> tuple[Any, Any]:
    """The conv net (seeded, built on the CPU) and the task batch of a MAML config."""
    import torch
    from meta import conv_net, make_tasks

    torch.manual_seed(0)
    size = cfg.get("size", MAML_SIZE)
    module = conv_net(cfg["channels"], cfg["ways"], size).to(device)
    tasks = make_tasks(cfg.get("tasks", MAML_TASKS), cfg["ways"], cfg["shots"],
                       cfg.get("query", MAML_QUERY), size, device, torch.float32)
    return module, tasks


def dp_data(cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The DP config's model, inputs and labels, seeded and built on the CPU."""
    import torch
    from ensembles import make_net
    from persample import build

    if cfg["model"] != "mlp":
        return build(cfg["model"], {"batch": cfg["batch"], "kw": cfg["kw"]}, torch.device("cpu"))
    torch.manual_seed(0)
    sizes = cfg["kw"]["sizes"]
    model = make_net(sizes)()
    return (model, torch.randn(cfg["batch"], sizes[0]),
            torch.randint(0, sizes[-1], (cfg["batch"],)))


def torch_maml(cfg: dict[str, Any], compile_on: bool) -> Prepared:
    import torch
    import torch.nn.functional as F

    from torchfn.functional import make_functional
    from torchfn.meta import init_meta_state, make_meta_train_step, maml
    from torchfn.optim import adam

    device = torch_device()
    module, tasks = maml_data(cfg, device)
    model_fn, params, buffers = make_functional(module)  # no knobs: unfold_convs="auto"
    learner = maml(model_fn, F.cross_entropy, inner_lr=INNER_LR, inner_steps=cfg["steps"])
    opt = adam(OUTER_LR)
    state = init_meta_state(learner, params, buffers, opt)
    step = make_meta_train_step(learner, opt)
    recipe = "make_meta_train_step(maml(...), adam)"
    if compile_on:
        step = torch.compile(step, fullgraph=True)
        recipe = f"torch.compile({recipe}, fullgraph=True)"
    holder = [state]

    def run() -> Any:
        holder[0], metrics = step(holder[0], tasks)
        return metrics["loss"]

    return Prepared(run, lambda: sync(device), recipe, str(device))


def torch_ensembles(cfg: dict[str, Any], compile_on: bool) -> Prepared:
    from ensembles import TorchfnStep

    device = torch_device()
    sizes = [cfg.get("inputs", 784), cfg["width"], cfg["width"], 10]
    n, batch = cfg["members"], cfg.get("batch", ENS_BATCH)
    mode = "graphed" if compile_on else "eager"
    s = TorchfnStep(sizes, device, mode, n, cfg["optimizer"])
    run, _, _ = s.prepare(n, sizes, batch, device)  # graphed: this compiles and captures
    opt = f"stacked_{cfg['optimizer']}"
    recipe = (f"make_graphed_step(make_ensemble_train_step(..., {opt}), state, (x, y))"
              if compile_on else f"make_ensemble_train_step(..., {opt}) (eager)")
    return Prepared(run, lambda: sync(device), recipe, str(device))


def torch_dp(cfg: dict[str, Any], compile_on: bool) -> Prepared:
    from persample import v_dpsgd

    device = torch_device()
    model, x, y = dp_data(cfg)
    step = v_dpsgd(model.to(device), x.to(device), y.to(device),
                   "graphed" if compile_on else "eager")
    recipe = ("make_graphed_step(make_dp_train_step(make_ghost_model(net), ...), ...)"
              if compile_on else "make_dp_train_step(make_ghost_model(net), ...) (eager)")
    return Prepared(lambda: step()["loss"], lambda: sync(device), recipe, str(device))


def sync(device: Any) -> None:
    from _bench import sync as bench_sync

    bench_sync(device)


def jax_setup() -> tuple[Any, Any]:
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    return jax, jax.lax.Precision.HIGHEST


def to_jax(tensors: dict[str, Any]) -> dict[str, Any]:
    import jax.numpy as jnp

    return {k: jnp.asarray(v.detach().cpu().numpy()) for k, v in tensors.items()}


def jax_maml(cfg: dict[str, Any]) -> Prepared:
    import torch

    jax, prec = jax_setup()
    import optax
    from meta import EPS
    from meta_jax import make_meta_loss

    module, tasks = maml_data(cfg, torch.device("cpu"))
    params = to_jax(dict(module.named_parameters()))
    data = list(to_jax(tasks._asdict()).values())
    meta_loss = make_meta_loss(n_blocks=4, eps=EPS, inner_lr=INNER_LR,
                               inner_steps=cfg["steps"], precision=prec)
    tx = optax.adam(OUTER_LR)

    def step(p: Any, s: Any, *batch: Any) -> tuple[Any, Any, Any]:
        loss, g = jax.value_and_grad(meta_loss)(p, *batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    jstep = jax.jit(step, donate_argnums=(0, 1))
    holder = [(params, tx.init(params))]

    def run() -> Any:
        p, s, loss = jstep(*holder[0], *data)
        holder[0] = (p, s)
        return loss

    return Prepared(run, lambda: jax.block_until_ready(holder[0]),
                    "jit(value_and_grad(meta_jax.make_meta_loss) + optax.adam), donated",
                    str(jax.devices()[0]))


def jax_ensembles(cfg: dict[str, Any]) -> Prepared:
    from ensembles import JaxStep

    js = JaxStep()
    sizes = [cfg.get("inputs", 784), cfg["width"], cfg["width"], 10]
    run, wait = js.prepare(cfg["members"], sizes, cfg.get("batch", ENS_BATCH), cfg["optimizer"])
    return Prepared(run, wait, f"jit(vmap(grad + optax.{cfg['optimizer']})), donated",
                    str(js.jax.devices()[0]))


def jax_dp_loss(cfg: dict[str, Any], prec: Any) -> Callable[[Any, Any, Any], Any]:
    """The one-example loss ``loss(p, xi, yi)`` of a DP config's model in JAX, ``p`` keyed
    like the torch ``state_dict`` (same math as the torch module)."""
    import jax
    import jax.numpy as jnp

    def lin(p: Any, name: str, h: Any) -> Any:
        return jnp.matmul(h, p[name + ".weight"].T, precision=prec) + p[name + ".bias"]

    def xent(logits: Any, yi: Any) -> Any:
        return -jax.nn.log_softmax(logits)[yi]

    if cfg["model"] == "cnn":
        from persample import jax_cnn_loss

        return jax_cnn_loss(prec)
    if cfg["model"] == "mlp":
        n = len(cfg["kw"]["sizes"]) - 1

        def mlp(p: Any, xi: Any, yi: Any) -> Any:
            h = xi
            for i in range(n):
                h = lin(p, str(2 * i), h)
                h = jax.nn.relu(h) if i < n - 1 else h
            return xent(h, yi)

        return mlp
    heads, layers = cfg["kw"]["heads"], cfg["kw"]["layers"]

    def ln(p: Any, name: str, h: Any) -> Any:
        mu = h.mean(-1, keepdims=True)
        var = ((h - mu) ** 2).mean(-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]

    def transformer(p: Any, ids: Any, yi: Any) -> Any:
        t, d = ids.shape[0], p["tok.weight"].shape[1]
        h = p["tok.weight"][ids] + p["pos.weight"][:t]
        for i in range(layers):
            b = f"blocks.{i}."
            q, k, v = (a.reshape(t, heads, -1).transpose(1, 0, 2)
                       for a in jnp.split(lin(p, b + "qkv", ln(p, b + "ln1", h)), 3, axis=-1))
            s = jnp.matmul(q, k.transpose(0, 2, 1), precision=prec) / (d // heads) ** 0.5
            a = jnp.matmul(jax.nn.softmax(s, axis=-1), v, precision=prec)
            h = h + lin(p, b + "proj", a.transpose(1, 0, 2).reshape(t, d))
            h = h + lin(p, b + "fc2", jax.nn.gelu(lin(p, b + "fc1", ln(p, b + "ln2", h)),
                                                  approximate=False))
        return xent(lin(p, "head", ln(p, "ln", h).mean(0)), yi)

    return transformer


def jax_dp(cfg: dict[str, Any]) -> Prepared:
    from persample import CLIP, LR, SIGMA

    jax, prec = jax_setup()
    import jax.numpy as jnp

    model, x, y = dp_data(cfg)
    params = to_jax(model.state_dict())
    xs, ys = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    valid = jnp.ones(x.shape[0], dtype=jnp.float32)
    loss = jax_dp_loss(cfg, prec)
    batch = x.shape[0]  # the expected batch size q * N of the torch step

    def step(p: Any, t: Any, xb: Any, yb: Any, mask: Any) -> tuple[Any, Any, Any]:
        losses, g = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0, 0))(p, xb, yb)
        sq = sum(jnp.sum(jnp.square(v.reshape(batch, -1)), axis=1) for v in g.values())
        factor = jnp.minimum(1.0, CLIP / (jnp.sqrt(sq) + 1e-6)) * mask
        keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(0), t), len(p))
        new = {k: p[k] - LR / batch * (
            jnp.tensordot(factor, g[k], axes=1, precision=prec)
            + SIGMA * CLIP * jax.random.normal(key, p[k].shape, p[k].dtype))
            for key, k in zip(keys, p, strict=True)}
        return new, t + 1, jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    jstep = jax.jit(step, donate_argnums=(0,))
    holder = [(params, jnp.asarray(0, dtype=jnp.uint32))]

    def run() -> Any:
        p, t, value = jstep(*holder[0], xs, ys, valid)
        holder[0] = (p, t)
        return value

    return Prepared(run, lambda: jax.block_until_ready(holder[0]),
                    "jit(vmap(value_and_grad) per-example grads, flat clip, noise, SGD), donated",
                    str(jax.devices()[0]))


BUILDERS: dict[tuple[str, str], Callable[..., Prepared]] = {
    ("maml", "torchfn"): torch_maml, ("ensembles", "torchfn"): torch_ensembles,
    ("dp", "torchfn"): torch_dp, ("maml", "jax"): jax_maml,
    ("ensembles", "jax"): jax_ensembles, ("dp", "jax"): jax_dp,
}


def emit(tag: str, payload: dict[str, Any]) -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


def child(args: argparse.Namespace) -> int:
    """Build one (config, side), make the first call, say READY, wait for GO, time, RESULT."""
    family, name, side = args.child
    cfg = get_config(family, name, args.small)
    import torch
    from _bench import set_tf32_off, time_calls

    tf32 = set_tf32_off()
    torch.set_float32_matmul_precision("highest")
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    if side == "jax":
        try:
            import jax
            import jaxlib
        except ImportError as exc:
            emit("SKIP", {"reason": f"jax not installed ({exc})"})
            return 0
        versions.update(jax=jax.__version__, jaxlib=jaxlib.__version__)
    t0 = time.perf_counter()
    if side == "torchfn":
        compile_on = {"on": True, "off": False}.get(args.compile, torch.cuda.is_available())
        prep = BUILDERS[family, side](cfg, compile_on)
    else:
        try:
            prep = BUILDERS[family, side](cfg)
        except ImportError as exc:  # optax, say
            emit("SKIP", {"reason": f"JAX side needs {exc.name or exc}: not installed"})
            return 0
    fake_oom = os.environ.get("TORCHFN_SWEEP_TEST_OOM")  # tests: fail the first try once
    if fake_oom and not (Path(fake_oom) / f"{family}_{name}_{side}").exists():
        (Path(fake_oom) / f"{family}_{name}_{side}").touch()
        raise RuntimeError("CUDA out of memory (simulated by TORCHFN_SWEEP_TEST_OOM)")
    first = prep.run()
    prep.wait()
    first_s = time.perf_counter() - t0
    loss = None if first is None else float(first)
    cuda = side == "torchfn" and torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()  # held while the others compile: keep only what is live
        versions["gpu"] = torch.cuda.get_device_name()
    emit("READY", {"first_call_s": first_s, "loss": loss})
    if sys.stdin.readline().strip() != "GO":
        return 0

    def reset_peak() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    t = time_calls(prep.run, wait=prep.wait, warmup=args.warmup, repeats=args.repeats,
                   min_sample_s=5e-3, before_repeats=reset_peak)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    elif side == "jax":
        import jax

        peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    else:
        peak = None
    emit("RESULT", {"median_ms": t.median_ms, "p10_ms": t.quantile_s(0.1) * 1e3,
                    "p90_ms": t.quantile_s(0.9) * 1e3, "inner": t.inner,
                    "repeats": len(t.times_s), "first_call_s": first_s, "loss": loss,
                    "peak_bytes": peak, "recipe": prep.recipe, "device": prep.device,
                    "versions": versions, "tf32": tf32})
    return 0


# --- the parent: launch, hold, time one at a time -------------------------------------------


class Job:
    def __init__(self, family: str, cfg: dict[str, Any], side: str, index: int) -> None:
        self.family, self.cfg, self.side, self.index = family, cfg, side, index
        self.est_s = estimate_s(family, cfg, side)
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        self.log: Path | None = None
        self.ready: dict[str, Any] | None = None
        self.record: dict[str, Any] | None = None  # RESULT, or {"skipped"/"error": ...}
        self.retried = False  # an out-of-memory first call gets one more try, alone

    @property
    def key(self) -> str:
        return f"{self.family}/{self.cfg['name']}/{self.side}"

    def error_tail(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log else []
        return " | ".join(lines[-3:])[-600:] or "no output"


def select(args: argparse.Namespace) -> list[tuple[str, int, dict[str, Any]]]:
    fams = [f for f in args.families.split(",") if f]
    for f in fams:
        if f not in CONFIGS:
            raise SystemExit(f"sweep.py --families: unknown {f!r} (known: {', '.join(FAMILIES)})")
    wanted = [c for c in (args.configs or "").split(",") if c]
    out = []
    for f in fams:
        for i, cfg in enumerate(CONFIGS[f]):
            if not wanted or str(i) in wanted or cfg["name"] in wanted:
                out.append((f, i, cfg))
    if not out:
        raise SystemExit(f"sweep.py --configs {args.configs!r}: selects nothing")
    return out


def reader(job: Job, events: queue.Queue) -> None:
    assert job.proc is not None and job.proc.stdout is not None
    for line in job.proc.stdout:
        tag, _, rest = line.partition(" ")
        if tag in ("READY", "RESULT", "SKIP"):
            events.put((job, tag, json.loads(rest)))
    events.put((job, "EXIT", job.proc.wait()))


def kill(job: Job) -> None:
    if job.proc is not None and job.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.proc.pid, signal.SIGKILL)  # the child and its compile workers


def orchestrate(args: argparse.Namespace, start: float) -> list[Job]:
    selected = select(args)
    sides = ["torchfn"] + ([] if args.no_jax else ["jax"])
    jobs = [Job(f, cfg, side, i) for f, i, cfg in selected for side in sides]
    events: queue.Queue = queue.Queue()
    logdir = Path(tempfile.mkdtemp(prefix="torchfn-sweep-"))
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cores = os.cpu_count() or 1
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(2, cores // 4)))
    pending = sorted(jobs, key=lambda j: -j.est_s)
    running: list[Job] = []
    ready: list[Job] = []
    retry: list[Job] = []  # out of memory in phase 1 beside others: started again once alone

    def elapsed() -> float:
        return time.perf_counter() - start

    def reserve() -> float:  # seconds kept for phase 2: the children alive now, timed in turn
        return args.reserve_per_job_s * (len(running) + len(ready)) + 10.0

    def handle(job: Job, tag: str, payload: Any) -> None:
        if tag == "READY":
            job.ready = payload
            running.remove(job)
            ready.append(job)
            print(f"[{elapsed():6.1f} s] ready   {job.key}: first call "
                  f"{payload['first_call_s']:.1f} s", flush=True)
        elif tag == "SKIP":
            job.record = {"skipped": payload["reason"]}
        elif tag == "RESULT":
            job.record = payload
        elif (tag == "EXIT" and job.record is None and job.ready is None and not job.retried
              and job.log is not None and is_oom(job.log.read_text(errors="replace"))):
            # the processes compiling beside it held the memory: try once more, alone
            job.retried = True
            running.remove(job)
            for pipe in (job.proc.stdin, job.proc.stdout) if job.proc is not None else ():
                with contextlib.suppress(OSError):
                    pipe.close()  # type: ignore[union-attr]
            retry.append(job)
            print(f"[{elapsed():6.1f} s] out of memory beside others: {job.key} will be "
                  "retried alone", flush=True)
            return
        elif tag == "EXIT" and job.record is None:
            when = "after GO" if job.ready is not None else "before its first call finished"
            job.record = {"error": f"exit {payload} {when}: {job.error_tail()}"}
            print(f"[{elapsed():6.1f} s] FAILED  {job.key}: {job.record['error']}", flush=True)
        if tag == "SKIP":
            print(f"[{elapsed():6.1f} s] skipped {job.key}: {payload['reason']}", flush=True)
        if tag in ("SKIP", "EXIT"):
            for alive in (running, ready):
                if job in alive and (tag == "SKIP" or job.record is not None):
                    alive.remove(job)

    print(f"phase 1: build + first call (compile), up to {args.jobs} at once, "
          f"{len(jobs)} processes; logs in {logdir}", flush=True)
    while pending or running or retry:
        if not pending and not running and retry:
            pending.append(retry.pop(0))  # alone: nothing else is compiling now
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            left = args.budget_s - reserve() - args.reserve_per_job_s - elapsed()
            if job.est_s * (0.1 if args.small else 1.0) > left:
                job.record = {"skipped": f"budget: estimated first call {job.est_s:.0f} s > "
                                         f"{max(left, 0):.0f} s left for compiling"}
                print(f"[{elapsed():6.1f} s] skipped {job.key}: {job.record['skipped']}",
                      flush=True)
                continue
            python = args.jax_python if job.side == "jax" else sys.executable
            argv = [python, str(Path(__file__).resolve()), "--child", job.family,
                    job.cfg["name"], job.side, "--compile", args.compile,
                    "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
            argv += ["--small"] if args.small else []
            job.log = logdir / f"{job.key.replace('/', '_')}.log"
            with open(job.log, "w") as err:
                job.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=err, text=True, env=env,
                                            start_new_session=True)
            running.append(job)
            job.thread = threading.Thread(target=reader, args=(job, events), daemon=True)
            job.thread.start()
        with contextlib.suppress(queue.Empty):
            handle(*events.get(timeout=1.0))
        if running and elapsed() > args.budget_s - reserve():
            for job in list(running):
                kill(job)
                running.remove(job)
                job.record = {"skipped": f"budget: still compiling at {elapsed():.0f} s"}
                print(f"[{elapsed():6.1f} s] killed  {job.key}: {job.record['skipped']}",
                      flush=True)
    print(f"phase 2: timing {len(ready)} steps one at a time [{elapsed():.0f} s]", flush=True)
    for job in sorted(ready, key=lambda j: (FAMILIES.index(j.family), j.index,
                                            SIDES.index(j.side))):
        if job.record is not None:  # died while held
            continue
        over = elapsed() > args.budget_s
        if over:
            job.record = {"skipped": f"budget: not timed ({elapsed():.0f} s elapsed)"}
        try:
            assert job.proc is not None and job.proc.stdin is not None
            job.proc.stdin.write("QUIT\n" if over else "GO\n")
            job.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        if over:
            continue
        deadline = time.perf_counter() + args.step_timeout_s
        while job.record is None and time.perf_counter() < deadline:
            with contextlib.suppress(queue.Empty):
                handle(*events.get(timeout=1.0))
        if job.record is None:
            kill(job)
            job.record = {"error": f"no result within {args.step_timeout_s} s of GO"}
        elif "median_ms" in job.record:
            print(f"[{elapsed():6.1f} s] timed   {job.key}: {job.record['median_ms']:.3f} ms",
                  flush=True)
        else:
            print(f"[{elapsed():6.1f} s] {job.key}: {job.record}", flush=True)
    for job in jobs:
        if job.proc is None:
            continue
        try:
            job.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill(job)
            job.proc.wait()
        if job.thread is not None:
            job.thread.join(timeout=10)
        for pipe in (job.proc.stdin, job.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
    return jobs


def rows_of(jobs: list[Job], small: bool) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for job in jobs:
        key = f"{job.family}/{job.cfg['name']}"
        row = rows.setdefault(key, {"family": job.family, "config": job.cfg["name"],
                                    "params": shrink(job.family, job.cfg) if small else job.cfg})
        row[job.side] = job.record
    for row in rows.values():
        add_ratio(row)
    return list(rows.values())


def add_ratio(row: dict[str, Any]) -> None:
    """``ratio`` = JAX ms / torchfn ms (> 1: torchfn faster); ``loss_rel_diff`` where both
    sides ran the same weights and batch (MAML, DP-SGD): their first-step losses."""
    t, j = row.get("torchfn") or {}, row.get("jax") or {}
    row["ratio"] = (j["median_ms"] / t["median_ms"]
                    if "median_ms" in t and "median_ms" in j else None)
    if row["family"] != "ensembles" and t.get("loss") is not None and j.get("loss") is not None:
        row["loss_rel_diff"] = abs(t["loss"] - j["loss"]) / max(abs(j["loss"]), 1e-30)


# --- reports --------------------------------------------------------------------------------


def is_oom(text: str) -> bool:
    """Whether a child's error output is a device out-of-memory error (torch's or XLA's; the
    kept tail of torch's long message may have lost its first line)."""
    low = text.lower()
    return any(k in low for k in ("out of memory", "outofmemoryerror", "pytorch_cuda_alloc_conf",
                                  "resource_exhausted"))


def cell(rec: Any, key: str, fmt: str, scale: float = 1.0, why: bool = False) -> str:
    """``rec[key]`` formatted; else, with ``why``, why it is missing (skipped or error, in
    short: the JSON keeps the whole message), else ``-``."""
    if not isinstance(rec, dict):
        return "not run"
    if rec.get(key) is not None:
        return format(rec[key] * scale, fmt)
    for k in ("skipped", "error") if why else ():
        if k in rec:
            text = str(rec[k])
            if k == "error" and is_oom(text):
                text = "CUDA out of memory"
            return f"{k}: {text[:80]}".replace("|", "/")
    return "-"


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    meta = result["meta"]
    runs = sorted({r["run"] for r in rows if r.get("run")})
    several = len(runs) > 1  # a merge of runs: each row names its own
    devices = sorted({run.rsplit(", ", 1)[0] for run in runs}) or [meta.get("device", "?")]
    out = [f"# Sweep: torchfn default steps vs JAX ({' / '.join(devices)})", "",
           f"- Date: {meta['date']}. torch {meta.get('torch', '?')}, jax "
           f"{meta.get('jax', 'not run')}. fp32, TF32 off on both sides.",
           f"- Command: `{meta['command']}`",
           "- torchfn: default options only (recipe per family below); JAX: `jit`, params "
           "donated, same model (MAML and DP: same weights and batch).",
           "- ratio = JAX ms / torchfn ms (> 1: torchfn faster). First call = build + first "
           "step (compile), measured while other configs compiled in parallel (an upper "
           "bound). Peak: torch CUDA peak over the timed steps; JAX process peak.",
           f"- torchfn at least JAX's speed: {sum(r >= 1 for r in ratios)} of "
           f"{len(ratios)} timed configs ({len(rows)} selected)"
           + (f"; ratio min {min(ratios):.2f}, max {max(ratios):.2f}" if ratios else ""), "",
           "| family | config | torchfn ms | JAX ms | JAX / torchfn | first call s torchfn / JAX "
           "| peak MiB torchfn / JAX | loss rel. diff |" + (" run (device, date) |" if several else ""),
           "|---|---|---:|---:|---:|---:|---:|---:|" + ("---|" if several else "")]
    if several:
        out[2] = (f"- Merged runs ({len(runs)}), each row's in its last column: a ratio compares "
                  "the two sides within one run (same machine); rows of different runs are not "
                  f"comparable in ms. torch {meta.get('torch', '?')}, jax "
                  f"{meta.get('jax', 'not run')} (the last run's). fp32, TF32 off on both sides.")
    for r in rows:
        t, j = r.get("torchfn"), r.get("jax")
        ratio = f"**{r['ratio']:.2f}**" if r.get("ratio") is not None else "-"
        diff = f"{r['loss_rel_diff']:.1e}" if r.get("loss_rel_diff") is not None else "-"
        out.append(f"| {r['family']} | {r['config']} | {cell(t, 'median_ms', '.3f', why=True)} "
                   f"| {cell(j, 'median_ms', '.3f', why=True)} | {ratio} | "
                   f"{cell(t, 'first_call_s', '.1f')} / {cell(j, 'first_call_s', '.1f')} | "
                   f"{cell(t, 'peak_bytes', '.0f', 2**-20)} / "
                   f"{cell(j, 'peak_bytes', '.0f', 2**-20)} | {diff} |"
                   + (f" {r.get('run', '?')} |" if several else ""))
    recipes: dict[str, set[str]] = {}
    for r in rows:
        for side in SIDES:
            rec = r.get(side)
            if isinstance(rec, dict) and "recipe" in rec:
                recipes.setdefault(f"{r['family']} ({side})", set()).add(rec["recipe"])
    out += ["", "Recipes:", ""] + [f"- {k}: `{'`, `'.join(sorted(v))}`"
                                   for k, v in recipes.items()]
    return "\n".join(out) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (make it later with --merge RESULTS.json "
              "--plot PNG)")
        return
    rows = [r for r in result["rows"] if r.get("ratio") is not None]
    if not rows:
        print("no config timed on both sides: no plot")
        return
    colors = {"maml": "tab:blue", "ensembles": "tab:orange", "dp": "tab:green"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows) + 2), 4.5))
    ax.bar(range(len(rows)), [r["ratio"] for r in rows],
           color=[colors.get(r["family"], "gray") for r in rows])
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.set_xticks(range(len(rows)), [f"{r['family']}/{r['config']}" for r in rows],
                  rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("JAX time / torchfn time (> 1: torchfn faster)")
    devices = sorted({r["run"].rsplit(", ", 1)[0] for r in rows if r.get("run")})
    ax.set_title(f"torchfn default steps vs JAX, fp32 TF32 off, "
                 f"{' / '.join(devices) or result['meta'].get('device', '?')}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The goal (torchfn at least JAX's speed on every config) over the rows timed on both
    sides."""
    ratios = {f"{r['family']}/{r['config']}": r["ratio"] for r in rows if r.get("ratio")}
    return {"selected": len(rows), "timed_both_sides": len(ratios),
            "torchfn_at_least_jax": sum(v >= 1 for v in ratios.values()),
            "min_ratio": min(ratios.values(), default=None),
            "all_selected_timed_and_at_least_jax": bool(ratios) and len(ratios) == len(rows)
            and all(v >= 1 for v in ratios.values())}


def write_outputs(result: dict[str, Any], args: argparse.Namespace) -> None:
    result["summary"] = summary(result["rows"])
    for path in (args.out, args.md, args.plot):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.out}")
    text = markdown(result)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
        print(f"wrote {args.md}")
    if args.plot:
        plot(result, args.plot)


def merge(paths: list[str]) -> dict[str, Any]:
    """Rows of several result files, a later file's row replacing an earlier one's."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    for p in paths:
        res = json.loads(Path(p).read_text())
        meta = {**res["meta"], "command": " ; ".join(
            x for x in (meta.get("command"), res["meta"]["command"]) if x)}
        for r in res["rows"]:
            # each row keeps the machine and date of the run that timed it
            r.setdefault("run", f"{res['meta'].get('device', '?')}, {res['meta']['date']}")
            rows[r["family"], r["config"]] = r
    order = {(f, c["name"]): (FAMILIES.index(f), i)
             for f in FAMILIES for i, c in enumerate(CONFIGS[f])}
    return {"meta": meta, "rows": sorted(rows.values(), key=lambda r: order.get(
        (r["family"], r["config"]), (9, 0)))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--configs", default=None,
                    help="comma list of config names or 0-based indices (within each family)")
    ap.add_argument("--list", action="store_true", help="print the configs and exit")
    ap.add_argument("--small", action="store_true", help="tiny sizes: a CPU smoke test")
    ap.add_argument("--no-jax", action="store_true", help="torchfn side only")
    ap.add_argument("--jax-python", default=sys.executable,
                    help="interpreter of the JAX processes (needs jax and optax)")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="torchfn's default compile recipe: auto = on with CUDA, off on the "
                         "CPU (a smoke run: eager steps, not the recipe)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall seconds for the whole sweep (what cannot finish is skipped)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes building/compiling at once (default: cores - 2)")
    ap.add_argument("--reserve-per-job-s", type=float, default=2.0,
                    help="phase-2 seconds kept per held process when deciding to skip")
    ap.add_argument("--step-timeout-s", type=float, default=120.0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--md", default=None, help="markdown table")
    ap.add_argument("--plot", default=None, help="PNG of the ratio per config")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="only combine these result files into --out/--md/--plot")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    if args.list:
        for f in FAMILIES:
            for i, cfg in enumerate(CONFIGS[f]):
                print(f"{f:10s} {i}  {cfg['name']:16s} "
                      f"{json.dumps({k: v for k, v in cfg.items() if k != 'name'})}")
        return 0
    if args.merge:
        write_outputs(merge(args.merge), args)
        return 0
    if args.warmup < 1 or args.repeats < 1:
        ap.error("--warmup and --repeats: expected >= 1")
    args.jobs = args.jobs or max(1, (os.cpu_count() or 1) - 2)
    start = time.perf_counter()
    jobs = orchestrate(args, start)
    rows = rows_of(jobs, args.small)
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "small": args.small,
        "command": "python benchmarks/sweep.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv),
        "wall_s": time.perf_counter() - start, "budget_s": args.budget_s, "jobs": args.jobs,
        "repeats": args.repeats, "warmup": args.warmup, "platform": platform.platform()}
    for job in jobs:
        rec = job.record or {}
        for k, v in (rec.get("versions") or {}).items():
            meta.setdefault("gpu" if k == "gpu" else k, v)
        if job.side == "torchfn" and "device" in rec:
            meta.setdefault("device", meta.get("gpu", rec["device"]))
        if "tf32" in rec:
            meta.setdefault("tf32", rec["tf32"])
    write_outputs({"meta": meta, "rows": rows}, args)
    print(f"wall {meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
