"""The sweep: every public transform and alias through the library's common properties.

The transforms come from ``functional_train.__all__`` through the registry
(``tests/_sweep_registry.py``): every public name is either swept, with a small builder, or
excluded with a reason, and ``test_registry_covers_every_public_name`` fails for a public name
in neither table, so a new transform is swept as soon as it exists. Each property is one test
function parametrised over the registry (``FACTORIES`` and ``VARIANTS``):

* ``sharded``: sharded == unsharded (``assert_sharded_equivalent`` on hypothesis-drawn meshes,
  placements with uneven and empty shards, pytrees, gradients, some leaves all-zero at some
  steps, 2-3 steps; both runs finite; the harness also checks that no input tree is modified in
  place, DTensor local shards included), and
  ``sharded_data_axis``: one deterministic case on a ``("dp", "tp")`` mesh with a data axis,
  ``Partial`` gradients and a leaf sharded over the data axis (zero gradients on two leaves at
  the last step; both runs finite);
* ``purity``: params, gradients and state bitwise unchanged by ``update``;
* ``state_structure`` / ``state_placements``: the state after updates has the treedef, shapes,
  dtypes and devices of ``init``'s (and, simulated sharded, the placements and local shapes);
* composition: inside ``chain``, ``named_chain``, ``multi_steps``, ``zero_redundancy``,
  ``partition`` and ``masked``, exactly the numbers of the transform alone;
* ``none_leaves``: a ``None`` gradient leaf comes out ``None`` and the other leaves get what a
  run without that leaf gives;
* ``bf16_states`` / ``bf16_close`` / ``update_dtype``: bfloat16 parameters keep float32 states,
  land within bf16 tolerance of the float32 run, and get bfloat16 updates (``update_dtype_f64``:
  float64 gradients get float64 updates);
* ``no_host_sync``: ``update`` issues no ``aten._local_scalar_dense`` / ``aten.item`` (nor the
  other host-reading ops listed below), except the documented CPU counter reads of the
  registry's ``HOST_COUNTER_READS``;
* ``compile``: ``torch.compile(update, fullgraph=True)`` gives eager's updates and states bit
  for bit (dynamo with the ``eager`` backend: the tracing is what breaks, and inductor is too
  slow for ~30 transforms on a small CPU machine; ``tests/test_compile.py`` runs a step through
  inductor; ``FT_SWEEP_COMPILE_BACKEND=aot_eager`` selects that backend here);
* ``step_counter``: every 0-dim int64 counter set to ``2**31 - 1`` and ``2**31 + 5`` goes up
  by exactly one, stays int64, and the update stays finite;
* ``step``: ``ft.step(tx, ...)`` pure and with ``donate=True`` gives the params and states of
  ``update`` + ``apply_updates`` (to float rounding where a fused kernel runs), and the pure step
  modifies no input; ``step_sharded``: the same sharded == unsharded check as
  ``sharded_data_axis`` through ``ft.step``, pure and donated;
* ``compile_dtensor``: ``torch.compile(ft.step, fullgraph=True)`` on DTensor leaves over 2 real
  gloo ranks equals the eager step (inductor for the optimizer aliases, dynamo's ``eager``
  backend for the other transforms; one spawned job for all of them,
  ``tests/_gloo_compile_worker.py``), and a changing schedule does not recompile.
* ``zero_grads``: the gradients a model gives the parts it did not use (``ZERO_SCHEDULE``: a leaf
  zero from init, zero after non-zero steps, values below every eps, zero rows, a zero
  parameter, a step zero on every leaf; and a whole tree zero from init): updates, states and
  parameters finite, ``ft.step`` == ``update``, and the parameters of the reference
  implementation where the registry has one (``REFERENCES``: torch.optim, transformers'
  Adafactor, came-pytorch, galore-torch, ``torch.nn.utils`` clipping, the LAMB equations);
  ``zero_grads_sharded``: the first step of those gradients sharded == unsharded on the
  data-axis layout, both runs finite (``sharded_data_axis``' last step and ``sharded``'s drawn
  cases have zero gradients after non-zero ones).

Properties that do not apply to a transform by design are skipped with the registry's reason
(``NOT_APPLICABLE``); library bugs found by the sweep are ``xfail(strict=True)`` with the
registry's reason (``KNOWN_BUGS``).

Everything runs on tiny trees (a 2-D, a wide 2-D, a 1-D, a 3-D and a 0-dim leaf) for 2-4
steps, so the module stays fast; the number of hypothesis examples follows the profile of
``tests/conftest.py`` (3 per transform in ``ci``).
"""

from __future__ import annotations

import inspect
import os
import zlib
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch._dynamo
from hypothesis import HealthCheck, Phase, example, find, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import _sweep_registry as reg  # noqa: E402  (tests/ is on sys.path)
import functional_train as ft
from _layouts import close, step_by_mode
from functional_train.testing import (
    ShardedCase,
    assert_sharded_equivalent,
    on_rank,
    replicated,
    sharded_cases,
    simulate,
)

ENTRIES = reg.all_entries()
# dynamo with the "eager" backend: tracing (graph breaks, guards, recompiles) is what this module
# checks for every transform; "aot_eager" (functionalisation, decompositions; about twice as slow)
# also gives eager's numbers bit for bit today: FT_SWEEP_COMPILE_BACKEND=aot_eager runs it
COMPILE_BACKEND = os.environ.get("FT_SWEEP_COMPILE_BACKEND", "eager")
S0, S1, R = Shard(0), Shard(1), Replicate()

# the tree every deterministic property runs on: a tall and a wide matrix (GaLore projects
# them on different sides), a vector, a 3-D leaf and a scalar
SHAPES = {"w": (4, 3), "m": (3, 5), "v": (5,), "t": (2, 3, 4), "s": ()}
STEPS = 3


def build(name: str) -> ft.GradientTransformation:
    return ENTRIES[name]()


def cases(prop: str) -> list:
    """The registry's entries as pytest params for ``prop``: left out where the property does
    not apply (the registry gives the reason), strict xfail where a library bug is known."""
    assert prop in reg.PROPERTIES, prop
    out = []
    for name in ENTRIES:
        marks = []
        key = (name, prop)
        if key in reg.NOT_APPLICABLE:
            continue
        if key in reg.KNOWN_BUGS:
            marks.append(pytest.mark.xfail(strict=True, reason=reg.KNOWN_BUGS[key]))
        out.append(pytest.param(name, id=name, marks=marks))
    return out


# =============================================================================================
# helpers
# =============================================================================================
def problem(
    steps: int = STEPS,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
    shapes: dict | None = None,
):
    """``(params, [grads per step])``: standard normal params, full-rank gradients."""
    shapes = SHAPES if shapes is None else shapes
    gen = torch.Generator().manual_seed(seed)

    def tree(s=1.0):
        return {
            k: (torch.randn(v, generator=gen, dtype=torch.float64) * s).to(dtype)
            for k, v in shapes.items()
        }

    return tree(), [tree(scale) for _ in range(steps)]


def clone_tree(tree: Any) -> Any:
    return optree.tree_map(
        lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True
    )


def walk(node: Any, path: tuple = ()):
    """``(dotted path, leaf)`` of a state tree, NamedTuple fields by name."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        for f in node._fields:
            yield from walk(getattr(node, f), path + (f,))
    elif isinstance(node, (list, tuple)):
        for i, x in enumerate(node):
            yield from walk(x, path + (str(i),))
    elif isinstance(node, dict):
        for k in sorted(node):  # optree's order: trees built in any key order walk alike
            yield from walk(node[k], path + (str(k),))
    else:
        yield ".".join(path) or "<root>", node


def map_state(fn: Callable[[str, Any], Any], node: Any, path: tuple = ()) -> Any:
    """``walk``'s leaves replaced by ``fn(path, leaf)``, the containers rebuilt."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*[map_state(fn, getattr(node, f), path + (f,)) for f in node._fields])
    if isinstance(node, (list, tuple)):
        return type(node)(map_state(fn, x, path + (str(i),)) for i, x in enumerate(node))
    if isinstance(node, dict):
        return type(node)((k, map_state(fn, x, path + (str(k),))) for k, x in node.items())
    return fn(".".join(path) or "<root>", node)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise_unchanged(before: Any, after: Any, what: str) -> None:
    """Same structure, and every tensor leaf holds the same bits (dtype and shape too)."""
    assert optree.tree_structure(before, none_is_leaf=True) == optree.tree_structure(
        after, none_is_leaf=True
    ), f"{what}: the tree structure changed"
    for (path, b), (_, a) in zip(walk(before), walk(after)):
        if not isinstance(b, torch.Tensor):
            continue
        if isinstance(b, DTensor):
            b, a = b._local_tensor, a._local_tensor
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}['{path}'] changed metadata"
        assert torch.equal(_bits(a), _bits(b)), f"{what}['{path}'] was modified in place"


def assert_trees_equal(
    got: Any, want: Any, what: str, *, rtol: float = 0.0, atol: float = 0.0
) -> None:
    """Same structure (NamedTuple types, dict keys, None leaves), dtypes, shapes and values
    (exactly by default)."""
    gt = optree.tree_structure(got, none_is_leaf=True)
    wt = optree.tree_structure(want, none_is_leaf=True)
    assert gt == wt, f"{what}: structure differs:\n  got  {gt}\n  want {wt}"
    for (path, g), (_, w) in zip(walk(got), walk(want)):
        if w is None or g is None:
            assert g is None and w is None, f"{what}['{path}']: got {g!r}, want {w!r}"
            continue
        if not isinstance(w, torch.Tensor):
            assert g == w, f"{what}['{path}']: got {g!r}, want {w!r}"
            continue
        assert g.dtype == w.dtype, f"{what}['{path}']: dtype {g.dtype}, want {w.dtype}"
        torch.testing.assert_close(
            g, w, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}['{path}']: {m}"
        )


def run(tx, params, grads_per_step, **kw):
    """``init`` then one ``update`` per step, applying the updates; returns ``(updates per
    step, states per step, final params)``."""
    state = tx.init(params)
    us, states = [], []
    for g in grads_per_step:
        u, state = tx.update(g, state, params, **kw)
        us.append(u)
        states.append(state)
        params = ft.apply_updates(params, u)
    return us, states, params


def subtree(tree: dict, keys) -> dict:
    return {k: tree[k] for k in keys}


# =============================================================================================
# the registry
# =============================================================================================
def _returns_transform(obj: Any) -> bool:
    """Whether ``obj`` is a function annotated to return a ``GradientTransformation``."""
    if not inspect.isfunction(obj):
        return False
    ann = obj.__annotations__.get("return")
    return "GradientTransformation" in (
        ann if isinstance(ann, str) else getattr(ann, "__name__", "")
    )


def test_registry_covers_every_public_name():
    """Every name of ``functional_train.__all__`` is swept or excluded with a reason (exactly
    one of the two), and nothing else is registered."""
    public = set(ft.__all__)
    swept, excluded = set(reg.FACTORIES), set(reg.EXCLUDED)
    missing = sorted(public - swept - excluded)
    assert not missing, (
        f"public names neither swept nor excluded: {missing}; add a builder to "
        "FACTORIES in tests/_sweep_registry.py (or a reason to EXCLUDED)"
    )
    both = sorted(swept & excluded)
    assert not both, f"names both swept and excluded: {both}"
    stale = sorted((swept | excluded) - public)
    assert not stale, f"registered names that are not public: {stale}"
    for name, why in reg.EXCLUDED.items():
        assert why.strip(), f"EXCLUDED['{name}'] needs a reason"


def test_registry_builders_and_exceptions_are_well_formed():
    for name in ENTRIES:
        tx = build(name)
        assert isinstance(tx, ft.GradientTransformation), name
        assert reg.base_name(name) in reg.FACTORIES, f"variant {name} of an unswept transform"
    # a function annotated to return a transform cannot hide in EXCLUDED
    for name in reg.EXCLUDED:
        assert not _returns_transform(getattr(ft, name)), (
            f"{name} returns a GradientTransformation: sweep it (FACTORIES), do not exclude it"
        )
    for name in reg.FACTORIES:
        assert _returns_transform(getattr(ft, name)), (
            f"FACTORIES['{name}'] is not a function annotated to return a GradientTransformation"
        )
    for table in (reg.NOT_APPLICABLE, reg.KNOWN_BUGS):
        for (name, prop), why in table.items():
            assert name in ENTRIES and prop in reg.PROPERTIES and why.strip(), (name, prop)
    assert not set(reg.NOT_APPLICABLE) & set(reg.KNOWN_BUGS)
    for name in (*reg.HOST_COUNTER_READS, *reg.COMPILE_GRAPH_BREAKS):
        assert name in ENTRIES, name


# =============================================================================================
# sharded == unsharded
# =============================================================================================
SHARDED_TOL = {  # (rtol, atol)
    "default": (1e-5, 1e-6),
    # factored statistics are sums in another order under sharding (and the data-axis mean of
    # Partial contributions), then normalised: a few float32 ulps, amplified over the steps
    "scale_by_factored_rms": (1e-4, 1e-5),
    "adafactor": (1e-4, 1e-5),
    "scale_by_came": (1e-4, 1e-5),
    "came": (1e-4, 1e-5),
}
MESH_NAMES = {1: ("dp",), 2: ("dp", "tp")}  # zero_redundancy shards its state over "dp"


def _tol(name: str) -> tuple:
    return SHARDED_TOL.get(name, SHARDED_TOL.get(reg.base_name(name), SHARDED_TOL["default"]))


def _ignore_state(name: str, data_axis: bool):
    if data_axis and reg.base_name(name) == "multi_steps":
        # under a data axis the accumulator holds each replica's own (unreduced) contribution,
        # by design (multi_steps issues no collective on non-final micro-steps)
        return lambda path: "acc_grads" in path
    return None


def _n_examples() -> int:
    # a fifth of the profile's examples per transform: 3 in "ci", 40 in "dev"
    return max(1, settings().max_examples // 5)


_SHARDED_CASES = sharded_cases(
    mesh_shapes=st.sampled_from([(2,), (3,), (2, 2)]),
    steps=st.integers(2, 3),
    max_leaves=3,
    sizes=(1, 2, 3, 5),
    max_numel=30,
    zero_grads=0.25,  # leaves without a gradient signal at a step (see test_zero_grads)
)


def _all_plain_case() -> ShardedCase:
    """An explicit example every transform gets: every leaf a plain tensor (no DTensor to find
    the mesh from, only the ``Mesh`` passed to update), sizes uneven over the mesh (2,), one
    leaf in a list (``blk.seq``: a placements tree holds a list there too)."""
    gen = torch.Generator().manual_seed(3)

    def tree():
        return {
            "w0": torch.randn(3, generator=gen),
            "blk": {"w1": torch.randn(2, 3, generator=gen), "seq": [torch.randn(5, generator=gen)]},
        }

    return ShardedCase(
        params=tree(),
        grads_per_step=[tree(), tree()],
        mesh_shape=(2,),
        placements={"w0": None, "blk": {"w1": None, "seq": [None]}},
        leaves=[
            ("w0", (3,), torch.float32, None),
            ("blk.w1", (2, 3), torch.float32, None),
            ("blk.seq.0", (5,), torch.float32, None),
        ],
        seed=3,
        grad_rank=None,
        grad_scale=1.0,
        frozen=None,
    )


@pytest.mark.parametrize("name", cases("sharded"))
def test_sharded(name):
    rtol, atol = _tol(name)
    expect_failure = (name, "sharded") in reg.KNOWN_BUGS

    @settings(
        max_examples=_n_examples(),
        database=None,
        phases=([Phase.explicit, Phase.generate] if expect_failure else list(settings().phases)),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=_SHARDED_CASES)
    @example(case=_all_plain_case())
    def check(case):
        run = lambda: assert_sharded_equivalent(  # noqa: E731
            build(name),
            mesh_dim_names=MESH_NAMES[len(case.mesh_shape)],
            rtol=rtol,
            atol=atol,
            finite=True,
            **case,
        )
        # (every leaf plain, read from the case's per-leaf list: a walk of the placements
        # tree cannot tell a list of leaves, ``blk.seq``, from one leaf's placements)
        if name in reg.NEEDS_A_DTENSOR and all(pl is None for *_, pl in case.leaves):
            with pytest.raises(ValueError, match=reg.NEEDS_A_DTENSOR[name]):
                run()
            return
        run()

    if settings().derandomize:  # reproducible, but a different stream of cases per transform
        check = hypothesis_seed(zlib.crc32(name.encode()))(check)
    check()


# the data-axis layout on a ("dp", "tp") mesh of 2 x 2: plain leaves (their gradients are
# per-replica contributions that average to the given gradient), a Partial-over-dp gradient
# (contributions that sum), a leaf replicated over dp and sharded over tp (uneven), one sharded
# over both (FSDP-style over dp, Shard(-1) over tp)
DATA_AXIS_PARAMS = {"w": [R, S0], "m": [R, S1], "v": None, "t": [S0, Shard(-1)], "s": None}
DATA_AXIS_GRADS = {"w": [R, S0], "m": [Partial(), S1], "v": None, "t": [S0, Shard(-1)], "s": None}


@pytest.mark.parametrize("name", cases("sharded_data_axis"))
def test_sharded_data_axis(name):
    """Sharded == unsharded on the data-axis layout over 3 steps, both runs finite; at the last
    step the Partial ``m`` and the plain ``v`` get zero gradients after non-zero ones (a
    non-zero state, every replica's contribution zero; see ``test_zero_grads``)."""
    params, grads = problem(3, seed=1)
    grads[2] = {**grads[2], "m": torch.zeros_like(grads[2]["m"]), "v": torch.zeros(5)}
    _assert_data_axis_equivalent(name, params, grads)


def _assert_data_axis_equivalent(name, params, grads):
    """``name``'s run on the (dp=2, tp=2) data-axis layout equals one process's, finite."""
    rtol, atol = _tol(name)
    assert_sharded_equivalent(
        build(name),
        params,
        grads,
        placements=DATA_AXIS_PARAMS,
        grad_placements=DATA_AXIS_GRADS,
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data_axis="dp",
        rtol=rtol,
        atol=atol,
        ignore_state=_ignore_state(name, data_axis=True),
        finite=True,
    )


# =============================================================================================
# purity, state structure
# =============================================================================================
@pytest.mark.parametrize("name", cases("purity"))
def test_purity(name):
    tx = build(name)
    params, grads = problem()
    snap = clone_tree(params)
    state = tx.init(params)
    assert_bitwise_unchanged(snap, params, "params (after init)")
    for t, g in enumerate(grads):
        before = clone_tree((params, g, state))
        updates, new_state = tx.update(g, state, params)
        assert_bitwise_unchanged(before[0], params, f"step {t}: params")
        assert_bitwise_unchanged(before[1], g, f"step {t}: grads")
        assert_bitwise_unchanged(before[2], state, f"step {t}: state")
        params, state = ft.apply_updates(params, updates), new_state


def _spec(x: Any):
    if x is None:
        return None
    assert isinstance(x, torch.Tensor), f"a state leaf is a {type(x).__name__}, not a tensor"
    if isinstance(x, DTensor):
        loc = x._local_tensor
        world = torch.distributed.get_world_size()
        return (
            "DTensor",
            tuple(x.shape),
            x.dtype,
            tuple(x.placements),
            x.device_mesh.mesh_dim_names,
            tuple(x.device_mesh.shape),
            tuple(tuple(on_rank(loc, r).shape) for r in range(world)),
        )
    return ("Tensor", tuple(x.shape), x.dtype, x.device.type)


def assert_same_structure(init: Any, later: Any, what: str) -> None:
    ti = optree.tree_structure(init, none_is_leaf=True)
    tl = optree.tree_structure(later, none_is_leaf=True)
    assert ti == tl, f"{what}: the state structure changed:\n  init  {ti}\n  later {tl}"
    bad = [
        f"state['{path}'] was {_spec(a)} after init, is {_spec(b)}"
        for (path, a), (_, b) in zip(walk(init), walk(later))
        if _spec(a) != _spec(b)
    ]
    assert not bad, f"{what}: " + "; ".join(bad)


@pytest.mark.parametrize("name", cases("state_structure"))
def test_state_structure(name):
    tx = build(name)
    params, grads = problem()
    init = tx.init(params)
    _, states, _ = run(tx, params, grads)
    for t, s in enumerate(states):
        assert_same_structure(init, s, f"step {t}")


@pytest.mark.parametrize("name", cases("torch_load"))
def test_torch_load(name, tmp_path):
    """torch.save of the state after two updates, then plain torch.load (weights_only=True,
    torch's default): the same types, structure and values, and the loaded state goes on."""
    tx = build(name)
    params, grads = problem()
    _, states, p = run(tx, params, grads[:2])
    torch.save(states[-1], tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert optree.tree_structure(loaded, none_is_leaf=True) == optree.tree_structure(
        states[-1], none_is_leaf=True
    )
    for a, b in zip(
        optree.tree_leaves(loaded, none_is_leaf=True),
        optree.tree_leaves(states[-1], none_is_leaf=True),
    ):
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b
    assert len(grads) > 2
    u1, _ = tx.update(grads[2], loaded, p)
    u2, _ = tx.update(grads[2], states[-1], p)
    for a, b in zip(
        optree.tree_leaves(u1, none_is_leaf=True), optree.tree_leaves(u2, none_is_leaf=True)
    ):
        assert (a is None and b is None) or torch.equal(a, b)


# simulated sharded layout for the placements check (mesh 2 x 2, ("dp", "tp")): uneven, nested
# and plain leaves
PLACEMENT_LAYOUT = {"w": [S0, S1], "m": [R, S1], "v": [S0, S0], "t": [R, Shard(-1)], "s": None}


@pytest.mark.parametrize("name", cases("state_placements"))
def test_state_placements(name):
    tx = build(name)
    params, grads = problem(2)
    with simulate(4):
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def lay(tree):
            return {
                k: replicated(4, x)
                if PLACEMENT_LAYOUT[k] is None
                else distribute_tensor(
                    replicated(4, x), dm, PLACEMENT_LAYOUT[k], src_data_rank=None
                )
                for k, x in tree.items()
            }

        dparams = lay(params)
        init = tx.init(dparams)
        _, states, _ = run(tx, dparams, [lay(g) for g in grads], mesh=ft.Mesh(dm))
        for t, s in enumerate(states):
            assert_same_structure(init, s, f"sharded step {t}")


def test_purity_and_structure_checks_catch_bugs():
    """(the checks work) an update that scales its gradients in place, or that returns a state
    leaf in another dtype than init's, is caught."""
    params, grads = problem(1)

    def scales_in_place(updates, state, params=None, **kw):
        for x in updates.values():
            x.mul_(0.5)
        return updates, state

    before = clone_tree(grads[0])
    scales_in_place(grads[0], None)
    with pytest.raises(AssertionError, match=r"grads\['m'\] was modified in place"):
        assert_bitwise_unchanged(before, grads[0], "grads")
    init_state = ft.TraceState(torch.zeros((), dtype=torch.int64), {"s": torch.zeros(())})
    later = ft.TraceState(
        torch.ones((), dtype=torch.int64), {"s": torch.zeros((), dtype=torch.float64)}
    )
    with pytest.raises(AssertionError, match=r"state\['trace.s'\] was .*float32.* is .*float64"):
        assert_same_structure(init_state, later, "step 0")


# =============================================================================================
# composition
# =============================================================================================
def _clip_then(tx, params, grads):
    """The reference of the chain properties: ``clip_by_global_norm(1.0)`` then ``tx``, by
    hand."""
    clip = ft.clip_by_global_norm(1.0)
    sc, st_ = clip.init(params), tx.init(params)
    out = []
    for g in grads:
        c, sc = clip.update(g, sc, params)
        u, st_ = tx.update(c, st_, params)
        out.append((u, sc, st_))
        params = ft.apply_updates(params, u)
    return out


@pytest.mark.parametrize("name", cases("chain"))
def test_chain(name):
    params, grads = problem(scale=3.0)  # global norms well above 1: the clip acts
    want = _clip_then(build(name), params, grads)
    us, states, _ = run(ft.chain(ft.clip_by_global_norm(1.0), build(name)), params, grads)
    for t, (u, s, (wu, wsc, wst)) in enumerate(zip(us, states, want)):
        assert_trees_equal(u, wu, f"step {t}: updates")
        assert_trees_equal(s, (wsc, wst), f"step {t}: state")


@pytest.mark.parametrize("name", cases("named_chain"))
def test_named_chain(name):
    params, grads = problem(scale=3.0)
    want = _clip_then(build(name), params, grads)
    tx = ft.named_chain(("clip", ft.clip_by_global_norm(1.0)), ("tx", build(name)))
    us, states, _ = run(tx, params, grads)
    for t, (u, s, (wu, wsc, wst)) in enumerate(zip(us, states, want)):
        assert_trees_equal(u, wu, f"step {t}: updates")
        assert_trees_equal(s, {"clip": wsc, "tx": wst}, f"step {t}: state")


@pytest.mark.parametrize("name", cases("multi_steps"))
def test_multi_steps(name):
    """``multi_steps(T, 2)`` over 4 micro-steps == ``T`` over the 2 mean gradients; the
    non-final micro-steps return zeros shaped like the params."""
    params, micro = problem(4)
    tx, ms = build(name), ft.multi_steps(build(name), every_k=2)
    s, ref_s = ms.init(params), tx.init(params)
    p, ref_p = params, params
    for k in range(2):
        g1, g2 = micro[2 * k], micro[2 * k + 1]
        u1, s = ms.update(g1, s, p)
        for path, z in walk(u1):
            assert z is not None and not z.any(), f"micro-step {2 * k}: update['{path}'] != 0"
            assert z.shape == p[path].shape and z.dtype == g1[path].dtype, path
        p = ft.apply_updates(p, u1)
        u2, s = ms.update(g2, s, p)
        mean = {key: (g1[key] + g2[key]) / 2.0 for key in g1}
        ref_u, ref_s = tx.update(mean, ref_s, ref_p)
        assert_trees_equal(u2, ref_u, f"step {k}: updates")
        assert_trees_equal(s.inner_state, ref_s, f"step {k}: inner state")
        assert int(s.mini_step) == 0 and int(s.gradient_step) == k + 1
        p, ref_p = ft.apply_updates(p, u2), ft.apply_updates(ref_p, ref_u)


@pytest.mark.parametrize("name", cases("zero_redundancy"))
def test_zero_redundancy(name):
    """One process (no mesh): ``zero_redundancy(T)`` is ``T``."""
    params, grads = problem()
    want_u, want_s, _ = run(build(name), params, grads)
    us, states, _ = run(ft.zero_redundancy(build(name)), params, grads)
    for t in range(len(grads)):
        assert_trees_equal(us[t], want_u[t], f"step {t}: updates")
        assert_trees_equal(states[t].inner_state, want_s[t], f"step {t}: inner state")


@pytest.mark.parametrize("name", cases("zero_redundancy_dp"))
def test_zero_redundancy_dp(name):
    """``zero_redundancy(T)`` on the simulated data-axis layout (``dp`` x ``tp`` = 2 x 2, plain,
    Partial, tensor parallel and FSDP leaves; see ``test_sharded_data_axis``) == ``T``
    unsharded: ``T`` runs on the dp-sharded zero views and its state holds 1/dp of each leaf."""
    rtol, atol = _tol(name)
    params, grads = problem(2, seed=2)
    assert_sharded_equivalent(
        ft.zero_redundancy(build(name)),
        params,
        grads,
        placements=DATA_AXIS_PARAMS,
        grad_placements=DATA_AXIS_GRADS,
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data_axis="dp",
        rtol=rtol,
        atol=atol,
        ignore_state=_ignore_state(name, True),
    )


# "a": the transform under test (a tall matrix, a vector and the 3-D leaf), "b": sgd
SPLIT = {"w": "a", "m": "b", "v": "a", "t": "a", "s": "b"}
A_KEYS = [k for k, v in SPLIT.items() if v == "a"]
B_KEYS = [k for k, v in SPLIT.items() if v == "b"]


@pytest.mark.parametrize("name", cases("partition"))
def test_partition(name):
    """``partition({"a": T, "b": sgd})`` == ``T`` on a tree of the "a" leaves only, and sgd on
    the "b" ones."""
    params, grads = problem()
    tx = ft.partition({"a": build(name), "b": ft.sgd(0.1)}, dict(SPLIT))
    us, _, _ = run(tx, params, grads)
    ua, _, _ = run(build(name), subtree(params, A_KEYS), [subtree(g, A_KEYS) for g in grads])
    ub, _, _ = run(ft.sgd(0.1), subtree(params, B_KEYS), [subtree(g, B_KEYS) for g in grads])
    for t in range(len(grads)):
        assert_trees_equal(subtree(us[t], A_KEYS), ua[t], f"step {t}: 'a' updates")
        assert_trees_equal(subtree(us[t], B_KEYS), ub[t], f"step {t}: 'b' updates")


@pytest.mark.parametrize("name", cases("masked"))
def test_masked(name):
    """``masked(T, mask)`` == ``T`` on a tree of the masked-in leaves; the others pass through
    unchanged."""
    params, grads = problem()
    us, _, _ = run(ft.masked(build(name), {k: v == "a" for k, v in SPLIT.items()}), params, grads)
    ua, _, _ = run(build(name), subtree(params, A_KEYS), [subtree(g, A_KEYS) for g in grads])
    for t in range(len(grads)):
        assert_trees_equal(subtree(us[t], A_KEYS), ua[t], f"step {t}: masked-in updates")
        for k in B_KEYS:
            assert us[t][k] is grads[t][k] or torch.equal(us[t][k], grads[t][k]), k


# =============================================================================================
# None gradient leaves
# =============================================================================================
@pytest.mark.parametrize("name", cases("none_leaves"))
@pytest.mark.parametrize("frozen", ["m", "v"])
def test_none_leaves(name, frozen):
    """A frozen parameter (``None`` gradient at every step) gets ``None`` updates, and the other
    leaves get exactly what a run on the tree without that parameter gives."""
    params, grads = problem()
    keep = [k for k in SHAPES if k != frozen]
    us, _, _ = run(build(name), params, [{**g, frozen: None} for g in grads])
    want, _, _ = run(build(name), subtree(params, keep), [subtree(g, keep) for g in grads])
    for t in range(len(grads)):
        assert us[t][frozen] is None, f"step {t}: the frozen leaf's update is not None"
        assert_trees_equal(subtree(us[t], keep), want[t], f"step {t}: updates")


# =============================================================================================
# bfloat16
# =============================================================================================
# leaves that may legitimately be non-float in a state: int64 counters, uint8 8-bit codes, bool
# flags (apply_if_finite's last_finite, zero_nans' found_nan)
STATE_INT_DTYPES = (torch.int64, torch.uint8, torch.bool)


def assert_float32_states(state: Any, what: str) -> None:
    for path, x in walk(state):
        if x is None or path.startswith("hyperparams.") or ".hyperparams." in path:
            continue  # inject_hyperparams' values: float64 CPU tensors by design
        if x.dtype.is_floating_point:
            assert x.dtype == torch.float32, f"{what}: state['{path}'] is {x.dtype}"
        else:
            assert x.dtype in STATE_INT_DTYPES, f"{what}: state['{path}'] is {x.dtype}"


MIXED_DTYPES = {
    "w": torch.float32,
    "m": torch.float64,
    "v": torch.float64,
    "t": torch.float32,
    "s": torch.float64,
}


@pytest.mark.parametrize("name", cases("mixed_dtypes"))
def test_mixed_dtypes(name):
    """A tree of float32 and float64 leaves: each leaf's updates equal the transform run on that
    leaf alone, bit for bit, at every step. Nothing computed for one leaf (a bias correction,
    an RMS, a trust ratio) is rounded to another leaf's dtype or widened because of it."""
    params, grads = problem()
    mixed = lambda tree: {k: x.to(MIXED_DTYPES[k]) for k, x in tree.items()}  # noqa: E731
    params, grads = mixed(params), [mixed(g) for g in grads]
    whole, _, _ = run(build(name), params, grads)
    for k in params:
        alone, _, _ = run(build(name), subtree(params, [k]), [subtree(g, [k]) for g in grads])
        for t, (u, a) in enumerate(zip(whole, alone)):
            assert u[k].dtype == params[k].dtype, (t, k, u[k].dtype)
            torch.testing.assert_close(
                u[k],
                a[k],
                rtol=0,
                atol=0,
                msg=lambda m: (
                    f"step {t}: update['{k}'] ({params[k].dtype} in a mixed tree vs alone): {m}"
                ),
            )


@pytest.mark.parametrize("name", cases("bf16_states"))
def test_bf16_states(name):
    tx = build(name)
    params, grads = problem(dtype=torch.bfloat16)
    assert_float32_states(tx.init(params), "init")
    _, states, _ = run(tx, params, grads)
    for t, s in enumerate(states):
        assert_float32_states(s, f"step {t}")


# Elementwise ``|bf16 - f32| <= BF16_RTOL |f32| + BF16_ATOL max|f32 leaf|``: each operation done
# in the gradients' dtype rounds to bf16 (2**-9 relative), a chain of transforms adds them up
# (rtol), and cancellations (momentum of updates of opposite signs, weight decay added to an
# update) turn them into errors of the order of the leaf's scale rather than of the element
# (atol: about one bf16 epsilon, 2**-7, of the leaf's largest value). Measured worst case over
# the registry: 1.0e-2 of the leaf scale (adafactor's relative step, several bf16 stages).
BF16_RTOL = 2e-2
BF16_ATOL = 1.25e-2


def _assert_close_bf16(got: Any, want: Any, what: str) -> None:
    for (path, g), (_, w) in zip(walk(got), walk(want)):
        if w is None or not w.dtype.is_floating_point or w.numel() == 0:
            continue
        w64, g64 = w.detach().double(), g.detach().double()
        atol = BF16_ATOL * float(w64.abs().max())
        torch.testing.assert_close(
            g64, w64, rtol=BF16_RTOL, atol=atol, msg=lambda m: f"{what}['{path}']: {m}"
        )


@pytest.mark.parametrize("name", cases("bf16_close"))
def test_bf16_close(name):
    """bfloat16 params and gradients vs float32 ones holding the same values: the updates (and
    the float32 states) agree within bf16 tolerance at every step. Both runs see the same
    gradients and the same parameters up to one bf16 rounding (the float32 run's parameters,
    rounded), so sign-like optimizers (Adam's first step) see identical signs and the
    comparison is fair; what differs is the arithmetic done in the gradients' dtype."""
    tx = build(name)
    params, grads = problem(dtype=torch.bfloat16)
    to32 = lambda tree: optree.tree_map(lambda x: x.float(), tree)  # noqa: E731
    to16 = lambda tree: optree.tree_map(lambda x: x.bfloat16(), tree)  # noqa: E731
    p32 = to32(params)
    s32, s16 = tx.init(p32), tx.init(to16(p32))
    for t, g in enumerate(grads):
        u32, s32 = tx.update(to32(g), s32, p32)
        u16, s16 = tx.update(g, s16, to16(p32))
        _assert_close_bf16(u16, u32, f"step {t}: updates")
        _assert_close_bf16(s16, s32, f"step {t}: state")
        p32 = ft.apply_updates(p32, u32)


def check_update_dtype(name: str, dtype: torch.dtype) -> None:
    params, grads = problem(dtype=dtype)
    us, _, _ = run(build(name), params, grads)
    for t, u in enumerate(us):
        for path, x in walk(u):
            assert x.dtype == dtype and x.shape == params[path].shape, (
                f"step {t}: update['{path}'] is {x.dtype} {tuple(x.shape)}, the gradient "
                f"{dtype} {tuple(params[path].shape)}"
            )


@pytest.mark.parametrize("name", cases("update_dtype"))
def test_update_dtype(name):
    """bf16 gradients get bf16 updates (of their shapes) at every step."""
    check_update_dtype(name, torch.bfloat16)


@pytest.mark.parametrize("name", cases("update_dtype_f64"))
def test_update_dtype_f64(name):
    """float64 gradients get float64 updates at every step."""
    check_update_dtype(name, torch.float64)


# =============================================================================================
# no host synchronisation
# =============================================================================================
_ATEN = torch.ops.aten
# ops that read a tensor's value on the host: ``.item()`` / ``int(t)`` / ``bool(t)`` (all of
# them reach ``_local_scalar_dense``), ``torch.equal`` / ``allclose`` (return a Python bool) and
# ops whose output shape depends on values (the host waits for the count on an accelerator;
# boolean-mask indexing, ``x[mask]``, too: see ``NoHostSync``)
HOST_READS = {
    _ATEN._local_scalar_dense.default,
    _ATEN.item.default,
    _ATEN.equal.default,
    _ATEN.allclose.default,
    _ATEN.is_nonzero.default,
    _ATEN.nonzero.default,
    _ATEN.masked_select.default,
}


class HostSync(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Fails on every op of ``HOST_READS``, except ``_local_scalar_dense`` of the documented
    CPU counters passed as ``allowed`` (0-dim int64 CPU tensors, matched by storage)."""

    def __init__(self, allowed=()):
        super().__init__()
        self.allowed = [(x.untyped_storage().data_ptr(), x.storage_offset()) for x in allowed]
        self.allowed_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _ATEN.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            raise HostSync(
                "host synchronisation in update: boolean-mask indexing (the output "
                "shape depends on the values)"
            )
        if func in HOST_READS:
            x = args[0] if args else None
            ok = (
                func is _ATEN._local_scalar_dense.default
                and isinstance(x, torch.Tensor)
                and x.ndim == 0
                and x.dtype in (torch.int64, torch.float64)
                and x.device.type == "cpu"
                and (x.untyped_storage().data_ptr(), x.storage_offset()) in self.allowed
            )
            if not ok:
                what = (
                    f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
                    if isinstance(x, torch.Tensor)
                    else repr(x)
                )
                raise HostSync(f"host synchronisation in update: {func} on {what}")
            self.allowed_reads += 1
        return func(*args, **(kwargs or {}))


def documented_host_counters(state: Any) -> list:
    """The CPU step counters the library documents as read on the host."""
    out = []

    def visit(node):
        if isinstance(node, ft.MultiStepsState):
            out.append(node.mini_step)
            out.extend(node.seen)
        elif isinstance(node, (ft.GaLoreState, ft.DifferentiallyPrivateAggregateState)):
            out.append(node.count)
        elif isinstance(node, ft.InjectHyperparamsState):
            out.extend(v for k, v in node.hyperparams.items() if k != "learning_rate")
            out.append(node.count)  # (read inside a partition: its groups share schedules)
        if isinstance(node, dict):
            for x in node.values():
                visit(x)
        elif isinstance(node, (list, tuple)):
            for x in node:
                visit(x)

    visit(state)
    return out


@pytest.mark.parametrize("name", cases("no_host_sync"))
def test_no_host_sync(name):
    tx = build(name)
    params, grads = problem()
    state = tx.init(params)
    allowed_reads = 0
    for g in grads:
        allowed = documented_host_counters(state) if reg.host_reads_allowed(name) else []
        with NoHostSync(allowed) as mode:
            u, state = tx.update(g, state, params)
        allowed_reads += mode.allowed_reads
        params = ft.apply_updates(params, u)
    if reg.host_reads_allowed(name):
        assert allowed_reads > 0, "the registry allows counter reads this transform never does"


def test_no_host_sync_mode_catches_reads():
    """(the mode works) ``.item()`` / ``int()`` / ``bool()`` / ``torch.equal`` fail, an allowed
    counter passes, another 0-dim int64 tensor does not."""
    counter, other = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    x = torch.ones(3)
    for fn in (
        lambda: x.sum().item(),
        lambda: int(other),
        lambda: bool(x.sum() > 0),
        lambda: torch.equal(x, x),
        lambda: x[x > 0],
    ):
        with pytest.raises(HostSync):
            with NoHostSync([counter]):
                fn()
    with NoHostSync([counter]) as mode:
        assert int(counter) == 0
    assert mode.allowed_reads == 1


# =============================================================================================
# torch.compile
# =============================================================================================
@pytest.mark.slow
@pytest.mark.parametrize("name", cases("compile"))
def test_compile(name):
    """``torch.compile(update, fullgraph=True)`` (``COMPILE_BACKEND``) gives eager's updates and
    states, bit for bit, over 3 steps (a GaLore refresh, a plain step and a
    refresh; a non-final and a final micro-step of multi_steps). The registry's
    ``COMPILE_GRAPH_BREAKS`` compile with graph breaks (``fullgraph=False``), for the reason
    given there."""
    tx = build(name)
    params, grads = problem()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(
            tx.update, backend=COMPILE_BACKEND, fullgraph=name not in reg.COMPILE_GRAPH_BREAKS
        )
        se, sc = tx.init(params), tx.init(params)
        pe = pc = params
        for t, g in enumerate(grads):
            ue, se = tx.update(g, se, pe)
            uc, sc = compiled(g, sc, pc)
            assert_trees_equal(uc, ue, f"step {t}: compiled updates")
            assert_trees_equal(sc, se, f"step {t}: compiled state")
            pe, pc = ft.apply_updates(pe, ue), ft.apply_updates(pc, uc)
    finally:
        torch._dynamo.reset()


def _torch_optimizer_steps(name: str, compiled: bool) -> list:
    """Per step of a ``TorchOptimizer`` over ``nn.Parameter`` leaves (its ``step()``, or that
    compiled by inductor): its parameters and its state's tensors, copied."""
    params, grads = problem(scale=3.0)
    tensors = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    tx = reg.COMPILED_BUILDERS[name][0]() if name in reg.COMPILED_BUILDERS else build(name)
    opt = ft.TorchOptimizer(tensors.items(), tx)
    step = torch.compile(opt.step) if compiled else opt.step
    # (the recompile limit fails the test, where torch would warn and run the frame eagerly:
    # a graph break left the write-back's per-leaf frames compiled once per dtype and rank
    # until session 65)
    out = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for g in grads:
            for k, p in tensors.items():
                p.grad = g[k].clone()
            step()
            if compiled:  # (read only there: see elementwise.read_only_updates)
                for k, p in tensors.items():
                    assert torch.equal(p.grad, g[k]), f"the compiled step wrote '{k}'.grad"
            out.append(
                (
                    {k: p.detach().clone() for k, p in tensors.items()},
                    [x.clone() for x in optree.tree_leaves(opt._ft_state)],
                )
            )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", cases("torch_optimizer_compile"))
def test_torch_optimizer_compile(name):
    """``torch.compile(TorchOptimizer.step)`` with inductor (the way torch.optim's optimizers
    are compiled) gives the eager ``step()``'s parameters and state over 3 steps, to float32
    rounding: torch's compiled code outside the library's stages (statistics, Newton-Schulz)
    may round otherwise. The compiled step writes the new state into the old tensors (dynamo
    takes an optimizer's tensors as static). It was silently wrong around ``multi_steps`` (no
    update ever applied; found in session 57), and, found by this property in session 58,
    around ``adafactor`` and ``came`` (an inductor reordering) and on Muon's AdamW leaves (a
    fake kernel's dtypes), none of which the sweep's other properties compiled. The compiled
    step leaves ``.grad`` as it was: since session 59 the step reads the gradients only
    (``elementwise.read_only_updates``), where session 58 gave it a copy of them."""
    torch._dynamo.reset()
    try:
        want = _torch_optimizer_steps(name, False)
        got = _torch_optimizer_steps(name, True)
    finally:
        torch._dynamo.reset()
    params0 = problem(scale=3.0)[0]
    for t, ((pw, sw), (pg, sg)) in enumerate(zip(want, got)):
        for k in pw:  # (the parameter change, relative)
            torch.testing.assert_close(
                pg[k] - params0[k],
                pw[k] - params0[k],
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m, k=k, t=t: f"step {t}: parameter '{k}': {m}",
            )
        assert len(sg) == len(sw), f"step {t}: the state has {len(sg)} leaves, not {len(sw)}"
        for i, (a, b) in enumerate(zip(sg, sw)):
            torch.testing.assert_close(
                a, b, rtol=1e-4, atol=1e-6, msg=lambda m, i=i, t=t: f"step {t}: state leaf {i}: {m}"
            )


# =============================================================================================
# the step counter past 2**31
# =============================================================================================
def _is_counter(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.ndim == 0 and x.dtype == torch.int64


@pytest.mark.parametrize("name", cases("step_counter"))
@pytest.mark.parametrize("count", [2**31 - 1, 2**31 + 5], ids=["2^31-1", "2^31+5"])
def test_step_counter(name, count):
    """After one real update, every 0-dim int64 counter of the state is set to ``count``
    (``MultiStepsState.mini_step``, bounded by ``every_k``, is left as it is); the next update
    moves each of them to ``count + 1`` exactly (``mini_step`` back to 0 on the final
    micro-step), keeps them int64, and its updates and floating states are finite."""
    tx = build(name)
    params, grads = problem(2)
    state = tx.init(params)
    _, state = tx.update(grads[0], state, params)

    def is_mini_step(path):  # multi_steps' micro-step counter and per-leaf flags, and the
        # counts of non-finite updates (apply_if_finite, dynamic_loss_scale): not step counters
        return (
            path.endswith(("mini_step", "notfinite_count", "total_notfinite"))
            or "seen" in path.split(".")[-2:]
        )

    big = map_state(
        lambda p, x: torch.full_like(x, count) if _is_counter(x) and not is_mini_step(p) else x,
        state,
    )
    counters = [p for p, x in walk(big) if _is_counter(x) and not is_mini_step(p)]
    updates, new = tx.update(grads[1], big, params)
    after = dict(walk(new))
    for p in counters:
        x = after[p]
        assert _is_counter(x), f"state['{p}'] is no longer a 0-dim int64 tensor: {x!r}"
        assert int(x) == count + 1, f"state['{p}']: {count} -> {int(x)}"
    for p, x in walk(new):
        if p.endswith("total_notfinite"):
            assert int(x) == int(dict(walk(big))[p]), f"state['{p}'] counted a finite update"
        elif is_mini_step(p):
            assert int(x) == 0, f"state['{p}'] = {int(x)} after the final micro-step"
        elif isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            assert torch.isfinite(x).all(), f"state['{p}'] is not finite"
    for p, u in walk(updates):
        assert torch.isfinite(u).all(), f"update['{p}'] is not finite"


# =============================================================================================
# ft.step
# =============================================================================================
STEP_TOL = (2e-5, 1e-6)  # fused kernels: the primitives' numbers to float32 rounding


@pytest.mark.parametrize("name", cases("step"))
def test_step(name):
    """``ft.step`` (pure and donated) == ``update`` + ``apply_updates``; the pure step leaves
    params, grads and state bitwise unchanged; the donated one returns the same numbers."""
    params, grads = problem(scale=3.0)
    want_u, want_s, _ = run(build(name), params, grads)
    tx = build(name)
    p_pure, s_pure = params, tx.init(params)
    p_don, s_don = clone_tree(params), tx.init(clone_tree(params))
    p_ref = params
    for t, g in enumerate(grads):
        old = (p_pure, g, s_pure)
        before = clone_tree(old)
        p_pure, s_pure = ft.step(tx, g, s_pure, p_pure)
        assert_bitwise_unchanged(before, old, f"step {t}: (params, grads, state)")
        p_don, s_don = ft.step(tx, clone_tree(g), s_don, p_don, donate=True)
        p_ref = ft.apply_updates(p_ref, want_u[t])
        for what, got in (("pure", (p_pure, s_pure)), ("donated", (p_don, s_don))):
            assert_trees_equal(
                got[0], p_ref, f"step {t}: {what} params", rtol=STEP_TOL[0], atol=STEP_TOL[1]
            )
            assert_trees_equal(
                got[1], want_s[t], f"step {t}: {what} state", rtol=STEP_TOL[0], atol=STEP_TOL[1]
            )


FUSED_TOL = (2e-5, 1e-6)  # C vs ATen rounding (torch's float32 sqrt), see tests/test_fused.py


def _run_mode(tx, params, grads, mode):
    state = tx.init(params)
    p = clone_tree(params)
    for g in grads:
        p, state = step_by_mode(tx, clone_tree(g), state, p, mode)
    return p, state


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("name", cases("fused"))
def test_fused(name, mode, monkeypatch):
    """One definition per primitive: what the engine runs fused (a generated kernel per stage,
    ``functional_train/engine/fuse.py``) equals the same per-leaf definitions run leaf by leaf
    in torch (the kernels off), params and states, for pure and donated ``ft.step`` (a
    transform without an elementwise spec runs the same code both times). ``update`` is
    checked so in ``tests/test_fused.py``; the compiled ``ft.step`` against the eager one by
    ``compile_dtensor``, whose stages are the same kernels behind an operator."""
    from functional_train.engine import fuse

    params, grads = problem(scale=3.0)
    got = _run_mode(build(name), params, grads, mode)
    monkeypatch.setattr(fuse, "ENABLED", False)
    want = _run_mode(build(name), params, grads, mode)
    rtol, atol = FUSED_TOL
    assert_trees_equal(got[0], want[0], f"{mode}: params", rtol=rtol, atol=atol)
    assert_trees_equal(got[1], want[1], f"{mode}: state", rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", cases("step_sharded"))
@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_step_sharded(name, mode):
    """``ft.step`` on the simulated data-axis layout (see ``test_sharded_data_axis``) ==
    ``ft.step`` unsharded, params and states, rank by rank."""
    rtol, atol = _tol(name)
    params, grads = problem(2, seed=1)
    assert_sharded_equivalent(
        build(name),
        params,
        grads,
        placements=DATA_AXIS_PARAMS,
        grad_placements=DATA_AXIS_GRADS,
        mesh_shape=(2, 2),
        mesh_dim_names=("dp", "tp"),
        data_axis="dp",
        rtol=rtol,
        atol=atol,
        ignore_state=_ignore_state(name, data_axis=True),
        step=mode,
    )


@pytest.fixture(scope="session")  # (kept to the end: a module's would go when a test of
def _compiled_on_gloo(ranks):  # another module runs between two of these under xdist)
    """One 2-rank gloo job compiling every transform (see ``tests/_gloo_compile_worker.py``)."""
    return ranks.run(2, "_gloo_compile_worker:main", timeout=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", cases("compile_dtensor"))
def test_compile_dtensor(name, _compiled_on_gloo):
    """``torch.compile(ft.step, fullgraph=True)`` on DTensors (2 gloo ranks) == eager."""
    assert name in _compiled_on_gloo, sorted(_compiled_on_gloo)
    assert _compiled_on_gloo[name] is None, _compiled_on_gloo[name]


# =============================================================================================
# zero gradients
# =============================================================================================
# What a model hands its optimizer for the parts it did not use, on the tree of ``SHAPES``:
# ``w`` belongs to an expert that received no tokens (zero at every step, from init); ``m`` to a
# layer used, then unused (a zero gradient with a non-zero state), then given values far below
# every eps (1e-30: their squares underflow to zero in float32 and bfloat16, so a norm or an RMS
# of them is zero); ``t`` is an embedding table whose unused rows (``t[0]``, ``t[:, 1]``) get
# zero gradients, the others values below eps at first; ``v`` a zero-initialised bias (a zero
# parameter: its norm and RMS are zero) with zero gradients, then non-zero ones; ``s`` a scalar.
# Step 1 is zero on every leaf (a global norm of zero).
TINY = 1e-30
ZERO_SCHEDULE = {  # per leaf, the kind of gradient at each step
    "w": ("zero", "zero", "zero"),
    "m": ("random", "zero", "tiny"),
    "t": ("tiny rows", "zero", "rows"),
    "v": ("zero", "zero", "random"),
    "s": ("random", "zero", "random"),
}
ZERO_PARAMS = ("v",)  # leaves whose parameter is zero at init


def zero_problem() -> tuple:
    """``(params, [grads per step])`` of ``ZERO_SCHEDULE`` on the tree of ``SHAPES``: float32,
    standard normal params (zeros for ``ZERO_PARAMS``), standard normal ``random`` gradients,
    ``TINY`` times that for ``tiny``, ``rows`` with zeros in ``[0]`` and ``[:, 1]``."""
    gen = torch.Generator().manual_seed(4)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    params = {
        k: torch.zeros(s) if k in ZERO_PARAMS else randn(s).float() for k, s in SHAPES.items()
    }

    def grad(kind: str, shape: tuple) -> torch.Tensor:
        x = randn(shape)
        if kind == "zero":
            x.zero_()
        if "tiny" in kind:
            x.mul_(TINY)
        if "rows" in kind:
            x[0] = 0.0
            x[:, 1] = 0.0
        return x.float()

    steps = len(ZERO_SCHEDULE["w"])
    grads = [{k: grad(ZERO_SCHEDULE[k][t], s) for k, s in SHAPES.items()} for t in range(steps)]
    return params, grads


def zero_scenarios() -> dict:
    """``{name: (params, [grads per step])}``: the whole tree zero from init (2 steps), and
    :func:`zero_problem`."""
    params, _ = problem()
    zeros = {k: torch.zeros_like(x) for k, x in params.items()}
    return {"all zero": (params, [zeros, zeros]), "mixed": zero_problem()}


def assert_finite(tree: Any, what: str) -> None:
    """Every floating-point leaf of ``tree`` is finite (no NaN, no infinity)."""
    for path, x in walk(tree):
        if isinstance(x, torch.Tensor) and (x.dtype.is_floating_point or x.dtype.is_complex):
            bad = ~torch.isfinite(x)
            assert not bad.any(), (
                f"{what}['{path}']: {int(bad.sum())} of {x.numel()} elements are not finite: {x}"
            )


# the reference comparisons: the parameter change, ``max |ours - theirs| <= REF_RTOL max |theirs|
# + steps * 2 ulps of max |param|`` (each run stores its parameters in float32 after every step)
REF_RTOL = 1e-4


@pytest.mark.parametrize("name", cases("zero_grads"))
def test_zero_grads(name):
    """Zero gradients and gradients below eps (see ``ZERO_SCHEDULE``; and the whole tree zero
    from init): at every step the updates, the states and the parameters are finite;
    ``ft.step`` (pure, its fused kernels where they apply) gives the parameters and states of
    ``update`` + ``apply_updates``; and where the registry has a reference implementation
    (``REFERENCES``), the parameters equal its parameters (a floor that keeps a zero norm or RMS
    from dividing is only right if it is the reference's floor)."""
    reference = reg.REFERENCES.get(name)
    for scenario, (params, grads) in zero_scenarios().items():
        us, states, _ = run(build(name), params, grads)
        want = None if reference is None else reference(params, grads)
        tx = build(name)
        p, p_step, s_step = params, params, tx.init(params)
        for t, g in enumerate(grads):
            what = f"{scenario}, step {t}"
            p = ft.apply_updates(p, us[t])
            assert_finite(us[t], f"{what}: updates")
            assert_finite(states[t], f"{what}: state")
            assert_finite(p, f"{what}: params")
            p_step, s_step = ft.step(tx, g, s_step, p_step)
            assert_trees_equal(
                p_step, p, f"{what}: ft.step params", rtol=STEP_TOL[0], atol=STEP_TOL[1]
            )
            assert_trees_equal(
                s_step, states[t], f"{what}: ft.step state", rtol=STEP_TOL[0], atol=STEP_TOL[1]
            )
            if want is None:
                continue
            for k, p0 in params.items():
                ulps = (t + 1) * 2 * torch.finfo(p0.dtype).eps * float(p[k].abs().max())
                close(
                    p[k] - p0,
                    want[t][k] - p0,
                    REF_RTOL,
                    ulps,
                    f"{what}: params['{k}'] change, the reference's",
                )


@pytest.mark.parametrize("name", cases("zero_grads_sharded"))
def test_zero_grads_sharded(name):
    """The first step of ``zero_problem`` (zero from init, below eps with zero rows, a zero
    parameter with a zero gradient, beside random leaves) on the data-axis layout of
    ``test_sharded_data_axis`` (the zero bias ``v`` and the scalar plain, their gradients
    per-replica contributions; ``m``'s gradients ``Partial`` over dp; ``w`` sharded over tp,
    ``t`` over both): sharded == unsharded, and both runs finite (``finite``: a NaN in both runs
    would otherwise count as equal). One step, to keep the sweep fast: zero gradients after
    non-zero ones are sharded in ``test_sharded_data_axis``' last step and in the drawn cases of
    ``test_sharded``."""
    params, grads = zero_problem()
    _assert_data_axis_equivalent(name, params, grads[:1])


# =============================================================================================
# the testing toolkit's zero-gradient options
# =============================================================================================
def test_finite_check_catches_nan_in_both_runs():
    """(the check works) A transform that divides by its gradient's norm without a floor gives
    NaN in both runs on a zero gradient: equal under ``equal_nan``, caught by ``finite=True``
    naming the run, step, tree and leaf; an infinity in the sharded run only is named with its
    rank."""

    def by_norm(updates, state, params=None, **kw):
        return optree.tree_map(lambda g: g / torch.linalg.vector_norm(g), updates), state

    def inf_if_sharded(updates, state, params=None, **kw):
        by_zero = lambda g: g / (0.0 if isinstance(g, DTensor) else 1.0)  # noqa: E731
        return optree.tree_map(by_zero, updates), state

    params, grads = problem(1, shapes={"w": (4, 3)})
    zeros = [{"w": torch.zeros(4, 3)}]
    kw = dict(placements={"w": [S0]}, mesh_shape=(2,), check_placements=False)
    tx = ft.GradientTransformation(lambda p: ft.EmptyState(), by_norm)
    assert_sharded_equivalent(tx, params, zeros, **kw)  # NaN == NaN
    with pytest.raises(
        AssertionError,
        match=r"unsharded run, step 0, updates\['w'\]: 12 of 12 elements are not finite "
        r"\(first: nan at index \(0, 0\)\)",
    ):
        assert_sharded_equivalent(tx, params, zeros, finite=True, **kw)
    tx = ft.GradientTransformation(lambda p: ft.EmptyState(), inf_if_sharded)
    with pytest.raises(
        AssertionError,
        match=r"sharded run, step 0, updates\['w'\]: 6 of 6 elements are not finite \(first: "
        r"-?inf at index \(0, 0\) on rank 0 \(local index\)\)",
    ):
        assert_sharded_equivalent(tx, params, grads, finite=True, **kw)


def test_sharded_cases_draw_zero_gradient_leaves():
    """(the strategy works) ``sharded_cases(zero_grads=p)`` makes the leaves it lists in
    ``zeros`` all-zero at those steps and leaves the others as drawn (never zero); ``p=1``
    zeroes every leaf at every step; ``p=0`` (the default) none."""
    quick = settings(max_examples=50, database=None, phases=[Phase.generate])
    with pytest.raises(ValueError, match=r"zero_grads must be in \[0, 1\], got 1.5"):
        sharded_cases(zero_grads=1.5)

    def check(case):  # the leaves listed in zeros, and only those, are all zero
        for t, g in enumerate(case.grads_per_step):
            for path, x in walk(g):
                assert bool(x.eq(0).all()) == ((t, path) in case.zeros), (t, path, x)

    all_zero = find(sharded_cases(zero_grads=1.0, frozen=False), lambda c: True, settings=quick)
    check(all_zero)
    assert len(all_zero.zeros) == all_zero.steps * len(all_zero.leaves)
    three = dict(steps=3, min_leaves=3, max_leaves=3, frozen=False)
    case = find(
        sharded_cases(zero_grads=0.5, **three), lambda c: 0 < len(c.zeros) < 9, settings=quick
    )
    check(case)
    assert f"zeros={list(case.zeros)}" in repr(case)
    assert not find(sharded_cases(**three), lambda c: True, settings=quick).zeros


# =============================================================================================
# torch.func: vmap and grad
# =============================================================================================
# a small float64 tree: a matrix (projected by GaLore, orthogonalised by Muon, factored by
# Adafactor and CAME) and a vector
FUNC_SHAPES = {"w": (4, 3), "v": (5,)}
VMAP_BATCH = 2
# a batched matmul / 8-bit absmax in float32 rounds otherwise than one element's; float64 else
VMAP_TOL = {
    "default": (1e-10, 1e-12),
    "adamw[8bit]": (1e-6, 1e-9),
    "galore_adamw[8bit]": (1e-6, 1e-9),
}
GRAD_RTOL = 1e-6  # analytic vs central differences (h = 1e-5, float64)


def _func_build(name: str) -> ft.GradientTransformation:
    hit = reg.FUNC_BUILDERS.get(name)
    return hit[0]() if hit is not None else build(name)


def _steps(tx, params, grads, state=None, use_step=False):
    state = tx.init(params) if state is None else state
    for g in grads:
        params, state = step_by_mode(tx, g, state, params, "pure" if use_step else "update")
    return params, state


@pytest.mark.parametrize("name", cases("vmap"))
def test_vmap(name):
    """``ft.vmap`` of ``init``, then of ``update`` and ``apply_updates`` (and of ``ft.step``),
    each call batched on its own, over a leading model axis equals a Python loop over that
    axis, params and every state leaf (the global norms, trust ratios, factored statistics,
    Newton-Schulz and counters are per batch element, as under ``jax.vmap``)."""
    problems = [
        problem(2, seed=s, dtype=torch.float64, shapes=FUNC_SHAPES, scale=2.0)
        for s in range(VMAP_BATCH)
    ]
    stack = lambda trees: {k: torch.stack([t[k] for t in trees]) for k in trees[0]}  # noqa: E731
    params = stack([p for p, _ in problems])
    grads = [stack([g[t] for _, g in problems]) for t in range(2)]
    rtol, atol = VMAP_TOL.get(name, VMAP_TOL["default"])
    for use_step in (False, True):
        tx = _func_build(name)
        p, state = params, ft.vmap(tx.init)(params)  # (batched counters, as jax.vmap gives)
        for g in grads:  # each call batched on its own, as a training loop makes them
            if use_step:
                p, state = ft.vmap(lambda g, s, q: ft.step(tx, g, s, q))(g, state, p)
            else:
                u, state = ft.vmap(tx.update)(g, state, p)
                p = ft.vmap(ft.apply_updates)(p, u)
        got = (p, state)
        for i, (p, g) in enumerate(problems):
            want = _steps(_func_build(name), p, g, use_step=use_step)
            for (path, x), (_, w) in zip(walk(got), walk(want)):
                what = f"{'ft.step' if use_step else 'update'}: element {i}, {path}"
                if not isinstance(w, torch.Tensor):
                    assert x == w, what
                    continue
                assert x.shape == (VMAP_BATCH, *w.shape), what
                torch.testing.assert_close(
                    x[i], w, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
                )


@pytest.mark.parametrize("name", cases("grad"))
def test_grad(name):
    """``torch.func.grad`` through ``update`` + ``apply_updates`` and ``torch.func.jvp``
    through ``ft.step`` (two steps, from a state one step in) of a loss of the new parameters,
    with respect to the parameters, the first gradients and every floating state leaf, equal
    central finite differences in float64 along a random direction; a transform of
    ``NOT_DIFFERENTIABLE`` raises its clear error instead (never a silent zero)."""
    params, grads = problem(3, dtype=torch.float64, shapes=FUNC_SHAPES, scale=2.0)
    tx = _func_build(name)
    _, state = _steps(tx, params, grads[:1])
    paths = [p for p, _ in walk(state)]
    leaves, spec = optree.tree_flatten(state, none_is_leaf=True)
    held = reg.GRAD_HELD_STATE.get(name)
    fl = [
        k
        for k, x in enumerate(leaves)
        if isinstance(x, torch.Tensor)
        and x.dtype == torch.float64  # (a float32 leaf's finite differences are its rounding)
        and not (held is not None and held[0] in paths[k])
    ]
    gen = torch.Generator().manual_seed(1)
    target = {k: torch.randn(v, generator=gen, dtype=torch.float64) for k, v in FUNC_SHAPES.items()}

    def loss(p, g1, g2, sf, use_step=False):
        full = list(leaves)
        for k, x in zip(fl, sf):
            full[k] = x
        s = optree.tree_unflatten(spec, full)
        q, _ = _steps(_func_build(name), p, [g1, g2], s, use_step)
        return sum(((q[k] - target[k]) ** 2).sum() for k in q)

    primal = (params, grads[1], grads[2], [leaves[k] for k in fl])

    def rnd(x, rel=False):  # state leaves: relative to the leaf (second moments stay positive)
        d = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        return d * x.abs() if rel else d

    tangent = (*optree.tree_map(rnd, primal[:3]), [rnd(x, True) for x in primal[3]])
    argnums = (0, 1, 2, 3)
    if name in reg.NOT_DIFFERENTIABLE:
        with pytest.raises(NotImplementedError, match=reg.NOT_DIFFERENTIABLE[name]):
            torch.func.grad(loss, argnums=argnums)(*primal)
        with pytest.raises(NotImplementedError, match=reg.NOT_DIFFERENTIABLE[name]):
            torch.func.jvp(lambda *a: loss(*a, use_step=True), primal, tangent)
        return
    h = 1e-5
    at = lambda t: loss(*optree.tree_map(lambda x, d: x + t * d, primal, tangent))  # noqa: E731
    fd = float((at(h) - at(-h)) / (2 * h))
    d = torch.func.grad(loss, argnums=argnums)(*primal)
    by_grad = float(
        sum((a * b).sum() for a, b in zip(optree.tree_leaves(d), optree.tree_leaves(tangent)))
    )
    _, by_jvp = torch.func.jvp(lambda *a: loss(*a, use_step=True), primal, tangent)
    for what, got in (("grad through update", by_grad), ("jvp through ft.step", float(by_jvp))):
        assert abs(got - fd) <= GRAD_RTOL * max(1.0, abs(fd)), (
            f"{what}: {got}, finite differences {fd}"
        )
