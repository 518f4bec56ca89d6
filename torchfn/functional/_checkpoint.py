"""Atomic checkpoints of a :class:`TrainState` that load with ``torch.load(weights_only=True)``.

The file holds only plain containers (dicts, lists, strings, numbers, tensors): ``weights_only``
refuses pickled classes, so tuples, lists and NamedTuples (torchopt's optimizer states) are
written as tagged dicts and rebuilt on load. torchfn's state NamedTuples are recorded by their
stable public names (``torchfn.optim.StackedAdamState``), so moving a class between private
modules keeps old files loadable (older module paths are accepted through an alias table);
torchopt's are recorded as ``module:qualname`` and re-imported from ``torchopt``; for a state with other classes, pass the optimizer to
:func:`load_checkpoint`, which then uses ``optimizer.init(params)`` as the template whose types
are refilled (and checked leaf by leaf) from the file.

Writes are atomic: the checkpoint goes to a hidden temporary file in the target directory, is
flushed and fsync'ed, then renamed over the target with ``os.replace``, and the directory is
fsync'ed. A crash mid-write leaves the previous checkpoint intact; at worst a
``.<name>.<pid>@<host>.<random>.tmp`` file remains, which loading never reads. The next save of
the same target removes such leftovers of *its own* target name: those written on this host by a
process that is no longer alive, and any (from another host, or named by an older torchfn as
``.<name>.<random>.tmp``) not modified for an hour (``_STALE_AFTER_S``). A temporary file of a
save running right now (its process alive, or written to within the hour) is never touched, nor
are the temporary files of other targets in the directory.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import secrets
import socket
import sys
import time
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
# A temporary file not modified for this long is no live save's (torch.save writes as it goes).
_STALE_AFTER_S = 3600.0

# torchfn's checkpointable state types by stable name: the package that exports the class
# publicly, then its name. A checkpoint records these names, never the private module.
_STABLE_NAMES = (
    "torchfn.functional.LossScaleState",
    "torchfn.functional.TrainState",
    "torchfn.optim.StackedAdamState",
    "torchfn.optim.StackedSgdState",
    "torchfn.persample.ClippedSum",
    "torchfn.persample.DPState",
    "torchfn.persample.GradStats",
    "torchfn.persample.NoiseScaleState",
    "torchfn.persample.NormHistory",
)
# What earlier checkpoints recorded for the same classes (``module:qualname``).
_LEGACY_NAMES = {
    "torchfn.ops._stacked_optimizers:StackedAdamState": "torchfn.optim.StackedAdamState",
    "torchfn.ops._stacked_optimizers:StackedSgdState": "torchfn.optim.StackedSgdState",
    "torchfn.functional._train_step:LossScaleState": "torchfn.functional.LossScaleState",
    "torchfn.functional._train_step:TrainState": "torchfn.functional.TrainState",
    "torchfn.functional._dpsgd:ClippedSum": "torchfn.persample.ClippedSum",
    "torchfn.functional._dpsgd:DPState": "torchfn.persample.DPState",
    "torchfn.functional._ghost_stats:GradStats": "torchfn.persample.GradStats",
    "torchfn.functional._ghost_stats:NoiseScaleState": "torchfn.persample.NoiseScaleState",
    "torchfn.functional._ghost_stats:NormHistory": "torchfn.persample.NormHistory",
}
_STATE_TYPES: dict[str, type] = {}


def _state_types() -> dict[str, type]:
    """Return the registry ``{stable name: class}``, filled on first use (the packages that
    define the classes sit above this module, so they are looked up by name, not imported)."""
    if not _STATE_TYPES:
        for name in _STABLE_NAMES:
            package, _, attr = name.rpartition(".")
            _STATE_TYPES[name] = getattr(importlib.import_module(package), attr)
    return _STATE_TYPES


def _type_name(cls: type) -> str:
    """Return what a checkpoint records for the NamedTuple class ``cls``."""
    if cls.__module__.startswith("torchfn."):
        for name, known in _state_types().items():
            if known is cls:
                return name
    return f"{cls.__module__}:{cls.__qualname__}"


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
            "type": _type_name(cls),
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
    stable = _LEGACY_NAMES.get(type_name, type_name)
    if stable in _STABLE_NAMES:
        return _check_fields(_state_types()[stable], type_name, fields, where, path)
    module_name, _, qualname = type_name.partition(":")
    if not qualname or not module_name.startswith(_ALLOWED_MODULES):
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
    return _check_fields(obj, type_name, fields, where, path)


def _check_fields(obj: Any, type_name: str, fields: list[str], where: str, path: str) -> type:
    if not (isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields")):
        raise CheckpointError(f"load_checkpoint({path!r}): {where}: {type_name} is no NamedTuple")
    have = list(obj._fields)
    # a checkpoint written before trailing fields with defaults were added (DPState.clip_norm)
    # loads with those defaults
    older = have[: len(fields)] == fields and all(f in obj._field_defaults
                                                  for f in have[len(fields):])
    if have != fields and not older:
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


def _host() -> str:
    """Returns this host's name with every character outside ``[A-Za-z0-9_.-]`` as ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost"


def _pid_alive(pid: int) -> bool:
    """Returns whether process ``pid`` exists on this host (True when that cannot be told)."""
    if os.name != "posix" or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists, owned by another user
        return True
    return True


def _open_tmp(directory: str, base: str) -> tuple[int, str]:
    """Creates ``.<base>.<pid>@<host>.<8 hex>.tmp`` in ``directory`` (exclusively, mode 0600)."""
    while True:
        tmp = os.path.join(
            directory, f".{base}.{os.getpid()}@{_host()}.{secrets.token_hex(4)}.tmp"
        )
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                           0o600), tmp
        except FileExistsError:
            continue


def _remove_stale_tmps(directory: str, base: str) -> None:
    """Removes leftover temporary files of killed saves of target ``base`` (module docstring)."""
    prefix = re.escape(f".{base}.")
    ours = re.compile(prefix + r"(\d+)@([^@/]*)\.[0-9a-f]{8}\.tmp")
    legacy = re.compile(prefix + r"[a-z0-9_]{8}\.tmp")  # tempfile.mkstemp's names
    host, now = _host(), time.time()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = ours.fullmatch(name)
        if m is None and legacy.fullmatch(name) is None:
            continue
        full = os.path.join(directory, name)
        with contextlib.suppress(OSError):  # gone already (another save cleaned it), or no right
            dead = m is not None and m.group(2) == host and not _pid_alive(int(m.group(1)))
            if dead or now - os.stat(full).st_mtime > _STALE_AFTER_S:
                os.unlink(full)


def save_checkpoint(
    path: str | os.PathLike[str], state: Any, *, extra: dict[str, Any] | None = None
) -> None:
    """Write ``state`` (and ``extra``) to ``path`` atomically; returns ``None``.

    ``state``: a :class:`TrainState` (train, ensemble and meta steps) or a
    :class:`torchfn.persample.DPState` (DP-SGD steps: its noise key, step count, adaptive
    clipping threshold and optimizer state, so a resumed DP run draws the same noise);
    :func:`load_checkpoint` gives back the same type.

    ``extra`` is a dict of plain data (numbers, strings, tensors, dict/list/tuple of them), e.g. a
    data loader's ``state_dict()``; anything else raises ``TypeError`` before a byte is written.
    The file records the format version and the torch version. The target directory must exist.
    Temporary files that killed saves of the same ``path`` left behind are removed first (the
    rule is in this module's docstring). A resumed run continues exactly when the optimizer
    keeps all its state in ``state.opt_state``: torchfn's optimizers do; ``torchopt.sgd`` with
    momentum does not (a first-call flag in a closure), use :func:`torchfn.optim.sgd`.

    Example:
        >>> import os, tempfile, torch
        >>> from torchfn.optim import adam
        >>> from torchfn.functional import init_train_state, save_checkpoint, load_checkpoint
        >>> opt = adam(1e-3)
        >>> state = init_train_state({"w": torch.ones(2)}, {}, opt, seed=0)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> save_checkpoint(path, state, extra={"epoch": 3})
        >>> state2, extra = load_checkpoint(path)
        >>> extra["epoch"], torch.equal(state2.params["w"], state.params["w"])
        (3, True)
    """
    path = os.fspath(path)
    dp_state = _state_types()["torchfn.persample.DPState"]
    if not isinstance(state, TrainState | dp_state):
        raise TypeError(
            f"save_checkpoint(path, state): expected a TrainState or a DPState, got "
            f"{type(state).__name__}"
        )
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint(extra=...): expected a dict, got {type(extra).__name__}")
    torchfn_module = sys.modules.get("torchfn")
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "torch_version": str(torch.__version__),
        "torchfn_version": str(getattr(torchfn_module, "__version__", "unknown")),
        "state": {"step_state": _encode(state, "state")} if isinstance(state, dp_state) else {
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
    _remove_stale_tmps(directory, os.path.basename(path))
    fd, tmp = _open_tmp(directory, os.path.basename(path))
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
) -> tuple[Any, dict[str, Any] | None]:
    """Return ``(state, extra)`` read from a checkpoint written by :func:`save_checkpoint`.

    ``state`` is of the type saved: a :class:`TrainState` or a
    :class:`torchfn.persample.DPState`.

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
        >>> from torchfn.optim import adam
        >>> from torchfn.functional import init_train_state, save_checkpoint, load_checkpoint
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
        if "step_state" in stored:  # a DPState, stored whole
            return (_load_step_state(stored["step_state"], optimizer, trainable, path),
                    _decode(payload["extra"], "extra", path))
        params = _decode(stored["params"], "state.params", path)
        buffers = _decode(stored["buffers"], "state.buffers", path)
        opt_state = _decode_opt_state(stored["opt_state"], params, optimizer, trainable, path)
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


def _decode_opt_state(stored: Any, params: dict[str, Any],
                      optimizer: GradientTransformation | None, trainable: Any,
                      path: str) -> Any:
    """The optimizer state as saved, or with ``optimizer`` rebuilt on the template
    ``optimizer.init`` of the trained params (``trainable`` as given to the init function)."""
    if optimizer is None:
        return _decode(stored, "state.opt_state", path)
    names = StepOptions(trainable=trainable, where="load_checkpoint").trainable_names(params)
    template = optimizer.init({k: params[k] for k in names})
    return _decode_like(stored, template, "state.opt_state", path)


def _load_step_state(stored: Any, optimizer: GradientTransformation | None, trainable: Any,
                     path: str) -> Any:
    """Rebuild a state NamedTuple saved whole (a DPState), its ``opt_state`` by
    :func:`_decode_opt_state` (called inside :func:`load_checkpoint`'s error translation)."""
    fields = stored["fields"]
    cls = _import_namedtuple(stored["type"], list(fields), "state", path)
    values = {f: _decode(v, f"state.{f}", path) for f, v in fields.items() if f != "opt_state"}
    opt_state = _decode_opt_state(fields["opt_state"], values["params"], optimizer, trainable,
                                  path)
    return cls(**values, opt_state=opt_state)
