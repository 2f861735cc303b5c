"""The per-layout plan: everything about one ``update`` call that depends only on the layout.

A layout is the tree structure, each leaf's kind (plain tensor, DTensor, ``None``), its mesh,
placements, global shape, stride and dtype, for the updates and for the params, plus the
:class:`~functional_train.Mesh` descriptor. The plan of a layout -- leaf paths, the
:class:`~functional_train.engine.layout.World` of the call, the validation of every leaf, which
leaves are reduced over the data axis, which ``Partial`` placements are reduced over which mesh
dims, the specs the materialised gradients have -- is built on the first call and reused: a step
then only packs, communicates and unpacks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..leaves import DEVICE, DTYPE, SHAPE
from ..mesh import Mesh
from ..tree import format_path, indexed
from .collectives import all_reduce_buckets, groups_over
from .dtensor import DTENSOR_OR_NONE, Spec, spec_of, to_local, wrap, wrap_like
from .layout import World
from .metadata import Memo

__all__ = ["Plan", "plan_for", "by_layout", "cache_clear", "agree_presence"]

_PLANS: OrderedDict[Any, Plan] = OrderedDict()
_MAX_PLANS = 64
# the cached plans of lists of plain tensors, by their exact metadata (one C++ check of each
# list where the key below reads three attributes of every leaf and hashes them; see
# .metadata), holding only plans _PLANS holds
_BY_METADATA = Memo()


def cache_clear() -> None:
    """Forget every cached plan (``functional_train.testing.simulate`` calls this)."""
    _PLANS.clear()
    _BY_METADATA.clear()
    _BY_SPECS.clear()
    _LAST_BY_SPECS.clear()


def _leaf_key(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, DTensor):
        s = x._spec
        return (s, id(s.mesh))  # DTensorSpec compares meshes by value; the key holds s alive
    if isinstance(x, torch.Tensor):
        return (x.shape, x.dtype, x.device)
    return type(x)


_SPEC, _MESH = operator.attrgetter("_spec"), operator.attrgetter("mesh")
_SPEC_MESH = operator.attrgetter("_spec.mesh")


def _leaves_key(leaves: Sequence[Any]) -> tuple:
    """``_leaf_key`` of each leaf; for a list of plain tensors (the common case), or of
    DTensors, by whole-list C loops (this runs for every step)."""
    kinds = set(map(type, leaves))
    if kinds == {torch.Tensor}:
        return tuple(zip(map(SHAPE, leaves), map(DTYPE, leaves), map(DEVICE, leaves)))
    if kinds == {DTensor}:
        specs = list(map(_SPEC, leaves))
        return tuple(zip(specs, map(id, map(_MESH, specs))))
    return tuple(map(_leaf_key, leaves))


def describe(x: Any) -> str:
    """A leaf's layout in words, for error messages."""
    if isinstance(x, DTensor):
        names = x.device_mesh.mesh_dim_names
        return f"a DTensor {tuple(x.placements)} on mesh {tuple(x.device_mesh.shape)}" + (
            f" {names}" if names else ""
        )
    if isinstance(x, torch.Tensor):
        return "a plain tensor"
    return "None" if x is None else type(x).__name__


def _check_leaf(plan: Plan, i: int, u: Any, p: Any, has_params: bool) -> None:
    """Leaf ``i`` of a call's updates (``u``) and params (``p``), checked; the error names
    its path (formatted then only: dynamo traces these checks per leaf)."""
    if u is not None and not isinstance(u, torch.Tensor):
        raise TypeError(
            f"update leaf '{plan.paths[i]}' must be a torch.Tensor, DTensor or None, "
            f"got {type(u).__name__}"
        )
    if p is not None and not isinstance(p, torch.Tensor):
        raise TypeError(
            f"params leaf '{plan.paths[i]}' must be a torch.Tensor, DTensor or None, "
            f"got {type(p).__name__}"
        )
    if u is None:
        return
    if not (u.dtype.is_floating_point or u.dtype.is_complex):
        raise TypeError(
            f"update leaf '{plan.paths[i]}' has dtype {u.dtype}; gradients and updates must "
            f"be floating point (give integer and bool parameters a None gradient)"
        )
    if has_params and p is None:
        raise ValueError(
            f"params leaf '{plan.paths[i]}' is None but its update leaf is not; give a "
            f"frozen or absent parameter a None update too"
        )
    if p is None:
        return
    if tuple(u.shape) != tuple(p.shape):
        raise ValueError(
            f"update leaf '{plan.paths[i]}' has shape {tuple(u.shape)}, "
            f"expected the parameter's shape {tuple(p.shape)}"
        )
    if isinstance(p, DTensor):
        if any(isinstance(pl, Partial) for pl in p.placements):
            raise ValueError(
                f"params leaf '{plan.paths[i]}' has Partial placements {tuple(p.placements)}; "
                f"parameters must be Shard or Replicate (only gradients can be "
                f"Partial)"
            )
    # a plain gradient of a DTensor parameter (or the converse) holds the global values:
    # materialize() relayouts it into the parameter's placements


class Plan:
    """The plan of one layout (see the module docstring).

    Attributes:
        treedef: structure of the updates (``None`` leaves included).
        paths: dotted leaf paths.
        world: the :class:`World` of the layout.
        mesh: the descriptor after materialisation (data axis reduced), or ``None``.
        active: indices of the non-``None`` update leaves.
        shapes: each update leaf's (global) ``torch.Size``, ``None`` for an absent one: those
            of every call of this plan (they are part of its key).
        specs: the :class:`Spec` of each materialised update leaf (``None``: plain or absent).
        data_rounds: per round (the data axis, then an expert axis that is data parallel too;
            see :class:`~functional_train.Mesh`), ``(mesh dim, leaves averaged over it, its
            groups)``.
        expert_scale: ``(leaf indices, 1 / expert axis size)``: expert leaves whose gradient
            sums the expert axis' contributions, divided by its size.
        partial_rounds: per round, ``(leaf index, groups, reduce op)`` of one ``Partial`` mesh dim
            of each leaf still partial, and the specs after the round.
        relayout: leaves whose materialised placements differ from their parameter's.
    """

    __slots__ = (
        "treedef",
        "_paths",
        "world",
        "mesh",
        "active",
        "every_active",
        "shapes",
        "specs",
        "data_rounds",
        "expert_scale",
        "partial_rounds",
        "relayout",
        "param_specs",
        "trivial",
        "memo",
    )

    def __init__(
        self, treedef, leaves: Sequence[Any], pleaves: Sequence[Any] | None, mesh: Mesh | None
    ):
        self.treedef = treedef
        self.memo: dict = {}  # values derived from the layout on first use (replica counts, ...)
        self._paths: list | None = None  # (see paths)
        for i, u in indexed(leaves):
            _check_leaf(self, i, u, None if pleaves is None else pleaves[i], pleaves is not None)
        self.active = [i for i, x in indexed(leaves) if x is not None]
        # (every leaf active: ``active`` is every position in order, see Prepared.at)
        self.every_active = len(self.active) == len(leaves)
        # the update leaves' (global) shapes: every call of this plan has them (its key)
        self.shapes = [None if x is None else x.shape for x in leaves]
        self.param_specs: list[Spec | None] | None = (
            None if pleaves is None else [spec_of(p) for p in pleaves]
        )
        any_dtensor = any(isinstance(x, DTensor) for x in leaves) or (
            pleaves is not None and any(isinstance(p, DTensor) for p in pleaves)
        )
        self.trivial = not any_dtensor and (mesh is None or mesh.device_mesh is None)
        self.data_rounds: list = []
        self.expert_scale: tuple = ((), 1.0)
        self.partial_rounds: list = []
        self.relayout: list = []
        if self.trivial:
            self.world = _NO_WORLD
            self.mesh = mesh
            self.specs: list[Spec | None] = [None] * len(leaves)
            return
        paths = self.paths
        labels = [f"update leaf '{p}'" for p in paths]
        if pleaves:
            labels = [f"params leaf '{p}'" for p in paths] + labels
        world = World(mesh, list(pleaves or []) + list(leaves), labels)
        for x, p in zip(leaves, paths):
            if isinstance(x, DTensor):
                world.leaf_dims(x, p)
        self.world = world
        self.mesh = None if mesh is None else mesh.reduced()
        specs = [spec_of(x) for x in leaves]
        # 1. the data-axis mean
        if mesh is not None and mesh.pending_data_reduction:
            self.data_rounds, self.expert_scale = data_rounds(world, leaves, paths)
        # 2. Partial placements, one round per mesh dim that can still be partial
        while True:
            rnd = []
            for i, s in enumerate(specs):
                if s is None:
                    continue
                for j, pl in enumerate(s.placements):
                    if isinstance(pl, Partial):
                        placements = list(s.placements)
                        placements[j] = Replicate()
                        specs[i] = _respec(s, tuple(placements))
                        rnd.append((i, ((s.mesh, j),), pl.reduce_op, specs[i]))
                        break
            if not rnd:
                break
            self.partial_rounds.append(rnd)
        self.specs = specs
        # 3. the placements of the parameter
        if pleaves is not None and self.param_specs is not None:
            for i, (s, p) in enumerate(zip(specs, pleaves)):
                if leaves[i] is None or p is None:
                    continue
                ps = self.param_specs[i]
                if s is None and ps is None:
                    continue
                if s is None or ps is None or not same_layout(s, ps):
                    self.relayout.append(i)
                    self.specs[i] = ps

    @property
    def paths(self) -> list:
        """The dotted leaf paths, formatted on first use (an error's message, a sharded
        layout's checks): under ``torch.compile`` dynamo traces the formatting of every
        leaf's path, which a step that raises nothing never reads."""
        if self._paths is None:
            self._paths = [format_path(p) for p in self.treedef.paths()]
        return self._paths

    def materialize(self, leaves: list, pleaves: list | None) -> list:
        """Reduce unreduced gradients into the placements of their parameters (new list).

        * plain tensors and DTensors on a sub-mesh without ``mesh.data_axis``: mean over the
          data axis (one bucketed all-reduce per dtype);
        * ``Partial`` placements: reduced as the placement says over its mesh dim (one bucketed
          all-reduce per process group, op and dtype), becoming ``Replicate``;
        * then, when the parameter's placements differ from the gradient's (autograd gives a
          ``Shard(0)`` bias gradient for a ``Replicate`` bias next to a colwise-sharded
          weight), the gradient is redistributed into the parameter's placements.
        """
        grads = list(leaves)
        grads = data_mean(grads, self.data_rounds, self.expert_scale)
        for rnd in self.partial_rounds:
            red = all_reduce_buckets([(to_local(grads[i]), g, op) for i, g, op, _ in rnd])
            for (i, _, _, s), r in zip(rnd, red):
                grads[i] = wrap(r, s)
        params = pleaves if pleaves is not None else []  # (relayout is planned from them)
        for i in self.relayout:
            g, p = grads[i], params[i]
            gd, pd = isinstance(g, DTensor), isinstance(p, DTensor)
            if gd and pd:
                grads[i] = g.redistribute(p.device_mesh, p.placements)
            elif gd:
                grads[i] = g.full_tensor()
            else:
                grads[i] = DTensor.from_local(
                    g, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False
                ).redistribute(p.device_mesh, p.placements)
        return grads


def data_rounds(world: World, leaves: Sequence[Any], paths: Sequence[str]) -> tuple[list, tuple]:
    """Which gradient leaves are per-replica contributions over which data-parallel mesh dims
    (:attr:`Mesh.data_dims`: the data axis, and the expert axis when it is data parallel too):
    one round per dim of more than one rank, ``(dim, leaf indices, groups)``, and the expert
    leaves to divide by the expert axis size (see :class:`~functional_train.Mesh`). A leaf
    whose DTensor lives on a dim (sharded, replicated or partial over it) is not averaged over
    it."""
    mesh = world.mesh
    experts = [g is not None and world.is_expert_leaf(g, paths[i]) for i, g in enumerate(leaves)]
    rounds = []
    for d in mesh.data_dims:
        if world.shape[d] == 1:
            continue
        idx = [
            i
            for i, g in enumerate(leaves)
            if g is not None
            and not (isinstance(g, DTensor) and d in world.leaf_dims(g, paths[i]))
            and not (d == world._ep and experts[i])
        ]
        if idx:
            rounds.append((d, idx, world.dim_group(d)))
    scaled = tuple(i for i, e in enumerate(experts) if e) if mesh.expert_data else ()
    return rounds, (scaled, 1.0 / world.shape[world._ep] if scaled else 1.0)


def data_mean(grads: list, rounds: list, expert_scale: tuple) -> list:
    """Apply :func:`data_rounds`' plan: one bucketed all-reduce (mean) per round and dtype,
    then the expert leaves' division (new list)."""
    grads = list(grads)
    for _, idx, group in rounds:
        red = all_reduce_buckets([(to_local(grads[i]), group, "avg") for i in idx])
        for i, r in zip(idx, red):
            grads[i] = wrap_like(r, grads[i])
    scaled, factor = expert_scale
    for i in scaled:
        grads[i] = wrap_like(to_local(grads[i]) * factor, grads[i])
    return grads


def same_layout(a: Spec, b: Spec) -> bool:
    """Same mesh and placements, compared element by element with ``==`` (a tuple comparison
    short-cuts identical elements, and dynamo then guards on the placements' identity: a new
    but equal ``Replicate()`` would recompile a compiled step)."""
    return (
        a.mesh == b.mesh
        and len(a.placements) == len(b.placements)
        and all([x == y for x, y in zip(a.placements, b.placements)])
    )


# (what, the DTensorSpec ids of lists of DTensors) -> (their specs, kept alive so that the
# ids are not reused; the value computed from them). Bounded: gradients made by
# ``DTensor.from_local`` each step bring new spec objects.
_BY_SPECS: dict = {}
_MAX_BY_SPECS = 256
# what -> the entry of :data:`_BY_SPECS` its last call used (specs held: their ids not reused)
_LAST_BY_SPECS: dict = {}


def only_dtensors(*lists: Sequence[Any]) -> bool:
    """Every element of every list is a DTensor (eagerly: whole-list C loops)."""
    return not torch.compiler.is_compiling() and all(
        set(map(type, xs)) == {DTensor} for xs in lists
    )


def by_specs(what: Any, lists: Sequence[Sequence[DTensor]], compute: Callable[[], Any]) -> Any:
    """``compute()``, remembered per ``what`` and the ``DTensorSpec`` objects of ``lists``
    (lists of DTensors only, see :func:`only_dtensors`): for a value decided by what the specs
    hold (mesh, placements, global shape and stride, dtype). A state's and a parameter's
    DTensors keep their spec objects from step to step, and so do FSDP's gradients and the
    results of one DTensor operation: computed once, then a lookup made in C loops (this runs
    every step)."""
    last = _LAST_BY_SPECS.get(what)  # (the spec objects of the last call: one C loop a list)
    if (
        last is not None
        and len(last[0]) == len(lists)
        and all(
            len(s) == len(xs) and all(map(operator.is_, map(_SPEC, xs), s))
            for s, xs in zip(last[0], lists)
        )
    ):
        return last[1]
    specs = [list(map(_SPEC, xs)) for xs in lists]
    key = (what, *[tuple(map(id, s)) for s in specs])
    hit = _BY_SPECS.get(key)
    if hit is None:
        hit = (specs, compute())
        if len(_BY_SPECS) >= _MAX_BY_SPECS:
            _BY_SPECS.clear()
        _BY_SPECS[key] = hit
    if len(_LAST_BY_SPECS) >= _MAX_BY_SPECS:
        _LAST_BY_SPECS.clear()
    _LAST_BY_SPECS[what] = hit
    return hit[1]


def same_layouts(xs: Sequence[Any], ys: Sequence[Any]) -> bool:
    """:func:`same_layout` of every pair of DTensors of ``xs`` and ``ys`` (remembered per their
    spec objects where every element is a DTensor: :func:`by_specs`)."""

    def compute() -> bool:
        return all(map(same_layout, map(spec_of, xs), map(spec_of, ys)))

    return by_specs("same layouts", (xs, ys), compute) if only_dtensors(xs, ys) else compute()


def _respec(s: Spec, placements: tuple) -> Spec:
    return dataclasses.replace(s, placements=placements)


_NO_WORLD = World(None, [], [])  # made at import: a global set under tracing would recompile


def plan_for(
    treedef, leaves: Sequence[Any], pleaves: Sequence[Any] | None, mesh: Mesh | None
) -> Plan:
    """The cached plan of this layout (built on first use; under ``torch.compile`` built anew,
    since tracing runs once per layout anyway)."""
    if torch.compiler.is_compiling():
        return Plan(treedef, leaves, pleaves, mesh)
    return by_layout(
        ("plan", treedef, mesh, pleaves is None),
        (leaves, () if pleaves is None else pleaves),
        lambda: _cached_plan(treedef, leaves, pleaves, mesh),
    )


def by_layout(what: Any, lists: Sequence[Sequence[Any]], compute: Callable[[], Any]) -> Any:
    """``compute()``, a value decided by the layouts of ``lists``' DTensors, remembered
    (eagerly) per ``what`` and their spec objects (:func:`by_specs`) where every element is a
    DTensor, or a DTensor or ``None`` (a masked / partition's transform: ``None`` outside
    its leaves; then per where the ``None`` are, and the others' spec objects); computed
    each call otherwise (plain tensors: the callers' own memos). Each list's element types
    read once (a C loop a list)."""
    if torch.compiler.is_compiling():
        return compute()
    kinds = [set(map(type, xs)) for xs in lists]
    if all(k == _ONLY_DTENSOR for k in kinds):
        return by_specs(what, lists, compute)
    if set().union(*kinds) == DTENSOR_OR_NONE:
        masks, present = zip(*map(present_of, lists))
        return by_specs((what, masks), present, compute)
    return compute()


_ONLY_DTENSOR = {DTensor}


def present_of(xs: Sequence[Any]) -> tuple[tuple, list]:
    """``(mask, present)``: per element of ``xs`` whether it is not ``None``, and those
    elements (whole-list C loops): a masked / partition's leaves, remembered per where the
    absent ones are and the present ones' spec objects (:func:`by_specs`)."""
    mask = tuple(map(operator.is_not, xs, _NONES))
    return mask, list(itertools.compress(xs, mask))


def _cached_plan(
    treedef, leaves: Sequence[Any], pleaves: Sequence[Any] | None, mesh: Mesh | None
) -> Plan:
    lists = (leaves,) if pleaves is None else (leaves, pleaves)
    fast = (treedef, mesh, pleaves is None)
    hit = _BY_METADATA.get(fast, lists)
    if hit is not None:
        return hit
    key = (
        treedef,
        _leaves_key(leaves),
        None if pleaves is None else _leaves_key(pleaves),
        mesh,
    )
    try:
        hit = _PLANS.get(key)
    except TypeError:  # an unhashable leaf: validation raises the clear error
        return Plan(treedef, leaves, pleaves, mesh)
    if hit is None:
        hit = Plan(treedef, leaves, pleaves, mesh)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.popitem(last=False)
            _BY_METADATA.clear()  # (it may hold the plan that went)
        _PLANS[key] = hit
    _BY_METADATA.put(fast, lists, hit)
    return hit


def all_on_data_axis(pleaves: Sequence[Any], axis: str | None) -> bool:
    """Every parameter is a DTensor whose mesh has the data axis: their gradients are placed
    over it (FSDP's reduce-scatter made them), so none is averaged over it by the engine. A
    property of the parameters, the same on every rank."""
    if only_dtensors(pleaves):
        return by_specs(("on data axis", axis), (pleaves,), lambda: _on_axis(pleaves, axis))
    return _on_axis(pleaves, axis)


def _on_axis(pleaves: Sequence[Any], axis: str | None) -> bool:
    if not torch.compiler.is_compiling() and set(map(type, pleaves)) <= DTENSOR_OR_NONE:
        # (C loops over the leaves, the names read once per mesh: this runs every step)
        present = itertools.compress(pleaves, map(operator.is_not, pleaves, _NONES))
        meshes = list(map(_SPEC_MESH, present))
        return all(
            axis in (m.mesh_dim_names or ()) for m in dict(zip(map(id, meshes), meshes)).values()
        )
    for p in pleaves:
        if p is None:
            continue
        if not isinstance(p, DTensor) or axis not in (p.device_mesh.mesh_dim_names or ()):
            return False
    return True


_NONES = itertools.repeat(None)


_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.complex64,
    torch.complex128,
)


def agree_presence(leaves: list, pleaves: list | None, treedef, mesh: Mesh) -> list:
    """Make every rank of the data axis hold the same gradient leaves (DDP's
    ``find_unused_parameters``): a leaf whose gradient is ``None`` on some ranks only (a
    parameter unused on their micro-batch, an expert no token reached) becomes zeros there, so
    it counts as zero in the data-parallel mean and every rank updates it identically; a leaf
    ``None`` on every rank stays ``None``.

    One all-reduce (sum) of ``2 n`` int64 over the data axis (and the expert axis where it is
    data parallel too, see :class:`~functional_train.Mesh`): per leaf, how many ranks have it,
    and the sum of a code of its dtype and layout (on CUDA meshes its result is read on the
    host: one synchronisation, as DDP's ``find_unused_parameters`` has). Without it the
    bucketed mean would have different sizes on different ranks (gloo aborts, NCCL hangs).
    Skipped when every parameter is a DTensor placed over the data axis (FSDP-style: nothing
    is averaged over it here) and under ``torch.compile`` (compiled steps assume every rank has
    the same gradient leaves).

    Raises (the same error on every rank):
        ValueError: a leaf present on some ranks only whose zeros cannot be built there: no
            ``params`` given, a DTensor gradient in placements other than its parameter's
            (``Partial``), or ranks that disagree on its dtype or layout.
    """
    if pleaves is not None and all_on_data_axis(pleaves, mesh.data_axis):
        return leaves  # FSDP-style: no gradient is averaged over the data axis here
    n = len(leaves)
    codes = []
    for i, g in enumerate(leaves):
        if g is None:
            codes.append((0, 0))
            continue
        dt = _DTYPES.index(g.dtype) if g.dtype in _DTYPES else len(_DTYPES)
        p = None if pleaves is None else pleaves[i]
        if not isinstance(g, DTensor):
            lay = 0
        elif isinstance(p, DTensor) and same_layout(spec_of(g), spec_of(p)):
            lay = 1
        else:
            lay = 2
        codes.append((1, 1 + dt * 4 + lay))
    dm = mesh.device_mesh
    assert dm is not None, "a data axis is a dim of a device mesh"
    local = torch.tensor(codes, dtype=torch.int64, device=dm.device_type).reshape(2 * n)
    dims = mesh.data_dims
    summed = all_reduce_buckets([(local, groups_over(dm, dims), "sum")])[0]
    total = summed.view(n, 2).tolist()
    out = list(leaves)
    dp = math.prod(dm.size(d) for d in dims)
    for i, (count, code) in enumerate(total):
        if count in (0, dp) or leaves[i] is not None:
            continue
        path = format_path(treedef.paths()[i])
        if code % count:
            raise ValueError(
                f"gradient leaf '{path}' is None on some ranks of the data axis "
                f"and has different dtypes or layouts on the others"
            )
        code = code // count - 1
        dt, lay = divmod(code, 4)
        p = None if pleaves is None else pleaves[i]
        if p is None or lay == 2 or dt >= len(_DTYPES):
            raise ValueError(
                f"gradient leaf '{path}' is None on {dp - count} of the {dp} ranks of the data "
                f"axis only; it can count as zero there only when params are given and the "
                f"gradient is a plain tensor or a DTensor in its parameter's placements (not "
                f"Partial): pass zeros on those ranks instead"
            )
        lp = to_local(p)
        if lay == 1:  # a DTensor in its parameter's placements: zeros of the local shard
            out[i] = wrap_like(torch.zeros(lp.shape, dtype=_DTYPES[dt], device=lp.device), p)
        else:  # a plain gradient holds the global values (of a plain or a DTensor parameter)
            out[i] = torch.zeros(p.shape, dtype=_DTYPES[dt], device=lp.device)
    return out
