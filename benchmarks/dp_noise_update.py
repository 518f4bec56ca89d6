"""The DP step's noise + update part alone, on a ``dp_models.py`` workload: variants side by side.

Times ``DPTrainStep``'s apply part (noise added to a fixed clipped sum, divided, the optimizer
update through the step core, the metrics) with no model in the step: the graph compiles in
about a minute per variant on an H100 where the whole GPT-2 DP step takes several. CUDA: each
variant through ``make_graphed_step`` (the clipped sum is a graph input: one copy of it per call
in every variant), timed with CUDA events over ``--inner`` calls, median of ``--rounds``
interleaved rounds. CPU (``--tiny``): ``torch.compile`` and wall time, a smoke test.

Variants (``--variants``, comma-separated; all but ``current`` replace library internals for
the run only, to see what a change would buy before making it):

- ``current``: the library's seeded noise (Box-Muller in float64, rounded to the params' dtype);
- ``f32-angle``: the radius still from a 53-bit uniform in float64, the angle from 24 bits and
  its cosine/sine in float32 (what a float32-output fast path could be);
- ``no-noise``: the clipped sum divided and applied, no noise (the floor of this part);
- ``per-leaf``: the noise added and divided by a per-leaf loop (Inductor: one update kernel per
  leaf) instead of the library's multi-tensor ops (grouped kernels);
- ``poly``: the angle's cosine and sine as float64 polynomials after an exact octant reduction
  of the 32-bit word (same float64 accuracy as the library functions, fewer FP64 operations);
- ``fused``: the ``poly`` draw computed elementwise from each parameter's global indices inside
  its per-leaf update expression (no flat noise tensor: Inductor can fuse the draw into the
  update; each element pays its pair's ``log``/``sqrt``); ``fused-foreach``: the same noise fed
  to the library's multi-tensor ops.

``+KEY=VALUE`` suffixes on a variant set Inductor options for it (``+combo`` is short for
``+combo_kernels=True``): e.g. ``current+combo`` or ``current+score_fusion_memory_threshold=1``.
Why: the non-private step's compiled update is grouped into ~13 kernels (same-size leaves fused
horizontally: they share a read of the stacked per-leaf norms), the DP step's is 148 (its
leaves share only 0-d reads, below Inductor's ``score_fusion_memory_threshold`` of 10 bytes).
``--kernels`` profiles a few calls of each variant and prints its kernel launches and summed
kernel time per call.

Measured: ``results/dp-noise-update-h100.md``.

    python benchmarks/dp_noise_update.py --workload gpt2
    python benchmarks/dp_noise_update.py --tiny --variants current,no-noise   # CPU smoke test
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchopt
from _bench import set_tf32_off
from dp_models import build_model, configs, loss_kind, per_sample_loss

import torchfn.persample._dp_random as R
import torchfn.persample._dpsgd as DPS
from torchfn._checks import STEP_INDUCTOR_OPTIONS
from torchfn.compile import make_graphed_step
from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model

VARIANTS = ("current", "f32-angle", "no-noise", "per-leaf", "poly", "fused", "fused-foreach")

# Taylor coefficients of sin (x^3 .. x^15) and cos (x^2 .. x^16): on [0, pi/4] the first
# omitted terms are below 5e-17 (sin) and 3e-18 (cos)
_SIN = [(-1) ** k / math.factorial(2 * k + 1) for k in range(1, 8)]
_COS = [(-1) ** k / math.factorial(2 * k) for k in range(1, 9)]
_TURN = R._TWO_PI / 4294967296.0  # radians per unit of a 32-bit angle word


def _turn_sincos(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the angle ``2 pi w / 2**32`` of int32 words ``w`` (bit patterns), in
    float64: the quadrant from the word's top two bits and the mirror of its octant are exact
    integer steps, leaving an angle in ``[0, pi/4]`` for two short polynomials (no library
    sine or cosine: what the FP64 units spend most of the draw on)."""
    q = (w >> 30) & 3
    m = w & 0x3FFFFFFF
    upper = m >= 0x20000000  # the octant's upper half: mirror, swap sine and cosine
    x = torch.where(upper, 0x40000000 - m, m).to(torch.float64) * _TURN
    x2 = x * x
    ps, pc = _SIN[-1], _COS[-1]
    for c in reversed(_SIN[:-1]):
        ps = ps * x2 + c
    for c in reversed(_COS[:-1]):
        pc = pc * x2 + c
    s, c = x + x * (x2 * ps), 1.0 + x2 * pc
    swap = upper ^ ((q & 1) == 1)
    a, b = torch.where(swap, s, c), torch.where(swap, c, s)
    return torch.where((q == 1) | (q == 2), -a, a), torch.where(q >= 2, -b, b)


def _radius_and_word(key: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ``p``'s Box-Muller radius (float64, from a 53-bit uniform) and angle word."""
    k0, k1 = R._word32(key[0]), R._word32(key[1])
    c = p * 3
    hi = (R._hash32(k0, k1, c) >> 5) & 0x7FFFFFF
    lo = (R._hash32(k0, k1, c + 1) >> 6) & 0x3FFFFFF
    u1 = 1.0 - (hi.to(torch.float64) * 67108864.0 + lo.to(torch.float64)) * (
        1.0 / 9007199254740992.0)
    return torch.sqrt(-2.0 * torch.log(u1)), R._hash32(k0, k1, c + 2)


def _pairs_poly(key: torch.Tensor, p: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_dp_random._pairs`` with :func:`_turn_sincos` for the angle (same float64 accuracy)."""
    r, w = _radius_and_word(key, p)
    cos, sin = _turn_sincos(w)
    return (r * cos).to(dtype), (r * sin).to(dtype)


def _normal_elementwise(key: torch.Tensor, j: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Element ``j`` (int64) of the :func:`_pairs_poly` draw, from ``j`` alone: its pair's
    radius times the cosine of its pair's angle word, less a quarter turn for the odd (sine)
    element -- exactly the pair's sine, as the quadrant step is an integer one. No flat draw is
    materialised, so a compiled graph can fuse each leaf's noise into its update; each
    element pays its pair's ``log``/``sqrt`` (twice the pair draw's)."""
    r, w = _radius_and_word(key, (j >> 1).to(torch.int32))
    cos, _ = _turn_sincos(w - ((j & 1).to(torch.int32) << 30))
    return (r * cos).to(dtype)


def _noisy_fused(self: Any, state: Any, sums: Any, noise_slices: Any = None,
                 foreach: bool = False) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``DPTrainStep._noisy`` (seeded noise, fixed threshold) with each leaf's noise computed
    elementwise from its global indices inside its own update expression."""
    names = self._options.trainable_names(state.params, set(self._ghost.frozen))
    noised = [k for k in sums if k in names]
    dtype = DPS._noise_dtype(state, noised)
    gs = [sums[k].to(state.params[k].dtype) for k in noised]
    zs, start = [], 0
    for g in gs:
        j = torch.arange(start, start + g.numel(), dtype=torch.int64, device=g.device)
        zs.append(_normal_elementwise(state.key, j, dtype).reshape(g.shape).to(g.dtype))
        start += g.numel()
    std, denom = self.noise_std, self.expected_batch_size
    if foreach:
        outs = list(torch._foreach_div(torch._foreach_add(gs, zs, alpha=std), denom))
    else:
        outs = [(g + std * z) / denom for g, z in zip(gs, zs, strict=True)]
    return dict(zip(noised, outs, strict=True)), noised


def _pairs_f32_angle(key: torch.Tensor, p: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_dp_random._pairs`` with the angle's cosine and sine in float32 (24-bit angle)."""
    k0, k1 = R._word32(key[0]), R._word32(key[1])
    c = p * 3
    hi = (R._hash32(k0, k1, c) >> 5) & 0x7FFFFFF
    lo = (R._hash32(k0, k1, c + 1) >> 6) & 0x3FFFFFF
    w = R._hash32(k0, k1, c + 2)
    u1 = 1.0 - (hi.to(torch.float64) * 67108864.0 + lo.to(torch.float64)) * (
        1.0 / 9007199254740992.0)
    theta = ((w >> 8) & 0xFFFFFF).to(torch.float32) * (R._TWO_PI / 16777216.0)
    r = torch.sqrt(-2.0 * torch.log(u1)).to(torch.float32)
    return (r * torch.cos(theta)).to(dtype), (r * torch.sin(theta)).to(dtype)


def _noisy_none(self: Any, state: Any, sums: Any, noise_slices: Any = None
                ) -> tuple[dict[str, torch.Tensor], list[str]]:
    names = self._options.trainable_names(state.params, set(self._ghost.frozen))
    noised = [k for k in sums if k in names]
    return {k: sums[k] / self.expected_batch_size for k in noised}, noised


def _sums_per_leaf(gs: list[torch.Tensor], zs: list[torch.Tensor], std: Any, denom: Any
                   ) -> list[torch.Tensor]:
    return [(g + std * z) / denom for g, z in zip(gs, zs, strict=True)]


def _options(variant: str) -> dict[str, Any]:
    """The Inductor options of ``variant``: the step's own plus its ``+KEY=VALUE`` suffixes."""
    import ast

    import torch._inductor.config as inductor_config

    out = dict(STEP_INDUCTOR_OPTIONS)
    for item in variant.split("+")[1:]:
        key, sep, value = ("combo_kernels", "=", "True") if item == "combo" else item.partition("=")
        if not sep or not hasattr(inductor_config, key):
            raise ValueError(f"--variants: {item!r} in {variant!r} is not KEY=VALUE with KEY a "
                             f"torch._inductor.config entry")
        out[key] = ast.literal_eval(value)
    return out


_ORIGINAL = (R._pairs, DPS.DPTrainStep._noisy, DPS._noisy_sums)


def _patch(variant: str) -> None:
    """Set the library internals ``variant`` replaces (the originals for the rest)."""
    variant = variant.split("+")[0]
    pairs, noisy, sums = _ORIGINAL
    if variant == "f32-angle":
        pairs = _pairs_f32_angle
    elif variant == "no-noise":
        noisy = _noisy_none
    elif variant == "per-leaf":
        sums = _sums_per_leaf
    elif variant == "poly":
        pairs = _pairs_poly
    elif variant == "fused":
        noisy = _noisy_fused
    elif variant == "fused-foreach":
        def noisy(self: Any, state: Any, sums: Any, noise_slices: Any = None) -> Any:
            return _noisy_fused(self, state, sums, noise_slices, foreach=True)
    elif variant != "current":
        raise ValueError(f"--variants: unknown {variant!r}; expected some of {VARIANTS}")
    R._pairs, DPS.DPTrainStep._noisy, DPS._noisy_sums = pairs, noisy, sums


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gpt2", choices=("gpt2", "gpt2-lora", "vit"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16"),
                    help="the DP step's amp setting (bf16: autocast, as dp_models.py's bf16 rows)")
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke test)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--kernels", action="store_true",
                    help="also profile each variant: kernel launches and kernel ms per call")
    a = ap.parse_args(argv)
    names = [v for v in a.variants.split(",") if v]
    for v in names:
        _patch(v)  # unknown names and options fail before any work
        _options(v)
    _patch("current")
    device = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    set_tf32_off()
    cfg = configs(a.tiny)[a.workload]
    model = build_model(a.workload, cfg, untie=False, expand_positions=True).to(device)
    ghost, params, buffers = make_ghost_model(model)
    opt = torchopt.sgd(1e-3)
    dp = make_dp_train_step(ghost, per_sample_loss(loss_kind(a.workload)), opt,
                            noise_multiplier=1.0, max_grad_norm=1.0,
                            sample_rate=cfg["batch"] / 50000, dataset_size=50000,
                            amp="bf16" if a.precision == "bf16" else None)
    gen = torch.Generator(device=device).manual_seed(0)
    sums = {k: torch.randn(v.shape, device=device, generator=gen) for k, v in params.items()}
    one = torch.tensor(1.0, device=device)
    total = DPS.ClippedSum(grads=sums, count=cfg["batch"] * one, loss_sum=3 * one,
                           clipped=one, norm_sum=2 * one)
    print(f"{a.workload}: {sum(v.numel() for v in params.values())} params in {len(params)} "
          f"leaves, {device}, {a.precision}", flush=True)
    steps: dict[str, tuple[Callable[..., Any], list[Any]]] = {}
    try:
        for v in names:
            _patch(v)
            if device.type == "cuda":  # (captured graphs; on the CPU guards pick the variant)
                torch._dynamo.reset()
            t0 = time.perf_counter()
            state = init_dp_state(params, buffers, opt, seed=0, trainable=ghost.trainable)

            def apply(s: Any, t: Any) -> Any:
                return dp._apply(s, t)

            # a code object of its own per variant: Dynamo caches compiled graphs per code
            # object, and compile options are not among its guards
            apply = types.FunctionType(apply.__code__.replace(co_name=f"apply_{len(steps)}"),
                                       apply.__globals__, closure=apply.__closure__)

            options = _options(v)
            if device.type == "cuda":
                fn: Callable[..., Any] = make_graphed_step(apply, state, total,
                                                           compile={"options": options})
            else:
                fn = torch.compile(apply, fullgraph=True, options=options)
                state, _ = fn(state, total)
            steps[v] = (fn, [state])
            print(f"  {v}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        times: dict[str, list[float]] = {v: [] for v in steps}
        for _ in range(a.rounds):
            for v, (fn, box) in steps.items():
                # each variant runs with its own patches (a CPU step may recompile on a call)
                _patch(v)
                if device.type == "cuda":
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(a.inner):
                        box[0], _m = fn(box[0], total)
                    e1.record()
                    torch.cuda.synchronize()
                    times[v].append(e0.elapsed_time(e1) / a.inner)
                else:
                    t0 = time.perf_counter()
                    for _ in range(a.inner):
                        box[0], _m = fn(box[0], total)
                    times[v].append(1e3 * (time.perf_counter() - t0) / a.inner)
    finally:
        _patch("current")
    for v, ts in times.items():
        if not all(torch.isfinite(p).all() for p in steps[v][1][0].params.values()):
            raise RuntimeError(f"{v}: non-finite params after the timed calls")
        print(f"  {v:16s} median {statistics.median(ts):.3f} ms  min {min(ts):.3f} ms per call")
    if a.kernels and device.type != "cuda":
        print("  --kernels: kernel launches are profiled on CUDA only (CPU Inductor kernels are "
              "not profiler events)")
    elif a.kernels:
        for v, (fn, box) in steps.items():
            launches, ms = _kernels(fn, box, total)
            print(f"  {v:16s} {launches:.0f} kernel launches, {ms:.3f} kernel ms per call")
    return 0


def _kernels(fn: Callable[..., Any], box: list[Any], total: Any, calls: int = 3
             ) -> tuple[float, float]:
    """``(kernel launches, summed kernel ms)`` per call of ``fn`` under the PyTorch profiler
    (CUDA kernels; copies excluded)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            box[0], _m = fn(box[0], total)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"
              and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    return len(events) / calls, sum(e.device_time for e in events) / 1e3 / calls


if __name__ == "__main__":
    sys.exit(main())
