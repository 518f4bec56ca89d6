"""Privacy accountants side by side: RDP, PLD (dp-accounting) and PRV on issue 19's settings.

For each DP-SGD setting (sample rate ``q``, noise multiplier ``sigma``, steps, ``delta``) prints
epsilon from each accountant (PRV: its proven upper bound, and the estimate / lower bound) and
the time to compute it from scratch (no caching: one function call per repeat; median of
``--repeats`` after one warm-up call). PLD rows are skipped when ``dp_accounting`` is missing.
Host-side float64 on one CPU thread.

    OMP_NUM_THREADS=1 python benchmarks/accountants.py --out accountants-cpu.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
from functools import partial
from pathlib import Path

import torch
from _bench import time_calls

from torchfn.persample import PRVAccountant, RDPAccountant, pld_epsilon

SETTINGS = [(0.01, 1.1, 1000, 1e-5), (0.032, 0.639, 93, 1e-5), (0.004, 0.8, 10_000, 1e-5)]


def _rdp(q: float, sigma: float, steps: int, delta: float) -> float:
    acct = RDPAccountant()
    acct.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    return acct.get_epsilon(delta)


def _prv(q: float, sigma: float, steps: int, delta: float) -> tuple[float, float, float]:
    acct = PRVAccountant()
    acct.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    return tuple(acct.get_epsilon_bounds(delta))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args()
    try:
        import dp_accounting  # noqa: F401

        pld_version = importlib.metadata.version("dp-accounting")
    except ImportError:
        pld_version = None
    rows = []
    print("| q | sigma | steps | delta | RDP eps (s) | PLD eps (s) | PRV eps_upper (s) | "
          "PRV low / estimate |")
    print("|---|---|---|---|---|---|---|---|")
    for q, sigma, steps, delta in SETTINGS:
        t_rdp = time_calls(partial(_rdp, q, sigma, steps, delta), None, warmup=1,
                           repeats=args.repeats)
        t_prv = time_calls(partial(_prv, q, sigma, steps, delta), None, warmup=1,
                           repeats=args.repeats)
        low, est, up = t_prv.first_output
        row = {"q": q, "sigma": sigma, "steps": steps, "delta": delta,
               "rdp": t_rdp.first_output, "rdp_s": t_rdp.median_s,
               "prv_low": low, "prv_estimate": est, "prv_upper": up, "prv_s": t_prv.median_s}
        pld = "n/a (no dp_accounting)"
        if pld_version is not None:
            t_pld = time_calls(partial(pld_epsilon, q, sigma, steps, delta), None, warmup=1,
                               repeats=args.repeats)
            row.update(pld=t_pld.first_output, pld_s=t_pld.median_s)
            pld = f"{t_pld.first_output:.4f} ({t_pld.median_s:.2f})"
        rows.append(row)
        print(f"| {q} | {sigma} | {steps} | {delta:g} | {row['rdp']:.4f} ({t_rdp.median_s:.3f}) "
              f"| {pld} | {up:.4f} ({t_prv.median_s:.2f}) | {low:.4f} / {est:.4f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({
            "torch": torch.__version__, "dp_accounting": pld_version,
            "machine": platform.processor() or platform.machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
