"""Atomic checkpoints of a :class:`TrainState` that load with ``torch.load(weights_only=True)``.

The file holds only plain containers (dicts, lists, strings, numbers, tensors): ``weights_only``
refuses pickled classes, so tuples, lists and NamedTuples (torchopt's optimizer states) are
written as tagged dicts and rebuilt on load. A NamedTuple class is re-imported by name only from
``torchopt`` and ``torchfn``; for a state with other classes, pass the optimizer to
:func:`load_checkpoint`, which then uses ``optimizer.init(params)`` as the template whose types
are refilled (and checked leaf by leaf) from the file.

Writes are atomic: the checkpoint goes to a hidden temporary file in the target directory, is
flushed and fsync'ed, then renamed over the target with ``os.replace``, and the directory is
fsync'ed. A crash mid-write leaves the previous checkpoint intact; at worst a
``.<name>.*.tmp`` file remains, which loading never reads.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from typing import Any

import torch
from torchopt.base import GradientTransformation

from torchfn.functional._core import StepOptions
from torchfn.functional._train_step import LossScaleState, TrainState

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

FORMAT = "torchfn.checkpoint"
FORMAT_VERSION = 1
_KIND = "__torchfn_kind__"
_ALLOWED_MODULES = ("torchopt.", "torchfn.")


class CheckpointError(RuntimeError):
    """A checkpoint file is unreadable, corrupt, or of an unknown format."""


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _encode(obj: Any, where: str) -> Any:
    """Return ``obj`` as plain containers that ``torch.load(weights_only=True)`` accepts."""
    if obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor)):
        return obj
    if _is_namedtuple(obj):
        cls = type(obj)
        return {
            _KIND: "namedtuple",
            "type": f"{cls.__module__}:{cls.__qualname__}",
            "fields": {f: _encode(getattr(obj, f), f"{where}.{f}") for f in cls._fields},
        }
    if isinstance(obj, (tuple, list)):
        items = [_encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return {_KIND: "tuple" if isinstance(obj, tuple) else "list", "items": items}
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(
                    f"save_checkpoint: {where} has a key {key!r} of type {type(key).__name__}; "
                    "only str and int keys can be stored"
                )
        return {
            _KIND: "dict",
            "keys": list(obj),
            "values": [_encode(v, f"{where}[{k!r}]") for k, v in obj.items()],
        }
    raise TypeError(
        f"save_checkpoint: cannot store {where} of type {type(obj).__name__}; a checkpoint holds "
        "tensors, None, bool, int, float, str and dict/list/tuple/NamedTuple of them"
    )


def _import_namedtuple(type_name: str, fields: list[str], where: str, path: str) -> type:
    module_name, _, qualname = type_name.partition(":")
    if not module_name.startswith(_ALLOWED_MODULES):
        raise CheckpointError(
            f"load_checkpoint({path!r}): {where} is a {type_name}, which is not imported from a "
            "checkpoint (only torchopt/torchfn classes are); pass optimizer=... to rebuild the "
            "optimizer state from optimizer.init(params)"
        )
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise CheckpointError(
            f"load_checkpoint({path!r}): {where} is a {type_name}, which no longer exists ({e}); "
            "pass optimizer=... to rebuild the optimizer state from optimizer.init(params)"
        ) from e
    if not (isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields")):
        raise CheckpointError(f"load_checkpoint({path!r}): {where}: {type_name} is no NamedTuple")
    if list(obj._fields) != fields:
        raise CheckpointError(
            f"load_checkpoint({path!r}): {where}: {type_name} now has fields "
            f"{list(obj._fields)}, the checkpoint has {fields}"
        )
    return obj


def _decode(obj: Any, where: str, path: str) -> Any:
    """Rebuild what :func:`_encode` wrote, importing NamedTuple classes from torchopt/torchfn."""
    if not (isinstance(obj, dict) and _KIND in obj):
        return obj
    kind = obj[_KIND]
    if kind == "namedtuple":
        names = list(obj["fields"])
        cls = _import_namedtuple(obj["type"], names, where, path)
        return cls(**{f: _decode(v, f"{where}.{f}", path) for f, v in obj["fields"].items()})
    if kind in ("tuple", "list"):
        items = [_decode(v, f"{where}[{i}]", path) for i, v in enumerate(obj["items"])]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {
            k: _decode(v, f"{where}[{k!r}]", path)
            for k, v in zip(obj["keys"], obj["values"], strict=True)
        }
    raise CheckpointError(f"load_checkpoint({path!r}): {where} has an unknown kind {kind!r}")


def _decode_like(obj: Any, template: Any, where: str, path: str) -> Any:
    """Rebuild ``obj`` with the container types of ``template``, checking that they match."""

    def mismatch(what: str) -> CheckpointError:
        return CheckpointError(
            f"load_checkpoint({path!r}, optimizer=...): {where}: the checkpoint has {what}, "
            "which does not match optimizer.init(params); was it saved with another optimizer?"
        )

    kind = obj.get(_KIND) if isinstance(obj, dict) else None
    if _is_namedtuple(template):
        fields = list(type(template)._fields)
        if kind != "namedtuple" or list(obj["fields"]) != fields:
            raise mismatch(f"{kind or type(obj).__name__} (expected fields {fields})")
        return type(template)(
            *(
                _decode_like(obj["fields"][f], getattr(template, f), f"{where}.{f}", path)
                for f in fields
            )
        )
    if isinstance(template, (tuple, list)):
        expected = "tuple" if isinstance(template, tuple) else "list"
        if kind != expected or len(obj["items"]) != len(template):
            n = len(obj["items"]) if kind in ("tuple", "list") else "?"
            raise mismatch(f"a {kind or type(obj).__name__} of length {n}")
        items = [
            _decode_like(v, t, f"{where}[{i}]", path)
            for i, (v, t) in enumerate(zip(obj["items"], template, strict=True))
        ]
        return type(template)(items)
    if isinstance(template, dict):
        if kind != "dict" or set(obj["keys"]) != set(template):
            raise mismatch(f"keys {obj['keys'] if kind == 'dict' else '?'}")
        stored = dict(zip(obj["keys"], obj["values"], strict=True))
        return {k: _decode_like(stored[k], t, f"{where}[{k!r}]", path) for k, t in template.items()}
    if isinstance(template, torch.Tensor):
        if not isinstance(obj, torch.Tensor):
            raise mismatch(type(obj).__name__)
        if obj.shape != template.shape or obj.dtype != template.dtype:
            raise mismatch(f"a {obj.dtype} tensor of shape {tuple(obj.shape)}")
        return obj
    return _decode(obj, where, path)


def _fsync_dir(directory: str) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    path: str | os.PathLike[str], state: TrainState, *, extra: dict[str, Any] | None = None
) -> None:
    """Write ``state`` (and ``extra``) to ``path`` atomically; returns ``None``.

    ``extra`` is a dict of plain data (numbers, strings, tensors, dict/list/tuple of them), e.g. a
    data loader's ``state_dict()``; anything else raises ``TypeError`` before a byte is written.
    The file records the format version and the torch version. The target directory must exist.

    Example:
        >>> import os, tempfile, torch
        >>> from torchfn.functional import adam, init_train_state, save_checkpoint, load_checkpoint
        >>> opt = adam(1e-3)
        >>> state = init_train_state({"w": torch.ones(2)}, {}, opt, seed=0)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> save_checkpoint(path, state, extra={"epoch": 3})
        >>> state2, extra = load_checkpoint(path)
        >>> extra["epoch"], torch.equal(state2.params["w"], state.params["w"])
        (3, True)
    """
    path = os.fspath(path)
    if not isinstance(state, TrainState):
        raise TypeError(
            f"save_checkpoint(path, state): expected a TrainState, got {type(state).__name__}"
        )
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint(extra=...): expected a dict, got {type(extra).__name__}")
    torchfn_module = sys.modules.get("torchfn")
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "torch_version": str(torch.__version__),
        "torchfn_version": str(getattr(torchfn_module, "__version__", "unknown")),
        "state": {
            "params": _encode(dict(state.params), "state.params"),
            "buffers": _encode(dict(state.buffers), "state.buffers"),
            "opt_state": _encode(state.opt_state, "state.opt_state"),
            "step": state.step,
            "seed": state.seed,
            "loss_scale": {
                "scale": state.loss_scale.scale,
                "growth_tracker": state.loss_scale.growth_tracker,
            },
            **({} if state.skipped is None else {"skipped": state.skipped}),
        },
        "extra": _encode(extra, "extra"),
    }
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"save_checkpoint({path!r}): directory {directory!r} does not exist"
        )
    fd, tmp = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    map_location: Any = None,
    optimizer: GradientTransformation | None = None,
    trainable: Any = None,
) -> tuple[TrainState, dict[str, Any] | None]:
    """Return ``(state, extra)`` read from a checkpoint written by :func:`save_checkpoint`.

    Loads with ``torch.load(weights_only=True)`` and ``map_location``, then rebuilds the
    :class:`TrainState` and the torchopt state NamedTuples. With ``optimizer`` given, the
    optimizer state is rebuilt on the template ``optimizer.init(params)`` and every leaf's
    shape/dtype is checked against it (needed when the state holds classes from outside
    torchopt/torchfn); ``trainable`` (as given to :func:`init_train_state`) restricts that
    template to the trained params. ``step`` and ``seed`` always come back on the CPU. ``extra`` is what was
    saved (``None`` if nothing was). Raises ``FileNotFoundError`` for a missing file and
    :class:`CheckpointError` for a corrupt one or one of another format, naming the path.

    Example:
        >>> import os, tempfile, torch
        >>> from torchfn.functional import adam, init_train_state, save_checkpoint, load_checkpoint
        >>> opt = adam(1e-3)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> save_checkpoint(path, init_train_state({"w": torch.ones(2)}, {}, opt, seed=7))
        >>> state, extra = load_checkpoint(path, optimizer=opt)
        >>> int(state.seed), extra is None
        (7, True)
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at {path!r}")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"load_checkpoint({path!r}): the file is corrupt or not a torch checkpoint "
            f"({type(e).__name__}: {e})"
        ) from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"load_checkpoint({path!r}): not a torchfn checkpoint (no format={FORMAT!r} record)"
        )
    version = payload.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"load_checkpoint({path!r}): checkpoint format version {version!r} (written by torch "
            f"{payload.get('torch_version')}); this torchfn reads version {FORMAT_VERSION}"
        )
    try:
        stored = payload["state"]
        params = _decode(stored["params"], "state.params", path)
        buffers = _decode(stored["buffers"], "state.buffers", path)
        if optimizer is not None:
            names = StepOptions(trainable=trainable, where="load_checkpoint").trainable_names(
                params)
            template = optimizer.init({k: params[k] for k in names})
            opt_state = _decode_like(stored["opt_state"], template, "state.opt_state", path)
        else:
            opt_state = _decode(stored["opt_state"], "state.opt_state", path)
        state = TrainState(
            params=params,
            buffers=buffers,
            opt_state=opt_state,
            step=stored["step"].cpu(),
            seed=stored["seed"].cpu(),
            loss_scale=LossScaleState(
                scale=stored["loss_scale"]["scale"],
                growth_tracker=stored["loss_scale"]["growth_tracker"],
            ),
            # checkpoints written before the skipped counter existed start it at 0
            skipped=stored.get("skipped", torch.zeros_like(stored["loss_scale"]["growth_tracker"])),
        )
        extra = _decode(payload["extra"], "extra", path)
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"load_checkpoint({path!r}): the checkpoint is missing or has malformed entries "
            f"({type(e).__name__}: {e})"
        ) from e
    return state, extra
