"""Sharded vs unsharded equivalence: the central property of functional_train.

The same transform chain run on DTensors over a simulated device mesh (one process,
``LocalTensorMode`` + the ``fake`` process group, see :mod:`functional_train.testing`) must give
the numbers it gives on plain tensors with ``mesh=None``: the updates of every step, the states
(gathered) and the final parameters.

Section 1 uses the public toolkit (``functional_train.testing.sharded_cases`` and
``assert_sharded_equivalent``): hypothesis draws the mesh (``(2,)``, ``(4,)``, ``(2, 2)``), the
pytree (0-D to 3-D leaves whose sizes mostly do not divide the mesh, down to sizes smaller than
it so that some ranks hold EMPTY shards), per-leaf placements (``Shard(d)`` on any dim,
``Shard(-1)``, ``Replicate()`` and, on the 2-D mesh, every pair of them, nested
``[Shard(0), Shard(0)]`` included), full-rank and rank-1 gradients, the hyper-parameters and the
transform itself (every public transform, and random compositions of them with ``chain`` /
``named_chain`` / ``multi_steps``).

Further sections check the mesh roles that placements cannot express: the pipeline axis (stages
hold different leaves), the expert axis (experts differ per rank), the data axis (per-replica
contributions are averaged; ``Partial`` gradients are summed; gradients come out in the
parameter's placements), and all of them at once on a (pp, dp, ep, tp) mesh.

Sharded results are checked rank by rank: every rank's local shard against the slice of the
unsharded reference that its placements say it holds (computed from the placements, not with
DTensor's ``full_tensor``), so replicas are checked one by one as well (the harness in section
1; ``rank_views`` / ``assert_tree_close`` below for the meshes it cannot express).

Transforms are drawn as plain *descriptors* (nested tuples) so that a failing example prints
readably and can be rebuilt identically for the unsharded reference and the sharded run.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.base import passes_unreduced
from functional_train.testing import (
    assert_sharded_equivalent,
    count_collectives,
    on_rank,
    per_rank,
    sharded_cases,
    simulate,
)
from functional_train.testing.strategies import _nest

RTOL, ATOL = 1e-5, 1e-6


# =============================================================================================
# comparison helpers
# =============================================================================================
def _leaves_with_paths(tree):
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return [".".join(map(str, p)) for p in paths], leaves, treedef


class ShardView:
    """What one rank holds of a DTensor leaf: its local shard and where it sits in the global
    tensor (computed here from the placements, independently of DTensor's redistribute)."""

    def __init__(self, local: torch.Tensor, index: tuple, global_shape: tuple, dtype):
        self.local, self.index, self.global_shape, self.dtype = local, index, global_shape, dtype

    def __repr__(self) -> str:
        return f"ShardView(index={self.index}, global_shape={self.global_shape})"


def _unravel(r: int, shape) -> list:
    out = []
    for s in reversed(shape):
        out.append(r % s)
        r //= s
    return list(reversed(out))


def _coords_in(mesh, r: int) -> list:
    """Coordinates of global rank ``r`` in ``mesh`` (a root mesh from init_device_mesh, ranks laid
    out row-major, or a named sub-mesh of one)."""
    root = mesh._get_root_mesh()
    rc = _unravel(r, tuple(root.shape))
    if mesh is root or mesh.mesh_dim_names == root.mesh_dim_names:
        return rc
    return [rc[root.mesh_dim_names.index(n)] for n in mesh.mesh_dim_names]


def shard_index(x: DTensor, r: int) -> tuple:
    """The slices of the global tensor that rank ``r`` holds (torch's nested chunking: mesh dims
    left to right, ``torch.chunk`` sizes, trailing shards possibly empty)."""
    ndim = len(x.shape)
    ranges = [(0, int(s)) for s in x.shape]
    coords = _coords_in(x.device_mesh, r)
    for i, p in enumerate(x.placements):
        if isinstance(p, Partial):
            raise AssertionError(f"unexpected Partial placement in {x.placements}")
        if isinstance(p, Shard):
            d = p.dim % ndim
            off, ln = ranges[d]
            n = x.device_mesh.size(i)
            cs = -(-ln // n)
            start = min(coords[i] * cs, ln)
            ranges[d] = (off + start, min(start + cs, ln) - start)
    return tuple(slice(o, o + ln) for o, ln in ranges)


def rank_views(tree, world: int) -> list:
    """Per-rank views of a (DTensor / simulated) tree: DTensor leaves become :class:`ShardView`
    (each rank's own shard, so replicas are checked one by one), simulated tensors are read on
    each rank. Comparing every rank's view with the unsharded reference also proves that every
    rank holds the same value of replicated quantities."""

    def one(x):
        if isinstance(x, DTensor):
            loc = x._local_tensor  # to_local() without its autograd overhead (slow in simulation)
            gshape = tuple(int(s) for s in x.shape)
            return [
                ShardView(on_rank(loc, r), shard_index(x, r), gshape, x.dtype) for r in range(world)
            ]
        return [on_rank(x, r) for r in range(world)]

    paths, leaves, treedef = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    per_leaf = [one(x) for x in leaves]
    return [optree.tree_unflatten(treedef, [v[r] for v in per_leaf]) for r in range(world)]


def assert_tree_close(got, want, what: str) -> None:
    """Same structure (NamedTuple types and dict keys included), dtypes, shapes and values;
    ``got`` may hold :class:`ShardView` leaves, compared with the matching slice of ``want``."""
    gp, gl, gt = _leaves_with_paths(got)
    wp, wl, wt = _leaves_with_paths(want)
    assert gt == wt, f"{what}: structure differs:\n got  {gt}\n want {wt}"
    for path, g, w in zip(wp, gl, wl):
        where = f"{what} at '{path}'"
        if w is None or g is None:
            assert g is None and w is None, f"{where}: got {g!r}, want {w!r}"
            continue
        if not isinstance(w, torch.Tensor):
            assert g == w, f"{where}: got {g!r}, want {w!r}"
            continue
        if isinstance(g, ShardView):
            assert g.global_shape == tuple(w.shape), (
                f"{where}: global shape {g.global_shape}, want {tuple(w.shape)}"
            )
            where = f"{where} shard {g.index}"
            g, w = g.local, w[g.index]
        assert isinstance(g, torch.Tensor), f"{where}: got {type(g).__name__}"
        assert not isinstance(g, DTensor), f"{where}: not a local value"
        assert g.dtype == w.dtype, f"{where}: dtype {g.dtype}, want {w.dtype}"
        assert tuple(g.shape) == tuple(w.shape), (
            f"{where}: shape {tuple(g.shape)}, want {tuple(w.shape)}"
        )
        if w.dtype.is_floating_point:
            torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(g, w), f"{where}: {g} != {w}"


def assert_placements_like(updates, params, what: str) -> None:
    """Every update leaf is a DTensor in its parameter's mesh and placements (plain if plain)."""
    up, ul, _ = _leaves_with_paths(updates)
    _, pl, _ = _leaves_with_paths(params)
    for path, u, p in zip(up, ul, pl):
        if u is None:
            continue
        if isinstance(p, DTensor):
            assert isinstance(u, DTensor), f"{what} '{path}': plain tensor for a DTensor param"
            assert u.device_mesh == p.device_mesh, f"{what} '{path}': mesh {u.device_mesh}"
            assert tuple(u.placements) == tuple(p.placements), (
                f"{what} '{path}': placements {u.placements}, param has {p.placements}"
            )
        else:
            assert not isinstance(u, DTensor), f"{what} '{path}': DTensor for a plain param"


def run_steps(tx, params, grads_seq, mesh):
    """Run ``update`` + ``apply_updates`` over the gradient sequence; return the updates and
    states of every step and the final params."""
    state = tx.init(params)
    ups, states = [], []
    for g in grads_seq:
        u, state = tx.update(g, state, params, mesh=mesh)
        params = ft.apply_updates(params, u)
        ups.append(u)
        states.append(state)
    return ups, states, params


# =============================================================================================
# transform descriptors
# =============================================================================================
def build(desc) -> ft.GradientTransformation:
    """Build a transform from a descriptor ``(name, args)``."""
    name, arg = desc
    if name == "chain":
        return ft.chain(*[build(d) for d in arg])
    if name == "named_chain":
        return ft.named_chain(*[(n, build(d)) for n, d in arg])
    if name == "identity":
        return ft.identity()
    kwargs = {k: _build_value(v) for k, v in arg.items()}
    return getattr(ft, name)(**kwargs)


def _build_value(v):
    if isinstance(v, tuple) and v and v[0] == "tx":
        return build(v[1])
    if isinstance(v, tuple) and v and v[0] == "schedule":
        fn = getattr(ft.schedules, v[1], None) or getattr(ft, v[1])
        return fn(**v[2])
    return v


def _f(lo, hi):
    """Floats in [lo, hi] rounded to 4 decimals: readable, and no subnormal values (a peak
    learning rate of 2e-311 makes optax-style schedules overflow in both runs alike)."""
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False).map(lambda v: round(v, 4))


_schedules = st.one_of(
    st.builds(
        lambda a, b, n, s: (
            "schedule",
            "linear_schedule",
            dict(init_value=a, end_value=b, transition_steps=n, transition_begin=s),
        ),
        _f(0.0, 0.5),
        _f(0.0, 0.5),
        st.integers(0, 3),
        st.integers(0, 2),
    ),
    st.builds(
        lambda a, n, al: (
            "schedule",
            "cosine_decay_schedule",
            dict(init_value=a, decay_steps=n, alpha=al),
        ),
        _f(0.0, 0.5),
        st.integers(1, 4),
        _f(0.0, 1.0),
    ),
    st.builds(
        lambda a, p, w, n, e: (
            "schedule",
            "warmup_cosine_decay_schedule",
            dict(init_value=a, peak_value=p, warmup_steps=w, decay_steps=w + n, end_value=e),
        ),
        _f(0.0, 0.1),
        _f(0.0, 0.5),
        st.integers(0, 2),
        st.integers(1, 3),
        _f(0.0, 0.1),
    ),
)
_schedules = st.one_of(
    _schedules,
    st.builds(lambda w: ("schedule", "relative_step_schedule", dict(warmup_init=w)), st.booleans()),
)
_lr = st.one_of(_f(0.0, 0.5), _schedules)


@st.composite
def _trace_args(draw):
    decay = draw(_f(0.0, 0.95))
    nesterov = draw(st.booleans()) and decay > 0
    dampening = 0.0 if nesterov else draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    return {"decay": decay, "nesterov": nesterov, "dampening": dampening}


def _leaf_tx(kind: str):
    """Strategy of descriptors of the primitive / optimizer ``kind``."""
    if kind == "identity":
        return st.just(("identity", None))
    if kind == "clip":
        return st.builds(lambda d: ("clip", dict(max_delta=d)), _f(0.05, 2.0))
    if kind == "clip_by_global_norm":
        return st.builds(
            lambda m, p: ("clip_by_global_norm", dict(max_norm=m, norm_type=p)),
            st.sampled_from([0.1, 0.5, 1.0, 3.0, 100.0]),
            st.sampled_from([2.0, 1.0, 3.0, math.inf]),
        )
    if kind == "scale":
        return st.builds(lambda s: ("scale", dict(step_size=s)), _f(-2.0, 2.0))
    if kind == "scale_by_learning_rate":
        return st.builds(
            lambda lr, f: ("scale_by_learning_rate", dict(learning_rate=lr, flip_sign=f)),
            _lr,
            st.booleans(),
        )
    if kind == "add_decayed_weights":
        return st.builds(
            lambda w: ("add_decayed_weights", dict(weight_decay=w)),
            st.one_of(st.just(0.0), _f(0.0, 0.5)),
        )
    if kind == "trace":
        return st.builds(
            lambda a, dt: ("trace", dict(a, accumulator_dtype=dt)),
            _trace_args(),
            st.sampled_from([torch.float32, None]),
        )
    if kind == "scale_by_adam":
        return st.builds(
            lambda b1, b2, eps, ams: ("scale_by_adam", dict(b1=b1, b2=b2, eps=eps, amsgrad=ams)),
            _f(0.0, 0.99),
            _f(0.5, 0.9999),
            st.sampled_from([1e-8, 1e-6, 1e-3]),
            st.booleans(),
        )
    if kind == "sgd":
        return st.builds(
            lambda lr, tr, wd, mx: (
                "sgd",
                dict(
                    learning_rate=lr,
                    momentum=tr["decay"],
                    dampening=tr["dampening"],
                    nesterov=tr["nesterov"],
                    weight_decay=wd,
                    maximize=mx,
                ),
            ),
            _lr,
            _trace_args(),
            st.one_of(st.just(0.0), _f(0.0, 0.3)),
            st.booleans(),
        )
    if kind in ("adam", "adamw"):
        extra = {
            "adam": st.fixed_dictionaries({"decoupled_weight_decay": st.booleans()}),
            "adamw": st.just({}),
        }[kind]
        return st.builds(
            lambda lr, b1, b2, eps, wd, ams, mx, ex: (
                kind,
                dict(
                    learning_rate=lr,
                    b1=b1,
                    b2=b2,
                    eps=eps,
                    weight_decay=wd,
                    amsgrad=ams,
                    maximize=mx,
                    **ex,
                ),
            ),
            _lr,
            _f(0.0, 0.99),
            _f(0.5, 0.9999),
            st.sampled_from([1e-8, 1e-6, 1e-3]),
            st.one_of(st.just(0.0), _f(0.0, 0.3)),
            st.booleans(),
            st.booleans(),
            extra,
        )
    if kind == "scale_by_factored_rms":
        return st.builds(
            lambda d, e, b2, m: (
                "scale_by_factored_rms",
                dict(decay_rate=d, eps=e, beta2=b2, min_dim_size_to_factor=m),
            ),
            _f(-1.0, -0.5),
            st.sampled_from([1e-30, 1e-3]),
            st.one_of(st.none(), _f(0.0, 0.99)),
            st.sampled_from([0, 2, 3]),
        )
    if kind == "clip_by_block_rms":
        return st.builds(lambda t: ("clip_by_block_rms", dict(threshold=t)), _f(0.05, 2.0))
    if kind == "scale_by_param_block_rms":
        return st.builds(lambda m: ("scale_by_param_block_rms", dict(min_scale=m)), _f(0.0, 0.5))
    if kind == "ema":
        return st.builds(
            lambda d, b: ("ema", dict(decay=d, debias=b)), _f(0.0, 0.95), st.booleans()
        )
    if kind == "adafactor":

        @st.composite
        def _adafactor(draw):
            relative = draw(st.booleans())
            kw = dict(
                relative_step=relative,
                learning_rate=None if relative else draw(st.one_of(_f(0.001, 0.5), _schedules)),
                warmup_init=relative and draw(st.booleans()),
                eps=(draw(st.sampled_from([1e-30, 1e-6])), draw(st.sampled_from([1e-3, 0.1]))),
                clip_threshold=draw(_f(0.1, 2.0)),
                decay_rate=draw(_f(-1.0, -0.5)),
                beta1=draw(st.one_of(st.none(), _f(0.0, 0.95))),
                weight_decay=draw(st.one_of(st.just(0.0), _f(0.0, 0.3))),
                scale_parameter=draw(st.booleans()),
            )
            return ("adafactor", kw)

        return _adafactor()
    raise AssertionError(kind)


PRIMITIVES = [
    "identity",
    "clip",
    "clip_by_global_norm",
    "scale",
    "scale_by_learning_rate",
    "add_decayed_weights",
    "trace",
    "scale_by_adam",
    "sgd",
    "adam",
    "adamw",
    "scale_by_factored_rms",
    "clip_by_block_rms",
    "scale_by_param_block_rms",
    "ema",
    "adafactor",
]
COMBINATORS = ["chain", "named_chain", "multi_steps"]
ALL_KINDS = PRIMITIVES + COMBINATORS


def any_tx(depth: int = 2):
    """Descriptors of any transform, combinators nested up to ``depth``."""
    prim = st.sampled_from(PRIMITIVES).flatmap(_leaf_tx)
    if depth <= 0:
        return prim
    return st.one_of(prim, *[tx_of(k, depth) for k in COMBINATORS])


def tx_of(kind: str, depth: int = 2):
    """Descriptors whose outermost transform is ``kind``."""
    if kind in PRIMITIVES:
        return _leaf_tx(kind)
    inner = st.deferred(lambda: any_tx(depth - 1))
    if kind == "chain":
        return st.lists(inner, min_size=1, max_size=3).map(lambda ds: ("chain", ds))
    if kind == "named_chain":
        return st.lists(inner, min_size=1, max_size=3).map(
            lambda ds: ("named_chain", [(f"t{i}", d) for i, d in enumerate(ds)])
        )
    if kind == "multi_steps":
        return st.builds(
            lambda d, k: ("multi_steps", dict(inner=("tx", d), every_k=k)), inner, st.integers(1, 3)
        )
    raise AssertionError(kind)


# =============================================================================================
# trees, meshes and placements
# =============================================================================================
MESH_NAMES = {1: ("x",), 2: ("a", "b")}
MESH_SHAPES = [(2,), (4,), (2, 2)]


def _placement_choices(ndim: int) -> list:
    out = [Replicate(), Shard(0), Shard(-1)]
    if ndim >= 2:
        out.append(Shard(1))
    return out


def cases(mesh_shapes=MESH_SHAPES, max_leaves=3, frozen=True):
    """Problems for :func:`assert_sharded_equivalent` from the public strategy
    (:func:`functional_train.testing.sharded_cases`): 0-D to 3-D leaves (1-D and 2-D ones twice
    as often) whose sizes mostly do not divide the mesh, often smaller than it (empty shards);
    every placement pair on the 2-D mesh (nested ``[Shard(0), Shard(0)]``, ``Shard(-1)``
    included); a plain leaf now and then; a frozen leaf (``None`` gradients) now and then, never
    the only one; full-rank or rank-1 gradients at three scales; 3 or 4 steps."""
    return sharded_cases(
        mesh_shapes=st.sampled_from(mesh_shapes),
        max_leaves=max_leaves,
        ndims=(1, 2, 3, 1, 2, 0),
        sizes=(1, 2, 3, 5, 7),
        max_numel=49,
        steps=st.integers(3, 4),
        grad_scale=st.sampled_from([0.01, 1.0, 10.0]),
        frozen=frozen,
        plain=0.17,
    )


nest = _nest  # put a flat list of leaves into a small nested pytree (dict / list)


def make_mesh(shape, names=None):
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names or MESH_NAMES[len(shape)])


def replicated(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding ``x`` on every simulated rank.

    Plain leaves must be simulated tensors (``per_rank``), not ordinary tensors made outside the
    simulation: LocalTensorMode runs an in-place op whose operands mix an ordinary tensor with a
    simulated one once per rank on the same ordinary tensor (``x.div_(t)`` divides by ``t``
    world-size times), which is an artefact of the simulation, not of the library."""
    return per_rank(torch.distributed.get_world_size(), lambda r: x)


def shard(x, mesh, placements):
    if x is None:
        return None
    if placements is None:
        return replicated(x)
    return distribute_tensor(replicated(x), mesh, list(placements), src_data_rank=None)


# =============================================================================================
# 1. every transform: sharded == unsharded
# =============================================================================================
def _events(case) -> None:
    """Label the example (``--hypothesis-show-statistics`` shows how often each case came up)."""
    if not currently_in_test_context():
        return
    event(f"mesh {case.mesh_shape}")
    for _, shape, _, pl in case.leaves:
        if pl is None:
            event("plain leaf")
            continue
        sharded = [
            (shape[p.dim % len(shape)], n)
            for p, n in zip(pl, case.mesh_shape)
            if isinstance(p, Shard)
        ]
        if len(sharded) == 2 and pl[0] == pl[1]:
            event("nested sharding of one dim")
        if any(size % n for size, n in sharded):
            event("uneven shards")
        if any(size < n for size, n in sharded):
            event("empty shards")
    if case.frozen is not None:
        event("frozen leaf (None gradient)")
    event(f"gradient rank {case.grad_rank or 'full'}")


def check_equivalence(case, desc, explicit_mesh: bool) -> None:
    """The public harness: updates, states and params of every step, rank by rank (each rank's
    shard against its slice of the unsharded values), updates and params in the parameters'
    placements, no tree modified in place."""
    _events(case)
    assert_sharded_equivalent(
        build(desc), explicit_mesh=explicit_mesh, rtol=RTOL, atol=ATOL, **case
    )


@pytest.mark.parametrize("kind", ALL_KINDS)
@given(case=cases(), explicit_mesh=st.booleans(), data=st.data())
def test_transform_sharded_equals_unsharded(kind, case, explicit_mesh, data):
    check_equivalence(case, data.draw(tx_of(kind), label="transform"), explicit_mesh)


@given(case=cases(max_leaves=4), explicit_mesh=st.booleans(), desc=any_tx(depth=3))
def test_random_compositions_sharded_equal_unsharded(case, explicit_mesh, desc):
    note(f"transform: {desc}")
    check_equivalence(case, desc, explicit_mesh)


# The edge cases named in the design, for every kind, deterministically: a size smaller than the
# mesh (empty shards on some ranks), uneven sizes, nested sharding of one dim over both mesh
# dims, Shard(-1), a 3-D leaf and a plain replicated leaf.
_EDGE_LEAVES = {
    (4,): (
        ((3,), (Shard(0),)),
        ((5, 2), (Shard(-1),)),
        ((2, 1, 3), (Shard(1),)),
        ((7,), (Replicate(),)),
        ((2, 3), None),
    ),
    (2, 2): (
        ((5,), (Shard(0), Shard(0))),
        ((3, 1), (Shard(0), Shard(1))),
        ((1, 5, 2), (Replicate(), Shard(-1))),
        ((2, 3), (Shard(1), Replicate())),
        ((3,), None),
    ),
}


def _edge_desc(kind: str):
    return {
        "identity": ("identity", None),
        "clip": ("clip", dict(max_delta=0.5)),
        "clip_by_global_norm": ("clip_by_global_norm", dict(max_norm=0.5, norm_type=math.inf)),
        "scale": ("scale", dict(step_size=-0.5)),
        "scale_by_learning_rate": (
            "scale_by_learning_rate",
            dict(
                learning_rate=(
                    "schedule",
                    "warmup_cosine_decay_schedule",
                    dict(init_value=0.0, peak_value=0.1, warmup_steps=1, decay_steps=3),
                )
            ),
        ),
        "add_decayed_weights": ("add_decayed_weights", dict(weight_decay=0.1)),
        "trace": ("trace", dict(decay=0.9, nesterov=True)),
        "scale_by_adam": ("scale_by_adam", dict(amsgrad=True)),
        "sgd": ("sgd", dict(learning_rate=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1)),
        "adam": ("adam", dict(learning_rate=0.1, weight_decay=0.1, amsgrad=True)),
        "adamw": ("adamw", dict(learning_rate=0.1, weight_decay=0.1)),
        "chain": (
            "chain",
            [
                ("clip_by_global_norm", dict(max_norm=0.5, norm_type=1.0)),
                ("adamw", dict(learning_rate=0.1)),
            ],
        ),
        "named_chain": (
            "named_chain",
            [
                ("clip", ("clip_by_global_norm", dict(max_norm=0.5))),
                ("opt", ("sgd", dict(learning_rate=0.1, momentum=0.5))),
            ],
        ),
        "scale_by_factored_rms": ("scale_by_factored_rms", dict()),
        "clip_by_block_rms": ("clip_by_block_rms", dict(threshold=0.5)),
        "scale_by_param_block_rms": ("scale_by_param_block_rms", dict(min_scale=0.01)),
        "ema": ("ema", dict(decay=0.9, debias=True)),
        "adafactor": ("adafactor", dict(beta1=0.9, weight_decay=0.1)),
        "multi_steps": (
            "multi_steps",
            dict(
                inner=(
                    "tx",
                    (
                        "chain",
                        [
                            ("clip_by_global_norm", dict(max_norm=0.5, norm_type=3.0)),
                            ("adam", dict(learning_rate=0.1)),
                        ],
                    ),
                ),
                every_k=2,
            ),
        ),
    }[kind]


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_uneven_and_empty_shards(kind, mesh_shape):
    leaves = _EDGE_LEAVES[mesh_shape]
    gen = torch.Generator().manual_seed(7)
    params = nest([torch.randn(s, generator=gen) for s, _ in leaves])
    grads = [nest([torch.randn(s, generator=gen) for s, _ in leaves]) for _ in range(4)]
    assert_sharded_equivalent(
        build(_edge_desc(kind)),
        params,
        grads,
        mesh_shape=mesh_shape,
        placements=nest([pl for _, pl in leaves]),
        rtol=RTOL,
        atol=ATOL,
        explicit_mesh=len(mesh_shape) == 2,
    )


def test_global_norm_function_matches_unsharded():
    """``ft.global_norm`` (the public function) on sharded trees, every norm type."""
    leaves = _EDGE_LEAVES[(2, 2)]
    gen = torch.Generator().manual_seed(3)
    vals = [torch.randn(s, generator=gen) for s, _ in leaves]
    want = {
        p: torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in vals]), p)
        for p in (2.0, 1.0, 3.0, math.inf)
    }
    with simulate(4):
        m = make_mesh((2, 2))
        tree = nest([shard(v, m, pl) for v, (_, pl) in zip(vals, leaves)])
        got = {p: [on_rank(ft.global_norm(tree, norm_type=p), r) for r in range(4)] for p in want}
    for p, w in want.items():
        for r, g in enumerate(got[p]):
            torch.testing.assert_close(
                g, w, rtol=RTOL, atol=ATOL, msg=lambda m: f"p={p} rank {r}: {m}"
            )


# =============================================================================================
# 2. pipeline axis: stages hold different leaves, the norm sums over them
# =============================================================================================
@st.composite
def stage_trees(draw):
    n = draw(st.integers(1, 3))
    leaves = []
    for _ in range(n):
        ndim = draw(st.integers(1, 2))
        shape = tuple(draw(st.sampled_from([1, 2, 3, 5])) for _ in range(ndim))
        pl = draw(st.sampled_from([None] + _placement_choices(ndim)))
        leaves.append((shape, pl))
    return tuple(leaves)


@given(
    leaves=stage_trees(),
    norm_type=st.sampled_from([2.0, 1.0, math.inf]),
    max_norm=st.sampled_from([0.1, 1.0, 100.0]),
    seed=st.integers(0, 2**16),
    with_adam=st.booleans(),
)
def test_pipeline_axis_norm_sums_over_stages(leaves, norm_type, max_norm, seed, with_adam):
    """(2 pp x 2 tp): stage s (ranks 2s, 2s+1) holds its own leaves (same shapes, different
    values). The clipping norm is the norm of the union of both stages' leaves and each stage's
    clipped updates (and, through adamw, its params) are those of the union tree."""
    gen = torch.Generator().manual_seed(seed)
    steps = 3
    P = [[torch.randn(s, generator=gen) for s, _ in leaves] for _ in range(2)]  # [stage][leaf]
    G = [
        [[torch.randn(s, generator=gen) for s, _ in leaves] for _ in range(2)] for _ in range(steps)
    ]

    def desc():
        d = [("clip_by_global_norm", dict(max_norm=max_norm, norm_type=norm_type))]
        if with_adam:
            d.append(("adamw", dict(learning_rate=0.1, weight_decay=0.1)))
        return ("chain", d)

    union = lambda per_stage: {"s0": nest(per_stage[0]), "s1": nest(per_stage[1])}  # noqa: E731
    ref_ups, ref_states, ref_params = run_steps(
        build(desc()), union(P), [union(g) for g in G], None
    )

    def stage_tensor(m, values, pl):
        if pl is None:
            return per_rank(4, lambda r: values[r // 2])
        return distribute_tensor(
            per_rank(4, lambda r: values[r // 2]), m["tp"], [pl], src_data_rank=None
        )

    with simulate(4):
        m = make_mesh((2, 2), ("pp", "tp"))
        mesh = ft.Mesh(m, pipeline_axis="pp")
        dP = nest([stage_tensor(m, [P[0][i], P[1][i]], pl) for i, (_, pl) in enumerate(leaves)])
        dG = [
            nest([stage_tensor(m, [g[0][i], g[1][i]], pl) for i, (_, pl) in enumerate(leaves)])
            for g in G
        ]
        with count_collectives() as c:
            tx = build(desc())
            state = tx.init(dP)
            u, state = tx.update(dG[0], state, dP, mesh=mesh)
        assert c.counts == {"all_reduce": 1}, c
        ups, states, out = run_steps(build(desc()), dP, dG, mesh)
        got_ups = [rank_views(x, 4) for x in ups]
        got_norms = [[on_rank(ft.tree_get(s, "global_norm"), r) for r in range(4)] for s in states]
        got_params = rank_views(out, 4)
    for t in range(steps):
        want_norm = ft.tree_get(ref_states[t], "global_norm")
        for r in range(4):
            torch.testing.assert_close(
                got_norms[t][r],
                want_norm,
                rtol=RTOL,
                atol=ATOL,
                msg=lambda msg: f"step {t} rank {r} norm: {msg}",
            )
            stage = f"s{r // 2}"
            assert_tree_close(got_ups[t][r], ref_ups[t][stage], f"step {t} rank {r} updates")
    for r in range(4):
        assert_tree_close(got_params[r], ref_params[f"s{r // 2}"], f"rank {r} params")


# =============================================================================================
# 3. expert axis: expert leaves differ per ep rank, the others are replicated over it
# =============================================================================================
@given(
    n_experts=st.integers(1, 2),
    dense=stage_trees(),
    norm_type=st.sampled_from([2.0, 1.0, math.inf]),
    max_norm=st.sampled_from([0.1, 1.0, 100.0]),
    seed=st.integers(0, 2**16),
    expert_pl=st.sampled_from([None, Replicate(), Shard(0), Shard(1), Shard(-1)]),
)
def test_expert_axis_norm_counts_every_expert_once(
    n_experts, dense, norm_type, max_norm, seed, expert_pl
):
    """(2 ep x 2 tp), ``Mesh(m, expert_axis="ep", is_expert=...)``: the norm is the norm over all
    experts of every ep rank plus the non-expert leaves counted once."""
    gen = torch.Generator().manual_seed(seed)
    steps = 3
    eshape = (3, 2)
    E = lambda: [[torch.randn(eshape, generator=gen) for _ in range(n_experts)] for _ in range(2)]  # noqa: E731
    D = lambda: [torch.randn(s, generator=gen) for s, _ in dense]  # noqa: E731
    P_e, P_d = E(), D()
    G = [(E(), D()) for _ in range(steps)]
    desc = (
        "chain",
        [
            ("clip_by_global_norm", dict(max_norm=max_norm, norm_type=norm_type)),
            ("adamw", dict(learning_rate=0.1, weight_decay=0.1)),
        ],
    )

    def union(e, d):  # all experts of both ep ranks, the dense leaves once
        return {"experts": {f"ep{j}": e[j] for j in range(2)}, "dense": nest(d)}

    ref_ups, ref_states, ref_params = run_steps(
        build(desc), union(P_e, P_d), [union(e, d) for e, d in G], None
    )

    def local_tree(m, e, d):
        def ex(i):
            v = per_rank(4, lambda r: e[r // 2][i])
            return (
                v
                if expert_pl is None
                else distribute_tensor(v, m["tp"], [expert_pl], src_data_rank=None)
            )

        return {
            "experts": [ex(i) for i in range(n_experts)],
            "dense": nest(
                [shard(x, m["tp"], None if pl is None else [pl]) for x, (_, pl) in zip(d, dense)]
            ),
        }

    with simulate(4):
        m = make_mesh((2, 2), ("ep", "tp"))
        mesh = ft.Mesh(m, expert_axis="ep", is_expert=lambda path: path.startswith("experts"))
        dP = local_tree(m, P_e, P_d)
        dG = [local_tree(m, e, d) for e, d in G]
        ups, states, out = run_steps(build(desc), dP, dG, mesh)
        got_ups = [rank_views(x, 4) for x in ups]
        got_norms = [[on_rank(ft.tree_get(s, "global_norm"), r) for r in range(4)] for s in states]
        got_params = rank_views(out, 4)
    for t in range(steps):
        want_norm = ft.tree_get(ref_states[t], "global_norm")
        for r in range(4):
            torch.testing.assert_close(
                got_norms[t][r],
                want_norm,
                rtol=RTOL,
                atol=ATOL,
                msg=lambda msg: f"step {t} rank {r} norm: {msg}",
            )
            want = {"experts": ref_ups[t]["experts"][f"ep{r // 2}"], "dense": ref_ups[t]["dense"]}
            assert_tree_close(got_ups[t][r], want, f"step {t} rank {r} updates")
    for r in range(4):
        want = {"experts": ref_params["experts"][f"ep{r // 2}"], "dense": ref_params["dense"]}
        assert_tree_close(got_params[r], want, f"rank {r} params")


_STACKED_OPT = {
    "adam": (("adam", dict(learning_rate=0.1)), 0),
    # per-leaf statistics over the whole stack: trust-ratio norms, update RMS
    "lamb": (("lamb", dict(learning_rate=0.1, weight_decay=0.1)), 1),
    "adafactor": (("adafactor", dict(learning_rate=0.1, relative_step=False, beta1=0.9)), 1),
}


@pytest.mark.parametrize("tp_pl", [Replicate(), Shard(1), Shard(0)])
@pytest.mark.parametrize("declare", [False, True])
@pytest.mark.parametrize("opt", list(_STACKED_OPT))
def test_stacked_experts_need_no_declaration(tp_pl, declare, opt):
    """Experts stacked in one DTensor ``Shard(0)`` over the ep mesh dim are plain sharding: the
    norm is the norm of the whole stack (plus the dense leaves), with or without expert_axis,
    and per-leaf statistics (lamb's norms, adafactor's update RMS) are the whole stack's: the
    expert dim joins their one all-reduce (it used to be left out, as for marked experts)."""
    gen = torch.Generator().manual_seed(0)
    steps = 3

    def mk():
        return {
            "experts": torch.randn(3, 4, 5, generator=gen),  # (3 over 2: uneven)
            "dense": torch.randn(4, 5, generator=gen),
        }

    P, G = mk(), [mk() for _ in range(steps)]
    inner, stats = _STACKED_OPT[opt]
    desc = ("chain", [("clip_by_global_norm", dict(max_norm=1.0)), inner])
    ref_ups, ref_states, ref_params = run_steps(build(desc), P, G, None)
    with simulate(4):
        m = make_mesh((2, 2), ("ep", "tp"))
        mesh = ft.Mesh(m, expert_axis="ep", is_expert=lambda p: False) if declare else ft.Mesh(m)

        def d(t):
            return {
                "experts": shard(t["experts"], m, [Shard(0), tp_pl]),
                "dense": shard(t["dense"], m["tp"], [Replicate()]),
            }

        dP, dG = d(P), [d(g) for g in G]
        with count_collectives() as c:
            ups, states, out = run_steps(build(desc), dP, dG, mesh)
        if opt == "adafactor" and tp_pl == Shard(1):
            stats = 2  # and the factored column statistic over the tp-split dim 1
        assert c.counts == {"all_reduce": steps * (1 + stats)}, c
        got = [(rank_views(u, 4), rank_views(s, 4)) for u, s in zip(ups, states)]
        got_params = rank_views(out, 4)
    for t, (gu, gs) in enumerate(got):
        for r in range(4):
            assert_tree_close(gu[r], ref_ups[t], f"step {t} rank {r} updates")
            assert_tree_close(gs[r], ref_states[t], f"step {t} rank {r} state")
    for r in range(4):
        assert_tree_close(got_params[r], ref_params, f"rank {r} params")


@pytest.mark.parametrize("opt", ["lamb", "adafactor"])
def test_stacked_and_marked_experts_together(opt):
    """Experts stacked in a DTensor ``Shard(0)`` over ep beside experts that ``is_expert``
    marks (each ep rank its own leaf under the same path), on (ep=2, tp=2): per-leaf
    statistics complete the stack's over ep and keep each rank's marked experts apart (each
    statistic reduction then takes two all-reduces, one over ep x tp and one over tp),
    against the unsharded union of every rank's leaves."""
    gen = torch.Generator().manual_seed(1)
    steps = 3

    def mk():
        return {
            "stack": torch.randn(4, 3, 5, generator=gen),
            "own": [torch.randn(3, 5, generator=gen) for _ in range(2)],  # per ep rank
            "dense": torch.randn(4, 5, generator=gen),
        }

    P, G = mk(), [mk() for _ in range(steps)]
    inner, _ = _STACKED_OPT[opt]
    desc = ("chain", [("clip_by_global_norm", dict(max_norm=1.0)), inner])
    ref_ups, _, ref_params = run_steps(build(desc), P, G, None)
    with simulate(4):
        m = make_mesh((2, 2), ("ep", "tp"))
        mesh = ft.Mesh(m, expert_axis="ep", is_expert=lambda p: p.startswith("own"))

        def d(t):
            return {
                "stack": shard(t["stack"], m, [Shard(0), Shard(1)]),
                "own": distribute_tensor(
                    per_rank(4, lambda r: t["own"][r // 2]), m["tp"], [Shard(0)], src_data_rank=None
                ),
                "dense": shard(t["dense"], m["tp"], [Replicate()]),
            }

        dP, dG = d(P), [d(g) for g in G]
        with count_collectives() as c:
            ups, _, out = run_steps(build(desc), dP, dG, mesh)
        # the clip's; lamb's norms, adafactor's update RMS and its factored column statistics
        # (both leaves split over tp along dim -2), each once over ep x tp and once over tp
        assert c.counts == {"all_reduce": steps * {"lamb": 3, "adafactor": 5}[opt]}, c
        got = [rank_views(u, 4) for u in ups]
        got_params = rank_views(out, 4)

    def of_rank(tree, r):
        return {"stack": tree["stack"], "own": tree["own"][r // 2], "dense": tree["dense"]}

    for t, gu in enumerate(got):
        for r in range(4):
            assert_tree_close(gu[r], of_rank(ref_ups[t], r), f"step {t} rank {r} updates")
    for r in range(4):
        assert_tree_close(got_params[r], of_rank(ref_params, r), f"rank {r} params")


# =============================================================================================
# 4. data axis: per-replica contributions are averaged, Partial is summed, gradients come out
#    in the parameter's placements
# =============================================================================================
# A leaf of the data-axis tests lives on one of:
#   "plain": a plain tensor (replicated parameter; its gradient is each dp rank's contribution);
#   "sub":   a DTensor on the sub-mesh without the data axis (m["tp"]), unreduced over dp;
#   "full":  a DTensor on the whole mesh, whose gradient is reduced over dp unless Partial there.
# Gradient placements are drawn independently of the parameter's, Partial("sum"/"avg") included.
_GRAD_PL = [Replicate(), Shard(0), Shard(-1), Partial(), Partial("avg")]
_PARAM_PL = [Replicate(), Shard(0), Shard(-1)]


@st.composite
def data_cases(draw):
    kind = draw(st.sampled_from(["dp2", "dp4", "dp_tp", "tp_dp"]))
    shape, names = {
        "dp2": ((2,), ("dp",)),
        "dp4": ((4,), ("dp",)),
        "dp_tp": ((2, 2), ("dp", "tp")),
        "tp_dp": ((2, 2), ("tp", "dp")),
    }[kind]
    homes = ["plain", "full"] + (["sub"] if len(shape) == 2 else [])
    leaves = []
    for _ in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 2))
        lshape = tuple(draw(st.sampled_from([1, 2, 3, 5])) for _ in range(ndim))
        home = draw(st.sampled_from(homes))
        nd = {"plain": 0, "sub": 1, "full": len(shape)}[home]
        ppl = tuple(draw(st.sampled_from(_PARAM_PL)) for _ in range(nd))
        gpl = (
            ppl
            if draw(st.booleans())
            else tuple(draw(st.sampled_from(_GRAD_PL)) for _ in range(nd))
        )
        leaves.append((lshape, home, ppl, gpl))
    return dict(
        mesh_shape=shape,
        names=names,
        leaves=tuple(leaves),
        seed=draw(st.integers(0, 2**16)),
        steps=draw(st.integers(3, 4)),
    )


def _leaf_mesh_dims(case, home):
    """World dim index of each mesh dim of a leaf living on ``home``."""
    names = case["names"]
    if home == "plain":
        return ()
    if home == "full":
        return tuple(range(len(names)))
    return (names.index("tp"),)


def _contribution_key(case, home, gpl, r):
    """Which contribution rank ``r`` holds: its coordinates along the dims over which the
    gradient is unreduced (the data axis for plain / sub-mesh leaves, every Partial dim)."""
    c = _unravel(r, case["mesh_shape"])
    dp = case["names"].index("dp")
    dims = _leaf_mesh_dims(case, home)
    key = []
    if dp not in dims:
        key.append(("dp", c[dp]))
    for d, p in zip(dims, gpl):
        if isinstance(p, Partial):
            key.append((d, c[d]))
    return tuple(key)


def _expected_grad(case, home, gpl, contrib: dict) -> torch.Tensor:
    """Reduce the contributions as the semantics say: Partial dims by their op, then the data
    axis by a mean (DDP)."""
    dims = _leaf_mesh_dims(case, home)
    ops = {d: p.reduce_op for d, p in zip(dims, gpl) if isinstance(p, Partial)}
    # group contributions key by key: reduce Partial dims first (innermost), then dp
    items = dict(contrib)

    def reduce_dim(items, dim, op):
        groups: dict = {}
        for key, v in items.items():
            rest = tuple(k for k in key if k[0] != dim)
            groups.setdefault(rest, []).append(v)
        return {
            k: (torch.stack(vs).sum(0) if op == "sum" else torch.stack(vs).mean(0))
            for k, vs in groups.items()
        }

    for d, op in ops.items():
        items = reduce_dim(items, d, op)
    items = reduce_dim(items, "dp", "avg")
    assert list(items) == [()]
    return items[()]


def _grad_leaf(case, m, home, ppl, gpl, contrib: dict, world: int, shape):
    """The simulated gradient leaf whose rank ``r`` holds contribution ``key(r)``."""
    fn = lambda r: contrib[_contribution_key(case, home, gpl, r)]  # noqa: E731
    if home == "plain":
        return per_rank(world, fn)
    dm = m if home == "full" else m["tp"]
    no_partial = [Replicate() if isinstance(p, Partial) else p for p in gpl]
    loc = distribute_tensor(per_rank(world, fn), dm, no_partial, src_data_rank=None).to_local()
    full = torch.empty(shape)
    return DTensor.from_local(
        loc, dm, list(gpl), run_check=False, shape=full.shape, stride=full.stride()
    )


def _param_leaf(m, home, ppl, value):
    if home == "plain":
        return replicated(value)
    return shard(value, m if home == "full" else m["tp"], ppl)


@given(case=data_cases(), desc=any_tx(depth=2))
def test_data_axis_mean_partial_sum_and_param_placements(case, desc):
    """Gradients unreduced over the data axis (plain tensors, sub-mesh DTensors) are averaged
    over it; ``Partial`` gradients are reduced as their op says; gradients in placements other
    than the parameter's come out in the parameter's. The whole run equals the unsharded run on
    the reduced gradients."""
    note(f"transform: {desc}")
    event(f"mesh {case['names']}")
    for _, home, ppl, gpl in case["leaves"]:
        event(f"{home} leaf")
        if any(isinstance(p, Partial) for p in gpl):
            event("Partial gradient")
        if tuple(gpl) != tuple(ppl):
            event("gradient placements differ from the parameter's")
    world = math.prod(case["mesh_shape"])
    gen = torch.Generator().manual_seed(case["seed"])
    # every possible contribution key of every leaf, for every step
    keys_per_leaf = []
    for _shape, home, _ppl, gpl in case["leaves"]:
        keys = sorted({_contribution_key(case, home, gpl, r) for r in range(world)})
        keys_per_leaf.append(keys)
    P = [torch.randn(s, generator=gen) for s, *_ in case["leaves"]]
    C = [
        [
            {k: torch.randn(s, generator=gen) for k in keys}
            for (s, *_), keys in zip(case["leaves"], keys_per_leaf)
        ]
        for _ in range(case["steps"])
    ]
    ref_grads = [
        nest(
            [_expected_grad(case, home, gpl, c) for (_, home, _, gpl), c in zip(case["leaves"], cs)]
        )
        for cs in C
    ]
    if passes_unreduced(build(desc)):
        # identity-like transforms return the gradients still unreduced (see
        # test_identity_returns_unreduced_gradients); follow them with one that needs the values
        event("pass-through transform, followed by scale(1.0)")
        desc = ("chain", [desc, ("scale", dict(step_size=1.0))])
    ref_ups, ref_states, ref_params = run_steps(build(desc), nest(P), ref_grads, None)
    with simulate(world):
        m = make_mesh(case["mesh_shape"], case["names"])
        mesh = ft.Mesh(m, data_axis="dp")
        dP = nest([_param_leaf(m, home, ppl, p) for (_, home, ppl, _), p in zip(case["leaves"], P)])
        dG = [
            nest(
                [
                    _grad_leaf(case, m, home, ppl, gpl, c, world, s)
                    for (s, home, ppl, gpl), c in zip(case["leaves"], cs)
                ]
            )
            for cs in C
        ]
        ups, states, out = run_steps(build(desc), dP, dG, mesh)
        for t, u in enumerate(ups):
            assert_placements_like(u, dP, f"step {t} updates")
        assert_placements_like(out, dP, "final params")
        got_ups = [rank_views(u, world) for u in ups]
        got_states = [rank_views(_drop_acc(s), world) for s in states]
        got_params = rank_views(out, world)
    for r in range(world):
        for t in range(case["steps"]):
            assert_tree_close(got_ups[t][r], ref_ups[t], f"rank {r} step {t} updates")
            assert_tree_close(
                got_states[t][r], _drop_acc(ref_states[t]), f"rank {r} step {t} state"
            )
        assert_tree_close(got_params[r], ref_params, f"rank {r} final params")


def _drop_acc(state):
    """States without ``MultiStepsState.acc_grads``: the accumulator holds each rank's own
    unreduced contribution by design, so it has no unsharded counterpart."""
    if isinstance(state, ft.MultiStepsState):
        return state._replace(acc_grads=None, inner_state=_drop_acc(state.inner_state))
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(_drop_acc(s) for s in state)
    if isinstance(state, dict):
        return {k: _drop_acc(v) for k, v in state.items()}
    return state


def test_shard0_grad_for_replicated_param_comes_out_replicated():
    """Autograd gives a ``Shard(0)`` bias gradient for a ``Replicate()`` bias next to a
    colwise-sharded weight: updates come out in the parameter's placements."""
    gen = torch.Generator().manual_seed(1)
    P = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(5, generator=gen)}
    G = [{k: torch.randn(v.shape, generator=gen) for k, v in P.items()} for _ in range(3)]
    desc = (
        "chain",
        [("clip_by_global_norm", dict(max_norm=0.5)), ("adamw", dict(learning_rate=0.1))],
    )
    ref_ups, _, ref_params = run_steps(build(desc), P, G, None)
    with simulate(4):
        m = make_mesh((2, 2), ("dp", "tp"))
        tp = m["tp"]
        dP = {"w": shard(P["w"], tp, [Shard(0)]), "b": shard(P["b"], tp, [Replicate()])}
        dG = [{"w": shard(g["w"], tp, [Shard(0)]), "b": shard(g["b"], tp, [Shard(0)])} for g in G]
        ups, _, out = run_steps(build(desc), dP, dG, ft.Mesh(m))
        for u in ups:
            for k in P:
                assert u[k].placements == dP[k].placements, (k, u[k].placements)
        got = [rank_views(u, 4)[0] for u in ups]
        got_params = rank_views(out, 4)[0]
    for t, u in enumerate(got):
        assert_tree_close(u, ref_ups[t], f"step {t}")
    assert_tree_close(got_params, ref_params, "params")


def test_nested_uneven_grad_for_replicated_param_after_a_norm():
    """A ``[Shard(0), Shard(0)]`` gradient (nested, uneven: 5 rows as 2/1/1/1) for a
    ``[Replicate(), Replicate()]`` parameter on a 2x2 mesh is redistributed into the parameter's
    placements. That must stay right after the global norm of a previous step has run on the
    mesh (it flattens the mesh for its one all-reduce)."""
    gen = torch.Generator().manual_seed(2)
    P = {"w": torch.randn(5, 3, generator=gen)}
    G = [{"w": torch.randn(5, 3, generator=gen)} for _ in range(3)]
    desc = (
        "chain",
        [("clip_by_global_norm", dict(max_norm=1.0)), ("sgd", dict(learning_rate=0.1))],
    )
    ref_ups, _, ref_params = run_steps(build(desc), P, G, None)
    with simulate(4):
        m = make_mesh((2, 2))
        dP = {"w": shard(P["w"], m, [Replicate(), Replicate()])}
        dG = [{"w": shard(g["w"], m, [Shard(0), Shard(0)])} for g in G]
        ups, _, out = run_steps(build(desc), dP, dG, ft.Mesh(m))
        got = [rank_views(u, 4) for u in ups]
        got_params = rank_views(out, 4)
    for t in range(3):
        for r in range(4):
            assert_tree_close(got[t][r], ref_ups[t], f"step {t} rank {r} updates")
    for r in range(4):
        assert_tree_close(got_params[r], ref_params, f"rank {r} params")


def test_update_leaves_the_users_mesh_behaving_as_before():
    """Purity beyond the arguments: after an update, the user's own DTensors on the same mesh
    still gather to their values (``full_tensor`` of a nested, uneven ``[Shard(0), Shard(0)]``
    DTensor). Flattening the user's DeviceMesh as a side effect changes how DTensor
    redistributes on it (pytorch/pytorch#194457: the flattened all-gather ignores nested uneven
    chunk sizes)."""
    x = torch.arange(5.0)
    with simulate(4):
        m = make_mesh((2, 2))
        d = shard(x, m, [Shard(0), Shard(0)])
        before = on_rank(d.full_tensor(), 0).clone()
        tx = ft.clip_by_global_norm(1.0)
        tx.update({"w": d}, tx.init({"w": d}), {"w": d}, mesh=ft.Mesh(m))
        after = [on_rank(d.full_tensor(), r).clone() for r in range(4)]
    torch.testing.assert_close(before, x)
    for r in range(4):
        torch.testing.assert_close(after[r], x, msg=lambda msg: f"rank {r}: {msg}")


def test_identity_returns_unreduced_gradients():
    """``identity`` (and chains of it) needs no value: under a data axis it returns each rank's
    own contribution untouched, the same objects, with no collective."""
    with simulate(4):
        m = make_mesh((2, 2), ("dp", "tp"))
        mesh = ft.Mesh(m, data_axis="dp")
        gen = torch.Generator().manual_seed(0)
        c = [torch.randn(5, 2, generator=gen) for _ in range(2)]
        grads = {
            "plain": per_rank(4, lambda r: c[r // 2][0]),
            "tp": distribute_tensor(
                per_rank(4, lambda r: c[r // 2]), m["tp"], [Shard(0)], src_data_rank=None
            ),
        }
        params = {
            "plain": replicated(torch.zeros(2)),
            "tp": shard(torch.zeros(5, 2), m["tp"], [Shard(0)]),
        }
        for tx in (
            ft.identity(),
            ft.chain(ft.identity(), ft.identity()),
            ft.named_chain(("a", ft.identity())),
        ):
            with count_collectives() as cnt:
                u, _ = tx.update(grads, tx.init(params), params, mesh=mesh)
            assert cnt.total == 0, cnt
            assert u["plain"] is grads["plain"] and u["tp"] is grads["tp"]


def test_multi_steps_of_identity_then_reducing_transform():
    """``chain(multi_steps(identity(), 2), scale(1.0))`` under a data axis: multi_steps passes
    the still-unreduced mean of its inner identity on, so the transform after it must still
    reduce it (DDP mean), as it does for ``chain(identity(), scale(1.0))``."""
    gen = torch.Generator().manual_seed(0)
    contrib = [[torch.randn(3, generator=gen) for _ in range(2)] for _ in range(2)]  # [step][dp]
    results = {}
    for name, tx in {
        "chain(identity, scale)": ft.chain(ft.identity(), ft.scale(1.0)),
        "chain(multi_steps(identity), scale)": ft.chain(
            ft.multi_steps(ft.identity(), 2), ft.scale(1.0)
        ),
    }.items():
        with simulate(2):
            m = make_mesh((2,), ("dp",))
            mesh = ft.Mesh(m, data_axis="dp")
            p = {"w": torch.zeros(3)}
            state = tx.init(p)
            for g in contrib:
                u, state = tx.update({"w": per_rank(2, lambda r: g[r])}, state, p, mesh=mesh)
            results[name] = [on_rank(u["w"], r).clone() for r in range(2)]
    want = {
        "chain(identity, scale)": (contrib[1][0] + contrib[1][1]) / 2,  # last step's DDP mean
        "chain(multi_steps(identity), scale)":  # the DDP mean of the 2 micro-steps' mean
        (contrib[0][0] + contrib[0][1] + contrib[1][0] + contrib[1][1]) / 4,
    }
    for name, per in results.items():
        for r in range(2):
            torch.testing.assert_close(
                per[r], want[name], msg=lambda msg: f"{name} rank {r}: {msg}"
            )


def test_data_axis_worked_example_collective_count():
    """The contract example: multi_steps(chain(clip, adamw)) over a (dp x tp) mesh equals the
    unsharded run on DDP-mean gradients, with 3 all-reduces per inner step (the presence
    agreement over dp, the mean, the clip norm) and none between."""
    gen = torch.Generator().manual_seed(0)
    P = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    G = [
        [{k: torch.randn(v.shape, generator=gen) for k, v in P.items()} for _ in range(2)]
        for _ in range(4)
    ]
    desc = (
        "multi_steps",
        dict(
            inner=(
                "tx",
                (
                    "chain",
                    [
                        ("clip_by_global_norm", dict(max_norm=0.5)),
                        ("adamw", dict(learning_rate=1e-2, weight_decay=0.1)),
                    ],
                ),
            ),
            every_k=2,
        ),
    )
    _, _, ref = run_steps(
        build(desc), P, [{k: (g[0][k] + g[1][k]) / 2 for k in P} for g in G], None
    )
    with simulate(4):
        m = make_mesh((2, 2), ("dp", "tp"))
        tp = m["tp"]
        dP = {"w": shard(P["w"], tp, [Shard(0)]), "b": replicated(P["b"])}
        dG = [
            {
                "w": distribute_tensor(
                    per_rank(4, lambda r: g[r // 2]["w"]), tp, [Shard(0)], src_data_rank=None
                ),
                "b": per_rank(4, lambda r: g[r // 2]["b"]),
            }
            for g in G
        ]
        with count_collectives() as c:
            _, _, out = run_steps(build(desc), dP, dG, ft.Mesh(m, data_axis="dp"))
        got = rank_views(out, 4)
    assert c.counts == {"all_reduce": 6}, c
    for r in range(4):
        assert_tree_close(got[r], ref, f"rank {r}")


# =============================================================================================
# 5. everything at once: pipeline x data x expert x tensor parallel
# =============================================================================================
def test_pp_dp_ep_tp_mesh_equals_unsharded_union():
    """A (pp=2, dp=2, ep=2, tp=2) mesh, 16 simulated ranks: stages differ over pp, experts over
    (pp, ep); the expert axis is data parallel too: dense gradients are per-(dp, ep)-rank
    contributions, an expert's gradient sums its ep group's contributions (what the all-to-all
    dispatch gives). ``chain(clip_by_global_norm, adamw)`` equals the unsharded run on the union
    of every stage's and expert's leaves with the mean gradients over all dp x ep ranks, with
    five all-reduces per step (presence over dp then ep, the mean over dp then ep, the norm)."""
    shape, names = (2, 2, 2, 2), ("pp", "dp", "ep", "tp")
    world, steps = 16, 2
    gen = torch.Generator().manual_seed(11)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    # parameters: dense [pp], experts [pp][ep], bias [pp]
    Pd = [rnd(5, 2) for _ in range(2)]
    Pe = [[rnd(3, 3) for _ in range(2)] for _ in range(2)]
    Pb = [rnd(3) for _ in range(2)]
    # gradients, per step: dense [pp][dp][ep], experts [pp][ep][dp] (sums over ep),
    # bias [pp][dp][ep]
    Gd = [
        [[[rnd(5, 2) for _ in range(2)] for _ in range(2)] for _ in range(2)] for _ in range(steps)
    ]
    Ge = [
        [[[rnd(3, 3) for _ in range(2)] for _ in range(2)] for _ in range(2)] for _ in range(steps)
    ]
    Gb = [[[[rnd(3) for _ in range(2)] for _ in range(2)] for _ in range(2)] for _ in range(steps)]
    mean = lambda xs: (xs[0] + xs[1]) / 2  # noqa: E731
    mean2 = lambda xs: (xs[0][0] + xs[0][1] + xs[1][0] + xs[1][1]) / 4  # noqa: E731

    def union(d, e, b):
        return {
            f"s{p}": {"dense": d[p], "experts": {f"e{j}": e[p][j] for j in range(2)}, "b": b[p]}
            for p in range(2)
        }

    ref_P = union(Pd, Pe, Pb)
    ref_G = [
        union(
            [mean2(Gd[t][p]) for p in range(2)],
            [[mean(Ge[t][p][j]) / 2 for j in range(2)] for p in range(2)],
            [mean2(Gb[t][p]) for p in range(2)],
        )
        for t in range(steps)
    ]
    desc = (
        "chain",
        [
            ("clip_by_global_norm", dict(max_norm=1.0)),
            ("adamw", dict(learning_rate=0.1, weight_decay=0.1)),
        ],
    )
    ref_ups, ref_states, ref_params = run_steps(build(desc), ref_P, ref_G, None)

    co = lambda r: dict(zip(names, _unravel(r, shape)))  # noqa: E731
    with simulate(world):
        m = make_mesh(shape, names)
        tp = m["tp"]
        mesh = ft.Mesh(
            m,
            data_axis="dp",
            pipeline_axis="pp",
            expert_axis="ep",
            is_expert=lambda path: path.startswith("experts"),
        )

        def on_tp(fn, pl):
            return distribute_tensor(per_rank(world, fn), tp, [pl], src_data_rank=None)

        dP = {
            "dense": on_tp(lambda r: Pd[co(r)["pp"]], Shard(0)),
            "experts": on_tp(lambda r: Pe[co(r)["pp"]][co(r)["ep"]], Shard(1)),
            "b": per_rank(world, lambda r: Pb[co(r)["pp"]]),
        }
        dG = [
            {
                "dense": on_tp(lambda r: Gd[t][co(r)["pp"]][co(r)["dp"]][co(r)["ep"]], Shard(0)),
                "experts": on_tp(lambda r: Ge[t][co(r)["pp"]][co(r)["ep"]][co(r)["dp"]], Shard(1)),
                "b": per_rank(world, lambda r: Gb[t][co(r)["pp"]][co(r)["dp"]][co(r)["ep"]]),
            }
            for t in range(steps)
        ]
        with count_collectives() as c:
            ups, states, out = run_steps(build(desc), dP, dG, mesh)
        got_ups = [rank_views(u, world) for u in ups]
        got_norms = [
            [on_rank(ft.tree_get(st_, "global_norm"), r) for r in range(world)] for st_ in states
        ]
        got_params = rank_views(out, world)
    assert c.counts == {"all_reduce": 5 * steps}, c  # presence and mean over dp, ep; norm

    def mine(tree, r):
        p, e = co(r)["pp"], co(r)["ep"]
        return {
            "dense": tree[f"s{p}"]["dense"],
            "experts": tree[f"s{p}"]["experts"][f"e{e}"],
            "b": tree[f"s{p}"]["b"],
        }

    for t in range(steps):
        want_norm = ft.tree_get(ref_states[t], "global_norm")
        for r in range(world):
            torch.testing.assert_close(
                got_norms[t][r],
                want_norm,
                rtol=RTOL,
                atol=ATOL,
                msg=lambda msg: f"step {t} rank {r} norm: {msg}",
            )
            assert_tree_close(got_ups[t][r], mine(ref_ups[t], r), f"step {t} rank {r} updates")
    for r in range(world):
        assert_tree_close(got_params[r], mine(ref_params, r), f"rank {r} params")
