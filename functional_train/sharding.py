"""The sharding engine: local views, rewrapping, batched global reductions, materialisation.

Arithmetic runs on local shards (``DTensor.to_local()``); results are rewrapped with
``DTensor.from_local(..., run_check=False, shape=..., stride=...)`` in the parameter's placements.
Every collective is issued here, through ``torch.distributed._functional_collectives`` (traceable
by torch.compile), and batched: the partial results of one kind for all leaves are flattened into
one buffer and reduced by one collective per process group.

Reductions are derived from placements plus the :class:`~functional_train.Mesh` descriptor
(DESIGN.md section 3):

* a sum over a whole leaf counts replicas once: each rank weighs its local partial sum by
  ``1 / (number of ranks holding the same shard)``, and one all-reduce over the whole mesh adds
  the weighted contributions of every leaf, shard, pipeline stage and expert;
* unreduced gradients (plain tensors over the data axis: mean; ``Partial`` placements: as the
  placement says) are reduced by :func:`materialize` into the placements of the parameter.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from typing import Any, Optional, Sequence

import optree
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .mesh import Mesh
from .tree import flatten_as, format_path, tree_flatten, tree_unflatten

__all__ = [
    "Spec",
    "spec_of",
    "to_local",
    "wrap",
    "World",
    "Prepared",
    "prepare",
    "materialize",
    "all_reduce_buckets",
]


# ---------------------------------------------------------------------------------------------
# local views and rewrapping
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
    """How a DTensor leaf is spread: its mesh, placements, global shape and global stride."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple
    _dtensor_specs: dict = dataclasses.field(default_factory=dict, compare=False, hash=False,
                                             repr=False)

    def dtensor_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The (cached) ``DTensorSpec`` of a DTensor of this layout and ``dtype``."""
        hit = self._dtensor_specs.get(dtype)
        if hit is None:
            hit = DTensorSpec(self.mesh, self.placements,
                              tensor_meta=TensorMeta(self.shape, self.stride, dtype))
            self._dtensor_specs[dtype] = hit
        return hit


def spec_of(x: Any) -> Optional[Spec]:
    """The :class:`Spec` of a DTensor, ``None`` for a plain tensor or ``None``."""
    if isinstance(x, DTensor):
        return Spec(x.device_mesh, tuple(x.placements), x.shape, tuple(x.stride()))
    return None


def to_local(x: Any) -> Any:
    """The local shard of a DTensor (no copy, no autograd edge); plain tensors and ``None`` are
    returned as is."""
    if isinstance(x, DTensor):
        if torch.compiler.is_compiling():
            return x.to_local()
        return x._local_tensor
    return x


def wrap(local: Any, spec: Optional[Spec]) -> Any:
    """Rewrap a local shard in ``spec`` (no communication, no check); identity for ``spec=None``.

    Eagerly this builds the DTensor directly from a cached ``DTensorSpec`` (about 15x cheaper than
    ``DTensor.from_local``); under ``torch.compile`` it uses ``DTensor.from_local``.
    """
    if spec is None or local is None:
        return local
    if torch.compiler.is_compiling():
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride)
    return DTensor(local, spec.dtensor_spec(local.dtype), requires_grad=False)


# ---------------------------------------------------------------------------------------------
# the world: the whole mesh a tree lives on
# ---------------------------------------------------------------------------------------------
def _groups_over(device_mesh: DeviceMesh, dims: Sequence[int]) -> tuple:
    """Functional-collective groups whose successive all-reduces reduce over the mesh dims
    ``dims``: the default (world) process group when they span every rank of the job, else one
    ``(device_mesh, dim)`` group per dim (sum, avg, max and min compose dim by dim).

    The user's mesh is never flattened: once a mesh has a flattened child, torch 2.13
    redistributes nested uneven ``Shard`` placements on it with wrong chunk sizes (pytorch PR
    194457), and flattened meshes outlive the process group they were made on."""
    dims = sorted(dims)
    if len(dims) == 1:
        return ((device_mesh, dims[0]),)
    size = math.prod(device_mesh.size(d) for d in dims)
    if dist.is_initialized() and size == dist.get_world_size():
        return (dist.group.WORLD,)
    return tuple((device_mesh, d) for d in dims)


class World:
    """The whole device mesh of one update call and the roles of its dims for each leaf.

    Built from the :class:`Mesh` descriptor, or, with ``mesh=None``, from the DTensor leaves
    themselves (they must share one root mesh).
    """

    def __init__(self, mesh: Optional[Mesh], leaves: Sequence[Any], paths: Sequence[str]):
        if mesh is not None and mesh.device_mesh is not None:
            self.mesh = mesh
        else:
            self.mesh = self._derive(leaves, paths)
        self.device_mesh: Optional[DeviceMesh] = self.mesh.device_mesh
        self.names = self.mesh.dim_names
        self.shape = tuple(self.device_mesh.shape) if self.device_mesh is not None else ()
        self._pp = self._dim_or_none(self.mesh.pipeline_axis)
        self._ep = self._dim_or_none(self.mesh.expert_axis)
        self._dp = self._dim_or_none(self.mesh.data_axis)

    def _dim_or_none(self, name):
        return None if name is None else self.names.index(name)

    @staticmethod
    def _derive(leaves, paths) -> Mesh:
        root = None
        for x, p in zip(leaves, paths):
            if isinstance(x, DTensor):
                r = x.device_mesh._get_root_mesh()
                if root is None:
                    root, root_path = r, p
                elif r is not root:
                    raise ValueError(
                        f"leaf '{p}' is a DTensor on {r}, but leaf '{root_path}' is on {root}; "
                        "DTensors on different meshes need mesh=ft.Mesh(device_mesh) naming the "
                        "mesh that holds both")
        return Mesh(root)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def leaf_dims(self, x: Any, path: str) -> tuple[int, ...]:
        """World dim index of each mesh dim of DTensor ``x``.

        Raises:
            ValueError: ``x`` lives on a mesh that is not the world mesh or a sub-mesh of it.
        """
        m = x.device_mesh
        if self.device_mesh is None:
            raise ValueError(f"leaf '{path}' is a DTensor but mesh has no device_mesh")
        if m is self.device_mesh:
            return tuple(range(self.device_mesh.ndim))
        names = m.mesh_dim_names
        ok = names is not None and all(n in self.names for n in names)
        if ok:
            dims = tuple(self.names.index(n) for n in names)
            ok = all(m.size(i) == self.shape[d] for i, d in enumerate(dims))
            ok = ok and (m._get_root_mesh() is self.device_mesh
                         or m.device_type == self.device_mesh.device_type)
        if not ok:
            raise ValueError(
                f"leaf '{path}' is a DTensor on {m}, which is not part of the mesh {self.mesh!r}; "
                "expected the mesh itself or a sub-mesh of it (device_mesh['name'])")
        return dims

    def replicas(self, x: Any, path: str, within: Optional[set] = None) -> int:
        """How many ranks hold the same local values of leaf ``x`` (materialised, not Partial),
        counting only the world dims in ``within`` (all by default)."""
        if self.device_mesh is None:
            return 1
        split = set()
        if isinstance(x, DTensor):
            for d, p in zip(self.leaf_dims(x, path), x.placements):
                if isinstance(p, Shard):
                    split.add(d)
                elif isinstance(p, Partial):
                    raise ValueError(f"leaf '{path}' is still Partial; materialize it first")
        if self._pp is not None:
            split.add(self._pp)
        if self._ep is not None and self.mesh.is_expert is not None and self.mesh.is_expert(path):
            split.add(self._ep)
        return math.prod(s for d, s in enumerate(self.shape)
                         if d not in split and (within is None or d in within))

    def shard_group(self, x: Any, path: str, tensor_dims: Sequence[int]):
        """The group of the mesh dims that shard any of ``tensor_dims`` of leaf ``x``, or
        ``None`` when the leaf is whole on every rank along them."""
        if not isinstance(x, DTensor):
            return None
        ndim = x.ndim
        want = {d % ndim for d in tensor_dims} if ndim else set()
        dims = sorted({w for w, p in zip(self.leaf_dims(x, path), x.placements)
                       if isinstance(p, Shard) and p.dim % ndim in want})
        return self.group_of(dims)

    def group_of(self, dims: Sequence[int]):
        """The groups (see :func:`_groups_over`) reducing over the world mesh dims ``dims``;
        ``None`` if ``dims`` is empty."""
        if not dims:
            return None
        return _groups_over(self.device_mesh, dims)

    def separating_dims(self) -> set:
        """World dims along which ranks hold different leaves (pipeline, expert)."""
        return {d for d in (self._pp, self._ep) if d is not None}

    def world_group(self):
        return _groups_over(self.device_mesh, range(self.device_mesh.ndim))

    def dim_group(self, dim: int):
        return ((self.device_mesh, dim),)


# ---------------------------------------------------------------------------------------------
# batched collectives
# ---------------------------------------------------------------------------------------------
def _group_key(groups: tuple) -> Any:
    return tuple(g if isinstance(g, dist.ProcessGroup) else g[0].get_group(g[1]) for g in groups)


def _all_reduce(t: torch.Tensor, op: str, groups: tuple) -> torch.Tensor:
    """All-reduce ``t`` over ``groups`` in succession (see :func:`_groups_over`)."""
    for g in groups:
        t = funcol.wait_tensor(funcol.all_reduce(t, op, g))
    return t


def all_reduce_buckets(items: Sequence[tuple[torch.Tensor, Any, str]]) -> list[torch.Tensor]:
    """All-reduce many tensors with one collective per (process group, op, dtype).

    Args:
        items: ``(tensor, groups, op)`` with ``groups`` a tuple of ``(DeviceMesh, dim)`` pairs
            or process groups to reduce over in succession, and ``op`` one of ``"sum"``, ``"avg"``, ``"max"``, ``"min"``. Tensors may have any shape; tensors of
            one bucket must have the same number of elements on every rank of the group.

    Returns:
        the reduced tensors, in the order given (new tensors; inputs are not modified).
    """
    buckets: dict[Any, list[int]] = defaultdict(list)
    for i, (t, group, op) in enumerate(items):
        buckets[(_group_key(group), op, t.dtype)].append(i)
    out: list[Optional[torch.Tensor]] = [None] * len(items)
    for (_, op, _), idx in buckets.items():
        group = items[idx[0]][1]
        tensors = [items[i][0] for i in idx]
        if len(tensors) == 1:
            flat = tensors[0].reshape(-1)
        else:
            flat = torch.cat([t.reshape(-1) for t in tensors])
        red = _all_reduce(flat, op, group)
        if len(tensors) == 1:
            out[idx[0]] = red.view(tensors[0].shape)
            continue
        parts = torch.split(red, [t.numel() for t in tensors])
        for i, t, part in zip(idx, tensors, parts):
            out[i] = part.view(t.shape)
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# materialisation of unreduced gradients
# ---------------------------------------------------------------------------------------------
def _unreduced_over_data(world: World, x: Any, path: str) -> bool:
    if world._dp is None:
        return False
    if isinstance(x, DTensor):
        return world._dp not in world.leaf_dims(x, path)
    return True


def materialize(grads: list, params: Optional[list], paths: Sequence[str],
                mesh: Optional[Mesh], world: World) -> list:
    """Reduce unreduced gradients into the placements of their parameters.

    * plain tensors and DTensors on a sub-mesh without ``mesh.data_axis``: mean over the data
      axis (one bucketed all-reduce per dtype);
    * ``Partial`` placements: reduced as the placement says over its mesh dim (one bucketed
      all-reduce per process group, op and dtype), becoming ``Replicate``;
    * then, when the parameter's placements differ from the gradient's (autograd gives a
      ``Shard(0)`` bias gradient for a ``Replicate`` bias next to a colwise-sharded weight), the
      gradient is redistributed into the parameter's placements.

    Returns the list of materialised gradients (``None`` leaves stay ``None``).
    """
    grads = list(grads)
    # 1. data axis mean
    if mesh is not None and mesh.pending_data_reduction:
        group = world.dim_group(world._dp)
        idx = [i for i, g in enumerate(grads)
               if g is not None and _unreduced_over_data(world, g, paths[i])]
        red = all_reduce_buckets([(to_local(grads[i]), group, "avg") for i in idx])
        for i, r in zip(idx, red):
            grads[i] = wrap(r, spec_of(grads[i]))
    # 2. Partial placements, one round per mesh dim that can still be partial
    while True:
        items, where = [], []
        for i, g in enumerate(grads):
            if not isinstance(g, DTensor):
                continue
            for j, p in enumerate(g.placements):
                if isinstance(p, Partial):
                    items.append((to_local(g), ((g.device_mesh, j),), p.reduce_op))
                    where.append((i, j))
                    break
        if not items:
            break
        red = all_reduce_buckets(items)
        for (i, j), r in zip(where, red):
            s = spec_of(grads[i])
            placements = list(s.placements)
            placements[j] = Replicate()
            grads[i] = wrap(r, dataclasses.replace(s, placements=tuple(placements)))
    # 3. placements of the parameter
    if params is not None:
        for i, (g, p) in enumerate(zip(grads, params)):
            if g is None or p is None:
                continue
            gd, pd = isinstance(g, DTensor), isinstance(p, DTensor)
            if gd and pd:
                if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
                    grads[i] = g.redistribute(p.device_mesh, p.placements)
            elif gd:
                grads[i] = g.full_tensor()
            elif pd:
                grads[i] = DTensor.from_local(
                    g, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False
                ).redistribute(p.device_mesh, p.placements)
    return grads


# ---------------------------------------------------------------------------------------------
# the prepared view of one update call
# ---------------------------------------------------------------------------------------------
class Prepared:
    """Flattened, validated and materialised inputs of one ``update`` call.

    Attributes:
        treedef: structure of the updates (``None`` leaves included).
        paths: dotted leaf paths (computed on first use).
        updates: materialised update leaves (DTensor / Tensor / ``None``).
        locals: their local shards (``None`` for ``None`` leaves).
        specs: their :class:`Spec` (``None`` for plain tensors).
        params: local shards of the parameters, or ``None`` when no params were given.
        active: indices of the non-``None`` update leaves.
        world: the :class:`World` of the call.
        mesh: the descriptor after materialisation (data axis reduced).
    """

    __slots__ = ("treedef", "_tree", "_paths", "updates", "locals", "specs", "params", "active",
                 "world", "mesh")

    def __init__(self, treedef, tree, paths, updates, locals_, specs, params, active, world, mesh):
        self.treedef, self._tree, self._paths = treedef, tree, paths
        self.updates, self.locals, self.specs, self.params = updates, locals_, specs, params
        self.active, self.world, self.mesh = active, world, mesh

    @property
    def paths(self) -> list:
        if self._paths is None:
            self._paths = leaf_paths(self._tree)
        return self._paths

    def rebuild(self, new_locals: Sequence[Any]) -> Any:
        """Unflatten ``new_locals`` (one per leaf, ``None`` allowed) rewrapped in ``specs``."""
        return tree_unflatten(self.treedef, [wrap(l, s) for l, s in zip(new_locals, self.specs)])

    def rebuild_active(self, active_locals: Sequence[Any]) -> Any:
        """Like :meth:`rebuild` from values for the ``active`` leaves only (others stay ``None``)."""
        full: list = [None] * len(self.locals)
        for i, v in zip(self.active, active_locals):
            full[i] = v
        return self.rebuild(full)

    def state_locals(self, tree: Any, what: str) -> list:
        """Local shards of a params-shaped state tree, checked against the updates' structure
        and, leaf by leaf, their shapes.

        Raises:
            ValueError: naming the leaf path whose structure or shape differs.
        """
        leaves = flatten_as(tree, self.treedef, what, "the updates")
        for i in self.active:
            x = leaves[i]
            if x is not None and x.shape != self.updates[i].shape:
                raise ValueError(f"update leaf '{self.paths[i]}' has shape "
                                 f"{tuple(self.updates[i].shape)}, but its {what} leaf has shape "
                                 f"{tuple(x.shape)} (the parameter's)")
        return [to_local(x) for x in leaves]

    def state_tree(self, tree: Any, what: str, new_active: Sequence[Any]) -> Any:
        """A params-shaped state tree with the ``active`` leaves replaced by rewrapped locals."""
        old = flatten_as(tree, self.treedef, what, "the updates")
        if all(x is None for x in old) and all(v is None for v in new_active):
            return tree  # an all-None field (dynamo cannot rebuild a dict of constants)
        leaves = list(old)
        for i, v in zip(self.active, new_active):
            leaves[i] = wrap(v, spec_of(old[i]))
        return tree_unflatten(self.treedef, leaves)

    def leaf_sums(self, items: Sequence[tuple[int, torch.Tensor, Sequence[int]]],
                  op: str = "sum", whole: bool = False) -> list:
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
                sharded = isinstance(x, DTensor) and any(isinstance(p, Shard)
                                                         for p in x.placements)
                if not sharded:
                    out[n] = t
                elif _statistic_shape(x, t, dims) is None:
                    raise ValueError(f"leaf_sums(whole=True): the partial result for leaf "
                                     f"'{self.paths[i]}' is not a statistic of its local shard")
                else:
                    scatter.append(n)
                continue
            group = self.world.shard_group(x, self.paths[i], dims)
            if group is None:
                out[n] = t
            elif _statistic_shape(x, t, dims) is not None:
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

    def _scatter_reduce(self, items, op: str, whole: bool = False) -> list:
        """Whole-statistic buffers of ``items`` completed by one all-reduce per dtype."""
        world = self.world
        dims = set(range(world.device_mesh.ndim)) - world.separating_dims()
        group = world.group_of(dims)
        root = world.device_mesh
        layout = root.mesh.reshape(-1).tolist()
        coords = dict(zip(layout, itertools.product(*(range(s) for s in root.mesh.shape))))
        out: list = [None] * len(items)
        by_dtype: dict = defaultdict(list)
        for k, (_, t, _) in enumerate(items):
            by_dtype[t.dtype].append(k)
        fill = 0.0 if op == "sum" else -math.inf
        for dtype, ks in by_dtype.items():
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
                w = 1.0 if op == "max" else 1.0 / world.replicas(x, self.paths[i], dims)
                metas.append((x, self.world.leaf_dims(x, self.paths[i]), keep, w,
                              _statistic_shape(x, t, red)))

            def pack(r, ts, metas=metas):
                parts = []
                for t, (x, ldims, keep, w, gshape) in zip(ts, metas):
                    buf = torch.full(gshape, fill, dtype=t.dtype, device=t.device)
                    region = _region(x, [coords[r][d] for d in ldims], keep)
                    buf[region] = t * w if w != 1.0 else t
                    parts.append(buf.reshape(-1))
                return parts[0] if len(parts) == 1 else torch.cat(parts)

            local = per_rank([items[k][1] for k in ks], pack)
            red = _all_reduce(local, op, group) if group is not None else local
            sizes = [math.prod(m[4]) for m in metas]
            if whole:  # every rank holds every statistic in full: no rank-dependent slicing
                for j, (k, piece) in enumerate(zip(ks, red.split(sizes))):
                    out[k] = piece.view(metas[j][4])
                continue
            for j, k in enumerate(ks):

                def unpack(r, ts, j=j, metas=metas, sizes=sizes):
                    x, ldims, keep, _, gshape = metas[j]
                    off = sum(sizes[:j])
                    whole = ts[0][off:off + sizes[j]].view(gshape)
                    return whole[_region(x, [coords[r][d] for d in ldims], keep)].contiguous()

                out[k] = per_rank([red], unpack)
        return out

    def leaf_totals(self, items: Sequence[tuple[int, torch.Tensor]]) -> list:
        """Complete per-leaf sums over whole leaves with ONE all-reduce for all of them.

        Args:
            items: ``(leaf index, 0-dim local sum over the leaf's local shard)``.

        Each rank weighs its local sums by ``1 / replicas`` and one all-reduce of the vector of
        per-leaf sums runs over every mesh dim but the pipeline and expert ones (whose ranks hold
        different leaves, which must not be mixed). Returns the global per-leaf sums (0-dim
        float32 tensors, float64 when an input is float64), in order.
        """
        if not items:
            return []
        dtype = torch.float64 if any(t.dtype == torch.float64 for _, t in items) else torch.float32
        vals = torch.stack([t.to(dtype) for _, t in items])
        world = self.world
        if world.device_mesh is None or world.size == 1:
            return list(vals.unbind())
        dims = set(range(world.device_mesh.ndim)) - world.separating_dims()
        group = world.group_of(dims)
        if group is None:
            return list(vals.unbind())
        paths = self.paths
        weights = [1.0 / world.replicas(self.updates[i], paths[i], dims) for i, _ in items]
        if any(w != 1.0 for w in weights):
            vals = vals * torch.tensor(weights, dtype=vals.dtype, device=vals.device)
        red = _all_reduce(vals, "sum", group)
        return list(red.unbind())

    def global_sum(self, local_sums: Sequence[torch.Tensor], indices: Sequence[int]) -> torch.Tensor:
        """Sum over every rank of per-leaf local sums, each element counted once (ONE all-reduce)."""
        return _global_reduce(self, local_sums, indices, "sum")

    def global_max(self, local_maxes: Sequence[torch.Tensor], indices: Sequence[int]) -> torch.Tensor:
        """Max over every rank of per-leaf local maxima (ONE all-reduce)."""
        return _global_reduce(self, local_maxes, indices, "max")


def _statistic_shape(x: Any, t: torch.Tensor, dims: Sequence[int]) -> Optional[list]:
    """The global shape of the statistic ``t`` of DTensor ``x`` reduced locally over ``dims``, or
    ``None`` when ``t`` is not one.

    ``t`` is a statistic when it is shaped like the local shard of ``x`` with ``dims`` removed
    (a row sum), or with ``dims`` kept at any size that no mesh dim splits (a projection onto
    ``r`` directions, a ``keepdim`` sum); the other dims are the leaf's local ones."""
    if not isinstance(x, DTensor):
        return None
    nd = x.ndim
    red = {d % nd for d in dims} if nd else set()
    loc = x._local_tensor.shape if not torch.compiler.is_compiling() else x.to_local().shape
    if t.ndim == nd - len(red):
        want = [loc[d] for d in range(nd) if d not in red]
        if all(a is b or a == b for a, b in zip(t.shape, want)):
            return [x.shape[d] for d in range(nd) if d not in red]
        return None
    if t.ndim == nd and all(t.shape[d] is loc[d] or t.shape[d] == loc[d]
                            for d in range(nd) if d not in red):
        return [t.shape[d] if d in red else x.shape[d] for d in range(nd)]
    return None


def shard_region(shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int],
                 coord: Sequence[int]) -> tuple[list, list]:
    """``(starts, lengths)`` of the block of a global tensor of ``shape`` that the rank at mesh
    coordinate ``coord`` holds under ``placements`` (torch's nested chunking: mesh dims left to
    right, ``torch.chunk`` sizes, trailing chunks possibly empty)."""
    nd = len(shape)
    starts, lens = [0] * nd, [int(s) for s in shape]
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % nd
            n = lens[d]
            chunk = -(-n // int(mesh_shape[i]))
            st = min(int(coord[i]) * chunk, n)
            starts[d] += st
            lens[d] = min(st + chunk, n) - st
    return starts, lens


def _region(x: DTensor, coord: Sequence[int], keep: Sequence[Optional[int]]) -> tuple:
    """The slices of the rank at mesh coordinate ``coord`` (one per dim of ``x``'s mesh) in a
    statistic of ``x`` whose dims are the tensor dims ``keep`` of ``x`` (``None``: a dim no
    mesh dim splits; taken whole)."""
    starts, lens = shard_region(x.shape, x.placements, x.device_mesh.shape, coord)
    return tuple(slice(None) if d is None else slice(starts[d], starts[d] + lens[d])
                 for d in keep)


def per_rank(tensors: Sequence[torch.Tensor], fn) -> torch.Tensor:
    """``fn(rank, [this rank's tensors]) -> tensor`` for rank-dependent work (offsets into a
    global buffer): one call on a real process group or in one process; under
    ``LocalTensorMode`` one call per simulated rank on its local values."""
    from torch.distributed import _local_tensor as lt

    mode = lt.enabled_local_tensor_mode()
    if mode is None:
        return fn(dist.get_rank() if dist.is_initialized() else 0, list(tensors))
    out = {}
    with mode.disable():
        for r in mode.ranks:
            out[r] = fn(r, [t._local_tensors[r] if isinstance(t, lt.LocalTensor) else t
                            for t in tensors])
    return lt.LocalTensor(out)


def leaf_paths(tree: Any) -> list:
    """Dotted paths of the leaves of ``tree`` (``None`` leaves included)."""
    paths_raw, _, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return [format_path(p) for p in paths_raw]


def _global_reduce(b: Prepared, values, indices, op: str) -> torch.Tensor:
    world = b.world
    if len(values) == 0:
        return torch.zeros((), dtype=torch.float32)
    dtype = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32
    vals = torch.stack([v.to(dtype) for v in values])
    if world.device_mesh is None or world.size == 1:
        return vals.sum() if op == "sum" else vals.max()
    paths = b.paths
    replicas = [world.replicas(b.updates[i], paths[i]) for i in indices]
    if all(r == world.size for r in replicas):
        # every leaf is whole on every rank: the local result is already the global one
        return vals.sum() if op == "sum" else vals.max()
    if op == "sum":
        if any(r != 1 for r in replicas):
            weights = [1.0 / r for r in replicas]
            vals = vals * torch.tensor(weights, dtype=vals.dtype, device=vals.device)
        total = vals.sum()
    else:
        total = vals.max()
    return _all_reduce(total, op, world.world_group())


def _check_leaf(path: str, u: Any, p: Any) -> None:
    if u is not None and not isinstance(u, torch.Tensor):
        raise TypeError(f"update leaf '{path}' must be a torch.Tensor, DTensor or None, "
                        f"got {type(u).__name__}")
    if p is not None and not isinstance(p, torch.Tensor):
        raise TypeError(f"params leaf '{path}' must be a torch.Tensor, DTensor or None, "
                        f"got {type(p).__name__}")
    if u is not None and p is not None and tuple(u.shape) != tuple(p.shape):
        raise ValueError(f"update leaf '{path}' has shape {tuple(u.shape)}, "
                         f"expected the parameter's shape {tuple(p.shape)}")


_NO_WORLD = None


def _trivial_world() -> "World":
    global _NO_WORLD
    if _NO_WORLD is None:
        _NO_WORLD = World(None, [], [])
    return _NO_WORLD


def prepare(updates: Any, params: Any, mesh: Optional[Mesh], *, need_params: bool = False,
            name: str = "transform") -> Prepared:
    """Flatten, validate and materialise the inputs of one ``update`` call.

    Raises:
        ValueError: ``params`` does not have the structure of ``updates``, a leaf's shape differs
            from its parameter's, a DTensor lives on a mesh that is not part of ``mesh``, or
            ``need_params`` and ``params`` is ``None``.
        TypeError: a leaf is not a tensor, or ``mesh`` is not a :class:`Mesh`.
    """
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"{name}: mesh must be a functional_train.Mesh or None, "
                        f"got {type(mesh).__name__}")
    if params is None:
        if need_params:
            raise ValueError(f"{name} needs params: call update(updates, state, params)")
        leaves, treedef = tree_flatten(updates)
        pleaves = None
    else:
        pleaves, treedef = tree_flatten(params)
        leaves = flatten_as(updates, treedef, "updates", "params", params)
    any_dtensor = False
    for i, u in enumerate(leaves):
        p = None if pleaves is None else pleaves[i]
        if u is None:
            continue
        if not isinstance(u, torch.Tensor) or (p is not None and (
                not isinstance(p, torch.Tensor) or u.shape != p.shape)):
            _check_leaf(leaf_paths(updates)[i], u, p)
        if isinstance(u, DTensor) or isinstance(p, DTensor):
            any_dtensor = True
    if pleaves is not None and not any_dtensor:
        any_dtensor = any(isinstance(p, DTensor) for p in pleaves)
    if not any_dtensor and (mesh is None or mesh.device_mesh is None):
        active = [i for i, x in enumerate(leaves) if x is not None]
        return Prepared(treedef, updates, None, leaves, leaves, [None] * len(leaves), pleaves,
                        active, _trivial_world(), mesh)
    paths = leaf_paths(updates)
    world = World(mesh, list(pleaves or []) + list(leaves), list(paths) * (2 if pleaves else 1))
    for x, p in zip(leaves, paths):
        if isinstance(x, DTensor):
            world.leaf_dims(x, p)
    leaves = materialize(leaves, pleaves, paths, mesh, world)
    specs = [spec_of(x) for x in leaves]
    locs = [to_local(x) for x in leaves]
    plocs = None if pleaves is None else [to_local(x) for x in pleaves]
    active = [i for i, x in enumerate(leaves) if x is not None]
    return Prepared(treedef, updates, paths, leaves, locs, specs, plocs, active, world,
                    None if mesh is None else mesh.reduced())
