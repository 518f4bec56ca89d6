"""GPU idle time and step time of a ResNet-18-style CNN trained on a stream, with and without
``torchfn.data.DevicePrefetcher``, against the same model fed from batches already on the GPU.

The stream: ``StreamingLoader(StreamingDataset(NumpySource(...)))`` over memory-mapped
``.npy`` images (``--n`` samples of ``[3, --size, --size]`` float32, labels 0..9), batch
``--batch``, ``--workers`` DataLoader workers (default: min(8, cores - 2)). The model: a
ResNet-18 layout for small images (3x3 stem at full resolution, four stages of two basic
blocks, ``--width`` channels in the first stage, doubled per stage, BatchNorm), cross entropy,
``torch.optim.SGD`` with momentum; ``--amp bf16`` runs forward and loss under bf16 autocast.

Modes (same model and seed):

- ``resident``: the upper bound, no input pipeline: 8 batches of the stream put on the device
  once, then cycled;
- ``plain``: ``batch["x"].to(device)`` in the loop (pageable memory, a synchronous copy);
- ``pinned``: ``DataLoader(pin_memory=True)`` (pinned by the DataLoader's thread) and
  ``.to(device, non_blocking=True)`` on the compute stream;
- ``prefetch``: ``DevicePrefetcher(loader, device, depth=--depth)`` (staged into reused pinned
  buffers and copied on a side stream by its thread, ``depth`` batches ahead);
- ``pinned+prefetch``: both: the DataLoader's thread pins, the prefetcher only copies.

The stream modes see the same batches in the same order (one ``StreamingLoader`` per mode,
``set_epoch`` per epoch). Per mode: ``--warmup`` steps, then ``--steps`` timed steps (wall
time / steps after a synchronize = step time), then ``--profile-steps`` steps under
``torch.profiler``: the GPU activity (kernels, memcpy, memset) is merged into busy intervals;
GPU idle = the sum of the gaps between them, reported per step and as a fraction of the
profiled span (first start to last end). "vs resident" is step time / the resident step
time. The default ``--n`` holds all the measured steps in one epoch (a new epoch starts new
DataLoader workers). Before the modes, the stream alone (no model, ``--stream-batches``
batches after the first) is timed with and without ``pin_memory``. On the CPU
(``--device cpu``, a smoke check) the idle columns are n/a.

Usage:

    python benchmarks/data_prefetch.py [--device cuda] [--n 8192] [--size 64] [--batch 128]
        [--workers W] [--width 64] [--amp none|bf16] [--steps 40] [--json F] [--md F]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from torchfn.data import DevicePrefetcher, NumpySource, StreamingDataset, StreamingLoader

MODES = ("resident", "plain", "pinned", "prefetch", "pinned+prefetch")
RESIDENT_BATCHES = 8


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


def _model(width: int) -> nn.Module:
    """ResNet-18 for small images: 3x3 stem, stages of ``width * (1, 2, 4, 8)`` channels."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU()]
    cin = width
    for i, mult in enumerate((1, 2, 4, 8)):
        cout = width * mult
        layers += [_Block(cin, cout, 1 if i == 0 else 2), _Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def _loader(root: str, pin: bool, a: argparse.Namespace, workers: int) -> StreamingLoader:
    src = NumpySource({"x": os.path.join(root, "x.npy")}, labels=os.path.join(root, "y.npy"))
    ds = StreamingDataset(src, batch_size=a.batch, seed=0)
    return StreamingLoader(ds, num_workers=workers, pin_memory=pin)


def _batches(root: str, mode: str, device: torch.device, a: argparse.Namespace):
    """Yields (x, y) on ``device`` forever (epochs in a row)."""
    if mode == "resident":
        host = itertools.islice(_loader(root, False, a, 0), RESIDENT_BATCHES)
        on_dev = [(b["x"].to(device), b["label"].to(device)) for b in host]
        yield from itertools.cycle(on_dev)
    pin = mode.startswith("pinned") and device.type == "cuda"
    stream: Any = _loader(root, pin, a, a.workers)
    if mode.endswith("prefetch"):
        stream = DevicePrefetcher(stream, device, depth=a.depth)
    nb = mode == "pinned"
    for epoch in itertools.count():
        stream.set_epoch(epoch)
        for b in stream:
            yield b["x"].to(device, non_blocking=nb), b["label"].to(device, non_blocking=nb)


def stream_alone(root: str, pin: bool, a: argparse.Namespace) -> float:
    """Samples/s of the stream with no model: ``--stream-batches`` batches after the first."""
    it = iter(_loader(root, pin, a, a.workers))
    next(it)
    t = time.perf_counter()
    k = sum(1 for _ in itertools.islice(it, a.stream_batches))
    return k * a.batch / (time.perf_counter() - t)


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
    model = _model(a.width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    it = _batches(root, mode, device, a)

    def step() -> torch.Tensor:
        x, y = next(it)
        with torch.autocast(device.type, torch.bfloat16, enabled=a.amp == "bf16"):
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
    it.close()  # ends the loader's workers before the next mode
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
    alone = ", ".join(f"{k} {v:.0f} samples/s" for k, v in out["stream_alone"].items())
    lines = [
        "# Device prefetch: GPU idle time and step time (benchmarks/data_prefetch.py)", "",
        f"- Date: {out['date']}", f"- Device: {out['device_name']} ({out['cpus']} CPU cores)",
        f"- torch {out['torch']}, Python {out['python']}", f"- Command: `{out['command']}`",
        f"- Stream: {out['n']} samples of [3, {out['size']}, {out['size']}] float32, batch "
        f"{out['batch']}, {out['workers']} DataLoader workers; prefetch depth {out['depth']}",
        f"- Model: ResNet-18 layout for small images, width {out['width']}, amp {out['amp']}, "
        "SGD with momentum",
        f"- Stream alone (no model): {alone}",
        "- resident: batches already on the device (no input pipeline: the bound); vs resident "
        "= step time / the resident step time",
        "- GPU idle: gaps between merged GPU activity intervals (kernels, memcpy, memset) in "
        f"{out['profile_steps']} profiled steps, per step and as a fraction of their span", "",
        "| mode | step ms | samples/s | vs resident | profiled step ms | GPU idle ms/step | "
        "GPU idle |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        idle = "n/a" if r["idle_ms_per_step"] is None else f"{r['idle_ms_per_step']:.3f}"
        frac = "n/a" if r["idle_fraction"] is None else f"{100 * r['idle_fraction']:.1f}%"
        vs = "n/a" if r.get("vs_resident") is None else f"{r['vs_resident']:.3f}"
        lines.append(f"| {r['mode']} | {r['step_ms']:.3f} | {r['samples_per_s']:.0f} | {vs} | "
                     f"{r['profiled_step_ms']:.3f} | {idle} | {frac} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 1) - 2)))
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--amp", choices=("none", "bf16"), default="none")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--stream-batches", type=int, default=30)
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
        else "CPU", "cpus": os.cpu_count(),
        "command": "python " + shlex.join(["benchmarks/data_prefetch.py", *(
            sys.argv[1:] if argv is None else argv)]),
        **{k: getattr(a, k) for k in ("n", "size", "batch", "workers", "depth", "width", "amp",
                                      "warmup", "steps", "profile_steps")},
        "stream_alone": {}, "rows": [],
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        rng = np.random.default_rng(0)
        x = np.lib.format.open_memmap(os.path.join(root, "x.npy"), mode="w+",
                                      dtype=np.float32, shape=(a.n, 3, a.size, a.size))
        for i in range(0, a.n, 1024):
            x[i:i + 1024] = rng.standard_normal((min(1024, a.n - i), 3, a.size, a.size),
                                                dtype=np.float32)
        x.flush()
        del x
        np.save(os.path.join(root, "y.npy"), rng.integers(0, 10, a.n).astype(np.int64))
        for pin in (False, True) if device.type == "cuda" else (False,):
            name = "pinned" if pin else "plain"
            out["stream_alone"][name] = stream_alone(root, pin, a)
            print(f"stream alone ({name}): {out['stream_alone'][name]:.0f} samples/s",
                  flush=True)
        for mode in modes:
            row = run_mode(root, mode, device, a)
            out["rows"].append(row)
            idle = ("n/a" if row["idle_ms_per_step"] is None else
                    f"{row['idle_ms_per_step']:.3f} ms/step ({100 * row['idle_fraction']:.1f}%)")
            print(f"{mode:15s} step {row['step_ms']:8.3f} ms  {row['samples_per_s']:9.0f} "
                  f"samples/s  GPU idle {idle}", flush=True)
    bound = next((r["step_ms"] for r in out["rows"] if r["mode"] == "resident"), None)
    for r in out["rows"]:
        r["vs_resident"] = None if bound is None else r["step_ms"] / bound
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.md:
        write_md(out, a.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
