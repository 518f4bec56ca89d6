"""The grouped-conv double-backward graph pass: same meta-gradients, fewer convolutions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _meta_nets import DT, N_TASKS, conv_net, conv_tasks
from torch.fx.experimental.proxy_tensor import make_fx

from torchfn.compile import inductor_options
from torchfn.compile._conv_pass import (
    GroupedConvDoubleBackwardPass,
    fuse_grouped_conv_double_backward,
)
from torchfn.functional import make_functional
from torchfn.meta import maml


def _meta_grad_fn(inner_steps: int):
    model_fn, params, _ = make_functional(conv_net())
    learner = maml(model_fn, F.cross_entropy, inner_lr=0.1, inner_steps=inner_steps)
    return (lambda p, t: learner.meta_grad(p, {}, t)[0]), params


def _n_convs(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.aten.convolution.default for n in gm.graph.nodes)


def _assert_close(got: dict, want: dict) -> None:
    # conv biases in front of BatchNorm have an exactly-zero gradient: compare on the global scale
    scale = max(float(w.abs().max()) for w in want.values())
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-13 * scale, msg=k)


@pytest.mark.parametrize("inner_steps", [1, 3])
def test_pass_rewrites_the_per_task_loop_and_keeps_the_meta_gradient(inner_steps):
    f, params = _meta_grad_fn(inner_steps)
    tasks = conv_tasks()
    gm = make_fx(f)(params, tasks)
    gm.graph.eliminate_dead_code()  # the pass removes dead code, so count without it
    before = _n_convs(gm)
    rewrites = fuse_grouped_conv_double_backward(gm.graph)
    gm.recompile()
    # per conv layer whose input needs a gradient (layer 2) and inner step: the first step
    # (weights shared by the tasks) has one conv(ggI.T, gO.T), each later step (per-task
    # weights) a loop of N_TASKS of them; each becomes one convolution_backward
    assert rewrites == inner_steps
    assert _n_convs(gm) == before - (inner_steps - 1) * N_TASKS - 1
    assert sum(n.target is torch.ops.aten.convolution_backward.default
               for n in gm.graph.nodes) >= rewrites
    _assert_close(gm(params, tasks), f(params, tasks))


def test_pass_leaves_graphs_without_the_pattern_alone():
    x, w = torch.randn(2, 4, 5, 5, dtype=DT), torch.randn(4, 4, 3, 3, dtype=DT)
    gm = make_fx(lambda x, w: torch.cat([F.conv2d(x, w, padding=1)] * 2, 1))(x, w)
    code = gm.code
    assert fuse_grouped_conv_double_backward(gm.graph) == 0
    assert gm.code == code


def test_inductor_options():
    opts = inductor_options()
    assert isinstance(opts["post_grad_custom_pre_pass"], GroupedConvDoubleBackwardPass)
    assert opts["post_grad_custom_pre_pass"].uuid() == GroupedConvDoubleBackwardPass().uuid()


@pytest.mark.slow
def test_inductor_with_the_pass_equals_eager():
    """Inductor (CPU) with the pass installed: same meta-gradient, and the pass did rewrite."""
    counts = []

    class Counting(GroupedConvDoubleBackwardPass):
        def __call__(self, graph):
            counts.append(fuse_grouped_conv_double_backward(graph))

    f, params = _meta_grad_fn(2)
    tasks = conv_tasks()
    # no on-disk caches: a cached graph (same pass uuid, from an earlier run) skips the pass
    with torch._functorch.config.patch(enable_autograd_cache=False):
        got = torch.compile(f, fullgraph=True,
                            options={"post_grad_custom_pre_pass": Counting(),
                                     "fx_graph_cache": False})(params, tasks)
    _assert_close(got, f(params, tasks))
    assert sum(counts) == 2


class _ConvLayouts(torch.utils._python_dispatch.TorchDispatchMode):
    """Record (op, groups, activation inputs channels-last?) of every convolution call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func is aten.convolution.default:
            self.calls.append(("fwd", args[8], _cl(args[0])))
        elif func is aten.convolution_backward.default:
            self.calls.append(("bwd", args[9], _cl(args[0]) and _cl(args[1])))
        return func(*args, **(kwargs or {}))


def _cl(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def test_channels_last_pass_converts_only_wide_grouped_convs_and_keeps_the_meta_gradient():
    from torchfn.compile._conv_layout import channels_last_grouped_convs

    f, params = _meta_grad_fn(3)
    tasks = conv_tasks()
    gm = make_fx(f, tracing_mode="fake")(params, tasks)
    fuse_grouped_conv_double_backward(gm.graph)
    # layer 2 has 3 input channels per task; layer 1 has 1 (stays NCHW)
    assert channels_last_grouped_convs(gm.graph, min_group_channels=2) > 0
    gm.recompile()
    with _ConvLayouts() as rec:
        got = gm(params, tasks)
    _assert_close(got, f(params, tasks))
    grouped = [c for c in rec.calls if c[1] > 1]
    wide = [c for c in grouped if c[2]]
    # the later inner steps' layer-2 forward and backward convolutions are channels-last;
    # layer 1 (one channel per task) and ungrouped ones (first step: shared weights) are not
    assert len(wide) >= 3 and len(wide) < len(grouped), rec.calls
    # nothing grouped is channels-last without the pass
    gm0 = make_fx(f, tracing_mode="fake")(params, tasks)
    with _ConvLayouts() as rec0:
        gm0(params, tasks)
    assert not any(cl for _, _, cl in rec0.calls)


def test_channels_last_pass_leaves_ungrouped_convs_alone():
    from torchfn.compile._conv_layout import channels_last_grouped_convs

    x, w = torch.randn(2, 4, 6, 6, dtype=DT), torch.randn(4, 4, 3, 3, dtype=DT)
    gm = make_fx(lambda x, w: F.conv2d(x, w, padding=1), tracing_mode="fake")(x, w)
    code = gm.code
    assert channels_last_grouped_convs(gm.graph, min_group_channels=1) == 0
    assert gm.code == code


def test_inductor_options_channels_last_flag_changes_the_cache_key():
    on, off = inductor_options(channels_last=True), inductor_options(channels_last=False)
    assert on["post_grad_custom_pre_pass"].channels_last is True
    assert inductor_options()["post_grad_custom_pre_pass"].channels_last == "auto"
    assert on["post_grad_custom_pre_pass"].uuid() != off["post_grad_custom_pre_pass"].uuid()
    # "auto" decides by the cuDNN TF32 switch when it runs: the switch is part of the key
    auto = inductor_options()["post_grad_custom_pre_pass"]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        key_tf32 = auto.uuid()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        key_fp32 = auto.uuid()
    assert key_tf32 != key_fp32


def test_bad_channels_last_is_refused():
    with pytest.raises(ValueError, match="channels_last: expected True, False or 'auto', "
                                         "got 'yes'"):
        inductor_options(channels_last="yes")


def _fake_grouped_conv_graph(device: str, dtype: torch.dtype) -> torch.fx.GraphModule:
    # fake tensors may live on "cuda" without a GPU: the pass only reads their metadata
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 4 * 16, 7, 7, device=device, dtype=dtype)
        w = torch.empty(4 * 8, 16, 3, 3, device=device, dtype=dtype)
    return make_fx(lambda x, w: F.conv2d(x, w, padding=1, groups=4))(x, w)


@pytest.mark.parametrize("device, dtype, tf32, expected", [
    ("cuda", torch.float32, True, 1),     # tensor-core NHWC kernels: 49 ms step on an H100
    ("cuda", torch.float32, False, 0),    # fp32 NHWC grouped kernels: measured slower
    ("cuda", torch.float64, True, 0),
    ("cpu", torch.float32, True, 0),
])
def test_auto_channels_last_only_where_it_pays(device, dtype, tf32, expected):
    from torchfn.compile._conv_layout import channels_last_grouped_convs, channels_last_pays

    gm = _fake_grouped_conv_graph(device, dtype)
    x_val = next(iter(gm.graph.nodes)).meta["val"]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
        assert channels_last_pays(x_val) == bool(expected)
        assert channels_last_grouped_convs(gm.graph, auto=True) == expected
    # without auto the rewrite is unconditional (16 channels per group >= 16)
    assert channels_last_grouped_convs(_fake_grouped_conv_graph(device, dtype).graph) == 1


@pytest.mark.slow
def test_inductor_with_the_channels_last_pass_equals_eager():
    """Inductor (CPU) with both rewrites on the 3-channel net: same meta-gradient."""
    f, params = _meta_grad_fn(2)
    tasks = conv_tasks()
    with torch._functorch.config.patch(enable_autograd_cache=False):
        got = torch.compile(f, fullgraph=True, options={
            "post_grad_custom_pre_pass": GroupedConvDoubleBackwardPass(
                channels_last=True, min_group_channels=2),
            "fx_graph_cache": False})(params, tasks)
    _assert_close(got, f(params, tasks))
