"""The fused ghost Gram-norm kernel (torchfn/ops/_gram_triton.py) against float64.

On the CPU: it declines (returns None) wherever it does not apply, and -- when Triton is
installed -- its arithmetic runs in Triton's interpreter against float64. On CUDA (``-m gpu``):
bf16/fp16 inputs of awkward shapes and strides, with and without the bias term, eager,
compiled and vmapped, and inside ghost norms of a model against an autograd loop.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import Tensor, nn

from torchfn.ops import _gram_triton
from torchfn.persample import make_ghost_model

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device here")
needs_triton_op = pytest.mark.skipif(
    not CUDA or not _gram_triton.ensure_gram_op_registered(),
    reason="needs CUDA, Triton and torch >= 2.11 (the op registered)")


def reference64(a: Tensor, g: Tensor, bias: bool) -> Tensor:
    a, g = a.double(), g.double()
    out = ((a @ a.mT) * (g @ g.mT)).sum((1, 2))
    return out + g.sum(1).square().sum(1) if bias else out


def _record_kernel_use(monkeypatch) -> list[bool]:
    """Patch the ghost linear rule's call of the kernel to record, per call, whether the
    kernel ran (True) or declined (False); return the record."""
    import torchfn.persample._ghost_layers as layers

    used: list[bool] = []

    def recording(a: Tensor, g: Tensor, bias: bool = False) -> Tensor | None:
        out = _gram_triton.fused_gram_norms_sq(a, g, bias)
        used.append(out is not None)
        return out

    monkeypatch.setattr(layers, "fused_gram_norms_sq", recording)
    return used


def test_declines_where_it_does_not_apply(monkeypatch) -> None:
    a, g = torch.randn(2, 5, 3), torch.randn(2, 5, 4)
    assert _gram_triton.fused_gram_norms_sq(a, g) is None  # CPU
    assert _gram_triton.fused_gram_norms_sq(a.half(), g.half()) is None  # CPU half
    if CUDA:
        c = dict(device="cuda", dtype=torch.bfloat16)
        assert _gram_triton.fused_gram_norms_sq(torch.ones(2, 3, **c), torch.ones(2, 4, **c)) \
            is None  # 2-D: the closed form elsewhere
        assert _gram_triton.fused_gram_norms_sq(a.cuda(), g.cuda()) is None  # float32
        assert _gram_triton.fused_gram_norms_sq(torch.ones(2, 0, 3, **c),
                                                torch.ones(2, 0, 4, **c)) is None  # empty
        wide = torch.ones(2, 3, _gram_triton.MAX_WIDTH, **c)
        assert _gram_triton.fused_gram_norms_sq(wide, torch.ones(2, 3, 1, **c)) is None
        wide = torch.ones(32, 256, _gram_triton.MAX_WIDTH, **c)  # 128-wide tiles: a wave
        assert _gram_triton.fused_gram_norms_sq(wide, torch.ones(32, 256, 1, **c)) is not None
        ar = a.to(**c).requires_grad_()
        assert _gram_triton.fused_gram_norms_sq(ar, g.to(**c)) is None  # autograd records
        monkeypatch.setenv("TORCHFN_OPS", "reference")
        assert _gram_triton.fused_gram_norms_sq(a.to(**c), g.to(**c)) is None


def test_config_fits_short_sequences() -> None:
    config = _gram_triton.gram_norms_config
    assert [config(b, t)["BT"] for b, t in [(8, 16), (8, 256), (32, 256), (32, 197), (2, 64)]] \
        == [32, 64, 128, 128, 64]


def _triton_version() -> tuple[int, ...] | None:
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())


@pytest.mark.skipif(_triton_version() is None,
                    reason="Triton is not installed (CPU-only torch); the GPU tests cover it")
@pytest.mark.skipif((_triton_version() or (99,)) < (3, 9), reason="Triton < 3.9's interpreter "
                    "cannot run a loop whose bound is a program-dependent value (TypeError: only "
                    "0-dimensional arrays ...); compiled, it can: the GPU tests cover it")
def test_kernel_arithmetic_in_the_triton_interpreter() -> None:
    """The kernel's tiles, masks, symmetry weights and bias term, run by Triton's interpreter
    on the CPU (float16 and float32: the interpreter has no bfloat16), against float64."""
    code = textwrap.dedent("""
        import torch
        from torchfn.ops import _gram_triton as m
        torch.manual_seed(0)
        cases = [(2, 40, 24, 72, 32, torch.float32, False, False),
                 (3, 70, 100, 36, 64, torch.float32, True, True),
                 (1, 197, 64, 64, 64, torch.float16, True, False),
                 (2, 9, 5, 7, 32, torch.float16, False, True),
                 (5, 12, 8, 8, 32, torch.float32, True, False)]
        m._MAX_GRID_Z = 2  # more than 2 samples: several launches (5 -> 2, 2 and 1)
        for b, t, da, dg, bt, dtype, bias, strided in cases:
            a, g = torch.randn(b, t, da).to(dtype), torch.randn(b, t, dg).to(dtype)
            if strided:
                a = a.transpose(0, 1).contiguous().transpose(0, 1)
            cfg = {"BT": bt, "BK": 32, "num_warps": 4, "num_stages": 2}
            out = m._launch(a, g, bias, cfg, m._direct)
            a64, g64 = a.double(), g.double()
            ref = ((a64 @ a64.mT) * (g64 @ g64.mT)).sum((1, 2))
            if bias:
                ref = ref + g64.sum(1).square().sum(1)
            err = ((out.double() - ref).abs() / ref.abs()).max().item()
            assert out.dtype == torch.float32 and out.shape == (b,), (out.dtype, out.shape)
            assert err < 1e-5, (b, t, da, dg, dtype, bias, err)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@needs_triton_op
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(3, 197, 100, 36), (8, 256, 768, 2304), (2, 5, 64, 48),
                                   (4, 33, 3072, 768)])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_equals_float64(dtype, shape, bias) -> None:
    b, t, d_in, d_out = shape
    gen = torch.Generator("cuda").manual_seed(1)
    a = torch.randn(t, b, d_in, device="cuda", generator=gen).to(dtype).transpose(0, 1)
    g = torch.randn(b, t, d_out, device="cuda", generator=gen).to(dtype)
    out = _gram_triton.fused_gram_norms_sq(a, g, bias)
    assert out is not None and out.dtype == torch.float32 and out.shape == (b,)
    torch.testing.assert_close(out.double(), reference64(a, g, bias), rtol=2e-5, atol=0)


@pytest.mark.gpu
@needs_triton_op
def test_cuda_more_samples_than_one_grid_takes(monkeypatch) -> None:
    monkeypatch.setattr(_gram_triton, "_MAX_GRID_Z", 3)  # 7 samples: launches of 3, 3, 1
    gen = torch.Generator("cuda").manual_seed(5)
    a = torch.randn(7, 40, 24, device="cuda", generator=gen).half()
    g = torch.randn(7, 40, 16, device="cuda", generator=gen).half()
    out = _gram_triton.fused_gram_norms_sq(a, g, True)
    torch.testing.assert_close(out.double(), reference64(a, g, True), rtol=2e-5, atol=0)


@pytest.mark.gpu
@needs_triton_op
def test_cuda_compiled_and_vmapped_equal_eager() -> None:
    gen = torch.Generator("cuda").manual_seed(2)
    a = torch.randn(3, 4, 70, 96, device="cuda", generator=gen).bfloat16()
    g = torch.randn(3, 4, 70, 40, device="cuda", generator=gen).bfloat16()
    eager = torch.stack([_gram_triton.fused_gram_norms_sq(a[i], g[i], True) for i in range(3)])
    compiled = torch.compile(_gram_triton.fused_gram_norms_sq, fullgraph=True)
    torch.testing.assert_close(torch.stack([compiled(a[i], g[i], True) for i in range(3)]),
                               eager, rtol=1e-6, atol=0)
    vmapped = torch.func.vmap(lambda x, y: _gram_triton.fused_gram_norms_sq(x, y, True))(a, g)
    torch.testing.assert_close(vmapped, eager, rtol=1e-6, atol=0)
    torch.testing.assert_close(eager.double(), torch.stack(
        [reference64(a[i], g[i], True) for i in range(3)]), rtol=2e-5, atol=0)


@pytest.mark.gpu
@needs_triton_op
def test_cuda_ghost_norms_use_the_kernel_and_match_a_loop(monkeypatch) -> None:
    """A bf16 sequence model's ghost norms go through the kernel and equal a per-sample
    autograd loop (norms in float64 of the loop's bf16 gradients)."""
    calls = _record_kernel_use(monkeypatch)
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 40, bias=False))
    net = net.to("cuda", torch.bfloat16)
    ghost, params, buffers = make_ghost_model(net)
    x = torch.randn(6, 20, 48, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(6, 20, 40, device="cuda", dtype=torch.bfloat16)

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        return ((out.float() - target.float()) ** 2).flatten(1).sum(1)

    norms = ghost.per_sample(params, buffers, x, y, loss_fn).grads.sq_norms()
    assert calls == [True, True]
    ref = []
    for i in range(x.shape[0]):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = loss_fn(ghost(p, buffers, x[i:i + 1])[0], y[i:i + 1]).sum()
        ref.append(sum(gr.double().square().sum() for gr in torch.autograd.grad(
            loss, list(p.values()))))
    torch.testing.assert_close(norms.double(), torch.stack(ref), rtol=3e-2, atol=0)


@pytest.mark.gpu
@needs_triton_op
def test_cuda_compiled_ghost_norms_equal_eager() -> None:
    """Ghost norms of a bf16 sequence model compiled (the kernel inside the graph, first
    call under compile) equal the eager ones up to bf16 rounding of the activations."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 32)).to("cuda").bfloat16()
    ghost, params, buffers = make_ghost_model(net)
    x = torch.randn(8, 40, 64, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8, 40, 32, device="cuda", dtype=torch.bfloat16)

    def norms(p, b, x, y):
        loss = lambda out, t: ((out.float() - t.float()) ** 2).flatten(1).sum(1)  # noqa: E731
        return ghost.per_sample(p, b, x, y, loss).grads.sq_norms()

    compiled = torch.compile(norms)(params, buffers, x, y)
    # not bitwise: Inductor keeps the fused tanh and loss in float32 where eager rounds the
    # bf16 activations and gradients between ops (2.6e-4 apart on an H200)
    torch.testing.assert_close(compiled, norms(params, buffers, x, y), rtol=2e-3, atol=0)


@pytest.mark.gpu
@needs_triton_op
@pytest.mark.parametrize("name", ["gpt2", "vit_hf", "bert", "tfm_encoder", "timm_vit"])
def test_cuda_zoo_bf16_norms_with_the_kernel_equal_the_plain_form(name, monkeypatch) -> None:
    """Models we did not write (HF GPT-2 / ViT / BERT, torch's TransformerEncoder, a timm-style
    ViT) in bfloat16 on CUDA: ghost norms through the kernel equal those of the plain Gram form
    (``TORCHFN_OPS=reference``), up to the plain form's bf16 rounding of its Gram entries."""
    from torchfn.persample import ghost_grad_norms

    zoo = pytest.importorskip("zoo")
    for pkg in zoo.NEEDS.get(name, ()):
        pytest.importorskip(pkg)
    entry = zoo.build(name, dtype=torch.bfloat16, device="cuda")
    x, y = entry.batch(4, 0)
    ghost, params, buffers = make_ghost_model(entry.module)
    used = _record_kernel_use(monkeypatch)

    def norms() -> Tensor:
        return ghost_grad_norms(ghost, entry.loss_fn)(params, buffers, x, y).double()

    fused = norms()
    assert any(used), f"{name}: no layer took the kernel"
    monkeypatch.setenv("TORCHFN_OPS", "reference")
    used.clear()
    plain = norms()
    assert not any(used)
    torch.testing.assert_close(fused, plain, rtol=2e-2, atol=0)
