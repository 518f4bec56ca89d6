"""Arrow columns to numpy (torchfn.data's Parquet / HF readers): chunked columns, zero copy."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from torchfn.data._arrow import _arrow_numpy  # noqa: E402


def _lists(rows: np.ndarray) -> pa.Array:
    n, w = rows.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * w + 1, w, dtype=np.int32)),
                                    pa.array(rows.reshape(-1)))


def test_chunked_list_column_equals_its_rows_in_order_and_empty_chunks_are_ignored():
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((k, 6)).astype(np.float32) for k in (3, 0, 5, 1)]
    col = pa.chunked_array([_lists(p) for p in parts], type=pa.list_(pa.float32()))
    got = _arrow_numpy(col, pa)
    np.testing.assert_array_equal(got, np.concatenate(parts))
    assert got.dtype == np.float32 and got.shape == (9, 6)


def test_single_chunk_is_read_without_a_copy():
    rows = np.arange(24, dtype=np.float64).reshape(4, 6)
    arr = _lists(rows)
    got = _arrow_numpy(pa.chunked_array([arr]), pa)
    np.testing.assert_array_equal(got, rows)
    # a view of the Arrow value buffer itself, not of a combined copy
    assert got.__array_interface__["data"][0] == arr.values.buffers()[1].address


def test_chunks_that_disagree_give_none():
    a = _lists(np.zeros((2, 3), np.float32))
    b = _lists(np.zeros((2, 4), np.float32))  # other row length
    assert _arrow_numpy(pa.chunked_array([a, b]), pa) is None
    c = pa.array([[1.0, 2.0, 3.0], None], type=pa.list_(pa.float32()))  # a null row
    assert _arrow_numpy(pa.chunked_array([a, c]), pa) is None
    d = _lists(np.zeros((2, 3), np.float64))  # other dtype: its own chunked array
    assert _arrow_numpy(pa.chunked_array([d, a.cast(pa.list_(pa.float64()))]), pa).dtype == np.float64


def test_scalar_and_empty_columns():
    col = pa.chunked_array([pa.array([1, 2], pa.int64()), pa.array([3], pa.int64())])
    np.testing.assert_array_equal(_arrow_numpy(col, pa), [1, 2, 3])
    empty = pa.chunked_array([], type=pa.int64())
    assert _arrow_numpy(empty, pa).shape == (0,)
