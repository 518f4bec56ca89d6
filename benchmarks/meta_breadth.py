"""iMAML and ProtoNet outer steps: torchfn eager / compiled vs JAX, side by side (issue 20).

The config of ``benchmarks/meta.py`` (its conv net, tasks and helpers are imported from there):
4-block conv net (64 channels, BatchNorm with each task's batch statistics, ReLU, max-pool),
28x28x1 inputs, 5-way 1-shot, 15 queries per class, 32 tasks. One outer step = the full
meta-gradient of the task batch:

- ``imaml``: ``torchfn.meta.imaml(model_fn, F.cross_entropy, lam, cg_steps, cg_damping,
  inner_steps=K, inner_lr)``'s ``meta_grad``: K detached SGD steps on the proximal support loss,
  then ``cg_steps`` CG iterations on Hessian-vector products, tasks vmapped. Run at every K of
  ``--inner-steps`` (default 5,10,20): time should grow with K, peak memory should not (the
  inner loop keeps no graph) -- the script prints peak(K max) / peak(K min) for each side.
- ``protonet``: ``torchfn.meta.protonet(embed_fn, n_way=5)`` (squared Euclidean, scale 1), the
  same conv net without its linear head as the embedding; ``meta_grad``.

The JAX twins (``benchmarks/meta_breadth_jax.py``, numpy/jax only) run in a subprocess of
``--jax-python`` on the same weights and tasks: same proximal inner objective, inner SGD, K,
CG iterations, lam and damping; same embedding and prototypes; ``jax.jit``. Each JAX row is
its own process, so its ``peak_bytes_in_use`` is that step's alone.

Variants per algorithm (``--imaml-variants``, ``--protonet-variants``; comma lists):
``eager``, ``jax``, ``compiled`` (``torch.compile(meta_grad, fullgraph=True)``), with the
tokens of ``meta.py`` (``-unfold``/``-unfoldall``: convs as unfold + matmul via
``torchfn.compile.unfold_convs``; ``-fix``, ``-cg``, ``-at``, ...). Compiled variants of iMAML
run only at the K of ``--compiled-steps`` (default 5: each compile of the conv4 step costs
minutes on an H100, growing with K: the inner loop is unrolled in the graph). iMAML also has
``inner`` variants (``inner-unfold``, ``inner-fix-unfold``, ...: the ``meta_grad`` of
``make_meta_train_step(learner, sgd, compile="inner")``: the proximal inner step and the
implicit solve each compiled once, compile time flat in K), run at every K of
``--inner-steps``; each row compiles afresh (``torch._dynamo.reset()``), but Inductor's on-disk
caches serve the later K the kernels of the first: set ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``
to time a cold compile at every K. Order: every JAX row, every eager row (so each eager row is
compared with JAX), the ``inner`` rows, then the compiled rows, iMAML's first. An ``inner`` or
compiled row starts only if the time so far plus its estimated compile
(``--imaml-inner-compile-estimate-s``, ``--imaml-compile-estimate-s``,
``--protonet-compile-estimate-s``) fits ``--budget-s`` (default 480 s); else it is recorded as
skipped, so one call of the defaults stays near 8 minutes.

Correctness first: every row's meta-gradient is compared with torchfn eager's and, for the
torch rows, with JAX's (max over params of ``max|g - g_ref| / max|g_ref|``, floored at 1e-3 of
the largest gradient; ``meta.max_rel_diff``); a difference above ``--tol`` (default 1e-9 in
float64, 2e-2 in float32) marks the row MISMATCH and the exit status 1 (after the files are
written). Precision as in ``meta.py``: ``--precision highest`` (default) = TF32 off in torch and
JAX 'highest'. Timing: ``--warmup`` calls (the first compiles; "first call"), then the median
of ``--repeats`` synchronized calls; peak CUDA memory over the timed calls.

    python benchmarks/meta_breadth.py --out meta-breadth.json --md meta-breadth-h100.md
    python benchmarks/meta_breadth.py --small --dtype float64 --jax-python /tmp/jaxenv/bin/python
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python benchmarks/meta_breadth.py --algos imaml \
        --imaml-variants jax,inner-unfold --compiled-steps '' --md meta-breadth-inner.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from meta import EPS, HERE, conv_net, make_tasks, max_rel_diff, parse_variant, timeit
from torch import Tensor, nn

from torchfn.compile import inductor_options, unfold_convs
from torchfn.functional import make_functional
from torchfn.meta import Task, imaml, make_meta_train_step, protonet
from torchfn.optim import sgd

LOSS = "__loss__"  # key of the meta-loss in a timed call's output dict
UNFOLD_MIN_PATCH = {"unfold": 64, "unfoldall": 1}


def embed_net(channels: int, n_way: int, size: int) -> nn.Module:
    """The 4-block conv net of ``meta.py`` without its linear head (flattened features)."""
    return nn.Sequential(*list(conv_net(channels, n_way, size))[:-1])


def write_jax_input(path: str, module: nn.Module, tasks: Task, settings: dict) -> None:
    """Write the module's weights, the task batch and ``settings`` (scalars) to ``path`` (.npz)."""
    arrays = {f"param:{k}": v.detach().cpu().numpy() for k, v in module.named_parameters()}
    arrays.update({f: getattr(tasks, f).cpu().numpy() for f in Task._fields})
    np.savez(path, **settings, **arrays)


def read_jax_output(path: str) -> dict:
    """Return the record of a ``meta_breadth_jax.py`` output file (grads as numpy arrays)."""
    out = dict(np.load(path))
    if "skipped" in out:
        return {"skipped": str(out["skipped"])}
    peak = int(out["peak_bytes"])
    return {"median_s": float(out["median_s"]), "times_s": out["times_s"].tolist(),
            "first_call_s": float(out["compile_s"]), "peak_bytes": None if peak < 0 else peak,
            "loss": float(out["loss"]), "device": str(out["device"]),
            "jax": str(out["jax_version"]),
            "grads": {k[len("grad:"):]: v for k, v in out.items() if k.startswith("grad:")}}


def run_jax(python: str, module: nn.Module, tasks: Task, settings: dict) -> dict:
    """Run ``meta_breadth_jax.py`` under ``python`` on the module's weights and ``tasks``."""
    with tempfile.TemporaryDirectory() as tmp:
        path_in, path_out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        write_jax_input(path_in, module, tasks, settings)
        proc = subprocess.run([python, os.path.join(HERE, "meta_breadth_jax.py"), path_in,
                               path_out], capture_output=True, text=True)
        if proc.returncode != 0:
            return {"skipped": f"meta_breadth_jax.py failed (rc {proc.returncode}): "
                               f"{proc.stderr.strip()[-2000:]}"}
        return read_jax_output(path_out)


def build_call(learner_fn: Callable[[Callable], object], module: nn.Module, kind: str,
               tokens: set[str], mode: str | None, backend: str = "inductor") -> Callable:
    """Return the learner's ``meta_grad`` for a torch variant: model unfolded, compiled whole,
    compiled by parts (``inner``: ``make_meta_train_step(compile="inner")``'s) or eager."""
    tok = next(iter(tokens & UNFOLD_MIN_PATCH.keys()), None)
    net = module if tok is None else unfold_convs(module, min_patch=UNFOLD_MIN_PATCH[tok])
    learner = learner_fn(make_functional(net)[0])
    if kind not in ("compiled", "inner"):
        return learner.meta_grad
    if "fix" in tokens:  # compile takes a mode or options, not both
        kwargs = {"options": {**(torch._inductor.list_mode_options(mode) if mode else {}),
                              **inductor_options(channels_last="gcl" in tokens)}}
    else:
        kwargs = {"mode": mode}
    if backend != "inductor":  # modes and options are Inductor's
        kwargs = {"backend": backend}
    if kind == "inner":
        return make_meta_train_step(learner, sgd(0.1), compile="inner",
                                    compile_kwargs=kwargs).meta_grad
    return torch.compile(learner.meta_grad, fullgraph=True, **kwargs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true",
                    help="tiny sizes for a CPU smoke test (8 channels, 16x16, 2 tasks, K 2,3)")
    ap.add_argument("--algos", default="imaml,protonet")
    ap.add_argument("--inner-steps", default=None, help="iMAML K values (default 5,10,20)")
    ap.add_argument("--compiled-steps", default="5",
                    help="the K values at which compiled iMAML variants run")
    ap.add_argument("--imaml-variants", default="eager,jax,compiled-unfold")
    ap.add_argument("--protonet-variants", default="eager,jax,compiled")
    ap.add_argument("--lam", type=float, default=2.0)
    ap.add_argument("--cg-steps", type=int, default=5)
    ap.add_argument("--cg-damping", type=float, default=0.0)
    ap.add_argument("--inner-lr", type=float, default=0.05)
    ap.add_argument("--jax-inner-loop", default="unroll", choices=["unroll", "fori"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="calls before timing (>= 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--precision", default="highest", choices=["highest", "tf32"])
    ap.add_argument("--tol", type=float, default=None,
                    help="max relative gradient difference (default 1e-9 float64, 2e-2 float32)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="start a compiled or inner row only if elapsed + its compile "
                         "estimate fits")
    ap.add_argument("--imaml-compile-estimate-s", type=float, default=240.0)
    ap.add_argument("--imaml-inner-compile-estimate-s", type=float, default=90.0)
    ap.add_argument("--protonet-compile-estimate-s", type=float, default=60.0)
    ap.add_argument("--backend", default="inductor",
                    help="torch.compile backend of compiled and inner rows (aot_eager: a CPU "
                         "smoke test without kernel builds)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--jax-python", default=sys.executable,
                    help="interpreter for the JAX twins (needs numpy and jax)")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--md", default=None, help="markdown results")
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error(f"--warmup: expected >= 1, got {args.warmup}")
    if args.inner_steps is None:
        args.inner_steps = "2,3" if args.small else "5,10,20"
    try:
        args.inner_steps = [int(k) for k in args.inner_steps.split(",") if k]
        args.compiled_steps = {int(k) for k in args.compiled_steps.split(",") if k}
    except ValueError:
        ap.error(f"--inner-steps/--compiled-steps: expected comma lists of ints, got "
                 f"{args.inner_steps!r} / {args.compiled_steps!r}")
    args.algos = [a for a in args.algos.split(",") if a]
    for a in args.algos:
        if a not in ("imaml", "protonet"):
            ap.error(f"--algos: unknown algorithm {a!r} (expected imaml, protonet)")
    if args.tol is None:
        args.tol = 1e-9 if args.dtype == "float64" else 2e-2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    tf32 = args.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(f"torch {torch.__version__} on {device}{f' ({gpu})' if gpu else ''}, {args.dtype}, "
          f"TF32: matmul={torch.backends.cuda.matmul.allow_tf32} "
          f"cudnn={torch.backends.cudnn.allow_tf32}", flush=True)
    cfg = dict(channels=64, n_tasks=32, n_way=5, k_shot=1, n_query=15, size=28)
    if args.small:
        cfg.update(channels=8, n_tasks=2, n_query=3, size=16)
    hyper = dict(lam=args.lam, cg_steps=args.cg_steps, cg_damping=args.cg_damping,
                 inner_lr=args.inner_lr)
    print("config:", cfg, "imaml:", hyper, "K:", args.inner_steps, flush=True)
    tasks = make_tasks(cfg["n_tasks"], cfg["n_way"], cfg["k_shot"], cfg["n_query"], cfg["size"],
                       device, dtype)
    torch.manual_seed(0)
    classifier = conv_net(cfg["channels"], cfg["n_way"], cfg["size"]).to(device, dtype)
    embedder = embed_net(cfg["channels"], cfg["n_way"], cfg["size"]).to(device, dtype)
    results: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv or sys.argv[1:])),
        "config": cfg, "imaml": hyper, "device": str(device), "gpu": gpu, "dtype": args.dtype,
        "precision": args.precision, "torch": torch.__version__, "tol": args.tol,
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32,
                 "cudnn": torch.backends.cudnn.allow_tf32},
        "rows": [],
    }

    def elapsed() -> float:
        return time.perf_counter() - start

    def save() -> None:  # after every row: a run cut by a time limit keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
        if args.md:
            with open(args.md, "w") as f:
                f.write(markdown(results))

    # the row plan: JAX rows, eager rows (compared with JAX), compiled rows (iMAML's first)
    variants = {"imaml": args.imaml_variants.split(","),
                "protonet": args.protonet_variants.split(",")}
    for algo in args.algos:
        for v in variants[algo]:
            if v and parse_variant(v)[0] == "inner" and algo != "imaml":
                raise SystemExit(f"meta_breadth.py: {v!r}: inner variants are iMAML's "
                                 "(ProtoNet has no inner loop)")
            if v:
                parse_variant(v)  # unknown variants fail before anything runs
    plan = [(algo, k, v) for algo in args.algos
            for k in (args.inner_steps if algo == "imaml" else [None])
            for v in variants[algo] if v]
    jobs = ([j for j in plan if j[2] == "jax"]
            + [j for j in plan if not j[2].startswith(("jax", "compiled", "inner"))]
            + [j for j in plan if j[2].startswith("inner")]
            + [j for j in plan if j[2].startswith("compiled") and j[0] == "imaml"
               and j[1] in args.compiled_steps]
            + [j for j in plan if j[2].startswith("compiled") and j[0] == "protonet"])
    estimate = {"imaml": args.imaml_compile_estimate_s,
                "protonet": args.protonet_compile_estimate_s}

    learners: dict[tuple[str, int | None], Callable] = {}
    for algo in args.algos:
        for k in (args.inner_steps if algo == "imaml" else [None]):
            if algo == "imaml":
                learners[algo, k] = (lambda fn, k=k: imaml(fn, F.cross_entropy, inner_steps=k,
                                                           **hyper))
            else:
                learners[algo, k] = lambda fn: protonet(fn, n_way=cfg["n_way"])

    # torchfn eager's meta-gradient and loss per (algo, K): the reference of every row
    params = {"imaml": make_functional(classifier)[1], "protonet": make_functional(embedder)[1]}
    modules = {"imaml": classifier, "protonet": embedder}
    reference: dict = {}
    for algo, k in learners:
        g, loss, _ = build_call(learners[algo, k], modules[algo], "eager", set(), None)(
            params[algo], {}, tasks)
        reference[algo, k] = ({n: v.detach().clone() for n, v in g.items()}, float(loss))
    jax_grads: dict = {}
    bad = []

    for algo, k, name in jobs:
        kind, tokens, chunk, mode = parse_variant(name)
        if chunk is not None:
            raise SystemExit(f"meta_breadth.py: chunkN is not supported here ({name!r})")
        label = f"{algo}{'' if k is None else f' K={k}'} {name}"
        row: dict = {"algo": algo, "inner_steps": k, "variant": name}
        results["rows"].append(row)
        ref_g, ref_loss = reference[algo, k]
        est = args.imaml_inner_compile_estimate_s if kind == "inner" else estimate[algo]
        if kind in ("compiled", "inner") and elapsed() + est > args.budget_s:
            row["skipped"] = (f"budget: {elapsed():.0f} s so far + {est:.0f} s "
                              f"compile estimate > --budget-s {args.budget_s:.0f}")
            print(f"[{elapsed():6.1f} s] {label:34s} skipped ({row['skipped']})", flush=True)
            save()
            continue
        print(f"[{elapsed():6.1f} s] {label} ...", flush=True)
        if kind == "jax":
            settings = dict(algo=algo, dtype=args.dtype, precision=args.precision, n_blocks=4,
                            eps=EPS, inner_lr=args.inner_lr, inner_steps=k or 0, lam=args.lam,
                            cg_steps=args.cg_steps, cg_damping=args.cg_damping,
                            inner_loop=args.jax_inner_loop, n_way=cfg["n_way"], scale=1.0,
                            repeats=args.repeats, warmup=args.warmup)
            rec = run_jax(args.jax_python, modules[algo], tasks, settings)
            if "skipped" in rec:
                row.update(rec)
                print(f"[{elapsed():6.1f} s] {label:34s} skipped: {rec['skipped']}", flush=True)
                save()
                continue
            grads = rec.pop("grads")
            jax_grads[algo, k] = grads
            row.update(rec)
            row["rel_diff_vs_eager"] = max_rel_diff(grads, ref_g)
        else:
            torch._dynamo.reset()
            try:
                call = build_call(learners[algo, k], modules[algo], kind, tokens, mode,
                                  args.backend)

                def fn(call=call, p=params[algo]) -> dict[str, Tensor]:
                    g, loss, _ = call(p, {}, tasks)
                    return {**g, LOSS: loss}

                rec, out = timeit(fn, args.warmup, args.repeats, device,
                                  cudagraphs=mode in ("reduce-overhead", "max-autotune"))
            except Exception as e:  # a failed compile must not cost the other rows
                row["skipped"] = f"{type(e).__name__}: {str(e)[:2000]}"
                print(f"[{elapsed():6.1f} s] {label:34s} FAILED: {row['skipped'][:300]}",
                      flush=True)
                save()
                continue
            row.update(rec)
            row["loss"] = float(out.pop(LOSS))
            row["rel_diff_vs_eager"] = max_rel_diff(out, ref_g)
            if (algo, k) in jax_grads:
                row["rel_diff_vs_jax"] = max_rel_diff(
                    out, {n: torch.from_numpy(v) for n, v in jax_grads[algo, k].items()})
        row["loss_rel_diff_vs_eager"] = abs(row["loss"] - ref_loss) / max(abs(ref_loss), 1e-30)
        worst = max(row.get("rel_diff_vs_eager", 0.0), row.get("rel_diff_vs_jax", 0.0),
                    row["loss_rel_diff_vs_eager"])
        row["ok"] = worst <= args.tol
        if not row["ok"]:
            bad.append(label)
        peak = row.get("peak_bytes")
        vs_jax = row.get("rel_diff_vs_jax")
        print(f"[{elapsed():6.1f} s] {label:34s} {row['median_s'] * 1e3:9.2f} ms  peak "
              f"{'-' if peak is None else f'{peak / 2**20:.0f}'} MiB  first call "
              f"{row['first_call_s']:6.1f} s  rel diff vs eager {row['rel_diff_vs_eager']:.1e}"
              f"{'' if vs_jax is None else f' vs jax {vs_jax:.1e}'}  loss {row['loss']:.6f}"
              f"{'' if row['ok'] else '  MISMATCH'}", flush=True)
        save()

    results["memory_flat_in_k"] = memory_flatness(results["rows"])
    for variant, ratio in results["memory_flat_in_k"].items():
        print(f"iMAML peak memory, K={max(args.inner_steps)} / K={min(args.inner_steps)}: "
              f"{variant} {ratio:.3f}x", flush=True)
    results["mismatches"] = bad
    for line in speed_vs_jax(results["rows"]):
        print("JAX / torchfn:", line, flush=True)
    save()
    print(f"done in {elapsed():.0f} s" + (f"; MISMATCH in {bad}" if bad else ""), flush=True)
    return 1 if bad else 0


def memory_flatness(rows: list[dict]) -> dict[str, float]:
    """Per iMAML variant measured at 2+ K with a peak: peak(largest K) / peak(smallest K)."""
    by_variant: dict[str, dict[int, int]] = {}
    for r in rows:
        if r["algo"] == "imaml" and r.get("peak_bytes"):
            by_variant.setdefault(r["variant"], {})[r["inner_steps"]] = r["peak_bytes"]
    return {v: peaks[max(peaks)] / peaks[min(peaks)] for v, peaks in by_variant.items()
            if len(peaks) > 1}


def speed_vs_jax(rows: list[dict]) -> list[str]:
    """One line per (algo, K) with a JAX row: each timed torch variant's JAX / torchfn ratio."""
    timed = [r for r in rows if "median_s" in r]
    out = []
    for j in (r for r in timed if r["variant"] == "jax"):
        k = "" if j["inner_steps"] is None else f" K={j['inner_steps']}"
        pairs = [f"{r['variant']} {j['median_s'] / r['median_s']:.2f}x"
                 for r in timed if r["variant"] != "jax" and r["algo"] == j["algo"]
                 and r["inner_steps"] == j["inner_steps"]]
        out.append(f"{j['algo']}{k}: JAX {j['median_s'] * 1e3:.2f} ms; " + ", ".join(pairs))
    return out


def markdown(results: dict) -> str:
    """Return the results as a markdown page: header lines, then one table row per row."""
    cfg = results["config"]
    jax_version = next((r["jax"] for r in results["rows"] if "jax" in r), "not run")
    lines = [
        "# iMAML and ProtoNet outer steps: torchfn vs JAX (`benchmarks/meta_breadth.py`)", "",
        f"- Date: {results['date']}",
        f"- Device: {results['gpu'] or results['device']}; torch {results['torch']}; "
        f"jax {jax_version}; {results['dtype']}, precision {results['precision']} "
        f"(TF32 matmul={results['tf32']['matmul']}, cudnn={results['tf32']['cudnn']})",
        f"- Command: `{results['command']}`",
        f"- Config: {cfg}; iMAML {results['imaml']}",
        "- step = median of synchronized calls after warm-up; peak = torch "
        "`max_memory_allocated` over the timed calls / JAX `peak_bytes_in_use` of its process; "
        "rel. diff = max over params of max|g - g_ref| / max|g_ref| (meta-gradient).", "",
        "| algo | K | variant | step | peak memory | first call | rel. diff vs eager "
        "| rel. diff vs JAX | ok |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["rows"]:
        k = "" if r["inner_steps"] is None else str(r["inner_steps"])
        if "skipped" in r:
            lines.append(f"| {r['algo']} | {k} | {r['variant']} | skipped: "
                         f"{r['skipped'][:120].replace('|', '/')} | | | | | |")
            continue
        peak = r.get("peak_bytes")

        def fmt(x):
            return "-" if x is None else f"{x:.1e}"

        lines.append(
            f"| {r['algo']} | {k} | {r['variant']} | {r['median_s'] * 1e3:.2f} ms | "
            f"{'-' if peak is None else f'{peak / 2**20:.0f} MiB'} | {r['first_call_s']:.1f} s"
            f" | {fmt(r.get('rel_diff_vs_eager'))} | {fmt(r.get('rel_diff_vs_jax'))} | "
            f"{'yes' if r.get('ok') else 'MISMATCH'} |")
    lines += ["", "Speed against JAX (JAX step / torchfn step; > 1: torchfn faster):", ""]
    lines += [f"- {line}" for line in speed_vs_jax(results["rows"])] or ["- no pair measured"]
    flat = results.get("memory_flat_in_k", {})
    if flat:
        lines += ["", "iMAML peak memory at the largest K over the smallest: "
                  + ", ".join(f"{v} {x:.3f}x" for v, x in flat.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
