"""A/B timing of the Parquet loaders of ``data_sources.py``: alternating epochs, medians.

``data_sources.py`` times each loader's best of a few epochs, one loader after the other; on a
shared 2-core VM its Parquet rows move by 10% or more between runs, more than most changes
tried. This script runs the loaders in turn, the order reversed every round, and reports per
loader the median epoch wall time, the median CPU time of an epoch (all processes: the main
one and its DataLoader workers, from ``getrusage``; with 2 workers on 2 cores the loaders are
CPU-bound, so it is the steadier measure) and the median time to the first batch.

Loaders (``--loaders``, comma-separated):

- ``iter``: pyarrow ``ParquetFile.iter_batches(256)``, files split over the workers (file
  order), as in ``data_sources.py``;
- ``sd`` / ``sdns``: ``StreamingDataset(ParquetSource(dir, label_column="label"))``, shuffled /
  ``shuffle=False``;
- ``sd-sync`` / ``sdns-sync``: the same without ``prefetch`` (no decode-ahead thread: each
  worker decodes, or waits for, the row group a batch needs when it reads that batch).

Data: ``--case small`` is 60000 samples of 784 float32 (1024 rows per row group), ``large``
4000 of 3x64x64 (256 per row group); 4 row groups per file, an int64 label; 2 workers, batch
256, one warm-up epoch per loader. Every epoch's sample count is checked.

Usage:

    python benchmarks/parquet_ab.py [--case small|large] [--num N] [--rounds R]
        [--loaders iter,sd,sdns,sd-sync,sdns-sync] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from data_sources import BATCH, WORKERS, _arrow_table, _ParquetBatches, _write_parquet
from torch.utils.data import DataLoader

from torchfn.data import ParquetSource, StreamingDataset

CASES = {"small": ((784,), 60000, 1024), "large": ((3, 64, 64), 4000, 256)}
LOADERS = ("iter", "sd", "sdns", "sd-sync", "sdns-sync")


def _cpu() -> float:
    """CPU seconds of this process and its waited-for children (DataLoader workers)."""
    return sum(getattr(resource.getrusage(who), f) for who in (
        resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))


def _epoch(make: Callable[[], Iterable[Any]]) -> tuple[float, float, float, int]:
    """One epoch: (wall s, CPU s, s to the first batch, samples)."""
    c0 = _cpu()
    loader = make()
    t = time.perf_counter()
    first, n = 0.0, 0
    for batch in loader:
        if not n:
            first = time.perf_counter() - t
        n += len(batch["label"] if isinstance(batch, dict) else batch[1])
    wall = time.perf_counter() - t
    del loader  # (the workers are joined: their CPU time is counted)
    return wall, _cpu() - c0, first, n


def _loaders(root: str, names: list[str]) -> dict[str, Callable[[], Iterable[Any]]]:
    files = sorted(os.path.join(root, f) for f in os.listdir(root))
    out: dict[str, Callable[[], Iterable[Any]]] = {}
    for name in names:
        if name == "iter":
            out[name] = lambda: DataLoader(_ParquetBatches(files), batch_size=None,
                                           num_workers=WORKERS)
            continue
        src = ParquetSource(root, label_column="label")
        if name.endswith("-sync"):
            src.prefetch = None  # StreamingDataset then announces nothing ahead
        shuffle = not name.startswith("sdns")
        out[name] = (lambda src=src, shuffle=shuffle: DataLoader(
            StreamingDataset(src, batch_size=BATCH, seed=0, shuffle=shuffle), batch_size=None,
            num_workers=WORKERS))
    return out


def run(case: str, num: int, rounds: int, names: list[str], root: str) -> dict[str, Any]:
    import pyarrow as pa

    shape, default_n, per_group = CASES[case]
    n = num or default_n
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *shape), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    path = os.path.join(root, case)
    _write_parquet(path, x, y, 4 * per_group, per_group)
    _arrow_table(pa, x[:2], y[:2])  # (pyarrow used in this process, as in data_sources.py)
    makes = _loaders(path, names)
    for name in names:  # warm-up epochs
        _epoch(makes[name])
    runs: dict[str, list[tuple[float, float, float, int]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            runs[name].append(_epoch(makes[name]))
    rows = []
    for name in names:
        a = np.array(runs[name])
        if not (a[:, 3] == n).all():
            raise RuntimeError(f"parquet_ab: {name} delivered {sorted(set(a[:, 3]))} samples, "
                               f"expected {n}")
        wall, cpu, first = (float(np.median(a[:, k])) for k in range(3))
        rows.append({"loader": name, "samples_per_s": n / wall, "wall_ms": 1e3 * wall,
                     "cpu_ms": 1e3 * cpu, "first_batch_ms": 1e3 * first,
                     "wall_ms_all": (1e3 * a[:, 0]).round(1).tolist()})
    return {"case": case, "num_samples": n, "rounds": rounds, "rows": rows,
            "loadavg_end": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), default="small")
    ap.add_argument("--num", type=int, default=0, help="samples (0: the case's default)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--loaders", default="iter,sd,sdns")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    names = [s for s in a.loaders.split(",") if s]
    unknown = sorted(set(names) - set(LOADERS))
    if unknown:
        ap.error(f"--loaders: unknown {unknown}; expected a subset of {list(LOADERS)}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        res = run(a.case, a.num, a.rounds, names, root)
    print(f"{res['case']}: {res['num_samples']} samples, {res['rounds']} rounds, medians "
          f"(load average at the end {res['loadavg_end']:.2f})")
    for r in res["rows"]:
        print(f"  {r['loader']:10s} {r['samples_per_s']:8.0f} samples/s  wall {r['wall_ms']:5.0f}"
              f" ms  cpu {r['cpu_ms']:5.0f} ms  first batch {r['first_batch_ms']:5.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
