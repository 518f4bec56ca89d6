"""Device prefetch: host batches staged in reused pinned buffers and copied to the GPU ahead of
use, from a background thread, on a side stream."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

__all__ = ["DevicePrefetcher", "prefetch_to_device"]

_MIN_BUCKET = 512


def _map_tensors(fn: Any, x: Any) -> Any:
    """``x`` with ``fn`` applied to every tensor inside dicts, lists, tuples and namedtuples."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, Mapping):  # a dict (or OrderedDict) keeps its type, other mappings
        out = {k: _map_tensors(fn, v) for k, v in x.items()}  # come back as dicts
        return type(x)(out) if type(x) in (dict, OrderedDict) else out
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_map_tensors(fn, v) for v in x))
    if isinstance(x, list | tuple):
        return type(x)(_map_tensors(fn, v) for v in x)
    return x


def _bucket(nbytes: int) -> int:
    """The staging buffer size for ``nbytes``: the next power of two (at least 512), so a
    stream of varying batch sizes reuses a few buffers instead of one per size."""
    return max(_MIN_BUCKET, 1 << (nbytes - 1).bit_length())


class _StagingPool:
    """Reusable host staging buffers (``(bucket,)`` uint8, from ``alloc``: pinned on CUDA).

    ``take`` hands out a free buffer of the size's bucket (or allocates one);
    ``give_back(buffers, event, keep)`` returns buffers that a copy still reads: they become
    free once ``event.query()`` is True (the copies ran; events of one stream complete in
    order, so only the oldest is polled), and ``keep`` (the source batch) is released then.
    Thread-safe.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor]) -> None:
        self._alloc = alloc
        self._free: dict[int, list[torch.Tensor]] = {}
        self._busy: deque[tuple[Any, list[torch.Tensor], Any]] = deque()
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated so far (the rest of the takes were reuses)

    def _reclaim(self) -> None:
        while self._busy and self._busy[0][0].query():
            _, bufs, _keep = self._busy.popleft()
            for b in bufs:
                self._free.setdefault(b.numel(), []).append(b)

    def take(self, nbytes: int) -> torch.Tensor:
        size = _bucket(nbytes)
        with self._lock:
            self._reclaim()
            free = self._free.get(size)
            if free:
                return free.pop()
            self.allocated += 1
        return self._alloc(size)

    def give_back(self, bufs: list[torch.Tensor], event: Any, keep: Any = None) -> None:
        with self._lock:
            self._reclaim()  # also when nothing is taken (every batch already pinned)
            self._busy.append((event, bufs, keep))

    def free_count(self) -> int:
        """Returns the number of buffers free now (after polling the pending copies)."""
        with self._lock:
            self._reclaim()
            return sum(len(v) for v in self._free.values())


def _stage(host: Any, pool: _StagingPool, used: list[torch.Tensor]) -> Any:
    """``host`` with every unpinned CPU tensor copied into a pool buffer (appended to
    ``used``); pinned, empty and non-CPU tensors pass through."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or t.numel() == 0 or t.is_pinned():
            return t
        nbytes = t.numel() * t.element_size()
        buf = pool.take(nbytes)
        used.append(buf)
        return buf[:nbytes].view(t.dtype).view(t.shape).copy_(t)

    return _map_tensors(one, host)


class _InFlight(NamedTuple):
    batch: Any  # on the device (copies may still be running on the side stream)
    event: Any  # torch.cuda.Event recorded after the copies, or None


class _Pending(NamedTuple):
    copy: Future | _InFlight  # the copy (a Future of one when it runs in the thread)
    state: dict[str, Any] | None  # the loader's state right after this batch


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class DevicePrefetcher:
    """Returns an iterable over ``loader``'s batches moved to ``device``, ``depth`` batches ahead.

    Each batch (a tensor or nested dicts / lists / tuples of tensors; other values pass through)
    is copied as soon as the previous ones are handed out, so the copy of batch ``i + depth``
    overlaps the work on batch ``i``. On CUDA the copies run in a background thread: host
    tensors are copied into reused pinned staging buffers (skipped for tensors already pinned,
    e.g. by ``DataLoader(pin_memory=True)``; a buffer is reused once the copy that read it has
    finished) and copied with ``non_blocking=True`` on a side stream, so the training loop's
    thread only takes batches from ``loader``. Before a batch is handed out the current stream
    waits for that batch's copies (an event recorded after them: the step does not wait for
    later batches' copies) and every device tensor is ``record_stream``-ed on the current
    stream, so its memory is not reused while work queued there still reads it. On other
    devices (the CPU) the batches are ``.to(device)`` in the calling thread: for the CPU the
    same tensors, no copy.

    Resume: the batches in flight were taken from ``loader`` but not yet handed out, so the
    loader's own ``state_dict()`` runs ``depth`` batches ahead. ``state_dict()`` here returns
    the loader's state as it was right after the last batch handed out (the loader's
    ``state_dict()`` is taken after each fetch), so resuming from it repeats none and loses
    none; ``load_state_dict`` passes the state to the loader. Needs a loader with
    ``state_dict`` / ``load_state_dict`` (``StreamingLoader``, torchdata's
    ``StatefulDataLoader``) for those two; iteration works with any iterable.

    Example:
        >>> loader = [{"x": torch.ones(2), "meta": ("a", torch.zeros(1))}] * 3
        >>> [b["x"].sum().item() for b in DevicePrefetcher(loader, "cpu")]
        [2.0, 2.0, 2.0]
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str, *, depth: int = 2,
                 pin_memory: bool | None = None) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"DevicePrefetcher(depth={depth!r}): expected an int >= 1 (the "
                             "number of batches copied ahead)")
        self.loader = loader
        self.device = torch.device(device)
        self.depth = depth
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"DevicePrefetcher(device={str(device)!r}): CUDA is not "
                               "available here; pass device='cpu' or run on a CUDA machine")
        if cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin_memory = cuda if pin_memory is None else bool(pin_memory and cuda)
        self._cuda = cuda
        self._background = cuda  # copies in a worker thread (tests turn it on for the CPU)
        self._stream: Any = None
        self._pool = _StagingPool(_pinned_bytes)
        self._state: dict[str, Any] | None = None

    def _snapshot(self) -> dict[str, Any] | None:
        sd = getattr(self.loader, "state_dict", None)
        return sd() if callable(sd) else None

    def _copy(self, host: Any) -> _InFlight:
        if not self._cuda:
            return _InFlight(_map_tensors(lambda t: t.to(self.device), host), None)
        used: list[torch.Tensor] = []
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            staged = _stage(host, self._pool, used) if self.pin_memory else host
            batch = _map_tensors(lambda t: t.to(self.device, non_blocking=True), staged)
            event = torch.cuda.Event()
            event.record(self._stream)
        # the staging buffers (and the host batch: pinned memory a copy may still read) are
        # kept until the copies ran
        self._pool.give_back(used, event, host)
        return _InFlight(batch, event)

    def _hand_out(self, item: _InFlight) -> Any:
        if item.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(item.event)

            def mark(t: torch.Tensor) -> torch.Tensor:
                if t.device.type == "cuda":
                    t.record_stream(current)
                return t

            _map_tensors(mark, item.batch)
        return item.batch

    def __iter__(self) -> Iterator[Any]:
        if self._cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._state = self._snapshot()  # before the first batch: the loader's pending state
        it = iter(self.loader)
        queue: deque[_Pending] = deque()
        done = False
        with contextlib.ExitStack() as stack:
            copier = None
            if self._background:
                copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchfn-prefetch")
                stack.callback(copier.shutdown, wait=True, cancel_futures=True)

            def fetch() -> None:
                nonlocal done
                try:
                    host = next(it)
                except StopIteration:
                    done = True
                    if queue:  # the state after the last batch is the loader's at its end
                        queue[-1] = queue[-1]._replace(state=self._snapshot())
                    else:
                        self._state = self._snapshot()
                    return
                copy = (copier.submit(self._copy, host) if copier is not None
                        else self._copy(host))
                queue.append(_Pending(copy, self._snapshot()))

            while not done and len(queue) < self.depth:
                fetch()
            while queue:
                item = queue.popleft()
                copied = item.copy.result() if isinstance(item.copy, Future) else item.copy
                batch = self._hand_out(copied)
                self._state = item.state
                if not done:
                    fetch()  # the next copy starts before this batch's step runs
                yield batch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Calls the loader's ``set_epoch``; returns nothing."""
        self.loader.set_epoch(epoch)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """Returns the loader's state right after the last batch handed out (see the class)."""
        if not callable(getattr(self.loader, "state_dict", None)):
            raise TypeError(
                f"DevicePrefetcher.state_dict: the loader ({type(self.loader).__name__}) has no "
                "state_dict(); use a resumable loader (StreamingLoader, StatefulDataLoader)"
            )
        return dict(self._state) if self._state is not None else self._snapshot()  # type: ignore[arg-type]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Passes ``state`` (from ``state_dict``) to the loader; returns nothing."""
        if not callable(getattr(self.loader, "load_state_dict", None)):
            raise TypeError(
                f"DevicePrefetcher.load_state_dict: the loader ({type(self.loader).__name__}) "
                "has no load_state_dict(); use a resumable loader (StreamingLoader, "
                "StatefulDataLoader)"
            )
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]
        self._state = None


def prefetch_to_device(loader: Iterable[Any], device: torch.device | str, depth: int = 2,
                       *, pin_memory: bool | None = None) -> DevicePrefetcher:
    """Returns ``DevicePrefetcher(loader, device, depth=depth)``: ``loader``'s batches on
    ``device``, copied ``depth`` batches ahead (pinned, non-blocking, on a side CUDA stream).

    Example:
        >>> batches = [(torch.arange(3), torch.tensor(1))] * 2
        >>> [x.tolist() for x, _ in prefetch_to_device(batches, "cpu", depth=1)]
        [[0, 1, 2], [0, 1, 2]]
    """
    return DevicePrefetcher(loader, device, depth=depth, pin_memory=pin_memory)
