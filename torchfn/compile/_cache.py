"""One directory for torch's compile caches, so a second process starts warm.

torch 2.13 caches compiled graphs on disk by default -- Inductor's FX graph cache
(``torch._inductor.config.fx_graph_cache``), the AOTAutograd cache
(``torch._functorch.config.enable_autograd_cache``), the C++/Triton kernels they build -- but
under ``/tmp/torchinductor_<user>`` (``TORCHINDUCTOR_CACHE_DIR``), which a reboot or a fresh
container wipes. :func:`enable_compile_cache` points all of them at one lasting directory.
Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` at each cache lookup, so switching works for
graphs compiled afterwards; Triton's directory (``TRITON_CACHE_DIR``) is pinned the first time
a Triton kernel is built, so call it before the first compile.

:func:`save_compile_cache` / :func:`load_compile_cache` move the same artifacts as one file
(``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``), e.g. to a fresh machine.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

__all__ = ["enable_compile_cache", "load_compile_cache", "save_compile_cache"]

ENV_VAR = "TORCHFN_COMPILE_CACHE"


def _default_dir() -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchfn" / "compile"


def _check_writable(path: Path, call: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".torchfn-write-test-"):
            pass
    except OSError as e:
        raise PermissionError(
            f"{call}: the compile cache directory {str(path)!r} is not writable ({e}); pass "
            f"a writable directory or set {ENV_VAR} to one"
        ) from e


def enable_compile_cache(path: str | os.PathLike[str] | None = None) -> Path:
    """Return the directory that now holds torch's compile caches (created if needed).

    ``path`` defaults to ``$TORCHFN_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/torchfn/compile``
    or ``~/.cache/torchfn/compile``. Sets ``TORCHINDUCTOR_CACHE_DIR`` (Inductor's FX graph
    cache, the AOTAutograd cache and the C++ kernels land under it) and ``TRITON_CACHE_DIR``
    (``<path>/triton``) in this process and in the subprocesses it starts, and switches the FX
    graph and AOTAutograd caches on (torch's default; this undoes an opt-out). Call it before
    the first compile; calling it again with the same path changes nothing. A later process
    that calls it with the same path (and the same torch, device and code) finds its graphs
    compiled: it skips Inductor and AOTAutograd and only re-traces with Dynamo.

    Raises ``PermissionError`` naming the directory when it cannot be written.

    Example:
        >>> import tempfile
        >>> from torchfn.compile import enable_compile_cache
        >>> d = enable_compile_cache(tempfile.mkdtemp())
        >>> d.is_dir(), enable_compile_cache(d) == d
        (True, True)
    """
    target = Path(path) if path is not None else _default_dir()
    target = target.expanduser().resolve()
    _check_writable(target, f"enable_compile_cache(path={str(target)!r})")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(target)
    os.environ["TRITON_CACHE_DIR"] = str(target / "triton")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return target


def save_compile_cache(file: str | os.PathLike[str]) -> Path | None:
    """Return ``file`` after writing this process's compile artifacts into it, or ``None``.

    The artifacts are the graphs and kernels compiled (or loaded) so far in this process, as
    ``torch.compiler.save_cache_artifacts()`` serialises them; ``None`` (nothing written)
    when there are none. The file is written to a temporary name and renamed, so a reader
    never sees half a file. :func:`load_compile_cache` loads it in another process.

    Example:
        >>> import os, tempfile
        >>> from torchfn.compile import save_compile_cache
        >>> out = save_compile_cache(os.path.join(tempfile.mkdtemp(), "cache.bin"))
        >>> out is None or out.is_file()
        True
    """
    target = Path(file)
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    data = saved[0]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def load_compile_cache(file: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Return the cache keys loaded from ``file``, by kind (``{"inductor": [...], ...}``).

    Loads a file written by :func:`save_compile_cache` (in any process with the same torch)
    into this process's caches, so the graphs it holds compile from cache. Call it before
    compiling. Raises ``FileNotFoundError`` when ``file`` does not exist and ``ValueError``
    when it is not such a file (torch also logs why).

    Example:
        >>> import os, tempfile
        >>> from torchfn.compile import load_compile_cache
        >>> load_compile_cache(os.path.join(tempfile.mkdtemp(), "missing.bin"))
        Traceback (most recent call last):
        ...
        FileNotFoundError: load_compile_cache(file=...): no such file ...
    """
    target = Path(file)
    if not target.is_file():
        raise FileNotFoundError(f"load_compile_cache(file=...): no such file {str(target)!r}; "
                                f"write one with save_compile_cache(file) after compiling")
    data = target.read_bytes()
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # torch raises its own unpickling errors on a foreign file
        raise ValueError(f"load_compile_cache(file={str(target)!r}): not a compile cache "
                         f"written by save_compile_cache with this torch ({e})") from e
    if info is None:  # torch logs why (e.g. a checksum mismatch) and returns None
        raise ValueError(f"load_compile_cache(file={str(target)!r}): not a compile cache "
                         f"written by save_compile_cache with this torch, or it holds no "
                         f"artifacts")
    return {kind: list(keys) for kind, keys in info.artifacts.items()}
