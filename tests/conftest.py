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
