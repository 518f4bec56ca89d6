"""MAML second-order outer step: per-task loop vs torchfn eager vs torchfn compiled vs JAX.

The standard few-shot setting: 4-block conv net (64 channels, BatchNorm with each task's own
batch statistics and no running stats, ReLU, max-pool), 28x28 single-channel inputs, 5-way 1-shot
with 15 queries per class, 32 tasks, 5 inner SGD steps, second order. Times the full
meta-gradient (forward + double backward) per outer step: ``--warmup`` calls (the first one
compiles; its time is reported as ``first_call_s``), then the median of ``--repeats``
synchronized calls, and the peak CUDA memory over the timed calls. Every variant's
meta-gradient is checked against torchfn eager (max over params of
``max|g - g_eager| / max|g_eager|``).

Variants (``--variants``, comma list; default ``loop,eager,compiled,jax``, the four of the
issue, torchfn compiled with default options, what a user gets without knobs; one compile):

- ``loop``: the learn2learn/higher pattern, one task at a time with
  ``autograd.grad(create_graph=True)`` on the ordinary module.
- ``eager``: ``torchfn.meta.maml(...).meta_grad``, tasks vmapped.
- ``compiled[-TOKEN...]``: the same under ``torch.compile(fullgraph=True)``. With no token it
  is the library's default: ``maml(..., unfold_convs="auto")``, which on CUDA computes the
  convolutions the inner loop adapts with a patch ``C_in*kh*kw >= 64`` (layers 2-4 here) as
  unfold + matmul inside the compiled graph. Tokens:
  ``conv`` (``unfold_convs=False``: every layer an ``nn.Conv2d``/cuDNN convolution in the
  graph; before the default changed (issue 18) plain ``compiled`` meant ``compiled-conv`` and
  ``compiled-fix`` meant ``compiled-fix-conv``: the conv-pass tokens below act on the
  convolutions left, so add ``conv`` to measure them as before),
  ``cg`` (mode ``reduce-overhead``: CUDA graphs), ``at`` (``max-autotune-no-cudagraphs``),
  ``atcg`` (``max-autotune``), ``cl`` (force Inductor's channels-last layout optimization, which
  it skips by itself for grouped convolutions, i.e. vmapped per-task conv weights),
  ``bench`` (``torch.backends.cudnn.benchmark=True`` for that variant), ``fix`` (install
  ``torchfn.compile.inductor_options(channels_last=False)``: the post-grad pass that turns the
  per-task loop of weight-gradient convolutions in ATen's conv double backward into one grouped
  ``convolution_backward``), ``gcl`` (with ``fix``: ``inductor_options(channels_last=True)``,
  grouped convolutions with >= 16 channels per group in channels-last; the library default
  ``"auto"`` does this only with cuDNN TF32 on, where it pays), ``unfold`` (the model through
  ``torchfn.compile.unfold_convs``: layers 2-4 as unfold + matmul, batched GEMMs over the tasks
  instead of grouped cuDNN convolutions; now the same graph as the default), ``unfoldall``
  (all four layers, the 1-channel first one too: no convolution left), ``chunkN`` (tasks in
  chunks of N). E.g.
  ``compiled-cg-fix-bench``, ``compiled-fix-unfold``. ``eager-chunkN``/``eager-bench``/
  ``eager-unfold`` work too.
- ``inner[-TOKEN...]``: ``make_meta_train_step(learner, sgd, compile="inner").meta_grad``:
  the inner step and the query loss each ``torch.compile``d once (compile time flat in the
  inner steps), the outer gradient an eager ``autograd.grad`` through them (default
  ``unfold_convs="auto"`` as for ``compiled``). Tokens: ``conv``, ``fix``, ``gcl``, ``unfold``, ``unfoldall``, ``bench``, ``cl``, ``at`` (``max-autotune-no-cudagraphs``;
  no ``cg``: there is no one graph to capture) and ``chunkN``, as for ``compiled``, and
  ``eagerquery`` (only the inner step compiled, the query loss eager: is compiling it worth
  its compile time?), ``norecomp`` (the inner step and query loss compiled with AOTAutograd's
  default partitioning, not the library's aggressive recomputation: saves more for the outer
  backward, e.g. the unfolded convolutions' patches).
- ``jax``: the twin in ``benchmarks/meta_jax.py`` (same weights, same tasks, same math,
  ``jax.jit(jax.value_and_grad(meta_loss))``), run in a subprocess of ``--jax-python``
  (default: this interpreter) so the two frameworks never share a process; skipped with a
  message when that interpreter cannot import jax.

Precision is equal on both sides: ``--precision highest`` (default) turns TF32 off in torch
(matmul and cuDNN) and sets JAX's default matmul/conv precision to 'highest'; ``tf32`` allows
TF32 on both. The TF32 state is printed. ``--small`` shrinks everything for a CPU smoke test;
``--out results.json`` writes JSON. ``--inner-steps K`` overrides the 5 inner steps (compile
time grows with K for ``compiled``, not for ``inner``). ``--config KEY=VALUE,...`` overrides
any entry of the config (``channels``, ``n_tasks``, ``n_way``, ``k_shot``, ``n_query``,
``size``, ``steps``), e.g. issue 18's second config ``--config
channels=32,n_way=5,k_shot=5,n_tasks=16,steps=3``; the JAX twin takes its shapes from the
same weights and tasks.

``--saved-bytes`` (``inner`` variants): after timing, one more call with
``torch.autograd.graph.saved_tensors_hooks`` that sums the bytes of the distinct storages the
step saves for its outer backward (what the compiled inner steps and query loss hand autograd,
plus the few eager ops between them), split by piece, with the largest saved shapes: the
activation memory the step holds at the start of its outer backward, on any device.

``--warm-start`` (``compiled`` and ``inner`` variants): after the in-process timing, run the
variant twice more, each in a fresh Python process with ``torchfn.compile.enable_compile_cache``
pointed at one new directory: the first fills the cache (a cold start), the second is the warm
start. Each reports ``start_to_first_step_s`` (from just before the process is spawned to the
end of its first synchronized meta-gradient: interpreter, imports, model, Dynamo, cache loads or
compiles), its ``first_call_s`` and its ``peak_bytes`` (CUDA peak of the first call).

    python benchmarks/meta.py --out benchmarks/results/meta-h100.json
    python benchmarks/meta.py --variants compiled,compiled-conv,compiled-unfoldall,jax
    python benchmarks/meta.py --variants compiled-cg-conv,compiled-cg-fix-cl-conv,jax
    python benchmarks/meta.py --variants compiled-conv,compiled-fix-conv --repeats 3 --profile
    python benchmarks/meta.py --variants compiled-fix-unfoldall,inner-fix-unfoldall,jax --warm-start
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from _bench import sync, time_calls
from torch import Tensor, nn
from torch.func import functional_call

from torchfn.compile import enable_compile_cache, inductor_options, unfold_convs
from torchfn.functional import make_functional
from torchfn.meta import Task, make_meta_train_step, maml
from torchfn.optim import sgd

EPS = 1e-5
HERE = os.path.dirname(os.path.abspath(__file__))


def conv_net(channels: int, n_way: int, size: int) -> nn.Module:
    """The 4-block conv net; BatchNorm without running stats (transductive, per task)."""
    layers: list[nn.Module] = []
    c_in = 1
    for _ in range(4):
        layers += [nn.Conv2d(c_in, channels, 3, padding=1),
                   nn.BatchNorm2d(channels, eps=EPS, track_running_stats=False), nn.ReLU(),
                   nn.MaxPool2d(2)]
        c_in = channels
    side = size // 16
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * side * side, n_way))


def make_tasks(n_tasks: int, n_way: int, k_shot: int, n_query: int, size: int,
               device: torch.device, dtype: torch.dtype) -> Task:
    g = torch.Generator().manual_seed(0)

    def rnd(n: int) -> Tensor:
        return torch.randn(n_tasks, n, 1, size, size, generator=g).to(device, dtype)

    def lab(k: int) -> Tensor:
        return torch.arange(n_way).repeat_interleave(k).expand(n_tasks, -1).contiguous().to(device)

    return Task(rnd(n_way * k_shot), lab(k_shot), rnd(n_way * n_query), lab(n_query))


def loop_meta_grad(module: nn.Module, tasks: Task, inner_lr: float, steps: int
                   ) -> dict[str, Tensor]:
    """The learn2learn/higher pattern: one task at a time, autograd.grad(create_graph=True)."""
    params = dict(module.named_parameters())
    total: Tensor | float = 0.0
    n = tasks.support_x.shape[0]
    for t in range(n):
        fast = dict(params)
        for _ in range(steps):
            loss = F.cross_entropy(functional_call(module, fast, (tasks.support_x[t],)),
                                   tasks.support_y[t])
            g = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
            fast = {k: v - inner_lr * gk for (k, v), gk in zip(fast.items(), g, strict=True)}
        total = total + F.cross_entropy(functional_call(module, fast, (tasks.query_x[t],)),
                                        tasks.query_y[t])
    assert isinstance(total, Tensor)
    grads = torch.autograd.grad(total / n, list(params.values()))
    return dict(zip(params, grads, strict=True))


def timeit(fn: Callable[[], dict[str, Tensor]], warmup: int, repeats: int, device: torch.device,
           cudagraphs: bool) -> tuple[dict, dict[str, Tensor]]:
    """Return ``(timing record, the meta-gradient of the first call, cloned)``."""
    mark = torch.compiler.cudagraph_mark_step_begin if cudagraphs else (lambda: None)
    first: list[dict[str, Tensor]] = []

    def call() -> dict[str, Tensor]:
        mark()
        out = fn()
        if not first:  # the first call's meta-gradient, cloned before the next call reuses it
            first.append({k: v.detach().clone() for k, v in out.items()})
        return out

    def reset_peak() -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    t = time_calls(call, device, warmup=warmup, repeats=repeats, before_repeats=reset_peak)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return ({"median_s": t.median_s, "times_s": t.times_s, "first_call_s": t.first_call_s,
             "peak_bytes": peak}, first[0])


def profile(fn: Callable[[], dict[str, Tensor]], device: torch.device, cudagraphs: bool,
            name: str, rows: int = 25) -> None:
    """Print the ``rows`` most expensive kernels/ops of 2 calls of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    mark = torch.compiler.cudagraph_mark_step_begin if cudagraphs else (lambda: None)
    with torch_profile(activities=activities) as prof:
        for _ in range(2):
            mark()
            fn()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"--- profile of {name} (2 calls), by {key} ---")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70))


def max_rel_diff(got: dict[str, Tensor] | dict[str, np.ndarray], want: dict[str, Tensor]
                 ) -> float:
    """Return max over params of ``max|got - want| / max(max|want|, 1e-3 * max_all|want|)``.

    The floor matters: the conv biases in front of BatchNorm have an exactly-zero meta-gradient
    (the normalization removes them), so their computed gradients are pure rounding noise.
    """
    w64 = {k: w.detach().double().cpu() for k, w in want.items()}
    scale = max(float(w.abs().max()) for w in w64.values())
    worst = 0.0
    for k, w in w64.items():
        g = got[k]
        g64 = (g.detach().double().cpu() if isinstance(g, Tensor)
               else torch.from_numpy(np.asarray(g, dtype=np.float64)))
        denom = max(float(w.abs().max()), 1e-3 * scale, 1e-30)
        worst = max(worst, float((g64 - w).abs().max()) / denom)
    return worst


@contextlib.contextmanager
def variant_settings(tokens: set[str]) -> Iterator[None]:
    """Apply a variant's global switches (cuDNN benchmark, Inductor layout) and restore them."""
    import torch._inductor.config as inductor_config

    old = (torch.backends.cudnn.benchmark, inductor_config.force_layout_optimization)
    torch.backends.cudnn.benchmark = "bench" in tokens
    inductor_config.force_layout_optimization = "cl" in tokens
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark, inductor_config.force_layout_optimization = old


def parse_variant(name: str) -> tuple[str, set[str], int | None, str | None]:
    """Return ``(kind, tokens, chunk_size, compile mode)`` of a variant name; raise if unknown."""
    kind, *rest = name.split("-")
    if (kind not in ("loop", "eager", "compiled", "inner", "jax")
            or (kind in ("loop", "jax") and rest)):
        raise SystemExit(f"meta.py --variants: unknown variant {name!r} (see --help)")
    tokens, chunk = set(), None
    known = ({"cg", "at", "atcg", "cl", "bench", "fix", "gcl", "conv", "unfold", "unfoldall"}
             if kind == "compiled" else
             {"at", "cl", "bench", "fix", "gcl", "conv", "unfold", "unfoldall", "eagerquery",
              "norecomp"}
             if kind == "inner"
             else {"bench", "unfold", "unfoldall"})
    for tok in rest:
        if tok.startswith("chunk") and tok[5:].isdigit():
            chunk = int(tok[5:])
        elif tok in known:
            tokens.add(tok)
        else:
            raise SystemExit(f"meta.py --variants: unknown token {tok!r} in {name!r} "
                             f"(known for {kind}: {sorted(known)} and chunkN)")
    mode = {"cg": "reduce-overhead", "at": "max-autotune-no-cudagraphs",
            "atcg": "max-autotune"}
    modes = [mode[t] for t in ("cg", "at", "atcg") if t in tokens]
    if len(modes) > 1:
        raise SystemExit(f"meta.py --variants: {name!r} names more than one compile mode")
    if len(tokens & {"conv", "unfold", "unfoldall"}) > 1:
        raise SystemExit(f"meta.py --variants: {name!r} names more than one of conv, unfold "
                         "and unfoldall")
    return kind, tokens, chunk, (modes[0] if modes else None)


def run_jax(python: str, module: nn.Module, tasks: Task, cfg: dict, inner_lr: float,
            dtype: str, precision: str, warmup: int, repeats: int) -> dict:
    """Run ``meta_jax.py`` in a subprocess on the same weights and tasks; return its record."""
    with tempfile.TemporaryDirectory() as tmp:
        path_in, path_out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        arrays = {f"param:{k}": v.detach().cpu().numpy() for k, v in module.named_parameters()}
        arrays.update({f: getattr(tasks, f).cpu().numpy() for f in Task._fields})
        np.savez(path_in, dtype=dtype, precision=precision, n_blocks=4, eps=EPS,
                 inner_lr=inner_lr, inner_steps=cfg["steps"], repeats=repeats, warmup=warmup,
                 **arrays)
        proc = subprocess.run([python, os.path.join(HERE, "meta_jax.py"), path_in, path_out],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return {"skipped": f"meta_jax.py failed (rc {proc.returncode}): "
                               f"{proc.stderr.strip()[-2000:]}"}
        out = dict(np.load(path_out))
    if "skipped" in out:
        return {"skipped": str(out["skipped"])}
    grads = {k[len("grad:"):]: v for k, v in out.items() if k.startswith("grad:")}
    peak = int(out["peak_bytes"])
    return {"median_s": float(out["median_s"]), "times_s": out["times_s"].tolist(),
            "first_call_s": float(out["compile_s"]), "peak_bytes": None if peak < 0 else peak,
            "device": str(out["device"]), "jax": str(out["jax_version"]), "grads": grads}


UNFOLD_MIN_PATCH = {"unfold": 64, "unfoldall": 1}  # layers 2-4 / all four as unfold + matmul


def build_call(kind: str, tokens: set[str], chunk: int | None, mode: str | None,
               module: nn.Module, model_fn: Callable, cfg: dict, inner_lr: float
               ) -> Callable[..., tuple]:
    """Return the meta-gradient function ``call(params, buffers, tasks)`` of an eager,
    ``compiled`` or ``inner`` variant."""
    tok = next(iter(tokens & UNFOLD_MIN_PATCH.keys()), None)  # one at most
    net_fn = model_fn if tok is None else make_functional(
        unfold_convs(module, min_patch=UNFOLD_MIN_PATCH[tok]))[0]
    # the library default ("auto": compiled on CUDA, adapted convs with a patch >= 64 as
    # unfold + matmul; eager calls nn.Conv2d), or the opt-out with the conv token
    learner = maml(net_fn, F.cross_entropy, inner_lr=inner_lr, inner_steps=cfg["steps"],
                   chunk_size=chunk, unfold_convs=False if "conv" in tokens else "auto")
    if kind == "eager":
        return learner.meta_grad
    if "fix" in tokens or "gcl" in tokens:  # compile takes a mode or options, not both
        kwargs = {"options": {**(torch._inductor.list_mode_options(mode) if mode else {}),
                              **inductor_options(channels_last="gcl" in tokens)}}
    else:
        kwargs = {"mode": mode}
    if kind == "inner" and tokens & {"eagerquery", "norecomp"}:
        from torchfn.meta._inner_compile import InnerCompiledMetaGrad  # the options' parts

        return InnerCompiledMetaGrad(learner, kwargs, compile_query="eagerquery" not in tokens,
                                     recompute="norecomp" not in tokens)
    if kind == "inner":
        return make_meta_train_step(learner, sgd(0.1), compile="inner",
                                    compile_kwargs=kwargs).meta_grad
    return torch.compile(learner.meta_grad, fullgraph=True, **kwargs)


def saved_bytes(call: Callable[..., tuple], params: dict, buffers: dict, tasks: Task,
                top: int = 8) -> dict:
    """Return what one call of an ``inner`` variant's ``call`` saves for its outer backward:
    ``{"total_bytes", "by_piece": {piece: bytes}, "largest": [[piece, count, shape, dtype,
    bytes], ...]}``, distinct storages counted once (``saved_tensors_hooks``)."""
    seen: dict[int, int] = {}
    by_piece: dict[str, int] = {}
    shapes: dict[tuple, list[int]] = {}
    piece = ["eager"]
    owner = getattr(call, "__self__", call)  # the InnerCompiledMetaGrad behind .meta_grad
    pieces = {name: getattr(owner, name) for name in ("inner_step", "query")
              if hasattr(owner, name)}

    def tagged(name: str, fn: Callable) -> Callable:
        def run(*a: object) -> object:
            piece[0] = name
            try:
                return fn(*a)
            finally:
                piece[0] = "eager"
        return run

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = n = storage.nbytes()
            by_piece[piece[0]] = by_piece.get(piece[0], 0) + n
            rec = shapes.setdefault((piece[0], tuple(t.shape), str(t.dtype)), [0, 0])
            rec[0] += 1
            rec[1] += n
        return t

    for name, fn in pieces.items():
        setattr(owner, name, tagged(name, fn))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            call(params, buffers, tasks)
    finally:
        for name, fn in pieces.items():
            setattr(owner, name, fn)
    largest = sorted(shapes.items(), key=lambda kv: -kv[1][1])[:top]
    return {"total_bytes": sum(seen.values()), "by_piece": by_piece,
            "largest": [[p, c, list(sh), dt, n] for (p, sh, dt), (c, n) in largest]}


def parse_config(text: str | None, cfg: dict) -> dict:
    """``--config``'s ``KEY=VALUE,...`` as ``{key: int}``; keys must be those of ``cfg``."""
    out: dict = {}
    for item in (text or "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or key not in cfg or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--config: {item!r} is not KEY=VALUE with KEY one of {sorted(cfg)} "
                             "and VALUE a positive int")
        out[key] = int(value)
    return out


def setup(args: argparse.Namespace) -> tuple:
    """Return ``(device, dtype, cfg, module, tasks, model_fn, params, buffers)``, seeded."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    tf32 = args.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    cfg = dict(channels=64, n_tasks=32, n_way=5, k_shot=1, n_query=15, size=28, steps=5)
    if args.small:
        cfg.update(channels=8, n_tasks=4, n_query=3, size=16, steps=2)
    if args.inner_steps is not None:
        cfg.update(steps=args.inner_steps)
    cfg.update(parse_config(args.config, cfg))
    torch.manual_seed(0)
    module = conv_net(cfg["channels"], cfg["n_way"], cfg["size"]).to(device, dtype)
    tasks = make_tasks(cfg["n_tasks"], cfg["n_way"], cfg["k_shot"], cfg["n_query"],
                       cfg["size"], device, dtype)
    model_fn, params, buffers = make_functional(module)
    return device, dtype, cfg, module, tasks, model_fn, params, buffers


def child_first_step(args: argparse.Namespace) -> None:
    """``--child``: one variant's first meta-gradient in this fresh process, with the compile
    cache in ``--cache-dir``; print the wall-clock time it finished and what it took."""
    t_imported = time.time()  # the interpreter is up and this script's imports are done
    enable_compile_cache(args.cache_dir)
    kind, tokens, chunk, mode = parse_variant(args.child)
    device, _, cfg, module, tasks, model_fn, params, buffers = setup(args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_setup = time.time()
    with variant_settings(tokens):
        call = build_call(kind, tokens, chunk, mode, module, model_fn, cfg, 0.01)
        t_built = time.time()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        if mode in ("reduce-overhead", "max-autotune"):
            torch.compiler.cudagraph_mark_step_begin()
        call(params, buffers, tasks)
        sync(device)
        done = time.time()
    first = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    print("CHILD " + json.dumps({
        "done_unix_s": done, "first_call_s": first, "peak_bytes": peak,
        # where process start went: interpreter and imports (from the parent's spawn time),
        # model and tasks on the device (CUDA init), building the step
        "imported_unix_s": t_imported,
        "setup_s": t_setup - t_imported, "build_s": t_built - t_setup,
        "first_call_breakdown": compile_breakdown()}), flush=True)


def compile_breakdown() -> dict:
    """Return where this process's compiles went: Dynamo's per-phase seconds (summed over
    frames, what ``torch._dynamo.utils.compile_times`` prints) for the phases that matter to a warm
    start, and the cache counters (an FX graph / AOTAutograd cache hit or miss per graph,
    Dynamo's unique graphs and recompiles)."""
    from torch._dynamo import utils as dynamo_utils
    from torch._dynamo.utils import counters

    phases = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler",
              "create_aot_dispatcher_function", "AOTAutogradCache.inductor_load",
              "PyCodeCache.load_by_key_path", "async_compile.wait", "compile_fx_inner",
              "GraphLowering.codegen", "Scheduler.codegen", "build_guards")
    metrics = getattr(dynamo_utils, "compilation_time_metrics", {})  # {phase: [seconds]}
    times = {k: round(sum(metrics[k]), 3) for k in phases if k in metrics}
    keep = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass",
            "autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass",
            "unique_graphs", "calls_captured", "async_compile_cache_hit",
            "async_compile_cache_miss")
    cnt = {k: v for group in ("inductor", "aot_autograd", "stats")
           for k, v in counters[group].items() if k in keep}
    cnt["recompiles"] = sum(counters["recompiles"].values())
    return {"dynamo_s": times, "counters": cnt}


def warm_start(args: argparse.Namespace, name: str) -> dict:
    """Return ``{"cold": rec, "warm": rec}``: the variant's first step in two fresh processes
    sharing one new compile cache directory (the first fills it)."""
    out: dict = {}
    cache = tempfile.mkdtemp(prefix="torchfn-meta-cache-")
    argv = [sys.executable, os.path.abspath(__file__), "--child", name, "--cache-dir", cache,
            "--dtype", args.dtype, "--precision", args.precision]
    argv += ["--small"] if args.small else []
    argv += [] if args.inner_steps is None else ["--inner-steps", str(args.inner_steps)]
    argv += [] if args.config is None else ["--config", args.config]
    for label in ("cold", "warm"):
        start = time.time()
        proc = subprocess.run(argv, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD ")]
        if proc.returncode != 0 or not lines:
            out[label] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
            print(f"{name:26s} {label} start failed: {out[label]['error']}", flush=True)
            continue
        rec = json.loads(lines[-1][6:])
        rec["start_to_first_step_s"] = rec.pop("done_unix_s") - start
        rec["interpreter_imports_s"] = rec.pop("imported_unix_s") - start
        out[label] = rec
        peak = rec["peak_bytes"]
        print(f"{name:26s} {label} start: process start to first step "
              f"{rec['start_to_first_step_s']:7.1f} s (first call {rec['first_call_s']:7.1f} s"
              f", peak {'-' if peak is None else f'{peak / 2**20:.0f} MiB'}); interpreter and "
              f"imports {rec['interpreter_imports_s']:.1f} s, setup "
              f"{rec['setup_s']:.1f} s, build {rec['build_s']:.1f} s", flush=True)
        print(f"{'':26s}   first call: {json.dumps(rec['first_call_breakdown'])}", flush=True)
    out["cache_dir"] = cache
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny sizes for a CPU smoke test")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="calls before timing (>= 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--precision", default="highest", choices=["highest", "tf32"])
    ap.add_argument("--variants", default="loop,eager,compiled,jax")
    ap.add_argument("--inner-steps", type=int, default=None, help="inner steps (default 5)")
    ap.add_argument("--config", default=None, metavar="KEY=VALUE,...",
                    help="override config entries (channels, n_tasks, n_way, k_shot, n_query, "
                         "size, steps), applied after --small and --inner-steps")
    ap.add_argument("--warm-start", action="store_true",
                    help="also time process start to first step, cold and warm compile cache, "
                         "for compiled and inner variants (two fresh processes each)")
    ap.add_argument("--jax-python", default=sys.executable,
                    help="interpreter for the JAX twin (needs numpy and jax)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="after timing each torch variant, profile 2 calls and print the top "
                         "kernels by device time (to see where the time goes)")
    ap.add_argument("--saved-bytes", action="store_true",
                    help="for inner variants, also count the bytes one step saves for its "
                         "outer backward (saved_tensors_hooks), by compiled piece")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # --warm-start's child: a variant
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_first_step(args)
        return
    if args.warmup < 1:
        ap.error(f"--warmup: expected >= 1, got {args.warmup}")
    variants = [(*parse_variant(v), v) for v in args.variants.split(",") if v]
    device, _, cfg, module, tasks, model_fn, params, buffers = setup(args)
    print(f"torch {torch.__version__} on {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"{args.dtype}, TF32: matmul={torch.backends.cuda.matmul.allow_tf32} "
          f"cudnn={torch.backends.cudnn.allow_tf32}")
    print("config:", cfg)
    inner_lr = 0.01
    results: dict = {"config": cfg, "device": str(device), "dtype": args.dtype,
                     "precision": args.precision, "torch": torch.__version__,
                     "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32,
                              "cudnn": torch.backends.cudnn.allow_tf32}, "runs": {}}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    ref_module = copy.deepcopy(module)
    reference = {k: v.detach().clone() for k, v in maml(
        model_fn, F.cross_entropy, inner_lr=inner_lr, inner_steps=cfg["steps"]
    ).meta_grad(params, buffers, tasks)[0].items()}

    def report(name: str, rec: dict) -> None:
        peak = rec.get("peak_bytes")
        peak_s = f"{peak / 2**20:8.0f} MiB" if peak else "       - MiB"
        diff = rec.get("max_rel_diff_vs_eager")
        print(f"{name:26s} {rec['median_s'] * 1e3:9.2f} ms  peak {peak_s}  "
              f"first call {rec['first_call_s']:7.1f} s  "
              f"max rel diff vs eager {'-' if diff is None else f'{diff:.1e}'}", flush=True)

    def save() -> None:  # after every variant: a run cut by a time limit keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)

    for kind, tokens, chunk, mode, name in variants:
        save()
        if kind == "jax":
            rec = run_jax(args.jax_python, module, tasks, cfg, inner_lr, args.dtype,
                          args.precision, args.warmup, args.repeats)
            if "skipped" in rec:
                print(f"{name:26s} skipped: {rec['skipped']}", flush=True)
            else:
                rec["max_rel_diff_vs_eager"] = max_rel_diff(rec.pop("grads"), reference)
                report(f"{name} ({rec['jax']})", rec)
            results["runs"][name] = rec
            continue
        torch._dynamo.reset()
        with variant_settings(tokens):
            if kind == "loop":
                def fn() -> dict[str, Tensor]:
                    return loop_meta_grad(ref_module, tasks, inner_lr, cfg["steps"])
            else:
                call = build_call(kind, tokens, chunk, mode, module, model_fn, cfg, inner_lr)

                def fn(call=call) -> dict[str, Tensor]:
                    return call(params, buffers, tasks)[0]
            cudagraphs = mode in ("reduce-overhead", "max-autotune")
            rec, grads = timeit(fn, args.warmup, args.repeats, device, cudagraphs=cudagraphs)
            if args.profile:
                profile(fn, device, cudagraphs, name)
            if args.saved_bytes and kind == "inner":
                rec["saved"] = saved = saved_bytes(call, params, buffers, tasks)
                print(f"{name:26s} saved for the outer backward: "
                      f"{saved['total_bytes'] / 2**20:.1f} MiB ("
                      + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in saved["by_piece"].items())
                      + "); largest: " + "; ".join(
                          f"{p} {c}x{tuple(sh)} {n / 2**20:.1f}"
                          for p, c, sh, _, n in saved["largest"][:4]), flush=True)
        rec["max_rel_diff_vs_eager"] = max_rel_diff(grads, reference)
        results["runs"][name] = rec
        report(name, rec)
        if args.warm_start and kind in ("compiled", "inner"):
            save()
            rec["fresh_process"] = warm_start(args, name)
    save()


if __name__ == "__main__":
    main()
