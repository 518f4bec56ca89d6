"""A decoder too large for one 80 GB GPU with Adam, trained on 2 GPUs with per-block sharding.

Default size (``--layers 26 --d-model 4096 --vocab 32000``): about 5.5e9 fp32 params, so
params + gradients + Adam's two moments take about 16 bytes x 5.5e9 = 88 GB unsharded -- more
than one H100 holds before any activation. With :func:`make_sharded_train_step`
``(blocks="auto", donate=True)`` on ``W`` ranks each rank keeps ``1 / W`` of the params,
gradients and Adam state plus the params outside the blocks (embeddings, final norm, head:
gathered whole, with their full gradients), one gathered decoder layer (~0.8 GB; two while one
is recomputed) and the activations at the layer boundaries.

Why ``donate=True`` (the default here; ``--no-donate`` is the control): a pure step holds at
the update the old state (params + moments, 12 bytes/param), the clipped gradient shard (4),
the new moments (8), the update (4) and the new params (4): about 32 bytes x P / W at the peak,
~88 GB per rank at W = 2 -- more than an 80 GB card. The donated step updates one param at a
time and writes the results into the old state's tensors, so the peak is the sharded state
(16 bytes x P / W, ~44 GB at W = 2) plus one param's new leaves (the largest param here is an
embedding or the head, 1.3e8 params: ~1 GB for its shard's new moments, update and params) and
the gathered tensors above. The script prints the estimate next to the measured
``torch.cuda.max_memory_allocated``.

The model is never materialised on one rank: it is built on the ``meta`` device (shapes only),
the :class:`ShardLayout` comes from the meta params, and each rank draws its own flat shard of
every param directly on its device (normal(0, 0.02) weights, zero biases, unit norm gains; a
rank's padding past the param's end is zero). The numbers are a benchmark's, not a checkpoint's:
the shards are drawn per rank, not sliced from one full draw.

Reports per rank: step time (median of the timed steps after ``--warmup``), the losses, and
``torch.cuda.max_memory_allocated``. ``--blocks none`` runs the whole-gather step
(``blocks=None``) instead: every rank then also holds the full params and the full gradient
(~44 GB more), so at the default size it should run out of memory -- run it on its own, an
out-of-memory rank ends the job; so should ``--no-donate`` on 2 GPUs (it fits 4).

``--layers auto`` sizes the decoder from the GPU: the fewest layers whose unsharded training
state (16 bytes/param) exceeds one card's total memory (26 layers on an 80 GB H100, 46 --
9.5e9 params -- on a 141 GB H200), so the run shows a model that cannot train on one card;
the summary says ``unsharded_state_exceeds_one_gpu``.

GPU (2 x H100 80 GB; the other two commands are controls expected to fail with OOM on 2 cards,
the last one is the pure step on 4 cards)::

    torchrun --standalone --nproc-per-node=2 benchmarks/sharded_big_model.py
    torchrun --standalone --nproc-per-node=2 benchmarks/sharded_big_model.py --no-donate
    torchrun --standalone --nproc-per-node=2 benchmarks/sharded_big_model.py --blocks none
    torchrun --standalone --nproc-per-node=4 benchmarks/sharded_big_model.py --no-donate

CPU smoke run (2 gloo processes, a tiny decoder; also checks per-block donated == whole-gather
pure)::

    torchrun --standalone --nproc-per-node=2 benchmarks/sharded_big_model.py --small --device cpu

``--dp``: the same decoder trained with DP-SGD through
``make_sharded_dp_train_step(make_dp_train_step(ghost, ...), layout, blocks="auto",
donate=True)``: ghost per-sample norms (per-sample loss: the mean token cross-entropy of a
sequence), flat clipping at ``--clip`` (``--per-layer``: per-layer clipping), Gaussian noise
``--sigma`` (each rank adds its shard's slice of the one draw). Every rank's ``--batch``
sequences are one physical batch, all valid (a benchmark: no Poisson sampler; the step takes
``sample_rate = W batch / dataset_size`` for its ``1 / (q N)`` scale). Per rank: the sharded
Adam state (16 bytes/param / W with donation), the params outside the blocks (embeddings,
final norm, head) and their clipped sums, ONE gathered decoder layer, the boundary activations
(flat clipping keeps each layer's input and output gradient for its second recompute) and the
ghost pass's per-layer activations of one recomputed layer. ``--dp --blocks none`` is the
whole-gather control (expected OOM at the default size). The small mode checks blocked +
donated == whole-gather pure on the same shards and noise key::

    torchrun --standalone --nproc-per-node=2 benchmarks/sharded_big_model.py --dp
    torchrun --standalone --nproc-per-node=2 benchmarks/sharded_big_model.py --dp --small --device cpu
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchfn import distributed as tdist
from torchfn.functional import init_train_state, make_functional
from torchfn.optim import adam


class Layer(nn.Module):
    """A pre-LN decoder layer: causal self-attention and a 4x GELU MLP (12 d^2 params)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # positions (1, T): a call shared by the batch (ghost norms need the batch, or 1, in dim 0)
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device)[None])
        for layer in self.layers:
            h = layer(h)
        return self.head(self.ln(h))


def shard_init(layout: tdist.ShardLayout, device: torch.device, seed: int
               ) -> dict[str, torch.Tensor]:
    """Return this rank's flat shard of every param, drawn directly (no full tensor)."""
    out = {}
    for name, shape in layout.shapes.items():
        c, valid = layout.chunk(name), layout.valid(name)
        shard = torch.zeros(c, dtype=layout.dtypes[name], device=device)
        if name.endswith("bias"):
            pass
        elif len(shape) == 1:  # LayerNorm gains
            shard[:valid] = 1.0
        else:
            g = torch.Generator(device=device)
            g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()) * 64 + layout.rank)
            shard[:valid] = torch.randn(valid, generator=g, device=device,
                                        dtype=layout.dtypes[name]) * 0.02
        out[name] = shard
    return out


def _layers(args: argparse.Namespace, gpu_bytes: int | None) -> int:
    """``--layers`` as an int; ``auto``: the fewest layers whose 16 bytes/param of unsharded
    training state (fp32 params, grads, Adam's two moments) exceed ``gpu_bytes``."""
    if args.layers != "auto":
        try:
            return int(args.layers)
        except ValueError:
            raise SystemExit(f"--layers: expected an int or 'auto', got {args.layers!r}") from None
    if gpu_bytes is None:
        raise SystemExit("--layers auto: needs --device cuda (it sizes the model from the GPU)")
    def count(layers: int) -> int:  # shapes only, from the model itself
        with torch.device("meta"):
            m = Decoder(args.vocab, args.d_model, layers, args.heads, args.seq)
        return sum(p.numel() for p in m.parameters())

    per_layer = count(2) - count(1)
    need = gpu_bytes / 16 - (count(1) - per_layer)  # minus the params outside the layers
    return max(1, math.ceil(need / per_layer))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny decoder (CPU smoke run)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--layers", default="26",
                    help="decoder layers, or 'auto': the fewest whose unsharded params + grads + "
                         "Adam moments (16 bytes/param) exceed one GPU's total memory")
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--blocks", choices=["auto", "none"], default="auto",
                    help="none: the whole-gather step (blocks=None), which runs out of memory "
                         "at the default size (run it on its own: an OOM ends the job)")
    ap.add_argument("--no-donate", dest="donate", action="store_false",
                    help="the pure step (donate=False): ~32 bytes/param / W at the update, "
                         "which does not fit 2 x 80 GB at the default size")
    ap.add_argument("--dp", action="store_true",
                    help="DP-SGD: make_sharded_dp_train_step(..., blocks=...) with ghost norms")
    ap.add_argument("--clip", type=float, default=1.0, help="--dp: max_grad_norm C")
    ap.add_argument("--sigma", type=float, default=1.0, help="--dp: noise_multiplier")
    ap.add_argument("--per-layer", action="store_true", help="--dp: per-layer clipping")
    args = ap.parse_args()
    if args.small:
        args.layers, args.d_model, args.heads, args.vocab, args.seq = 3, 32, 4, 97, 16
        args.steps, args.warmup = 2, 1
    info = tdist.init_from_env("gloo" if args.device == "cpu" else None)
    device, rank, world = info.device, info.rank, info.world_size
    gpu_bytes = (torch.cuda.get_device_properties(device).total_memory
                 if device.type == "cuda" else None)
    args.layers = _layers(args, gpu_bytes)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    with torch.device("meta"):
        module = Decoder(args.vocab, args.d_model, args.layers, args.heads, args.seq)
    model_fn, meta_params, _ = make_functional(module)
    layout = tdist.ShardLayout.from_params(meta_params)
    n_params = sum(math.prod(s) for s in layout.shapes.values())
    opt = adam(1e-4)

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    g = torch.Generator(device=device).manual_seed(1000 + rank)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g, device=device),
                torch.randint(0, args.vocab, (args.batch, args.seq), generator=g,
                              device=device)) for _ in range(args.warmup + args.steps)]

    if args.dp:
        from torchfn.persample import init_dp_state, make_dp_train_step, make_ghost_model

        ghost, ghost_params, _ = make_ghost_model(module)  # meta: shapes only
        assert list(ghost_params) == list(layout.shapes)

        def per_sample_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            tok = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            return tok.view(y.shape).mean(1)  # (B,): one loss per sequence

        dataset_size = 1_000_000

        def make_dp(g: object) -> object:
            return make_dp_train_step(
                g, per_sample_loss, opt, noise_multiplier=args.sigma, max_grad_norm=args.clip,
                clipping="per_layer" if args.per_layer else "flat",
                sample_rate=world * args.batch / dataset_size, dataset_size=dataset_size)

        valid = torch.ones(args.batch, dtype=torch.bool, device=device)

    def make_step(blocks: object, donate: bool) -> tuple[object, object]:
        if args.dp:
            if blocks is None:  # whole gather: the ghost pass takes full params on the device
                with torch.device(device):
                    real = Decoder(args.vocab, args.d_model, args.layers, args.heads, args.seq)
                dp = make_dp(make_ghost_model(real)[0])
                del real
            else:  # per block: the meta ghost model (its blocks get their params gathered)
                dp = make_dp(ghost)
            sstep = tdist.make_sharded_dp_train_step(dp, layout, blocks=blocks, donate=donate)
            state = init_dp_state(shard_init(layout, device, seed=0), {}, opt, seed=0)
            return (lambda st, b: sstep(st, b, valid)), state
        if blocks is None:  # whole gather: a plain functional_call of the meta module
            def fn(p: dict, b: dict, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
                return torch.func.functional_call(module, (p, b), (x,)), b
        else:
            fn = model_fn
        step = tdist.make_sharded_train_step(fn, loss_fn, opt, layout, blocks=blocks,
                                             max_grad_norm=1.0, donate=donate)
        return step, init_train_state(shard_init(layout, device, seed=0), {}, opt, seed=0)

    def run(blocks: object, donate: bool) -> dict[str, object]:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        step, state = make_step(blocks, donate)
        times, losses = [], []
        for i, batch in enumerate(batches):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        out: dict[str, object] = {
            "rank": rank, "dp": args.dp, "blocks": blocks, "donate": donate,
            "step_s": statistics.median(times),
            "losses": losses, "params": layout.gather(state.params) if args.small else None}
        if device.type == "cuda":
            out["max_memory_allocated_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
        return out

    if args.small:
        results = [run("auto", args.donate), run(None, False)]
    else:
        results = [run("auto" if args.blocks == "auto" else None, args.donate)]
    if args.small:  # per-block (donated) == whole gather (pure) on the same shards and batches
        a, b = results[0].pop("params"), results[1].pop("params")
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        results[0]["max_abs_diff_vs_whole"] = diff
        if diff > 1e-5:
            raise SystemExit(f"rank {rank}: per-block and whole-gather params differ by {diff}")
    for r in results:
        r.pop("params", None)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        print(json.dumps({
            "params": n_params, "world": world, "device": str(device.type), "dp": args.dp,
            "clipping": ("per_layer" if args.per_layer else "flat") if args.dp else None,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "unsharded_param_grad_adam_GB": 16 * n_params / 1e9,
            "sharded_state_per_rank_GB": 16 * n_params / world / 1e9,
            "estimated_update_peak_per_rank_GB": (
                (16 * n_params / world + 16 * max(layout.chunk(n) for n in layout.shapes))
                if args.donate else 32 * n_params / world) / 1e9,
            "one_gpu_memory_GB": gpu_bytes / 1e9 if gpu_bytes else None,
            "unsharded_state_exceeds_one_gpu": (16 * n_params > gpu_bytes) if gpu_bytes else None,
            "layers": args.layers, "d_model": args.d_model, "seq": args.seq,
            "batch_per_rank": args.batch, "ranks": everyone}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
