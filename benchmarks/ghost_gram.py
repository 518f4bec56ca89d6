"""Ghost Gram norms of sequence linears: the fused Triton kernel vs the plain-torch Gram form.

Per layer shape ``a (B, T, d_in)``, ``g (B, T, d_out)`` (bf16 by default), times

- ``twin``: ``torch.compile`` of the plain Gram form, ``torchfn.ops.reference``'s (two batched
  ``(B, T, T)`` GEMMs, odd sizes padded for the tensor cores, and the product-sum, plus the
  bias term) -- what a compiled DP step ran before the kernel;
- ``fused``: ``torchfn.ops._gram_triton.fused_gram_norms_sq`` with its default tile config,
  eager and under ``torch.compile``;
- with ``--configs``, the kernel at every config of a small grid (to check the default).

Each time is the device time per call with launches removed (``reps`` calls captured in one
CUDA graph, median of replays), as in a graphed step. Each variant's result is checked
against float64 (max relative difference printed). ``--workloads`` picks the layer sets:
``gpt2`` (GPT-2 small, B=8 and B=32, T=256, with the tied LM head's 50257 outputs), ``vit``
(ViT-B/16, B=32, T=197). The per-step total weighs each shape by its count in the model.

    python3 benchmarks/ghost_gram.py --json gram.json --md benchmarks/results/ghost-gram-h200.md
    python3 benchmarks/ghost_gram.py --small   # CPU smoke: the twin only
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import device_name, graph_replay_ms, set_tf32_off, write_json

from torchfn.ops import _gram_triton, reference

# (name, batch, time, d_in, d_out, layers of this shape per model)
WORKLOADS = {
    "gpt2": [
        ("gpt2 c_attn", 8, 256, 768, 2304, 12), ("gpt2 attn.c_proj", 8, 256, 768, 768, 12),
        ("gpt2 c_fc", 8, 256, 768, 3072, 12), ("gpt2 mlp.c_proj", 8, 256, 3072, 768, 12),
        ("gpt2 lm_head", 8, 256, 768, 50257, 1),
        ("gpt2 c_attn", 32, 256, 768, 2304, 12), ("gpt2 attn.c_proj", 32, 256, 768, 768, 12),
        ("gpt2 c_fc", 32, 256, 768, 3072, 12), ("gpt2 mlp.c_proj", 32, 256, 3072, 768, 12),
        ("gpt2 lm_head", 32, 256, 768, 50257, 1),
    ],
    "vit": [
        ("vit qkv", 32, 197, 768, 2304, 12), ("vit proj", 32, 197, 768, 768, 12),
        ("vit fc1", 32, 197, 768, 3072, 12), ("vit fc2", 32, 197, 3072, 768, 12),
    ],
}
SMALL = [("small", 2, 24, 16, 40, 1)]


def plain_gram(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The library's plain Gram form with the bias term (``torchfn.ops.reference``: half
    inputs of odd ``T`` or width padded for the tensor cores), what compiled steps ran before
    the kernel and still run where it does not apply."""
    return reference.linear_grad_norms_sq(a, g, bias=True, method="gram")


def reference64(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    a, g = a.double(), g.double()
    return ((a @ a.mT) * (g @ g.mT)).sum((1, 2)) + g.sum(1).square().sum(1)


def config_grid() -> list[dict[str, int]]:
    out = []
    for bt, bk, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (4, 8),
                                                   (2, 3, 4)):
        if bt == 128 and warps == 4:
            continue
        out.append({"BT": bt, "BK": bk, "num_warps": warps, "num_stages": stages})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gpt2,vit")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--configs", action="store_true", help="time the config grid too")
    parser.add_argument("--small", action="store_true", help="CPU smoke run")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--md", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    tf32 = set_tf32_off()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    shapes = SMALL if device.type == "cpu" else [
        s for w in args.workloads.split(",") for s in WORKLOADS[w]]
    twin = torch.compile(plain_gram, dynamic=False)
    _gram_triton.ensure_gram_op_registered()  # before compiling a call of it (Dynamo cannot register)
    fused_c = torch.compile(_gram_triton.fused_gram_norms_sq, dynamic=False)
    gen = torch.Generator(device).manual_seed(0)
    rows = [measure(shape, device, dtype, gen, twin, fused_c, args.configs) for shape in shapes]
    result = {"date": datetime.date.today().isoformat(), "device": device_name(device),
              "torch": torch.__version__, "dtype": args.dtype, "tf32": tf32,
              "command": "python3 benchmarks/ghost_gram.py " + " ".join(
                  sys.argv[1:] if argv is None else argv), "rows": rows}
    write_json(args.json, result)
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(markdown(result))
        print(f"wrote {args.md}")
    print(markdown(result))
    return 0


def measure(shape: tuple, device: torch.device, dtype: torch.dtype, gen: torch.Generator,
            twin, fused_c, configs: bool) -> dict:
    """Time and check every variant on one layer shape; return its row."""
    name, b, t, d_in, d_out, count = shape
    a = torch.randn(b, t, d_in, device=device, generator=gen).to(dtype)
    g = torch.randn(b, t, d_out, device=device, generator=gen).to(dtype)
    ref = reference64(a, g)

    def err(x: torch.Tensor | None) -> float | None:
        return None if x is None else ((x.double() - ref).abs() / ref.abs()).max().item()

    def fused() -> torch.Tensor | None:
        return _gram_triton.fused_gram_norms_sq(a, g, True)

    row = {"shape": name, "B": b, "T": t, "d_in": d_in, "d_out": d_out, "count": count,
           "twin_ms": graph_replay_ms(lambda: twin(a, g), device), "twin_err": err(twin(a, g))}
    if fused() is not None:
        row["fused_ms"] = graph_replay_ms(fused, device)
        row["fused_err"] = err(fused())
        row["fused_compiled_ms"] = graph_replay_ms(lambda: fused_c(a, g, True), device)
        row["fused_compiled_err"] = err(fused_c(a, g, True))
        row["config"] = _gram_triton.gram_norms_config(b, t)
        best = None
        for cfg in config_grid() if configs else []:
            def run(cfg: dict = cfg) -> torch.Tensor:
                return _gram_triton._launch(a, g, True, cfg, _gram_triton._direct)
            try:
                ms, e = graph_replay_ms(run, device), err(run())
            except Exception as exc:
                print(f"  {name} {cfg}: {type(exc).__name__}")
                continue
            if e is not None and e < 1e-2 and (best is None or ms < best[0]):
                best = (ms, cfg)
        if best is not None:
            row["best_ms"], row["best_config"] = best
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return row


def markdown(result: dict) -> str:
    def f(x: object, spec: str = ".4f") -> str:
        return "--" if x is None else format(x, spec)

    lines = [
        "# Ghost Gram norms: fused Triton kernel vs the plain Gram form",
        "",
        f"- Date: {result['date']}; device: {result['device']}; torch {result['torch']}; "
        f"{result['dtype']} inputs, float32 accumulation; TF32 off",
        f"- Command: `{result['command']}`",
        "- Device ms per call with launches removed (calls captured in one CUDA graph, median "
        "of replays); error: max relative difference from float64 over the batch.",
        "",
        "| shape | B | T | d_in | d_out | plain ms | fused ms | fused compiled ms | best ms "
        "(config) | plain err | fused err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    totals: dict[tuple, list[float]] = {}
    for r in result["rows"]:
        best = (f"{r['best_ms']:.4f} ({r['best_config']})" if "best_ms" in r else "--")
        lines.append(
            f"| {r['shape']} | {r['B']} | {r['T']} | {r['d_in']} | {r['d_out']} | "
            f"{f(r['twin_ms'])} | {f(r.get('fused_ms'))} | {f(r.get('fused_compiled_ms'))} | "
            f"{best} | {f(r['twin_err'], '.1e')} | {f(r.get('fused_err'), '.1e')} |")
        key = (r["shape"].split()[0], r["B"])
        tot = totals.setdefault(key, [0.0, 0.0])
        tot[0] += r["count"] * r["twin_ms"]
        tot[1] += r["count"] * r.get("fused_ms", r["twin_ms"])
    lines += ["", "Per model step (each shape times its layer count):", ""]
    for (model, b), (plain, fused) in totals.items():
        lines.append(f"- {model} B={b}: plain {plain:.3f} ms, fused {fused:.3f} ms "
                     f"({plain - fused:+.3f} ms saved)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
