"""The JAX twin of ``benchmarks/meta.py``: the same MAML outer step, run in its own process.

``benchmarks/meta.py`` writes the conv net's weights (copied from the torch module) and the
task batch to an ``.npz`` file and runs ``python benchmarks/meta_jax.py IN.npz OUT.npz``. This
file imports only numpy and jax (no torch), so the two frameworks never share a CUDA context,
an allocator or a cuDNN library in one process.

The computation, identical to torchfn's: 4 blocks of [3x3 conv (pad 1) -> BatchNorm with the
task's own batch statistics (biased variance, eps, no running stats) -> ReLU -> 2x2 max-pool],
flatten (NCHW order, as torch's ``nn.Flatten``), linear head; mean softmax cross-entropy;
``inner_steps`` plain SGD steps on the support set, differentiated through (second order);
the query loss averaged over the tasks, which are vmapped. ``jax.jit(jax.grad(meta_loss))`` is
timed like the torch variants: one warm-up (compile) call, then ``repeats`` calls each ended by
``block_until_ready``, median. Matmul and conv precision is ``'highest'`` (no TF32) unless the
input file says ``precision='tf32'``.

OUT.npz holds ``grad:<name>`` arrays (the meta-gradient, keyed like torch's
``named_parameters()``), ``loss``, ``times_s``, ``compile_s``, ``peak_bytes`` (-1 where the
device does not report it), ``device`` and ``jax_version``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # report real peaks


def conv_net(params, x, *, n_blocks: int, eps: float, precision, head: bool = True):
    """Return logits ``(N, n_way)`` for ``x (N, C, H, W)``; ``params`` keyed like torch's.

    ``head=False``: the flattened features ``(N, C * H' * W')`` before the linear head (the
    embedding of ``benchmarks/meta_breadth_jax.py``'s ProtoNet).
    """
    import jax.numpy as jnp
    from jax import lax

    h = x
    for i in range(n_blocks):
        conv, bn = f"{4 * i}", f"{4 * i + 1}"
        h = lax.conv_general_dilated(
            h, params[conv + ".weight"], window_strides=(1, 1), padding=((1, 1), (1, 1)),
            dimension_numbers=("NCHW", "OIHW", "NCHW"), precision=precision,
        ) + params[conv + ".bias"][None, :, None, None]
        mean = jnp.mean(h, axis=(0, 2, 3), keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=(0, 2, 3), keepdims=True)
        h = (h - mean) * lax.rsqrt(var + eps)
        h = h * params[bn + ".weight"][None, :, None, None] + params[bn + ".bias"][None, :, None, None]
        h = jnp.maximum(h, 0)
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    h = h.reshape(h.shape[0], -1)
    if not head:
        return h
    name = f"{4 * n_blocks + 1}"
    return jnp.matmul(h, params[name + ".weight"].T, precision=precision) + params[name + ".bias"]


def cross_entropy(logits, labels):
    """Return the mean softmax cross-entropy of ``logits (N, K)`` against int ``labels (N,)``."""
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def make_meta_loss(*, n_blocks: int, eps: float, inner_lr: float, inner_steps: int, precision):
    """Return ``meta_loss(params, sx, sy, qx, qy)``: the mean post-adaptation query loss."""
    import jax
    import jax.numpy as jnp

    def loss(p, x, y):
        return cross_entropy(conv_net(p, x, n_blocks=n_blocks, eps=eps, precision=precision), y)

    def task_loss(params, sx, sy, qx, qy):
        fast = params
        for _ in range(inner_steps):
            g = jax.grad(loss)(fast, sx, sy)
            fast = jax.tree_util.tree_map(lambda w, gw: w - inner_lr * gw, fast, g)
        return loss(fast, qx, qy)

    def meta_loss(params, sx, sy, qx, qy):
        return jnp.mean(jax.vmap(task_loss, in_axes=(None, 0, 0, 0, 0))(params, sx, sy, qx, qy))

    return meta_loss


def run_twin(path_in: str, path_out: str,
             build: Callable[[dict[str, Any], Any], Callable[..., Any]]) -> int:
    """Load ``path_in``, jit the step ``build(data, precision)`` returns, time it, save ``path_out``.

    ``build`` gets the input file's arrays and the matmul/conv precision and returns a jitted
    ``step(params, support_x, support_y, query_x, query_y) -> (loss, grads)``. The first call
    (compilation) is ``compile_s``; ``data["warmup"] - 1`` more untimed calls (default none),
    then ``data["repeats"]`` timed ones. Without JAX it writes ``skipped`` and returns 0.
    """
    import numpy as np

    data = dict(np.load(path_in))
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as e:
        np.savez(path_out, skipped=f"jax is not importable ({e})")
        return 0
    if str(data["dtype"]) == "float64":
        jax.config.update("jax_enable_x64", True)
    if str(data["precision"]) == "highest":
        jax.config.update("jax_default_matmul_precision", "highest")
        precision = jax.lax.Precision.HIGHEST
    else:  # 'tf32': XLA's default (TF32 on GPUs that have it)
        precision = jax.lax.Precision.DEFAULT
    device = jax.devices()[0]
    params = {k[len("param:"):]: jax.device_put(jnp.asarray(v), device)
              for k, v in data.items() if k.startswith("param:")}
    tasks = [jax.device_put(jnp.asarray(data[k]), device)
             for k in ("support_x", "support_y", "query_x", "query_y")]
    step = build(data, precision)
    t0 = time.perf_counter()
    loss, grads = step(params, *tasks)
    jax.block_until_ready(grads)
    compile_s = time.perf_counter() - t0
    for _ in range(int(data.get("warmup", 1)) - 1):
        jax.block_until_ready(step(params, *tasks))
    times = []
    for _ in range(int(data["repeats"])):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, *tasks))
        times.append(time.perf_counter() - t0)
    stats = device.memory_stats() or {}
    np.savez(
        path_out,
        loss=np.asarray(loss), times_s=np.asarray(times), median_s=statistics.median(times),
        compile_s=compile_s, peak_bytes=int(stats.get("peak_bytes_in_use", -1)),
        device=f"{device.platform}:{getattr(device, 'device_kind', '')}",
        jax_version=jax.__version__,
        **{f"grad:{k}": np.asarray(v) for k, v in grads.items()},
    )
    return 0


def main(path_in: str, path_out: str) -> int:
    def build(data: dict[str, Any], precision: Any) -> Callable[..., Any]:
        import jax

        return jax.jit(jax.value_and_grad(make_meta_loss(
            n_blocks=int(data["n_blocks"]), eps=float(data["eps"]),
            inner_lr=float(data["inner_lr"]), inner_steps=int(data["inner_steps"]),
            precision=precision)))

    return run_twin(path_in, path_out, build)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python benchmarks/meta_jax.py IN.npz OUT.npz")
    sys.exit(main(sys.argv[1], sys.argv[2]))
