"""``TorchOptimizer`` as a torch.optim citizen, checked the way torch checks its own optimizers.

The cases are torch's own: the hyperparameter inputs of ``AdamW``, ``Adam``, ``SGD`` and
``Adafactor`` in ``torch.testing._internal.common_optimizers.optim_db`` (the database
``TestOptimRenewed`` is driven by), each given to a constructor with torch's signature that
builds ``TorchOptimizer(params, ft.<alias>(...))``. The checks are this project's own (torch's
test file is not copied): state dicts (named and unnamed, through ``torch.save``), deepcopy,
pickle, hooks, param-group dicts with per-group schedulers, steps without gradients, tensor
learning rates, a writable ``optimizer.state``, and state dicts moving between ``torch.optim``
and ``TorchOptimizer`` in both directions mid-run.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections import defaultdict

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import functional_train as ft

co = pytest.importorskip("torch.testing._internal.common_optimizers")

_IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _no_flags(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k not in _IMPLEMENTATION_FLAGS}


# constructors with torch.optim's signatures (its implementation flags are accepted and unused)
def AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kw):
    tx = ft.adamw(lr, betas[0], betas[1], eps, weight_decay, amsgrad, **_no_flags(kw))
    return ft.TorchOptimizer(params, tx)


def Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, **kw):
    tx = ft.adam(lr, betas[0], betas[1], eps, weight_decay, amsgrad, **_no_flags(kw))
    return ft.TorchOptimizer(params, tx)


def SGD(params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, **kw):
    tx = ft.sgd(lr, momentum, dampening, weight_decay, nesterov, **_no_flags(kw))
    return ft.TorchOptimizer(params, tx)


def Adafactor(params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, **kw):
    maximize = _no_flags(kw).pop("maximize", False)
    tx = ft.adafactor(
        lr,
        eps=(1e-30 if eps[0] is None else eps[0], eps[1]),
        clip_threshold=d,
        decay_rate=beta2_decay,
        weight_decay=weight_decay,
        relative_step=False,
        scale_parameter=False,
    )
    return ft.TorchOptimizer(params, ft.chain(ft.scale(-1.0), tx) if maximize else tx)


OURS = {"AdamW": AdamW, "Adam": Adam, "SGD": SGD, "Adafactor": Adafactor}
TORCH = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}
_DB = {info.optim_cls.__name__: info for info in co.optim_db}
CASES = [
    pytest.param(name, inp.kwargs, id=f"{name}-{inp.desc.replace(' ', '_')}")
    for name in OURS
    for inp in _DB[name].optim_inputs_func(device="cpu", dtype=torch.float32)
]
TORCH_CASES = [c for c in CASES if c.values[0] in TORCH]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)) for _ in range(n)]


def _backward(model, batch):
    x, y = batch
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _train(model, opt, batches, sched=None):
    for b in batches:
        _backward(model, b)
        opt.step()
        if sched is not None:
            sched.step()


def _kw(kwargs):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


def _same_params(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


def _same_state(sa: dict, sb: dict):
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (i, k)


def _through_torch_save(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True


@pytest.mark.parametrize("name, kwargs", CASES)
def test_state_dict_named_and_unnamed_round_trip_bitwise(name, kwargs):
    """Saved from ``named_parameters()`` (through ``torch.save`` / ``torch.load``), loaded into
    one built from ``parameters()``, then back into a named one: all three continue bitwise."""
    batches = _batches(6)
    a = _model()
    oa = OURS[name](a.named_parameters(), **_kw(kwargs))
    _train(a, oa, batches[:3])
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    ob = OURS[name](b.parameters(), **_kw(kwargs))
    ob.load_state_dict(_through_torch_save(oa.state_dict()))
    assert "param_names" not in ob.state_dict()["param_groups"][0]
    oc = OURS[name](c.named_parameters(), **_kw(kwargs))
    oc.load_state_dict(_through_torch_save(ob.state_dict()))
    assert oc.state_dict()["param_groups"][0]["param_names"] == [n for n, _ in a.named_parameters()]
    for m, o in ((a, oa), (b, ob), (c, oc)):
        _train(m, o, batches[3:])
    _same_params(a, b)
    _same_params(a, c)
    _same_state(oa.state_dict()["state"], ob.state_dict()["state"])
    assert not torch.equal(a[0].weight, _model()[0].weight)


@pytest.mark.parametrize("name, kwargs", CASES)
def test_deepcopy_and_pickle_step_on_copies(name, kwargs):
    """``copy.deepcopy`` and a pickle round trip give optimizers with the same public
    attributes over copies of the parameters, which then step as the original does."""
    model = _model()
    opt = OURS[name](model.named_parameters(), **_kw(kwargs))
    _train(model, opt, _batches(2))
    dup = copy.deepcopy(opt)
    pickled = pickle.loads(pickle.dumps(opt))
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    for other in (dup, pickled):
        assert {k for k in other.__dict__ if not k.startswith("_")} == public
        assert repr(other) == repr(opt)
        _same_state(other.state_dict()["state"], opt.state_dict()["state"])
        ps = other.param_groups[0]["params"]
        assert all(p is not q for p, q in zip(ps, model.parameters()))
    _backward(model, _batches(3)[2])
    grads = [p.grad.clone() for p in model.parameters()]
    for o in (opt, dup, pickled):
        for p, g in zip([p for grp in o.param_groups for p in grp["params"]], grads):
            p.grad = g.clone()
        o.step()
    for o in (dup, pickled):
        for p, q in zip(opt.param_groups[0]["params"], o.param_groups[0]["params"]):
            assert torch.equal(p, q)
        _same_state(o.state_dict()["state"], opt.state_dict()["state"])


@pytest.mark.parametrize("name, kwargs", CASES)
def test_hooks_run_and_their_results_are_used(name, kwargs):
    """Step pre/post hooks (the optimizer's and the global ones), state-dict pre/post hooks (a
    post hook's dict is returned) and load-state-dict pre/post hooks (a pre hook's dict is
    loaded), in order."""
    model = _model()
    opt = OURS[name](model.named_parameters(), **_kw(kwargs))
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    handle = register_optimizer_step_pre_hook(lambda o, a, k: seen.append("global-pre"))
    try:
        _train(model, opt, _batches(1))
    finally:
        handle.remove()
    assert seen == ["global-pre", "pre", "post"]

    opt.register_state_dict_pre_hook(lambda o: seen.append("sd-pre"))

    def add_note(o, sd):
        seen.append("sd-post")
        return {**sd, "note": "kept"}

    opt.register_state_dict_post_hook(add_note)
    sd = opt.state_dict()
    assert sd["note"] == "kept" and seen[-2:] == ["sd-pre", "sd-post"]

    other = OURS[name](copy.deepcopy(model).named_parameters(), **_kw(kwargs))

    def strip_note(o, sd):
        seen.append("load-pre")
        assert sd["note"] == "kept"
        sd = dict(sd)
        sd["param_groups"] = [dict(g, lr=0.5) for g in sd["param_groups"]]
        return sd

    other.register_load_state_dict_pre_hook(strip_note)
    other.register_load_state_dict_post_hook(lambda o: seen.append("load-post"))
    other.load_state_dict(copy.deepcopy(sd))
    assert seen[-2:] == ["load-pre", "load-post"]
    assert float(other.param_groups[0]["lr"]) == 0.5


@pytest.mark.parametrize("name, kwargs", CASES)
def test_param_group_dicts_with_per_group_schedulers(name, kwargs):
    """torch's usual two groups (weights with the case's settings and twice its learning
    rate, biases without weight decay), each driven by its own LambdaLR lambda: the same
    parameters as one optimizer per group under its own lambda (to float32 rounding: the groups
    run as a partition, one optimizer alone as its fused kernel), and as the torch.optim
    class given the same groups where there is one."""
    lr = float(kwargs.get("lr", 1e-2 if name == "Adafactor" else 1e-3))
    lambdas = [lambda t: 0.9**t, lambda t: 1.0 / (1 + t)]
    batches = _batches(5)
    start = _model()
    grouped, split, ref = copy.deepcopy(start), copy.deepcopy(start), copy.deepcopy(start)

    def groups(model):
        return [
            {"params": [p for n, p in model.named_parameters() if "weight" in n], "lr": 2 * lr},
            {
                "params": [p for n, p in model.named_parameters() if "bias" in n],
                "weight_decay": 0.0,
            },
        ]

    kw = {k: v for k, v in _kw(kwargs).items() if k != "lr"}
    opt = OURS[name](groups(grouped), lr=lr, **kw)
    assert [float(g["lr"]) for g in opt.param_groups] == [2 * lr, lr]
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[0]["weight_decay"] == kwargs.get(
        "weight_decay", {"AdamW": 1e-2}.get(name, 0.0)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
    one = []
    for g, fn in zip(groups(split), lambdas):
        settings = {**kw, "lr": lr, **{k: v for k, v in g.items() if k != "params"}}
        o = OURS[name](g["params"], **settings)
        one.append((o, torch.optim.lr_scheduler.LambdaLR(o, fn)))
    for b in batches:
        _backward(grouped, b)
        opt.step()
        sched.step()
        _backward(split, b)
        for o, s in one:
            o.step()
            s.step()
    for p, q, s in zip(grouped.parameters(), split.parameters(), start.parameters()):
        torch.testing.assert_close(p - s, q - s, rtol=1e-5, atol=1e-7)
    if name in TORCH:
        ref_opt = TORCH[name](groups(ref), lr=lr, **kw)
        _train(ref, ref_opt, batches, torch.optim.lr_scheduler.LambdaLR(ref_opt, lambdas))
        for (n, p), q, s in zip(grouped.named_parameters(), ref.parameters(), start.parameters()):
            torch.testing.assert_close(p - s, q - s, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("name, kwargs", CASES)
def test_step_without_gradients_changes_nothing(name, kwargs):
    """A step where no parameter has a gradient (before any other step, and after some) leaves
    every parameter and every state tensor as it was, as torch.optim's steps do."""
    model = _model()
    opt = OURS[name](model.named_parameters(), **_kw(kwargs))
    for steps in (0, 2):
        _train(model, opt, _batches(steps))
        opt.zero_grad(set_to_none=True)
        before = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict()["state"])
        opt.step()
        for p, q in zip(model.parameters(), before):
            assert torch.equal(p, q)
        _same_state(opt.state_dict()["state"], state)


@pytest.mark.parametrize("name, kwargs", [c for c in CASES if "lr" not in c.values[1]])
@pytest.mark.parametrize("form", ["0-dim", "one-element"])
def test_tensor_learning_rate_steps_as_the_float(name, kwargs, form):
    """A learning rate given as a tensor (0-dim, or one element as torch also accepts) steps
    exactly as the same float, and is a tensor in the group (schedulers update it in place)."""
    lr = 1e-2 if name == "Adafactor" else 1e-3
    value = torch.tensor(lr) if form == "0-dim" else torch.tensor([lr])
    batches = _batches(3)
    a, b = _model(), _model()
    oa = OURS[name](a.parameters(), lr=lr, **_kw(kwargs))
    ob = OURS[name](b.parameters(), lr=value, **_kw(kwargs))
    assert isinstance(ob.param_groups[0]["lr"], torch.Tensor)
    _train(a, oa, batches)
    _train(b, ob, batches)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name, kwargs", CASES)
def test_state_is_writable_like_torchs(name, kwargs):
    """``state[p][key] = tensor`` replaces that leaf (writing another optimizer's entries makes
    this one continue as that one, bitwise); a new key is kept through ``state_dict`` and
    ``load_state_dict``, and can be deleted; ``optimizer.state = defaultdict(dict)`` resets the
    state (then it steps as a fresh optimizer); a wrong shape raises naming the key."""
    batches = _batches(5)
    a = _model()
    oa = OURS[name](a.named_parameters(), **_kw(kwargs))
    _train(a, oa, batches[:2])
    b = copy.deepcopy(a)
    ob = OURS[name](b.named_parameters(), **_kw(kwargs))
    for p, q in zip(a.parameters(), b.parameters()):
        for k, v in oa.state[p].items():
            ob.state[q][k] = v.clone()
    _same_state(ob.state_dict()["state"], oa.state_dict()["state"])
    _train(a, oa, batches[2:3])
    _train(b, ob, batches[2:3])
    _same_params(a, b)

    p0 = next(b.parameters())
    ob.state[p0]["note"] = torch.tensor(7.0)
    assert ob.state_dict()["state"][0]["note"] == 7.0
    oc = OURS[name](copy.deepcopy(b).named_parameters(), **_kw(kwargs))
    oc.load_state_dict(copy.deepcopy(ob.state_dict()))
    assert oc.state_dict()["state"][0]["note"] == 7.0
    del ob.state[p0]["note"]
    assert "note" not in ob.state[p0]
    key = next(k for k, v in ob.state[p0].items() if isinstance(v, torch.Tensor) and v.ndim)
    with pytest.raises(ValueError, match=f"'{key}' has shape"):
        ob.state[p0][key] = torch.zeros(1, 1, 1)

    fresh = copy.deepcopy(b)
    of = OURS[name](fresh.named_parameters(), **_kw(kwargs))
    ob.state = defaultdict(dict)
    _same_state(ob.state_dict()["state"], of.state_dict()["state"])
    _train(b, ob, batches[3:])
    _train(fresh, of, batches[3:])
    _same_params(b, fresh)


@pytest.mark.parametrize("name, kwargs", TORCH_CASES)
def test_torch_state_dict_moves_both_ways_mid_run(name, kwargs):
    """A ``torch.optim`` state dict loads into the equivalent ``TorchOptimizer`` (which then
    follows torch's run to float32 rounding), and back: torch -> TorchOptimizer -> torch and
    TorchOptimizer -> torch -> TorchOptimizer both continue bitwise as the run that was not
    interrupted."""
    batches = _batches(7)
    t = _model()
    ot = TORCH[name](t.parameters(), **_kw(kwargs))
    _train(t, ot, batches[:3])

    # torch -> ours -> torch, continuing bitwise as torch
    f = copy.deepcopy(t)
    of = OURS[name](f.named_parameters(), **_kw(kwargs))
    of.load_state_dict(copy.deepcopy(ot.state_dict()))
    assert set(of.state_dict()["state"][0]) >= {"step"}
    back = copy.deepcopy(t)
    ob = TORCH[name](back.parameters(), **_kw(kwargs))
    ob.load_state_dict(copy.deepcopy(of.state_dict()))
    theirs = ot.state_dict()["state"]  # (SGD's entries also carry this optimizer's "step")
    ours = ob.state_dict()["state"]
    _same_state({i: {k: ours[i][k] for k in e} for i, e in theirs.items()}, theirs)
    _train(back, ob, batches[3:5])

    # ours continuing from torch's state follows torch
    _train(f, of, batches[3:5])
    _train(t, ot, batches[3:5])
    _same_params(t, back)
    start = _model()
    for (n, p), q, s in zip(f.named_parameters(), t.parameters(), start.parameters()):
        torch.testing.assert_close(p - s, q - s, rtol=1e-5, atol=1e-7, msg=n)

    # ours -> torch -> ours, continuing bitwise as ours
    g = copy.deepcopy(f)
    og = OURS[name](g.parameters(), **_kw(kwargs))
    via = TORCH[name](copy.deepcopy(f).parameters(), **_kw(kwargs))
    via.load_state_dict(copy.deepcopy(of.state_dict()))
    og.load_state_dict(copy.deepcopy(via.state_dict()))
    _train(f, of, batches[5:])
    _train(g, og, batches[5:])
    _same_params(f, g)


def test_another_optimizers_state_dict_is_refused():
    """torch's SGD state into an AdamW, Adam's into AdamW, amsgrad's into one without, per-
    parameter step counts that differ: each raises naming what differs."""
    model = _model()
    _backward(model, _batches(1)[0])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    adam.step()
    ams = torch.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    ams.step()
    with pytest.raises(ValueError, match=r"has no \['betas', 'eps'\]"):
        AdamW(model.parameters()).load_state_dict(sgd.state_dict())
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        AdamW(model.parameters()).load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="amsgrad=True"):
        AdamW(model.parameters()).load_state_dict(ams.state_dict())
    sd = copy.deepcopy(adam.state_dict())
    sd["state"][1]["step"] = torch.tensor(4.0)
    with pytest.raises(ValueError, match="'0' and '1' have different step counts"):
        Adam(model.parameters()).load_state_dict(sd)
    sd["state"][1]["step"] = torch.tensor(1.5)
    with pytest.raises(ValueError, match="whole number"):
        Adam(model.parameters()).load_state_dict(sd)
    opt = AdamW(model.parameters())
    with pytest.raises(ValueError, match="1 parameter groups.*has 1|parameters, this optimizer"):
        sd = copy.deepcopy(ams.state_dict())
        sd["param_groups"][0]["params"] = [0, 1]
        opt.load_state_dict(sd)


def test_a_parameter_torch_never_stepped_starts_from_zeros():
    """torch keeps no state for a parameter that never had a gradient: loading such a state
    gives it zero moments (what this optimizer would hold for it) and the others theirs."""
    model = _model()
    _backward(model, _batches(1)[0])
    model[2].bias.grad = None
    ref = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref.step()
    assert 3 not in ref.state_dict()["state"]
    opt = AdamW(model.parameters())
    opt.load_state_dict(ref.state_dict())
    assert torch.equal(opt.state[model[2].bias]["exp_avg"], torch.zeros(3))
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], ref.state[model[0].weight]["exp_avg"])
    assert float(opt.state[model[2].bias]["step"]) == 1.0


def test_params_and_groups_are_checked_as_torch_checks_them():
    model = _model()
    with pytest.raises(TypeError, match="iterable of Tensors.*but got torch.FloatTensor"):
        AdamW(model[0].weight)
    with pytest.raises(TypeError, match="set"):
        AdamW([{"params": set(model.parameters())}])
    with pytest.raises(ValueError, match="not a leaf"):
        AdamW([model[0].weight * 2])
    with pytest.raises(ValueError, match="more than once"):
        AdamW([{"params": [model[0].weight]}, {"params": [model[0].weight]}])
    with pytest.raises(ValueError, match="named and some are not"):
        AdamW([{"params": [("w", model[0].weight)]}, {"params": [model[0].bias]}])
    with pytest.raises(ValueError, match=r"param group 1 sets \['momentum'\]"):
        AdamW([{"params": [model[0].weight]}, {"params": [model[0].bias], "momentum": 0.9}])
    with pytest.raises(TypeError, match="param-group dicts or a partition"):
        ft.TorchOptimizer(
            [{"params": [model[0].weight]}, {"params": [model[0].bias]}],
            ft.partition({"a": ft.sgd()}, lambda p: {k: "a" for k in p}),
        )
    with pytest.raises(ValueError, match="has no hyperparameters this optimizer can set"):
        ft.TorchOptimizer(
            [{"params": [model[0].weight]}, {"params": [model[0].bias], "lr": 0.1}],
            ft.scale(-0.1),
        )


def test_group_flags_build_their_own_transform_and_cannot_change():
    """A group's non-float argument (amsgrad, nesterov) builds its own transform (as torch's
    group would run); changing such a flag in ``param_groups`` later raises; a chain keeps its
    clip over every parameter (one global norm)."""
    start = _model()
    a, b = copy.deepcopy(start), copy.deepcopy(start)
    groups_a = [
        {"params": list(a[0].parameters()), "amsgrad": True},
        {"params": list(a[2].parameters())},
    ]
    groups_b = [
        {"params": list(b[0].parameters()), "amsgrad": True},
        {"params": list(b[2].parameters())},
    ]
    opt = AdamW(groups_a, lr=1e-2)
    ref = torch.optim.AdamW(groups_b, lr=1e-2)
    assert [g["amsgrad"] for g in opt.param_groups] == [True, False]
    batches = _batches(3)
    _train(a, opt, batches)
    _train(b, ref, batches)
    for p, q, s in zip(a.parameters(), b.parameters(), start.parameters()):
        torch.testing.assert_close(p - s, q - s, rtol=1e-5, atol=1e-7)
    assert "max_exp_avg_sq" in opt.state[a[0].weight]
    assert "max_exp_avg_sq" not in opt.state[a[2].weight]
    opt.param_groups[1]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['amsgrad'\] is True"):
        _train(a, opt, batches[:1])

    clipped = copy.deepcopy(start)
    tx = ft.chain(ft.clip_by_global_norm(0.05), ft.sgd(0.1))
    groups = [{"params": list(clipped[0].parameters())}, {"params": list(clipped[2].parameters())}]
    opt = ft.TorchOptimizer(groups, tx)
    whole = copy.deepcopy(start)
    ref = torch.optim.SGD(whole.parameters(), lr=0.1)
    for batch in batches:
        _backward(clipped, batch)
        opt.step()
        _backward(whole, batch)
        torch.nn.utils.clip_grad_norm_(whole.parameters(), 0.05)
        ref.step()
    for p, q in zip(clipped.parameters(), whole.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


# torch's error inputs this optimizer answers otherwise, on purpose: torch's kernels' limits on
# tensor hyperparameters (foreach / capturable, betas half tensors) do not apply here (no error),
# a leaf without a complex definition is a TypeError naming it (as every transform's is), and a
# parameter twice in one group is refused (torch warns that this will become an error)
_OTHERWISE = {
    "a param group cannot have duplicate parameters": ValueError,
    "lr as Tensor doesn't work with foreach & not capturable": None,
    "betas must be either both floats or both Tensors": None,
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True": None,
    "does not support complex parameters": TypeError,
}
ERROR_CASES = [
    pytest.param(name, e, id=f"{name}-{e.optimizer_error_input.desc[:40].replace(' ', '_')}")
    for name in OURS
    for e in _DB[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)
]


@pytest.mark.parametrize("name, error", ERROR_CASES)
def test_torchs_error_inputs_raise_the_same_error(name, error):
    """torch's ``optim_error_inputs_func`` cases (bad params, duplicates, names on some
    parameters only, a learning-rate tensor of two elements, betas or weight decay out of
    range...) raise the exception type torch raises, at construction or at the step, except the
    documented differences above."""
    inp = error.optimizer_error_input
    params = inp.params if inp.params is not None else [torch.nn.Parameter(torch.randn(2, 3))]
    want = _OTHERWISE.get(inp.desc, error.error_type)

    def run():
        opt = OURS[name](params, **_kw(inp.kwargs))
        if error.error_on == co.OptimizerErrorEnum.STEP_ERROR:
            for p in (p for g in opt.param_groups for p in g["params"]):
                p.grad = torch.rand_like(p)
            opt.step()

    if want is None:
        run()
    else:
        with pytest.raises(want):
            run()


@pytest.mark.parametrize("value", [float("nan"), -1e-3, float("inf")])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_bad_learning_rate_set_in_the_group_raises_at_the_step(value, as_tensor):
    """``param_groups[0]["lr"]`` set to NaN, a negative or an infinite value (a float, or a
    tensor as a scheduler fills it in place) raises at the next step, as construction would,
    and the parameters are untouched."""
    model = _model()
    opt = AdamW(model.parameters(), lr=torch.tensor(1e-3) if as_tensor else 1e-3)
    _train(model, opt, _batches(1))
    before = [p.detach().clone() for p in model.parameters()]
    if as_tensor:
        opt.param_groups[0]["lr"].fill_(value)
    else:
        opt.param_groups[0]["lr"] = value
    _backward(model, _batches(2)[1])
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] = .*learning_rate must"):
        opt.step()
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
