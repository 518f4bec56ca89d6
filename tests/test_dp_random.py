"""The counter-based generator of DP-SGD's seeded noise (torchfn.persample._dp_random).

Properties, not pinned values: the int32 hash equals a plain int64 reference of the same
bijection (eager and compiled, counters near 2**32); normals have the standard normal's
moments, a small Kolmogorov-Smirnov distance and the right tail frequencies; the cosine and
sine outputs of one pair and different keys are uncorrelated; slices at odd offsets and
lengths, ranges and scattered positions equal the whole draw's elements bit for bit; a
draw is a prefix of a longer one; compiled equals eager (float32 bit for bit, float64 to
the last bit).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from torchfn.persample import _dp_random as R

F64 = torch.float64
M32 = 0xFFFFFFFF


def _mix_ref(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def _bits_ref(k0: int, k1: int, c: int) -> int:
    return _mix_ref((((_mix_ref(c ^ k0)) + k1) & M32) ^ 0x5BD1E995)


def _normal_ref(key: torch.Tensor, n: int) -> torch.Tensor:
    """Box-Muller in float64 from Python-int words: element 2p cos, 2p + 1 sin of pair p."""
    k0, k1 = (int(v) for v in key)
    out = []
    for p in range((n + 1) // 2):
        w = [_bits_ref(k0, k1, 3 * p + i) for i in range(3)]
        u1 = 1.0 - ((w[0] >> 5) * 67108864 + (w[1] >> 6)) / 9007199254740992.0
        theta = w[2] * (2.0 * math.pi / 4294967296.0)
        r = math.sqrt(-2.0 * math.log(u1))
        out += [r * math.cos(theta), r * math.sin(theta)]
    return torch.tensor(out[:n], dtype=F64)


def test_int32_hash_equals_the_int64_reference() -> None:
    key = R.key_from_seed(2024)
    k0, k1 = (int(v) for v in key)
    offset = 2**32 - 300  # counters whose words are >= 2**31 and whose products overflow
    ref = torch.tensor([_bits_ref(k0, k1, offset + i) for i in range(300)])
    assert torch.equal(R.random_bits(key, 300, offset), ref)
    compiled = torch.compile(lambda k: R.random_bits(k, 300, offset), fullgraph=True)
    assert torch.equal(compiled(key), ref)
    with pytest.raises(ValueError, match="at most 2\\*\\*32 counters"):
        R.random_bits(key, 301, offset)


def test_normal_equals_the_scalar_reference() -> None:
    key = R.fold_in(R.key_from_seed(5), 9)
    ref = _normal_ref(key, 301)
    torch.testing.assert_close(R.normal(key, (301,), F64), ref, rtol=0, atol=1e-14)
    # float32 is the float64 draw rounded once
    assert torch.equal(R.normal(key, (301,)), R.normal(key, (301,), F64).float())


def test_moments_ks_and_tails() -> None:
    n = 1 << 20
    z = R.normal(R.key_from_seed(0), (n,), F64)
    se = 1 / math.sqrt(n)
    assert abs(float(z.mean())) < 4 * se
    assert abs(float(z.var()) - 1) < 4 * math.sqrt(2) * se
    assert abs(float((z**3).mean())) < 4 * math.sqrt(15) * se
    assert abs(float((z**4).mean()) - 3) < 4 * math.sqrt(96) * se
    # Kolmogorov-Smirnov distance to the normal CDF (critical value ~1.63 / sqrt(n) at 1%)
    s = z.sort().values
    cdf = 0.5 * torch.erfc(-s / math.sqrt(2))
    i = torch.arange(1, n + 1, dtype=F64)
    d = torch.maximum(i / n - cdf, cdf - (i - 1) / n).max()
    assert float(d) < 1.63 / math.sqrt(n)
    # tail counts beyond 3 and 4 sigma against the binomial expectation
    for t in (3.0, 4.0):
        p = math.erfc(t / math.sqrt(2))
        count = int((z.abs() > t).sum())
        assert abs(count - n * p) < 5 * math.sqrt(n * p), t
    # even (cos) and odd (sin) elements each have the right variance and are uncorrelated
    c, sn = z[0::2], z[1::2]
    assert abs(float(c.var()) - 1) < 6 * se and abs(float(sn.var()) - 1) < 6 * se
    assert abs(float((c * sn).mean())) < 4 * math.sqrt(2) * se
    # and so are their squares (a pair shares its radius: E[c^2 s^2] = 1 for independent
    # normals, the Box-Muller pair is independent)
    assert abs(float((c**2 * sn**2).mean()) - 1) < 6 * math.sqrt(8 * 2) * se


def test_keys_give_uncorrelated_streams() -> None:
    key = R.key_from_seed(1)
    draws = [R.normal(k, (1 << 16,), F64) for k in
             (key, R.fold_in(key, 1), R.fold_in(key, 2), R.key_from_seed(2))]
    corr = torch.corrcoef(torch.stack(draws))
    off = corr[~torch.eye(4, dtype=torch.bool)]
    assert float(off.abs().max()) < 4 / math.sqrt(1 << 16)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1001])
def test_slices_ranges_and_positions_equal_the_whole_draw(n: int) -> None:
    key = R.key_from_seed(7)
    full = R.normal(key, (n,), F64)
    assert torch.equal(R.normal(key, (n + 5,), F64)[:n], full)  # a prefix of a longer draw
    cuts = sorted({0, 1, n // 3, n // 2 + 1, n - 1, n} & set(range(n + 1)))
    for a in cuts:
        for b in cuts:
            if a <= b:
                assert torch.equal(R.normal_slice(key, n, a, b - a, F64), full[a:b]), (a, b)
    ranges = [(a, b - a) for a, b in itertools.pairwise(cuts)] + [(n // 2, 0)]
    for (a, length), part in zip(ranges, R._normal_ranges(key, n, ranges, F64), strict=True):
        assert torch.equal(part, full[a:a + length]), (a, length)
    j = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(R._normal_at(key, n, j, F64), full[j])
    with pytest.raises(ValueError, match=r"normal_slice\(n="):
        R.normal_slice(key, n, n, 1)


def test_compiled_equals_eager() -> None:
    key = R.key_from_seed(3)
    n = 10001

    def draw(k, dtype):
        return (R.normal(k, (n,), dtype), R.normal_slice(k, n, 3, 4001, dtype),
                *R._normal_ranges(k, n, [(1, 500), (2000, 999)], dtype))

    for dtype in (torch.float32, torch.bfloat16):
        eager = draw(key, dtype)
        compiled = torch.compile(lambda k, dtype=dtype: draw(k, dtype), fullgraph=True)(key)
        for e, c in zip(eager, compiled, strict=True):
            assert c.dtype == dtype and torch.equal(e, c)
    eager = draw(key, F64)
    compiled = torch.compile(lambda k: draw(k, F64), fullgraph=True)(key)
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(c, e, rtol=4e-16, atol=4e-16)


def test_too_long_draws_raise() -> None:
    with pytest.raises(ValueError, match="normals per key"):
        R.normal_slice(R.key_from_seed(0), 2**33, 0, 0)
