"""MAML++ and ProtoNets/matching nets vs hand-written per-task loops in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchfn.functional import functional_batch_norm, make_functional
from torchfn.meta import (
    STEP_KEY,
    Task,
    batchnorm_names,
    fomaml,
    init_meta_state,
    make_meta_train_step,
    maml,
    maml_plus_plus,
    matching_net,
    msl_weights,
    protonet,
    sinusoid_tasks,
)
from torchfn.optim import adam

DT = torch.float64
LR, STEPS = 0.1, 3


def _bn_mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(1, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 1)).to(DT)


def _tasks(n: int = 4, seed: int = 1) -> Task:
    return sinusoid_tasks(n, 6, 7, generator=torch.Generator().manual_seed(seed), dtype=DT)[0]


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w1": torch.randn(1, 8, generator=g, dtype=DT), "b1": torch.randn(8, generator=g,
                                                                                dtype=DT),
            "w2": torch.randn(8, 1, generator=g, dtype=DT) / 3}


def _mlp_fn(p, b, x):
    return torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"], b


def _off(model_fn, **kw):
    return maml_plus_plus(model_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS, lslr=False,
                          multi_step_loss=False, **kw)


# -- MAML++ with every piece off is MAML --------------------------------------------------------


def test_all_pieces_off_equals_maml_bitwise():
    model_fn, params, buffers = make_functional(_bn_mlp())
    tasks = _tasks()
    ref = maml(model_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS)
    pp = _off(model_fn)
    assert set(pp.init(params)) == set(params) and set(pp.init_buffers(buffers)) == set(buffers)
    g_ref, l_ref, b_ref = ref.meta_grad(ref.init(params), buffers, tasks)
    g, loss, b = pp.meta_grad(pp.init(params), pp.init_buffers(buffers), tasks)
    assert torch.equal(loss, l_ref)
    for k in g_ref:
        assert torch.equal(g[k], g_ref[k]), k
    for k in b_ref:
        assert torch.equal(b[k], b_ref[k]), k
    # and through the outer step
    opt = adam(1e-2)
    s_ref = init_meta_state(ref, params, buffers, opt)
    s = init_meta_state(pp, params, buffers, opt)
    s_ref, m_ref = make_meta_train_step(ref, opt)(s_ref, tasks)
    s, m = make_meta_train_step(pp, opt)(s, tasks)
    assert torch.equal(m["loss"], m_ref["loss"])
    for k in s_ref.params:
        assert torch.equal(s.params[k], s_ref.params[k]), k
    # adapt: the same fast params
    f_ref, _ = ref.adapt(params, buffers, tasks.support_x[0], tasks.support_y[0])
    f, _ = pp.adapt(pp.init(params), buffers, tasks.support_x[0], tasks.support_y[0])
    for k in f_ref:
        assert torch.equal(f[k], f_ref[k]), k


# -- hand-unrolled reference --------------------------------------------------------------------


def _reference(params, tasks, *, lrs=None, weights=None, first_order=False):
    """Per task: STEPS inner SGD steps with autograd.grad; query loss after each step.

    ``lrs[k]``: per-step rates ``(STEPS,)`` (LSLR); ``weights``: MSL weights (else the last
    query loss only). Returns ``(loss, grads of params and lrs)``.
    """
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    lr_t = {k: v.clone().requires_grad_() for k, v in (lrs or {}).items()}
    total = 0
    for t in range(tasks.support_x.shape[0]):
        fast = dict(p)
        task_loss = 0
        for i in range(STEPS):
            loss = F.mse_loss(_mlp_fn(fast, {}, tasks.support_x[t])[0], tasks.support_y[t])
            g = torch.autograd.grad(loss, list(fast.values()), create_graph=not first_order)
            fast = {k: fast[k] - (lr_t[k][i] if lrs else LR) * gk
                    for k, gk in zip(fast, g, strict=True)}
            q = F.mse_loss(_mlp_fn(fast, {}, tasks.query_x[t])[0], tasks.query_y[t])
            if weights is not None:
                task_loss = task_loss + float(weights[i]) * q
            elif i == STEPS - 1:
                task_loss = q
        total = total + task_loss
    total = total / tasks.support_x.shape[0]
    leaves = {**p, **{"lslr:" + k: v for k, v in lr_t.items()}}
    grads = torch.autograd.grad(total, list(leaves.values()))
    return total.detach(), dict(zip(leaves, grads, strict=True))


def test_lslr_gradients_flow_to_per_step_rates():
    params, tasks = _params(), _tasks()
    learner = maml_plus_plus(_mlp_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS,
                             multi_step_loss=False)
    meta = learner.init(params)
    assert meta["lslr:w1"].shape == (STEPS,) and torch.all(meta["lslr:w1"] == LR)
    g = torch.Generator().manual_seed(7)  # distinct rates per step and layer
    for k in params:
        meta["lslr:" + k] = 0.05 + 0.1 * torch.rand(STEPS, generator=g, dtype=DT)
    got, loss, _ = learner.meta_grad(meta, learner.init_buffers({}), tasks)
    ref_loss, ref = _reference(params, tasks, lrs={k: meta["lslr:" + k] for k in params})
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12, msg=k)
        assert got[k].abs().max() > 0, k


def _hand_weights(step: int, anneal: int) -> list[float]:
    n, floor = STEPS, 0.03 / STEPS
    early = max((1 - min(step / anneal, 1.0)) / n, floor)
    return [early] * (n - 1) + [1 - (n - 1) * early]


@pytest.mark.parametrize("step", [0, 2, 5, 9])
def test_multi_step_loss_equals_hand_weighted_sum(step):
    anneal = 5
    weights = msl_weights(torch.tensor(step), STEPS, anneal, dtype=DT)
    torch.testing.assert_close(weights, torch.tensor(_hand_weights(step, anneal), dtype=DT),
                               rtol=1e-15, atol=0)
    params, tasks = _params(), _tasks()
    learner = maml_plus_plus(_mlp_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS, lslr=False,
                             msl_anneal_steps=anneal)
    bufs = learner.init_buffers({})
    bufs[STEP_KEY] = torch.tensor(step)
    got, loss, new = learner.meta_grad(learner.init(params), bufs, tasks)
    ref_loss, ref = _reference(params, tasks, weights=_hand_weights(step, anneal))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12, msg=k)
    assert int(new[STEP_KEY]) == step + 1


def test_derivative_order_annealing_switches_from_first_to_second_order():
    params, tasks = _params(), _tasks()
    learner = _off(_mlp_fn, first_order_until=2)
    meta, bufs = learner.init(params), learner.init_buffers({})
    fo = fomaml(_mlp_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS).meta_grad(params, {}, tasks)
    so = maml(_mlp_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS).meta_grad(params, {}, tasks)
    assert (fo[0]["w1"] - so[0]["w1"]).abs().max() > 1e-4  # the two orders differ here
    for step, want in ((0, fo), (1, fo), (2, so), (7, so)):
        bufs[STEP_KEY] = torch.tensor(step)
        got, loss, _ = learner.meta_grad(meta, bufs, tasks)
        torch.testing.assert_close(loss, want[1], rtol=1e-14, atol=0)
        for k in params:
            torch.testing.assert_close(got[k], want[0][k], rtol=1e-12, atol=1e-14,
                                       msg=f"step {step} {k}")


# -- per-step BatchNorm -------------------------------------------------------------------------


def _bn_fn(p, b, x):
    h = x @ p["w1"]
    h, rm, rv, _ = functional_batch_norm(h, b["rm"], b["rv"], p["g"], p["beta"], training=True,
                                         momentum=0.1, eps=1e-5)
    return torch.tanh(h) @ p["w2"], {"rm": rm, "rv": rv}


def test_per_step_bn_equals_loop_with_per_step_rows():
    gen = torch.Generator().manual_seed(4)
    params = {"w1": torch.randn(1, 5, generator=gen, dtype=DT),
              "g": 1 + 0.1 * torch.randn(5, generator=gen, dtype=DT),
              "beta": 0.1 * torch.randn(5, generator=gen, dtype=DT),
              "w2": torch.randn(5, 1, generator=gen, dtype=DT) / 3}
    buffers = {"rm": torch.zeros(5, dtype=DT), "rv": torch.ones(5, dtype=DT)}
    tasks = _tasks(3)
    bn = {"g", "beta", "rm", "rv"}
    learner = maml_plus_plus(_bn_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS, lslr=False,
                             multi_step_loss=False, per_step_bn=bn,
                             adapt_filter=lambda n: n not in bn)
    meta, bufs = learner.init(params), learner.init_buffers(buffers, params)
    assert meta["g"].shape == (STEPS, 5) and bufs["rm"].shape == (STEPS, 5)
    meta["g"] = meta["g"] + 0.1 * torch.randn(STEPS, 5, generator=gen, dtype=DT)  # rows differ
    meta["beta"] = meta["beta"] + 0.1 * torch.randn(STEPS, 5, generator=gen, dtype=DT)
    got, loss, new = learner.meta_grad(meta, bufs, tasks)

    p = {k: v.clone().requires_grad_() for k, v in meta.items()}
    total, stats = 0, []
    for t in range(3):
        fast = {"w1": p["w1"], "w2": p["w2"]}
        rm, rv = [bufs["rm"][i] for i in range(STEPS)], [bufs["rv"][i] for i in range(STEPS)]

        def fwd(f, i, x, rm=rm, rv=rv):
            out, nb = _bn_fn({**f, "g": p["g"][i], "beta": p["beta"][i]},
                             {"rm": rm[i], "rv": rv[i]}, x)
            rm[i], rv[i] = nb["rm"], nb["rv"]
            return out

        for i in range(STEPS):
            loss_i = F.mse_loss(fwd(fast, i, tasks.support_x[t]), tasks.support_y[t])
            g = torch.autograd.grad(loss_i, list(fast.values()), create_graph=True)
            fast = {k: fast[k] - LR * gk for k, gk in zip(fast, g, strict=True)}
        total = total + F.mse_loss(fwd(fast, STEPS - 1, tasks.query_x[t]), tasks.query_y[t])
        stats.append((torch.stack(rm), torch.stack(rv)))
    total = total / 3
    ref = dict(zip(p, torch.autograd.grad(total, list(p.values())), strict=True))
    torch.testing.assert_close(loss, total.detach(), rtol=1e-12, atol=0)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12, msg=k)
    assert got["g"].abs().min() > 0  # every step's BN weights get a gradient
    torch.testing.assert_close(new["rm"], torch.stack([s[0] for s in stats]).mean(0))
    torch.testing.assert_close(new["rv"], torch.stack([s[1] for s in stats]).mean(0))


def test_per_step_bn_with_make_functional_and_batchnorm_names():
    module = _bn_mlp()
    model_fn, params, buffers = make_functional(module)
    names = batchnorm_names(module)
    assert names == ["1.weight", "1.bias", "1.running_mean", "1.running_var",
                     "1.num_batches_tracked"]
    learner = maml_plus_plus(model_fn, F.mse_loss, inner_lr=LR, inner_steps=STEPS,
                             msl_anneal_steps=4, per_step_bn=names)
    opt = adam(1e-2)
    state = init_meta_state(learner, params, buffers, opt)
    state, _ = make_meta_train_step(learner, opt)(state, _tasks())
    assert state.params["1.weight"].shape == (STEPS, 6)
    # each step's forward counts once per row: 1 support forward, and the query on the last row
    assert state.buffers["1.num_batches_tracked"].tolist() == [1] * (STEPS - 1) + [2]
    fast, bufs = learner.adapt(state.params, state.buffers, _tasks().support_x[0],
                               _tasks().support_y[0])
    assert fast["1.weight"].shape == (6,) and bufs["1.running_mean"].shape == (6,)
    assert STEP_KEY not in bufs


# -- compiled == eager, no recompiles while the MSL weights and the order change -----------------


def test_compiled_step_equals_eager_without_recompiles():
    learner = maml_plus_plus(_mlp_fn, F.mse_loss, inner_lr=LR, inner_steps=2,
                             msl_anneal_steps=3, first_order_until=2)
    opt = adam(1e-2)
    state = init_meta_state(learner, _params(), {}, opt)
    step = make_meta_train_step(learner, opt)
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    s_eager, s_comp = state, state
    for i in range(4):
        tasks = sinusoid_tasks(3, 5, 5, generator=gen, dtype=DT)[0]
        s_eager, m_eager = step(s_eager, tasks)
        s_comp, m_comp = compiled(s_comp, tasks)
        torch.testing.assert_close(m_comp["loss"], m_eager["loss"], rtol=1e-12, atol=0)
        for k in s_eager.params:
            torch.testing.assert_close(s_comp.params[k], s_eager.params[k], rtol=1e-10,
                                       atol=1e-13, msg=f"step {i} {k}")
        assert len(calls) == 1, f"recompiled at step {i}: {len(calls)} graphs"
    assert int(s_comp.buffers[STEP_KEY]) == 4 and int(s_comp.step) == 4
    assert not torch.equal(s_comp.params["lslr:w1"], torch.full((2,), LR, dtype=DT))


# -- ProtoNet and matching net ------------------------------------------------------------------

N_WAY, K, Q, D = 3, 2, 4, 5


def _metric_tasks(n: int = 3) -> Task:
    g = torch.Generator().manual_seed(8)
    sy = torch.arange(N_WAY).repeat(K)[torch.randperm(N_WAY * K, generator=g)].repeat(n, 1)
    qy = torch.randint(0, N_WAY, (n, Q), generator=g)
    return Task(torch.randn(n, N_WAY * K, 6, generator=g, dtype=DT), sy,
                torch.randn(n, Q, 6, generator=g, dtype=DT), qy)


def _embed(p, b, x):
    return torch.tanh(x @ p["w"]) @ p["v"], b


def _embed_params():
    g = torch.Generator().manual_seed(9)
    return {"w": torch.randn(6, 7, generator=g, dtype=DT),
            "v": torch.randn(7, D, generator=g, dtype=DT)}


def _ref_logits(kind, distance, scale, p, task):
    zs, zq = _embed(p, {}, task.support_x)[0], _embed(p, {}, task.query_x)[0]
    rows = []
    for q in range(zq.shape[0]):
        row = []
        if kind == "matching_net":
            sims = [torch.dot(zq[q], zs[j]) / (zq[q].norm() * zs[j].norm())
                    for j in range(zs.shape[0])]
            att = torch.softmax(scale * torch.stack(sims), 0)
            for c in range(N_WAY):
                row.append(torch.log(sum(att[j] for j in range(zs.shape[0])
                                         if int(task.support_y[j]) == c)))
        else:
            for c in range(N_WAY):
                members = [zs[j] for j in range(zs.shape[0]) if int(task.support_y[j]) == c]
                proto = sum(members) / len(members)
                if distance == "sqeuclidean":
                    d = sum((zq[q][i] - proto[i]) ** 2 for i in range(D))
                else:
                    d = 1 - torch.dot(zq[q], proto) / (zq[q].norm() * proto.norm())
                row.append(-scale * d)
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize("kind,distance,scale", [("protonet", "sqeuclidean", 1.0),
                                                 ("protonet", "cosine", 4.0),
                                                 ("matching_net", "cosine", 3.0)])
def test_metric_logits_and_grads_equal_hand_written_reference(kind, distance, scale):
    tasks, params = _metric_tasks(), _embed_params()
    if kind == "protonet":
        learner = protonet(_embed, n_way=N_WAY, distance=distance, scale=scale)
    else:
        learner = matching_net(_embed, n_way=N_WAY, scale=scale)
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    total = 0
    for t in range(3):
        task = Task(*(f[t] for f in tasks))
        ref = _ref_logits(kind, distance, scale, p, task)
        got, _ = learner.logits(params, {}, task)
        torch.testing.assert_close(got, ref.detach(), rtol=1e-12, atol=1e-14)
        total = total + F.cross_entropy(ref, task.query_y)
    total = total / 3
    ref_g = dict(zip(p, torch.autograd.grad(total, list(p.values())), strict=True))
    g, loss, _ = learner.meta_grad(params, {}, tasks)
    torch.testing.assert_close(loss, total.detach(), rtol=1e-12, atol=0)
    for k in ref_g:
        torch.testing.assert_close(g[k], ref_g[k], rtol=1e-10, atol=1e-13, msg=k)
    loss2, _ = learner.meta_loss(params, {}, tasks)
    torch.testing.assert_close(loss2, loss, rtol=1e-14, atol=0)


def test_protonet_trains_with_meta_train_step_compiled():
    learner = protonet(_embed, n_way=N_WAY)
    opt = adam(1e-2)
    state = init_meta_state(learner, _embed_params(), {}, opt)
    step = make_meta_train_step(learner, opt)
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    tasks = _metric_tasks()
    s_e, m_e = step(state, tasks)
    s_c, m_c = compiled(state, tasks)
    torch.testing.assert_close(m_c["loss"], m_e["loss"], rtol=1e-12, atol=0)
    for k in s_e.params:
        torch.testing.assert_close(s_c.params[k], s_e.params[k], rtol=1e-10, atol=1e-13)
        assert not torch.equal(s_e.params[k], state.params[k])


# -- errors -------------------------------------------------------------------------------------


def test_clear_errors():
    with pytest.raises(ValueError, match=r"multi_step_loss=True\): pass msl_anneal_steps"):
        maml_plus_plus(_mlp_fn, F.mse_loss)
    with pytest.raises(ValueError, match=r"first_order=True, first_order_until=3\)"):
        maml_plus_plus(_mlp_fn, F.mse_loss, msl_anneal_steps=2, first_order=True,
                       first_order_until=3)
    with pytest.raises(ValueError, match=r"msl_floor=...\): expected a float in \[0, 1/inner"):
        maml_plus_plus(_mlp_fn, F.mse_loss, inner_steps=2, msl_anneal_steps=2, msl_floor=0.9)
    with pytest.raises(ValueError, match=r"multi_step_loss=False, msl_anneal_steps=5"):
        maml_plus_plus(_mlp_fn, F.mse_loss, multi_step_loss=False, msl_anneal_steps=5)
    with pytest.raises(ValueError, match=r"per_step_bn=...\): expected a collection"):
        maml_plus_plus(_mlp_fn, F.mse_loss, multi_step_loss=False, per_step_bn="1.weight")
    learner = maml_plus_plus(_mlp_fn, F.mse_loss, msl_anneal_steps=2, inner_steps=2)
    with pytest.raises(ValueError, match=r"buffers have no 'mamlpp:step'.*init_buffers"):
        learner.meta_grad(learner.init(_params()), {}, _tasks())
    with pytest.raises(ValueError, match=r"meta_params lack the learned rates \['lslr:w1'"):
        learner.meta_grad(_params(), learner.init_buffers({}), _tasks())
    bn = maml_plus_plus(_mlp_fn, F.mse_loss, multi_step_loss=False, per_step_bn=["nope"])
    with pytest.raises(ValueError, match=r"\['nope'\] are neither parameters"):
        bn.init_buffers({}, _params())

    with pytest.raises(ValueError, match=r"protonet\(distance=...\): expected one of"):
        protonet(_embed, n_way=3, distance="l1")
    with pytest.raises(ValueError, match=r"matching_net\(n_way=...\): expected an int >= 2"):
        matching_net(_embed, n_way=1)
    learner = protonet(_embed, n_way=N_WAY)
    tasks = _metric_tasks()
    missing = Task(tasks.support_x, torch.zeros_like(tasks.support_y), tasks.query_x,
                   tasks.query_y)
    with pytest.raises(ValueError, match=r"task 0 has no support example of class 1"):
        learner.meta_grad(_embed_params(), {}, missing)
    too_big = Task(tasks.support_x, tasks.support_y + 1, tasks.query_x, tasks.query_y)
    with pytest.raises(ValueError, match=r"class ids in 0..2 \(n_way=3\), got values in 1..3"):
        learner.meta_loss(_embed_params(), {}, too_big)
    # query ids past n_way were an out-of-bounds gather (a device-side assert on CUDA), one-hot
    # label rows a shape error inside the loss
    big_query = Task(tasks.support_x, tasks.support_y, tasks.query_x, tasks.query_y + N_WAY)
    with pytest.raises(ValueError, match=r"query labels must be class ids in 0..2 \(n_way=3\)"):
        learner.meta_loss(_embed_params(), {}, big_query)
    one_hot = Task(tasks.support_x, F.one_hot(tasks.support_y, N_WAY), tasks.query_x,
                   tasks.query_y)
    with pytest.raises(ValueError, match=r"tasks.support_y must be class ids of shape \(T, n\), "
                       r"got shape \(\d+, \d+, 3\)"):
        learner.meta_grad(_embed_params(), {}, one_hot)
    with pytest.raises(TypeError, match=r"protonet has no inner loop.*learner.logits"):
        learner.adapt(_embed_params(), {}, tasks.support_x[0], tasks.support_y[0])
    flat = protonet(lambda p, b, x: (x[..., None] * p["w"][0, 0], b), n_way=N_WAY)
    with pytest.raises(ValueError, match=r"embed_fn returned \(6, 6, 1\).*expected embeddings"):
        flat.meta_grad(_embed_params(), {}, tasks)
