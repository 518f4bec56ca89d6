"""``torchfn.compile.profile_step`` on the MAML and DP-SGD steps: tables and Chrome traces.

The helper's own output for two of the library's step kinds, written as a results file: the
MAML outer step (second order, the sweep's 4-block conv net with BatchNorm on 28x28 inputs)
and the DP-SGD step (``benchmarks/persample.py``'s transformer, ghost clipping). An eager step
shows the step's named parts (``torchfn.inner_loop``, ``torchfn.outer_grad``,
``torchfn.ghost_norms``, ``torchfn.clip``, ``torchfn.noise``, ``torchfn.optimizer``, ...);
``--compile`` profiles ``torch.compile(step, fullgraph=True)`` instead (compiled regions and
kernels). Each trace is gzipped next to the markdown (Perfetto opens ``.json.gz``).

    python benchmarks/profile_steps.py --device cpu --md benchmarks/results/profile-steps-cpu.md
    python benchmarks/profile_steps.py --device cuda --md benchmarks/results/profile-steps-h200.md
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
for _path in (str(HERE.parent), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from meta import conv_net, make_tasks  # noqa: E402
from persample import CLIP, LR, SIGMA, build, xent_none  # noqa: E402

from torchfn.compile import profile_step  # noqa: E402
from torchfn.functional import make_functional  # noqa: E402
from torchfn.meta import init_meta_state, make_meta_train_step, maml  # noqa: E402
from torchfn.optim import adam  # noqa: E402
from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model  # noqa: E402

#: (CPU-sized, GPU-sized) workloads: MAML ways/shots/tasks/inner steps/channels; DP model size
SIZES = {
    "cpu": {"maml": {"channels": 16, "ways": 5, "shots": 1, "tasks": 4, "query": 5, "steps": 2},
            "dp": {"batch": 16, "kw": {"vocab": 512, "seq": 32, "d": 64, "heads": 4,
                                       "ff": 128, "layers": 2}}},
    "cuda": {"maml": {"channels": 64, "ways": 5, "shots": 1, "tasks": 32, "query": 15,
                      "steps": 5},
             "dp": {"batch": 64, "kw": {"vocab": 8192, "seq": 128, "d": 256, "heads": 4,
                                        "ff": 1024, "layers": 4}}},
}


def maml_step(device: torch.device, cfg: dict[str, Any]) -> tuple[Any, Any, Any, str]:
    torch.manual_seed(0)
    module = conv_net(cfg["channels"], cfg["ways"], 28).to(device)
    tasks = make_tasks(cfg["tasks"], cfg["ways"], cfg["shots"], cfg["query"], 28, device,
                       torch.float32)
    model_fn, params, buffers = make_functional(module)
    learner = maml(model_fn, F.cross_entropy, inner_lr=0.01, inner_steps=cfg["steps"])
    opt = adam(1e-3)
    what = (f"MAML second order, conv4 ({cfg['channels']} channels, BatchNorm), "
            f"{cfg['ways']}-way {cfg['shots']}-shot, {cfg['tasks']} tasks x {cfg['query']} "
            f"query, {cfg['steps']} inner steps, Adam outer")
    return make_meta_train_step(learner, opt), init_meta_state(learner, params, buffers, opt), \
        tasks, what


def dp_step(device: torch.device, cfg: dict[str, Any]) -> tuple[Any, Any, Any, str]:
    model, x, y = build("transformer", cfg, device)
    ghost, params, buffers = make_ghost_model(model)
    opt = adam(LR)
    dp = make_dp_train_step(ghost, xent_none, opt, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                            sample_rate=0.01, dataset_size=100 * x.shape[0])
    valid = torch.ones(x.shape[0], dtype=torch.bool, device=device)
    kw = cfg["kw"]
    what = (f"DP-SGD (ghost clipping, noise, Adam), transformer {kw['layers']} layers d={kw['d']} "
            f"seq {kw['seq']}, batch {x.shape[0]}")
    return (lambda s, b: dp(s, b, valid)), init_dp_state(params, buffers, opt, seed=0), \
        (x, y), what


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--compile", action="store_true",
                    help="profile torch.compile(step, fullgraph=True) (kernels, no parts)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--md", default=None, help="markdown results (traces gzipped beside it)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("profile_steps.py --device cuda: no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    sizes = SIZES[device.type]
    out_dir = Path(args.md).parent if args.md else Path(tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(args.md).stem if args.md else "profile-steps"
    lines = [f"# `profile_step` on the MAML and DP-SGD steps ({device.type})", "",
             f"- Date: {datetime.date.today()}; torch {torch.__version__}"
             + (f"; {torch.cuda.get_device_name()}, TF32 off" if device.type == "cuda" else
                f"; CPU, {torch.get_num_threads()} threads"),
             f"- Command: `python benchmarks/profile_steps.py {' '.join(argv or sys.argv[1:])}`",
             f"- {'Compiled' if args.compile else 'Eager'} steps, {args.warmup} warm-up and "
             f"{args.steps} profiled steps each; `torchfn.compile.profile_step`'s own table "
             "below each heading, its Chrome trace gzipped beside this file.", ""]
    for name, make in (("maml", maml_step), ("dp", dp_step)):
        step, state, batch, what = make(device, sizes[name])
        if args.compile:
            step = torch.compile(step, fullgraph=True)
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof = profile_step(step, state, batch, warmup=args.warmup, steps=args.steps,
                                trace=raw, top_k=args.top)
            trace = out_dir / f"{stem}-{name}-trace.json.gz"
            with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
        table = prof.table().replace(raw, trace.name)
        print(f"== {name}: {what}\n{table}\ntrace: {trace}", flush=True)
        lines += [f"## {what}", "", f"Trace: `{trace.name}`", "", "```", table.rstrip(), "```",
                  ""]
    if args.md:
        Path(args.md).write_text("\n".join(lines))
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
