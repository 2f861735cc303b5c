"""``inject_hyperparams``: hyperparameters in the state, equal bit for bit to the aliases built
with the same numbers, settable between updates (``set_hyperparams`` and optax's in-place
idiom), schedules, the fused ``ft.step`` kernels, and a compiled step that does not recompile
when the learning rate changes."""

from __future__ import annotations

import pytest
import torch

import functional_train as ft


def _problem(steps=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(40, 30, generator=gen), "v": torch.randn(30, 8, generator=gen),
              "b": torch.randn(30, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
             for _ in range(steps)]
    return params, grads


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
        if mode == "update":
            u, state = tx.update(g, state, p)
            p = ft.apply_updates(p, u)
        else:
            p, state = ft.step(tx, g, state, p, donate=mode == "donate")
    return p, state


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", sorted(ALIASES))
def test_injected_equals_the_alias_bitwise(name, mode):
    factory, kw = ALIASES[name]
    params, grads = _problem()
    want_p, want_s = _run(factory(**kw), params, grads, mode)
    got_p, got_s = _run(ft.inject_hyperparams(factory)(**kw), params, grads, mode)
    for k in params:
        assert torch.equal(got_p[k], want_p[k]), k
    assert isinstance(got_s, ft.InjectHyperparamsState) and int(got_s.count) == len(grads)
    injected = {k for k, v in kw.items() if isinstance(v, float)}
    assert set(got_s.hyperparams) == injected
    for k in injected:
        h = got_s.hyperparams[k]
        assert h.dtype == torch.float64 and h.device.type == "cpu" and float(h) == kw[k]
    # (the inner state may hold one more counter: the injected learning rate is a schedule)
    got_leaves = [x for x in torch.utils._pytree.tree_leaves(got_s.inner_state)
                  if x is not None and x.ndim]
    want_leaves = [x for x in torch.utils._pytree.tree_leaves(want_s)
                   if x is not None and x.ndim]
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        assert torch.equal(a, b)


def _switch_schedule(before, after, at):
    return lambda c: torch.where(torch.as_tensor(c) < at, torch.tensor(before, dtype=torch.float64),
                                 torch.tensor(after, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["update", "pure"])
def test_set_learning_rate_between_steps_equals_a_schedule(mode):
    params, grads = _problem(steps=5)
    want, _ = _run(ft.adamw(_switch_schedule(1e-2, 3e-3, 2), weight_decay=0.1), params, grads,
                   mode)
    tx = ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, weight_decay=0.1)

    def between(t, s):
        return ft.set_hyperparams(s, learning_rate=3e-3) if t == 2 else s

    got, s = _run(tx, params, grads, mode, between)
    for k in params:
        assert torch.equal(got[k], want[k]), k
    assert float(ft.get_hyperparams(s)["learning_rate"]) == 3e-3


def test_optax_in_place_idiom_and_host_hyperparameters():
    """``state.hyperparams['b1'] = ...`` (optax's idiom) on a host-read hyperparameter: the
    alias is rebuilt with the new value from that step on, the moments carried over."""
    params, grads = _problem(steps=4)
    tx = ft.inject_hyperparams(ft.adam)(learning_rate=1e-2, b1=0.9)
    state, p = tx.init(params), dict(params)
    ref_state, q = ft.adam(1e-2, b1=0.9).init(params), dict(params)
    for t, g in enumerate(grads):
        if t == 2:
            state.hyperparams["b1"] = 0.5
        u, state = tx.update(g, state, p)
        p = ft.apply_updates(p, u)
        ref = ft.adam(1e-2, b1=0.9 if t < 2 else 0.5)
        r, ref_state = ref.update(g, ref_state, q)
        q = ft.apply_updates(q, r)
        for k in params:
            assert torch.equal(p[k], q[k]), (t, k)
    assert float(state.hyperparams["b1"]) == 0.5


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


def test_compiled_step_does_not_recompile_when_the_learning_rate_changes():
    torch._dynamo.reset()
    params, grads = _problem(steps=4)
    tx = ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, weight_decay=0.1)
    want, _ = _run(ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, weight_decay=0.1),
                   params, grads, "update",
                   lambda t, s: ft.set_hyperparams(s, learning_rate=1e-2 / (t + 1)))

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


def test_static_and_non_numeric_arguments_are_not_injected():
    tx = ft.inject_hyperparams(ft.adamw, static_args=("eps",))(
        1e-3, eps=1e-6, weight_decay=0.0, optim_bits=32, mask=ft.decay_mask)
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
