"""Weak scaling of torchfn.distributed over 1..N GPUs: four workloads, eager and compiled.

Every workload runs at each world size ``W`` of ``--world`` (default: 1, 2, 4, 8 up to
``torch.cuda.device_count()``) with the SAME per-process work (weak scaling: each rank keeps
the 1-process local batch / tasks / members, so the global work grows with ``W``)::

    efficiency(W) = throughput(W) / (W x throughput(1))

Workloads (realistic, GPU-bound sizes on an H100; ``--small`` shrinks them for a CPU smoke run):

- ``data_parallel``: a 8-layer pre-LN decoder (d=1024, 16 heads, vocab 8192, ~117M params),
  12 sequences x 1024 tokens per rank (nanoGPT's per-GPU micro-batch for GPT-2 small;
  ``--lm-batch 8x256`` gives the smaller, host-bound step measured before), Adam.
  Variants: ``eager`` and ``compiled``
  (:func:`make_data_parallel_train_step`, bucketed all-reduce after the backward),
  ``overlap`` (eager, ``overlap_backward=True``: each parameter's all-reduce launched from
  its gradient hook during the backward), ``sharded`` and
  ``sharded-compiled`` (:func:`make_sharded_train_step`: all-gather, reduce-scatter).
- ``meta``: second-order MAML, the 4-block conv net of ``benchmarks/meta.py`` (64 channels),
  5-way 1-shot, 15 queries, 5 inner steps, 32 tasks per rank
  (:func:`make_distributed_meta_train_step`). ``inner``: the same with ``compile="inner"``
  (inner step and query loss compiled once each, convs unfolded by default; about a minute
  of Inductor per process). ``compiled`` is opt-in: Inductor needs 160-300 s per process for
  the whole unrolled graph (``benchmarks/results/meta-h100.md``).
- ``ensemble``: 32 MLP members per rank (1024-2048-2048-10), 1024 examples per member, Adam
  (:func:`make_ensemble_train_step` on this rank's members; no communication).
- ``dpsgd``: ghost-clipped DP-SGD (:class:`DistributedDPStep`) on a 4-layer pre-LN decoder
  (d=512, vocab 8192, ~21M params), 32 sequences x 128 tokens per rank.

Compiled rows use ``torch.compile(fullgraph=True)`` with Inductor's compute/communication
reordering on (``--overlap``, default ``reorder``: ``reorder_for_compute_comm_overlap`` with
the passes ``reorder_communication_preserving_peak_memory``, ``sink_waits_iterative``,
``reorder_communication_preserving_peak_memory``; ``schedule``: the ATen-graph overlap
scheduler ``aten_distributed_optimizations.enable_overlap_scheduling``; ``none``). Their
1-process baseline is the compiled single-process step under the same settings.

Each process: its own GPU only (``CUDA_VISIBLE_DEVICES`` set per rank, so it is ``cuda:0`` in
every process and compiled rows share one Inductor cache; ``--all-gpus-visible``: every GPU
visible, ``cuda:<rank>``), CPU threads ``max(1, cores // W)`` and (unless
``--no-cpu-pin``) its own slice of the CPU cores, so ranks do not fight for the host. TF32 is
OFF (``_bench.set_tf32_off``: fp32 matmul and cuDNN). Timing (``_bench.time_calls``, wall
clock): 2 warm-up calls (the first, with compilation, reported as ``first_call_s``), one call
to size the sample so a repeat lasts about ``--budget-s / 4`` (the same count on every rank),
3 more warm-up calls, then the median of 5 repeats after a barrier; the slowest rank's time
counts, and ``spread`` ((max - min) / median of the repeats) flags unsteady rows.

At every ``W > 1`` the collectives alone are timed too (``comm_floor``: one fp32 all-reduce,
all-gather and reduce-scatter of each LM's parameter bytes, with nccl-tests' bus bandwidth):
the communication a step pays unless it overlaps it. ``--trace DIR`` profiles 3 more steps of
every row (Chrome trace per rank; NCCL vs other GPU ms per step, host syncs per step).

Then, at every ``W > 1``, each distributed step is checked in float64 against the
single-process step over the same global batch (rank 0 of the same job), the data-parallel
step once more compiled with the same Inductor settings (graph count recorded). NCCL on CUDA,
gloo on the CPU; NCCL's environment is left as the machine has it.

Run::

    python benchmarks/distributed.py --out benchmarks/results/distributed-h200x4.json   # GPUs
    python benchmarks/distributed.py --small --device cpu --out /tmp/dist.json           # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchopt
from _bench import device_name, set_tf32_off, time_calls
from meta import conv_net, make_tasks
from torch import Tensor, nn

from torchfn import distributed as tdist
from torchfn.compile import compile_step
from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.functional import init_train_state, make_functional, make_train_step
from torchfn.meta import init_meta_state, make_meta_train_step, maml, sinusoid_tasks
from torchfn.optim import adam
from torchfn.persample import PoissonSampler, init_dp_state, make_dp_train_step, make_ghost_model

F64 = torch.float64
VARIANTS = {"data_parallel": ("eager", "overlap", "compiled", "sharded", "sharded-compiled"),
            "meta": ("eager", "inner", "compiled"), "ensemble": ("eager", "compiled"),
            "dpsgd": ("eager", "compiled", "sharded")}
# meta compiled is opt-in (minutes of Inductor per process); sharded-compiled too (budget)
DEFAULT_ROWS = ("data_parallel:eager,data_parallel:overlap,data_parallel:compiled,data_parallel:sharded,meta:eager,"
                "ensemble:eager,ensemble:compiled,dpsgd:eager,dpsgd:compiled,dpsgd:sharded")
OVERLAP_PASSES = ["reorder_communication_preserving_peak_memory", "sink_waits_iterative",
                  "reorder_communication_preserving_peak_memory"]


def _sizes(small: bool, lm_batch: str = "12x1024") -> dict[str, Any]:
    if small:
        return {"lm": {"vocab": 64, "d": 32, "heads": 2, "layers": 2, "seq": 16, "batch": 4},
                "meta": {"channels": 4, "n_tasks": 2, "n_way": 5, "k_shot": 1, "n_query": 2,
                         "size": 16, "steps": 1},
                "ens": {"members": 2, "dims": (16, 32, 4), "batch": 16},
                "dp_lm": {"vocab": 64, "d": 32, "heads": 2, "layers": 1, "seq": 8,
                          "batch": 4}}
    batch, seq = (int(v) for v in lm_batch.lower().split("x"))
    return {"lm": {"vocab": 8192, "d": 1024, "heads": 16, "layers": 8, "seq": seq, "batch": batch},
            "meta": {"channels": 64, "n_tasks": 32, "n_way": 5, "k_shot": 1, "n_query": 15,
                     "size": 28, "steps": 5},
            "ens": {"members": 32, "dims": (1024, 2048, 2048, 10), "batch": 1024},
            "dp_lm": {"vocab": 8192, "d": 512, "heads": 8, "layers": 4, "seq": 128,
                      "batch": 32}}


# -- models --------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN decoder block: causal self-attention (SDPA) and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class DecoderLM(nn.Module):
    """``ids (B, T) -> logits (B, T, vocab)``: token + position embeddings, blocks, LN, head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int, **_: Any) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.head(self.ln(self.blocks(self.tok(ids) + self.pos(pos))))


def _lm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _lm_loss_per_sample(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits.transpose(1, 2), ids, reduction="none").mean(1)


def _mlp(dims: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _ids(cfg: dict[str, Any], g: torch.Generator, device: torch.device) -> Tensor:
    return torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(device)


# -- the rows: build(step function, state, work units per rank per step) ------------------------

Row = tuple[Callable[[Any], Any], Any, int, dict[str, Any]]


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True)`` with the step's ``inductor_options``, no log."""
    return compile_step(fn, log=None)


def _row_data_parallel(variant: str, world: int, rank: int, device: torch.device,
                       sz: dict[str, Any], g: torch.Generator) -> Row:
    cfg = sz["lm"]
    torch.manual_seed(0)
    model_fn, params, buffers = make_functional(DecoderLM(**cfg).to(device))
    opt = adam(1e-4)
    ids = _ids(cfg, g, device)
    n_params = sum(p.numel() for p in params.values())
    info = {"unit": "sequences/s", "params": n_params, "grad_MB": 4 * n_params / 2**20,
            "local_batch": f"{cfg['batch']} x {cfg['seq']} tokens"}
    if variant.startswith("sharded") and world > 1:
        layout = tdist.ShardLayout.from_params(params)
        state = tdist.init_sharded_state(params, buffers, opt, layout, seed=0)
        step = tdist.make_sharded_train_step(model_fn, _lm_loss, opt, layout)
    else:  # 1 process: the plain step is the baseline of every variant
        state = init_train_state(params, buffers, opt, seed=0)
        overlap = {"overlap_backward": True} if variant == "overlap" else {}
        step = (tdist.make_data_parallel_train_step(model_fn, _lm_loss, opt, **overlap)
                if world > 1 else make_train_step(model_fn, _lm_loss, opt))
    if variant.endswith("compiled"):
        step = _compile(step)
    return (lambda s: step(s, (ids, ids))[0]), state, cfg["batch"], info


def _row_meta(variant: str, world: int, rank: int, device: torch.device, sz: dict[str, Any],
              g: torch.Generator) -> Row:
    cfg = sz["meta"]
    torch.manual_seed(0)
    model_fn, params, buffers = make_functional(
        conv_net(cfg["channels"], cfg["n_way"], cfg["size"]).to(device))
    learner = maml(model_fn, F.cross_entropy, inner_lr=0.01, inner_steps=cfg["steps"])
    opt = adam(1e-3)
    state = init_meta_state(learner, params, buffers, opt)
    tasks = make_tasks(cfg["n_tasks"], cfg["n_way"], cfg["k_shot"], cfg["n_query"], cfg["size"],
                       device, torch.float32)
    # inner: the step compiles its inner step and query loss once each (compile="inner")
    kw = {"compile": "inner"} if variant == "inner" else {}
    step = (tdist.make_distributed_meta_train_step(learner, opt, **kw) if world > 1
            else make_meta_train_step(learner, opt, **kw))
    if variant == "compiled":
        step = _compile(step)
    info = {"unit": "tasks/s", "local_tasks": cfg["n_tasks"], "inner_steps": cfg["steps"],
            "task": f"{cfg['n_way']}-way {cfg['k_shot']}-shot, {cfg['n_query']} queries"}
    return (lambda s: step(s, tasks)[0]), state, cfg["n_tasks"], info


def _row_ensemble(variant: str, world: int, rank: int, device: torch.device,
                  sz: dict[str, Any], g: torch.Generator) -> Row:
    cfg = sz["ens"]
    n, dims = cfg["members"], cfg["dims"]
    # this rank's members: seeds [r n, (r+1) n); built on the device (model_fn checks it)
    ens = Ensemble.from_seeds(lambda: _mlp(dims).to(device), seeds=range(rank * n, rank * n + n))
    opt = adam(1e-3)
    state = init_ensemble_state(ens, opt, seed=0)
    moved = {k: v.to(device) for k, v in state.params.items()}
    state = state._replace(params=moved, opt_state=opt.init(moved),
                           buffers={k: v.to(device) for k, v in state.buffers.items()})
    x = torch.randn(n, cfg["batch"], dims[0], generator=g).to(device)
    y = torch.randint(0, dims[-1], (n, cfg["batch"]), generator=g).to(device)
    step = make_ensemble_train_step(ens.model_fn, F.cross_entropy, opt)
    if variant == "compiled":
        step = _compile(step)
    info = {"unit": "member-examples/s", "local_members": n, "batch_per_member": cfg["batch"],
            "params_per_member": sum(v[0].numel() for v in moved.values())}
    return (lambda s: step(s, (x, y))[0]), state, n * cfg["batch"], info


def _row_dpsgd(variant: str, world: int, rank: int, device: torch.device, sz: dict[str, Any],
               g: torch.Generator) -> Row:
    cfg = sz["dp_lm"]
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(DecoderLM(**cfg).to(device))
    opt = torchopt.sgd(0.1)
    b = cfg["batch"]
    # the local physical batch fully valid; the global dataset sized so that q N = W b
    step = make_dp_train_step(ghost, _lm_loss_per_sample, opt, noise_multiplier=1.0,
                              max_grad_norm=1.0, sample_rate=0.01, dataset_size=100 * world * b)
    ids = _ids(cfg, g, device)
    valid = torch.ones(b, dtype=torch.bool, device=device)
    run: Any
    if variant == "sharded" and world > 1:  # params + optimizer state sharded (ZeRO-3)
        layout = tdist.ShardLayout.from_params(params)
        state = tdist.init_sharded_dp_state(params, buffers, opt, layout, seed=0)
        run = tdist.make_sharded_dp_train_step(step, layout)
    else:  # 1 process: the plain DP step is the baseline of every variant
        state = init_dp_state(params, buffers, opt, seed=0)
        run = tdist.DistributedDPStep(step) if world > 1 else step
    if variant == "compiled":
        run = run.compile()
    info = {"unit": "sequences/s", "params": sum(p.numel() for p in params.values()),
            "local_batch": f"{b} x {cfg['seq']} tokens", "clipping": "ghost, flat 1.0"}
    return (lambda s: run(s, (ids, ids), valid)[0]), state, b, info


BUILDERS = {"data_parallel": _row_data_parallel, "meta": _row_meta, "ensemble": _row_ensemble,
            "dpsgd": _row_dpsgd}


# -- timing --------------------------------------------------------------------------------------


def _measure(fn: Callable[[Any], Any], state: Any, device: torch.device, distributed: bool,
             budget_s: float) -> dict[str, float]:
    """Time ``state = fn(state)``; return ms per step (slowest rank) and the first call's s."""
    box = [state]

    def call() -> None:
        box[0] = fn(box[0])

    def slowest(x: float) -> float:
        t = torch.tensor(x, dtype=F64, device=device)
        if distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    # 2 warm-up calls (the first compiles), then one timed call sizes the sample; every rank
    # takes the slowest rank's size, so all ranks make the same number of collective calls
    probe = time_calls(call, device, warmup=2, repeats=1, inner=1)
    one = slowest(probe.median_s)
    inner = max(1, min(100, math.ceil(budget_s / 4 / max(one, 1e-6))))
    t = time_calls(call, device, warmup=3, repeats=5, inner=inner,
                   before_repeats=dist.barrier if distributed else None)
    return {"step_ms": 1e3 * slowest(t.median_s), "first_call_s": slowest(probe.first_call_s),
            "fastest_rank_step_ms": -1e3 * slowest(-t.median_s),
            "steps_per_repeat": inner,
            # (max - min) / median of the repeats: a large spread flags an unsteady row
            "spread": slowest((max(t.times_s) - min(t.times_s)) / t.median_s)}


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _trace(fn: Callable[[Any], Any], state: Any, device: torch.device, path: str) -> Any:
    """Profile 3 steps (CPU and CUDA activities) into the Chrome trace ``path``; return the
    state and a summary: each kind of GPU kernel's total time (NCCL vs the rest)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if dist.is_initialized():
        dist.barrier()
    with profile(activities=acts) as prof:
        for _ in range(3):
            state = fn(state)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(path)
    kinds: dict[str, float] = {}
    for e in prof.events():
        # kernels, memcpy and memset only: GPU-side user annotations (the steps'
        # record_function parts, NCCL's ranges) span kernels and would count them twice
        if e.device_type.name != "CUDA" or e.is_user_annotation or e.is_async:
            continue
        kind = "nccl" if "nccl" in e.name.lower() else "other"
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 3e3  # ms per step
    # device syncs as the CUDA runtime sees them (a CUDA ``.item()`` is a copy plus a stream
    # sync); ``aten::_local_scalar_dense`` would also count reads of CPU scalars, which are free
    syncs = sum(e.count for e in prof.key_averages()
                if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    syncs = max(0, syncs - (device.type == "cuda")) / 3  # less the closing synchronize above
    return state, {"trace": path, "gpu_ms_per_step": kinds, "host_syncs_per_step": syncs}


def _bench(rows: list[tuple[str, str]], world: int, rank: int, device: torch.device,
           sz: dict[str, Any], budget_s: float, trace: str | None = None) -> dict[str, Any]:
    distributed = world > 1
    out: dict[str, Any] = {}
    for workload, variant in rows:
        name = f"{workload}:{variant}"
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(1000 + rank)
        try:
            fn, state, units, info = BUILDERS[workload](variant, world, rank, device, sz, g)
            m = _measure(fn, state, device, distributed, budget_s)
            rec = {**info, **m, "throughput": world * units / (m["step_ms"] / 1e3)}
            if trace:
                os.makedirs(trace, exist_ok=True)
                path = os.path.join(trace, f"{workload}-{variant}-W{world}-rank{rank}.json")
                state, rec["profile"] = _trace(fn, state, device, path)
            if device.type == "cuda":
                rec["peak_MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
                torch.cuda.reset_peak_memory_stats(device)
            del fn, state
        except Exception as e:  # recorded; a failure on one rank only would hang the others
            rec = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                   "traceback": traceback.format_exc(limit=-12)}
            if rank == 0:
                print(rec["traceback"], file=sys.stderr, flush=True)
        _free(device)
        out[name] = rec
        if rank == 0:
            what = (f"{rec['step_ms']:.2f} ms/step (spread {rec['spread']:.2f}), "
                    f"{rec['throughput']:.1f} {rec['unit']}, "
                    f"first call {rec['first_call_s']:.1f}s" if "error" not in rec
                    else rec["error"])
            print(f"  [W={world}] {name}: {what} ({time.perf_counter() - t0:.0f}s)", flush=True)
        if distributed:
            dist.barrier()
    return out


# -- the communication floor: each workload's collectives alone, at its gradient size ------------


def _comm_floor(world: int, device: torch.device, sz: dict[str, Any]) -> dict[str, Any]:
    """Time one fp32 all-reduce, all-gather and reduce-scatter of each LM's parameter count
    (the bytes of the data-parallel / sharded steps' collectives), with nothing else running:
    the communication a step cannot go below unless it overlaps it with compute."""
    out: dict[str, Any] = {}
    for name in ("lm", "dp_lm"):
        with torch.device("meta"):
            n = sum(p.numel() for p in DecoderLM(**sz[name]).parameters())
        n = -(-n // world) * world
        full = torch.ones(n, device=device)
        shard = torch.ones(n // world, device=device)
        ops = {"all_reduce": lambda f=full: dist.all_reduce(f),
               "all_gather": lambda f=full, s=shard: dist.all_gather_into_tensor(f, s),
               "reduce_scatter": lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f)}
        res = {"MB": 4 * n / 2**20}
        for op, fn in ops.items():
            times = []
            for i in range(7):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            t = torch.tensor(sorted(times)[len(times) // 2], dtype=F64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ms = 1e3 * float(t)
            # bus bandwidth as nccl-tests defines it: what each link carries
            factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
            res[op] = {"ms": ms, "busbw_GBps": factor * 4 * n / 1e9 / (ms / 1e3)}
        out[name] = res
    return out


# -- equality (float64, distributed vs one process over the global batch) -----------------------


def _rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = math.sqrt(sum(float((a[k] - b[k]).double().square().sum()) for k in a))
    den = math.sqrt(sum(float(b[k].double().square().sum()) for k in b))
    return num / max(den, 1e-300)


def _check(rank: int, world: int, device: torch.device, compile_check: bool) -> dict[str, Any]:
    """Run each distributed step on float64 data; rank 0 compares with the one-process step."""
    res: dict[str, Any] = {}
    g = torch.Generator().manual_seed(7)

    def split(t: torch.Tensor) -> torch.Tensor:
        per = t.shape[0] // world
        return t[rank * per:(rank + 1) * per]

    # data parallel (eager, and compiled)
    torch.manual_seed(0)
    model_fn, params, buffers = make_functional(_mlp((8, 32, 4)).to(device, F64))
    opt = adam(1e-2)
    batches = [(torch.randn(32, 8, generator=g, dtype=F64).to(device),
                torch.randint(0, 4, (32,), generator=g).to(device)) for _ in range(3)]
    kw = {"max_grad_norm": 0.5, "grad_accum_steps": 2}
    variants = {"data_parallel": False} | ({"data_parallel_compiled": True}
                                            if compile_check else {})
    for name, compiled in variants.items():
        step = tdist.make_data_parallel_train_step(model_fn, F.cross_entropy, opt, **kw)
        frames = None
        if compiled:
            from torch._dynamo.testing import CompileCounterWithBackend

            counter = CompileCounterWithBackend("inductor")
            step = torch.compile(step, fullgraph=True, backend=counter)
        state = init_train_state(params, buffers, opt, seed=0)
        for x, y in batches:
            state, _ = step(state, (split(x), split(y)))
        if compiled:
            frames = counter.frame_count
        ref_step = make_train_step(model_fn, F.cross_entropy, opt, **kw)
        ref = init_train_state(params, buffers, opt, seed=0)
        for batch in batches:
            ref, _ = ref_step(ref, batch)
        res[name] = {"rel_err": _rel_err(state.params, ref.params), "graphs": frames}

    # data parallel with the all-reduce launched from the backward's gradient hooks
    step = tdist.make_data_parallel_train_step(model_fn, F.cross_entropy, opt, max_grad_norm=0.5,
                                               overlap_backward=True)
    state = ref = init_train_state(params, buffers, opt, seed=0)
    ref_step = make_train_step(model_fn, F.cross_entropy, opt, max_grad_norm=0.5)
    for x, y in batches:
        state, _ = step(state, (split(x), split(y)))
        ref, _ = ref_step(ref, (x, y))
    res["data_parallel_overlap"] = {"rel_err": _rel_err(state.params, ref.params)}

    # meta
    mfn, mparams, mbuffers = make_functional(_mlp((1, 16, 1)).to(device, F64))
    learner = maml(mfn, F.mse_loss, inner_lr=0.05, inner_steps=2)
    tasks = sinusoid_tasks(4 * world, 5, 5, generator=g, dtype=F64, device=device)[0]
    mstate = ref = init_meta_state(learner, mparams, mbuffers, adam(1e-2))
    mstep = tdist.make_distributed_meta_train_step(learner, adam(1e-2))
    ref_step = make_meta_train_step(learner, adam(1e-2))
    for _ in range(2):
        mstate, _ = mstep(mstate, tdist.shard_tasks(tasks, rank=rank, world_size=world))
        ref, _ = ref_step(ref, tasks)
    res["meta"] = {"rel_err": _rel_err(mstate.params, ref.params)}

    # ensemble: gather trained members + checkpoint round trip on the job's world size
    ens = Ensemble.from_seeds(lambda: _mlp((6, 16, 3)).to(device, F64), seeds=range(2 * world))
    eopt = adam(1e-2)
    full = init_ensemble_state(ens, eopt, seed=0)
    full = full._replace(params={k: v.to(device) for k, v in full.params.items()},
                         opt_state=eopt.init({k: v.to(device) for k, v in full.params.items()}))
    local = tdist.shard_members(full, rank=rank, world_size=world)
    ex = torch.randn(2 * world, 8, 6, generator=g, dtype=F64).to(device)
    ey = torch.randint(0, 3, (2 * world, 8), generator=g).to(device)
    estep = make_ensemble_train_step(ens.model_fn, F.cross_entropy, eopt)
    r = tdist.member_range(2 * world, rank=rank, world_size=world)
    for _ in range(2):
        local, _ = estep(local, (ex[r.start:r.stop], ey[r.start:r.stop]))
        full, _ = estep(full, (ex, ey))
    gathered = tdist.gather_members(local)
    res["ensemble"] = {"rel_err": _rel_err(gathered.params, full.params)}
    path = os.path.join(tempfile.gettempdir(), f"torchfn_bench_ens_{os.getppid()}.pt")
    tdist.save_ensemble_gathered(path, local)
    back, _ = tdist.load_ensemble_shard(path, rank=rank, world_size=world, map_location=device)
    res["ensemble"]["checkpoint_rel_err"] = _rel_err(back.params, local.params)
    dist.barrier()
    if rank == 0:
        os.unlink(path)

    # DP-SGD
    torch.manual_seed(0)
    ghost, dparams, dbuffers = make_ghost_model(_mlp((6, 16, 3)).to(device, F64))
    dopt = torchopt.sgd(0.5)
    dstep = make_dp_train_step(ghost, lambda o, t: F.cross_entropy(o, t, reduction="none"),
                               dopt, noise_multiplier=0.7, max_grad_norm=0.5,
                               sample_rate=0.25, dataset_size=64)
    sampler_x = torch.randn(64, 6, generator=g, dtype=F64).to(device)
    sampler_y = torch.randint(0, 3, (64,), generator=g).to(device)
    sampler = PoissonSampler(64, 0.25, 32, seed=3)
    dist_state = ref = init_dp_state(dparams, dbuffers, dopt, seed=4)
    dd = tdist.DistributedDPStep(dstep)
    for t in range(3):
        chunks = tdist.shard_poisson_sample(sampler, t, rank=rank, world_size=world,
                                            physical_batch_size=8)
        dist_state, _ = dd.run(dist_state, chunks, lambda i: (sampler_x[i], sampler_y[i]))
        ref, _ = dstep.run(ref, sampler.sample(t), lambda i: (sampler_x[i], sampler_y[i]))
    res["dpsgd"] = {"rel_err": _rel_err(dist_state.params, ref.params)}
    return res


# -- driver --------------------------------------------------------------------------------------


def _set_overlap(mode: str) -> dict[str, Any]:
    """Switch Inductor's compute/communication overlap on (``mode``); return what was set."""
    import torch._inductor.config as ic

    if mode == "reorder":
        ic.reorder_for_compute_comm_overlap = True
        ic.reorder_for_compute_comm_overlap_passes = list(OVERLAP_PASSES)
        return {"reorder_for_compute_comm_overlap": True,
                "reorder_for_compute_comm_overlap_passes": list(OVERLAP_PASSES)}
    if mode == "schedule":
        ic.aten_distributed_optimizations.enable_overlap_scheduling = True
        return {"aten_distributed_optimizations.enable_overlap_scheduling": True}
    return {}


def _pin(rank: int, world: int, device: torch.device, max_world: int) -> dict[str, Any]:
    """Give this rank its share of the CPU cores (and threads); return what it got."""
    cores = sorted(os.sched_getaffinity(0))
    # CUDA: a rank gets cores // W; CPU: cores // max(W) at every W (the same compute per rank)
    per = max(1, len(cores) // (world if device.type == "cuda" else max_world))
    mine = cores[rank * per:(rank + 1) * per] or cores
    return {"cores": mine, "threads": per}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    use_cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda and not args.all_gpus_visible:
        # before this process touches CUDA: it sees only its own GPU, as cuda:0, so compiled
        # rows hit the Inductor / AOTAutograd caches that other processes filled (the cache
        # keys hold the device index: a rank on cuda:3 would recompile what cuda:0 compiled)
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu_ids[rank]
        device = torch.device("cuda", 0)
    if use_cuda:
        torch.cuda.set_device(device)
    pin = _pin(rank, world, device, max(args.worlds))
    if not args.no_cpu_pin:
        os.sched_setaffinity(0, pin["cores"])
    torch.set_num_threads(pin["threads"])
    if args.gc == "off":
        import gc

        gc.disable()
    tf32 = set_tf32_off()
    inductor = _set_overlap(args.overlap)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        import datetime

        kw = {"device_id": device} if use_cuda else {}
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=10), **kw)
    try:
        if rank == 0:
            print(f"world {world}: {pin['threads']} CPU threads per rank"
                  f"{'' if args.no_cpu_pin else ', pinned'}", flush=True)
        result: dict[str, Any] = {
            "bench": _bench(args.rows, world, rank, device, _sizes(args.small, args.lm_batch),
                            args.budget_s, args.trace),
            "tf32": tf32, "inductor": inductor, "threads_per_rank": pin["threads"],
            "device_name": device_name(device)}
        if world > 1 and not args.no_comm_floor:
            result["comm_floor"] = _comm_floor(world, device, _sizes(args.small, args.lm_batch))
        if world > 1 and not args.no_checks:
            result["checks"] = _check(rank, world, device,
                                      not args.no_compile_check and world == max(args.worlds))
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        if world > 1:
            dist.barrier()  # no rank tears the process group down while another uses it
    finally:
        if world > 1:
            dist.destroy_process_group()


def _spawn(world: int, args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    mp.spawn(_worker, args=(world, port, args, out), nprocs=world, join=True)
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def _median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One world size run in several fresh process groups -> per row, the median process's record.

    Each row keeps the record (step time, throughput, ...) of the run whose step time is the
    median over the runs (the lower one for an even count) and lists every run's step time in
    ``step_ms_processes``; checks, comm floor and the rest come from the first run.
    """
    merged = dict(results[0])
    bench = {}
    for name, rec in results[0]["bench"].items():
        recs = [r["bench"].get(name, {}) for r in results]
        timed = sorted((r for r in recs if "step_ms" in r), key=lambda r: r["step_ms"])
        if not timed:
            bench[name] = rec
            continue
        bench[name] = {**timed[(len(timed) - 1) // 2],
                       "step_ms_processes": [r.get("step_ms") for r in recs]}
    merged["bench"] = bench
    return merged


def _parse_rows(text: str) -> list[tuple[str, str]]:
    rows = []
    for item in text.split(","):
        workload, _, variant = item.strip().partition(":")
        if workload not in VARIANTS or variant not in VARIANTS[workload]:
            known = ", ".join(f"{w}:{v}" for w, vs in VARIANTS.items() for v in vs)
            sys.exit(f"benchmarks/distributed.py --rows: unknown row {item!r}; known: {known}")
        rows.append((workload, variant))
    return rows


def _markdown(report: dict[str, Any], worlds: list[int]) -> str:
    others = [w for w in worlds if w > 1]
    lines = [f"# torchfn.distributed weak scaling: {report['device']} ({report['backend']}, "
             f"torch {report['torch']}{', --small' if report['small'] else ''})", "",
             f"- Command: `{report['command']}`",
             f"- TF32 off ({report['tf32']}); {report['threads']}",
             f"- Compiled rows: `torch.compile(fullgraph=True)`, Inductor settings "
             f"{report['inductor'] or '(defaults)'}",
             f"- Timing: wall clock, median of 5 repeats of N steps (N sized to about "
             f"{report['budget_s'] / 4:g} s per repeat), slowest rank"
             + (f", median over {report['process_repeats']} fresh process groups per world "
                f"size" if report.get("process_repeats", 1) > 1 else "")
             + "; efficiency(W) = "
             "throughput(W) / (W x throughput(1)), every rank keeping the 1-process work.", "",
             "| workload | variant | unit | " + " | ".join(f"thr W={w}" for w in worlds)
             + " | " + " | ".join(f"eff W={w}" for w in others) + " | step ms ("
             + " / ".join(str(w) for w in worlds) + ") | first call s |",
             "|---|---|---|" + "---:|" * (len(worlds) + len(others) + 2)]
    per_process: list[str] = []
    for name, r in report["workloads"].items():
        workload, variant = name.split(":")
        per = r["by_world"]
        unit = next((v["unit"] for v in per.values() if "unit" in v), "")
        thr = [f"{per[str(w)]['throughput']:.1f}" if "throughput" in per[str(w)] else "error"
               for w in worlds]
        eff = [f"{r['efficiency'][str(w)]:.3f}" if r["efficiency"].get(str(w)) is not None
               else "-" for w in others]
        ms = " / ".join(f"{per[str(w)]['step_ms']:.1f}" if "step_ms" in per[str(w)] else "-"
                        for w in worlds)
        first = max((v.get("first_call_s", 0.0) for v in per.values()), default=0.0)
        lines.append(f"| {workload} | {variant} | {unit} | " + " | ".join(thr) + " | "
                     + " | ".join(eff) + f" | {ms} | {first:.1f} |")
        spread = [f"W={w}: " + ", ".join(f"{t:.1f}" for t in per[str(w)]["step_ms_processes"]
                                         if t is not None)
                  for w in worlds if len(per[str(w)].get("step_ms_processes", ())) > 1]
        if spread:
            per_process.append(f"- {name}: " + "; ".join(spread))
    if per_process:
        lines += ["", "Step ms of each fresh process group (the median one is in the table):",
                  *per_process]
    errors = [f"- {name} W={w}: {v['error']}" for name, r in report["workloads"].items()
              for w, v in r["by_world"].items() if "error" in v]
    if errors:
        lines += ["", "Errors:", *errors]
    for w, checks in report["equality_float64"].items():
        if not checks:
            continue
        lines += ["", f"| float64 check, W={w} vs 1 process (same global batch) | relative "
                  "error | graphs | ok |", "|---|---:|---:|---|"]
        for name, c in checks.items():
            lines.append(f"| {name} | {c['rel_err']:.2e} | {c.get('graphs') or '-'} | "
                         f"{'yes' if c['ok'] else 'FAILED'} |")
    prof = [(name, w, v["profile"]) for name, r in report["workloads"].items()
            for w, v in r["by_world"].items() if "profile" in v]
    if prof:
        lines += ["", "| profiled (3 steps, rank 0) | W | GPU ms/step: NCCL | other kernels | "
                  "host syncs/step | trace |", "|---|---:|---:|---:|---:|---|"]
        for name, w, p in prof:
            g = p["gpu_ms_per_step"]
            lines.append(f"| {name} | {w} | {g.get('nccl', 0.0):.1f} | {g.get('other', 0.0):.1f}"
                         f" | {p['host_syncs_per_step']:.1f} | {os.path.basename(p['trace'])} |")
    for w, floor in report.get("comm_floor", {}).items():
        lines += ["", f"| collectives alone, W={w} (fp32, median of 5, slowest rank) | MB | "
                  "all-reduce ms (busbw GB/s) | all-gather ms (busbw) | reduce-scatter ms "
                  "(busbw) |", "|---|---:|---:|---:|---:|"]
        for name, r in floor.items():
            cells = " | ".join(f"{r[op]['ms']:.2f} ({r[op]['busbw_GBps']:.0f})"
                               for op in ("all_reduce", "all_gather", "reduce_scatter"))
            lines.append(f"| {name} params | {r['MB']:.0f} | {cells} |")
    lines += ["", f"NCCL environment: {report['env'] or 'no NCCL_* variables set'}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write (the .md next to it)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", default=None,
                   help="comma list of world sizes (default: 1,2,4,8 up to the GPU count; "
                        "CPU: 1,2); 1 is always run (the baseline)")
    p.add_argument("--rows", default=DEFAULT_ROWS,
                   help="comma list of workload:variant (default: %(default)s)")
    p.add_argument("--overlap", choices=("reorder", "schedule", "none"), default="reorder",
                   help="Inductor compute/communication overlap for compiled rows")
    p.add_argument("--budget-s", type=float, default=6.0,
                   help="timed seconds per row and world size, about (default 6)")
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
    p.add_argument("--lm-batch", default="12x1024", metavar="BxT",
                   help="data_parallel's per-rank batch: sequences x tokens (default "
                        "%(default)s, nanoGPT's GPT-2 micro-batch; the model stays the same)")
    p.add_argument("--no-cpu-pin", action="store_true", help="do not pin ranks to CPU cores")
    p.add_argument("--all-gpus-visible", action="store_true",
                   help="every rank sees every GPU and uses cuda:<rank> (default: a rank sees "
                        "only its own GPU, as cuda:0, so compiled rows share one compile cache)")
    p.add_argument("--no-checks", action="store_true", help="skip the float64 equality checks")
    p.add_argument("--gc", choices=("on", "off"), default="on",
                   help="off: Python's cyclic garbage collector disabled in every rank (is a "
                        "straggling rank's collection what a step waits for?)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="after timing, profile 3 steps of every row (CPU + CUDA) into "
                        "DIR/<workload>-<variant>-W<w>-rank<r>.json (Chrome traces) and "
                        "record each row's NCCL / other GPU ms per step and host syncs")
    p.add_argument("--no-comm-floor", action="store_true",
                   help="skip timing the collectives alone (all-reduce, all-gather, "
                        "reduce-scatter of each model's parameter bytes)")
    p.add_argument("--no-compile-check", action="store_true",
                   help="skip the compiled data-parallel equality check")
    p.add_argument("--process-repeats", type=int, default=1, metavar="N",
                   help="run every world size in N fresh process groups and keep, per row, "
                        "the median one (steps whose time varies from process to process, "
                        "e.g. eager MAML's cuDNN convolutions; checks, comm floor and traces "
                        "only in the first)")
    args = p.parse_args()
    if args.process_repeats < 1:
        p.error(f"--process-repeats: expected >= 1, got {args.process_repeats}")
    args.rows = _parse_rows(args.rows)
    n_dev = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.world is None:
        worlds = [w for w in (1, 2, 4, 8) if w <= n_dev]
    else:
        worlds = sorted({1, *(int(w) for w in args.world.split(","))})
    if max(worlds) > n_dev and args.device == "cuda":
        sys.exit(f"benchmarks/distributed.py --world {args.world}: only {n_dev} GPUs here")
    if len(worlds) < 2:
        sys.exit(f"benchmarks/distributed.py: needs 2 GPUs or more, found {n_dev}")
    args.worlds = worlds
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    args.gpu_ids = ([v.strip() for v in visible.split(",") if v.strip()] if visible
                    else [str(i) for i in range(n_dev)])
    t0 = time.time()
    runs = {}
    for w in worlds:
        print(f"== world {w} ({time.time() - t0:.0f}s)", flush=True)
        again = argparse.Namespace(**{**vars(args), "no_checks": True, "no_comm_floor": True,
                                      "trace": None})
        runs[w] = _median_run([_spawn(w, args if i == 0 else again)
                               for i in range(args.process_repeats)])
        with open(os.path.splitext(args.out)[0] + ".partial.json", "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "runs": runs}, f)
    rows = {}
    for name in runs[1]["bench"]:
        by_world = {str(w): runs[w]["bench"][name] for w in worlds}
        base = by_world["1"].get("throughput")
        eff = {str(w): (by_world[str(w)]["throughput"] / (w * base)
                        if base and "throughput" in by_world[str(w)] else None)
               for w in worlds if w > 1}
        rows[name] = {"by_world": by_world, "efficiency": eff}
    tol = 1e-9
    checks = {str(w): {k: v | {"ok": v["rel_err"] < tol and v.get("checkpoint_rel_err", 0.0) < tol
                               and v.get("graphs") in (None, 1)}
                       for k, v in runs[w].get("checks", {}).items()}
              for w in worlds if w > 1}
    first = runs[worlds[-1]]
    report = {
        "benchmark": "torchfn.distributed weak scaling (fixed per-process work)",
        "device": first["device_name"], "backend": "nccl" if args.device == "cuda" else "gloo",
        "torch": torch.__version__, "small": args.small, "worlds": worlds,
        "command": "python " + " ".join(sys.argv), "budget_s": args.budget_s,
        "process_repeats": args.process_repeats,
        "tf32": first["tf32"], "inductor": first["inductor"],
        "threads": ", ".join(f"W={w}: {runs[w]['threads_per_rank']} CPU threads per rank"
                             for w in worlds) + ("" if args.no_cpu_pin else ", pinned"),
        "sizes": _sizes(args.small, args.lm_batch),
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "workloads": rows, "equality_float64": checks, "wall_s": time.time() - t0,
        "comm_floor": {str(w): runs[w]["comm_floor"] for w in worlds if "comm_floor" in runs[w]},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    md = os.path.splitext(args.out)[0] + ".md"
    text = _markdown(report, worlds)
    with open(md, "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {args.out} and {md} ({report['wall_s']:.0f}s)")
    failed = [c for cs in checks.values() for c in cs.values() if not c["ok"]]
    if failed or any("error" in v for r in rows.values() for v in r["by_world"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
