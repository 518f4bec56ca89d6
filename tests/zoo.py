"""The model zoo: tiny, random-weight versions of the models researchers bring to torchfn.

Nothing is downloaded; every model builds on the CPU in a fraction of a second and runs in
float64 (``build(name)``) or float32 on any device (``build(name, dtype=..., device=...)``).
Each entry is a :class:`ZooModel` record:

- ``module``: the ``nn.Module`` in the mode the zoo row is about (train mode unless said);
- ``batch(b, seed)`` -> ``(inputs, targets)``: a random batch of ``b`` samples, batch dim 0 of
  every tensor; ``inputs`` is a tensor or, for Hugging Face text models (and other
  keyword-argument models), a ``dict`` of keyword arguments (``module(**inputs)``);
- ``loss_fn(outputs, targets)`` -> ``(B,)`` per-sample losses (Hugging Face models return a
  ``ModelOutput``: the loss reads its ``.logits``); sequence models' per-sample loss is the
  mean token cross-entropy.

Hugging Face ``transformers`` and ``peft`` are imported lazily by their builders; a test
asks for them with ``pytest.importorskip`` (``NEEDS`` lists the packages of each row).
torchvision/timm are not used (they pin torch versions of their own): the ResNet, ConvNeXt
and timm-style ViT rows are written from ``torch.nn`` with the same structure (BasicBlocks
with BatchNorm2d; depthwise 7x7 conv, channels-last LayerNorm and a layer-scale ``gamma``;
root-level ``pos_embed``/``cls_token`` parameters).

The HF configs set every dropout probability to 0 so that the train-mode rows are
deterministic (dropout itself is covered by the ``dropout_mlp`` row). They keep the attention
implementation users get by default (``sdpa`` in transformers 5); nothing here asks for
``attn_implementation="eager"``.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

VOCAB, SEQ, N_CLASSES, IMG = 50, 6, 3, 8

Batch = tuple[Any, Any]


@dataclass(frozen=True)
class ZooModel:
    """One zoo row: a module, a random-batch maker and a per-sample loss."""

    name: str
    module: nn.Module
    batch: Callable[[int, int], Batch]  # (b, seed) -> (inputs, targets)
    loss_fn: Callable[[Any, Any], Tensor]  # (outputs, targets) -> (B,)

    def forward(self, inputs: Any, module: nn.Module | None = None) -> Any:
        """Return ``module(**inputs)`` for dict inputs, else ``module(inputs)``."""
        return call(self.module if module is None else module, inputs)


def call(fn: Callable[..., Any], inputs: Any, *lead: Any) -> Any:
    """Call ``fn(*lead, **inputs)`` for dict inputs, else ``fn(*lead, inputs)``."""
    if isinstance(inputs, dict):
        return fn(*lead, **inputs)
    return fn(*lead, inputs)


def logits_of(outputs: Any) -> Tensor:
    """Return ``outputs.logits`` for a Hugging Face ``ModelOutput``, else ``outputs``."""
    return outputs.logits if hasattr(outputs, "logits") else outputs


def class_loss(outputs: Any, y: Tensor) -> Tensor:
    """Per-sample cross-entropy of ``(B, C)`` logits: ``(B,)``."""
    return F.cross_entropy(logits_of(outputs), y, reduction="none")


def token_loss(outputs: Any, y: Tensor) -> Tensor:
    """Per-sample mean token cross-entropy of ``(B, T, V)`` logits and ``(B, T)`` targets."""
    logits = logits_of(outputs)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


# -- batches ------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _tokens_cls(module: nn.Module) -> Callable[[int, int], Batch]:
    def batch(b: int, seed: int) -> Batch:
        g, dev = _gen(seed), _device(module)
        x = torch.randint(0, VOCAB, (b, SEQ), generator=g)
        y = torch.randint(0, N_CLASSES, (b,), generator=g)
        return x.to(dev), y.to(dev)
    return batch


def _tokens_lm(module: nn.Module, length: int = SEQ) -> Callable[[int, int], Batch]:
    def batch(b: int, seed: int) -> Batch:
        g, dev = _gen(seed), _device(module)
        x = torch.randint(0, VOCAB, (b, length), generator=g)
        y = torch.randint(0, VOCAB, (b, length), generator=g)
        return x.to(dev), y.to(dev)
    return batch


def _features(module: nn.Module, *shape: int) -> Callable[[int, int], Batch]:
    def batch(b: int, seed: int) -> Batch:
        g = _gen(seed)
        x = torch.randn(b, *shape, generator=g, dtype=torch.float64)
        y = torch.randint(0, N_CLASSES, (b,), generator=g)
        return x.to(_device(module), _dtype(module)), y.to(_device(module))
    return batch


def _bert_batch(module: nn.Module) -> Callable[[int, int], Batch]:
    def batch(b: int, seed: int) -> Batch:
        g, dev = _gen(seed), _device(module)
        ids = torch.randint(1, VOCAB, (b, SEQ), generator=g)
        mask = torch.ones(b, SEQ, dtype=torch.long)
        for i in range(1, b, 2):  # every other sample padded at the end (2 tokens)
            mask[i, -2:] = 0
            ids[i, -2:] = 0
        y = torch.randint(0, N_CLASSES, (b,), generator=g)
        return {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}, y.to(dev)
    return batch


def _gpt2_batch(module: nn.Module) -> Callable[[int, int], Batch]:
    def batch(b: int, seed: int) -> Batch:
        x, y = _tokens_lm(module)(b, seed)
        return {"input_ids": x}, y
    return batch


# -- Hugging Face -------------------------------------------------------------------------------

_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _bert_module() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                        num_labels=N_CLASSES, **_NO_DROPOUT)
    return BertForSequenceClassification(config)


def bert() -> ZooModel:
    m = _bert_module()
    return ZooModel("bert", m, _bert_batch(m), class_loss)


def gpt2() -> ZooModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                        use_cache=False)  # no KV-cache object in the outputs (ghost refuses one)
    m = GPT2LMHeadModel(config)  # tie_word_embeddings=True: lm_head.weight is wte.weight
    assert m.lm_head.weight is m.transformer.wte.weight
    return ZooModel("gpt2", m, _gpt2_batch(m), token_loss)


def vit_hf() -> ZooModel:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=IMG, patch_size=4, num_channels=3, hidden_size=16,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       num_labels=N_CLASSES, **_NO_DROPOUT)
    m = ViTForImageClassification(config)
    return ZooModel("vit_hf", m, _features(m, 3, IMG, IMG), class_loss)


def peft_bert() -> ZooModel:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["query", "value"],
                        init_lora_weights=False)  # random B too: A's gradient is not zero
    with warnings.catch_warnings():
        # peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` (inside peft)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                FutureWarning)
        m = get_peft_model(_bert_module(), config)
    return ZooModel("peft_bert", m, _bert_batch(m), class_loss)


# -- torch's Transformer ------------------------------------------------------------------------


class EncoderClassifier(nn.Module):
    """Embedding -> nn.TransformerEncoder (batch_first) -> mean over tokens -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


class DecoderLM(nn.Module):
    """nn.TransformerDecoder (batch_first, causal) over target tokens, memory = embedded source.

    ``x`` is ``(B, S + T)``: the first ``S`` tokens are the encoder input (the memory), the last
    ``T`` the decoder's; the output is ``(B, T, V)`` next-token logits.
    """

    def __init__(self, src_len: int = 4) -> None:
        super().__init__()
        self.src_len = src_len
        self.src_embed = nn.Embedding(VOCAB, 16)
        self.tgt_embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        src, tgt = x[:, : self.src_len], x[:, self.src_len :]
        mask = nn.Transformer.generate_square_subsequent_mask(
            tgt.shape[1], device=x.device, dtype=self.head.weight.dtype)
        h = self.decoder(self.tgt_embed(tgt), self.src_embed(src), tgt_mask=mask)
        return self.head(h)


def tfm_encoder() -> ZooModel:
    m = EncoderClassifier()
    return ZooModel("tfm_encoder", m, _tokens_cls(m), class_loss)


def tfm_decoder() -> ZooModel:
    m = DecoderLM()
    tokens = _tokens_lm(m, m.src_len + SEQ)

    def batch(b: int, seed: int) -> Batch:
        x, y = tokens(b, seed)
        return x, y[:, m.src_len :]

    return ZooModel("tfm_decoder", m, batch, token_loss)


# -- recurrent ----------------------------------------------------------------------------------


class RNNClassifier(nn.Module):
    """Embedding -> LSTM/GRU (batch_first) -> last hidden state -> Linear."""

    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.rnn = cell(8, 12, batch_first=True)
        self.head = nn.Linear(12, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out[:, -1])


class LSTMLM(nn.Module):
    """Embedding -> LSTM (batch_first) -> Linear over the vocabulary, every position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.lstm = nn.LSTM(8, 12, batch_first=True)
        self.head = nn.Linear(12, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(self.embed(x))[0])


def lstm_cls() -> ZooModel:
    m = RNNClassifier(nn.LSTM)
    return ZooModel("lstm_cls", m, _tokens_cls(m), class_loss)


def gru_cls() -> ZooModel:
    m = RNNClassifier(nn.GRU)
    return ZooModel("gru_cls", m, _tokens_cls(m), class_loss)


def lstm_lm() -> ZooModel:
    m = LSTMLM()
    return ZooModel("lstm_lm", m, _tokens_lm(m), token_loss)


# -- dropout, checkpointing, tied weights, LoRA ----------------------------------------------------


def dropout_mlp() -> ZooModel:
    """An MLP with ``nn.Dropout(0.5)``, left in train mode (dropout active)."""
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, N_CLASSES))
    return ZooModel("dropout_mlp", m, _features(m, 6), class_loss)


class CheckpointedMLP(nn.Module):
    """An MLP whose hidden block runs under activation checkpointing in ``forward``.

    ``use_torchfn=False``: ``torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)``
    (what users write); ``True``: ``torchfn.functional.checkpoint(block, h)``.
    """

    def __init__(self, use_torchfn: bool) -> None:
        super().__init__()
        self.use_torchfn = use_torchfn
        self.inp = nn.Linear(6, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        if self.use_torchfn:
            from torchfn.functional import checkpoint

            h = checkpoint(self.block, h)
        else:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        return self.head(h)


def ckpt_torch() -> ZooModel:
    m = CheckpointedMLP(use_torchfn=False)
    return ZooModel("ckpt_torch", m, _features(m, 6), class_loss)


def ckpt_torchfn() -> ZooModel:
    m = CheckpointedMLP(use_torchfn=True)
    return ZooModel("ckpt_torchfn", m, _features(m, 6), class_loss)


class TiedLM(nn.Module):
    """Embedding -> Linear + tanh -> output head sharing the embedding's weight (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.embed(x))))


def tied_lm() -> ZooModel:
    m = TiedLM()
    return ZooModel("tied_lm", m, _tokens_lm(m), token_loss)


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))``: a frozen ``nn.Linear`` plus a trainable rank-``r`` update."""

    def __init__(self, d_in: int, d_out: int, r: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(d_in, r, bias=False)
        self.lora_B = nn.Linear(r, d_out, bias=False)  # random, not zero: A gets a gradient
        self.scale = alpha / r

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.scale * self.lora_B(self.lora_A(x))


class LoRAParamLinear(nn.Module):
    """LoRA written with raw ``nn.Parameter`` A/B next to the frozen ``base`` Linear."""

    def __init__(self, d_in: int, d_out: int, r: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(r, d_in) / d_in**0.5)
        self.lora_B = nn.Parameter(torch.randn(d_out, r) / r**0.5)
        self.scale = alpha / r

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.scale * (x @ self.lora_A.T) @ self.lora_B.T


def lora_param() -> ZooModel:
    m = nn.Sequential(LoRAParamLinear(6, 16), nn.ReLU(), LoRAParamLinear(16, N_CLASSES))
    return ZooModel("lora_param", m, _features(m, 6), class_loss)


def lora_mlp() -> ZooModel:
    m = nn.Sequential(LoRALinear(6, 16), nn.ReLU(), LoRALinear(16, N_CLASSES))
    return ZooModel("lora_mlp", m, _features(m, 6), class_loss)


# -- vision from torch.nn --------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet's BasicBlock: conv3x3-BN-ReLU-conv3x3-BN + shortcut (1x1 conv + BN when reshaped)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet18ish(nn.Module):
    """ResNet-18's shape (stem, 4 stages of 2 BasicBlocks, avg-pool, fc) at tiny widths."""

    def __init__(self, widths: tuple[int, ...] = (4, 4, 8, 8)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        stages, c = [], widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i in (0, 1) else 2
            stages.append(nn.Sequential(BasicBlock(c, w, stride), BasicBlock(w, w, 1)))
            c = w
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(c, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean((2, 3)))


def _randomize_bn_(m: nn.Module) -> nn.Module:
    """Give every BatchNorm non-trivial affine params and running stats (eval rows use them)."""
    g = _gen(7)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            n = mod.num_features
            mod.weight.data = 1 + 0.1 * torch.randn(n, generator=g)
            mod.bias.data = 0.1 * torch.randn(n, generator=g)
            mod.running_mean = 0.1 * torch.randn(n, generator=g)
            mod.running_var = 1 + 0.1 * torch.rand(n, generator=g)
    return m


def resnet() -> ZooModel:
    """The ResNet in train mode (BatchNorm on batch statistics)."""
    m = _randomize_bn_(ResNet18ish())
    return ZooModel("resnet", m, _features(m, 3, IMG, IMG), class_loss)


def resnet_eval() -> ZooModel:
    """The ResNet in eval mode (BatchNorm on running statistics): the per-sample rows."""
    m = _randomize_bn_(ResNet18ish()).eval()
    return ZooModel("resnet_eval", m, _features(m, 3, IMG, IMG), class_loss)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (channels-last inside), ConvNeXt's."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv -> LayerNorm (channels last) -> Linear 4x -> GELU -> Linear -> gamma."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pwconv1 = nn.Linear(c, 4 * c)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(0.5 * torch.ones(c))  # layer scale

    def forward(self, x: Tensor) -> Tensor:
        h = self.dwconv(x).permute(0, 2, 3, 1)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 3, 1, 2)


class ConvNeXtish(nn.Module):
    """ConvNeXt's structure at tiny widths: patchify stem + LayerNorm2d, blocks, downsample."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 2, 2), LayerNorm2d(8))
        self.stage1 = ConvNeXtBlock(8)
        self.down = nn.Sequential(LayerNorm2d(8), nn.Conv2d(8, 16, 2, 2))
        self.stage2 = ConvNeXtBlock(16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean((2, 3))))


def convnext() -> ZooModel:
    m = ConvNeXtish()
    return ZooModel("convnext", m, _features(m, 3, IMG, IMG), class_loss)


class Attention(nn.Module):
    """timm's Attention: one nn.Linear qkv, scaled dot-product attention, nn.Linear proj."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(h.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """timm's pre-norm ViT block: x + attn(norm1(x)); x + mlp(norm2(x))."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmViT(nn.Module):
    """timm's VisionTransformer layout: ``cls_token`` and ``pos_embed`` live on the ROOT module."""

    def __init__(self, d: int = 16, depth: int = 2, heads: int = 2, patch: int = 4) -> None:
        super().__init__()
        n = (IMG // patch) ** 2
        self.patch_embed = nn.Conv2d(3, d, patch, patch)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, n + 1, d))
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def timm_vit() -> ZooModel:
    m = TimmViT()
    return ZooModel("timm_vit", m, _features(m, 3, IMG, IMG), class_loss)


# -- registry ---------------------------------------------------------------------------------------

BUILDERS: dict[str, Callable[[], ZooModel]] = {
    "bert": bert,
    "gpt2": gpt2,
    "vit_hf": vit_hf,
    "peft_bert": peft_bert,
    "tfm_encoder": tfm_encoder,
    "tfm_decoder": tfm_decoder,
    "lstm_cls": lstm_cls,
    "gru_cls": gru_cls,
    "lstm_lm": lstm_lm,
    "dropout_mlp": dropout_mlp,
    "ckpt_torch": ckpt_torch,
    "ckpt_torchfn": ckpt_torchfn,
    "tied_lm": tied_lm,
    "lora_mlp": lora_mlp,
    "lora_param": lora_param,
    "resnet": resnet,
    "resnet_eval": resnet_eval,
    "convnext": convnext,
    "timm_vit": timm_vit,
}
# the optional packages a row imports (a test asks pytest.importorskip for them before building)
NEEDS = {"bert": ("transformers",), "gpt2": ("transformers",), "vit_hf": ("transformers",),
         "peft_bert": ("transformers", "peft")}
NAMES = tuple(BUILDERS)


@functools.cache
def _built(name: str, dtype: torch.dtype, device: str, seed: int) -> ZooModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        entry = BUILDERS[name]()
    entry.module.to(device=device, dtype=dtype)  # in place: the batch makers see it
    return entry


def build(name: str, *, dtype: torch.dtype = torch.float64, device: str = "cpu",
          seed: int = 0) -> ZooModel:
    """Return zoo row ``name`` with a PRIVATE copy of its module (safe to train or mutate).

    Builds are cached per ``(name, dtype, device, seed)``; the cached module is never handed
    out, so one test mutating its module cannot change another's.
    """
    entry = _built(name, dtype, device, seed)
    # the batch makers only read the module's dtype/device, which the copy shares
    return ZooModel(entry.name, copy.deepcopy(entry.module), entry.batch, entry.loss_fn)
