"""One task's second-order MAML meta-gradient with O(1) activation memory in the inner steps.

The plain-SGD inner loop ``theta_{k+1} = theta_k - a * g_k`` with
``g_k = grad_theta L_s(theta_k, phi)`` (``phi``: the params the inner loop does not adapt;
``a``: the inner rate, a float or Meta-SGD's learned per-element rates) ends in the query loss
``L_q(theta_K, phi)``. Its meta-gradient is computed by a hand-written reverse pass instead of
autograd through the unrolled loop:

- forward: keep only the iterates ``theta_0 .. theta_{K-1}`` (and the buffers each step saw),
  no activations: every inner gradient is a finished ``torch.func.grad``;
- ``v = dL_q/dtheta_K``, ``g_phi = dL_q/dphi``;
- for ``k = K-1 .. 0``: recompute step ``k``'s support forward and backward at ``theta_k`` and
  take the vector-Jacobian product of ``(theta, phi) -> g_k`` with ``u = a * v``:
  ``v <- v - d g_k/d theta^T u``, ``g_phi <- g_phi - d g_k/d phi^T u``, and for learned rates
  ``g_a <- g_a - g_k * v`` (with ``v`` before the update).

Only one inner step's activations live at a time; the cost is one more forward and backward
of the support loss per inner step. Buffers are threaded as in the unrolled loop (step ``k``
runs with the buffers step ``k - 1`` returned) and are treated as state, not differentiated:
exact for BatchNorm in either mode (training mode normalises with batch statistics and never
reads the running ones it updates).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.func import grad, grad_and_value, vjp

from torchfn._checks import _call_model, _part

__all__: list[str] = []

TensorDict = dict[str, Tensor]


def remat_task_grad(
    model_fn: Callable[..., Any],
    loss_fn: Callable[[Any, Tensor], Tensor],
    model_names: list[str],
    adapted: list[str],
    rates: Mapping[str, Tensor | float],
    inner_steps: int,
    meta_params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    task: Any,
    loss_scale: Tensor | None,
) -> tuple[TensorDict, dict[str, Tensor], Tensor, TensorDict]:
    """Return ``(grads of the adapted and fixed model params, grads of the rates, query loss,
    buffers after the query forward)`` for one task (no task dim; vmap it over tasks).

    ``rates[name]`` is the inner step size of adapted param ``name``: a float (MAML, ANIL) or a
    tensor of the param's shape (Meta-SGD, whose rate gradients come back in the second dict,
    keyed by the param name; empty for float rates). ``loss_scale`` multiplies the
    differentiated query loss (not the returned loss).
    """
    fixed = [k for k in model_names if k not in adapted]
    phi = {k: meta_params[k] for k in fixed}

    def merged(f: Mapping[str, Tensor], ph: Mapping[str, Tensor]) -> TensorDict:
        return {k: f[k] if k in f else ph[k] for k in model_names}

    def support_loss(f: TensorDict, ph: TensorDict, bufs: TensorDict) -> tuple[Tensor, TensorDict]:
        out, new_bufs = _call_model(model_fn, merged(f, ph), bufs, task.support_x,
                                    "meta-learner (support_x)")
        return loss_fn(out, task.support_y), new_bufs

    support_grad = grad(support_loss, has_aux=True)

    fast = {k: meta_params[k] for k in adapted}
    bufs = dict(buffers)
    iterates: list[tuple[TensorDict, TensorDict]] = []
    with _part("torchfn.inner_loop"):
        for _ in range(inner_steps):
            iterates.append((fast, bufs))
            g, bufs = support_grad(fast, phi, bufs)
            fast = {k: fast[k] - rates[k] * g[k] for k in adapted}

    def query_loss(f: TensorDict, ph: TensorDict) -> tuple[Tensor, tuple[Tensor, TensorDict]]:
        out, new_bufs = _call_model(model_fn, merged(f, ph), bufs, task.query_x,
                                    "meta-learner (query_x)")
        loss = loss_fn(out, task.query_y)
        scaled = loss
        if loss_scale is not None:
            scaled = loss.to(torch.promote_types(loss.dtype, torch.float32)) * loss_scale
        return scaled, (loss.detach(), new_bufs)

    with _part("torchfn.outer_grad"):
        (v, g_phi), (_, (loss, out_bufs)) = grad_and_value(
            query_loss, argnums=(0, 1), has_aux=True)(fast, phi)
        g_rate = {k: torch.zeros_like(r) for k, r in rates.items() if isinstance(r, Tensor)}
        for theta_k, bufs_k in reversed(iterates):
            def step_grad(f: TensorDict, ph: TensorDict, b: TensorDict = bufs_k) -> tuple[
                    TensorDict, TensorDict]:
                return support_grad(f, ph, b)

            g_k, vjp_fn, _ = vjp(step_grad, theta_k, phi, has_aux=True)
            hv_theta, hv_phi = vjp_fn({k: rates[k] * v[k] for k in adapted})
            for k in g_rate:
                g_rate[k] = g_rate[k] - g_k[k] * v[k]
            v = {k: v[k] - hv_theta[k] for k in adapted}
            g_phi = {k: g_phi[k] - hv_phi[k] for k in fixed}
    return {**v, **g_phi}, g_rate, loss, out_bufs
