"""Shared pytest configuration: every test starts from, and leaves, the same global state."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Restore torch's default dtype, RNG state and Dynamo caches around every test."""
    dtype = torch.get_default_dtype()
    rng = torch.random.get_rng_state()
    grad_enabled = torch.is_grad_enabled()
    yield
    torch.set_default_dtype(dtype)
    torch.random.set_rng_state(rng)
    torch.set_grad_enabled(grad_enabled)
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def kernels() -> dict:
    """Build (or load the cached) custom-op kernels once; fail loudly if they do not build."""
    from torchfn import ops
    from torchfn.ops import _build

    if _build.mode() == "reference":
        pytest.skip("TORCHFN_OPS=reference: the kernels are deliberately not built")
    report = ops.build_ops()
    assert report["ok"], f"torchfn kernels failed to build: {report['reason']}"
    return report
