"""Cryptographically secure Gaussian noise for DP-SGD: ChaCha20 in torch integer ops.

The default DP-SGD noise (:mod:`torchfn.persample._dp_random`) is a fast hash of
``(seed, step, counter)``: statistically strong, but whoever learns or guesses the seed
can regenerate the noise and subtract it. ``make_dp_train_step(..., secure_noise=True)``
draws it from this module instead (like Opacus' ``secure_mode``):

- **Generator.** The ChaCha20 block function of RFC 8439 (section 2.3), written with
  int64 tensors holding 32-bit words (additions masked with ``2**32 - 1``, rotations as two
  shifts), vectorised over block counters. It runs wherever torch runs (CPU, CUDA) and
  under ``torch.compile(fullgraph=True)``, where Inductor fuses the 20 rounds into one
  kernel; eagerly it works through ``2**17`` blocks at a time (``2**20`` on CUDA) to bound
  memory. The tests
  check it against RFC 8439's test vectors bit for bit.
- **Key.** 256 bits from the operating system's CSPRNG (``secrets.token_bytes(32)``), drawn
  by :func:`secure_key` (``init_dp_state(..., secure_noise=True)``); it is never derived from
  a seed. It lives in the DP state (``state.key``, int64 ``(8,)``), so the step stays a pure,
  compile-friendly function of the state, eager and compiled give the same noise, all ranks
  of a distributed run add the same noise (broadcast the key from one rank), and a run
  resumed from a checkpoint continues exactly. The price: **the state and every checkpoint
  of it hold a secret** -- whoever reads ``state.key`` at step ``t`` can regenerate the noise
  of steps ``t, t + 1, ...`` and strip it from the later updates. Publish parameters, never
  the state; store checkpoints like private data.
  Fresh OS entropy for every step instead is one line in the host loop,
  ``state = state._replace(key=secure_key(device))`` before each step (the public
  :func:`torchfn.persample.secure_key`): then a leaked state reveals no future noise either,
  but the noise is no longer a function of the state, so a resumed run does not repeat it
  (and every rank of a distributed run needs the new key broadcast).
- **Forward secrecy.** Each step replaces the key by a ChaCha20 block of itself
  (:func:`next_secure_key`, nonce domain 1), a one-way ratchet: the key of step ``t`` does
  not reveal the keys (so the noise) of steps before ``t``. The noise of step ``t`` uses
  nonce ``(step mod 2**32, step // 2**32, 0)`` and block counters ``0, 1, ...``.
- **Normals.** Per pair of normals, Box-Muller in float64 on two 53-bit uniforms (two
  32-bit words each): ``u1`` in ``(0, 1]``, so the radius reaches ``sqrt(2 ln 2**53)``,
  about 8.57 standard deviations, and a 53-bit angle. Each output is the sum of four such
  normals divided by 2 (Holohan and Braghin 2021, "Secure Random Sampling in Differential
  Privacy"; Opacus' ``secure_mode`` does the same): 8 ChaCha20 words, half a block, per
  output.

What this protects and what it does not:

- Protected: prediction of the noise from the seed, from other runs or from earlier
  outputs (ChaCha20 is a cryptographic PRF; the key is fresh OS entropy per
  :func:`secure_key` call); recovery of past noise from a later state (the ratchet).
- Mitigated, not proven: Mironov's floating-point attack (2012, "On significance of the
  least significant bits for differential privacy"): a float sampler cannot reach every
  float and its gaps shift with the data. The 53-bit uniforms, the sum of four normals and
  the addition done in float64 (rounded once to the parameter dtype by the DP step) make
  the reachable set dense and hard to exploit, as in Opacus; there is no snapping or
  discrete Gaussian, so no formal guarantee of DP under floating point.
- Not protected: the Poisson sampling of the batches (still the counter-based generator of
  :class:`PoissonSampler` from its seed: keep that seed secret), a leaked state or
  checkpoint (above), timing and other side channels of the device, the randomness of the
  model itself (dropout, ...).
"""

from __future__ import annotations

import math
import secrets

import torch
from torch import Tensor

__all__ = ["chacha20_block", "next_secure_key", "secure_key", "secure_normal",
           "words_from_bytes"]

_M32 = 0xFFFFFFFF
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
_TWO_PI = 2.0 * math.pi
_EAGER_BLOCKS = {"cpu": 1 << 17, "cuda": 1 << 20}  # blocks per eager chunk (CPU: ~140 MB)
_NOISE_DOMAIN, _RATCHET_DOMAIN, _COUNT_DOMAIN = 0, 1, 2
_MAX_BLOCKS = 1 << 32  # RFC 8439: a 32-bit block counter per (key, nonce)


def words_from_bytes(data: bytes) -> list[int]:
    """Return the little-endian 32-bit words of ``data`` (length a multiple of 4), RFC 8439 style.

    Example:
        >>> [hex(w) for w in words_from_bytes(bytes(range(8)))]
        ['0x3020100', '0x7060504']
    """
    if len(data) % 4:
        raise ValueError(f"words_from_bytes: expected a multiple of 4 bytes, got {len(data)}")
    return [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]


def secure_key(device: torch.device | str | None = None) -> Tensor:
    """Return a fresh 256-bit ChaCha20 key from the OS CSPRNG: int64 ``(8,)``, words in ``[0, 2**32)``.

    ``secrets.token_bytes(32)``; every call gives a new key, and nothing (no seed) can
    reproduce it.

    Example:
        >>> k = secure_key()
        >>> k.shape, k.dtype, bool((k >= 0).all() and (k < 2**32).all())
        (torch.Size([8]), torch.int64, True)
    """
    return torch.tensor(words_from_bytes(secrets.token_bytes(32)), dtype=torch.int64,
                        device=device)


def _rotl(x: Tensor, r: int) -> Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _quarter(s: list[Tensor], a: int, b: int, c: int, d: int) -> None:
    """The ChaCha quarter round on words ``a, b, c, d`` of ``s`` (RFC 8439, 2.1), in place."""
    s[a] = (s[a] + s[b]) & _M32
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & _M32
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & _M32
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & _M32
    s[b] = _rotl(s[b] ^ s[c], 7)


@torch.compiler.nested_compile_region
def _double_round(*words: Tensor) -> tuple[Tensor, ...]:
    """A column round and a diagonal round on the 16 words, each ``(n,)`` int64.

    A nested compile region: ``torch.compile`` traces and compiles it once and calls it ten
    times, instead of unrolling all 20 rounds into one graph (several times the compile time
    for about the same speed).
    """
    s = list(words)
    _quarter(s, 0, 4, 8, 12)
    _quarter(s, 1, 5, 9, 13)
    _quarter(s, 2, 6, 10, 14)
    _quarter(s, 3, 7, 11, 15)
    _quarter(s, 0, 5, 10, 15)
    _quarter(s, 1, 6, 11, 12)
    _quarter(s, 2, 7, 8, 13)
    _quarter(s, 3, 4, 9, 14)
    return tuple(s)


def _check_key(key: Tensor, where: str) -> None:
    if not isinstance(key, Tensor) or key.shape != (8,) or key.dtype != torch.int64:
        seen = (f"{tuple(key.shape)} {key.dtype}" if isinstance(key, Tensor)
                else type(key).__name__)
        raise ValueError(f"{where}: expected a ChaCha20 key, an int64 tensor of shape (8,) "
                         f"(secure_key(), init_dp_state(..., secure_noise=True)), got {seen}")


def chacha20_block(key: Tensor, counter: Tensor, nonce: Tensor | tuple[int, int, int]) -> Tensor:
    """Return the ChaCha20 blocks (RFC 8439, 2.3) for each counter: int64 ``(n, 16)`` words.

    ``key``: int64 ``(8,)`` words (the 32 key bytes read little-endian); ``counter``: int64
    ``(n,)`` block counters in ``[0, 2**32)``; ``nonce``: three 32-bit words (int64 ``(3,)``
    or ints). Row ``i`` is the serialised keystream block ``counter[i]`` as 16 little-endian
    words in ``[0, 2**32)``. Pure tensor ops: CPU, CUDA, ``torch.compile(fullgraph=True)``.

    Example (RFC 8439, 2.3.2):
        >>> key = torch.tensor(words_from_bytes(bytes(range(32))))
        >>> nonce = words_from_bytes(bytes.fromhex("000000090000004a00000000"))
        >>> hex(int(chacha20_block(key, torch.tensor([1]), tuple(nonce))[0, 0]))
        '0xe4e7f110'
    """
    _check_key(key, "chacha20_block(key, ...)")
    n = counter.shape[0]
    if isinstance(nonce, Tensor):
        nonce_t = nonce.to(device=key.device, dtype=torch.int64) & _M32
    else:
        nonce_t = torch.tensor([int(w) & _M32 for w in nonce], dtype=torch.int64,
                               device=key.device)
    head = torch.cat([torch.tensor(_SIGMA, dtype=torch.int64, device=key.device), key,
                      torch.zeros(1, dtype=torch.int64, device=key.device), nonce_t])
    # the initial state, one (n,) tensor per word (materialised: the region's inputs must
    # not alias each other)
    init = [counter & _M32 if i == 12 else head[i].expand(n).clone() for i in range(16)]
    s = tuple(init)
    for _ in range(10):  # 20 rounds
        s = _double_round(*s)
    return torch.stack([(x + x0) & _M32 for x, x0 in zip(s, init, strict=True)], dim=1)


def _step_nonce(step: Tensor | int, domain: int) -> tuple[Tensor, Tensor, Tensor] | tuple[int, ...]:
    if isinstance(step, Tensor):
        step = step.to(torch.int64)
        return (step & _M32, (step >> 32) & _M32, torch.full_like(step, domain))
    return (step & _M32, (step >> 32) & _M32, domain)


def next_secure_key(key: Tensor, step: Tensor | int = 0) -> Tensor:
    """Return the key after ``key`` (int64 ``(8,)``): words 0-7 of its ChaCha20 block 0 under
    nonce ``(step mod 2**32, step // 2**32, 1)`` -- a one-way ratchet.

    ``step`` (an int or an int64 0-d tensor, e.g. ``state.step``) keeps the ratchet of
    different steps apart.

    Example:
        >>> k = secure_key()
        >>> nk = next_secure_key(k, 0)
        >>> nk.shape, bool((nk != k).any())
        (torch.Size([8]), True)
    """
    _check_key(key, "next_secure_key(key, ...)")
    nonce = _step_nonce(step, _RATCHET_DOMAIN)
    if isinstance(step, Tensor):
        nonce = torch.stack(list(nonce))
    counter = torch.zeros(1, dtype=torch.int64, device=key.device)
    return chacha20_block(key, counter, nonce)[0, :8]


def _normals_of_blocks(words: Tensor) -> Tensor:
    """``(m, 16)`` ChaCha20 words -> ``(2 m,)`` float64 normals, each a sum of four / 2."""
    u = ((words[:, 0::2] >> 5) * 67108864 + (words[:, 1::2] >> 6)).to(torch.float64)
    u = u * (1.0 / 9007199254740992.0)  # (m, 8) 53-bit uniforms in [0, 1)
    r = torch.sqrt(-2.0 * torch.log(1.0 - u[:, 0::2]))  # u1 in (0, 1]
    angle = u[:, 1::2] * _TWO_PI
    z = torch.cat([r * torch.cos(angle), r * torch.sin(angle)], dim=1)  # (m, 8)
    return z.reshape(-1, 4).sum(dim=1) * 0.5


def secure_normal(key: Tensor, n: int, step: Tensor | int = 0, *, stream: int = 0) -> Tensor:
    """Return ``(n,)`` float64 standard normals from the ChaCha20 keystream of ``key``.

    Block counters ``0 .. ceil(n / 2) - 1`` under nonce ``(step mod 2**32, step // 2**32,
    stream)``; ``stream`` 0 is the gradient noise, 2 a second independent draw under the same
    key and step (adaptive clipping's noisy count); 1 is the key ratchet's, refused here; each output is ``(z1 + z2 + z3 + z4) / 2`` of four Box-Muller normals with 53-bit
    uniforms (see the module docstring for what this does and does not protect). A pure
    function of ``(key, n, step)``: the same numbers eager, compiled and on any device.

    Example:
        >>> z = secure_normal(secure_key(), 10000)
        >>> z.shape, z.dtype, abs(float(z.mean())) < 0.05, abs(float(z.std()) - 1) < 0.05
        (torch.Size([10000]), torch.float64, True, True)
    """
    _check_key(key, "secure_normal(key, ...)")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"secure_normal(n=...): expected an int >= 0, got {n!r}")
    blocks = (n + 1) // 2
    if blocks > _MAX_BLOCKS:
        raise ValueError(f"secure_normal(n={n}): at most 2**33 normals per key and step "
                         "(2**32 ChaCha20 blocks); noise fewer parameters per step")
    if stream not in (_NOISE_DOMAIN, _COUNT_DOMAIN):
        raise ValueError(f"secure_normal(stream=...): expected {_NOISE_DOMAIN} (gradient noise) "
                         f"or {_COUNT_DOMAIN} (a second draw), got {stream!r}")
    nonce = _step_nonce(step, stream)
    if isinstance(step, Tensor):
        nonce = torch.stack(list(nonce))
    chunk = _EAGER_BLOCKS.get(key.device.type, _EAGER_BLOCKS["cpu"])
    if torch.compiler.is_compiling() or blocks <= chunk:
        counter = torch.arange(blocks, dtype=torch.int64, device=key.device)
        return _normals_of_blocks(chacha20_block(key, counter, nonce))[:n]
    parts = []
    for start in range(0, blocks, chunk):
        counter = torch.arange(start, min(start + chunk, blocks), dtype=torch.int64,
                               device=key.device)
        parts.append(_normals_of_blocks(chacha20_block(key, counter, nonce)))
    return torch.cat(parts)[:n]
