"""``torchfn demo``: the functional core end to end, on the CPU, in well under two minutes.

What it does, printing each result as it goes:

1. builds a small MLP with BatchNorm and makes it stateless (``make_functional``);
2. trains it on a synthetic 3-class spiral with a pure train step (torchfn Adam, a torchopt LR
   schedule, global-norm clipping, 2 micro-batches) compiled with ``fullgraph=True``, and
   checks the compiled step never recompiles and matches the eager step;
3. saves a checkpoint halfway, resumes from it in a fresh state, and checks the resumed run
   ends bitwise-identical to the uninterrupted one;
4. computes per-sample gradients (checked against a loop of ``torch.autograd.grad``) and
   their norms, a Hessian-vector product, a Hutchinson Hessian-diagonal estimate and the
   empirical NTK of the trained model.
"""

from __future__ import annotations

import math
import os
import tempfile
import time

import torch
import torchopt
from torch import Tensor, nn

from torchfn.compile import compile_step
from torchfn.functional import (
    empirical_ntk,
    hessian_diagonal,
    hvp,
    init_train_state,
    load_checkpoint,
    make_functional,
    make_train_step,
    per_sample_grads,
    save_checkpoint,
    single_sample_fn,
    tree_global_norm,
)
from torchfn.optim import adam


def spiral(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Return ``(x, y)``: ``n`` points of a noisy 3-arm spiral, ``x`` of shape ``(n, 2)``."""
    y = torch.randint(0, 3, (n,), generator=generator)
    r = torch.rand(n, generator=generator)
    theta = 4.0 * r + y * (2 * math.pi / 3) + 0.2 * torch.randn(n, generator=generator)
    x = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1)
    return x, y


def _count_compiles() -> tuple[object, list[int]]:
    """Return a ``torch.compile`` backend that counts the graphs it is given, and the count."""
    count = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]):
        count[0] += 1
        from torch._inductor import compile as inductor_compile

        return inductor_compile(gm, example_inputs)

    return backend, count


def _params_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_demo(steps: int = 60, *, seed: int = 0) -> dict[str, float]:
    """Run the demo and return its headline numbers (also printed)."""
    if steps < 2 or steps % 2:
        raise ValueError(f"run_demo: `steps` must be an even number >= 2, got {steps}")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    x_train, y_train = spiral(1024, gen)
    x_test, y_test = spiral(512, gen)

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.1f}s] {msg}", flush=True)

    print("torchfn demo: the functional core end to end (CPU)\n")
    # 1. a stateless model (no bias before BatchNorm: its gradient is exactly zero, so Adam's
    #    normalised update would amplify rounding noise into +-lr steps)
    net = nn.Sequential(
        nn.Linear(2, 64, bias=False), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, 3),
    )
    model_fn, params, buffers = make_functional(net)
    n_params = sum(p.numel() for p in params.values())
    say(f"1. make_functional: {len(params)} parameter tensors ({n_params} numbers), "
        f"{len(buffers)} buffers; BatchNorm swapped for torchfn's functional BatchNorm")

    # 2. a pure train step, compiled
    def loss_fn(logits: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(logits, y)

    schedule = torchopt.schedule.linear_schedule(3e-2, 3e-3, transition_steps=steps,
                                                 transition_begin=0)
    opt = adam(schedule)
    step = make_train_step(model_fn, loss_fn, opt, grad_accum_steps=2, max_grad_norm=5.0,
                           lr_schedule=schedule)
    backend, compiles = _count_compiles()
    # announces 'compiling the train step (first call; ...)...', then how long it took
    cstep = compile_step(step, name="the train step", log=lambda m: say("   " + m),
                         backend=backend)

    batch_size = 128

    def batch_at(i: int) -> tuple[Tensor, Tensor]:
        idx = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(1000 + i))
        idx = idx[:batch_size]
        return x_train[idx], y_train[idx]

    state0 = init_train_state(params, buffers, opt, seed=seed)
    state, estate = state0, state0
    max_diff = 0.0
    for i in range(steps):
        state, metrics = cstep(state, batch_at(i))
        estate, _ = step(estate, batch_at(i))
        max_diff = max(max_diff, max((state.params[k] - estate.params[k]).abs().max().item()
                                     for k in state.params))
        if i in (0, steps // 2 - 1, steps - 1):
            say(f"   step {i + 1:3d}: loss {metrics['loss'].item():.4f}  "
                f"grad-norm {metrics['grad_norm'].item():.3f}  lr {metrics['lr'].item():.4f}")
    eval_fn = model_fn.eval()
    logits, _ = eval_fn(state.params, state.buffers, x_test)
    acc = (logits.argmax(-1) == y_test).float().mean().item()
    say(f"2. compiled train step (fullgraph, Adam + linear LR schedule + clipping + 2 "
        f"micro-batches): {steps} steps, compiled {compiles[0]} time(s), "
        f"max |compiled - eager| param diff {max_diff:.1e}; test accuracy {acc:.3f}")
    if compiles[0] != 1:
        raise RuntimeError(f"demo: the train step recompiled ({compiles[0]} graphs)")

    # 3. checkpoint halfway, resume, compare bitwise with the uninterrupted eager run
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        s = state0
        for i in range(steps // 2):
            s, _ = step(s, batch_at(i))
        save_checkpoint(path, s, extra={"next_batch": steps // 2})
        del s
        resumed, extra = load_checkpoint(path, optimizer=opt)
        for i in range(extra["next_batch"], steps):
            resumed, _ = step(resumed, batch_at(i))
    identical = _params_equal(resumed.params, estate.params) and _params_equal(
        resumed.buffers, estate.buffers)
    say(f"3. checkpoint at step {steps // 2}, resumed in a fresh state: final params "
        f"{'BITWISE IDENTICAL to' if identical else 'DIFFER from'} the uninterrupted run")
    if not identical:
        raise RuntimeError("demo: the resumed run differs from the uninterrupted one")

    # 4. transforms on the trained model (eval mode: per-sample BatchNorm has no meaning)
    p = state.params
    f1 = single_sample_fn(eval_fn, state.buffers)  # f1(params, x_i) -> logits (3,)

    def sample_loss(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(f1(params, x)[None], y[None])

    xb, yb = x_test[:64], y_test[:64]
    grads = per_sample_grads(sample_loss, chunk_size=16)(p, xb, yb)
    ref = torch.autograd.grad(sample_loss({k: v.requires_grad_() for k, v in p.items()},
                                          xb[5], yb[5]), list(p.values()))
    err = max((grads[k][5] - r).abs().max().item() for k, r in zip(p, ref, strict=True))
    norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in grads.values()))
    say(f"4a. per-sample grads for 64 samples (chunk_size=16): |vmap - autograd loop| "
        f"{err:.1e}; per-sample grad norms median {norms.median():.3f}, "
        f"max {norms.max():.3f}")
    p = {k: v.detach() for k, v in p.items()}

    def batch_loss(params: dict[str, Tensor]) -> Tensor:
        return loss_fn(eval_fn(params, state.buffers, xb)[0], yb)

    v = {k: torch.randn(t.shape, generator=gen) for k, t in p.items()}
    hv = hvp(batch_loss, p, v, mode="reverse_over_reverse")
    say(f"4b. Hessian-vector product: |Hv| = {tree_global_norm(hv).item():.4f}, "
        f"v.Hv = {sum((hv[k] * v[k]).sum() for k in p).item():.4f}")
    head = {k: t for k, t in p.items() if k.startswith("5.")}
    rest = {k: t for k, t in p.items() if not k.startswith("5.")}

    def head_loss(h: dict[str, Tensor]) -> Tensor:
        return batch_loss({**rest, **h})

    est = hessian_diagonal(head_loss, head, n_samples=2000,
                           generator=torch.Generator().manual_seed(1))
    exact = hessian_diagonal(head_loss, head, exact=True)
    rel = (tree_global_norm({k: est[k] - exact[k] for k in head})
           / tree_global_norm(exact)).item()
    say(f"4c. Hessian diagonal of the output layer ({sum(t.numel() for t in head.values())} "
        f"params): Hutchinson with 2000 probes vs exact, relative error {rel:.3f}")
    ntk = empirical_ntk(f1, p, x_test[:32], mode="trace")
    eig = torch.linalg.eigvalsh(ntk)
    say(f"4d. empirical NTK (trace) of 32 test points: {tuple(ntk.shape)}, eigenvalues "
        f"{eig.min().item():.2e} .. {eig.max().item():.2e}")
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    return {"test_accuracy": acc, "compiles": float(compiles[0]), "max_diff": max_diff,
            "hutchinson_rel_err": rel, "per_sample_err": err}
