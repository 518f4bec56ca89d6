"""Device prefetch: host batches pinned and copied to the GPU ahead of use, on a side stream."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["DevicePrefetcher", "prefetch_to_device"]


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


class _InFlight(NamedTuple):
    batch: Any  # on the device (copies may still be running on the side stream)
    host: Any  # the pinned host batch, kept alive until the batch is handed out
    event: Any  # torch.cuda.Event recorded after the copies, or None
    state: dict[str, Any] | None  # the loader's state right after this batch


class DevicePrefetcher:
    """Returns an iterable over ``loader``'s batches moved to ``device``, ``depth`` batches ahead.

    Each batch (a tensor or nested dicts / lists / tuples of tensors; other values pass through)
    is copied as soon as the previous ones are handed out, so the copy of batch ``i + depth``
    overlaps the work on batch ``i``. On CUDA: host tensors are pinned (``pin_memory()``,
    skipped for tensors already pinned, e.g. by ``DataLoader(pin_memory=True)``) and copied
    with ``non_blocking=True`` on a side stream; before a batch is handed out the current
    stream waits for that batch's copies (an event recorded after them: the step does not wait
    for later batches' copies) and every device tensor is ``record_stream``-ed on the current
    stream, so its memory is not reused while work queued there still reads it. On other
    devices (the CPU) the batches are ``.to(device)``: for the CPU the same tensors, no copy.

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
        self.pin_memory = cuda if pin_memory is None else bool(pin_memory and cuda)
        self._cuda = cuda
        self._stream: Any = None
        self._state: dict[str, Any] | None = None

    def _snapshot(self) -> dict[str, Any] | None:
        sd = getattr(self.loader, "state_dict", None)
        return sd() if callable(sd) else None

    def _copy(self, host: Any) -> _InFlight:
        if not self._cuda:
            return _InFlight(_map_tensors(lambda t: t.to(self.device), host), None, None, None)
        pinned = _map_tensors(
            lambda t: t.pin_memory() if self.pin_memory and t.device.type == "cpu"
            and not t.is_pinned() else t, host)
        with torch.cuda.stream(self._stream):
            batch = _map_tensors(lambda t: t.to(self.device, non_blocking=True), pinned)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _InFlight(batch, pinned, event, None)

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
        queue: deque[_InFlight] = deque()
        done = False

        def fetch() -> None:
            nonlocal done
            try:
                host = next(it)
            except StopIteration:
                done = True
                if queue:  # the state after the last batch is the loader's state at its end
                    queue[-1] = queue[-1]._replace(state=self._snapshot())
                else:
                    self._state = self._snapshot()
                return
            queue.append(self._copy(host)._replace(state=self._snapshot()))

        while not done and len(queue) < self.depth:
            fetch()
        while queue:
            item = queue.popleft()
            batch = self._hand_out(item)
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
