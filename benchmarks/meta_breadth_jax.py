"""The JAX twins of ``benchmarks/meta_breadth.py``: iMAML and ProtoNet outer steps, own process.

``benchmarks/meta_breadth.py`` writes the weights (copied from the torch module), the task batch
and the algorithm's settings to an ``.npz`` file and runs
``python benchmarks/meta_breadth_jax.py IN.npz OUT.npz``. Like ``meta_jax.py`` (whose conv net
and cross-entropy this file imports) it imports only numpy and jax.

The computations, identical to torchfn's:

- ``algo='imaml'`` (``torchfn.meta.imaml``): per task, ``inner_steps`` plain SGD steps
  (``inner_lr``) on the proximal support loss ``L_s(phi) + lam/2 ||phi - theta||^2`` from
  ``phi = theta`` (nothing differentiated through them); then ``cg_steps`` conjugate-gradient
  iterations from 0 on ``((1 + cg_damping) I + H / lam) g = grad L_q(phi*)``, ``H`` the Hessian
  of ``L_s`` at ``phi*`` (Hessian-vector products by ``jax.linearize`` of ``grad L_s``:
  forward-over-reverse, linearised once per task); the same zero-guarded step sizes as torchfn's
  CG. The meta-gradient is the mean of the tasks' ``g`` (tasks vmapped), the loss the mean query
  loss at ``phi*``. ``inner_loop='unroll'`` (default) unrolls the inner steps in Python (as
  torch does); ``'fori'`` uses ``lax.fori_loop`` (compile time independent of the steps).
- ``algo='protonet'`` (``torchfn.meta.protonet``, squared Euclidean): the conv net without its
  head embeds support and query set (two calls: BatchNorm normalises each with its own batch
  statistics); the logits are ``-scale * ||z_q - proto_c||^2``, ``proto_c`` the mean support
  embedding of class ``c``; ``jax.value_and_grad`` of the mean query cross-entropy.

Both are ``jax.jit``-ed and timed like ``meta_jax.py``: the first call alone (compile,
``compile_s``), ``warmup - 1`` more calls, then ``repeats`` calls each ended by
``block_until_ready``, median. Precision ``'highest'`` (no TF32) unless ``precision='tf32'``.
``peak_bytes`` is the device's ``peak_bytes_in_use`` over the process (this one step only).

OUT.npz holds ``grad:<name>`` (keyed like torch's ``named_parameters()``), ``loss``,
``times_s``, ``median_s``, ``compile_s``, ``peak_bytes`` (-1 where not reported), ``device``,
``jax_version``; or ``skipped`` when jax cannot be imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # report real peaks

from meta_jax import conv_net, cross_entropy, run_twin  # numpy/jax only, same folder


def _safe_div(num, den):
    """``num / den``, and 0 where ``den`` is 0 (as torchfn's CG)."""
    import jax.numpy as jnp

    nonzero = den != 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, jnp.ones_like(den)),
                     jnp.zeros_like(num))


def conjugate_gradient(matvec, b, steps: int):
    """Return ``x ~ A^{-1} b`` after ``steps`` CG iterations from 0 (pytrees; fixed count)."""
    import jax
    import jax.numpy as jnp

    tm = jax.tree_util.tree_map

    def dot(a, c):
        return sum(jnp.sum(u * v) for u, v in zip(jax.tree_util.tree_leaves(a),
                                                  jax.tree_util.tree_leaves(c), strict=True))

    x = tm(jnp.zeros_like, b)
    r = p = b
    rr = dot(r, r)
    for _ in range(steps):
        ap = matvec(p)
        alpha = _safe_div(rr, dot(p, ap))
        x = tm(lambda xi, pi, a=alpha: xi + a * pi, x, p)
        r = tm(lambda ri, api, a=alpha: ri - a * api, r, ap)
        rr_new = dot(r, r)
        beta = _safe_div(rr_new, rr)
        p = tm(lambda ri, pi, b=beta: ri + b * pi, r, p)
        rr = rr_new
    return x


def make_imaml_grad(*, n_blocks: int, eps: float, inner_lr: float, inner_steps: int, lam: float,
                    cg_steps: int, cg_damping: float, precision, inner_loop: str = "unroll"):
    """Return ``meta_grad(theta, sx, sy, qx, qy) -> (loss, grads)``: iMAML, tasks vmapped."""
    import jax
    import jax.numpy as jnp

    tm = jax.tree_util.tree_map

    def loss(p, x, y):
        return cross_entropy(conv_net(p, x, n_blocks=n_blocks, eps=eps, precision=precision), y)

    def task_grad(theta, sx, sy, qx, qy):
        def support_grad(p):
            return jax.grad(loss)(p, sx, sy)

        def step(phi):
            g = support_grad(phi)
            return tm(lambda w, gw, t: w - inner_lr * (gw + lam * (w - t)), phi, g, theta)

        if inner_loop == "fori":
            phi = jax.lax.fori_loop(0, inner_steps, lambda _, p: step(p), theta)
        else:
            phi = theta
            for _ in range(inner_steps):
                phi = step(phi)
        phi = jax.lax.stop_gradient(phi)
        q_loss, gq = jax.value_and_grad(loss)(phi, qx, qy)
        _, hvp = jax.linearize(support_grad, phi)
        diag, inv_lam = 1.0 + cg_damping, 1.0 / lam

        def matvec(v):
            return tm(lambda vi, hi: diag * vi + inv_lam * hi, v, hvp(v))

        return conjugate_gradient(matvec, gq, cg_steps), q_loss

    def meta_grad(theta, sx, sy, qx, qy):
        g, losses = jax.vmap(task_grad, in_axes=(None, 0, 0, 0, 0))(theta, sx, sy, qx, qy)
        return jnp.mean(losses), tm(lambda a: jnp.mean(a, axis=0), g)

    return meta_grad


def make_protonet_loss(*, n_blocks: int, eps: float, n_way: int, scale: float, precision):
    """Return ``meta_loss(params, sx, sy, qx, qy)``: the mean ProtoNet query cross-entropy."""
    import jax
    import jax.numpy as jnp

    def embed(p, x):
        return conv_net(p, x, n_blocks=n_blocks, eps=eps, precision=precision, head=False)

    def task_loss(p, sx, sy, qx, qy):
        zs, zq = embed(p, sx), embed(p, qx)
        onehot = (sy[:, None] == jnp.arange(n_way)).astype(zs.dtype)  # (K, n_way)
        protos = jnp.matmul(onehot.T, zs, precision=precision) / jnp.sum(onehot, 0)[:, None]
        dist = jnp.sum(jnp.square(zq[:, None, :] - protos[None, :, :]), -1)
        return cross_entropy(-scale * dist, qy)

    def meta_loss(p, sx, sy, qx, qy):
        return jnp.mean(jax.vmap(task_loss, in_axes=(None, 0, 0, 0, 0))(p, sx, sy, qx, qy))

    return meta_loss


def main(path_in: str, path_out: str) -> int:
    def build(data: dict[str, Any], precision: Any) -> Callable[..., Any]:
        import jax

        algo = str(data["algo"])
        common = dict(n_blocks=int(data["n_blocks"]), eps=float(data["eps"]),
                      precision=precision)
        if algo == "imaml":
            return jax.jit(make_imaml_grad(
                **common, inner_lr=float(data["inner_lr"]), inner_steps=int(data["inner_steps"]),
                lam=float(data["lam"]), cg_steps=int(data["cg_steps"]),
                cg_damping=float(data["cg_damping"]), inner_loop=str(data["inner_loop"])))
        if algo == "protonet":
            return jax.jit(jax.value_and_grad(make_protonet_loss(
                **common, n_way=int(data["n_way"]), scale=float(data["scale"]))))
        sys.exit(f"meta_breadth_jax.py: unknown algo {algo!r} (expected 'imaml' or 'protonet')")

    return run_twin(path_in, path_out, build)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/meta_breadth_jax.py IN.npz OUT.npz")
    sys.exit(main(sys.argv[1], sys.argv[2]))
