"""Attribution scores (per-sample gradient inner products, TracIn's core): torchfn vs materialised.

The score matrix ``S[i, j] = <grad l_i, grad l_j>`` between ``--train`` training samples and
``--query`` query samples, over every parameter, fp32 (TF32 off for matmuls and cuDNN). One
TracIn checkpoint term is ``lr * S``; influence functions with an identity Hessian are ``S``.

Workloads (random weights, random data; the loss is per-sample cross-entropy over 10 classes):

- ``cnn``: the CNN of ``benchmarks/persample.py`` (28x28x1 inputs; Conv(1->32, 3x3) ReLU
  MaxPool, Conv(32->64, 3x3) ReLU MaxPool, Linear(3136->128) ReLU, Linear(128->10); 421k
  parameters);
- ``transformer``: the 4-layer pre-LN encoder of ``benchmarks/persample.py`` (d_model 256,
  4 heads, MLP 1024, vocab 8192, sequence 128, mean-pooled classifier; 5.3M parameters) with
  the attention core written as ``softmax(q k^T / sqrt(d)) v`` (``torch.func.vmap`` has no
  batching rule for the fused SDPA kernels; both rows run the same function).

Rows, each computing the whole ``(n_train, n_query)`` matrix once per timed call:

- ``torchfn-ghost``: ``torchfn.persample.grad_inner_products(..., chunk_size=--chunk)``: one
  ghost pass (forward + backward of the summed loss) over the query set, then one per train
  chunk; per linear map the cheaper of the ghost form ``sum_{t,s} (a_it . a_js)(g_it . g_js)``
  and materialising both sides (the cost rule ``inner_route``; the note says which maps took
  which form); a layer the query side materialises is materialised once;
- ``materialized``: the textbook route: ``torch.func.vmap(torch.func.grad(loss))`` per-sample
  gradients of the query set flattened to ``(n_query, P)`` (in chunks), then per train chunk
  its ``(chunk, P)`` gradients and one ``(chunk, P) @ (P, n_query)`` matmul;
- ``kronfluence``, ``trak``: recorded as "not installed" unless the package imports (no
  adapter is written for them yet; an installed package is reported as such, not timed).

Correctness first: every row's matrix is compared with the materialised one (max |diff| / max
|S|), and a float64 check runs both routes on the first ``8 x 4`` samples (a float64 copy of
the model). Timing: ``_bench.time_calls`` (``--warmup`` calls, the first timed alone as
"first call", then the median of ``--repeats`` synchronized repeats); peak CUDA memory
(``max_memory_allocated``) over all calls of the row, reset per row. Speed-up: materialised
median / torchfn median (goal >= 5x). JSON (``--json``) and markdown (``--md``) are rewritten
after every row, so a run cut short keeps what it measured.

    python benchmarks/attribution.py --train 10000 --query 1000 --json attribution.json \\
        --md benchmarks/results/attribution-h100.md
    python benchmarks/attribution.py --tiny --device cpu          # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import device_name, set_tf32_off, time_calls
from persample import CNN

from torchfn.persample import _ghost_grads, grad_inner_products, make_ghost_model

WORKLOADS = ("cnn", "transformer")
METHODS = ("torchfn-ghost", "materialized", "kronfluence", "trak")
GOAL_SPEEDUP = 5.0
CHECK_TRAIN, CHECK_QUERY = 8, 4  # the float64 check's sizes


class Block(nn.Module):
    """persample.py's pre-LN block with the attention core in plain ops (vmap-friendly)."""

    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(x.shape[-1], -1))
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        x = x + self.proj((p @ v).transpose(1, 2).flatten(2))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, ff: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        h = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h).mean(1))


def configs(tiny: bool) -> dict[str, dict[str, Any]]:
    """Model sizes and train-chunk sizes per workload (``tiny``: the CPU smoke-test sizes)."""
    if tiny:
        return {"cnn": {"model": {"c1": 4, "c2": 8, "hidden": 16}, "chunk": 16},
                "transformer": {"model": {"vocab": 50, "seq": 16, "d": 16, "heads": 2,
                                          "ff": 32, "layers": 2}, "chunk": 16}}
    return {"cnn": {"model": {}, "chunk": 2000},
            "transformer": {"model": {"vocab": 8192, "seq": 128, "d": 256, "heads": 4,
                                      "ff": 1024, "layers": 4}, "chunk": 500}}


def build(name: str, cfg: dict[str, Any], n_train: int, n_query: int, device: torch.device
          ) -> tuple[nn.Module, tuple[Tensor, Tensor, Tensor, Tensor]]:
    torch.manual_seed(0)
    if name == "cnn":
        model: nn.Module = CNN(**cfg["model"])
        xs, xq = torch.randn(n_train, 1, 28, 28), torch.randn(n_query, 1, 28, 28)
    else:
        model = Transformer(**cfg["model"])
        vocab, seq = cfg["model"]["vocab"], cfg["model"]["seq"]
        xs, xq = torch.randint(0, vocab, (n_train, seq)), torch.randint(0, vocab, (n_query, seq))
    ys, yq = torch.randint(0, 10, (n_train,)), torch.randint(0, 10, (n_query,))
    data = tuple(t.to(device) for t in (xs, ys, xq, yq))
    return model.to(device), data  # type: ignore[return-value]


def xent_none(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


# --- the two routes: each returns a zero-argument callable giving the (n_train, n_query) matrix


def v_ghost(model: nn.Module, data: tuple[Tensor, ...], chunk: int
            ) -> tuple[Callable[[], Tensor], dict[str, Any]]:
    ghost, params, buffers = make_ghost_model(model)
    fallback = [n for n, k in ghost.layer_kinds.items() if k == "fallback"]
    assert not fallback, f"layers on the vmap fallback: {fallback}"
    xs, ys, xq, yq = data

    def run() -> Tensor:
        return grad_inner_products(ghost, xent_none, params, buffers, xs, ys, xq, yq,
                                   chunk_size=chunk)  # type: ignore[return-value]

    return run, {"layers": dict(sorted(_count(ghost.layer_kinds.values()).items()))}


def v_materialized(model: nn.Module, data: tuple[Tensor, ...], chunk: int
                   ) -> tuple[Callable[[], Tensor], dict[str, Any]]:
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    names = list(params)
    xs, ys, xq, yq = data

    def loss1(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, (p, buffers), (xi[None],))
        return F.cross_entropy(out, yi[None])

    psg = vmap(grad(loss1), in_dims=(None, 0, 0))

    def flat(x: Tensor, y: Tensor) -> Tensor:
        g = psg(params, x, y)
        return torch.cat([g.pop(k).reshape(x.shape[0], -1) for k in names], 1)  # (B, P)

    def run() -> Tensor:
        q = torch.cat([flat(xq[i:i + chunk], yq[i:i + chunk]) for i in range(0, len(yq), chunk)])
        out = q.new_empty(len(ys), len(yq))
        for lo in range(0, len(ys), chunk):
            out[lo:lo + chunk] = flat(xs[lo:lo + chunk], ys[lo:lo + chunk]) @ q.T
        return out

    return run, {}


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def routes(model: nn.Module, data: tuple[Tensor, ...], chunk: int) -> dict[str, int]:
    """Which form the cost rule picks for each linear map at the benchmark's sizes (one
    untimed call with ``inner_route`` observed): ``{"k x o, T=.., S=..: form": count}``."""
    seen: list[str] = []
    rule = _ghost_grads.inner_route

    def spy(x: Any, y: Any) -> str:
        r = rule(x, y)
        t = x.a.shape[1] if x.a.dim() == 3 else 1
        s = y.a.shape[1] if y.a.dim() == 3 else 1
        seen.append(f"{x.a.shape[-1] // x.groups}x{x.g.shape[-1] // x.groups}"
                    f"{'' if x.groups == 1 else f' (groups {x.groups})'} T={t} S={s}: {r}")
        return r

    xs, ys, xq, yq = data
    n = min(len(ys), chunk)
    _ghost_grads.inner_route = spy  # type: ignore[assignment]
    try:
        ghost, params, buffers = make_ghost_model(model)
        grad_inner_products(ghost, xent_none, params, buffers, xs[:n], ys[:n], xq, yq)
    finally:
        _ghost_grads.inner_route = rule  # type: ignore[assignment]
    return _count(seen)


def check_fp64(model: nn.Module, data: tuple[Tensor, ...]) -> float:
    """max |ghost - materialised| / max |materialised| in float64 on the first 8 x 4 samples."""
    import copy

    m64 = copy.deepcopy(model).double()
    xs, ys, xq, yq = (t.double() if t.is_floating_point() else t for t in data)
    small = (xs[:CHECK_TRAIN], ys[:CHECK_TRAIN], xq[:CHECK_QUERY], yq[:CHECK_QUERY])
    a = v_ghost(m64, small, 3)[0]()  # chunked: 3 train samples per pass
    b = v_materialized(m64, small, 3)[0]()
    return float((a - b).abs().max() / b.abs().max())


# --- rows ----------------------------------------------------------------------------------


def measure(fn: Callable[[], Any], device: torch.device, warmup: int,
            repeats: int) -> tuple[dict[str, float], Any]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # peak over all calls, the first included
    t = time_calls(fn, device, warmup=warmup, repeats=repeats)
    out = {"median_s": t.median_s, "p10_s": t.quantile_s(0.1), "p90_s": t.quantile_s(0.9),
           "first_call_s": t.first_call_s}
    if device.type == "cuda":
        out["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out, t.first_output


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_row(workload: str, method: str, cfg: dict[str, Any], device: torch.device,
            args: argparse.Namespace, notes: list[str], scores: dict[str, Tensor]
            ) -> dict[str, Any]:
    """One (workload, method) row; its error is recorded, never raised."""
    chunk = args.chunk or cfg["chunk"]
    row: dict[str, Any] = {"workload": workload, "method": method, "n_train": args.train,
                           "n_query": args.query, "chunk": chunk}
    if method in ("kronfluence", "trak"):
        module = {"kronfluence": "kronfluence", "trak": "trak"}[method]
        try:
            version = getattr(__import__(module), "__version__", "?")
        except ImportError:
            row["error"] = "not installed"
            return row
        row["error"] = (f"installed ({module} {version}) but no adapter in this script yet: "
                        "not timed")
        return row
    try:
        model, data = build(workload, cfg, args.train, args.query, device)
        row["params"] = sum(p.numel() for p in model.parameters())
        make = v_ghost if method == "torchfn-ghost" else v_materialized
        fn, info = make(model, data, chunk)
        row.update(info)
        timing, out = measure(fn, device, args.warmup, args.repeats)
        row.update(timing)
        scores[method] = out.detach()
        if method == "torchfn-ghost":
            row["routes"] = routes(model, data, chunk)
            if not args.no_check:
                row["fp64_max_rel_diff"] = check_fp64(model, data)
        del model, data, fn, out
    except Exception as e:  # OOM, a refused layer: record it, go on
        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row["error"] = ("out of memory: " if oom else "") + f"{type(e).__name__}: {first}"[:400]
        if not oom:
            notes.append(f"{workload}/{method}:\n{traceback.format_exc(limit=-4)}")
    return row


def compare(rows: list[dict[str, Any]], workload: str, scores: dict[str, Tensor]) -> None:
    """Fill the torchfn row's max rel diff vs the materialised matrix and the speed-up."""
    ghost = next((r for r in rows if r["workload"] == workload
                  and r["method"] == "torchfn-ghost"), None)
    mat = next((r for r in rows if r["workload"] == workload
                and r["method"] == "materialized"), None)
    if ghost is None or mat is None:
        return
    if "torchfn-ghost" in scores and "materialized" in scores:
        a, b = scores["torchfn-ghost"].double(), scores["materialized"].double()
        ghost["max_rel_diff_vs_materialized"] = float((a - b).abs().max() / b.abs().max())
    if "median_s" in ghost and "median_s" in mat:
        ghost["speedup_vs_materialized"] = mat["median_s"] / ghost["median_s"]
        if "peak_mem_mb" in ghost and "peak_mem_mb" in mat:
            ghost["mem_vs_materialized"] = ghost["peak_mem_mb"] / mat["peak_mem_mb"]


# --- output --------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("kronfluence", "trak"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError:
            out[mod] = "not installed"
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out


def _goal(x: float) -> str:
    return f"{x:.2f}x ({'ok' if x >= GOAL_SPEEDUP else 'MISS'}, goal >= {GOAL_SPEEDUP:g}x)"


def fmt_row(r: dict[str, Any]) -> str:
    head = f"{r['workload']:<12}{r['method']:<15}"
    if "error" in r:
        return head + f"  {r['error']}"
    mem = f"{r['peak_mem_mb']:9.0f} MiB" if "peak_mem_mb" in r else ""
    return (head + f"{r['median_s']:10.3f} s [{r['p10_s']:.3f}, {r['p90_s']:.3f}]{mem}"
            f"  first call {r['first_call_s']:.1f} s{_check_text(r)}")


def _check_text(r: dict[str, Any]) -> str:
    parts = []
    if "max_rel_diff_vs_materialized" in r:
        parts.append(f"max rel diff vs materialized {r['max_rel_diff_vs_materialized']:.1e}")
    if "fp64_max_rel_diff" in r:
        parts.append(f"fp64 check ({CHECK_TRAIN}x{CHECK_QUERY}) {r['fp64_max_rel_diff']:.1e}")
    if "speedup_vs_materialized" in r:
        parts.append(f"speed-up {_goal(r['speedup_vs_materialized'])}")
    if "mem_vs_materialized" in r:
        parts.append(f"memory {r['mem_vs_materialized']:.2f}x of materialized")
    return ("; " + "; ".join(parts)) if parts else ""


def to_markdown(result: dict[str, Any]) -> str:
    v = result["versions"]
    lines = [
        f"# Attribution scores (per-sample gradient inner products): torchfn vs materialised "
        f"({result['device']})", "",
        f"- Date: {result['date']}",
        f"- Device: {result['device']}; torch {v['torch']}"
        + (f", CUDA {v['cuda']}" if "cuda" in v else "")
        + f", Python {v['python']}; kronfluence {v['kronfluence']}, trak {v['trak']}",
        f"- Command: `{result['command']}`",
        "- Precision: fp32 parameters and compute, TF32 off (matmul and cuDNN).",
        f"- Task: the ({result['n_train']} x {result['n_query']}) matrix of <grad l_i, grad l_j> "
        "over all parameters (train x query), per-sample cross-entropy, random weights and data; "
        "one timed call computes the whole matrix (train in chunks of the row's chunk size).",
        f"- Timing: {result['warmup']} warm-up calls (the first timed alone: \"first call\"), then "
        f"the median of {result['repeats']} synchronized repeats; p10/p90 in brackets; peak CUDA "
        "memory (max_memory_allocated) over all calls of the row, reset per row (model and data "
        "included).",
        "- Checks: max |S - S_materialized| / max |S_materialized| over the whole fp32 matrix; "
        f"and both routes in float64 on the first {CHECK_TRAIN} x {CHECK_QUERY} samples.", "",
        "| workload | params | method | chunk | median s [p10, p90] | peak MiB | first call s | "
        "checks / speed-up | note |", "|---|---:|---|---:|---:|---:|---:|---|---|"]
    for r in result["results"]:
        params = f"{r['params']:,}" if "params" in r else "--"
        if "error" in r:
            lines.append(f"| {r['workload']} | {params} | {r['method']} | {r['chunk']} | -- | -- "
                         f"| -- | -- | {r['error'].replace('|', '/')} |")
            continue
        mem = f"{r['peak_mem_mb']:.0f}" if "peak_mem_mb" in r else "--"
        note = ""
        if r.get("layers"):
            note = "ghost layers " + ", ".join(f"{k} {n}" for k, n in r["layers"].items())
        if r.get("routes"):
            note += "; forms per linear map: " + ", ".join(
                f"{k} ({n})" for k, n in r["routes"].items())
        lines.append(f"| {r['workload']} | {params} | {r['method']} | {r['chunk']} | "
                     f"{r['median_s']:.3f} [{r['p10_s']:.3f}, {r['p90_s']:.3f}] | {mem} | "
                     f"{r['first_call_s']:.1f} | {_check_text(r)[2:].replace('|', '/')} | "
                     f"{note} |")
    if result["errors"]:
        lines += ["", "Tracebacks of the failed rows (last frames):", "", "```"]
        lines += [n.rstrip() for n in result["errors"]] + ["```"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    workloads, methods = args.workloads.split(","), args.methods.split(",")
    for given, allowed, what in [(workloads, WORKLOADS, "--workloads"),
                                 (methods, METHODS, "--methods")]:
        bad = [g for g in given if g not in allowed]
        if bad:
            raise SystemExit(f"{what}: unknown {bad}; expected a comma-separated subset of "
                             f"{', '.join(allowed)}")
    cfgs = configs(args.tiny)
    if args.seq:
        cfgs["transformer"]["model"]["seq"] = args.seq
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device": device_name(device),
        "versions": _versions(), "command": args.command, "tf32": set_tf32_off(),
        "tiny": args.tiny, "n_train": args.train, "n_query": args.query,
        "repeats": args.repeats, "warmup": args.warmup,
        "config": {w: cfgs[w] for w in workloads}, "results": [], "errors": []}
    rows, notes = result["results"], result["errors"]
    start = time.perf_counter()
    for w in workloads:
        scores: dict[str, Tensor] = {}
        for method in methods:
            if time.perf_counter() - start > args.budget_s:
                row = {"workload": w, "method": method, "n_train": args.train,
                       "n_query": args.query, "chunk": args.chunk or cfgs[w]["chunk"],
                       "error": f"skipped: time budget (--budget-s {args.budget_s:g}) spent"}
            else:
                row = run_row(w, method, cfgs[w], device, args, notes, scores)
                _free(device)
            rows.append(row)
            compare(rows, w, scores)
            print(fmt_row(row), flush=True)
            if args.json:  # rewritten per row: a run cut short keeps its rows
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=2))
            if args.md:
                args.md.parent.mkdir(parents=True, exist_ok=True)
                args.md.write_text(to_markdown(result))
        del scores
        _free(device)
    result["total_s"] = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.md:
        args.md.write_text(to_markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--train", type=int, default=None,
                        help="train samples (default 10000; --tiny 40)")
    parser.add_argument("--query", type=int, default=None,
                        help="query samples (default 1000; --tiny 8)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="train (and query, materialised) samples per pass (default per "
                             "workload: cnn 2000, transformer 500; --tiny 16)")
    parser.add_argument("--seq", type=int, default=None,
                        help="the transformer's sequence length (default 128; --tiny 16)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per row (default 5; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up calls per row, the first timed alone (default 2; --tiny 1)")
    parser.add_argument("--tiny", action="store_true", help="tiny models and sizes (CPU smoke)")
    parser.add_argument("--no-check", action="store_true", help="skip the float64 check")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="rows starting after this many seconds are skipped (recorded)")
    parser.add_argument("--json", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--md", type=Path, default=None,
                        help="write a markdown results file here (benchmarks/results/...)")
    args = parser.parse_args(argv)
    args.train = args.train or (40 if args.tiny else 10_000)
    args.query = args.query or (8 if args.tiny else 1000)
    args.repeats = args.repeats or (2 if args.tiny else 5)
    args.warmup = args.warmup or (1 if args.tiny else 2)
    args.command = "python benchmarks/attribution.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    print(f"device: {device_name(torch.device(args.device))}; {_versions()}", flush=True)
    result = run(args)
    print("torchfn vs materialised:")
    for r in result["results"]:
        if r["method"] == "torchfn-ghost" and "error" not in r:
            print(f"  {r['workload']}: {_check_text(r)[2:]}")
    for note in result["errors"]:
        print(note)
    print(f"total {result['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
