"""Every collective the library issues, through ``torch.distributed._functional_collectives``
(traceable by torch.compile; eager all-reduces through c10d, see :func:`all_reduce`), batched:
the tensors of one kind for all leaves are flattened into one buffer and reduced by one
collective per process group, op and dtype. An all-reduce can be issued now and waited for
later (:func:`all_reduce_start`), so that host work overlaps it; the all-reduces started
within :func:`coalesced` are issued together, one per process group, op and dtype.

Process groups are named as tuples of groups to reduce over in succession: ``(DeviceMesh, dim)``
pairs, or the default (world) process group (see :func:`groups_over`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "groups_over",
    "all_reduce",
    "all_reduce_start",
    "coalesced",
    "all_reduce_buckets",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "per_rank",
]


def groups_over(device_mesh: DeviceMesh, dims: Collection[int]) -> tuple:
    """Functional-collective groups whose successive all-reduces reduce over the mesh dims
    ``dims``: the default (world) process group when they span every rank of the job; on real
    process groups, one cached process group of this rank's slice of the mesh along ``dims``
    (:func:`slice_group`: one all-reduce whatever the number of dims, e.g. over the dp x tp
    ranks of a pipeline stage); else (a one-process simulation, or under torch.compile, which
    cannot create groups) one ``(device_mesh, dim)`` group per dim of more than one rank (sum,
    avg, max and min compose dim by dim).

    The user's mesh is never flattened: once a mesh has a flattened child, torch 2.13
    redistributes nested uneven ``Shard`` placements on it with wrong chunk sizes (pytorch PR
    194457), and flattened meshes outlive the process group they were made on."""
    dims = sorted(dims)
    if len(dims) > 1:  # a dim of one rank reduces nothing
        dims = [d for d in dims if device_mesh.size(d) > 1] or dims[:1]
    if len(dims) == 1:
        return ((device_mesh, dims[0]),)
    size = math.prod([device_mesh.size(d) for d in dims])
    if dist.is_initialized() and size == dist.get_world_size():
        return (dist.group.WORLD,)
    if dist.is_initialized() and dist.get_backend() != "fake" and not torch.compiler.is_compiling():
        group = slice_group(device_mesh, dims)
        if group is not None:
            return (group,)
    return tuple((device_mesh, d) for d in dims)


_SLICE_BY_MESH: dict = {}  # (world group, mesh, dims) -> this rank's slice group or None
_SLICE_BY_RANKS: dict = {}  # (world group, slice ranks) -> its group


def slice_group(device_mesh: DeviceMesh, dims: Sequence[int]) -> dist.ProcessGroup | None:
    """The process group of the ranks that share this rank's coordinates on the dims of
    ``device_mesh`` other than ``dims`` (its slice along ``dims``), made on first use with
    ``dist.new_group(ranks, use_local_synchronization=True)`` (only the slice's ranks take
    part, each the first time it reduces over these dims) and cached by the slice's ranks and
    the default process group, not by the mesh object (a new mesh of the same layout reuses
    it; a new default group makes new ones). ``None`` when this rank is not in the mesh."""
    fast = (dist.group.WORLD, device_mesh, tuple(dims))
    if fast in _SLICE_BY_MESH:
        return _SLICE_BY_MESH[fast]
    ranks = device_mesh.mesh
    other = [d for d in range(ranks.ndim) if d not in dims]
    rows = ranks.permute(*other, *dims).reshape(-1, math.prod(ranks.shape[d] for d in dims))
    me = dist.get_rank()
    row = next((tuple(r) for r in rows.tolist() if me in r), None)
    group = None
    if row is not None:
        key = (dist.group.WORLD, row)  # (holding the world group: its id is not reused)
        group = _SLICE_BY_RANKS.get(key)
        if group is None:
            group = _SLICE_BY_RANKS[key] = dist.new_group(list(row), use_local_synchronization=True)
    _SLICE_BY_MESH[fast] = group
    return group


def _group_key(groups: tuple) -> Any:
    return tuple(g if isinstance(g, dist.ProcessGroup) else g[0].get_group(g[1]) for g in groups)


_C10D_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, op: str, groups: tuple) -> torch.Tensor:
    """All-reduce ``t`` over ``groups`` in succession (see :func:`groups_over`); a new tensor.

    Eagerly, a plain tensor that autograd does not track, outside any dispatch mode (simulated
    ranks, :func:`functional_train.testing.count_collectives`), is reduced by c10d's own
    ``dist.all_reduce`` on a copy: the same collective on the same process group, without the
    functional collective's dispatch and work registry (about 0.19 ms less per call on gloo, 2
    ranks: 0.24 against 0.43 ms). Under ``torch.compile``, and for ``"avg"`` (which gloo lacks),
    the functional collective."""
    return all_reduce_start(t, op, groups)()


def _by_c10d(t: torch.Tensor, op: str) -> bool:
    return op in _C10D_OPS and _eager(t)


def _eager(t: torch.Tensor) -> bool:
    """A plain tensor outside ``torch.compile``, dispatch modes (simulated ranks, collective
    counters) and autograd: a collective on it may be c10d's own, issued eagerly."""
    return (
        type(t) is torch.Tensor
        and not t.requires_grad
        and not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
    )


def _process_group(group) -> dist.ProcessGroup:
    return group if isinstance(group, dist.ProcessGroup) else group[0].get_group(group[1])


def all_reduce_start(t: torch.Tensor, op: str, groups: tuple) -> Callable[[], torch.Tensor]:
    """:func:`all_reduce`, issued now and finished later: returns ``finish``, which waits for
    the collective and returns the reduced tensor (call it exactly once, on every rank). Host
    work between the two overlaps the collective and the other ranks' lateness. With more than
    one group, all but the last reduce before this returns. The same collectives as
    :func:`all_reduce`: c10d's ``async_op=True`` eagerly, else the functional collective,
    waited on in ``finish``. Within :func:`coalesced`: registered, and issued with the
    others started there."""
    batch = None if torch.compiler.is_compiling() else _BATCH.get()
    if batch is not None and batch.results is None:
        return batch.add(t, op, groups)
    return _start_now(t, op, groups)


def _start_now(t: torch.Tensor, op: str, groups: tuple) -> Callable[[], torch.Tensor]:
    """:func:`all_reduce_start`, issued now whatever :func:`coalesced` is open."""
    if _by_c10d(t, op):
        t = t.clone(memory_format=torch.contiguous_format)
        work = None
        for g in groups:
            if work is not None:
                work.wait()
            work = dist.all_reduce(
                t,
                _C10D_OPS[op],
                async_op=True,
                group=_process_group(g),
            )

        def finish() -> torch.Tensor:
            if work is not None:
                work.wait()
            return t

        return finish
    for g in groups[:-1]:
        t = funcol.wait_tensor(funcol.all_reduce(t, op, g))
    if groups:
        t = funcol.all_reduce(t, op, groups[-1])
    return lambda: funcol.wait_tensor(t) if groups else t


_BATCH: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar(
    "functional_train_coalesced", default=None
)


@contextlib.contextmanager
def coalesced():
    """Within: :func:`all_reduce_start` registers its tensor instead of issuing; they are
    issued together when the first ``finish`` is called or on leaving, whichever comes
    first: ONE all-reduce per (process groups, op, dtype, device) of the registered
    tensors' concatenation (as :func:`all_reduce_buckets` issues them), each ``finish``
    giving its own part (a view of the reduced buffer, in its shape); those started after
    that are issued as they come. Every rank must start the same all-reduces in the same
    order, as for the collectives themselves. Several parts' global norms of one step
    become one scalar all-reduce (``Elementwise.starts``). Eagerly only: under
    ``torch.compile`` each is issued as it comes."""
    batch = _Batch()
    token = _BATCH.set(batch)
    try:
        yield
    finally:
        _BATCH.reset(token)
        batch.issue()


class _Batch:
    """The all-reduces registered within one :func:`coalesced` (see there)."""

    __slots__ = ("items", "results")

    def __init__(self):
        self.items: list = []  # (tensor, op, groups)
        self.results: list | None = None  # per item, its finish (once issued: _bucketed)

    def add(self, t: torch.Tensor, op: str, groups: tuple) -> Callable[[], torch.Tensor]:
        i = len(self.items)
        self.items.append((t, op, groups))
        return lambda: self.result(i)

    def issue(self) -> None:
        """Issue the registered all-reduces (once; the all-reduces started after it within
        the same :func:`coalesced` are issued as they come)."""
        if self.results is None:
            self.results = _bucketed(self.items)

    def result(self, i: int) -> torch.Tensor:
        self.issue()
        return self.results[i]()  # type: ignore[index]


def _bucketed(items: Sequence[tuple[torch.Tensor, str, tuple]]) -> list[Callable[[], torch.Tensor]]:
    """ONE all-reduce per (process groups, op, dtype, device) of ``items`` (``(tensor, op,
    groups)``), issued now, in the order the buckets first appear (:func:`_start_now` of the
    bucket's tensors flattened and concatenated): per item, ``finish`` giving its reduced
    value in its shape (a view of its bucket's result, waited for once)."""
    buckets: dict[Any, list[int]] = defaultdict(list)
    for i, (t, op, groups) in enumerate(items):
        buckets[(_group_key(groups), op, t.dtype, t.device)].append(i)
    out: list = [None] * len(items)
    for idx in buckets.values():
        ts = [items[i][0] for i in idx]
        _, op, groups = items[idx[0]]
        flat = ts[0].reshape(-1) if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts])
        whole = _once(_start_now(flat, op, groups))
        offset = 0
        for i, t in zip(idx, ts):
            out[i] = _part(whole, offset, t.numel(), t.shape)
            offset += t.numel()
    return out


def _once(finish: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``finish``, called once; its result given to every caller."""
    box: list = []

    def get() -> torch.Tensor:
        if not box:
            box.append(finish())
        return box[0]

    return get


def _part(whole: Callable[[], torch.Tensor], offset: int, n: int, shape) -> Callable:
    return lambda: whole().narrow(0, offset, n).view(shape)


def all_reduce_buckets(items: Sequence[tuple[torch.Tensor, Any, str]]) -> list[torch.Tensor]:
    """All-reduce many tensors with one collective per (process group, op, dtype).

    Args:
        items: ``(tensor, groups, op)`` with ``groups`` a tuple of ``(DeviceMesh, dim)`` pairs
            or process groups to reduce over in succession, and ``op`` one of ``"sum"``,
            ``"avg"``, ``"max"``, ``"min"``. Tensors may have any shape; tensors of one bucket
            must have the same number of elements on every rank of the group.

    Returns:
        the reduced tensors, in the order given (new tensors; inputs are not modified); every
        bucket issued before the first is waited for.
    """
    finishes = _bucketed([(t, op, group) for t, group, op in items])
    return [finish() for finish in finishes]


def reduce_scatter(buf: torch.Tensor, op: str, group) -> torch.Tensor:
    """Reduce-scatter a flat buffer (every rank's block laid out rank by rank along dim 0)."""
    return funcol.wait_tensor(funcol.reduce_scatter_single(buf, op, 0, group))


def all_gather(buf: torch.Tensor, group) -> torch.Tensor:
    """All-gather a buffer along dim 0 (the ranks' buffers concatenated in rank order).

    On a gloo process group, eagerly, issued as one broadcast per rank into the result (all
    in flight at once, as torch's ``ZeroRedundancyOptimizer`` broadcasts its shards): gloo's
    all-gather (a ring) took 56 ms where two broadcasts took 17 ms for 27 MB per rank on 2
    ranks of one machine (``functional_collectives``' all-gather 79 ms). Elsewhere (NCCL,
    ``torch.compile``, simulated ranks, :func:`~functional_train.testing.count_collectives`)
    the functional all-gather, one collective."""
    if _eager(buf) and buf.dim() > 0 and buf.numel() > 0:
        pg = _process_group(group)
        if dist.get_backend(pg) == "gloo":
            world = pg.size()
            out = buf.new_empty((world, *buf.shape))
            out[pg.rank()].copy_(buf)
            works = [
                dist.broadcast(out[r], group=pg, group_src=r, async_op=True) for r in range(world)
            ]
            for w in works:
                w.wait()
            return out.view(world * buf.shape[0], *buf.shape[1:])
    return funcol.wait_tensor(funcol.all_gather_single(buf, 0, group))


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
            out[r] = fn(
                r, [t._local_tensors[r] if isinstance(t, lt.LocalTensor) else t for t in tensors]
            )
    return lt.LocalTensor(out)


def all_to_all(buf: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of a flat buffer in equal blocks: block ``q`` goes to peer ``q``; the result
    holds peer ``q``'s block for this rank at block ``q``."""
    return funcol.wait_tensor(funcol.all_to_all_single(buf, None, None, group))
