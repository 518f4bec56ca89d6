"""Two real ranks (torch.distributed, gloo, CPU): exactly-once across ranks and equal lengths."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchfn.data._audit import Auditor
from torchfn.data._shards import ShardWriter
from torchfn.data._stream import StreamingDataset, StreamingLoader

N = 61  # odd: "drop" must drop one sample, "pad" must pad one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {}
        for policy in ("drop", "pad"):
            ds = StreamingDataset(root, batch_size=4, seed=7, meta=True, policy=policy)
            assert (ds.rank, ds.world_size) == (rank, world)  # taken from torch.distributed
            ds.set_epoch(1)
            audit = Auditor()
            steps = 0
            for batch in StreamingLoader(ds, num_workers=1):
                audit.record(batch)
                # a DDP-style collective every step: hangs if the ranks' lengths differed
                t = torch.ones(1)
                dist.all_reduce(t)
                steps += 1
            rep = audit.report(ds.labels, allowed_missing=1)  # gathers both ranks
            result[policy] = {
                "steps": steps, "ok": rep.ok, "missing": list(rep.missing),
                "duplicates": list(rep.duplicates), "padded": rep.padded,
                "rank_lengths": rep.rank_lengths, "seen": rep.seen,
                "ids": audit.records()[:, 3].tolist(),
            }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()  # no rank tears gloo down while the other finishes (see test_distributed)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_exactly_once_equal_lengths(tmp_path):
    root = tmp_path / "shards"
    with ShardWriter(root, samples_per_shard=10) as w:
        for i in range(N):
            w.write({"x": torch.full((3,), float(i))}, label=i % 2)
    mp.spawn(_rank_main, args=(2, _free_port(), str(root), str(tmp_path)), nprocs=2, join=True)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for policy, length in (("drop", 30), ("pad", 31)):
        r0, r1 = res[0][policy], res[1][policy]
        assert r0["steps"] == r1["steps"] == -(-length // 4)
        assert len(r0["ids"]) == len(r1["ids"]) == length
        assert r0["ok"] and r1["ok"] and not r0["duplicates"]
        assert r0["rank_lengths"] == {"0": length, "1": length}
        if policy == "drop":
            assert not set(r0["ids"]) & set(r1["ids"])
            assert len(r0["missing"]) == 1 and r0["seen"] == N - 1
        else:
            assert r0["missing"] == [] and r0["seen"] == N and r0["padded"] == 1
            assert set(r0["ids"]) | set(r1["ids"]) == set(range(N))
