"""Counter-based random numbers in plain tensor ops: pure functions of a key, like JAX's.

``torch.Generator`` cannot be passed into a ``torch.compile(fullgraph=True)`` graph, and the
global generator gives a compiled graph a different stream than eager code. DP-SGD wants
its noise and its Poisson sampling to be reproducible from an explicit seed, identical eager
and compiled, and resumable from ``(seed, step)`` alone. So the numbers here are a hash of
``(key, counter)`` written in int64 tensor ops (Inductor fuses them into one kernel):

- a key is an int64 tensor of shape ``(2,)`` holding two 32-bit words (:func:`key_from_seed`);
- :func:`fold_in` derives a new key from a key and an integer (the step, a parameter index);
- :func:`random_bits` hashes counters ``offset + arange(n)`` under a key with two keyed
  rounds of a two-multiply xorshift hash from Chris Wellons' hash prospector (an
  avalanche-tested bijection on 32 bits; multipliers below ``2**31``, so no int64 product
  can overflow);
- :func:`uniform` gives 53-bit float64 uniforms in ``[0, 1)`` from two words;
  :func:`normal` gives standard normals by Box-Muller with a 53-bit ``u1`` (tails to about
  8.6 standard deviations) and a 32-bit angle.

These are statistically strong, not cryptographic: like Opacus outside its ``secure_mode``,
they do not defend against an adversary who can predict the generator or exploit
floating-point artefacts of the noise (Mironov 2012, "On significance of the least
significant bits for differential privacy"). Keep the seed secret.

Inside ``torch.compile`` keep keys as graph *inputs* (carry the current key in the state) and
split streams by counter ranges: Inductor inlines integer chains into each element's kernel,
so a key derived by nested :func:`fold_in` calls inside the graph multiplies compile time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["fold_in", "key_from_seed", "normal", "normal_slice", "random_bits", "uniform"]

_M32 = 0xFFFFFFFF
_TWO_PI = 2.0 * math.pi


def _mix32(x: Tensor) -> Tensor:
    """A bijection on 32-bit words with strong avalanche (Wellons' hash prospector).

    ``x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15`` (listed
    bias 0.107). Both multipliers are below ``2**31``, so ``x * c < 2**63`` never overflows
    int64 and ``x`` is read once per product (Inductor inlines every read).
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return z ^ (z >> 31)


def key_from_seed(seed: int, device: torch.device | str | None = None) -> Tensor:
    """Return a key (int64 tensor ``(2,)``, two 32-bit words) from an int seed in ``[0, 2**63)``.

    Example:
        >>> key_from_seed(0).shape, key_from_seed(0).dtype
        (torch.Size([2]), torch.int64)
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"key_from_seed(seed=...): expected an int in [0, 2**63), got {seed!r}")
    z = _splitmix64(seed)
    return torch.tensor([z & _M32, z >> 32], dtype=torch.int64, device=device)


def fold_in(key: Tensor, data: int | Tensor) -> Tensor:
    """Return a new key derived from ``key`` and the integer ``data`` (an int or 0-d tensor).

    Distinct ``data`` give (pseudo-)independent streams; ``data`` is taken modulo ``2**32``.

    Example:
        >>> k = key_from_seed(1)
        >>> torch.equal(fold_in(k, 3), fold_in(k, torch.tensor(3)))
        True
    """
    d = data & _M32 if isinstance(data, Tensor) else torch.tensor(data & _M32, device=key.device)
    d = d.to(device=key.device, dtype=torch.int64)
    a = _mix32(key[0] ^ _mix32(d ^ 0x9E3779B9))
    b = _mix32(((key[1] + a) & _M32) ^ _mix32((d + 0x85EBCA6B) & _M32))
    return torch.stack([a, b])


def random_bits(key: Tensor, n: int, offset: int = 0) -> Tensor:
    """Return ``(n,)`` int64 pseudo-random 32-bit words (values in ``[0, 2**32)``) for ``key``.

    Word ``i`` is the hash of counter ``offset + i``: disjoint counter ranges of one key give
    independent streams (cheaper than :func:`fold_in` inside a compiled graph).

    Example:
        >>> w = random_bits(key_from_seed(0), 4)
        >>> bool((w >= 0).all() and (w < 2**32).all())
        True
    """
    if offset + n > 2**32:
        raise ValueError(f"random_bits: at most 2**32 counters per key, got offset={offset} and "
                         f"n={n}; split the draw over several keys (fold_in)")
    return _bits_at(key, torch.arange(offset, offset + n, dtype=torch.int64, device=key.device))


def _bits_at(key: Tensor, counters: Tensor) -> Tensor:
    """Return the 32-bit words of ``key`` at the int64 ``counters`` (any shape, any order)."""
    h = _mix32(counters ^ key[0])
    return _mix32(((h + key[1]) & _M32) ^ 0x5BD1E995)


def _unit53(key: Tensor, n: int, offset: int) -> Tensor:
    """53-bit uniforms in ``[0, 1)`` from counters ``[offset, offset + 2n)``."""
    words = random_bits(key, 2 * n, offset)
    hi, lo = words[:n] >> 5, words[n:] >> 6  # 27 + 26 bits
    return (hi * 67108864 + lo).to(torch.float64) * (1.0 / 9007199254740992.0)


def uniform(key: Tensor, shape: tuple[int, ...] | torch.Size) -> Tensor:
    """Return float64 uniforms in ``[0, 1)`` with 53 random bits, of the given shape.

    Uses counters ``[0, 2 n)`` of ``key`` (``n`` = number of elements).

    Example:
        >>> u = uniform(key_from_seed(0), (1000,))
        >>> 0.45 < float(u.mean()) < 0.55
        True
    """
    n = math.prod(shape)
    return _unit53(key, n, 0).reshape(shape)


def normal(key: Tensor, shape: tuple[int, ...] | torch.Size,
           dtype: torch.dtype = torch.float32) -> Tensor:
    """Return standard normal samples of the given shape and dtype (Box-Muller in float64).

    Uses counters ``[0, 3 m)`` of ``key``, ``m = ceil(n / 2)``: per pair of outputs a 53-bit
    radius uniform (two words) and a 32-bit angle.

    Example:
        >>> z = normal(key_from_seed(0), (10000,), torch.float64)
        >>> abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1) < 0.05
        True
    """
    n = math.prod(shape)
    m = (n + 1) // 2
    u1 = 1.0 - _unit53(key, m, 0)  # (0, 1]
    angle = random_bits(key, m, 2 * m).to(torch.float64) * (_TWO_PI / 4294967296.0)
    r = torch.sqrt(-2.0 * torch.log(u1))
    z = torch.cat([r * torch.cos(angle), r * torch.sin(angle)])[:n]
    return z.reshape(shape).to(dtype)


def normal_slice(key: Tensor, n: int, start: int, length: int,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """Return ``normal(key, (n,), dtype)[start:start + length]`` without drawing the rest.

    A ``(length,)`` tensor, bit-identical to that slice: element ``j`` of the flat draw is the
    cosine (``j < m``) or sine (``j >= m``) half of Box-Muller pair ``j mod m``
    (``m = ceil(n / 2)``), whose words sit at counters ``p``, ``m + p`` and ``2 m + p``. So each
    rank of a sharded step can draw exactly its own part of one global noise vector.

    Example:
        >>> k = key_from_seed(3)
        >>> torch.equal(normal_slice(k, 11, 4, 5), normal(k, (11,))[4:9])
        True
    """
    if start < 0 or length < 0 or (length and start + length > n):
        raise ValueError(f"normal_slice(n={n}, start={start}, length={length}): expected "
                         f"start >= 0, length >= 0 and start + length <= n (any start for length 0)")
    return _normal_at(key, n, torch.arange(start, start + length, dtype=torch.int64,
                                           device=key.device), dtype)


def _normal_at(key: Tensor, n: int, j: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Return ``normal(key, (n,), dtype)[j]`` for int64 positions ``j`` (any shape, each in
    ``[0, n)``) without drawing the rest: :func:`normal_slice` at arbitrary positions, so the
    slices of many params can be drawn in one pass (same values, elementwise)."""
    m = (n + 1) // 2
    second = j >= m
    p = torch.where(second, j - m, j)
    hi, lo = _bits_at(key, p) >> 5, _bits_at(key, m + p) >> 6
    u1 = 1.0 - (hi * 67108864 + lo).to(torch.float64) * (1.0 / 9007199254740992.0)
    angle = _bits_at(key, 2 * m + p).to(torch.float64) * (_TWO_PI / 4294967296.0)
    r = torch.sqrt(-2.0 * torch.log(u1))
    return torch.where(second, r * torch.sin(angle), r * torch.cos(angle)).to(dtype)
