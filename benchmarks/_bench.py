"""Helpers shared by the benchmark scripts: a back-to-back kernel timer, writing results."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


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


def write_json(path: Path | None, result: Any) -> None:
    """Write ``result`` as indented JSON to ``path`` (creating its folder); no-op for None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
