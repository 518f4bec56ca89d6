"""The grouped-conv double-backward graph pass: same meta-gradients, fewer convolutions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from torchfn.functional import make_functional
from torchfn.meta import (
    GroupedConvDoubleBackwardPass,
    Task,
    fuse_grouped_conv_double_backward,
    inductor_options,
    maml,
)

DT = torch.float64
N_TASKS, N_WAY, SIZE = 3, 4, 8


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    c_in = 1
    for _ in range(2):
        layers += [nn.Conv2d(c_in, 3, 3, padding=1), nn.BatchNorm2d(3, track_running_stats=False),
                   nn.ReLU(), nn.MaxPool2d(2)]
        c_in = 3
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(3 * (SIZE // 4) ** 2, N_WAY)).to(DT)


def _tasks() -> Task:
    g = torch.Generator().manual_seed(1)
    labels = torch.arange(N_WAY).repeat(N_TASKS, 2)
    return Task(torch.randn(N_TASKS, 2 * N_WAY, 1, SIZE, SIZE, generator=g, dtype=DT), labels,
                torch.randn(N_TASKS, 2 * N_WAY, 1, SIZE, SIZE, generator=g, dtype=DT), labels)


def _meta_grad_fn(inner_steps: int):
    model_fn, params, _ = make_functional(_conv_net())
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
    tasks = _tasks()
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
    tasks = _tasks()
    # no on-disk caches: a cached graph (same pass uuid, from an earlier run) skips the pass
    with torch._functorch.config.patch(enable_autograd_cache=False):
        got = torch.compile(f, fullgraph=True,
                            options={"post_grad_custom_pre_pass": Counting(),
                                     "fx_graph_cache": False})(params, tasks)
    _assert_close(got, f(params, tasks))
    assert sum(counts) == 2
