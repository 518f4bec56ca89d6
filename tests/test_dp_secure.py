"""Secure DP-SGD noise: ChaCha20 == RFC 8439's test vectors bit for bit, the normals are
standard, and a DP step with ``secure_noise=True`` is the textbook update with that noise,
eager and compiled (fullgraph, no recompiles), with a key from the OS that no seed gives."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model
from torchfn.persample._dp_secure import (
    chacha20_block,
    next_secure_key,
    secure_key,
    secure_normal,
    words_from_bytes,
)

F64 = torch.float64
RFC_KEY = torch.tensor(words_from_bytes(bytes(range(32))))

# RFC 8439 2.3.2: the state at the end of the ChaCha20 block function (key 00..1f,
# nonce 00:00:00:09:00:00:00:4a:00:00:00:00, block count 1)
BLOCK_232 = [
    0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3, 0xC7F4D1C7, 0x0368C033, 0x9AAA2204, 0x4E6CD4C3,
    0x466482D2, 0x09AA9F07, 0x05D7C214, 0xA2028BD9, 0xD19C12B5, 0xB94E16DE, 0xE883D0CB, 0x4E3C50A2,
]
# RFC 8439 2.4.2: the sunscreen plaintext and its ciphertext (key 00..1f,
# nonce 00:00:00:00:00:00:00:4a:00:00:00:00, initial counter 1)
PLAIN_242 = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for "
             b"the future, sunscreen would be it.")
CIPHER_242 = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
    "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
    "5af90bbf74a35be6b40b8eedf2785e42874d")
# RFC 8439 A.1 test vector 1: all-zero key and nonce, block count 0
BLOCK_A1 = [
    0xADE0B876, 0x903DF1A0, 0xE56A5D40, 0x28BD8653, 0xB819D2BD, 0x1AED8DA0, 0xCCEF36A8, 0xC70D778B,
    0x7C5941DA, 0x8D485751, 0x3FE02477, 0x374AD8B8, 0xF4B8436A, 0x1CA11815, 0x69B687C3, 0x8665EEB2,
]


def _bytes(words: Tensor) -> bytes:
    return b"".join(int(w).to_bytes(4, "little") for w in words.flatten())


def test_chacha20_block_matches_rfc8439_2_3_2_and_a_1() -> None:
    nonce = words_from_bytes(bytes.fromhex("000000090000004a00000000"))
    out = chacha20_block(RFC_KEY, torch.tensor([1]), tuple(nonce))
    assert out.shape == (1, 16) and out.dtype == torch.int64
    assert out[0].tolist() == BLOCK_232
    zero = chacha20_block(torch.zeros(8, dtype=torch.int64), torch.tensor([0]), (0, 0, 0))
    assert zero[0].tolist() == BLOCK_A1


def test_chacha20_keystream_encrypts_rfc8439_2_4_2() -> None:
    nonce = torch.tensor(words_from_bytes(bytes.fromhex("000000000000004a00000000")))
    blocks = chacha20_block(RFC_KEY, torch.tensor([1, 2]), nonce)  # a tensor nonce this time
    stream = _bytes(blocks)[: len(PLAIN_242)]
    assert bytes(p ^ s for p, s in zip(PLAIN_242, stream, strict=True)) == CIPHER_242


def test_secure_normal_is_standard_normal_on_a_million_draws() -> None:
    key = torch.tensor(words_from_bytes(bytes(range(100, 132))))  # fixed key: deterministic
    n = 1_000_000
    z = secure_normal(key, n, step=3)
    assert z.shape == (n,) and z.dtype == F64 and bool(torch.isfinite(z).all())
    assert torch.equal(z, secure_normal(key, n, step=3))  # a function of (key, n, step)
    # standard errors: mean 1e-3, variance sqrt(2 / n) = 1.4e-3; tolerances about 5 of them
    assert abs(float(z.mean())) < 5e-3
    assert abs(float(z.var()) - 1.0) < 7e-3
    assert abs(float((z**4).mean()) - 3.0) < 0.05  # Gaussian kurtosis (std err about 0.01)
    assert abs(float((z.abs() < 1.959964).double().mean()) - 0.95) < 2e-3
    # the eager chunking (n above 2**18 here) continues the same counters as one pass
    assert torch.equal(z[:1001], secure_normal(key, 1001, step=3))
    assert not torch.equal(z[:1000], secure_normal(key, 1000, step=4))


def test_keys_come_from_the_os_and_the_ratchet_moves_forward() -> None:
    a, b = secure_key(), secure_key()
    assert a.shape == (8,) and not torch.equal(a, b)
    nxt = next_secure_key(a, torch.tensor(0))
    assert torch.equal(nxt, next_secure_key(a, 0)) and not torch.equal(nxt, a)
    assert not torch.equal(next_secure_key(a, 1), nxt)
    with pytest.raises(ValueError, match=r"secure_normal\(key, \.\.\.\): expected a ChaCha20 "
                                         r"key, an int64 tensor of shape \(8,\).*got \(2,\)"):
        secure_normal(torch.zeros(2, dtype=torch.int64), 4)


# -- the DP step with secure noise -------------------------------------------------------------

def xent(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _setup(secure: bool = True):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(F64)
    ghost, params, buffers = make_ghost_model(net)
    opt = torchopt.sgd(0.5)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.3, max_grad_norm=0.7,
                              sample_rate=0.25, dataset_size=40, secure_noise=secure)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 5, dtype=F64, generator=g), torch.randint(0, 3, (10,), generator=g)
    valid = torch.arange(10) % 3 != 1
    return ghost, params, buffers, opt, step, (x, y), valid


def test_secure_step_is_the_textbook_update_with_chacha_noise() -> None:
    _, params, buffers, opt, step, batch, valid = _setup()
    state = init_dp_state(params, buffers, opt, secure_noise=True)
    assert state.key.shape == (8,)
    total = step.clipped_sum(state, batch, valid)
    new, _ = step(state, batch, valid)
    z = secure_normal(state.key, sum(p.numel() for p in params.values()), 0)
    offset = 0
    for k, p in params.items():
        noise = z[offset:offset + p.numel()].reshape(p.shape)
        offset += p.numel()
        expect = p - 0.5 * (total.grads[k] + step.noise_std * noise) / (0.25 * 40)
        torch.testing.assert_close(new.params[k], expect, rtol=1e-12, atol=1e-12, msg=k)
    assert torch.equal(new.key, next_secure_key(state.key, 0)) and int(new.step) == 1
    # the same state gives the same step (pure); a fresh state (new OS key) other noise
    again, _ = step(state, batch, valid)
    other, _ = step(init_dp_state(params, buffers, opt, secure_noise=True), batch, valid)
    for k in params:
        assert torch.equal(again.params[k], new.params[k])
        assert not torch.equal(other.params[k], new.params[k])


def test_secure_step_compiled_fullgraph_equals_eager_without_recompiles() -> None:
    _, params, buffers, opt, step, batch, valid = _setup()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager = comp = init_dp_state(params, buffers, opt, secure_noise=True)
    for _ in range(2):
        eager, m_e = step(eager, batch, valid)
        comp, m_c = compiled(comp, batch, valid)
        for k in params:
            torch.testing.assert_close(comp.params[k], eager.params[k], rtol=1e-12, atol=1e-13)
            assert torch.equal(comp.key, eager.key)  # the ChaCha20 ratchet, bitwise
    assert counter.frame_count == 1
    assert float(m_c["loss"]) == pytest.approx(float(m_e["loss"]), rel=1e-12)


def test_secure_noise_refuses_a_seed_and_mismatched_states() -> None:
    _, params, buffers, opt, step, batch, valid = _setup()
    with pytest.raises(ValueError, match=r"init_dp_state\(seed=3, secure_noise=True\): a secure "
                                         r"noise key comes from the OS CSPRNG, never from a seed"):
        init_dp_state(params, buffers, opt, seed=3, secure_noise=True)
    with pytest.raises(ValueError, match=r"init_dp_state\(seed=None\): pass seed="):
        init_dp_state(params, buffers, opt)
    with pytest.raises(ValueError, match=r"state.key must have shape \(8,\), got \(2,\); build "
                                         r"the state with init_dp_state\(\.\.\., "
                                         r"secure_noise=True\)"):
        step(init_dp_state(params, buffers, opt, seed=0), batch, valid)
    plain = _setup(secure=False)[4]
    with pytest.raises(ValueError, match=r"state.key must have shape \(2,\), got \(8,\)"):
        plain(init_dp_state(params, buffers, opt, secure_noise=True), batch, valid)
    with pytest.raises(TypeError, match=r"make_dp_train_step\(secure_noise=\.\.\.\): expected "
                                        r"True or False, got 'yes'"):
        make_dp_train_step(_setup()[0], xent, opt, noise_multiplier=1.0, max_grad_norm=1.0,
                           sample_rate=0.1, dataset_size=10, secure_noise="yes")


def test_secure_noise_std_matches_sigma_c() -> None:
    """The noise alone (zero gradients) has std sigma * C / (q N) per coordinate."""
    _, params, buffers, opt, step, batch, _ = _setup()
    state = init_dp_state(params, buffers, opt, secure_noise=True)
    none = torch.zeros(10, dtype=torch.bool)
    deltas = []
    for _ in range(40):
        new, _ = step(state, batch, none)
        deltas.append(torch.cat([(new.params[k] - state.params[k]).flatten() for k in params]))
        state = new._replace(params=state.params)
    d = torch.cat(deltas) / -0.5  # the noisy mean gradient
    expected = 1.3 * 0.7 / (0.25 * 40)
    assert float(d.std()) == pytest.approx(expected, rel=0.06)  # 1,240 draws: se about 2 %
    assert math.isfinite(float(d.mean())) and abs(float(d.mean())) < 0.15 * expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_chacha20_and_secure_normal_equal_the_cpu() -> None:
    key = secure_key()
    counter = torch.arange(300, dtype=torch.int64)
    cpu = chacha20_block(key, counter, (1, 2, 3))
    assert torch.equal(chacha20_block(key.cuda(), counter.cuda(), (1, 2, 3)).cpu(), cpu)
    compiled = torch.compile(secure_normal, fullgraph=True)
    z = compiled(key.cuda(), 4099, torch.tensor(5, device="cuda"))
    torch.testing.assert_close(z.cpu(), secure_normal(key, 4099, 5), rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_secure_step_compiled_equals_eager_and_the_cpu_noise() -> None:
    *_, opt, _, batch, valid = _setup()
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(F64).cuda()
    ghost, params, buffers = make_ghost_model(net)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.3, max_grad_norm=0.7,
                              sample_rate=0.25, dataset_size=40, secure_noise=True)
    state = init_dp_state(params, buffers, opt, secure_noise=True)
    batch = tuple(t.cuda() for t in batch)
    eager, _ = step(state, batch, valid.cuda())
    compiled, _ = step.compile()(state, batch, valid.cuda())
    for k in params:
        torch.testing.assert_close(compiled.params[k], eager.params[k], rtol=1e-12, atol=1e-13)
    assert torch.equal(compiled.key, eager.key)
    assert torch.equal(eager.key.cpu(), next_secure_key(state.key.cpu(), 0))


def test_secure_noise_with_adaptive_clipping_draws_the_count_from_its_own_stream() -> None:
    """Adaptive clipping's noisy count under a secure key: ChaCha20 stream 2 of the step
    (never the seeded hash, never the gradient noise's stream 0)."""
    from torchfn.persample import AdaptiveClipping

    ghost, params, buffers, opt, _, batch, valid = _setup()
    adaptive = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2,
                                count_noise_multiplier=5.0)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=1.3, max_grad_norm=0.7,
                              sample_rate=0.25, dataset_size=40, secure_noise=True,
                              adaptive_clipping=adaptive)
    state = init_dp_state(params, buffers, opt, secure_noise=True, max_grad_norm=0.7)
    new, metrics = step(state, batch, valid)
    total = step.clipped_sum(state, batch, valid)
    unclipped = float(total.count - total.clipped)
    z = float(secure_normal(state.key, 1, state.step, stream=2)[0])
    b = (unclipped - float(total.count) / 2 + 5.0 * z) / 10.0 + 0.5  # qN = 10
    assert float(metrics["unclipped_fraction"]) == pytest.approx(b, rel=1e-12)
    assert float(new.clip_norm) == pytest.approx(0.7 * math.exp(-0.2 * (b - 0.5)), rel=1e-12)
    assert not torch.equal(secure_normal(state.key, 1, state.step, stream=2),
                           secure_normal(state.key, 1, state.step)[:1])
    with pytest.raises(ValueError, match=r"secure_normal\(stream=...\): expected 0 .* or 2"):
        secure_normal(state.key, 1, state.step, stream=1)
