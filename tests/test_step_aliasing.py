"""A pure ``ft.step`` (``donate=False``) modifies nothing, and nothing the caller still holds is
written by a later step: a leaf the pure step leaves as it was (a ``None`` gradient's parameter
and its state, the parameters and inner state of a ``multi_steps`` micro-step, an injected
hyperparameter) comes back as it is and is recorded as shared, and a later donated step copies a
shared tensor before writing into it (under ``torch.compile`` the pure step copies it)."""

from __future__ import annotations

import collections
from typing import NamedTuple

import optree
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import _sweep_registry as reg  # noqa: E402  (tests/ is on sys.path)
import functional_train as ft
from _layouts import shard  # noqa: E402
from functional_train.testing import on_rank, simulate

SHAPES = {"w": (4, 3), "m": (3, 5), "v": (5,), "t": (2, 3, 4)}


def _tree(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v, generator=gen) for k, v in SHAPES.items()}


def _tensors(tree) -> list:
    return [
        x
        for x in optree.tree_leaves(tree, none_is_leaf=True)
        if isinstance(x, torch.Tensor) and x.numel() > 0
    ]


def _local(x):
    return x._local_tensor if isinstance(x, DTensor) else x


def _clone(tree):
    return optree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True
    )


def _assert_bitwise(got, want, what: str) -> None:
    paths, a, _ = optree.tree_flatten_with_path(got, none_is_leaf=True)
    b = optree.tree_leaves(want, none_is_leaf=True)
    assert len(a) == len(b), what
    for path, x, y in zip(paths, a, b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {path} changed"


CASES = {
    "adamw": lambda: ft.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: ft.sgd(0.1, momentum=0.9),
    "clip_adamw": lambda: ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2)),
    "lamb": lambda: ft.lamb(1e-2, weight_decay=0.1),
    "adafactor": lambda: ft.adafactor(beta1=0.9, weight_decay=0.1),
    "multi_steps": lambda: ft.multi_steps(ft.adamw(1e-2), every_k=2),
    "inject_hyperparams": lambda: ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, b1=0.8),
    "galore_adamw": lambda: ft.galore_adamw(1e-2, rank=2, update_proj_gap=4),
}


@pytest.mark.parametrize("frozen", [("m",), ("w", "v", "t")], ids=["one_none", "three_none"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_donating_a_pure_steps_result_leaves_its_inputs_alone(name, frozen):
    """``p1, s1 = step(p0, s0)`` (pure, some gradients ``None``), then ``step(p1, s1,
    donate=True)`` with every gradient: ``p0`` and ``s0`` are bitwise what they were, and the
    donated step's numbers are the pure step's."""
    tx = CASES[name]()
    p0 = _tree(0)
    s0 = tx.init(p0)
    p0, s0 = ft.step(tx, _tree(1), s0, p0)  # (non-zero moments)
    want_p0, want_s0 = _clone(p0), _clone(s0)
    g1 = {k: None if k in frozen else v for k, v in _tree(2).items()}
    p1, s1 = ft.step(tx, g1, s0, p0)
    ref = ft.step(tx, _tree(3), _clone(s1), _clone(p1))  # (pure: the donated step's numbers)
    got = ft.step(tx, _tree(3), s1, p1, donate=True)
    _assert_bitwise(p0, want_p0, "p0")
    _assert_bitwise(s0, want_s0, "s0")
    # (the donated and the pure fused kernels round differently: the sweep's step tolerance)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_donating_the_inputs_of_a_pure_step_leaves_its_result_alone(name):
    """The other way round: ``p1, s1 = step(p0, s0)`` (pure, a ``None`` gradient), then the
    caller donates ``p0, s0`` to another step: ``p1`` and ``s1`` keep their values."""
    tx = CASES[name]()
    p0 = _tree(0)
    s0 = tx.init(p0)
    p0, s0 = ft.step(tx, _tree(1), s0, p0)
    p1, s1 = ft.step(tx, {**_tree(2), "m": None}, s0, p0)
    want_p1, want_s1 = _clone(p1), _clone(s1)
    ft.step(tx, _tree(3), s0, p0, donate=True)
    _assert_bitwise(p1, want_p1, "p1")
    _assert_bitwise(s1, want_s1, "s1")


@pytest.mark.parametrize("name", sorted(reg.all_entries()))
def test_a_pure_step_records_the_input_tensors_it_returns(name):
    """Every registry entry: after a pure step with one ``None`` gradient (and one with every
    gradient, and one with none), every tensor of the result that is a tensor of ``params`` or
    ``state`` is recorded as shared (what a later donated step copies first), and every
    parameter keeps ``requires_grad``; donating the result leaves the inputs bitwise as they
    were."""
    from functional_train.aliasing import is_shared

    tx = reg.all_entries()[name]()
    params = {k: v.requires_grad_(k == "m") for k, v in _tree(0).items()}
    state = tx.init(params)
    params, state = ft.step(tx, _tree(1), state, params)
    for g in ({**_tree(2), "m": None}, _tree(3), dict.fromkeys(SHAPES)):
        ids = set(map(id, _tensors((params, state))))
        new_p, new_s = ft.step(tx, g, state, params)
        unrecorded = [
            tuple(x.shape) for x in _tensors((new_p, new_s)) if id(x) in ids and not is_shared(x)
        ]
        assert not unrecorded, f"unrecorded input tensors of shapes {unrecorded} in the result"
        for k in SHAPES:
            assert new_p[k].requires_grad == params[k].requires_grad, k
        want = _clone((params, state))
        ft.step(tx, _tree(4), new_s, new_p, donate=True)
        _assert_bitwise((params, state), want, "(params, state)")
        params, state = ft.step(tx, g, state, params)


def test_records_of_tensors_gone_are_dropped():
    """The shared records hold no reference that keeps a tensor alive and grow with the
    tensors alive, not with the steps: in a loop of pure ``multi_steps`` steps (a cycle's last
    micro-step makes new parameters and moments, the next one records them) the records stay
    under twice a step's tensors plus the sweep's 4,096 and one step's (31 steps would have
    made ~18,000); a donated step drops every record of a tensor gone before it reads them
    (none of the loop's left once its results are dropped); a new tensor that takes a gone
    tensor's address is not shared."""
    from functional_train import aliasing
    from functional_train.aliasing import is_shared

    shapes = {f"k{i}": (2, 3) for i in range(400)}
    gen = torch.Generator().manual_seed(0)
    tx = ft.multi_steps(ft.adamw(1e-2), every_k=2)
    p = {k: torch.randn(v, generator=gen) for k, v in shapes.items()}
    s = tx.init(p)
    for _ in range(31):  # ~1,200 new tensors recorded every second step
        g = {k: torch.randn(v, generator=gen) for k, v in shapes.items()}
        p, s = ft.step(tx, g, s, p)
        # (a step's tensors: p, mu, nu, acc per leaf; records alive at a sweep, twice, plus
        # 4,096, plus one step's)
        assert len(aliasing._SHARED) <= 3 * 4 * len(shapes) + 4096
    assert any(is_shared(x) for x in _tensors(p))  # (the last step was a non-final micro-step)
    g = {k: torch.randn(v, generator=gen) for k, v in shapes.items()}
    p2, s2 = ft.step(tx, g, _clone(s), _clone(p), donate=True)  # (the records read, swept)
    assert all(r() is not None for r in aliasing._SHARED.values())
    del p, s, p2, s2
    q = _tree(0)
    ft.step(tx, _tree(1), tx.init(q), q, donate=True)
    # (no record of this test's trees left; other tests' results in this process may be alive)
    assert all(r() is not None for r in aliasing._SHARED.values())
    x = torch.randn(3)
    aliasing.mark_shared(x)
    gone = id(x)
    del x
    for _ in range(100):
        y = torch.randn(3)
        assert not is_shared(y), "a new tensor at a gone shared tensor's address"
        if id(y) == gone:
            break


def test_a_sweep_never_hides_a_live_record():
    """Another thread's donated step reads the records without a lock, and may read them at
    any moment of a sweep (the interpreter switches threads between bytecodes and at calls): at
    every builtin call's return inside ``_sweep``, every live shared tensor is still recorded
    (a sweep that cleared the dict and filled it again would have a donated step in that
    window write through a tensor the caller's older tree holds); and the gone tensors'
    records are dropped. Then for real: a thread reads the records while this one marks and
    sweeps, threads switched every microsecond (the sweep before this one missed records in
    about 1 of 10,000 reads)."""
    import sys
    import threading

    from functional_train import aliasing

    live = [torch.randn(3) for _ in range(50)]
    gone = [torch.randn(3) for _ in range(50)]
    aliasing.mark_shared_locals(live + gone)
    gone_ids = set(map(id, gone))
    del gone
    seen: list = []

    def check(frame, event, arg):
        if event == "c_return" and frame.f_code is aliasing._sweep.__code__:
            seen.append(all(aliasing._recorded(live)))

    with aliasing._WRITING:
        sys.setprofile(check)
        try:
            aliasing._sweep()
        finally:
            sys.setprofile(None)
    assert seen and all(seen)
    assert all(aliasing._recorded(live))
    assert not any(
        aliasing._SHARED.get(i) is not None and aliasing._SHARED[i]() is None for i in gone_ids
    )

    misses, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            misses.append(not all(aliasing._recorded(live)))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(100):
            junk = [torch.randn(1) for _ in range(500)]
            aliasing.mark_shared_locals(junk)
            del junk
            with aliasing._WRITING:
                aliasing._sweep()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert misses and not any(misses)


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


STATE_MOVES = {
    # name: (init(params) -> state, the new state from the old one, which of the new state's
    # tensors are the old state's: as paths into it)
    "kept_whole": (
        lambda p: (p["w"].clone(), {"x": p["m"].clone(), "y": [p["v"].clone()]}),
        lambda s: (s[0] + 1, s[1]),
        [(1, "x"), (1, "y", 0)],
    ),
    "dict_rebuilt": (
        lambda p: {"x": p["m"].clone(), "y": p["v"].clone()},
        lambda s: {"x": s["x"], "y": s["y"] + 1},
        [("x",)],
    ),
    "swapped": (
        lambda p: _Pair(p["v"].clone(), p["v"].clone() + 1),
        lambda s: _Pair(s.b, s.a),
        [(0,), (1,)],
    ),
    "moved_to_another_structure": (
        lambda p: (p["m"].clone(), p["v"].clone()),
        # (a tuple to a dict, and back: the step checked is the second, dict to tuple)
        lambda s: (
            {"kept": s[1], "new": s[0] * 2} if isinstance(s, tuple) else (s["new"] * 2, s["kept"])
        ),
        [(1,)],
    ),
    "ordered_dict": (
        lambda p: collections.OrderedDict(x=p["m"].clone(), y=p["v"].clone()),
        lambda s: collections.OrderedDict(x=s["x"] - 1, y=s["y"]),
        [("y",)],
    ),
}


@pytest.mark.parametrize("name", sorted(STATE_MOVES))
def test_a_users_state_is_recorded_wherever_its_tensors_go(name):
    """A user's optax-style transform (no engine) whose state keeps some of its tensors: as a
    whole subtree, in a rebuilt dict, swapped between fields, moved into another structure,
    in a node kind the step's walk leaves to optree. After a pure step every tensor of the new
    state that is a tensor of the old one is recorded as shared, wherever it went, and no new
    tensor is; in a chain with adamw, donating the result leaves the inputs bitwise as they
    were."""
    from functional_train.aliasing import is_shared

    init, move, kept = STATE_MOVES[name]

    def update(updates, state, params=None, **extra):
        return optree.tree_map(lambda g: 0.5 * g, updates), move(state)

    tx = ft.chain(ft.GradientTransformation(init, update), ft.adamw(1e-2))
    p0 = _tree(0)
    p0, s0 = ft.step(tx, _tree(1), tx.init(p0), p0)
    want = _clone((p0, s0))
    p1, s1 = ft.step(tx, _tree(2), s0, p0)
    olds = set(map(id, _tensors(s0[0])))
    for path in kept:
        x = s1[0]
        for k in path:
            x = x[k]
        assert id(x) in olds and is_shared(x), path
    fresh = [x for x in _tensors(s1[0]) if id(x) not in olds]
    assert not any(map(is_shared, fresh))
    ft.step(tx, _tree(3), s1, p1, donate=True)
    _assert_bitwise((p0, s0), want, "(p0, s0)")


def test_a_shared_tensor_is_copied_once():
    """A donated step copies a shared tensor (the unchanged ``m`` of a pure step with its
    gradient ``None``) before writing, and writes the copy in place from then on: the next
    donated step returns the same tensor objects it was given."""
    tx = ft.adamw(1e-2, weight_decay=0.1)
    p0 = _tree(0)
    p0, s0 = ft.step(tx, _tree(1), tx.init(p0), p0)
    p1, s1 = ft.step(tx, {**_tree(2), "m": None}, s0, p0)
    assert p1["m"] is p0["m"]
    p2, s2 = ft.step(tx, _tree(3), s1, p1, donate=True)
    assert p2["m"] is not p0["m"] and p2["w"] is p1["w"]
    p3, _ = ft.step(tx, _tree(4), s2, p2, donate=True)
    assert all(p3[k] is p2[k] for k in SHAPES)


class _Pair(NamedTuple):
    a: object
    b: object


@pytest.mark.parametrize(
    "where",
    [
        "dict",
        "list",
        "tuple",
        "namedtuple",
        "ordered_dict",
        "defaultdict",
        "deque",
        "deep",
        "parameters",
    ],
)
def test_claimed_finds_a_shared_tensor_wherever_it_is(where):
    """``claimed`` finds a recorded tensor in every kind of node a state may hold (its first
    check walks plain containers itself and hands other nodes to optree), among other
    tensors, and copies it: the copy in the tree it returns, the tensor itself untouched
    (``defaultdict`` and ``deque``: nodes of optree's that the check hands to optree)."""
    from functional_train import aliasing

    x, other = torch.ones(3), torch.zeros(2)
    if where == "parameters":  # (a container of a tensor subclass: see test_on_dtensors too)
        x, other = torch.nn.Parameter(x), torch.nn.Parameter(other)
    aliasing.mark_shared(x)
    tree = {
        "dict": {"a": other, "b": x, "c": None},
        "list": [other, None, x],
        "tuple": (other, x),
        "namedtuple": _Pair(other, x),
        "ordered_dict": collections.OrderedDict(a=other, b=x),
        "defaultdict": collections.defaultdict(list, a=other, b=x),
        "deque": collections.deque([other, x]),
        "deep": {"s": (_Pair(None, [other, {"k": x}]),)},
        "parameters": {"a": other, "b": x},
    }[where]
    got = aliasing.claimed((tree,), lambda t: t.detach().clone())[0]
    leaves = optree.tree_leaves(got, none_is_leaf=True)
    assert not any(leaf is x for leaf in leaves) and any(leaf is other for leaf in leaves)
    assert any(isinstance(v, torch.Tensor) and torch.equal(v, x) and v is not x for v in leaves)
    assert aliasing.claimed(({"a": other, "b": [None, other]},), torch.clone)[0]["a"] is other


def test_claimed_does_not_flatten_trees_without_a_shared_tensor(monkeypatch):
    """While another system's pure steps keep records alive (its unchanged leaves, shared),
    a donated ``multi_steps`` step whose trees hold none of them is not flattened for them
    (each flatten sorted every dict's keys: more than the rest of a micro-step's host time
    on a partition of two labels), and its steps stay exact."""
    from functional_train import aliasing

    def make():
        return ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2)), every_k=2)

    tx, other_tx = make(), make()
    p, q = _tree(0), _tree(0)
    s, t = tx.init(p), other_tx.init(q)
    ref_p, ref_s = _clone(p), tx.init(p)
    flattened = []
    real = aliasing.tree_flatten
    monkeypatch.setattr(aliasing, "tree_flatten", lambda x: flattened.append(1) or real(x))
    for k in range(4):
        q, t = ft.step(other_tx, _tree(10 + k), t, q)  # (pure: records its unchanged leaves)
        assert aliasing._SHARED
        p, s = ft.step(tx, _tree(10 + k), s, p, donate=True)
        u, ref_s = tx.update(_tree(10 + k), ref_s, ref_p)
        ref_p = ft.apply_updates(ref_p, u)
    assert flattened == []
    for key in SHAPES:
        torch.testing.assert_close(p[key], ref_p[key], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum", "lamb"])
def test_on_dtensors(name):
    """The same on DTensor leaves (2 simulated ranks, sharded and replicated): after a pure
    step with a ``None`` gradient, the local shards the result shares with the inputs are
    recorded, and donating the result leaves ``p0`` / ``s0`` alone on every rank."""
    from functional_train.aliasing import is_shared

    with simulate(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        placements = {"w": [Shard(0)], "m": [Shard(1)], "v": [Replicate()], "t": [Shard(2)]}

        def tree(seed):
            return {k: shard(v, mesh, placements[k]) for k, v in _tree(seed).items()}

        tx = CASES[name]()
        p0 = tree(0)
        p0, s0 = ft.step(tx, tree(1), tx.init(p0), p0)
        want = [on_rank(_local(x), r).clone() for x in _tensors((p0, s0)) for r in (0, 1)]
        p1, s1 = ft.step(tx, {**tree(2), "m": None, "t": None}, s0, p0)
        ins = set(map(id, map(_local, _tensors((p0, s0)))))
        shared = [_local(x) for x in _tensors((p1, s1)) if id(_local(x)) in ins]
        assert shared  # (m and t: their gradients are None)
        assert all(map(is_shared, shared))
        ft.step(tx, tree(3), s1, p1, donate=True)
        got = [on_rank(_local(x), r) for x in _tensors((p0, s0)) for r in (0, 1)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.slow
def test_compiled_pure_step_returns_none_of_its_input_tensors():
    """Under ``torch.compile(fullgraph=True)`` (a compiled graph hands an input back as the
    same object): the pure step's result holds no input tensor, donating it leaves ``p0`` /
    ``s0`` alone, and a new ``None`` gradient pattern aside, steps do not recompile."""
    import torch._dynamo

    torch._dynamo.reset()
    tx = CASES["sgd_momentum"]()
    fn = torch.compile(lambda g, s, p: ft.step(tx, g, s, p), backend="eager", fullgraph=True)
    p0 = _tree(0)
    s0 = tx.init(p0)
    for t in range(3):
        want = _clone((p0, s0))
        with torch._dynamo.config.patch(error_on_recompile=t > 0):
            p1, s1 = fn({**_tree(1 + t), "m": None}, s0, p0)
        ids = set(map(id, _tensors((p0, s0))))
        assert not [x for x in _tensors((p1, s1)) if id(x) in ids]
        p2, s2 = ft.step(tx, _tree(9), _clone(s1), _clone(p1))
        ft.step(tx, _tree(9), s1, p1, donate=True)
        _assert_bitwise((p0, s0), want, "(p0, s0)")
        p0, s0 = p2, s2
    torch._dynamo.reset()


@pytest.mark.slow
def test_eager_records_do_not_recompile_a_compiled_donated_step():
    """Records made and dropped by eager pure steps between the calls of a compiled donated
    step do not recompile it: it reads the mode (compiling: no records) before the records,
    where dynamo guarded on their keys and every record made or dropped recompiled it."""
    from torch._dynamo.testing import CompileCounter

    tx = ft.adamw(1e-2)
    counter = CompileCounter()
    torch._dynamo.reset()
    step = torch.compile(
        lambda g, s, p: ft.step(tx, g, s, p, donate=True), backend=counter, fullgraph=True
    )
    p = _tree(0)
    s = tx.init(p)
    for i in range(4):
        q = _tree(20 + i)  # (an eager pure step with a None gradient: records its new q's "m")
        kept = ft.step(tx, {**_tree(30 + i), "m": None}, tx.init(q), q)
        p, s = step(_tree(10 + i), s, p)
        del kept
    assert counter.frame_count == 1
