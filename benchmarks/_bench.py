"""Helpers shared by the benchmark scripts: the one timer, a back-to-back kernel timer, results.

Every script times with :func:`time_calls` (warm-up calls, the first one timed on its own as
it compiles, then the median of synchronized repeats) or, for kernels launched back to back,
:func:`back_to_back_ms`.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def sync(device: torch.device | str | None) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """What :func:`time_calls` measured; times in seconds per call.

    ``times_s``: one entry per repeat, in the order taken (each the mean of ``inner`` calls).
    ``first_call_s``: the first call alone (compilation included). ``first_output``: what
    the first call returned.
    """

    times_s: list[float]
    first_call_s: float
    inner: int = 1
    first_output: object = field(default=None, repr=False)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    def quantile_s(self, q: float) -> float:
        """The ``int(q * n)``-th smallest repeat (``q=0.1``: p10, ``q=0.9``: p90)."""
        s = sorted(self.times_s)
        return s[min(len(s) - 1, int(len(s) * q + 1e-9))]


def time_calls(fn: Callable[[], object], device: torch.device | str | None = None, *,
               warmup: int = 3, repeats: int = 20, inner: int = 1,
               min_sample_s: float | None = None, clock: str = "wall",
               wait: Callable[[], None] | None = None,
               before_repeats: Callable[[], None] | None = None) -> Timing:
    """Time ``fn()``: ``warmup`` calls (the first timed alone), then ``repeats`` synchronized repeats.

    Each repeat runs ``fn`` ``inner`` times and waits for the device; its time is the mean
    per call. ``clock="wall"`` times a repeat with ``time.perf_counter`` between
    synchronizations, so host overhead counts; ``clock="events"`` brackets it with CUDA events
    (device time; wall clock off CUDA). ``min_sample_s`` picks ``inner`` (at most 200) so a
    repeat lasts at least that long, from one more timed call after the warm-up. ``wait``
    replaces the device synchronization (e.g. JAX's ``block_until_ready``).
    ``before_repeats`` runs after the warm-up, just before the repeats (to reset peak memory
    counters, say).
    """
    if clock not in ("wall", "events"):
        raise ValueError(f"time_calls(clock={clock!r}): expected 'wall' or 'events'")
    if warmup < 1 or repeats < 1:
        raise ValueError(f"time_calls(warmup={warmup}, repeats={repeats}): both must be >= 1")
    done = wait if wait is not None else (lambda: sync(device))
    t0 = time.perf_counter()
    first = fn()
    done()
    first_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        fn()
    done()
    if min_sample_s is not None:
        t0 = time.perf_counter()
        fn()
        done()
        one = time.perf_counter() - t0
        inner = max(1, min(200, math.ceil(min_sample_s / max(one, 1e-7))))
    if before_repeats is not None:
        before_repeats()
    use_events = clock == "events" and device is not None and torch.device(device).type == "cuda"
    times = []
    for _ in range(repeats):
        if use_events:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            done()
            times.append((time.perf_counter() - t0) / inner)
    return Timing(times, first_s, inner, first)


def event_median_ms(device: torch.device, fn: Callable[[], object], warmup: int,
                    repeats: int) -> float:
    """Median time of one ``fn()`` in ms: each call bracketed by CUDA events (wall clock off CUDA)."""
    return time_calls(fn, device, warmup=warmup, repeats=repeats, clock="events").median_ms


def back_to_back_ms(fn: Callable[[], object], device: torch.device, reps: int = 50,
                    samples: int = 5, warmup: int = 3) -> float:
    """Mean time of one ``fn()`` over ``reps`` back-to-back calls, median of ``samples``, in ms.

    On CUDA the calls are bracketed by CUDA events (device time, launches overlapped as in a
    loop); elsewhere by ``time.perf_counter``.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(samples):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(times)


def graph_replay_ms(fn: Callable[[], object], device: torch.device, reps: int = 20,
                    samples: int = 7, warmup: int = 3) -> float:
    """Mean device time of one ``fn()`` in ms with launch overhead removed, as in a graphed step.

    On CUDA, ``reps`` calls are captured into one CUDA graph; the median over ``samples`` of
    event-timed replays is divided by ``reps``. Elsewhere :func:`back_to_back_ms`.
    """
    if device.type != "cuda":
        return back_to_back_ms(fn, device, reps=reps, samples=samples, warmup=warmup)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(samples + 1):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times[1:])


def write_json(path: Path | None, result: Any) -> None:
    """Write ``result`` as indented JSON to ``path`` (creating its folder); no-op for None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or the CPU's architecture and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def set_tf32_off() -> dict[str, Any]:
    """Switch TF32 off for matmuls and cuDNN; return the switches as they now stand."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {"torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
