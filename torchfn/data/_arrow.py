"""``ParquetSource`` and ``HFDiskSource``: Arrow data (via ``pyarrow``) as ``SampleSource``s.

See ``_sources.py`` for the protocol; ``pyarrow`` is imported on first use (the ``arrow`` extra).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._alloc import batch_tensor, empty_batch, gather_rows
from ._fsio import is_url, open_binary
from ._pqdecode import FastReader
from ._shmcache import SharedDecodeCache
from ._sources import _as_ids, _digest, _expand, collate_values

__all__ = ["HFDiskSource", "ParquetSource"]


def _pyarrow(who: str) -> Any:
    try:
        import pyarrow as pa
        import pyarrow.compute
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ImportError(
            f"{who} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    return pa


def _arrow_numpy(col: Any, pa: Any) -> np.ndarray | None:
    """Returns a ``(n, *shape)`` numpy array in the column's own dtype when the column holds
    numbers (or nested lists of numbers of one shape) without nulls, read from Arrow's flat
    value buffer (zero-copy where Arrow allows: then read-only); else None."""
    if hasattr(col, "combine_chunks"):  # a ChunkedArray
        chunks = [c for c in col.chunks if len(c)]
        if len(chunks) > 1:  # each chunk zero-copy, then one numpy concatenation
            parts = [_arrow_numpy(c, pa) for c in chunks]
            if any(a is None for a in parts) or len({(a.shape[1:], a.dtype)
                                                     for a in parts}) != 1:  # type: ignore[union-attr]
                return None
            return np.concatenate(parts)  # type: ignore[arg-type]
        # one chunk: used as is (``combine_chunks`` would copy it, into pyarrow's memory
        # pool: in a forked DataLoader worker those are copy-on-write pages of the parent)
        col = chunks[0] if chunks else col.combine_chunks()
    n, shape, cur = len(col), [], col
    while (pa.types.is_list(cur.type) or pa.types.is_large_list(cur.type)
           or pa.types.is_fixed_size_list(cur.type)):
        if cur.null_count or len(cur) == 0:
            return None
        if pa.types.is_fixed_size_list(cur.type):
            shape.append(cur.type.list_size)
        else:  # one length for all rows: read from the offsets (no compute kernel)
            lengths = np.diff(cur.offsets.to_numpy())
            if lengths.min() != lengths.max():
                return None
            shape.append(int(lengths[0]))
        cur = cur.flatten()
    t = cur.type
    if cur.null_count or not (pa.types.is_integer(t) or pa.types.is_floating(t)
                              or pa.types.is_boolean(t)):
        return None
    if not shape and pa.types.is_boolean(t):
        return np.asarray(cur.to_numpy(zero_copy_only=False), dtype=bool)
    if pa.types.is_boolean(t):
        return None  # lists of bools stay lists (as before)
    return cur.to_numpy(zero_copy_only=False).reshape(n, *shape)


def _arrow_fixed_shape(col: Any, pa: Any) -> Any:
    """Returns a ``(b, *shape)`` tensor in the column's own dtype when it is (nested) lists of
    numbers of one shape without nulls, read from Arrow's flat value buffer; else None."""
    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)):
        return None
    a = _arrow_numpy(col, pa)
    return None if a is None else torch.from_numpy(np.array(a))


def _arrow_column(col: Any, pa: Any) -> Any:
    """Returns an Arrow column as a ``(b, ...)`` tensor when its values are numbers of one
    shape (scalars or nested lists), else the Python list of values."""
    t = col.type
    fixed = _arrow_fixed_shape(col, pa)
    if fixed is not None:
        return fixed
    if col.null_count == 0 and (pa.types.is_integer(t) or pa.types.is_floating(t)
                                or pa.types.is_boolean(t)):
        return torch.from_numpy(np.array(col.to_pylist() if pa.types.is_boolean(t)
                                         else col.to_numpy()))
    values = col.to_pylist()
    if values and col.null_count == 0 and (
        pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    ):
        arrays = [np.asarray(v) for v in values]
        if len({(a.shape, a.dtype) for a in arrays}) == 1 and arrays[0].dtype.kind in "biuf":
            return torch.from_numpy(np.stack(arrays))
    return values


class _ArrowSource:
    """Shared reading for sources whose units are Arrow tables (row groups or files)."""

    _who = "ArrowSource"

    def _setup(self, pa: Any, schema: Any, unit_rows: list[int], columns: Sequence[str] | None,
               label_column: str | None, labels_of: Callable[[], Any],
               cache_units: int | None) -> None:
        names = list(schema.names)
        if label_column is not None and label_column not in names:
            raise ValueError(
                f"{self._who}(label_column={label_column!r}): no such column; the columns are "
                f"{names}"
            )
        cols = [c for c in names if c != label_column] if columns is None else list(columns)
        missing = [c for c in cols if c not in names]
        if missing:
            raise ValueError(
                f"{self._who}(columns=...): no columns {missing}; the columns are {names}"
            )
        self.columns = cols
        self.label_column = label_column
        self.shard_sizes = unit_rows
        self._starts = np.cumsum([0, *unit_rows])
        self.labels: np.ndarray | None = None
        if label_column is not None:
            lab = labels_of()
            if lab.null_count or not pa.types.is_integer(lab.type):
                raise ValueError(
                    f"{self._who}(label_column={label_column!r}): expected integers without "
                    f"nulls, got type {lab.type} with {lab.null_count} nulls"
                )
            self.labels = np.asarray(lab.to_numpy(), dtype=np.int64)
        if cache_units is None:
            # enough units for any two consecutive windows of the default shuffle buffer (twice
            # the largest unit), plus one: a worker's batches then find every unit they touch
            # cached, so each unit is read and decoded once per epoch per worker
            window = 4 * max(unit_rows, default=1)
            small = np.cumsum(sorted(unit_rows))
            cache_units = int(np.searchsorted(small, window)) + 2
        if not isinstance(cache_units, int) or cache_units < 1:
            raise ValueError(f"{self._who}(cache_units={cache_units!r}): expected an int >= 1")
        self.cache_units = cache_units
        self._cache: OrderedDict[int, tuple[Any, dict[str, np.ndarray | None]]] = OrderedDict()
        self._ahead: dict[int, Any] = {}  # unit -> Future of its decode (``prefetch``)
        self._pool: tuple[int, Any] | None = None  # (pid, executor) of the decode-ahead thread
        self._pid: int | None = os.getpid()  # the process the cache and open files belong to

    def _own(self) -> None:
        """Starts a process's own cache and open files when it is not the one that filled them
        (a forked DataLoader worker inherits its parent's: row groups the parent decoded for
        itself, which this process would otherwise evict from the shared cache as if it had
        shared them, and file objects whose descriptors it shares with the parent)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._cache, self._ahead, self._pool = OrderedDict(), {}, None
            self._forget_files()

    def _forget_files(self) -> None:
        pass

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _table(self, unit: int) -> Any:  # one unit's table with self.columns
        raise NotImplementedError

    def _unit(self, unit: int) -> tuple[Any, dict[str, np.ndarray | None]]:
        """The unit's table and its columns decoded to numpy (None: not numbers of one
        shape), from an LRU cache of ``cache_units`` units."""
        hit = self._cache.get(unit)
        if hit is not None:
            self._cache.move_to_end(unit)
            return hit
        fut = self._ahead.pop(unit, None)
        if fut is not None:
            try:
                hit = fut.result()  # None: another process decodes it (shared cache)
            except Exception:
                hit = None  # decoded again below, which raises the error here
        if hit is None:
            hit = self._decode_unit(unit)
        self._cache[unit] = hit
        while len(self._cache) > self.cache_units:
            self._evicted(self._cache.popitem(last=False)[0])
        return hit

    def _decode_unit(self, unit: int) -> tuple[Any, dict[str, np.ndarray | None]]:
        pa = _pyarrow(self._who)
        table = self._table(unit)
        return table, {c: _arrow_numpy(table.column(c), pa) for c in self.columns}

    def _evicted(self, unit: int) -> None:
        pass

    def _decode_ahead(self, unit: int) -> tuple[Any, dict[str, np.ndarray | None]] | None:
        """Runs in the decode-ahead thread: the unit as ``_unit`` caches it, or None."""
        raise NotImplementedError

    def _prefetch(self, ids: Any) -> None:
        """Starts decoding the units of ``ids`` in a background thread (see ``prefetch``)."""
        self._own()
        ids = _as_ids(ids)
        if not ids.size:
            return
        if ids.min() < 0 or ids.max() >= len(self):
            raise IndexError(f"{self._who}.prefetch: ids must lie in [0, {len(self)})")
        units = np.searchsorted(self._starts, ids, side="right") - 1
        _, first = np.unique(units, return_index=True)
        order = units[np.sort(first)].tolist()  # in the order they are needed
        wanted = set(order)
        for u in [u for u in self._ahead if u not in wanted]:  # plans changed: drop them
            del self._ahead[u]
        if self._pool is None or self._pool[0] != os.getpid():  # none yet, or forked
            from concurrent.futures import ThreadPoolExecutor

            self._pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="torchfn-ahead"))
            self._ahead = {}
            self.__dict__.pop("_pfiles_ahead", None)  # the thread opens its own files
        for u in order:
            if len(self._ahead) > self.cache_units // 2:
                break
            if u not in self._cache and u not in self._ahead:
                self._ahead[u] = self._pool[1].submit(self._decode_ahead, u)

    def read(self, ids: Any) -> dict[str, Any]:
        self._own()
        ids = _as_ids(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"{self._who}.read: ids must lie in [0, {len(self)})")
        if not ids.size:
            return {c: collate_values([]) for c in self.columns}
        units = np.searchsorted(self._starts, ids, side="right") - 1
        uniq = np.unique(units).tolist()
        decoded = {u: self._unit(u) for u in uniq}
        out: dict[str, Any] = {}
        slow = []
        for c in self.columns:
            arrays = [decoded[u][1][c] for u in uniq]
            if any(a is None for a in arrays) or len(
                {(a.shape[1:], a.dtype) for a in arrays}  # type: ignore[union-attr]
            ) != 1:
                slow.append(c)
                continue
            if len(uniq) == 1:
                parts = [(arrays[0], ids - self._starts[uniq[0]], np.arange(len(ids)))]
            else:
                parts = []
                for u, a in zip(uniq, arrays, strict=True):
                    rows = np.flatnonzero(units == u)
                    parts.append((a, ids[rows] - self._starts[u], rows))
            # in a worker: the rows written straight from the decoded arrays into the batch's
            # shared memory (one pwritev); else gathered into an empty batch
            dst = gather_rows(parts, len(ids))  # type: ignore[arg-type]
            if dst is None:
                a0 = arrays[0]
                dst = empty_batch((len(ids), *a0.shape[1:]), a0.dtype)  # type: ignore[union-attr]
                for a, src_rows, rows in parts:
                    if len(parts) == 1:
                        np.take(a, src_rows, axis=0, out=dst)
                    else:
                        dst[rows] = a[src_rows]  # type: ignore[index]
            out[c] = batch_tensor(dst)
        if slow:  # strings, ragged lists, nulls, shapes that differ between units
            pa = _pyarrow(self._who)
            order = np.argsort(units, kind="stable")
            parts = [(decoded[u][0] if decoded[u][0] is not None else self._table(u)).select(
                slow).take(pa.array(ids[units == u] - self._starts[u])) for u in uniq]
            table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            inv = np.empty_like(order)
            inv[order] = np.arange(len(order))
            table = table.take(pa.array(inv))  # back to the order of ids
            out.update({c: _arrow_column(table.column(c), pa) for c in slow})
        return {c: out[c] for c in self.columns}

    def read_sample(self, i: int) -> dict[str, Any]:
        return {k: v[0] for k, v in self.read([i]).items()}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": OrderedDict(), "_ahead": {}, "_pool": None,
                "_pid": None}


_OPEN_FILES = 32  # Parquet files a process keeps open (at least cache_units)


def _parquet_file(pa: Any, path: str) -> Any:
    # a URL is read through an fsspec file object (pyarrow reads the footer and the row
    # groups it needs as byte ranges)
    # a local file is memory-mapped (no read copy of each row group's pages)
    if is_url(path):
        return pa.parquet.ParquetFile(open_binary(path))
    return pa.parquet.ParquetFile(path, memory_map=True)


class ParquetSource(_ArrowSource):
    """Returns a ``SampleSource`` over Parquet files (needs ``pyarrow``); row groups are the
    locality units (``shard_sizes``), each read whole and decoded once into numpy arrays in the
    columns' own dtypes, kept in an LRU cache of ``cache_units`` row groups per process.

    The default ``cache_units`` covers two windows of ``StreamingDataset``'s default
    ``shuffle_buffer`` (twice the largest row group), so each row group is read once per epoch
    per worker; with a larger ``shuffle_buffer`` pass ``cache_units >= 2 * shuffle_buffer /
    rows per group + 2`` (memory: that many decoded row groups per worker, plus up to
    ``cache_units // 2 + 1`` decoded ahead).

    ``shared_cache=True`` (default; Linux/macOS): DataLoader workers share decoded row groups
    through ``.npy`` files in ``/dev/shm`` (``_shmcache.py``): the first worker that needs a
    row group decodes it under a file lock, the others map it, so each row group is decoded
    about once per epoch in all instead of once per worker. The directory is removed when the
    process that created the source drops it or exits (a killed process leaves
    ``/dev/shm/torchfn-parquet-*``); that process itself (``num_workers=0``) decodes for
    itself. ``shared_cache=False``: each process decodes for itself.

    Row groups are decoded ahead in a background thread (pyarrow releases the GIL) when
    ``StreamingDataset`` announces the next ids (``prefetch``); with the shared cache each
    worker's thread skips row groups another worker is decoding, so the workers split the
    decoding between them instead of waiting on each other.

    Local files: columns of numbers, or of lists of numbers (one level), without nulls or
    empty lists, PLAIN or dictionary encoded, are decoded straight from a memory map of the
    file (``_pqdecode.py``: the rows' starts read from the repetition levels run by run rather
    than value by value); pages that carry a CRC32 are checked (``CorruptParquetError``
    naming the file, row group and column). Other columns are read with pyarrow; the values
    are the same either way.

    ``paths``: a file, a directory (its ``*.parquet``), a glob, or a list (local paths or
    fsspec URLs, e.g. ``memory://``, ``s3://``; URLs need ``fsspec``). ``columns``: the
    fields (default all but ``label_column``); ``label_column``: an integer column that becomes
    ``labels``. Numeric columns and lists of numbers of one shape become tensors, others lists.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> path = tempfile.mkdtemp() + "/a.parquet"
        >>> pq.write_table(pa.table({"x": [[0.0, 1.0], [2.0, 3.0]], "y": [1, 0]}), path)
        >>> ParquetSource(path, label_column="y").read([1])["x"].tolist()
        [[2.0, 3.0]]
    """

    _who = "ParquetSource"

    def __init__(self, paths: Any, *, columns: Sequence[str] | None = None,
                 label_column: str | None = None, cache_units: int | None = None,
                 shared_cache: bool = True) -> None:
        pa = _pyarrow(self._who)
        self.files = _expand(paths, ".parquet", self._who)
        self._units: list[tuple[int, int]] = []
        rows, schema, meta = [], None, []
        for f, path in enumerate(self.files):
            pf = _parquet_file(pa, path)
            if schema is None:
                schema = pf.schema_arrow
            elif not pf.schema_arrow.equals(schema):
                raise ValueError(
                    f"ParquetSource: {path!r} has schema {pf.schema_arrow}; the first file has "
                    f"{schema}"
                )
            md = pf.metadata
            meta.append((os.path.basename(path), md.num_rows, md.num_row_groups))
            for g in range(md.num_row_groups):
                self._units.append((f, g))
                rows.append(md.row_group(g).num_rows)

        def labels_of() -> Any:
            cols = [_parquet_file(pa, p).read(columns=[label_column]).column(0)
                    for p in self.files]
            return pa.chunked_array([c for col in cols for c in col.chunks],
                                    type=schema.field(label_column).type)

        self._setup(pa, schema, rows, columns, label_column, labels_of, cache_units)
        self._fp = _digest(meta, str(schema))
        self._shared = SharedDecodeCache(self, "parquet") if shared_cache else None

    def _sharing(self) -> SharedDecodeCache | None:
        # the process that made the source has no one to share with: its child processes
        # (DataLoader workers, write_shards' processes) share what they decode
        shared = self._shared
        return shared if shared is not None and shared.owner != os.getpid() else None

    def _decode_unit(self, unit: int) -> tuple[Any, dict[str, np.ndarray | None]]:
        shared = self._sharing()
        if shared is None:
            return super()._decode_unit(unit)
        pa = _pyarrow(self._who)
        def decode(alloc: Any) -> dict[str, np.ndarray | None]:
            # the fast decoder writes the values straight into the shared files (``alloc``)
            table = self._table(unit, alloc=alloc)
            return {c: _arrow_numpy(table.column(c), pa) for c in self.columns}

        arrays = shared.get(unit, self.columns, decode, into=True)
        assert arrays is not None
        return None, arrays  # the table is read again only for columns not shared (strings)

    def prefetch(self, ids: Any) -> None:
        """Returns None at once, having started to decode, in a background thread, the row
        groups of the ``(n,)`` int64 ``ids`` about to be read (``StreamingDataset`` passes the
        next ids of its plan), so ``read`` finds them decoded; at most ``cache_units // 2 + 1``
        row groups are decoded ahead. The samples read do not change.

        Example:
            >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
            >>> path = tempfile.mkdtemp() + "/a.parquet"
            >>> pq.write_table(pa.table({"x": [1.0, 2.0, 3.0]}), path, row_group_size=2)
            >>> src = ParquetSource(path)
            >>> src.prefetch([2, 0])
            >>> src.read([2, 0])["x"].tolist()
            [3.0, 1.0]
        """
        self._prefetch(ids)

    def _decode_ahead(self, unit: int) -> tuple[Any, dict[str, np.ndarray | None]] | None:
        # own open files (a ParquetFile is not shared between threads); with the shared cache
        # a unit another process is decoding is skipped (the reader maps it when it needs it)
        pa = _pyarrow(self._who)
        def decode(alloc: Any) -> dict[str, np.ndarray | None]:
            table = self._table(unit, "_pfiles_ahead", alloc)
            return {c: _arrow_numpy(table.column(c), pa) for c in self.columns}

        shared = self._sharing()
        if shared is None:
            table = self._table(unit, "_pfiles_ahead")
            return table, {c: _arrow_numpy(table.column(c), pa) for c in self.columns}
        arrays = shared.get(unit, self.columns, decode, wait=False, into=True)
        return None if arrays is None else (None, arrays)

    def _evicted(self, unit: int) -> None:
        shared = self._sharing()
        if shared is not None:
            shared.evict(unit, self.columns)

    def _table(self, unit: int, files: str = "_pfiles", alloc: Any = None) -> Any:
        # ``alloc``: where the fast decoder puts a column's values (``SharedDecodeCache.get``)
        pa = _pyarrow(self._who)
        f, g = self._units[unit]
        pfiles = self.__dict__.setdefault(files, OrderedDict())
        pf = pfiles.get(f)
        if pf is None:  # footers parsed once per file per process (some files kept open:
            # a shuffled epoch visits the row groups of many files in turn)
            path = self.files[f]
            pf = pfiles[f] = _parquet_file(pa, path)
            if not is_url(path):  # numbers and lists of numbers decoded from a memory map
                pf = pfiles[f] = FastReader(pa, pf, path, self.columns)
            while len(pfiles) > max(self.cache_units, _OPEN_FILES):
                pfiles.popitem(last=False)
        pfiles.move_to_end(f)
        if isinstance(pf, FastReader):
            return pf.read_row_group(pa, g, self.columns, alloc)
        # one thread: a DataLoader's workers already keep the cores busy
        return pf.read_row_group(g, columns=self.columns, use_threads=False)

    def _forget_files(self) -> None:
        self.__dict__.pop("_pfiles", None)
        self.__dict__.pop("_pfiles_ahead", None)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_pfiles": OrderedDict(),
                "_pfiles_ahead": OrderedDict()}

    def fingerprint(self) -> str:
        return self._fp

    def describe(self) -> str:
        return f"ParquetSource({len(self)} rows in {len(self.files)} files)"


class HFDiskSource(_ArrowSource):
    """Returns a ``SampleSource`` over a Hugging Face ``Dataset.save_to_disk`` directory
    (needs ``pyarrow``, not ``datasets``): its Arrow files are memory-mapped, one unit each.

    ``path``: the directory holding ``state.json`` (for a ``DatasetDict``, the split's
    directory, e.g. ``path/train``). ``label_column`` defaults to ``"label"`` when present.
    Numeric columns are read as zero-copy numpy views of the memory-mapped Arrow buffers; the
    views of the last ``cache_units`` files are kept (``ParquetSource`` says how many).

    Example (the layout ``save_to_disk`` writes: ``state.json`` naming Arrow stream files)::

        >>> import json, os, tempfile, pyarrow as pa, pyarrow.ipc
        >>> d = tempfile.mkdtemp()
        >>> table = pa.table({"x": [[0.0, 1.0], [2.0, 3.0]], "label": [1, 0]})
        >>> with pa.OSFile(os.path.join(d, "data-00000-of-00001.arrow"), "wb") as f:
        ...     with pyarrow.ipc.new_stream(f, table.schema) as w:
        ...         w.write_table(table)
        >>> with open(os.path.join(d, "state.json"), "w") as f:
        ...     json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}, f)
        >>> src = HFDiskSource(d)
        >>> len(src), src.labels.tolist(), src.read([1])["x"].tolist()
        (2, [1, 0], [[2.0, 3.0]])
    """

    _who = "HFDiskSource"

    def __init__(self, path: str | os.PathLike[str], *, columns: Sequence[str] | None = None,
                 label_column: str | None = "label", cache_units: int | None = None) -> None:
        pa = _pyarrow(self._who)
        root = Path(path)
        if (root / "dataset_dict.json").exists():
            splits = sorted(p.name for p in root.iterdir() if p.is_dir())
            raise ValueError(
                f"HFDiskSource({str(path)!r}): this is a DatasetDict; pass one split's directory, "
                f"one of {splits}"
            )
        try:
            state = json.loads((root / "state.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"HFDiskSource({str(path)!r}): no state.json; expected a directory written by "
                "datasets' Dataset.save_to_disk"
            ) from None
        self.files = [str(root / d["filename"]) for d in state["_data_files"]]
        self._tables = [self._open(p) for p in self.files]
        schema = self._tables[0].schema
        if label_column == "label" and "label" not in schema.names:
            label_column = None
        self._setup(
            pa, schema, [t.num_rows for t in self._tables], columns, label_column,
            lambda: pa.chunked_array(
                [c for t in self._tables for c in t.column(label_column).chunks],
                type=schema.field(label_column).type,
            ),
            cache_units,
        )
        self._fp = _digest(state.get("_fingerprint"), [d["filename"] for d in state["_data_files"]],
                           self.shard_sizes)

    def _open(self, path: str) -> Any:
        pa = _pyarrow(self._who)
        try:
            return pa.ipc.open_stream(pa.memory_map(path, "r")).read_all()
        except (OSError, pa.ArrowInvalid) as e:
            raise ValueError(f"HFDiskSource: cannot read Arrow file {path!r}: {e}") from e

    def _table(self, unit: int) -> Any:
        if self._tables[unit] is None:
            self._tables[unit] = self._open(self.files[unit])
        return self._tables[unit].select(self.columns)

    def fingerprint(self) -> str:
        return self._fp

    def describe(self) -> str:
        return f"HFDiskSource({len(self)} rows in {len(self.files)} Arrow files)"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": OrderedDict(), "_tables": [None] * len(self.files),
                "_pid": None}
