"""Functional transforms on the models researchers bring: dropout, activation checkpointing,
dict (Hugging Face) inputs, BERT attention masks. Every fast path against a plain float64 loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.func import grad
from torchopt import sgd

from torchfn.functional import (
    checkpoint,
    init_train_state,
    make_functional,
    make_train_step,
    per_sample_grad_norms,
    per_sample_grads,
    single_sample_fn,
)

D = torch.float64
_PERF = "ignore:There is a performance drop:UserWarning"  # fused SDPA has no vmap rule on CPU


def _close(a: dict, b: dict, tol: float = 1e-10) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


# ---------------------------------------------------------------------------------------------
# 1. dropout: randomness=
# ---------------------------------------------------------------------------------------------


def _dropout_net() -> tuple:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 3)).to(D)
    model_fn, params, buffers = make_functional(net)
    x, y = torch.randn(6, 4, dtype=D), torch.randint(0, 3, (6,))
    return model_fn, params, buffers, x, y


def _loss_of(model_fn, buffers):
    f = single_sample_fn(model_fn, buffers)
    return lambda p, x, y: F.cross_entropy(f(p, x), y)


def test_dropout_default_error_names_the_randomness_keyword():
    model_fn, params, buffers, x, y = _dropout_net()
    loss = _loss_of(model_fn, buffers)
    for transform in (per_sample_grads, per_sample_grad_norms):
        with pytest.raises(RuntimeError, match=rf"{transform.__name__}: the model draws random "
                           r"numbers .*randomness='different'.*randomness='same'"):
            transform(loss)(params, x, y)
        with pytest.raises(ValueError, match=r"randomness must be one of \('error', "
                           r"'different', 'same'\), got 'sometimes'"):
            transform(loss, randomness="sometimes")


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_dropout_same_equals_a_loop_that_reseeds_before_every_sample(chunk_size):
    """randomness='same' draws the mask once from the generator; a loop that reseeds before
    each single-sample call draws that same mask for every sample (CPU: chunks share it)."""
    model_fn, params, buffers, x, y = _dropout_net()
    loss = _loss_of(model_fn, buffers)
    torch.manual_seed(123)
    got = per_sample_grads(loss, randomness="same", chunk_size=chunk_size)(params, x, y)
    torch.manual_seed(123)
    norms = per_sample_grad_norms(loss, randomness="same", chunk_size=chunk_size)(params, x, y)
    for i in range(x.shape[0]):
        torch.manual_seed(123)
        ref = grad(loss)(params, x[i], y[i])
        _close({k: v[i] for k, v in got.items()}, ref)
        ref_norm = torch.sqrt(sum((v ** 2).sum() for v in ref.values()))
        torch.testing.assert_close(norms[i], ref_norm, rtol=1e-10, atol=1e-10)
    # and the mask really was random: another seed gives other gradients
    torch.manual_seed(7)
    other = per_sample_grads(loss, randomness="same", chunk_size=chunk_size)(params, x, y)
    assert not torch.allclose(other["3.weight"], got["3.weight"])


def test_dropout_different_draws_a_mask_per_sample_and_eval_equals_the_loop():
    torch.manual_seed(0)
    p_drop, n, width = 0.5, 64, 32
    drop = nn.Dropout(p_drop)

    def loss(w, x):  # d/dw = dropout mask * x / (1 - p): the mask is visible in the gradient
        return (w * drop(x)).sum()

    w, x = torch.randn(width, dtype=D), torch.ones(n, width, dtype=D)
    g = per_sample_grads(loss, randomness="different")(w, x)
    kept = g != 0
    assert set(g.unique().tolist()) <= {0.0, 1.0 / (1 - p_drop)}
    assert abs(kept.double().mean().item() - (1 - p_drop)) < 0.05   # 2048 Bernoulli draws
    distinct = {tuple(row.tolist()) for row in kept}
    assert len(distinct) > n - 2                                    # masks differ per sample
    same = per_sample_grads(loss, randomness="same")(w, x)
    assert len({tuple(row.tolist()) for row in same != 0}) == 1
    # eval(): no randomness, any mode equals the plain loop exactly
    model_fn, params, buffers, xb, yb = _dropout_net()
    loss_eval = _loss_of(model_fn.eval(), buffers)
    for mode in ("error", "different", "same"):
        got = per_sample_grads(loss_eval, randomness=mode)(params, xb, yb)
        for i in range(xb.shape[0]):
            _close({k: v[i] for k, v in got.items()}, grad(loss_eval)(params, xb[i], yb[i]))


# ---------------------------------------------------------------------------------------------
# 2. activation checkpointing
# ---------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, use: str) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
        self.head = nn.Linear(4, 2)
        self.use = use
        self.calls = 0

    def _body(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.inner(x)) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use == "torchfn":
            h = checkpoint(self._body, x, scale=1.5)
        elif self.use in ("torch", "torch_reentrant"):
            h = torch.utils.checkpoint.checkpoint(
                self._body, x, 1.5, use_reentrant=self.use == "torch_reentrant")
        else:
            h = self._body(x, scale=1.5)
        return self.head(h + x)


def _block_fns():
    torch.manual_seed(0)
    plain = _Block("none").to(D)
    ck = _Block("torchfn").to(D)
    ck.load_state_dict(plain.state_dict())
    fn_plain, params, buffers = make_functional(plain)
    fn_ck, _, _ = make_functional(ck)
    return fn_plain, fn_ck, params, buffers


def test_checkpoint_matches_no_checkpointing_under_grad_vmap_and_grad_of_grad():
    fn_plain, fn_ck, params, buffers = _block_fns()
    x, y = torch.randn(5, 4, dtype=D), torch.randint(0, 2, (5,))
    losses = [_loss_of(fn, buffers) for fn in (fn_plain, fn_ck)]
    ref, got = (per_sample_grads(lo)(params, x, y) for lo in losses)
    _close(got, ref)

    def hessian_trace_proxy(lo):  # grad of a function of the gradient: second order
        return grad(lambda p: sum((v ** 2).sum() for v in grad(lo)(p, x[0], y[0]).values()))

    _close(hessian_trace_proxy(losses[1])(params), hessian_trace_proxy(losses[0])(params))


def test_checkpoint_compiled_equals_eager():
    fn_plain, fn_ck, params, buffers = _block_fns()
    x, y = torch.randn(5, 4, dtype=D), torch.randint(0, 2, (5,))
    eager = per_sample_grads(_loss_of(fn_plain, buffers))(params, x, y)
    compiled = torch.compile(per_sample_grads(_loss_of(fn_ck, buffers)), fullgraph=True,
                             backend="aot_eager")(params, x, y)
    _close(compiled, eager)


def test_checkpoint_recomputes_in_plain_autograd_and_runs_once_under_transforms():
    torch.manual_seed(0)
    block = _Block("torchfn").to(D)
    x = torch.randn(3, 4, dtype=D)
    block(x).sum().backward()
    assert block.calls == 2  # forward + recomputation in the backward: activations not kept
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    plain = _Block("none").to(D)
    plain.load_state_dict(block.state_dict())
    plain(x).sum().backward()
    _close(grads, {n: p.grad for n, p in plain.named_parameters()})
    block.calls = 0
    fn, params, buffers = make_functional(block)
    grad(lambda p: fn(p, buffers, x)[0].sum())(params)
    assert fn._module.calls == 1  # inside torch.func: computed directly, no recomputation
    with pytest.raises(TypeError, match=r"checkpoint\(fn, \*args\): fn must be callable"):
        checkpoint(3, x)


@pytest.mark.parametrize("use", ["torch", "torch_reentrant"])
def test_torch_checkpoint_inside_torchfn_paths_points_to_torchfn_checkpoint(use):
    from torchfn.meta import Task, maml

    torch.manual_seed(0)
    model_fn, params, buffers = make_functional(_Block(use).to(D))
    x, y = torch.randn(4, 4, dtype=D), torch.randint(0, 2, (4,))
    hint = r"torch\.utils\.checkpoint\.checkpoint.*Use torchfn\.functional\.checkpoint"
    with pytest.raises(RuntimeError, match="per_sample_grads: the model calls " + hint):
        per_sample_grads(_loss_of(model_fn, buffers))(params, x, y)
    opt = sgd(0.1)
    state = init_train_state(params, buffers, opt, seed=0)
    with pytest.raises(RuntimeError, match="train step: the model calls " + hint):
        make_train_step(model_fn, F.cross_entropy, opt)(state, (x, y))
    tasks = Task(x.view(2, 2, 4), y.view(2, 2), x.view(2, 2, 4), y.view(2, 2))
    with pytest.raises(RuntimeError, match=r"MetaLearner\.meta_grad\(.*\): the model calls " + hint):
        maml(model_fn, F.cross_entropy).meta_grad(params, buffers, tasks)


# ---------------------------------------------------------------------------------------------
# 3./4. dict inputs and a tiny Hugging Face BERT
# ---------------------------------------------------------------------------------------------


def _tiny_bert(n_models: int = 1):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    models = [transformers.BertForSequenceClassification(cfg).to(D).eval()
              for _ in range(n_models)]
    return models


def _bert_batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (4, 7), generator=gen)
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[1, 5:] = 0
    mask[3, 3:] = 0
    return ids, mask, torch.randint(0, 3, (4,), generator=gen)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The workaround the error names: a 4D additive mask transformers uses as given."""
    return (1.0 - mask[..., None, None, :].to(dtype)) * torch.finfo(dtype).min


@pytest.mark.filterwarnings(_PERF)
def test_bert_per_sample_grads_with_dict_inputs_match_an_autograd_loop():
    (bert,) = _tiny_bert()
    model_fn, params, buffers = make_functional(bert)

    def hf_fn(p, b, inputs):  # HF style: the batch is a dict of keyword inputs
        out, new_b = model_fn(p, b, **inputs)
        return out.logits, new_b

    f = single_sample_fn(hf_fn, buffers)

    def loss(p, inputs, y):
        return F.cross_entropy(f(p, inputs), y)

    ids, mask, y = _bert_batch()
    # the 2D 0/1 mask meets transformers' data-dependent check under vmap: a clear error
    with pytest.raises(RuntimeError, match=r"per_sample_grads: the Hugging Face model builds "
                       r"its attention mask with a data-dependent check.*4D additive form"):
        per_sample_grads(loss)(params, {"input_ids": ids, "attention_mask": mask}, y)
    inputs = {"input_ids": ids, "attention_mask": additive_mask(mask, D)}
    got = per_sample_grads(loss)(params, inputs, y)
    norms = per_sample_grad_norms(loss, chunk_size=3)(params, inputs, y)
    by_prefix = per_sample_grads(loss, in_dims=(None, {"input_ids": 0, "attention_mask": 0}, 0))(
        params, inputs, y)
    for i in range(ids.shape[0]):
        leaf = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        out = torch.func.functional_call(
            bert, {**leaf, **buffers}, (), {"input_ids": ids[i:i + 1],
                                            "attention_mask": mask[i:i + 1]})
        ref = torch.autograd.grad(F.cross_entropy(out.logits, y[i:i + 1]), list(leaf.values()),
                                  allow_unused=True)
        ref = {k: torch.zeros_like(v) if r is None else r
               for (k, v), r in zip(leaf.items(), ref, strict=True)}
        _close({k: v[i] for k, v in got.items()}, ref)
        _close({k: v[i] for k, v in by_prefix.items()}, ref)
        ref_norm = torch.sqrt(sum((r ** 2).sum() for r in ref.values()))
        torch.testing.assert_close(norms[i], ref_norm, rtol=1e-10, atol=1e-10)


def test_dict_in_dims_batch_checks_name_the_key():
    def loss(p, inputs):
        return (p * inputs["a"]).sum() + inputs["b"].sum()

    w = torch.randn(3, dtype=D)
    bad = {"a": torch.randn(4, 3, dtype=D), "b": torch.randn(5, 2, dtype=D)}
    with pytest.raises(ValueError, match=r"argument 1 \(leaf 'a'\): 4, argument 1 \(leaf 'b'\): 5"):
        per_sample_grads(loss)(w, bad)
    # a pytree in_dims entry: 'b' is shared, so only 'a' is checked and mapped
    ok = {"a": torch.randn(4, 3, dtype=D), "b": torch.randn(5, 2, dtype=D)}
    g = per_sample_grads(loss, in_dims=(None, {"a": 0, "b": None}))(w, ok)
    torch.testing.assert_close(g, ok["a"])
    with pytest.raises(ValueError, match=r"the in_dims entry of argument 1 must be None, an int, "
                       r"or a pytree"):
        per_sample_grads(loss, in_dims=(None, {"a": 0}))(w, ok)


@pytest.mark.filterwarnings(_PERF)
def test_bert_ensemble_step_with_a_shared_2d_mask_matches_separate_models():
    from torchfn.ensembles import Ensemble, init_ensemble_state, make_ensemble_train_step

    models = _tiny_bert(2)
    ens = Ensemble.from_modules(models)

    def hf_fn(p, b, **inputs):  # a dict of inputs comes in as keywords
        out, new_b = ens.model_fn(p, b, **inputs)
        return out.logits, new_b

    opt = sgd(0.5)
    state = init_ensemble_state(ens, opt, seed=0)
    step = make_ensemble_train_step(hf_fn, F.cross_entropy, opt, shared_batch=True)
    ids, mask, y = _bert_batch()
    new_state, metrics = step(state, ({"input_ids": ids, "attention_mask": mask}, y))
    for n, model in enumerate(models):
        loss = F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y)
        torch.testing.assert_close(metrics["loss"][n], loss.detach(), rtol=1e-10, atol=1e-10)
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        for (name, p), g in zip(model.named_parameters(), grads, strict=True):
            expected = p.detach() - 0.5 * (torch.zeros_like(p) if g is None else g)
            torch.testing.assert_close(new_state.params[name][n], expected, rtol=1e-10,
                                       atol=1e-10, msg=name)


@pytest.mark.filterwarnings(_PERF)
def test_bert_ensembles_with_per_member_masks_name_the_workaround():
    from torchfn.ensembles import (
        Ensemble,
        ensemble_apply,
        init_ensemble_state,
        make_ensemble_train_step,
    )

    models = _tiny_bert(2)
    ens = Ensemble.from_modules(models)

    def hf_fn(p, b, **inputs):  # a dict of inputs comes in as keywords
        out, new_b = ens.model_fn(p, b, **inputs)
        return out.logits, new_b

    ids, mask, y = _bert_batch()
    per_member = {"input_ids": torch.stack([ids, ids.flip(0)]),
                  "attention_mask": torch.stack([mask, mask.flip(0)])}
    hint = r"the Hugging Face model builds its attention mask.*4D additive form"
    with pytest.raises(RuntimeError, match=r"ensemble_apply\(.*\): " + hint):
        ensemble_apply(hf_fn, ens.params, ens.buffers, per_member, per_member=True)
    opt = sgd(0.5)
    step = make_ensemble_train_step(hf_fn, F.cross_entropy, opt)
    state = init_ensemble_state(ens, opt, seed=0)
    with pytest.raises(RuntimeError, match=r"ensemble train step\(state, batch\): " + hint):
        step(state, (per_member, torch.stack([y, y.flip(0)])))
    # the workaround, per member, against each model's own forward with its 2D mask
    fixed = {**per_member, "attention_mask": additive_mask(per_member["attention_mask"], D)}
    out, _ = ensemble_apply(hf_fn, ens.params, ens.buffers, fixed, per_member=True)
    for n, model in enumerate(models):
        ref = model(input_ids=per_member["input_ids"][n],
                    attention_mask=per_member["attention_mask"][n]).logits
        torch.testing.assert_close(out[n], ref.detach(), rtol=1e-10, atol=1e-10)


def test_dict_inputs_with_pytree_in_dims_compiled_equal_eager_and_the_loop():
    torch.manual_seed(0)
    w = {"W": torch.randn(2, 3, dtype=D), "V": torch.randn(2, 4, dtype=D)}

    def loss(p, inputs, y):  # one sample: inputs["a"] (3,), inputs["b"] (4,), shared "s" (2,)
        out = torch.tanh(p["W"] @ inputs["a"] + p["V"] @ inputs["b"]) * inputs["s"]
        return ((out - y) ** 2).sum()

    inputs = {"a": torch.randn(5, 3, dtype=D), "b": torch.randn(5, 4, dtype=D),
              "s": torch.randn(2, dtype=D)}
    y = torch.randn(5, 2, dtype=D)
    fn = per_sample_grads(loss, in_dims=(None, {"a": 0, "b": 0, "s": None}, 0))
    eager = fn(w, inputs, y)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(w, inputs, y)
    _close(compiled, eager)
    for i in range(5):
        one = {"a": inputs["a"][i], "b": inputs["b"][i], "s": inputs["s"]}
        _close({k: v[i] for k, v in eager.items()}, grad(loss)(w, one, y[i]))
