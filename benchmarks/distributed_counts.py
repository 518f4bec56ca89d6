"""Per-step op census of the distributed steps of ``benchmarks/distributed.py`` (CPU, gloo).

For each row (``data_parallel:eager``, ``:overlap``, ``:sharded``, ``dpsgd:sharded`` and the
1-process baselines) this builds the benchmark's model at its full parameter count, runs two
warm-up steps, then profiles ONE step with ``torch.profiler`` (CPU activities) and counts:

- ``collectives``: every c10d / functional-collective op, with its element count and MB;
- ``host_syncs``: ops that block the host on CUDA (``aten::_local_scalar_dense`` = ``.item()``
  / ``bool()`` / ``int()`` of a tensor, ``aten::nonzero``, ``masked_select``, ``unique``,
  a ``wait`` on a c10d ``Work``);
- ``launches``: leaf ATen ops that would launch a device kernel (views, ``empty`` and other
  metadata-only ops left out) -- the eager step's host-side cost on a GPU;
- ``copies``: ``cat``, ``constant_pad_nd``, ``clone``, ``copy_`` calls and the MB they write
  (MB assuming 4-byte elements; ``cat``'s MB is not recorded; a copy made inside a collective,
  e.g. the clone of funcol's out-of-place all_reduce, is not counted).

Only the batch is shrunk (1-2 short sequences): every count here depends on the params, not
on the batch. Run::

    OMP_NUM_THREADS=1 python benchmarks/distributed_counts.py [--rows ...] [--out counts.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import distributed as bench

ROWS = ("data_parallel:eager,data_parallel:overlap,data_parallel:sharded,dpsgd:eager,"
        "dpsgd:sharded")
_VIEWS = {"view", "reshape", "_reshape_alias", "as_strided", "empty", "empty_strided", "t",
          "transpose", "expand", "slice", "select", "split", "split_with_sizes", "unsqueeze",
          "squeeze", "detach", "alias", "lift_fresh", "resolve_conj", "resolve_neg",
          "result_type", "unbind", "permute", "flatten", "unflatten", "chunk", "narrow",
          "view_as", "expand_as", "empty_like", "contiguous", "_unsafe_view", "numpy_T",
          "is_nonzero", "size", "stride", "dim", "set_", "record_stream", "item",
          "_has_compatible_shallow_copy_type", "lift_fresh_copy", "to", "_to_copy_meta",
          "broadcast_tensors", "movedim", "matrix_H", "mT", "diagonal", "_local_scalar_dense",
          "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "scalar_tensor",
          "tensor", "promote_types", "new_zeros", "new_empty", "new_full", "new_ones"}
_SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
          "nonzero_static"}
_COPIES = {"cat", "constant_pad_nd", "clone", "copy_", "stack"}
_ELT = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Bool": 1}


def _name(ev: Any) -> str:
    n = ev.name
    for pre in ("aten::", "_c10d_functional::", "c10d::"):
        if n.startswith(pre):
            return n[len(pre):]
    return n


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _census(prof: Any) -> dict[str, Any]:
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    coll: Counter[str] = Counter()
    coll_mb: Counter[str] = Counter()
    coll_list: list[tuple[str, int]] = []
    syncs: Counter[str] = Counter()
    copies: Counter[str] = Counter()
    copies_mb: Counter[str] = Counter()
    launches: Counter[str] = Counter()
    waits = 0
    for e in events:
        n = e.name
        short = _name(e)
        is_coll = n.startswith(("_c10d_functional::", "c10d::")) and short not in (
            "wait_tensor", "_wrap_tensor_autograd")
        parent, nested = e.cpu_parent, False
        while parent is not None:  # funcol's all_reduce calls c10d's allreduce_: count once
            nested = nested or parent.name.startswith(("_c10d_functional::", "c10d::"))
            parent = parent.cpu_parent
        if short == "wait_tensor" and not nested:
            waits += 1
        if is_coll and not nested:
            shapes = e.input_shapes or [[]]
            types = getattr(e, "input_types", None) or ["Float"]
            numel = _numel(shapes[0]) if shapes and shapes[0] else 0
            size = _ELT.get(types[0], 4) * numel if types else 4 * numel
            coll[short] += 1
            coll_mb[short] += size / 2**20
            coll_list.append((short, numel))
            continue
        if not n.startswith("aten::") or nested:
            continue
        if short in _SYNCS:
            syncs[short] += 1
        # a leaf: no ATen op beneath it (a composite calls others, which are counted instead)
        if any(c.name.startswith("aten::") for c in e.cpu_children):
            continue
        if short in _COPIES:
            copies[short] += 1
            shapes = e.input_shapes or [[]]
            types = getattr(e, "input_types", None) or ["Float"]
            out_shape = shapes[0] if short in ("copy_", "clone", "constant_pad_nd") else None
            if short in ("copy_", "clone", "constant_pad_nd"):  # copy_: dst is input 0
                mb = _numel(out_shape or []) * _ELT.get(types[0] if types else "Float", 4)
            else:  # cat/stack: input 0 is a list; its shapes are not recorded, use the outputs
                mb = 0
            copies_mb[short] += mb / 2**20
        if short not in _VIEWS:
            launches[short] += 1
    return {"collectives": dict(coll), "collective_MB": {k: round(v, 1) for k, v in coll_mb.items()},
            "collective_sizes": coll_list, "host_syncs": dict(syncs), "waits": waits,
            "launches": sum(launches.values()), "top_launches": launches.most_common(12),
            "copies": dict(copies), "copy_MB": {k: round(v, 1) for k, v in copies_mb.items()}}


def _worker(rank: int, world: int, port: int, rows: list[tuple[str, str]], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    sz = bench._sizes(False)
    sz["lm"]["batch"], sz["dp_lm"]["batch"] = 1, 2
    # the params keep the benchmark's sizes (pos embedding of seq rows); the ids are 16 long
    bench._ids = lambda cfg, g, device: torch.randint(0, cfg["vocab"], (cfg["batch"], 16),
                                                      generator=g)
    res: dict[str, Any] = {}
    try:
        for workload, variant in rows:
            g = torch.Generator().manual_seed(1000 + rank)
            fn, state, _, info = bench.BUILDERS[workload](variant, world, rank,
                                                          torch.device("cpu"), sz, g)
            for _ in range(2):
                state = fn(state)
            if world > 1:
                dist.barrier()
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                state = fn(state)
            res[f"{workload}:{variant}"] = {"params": info.get("params"), **_census(prof)}
            del fn, state
            if world > 1:
                dist.barrier()
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
    finally:
        if world > 1:
            dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [tuple(r.split(":")) for r in args.rows.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    mp.spawn(_worker, args=(args.world, port, rows, out), nprocs=args.world, join=True)
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    for name, r in res.items():
        sizes = Counter(f"{op}:{n}" for op, n in r.pop("collective_sizes"))
        print(f"== {name} (W={args.world}, {r['params']} params)")
        print(f"  collectives {r['collectives']} MB {r['collective_MB']}")
        print(f"  sizes (op:numel x count) {dict(sizes.most_common(8))}")
        print(f"  host syncs {r['host_syncs']}, collective waits {r['waits']}")
        print(f"  launches {r['launches']}; top {r['top_launches']}")
        print(f"  copies {r['copies']} MB {r['copy_MB']}")
        r["collective_sizes"] = dict(sizes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
