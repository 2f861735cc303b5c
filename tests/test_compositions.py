"""Wrappers and combinators composed in each other: ``ft.step`` (pure, donated, and compiled)
and the simulated data-axis sharding against ``update`` + ``apply_updates``.

Each wrapper is tested alone and in a few chains elsewhere (tests/test_fused_wrappers.py, the
sweep's variants); here they are nested the ways users nest them -- ``multi_steps`` around
``apply_if_finite`` and the other way round, combinators around wrappers, schedules and
injected hyperparameters inside, ``zero_redundancy`` outside or inside -- over steps with a NaN
gradient element and ``None`` gradients. In float64 the fused step is ``update`` +
``apply_updates`` to 1e-10 of the parameters (the same definitions, run fused or primitive by
primitive; NaN where NaN). ``ft.step`` of a nested ``apply_if_finite`` raised and a compiled
``multi_steps(apply_if_finite(...))`` did not trace until a guarded part's state had one
structure in and out (found this way).
"""

import pytest
import torch

import functional_train as ft
from _layouts import step_by_mode
from functional_train.testing.equivalence import assert_sharded_equivalent

_W = ("w0", "w1", "w2")
_B = ("b0", "b1", "b2")
MASK = {**{k: True for k in _W}, **{k: False for k in _B}, "s": False}
LABELS = {**{k: "a" for k in _W}, **{k: "b" for k in _B}, "s": "b"}


def _clip(c=0.5):
    return ft.clip_by_global_norm(c)


def _sched():
    return ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)


CASES = {
    "multi_steps(apply_if_finite(chain))": lambda: ft.multi_steps(
        ft.apply_if_finite(ft.chain(_clip(), ft.adamw(1e-2)), 3), 2
    ),
    "apply_if_finite(multi_steps(chain))": lambda: ft.apply_if_finite(
        ft.multi_steps(ft.chain(_clip(), ft.adamw(1e-2)), 2), 3
    ),
    "apply_if_finite(apply_if_finite(chain))": lambda: ft.apply_if_finite(
        ft.apply_if_finite(ft.chain(_clip(), ft.adamw(1e-2)), 1), 2
    ),
    "apply_if_finite(apply_if_finite(adamw))": lambda: ft.apply_if_finite(
        ft.apply_if_finite(ft.adamw(1e-2), 1), 2
    ),
    "multi_steps(apply_if_finite(adamw))": lambda: ft.multi_steps(
        ft.apply_if_finite(ft.adamw(1e-2), 1), 2
    ),
    "chain(multi_steps, ema_params)": lambda: ft.chain(
        ft.multi_steps(ft.chain(_clip(), ft.adamw(1e-2)), 2), ft.ema_params(0.9)
    ),
    "multi_steps(chain(clip, inject_hyperparams(adamw)))": lambda: ft.multi_steps(
        ft.chain(_clip(), ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2)), 2
    ),
    "inject_hyperparams(multi_steps)": lambda: ft.inject_hyperparams(
        lambda learning_rate: ft.multi_steps(ft.adamw(learning_rate), 2)
    )(learning_rate=1e-2),
    "multi_steps(partition of clips)": lambda: ft.multi_steps(
        ft.partition(
            {
                "a": ft.chain(_clip(), ft.adamw(1e-2)),
                "b": ft.chain(_clip(), ft.sgd(1e-2, momentum=0.9)),
            },
            LABELS,
        ),
        3,
    ),
    "partition(multi_steps, sgd)": lambda: ft.partition(
        {"a": ft.multi_steps(ft.chain(_clip(), ft.adamw(1e-2)), 2), "b": ft.sgd(1e-2)}, LABELS
    ),
    "partition(multi_steps, multi_steps)": lambda: ft.partition(
        {"a": ft.multi_steps(ft.adamw(1e-2), 2), "b": ft.multi_steps(ft.sgd(1e-2), 3)}, LABELS
    ),
    "masked(multi_steps)": lambda: ft.masked(ft.multi_steps(ft.adamw(1e-2), 2), MASK),
    "multi_steps(masked(lamb))": lambda: ft.multi_steps(ft.masked(ft.lamb(1e-2), MASK), 2),
    "partition(apply_if_finite, multi_steps)": lambda: ft.partition(
        {
            "a": ft.apply_if_finite(ft.chain(_clip(), ft.adamw(1e-2)), 2),
            "b": ft.multi_steps(ft.sgd(1e-2), 2),
        },
        LABELS,
    ),
    "partition(masked, apply_if_finite)": lambda: ft.partition(
        {
            "a": ft.masked(ft.chain(_clip(), ft.adamw(1e-2)), lambda p: {k: k != "w0" for k in p}),
            "b": ft.apply_if_finite(ft.sgd(1e-2, momentum=0.9), 1),
        },
        LABELS,
    ),
    "masked(partition)": lambda: ft.masked(
        ft.partition({"a": ft.adamw(1e-2), "b": ft.chain(_clip(), ft.sgd(1e-2))}, LABELS),
        {k: k != "b0" for k in LABELS},
    ),
    "apply_if_finite(chain(masked(clip), adamw))": lambda: ft.apply_if_finite(
        ft.chain(ft.masked(_clip(), MASK), ft.adamw(1e-2)), 2
    ),
    "multi_steps(apply_if_finite(partition))": lambda: ft.multi_steps(
        ft.apply_if_finite(
            ft.partition({"a": ft.chain(_clip(), ft.adamw(1e-2)), "b": ft.trace(0.9)}, LABELS),
            1,
        ),
        2,
    ),
    "apply_if_finite(apply_if_finite(partition))": lambda: ft.apply_if_finite(
        ft.apply_if_finite(
            ft.partition({"a": ft.chain(_clip(), ft.adamw(1e-2)), "b": ft.trace(0.9)}, LABELS),
            1,
        ),
        2,
    ),
    "chain(apply_if_finite(multi_steps), ema_params)": lambda: ft.chain(
        ft.apply_if_finite(ft.multi_steps(ft.adamw(1e-2), 2), 2), ft.ema_params(0.9)
    ),
    "named_chain(clip, apply_if_finite)": lambda: ft.named_chain(
        ("clip", _clip()), ("opt", ft.apply_if_finite(ft.adamw(1e-2), 2))
    ),
    "multi_steps(adamw(schedule))": lambda: ft.multi_steps(ft.adamw(_sched()), 2),
    "multi_steps(chain(clip, amsgrad))": lambda: ft.multi_steps(
        ft.chain(_clip(), ft.adam(1e-2, amsgrad=True)), 2
    ),
    "zero_redundancy(multi_steps)": lambda: ft.zero_redundancy(
        ft.multi_steps(ft.chain(_clip(), ft.adamw(1e-2)), 2)
    ),
    "multi_steps(zero_redundancy)": lambda: ft.multi_steps(
        ft.zero_redundancy(ft.chain(_clip(), ft.adamw(1e-2))), 2
    ),
}


def _problem(steps=7):
    """float64 leaves of 2, 1 and 0 dims; step 2 has a NaN element, steps 4 and 5 a None
    gradient each."""
    g = torch.Generator().manual_seed(0)
    shapes = {**{k: (16, 12) for k in _W}, **{k: (12,) for k in _B}, "s": ()}
    params = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    grads = []
    for t in range(steps):
        gt: dict = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
        if t == 2:
            gt["w1"][0, 0] = float("nan")
        if t == 4:
            gt["b2"] = None
        if t == 5:
            gt["s"] = None
        grads.append(gt)
    return params, grads


def _run(tx, params, grads, step):
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        p, state = step(tx, {k: None if v is None else v.clone() for k, v in g.items()}, state, p)
    return p


def _assert_same(got, want):
    for k in want:
        assert torch.equal(got[k].isnan(), want[k].isnan()), k
        torch.testing.assert_close(
            got[k].nan_to_num(0.0), want[k].nan_to_num(0.0), rtol=1e-10, atol=1e-12, msg=k
        )


def _by_update(tx, g, state, params):
    return step_by_mode(tx, g, state, params, "update")


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_step_equals_update(name, mode):
    """``ft.step`` == ``update`` + ``apply_updates`` (float64), NaN and None gradients
    included."""
    params, grads = _problem()
    want = _run(CASES[name](), params, grads, _by_update)
    got = _run(CASES[name](), params, grads, lambda tx, g, s, p: step_by_mode(tx, g, s, p, mode))
    _assert_same(got, want)


# (the nestings whose compiled form differs from the eager one: a compiled multi_steps guards
# its inner parts by a flag, as apply_if_finite does; two minutes for all 25 on 2 cores)
COMPILED = [
    "multi_steps(apply_if_finite(chain))",
    "apply_if_finite(multi_steps(chain))",
    "apply_if_finite(apply_if_finite(chain))",
    "multi_steps(apply_if_finite(adamw))",
    "multi_steps(partition of clips)",
    "partition(multi_steps, multi_steps)",
    "multi_steps(masked(lamb))",
    "multi_steps(apply_if_finite(partition))",
    "apply_if_finite(apply_if_finite(partition))",
    "chain(apply_if_finite(multi_steps), ema_params)",
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_step_equals_update(name, mode):
    """``torch.compile(ft.step, fullgraph=True)`` (dynamo's tracing; the stages are the
    library's operators whatever the backend) == eager ``update`` + ``apply_updates``."""
    params, grads = _problem()
    want = _run(CASES[name](), params, grads, _by_update)
    torch._dynamo.reset()
    tx = CASES[name]()
    compiled = torch.compile(
        lambda g, s, p: ft.step(tx, g, s, p, donate=mode == "donate"),
        backend="eager",
        fullgraph=True,
    )
    got = _run(tx, params, grads, lambda _tx, g, s, p: compiled(g, s, p))
    _assert_same(got, want)


# the data-axis layout of the sweep (tests/test_sweep.py's DATA_AXIS_*): Partial and
# replicated gradients, leaves sharded over tp and over dp x tp
_R, _S0, _S1 = (
    torch.distributed.tensor.Replicate(),
    torch.distributed.tensor.Shard(0),
    torch.distributed.tensor.Shard(1),
)
_PLACE = {
    "w0": [_R, _S0],
    "w1": [_R, _S1],
    "w2": [_S0, _S1],
    "b0": [_R, _S0],
    "b1": None,
    "b2": [_S0, _R],
    "s": None,
}
_GRAD_PLACE = {**_PLACE, "w1": [torch.distributed.tensor.Partial(), _S1]}


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize(
    "name",
    [
        "multi_steps(apply_if_finite(chain))",
        "apply_if_finite(apply_if_finite(chain))",
        "partition(multi_steps, multi_steps)",
        "multi_steps(masked(lamb))",
    ],
)
def test_sharded_step_equals_unsharded(name, mode):
    """``ft.step`` on a simulated (dp=2) x (tp=2) mesh with a data axis == unsharded, rank by
    rank (the accumulators hold each replica's own contribution, by design: not compared);
    sizes that do not divide the mesh."""
    g = torch.Generator().manual_seed(1)
    shapes = {"w0": (6, 5), "w1": (5, 7), "w2": (7, 6), "b0": (5,), "b1": (7,), "b2": (3,), "s": ()}
    params = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    grads = [
        {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
        for _ in range(3)
    ]
    tx = CASES[name]()
    assert_sharded_equivalent(
        tx,
        params,
        grads,
        placements=_PLACE,
        grad_placements=_GRAD_PLACE,
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data_axis="dp",
        rtol=1e-10,
        atol=1e-12,
        step=mode,
        ignore_state=lambda path: "acc_grads" in path,
    )
