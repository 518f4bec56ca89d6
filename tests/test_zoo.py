"""The conformance matrix: every torchfn path on every zoo model (tests/zoo.py).

Each cell either equals a plain autograd reference in float64 -- a loop of
``torch.autograd.grad`` over single samples, ``torch.optim.SGD`` on the module, separately
trained members, a per-task MAML loop with ``create_graph=True`` -- or asserts a clear refusal
(``REFUSED``: the error type and the gist of its text). docs/models.md is this table in prose.

Randomness (the dropout row) is compared exactly, not statistically:

- ``vmap(randomness="different")`` draws the masks of the whole batch in ONE call of the
  batched shape ``(B, 1, ...)``: the same numbers, in the same order, as a batched forward's
  ``(B, ...)`` mask from the same generator state (checked in
  ``test_vmap_randomness_assumptions``). So the reference is a batched forward under the same
  seed, differentiated sample by sample (dropout does not mix samples; sample ``i``'s gradient
  is that of ``losses[i]``). Ghost norms and DP-SGD run the batched forward themselves and use
  the same reference.
- ``randomness="same"`` draws one unbatched mask, i.e. the numbers a single-sample forward
  draws from the same generator state: the reference reseeds before every sample (per-sample
  loop) or every task (MAML loop).
- The train and ensemble steps seed their randomness with ``step_rng(state)``; the reference
  forward runs inside the same ``step_rng(state)``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torchopt
import zoo
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step
from torchfn.functional import (
    init_train_state,
    make_functional,
    make_train_step,
    per_sample_grads,
    single_sample_fn,
    step_rng,
)
from torchfn.meta import Task, maml
from torchfn.persample import (
    GhostLayerError,
    ghost_grad_norms,
    init_dp_state,
    make_dp_train_step,
    make_ghost_model,
)

# torch (2.13, CPU) warns once per process that vmap falls back to a loop for
# aten::_scaled_dot_product_flash_attention_for_cpu (no batching rule): a performance remark
# from inside torch, raised whenever attention runs under vmap (per-sample gradients, ensembles
# over members, the ghost fallback); the numbers are right, the matrix checks them.
pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching "
    "rule for aten.._scaled_dot_product:UserWarning")

B, SEED, LR = 4, 1234, 0.1
CPU64 = ("cpu", torch.float64)

# -- what is refused by design (anything not listed must equal its reference) ----------------

_BN_TRAIN = "BatchNorm(2d)? in training mode, which normalises with statistics of the whole batch"
_BN_TRAIN_PS = (ValueError, _BN_TRAIN)
_BN_TRAIN_GHOST = (GhostLayerError, _BN_TRAIN)
# torch.utils.checkpoint under torch.func: a clear error naming torchfn's checkpoint
_CKPT = ((RuntimeError, ValueError, TypeError), r"torchfn\.functional\.checkpoint")
PER_SAMPLE_PATHS = ("per_sample_grads", "ghost", "ghost_per_layer", "dp", "dp_per_layer")
REFUSED: dict[tuple[str, str], tuple[Any, str]] = {
    ("resnet", "per_sample_grads"): _BN_TRAIN_PS,
    **{("resnet", p): _BN_TRAIN_GHOST for p in PER_SAMPLE_PATHS[1:]},
    **{("ckpt_torch", p): _CKPT
       for p in (*PER_SAMPLE_PATHS, "train_step", "ensemble")},
}

MAML_MODELS = ("dropout_mlp", "lstm_cls", "tfm_encoder", "bert")
RANDOM = {"dropout_mlp"}  # rows whose forward draws random numbers in train mode


def _entry(name: str, device: str = "cpu", dtype: torch.dtype = torch.float64,
           seed: int = 0) -> zoo.ZooModel:
    for pkg in zoo.NEEDS.get(name, ()):
        pytest.importorskip(pkg)
    return zoo.build(name, dtype=dtype, device=device, seed=seed)


def _cell(name: str, path: str, fn: Callable[[], None]) -> None:
    refused = REFUSED.get((name, path))
    if refused is None:
        fn()
        return
    err, pattern = refused
    with pytest.raises(err, match=pattern):
        fn()


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    if expected.dtype == torch.float64:
        tol = {"rtol": 1e-7, "atol": 1e-9}
    else:  # float32 on the GPU: loose
        tol = {"rtol": 2e-3, "atol": 2e-4}
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


def _select(tree: Any, i: int) -> Any:
    return optree.tree_map(lambda t: t[i : i + 1], tree)


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {k: p for k, p in module.named_parameters() if p.requires_grad}


def _frozen(module: nn.Module) -> dict[str, nn.Parameter]:
    return {k: p for k, p in module.named_parameters() if not p.requires_grad}


# -- references -------------------------------------------------------------------------------------


def ref_per_sample(entry: zoo.ZooModel, x: Any, y: Tensor, *, seed: int | None = None,
                   randomness: str = "different") -> list[dict[str, Tensor]]:
    """Each sample's gradient over the trainable params: a loop of torch.autograd.grad.

    Deterministic models: one forward of a batch of 1 per sample. Random models (``seed``
    given): ``randomness="different"`` -- one batched forward under ``seed``, then the gradient
    of each ``losses[i]``; ``"same"`` -- reseed, then a batch of 1, per sample.
    """
    module = copy.deepcopy(entry.module)
    params = _trainable(module)
    out = []
    if seed is not None and randomness == "different":
        torch.manual_seed(seed)
        losses = entry.loss_fn(entry.forward(x, module), y)
        for i in range(losses.shape[0]):
            g = torch.autograd.grad(losses[i], list(params.values()), retain_graph=True)
            out.append(dict(zip(params, g, strict=True)))
        return out
    for i in range(y.shape[0]):
        if seed is not None:
            torch.manual_seed(seed)
        loss = entry.loss_fn(entry.forward(_select(x, i), module), _select(y, i))[0]
        g = torch.autograd.grad(loss, list(params.values()))
        out.append(dict(zip(params, g, strict=True)))
    return out


def _norm(g: dict[str, Tensor], names: Any = None) -> Tensor:
    keys = [k for k in g if names is None or k in names]
    zero = torch.zeros((), dtype=torch.float64, device=next(iter(g.values())).device)
    return torch.sqrt(sum(((g[k].double() ** 2).sum() for k in keys), zero))


# -- cells --------------------------------------------------------------------------------------------


def check_make_functional(name: str, device: str = "cpu", dtype: torch.dtype = torch.float64
                          ) -> None:
    entry = _entry(name, device, dtype)
    x, _ = entry.batch(B, 0)
    model_fn, params, buffers = make_functional(entry.module)
    torch.manual_seed(SEED)
    out, new_buffers = zoo.call(model_fn, x, params, buffers)
    torch.manual_seed(SEED)
    ref_module = copy.deepcopy(entry.module)
    ref = entry.forward(x, ref_module)
    _close(zoo.logits_of(out), zoo.logits_of(ref), f"{name}: outputs")
    for k, b in ref_module.named_buffers():
        _close(new_buffers[k].to(b.dtype), b, f"{name}: buffer {k}")


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """transformers' 4D additive form of a 2D 0/1 attention mask: the same attention."""
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def test_hf_2d_mask_under_per_sample_grads_is_refused_naming_the_4d_form() -> None:
    entry = _entry("bert", "cpu", torch.float64)
    x, y = entry.batch(B, 0)
    model_fn, params, buffers = make_functional(entry.module)

    def loss(p: dict[str, Tensor], xi: Any, yi: Tensor) -> Tensor:
        out, _ = zoo.call(model_fn, optree.tree_map(lambda t: t[None], xi), p, buffers)
        return entry.loss_fn(zoo.logits_of(out), yi[None])[0]

    with pytest.raises(RuntimeError, match=r"per_sample_grads: the Hugging Face model builds "
                       r"its attention mask.*4D additive form"):
        per_sample_grads(loss)(params, x, y)


def check_per_sample_grads(name: str, device: str = "cpu", dtype: torch.dtype = torch.float64,
                           randomness: str | None = "auto") -> None:
    """``randomness="auto"``: ``"different"`` for the random rows, not passed for the others."""
    if randomness == "auto":
        randomness = "different" if name in RANDOM else None
    entry = _entry(name, device, dtype)
    x, y = entry.batch(B, 0)
    model_fn, params, buffers = make_functional(entry.module)
    frozen = {k: v for k, v in params.items() if k in model_fn.frozen}
    if isinstance(x, dict):  # keyword inputs: add the batch dim of 1 ourselves
        def one(p: dict[str, Tensor], xi: Any) -> Any:
            xb = optree.tree_map(lambda t: t[None], xi)
            if "attention_mask" in xb:  # the documented 4D form (the 2D one is refused)
                xb["attention_mask"] = additive_mask(xb["attention_mask"], dtype)
            out, _ = zoo.call(model_fn, xb, p, buffers)
            return optree.tree_map(lambda t: t[0], zoo.logits_of(out))
    else:
        one = single_sample_fn(model_fn, buffers)

    def loss(p: dict[str, Tensor], xi: Any, yi: Tensor) -> Tensor:
        out = one({**frozen, **p}, xi)
        return entry.loss_fn(zoo.logits_of(out)[None], yi[None])[0]

    trainable = {k: v for k, v in params.items() if k not in model_fn.frozen}
    kwargs = {} if randomness is None else {"randomness": randomness}
    torch.manual_seed(SEED)
    grads = per_sample_grads(loss, **kwargs)(trainable, x, y)
    seed = SEED if name in RANDOM else None
    ref = ref_per_sample(entry, x, y, seed=seed, randomness=randomness or "different")
    assert set(grads) == set(ref[0]), f"{name}: per-sample gradient keys"
    for i, r in enumerate(ref):
        for k, v in r.items():
            _close(grads[k][i], v, f"{name}: sample {i}, {k}")


def _clip_groups(ghost: Any) -> dict[str, tuple[str, ...]]:
    """``{first layer: parameter names}`` of each per-layer clipping group (tied layers: one)."""
    return {head: tuple(dict.fromkeys(k for m in members for k in ghost.layer_params[m]))
            for head, members in ghost.clip_groups.items()}


def check_ghost(name: str, device: str = "cpu", dtype: torch.dtype = torch.float64,
                per_layer: bool = False) -> None:
    entry = _entry(name, device, dtype)
    x, y = entry.batch(B, 0)
    ghost, params, buffers = make_ghost_model(entry.module)
    if name == "timm_vit":  # root-level pos_embed/cls_token must not swallow the whole model
        kinds = ghost.layer_kinds
        assert kinds[""] == "direct", f"timm_vit: root layer {kinds}"
        assert kinds["blocks.0.attn.qkv"] == "linear", f"timm_vit: blocks not ghost {kinds}"
    if name == "lora_param":  # trainable A/B owned beside a frozen base Linear
        assert ghost.layer_kinds == {"0": "direct", "2": "direct"}, ghost.layer_kinds
    torch.manual_seed(SEED)
    norms = ghost_grad_norms(ghost, entry.loss_fn, per_layer=per_layer)(params, buffers, x, y)
    ref = ref_per_sample(entry, x, y, seed=SEED if name in RANDOM else None)
    if per_layer:
        assert set(norms) == set(ghost.layer_names)
        groups = _clip_groups(ghost)
        for layer in ghost.layer_names:  # a tied group reports at its first layer, else zeros
            names = groups.get(layer, ())
            expected = torch.stack([_norm(r, names) for r in ref]).to(norms[layer].dtype)
            _close(norms[layer], expected, f"{name}: layer {layer!r} norms")
    else:
        expected = torch.stack([_norm(r) for r in ref]).to(norms.dtype)
        _close(norms, expected, f"{name}: per-sample norms")


def check_dp(name: str, device: str = "cpu", dtype: torch.dtype = torch.float64,
             per_layer: bool = False) -> None:
    entry = _entry(name, device, dtype)
    x, y = entry.batch(B, 0)
    valid = torch.tensor([True, True, False, True], device=device)
    ghost, params, buffers = make_ghost_model(entry.module)
    ref = ref_per_sample(entry, x, y, seed=SEED if name in RANDOM else None)
    # a threshold between the smallest and largest norm: some samples are clipped, some not
    norms = sorted(float(_norm(r)) for r in ref)
    c = 0.5 * (norms[1] + norms[2])
    q, n = 0.25, 20  # expected batch size q * N = 5, not the B = 4 of the batch
    opt = torchopt.sgd(LR)
    step = make_dp_train_step(ghost, entry.loss_fn, opt, noise_multiplier=0.0, max_grad_norm=c,
                              sample_rate=q, dataset_size=n,
                              clipping="per_layer" if per_layer else "flat")
    state = init_dp_state(params, buffers, opt, seed=0, trainable=ghost.trainable)
    torch.manual_seed(SEED)
    new_state, _ = step(state, (x, y), valid)

    # reference: clip each valid sample's gradient (per layer: C_l = C / sqrt(L)), sum, / (q N)
    layers = _clip_groups(ghost) if per_layer else {"": tuple(ref[0])}
    c_l = c / math.sqrt(len(layers)) if per_layer else c
    total = {k: torch.zeros_like(v) for k, v in ref[0].items()}
    for i, g in enumerate(ref):
        if not valid[i]:
            continue
        for names in layers.values():
            coef = min(1.0, c_l / (float(_norm(g, names)) + 1e-6))
            for k in names:
                if k in g:
                    total[k] = total[k] + coef * g[k]
    module = entry.module
    for k, p in _trainable(module).items():
        expected = p.detach() - LR * total[k] / (q * n)
        _close(new_state.params[k], expected, f"{name}: DP-SGD param {k}")
    for k, p in _frozen(module).items():
        assert torch.equal(new_state.params[k], p.detach()), f"{name}: frozen {k} changed"


def check_train_step(name: str, device: str = "cpu", dtype: torch.dtype = torch.float64) -> None:
    entry = _entry(name, device, dtype)
    x, y = entry.batch(B, 0)
    model_fn, params, buffers = make_functional(entry.module)
    opt = torchopt.sgd(LR)
    state = init_train_state(params, buffers, opt, seed=3, trainable=model_fn.trainable)

    def loss_fn(out: Any, t: Tensor) -> Tensor:
        return entry.loss_fn(out, t).mean()

    new_state, _ = make_train_step(model_fn, loss_fn, opt)(state, (x, y))

    module = copy.deepcopy(entry.module)
    sgd = torch.optim.SGD(list(_trainable(module).values()), lr=LR)
    with step_rng(state):
        loss_fn(entry.forward(x, module), y).backward()
    sgd.step()
    for k, p in module.named_parameters():
        if p.requires_grad:
            _close(new_state.params[k], p.detach(), f"{name}: param {k}")
        else:
            assert torch.equal(new_state.params[k], p.detach()), f"{name}: frozen {k} changed"
    for k, b in module.named_buffers():
        _close(new_state.buffers[k].to(b.dtype), b, f"{name}: buffer {k}")


def check_ensemble(name: str, device: str = "cpu", dtype: torch.dtype = torch.float64) -> None:
    members = [_entry(name, device, dtype, seed=s) for s in (0, 1)]
    entry = members[0]
    batches = [entry.batch(B, s) for s in (0, 1)]
    # members' masks differ: under vmap HF needs the documented 4D form (the reference: 2D)
    x = optree.tree_map(lambda *t: torch.stack(t), *[_vmappable(b[0], dtype) for b in batches])
    y = torch.stack([b[1] for b in batches])
    ens = Ensemble.from_modules([m.module for m in members])
    opt = torchopt.sgd(LR)
    state = init_ensemble_state(ens, opt, seed=5)

    def loss_fn(out: Any, t: Tensor) -> Tensor:
        return entry.loss_fn(out, t).mean()

    randomness = "same" if name in RANDOM else "error"
    step = make_ensemble_train_step(ens.model_fn, loss_fn, opt, randomness=randomness)
    new_state, _ = step(state, (x, y))
    for n, (member, (xn, yn)) in enumerate(zip(members, batches, strict=True)):
        module = copy.deepcopy(member.module)
        sgd = torch.optim.SGD(list(_trainable(module).values()), lr=LR)
        with step_rng(state):  # randomness="same": every member draws these numbers
            loss_fn(entry.forward(xn, module), yn).backward()
        sgd.step()
        for k, p in module.named_parameters():
            if p.requires_grad:
                _close(new_state.params[k][n], p.detach(), f"{name}: member {n} param {k}")
            else:
                assert torch.equal(new_state.params[k][n], p.detach()), f"{name}: frozen {k}"
        for k, b in module.named_buffers():
            _close(new_state.buffers[k][n].to(b.dtype), b, f"{name}: member {n} buffer {k}")


def _vmappable(inputs: Any, dtype: torch.dtype) -> Any:
    """HF dict inputs with the 2D mask in the 4D additive form that vmap can run (same
    attention); anything else unchanged."""
    if isinstance(inputs, dict) and "attention_mask" in inputs:
        return {**inputs, "attention_mask": additive_mask(inputs["attention_mask"], dtype)}
    return inputs


def _tasks(entry: zoo.ZooModel, dtype: torch.dtype, n_tasks: int = 2,
           k: int = 3) -> tuple[Task, list[tuple]]:
    raw = []
    for t in range(n_tasks):
        sx, sy = entry.batch(k, 10 + t)
        qx, qy = entry.batch(k, 20 + t)
        raw.append((sx, sy, qx, qy))
    fields = [optree.tree_map(lambda *v: torch.stack(v),
                              *[_vmappable(r[i], dtype) for r in raw]) for i in range(4)]
    return Task(*fields), raw


def check_maml(name: str, device: str = "cpu", dtype: torch.dtype = torch.float64) -> None:
    entry = _entry(name, device, dtype)
    model_fn, params, buffers = make_functional(entry.module)
    tasks, raw = _tasks(entry, dtype)
    inner_lr = 0.1

    def loss_fn(out: Any, t: Tensor) -> Tensor:
        return entry.loss_fn(out, t).mean()

    kwargs = {"randomness": "same"} if name in RANDOM else {}
    learner = maml(model_fn, loss_fn, inner_lr=inner_lr, inner_steps=1, **kwargs)
    torch.manual_seed(SEED)
    grads, _, _ = learner.meta_grad(params, buffers, tasks)

    # reference: per task, one SGD step on the support loss with create_graph=True
    module = copy.deepcopy(entry.module)
    names = list(_trainable(module))
    meta = {k: params[k].detach().clone().requires_grad_() for k in names}

    def run(p: dict[str, Tensor], x: Any) -> Any:
        return zoo.call(lambda *a, **kw: torch.func.functional_call(module, p, a, kw), x)

    total = 0.0
    # torch's fused attention kernels and cuDNN's RNN have no double backward: the reference
    # uses the math attention kernel and torch's non-cuDNN RNN
    with sdpa_kernel(SDPBackend.MATH), torch.backends.cudnn.flags(enabled=False):
        for sx, sy, qx, qy in raw:
            if name in RANDOM:
                torch.manual_seed(SEED)  # randomness="same": every task draws these numbers
            support = loss_fn(run(meta, sx), sy)
            g = torch.autograd.grad(support, list(meta.values()), create_graph=True)
            fast = {k: meta[k] - inner_lr * gk for k, gk in zip(names, g, strict=True)}
            total = total + loss_fn(run(fast, qx), qy)
        expected = torch.autograd.grad(total / len(raw), list(meta.values()))
    for k, e in zip(names, expected, strict=True):
        _close(grads[k], e, f"{name}: meta-gradient {k}")


PATHS: dict[str, Callable[..., None]] = {
    "make_functional": check_make_functional,
    "per_sample_grads": check_per_sample_grads,
    "ghost": check_ghost,
    "ghost_per_layer": lambda n, *a: check_ghost(n, *a, per_layer=True),
    "dp": check_dp,
    "dp_per_layer": lambda n, *a: check_dp(n, *a, per_layer=True),
    "train_step": check_train_step,
    "ensemble": check_ensemble,
}


# -- the matrix ---------------------------------------------------------------------------------------


# resnet_eval is the per-sample twin of resnet (BatchNorm on running statistics); the train and
# ensemble steps train BatchNorm in train mode, which is the resnet row.
CELLS = [(n, p) for n in zoo.NAMES for p in PATHS
         if not (n == "resnet_eval" and p in ("train_step", "ensemble"))]


@pytest.mark.parametrize(("name", "path"), CELLS)
def test_zoo_matrix(name: str, path: str) -> None:
    _cell(name, path, lambda: PATHS[path](name, *CPU64))


@pytest.mark.parametrize("name", MAML_MODELS)
def test_zoo_maml(name: str) -> None:
    _cell(name, "maml", lambda: check_maml(name, *CPU64))


def test_dropout_per_sample_grads_same_randomness() -> None:
    """randomness="same": one mask for every sample, as a reseeded single-sample loop draws."""
    check_per_sample_grads("dropout_mlp", randomness="same")


def test_dropout_refused_without_randomness() -> None:
    """Dropout under vmap without randomness= stays refused (torch.func's safe default)."""
    with pytest.raises(RuntimeError, match="randomness"):
        check_per_sample_grads("dropout_mlp", randomness=None)


def test_dropout_maml_refused_without_randomness() -> None:
    entry = _entry("dropout_mlp")
    model_fn, params, buffers = make_functional(entry.module)
    tasks, _ = _tasks(entry, torch.float64)
    learner = maml(model_fn, lambda o, t: entry.loss_fn(o, t).mean(), inner_lr=0.1)
    with pytest.raises(RuntimeError, match="randomness"):
        learner.meta_grad(params, buffers, tasks)


def test_vmap_randomness_assumptions() -> None:
    """The facts the dropout references rest on (see the module docstring)."""
    x = torch.randn(B, 16, dtype=torch.float64)

    def one(xi: Tensor) -> Tensor:
        return torch.nn.functional.dropout(xi[None], 0.5, True)[0]

    torch.manual_seed(SEED)
    different = torch.func.vmap(one, randomness="different")(x)
    torch.manual_seed(SEED)
    assert torch.equal(different, torch.nn.functional.dropout(x, 0.5, True))
    torch.manual_seed(SEED)
    same = torch.func.vmap(one, randomness="same")(x)
    torch.manual_seed(SEED)
    mask = torch.nn.functional.dropout(torch.ones(1, 16, dtype=torch.float64), 0.5, True) != 0
    assert torch.equal(same != 0, mask.expand(B, 16))


def test_zoo_rows_are_what_they_say() -> None:
    """The zoo's structural promises, which the matrix rows rely on."""
    vit = zoo.build("timm_vit").module
    assert {"pos_embed", "cls_token"} <= set(vit._parameters)
    lora = zoo.build("lora_mlp").module
    assert _frozen(lora) and _trainable(lora)
    tied = zoo.build("tied_lm").module
    assert tied.head.weight is tied.embed.weight
    assert zoo.build("resnet").module.training and not zoo.build("resnet_eval").module.training
    assert zoo.build("dropout_mlp").module.training


def test_zoo_hf_rows_are_what_they_say() -> None:
    gpt2 = _entry("gpt2")
    assert gpt2.module.lm_head.weight is gpt2.module.transformer.wte.weight
    x, y = gpt2.batch(B, 0)
    assert isinstance(x, dict) and y.shape == x["input_ids"].shape
    x, _ = _entry("bert").batch(B, 0)
    assert (x["attention_mask"] == 0).any(), "some BERT samples are padded"
    peft = _entry("peft_bert").module
    assert _frozen(peft) and all("lora_" in k for k in _trainable(peft))


# -- the same matrix on CUDA in float32, a few representative rows ------------------------------

GPU_MODELS = ("tfm_encoder", "lstm_cls", "resnet_eval", "timm_vit", "bert", "lora_mlp")
GPU_PATHS = ("make_functional", "per_sample_grads", "ghost", "dp", "train_step", "ensemble")


# torch's cuDNN LSTM (the references run torch's own module) warns that a copied module's
# weights are not one contiguous chunk: a memory remark about the reference, not torchfn
_RNN_CHUNK = "ignore:RNN module weights are not part of single contiguous chunk:UserWarning"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings(_RNN_CHUNK)
@pytest.mark.parametrize("path", GPU_PATHS)
@pytest.mark.parametrize("name", GPU_MODELS)
def test_zoo_matrix_cuda(name: str, path: str) -> None:
    _cell(name, path, lambda: PATHS[path](name, "cuda", torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings(_RNN_CHUNK)
@pytest.mark.parametrize("name", ("lstm_cls", "tfm_encoder"))
def test_zoo_maml_cuda(name: str) -> None:
    _cell(name, "maml", lambda: check_maml(name, "cuda", torch.float32))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "peft_bert", "lstm_cls", "tied_lm"])
def test_zoo_dp_step_compiled_equals_eager_with_noise(name: str) -> None:
    """The compiled DP step (noise on: the multi-tensor noisy sum and update) equals the eager
    step in float64 on zoo models with tied weights, frozen LoRA bases and recurrent layers."""
    entry = _entry(name)
    x, y = entry.batch(B, 0)
    valid = torch.tensor([True, True, False, True])
    ghost, params, buffers = make_ghost_model(entry.module)
    opt = torchopt.sgd(LR, momentum=0.9)
    step = make_dp_train_step(ghost, entry.loss_fn, opt, noise_multiplier=1.0, max_grad_norm=0.5,
                              sample_rate=0.25, dataset_size=20)
    eager = compiled = init_dp_state(params, buffers, opt, seed=3, trainable=ghost.trainable)
    fn = torch.compile(step, fullgraph=True)
    # torch 2.11's Inductor fails the CPU flash-attention backward in float64 (the forward's
    # log-sum-exp kept as float32; docs/models.md): the math kernel there, both sides, with
    # the compile caches off (their keys miss the attention backend: a graph cached by a run
    # with flash attention would come back)
    old_torch = torch.torch_version.TorchVersion(torch.__version__) < "2.13"
    with contextlib.ExitStack() as stack:
        if old_torch:
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        for _ in range(2):
            eager, m_e = step(eager, (x, y), valid)
            compiled, m_c = fn(compiled, (x, y), valid)
    for k in params:
        _close(compiled.params[k], eager.params[k], f"{name}: compiled DP param {k}")
    for k in m_e:
        _close(m_c[k].double(), m_e[k].double(), f"{name}: compiled DP metric {k}")
    for k in _frozen(entry.module):  # a frozen base (LoRA) gets no noise and no update
        assert torch.equal(compiled.params[k], params[k]), f"{name}: frozen {k} changed"
    assert all(not torch.equal(compiled.params[k], params[k]) for k in _trainable(entry.module))
