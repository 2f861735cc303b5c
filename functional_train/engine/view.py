"""The prepared local view of one ``update`` call, which a chain passes from primitive to
primitive, and :func:`prepare`, which builds it from the plan of the call's layout.

A :class:`Prepared` holds the local shards of the (materialised) updates and of the params, and
offers the batched global reductions a sharding-aware transform needs (``leaf_totals``,
``leaf_sums``, ``global_sum``, ``global_max``). Inside a ``chain`` the view travels between the
primitives that declare they accept it: DTensors are built once, for what the caller receives.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Shard

from ..autograd import detached, requires_grad_like, traced
from ..leaves import SHAPE
from ..mesh import Mesh
from ..tree import flatten_as, format_path, tree_flatten, tree_unflatten, unflatten_like
from .collectives import all_reduce, all_reduce_buckets, all_reduce_start, per_rank
from .dtensor import DTENSOR_OR_NONE, TENSOR_OR_NONE, spec_of, to_locals, wrap, wraps_like
from .layout import region, statistic_shape
from .metadata import Memo
from .plan import Plan, agree_presence, describe, plan_for, present_of, same_layout
from .pool import of_plan
from .scalars import scalar_program

__all__ = ["Prepared", "prepare", "leaf_paths"]


_SPEC = operator.attrgetter("_spec")


def _state_shapes_memo() -> Memo:  # (a plan's state trees whose leaves have its shapes)
    return Memo(per_key=8)


class Prepared:
    """Flattened, validated and materialised inputs of one ``update`` call: the local view.

    Attributes:
        plan: the :class:`~functional_train.engine.plan.Plan` of the call's layout.
        treedef: structure of the updates (``None`` leaves included).
        paths: dotted leaf paths.
        updates: the materialised update leaves (DTensor / Tensor / ``None``) as they entered
            (for a view passed along a chain: as they entered the chain). Read their LAYOUT
            (shape, placements, local shape) from them; read values from ``locals``.
        locals: the current local shards (``None`` for ``None`` leaves).
        specs: their :class:`Spec` (``None`` for plain tensors).
        params: local shards of the parameters, or ``None`` when no params were given.
        active: indices of the non-``None`` update leaves.
        world: the :class:`World` of the call.
        mesh: the descriptor after materialisation (data axis reduced).
        is_view: whether :meth:`rebuild` returns a view (inside a chain) rather than a tree.
        needed: ``None``, or a 0-dim bool tensor: whether the values of reductions over this
            view are used at all (false: a part guarded by a false flag reads it, see
            :func:`~functional_train.engine.elementwise.guarded`; an operator that reads the
            flag when it runs may then skip the reduction and give zeros).
        sum_squares: ``None``, or the per-leaf sums of squares of ``locals`` over ``active``
            (a float64 vector, in that order), computed by the stage that wrote them (see
            ``Elementwise.reads_sum_squares``).
        params_sum_squares: ``None``, or those of ``params`` over ``active``, computed by
            that stage as it read them (see ``Elementwise.reads_params_sum_squares``).
    """

    __slots__ = (
        "plan",
        "treedef",
        "updates",
        "locals",
        "specs",
        "params",
        "active",
        "world",
        "mesh",
        "is_view",
        "needed",
        "sum_squares",
        "params_sum_squares",
        "_flat",
        "_plain",
    )

    def __init__(self, plan: Plan, updates, locals_, params, is_view: bool = False):
        self.plan, self.treedef = plan, plan.treedef
        self.updates, self.locals, self.params = updates, locals_, params
        self.specs, self.active, self.world, self.mesh = (
            plan.specs,
            plan.active,
            plan.world,
            plan.mesh,
        )
        self.is_view = is_view
        self.needed = None
        self.sum_squares: torch.Tensor | None = None
        self.params_sum_squares: torch.Tensor | None = None
        self._flat: dict = {}  # id(state tree) -> (tree, leaves): a state field is read twice
        self._plain: bool | None = None  # every update leaf a plain tensor (once per view)

    @property
    def paths(self) -> list:
        return self.plan.paths

    def _derived(self, locals_, active, needed=None, sums=(None, None)) -> Prepared:
        """A view of the same call and layout (the one constructor of the views below);
        ``sums``: its ``(sum_squares, params_sum_squares)``."""
        out = Prepared(self.plan, self.updates, locals_, self.params, self.is_view)
        out.active, out.needed = active, needed
        out.sum_squares, out.params_sum_squares = sums
        return out

    def at(self, xs: Sequence[Any]) -> list:
        """``[xs[i] for i in self.active]`` (``xs``: one value per leaf of the tree): a copy
        of ``xs`` where the view's active leaves are the plan's and every leaf is active."""
        if (
            self.active is self.plan.active
            and self.plan.every_active
            and len(xs) == len(self.active)
        ):
            return list(xs)
        return [xs[i] for i in self.active]

    def with_locals(self, new_locals: Sequence[Any]) -> Prepared:
        """The same view with other local values (one per leaf, ``None`` allowed)."""
        return self._derived(list(new_locals), self.active)

    def needed_if(self, flag) -> Prepared:
        """The same view, its reductions' values used only where ``flag`` (a 0-dim bool
        tensor) is true (see :attr:`needed`)."""
        return self._derived(
            self.locals, self.active, flag, (self.sum_squares, self.params_sum_squares)
        )

    def restricted(self, where) -> Prepared:
        """The view of some of its active leaves (``masked`` / ``partition``'s parts, see
        ``Elementwise.restrict``): ``where.positions``, positions in :attr:`active`, become
        the active leaves, and :attr:`sum_squares` and :attr:`params_sum_squares` theirs;
        values and layout are shared."""
        sums = tuple(
            None if x is None else where.rows(x)
            for x in (self.sum_squares, self.params_sum_squares)
        )
        return self._derived(self.locals, where.of_active(self.active), self.needed, sums)

    def tree(self) -> Any:
        """The current values as a tree of the caller's kind (DTensors rewrapped in ``specs``)."""
        return tree_unflatten(
            self.treedef, [wrap(loc, s) for loc, s in zip(self.locals, self.specs)]
        )

    def rebuild(self, new_locals: Sequence[Any]) -> Any:
        """``new_locals`` (one per leaf, ``None`` allowed) as the result of a transform: a view
        inside a chain (:attr:`is_view`), else a tree rewrapped in ``specs``."""
        if self.is_view:
            return self.with_locals(new_locals)
        return tree_unflatten(
            self.treedef, [wrap(loc, s) for loc, s in zip(new_locals, self.specs)]
        )

    def every_leaf(self, active_values: Sequence[Any]) -> list:
        """One value per leaf from one per ``active`` leaf (``None`` for the others)."""
        if len(active_values) == len(self.locals):  # (every leaf active: in their order)
            return list(active_values)
        full: list = [None] * len(self.locals)
        for i, v in zip(self.active, active_values):
            full[i] = v
        return full

    def rebuild_active(self, active_locals: Sequence[Any]) -> Any:
        """Like :meth:`rebuild` from values for the ``active`` leaves only (others stay
        ``None``)."""
        return self.rebuild(self.every_leaf(active_locals))

    def replicas(self, i: int, within: frozenset | None = None) -> int:
        """How many ranks hold the same values of leaf ``i`` (cached in the plan)."""
        memo = self.plan.memo
        key = ("replicas", i, within)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = self.world.replicas(self.updates[i], self.paths[i], within)
        return hit

    def _flatten(self, tree: Any, what: str) -> list:
        """``flatten_as`` of a state tree, once per tree object for this step (its
        :meth:`state_locals` and then its :meth:`state_tree`; the engine builds new trees and
        changes none, and the entry holds the tree, so its id is not reused)."""
        if torch.compiler.is_compiling():  # (dynamo traces the flattening as it is)
            return flatten_as(tree, self.treedef, what, "the updates")
        hit = self._flat.get(id(tree))
        if hit is not None and hit[0] is tree:
            return list(hit[1])
        leaves = flatten_as(tree, self.treedef, what, "the updates")
        self._flat[id(tree)] = (tree, leaves)
        return list(leaves)

    def _plain_specs(self) -> bool:
        """Every update leaf plain or absent (no :class:`Spec`): once per plan (a
        ``list.count(None)`` calls each ``Spec``'s ``__eq__`` in Python)."""
        memo = self.plan.memo
        hit = memo.get("plain specs")
        if hit is None:
            hit = memo["plain specs"] = all(s is None for s in self.specs)
        return hit

    def state_locals(self, tree: Any, what: str) -> list:
        """Local shards of a params-shaped state tree, checked against the updates' structure
        and, leaf by leaf, their shapes.

        Raises:
            ValueError: naming the leaf path whose structure or shape differs.
        """
        leaves = self._flatten(tree, what)
        n = len(leaves)
        if (  # (plain tensors of the updates' shapes, every leaf active: whole-list checks)
            not torch.compiler.is_compiling() and len(self.active) == n and self._plain_specs()
        ):
            # (plain tensors of this plan's shapes checked before: one C++ check of their
            # exact metadata, see .metadata)
            shaped = of_plan(self.plan, "state shapes", _state_shapes_memo)
            if shaped.get(None, (leaves,)):
                return list(leaves)
            kinds = set(map(type, leaves))
            if kinds == {type(None)}:  # (a part's state outside its leaves: partition)
                return list(leaves)
            if self._plain is None:
                self._plain = set(map(type, self.updates)) == {torch.Tensor}
            if (
                kinds == {torch.Tensor}
                and self._plain
                and list(map(SHAPE, leaves)) == self.plan.shapes  # (the updates' shapes)
            ):
                shaped.put(None, (leaves,), True)
                return list(leaves)
            if kinds == TENSOR_OR_NONE and self._plain:
                # (a restricted part's state, None outside its leaves: the others' shapes,
                # the updates' there, by C loops)
                kept, held = present_of(leaves)
                key = ("shapes at", kept)
                want = self.plan.memo.get(key)
                if want is None:
                    want = self.plan.memo[key] = list(itertools.compress(self.plan.shapes, kept))
                if list(map(SHAPE, held)) == want:
                    return list(leaves)
        # the DTensorSpec objects already checked, per leaf (states keep their spec objects from
        # step to step, so the layout is checked once per layout, not per step)
        # (not under torch.compile: reading x._spec there makes dynamo guard on the spec
        # object, and the next step's state has another one: a recompile per step)
        memo = not torch.compiler.is_compiling()
        checked = self.plan.memo.setdefault(("state specs", what), {}) if memo else {}
        kinds = set(map(type, leaves)) if memo else set()
        every = memo and len(self.active) == n and DTensor in kinds and kinds <= DTENSOR_OR_NONE
        if every:
            # (every leaf an active DTensor, or None: a restricted part's state outside its
            # leaves; where they are and the spec objects checked last, C loops)
            # (per set of absent leaves: the parts of a partition's labels ask in turn)
            mask: tuple | None = None
            present = leaves
            if len(kinds) == 2:
                mask, present = present_of(leaves)
            at = ("all", mask)
            specs = list(map(_SPEC, present))
            last = checked.get(at)
            if last is not None and all(map(operator.is_, specs, last)):
                return to_locals(leaves)
        for i in self.active:
            x = leaves[i]
            if x is None:
                continue
            dt = isinstance(x, DTensor)
            if dt and memo and checked.get(i) is x._spec:
                continue
            if x.shape != self.updates[i].shape:
                raise ValueError(
                    f"update leaf '{self.paths[i]}' has shape "
                    f"{tuple(self.updates[i].shape)}, but its {what} leaf has shape "
                    f"{tuple(x.shape)} (the parameter's)"
                )
            s = self.specs[i]
            if (s is None) == dt or (s is not None and not same_layout(spec_of(x), s)):
                raise ValueError(
                    f"{what} leaf '{self.paths[i]}' is {describe(x)}, but the update leaf is "
                    f"{describe(self.updates[i])} (in the parameter's layout); the state must "
                    f"come from init on parameters of this layout"
                )
            if dt and memo:
                checked[i] = x._spec
        if every:
            checked[at] = specs  # (holding them: their ids are not reused)
        return to_locals(leaves)

    def state_tree(self, tree: Any, what: str, new_active: Sequence[Any]) -> Any:
        """A params-shaped state tree with the ``active`` leaves replaced by rewrapped locals."""
        old = self._flatten(tree, what)
        if not torch.compiler.is_compiling():  # (C loops: this runs per state tree per step)
            if not any(map(operator.is_not, old, itertools.repeat(None))) and not any(
                map(operator.is_not, new_active, itertools.repeat(None))
            ):
                return tree  # an all-None field
            if len(self.active) == len(old):  # (every leaf active: the new leaves in order)
                new = wraps_like(new_active, old)
                if all(map(operator.is_, new, old)):  # (a donated step wrote every leaf)
                    return tree
                return unflatten_like(tree, self.treedef, new)
        elif all(x is None for x in old) and all(v is None for v in new_active):
            return tree  # an all-None field (dynamo cannot rebuild a dict of constants)
        leaves = list(old)
        for i, v in zip(self.active, wraps_like(new_active, [old[i] for i in self.active])):
            leaves[i] = v
        return unflatten_like(tree, self.treedef, leaves)

    def leaf_sums(
        self,
        items: Sequence[tuple[int, torch.Tensor, Sequence[int]]],
        op: str = "sum",
        whole: bool = False,
    ) -> list:
        """Complete per-leaf reductions that were computed over the local shard.

        Args:
            items: ``(leaf index, local partial result, tensor dims reduced locally)``; the
                partial result becomes the reduction over the global tensor (replicas are never
                added, pipeline stages and experts never mixed).
            op: ``"sum"`` or ``"max"``.

        A partial result shaped like the leaf's local shard without the reduced dims (a row
        sum, a column sum, a total) is written at its global offsets into a buffer holding the
        whole statistic of its leaf (zeros, ``-inf`` for max, elsewhere; sums weighed by
        ``1 / replicas``), and ONE all-reduce per dtype over every mesh dim but the pipeline
        and expert ones completes the statistics of every leaf at once, whatever their meshes
        and placements; each rank then reads its own region back. Partial results of another
        shape are all-reduced over the mesh dims that shard any of the reduced dims of their
        leaf, one collective per distinct set of mesh dims. Leaves whole along the reduced dims
        need nothing.

        With ``whole=True`` every rank gets the WHOLE statistic of each leaf (global shape, e.g.
        a projection ``G^T Omega`` of a column-sharded ``G`` in full), not its own region: the
        partial results must then be statistics (shaped as above), and the same one all-reduce
        (per dtype) serves, since every rank already receives the whole buffer.

        Returns the completed results, in order (the inputs are not modified).
        """
        out: list = [None] * len(items)
        batch, where, scatter = [], [], []
        for n, (i, t, dims) in enumerate(items):
            x = self.updates[i]
            if whole:
                sharded = isinstance(x, DTensor) and any(isinstance(p, Shard) for p in x.placements)
                if not sharded:
                    out[n] = t
                elif statistic_shape(x, t, dims) is None:
                    raise ValueError(
                        f"leaf_sums(whole=True): the partial result for leaf "
                        f"'{self.paths[i]}' is not a statistic of its local shard"
                    )
                else:
                    scatter.append(n)
                continue
            group = self.world.shard_group(x, self.paths[i], dims)
            if group is None:
                out[n] = t
            elif statistic_shape(x, t, dims) is not None:
                scatter.append(n)
            else:
                batch.append((t, group, op))
                where.append(n)
        for n, r in zip(where, all_reduce_buckets(batch)):
            out[n] = r
        if scatter:
            for n, r in zip(scatter, self._scatter_reduce([items[n] for n in scatter], op, whole)):
                out[n] = r
        return out

    def _statistic_dims(self, indices: Sequence[int]) -> list:
        """:meth:`World.statistic_dims` of leaves ``indices`` (cached in the plan)."""
        key = ("statistic_dims", tuple(indices))
        hit = self.plan.memo.get(key)
        if hit is None:
            hit = self.plan.memo[key] = self.world.statistic_dims(
                [(self.updates[i], self.paths[i]) for i in indices]
            )
        return hit

    def _scatter_reduce(self, items, op: str, whole: bool = False, dims=None) -> list:
        """Whole-statistic buffers of ``items`` completed by one all-reduce per dtype (and per
        part of :meth:`World.statistic_dims`: two only when experts are both marked by
        ``is_expert`` and stacked in a DTensor split over the expert axis)."""
        world = self.world
        if dims is None:
            parts = self._statistic_dims([i for i, _, _ in items])
            if parts[0][0] is not None:
                out: list = [None] * len(items)
                for positions, d in parts:
                    got = self._scatter_reduce([items[k] for k in positions], op, whole, d)
                    for k, r in zip(positions, got):
                        out[k] = r
                return out
            dims = parts[0][1]
        group = world.group_of(dims)
        root = world.device_mesh
        coords = mesh_coordinates(root)
        out = [None] * len(items)
        by_dtype: dict = defaultdict(list)
        for k, (_, t, _) in enumerate(items):
            by_dtype[t.dtype].append(k)
        fill = 0.0 if op == "sum" else -math.inf
        for _dtype, ks in by_dtype.items():
            metas = []
            for k in ks:
                i, t, red = items[k]
                x = self.updates[i]
                nd = x.ndim
                red = {d % nd for d in red}
                if t.ndim == nd:  # reduced dims kept (at any size): taken whole
                    keep = [None if d in red else d for d in range(nd)]
                else:
                    keep = [d for d in range(nd) if d not in red]
                w = 1.0 if op == "max" else 1.0 / self.replicas(i, frozenset(dims))
                gshape = statistic_shape(x, t, red)
                assert gshape is not None, "_scatter_reduce takes statistics of DTensor leaves"
                metas.append((x, self.world.leaf_dims(x, self.paths[i]), keep, w, gshape))

            def pack(r, ts, metas=metas):
                parts = []
                for t, (x, ldims, keep, w, gshape) in zip(ts, metas):
                    buf = torch.full(gshape, fill, dtype=t.dtype, device=t.device)
                    where = region(x, [coords[r][d] for d in ldims], keep)
                    buf[where] = t * w if w != 1.0 else t
                    parts.append(buf.reshape(-1))
                return parts[0] if len(parts) == 1 else torch.cat(parts)

            local = per_rank([items[k][1] for k in ks], pack)
            red = all_reduce(local, op, group) if group is not None else local
            sizes = [math.prod(m[4]) for m in metas]
            if whole:  # every rank holds every statistic in full: no rank-dependent slicing
                for j, (k, piece) in enumerate(zip(ks, red.split(sizes))):
                    out[k] = piece.view(metas[j][4])
                continue
            for j, k in enumerate(ks):

                def unpack(r, ts, j=j, metas=metas, sizes=sizes):
                    x, ldims, keep, _, gshape = metas[j]
                    off = sum(sizes[:j])
                    whole = ts[0][off : off + sizes[j]].view(gshape)
                    return whole[region(x, [coords[r][d] for d in ldims], keep)].contiguous()

                out[k] = per_rank([red], unpack)
        return out

    def leaf_totals(self, items: Sequence[tuple[int, torch.Tensor]]) -> list:
        """Complete per-leaf sums over whole leaves with ONE all-reduce for all of them.

        Args:
            items: ``(leaf index, 0-dim local sum over the leaf's local shard)``.

        Each rank weighs its local sums by ``1 / replicas`` and one all-reduce of the vector of
        per-leaf sums runs over every mesh dim but the pipeline one and the expert one (whose
        ranks hold different leaves, which must not be mixed; the expert dim does take part
        when a leaf is one DTensor split over it, see :meth:`World.statistic_dims`); the vector
        is float64 when an input is float64. Returns the global per-leaf sums in order, each a
        0-dim tensor of its input's dtype, so that a leaf's result does not depend on the dtypes
        of the other leaves.
        """
        if not items:
            return []
        dtype = torch.float64 if any(t.dtype == torch.float64 for _, t in items) else torch.float32
        vals = self.leaf_totals_vector(
            [i for i, _ in items], torch.stack([t.to(dtype) for _, t in items])
        )
        return [
            v if v.dtype == t.dtype else v.to(t.dtype) for v, (_, t) in zip(vals.unbind(), items)
        ]

    def leaf_totals_vector(self, indices: Sequence[int], vals: torch.Tensor) -> torch.Tensor:
        """:meth:`leaf_totals` of a vector: ``vals[k]`` is the local sum of leaf
        ``indices[k]``; returns the vector of global sums (ONE all-reduce, none in one
        process), of ``vals``' dtype."""
        return self.leaf_totals_vector_start(indices, vals)()

    def leaf_totals_vector_start(
        self, indices: Sequence[int], vals: torch.Tensor
    ) -> Callable[[], torch.Tensor]:
        """:meth:`leaf_totals_vector` with its all-reduce issued now: returns ``finish``,
        which waits and gives the vector (see
        :func:`~functional_train.engine.collectives.all_reduce_start`: within
        ``collectives.coalesced`` it joins the others started there)."""
        world = self.world
        if world.device_mesh is None or world.size == 1:
            return _done(vals)
        parts = self._statistic_dims(indices)
        if parts[0][0] is None:
            return self._totals_start(indices, vals, parts[0][1])
        started = []
        for positions, dims in parts:
            pos = torch.tensor(positions, dtype=torch.long, device=vals.device)
            sub = [indices[k] for k in positions]
            started.append((pos, self._totals_start(sub, vals[pos], dims)))

        def finish() -> torch.Tensor:
            out = vals.clone()
            for pos, fin in started:
                out[pos] = fin()
            return out

        return finish

    def _totals_start(self, indices, vals: torch.Tensor, dims: set) -> Callable[[], torch.Tensor]:
        """The sums of ``vals`` (per leaf ``indices``) over the world ``dims``, each replica
        counted once (one all-reduce, issued now; none when no dim has more than one rank):
        ``finish`` gives them."""
        group = self.world.group_of(dims)
        if group is None:
            return _done(vals)
        weights = [1.0 / self.replicas(i, frozenset(dims)) for i in indices]
        if any(w != 1.0 for w in weights):
            vals = vals * torch.tensor(weights, dtype=vals.dtype, device=vals.device)
        return all_reduce_start(vals, "sum", group)

    def global_sum(
        self, local_sums: Sequence[torch.Tensor], indices: Sequence[int]
    ) -> torch.Tensor:
        """Sum over every rank of per-leaf local sums (0-dim tensors, or one vector of them),
        each element counted once (ONE all-reduce)."""
        return _global_reduce(self, local_sums, indices, "sum")

    def global_max(
        self, local_maxes: Sequence[torch.Tensor], indices: Sequence[int]
    ) -> torch.Tensor:
        """Max over every rank of per-leaf local maxima (ONE all-reduce)."""
        return _global_reduce(self, local_maxes, indices, "max")

    def global_reduce_start(
        self, values: Sequence[torch.Tensor], indices: Sequence[int], op: str
    ) -> Callable[[], torch.Tensor]:
        """:meth:`global_sum` (``op="sum"``) or :meth:`global_max` (``"max"``) with its
        all-reduce issued now: returns ``finish``, which waits and gives the result (see
        :func:`~functional_train.engine.collectives.all_reduce_start`)."""
        return _global_reduce_start(self, values, indices, op)


def _global_reduce(b: Prepared, values, indices, op: str) -> torch.Tensor:
    return _global_reduce_start(b, values, indices, op)()


def _done(x: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: x


@scalar_program
def _reduce(vals: torch.Tensor, op: str) -> tuple:
    """``(vals.sum(),)`` or ``(vals.max(),)`` (``op``: ``"sum"`` or ``"max"``)."""
    return (vals.sum() if op == "sum" else vals.max(),)


def _global_reduce_start(b: Prepared, values, indices, op: str) -> Callable[[], torch.Tensor]:
    world = b.world
    if len(values) == 0:
        return _done(torch.zeros((), dtype=torch.float32))
    if isinstance(values, torch.Tensor):  # already one vector of per-leaf values
        dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
        vals = values.to(dtype)
    else:
        dtype = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32
        vals = torch.stack([v.to(dtype) for v in values])
    if world.device_mesh is None or world.size == 1:
        return _done(_reduce(vals, op)[0])
    key = ("global", tuple(indices), vals.dtype, vals.device)
    hit = b.plan.memo.get(key)
    if hit is None:  # (every leaf whole on every rank?, replica weights or None), per layout
        replicas = [b.replicas(i) for i in indices]
        weights = None
        if any(r != 1 for r in replicas):
            weights = torch.tensor(
                [1.0 / r for r in replicas], dtype=vals.dtype, device=vals.device
            )
        hit = b.plan.memo[key] = (all(r == world.size for r in replicas), weights)
    whole, weights = hit
    if whole:  # every leaf is whole on every rank: the local result is already the global one
        return _done(vals.sum() if op == "sum" else vals.max())
    if op == "sum":
        if weights is not None:
            vals = vals * weights
        total = vals.sum()
    else:
        total = vals.max()
    return all_reduce_start(total, op, world.world_group())


def mesh_coordinates(root) -> dict:
    """``rank -> mesh coordinate`` for the ranks of ``root`` (under torch.compile: this rank's
    only, read from the mesh rather than from its rank tensor, which tracing cannot read)."""
    if torch.compiler.is_compiling():
        import torch.distributed as dist

        return {dist.get_rank(): tuple(root.get_coordinate())}
    layout = root.mesh.reshape(-1).tolist()
    return dict(zip(layout, itertools.product(*[range(s) for s in root.mesh.shape])))


def leaf_paths(tree: Any) -> list:
    """Dotted paths of the leaves of ``tree`` (``None`` leaves included)."""
    paths_raw, _, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return [format_path(p) for p in paths_raw]


def _unwrapped(x: Any) -> Any:
    """The tensor under ``x``'s ``torch.func`` wrappers (``x`` itself if it has none)."""
    while isinstance(x, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def _refuse_dtensors(tree: Any, leaves: list, pleaves: list | None, name: str) -> None:
    """Raise for a DTensor leaf under a ``torch.func`` transform.

    Raises:
        TypeError: naming the first DTensor leaf's path.
    """
    for k, x in enumerate(zip(leaves, pleaves or [None] * len(leaves))):
        if any(isinstance(_unwrapped(y), DTensor) for y in x):
            path = format_path(optree.tree_flatten_with_path(tree, none_is_leaf=True)[0][k])
            raise TypeError(
                f"{name}: leaf '{path}' is a DTensor; torch.func transforms (vmap, grad, jvp) "
                f"of the library's transforms take plain tensors only (DTensor has no batching "
                f"rules): run them on each rank's local tensors, or without torch.func"
            )


def prepare(
    updates: Any,
    params: Any,
    mesh: Mesh | None,
    *,
    need_params: bool = False,
    name: str = "transform",
    view: bool = False,
) -> Prepared:
    """Flatten, validate and materialise the inputs of one ``update`` call.

    ``updates`` may be a tree, or a :class:`Prepared` view handed along by a chain (returned as
    it is). The layout's :class:`~functional_train.engine.plan.Plan` is built on first use and
    cached; each call then only flattens, reduces unreduced gradients (one bucketed all-reduce
    per kind) and takes the local shards. With ``view=True`` the result's :meth:`rebuild`
    returns views (what a chain does).

    Raises:
        ValueError: ``params`` does not have the structure of ``updates``, a leaf's shape differs
            from its parameter's, a DTensor lives on a mesh that is not part of ``mesh``, or
            ``need_params`` and ``params`` is ``None``.
        TypeError: a leaf is not a tensor, or ``mesh`` is not a :class:`Mesh`.
    """
    if isinstance(updates, Prepared):
        if need_params and updates.params is None:
            raise ValueError(f"{name} needs params: call update(updates, state, params)")
        return updates
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(
            f"{name}: mesh must be a functional_train.Mesh or None, got {type(mesh).__name__}"
        )
    if params is None:
        if need_params:
            raise ValueError(f"{name} needs params: call update(updates, state, params)")
        leaves, treedef = tree_flatten(updates)
        pleaves = None
    else:
        pleaves, treedef = tree_flatten(params)
        leaves = flatten_as(updates, treedef, "updates", "params", params)
    if traced():  # (torch.func has no batching or grad rules for DTensor)
        _refuse_dtensors(updates if params is None else params, leaves, pleaves, name)
    leaves = detached(leaves)  # no graph into the states (see functional_train.autograd)
    if pleaves is not None:
        # (a DTensor parameter is read for its layout, its local shard detached below)
        pleaves = detached(pleaves, dtensors=False)
    if mesh is not None and mesh.pending_data_reduction and not torch.compiler.is_compiling():
        # ranks may differ in which gradients are None: agree first (one small all-reduce)
        leaves = agree_presence(leaves, pleaves, treedef, mesh)
    plan = plan_for(treedef, leaves, pleaves, mesh)
    if plan.trivial:
        return Prepared(plan, leaves, leaves, pleaves, view)
    leaves = plan.materialize(leaves, pleaves)
    locs = to_locals(leaves)
    plocs = None if pleaves is None else detached(to_locals(pleaves))
    return Prepared(plan, leaves, locs, plocs, view)


def per_leaf_view(
    grads: Any, params: Any, mesh: Any, name: str, min_mean_bytes: int = 0
) -> tuple | None:
    """``(prepared view, flat params, treedef)`` for a per-leaf ``ft.step`` path, or ``None``
    where it does not apply: a mesh of more than one rank, no active leaf, DTensor, complex or
    tensor-subclass leaves, gradients of another dtype than their parameters, or active
    gradients averaging under ``min_mean_bytes``."""
    b = prepare(grads, params, mesh, need_params=True, name=name)
    if b.world.device_mesh is not None and b.world.size > 1:
        return None
    pl, treedef = tree_flatten(params)
    act = b.active
    if not act or any(
        isinstance(pl[i], DTensor)
        or b.params[i].dtype != b.locals[i].dtype
        or b.locals[i].dtype.is_complex
        or type(b.locals[i]) is not torch.Tensor
        or type(b.params[i]) is not torch.Tensor
        for i in act
    ):
        return None
    if min_mean_bytes and sum(
        b.locals[i].numel() * b.locals[i].element_size() for i in act
    ) < min_mean_bytes * len(act):
        return None
    return b, pl, treedef


def per_leaf_result(
    params: Any, pl: list, treedef: Any, new_p: dict, new_state: Any, donate: bool
) -> tuple:
    """A per-leaf step's ``(params, state)``: the donated ``params`` (updated in place), or the
    params tree with the new leaves ``new_p`` (position -> tensor) marked as requiring grad
    where the old ones did."""
    if donate:
        return params, new_state
    leaves = list(pl)
    for i, x in new_p.items():
        leaves[i] = requires_grad_like(x, pl[i])
    return tree_unflatten(treedef, leaves), new_state
