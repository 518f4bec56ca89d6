"""Process-group set-up from ``torchrun``'s environment, and the checks every step shares."""

from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["DistInfo", "init_from_env", "world_info"]

_NOT_INIT = (
    "{where}: torch.distributed is not initialised. Launch with `torchrun --nproc_per_node N "
    "script.py` and call torchfn.distributed.init_from_env() (or "
    "torch.distributed.init_process_group(...)) before building the step"
)


class DistInfo(NamedTuple):
    """Where this process sits: ``rank``, ``world_size``, ``local_rank``, ``device``, ``backend``."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _check_init(where: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(_NOT_INIT.format(where=where))


def world_info(group: ProcessGroup | None = None, where: str = "world_info()") -> tuple[int, int]:
    """Return ``(rank, world_size)`` of this process in ``group`` (default: the whole world).

    Raises ``RuntimeError`` naming ``where`` when no process group is initialised.

    Example::

        rank, world = world_info()  # inside a torchrun-launched script
    """
    _check_init(where)
    return dist.get_rank(group), dist.get_world_size(group)


def init_from_env(backend: str | None = None, *,
                  timeout: datetime.timedelta | None = None) -> DistInfo:
    """Return :class:`DistInfo` after initialising the default process group from the env.

    Reads ``torchrun``'s variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``). ``backend`` defaults to ``"nccl"`` when CUDA is
    available (each process then uses ``cuda:LOCAL_RANK``, set as the current device) and to
    ``"gloo"`` on the CPU. Run without ``torchrun`` (no ``WORLD_SIZE``) it starts a world of
    one process (a free local port), so the same script runs as ``python script.py``. Calling
    it again when a group already exists returns the existing layout. Nothing here touches
    NCCL's settings (``NCCL_*`` variables are left as the environment has them).

    Example::

        info = init_from_env()          # torchrun --nproc_per_node 2 train.py
        info.rank, info.world_size, info.device
        # (0, 2, device(type='cuda', index=0))
    """
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"init_from_env(backend=...): expected None, 'nccl' or 'gloo', got "
                         f"{backend!r}")
    if backend == "nccl" and not cuda:
        raise RuntimeError("init_from_env(backend='nccl'): CUDA is not available in this "
                           "process; use backend='gloo' on the CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:  # plain `python script.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kwargs = {"timeout": timeout} if timeout is not None else {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(backend, **kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device,
                    dist.get_backend())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
