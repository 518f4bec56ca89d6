"""Op 3 (``linear_grad_norms_sq``, ``clipped_linear_grad_sum`` and their bias counterparts).

kernel == twin == explicit per-sample gradients (a loop of ``torch.autograd.grad`` over samples
through an ``nn.Linear``), both 3-D paths (Gram and materialised), opcheck, gradcheck,
gradgradcheck, the transform matrix, forward mode, and input errors. CUDA variants skip where
no GPU is present.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from _op_matrix import DEVICES, DIFFS, MODES, TOLERANCES, OpLog
from _op_matrix import need_device as _need_device
from torch import Tensor

from torchfn import ops
from torchfn.ops import _dispatch, _ghost, reference

F64 = torch.float64
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
METHODS = ("gram", "materialize")


@pytest.fixture(autouse=True)
def _kernels_at_every_size():
    """Route every eager call to the kernels, whatever the default size rules say (restored
    after each test): these tests exist to exercise the kernels, on tiny inputs."""
    ops_devices = [(op, dev) for op in _ghost.DISPATCH_KEYS for dev in ("cpu", "cuda")]
    before = {key: _dispatch.get_rule(*key) for key in ops_devices}
    for key in ops_devices:
        _dispatch.set_rule(*key, min_numel=0, min_numel_grad=0)
    yield
    for key, rule in before.items():
        _dispatch.set_rule(*key, **dataclasses.asdict(rule))


def _runs_kernel(a: Tensor, g: Tensor, **kwargs: object) -> bool:
    """True when ops.linear_grad_norms_sq(a, g, ...) runs through the kernels' Function."""
    out = ops.linear_grad_norms_sq(a.detach().requires_grad_(True), g, **kwargs)
    return type(out.grad_fn).__name__.startswith("_NormsFn")


def _randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(shape, generator=gen, dtype=F64)


def _pair(batch: int, time: int | None, d_in: int, d_out: int, seed: int) -> tuple[Tensor, Tensor]:
    """Float64 ``(a, g)`` on the CPU with rows of norm about 1 (no float16 overflow)."""
    lead = (batch,) if time is None else (batch, time)
    a = _randn((*lead, d_in), seed, scale=max(d_in, 1) ** -0.5)
    g = _randn((*lead, d_out), seed + 1, scale=max(d_out, 1) ** -0.5)
    return a, g


def _assert_close(got: Tensor, want64: Tensor, dtype: torch.dtype, three_d: bool) -> None:
    """Assert ``got`` (in ``dtype``) equals the float64 ``want64`` within the dtype's tolerance.

    3-D half/bfloat16 results are contractions of Gram/product matrices that are rounded to
    the input dtype first (as torch's own bmm does), so their error is relative to the size of
    the terms, not of the (possibly cancelled) result: atol scales with the largest value.
    """
    assert got.dtype == dtype, f"dtype {got.dtype} != {dtype}"
    tol = dict(TOLERANCES[dtype])
    if three_d and dtype in (torch.float16, torch.bfloat16) and want64.numel():
        tol["atol"] = max(tol["atol"], 2 * tol["rtol"] * want64.abs().max().item())
    torch.testing.assert_close(got, want64.to(dtype), **tol)


# ---------------------------------------------------------------------------------------------
# The plain reference: per-sample gradients of an nn.Linear, one sample at a time


def _linear_problem(
    kind: str, bias: bool, device: str, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Return ``(x, g, grads_w, grads_b)``: the layer input, the output gradient of the summed
    loss, and every sample's weight/bias gradient from its own ``torch.autograd.grad`` call."""
    batch, time, d_in, d_out = 5, 4, 6, 3
    layer = torch.nn.Linear(d_in, d_out, bias=bias, dtype=F64)
    with torch.no_grad():
        layer.weight.copy_(_randn((d_out, d_in), seed))
        if bias:
            layer.bias.copy_(_randn((d_out,), seed + 1))
    layer = layer.to(device)
    lead = (batch,) if kind == "2d" else (batch, time)
    x = _randn((*lead, d_in), seed + 2).to(device)
    target = _randn((*lead, d_out), seed + 3).to(device)

    def sample_loss(y: Tensor, t: Tensor) -> Tensor:
        return (torch.tanh(y) * t).sum() + 0.5 * (y**2).sum()

    y = layer(x).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(sample_loss(y, target), y)  # the summed loss's output gradient
    params = [layer.weight] + ([layer.bias] if bias else [])
    grads_w, grads_b = [], []
    for i in range(batch):
        grads = torch.autograd.grad(sample_loss(layer(x[i]), target[i]), params)
        grads_w.append(grads[0])
        if bias:
            grads_b.append(grads[1])
    return x, g, torch.stack(grads_w), torch.stack(grads_b) if bias else None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kind", ["2d", "3d"])
def test_norms_equal_explicit_per_sample_gradients(kernels, kind, bias, device):
    _need_device(kernels, device)
    x, g, grads_w, grads_b = _linear_problem(kind, bias, device)
    want = grads_w.square().sum((1, 2))
    if bias:
        want_b = grads_b.square().sum(1)
        torch.testing.assert_close(ops.linear_bias_grad_norms_sq(g), want_b)
        torch.testing.assert_close(reference.linear_bias_grad_norms_sq(g), want_b)
        want = want + want_b
    assert all(_runs_kernel(x, g, method=m) for m in METHODS)
    for method in ("auto", *METHODS):
        torch.testing.assert_close(ops.linear_grad_norms_sq(x, g, bias=bias, method=method), want)
        torch.testing.assert_close(
            torch.ops.torchfn.linear_grad_norms_sq(x, g, bias, method)[0], want)
        torch.testing.assert_close(
            reference.linear_grad_norms_sq(x, g, bias=bias, method=method), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["2d", "3d"])
def test_clipped_sum_equals_explicit_clipped_per_sample_gradients(kernels, kind, device):
    _need_device(kernels, device)
    x, g, grads_w, grads_b = _linear_problem(kind, True, device, seed=10)
    norms = (grads_w.square().sum((1, 2)) + grads_b.square().sum(1)).sqrt()
    clip = norms.median()
    coef = (clip / norms).clamp(max=1.0)  # DP-SGD: coef_i = min(1, C / ||grad_i||)
    assert (coef < 1).any() and (coef == 1).any()
    torch.testing.assert_close(ops.linear_grad_norms_sq(x, g, bias=True).sqrt(), norms)
    want_w = (coef[:, None, None] * grads_w).sum(0)
    want_b = (coef[:, None] * grads_b).sum(0)
    torch.testing.assert_close(ops.clipped_linear_grad_sum(x, g, coef), want_w)
    torch.testing.assert_close(torch.ops.torchfn.clipped_linear_grad_sum(x, g, coef), want_w)
    torch.testing.assert_close(reference.clipped_linear_grad_sum(x, g, coef), want_w)
    torch.testing.assert_close(ops.clipped_linear_bias_grad_sum(g, coef), want_b)
    torch.testing.assert_close(reference.clipped_linear_bias_grad_sum(g, coef), want_b)


# ---------------------------------------------------------------------------------------------
# kernels == twins, every dtype; both 3-D paths; empty, unaligned and non-contiguous inputs

SHAPES_2D = [(0, 3, 4), (1, 1, 1), (5, 7, 3), (3, 1027, 17), (64, 40, 24), (2, 20000, 300),
             (3, 20001, 301), (4, 0, 5),  # (B, d_in, d_out): tails, one row split (CUDA) ...
             # ... a and g of very different lengths (the CUDA kernels read them side by side,
             # batches running past the shorter one), 8-thread groups over many rows, and split
             # rows whose splits of a run out (some empty)
             (9, 8, 4096), (300, 128, 136), (2, 64, 30000)]
SHAPES_3D = [(0, 3, 4, 5), (2, 0, 3, 4), (3, 5, 7, 6), (2, 9, 4, 5), (4, 16, 32, 24)]


def _shape_id(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _pair_for(shape: tuple[int, ...], seed: int) -> tuple[Tensor, Tensor]:
    if len(shape) == 3:
        return _pair(shape[0], None, shape[1], shape[2], seed)
    return _pair(shape[0], shape[1], shape[2], shape[3], seed)


def _assert_aux(aux: Tensor, a64: Tensor, g64: Tensor, method: str, dtype: torch.dtype) -> None:
    """The forward's aux: row norms (2-D, accumulation dtype), Gram matrices or g^T a (3-D)."""
    if a64.dim() == 2:
        acc = F64 if dtype == F64 else torch.float32
        want = torch.stack([a64.square().sum(-1), g64.square().sum(-1)], dim=1)
        assert aux.dtype == acc
        torch.testing.assert_close(aux, want.to(acc), **TOLERANCES[acc])
        return
    if method == "gram":
        want = torch.stack([a64 @ a64.transpose(1, 2), g64 @ g64.transpose(1, 2)], dim=1)
    else:
        want = g64.transpose(1, 2) @ a64
    _assert_close(aux, want, dtype, three_d=True)


def _forward_cases():  # type: ignore[no-untyped-def]
    for shape in SHAPES_2D:
        yield pytest.param(shape, "gram", id=f"2d-{_shape_id(shape)}")
    for shape in SHAPES_3D:
        for method in METHODS:
            yield pytest.param(shape, method, id=f"3d-{_shape_id(shape)}-{method}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "method"), list(_forward_cases()))
def test_kernels_match_twins(kernels, shape, method, dtype, device):
    """Forward, backward and clipped-sum kernels against the float64 twin (and its autograd)."""
    _need_device(kernels, device)
    a64, g64 = _pair_for(shape, seed=1)
    a, g = a64.to(device, dtype), g64.to(device, dtype)
    a64, g64 = a.to(F64), g.to(F64)  # the same (rounded) inputs, exactly, in float64
    three_d = len(shape) == 4
    # 2-D: the closed form (materialising (B, d_out, d_in) is slow at these sizes; the
    # per-sample tests above check the closed form against the obvious definition).
    twin_method = "materialize" if len(shape) == 4 else "gram"
    for bias in (False, True):
        got, aux = torch.ops.torchfn.linear_grad_norms_sq(a, g, bias, method)
        want = reference.linear_grad_norms_sq(a64, g64, bias=bias, method=twin_method)
        assert got.shape == (shape[0],)
        _assert_close(got, want, dtype, three_d)
        _assert_aux(aux, a64, g64, method, dtype)
        w = _randn((shape[0],), seed=3).to(device, dtype)
        leaves = (a64.clone().requires_grad_(True), g64.clone().requires_grad_(True))
        want_da, want_dg = torch.autograd.grad(
            reference.linear_grad_norms_sq(*leaves, bias=bias, method=twin_method), leaves,
            w.to(F64))
        for given in (aux, None):  # the forward's aux, or recomputed in the kernel
            got_da, got_dg = torch.ops.torchfn.linear_grad_norms_sq_backward(
                w, a, g, given, bias, method)
            _assert_close(got_da, want_da, dtype, three_d)
            _assert_close(got_dg, want_dg, dtype, three_d)
    coef = torch.rand(shape[0], generator=torch.Generator().manual_seed(4), dtype=F64)
    got = torch.ops.torchfn.clipped_linear_grad_sum(a, g, coef.to(device, dtype))
    want = reference.clipped_linear_grad_sum(a64, g64, coef.to(device, dtype).to(F64))
    assert got.shape == (g.shape[-1], a.shape[-1])
    _assert_close(got, want, dtype, three_d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_kernels_over_more_rows_than_resident_groups(kernels, dtype, device):
    """70000 short rows: on CUDA more rows than 8-thread groups fit on the GPU at once, so each
    group strides over several rows (forward and both backward paths) == the float64 twin."""
    _need_device(kernels, device)
    a, g = _pair(70000, None, 8, 8, seed=6)
    a, g = a.to(device, dtype), g.to(device, dtype)
    a64, g64 = a.to(F64), g.to(F64)
    got, aux = torch.ops.torchfn.linear_grad_norms_sq(a, g, True, "gram")
    _assert_close(got, reference.linear_grad_norms_sq(a64, g64, bias=True), dtype, False)
    _assert_aux(aux, a64, g64, "gram", dtype)
    w = _randn((a.shape[0],), seed=7).to(device, dtype)
    leaves = (a64.clone().requires_grad_(True), g64.clone().requires_grad_(True))
    want_da, want_dg = torch.autograd.grad(
        reference.linear_grad_norms_sq(*leaves, bias=True), leaves, w.to(F64))
    for given in (aux, None):
        got_da, got_dg = torch.ops.torchfn.linear_grad_norms_sq_backward(
            w, a, g, given, True, "gram")
        _assert_close(got_da, want_da, dtype, False)
        _assert_close(got_dg, want_dg, dtype, False)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_misaligned_inputs(kernels, device):
    """Views (transposed, strided, at odd storage offsets) give the twin's values and grads."""
    _need_device(kernels, device)
    base = _randn((6, 2, 40), seed=5).to(device, torch.float32)
    flat = base.reshape(-1)
    views = [
        (base[:, 0, :16], base[:, 1, 3:11]),  # strided rows
        (flat[1:1 + 6 * 16].view(6, 16), flat[3:3 + 6 * 8].view(6, 8)),  # misaligned
        (base.transpose(1, 2)[:, :5, :], base.transpose(1, 2)[:, 5:10, :]),  # 3-D, transposed
        (base[:, :, :12].reshape(6, 2, 12)[:, :, 1:], base[:, :, 20:29]),  # 3-D, offsets
    ]
    for a, g in views:
        assert _runs_kernel(a, g)
        for bias in (False, True):
            torch.testing.assert_close(ops.linear_grad_norms_sq(a, g, bias=bias),
                                       reference.linear_grad_norms_sq(a, g, bias=bias))
        coef = torch.linspace(0.1, 1.0, a.shape[0], device=device)
        torch.testing.assert_close(ops.clipped_linear_grad_sum(a, g, coef),
                                   reference.clipped_linear_grad_sum(a, g, coef))
        leaves = (a.detach().requires_grad_(True), g.detach().requires_grad_(True))
        got = torch.autograd.grad(ops.linear_grad_norms_sq(*leaves, bias=True).sum(), leaves)
        want = torch.autograd.grad(reference.linear_grad_norms_sq(*leaves, bias=True).sum(),
                                   leaves)
        torch.testing.assert_close(got, want)


def test_auto_method_rule_and_both_paths():
    """``auto`` picks Gram iff T (d_in + d_out) <= d_in d_out; both paths give equal values."""
    assert _ghost.gram_is_cheaper(3, 6, 6) and not _ghost.gram_is_cheaper(4, 6, 6)
    assert _ghost.gram_is_cheaper(128, 1024, 1024) and not _ghost.gram_is_cheaper(4096, 256, 256)
    cases = {(2, 3, 6, 6): "gram", (2, 4, 6, 6): "materialize", (2, 9, 4, 5): "materialize",
             (3, 5, 16, 12): "gram"}
    for (batch, time, d_in, d_out), path in cases.items():
        a, g = _pair(batch, time, d_in, d_out, seed=6)
        assert _ghost._resolve_method(a, g, "auto") == path
        leaf = a.clone().requires_grad_(True)
        out = ops.linear_grad_norms_sq(leaf, g)
        assert out.grad_fn.method == path  # the Function (and its backward) run this path
        values = [ops.linear_grad_norms_sq(a, g, method=m) for m in METHODS]
        torch.testing.assert_close(values[0], values[1])
    a2, g2 = _pair(3, None, 4, 5, seed=7)
    assert _ghost._resolve_method(a2, g2, "auto") == "gram"  # 2-D: always the closed form


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck, gradcheck, gradgradcheck, third derivatives


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(kernels, device):
    _need_device(kernels, device)
    for time in (None, 3):
        a, g = (x.to(device, torch.float32) for x in _pair(4, time, 5, 6, seed=8))
        w = torch.rand(4, device=device)
        for method in METHODS:
            torch.library.opcheck(torch.ops.torchfn.linear_grad_norms_sq.default,
                                  (a, g, True, method))
            _, aux = torch.ops.torchfn.linear_grad_norms_sq(a, g, False, method)
            for given in (aux, None):
                torch.library.opcheck(torch.ops.torchfn.linear_grad_norms_sq_backward.default,
                                      (w, a, g, given, False, method))
        torch.library.opcheck(torch.ops.torchfn.clipped_linear_grad_sum.default, (a, g, w))
        torch.library.opcheck(torch.ops.torchfn.linear_grad_norms_sq.default,
                              (a.transpose(0, -1).contiguous().transpose(0, -1), g, False,
                               "auto"))  # non-contiguous input


_GRADCHECK_CASES = [
    pytest.param(None, "gram", False, id="2d"),
    pytest.param(None, "gram", True, id="2d-bias"),
    pytest.param(3, "gram", True, id="3d-gram-bias"),
    pytest.param(3, "materialize", False, id="3d-materialize"),
    pytest.param(3, "materialize", True, id="3d-materialize-bias"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("time", "method", "bias"), _GRADCHECK_CASES)
def test_norms_gradcheck_and_gradgradcheck(kernels, time, method, bias, device):
    _need_device(kernels, device)
    a, g = (x.to(device).requires_grad_(True) for x in _pair(3, time, 4, 5, seed=9))
    assert _runs_kernel(a, g, bias=bias, method=method)

    def fn(a: Tensor, g: Tensor) -> Tensor:
        return ops.linear_grad_norms_sq(a, g, bias=bias, method=method)

    assert torch.autograd.gradcheck(fn, (a, g))
    assert torch.autograd.gradgradcheck(fn, (a, g))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("time", [None, 3], ids=["2d", "3d"])
def test_clipped_sum_gradcheck_and_gradgradcheck(kernels, time, device):
    _need_device(kernels, device)
    a, g = (x.to(device).requires_grad_(True) for x in _pair(3, time, 4, 2, seed=11))
    coef = torch.rand(3, dtype=F64, device=device).requires_grad_(True)
    assert torch.autograd.gradcheck(ops.clipped_linear_grad_sum, (a, g, coef))
    assert torch.autograd.gradgradcheck(ops.clipped_linear_grad_sum, (a, g, coef))


@pytest.mark.parametrize(("time", "method", "bias"), _GRADCHECK_CASES)
def test_third_derivatives_match_twin(kernels, time, method, bias):
    """Every order works: the gradient of the third directional derivative (N has degree 4)."""
    a, g = _pair(3, time, 4, 5, seed=12)
    dirs = (_randn(a.shape, seed=13), _randn(g.shape, seed=14))

    def third(fn: Callable[..., Tensor]) -> tuple[Tensor, ...]:
        leaves = (a.clone().requires_grad_(True), g.clone().requires_grad_(True))
        out = fn(*leaves, bias=bias, method=method).sum()
        for _ in range(2):  # out <- <grad out, dirs>
            grads = torch.autograd.grad(out, leaves, create_graph=True)
            out = sum((d * v).sum() for d, v in zip(grads, dirs, strict=True))
        return torch.autograd.grad(out, leaves)

    got, want = third(ops.linear_grad_norms_sq), third(reference.linear_grad_norms_sq)
    torch.testing.assert_close(got, want)
    assert want[0].abs().sum() > 0 and want[1].abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# The transform matrix: {eager, compiled} x {backward, grad, vmap(grad), grad(grad)}, each
# against the twin run eagerly, differentiating with respect to every tensor input.


@dataclasses.dataclass(frozen=True)
class MultiCase:
    name: str
    op: Callable[..., Tensor]
    twin: Callable[..., Tensor]
    shapes: tuple[tuple[int, ...], ...]
    dispatch_name: str

    def __str__(self) -> str:
        return self.name


def _norms_case(name: str, shapes: tuple, bias: bool, method: str) -> MultiCase:
    key = "linear_grad_norms_sq" + ("" if len(shapes[0]) == 2 else f"_{method}")
    return MultiCase(
        name,
        lambda a, g: ops.linear_grad_norms_sq(a, g, bias=bias, method=method),
        lambda a, g: reference.linear_grad_norms_sq(a, g, bias=bias, method=method),
        shapes, key)


MATRIX_CASES = [
    _norms_case("norms-2d-bias", ((4, 5), (4, 3)), True, "auto"),
    _norms_case("norms-3d-gram-bias", ((3, 2, 5), (3, 2, 4)), True, "gram"),
    _norms_case("norms-3d-materialize", ((3, 4, 2), (3, 4, 3)), False, "materialize"),
    MultiCase("clipped-2d", ops.clipped_linear_grad_sum, reference.clipped_linear_grad_sum,
              ((4, 5), (4, 3), (4,)), "clipped_linear_grad_sum"),
    MultiCase("clipped-3d", ops.clipped_linear_grad_sum, reference.clipped_linear_grad_sum,
              ((3, 2, 5), (3, 2, 4), (3,)), "clipped_linear_grad_sum"),
]
MATRIX_PARAMS = [pytest.param(c, id=c.name) for c in MATRIX_CASES]


def _matrix_inputs(case: MultiCase, device: str, lead: tuple[int, ...] = ()) -> list[Tensor]:
    return [_randn((*lead, *shape), seed=20 + k).to(device) for k, shape in enumerate(case.shapes)]


def _matrix_derivative(diff: str, fn: Callable[..., Tensor], xs: list[Tensor], weight: Tensor,
                       dirs: list[Tensor], compiled: bool, backend: str) -> tuple[Tensor, ...]:
    def loss(*args: Tensor) -> Tensor:
        out = fn(*args)
        return (weight * out).sum() + 0.1 * (out**2).sum()

    argnums = tuple(range(len(xs)))
    if diff == "backward":
        step = torch.compile(loss, backend=backend, fullgraph=True) if compiled else loss
        leaves = [x.detach().clone().requires_grad_(True) for x in xs]
        step(*leaves).backward()
        return tuple(leaf.grad for leaf in leaves)  # type: ignore[misc]
    if diff == "grad":
        transform = torch.func.grad(loss, argnums=argnums)
    elif diff == "vmap_grad":
        transform = torch.func.vmap(torch.func.grad(loss, argnums=argnums))
    elif diff == "grad_grad":
        inner = torch.func.grad(loss, argnums=argnums)

        def hvp(*args: Tensor) -> Tensor:
            pairs = zip(inner(*args), dirs, strict=True)
            return sum(((d * v).sum() for d, v in pairs), torch.zeros((), dtype=F64))

        transform = torch.func.grad(hvp, argnums=argnums)
    else:
        raise ValueError(f"_matrix_derivative(diff={diff!r}): expected one of {DIFFS}")
    if compiled:
        transform = torch.compile(transform, backend=backend, fullgraph=True)
    return transform(*xs)


def assert_multi_matrix_case(case: MultiCase, mode: str, diff: str, device: str,
                             backend: str = "aot_eager") -> None:
    xs = _matrix_inputs(case, device, lead=(2,) if diff == "vmap_grad" else ())
    out_shape = case.twin(*[x[0] for x in xs] if diff == "vmap_grad" else xs).shape
    weight = _randn(tuple(out_shape), seed=30).to(device) + 1
    dirs = [_randn(tuple(x.shape), seed=40 + k).to(device) for k, x in enumerate(xs)]
    got = _matrix_derivative(diff, case.op, xs, weight, dirs, mode == "compiled", backend)
    want = _matrix_derivative(diff, case.twin, xs, weight, dirs, False, backend)
    assert len(got) == len(want) == len(xs)
    for k, (gk, wk) in enumerate(zip(got, want, strict=True)):
        assert wk.abs().sum() > 0, f"input {k}: the reference derivative is all zeros"
        torch.testing.assert_close(gk, wk, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("diff", DIFFS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", MATRIX_PARAMS)
def test_matrix(kernels, case, mode, diff, device):
    _need_device(kernels, device)
    xs = _matrix_inputs(case, device)
    assert _dispatch.use_kernel(case.dispatch_name, xs[0]), "eager calls must run the kernel"
    assert_multi_matrix_case(case, mode, diff, device)


@pytest.mark.parametrize("device", DEVICES)
def test_matrix_inductor_grad_grad(kernels, device):
    """One Inductor (codegen) compile: grad-of-grad of the 3-D Gram norms."""
    _need_device(kernels, device)
    assert_multi_matrix_case(MATRIX_CASES[1], "compiled", "grad_grad", device,
                             backend="inductor")


@pytest.mark.parametrize("case", MATRIX_PARAMS)
def test_vmap_of_the_ops_equals_a_loop(kernels, case):
    """vmap rules: batched in any dim, or unbatched, inputs equal a Python loop."""
    xs = _matrix_inputs(case, "cpu", lead=(3,))
    base = _matrix_inputs(case, "cpu")
    want = torch.stack([case.twin(*[x[v] for x in xs]) for v in range(3)])
    torch.testing.assert_close(torch.func.vmap(case.op)(*xs), want)
    moved = [x.movedim(0, -1) for x in xs]  # batch dim last
    n = len(xs)
    torch.testing.assert_close(torch.func.vmap(case.op, in_dims=(-1,) * n)(*moved), want)
    half = (0,) + (None,) * (n - 1)  # only the first input batched
    want_half = torch.stack([case.twin(xs[0][v], *base[1:]) for v in range(3)])
    torch.testing.assert_close(torch.func.vmap(case.op, in_dims=half)(xs[0], *base[1:]),
                               want_half)


@pytest.mark.parametrize("case", MATRIX_PARAMS)
def test_forward_mode_hessian_and_jvp_match_twin(kernels, case):
    """jvp rules: hessian (jacfwd over jacrev) and jvp-of-grad equal the twin's."""
    xs = _matrix_inputs(case, "cpu")
    tangents = tuple(_randn(tuple(x.shape), seed=50 + k) for k, x in enumerate(xs))
    argnums = tuple(range(len(xs)))

    def loss(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        return lambda *args: (fn(*args) ** 2).sum()

    got = torch.func.hessian(loss(case.op), argnums=argnums)(*xs)
    want = torch.func.hessian(loss(case.twin), argnums=argnums)(*xs)
    torch.testing.assert_close(got, want)
    _, got_t = torch.func.jvp(torch.func.grad(loss(case.op), argnums=argnums), tuple(xs),
                              tangents)
    _, want_t = torch.func.jvp(torch.func.grad(loss(case.twin), argnums=argnums), tuple(xs),
                               tangents)
    torch.testing.assert_close(got_t, want_t)
    assert all(t.abs().sum() > 0 for t in want_t)


@pytest.mark.parametrize("case", MATRIX_PARAMS)
def test_forward_over_forward_and_reverse_over_forward_match_twin(kernels, case):
    """jacfwd(jacfwd) routes to the twins (pytorch #197867); jacrev(jacfwd) runs the kernels."""
    xs = _matrix_inputs(case, "cpu")

    def loss(fn: Callable[..., Tensor]) -> Callable[[Tensor], Tensor]:
        return lambda x0: (fn(x0, *xs[1:]) ** 2).sum()

    for outer, inner in ((torch.func.jacfwd, torch.func.jacfwd),
                         (torch.func.jacrev, torch.func.jacfwd)):
        got = outer(inner(loss(case.op)))(xs[0])
        want = outer(inner(loss(case.twin)))(xs[0])
        torch.testing.assert_close(got, want)
        assert want.abs().sum() > 0


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="pytorch #197867: forward-over-forward through an autograd.Function's "
                   "jvp drops the rule's dependence on the primal (XPASS: torch fixed it; the "
                   "nested_forward_ad routing in _dispatch can then go)")
def test_bug_reproducer_forward_over_forward_of_the_function(kernels):
    """jacfwd(jacfwd) through the raw Function (no routing) differs from the twin today."""
    a, g = _pair(3, None, 4, 5, seed=19)

    def loss(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        return lambda x: (fn(x) ** 2).sum()

    raw = torch.func.jacfwd(torch.func.jacfwd(loss(
        lambda x: _ghost._NormsFn.apply(x, g, False, "gram")[0])))(a)
    want = torch.func.jacfwd(torch.func.jacfwd(loss(
        lambda x: reference.linear_grad_norms_sq(x, g))))(a)
    torch.testing.assert_close(raw, want)


def test_eager_backward_runs_through_the_functions(kernels):
    a, g = (x.requires_grad_(True) for x in _pair(3, 2, 4, 5, seed=14))
    out = ops.linear_grad_norms_sq(a, g)
    assert type(out.grad_fn).__name__.startswith("_NormsFn")
    grads = torch.autograd.grad(out.sum(), (a, g), create_graph=True)
    assert all(type(d.grad_fn).__name__.startswith("_NormsGradFn") for d in grads)
    coef = torch.rand(3, dtype=F64)
    assert type(ops.clipped_linear_grad_sum(a, g, coef).grad_fn).__name__.startswith(
        "_ClippedSumFn")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("time", "method"), [(None, "gram"), (24, "gram"), (24, "materialize")])
def test_public_forward_backward_runs_only_the_two_kernels(kernels, device, dtype, time, method):
    """The public op + a plain first-order backward (what benchmarks/ops_ghost.py times) runs
    exactly what the raw library calls run (its ``kernel-raw``): the forward kernel and the
    backward kernel, once each, with the same results -- no copy, cast, fill or reduction of
    anything else. (The backward used to go through a second autograd.Function and, in 3-D, to
    fill a zeros tensor of aux's size for aux's non-existent gradient.)"""
    _need_device(kernels, device)
    a, g = (x.to(device, dtype) for x in _pair(6, time, 40, 32, seed=21))
    w = torch.linspace(0.5, 1.5, 6, device=device, dtype=dtype)
    leaves = [x.clone().requires_grad_(True) for x in (a, g)]
    with OpLog() as log:
        grads = torch.autograd.grad(ops.linear_grad_norms_sq(*leaves, method=method), leaves, w)
    assert log.ops == [("torchfn::linear_grad_norms_sq", log.ops[0][1]),
                       ("torchfn::linear_grad_norms_sq_backward", log.ops[1][1])], log.ops
    _, aux = torch.ops.torchfn.linear_grad_norms_sq(a, g, False, method)
    want = torch.ops.torchfn.linear_grad_norms_sq_backward(w, a, g, aux, False, method)
    for got, exp in zip(grads, want, strict=True):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)


def test_forward_over_reverse_with_dual_tensors_keeps_the_backward_function(kernels):
    """A backward without create_graph inside a forward_ad dual level must still run the
    backward Function (its jvp rule carries the tangents): the raw kernel would drop them."""
    a, g = (x.requires_grad_(True) for x in _pair(3, None, 4, 5, seed=22))
    a_t = _randn((3, 4), seed=24)

    def tangents(fn: Callable[..., Tensor]) -> list[Tensor]:
        with fwAD.dual_level():
            grads = torch.autograd.grad(fn(fwAD.make_dual(a, a_t), g).sum(), (a, g))
            return [fwAD.unpack_dual(d).tangent for d in grads]

    got, want = tangents(ops.linear_grad_norms_sq), tangents(reference.linear_grad_norms_sq)
    assert all(t is not None for t in got)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y)


def test_functions_skip_the_per_call_signature_binding():
    """torchfn's Functions take the fast ``apply`` (all arguments positional, no defaults)."""
    assert (_ghost._NormsFn.fast_nargs, _ghost._NormsGradFn.fast_nargs,
            _ghost._ClippedSumFn.fast_nargs) == (4, 6, 3)


def test_rules_and_reference_mode_route_to_twins(kernels, monkeypatch):
    a, g = _pair(3, None, 4, 5, seed=15)
    a3, g3 = _pair(3, 9, 4, 5, seed=16)  # auto -> materialize
    _dispatch.set_rule("linear_grad_norms_sq", "cpu", min_numel=a.numel() + 1,
                       min_numel_grad=a.numel() + 1)  # the autouse fixture restores it
    assert not _dispatch.use_kernel("linear_grad_norms_sq", a)
    assert not _runs_kernel(a, g)
    assert _runs_kernel(a3, g3)  # the 3-D paths have rules of their own
    _dispatch.set_rule("linear_grad_norms_sq_materialize", "cpu", min_numel_grad=None)
    assert not _runs_kernel(a3, g3)
    assert _runs_kernel(a3, g3, method="gram")
    monkeypatch.setenv("TORCHFN_OPS", "reference")
    assert not _dispatch.use_kernel("clipped_linear_grad_sum", a)
    out = ops.clipped_linear_grad_sum(a.requires_grad_(True), g, torch.ones(3, dtype=F64))
    assert not type(out.grad_fn).__name__.startswith("_ClippedSumFn")


def test_default_rules_send_small_recorded_calls_to_twins(kernels, monkeypatch):
    """The defaults (set at import): kernels for plain forwards, twins for small calls that
    autograd records (the Functions' Python overhead), both equal in value."""
    for op, fields in _ghost._RULES["cpu"].items():
        _dispatch.set_rule(op, "cpu", **fields)  # the autouse fixture restores its own
    calls = []
    apply = _ghost._NormsFn.apply
    monkeypatch.setattr(_ghost._NormsFn, "apply", lambda *args: calls.append(1) or apply(*args))
    a, g = _pair(3, None, 4, 5, seed=17)
    plain = ops.linear_grad_norms_sq(a, g)
    assert calls == [1]  # no autograd: the kernel
    recorded = ops.linear_grad_norms_sq(a.requires_grad_(True), g)
    assert calls == [1]  # recorded and small: the twin
    torch.testing.assert_close(plain, recorded.detach())
    big_a, big_g = _pair(2, None, 1 << 16, 3, seed=18)
    ops.linear_grad_norms_sq(big_a.requires_grad_(True), big_g)
    assert calls == [1, 1]  # recorded and at the threshold: the kernel


_IGNORE_DYNAMO_INSTANTIATION = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated.*:DeprecationWarning"
)


@_IGNORE_DYNAMO_INSTANTIATION
def test_raw_function_under_compiled_grad_is_refused_loudly(kernels):
    """Without the dispatch rule, torchfn's C++ Autograd guard raises instead of zeros."""
    a, g = _pair(3, None, 4, 5, seed=16)

    def loss(a: Tensor) -> Tensor:
        return _ghost._NormsFn.apply(a, g, False, "gram").sum()

    compiled = torch.compile(torch.func.grad(loss), backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match=r"torchfn::linear_grad_norms_sq: argument 'a' "
                                           r"requires grad.*no derivative of its own"):
        compiled(a)


# ---------------------------------------------------------------------------------------------
# Bad inputs give clear errors naming the op, the arguments and what was seen


def test_shape_errors_name_both_shapes():
    a, g = torch.zeros(4, 5), torch.zeros(4, 3)
    call = r"torchfn.ops.linear_grad_norms_sq\(a=..., g=...\)"
    with pytest.raises(ValueError, match=call + r": expected a and g to have the same batch "
                                         r"size \(dim 0\), got a.shape=\(4, 5\) and "
                                         r"g.shape=\(3, 3\)"):
        ops.linear_grad_norms_sq(a, torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"same number of dims .* got a.shape=\(4, 5\) and "
                                         r"g.shape=\(4, 2, 3\)"):
        ops.linear_grad_norms_sq(a, torch.zeros(4, 2, 3))
    with pytest.raises(ValueError, match=r"same time length \(dim 1\), got a.shape=\(4, 2, 5\) "
                                         r"and g.shape=\(4, 3, 3\)"):
        ops.linear_grad_norms_sq(torch.zeros(4, 2, 5), torch.zeros(4, 3, 3))
    for bad in (torch.zeros(5), torch.zeros(2, 2, 2, 2)):
        with pytest.raises(ValueError, match=re.escape(
                "expected a to have 2 dims (batch, d_in) or 3 dims (batch, time, d_in), got "
                f"a.shape={tuple(bad.shape)}")):
            ops.linear_grad_norms_sq(bad, g)
    with pytest.raises(ValueError, match=r"clipped_linear_grad_sum\(a=..., g=..., coef=...\): "
                                         r"expected a and g to have the same batch size"):
        ops.clipped_linear_grad_sum(a, torch.zeros(2, 3), torch.ones(4))
    with pytest.raises(ValueError, match=r"linear_bias_grad_norms_sq\(g=...\): expected g to "
                                         r"have 2 dims .* got g.shape=\(3,\)"):
        ops.linear_bias_grad_norms_sq(torch.zeros(3))


def test_coef_errors():
    a, g = torch.zeros(4, 5), torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"clipped_linear_grad_sum\(a=..., g=..., coef=...\): "
                                         r"expected coef of shape \(4,\) \(one coefficient per "
                                         r"sample of g.shape=\(4, 3\)\), got coef.shape=\(5,\)"):
        ops.clipped_linear_grad_sum(a, g, torch.ones(5))
    with pytest.raises(ValueError, match=r"got coef.shape=\(4, 1\)"):
        ops.clipped_linear_grad_sum(a, g, torch.ones(4, 1))
    with pytest.raises(TypeError, match=r"expected coef to have the dtype of g \(torch.float32\), "
                                        r"got coef.dtype=torch.float64"):
        ops.clipped_linear_grad_sum(a, g, torch.ones(4, dtype=F64))
    with pytest.raises(ValueError, match=r"expected coef on the device of g \(cpu\), got "
                                         r"coef.device=meta"):
        ops.clipped_linear_grad_sum(a, g, torch.ones(4, device="meta"))
    with pytest.raises(ValueError, match=r"clipped_linear_bias_grad_sum\(g=..., coef=...\): "
                                         r"expected coef of shape \(4,\)"):
        ops.clipped_linear_bias_grad_sum(g, torch.ones(3))
    with pytest.raises(TypeError, match=r"clipped_linear_grad_sum\(coef=...\): expected coef to "
                                        "be a torch.Tensor, got float"):
        ops.clipped_linear_grad_sum(a, g, 1.0)


def test_dtype_device_and_method_errors():
    a, g = torch.zeros(4, 5), torch.zeros(4, 3)
    with pytest.raises(TypeError, match=r"linear_grad_norms_sq\(a=..., g=...\): expected a and "
                                        r"g to have the same dtype, got a.dtype=torch.float32 "
                                        r"and g.dtype=torch.float64"):
        ops.linear_grad_norms_sq(a, g.double())
    with pytest.raises(TypeError, match=r"linear_grad_norms_sq\(g=...\): expected a "
                                        r"floating-point tensor .* got g.dtype=torch.int64"):
        ops.linear_grad_norms_sq(a, torch.zeros(4, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"expected a to be a torch.Tensor, got list"):
        ops.linear_grad_norms_sq([[1.0]], g)
    with pytest.raises(ValueError, match=r"expected a and g on the same device, got "
                                         r"a.device=cpu and g.device=meta"):
        ops.linear_grad_norms_sq(a, g.to("meta"))
    with pytest.raises(ValueError, match=r"expected method to be one of \('auto', 'gram', "
                                         r"'materialize'\), got 'fast'"):
        ops.linear_grad_norms_sq(a, g, method="fast")
    with pytest.raises(ValueError, match=r"reference\.linear_grad_norms_sq"):
        reference.linear_grad_norms_sq(a, g, method="fast")


def test_raw_kernels_check_their_arguments(kernels):
    a, g = torch.zeros(4, 5), torch.zeros(4, 3)
    op = torch.ops.torchfn
    with pytest.raises(RuntimeError, match=r"torchfn::linear_grad_norms_sq: arguments 'a' "
                                           r"\[4, 5\] and 'g' \[3, 3\] must agree in the batch"):
        op.linear_grad_norms_sq(a, torch.zeros(3, 3))
    with pytest.raises(RuntimeError, match=r"torchfn::linear_grad_norms_sq: argument 'a' must "
                                           r"have 2 dims .* got shape \[5\]"):
        op.linear_grad_norms_sq(torch.zeros(5), torch.zeros(5))
    with pytest.raises(RuntimeError, match=r"argument 'g' must have as many dims as 'a' \[4, 5\], "
                                           r"got shape \[4, 1, 3\]"):
        op.linear_grad_norms_sq(a, torch.zeros(4, 1, 3))
    with pytest.raises(RuntimeError, match=r"argument 'g' must have the dtype of 'a' \(Float\), "
                                           "got Double"):
        op.linear_grad_norms_sq(a, g.double())
    with pytest.raises(RuntimeError, match=r"argument 'a' must be float32, float64, float16 or "
                                           "bfloat16, got dtype Long"):
        op.linear_grad_norms_sq(a.long(), g)
    with pytest.raises(RuntimeError, match=r"argument 'method' must be 'auto', 'gram' or "
                                           "'materialize', got 'fast'"):
        op.linear_grad_norms_sq(torch.zeros(4, 2, 5), torch.zeros(4, 2, 3), False, "fast")
    with pytest.raises(RuntimeError, match=r"torchfn::clipped_linear_grad_sum: argument 'coef' "
                                           r"must have shape \[4\] .* got \[3\]"):
        op.clipped_linear_grad_sum(a, g, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"torchfn::linear_grad_norms_sq_backward: argument "
                                           r"'grad' must have the dtype of 'a' \(Float\)"):
        op.linear_grad_norms_sq_backward(torch.ones(4, dtype=F64), a, g)
    with pytest.raises(RuntimeError, match=r"torchfn::linear_grad_norms_sq_backward: argument "
                                           r"'aux' must be the forward's aux for these inputs, "
                                           r"of shape \[4, 2\], got \[4, 3\]"):
        op.linear_grad_norms_sq_backward(torch.ones(4), a, g, torch.ones(4, 3))
    with pytest.raises(RuntimeError, match=r"argument 'aux' must be the forward's aux for these "
                                           r"inputs, of shape \[4, 3, 5\], got \[4, 2, 2, 2\]"):
        op.linear_grad_norms_sq_backward(torch.ones(4), torch.zeros(4, 2, 5),
                                         torch.zeros(4, 2, 3), torch.ones(4, 2, 2, 2), False,
                                         "materialize")
    with pytest.raises(RuntimeError, match=r"argument 'aux' must have dtype Float, got Double"):
        op.linear_grad_norms_sq_backward(torch.ones(4), a, g, torch.ones(4, 2, dtype=F64))
    with pytest.raises(RuntimeError, match=r"torchfn::clipped_linear_grad_sum: argument 'g' "
                                           "requires grad.*call the public torchfn.ops function"):
        op.clipped_linear_grad_sum(a, g.requires_grad_(True), torch.ones(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_raw_kernels_check_device(kernels):
    _need_device(kernels, "cuda")
    a = torch.zeros(4, 5, device="cuda")
    with pytest.raises(RuntimeError, match=r"torchfn::linear_grad_norms_sq: argument 'g' must be "
                                           "on a cuda device for this kernel, got device cpu"):
        torch.ops.torchfn.linear_grad_norms_sq(a, torch.zeros(4, 3))
    with pytest.raises(RuntimeError, match=r"torchfn::clipped_linear_grad_sum: argument 'coef' "
                                           "must be on a cuda device"):
        torch.ops.torchfn.clipped_linear_grad_sum(a, torch.zeros(4, 3, device="cuda"),
                                                  torch.ones(4))
    with pytest.raises(ValueError, match=r"expected a and g on the same device, got "
                                         r"a.device=cuda:0 and g.device=cpu"):
        ops.linear_grad_norms_sq(a, torch.zeros(4, 3))


def test_gram_norms_unchanged_by_zero_time_padding():
    # the CUDA half-type Gram path pads T and the feature widths to multiples of 8 with zeros;
    # the math it relies on, checked in float64 where it runs here: zero rows and columns leave
    # every per-sample norm exact
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 13, 6, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 13, 5, generator=gen, dtype=torch.float64)
    pad = torch.nn.functional.pad
    plain = reference.linear_grad_norms_sq(a, g, bias=True, method="gram")
    padded = reference.linear_grad_norms_sq(pad(a, (0, 0, 0, 3)), pad(g, (0, 0, 0, 3)),
                                            bias=True, method="gram")
    torch.testing.assert_close(padded, plain, rtol=1e-14, atol=0)
    wide = reference.linear_grad_norms_sq(pad(a, (0, 2, 0, 3)), pad(g, (0, 3, 0, 3)),
                                          method="gram")
    torch.testing.assert_close(wide, reference.linear_grad_norms_sq(a, g, method="gram"),
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(plain, reference.linear_grad_norms_sq(a, g, bias=True,
                                                                     method="materialize"))
    assert reference.pad_for_tensor_cores(a.half()).shape == (3, 13, 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_gram_norms_half_odd_time_cuda():
    # a ViT's 197 tokens (and an odd output width, as GPT-2's 50257 logits): the half-type
    # Gram GEMMs run on T padded to 200 and widths to multiples of 8, same norms (bf16:
    # these sums overflow float16, which the ghost layers keep in float32 anyway)
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4, 197, 64, device="cuda", generator=gen).to(dtype)
    g = torch.randn(4, 197, 51, device="cuda", generator=gen).to(dtype)  # 51: an odd width
    assert reference.pad_for_tensor_cores(a).shape == (4, 200, 64)
    assert reference.pad_for_tensor_cores(g).shape == (4, 200, 56)
    assert reference.pad_for_tensor_cores(a.float()).shape == (4, 197, 64)
    got = reference.linear_grad_norms_sq(a, g, bias=True, method="gram").double()
    want = reference.linear_grad_norms_sq(a.double(), g.double(), bias=True, method="materialize")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)
    compiled = torch.compile(lambda x, y: reference.linear_grad_norms_sq(x, y, method="gram"),
                             fullgraph=True)
    torch.testing.assert_close(compiled(a, g).double(),
                               reference.linear_grad_norms_sq(a, g, method="gram").double(),
                               rtol=2e-2, atol=0)
