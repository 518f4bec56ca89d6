"""GPU idle time and step time of a small CNN trained on a stream, with and without
``torchfn.data.DevicePrefetcher``.

The stream: ``StreamingLoader(StreamingDataset(NumpySource(...)))`` over memory-mapped
``.npy`` images (``--n`` samples of ``[3, --size, --size]`` float32, labels 0..9), batch
``--batch``, ``--workers`` DataLoader workers. The model: conv(3->32) + ReLU + conv(32->64,
stride 2) + ReLU + global average pool + linear(64->10), cross entropy, ``torch.optim.SGD``.

Modes (same stream, same model and seed):

- ``plain``: ``batch["x"].to(device)`` in the loop (pageable memory, a synchronous copy);
- ``pinned``: ``DataLoader(pin_memory=True)`` (pinned by the DataLoader's thread) and
  ``.to(device, non_blocking=True)`` on the compute stream;
- ``prefetch``: ``DevicePrefetcher(loader, device, depth=--depth)`` (pinned in the main
  thread, non-blocking copies on a side stream, ``depth`` batches ahead);
- ``pinned+prefetch``: both: the DataLoader's thread pins, the prefetcher only copies.

Per mode: ``--warmup`` steps, then ``--steps`` timed steps (wall time / steps after a
synchronize = step time), then ``--profile-steps`` steps under ``torch.profiler``: the GPU
activity (kernels, memcpy, memset) is merged into busy intervals; GPU idle = the sum of the
gaps between them, reported per step and as a fraction of the profiled span (first start to
last end). On the CPU (``--device cpu``, a smoke check) the idle columns are n/a.

Usage:

    python benchmarks/data_prefetch.py [--device cuda] [--n 4096] [--size 64] [--batch 128]
        [--steps 40] [--json F] [--md F]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from torchfn.data import DevicePrefetcher, NumpySource, StreamingDataset, StreamingLoader

MODES = ("plain", "pinned", "prefetch", "pinned+prefetch")


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def _stream(root: str, mode: str, device: torch.device, a: argparse.Namespace) -> Iterable[Any]:
    src = NumpySource({"x": os.path.join(root, "x.npy")}, labels=os.path.join(root, "y.npy"))
    ds = StreamingDataset(src, batch_size=a.batch, seed=0)
    pin = mode.startswith("pinned") and device.type == "cuda"
    loader = StreamingLoader(ds, num_workers=a.workers, pin_memory=pin)
    if mode.endswith("prefetch"):
        return DevicePrefetcher(loader, device, depth=a.depth)
    return loader


def _batches(root: str, mode: str, device: torch.device, a: argparse.Namespace):
    """Yields (x, y) on ``device`` forever (epochs in a row)."""
    epoch = 0
    while True:
        stream = _stream(root, mode, device, a)
        stream.set_epoch(epoch)
        for b in stream:
            nb = mode == "pinned"
            yield b["x"].to(device, non_blocking=nb), b["label"].to(device, non_blocking=nb)
        epoch += 1


def _gpu_gaps(prof: Any) -> tuple[float, float, int] | None:
    """(idle us, span us, intervals) over the profiled GPU activity, or None without any."""
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end))
    if not spans:
        return None
    spans.sort()
    idle, end = 0.0, spans[0][1]
    for s, t in spans[1:]:
        if s > end:
            idle += s - end
        end = max(end, t)
    return idle, end - spans[0][0], len(spans)


def run_mode(root: str, mode: str, device: torch.device, a: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    it = _batches(root, mode, device, a)

    def step() -> torch.Tensor:
        x, y = next(it)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(a.warmup):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    step_s = (time.perf_counter() - t) / a.steps
    row: dict[str, Any] = {"mode": mode, "step_ms": step_s * 1e3,
                           "samples_per_s": a.batch / step_s, "last_loss": float(loss)}
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(a.profile_steps):
            step()
        sync()
        prof_s = time.perf_counter() - t
    gaps = _gpu_gaps(prof) if device.type == "cuda" else None
    row["profiled_step_ms"] = prof_s / a.profile_steps * 1e3
    if gaps is None:
        row.update(idle_ms_per_step=None, idle_fraction=None)
    else:
        idle_us, span_us, n = gaps
        row.update(idle_ms_per_step=idle_us / 1e3 / a.profile_steps,
                   idle_fraction=idle_us / span_us, gpu_intervals=n)
    return row


def write_md(out: dict[str, Any], path: str) -> None:
    lines = [
        "# Device prefetch: GPU idle time and step time (benchmarks/data_prefetch.py)", "",
        f"- Date: {out['date']}", f"- Device: {out['device_name']}",
        f"- torch {out['torch']}, Python {out['python']}", f"- Command: `{out['command']}`",
        f"- Stream: {out['n']} samples of [3, {out['size']}, {out['size']}] float32, batch "
        f"{out['batch']}, {out['workers']} DataLoader workers; prefetch depth {out['depth']}",
        "- GPU idle: gaps between merged GPU activity intervals (kernels, memcpy, memset) in "
        f"{out['profile_steps']} profiled steps, per step and as a fraction of their span", "",
        "| mode | step ms | samples/s | profiled step ms | GPU idle ms/step | GPU idle |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        idle = "n/a" if r["idle_ms_per_step"] is None else f"{r['idle_ms_per_step']:.3f}"
        frac = "n/a" if r["idle_fraction"] is None else f"{100 * r['idle_fraction']:.1f}%"
        lines.append(f"| {r['mode']} | {r['step_ms']:.3f} | {r['samples_per_s']:.0f} | "
                     f"{r['profiled_step_ms']:.3f} | {idle} | {frac} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    modes = [m for m in a.modes.split(",") if m]
    bad = sorted(set(modes) - set(MODES))
    if bad:
        ap.error(f"--modes: unknown {bad}; expected a subset of {list(MODES)}")
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"CPU ({os.cpu_count()} cores)",
        "command": "python " + shlex.join(["benchmarks/data_prefetch.py", *(
            sys.argv[1:] if argv is None else argv)]),
        **{k: getattr(a, k) for k in ("n", "size", "batch", "workers", "depth", "steps",
                                      "profile_steps")},
        "rows": [],
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        rng = np.random.default_rng(0)
        np.save(os.path.join(root, "x.npy"),
                rng.standard_normal((a.n, 3, a.size, a.size), dtype=np.float32))
        np.save(os.path.join(root, "y.npy"), rng.integers(0, 10, a.n).astype(np.int64))
        for mode in modes:
            row = run_mode(root, mode, device, a)
            out["rows"].append(row)
            idle = ("n/a" if row["idle_ms_per_step"] is None else
                    f"{row['idle_ms_per_step']:.3f} ms/step ({100 * row['idle_fraction']:.1f}%)")
            print(f"{mode:9s} step {row['step_ms']:8.3f} ms  {row['samples_per_s']:9.0f} "
                  f"samples/s  GPU idle {idle}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.md:
        write_md(out, a.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
