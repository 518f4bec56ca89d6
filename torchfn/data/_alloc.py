"""Batch buffers in shared memory inside DataLoader workers (no copy when handed over)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import get_worker_info


def alloc_bytes(nbytes: int, shared: bool) -> torch.Tensor:
    """Returns an uninitialized ``(nbytes,)`` uint8 tensor, in shared memory when ``shared``."""
    if not shared:
        return torch.empty(nbytes, dtype=torch.uint8)
    # Allocated straight in shared memory, as default_collate does, so handing the batch to the
    # main process costs no extra copy (no public API for this).
    proto = torch.empty(0, dtype=torch.uint8)
    return proto.new(proto._typed_storage()._new_shared(nbytes, device=proto.device))


def empty_batch(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Returns an uninitialized numpy array whose memory a tensor can share (``torch.from_numpy``
    of it is zero-copy), in shared memory inside a DataLoader worker."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = alloc_bytes(nbytes, get_worker_info() is not None)
    return buf.numpy().view(dtype).reshape(shape)
