"""Counter-based random numbers in plain tensor ops: pure functions of a key, like JAX's.

``torch.Generator`` cannot be passed into a ``torch.compile(fullgraph=True)`` graph, and the
global generator gives a compiled graph a different stream than eager code. DP-SGD wants
its noise and its Poisson sampling to be reproducible from an explicit seed, identical eager
and compiled, and resumable from ``(seed, step)`` alone. So the numbers here are a hash of
``(key, counter)`` written in integer tensor ops (Inductor fuses them into one kernel):

- a key is an int64 tensor of shape ``(2,)`` holding two 32-bit words (:func:`key_from_seed`);
- :func:`fold_in` derives a new key from a key and an integer (the step, a parameter index);
- :func:`random_bits` hashes counters ``offset + arange(n)`` under a key with two keyed
  rounds of a two-multiply xorshift hash from Chris Wellons' hash prospector (an
  avalanche-tested bijection on 32 bits);
- :func:`uniform` gives 53-bit float64 uniforms in ``[0, 1)`` from two words;
  :func:`normal` gives standard normals by Box-Muller with a 53-bit ``u1`` (tails to about
  8.6 standard deviations) and a 32-bit angle, both outputs of each pair used: elements
  ``2p`` and ``2p + 1`` are the cosine and sine outputs of pair ``p`` (counters ``3p`` to
  ``3p + 2``), so any slice of a draw (:func:`normal_slice`, a shard's part of the noise)
  computes each pair it touches once, and a draw is a prefix of any longer one.

The hash runs on int32 tensors holding the words' bit patterns (an int64 multiply is several
32-bit instructions on GPUs and without AVX-512): it relies on int32 ``*`` and ``+`` giving
the right low 32 bits of the product or sum, which holds for the two's complement wrap of
eager kernels on CPU and CUDA and of Triton's ``i32`` arithmetic, and also where a backend
keeps int32 values in wider registers (C++ signed overflow is formally undefined, and
Inductor's C++ code has computed some int32 expressions unwrapped; pytorch/pytorch#108520,
#190764): every shift is masked to a logical one and every read of a word masks, so only low
32 bits ever matter. int64 values enter int32 only through an exact, in-range cast.
The words of :func:`random_bits`, :func:`uniform` and :func:`fold_in` are those of the
earlier int64 formulation; **the normal stream changed** (the pair layout above replaced
``cos`` halves then ``sin`` halves over counters ``p``, ``m + p``, ``2m + p``), so a seed's
gradient noise differs from torchfn versions before it.

Values are computed in float64 and rounded once to the requested dtype. Compiled and eager
float64 draws can differ in the last bit (the vector math libraries differ); rounded to
float32 or bfloat16 they agree unless a value straddles a rounding boundary (none in the
tests' draws).

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
# fold_in's salts 0x9E3779B9 and 0x85EBCA6B as int32 bit patterns
_I32_GOLDEN = 0x9E3779B9 - 2**32
_I32_MURMUR = 0x85EBCA6B - 2**32


def _mix32(x: Tensor) -> Tensor:
    """A bijection on 32-bit words with strong avalanche (Wellons' hash prospector), on int32.

    ``x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15`` (listed
    bias 0.107) on unsigned words, written on int32 tensors holding the words' bit patterns:
    the products are taken modulo ``2**32`` (two's complement wrap) and each right shift is
    masked to a logical one. Every step's low 32 bits depend only on its inputs' low 32 bits,
    and every read of a word (:func:`_unsigned`, the float conversions) masks, so the words
    are right also where a backend keeps int32 values in wider registers without wrapping.
    """
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x21F0AAAD
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x735A2D97
    return x ^ ((x >> 15) & 0x1FFFF)


def _word32(x: Tensor) -> Tensor:
    """int64 values (low 32 bits used) -> int32 tensor of the same 32-bit words.

    Centred into ``[-2**31, 2**31)`` in int64 first, so the cast is exact (no reliance on how a
    backend casts an out-of-range int64)."""
    return (((x & _M32) ^ 0x80000000) - 0x80000000).to(torch.int32)


def _unsigned(w: Tensor) -> Tensor:
    """int32 words -> int64 values in ``[0, 2**32)``."""
    return w.to(torch.int64) & _M32


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
    k0, k1, d = _word32(key[0]), _word32(key[1]), _word32(d)
    a = _mix32(k0 ^ _mix32(d ^ _I32_GOLDEN))
    b = _mix32((k1 + a) ^ _mix32(d + _I32_MURMUR))
    return _unsigned(torch.stack([a, b]))


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
    """Return the 32-bit words (int64) of ``key`` at the int64 ``counters`` (any shape)."""
    return _unsigned(_hash32(_word32(key[0]), _word32(key[1]), _word32(counters)))


def _hash32(k0: Tensor, k1: Tensor, c: Tensor) -> Tensor:
    """The word of counter ``c`` under key words ``k0, k1``: two keyed :func:`_mix32` rounds
    (all int32 tensors, broadcast)."""
    return _mix32((_mix32(c ^ k0) + k1) ^ 0x5BD1E995)


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


def _check_pairs(where: str, n_pairs: int) -> None:
    if 3 * n_pairs > 2**32:
        raise ValueError(f"{where}: at most {2 * (2**32 // 3)} normals per key (3 counters per "
                         f"pair of normals), got {2 * n_pairs}; split the draw over several "
                         f"keys (fold_in)")


def _pairs(key: Tensor, p: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Return Box-Muller pairs ``(r cos(theta), r sin(theta))`` in ``dtype`` for the int32 pair
    indices ``p`` (any shape, each in ``[0, 2**32 / 3)``).

    Pair ``p`` hashes counters ``3p, 3p + 1, 3p + 2``: a 53-bit ``u1`` in ``(0, 1]`` from the
    first two words (27 + 26 bits), the angle ``theta = 2 pi w / 2**32`` from the third; then
    ``r = sqrt(-2 log u1)`` and both outputs in float64, each rounded once to ``dtype`` (so a
    compiled graph writes only ``dtype`` values)."""
    k0, k1 = _word32(key[0]), _word32(key[1])
    c = p * 3  # int32: wraps like the hash (p < 2**32 / 3, so c + 2 < 2**32 as a word)
    hi = (_hash32(k0, k1, c) >> 5) & 0x7FFFFFF  # 27 bits
    lo = (_hash32(k0, k1, c + 1) >> 6) & 0x3FFFFFF  # 26 bits
    w = _hash32(k0, k1, c + 2)
    u1 = 1.0 - (hi.to(torch.float64) * 67108864.0 + lo.to(torch.float64)) * (
        1.0 / 9007199254740992.0)
    # the angle's word as an unsigned value, from two masked 16-bit halves (exact in float64)
    theta = (((w >> 16) & 0xFFFF).to(torch.float64) * 65536.0
             + (w & 0xFFFF).to(torch.float64)) * (_TWO_PI / 4294967296.0)
    r = torch.sqrt(-2.0 * torch.log(u1))
    return (r * torch.cos(theta)).to(dtype), (r * torch.sin(theta)).to(dtype)


def _pair_range(key: Tensor, start: int, length: int, dtype: torch.dtype) -> Tensor:
    """Return elements ``[start, start + length)`` of the flat draw from the pairs covering them
    (each pair's two outputs computed once), a ``(length,)`` tensor."""
    if length == 0:
        return torch.zeros(0, dtype=dtype, device=key.device)
    first, end = start >> 1, (start + length + 1) >> 1
    p = torch.arange(first, end, dtype=torch.int32, device=key.device)
    c, s = _pairs(key, p, dtype)
    flat = torch.stack([c, s], dim=1).reshape(-1)
    return flat[start & 1:(start & 1) + length]


def normal(key: Tensor, shape: tuple[int, ...] | torch.Size,
           dtype: torch.dtype = torch.float32) -> Tensor:
    """Return standard normal samples of the given shape and dtype (Box-Muller in float64).

    Element ``2p`` of the flat draw is the cosine and element ``2p + 1`` the sine output of
    Box-Muller pair ``p``, whose words sit at counters ``3p``, ``3p + 1`` and ``3p + 2``
    (a 53-bit radius uniform from two words, a 32-bit angle): 1.5 hashed words, one ``log``,
    ``sqrt``, ``cos`` and ``sin`` per two normals. The values are computed in float64 and
    rounded once to ``dtype``. The draw of ``n`` elements is the first ``n`` of any longer
    draw under the same key. At most ``2 * (2**32 // 3)`` elements per key.

    Example:
        >>> z = normal(key_from_seed(0), (10000,), torch.float64)
        >>> abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1) < 0.05
        True
    """
    n = math.prod(shape)
    _check_pairs("normal", (n + 1) // 2)
    return _pair_range(key, 0, n, dtype).reshape(shape)


def normal_slice(key: Tensor, n: int, start: int, length: int,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    """Return ``normal(key, (n,), dtype)[start:start + length]`` without drawing the rest.

    A ``(length,)`` tensor, bit-identical to that slice: element ``j`` of the flat draw is the
    cosine (even ``j``) or sine (odd ``j``) output of Box-Muller pair ``j // 2`` (see
    :func:`normal`), so each rank of a sharded step can draw exactly its own part of one global
    noise vector, computing each pair it touches once (one extra pair at an odd end).

    Example:
        >>> k = key_from_seed(3)
        >>> torch.equal(normal_slice(k, 11, 3, 5), normal(k, (11,))[3:8])
        True
    """
    if start < 0 or length < 0 or (length and start + length > n):
        raise ValueError(f"normal_slice(n={n}, start={start}, length={length}): expected "
                         f"start >= 0, length >= 0 and start + length <= n (any start for length 0)")
    _check_pairs("normal_slice", (n + 1) // 2)
    return _pair_range(key, start, length, dtype)


def _normal_ranges(key: Tensor, n: int, ranges: list[tuple[int, int]],
                   dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """Return ``[normal(key, (n,), dtype)[s:s + l] for (s, l) in ranges]`` in one pass.

    The pairs covering every range are hashed together (one pass of the elementwise ops for
    all ranges, each pair's two outputs computed once); each result is a view of that pass."""
    _check_pairs("_normal_ranges", (n + 1) // 2)
    spans = [(s >> 1, (s + ln + 1) >> 1) if ln else (0, 0) for s, ln in ranges]
    if any(s < 0 or ln < 0 or s + ln > n for s, ln in ranges):
        raise ValueError(f"_normal_ranges(n={n}, ranges={ranges}): expected each start >= 0, "
                         f"length >= 0 and start + length <= n")
    # (no host-to-device copy of a position table: that would block the host on CUDA)
    parts = [torch.arange(a, b, dtype=torch.int32, device=key.device) for a, b in spans if b > a]
    if not parts:
        return [torch.zeros(0, dtype=dtype, device=key.device) for _ in ranges]
    p = parts[0] if len(parts) == 1 else torch.cat(parts)
    c, s = _pairs(key, p, dtype)
    flat = torch.stack([c, s], dim=1).reshape(-1)
    out, offset = [], 0
    for (start, length), (a, b) in zip(ranges, spans, strict=True):
        lo = 2 * offset + (start & 1)
        out.append(flat[lo:lo + length])
        offset += b - a
    return out


def _normal_at(key: Tensor, n: int, j: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Return ``normal(key, (n,), dtype)[j]`` for int64 positions ``j`` (any shape, each in
    ``[0, n)``) without drawing the rest, elementwise (each element hashes its whole pair;
    :func:`_normal_ranges` shares pairs across contiguous ranges)."""
    _check_pairs("_normal_at", (n + 1) // 2)
    c, s = _pairs(key, (j >> 1).to(torch.int32), dtype)
    return torch.where((j & 1) == 1, s, c)
