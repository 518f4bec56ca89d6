"""``write_shards``: any ``SampleSource`` to ``.tfs`` shards, in one or several processes."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ._sources import SampleSource, _progress_bar

__all__ = ["write_shards"]


def write_shards(
    source: SampleSource,
    root: str | os.PathLike[str],
    *,
    samples_per_shard: int,
    batch_size: int = 256,
    fields: Sequence[str] | None = None,
    default_label: int | None = None,
    progress: bool = False,
    num_workers: int = 1,
    **writer_kwargs: Any,
) -> Path:
    """Returns ``root`` after writing every sample of ``source`` (in id order) as ``.tfs``
    shards (``ShardWriter``: per-sample checksums, memory-mapped reads).

    Sample ``i`` of the shards is sample ``i`` of the source, with its label. Fields must be
    tensors or numbers (a field of strings or bytes is refused by ``ShardWriter``, naming it).
    ``fields`` selects fields (default all). A source without labels needs ``default_label``
    (the shards store one integer per sample).
    ``writer_kwargs`` go to ``ShardWriter`` (``checksum``, ``ragged``). ``progress=True``
    shows a progress bar on stderr when ``tqdm`` is installed (nothing otherwise).

    ``num_workers > 1`` converts in that many processes (forked where the platform allows,
    else spawned: the source is then pickled): shard ``k`` holds samples ``[k *
    samples_per_shard, (k + 1) * samples_per_shard)`` whatever the worker count, each worker
    writes a contiguous run of shards into ``root/.write-<w>/``, and the parent moves them into
    place and writes the manifest once all succeeded. The files (shards and manifest) are
    byte-identical to a one-process write. A worker's error is re-raised in the caller (same
    type and text) and the partial output is removed; with one process the manifest is
    rewritten after every shard (a crash leaves the shards written so far), with several it is
    written at the end only.

    Example:
        >>> import tempfile, numpy as np
        >>> from torchfn.data import NumpySource, ShardSource
        >>> src = NumpySource({"x": np.arange(6.0)}, labels=np.arange(6) % 2)
        >>> root = write_shards(src, tempfile.mkdtemp(), samples_per_shard=4)
        >>> ShardSource(root).read([5])["x"].tolist(), ShardSource(root).labels.tolist()
        ([5.0], [0, 1, 0, 1, 0, 1])
    """
    from ._shards import MANIFEST, ShardWriter

    labels = source.labels
    if labels is None and default_label is None:
        raise ValueError(
            f"write_shards: {source.describe()} has no labels and .tfs shards store one integer "
            "label per sample; pass default_label=<int> to store that for every sample"
        )
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise ValueError(f"write_shards(num_workers={num_workers!r}): expected an int >= 1")
    if not isinstance(samples_per_shard, int) or samples_per_shard < 1:
        raise ValueError(
            f"write_shards(samples_per_shard=...): expected a positive int, got "
            f"{samples_per_shard!r}"
        )
    n = len(source)
    num_shards = -(-n // samples_per_shard)
    workers = min(num_workers, num_shards)
    bar = _progress_bar(n, f"write_shards -> {root}") if progress else None
    job = _WriteJob(source, samples_per_shard, batch_size,
                    None if fields is None else list(fields), default_label, writer_kwargs)
    try:
        if workers <= 1:
            with ShardWriter(root, samples_per_shard=samples_per_shard, **writer_kwargs) as w:
                job.write_range(w, 0, n, bar.update if bar is not None else None)
        else:
            if (Path(root) / MANIFEST).exists():
                raise FileExistsError(
                    f"write_shards({str(root)!r}): a manifest already exists there; write into "
                    "an empty directory"
                )
            _write_parallel(job, Path(root), n, num_shards, workers, bar)
    finally:
        if bar is not None:
            bar.close()
    return Path(root)


class _WriteJob(NamedTuple):
    source: Any
    samples_per_shard: int
    batch_size: int
    fields: list[str] | None
    default_label: int | None
    writer_kwargs: dict[str, Any]

    def write_range(self, w: Any, a: int, b: int, step: Callable[[int], Any] | None) -> None:
        """Writes samples ``[a, b)`` of the source with ``w`` (a ``ShardWriter``)."""
        labels, fields = self.source.labels, self.fields
        for lo in range(a, b, self.batch_size):
            ids = np.arange(lo, min(lo + self.batch_size, b), dtype=np.int64)
            batch = self.source.read(ids)
            if fields is not None:
                missing = [f for f in fields if f not in batch]
                if missing:
                    raise ValueError(
                        f"write_shards(fields=...): {self.source.describe()} has no fields "
                        f"{missing}; it has {sorted(batch)}"
                    )
                batch = {f: batch[f] for f in fields}
            for j, i in enumerate(ids.tolist()):
                w.write({k: v[j] for k, v in batch.items()},
                        label=int(labels[i]) if labels is not None else int(self.default_label))
            if step is not None:
                step(len(ids))


def _write_worker(job: _WriteJob, tmp: str, a: int, b: int, counter: Any, results: Any,
                  w_id: int) -> None:
    from ._shards import ShardWriter

    try:
        def step(k: int) -> None:
            with counter.get_lock():
                counter.value += k

        with ShardWriter(tmp, samples_per_shard=job.samples_per_shard,
                         **job.writer_kwargs) as w:
            job.write_range(w, a, b, step)
        results.put((w_id, None, w._shapes))
    except BaseException as e:  # sent to the parent, which re-raises it
        try:
            pickle.dumps(e)
        except Exception:
            e = RuntimeError(f"{type(e).__name__}: {e}")
        results.put((w_id, e, None))


def _write_parallel(job: _WriteJob, root: Path, n: int, num_shards: int, workers: int,
                    bar: Any) -> None:
    import multiprocessing as mp
    import queue
    import shutil

    from ._shards import MANIFEST, _atomic_write, read_manifest

    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else "spawn")
    sps = job.samples_per_shard
    cuts = [round(w * num_shards / workers) for w in range(workers + 1)]  # shards per worker
    root.mkdir(parents=True, exist_ok=True)
    tmps = [root / f".write-{w}" for w in range(workers)]
    for t in tmps:
        shutil.rmtree(t, ignore_errors=True)
    counter, results = ctx.Value("q", 0), ctx.Queue()
    procs = [ctx.Process(target=_write_worker, daemon=True, args=(
        job, str(tmps[w]), cuts[w] * sps, min(cuts[w + 1] * sps, n), counter, results, w))
        for w in range(workers)]
    done: dict[int, Any] = {}
    shown = 0
    try:
        for p in procs:
            p.start()
        while len(done) < workers:
            try:
                w_id, err, shapes = results.get(timeout=0.2)
            except queue.Empty:
                dead = [w for w, p in enumerate(procs) if w not in done and p.exitcode
                        not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"write_shards: worker {dead[0]} died (exit code "
                        f"{procs[dead[0]].exitcode}) while writing shards "
                        f"[{cuts[dead[0]]}, {cuts[dead[0] + 1]})"
                    ) from None
            else:
                if err is not None:
                    raise err
                done[w_id] = shapes
            if bar is not None and counter.value > shown:
                bar.update(counter.value - shown)
                shown = counter.value
        for p in procs:
            p.join()
        # the checks one writer makes across all samples: same fields, dtypes and shapes
        manifests = [read_manifest(t) for t in tmps]
        ragged = frozenset(job.writer_kwargs.get("ragged", ()))
        for w in range(1, workers):
            if manifests[w]["fields"] != manifests[0]["fields"]:
                raise ValueError(
                    f"ShardWriter.write: fields/dtypes changed between shards: "
                    f"{manifests[0]['fields']} then {manifests[w]['fields']}"
                )
            for k, shape in done[w].items():
                ref = done[0].get(k)
                if k not in ragged and ref is not None and shape != ref:
                    raise ValueError(
                        f"ShardWriter.write: sample {cuts[w] * sps} has field {k!r} of shape "
                        f"{shape}, but sample 0 has shape {ref}; a field keeps one shape "
                        f"(batches stack it), or pass ShardWriter(..., ragged=[{k!r}]) to store "
                        "it ragged (batches then hold it as a list of tensors)"
                    )
        shards = []
        for w, m in enumerate(manifests):
            for j, entry in enumerate(m["shards"]):
                name = f"shard-{cuts[w] + j:05d}.tfs"
                os.replace(tmps[w] / entry["file"], root / name)
                shards.append({**entry, "file": name})
        manifest = {**manifests[0], "num_samples": sum(s["num_samples"] for s in shards),
                    "shards": shards}
        _atomic_write(root / MANIFEST, [json.dumps(manifest).encode()])
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)
    if bar is not None and counter.value > shown:
        bar.update(counter.value - shown)
