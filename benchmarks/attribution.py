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
- ``torchfn-projected``: ``grad_inner_products(..., projection=Projection(k=--proj-k,
  seed=0, factored=...), chunk_size=--chunk)``: an *approximation* (TRAK / LoGra random
  projections): linear maps applied once per sample (the CNN's two dense layers, the
  transformer's head) or at few positions kept exact as their factors (inputs with a ones
  column, output gradients; pair score ``(a_i . a_j)(g_i . g_j)``; ``--proj-factored``:
  ``on``, the default, ``off``: every map projected, or ``both``: one row each), the other
  linear maps the Kronecker-structured projection ``sum_t (g_it P_out)^T (a_it P_in)``
  (``(k, k)``, from the ghost pass's recorded inputs and output gradients, no per-sample
  gradient formed), embeddings by gathered rows of ``P_V``, other layers materialised and
  projected densely (or exact when they have at most ``k^2`` parameters); scores =
  ``projected_scores(train_feats, query_feats)``. Feature sizes per sample: projected
  features, factor numbers, their total (``features``) and the factored maps. Its accuracy is measured against the exact matrix (the
  ``torchfn-ghost`` row's, else the ``materialized`` one's): max |diff| / max |S|, relative
  Frobenius error, Spearman rank correlation of the train samples per query column (mean
  and min over queries) and top-m overlap per query column (m = min(100, n_train / 10)).
  Besides the whole-matrix time it times the stored-features use: the train features
  computed once (reported, with their size), then per call only the query features and one
  matmul;
- ``kronfluence`` (EK-FAC, its default) and ``kronfluence-identity`` (factor strategy
  ``identity``): kronfluence's own pipeline on the same model and data: a ``Task`` (train loss
  the summed cross-entropy, labels sampled from the model's softmax when kronfluence fits its
  true-Fisher factors; measurement the query's summed cross-entropy), ``prepare_model``,
  ``Analyzer.fit_all_factors`` on the train set (``per_device_batch_size=chunk``), then
  ``compute_pairwise_scores`` query x train (query batch ``--kf-query-batch``, default all
  queries: one pass over the train set; train batch ``chunk``); output under a temporary
  directory, progress bars and info logs off. Inputs are CPU ``TensorDataset``s that its
  DataLoader batches and moves to the device (its usual input path). Timed: ``--kf-warmup``
  runs (the first reported as "first call"), then the median of ``--kf-repeats`` runs, the
  factor fit and the pairwise scores each timed too. EK-FAC computes influence
  ``g_q^T (F + damping I)^-1 g_i``, not ``<g_i, g_q>``: time is compared only. ``identity``
  applies no preconditioning, so it gives plain ``<g_i, g_q>`` over the parameters kronfluence
  tracks (``nn.Linear``, ``nn.Conv2d``: all of the CNN's; the transformer without its
  embeddings and LayerNorms): checked against torchfn's ``grad_inner_products(per_layer=True)``
  summed over those layers (untimed), and for the CNN against the torchfn row's matrix too;
- ``trak``: recorded as "not installed" unless the package imports (no adapter yet; an
  installed package is reported as such, not timed).

Correctness first: every row's matrix is compared with the materialised one (max |diff| / max
|S|), and a float64 check runs both routes on the first ``8 x 4`` samples (a float64 copy of
the model). Timing: ``_bench.time_calls`` (``--warmup`` calls, the first timed alone as
"first call", then the median of ``--repeats`` synchronized repeats); peak CUDA memory
(``max_memory_allocated``) over all calls of the row, reset per row. Speed-up: materialised
median / torchfn median (goal >= 5x; for ``torchfn-projected`` too, with its accuracy beside it). JSON (``--json``) and markdown (``--md``) are rewritten
after every row, so a run cut short keeps what it measured.

    python benchmarks/attribution.py --train 10000 --query 1000 --json attribution.json \\
        --md benchmarks/results/attribution-h100.md
    python benchmarks/attribution.py --tiny --device cpu          # CPU smoke test
    python benchmarks/attribution.py --methods torchfn-ghost,materialized,torchfn-projected \
        --proj-k 32                                               # the projected row alone

kronfluence 1.0.1 (not a torchfn dependency) with everything it imports beyond torch, einops
and numpy (torchfn's own), tested on torch 2.13 CPU with all other packages blocked
(torchvision, huggingface_hub and psutil are in its or accelerate's metadata but never
imported): ``kronfluence-1.0.1-py3-none-any.whl``, ``einconv-0.1.0-py3-none-any.whl``,
``opt_einsum-3.4.0-py3-none-any.whl``, ``accelerate-1.15.0-py3-none-any.whl``,
``safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl``,
``tqdm-4.70.1-py3-none-any.whl``, ``packaging-26.4-py3-none-any.whl``,
``pyyaml-6.0.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl``
(plus ``numpy-2.4.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl`` where numpy
is missing). Installed beside torch without touching it, then put after the repository::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
        kronfluence==1.0.1 einconv==0.1.0 opt-einsum==3.4.0 accelerate==1.15.0 \
        safetensors==0.8.0 tqdm==4.70.1 packaging==26.4 pyyaml==6.0.4
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=$PWD:/tmp/site python3 benchmarks/attribution.py ...
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import shlex
import statistics
import sys
import tempfile
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

from _bench import Timing, device_name, set_tf32_off, sync, time_calls
from persample import CNN

from torchfn.persample import (
    ProjectedGrads,
    Projection,
    _ghost_grads,
    grad_inner_products,
    make_ghost_model,
    project_grads,
    projected_scores,
)

WORKLOADS = ("cnn", "transformer")
METHODS = ("torchfn-ghost", "materialized", "torchfn-projected", "kronfluence",
           "kronfluence-identity", "trak")
EXACT = ("torchfn-ghost", "materialized")  # the rows whose matrix is exact (fp32 rounding)
GOAL_SPEEDUP = 5.0
DEFAULT_PROJ_K = 64
TOP_M = 100  # the projected row's top-m overlap: m = min(TOP_M, n_train // 10)
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


def v_projected(model: nn.Module, data: tuple[Tensor, ...], chunk: int, k: int,
                factored: bool) -> tuple[Callable[[], Tensor], dict[str, Any]]:
    """``grad_inner_products(..., projection=Projection(k, seed=0, factored=factored))``:
    train and query features from one ghost pass each (per chunk), then one matmul per chunk
    (plus two GEMMs per factored map)."""
    ghost, params, buffers = make_ghost_model(model)
    xs, ys, xq, yq = data
    proj = Projection(k=k, seed=0, factored=factored)

    def run() -> Tensor:
        return grad_inner_products(ghost, xent_none, params, buffers, xs, ys, xq, yq,
                                   chunk_size=chunk, projection=proj)  # type: ignore[return-value]

    n = min(2, len(ys))
    f = project_grads(ghost, xent_none, params, buffers, xs[:n], ys[:n], projection=proj)
    return run, {"proj_k": k, "proj_factored": factored, "features": f.num_features,
                 "projected_features": int(f.projected.shape[1]),  # type: ignore[union-attr]
                 "factored_features": f.num_features - int(f.projected.shape[1]),  # type: ignore[union-attr]
                 "factored_maps": {key: f"{a.shape[-1]}+{g.shape[-1]}"
                                   + (f" T={a.shape[1]}" if a.dim() > 2 else "")
                                   for key, (a, g) in f.factored.items()}}


def stored_train(model: nn.Module, data: tuple[Tensor, ...], chunk: int, k: int,
                 factored: bool, device: torch.device, warmup: int, repeats: int
                 ) -> dict[str, float]:
    """The stored-features use: train features computed once (timed alone), then per timed call
    only the query's features and ``projected_scores(train_feats, query_feats)``."""
    ghost, params, buffers = make_ghost_model(model)
    xs, ys, xq, yq = data
    proj = Projection(k=k, seed=0, factored=factored)

    def train() -> ProjectedGrads:
        return project_grads(ghost, xent_none, params, buffers, xs, ys, projection=proj,
                             chunk_size=chunk)

    t = time_calls(train, device, warmup=1, repeats=1)  # warm: the time of a second pass
    feats = t.first_output

    def score() -> Tensor:
        q = project_grads(ghost, xent_none, params, buffers, xq, yq, projection=proj,
                          chunk_size=chunk)
        return projected_scores(feats, q)  # type: ignore[return-value]

    s = time_calls(score, device, warmup=warmup, repeats=repeats)
    p = feats.projected
    size = p.numel() * p.element_size() + sum(v.numel() * v.element_size()
                                              for ag in feats.factored.values() for v in ag)
    return {"train_features_s": t.median_s, "stored_train_median_s": s.median_s,
            "train_features_mb": size / 2**20}


def rank_agreement(approx: Tensor, exact: Tensor, m: int) -> dict[str, float]:
    """Per query column (ranking the train samples): mean Spearman correlation and mean
    top-``m`` overlap (|top-m of approx & top-m of exact| / m), plus the matrix's max |diff|
    / max |S| and relative Frobenius error."""
    a, e = approx.double(), exact.double()

    def ranks(x: Tensor) -> Tensor:
        return x.argsort(0).argsort(0).double()

    ra, re = ranks(a), ranks(e)
    ra, re = ra - ra.mean(0), re - re.mean(0)
    spearman = (ra * re).sum(0) / (ra.norm(dim=0) * re.norm(dim=0)).clamp_min(1e-300)
    ta, te = a.topk(m, 0).indices, e.topk(m, 0).indices  # (m, n_query)
    hits = (ta[:, None, :] == te[None, :, :]).any(1).double().sum(0) / m
    return {"max_rel_diff_vs_exact": float((a - e).abs().max() / e.abs().max()),
            "rel_fro_err": float((a - e).norm() / e.norm()),
            "spearman": float(spearman.mean()), "spearman_min": float(spearman.min()),
            "top_m": m, "top_m_overlap": float(hits.mean())}


# --- kronfluence: its own pipeline (Task, prepare_model, Analyzer), timed in two phases


KF_STRATEGY = {"kronfluence": "ekfac", "kronfluence-identity": "identity"}


def _kf_task(kronfluence: Any) -> Any:
    """kronfluence's ``Task`` for the script's loss: summed cross-entropy for training (labels
    sampled from the model's softmax when kronfluence asks, ``sample=True``: the true Fisher of
    its EK-FAC factors), the query's summed cross-entropy as the measurement. Per-sample
    gradients of a summed loss are those of each sample's own loss, as in the other rows."""

    class XentTask(kronfluence.Task):
        def compute_train_loss(self, batch: Any, model: nn.Module, sample: bool = False
                               ) -> Tensor:
            x, y = batch
            logits = model(x)
            if sample:
                with torch.no_grad():
                    y = torch.multinomial(torch.softmax(logits.detach(), -1), 1).flatten()
            return F.cross_entropy(logits, y, reduction="sum")

        def compute_measurement(self, batch: Any, model: nn.Module) -> Tensor:
            x, y = batch
            return F.cross_entropy(model(x), y, reduction="sum")

    return XentTask()


def v_kronfluence(model: nn.Module, data: tuple[Tensor, ...], chunk: int, strategy: str,
                  device: torch.device, query_batch: int, workdir: Path
                  ) -> tuple[Callable[[], tuple[Tensor, float, float]], dict[str, Any]]:
    """kronfluence's standard pipeline on ``model`` (wrapped in place by ``prepare_model``):
    ``Analyzer.fit_all_factors`` (``strategy``) on the train set, then
    ``compute_pairwise_scores`` query x train. The returned callable runs both (outputs
    overwritten under ``workdir``) and gives ``(S (n_train, n_query), fit_s, score_s)``.
    Datasets are CPU ``TensorDataset``s that kronfluence's DataLoader batches and moves to the
    device (its usual input path); train batches of ``chunk``, query batches of
    ``query_batch``; factors and scores in fp32 (its defaults, eigendecomposition fp64)."""
    import logging
    import warnings

    import kronfluence
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.module import TrackedModule
    from kronfluence.utils.dataset import DataLoaderKwargs

    xs, ys, xq, yq = (t.cpu() for t in data)
    train = torch.utils.data.TensorDataset(xs, ys)
    query = torch.utils.data.TensorDataset(xq, yq)
    task = _kf_task(kronfluence)
    model = prepare_model(model.eval(), task)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.cuda.amp.GradScaler deprecation and the like
        analyzer = Analyzer(analysis_name="attribution", model=model, task=task,
                            cpu=device.type == "cpu", log_level=logging.WARNING,
                            disable_tqdm=True, output_dir=str(workdir))
    loader = DataLoaderKwargs(num_workers=0)
    factor_args = FactorArguments(strategy=strategy)
    score_args = ScoreArguments()

    def run() -> tuple[Tensor, float, float]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            analyzer.fit_all_factors(factors_name=strategy, dataset=train,
                                     per_device_batch_size=chunk, dataloader_kwargs=loader,
                                     factor_args=factor_args, overwrite_output_dir=True)
            sync(device)
            t1 = time.perf_counter()
            analyzer.compute_pairwise_scores(
                scores_name=strategy, factors_name=strategy, query_dataset=query,
                train_dataset=train, per_device_query_batch_size=query_batch,
                per_device_train_batch_size=chunk, dataloader_kwargs=loader,
                score_args=score_args, overwrite_output_dir=True)
            s = analyzer.load_pairwise_scores(scores_name=strategy)["all_modules"]
            s = s.to(device).T  # kronfluence's (n_query, n_train) -> (n_train, n_query)
            sync(device)
            t2 = time.perf_counter()
        return s, t1 - t0, t2 - t1

    tracked = [m for m in model.modules() if isinstance(m, TrackedModule)]
    return run, {"kronfluence_strategy": strategy, "query_batch": query_batch,
                 "tracked_modules": len(tracked),
                 "tracked_params": sum(p.numel() for m in tracked
                                       for p in m.original_module.parameters())}


def measure_kf(fn: Callable[[], tuple[Tensor, float, float]], device: torch.device,
               warmup: int, repeats: int) -> tuple[dict[str, float], Tensor]:
    """``warmup`` untimed-for-the-median runs (the first one reported as "first call"), then
    ``repeats`` runs: medians of the whole pipeline, of its factor fit and of its scores."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first: Any = None
    fits, scores_s, totals = [], [], []
    for i in range(warmup + repeats):
        s, fit_s, score_s = fn()
        if i == 0:
            first, first_s = s.detach(), fit_s + score_s
        if i >= warmup:
            fits.append(fit_s)
            scores_s.append(score_s)
            totals.append(fit_s + score_s)
        del s
    t = Timing(totals, first_s)
    out = {"median_s": t.median_s, "p10_s": t.quantile_s(0.1), "p90_s": t.quantile_s(0.9),
           "first_call_s": first_s, "fit_median_s": statistics.median(fits),
           "score_median_s": statistics.median(scores_s)}
    if device.type == "cuda":
        out["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out, first


def tracked_reference(model: nn.Module, data: tuple[Tensor, ...], chunk: int) -> Tensor:
    """torchfn's ``(n_train, n_query)`` inner products over the parameters kronfluence tracks
    (its ``nn.Linear`` and ``nn.Conv2d`` modules): ``grad_inner_products(per_layer=True)``
    summed over those layers (embeddings and norms left out)."""
    ghost, params, buffers = make_ghost_model(model)
    xs, ys, xq, yq = data
    per = grad_inner_products(ghost, xent_none, params, buffers, xs, ys, xq, yq,
                              chunk_size=chunk, per_layer=True)
    keep = [n for n in per  # type: ignore[union-attr]
            if isinstance(model.get_submodule(n), (nn.Linear, nn.Conv2d))]
    return sum(per[n] for n in keep)  # type: ignore[index, return-value]


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
            args: argparse.Namespace, notes: list[str], scores: dict[str, Tensor],
            proj_k: int | None = None, proj_factored: bool = True) -> dict[str, Any]:
    """One (workload, method) row (``torchfn-projected``: at ``proj_k``, ``proj_factored``);
    its error is recorded, never raised."""
    chunk = args.chunk or cfg["chunk"]
    row: dict[str, Any] = {"workload": workload, "method": method, "n_train": args.train,
                           "n_query": args.query, "chunk": chunk}
    if proj_k is not None:
        row["proj_k"], row["proj_factored"] = proj_k, proj_factored
    if method == "trak":
        try:
            version = getattr(__import__("trak"), "__version__", "?")
        except ImportError:
            row["error"] = "not installed"
            return row
        row["error"] = f"installed (trak {version}) but no adapter in this script yet: not timed"
        return row
    if method in KF_STRATEGY:
        try:
            import kronfluence  # noqa: F401
        except ImportError as e:
            row["error"] = f"not installed ({type(e).__name__}: {e})"[:400]
            return row
        return _kf_row(row, workload, method, cfg, chunk, device, args, notes, scores)
    try:
        model, data = build(workload, cfg, args.train, args.query, device)
        row["params"] = sum(p.numel() for p in model.parameters())
        if method == "torchfn-projected":
            assert proj_k is not None
            fn, info = v_projected(model, data, chunk, proj_k, proj_factored)
        else:
            fn, info = (v_ghost if method == "torchfn-ghost" else v_materialized)(model, data,
                                                                                   chunk)
        row.update(info)
        timing, out = measure(fn, device, args.warmup, args.repeats)
        row.update(timing)
        scores[_score_key(method, proj_k, proj_factored)] = out.detach()
        del fn, out
        if method == "torchfn-projected":
            _free(device)
            row.update(stored_train(model, data, chunk, proj_k,  # type: ignore[arg-type]
                                    proj_factored, device, args.warmup, args.repeats))
        if method == "torchfn-ghost":
            row["routes"] = routes(model, data, chunk)
            if not args.no_check:
                row["fp64_max_rel_diff"] = check_fp64(model, data)
        del model, data
    except Exception as e:  # OOM, a refused layer: record it, go on
        _record_error(row, e, f"{workload}/{method}", notes)
    return row


def _record_error(row: dict[str, Any], e: Exception, where: str, notes: list[str]) -> None:
    """``row["error"]``: the exception's type and first line (``out of memory: `` first for a
    CUDA OOM); a traceback goes to ``notes`` unless it was an OOM."""
    oom = isinstance(e, torch.cuda.OutOfMemoryError)
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    row["error"] = ("out of memory: " if oom else "") + f"{type(e).__name__}: {first}"[:400]
    if not oom:
        notes.append(f"{where}:\n{traceback.format_exc(limit=-4)}")


def _kf_row(row: dict[str, Any], workload: str, method: str, cfg: dict[str, Any], chunk: int,
            device: torch.device, args: argparse.Namespace, notes: list[str],
            scores: dict[str, Tensor]) -> dict[str, Any]:
    """A kronfluence row (``KF_STRATEGY[method]``); the identity strategy's scores are checked
    against torchfn's over the same (tracked) parameters. Errors recorded, never raised."""
    import copy

    query_batch = min(args.query, args.kf_query_batch or args.query)
    row["query_batch"] = query_batch
    try:
        model, data = build(workload, cfg, args.train, args.query, device)
        row["params"] = sum(p.numel() for p in model.parameters())
        ref_model = copy.deepcopy(model) if method == "kronfluence-identity" else None
        with tempfile.TemporaryDirectory(prefix="attribution-kf-") as workdir:
            fn, info = v_kronfluence(model, data, chunk, KF_STRATEGY[method], device,
                                     query_batch, Path(workdir))
            row.update(info)
            timing, out = measure_kf(fn, device, args.kf_warmup, args.kf_repeats)
        row.update(timing)
        del fn, model
        _free(device)
        if ref_model is not None:  # the apples-to-apples check: same parameters, same score
            ref = tracked_reference(ref_model, data, chunk).double()
            row["max_rel_diff_vs_torchfn"] = float((out.double() - ref).abs().max()
                                                   / ref.abs().max())
            if "torchfn-ghost" in scores and row["tracked_params"] == row["params"]:
                full = scores["torchfn-ghost"].double()
                row["max_rel_diff_vs_torchfn_row"] = float((out.double() - full).abs().max()
                                                           / full.abs().max())
            del ref
        del ref_model, data, out
    except Exception as e:  # OOM, an unsupported layer: record it, go on
        _record_error(row, e, f"{workload}/{method}", notes)
    return row


def _score_key(method: str, proj_k: int | None, proj_factored: bool = True) -> str:
    return method if proj_k is None else f"{method}:k={proj_k}:factored={proj_factored}"


def compare(rows: list[dict[str, Any]], workload: str, scores: dict[str, Tensor]) -> None:
    """Fill the torchfn row's max rel diff vs the materialised matrix and the speed-up, and each
    kronfluence row's time over torchfn's (``torchfn_speedup``: time only, see the notes)."""
    ghost = next((r for r in rows if r["workload"] == workload
                  and r["method"] == "torchfn-ghost"), None)
    mat = next((r for r in rows if r["workload"] == workload
                and r["method"] == "materialized"), None)
    exact = next((m for m in EXACT if m in scores), None)
    for proj in rows:
        if (proj["workload"] != workload or proj["method"] != "torchfn-projected"
                or "error" in proj):
            continue
        key = _score_key("torchfn-projected", proj["proj_k"], proj["proj_factored"])
        if key in scores and exact is not None and "top_m_overlap" not in proj:
            n_train = scores[exact].shape[0]
            proj.update(rank_agreement(scores[key], scores[exact],
                                       max(1, min(TOP_M, n_train // 10))))
            proj["exact_row"] = exact
        for base in (mat, ghost):
            if base is not None and "median_s" in proj and "median_s" in base:
                proj[f"speedup_vs_{base['method']}"] = base["median_s"] / proj["median_s"]
                if "stored_train_median_s" in proj:
                    proj[f"stored_speedup_vs_{base['method']}"] = (
                        base["median_s"] / proj["stored_train_median_s"])
    for r in rows:
        if (r["workload"] == workload and r["method"] in KF_STRATEGY and ghost is not None
                and "median_s" in r and "median_s" in ghost):
            r["torchfn_speedup"] = r["median_s"] / ghost["median_s"]
            r["torchfn_speedup_scores_only"] = r["score_median_s"] / ghost["median_s"]
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
    head = f"{r['workload']:<12}{r['method']:<21}"
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
    if "top_m_overlap" in r:
        parts.append(f"k={r['proj_k']} ({r['features']:,} features: {r['projected_features']:,} "
                     f"projected + {r['factored_features']:,} exact factors): vs exact max rel diff "
                     f"{r['max_rel_diff_vs_exact']:.1e}, rel Frobenius {r['rel_fro_err']:.1e}, "
                     f"Spearman {r['spearman']:.3f} (min {r['spearman_min']:.3f}), top-"
                     f"{r['top_m']} overlap {r['top_m_overlap']:.3f}")
    if "speedup_vs_materialized" in r:
        parts.append(f"speed-up {_goal(r['speedup_vs_materialized'])}")
    if "speedup_vs_torchfn-ghost" in r:
        parts.append(f"{r['speedup_vs_torchfn-ghost']:.2f}x torchfn-ghost")
    if "stored_train_median_s" in r:
        parts.append(f"train features stored: {r['train_features_s']:.3f} s once "
                     f"({r['train_features_mb']:.0f} MiB), then {r['stored_train_median_s']:.3f}"
                     " s per query set"
                     + (f" ({r['stored_speedup_vs_materialized']:.1f}x materialized)"
                        if "stored_speedup_vs_materialized" in r else ""))
    if "mem_vs_materialized" in r:
        parts.append(f"memory {r['mem_vs_materialized']:.2f}x of materialized")
    if "fit_median_s" in r:
        parts.append(f"factor fit {r['fit_median_s']:.3f} s + pairwise scores "
                     f"{r['score_median_s']:.3f} s")
    if "max_rel_diff_vs_torchfn" in r:
        parts.append("max rel diff vs torchfn over the tracked parameters "
                     f"{r['max_rel_diff_vs_torchfn']:.1e}")
    if "max_rel_diff_vs_torchfn_row" in r:
        parts.append(f"vs the torchfn row {r['max_rel_diff_vs_torchfn_row']:.1e}")
    if "torchfn_speedup" in r:
        parts.append(f"torchfn-ghost {r['torchfn_speedup']:.2f}x faster "
                     f"({r['torchfn_speedup_scores_only']:.2f}x vs the scores phase alone)")
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
        f"and both routes in float64 on the first {CHECK_TRAIN} x {CHECK_QUERY} samples.",
        "- kronfluence rows: its own pipeline (`Task` with summed cross-entropy, `prepare_model`, "
        "`Analyzer.fit_all_factors` on the train set, `compute_pairwise_scores` query x train, "
        "factors and scores written under a temporary directory, CPU `TensorDataset`s batched "
        "by its DataLoader: its times include that input path and its file writes); median s "
        "= factor fit + pairwise scores, each phase's median in the checks column. `kronfluence` (EK-FAC, its default) computes influence "
        "`g_q^T (F + damping I)^-1 g_i` (F: its EK-FAC approximation of the Fisher, labels sampled from the model), a different score from the `<g_i, g_q>` of the other "
        "rows: only its time is compared. `kronfluence-identity` (strategy `identity`: no "
        "factors, no preconditioning) computes plain `<g_i, g_q>` over the parameters "
        "kronfluence tracks (`nn.Linear`, `nn.Conv2d`; the transformer's embeddings and "
        "LayerNorms are left out): it is checked against torchfn's `grad_inner_products("
        "per_layer=True)` summed over the same layers (max |diff| / max |S|).",
        "- `torchfn-projected` rows: **approximate** scores, `grad_inner_products(..., "
        "projection=Projection(k, seed=0, factored=...))` (`factored=True`: linear maps "
        "applied once per sample, or at few positions, kept exact as their factors, inputs "
        "with a ones column and output gradients, pair score (a_i . a_j)(g_i . g_j); every "
        "other linear map, or every one with `factored=False`, a Kronecker-structured "
        "Rademacher projection of the per-sample gradient formed from the recorded activations "
        "and output gradients, up to k^2 features; embeddings by gathered rows; other layers "
        "dense or exact; feature sizes per sample in the checks column): their error vs the exact matrix is in the checks column (max |diff| / max |S|, "
        "relative Frobenius error, Spearman rank correlation of the train samples per query: "
        "mean and min, top-m overlap per query); the stored-features use (train features once, "
        "then query features + `projected_scores` per call) is timed too.", "",
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
        if r["method"] == "torchfn-projected":
            note = (f"Projection(k={r['proj_k']}, seed=0, kind='rademacher', "
                    f"factored={r['proj_factored']})")
            if r.get("factored_maps"):
                note += "; exact as factors (d_in+1 + d_out): " + ", ".join(
                    f"{k} {v}" for k, v in r["factored_maps"].items())
        if r["method"] in KF_STRATEGY:
            note = (f"strategy {r['kronfluence_strategy']}: "
                    + ("EK-FAC influence (preconditioned scores, not <grad, grad>: time "
                       "compared only)" if r["kronfluence_strategy"] == "ekfac" else
                       "no preconditioning: plain <grad, grad>")
                    + f"; tracks {r['tracked_modules']} Linear/Conv2d modules, "
                    f"{r['tracked_params']:,} of the {r['params']:,} parameters; query batch "
                    f"{r['query_batch']}; {result['kf_repeats']} run(s) after "
                    f"{result['kf_warmup']} warm-up")
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
        "repeats": args.repeats, "warmup": args.warmup, "kf_repeats": args.kf_repeats,
        "kf_warmup": args.kf_warmup, "kf_query_batch": args.kf_query_batch,
        "config": {w: cfgs[w] for w in workloads}, "results": [], "errors": []}
    rows, notes = result["results"], result["errors"]
    start = time.perf_counter()
    for w in workloads:
        scores: dict[str, Tensor] = {}
        todo = [(m, k, f) for m in methods
                for k in (args.proj_k if m == "torchfn-projected" else [None])
                for f in (args.proj_factored if m == "torchfn-projected" else [True])]
        for method, proj_k, proj_factored in todo:
            if time.perf_counter() - start > args.budget_s:
                row = {"workload": w, "method": method, "n_train": args.train,
                       "n_query": args.query, "chunk": args.chunk or cfgs[w]["chunk"],
                       "error": f"skipped: time budget (--budget-s {args.budget_s:g}) spent"}
                if proj_k is not None:
                    row["proj_k"], row["proj_factored"] = proj_k, proj_factored
            else:
                row = run_row(w, method, cfgs[w], device, args, notes, scores, proj_k,
                              proj_factored)
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
    parser.add_argument("--kf-repeats", type=int, default=None,
                        help="timed runs of each kronfluence pipeline (default 3; --tiny 1)")
    parser.add_argument("--kf-warmup", type=int, default=1,
                        help="kronfluence runs before those, the first timed alone (default 1)")
    parser.add_argument("--kf-query-batch", type=int, default=None,
                        help="kronfluence's per_device_query_batch_size (default: all queries, "
                             "one pass over the train set)")
    parser.add_argument("--proj-k", default=str(DEFAULT_PROJ_K),
                        help="torchfn-projected: projected size per side of each linear map "
                             f"(Projection(k=...); default {DEFAULT_PROJ_K}); a comma-separated "
                             "list gives one row per k")
    parser.add_argument("--proj-factored", choices=("on", "off", "both"), default="on",
                        help="torchfn-projected: keep linear maps applied once per sample (or "
                             "at few positions) exact as factors (Projection(factored=True); "
                             "default on), project them too (off), or one row each (both)")
    parser.add_argument("--tiny", action="store_true", help="tiny models and sizes (CPU smoke)")
    parser.add_argument("--no-check", action="store_true", help="skip the float64 check")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="rows starting after this many seconds are skipped (recorded)")
    parser.add_argument("--json", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--md", type=Path, default=None,
                        help="write a markdown results file here (benchmarks/results/...)")
    args = parser.parse_args(argv)
    try:
        args.proj_k = [int(k) for k in str(args.proj_k).split(",")]
        if any(k < 1 for k in args.proj_k):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--proj-k {args.proj_k}: expected positive ints, comma-separated "
                         "(e.g. 32 or 32,64,128)") from None
    args.proj_factored = {"on": [True], "off": [False], "both": [False, True]}[args.proj_factored]
    args.train = args.train or (40 if args.tiny else 10_000)
    args.query = args.query or (8 if args.tiny else 1000)
    args.repeats = args.repeats or (2 if args.tiny else 5)
    args.warmup = args.warmup or (1 if args.tiny else 2)
    args.kf_repeats = args.kf_repeats or (1 if args.tiny else 3)
    args.command = "python benchmarks/attribution.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    print(f"device: {device_name(torch.device(args.device))}; {_versions()}", flush=True)
    result = run(args)
    print("torchfn vs materialised:")
    for r in result["results"]:
        if r["method"] in ("torchfn-ghost", "torchfn-projected") and "error" not in r:
            print(f"  {r['workload']} {r['method']}: {_check_text(r)[2:]}")
    for r in result["results"]:
        if r["method"] in KF_STRATEGY and "error" not in r:
            print(f"  {r['workload']} vs {r['method']}: {_check_text(r)[2:]}")
    for note in result["errors"]:
        print(note)
    print(f"total {result['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
