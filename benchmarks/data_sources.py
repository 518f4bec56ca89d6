"""Samples/s of each torchfn.data reader through StreamingDataset vs in-memory vs the format's
own loader, and the converter's (``write_shards``) samples/s. CPU, one run, side by side.

Same data for every loader (float32 samples + an int64 label in 0..9), 2 DataLoader workers,
batch 256. Per loader: one warm-up epoch (page cache warm, worker code paths run; it also
computes the correctness sums below), then ``--repeats`` timed epochs; the best is reported.
The load average is printed per row (numbers mean little above ~1.5 on a 2-core machine).

Rows per case (the same arrays written in each format):

- ``in-memory``: ``DataLoader(TensorDataset(x, y), batch_size=256, shuffle=True)``;
- ``tfs``: ``StreamingDataset(dir)`` over ``.tfs`` shards (xxh3_64 check on);
- ``numpy``: ``StreamingDataset(NumpySource({"x": "x.npy"}, labels="y.npy"))`` vs
  ``np.load(mmap_mode="r")`` + a plain map-style ``Dataset`` (shuffled, default collate);
- ``tar``: ``StreamingDataset(TarSource(dir))`` vs webdataset's
  ``WebDataset(...).shuffle(1000).decode().to_tuple(...).batched(256)`` + ``WebLoader``;
- ``parquet``: ``StreamingDataset(ParquetSource(dir, label_column="label"))`` (shuffled, and
  ``shuffle=False``: file order, like ``iter_batches``) vs pyarrow
  ``ParquetFile.iter_batches(256)`` (files split over the workers, file order: no shuffle;
  columns to tensors with ``flatten().to_numpy()``);
- ``hf``: ``StreamingDataset(HFDiskSource(dir))`` over a ``save_to_disk`` layout written with
  pyarrow (``state.json``, ``dataset_info.json``, Arrow stream files) vs
  ``datasets.load_from_disk(dir).with_format("torch")`` in a shuffled ``DataLoader``.

Parquet and HF store ``x`` flattened (``list<float32>``); sums do not depend on the shape.
Libraries that do not import (webdataset, datasets) give rows marked "not installed".
Correctness first: in the warm-up epoch every loader computes the sample count, the sum of
labels, the sum of ``x`` and the sum of ``x.sum() * (label + 1)`` (pairs each sample with its
label) in float64; every row must agree with the in-memory one (``agree`` in the results).

Usage:

    python benchmarks/data_sources.py [--small N] [--large N] [--repeats R] [--json F] [--md F]
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import shlex
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info

from torchfn.data import (
    HFDiskSource,
    NumpySource,
    ParquetSource,
    StreamingDataset,
    TarSource,
    write_shards,
)

BATCH, WORKERS = 256, 2
GOAL_VS_MEMORY = 0.8
FORMATS = ("tfs", "numpy", "tar", "parquet", "hf")
OWN = {"numpy": "np.load(mmap) + Dataset", "tar": "webdataset", "parquet": "pyarrow iter_batches",
       "hf": "datasets load_from_disk"}


# ---------------------------------------------------------------------- writing the formats
def _write_tars(root: str, x: np.ndarray, y: np.ndarray, per_shard: int) -> None:
    os.makedirs(root)
    for s in range(0, len(x), per_shard):
        with tarfile.open(os.path.join(root, f"wds-{s // per_shard:05d}.tar"), "w") as tar:
            for i in range(s, min(s + per_shard, len(x))):
                for ext in ("x.npy", "cls"):
                    buf = io.BytesIO()
                    if ext == "cls":
                        buf.write(str(int(y[i])).encode())
                    else:
                        np.save(buf, x[i])
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = buf.tell()
                    buf.seek(0)
                    tar.addfile(info, buf)


def _arrow_table(pa: Any, x: np.ndarray, y: np.ndarray) -> Any:
    flat = x.reshape(len(x), -1)
    offsets = np.arange(0, flat.size + 1, flat.shape[1], dtype=np.int32)
    col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))
    return pa.table({"x": col, "label": pa.array(y.astype(np.int64))})


def _file_ranges(n: int, per_file: int) -> list[tuple[int, int]]:
    return [(a, min(a + per_file, n)) for a in range(0, n, per_file)]


def _write_parquet(root: str, x: np.ndarray, y: np.ndarray, per_file: int, row_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root)
    for k, (a, b) in enumerate(_file_ranges(len(x), per_file)):
        pq.write_table(_arrow_table(pa, x[a:b], y[a:b]), os.path.join(root, f"part-{k:05d}.parquet"),
                       row_group_size=row_group)


def _write_hf(root: str, x: np.ndarray, y: np.ndarray, per_file: int) -> None:
    """The ``Dataset.save_to_disk`` layout, written with pyarrow."""
    import pyarrow as pa
    import pyarrow.ipc

    os.makedirs(root)
    ranges = _file_ranges(len(x), per_file)
    files = []
    for k, (a, b) in enumerate(ranges):
        name = f"data-{k:05d}-of-{len(ranges):05d}.arrow"
        table = _arrow_table(pa, x[a:b], y[a:b])
        with pa.OSFile(os.path.join(root, name), "wb") as f, pyarrow.ipc.new_stream(
                f, table.schema) as w:
            w.write_table(table)
        files.append({"filename": name})
    state = {"_data_files": files, "_fingerprint": f"bench-{len(x)}-{x.shape[1:]}",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    info = {"citation": "", "description": "", "homepage": "", "license": "",
            "features": {"x": {"feature": {"dtype": "float32", "_type": "Value"},
                               "_type": "Sequence"},
                         "label": {"dtype": "int64", "_type": "Value"}}}
    with open(os.path.join(root, "state.json"), "w") as f:
        json.dump(state, f)
    with open(os.path.join(root, "dataset_info.json"), "w") as f:
        json.dump(info, f)


# ---------------------------------------------------------------------- the format's own loaders
class _NpyDataset(Dataset):
    """``np.load(mmap_mode="r")`` + a plain map-style Dataset (one row per ``__getitem__``)."""

    def __init__(self, xpath: str, ypath: str) -> None:
        self.xpath, self.ypath = xpath, ypath
        self.n = len(np.load(ypath, mmap_mode="r"))
        self._x: np.ndarray | None = None
        self._y: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self._x is None:  # opened in the worker
            self._x = np.load(self.xpath, mmap_mode="r")
            self._y = np.load(self.ypath, mmap_mode="r")
        return torch.from_numpy(np.array(self._x[i])), int(self._y[i])


class _ParquetBatches(IterableDataset):
    """pyarrow ``ParquetFile.iter_batches``; files split over the DataLoader workers."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __iter__(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        import pyarrow.parquet as pq

        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for path in self.files[wid::nw]:
            for rb in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
                xs = rb.column("x")
                flat = np.array(xs.flatten().to_numpy())  # writable copy
                yield (torch.from_numpy(flat.reshape(len(rb), -1)),
                       torch.from_numpy(np.array(rb.column("label").to_numpy())))


# ---------------------------------------------------------------------- timing
def _xy(batch: Any, xkey: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):
        return batch[xkey], batch["label"]
    x, y = batch[0], batch[1]
    if not torch.is_tensor(x):  # webdataset: an ndarray, or a list of per-sample arrays
        x = torch.as_tensor(np.stack([np.asarray(v) for v in x]))
    return x, torch.as_tensor(np.asarray(y))


def _sums(loader: Iterable[Any], xkey: str) -> dict[str, float]:
    """One epoch computing the correctness sums (float64)."""
    n, lab, xs, pair = 0, 0.0, 0.0, 0.0
    for batch in loader:
        x, y = _xy(batch, xkey)
        per = x.reshape(len(x), -1).double().sum(1)
        yd = y.double()
        n += len(y)
        lab += float(yd.sum())
        xs += float(per.sum())
        pair += float((per * (yd + 1)).sum())
    return {"samples": n, "label_sum": lab, "x_sum": xs, "x_label_sum": pair}


def _count(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(batch["label"])
    return len(batch[1])


def _epoch(loader: Iterable[Any]) -> tuple[float, int]:
    t = time.perf_counter()
    n = 0
    for batch in loader:
        n += _count(batch)
    return time.perf_counter() - t, n


def _measure(make: Callable[[], Iterable[Any]], xkey: str, repeats: int) -> dict[str, Any]:
    load0 = os.getloadavg()[0]
    sums = _sums(make(), xkey)  # the warm-up epoch
    runs = [_epoch(make()) for _ in range(repeats)]
    best = min(r[0] for r in runs)
    return {"samples_per_s": runs[0][1] / best, "seconds": [r[0] for r in runs],
            "samples": runs[0][1], "sums": sums, "loadavg": [load0, os.getloadavg()[0]]}


def _agree(a: dict[str, float], b: dict[str, float]) -> bool:
    if a["samples"] != b["samples"]:
        return False
    return all(abs(a[k] - b[k]) <= 1e-9 * max(1.0, abs(a[k]), abs(b[k])) + 1e-6
               for k in ("label_sum", "x_sum", "x_label_sum"))


def _streaming(src: Any, shuffle: bool = True) -> Callable[[], Iterable[Any]]:
    def make() -> Iterable[Any]:
        return DataLoader(StreamingDataset(src, batch_size=BATCH, seed=0, shuffle=shuffle),
                          batch_size=None, num_workers=WORKERS)
    return make


def run_case(name: str, shape: tuple[int, ...], n: int, repeats: int, per_shard: int,
             root: str, formats: tuple[str, ...] = FORMATS) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *shape), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    res: dict[str, Any] = {"case": name, "shape": list(shape), "num_samples": n,
                           "samples_per_shard": per_shard, "rows": [], "convert": []}
    d = {f: os.path.join(root, name, f) for f in FORMATS}
    os.makedirs(d["numpy"])
    np.save(os.path.join(d["numpy"], "x.npy"), x)
    np.save(os.path.join(d["numpy"], "y.npy"), y)
    npy_src = NumpySource({"x": os.path.join(d["numpy"], "x.npy")},
                          labels=os.path.join(d["numpy"], "y.npy"))
    _write_tars(d["tar"], x, y, per_shard)
    have_arrow = True
    try:
        _write_parquet(d["parquet"], x, y, 4 * per_shard, per_shard)
        _write_hf(d["hf"], x, y, 4 * per_shard)
    except ImportError:
        have_arrow = False
    write_shards(npy_src, d["tfs"], samples_per_shard=per_shard)  # the tfs rows' shards

    sources: dict[str, Any] = {"numpy": npy_src, "tar": TarSource(d["tar"])}
    if have_arrow:
        sources["parquet"] = ParquetSource(d["parquet"], label_column="label")
        sources["hf"] = HFDiskSource(d["hf"])
    for fmt in ("numpy", "tar", "parquet", "hf"):
        if fmt in sources and fmt in (*formats, "numpy"):
            for workers in (1, WORKERS):
                out = os.path.join(root, name, f"convert-{fmt}-{workers}")
                t = time.perf_counter()
                write_shards(sources[fmt], out, samples_per_shard=per_shard,
                             num_workers=workers)
                res["convert"].append({"source": fmt, "workers": workers,
                                       "samples_per_s": n / (time.perf_counter() - t)})
                shutil.rmtree(out)
    bytes_per = x[0].nbytes + 8
    for c in res["convert"]:
        c["mb_per_s"] = c["samples_per_s"] * bytes_per / 1e6
        print(f"{name:6s} write_shards from {c['source']:8s} ({c.get('workers', 1)} proc) "
              f"{c['samples_per_s']:10.0f} samples/s ({c['mb_per_s']:.0f} MB/s)", flush=True)

    os.sync()  # flush the written files now, not in the background of the first timed rows
    tds = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    gen = torch.Generator().manual_seed(0)
    xkeys = {"tfs": "x", "numpy": "x", "tar": "x.npy", "parquet": "x", "hf": "x"}
    loaders: list[tuple[str, str, Callable[[], Iterable[Any]] | str]] = [
        ("in-memory", "TensorDataset", lambda: DataLoader(
            tds, batch_size=BATCH, shuffle=True, num_workers=WORKERS, generator=gen)),
        ("tfs", "StreamingDataset", _streaming(d["tfs"])),
        ("numpy", "StreamingDataset", _streaming(npy_src)),
        ("numpy", OWN["numpy"], lambda: DataLoader(
            _NpyDataset(os.path.join(d["numpy"], "x.npy"), os.path.join(d["numpy"], "y.npy")),
            batch_size=BATCH, shuffle=True, num_workers=WORKERS, generator=gen)),
        ("tar", "StreamingDataset", _streaming(sources["tar"])),
    ]
    try:
        import webdataset as wds

        urls = sorted(os.path.join(d["tar"], f) for f in os.listdir(d["tar"]))

        def web() -> Iterable[Any]:
            ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
                  .shuffle(1000).decode().to_tuple("x.npy", "cls").batched(BATCH))
            return wds.WebLoader(ds, batch_size=None, num_workers=WORKERS)

        loaders.append(("tar", OWN["tar"], web))
    except ImportError:
        loaders.append(("tar", OWN["tar"], "not installed"))
    if have_arrow:
        pfiles = sorted(os.path.join(d["parquet"], f) for f in os.listdir(d["parquet"]))
        loaders += [
            ("parquet", "StreamingDataset", _streaming(sources["parquet"])),
            # file order, like iter_batches: the like-for-like comparison with it
            ("parquet", "StreamingDataset shuffle=False", _streaming(sources["parquet"], False)),
            ("parquet", OWN["parquet"], lambda: DataLoader(
                _ParquetBatches(pfiles), batch_size=None, num_workers=WORKERS)),
            ("hf", "StreamingDataset", _streaming(sources["hf"])),
        ]
        try:
            import datasets

            hf = datasets.load_from_disk(d["hf"]).with_format("torch")
            loaders.append(("hf", OWN["hf"], lambda: DataLoader(
                hf, batch_size=BATCH, shuffle=True, num_workers=WORKERS, generator=gen)))
        except ImportError:
            loaders.append(("hf", OWN["hf"], "not installed"))
        except Exception as e:  # the layout written above is not one this datasets reads
            loaders.append(("hf", OWN["hf"], f"load_from_disk failed: {type(e).__name__}: {e}"))
    else:
        loaders += [("parquet", "StreamingDataset", "not installed (pyarrow)"),
                    ("hf", "StreamingDataset", "not installed (pyarrow)")]

    loaders = [t for t in loaders if t[0] == "in-memory" or t[0] in formats]
    for fmt, loader, make in loaders:
        row: dict[str, Any] = {"format": fmt, "loader": loader}
        if isinstance(make, str):
            row["status"] = make
            print(f"{name:6s} {fmt:8s} {loader:32s} {make}", flush=True)
        else:
            row.update(_measure(make, xkeys.get(fmt, "x"), repeats))
            row["status"] = "ok"
            print(f"{name:6s} {fmt:8s} {loader:32s} {row['samples_per_s']:10.0f} samples/s  "
                  f"(load {row['loadavg'][0]:.2f} -> {row['loadavg'][1]:.2f})", flush=True)
        res["rows"].append(row)

    base = res["rows"][0]
    timed = [r for r in res["rows"] if r["status"] == "ok"]
    own = {r["format"]: r for r in timed if r["loader"] == OWN.get(r["format"])}
    for r in timed:
        r["agree"] = _agree(r["sums"], base["sums"])
        r["vs_in_memory"] = r["samples_per_s"] / base["samples_per_s"]
        if r["loader"].startswith("StreamingDataset"):
            r["goal_vs_memory"] = "ok" if r["vs_in_memory"] >= GOAL_VS_MEMORY else "MISS"
            o = own.get(r["format"])
            if o is not None:
                r["vs_own"] = r["samples_per_s"] / o["samples_per_s"]
                r["goal_vs_own"] = "ok" if r["vs_own"] > 1.0 else "MISS"
            elif r["format"] in OWN:
                r["goal_vs_own"] = "n/a (own loader not installed)"
    bad = [f"{r['format']}/{r['loader']}" for r in timed if not r["agree"]]
    if bad:
        print(f"{name:6s} DISAGREE with in-memory sums: {bad}", flush=True)
    return res


# ---------------------------------------------------------------------- reports
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except ImportError:
        return "not installed"


def write_md(out: dict[str, Any], path: str) -> None:
    lines = [
        "# torchfn.data readers vs in-memory vs each format's own loader, CPU (current)",
        "",
        f"- Date: {out['date']}",
        f"- Device: {out['cpu']} ({out['cpus']} cores), no GPU; shared machine, load average "
        "per row (start -> end of its epochs; the benchmark itself keeps up to 3 processes "
        "busy, main + 2 workers, so ~2-3 is its own load and more is other jobs)",
        f"- torch {out['versions']['torch']}, numpy {out['versions']['numpy']}, pyarrow "
        f"{out['versions']['pyarrow']}, webdataset {out['versions']['webdataset']}, datasets "
        f"{out['versions']['datasets']}, Python {out['python']}",
        f"- Command: `{out['command']}`",
        f"- Method: batch {BATCH}, {WORKERS} DataLoader workers, one warm-up epoch (computes "
        f"the correctness sums) then {out['repeats']} timed epochs, best reported. Goals (issue "
        f"21): each reader through `StreamingDataset` >= {GOAL_VS_MEMORY}x in-memory and faster "
        "than the format's own loader. `agree`: sample count, label sum, x sum and "
        "sum(x.sum() * (label + 1)) equal the in-memory loader's (float64). The pyarrow "
        "`iter_batches` row reads in file order (no shuffle), as does `StreamingDataset "
        "shuffle=False` (the like-for-like row); the others shuffle.",
        "",
    ]
    for case in out["results"]:
        lines += [f"## {case['case']}: {case['num_samples']} samples of {case['shape']} float32 "
                  f"+ int64 label ({case['samples_per_shard']} per shard / tar / row group; "
                  "Parquet and Arrow files hold 4 of those)", "",
                  "| format | loader | samples/s | vs in-memory | vs own loader | >= 0.8x "
                  "in-memory | > own loader | agree | load avg |",
                  "|---|---|---:|---:|---:|---|---|---|---|"]
        for r in case["rows"]:
            if r["status"] != "ok":
                lines.append(f"| {r['format']} | {r['loader']} | {r['status']} | | | | | | |")
                continue
            vo = f"{r['vs_own']:.2f}x" if "vs_own" in r else ""
            lines.append(
                f"| {r['format']} | {r['loader']} | {r['samples_per_s']:.0f} | "
                f"{r['vs_in_memory']:.2f}x | {vo} | {r.get('goal_vs_memory', '')} | "
                f"{r.get('goal_vs_own', '')} | {'yes' if r['agree'] else '**NO**'} | "
                f"{r['loadavg'][0]:.2f} -> {r['loadavg'][1]:.2f} |")
        lines += ["", "Converter (`write_shards(source, dir, samples_per_shard=..., "
                  "num_workers=...)`, default xxh3_64 checksums):", "",
                  "| source | processes | samples/s | MB/s |", "|---|---:|---:|---:|"]
        for c in case["convert"]:
            lines.append(f"| {c['source']} | {c.get('workers', 1)} | {c['samples_per_s']:.0f} | "
                         f"{c['mb_per_s']:.0f} |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=60000, help="samples of 784 floats (0: skip)")
    ap.add_argument("--large", type=int, default=4000, help="samples of 3x64x64 floats (0: skip)")
    ap.add_argument("--per-shard-small", type=int, default=1024)
    ap.add_argument("--per-shard-large", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="comma-separated subset of the rows to time (quick checks); in-memory "
                         "is always timed")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="e.g. benchmarks/results/data-sources-cpu.md")
    a = ap.parse_args(argv)
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in ("torch", "numpy", "pyarrow", "webdataset",
                                              "datasets")},
        "command": "python " + shlex.join(["benchmarks/data_sources.py", *(
            sys.argv[1:] if argv is None else argv)]),
        "batch": BATCH, "workers": WORKERS, "repeats": a.repeats, "results": [],
    }
    formats = tuple(f for f in a.formats.split(",") if f)
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        ap.error(f"--formats: unknown {unknown}; expected a subset of {list(FORMATS)}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        if a.small:
            out["results"].append(run_case("small", (784,), a.small, a.repeats,
                                           a.per_shard_small, root, formats))
        if a.large:
            out["results"].append(run_case("large", (3, 64, 64), a.large, a.repeats,
                                           a.per_shard_large, root, formats))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.md:
        write_md(out, a.md)
    ok = all(r["agree"] for c in out["results"] for r in c["rows"] if r["status"] == "ok")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
