"""Ghost per-sample gradient rules on zoo layers, against a loop of torch.autograd.grad.

HF GPT-2's ``Conv1D`` (transposed linear rule), parameters tied across layers (embedding +
LM head, two linears, three uses, a fallback layer, frozen ties, per-layer DP clipping of a
tied group), ``nn.MultiheadAttention`` (the attention rule: masks, ``is_causal``, attention
weights, cross attention, encoder/decoder layers; the vmap fallback for ``add_bias_kv``),
depthwise/grouped convs, LayerNorm variants (a subclass, channels-last after a permute, an
HF-style RMSNorm) and tiny HF GPT-2/Llama LMs: materialised per-sample gradients, squared
norms (flat and per layer, tied groups counted once), weighted sums, all in float64; plus
compiled == eager for the new rules.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

from torchfn.persample import GhostLayerError, ghost_grad_norms, make_ghost_model

F64 = torch.float64
B = 4
TOL = {"rtol": 1e-9, "atol": 1e-11}


def sq_loss(out: Tensor, target: Tensor) -> Tensor:
    w = torch.linspace(0.5, 1.5, out[0].numel(), dtype=out.dtype).reshape(out.shape[1:])
    return ((out - target) ** 2 * w).flatten(1).sum(1)


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)


def loop_grads(ghost, params, buffers, x, y, loss_fn) -> dict[str, Tensor]:
    """Per-sample gradients by a loop of torch.autograd.grad: {name: (B, *shape)}."""
    out: dict[str, list[Tensor]] = {k: [] for k in params}
    for i in range(x.shape[0]):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = loss_fn(ghost(p, buffers, x[i : i + 1])[0], y[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, list(p.values()), allow_unused=True)
        for k, g in zip(p, grads, strict=True):
            out[k].append(torch.zeros_like(p[k]) if g is None else g)
    return {k: torch.stack(v) for k, v in out.items()}


def check(module: nn.Module, x: Tensor, y: Tensor, loss_fn=sq_loss,
          groups: dict[str, list[str]] | None = None, **kw) -> dict[str, str]:
    """Assert ghost == loop for ``module``; return ``ghost.layer_kinds``.

    ``groups``: ``{head layer: [layers tied to it]}``; their per-layer norm is the head's.
    """
    ghost, params, buffers = make_ghost_model(module.to(F64), **kw)
    x = x.to(F64) if x.is_floating_point() else x
    y = y.to(F64) if y.is_floating_point() else y
    trainable = [k for k in params if k not in ghost.frozen]
    ref = loop_grads(ghost, params, buffers, x, y, loss_fn)
    res = ghost.per_sample(params, buffers, x, y, loss_fn)
    mat = res.grads.materialize()
    assert set(mat) == set(trainable)
    for k in trainable:
        torch.testing.assert_close(mat[k], ref[k], **TOL, msg=k)
    ref_sq = sum(ref[k].flatten(1).square().sum(1) for k in trainable)
    torch.testing.assert_close(res.grads.sq_norms(), ref_sq, **TOL)
    norms = ghost_grad_norms(ghost, loss_fn)(params, buffers, x, y)
    torch.testing.assert_close(norms, ref_sq.sqrt(), **TOL)
    per_layer = res.grads.sq_norms(per_layer=True)
    groups = groups or {}
    tied_to = {m: h for h, ms in groups.items() for m in ms}
    for layer in ghost.layer_names:
        if layer in tied_to:
            torch.testing.assert_close(per_layer[layer], torch.zeros(B, dtype=F64), msg=layer)
            continue
        names = {k for m in [layer, *groups.get(layer, [])] for k in ghost.layer_params[m]}
        expect = sum(ref[k].flatten(1).square().sum(1) for k in names)
        torch.testing.assert_close(per_layer[layer], expect, **TOL, msg=layer)
    coef = torch.rand(B, dtype=F64) + 0.1
    summed = res.grads.weighted_sum(coef)
    for k in params:
        expect = torch.tensordot(coef, ref[k], dims=1) if k in trainable else ref[k][0] * 0
        torch.testing.assert_close(summed[k], expect, **TOL, msg=k)
    # per-layer coefficients: a parameter takes its (first) layer's, a tied layer its head's
    coefs = {n: torch.rand(B, dtype=F64) + 0.1 for n in ghost.layer_names}
    summed = res.grads.weighted_sum(coefs)
    for k in trainable:
        first = next(n for n, names in ghost.layer_params.items() if k in names)
        expect = torch.tensordot(coefs[tied_to.get(first, first)], ref[k], dims=1)
        torch.testing.assert_close(summed[k], expect, **TOL, msg=k)
    return ghost.layer_kinds


# ---------------------------------------------------------------------------------------------
# 1. HF GPT-2's Conv1D


def test_hf_conv1d_gets_the_transposed_linear_rule() -> None:
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    net = nn.Sequential(pytorch_utils.Conv1D(6, 3), nn.Tanh(), pytorch_utils.Conv1D(2, 6))
    kinds = check(net, torch.randn(B, 5, 3), torch.randn(B, 5, 2))
    assert kinds == {"0": "linear", "2": "linear"}
    kinds = check(net, torch.randn(B, 3), torch.randn(B, 2))  # no sequence dim
    assert kinds == {"0": "linear", "2": "linear"}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_weighted_sum_in_the_weight_layout_compiled_equals_reference(backend: str) -> None:
    """Book-keeping sums of ``Conv1D`` (``(d_in, d_out)`` weight) and ``nn.Linear`` layers,
    wider and narrower than their inputs (the coefficient goes into the narrower of ``a`` and
    ``g``), sequences and single positions: eager and compiled equal the weighted sum of the
    loop's per-sample gradients (float64), and every sum is contiguous in the weight's own
    layout (no transposed view left for the noise add, guard and update to read column-wise).
    """
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    net = nn.Sequential(pytorch_utils.Conv1D(7, 3), nn.Tanh(), pytorch_utils.Conv1D(2, 7),
                        nn.Tanh(), nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64)
    ghost, params, buffers = make_ghost_model(net)
    coef = torch.rand(B, dtype=F64) + 0.1
    for x, y in [(torch.randn(B, 4, 3, dtype=F64), torch.randn(B, 4, 3, dtype=F64)),
                 (torch.randn(B, 3, dtype=F64), torch.randn(B, 3, dtype=F64))]:
        ref = loop_grads(ghost, params, buffers, x, y, sq_loss)

        def step(params, buffers, x, y):
            return ghost.per_sample(params, buffers, x, y, sq_loss).grads.weighted_sum(coef)

        eager = step(params, buffers, x, y)
        compiled = torch.compile(step, fullgraph=True, backend=backend)(params, buffers, x, y)
        for k in params:
            expect = torch.tensordot(coef, ref[k], dims=1)
            for got in (eager[k], compiled[k]):
                torch.testing.assert_close(got, expect, **TOL, msg=k)
                assert got.is_contiguous(), (k, got.stride())


class GPT2Wrap(nn.Module):
    """HF GPT-2 LM with position ids expanded to the batch (ghost layers need batch dim 0)."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        cfg = transformers.GPT2Config(vocab_size=13, n_positions=8, n_embd=8, n_layer=1,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, attn_implementation="eager")
        self.gpt = transformers.GPT2LMHeadModel(cfg)

    def forward(self, ids: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        return self.gpt(input_ids=ids, position_ids=pos).logits


def test_gpt2_tied_lm_head_is_exact() -> None:
    torch.manual_seed(0)
    net = GPT2Wrap()
    assert net.gpt.lm_head.weight is net.gpt.transformer.wte.weight
    ids = torch.randint(0, 13, (B, 6))
    kinds = check(net, ids, torch.randint(0, 13, (B, 6)), lm_loss,
                  groups={"gpt.transformer.wte": ["gpt.lm_head"]})
    assert "fallback" not in kinds.values(), kinds
    assert kinds["gpt.transformer.h.0.attn.c_attn"] == "linear"


# ---------------------------------------------------------------------------------------------
# 2. Tied parameters


class TiedLM(nn.Module):
    """Embedding -> mixer -> LM head whose weight is the embedding's (optional bias)."""

    def __init__(self, vocab: int = 11, d: int = 5, head_bias: bool = True,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=head_bias)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


@pytest.mark.parametrize("head_bias", [False, True])
def test_tied_embedding_and_head(head_bias: bool) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (B, 7))
    ids[0, :3] = 2  # repeated ids and a padding id
    net = TiedLM(head_bias=head_bias, padding_idx=2)
    kinds = check(net, ids, torch.randint(0, 11, (B, 7)), lm_loss, groups={"emb": ["head"]})
    assert kinds == {"emb": "embedding", "mix": "linear", "head": "linear"}


class TiedLinears(nn.Module):
    """One (weight, bias) used by three layers; 2-D and 3-D inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight, self.b.bias = self.a.weight, self.a.bias
        self.c.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("shape", [(B, 4), (B, 3, 4)])
def test_parameter_used_by_three_layers(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    check(TiedLinears(), torch.randn(shape), torch.randn(shape), groups={"a": ["b", "c"]})


class TiedGeneric(nn.Module):
    """A weight shared by an nn.Linear and a custom (fallback) layer: the generic route."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.custom = Bilinear()
        self.custom.weight = self.lin.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.custom(torch.tanh(self.lin(x)))


class Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        return (x @ self.weight) * x * self.scale


def test_tied_with_a_fallback_layer() -> None:
    torch.manual_seed(0)
    kinds = check(TiedGeneric(), torch.randn(B, 3, 4), torch.randn(B, 3, 4),
                  groups={"lin": ["custom"]})
    assert kinds == {"lin": "linear", "custom": "fallback"}


def test_frozen_tied_parameter_gets_no_gradient() -> None:
    torch.manual_seed(0)
    net = TiedLM(head_bias=False)
    net.emb.weight.requires_grad_(False)
    ghost, _, _ = make_ghost_model(net)
    assert ghost.frozen == ("emb.weight",)
    assert ghost.layer_names == ("mix",)
    check(net, torch.randint(0, 11, (B, 5)), torch.randint(0, 11, (B, 5)), lm_loss)


def test_tied_compiled_equals_eager() -> None:
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(TiedLM().to(F64))
    ids, y = torch.randint(0, 11, (B, 6)), torch.randint(0, 11, (B, 6))

    def step(params, buffers, ids, y):
        res = ghost.per_sample(params, buffers, ids, y, lm_loss)
        sq = res.grads.sq_norms()
        return sq, res.grads.weighted_sum(1 / (1 + sq))

    eager = step(params, buffers, ids, y)
    counter = CompileCounterWithBackend("aot_eager")  # inductor: test_ghost_norms
    compiled_step = torch.compile(step, fullgraph=True, backend=counter)
    torch.testing.assert_close(compiled_step(params, buffers, ids, y), eager, **TOL)
    ids2 = torch.randint(0, 11, (B, 6))
    torch.testing.assert_close(compiled_step(params, buffers, ids2, y),
                               step(params, buffers, ids2, y), **TOL)
    assert counter.frame_count == 1  # no recompile


# ---------------------------------------------------------------------------------------------
# 3. nn.MultiheadAttention (the attention rule; the vmap fallback for other settings)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, xm: tuple[Tensor, Tensor]) -> Tensor:
        x, pad = xm
        return self.head(self.layer(x, src_key_padding_mask=pad))


class PairBatch(tuple):
    """``(x, mask)`` that slices per sample (for the loop reference)."""

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return PairBatch((self[0][i], self[1][i]))
        return tuple.__getitem__(self, i)

    @property
    def shape(self) -> torch.Size:
        return self[0].shape

    def is_floating_point(self) -> bool:
        return False


def test_multihead_attention_in_encoder_layer_with_padding_mask() -> None:
    torch.manual_seed(0)
    x = torch.randn(B, 5, 8, dtype=F64)
    pad = torch.zeros(B, 5, dtype=torch.bool)
    pad[1, 3:] = True
    pad[2, 4:] = True
    kinds = check(Encoder(), PairBatch((x, pad)), torch.randn(B, 5, 3))
    assert kinds["layer.self_attn"] == "attention"
    assert kinds["layer.linear1"] == "linear"


class MHA(nn.Module):
    """One MultiheadAttention called in a chosen way (``mode``)."""

    def __init__(self, mode: str, **kw) -> None:
        super().__init__()
        self.mode = mode
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True, **kw)
        self.proj = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        a, mode, t = self.attn, self.mode, x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        if mode == "no_weights":
            return a(x, x, x, need_weights=False)[0]
        if mode == "weights":  # the loss sees the averaged attention weights too
            out, w = a(x, x, x)
            return out + w.sum(-1, keepdim=True) * w[..., :1]
        if mode == "head_weights":
            out, w = a(x, x, x, average_attn_weights=False)
            return out * w[:, 1, :, :1]
        if mode == "causal_bool":
            return a(x, x, x, attn_mask=causal, need_weights=False)[0]
        if mode == "is_causal":
            mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=x.dtype)
            return a(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
        if mode == "float_3d":  # a per-(sample, head) additive mask
            heads = torch.tensor([1.0, -2.0], dtype=x.dtype).reshape(1, 2, 1, 1)
            bias = x[:, None, :, :1] * x[:, None, None, :, 1] * heads  # (B, H, L, S)
            return a(x, x, x, attn_mask=bias.flatten(0, 1))[0]
        if mode == "cross_twice":  # cross attention to a shorter memory, called twice
            mem = torch.tanh(self.proj(x[:, :3]))
            y = a(x, mem, mem, need_weights=False)[0]
            return a(y, x, x, key_padding_mask=causal[:1].expand(x.shape[0], -1))[0]
        raise AssertionError(mode)


MODES = ["no_weights", "weights", "head_weights", "causal_bool", "is_causal", "float_3d",
         "cross_twice"]


@pytest.mark.parametrize("mode", MODES)
def test_multihead_attention_rule(mode: str) -> None:
    torch.manual_seed(0)
    kinds = check(MHA(mode), torch.randn(B, 4, 6), torch.randn(B, 4, 6))
    assert kinds["attn"] == "attention"


def test_multihead_attention_bias_kv_fallback_eval_dropout_no_bias() -> None:
    torch.manual_seed(0)
    kinds = check(MHA("weights", add_bias_kv=True), torch.randn(B, 4, 6), torch.randn(B, 4, 6))
    assert kinds["attn"] == "fallback"
    kinds = check(MHA("no_weights", dropout=0.5).eval(), torch.randn(B, 4, 6),
                  torch.randn(B, 4, 6))
    assert kinds["attn"] == "attention"
    kinds = check(MHA("cross_twice", bias=False), torch.randn(B, 4, 6), torch.randn(B, 4, 6))
    assert kinds["attn"] == "attention"


def test_multihead_attention_refuses_training_dropout() -> None:
    ghost, params, buffers = make_ghost_model(MHA("no_weights", dropout=0.5))
    with pytest.raises(GhostLayerError, match=r"dropout=0.5 in training mode .* Set its "
                                              r"dropout to 0 or call eval\(\)"):
        ghost.per_sample(params, buffers, torch.randn(B, 4, 6), torch.randn(B, 4, 6), sq_loss)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(8, 2, dim_feedforward=12, dropout=0.0,
                                                batch_first=True, norm_first=True)

    def forward(self, x: Tensor) -> Tensor:
        mem = x[:, :3] * 0.5
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.layer(x, mem, tgt_mask=mask, tgt_is_causal=True)


def test_transformer_decoder_layer() -> None:
    torch.manual_seed(0)
    kinds = check(Decoder(), torch.randn(B, 5, 8), torch.randn(B, 5, 8))
    assert kinds["layer.self_attn"] == kinds["layer.multihead_attn"] == "attention"


def test_attention_compiled_equals_eager() -> None:
    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(MHA("weights").to(F64))
    x, y = torch.randn(B, 4, 6, dtype=F64), torch.randn(B, 4, 6, dtype=F64)

    def step(params, buffers, x, y):
        res = ghost.per_sample(params, buffers, x, y, sq_loss)
        sq = res.grads.sq_norms()
        return sq, res.grads.weighted_sum(1 / (1 + sq))

    eager = step(params, buffers, x, y)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(params, buffers, x, y)
    torch.testing.assert_close(compiled, eager, **TOL)


# ---------------------------------------------------------------------------------------------
# 4. Depthwise and grouped convs


@pytest.mark.parametrize("method", ["unfold", "grouped"])
def test_depthwise_and_grouped_convs(method: str) -> None:
    torch.manual_seed(0)
    net2 = nn.Sequential(nn.Conv2d(6, 6, 7, padding=3, groups=6), nn.Tanh(),
                         nn.Conv2d(6, 4, 3, groups=2))
    kinds = check(net2, torch.randn(B, 6, 9, 9), torch.randn(B, 4, 7, 7), conv_method=method)
    assert kinds == {"0": "conv", "2": "conv"}
    net1 = nn.Sequential(nn.Conv1d(4, 8, 3, groups=4), nn.Tanh(),
                         nn.Conv1d(8, 8, 5, padding="same", groups=8, bias=False))
    check(net1, torch.randn(B, 4, 10), torch.randn(B, 8, 8), conv_method=method)
    # one output position: the grouped Gram form is the cheaper one there
    check(nn.Conv2d(8, 8, 3, groups=2), torch.randn(B, 8, 3, 3), torch.randn(B, 8, 1, 1),
          conv_method=method)


def test_depthwise_conv_compiled_equals_eager() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.Tanh(),
                        nn.Flatten(),
                        nn.Linear(4 * 5 * 5, 2)).to(F64)
    ghost, params, buffers = make_ghost_model(net)
    x, y = torch.randn(B, 4, 5, 5, dtype=F64), torch.randn(B, 2, dtype=F64)

    def step(params, buffers, x, y):
        res = ghost.per_sample(params, buffers, x, y, sq_loss)
        sq = res.grads.sq_norms()
        return sq, res.grads.weighted_sum(1 / (1 + sq))

    eager = step(params, buffers, x, y)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(params, buffers, x, y)
    torch.testing.assert_close(compiled, eager, **TOL)


# ---------------------------------------------------------------------------------------------
# 5. LayerNorm variants


class LayerNorm2d(nn.LayerNorm):
    """timm-style: normalise the channel dim of NCHW."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class HFRMSNorm(nn.Module):
    """HF-style RMSNorm: a ``weight`` parameter and a custom forward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x: Tensor) -> Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.ln2d = LayerNorm2d(4)
        self.ln = nn.LayerNorm(4)
        self.rms = HFRMSNorm(4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.ln2d(self.conv(x))
        x = self.ln(x.permute(0, 2, 3, 1))  # channels-last nn.LayerNorm after a permute
        return self.rms(torch.tanh(x))


def test_layernorm_variants_are_exact() -> None:
    torch.manual_seed(0)
    net = ChannelsLast()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    kinds = check(net, torch.randn(B, 3, 6, 6), torch.randn(B, 4, 4, 4))
    assert kinds == {"conv": "conv", "ln2d": "fallback", "ln": "norm", "rms": "fallback"}


def test_tied_cross_terms_need_no_materialised_gradients(monkeypatch) -> None:
    """Embedding + linear head and linear + linear ties take the closed forms."""
    from torchfn.persample import _ghost_layers

    def refuse(self):
        raise AssertionError("materialize called")

    for net, x in ((TiedLM(), torch.randint(0, 11, (B, 6))), (TiedLinears(), torch.randn(B, 3, 4))):
        ghost, params, buffers = make_ghost_model(net.to(F64))
        x = x.to(F64) if x.is_floating_point() else x
        loss = lm_loss if isinstance(net, TiedLM) else sq_loss
        y = torch.randint(0, 11, (B, 6)) if isinstance(net, TiedLM) else torch.randn(B, 3, 4, dtype=F64)
        res = ghost.per_sample(params, buffers, x, y, loss)
        expect = res.grads.sq_norms(per_layer=True)
        with monkeypatch.context() as m:
            m.setattr(_ghost_layers._LinearLike, "materialize", refuse)
            m.setattr(_ghost_layers._EmbeddingGrads, "materialize", refuse)
            res = ghost.per_sample(params, buffers, x, y, loss)
            got = res.grads.sq_norms(per_layer=True)
        torch.testing.assert_close(got, expect, **TOL)


def test_dp_per_layer_clipping_counts_a_tied_group_once() -> None:
    """clipping="per_layer": the tied group (emb.weight, head.bias) is clipped as one block
    under the first layer's threshold (C / sqrt(L) with L counting groups); 'head' reports
    zero norm."""
    torchopt = pytest.importorskip("torchopt")
    from torchfn.persample import init_dp_state, make_dp_train_step

    torch.manual_seed(0)
    ghost, params, buffers = make_ghost_model(TiedLM().to(F64))
    ids, y = torch.randint(0, 11, (B, 6)), torch.randint(0, 11, (B, 6))
    step = make_dp_train_step(ghost, lm_loss, torchopt.sgd(0.1), noise_multiplier=0.0,
                              max_grad_norm=0.3, sample_rate=0.5, dataset_size=8,
                              clipping="per_layer")
    state = init_dp_state(params, buffers, torchopt.sgd(0.1), seed=0)
    got = step.clipped_sum(state, (ids, y), torch.ones(B, dtype=torch.bool)).grads
    ref = loop_grads(ghost, params, buffers, ids, y, lm_loss)
    assert ghost.clip_groups == {"emb": ("emb", "head"), "mix": ("mix",)}
    c = 0.3 / 2**0.5  # C / sqrt(L), L = 2 clipping groups
    groups = {"emb": ["emb.weight", "head.bias"], "mix": ["mix.weight", "mix.bias"]}
    expect = {}
    for names in groups.values():
        n = sum(ref[k].flatten(1).square().sum(1) for k in names).sqrt()
        coef = torch.clamp(c / (n + 1e-6), max=1.0)
        expect.update({k: torch.tensordot(coef, ref[k], dims=1) for k in names})
    assert set(got) == set(expect)
    for k in expect:
        torch.testing.assert_close(got[k], expect[k], **TOL, msg=k)


def test_multihead_attention_in_encoder_layer_eval_mode() -> None:
    """Eval mode: torch's fused encoder fast path must not bypass the ghost layers."""
    torch.manual_seed(0)
    x = torch.randn(B, 5, 8, dtype=F64)
    pad = torch.zeros(B, 5, dtype=torch.bool)
    pad[1, 3:] = True
    kinds = check(Encoder().eval(), PairBatch((x, pad)), torch.randn(B, 5, 3))
    assert kinds["layer.self_attn"] == "attention"


class LlamaWrap(nn.Module):
    """A tiny HF Llama LM with tied input/output embeddings (HF RMSNorm: vmap fallback)."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        cfg = transformers.LlamaConfig(vocab_size=13, hidden_size=8, intermediate_size=12,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, max_position_embeddings=16,
                                       tie_word_embeddings=True, attn_implementation="eager")
        self.lm = transformers.LlamaForCausalLM(cfg)

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(input_ids=ids).logits


def test_llama_tied_embeddings_and_rmsnorm() -> None:
    torch.manual_seed(0)
    net = LlamaWrap()
    assert net.lm.lm_head.weight is net.lm.model.embed_tokens.weight
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    kinds = check(net, torch.randint(0, 13, (B, 6)), torch.randint(0, 13, (B, 6)), lm_loss,
                  groups={"lm.model.embed_tokens": ["lm.lm_head"]})
    assert kinds["lm.model.layers.0.input_layernorm"] == "fallback"
    assert kinds["lm.model.layers.0.self_attn.q_proj"] == "linear"


def _weighted_sums_and_small_gemms(net: nn.Module, x: Tensor, y: Tensor, per_layer: bool
                                   ) -> tuple[int, dict[str, Tensor]]:
    """Check ghost ``weighted_sum`` of ``net`` (eager and compiled) against the loop reference
    with random flat or per-layer coefficients; return the number of ``coef @ x`` GEMMs (1-D
    left operand) in the compiled graph and the layer kinds."""
    import operator

    ghost, params, buffers = make_ghost_model(net)
    ref = loop_grads(ghost, params, buffers, x, y, sq_loss)
    if per_layer:
        coef = {n: torch.rand(B, dtype=F64) + 0.1 for n in ghost.layer_names}
    else:
        coef = torch.rand(B, dtype=F64) + 0.1
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(params, buffers, x, y, coef):
        return ghost.per_sample(params, buffers, x, y, sq_loss).grads.weighted_sum(coef)

    eager = step(params, buffers, x, y, coef)
    compiled = torch.compile(step, fullgraph=True, backend=capture)(params, buffers, x, y, coef)
    for k in params:
        c = coef[k.rsplit(".", 1)[0]] if per_layer else coef
        for got in (eager[k], compiled[k]):
            torch.testing.assert_close(got, torch.tensordot(c, ref[k], dims=1), **TOL, msg=k)
    (gm,) = graphs
    small = [n for n in gm.graph.nodes if n.op == "call_function"
             and n.target in (torch.matmul, operator.matmul)
             and n.args[0].meta["example_value"].dim() == 1]
    return len(small), ghost.layer_kinds


@pytest.mark.parametrize("per_layer", [False, True])
def test_small_parts_of_all_layers_are_summed_in_one_gemm(per_layer: bool, monkeypatch) -> None:
    """Biases and LayerNorm parameters (small per-sample gradients) of every layer are
    contracted with the clipping coefficients in one ``coef @ cat(parts)`` GEMM per clipping
    group instead of one small GEMM each (one kernel launch instead of dozens in a
    transformer); parts above ``SMALL_PART`` numbers per sample stay on their own. Eager and
    compiled equal the weighted sum of the loop's per-sample gradients (float64)."""
    from torchfn.persample import _ghost_layers

    monkeypatch.setattr(_ghost_layers, "SMALL_PART", 6)  # the 7-wide LayerNorm stays alone
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 7),
                        nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 2, bias=False),
                        nn.Linear(2, 3)).to(F64)
    x, y = torch.randn(B, 5, 3, dtype=F64), torch.randn(B, 5, 3, dtype=F64)
    small_gemms, _ = _weighted_sums_and_small_gemms(net, x, y, per_layer)
    # flat: the four biases and the 6-wide LayerNorm's weight and bias in one GEMM; per layer:
    # one per layer that has small parts (0, 1, 3, 7; the 7-wide LayerNorm's are too large)
    assert small_gemms == (4 if per_layer else 1), small_gemms


def test_small_parts_of_attention_layers_join_the_one_gemm() -> None:
    """``nn.TransformerEncoderLayer``: the attention's in/out projection biases join the
    feed-forward biases and LayerNorm parameters in the one small-parts GEMM; the clipped sum
    equals the loop reference (float64), eager and compiled."""
    torch.manual_seed(0)
    net = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).to(F64)
    x, y = torch.randn(B, 5, 8, dtype=F64), torch.randn(B, 5, 8, dtype=F64)
    small_gemms, kinds = _weighted_sums_and_small_gemms(net, x, y, per_layer=False)
    assert "attention" in kinds.values()
    assert small_gemms == 1, small_gemms
