"""A progress bar for the examples' long loops: tqdm where it is installed, else nothing.

``progress(iterable, total=..., desc=...)`` returns a tqdm bar on stderr (``pip install tqdm``,
or the ``examples`` extra) or the iterable itself; ``TORCHFN_PROGRESS=0`` turns bars off (the
example tests do, so their captured output stays short).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(iterable: Iterable[T], *, total: int | None = None,
             desc: str | None = None) -> Iterable[T] | Iterator[T]:
    """Return ``iterable`` wrapped in a tqdm progress bar if tqdm is importable and bars are on."""
    if os.environ.get("TORCHFN_PROGRESS", "1") == "0":
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
