"""Op 1 (``softmax_cross_entropy``): kernels == twin == ``F.cross_entropy``, opcheck,
gradcheck/gradgradcheck, the transform matrix, vmap over a task dim == a loop, forward-mode
rules, dispatch, and input errors. CUDA variants skip where no GPU is present."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from _op_matrix import DEVICES, DIFFS, MODES, TOLERANCES, OpLog
from _op_matrix import need_device as _need_device
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from torchfn import ops
from torchfn.ops import _dispatch, _xent, reference

OP = "softmax_cross_entropy"
IGNORE = -100
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# C not a multiple of any vector width (5, 1027, 4099); warp rows (C <= 2048) and block rows;
# vector loads (64, 2048, 8192); N = 0; one class.
SHAPES = [(0, 4), (1, 1), (7, 5), (33, 1027), (257, 64), (16, 2048), (5, 4099), (3, 8192)]
_IGNORE_DYNAMO_INSTANTIATION = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated.*:DeprecationWarning"
)


@pytest.fixture(scope="module")
def kernels(kernels: dict) -> dict:
    """The built kernels (conftest), with every size routed to them while this module runs
    (the shipped rules send CPU and small CUDA inputs to the twin, see ``_xent``)."""
    report = kernels
    saved = {d: _dispatch.get_rule(OP, d) for d in ("cpu", "cuda")}
    saved_transform = dict(_xent.TRANSFORM_MIN_NUMEL)
    for d in saved:
        _dispatch.set_rule(OP, d, min_numel=0, min_numel_grad=0)
    _xent.TRANSFORM_MIN_NUMEL.clear()
    yield report
    for d, rule in saved.items():
        _dispatch.set_rule(OP, d, **vars(rule))
    _xent.TRANSFORM_MIN_NUMEL.update(saved_transform)


def _data(n: int, c: int, dtype: torch.dtype, device: str, seed: int, ignore_every: int = 3,
          scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(n, c)`` logits and ``(n,)`` targets with every ``ignore_every``-th row ignored."""
    gen = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(n, c, generator=gen, dtype=torch.float64)).to(device, dtype)
    t = torch.randint(0, c, (n,), generator=gen)
    if ignore_every:
        t[1::ignore_every] = IGNORE
    return x, t.to(device)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, **kw) -> None:
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got, want, **{**TOLERANCES[dtype], **kw})


# ---------------------------------------------------------------------------------------------
# kernels == twin == F.cross_entropy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_forward_matches_twin_and_torch(kernels, device, dtype, shape, eps):
    _need_device(kernels, device)
    x, t = _data(*shape, dtype, device, seed=1)
    loss, stats = torch.ops.torchfn.softmax_cross_entropy(x, t, eps, IGNORE)
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    assert loss.dtype == stats.dtype == acc
    assert stats.shape == (shape[0], 2)
    keep = t != IGNORE
    if shape[0]:
        _close(stats[keep, 0], x[keep].to(acc).amax(-1), acc)  # the row max, exactly
    _close(stats[keep].sum(-1), torch.logsumexp(x.to(acc), dim=-1)[keep], acc)
    assert (loss[~keep] == 0).all() and (stats[~keep] == 0).all()
    for reduction in ("none", "sum", "mean"):
        got = ops.softmax_cross_entropy(x, t, label_smoothing=eps, reduction=reduction)
        twin = reference.softmax_cross_entropy(x, t, label_smoothing=eps, reduction=reduction)
        _close(got, twin, dtype, equal_nan=True)
        # The oracle: torch in float64, rounded to the dtype (bf16/fp16 compute in float here).
        torch_ = F.cross_entropy(x.double(), t, label_smoothing=eps, ignore_index=IGNORE,
                                 reduction=reduction).to(dtype)
        _close(got, torch_, dtype, equal_nan=True)
        _close(twin, torch_, dtype, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_backward_kernels_match_twin_derivatives(kernels, device, dtype, shape, eps):
    """backward == d(twin)/dx; double backward == the derivatives of the twin's gradient."""
    _need_device(kernels, device)
    x, t = _data(*shape, dtype, device, seed=2)
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    n, c = shape
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(n, generator=gen, dtype=torch.float64).to(device, acc)
    v = torch.randn(n, c, generator=gen, dtype=torch.float64).to(device, dtype)
    _, stats = torch.ops.torchfn.softmax_cross_entropy(x, t, eps, IGNORE)

    x64 = x.detach().clone().double().requires_grad_(True)
    g64 = g.detach().clone().double().requires_grad_(True)
    rows = reference.softmax_cross_entropy(x64, t, label_smoothing=eps, reduction="none")
    (dx64,) = torch.autograd.grad(rows, x64, g64, create_graph=True)
    dx = torch.ops.torchfn.softmax_cross_entropy_backward(g, x, t, stats, eps, IGNORE)
    _close(dx, dx64.to(dtype), dtype)

    want_g, want_x = torch.autograd.grad(dx64, (g64, x64), v.double(), allow_unused=True,
                                         materialize_grads=True)
    d_g, d_x = torch.ops.torchfn.softmax_cross_entropy_double_backward(
        v, g, x, t, stats, eps, IGNORE)
    # d_g is a row reduction kept in the accumulation dtype: its error grows like sqrt(C).
    _close(d_g, want_g.to(acc), acc, atol=TOLERANCES[acc]["atol"] * max(1, c) ** 0.5)
    _close(d_x, want_x.to(dtype), dtype)


# Row lengths around the vector widths (2 elements for fp64 .. 8 for bf16/fp16) and a
# vocabulary-sized odd C. 9 rows of odd C start at every offset from a 16-byte boundary, and the
# storage offsets 0..7 move the first row too, so the CUDA kernels' peeled rows (scalar head up to
# a 16-byte boundary, vector body, scalar tail) meet every head/body/tail split, in the forward
# (any offset), the backward and the double backward (offset 0: the outputs are fresh, aligned
# tensors; at other offsets they take the scalar path).
PEEL_CLASSES = [1, 2, 3, 5, 7, 8, 9, 31, 33, 50257]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("c", PEEL_CLASSES)
def test_rows_at_every_alignment_match_float64_twin(kernels, device, dtype, c):
    """Forward, backward and double-backward kernels == the float64 twin's values and
    derivatives for contiguous logits at storage offsets 0..7 (misaligned rows)."""
    _need_device(kernels, device)
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    n, eps = 9, 0.2
    gen = torch.Generator().manual_seed(20 + c)
    storage = (3.0 * torch.randn(7 + n * c, generator=gen, dtype=torch.float64)).to(device, dtype)
    t = torch.randint(0, c, (n,), generator=gen)
    t[4] = IGNORE
    t = t.to(device)
    g = torch.randn(n, generator=gen, dtype=torch.float64).to(device, acc)
    v = torch.randn(n, c, generator=gen, dtype=torch.float64).to(device, dtype)

    def tol(out_dtype: torch.dtype, offset: int, atol_scale: float = 1.0) -> dict:
        """The dtype's tolerance plus the row sums' rounding in the accumulation dtype, which
        grows like sqrt(C) (the CPU kernel sums a row serially)."""
        base = TOLERANCES[out_dtype]
        return {"rtol": base["rtol"] + TOLERANCES[acc]["rtol"] * c**0.5,
                "atol": base["atol"] * atol_scale, "msg": lambda m: f"offset {offset}: {m}"}

    for offset in range(8):
        x = storage[offset:offset + n * c].view(n, c)
        assert x.is_contiguous() and x.storage_offset() == offset
        x64 = x.detach().double().requires_grad_(True)
        g64 = g.detach().double().requires_grad_(True)
        rows = reference.softmax_cross_entropy(x64, t, label_smoothing=eps, reduction="none")
        (dx64,) = torch.autograd.grad(rows, x64, g64, create_graph=True)
        want_g, want_x = torch.autograd.grad(dx64, (g64, x64), v.double(), allow_unused=True,
                                             materialize_grads=True)

        loss, stats = torch.ops.torchfn.softmax_cross_entropy(x, t, eps, IGNORE)
        _close(loss, rows.detach().to(acc), acc, **tol(acc, offset))
        dx = torch.ops.torchfn.softmax_cross_entropy_backward(g, x, t, stats, eps, IGNORE)
        _close(dx, dx64.detach().to(dtype), dtype, **tol(dtype, offset))
        d_g, d_x = torch.ops.torchfn.softmax_cross_entropy_double_backward(
            v, g, x, t, stats, eps, IGNORE)
        _close(d_g, want_g.to(acc), acc, **tol(acc, offset, atol_scale=max(1, c) ** 0.5))
        _close(d_x, want_x.to(dtype), dtype, **tol(dtype, offset))
        assert (dx[4] == 0).all() and (d_x[4] == 0).all() and loss[4] == 0 and d_g[4] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_logits_and_masked_classes(kernels, device):
    """Large offsets (stability), -inf masked classes (zero probability, finite loss), a row of
    all -inf and a NaN (NaN like torch)."""
    _need_device(kernels, device)
    x = torch.tensor([[1e4, 1e4 - 1.0, -1e4, 0.0],
                      [-float("inf"), 2.0, -float("inf"), 1.0],
                      [3.0, -float("inf"), -float("inf"), -float("inf")],
                      [-float("inf")] * 4,
                      [0.0, float("nan"), 1.0, 2.0]], dtype=torch.float32, device=device)
    t = torch.tensor([1, 3, 0, 2, 0], device=device)
    want = F.cross_entropy(x, t, reduction="none")
    got = ops.softmax_cross_entropy(x, t, reduction="none")
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got[3].isnan() and got[4].isnan()
    finite = x[:3].clone().requires_grad_(True)
    (g_op,) = torch.autograd.grad(ops.softmax_cross_entropy(finite, t[:3]), finite)
    leaf = x[:3].clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(F.cross_entropy(leaf, t[:3]), leaf)
    torch.testing.assert_close(g_op, g_ref)
    assert g_op[1, 0] == 0 and g_op[2, 1:].eq(0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_misaligned_logits(kernels, device):
    _need_device(kernels, device)
    base, _ = _data(24, 16, torch.float32, device, seed=4, ignore_every=0)
    gen = torch.Generator().manual_seed(5)
    views = [base.t(), base[:, 1:], base[::2], base.reshape(-1)[1:1 + 23 * 16].view(23, 16)]
    for x in views:
        t = torch.randint(0, x.shape[1], (x.shape[0],), generator=gen).to(device)
        t[::4] = IGNORE
        assert _dispatch.use_kernel(OP, x)
        _close(ops.softmax_cross_entropy(x, t, reduction="none", label_smoothing=0.1),
               F.cross_entropy(x, t, reduction="none", label_smoothing=0.1), torch.float32)
        leaf = x.detach().requires_grad_(True)
        (g_op,) = torch.autograd.grad(ops.softmax_cross_entropy(leaf, t), leaf)
        (g_ref,) = torch.autograd.grad(F.cross_entropy(leaf, t), leaf)
        _close(g_op, g_ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_spatial_and_unbatched_shapes_match_torch(kernels, device, reduction):
    """``(N, C, d1, d2)`` logits (class dim moved last) and unbatched ``(C,)`` like torch."""
    _need_device(kernels, device)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, 3, 4, generator=gen, dtype=torch.float64).to(device)
    t = torch.randint(0, 5, (2, 3, 4), generator=gen).to(device)
    t[0, 1] = IGNORE
    kw = {"reduction": reduction, "label_smoothing": 0.2}
    torch.testing.assert_close(ops.softmax_cross_entropy(x, t, **kw), F.cross_entropy(x, t, **kw))
    torch.testing.assert_close(reference.softmax_cross_entropy(x, t, **kw),
                               F.cross_entropy(x, t, **kw))
    leaf = x.clone().requires_grad_(True)
    (g_op,) = torch.autograd.grad(ops.softmax_cross_entropy(leaf, t, **kw).sum(), leaf)
    (g_ref,) = torch.autograd.grad(F.cross_entropy(leaf, t, **kw).sum(), leaf)
    torch.testing.assert_close(g_op, g_ref)
    row, target = x[0, :, 0, 0], t[1, 0, 0]
    torch.testing.assert_close(ops.softmax_cross_entropy(row, target, **kw),
                               F.cross_entropy(row, target, **kw))


@pytest.mark.parametrize("device", DEVICES)
def test_all_rows_ignored(kernels, device):
    """Mean over no rows is NaN like torch; sum and none are zeros."""
    _need_device(kernels, device)
    x, _ = _data(4, 3, torch.float64, device, seed=7)
    t = torch.full((4,), IGNORE, device=device)
    assert ops.softmax_cross_entropy(x, t).isnan()
    assert F.cross_entropy(x, t).isnan()
    assert ops.softmax_cross_entropy(x, t, reduction="sum") == 0
    assert (ops.softmax_cross_entropy(x, t, reduction="none") == 0).all()
    leaf = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ops.softmax_cross_entropy(leaf, t, reduction="sum"), leaf)
    assert (g == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_ignore_index_inside_the_class_range(kernels, device):
    _need_device(kernels, device)
    x, t = _data(9, 4, torch.float64, device, seed=8, ignore_every=0)
    t[::2] = 2
    for reduction in ("none", "mean"):
        torch.testing.assert_close(
            ops.softmax_cross_entropy(x, t, ignore_index=2, reduction=reduction),
            F.cross_entropy(x, t, ignore_index=2, reduction=reduction))


# ---------------------------------------------------------------------------------------------
# opcheck, gradcheck, gradgradcheck


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(kernels, device):
    _need_device(kernels, device)
    x, t = _data(6, 5, torch.float32, device, seed=9)
    _, stats = torch.ops.torchfn.softmax_cross_entropy(x, t, 0.1, IGNORE)
    g = torch.randn(6, device=device)
    v = torch.randn(6, 5, device=device)
    for op, args in [
        (torch.ops.torchfn.softmax_cross_entropy.default, (x, t, 0.1, IGNORE)),
        (torch.ops.torchfn.softmax_cross_entropy.default,
         (x.t().contiguous().t(), t.clamp(min=0), 0.0, 3)),
        (torch.ops.torchfn.softmax_cross_entropy_backward.default,
         (g, x, t, stats, 0.1, IGNORE)),
        (torch.ops.torchfn.softmax_cross_entropy_double_backward.default,
         (v, g, x, t, stats, 0.1, IGNORE)),
        (torch.ops.torchfn.softmax_cross_entropy.default, (x.bfloat16(), t, 0.2, IGNORE)),
    ]:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("eps", [0.0, 0.25])
def test_gradcheck_and_gradgradcheck(kernels, device, reduction, eps):
    _need_device(kernels, device)
    x, t = _data(5, 4, torch.float64, device, seed=10, scale=1.0)
    x.requires_grad_(True)
    assert _dispatch.use_kernel(OP, x)

    def f(x: torch.Tensor) -> torch.Tensor:
        out = ops.softmax_cross_entropy(x, t, label_smoothing=eps, reduction=reduction)
        return out**2 if reduction == "none" else out  # squared: exercises d/d(grad_loss)

    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def test_third_order_gradgradcheck(kernels):
    """Third derivatives (plain torch formulas of the double backward) by finite differences."""
    x, t = _data(4, 3, torch.float64, "cpu", seed=11, scale=1.0)
    x.requires_grad_(True)

    def first(x: torch.Tensor) -> torch.Tensor:
        rows = ops.softmax_cross_entropy(x, t, label_smoothing=0.1, reduction="none")
        (g,) = torch.autograd.grad((rows**2).sum(), x, create_graph=True)
        return g

    assert torch.autograd.gradgradcheck(first, (x,))


# ---------------------------------------------------------------------------------------------
# The transform matrix: {eager, compiled} x {backward, grad, vmap(grad), grad(grad)}, against the
# twin run eagerly in float64. vmap maps over a task dim (T, N, C) like MAML's outer batch.


def _matrix_inputs(device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 6, 5, generator=gen, dtype=torch.float64)
    t = torch.randint(0, 5, (3, 6), generator=gen)
    t[0, 2] = t[1, 0] = t[2, 5] = IGNORE
    weight = torch.rand(6, generator=gen, dtype=torch.float64) + 0.5
    direction = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    return {k: v.to(device) for k, v in
            {"x": x, "t": t, "weight": weight, "direction": direction}.items()}


def _matrix_loss(fn, weight):  # type: ignore[no-untyped-def]
    """``sum(weight * rows**2) + mean``: the squared rows make d/d(grad_loss) matter."""
    def loss(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        rows = fn(x, t, label_smoothing=0.1, reduction="none")
        return (weight * rows**2).sum() + fn(x, t, label_smoothing=0.1)

    return loss


def _xent_derivative(diff: str, fn, data: dict, compiled: bool,  # type: ignore[no-untyped-def]
                     backend: str = "aot_eager") -> torch.Tensor:
    loss = _matrix_loss(fn, data["weight"])
    x, t = data["x"], data["t"]
    if diff == "backward":
        step = torch.compile(loss, backend=backend, fullgraph=True) if compiled else loss
        leaf = x[0].detach().clone().requires_grad_(True)
        step(leaf, t[0]).backward()
        assert leaf.grad is not None
        return leaf.grad
    if diff == "grad":
        transform, args = grad(loss), (x[0], t[0])
    elif diff == "vmap_grad":
        transform, args = vmap(grad(loss)), (x, t)
    elif diff == "grad_grad":
        inner = grad(loss)
        transform = grad(lambda x, t: (inner(x, t) * data["direction"]).sum())
        args = (x[0], t[0])
    else:
        raise ValueError(diff)
    if compiled:
        transform = torch.compile(transform, backend=backend, fullgraph=True)
    return transform(*args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("diff", DIFFS)
@pytest.mark.parametrize("mode", MODES)
def test_matrix(kernels, mode, diff, device):
    _need_device(kernels, device)
    data = _matrix_inputs(device)
    assert _dispatch.use_kernel(OP, data["x"]), "eager calls must run the kernel"
    got = _xent_derivative(diff, ops.softmax_cross_entropy, data, compiled=mode == "compiled")
    want = _xent_derivative(diff, reference.softmax_cross_entropy, data, compiled=False)
    assert want.abs().sum() > 0, "the reference derivative is all zeros; the test is too weak"
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# Inductor (torch 2.11, CUDA) warns "\nOnline softmax is disabled on the fly..." while lowering.
@pytest.mark.filterwarnings("ignore:\\s*Online softmax is disabled:UserWarning")
@pytest.mark.parametrize("device", DEVICES)
def test_matrix_inductor_grad_grad(kernels, device):
    """One Inductor (codegen) compile: MAML's grad-of-grad of the loss under torch.compile."""
    _need_device(kernels, device)
    data = _matrix_inputs(device)
    got = _xent_derivative("grad_grad", ops.softmax_cross_entropy, data, compiled=True,
                           backend="inductor")
    want = _xent_derivative("grad_grad", reference.softmax_cross_entropy, data, compiled=False)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _graph_names(t: torch.Tensor) -> set[str]:
    """Class names of every autograd node reachable from ``t``."""
    names: set[str] = set()
    seen: set[int] = set()
    kept = []  # hold every visited node: ids of freed Python wrappers can be reused
    stack = [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        kept.append(node)
        seen.add(id(node))
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.parametrize("device", DEVICES)
def test_eager_derivatives_run_on_the_kernels(kernels, device):
    """Forward, first and second derivatives go through the kernel Functions, not the twin."""
    _need_device(kernels, device)
    data = _matrix_inputs(device)
    x = data["x"][0].clone().requires_grad_(True)
    rows = ops.softmax_cross_entropy(x, data["t"][0], reduction="none")
    assert "_XentFnBackward" in _graph_names(rows)
    (g,) = torch.autograd.grad((rows**2).sum(), x, create_graph=True)
    assert "_XentGradFnBackward" in _graph_names(g)
    (h,) = torch.autograd.grad((g * data["direction"]).sum(), x, create_graph=True)
    assert "_XentGradGradFnBackward" in _graph_names(h)
    assert "LogSoftmaxBackward0" not in _graph_names(h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_public_forward_backward_runs_the_two_kernels_over_the_logits(kernels, device, dtype,
                                                                      reduction):
    """The public op + a plain first-order backward (what benchmarks/ops.py times as ``kernel``)
    touches the logits-sized tensors exactly as the raw library calls do (its ``kernel-raw``):
    the forward kernel and the backward kernel, once each; everything else (the reduction and
    its derivative, grad_loss) works on per-row vectors. No second autograd.Function runs, and
    no zeros are filled for the stats' non-existent gradient."""
    _need_device(kernels, device)
    n, c = 12, 40
    x, t = _data(n, c, dtype, device, seed=31)
    leaf = x.clone().requires_grad_(True)
    with OpLog() as log:
        loss = ops.softmax_cross_entropy(leaf, t, reduction=reduction)
        (got,) = torch.autograd.grad(loss, leaf, torch.ones_like(loss))
    assert [name for name, size in log.ops if size > n] == [
        "torchfn::softmax_cross_entropy", "torchfn::softmax_cross_entropy_backward"], log.ops
    assert "aten::zeros" not in [name for name, _ in log.ops]
    _, stats = torch.ops.torchfn.softmax_cross_entropy(x, t, 0.0, IGNORE)
    g = torch.ones(n, device=device)
    if reduction == "mean":
        g = g / (t != IGNORE).sum()
    want = torch.ops.torchfn.softmax_cross_entropy_backward(g, x, t, stats, 0.0, IGNORE)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_forward_over_reverse_with_dual_tensors_keeps_the_backward_function(kernels):
    """A backward without create_graph inside a forward_ad dual level must still run the
    backward Function (its jvp rule carries the tangent): the raw kernel would drop it."""
    x, t = _data(5, 7, torch.float64, "cpu", seed=32)
    x.requires_grad_(True)
    x_t = _data(5, 7, torch.float64, "cpu", seed=33)[0]

    def tangent(fn):  # type: ignore[no-untyped-def]
        with fwAD.dual_level():
            (d,) = torch.autograd.grad(fn(fwAD.make_dual(x, x_t), t, label_smoothing=0.1), x)
            return fwAD.unpack_dual(d).tangent

    got = tangent(ops.softmax_cross_entropy)
    assert got is not None
    torch.testing.assert_close(got, tangent(reference.softmax_cross_entropy))


# ---------------------------------------------------------------------------------------------
# vmap over a task dim == a loop; forward-mode rules


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_vmap_over_tasks_equals_loop(kernels, device, reduction):
    _need_device(kernels, device)
    data = _matrix_inputs(device)
    x, t = data["x"], data["t"].clone()
    t[2] = IGNORE  # a task with every row ignored: its mean is NaN, like the loop's
    kw = {"label_smoothing": 0.2, "reduction": reduction}

    def loop(x, t):  # type: ignore[no-untyped-def]
        return torch.stack([F.cross_entropy(x[i], t[i], **kw) for i in range(x.shape[0])])

    def ours(x, t):  # type: ignore[no-untyped-def]
        return ops.softmax_cross_entropy(x, t, **kw)

    torch.testing.assert_close(vmap(ours)(x, t), loop(x, t), equal_nan=True)
    # One side unbatched: shared targets, or shared logits with per-task targets.
    torch.testing.assert_close(vmap(ours, in_dims=(0, None))(x, t[0]),
                               loop(x, t[0].expand(3, -1)), equal_nan=True)
    torch.testing.assert_close(vmap(ours, in_dims=(None, 0))(x[1], t),
                               loop(x[1].expand(3, -1, -1), t), equal_nan=True)
    # Batch dim not at 0, and nested vmap.
    torch.testing.assert_close(vmap(ours, in_dims=(1, 1))(x.movedim(0, 1), t.movedim(0, 1)),
                               loop(x, t), equal_nan=True)
    nested = vmap(vmap(ours))(x.unsqueeze(0).expand(2, -1, -1, -1), t.expand(2, -1, -1))
    torch.testing.assert_close(nested, loop(x, t).expand(2, *loop(x, t).shape), equal_nan=True)

    def task_grad(x, t):  # type: ignore[no-untyped-def]
        out = ops.softmax_cross_entropy(x, t, **kw)
        return (out**2).sum()

    keep = slice(0, 2)  # tasks with rows that count
    got = vmap(grad(task_grad))(x[keep], t[keep])
    want = []
    for i in range(2):
        leaf = x[i].clone().requires_grad_(True)
        out = F.cross_entropy(leaf, t[i], **kw)
        (g,) = torch.autograd.grad((out**2).sum(), leaf)
        want.append(g)
    torch.testing.assert_close(got, torch.stack(want))


@pytest.mark.parametrize("device", DEVICES)
def test_forward_mode_matches_twin(kernels, device):
    """jvp rules: hessian (jacfwd over jacrev), jvp of grad, jacrev over jacfwd, jvp of vmap."""
    _need_device(kernels, device)
    data = _matrix_inputs(device)
    x, t, v = data["x"][0], data["t"][0], data["direction"]
    ours = _matrix_loss(ops.softmax_cross_entropy, data["weight"])
    twin = _matrix_loss(reference.softmax_cross_entropy, data["weight"])
    torch.testing.assert_close(hessian(ours)(x, t), hessian(twin)(x, t))
    want = jvp(grad(lambda x: twin(x, t)), (x,), (v,))[1]
    assert want.abs().sum() > 0
    torch.testing.assert_close(jvp(grad(lambda x: ours(x, t)), (x,), (v,))[1], want)
    torch.testing.assert_close(jacrev(jacfwd(ours))(x, t), jacrev(jacfwd(twin))(x, t))
    vm = vmap(lambda x: ops.softmax_cross_entropy(x, t, label_smoothing=0.3, reduction="none"))
    vt = vmap(lambda x: reference.softmax_cross_entropy(x, t, label_smoothing=0.3,
                                                        reduction="none"))
    xs = data["x"]
    torch.testing.assert_close(jvp(vm, (xs,), (xs.flip(0),))[1], jvp(vt, (xs,), (xs.flip(0),))[1])


def test_nested_forward_mode_routes_to_the_twin(kernels):
    """jacfwd(jacfwd(f)) through any autograd.Function's jvp is wrong in torch (pytorch #197867):
    the op detects two forward-mode levels and uses the twin, so the answer is right."""
    data = _matrix_inputs("cpu")
    x, t = data["x"][0], data["t"][0]
    seen = []

    def probe(x):  # type: ignore[no-untyped-def]
        seen.append(_dispatch.nested_forward_ad())
        return ops.softmax_cross_entropy(x, t, reduction="sum")

    got = jacfwd(jacfwd(probe))(x)
    want = jacfwd(jacfwd(lambda x: F.cross_entropy(x, t, reduction="sum")))(x)
    torch.testing.assert_close(got, want)
    assert seen and all(seen)
    assert not _dispatch.nested_forward_ad()


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="pytorch #197867: forward-over-forward through an autograd.Function's "
                   "jvp drops the rule's dependence on the primal (XPASS: torch fixed it; the "
                   "nested_forward_ad routing in _dispatch can then go)")
def test_bug_reproducer_forward_over_forward_of_function(kernels):
    data = _matrix_inputs("cpu")
    x, t = data["x"][0], data["t"][0]

    def raw(x):  # type: ignore[no-untyped-def]
        return _xent._XentFn.apply(x, t, 0.0, IGNORE)[0].sum()

    want = jacfwd(jacfwd(lambda x: F.cross_entropy(x, t, reduction="sum")))(x)
    torch.testing.assert_close(jacfwd(jacfwd(raw))(x), want)


# ---------------------------------------------------------------------------------------------
# Dispatch


def test_shipped_rules_and_reference_mode(kernels, monkeypatch):
    # Outside the module fixture's override, CPU always goes to the twin (see _xent.RULES).
    saved = _dispatch.get_rule(OP, "cpu")
    x, t = _data(4, 3, torch.float64, "cpu", seed=13)
    try:
        _dispatch.set_rule(OP, "cpu", **_xent.RULES["cpu"])
        assert not _dispatch.use_kernel(OP, x)
        assert not _dispatch.use_kernel(OP, torch.zeros(1 << 20).requires_grad_(True))
        leaf = x.clone().requires_grad_(True)
        out = ops.softmax_cross_entropy(leaf, t, reduction="none")
        names = _graph_names(out)
        assert "LogSoftmaxBackward0" in names and not any("Xent" in n for n in names)
    finally:
        _dispatch.set_rule(OP, "cpu", **vars(saved))
    monkeypatch.setenv("TORCHFN_OPS", "reference")
    assert not _dispatch.use_kernel(OP, x)
    torch.testing.assert_close(ops.softmax_cross_entropy(x, t), F.cross_entropy(x, t))


def test_transform_threshold_counts_the_vmapped_batch(kernels, monkeypatch):
    """Inside torch.func transforms small problems go to the twin (TRANSFORM_MIN_NUMEL), with
    the size counted over the vmapped batch; the numbers are the same either way."""
    monkeypatch.setitem(_xent.TRANSFORM_MIN_NUMEL, "cpu", 100)
    seen = []

    def probe(x):  # type: ignore[no-untyped-def]
        seen.append(_xent._use_kernel(x))
        return x.sum()

    x = torch.randn(4, 5, 6, dtype=torch.float64)
    vmap(probe)(x)  # 4 x 30 = 120 elements: kernel
    vmap(probe)(x[:3])  # 90: twin
    grad(probe)(x[0])  # 30: twin
    assert seen == [True, False, False]
    assert _xent._use_kernel(x[0])  # outside transforms only the (module-overridden) rule counts
    monkeypatch.delitem(_xent.TRANSFORM_MIN_NUMEL, "cpu")
    saved = _dispatch.get_rule(OP, "cpu")
    try:  # no transform threshold: the eager grad rule applies to the batched size
        _dispatch.set_rule(OP, "cpu", min_numel_grad=100)
        seen.clear()
        vmap(probe)(x)
        vmap(probe)(x[:3])
        _dispatch.set_rule(OP, "cpu", min_numel_grad=None)
        vmap(probe)(x)
        assert seen == [True, False, False]
    finally:
        _dispatch.set_rule(OP, "cpu", **vars(saved))
    monkeypatch.setitem(_xent.TRANSFORM_MIN_NUMEL, "cpu", 100)
    t = torch.randint(0, 6, (4, 5))
    for n in (4, 3):
        got = vmap(grad(lambda x, t: ops.softmax_cross_entropy(x, t)))(x[:n], t[:n])
        want = vmap(grad(lambda x, t: F.cross_entropy(x, t)))(x[:n], t[:n])
        torch.testing.assert_close(got, want)


@_IGNORE_DYNAMO_INSTANTIATION
def test_raw_function_under_compiled_grad_is_refused_loudly(kernels):
    """Without the dispatch rule, torchfn's C++ Autograd guard raises instead of zeros."""
    data = _matrix_inputs("cpu")

    def raw(x, t, label_smoothing, reduction="mean"):  # type: ignore[no-untyped-def]
        rows = _xent._XentFn.apply(x, t, label_smoothing, IGNORE)[0]
        return rows if reduction == "none" else rows.mean()

    with pytest.raises(RuntimeError, match=r"torchfn::softmax_cross_entropy: argument 'logits' "
                                           "requires grad.*no derivative of its own"):
        _xent_derivative("grad", raw, data, compiled=True)


# ---------------------------------------------------------------------------------------------
# Bad inputs give clear errors naming the op and the argument


def test_bad_public_arguments_are_refused():
    x = torch.randn(3, 4)
    t = torch.tensor([0, 1, 3])
    call = r"torchfn.ops.softmax_cross_entropy"
    cases = [
        ((torch.arange(12).view(3, 4), t), {}, TypeError,
         call + r"\(logits=...\): expected a floating-point tensor .* logits.dtype=torch.int64"),
        ((x, t.int()), {}, TypeError,
         call + r"\(target=...\): expected int64 class indices, got target.dtype=torch.int32"),
        ((x, torch.rand(3, 4)), {}, TypeError, "class probabilities are not supported"),
        ((x, [0, 1, 2]), {}, TypeError, r"expected target to be a torch.Tensor .* got list"),
        ((x, t[:2]), {}, ValueError,
         call + r"\(target=...\): expected target of shape \(3,\) for logits of shape "
                r"\(3, 4\) .* got \(2,\)"),
        ((torch.tensor(1.0), torch.tensor(0)), {}, ValueError, "got a 0-D tensor"),
        ((torch.randn(2, 0), torch.tensor([0, 0])), {}, ValueError, "at least one class"),
        ((x, t), {"label_smoothing": 1.5}, ValueError,
         call + r"\(label_smoothing=...\): expected a value in \[0, 1\], got 1.5"),
        ((x, t), {"label_smoothing": -0.1}, ValueError, r"in \[0, 1\], got -0.1"),
        ((x, t), {"label_smoothing": torch.tensor(0.1)}, TypeError,
         r"label_smoothing=...\): expected a Python float in \[0, 1\], got Tensor"),
        ((x, t), {"ignore_index": 1.0}, TypeError,
         r"ignore_index=...\): expected a Python int, got float"),
        ((x, t), {"reduction": "avg"}, ValueError,
         call + r"\(reduction=...\): expected one of \('none', 'sum', 'mean'\), got 'avg'"),
    ]
    for args, kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            ops.softmax_cross_entropy(*args, **kw)
    with pytest.raises(TypeError):
        ops.softmax_cross_entropy(x, t, 0.1)  # keyword-only options


def test_out_of_range_targets_raise_on_cpu(kernels):
    x = torch.randn(3, 4)
    for bad in (4, -1, -7):
        t = torch.tensor([0, bad, 1])
        with pytest.raises(RuntimeError, match=rf"torchfn::softmax_cross_entropy: argument "
                                                rf"'target' holds class index {bad} at row 1, "
                                                r"outside \[0, C\) = \[0, 4\)"):
            ops.softmax_cross_entropy(x, t)
    g = torch.ones(3)
    stats = torch.zeros(3, 2)
    t = torch.tensor([0, 9, 1])
    with pytest.raises(RuntimeError, match="softmax_cross_entropy_backward: argument 'target' "
                                           "holds class index 9"):
        torch.ops.torchfn.softmax_cross_entropy_backward(g, x, t, stats, 0.0, IGNORE)
    with pytest.raises(RuntimeError, match="softmax_cross_entropy_double_backward: argument "
                                           "'target' holds class index 9"):
        torch.ops.torchfn.softmax_cross_entropy_double_backward(x, g, x, t, stats, 0.0, IGNORE)


def test_out_of_range_targets_on_the_twin_path():
    """CPU eager: the public op raises before the twin; the twin itself (and the op under
    vmap, where a check would be data-dependent) gives NaN rows with NaN gradients."""
    saved = _dispatch.get_rule(OP, "cpu")
    x = torch.randn(3, 4, dtype=torch.float64)
    t = torch.tensor([0, 4, IGNORE])
    try:
        _dispatch.set_rule(OP, "cpu", **_xent.RULES["cpu"])
        with pytest.raises(ValueError, match=r"softmax_cross_entropy\(target=...\): holds class "
                                             r"index 4 at position 1, outside \[0, C\) = \[0, 4\)"):
            ops.softmax_cross_entropy(x, t)
        for bad in (4, -1):
            tt = torch.tensor([[0, bad, IGNORE], [1, 2, 3]])
            rows = vmap(lambda x, t: ops.softmax_cross_entropy(x, t, reduction="none"),
                        in_dims=(None, 0))(x, tt)
            assert rows[0, 1].isnan() and rows[0, 2] == 0 and not rows[1].isnan().any()
            torch.testing.assert_close(rows[1], F.cross_entropy(x, tt[1], reduction="none"))
    finally:
        _dispatch.set_rule(OP, "cpu", **vars(saved))
    leaf = x.clone().requires_grad_(True)
    rows = reference.softmax_cross_entropy(leaf, t, reduction="none", label_smoothing=0.1)
    assert rows[1].isnan() and rows[2] == 0
    torch.testing.assert_close(rows[0], F.cross_entropy(x[:1], t[:1], reduction="sum",
                                                        label_smoothing=0.1))
    (g,) = torch.autograd.grad(rows[0] + rows[1], leaf)
    assert g[1].isnan().all() and not g[0].isnan().any() and (g[2] == 0).all()


def test_raw_kernels_check_arguments(kernels):
    x = torch.randn(3, 4)
    t = torch.tensor([0, 1, 2])
    stats = torch.zeros(3, 2)
    g = torch.ones(3)
    fwd = torch.ops.torchfn.softmax_cross_entropy
    bwd = torch.ops.torchfn.softmax_cross_entropy_backward
    dbl = torch.ops.torchfn.softmax_cross_entropy_double_backward
    cases = [
        (lambda: fwd(x.view(3, 2, 2), t, 0.0, IGNORE),
         r"softmax_cross_entropy: argument 'logits' must be 2-D \(N, C\), got 3-D"),
        (lambda: fwd(x.long(), t, 0.0, IGNORE), "argument 'logits' must be float32.*got dtype Long"),
        (lambda: fwd(x, t.int(), 0.0, IGNORE),
         "argument 'target' must hold int64 class indices, got dtype Int"),
        (lambda: fwd(x, t[:2], 0.0, IGNORE),
         r"argument 'target' must have shape \(N,\) = \[3\] to match 'logits'"),
        (lambda: fwd(x, t, 2.0, IGNORE), r"argument 'label_smoothing' must be in \[0, 1\], got 2"),
        (lambda: bwd(g.double(), x, t, stats, 0.0, IGNORE),
         "softmax_cross_entropy_backward: argument 'grad_loss' must have dtype Float"),
        (lambda: bwd(g, x, t, stats[:, :1], 0.0, IGNORE),
         r"argument 'stats' must have shape \(N, 2\) = \[3, 2\], got \[3, 1\]"),
        (lambda: bwd(g, x.double(), t, stats, 0.0, IGNORE),
         r"argument 'grad_loss' must have dtype Double \(the accumulation dtype of 'logits'"),
        (lambda: bwd(g, x, t, stats.double(), 0.0, IGNORE),
         "argument 'stats' must have dtype Float"),
        (lambda: dbl(x[:, :3], g, x, t, stats, 0.0, IGNORE),
         "double_backward: argument 'grad_grad_logits' must have the shape of 'logits'"),
        (lambda: fwd(x.requires_grad_(True), t, 0.0, IGNORE),
         "softmax_cross_entropy: argument 'logits' requires grad.*call the public torchfn.ops"),
    ]
    for fn, match in cases:
        with pytest.raises(RuntimeError, match=match):
            fn()


# ---------------------------------------------------------------------------------------------
# CUDA only: device checks and the NaN contract for out-of-range targets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_device_checks_and_out_of_range_targets(kernels):
    _need_device(kernels, "cuda")
    x = torch.randn(4, 6, device="cuda", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"softmax_cross_entropy\(target=...\): expected target "
                                         "on the device of logits"):
        ops.softmax_cross_entropy(x, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(RuntimeError, match="argument 'target' must be on the device of 'logits'"):
        torch.ops.torchfn.softmax_cross_entropy(x, torch.tensor([0, 1, 2, 3]), 0.0, IGNORE)
    with pytest.raises(RuntimeError, match="argument 'logits' must be on a cuda device"):
        torch.ops.torchfn.softmax_cross_entropy_backward(
            torch.ones(4, device="cuda", dtype=torch.float64), x.cpu(),
            torch.tensor([0, 1, 2, 3]), torch.zeros(4, 2, dtype=torch.float64), 0.0, IGNORE)
    # Out of range on CUDA: that row's loss and gradient are NaN (no host sync), others exact;
    # for C = 6 (vector loads), 7 and 4099 (peeled rows; warp and block rows).
    for c in (6, 7, 4099):
        x = torch.randn(4, c, device="cuda", dtype=torch.float64)
        t = torch.tensor([0, c, IGNORE, -3], device="cuda")
        leaf = x.clone().requires_grad_(True)
        rows = ops.softmax_cross_entropy(leaf, t, reduction="none")
        assert rows[1].isnan() and rows[3].isnan() and rows[2] == 0
        torch.testing.assert_close(rows[0], F.cross_entropy(x[:1], t[:1], reduction="sum"))
        (g,) = torch.autograd.grad(rows[0] + rows[1], leaf)
        assert g[1].isnan().all() and g[3].isnan().all() and (g[2] == 0).all()
        assert g[0].isfinite().all()
        assert ops.softmax_cross_entropy(x, t).isnan()
        twin = reference.softmax_cross_entropy(x, t, reduction="none")  # the twin: NaN rows too
        assert twin[1].isnan() and twin[3].isnan() and twin[2] == 0
    torch.cuda.synchronize()  # the context is healthy (no device-side assert)
