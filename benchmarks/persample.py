"""Per-sample gradients and DP-SGD: torchfn vs Opacus vs JAX, on a CNN and a transformer.

Two models, side by side in one run:

- ``cnn``: 28x28x1 inputs, batch 256: Conv(1->32, 3x3) ReLU MaxPool, Conv(32->64, 3x3) ReLU
  MaxPool, Linear(3136->128) ReLU, Linear(128->10);
- ``transformer``: a 4-layer pre-LN encoder at sequence length 128 (d_model 256, 4 heads,
  MLP 1024, vocab 8192, batch 64, mean-pooled classifier), written from nn.Embedding,
  nn.Linear, nn.LayerNorm and F.scaled_dot_product_attention, so every parameterised layer
  has a closed-form ghost-norm rule (nn.TransformerEncoderLayer's nn.MultiheadAttention has
  a rule too, but it recomputes the attention core once more).

Timed training steps (SGD, noise multiplier 1, clipping norm 1; one full step each: forward,
backward, clipping, noise, update):

- ``torch-eager``: a plain PyTorch loop (module, loss.backward(), torch.optim.SGD);
- ``nonprivate-eager`` / ``nonprivate-compiled``: torchfn's ``make_train_step``;
- ``dpsgd-eager`` / ``dpsgd-compiled``: torchfn's ``make_dp_train_step`` (ghost norms,
  book-keeping clipped sum, counter-based noise; ``DPTrainStep.compile()``);
- ``nonprivate-graphed`` / ``dpsgd-graphed`` (CUDA only): the same two steps through
  ``make_graphed_step`` (compiled, captured as one CUDA graph, state donated);
  ``dpsgd-graphed-grouped``: the DP step with the convs on the batch-as-groups route
  (``make_ghost_model(conv_method="grouped")``);
- ``opacus-hooks``: Opacus ``GradSampleModule`` + ``DPOptimizer`` (materialised per-sample
  gradients); ``opacus-ghost``: Opacus ``GradSampleModuleFastGradientClipping`` +
  ``DPOptimizerFastGradientClipping`` + ``DPLossFastGradientClipping`` (ghost clipping, two
  backward passes) -- both when ``opacus`` imports;

and, for the CNN, materialised per-sample gradients: ``psg-torchfn-eager`` /
``psg-torchfn-compiled`` (``per_sample_grads``: vmap of grad) vs ``psg-jax``
(``jit(vmap(grad))`` of the same network in ``jax.lax``, same weights; checked to agree)
when ``jax`` imports.

Each entry: warm-up calls (compilation included), then the median of ``--repeats`` calls,
each timed with ``perf_counter`` between device synchronisations (so host overhead counts);
peak device memory per entry on CUDA. TF32 is set explicitly for torch and JAX (``--tf32``,
default off) and printed. Prints a table, writes JSON to ``--out``.

    python benchmarks/persample.py --out benchmarks/results/persample_h100.json
    python benchmarks/persample.py --small --device cpu       # smoke test (tiny sizes)
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchopt
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import device_name, time_calls, write_json

from torchfn.compile import make_graphed_step
from torchfn.functional import (
    init_train_state,
    make_functional,
    make_train_step,
    per_sample_grads,
    single_sample_fn,
)
from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model

LR, SIGMA, CLIP, DATASET = 0.01, 1.0, 1.0, 60_000


class CNN(nn.Module):
    def __init__(self, c1: int = 32, c2: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.fc1 = nn.Linear(c2 * 7 * 7, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: Tensor) -> Tensor:
        # split (not a strided view) so the qkv output gradient is contiguous: Opacus' ghost
        # clipping .view()s it
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(x.shape[-1], -1))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, ff: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, ids: Tensor) -> Tensor:
        # positions expanded to the batch: a layer's inputs must carry the batch in dim 0
        # (contiguous: Opacus' embedding norm sampler .view()s the ids)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()
        h = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h).mean(1))


def configs(small: bool) -> dict[str, dict[str, Any]]:
    if small:
        return {"cnn": {"batch": 8, "kw": {"c1": 4, "c2": 8, "hidden": 16}},
                "transformer": {"batch": 4, "kw": {"vocab": 50, "seq": 16, "d": 16,
                                                   "heads": 2, "ff": 32, "layers": 2}}}
    return {"cnn": {"batch": 256, "kw": {}},
            "transformer": {"batch": 64, "kw": {"vocab": 8192, "seq": 128, "d": 256,
                                                "heads": 4, "ff": 1024, "layers": 4}}}


def build(name: str, cfg: dict[str, Any], device: torch.device) -> tuple[nn.Module, Tensor,
                                                                         Tensor]:
    torch.manual_seed(0)
    b = cfg["batch"]
    if name == "cnn":
        model = CNN(**cfg["kw"])
        x = torch.randn(b, 1, 28, 28)
    else:
        model = Transformer(**cfg["kw"])
        x = torch.randint(0, cfg["kw"]["vocab"], (b, cfg["kw"]["seq"]))
    return model.to(device), x.to(device), torch.randint(0, 10, (b,), device=device)


def xent_none(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def xent_mean(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y)


# --- the timed variants: each returns a zero-argument callable doing one step --------------


def v_torch_eager(model: nn.Module, x: Tensor, y: Tensor, compiled: bool) -> Callable[[], Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        xent_mean(model(x), y).backward()
        opt.step()

    return step


def v_nonprivate(model: nn.Module, x: Tensor, y: Tensor, mode: str,
                 guard: bool = True) -> Callable[[], Any]:
    model_fn, params, buffers = make_functional(model)
    opt = torchopt.sgd(LR)
    fn = make_train_step(model_fn, xent_mean, opt, skip_nonfinite=guard)
    box = [init_train_state(params, buffers, opt, seed=0)]
    if mode == "graphed":
        fn = make_graphed_step(fn, box[0], (x, y))
    elif mode == "compiled":
        fn = torch.compile(fn, fullgraph=True)

    def step() -> None:
        box[0], _ = fn(box[0], (x, y))

    return step


def v_dpsgd(model: nn.Module, x: Tensor, y: Tensor, mode: str,
            conv_method: str = "unfold", guard: bool = True) -> Callable[[], Any]:
    ghost, params, buffers = make_ghost_model(model, conv_method=conv_method)
    fallback = [n for n, k in ghost.layer_kinds.items() if k == "fallback"]
    assert not fallback, f"layers on the vmap fallback: {fallback}"
    opt = torchopt.sgd(LR)
    dp = make_dp_train_step(ghost, xent_none, opt, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                            sample_rate=x.shape[0] / DATASET, dataset_size=DATASET,
                            skip_nonfinite=guard)
    valid = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    box = [init_dp_state(params, buffers, opt, seed=0)]
    fn: Callable[..., Any] = dp
    if mode == "graphed":
        # make_graphed_step applies DPTrainStep.inductor_options (see DPTrainStep.compile)
        fn = make_graphed_step(dp, box[0], (x, y), valid)
    elif mode == "compiled":
        fn = dp.compile()

    def step() -> dict[str, Tensor]:
        box[0], metrics = fn(box[0], (x, y), valid)
        return metrics

    return step


def v_opacus(model: nn.Module, x: Tensor, y: Tensor, ghost: bool) -> Callable[[], Any]:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    b = x.shape[0]
    if not ghost:
        gsm = GradSampleModule(model)
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=SIGMA,
                          max_grad_norm=CLIP, expected_batch_size=b)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            xent_mean(gsm(x), y).backward()
            opt.step()

        return step
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=CLIP,
                                               use_ghost_clipping=True, loss_reduction="mean")
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=SIGMA, max_grad_norm=CLIP,
        expected_batch_size=b, loss_reduction="mean")
    criterion = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(), loss_reduction="mean")

    def step_ghost() -> None:
        opt.zero_grad(set_to_none=True)
        criterion(gsm(x), y).backward()
        opt.step()

    return step_ghost


def v_psg_torchfn(model: nn.Module, x: Tensor, y: Tensor, compiled: bool) -> Callable[[], Any]:
    model_fn, params, buffers = make_functional(model)
    f = single_sample_fn(model_fn, buffers)

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(f(p, xi), yi)

    fn = per_sample_grads(loss)
    fn = torch.compile(fn, fullgraph=True) if compiled else fn
    return lambda: fn(params, x, y)


def v_psg_ghost(model: nn.Module, x: Tensor, y: Tensor, compiled: bool) -> Callable[[], Any]:
    """Materialised per-sample gradients from the ghost form: one forward, one backward, then
    per layer ``g_i^T a_i`` (Linear) or ``g_i^T unfold(x_i)`` (Conv) as batched matmuls."""
    ghost, params, buffers = make_ghost_model(model)

    def fn(p: dict[str, Tensor], b: dict[str, Tensor], xx: Tensor, yy: Tensor) -> Any:
        return ghost.per_sample(p, b, xx, yy, xent_none).grads.materialize()

    fn = torch.compile(fn, fullgraph=True) if compiled else fn
    return lambda: fn(params, buffers, x, y)


def jax_cnn_loss(prec: Any) -> Callable[[Any, Any, Any], Any]:
    """The CNN's one-sample loss ``loss(p, xi, yi)`` in jax.lax (``p`` keyed like the torch
    ``state_dict``; ``xi (1, 28, 28)``, int ``yi``) at matmul/conv precision ``prec``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def conv(h: Any, w: Any, b: Any) -> Any:
        out = lax.conv_general_dilated(h, w, (1, 1), ((1, 1), (1, 1)),
                                       dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                       precision=prec)
        return out + b[None, :, None, None]

    def pool(h: Any) -> Any:
        return lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

    def loss(p: Any, xi: Any, yi: Any) -> Any:
        h = pool(jax.nn.relu(conv(xi[None], p["conv1.weight"], p["conv1.bias"])))
        h = pool(jax.nn.relu(conv(h, p["conv2.weight"], p["conv2.bias"])))
        h = jax.nn.relu(jnp.matmul(h.reshape(1, -1), p["fc1.weight"].T, precision=prec)
                        + p["fc1.bias"])
        logits = (jnp.matmul(h, p["fc2.weight"].T, precision=prec) + p["fc2.bias"])[0]
        return -jax.nn.log_softmax(logits)[yi]

    return loss


def jax_cnn(model: CNN, x: Tensor, y: Tensor, tf32: bool) -> tuple[Callable[[], Any], Any]:
    """``jit(vmap(grad))`` of the CNN in jax.lax with the torch weights; returns (step, psg)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    jax.config.update("jax_default_matmul_precision", "tensorfloat32" if tf32 else "highest")
    # explicit per-op precision too: the config flag alone left cuDNN convs in TF32 on the H100
    # (per-sample gradients then differed from torch's fp32 ones by 2.5e-2 relative)
    prec = lax.Precision.DEFAULT if tf32 else lax.Precision.HIGHEST
    p = {k: jnp.asarray(v.detach().cpu().numpy()) for k, v in model.state_dict().items()}
    xs, ys = jnp.asarray(x.cpu().numpy()), jnp.asarray(y.cpu().numpy())
    loss = jax_cnn_loss(prec)
    fn = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))
    return (lambda: jax.block_until_ready(fn(p, xs, ys))), fn(p, xs, ys)


def max_rel_diff(got: dict[str, Any], ref: dict[str, Tensor]) -> float:
    """max over parameters of max|got - ref| / max|ref| (per-sample gradient dicts)."""
    return max(float((got[k].cpu() - ref[k].cpu()).abs().max()
                     / ref[k].abs().max().clamp_min(1e-30)) for k in ref)


# --- timing -------------------------------------------------------------------------------


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


def set_tf32(on: bool) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return {"torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "jax_default_matmul_precision": "tensorfloat32" if on else "highest"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    tf32 = set_tf32(args.tf32 == "on")
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    cfgs = configs(args.small)
    for name in args.models.split(","):
        cfg = cfgs[name]
        variants: list[tuple[str, Callable[[nn.Module, Tensor, Tensor], Callable[[], Any]]]] = [
            ("torch-eager", lambda m, x, y: v_torch_eager(m, x, y, False)),
            ("nonprivate-eager", lambda m, x, y: v_nonprivate(m, x, y, "eager")),
            ("dpsgd-eager", lambda m, x, y: v_dpsgd(m, x, y, "eager")),
            ("opacus-hooks", lambda m, x, y: v_opacus(m, x, y, False)),
            ("opacus-ghost", lambda m, x, y: v_opacus(m, x, y, True)),
        ]
        if not args.no_compile:
            variants[2:2] = [
                ("nonprivate-compiled", lambda m, x, y: v_nonprivate(m, x, y, "compiled")),
                ("dpsgd-compiled", lambda m, x, y: v_dpsgd(m, x, y, "compiled"))]
            if device.type == "cuda":  # make_graphed_step: one CUDA graph per step
                variants[4:4] = [
                    ("nonprivate-graphed", lambda m, x, y: v_nonprivate(m, x, y, "graphed")),
                    ("dpsgd-graphed", lambda m, x, y: v_dpsgd(m, x, y, "graphed")),
                    # the non-finite guard off on both sides: what the guard costs
                    ("nonprivate-graphed-noguard",
                     lambda m, x, y: v_nonprivate(m, x, y, "graphed", guard=False)),
                    ("dpsgd-graphed-noguard",
                     lambda m, x, y: v_dpsgd(m, x, y, "graphed", guard=False)),
                    # the convs through batch-as-groups weight-gradient convolutions
                    ("dpsgd-graphed-grouped",
                     lambda m, x, y: v_dpsgd(m, x, y, "graphed", "grouped"))]
        if name == "cnn":
            variants.append(("psg-torchfn-eager", lambda m, x, y: v_psg_torchfn(m, x, y, False)))
            if not args.no_compile:
                variants.append(("psg-torchfn-compiled",
                                 lambda m, x, y: v_psg_torchfn(m, x, y, True)))
            variants.append(("psg-ghost-eager", lambda m, x, y: v_psg_ghost(m, x, y, False)))
            if not args.no_compile:
                variants.append(("psg-ghost-compiled",
                                 lambda m, x, y: v_psg_ghost(m, x, y, True)))
            variants.append(("psg-jax", None))  # type: ignore[arg-type]
        if args.only:
            variants = [v for v in variants if v[0] in args.only.split(",")]
        for variant, make in variants:
            model, x, y = build(name, cfg, device)
            row: dict[str, Any] = {"model": name, "variant": variant, "batch": x.shape[0]}
            try:
                if variant == "psg-jax":
                    step, jax_psg = jax_cnn(model, x, y, args.tf32 == "on")
                    ref = v_psg_torchfn(model, x, y, False)()
                    row["max_rel_diff_vs_torchfn"] = max_rel_diff(
                        {k: torch.as_tensor(v.__array__()) for k, v in jax_psg.items()}, ref)
                else:
                    step = make(model, x, y)
                    if variant.startswith("psg-ghost"):
                        row["max_rel_diff_vs_torchfn"] = max_rel_diff(
                            step(), v_psg_torchfn(model, x, y, False)())
                row.update(measure(step, device, args.warmup, args.repeats))
            except Exception as e:  # a missing package or an unsupported layer: record it
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                if not isinstance(e, ImportError):
                    notes.append(f"{name}/{variant}: {traceback.format_exc(limit=3)}")
            rows.append(row)
            print(_fmt(row, rows), flush=True)
            del model, x, y
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"device": device_name(device), "torch": torch.__version__,
            "versions": _versions(), "tf32": tf32, "small": args.small,
            "repeats": args.repeats, "warmup": args.warmup,
            "config": {k: cfgs[k] for k in args.models.split(",")},
            "hyper": {"lr": LR, "noise_multiplier": SIGMA, "max_grad_norm": CLIP},
            "results": rows, "summary": summarize(rows), "errors": notes}


def _base(rows: list[dict[str, Any]], row: dict[str, Any]) -> float | None:
    mode = row["variant"].rsplit("-", 1)[-1]
    mode = mode if mode in ("compiled", "graphed") else "eager"
    for r in rows:
        if r["model"] == row["model"] and r["variant"] == f"nonprivate-{mode}":
            return r.get("median_ms")
    return None


def _fmt(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    head = f"{row['model']:<12}{row['variant']:<22}"
    if "error" in row:
        return head + f"  unavailable: {row['error']}"
    base = _base(rows, row)
    ratio = f"{row['median_ms'] / base:6.2f}x" if base else "      "
    mem = f"{row['peak_mem_mb']:9.0f} MB" if "peak_mem_mb" in row else ""
    extra = (f"  (max rel diff vs torchfn {row['max_rel_diff_vs_torchfn']:.1e})"
             if "max_rel_diff_vs_torchfn" in row else "")
    return (head + f"{row['median_ms']:10.3f} ms [{row['p10_ms']:.3f}, {row['p90_ms']:.3f}]"
            f"  {ratio} of non-private{mem}  first call {row['first_call_s']:.1f} s{extra}")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def ms(model: str, variant: str) -> float | None:
        for r in rows:
            if r["model"] == model and r["variant"] == variant:
                return r.get("median_ms")
        return None

    out: dict[str, Any] = {}
    for model in sorted({r["model"] for r in rows}):
        for a, b in [("dpsgd-compiled", "nonprivate-compiled"), ("dpsgd-eager", "nonprivate-eager"),
                     ("dpsgd-graphed", "nonprivate-graphed"),
                     ("dpsgd-graphed-grouped", "nonprivate-graphed"),
                     ("dpsgd-graphed", "nonprivate-compiled"),
                     ("dpsgd-graphed", "opacus-hooks"), ("dpsgd-graphed", "opacus-ghost"),
                     ("dpsgd-compiled", "torch-eager"), ("dpsgd-compiled", "opacus-ghost"),
                     ("dpsgd-compiled", "opacus-hooks"), ("dpsgd-eager", "opacus-ghost"),
                     ("psg-torchfn-compiled", "psg-jax"), ("psg-torchfn-eager", "psg-jax"),
                     ("psg-ghost-compiled", "psg-jax")]:
            ta, tb = ms(model, a), ms(model, b)
            if ta is not None and tb is not None and not math.isnan(ta):
                out[f"{model}: {a} / {b}"] = round(ta / tb, 3)
    return out


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torchopt": torchopt.__version__}
    for mod in ("opacus", "jax", "jaxlib"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # not installed
            out[mod] = f"unavailable ({type(e).__name__})"
    try:
        import jax

        out["jax_backend"] = f"{jax.default_backend()} {jax.devices()[0]}"
    except Exception as e:  # not installed, or no usable backend
        out["jax_backend"] = f"unavailable ({type(e).__name__})"
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="cnn,transformer")
    parser.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--tf32", choices=("off", "on"), default="off")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile entries")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--only", default=None, metavar="VARIANTS",
                        help="comma-separated variant names to run (default: all)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.small else 50)
    args.warmup = args.warmup or (2 if args.small else 10)
    print(f"device: {device_name(torch.device(args.device))}, torch {torch.__version__}, "
          f"{_versions()}")
    result = run(args)
    print(f"TF32: {result['tf32']}")
    print("summary (ratios of median step times):")
    for k, v in result["summary"].items():
        print(f"  {k}: {v}")
    for note in result["errors"]:
        print(note)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
