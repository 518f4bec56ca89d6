"""Samples/s of StreamingDataset (shards on local disk) vs in-memory TensorDataset vs webdataset.

Same data for all three loaders, 2 DataLoader workers, batch 256, one full shuffled epoch
(after one warm-up epoch, so the page cache is warm for the disk-based loaders: this measures
the loader, not the disk). StreamingDataset is measured with its default per-sample checksum
(xxh3_64), on shards written with ``checksum="crc32"`` (the older format's checksum), and with
``verify=False``. The load average is printed per case (the numbers mean little above ~1.5 on
a 2-core machine). Usage:

    .venv/bin/python benchmarks/data.py [--small N] [--large N] [--repeats R] [--out results.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import tarfile
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchfn.data import ShardWriter, StreamingDataset

BATCH, WORKERS = 256, 2


class _MmapPath(StreamingDataset):
    """The previous read path (memory map + per-sample checksum + index_select), for comparison."""

    def _read_batch(self, ids):
        return None


def _epoch(loader) -> tuple[float, int]:
    t = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch[1]) if isinstance(batch, list | tuple) else len(batch["label"])
    return time.perf_counter() - t, n


def _best(loader_fn, repeats: int) -> tuple[float, int]:
    _epoch(loader_fn())  # warm-up: page cache, worker start-up code paths
    runs = [_epoch(loader_fn()) for _ in range(repeats)]
    return min(r[0] for r in runs), runs[0][1]


def _write_tars(root: str, x: np.ndarray, y: np.ndarray, per_shard: int) -> list[str]:
    urls = []
    for s in range(0, len(x), per_shard):
        path = os.path.join(root, f"wds-{s // per_shard:05d}.tar")
        with tarfile.open(path, "w") as tar:
            for i in range(s, min(s + per_shard, len(x))):
                for ext, payload in (("x.npy", x[i]), ("cls", None)):
                    buf = io.BytesIO()
                    if payload is None:
                        buf.write(str(int(y[i])).encode())
                    else:
                        np.save(buf, payload)
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = buf.tell()
                    buf.seek(0)
                    tar.addfile(info, buf)
        urls.append(path)
    return urls


def run(name: str, shape: tuple[int, ...], n: int, repeats: int, per_shard: int) -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *shape), dtype=np.float32)
    y = rng.integers(0, 10, n)
    res: dict = {"case": name, "shape": list(shape), "num_samples": n,
                 "loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        for checksum in ("xxh3_64", "crc32"):
            t = time.perf_counter()
            with ShardWriter(os.path.join(root, checksum), samples_per_shard=per_shard,
                             checksum=checksum) as w:
                for i in range(n):
                    w.write({"x": x[i]}, label=int(y[i]))
            res[f"write_s_{checksum}"] = time.perf_counter() - t

        tds = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        gen = torch.Generator().manual_seed(0)

        def mem():
            return DataLoader(tds, batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                              generator=gen)

        def stream(verify: bool, checksum: str = "xxh3_64",
                   cls: type[StreamingDataset] = StreamingDataset):
            def make():
                ds = cls(os.path.join(root, checksum), batch_size=BATCH, seed=0, verify=verify)
                return DataLoader(ds, batch_size=None, num_workers=WORKERS)
            return make

        loaders = {"tensordataset_in_memory": mem,
                   "streaming_verify_xxh3": stream(True),
                   "streaming_verify_crc32": stream(True, "crc32"),
                   "streaming_no_verify": stream(False),
                   "streaming_mmap_path_xxh3": stream(True, cls=_MmapPath),
                   "streaming_mmap_path_no_verify": stream(False, cls=_MmapPath)}
        try:
            import webdataset as wds

            urls = _write_tars(root, x, y, per_shard)

            def web():
                ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
                      .shuffle(1000).decode().to_tuple("x.npy", "cls").batched(BATCH))
                return wds.WebLoader(ds, batch_size=None, num_workers=WORKERS)

            loaders["webdataset"] = web
        except ImportError:
            res["webdataset"] = "not installed"
        for key, fn in loaders.items():
            dt, count = _best(fn, repeats)
            res[key] = {"seconds": dt, "samples": count, "samples_per_s": count / dt}
            print(f"{name:6s} {key:30s} {count / dt:12.0f} samples/s  ({count} in {dt:.3f}s)",
                  flush=True)
    base = res["tensordataset_in_memory"]["samples_per_s"]
    for key in loaders:
        res[key]["vs_in_memory"] = res[key]["samples_per_s"] / base
    res["loadavg_end"] = os.getloadavg()
    print(f"{name:6s} vs in-memory: " + ", ".join(
        f"{k.removeprefix('streaming_')} {res[k]['vs_in_memory']:.2f}x" for k in loaders
        if k != "tensordataset_in_memory"), flush=True)
    print(f"{name:6s} load average start {res['loadavg_start'][0]:.2f}, "
          f"end {res['loadavg_end'][0]:.2f}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", type=int, default=60000, help="samples of 784 floats")
    ap.add_argument("--large", type=int, default=6000, help="samples of 3x64x64 floats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = {
        "torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.platform(),
        "batch": BATCH, "workers": WORKERS,
        "results": [run("small", (784,), a.small, a.repeats, 1024),
                    run("large", (3, 64, 64), a.large, a.repeats, 256)],
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
