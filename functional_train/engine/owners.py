"""A whole-tensor function of many DTensor leaves run ONCE per leaf, on an owner rank, with one
batched all-to-all each way (for Muon's Newton-Schulz orthogonalisation).

Every leaf of a mesh is given an owner: a rank of that mesh, chosen by a greedy longest-first
balance of the leaves' costs (Graham's LPT rule), so each rank computes about ``1/N`` of the
total. The blocks of each leaf travel to its owner, which assembles the global tensor, applies
the function and sends every rank its block of the result back:

* on a 1-D mesh, and on a mesh of more dims that is the whole world (ranks in mesh order): ONE
  ``all_to_all_single`` to the owners, carrying every holder's block of every sharded leaf
  (of a leaf replicated over some mesh dims, only the replica on the owner's coordinates
  sends; a fully replicated leaf needs no gather), and ONE back, carrying every rank its block
  of every result.
* on a sub-mesh of more dims (a (dp, tp) mesh under a pipeline axis), one all-to-all per mesh
  dim instead: to the owners one per dim that shards some leaf (in mesh order); back, the
  sharding dims' scatters from last to first, then the replicating dims' broadcasts from first
  to last, the two passes over dim 0 merged (at most ``2 ndim - 1``).

Never more with more leaves. Each message holds whole blocks laid out one after the other;
the all-to-all's blocks are padded to the longest message. Blocks are copied, never computed
on, so the function sees the global tensor bit for bit and its result is the one-process result.

The routing is a pure function of the layout (mesh shape, each leaf's global shape, placements
and cost): it is simulated once for every rank (that is how the padded message sizes are known
everywhere without communication) and cached. Rank-dependent packing runs once per simulated
rank under ``LocalTensorMode`` (:func:`~functional_train.engine.collectives.per_rank`).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from .collectives import all_to_all
from .layout import shard_region
from .whole import per_rank

__all__ = ["OwnerPlan", "owner_plan", "run_at_owners"]

_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 64


def cache_clear() -> None:
    """Forget every cached routing."""
    _PLANS.clear()


class _Phase:
    """One all-to-all: over mesh dim ``dim``, blocks of ``length`` elements per peer.

    ``sends[c]``: for rank coordinate ``c``, per peer index, the ``(source, offset, numel)``
    pieces it sends (in order); the received buffer becomes source ``buffer`` on every rank."""

    __slots__ = ("dim", "length", "sends", "buffer")

    def __init__(self, dim, length, sends, buffer):
        self.dim, self.length, self.sends, self.buffer = dim, length, sends, buffer


class OwnerPlan:
    """The routing of one layout (see the module docstring).

    Attributes:
        mesh_shape: the mesh's shape.
        owners: per leaf, the owner's mesh coordinate.
        flops: per rank coordinate, the summed costs of the leaves it owns.
        sent: per rank coordinate, elements it sends to other ranks (padding included), both
            directions together.
        held: per rank coordinate, elements of the leaves' blocks it holds (its share).
    """

    def __init__(
        self,
        mesh_shape: Sequence[int],
        shapes: Sequence[tuple],
        placements: Sequence[tuple],
        costs: Sequence[float],
        flat: bool = False,
    ):
        self.mesh_shape = tuple(int(s) for s in mesh_shape)
        self.flat = flat
        n = self.mesh_shape
        k, m = len(n), len(shapes)
        coords = list(itertools.product(*[range(s) for s in n]))
        self.coords = coords
        # per leaf: its sharding and replicating dims (size-1 dims take no part)
        sdims = [[d for d in range(k) if n[d] > 1 and isinstance(p[d], Shard)] for p in placements]
        rdims = [
            [d for d in range(k) if n[d] > 1 and not isinstance(p[d], Shard)] for p in placements
        ]
        self.shapes, self.placements = [tuple(s) for s in shapes], list(placements)
        self._sdims = sdims

        block = self.block
        numel = {}

        def size(j, key):
            hit = numel.get((j, key))
            if hit is None:
                hit = numel[(j, key)] = math.prod(block(j, key)[1])
            return hit

        # owners: longest first onto the least loaded rank (ties: first in mesh order)
        load = [0.0] * len(coords)
        owners: list = [None] * m
        for j in sorted(range(m), key=lambda j: (-costs[j], j)):
            r = min(range(len(coords)), key=lambda r: (load[r], r))
            load[r] += costs[j]
            owners[j] = coords[r]
        self.owners = owners
        self.flops = dict(zip(coords, load))
        self.held = {
            c: sum(size(j, tuple(c[d] for d in sdims[j])) for j in range(m)) for c in coords
        }
        sent = dict.fromkeys(coords, 0)

        # held[c][j]: list of pieces (key, source, offset, numel); sources 0..m-1: the locals
        held = {c: {} for c in coords}
        for c in coords:
            for j in range(m):
                if all(c[d] == owners[j][d] for d in rdims[j]):
                    key = tuple(c[d] for d in sdims[j])
                    held[c][j] = [(key, j, 0, size(j, key))]
        n_sources = m
        phases_in, phases_out = [], []

        def group_of(c, dim):  # the ranks of c's group in a phase over dim, in peer order
            if dim is None:  # the whole mesh (the world, ranks in mesh order)
                return coords
            return [c[:dim] + (q,) + c[dim + 1 :] for q in range(n[dim])]

        def run_phase(dim, route, out_list):
            """One all-to-all over mesh dim ``dim`` (``None``: over the whole mesh), none when
            no rank sends anything: ``route(c, j, pieces)`` gives, for rank ``c``'s pieces of
            leaf ``j``, ``None`` (not taking part: kept) or ``(kept, {peer coordinate: pieces
            sent there})``."""
            nonlocal n_sources
            msgs = {c: defaultdict(list) for c in coords}
            new_held = {c: {} for c in coords}
            for c in coords:
                for j, pieces in held[c].items():
                    r = route(c, j, pieces)
                    if r is None:
                        new_held[c][j] = pieces
                        continue
                    kept, out = r
                    if kept:
                        new_held[c].setdefault(j, []).extend(kept)
                    for q, ps in out.items():
                        msgs[c][q].extend((j, p) for p in ps)
            length = max(
                (sum(p[3] for _, p in ps) for c in coords for ps in msgs[c].values()), default=0
            )
            if length == 0:  # nothing to move: the empty pieces reach their owners as they are
                for c in coords:
                    for dst, ps in msgs[c].items():
                        for j, piece in ps:
                            new_held[dst].setdefault(j, []).append(piece)
                held.update(new_held)
                return
            buf = n_sources
            n_sources += 1
            sends = {}
            for c in coords:
                group = group_of(c, dim)
                sends[c] = [[(p[1], p[2], p[3]) for _, p in msgs[c].get(q, ())] for q in group]
                sent[c] += (len(group) - 1) * length
                me = group.index(c)
                for dst, ps in msgs[c].items():  # the receiver's copy of each piece
                    off = me * length
                    for j, (key, _, _, cnt) in ps:
                        new_held[dst].setdefault(j, []).append((key, buf, off, cnt))
                        off += cnt
            held.clear()
            held.update(new_held)
            out_list.append(_Phase(dim, length, sends, buf))

        def at(c, d, q):
            return c[:d] + (q,) + c[d + 1 :]

        # -- to the owners ------------------------------------------------------------------
        if flat:  # every holder straight to the owner

            def gather_all(c, j, pieces):
                if not sdims[j]:
                    return None
                return (pieces, {}) if owners[j] == c else ([], {owners[j]: pieces})

            run_phase(None, gather_all, phases_in)
        for d in [] if flat else range(k):

            def gather(c, j, pieces, d=d):
                if d not in sdims[j]:
                    return None
                q = owners[j][d]
                return (pieces, {}) if q == c[d] else ([], {at(c, d, q): pieces})

            run_phase(d, gather, phases_in)
        self.phases_in = phases_in

        # -- the owners' results ------------------------------------------------------------
        self.result_source = n_sources
        n_sources += 1
        # per rank: (leaf, its pieces [((starts, lens), source, offset, numel)], its result's blocks
        # [(starts, lens)] in the order they are laid out)
        self.computed = {c: [] for c in coords}
        result_len = {}
        for c in coords:
            off = 0
            for j in range(m):
                if owners[j] != c:
                    if j in held[c]:
                        raise AssertionError("owner routing: a non-owner holds a gathered leaf")
                    continue
                keys = list(itertools.product(*[range(n[d]) for d in sdims[j]]))
                got = {p[0] for p in held[c][j]}
                if got != set(keys):
                    raise AssertionError("owner routing: an owner misses blocks of its leaf")
                placed = []
                for key in keys:
                    placed.append((key, off))
                    off += size(j, key)
                self.computed[c].append(
                    (
                        j,
                        [(block(j, key), src, o, cnt) for key, src, o, cnt in held[c][j]],
                        [block(j, key) for key, _ in placed],
                    )
                )
                held[c][j] = [(key, self.result_source, o, size(j, key)) for key, o in placed]
            result_len[c] = off
        self.result_length = max(result_len.values(), default=0)

        # -- back to every rank ---------------------------------------------------------------
        if flat:  # the owner straight to every rank: its block

            def back_all(c, j, pieces):
                kept, out = [], defaultdict(list)
                by_key = {p[0]: p for p in pieces}
                for r in coords:
                    p = by_key[tuple(r[d] for d in sdims[j])]
                    (kept if r == c else out[r]).append(p)
                return kept, out

            run_phase(None, back_all, phases_out)
        order = (
            []
            if flat
            else [(d, "scatter") for d in range(k - 1, 0, -1)]
            + [(0, "both")]
            + [(d, "broadcast") for d in range(1, k)]
        )
        for d, kind in order:

            def back(c, j, pieces, d=d, kind=kind):
                if d in sdims[j] and kind in ("scatter", "both"):
                    pos = sdims[j].index(d)
                    kept, out = [], defaultdict(list)
                    for p in pieces:
                        q = p[0][pos]
                        (kept if q == c[d] else out[at(c, d, q)]).append(p)
                    return kept, out
                if d in rdims[j] and kind in ("broadcast", "both"):
                    return pieces, {at(c, d, q): pieces for q in range(n[d]) if q != c[d]}
                return None

            run_phase(d, back, phases_out)
        self.phases_out = phases_out

        self.final = {}
        for c in coords:
            locs = []
            for j in range(m):
                key = tuple(c[d] for d in sdims[j])
                ps = held[c].get(j, [])
                if len(ps) != 1 or ps[0][0] != key:
                    raise AssertionError("owner routing: a rank misses its block of a result")
                locs.append(ps[0][1:])
            self.final[c] = locs
        self.sent = sent
        self.n_sources = n_sources

    def block(self, j: int, key: tuple) -> tuple:
        """``(starts, lens)`` of leaf ``j``'s block at ``key`` (coordinates on its sharding
        dims)."""
        full = [0] * len(self.mesh_shape)
        for d, c in zip(self._sdims[j], key):
            full[d] = c
        return shard_region(self.shapes[j], self.placements[j], self.mesh_shape, full)

    @property
    def collectives(self) -> int:
        """All-to-alls per call (both directions)."""
        return len(self.phases_in) + len(self.phases_out)


def owner_plan(
    mesh_shape: Sequence[int],
    shapes: Sequence[tuple],
    placements: Sequence[tuple],
    costs: Sequence[float],
    flat: bool = False,
) -> OwnerPlan:
    """The (cached) :class:`OwnerPlan` of a layout (``flat``: one all-to-all over the whole
    mesh each way, for a mesh that is the world in rank order)."""
    code = tuple(
        tuple(p.dim % len(s) if isinstance(p, Shard) else None for p in pl)
        for s, pl in zip(shapes, placements)
    )
    return _plan_of(
        tuple(int(n) for n in mesh_shape),
        tuple(tuple(int(n) for n in s) for s in shapes),
        code,
        tuple(float(c) for c in costs),
        bool(flat),
    )


def assume_constant_result(fn):
    """``torch._dynamo.assume_constant_result`` (under torch.compile, ``fn``'s result is built
    at trace time and is a constant of the graph) without importing ``torch._dynamo`` when
    this library is imported (0.4 s of every process's start): that decorator only sets this
    attribute, which dynamo reads when it traces a call (``tests/test_compile.py`` checks that
    they agree)."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def _plan_of(mesh_shape: tuple, shapes: tuple, code: tuple, costs: tuple, flat: bool) -> OwnerPlan:
    key = (mesh_shape, shapes, code, costs, flat)
    hit = _PLANS.get(key)
    if hit is None:
        placements = [tuple(Replicate() if d is None else Shard(d) for d in c) for c in code]
        hit = OwnerPlan(mesh_shape, shapes, placements, costs, flat)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.popitem(last=False)
        _PLANS[key] = hit
    return hit


def _is_world(mesh) -> bool:
    """A mesh of 2 or more dims that is the world, its ranks in mesh order: one all-to-all over
    the world serves it (not under torch.compile, which cannot read the mesh's rank layout:
    there one all-to-all per mesh dim)."""
    if mesh.ndim < 2 or torch.compiler.is_compiling() or not dist.is_initialized():
        return False
    size = mesh.size()
    return size == dist.get_world_size() and mesh.mesh.reshape(-1).tolist() == list(range(size))


def run_at_owners(
    specs: Sequence,
    values: Sequence[torch.Tensor],
    fn: Callable[[int, torch.Tensor], torch.Tensor],
    out_dtype: torch.dtype,
    costs: Sequence[float],
) -> list:
    """This rank's blocks of ``fn(j, global tensor of leaf j)`` for DTensor leaves on ONE mesh.

    Args:
        specs: per leaf, its :class:`~functional_train.engine.dtensor.Spec` (all on one mesh).
        values: per leaf, this rank's local block (laid out as the spec says; one dtype).
        fn: ``(j, global tensor) -> tensor`` of the same shape in ``out_dtype``; called once per
            leaf, on its owner rank only.
        out_dtype: dtype of ``fn``'s results.
        costs: per leaf, its relative cost (the owners balance their sums).

    Returns:
        per leaf, this rank's block of the result (``out_dtype``, the local shape of
        ``values[j]``). Collectives: the plan's all-to-alls (module docstring).
    """
    mesh = specs[0].mesh
    flat = _is_world(mesh)
    plan = owner_plan(
        tuple(int(s) for s in mesh.shape),
        [tuple(s.shape) for s in specs],
        [tuple(s.placements) for s in specs],
        costs,
        flat,
    )
    coord = list(mesh.get_coordinate())
    sources = list(values)

    def group(ph):
        return dist.group.WORLD if ph.dim is None else (mesh, ph.dim)

    for ph in plan.phases_in:
        sources.append(all_to_all(_pack(sources, coord, ph, values[0].dtype), group(ph)))
    sources.append(_compute(sources, coord, plan, specs, fn, out_dtype))
    for ph in plan.phases_out:
        sources.append(all_to_all(_pack(sources, coord, ph, out_dtype), group(ph)))
    return [_unpack(sources, coord, plan, j) for j in range(len(values))]


@per_rank
def _pack(sources: list, coord: list, ph: _Phase, dtype: torch.dtype) -> torch.Tensor:
    """One rank's all-to-all input: per peer its pieces one after the other, zero-padded."""
    parts = []
    device = sources[0].device
    for pieces in ph.sends[tuple(coord)]:
        used = 0
        for src, off, cnt in pieces:
            parts.append(sources[src].reshape(-1)[off : off + cnt])
            used += cnt
        if used < ph.length:
            parts.append(torch.zeros(ph.length - used, dtype=dtype, device=device))
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


@per_rank
def _compute(sources: list, coord: list, plan: OwnerPlan, specs, fn, out_dtype) -> torch.Tensor:
    """The owner's results: each owned leaf assembled, ``fn`` applied, cut into blocks (the
    plan is a constant under torch.compile: only its data is read here, no method called)."""
    parts, used = [], 0
    for j, pieces, placed in plan.computed[tuple(coord)]:
        full = sources[0].new_empty(tuple(specs[j].shape))
        for (st, ln), src, off, cnt in pieces:
            if cnt:
                full[tuple(slice(a, a + b) for a, b in zip(st, ln))] = (
                    sources[src].reshape(-1)[off : off + cnt].view(ln)
                )
        res = fn(j, full)
        for st, ln in placed:
            parts.append(res[tuple(slice(a, a + b) for a, b in zip(st, ln))].reshape(-1))
            used += parts[-1].numel()
    if used < plan.result_length or not parts:
        parts.append(
            torch.zeros(plan.result_length - used, dtype=out_dtype, device=sources[0].device)
        )
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@per_rank
def _unpack(sources: list, coord: list, plan: OwnerPlan, j: int) -> torch.Tensor:
    src, off, cnt = plan.final[tuple(coord)][j]
    return sources[src].reshape(-1)[off : off + cnt].view(sources[j].shape)
