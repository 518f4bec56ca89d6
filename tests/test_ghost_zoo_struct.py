"""Ghost models of everyone's structures against a per-sample loop of torch.autograd.grad.

torch's TransformerEncoder/Decoder (their layers read attributes of tapped children), modules
owning parameters directly beside child layers (timm-style ViT, ConvNeXt layer scale, HF
ViTEmbeddings: a "direct" layer, children stay ghost), layers called on data shared by the
batch (HF position ids ``(1, T)``), dict (keyword) inputs (tiny HF BERT and GPT-2 with padding),
and the coverage check under dropout. Float64 throughout; also the DP step (flat and per-layer
clipping) where it matters, and compiled == eager for a TransformerEncoder.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchopt
from torch import Tensor, nn

from torchfn.persample import (
    GhostLayerError,
    check_ghost_coverage,
    ghost_grad_norms,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)

F64 = torch.float64
B = 4
TOL = {"rtol": 1e-9, "atol": 1e-11}


def xent(out: Any, y: Tensor) -> Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    if logits.dim() == 3:  # language model: mean over positions
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
    return F.cross_entropy(logits, y, reduction="none")


def _sample(inputs: Any, i: int) -> Any:
    if isinstance(inputs, Tensor):
        return inputs[i : i + 1]
    if isinstance(inputs, Mapping):
        return {k: _sample(v, i) for k, v in inputs.items()}
    return type(inputs)(_sample(v, i) for v in inputs)


def _call(ghost, params, buffers, inputs):
    if isinstance(inputs, Mapping):
        return ghost(params, buffers, **inputs)[0]
    return ghost(params, buffers, inputs)[0]


def loop_grads(ghost, params, buffers, inputs, y) -> dict[str, Tensor]:
    """Per-sample gradients by a loop of torch.autograd.grad: {name: (B, *shape)}."""
    out: dict[str, list[Tensor]] = {k: [] for k in ghost.trainable}
    for i in range(y.shape[0]):
        p = {k: v.clone().requires_grad_(k in out) for k, v in params.items()}
        loss = xent(_call(ghost, p, buffers, _sample(inputs, i)), y[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, [p[k] for k in out], allow_unused=True)
        for k, g in zip(out, grads, strict=True):
            out[k].append(torch.zeros_like(p[k]) if g is None else g)
    return {k: torch.stack(v) for k, v in out.items()}


def assert_matches_loop(net: nn.Module, inputs: Any, y: Tensor) -> Any:
    ghost, params, buffers = make_ghost_model(net)
    ref = loop_grads(ghost, params, buffers, inputs, y)
    res = ghost.per_sample(params, buffers, inputs, y, xent)
    mat = res.grads.materialize()
    for k in ref:
        torch.testing.assert_close(mat[k], ref[k], **TOL, msg=k)
    ref_sq = sum(g.reshape(B, -1).square().sum(1) for g in ref.values())
    torch.testing.assert_close(res.grads.sq_norms(), ref_sq, **TOL)
    per_layer = res.grads.sq_norms(per_layer=True)
    for layer, names in ghost.layer_params.items():
        expect = sum(ref[k].reshape(B, -1).square().sum(1) for k in names)
        torch.testing.assert_close(per_layer[layer], expect, **TOL, msg=layer)
    coef = torch.rand(B, dtype=F64, device=y.device) + 0.1
    summed = res.grads.weighted_sum(coef)
    for k in ref:
        torch.testing.assert_close(summed[k], torch.tensordot(coef, ref[k], dims=1), **TOL,
                                   msg=k)
    norms = ghost_grad_norms(ghost, xent)(params, buffers, inputs, y)
    torch.testing.assert_close(norms, ref_sq.sqrt(), **TOL)
    check_ghost_coverage(ghost, xent, params, buffers, inputs, y, rtol=1e-9, atol=1e-11)
    return ghost, params, buffers, ref


def assert_dp_step_matches(ghost, params, buffers, inputs, y, ref, clipping: str) -> None:
    """One DP step (noise 0) == clip-then-sum of the loop's per-sample gradients."""
    c = 0.5 * float(sum(g.reshape(B, -1).square().sum(1) for g in ref.values()).sqrt().median())
    opt = torchopt.sgd(1.0)
    step = make_dp_train_step(ghost, xent, opt, noise_multiplier=0.0, max_grad_norm=c,
                              sample_rate=B / 100, dataset_size=100, clipping=clipping)
    state = init_dp_state(params, buffers, opt, seed=0, trainable=ghost.trainable)
    new, metrics = step(state, (inputs, y), torch.ones(B, dtype=torch.bool))
    coef = {}
    if clipping == "flat":
        norm = sum(g.reshape(B, -1).square().sum(1) for g in ref.values()).sqrt()
        coef = dict.fromkeys(ref, torch.clamp(c / (norm + 1e-6), max=1.0))
    else:
        c_layer = c / math.sqrt(len(ghost.layer_names))
        for names in ghost.layer_params.values():
            norm = sum(ref[k].reshape(B, -1).square().sum(1) for k in names).sqrt()
            coef.update(dict.fromkeys(names, torch.clamp(c_layer / (norm + 1e-6), max=1.0)))
    for k, g in ref.items():
        expect = params[k] - torch.einsum("b,b...->...", coef[k], g) / B
        torch.testing.assert_close(new.params[k], expect, **TOL, msg=k)
    assert float(metrics["clip_fraction"]) > 0


# --- 1. torch's TransformerEncoder / TransformerDecoder -------------------------------------


class Encoder(nn.Module):
    def __init__(self, norm_first: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        # torch's default (nested tensors on the fused inference path) where it applies
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=not norm_first)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        pad = ids == 0
        return self.head(self.enc(self.emb(ids), src_key_padding_mask=pad).mean(1))


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.tr = nn.Transformer(8, 2, 1, 1, 12, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=h.dtype)
        return self.head(self.tr(h, h[:, :3], tgt_mask=mask[:3, :3]).mean(1))


def _ids(seed: int, t: int = 5) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 7, (B, t), generator=g)
    ids[1, -2:] = 0  # padding
    return ids, torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-ln", "pre-ln"])
def test_transformer_encoder_matches_loop_and_dp_step(training, norm_first) -> None:
    torch.manual_seed(0)
    net = Encoder(norm_first).to(F64).train(training)
    ids, y = _ids(1)
    ghost, params, buffers, ref = assert_matches_loop(net, ids, y)
    assert ghost.layer_kinds["enc.layers.0.linear1"] == "linear"
    if training:
        assert_dp_step_matches(ghost, params, buffers, ids, y, ref, "flat")


def test_transformer_decoder_matches_loop() -> None:
    torch.manual_seed(1)
    ids, y = _ids(2)
    ghost, *_ = assert_matches_loop(EncDec().to(F64), ids, y)
    assert ghost.layer_kinds["tr.decoder.layers.0.multihead_attn"] == "attention"


def test_tap_forwards_attributes_but_not_dunders_and_copies() -> None:
    net = Encoder().to(F64)
    ghost, params, buffers = make_ghost_model(net)
    tapped = ghost._model_fn._module.enc.layers[0].self_attn
    assert type(tapped).__name__ == "Tap" and tapped.batch_first is True
    assert tapped.num_heads == 2 and callable(tapped.merge_masks)
    with pytest.raises(AttributeError, match="no_such_setting"):
        tapped.no_such_setting  # noqa: B018
    ids, y = _ids(3)
    expect = ghost_grad_norms(ghost, xent)(params, buffers, ids, y)
    for other in (copy.deepcopy(ghost), pickle.loads(pickle.dumps(ghost))):
        torch.testing.assert_close(ghost_grad_norms(other, xent)(params, buffers, ids, y),
                                   expect, **TOL)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # MHA fallback
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compiled_transformer_encoder_equals_eager(training) -> None:
    """Eval mode: torch's fused inference path must not bypass the taps when compiled."""
    torch.manual_seed(2)
    ghost, params, buffers = make_ghost_model(Encoder().to(F64).train(training))

    def f(params, buffers, ids, y):
        res = ghost.per_sample(params, buffers, ids, y, xent)
        return res.grads.sq_norms(per_layer=True)

    ids, y = _ids(4)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out_c, out_e = compiled(params, buffers, ids, y), f(params, buffers, ids, y)
    for k in out_e:
        torch.testing.assert_close(out_c[k], out_e[k], msg=k)


# --- 2. parameters owned directly beside child layers ----------------------------------------


class TinyViT(nn.Module):
    """timm-style: the root owns cls_token and pos_embed; a conv patch embed, one block."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.patch = nn.Conv2d(2, d, 2, stride=2)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos_embed = nn.Parameter(torch.randn(1, 5, d) * 0.5)
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)  # (B, 4, d)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        q, k, v = self.qkv(self.norm1(h)).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return self.head(h[:, 0])


class ConvNeXtBlock(nn.Module):
    """Depthwise conv, LayerNorm, MLP, then a layer-scale ``gamma`` owned by the block."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pw1, self.pw2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.gamma = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.gamma * self.pw2(F.gelu(self.pw1(h)))
        return x + h.permute(0, 3, 1, 2)


def test_vit_root_parameters_are_a_direct_layer_and_the_rest_stays_ghost() -> None:
    torch.manual_seed(3)
    net = TinyViT().to(F64)
    x, y = torch.randn(B, 2, 4, 4, dtype=F64), torch.randint(0, 3, (B,))
    ghost, params, buffers, ref = assert_matches_loop(net, x, y)
    assert ghost.layer_kinds == {"patch": "conv", "norm1": "norm", "qkv": "linear",
                                 "proj": "linear", "head": "linear", "": "direct"}
    assert ghost.layer_params[""] == ("cls_token", "pos_embed")
    for clipping in ("flat", "per_layer"):  # per-layer: the direct layer is one more layer
        assert_dp_step_matches(ghost, params, buffers, x, y, ref, clipping)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap of SDPA
def test_compiled_direct_layer_equals_eager() -> None:
    torch.manual_seed(3)
    ghost, params, buffers = make_ghost_model(TinyViT().to(F64))
    x, y = torch.randn(B, 2, 4, 4, dtype=F64), torch.randint(0, 3, (B,))
    coef = torch.rand(B, dtype=F64)

    def f(params, buffers, x, y):
        res = ghost.per_sample(params, buffers, x, y, xent)
        return res.grads.sq_norms(per_layer=True), res.grads.weighted_sum(coef)

    out_c = torch.compile(f, fullgraph=True, backend="aot_eager")(params, buffers, x, y)
    for c, e in zip(out_c, f(params, buffers, x, y), strict=True):
        for k in e:
            torch.testing.assert_close(c[k], e[k], msg=k)


def test_convnext_layer_scale_and_nested_direct_layers() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(1, 4, 2, stride=2)
            self.blocks = nn.Sequential(ConvNeXtBlock(), ConvNeXtBlock())
            self.scale = nn.Parameter(torch.tensor(1.5))  # the root owns one too: nested
            self.head = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.blocks(self.stem(x)).mean((2, 3)) * self.scale)

    torch.manual_seed(4)
    x, y = torch.randn(B, 1, 6, 6, dtype=F64), torch.randint(0, 3, (B,))
    ghost, params, buffers, ref = assert_matches_loop(Net().to(F64), x, y)
    assert ghost.layer_kinds["blocks.0"] == "direct" and ghost.layer_kinds[""] == "direct"
    assert ghost.layer_kinds["blocks.1.pw1"] == "linear"
    assert ghost.layer_params["blocks.1"] == ("blocks.1.gamma",)
    assert_dp_step_matches(ghost, params, buffers, x, y, ref, "per_layer")


def test_direct_layer_with_dropout_in_its_children_is_refused_clearly() -> None:
    class Drop(TinyViT):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Sequential(nn.Linear(8, 24), nn.Dropout(0.5))

    ghost, params, buffers = make_ghost_model(Drop().to(F64))
    x, y = torch.randn(B, 2, 4, 4, dtype=F64), torch.randint(0, 3, (B,))
    with pytest.raises(GhostLayerError, match=r"ghost layer '' \(Drop\).*deterministic"):
        ghost.per_sample(params, buffers, x, y, xent)
    ghost.eval().per_sample(params, buffers, x, y, xent)  # eval: no randomness, fine


def test_tied_parameters_under_a_direct_owner_stay_one_fallback_layer() -> None:
    class TiedPair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(4))
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x: Tensor) -> Tensor:
            return self.b(torch.tanh(self.a(x) * self.scale))

    ghost, *_ = make_ghost_model(nn.Sequential(TiedPair(), nn.Linear(4, 3)))
    assert ghost.layer_kinds == {"0": "fallback", "1": "linear"}


# --- 3. layers called on data shared by the batch --------------------------------------------


class SharedPos(nn.Module):
    def __init__(self, misuse: bool = False) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(7, 6), nn.Embedding(8, 6)
        self.ln, self.head = nn.LayerNorm(6), nn.Linear(6, 3)
        self.misuse = misuse

    def forward(self, ids: Tensor) -> Tensor:
        pos = self.pos(torch.arange(ids.shape[1], device=ids.device)[None])  # (1, T, 6)
        if self.misuse:  # indexes dim 0 instead of broadcasting: not per-sample any more
            pos = pos[:1].expand(ids.shape[0], -1, -1)[0]
        return self.head(self.ln(self.tok(ids) + pos).mean(1))


def test_layer_on_inputs_shared_by_the_batch_matches_loop() -> None:
    torch.manual_seed(5)
    ids, y = _ids(5)
    ghost, params, buffers, ref = assert_matches_loop(SharedPos().to(F64), ids, y)
    assert ghost.layer_kinds["pos"] == "embedding"
    assert_dp_step_matches(ghost, params, buffers, ids, y, ref, "flat")


def test_coverage_check_catches_a_shared_output_that_is_not_broadcast() -> None:
    ghost, params, buffers = make_ghost_model(SharedPos(misuse=True).to(F64))
    ids, y = _ids(6)
    with pytest.raises(ValueError, match=r"'pos.weight'.*do not match autograd"):
        check_ghost_coverage(ghost, xent, params, buffers, ids, y)


# --- 4. dict (keyword) inputs, HF models -----------------------------------------------------


def _hf_batch(vocab: int, t: int = 6) -> tuple[dict[str, Tensor], Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (B, t), generator=g)
    mask = torch.ones(B, t, dtype=torch.long)
    mask[1, -2:] = 0  # padding
    mask[3, -3:] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 2, (B,), generator=g)


def test_hf_bert_with_dict_inputs_and_padding_matches_loop() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=12,
                                  max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(8)
    net = transformers.BertForSequenceClassification(cfg).to(F64)
    inputs, y = _hf_batch(20)
    ghost, params, buffers, ref = assert_matches_loop(net, inputs, y)
    kinds = ghost.layer_kinds
    assert kinds["bert.embeddings.position_embeddings"] == "embedding"
    assert kinds["bert.encoder.layer.0.attention.self.query"] == "linear"
    assert "fallback" not in kinds.values()
    assert_dp_step_matches(ghost, params, buffers, inputs, y, ref, "flat")
    shared = {**inputs, "position_ids": torch.arange(6)[None]}  # (1, T): shared input
    torch.testing.assert_close(ghost_grad_norms(ghost, xent)(params, buffers, shared, y),
                               sum(g.reshape(B, -1).square().sum(1) for g in ref.values()).sqrt(),
                               **TOL)
    bad = {**inputs, "attention_mask": inputs["attention_mask"][:2]}
    with pytest.raises(ValueError, match=r"inputs\['attention_mask'\] has shape \(2, 6\)"):
        ghost.per_sample(params, buffers, bad, y, xent)


def test_hf_gpt2_untied_with_dict_inputs_matches_loop() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=20, n_embd=8, n_layer=1, n_head=2, n_positions=16,
                                  tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(9)
    net = transformers.GPT2LMHeadModel(cfg).to(F64)
    inputs, _ = _hf_batch(20)
    y = torch.randint(0, 20, (B, 6))
    ghost, params, buffers, _ = assert_matches_loop(net, inputs, y)
    assert ghost.layer_kinds["transformer.wpe"] == "embedding"
    with pytest.raises(ValueError, match="use_cache=False"):  # a DynamicCache in the outputs
        ghost.per_sample(params, buffers, {**inputs, "use_cache": True}, y, xent)


def test_dict_inputs_with_other_keys_are_not_a_cached_signature() -> None:
    class Optional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x: Tensor, extra: Tensor | None = None,
                    unused: Tensor | None = None) -> Tensor:
            h = self.a(x) if extra is None else self.a(x) + self.b(extra)
            return self.head(torch.tanh(h))

    torch.manual_seed(13)
    x, e, y = torch.randn(B, 3, dtype=F64), torch.randn(B, 3, dtype=F64), torch.randint(0, 2, (B,))
    net = Optional().to(F64)
    ghost, params, buffers = make_ghost_model(net)
    ghost.per_sample(params, buffers, {"x": x, "unused": e}, y, xent)  # b is not called
    ref = loop_grads(ghost, params, buffers, {"x": x, "extra": e}, y)  # same shapes, b called
    res = ghost.per_sample(params, buffers, {"x": x, "extra": e}, y, xent)
    mat = res.grads.materialize()
    for k in ref:
        torch.testing.assert_close(mat[k], ref[k], **TOL, msg=k)


# --- 5. coverage check under dropout ---------------------------------------------------------


def test_coverage_check_with_dropout_in_training_mode() -> None:
    net = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3))
    ghost, params, buffers = make_ghost_model(net.to(F64).train())
    x, y = torch.randn(B * 4, 5, dtype=F64), torch.randint(0, 3, (B * 4,))
    torch.manual_seed(10)
    state = torch.get_rng_state()
    check_ghost_coverage(ghost, xent, params, buffers, x, y, rtol=1e-9, atol=1e-11)
    assert torch.equal(torch.get_rng_state(), state)  # the global stream is left as it was


def test_batch_size_checks_name_the_input() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

        def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
            return self.a(xs[0]) + self.b(xs[1])

    ghost, params, buffers = make_ghost_model(Pair().to(F64))
    x1, x2, y = torch.randn(B, 3, dtype=F64), torch.randn(B - 1, 4, dtype=F64), torch.zeros(B)
    with pytest.raises(ValueError, match=r"inputs\[1\] has shape \(3, 4\), but inputs\[0\]"):
        ghost.per_sample(params, buffers, (x1, x2), y.long(), xent)
    lin, lp, lb = make_ghost_model(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="returned 2 per-sample losses, but the inputs have "
                                         "batch size 4"):
        lin.per_sample(lp, lb, torch.randn(B, 3), y, lambda o, t: o.sum(1)[:2])


def test_hf_vit_embeddings_direct_layer_matches_loop() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(image_size=4, patch_size=2, num_channels=2, hidden_size=8,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=12, num_labels=3)
    torch.manual_seed(11)
    net = transformers.ViTForImageClassification(cfg).to(F64)
    with torch.no_grad():  # HF initialises these to zeros: make their gradients non-trivial
        net.vit.embeddings.cls_token.normal_()
    x, y = torch.randn(B, 2, 4, 4, dtype=F64), torch.randint(0, 3, (B,))
    ghost, *_ = assert_matches_loop(net, {"pixel_values": x}, y)
    assert ghost.layer_kinds["vit.embeddings"] == "direct"
    assert ghost.layer_kinds["vit.embeddings.patch_embeddings.projection"] == "conv"
    assert ghost.layer_params["vit.embeddings"] == ("vit.embeddings.cls_token",
                                                    "vit.embeddings.position_embeddings")


def test_hf_clip_vision_direct_layer_and_shared_position_ids_match_loop() -> None:
    """CLIPVisionEmbeddings: class_embedding (direct), a conv, an Embedding of (1, N) ids."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPVisionConfig(image_size=4, patch_size=2, num_channels=2,
                                        hidden_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=12)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.clip, self.head = transformers.CLIPVisionModel(cfg), nn.Linear(8, 3)

        def forward(self, pixel_values: Tensor) -> Tensor:
            return self.head(self.clip(pixel_values=pixel_values).pooler_output)

    torch.manual_seed(12)
    x, y = torch.randn(B, 2, 4, 4, dtype=F64), torch.randint(0, 3, (B,))
    ghost, *_ = assert_matches_loop(Classifier().to(F64), {"pixel_values": x}, y)
    assert {k: v for k, v in ghost.layer_kinds.items() if k.startswith("clip.embeddings")} == {
        "clip.embeddings.patch_embedding": "conv",
        "clip.embeddings.position_embedding": "embedding", "clip.embeddings": "direct"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_dropout_coverage_direct_layer_and_shared_calls() -> None:
    """CUDA: the coverage check replays the CUDA stream; direct and shared layers match."""
    net = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3))
    ghost, params, buffers = make_ghost_model(net.to("cuda", F64).train())
    x = torch.randn(B * 4, 5, dtype=F64, device="cuda")
    y = torch.randint(0, 3, (B * 4,), device="cuda")
    state = torch.cuda.get_rng_state()
    check_ghost_coverage(ghost, xent, params, buffers, x, y, rtol=1e-9, atol=1e-11)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    torch.manual_seed(3)
    x, y = torch.randn(B, 2, 4, 4, dtype=F64), torch.randint(0, 3, (B,))
    assert_matches_loop(TinyViT().to("cuda", F64), x.cuda(), y.cuda())
    ids, y = _ids(5)
    assert_matches_loop(SharedPos().to("cuda", F64), ids.cuda(), y.cuda())
