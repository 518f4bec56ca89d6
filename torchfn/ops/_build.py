"""Build and load torchfn's C++/CUDA op library on first use (ninja, ``cpp_extension.load``).

The library is compiled against the torch that is installed (no ABI mismatch), into a cache
folder keyed by the torch version and device (``TORCHFN_BUILD_DIR`` overrides the root):

    ~/.cache/torchfn/ops/<torch version>-<cuXXX|cpu>/torchfn_ops_<hash>/torchfn_ops_<hash>.so

``<hash>`` covers the bytes of every file under ``csrc/``, the build flags, the torch and
Python versions and the CUDA architectures, so an edited source gets a fresh folder and a
fresh build (nothing relies on file times), and a process never ``dlopen``s a stale library.
A finished build leaves a ``done`` stamp; a process that finds it loads the ``.so`` directly.
Builds are serialised across processes with an ``fcntl`` lock on ``<folder>.lock``; inside the
lock a leftover ``lock`` file of ``cpp_extension``'s own baton (left by a build that was
killed) is removed, since only the lock holder can be building.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["TorchfnOpsWarning", "build_ops", "ops_status"]

_LIB_PREFIX = "torchfn_ops"
_RECIPE_VERSION = 1  # bump when this file changes how the library is built
_EXTRA_CFLAGS = ["-O3"]
_EXTRA_CUDA_CFLAGS = ["-O3"]


class TorchfnOpsWarning(UserWarning):
    """torchfn's kernels could not be (fully) set up; the reference twins are used instead."""


@dataclasses.dataclass
class _State:
    attempted: bool = False
    loaded: bool = False
    devices: tuple[str, ...] = ()  # device types with compiled kernels, e.g. ("cpu", "cuda")
    library: str | None = None
    reason: str | None = None  # why kernels are (partly) unavailable
    cuda_reason: str | None = None  # why CUDA kernels are unavailable, if CPU ones exist
    build_seconds: float | None = None
    action: str | None = None  # "loaded" | "built" | "waited"
    log: str | None = None  # full text of the last build error
    warned: bool = False


_STATE = _State()
_LOCK = threading.RLock()
_ON_LOAD: list[Any] = []  # callables run once, right after the library is loaded


def mode() -> str:
    """Return ``TORCHFN_OPS`` lower-cased: ``auto`` (default), ``reference`` or ``kernels``."""
    value = os.environ.get("TORCHFN_OPS", "auto").strip().lower() or "auto"
    if value not in ("auto", "reference", "kernels"):
        raise ValueError(
            f"TORCHFN_OPS={value!r}: expected 'auto' (kernels where they build, else the "
            "reference twins), 'reference' (always the twins) or 'kernels' (fail if they "
            "cannot be built)"
        )
    return value


def csrc_dir() -> Path:
    """Return the folder holding the C++/CUDA sources (``TORCHFN_CSRC`` overrides it)."""
    override = os.environ.get("TORCHFN_CSRC")
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "_csrc", here.parent.parent / "csrc"):
        if (candidate / "ops.cpp").is_file():
            return candidate
    return here.parent.parent / "csrc"


def _cuda_toolkit() -> str | None:
    """Return why CUDA kernels cannot be built here, or None when they can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return None


def _cuda_archs() -> str:
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        return archs
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{a}.{b}" for a, b in sorted(caps))


def default_root() -> Path:
    """Return the cache root: ``TORCHFN_BUILD_DIR`` or ``~/.cache/torchfn/ops/<torch>-<dev>``."""
    override = os.environ.get("TORCHFN_BUILD_DIR")
    if override:
        return Path(override)
    tag = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "torchfn" / "ops" / f"{torch.__version__}-{tag}"


def _sources(with_cuda: bool) -> tuple[list[Path], list[Path]]:
    """Return (sources to compile, every file that goes into the hash)."""
    root = csrc_dir()
    if not (root / "ops.cpp").is_file():
        raise FileNotFoundError(f"torchfn C++ sources not found: {root / 'ops.cpp'} is missing")
    hashed = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _SOURCE_SUFFIXES)
    compiled = [*sorted(root.glob("*.cpp")), *sorted((root / "cpu").glob("*.cpp"))]
    if with_cuda:
        compiled += sorted((root / "cuda").glob("*.cu"))
    return compiled, hashed


_SOURCE_SUFFIXES = {".cpp", ".h", ".cu", ".cuh"}


def _library_name(with_cuda: bool, compiled: list[Path], hashed: list[Path]) -> str:
    digest = hashlib.sha256()
    root = csrc_dir()
    digest.update(f"recipe {_RECIPE_VERSION}\n".encode())
    for path in compiled:
        digest.update(f"compile {path.relative_to(root)}\n".encode())
    for path in hashed:
        digest.update(str(path.relative_to(root)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    meta = [
        torch.__version__,
        f"{sys.version_info.major}.{sys.version_info.minor}",
        " ".join(_EXTRA_CFLAGS),
        " ".join(_EXTRA_CUDA_CFLAGS) if with_cuda else "cpu-only",
        _cuda_archs() if with_cuda else "",
        os.environ.get("CXX", ""),
    ]
    digest.update("\n".join(meta).encode())
    return f"{_LIB_PREFIX}_{digest.hexdigest()[:16]}"


class _FileLock:
    """An exclusive ``fcntl.flock`` on a file; released by the OS if the process dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> _FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: cpp_extension's baton still guards
            return self
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _toolchain_problem() -> str | None:
    """Return why nothing can be compiled here (no C++ compiler, no ninja), or None."""
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler found (looked for {cxx!r} on PATH; set CXX)"
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _build_and_load(root: Path, verbose: bool) -> dict[str, Any]:
    """Build (if needed) and load the library; return path, devices, action and timings.

    ``action`` is ``"loaded"`` (a finished build was in the cache), ``"built"`` (this process
    compiled it) or ``"waited"`` (another process compiled it while this one held the lock).
    """
    cuda_reason = _cuda_toolkit()
    with_cuda = cuda_reason is None
    compiled, hashed = _sources(with_cuda)
    name = _library_name(with_cuda, compiled, hashed)
    build_dir = root / name
    so_path = build_dir / f"{name}.so"
    stamp = build_dir / "done"
    devices = ("cpu", "cuda") if with_cuda else ("cpu",)
    start = time.perf_counter()
    action = "loaded"
    if not (stamp.is_file() and so_path.is_file()):
        problem = _toolchain_problem()
        if problem is not None:
            raise RuntimeError(problem)
        with _FileLock(root / f"{name}.lock"):
            if stamp.is_file():  # another process finished while we waited for the lock
                action = "waited"
            else:
                action = "built"
                build_dir.mkdir(parents=True, exist_ok=True)
                stale_baton = build_dir / "lock"  # cpp_extension's, left by a killed build
                if stale_baton.exists():
                    stale_baton.unlink()
                from torch.utils.cpp_extension import load

                load(
                    name=name,
                    sources=[str(p) for p in compiled],
                    extra_cflags=list(_EXTRA_CFLAGS),
                    extra_cuda_cflags=list(_EXTRA_CUDA_CFLAGS),
                    extra_include_paths=[str(csrc_dir())],
                    build_directory=str(build_dir),
                    verbose=verbose,
                    with_cuda=with_cuda,
                    is_python_module=False,
                )  # loads the library into this process too
                tmp = build_dir / f"done.tmp{os.getpid()}"
                tmp.write_text(f"{torch.__version__}\n{' '.join(devices)}\n")
                tmp.replace(stamp)
    if action != "built":
        torch.ops.load_library(str(so_path))
    return {
        "library": str(so_path),
        "devices": devices,
        "cuda_reason": cuda_reason,
        "action": action,
        "seconds": time.perf_counter() - start,
    }


def ensure_loaded(verbose: bool = False) -> bool:
    """Build/load the library once per process; return True when kernels are usable.

    Returns False (and warns once with :class:`TorchfnOpsWarning`) when the build is not
    possible or fails; with ``TORCHFN_OPS=kernels`` it raises instead, and with
    ``TORCHFN_OPS=reference`` it returns False without building anything.
    """
    current = mode()
    if current == "reference":
        return False
    if _STATE.loaded:
        return True
    with _LOCK:
        if _STATE.loaded:
            return True
        if _STATE.attempted and current != "kernels":
            return False
        _STATE.attempted = True
        try:
            result = _build_and_load(default_root(), verbose)
        except Exception as exc:
            _STATE.reason = _summarise(exc)
            _STATE.log = str(exc)
            if current == "kernels":
                raise RuntimeError(
                    f"torchfn ops: TORCHFN_OPS=kernels but the kernels could not be built: "
                    f"{_STATE.reason}"
                ) from exc
            _warn_once(
                f"torchfn ops: using the pure-PyTorch reference twins because the C++ kernels "
                f"could not be built: {_STATE.reason}. Run `torchfn build-ops` for the full "
                "log; set TORCHFN_OPS=reference to silence this."
            )
            return False
        _STATE.library, _STATE.devices = result["library"], result["devices"]
        _STATE.cuda_reason, _STATE.action = result["cuda_reason"], result["action"]
        _STATE.build_seconds = result["seconds"]
        _STATE.reason = _STATE.log = None
        _STATE.loaded = True
        failures = []
        while _ON_LOAD:  # each callback runs once per process, even if the state is reset
            callback = _ON_LOAD.pop(0)
            try:
                callback()
            except Exception as exc:  # one op's registration must not disable the others
                name = f"{callback.__module__}.{callback.__qualname__}"
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
        if failures:
            warnings.warn(
                "torchfn ops: Python-side registration failed after loading the kernels (the "
                "ops concerned fail under torch.compile and opcheck): " + "; ".join(failures),
                TorchfnOpsWarning,
                stacklevel=3,
            )
        return True


def _summarise(exc: BaseException) -> str:
    """One line: the first line of the error plus its first compiler ``error:`` lines."""
    text = str(exc).strip() or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines[1:] if "error" in line.lower()][:3]
    return " | ".join([lines[0][:300], *errors])


def _warn_once(message: str) -> None:
    if not _STATE.warned:
        _STATE.warned = True
        warnings.warn(message, TorchfnOpsWarning, stacklevel=4)


def has_kernels(device_type: str) -> bool:
    """Return True when compiled kernels for ``device_type`` ("cpu", "cuda") are loaded."""
    return ensure_loaded() and device_type in _STATE.devices


def is_loaded_for(device_type: str) -> bool:
    """Return True when kernels for ``device_type`` are already loaded (never builds)."""
    return _STATE.loaded and device_type in _STATE.devices


def on_load(callback: Any) -> None:
    """Run ``callback()`` once right after the library loads (Python-side registrations)."""
    _ON_LOAD.append(callback)


def build_ops(verbose: bool = False) -> dict[str, Any]:
    """Build (or find cached) and load the kernels now; return a report dict.

    The report has ``ok`` (bool), ``library`` (path of the ``.so`` or None), ``devices``
    (device types with kernels), ``action`` ("built", "loaded" from the cache, or "waited"
    for another process's build), ``seconds`` (time spent building or loading), ``reason``
    (why not, when ``ok`` is False; ``log`` holds the full compiler output), ``cuda_reason``
    (why no CUDA kernels, if none) and ``build_root``.
    ``verbose=True`` streams the compiler's output. Unlike first use, a failure here is
    reported, never raised, and no warning is emitted.

    Example:
        >>> report = build_ops()
        >>> report["ok"], report["devices"]  # doctest: +SKIP
        (True, ('cpu',))
    """
    if mode() != "reference" and not _STATE.loaded:
        with _LOCK:
            _STATE.attempted = False
            _STATE.warned = True  # the report carries the reason; no warning from here
            with contextlib.suppress(RuntimeError):
                ensure_loaded(verbose=verbose)
    return {
        "ok": _STATE.loaded,
        "library": _STATE.library,
        "devices": _STATE.devices,
        "action": _STATE.action,
        "seconds": _STATE.build_seconds,
        "reason": _STATE.reason if not _STATE.loaded else None,
        "log": _STATE.log if not _STATE.loaded else None,
        "cuda_reason": _STATE.cuda_reason,
        "build_root": str(default_root()),
    }


def ops_status() -> dict[str, Any]:
    """Return what ``torchfn doctor`` shows about the ops, without building anything.

    Keys: ``mode`` (TORCHFN_OPS), ``built`` (library loaded in this process), ``library``,
    ``backend`` (device type -> "kernel" or "reference"), ``reason`` (why the twins are used,
    or None), ``cuda_reason``, ``toolchain`` (None if a compiler and ninja are present, else
    what is missing), ``sources`` (csrc folder) and ``build_root``.

    Example:
        >>> ops_status()["mode"]  # doctest: +SKIP
        'auto'
    """
    current = mode()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    backend = {
        d: "kernel" if (_STATE.loaded and d in _STATE.devices and current != "reference")
        else "reference"
        for d in devices
    }
    if current == "reference":
        reason: str | None = "TORCHFN_OPS=reference"
    elif not _STATE.loaded:
        reason = _STATE.reason or "not built in this process yet (builds on first use)"
    else:
        reason = None
    return {
        "mode": current,
        "built": _STATE.loaded,
        "library": _STATE.library,
        "backend": backend,
        "reason": reason,
        "cuda_reason": _STATE.cuda_reason if _STATE.loaded else _cuda_toolkit(),
        "toolchain": _toolchain_problem(),
        "sources": str(csrc_dir()),
        "build_root": str(default_root()),
    }
