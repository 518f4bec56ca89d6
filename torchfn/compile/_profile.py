"""Profile a step: wall, host and device time per step, top ops/kernels, peak memory, named
parts, a Chrome trace; and a CUDA memory snapshot.

The steps name their parts with ``record_function`` (``torchfn.forward_backward``,
``torchfn.apply_gradients``, ``torchfn.clip``, ``torchfn.optimizer``,
``torchfn.nonfinite_guard``, ``torchfn.ghost_pass``, ``torchfn.clipped_sum``,
``torchfn.noise``, ``torchfn.inner_loop``, ``torchfn.outer_grad``) only while a profiler runs
and only in eager code: a compiled step shows as its compiled regions and their kernels.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import optree
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["OpTime", "StepProfile", "memory_snapshot", "profile_step"]

T = TypeVar("T")

_STEP = "torchfn.profile_step"  # the annotation around each profiled step
_PART_PREFIX = "torchfn."
_NAME_WIDTH = 48


class OpTime(NamedTuple):
    """One op, kernel or step part: ``calls``, ``host_ms`` and ``device_ms`` per step.

    For an op or kernel the times are self times (children excluded); for a step part they
    are inclusive (host: the wall time of the region on the host; device: the kernels
    launched while it was open, from any thread, so a part's backward kernels count). ``device_ms`` is ``None`` where no device was profiled.
    """

    name: str
    calls: float
    host_ms: float
    device_ms: float | None


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """What :func:`profile_step` measured, per step (``str()`` or :meth:`table` prints it).

    Fields:
        device: ``"cpu"`` or the CUDA device the step's tensors live on (``"cuda:0"``).
        steps, warmup: the profiled and the warm-up calls.
        wall_ms: median wall time of one profiled step (synchronised; profiler overhead
            included).
        host_ms: host time in torch ops per step (self CPU time of every op: dispatch, kernel
            launches, and on the CPU the compute); ``wall_ms - host_ms`` is Python and other
            time outside ops.
        device_ms: CUDA kernel (and memcpy/memset) time per step; ``None`` on the CPU.
        peak_memory_bytes: ``torch.cuda.max_memory_allocated`` over the profiled steps;
            ``None`` on the CPU (not tracked there; the trace holds the profiler's memory
            events).
        top: the ``top_k`` ops (CPU) or kernels (CUDA) by self time, largest first.
        parts: the step's named parts (``torchfn.*`` annotations), largest host time first;
            empty for a compiled step.
        trace: the Chrome trace written (``chrome://tracing`` / Perfetto), or ``None``.
    """

    device: str
    steps: int
    warmup: int
    wall_ms: float
    host_ms: float
    device_ms: float | None
    peak_memory_bytes: int | None
    top: tuple[OpTime, ...]
    parts: tuple[OpTime, ...]
    trace: str | None

    def table(self) -> str:
        """Return the profile as a short text table."""
        dev = self.device_ms is not None
        lines = [f"profile_step on {self.device}: {self.steps} profiled steps after "
                 f"{self.warmup} warm-up, times per step"]
        summary = [f"wall {self.wall_ms:.3f} ms (median)", f"host (ops) {self.host_ms:.3f} ms",
                   (f"device (kernels) {self.device_ms:.3f} ms" if self.device_ms is not None
                    else "device: none (CPU)")]
        lines.append("  " + " | ".join(summary))
        if self.peak_memory_bytes is not None:
            lines.append(f"  peak memory {_fmt_bytes(self.peak_memory_bytes)} "
                         "(torch.cuda.max_memory_allocated)")
        else:
            lines.append("  peak memory: not tracked on the CPU")

        def rows(title: str, items: tuple[OpTime, ...]) -> None:
            head = f"  {title:<{_NAME_WIDTH}} {'calls':>7} {'host ms':>9}"
            lines.append(head + (f" {'device ms':>10}" if dev else ""))
            for op in items:
                name = op.name if len(op.name) <= _NAME_WIDTH else op.name[:_NAME_WIDTH - 3] + "..."
                row = f"  {name:<{_NAME_WIDTH}} {op.calls:>7.4g} {op.host_ms:>9.3f}"
                if dev:
                    row += f" {op.device_ms or 0.0:>10.3f}"
                lines.append(row)

        if self.parts:
            rows("step parts (inclusive; parts nest)", self.parts)
        else:
            lines.append("  step parts: none recorded (a compiled step shows as compiled regions)")
        rows("top kernels (self time)" if dev else "top ops (self time)", self.top)
        if self.trace is not None:
            lines.append(f"  Chrome trace: {self.trace}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _count(where: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}({name}=...): expected an int >= {minimum}, got {value!r}")
    return value


def _check_path(where: str, name: str, path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}({name}=...): expected a file path (str or os.PathLike), got "
                        f"{type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise TypeError(f"{where}({name}=...): expected a non-empty file path, got {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{where}({name}={path!r}): the directory {parent!r} does not "
                                "exist; create it first (os.makedirs)")
    return path


def _write_atomic(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then move it onto ``path``."""
    parent = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _cuda_device(tree: Any) -> torch.device | None:
    for leaf in optree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
            return leaf.device
    return None


def _next_state(where: str, out: Any) -> Any:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{where}(step=...): step(state, batch) returned {type(out).__name__}"
                        + (f" of length {len(out)}" if isinstance(out, tuple) else "")
                        + "; expected a pair (new_state, metrics), as every torchfn step returns")
    return out[0]


def _summarise(events: Any, steps: int, on_device: bool, top_k: int
               ) -> tuple[float, float | None, tuple[OpTime, ...], tuple[OpTime, ...]]:
    """Return ``(host_ms, device_ms, top, parts)`` per step from the profiler's raw events."""
    host_us = device_us = 0.0
    ops: dict[str, list[float]] = {}  # name -> [calls, host us, device us]
    parts: dict[str, list[float]] = {}
    spans: list[tuple[str, float, float]] = []  # part annotations: name, start, end (us)
    launches: list[tuple[float, float]] = []  # an op that launched kernels: start, kernel us
    for e in events:
        if e.is_async:
            continue
        if e.device_type == DeviceType.CPU:
            if e.kernels:
                launches.append((e.time_range.start, sum(k.duration for k in e.kernels)))
            if e.is_user_annotation:
                if e.name.startswith(_PART_PREFIX) and e.name != _STEP:
                    acc = parts.setdefault(e.name, [0.0, 0.0, 0.0])
                    acc[0] += 1
                    acc[1] += e.cpu_time_total
                    spans.append((e.name, e.time_range.start, e.time_range.end))
                continue
            host_us += e.self_cpu_time_total
            if not on_device:
                acc = ops.setdefault(e.name, [0.0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += e.self_cpu_time_total
        elif on_device and not e.is_user_annotation:  # kernels, memcpy, memset
            device_us += e.self_device_time_total
            acc = ops.setdefault(e.name, [0.0, 0.0, 0.0])
            acc[0] += 1
            acc[2] += e.self_device_time_total

    # A part's device time: the kernels launched while it was open, from any thread (the
    # backward of a CUDA step runs in autograd's device thread, outside the part's children).
    launches.sort()
    starts = [t for t, _ in launches]
    cumulative = list(itertools.accumulate((us for _, us in launches), initial=0.0))
    for name, start, end in spans:
        lo, hi = bisect.bisect_left(starts, start), bisect.bisect_right(starts, end)
        parts[name][2] += cumulative[hi] - cumulative[lo]

    def op_times(table: dict[str, list[float]], key: int) -> tuple[OpTime, ...]:
        order = sorted(table.items(), key=lambda kv: -kv[1][key])
        return tuple(OpTime(name, calls / steps, h / steps / 1e3,
                            d / steps / 1e3 if on_device else None)
                     for name, (calls, h, d) in order)

    top = op_times(ops, 2 if on_device else 1)[:top_k]
    return (host_us / steps / 1e3, device_us / steps / 1e3 if on_device else None, top,
            op_times(parts, 1))


def profile_step(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    batch: Any,
    *,
    warmup: int = 2,
    steps: int = 3,
    trace: str | os.PathLike[str] | None = None,
    top_k: int = 10,
    device: torch.device | str | None = None,
) -> StepProfile:
    """Return a :class:`StepProfile` of ``step(state, batch)``: times per step, top ops or
    kernels, peak memory, the step's named parts; optionally write a Chrome trace.

    Runs ``step`` ``warmup`` times (compiles, allocator and autotuning warm-up), then
    ``steps`` times under ``torch.profiler.profile`` (CPU activity, plus CUDA activity for a
    CUDA step; ``profile_memory=True``), synchronising after each step. The step's device is
    the first CUDA tensor's in ``(state, batch)`` (else the CPU); pass ``device`` (e.g.
    ``"cuda"``) for a step whose tensors are all held in its closure. The state returned
    by each call (``(new_state, metrics)``, as every torchfn step returns) is passed to the
    next; ``state`` itself is not modified and the last state is dropped. The batch is the
    same every call. For a step with more arguments close over them, e.g. DP-SGD:
    ``profile_step(lambda s, b: dp_step(s, b, valid), state, batch)``.

    Eager steps show their parts (``torchfn.forward_backward``, ``torchfn.clip``,
    ``torchfn.optimizer``, ``torchfn.noise``, ``torchfn.inner_loop``, ...); a
    ``torch.compile``-d step shows its compiled regions and kernels instead. ``trace`` (a
    ``.json`` path in an existing directory) receives the Chrome trace, written atomically;
    open it in ``chrome://tracing`` or https://ui.perfetto.dev.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torchfn.compile import profile_step
        >>> from torchfn.functional import init_train_state, make_train_step
        >>> from torchfn.optim import adam
        >>> step = make_train_step(lambda p, b, x: (x @ p["w"], b), F.mse_loss, adam(0.1),
        ...                        max_grad_norm=1.0)
        >>> state = init_train_state({"w": torch.zeros(3, 1)}, {}, adam(0.1), seed=0)
        >>> prof = profile_step(step, state, (torch.ones(8, 3), torch.ones(8, 1)), warmup=1)
        >>> sorted(p.name for p in prof.parts)  # doctest: +NORMALIZE_WHITESPACE
        ['torchfn.apply_gradients', 'torchfn.clip', 'torchfn.forward_backward',
         'torchfn.nonfinite_guard', 'torchfn.optimizer']
        >>> prof.wall_ms > 0, prof.device_ms, prof.peak_memory_bytes
        (True, None, None)
    """
    where = "profile_step"
    if not callable(step):
        raise TypeError(f"{where}(step=...): expected a callable step(state, batch) -> "
                        f"(new_state, metrics), got {type(step).__name__}")
    warmup = _count(where, "warmup", warmup, 0)
    steps = _count(where, "steps", steps, 1)
    top_k = _count(where, "top_k", top_k, 1)
    path = _check_path(where, "trace", trace) if trace is not None else None

    if device is None:
        device = _cuda_device((state, batch))
    else:
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"{where}(device=...): expected a torch.device or a device string "
                             f"such as 'cuda' or 'cpu', got {device!r}") from e
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.type == "cpu":
            device = None
        elif device.type != "cuda":
            raise ValueError(f"{where}(device=...): expected a CUDA or CPU device, got {device}")
    on_device = device is not None

    def sync() -> None:
        if device is not None:
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        state = _next_state(where, step(state, batch))
    sync()
    activities = [ProfilerActivity.CPU]
    if on_device:
        activities.append(ProfilerActivity.CUDA)
    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)
    walls = []
    with profile(activities=activities, profile_memory=True, acc_events=True) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            with record_function(_STEP):
                state = _next_state(where, step(state, batch))
            sync()
            walls.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) if device is not None else None
    host_ms, device_ms, top, parts = _summarise(prof.events(), steps, on_device, top_k)
    if path is not None:
        _write_atomic(path, prof.export_chrome_trace)
    return StepProfile(device=str(device) if device is not None else "cpu", steps=steps,
                       warmup=warmup, wall_ms=statistics.median(walls), host_ms=host_ms,
                       device_ms=device_ms, peak_memory_bytes=peak, top=top, parts=parts,
                       trace=path)


def memory_snapshot(path: str | os.PathLike[str], fn: Callable[..., T], *args: Any,
                    max_entries: int = 100_000, **kwargs: Any) -> T:
    """Return ``fn(*args, **kwargs)``, run while CUDA memory history is recorded, and write the
    snapshot to ``path`` (a pickle; drop it on https://pytorch.org/memory_viz).

    The snapshot holds every CUDA allocation and free during ``fn`` (up to ``max_entries``
    events) with its Python and C++ stack, and the allocator's segments at the end. Call it
    on a warmed-up step (e.g. ``memory_snapshot("step.pickle", step, state, batch)``) to see
    what holds the peak. ``path``'s directory must exist; the file is written atomically.
    Needs CUDA: on a machine without it, it raises ``RuntimeError`` (use :func:`profile_step`,
    whose trace holds the profiler's memory events, there).

    Example:
        >>> import os, tempfile
        >>> import torch
        >>> from torchfn.compile import memory_snapshot
        >>> path = os.path.join(tempfile.mkdtemp(), "snapshot.pickle")
        >>> if torch.cuda.is_available():
        ...     out = memory_snapshot(path, torch.ones, 1024, device="cuda")
        ...     assert os.path.getsize(path) > 0
        ... else:
        ...     try:
        ...         memory_snapshot(path, torch.ones, 1024)
        ...     except RuntimeError as e:
        ...         assert "needs CUDA" in str(e)
    """
    where = "memory_snapshot"
    if not callable(fn):
        raise TypeError(f"{where}(path, fn, ...): fn must be callable, got {type(fn).__name__}")
    out_path = _check_path(where, "path", path)
    max_entries = _count(where, "max_entries", max_entries, 1)
    if not torch.cuda.is_available():
        raise RuntimeError(f"{where}: recording CUDA memory history needs CUDA, and "
                           "torch.cuda.is_available() is False here; on the CPU use "
                           "torchfn.compile.profile_step(..., trace=...), whose trace holds the "
                           "profiler's memory events")
    # torch 2.13 has no public API that records the allocation history (torch.cuda
    # .memory_snapshot() returns only the current segments, which memory_viz cannot replay):
    # the private _record_memory_history / _dump_snapshot are used here and nowhere else.
    from torch.cuda import memory as cuda_memory

    cuda_memory._record_memory_history(max_entries=max_entries)
    try:
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        _write_atomic(out_path, cuda_memory._dump_snapshot)
    finally:
        cuda_memory._record_memory_history(enabled=None)
    return result
