"""unfold_convs / UnfoldConv2d: the same convolution (values, gradients to second order, MAML
meta-gradients) as nn.Conv2d, in float64 on random inputs; only eligible layers are swapped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _meta_nets import DT, conv_net, conv_tasks
from torch import nn

from torchfn.compile import unfold_convs
from torchfn.compile._unfold_conv import UnfoldConv2d
from torchfn.functional import make_functional
from torchfn.meta import Task, maml

CONVS = [
    pytest.param(lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 6, 5), id="3x3-pad1"),
    pytest.param(lambda: nn.Conv2d(2, 5, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
                 (2, 7, 6), id="stride-pad-dilation"),
    pytest.param(lambda: nn.Conv2d(3, 2, 3, padding="valid", bias=False), (3, 5, 5),
                 id="valid-nobias"),
]


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize(("make", "shape"), CONVS)
def test_unfold_conv_equals_conv2d_to_second_order(make, shape, batched) -> None:
    torch.manual_seed(0)
    conv = make().to(DT)
    fast = UnfoldConv2d(conv)  # shares conv's parameters
    x = torch.randn(*((4,) if batched else ()), *shape, dtype=DT, requires_grad=True)
    target = torch.randn_like(conv(x))

    def second_order(module: nn.Module) -> list[torch.Tensor]:
        out = module(x)
        loss = ((out - target) ** 2).sum()
        params = [x, *module.parameters()]
        first = torch.autograd.grad(loss, params, create_graph=True)
        penalty = sum((g ** 2).sum() for g in first)  # a gradient penalty: double backward
        return [out, *first, *torch.autograd.grad(penalty, params)]

    for got, want in zip(second_order(fast), second_order(conv), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_unfold_convs_swaps_only_eligible_layers() -> None:
    class MyConv(nn.Conv2d):
        pass

    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3),                             # patch 9 < 64: stays
        nn.Conv2d(8, 8, 3),                             # patch 72: swapped
        nn.Sequential(nn.Conv2d(8, 8, 3, groups=2)),    # grouped: stays
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"),  # padding mode: stays
        nn.Conv2d(8, 8, 3, padding="same"),             # 'same': stays
        MyConv(8, 8, 3),                                # subclass: stays
    )
    fast = unfold_convs(net)
    kinds = [type(m).__name__ for m in fast.modules()][1:]
    assert kinds == ["Conv2d", "UnfoldConv2d", "Sequential", "Conv2d", "Conv2d", "Conv2d",
                     "MyConv"]
    assert all(type(m) is nn.Conv2d for m in net[:2])  # the original is left alone
    want, got = dict(net.named_parameters()), dict(fast.named_parameters())
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k] is not want[k]
    assert type(unfold_convs(net, min_patch=1)[0]) is UnfoldConv2d
    assert type(unfold_convs(nn.Conv2d(8, 8, 3))) is UnfoldConv2d  # a bare conv as the root
    x = torch.randn(2, 1, 16, 16)
    torch.testing.assert_close(fast(x), net(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_maml_meta_gradient_is_unchanged(compiled) -> None:
    """Second-order MAML with BatchNorm over vmapped tasks: same meta-gradient as nn.Conv2d."""
    net = conv_net()
    tasks = conv_tasks()
    compile_kw = {"backend": "aot_eager"} if compiled else None
    want = _meta_grad(net, tasks)
    got = _meta_grad(unfold_convs(net, min_patch=1), tasks, compile_kw)
    assert sorted(got) == sorted(want)
    _assert_close_on_global_scale(got, want, 1e-12)


def _meta_grad(module: nn.Module, tasks: Task,
               compile_kw: dict | None = None) -> dict[str, torch.Tensor]:
    """Second-order MAML meta-gradient (2 inner steps), compiled with ``compile_kw`` if given."""
    model_fn, params, buffers = make_functional(module)
    fn = maml(model_fn, F.cross_entropy, inner_lr=0.1, inner_steps=2).meta_grad
    if compile_kw is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, **compile_kw)
    return fn(params, buffers, tasks)[0]


def _assert_close_on_global_scale(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                                  tol: float) -> None:
    # conv biases in front of BatchNorm have an exactly-zero gradient: compare on the global scale
    scale = max(float(w.abs().max()) for w in want.values())
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k], rtol=0, atol=tol * scale, msg=k)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"UnfoldConv2d\(conv\): expected groups=1.*groups=2"):
        UnfoldConv2d(nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(TypeError, match=r"expected an nn.Conv2d, got Conv1d"):
        UnfoldConv2d(nn.Conv1d(4, 4, 3))  # type: ignore[arg-type]
    fast = UnfoldConv2d(nn.Conv2d(4, 4, 3))
    with pytest.raises(ValueError, match=r"expected input \(B, 4, H, W\).*got shape \(2, 3, 8, 8\)"):
        fast(torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match=r"min_patch=...\): expected an int >= 1, got 0"):
        unfold_convs(nn.Conv2d(4, 4, 3), min_patch=0)
    with pytest.raises(TypeError, match=r"unfold_convs\(module\): expected an nn.Module, got str"):
        unfold_convs("net")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize(("min_patch", "options"), [
    (27, None),  # the second conv only (patch 3 * 3 * 3)
    # every conv: the 1-channel first one unfolded trips Inductor's mix-order reduction on CUDA
    # (torch 2.11: "AssertionError: 9 v.s. 3"); the documented workaround
    (1, {"triton.mix_order_reduction": False}),
], ids=["min_patch27", "min_patch1-no-mix-order"])
def test_cuda_compiled_maml_with_unfolded_convs_equals_eager_conv2d(min_patch, options) -> None:
    """Unfolded convs under Inductor on the GPU: the same meta-gradient, in float64, as eager
    second-order MAML through ``nn.Conv2d`` on the CPU."""
    net, tasks = conv_net(), conv_tasks()
    want = _meta_grad(net, tasks)
    fast = unfold_convs(net, min_patch=min_patch).cuda()
    assert isinstance(fast[4 if min_patch > 9 else 0], UnfoldConv2d)
    got = _meta_grad(fast, Task(*(t.cuda() for t in tasks)), {"options": options})
    _assert_close_on_global_scale(got, want, 1e-10)


def test_unfold_convs_only_picks_convs_by_qualified_name() -> None:
    # ``only`` sees each eligible conv's qualified name and keeps the others convolutions
    net = nn.Sequential(nn.Conv2d(8, 8, 3), nn.Sequential(nn.Conv2d(8, 8, 3), nn.ReLU()))
    seen: list[str] = []
    out = unfold_convs(net, only=lambda path: seen.append(path) or path == "1.0")
    assert seen == ["0", "1.0"]
    assert [type(m).__name__ for m in (out[0], out[1][0])] == ["Conv2d", "UnfoldConv2d"]
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    torch.testing.assert_close(out.double()(x), net.double()(x))
