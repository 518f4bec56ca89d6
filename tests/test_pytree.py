"""Tests for torchfn.functional._pytree against plain loops over dict items, in float64."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torchopt.pytree
from torch.func import grad, vmap

from torchfn.functional._pytree import (
    tree_add,
    tree_add_scaled,
    tree_dot,
    tree_global_norm,
    tree_map,
    tree_numel,
    tree_ones_like,
    tree_ravel,
    tree_scalar_mul,
    tree_sub,
    tree_zeros_like,
)

DT = torch.float64

# torch 2.13 itself warns (DeprecationWarning from torch.jit.script/script_method) the first time
# forward-mode AD or Inductor is imported; not ours to fix. See the report to the coordinator.

def _random_tree(seed: int, dtype: torch.dtype = DT) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # insertion order deliberately not sorted; includes a 0-d and a 3-d leaf
    return {
        "fc2.weight": torch.randn(2, 5, generator=g, dtype=dtype),
        "fc1.weight": torch.randn(5, 3, generator=g, dtype=dtype),
        "fc1.bias": torch.randn(5, generator=g, dtype=dtype),
        "scale": torch.randn((), generator=g, dtype=dtype),
        "conv.weight": torch.randn(2, 1, 3, generator=g, dtype=dtype),
    }


def _flat_reference(tree: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tree[k].reshape(-1) for k in sorted(tree)])


def test_reexports_are_torchopt_objects() -> None:
    assert tree_map is torchopt.pytree.tree_map is optree.tree_map
    assert tree_add is torchopt.pytree.tree_add
    assert tree_sub is torchopt.pytree.tree_sub
    assert tree_scalar_mul is torchopt.pytree.tree_scalar_mul
    a, b = _random_tree(0), _random_tree(1)
    s = torch.tensor(0.7, dtype=DT)
    expected = {k: s * (a[k] + b[k] - b[k]) for k in a}
    got = tree_scalar_mul(s, tree_sub(tree_add(a, b), b))
    assert list(got) == list(a)  # insertion order kept
    for k in a:
        torch.testing.assert_close(got[k], expected[k])


def test_tree_add_scaled_matches_loop_and_differentiates_alpha() -> None:
    a, b = _random_tree(0), _random_tree(1)
    for alpha in (-0.3, torch.tensor(1.7, dtype=DT)):
        got = tree_add_scaled(a, b, alpha)
        for k in a:
            torch.testing.assert_close(got[k], a[k] + alpha * b[k], rtol=0, atol=0)

    def f(alpha: torch.Tensor) -> torch.Tensor:
        return sum(v.sum() for v in tree_add_scaled(a, b, alpha).values())

    d_alpha = grad(f)(torch.tensor(0.5, dtype=DT))
    torch.testing.assert_close(d_alpha, sum(v.sum() for v in b.values()))


def test_tree_dot_matches_loop_and_vdot_of_ravel() -> None:
    a, b = _random_tree(0), _random_tree(1)
    expected = sum((a[k] * b[k]).sum() for k in a)
    torch.testing.assert_close(tree_dot(a, b), expected)
    torch.testing.assert_close(tree_dot(a, b), torch.dot(_flat_reference(a), _flat_reference(b)))
    # gradient with respect to the first tree is the second tree
    g = grad(tree_dot)(a, b)
    for k in a:
        torch.testing.assert_close(g[k], b[k])


def test_tree_dot_mixed_dtypes_promotes() -> None:
    a = {"x": torch.randn(4, dtype=torch.float32), "y": torch.randn(3, dtype=DT)}
    out = tree_dot(a, a)
    assert out.dtype == DT
    torch.testing.assert_close(out, (a["x"].double() ** 2).sum() + (a["y"] ** 2).sum())


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_tree_global_norm_matches_norm_of_ravel(p: float) -> None:
    t = _random_tree(3)
    expected = torch.linalg.vector_norm(_flat_reference(t), ord=p)
    got = tree_global_norm(t, p)
    assert got.shape == ()
    torch.testing.assert_close(got, expected)
    # gradient matches the gradient of the raveled norm
    flat, unravel = tree_ravel(t)
    g_ref = unravel(grad(lambda v: torch.linalg.vector_norm(v, ord=p))(flat))
    g = grad(tree_global_norm)(t, p)
    for k in t:
        torch.testing.assert_close(g[k], g_ref[k])


def test_zeros_ones_numel() -> None:
    t = _random_tree(0)
    z, o = tree_zeros_like(t), tree_ones_like(t)
    for k in t:
        assert z[k].shape == t[k].shape and z[k].dtype == t[k].dtype
        assert torch.equal(z[k], torch.zeros_like(t[k]))
        assert torch.equal(o[k], torch.ones_like(t[k]))
    assert tree_numel(t) == sum(v.numel() for v in t.values()) == 10 + 15 + 5 + 1 + 6


def test_tree_ravel_round_trip_preserves_shapes_and_dtypes() -> None:
    t = _random_tree(0)
    t["half"] = torch.randn(2, 2, dtype=torch.float32)
    vec, unravel = tree_ravel(t)
    assert vec.shape == (tree_numel(t),) and vec.dtype == DT
    expected = torch.cat([t[k].reshape(-1).to(DT) for k in sorted(t)])
    assert torch.equal(vec, expected)
    back = unravel(vec)
    assert list(back) == list(t)
    for k in t:
        assert back[k].dtype == t[k].dtype and back[k].shape == t[k].shape
        assert torch.equal(back[k], t[k])


def test_tree_ravel_nested_and_tuple_trees() -> None:
    g = torch.Generator().manual_seed(0)
    t = {"enc": {"w": torch.randn(3, 2, generator=g, dtype=DT)},
         "dec": (torch.randn(4, generator=g, dtype=DT), torch.randn(1, 1, generator=g, dtype=DT))}
    vec, unravel = tree_ravel(t)
    ref = torch.cat([x.reshape(-1) for x in optree.tree_leaves(t)])
    assert torch.equal(vec, ref)
    back = unravel(vec * 2)
    assert optree.tree_structure(back) == optree.tree_structure(t)
    for x, y in zip(optree.tree_leaves(back), optree.tree_leaves(t), strict=True):
        assert torch.equal(x, 2 * y)


def test_tree_ravel_under_vmap_and_grad() -> None:
    members = [_random_tree(s) for s in range(4)]
    stacked = {k: torch.stack([m[k] for m in members]) for k in members[0]}
    vecs = vmap(lambda t: tree_ravel(t)[0])(stacked)
    for i, m in enumerate(members):
        torch.testing.assert_close(vecs[i], _flat_reference(m), rtol=0, atol=0)
    _, unravel = tree_ravel(members[0])
    back = vmap(unravel)(vecs)
    for k in stacked:
        torch.testing.assert_close(back[k], stacked[k], rtol=0, atol=0)

    # grad through unravel == ravel of the grad over the tree
    t = members[1]

    def loss(tree: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((torch.sin(v) * (i + 1)).sum() for i, v in enumerate(tree.values()))

    vec, unravel = tree_ravel(t)
    g_flat = grad(lambda v: loss(unravel(v)))(vec)
    g_tree = grad(loss)(t)
    torch.testing.assert_close(g_flat, tree_ravel(g_tree)[0])


def test_pytree_ops_compile_fullgraph_match_eager() -> None:
    a, b = _random_tree(0), _random_tree(1)

    def step(a: dict, b: dict, lr: torch.Tensor) -> tuple:
        vec, unravel = tree_ravel(tree_add_scaled(a, b, lr))
        new = unravel(vec * 0.5)
        return new, tree_dot(new, b), tree_global_norm(new), tree_global_norm(b, math.inf)

    # Dynamo tracing (fullgraph) is what is under test; aot_eager skips slow C++ codegen.
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    lr = torch.tensor(-0.1, dtype=DT)
    got, expected = compiled(a, b, lr), step(a, b, lr)
    for x, y in zip(optree.tree_leaves(got), optree.tree_leaves(expected), strict=True):
        torch.testing.assert_close(x, y)


def test_mismatched_keys_error_names_keys() -> None:
    a = _random_tree(0)
    b = dict(a)
    b.pop("scale")
    b["extra"] = torch.zeros(1, dtype=DT)
    with pytest.raises(ValueError, match=r"tree_dot: `tree_y`.*missing keys \['scale'\], "
                                         r"extra keys \['extra'\]"):
        tree_dot(a, b)
    with pytest.raises(ValueError, match=r"tree_add_scaled: .*missing keys \['scale'\]"):
        tree_add_scaled(a, b, 1.0)
    # torchopt's re-exported tree_add reports key differences through optree
    with pytest.raises(ValueError, match=r"missing key\(s\): \['scale'\]"):
        tree_add(a, b)


def test_mismatched_shapes_and_containers_errors() -> None:
    a = _random_tree(0)
    b = dict(a, **{"fc1.bias": torch.zeros(4, dtype=DT)})
    with pytest.raises(ValueError, match=r"leaf 'fc1.bias' has shape \(5,\) in `tree_x` but "
                                         r"\(4,\)"):
        tree_dot(a, b)
    with pytest.raises(ValueError, match="different containers"):
        tree_dot({"a": (a["scale"],)}, {"a": [a["scale"]]})


def test_unravel_and_norm_argument_errors() -> None:
    _, unravel = tree_ravel(_random_tree(0))
    with pytest.raises(ValueError, match=r"expected a 1-D tensor of shape \(37,\), got \(36,\)"):
        unravel(torch.zeros(36, dtype=DT))
    with pytest.raises(ValueError, match=r"got \(2, 37\).*vmap"):
        unravel(torch.zeros(2, 37, dtype=DT))
    with pytest.raises(ValueError, match=r"`p` must be a number > 0 or math.inf, got 0"):
        tree_global_norm(_random_tree(0), 0)
    with pytest.raises(TypeError, match=r"leaf 'n' is a int"):
        tree_ravel({"n": 3, "w": torch.zeros(2)})
