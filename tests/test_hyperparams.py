"""``inject_hyperparams``: hyperparameters in the state, equal bit for bit to the aliases built
with the same numbers, settable between updates (``set_hyperparams`` and optax's in-place
idiom), schedules, the fused ``ft.step`` kernels, and a compiled step that does not recompile
when the learning rate, b1, b2, eps, the weight decay or the momentum changes."""

from __future__ import annotations

import re
import sys

import optree
import pytest
import torch

import functional_train as ft
from _layouts import step_by_mode  # noqa: E402
from _spy import general_updates


def _problem(steps=4, seed=0, big=False):
    """A 2-D, a thin 2-D and a 1-D leaf; ``big``: leaves averaging over 64 KiB, where
    ``ft.step`` takes its per-leaf paths (came, galore_adamw)."""
    gen = torch.Generator().manual_seed(seed)
    (n, m), k = ((256, 128), 160) if big else ((40, 30), 8)
    params = {
        "w": torch.randn(n, m, generator=gen),
        "v": torch.randn(m, k, generator=gen),
        "b": torch.randn(m, generator=gen),
    }
    grads = [
        {k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(steps)
    ]
    return params, grads


# leaves of over 64 KiB on average: where ft.step's per-leaf came and galore_adamw steps run
BIG = {"came", "galore_adamw"}

ALIASES = {
    "sgd": (ft.sgd, dict(learning_rate=0.1, momentum=0.9, weight_decay=0.01)),
    "adam": (ft.adam, dict(learning_rate=1e-2, b1=0.8, amsgrad=True)),
    "adamw": (ft.adamw, dict(learning_rate=1e-2, weight_decay=0.1, eps=1e-7)),
    "adamw8bit": (ft.adamw, dict(learning_rate=1e-2, optim_bits=8, min_8bit_size=0)),
    "lamb": (ft.lamb, dict(learning_rate=1e-2, weight_decay=0.1)),
    "adafactor": (ft.adafactor, dict(learning_rate=1e-2, relative_step=False, beta1=0.9)),
    "came": (ft.came, dict(learning_rate=1e-2, weight_decay=0.1)),
    "galore_adamw": (ft.galore_adamw, dict(learning_rate=1e-2, rank=4, update_proj_gap=2)),
}


def _run(tx, params, grads, mode, between=None):
    state, p = tx.init(params), {k: v.clone() for k, v in params.items()}  # (donated)
    for t, g in enumerate(grads):
        g = {k: v.clone() for k, v in g.items()}
        if between is not None:
            state = between(t, state)
        p, state = step_by_mode(tx, g, state, p, mode)
    return p, state


def _fused_runs(monkeypatch):
    """A list that records, for each ``ft.step``, whether its fused kernels or per-leaf path
    ran (the step module's ``_run_fused`` returned a result)."""
    mod = sys.modules["functional_train.step"]
    run, seen = mod._run_fused, []

    def recorded(*args, **kwargs):
        out = run(*args, **kwargs)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(mod, "_run_fused", recorded)
    return seen


@pytest.mark.usefixtures("recognised_path")
@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", sorted(ALIASES))
def test_injected_equals_the_alias_bitwise(name, mode, monkeypatch):
    """Bit for bit the alias, states included; ``ft.step`` takes the alias' fused kernels or
    per-leaf path at the same steps (large leaves: came's and galore's per-leaf paths)."""
    factory, kw = ALIASES[name]
    params, grads = _problem(big=mode != "update" and name in BIG)
    fused = _fused_runs(monkeypatch)
    want_p, want_s = _run(factory(**kw), params, grads, mode)
    want_fused, fused[:] = list(fused), []
    got_p, got_s = _run(ft.inject_hyperparams(factory)(**kw), params, grads, mode)
    assert fused == want_fused
    if mode != "update" and name not in ("lamb", "adafactor", "adamw8bit"):
        # (lamb and 8-bit Adam have no fused step, adafactor with beta1 none)
        assert any(fused), "the alias' fused path never ran"
    for k in params:
        assert torch.equal(got_p[k], want_p[k]), k
    assert isinstance(got_s, ft.InjectHyperparamsState) and int(got_s.count) == len(grads)
    injected = {k for k, v in kw.items() if isinstance(v, float)}
    assert set(got_s.hyperparams) == injected
    for k in injected:
        h = got_s.hyperparams[k]
        assert h.dtype == torch.float64 and h.device.type == "cpu" and float(h) == kw[k]
    # (the inner state may hold one more counter: the injected learning rate is a schedule)
    got_leaves = [
        x for x in torch.utils._pytree.tree_leaves(got_s.inner_state) if x is not None and x.ndim
    ]
    want_leaves = [x for x in torch.utils._pytree.tree_leaves(want_s) if x is not None and x.ndim]
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        assert torch.equal(a, b)


def _switch_schedule(before, after, at):
    return lambda c: torch.where(
        torch.as_tensor(c) < at,
        torch.tensor(before, dtype=torch.float64),
        torch.tensor(after, dtype=torch.float64),
    )


@pytest.mark.parametrize("mode", ["update", "pure"])
def test_set_learning_rate_between_steps_equals_a_schedule(mode):
    params, grads = _problem(steps=5)
    want, _ = _run(ft.adamw(_switch_schedule(1e-2, 3e-3, 2), weight_decay=0.1), params, grads, mode)
    tx = ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, weight_decay=0.1)

    def between(t, s):
        return ft.set_hyperparams(s, learning_rate=3e-3) if t == 2 else s

    got, s = _run(tx, params, grads, mode, between)
    for k in params:
        assert torch.equal(got[k], want[k]), k
    assert float(ft.get_hyperparams(s)["learning_rate"]) == 3e-3


@pytest.mark.parametrize(
    "factory,name,kw",
    [
        (ft.adam, "b1", dict(learning_rate=1e-2, b1=0.9)),  # read as a tensor
        (ft.sgd, "dampening", dict(learning_rate=1e-2, momentum=0.9, dampening=0.9)),  # host read
    ],
    ids=["tensor", "host"],
)
def test_optax_in_place_idiom(factory, name, kw):
    """``state.hyperparams['b1'] = ...`` (optax's idiom): the alias takes the new value from
    that step on, the moments carried over (a host-read one by rebuilding the alias)."""
    params, grads = _problem(steps=4)
    tx = ft.inject_hyperparams(factory)(**kw)
    state, p = tx.init(params), dict(params)
    ref_state, q = factory(**kw).init(params), dict(params)
    for t, g in enumerate(grads):
        if t == 2:
            state.hyperparams[name] = 0.5
        u, state = tx.update(g, state, p)
        p = ft.apply_updates(p, u)
        ref = factory(**{**kw, name: kw[name] if t < 2 else 0.5})
        r, ref_state = ref.update(g, ref_state, q)
        q = ft.apply_updates(q, r)
        for k in params:
            assert torch.equal(p[k], q[k]), (t, k)
    assert float(state.hyperparams[name]) == 0.5


def test_injected_schedule_is_evaluated_and_logged():
    params, grads = _problem(steps=5)
    sched = ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 5, 1e-3)
    want, _ = _run(ft.adamw(sched), params, grads, "update")
    tx = ft.inject_hyperparams(ft.adamw)(learning_rate=sched)
    state, p = tx.init(params), dict(params)
    assert float(state.hyperparams["learning_rate"]) == float(sched(0))
    for t, g in enumerate(grads):
        u, state = tx.update(g, state, p)
        p = ft.apply_updates(p, u)
        assert float(state.hyperparams["learning_rate"]) == float(sched(t))  # used by step t
    for k in params:
        assert torch.equal(p[k], want[k])


@pytest.mark.parametrize("path", ["fused", "general"])
@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
def test_param_groups_injecting_one_schedule_evaluate_it_once_a_step(path, mode, monkeypatch):
    """A partition whose groups inject the same schedule (TorchOptimizer's param groups with
    a scheduler, written the optax way) evaluates it once per step, and each group's state
    holds the value as its own tensor: the numbers bit for bit those of groups with schedules
    of their own, evaluated per group."""
    if path == "general":
        general_updates(monkeypatch)
    params, grads = _problem(steps=5)
    base = ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 5, 1e-3)
    calls = []

    def sched(count):
        calls.append(int(count))
        return base(count)

    def groups(s1, s2):
        inject = ft.inject_hyperparams(ft.adamw)
        return ft.partition(
            {
                "a": inject(learning_rate=s1, weight_decay=0.1),
                "b": inject(learning_rate=s2, b1=0.8),
            },
            {"w": "a", "v": "b", "b": "b"},
        )

    def run(tx):
        state, p = tx.init(params), {k: v.clone() for k, v in params.items()}
        calls.clear()  # (init reads the schedules' first values)
        for g in grads:
            p, state = step_by_mode(tx, {k: v.clone() for k, v in g.items()}, state, p, mode)
        return p, state

    p, state = run(groups(sched, sched))
    assert calls == list(range(len(grads)))  # once a step, not once a group
    want, want_state = run(groups(base, lambda c: base(c)))
    for k in params:
        assert torch.equal(p[k], want[k]), k
    got_lr = [s.hyperparams["learning_rate"] for s in state.inner_states.values()]
    want_lr = [s.hyperparams["learning_rate"] for s in want_state.inner_states.values()]
    assert [float(x) for x in got_lr] == [float(x) for x in want_lr] == [float(base(4))] * 2
    assert got_lr[0].data_ptr() != got_lr[1].data_ptr()  # (each group's own tensor)


@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_param_groups_choose_their_fused_form_without_building_trees(mode, monkeypatch):
    """``inject_hyperparams`` chooses its fused form from its state alone
    (``Switch.reads_trees``), so a ``partition`` of injected groups (TorchOptimizer's param
    groups with a scheduler) builds no tree of each group's updates and parameters to choose
    it (four ``tree_unflatten`` calls a step, ~6% of a donated step's host time on 244 tiny
    leaves), and flattens the parameters once a step to choose it (its labels read from those
    leaves); and steps as ``update`` + ``apply_updates`` does."""
    from functional_train import combine

    params, grads = _problem(steps=3)
    sched = ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 5, 1e-3)
    inject = ft.inject_hyperparams(ft.adamw)
    tx = ft.chain(
        ft.clip_by_global_norm(1.0),
        ft.partition(
            {
                "a": inject(learning_rate=sched, weight_decay=0.1),
                "b": inject(learning_rate=sched, weight_decay=0.0),
            },
            {"w": "a", "v": "b", "b": "b"},
        ),
    )
    want, want_state = _run(tx, params, grads, "update")
    built, fused, flattened = [], [], []
    real = combine.tree_unflatten
    monkeypatch.setattr(combine, "tree_unflatten", lambda *a: built.append(1) or real(*a))
    flatten = combine.tree_flatten
    monkeypatch.setattr(combine, "tree_flatten", lambda t: flattened.append(t) or flatten(t))
    step_module = sys.modules["functional_train.step"]
    run = step_module._run_spec
    monkeypatch.setattr(step_module, "_run_spec", lambda *a: fused.append(1) or run(*a))
    got_state, got = tx.init(params), {k: v.clone() for k, v in params.items()}
    built.clear()  # (init builds each group's parameters)
    for g in grads:
        flattened.clear()
        p = got
        got, got_state = step_by_mode(
            tx, {k: v.clone() for k, v in g.items()}, got_state, got, mode
        )
        assert sum(t is p for t in flattened) == 1
    assert not built
    assert len(fused) == len(grads)  # (every step the fused stages)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    for a, b in zip(optree.tree_leaves(got_state), optree.tree_leaves(want_state)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_compiled_step_does_not_recompile_when_the_learning_rate_changes():
    torch._dynamo.reset()
    params, grads = _problem(steps=4)
    tx = ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, weight_decay=0.1)
    want, _ = _run(
        ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, weight_decay=0.1),
        params,
        grads,
        "update",
        lambda t, s: ft.set_hyperparams(s, learning_rate=1e-2 / (t + 1)),
    )

    @torch.compile(fullgraph=True)
    def train_step(g, s, p):
        u, s = tx.update(g, s, p)
        return ft.apply_updates(p, u), s

    state, p = tx.init(params), dict(params)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t, g in enumerate(grads):
            state = ft.set_hyperparams(state, learning_rate=1e-2 / (t + 1))
            p, state = train_step(g, state, p)
    for k in params:
        torch.testing.assert_close(p[k], want[k], rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()


@pytest.mark.parametrize("wrapper", ["apply_if_finite", "dynamic_loss_scale", "multi_steps"])
@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_a_wrapper_keeps_the_injected_count_where_it_keeps_the_inner_state(wrapper, mode):
    """``apply_if_finite`` and ``dynamic_loss_scale`` (a non-finite step) and ``multi_steps``
    (its non-final micro-steps) of a chain holding ``inject_hyperparams`` with a schedule:
    the fused ``ft.step`` (the wrapper's Switch chooses a fused form) keeps the count and
    the values where it keeps the inner state, as the general ``update`` does (optax's
    semantics; the
    fused step advanced them on a skipped step before session 44, and the schedule ran
    ahead of the updates). Parameters and every state leaf over 6 steps."""
    from functional_train.engine import elementwise as E

    sched = ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    inner = ft.chain(
        ft.clip_by_global_norm(1.0),
        ft.inject_hyperparams(ft.adamw)(learning_rate=sched, weight_decay=0.1),
    )
    if wrapper == "apply_if_finite":
        tx = ft.apply_if_finite(inner, max_consecutive_errors=3)
    elif wrapper == "dynamic_loss_scale":
        tx = ft.dynamic_loss_scale(inner, init_scale=2.0**3, growth_interval=2)
    else:
        tx = ft.multi_steps(inner, every_k=3)
    params, grads = _problem(steps=6)
    skips = wrapper != "multi_steps"
    if skips:
        grads[2]["w"][1, 2] = float("nan")  # (the third step skipped)
    switch = E.switch_of(tx)
    assert switch is not None and switch.choose(grads[0], tx.init(params), params, None)
    got, got_state = _run(tx, params, grads, mode)
    with pytest.MonkeyPatch.context() as m:
        general_updates(m)
        want, want_state = _run(tx, params, grads, "update")
    injected = ft.get_hyperparams(got_state)
    assert int(_inject_count(got_state)) == (5 if skips else 2)
    assert injected.keys() == ft.get_hyperparams(want_state).keys()
    for a, b in zip(optree.tree_leaves((got, got_state)), optree.tree_leaves((want, want_state))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("kind", ["chain", "named_chain", "partition", "multi_steps"])
def test_a_chain_holding_a_switch_updates_by_its_fused_form(kind, monkeypatch):
    """``update`` of a chain holding ``inject_hyperparams`` (in a ``partition``, as
    ``TorchOptimizer``'s param groups make it; or a ``multi_steps``) runs the chain's chosen
    fused form, one ``engine.elementwise.run`` per update (the transforms one by one ran a
    pass each), extra arguments given or not (optax's ``value``, which none of them reads),
    and equals the transforms' own updates run one after another to float rounding, over 6
    steps (the state too)."""
    from functional_train.engine import elementwise as E

    sched = ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    inject = ft.inject_hyperparams(ft.adamw)(learning_rate=sched, weight_decay=0.1)
    if kind == "partition":
        labels = {"w": "a", "v": "b", "b": "a"}
        inject = ft.partition({"a": inject, "b": ft.sgd(0.1, momentum=0.9)}, labels)
    elif kind == "multi_steps":
        inject = ft.multi_steps(inject, every_k=2)
    clip = ft.clip_by_global_norm(1.0)
    if kind == "named_chain":
        tx = ft.named_chain(("clip", clip), ("opt", inject))
    else:
        tx = ft.chain(clip, inject)
    params, grads = _problem(steps=6)
    if kind in ("chain", "named_chain"):  # (without params: the transform needing them says so)
        with pytest.raises(ValueError, match="add_decayed_weights needs params"):
            tx.update(grads[0], tx.init(params))
    runs: list = []
    run = E.run
    monkeypatch.setattr(E, "run", lambda *a, **k: runs.append(1) or run(*a, **k))
    state, p = tx.init(params), dict(params)
    cs, js, q = clip.init(params), inject.init(params), dict(params)
    for g in grads:
        del runs[:]
        u, state = tx.update(g, state, p, value=torch.tensor(0.5))  # (unread: see base.run_fused)
        assert len(runs) == 1
        p = ft.apply_updates(p, u)
        v, cs = clip.update(g, cs, q)
        v, js = inject.update(v, js, q)
        q = ft.apply_updates(q, v)
    for k in params:
        assert not torch.equal(p[k], params[k])
        torch.testing.assert_close(p[k], q[k], rtol=1e-6, atol=1e-7)
    want = (cs, js) if kind != "named_chain" else {"clip": cs, "opt": js}
    for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("wrapper", ["apply_if_finite", "dynamic_loss_scale"])
def test_a_wrapper_of_a_switch_updates_by_its_fused_form(wrapper, monkeypatch):
    """``update`` of ``apply_if_finite`` / ``dynamic_loss_scale`` around a chain holding
    ``inject_hyperparams`` runs the wrapper's chosen fused form (one
    ``engine.elementwise.run`` per update, where the general path runs the chain's and the
    wrapper's own passes), a non-finite step skipped, and equals the general ``update`` to
    float rounding over 6 steps, the parameters and every state leaf."""
    from functional_train.engine import elementwise as E

    sched = ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)

    def make():
        inner = ft.chain(
            ft.clip_by_global_norm(1.0),
            ft.inject_hyperparams(ft.adamw)(learning_rate=sched, weight_decay=0.1),
        )
        if wrapper == "apply_if_finite":
            return ft.apply_if_finite(inner, max_consecutive_errors=3)
        return ft.dynamic_loss_scale(inner, init_scale=2.0**3, growth_interval=2)

    params, grads = _problem(steps=6)
    grads[2]["w"][1, 2] = float("nan")
    with pytest.MonkeyPatch.context() as m:
        general_updates(m)
        want, want_state = _run(make(), params, grads, "update")
    runs: list = []
    run = E.run
    monkeypatch.setattr(E, "run", lambda *a, **k: runs.append(1) or run(*a, **k))
    got, got_state = _run(make(), params, grads, "update")
    assert len(runs) == len(grads)
    assert int(_inject_count(got_state)) == 5
    for a, b in zip(optree.tree_leaves((got, got_state)), optree.tree_leaves((want, want_state))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)


def _inject_count(state):
    """The count of the one ``InjectHyperparamsState`` in ``state``."""
    found = [
        s
        for s in optree.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, ft.hyperparams.InjectHyperparamsState)
        )
        if isinstance(s, ft.hyperparams.InjectHyperparamsState)
    ]
    assert len(found) == 1
    return found[0].count


def test_static_and_non_numeric_arguments_are_not_injected():
    tx = ft.inject_hyperparams(ft.adamw, static_args=("eps",))(
        1e-3, eps=1e-6, weight_decay=0.0, optim_bits=32, mask=ft.decay_mask
    )
    s = tx.init({"w": torch.zeros(4, 4), "b": torch.zeros(4)})
    # positional learning_rate injected; eps static; the int optim_bits and the mask callable not
    assert set(s.hyperparams) == {"learning_rate", "weight_decay"}


def test_bad_input():
    tx = ft.inject_hyperparams(ft.adamw)(learning_rate=1e-3)
    s = tx.init({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"no hyperparameter\(s\) \['b1'\]"):
        ft.set_hyperparams(s, b1=0.5)
    with pytest.raises(TypeError, match="learning_rate must be a real number"):
        ft.set_hyperparams(s, learning_rate="0.1")
    with pytest.raises(ValueError, match="one InjectHyperparamsState"):
        ft.set_hyperparams(ft.adamw().init({"w": torch.zeros(3)}), learning_rate=0.1)
    with pytest.raises(ValueError, match="InjectHyperparamsState"):
        tx.update({"w": torch.zeros(3)}, ft.adamw().init({"w": torch.zeros(3)}))
    with pytest.raises(ValueError, match="b1"):  # the alias' own check, on the initial values
        ft.inject_hyperparams(ft.adamw)(b1=1.5)
    with pytest.raises(TypeError):
        ft.inject_hyperparams(ft.adamw)(nonsense=1.0)
    with pytest.raises(TypeError, match="callable"):
        ft.inject_hyperparams(3)


# hyperparameters the aliases read as tensors at every update (no rebuild; compiled: graph inputs)
TENSOR_CASES = {
    "adam": (ft.adam, dict(learning_rate=1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05)),
    "adam_no_decay": (ft.adam, dict(learning_rate=1e-2, weight_decay=0.0)),  # (changed to 0.2)
    "sgd_dampening": (
        ft.sgd,
        dict(learning_rate=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01),
    ),  # (dampening changed to 0.3)
    "sgd_momentum_from_0": (ft.sgd, dict(learning_rate=0.1, momentum=0.0, weight_decay=0.01)),
    "adafactor": (
        ft.adafactor,
        dict(
            learning_rate=1e-2,
            relative_step=False,
            clip_threshold=1.0,
            decay_rate=-0.8,
            weight_decay=0.1,
        ),
    ),
    "adafactor_beta1": (
        ft.adafactor,
        dict(clip_threshold=1.0, decay_rate=-0.8, beta1=0.9, weight_decay=0.0, mask=ft.decay_mask),
    ),
    "galore_adamw": (
        ft.galore_adamw,
        dict(
            learning_rate=1e-2,
            b1=0.8,
            b2=0.99,
            eps=1e-6,
            weight_decay=0.1,
            scale=0.25,
            rank=4,
            update_proj_gap=3,
        ),
    ),
    "adamw_mask": (
        ft.adamw,
        dict(learning_rate=1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, mask=ft.decay_mask),
    ),
    "lamb": (ft.lamb, dict(learning_rate=1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)),
    "sgd_nesterov": (
        ft.sgd,
        dict(learning_rate=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    ),
    "muon": (ft.muon, dict(learning_rate=1e-2, beta=0.9, weight_decay=0.1, ns_dtype=torch.float32)),
    "came": (ft.came, dict(learning_rate=1e-2, weight_decay=0.1, clip_threshold=1.0)),
}
_CHANGED = {
    "b1": 0.6,
    "b2": 0.9,
    "eps": 1e-3,
    "weight_decay": 0.2,
    "momentum": 0.5,
    "beta": 0.7,
    "dampening": 0.3,
    "clip_threshold": 0.5,
    "decay_rate": -0.6,
    "beta1": 0.7,
    "scale": 0.5,
}


def _carried(state, tx, params, t):
    """``state`` for ``tx`` (an alias rebuilt with other numbers before step ``t``): the same,
    or where a weight decay set from 0 adds the decay's transform to a chain, ``tx``'s state
    with the old states in the places of their types (the decay's own fresh, its counter at
    ``t``: the injected decay has counted every step)."""
    fresh = tx.init(params)
    if not isinstance(state, tuple) or len(state) == len(fresh):
        return state
    old = list(state)
    out = []
    for s in fresh:
        if old and type(old[0]) is type(s):
            out.append(old.pop(0))
        else:
            out.append(
                s._replace(count=torch.full_like(s.count, t))
                if "count" in getattr(s, "_fields", ())
                else s
            )
    assert not old
    return type(fresh)(out)


def _changes(kw, t):
    """The values of step ``t``: each tensor hyperparameter moved at step 1, again at step 3."""
    out = {n: v for n, v in kw.items() if n in _CHANGED}
    if t >= 1:
        out = {n: _CHANGED[n] for n in out}
    if t >= 3:
        out = {n: v * 0.5 for n, v in out.items()}
    return out


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", sorted(TENSOR_CASES))
def test_tensor_hyperparameters_are_read_per_update(name, mode):
    """b1, b2, eps, weight decay and momentum reach the alias as tensors read at every update:
    changed between steps, the run equals the alias rebuilt with each step's numbers, bit for
    bit (update, pure and donated ``ft.step``: the fused kernels read them too), with no
    rebuild; the changes matter (the run differs from one without them)."""
    factory, kw = TENSOR_CASES[name]
    params, grads = _problem(steps=5, big=name in BIG)
    tx = ft.inject_hyperparams(factory)(**kw)
    got, _ = _run(tx, params, grads, mode, lambda t, s: ft.set_hyperparams(s, **_changes(kw, t)))
    ref_state, want = None, {k: v.clone() for k, v in params.items()}
    for t, g in enumerate(grads):
        ref = factory(**{**kw, **_changes(kw, t)})
        ref_state = ref.init(params) if ref_state is None else _carried(ref_state, ref, params, t)
        g = {k: v.clone() for k, v in g.items()}
        want, ref_state = step_by_mode(ref, g, ref_state, want, mode)
    unchanged, _ = _run(ft.inject_hyperparams(factory)(**kw), params, grads, mode)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert any(not torch.equal(got[k], unchanged[k]) for k in params)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,backend",
    [(n, "aot_eager") for n in sorted(TENSOR_CASES)]
    + [("adam", "inductor"), ("adafactor", "inductor")],
)  # (foreach and factored ops)
def test_compiled_step_does_not_recompile_when_tensor_hyperparameters_change(name, backend):
    """``torch.compile(ft.step, fullgraph=True)`` with b1, b2, eps, the weight decay and the
    momentum changed between steps: no recompile (``error_on_recompile``), the parameters of
    the eager pure ``ft.step`` to float rounding (to 1e-5 of the change; with inductor this
    fails if the transforms give the tensor to ``_foreach_add``, whose kernel torch 2.13's
    inductor compiles with the first value baked in); adam and adamw bit for bit: their
    compiled step calls the eager step's fused kernels through one operator, the injected
    values among its inputs. GaLore compiles a refresh step and another: its
    first two steps run before recompiles are errors (the values change again at step 3)."""
    factory, kw = TENSOR_CASES[name]
    warm = 0
    if name == "galore_adamw":
        kw, warm = {**kw, "update_proj_gap": 1000}, 2
    params, grads = _problem(steps=5)
    tx = ft.inject_hyperparams(factory)(**kw)

    def between(t, s):
        return ft.set_hyperparams(s, **_changes(kw, t))

    want, _ = _run(tx, params, grads, "pure", between)
    torch._dynamo.reset()
    step = torch.compile(lambda g, s, p: ft.step(tx, g, s, p), backend=backend, fullgraph=True)
    state, p = tx.init(params), dict(params)
    for t, g in enumerate(grads):
        with torch._dynamo.config.patch(error_on_recompile=t >= warm):
            p, state = step(g, between(t, state), p)
    torch._dynamo.reset()
    fused = factory is ft.adam or factory is ft.adamw
    for k in params:
        change = (want[k] - params[k]).abs().max()
        torch.testing.assert_close(
            p[k], want[k], rtol=0, atol=0 if fused else 1e-5 * float(change) + 1e-7
        )


def test_tensor_hyperparameters_are_checked_when_set():
    """A value out of the alias' range set between updates raises at the next update (eager),
    as the alias raises at construction. A host-read value of a factory of another library
    whose chain depends on it (sgd's momentum through a lambda) changed from 0: the update
    says why it cannot run."""
    params, grads = _problem(steps=1)
    tx = ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, b1=0.9, weight_decay=0.1)
    s = ft.set_hyperparams(tx.init(params), b1=1.5)
    with pytest.raises(ValueError, match="b1"):
        tx.update(grads[0], s, params)
    s = ft.set_hyperparams(tx.init(params), weight_decay=-1.0)
    with pytest.raises(ValueError, match="weight_decay"):
        ft.step(tx, grads[0], s, params)
    zero = ft.inject_hyperparams(
        lambda learning_rate, momentum: ft.sgd(learning_rate, momentum=momentum)
    )(learning_rate=0.1, momentum=0.0)
    s = zero.init(params)
    with pytest.raises(ValueError, match=r"host-read.*momentum.*another state"):
        ft.step(zero, grads[0], ft.set_hyperparams(s, momentum=0.5), params)


BAD_LEARNING_RATES = [
    (float("nan"), r"learning_rate must not be NaN, got nan"),
    (-1e-3, r"learning_rate must be >= 0.0, got -0.001"),
    (float("inf"), r"learning_rate must be finite, got inf"),
]


@pytest.mark.parametrize("bad, match", BAD_LEARNING_RATES)
@pytest.mark.parametrize("name", sorted(ALIASES))
def test_injected_learning_rate_is_checked_as_at_construction(name, bad, match):
    """A NaN, infinite or negative learning rate raises wherever it comes in: at
    ``inject_hyperparams`` construction the alias' own error; set later, the library's
    learning-rate check (finite, >= 0) at ``set_hyperparams`` (a number or a 0-dim tensor),
    and at the next update or step for a number put in the state by optax's idiom; the
    parameters are left alone, and a valid value (0 too: a warmup's start) trains on."""
    factory, kw = ALIASES[name]
    with pytest.raises(ValueError) as at_construction:
        factory(**{**kw, "learning_rate": bad})
    with pytest.raises(ValueError, match=re.escape(str(at_construction.value))):
        ft.inject_hyperparams(factory)(**{**kw, "learning_rate": bad})
    params, grads = _problem(steps=1)
    tx = ft.inject_hyperparams(factory)(**kw)
    state = tx.init(params)
    for value in (bad, torch.tensor(bad), torch.tensor(bad, dtype=torch.float32)):
        with pytest.raises(ValueError, match=rf"set_hyperparams: {match}"):
            ft.set_hyperparams(state, learning_rate=value)
    idiom = ft.set_hyperparams(state, learning_rate=1e-2)
    idiom.hyperparams["learning_rate"] = bad  # optax's in-place idiom
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(ValueError, match=rf"{factory.__name__}: {match}"):
        tx.update(grads[0], idiom, params)
    for donate in (False, True):
        with pytest.raises(ValueError, match=rf"{factory.__name__}: {match}"):
            ft.step(tx, grads[0], idiom, params, donate=donate)
    for k in params:
        assert torch.equal(params[k], before[k]), k
    # a valid value set afterwards trains on
    ok = ft.set_hyperparams(idiom, learning_rate=0.0)
    p, _ = ft.step(tx, grads[0], ok, params)
    assert all(torch.isfinite(v).all() for v in p.values())


@pytest.mark.parametrize("bad, match", BAD_LEARNING_RATES)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_torch_optimizer_learning_rate_set_in_its_group_is_checked(bad, match, as_tensor):
    """``param_groups[0]["lr"]`` set to a NaN, infinite or negative value (a float assigned, or
    the group's tensor filled in place as torch's schedulers do) raises at the next ``step()``
    with the value, and leaves the parameters and the state as they were (as torch.optim's
    "Invalid learning rate", which it raises at construction only)."""
    model = torch.nn.Linear(4, 3)
    lr = torch.tensor(1e-2, dtype=torch.float64) if as_tensor else 1e-2
    opt = ft.TorchOptimizer(model.named_parameters(), ft.adamw(lr, weight_decay=0.1))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    model(x).square().sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: v.clone() for n, v in d.items()} for k, d in opt.state_dict()["state"].items()}
    if as_tensor:
        opt.param_groups[0]["lr"].fill_(bad)
    else:
        opt.param_groups[0]["lr"] = bad
    with pytest.raises(ValueError, match=rf"learning_rate.*{match.split(', ')[-1]}"):
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    after = opt.state_dict()["state"]
    for k, d in state.items():
        for n, v in d.items():
            assert torch.equal(after[k][n], v), (k, n)
    if as_tensor:
        opt.param_groups[0]["lr"].fill_(1e-2)
    else:
        opt.param_groups[0]["lr"] = 1e-2
    opt.step()  # trains on once the value is valid again
    assert not torch.equal(next(model.parameters()).detach(), before[0])


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
def test_momentum_injected_as_0_and_set_later_follows_torch_sgd(mode):
    """sgd's momentum injected as 0 keeps a buffer that waits: set to 0.9 (dampening 0.3) at
    step 2, the parameters follow ``torch.optim.SGD`` whose ``param_groups`` get the same
    values at the same step (its buffer starts undamped then), to float32 rounding."""
    params, grads = _problem(steps=6)
    tx = ft.inject_hyperparams(ft.sgd)(
        learning_rate=0.1, momentum=0.0, dampening=0.3, weight_decay=0.01
    )

    def between(t, s):
        return ft.set_hyperparams(s, momentum=0.9) if t == 2 else s

    got, state = _run(tx, params, grads, mode, between)
    trace = state.inner_state[1]
    assert isinstance(trace, ft.TraceState) and int(trace.count) == 4  # steps with momentum
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.SGD(
        list(ref.values()), lr=0.1, momentum=0.0, dampening=0.3, weight_decay=0.01, foreach=False
    )
    for t, g in enumerate(grads):
        if t == 2:
            opt.param_groups[0]["momentum"] = 0.9
        for k, v in ref.items():
            v.grad = g[k].clone()
        opt.step()
    for k in params:
        change = (ref[k].detach() - params[k]).abs().max()
        torch.testing.assert_close(got[k], ref[k].detach(), rtol=0, atol=1e-6 * float(change))
