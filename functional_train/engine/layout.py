"""Mesh roles per leaf: which dims of the device mesh split, replicate or separate each leaf,
and where a rank's shard sits in the global tensor.

A leaf's DTensor placements say how it is spread over the mesh dims it lives on; the
:class:`~functional_train.Mesh` descriptor adds the data, pipeline and expert roles.
:class:`World` answers, for one tree on one mesh, the questions every global reduction asks:
how many ranks hold the same values of a leaf (replicas count once), and which mesh dims shard
a given tensor dim.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard

from ..mesh import Mesh
from .collectives import groups_over

__all__ = ["World", "shard_region", "region", "statistic_shape"]


class World:
    """The whole device mesh of one update call and the roles of its dims for each leaf.

    Built from the :class:`Mesh` descriptor, or, with ``mesh=None``, from the DTensor leaves
    themselves (they must share one root mesh).
    """

    def __init__(self, mesh: Mesh | None, leaves: Sequence[Any], paths: Sequence[str]):
        """``paths``: one label per leaf for error messages (``"params leaf 'w'"``)."""
        if mesh is not None and mesh.device_mesh is not None:
            self.mesh = mesh
        else:
            self.mesh = self._derive(leaves, paths)
        self.device_mesh: DeviceMesh | None = self.mesh.device_mesh
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
                elif r is not root and r != root:  # (equal meshes: torch's DTensor
                    # caches hand back results on an equal mesh of an earlier layout)
                    raise ValueError(
                        f"{p} is a DTensor on {r}, but {root_path} is on {root}; "
                        "DTensors on different meshes need mesh=ft.Mesh(device_mesh) naming the "
                        "mesh that holds both"
                    )
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
        if m is self.device_mesh or m == self.device_mesh:
            return tuple(range(self.device_mesh.ndim))
        names = m.mesh_dim_names
        ok = names is not None and all(n in self.names for n in names)
        if ok:
            dims = tuple(self.names.index(n) for n in names)
            ok = all(m.size(i) == self.shape[d] for i, d in enumerate(dims))
            ok = ok and (
                m._get_root_mesh() == self.device_mesh
                or m.device_type == self.device_mesh.device_type
            )
        if not ok:
            raise ValueError(
                f"leaf '{path}' is a DTensor on {m}, which is not part of the mesh {self.mesh!r}; "
                "expected the mesh itself or a sub-mesh of it (device_mesh['name'])"
            )
        return dims

    def replicas(self, x: Any, path: str, within: Collection[int] | None = None) -> int:
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
        return math.prod(
            [
                s
                for d, s in enumerate(self.shape)
                if d not in split and (within is None or d in within)
            ]
        )

    def is_expert_leaf(self, x: Any, path: str) -> bool:
        """Leaf ``x`` differs per rank along the expert axis: ``Mesh.is_expert`` marks its path,
        or it is a DTensor ``Shard``-ed over the expert axis (stacked experts)."""
        return self.expert_marked(path) or self.expert_split(x, path)

    def expert_marked(self, path: str) -> bool:
        """``Mesh.is_expert`` marks ``path``: the ranks of the expert axis hold different leaves
        under it (never to be mixed in a reduction over that axis)."""
        return (
            self._ep is not None
            and self.mesh.is_expert is not None
            and bool(self.mesh.is_expert(path))
        )

    def expert_split(self, x: Any, path: str) -> bool:
        """``x`` is one DTensor ``Shard``-ed over the expert axis (experts stacked along a
        tensor dim): its statistics are completed over that axis like over any other."""
        return (
            self._ep is not None
            and isinstance(x, DTensor)
            and any(
                d == self._ep and isinstance(p, Shard)
                for d, p in zip(self.leaf_dims(x, path), x.placements)
            )
        )

    def statistic_dims(self, leaves: Sequence[tuple[Any, str]]) -> list:
        """How to complete per-leaf statistics of ``leaves`` (``(leaf, path)`` pairs) with as
        few all-reduces as possible: ``[(positions or None for all, world dims)]``. The
        pipeline dim never takes part (its ranks hold different leaves); the expert dim takes
        part when a leaf is split over it, except for the leaves ``is_expert`` marks (each
        expert-axis rank holds different ones), which then go in a second reduction."""
        base = set(range(len(self.shape))) - self.separating_dims()
        split = [self.expert_split(x, p) for x, p in leaves]
        if not any(split):
            return [(None, base)]
        marked = [self.expert_marked(p) and not s for (_, p), s in zip(leaves, split)]
        if not any(marked):
            return [(None, base | {self._ep})]
        return [
            ([k for k, m in enumerate(marked) if not m], base | {self._ep}),
            ([k for k, m in enumerate(marked) if m], base),
        ]

    def shard_group(self, x: Any, path: str, tensor_dims: Sequence[int]):
        """The group of the mesh dims that shard any of ``tensor_dims`` of leaf ``x``, or
        ``None`` when the leaf is whole on every rank along them."""
        if not isinstance(x, DTensor):
            return None
        ndim = x.ndim
        want = {d % ndim for d in tensor_dims} if ndim else set()
        dims = sorted(
            {
                w
                for w, p in zip(self.leaf_dims(x, path), x.placements)
                if isinstance(p, Shard) and p.dim % ndim in want
            }
        )
        return self.group_of(dims)

    def group_of(self, dims: Collection[int]):
        """The groups (see :func:`groups_over`) reducing over the world mesh dims ``dims``;
        ``None`` if ``dims`` is empty."""
        if not dims or self.device_mesh is None:
            return None
        return groups_over(self.device_mesh, dims)

    def separating_dims(self) -> set:
        """World dims along which ranks hold different leaves (pipeline, expert)."""
        return {d for d in (self._pp, self._ep) if d is not None}

    def world_group(self):
        return groups_over(self.device_mesh, range(self.device_mesh.ndim))

    def dim_group(self, dim: int):
        return ((self.device_mesh, dim),)


def statistic_shape(x: Any, t: torch.Tensor, dims: Collection[int]) -> list | None:
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
    if t.ndim == nd and all(
        t.shape[d] is loc[d] or t.shape[d] == loc[d] for d in range(nd) if d not in red
    ):
        return [t.shape[d] if d in red else x.shape[d] for d in range(nd)]
    return None


def shard_region(
    shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int], coord: Sequence[int]
) -> tuple[list, list]:
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


def region(x: DTensor, coord: Sequence[int], keep: Sequence[int | None]) -> tuple:
    """The slices of the rank at mesh coordinate ``coord`` (one per dim of ``x``'s mesh) in a
    statistic of ``x`` whose dims are the tensor dims ``keep`` of ``x`` (``None``: a dim no
    mesh dim splits; taken whole)."""
    starts, lens = shard_region(x.shape, x.placements, x.device_mesh.shape, coord)
    return tuple(slice(None) if d is None else slice(starts[d], starts[d] + lens[d]) for d in keep)
