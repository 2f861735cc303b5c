"""ZeRO-1/2 as a transform: the inner state sharded over the data axis (Rajbhandari et al. 2020).

``zero_redundancy(inner, axis="dp")`` runs ``inner`` on a *zero view* of every leaf: the leaf's
own layout (its tensor parallel placements) plus ``Shard(d)`` over the data axis on a tensor dim
``d`` that no other mesh dim shards. The gradients enter the view by one bucketed
reduce-scatter over the data axis (the data parallel mean and the sharding in one collective),
``inner`` sees DTensors sharded over the data axis (so its state, built from the zero view of
the parameters, holds 1/dp of each leaf per rank, and its global statistics stay exact: they are
over the global tensor whatever the placements), and its updates leave the view by one bucketed
all-gather back into the parameters' placements.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .autograd import requires_grad_like
from .base import GradientTransformation, declare
from .engine.collectives import all_gather, all_reduce_buckets, per_rank, reduce_scatter
from .engine.dtensor import Spec, spec_of, to_local, wrap, wrap_like
from .engine.plan import agree_presence, data_mean, plan_for
from .engine.view import leaf_paths, mesh_coordinates
from .mesh import Mesh
from .spec import attach_spec
from .tree import contiguous_stride, flatten_as, leaves_of, tree_flatten, tree_unflatten

__all__ = ["zero_redundancy", "ZeroRedundancyState"]


class _Entered(NamedTuple):
    """The zero view of one update (see :func:`zero_redundancy`'s step 1): gradients and
    parameters (DTensors sharded over the data axis), the descriptor with the data axis
    reduced, the updates' treedef, the parameter leaves (or ``None``), the leaves whose layout
    the results take, each leaf's :class:`_View`, and the data axis' group."""

    grads: Any
    params: Any
    mesh: Mesh
    treedef: Any
    p: list | None
    layout: list
    views: list
    group: tuple


class ZeroRedundancyState(NamedTuple):
    """State of :func:`zero_redundancy`: the inner transform's state, built from the zero view of
    the parameters (DTensors sharded over the data axis on top of the parameters' placements)."""

    inner_state: Any


# ---------------------------------------------------------------------------------------------
# per-rank helpers (a plain call on a real process group, one call per rank under simulation)
# ---------------------------------------------------------------------------------------------
def _chunk(n: int, parts: int, j: int) -> tuple[int, int]:
    """``(offset, size)`` of chunk ``j`` of a dim of size ``n`` split in ``parts`` (torch.chunk)."""
    cs = -(-n // parts) if parts else 0
    start = min(j * cs, n)
    return start, max(0, min(n, start + cs) - start)


@dataclasses.dataclass(frozen=True)
class _View:
    """Where one leaf lives in the zero view.

    ``dim``: the tensor dim sharded over the data axis (``None``: the leaf is left as it is,
    because it is already sharded over the data axis, or no dim is free); ``spec``: the zero
    view's layout; ``size``: the leaf's (local, = global) size along ``dim``; ``coord``: global
    rank -> coordinate along the data axis."""

    dim: int | None
    spec: Spec | None
    size: int = 0
    parts: int = 1
    coord: dict | None = None

    def chunk(self, rank: int) -> tuple[int, int]:
        return _chunk(self.size, self.parts, self.coord[rank])

    def slice(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a full (along ``dim``) local tensor; no communication."""
        if self.dim is None:
            return local
        d = self.dim
        return per_rank([local], lambda r, t: t[0].narrow(d, *self.chunk(r)).contiguous())


def _root_of(mesh: Mesh | None, leaves: Sequence[Any], device_mesh: DeviceMesh | None):
    if mesh is not None and mesh.device_mesh is not None:
        return mesh.device_mesh
    for x in leaves:
        if isinstance(x, DTensor):
            return x.device_mesh._get_root_mesh()
    return device_mesh


def _views(leaves: Sequence[Any], paths: Sequence[str], root: DeviceMesh | None, axis: str) -> list:
    """The zero view of each leaf (``None`` for ``None`` leaves)."""
    if root is None:
        return [None if x is None else _View(None, spec_of(x)) for x in leaves]
    names = tuple(root.mesh_dim_names or ())
    if axis not in names:
        raise ValueError(
            f"zero_redundancy: axis={axis!r} is not a dim of the device mesh (dims: {names})"
        )
    a = names.index(axis)
    parts = root.size(a)
    coord = {r: c[a] for r, c in mesh_coordinates(root).items()}  # rank -> index along axis
    out = []
    for x, path in zip(leaves, paths):
        if x is None:
            out.append(None)
            continue
        if isinstance(x, DTensor):
            m = x.device_mesh
            lnames = tuple(m.mesh_dim_names or ())
            if m._get_root_mesh() is not root and m is not root and not set(lnames) <= set(names):
                raise ValueError(
                    f"zero_redundancy: leaf '{path}' is a DTensor on {m}, which is "
                    f"not part of the mesh {root}"
                )
            by_name = dict(zip(lnames, x.placements))
            if isinstance(by_name.get(axis), Shard):  # already sharded over the data axis (FSDP)
                out.append(_View(None, spec_of(x)))
                continue
            taken = {p.dim % x.ndim for p in x.placements if isinstance(p, Shard)}
        else:
            by_name, taken = {}, set()
        free = [d for d in range(x.ndim) if d not in taken and x.shape[d] > 1]
        if not free or parts == 1:
            out.append(_View(None, spec_of(x)))
            continue
        big = [d for d in free if x.shape[d] >= parts]
        dim = big[0] if big else max(free, key=lambda d: x.shape[d])
        vnames = tuple(n for n in names if n in by_name or n == axis)
        vmesh = root if len(vnames) == root.ndim else root[vnames]
        placements = tuple(Shard(dim) if n == axis else by_name[n] for n in vnames)
        stride = tuple(x.stride()) if isinstance(x, DTensor) else contiguous_stride(x.shape)
        out.append(_View(dim, Spec(vmesh, placements, x.shape, stride), x.shape[dim], parts, coord))
    return out


def _rest(shape, dim: int) -> tuple:
    return tuple(shape[:dim]) + tuple(shape[dim + 1 :])


def _enter(
    locals_: Sequence[torch.Tensor], views: Sequence[_View], ops: Sequence[str], group
) -> list:
    """Reduce-scatter full local tensors into their chunks: ONE collective per (op, dtype).

    Local shapes may differ between tensor parallel ranks (uneven shards), never between the
    ranks of one data parallel group, so buffers are built and split rank by rank."""
    out: list = [None] * len(locals_)
    buckets: dict = {}
    for i, (t, op) in enumerate(zip(locals_, ops)):
        buckets.setdefault((op, t.dtype), []).append(i)
    for (op, _), idx in buckets.items():
        vs = [views[i] for i in idx]

        def pack(r, ts, vs=vs):
            rows = []
            for t, v in zip(ts, vs):
                cs = -(-v.size // v.parts)
                x = t.movedim(v.dim, 0)
                pad = v.parts * cs - v.size
                if pad:
                    x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
                rows.append(x.reshape(v.parts, -1))
            return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)).reshape(-1)

        ts = [locals_[i] for i in idx]
        buf = per_rank(ts, pack)
        red = reduce_scatter(buf, op, group)
        for k, i in enumerate(idx):

            def take(r, xs, k=k, vs=vs):
                f, ts_r = xs[0], xs[1:]
                offset = 0
                for t, v in zip(ts_r[:k], vs[:k]):
                    offset += -(-v.size // v.parts) * math.prod(_rest(t.shape, v.dim))
                v = vs[k]
                rest = _rest(ts_r[k].shape, v.dim)
                _, n = v.chunk(r)
                piece = f[offset : offset + n * math.prod(rest)]
                return piece.reshape(n, *rest).movedim(0, v.dim).contiguous()

            out[i] = per_rank([red] + ts[: k + 1], take)
    return out


def _leave(
    chunks: Sequence[torch.Tensor],
    views: Sequence[_View],
    group,
    into: Sequence[torch.Tensor] | None = None,
) -> list:
    """All-gather chunks back into full local tensors: ONE collective per dtype. With
    ``into`` (full local tensors, one per chunk; on a real process group, eagerly), each
    rank's part is copied from the gathered buffer into them (one copy, no whole-leaf
    temporary) and they are returned."""
    from torch.distributed import _local_tensor as lt

    if into is not None and (
        lt.enabled_local_tensor_mode() is not None or torch.compiler.is_compiling()
    ):
        got = _leave(chunks, views, group)
        for d, x in zip(into, got):
            d.copy_(x)
        return list(into)
    out: list = [None] * len(chunks)
    buckets: dict = {}
    for i, t in enumerate(chunks):
        buckets.setdefault(t.dtype, []).append(i)
    for _, idx in buckets.items():
        vs = [views[i] for i in idx]
        ts = [chunks[i] for i in idx]

        def pack(r, cs_, vs=vs):
            flats = []
            for c, v in zip(cs_, vs):
                width = -(-v.size // v.parts) * math.prod(_rest(c.shape, v.dim))
                f = c.movedim(v.dim, 0).reshape(-1)
                flats.append(
                    torch.cat([f, f.new_zeros(width - f.numel())]) if f.numel() < width else f
                )
            return flats[0] if len(flats) == 1 else torch.cat(flats)

        buf = per_rank(ts, pack)
        parts = vs[0].parts
        full = all_gather(buf, group)

        def unpack(r, xs, vs=vs):
            """Every leaf of the bucket from the gathered buffer (offsets in one pass)."""
            return [
                src.reshape(parts * src.shape[1], *src.shape[2:])[: v.size].movedim(0, v.dim)
                for src, v in _gathered(xs[0], xs[1:], vs, parts)
            ]

        if into is not None:  # (every rank's rows copied where they go)
            for i, (src, v) in zip(idx, _gathered(full, ts, vs, parts)):
                dst = into[i].movedim(v.dim, 0)
                cs = src.shape[1]
                for r in range(parts):
                    n = max(0, min(v.size, (r + 1) * cs) - r * cs)
                    if n:
                        dst.narrow(0, r * cs, n).copy_(src[r, :n])
                out[i] = into[i]
            continue
        for k, x in enumerate(_per_rank_list([full, *ts], unpack, len(idx))):
            out[idx[k]] = x.contiguous()
    return out


def _gathered(full: torch.Tensor, chunks: Sequence[torch.Tensor], views: Sequence[_View], parts):
    """Per leaf of an all-gathered bucket (the ranks' packed chunks, rank after rank): its
    rows from every rank, a ``(parts, chunk rows, *other dims)`` view of ``full``, and its
    :class:`_View`."""
    f = full.view(parts, -1)
    offset = 0
    for c, v in zip(chunks, views):
        rest = _rest(c.shape, v.dim)
        cs = -(-v.size // v.parts)
        width = cs * math.prod(rest)
        yield f[:, offset : offset + width].view(parts, cs, *rest), v
        offset += width


def _per_rank_list(tensors: Sequence[torch.Tensor], fn, n: int) -> list:
    """:func:`~functional_train.engine.collectives.per_rank` of an ``fn`` that returns a list
    of ``n`` tensors: one call per rank for all of them (simulated ranks: a LocalTensor
    each)."""
    from torch.distributed import _local_tensor as lt

    if lt.enabled_local_tensor_mode() is None:
        return per_rank(tensors, lambda r, xs: fn(r, xs))  # (a list: per_rank passes it on)
    return [per_rank(tensors, lambda r, xs, k=k: fn(r, xs)[k]) for k in range(n)]


def zero_redundancy(
    inner: GradientTransformation, axis: str = "dp", *, device_mesh: DeviceMesh | None = None
) -> GradientTransformation:
    """ZeRO-1/2 for any inner transform: its state sharded over the data parallel mesh dim.

    Every leaf is given a *zero view*: its own placements (tensor parallel ``Shard`` /
    ``Replicate`` on the mesh dims it lives on) plus ``Shard(d)`` over ``axis`` on the first
    tensor dim ``d`` that no other mesh dim shards and whose size is at least the data parallel
    size (else the largest such dim); uneven sizes follow ``torch.chunk``, as DTensor does.
    Leaves already sharded over ``axis`` (FSDP / ZeRO-3 parameters) keep their placements, and
    leaves with no free dim of size > 1 (a 0-dim scale, a bias already split by tensor
    parallelism) stay whole over ``axis``: their state is replicated there.

    Per update:

    1. gradients still unreduced over ``axis`` (plain tensors and DTensors without ``axis``
       when ``Mesh.data_axis == axis`` or when ``update`` is given no ``mesh`` -- then the
       gradients are each rank's own, as in ZeRO-2; a ``Mesh`` without that data axis says
       they are reduced already; ``Partial`` over ``axis``) are averaged (``Partial``:
       reduced as it says) AND scattered into the zero view by ONE bucketed reduce-scatter per
       (op, dtype) over ``axis``; reduced gradients are sliced locally (no communication);
       ``Partial`` placements over other dims are reduced first, as every transform does;
    2. ``inner`` runs on the zero views of gradients and parameters with a descriptor whose
       data axis is reduced, so its state (``inner.init`` of the zero view of the parameters)
       holds 1/dp of each leaf per rank as DTensors with the global shapes, and its statistics
       are those of the global tensors (sharded == unsharded);
    3. the updates are all-gathered back into the parameters' placements by ONE bucketed
       all-gather per dtype over ``axis``.

    Leaves that stay whole over ``axis`` are averaged by one bucketed all-reduce instead. With
    one process, or no mesh with ``axis``, this is ``inner`` (numbers are the same).

    Args:
        inner: any transform (``adamw``, ``adafactor``, ``chain(clip_by_global_norm, ...)``).
        axis: name of the data parallel mesh dim (default ``"dp"``).
        device_mesh: the whole device mesh; needed only when no parameter is a DTensor (pure
            data parallelism on plain tensors), otherwise the parameters' root mesh is used.

    State: :class:`ZeroRedundancyState` holding ``inner``'s state over the zero view.

    Raises:
        TypeError: ``inner`` is not a GradientTransformation.
        ValueError: ``axis`` is not a dim of the mesh; at update, a state from another
            transform, or a ``mesh`` with ``axis`` when no parameter is a DTensor and
            ``device_mesh`` was not given (``init`` could not have sharded the state).
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"zero_redundancy: inner must be a GradientTransformation, got {type(inner).__name__}"
        )
    if not isinstance(axis, str):
        raise TypeError(f"zero_redundancy: axis must be a mesh dim name (str), got {axis!r}")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"zero_redundancy: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}"
        )

    def view_tree(tree, views):
        leaves, treedef = tree_flatten(tree)
        return tree_unflatten(
            treedef,
            [
                None if x is None else wrap(v.slice(to_local(x)), v.spec)
                for x, v in zip(leaves, views)
            ],
        )

    def init_fn(params):
        leaves = leaves_of(params)
        root = _root_of(None, leaves, device_mesh)
        views = _views(leaves, leaf_paths(params), root, axis)
        return ZeroRedundancyState(inner.init(view_tree(params, views)))

    own_mesh: dict = {}

    def check(state, mesh):
        if not isinstance(state, ZeroRedundancyState):
            raise ValueError(
                f"zero_redundancy: expected a ZeroRedundancyState from "
                f"zero_redundancy.init, got {type(state).__name__}"
            )
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(
                f"zero_redundancy: mesh must be a functional_train.Mesh or None, "
                f"got {type(mesh).__name__}"
            )

    def enter(updates, params, mesh) -> _Entered | None:
        """Step 1: the gradients and parameters in the zero view (``None``: no zero view, one
        rank over ``axis`` or no mesh: ``inner`` runs on the trees as they are)."""
        g, treedef = tree_flatten(updates)
        p = None if params is None else flatten_as(params, treedef, "params", "the updates")
        paths = leaf_paths(updates)
        root = _root_of(mesh, list(p or []) + list(g), device_mesh)
        if root is not None and axis not in (root.mesh_dim_names or ()):
            _views([], [], root, axis)  # raises: the mesh has no such dim
        if (
            root is not None
            and device_mesh is None
            and root.size(root.mesh_dim_names.index(axis)) > 1
            and not any(isinstance(x, DTensor) for x in list(p or []) + list(g))
        ):
            raise ValueError(
                "zero_redundancy: no parameter is a DTensor, so init could not see the device "
                f"mesh and built the inner state on whole leaves; pass the mesh at construction: "
                f"zero_redundancy(inner, axis={axis!r}, device_mesh=...)"
            )
        if root is None or root.size(root.mesh_dim_names.index(axis)) == 1:
            return None
        if mesh is None:
            # no descriptor: the gradients are each rank's own over the declared axis (ZeRO-2
            # reduce-scatters them), never taken as replicated -- slicing gradients that differ
            # per rank would stitch rows of different ranks; one descriptor per root mesh
            hit = own_mesh.get(id(root))
            if hit is None or hit[0] is not root:
                hit = own_mesh[id(root)] = (root, Mesh(root, data_axis=axis))
            mesh = hit[1]
        elif mesh.device_mesh is None:
            mesh = Mesh(root, data_axis=mesh.data_axis)
        a = root.mesh_dim_names.index(axis)
        pending = mesh.data_axis == axis and root.size(a) > 1
        if pending and not torch.compiler.is_compiling():
            # ranks may differ in which gradients are None: agree first (one small all-reduce)
            g = agree_presence(g, p, treedef, mesh)
        if pending and mesh.expert_data:
            # the expert axis is data parallel too: its mean first (one all-reduce; the
            # layout's cached plan says which leaves), the reduce-scatter over the data axis below
            plan = plan_for(treedef, g, p, mesh)
            ep = mesh.dim(mesh.expert_axis)
            g = data_mean(g, [r for r in plan.data_rounds if r[0] == ep], plan.expert_scale)
        # which gradients are still each rank's own contribution over the data axis, and how
        # they add up; Partial-over-axis leaves are relabelled Replicate until step 1
        ops: list = [None] * len(g)
        g = list(g)
        for i, x in enumerate(g):
            if x is None:
                continue
            if isinstance(x, DTensor):
                lnames = tuple(x.device_mesh.mesh_dim_names or ())
                if axis in lnames:
                    j = lnames.index(axis)
                    pl = x.placements[j]
                    if isinstance(pl, Partial):
                        s = spec_of(x)
                        new_pl = list(s.placements)
                        new_pl[j] = Replicate()
                        g[i] = wrap(to_local(x), dataclasses.replace(s, placements=tuple(new_pl)))
                        ops[i] = pl.reduce_op
                    continue
            if pending:
                ops[i] = "avg"
        # the descriptor once the data axis is reduced (one object per descriptor: the plans
        # of the inner transform's calls are cached by it)
        rest = mesh.reduced() if mesh.data_axis == axis else mesh
        g = plan_for(treedef, g, p, rest).materialize(g, p)
        layout = p if p is not None else g
        views = _views(layout, paths, root, axis)
        group = (root, a)
        # 1. into the zero view
        locs = [to_local(x) for x in g]
        sc = [i for i, x in enumerate(g) if x is not None and ops[i] and views[i].dim is not None]
        whole = [i for i, x in enumerate(g) if x is not None and ops[i] and views[i].dim is None]
        zg: list = [None] * len(g)
        for i, r in zip(
            sc, _enter([locs[i] for i in sc], [views[i] for i in sc], [ops[i] for i in sc], group)
        ):
            zg[i] = r
        red = all_reduce_buckets([(locs[i], (group,), ops[i]) for i in whole])
        for i, r in zip(whole, red):
            zg[i] = r
        for i, x in enumerate(g):
            if x is not None and not ops[i]:
                zg[i] = views[i].slice(locs[i])
        zgrads = tree_unflatten(
            treedef, [None if z is None else wrap(z, v.spec) for z, v in zip(zg, views)]
        )
        zparams = None if params is None else view_tree(params, views)
        return _Entered(zgrads, zparams, rest, treedef, p, layout, views, group)

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        check(state, mesh)
        z = enter(updates, params, mesh)
        if z is None:
            new, inner_state = inner.update(updates, state.inner_state, params, mesh=mesh, **extra)
            return new, ZeroRedundancyState(inner_state)
        # 2. the inner transform on the shards
        new, inner_state = inner.update(z.grads, state.inner_state, z.params, mesh=z.mesh, **extra)
        # 3. out of the zero view
        nl = flatten_as(new, z.treedef, "zero_redundancy's inner updates", "the updates")
        out = [to_local(x) for x in nl]
        ga = [i for i, x in enumerate(nl) if x is not None and z.views[i].dim is not None]
        for i, r in zip(ga, _leave([out[i] for i in ga], [z.views[i] for i in ga], z.group)):
            out[i] = r
        specs = [None if x is None else spec_of(x) for x in z.layout]
        return tree_unflatten(
            z.treedef, [None if o is None else wrap(o, s) for o, s in zip(out, specs)]
        ), ZeroRedundancyState(inner_state)

    def step(grads, state, params, mesh, donate, extra, inner_step):
        """``ft.step`` of this transform: the inner's step (``inner_step``, ``ft.step``'s own,
        fused where the inner is) on the zero view of the parameters, then the new parameter
        chunks all-gathered into whole leaves (ONE bucketed all-gather per dtype, as the
        updates otherwise), with no pass of ``p + u`` over whole leaves: donated, the inner
        step writes its rows of every leaf in place (a dim-0 zero view is a view of the
        parameter) and the gathered leaves are copied over the parameters."""
        check(state, mesh)
        z = enter(grads, params, mesh)
        if z is None:
            new_p, inner_state = inner_step(
                inner, grads, state.inner_state, params, mesh, donate, extra
            )
            return new_p, ZeroRedundancyState(inner_state)
        new_zp, inner_state = inner_step(
            inner, z.grads, state.inner_state, z.params, z.mesh, donate, extra
        )
        nz = flatten_as(new_zp, z.treedef, "zero_redundancy's inner parameters", "the params")
        gl = leaves_of(z.grads)
        pl = list(z.p)
        active = [i for i, x in enumerate(gl) if x is not None]
        ga = [i for i in active if z.views[i].dim is not None]
        out = list(pl)
        with torch.no_grad():
            chunks = [to_local(nz[i]) for i in ga]
            # (donated: gathered straight into the parameters' memory)
            into = [to_local(pl[i]) for i in ga] if donate else None
            full = dict(zip(ga, _leave(chunks, [z.views[i] for i in ga], z.group, into)))
            for i in active:
                new = full.get(i)
                if new is None:  # (a leaf whole in the zero view: the inner's result itself)
                    new = to_local(nz[i])
                if donate:
                    local = to_local(pl[i])
                    if new is not local:
                        local.copy_(new)
                else:
                    out[i] = requires_grad_like(wrap_like(new, pl[i]), pl[i])
        if donate:
            return params, ZeroRedundancyState(inner_state)
        return tree_unflatten(z.treedef, out), ZeroRedundancyState(inner_state)

    attach_spec(update_fn, zero=step)
    return GradientTransformation(init_fn, declare(update_fn, unreduced=True))
