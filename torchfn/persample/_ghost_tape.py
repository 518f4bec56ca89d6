"""The tape behind ghost per-sample gradients: taps that log layer inputs and add probes.

A :class:`Tap` replaces a layer in :func:`make_ghost_model`'s private copy of a module. It
shares the layer's parameter/buffer/child dicts (so names and ``make_functional``'s slot
swapping are unchanged; taps nest: a tapped module's tapped children sit in the shared child
dict), forwards every other attribute read to the layer (``tap.batch_first``, methods; not
dunders), and calls the layer; while its :class:`Tape` is in ``"shape"`` mode it logs output
shapes, in ``"record"`` mode it logs the call's ``(args, kwargs)`` and adds a zero probe to
every floating output. The tape is a plain Python object (``deepcopy`` returns it), so the
writes are ordinary side effects that Dynamo replays: no hooks, no graph breaks.

Shared calls: the tape knows the batch size ``B`` of the pass. A call whose floating output
has leading dim 1 while ``B > 1`` (a layer applied to data shared by the batch, e.g. HF's
position embeddings of ``position_ids`` ``(1, T)``) gets that output expanded to ``(B, ...)``
before the probe is added, and its inputs with leading dim 1 recorded expanded to ``B``; the
layer's rule then sees per-sample data. This is exact provided the output is only broadcast
against batch-``B`` tensors downstream (as an ``(1, ...)`` tensor would be); an output that is
indexed or reduced over its dim 0 instead gets its gradient misattributed between samples,
which :func:`check_ghost_coverage` detects (it compares a randomly weighted sum).

Inputs: :func:`batch_size_of` reads ``B`` from the model inputs (a tensor, tuple or dict;
every tensor has ``B`` or 1 in dim 0) and :func:`lift_inputs` adds a differentiated zero to
their floating tensors, so both passes take the branches a differentiated forward takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import Tensor, nn

from torchfn._checks import _leaves_with_paths

__all__: list[str] = []  # private to torchfn.persample._ghost_norms


class _Slot:
    """Marks where a tensor was in a :func:`template_of`."""


_SLOT = _Slot()


def tensors_of(obj: Any, out: list[Tensor]) -> list[Tensor]:
    """Append the tensors of a nest of tuples/lists/dicts to ``out`` (depth first); return it.

    (optree's flatten is not traceable by Dynamo on these structures; this is.)
    """
    if isinstance(obj, Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            tensors_of(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensors_of(x, out)
    return out


def template_of(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a slot marker (static Python data only)."""
    if isinstance(obj, Tensor):
        return _SLOT
    if isinstance(obj, list):
        return [template_of(x) for x in obj]
    if isinstance(obj, tuple):
        items = [template_of(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, dict):
        return {k: template_of(v) for k, v in obj.items()}
    return obj


def fill_slots(obj: Any, it: Any) -> Any:
    """Inverse of :func:`template_of`: put ``next(it)`` into every slot (also into tensors)."""
    if obj is _SLOT or isinstance(obj, Tensor):
        return next(it)
    if isinstance(obj, list):
        return [fill_slots(x, it) for x in obj]
    if isinstance(obj, tuple):
        items = [fill_slots(x, it) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, dict):
        return {k: fill_slots(v, it) for k, v in obj.items()}
    return obj


class Tape:
    """Shared scratch space of one GhostModel's taps (never copied: deepcopy returns it)."""

    def __init__(self) -> None:
        self.mode: str | None = None  # None (plain forward), "shape" or "record"
        self.batch: int | None = None  # B of the pass (expands calls shared by the batch)
        self.dummy: Tensor | None = None  # shape pass: a 0-d zero added to tapped outputs
        self.shapes: dict[str, list[list[tuple[torch.Size, torch.dtype, torch.device]]]] = {}
        self.probes: dict[str, list[list[Tensor]]] = {}
        self.calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
        # record pass: (input, its autocast cast) of the taps that cast (see Tap), so that
        # layers reading one tensor (attention's query/key/value) share one cast
        self.casts: list[tuple[Tensor, Tensor]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> Tape:
        return self

    def reset(self) -> None:
        self.mode, self.shapes, self.probes, self.calls = None, {}, {}, {}
        self.batch, self.dummy, self.casts = None, None, []


def _is_float(t: Any) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


def _shared(t: Any, batch: int | None) -> bool:
    """Whether ``t`` is a floating tensor with leading dim 1 in a pass of batch ``B > 1``."""
    return batch is not None and batch > 1 and _is_float(t) and t.dim() > 0 and t.shape[0] == 1


def _expand(t: Any, batch: int) -> Any:
    if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == 1:
        return t.expand(batch, *t.shape[1:])
    return t


def _autocast_target(x: Any) -> torch.dtype | None:
    """The dtype autocast would cast ``x`` to for a linear or conv op (a float32 tensor on a
    device with autocast on), else None."""
    if not isinstance(x, Tensor) or x.dtype != torch.float32 or x.device.type not in (
            "cuda", "cpu"):
        return None
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class Tap(nn.Module):
    """Calls ``inner`` and, while the tape records, logs its inputs and adds the probes.

    With ``cast_input`` (linear and conv layers) a single float32 input is first cast to the
    autocast dtype where autocast is on (:meth:`_cast`); while recording, taps given the same
    tensor share its one cast."""

    def __init__(self, inner: nn.Module, name: str, tape: Tape, *,
                 expand_shared: bool = True, cast_input: bool = False) -> None:
        super().__init__()
        object.__setattr__(self, "_inner", inner)  # not a child: names stay the layer's own
        object.__setattr__(self, "_tap_name", name)
        object.__setattr__(self, "_tape", tape)
        # False for a layer whose outputs hold a leading dim 1 that is not the batch (a
        # recurrent layer's (num_layers, B, H) final states): never expanded as shared calls
        object.__setattr__(self, "_expand_shared", expand_shared)
        object.__setattr__(self, "_cast_input", cast_input)
        self._parameters = inner._parameters
        self._buffers = inner._buffers
        self._modules = inner._modules
        self.training = inner.training

    def train(self, mode: bool = True) -> Tap:
        super().train(mode)
        self._inner.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        # nn.Module.__getattr__ finds parameters, buffers and children (shared dicts); any
        # other attribute (settings such as ``batch_first``, methods) is the layer's own.
        # Dunders are not forwarded: copy/pickle probe them on half-built objects.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_inner")
            if inner is None or (name.startswith("__") and name.endswith("__")):
                raise
            return getattr(inner, name)

    def extra_repr(self) -> str:
        return f"tap of {type(self._inner).__name__} {self._tap_name!r}"

    def _cast(self, x: Any) -> Any:
        """``x`` cast to the autocast dtype where autocast would cast it (else ``x``); while
        recording, one cast per input tensor and dtype.

        The layer then computes with exactly the values autocast would have given it, and the
        tape records that one cast tensor for the per-sample work: a compiled step computes the
        cast (and an elementwise producer fused into it, such as an activation) once instead
        of once for the layer and again for each per-sample use."""
        tape, dtype = self._tape, _autocast_target(x)
        if dtype is None:
            return x
        if tape.mode != "record":
            return x.to(dtype)
        for src, cast in tape.casts:  # (the same autocast dtype: a region may change it)
            if src is x and cast.dtype == dtype:
                return cast
        cast = x.to(dtype)
        tape.casts.append((x, cast))
        return cast

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tape, name = self._tape, self._tap_name
        if self._cast_input and len(args) == 1 and not kwargs:
            args = (self._cast(args[0]),)
        out = self._inner(*args, **kwargs)
        if tape.mode is None:
            return out
        leaves = tensors_of(out, [])
        batch = tape.batch if self._expand_shared else None
        shared = any(_shared(t, batch) for t in leaves)
        if tape.mode == "shape":
            if name not in tape.shapes:
                tape.shapes[name] = []
            tape.shapes[name].append([
                (torch.Size((batch, *t.shape[1:])) if _shared(t, batch) else t.shape, t.dtype,
                 t.device) for t in leaves if _is_float(t)])
            dummy = tape.dummy
            if dummy is None:
                return out
            return fill_slots(out, iter([t + dummy if _is_float(t) else t for t in leaves]))
        if name not in tape.calls:
            tape.calls[name] = []
        k = len(tape.calls[name])
        if shared:
            assert batch is not None
            call = fill_slots((args, kwargs), iter([_expand(t, batch)
                                                    for t in tensors_of((args, kwargs), [])]))
            tape.calls[name].append(call)
        else:
            tape.calls[name].append((args, kwargs))
        probes = tape.probes.get(name, [])
        if k >= len(probes):
            raise RuntimeError(
                f"ghost layer {name!r} was called more often ({k + 1} times) than in the shape "
                "pass; its forward must call it the same number of times for the same input "
                "shapes"
            )
        it = iter(probes[k])
        new = []
        for t in leaves:
            if _is_float(t):
                p = next(it)
                if _shared(t, batch):
                    assert batch is not None
                    t = t.expand(batch, *t.shape[1:])
                if p.shape != t.shape:
                    raise RuntimeError(
                        f"ghost layer {name!r}: output shape {tuple(t.shape)} differs from the "
                        f"shape pass ({tuple(p.shape)}); output shapes must depend on input "
                        "shapes only"
                    )
                t = t + p
            new.append(t)
        return fill_slots(out, iter(new))


def input_signature(params: Mapping[str, Tensor], inputs: Any, training: bool) -> Any:
    leaves, spec = optree.tree_flatten(inputs)
    sig: list[Any] = [training, spec]  # spec: the structure, with dict keys (keyword names)
    for t in leaves:
        if isinstance(t, Tensor):
            sig.append((tuple(t.shape), t.dtype, t.device))
        else:
            try:
                hash(t)
            except TypeError:
                return None
            sig.append(t)
    sig.extend((t.dtype, t.device) for t in params.values())
    return tuple(sig)


def to_meta_(module: nn.Module, memo: dict[int, Tensor]) -> None:
    """Replace every parameter/buffer of ``module`` by a meta placeholder, keeping ties.

    (``module.to("meta")`` makes one new Parameter per owner, which unties shared weights;
    ``functional_call`` would then leave the second alias on its uninitialised placeholder.)
    """
    for sub in module.modules():
        for slots in (sub._parameters, sub._buffers):
            for name, t in slots.items():
                if t is None or t.is_meta:  # done already (a layer nested in another)
                    continue
                if id(t) not in memo:
                    meta = torch.empty_like(t, device="meta")
                    memo[id(t)] = (nn.Parameter(meta, requires_grad=t.requires_grad)
                                   if isinstance(t, nn.Parameter) else meta)
                slots[name] = memo[id(t)]


def batch_size_of(inputs: Any, where: str) -> int:
    """Return ``B``: every tensor of ``inputs`` has ``B`` (or 1: shared by the batch) in dim 0.

    0-d tensors and non-tensors are ignored. Raises ``ValueError`` naming the first tensor
    (path and shape) that disagrees.
    """
    leaves = [(p, t) for p, t in _leaves_with_paths(inputs, "inputs")
              if isinstance(t, Tensor) and t.dim() > 0]
    if not leaves:
        raise ValueError(f"{where}: inputs must hold at least one tensor with the batch in "
                         f"dim 0, got {type(inputs).__name__} without one")
    first, t0 = leaves[0]
    for path, t in leaves[1:]:  # the first of the largest dim 0 (no max(key=): Dynamo)
        if t.shape[0] > t0.shape[0]:
            first, t0 = path, t
    batch = t0.shape[0]
    for path, t in leaves:
        if t.shape[0] not in (batch, 1):
            raise ValueError(
                f"{where}: {path} has shape {tuple(t.shape)}, but {first} has batch size "
                f"{batch} in dim 0 (shape {tuple(t0.shape)}); every tensor of inputs must "
                "have the batch in dim 0 (or 1 for a tensor shared by the batch, which the "
                "model then broadcasts)"
            )
    return batch


def lift_inputs(inputs: Any, zero: Tensor) -> Any:
    """``inputs`` with a differentiated 0-d ``zero`` added to every floating tensor.

    Same numbers; it makes the inputs depend on what the ghost passes differentiate, so code
    that branches on ``requires_grad`` (torch's fused ``nn.TransformerEncoderLayer`` inference
    path reads its layers' weights without calling them when no input needs a gradient) takes
    the branch that calls every tapped layer.
    """
    leaves = tensors_of(inputs, [])
    if not any(t.is_floating_point() for t in leaves):
        return inputs
    lifted = [t + zero.to(t.dtype) if t.is_floating_point() else t for t in leaves]
    return fill_slots(template_of(inputs), iter(lifted))
