"""DP-SGD on Hugging Face models: torchfn vs Opacus vs torch.func, GPT-2 small, LoRA, ViT-B/16.

Workloads (random weights, dropout 0 so every variant computes the same function):

- ``gpt2``: ``GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
  n_positions=1024))``, batch 8 x 256 tokens, next-token cross-entropy averaged over each
  sequence (one loss per sample); every parameter trained (``wte`` and ``lm_head`` tied, as
  in GPT-2; ``--untie`` unties them);
- ``gpt2-lora``: the same model with peft ``LoraConfig(r=8, target_modules=["c_attn",
  "c_proj"])``: the base is frozen, only the adapters train;
- ``vit``: ``ViTForImageClassification(ViTConfig(image_size=224, patch_size=16,
  hidden_size=768, 12 layers, 12 heads, intermediate 3072, 1000 classes))``, batch 32.

The language models are called as ``model(input_ids=ids, position_ids=arange(T).expand(B, T))``
and return the logits: per-sample methods (torchfn's ghost norms, Opacus' hooks) need the
batch in dim 0 of every layer input, and GPT-2's own ``position_ids`` are ``(1, T)``
(``--positions model`` passes none and lets the model build them).

Variants, each one full training step (forward, backward, [per-sample clipping, noise],
SGD update; noise multiplier 1, clipping norm 1, flat clipping):

- ``torch-eager``: plain PyTorch (module, ``loss.backward()``, ``torch.optim.SGD``);
- ``nonprivate-{eager,compiled,graphed}``: torchfn ``make_train_step`` (torchopt SGD);
- ``dpsgd-{eager,compiled,graphed}``: torchfn ``make_ghost_model`` + ``make_dp_train_step``;
  compiled: ``DPTrainStep.compile()`` / ``torch.compile(fullgraph=True)``; graphed:
  ``make_graphed_step`` (CUDA only);
- ``opacus-hooks``: Opacus ``GradSampleModule`` + ``DPOptimizer`` (per-sample gradients);
- ``opacus-ghost``: Opacus ``GradSampleModuleFastGradientClipping`` (ghost clipping) +
  ``DPOptimizerFastGradientClipping`` + ``DPLossFastGradientClipping`` (it refuses tied
  parameters; the refusal is recorded);
- ``vmap-dpsgd``: the textbook floor: ``torch.func`` ``vmap(grad)`` per-sample gradients of the
  trained parameters, then clipping, noise and the SGD update in plain tensor ops.

Precision (``--precision fp32,bf16``): ``fp32`` with TF32 off (matmul and cuDNN); ``bf16``:
torchfn ``amp="bf16"``, the other rows run the forward under ``torch.autocast(bfloat16)``;
parameters stay fp32 in both. Each row builds a fresh copy of the model, is timed with
``_bench.time_calls`` (warm-up calls -- the first timed alone as "first call" -- then the
median of ``--steps`` synchronized repeats) and reports the peak CUDA memory over all its
calls (``max_memory_allocated``, reset per row). A row that raises (a refused layer, an
out-of-memory, a missing package) records the error and the run goes on; rows past
``--budget-s`` are recorded as skipped. JSON (``--json``) and markdown (``--md``) are
rewritten after every row, so a run cut short keeps what it measured.

    TORCHFN_OPS=kernels python benchmarks/dp_models.py --json dp_models.json \\
        --md benchmarks/results/dp-models-h100.md
    python benchmarks/dp_models.py --tiny --steps 2 --device cpu    # CPU smoke test
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchopt
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import device_name, set_tf32_off, time_calls

from torchfn.compile import make_graphed_step
from torchfn.functional import (
    init_train_state,
    make_functional,
    make_train_step,
    per_sample_grads,
    single_sample_fn,
)
from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model

LR, SIGMA, CLIP, DATASET = 1e-3, 1.0, 1.0, 60_000
WORKLOADS = ("gpt2", "gpt2-lora", "vit")
VARIANTS = ("nonprivate-eager", "dpsgd-eager", "opacus-hooks", "opacus-ghost", "torch-eager",
            "vmap-dpsgd", "nonprivate-compiled", "dpsgd-compiled", "nonprivate-graphed",
            "dpsgd-graphed")
DEFAULT_VARIANTS = VARIANTS[:6]  # eager only: no long compiles by default
GOALS = {"dp_time": 1.25, "dp_mem": 1.3, "vs_opacus_ghost": 3.0, "vs_opacus_hooks": 2.0}


# --- models -------------------------------------------------------------------------------


class CausalLM(nn.Module):
    """``ids (B, T) -> logits (B, T, V)`` of a HF causal LM, position ids ``(B, T)``."""

    def __init__(self, model: nn.Module, expand_positions: bool) -> None:
        super().__init__()
        self.model, self.expand_positions = model, expand_positions

    def forward(self, ids: Tensor) -> Tensor:
        pos = None
        if self.expand_positions:  # contiguous: Opacus' embedding sampler .view()s its input
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
        return self.model(input_ids=ids, position_ids=pos).logits


class ImageClassifier(nn.Module):
    """``pixels (B, C, H, W) -> logits (B, classes)`` of a HF image classifier."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(pixel_values=x).logits


def configs(tiny: bool, batch: int | None = None) -> dict[str, dict[str, Any]]:
    """Model sizes and batch shapes per workload (``tiny``: the CPU smoke-test sizes);
    ``batch`` (a positive int) replaces every workload's samples per step."""
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                              or batch < 1):
        raise ValueError(f"configs(batch=...): expected a positive int, got {batch!r}")
    if tiny:
        gpt2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 32}
        vit = {"image_size": 16, "patch_size": 4, "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "intermediate_size": 64, "num_labels": 10}
        lm, img = {"batch": 2, "seq": 16}, {"batch": 2}
    else:
        gpt2 = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
                "n_positions": 1024}
        vit = {"image_size": 224, "patch_size": 16, "hidden_size": 768, "num_hidden_layers": 12,
               "num_attention_heads": 12, "intermediate_size": 3072, "num_labels": 1000}
        lm, img = {"batch": 8, "seq": 256}, {"batch": 32}
    out = {"gpt2": {"model": gpt2, **lm}, "gpt2-lora": {"model": gpt2, "lora_r": 8, **lm},
           "vit": {"model": vit, **img}}
    return out if batch is None else {w: {**c, "batch": batch} for w, c in out.items()}


def build_model(name: str, cfg: dict[str, Any], untie: bool, expand_positions: bool) -> nn.Module:
    """The workload's module (CPU, fp32, train mode, seeded weights)."""
    import transformers

    torch.manual_seed(0)
    if name == "vit":
        vcfg = transformers.ViTConfig(**cfg["model"], hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        return ImageClassifier(transformers.ViTForImageClassification(vcfg)).train()
    gcfg = transformers.GPT2Config(**cfg["model"], resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                                   eos_token_id=0, tie_word_embeddings=not untie)
    model = transformers.GPT2LMHeadModel(gcfg)
    if name == "gpt2-lora":
        from peft import LoraConfig, get_peft_model

        # fan_in_fan_out: GPT-2's c_attn/c_proj are transformers' Conv1D (weight (in, out))
        lora = LoraConfig(r=cfg["lora_r"], lora_alpha=2 * cfg["lora_r"], lora_dropout=0.0,
                          target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
        model = get_peft_model(model, lora)
    return CausalLM(model, expand_positions).train()


def make_batch(name: str, cfg: dict[str, Any], device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    b = cfg["batch"]
    if name == "vit":
        m = cfg["model"]
        x = torch.randn(b, 3, m["image_size"], m["image_size"], generator=g)
        y = torch.randint(0, m["num_labels"], (b,), generator=g)
        return x.to(device), y.to(device)
    ids = torch.randint(0, cfg["model"]["vocab_size"], (b, cfg["seq"]), generator=g).to(device)
    return ids, ids  # targets: the next token of the same sequence


def per_sample_loss(kind: str) -> Callable[[Tensor, Tensor], Tensor]:
    """``(outputs, targets) -> (B,)`` losses: mean next-token cross-entropy per sequence (lm) or
    cross-entropy per image (cls), computed in fp32."""
    if kind == "lm":
        def lm(logits: Tensor, ids: Tensor) -> Tensor:
            lg = logits[:, :-1].float()
            tok = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1),
                                  reduction="none")
            return tok.view(ids.shape[0], -1).mean(1)
        return lm

    def cls(logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits.float(), y, reduction="none")
    return cls


def loss_kind(name: str) -> str:
    return "cls" if name == "vit" else "lm"


def autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# --- the timed variants: each returns a zero-argument callable doing one step --------------


def v_torch(model: nn.Module, x: Tensor, y: Tensor, kind: str, precision: str) -> Callable[[], Any]:
    opt = torch.optim.SGD(trainable_params(model), lr=LR)
    loss_fn = per_sample_loss(kind)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast(x.device, precision):
            loss = loss_fn(model(x), y).mean()
        loss.backward()
        opt.step()

    return step


def _amp(precision: str) -> str | None:
    return "bf16" if precision == "bf16" else None


def v_nonprivate(model: nn.Module, x: Tensor, y: Tensor, kind: str, precision: str,
                 mode: str) -> Callable[[], Any]:
    model_fn, params, buffers = make_functional(model)
    opt = torchopt.sgd(LR)
    per_sample = per_sample_loss(kind)

    def mean_loss(out: Tensor, t: Tensor) -> Tensor:
        return per_sample(out, t).mean()

    fn = make_train_step(model_fn, mean_loss, opt, amp=_amp(precision))
    box = [init_train_state(params, buffers, opt, seed=0, trainable=model_fn.trainable)]
    if mode == "graphed":
        fn = make_graphed_step(fn, box[0], (x, y))
    elif mode == "compiled":
        fn = torch.compile(fn, fullgraph=True)

    def step() -> None:
        box[0], _ = fn(box[0], (x, y))

    return step


def v_dpsgd(model: nn.Module, x: Tensor, y: Tensor, kind: str, precision: str,
            mode: str) -> tuple[Callable[[], Any], dict[str, Any]]:
    ghost, params, buffers = make_ghost_model(model)
    kinds = list(ghost.layer_kinds.values())
    info = {"layers": {k: kinds.count(k) for k in sorted(set(kinds))},
            "fallback_layers": [n for n, k in ghost.layer_kinds.items() if k == "fallback"][:8]}
    opt = torchopt.sgd(LR)
    dp = make_dp_train_step(ghost, per_sample_loss(kind), opt, noise_multiplier=SIGMA,
                            max_grad_norm=CLIP, sample_rate=x.shape[0] / DATASET,
                            dataset_size=DATASET, amp=_amp(precision))
    valid = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    box = [init_dp_state(params, buffers, opt, seed=0, trainable=ghost.trainable)]
    fn: Callable[..., Any] = dp
    if mode == "graphed":  # make_graphed_step applies DPTrainStep.inductor_options
        fn = make_graphed_step(dp, box[0], (x, y), valid)
    elif mode == "compiled":
        fn = dp.compile()

    def step() -> None:
        box[0], _ = fn(box[0], (x, y), valid)

    return step, info


class _PerSampleCriterion(nn.Module):
    """Opacus' ghost-clipping loss wrapper wants a criterion with a ``reduction`` attribute;
    this one always returns the ``(B,)`` per-sample losses (what Opacus sets it to want)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fn, self.reduction = per_sample_loss(kind), "mean"

    def forward(self, out: Tensor, t: Tensor) -> Tensor:
        return self.fn(out, t)


def v_opacus(model: nn.Module, x: Tensor, y: Tensor, kind: str, precision: str,
             ghost: bool) -> Callable[[], Any]:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    b = x.shape[0]
    loss_fn = per_sample_loss(kind)
    if not ghost:
        gsm = GradSampleModule(model)
        opt = DPOptimizer(torch.optim.SGD(trainable_params(gsm), lr=LR), noise_multiplier=SIGMA,
                          max_grad_norm=CLIP, expected_batch_size=b)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast(x.device, precision):
                loss = loss_fn(gsm(x), y).mean()
            loss.backward()
            opt.step()

        return step
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=CLIP,
                                               use_ghost_clipping=True, loss_reduction="mean")
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(trainable_params(gsm), lr=LR), noise_multiplier=SIGMA,
        max_grad_norm=CLIP, expected_batch_size=b, loss_reduction="mean")
    criterion = DPLossFastGradientClipping(gsm, opt, _PerSampleCriterion(kind),
                                           loss_reduction="mean")

    def step_ghost() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast(x.device, precision):
            loss = criterion(gsm(x), y)
        loss.backward()  # two backward passes: norms, then the clipped sum
        opt.step()

    return step_ghost


def v_vmap(model: nn.Module, x: Tensor, y: Tensor, kind: str, precision: str) -> Callable[[], Any]:
    """vmap(grad) per-sample gradients of the trained params, then clip, noise, SGD."""
    model_fn, params, buffers = make_functional(model)
    names = model_fn.trainable
    train = {k: params[k] for k in names}
    fixed = {k: v for k, v in params.items() if k not in train}
    f = single_sample_fn(model_fn, buffers)
    loss_fn = per_sample_loss(kind)

    def loss1(tp: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return loss_fn(f({**fixed, **tp}, xi)[None], yi[None])[0]

    psg_fn = per_sample_grads(loss1)
    gen = torch.Generator(device=x.device).manual_seed(0)
    box = [train]

    def step() -> None:
        with autocast(x.device, precision):
            psg = psg_fn(box[0], x, y)
        norms = torch.stack([g.float().flatten(1).pow(2).sum(1) for g in psg.values()]).sum(0)
        coef = (CLIP / (norms.sqrt() + 1e-6)).clamp(max=1.0)
        new = {}
        for k, p in box[0].items():
            g = torch.einsum("b,b...->...", coef, psg[k].float())
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)
            new[k] = p - LR * (g + SIGMA * CLIP * noise) / x.shape[0]
        box[0] = new

    return step


def check_norms(model: nn.Module, x: Tensor, y: Tensor, kind: str) -> float:
    """max_i |ghost norm_i - vmap norm_i| / max_i vmap norm_i: the per-sample gradient norms of
    the trained params that torchfn's DP step clips by, against ``vmap(grad)`` (fp32)."""
    loss_fn = per_sample_loss(kind)
    ghost, params, buffers = make_ghost_model(model)
    got = ghost.per_sample(params, buffers, x, y, loss_fn).grads.sq_norms().detach().sqrt()
    model_fn, params, buffers = make_functional(model)
    train = {k: params[k] for k in model_fn.trainable}
    fixed = {k: v for k, v in params.items() if k not in train}
    f = single_sample_fn(model_fn, buffers)

    def loss1(tp: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return loss_fn(f({**fixed, **tp}, xi)[None], yi[None])[0]

    ref = torch.zeros(x.shape[0], device=x.device)
    for g in per_sample_grads(loss1, chunk_size=1)(train, x, y).values():
        ref += g.flatten(1).pow(2).sum(1)
    ref = ref.sqrt()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# --- running -------------------------------------------------------------------------------


def make_variant(variant: str, model: nn.Module, x: Tensor, y: Tensor, kind: str,
                 precision: str) -> tuple[Callable[[], Any], dict[str, Any]]:
    mode = variant.rsplit("-", 1)[-1]
    if variant == "torch-eager":
        return v_torch(model, x, y, kind, precision), {}
    if variant.startswith("nonprivate-"):
        return v_nonprivate(model, x, y, kind, precision, mode), {}
    if variant.startswith("dpsgd-"):
        return v_dpsgd(model, x, y, kind, precision, mode)
    if variant.startswith("opacus-"):
        return v_opacus(model, x, y, kind, precision, ghost=mode == "ghost"), {}
    if variant == "vmap-dpsgd":
        return v_vmap(model, x, y, kind, precision), {}
    raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")


def measure(fn: Callable[[], Any], device: torch.device, warmup: int,
            repeats: int) -> dict[str, float]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # peak over all calls, the first included
    t = time_calls(fn, device, warmup=warmup, repeats=repeats)
    out = {"median_ms": t.median_ms, "p10_ms": t.quantile_s(0.1) * 1e3,
           "p90_ms": t.quantile_s(0.9) * 1e3, "first_call_s": t.first_call_s}
    if device.type == "cuda":
        out["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_row(workload: str, variant: str, precision: str, template: nn.Module,
            cfg: dict[str, Any], device: torch.device, args: argparse.Namespace,
            notes: list[str]) -> dict[str, Any]:
    """One (workload, precision, variant) row; its error is recorded, never raised."""
    row: dict[str, Any] = {"workload": workload, "precision": precision, "variant": variant,
                           "batch": cfg["batch"]}
    if variant.endswith("-graphed") and device.type != "cuda":
        row["error"] = "skipped: make_graphed_step captures CUDA graphs (CUDA only)"
        return row
    try:
        model = copy.deepcopy(template).to(device)
        row["trained_params"] = sum(p.numel() for p in trainable_params(model))
        x, y = make_batch(workload, cfg, device)
        t0 = time.perf_counter()
        step, info = make_variant(variant, model, x, y, loss_kind(workload), precision)
        row["setup_s"] = time.perf_counter() - t0  # graphed: compile + capture happen here
        row.update(info)
        row.update(measure(step, device, args.warmup, args.steps))
        if variant == "dpsgd-eager" and precision == "fp32" and not args.no_check:
            try:
                row["norm_max_rel_diff_vs_vmap"] = check_norms(model, x, y, loss_kind(workload))
            except Exception as e:  # the reference itself failed: say so, keep the timing
                row["check_error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
    except Exception as e:  # refused layer, OOM, missing package: record it, go on
        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        row["error"] = ("out of memory: " if oom else "") + f"{type(e).__name__}: {first}"[:400]
        if not isinstance(e, ImportError) and not oom:
            notes.append(f"{workload}/{precision}/{variant}:\n{traceback.format_exc(limit=-4)}")
    return row


def _lookup(rows: list[dict[str, Any]], workload: str, precision: str, variant: str,
            key: str = "median_ms") -> float | None:
    for r in rows:
        if (r["workload"], r["precision"], r["variant"]) == (workload, precision, variant):
            return r.get(key)
    return None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per DP row: time and memory over the non-private step of the same mode, and the
    speed-up over Opacus and the vmap floor, each with its goal where one is set."""
    out = []
    for r in rows:
        if not r["variant"].startswith("dpsgd-") or "median_ms" not in r:
            continue
        w, p, mode = r["workload"], r["precision"], r["variant"].split("-", 1)[1]
        s: dict[str, Any] = {"workload": w, "precision": p, "variant": r["variant"]}
        base = f"nonprivate-{mode}"
        t0, m0 = _lookup(rows, w, p, base), _lookup(rows, w, p, base, "peak_mem_mb")
        if t0:
            s["dp_time"] = r["median_ms"] / t0
        if m0 and "peak_mem_mb" in r:
            s["dp_mem"] = r["peak_mem_mb"] / m0
        for other, key in [("opacus-ghost", "vs_opacus_ghost"), ("opacus-hooks", "vs_opacus_hooks"),
                           ("vmap-dpsgd", "vs_vmap")]:
            t = _lookup(rows, w, p, other)
            if t:
                s[key] = t / r["median_ms"]
        t = _lookup(rows, w, p, "torch-eager")
        if t:
            s["vs_torch"] = r["median_ms"] / t  # DP step time over plain PyTorch's step
        out.append(s)
    return out


def _goal(key: str, value: float) -> str:
    if key not in GOALS:
        return f"{value:.2f}x"
    ok = value <= GOALS[key] if key.startswith("dp_") else value >= GOALS[key]
    sign = "<=" if key.startswith("dp_") else ">="
    return f"{value:.2f}x ({'ok' if ok else 'MISS'}, goal {sign} {GOALS[key]}x)"


def fmt_row(r: dict[str, Any]) -> str:
    head = f"{r['workload']:<10}{r['precision']:<6}{r['variant']:<21}"
    if "error" in r:
        return head + f"  {r['error']}"
    mem = f"{r['peak_mem_mb']:9.0f} MiB" if "peak_mem_mb" in r else ""
    return (head + f"{r['median_ms']:10.2f} ms [{r['p10_ms']:.2f}, {r['p90_ms']:.2f}]{mem}"
            f"  first call {r['first_call_s']:.1f} s{_check_text(r)}")


def _check_text(r: dict[str, Any]) -> str:
    if "norm_max_rel_diff_vs_vmap" in r:
        return f"; per-sample norms vs vmap(grad): max rel diff {r['norm_max_rel_diff_vs_vmap']:.1e}"
    if "check_error" in r:
        return f"; norm check failed: {r['check_error']}"
    return ""


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "torchopt": torchopt.__version__}
    for mod in ("transformers", "peft", "opacus"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # not installed
            out[mod] = f"unavailable ({type(e).__name__})"
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out


PRECISION_TEXT = {
    "fp32": "fp32 parameters and compute, TF32 off (matmul and cuDNN)",
    "bf16": ("fp32 parameters, bf16 compute: torchfn amp='bf16'; torch/Opacus/vmap rows run the "
             "forward under torch.autocast(dtype=torch.bfloat16); losses in fp32"),
}


def to_markdown(result: dict[str, Any]) -> str:
    v = result["versions"]
    lines = [
        f"# DP-SGD on Hugging Face models: GPT-2 small, GPT-2 + LoRA, ViT-B/16 "
        f"({result['device']})", "",
        f"- Date: {result['date']}",
        f"- Device: {result['device']}; torch {v['torch']}"
        + (f", CUDA {v['cuda']}" if "cuda" in v else "")
        + f", Python {v['python']}; transformers {v['transformers']}, peft {v['peft']}, "
        f"opacus {v['opacus']}, torchopt {v['torchopt']}",
        f"- Command: `{result['command']}`",
        "- Precision: " + "; ".join(f"{p}: {PRECISION_TEXT[p]}" for p in result["precisions"]),
        f"- Timing: {result['warmup']} warm-up calls (the first timed alone: \"first call\"), then "
        f"the median of {result['steps']} synchronized repeats of one full step (forward, "
        "backward, clipping, noise, SGD update); p10/p90 in brackets; peak CUDA memory "
        "(max_memory_allocated) over all calls of the row, reset per row. Each row builds a fresh "
        "copy of the model (random weights, dropout 0).",
        f"- DP: noise multiplier {SIGMA}, flat clipping at {CLIP}, SGD lr {LR}; "
        f"{'tied' if not result['untie'] else 'untied'} wte/lm_head; position ids "
        f"{'(B, T), passed' if result['positions'] == 'expanded' else 'built by the model'}.",
        "- Setup s: building the step (for graphed rows: Inductor compile and CUDA-graph "
        "capture), before the first timed call.", ""]
    lines += [f"- Run {i}: {d} -- `{c}`" for i, (d, c) in enumerate(result.get("runs", []), 1)]
    lines += ["", "| workload | batch | precision | variant | median ms [p10, p90] | peak MiB | "
              "setup s | first call s | note |", "|---|---:|---|---|---:|---:|---:|---:|---|"]
    for r in result["results"]:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['batch']} | {r['precision']} | {r['variant']} "
                         f"| -- | -- | -- | -- | {r['error'].replace('|', '/')} |")
            continue
        mem = f"{r['peak_mem_mb']:.0f}" if "peak_mem_mb" in r else "--"
        setup = f"{r['setup_s']:.1f}" if "setup_s" in r else "--"
        note = (f"run {r['run']}; " if "run" in r else "") + f"{r['trained_params']:,} trained params"
        if r.get("layers"):
            note += "; ghost layers " + ", ".join(f"{k} {n}" for k, n in r["layers"].items())
        note += _check_text(r).replace("|", "/")
        lines.append(f"| {r['workload']} | {r['batch']} | {r['precision']} | {r['variant']} | "
                     f"{r['median_ms']:.2f} [{r['p10_ms']:.2f}, {r['p90_ms']:.2f}] | {mem} | "
                     f"{setup} | {r['first_call_s']:.1f} | {note} |")
    lines += ["", "Ratios (goals: DP / non-private <= 1.25x time and <= 1.3x memory; >= 3x "
              "faster than Opacus ghost clipping, >= 2x faster than Opacus hooks):", "",
              "| workload | precision | DP row | DP / non-private time | memory | Opacus ghost "
              "/ DP | Opacus hooks / DP | vmap floor / DP | DP / plain PyTorch step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        cells = [_goal(k, s[k]) if k in s else "--"
                 for k in ("dp_time", "dp_mem", "vs_opacus_ghost", "vs_opacus_hooks", "vs_vmap",
                           "vs_torch")]
        run = f" (run {s['run']})" if "run" in s else ""
        lines.append(f"| {s['workload']} | {s['precision']} | {s['variant']}{run} | "
                     + " | ".join(cells) + " |")
    if result["errors"]:
        lines += ["", "Tracebacks of the failed rows (last frames):", "", "```"]
        lines += [n.rstrip() for n in result["errors"]] + ["```"]
    return "\n".join(lines) + "\n"


def merge_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs: rows tagged with their run (each run compares its own
    rows side by side; ratios never mix runs), the runs' devices and commands listed."""
    if not parts:
        raise SystemExit("--merge: no JSON files given")
    flat = []  # a merged result (with "runs") splits back into its runs
    for p in parts:
        if "runs" not in p:
            flat.append(p)
            continue
        for i, (device, command) in enumerate(p["runs"], 1):
            rows = [{k: v for k, v in r.items() if k != "run"} for r in p["results"]
                    if r.get("run") == i]
            flat.append({**p, "device": device, "command": command, "results": rows,
                         "errors": p["errors"] if i == 1 else []})
    parts = flat
    out = dict(parts[0])
    out["runs"] = [(p["device"], p["command"]) for p in parts]
    out["device"] = ", ".join(dict.fromkeys(p["device"] for p in parts))
    out["date"] = max(p["date"] for p in parts)
    out["precisions"] = list(dict.fromkeys(q for p in parts for q in p["precisions"]))
    out["command"] = " ; ".join(p["command"] for p in parts)
    out["results"], out["summary"], out["errors"] = [], [], []
    for i, p in enumerate(parts, 1):
        rows = [{**r, "run": i} for r in p["results"]]
        out["results"] += rows
        out["summary"] += [{**x, "run": i} for x in summarize(rows)]
        out["errors"] += p["errors"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    workloads = args.workloads.split(",")
    variants = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    precisions = args.precision.split(",")
    for given, allowed, what in [(workloads, WORKLOADS, "--workloads"),
                                 (variants, VARIANTS, "--variants"),
                                 (precisions, ("fp32", "bf16"), "--precision")]:
        bad = [g for g in given if g not in allowed]
        if bad:
            raise SystemExit(f"{what}: unknown {bad}; expected a comma-separated subset of "
                             f"{', '.join(allowed)}")
    try:
        cfgs = configs(args.tiny, getattr(args, "batch", None))
    except ValueError as e:
        raise SystemExit(f"--batch: {e}") from None
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device": device_name(device),
        "versions": _versions(), "command": args.command, "tf32": set_tf32_off(),
        "precisions": precisions, "tiny": args.tiny, "steps": args.steps,
        "warmup": args.warmup, "untie": args.untie, "positions": args.positions,
        "inductor_config": getattr(args, "inductor_config", {}),
        "config": {w: cfgs[w] for w in workloads},
        "hyper": {"lr": LR, "noise_multiplier": SIGMA, "max_grad_norm": CLIP,
                  "dataset_size": DATASET},
        "results": [], "summary": [], "errors": []}
    rows, notes = result["results"], result["errors"]
    start = time.perf_counter()
    templates: dict[str, nn.Module] = {}
    for precision in precisions:
        for w in workloads:
            for variant in variants:
                elapsed = time.perf_counter() - start
                if elapsed > args.budget_s:
                    row = {"workload": w, "precision": precision, "variant": variant,
                           "batch": cfgs[w]["batch"],
                           "error": f"skipped: time budget (--budget-s {args.budget_s:g}) spent"}
                else:
                    if w not in templates:
                        templates[w] = build_model(w, cfgs[w], args.untie,
                                                   args.positions == "expanded")
                    row = run_row(w, variant, precision, templates[w], cfgs[w], device, args,
                                  notes)
                    _free(device)
                rows.append(row)
                print(fmt_row(row), flush=True)
                result["summary"] = summarize(rows)
                if args.json:  # rewritten per row: a run cut short keeps its rows
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps(result, indent=2))
                if args.md:
                    args.md.parent.mkdir(parents=True, exist_ok=True)
                    args.md.write_text(to_markdown(result))
    result["total_s"] = time.perf_counter() - start
    return result


def _set_inductor(items: list[str]) -> dict[str, Any]:
    """Set ``torch._inductor.config`` entries given as ``KEY=VALUE``; return them as a dict."""
    import ast

    import torch._inductor.config as inductor_config

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not hasattr(inductor_config, key):
            raise SystemExit(f"--inductor: expected KEY=VALUE with KEY a torch._inductor.config "
                             f"entry, got {item!r}")
        out[key] = ast.literal_eval(value)
        setattr(inductor_config, key, out[key])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated subset of {', '.join(VARIANTS)} "
                             "or 'all' (default: the eager ones)")
    parser.add_argument("--precision", default="fp32,bf16", help="fp32, bf16 or both")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed repeats per row (default 10; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up calls per row, the first timed alone (default 3; --tiny 1)")
    parser.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke test)")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per step for every workload (default: GPT-2 8, ViT 32)")
    parser.add_argument("--untie", action="store_true", help="untie GPT-2's wte and lm_head")
    parser.add_argument("--positions", choices=("expanded", "model"), default="expanded",
                        help="GPT-2 position ids: (B, T) passed in, or the model's own (1, T)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="rows starting after this many seconds are skipped (recorded)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the fp32 check of the DP step's per-sample norms vs vmap(grad)")
    parser.add_argument("--json", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--md", type=Path, default=None,
                        help="write a markdown results file here (benchmarks/results/...)")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="set torch._inductor.config.KEY (a Python literal) for every "
                             "compiled row, both sides (recorded in the results), e.g. "
                             "shape_padding=False")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                        help="measure nothing: merge the JSON files of earlier runs (each one "
                             "side by side on its own) into --md / --json")
    args = parser.parse_args(argv)
    if args.merge:
        merged = merge_results([json.loads(p.read_text()) for p in args.merge])
        if args.json:
            args.json.write_text(json.dumps(merged, indent=2))
        if args.md:
            args.md.write_text(to_markdown(merged))
        print(to_markdown(merged))
        return 0
    args.inductor_config = _set_inductor(args.inductor)
    args.steps = args.steps or (2 if args.tiny else 10)
    args.warmup = args.warmup or (1 if args.tiny else 3)
    args.command = "python benchmarks/dp_models.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    print(f"device: {device_name(torch.device(args.device))}; {_versions()}")
    print("precision: " + "; ".join(f"{p}: {PRECISION_TEXT[p]}" for p in args.precision.split(",")
                                    if p in PRECISION_TEXT), flush=True)
    result = run(args)
    print("ratios per DP row:")
    for s in result["summary"]:
        print(f"  {s['workload']}/{s['precision']}/{s['variant']}: " + ", ".join(
            f"{k} {_goal(k, s[k])}" for k in s if k not in ("workload", "precision", "variant")))
    for note in result["errors"]:
        print(note)
    print(f"total {result['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
